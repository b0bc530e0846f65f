"""A real capture shared by the inspect and dissector tests, recorded once per run.

Four sites' instances (each with its own Ed25519 key, delegated by one operator key)
announce signed advertisements through ExaBGP; one is sealed under a group key, one is
20 KB (an extended message spread over ~15 TCP segments). Three more routes carry a
forged advertisement (altered after signing), one signed by an unauthorised key and a
malformed one. `EXPECTED` says what `inspect --trust` must make of each prefix.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import ipaddress
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from catsproto import security, wire
from catsproto.adapters.capture import Announcement, CaptureResult, record_capture

CS_ID = 100
OPERATOR = security.SigningKey.from_seed(bytes(range(32)))
NODES = {site: security.SigningKey.from_seed(bytes([site]) * 32) for site in (1, 2, 3, 4)}
STRANGER = security.SigningKey.from_seed(b"\x99" * 32)
GROUP_KEY = security.GroupKey.of(7, bytes(range(100, 132)))
LARGE_BODY = 20_000

EXPECTED = {
    "10.255.0.1/32": "verified",
    "10.255.0.2/32": "verified",
    "10.255.0.3/32": "verified",
    "10.255.0.4/32": "verified",
    "10.255.9.1/32": "bad-signature",
    "10.255.9.2/32": "unknown-key",
    "10.255.9.3/32": "malformed",
}


def require_root() -> None:
    """Lab tests need root; under CI=true they must run, never skip."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("lab tests need root and CI=true forbids skipping them")
        pytest.skip("needs root (network namespaces, tcpdump)")


def _summary(tier: wire.Tier, blocks: int, body_len: int) -> wire.SummaryEntry:
    return wire.SummaryEntry(
        tier=tier,
        kind=wire.SummaryKind.EXACT,
        version=5,
        base_version=0,
        key_lo=0,
        key_hi=(1 << 64) - 1,
        entry_count=blocks,
        bytes_per_block=131072,
        fetch_latency_us=5 if tier == wire.Tier.HBM else 60,
        fetch_bandwidth_mbps=800_000,
        params=b"",
        body=bytes((i * 7) % 256 for i in range(body_len)),
    )


def advertisement(site: int, now_ms: int, body_len: int = 64) -> wire.Advertisement:
    return wire.Advertisement.build(
        wire.Version(1),
        wire.Origin(CS_ID, site, ipaddress.ip_address(f"192.0.2.{site}")),
        wire.Sequence(1, 10 + site),
        wire.Timestamp(now_ms),
        wire.MetricsL2(site + 3),
        wire.CacheModel("meta-llama/Llama-3.1-8B-Instruct", 512, wire.KeyScheme(1), 7),
        wire.CacheSummaries(
            (_summary(wire.Tier.HBM, 8 * site, body_len), _summary(wire.Tier.DRAM, 100, 32))
        ),
    )


@dataclasses.dataclass(frozen=True)
class LabCapture:
    pcap: Path
    trust: Path
    group_key: Path
    values: dict[str, bytes]  # prefix -> attribute value announced
    result: CaptureResult


def announcements(now_ms: int) -> dict[str, bytes]:
    def net(p: str) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(p)

    keyring = security.GroupKeyring(GROUP_KEY)
    values = {}
    for site in (1, 2, 3, 4):
        prefix = f"10.255.0.{site}/32"
        adv = advertisement(site, now_ms, LARGE_BODY if site == 3 else 64)
        if site == 2:
            adv = security.seal(adv, keyring, nonce=bytes(range(12)))
        values[prefix] = wire.encode(security.sign(adv, NODES[site], net(prefix)))
    forged = security.sign(advertisement(1, now_ms), NODES[1], net("10.255.9.1/32"))
    bigger = forged.replace(wire.MetricsL2(10))  # altered after signing
    values["10.255.9.1/32"] = wire.encode(bigger)
    values["10.255.9.2/32"] = wire.encode(
        security.sign(advertisement(4, now_ms), STRANGER, net("10.255.9.2/32"))
    )
    good = values["10.255.0.4/32"]
    values["10.255.9.3/32"] = good[:-3] + b"\x00"  # signature TLV cut short
    return values


def trust_json() -> dict:
    store = security.TrustStore().with_operator(OPERATOR.public.raw, "lab-operator")
    now_ms = int(time.time() * 1000)
    for site, key in NODES.items():
        store = store.with_delegation(
            security.authorise(
                OPERATOR,
                key.public.raw,
                cs_ids=[CS_ID],
                routes=[f"10.255.0.{site}/32", "10.255.9.0/24"],
                addresses=[f"192.0.2.{site}/32"],
                not_before_ms=now_ms - 3_600_000,
                not_after_ms=now_ms + 3_600_000,
            )
        )
    return store.to_json()


@functools.lru_cache(maxsize=1)
def lab_capture() -> LabCapture:
    """Record the capture (about 1.5 s) once per test run."""
    require_root()
    out = Path(tempfile.mkdtemp(prefix="catsproto-lab-capture-"))
    atexit.register(shutil.rmtree, out, True)
    values = announcements(int(time.time() * 1000))
    anns = [Announcement(ipaddress.IPv4Network(p), v) for p, v in values.items()]
    result = record_capture(out / "lab.pcap", anns)
    (out / "trust.json").write_text(json.dumps(trust_json()))
    (out / "group-key.json").write_text(json.dumps(GROUP_KEY.to_json()))
    (out / "group-key.json").chmod(0o600)  # a group key file others may read is refused
    return LabCapture(out / "lab.pcap", out / "trust.json", out / "group-key.json", values, result)
