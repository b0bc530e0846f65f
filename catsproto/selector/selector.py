"""The CATS path selector: one time-to-first-token estimate per instance, the cheapest wins.

Strategy. For a request (CS-ID, the prompt's block keys, its length, the ingress) every
live instance gets an estimate, in milliseconds:

    ttft = path RTT + upload + queue wait + KV fetch + prefill of what is not cached
           + eviction

- path RTT and upload come from the network graph between the ingress and the
  instance's site (delay × 2; prompt bytes ÷ bottleneck bandwidth);
- queue wait is (advertised outstanding prefill tokens, less what the instance has
  prefilled since the advertisement's timestamp at its advertised rate, + tokens this
  selector has sent there since, times the number of peer selectors assumed to steer
  as much onto it) ÷ advertised prefill rate. Counting our own recent
  decisions keeps a hot prefix from herding every request onto its holder before the
  holder's next advertisement says it is busy; draining the advertised backlog keeps a
  once-busy instance from looking busy for a whole update interval;
- the cached prefix is the longest run of the request's keys in the instance's
  summaries; a run of k hits under a filter with false-positive rate p is worth
  k − p/(1−p) blocks in expectation (the tail of a run may be false positives), and a
  stale summary (a delta that could not be applied) counts half;
- KV fetch is the cost of bringing the cached blocks from their tier (latency once per
  tier used, bytes ÷ tier bandwidth); HBM is free;
- alternatively an instance may compute while pulling the longest cached prefix held
  anywhere from its holder: one-way delay between the sites + bytes ÷ bottleneck of path
  and source tier. Whichever is cheaper is that instance's estimate;
- eviction is what storing the prompt's new blocks there costs the fleet: nothing while
  the instance has free KV blocks (its Capacity TLV, less what this selector placed
  there since), else the evicted blocks' prefill times the chance they are wanted again
  (`catsproto.selector.occupancy`). It spreads new prefixes over the caches and keeps a
  conversation on its holder. Not time the request waits: the price of a choice.

Scores are computed for all instances at once on the service table's arrays; only
instances holding part of the prefix get individual work. With `spread_ms` > 0 the
choice among candidates within that margin of the best is the better of two picked by
a seeded hash (power of two choices): several selectors that see the same stale load
then stop sending their requests to the same instance. With `work_weight` > 0 the
candidates are ranked by ttft + weight x prefill (the instance time the choice uses up,
which a holder of the prefix saves) rather than by ttft alone; every estimate keeps its
real terms. The decision carries every term for the chosen instance and the runner-up.

A request may carry a pull planned by another C-PS (`CarriedPull`: a source this
selector's RIB need not hold, with the pull and the prefill priced there): a site's
C-PS, whose RIB holds only its own site, is told this way of the ingress's plan to pull
the prefix from another site. Every candidate is offered it at its own round trip,
upload and queue; the best such offer replaces the selector's own choice only when it
ranks strictly lower, and its work (pull + prefill) is logged like any decision's.
Pure: `now_ms` and the seed come in.
"""

from __future__ import annotations

import math

import numpy as np

from catsproto.selector.decision import (
    CarriedPull,
    Decision,
    Estimate,
    NoInstanceError,
    Request,
    SelectorConfig,
)
from catsproto.selector.holders import _Holders, _new_estimate, _Priced
from catsproto.selector.index import KeyIndex
from catsproto.selector.network import Network, Path
from catsproto.selector.occupancy import CacheLedger
from catsproto.selector.pending import PendingWork
from catsproto.selector.rib import RIB, Instance, IPAddress, ServiceTable
from catsproto.wire import Tier

INF = float("inf")
# Above this many candidates the remote-KV option reads the source site's vectors to all
# sites (built once per site node) rather than one path each.
_FEW_PULLS = 64
# Staged search over bounded runs: after this many rounds, every loose holder still within
# the leaders' bar (or as deep as the KV source) is made exact in one pass.
MAX_STAGES = 3
# Loose holders made exact together, besides those the decision reads: this many of the
# best at their bounds and this many of the deepest (one pass; the likeliest leaders and
# KV sources of the next round)
BATCH = 4


def _leaders(total: np.ndarray) -> list[int]:
    """Indices of the best and the runner-up estimate (lowest index first among equals,
    as a stable sort would give)."""
    first = int(total.argmin())  # the method: np.argmin adds a Python-level call
    if len(total) == 1:
        return [first]
    saved, total[first] = total[first], INF
    second = int(total.argmin())
    total[first] = saved
    if second == first:  # every other estimate is infinite: the lowest other index
        second = 1 if first == 0 else 0
    return [first, second]


def _new_blocks(tokens: int, block_tokens: np.ndarray, plan: _Holders | None) -> np.ndarray:
    """Per candidate, the whole blocks of the prompt it would store: all of them, less
    the run a holder has (its expected cached tokens, as its prefill is priced)."""
    new = np.floor(tokens / block_tokens)
    if plan is not None and plan.src >= 0:
        new[plan.idx] = np.floor(plan.uncached / block_tokens[plan.idx])
    return new


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a well-spread 64-bit hash of an integer."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class PathSelector:
    def __init__(self, rib: RIB, network: Network, config: SelectorConfig | None = None):
        self.rib = rib
        self.network = network
        self.config = config or SelectorConfig()
        self._index: dict[int, KeyIndex] = {}
        self._plans: dict[int, dict[tuple[bytes, int, int], _Holders]] = {}
        self._pending: dict[int, PendingWork] = {}
        self._ledgers: dict[int, CacheLedger] = {}
        self._site_paths: dict[tuple[str, int], Path | None] = {}
        self._draws = 0
        # (node, CS-ID) -> (version, delay, bandwidth, the sites they were worked out for)
        self._site_cache: dict[tuple[str, int], tuple[tuple[int, int], np.ndarray, ...]] = {}
        self._site_max_bw: dict[tuple[str, int], float] = {}
        self._arange = np.arange(0)
        self._site_derived: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._network_version = network.version  # what the four caches above were built on

    # ---- helpers -----------------------------------------------------------------------

    def _network_moved(self) -> None:
        """Forget the paths and per-site vectors when a link changed (`Network.add`: a new
        delay measurement, say); they are worked out again from the network as it is."""
        if self.network.version != self._network_version:
            self._site_paths.clear()
            self._site_cache.clear()
            self._site_max_bw.clear()
            self._site_derived.clear()
            self._network_version = self.network.version

    def _path(self, node: str, site_id: int) -> Path | None:
        self._network_moved()
        key = (node, site_id)
        if key not in self._site_paths:
            self._site_paths[key] = self.network.path(node, self.config.node_of(site_id))
        return self._site_paths[key]

    def _site_vectors(
        self, node: str, table: ServiceTable, slots: slice | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """One-way delay and bottleneck bandwidth from `node` to each slot's site. When
        the table's sites change, only the slots whose site differs get a new path (a
        thousand-site table costs a path per site once, milliseconds). Fresh arrays each
        time: an estimate written out later still reads the values of its decision."""
        self._network_moved()
        key = (node, table.cs_id)
        cached = self._site_cache.get(key)
        version = (table.site_version, len(table.site))
        if cached is None or cached[0] != version:
            sites = table.site
            if cached is None:
                delay, bw = np.empty(len(sites)), np.empty(len(sites))
                changed = np.arange(len(sites))
            else:
                _, old_delay, old_bw, seen = cached
                m = len(seen)
                delay, bw = np.empty(len(sites)), np.empty(len(sites))
                delay[:m], bw[:m] = old_delay[:m], old_bw[:m]
                changed = np.flatnonzero(sites[:m] != seen[:m])
                if len(sites) > m:
                    changed = np.concatenate([changed, np.arange(m, len(sites))])
            for i, site in zip(changed.tolist(), sites[changed].tolist(), strict=True):
                p = self._path(node, site) if site >= 0 else None
                delay[i], bw[i] = (p.delay_ms, p.bandwidth_mbps) if p else (INF, 1.0)
            cached = self._site_cache[key] = (version, delay, bw, sites.copy())
            self._site_max_bw[key] = float(bw.max()) if len(bw) else 1.0
            self._site_derived[key] = (2 * delay, bw * 1000)
        return cached[1][slots], cached[2][slots]

    def prepare(self, cs_id: int) -> int:
        """Work out now the per-site vectors from every site of the service, which the
        remote-KV option reads for a source at that site (else the first decision with
        a source at a new site pays a path per site). They stay valid until the table's
        sites change, and then only changed slots are redone. Returns the sites done."""
        table = self.rib.services.get(cs_id)
        if table is None:
            return 0
        sites = np.unique(table.site[: len(table.instances)])
        done = 0
        for site in sites.tolist():
            if site >= 0:
                self._site_vectors(self.config.node_of(site), table, slice(0, 0))
                done += 1
        return done

    def sync(self, cs_id: int) -> int:
        """Bring the fleet probe's copy of the service's summaries up to the table now
        (the rows of every instance whose summaries changed since). A receive loop calls
        it once it has merged a batch of updates, so that the next decision does not pay
        for the rebuild; without it the first probe after a change does the same work.
        The same decisions either way. Returns the instances whose rows were rebuilt."""
        table = self.rib.services.get(cs_id)
        if table is None:
            return 0
        fleet = self._index_of(table).fleet
        before = fleet.rebuilds
        fleet.sync()
        return fleet.rebuilds - before

    def _index_of(self, table: ServiceTable) -> KeyIndex:
        index = self._index.get(table.cs_id)
        if index is None or index.table is not table:
            index = self._index[table.cs_id] = KeyIndex(table)
            self._plans[table.cs_id] = {}
        return index

    def _site_terms(
        self, node: str, table: ServiceTable, slots: slice | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Round trip (ms) and bottleneck bandwidth in kbit/s (bits ÷ it = ms) from `node`
        to each slot's site."""
        self._site_vectors(node, table, slice(0, 0))
        rtt, bw_kbps = self._site_derived[(node, table.cs_id)]
        return rtt[slots], bw_kbps[slots]

    def _has_vectors(self, node: str, table: ServiceTable) -> bool:
        """Whether the per-site vectors from `node` are built and current."""
        self._network_moved()
        cached = self._site_cache.get((node, table.cs_id))
        return cached is not None and cached[0] == (table.site_version, len(table.site))

    def _max_bandwidth(self, node: str, table: ServiceTable) -> float:
        """An upper bound on the bottleneck from `node` to any site of the table: the
        widest such path if the per-site vectors from `node` are at hand, else infinity
        (working them out costs a path per site: milliseconds at a thousand sites)."""
        if not self._has_vectors(node, table):
            return INF
        return self._site_max_bw[(node, table.cs_id)]

    def _all_slots(self, n: int) -> np.ndarray:
        if len(self._arange) != n:
            self._arange = np.arange(n)
        return self._arange

    def _pending_for(self, table: ServiceTable) -> PendingWork:
        """The per-slot record of work this selector sent, grown with the table."""
        pend = self._pending.get(table.cs_id)
        if pend is None:
            cfg = self.config
            pend = PendingWork(cfg.pending == "drain", cfg.peer_selectors)
            self._pending[table.cs_id] = pend
        return pend

    def _ledger_for(self, table: ServiceTable) -> CacheLedger:
        """The per-slot record of blocks this selector placed, grown with the table."""
        ledger = self._ledgers.get(table.cs_id)
        if ledger is None:
            cfg = self.config
            peers = cfg.peer_selectors if cfg.pending == "count" else 1
            ledger = self._ledgers[table.cs_id] = CacheLedger(peers, cfg.reuse_horizon_ms)
        return ledger

    def _slot_of(self, cs_id: int, address: IPAddress) -> tuple[ServiceTable, int] | None:
        table = self.rib.services.get(cs_id)
        inst = table.by_address.get(address) if table is not None else None
        return None if inst is None else (table, inst.slot)  # type: ignore[return-value]

    # ---- work sent, as the queue term counts it ----------------------------------------

    def note(self, cs_id: int, address: IPAddress, now_ms: int, tokens: float) -> bool:
        """Count `tokens` of work another decision-maker sent to `address` at `now_ms`
        (a site's C-PS telling the ingress selector in the same box, say), as if this
        selector had sent it. False: no such instance in the RIB."""
        found = self._slot_of(cs_id, address)
        if found is None:
            return False
        table, slot = found
        self._pending_for(table).add(table, slot, now_ms, tokens)
        return True

    def forget_last(self, cs_id: int, address: IPAddress) -> bool:
        """Undo the last work counted for `address` (this selector's decision, or a
        `note`): the request went elsewhere. False: nothing was counted there."""
        found = self._slot_of(cs_id, address)
        if found is None:
            return False
        table, slot = found
        self._ledger_for(table).remove(table, slot)
        return self._pending_for(table).pop_last(table, slot) is not None

    def forget(self, cs_id: int, address: IPAddress, sent_ms: int, tokens: float) -> bool:
        """Undo the work counted for `address` at `sent_ms` with exactly `tokens` (the
        request went elsewhere, learnt after later work was counted there). False:
        nothing such is counted, or a newer advertisement already counts it."""
        found = self._slot_of(cs_id, address)
        if found is None:
            return False
        table, slot = found
        self._ledger_for(table).remove(table, slot, sent_ms)
        return self._pending_for(table).remove(table, slot, sent_ms, tokens)

    def queued_ms(self, cs_id: int, address: IPAddress, now_ms: int) -> float:
        """The queue this selector reckons `address` has at `now_ms`: the advertised
        backlog drained at the advertised rate plus the work counted since, in ms of
        that rate. KeyError: no such instance."""
        found = self._slot_of(cs_id, address)
        if found is None:
            raise KeyError(address)
        table, slot = found
        tokens = self._pending_for(table).queued_tokens(table, slot, now_ms)
        return tokens * 1000 / float(table.prefill_tps[slot])

    def least_queued(
        self, cs_id: int, now_ms: int, *, before_last: IPAddress | None = None
    ) -> tuple[IPAddress, float] | None:
        """The live instance with the least `queued_ms`: (address, ms), or None when
        there is none. With `before_last`, the queues as they were before the last work
        counted at that address (the request being placed, say)."""
        table = self.rib.services.get(cs_id)
        if table is None:
            return None
        pend = self._pending_for(table)
        slot = table.by_address[before_last].slot if before_last is not None else None
        log = pend.log[slot] if slot is not None and slot < len(pend.log) else None
        last = log.pop() if log else None
        try:
            best: tuple[IPAddress, float] | None = None
            for address, inst in table.by_address.items():
                if table.alive[inst.slot]:
                    q = pend.queued_tokens(table, inst.slot, now_ms) * 1000
                    q /= float(table.prefill_tps[inst.slot])
                    if best is None or q < best[1]:
                        best = (address, q)
            return best
        finally:
            if last is not None and log is not None:
                log.append(last)

    # ---- the decision ------------------------------------------------------------------

    def decide(self, request: Request, now_ms: int) -> Decision:
        cfg = self.config
        table = self.rib.services.get(request.cs_id)
        if table is None:
            raise NoInstanceError(f"no advertisement for CS-ID {request.cs_id}")
        n = len(table.instances)
        hold = self.rib.hold_time_ms
        pick: slice | np.ndarray
        if n and len(table.by_address) == n and now_ms - table.heard_floor(n) <= hold:
            # every slot live (the usual case): slices are views, no gathers
            slots, pick, candidates = self._all_slots(n), slice(0, n), table.live_mask
        else:
            live = table.alive[:n] & (now_ms - table.heard_ms[:n] <= hold)
            slots = pick = np.flatnonzero(live)
            if len(slots) == 0:
                raise NoInstanceError(f"no live instance for CS-ID {request.cs_id}")
            candidates = int.from_bytes(np.packbits(live, bitorder="little").tobytes(), "little")
        pend = self._pending_for(table)
        pend.refresh(table, now_ms)
        rtt, bw_kbps = self._site_terms(request.ingress, table, pick)
        ms_per_token = table.ms_per_token[pick]
        tokens = request.prompt_tokens
        upload = tokens * cfg.request_bytes_per_token * 8 / bw_kbps
        # the advertised backlog, drained at the advertised rate since its timestamp
        queue = np.subtract(table.drain_end_ms[pick], now_ms)
        np.maximum(queue, 0.0, out=queue)
        np.minimum(queue, table.backlog_ms[pick], out=queue)
        queue += pend.ms[pick]
        prefill_full = tokens * ms_per_token
        base = rtt + upload
        base += queue
        evictions, block_tokens, ledger = None, None, None
        if cfg.price_evictions:
            ledger = self._ledger_for(table)
            ledger.refresh(table)
            block_tokens = table.block_size[pick].astype(np.float64)
            block_tokens[block_tokens <= 0] = cfg.default_block_size
            evictions = ledger.terms(table, pick, now_ms, block_tokens, ms_per_token)
        placed = base  # rtt + upload + queue, with the eviction term once priced
        keys = request.block_keys
        if request.key_space is not None:
            # the others' summaries name keys of another space: they hold none of these
            candidates &= table.key_space_mask(request.key_space)
            if not candidates:
                keys = keys[:0]
        plan = self._holders(table, keys, tokens, candidates, slots, pick) if len(keys) else None
        stages = 0
        while True:
            new_blocks = evicted = None
            if evictions is not None and block_tokens is not None:
                new_blocks = _new_blocks(tokens, block_tokens, plan)
                evicted, evict_ms = evictions.price(new_blocks)
                placed = base + evict_ms
            total = placed + prefill_full
            priced = _Priced(rtt, upload, queue, total, prefill_full)
            if evicted is not None:
                priced.evicted, priced.evict = evicted, evict_ms
            if plan is not None and plan.src >= 0:
                priced.price_holders(plan, table, keys, placed, ms_per_token)
            # what the candidates are ranked by: `total` itself unless work is weighed
            rank = priced.ranking(cfg.work_weight)
            order = _leaders(rank)
            if (
                cfg.allow_remote_kv
                and plan is not None
                and plan.src >= 0
                and plan.src_cached_tokens > 0
                and self._consider_remote(
                    table, pick, plan, placed, ms_per_token, request, priced, order, rank
                )
            ):
                rank = priced.ranking(cfg.work_weight)
                order = _leaders(rank)
            spread = (
                cfg.spread_ms > 0
                and len(order) > 1
                and rank[order[1]] <= rank[order[0]] + cfg.spread_ms
            )
            if plan is None or not plan.loose_left:
                break
            # Runs only bounded from above price a holder at its best: it can only lose
            # by the exact run (a longer prefill raises its estimate and its rank). Make
            # exact every one that the decision reads (the leaders, the near-equal set,
            # the KV source) and decide again; the others cannot come ahead of them.
            watch = set(order)
            if spread:
                watch.update(np.flatnonzero(rank <= rank.min() + cfg.spread_ms).tolist())
            need = [j for j in map(plan.at, watch) if j is not None and plan.loose[j]]
            if plan.loose[plan.src]:
                need.append(plan.src)
            if not need:
                break
            # with them, the likeliest leaders and KV sources of the next round: the best
            # other loose holders at their bounds, and the deepest (ties: lowest slot)
            loose_at = np.flatnonzero(plan.loose)
            if len(loose_at) > BATCH:
                by_total = rank[plan.idx[loose_at]]
                best = np.argpartition(by_total, BATCH)[:BATCH]
                need += loose_at[best].tolist()
                by_depth = np.lexsort((plan.hs[loose_at], -plan.expected[loose_at]))
                need += loose_at[by_depth[:BATCH]].tolist()
            else:
                need += loose_at.tolist()
            if plan.recalled:
                # a prompt seen again (a recurring prefix): make every run exact now, in
                # one pass, rather than a few in each of the decisions to come
                need += loose_at.tolist()
            elif stages >= MAX_STAGES:
                # bounds keep proving loose: make exact at once every holder that, at its
                # bound, is within the leaders' bar or could be the KV source
                bar = float(rank[order[-1]]) + (cfg.spread_ms if spread else 0.0)
                within = rank[plan.idx] <= bar
                deeper = plan.expected >= plan.expected[plan.src]
                need += np.flatnonzero(plan.loose & (within | deeper)).tolist()
            plan, moved = self._verified(table, keys, tokens, candidates, slots, pick, plan, need)
            stages += 1
            if not moved:
                # every run made exact was at its bound: the estimates are those just
                # priced, and every holder the decision reads is now exact
                break
        if spread:
            order = self._spread(rank, cfg.spread_ms).tolist()
        best = self._estimate(table, slots, order[0], request, priced)
        if not math.isfinite(best.total_ms):
            raise NoInstanceError(f"no reachable instance for CS-ID {request.cs_id}")
        runner = None
        if len(order) > 1:
            second = order[1]
            held_then = self._candidate(table, slots, second, priced)

            def runner() -> Estimate:
                return self._estimate(table, slots, second, request, priced, held_then)

        chosen_slot = int(slots[order[0]])
        carried = None
        offer = request.carried_pull
        if offer is not None and offer.source not in table.by_address:
            at, carried = self._carried(table, slots, placed, request, offer, priced)
            own = float(rank[order[0]])
            offer_rank = carried.total_ms
            if cfg.work_weight:
                offer_rank += cfg.work_weight * offer.prefill_ms
            if offer_rank < own:  # strictly: the selector's own best keeps a tie
                runner, best, chosen_slot = best, carried, int(slots[at])
        # the instance is busy for the fetch or pull as well as the prefill
        work = (best.prefill_ms + best.fetch_ms) / 1000 * table.prefill_tps[chosen_slot]
        pend.add(table, chosen_slot, now_ms, work)
        if pend.drain:
            pend.drain_ms(table, chosen_slot, now_ms)
        if ledger is not None and new_blocks is not None:
            at_chosen = int(np.searchsorted(slots, chosen_slot))
            ledger.add(table, chosen_slot, now_ms, float(new_blocks[at_chosen]))
        return Decision(best, runner, len(slots), carried)

    def _carried(
        self,
        table: ServiceTable,
        slots: np.ndarray,
        base: np.ndarray,
        request: Request,
        offer: CarriedPull,
        priced: _Priced,
    ) -> tuple[int, Estimate]:
        """The carried pull at its best candidate: (its index, its estimate). Every
        candidate may take it at its own round trip, upload and queue (`base`, as this
        decision priced them: before its own work is logged) plus the pull and prefill
        as carried; the least wins, lowest slot first among equals. At one site (a site's
        C-PS) the round trip and upload are the same for all, so that is the
        least-queued instance. No summary of the candidate is read: what it computes
        from is the source's prefix, so its cached blocks are 0."""
        total = base + offer.fetch_ms
        total += offer.prefill_ms
        i = int(np.argmin(total))
        evicted, evict_ms = priced.eviction(i)
        inst = table.instances[int(slots[i])]
        assert inst is not None
        path = self._path(request.ingress, inst.site_id)
        return i, _new_estimate(
            address=inst.address,
            site_id=inst.site_id,
            path=path.nodes if path else (),
            rtt_ms=float(priced.rtt[i]),
            upload_ms=float(priced.upload[i]),
            queue_ms=float(priced.queue[i]),
            cached_blocks=0,
            expected_cached_blocks=0.0,
            fpr=inst.fpr,
            stale=inst.stale,
            kv_source=offer.source,
            fetch_ms=float(offer.fetch_ms),
            prefill_ms=float(offer.prefill_ms),
            total_ms=float(total[i]),
            evicted_blocks=evicted,
            evict_ms=evict_ms,
        )

    def _holders(
        self,
        table: ServiceTable,
        keys: np.ndarray,
        tokens: int,
        candidates: int,
        slots: np.ndarray,
        pick: slice | np.ndarray,
    ) -> _Holders:
        """Who among `candidates` holds part of the prompt, and what that prefix is worth
        to each; remembered per (prompt, candidates, prompt length) until any summary of
        the table changes (its generation moves)."""
        index = self._index_of(table)
        plans = self._plans[table.cs_id]
        name = (keys.tobytes(), candidates, tokens)
        plan = plans.get(name)
        if plan is not None and plan.generation == table.generation:
            plan.recalled = True
            return plan
        hs, ks, loose, held = index.prefix_bounds(keys, candidates)
        if loose.any():
            # a holder with tiers beyond HBM may lose by a longer run (its fetch grows):
            # only runs of HBM-only holders are left bounded
            deep = loose & ~table.hbm_only[hs]
            if deep.any():
                ks, loose, held = ks.copy(), loose.copy(), held.copy()
                ks[deep] = held[deep] = index.verify(keys, hs[deep], ks[deep], held[deep])
                loose[deep] = False
        plan = _Holders.price(table, self.config, hs, ks, tokens, slots, pick, loose, held)
        if len(plans) >= 4096:
            plans.clear()
        plans[name] = plan
        return plan

    def _verified(
        self,
        table: ServiceTable,
        keys: np.ndarray,
        tokens: int,
        candidates: int,
        slots: np.ndarray,
        pick: slice | np.ndarray,
        plan: _Holders,
        need: list[int],
    ) -> tuple[_Holders, bool]:
        """The plan with the exact runs of holders `need` (positions) in place of their
        bounds, remembered in its place, and whether any run fell short of its bound.
        Where one did, the position of the key it missed joins the plan's `ends`, and
        every holder still loose is asked the new ends (one pass more): a miss at p caps
        its run at p, so the next round makes exact only those that still matter."""
        index = self._index[table.cs_id]
        at = np.unique(np.array(need, dtype=np.int64))
        at = at[plan.loose[at]]
        ks, loose, held = plan.ks.copy(), plan.loose.copy(), plan.held.copy()
        exact = index.verify(keys, plan.hs[at], ks[at], held[at])
        short = exact[exact != ks[at]].tolist()
        ks[at] = held[at] = exact
        loose[at] = False
        new_ends = sorted(set(short).difference(plan.ends))
        if new_ends and loose.any():
            # the whole holder set is asked (its row set recurs with the prompt's holders)
            ks = index.tighten(keys, plan.hs, ks, held, new_ends)
            loose &= ks > held
        fresh = _Holders.price(table, self.config, plan.hs, ks, tokens, slots, pick, loose, held)
        fresh.ends = sorted(plan.ends + new_ends) if new_ends else plan.ends
        self._plans[table.cs_id][(keys.tobytes(), candidates, tokens)] = fresh
        return fresh, bool(short)

    def _spread(self, total: np.ndarray, margin: float) -> np.ndarray:
        """Power of two choices among the candidates within `margin` ms of the best
        (`total`: what the candidates are ranked by)."""
        near = np.nonzero(total <= total.min() + margin)[0]
        self._draws += 1
        h = _mix64(self.config.seed * 0x9E3779B97F4A7C15 + self._draws)
        a, b = near[h % len(near)], near[(h >> 32) % len(near)]
        first, second = (a, b) if total[a] <= total[b] else (b, a)
        if first == second:
            rest = np.argsort(total, kind="stable")
            second = next(int(i) for i in rest if i != first)
        return np.array([first, second])

    def _consider_remote(
        self,
        table: ServiceTable,
        pick: slice | np.ndarray,
        plan: _Holders,
        base: np.ndarray,
        ms_per_token: np.ndarray,
        request: Request,
        priced: _Priced,
        leaders: list[int],
        rank: np.ndarray,
    ) -> bool:
        """Offer every instance the option of pulling the best source's prefix; True if
        some estimate improved. An instance takes the pull when it lowers its estimate
        (and so its rank too: the source holds the most, so a pull never adds prefill);
        `rank` is what the leaders were ranked by."""
        src_slot, cached_tokens = plan.src_slot, plan.src_cached_tokens
        stamp = (table.site_version, len(table.site), self.network.version)
        pull_of = plan.pull
        loose = pull_of is not None and pull_of[7] and self._has_vectors(pull_of[1], table)
        if pull_of is None or pull_of[0] != stamp or loose:
            pull_of = self._pull_terms(table, plan, request.block_keys, stamp)
        _, node, nblocks, bpb, tier_bw, latency, fastest, _ = pull_of
        # Nothing to gain when even the fastest pull cannot reach the runner-up (or the
        # near-equal margin of the best): the two leaders and the spread stay as they are.
        total = priced.total
        weight = self.config.work_weight
        if len(leaders) > 1:
            first, second = rank[leaders[0]], rank[leaders[1]]
            bar = max(float(second), float(first) + self.config.spread_ms)
            least_prefill = (request.prompt_tokens - cached_tokens) * float(ms_per_token.min())
            least = float(base.min()) + least_prefill
            if weight:  # a rank is the estimate plus the weighed prefill
                least += weight * least_prefill
            if least + fastest > bar:
                return False
        remote_prefill = (request.prompt_tokens - cached_tokens) * ms_per_token
        src_at = int(plan.idx[plan.src])
        if len(leaders) < 2 or len(total) <= _FEW_PULLS:  # every candidate, vectors
            delay, bw = self._site_vectors(node, table, pick)
            link_bw = np.minimum(bw, tier_bw)
            pull = delay + latency + nblocks * bpb * 8 / (link_bw * 1000)
            remote_total = base + pull + remote_prefill
            took = remote_total < total
            took[src_at] = False
            if not took.any():
                return False
            total[took] = remote_total[took]
            priced.remote = (took, pull, remote_prefill, src_slot)
            return True
        # Only a candidate whose pull could bring it within the bar can change the
        # leaders, the near-equal set or their terms. Its estimate is at least base +
        # fastest pull + remote prefill, summed in the order the estimate is (IEEE
        # rounding is monotone, so this floor never exceeds the estimate itself).
        floor = base + fastest
        floor += remote_prefill
        if weight:
            floor += weight * remote_prefill
        reach = np.flatnonzero(floor <= bar)
        if len(reach) > _FEW_PULLS or self._has_vectors(node, table):
            delay_all, bw_all = self._site_vectors(node, table, pick)
            delay, bw = delay_all[reach], bw_all[reach]
        else:  # a path each: no need for the vectors from the source's site to all sites
            delay, bw = np.empty(len(reach)), np.empty(len(reach))
            sites = table.site[pick][reach].tolist()
            for j, site in enumerate(sites):
                p = self._path(node, site) if site >= 0 else None
                delay[j], bw[j] = (p.delay_ms, p.bandwidth_mbps) if p else (INF, 1.0)
        link_bw = np.minimum(bw, tier_bw)
        pull = delay + latency + nblocks * bpb * 8 / (link_bw * 1000)
        remote_total = base[reach] + pull + remote_prefill[reach]
        better = remote_total < total[reach]
        better[reach == src_at] = False
        if not better.any():
            return False
        won = reach[better]
        total[won] = remote_total[better]
        took = np.zeros(len(total), dtype=bool)
        took[won] = True
        pulls = np.zeros(len(total))
        pulls[won] = pull[better]
        priced.remote = (took, pulls, remote_prefill, src_slot)
        return True

    def _pull_terms(
        self,
        table: ServiceTable,
        plan: _Holders,
        keys: np.ndarray,
        stamp: tuple[int, int, int],
    ) -> tuple:
        """What pulling the best source's prefix costs at best: (stamp, its site's graph
        node, blocks, bytes per block, tier bandwidth, tier latency, the fastest pull
        over the widest path, and whether that path's width was unknown). Remembered
        with the plan for an HBM-only source (its figures move with the table
        generation); a source with deeper tiers is asked each time."""
        src_slot, cached_tokens = plan.src_slot, plan.src_cached_tokens
        src = table.instances[src_slot]
        assert src is not None
        node = self.config.node_of(src.site_id)
        block = src.block_size or self.config.default_block_size
        nblocks = int(np.ceil(cached_tokens / block))
        bpb = int(table.max_block_bytes[src_slot])
        hbm_only = bool(table.hbm_only[src_slot])
        if hbm_only:
            tier_bw = float(table.tier0_mbps[src_slot]) if nblocks else INF
            latency = float(table.tier0_latency_ms[src_slot]) if nblocks else 0.0
        else:
            codes = [c for c in np.unique(src.prefix_tiers(keys[:nblocks])).tolist() if c]
            tier_bw = min((src.tiers[Tier(c)].fetch_bandwidth_mbps for c in codes), default=INF)
            latency = max((src.tiers[Tier(c)].fetch_latency_us / 1000 for c in codes), default=0.0)
        known = self._has_vectors(node, table)
        widest = min(self._max_bandwidth(node, table), tier_bw)
        fastest = latency + nblocks * bpb * 8 / (widest * 1000)
        # the last term: the path bound was not at hand (a tighter one may come later)
        terms = (stamp, node, nblocks, bpb, tier_bw, latency, fastest, not known)
        if hbm_only:
            plan.pull = terms
        return terms

    @staticmethod
    def _candidate(
        table: ServiceTable, slots: np.ndarray, i: int, priced: _Priced
    ) -> tuple[Instance, Instance | None]:
        inst = table.instances[int(slots[i])]
        assert inst is not None
        remote = priced.remote
        src = table.instances[remote[3]] if remote is not None and remote[0][i] else None
        return inst, src

    def _estimate(
        self,
        table: ServiceTable,
        slots: np.ndarray,
        i: int,
        request: Request,
        priced: _Priced,
        instances: tuple[Instance, Instance | None] | None = None,
    ) -> Estimate:
        """The terms of candidate `i` (an index into `slots`), as an Estimate; the
        instance and its KV source may be given as they were at decision time."""
        if instances is None:
            instances = self._candidate(table, slots, i, priced)
        inst, src = instances
        path = self._path(request.ingress, inst.site_id)
        cached, expected, fetch, prefill = priced.terms(i)
        evicted, evict_ms = priced.eviction(i)
        return _new_estimate(
            address=inst.address,
            site_id=inst.site_id,
            path=path.nodes if path else (),
            rtt_ms=float(priced.rtt[i]),
            upload_ms=float(priced.upload[i]),
            queue_ms=float(priced.queue[i]),
            cached_blocks=cached,
            expected_cached_blocks=expected,
            fpr=inst.fpr,
            stale=inst.stale,
            kv_source=src.address if src else None,
            fetch_ms=fetch,
            prefill_ms=prefill,
            total_ms=float(priced.total[i]),
            evicted_blocks=evicted,
            evict_ms=evict_ms,
        )
