"""Garbage collection kept out of decisions, for the processes that run a path selector.

Strategy. CPython collects its youngest generation whenever 700 more container objects
have been allocated than freed, wherever that happens to be: at 1,000 aggregated sites
about one decision in 40 carried a young-generation collection (0.06-0.12 ms) and one in
400 a middle-generation one (0.4-0.5 ms), on top of its own work. A process that runs a
selector (the steering daemon, the scale benchmark) instead

* freezes what it has loaded (`gc.freeze`: the RIB and the selector's tables are never
  garbage, and are never scanned again by any collection),
* turns the automatic collector off, and
* collects between decisions (`between`), once the youngest generation is a given
  fraction of the way to its threshold, choosing the generation as CPython would (the
  oldest one whose count passed its threshold).

So the same collections happen, at most a little earlier, and never inside a decision.
A process that stops deciding must call `between` now and then (the daemon does so from
its main loop too) or `stop`, else cyclic garbage is not collected at all. Only the
process's entry point may use this: collection is process-wide state.
"""

from __future__ import annotations

import gc


class DecisionCollector:
    """Collect between decisions rather than inside them (see the module docstring)."""

    def __init__(self, fill: float = 0.5) -> None:
        if not 0.0 < fill <= 1.0:
            raise ValueError(f"fill must be in (0, 1], got {fill}")
        self.fill = fill
        self.collections = [0, 0, 0]  # per generation, made by `between`
        self._was_enabled = False

    def start(self) -> None:
        """Freeze everything alive now and take over from the automatic collector."""
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        gc.freeze()

    def between(self) -> int:
        """Collect if due (call it when no decision is running): the generation
        collected, or -1 if none was due."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        if thresholds[0] == 0 or counts[0] < self.fill * thresholds[0]:
            return -1
        generation = 0
        for g in (1, 2):
            if counts[g] >= thresholds[g]:
                generation = g
        gc.collect(generation)
        self.collections[generation] += 1
        return generation

    def stop(self) -> None:
        """Hand collection back to CPython, frozen objects included."""
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
