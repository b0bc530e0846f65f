"""The real-engine benchmark's parts that need no engine: the text workload is exactly the
trace's blocks, the peer routers' commands, readiness and install cache, the second
ingress's topology, the ratios and the docs' table (`benchmarks/engine_e2e.py`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from catsproto.adapters.tokenizer import PromptTokenizer
from catsproto.adapters.trace import find_trace
from catsproto.lab import flows, peers, text_workload
from catsproto.lab.engine import MODEL_DIR, EngineSpec
from catsproto.lab.topology import load

REPO = Path(__file__).resolve().parent.parent
CATS4 = REPO / "lab" / "cats4.clab.yml"


def bench():
    spec = importlib.util.spec_from_file_location(
        "engine_e2e", REPO / "benchmarks" / "engine_e2e.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the text workload ------------------------------------------------------------------


def test_single_token_words_are_what_they_claim():
    words = text_workload.single_token_words()
    tok = PromptTokenizer(MODEL_DIR)
    assert len(words) > 200  # enough for random blocks
    for i, text in words:
        assert text[0] == " " and text[1:].isalpha()
        assert tok.completion_ids(text) == [i]


def test_the_whole_default_workload_retokenizes_exactly():
    """Every prompt of the benchmark's default workload (100 conversations, 64 tokens per
    trace block, 3,500 at most) encodes to exactly its ids, as the ingress encodes it."""
    items = text_workload.workload(find_trace(), 100, 2.0, 64, 3500)
    assert len(items) == 369
    assert text_workload.check_exact(items) == sum(len(it["ids"]) for it in items)
    assert max(len(it["ids"]) for it in items) == 3500
    assert items[1]["t_s"] == 0.5
    # the trace's sharing survives: a ceiling as the token-id workload had
    assert text_workload.reuse_ceiling(items) == pytest.approx(0.566, abs=0.002)


def test_turns_sharing_trace_blocks_share_a_token_prefix():
    items = text_workload.workload(find_trace(), 10, 1.0, 64, 3500)
    by_conv: dict[int, list[dict]] = {}
    for it in items:
        by_conv.setdefault(it["conversation"], []).append(it)
    first, second = next(turns for turns in by_conv.values() if len(turns) >= 2)[:2]
    assert first["ids"][:128] == second["ids"][:128]  # blocks 0 and 1 are shared
    assert second["prompt"].startswith(
        "".join(dict(text_workload.single_token_words())[t] for t in first["ids"][:128])
    )


def test_a_prompt_that_does_not_retokenize_is_refused_by_item():
    items = text_workload.workload(find_trace(), 3, 1.0, 64, 3500)
    items[2] = {**items[2], "prompt": items[2]["prompt"].replace(" ", "", 1)}
    with pytest.raises(text_workload.WorkloadError, match="workload item 2"):
        text_workload.check_exact(items)


def test_block_ids_depend_on_the_hash_id_only():
    words = text_workload.single_token_words()
    assert text_workload.block_ids(7, 64, words) == text_workload.block_ids(7, 64, words)
    assert text_workload.block_ids(7, 64, words) != text_workload.block_ids(8, 64, words)
    ids = np.array(text_workload.block_ids(7, 4096, words))
    assert set(ids.tolist()) <= {i for i, _ in words}


# ---- peers ------------------------------------------------------------------------------


def test_every_peer_is_pinned_and_cache_aware():
    assert set(peers.PEERS) == {"smg", "sglang-router", "vllm-router"}
    for peer in peers.PEERS.values():
        assert peer.requirement.count("==") == 1 and peer.version[0].isdigit()
        argv = peer.argv(Path("/v"), "10.100.1.1", 8100, ["http://a:1", "http://b:2"], 8101)
        assert argv[argv.index("--policy") + 1] == "cache_aware"
        assert argv[argv.index("--host") + 1] == "10.100.1.1"
        assert argv[argv.index("--prometheus-host") + 1] == "10.100.1.1"  # never 0.0.0.0
        w = argv.index("--worker-urls")
        assert argv[w + 1 : w + 3] == ["http://a:1", "http://b:2"]
        assert argv[0].startswith("/v/bin/")
    assert peers.PEERS["vllm-router"].needs_scale_out


def test_a_peer_without_engines_is_refused():
    with pytest.raises(peers.PeerError, match="smg: no engine"):
        peers.PEERS["smg"].argv(Path("/v"), "h", 1, [], 2)


def test_the_engines_serve_what_vllm_router_asks():
    assert "--enable-scale-out" in EngineSpec(host="127.0.0.1").argv(Path("python"))


SMG_WORKERS = {
    "workers": [
        {"url": "http://10.102.0.11:8000", "is_healthy": True, "status": "ready"},
        {"url": "http://10.103.0.11:8000", "is_healthy": False, "status": "ready"},
    ],
    "total": 2,
}
SGLANG_WORKERS = {"workers": [{"url": "http://10.102.0.11:8000/", "is_healthy": True}]}


def test_healthy_workers_of_each_routers_answer():
    assert peers.healthy_workers(SMG_WORKERS) == {"http://10.102.0.11:8000"}
    assert peers.healthy_workers(SGLANG_WORKERS) == {"http://10.102.0.11:8000"}
    assert peers.healthy_workers({"urls": ["http://x:1/"]}) == {"http://x:1"}
    pending = {"workers": [{"url": "http://x:1", "is_healthy": True, "status": "pending"}]}
    for junk in (None, 3, "x", {"workers": 5}, [{"url": 7}], pending):
        assert peers.healthy_workers(junk) == set()


def test_wait_for_workers_until_all_are_healthy():
    answers = iter([OSError("refused"), {"workers": []}, SMG_WORKERS, SMG_WORKERS])

    def fetch(url: str):
        assert url == "http://r:1/workers"
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    took = peers.wait_for_workers(
        "http://r:1", ["http://10.102.0.11:8000"], lambda: True, "x", fetch=fetch
    )
    assert took >= 0


def test_a_router_that_dies_or_never_lists_the_engines_fails_with_its_log(tmp_path):
    log = tmp_path / "peer.log"
    log.write_text("error: bind failed\n")
    with pytest.raises(peers.PeerError, match="exited while starting:\nerror: bind failed"):
        peers.wait_for_workers("http://r:1", ["http://e:1"], lambda: False, log, fetch=lambda u: {})
    with pytest.raises(peers.PeerError, match=r"listed \[\] of \['http://e:1'\]"):
        peers.wait_for_workers(
            "http://r:1", ["http://e:1"], lambda: True, log, fetch=lambda u: {}, timeout=0.0
        )


def test_a_cached_peer_venv_is_reused_without_pip(tmp_path, monkeypatch):
    peer = peers.PEERS["smg"]
    venv = tmp_path / f"smg-{peer.version}"
    venv.mkdir()
    (venv / peers.INSTALLED_MARK).write_text("{}")

    def no_run(*a, **k):
        raise AssertionError("pip ran for a cached venv")

    monkeypatch.setattr(peers.subprocess, "run", no_run)
    assert peers.peer_venv(peer, tmp_path) == venv


def test_a_failed_install_leaves_nothing_that_looks_usable(tmp_path, monkeypatch):
    peer = peers.PEERS["sglang-router"]
    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        if "pip" in argv:
            return subprocess.CompletedProcess(argv, 1, "", "No matching distribution")
        Path(argv[-1]).mkdir(parents=True)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    with pytest.raises(peers.PeerError, match=r"sglang-router: .*No matching distribution"):
        peers.peer_venv(peer, tmp_path)
    assert calls[1][-1] == "sglang-router==0.3.2"
    assert list(tmp_path.iterdir()) == []


def test_the_cache_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peers.cache_root() == tmp_path / "catsproto" / "peers"


def test_a_peer_route_stays_below_the_selectors():
    argv = peers.route_argv("replace", "10.102.0.11", "10.0.11.2", "10.100.1.1")
    assert argv == [
        "ip", "route", "replace", "10.102.0.11/32", "via", "10.0.11.2",
        "src", "10.100.1.1", "metric", str(peers.PEER_ROUTE_METRIC),
    ]  # fmt: skip
    assert peers.PEER_ROUTE_METRIC > 0


# ---- the second ingress -----------------------------------------------------------------


def test_a_second_ingress_receives_and_has_its_own_client(tmp_path):
    doc = flows.with_second_ingress(yaml.safe_load(CATS4.read_text()), "e4", "client4")
    path = tmp_path / "two.clab.yml"
    path.write_text(yaml.safe_dump(doc))
    topology = load(path)
    assert topology.nodes["e4"].receive and topology.nodes["e1"].receive
    assert flows.ingress_node(topology) == "e1"  # the first ingress stays the default
    assert flows.client_link(topology, "e4") == ("client4", "10.100.4.2", "10.100.4.1")
    assert flows.client_link(topology, "e1") == ("client", "10.100.1.2", "10.100.1.1")
    assert "client4" not in yaml.safe_load(CATS4.read_text())["topology"]["nodes"]


def test_a_second_ingress_needs_an_exabgp_node_and_a_new_host():
    doc = yaml.safe_load(CATS4.read_text())
    for node, host, why in (
        ("e9", "h", "no node 'e9'"),
        ("c1", "h", "c1 is not an ExaBGP node"),
        ("e4", "client", "'client' is already a node"),
    ):
        with pytest.raises(Exception, match=why):
            flows.with_second_ingress(doc, node, host)


# ---- ratios and the table ---------------------------------------------------------------


def run(mean: float, p50: float, cached: float, loaded: bool = False) -> dict:
    return {
        "ttft_ms": {"mean": mean, "p50": p50, "p99": 3 * mean},
        "engine_cached_fraction": cached,
        "loaded": loaded,
        "engines": {"i21": {"requests": 2}, "i31": {"requests": 1}},
        "load_1min": {"start": 1.0, "end": 2.5 if not loaded else 4.0},
        "cached_report_agreement": 1.0,
    }


def test_ratios_take_the_best_unloaded_peer_per_figure():
    b = bench()
    runs = {
        "catsproto": run(100, 40, 0.5),
        "smg": run(200, 50, 0.45),
        "sglang-router": run(150, 80, 0.3),
        "vllm-router": run(50, 10, 0.9, loaded=True),  # left out
    }
    r = b.ratios(runs, ["smg", "sglang-router", "vllm-router"])
    assert r["ttft_mean"] == {"best_peer": "sglang-router", "ratio": 0.667}
    assert r["ttft_p50"] == {"best_peer": "smg", "ratio": 0.8}
    assert r["cached_fraction"] == {"best_peer": "smg", "ratio": 1.111}
    assert b.ratios({**runs, "catsproto": run(1, 1, 1, loaded=True)}, ["smg"]) == {}


def test_sites_split_by_conversation_or_by_turn():
    b = bench()
    items = [{"conversation": c} for c in (0, 1, 0, 1, 0)]
    first, second = b.split_sites(items, "conversation")
    assert [i["conversation"] for i in first] == [0, 0, 0] and len(second) == 2
    first, second = b.split_sites(items, "turn")
    assert len(first) == 3 and len(second) == 2  # 0:turn0, 1:turn1, 0:turn2 at the first
    assert [i["conversation"] for i in first] == [0, 1, 0]


def test_the_table_renders_from_the_json():
    b = bench()
    doc = {
        "requests": 3,
        "conversations": 1,
        "prompt_tokens_mean": 1700.0,
        "reuse_ceiling": 0.5,
        "cores": 2,
        "sweep": [
            {
                "rate_per_s": 2.0,
                "runs": {"catsproto": run(100, 40, 0.5), "smg": run(200, 50, 0.4, loaded=True)},
                "ratios": {},
            }
        ],
        "multi_site": [],
    }
    text = b.render(json.loads(json.dumps(doc)))
    assert "| 2 | catsproto | 100.0 | 40.0 | 300.0 | 50.0 % | 2 / 1 |" in text
    assert "4.0 **loaded**" in text
    assert "no ratio" in text


def test_the_benchmark_refuses_to_run_without_root_and_renders_without():
    import os

    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_e2e.py"), "--peers", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr
    if os.geteuid() != 0:
        out = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "engine_e2e.py")],
            capture_output=True,
            text=True,
            check=False,
        )
        assert "needs root" in out.stderr


def test_an_older_result_file_is_refused_by_name():
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "engine_e2e.py"),
            "--render",
            str(REPO / "docs" / "eval" / "engine" / "e2e.json"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1
    assert "e2e.json: not a result of this benchmark with peers" in out.stderr


def test_the_published_tables_are_the_rendered_json():
    """Every result file docs/engine.md renders (`--render FILE` beside its tables) is
    what the page shows, line for line."""
    import re

    b = bench()
    page = (REPO / "docs" / "engine.md").read_text()
    files = re.findall(r"engine_e2e\.py --render (\S+\.json)", page)
    assert files, "docs/engine.md shows no rendered result"
    for name in files:
        doc = json.loads((REPO / name).read_text())
        for line in b.render(doc).splitlines():
            assert line in page, f"{name}: {line}"
