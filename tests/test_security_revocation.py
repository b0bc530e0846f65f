"""Revoking a node key sticks, and operators stay inside their scope.

A delegation stays valid until it expires, so removing a key's authorisation is not
enough: the node can carry the same operator-signed delegation in its next
advertisement. These tests drive the real receiver (and the receive daemon's trust-file
verifier over a real file) with such advertisements."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.security import OperatorScope, Reason, TrustFileError, TrustStore
from catsproto.security.vectors import NLRI, NOW_MS, fixture, seed
from tests.test_robust_receiver import _cli

F = fixture()
KEY = F.node.key_id
OPERATOR2 = security.SigningKey.from_seed(seed("operator-2"))
NODE2 = security.SigningKey.from_seed(seed("node-2"))


def _signed(seq: int, *, carry: bool = False, key: security.SigningKey = F.node) -> bytes:
    adv = F.at(1, seq)
    if carry:
        adv = adv.replace(F.delegation)
    return wire.encode(security.sign(adv, key, NLRI))


def _operator_only() -> TrustStore:
    return TrustStore().with_operator(F.operator.public.raw, "operator-1")


def _rewrite(path: Path, obj: object) -> None:
    """Write `obj` as JSON and make sure the file's stamp moves on."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(json.dumps(obj))
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


# ---- the store ------------------------------------------------------------------------


def test_without_key_refuses_the_same_delegation_carried_in_band():
    receiver = security.Receiver(F.trust.without_key(KEY))
    verdict, after = receiver.receive(_signed(1), NLRI, NOW_MS)
    assert verdict.reason is Reason.UNKNOWN_KEY and "is revoked" in verdict.detail
    verdict, after = after.receive(_signed(2, carry=True), NLRI, NOW_MS)
    assert verdict.reason is Reason.BAD_DELEGATION
    assert verdict.detail == f"key {KEY.hex()} is revoked; its delegation is refused"
    assert after.trust is receiver.trust and after.trust.lookup(KEY) is None
    assert after.window is receiver.window


def test_a_carried_delegation_of_a_key_never_revoked_is_still_learned():
    receiver = security.Receiver(_operator_only())
    verdict, after = receiver.receive(_signed(1, carry=True), NLRI, NOW_MS)
    assert verdict.ok and after.trust.lookup(KEY) is not None


def test_revoked_keys_survive_other_changes_to_the_store():
    store = F.trust.without_key(KEY).with_operator(OPERATOR2.public.raw, "operator-2")
    store = store.without_operator(OPERATOR2.key_id)
    assert store.revoked == {KEY}
    with pytest.raises(security.BadDelegationError, match="is revoked"):
        store.with_delegation(F.delegation)


def test_trust_file_round_trip_keeps_revoked_keys_and_leaves_their_delegations_out():
    obj = F.trust.to_json()
    assert "revoked_keys" not in obj  # files without the field: as before
    assert TrustStore.from_json(obj).lookup(KEY) is not None
    obj["revoked_keys"] = [KEY.hex()]
    store = TrustStore.from_json(obj)  # revocation wins over the delegation next to it
    assert store.lookup(KEY) is None and store.revoked == {KEY}
    assert TrustStore.from_json(store.to_json()).revoked == {KEY}
    assert store.to_json()["revoked_keys"] == [KEY.hex()]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("zz", 'revoked_keys is "zz", not a list'),
        (["zz"], 'revoked_keys[0] "zz" is not hex'),
        ([5], "revoked_keys[0] is 5, not a hex string"),
        (["abcd"], 'revoked_keys[0] "abcd" is 2 bytes, a key id is 8'),
    ],
)
def test_bad_revoked_keys_name_the_entry(value, message):
    obj = F.trust.to_json()
    obj["revoked_keys"] = value
    with pytest.raises(TrustFileError) as info:
        TrustStore.from_json(obj)
    assert str(info.value) == message


# ---- reloads: a delegation gone from the file is revoked for the process's life --------


class Daemon:
    """The receive daemon's real `run` loop, RIB and trust-file verifier."""

    def __init__(self, trust: Path) -> None:
        self.verifier = rx.TrustFileVerifier(trust, clock=lambda: NOW_MS / 1000, log=print)
        self.rib = rx.CacheRib(verifier=self.verifier)

    def feed(self, value: bytes) -> tuple[str, str]:
        line = json.dumps(
            {
                "type": "update",
                "neighbor": {
                    "address": {"peer": "10.0.0.1"},
                    "message": {
                        "update": {
                            "attribute": {"attribute-0xFF-0xC0": value.hex()},
                            "announce": {"ipv4 unicast": {"10.0.0.1": [{"nlri": str(NLRI)}]}},
                        }
                    },
                },
            }
        )
        changes: list[rx.Change] = []
        rx.run([line], self.rib, changes.append)
        ((change,),) = [changes]
        return change.kind, change.reason


def test_a_delegation_removed_from_the_file_cannot_come_back_in_band(tmp_path):
    path = tmp_path / "trust.json"
    path.write_text(json.dumps(F.trust.to_json()))
    daemon = Daemon(path)
    assert daemon.feed(_signed(1)) == ("accept", "")
    _rewrite(path, _operator_only().to_json())  # the operator removes the node's key
    kind, reason = daemon.feed(_signed(2))
    assert (kind, reason) == (
        "treat-as-withdraw",
        f"not verified: unknown-key: signing key {KEY.hex()} is revoked",
    )
    kind, reason = daemon.feed(_signed(3, carry=True))
    assert kind == "treat-as-withdraw" and reason.startswith("not verified: bad-delegation")
    assert "is revoked" in reason
    _rewrite(path, _operator_only().to_json())  # another edit, read anew
    kind, reason = daemon.feed(_signed(4, carry=True))  # still revoked: same process
    assert kind == "treat-as-withdraw" and "is revoked" in reason
    assert daemon.verifier.loads == 3
    _rewrite(path, F.trust.to_json())  # the file itself delegates the key again
    assert daemon.feed(_signed(5)) == ("accept", "")


def test_reloaded_revokes_only_what_left_the_file():
    old = F.trust.with_operator(OPERATOR2.public.raw, "operator-2")
    receiver = security.Receiver(old)
    same = security.Receiver(old).reloaded(TrustStore.from_json(old.to_json()), old)
    assert same.trust.revoked == frozenset()
    gone = receiver.reloaded(_operator_only(), old)
    assert gone.trust.revoked == {KEY}
    again = gone.reloaded(F.trust, _operator_only())
    assert again.trust.revoked == frozenset() and again.trust.lookup(KEY) is not None


def test_a_key_learned_in_band_is_not_revoked_by_a_reload(tmp_path):
    path = tmp_path / "trust.json"
    path.write_text(json.dumps(_operator_only().to_json()))
    daemon = Daemon(path)
    assert daemon.feed(_signed(1, carry=True)) == ("accept", "")  # never in the file
    _rewrite(path, _operator_only().to_json() | {"delegations": []})
    assert daemon.feed(_signed(2)) == ("accept", "")


# ---- the CLI writes what it removes into revoked_keys --------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("revoke")
    (d / "op.key").write_text(json.dumps(F.operator.to_json("op")))
    (d / "op.key").chmod(0o600)  # a private key file others may read is refused
    (d / "deleg.json").write_text(json.dumps(security.delegation_to_json(F.delegation)))
    done = _cli("trust", "--operator", "op.key", "--delegation", "deleg.json", cwd=d)
    assert done.returncode == 0, done.stderr
    (d / "old.json").write_text(done.stdout)
    return d


def test_trust_previous_writes_the_removed_key_as_revoked_and_a_restart_keeps_it(files):
    done = _cli("trust", "--operator", "op.key", "--previous", "old.json", cwd=files)
    assert done.returncode == 0, done.stderr
    new = json.loads(done.stdout)
    assert new["revoked_keys"] == [KEY.hex()] and new["delegations"] == []
    (files / "new.json").write_text(done.stdout)
    fresh = Daemon(files / "new.json")  # a receiver started after the change
    kind, reason = fresh.feed(_signed(1, carry=True))
    assert kind == "treat-as-withdraw" and "is revoked" in reason
    # the revocation is carried on by the next rebuild from this file
    done = _cli("trust", "--operator", "op.key", "--previous", "new.json", cwd=files)
    assert json.loads(done.stdout)["revoked_keys"] == [KEY.hex()]


def test_trust_revoke_and_renewal(files):
    done = _cli("trust", "--operator", "op.key", "--revoke", KEY.hex(), cwd=files)
    assert done.returncode == 0 and json.loads(done.stdout)["revoked_keys"] == [KEY.hex()]
    kept = _cli(
        "trust",
        "--operator",
        "op.key",
        "--delegation",
        "deleg.json",
        "--previous",
        "old.json",
        cwd=files,
    )
    assert kept.returncode == 0 and "revoked_keys" not in json.loads(kept.stdout)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--revoke", "zz"), ("--revoke 'zz' is not a hex key id",)),
        (("--revoke", "abcd"), ("--revoke 'abcd' is 2 bytes",)),
        (
            ("--revoke", KEY.hex(), "--delegation", "deleg.json"),
            (f"delegation of key {KEY.hex()}, which is revoked",),
        ),
        (("--previous", "op.key"), ("previous trust file",)),
    ],
)
def test_trust_revocation_usage_errors(files, args, words):
    done = _cli("trust", "--operator", "op.key", *args, cwd=files)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
    for word in words:
        assert word in done.stderr, done.stderr


# ---- operator scopes -----------------------------------------------------------------


SCOPE1 = OperatorScope.of(  # F.delegation's scope lies inside
    cs_ids=[100, 200],
    routes=["10.0.0.0/16", "2001:db8::/32"],
    addresses=["192.0.2.0/24", "2001:db8::/48"],
)
SCOPE2 = OperatorScope.of(cs_ids=[300], routes=["10.9.0.0/16"], addresses=["198.51.100.0/24"])


def _delegation(
    operator, node, cs_ids=(100,), routes=("10.0.0.0/16",), addresses=("192.0.2.11/32",)
):
    return security.authorise(
        operator,
        node.public.raw,
        cs_ids=cs_ids,
        routes=routes,
        addresses=addresses,
        not_before_ms=NOW_MS - 1000,
        not_after_ms=NOW_MS + 86_400_000,
    )


def _two_operators(scope2: OperatorScope | None = SCOPE2) -> TrustStore:
    store = TrustStore().with_operator(F.operator.public.raw, "operator-1", SCOPE1)
    store = store.with_operator(OPERATOR2.public.raw, "operator-2", scope2)
    return store.with_delegation(F.delegation)


def test_an_operator_cannot_authorise_a_node_as_another_operators_instance():
    impostor = _delegation(OPERATOR2, NODE2)  # operator 1's CS-ID, route, address
    adv = F.at(0xFFFFFFFF, 1).replace(impostor)
    receiver = security.Receiver(_two_operators())
    verdict, after = receiver.receive(wire.encode(security.sign(adv, NODE2, NLRI)), NLRI, NOW_MS)
    assert verdict.reason is Reason.BAD_DELEGATION
    assert verdict.detail == (
        f"delegation of key {NODE2.key_id.hex()} by operator-2: CS-ID 100 is outside operator scope"
    )
    assert after.trust is receiver.trust and after.window is receiver.window
    real, _ = after.receive(_signed(1), NLRI, NOW_MS)
    assert real.ok  # operator 1's instance is not shadowed by a higher epoch


@pytest.mark.parametrize(
    ("kwargs", "outside"),
    [
        ({"cs_ids": (300, 100)}, "CS-ID 100"),
        (
            {"cs_ids": (300,), "routes": ("10.0.0.0/8",), "addresses": ("198.51.100.1/32",)},
            "route 10.0.0.0/8",
        ),
        (
            {"cs_ids": (300,), "routes": ("10.9.1.0/24",), "addresses": ("198.51.0.0/16",)},
            "address 198.51.0.0/16",
        ),
        (
            {
                "cs_ids": (300,),
                "routes": ("10.9.1.0/24", "2001:db8::/32"),
                "addresses": ("198.51.100.1/32",),
            },
            "route 2001:db8::/32",
        ),
    ],
)
def test_every_scope_entry_must_lie_within_the_operator_scope(kwargs, outside):
    d = _delegation(OPERATOR2, NODE2, **kwargs)
    with pytest.raises(security.BadDelegationError, match="outside operator scope") as info:
        _two_operators().check_delegation(d)
    assert f": {outside} is outside operator scope" in str(info.value)


def test_a_delegation_within_the_operator_scope_and_an_unscoped_operator_are_accepted():
    inside = _delegation(
        OPERATOR2, NODE2, cs_ids=(300,), routes=("10.9.4.0/24",), addresses=("198.51.100.7/32",)
    )
    assert _two_operators().check_delegation(inside).key_id == NODE2.key_id
    anything = _delegation(OPERATOR2, NODE2)  # no scope: today's behaviour
    assert _two_operators(scope2=None).check_delegation(anything).key_id == NODE2.key_id


def test_trust_file_operator_scope_round_trip_and_a_delegation_outside_it_is_refused():
    store = _two_operators()
    obj = store.to_json()
    assert obj["operators"][1]["scope"] == {
        "cs_ids": [300],
        "routes": ["10.9.0.0/16"],
        "addresses": ["198.51.100.0/24"],
    }
    assert TrustStore.from_json(obj).operators[OPERATOR2.key_id].scope == SCOPE2
    obj["delegations"].append(security.delegation_to_json(_delegation(OPERATOR2, NODE2)))
    with pytest.raises(TrustFileError) as info:
        TrustStore.from_json(obj)
    assert str(info.value).startswith("delegations[1]: delegation of key")
    assert str(info.value).endswith("CS-ID 100 is outside operator scope")


@pytest.mark.parametrize(
    ("scope", "message"),
    [
        (5, "operators[0]: scope is 5, not a JSON object"),
        ({"cs_ids": [1]}, "operators[0]: scope lacks routes, addresses"),
        (
            {"cs_ids": ["x"], "routes": [], "addresses": []},
            'operators[0]: scope: cs_ids[0] is "x", not an integer',
        ),
        (
            {"cs_ids": [1], "routes": "10.0.0.0/8", "addresses": []},
            'operators[0]: scope: routes is "10.0.0.0/8", not a list',
        ),
        (
            {"cs_ids": [1], "routes": ["10.0.0.1/8"], "addresses": ["192.0.2.0/24"]},
            "operators[0]: scope: routes[0]: 10.0.0.1/8 has host bits set",
        ),
        (
            {"cs_ids": [1], "routes": ["10.0.0.0/8"], "addresses": []},
            "operators[0]: scope: operator scope: addresses is empty (it would allow nothing)",
        ),
    ],
)
def test_bad_operator_scope_names_the_field(scope, message):
    obj = _operator_only().to_json()
    obj["operators"][0]["scope"] = scope
    with pytest.raises(TrustFileError) as info:
        TrustStore.from_json(obj)
    assert str(info.value) == message


def test_scoped_operator_in_the_file_refuses_an_in_band_delegation_outside_it(tmp_path):
    path = tmp_path / "trust.json"
    store = TrustStore().with_operator(F.operator.public.raw, "operator-1", SCOPE2)
    path.write_text(json.dumps(store.to_json()))
    kind, reason = Daemon(path).feed(_signed(1, carry=True))  # F.delegation: CS-ID 100
    assert kind == "treat-as-withdraw"
    assert reason.endswith("CS-ID 100 is outside operator scope") and "bad-delegation" in reason
