"""Topology files (valid containerlab, our labels), rendered configs, names, CLI wiring."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from catsproto import cli
from catsproto.adapters import netns
from catsproto.lab import configs, topology

LAB = Path(__file__).resolve().parent.parent / "lab"
SCHEMA = Path(__file__).resolve().parents[2] / "shared" / "schemas" / "clab.schema.json"
if not SCHEMA.exists():
    SCHEMA = Path(__file__).resolve().parent.parent.parent / "shared/schemas/clab.schema.json"
TOPOLOGIES = sorted(LAB.glob("*.clab.yml"))


def _schema() -> dict:
    """containerlab's own schema, from ../shared beside the checkout (or /work/shared)."""
    for path in (SCHEMA, Path("/work/shared/schemas/clab.schema.json")):
        if path.exists():
            return json.loads(path.read_text())
    if os.environ.get("CI") == "true":
        pytest.fail(f"containerlab schema not found at {SCHEMA} and CI=true forbids skipping")
    pytest.skip(f"containerlab schema not found at {SCHEMA}")


def test_there_are_topologies():
    assert {p.name for p in TOPOLOGIES} >= {"cats3.clab.yml", "cats4.clab.yml"}


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_topology_is_valid_containerlab(path):
    schema = _schema()
    # the schema's `ports` pattern uses \p{..}, which Python's re cannot compile, so the
    # metaschema check is skipped; validation itself never reaches that pattern here
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


def test_schema_validation_can_fail():
    schema = _schema()
    doc = yaml.safe_load((LAB / "cats3.clab.yml").read_text())
    doc["topology"]["links"][0]["vars"] = "5ms"  # vars must be an object
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert list(validator.iter_errors(doc))


def test_four_site_topology_shape():
    t = topology.load(LAB / "cats4.clab.yml")
    roles = {}
    for n in t.nodes.values():
        roles.setdefault(n.role, []).append(n.name)
    assert sorted(roles["exabgp"]) == ["e1", "e2", "e3", "e4"]
    assert len(roles["frr"]) >= 2 and roles["bird"] == ["b4"]
    for name in roles["exabgp"]:
        node = t.nodes[name]
        assert len(node.instances) >= 2
        for spec in node.instances:  # own prefixes: a /32 and a shard range, never shared
            assert spec.csci.prefixlen == 32 and spec.shards.num_addresses >= 2
    prefixes = [p for n in t.nodes.values() for s in n.instances for p in (s.csci, s.shards)]
    assert all(not a.overlaps(b) for i, a in enumerate(prefixes) for b in prefixes[i + 1 :])
    assert all(link.delay_ms > 0 and link.rate for link in t.links)
    assert [nb.remote.node for nb in t.neighbors("b4")] == ["e4", "c3"]


def test_configs_follow_lab_notes():
    t3 = topology.load(LAB / "cats3.clab.yml")
    spk = configs.exabgp_conf(t3, "spk", python="/py", spool="/s", out="/o")
    assert "capability { extended-message disable; }" in spk
    assert "--max-message 4096" in spk and "encoder text" in spk
    rcv = configs.exabgp_conf(t3, "rcv", python="/py", spool="/s", out="/o")
    assert "receive { parsed; update; }" in rcv and "encoder json" in rcv
    bgpd = configs.frr_bgpd_conf(t3, "t1")
    assert "no bgp ebgp-requires-policy" in bgpd
    assert "neighbor 10.0.12.1 remote-as 65001" in bgpd
    t4 = topology.load(LAB / "cats4.clab.yml")
    bird = configs.bird_conf(t4, "b4")
    assert "enable extended messages on;" in bird and "neighbor 10.0.14.1 as 65004;" in bird


def test_bad_topologies_say_what_is_wrong():
    doc = yaml.safe_load((LAB / "cats3.clab.yml").read_text())
    doc["topology"]["nodes"]["rcv"]["labels"]["catsproto.asn"] = 65100
    with pytest.raises(topology.TopologyError, match="share AS 65100"):
        topology.from_dict(doc)
    doc = yaml.safe_load((LAB / "cats3.clab.yml").read_text())
    doc["topology"]["nodes"]["t1"]["labels"]["catsproto.role"] = "quagga"
    with pytest.raises(topology.TopologyError, match="role 'quagga'"):
        topology.from_dict(doc)


def test_names_fit_linux_limits():
    lab = netns.NetnsLab.__new__(netns.NetnsLab)
    lab.tag = netns.lab_tag(4194304)  # the largest Linux PID
    assert len(lab._ifname(999, "a")) <= netns.IFNAME_MAX


def test_lab_cli_is_registered_and_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        cli.main(["lab", "--help"])
    assert "capture" in capsys.readouterr().out
    assert cli.main(["lab", "up", "no-such-topology.yml"]) == cli.EXIT_BAD_INPUT
    assert "no topology" in capsys.readouterr().err
    assert cli.main(["lab", "status", "--root", "/nonexistent-root"]) == cli.EXIT_BAD_INPUT
