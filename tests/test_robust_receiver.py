"""Bad input to the receive path, the trust file and the security CLI: it is refused
with a one-line reason naming the field, it changes nothing it should not, and the
receiver process lives on (and never falls back to accepting what it cannot verify)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.security.vectors import NLRI, NOW_MS, fixture

F = fixture()
PEER = "10.0.0.1"
OTHER = ipaddress.ip_network("10.0.2.0/24")  # inside the delegation's 10.0.0.0/16


def _signed(seq: int, nlri: ipaddress.IPv4Network = NLRI, *, carry: bool = False) -> bytes:
    adv = F.at(1, seq)
    if carry:
        adv = adv.replace(F.delegation)
    return wire.encode(security.sign(adv, F.node, nlri))


def _unsigned(seq: int) -> bytes:
    return wire.encode(F.at(1, seq))


def _update(
    attributes: dict,
    announce: list | None = None,
    withdraw: list | None = None,
) -> str:
    update: dict = {"attribute": attributes}
    if announce is not None:
        update["announce"] = {"ipv4 unicast": {PEER: announce}}
    if withdraw is not None:
        update["withdraw"] = {"ipv4 unicast": withdraw}
    return json.dumps(
        {"type": "update", "neighbor": {"address": {"peer": PEER}, "message": {"update": update}}}
    )


def _announce(value: bytes, *prefixes: object) -> str:
    routes = [{"nlri": str(p)} for p in (prefixes or (NLRI,))]
    return _update({"attribute-0xFF-0xC0": "0x" + value.hex()}, routes)


def _trust_json(store: security.TrustStore = F.trust, indent: int | None = None) -> str:
    return json.dumps(store.to_json(), indent=indent)


class Receiver:
    """The real `run` loop over a real RIB and trust-file verifier; keeps the changes."""

    def __init__(self, trust: Path, *, optional: bool = False) -> None:
        self.logs: list[str] = []
        self.verifier = rx.TrustFileVerifier(
            trust, clock=lambda: NOW_MS / 1000, optional=optional, log=self.logs.append
        )
        self.rib = rx.CacheRib(verifier=self.verifier)

    def feed(self, *lines: str) -> list[rx.Change]:
        changes: list[rx.Change] = []
        rx.run(lines, self.rib, changes.append, log=self.logs.append)
        return changes

    def kinds(self, *lines: str) -> list[tuple[str, str]]:
        return [(c.kind, c.reason) for c in self.feed(*lines)]


def _rewrite(path: Path, text: str | bytes) -> None:
    """Write `text` and make sure the file's stamp (mtime, size, inode) moves on."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


# ---- the trust file's own checks ------------------------------------------------------


@pytest.mark.parametrize("section", ["operators", "delegations"])
@pytest.mark.parametrize("value", [5, None, "zz", {}, True, 1.5])
def test_trust_file_section_that_is_not_a_list_names_it(section, value):
    obj = {**F.trust.to_json(), section: value}
    with pytest.raises(security.TrustFileError, match=f"^{section} is .*, not a list$"):
        security.TrustStore.from_json(obj)


@pytest.mark.parametrize(
    ("operator", "message"),
    [
        ({"name": "x"}, "operators[0]: missing public_key"),
        (5, "operators[0] is 5, not a JSON object"),
        ({"public_key": 5}, "operators[0]: public_key is 5, not a hex string"),
        ({"public_key": "zz"}, 'operators[0]: public_key "zz" is not hex'),
        ({"public_key": "00"}, "operators[0]: public_key: Ed25519 public key is 1 bytes"),
        ({"public_key": F.operator.public.raw.hex(), "name": []}, "operators[0]: name is []"),
    ],
)
def test_trust_file_operator_errors_name_the_field(operator, message):
    obj = {**F.trust.to_json(), "operators": [operator], "delegations": []}
    with pytest.raises(security.TrustFileError) as info:
        security.TrustStore.from_json(obj)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("algorithm", None, "delegation: algorithm null is not one of ed25519"),
        ("algorithm", "zz", 'delegation: algorithm "zz" is not one of ed25519'),
        ("node_key", 5, "delegation: node_key is 5, not a hex string"),
        ("operator_key_id", "zz", 'delegation: operator_key_id "zz" is not hex'),
        ("operator_signature", [], "delegation: operator_signature is [], not a hex string"),
        ("not_before_ms", "1", 'delegation: not_before_ms is "1", not an integer'),
        ("not_after_ms", True, "delegation: not_after_ms is true, not an integer"),
        ("cs_ids", 5, "delegation: cs_ids is 5, not a list"),
        ("cs_ids", ["zz"], 'delegation: cs_ids[0] is "zz", not an integer'),
        ("routes", [5], "delegation: routes[0] is 5, not a string"),
        ("addresses", ["zz"], "delegation: addresses[0]: 'zz' does not appear"),
    ],
)
def test_delegation_field_errors_name_the_field(field, value, message):
    obj = {**security.delegation_to_json(F.delegation), field: value}
    with pytest.raises(security.TrustFileError) as info:
        security.delegation_from_json(obj)
    assert str(info.value).startswith(message)
    trust = {**F.trust.to_json(), "delegations": [obj]}
    with pytest.raises(security.TrustFileError) as info:
        security.TrustStore.from_json(trust)
    assert str(info.value).startswith(f"delegations[0]: {message}")


def test_delegation_lacking_fields_names_them_all():
    obj = security.delegation_to_json(F.delegation)
    del obj["routes"], obj["node_key"]
    with pytest.raises(security.TrustFileError, match=r"^delegation lacks node_key, routes$"):
        security.delegation_from_json(obj)


def _paths(obj: object, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*path, i))
    return out


TRUST_PATHS = _paths(F.trust.to_json())[1:]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(TRUST_PATHS), JSON_VALUES | st.just(KeyError))))
def test_any_mangled_trust_file_raises_only_trust_file_error(edits):
    obj = F.trust.to_json()
    for path, value in edits:
        parent = obj
        try:
            for k in path[:-1]:
                parent = parent[k]
            if value is KeyError:
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced this path
    try:
        security.TrustStore.from_json(obj)
    except security.TrustFileError as exc:
        assert "\n" not in str(exc)


# ---- the receiver's trust file: fail-closed, last good kept, state carried -----------


def test_configured_trust_file_that_never_existed_refuses_every_value(tmp_path):
    r = Receiver(tmp_path / "trust.json")
    ((kind, reason),) = r.kinds(_announce(_unsigned(1)))
    assert kind == "treat-as-withdraw"
    assert (
        reason == "not verified: trust file unavailable: cannot read it: No such file or directory"
    )
    assert r.rib.entries == {}
    ((kind, _),) = r.kinds(_announce(_signed(2)))  # not even a good signature: no trust
    assert kind == "treat-as-withdraw"
    assert r.verifier.reload_failures == 1 and len(r.logs) == 1  # logged once, not per value
    assert "refusing every value" in r.logs[0]


def test_trust_file_that_goes_missing_keeps_the_last_good_store(tmp_path):
    path = tmp_path / "trust.json"
    path.write_text(_trust_json())
    r = Receiver(path)
    assert r.kinds(_announce(_signed(1))) == [("accept", "")]
    path.unlink()
    ((kind, reason),) = r.kinds(_announce(_unsigned(2)))
    assert kind == "treat-as-withdraw" and reason.startswith("not verified: unsigned")
    assert r.kinds(_announce(_signed(3))) == [("accept", "")]
    assert next(iter(r.rib.entries.values())).verified
    assert r.verifier.reload_failures == 1
    assert "keeping the last good trust store" in r.logs[0]
    assert r.rib.to_json()["trust"]["state"] == "verifying with the last good store"


def test_unreadable_trust_file_never_leads_to_acceptance(tmp_path):
    path = tmp_path / "trust.json"
    path.mkdir()  # stat works, reading fails (even as root)
    r = Receiver(path)
    ((kind, reason),) = r.kinds(_announce(_unsigned(1)))
    assert kind == "treat-as-withdraw" and "trust file unavailable: cannot read it" in reason
    opt = Receiver(path, optional=True)  # exists but unreadable: the lab mode refuses too
    ((kind, _),) = opt.kinds(_announce(_unsigned(1)))
    assert kind == "treat-as-withdraw"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"format": "catsproto-trust/1", "oper', "does not load: Unterminated string"),
        ('{"format": "catsproto-trust/1", "operators": 5}', "operators is 5, not a list"),
        ("", "does not load: Expecting value"),
        (b"\xc3\x28", "does not load: 'utf-8' codec can't decode"),
        ("[" * 100_000, "does not load"),
    ],
)
def test_bad_or_half_written_trust_file_keeps_the_last_good_store_and_run_lives_on(
    tmp_path, text, error
):
    path = tmp_path / "trust.json"
    path.write_text(_trust_json())
    r = Receiver(path)
    assert r.kinds(_announce(_signed(1))) == [("accept", "")]
    _rewrite(path, text)
    assert r.kinds(_announce(_signed(2))) == [("accept", "")]  # last good store verified it
    ((kind, _),) = r.kinds(_announce(_unsigned(3)))
    assert kind == "treat-as-withdraw"
    assert r.verifier.reload_failures == 1 and error in r.verifier.error
    status = r.rib.to_json()["trust"]
    assert status["reload_failures"] == 1 and status["loads"] == 1
    _rewrite(path, _trust_json(indent=1))  # a good file again: loads
    assert r.kinds(_announce(_signed(4))) == [("accept", "")]
    assert r.verifier.loads == 2 and r.verifier.error == ""
    assert r.rib.to_json()["trust"]["state"] == "verifying"


def test_bad_trust_file_before_any_good_one_refuses_every_value(tmp_path):
    path = tmp_path / "trust.json"
    path.write_text('{"format": "catsproto-trust/1", "operators": 5}')
    r = Receiver(path)
    ((kind, reason),) = r.kinds(_announce(_unsigned(1)))
    assert kind == "treat-as-withdraw"
    assert (
        reason == "not verified: trust file unavailable: does not load: operators is 5, not a list"
    )
    assert r.rib.to_json()["trust"]["state"] == "unavailable: refusing every value"


def test_reload_keeps_the_replay_window(tmp_path):
    path = tmp_path / "trust.json"
    path.write_text(_trust_json())
    r = Receiver(path)
    assert r.kinds(_announce(_signed(5))) == [("accept", "")]
    _rewrite(path, _trust_json(indent=2))  # an edit: same trust, new file
    ((kind, reason),) = r.kinds(_announce(_signed(3)))  # an older, validly signed value
    assert kind == "treat-as-withdraw" and reason.startswith("not verified: replayed")
    assert r.verifier.loads == 2
    assert r.kinds(_announce(_signed(6))) == [("accept", "")]
    verdicts = r.rib.to_json()["trust"]["verdicts"]
    assert verdicts == {"ok": 2, "replayed": 1}  # the counters carried over too


def test_reload_keeps_in_band_delegations_the_new_file_still_allows(tmp_path):
    path = tmp_path / "trust.json"
    operator_only = security.TrustStore().with_operator(F.operator.public.raw, "operator-1")
    path.write_text(_trust_json(operator_only))
    r = Receiver(path)
    assert r.kinds(_announce(_signed(1, carry=True))) == [("accept", "")]  # learned in-band
    _rewrite(path, _trust_json(operator_only, indent=2))
    assert r.kinds(_announce(_signed(2))) == [("accept", "")]  # still known after the reload
    stranger = security.TrustStore().with_operator(F.stranger.public.raw, "someone else")
    _rewrite(path, _trust_json(stranger))  # the operator is no longer trusted
    ((kind, reason),) = r.kinds(_announce(_signed(3)))
    assert kind == "treat-as-withdraw" and reason.startswith("not verified: unknown-key")


def test_receiver_reloaded_drops_what_came_from_the_old_file():
    receiver = security.Receiver(F.trust)
    without = security.TrustStore().with_operator(F.operator.public.raw, "operator-1")
    assert receiver.reloaded(without, F.trust).trust.lookup(F.node.key_id) is None


def test_lab_mode_absent_file_accepts_unverified_until_it_loads(tmp_path):
    path = tmp_path / "trust.json"
    r = Receiver(path, optional=True)
    assert r.kinds(_announce(_unsigned(1))) == [("accept", "")]
    assert r.rib.to_json()["trust"]["state"] == "absent: accepting unverified"
    path.write_text('{"format": "catsproto-trust/1", "oper')  # being written
    ((kind, reason),) = r.kinds(_announce(_unsigned(2)))
    assert kind == "treat-as-withdraw" and "trust file unavailable" in reason
    _rewrite(path, _trust_json())
    ((kind, _),) = r.kinds(_announce(_unsigned(3)))
    assert kind == "treat-as-withdraw"
    assert r.kinds(_announce(_signed(4))) == [("accept", "")]


# ---- ExaBGP's JSON: per route, never the whole UPDATE --------------------------------


def _run(rib: rx.CacheRib, *lines: str) -> tuple[list[rx.Change], list[str]]:
    changes: list[rx.Change] = []
    logs: list[str] = []
    rx.run(lines, rib, changes.append, log=logs.append)
    return changes, logs


@pytest.mark.parametrize("raw", ["0xzz", "0x0", 5, None, ["00"]])
def test_undecodable_attribute_hex_is_treat_as_withdraw_of_that_route(raw):
    rib = rx.CacheRib()
    _run(rib, _announce(_unsigned(1), NLRI, OTHER))
    assert len(rib.entries) == 2
    changes, logs = _run(rib, _update({"attribute-0xFF-0xC0": raw}, [{"nlri": str(NLRI)}]))
    (change,) = changes
    assert change.kind == "treat-as-withdraw" and change.prefix == NLRI
    assert change.reason.startswith("malformed: attribute-0xFF-0xC0 ")
    assert change.entry is not None  # the state it withdrew
    assert list(rib.entries) == [(PEER, OTHER)]
    assert rib.counters["malformed"] == 1 and logs == []


def test_bad_nlri_skips_that_route_only():
    rib = rx.CacheRib()
    routes = [{"nlri": "bogus"}, {"nlri": str(NLRI)}, {"x": 1}, 7, {"nlri": "10.0.2.1/24"}]
    line = _update({"attribute-0xFF-0xC0": "0x" + _unsigned(1).hex()}, routes)
    changes, logs = _run(rib, line)
    # route objects without nlri text are set aside while the UPDATE is read; the
    # texts are then parsed in their order
    assert [c.kind for c in changes] == ["ignore", "ignore", "ignore", "accept", "ignore"]
    assert changes[0].reason == 'unusable: route {"x": 1} has no nlri string'
    assert changes[1].reason == "unusable: route 7 has no nlri string"
    assert changes[2].reason.startswith('unusable: nlri "bogus": ')
    assert "has host bits set" in changes[4].reason
    assert list(rib.entries) == [(PEER, NLRI)]
    assert rib.counters["unusable_routes"] == 4 and logs == []


def test_bad_withdrawn_route_does_not_stop_the_others():
    rib = rx.CacheRib()
    _run(rib, _announce(_unsigned(1), NLRI, OTHER))
    changes, _ = _run(rib, _update({}, withdraw=[{"nlri": "x"}, {"nlri": str(NLRI)}]))
    assert [c.kind for c in changes] == ["ignore", "withdraw"]
    assert list(rib.entries) == [(PEER, OTHER)]


@pytest.mark.parametrize(
    ("as_path", "expected"),
    [
        (5, ()),
        ("65001", ()),
        ({"0": {"element": "as-sequence", "value": [65001, "x", 1.5]}}, ()),
        ({"0": {"element": "as-sequence", "value": [65001, 2**32]}}, ()),
        ({"0": {"element": "as-sequence", "value": [65001, True]}}, ()),
        ({"0": {"element": "as-sequence", "value": 5}}, (5,)),
        ({"0": {"element": "as-sequence", "value": ["65001", 65002]}}, (65001, 65002)),
        ([65001, 65002], (65001, 65002)),
        ([{"element": "as-sequence", "value": ["²"]}], ()),
    ],
)
def test_unusable_as_path_becomes_empty_and_the_route_is_kept(as_path, expected):
    rib = rx.CacheRib()
    attributes = {"as-path": as_path, "attribute-0xFF-0xC0": "0x" + _unsigned(1).hex()}
    changes, logs = _run(rib, _update(attributes, [{"nlri": str(NLRI)}]))
    assert [c.kind for c in changes] == ["accept"] and logs == []
    assert rib.entries[(PEER, NLRI)].as_path == expected


@pytest.mark.parametrize(
    "line",
    [
        "nan",
        '"x"',
        "[1]",
        "[" * 100_000,
        json.dumps({"type": "update", "neighbor": {"message": {"update": {"announce": [1]}}}}),
        json.dumps({"type": "update", "neighbor": {"message": {"update": {"withdraw": 5}}}}),
    ],
)
def test_message_that_cannot_be_parsed_is_counted_logged_and_run_lives_on(tmp_path, line):
    rib = rx.CacheRib()
    sink = rx.FileSink(tmp_path, rib, coalesce=True)
    logs: list[str] = []
    rx.run([line, _announce(_unsigned(1))], rib, sink, log=logs.append)
    assert rib.counters["unparsed_messages"] == 1
    assert len(logs) == 1 and logs[0].startswith("cannot parse ExaBGP message (")
    assert list(rib.entries) == [(PEER, NLRI)]
    rx.run([line], rib, sink, log=logs.append)  # nothing else changed: the count shows
    sink.flush()
    snapshot = json.loads((tmp_path / "rib.json").read_text())
    assert snapshot["counters"]["unparsed_messages"] == 2


# ---- the real receiver process -------------------------------------------------------


def trust_for_now(now_ms: int) -> security.TrustStore:
    """The fixture's operator and node, delegated for an hour around `now_ms` (a daemon
    that reads its own clock needs a delegation valid now, not at the vectors' time)."""
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


def test_receiver_process_survives_bad_trust_files_and_bad_json(tmp_path):
    """`python -m catsproto.adapters.exabgp_receive`, as ExaBGP runs it, fed line by line
    while its trust file is rewritten under it."""
    out, trust = tmp_path / "rib", tmp_path / "trust.json"
    trust.write_text(_trust_json())
    now = int(time.time() * 1000)  # the process reads its own clock: sign for now
    store = trust_for_now(now)
    trust.write_text(_trust_json(store))

    def signed(seq: int) -> bytes:
        adv = F.base.replace(wire.Sequence(1, seq), wire.Timestamp(now + seq))
        return wire.encode(security.sign(adv, F.node, NLRI))

    argv = ["-m", "catsproto.adapters.exabgp_receive", "--out", str(out), "--trust", str(trust)]
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def send(line: str, events: int) -> list[dict]:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                path = out / "events.jsonl"
                lines = path.read_text().splitlines() if path.exists() else []
                if len(lines) >= events and lines[-1].endswith("}"):
                    return [json.loads(x) for x in lines]
                time.sleep(0.05)
            raise AssertionError(f"no event {events} after {line[:80]}")

        assert send(_announce(signed(1)), 1)[-1]["kind"] == "accept"
        _rewrite(trust, '{"format": "catsproto-trust/1", "oper')  # half-written
        assert send(_announce(signed(2)), 2)[-1]["kind"] == "accept"
        _rewrite(trust, '{"format": "catsproto-trust/1", "operators": 5}')
        last = send(_announce(_unsigned(3)), 3)[-1]
        assert last["kind"] == "treat-as-withdraw" and "unsigned" in last["reason"]
        assert proc.stdin is not None
        proc.stdin.write("[" * 100_000 + "\n")
        last = send(_update({"attribute-0xFF-0xC0": "0xzz"}, [{"nlri": str(NLRI)}]), 4)[-1]
        assert last["kind"] == "treat-as-withdraw" and last["reason"].startswith("malformed")
        trust.unlink()
        last = send(_announce(signed(5)), 5)[-1]
        assert last["kind"] == "accept" and last["entry"]["verified"] is True
        proc.stdin.close()
        assert proc.wait(timeout=20) == 0
        assert proc.stdout is not None and proc.stdout.read() == ""  # ExaBGP reads stdout
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in stderr
        assert stderr.count("keeping the last good trust store") == 3
        snapshot = json.loads((out / "rib.json").read_text())
        assert snapshot["counters"] == {
            "unparsed_messages": 1,
            "unusable_routes": 0,
            "malformed": 1,
            "not_verified": 1,
            "unknown_sealing_algorithm": 0,
            "sealed_opened": 0,
            "unheld_group_key": 0,
        }
        assert snapshot["trust"]["reload_failures"] == 3 and snapshot["trust"]["loads"] == 1
        assert [(r["prefix"], r["sequence"]) for r in snapshot["routes"]] == [(str(NLRI), 5)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the security CLI ----------------------------------------------------------------


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "catsproto", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def _one_line_usage_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "op.key").write_text(json.dumps(F.operator.to_json("op")))
    (d / "node.key").write_text(json.dumps(F.node.to_json("node")))
    for private in ("op.key", "node.key"):
        (d / private).chmod(0o600)  # a private key file others may read is refused
    (d / "deleg.json").write_text(json.dumps(security.delegation_to_json(F.delegation)))
    (d / "trust.json").write_text(_trust_json())
    (d / "ops5.json").write_text('{"format": "catsproto-trust/1", "operators": 5}')
    (d / "badutf8").write_bytes(bytes([0xC3, 0x28]))
    (d / "null.json").write_text("null")
    (d / "value.hex").write_text(_signed(1).hex())
    (d / "plain.hex").write_text(_unsigned(1).hex())
    return d


@pytest.mark.parametrize("group", ["-1", "99999999999999999999", "4294967296"])
def test_keygen_group_id_out_of_range(files, group):
    out = files / f"g{group[:5]}.key"
    done = _cli("keygen", str(out), "--group", group)
    _one_line_usage_error(done, f"--group: group key id {group} outside 0..4294967295")
    assert not out.exists()


@pytest.mark.parametrize("days", ["nan", "inf", "-inf", "0", "-1"])
def test_authorize_days_must_be_finite_and_above_zero(files, days):
    done = _cli(
        "authorize",
        str(files / "op.key"),
        F.node.public.raw.hex(),
        *("--cs-id", "100", "--route", "10.0.0.0/16", "--address", "192.0.2.0/24"),
        f"--days={days}",
    )
    _one_line_usage_error(done, "--days", "finite number of days above 0")


@pytest.mark.parametrize(
    ("key", "route", "words"),
    [
        ("zz", "10.0.0.0/16", ("node public key 'zz' is not hex",)),
        (F.node.public.raw.hex(), "10.0.0.1/16", ("route: ", "10.0.0.1/16", "host bits")),
    ],
)
def test_authorize_names_the_bad_argument(files, key, route, words):
    done = _cli(
        "authorize",
        str(files / "op.key"),
        key,
        *("--cs-id", "100", "--route", route, "--address", "192.0.2.0/24"),
    )
    _one_line_usage_error(done, *words)


def _commands_reading(bad: str) -> list[tuple[str, ...]]:
    node = F.node.public.raw.hex()
    scope = ("--cs-id", "100", "--route", "10.0.0.0/16", "--address", "192.0.2.0/24")
    return [
        ("authorize", bad, node, *scope),
        ("trust", "--operator", bad),
        ("trust", "--operator", "op.key", "--delegation", bad),
        ("sign", "plain.hex", "--key", bad, "--route", str(NLRI)),
        ("sign", "plain.hex", "--key", "node.key", "--delegation", bad, "--route", str(NLRI)),
        ("sign", "plain.hex", "--key", "node.key", "--seal", bad, "--route", str(NLRI)),
        ("verify", "value.hex", "--trust", bad, "--route", str(NLRI)),
        ("verify", "value.hex", "--trust", "trust.json", "--group-key", bad, "--route", str(NLRI)),
    ]


@pytest.mark.parametrize("args", _commands_reading("badutf8"), ids=lambda a: " ".join(a[:2]))
def test_file_that_is_not_utf8_is_a_usage_error(files, args):
    _one_line_usage_error(_cli(*args, cwd=files), "badutf8 is not UTF-8 (byte 0)")


@pytest.mark.parametrize("args", _commands_reading("null.json"), ids=lambda a: " ".join(a[:2]))
def test_file_that_is_json_null_is_a_usage_error(files, args):
    _one_line_usage_error(_cli(*args, cwd=files), "null.json: a ", "JSON object, not null")


def test_verify_with_a_mistyped_trust_file_names_the_field(files):
    done = _cli("verify", "value.hex", "--trust", "ops5.json", "--route", str(NLRI), cwd=files)
    _one_line_usage_error(done, "trust file: operators is 5, not a list")


def test_the_verifier_prunes_replay_entries_of_routes_silent_past_the_window(tmp_path):
    """A long-lived receiver hears routes come and go: entries of routes silent for
    longer than the freshness window are dropped (the window stays bounded), and an old
    value of such a route is still refused, now as stale."""
    from catsproto.security.vectors import OTHER_NLRI

    path = tmp_path / "trust.json"
    path.write_text(_trust_json())
    now = [NOW_MS]
    verifier = rx.TrustFileVerifier(path, clock=lambda: now[0] / 1000, log=lambda _: None)
    rib = rx.CacheRib(verifier=verifier)
    old = _signed(5)  # timestamped NOW_MS - 1 s, on NLRI
    rx.run([_announce(old)], rib, lambda _: None)
    assert len(verifier._receiver.window) == 1
    max_age = verifier._receiver.policy.max_age_ms
    now[0] = NOW_MS + max_age + 60_000  # NLRI silent since; OTHER_NLRI speaks, fresh
    fresh = wire.encode(security.sign(F.at(1, 6, now[0] - 1000), F.node, OTHER_NLRI))
    changes: list[rx.Change] = []
    rx.run([_announce(fresh, OTHER_NLRI), _announce(old)], rib, changes.append)
    kinds = [(c.kind, c.reason) for c in changes]
    assert kinds[0] == ("accept", "")
    (kind, reason), *_ = kinds[1:]  # the old value again: refused, as stale
    assert kind == "treat-as-withdraw" and "stale" in reason, kinds
    window = verifier._receiver.window
    assert len(window) == 1 and all(key.nlri == OTHER_NLRI for key, _ in window)
