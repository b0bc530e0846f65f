"""The `catsproto` command as a user runs it: a real process, real stdin/stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())


def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "catsproto", *args], input=stdin, capture_output=True, timeout=60
    )


@pytest.mark.parametrize("vector", VECTORS["positive"], ids=lambda v: v["name"])
def test_decode_prints_the_json_and_encode_prints_the_hex(vector):
    out = run("decode", stdin=vector["hex"].encode())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == vector["json"]
    back = run("encode", stdin=out.stdout)
    assert back.returncode == 0, back.stderr
    assert back.stdout.decode().strip() == vector["hex"]
    attr = run("encode", "--attribute", stdin=out.stdout)
    assert attr.stdout.decode().strip() == vector["attribute"]


def test_decode_takes_raw_bytes_and_whole_attributes(tmp_path):
    vector = VECTORS["positive"][2]
    raw = tmp_path / "value.bin"
    raw.write_bytes(bytes.fromhex(vector["hex"]))
    assert json.loads(run("decode", str(raw)).stdout) == vector["json"]
    out = run("decode", "--attribute", stdin=("0x" + vector["attribute"]).encode())
    assert json.loads(out.stdout) == vector["json"]


@pytest.mark.parametrize("vector", VECTORS["negative"], ids=lambda v: v["name"])
def test_bad_bytes_exit_2_with_one_line(vector):
    out = run("decode", stdin=vector["hex"].encode())
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
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, stdin, message):
    out = run(*args, stdin=stdin)
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


def test_vector_file_check():
    assert run("vectors", "--check").returncode == 0


def test_help_names_every_command():
    text = run("--help").stdout.decode()
    for command in ("decode", "encode", "demo", "vectors"):
        assert command in text
