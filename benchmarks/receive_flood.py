"""What one hostile UPDATE costs the receive daemon, against one honest accept, as JSON.

The daemon's own loop (`exabgp_receive.run`: ExaBGP's JSON line in, parse, decode,
verify against a trust file, RIB, and the file sink writing `events.jsonl` and, once per
batch as when the daemon's input runs dry, `rib.json`) is fed one kind of message at a
time, and its CPU time per message is taken (`time.process_time`, best of interleaved
rounds, so the machine's other load is not counted). The baseline is an honest message:
one /32 with a fresh signed advertisement, accepted. The hostile ones, each a single
UPDATE that a BGP speaker on the path can send:

* `unsigned-400`: one unsigned value on 400 /32s (a 4 KiB UPDATE's worth of NLRI);
* `unknown-key-400`: one value signed by a key nobody authorised, on 400 /32s;
* `replayed-400`: an honest signed value, copied onto 400 /32s of the signer's scope (a
  signature covers one route, so at most one of them can verify);
* `empty-tlvs-64k`: one /32 whose value is 16,000 empty TLVs of unassigned types (64 KiB).

`ratio` is a hostile message's cost over the honest accept's; the target is at most 2.

    .venv/bin/python benchmarks/receive_flood.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from catsproto import security, wire  # noqa: E402
from catsproto.adapters import exabgp_receive as rx  # noqa: E402
from catsproto.security.vectors import NOW_MS, fixture  # noqa: E402

PEER = "10.0.0.1"
F = fixture()
HOSTS = [ipaddress.ip_network(f"10.0.{i // 250 + 10}.{i % 250 + 1}/32") for i in range(400)]


def update(value: bytes, prefixes: list[ipaddress.IPv4Network]) -> str:
    """ExaBGP's JSON for one UPDATE carrying `value` (attribute 255, flags 0xC0)."""
    routes = [{"nlri": str(p)} for p in prefixes]
    body = {
        "attribute": {"origin": "igp", "attribute-0xFF-0xC0": "0x" + value.hex()},
        "announce": {"ipv4 unicast": {PEER: routes}},
    }
    message = {"update": body}
    return json.dumps(
        {"type": "update", "neighbor": {"address": {"peer": PEER}, "message": message}}
    )


def honest(seq: int, prefix: ipaddress.IPv4Network) -> bytes:
    return wire.encode(security.sign(F.at(1, seq), F.node, prefix))


class Daemon:
    """The receive loop with a trust file and the file sink, in a folder of its own."""

    def __init__(self, folder: Path) -> None:
        trust = folder / "trust.json"
        trust.write_text(json.dumps(F.trust.to_json()))
        trust.chmod(0o644)
        verifier = rx.TrustFileVerifier(trust, clock=lambda: NOW_MS / 1000, log=lambda m: None)
        self.rib = rx.CacheRib(verifier=verifier)
        self.sink = rx.FileSink(folder / "out", self.rib, coalesce=True)

    def feed(self, line: str) -> None:
        rx.run([line], self.rib, self.sink, clock=lambda: NOW_MS / 1000, log=lambda m: None)


def per_message(daemon: Daemon, lines: Callable[[], str], n: int) -> float:
    """CPU seconds per message over `n` messages."""
    batch = [lines() for _ in range(n)]
    t = time.process_time()
    for line in batch:
        daemon.feed(line)
    daemon.sink.flush()  # as the daemon does when its input runs dry
    return (time.process_time() - t) / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds, best kept")
    p.add_argument("--honest", type=int, default=200, help="honest messages per round")
    p.add_argument("--hostile", type=int, default=5, help="hostile messages per round")
    args = p.parse_args()

    seq = iter(range(1, 10**9))
    stranger = wire.encode(security.sign(F.at(1, 1), F.stranger, HOSTS[0]))
    unsigned = wire.encode(F.at(1, 1))
    replayed = honest(1, HOSTS[0])
    head = wire.encode(F.at(1, 1))
    fill = b"".join((0x1000 + i).to_bytes(2, "big") + b"\0\0" for i in range(16_000))
    empty_tlvs = head + fill[: 0xFFFF - len(head)]  # the most one attribute holds
    kinds: dict[str, Callable[[], str]] = {
        "honest-accept": lambda: update(honest(next(seq), HOSTS[1]), [HOSTS[1]]),
        "unsigned-400": lambda: update(unsigned, HOSTS),
        "unknown-key-400": lambda: update(stranger, HOSTS),
        "replayed-400": lambda: update(replayed, HOSTS),
        "empty-tlvs-64k": lambda: update(empty_tlvs, [HOSTS[2]]),
    }
    best = dict.fromkeys(kinds, float("inf"))
    with tempfile.TemporaryDirectory(prefix="catsproto-flood-") as tmp:
        daemon = Daemon(Path(tmp))
        for _ in range(args.rounds):
            for name, make in kinds.items():
                n = args.honest if name == "honest-accept" else args.hostile
                best[name] = min(best[name], per_message(daemon, make, n))
        counters = dict(daemon.rib.counters)
    base = best["honest-accept"]
    out = {
        "benchmark": "receive_flood",
        "honest_accept_us": round(base * 1e6, 1),
        "hostile": {
            name: {"us": round(cost * 1e6, 1), "ratio": round(cost / base, 2)}
            for name, cost in best.items()
            if name != "honest-accept"
        },
        "target_ratio": 2.0,
        "counters": counters,
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
