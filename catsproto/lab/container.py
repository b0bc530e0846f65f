"""Inside a containerlab node: shape the links, render the config, run the daemon.

The node image's command is `catsproto lab node --topology /catsproto/lab/X.clab.yml`
with `CATSPROTO_NODE` set per node (see the topology files), so containerlab and the
netns runner read the same file. containerlab names the interfaces (eth1, ...) and sets
the endpoint addresses; this adds the netem shaping from the links' `vars` on this
node's side and then runs the daemons in the foreground until the container stops.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pyroute2 import IPRoute

from catsproto.adapters.netns import shape
from catsproto.lab import configs
from catsproto.lab.runner import FRR_BIN, exabgp_binary
from catsproto.lab.topology import Topology, load

STATE = Path("/var/lib/catsproto")


def shape_links(topology: Topology, node: str) -> None:
    with IPRoute() as ip:
        for link in topology.links:
            for end in (link.a, link.b):
                if end.node != node or not (link.delay_ms or link.rate):
                    continue
                for idx in ip.link_lookup(ifname=end.interface):
                    print(f"{end.interface}: {shape(ip, idx, link.delay_ms, link.rate)}")


def commands(topology: Topology, node: str, state: Path) -> list[list[str]]:
    """The daemons of `node`, in start order, with their configs written under `state`."""
    n = topology.nodes[node]
    state.mkdir(parents=True, exist_ok=True)
    if n.role == "frr":
        (state / "zebra.conf").write_text(configs.frr_zebra_conf(node))
        (state / "bgpd.conf").write_text(configs.frr_bgpd_conf(topology, node))
        os.system(f"chown -R frr:frr {state}")
        return [
            [str(FRR_BIN / "zebra"), "-f", str(state / "zebra.conf"), "--log", "stdout"],
            [str(FRR_BIN / "bgpd"), "-f", str(state / "bgpd.conf"), "--log", "stdout"],
        ]
    if n.role == "bird":
        (state / "bird.conf").write_text(configs.bird_conf(topology, node))
        return [["bird", "-f", "-c", str(state / "bird.conf"), "-s", str(state / "bird.ctl")]]
    conf = configs.exabgp_conf(
        topology, node, python=sys.executable, spool=str(state / "spool"), out=str(state / "rib")
    )
    (state / "exabgp.conf").write_text(conf)
    return [[exabgp_binary(), str(state / "exabgp.conf")]]


def run_node(topology_path: Path, node: str) -> int:
    topology = load(topology_path)
    if node not in topology.nodes:
        print(f"node {node} is not in {topology_path}", file=sys.stderr)
        return 2
    shape_links(topology, node)
    env = dict(os.environ, **configs.EXABGP_ENV)
    procs = []
    for argv in commands(topology, node, STATE):
        procs.append(subprocess.Popen(argv, env=env))
        time.sleep(0.5)  # zebra before bgpd
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    finally:
        for p in procs:
            p.terminate()
    return max((p.wait() for p in procs), default=0)
