"""The signing spool and the announcer, attacked as issue #41 rows 1-5 found them.

The spool is a folder of route files the node writes and ExaBGP's API process reads.
Whoever can put a file (or a link, or a FIFO) in it decides what is written outside it
or announced in BGP, so: temporary files are created fresh and never written through a
link (row 1); a folder others may write is refused, naming the chmod (row 2); the
announcer reads only regular files of ours, never through a link (row 3), only host
routes or what a delegation's route scope allows (row 4), and neither a FIFO in the
spool nor one given as the signing key blocks anything (row 5)."""

from __future__ import annotations

import io
import ipaddress
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from catsproto import security
from catsproto.adapters import exabgp_announce as ann
from catsproto.adapters.file_modes import FileModeError
from catsproto.adapters.signed_routes import read_signing_key
from catsproto.cli import build_parser
from catsproto.commands import UsageError
from catsproto.security.vectors import fixture

F = fixture()
SECRET = "ab" * 16
HOST = ipaddress.ip_network("10.1.0.11/32")


def spool_dir(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    return d


def announced(spool: ann.Spool, announcer: ann.Announcer | None = None) -> list[str]:
    """The commands one round of the API process writes for what is in `spool`."""
    out, acks = io.StringIO(), io.StringIO("done\n" * 20)
    steps = iter([False, True])
    logged: list[str] = []
    ann.run(
        spool,
        announcer or ann.Announcer(),
        out,
        acks,
        poll=0,
        log=logged.append,
        stop=lambda: next(steps),
    )
    return out.getvalue().splitlines()


# ---- row 1: the temporary file -------------------------------------------------------


def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    d = spool_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    spool = ann.Spool(d)
    # every name the old code would use (pid-based), and the final name too
    (d / f".10.1.0.11_32.{os.getpid()}.tmp").symlink_to(victim)
    spool.publish(HOST, b"\x01\x02")
    assert victim.read_bytes() == b"precious"
    assert spool.read()[HOST][0] == b"\x01\x02"
    (d / "10.1.0.11_32").unlink()
    (d / "10.1.0.11_32").symlink_to(victim)
    spool.publish(HOST, b"\x03")  # replaces the link itself
    assert victim.read_bytes() == b"precious"
    assert not (d / "10.1.0.11_32").is_symlink()
    assert spool.read()[HOST][0] == b"\x03"


def test_route_files_are_0644_whatever_the_umask(tmp_path: Path) -> None:
    d = spool_dir(tmp_path)
    old = os.umask(0)
    try:
        ann.Spool(d).publish(HOST, b"\x01")
        made = ann.Spool(tmp_path / "made")  # a folder the spool makes itself
    finally:
        os.umask(old)
    assert stat.S_IMODE((d / "10.1.0.11_32").stat().st_mode) == 0o644
    assert stat.S_IMODE(made.path.stat().st_mode) == 0o755
    leftovers = [p.name for p in d.iterdir() if p.name.startswith(".")]
    assert leftovers == []


# ---- row 2: the folder ---------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o757])
def test_a_spool_folder_others_may_write_is_refused_with_the_chmod(
    tmp_path: Path, mode: int
) -> None:
    d = spool_dir(tmp_path)
    d.chmod(mode)
    with pytest.raises(FileModeError) as caught:
        ann.Spool(d)
    said = str(caught.value)
    assert f"spool folder {d} has mode {mode:04o}" in said
    assert said.endswith(f"chmod go-w {d}")
    assert stat.S_IMODE(d.stat().st_mode) == mode  # changes nothing


def test_a_spool_in_a_folder_others_may_write_without_the_sticky_bit_is_refused(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    d = parent / "spool"
    d.mkdir(mode=0o755)
    with pytest.raises(FileModeError) as caught:
        ann.Spool(d)
    assert str(caught.value) == (
        f"folder {parent} of the spool folder {d} has mode 0777: others can replace the "
        f"spool folder (group and others can write it, no sticky bit); chmod go-w {parent}"
    )
    parent.chmod(0o1777)  # sticky, as /tmp: only the owner may rename what is in it
    assert ann.Spool(d).path == d


def test_instance_node_refuses_an_open_spool_in_one_line(tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    key.write_text(json.dumps(F.node.to_json("node-1")))
    key.chmod(0o600)
    d = spool_dir(tmp_path)
    d.chmod(0o777)
    args = build_parser().parse_args(
        ["instance", "node", "--secret", SECRET, "--signing-key", str(key), "--spool", str(d)]
    )
    with pytest.raises(UsageError) as caught:
        args.func(args)
    assert str(caught.value) == (
        f"--spool: spool folder {d} has mode 0777: group and others can write it, so they "
        f"could plant links and routes in it; chmod go-w {d}"
    )


# ---- row 3: what the announcer reads -------------------------------------------------


def test_the_announcer_never_follows_a_link_to_a_secret(tmp_path: Path) -> None:
    d = spool_dir(tmp_path)
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"the operator's private key")
    secret.chmod(0o600)
    spool = ann.Spool(d)
    spool.publish(HOST, b"\x01")
    (d / "10.1.0.12_32").symlink_to(secret)
    commands = announced(spool)
    assert commands == [ann.announce_command(HOST, b"\x01")]
    assert b"the operator's private key".hex().upper() not in "".join(commands)
    assert "10.1.0.12_32" in spool.refused and "not a regular file" in spool.refused["10.1.0.12_32"]


# ---- row 4: which routes -------------------------------------------------------------


@pytest.mark.parametrize("name", ["0.0.0.0_0", "10.0.0.0_8", "10.1.0.0_31", "2001:db8::_64"])
def test_only_host_routes_are_announced_without_a_scope(tmp_path: Path, name: str) -> None:
    d = spool_dir(tmp_path)
    (d / name).write_bytes(b"\x01")
    a = ann.Announcer()
    spool = ann.Spool(d)
    assert announced(spool, a) == []
    assert spool.refused == {}  # the file is fine; the route is not ours to announce
    prefix = ann.parse_prefix(name)
    fresh = ann.Announcer()
    assert fresh.step(spool.read(), 0.0) == []
    assert fresh.diagnostics == [
        f"refused: {prefix}: not a host route (/32, /128), and no delegation scope "
        "(--delegation) allows it"
    ]


def test_a_delegation_scope_allows_exactly_its_routes(tmp_path: Path) -> None:
    d = spool_dir(tmp_path)
    delegation = security.authorise(
        F.operator,
        F.node.public.raw,
        cs_ids=[1],
        routes=["10.1.0.0/16"],
        addresses=["10.1.0.0/16"],
        not_before_ms=0,
        not_after_ms=2**62,
    )
    file = tmp_path / "delegation.json"
    file.write_text(json.dumps(security.delegation_to_json(delegation)))
    scope = ann.read_route_scope(file)
    assert scope == (ipaddress.ip_network("10.1.0.0/16"),)
    for name in ("10.1.0.0_24", "10.1.0.11_32", "10.2.0.11_32", "0.0.0.0_0"):
        (d / name).write_bytes(b"\x01")
    a = ann.Announcer(scope=scope)
    assert [c.split()[2] for c in announced(ann.Spool(d), a)] == ["10.1.0.0/24", "10.1.0.11/32"]
    assert ann.main(["--spool", str(d), "--delegation", str(tmp_path / "none")]) == 2
    file.chmod(0o666)
    with pytest.raises(FileModeError):
        ann.read_route_scope(file)


# ---- row 5: FIFOs --------------------------------------------------------------------


def _within(seconds: float, fn, *args):  # type: ignore[no-untyped-def]
    """fn(*args) on a thread; its result, or a failure if it has not returned in time."""
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        # unblock it: open the FIFO's other end
        for a in args:
            if isinstance(a, (str, Path)) and stat.S_ISFIFO(os.stat(a).st_mode):
                os.close(os.open(a, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail(f"{fn.__name__} blocked for more than {seconds} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]


def test_a_fifo_in_the_spool_blocks_nothing(tmp_path: Path) -> None:
    d = spool_dir(tmp_path)
    spool = ann.Spool(d)
    spool.publish(HOST, b"\x01")
    fifo = d / "10.1.0.12_32"
    os.mkfifo(fifo, 0o644)
    got = _within(5, ann.Spool.read, spool)
    assert list(got) == [HOST]
    assert "not a regular file" in spool.refused["10.1.0.12_32"]


def test_a_fifo_as_the_signing_key_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "node.key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(OSError) as caught:
        _within(5, read_signing_key, str(fifo))
    assert str(caught.value) == f"key file {fifo} is not a regular file (a FIFO)"
