"""The receive daemon with its signature checks in a pool of worker processes: the same
changes in the same order, the same RIB and counters as in one process, over a stream
that mixes accepts, replays, duplicates, bad signatures, unknown keys, unsigned,
malformed and multi-route values, withdrawals and a session going down; and the checks
really leave the daemon's process. `security.presign` and `check(presigned=...)` below."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.adapters.verifier_pool import VerifierPool
from catsproto.security.identity import PublicKey
from catsproto.security.vectors import NOW_MS, fixture

F = fixture()
PEER = "10.0.0.1"
HOSTS = [ipaddress.ip_network(f"10.0.9.{i}/32") for i in range(1, 5)]


def update(value: bytes | None, prefixes: list, withdraw: list | None = None) -> str:
    body: dict = {}
    if value is not None:
        body["attribute"] = {"origin": "igp", "attribute-0xFF-0xC0": "0x" + value.hex()}
        body["announce"] = {"ipv4 unicast": {PEER: [{"nlri": str(p)} for p in prefixes]}}
    if withdraw:
        body["withdraw"] = {"ipv4 unicast": [{"nlri": str(p)} for p in withdraw]}
    message = {"update": body}
    return json.dumps(
        {"type": "update", "neighbor": {"address": {"peer": PEER}, "message": message}}
    )


def signed(seq: int, prefix, key=None) -> bytes:
    return wire.encode(security.sign(F.at(1, seq), key or F.node, prefix))


def stream() -> list[str]:
    """Every kind of line the daemon meets, several per route, in an order that makes
    the replay window matter."""
    lines = []
    for seq in range(1, 13):
        for host in HOSTS[:3]:
            lines.append(update(signed(seq * 3 + HOSTS.index(host), host), [host]))
    bad = bytearray(signed(90, HOSTS[0]))
    bad[-1] ^= 1  # the signature's last byte
    lines += [
        update(signed(5, HOSTS[0]), [HOSTS[0]]),  # replayed: below the last accepted
        update(signed(40, HOSTS[1]), [HOSTS[1]]),
        update(signed(40, HOSTS[1]), [HOSTS[1]]),  # the same again: duplicate
        update(bytes(bad), [HOSTS[0]]),  # bad signature
        update(signed(91, HOSTS[2], F.stranger), [HOSTS[2]]),  # a key nobody authorised
        update(wire.encode(F.at(1, 92)), [HOSTS[3]]),  # unsigned
        update(signed(93, HOSTS[3])[:-7], [HOSTS[3]]),  # cut short: malformed
        update(signed(94, HOSTS[3]), HOSTS[:2]),  # one value on two routes
        update(None, [], withdraw=[HOSTS[2]]),
        "not json at all",
        update(signed(95, HOSTS[3]), [HOSTS[3]]),
        update(signed(96, HOSTS[0]), [HOSTS[0]]),
        json.dumps({"type": "state", "neighbor": {"address": {"peer": PEER}, "state": "down"}}),
        update(signed(97, HOSTS[1]), [HOSTS[1]]),
    ]
    return lines


def receive(tmp: Path, lines: list[str], pool: VerifierPool | None, batch: int = 32):
    trust = tmp / "trust.json"
    trust.write_text(json.dumps(F.trust.to_json()))
    trust.chmod(0o644)
    clock = lambda: NOW_MS / 1000  # noqa: E731
    verifier = rx.TrustFileVerifier(trust, clock=clock, log=lambda m: None)
    rib = rx.CacheRib(verifier=verifier)
    changes: list[dict] = []
    logged: list[str] = []
    rx.run(
        lines, rib, lambda c: changes.append(c.to_json()), clock=clock, log=logged.append,
        pool=pool, batch=batch,
    )  # fmt: skip
    snapshot, status = rib.to_json(), verifier.status()
    del snapshot["trust"]["path"], status["path"]  # each run has its own folder
    return changes, snapshot, dict(rib.counters), status, logged


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return receive(tmp_path_factory.mktemp("alone"), stream(), None)


@pytest.mark.parametrize(("workers", "batch"), [(1, 1), (1, 32), (2, 3), (2, 7)])
def test_a_pool_gives_what_one_process_gives(tmp_path, one_process, workers, batch):
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(F.trust.to_json()))
    pool = VerifierPool(workers, trust, optional=False, attribute_type=255)
    try:
        pooled = receive(tmp_path, stream(), pool, batch)
    finally:
        pool.close()
    assert pooled == one_process
    changes, _, counters, status, logged = pooled
    kinds = [c["kind"] for c in changes]
    # the stream did meet every case (so the equality above says something)
    assert kinds.count("accept") >= 36 and "treat-as-withdraw" in kinds
    assert {"replayed", "bad-signature", "unknown-key", "unsigned", "duplicate"} <= set(
        status["verdicts"]
    )
    assert counters["unparsed_messages"] == 1 and len(logged) == 1


def test_the_checks_leave_the_daemons_process(tmp_path, monkeypatch):
    """With a pool, an honest value is accepted without a check of the node's signature
    in this process (the workers, forked before the count starts, did them); without,
    one each."""
    calls = []
    real = PublicKey.verify
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(F.trust.to_json()))
    pool = VerifierPool(2, trust, optional=False, attribute_type=255)
    try:
        pool.submit([]).result()  # the workers exist before the count below starts
        monkeypatch.setattr(  # the node's signatures (a carried delegation's is checked
            PublicKey,  # here once, by the operator's key, when it is first learned)
            "verify",
            lambda self, s, m: (
                (self.raw == F.node.public.raw and calls.append(1)) or real(self, s, m)
            ),
        )
        honest = [update(signed(s, HOSTS[0]), [HOSTS[0]]) for s in range(1, 21)]
        changes, *_ = receive(tmp_path, honest, pool, batch=4)
    finally:
        pool.close()
    assert [c["kind"] for c in changes] == ["accept"] * 20
    assert calls == []
    changes, *_ = receive(tmp_path, honest, None)
    assert [c["kind"] for c in changes] == ["accept"] * 20 and len(calls) == 20


def test_presign_answers_for_the_key_the_trust_store_names():
    good = signed(7, HOSTS[0])
    answer = security.presign(good, HOSTS[0], F.trust)
    assert answer is not None and answer.ok and answer.key == F.node.public.raw
    bad = bytearray(good)
    bad[-1] ^= 1
    assert security.presign(bytes(bad), HOSTS[0], F.trust).ok is False
    # the route is part of the signed message
    assert security.presign(good, HOSTS[1], F.trust).ok is False
    # nothing to check, or no key to check it with
    assert security.presign(signed(7, HOSTS[0], F.stranger), HOSTS[0], F.trust) is None
    assert security.presign(wire.encode(F.at(1, 7)), HOSTS[0], F.trust) is None
    assert security.presign(good[:-5], HOSTS[0], F.trust) is None


def test_check_uses_a_presigned_answer_only_for_its_own_key_and_signature():
    good = signed(8, HOSTS[0])
    sig = wire.decode(good).signature.signature
    # an answer for this key and signature is taken as it is (here: a wrong one, to see it)
    wrong = security.Presigned(F.node.public.raw, sig, False)
    assert security.check(good, HOSTS[0], NOW_MS, F.trust, presigned=wrong).reason.value == (
        "bad-signature"
    )
    # for another key or another signature it is not: the check is done here
    other_key = security.Presigned(F.stranger.public.raw, sig, False)
    other_sig = security.Presigned(F.node.public.raw, bytes(64), False)
    for answer in (other_key, other_sig):
        assert security.check(good, HOSTS[0], NOW_MS, F.trust, presigned=answer).ok


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--verify-workers", "2"], "there are no signatures to check without --trust"),
        (["--verify-workers", "-1", "--trust", "t.json"], "--verify-workers -1: give 0 or more"),
    ],
)
def test_verify_workers_usage_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        rx.main(["--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
