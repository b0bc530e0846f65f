"""Which instances hold a block key: a lazily refreshed key → instance-bitmask index.

Strategy: a decision needs, for every instance, the longest run of the request's block
keys found in that instance's summaries. Probing every instance for every key costs
instances × blocks filter lookups. Instead the index keeps, per key it has seen, a
Python-int bitmask over the service table's slots, stamped with the table generation
it was computed at; a slot whose summaries changed since (its slot generation is newer)
is re-probed for just those keys, in one vectorised call per slot. The walk down the
prompt ANDs the masks and stops as soon as no instance is left: block keys are chained,
so an instance holding block i almost always holds every block before it (the prefix
property), and a run ends where the first key is missing.
"""

from __future__ import annotations

import numpy as np

from catsproto.selector.rib import ServiceTable

CHUNK = 16  # keys refreshed together; a prefix usually ends within a few chunks
SMALL = 8  # keys not yet indexed and this many candidates or fewer: probe them directly


class KeyIndex:
    def __init__(self, table: ServiceTable, max_keys: int = 1 << 20):
        self.table = table
        self.max_keys = max_keys
        self._mask: dict[int, int] = {}
        self._gen: dict[int, int] = {}
        self.probes = 0  # slot-probe calls made, for benchmarks and tests
        self._sighted: set[int] = set()  # first keys of chunks probed directly once

    def _worth_indexing(self, chunk: list[int]) -> bool:
        """Index a chunk of a few holders' keys once it recurs: the first sighting is
        probed directly (a one-off prompt costs few probes), the second is indexed."""
        if chunk[0] in self._gen:
            return True
        if chunk[0] in self._sighted:
            return True
        if len(self._sighted) >= self.max_keys:
            self._sighted.clear()
        self._sighted.add(chunk[0])
        return False

    def _refresh(self, keys: list[int], arr: np.ndarray) -> list[int]:
        """Masks of `keys`, re-probing the slots that changed since each was computed."""
        table = self.table
        gens = [self._gen.get(k, -1) for k in keys]
        oldest = min(gens)
        if oldest < table.generation:
            n = len(table.instances)
            changed = np.nonzero(table.slot_generation[:n] > oldest)[0]
            masks = [self._mask.get(k, 0) for k in keys]
            gen_arr = np.array(gens, dtype=np.int64)
            for slot in changed.tolist():
                need = gen_arr < table.slot_generation[slot]
                inst = table.instances[slot]
                bit = 1 << slot
                if inst is None or not inst.tiers:
                    held = np.zeros(len(keys), dtype=bool)
                else:
                    self.probes += 1
                    held = np.zeros(len(keys), dtype=bool)
                    held[need] = inst.lookup(arr[need]) > 0
                for i in np.nonzero(need)[0].tolist():
                    masks[i] = (masks[i] | bit) if held[i] else (masks[i] & ~bit)
            if len(self._mask) + len(keys) > self.max_keys:
                self._mask.clear()
                self._gen.clear()
            for k, m in zip(keys, masks, strict=True):
                self._mask[k] = m
                self._gen[k] = table.generation
            return masks
        return [self._mask[k] for k in keys]

    def prefix_lengths(self, keys: np.ndarray, candidates: int) -> dict[int, int]:
        """Slot → number of leading `keys` its summaries hold (only slots with ≥ 1),
        among the slots set in the bitmask `candidates`."""
        out: dict[int, int] = {}
        running = candidates
        key_list = keys.tolist()
        for start in range(0, len(key_list), CHUNK):
            chunk = key_list[start : start + CHUNK]
            arr = keys[start : start + CHUNK]
            if start and running.bit_count() <= SMALL and not self._worth_indexing(chunk):
                masks = self._direct(running, arr)
            else:
                masks = self._refresh(chunk, arr)
            for offset, mask in enumerate(masks):
                kept = running & mask
                dropped = running & ~kept
                if dropped and start + offset:
                    for slot in _bits(dropped):
                        out[slot] = start + offset
                running = kept
                if not running:
                    return out
        for slot in _bits(running):
            out[slot] = len(key_list)
        return out

    def _direct(self, slots: int, arr: np.ndarray) -> list[int]:
        masks = [0] * len(arr)
        for slot in _bits(slots):
            inst = self.table.instances[slot]
            if inst is None:
                continue
            self.probes += 1
            held = inst.lookup(arr) > 0
            for i in np.nonzero(held)[0].tolist():
                masks[i] |= 1 << slot
        return masks


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
