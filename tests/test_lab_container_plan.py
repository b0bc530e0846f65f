"""The container deployer's plan (pure: what each container gets, read as containerlab
reads a topology) and the node's wait for its links. No Docker here: the deployed lab is
tests/test_lab_container.py."""

from __future__ import annotations

import copy
import re
import threading
import time
from pathlib import Path

import pytest
import yaml

from catsproto.lab import container, deploy
from catsproto.lab.errors import LabError
from catsproto.lab.topology import load

LAB = Path(__file__).resolve().parent.parent / "lab"
CATS4 = LAB / "cats4.clab.yml"


def _doc() -> dict:
    return yaml.safe_load(CATS4.read_text())


def test_cats4_containers_are_named_labelled_and_bound_as_containerlab_does():
    p = deploy.plan(_doc(), CATS4)
    assert p.lab == "cats4"
    assert sorted(c.container for c in p.containers.values()) == sorted(
        f"clab-cats4-{n}" for n in ("b4", "c1", "c2", "c3", "client", "e1", "e2", "e3", "e4")
    )
    e1 = p.containers["e1"]
    assert e1.image == "catsproto-node:latest"
    assert e1.cmd == ("catsproto", "lab", "node", "--topology", "/catsproto/lab/cats4.clab.yml")
    assert e1.binds == (f"{LAB}:/catsproto/lab:ro",)  # `.` is the topology file's folder
    assert e1.labels["containerlab"] == "cats4" and e1.labels["clab-node-name"] == "e1"
    assert e1.labels["clab-node-kind"] == "linux"
    assert e1.labels["clab-topo-file"] == str(CATS4)
    assert e1.labels["catsproto.asn"] == "65001"  # the topology's own, as text
    assert e1.env["CATSPROTO_NODE"] == "e1"
    assert e1.env["CLAB_LABEL_CATSPROTO_ROUTER_ID"] == "10.255.0.1"
    assert e1.env["CLAB_LABEL_CLAB_NODE_NAME"] == "e1"
    # CLAB_INTFS: the data interfaces the node gets (e1: to c1 and to the client)
    intfs = {n: int(c.env["CLAB_INTFS"]) for n, c in p.containers.items()}
    assert intfs == {
        "b4": 2,
        "c1": 3,
        "c2": 3,
        "c3": 4,
        "client": 1,
        "e1": 2,
        "e2": 1,
        "e3": 1,
        "e4": 1,
    }
    assert sum(intfs.values()) == 2 * len(p.links) == 18
    assert all(link.mtu == deploy.VETH_MTU for link in p.links)
    argv = e1.create_argv()
    assert argv[:6] == ["docker", "create", "--name", "clab-cats4-e1", "--hostname", "e1"]
    assert "--privileged" not in argv and argv[10:12] == ["--cap-drop", "SYS_RESOURCE"]
    assert argv[-6:] == ["catsproto-node:latest", *e1.cmd]


def test_layers_merge_defaults_then_kind_then_node_and_prefix_changes_names():
    doc = _doc()
    doc["prefix"] = ""
    doc["topology"]["defaults"] = {"env": {"A": "defaults", "B": "defaults"}, "labels": {"x": 1}}
    doc["topology"]["kinds"]["linux"]["env"] = {"B": "kind", "C": "kind"}
    doc["topology"]["nodes"]["e2"]["env"]["C"] = "node"
    doc["topology"]["nodes"]["e2"]["cmd"] = "sleep 'a b'"
    p = deploy.plan(doc, CATS4)
    e2 = p.containers["e2"]
    assert (e2.env["A"], e2.env["B"], e2.env["C"]) == ("defaults", "kind", "node")
    assert e2.labels["x"] == "1" and e2.env["CLAB_LABEL_X"] == "1"
    assert e2.container == "e2" and e2.cmd == ("sleep", "a b")
    doc["prefix"] = "__lab-name"
    assert deploy.plan(doc, CATS4).containers["e2"].container == "cats4-e2"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["topology"]["nodes"]["e1"].update(kind="nokia_srlinux"), "linux only"),
        (lambda d: d["topology"]["nodes"]["e1"].update(exec=["ip a"]), "['exec'] not supported"),
        (lambda d: d.update(mgmt={"network": "x"}), "mgmt"),
        (lambda d: d["topology"]["links"][0].update(type="host"), "veth links only"),
        (lambda d: d["topology"]["links"][0]["endpoints"].pop(), "two endpoints, has 1"),
        (lambda d: d["topology"]["links"][0]["endpoints"][0].update(node="zz"), "no node zz"),
        (
            lambda d: d["topology"]["links"][1]["endpoints"][0].update(node="e1"),
            "e1:eth1 is already",
        ),
        (lambda d: d["topology"]["kinds"]["linux"].update(binds=["nowhere:/x"]), "does not exist"),
        (lambda d: d["topology"]["kinds"]["linux"].pop("image"), "node b4: no image"),
        (lambda d: d.pop("name"), "no lab `name`"),
    ],
)
def test_what_cannot_be_deployed_this_way_is_refused_by_name(change, message):
    doc = copy.deepcopy(_doc())
    change(doc)
    with pytest.raises(deploy.DeployError, match=re.escape(message)):
        deploy.plan(doc, CATS4)


def test_brief_endpoints_are_read_too():
    doc = _doc()
    doc["topology"]["links"][0] = {"endpoints": ["e1:eth1", "c1:eth1"]}
    link = deploy.plan(doc, CATS4).links[0]
    assert (link.a, link.b) == (("e1", "eth1"), ("c1", "eth1"))


def test_env_key_is_containerlabs():
    assert deploy.env_key("catsproto.router-id") == "CLAB_LABEL_CATSPROTO_ROUTER_ID"
    assert deploy.env_key("clab-node-name") == "CLAB_LABEL_CLAB_NODE_NAME"


def test_the_node_waits_for_interfaces_that_appear_later(tmp_path):
    (tmp_path / "lo").touch()
    (tmp_path / "eth0").touch()  # containerlab's management interface does not count

    def wire() -> None:
        time.sleep(0.3)
        (tmp_path / "eth1").touch()
        time.sleep(0.3)
        (tmp_path / "eth2").touch()

    t = threading.Thread(target=wire)
    t.start()
    waited = container.wait_for_interfaces(["eth1", "eth2"], 2, timeout=10, sys_net=tmp_path)
    t.join()
    assert waited >= 0.5


def test_the_node_names_the_interfaces_that_never_came(tmp_path):
    (tmp_path / "eth1").touch()
    with pytest.raises(
        LabError, match=r"interfaces eth2 did not appear in 0.3 s \(1 of CLAB_INTFS=2"
    ):
        container.wait_for_interfaces(["eth1", "eth2"], 2, timeout=0.3, sys_net=tmp_path)


def test_a_stop_ends_the_wait(tmp_path):
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(LabError, match="stopped while waiting"):
        container.wait_for_interfaces(["eth1"], 1, timeout=30, sys_net=tmp_path, stop=stop)


def test_interfaces_of_each_node_follow_the_file():
    t = load(CATS4)
    assert container.interfaces_of(t, "c3") == ["eth1", "eth2", "eth3", "eth4"]
    assert container.interfaces_of(t, "client") == ["eth1"]


def test_lab_deploy_refuses_a_topology_it_cannot_wire_before_docker(tmp_path, capsys):
    from catsproto import cli

    bad = tmp_path / "bad.clab.yml"
    bad.write_text("name: bad\ntopology:\n  nodes:\n    a: {kind: nokia_srlinux, image: x}\n")
    assert cli.main(["lab", "deploy", str(bad)]) == 2
    assert "node a: kind 'nokia_srlinux' not supported here (linux only)" in capsys.readouterr().err
    assert cli.main(["lab", "destroy", str(tmp_path / "none.clab.yml")]) == 2
    assert "no topology" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CATSPROTO_NODE": "zz"}, "node zz is not in"),
        ({"CATSPROTO_NODE": "e1", "CLAB_INTFS": "x"}, "CLAB_INTFS='x' is not a number"),
    ],
)
def test_the_node_refuses_a_wrong_name_or_count_before_touching_anything(env, message):
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "catsproto", "lab", "node", "--topology", str(CATS4)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
