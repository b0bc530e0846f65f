"""One UPDATE, many routes: the receive daemon judges an attribute value once per message.

A signature covers one route, so a value carried on several routes of one UPDATE can be
valid for one of them at most: a verifying receiver refuses it on all of them after one
decode, without a signature check, and logs one line for the routes that had no state.
Before, it decoded and checked the value once per route (an UPDATE of 400 /32s cost 400
decodes, and a captured signed value 400 Ed25519 verifications).
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.security.vectors import NOW_MS, fixture

F = fixture()
PEER = "10.0.0.1"
HOSTS = [ipaddress.ip_network(f"10.0.{i // 250 + 10}.{i % 250 + 1}/32") for i in range(400)]


def _update(value: bytes | None, prefixes: list) -> str:
    attributes = {"origin": "igp"}
    if value is not None:
        attributes["attribute-0xFF-0xC0"] = "0x" + value.hex()
    update = {"attribute": attributes, "announce": {"ipv4 unicast": {PEER: prefixes}}}
    return json.dumps(
        {"type": "update", "neighbor": {"address": {"peer": PEER}, "message": {"update": update}}}
    )


def _routes(prefixes: list) -> list[dict]:
    return [{"nlri": str(p)} for p in prefixes]


def _signed(seq: int, prefix: ipaddress.IPv4Network, key=F.node) -> bytes:
    return wire.encode(security.sign(F.at(1, seq), key, prefix))


class Counting:
    """Counts the codec's decodes and the verifier's calls in the receive module."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, verifier) -> None:
        self.decodes = self.checks = 0
        real_decode, real_verify = wire.decode, verifier.__call__

        def decode(data, *a, **k):
            self.decodes += 1
            return real_decode(data, *a, **k)

        def check(value, adv, prefix):
            self.checks += 1
            return real_verify(value, adv, prefix)

        monkeypatch.setattr(wire, "decode", decode)
        monkeypatch.setattr(verifier, "__call__", check)


class Daemon:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        trust = tmp / "trust.json"
        trust.write_text(json.dumps(F.trust.to_json()))
        self.verifier = rx.TrustFileVerifier(trust, clock=lambda: NOW_MS / 1000, log=print)
        self.rib = rx.CacheRib(verifier=self._call)
        self.count = Counting(monkeypatch, self.verifier)

    def _call(self, value, adv, prefix):
        return self.verifier.__call__(value, adv, prefix)

    def feed(self, line: str) -> list[rx.Change]:
        changes: list[rx.Change] = []
        rx.run([line], self.rib, changes.append, clock=lambda: NOW_MS / 1000)
        return changes


@pytest.fixture
def daemon(tmp_path, monkeypatch) -> Daemon:
    return Daemon(tmp_path, monkeypatch)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("unsigned", wire.encode(F.at(1, 1))),
        ("unknown key", _signed(1, HOSTS[0], F.stranger)),
        ("captured honest value", _signed(1, HOSTS[0])),
    ],
)
def test_a_value_on_400_routes_is_judged_once_and_refused_on_all(daemon, name, value):
    changes = daemon.feed(_update(value, _routes(HOSTS)))
    assert (daemon.count.decodes, daemon.count.checks) == (1, 0), name
    (line,) = changes  # no route had state: one line for all 400
    assert line.kind == "treat-as-withdraw" and line.prefix is None and line.routes == 400
    assert "one value on 400 routes" in line.reason
    assert line.reason.startswith("not verified: not-authorised")
    assert daemon.rib.counters["not_verified"] == 400
    assert daemon.rib.entries == {}


def test_routes_with_state_are_withdrawn_one_by_one_the_rest_in_one_line(daemon):
    """The honest state of two routes is removed by name (the RIB's consumers need the
    prefix); the 398 others, which had none, share one line."""
    for seq, host in enumerate(HOSTS[:2], start=1):
        (accepted,) = daemon.feed(_update(_signed(seq, host), _routes([host])))
        assert accepted.kind == "accept" and accepted.entry.verified
    changes = daemon.feed(_update(_signed(9, HOSTS[0]), _routes(HOSTS)))
    by_route = [c for c in changes if c.prefix is not None]
    assert sorted(c.prefix for c in by_route) == HOSTS[:2]
    assert all(c.kind == "treat-as-withdraw" and c.entry is not None for c in by_route)
    (rest,) = [c for c in changes if c.prefix is None]
    assert rest.routes == 398
    assert daemon.rib.entries == {}
    as_json = rest.to_json()
    assert as_json["routes"] == 398 and "prefix" not in as_json


def test_a_malformed_value_on_many_routes_is_decoded_once(daemon):
    head = wire.encode(F.at(1, 1))
    junk = head + b"".join((0x1000 + i).to_bytes(2, "big") + b"\0\0" for i in range(100))
    (line,) = daemon.feed(_update(junk, _routes(HOSTS)))
    assert daemon.count.decodes == 1
    assert line.reason.startswith("malformed") and "the 64 a value may hold" in line.reason
    assert daemon.rib.counters["malformed"] == 400


def test_one_route_per_value_is_verified_as_before(daemon):
    (accepted,) = daemon.feed(_update(_signed(1, HOSTS[0]), _routes([HOSTS[0]])))
    assert accepted.kind == "accept" and daemon.count.checks == 1
    (refused,) = daemon.feed(_update(_signed(2, HOSTS[5]), _routes([HOSTS[6]])))
    assert refused.kind == "treat-as-withdraw" and "bad-signature" in refused.reason


def test_without_verification_a_shared_value_is_accepted_on_every_route():
    """No trust configured (a lab without keys): nothing is signed, so nothing says a
    value belongs to one route; each route keeps it, decoded once."""
    rib = rx.CacheRib()
    changes: list[rx.Change] = []
    rx.run([_update(wire.encode(F.at(1, 1)), _routes(HOSTS[:3]))], rib, changes.append)
    assert [c.kind for c in changes] == ["accept"] * 3
    assert sorted(rib.entries) == [(PEER, h) for h in HOSTS[:3]]


def test_a_route_object_without_nlri_text_is_counted_unusable(daemon):
    routes = [*_routes(HOSTS[:3]), {"nlri": 7}, "junk"]
    changes = daemon.feed(_update(wire.encode(F.at(1, 1)), routes))
    assert daemon.rib.counters["unusable_routes"] == 2
    (line,) = [c for c in changes if c.kind == "treat-as-withdraw"]
    assert line.routes == 3
