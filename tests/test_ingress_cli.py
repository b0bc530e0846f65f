"""`catsproto ingress serve` as the lab starts it: its own process, a steering config, a
token file, a ready file; a completion through it reaches the real engine; SIGTERM ends
it cleanly. Bad command lines are refused before anything listens."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from catsproto import cli
from catsproto.adapters.ingress import ModelSpec
from tests.test_ingress import API_TOKEN, CS_ID, RibWriter, c_sma, fresh_text, steering_config
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "text, spec",
    [
        ("m=7:/models/tiny", ModelSpec("m", 7, Path("/models/tiny"))),
        ("m=7:/models/tiny:8000", ModelSpec("m", 7, Path("/models/tiny"), 8000)),
        ("a/b=0:rel/dir:1", ModelSpec("a/b", 0, Path("rel/dir"), 1)),
    ],
)
def test_model_specs_parse(text, spec):
    assert ModelSpec.parse(text) == spec


@pytest.mark.parametrize(
    "text", ["m", "m=7", "=7:/d", "m=x:/d", "m=7:", "m=7:/d:70000", "m=4294967296:/d"]
)
def test_bad_model_specs_are_refused(text):
    with pytest.raises(ValueError, match="--model"):
        ModelSpec.parse(text)


def test_bad_command_lines_are_refused_with_the_option(tmp_path, capsys, vllm_engine):
    config = tmp_path / "steering.json"
    config.write_text(json.dumps(steering_config(tmp_path / "rib.json", vllm_engine).to_json()))
    model = f"m={CS_ID}:{vllm_engine.model_dir}"
    for argv, words in [
        (["--config", str(config), "--model", "m"], "--model"),
        (["--config", str(config)], "at least one --model"),
        (["--config", str(tmp_path / "none.json"), "--model", model], "cannot read"),
        (["--config", str(config), "--model", f"m={CS_ID}:{tmp_path}"], "tokenizer"),
        (["--config", str(config), "--model", model, "--api-token-file", str(config)], "token"),
        (["--config", str(config), "--model", model, "--model-config", "x=y"], "no --model"),
    ]:
        status = cli.main(["ingress", "serve", *argv])
        err = capsys.readouterr().err
        assert status != 0 and words in err, (argv, err)


def test_the_command_serves_a_completion_and_stops_on_sigterm(tmp_path, vllm_engine):
    rib = RibWriter(tmp_path / "rib.json", vllm_engine.host)
    agent = c_sma(vllm_engine, rib)
    config = tmp_path / "steering.json"
    config.write_text(json.dumps(steering_config(rib.path, vllm_engine).to_json()))
    token = tmp_path / "token"
    token.write_text(API_TOKEN + "\n")
    token.chmod(0o600)  # a token file others may read is refused
    ready = tmp_path / "ready"
    name = vllm_engine.served_model_name
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "catsproto.cli",
            "ingress",
            "serve",
            "--config",
            str(config),
            "--model",
            f"{name}={CS_ID}:{vllm_engine.model_dir}:{vllm_engine.port}",
            "--listen",
            "127.0.0.1:0",
            "--api-token-file",
            str(token),
            "--ready",
            str(ready),
            "--no-install-routes",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            "the ingress's ready file",
            lambda: ready.exists() or proc.poll() is not None,
            60,
            seen=lambda: proc.poll(),
        )
        assert ready.exists(), proc.communicate()  # it ended before it was ready
        (url,) = json.loads(ready.read_text())
        # the C-SMA's first advertisement: the engine is known
        wait_until("the C-SMA's first advertisement", lambda: rib.writes, 30, seen=agent.state)
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_TOKEN, max_retries=0)
        assert [m.id for m in client.models.list().data] == [name]
        raw = client.completions.with_raw_response.create(
            model=name, prompt=fresh_text(20), max_tokens=2
        )
        assert raw.headers["x-catsproto-instance"] == vllm_engine.host
        assert raw.parse().usage.prompt_tokens > 0
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(url + "/metrics", timeout=10)
        assert exc.value.code == 401
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert json.loads(out.splitlines()[0])["models"] == [name]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        agent.close()
