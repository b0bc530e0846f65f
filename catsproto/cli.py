"""The `catsproto` command: encode, decode and inspect cache-state advertisements.

Bad input ends with exit status 2 and one line on stderr that names the offset, the
TLV and what is wrong; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path

from catsproto import wire
from catsproto.adapters.cli_args import whole_number
from catsproto.commands import (
    HEX_INPUT_RULE,
    CommandParser,
    UsageError,
    add_type_code,
    bytes_from_input,
    read_input,
)
from catsproto.examples import examples

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C stopped


def cmd_decode(args: argparse.Namespace) -> int:
    data = bytes_from_input(read_input(args.file))
    adv = wire.decode_attribute_value(data, args.type_code) if args.attribute else wire.decode(data)
    print(json.dumps(adv.to_json(), indent=None if args.compact else 2))
    return 0


def cmd_encode(args: argparse.Namespace) -> int:
    raw = read_input(args.file)
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"input is not JSON: line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except UnicodeDecodeError:
        raise UsageError("input is not UTF-8 JSON") from None
    items = obj if isinstance(obj, list) else [obj]
    for i, item in enumerate(items):
        try:
            value = wire.encode(wire.Advertisement.from_json(item))
        except wire.CodecError as exc:
            where = f"advertisement {i}: " if isinstance(obj, list) else ""
            raise UsageError(f"{where}{exc}") from None
        print((wire.encode_attribute(value, args.type_code) if args.attribute else value).hex())
    return 0


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), line, *(fmt(r) for r in rows)])


def cmd_demo(args: argparse.Namespace) -> int:
    """Part 1: the codec on the example advertisements. Part 2: the 4-site lab, with
    signed advertisements crossing FRR and BIRD into the path selector's RIB. Part 3:
    the trace-driven evaluation on a slice of the Mooncake conversation trace."""
    status = codec_demo()
    if args.codec_only or status:
        return status
    from catsproto.commands import lab

    print("\n" + "=" * 78 + "\n")
    lab_args = build_parser().parse_args(lab_demo_argv(args, lab.can_netns()))
    status = lab.cmd_demo(lab_args)
    if args.no_eval:
        return status
    print("\n" + "=" * 78 + "\n")
    return eval_demo(args.eval_requests, download=False if args.no_download else None) or status


def lab_demo_argv(args: argparse.Namespace, namespaced: bool) -> list[str]:
    """The `lab demo` the main demo runs. The namespaced lab seals the cache sections (the
    capture then shows ciphertext, and the printed second command opens it); the loopback
    lab cannot (`lab demo --seal` refuses it), so it runs in the clear."""
    if args.embedded or not namespaced:
        return ["lab", "demo", *(["--embedded"] if args.embedded else [])]
    engine = [] if args.no_engine or not engine_installed() else ["--engine", "vllm"]
    return ["lab", "demo", *([] if args.no_seal else ["--seal"]), *engine]


def engine_installed() -> bool:
    """Whether the real engine (scripts/setup's .venv-engine) is there; the demo says so
    when it is not."""
    from catsproto.lab.engine import EngineError, check_installed

    try:
        check_installed()
    except EngineError as exc:
        print(f"real engines skipped: {exc}")
        return False
    return True


def eval_demo(requests: int, download: bool | None = None) -> int:
    """Policies on the first `requests` requests of the Mooncake trace, S1, x1 and x4.
    The trace is downloaded when it is nowhere (`download` False: never; None: unless
    $CATSPROTO_NO_DOWNLOAD); without it, this part is skipped with the reason."""
    from catsproto.adapters.trace import TraceFormatError
    from catsproto.adapters.trace_download import find_or_download_trace
    from catsproto.commands import eval as evaluation

    try:
        trace = find_or_download_trace(download=download)
    except TraceFormatError as exc:
        print(f"trace-driven evaluation skipped: {exc}")
        return 0
    print(
        f"catsproto eval: the first {requests:,} requests of the Mooncake conversation trace,"
        " scenario S1 (4 sites x 4 instances), speedups 1 and 4; every advertisement built,"
        " signed, encoded, delayed, verified. The whole trace over twenty seeds:"
        " docs/evaluation.md.\n"
    )
    policies = ["nearest", "compute-aware", "catsproto", "oracle"]
    argv = ["eval", "--trace", str(trace), "--limit", str(requests), "--sweep-limit", "0"]
    return evaluation.run(build_parser().parse_args([*argv, "--policies", *policies]))


def codec_demo() -> int:
    print("catsproto codec demo: build -> encode -> decode the example advertisements\n")
    rows = []
    for ex in examples():
        adv = ex.advertisement
        value = wire.encode(adv)
        attr = wire.encode_attribute(value)
        back = wire.decode_attribute_value(attr)
        same = back == adv and wire.encode(back) == value
        tiers = adv.cache_summaries.entries if adv.cache_summaries else ()
        rows.append(
            [
                ex.name,
                str(len(adv.tlvs)),
                str(len(value)),
                attr[: 4 if attr[0] & wire.FLAG_EXTENDED_LENGTH else 3].hex(" "),
                f"cs {adv.origin.cs_id} {adv.origin.address}",
                f"{adv.sequence.epoch}/{adv.sequence.sequence}",
                ",".join(f"{e.tier.name.lower()}:{wire.summary_kind_name(e.kind)}" for e in tiers)
                or "-",
                "exact" if same else "MISMATCH",
            ]
        )
    print(
        _table(
            rows,
            [
                "example",
                "TLVs",
                "bytes",
                "attr hdr",
                "origin",
                "epoch/seq",
                "summaries",
                "round trip",
            ],
        )
    )
    sample = examples()[1].advertisement
    print(f"\n{examples()[1].name} as JSON (`catsproto decode` prints this):")
    print(json.dumps(sample.to_json()))
    value = wire.encode(sample)
    flipped = bytearray(value)
    flipped[-1] ^= 0x01  # the last byte of the L2 score
    changed = wire.decode(bytes(flipped)) != sample
    print(
        f"\nflip one value bit: still decodes ({'a different' if changed else 'the same'} score)"
        " -- only a signature can catch that"
    )
    bad_length = bytearray(value)
    at = len(wire.encode(wire.Advertisement(sample.tlvs[:4]))) + 3  # metrics-l0 length
    bad_length[at] += 1  # one byte too long
    try:
        wire.decode(bytes(bad_length))
    except wire.CodecError as exc:
        print(f"break a length field: decode refuses: {exc}")
    ok = all(r[-1] == "exact" for r in rows)
    return 0 if ok else 1


def cmd_vectors(args: argparse.Namespace) -> int:
    from catsproto.security.vectors import security_vectors
    from catsproto.vectors import wire_vectors

    folder = Path(args.dir)
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise UsageError(f"{folder} {what} (the vector files go in an existing directory)")
    stale = []
    for name, make in (("wire.json", wire_vectors), ("security.json", security_vectors)):
        path = folder / name
        text = json.dumps(make(), indent=2) + "\n"
        try:
            if args.check:
                if not path.is_file() or path.read_text() != text:
                    stale.append(str(path))
                continue
            path.write_text(text)
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            verb = "read" if args.check else "write"
            raise UsageError(f"cannot {verb} {path}: {reason}") from None
        print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run `catsproto vectors`", file=sys.stderr)
        return 1
    if args.check:
        print(f"the vector files in {folder} match the code")
    return 0


def _version() -> str:
    """The installed package's version (pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("catsproto")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="catsproto",
        description="KV-cache-aware CATS: cache-state advertisements in a BGP path attribute.\n\n"
        "`catsproto COMMAND --help` explains each command; bad input exits with status 2 "
        "and one line on stderr.",
    )
    parser.add_argument(
        "--version", action="version", version=f"catsproto {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "decode",
        help="attribute bytes (hex or raw) -> JSON",
        description="Decode an advertisement from hex text or raw bytes and print its JSON. "
        f"Hex input: {HEX_INPUT_RULE}. Printable text that is not hex is refused.",
    )
    p.add_argument("file", nargs="?", default="-", help="input file, or - for stdin")
    p.add_argument(
        "--attribute",
        action="store_true",
        help="input is the whole path attribute (flags, type, length, value), not only its value",
    )
    add_type_code(p)
    p.add_argument("--compact", action="store_true", help="one-line JSON")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser(
        "encode",
        help="JSON -> hex of the attribute value",
        description="Encode advertisement JSON (an object, or a list of them) to hex, "
        "one line each.",
    )
    p.add_argument("file", nargs="?", default="-", help="input file, or - for stdin")
    p.add_argument(
        "--attribute",
        action="store_true",
        help="print the whole path attribute (flags, type, length, value)",
    )
    add_type_code(p)
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser(
        "demo",
        help="the end-to-end demo: the codec, the 4-site BGP lab with the path selector, "
        "then the steering policies on the Mooncake trace",
        description="Show the codec on the example advertisements, then bring up the "
        "4-site lab (network namespaces with FRR and BIRD as root; ExaBGP on loopback "
        "otherwise), watch signed advertisements arrive, ask the path selector where "
        "each site's cached conversation should go, and tear everything down (as root "
        "the instances seal their cache sections, and a capture of the receiver's BGP "
        "sessions is kept with the `catsproto inspect` commands that verify it and open "
        "it); then run the steering policies on a slice of the Mooncake conversation "
        "trace.",
    )
    p.add_argument("--codec-only", action="store_true", help="only the codec part")
    p.add_argument("--embedded", action="store_true", help="lab on loopback even as root")
    p.add_argument("--no-eval", action="store_true", help="skip the trace-driven evaluation")
    p.add_argument(
        "--no-download",
        action="store_true",
        help="do not download the Mooncake trace when it is not found (the evaluation part "
        "is then skipped; also: CATSPROTO_NO_DOWNLOAD=1)",
    )
    p.add_argument(
        "--no-engine",
        action="store_true",
        help="no real vLLM engines in the namespaced lab (by default sites 2 and 3 run one "
        "each when scripts/setup installed them, and a conversation goes through the "
        "OpenAI-compatible ingress)",
    )
    p.add_argument(
        "--no-seal",
        action="store_true",
        help="leave the instances' cache sections unsealed (the namespaced lab seals them "
        "under the lab's group key, as `lab demo --seal`; loopback never does)",
    )
    p.add_argument(
        "--eval-requests",
        type=whole_number(1),
        default=3000,
        metavar="N",
        help="requests of the trace the evaluation part uses (default 3000, about 20 s)",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "vectors",
        help="write (or --check) the codec's and security layer's test vectors",
        description="Generate the test vectors from the code and write them to two files in "
        "DIR: wire.json (the codec's positive and negative vectors) and security.json (keys, "
        "a delegation, a trust file, signed and sealed values and the receiver's verdicts). "
        "With --check, write nothing and exit 1 if either file differs from what the code "
        "generates. DIR is relative to the working directory: run it from the checkout's "
        "root to update tests/vectors.",
    )
    p.add_argument(
        "dir",
        nargs="?",
        default="tests/vectors",
        help="folder of wire.json and security.json, relative to the working directory",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if wire.json or security.json differs from the code",
    )
    p.set_defaults(func=cmd_vectors)

    import catsproto.commands

    for info in sorted(pkgutil.iter_modules(catsproto.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"catsproto.commands.{info.name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the words its errors start with: a subcommand may name itself whole, as argparse's
    # own errors for it do (`catsproto instance serve: ...`)
    prog = getattr(args, "command_prog", None) or f"catsproto {args.command}"
    try:
        return args.func(args)
    except (wire.CodecError, UsageError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # Ctrl-C: what the command started is cleaned up on the way
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
