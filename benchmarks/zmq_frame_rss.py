"""What one oversized KV-event frame costs the node's subscriber in memory, as JSON.

A publisher in another process sends a single frame of `--mib` MiB (160 by default, the
size issue #41 row 14 used) to a `VllmEventSubscriber`, once with no maximum message size
(`max_message_bytes=-1`, as before the fix) and once with the default `ZMQ_MAXMSGSIZE`
(`MAX_MESSAGE_BYTES`, 16 MiB). Each case runs in a fresh process, which reports how much
its peak RSS (`ru_maxrss`) grew while the frame was sent and how many frames it took in.

    .venv/bin/python benchmarks/zmq_frame_rss.py [--mib 160]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SENDER = """
import sys, time, zmq
c = zmq.Context(); p = c.socket(zmq.PUB); p.connect(sys.argv[1]); time.sleep(0.5)
p.send_multipart([b"", (0).to_bytes(8, "big"), b"\\0" * (int(sys.argv[2]) << 20)])
time.sleep(2); p.close(0); c.term()
"""


def one_case(limit: int, mib: int) -> dict[str, object]:
    """In this process: a subscriber with `limit`, the frame from a child process."""
    import zmq

    from catsproto.adapters.vllm_events import RankEndpoint, VllmEventSubscriber
    from catsproto.keys import BlockKeyer
    from catsproto.node import TieredCache, TierSpec, VllmIngest
    from catsproto.wire import Tier

    ctx = zmq.Context()
    ingest = VllmIngest(TieredCache([TierSpec(Tier.HBM, 64, 5, 1)]), BlockKeyer(b"k" * 32, "m", 16))
    with VllmEventSubscriber(
        ingest,
        [RankEndpoint(0, "tcp://127.0.0.1:*", None, bind=True)],
        context=ctx,
        max_message_bytes=limit,
    ) as sub:
        where = sub.bound_endpoints()[0]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sender = subprocess.Popen([sys.executable, "-c", SENDER, where, str(mib)])
        end = time.monotonic() + 4
        while time.monotonic() < end:
            sub.poll(50)
        sender.wait(timeout=30)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        frames = sub.stats.frames
    ctx.term()
    return {"max_message_bytes": limit, "frames": frames, "peak_rss_growth_mib": round(grew / 1024)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=160, help="size of the frame sent")
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # run one case (a child)
    args = p.parse_args()
    if args.case is not None:
        print(json.dumps(one_case(args.case, args.mib)))
        return 0
    from catsproto.adapters.vllm_events import MAX_MESSAGE_BYTES

    cases = []
    for limit in (-1, MAX_MESSAGE_BYTES):
        out = subprocess.run(
            [sys.executable, __file__, "--mib", str(args.mib), "--case", str(limit)],
            capture_output=True,
            text=True,
            check=True,
        )
        cases.append(json.loads(out.stdout))
    print(json.dumps({"frame_mib": args.mib, "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
