"""The holder's trust file, read again when it changes (issue #32, row 3).

A `transfer serve` used to load its trust store once at start, so a puller revoked in
the trust file kept pulling until the holder restarted. `TrustFile` looks at the file's
stat stamp at every connection and reads it again when it changed: a revoked key is
refused from the next connection on, a file that goes bad leaves the last good store
(logged once, counted), and before a first good load every peer is refused. Real
`TransferServer` and `pull` over TLS 1.3 on loopback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from catsproto.adapters.transfer_tls import (
    PeerAuthError,
    PeerPolicy,
    TransferServer,
    TrustFile,
    pull,
)
from catsproto.transfer import synthetic_keys, synthetic_store
from tests.transfer_helpers import PULLER, TRUST, holder_policy, wait_ended

KEYS = synthetic_keys(3, 2)
STORE = synthetic_store(KEYS, 16 << 10)
REVOKED = TRUST.without_key(PULLER.key_id)


@pytest.fixture
def trust_path(tmp_path: Path) -> Path:
    path = tmp_path / "trust.json"
    path.write_text(json.dumps(TRUST.to_json()))
    return path


def test_the_store_follows_the_file(trust_path: Path) -> None:
    logged: list[str] = []
    trust = TrustFile(trust_path, log=logged.append)
    first = trust.current()
    assert first is not None and first.lookup(PULLER.key_id) is not None
    assert trust.current() is first and trust.loads == 1  # unchanged: not read again
    trust_path.write_text(json.dumps(REVOKED.to_json()))
    now = trust.current()
    assert now is not None and now.lookup(PULLER.key_id) is None
    assert trust.loads == 2 and trust.reload_failures == 0
    assert logged == [f"trust file {trust_path}: reloaded"]


def test_a_failed_reload_keeps_the_last_good_store_logged_once_and_counted(
    trust_path: Path,
) -> None:
    logged: list[str] = []
    trust = TrustFile(trust_path, log=logged.append)
    good = trust.current()
    trust_path.write_text("{not json")
    assert trust.current() is good and trust.current() is good  # twice: logged once
    assert trust.reload_failures == 1 and trust.error.startswith("does not load: ")
    assert len(logged) == 1 and logged[0].endswith("; keeping the last good trust store")
    trust_path.unlink()
    assert trust.current() is good and trust.reload_failures == 2
    assert trust.error == "cannot read it: No such file or directory"
    trust_path.write_text(json.dumps(REVOKED.to_json()))
    assert trust.current().lookup(PULLER.key_id) is None  # type: ignore[union-attr]
    assert trust.error == "" and trust.loads == 2


def test_a_reader_that_refuses_the_file_is_a_failed_load(trust_path: Path) -> None:
    # the hook a mode check plugs into: its OSError (PermissionError) keeps the last store
    refuse = {"now": False}

    def read(path: Path) -> bytes:
        if refuse["now"]:
            raise PermissionError(13, "trust file has mode 0666")
        return path.read_bytes()

    trust = TrustFile(trust_path, log=lambda _: None, read=read)
    good = trust.current()
    refuse["now"] = True
    trust_path.write_text(json.dumps(REVOKED.to_json()))
    assert trust.current() is good and trust.reload_failures == 1
    assert trust.error == "cannot read it: trust file has mode 0666"


def test_before_a_first_good_load_every_peer_is_refused(ids, tmp_path: Path) -> None:
    path = tmp_path / "later.json"
    logged: list[str] = []
    trust = TrustFile(path, log=logged.append)
    policy = PeerPolicy(trust)
    with pytest.raises(PeerAuthError) as exc:
        policy.check(ids["puller"].certificate)
    assert exc.value.code == "trust-unavailable"
    assert str(exc.value) == (
        f"trust-unavailable: trust file {path}: cannot read it: No such file or directory"
    )
    assert logged == [
        f"trust file {path}: cannot read it: No such file or directory; refusing every peer"
    ]
    with TransferServer(ids["holder"], policy, STORE.get) as srv:
        refused = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
        path.write_text(json.dumps(TRUST.to_json()))  # no restart: the next connection reads it
        ok = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
    assert refused.completed is None and isinstance(refused.error, PeerAuthError)
    assert ok.error is None and ok.completed is not None
    assert "trust-unavailable" in srv.served[0].error


def test_a_running_holder_refuses_a_puller_revoked_in_its_trust_file(ids, trust_path: Path) -> None:
    trust = TrustFile(trust_path, log=lambda _: None)
    with TransferServer(ids["holder"], PeerPolicy(trust), STORE.get) as srv:
        before = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
        trust_path.write_text(json.dumps(REVOKED.to_json()))
        after = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
        trust_path.write_text("{not json")  # a broken file does not bring the key back
        still = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
        wait_ended(srv, 2.0)
    assert before.error is None and before.completed is not None
    for r in (after, still):
        assert r.completed is None and isinstance(r.error, PeerAuthError)
        assert "may not trust this node's key" in str(r.error)
    errors = [s.error for s in srv.served]
    assert errors[0] == ""
    assert (
        errors[1:]
        == [f"PeerAuthError: unknown-key: no delegation for key {PULLER.key_id.hex()}"] * 2
    )
    assert trust.loads == 2 and trust.reload_failures == 1
