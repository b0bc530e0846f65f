"""The receive daemon (`python -m catsproto.adapters.exabgp_receive`): it verifies
signatures for the attribute type it reads (--type-code), and its event log stays
bounded when peers re-send the same UPDATE."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.security.vectors import NLRI, NOW_MS, fixture
from tests.test_robust_receiver import trust_for_now

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
    trust.write_text(json.dumps(trust_for_now(now).to_json()))

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
        (("--events-max-bytes", "0"), ("--events-max-bytes 0: give a size above 0",)),
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


# ---- the event log -------------------------------------------------------------------


def _big_value(seq: int) -> bytes:
    """A signed value of ~30 kB (an unknown TLV as padding)."""
    adv = F.at(1, seq).replace(wire.UnknownTLV(1000, bytes(30_000)))
    return wire.encode(security.sign(adv, F.node, NLRI))


def _run_sink(tmp_path: Path, lines: list[str], **kwargs: int) -> rx.FileSink:
    verifier = rx.TrustFileVerifier(tmp_path / "trust.json", clock=lambda: NOW_MS / 1000)
    (tmp_path / "trust.json").write_text(json.dumps(F.trust.to_json()))
    rib = rx.CacheRib(verifier=verifier)
    sink = rx.FileSink(tmp_path / "out", rib, coalesce=True, **kwargs)
    rx.run(lines, rib, sink, clock=lambda: NOW_MS / 1000)
    sink.flush()
    return sink


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_re_sent_unchanged_value_is_a_short_line(tmp_path):
    first, second = _big_value(1), _big_value(2)
    lines = [_update(first)] * 50 + [_update(second)]
    sink = _run_sink(tmp_path, lines)
    events = _events(sink.events_path)
    assert [e["kind"] for e in events] == ["accept"] * 51
    assert events[0]["entry"]["value"] == first.hex() and "unchanged" not in events[0]
    for e in events[1:50]:  # the 49 duplicates: still accepted, counted, no hex
        assert e["unchanged"] is True and "value" not in e["entry"]
        assert e["entry"]["sequence"] == 1 and e["entry"]["bytes"] == len(first)
    assert events[50]["entry"]["value"] == second.hex() and "unchanged" not in events[50]
    assert sink.events_path.stat().st_size < 3 * len(first.hex())  # was ~51 full lines
    verdicts = json.loads((tmp_path / "out" / "rib.json").read_text())["trust"]["verdicts"]
    assert verdicts == {"ok": 2, "duplicate": 49}


def test_a_value_refused_in_between_is_logged_in_full_again(tmp_path):
    value = _big_value(1)
    withdraw = json.dumps(
        {
            "type": "update",
            "neighbor": {
                "address": {"peer": PEER},
                "message": {"update": {"withdraw": {"ipv4 unicast": [{"nlri": str(NLRI)}]}}},
            },
        }
    )
    sink = _run_sink(tmp_path, [_update(value), withdraw, _update(value)])
    events = _events(sink.events_path)
    assert [e["kind"] for e in events] == ["accept", "withdraw", "accept"]
    assert events[2]["entry"]["value"] == value.hex()  # not the route's state any more


def test_event_log_rotates_at_its_size_limit(tmp_path):
    limit = 200_000
    lines = [_update(_big_value(seq)) for seq in range(1, 21)]  # ~60 kB a line
    sink = _run_sink(tmp_path, lines, events_max_bytes=limit)
    current, older = sink.events_path, tmp_path / "out" / "events.jsonl.1"
    assert current.stat().st_size <= limit and older.stat().st_size <= limit
    assert sink.rotations >= 5
    newest = _events(current)
    assert newest[-1]["entry"]["sequence"] == 20  # the latest lines are in the current file
    sequences = [e["entry"]["sequence"] for e in _events(older) + newest]
    assert sequences == list(range(21 - len(sequences), 21))  # whole lines, in order


def test_daemon_rotates_its_event_log(tmp_path):
    trust = tmp_path / "trust.json"
    now = int(time.time() * 1000)
    trust.write_text(json.dumps(trust_for_now(now).to_json()))

    def value(seq: int) -> bytes:
        adv = F.base.replace(
            wire.Sequence(1, seq), wire.Timestamp(now), wire.UnknownTLV(1000, bytes(10_000))
        )
        return wire.encode(security.sign(adv, F.node, NLRI))

    lines = [_update(value(seq)) for seq in range(1, 11)]
    args = ("--trust", str(trust), "--events-max-bytes", "50000")
    events, _ = _daemon(tmp_path, lines, *args)
    older = _events(tmp_path / "rib" / "events.jsonl.1")
    assert [e["entry"]["sequence"] for e in older + events][-1] == 10
    assert (tmp_path / "rib" / "events.jsonl").stat().st_size <= 50_000
