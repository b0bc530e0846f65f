"""The `catsproto` command as a user runs it: a real process, real stdin/stdout.

The many vector cases run `cli.main` in this process with stdin and stdout swapped
(`invoke`), the same code path without an interpreter start each; the rest, and one
vector, run the real process (`run`)."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from catsproto import cli
from catsproto.commands import CommandParser, HelpFormatter, shows_default
from catsproto.commands.chaos import SCENARIO_NAMES
from catsproto.sim import POLICIES

VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())


def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "catsproto", *args], input=stdin, capture_output=True, timeout=60
    )


@pytest.fixture
def invoke(monkeypatch, capsysbinary):
    """`run` in this process: `cli.main` with `stdin` as its stdin, giving the same
    CompletedProcess (exit code, stdout and stderr bytes)."""

    def call(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        capsysbinary.readouterr()
        code = cli.main(list(args))
        out, err = capsysbinary.readouterr()
        return subprocess.CompletedProcess(["catsproto", *args], code, out, err)

    return call


@pytest.mark.parametrize("vector", VECTORS["positive"], ids=lambda v: v["name"])
def test_decode_prints_the_json_and_encode_prints_the_hex(vector, invoke):
    out = invoke("decode", stdin=vector["hex"].encode())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == vector["json"]
    back = invoke("encode", stdin=out.stdout)
    assert back.returncode == 0, back.stderr
    assert back.stdout.decode().strip() == vector["hex"]
    attr = invoke("encode", "--attribute", stdin=out.stdout)
    assert attr.stdout.decode().strip() == vector["attribute"]


def test_a_real_process_decodes_and_encodes_a_vector():
    vector = VECTORS["positive"][0]
    out = run("decode", stdin=vector["hex"].encode())
    assert out.returncode == 0 and json.loads(out.stdout) == vector["json"], out.stderr
    back = run("encode", "--attribute", stdin=out.stdout)
    assert back.returncode == 0 and back.stdout.decode().strip() == vector["attribute"]
    bad = run("decode", stdin=VECTORS["negative"][0]["hex"].encode())
    assert bad.returncode == 2 and bad.stdout == b""
    assert bad.stderr.decode() == f"catsproto decode: {VECTORS['negative'][0]['message']}\n"


def test_decode_takes_raw_bytes_and_whole_attributes(tmp_path):
    vector = VECTORS["positive"][2]
    raw = tmp_path / "value.bin"
    raw.write_bytes(bytes.fromhex(vector["hex"]))
    assert json.loads(run("decode", str(raw)).stdout) == vector["json"]
    out = run("decode", "--attribute", stdin=("0x" + vector["attribute"]).encode())
    assert json.loads(out.stdout) == vector["json"]


@pytest.mark.parametrize("vector", VECTORS["negative"], ids=lambda v: v["name"])
def test_bad_bytes_exit_2_with_one_line(vector, invoke):
    out = invoke("decode", stdin=vector["hex"].encode())
    assert out.returncode == 2
    assert out.stdout == b""
    lines = out.stderr.decode().splitlines()
    assert lines == [f"catsproto decode: {vector['message']}"]


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["encode"], b"{not json", "input is not JSON: line 1 column 2"),
        (["encode"], b'{"version": 1}', "mandatory origin TLV is missing"),
        (["encode"], b'{"metrics-l2": 12}', "metrics-l2 TLV: metrics-l2.score 12 outside 0..10"),
        (["encode"], b'{"bogus": 1}', "no TLV named 'bogus'"),
        (["decode"], b"abc", "odd number of digits"),
        (["decode", "/no/such/file"], b"", "cannot read /no/such/file"),
        (
            ["decode", "--attribute"],
            b"000100010102000b00640001c0000201",  # a bare value: version 1, then origin
            "at offset 0: attribute flags 0x00 lack optional+transitive (0xc0): the input "
            "starts 00 01, the Version TLV's type, so it looks like an attribute value",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, stdin, message, invoke):
    out = invoke(*args, stdin=stdin)
    assert out.returncode == 2
    err = out.stderr.decode()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert message in err


def test_demo_runs_and_round_trips_every_example():
    out = run("demo", "--codec-only")
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    assert text.count(" exact") == len(VECTORS["positive"])
    assert "decode refuses" in text


@pytest.mark.parametrize(
    ("argv", "namespaced", "lab"),
    [
        ([], True, ["lab", "demo", "--seal"]),  # as root: sealed
        (["--no-seal"], True, ["lab", "demo"]),
        ([], False, ["lab", "demo"]),  # loopback cannot seal, and does not try
        (["--embedded"], True, ["lab", "demo", "--embedded"]),
        (["--embedded", "--no-seal"], False, ["lab", "demo", "--embedded"]),
    ],
)
def test_the_main_demo_seals_the_namespaced_lab_only(argv, namespaced, lab):
    args = cli.build_parser().parse_args(["demo", "--no-engine", *argv])
    assert cli.lab_demo_argv(args, namespaced) == lab
    cli.build_parser().parse_args(lab)  # and `lab demo` takes what it is given


def test_the_main_demo_runs_real_engines_where_they_are_installed(tmp_path, monkeypatch, capsys):
    python = tmp_path / "python"
    monkeypatch.setenv("CATSPROTO_ENGINE_PYTHON", str(python))
    args = cli.build_parser().parse_args(["demo"])
    assert cli.lab_demo_argv(args, True) == ["lab", "demo", "--seal"]
    assert f"real engines skipped: no engine at {python}" in capsys.readouterr().out
    python.touch()
    lab = cli.lab_demo_argv(args, True)
    assert lab == ["lab", "demo", "--seal", "--engine", "vllm"]
    cli.build_parser().parse_args(lab)
    # on loopback, or when asked, never
    assert cli.lab_demo_argv(args, False) == ["lab", "demo"]
    no_engine = cli.build_parser().parse_args(["demo", "--no-engine"])
    assert cli.lab_demo_argv(no_engine, True) == ["lab", "demo", "--seal"]


def test_vector_file_check():
    assert run("vectors", "--check").returncode == 0


def test_help_names_every_command():
    text = run("--help").stdout.decode()
    for command in ("decode", "encode", "demo", "vectors"):
        assert command in text


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every parser of the command tree with its subcommand path, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


PARSERS = list(_parsers(cli.build_parser()))


def _shown(value: object) -> list[str]:
    """Ways a help text may spell a default value."""
    if isinstance(value, list | tuple):
        return [" ".join(str(v) for v in value), ",".join(str(v) for v in value)]
    texts = [str(value)]
    if isinstance(value, float):
        texts.append(f"{value:g}")
    if isinstance(value, str) and "/" in value:
        texts.append("/".join(Path(value).parts[-2:]))
    return texts


def test_the_tree_is_walked_whole():
    paths = {" ".join(p) for p, _ in PARSERS}
    for path in ("eval", "lab demo", "instance serve", "transfer pull", "draft render"):
        assert path in paths
    assert len(PARSERS) > 25


@pytest.mark.parametrize(
    ("path", "parser"), PARSERS, ids=[" ".join(p) or "catsproto" for p, _ in PARSERS]
)
def test_every_parser_option_and_subcommand_has_help(path, parser):
    assert isinstance(parser, CommandParser) and parser.formatter_class is HelpFormatter
    text = parser.format_help()  # raises on a help string argparse cannot format
    assert text.startswith(f"usage: {' '.join(['catsproto', *path])}")
    assert parser.description, "no description: its --help would show only the options"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            missing = [name for name in action.choices if not helps.get(name)]
            assert not missing, f"subcommands without help: {missing}"
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{name} has no help"
        if not shows_default(action):
            continue
        said = HelpFormatter("catsproto")._get_help_string(action)
        assert "default" in said, f"{name}: its default is not shown"
        if "(default: " not in said or not said.endswith(")"):  # written by hand
            assert any(t in said for t in _shown(action.default)), (
                f"{name}: the help speaks of a default, but not of {action.default!r}"
            )


@pytest.mark.parametrize(
    "path", [p for p, _ in PARSERS], ids=[" ".join(p) or "catsproto" for p, _ in PARSERS]
)
def test_every_help_runs_and_exits_0(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args([*path, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {' '.join(['catsproto', *path])}")
    assert not re.search(r"\bissues?\b", text, re.IGNORECASE), "help speaks of an issue"


def test_help_runs_as_a_process_and_shows_defaults():
    out = run("eval", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.decode().split())
    assert "--sweep-limit N with --report: requests per catsproto sweep run (0: no sweeps)" in text
    assert "(default: 2000)" in text
    assert "(default: 1.0 4.0)" in text
    assert "catsproto eval --report docs/eval --sweep-limit 2000" in text
    assert "--seeds 1-20 --jobs 2 \\ --report docs/eval/seeds" in text
    assert "CATSPROTO_TRACES" in text


def test_eval_help_lists_every_policy_and_the_sweep_default():
    parser = dict(PARSERS)[("eval",)]
    actions = {a.dest: a for a in parser._actions}
    assert actions["sweep_limit"].default == 2000
    for policy in POLICIES:
        assert policy in actions["policies"].help


def test_chaos_help_names_the_campaigns_scenarios():
    from catsproto.lab.faults import campaign

    assert tuple(campaign.SCENARIOS) == SCENARIO_NAMES
    parser = dict(PARSERS)[("chaos",)]
    only = next(a for a in parser._actions if a.dest == "only")
    assert all(name in only.help for name in campaign.SCENARIOS)


def test_lab_status_and_down_find_a_loopback_lab_without_root(tmp_path, monkeypatch):
    """`lab up --embedded` without --root puts its run directory in the loopback root;
    `lab status` / `lab down` without --root look there as well as in the namespace
    labs' root (they used to look only in the latter)."""
    import argparse

    from catsproto.adapters import netns
    from catsproto.commands import lab
    from catsproto.lab import runner

    ns_root, loop_root = tmp_path / "run", tmp_path / "loop"
    for root, tag in ((ns_root, "n1"), (loop_root, "e2")):
        (root / tag).mkdir(parents=True)
        (root / tag / netns.STATE_FILE).write_text("{}")
    monkeypatch.setattr(runner, "DEFAULT_ROOT", ns_root)
    monkeypatch.setattr(lab, "LOOPBACK_ROOT", loop_root)
    found, where = lab._running(argparse.Namespace(root=None, tag=None))
    assert [p.name for p in found] == ["n1", "e2"]
    assert str(ns_root) in where and str(loop_root) in where
    only, _ = lab._running(argparse.Namespace(root=str(loop_root), tag=None))
    assert [p.name for p in only] == ["e2"]
    assert lab._one_lab(argparse.Namespace(root=None, tag="e2")) == loop_root / "e2"


@pytest.mark.parametrize("tag", ["", "A1", "1ab", "ab-c", "abcdefghi"])
def test_lab_up_refuses_a_bad_tag_before_building(tmp_path, tag):
    """A tag prefixes namespace and interface names (15 characters at most), so `lab up`
    checks it first: exit 2, and no run directory is made."""
    proc = run(
        "lab", "up", "cats4", "--embedded", "--no-feed", "--root", str(tmp_path), "--tag", tag
    )
    assert proc.returncode == 2, proc.stderr.decode()
    assert "--tag" in proc.stderr.decode()
    assert list(tmp_path.iterdir()) == []


def test_lab_up_tag_names_the_lab_and_status_and_down_find_it(tmp_path):
    """`lab up --tag` names the run directory; status and down find the lab by it, a
    second `up` with the same tag is refused while the first runs, and down removes it."""
    root = str(tmp_path)
    up = run("lab", "up", "cats4", "--embedded", "--no-feed", "--root", root, "--tag", "demo1")
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.decode().startswith("lab demo1 (")
        assert (tmp_path / "demo1").is_dir()
        again = run(
            "lab", "up", "cats4", "--embedded", "--no-feed", "--root", root, "--tag", "demo1"
        )
        assert again.returncode == 2 and "exists" in again.stderr.decode()
        status = run("lab", "status", "--root", root, "--tag", "demo1")
        assert status.returncode == 0, status.stderr
        assert f"lab demo1 (cats4) in {tmp_path / 'demo1'}" in status.stdout.decode()
    finally:
        down = run("lab", "down", "--root", root, "--tag", "demo1")
    assert down.returncode == 0, down.stderr
    assert not (tmp_path / "demo1").exists()


def test_version_prints_the_packages_version():
    from importlib.metadata import version

    out = run("--version")
    assert out.returncode == 0 and out.stdout.decode() == f"catsproto {version('catsproto')}\n"


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["lab", "capture", "e1-c1", "--bogus"], "catsproto lab capture"),
        (["decode", "--bogus"], "catsproto decode"),
        (["--bogus", "decode"], "catsproto"),
    ],
)
def test_an_unknown_option_is_reported_by_the_parser_it_was_given_to(argv, prog):
    """argparse reports words a subcommand does not know from the top-level parser
    (`catsproto: unrecognized arguments`); ours names the subcommand and its --help."""
    out = run(*argv)
    assert out.returncode == 2
    assert out.stderr.decode() == (
        f"{prog}: unrecognized arguments: --bogus; see `{prog} --help`\n"
    )


@pytest.mark.parametrize(
    "argv",
    [["lab", "capture", "e1-c1", "--seconds", value] for value in ("-1", "0", "nan", "inf", "ten")]
    + [["lab", "up", "cats4", "--interval", "-1"], ["lab", "up", "cats4", "--interval", "0"]]
    + [["lab", "demo", "--seconds", "-5"], ["lab", "demo", "--interval", "nan"]],
)
def test_lab_seconds_and_intervals_are_checked_before_anything_starts(argv, capsys):
    """--seconds and --interval: finite and > 0, refused while parsing (`lab up
    --interval -1` said up while every instance process died; `--seconds nan` hung)."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "must be finite and > 0 seconds" in err or "'ten' is not a number of seconds" in err


def test_lab_down_with_nothing_running_says_so_and_exits_0(tmp_path):
    """Teardown is idempotent: nothing running (or no lab of --tag) is what was asked."""
    for extra in ([], ["--tag", "nolab"], ["--all"]):
        out = run("lab", "down", "--root", str(tmp_path), *extra)
        assert out.returncode == 0, out.stderr
        assert "nothing to stop" in out.stdout.decode() and out.stderr == b""


def test_a_loopback_lab_up_lists_only_the_daemons_it_runs(tmp_path):
    """On loopback only the ExaBGP speakers and the receiver run; the transit routers of
    the topology are named as not run, not listed beside them as if they were."""
    root = str(tmp_path)
    up = run("lab", "up", "cats4", "--embedded", "--no-feed", "--root", root, "--tag", "lst1")
    try:
        assert up.returncode == 0, up.stderr
        text = up.stdout.decode()
        listed = re.findall(r"^  (\S+)\s+(exabgp|frr|bird)\s", text, re.MULTILINE)
        assert listed == [("e1", "exabgp"), ("e2", "exabgp"), ("e3", "exabgp"), ("e4", "exabgp")]
        assert "not run on loopback (no transit): c1 (frr), c2 (frr), c3 (frr), b4 (bird)" in text
    finally:
        assert run("lab", "down", "--root", root, "--tag", "lst1").returncode == 0
