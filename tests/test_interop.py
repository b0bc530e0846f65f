"""Interop matrix against the real daemons: ExaBGP → FRR / BIRD / GoBGP → ExaBGP.

The matrix runs once for the module (six labs, three at a time, about 12 s here) and
each test checks cells of it. It needs root and FRR, BIRD, GoBGP, tcpdump; under
CI=true it must run, never skip. The unit tests at the top need none of that.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
from pyroute2 import netns

from catsproto import wire
from catsproto.lab.runner import FRR_BIN, FRR_RUN
from lab.interop import gobgp, matrix, options

ROOT = Path(__file__).resolve().parent.parent
SMALL = (0, 255, 256)  # fit one 4096-byte UPDATE even after a transit's AS is added
LAB_NAMESPACE = re.compile(r"^x\d+[fbg][en]-")


# ---- without daemons -----------------------------------------------------------------


@pytest.mark.parametrize("size", options.SIZES)
def test_payload_is_exactly_the_size_and_decodes_when_it_can(size: int) -> None:
    value = matrix.payload_value(size, 3)
    assert len(value) == size
    assert matrix.payload_value(size, 3) == value  # deterministic
    if size >= 55:
        adv = wire.decode(value)
        assert wire.encode(adv) == value
        assert adv.tlvs[-1] == wire.UnknownTLV(matrix.PAD_TLV_TYPE, adv.tlvs[-1].value)


def test_payloads_ride_distinct_prefixes() -> None:
    ps = matrix.payloads(options.SIZES)
    assert [p.size for p in ps] == list(options.SIZES)
    assert len({p.prefix for p in ps}) == len(ps)


def test_open_capabilities() -> None:
    caps = (
        bytes([2, 6, 1, 4, 0, 1, 0, 1])
        + bytes([2, 2, 6, 0])
        + bytes([2, 6, 65, 4, 0, 0, 0xFD, 0xE9])
    )
    body = bytes([4]) + (65001).to_bytes(2, "big") + (9).to_bytes(2, "big")
    body += ipaddress.ip_address("10.0.1.1").packed + bytes([len(caps)]) + caps
    msg = b"\xff" * 16 + (19 + len(body)).to_bytes(2, "big") + bytes([1]) + body
    assert matrix.open_capabilities(msg) == {1, 6, 65}
    assert matrix.open_capabilities(msg[:20]) == set()


def test_gobgp_config_has_one_neighbor_per_link() -> None:
    text = gobgp.gobgpd_conf(matrix.lab_topology("gobgp", True), "t")
    assert "as = 65010" in text
    assert 'router-id = "10.0.1.2"' in text
    assert text.count("[[neighbors]]") == 2
    assert 'neighbor-address = "10.0.1.1"' in text and "peer-as = 65001" in text
    assert 'neighbor-address = "10.0.2.2"' in text and "peer-as = 65002" in text
    assert 'local-address = "10.0.2.1"' in text
    doc = tomllib.loads(text)
    assert [n["config"]["peer-as"] for n in doc["neighbors"]] == [65001, 65002]


def test_an_update_doc_write_that_fails_is_one_error_not_a_traceback(
    tmp_path: Path, monkeypatch
) -> None:
    """The doc passed the check before the run but cannot be written after it (a full
    or read-only disk): `OutputFileError` naming the option, the file as it was."""
    import errno

    from catsproto.adapters.output_files import OutputFileError

    doc = tmp_path / "doc.md"
    doc.write_text(f"a\n{matrix.BEGIN}\nold\n{matrix.END}\nb\n")

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", read_only)
    with pytest.raises(OutputFileError, match=r"--update-doc .*cannot update: Read-only"):
        matrix.update_doc(doc, "| new |\n")
    assert "old" in doc.read_text()


def test_update_doc_replaces_only_between_markers(tmp_path: Path) -> None:
    doc = tmp_path / "interop.md"
    doc.write_text(f"intro\n{matrix.BEGIN}\nold\n{matrix.END}\noutro\n")
    matrix.update_doc(doc, "| new |\n")
    assert doc.read_text() == f"intro\n{matrix.BEGIN}\n| new |\n{matrix.END}\noutro\n"


def test_docs_carry_the_matrix_markers() -> None:
    text = (ROOT / "docs" / "interop.md").read_text()
    assert matrix.BEGIN in text and matrix.END in text


def test_cli_registers_interop() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "catsproto", "interop", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "--transit" in out.stdout and "--extended" in out.stdout


def _interop(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "catsproto", "interop", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _interop_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("catsproto-interop-*")}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--markdown", "/nonexistent-dir/x.md"], "--markdown /nonexistent-dir/x.md: no folder"),
        (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: no folder"),
        (["--update-doc", "/nonexistent-dir/doc.md"], "--update-doc /nonexistent-dir/doc.md"),
        (["--sizes", "abc"], "--sizes: 'abc' is not a whole number"),
        (["--sizes", "0,70000"], "--sizes: 70000 is outside 0..65535"),
        (["--jobs", "0"], "--jobs: must be >= 1, not 0"),
        (["--jobs", "two"], "--jobs: 'two' is not a whole number"),
        (["--settle", "nan"], "--settle: must be finite and > 0 seconds, not nan"),
        (["--settle", "0"], "--settle: must be finite and > 0 seconds, not 0"),
    ],
)
def test_bad_options_are_refused_before_any_lab(argv: list[str], says: str) -> None:
    before = _interop_dirs()
    out = _interop(*argv)
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert _interop_dirs() <= before  # no lab ran: it would have made its folder


def test_update_doc_without_markers_is_refused_and_untouched(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("no markers here\n")
    out = _interop("--update-doc", str(doc))
    assert out.returncode == 2
    assert "no <!-- interop-matrix:begin --> ... <!-- interop-matrix:end --> markers" in out.stderr
    assert doc.read_text() == "no markers here\n"
    with pytest.raises(ValueError, match="markers"):
        matrix.update_doc(doc, "| new |\n")
    assert doc.read_text() == "no markers here\n"


def test_a_size_too_large_leaves_no_run_folder() -> None:
    before = _interop_dirs()
    with pytest.raises(matrix.ArgumentError, match="--sizes: 70000"):
        matrix.run_lab("bird", True, [256, 70_000], tag="xsz")
    with pytest.raises(matrix.ArgumentError, match="--sizes: 260 sizes"):
        matrix.run_matrix(("bird",), (True,), list(range(260)))
    assert _interop_dirs() <= before


# ---- with the daemons ----------------------------------------------------------------


def _require_lab() -> None:
    """Real daemons need root; under CI=true these tests must run, never skip."""
    missing = [b for b in ("tcpdump", "bird", "gobgpd") if shutil.which(b) is None]
    if not (FRR_BIN / "bgpd").exists():
        missing.append("frr")
    problem = "needs root" if os.geteuid() != 0 else ""
    if missing:
        problem = f"missing {', '.join(missing)}"
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"interop matrix {problem} and CI=true forbids skipping it")
        pytest.skip(f"interop matrix {problem}")


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, bool], matrix.LabRun]:
    _require_lab()
    before = {n for n in netns.listnetns() if LAB_NAMESPACE.match(n)}
    start = time.monotonic()
    result = matrix.run_matrix(sizes=(*options.SIZES, *options.LIMIT_SIZES), jobs=3)
    print(f"interop matrix: {time.monotonic() - start:.1f} s")  # a figure, not a check
    left = {n for n in netns.listnetns() if LAB_NAMESPACE.match(n)} - before
    assert not left, f"namespaces left behind: {sorted(left)}"
    frr_left = [p.name for p in FRR_RUN.glob("x*-t")] if FRR_RUN.is_dir() else []
    assert not frr_left, f"FRR run directories left behind: {frr_left}"
    return {(r.transit, r.extended): r for r in result}


def _cell(runs: dict[tuple[str, bool], matrix.LabRun], transit: str, ext: bool, size: int):
    return next(c for c in runs[(transit, ext)].cells if c.size == size)


def test_every_lab_ran(runs: dict[tuple[str, bool], matrix.LabRun]) -> None:
    assert set(runs) == {(t, e) for t in options.TRANSITS for e in (True, False)}
    for run in runs.values():
        assert [c.size for c in run.cells] == [*options.SIZES, *options.LIMIT_SIZES]


# The largest value each transit passes on (one speaker AS plus the transit's own):
# FRR encodes AS_PATH with Extended Length (+1 byte), BIRD refuses to send an UPDATE
# that leaves less than 1000 bytes of the message free, GoBGP has no extended messages.
LARGEST = {
    ("frr", True): 65478,
    ("frr", False): 4039,
    ("bird", True): 64479,
    ("bird", False): 3040,
    ("gobgp", True): 4040,
    ("gobgp", False): 4040,
}


@pytest.mark.parametrize(("transit", "ext"), sorted(LARGEST))
def test_largest_value_passed_on(
    runs: dict[tuple[str, bool], matrix.LabRun], transit: str, ext: bool
) -> None:
    assert matrix.largest_passed(runs[(transit, ext)]) == LARGEST[(transit, ext)]
    for cell in runs[(transit, ext)].cells:
        if cell.sent:
            assert cell.delivered == (cell.size <= LARGEST[(transit, ext)]), cell


@pytest.mark.parametrize("transit", ["frr", "bird"])
@pytest.mark.parametrize("ext", [True, False])
def test_frr_and_bird_pass_every_size_that_fits_with_partial_set(
    runs: dict[tuple[str, bool], matrix.LabRun], transit: str, ext: bool
) -> None:
    fits = options.SIZES if ext else SMALL
    for size in fits:
        cell = _cell(runs, transit, ext, size)
        assert cell.sendable and cell.sent and cell.passed_on and cell.delivered, cell
        assert cell.unchanged is True, cell
        assert cell.partial is True, cell
        # RFC 4271 5: Partial added, Optional and Transitive kept, Extended Length as needed
        assert cell.flags == (0xF0 if size > 255 else 0xE0), cell
        assert cell.sent_flags == (0xD0 if size > 255 else 0xC0), cell
    assert runs[(transit, ext)].negotiated == {"speaker-transit": ext, "transit-receiver": ext}


@pytest.mark.parametrize("transit", options.TRANSITS)
def test_4044_bytes_without_extended_messages_dies_at_the_transit(
    runs: dict[tuple[str, bool], matrix.LabRun], transit: str
) -> None:
    """4044 bytes fill a 4096-byte UPDATE from the speaker; the transit's own AS makes
    it 4100 bytes, which no transit can send on a session without extended messages."""
    cell = _cell(runs, transit, False, 4044)
    assert cell.sendable and cell.sent and cell.sent_bytes == 4096, cell
    assert not cell.passed_on and not cell.delivered, cell


@pytest.mark.parametrize("transit", options.TRANSITS)
def test_60000_bytes_without_extended_messages_is_not_sendable(
    runs: dict[tuple[str, bool], matrix.LabRun], transit: str
) -> None:
    cell = _cell(runs, transit, False, 60_000)
    assert not cell.sendable and not cell.sent and not cell.delivered, cell
    assert "exceeds the 4044 bytes" in cell.note


@pytest.mark.parametrize("ext", [True, False])
def test_gobgp_passes_small_messages_without_setting_partial(
    runs: dict[tuple[str, bool], matrix.LabRun], ext: bool
) -> None:
    for size in SMALL:
        cell = _cell(runs, "gobgp", ext, size)
        assert cell.sent and cell.passed_on and cell.delivered and cell.unchanged, cell
        assert cell.partial is False, cell  # deviation from RFC 4271 section 5
        assert cell.flags == cell.sent_flags, cell
    # GoBGP 3.10 offers no extended messages, so neither hop has them
    assert runs[("gobgp", ext)].negotiated == {
        "speaker-transit": False,
        "transit-receiver": False,
    }


def test_gobgp_passes_nothing_over_4096_bytes(
    runs: dict[tuple[str, bool], matrix.LabRun],
) -> None:
    cell = _cell(runs, "gobgp", True, 4044)
    assert cell.sent and not cell.passed_on and not cell.delivered, cell
    # ExaBGP was configured for 65535 bytes, so our check let it through; the session
    # has no extended messages, and ExaBGP dropped the UPDATE without a word
    big = _cell(runs, "gobgp", True, 60_000)
    assert big.sendable and not big.sent and not big.delivered, big
    assert "dropped the UPDATE silently" in big.note


def test_outputs(runs: dict[tuple[str, bool], matrix.LabRun]) -> None:
    table = matrix.markdown(list(runs.values()))
    assert table.count("\n| FRR | on |") == 6  # grid row + five detail rows
    assert "Partial **not set** (0xc0)" in table
    doc = matrix.to_json(list(runs.values()), 1.0, {"exabgp": "x"})
    back = json.loads(json.dumps(doc))
    assert len(back["labs"]) == 6
    cell = back["labs"][0]["cells"][0]
    assert {"delivered", "partial", "flags", "unchanged", "sendable"} <= cell.keys()


def test_command_line_runs_one_lab(tmp_path: Path) -> None:
    _require_lab()
    out = tmp_path / "m.json"
    args = argparse.Namespace(
        transit=["bird"], extended="on", sizes=[256], limits=False, jobs=1, settle=1.0,
        json=str(out),
        markdown=str(tmp_path / "m.md"), update_doc=None, keep=False,
    )  # fmt: skip
    assert matrix.run_from_args(args) == 0
    doc = json.loads(out.read_text())
    (cell,) = doc["labs"][0]["cells"]
    assert cell["delivered"] and cell["partial"] and cell["unchanged"]
    assert "| BIRD | on |" in (tmp_path / "m.md").read_text()
