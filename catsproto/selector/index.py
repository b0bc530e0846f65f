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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from catsproto.selector.fleet import FleetProbe
from catsproto.selector.rib import ServiceTable

CHUNK = 16  # keys of the second chunk; a prefix usually ends or is confirmed by then
# A new prompt's last chunk is galloped when at least this many slots enter it, it has
# at least this many keys, and asking all of them every key would take this many
# lookups (below, one pass over every key is quicker than the gallop's ~7 passes).
GALLOP_MIN_SLOTS = 8
GALLOP_MIN_KEYS = 32
GALLOP_MIN_LOOKUPS = 8192
GALLOP_STRIDE = 16  # keys between the positions a gallop asks first


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
        # per (prompt, candidates): a gallop's groups, and exact runs, at a generation
        self._gallops: dict[tuple[bytes, int], tuple[int, tuple[list, list]]] = {}
        self._runs: dict[tuple[bytes, int], tuple[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._answers: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def prefix_lengths(self, keys: np.ndarray, candidates: int) -> tuple[np.ndarray, np.ndarray]:
        """The slots (among the bitmask `candidates`) whose summaries hold one or more
        leading `keys`, and how many leading keys each holds: two int64 arrays."""
        hs, ks, loose = self.prefix_bounds(keys, candidates)
        if not loose.any():
            return hs, ks
        name = (keys.tobytes(), candidates)
        known = self._runs.get(name)
        if known is not None and known[0] == self.table.generation:
            return known[1]
        ks = ks.copy()
        ks[loose] = self.verify(keys, hs[loose], ks[loose])
        ks.flags.writeable = False
        if len(self._runs) >= 4096:
            self._runs.clear()
        self._runs[name] = (self.table.generation, (hs, ks))
        return hs, ks

    def prefix_bounds(
        self, keys: np.ndarray, candidates: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As `prefix_lengths`, but where many slots enter the long last chunk of a new
        prompt, their runs are only bounded from above by a gallop (see `_gallop`):
        the third array marks those (`verify` gives their exact runs)."""
        groups: list[tuple[int, int]] = []  # (bitmask of slots, their prefix length)
        bounded: list[tuple[int, int]] = []  # (bitmask of slots, an upper bound on it)
        running = candidates
        n = len(keys)
        pos = 0
        while pos < n and running:
            # chunks at fixed positions, so a recurring prompt meets the same ones: the
            # first key alone (asked of everyone), then CHUNK keys, then the rest
            end = 1 if pos == 0 else min(n, pos + CHUNK) if pos == 1 else n
            if (
                pos == CHUNK + 1
                and end - pos >= GALLOP_MIN_KEYS
                and running.bit_count() >= GALLOP_MIN_SLOTS
                and running.bit_count() * (end - pos) >= GALLOP_MIN_LOOKUPS
                and not self._known(keys, pos, end, running)
            ):
                exact, bounded = self._gallop(keys, pos, running, candidates)
                groups.extend(exact)
                running = 0
                break
            chunk = self._chunk(keys, pos, end, running)
            if running & chunk.all_held == running:
                pos = end
                continue
            if chunk.walked_in == running and chunk.walked_in:
                groups.extend(chunk.walked)
                running = chunk.walked_out
                pos = end
                continue
            entered, dropped = running, []
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
            return _EMPTY, _EMPTY, _NONE
        answer = (tuple(groups), tuple(bounded))
        out = self._answers.get(answer)
        if out is None:  # the same holders recur with the same prompts: remember
            parts = [_slots_array(mask) for mask, _ in groups + bounded]
            sizes = [len(p) for p in parts]
            lengths = np.repeat(np.array([k for _, k in groups + bounded], dtype=np.int64), sizes)
            loose = np.zeros(len(lengths), dtype=bool)
            loose[sum(sizes[: len(groups)]) :] = True
            out = (np.concatenate(parts), lengths, loose)
            for a in out:
                a.flags.writeable = False
            if len(self._answers) >= 4096:
                self._answers.clear()
            self._answers[answer] = out
        return out

    def _known(self, keys: np.ndarray, start: int, end: int, running: int) -> bool:
        """Whether the chunk's masks are remembered, current, for all of `running`."""
        entry = self._chunks.get((int(keys[end - 1]), end - start))
        return (
            entry is not None
            and entry.generation == self.table.generation
            and running & ~entry.scope == 0
        )

    def _gallop(
        self, keys: np.ndarray, start: int, running: int, candidates: int
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Ask every running slot (all hold keys[:start]) for the keys at start, start +
        1, + 3, + 7, ... and the last, in one pass, instead of every key of the rest.
        A slot that misses the first of them holds exactly `start` keys; one that first
        misses at position p holds at most p (a filter has no false negatives); one that
        misses none, at most all. Under the prefix property those bounds are the runs,
        up to a false positive at a probed position; `verify` makes them exact where it
        matters. Returns (exact groups, bounded groups) as (bitmask, length)."""
        name = (keys.tobytes(), candidates)
        known = self._gallops.get(name)
        if known is not None and known[0] == self.table.generation:
            return known[1]
        n = len(keys)
        at = list(range(start, n, GALLOP_STRIDE))
        if at[-1] != n - 1:
            at.append(n - 1)
        masks = self.fleet.held(keys[at], _slots_array(running))
        self.probes += 1
        exact: list[tuple[int, int]] = []
        bounded: list[tuple[int, int]] = []
        brackets: dict[tuple[int, int], int] = {}  # (held at, missed at) -> slots
        prev = start - 1  # every running slot holds keys[:start]
        for p, mask in zip(at, masks, strict=True):
            out = running & ~mask
            if out:
                if p == start:  # contiguous with what is known held: exact
                    exact.append((out, p))
                else:
                    brackets[(prev, p)] = out
                running &= mask
                if not running:
                    break
            prev = p
        if running:
            bounded.append((running, n))
        # halve each bracket (slots that held `lo` and missed `hi`) down to neighbours
        while brackets:
            mids = sorted({(lo + hi) // 2 for lo, hi in brackets})
            asked = 0
            for mask in brackets.values():
                asked |= mask
            answers = dict(zip(mids, self.fleet.held(keys[mids], _slots_array(asked)), strict=True))
            self.probes += 1
            halves: dict[tuple[int, int], int] = {}
            for (lo, hi), mask in brackets.items():
                mid = (lo + hi) // 2
                for part, (a, b) in (
                    (mask & answers[mid], (mid, hi)),
                    (mask & ~answers[mid], (lo, mid)),
                ):
                    if not part:
                        continue
                    if b - a == 1:
                        bounded.append((part, b))
                    else:
                        halves[(a, b)] = halves.get((a, b), 0) | part
            brackets = halves
        if len(self._gallops) >= 4096:
            self._gallops.clear()
        self._gallops[name] = (self.table.generation, (exact, bounded))
        return exact, bounded

    def verify(self, keys: np.ndarray, slots: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """The exact runs of `slots` (each known to hold keys[:CHUNK + 1]) whose runs
        are at most `bounds`: every key in between is asked of them."""
        start = CHUNK + 1
        top = int(bounds.max())
        runs = np.array(bounds, dtype=np.int64)
        if top <= start:
            return runs
        masks = self.fleet.held(keys[start:top], slots)
        self.probes += 1
        bits = [1 << int(s) for s in slots.tolist()]
        for j, bit in enumerate(bits):
            for offset, mask in enumerate(masks[: int(bounds[j]) - start]):
                if not mask & bit:
                    runs[j] = start + offset
                    break
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
            held = self.fleet.held(keys[start:end], _slots_array(need))
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
