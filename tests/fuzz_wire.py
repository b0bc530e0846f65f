"""Mutation fuzzer for the codec: any input either decodes (canonically) or raises
CodecError. Run: python -m tests.fuzz_wire --iterations 1000000 [--seed N]

Mutates the positive test vectors (bit flips, byte overwrites, insertions, deletions,
splices between vectors, length-field nudges) and decodes each result, both as an
attribute value and as a whole path attribute. Every attribute value is also decoded
by the reference decoder alone (`wire.decode_from`), which must agree with `decode`
(same objects, or the same error). Prints a JSON summary; exit status 1 if any other
exception escaped, an accepted input did not re-encode byte for byte, or the two
decoders disagreed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from pathlib import Path

from catsproto import wire

SEEDS = [
    bytes.fromhex(v["hex"])
    for v in json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())["positive"]
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(buf) + 1)
        if op == 0 and buf and at < len(buf):
            buf[at] ^= 1 << rng.randrange(8)
        elif op == 1 and at < len(buf):
            buf[at] = rng.randrange(256)
        elif op == 2:
            buf[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and buf:
            del buf[at : at + rng.randint(1, 8)]
        elif op == 4:
            other = rng.choice(SEEDS)
            cut = rng.randrange(len(other) + 1)
            buf[at:] = other[cut:]
        elif op == 5 and len(buf) >= 4 and at + 4 <= len(buf):
            # nudge a 16-bit big-endian field (often a TLV length) by a small amount
            value = (
                int.from_bytes(buf[at + 2 : at + 4], "big") + rng.choice((-2, -1, 1, 2))
            ) & 0xFFFF
            buf[at + 2 : at + 4] = value.to_bytes(2, "big")
    return bytes(buf)


def _against_reference(
    data: bytes, adv: wire.Advertisement | None, error: wire.CodecError | None
) -> str:
    """How `decode`'s answer differs from the reference decoder's ("" if it does not)."""
    try:
        ref = wire.decode_from(wire.Reader(data))
    except wire.CodecError as exc:
        if error is None:
            return f"decode accepts what the reference refuses: {exc}"
        if (type(exc), exc.reason, exc.offset, exc.tlv_type) != (
            type(error),
            error.reason,
            error.offset,
            error.tlv_type,
        ):
            return f"errors differ: {error!r} against the reference's {exc!r}"
        return ""
    if adv is None:
        return f"decode refuses what the reference accepts: {error}"
    return "" if repr(adv) == repr(ref) else "decoded objects differ from the reference's"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    counts = {
        "accepted": 0,
        "codec_error": 0,
        "other_exception": 0,
        "not_canonical": 0,
        "reference_disagrees": 0,
    }
    by_class: dict[str, int] = {}
    first_failure = None
    start = time.perf_counter()
    for i in range(args.iterations):
        data = mutate(rng, rng.choice(SEEDS))
        as_attribute = i % 2 == 1
        if as_attribute:
            data = wire.encode_attribute(data[:0xFFFF])
        adv = error = None
        try:
            adv = wire.decode_attribute_value(data) if as_attribute else wire.decode(data)
        except wire.CodecError as exc:
            error = exc
            counts["codec_error"] += 1
            by_class[type(exc).__name__] = by_class.get(type(exc).__name__, 0) + 1
        except Exception:
            counts["other_exception"] += 1
            first_failure = first_failure or (data.hex(), traceback.format_exc())
        if not as_attribute and (disagreement := _against_reference(data, adv, error)):
            counts["reference_disagrees"] += 1
            first_failure = first_failure or (data.hex(), disagreement)
        if adv is not None:
            counts["accepted"] += 1
            value = wire.encode(adv)
            if (wire.encode_attribute(value) if as_attribute else value) != data:
                counts["not_canonical"] += 1
                first_failure = first_failure or (data.hex(), "accepted but re-encodes differently")
        if not args.quiet and (i + 1) % 50_000 == 0:
            rate = (i + 1) / (time.perf_counter() - start)
            print(f"\r{i + 1}/{args.iterations} inputs, {rate:,.0f}/s", end="", file=sys.stderr)
    if not args.quiet and args.iterations >= 50_000:
        print(file=sys.stderr)
    report = {
        "iterations": args.iterations,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - start, 2),
        **counts,
        "codec_errors_by_class": dict(sorted(by_class.items())),
    }
    print(json.dumps(report, indent=2))
    if first_failure:
        print(f"first failure on input {first_failure[0]}:\n{first_failure[1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
