"""Issue #41 row 15, decided: every delegation binds its sites. The lab's trust file lists
each instance's own site in its delegation, modelled and real-engine instances alike, so
no lab instance can claim another site's id and be priced at that site's distance."""

from __future__ import annotations

from pathlib import Path

import pytest

from catsproto import security
from catsproto.lab import topology as topo
from catsproto.lab.instances import lab_trust
from catsproto.lab.runner import DEFAULT_ENGINE_SITES, engine_topology
from catsproto.wire import ScopeKind

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["cats4", "catsrr"])
@pytest.mark.parametrize("engines", [False, True])
def test_every_lab_delegation_binds_exactly_its_instance_s_site(
    name: str, engines: bool, tmp_path: Path
) -> None:
    path = ROOT / "lab" / f"{name}.clab.yml"
    if engines:
        path = engine_topology(path, tmp_path, "vllm", DEFAULT_ENGINE_SITES)
    t = topo.load(path)
    specs = {
        security.key_id(lab_key_public(t, spec.name)): spec
        for node in t.nodes.values()
        for spec in node.instances
    }
    assert specs and (not engines or any(s.engine for s in specs.values()))
    store = security.TrustStore.from_json(lab_trust(t, 1_800_000_000_000))
    for kid, spec in specs.items():
        delegation = store.lookup(kid)
        assert delegation is not None, spec.name
        assert [e.site_id for e in delegation.delegation.entries(ScopeKind.SITE)] == [
            spec.site_id
        ], spec.name


def lab_key_public(t: topo.Topology, name: str) -> bytes:
    from catsproto.lab.instances import lab_key

    return lab_key(t, name).public.raw
