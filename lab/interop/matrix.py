"""The interop matrix: does our attribute cross FRR, BIRD and GoBGP unchanged?

Strategy: one small lab per (transit, extended messages on/off) — ExaBGP speaker `spk`
(AS 65001) → transit `t` (AS 65010) → ExaBGP receiver `rcv` (AS 65002), in network
namespaces (`catsproto.adapters.netns`), daemons started by the lab runner's starters
(`catsproto.lab.runner.STARTERS`; GoBGP by `lab.interop.gobgp`). Every payload size
rides its own /32 (10.255.0.N), all published at once through the speaker's spool
(`exabgp_announce.Spool`), so each transit runs once per extended setting, and the labs
run side by side in worker processes. Extended messages (RFC 8654) are switched at the
two ExaBGP ends; FRR and BIRD offer them in both runs, GoBGP never does.

What a cell records comes from the wire, not from ExaBGP's JSON (ExaBGP ORs the Partial
bit into an unknown attribute it receives, so its flags say nothing about the transit):
tcpdump runs on both of the transit's interfaces, and the captures are reassembled and
framed by `catsproto.adapters.pcap`; the UPDATEs are split by `catsproto.wire.bgp`.
Per prefix: whether the speaker put it on the wire (hop 1), whether the transit passed
it on (hop 2) and the receiver's ExaBGP delivered it to its API process, the flags on
hop 2 (Partial), and whether the value bytes on hop 2 and at the receiver equal the
published bytes exactly. A payload our own size check (`exabgp_announce.check_size`, the
rule the announcer applies) refuses for the session, or ExaBGP's text API rejects, is
"not sendable" and never reaches the wire. Whether each hop negotiated extended
messages is read from the two OPEN messages on it (capability 6).

Payloads of 55 bytes or more are real advertisements (version, origin, sequence,
timestamp) padded to the exact size with an unknown TLV, so they also decode with the
codec at the far end; smaller ones are deterministic pseudo-random bytes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import ipaddress
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from catsproto import wire
from catsproto.adapters import netns
from catsproto.adapters.exabgp_announce import OversizeError, Spool, check_size
from catsproto.adapters.exabgp_receive import Announced, Session, Withdrawn, parse_message
from catsproto.adapters.output_files import OutputFileError, check_markers, check_writable
from catsproto.adapters.pcap import bgp_messages, segments
from catsproto.lab import runner
from catsproto.lab.topology import Endpoint, Link, Node, Topology
from catsproto.wire.bgp import parse_update
from lab.interop import gobgp
from lab.interop.options import (
    LIMIT_SIZES,
    MAX_SIZES,
    MAX_VALUE,
    SIZES,
    TRANSITS,
    add_arguments,
)

TYPE_CODE = wire.DEFAULT_ATTRIBUTE_TYPE
SPEAKER_AS, TRANSIT_AS, RECEIVER_AS = 65001, 65010, 65002
SPEAKER_IP, TRANSIT_IN_IP = "10.0.1.1", "10.0.1.2"
TRANSIT_OUT_IP, RECEIVER_IP = "10.0.2.1", "10.0.2.2"
PAD_TLV_TYPE = 0xFF00  # unassigned: the codec keeps it as UnknownTLV, byte for byte
CAP_EXTENDED_MESSAGE = 6  # RFC 8654
OPEN = 1

STARTERS = {
    "frr": runner.STARTERS["frr"],
    "bird": runner.STARTERS["bird"],
    "gobgp": gobgp.start_gobgp,
}


# ---- payloads ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Payload:
    size: int
    prefix: ipaddress.IPv4Network
    value: bytes


def _noise(n: int, seed: str) -> bytes:
    return hashlib.shake_256(seed.encode()).digest(n) if n else b""


def payload_value(size: int, index: int) -> bytes:
    """Exactly `size` bytes: a padded advertisement when it fits, else noise."""
    base = wire.Advertisement.build(
        wire.Version(1),
        wire.Origin(100, 1, ipaddress.ip_address("192.0.2.1")),
        wire.Sequence(epoch=1, sequence=index + 1),
        wire.Timestamp(1_795_000_000_000),
    )
    head = len(wire.encode(base)) + 4  # + the pad TLV's type and length
    if size < head:
        return _noise(size, f"interop-{size}")
    pad = wire.UnknownTLV(PAD_TLV_TYPE, _noise(size - head, f"interop-{size}"))
    value = wire.encode(wire.Advertisement((*base.tlvs, pad)))
    assert len(value) == size
    return value


class ArgumentError(ValueError):
    """Arguments the matrix cannot run with; the message names the option."""


def check_sizes(sizes: Sequence[int]) -> None:
    """Every size fits an attribute value and each has its own /32 (`payloads`)."""
    bad = [s for s in sizes if not 0 <= s <= MAX_VALUE]
    if bad:
        raise ArgumentError(
            f"--sizes: {bad[0]} is outside 0..{MAX_VALUE} (an attribute value's largest length)"
        )
    if len(sizes) > MAX_SIZES:
        raise ArgumentError(
            f"--sizes: {len(sizes)} sizes (counting any --limits probes), more than {MAX_SIZES}"
        )


def payloads(sizes: Sequence[int]) -> list[Payload]:
    check_sizes(sizes)
    return [
        Payload(size, ipaddress.IPv4Network(f"10.255.0.{i + 1}/32"), payload_value(size, i))
        for i, size in enumerate(sizes)
    ]


# ---- results -----------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    """One payload size through one transit with extended messages on or off."""

    transit: str
    extended: bool
    size: int
    prefix: str
    sendable: bool = True
    sent: bool = False  # the speaker's UPDATE for it is on hop 1
    sent_flags: int | None = None
    sent_bytes: int | None = None  # hop-1 UPDATE length
    passed_on: bool = False  # the transit's UPDATE for it is on hop 2
    delivered: bool = False  # the receiver's ExaBGP gave it to its API process
    flags: int | None = None  # on hop 2
    unchanged: bool | None = None  # hop-2 value and receiver value == published bytes
    message_bytes: int | None = None  # hop-2 UPDATE length
    note: str = ""

    @property
    def partial(self) -> bool | None:
        return None if self.flags is None else bool(self.flags & wire.FLAG_PARTIAL)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["sent_flags"] = None if self.sent_flags is None else f"{self.sent_flags:#04x}"
        out["flags"] = None if self.flags is None else f"{self.flags:#04x}"
        out["partial"] = self.partial
        return out


@dataclasses.dataclass
class LabRun:
    transit: str
    extended: bool
    seconds: float
    negotiated: dict[str, bool]  # hop -> extended messages negotiated
    cells: list[Cell]
    kept: Path | None = None  # the run folder (captures, logs), left in place by `keep`

    def to_json(self) -> dict[str, Any]:
        return {
            "transit": self.transit,
            "extended": self.extended,
            "seconds": round(self.seconds, 2),
            "extended_negotiated": self.negotiated,
            "cells": [c.to_json() for c in self.cells],
        }


# ---- the lab -----------------------------------------------------------------------


def lab_topology(transit: str, extended: bool) -> Topology:
    """spk — t — rcv; built directly (the `.clab.yml` roles have no GoBGP)."""

    def end(node: str, iface: str, addr: str) -> Endpoint:
        return Endpoint(node, iface, ipaddress.IPv4Interface(f"{addr}/30"))

    nodes = {
        "spk": Node("spk", "exabgp", SPEAKER_AS, SPEAKER_IP, announce=True,
                    extended_message=extended),
        "t": Node("t", transit, TRANSIT_AS, TRANSIT_IN_IP),
        "rcv": Node("rcv", "exabgp", RECEIVER_AS, RECEIVER_IP, receive=True,
                    extended_message=extended),
    }  # fmt: skip
    links = (
        Link(end("spk", "eth1", SPEAKER_IP), end("t", "eth1", TRANSIT_IN_IP)),
        Link(end("t", "eth2", TRANSIT_OUT_IP), end("rcv", "eth1", RECEIVER_IP)),
    )
    return Topology(f"interop-{transit}-{'ext' if extended else 'noext'}", nodes, links)


def _received(raw: Path) -> tuple[dict[str, Announced], bool]:
    """The last announcement per prefix in the receiver's raw ExaBGP JSON lines, and
    whether its session to the transit is up."""
    out: dict[str, Announced] = {}
    up = False
    try:
        text = raw.read_text()
    except OSError:
        return out, up
    for line in text.splitlines():
        try:
            events = parse_message(json.loads(line), TYPE_CODE)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a line being written, or not an UPDATE
        for event in events:
            if isinstance(event, Announced):
                out[str(event.prefix)] = event
            elif isinstance(event, Withdrawn):
                out.pop(str(event.prefix), None)
            elif isinstance(event, Session):
                up = event.state == "up"
    return out, up


def _wait_listening(log: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while "listening on" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise runner.LabError(f"tcpdump did not start: {log.read_text()[-300:]}")
        time.sleep(0.02)


def _tcpdump(lab: runner.Lab, node: str, ifname: str, path: Path) -> netns.Process:
    proc = lab.handle.start(
        node,
        f"tcpdump-{ifname}",
        ["tcpdump", "-i", ifname, "--immediate-mode", "-U", "-Z", "root", "-w", str(path),
         "tcp port 179"],
    )  # fmt: skip
    _wait_listening(Path(proc.log))
    return proc


def run_lab(
    transit: str,
    extended: bool,
    sizes: Sequence[int] = SIZES,
    *,
    tag: str | None = None,
    settle: float = 2.0,
    timeout: float = 25.0,
    keep: bool = False,
) -> LabRun:
    """Bring one lab up, announce every size at once, record the cells, tear down. With
    `keep` the run folder stays (`LabRun.kept`; a lab that fails names it on stderr)."""
    start = time.monotonic()
    tag = tag or f"x{os.getpid()}{transit[0]}{'e' if extended else 'n'}"
    max_message = 65535 if extended else 4096
    cells: dict[str, Cell] = {}
    published: dict[str, bytes] = {}
    for p in payloads(sizes):  # before the run folder: bad sizes leave nothing behind
        cell = Cell(transit, extended, p.size, str(p.prefix))
        try:
            check_size(p.prefix, p.value, max_message)
            published[cell.prefix] = p.value
        except OversizeError as exc:
            cell.sendable, cell.note = False, f"not sendable: {exc}"
        cells[cell.prefix] = cell
    topo = lab_topology(transit, extended)
    run_dir = Path(tempfile.mkdtemp(prefix=f"catsproto-interop-{tag}-"))
    hop1, hop2 = run_dir / "hop1.pcap", run_dir / "hop2.pcap"
    try:
        lab = runner.Lab(topo, netns.NetnsLab(run_dir, tag, topo.name))
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    try:
        for name in topo.nodes:
            lab.handle.add_node(name)
            lab.node_dir(name).mkdir(exist_ok=True)
        ends = [
            lab.handle.add_link(
                (link.a.node, link.a.interface, str(link.a.address)),
                (link.b.node, link.b.interface, str(link.b.address)),
            )
            for link in topo.links
        ]
        _tcpdump(lab, "t", ends[0][1].ifname, hop1)
        _tcpdump(lab, "t", ends[1][0].ifname, hop2)
        STARTERS[transit](lab, "t")
        runner.STARTERS["exabgp"](lab, "rcv")
        spool = Spool(lab.node_dir("spk") / "spool")
        for prefix, value in published.items():
            spool.publish(prefix, value)
        runner.STARTERS["exabgp"](lab, "spk")
        raw = lab.node_dir("rcv") / "rib" / "raw.jsonl"
        # judged once nothing new arrived for `settle` s (2 x settle after the
        # receiver's session came up with nothing yet), or at `timeout`
        deadline = time.monotonic() + timeout
        seen: dict[str, Announced] = {}
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            now_seen, up = _received(raw)
            if up and quiet_since is None:
                quiet_since = time.monotonic() + settle
            if now_seen.keys() != seen.keys():
                seen, quiet_since = now_seen, time.monotonic()
            if published.keys() <= seen.keys():
                break
            if quiet_since is not None and time.monotonic() - quiet_since > settle:
                break
            time.sleep(0.05)
        seen, _ = _received(raw)
        judged_at = time.time()  # teardown withdraws everything: ignore the wire after this
        speaker_log = (lab.run_dir / "spk.exabgp.log").read_text(errors="replace")
        transit_log = "".join(
            f.read_text(errors="replace") for f in sorted(lab.run_dir.glob("t.*.log"))
        )
    except BaseException:
        lab.down()
        if keep:
            report_kept([run_dir])  # the error may be lost among the labs: name it now
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    lab.down()
    try:
        negotiated = _fill_cells(cells, published, seen, hop1, hop2, judged_at)
        for cell in cells.values():
            if cell.sendable and not cell.sent:
                cell.note = _why_not_sent(cell, speaker_log, negotiated)
            elif cell.sent and not cell.passed_on:
                cell.note += f"; transit log: {_oversize_complaint(transit_log)}"
    except BaseException:
        if keep:
            report_kept([run_dir])
        raise
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    seconds = time.monotonic() - start
    kept = run_dir if keep else None
    return LabRun(transit, extended, seconds, negotiated, list(cells.values()), kept)


def report_kept(folders: Iterable[Path], stream: TextIO | None = None) -> None:
    """One `kept: PATH` line per run folder left in place (`--keep`), on stderr: the
    folder names end in random letters, so this is where the captures can be found."""
    out = sys.stderr if stream is None else stream
    for folder in folders:
        out.write(f"kept: {folder}\n")
    out.flush()


def _why_not_sent(cell: Cell, speaker_log: str, negotiated: dict[str, bool]) -> str:
    for line in speaker_log.splitlines():
        if "exabgp answered" in line and f" {cell.prefix} " in line:
            m = re.search(r"exabgp answered ('[^']*')", line)
            cell.sendable = False
            return f"not sendable: ExaBGP's API answered {m.group(1) if m else 'an error'}"
    if cell.size > 4044 and not negotiated.get("speaker-transit", False):
        return (
            "not sent: ExaBGP dropped the UPDATE silently (no extended messages on this "
            "session) though its API answered done"
        )
    return "not sent by ExaBGP"


_COMPLAINT = re.compile(r"too long|too large|too big|exceed", re.IGNORECASE)
_LOG_PREFIX = re.compile(r"^\S+ \S+ (?:BGP: )?(?:\[[^\]]*\]\s*)*")


def _oversize_complaint(log: str) -> str:
    """The transit's first log line about a message too large, or that it said nothing."""
    for line in log.splitlines():
        if _COMPLAINT.search(line):
            return repr(_LOG_PREFIX.sub("", line).strip())
    return "nothing"


def _updates(
    path: Path, sender: str, until: float
) -> tuple[list[tuple[bytes, int]], dict[str, set[int]]]:
    """(UPDATE, length) sent by `sender` up to `until` (wall clock), and the capabilities
    in each side's OPEN."""
    updates: list[tuple[bytes, int]] = []
    caps: dict[str, set[int]] = {}
    if not path.exists():
        return updates, caps
    for msg in bgp_messages(segments(path)):
        src = msg.flow[0]
        if msg.kind == OPEN:
            caps[src] = open_capabilities(msg.data)
        elif msg.kind == 2 and src == sender and msg.time <= until:
            updates.append((msg.data, len(msg.data)))
    return updates, caps


def open_capabilities(data: bytes) -> set[int]:
    """Capability codes in an OPEN message (RFC 5492 optional parameter 2)."""
    codes: set[int] = set()
    if len(data) < 29:
        return codes
    params = data[29 : 29 + data[28]]
    i = 0
    while i + 2 <= len(params):
        ptype, plen = params[i], params[i + 1]
        body = params[i + 2 : i + 2 + plen]
        if ptype == 2:
            j = 0
            while j + 2 <= len(body):
                codes.add(body[j])
                j += 2 + body[j + 1]
        i += 2 + plen
    return codes


def _last_attribute(
    updates: Iterable[tuple[bytes, int]],
) -> dict[str, tuple[int | None, bytes | None, int]]:
    """Per announced prefix: flags and value of our attribute, and the UPDATE length."""
    out: dict[str, tuple[int | None, bytes | None, int]] = {}
    for data, length in updates:
        try:
            update = parse_update(data)
        except wire.CodecError:
            continue
        attr = update.attribute(TYPE_CODE)
        for prefix in update.nlri:
            out[str(prefix)] = (attr.flags, attr.value, length) if attr else (None, None, length)
        for prefix in update.withdrawn:
            out.pop(str(prefix), None)
    return out


def _fill_cells(
    cells: dict[str, Cell],
    published: dict[str, bytes],
    seen: dict[str, Announced],
    hop1: Path,
    hop2: Path,
    judged_at: float,
) -> dict[str, bool]:
    up1, caps1 = _updates(hop1, SPEAKER_IP, judged_at)
    up2, caps2 = _updates(hop2, TRANSIT_OUT_IP, judged_at)
    negotiated = {
        "speaker-transit": len(caps1) == 2
        and all(CAP_EXTENDED_MESSAGE in c for c in caps1.values()),
        "transit-receiver": len(caps2) == 2
        and all(CAP_EXTENDED_MESSAGE in c for c in caps2.values()),
    }
    on_hop1, on_hop2 = _last_attribute(up1), _last_attribute(up2)
    for prefix, cell in cells.items():
        if prefix in on_hop1:
            cell.sent, cell.sent_flags, _, cell.sent_bytes = True, *on_hop1[prefix]
        if prefix in on_hop2:
            flags, value, length = on_hop2[prefix]
            cell.passed_on, cell.flags, cell.message_bytes = True, flags, length
            cell.unchanged = value == published.get(prefix)
        if prefix in seen:
            cell.delivered = True
            at_receiver = seen[prefix].value == published.get(prefix)
            cell.unchanged = (
                at_receiver if cell.unchanged is None else (cell.unchanged and at_receiver)
            )
        if cell.delivered != cell.passed_on:
            cell.note = "the receiver's ExaBGP and the hop-2 capture disagree"
        elif cell.sent and not cell.passed_on:
            cell.note = "not passed on by the transit"
    return negotiated


# ---- the whole matrix --------------------------------------------------------------


def _run_one(job: tuple[str, bool, tuple[int, ...], float, float, bool]) -> LabRun:
    transit, extended, sizes, settle, timeout, keep = job
    return run_lab(transit, extended, sizes, settle=settle, timeout=timeout, keep=keep)


def run_matrix(
    transits: Sequence[str] = TRANSITS,
    extended: Sequence[bool] = (True, False),
    sizes: Sequence[int] = SIZES,
    *,
    jobs: int = 3,
    settle: float = 2.0,
    timeout: float = 25.0,
    keep: bool = False,
) -> list[LabRun]:
    """Every (transit, extended) lab, `jobs` at a time in worker processes."""
    check_sizes(sizes)
    work = [(t, e, tuple(sizes), settle, timeout, keep) for t in transits for e in extended]
    if jobs <= 1:
        return [_run_one(w) for w in work]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(_run_one, work))


def versions() -> dict[str, str]:
    def first_line(argv: list[str]) -> str:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except OSError:
            return "missing"
        text = (out.stdout or out.stderr).strip()
        return text.splitlines()[0] if text else "?"

    return {
        "exabgp": first_line([runner.exabgp_binary(), "version"]),
        "frr": first_line([str(runner.FRR_BIN / "bgpd"), "--version"]),
        "bird": first_line(["bird", "--version"]),
        "gobgp": first_line(["gobgpd", "--version"]),
    }


# ---- output ------------------------------------------------------------------------

TRANSIT_NAMES = {"frr": "FRR", "bird": "BIRD", "gobgp": "GoBGP"}


def cell_text(cell: Cell) -> str:
    if not cell.sendable:
        return "not sendable"
    if not cell.sent:
        return "not sent (ExaBGP drop)"
    if not cell.delivered:
        return "**not passed on**"
    parts = ["delivered"]
    parts.append(f"Partial {'set' if cell.partial else '**not set**'} ({cell.flags:#04x})"
                 if cell.flags is not None else "no attribute")  # fmt: skip
    parts.append("bytes equal" if cell.unchanged else "**bytes changed**")
    return ", ".join(parts)


def _size(n: int) -> str:
    return f"{n:,}"


def markdown(runs: Sequence[LabRun]) -> str:
    """The grid (transit × extended by payload size), one detail row per cell, and the
    limit probes (sizes outside `SIZES`) as one line per lab."""
    ordered = sorted(runs, key=lambda r: (TRANSITS.index(r.transit) if r.transit in TRANSITS
                                          else 99, not r.extended))  # fmt: skip
    every = [c.size for c in ordered[0].cells] if ordered else []
    sizes = [s for s in every if s in SIZES] or every
    runs = [dataclasses.replace(r, cells=[c for c in r.cells if c.size in sizes]) for r in ordered]
    probes = [
        dataclasses.replace(r, cells=[c for c in r.cells if c.size not in sizes])
        for r in ordered
        if any(c.size not in sizes for c in r.cells)
    ]
    head = "| transit | extended messages | " + " | ".join(f"{_size(s)} B" for s in sizes)
    lines = [head + " |", "|" + " --- |" * (2 + len(sizes))]
    for r in runs:
        ext = "on" if r.extended else "off"
        row = [TRANSIT_NAMES.get(r.transit, r.transit), ext, *(cell_text(c) for c in r.cells)]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| transit | ext | payload | sent (flags) | delivered | flags at receiver | Partial "
        "| bytes unchanged | UPDATE bytes | note |",
        "|" + " --- |" * 10,
    ]

    def yn(v: bool | None) -> str:
        return "-" if v is None else ("yes" if v else "no")

    for r in runs:
        for c in r.cells:
            sent = (
                f"yes ({c.sent_flags:#04x})"
                if c.sent and c.sent_flags is not None
                else (yn(c.sent) if c.sendable else "-")
            )
            lines.append(
                "| " + " | ".join([
                    TRANSIT_NAMES.get(c.transit, c.transit), "on" if c.extended else "off",
                    _size(c.size), sent, yn(c.delivered) if c.sendable else "-",
                    f"{c.flags:#04x}" if c.flags is not None else "-", yn(c.partial),
                    yn(c.unchanged), str(c.message_bytes or "-"), c.note.replace("|", "/"),
                ]) + " |"
            )  # fmt: skip
    lines += ["", "Extended messages negotiated (OPEN capability 6 from both sides):", ""]
    for r in runs:
        hops = ", ".join(f"{hop} {'yes' if ok else 'no'}" for hop, ok in r.negotiated.items())
        lines.append(
            f"- {TRANSIT_NAMES.get(r.transit, r.transit)}, extended "
            f"{'on' if r.extended else 'off'}: {hops} ({r.seconds:.1f} s)"
        )
    if probes:
        lines += ["", "Limit probes (value bytes; ✓ passed on unchanged, ✗ not):", ""]
        for r in probes:
            marks = ", ".join(
                f"{_size(c.size)} {'✓' if c.delivered and c.unchanged else '✗'}"
                for c in sorted(r.cells, key=lambda c: c.size)
                if c.sendable and c.sent
            )
            lines.append(
                f"- {TRANSIT_NAMES.get(r.transit, r.transit)}, extended "
                f"{'on' if r.extended else 'off'}: {marks}"
            )
    return "\n".join(lines) + "\n"


def largest_passed(run: LabRun) -> int | None:
    """The largest value size delivered unchanged in this lab."""
    ok = [c.size for c in run.cells if c.delivered and c.unchanged]
    return max(ok) if ok else None


def to_json(runs: Sequence[LabRun], seconds: float, info: dict[str, str]) -> dict[str, Any]:
    return {
        "type_code": TYPE_CODE,
        "versions": info,
        "seconds": round(seconds, 2),
        "labs": [r.to_json() for r in runs],
    }


BEGIN, END = "<!-- interop-matrix:begin -->", "<!-- interop-matrix:end -->"


def update_doc(path: Path, table: str) -> None:
    """Replace the text between the matrix markers in `path` with `table`; a file without
    them raises `OutputFileError` and is left as it was."""
    check_markers("--update-doc", path, BEGIN, END)
    try:
        text = path.read_text(encoding="utf-8")
        start = text.index(BEGIN) + len(BEGIN)
        end = text.index(END, start)
        path.write_text(text[:start] + "\n" + table + text[end:], encoding="utf-8")
    except (OSError, ValueError) as exc:  # changed or unwritable since the check
        reason = exc.strerror if isinstance(exc, OSError) else "its markers are gone"
        raise OutputFileError(f"--update-doc {path}: cannot update: {reason or exc}") from None


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse output options that could not be written, before any lab runs."""
    try:
        if args.json and args.json != "-":
            check_writable("--json", args.json)
        if args.markdown:
            check_writable("--markdown", args.markdown)
        if args.update_doc:
            check_markers("--update-doc", args.update_doc, BEGIN, END)
    except OutputFileError as exc:
        raise ArgumentError(str(exc)) from None


def _write(option: str, path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ArgumentError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None


# ---- command line ------------------------------------------------------------------


def run_from_args(args: argparse.Namespace) -> int:
    """Run the matrix as the command line asked. Raises `ArgumentError` (before any lab
    runs, except for a write that fails at the end) for arguments it cannot use."""
    ext = {"on": (True,), "off": (False,), "both": (True, False)}[args.extended]
    sizes = (
        [*args.sizes, *(s for s in LIMIT_SIZES if s not in args.sizes)]
        if args.limits
        else args.sizes
    )
    check_sizes(sizes)
    check_outputs(args)
    if os.geteuid() != 0:
        print("the interop matrix needs root (network namespaces, FRR)", file=sys.stderr)
        return 2
    start = time.monotonic()
    runs = run_matrix(
        args.transit or TRANSITS, ext, sizes,
        jobs=args.jobs, settle=args.settle, keep=args.keep,
    )  # fmt: skip
    seconds = time.monotonic() - start
    table = markdown(runs)
    result = to_json(runs, seconds, versions())
    if args.json == "-":
        print(json.dumps(result, indent=1))
    else:
        print(table)
        print(f"{len(runs)} lab(s) in {seconds:.1f} s")
    report_kept(r.kept for r in runs if r.kept is not None)
    failed = []  # each output is tried: one that cannot be written does not stop the next
    writes = [
        ("--json", args.json, json.dumps(result, indent=1) + "\n"),
        ("--markdown", args.markdown, table),
    ]
    for option, path, text in writes:
        if path and path != "-":
            try:
                _write(option, path, text)
            except ArgumentError as exc:
                failed.append(str(exc))
    if args.update_doc:
        try:
            update_doc(Path(args.update_doc), table)
        except OutputFileError as exc:  # the file changed during the run
            failed.append(str(exc))
    if failed:
        raise ArgumentError("; ".join(failed))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lab.interop.matrix",
        description="ExaBGP -> FRR/BIRD/GoBGP -> ExaBGP: our attribute across transits",
    )
    add_arguments(p)
    try:
        return run_from_args(p.parse_args(argv))
    except ArgumentError as exc:
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
