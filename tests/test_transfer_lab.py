"""A real transfer between two network namespaces over a tbf-shaped veth link.

Needs root (namespaces). Under CI=true it always runs (and fails loudly without root);
elsewhere, without root, it is skipped with the reason. Holder and puller are separate
processes (`catsproto transfer serve|pull`), each in its own namespace.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

from catsproto.security import SigningKey
from catsproto.transfer import synthetic_keys, synthetic_payload

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytestmark = pytest.mark.skip(reason="the transfer lab test needs root (network namespaces)")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("transfer_bench", ROOT / "benchmarks/transfer.py")
bench = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
_spec.loader.exec_module(bench)

BLOCKS, SIZE, RATE_MBIT = 12, 1 << 20, 200


def test_pull_across_namespaces_over_a_shaped_link(tmp_path: Path) -> None:
    creds = bench.write_credentials(tmp_path)
    stranger = tmp_path / "stranger.json"
    stranger.write_text(json.dumps(SigningKey.from_seed(b"s" * 32).to_json("stranger")))
    stranger.chmod(0o600)  # a key file others may read is refused before its key is tried
    expected = hashlib.sha256()
    for k in synthetic_keys(7, BLOCKS):
        expected.update(synthetic_payload(k, SIZE))
    with bench.namespace_pair(tmp_path, f"{RATE_MBIT}mbit") as lab:
        assert [n for n in lab.state.namespaces] == [lab.ns("h"), lab.ns("p")]
        runner = bench.Runner(tmp_path, lab)
        holder = runner.start(
            "h", "holder", bench.serve_argv(creds, "10.77.0.1:7480", f"7:{BLOCKS}:{SIZE}", False)
        )
        good = runner.run("p", bench.pull_argv(creds, "10.77.0.1:7480", f"7:{BLOCKS}", False))
        bad_argv = bench.pull_argv(creds, "10.77.0.1:7480", f"7:{BLOCKS}", False)
        bad_argv[bad_argv.index(creds["puller"])] = str(stranger)
        refused = runner.run("p", bad_argv)
        runner.stop(holder)
        tag = lab.tag
    assert good["ok"] and good["blocks"] == BLOCKS and good["tls"]
    assert good["sha256"] == expected.hexdigest()
    assert good["holder_key_id"] == creds["holder_key_id"]
    # the link's rate is a ceiling the transfer must respect; how much of it the transfer
    # fills is a figure of this machine (benchmarks/transfer.py measures it)
    print(f"payload {good['payload_mbit_s']} Mbit/s on a {RATE_MBIT} Mbit/s link")
    assert 0 < good["payload_mbit_s"] <= 1.02 * RATE_MBIT
    assert not refused["ok"] and refused["blocks"] == 0 and "PeerAuthError" in refused["error"]
    from catsproto.adapters.netns import leftover_namespaces

    assert leftover_namespaces(tag) == []
