"""Where numba cannot be loaded, the selector and the summaries fall back to numpy and
decide the same.

The compiled parts (`selector/probe_pass.py`, `summary/fuse_peel.py`) load with their
first use. If that fails (numba missing for the platform, or its compiler refusing the
machine), `fleet.PASS.get()` and `fuse.PEEL.get()` say None (`.why` says why), the
fleet probe asks every filter through its own summary and fuse construction runs the
numpy definition. Checked in process (the loaders' answers replaced, both paths in
one run), in a process where numba cannot even be imported and in one running numba's
debugging mode (`NUMBA_DISABLE_JIT`, the kernels as Python): the same filters, the
same probe answers, the same decisions to the last digit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from catsproto.selector import Link, Network, PathSelector, Request, fleet
from catsproto.summary import fuse
from tests.test_selector_fleet import make_fleet, probe_keys, reference

REPO = Path(__file__).resolve().parent.parent

# A small fleet, its summaries built here (fuse, Bloom and exact, one or two shards),
# prompts whose prefixes some instances hold, and the decisions as JSON: what a process
# with numba and one without must both print.
SCRIPT = """
import json, sys
import numpy as np
from catsproto import wire
from catsproto.selector import RIB, Link, Network, PathSelector, Request, fleet
from catsproto.summary import fuse
from tests.test_selector_fleet import KINDS, announce, entries_for

rng = np.random.default_rng(5)
rib = RIB(hold_time_ms=10**9)
prompts = rng.integers(0, 2**63, size=(12, 24), dtype=np.uint64)
filters = []
for i in range(16):
    keys = rng.integers(0, 2**63, size=400 + 50 * i, dtype=np.uint64)
    keys[: 24 - i % 24] = prompts[i % 12][: 24 - i % 24]  # a prefix of a prompt
    entries = entries_for(keys, KINDS[i % 3] if i % 4 else wire.SummaryKind.FUSE, 1 + i % 2)
    filters += [e.body.hex() for e in entries]
    announce(rib, i, entries)
links = [Link("in", f"site{s}", 1 + 2 * s, 10_000) for s in range(1, 5)]
selector = PathSelector(rib, Network(links))
decisions = []
for n, keys in enumerate([*prompts, *prompts[:4]]):
    d = selector.decide(Request(7, keys, 24 * 512, "in"), now_ms=2 + n)
    decisions.append(repr(d))
print(json.dumps({
    "filters": filters,
    "decisions": decisions,
    "pass": fleet.PASS.get() is not None,
    "peel": fuse.PEEL.get() is not None,
    "why": [fleet.PASS.why, fuse.PEEL.why],
}))
"""

# numba refused at import, as on a platform it does not support
BLOCK_NUMBA = "import sys; sys.modules['numba'] = None\n"


def run(script: str, **env_vars: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_vars}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env,
        timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_without_numba_builds_and_decides_the_same() -> None:
    with_numba = run(SCRIPT)
    without = run(BLOCK_NUMBA + SCRIPT)
    assert (with_numba["pass"], with_numba["peel"]) == (True, True)
    assert with_numba["why"] == ["", ""]
    assert (without["pass"], without["peel"]) == (False, False)
    assert all("import of numba" in why for why in without["why"]), without["why"]
    assert without["filters"] == with_numba["filters"]
    assert without["decisions"] == with_numba["decisions"]
    assert len(set(with_numba["decisions"])) > 3  # not one answer for everything
    # numba's debugging mode runs the compiled parts as Python (the prefetch a no-op)
    debugging = run(SCRIPT, NUMBA_DISABLE_JIT="1")
    assert (debugging["filters"], debugging["decisions"]) == (
        with_numba["filters"],
        with_numba["decisions"],
    )


def test_the_probe_without_the_compiled_pass_answers_alike(fleet_rib) -> None:
    rib, held, rng = fleet_rib
    keys = probe_keys(held, rng)
    expect = reference(rib, keys)
    compiled = fleet.FleetProbe(rib.services[7])
    plain = fleet.FleetProbe(rib.services[7], compiled=False)
    assert compiled.held(keys) == plain.held(keys) == expect
    slots = np.array([29, 3, 0, 17, 44])
    assert (compiled.hits(keys, slots) == plain.hits(keys, slots)).all()
    assert plain.pairs > compiled.pairs // 2  # the plain probe asked the filters itself


def test_decisions_are_the_same_when_the_pass_cannot_load(fleet_rib, monkeypatch) -> None:
    rib, held, rng = fleet_rib
    links = [Link("in", f"site{s}", 2 * s, 10_000) for s in range(1, 5)]
    prompts = [k[:20] for k in held.values()] + [
        rng.integers(0, 2**63, size=20, dtype=np.uint64) for _ in range(5)
    ]

    def decide_all() -> list[str]:
        selector = PathSelector(rib, Network(links))
        return [
            repr(selector.decide(Request(7, keys, 20 * 512, "in"), now_ms=2 + n))
            for n, keys in enumerate(prompts + prompts[:6])
        ]

    compiled = decide_all()
    monkeypatch.setattr(fleet.PASS, "_module", None)
    assert fleet.PASS.get() is None
    assert decide_all() == compiled


def test_construction_without_the_peeling_kernel_gives_the_same_filter(monkeypatch) -> None:
    keys = np.random.default_rng(2).integers(0, 2**63, size=5_000, dtype=np.uint64)
    built = fuse.FuseSummary.from_keys(keys, 0.01, seed=3)
    monkeypatch.setattr(fuse.PEEL, "_module", None)
    again = fuse.FuseSummary.from_keys(keys, 0.01, seed=3)
    assert (again.params(), again.encode()) == (built.params(), built.encode())


@pytest.fixture
def fleet_rib():
    """The fleet of tests/test_selector_fleet.py: every kind, one or two shards."""
    return make_fleet()
