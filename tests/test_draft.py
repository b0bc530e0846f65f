"""The Internet-Draft: it renders offline without errors, passes idnits-style checks, its
tables match the code's registries, and its vector appendix is what the code generates.

Rendering needs kramdown-rfc (Debian's ruby-kramdown-rfc2629) and xml2rfc; without them
the rendering tests are skipped, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from catsproto import draft, wire

ROOT = Path(__file__).resolve().parent.parent
DRAFTS = ROOT / "drafts"
NAME = "draft-catsproto-cats-kv-cache-bgp"
SOURCE = DRAFTS / f"{NAME}.md"
VECTORS_MD = DRAFTS / "vectors.md"
VECTORS = ROOT / "tests" / "vectors"


def _xml2rfc() -> str | None:
    local = ROOT / ".venv" / "bin" / "xml2rfc"
    return str(local) if local.exists() else shutil.which("xml2rfc")


def _generated() -> str:
    return draft.vectors_from_files(
        {name: (VECTORS / f"{name}.json").read_text() for name in draft.VECTOR_FILES}
    )


@pytest.fixture(scope="module")
def markdown() -> str:
    return SOURCE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tools = {"kramdown-rfc": shutil.which("kramdown-rfc"), "xml2rfc": _xml2rfc()}
    missing = [name for name, path in tools.items() if not path]
    if missing and os.environ.get("CI") != "true":
        pytest.skip(f"{', '.join(missing)} not installed")
    out = tmp_path_factory.mktemp("draft")
    env = dict(os.environ, PYTHON=sys.executable, DRAFT_VECTORS="keep")
    proc = subprocess.run(
        [str(DRAFTS / "render"), str(out)], capture_output=True, text=True, env=env, timeout=120
    )
    return {
        "returncode": str(proc.returncode),
        "stderr": proc.stderr,
        "txt": (out / f"{NAME}.txt").read_text() if (out / f"{NAME}.txt").exists() else "",
        "html": (out / f"{NAME}.html").read_text() if (out / f"{NAME}.html").exists() else "",
    }


# ---- the generated appendix ------------------------------------------------------------


def test_vector_appendix_is_what_the_generator_writes():
    assert VECTORS_MD.read_text(encoding="utf-8") == _generated(), (
        "drafts/vectors.md is out of date: run python drafts/make_vectors.py"
    )


def test_draft_includes_the_appendix(markdown):
    assert "{::include vectors.md}" in markdown


def test_annotated_hex_covers_every_byte_exactly_once():
    for v in json.loads((VECTORS / "wire.json").read_text())["positive"]:
        lines = draft.annotate_attribute(bytes.fromhex(v["attribute"]))
        hexes = "".join(line.split(";")[0].strip() for line in lines)
        assert hexes == v["attribute"], v["name"]


def test_generator_refuses_a_vector_the_codec_does_not_reproduce():
    vectors = json.loads((VECTORS / "wire.json").read_text())
    vectors["positive"][0]["json"]["sequence"]["sequence"] += 1
    _, keys, security, transfer = _vector_files()
    with pytest.raises(ValueError, match="does not reproduce"):
        draft.vectors_markdown(vectors, keys, security, transfer)


def test_generator_refuses_a_negative_vector_with_the_wrong_offset():
    vectors = json.loads((VECTORS / "wire.json").read_text())
    vectors["negative"][0]["offset"] += 1
    _, keys, security, transfer = _vector_files()
    with pytest.raises(ValueError, match="codec says"):
        draft.vectors_markdown(vectors, keys, security, transfer)


def _vector_files() -> list:
    return [json.loads((VECTORS / f"{name}.json").read_text()) for name in draft.VECTOR_FILES]


def test_the_appendix_is_made_of_every_vector_file():
    assert set(draft.VECTOR_FILES) == {p.stem for p in VECTORS.glob("*.json")}
    texts = {name: (VECTORS / f"{name}.json").read_text() for name in draft.VECTOR_FILES}
    del texts["transfer"]
    with pytest.raises(ValueError, match=r"transfer\.json"):
        draft.vectors_from_files(texts)
    for heading in ("Codec Vectors", "Block-Key Vectors", "Security Vectors",
                    "KV Transfer Vectors"):  # fmt: skip
        assert re.search(rf"^## {heading} \{{#vectors-", VECTORS_MD.read_text(), re.M), heading


def test_annotated_transfer_frames_cover_every_byte_exactly_once():
    transfer = json.loads((VECTORS / "transfer.json").read_text())
    frames = transfer["frames"] + transfer["exchange"]["frames"]
    for v in frames:
        lines = draft.annotate_frame(bytes.fromhex(v["hex"]))
        assert "".join(line.split(";")[0].strip() for line in lines) == v["hex"]
    elided = draft.annotate_frame(bytes.fromhex(frames[-1]["hex"]), elide=True)
    assert elided == draft.annotate_frame(bytes.fromhex(frames[-1]["hex"]))  # short: whole


def test_generator_refuses_transfer_vectors_the_codec_does_not_reproduce():
    wire_v, keys, security, transfer = _vector_files()
    bad = json.loads(json.dumps(transfer))
    bad["malformed"][1]["offset"] += 1
    with pytest.raises(ValueError, match="codec says"):
        draft.vectors_markdown(wire_v, keys, security, bad)
    bad = json.loads(json.dumps(transfer))
    [long] = [v for v in bad["frames"] if "reason_given" in v]
    long["reason_given"] = "xx" + long["reason_given"][1:]  # other octets, another cut
    with pytest.raises(ValueError, match="does not reproduce"):
        draft.vectors_markdown(wire_v, keys, security, bad)
    bad = json.loads(json.dumps(transfer))
    bad["digests"][1]["digest"] = bad["digests"][2]["digest"]
    with pytest.raises(ValueError, match="does not reproduce"):
        draft.vectors_markdown(wire_v, keys, security, bad)


# ---- tables against the registries -----------------------------------------------------


@pytest.mark.parametrize("heading", draft.TLV_TABLES)
def test_tlv_tables_equal_the_codec_registry(markdown, heading):
    assert draft.table_tlvs(markdown, heading) == draft.registry_tlvs()


def test_registry_comparison_notices_a_missing_and_an_extra_tlv(markdown):
    missing = re.sub(r"^\| 35 \| hot-prefixes \|.*\n", "", markdown, flags=re.M)
    extra = markdown.replace(
        "| 36 | sealed-cache | treat-as-withdraw | this document |",
        "| 36 | sealed-cache | treat-as-withdraw | this document |\n"
        "| 37 | made-up | treat-as-withdraw | this document |",
    )
    want = draft.registry_tlvs()
    heading = "Cache-State TLV Types"
    assert 35 not in draft.table_tlvs(missing, heading)
    assert draft.table_tlvs(missing, heading) != want
    assert draft.table_tlvs(extra, heading) != want


@pytest.mark.parametrize("heading", sorted(draft.ENUM_TABLES))
def test_iana_code_tables_equal_the_code(markdown, heading):
    assert draft.table_enum(markdown, heading) == draft.enum_codes(draft.ENUM_TABLES[heading])


def test_iana_check_notices_a_transfer_code_missing(markdown):
    broken = markdown.replace("| 6 | not-authorised |\n", "")
    assert any("KV Transfer Codes" in p for p in draft.markdown_problems(broken, ""))
    renamed = markdown.replace("| 8 | refuse |", "| 8 | reject |")
    assert any("KV Transfer Frame Types" in p for p in draft.markdown_problems(renamed, ""))


def test_transfer_frames_table_and_reason_rule_match_the_code(markdown):
    from catsproto.transfer import FrameType
    from catsproto.transfer.frames import MAX_REASON

    assert draft.table_enum(markdown, "Frames") == draft.enum_codes(FrameType)
    section = markdown[markdown.index("## Frames") : markdown.index("## Procedure")]
    flat = " ".join(section.split())
    assert f"longer than {MAX_REASON} octets to at most {MAX_REASON} octets" in flat
    assert "at a character boundary" in flat


def test_summary_kind_table_equals_the_summary_registry(markdown):
    from catsproto.summary import registered_kinds

    _, rows = draft.section_table(markdown, "Summaries")
    assert {int(r[0]) for r in rows} == set(registered_kinds())
    assert {int(r[0]): r[1] for r in rows} == draft.enum_codes(wire.SummaryKind)


def test_every_registered_tlv_has_its_own_section(markdown):
    for tlv_type, cls in wire.DEFAULT_REGISTRY.by_type.items():
        assert re.search(rf"^## .+ \(Type {tlv_type}\)", markdown, re.M), cls.NAME


def test_lab_type_code_is_the_codes_default(markdown):
    assert wire.DEFAULT_ATTRIBUTE_TYPE == 255
    assert "type code 255" in markdown


def test_markdown_has_no_problems(markdown):
    assert draft.markdown_problems(markdown, VECTORS_MD.read_text(encoding="utf-8")) == []


def test_reference_check_notices_an_undefined_citation(markdown):
    broken = markdown.replace("{{RFC7606}}, Section 8", "{{RFC9999}}, Section 8")
    problems = draft.markdown_problems(broken, VECTORS_MD.read_text(encoding="utf-8"))
    assert any("RFC9999" in p for p in problems)


# ---- rendering and idnits-style checks --------------------------------------------------


def test_render_succeeds_without_errors_or_warnings(rendered):
    assert rendered["returncode"] == "0", rendered["stderr"]
    noise = [line for line in rendered["stderr"].splitlines() if line.strip()]
    assert noise == [], "\n".join(noise)
    assert rendered["txt"] and rendered["html"]


def test_text_is_72_columns_and_ascii(rendered):
    assert draft.text_problems(rendered["txt"]) == []


def test_text_check_notices_a_long_line():
    assert draft.text_problems("x" * 73) != []
    assert draft.text_problems("caf\u00e9") != []


def test_rendered_references_resolve(rendered):
    txt = rendered["txt"]
    assert "[RFC7606]" in txt and "[RFC4271]" in txt
    # xml2rfc prints an unresolved cross-reference as its raw anchor in brackets;
    # every bracketed citation must be a listed reference.
    listed = set(re.findall(r"^   \[([A-Za-z0-9.\-]+)\]", txt, re.M))
    cited = set(re.findall(r"\[([A-Z][A-Za-z0-9.\-]*[0-9])\]", txt))
    assert cited <= listed, cited - listed


def test_rendered_text_carries_the_vectors_and_the_iana_table(rendered):
    txt = rendered["txt"]
    for tlv_type, cls in wire.DEFAULT_REGISTRY.by_type.items():
        assert re.search(rf"\|\s+{tlv_type}\s+\|\s+{re.escape(cls.NAME)}\s+\|", txt), cls.NAME
    for name in ("minimal-ipv4", "sealed-delegated", "ed25519-signature-short"):
        assert name in txt


def test_draft_command_checks_the_appendix(capsys):
    from catsproto import cli

    assert cli.main(["draft", "vectors", "--check"]) == 0
    assert capsys.readouterr().out == "drafts/vectors.md matches tests/vectors/*.json\n"


# ---- what the draft says about the vectors holds in the code ---------------------------


def test_unknown_kind_vector_is_kept_and_only_its_entry_is_ignored():
    """The draft: an entry of an unknown Kind is ignored, the others are used, and the
    attribute is passed on unchanged."""
    from catsproto.examples import EXACT_KEYS
    from catsproto.selector.rib import RIB
    from catsproto.summary.versioning import Outcome

    vector = next(
        v
        for v in json.loads((VECTORS / "wire.json").read_text())["positive"]
        if v["name"] == "unknown-summary-kind"
    )
    value = bytes.fromhex(vector["hex"])
    adv = wire.decode(value)
    assert wire.encode(adv) == value  # passed on octet for octet
    kinds = [e.kind for e in adv.cache_summaries.entries]
    assert kinds == [wire.SummaryKind.EXACT, 200] and not isinstance(kinds[1], wire.SummaryKind)
    result = RIB().accept(adv, adv.timestamp_ms)
    outcomes = {tier: outcome for tier, _, outcome in result.outcomes}
    assert outcomes[wire.Tier.HBM] == Outcome.SNAPSHOT.value
    assert outcomes[wire.Tier.DRAM].startswith("rejected") and "200" in outcomes[wire.Tier.DRAM]
    hbm = result.instance.tiers[wire.Tier.HBM].shards[(0, (1 << 64) - 1)]
    assert all(k in hbm.state for k in EXACT_KEYS) and 5 not in hbm.state


def test_summary_kind_zero_is_malformed_both_ways():
    """Kind 0 is reserved: the encoder refuses it and so does the decoder (both paths)."""
    vector = next(
        v
        for v in json.loads((VECTORS / "wire.json").read_text())["negative"]
        if v["name"] == "summary-kind-zero"
    )
    with pytest.raises(wire.BadValueError, match="kind 0"):
        wire.decode(bytes.fromhex(vector["hex"]))


def test_the_rib_keeps_the_latest_rejections_and_counts_them_all():
    """A long-lived selector hears unusable entries from peers forever: it keeps the
    latest messages (bounded) and a total, not a list that grows without end."""
    from catsproto.selector.rib import REJECTED_KEPT, RIB

    vector = next(
        v
        for v in json.loads((VECTORS / "wire.json").read_text())["positive"]
        if v["name"] == "unknown-summary-kind"
    )
    adv = wire.decode(bytes.fromhex(vector["hex"]))
    rib = RIB()
    n = REJECTED_KEPT + 5
    for _ in range(n):
        rib.accept(adv, adv.timestamp_ms)
    assert rib.rejected_total == n and len(rib.rejected) == REJECTED_KEPT
    assert all("200" in line for line in rib.rejected)


_COUNTS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def test_readme_counts_the_canonical_form_exceptions_the_draft_lists():
    """drafts/README.md speaks of the exceptions to the canonical-form rule (TLV Framing,
    item 5): the number it gives for the rule as it stands is the draft's."""
    draft_text = " ".join(
        (DRAFTS / "draft-catsproto-cats-kv-cache-bgp.md").read_text(encoding="utf-8").split()
    )
    (listed,) = re.findall(r"There are (\w+) exceptions, fields whose unknown values", draft_text)
    readme = " ".join((DRAFTS / "README.md").read_text(encoding="utf-8").split())
    said = re.findall(r"has (\w+) exceptions", readme)
    assert said and {_COUNTS[w] for w in said} == {_COUNTS[listed]}, (listed, said)


def test_ed25519_verification_is_stated_not_delegated_to_a_library():
    """The Signature TLV's verification rules are normative text (each one is measured on
    the code by tests/test_ed25519_rules.py), not a reference to how a library behaves."""
    text = (DRAFTS / "draft-catsproto-cats-kv-cache-bgp.md").read_text(encoding="utf-8")
    section = text[text.index("## Signature (Type 255)") : text.index("# CATS Metric Levels")]
    flat = " ".join(section.split())
    assert "cryptography" not in flat and "OpenSSL" not in flat
    for rule in (
        "MUST be lower than the group order L",
        "S is never reduced modulo L",
        "compares its canonical encoding with the 32 octets of R",
        r"cofactorless equation \[S\]B = R + \[k\]A",
        "k is SHA-512(R || A || M)",
        "verifies no signature",
        "decoded with y reduced modulo p",
        "Public keys of small order",
    ):
        assert rule in flat, rule
    status = text[text.index("# Implementation Status") : text.index("# Open Issues")]
    flat = " ".join(status.split())
    for field in ("Organization and contact: : The authors of this document.", "Licensing:"):
        assert field in flat, field
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert f"Licensing: : {project['license']}, as declared" in flat
    assert f"version {project['version']}" in flat
    assert "Maturity:" in flat and "Coverage:" in flat
