"""Codec throughput against scapy's dissection of the same BGP UPDATE, in one run.

Prints JSON: for a small (metrics only) and a large (16 KiB summary) advertisement,
encode and decode operations per second and MB/s, and the ratio of our decode rate
to scapy's rate dissecting the whole UPDATE that carries it (scapy sees our attribute
as raw bytes, so its figure is the cost of framing alone: a floor, not a rival codec).

    python benchmarks/codec.py [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import time
from collections.abc import Callable

from catsproto import wire
from catsproto.examples import large_advertisement, small_advertisement
from catsproto.wire.bgp import build_update


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second, best of three rounds (noise only ever slows a round down)."""
    best = 0.0
    for _ in range(3):
        n, start = 0, time.perf_counter()
        deadline = start + seconds / 3
        while True:
            for _ in range(50):
                fn()
            n += 50
            now = time.perf_counter()
            if now >= deadline:
                break
        best = max(best, n / (now - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    args = parser.parse_args()

    from scapy.contrib import bgp as scapy_bgp

    scapy_bgp.bgp_module_conf.use_2_bytes_asn = False
    results = {}
    for label, adv in (("small", small_advertisement()), ("large", large_advertisement())):
        value = wire.encode(adv)
        update = build_update(
            [ipaddress.ip_network("10.255.0.1/32")],
            ipaddress.ip_address("10.0.12.1"),
            [wire.encode_attribute(value)],
            as_path=(65001,),
        )
        assert wire.decode(value) == adv
        enc = rate(lambda adv=adv: wire.encode(adv), args.seconds)
        dec = rate(lambda value=value: wire.decode(value), args.seconds)
        scapy = rate(lambda update=update: scapy_bgp.BGPHeader(update), args.seconds)
        results[label] = {
            "value_bytes": len(value),
            "update_bytes": len(update),
            "encode_per_s": round(enc),
            "decode_per_s": round(dec),
            "decode_mb_per_s": round(dec * len(value) / 1e6, 1),
            "scapy_dissect_update_per_s": round(scapy),
            "decode_vs_scapy_ratio": round(dec / scapy, 2),
        }
    print(json.dumps({"benchmark": "codec", **results}, indent=2))


if __name__ == "__main__":
    main()
