"""TCP reassembly cost of `adapters.pcap.BGPStreams` as the out-of-order backlog grows.

Prints JSON: CPU seconds to reassemble n one-byte segments sent in reverse order (every
one waits until the very first arrives and fills the gap) for n = 2,000 and 8,000, best
of a few rounds each, and the ratio of the two times. Linear reassembly gives a ratio
near 4; one that rescans its backlog per segment gives near 16.

    python benchmarks/pcap_reassembly.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time

from catsproto.adapters.pcap import MAX_PENDING_SEGMENTS, BGPStreams, Segment

FLOW = ("10.0.0.1", 179, "10.0.0.2", 40000)
ISN = 999  # the SYN's sequence: data starts at 1000


def reversed_segments(n: int) -> list[Segment]:
    """A SYN, then bytes 2..n+1 of the stream one segment each, last first, then byte 1."""
    segs = [Segment(0.0, FLOW, ISN, True, False, False, b"")]
    segs += [Segment(0.0, FLOW, ISN + 1 + i, False, False, False, b"\xff") for i in range(n, 0, -1)]
    segs.append(Segment(0.0, FLOW, ISN + 1, False, False, False, b"\xff"))
    return segs


def cpu_seconds(n: int, rounds: int) -> float:
    """Best CPU time over `rounds` to feed the reversed segments (noise only slows a round)."""
    best = float("inf")
    for _ in range(rounds):
        segs = reversed_segments(n)
        streams = BGPStreams()
        start = time.process_time()
        for seg in segs:
            streams.feed(seg)
        best = min(best, time.process_time() - start)
        assert not streams.problems  # every segment was kept and the gap filled
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size (best kept)")
    args = parser.parse_args()
    small, large = 2_000, 8_000
    assert large < MAX_PENDING_SEGMENTS
    t_small = cpu_seconds(small, args.rounds)
    t_large = cpu_seconds(large, args.rounds)
    print(
        json.dumps(
            {
                "segments": {str(small): round(t_small, 6), str(large): round(t_large, 6)},
                "ratio_8000_to_2000": round(t_large / t_small, 2),
                "linear_ratio": large / small,
                "max_pending_segments": MAX_PENDING_SEGMENTS,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
