"""docs/scenarios.md against the scenario loader: every key `Scenario.from_mapping` reads
is on the page and every key on the page is read; the tier and model tables list the
fields the loader reads of them; the S1 column shows s1.toml's values. The keys come
from the loader's code (its `d["key"]`, `d.get("key")` and `_flag(d, "key")`), not from
a list kept here, so a new key without a row fails."""

from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "scenarios.md"
LOADER = ROOT / "catsproto" / "sim" / "scenario.py"
S1 = ROOT / "catsproto" / "sim" / "scenarios" / "s1.toml"


def _read_keys(function: ast.AST, mapping: str) -> set[str]:
    """The string keys `function` reads from the dict named `mapping`."""
    keys = set()
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == mapping
            and isinstance(node.slice, ast.Constant)
        ):
            keys.add(node.slice.value)
        if isinstance(node, ast.Call):
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "get"
                and isinstance(f.value, ast.Name)
                and f.value.id == mapping
            ):
                keys.add(node.args[0].value)
            if isinstance(f, ast.Name) and f.id == "_flag" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Name) and arg.id == mapping:
                    keys.add(node.args[1].value)
    return keys


def loader_keys(source: str) -> tuple[set[str], set[str], set[str]]:
    """(top-level keys, tier fields, model fields) the loader reads."""
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    top = _read_keys(functions["from_mapping"], "d")
    tier = _read_keys(functions["_tiers"], "spec")
    model = _read_keys(functions["from_mapping"], "model")
    return top, tier, model


def page_rows(text: str, heading: str) -> dict[str, list[str]]:
    """The rows of the first table after `heading`: first cell's `key` -> its cells."""
    after = text.split(heading, 1)[1]
    rows: dict[str, list[str]] = {}
    started = False
    for line in after.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            found = re.fullmatch(r"`([a-z_0-9]+)`", cells[0])
            if found:
                rows[found.group(1)] = cells
        elif started:
            break
    return rows


def check(page: str, source: str, s1: dict) -> list[str]:
    """What is wrong with `page`, one line each."""
    top, tier, model = loader_keys(source)
    problems = []
    rows = page_rows(page, "## Top-level keys")
    shown = set(rows) | {"rtt_ms", "tiers", "model"} & set(re.findall(r"\[(\w+)", page))
    for key in sorted(top - shown):
        problems.append(f"{key}: read by the loader, not on the page")
    for key in sorted(set(rows) - top):
        problems.append(f"{key}: on the page, not read by the loader")
    for key, cells in rows.items():
        want = "–" if key not in s1 else _shown(s1[key])
        if cells[3] != want:
            problems.append(f"{key}: the page shows S1 {cells[3]}, s1.toml has {want}")
    tier_rows = page_rows(page, "**`[tiers.NAME]`**")
    if set(tier_rows) != tier:
        problems.append(f"tier fields: page {sorted(tier_rows)}, loader {sorted(tier)}")
    for key, cells in tier_rows.items():
        if cells[3] != _shown(s1["tiers"]["hbm"][key]):
            problems.append(f"tiers.hbm.{key}: the page shows S1 {cells[3]}")
    model_rows = page_rows(page, "**`[model]`**")
    if set(model_rows) != model:
        problems.append(f"model fields: page {sorted(model_rows)}, loader {sorted(model)}")
    return problems


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return json.dumps(value)
    return repr(value)


@pytest.fixture(scope="module")
def inputs() -> tuple[str, str, dict]:
    return PAGE.read_text(), LOADER.read_text(), tomllib.loads(S1.read_text())


def test_the_page_lists_what_the_loader_reads_with_s1s_values(inputs) -> None:
    assert check(*inputs) == []


def test_the_loader_reads_what_the_shipped_files_hold(inputs) -> None:
    """The key walk finds real keys (the check above is not vacuous)."""
    _, source, s1 = inputs
    top, tier, model = loader_keys(source)
    assert set(s1) <= top and len(top) >= 40
    assert tier == {"capacity_blocks", "fetch_latency_us", "fetch_bandwidth_mbps"}
    assert {"layers", "kv_heads", "head_dim", "dtype_bytes", "id"} == model


def test_a_missing_a_stray_or_a_wrong_row_is_found(inputs) -> None:
    page, source, s1 = inputs
    missing = re.sub(r"^\| `hot_prefixes` .*\n", "", page, flags=re.M)
    assert check(missing, source, s1) == ["hot_prefixes: read by the loader, not on the page"]
    stray = page.replace("| `name` |", "| `nmae` |", 1)
    assert "nmae: on the page, not read by the loader" in check(stray, source, s1)
    wrong = re.sub(r"(\| `seed` \|[^|]*\|[^|]*\| )1 \|", r"\g<1>2 |", page)
    assert check(wrong, source, s1) == ["seed: the page shows S1 2, s1.toml has 1"]
    new_key = source.replace('d.get("hot_prefixes", 0)', 'd.get("hot_prefixes", d.get("hp", 0))')
    assert check(page, new_key, s1) == ["hp: read by the loader, not on the page"]
