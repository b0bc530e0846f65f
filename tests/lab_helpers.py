"""Shared pieces of the 4-site lab tests: bringing the lab up and down, and small
programs run inside a namespace (`python -c SCRIPT args`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from catsproto import cli
from catsproto.adapters import netns
from catsproto.lab import flows, runner

CATS4 = Path(__file__).resolve().parent.parent / "lab" / "cats4.clab.yml"

# POST a prompt of random tokens to an instance: argv[1] = instance URL, argv[2] = blocks
# of 512 tokens, argv[3] = the instances' token file. Prints the instance's answer (JSON).
RANDOM_PROMPT = (
    "import random, sys\n"
    "from pathlib import Path\n"
    "from catsproto.adapters.steering import post_json\n"
    "tokens = [random.randrange(128000) for _ in range(int(sys.argv[2]) * 512)]\n"
    "token = Path(sys.argv[3]).read_text().strip()\n"
    "body = {'prompt_token_ids': tokens}\n"
    "print(post_json(sys.argv[1] + '/generate', body, timeout=120, token=token))\n"
)


@contextlib.contextmanager
def cats4_lab(run_dir: Path, tag: str, **options: Any) -> Iterator[runner.Lab]:
    """The 4-site lab with feeders; on exit every namespace and process is gone (asserted)."""
    lab = runner.up(CATS4, run_dir, tag=tag, feed=True, **options)
    try:
        yield lab
    finally:
        pids = [p.pid for p in lab.handle.state.processes]
        lab.down()
        assert netns.leftover_namespaces(lab.tag) == []
        assert not any(netns.pid_alive(pid) for pid in pids)


def client_to_site(lab: runner.Lab, site: int, repeat: int, *extra: str) -> dict:
    """The lab's flows client, as the API token's holder (and the instances' token's, for
    what it asks them directly): ask the steering API for the conversation cached at
    `site`, `repeat` follow-up turns, then `extra` options."""
    argv = ["client", "--api", flows.api_url(lab), "--api-token-file"]
    argv += [str(flows.api_token_file(lab)), "--site", str(site), "--repeat", str(repeat)]
    argv += ["--instance-token-file", str(flows.instances_token_file(lab))]
    return flows.run_client(lab, [*argv, *extra])


def inspect_rows(capsys: Any, *args: str) -> list[dict]:
    """`catsproto inspect ARGS --jsonl`, one dict per line it printed."""
    capsys.readouterr()
    cli.main(["inspect", *args, "--jsonl"])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
