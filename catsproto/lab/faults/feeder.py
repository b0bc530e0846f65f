"""A modelled instance for the chaos lab: signed routes into its egress's spool, steadily.

One process per instance (so a crash kills exactly one). Each `--interval` it takes the
next sequence and publishes its CSCI-ID route and summary shards (built by
`catsproto.lab.instances.instance_routes`, signed with the instance's lab key) holding
the site's demo conversation plus `--blocks` random blocks. `--count` stops after that
many rounds (0: run until killed). Nothing is withdrawn on exit: a crash leaves its
routes to the lease, the session or the hold time, as a real crash would.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from catsproto.adapters.exabgp_announce import Spool
from catsproto.lab.instances import demo_prefix_keys, instance_routes, lab_key
from catsproto.lab.topology import InstanceSpec, Topology, load


def find_instance(topology: Topology, name: str) -> tuple[str, InstanceSpec]:
    for node_name, node in topology.nodes.items():
        for spec in node.instances:
            if spec.name == name:
                return node_name, spec
    raise KeyError(f"no instance {name} in {topology.name}")


def instance_keys(spec: InstanceSpec, blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed or spec.site_id)
    extra = rng.integers(0, 2**63, size=blocks, dtype=np.uint64) * np.uint64(2)
    return np.concatenate([demo_prefix_keys(spec.site_id), extra])


def signed_routes(
    topology: Topology, spec: InstanceSpec, sequence: int, now_ms: int, blocks: int = 200
) -> dict:
    """The instance's routes at `sequence`, signed with its lab key."""
    return instance_routes(
        spec,
        instance_keys(spec, blocks),
        sequence=sequence,
        now_ms=now_ms,
        max_message=4096,
        free_blocks=60_000,
        signer=lab_key(topology, spec.name),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="chaos lab: one modelled instance")
    p.add_argument("--topology", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--spool", required=True)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--blocks", type=int, default=200)
    p.add_argument("--first-sequence", type=int, default=1)
    p.add_argument("--count", type=int, default=0)
    args = p.parse_args(argv)
    topology = load(args.topology)
    _, spec = find_instance(topology, args.instance)
    spool = Spool(args.spool)
    sequence = args.first_sequence
    while True:
        for prefix, value in signed_routes(
            topology, spec, sequence, int(time.time() * 1000), args.blocks
        ).items():
            spool.publish(prefix, value)
        if args.count and sequence - args.first_sequence + 1 >= args.count:
            return 0
        sequence += 1
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
