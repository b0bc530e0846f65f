"""`catsproto transfer serve` / `pull`: the holder's deadlines and caps and the puller's
handshake deadline as options. Bad values are refused before anything listens or
connects; good ones reach the server and the puller (the real command, real TLS sockets
on loopback, silent peers that never send a byte)."""

from __future__ import annotations

import inspect
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from catsproto.adapters import transfer_tls
from catsproto.cli import build_parser
from catsproto.commands import UsageError
from catsproto.commands import transfer as transfer_cli
from tests.transfer_helpers import HOLDER, PULLER, TRUST, closed_by_peer

CLI = [sys.executable, "-m", "catsproto", "transfer"]
SERVE = ["serve", "--plaintext", "--listen", "127.0.0.1:0", "--synthetic", "7:4:1024"]
PULL = ["pull", "--plaintext", "--from", "127.0.0.1:9", "--synthetic", "7:4"]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Key files of the holder and the puller and the trust file both trust."""
    out = {}
    for name, obj in (
        ("holder", HOLDER.to_json("holder")),
        ("puller", PULLER.to_json("puller")),
        ("trust", TRUST.to_json()),
    ):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(obj))
        path.chmod(0o644 if name == "trust" else 0o600)  # a key file others read is refused
        out[name] = str(path)
    return out


def test_the_commands_defaults_are_the_servers_and_the_pullers():
    o = transfer_tls.ServerOptions(plaintext=True)  # SERVE's --plaintext
    pull = inspect.signature(transfer_tls.pull).parameters
    assert o.timeout == pull["timeout"].default == transfer_cli.IO_TIMEOUT_S
    assert o.handshake_timeout == o.request_timeout == transfer_cli.HANDSHAKE_TIMEOUT_S
    assert pull["handshake_timeout"].default == transfer_cli.HANDSHAKE_TIMEOUT_S
    assert o.offer_timeout == transfer_cli.OFFER_TIMEOUT_S == transfer_tls.OFFER_TIMEOUT
    assert o.max_connections == transfer_cli.MAX_CONNECTIONS
    assert o.min_rate_bps == transfer_cli.MIN_RATE_BPS
    args = build_parser().parse_args(["transfer", *SERVE])
    assert transfer_cli.server_options(args) == o


def test_every_option_reaches_the_server_options():
    argv = ["transfer", *SERVE, "--timeout", "7.5", "--handshake-timeout", "0.25",
            "--request-timeout", "1.5", "--min-rate", "1000", "--max-connections", "10",
            "--max-handshakes", "4", "--max-handshakes-per-address", "2",
            "--offer-timeout", "0.125"]  # fmt: skip
    o = transfer_cli.server_options(build_parser().parse_args(argv))
    assert (o.timeout, o.handshake_timeout, o.request_timeout) == (7.5, 0.25, 1.5)
    assert o.offer_timeout == 0.125
    assert o.min_rate_bps == 1000
    assert (o.max_connections, o.max_handshakes, o.max_handshakes_per_source) == (10, 4, 2)
    # what is not given follows what is, as ServerOptions' own defaults do
    argv = ["transfer", *SERVE, "--handshake-timeout", "2", "--max-connections", "40"]
    o = transfer_cli.server_options(build_parser().parse_args(argv))
    assert o.request_timeout == 2 and o.max_handshakes == 20 and o.max_handshakes_per_source == 5
    assert o.offer_timeout == 2
    argv = ["transfer", *SERVE, "--handshake-timeout", "0.5"]
    assert transfer_cli.server_options(build_parser().parse_args(argv)).offer_timeout == 0.5
    o = transfer_cli.server_options(build_parser().parse_args([*argv, "--min-rate", "0"]))
    assert o.min_rate_bps == 0


@pytest.mark.parametrize(
    ("rest", "says"),
    [
        ([*SERVE, "--handshake-timeout", "0"], "--handshake-timeout 0.0 is not a positive, finite"),
        ([*SERVE, "--handshake-timeout", "-1"], "--handshake-timeout -1.0 is not"),
        ([*SERVE, "--handshake-timeout", "nan"], "--handshake-timeout nan is not"),
        ([*SERVE, "--handshake-timeout", "inf"], "--handshake-timeout inf is not"),
        ([*SERVE, "--request-timeout", "0"], "--request-timeout 0.0 is not"),
        ([*SERVE, "--request-timeout", "nan"], "--request-timeout nan is not"),
        ([*SERVE, "--offer-timeout", "0"], "--offer-timeout 0.0 is not a positive, finite"),
        ([*SERVE, "--offer-timeout", "6"], "--offer-timeout 6.0 is more than --handshake-timeout"),
        ([*PULL[:-1], "7:4:0"], "--synthetic '7:4:0': BYTES 0 is not >= 1"),
        ([*PULL[:-1], "7:4:1:2"], "--synthetic '7:4:1:2' is not SEED:COUNT[:BYTES]"),
        ([*SERVE, "--timeout", "inf"], "--timeout inf is not a positive, finite number"),
        ([*SERVE, "--timeout", "-3"], "--timeout -3.0 is not"),
        ([*SERVE, "--min-rate", "-1"], "--min-rate -1.0 is not 0 (no floor)..2^64-1"),
        ([*SERVE, "--min-rate", "nan"], "--min-rate nan is not"),
        ([*SERVE, "--min-rate", "inf"], "--min-rate inf is not"),
        ([*SERVE, "--max-connections", "0"], "--max-connections 0 is not >= 1"),
        ([*SERVE, "--max-handshakes", "0"], "--max-handshakes 0 is not >= 1"),
        ([*SERVE, "--max-handshakes-per-address", "0"],
         "--max-handshakes-per-address 0 is not >= 1"),
        ([*SERVE, "--max-connections", "4", "--max-handshakes", "5"],
         "--max-handshakes 5 is more than --max-connections 4"),
        ([*SERVE, "--max-connections", "4", "--max-handshakes-per-address", "3"],
         "--max-handshakes-per-address 3 is more than the 2 unauthenticated connections "
         "allowed in all (half of --max-connections)"),
        ([*SERVE, "--max-handshakes", "2", "--max-handshakes-per-address", "3"],
         "is more than the 2 unauthenticated connections allowed in all --max-handshakes"),
        ([*PULL, "--handshake-timeout", "0"], "--handshake-timeout 0.0 is not a positive, finite"),
        ([*PULL, "--handshake-timeout", "nan"], "--handshake-timeout nan is not"),
        ([*PULL, "--timeout", "inf"], "--timeout inf is not"),
    ],
)  # fmt: skip
def test_a_bad_value_exits_2_with_one_line_before_listening_or_connecting(rest, says):
    r = subprocess.run([*CLI, *rest], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert r.stdout == ""  # no {"listening": ...}, no pull result: nothing was started


def test_server_options_refuses_without_building_anything():
    args = build_parser().parse_args(["transfer", *SERVE, "--max-handshakes", "0"])
    with pytest.raises(UsageError, match="--max-handshakes 0"):
        transfer_cli.server_options(args)


class _Serve:
    """`catsproto transfer serve` as a process, with its address once it listens."""

    def __init__(self, files: dict[str, str], *options: str) -> None:
        argv = [*CLI, "serve", "--key", files["holder"], "--trust", files["trust"],
                "--listen", "127.0.0.1:0", "--synthetic", "7:4:1024", *options]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        host, _, port = json.loads(line)["listening"].rpartition(":")
        self.address = (host, int(port))

    def stop(self) -> list[dict]:
        """SIGTERM; the records of the served connections it prints at the end."""
        return self.stop_with_log()[0]

    def stop_with_log(self) -> tuple[list[dict], str]:
        """SIGTERM; those records and everything it wrote on stderr."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=20)
        assert self.proc.returncode == 0, err
        return [json.loads(line) for line in err.splitlines() if line.startswith("{")], err


def _silent_for(address: tuple[str, int], wait: float) -> tuple[socket.socket, float]:
    """Connect, send nothing; how long until the holder closed (math.inf: not in `wait`)."""
    sock = socket.create_connection(address, timeout=5)
    started = time.monotonic()
    closed = closed_by_peer(sock, wait)
    return sock, (time.monotonic() - started) if closed else math.inf


def test_a_short_handshake_timeout_drops_a_silent_peer_sooner_than_the_default(files):
    srv = _Serve(files, "--handshake-timeout", "0.5")
    try:
        sock, took = _silent_for(srv.address, transfer_cli.HANDSHAKE_TIMEOUT_S)
        sock.close()
    finally:
        records = srv.stop()
    # measured from our connect; the holder counts from its accept, a moment before
    assert 0.3 <= took < 2.0, took
    assert any("deadline of 0.5 s" in r["error"] for r in records), records


def test_handshake_caps_from_the_command_line_evict_the_older_silent_peer(files):
    srv = _Serve(files, "--max-connections", "4", "--max-handshakes-per-address", "1")
    first = socket.create_connection(srv.address, timeout=5)
    try:
        time.sleep(0.2)  # accepted before the second
        second = socket.create_connection(srv.address, timeout=5)  # the same address
        started = time.monotonic()
        first_closed = closed_by_peer(first, 2.0)
        took = time.monotonic() - started
        assert first_closed and took < 1.0, took  # evicted at once, long before a deadline
        assert not closed_by_peer(second, 0.2)  # the newer one keeps its slot
        second.close()
    finally:
        first.close()
        records = srv.stop()
    assert any(
        r["error"] == "evicted before authentication: the oldest of 1 from 127.0.0.1 not yet "
        "authenticated"
        for r in records
    ), records


def test_a_running_serve_refuses_a_puller_revoked_in_its_trust_file(files):
    # issue #32, row 3: the trust file was read once at start, so a revoked puller kept
    # pulling from a running holder; now the next connection reads the changed file
    from catsproto.adapters.transfer_tls import PeerPolicy, TransferIdentity, pull
    from catsproto.transfer import synthetic_keys

    keys = synthetic_keys(7, 4)
    srv = _Serve(files)
    with TransferIdentity(PULLER) as puller:
        policy = PeerPolicy(TRUST, expected_key_id=HOLDER.key_id)
        try:
            before = pull(srv.address, puller, policy, keys, timeout=5)
            revoked = TRUST.without_key(PULLER.key_id)
            Path(files["trust"]).write_text(json.dumps(revoked.to_json()))
            after = pull(srv.address, puller, policy, keys, timeout=5)
            Path(files["trust"]).write_text("{not json")
            broken = pull(srv.address, puller, policy, keys, timeout=5)
        finally:
            _, err = srv.stop_with_log()
    assert before.error is None and before.completed is not None
    assert after.completed is None and broken.completed is None
    assert "may not trust this node's key" in str(after.error)
    lines = err.splitlines()
    assert f"trust file {files['trust']}: reloaded" in lines
    assert any(
        line.startswith(f"trust file {files['trust']}: does not load: ")
        and line.endswith("; keeping the last good trust store")
        for line in lines
    ), lines
    records = [json.loads(line) for line in lines if line.startswith("{")]
    unknown = f"PeerAuthError: unknown-key: no delegation for key {PULLER.key_id.hex()}"
    assert [r["error"] for r in records] == ["", unknown, unknown]


def test_pull_with_the_expected_block_size_refuses_a_larger_block():
    srv = subprocess.Popen(
        [*CLI, *SERVE[:-1], "7:4:65536"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert srv.stdout is not None
        port = json.loads(srv.stdout.readline())["listening"].rpartition(":")[2]
        base = [*CLI, "pull", "--plaintext", "--from", f"127.0.0.1:{port}", "--synthetic"]
        small = subprocess.run([*base, "7:4:4096"], capture_output=True, text=True, timeout=30)
        right = subprocess.run([*base, "7:4:65536"], capture_output=True, text=True, timeout=30)
    finally:
        srv.send_signal(signal.SIGTERM)
        srv.communicate(timeout=20)
    assert small.returncode == 1 and right.returncode == 0, (small.stderr, right.stderr)
    out = json.loads(small.stdout)
    assert out["ok"] is False and out["blocks"] == 0
    assert out["error"].startswith("BlockTooLargeError: block frame at stream offset ")
    assert "announced as 65536 bytes, over the limit of 4096" in out["error"]
    assert json.loads(right.stdout)["blocks"] == 4


def test_a_short_handshake_timeout_gives_up_on_a_silent_holder(files):
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    accepting = threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True)
    accepting.start()
    port = listener.getsockname()[1]
    argv = [*CLI, "pull", "--key", files["puller"], "--trust", files["trust"],
            "--from", f"127.0.0.1:{port}", "--synthetic", "7:4",
            "--handshake-timeout", "0.5"]  # fmt: skip
    try:
        started = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        took = time.monotonic() - started
    finally:
        for s in (*held, listener):
            s.close()
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is False and out["error"].startswith("HandshakeDeadlineError"), out
    assert "deadline of 0.5 s" in out["error"]
    # the process start and imports included; the default would wait 5 s for the offer
    assert took < transfer_cli.HANDSHAKE_TIMEOUT_S, took


@pytest.mark.parametrize("command", ["serve", "pull"])
def test_a_missing_key_file_names_the_option_and_the_path_once(command: str, files) -> None:
    rest = (
        ["--synthetic", "7:4:1024", "--listen", "127.0.0.1:0"]
        if command == "serve"
        else ["--synthetic", "7:4", "--from", "127.0.0.1:9"]
    )
    missing = "/nonexistent-dir/key.json"
    r = subprocess.run(
        [*CLI, command, "--key", missing, "--trust", files["trust"], *rest],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert (
        r.stderr == f"catsproto transfer: --key {missing}: cannot read: No such file or directory\n"
    )


def test_a_refused_pull_says_connection_refused() -> None:
    with socket.socket() as s:  # bound, never listening: the connect is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        r = subprocess.run(
            [*CLI, "pull", "--plaintext", "--from", f"127.0.0.1:{port}", "--synthetic", "7:4"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["error"] == (
        f"ConnectError: connection refused by 127.0.0.1:{port} (no holder listens there)"
    )
