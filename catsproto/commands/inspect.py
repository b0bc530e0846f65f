"""`catsproto inspect`: every cache-state advertisement in a capture, decoded and checked.

Reads a pcap/pcapng file, gzip-compressed or not (or follows a live interface inside a
lab namespace), rebuilds the BGP streams, and lists each route's advertisement with its
origin, sequence, tiers and block count. With `--trust` each one is verified as a
selector would at the moment the packet was captured (signature, delegation, scope,
freshness, replay, in capture order); with `--group-key` sealed cache sections are
opened. Malformed attributes are listed with the codec's error. Exit status: 0 when
everything shown is well-formed (and verified, with --trust), 1 otherwise (a capture
file cut short or corrupt too: what precedes the damage is shown, and one line on
stderr says what and where), 2 on bad input (a file that is no capture at all, a live
interface or namespace that is not there among it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from catsproto import wire
from catsproto.adapters import pcap
from catsproto.adapters.cli_args import seconds, whole_number
from catsproto.adapters.file_modes import FileModeError, read_secret_file, read_trust_file
from catsproto.adapters.pcap_file import CaptureFileError
from catsproto.commands import UsageError, add_type_code


def _load_json(path: str, what: str, *, secret: bool) -> Any:
    """The JSON in a `what` file, refused if its mode lets others read a secret or write
    a trust file (`file_modes`)."""
    try:
        raw = read_secret_file(path, what) if secret else read_trust_file(path, what)
        return json.loads(raw.decode("utf-8"))
    except FileModeError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{what} {path} is not JSON: {exc}") from None


def make_verifier(trust_file: str | None, group_key_files: list[str]) -> pcap.Verify:
    """The check applied to each advertisement: nothing, decryption, or full verification
    by a `security.Receiver` whose state moves on in capture order."""
    if trust_file is None and not group_key_files:
        return pcap.not_checked
    from catsproto import security

    keyring = None
    if group_key_files:
        if len(group_key_files) > 2:
            raise UsageError("at most two --group-key files (the active and a standby key)")
        try:
            keys = [
                security.GroupKey.from_json(_load_json(f, "group key", secret=True))
                for f in group_key_files
            ]
            keyring = security.GroupKeyring.of(keys)
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"group key: {exc}") from None
    if trust_file is None:
        assert keyring is not None

        def open_only(value: bytes, prefix: Any, now: float) -> pcap.Check:
            try:
                adv = security.open_sealed(wire.decode(value), keyring)
            except security.UnknownSealingAlgorithmError as exc:
                # an AEAD this code lacks: left sealed, the rest shown (not a refusal)
                return pcap.Check("not-checked", f"no --trust given; {exc.reason}")
            except wire.CodecError as exc:
                reason = getattr(exc, "why", None)
                return pcap.Check(reason.value if reason else "malformed", str(exc))
            return pcap.Check("not-checked", "no --trust given; cache section opened", adv)

        return open_only
    try:
        trust = security.TrustStore.from_json(_load_json(trust_file, "trust file", secret=False))
    except (security.TrustFileError, ValueError) as exc:
        raise UsageError(f"trust file {trust_file}: {exc}") from None
    state = {"receiver": security.Receiver(trust, group_keys=keyring)}

    def verify(value: bytes, prefix: Any, now: float) -> pcap.Check:
        if prefix is None:
            return pcap.Check("no-route", "no IPv4 NLRI in the UPDATE to verify against")
        verdict, state["receiver"] = state["receiver"].receive(value, prefix, int(now * 1000))
        if verdict.reason is security.Reason.OK:
            return pcap.Check("verified", verdict.detail, verdict.advertisement)
        if verdict.reason is security.Reason.DUPLICATE:
            return pcap.Check("verified", "re-sent: " + verdict.detail, verdict.advertisement)
        return pcap.Check(verdict.reason.value, verdict.detail)

    return verify


# ---- output ----------------------------------------------------------------------------

HEADER = ["time (UTC)", "peer", "prefix", "origin", "epoch/seq", "tiers", "blocks", "bytes"]


def _row(f: pcap.Finding) -> list[str]:
    adv = f.check.advertisement or f.advertisement
    when = datetime.datetime.fromtimestamp(f.time, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]
    prefix = str(f.prefix) if f.prefix is not None else "-"
    size = str(f.value_len) if f.value_len is not None else "-"
    if adv is None:
        return [when, f.peer, prefix, "-", "-", "-", "-", size]
    origin = f"cs {adv.origin.cs_id} {adv.origin.address}"
    seq = f"{adv.sequence.epoch}/{adv.sequence.sequence}"
    summaries = adv.cache_summaries
    if summaries is not None:
        tiers = ",".join(
            f"{e.tier.name.lower()}:{wire.summary_kind_name(e.kind)}" for e in summaries.entries
        )
        blocks = str(sum(e.entry_count for e in summaries.entries))
    elif adv.get(wire.SealedCache) is not None:
        tiers, blocks = "sealed", "?"
    else:
        tiers, blocks = "-", "-"
    return [when, f.peer, prefix, origin, seq, tiers, blocks, size]


def _status(f: pcap.Finding) -> str:
    if f.error is not None:
        return f"malformed: {f.error} ({wire.error_action(f.error).value})"
    if f.check.status in ("verified", "not-checked"):
        return f.check.status
    return f"{f.check.status}: {f.check.detail}"


def format_table(found: list[pcap.Finding]) -> str:
    rows = [[*_row(f), _status(f)] for f in found]
    header = [*HEADER, "status"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]

    def line(r: list[str]) -> str:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        return "  ".join([*cells, r[-1]]).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in [*widths, 6]), *map(line, rows)])


def _problem_json(p: pcap.StreamProblem) -> dict[str, Any]:
    src, sport, dst, dport = p.flow
    return {"time": round(p.time, 6), "flow": f"{src}:{sport} > {dst}:{dport}", "problem": p.reason}


def _ok(f: pcap.Finding, verifying: bool) -> bool:
    return f.error is None and (not verifying or f.check.verified)


# ---- the command -----------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # own session: `ip netns exec` + tcpdump
        os.killpg(proc.pid, signal.SIGTERM)


class _Relay:
    """tcpdump's stderr: held until it says it listens (so a tcpdump that fails before,
    on an interface or namespace that is not there, becomes our one-line error), then
    passed on to our stderr a line at a time, with one "tcpdump: " prefix."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self.held: list[str] = []
        self.listening = False
        self.thread = threading.Thread(target=self._run, args=(lines,), daemon=True)
        self.thread.start()

    def _run(self, lines: Iterable[bytes]) -> None:
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\n").removeprefix("tcpdump: ")
            if not self.listening and "listening on" in line:
                self.listening = True
                for early in self.held:
                    self._write(early)
            if self.listening:
                self._write(line)
            else:
                self.held.append(line)

    @staticmethod
    def _write(line: str) -> None:
        sys.stderr.write(f"tcpdump: {line}\n")
        sys.stderr.flush()

    def failure(self, where: str, status: int | None) -> UsageError:
        """The error of a capture that never opened, in tcpdump's (or ip's) words."""
        self.thread.join(timeout=5)
        said = " ".join(line.strip() for line in self.held if line.strip()) or "no message"
        return UsageError(f"cannot capture on {where}: {said} (exit status {status})")


def _follow(args: argparse.Namespace, streams: pcap.BGPStreams) -> Iterator[pcap.Finding]:
    """Findings from tcpdump on a live interface until --timeout, --count or Ctrl-C."""
    proc = pcap.live_capture(args.follow, args.netns)
    assert proc.stdout is not None and proc.stderr is not None
    # tcpdump's own lines ("listening on IFACE", the packet counts at the end) go to our
    # stderr: a caller (or a script) knows from the first one that the capture is open
    relay = _Relay(proc.stderr)
    timer = threading.Timer(args.timeout, _stop, [proc]) if args.timeout else None
    if timer is not None:
        timer.start()
    where = f"{args.follow} in namespace {args.netns}" if args.netns else args.follow
    opened = False
    try:
        for finding in pcap.inspect_capture(proc.stdout, args.type_code, args.verify, streams):
            opened = True
            yield finding
    except Exception as exc:  # no pcap header came: tcpdump (or ip netns exec) failed
        if opened or not _no_capture(exc):
            raise
        if timer is not None and timer.finished.is_set():
            return  # --timeout ended it before it wrote anything
        if proc.wait(timeout=10) != 0 or not relay.listening:
            raise relay.failure(where, proc.returncode) from None
    finally:
        if timer is not None:
            timer.cancel()
        _stop(proc)
        proc.wait(timeout=10)


def _no_capture(exc: Exception) -> bool:
    """A stream that ended before a whole pcap header (ours or scapy's reader says so)."""
    from scapy.error import Scapy_Exception

    return isinstance(exc, CaptureFileError | EOFError | Scapy_Exception)


def cmd_inspect(args: argparse.Namespace) -> int:
    if not 0 <= args.type_code <= 255:
        raise UsageError(f"--type-code {args.type_code} outside 0..255")
    if (args.capture is None) == (args.follow is None):
        raise UsageError("give a capture file or --follow IFACE (one of them)")
    if args.netns and not args.follow:
        raise UsageError("--netns goes with --follow")
    args.verify = make_verifier(args.trust, args.group_key or [])
    verifying = args.trust is not None
    streams = pcap.BGPStreams()
    if args.capture is not None:
        capture = Path(args.capture)
        if not capture.is_file():
            what = (
                "is a directory, not a capture file"
                if capture.is_dir()
                else "not a regular file"
                if capture.exists()
                else "no such file"
            )
            raise UsageError(f"cannot read {args.capture}: {what}")
        try:
            source: Iterable[pcap.Finding] = list(
                pcap.inspect_capture(args.capture, args.type_code, args.verify, streams)
            )
        except CaptureFileError as exc:
            raise UsageError(f"{args.capture} is {exc}") from None
        except OSError as exc:
            raise UsageError(f"cannot read {args.capture}: {exc.strerror or exc}") from None
        except Exception as exc:  # scapy's reader on a file that is not a capture
            if isinstance(exc, UsageError | wire.CodecError):
                raise
            raise UsageError(f"{args.capture} is not a pcap or pcapng capture ({exc})") from None
    else:
        source = _follow(args, streams)
    found: list[pcap.Finding] = []
    try:
        for f in source:
            found.append(f)
            if args.jsonl:
                print(json.dumps(f.to_json()), flush=True)
            elif args.follow and not args.json:
                print(f"{'  '.join(_row(f))}  {_status(f)}", flush=True)
            if args.count and len(found) >= args.count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    if args.json:
        print(
            json.dumps(
                {
                    "advertisements": [f.to_json() for f in found],
                    "stream_problems": [_problem_json(p) for p in streams.problems],
                },
                indent=1,
            )
        )
    elif args.jsonl:
        for p in streams.problems:
            print(json.dumps(_problem_json(p)))
    elif not args.follow:
        if found:
            print(format_table(found))
        counts: dict[str, int] = {}
        for f in found:
            counts[f.status] = counts.get(f.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"
        print(f"\n{len(found)} advertisement(s) of attribute type {args.type_code}: {summary}")
        for p in streams.problems:
            print(f"stream problem: {_problem_json(p)['flow']}: {p.reason}", file=sys.stderr)
    where = args.capture if args.capture is not None else f"live capture on {args.follow}"
    for note in streams.capture_notes:  # whatever the output format: the file is damaged
        level = "error" if note.kind == "corrupt" else "warning"
        print(f"catsproto inspect: {level}: {where}: {note}", file=sys.stderr)
    clean = not streams.problems and not streams.capture_notes
    return 0 if all(_ok(f, verifying) for f in found) and clean else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="list the advertisements in a packet capture (or live), decoded and verified",
        description="Reassemble BGP in a pcap/pcapng capture (gzip-compressed or not), "
        "decode every path attribute of our type code with the codec and, with --trust, "
        "verify it for its route at the time it was captured. Exit 0 if all are well-formed "
        "(and verified), 1 if not or if the capture is cut short or corrupt (what precedes "
        "the damage is shown, and stderr says where).",
    )
    p.add_argument("capture", nargs="?", help="pcap or pcapng file (gzip-compressed or not)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON document")
    out.add_argument("--jsonl", action="store_true", help="one JSON object per line")
    p.add_argument("--trust", metavar="FILE", help="trust file (catsproto-trust/1) to verify with")
    p.add_argument(
        "--group-key",
        metavar="FILE",
        action="append",
        help="group key file to open sealed cache sections (repeat for a standby key)",
    )
    add_type_code(p)
    p.add_argument("--follow", metavar="IFACE", help="capture live on this interface (tcpdump)")
    p.add_argument("--netns", metavar="NS", help="network namespace of --follow's interface")
    p.add_argument(
        "--count",
        type=whole_number(0, "no limit"),
        default=0,
        help="stop after this many advertisements (0: no limit)",
    )
    p.add_argument(
        "--timeout",
        type=seconds(zero_means="no limit"),
        default=0.0,
        help="with --follow: stop after this many seconds (0: no limit)",
    )
    p.set_defaults(func=cmd_inspect)
