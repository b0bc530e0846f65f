"""Scenario 4, selector restart: the receiver's ExaBGP (and its receive process, the
selector's RIB and replay window) stopped and started again.

The RIB must come back from BGP alone (the transits resend everything on the new
sessions), equal to what it was; the empty replay window must accept the current state
(no refusals while rebuilding); and an older advertisement of a route, sent afterwards by
the hostile peer (a replay of captured state), must still be refused as `replayed`:
the window is rebuilt from what was just accepted.
"""

from __future__ import annotations

import time
from pathlib import Path

from catsproto.lab.faults.feeder import signed_routes
from catsproto.lab.faults.harness import (
    HOSTILE,
    RECEIVER,
    ChaosLab,
    Result,
    rejected_by_reason,
)
from catsproto.lab.faults.hostile import start_speaker, wait_established
from catsproto.lab.faults.speaker import write_plan

I1, I2 = "10.101.0.11", "10.102.0.11"
CURRENT, OLDER = 5, 4


def run(root: Path, *, full: bool = False) -> Result:
    result = Result("selector", "selector restart (receiver ExaBGP and RIB)")
    with ChaosLab(root) as lab:
        lab.publish("i1", CURRENT)
        lab.publish("i2", CURRENT)
        lab.wait_for(lambda: lab.origins() >= {I1, I2}, 30, "both instances")
        before = lab.wait_stable(1.0)
        speaker_dir = start_speaker(lab)
        stopped_at = time.time()
        lab.lab.handle.stop(lab.process(RECEIVER, "exabgp"))
        down_s = time.time() - stopped_at
        events_before = len(lab.events())
        started_at = lab.restart_exabgp(RECEIVER)
        lab.wait_for(lambda: lab.rib_keys() == before, 40, "the RIB rebuilt from BGP")
        rebuilt_s = time.time() - started_at
        rebuild_events = lab.events()[events_before:]
        wait_established(speaker_dir, 30)
        # a replay of captured older state for i1's main route, from the hostile peer
        _, spec = lab.instance("i1")
        older = signed_routes(lab.lab.topology, spec, OLDER, int(time.time() * 1000))
        prefix = str(spec.csci)
        replays = 20
        plan = {
            "rate": 50,
            "messages": [
                {
                    "case": "replayed",
                    "prefix": prefix,
                    "flags": 0xC0,
                    "value": older[spec.csci].hex(),
                }
            ]
            * replays,
        }
        mark = len(lab.events())
        write_plan(speaker_dir, "000.json", plan)
        evil = lab.address_of(HOSTILE, RECEIVER)
        lab.wait_for(
            lambda: sum(rejected_by_reason(lab.events()[mark:], evil).values()) >= replays,
            20,
            "the replays refused",
        )
        time.sleep(0.3)
        replay_refusals = rejected_by_reason(lab.events()[mark:], evil)
        after = lab.rib_keys()
    refused_in_rebuild = rejected_by_reason(rebuild_events)
    result.time_label, result.time_s, result.misrouted = "rebuild", rebuilt_s, 0
    result.rejected = replay_refusals
    result.figures = {
        "receiver_stop_s": round(down_s, 3),
        "rib_rebuilt_from_bgp_s": round(rebuilt_s, 3),
        "routes": len(before),
        "refused_while_rebuilding": refused_in_rebuild,
        "older_state_sent": replays,
        "older_state_refused": replay_refusals,
    }
    result.check("RIB rebuilt from BGP equals the RIB before", True)
    result.check("current state not refused after the restart", not refused_in_rebuild)
    result.check("older state refused as replayed", replay_refusals == {"replayed": replays})
    result.check("honest state untouched by the replays", after == before)
    return result
