"""Secret and trust files open to other users are refused at every loader (issue #32, row 7c).

A secret file (signing key, group key, API token) with any permission for group or others,
and a trust file (trust store, delegation, operator public key) that group or others may
write, are refused with a message naming the file, its mode and the chmod that fixes it;
the modes the project writes (0600, 0644) and tighter ones load. Each loader is driven
through its real entry point: the CLI in this process, the daemons' option readers, the
receive daemon's trust-file verifier."""

from __future__ import annotations

import argparse
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from catsproto import cli, security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.adapters import file_modes, http
from catsproto.adapters.file_modes import FileModeError
from catsproto.commands import UsageError
from catsproto.security import commands
from catsproto.security.vectors import NLRI, NOW_MS, fixture

F = fixture()
TOKEN = "file-modes-test-token-0123456789"
ROOT = Path(__file__).resolve().parent.parent

SECRET_REFUSED = [0o644, 0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o666]
SECRET_ACCEPTED = [0o600, 0o400, 0o700]
TRUST_REFUSED = [0o664, 0o646, 0o666, 0o620, 0o602, 0o777]
TRUST_ACCEPTED = [0o644, 0o444, 0o640, 0o600, 0o755]


# ---- the rule, on mode numbers ---------------------------------------------------------


@pytest.mark.parametrize("mode", SECRET_REFUSED)
def test_a_secret_open_to_group_or_others_is_a_problem(mode):
    problem = file_modes.mode_problem("/k/node.key", mode, "key file", secret=True)
    assert problem is not None
    assert problem.startswith(f"key file /k/node.key has mode {mode:04o}: ")
    assert problem.endswith("chmod 600 /k/node.key")


@pytest.mark.parametrize("mode", SECRET_ACCEPTED)
def test_a_secret_private_to_its_owner_is_fine(mode):
    assert file_modes.mode_problem("/k/node.key", mode, "key file", secret=True) is None


@pytest.mark.parametrize("mode", TRUST_REFUSED)
def test_a_trust_file_others_may_write_is_a_problem(mode):
    problem = file_modes.mode_problem("/t/trust.json", mode, "trust file", secret=False)
    assert problem is not None
    assert problem.startswith(f"trust file /t/trust.json has mode {mode:04o}: ")
    assert problem.endswith("chmod go-w /t/trust.json")


@pytest.mark.parametrize("mode", TRUST_ACCEPTED)
def test_a_trust_file_only_its_owner_writes_is_fine(mode):
    assert file_modes.mode_problem("/t/trust.json", mode, "trust file", secret=False) is None


@pytest.mark.parametrize(
    ("mode", "secret", "who"),
    [
        (0o644, True, "group and others can read it"),
        (0o640, True, "group can read it"),
        (0o606, True, "others can read and write it"),
        (0o671, True, "group can read and write and execute it; others can execute it"),
        (0o664, False, "group can write it"),
        (0o666, False, "group and others can write it"),
    ],
)
def test_the_message_says_who_may_do_what(mode, secret, who):
    problem = file_modes.mode_problem("/f", mode, "file", secret=secret)
    assert problem is not None and f": {who}, " in problem


def test_the_fix_quotes_a_path_a_shell_would_split():
    problem = file_modes.mode_problem("/my keys/node.key", 0o644, "key file", secret=True)
    assert problem is not None and problem.endswith("chmod 600 '/my keys/node.key'")


def test_a_refusal_is_a_permission_error_that_reads_as_its_message(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o644)
    with pytest.raises(PermissionError) as caught:
        file_modes.read_secret_file(path, "API token file")
    assert isinstance(caught.value, FileModeError) and caught.value.mode == 0o644
    assert str(caught.value) == caught.value.strerror
    assert str(caught.value).startswith(f"API token file {path} has mode 0644: ")


def test_the_mode_checked_is_the_files_not_a_links(tmp_path):
    """Symbolic links are 0777 themselves: the check follows them to the file read."""
    target, link = tmp_path / "trust.json", tmp_path / "link.json"
    target.write_text(json.dumps(F.trust.to_json()))
    target.chmod(0o644)
    link.symlink_to(target)
    assert file_modes.read_trust_file(link, "trust file") == target.read_bytes()
    target.chmod(0o666)
    with pytest.raises(FileModeError, match="mode 0666"):
        file_modes.read_trust_file(link, "trust file")


# ---- every loader, per file kind -------------------------------------------------------


def _write(path: Path, obj: object, mode: int) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    path.chmod(mode)
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """One good file of each kind, at the mode the project writes it with."""
    operator = F.operator.to_json("op")
    signed = wire.encode(security.sign(F.at(1, 1), F.node, NLRI))
    return {
        "node.key": _write(tmp_path / "node.key", F.node.to_json("node"), 0o600),
        "op.key": _write(tmp_path / "op.key", operator, 0o600),
        "op.pub": _write(tmp_path / "op.pub", commands.public_key(operator), 0o644),
        "deleg.json": _write(
            tmp_path / "deleg.json", security.delegation_to_json(F.delegation), 0o644
        ),
        "trust.json": _write(tmp_path / "trust.json", F.trust.to_json(), 0o644),
        "group.key": _write(tmp_path / "group.key", F.group.active.to_json(), 0o600),
        "token": _write(tmp_path / "token", TOKEN + "\n", 0o600),
        "value.hex": _write(tmp_path / "value.hex", wire.encode(F.at(1, 1)).hex(), 0o644),
        "signed.hex": _write(tmp_path / "signed.hex", signed.hex(), 0o644),
    }


Run = Callable[[dict[str, Path], Any], "str | None"]


@dataclass(frozen=True)
class Loader:
    """A place that reads a `file` of one kind; `run` returns the refusal, or None when
    the whole load worked."""

    name: str
    file: str
    secret: bool
    run: Run


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str | None:
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    _, err = capsys.readouterr()
    if status == 0:
        return None
    assert status == 2 and len(err.splitlines()) == 1, (status, err)  # one usage line
    return err


def _raised(errors: type[BaseException] | tuple, call: Callable[[], object]) -> str | None:
    try:
        call()
    except errors as exc:
        return str(exc)
    return None


def _sign(f: dict[str, Path], *extra: str) -> list[str]:
    return ["sign", str(f["value.hex"]), "--key", str(f["node.key"]), "--route", str(NLRI), *extra]


def _verify(f: dict[str, Path], *extra: str) -> list[str]:
    argv = ["verify", str(f["signed.hex"]), "--trust", str(f["trust.json"])]
    return [*argv, "--route", str(NLRI), "--now-ms", str(NOW_MS), *extra]


def _authorize(f: dict[str, Path]) -> list[str]:
    scope = ["--cs-id", "100", "--route", "10.0.0.0/16", "--address", "192.0.2.0/24"]
    return ["authorize", str(f["op.key"]), F.node.public.raw.hex(), *scope]


def _transfer(f: dict[str, Path], _capsys: object) -> str | None:
    from catsproto.commands import transfer

    args = argparse.Namespace(
        plaintext=False, key=str(f["node.key"]), trust=str(f["trust.json"]), holder=None
    )
    return _raised(UsageError, lambda: transfer._credentials(args))


def _inspect(trust: Path | None, group_keys: list[Path]) -> str | None:
    from catsproto.commands.inspect import make_verifier

    given = str(trust) if trust is not None else None
    return _raised(UsageError, lambda: make_verifier(given, [str(k) for k in group_keys]))


def _receive_group_key(f: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> str | None:
    parser = argparse.ArgumentParser(prog="exabgp_receive")
    refused = _raised(SystemExit, lambda: rx._group_keys(parser, [str(f["group.key"])]))
    return capsys.readouterr().err if refused is not None else None


def _receive_trust(f: dict[str, Path], _capsys: object) -> str | None:
    logs: list[str] = []
    verifier = rx.TrustFileVerifier(f["trust.json"], clock=lambda: NOW_MS / 1000, log=logs.append)
    value = bytes.fromhex(f["signed.hex"].read_text())
    got = verifier(value, wire.decode(value), NLRI)
    return None if got.accepted else got.reason  # "trust file unavailable: ..."


def _lab_client_token(f: dict[str, Path], _capsys: object) -> str | None:
    from catsproto.lab import flows

    return _raised(FileModeError, lambda: flows._read_token(str(f["token"])))


LOADERS = [
    Loader(
        "API token: --api-token-file (instance, steering daemon, ingress, lab instances)",
        "token",
        True,
        lambda f, c: _raised(
            ValueError, lambda: http.token_option(str(f["token"]), "--api-token-file")
        ),
    ),
    Loader("API token: the lab's flows client", "token", True, _lab_client_token),
    Loader("node key: catsproto sign --key", "node.key", True, lambda f, c: _cli(_sign(f), c)),
    Loader("node key: catsproto transfer --key", "node.key", True, _transfer),
    Loader(
        "operator key: catsproto authorize", "op.key", True, lambda f, c: _cli(_authorize(f), c)
    ),
    Loader(
        "operator private key: catsproto trust --operator",
        "op.key",
        True,
        lambda f, c: _cli(["trust", "--operator", str(f["op.key"])], c),
    ),
    Loader(
        "group key: catsproto sign --seal",
        "group.key",
        True,
        lambda f, c: _cli(_sign(f, "--seal", str(f["group.key"])), c),
    ),
    Loader(
        "group key: catsproto verify --group-key",
        "group.key",
        True,
        lambda f, c: _cli(_verify(f, "--group-key", str(f["group.key"])), c),
    ),
    Loader(
        "group key: catsproto inspect --group-key",
        "group.key",
        True,
        lambda f, c: _inspect(None, [f["group.key"]]),
    ),
    Loader("group key: exabgp_receive --group-key", "group.key", True, _receive_group_key),
    Loader(
        "trust file: catsproto verify --trust",
        "trust.json",
        False,
        lambda f, c: _cli(_verify(f), c),
    ),
    Loader(
        "trust file: catsproto trust --previous",
        "trust.json",
        False,
        lambda f, c: _cli(
            ["trust", "--operator", str(f["op.pub"]), "--previous", str(f["trust.json"])], c
        ),
    ),
    Loader(
        "trust file: catsproto inspect --trust",
        "trust.json",
        False,
        lambda f, c: _inspect(f["trust.json"], []),
    ),
    Loader("trust file: catsproto transfer --trust", "trust.json", False, _transfer),
    Loader("trust file: exabgp_receive --trust", "trust.json", False, _receive_trust),
    Loader(
        "delegation: catsproto trust --delegation",
        "deleg.json",
        False,
        lambda f, c: _cli(
            ["trust", "--operator", str(f["op.pub"]), "--delegation", str(f["deleg.json"])], c
        ),
    ),
    Loader(
        "delegation: catsproto sign --delegation",
        "deleg.json",
        False,
        lambda f, c: _cli(_sign(f, "--delegation", str(f["deleg.json"])), c),
    ),
    Loader(
        "operator public key: catsproto trust --operator",
        "op.pub",
        False,
        lambda f, c: _cli(["trust", "--operator", str(f["op.pub"])], c),
    ),
]


def _cases(accepted: bool) -> list:
    cases = []
    for loader in LOADERS:
        if loader.secret:
            modes = SECRET_ACCEPTED if accepted else SECRET_REFUSED
        else:
            modes = TRUST_ACCEPTED if accepted else TRUST_REFUSED
        cases += [pytest.param(loader, m, id=f"{loader.name} {m:04o}") for m in modes]
    return cases


@pytest.mark.parametrize(("loader", "mode"), _cases(accepted=False))
def test_a_file_open_to_others_is_refused(loader, mode, files, capsys):
    path = files[loader.file]
    path.chmod(mode)
    refusal = loader.run(files, capsys)
    assert refusal is not None, f"{loader.name} loaded a {mode:04o} file"
    fix = "chmod 600" if loader.secret else "chmod go-w"
    assert f"{path} has mode {mode:04o}: " in refusal, refusal
    assert f"{fix} {path}" in refusal, refusal


@pytest.mark.parametrize(("loader", "mode"), _cases(accepted=True))
def test_a_file_closed_to_others_loads(loader, mode, files, capsys):
    """Controls: each loader works with its file at the modes the project writes (0600
    secrets, 0644 trust files) and tighter ones (these pass before the check too)."""
    files[loader.file].chmod(mode)
    assert loader.run(files, capsys) is None


def test_the_ingress_daemon_stops_at_start_on_a_readable_token(files, capsys):
    files["token"].chmod(0o644)
    argv = ["ingress", "serve", "--config", str(files["trust.json"])]
    refusal = _cli([*argv, "--api-token-file", str(files["token"])], capsys)
    assert refusal is not None and "--api-token-file: API token file" in refusal
    assert f"chmod 600 {files['token']}" in refusal


def test_transfer_serve_rereads_its_trust_file_only_while_others_cannot_write_it(files, capsys):
    """`transfer serve` reads its trust file again when it changes (issue #32 row 3): a
    rewrite others may write is refused like a broken one, the last good store kept."""
    from catsproto.commands import transfer

    path, policy = files["trust.json"], SimpleNamespace(trust=None)
    transfer._reloading(policy, str(path))
    assert policy.trust.current() is not None and policy.trust.loads == 1
    path.write_text(json.dumps(F.trust.to_json(), indent=1))  # a new stamp
    path.chmod(0o664)
    assert policy.trust.current() is not None  # the last good store
    assert policy.trust.loads == 1 and policy.trust.reload_failures == 1
    assert "has mode 0664: group can write it" in policy.trust.error
    assert f"chmod go-w {path}" in capsys.readouterr().err  # logged once
    with pytest.raises(UsageError, match="mode 0664"):
        transfer._reloading(SimpleNamespace(trust=None), str(path))


def test_a_chmod_alone_is_reread(files):
    """Fixing a refused file's mode is a change the daemons see: the mode is part of the
    stamp they reread on, so no `touch` is needed."""
    from catsproto.adapters import exabgp_receive as rx
    from catsproto.commands import transfer

    path = files["trust.json"]
    path.chmod(0o664)
    verifier = rx.TrustFileVerifier(path, log=lambda m: None)
    assert verifier._current() is None and verifier.reload_failures == 1  # refused
    policy = SimpleNamespace(trust=None)
    path.chmod(0o644)
    transfer._reloading(policy, str(path))
    path.chmod(0o664)
    assert policy.trust.current() is not None and policy.trust.reload_failures == 1
    path.chmod(0o644)  # mtime, size and inode unchanged
    assert verifier._current() is not None and verifier.loads == 1
    assert policy.trust.current() is not None and policy.trust.error == ""


def test_the_engine_client_refuses_a_readable_token(files):
    from catsproto.lab import engine_client

    files["token"].chmod(0o640)
    argv = ["ask", "--url", "http://127.0.0.1:9", "--token-file", str(files["token"])]
    with pytest.raises(FileModeError, match="mode 0640: group can read it"):
        engine_client.main(argv)


def test_stdin_has_no_mode_to_check(files, capsys, monkeypatch):
    """`-` reads the key from stdin, which the caller handed over: no mode to check."""
    import io

    raw = json.dumps(F.node.to_json("node")).encode()
    monkeypatch.setattr("sys.stdin", SimpleNamespace(buffer=io.BytesIO(raw)))
    assert (
        _cli(["sign", str(files["value.hex"]), "--key", "-", "--route", str(NLRI)], capsys) is None
    )


# ---- what the project writes passes ----------------------------------------------------


@pytest.fixture
def open_umask():
    """Umask 0: a file created without an explicit mode would be 0666."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("write", "mode"),
    [(file_modes.write_secret_file, 0o600), (file_modes.write_trust_file, 0o644)],
)
def test_written_files_get_their_mode_whatever_the_umask_or_was_there(
    tmp_path, open_umask, write, mode
):
    path = tmp_path / "f"
    write(path, b"first")
    assert _mode(path) == mode and path.read_bytes() == b"first"
    path.chmod(0o666)
    write(path, b"second")
    assert _mode(path) == mode and path.read_bytes() == b"second"
    victim = tmp_path / "victim"
    victim.write_bytes(b"ORIGINAL")
    path.unlink()
    path.symlink_to(victim)
    write(path, b"third")  # the link is replaced, not written through
    assert not path.is_symlink() and victim.read_bytes() == b"ORIGINAL"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_lab_trust_file_is_0644_whatever_the_umask_or_was_there(tmp_path, open_umask):
    from catsproto.lab.instances import write_lab_trust
    from catsproto.lab.topology import load

    topology = load(ROOT / "lab" / "cats4.clab.yml")
    path = tmp_path / "trust.json"
    path.write_text("{}")
    path.chmod(0o666)  # left by an earlier run, or made by a careless hand
    write_lab_trust(topology, str(path), NOW_MS)
    assert _mode(path) == 0o644
    store = security.TrustStore.from_json(json.loads(file_modes.read_trust_file(path, "trust")))
    assert store.to_json() == json.loads(path.read_text())


def test_the_lab_token_and_group_key_files_pass_their_loaders(tmp_path, open_umask):
    """Controls: the runner's token and group key files were 0600 before the check."""
    from catsproto.lab import flows, runner
    from catsproto.lab.topology import load

    token = flows.write_token_file(tmp_path / "instances.token")
    assert http.token_option(str(token), "--api-token-file") is not None
    lab = SimpleNamespace(
        node_dir=lambda _node: tmp_path, topology=load(ROOT / "lab" / "cats4.clab.yml")
    )
    key = runner.write_group_key(lab, "e1")  # type: ignore[arg-type]
    assert rx._group_keys(argparse.ArgumentParser(), [str(key)]) is not None


def test_keygen_writes_key_files_the_commands_take(tmp_path, capsys, open_umask):
    key, group = tmp_path / "node.key", tmp_path / "group.key"
    assert _cli(["keygen", str(key)], capsys) is None
    assert _cli(["keygen", str(group), "--group", "7"], capsys) is None
    assert _mode(key) == _mode(group) == 0o600
    value = tmp_path / "value.hex"
    value.write_text(wire.encode(F.at(1, 1)).hex())
    argv = ["sign", str(value), "--key", str(key), "--route", str(NLRI), "--seal", str(group)]
    assert _cli(argv, capsys) is None
