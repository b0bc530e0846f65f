"""Which instances hold a prompt's leading blocks: a walk down the prompt over cached masks.

Strategy: a decision needs, for every instance, the longest run of the request's block
keys found in that instance's summaries. The walk keeps a Python-int bitmask of the
instances still in the running and ANDs in, key by key, the mask of instances holding
that key; it stops as soon as nobody is left. Block keys are chained, so an instance
holding block i almost always holds every block before it (the prefix property): after
the first key only the few holders of the prefix remain, and the rest of the prompt is
asked of them alone.

Masks come from the fleet probe (`fleet.py`), which answers a batch of keys for many
instances in one vector pass, and are remembered per *chunk* of the prompt. The walk cuts
the prompt into chunks at fixed positions — the first key alone (a new prompt's first
key is asked of everyone, and it sorts out all but the holders and a few false
positives), then `CHUNK` keys, then the rest, each asked only of who is still running —
so a prompt that recurs meets the same chunks, and a new one costs three vector passes
however widely its prefix is held. A chunk is named by its last key and length (chained keys:
the last names all before it) and remembered with the set of slots its masks are valid
for (its scope) and the table generation it was computed at. A later walk reuses it when
its running set lies inside the scope, after re-probing only the slots whose summaries
changed since; a chunk that nobody drops out of is crossed with one AND.

Where many slots would walk a long chunk nobody has walked yet (a new prompt behind a
widely held prefix), the walk stops before it: those slots' runs are only bounded from
above, by the prompt's length, and the selector makes exact only the runs its decision
reads (`verify`), lowering the others' bounds with the keys where exact runs ended
(`tighten`; a filter has no false negatives, so a missed key caps a run). After the first
key it first asks the second one (a one-key chunk, remembered like the first): those
missing it hold the first alone, and when few of the others are left, the walk goes on
with them as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from catsproto.selector.fleet import FleetProbe
from catsproto.selector.rib import ServiceTable

CHUNK = 16  # keys of the second chunk; a prefix usually ends or is confirmed by then
# The walk stops before a chunk nobody has walked yet when at least this many slots
# would enter it and asking them the rest of the prompt would take this many lookups:
# their runs are left bounded for the selector's staged search (below, the walk's one
# pass is quicker than the search's two or three small passes and repricings).
STAGE_MIN_SLOTS = 8
STAGE_MIN_LOOKUPS = 2048
# After the first key only: so many times the slots expected to hold it by false
# positives alone (else most are false positives, which the next chunk sorts out)
STAGE_FP_FACTOR = 4.0


@dataclass
class _Chunk:
    masks: list[int]
    all_held: int  # AND of the masks: who holds the whole chunk
    scope: int  # slots the masks are valid for
    generation: int  # table generation they were computed at
    # the last walk through it: who entered, who dropped out where, who came out
    walked_in: int = 0
    walked: tuple[tuple[int, int], ...] = ()
    walked_out: int = 0


class KeyIndex:
    def __init__(self, table: ServiceTable, max_chunks: int = 1 << 16):
        self.table = table
        self.fleet = FleetProbe(table)
        self.max_chunks = max_chunks
        self._chunks: dict[tuple[int, int], _Chunk] = {}
        self.probes = 0  # fleet-probe calls made, for benchmarks and tests
        # per (prompt, candidates): exact runs, at a generation
        self._runs: dict[tuple[bytes, int], tuple[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._answers: dict[tuple, tuple[np.ndarray, ...]] = {}
        self._fp = (-1, 0.0)  # (table generation, false hits expected of a key)

    def prefix_lengths(self, keys: np.ndarray, candidates: int) -> tuple[np.ndarray, np.ndarray]:
        """The slots (among the bitmask `candidates`) whose summaries hold one or more
        leading `keys`, and how many leading keys each holds: two int64 arrays."""
        hs, ks, loose, lo = self.prefix_bounds(keys, candidates)
        if not loose.any():
            return hs, ks
        name = (keys.tobytes(), candidates)
        known = self._runs.get(name)
        if known is not None and known[0] == self.table.generation:
            return known[1]
        ks = ks.copy()
        ks[loose] = self.verify(keys, hs[loose], ks[loose], lo[loose])
        ks.flags.writeable = False
        if len(self._runs) >= 4096:
            self._runs.clear()
        self._runs[name] = (self.table.generation, (hs, ks))
        return hs, ks

    def prefix_bounds(
        self, keys: np.ndarray, candidates: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """As `prefix_lengths`, but where many slots would walk a long chunk nobody has
        walked yet, the walk stops there: those slots' runs are only bounded from above
        (by the prompt's length). The third array marks them, the fourth is how many
        leading keys each slot is known to hold (its run, where exact). `verify` and
        `tighten` narrow the bounds; the selector does so only where its decision reads
        them."""
        groups: list[tuple[int, int]] = []  # (bitmask of slots, their prefix length)
        bounded: list[tuple[int, int]] = []  # (bitmask of slots, known-held length)
        running = candidates
        n = len(keys)
        pos = 0
        while pos < n and running:
            # chunks at fixed positions, so a recurring prompt meets the same ones: the
            # first key alone (asked of everyone), then CHUNK keys, then the rest
            end = 1 if pos == 0 else min(n, pos + CHUNK) if pos == 1 else n
            if (
                pos
                and running.bit_count() >= STAGE_MIN_SLOTS
                and running.bit_count() * (n - pos) >= STAGE_MIN_LOOKUPS
                and (pos > 1 or running.bit_count() >= STAGE_FP_FACTOR * self._false_hits())
                and not self._known(keys, pos, end, running)
            ):
                if pos == 1:
                    # the second key first (one small pass): those who miss it hold the
                    # first alone; leave the rest bounded only if they are still many
                    # (remembered as a one-key chunk, as the first key is: who holds a
                    # key does not depend on where it stands in a prompt)
                    stay = running & self._chunk(keys, 1, 2, running).masks[0]
                    if stay != running:  # they hold the first key alone
                        groups.append((running & ~stay, 1))
                        running = stay
                    if stay.bit_count() >= STAGE_MIN_SLOTS and stay.bit_count() * (n - 1) >= (
                        STAGE_MIN_LOOKUPS
                    ):
                        bounded.append((stay, 2))
                        running = 0
                        break
                    # few hold more: the walk goes on with them (its chunk remembered for
                    # them; a recurring prompt finds both chunks and asks nothing)
                    if not running:
                        break
                else:
                    bounded.append((running, pos))
                    running = 0
                    break
            chunk = self._chunk(keys, pos, end, running)
            entered = running
            if running & chunk.all_held == running:
                pass
            elif chunk.walked_in == running and chunk.walked_in:
                groups.extend(chunk.walked)
                running = chunk.walked_out
            else:
                dropped = []
                for offset, mask in enumerate(chunk.masks):
                    kept = running & mask
                    if kept != running:
                        if pos + offset:
                            dropped.append((running & ~kept, pos + offset))
                        running = kept
                        if not running:
                            break
                chunk.walked_in, chunk.walked, chunk.walked_out = entered, tuple(dropped), running
                groups.extend(dropped)
            pos = end
        if running:
            groups.append((running, n))
        if not groups and not bounded:
            return _EMPTY, _EMPTY, _NONE, _EMPTY
        answer = (n, tuple(groups), tuple(bounded))
        out = self._answers.get(answer)
        if out is None:  # the same holders recur with the same prompts: remember
            parts = [_slots_array(mask) for mask, _ in groups + bounded]
            sizes = [len(p) for p in parts]
            known = np.array([k for _, k in groups + bounded], dtype=np.int64)
            held = np.repeat(known, sizes)
            lengths = held.copy()
            loose = np.zeros(len(lengths), dtype=bool)
            loose[sum(sizes[: len(groups)]) :] = True
            lengths[loose] = n
            out = (np.concatenate(parts), lengths, loose, held)
            for a in out:
                a.flags.writeable = False
            if len(self._answers) >= 4096:
                self._answers.clear()
            self._answers[answer] = out
        return out

    def _false_hits(self) -> float:
        """How many slots a key nobody holds is expected to pass, by false positives."""
        table = self.table
        if self._fp[0] != table.generation:
            self._fp = (table.generation, float(table.fpr[: len(table.instances)].sum()))
        return self._fp[1]

    def _known(self, keys: np.ndarray, start: int, end: int, running: int) -> bool:
        """Whether the chunk's masks are remembered, current, for all of `running`."""
        entry = self._chunks.get((int(keys[end - 1]), end - start))
        return (
            entry is not None
            and entry.generation == self.table.generation
            and running & ~entry.scope == 0
        )

    def verify(
        self, keys: np.ndarray, slots: np.ndarray, bounds: np.ndarray, held: np.ndarray
    ) -> np.ndarray:
        """The exact runs of `slots`, each known to hold its first `held`
        keys and to hold at most `bounds`: every key in between is asked of them (one
        pass)."""
        runs = np.array(bounds, dtype=np.int64)
        if not len(runs):
            return runs
        start, top = int(held.min()), int(bounds.max())
        if top <= start:
            return runs
        return self._cap(keys[start:top], np.arange(start, top), slots, runs, held)

    def tighten(
        self,
        keys: np.ndarray,
        slots: np.ndarray,
        bounds: np.ndarray,
        held: np.ndarray,
        at: list[int],
    ) -> np.ndarray:
        """Lower bounds: ask `slots` the keys at positions `at` (ascending)
        in one pass; a slot that misses the key at p holds at most p leading keys (a
        filter has no false negatives). Only positions between a slot's `held` and its
        bound count."""
        out = np.array(bounds, dtype=np.int64)
        if not len(out) or not at:
            return out
        return self._cap(keys[at], np.array(at, dtype=np.int64), slots, out, held)

    def _cap(
        self,
        asked: np.ndarray,
        pos: np.ndarray,
        slots: np.ndarray,
        runs: np.ndarray,
        held: np.ndarray,
    ) -> np.ndarray:
        """Ask `slots` the keys `asked` (at prompt positions `pos`, ascending) in one
        pass and cut each slot's run (in place) at the first position, between its
        `held` and its run, whose key it misses."""
        hit = self.fleet.hits(asked, slots)
        self.probes += 1
        at = pos[:, None]
        miss = ~hit & (at >= held) & (at < runs)
        first = miss.argmax(axis=0)
        short = miss[first, np.arange(len(runs))]
        runs[short] = pos[first[short]]
        return runs

    def _chunk(self, keys: np.ndarray, start: int, end: int, running: int) -> _Chunk:
        table = self.table
        name = (int(keys[end - 1]), end - start)
        entry = self._chunks.get(name)
        if entry is not None and entry.generation == table.generation:
            if running & ~entry.scope == 0:
                return entry
            valid = entry.scope
        elif entry is not None:
            valid = entry.scope & ~self._changed_since(entry.generation)
        else:
            valid = 0
        need = running & ~valid
        if need:
            fleet = self.fleet
            every = fleet.live_mask()
            if need & every == every:  # all slots with rows (a new first key): no slot list
                held = [m & need for m in fleet.held(keys[start:end])]
            else:
                held = fleet.held(keys[start:end], _slots_array(need))
            self.probes += 1
        else:
            held = [0] * (end - start)
        if entry is None:
            masks = held
        else:
            masks = [(old & valid) | new for old, new in zip(entry.masks, held, strict=True)]
        all_held = -1
        for m in masks:
            all_held &= m
        fresh = _Chunk(masks, all_held, valid | need, table.generation)
        if entry is None and len(self._chunks) >= self.max_chunks:
            self._chunks.clear()
        self._chunks[name] = fresh
        return fresh

    def _changed_since(self, generation: int) -> int:
        n = len(self.table.instances)
        changed = self.table.slot_generation[:n] > generation
        if not changed.any():
            return 0
        return int.from_bytes(np.packbits(changed, bitorder="little").tobytes(), "little")


_EMPTY = np.zeros(0, dtype=np.int64)
_NONE = np.zeros(0, dtype=bool)


def _slots_array(mask: int) -> np.ndarray:
    if not mask:
        return np.zeros(0, dtype=np.int64)
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))
