"""The container lab's times and sizes: image build, deploy, sessions, first routes (JSON).

Run (root): .venv/bin/python benchmarks/container_lab.py [--cold] [--topology cats4]

--cold removes the node image, its base (debian:12-slim) and Docker's build cache first,
so the run starts as on a fresh machine with Docker installed (installing Docker itself,
`apt-get install docker.io`, is not counted). Then, each timed from the one before:

* image: `scripts/lab-image` (with --cold: debootstrap base + full build; else the
  cached check or a code-only rebuild), and the image's and the base's sizes;
* deploy: containers created, started and wired (`catsproto.lab.deploy`);
* sessions: until every BGP session of the topology is up (FRR, BIRD, the receivers);
* routes: until a signed advertisement of every instance is verified at every receiver;
* destroy: SIGTERM to every container, removed;
* total: image + deploy + sessions + routes, the "lab up in containers" time.

A Docker daemon is started when none answers, and ended at the end. Wall-clock seconds on
a shared machine: they move with its load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))

from catsproto.lab import deploy  # noqa: E402
from catsproto.lab.deploy import wait_for  # noqa: E402
from catsproto.lab.instances import instance_routes, lab_key, write_lab_trust  # noqa: E402


def _mb(image: str) -> float:
    out = deploy.docker("image", "inspect", "-f", "{{.Size}}", image)
    return round(int(out.stdout) / 1e6, 1)


def _established(lab: deploy.ContainerLab) -> bool:
    sessions = lab.sessions()
    expected = {
        n for n, node in lab.topology.nodes.items() if node.role != "exabgp" or node.receive
    }
    return set(sessions) == expected and all(
        s and set(s.values()) <= {"Established", "up"} for s in sessions.values()
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cold", action="store_true", help="remove the image, base and build cache first"
    )
    p.add_argument("--topology", default="cats4", help="cats3, cats4 or catsrr (default cats4)")
    args = p.parse_args()
    path = CHECKOUT / "lab" / f"{args.topology}.clab.yml"
    daemon = deploy.DockerDaemon().ensure()
    out: dict = {"topology": args.topology, "cold": args.cold}
    try:
        if args.cold:
            for image in ("catsproto-node:latest", "debian:12-slim"):
                deploy.docker("image", "rm", "-f", image, check=False)
            deploy.docker("builder", "prune", "-a", "-f", check=False)
            deploy.docker("image", "prune", "-a", "-f", check=False)
        t0 = time.monotonic()
        subprocess.run([str(CHECKOUT / "scripts" / "lab-image")], check=True)
        t1 = time.monotonic()
        out["image_s"] = round(t1 - t0, 1)
        out["image_mb"] = _mb("catsproto-node:latest")
        out["base_mb"] = _mb("debian:12-slim")
        lab = deploy.ContainerLab(deploy.load_plan(path))
        lab.destroy()
        t1 = time.monotonic()
        lab.deploy()
        t2 = time.monotonic()
        out["deploy_s"] = round(t2 - t1, 1)
        try:
            wait_for(lambda: _established(lab), 120, "every session up")
            t3 = time.monotonic()
            out["sessions_s"] = round(t3 - t2, 1)
            topo = lab.topology
            now = int(time.time() * 1000)
            receivers = [n for n, node in topo.nodes.items() if node.receive]
            for r in receivers:
                write_lab_trust(topo, str(lab.node_dir(r) / "trust.json"), now)
            origins = set()
            for name, node in topo.nodes.items():
                routes = {}
                for spec in node.instances:
                    keys = np.random.default_rng(spec.site_id).integers(
                        0, 2**63, 200, dtype=np.uint64
                    )
                    routes.update(
                        instance_routes(
                            spec, keys, sequence=1, now_ms=now, signer=lab_key(topo, spec.name)
                        )
                    )
                    origins.add(str(spec.address))
                if routes:
                    lab.publish(name, routes)

            def everywhere() -> bool:
                return all(
                    {r["origin"] for r in lab.routes(n) if r["verified"]}
                    >= origins - {str(s.address) for s in topo.nodes[n].instances}
                    for n in receivers
                )

            wait_for(everywhere, 120, "every origin verified at every receiver")
            t4 = time.monotonic()
            out["routes_s"] = round(t4 - t3, 1)
            out["total_s"] = round(t4 - t0, 1)
            out["containers"] = len(lab.plan.containers)
            out["links"] = len(lab.plan.links)
        finally:
            t5 = time.monotonic()
            lab.destroy()
            out["destroy_s"] = round(time.monotonic() - t5, 1)
    finally:
        daemon.stop()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
