"""The receive daemon (`python -m catsproto.adapters.exabgp_receive`) verifies
signatures for the attribute type it reads (--type-code)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.security.vectors import NLRI, fixture

F = fixture()
PEER = "10.0.0.1"


def _update(value: bytes, type_code: int = 255) -> str:
    attribute = f"attribute-0x{type_code:02X}-0xC0"
    return json.dumps(
        {
            "type": "update",
            "neighbor": {
                "address": {"peer": PEER},
                "message": {
                    "update": {
                        "attribute": {attribute: "0x" + value.hex()},
                        "announce": {"ipv4 unicast": {PEER: [{"nlri": str(NLRI)}]}},
                    }
                },
            },
        }
    )


def _trust_for_now(now_ms: int) -> security.TrustStore:
    delegation = security.authorise(
        F.operator,
        F.node.public.raw,
        cs_ids=[100],
        routes=["10.0.0.0/16"],
        addresses=["192.0.2.0/24"],
        not_before_ms=now_ms - 60_000,
        not_after_ms=now_ms + 3_600_000,
    )
    store = security.TrustStore().with_operator(F.operator.public.raw, "op")
    return store.with_delegation(delegation)


def _daemon(tmp_path: Path, lines: list[str], *args: str) -> tuple[list[dict], str]:
    """Run the real daemon as ExaBGP does, feed `lines`, close its input; its events."""
    out = tmp_path / "rib"
    proc = subprocess.run(
        [sys.executable, "-m", "catsproto.adapters.exabgp_receive", "--out", str(out), *args],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    text = (out / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()], proc.stderr


# ---- --type-code reaches the verifier -------------------------------------------------


def test_daemon_verifies_for_the_type_code_it_reads(tmp_path):
    now = int(time.time() * 1000)  # the process reads its own clock
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(_trust_for_now(now).to_json()))

    def value(seq: int, attribute_type: int) -> bytes:
        adv = F.base.replace(wire.Sequence(1, seq), wire.Timestamp(now))
        return wire.encode(security.sign(adv, F.node, NLRI, attribute_type))

    lines = [
        _update(value(1, 42), type_code=42),  # signed for the type it arrives in
        _update(value(2, 255), type_code=42),  # signed for 255, moved into attribute 42
    ]
    events, _ = _daemon(tmp_path, lines, "--type-code", "42", "--trust", str(trust))
    assert [e["kind"] for e in events] == ["accept", "treat-as-withdraw"]
    assert events[0]["entry"]["verified"] is True and events[0]["entry"]["sequence"] == 1
    assert events[1]["reason"].startswith("not verified: bad-signature")
    # and the default type still works as before
    events, _ = _daemon(tmp_path / "d", [_update(value(3, 255))], "--trust", str(trust))
    assert [e["kind"] for e in events] == ["accept"]


def test_run_refuses_a_verifier_for_another_type_code(tmp_path):
    verifier = rx.TrustFileVerifier(tmp_path / "trust.json", log=lambda m: None)
    with pytest.raises(ValueError, match="attribute type 255, the attribute is read as type 42"):
        rx.run([], rx.CacheRib(verifier=verifier), lambda c: None, type_code=42)
    ok = rx.TrustFileVerifier(tmp_path / "trust.json", attribute_type=42, log=lambda m: None)
    rx.run([], rx.CacheRib(verifier=ok), lambda c: None, type_code=42)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--type-code", "300"), ("--type-code", "300 outside 0..255")),
    ],
)
def test_daemon_bad_options_are_usage_errors(tmp_path, args, words):
    done = subprocess.run(
        [sys.executable, "-m", "catsproto.adapters.exabgp_receive", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    for word in words:
        assert word in done.stderr, done.stderr
