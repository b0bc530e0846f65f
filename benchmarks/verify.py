"""Security costs, as JSON: sign, the whole receive path, bare Ed25519 verify, seal, open.

The headline is `receive_over_bare_verify`: decode + key lookup + scope + freshness +
replay + Ed25519 verify (what `Receiver.receive` does for one advertisement) divided by
a bare Ed25519 verify of the very same signed message with an already-parsed key,
measured in the same run. Target: at most 1.25. `microseconds` splits one receive into
the bare verify, the codec's decode and the rest (trust, scope, freshness, replay,
commit). Three advertisements: `metrics` (load only, the common update), `cache-state`
(the example with a 16-key summary and hot prefixes) and `large` (a 16 KiB summary).

    .venv/bin/python benchmarks/security.py [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import time
from collections.abc import Callable

import cryptography

from catsproto import security, wire
from catsproto.examples import examples, large_advertisement, small_advertisement
from catsproto.security.vectors import NOW_MS, fixture


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second: best of 5 timed batches sized to take about `seconds` / 5 each."""
    n = 1
    while True:  # calibrate
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if (elapsed := time.perf_counter() - t) > 0.02:
            break
        n *= 2
    batch = max(1, int(n * (seconds / 5) / elapsed))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        best = min(best, (time.perf_counter() - t) / batch)
    return 1.0 / best


def measure(adv: wire.Advertisement, seconds: float) -> dict[str, object]:
    f = fixture()
    nlri = ipaddress.ip_network("10.0.1.0/24")
    origin = wire.Origin(100, 1, ipaddress.ip_address("192.0.2.11"))
    adv = adv.replace(origin, wire.Timestamp(NOW_MS - 1000))
    signed = security.sign(adv, f.node, nlri)
    value = wire.encode(signed)
    message = security.signed_message(security.without_signature(value), nlri)
    sig = signed.signature.signature  # type: ignore[union-attr]
    node_key = f.node.public._key  # parsed once, as the trust store does
    receiver = security.Receiver(f.trust)
    assert receiver.check(value, nlri, NOW_MS).ok

    sealed_value = wire.encode(
        security.sign(security.seal(adv, f.group, os.urandom(12)), f.node, nlri)
    )
    sealed_adv = wire.decode(sealed_value)
    opening = security.Receiver(f.trust, group_keys=f.group)
    assert opening.check(sealed_value, nlri, NOW_MS).ok

    bare = rate(lambda: node_key.verify(sig, message), seconds)
    decode = rate(lambda: wire.decode(value), seconds)
    receive = rate(lambda: receiver.receive(value, nlri, NOW_MS), seconds)
    us = lambda per_s: round(1e6 / per_s, 1)  # noqa: E731
    return {
        "value_bytes": len(value),
        "sealed_value_bytes": len(sealed_value),
        "bare_ed25519_verify_per_s": round(bare),
        "decode_per_s": round(decode),
        "receive_per_s": round(receive),
        "receive_over_bare_verify": round(bare / receive, 3),
        "microseconds": {
            "bare_verify": us(bare),
            "decode": us(decode),
            "receive": us(receive),
            "rest_of_receive": round(us(receive) - us(decode) - us(bare), 1),
        },
        "receive_sealed_and_open_per_s": round(
            rate(lambda: opening.receive(sealed_value, nlri, NOW_MS), seconds)
        ),
        "sign_per_s": round(rate(lambda: security.sign(adv, f.node, nlri), seconds)),
        "seal_per_s": round(rate(lambda: security.seal(adv, f.group, bytes(12)), seconds)),
        "open_per_s": round(rate(lambda: security.open_sealed(sealed_adv, f.group), seconds)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="time per figure")
    args = parser.parse_args()
    results = {
        "benchmark": "security",
        "python": platform.python_version(),
        "cryptography": cryptography.__version__,
        "machine": platform.machine(),
        "advertisements": {
            "metrics": measure(small_advertisement(), args.seconds),
            "cache-state": measure(
                examples()[2].advertisement.without(wire.TLVType.SIGNATURE), args.seconds
            ),
            "large": measure(large_advertisement(16 * 1024), args.seconds),
        },
        "target_receive_over_bare_verify": 1.25,
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
