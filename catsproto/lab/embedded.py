"""The no-root lab: the same ExaBGP adapters on loopback, without namespaces or transits.

Every ExaBGP node of a topology that announces becomes a speaker on its own loopback
address (127.0.0.11, .12, ...); the receiving node listens on 127.0.0.2 at an
unprivileged port, and each speaker peers with it directly (eBGP, the topology's ASNs).
No FRR or BIRD (they need root), so there is one BGP hop; everything else — spool,
announce process, size checks, JSON receiver, RIB — is what the full lab runs.
Linux routes all of 127.0.0.0/8 to `lo`, so no address needs configuring.
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
from pathlib import Path
from typing import Any

from catsproto.adapters import netns
from catsproto.lab import configs, runner
from catsproto.lab.runner import Lab, LabError, discard, exabgp_binary
from catsproto.lab.topology import load

RECEIVER_ADDRESS = "127.0.0.2"


def free_port(address: str = RECEIVER_ADDRESS) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def up(topology_path: str | Path, root: str | Path, *, tag: str | None = None) -> Lab:
    """Start the speakers and the receiver of `topology_path` on loopback."""
    topology = load(topology_path)
    receivers = [n for n in topology.nodes.values() if n.role == "exabgp" and n.receive]
    speakers = [
        n for n in topology.nodes.values() if n.role == "exabgp" and n.announce and not n.receive
    ]
    if len(receivers) != 1 or not speakers:
        raise LabError("embedded mode needs one receiving ExaBGP node and at least one speaker")
    receiver = receivers[0]
    tag = tag or f"e{os.getpid()}"
    handle = netns.NetnsLab(
        Path(root) / tag, tag, str(Path(topology_path).resolve()), namespaced=False
    )
    handle.state.info.update(name=topology.name, mode="embedded")
    lab = Lab(topology, handle, str(topology_path))
    port = free_port()
    env = dict(configs.EXABGP_ENV, exabgp_daemon_user=getpass.getuser())
    addresses = {n.name: f"127.0.0.{11 + i}" for i, n in enumerate(speakers)}
    handle.state.info["addresses"] = {receiver.name: RECEIVER_ADDRESS, **addresses}
    handle.state.info["port"] = port  # the receiver's BGP port (what a capture filters on)
    with runner.noting_interrupts() as interrupted:
        try:
            _start(lab, receiver, speakers, addresses, port, env)
            interrupted.check()
        except BaseException:  # an error or Ctrl-C: processes and run directory go
            discard(handle)
            raise
    return lab


def _start(
    lab: Lab,
    receiver: Any,
    speakers: list[Any],
    addresses: dict[str, str],
    port: int,
    env: dict[str, str],
) -> None:
    """The receiver's ExaBGP, then each speaker's, peering on loopback."""
    topology, handle = lab.topology, lab.handle
    for node in [receiver, *speakers]:
        d = lab.node_dir(node.name)
        for sub in ("spool", "rib"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        if node is receiver:
            neighbors = [(RECEIVER_ADDRESS, addresses[s.name], node.asn, s.asn) for s in speakers]
            ports: tuple[int | None, int | None] = (port, None)
            node_env = dict(env, exabgp_tcp_bind=RECEIVER_ADDRESS, exabgp_tcp_port=str(port))
        else:
            neighbors = [(addresses[node.name], RECEIVER_ADDRESS, node.asn, receiver.asn)]
            ports = (None, port)
            node_env = dict(env, exabgp_tcp_bind="")
        conf = configs.exabgp_conf(
            topology,
            node.name,
            python=sys.executable,
            spool=str(d / "spool"),
            out=str(d / "rib"),
            neighbors=neighbors,
            ports=ports,
        )
        (d / "exabgp.conf").write_text(conf)
        handle.start(node.name, "exabgp", [exabgp_binary(), str(d / "exabgp.conf")], env=node_env)
