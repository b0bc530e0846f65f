"""ExaBGP adapters: the pure announce/receive cores, and the real thing on loopback.

The loopback tests (embedded mode) need no root: two or more ExaBGP processes on
127.0.0.x, the same announce and receive API processes as the full lab.
"""

from __future__ import annotations

import io
import ipaddress
import json
from pathlib import Path

import pytest

from catsproto import examples, wire
from catsproto.adapters import exabgp_announce as ann
from catsproto.adapters import exabgp_receive as rx
from catsproto.lab import embedded

LAB = Path(__file__).resolve().parent.parent / "lab"
P1 = ipaddress.ip_network("10.101.0.11/32")
P2 = ipaddress.ip_network("10.101.0.12/32")


def _value(seq: int = 1, address: str = "10.101.0.11") -> bytes:
    adv = examples.examples()[0].advertisement.replace(
        wire.Origin(100, 1, ipaddress.ip_address(address)), wire.Sequence(1, seq)
    )
    return wire.encode(adv)


# ---- announce -------------------------------------------------------------------------


def test_announce_command_is_exabgp_text_api():
    cmd = ann.announce_command(P1, bytes.fromhex("0102ff"))
    assert cmd == "announce route 10.101.0.11/32 next-hop self attribute [ 0xff 0xc0 0x0102FF ]"
    assert ann.withdraw_command(P1) == "withdraw route 10.101.0.11/32"


def test_budget_matches_lab_notes():
    # LAB-NOTES: one IPv4 /32 over eBGP leaves 4044 bytes of value in a 4096-byte UPDATE
    assert ann.value_budget(P1, 4096) == 4044
    ann.check_size(P1, b"x" * 4044, 4096)
    with pytest.raises(ann.OversizeError, match="4045 bytes exceeds the 4044"):
        ann.check_size(P1, b"x" * 4045, 4096)


def test_announcer_announces_changes_only_and_withdraws():
    a = ann.Announcer()
    v1, v2 = _value(1), _value(2)
    assert a.step({P1: (v1, 0.0)}, 0.0) == [ann.announce_command(P1, v1)]
    assert a.step({P1: (v1, 0.0)}, 1.0) == []
    assert a.step({P1: (v2, 1.0)}, 1.0) == [ann.announce_command(P1, v2)]
    assert a.step({}, 2.0) == [ann.withdraw_command(P1)]
    assert a.step({}, 3.0) == []


def test_announcer_paces_by_min_interval_latest_value_wins():
    a = ann.Announcer(min_interval=1.0)
    v1, v2, v3 = _value(1), _value(2), _value(3)
    assert a.step({P1: (v1, 0)}, 0.0) == [ann.announce_command(P1, v1)]
    assert a.step({P1: (v2, 0)}, 0.3) == []
    assert a.step({P1: (v3, 0)}, 0.6) == []
    assert a.step({P1: (v3, 0)}, 1.0) == [ann.announce_command(P1, v3)]


def test_announcer_refuses_oversized_value_and_withdraws_the_stale_one():
    a = ann.Announcer(max_message=4096)
    small, big = _value(1), b"\x00" * 5000
    a.step({P1: (small, 0)}, 0)
    assert a.step({P1: (big, 0)}, 1) == [ann.withdraw_command(P1)]
    assert "refused" in a.diagnostics[-1] and "5000 bytes" in a.diagnostics[-1]
    assert a.step({P1: (big, 0)}, 2) == []  # refused once, not on every poll
    assert a.step({P1: (small, 0)}, 3) == [ann.announce_command(P1, small)]
    assert ann.Announcer(max_message=65535).step({P2: (big, 0)}, 0)[0].startswith("announce")


def test_announcer_lease_withdraws_a_silent_instance():
    a = ann.Announcer(lease=2.0)
    v = _value()
    assert a.step({P1: (v, 0.0)}, 1.0)
    assert a.step({P1: (v, 0.0)}, 2.0) == []
    assert a.step({P1: (v, 0.0)}, 2.5) == [ann.withdraw_command(P1)]
    assert a.step({P1: (v, 3.0)}, 3.5) == [ann.announce_command(P1, v)]


def test_spool_round_trip_and_run_loop(tmp_path):
    spool = ann.Spool(tmp_path)
    spool.publish(P1, b"\x01\x02")
    spool.publish("10.201.11.3/32", b"\x03")
    assert {str(p): v for p, (v, _) in spool.read().items()} == {
        "10.101.0.11/32": b"\x01\x02",
        "10.201.11.3/32": b"\x03",
    }
    out, acks = io.StringIO(), io.StringIO("done\ndone\n")
    logged: list[str] = []
    steps = iter([False, True])
    ann.run(spool, ann.Announcer(), out, acks, poll=0, log=logged.append, stop=lambda: next(steps))
    assert out.getvalue().splitlines() == [
        ann.announce_command(P1, b"\x01\x02"),
        ann.announce_command(ipaddress.ip_network("10.201.11.3/32"), b"\x03"),
    ]
    spool.withdraw(P1)
    assert list(spool.read()) == [ipaddress.ip_network("10.201.11.3/32")]


# ---- receive --------------------------------------------------------------------------


def _update(attributes: dict, announce=(), withdraw=(), peer="10.0.23.1") -> dict:
    update: dict = {"attribute": attributes}
    if announce:
        update["announce"] = {"ipv4 unicast": {peer: [{"nlri": p} for p in announce]}}
    if withdraw:
        update["withdraw"] = {"ipv4 unicast": [{"nlri": p} for p in withdraw]}
    return {
        "type": "update",
        "neighbor": {"address": {"local": "x", "peer": peer}, "message": {"update": update}},
    }


@pytest.mark.parametrize("flags", ["0xC0", "0xE0", "0xF0", "0xD0"])
def test_attribute_found_by_type_whatever_the_flags(flags):
    value = _value()
    attrs = {
        "origin": "igp",
        f"attribute-0xFF-{flags}": "0x" + value.hex().upper(),
        "attribute-0xFE-0xC0": "0x00",
    }
    assert rx.find_attribute(attrs, 255) == (int(flags, 16), value)
    assert rx.find_attribute(attrs, 42) is None


def test_rib_accepts_withdraws_and_treats_malformed_as_withdraw_of_that_route_only():
    rib = rx.CacheRib()
    a, b = _value(1, "10.101.0.11"), _value(1, "10.101.0.12")
    for prefix, value in ((P1, a), (P2, b)):
        msg = _update(
            {
                "as-path": {"0": {"element": "as-sequence", "value": [65100, 65001]}},
                "attribute-0xFF-0xE0": "0x" + value.hex(),
            },
            [str(prefix)],
        )
        (ev,) = rx.parse_message(msg)
        assert ev.as_path == (65100, 65001)
        assert rib.apply(ev, 1.0)[0].kind == "accept"
    broken = bytearray(a)
    broken[3] += 1
    (ev,) = rx.parse_message(_update({"attribute-0xFF-0xE0": "0x" + broken.hex()}, [str(P1)]))
    (change,) = rib.apply(ev, 2.0)
    assert change.kind == "treat-as-withdraw" and "malformed" in change.reason
    assert change.entry is not None and str(change.entry.advertisement.origin.address) == (
        "10.101.0.11"
    )
    assert list(rib.by_origin()) == ["10.101.0.12"]
    (ev,) = rx.parse_message(_update({}, withdraw=[str(P2)]))
    assert rib.apply(ev, 3.0)[0].kind == "withdraw"
    assert rib.entries == {}


@pytest.mark.parametrize("flags", ["0x40", "0x80", "0x00"])
def test_rib_refuses_our_attribute_without_optional_and_transitive(flags):
    rib = rx.CacheRib()
    good = _update({"attribute-0xFF-0xE0": "0x" + _value().hex()}, [str(P1)])
    assert rib.apply(rx.parse_message(good)[0], 1.0)[0].kind == "accept"
    bad = _update({f"attribute-0xFF-{flags}": "0x" + _value().hex()}, [str(P1)])
    (change,) = rib.apply(rx.parse_message(bad)[0], 2.0)
    assert change.kind == "treat-as-withdraw" and "lack optional+transitive" in change.reason
    assert rib.entries == {}


def test_rib_verifier_refusal_is_treat_as_withdraw_and_session_down_clears_peer():
    rib = rx.CacheRib(
        verifier=lambda value, adv, prefix: (
            rx.Verification(True, True)
            if adv.sequence.sequence > 1
            else rx.Verification(False, False, "replayed")
        )
    )
    for seq, kind in ((1, "treat-as-withdraw"), (2, "accept")):
        (ev,) = rx.parse_message(_update({"attribute-0xFF-0xC0": _value(seq).hex()}, [str(P1)]))
        assert rib.apply(ev, 0)[0].kind == kind
    assert next(iter(rib.entries.values())).verified
    state = {"type": "state", "neighbor": {"address": {"peer": "10.0.23.1"}, "state": "down"}}
    kinds = [c.kind for ev in rx.parse_message(state) for c in rib.apply(ev, 1)]
    assert kinds == ["session", "withdraw"] and rib.entries == {}


def test_receiver_run_never_writes_stdout(tmp_path, capsys):
    rib = rx.CacheRib()
    sink = rx.FileSink(tmp_path, rib)
    lines = [
        json.dumps(_update({"attribute-0xFF-0xE0": _value().hex()}, [str(P1)])),
        "not json",
        json.dumps({"type": "notification", "notification": "shutdown"}),
    ]
    rx.run(lines, rib, sink, log=lambda m: None)
    assert capsys.readouterr().out == ""
    snapshot = json.loads((tmp_path / "rib.json").read_text())
    assert snapshot["routes"][0]["value"] == _value().hex()


# ---- the real ExaBGP on loopback (no root needed) -------------------------------------


def test_embedded_loopback_speakers_to_receiver(tmp_path):
    lab = embedded.up(LAB / "cats4.clab.yml", tmp_path)
    try:
        value = wire.encode(examples.examples()[3].advertisement)
        lab.spool("e4").publish("10.104.0.11/32", value)
        lab.spool("e2").publish("10.102.0.11/32", _value(1, "10.102.0.11"))
        lab.wait_for(lambda: len(lab.routes("e1")) == 2, 20, "two routes at e1")
        got = {r["prefix"]: r for r in lab.routes("e1")}
        assert got["10.104.0.11/32"]["value"] == value.hex()
        assert got["10.104.0.11/32"]["as_path"] == [65004]
        broken = bytearray(_value(1, "10.102.0.11"))
        broken[3] += 1
        lab.spool("e2").publish("10.102.0.11/32", bytes(broken))
        lab.wait_for(lambda: len(lab.routes("e1")) == 1, 20, "malformed route withdrawn")
        assert lab.routes("e1")[0]["prefix"] == "10.104.0.11/32"
        # a speaker with nothing to announce may come up after the others' routes arrived
        every = {"127.0.0.11": "up", "127.0.0.12": "up", "127.0.0.13": "up"}
        lab.wait_for(lambda: lab.sessions()["e1"] == every, 20, "all three sessions up at e1")
        lab.spool("e4").withdraw("10.104.0.11/32")
        lab.wait_for(lambda: not lab.routes("e1"), 20, "withdrawal")
    finally:
        lab.down()
    assert not any(lab.handle.alive(p) for p in lab.handle.state.processes)


def _state(peer: str, state: str, reason: str = "") -> dict:
    neighbor = {"address": {"peer": peer}, "state": state, "reason": reason}
    return {"type": "state", "neighbor": neighbor}


def _eor(peer: str) -> dict:
    return {
        "type": "update",
        "neighbor": {
            "address": {"peer": peer},
            "message": {"eor": {"afi": "ipv4", "safi": "unicast"}},
        },
    }


def test_graceful_restart_keeps_routes_stale_until_end_of_rib():
    rib = rx.CacheRib(restart_time=120)
    a, b = _value(1, "10.101.0.11"), _value(1, "10.101.0.12")
    for prefix, value in ((P1, a), (P2, b)):
        (ev,) = rx.parse_message(
            _update({"attribute-0xFF-0xE0": "0x" + value.hex()}, [str(prefix)])
        )
        rib.apply(ev, 1.0)
    changes = rib.apply(rx.parse_message(_state(ev.peer, "down"))[0], 2.0)
    assert [c.kind for c in changes] == ["session", "stale", "stale"]
    assert len(rib.entries) == 2 and all(r["stale"] for r in rib.to_json()["routes"])
    # the peer comes back and resends P1 only, then End-of-RIB: P2 goes, P1 is fresh again
    (ev,) = rx.parse_message(_update({"attribute-0xFF-0xE0": "0x" + a.hex()}, [str(P1)]))
    assert rib.apply(ev, 3.0)[0].kind == "accept"
    (eor,) = rx.parse_message(_eor(ev.peer))
    assert isinstance(eor, rx.EndOfRib)
    (gone,) = rib.apply(eor, 4.0)
    assert gone.kind == "withdraw" and gone.prefix == P2 and "EoR" in gone.reason
    assert [r["prefix"] for r in rib.to_json()["routes"]] == [str(P1)]
    assert not any(r["stale"] for r in rib.to_json()["routes"])


def test_graceful_restart_time_runs_out_when_the_peer_never_returns():
    rib = rx.CacheRib(restart_time=5)
    (ev,) = rx.parse_message(_update({"attribute-0xFF-0xE0": "0x" + _value().hex()}, [str(P1)]))
    rib.apply(ev, 1.0)
    rib.apply(rx.parse_message(_state(ev.peer, "down"))[0], 2.0)
    assert rib.expire(6.9) == [] and len(rib.entries) == 1
    (gone,) = rib.expire(7.0)
    assert gone.kind == "withdraw" and "expired" in gone.reason and rib.entries == {}


def test_without_graceful_restart_a_session_down_withdraws_at_once():
    rib = rx.CacheRib()
    (ev,) = rx.parse_message(_update({"attribute-0xFF-0xE0": "0x" + _value().hex()}, [str(P1)]))
    rib.apply(ev, 1.0)
    kinds = [c.kind for c in rib.apply(rx.parse_message(_state(ev.peer, "down"))[0], 2.0)]
    assert kinds == ["session", "withdraw"] and rib.entries == {}


def test_graceful_restart_does_not_cover_an_expired_hold_timer():
    rib = rx.CacheRib(restart_time=120)
    (ev,) = rx.parse_message(_update({"attribute-0xFF-0xE0": "0x" + _value().hex()}, [str(P1)]))
    rib.apply(ev, 1.0)
    down = _state(ev.peer, "down", "notification sent (4,0)")  # as ExaBGP reports it
    kinds = [c.kind for c in rib.apply(rx.parse_message(down)[0], 2.0)]
    assert kinds == ["session", "withdraw"] and rib.entries == {}
