"""Scenario 1, instance crash: kill -9 of a modelled instance and of its ExaBGP.

The selector is steering site 1's cached conversation to i1 (it holds the prefix). Then
the feeder of i1 and s1's ExaBGP (with its API processes: one process group) are
killed with SIGKILL. The kernel closes their TCP connections, so FRR and BIRD drop the
sessions at once and withdraw i1's routes; had the host vanished instead, the hold
time (9 s) would bound the detection (scenario 2 shows that case). Measured: the time
from the kill to the first decision made without i1 (detection), the decisions that
still went to i1 in between, and those after (must be none).
"""

from __future__ import annotations

import time
from pathlib import Path

from catsproto.lab.faults.harness import HOLD_TIME_S, ChaosLab, Result, Steerer
from catsproto.lab.instances import demo_prefix_keys

I1, I2 = "10.101.0.11", "10.102.0.11"


def run(root: Path, *, full: bool = False) -> Result:
    result = Result("crash", "instance crash (kill -9 of instance and its ExaBGP)")
    with ChaosLab(root) as lab:
        lab.start_feeder("i1", 0.5)
        lab.start_feeder("i2", 0.5)
        lab.wait_for(lambda: lab.origins() >= {I1, I2}, 30, "both instances at the receiver")
        steer = Steerer(lab, demo_prefix_keys(1))
        steer.start()
        try:
            steer.wait_choice(I1, 10)
            time.sleep(1.0)
            killed_at = lab.kill9("s1", "feeder-i1")
            lab.kill9_exabgp("s1")
            lab.wait_for(lambda: I1 not in lab.origins(), HOLD_TIME_S + 5, "i1 gone")
            time.sleep(3.0 if full else 1.5)
        finally:
            samples = steer.stop()
        sessions = lab.receiver_sessions()
        downs = lab.session_downs(killed_at)
    after = [s for s in samples if s.time >= killed_at]
    detected = next((s for s in after if I1 not in s.origins), None)
    detect_s = detected.time - killed_at if detected else None
    window = [s for s in after if detected and s.time < detected.time and s.chosen == I1]
    late = [s for s in after if detected and s.time >= detected.time and s.chosen == I1]
    post = [s for s in after if detected and s.time >= detected.time]
    result.time_label, result.time_s, result.misrouted = "detection", detect_s, len(late)
    result.figures = {
        "decisions_after_kill": len(after),
        "steered_to_dead_before_detection": len(window),
        "steered_to_dead_after_detection": len(late),
        "decisions_after_detection_to_i2": sum(s.chosen == I2 for s in post),
        "decisions_without_instance": sum(s.chosen is None for s in post),
        "driver_errors": len(steer.errors),
        "receiver_sessions_at_end": sessions,
    }
    result.check("steered to i1 before the crash", any(s.chosen == I1 for s in samples))
    result.check("detected", detect_s is not None)
    result.check(
        f"detected within the hold time ({HOLD_TIME_S:g} s)", (detect_s or 99) <= HOLD_TIME_S
    )
    result.check("no request steered to i1 after detection", not late)
    result.check(
        "every later request steered to i2", bool(post) and all(s.chosen == I2 for s in post)
    )
    result.check("receiver sessions with both transits stay up", not downs)
    result.check("request driver without errors", not steer.errors)
    return result
