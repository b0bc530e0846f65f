"""Scenario 2, link cut and restore (and a loss burst where the kernel allows one).

The selector steers a request without cached blocks (network cost decides) to i1 over
s1-t1-rcv (2 ms one way; i2 is 3 ms away over t2, i1's other path over t2 22 ms). The
link t1-rcv is set down with pyroute2 on both ends. FRR notices its interface at once;
the receiver's ExaBGP has no interface to watch, so its session to t1 ends with the
hold time (9 s) and with it the routes over t1. Decisions must then follow the new path
costs: i2, never the cut link. The link comes back; sessions re-establish and decisions
return to i1 over t1.

Loss bursts: netem is what the issue names; this kernel has no sch_netem (nor gact
drop actions), so the burst here is the link t2-rcv squeezed by tbf to 16 kbit/s with a
one-packet queue (tail drops) for a few seconds. On a kernel with netem the scenario
says so and still uses tbf, so the figures compare across machines.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from catsproto.lab.faults.harness import (
    HOLD_TIME_S,
    RECEIVER,
    ChaosLab,
    Result,
    Steerer,
    netem_available,
    qdisc_drops,
    uses_link,
)

I1, I2 = "10.101.0.11", "10.102.0.11"


def run(root: Path, *, full: bool = False) -> Result:
    result = Result("link", "link cut and restore; loss burst")
    with ChaosLab(root) as lab:
        t1_peer = lab.address_of("t1", RECEIVER)
        t2_peer = lab.address_of("t2", RECEIVER)
        lab.start_feeder("i1", 0.5)
        lab.start_feeder("i2", 0.5)
        lab.wait_for(lambda: I1 in lab.origins(t1_peer), 30, "i1 over t1 at the receiver")
        lab.wait_for(lambda: I2 in lab.origins(t2_peer), 30, "i2 over t2 at the receiver")
        steer = Steerer(lab, np.zeros(0, dtype=np.uint64))
        steer.start()
        try:
            steer.wait_choice(I1, 10)
            time.sleep(0.5)
            cut_at = lab.set_link("t1", RECEIVER, up=False)
            lab.wait_for(
                lambda: not lab.origins(t1_peer), HOLD_TIME_S + 6, "routes over t1 withdrawn"
            )
            time.sleep(1.0)
            restored_at = lab.set_link("t1", RECEIVER, up=True)
            lab.wait_for(lambda: I1 in lab.origins(t1_peer), 40, "i1 over t1 again")
            steer.wait_choice(I1, 10)
            back_at = time.time()
            time.sleep(0.5)
            # the loss burst on t2-rcv
            burst_s = 5.0 if full else 3.0
            burst_at = time.time()
            squeeze = lab.squeeze("t2", RECEIVER, "16kbit")
            time.sleep(burst_s)
            drops = qdisc_drops(lab, "t2", RECEIVER)
            lab.squeeze("t2", RECEIVER, None)
            healed_at = time.time()
            fresh = lab.wait_for(
                lambda: next(
                    (
                        e["time"]
                        for e in reversed(lab.events())
                        if e["kind"] == "accept"
                        and e["peer"] == t2_peer
                        and e["prefix"] == "10.102.0.11/32"
                        and e["entry"]["timestamp_ms"] >= healed_at * 1000
                    ),
                    None,
                ),
                20,
                "a fresh i2 update after the burst",
            )
        finally:
            samples = steer.stop()
        downs_t2 = lab.session_downs(burst_at, [t2_peer])
        downs_t1 = lab.session_downs(cut_at, [t1_peer])
        netem = netem_available(lab)
    after_cut = [s for s in samples if cut_at <= s.time < restored_at]
    detected = next((s for s in after_cut if not uses_link(s.path, "t1", RECEIVER)), None)
    detect_s = detected.time - cut_at if detected else None
    over_cut = [s for s in after_cut if uses_link(s.path, "t1", RECEIVER)]
    late = [s for s in over_cut if detected and s.time >= detected.time]
    post = [s for s in after_cut if detected and s.time >= detected.time]
    result.time_label, result.time_s, result.misrouted = "convergence", detect_s, len(late)
    result.figures = {
        "cut_convergence_s": detect_s,
        "steered_over_cut_link_before_convergence": len(over_cut) - len(late),
        "steered_over_cut_link_after_convergence": len(late),
        "decisions_after_convergence": {
            "i2": sum(s.chosen == I2 for s in post),
            "i1": sum(s.chosen == I1 for s in post),
            "none": sum(s.chosen is None for s in post),
        },
        "restore_convergence_s": back_at - restored_at,
        "session_down_t1_during_cut": len(downs_t1),
        "loss_burst": {
            "method": "tbf 16kbit, one-packet queue (netem not in this kernel)"
            if not netem
            else "tbf 16kbit, one-packet queue (netem present but not used)",
            "seconds": burst_s,
            "tc": squeeze,
            "packets_dropped": drops,
            "session_downs": len(downs_t2),
            "fresh_update_after_s": round(fresh - healed_at, 3),
        },
        "driver_errors": len(steer.errors),
    }
    if not netem:
        result.notes.append("netem loss bursts: not available here (no sch_netem, no gact)")
    result.check("steered to i1 over t1 before the cut", any(s.chosen == I1 for s in samples))
    result.check("converged within hold time + 2 s", (detect_s or 99) <= HOLD_TIME_S + 2)
    result.check("no decision over the cut link after convergence", not late)
    result.check(
        "decisions follow the new costs (i2)", bool(post) and all(s.chosen == I2 for s in post)
    )
    result.check("back to i1 over t1 after restore", back_at > restored_at)
    result.check("session t2 survives the loss burst", not downs_t2)
    result.check("request driver without errors", not steer.errors)
    return result
