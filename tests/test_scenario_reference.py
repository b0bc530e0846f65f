"""docs/scenarios.md against the scenario loader: every key `Scenario.from_mapping` reads
is on the page and every key on the page is read; a key is "required" on the page exactly
when the loader reads it without a default; the tier and model tables list the fields the
loader reads of them; the S1 and llama70b columns show the shipped files' values; the
range a number or text key has on the page (its values column, up to a note in
parentheses) is the one its reader in the loader checks. The keys come from the loader's
code (its `d["key"]`, `d.get("key")` and its readers, `_flag(d, "key")`,
`_whole(d, "key", default)`, `_real(d, "key", default)` and `_text(d, "key", default)`,
checked against the `Scenario` dataclass's fields), not from a list kept here, so a new
key without a row fails. The last test feeds the checker broken pages and loaders."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest

from catsproto.sim.scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "scenarios.md"
LOADER = ROOT / "catsproto" / "sim" / "scenario.py"
SHIPPED = ROOT / "catsproto" / "sim" / "scenarios"
ABSENT = "–"  # a cell for a key the shipped file leaves out
# the loader's readers of one key, `reader(mapping, "key", default, ...)`; a reader
# given None for its default reads a required key
READERS = ("_flag", "_whole", "_real", "_text")
RANGED = ("_whole", "_real", "_text")  # the readers whose keywords give a range


class LoaderKeys(NamedTuple):
    top: set[str]  # top-level keys from_mapping reads
    required: set[str]  # ... of them, read without a default (d["key"])
    tier: set[str]  # fields of one [tiers.NAME] table
    model: set[str]  # fields of the [model] table


def _reads(function: ast.AST, mapping: str) -> tuple[set[str], set[str]]:
    """(every string key `function` reads from the dict named `mapping`, those read by
    subscript, without a default)."""
    keys: set[str] = set()
    required: set[str] = set()
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == mapping
            and isinstance(node.slice, ast.Constant)
        ):
            keys.add(node.slice.value)
            required.add(node.slice.value)
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "get"
            and isinstance(f.value, ast.Name)
            and f.value.id == mapping
        ):
            keys.add(node.args[0].value)
        if isinstance(f, ast.Name) and f.id in READERS and len(node.args) >= 2:
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id == mapping:
                key = node.args[1].value
                keys.add(key)
                default = node.args[2] if len(node.args) >= 3 else None
                if isinstance(default, ast.Constant) and default.value is None:
                    required.add(key)  # a reader with no default: required
    return keys, required


def loader_keys(source: str) -> LoaderKeys:
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    top, required = _reads(functions["from_mapping"], "d")
    tier, _ = _reads(functions["_tiers"], "spec")
    model, _ = _reads(functions["from_mapping"], "model")
    return LoaderKeys(top, required, tier, model)


def _range(call: ast.Call, constants: dict[str, object]) -> str:
    """What a reader call accepts, as the page's values column says it; a keyword's
    value is a literal or one of the module's constants (`high=_U32`)."""
    kw = {
        k.arg: constants[k.value.id] if isinstance(k.value, ast.Name) else ast.literal_eval(k.value)
        for k in call.keywords
        if k.arg in ("low", "high", "positive", "inf", "below")
    }
    low, high = kw.get("low", 0), kw.get("high")
    if call.func.id == "_whole":  # type: ignore[attr-defined]
        return f"integer {low}..{high}" if high is not None else f"integer ≥ {low}"
    if call.func.id == "_text":  # type: ignore[attr-defined]
        return f"text, {low}..{high} bytes" if high is not None else "text"
    text = "number > 0" if kw.get("positive") else "number ≥ 0"
    if kw.get("below") is not None:
        text += f", below {kw['below']:g}"
    return text + (", or inf" if kw.get("inf") else "")


def _says(cell: str, want: str) -> bool:
    """Whether a values cell states the range `want`, alone or before a note: `(...)`,
    or `: ...` (``number > 0, or inf: never``)."""
    return cell == want or cell.startswith((want + " (", want + ":"))


def loader_ranges(source: str) -> dict[str, dict[str, str]]:
    """(`top`, `tier`, `model`) -> key -> the range its reader accepts."""
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    out: dict[str, dict[str, str]] = {"top": {}, "tier": {}, "model": {}}
    for table, function, mapping in (
        ("top", "from_mapping", "d"),
        ("tier", "_tiers", "spec"),
        ("model", "from_mapping", "model"),
    ):
        for node in ast.walk(functions[function]):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in RANGED
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == mapping
            ):
                out[table][node.args[1].value] = _range(node, constants)
    return out


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


def _shown(value: object) -> str:
    """A value as the page writes it: TOML's spelling, text in double quotes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return json.dumps(value)
    return repr(value)


def _cell(table: dict, key: str) -> str:
    return _shown(table[key]) if key in table else ABSENT


def check(page: str, source: str, s1: dict, l70: dict) -> list[str]:
    """What is wrong with `page`, one line each."""
    keys = loader_keys(source)
    problems = []
    rows = page_rows(page, "## Top-level keys")
    tables = {"rtt_ms", "tiers", "model"} & set(re.findall(r"\*\*`\[(\w+)", page))
    for key in sorted(keys.top - set(rows) - tables):
        problems.append(f"{key}: read by the loader, not on the page")
    for key in sorted(set(rows) - keys.top):
        problems.append(f"{key}: on the page, not read by the loader")
    for key, cells in rows.items():
        if (cells[2] == "required") != (key in keys.required):
            problems.append(f"{key}: the page's default {cells[2]} disagrees with the loader")
        for column, name, doc in ((3, "S1", s1), (4, "llama70b", l70)):
            if cells[column] != _cell(doc, key):
                problems.append(
                    f"{key}: the page shows {name} {cells[column]}, the file {_cell(doc, key)}"
                )
    ranges = loader_ranges(source)
    for key, want in ranges["top"].items():
        if key in rows and not _says(rows[key][1], want):
            problems.append(f"{key}: the page says {rows[key][1]}, the loader takes {want}")
    tier_rows = page_rows(page, "**`[tiers.NAME]`**")
    for key, want in ranges["tier"].items():
        if key in tier_rows and not _says(tier_rows[key][1], want):
            problems.append(f"tiers.*.{key}: the page says {tier_rows[key][1]}, the loader {want}")
    if set(tier_rows) != keys.tier:
        problems.append(f"tier fields: page {sorted(tier_rows)}, loader {sorted(keys.tier)}")
    for key, cells in tier_rows.items():
        want_s1 = " / ".join(_cell(t, key) for t in s1["tiers"].values())
        want_l70 = " / ".join(_cell(t, key) for t in l70["tiers"].values())
        if (cells[3], cells[4]) != (want_s1, want_l70):
            problems.append(
                f"tiers.*.{key}: the page shows {cells[3]} and {cells[4]}, "
                f"the files {want_s1} and {want_l70}"
            )
    model_rows = page_rows(page, "**`[model]`**")
    for key, want in ranges["model"].items():
        if key in model_rows and not _says(model_rows[key][1], want):
            problems.append(f"model.{key}: the page says {model_rows[key][1]}, the loader {want}")
    if set(model_rows) != keys.model:
        problems.append(f"model fields: page {sorted(model_rows)}, loader {sorted(keys.model)}")
    for key, cells in model_rows.items():
        want = (_cell(s1.get("model", {}), key), _cell(l70.get("model", {}), key))
        if (cells[2], cells[3]) != want:
            problems.append(f"model.{key}: the page shows {cells[2]} and {cells[3]}")
    return problems


@pytest.fixture(scope="module")
def inputs() -> tuple[str, str, dict, dict]:
    return (
        PAGE.read_text(encoding="utf-8"),
        LOADER.read_text(encoding="utf-8"),
        tomllib.loads((SHIPPED / "s1.toml").read_text(encoding="utf-8")),
        tomllib.loads((SHIPPED / "llama70b.toml").read_text(encoding="utf-8")),
    )


def test_the_page_lists_what_the_loader_reads_with_the_shipped_values(inputs) -> None:
    assert check(*inputs) == []


def test_the_key_walk_finds_the_dataclass_fields_and_the_shipped_keys(inputs) -> None:
    """The loader's reads cover every `Scenario` field (each is a key of the same name)
    and every key of the shipped files, so the check above is not vacuous."""
    _, source, s1, l70 = inputs
    keys = loader_keys(source)
    assert {f.name for f in dataclasses.fields(Scenario)} <= keys.top
    assert set(s1) | set(l70) <= keys.top
    assert keys.required == {"sites", "rtt_ms", "tiers", "instances_per_site", "prefill_tps"}
    assert keys.tier == {"capacity_blocks", "fetch_latency_us", "fetch_bandwidth_mbps"}
    assert keys.model == {"layers", "kv_heads", "head_dim", "dtype_bytes", "id"}


def test_a_missing_a_stray_or_a_wrong_row_is_found(inputs) -> None:
    page, source, s1, l70 = inputs
    missing = re.sub(r"^\| `hot_prefixes` .*\n", "", page, flags=re.M)
    assert check(missing, source, s1, l70) == ["hot_prefixes: read by the loader, not on the page"]
    stray = page.replace("| `name` |", "| `nmae` |", 1)
    assert "nmae: on the page, not read by the loader" in check(stray, source, s1, l70)
    wrong = re.sub(r"(\| `seed` \|[^|]*\|[^|]*\| )1 \|", r"\g<1>2 |", page)
    assert check(wrong, source, s1, l70) == ["seed: the page shows S1 2, the file 1"]
    wrong_70b = page.replace("| 4096 | 65535 |", "| 4096 | 4096 |", 1)
    assert check(wrong_70b, source, s1, l70) == [
        "max_message_bytes: the page shows llama70b 4096, the file 65535"
    ]
    wrong_tier = page.replace("| 1000 / 4000 |", "| 1000 / 2000 |", 1)
    assert len(check(wrong_tier, source, s1, l70)) == 1
    no_tables = page.replace("**`[rtt_ms]`**", "**rtt**", 1)
    assert check(no_tables, source, s1, l70) == ["rtt_ms: read by the loader, not on the page"]
    new_key = source.replace(
        '_whole(d, "hot_prefixes", 0)', '_whole(d, "hot_prefixes", d.get("hp", 0))'
    )
    assert check(page, new_key, s1, l70) == ["hp: read by the loader, not on the page"]
    loose = page.replace("| `snapshot_every` | integer ≥ 1 |", "| `snapshot_every` | integer |")
    assert check(loose, source, s1, l70) == [
        "snapshot_every: the page says integer, the loader takes integer ≥ 1"
    ]
    stricter = source.replace(
        '_real(d, "per_hop_ms", 1.0)', '_real(d, "per_hop_ms", 1.0, positive=True)'
    )
    assert check(page, stricter, s1, l70) == [
        "per_hop_ms: the page says number ≥ 0, the loader takes number > 0"
    ]
    no_bound = source.replace('"model_id", "model", low=1, high=255)', '"model_id", "model")')
    assert check(page, no_bound, s1, l70) == [
        "model_id: the page says text, 1..255 bytes, the loader takes text"
    ]
    wider = source.replace('"target_fpr", 0.01, below=1)', '"target_fpr", 0.01, below=2)')
    assert check(page, wider, s1, l70) == [
        "target_fpr: the page says number ≥ 0, below 1, the loader takes number ≥ 0, below 2"
    ]
    u64 = source.replace("_U32 = 0xFFFF_FFFF", "_U32 = 0xFFFF_FFFF_FFFF_FFFF")
    assert len(check(page, u64, s1, l70)) == 4  # block_tokens, bytes_per_block, tier costs
    now_required = source.replace(
        '_whole(d, "snapshot_every", 8', '_whole(d, "snapshot_every", None'
    )
    assert check(page, now_required, s1, l70) == [
        "snapshot_every: the page's default 8 disagrees with the loader"
    ]
