"""Scenario 3, transit restart: FRR (t1) and then BIRD (t2) killed with SIGKILL and restarted.

The instances publish once (static state), so "the RIB ends identical to before" is a
comparison of (peer, prefix, value) sets at the receiver. Each transit is killed, its
sessions drop (the kernel closes them), and it is restarted from the configuration
rendered at `up`; the speakers resend their routes and the receiver must end with the
very same RIB, every re-sent advertisement accepted (the replay window takes the same
bytes as a duplicate, not a replay).

The transits and the receiver negotiate graceful restart (RFC 4724, 10 s restart time,
lab/faults/chaos-gr.clab.yml): when a transit dies, the
receiver keeps the routes it had from it, marked stale, and clears the marks when the
restarted transit has resent them and sent End-of-RIB. So i2, single-homed behind
BIRD, stays known (stale) while BIRD is down instead of being dropped and relearned.
"""

from __future__ import annotations

import time
from pathlib import Path

from catsproto.lab.faults.harness import (
    CHAOS_TOPOLOGY,
    RECEIVER,
    ChaosLab,
    Result,
    Steerer,
    rejected_by_reason,
)
from catsproto.lab.instances import demo_prefix_keys

I1, I2 = "10.101.0.11", "10.102.0.11"


def run(root: Path, *, full: bool = False) -> Result:
    result = Result("transit", "transit restart (FRR, then BIRD; kill -9, restart)")
    figures: dict = {}
    with ChaosLab(root, CHAOS_TOPOLOGY.with_name("chaos-gr.clab.yml")) as lab:
        t1_peer, t2_peer = lab.address_of("t1", RECEIVER), lab.address_of("t2", RECEIVER)
        lab.publish("i1", 1)
        lab.publish("i2", 1)
        lab.wait_for(
            lambda: I1 in lab.origins(t1_peer) and {I1, I2} <= lab.origins(t2_peer),
            30,
            "i1 over t1 and t2, i2 over t2",
        )
        before = lab.wait_stable(1.0)
        events_before = len(lab.events())
        steer = Steerer(lab, demo_prefix_keys(1))
        steer.start()
        try:
            for transit, peer, daemons, restart in (
                ("t1", t1_peer, ("bgpd", "zebra"), lab.restart_frr),
                ("t2", t2_peer, ("bird",), lab.restart_bird),
            ):
                killed_at = time.time()
                for daemon in daemons:
                    lab.kill9(transit, daemon)
                lab.wait_for(lambda p=peer: _all_stale(lab, p), 15, f"routes over {transit} stale")
                gone_at = time.time()
                i2_visible_while_down = I2 in lab.origins()
                time.sleep(0.5)
                restarted_at = restart(transit)
                lab.wait_for(
                    lambda: lab.rib_keys() == before and not _any_stale(lab),
                    40,
                    f"RIB as before, nothing stale ({transit})",
                )
                back_at = time.time()
                figures[transit] = {
                    "routes_stale_after_s": round(gone_at - killed_at, 3),
                    "rib_identical_after_restart_s": round(back_at - restarted_at, 3),
                    "i2_state_kept_while_down": i2_visible_while_down,
                }
            time.sleep(0.5)
        finally:
            samples = steer.stop()
        after = lab.wait_stable(1.0)
        new_events = lab.events()[events_before:]
    rejected = rejected_by_reason(new_events)
    wrong = [s for s in samples if s.chosen != I1]
    result.time_label = "convergence"
    result.time_s = max(f["rib_identical_after_restart_s"] for f in figures.values())
    result.misrouted = len(wrong)
    result.rejected = rejected
    result.figures = {
        **figures,
        "decisions": len(samples),
        "site1_decisions_not_to_i1": len(wrong),
        "graceful_restart": "negotiated between transits and receiver (10 s); routes kept "
        "stale until End-of-RIB",
    }
    result.check("RIB identical after the FRR and BIRD restarts", after == before)
    result.check(
        "i2's state kept (stale) while BIRD, its only transit, was down",
        figures["t2"]["i2_state_kept_while_down"],
    )
    result.check("no re-sent advertisement refused", not rejected)
    result.check("site-1 requests kept on i1 throughout (second path)", not wrong)
    result.check("request driver without errors", not steer.errors)
    return result


def _routes_of(lab: ChaosLab, peer: str) -> list[dict]:
    return [r for r in lab.routes() if r["peer"] == peer]


def _all_stale(lab: ChaosLab, peer: str) -> bool:
    routes = _routes_of(lab, peer)
    return bool(routes) and all(r.get("stale") for r in routes)


def _any_stale(lab: ChaosLab) -> bool:
    return any(r.get("stale") for r in lab.routes())
