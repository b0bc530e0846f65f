"""The fleet probe and the key index against the plain per-instance lookup they replace.

Every answer the vectorised probe gives must equal what each instance's own summaries say
(`Instance.lookup`), false positives included (the hashing is the same), for every kind,
for shards, tiers, deltas layered on filters, withdrawals and after compaction; and the
chunked walk must give each instance the leading run a direct probe gives, also after the
state it remembered has changed.
"""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from catsproto import wire
from catsproto.selector import RIB
from catsproto.selector.fleet import FleetProbe
from catsproto.selector.index import KeyIndex
from catsproto.summary import Summary, SummarySender
from tests.selector_fixtures import BYTES_PER_BLOCK, advert

HALF = 1 << 63
U64 = (1 << 64) - 1
KINDS = (wire.SummaryKind.FUSE, wire.SummaryKind.BLOOM, wire.SummaryKind.EXACT)
# fixture instances with one tier of two shards, and their kind
SAME_GEOMETRY = (
    (9, wire.SummaryKind.FUSE),
    (21, wire.SummaryKind.FUSE),
    (13, wire.SummaryKind.BLOOM),
)


def shard_entry(summary, lo, hi, tier=wire.Tier.HBM, version=1, base=0, count=1):
    return wire.SummaryEntry(
        tier=tier,
        kind=wire.SummaryKind(summary.kind),
        version=version,
        base_version=base,
        key_lo=lo,
        key_hi=hi,
        entry_count=count,
        bytes_per_block=BYTES_PER_BLOCK,
        fetch_latency_us=5,
        fetch_bandwidth_mbps=800_000,
        params=summary.params(),
        body=summary.encode(),
    )


def entries_for(keys, kind, shards, tier=wire.Tier.HBM, version=1):
    ranges = [(0, U64)] if shards == 1 else [(0, HALF - 1), (HALF, U64)]
    out = []
    for lo, hi in ranges:
        part = keys[(keys >= np.uint64(lo)) & (keys <= np.uint64(hi))]
        s = Summary.build(part, 0.05, kind=int(kind), seed=lo & 0xFFFF)
        out.append(shard_entry(s, lo, hi, tier=tier, version=version, count=max(1, len(part))))
    return out


def addr(i):
    return ipaddress.IPv4Address(0x0A000000 + i + 1)


def announce(rib, i, entries, seq=1, now_ms=1):
    """One route per shard and tier, as an instance sends them."""
    for n, e in enumerate(entries):
        rib.accept(advert(str(addr(i)), 1 + i % 4, [e], seq=seq * 16 + n), now_ms=now_ms)


def reference(rib, keys):
    """Per key, the bitmask of slots whose own lookup holds it."""
    table = rib.services[7]
    masks = [0] * len(keys)
    for inst in table.live():
        held = inst.lookup(keys) > 0
        for i in np.flatnonzero(held).tolist():
            masks[i] |= 1 << inst.slot
    return masks


@pytest.fixture
def fleet():
    return make_fleet()


def make_fleet():
    """30 instances of every kind, one or two shards, some with a DRAM tier too."""
    rng = np.random.default_rng(11)
    rib = RIB(hold_time_ms=10**9)
    held = {}
    for i in range(30):
        keys = rng.integers(0, 2**64 - 1, size=300 + 40 * i, dtype=np.uint64)
        kind = KINDS[i % 3]
        entries = entries_for(keys[:200], kind, 1 + i % 2)
        if i % 5 == 0:
            entries += entries_for(keys[200:], KINDS[(i + 1) % 3], 1, tier=wire.Tier.DRAM)
        announce(rib, i, entries)
        held[i] = keys
    return rib, held, rng


def probe_keys(held, rng):
    own = np.concatenate([k[::7] for k in held.values()])
    return np.concatenate([own, rng.integers(0, 2**64 - 1, size=4000, dtype=np.uint64)])


def test_probe_agrees_with_every_instance(fleet):
    rib, held, rng = fleet
    probe = FleetProbe(rib.services[7])
    keys = probe_keys(held, rng)
    got = probe.held(keys)
    assert got == reference(rib, keys)
    assert sum(m != 0 for m in got[-4000:]) > 0  # some false positives, answered alike
    # a subset of slots answers only for those slots
    some = np.array([0, 3, 4, 17, 29])
    mask = sum(1 << s for s in some.tolist())
    assert probe.held(keys, some) == [m & mask for m in reference(rib, keys)]


def test_probe_follows_deltas_withdrawals_and_compaction(fleet):
    rib, held, rng = fleet
    table = rib.services[7]
    probe = FleetProbe(table)
    keys = probe_keys(held, rng)
    probe.held(keys)
    # instance 0 (fuse) moves on by a delta: some keys removed, some added
    sender = SummarySender(0.05, kind=int(wire.SummaryKind.FUSE))
    first = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    snap = sender.update(first)
    later = np.concatenate([first[50:], rng.integers(0, 2**64 - 1, 30, dtype=np.uint64)])
    delta = sender.update(later)
    assert delta.is_delta
    for upd in (snap, delta):
        e = shard_entry(upd.summary, 0, U64, version=upd.version, base=upd.base_version)
        announce(rib, 0, [e], seq=upd.version + 1, now_ms=2)
    query = np.concatenate([keys, later[-30:], first[:50], first[50:400]])
    assert probe.held(query) == reference(rib, query)
    # a withdrawn instance holds nothing any more
    rib.withdraw(addr(3))
    assert probe.held(query) == reference(rib, query)
    assert not any(m & (1 << 3) for m in probe.held(held[3]))
    # re-advertised filters of the same geometry are rewritten where they stand
    used, rows = probe._used, len(probe.rows_of(None))
    before = probe.rebuilds
    for round_ in range(3):
        for i, kind in SAME_GEOMETRY:  # announced as such in the fixture, 200 keys
            split = int(np.count_nonzero(held[i][:200] < HALF))
            fresh = rng.integers(0, 2**64 - 1, 200, dtype=np.uint64)  # as many per shard
            fresh[:split] &= np.uint64(HALF - 1)
            fresh[split:] |= np.uint64(HALF)
            entries = entries_for(fresh, kind, 2, version=round_ + 2)
            announce(rib, i, entries, seq=round_ + 5, now_ms=3)
            asked = np.concatenate([fresh[:50], query])
            assert probe.held(asked) == reference(rib, asked)
    assert probe.rebuilds - before == 3 * len(SAME_GEOMETRY)
    assert (probe._used, len(probe.rows_of(None))) == (used, rows)
    # many re-advertisements of other sizes: dead rows pile up, the buffer is
    # compacted, answers stay
    before = probe.rebuilds
    for round_ in range(12):
        for i in (1, 4, 7, 10):
            entries = entries_for(
                held[i][: 150 + 180 * (round_ % 2)], wire.SummaryKind.FUSE, 2, version=round_ + 2
            )
            announce(rib, i, entries, seq=round_ + 10, now_ms=3)
        assert probe.held(query) == reference(rib, query)
    assert probe.rebuilds - before >= 48
    assert probe.compactions >= 1


def test_walk_gives_each_instance_its_leading_run():
    rng = np.random.default_rng(5)
    rib = RIB(hold_time_ms=10**9)
    prompt = rng.integers(0, 2**64 - 1, size=128, dtype=np.uint64)
    depth = {}
    for i in range(120):  # the first key is asked of all 120, the rest of its holders
        d = int(rng.integers(0, 129)) if i % 3 == 0 else 0
        other = rng.integers(0, 2**64 - 1, size=500, dtype=np.uint64)
        keys = np.concatenate([prompt[:d], other])
        announce(rib, i, entries_for(keys, KINDS[i % 3], 1 + i % 2))
        depth[i] = d
    table = rib.services[7]
    index = KeyIndex(table)

    def brute():
        out = {}
        for inst in table.live():
            held = inst.lookup(prompt) > 0
            run = len(held) if held.all() else int(np.argmin(held))
            if run:
                out[inst.slot] = run
        return out

    def walk():
        hs, ks = index.prefix_lengths(prompt, table.live_mask)
        return dict(zip(hs.tolist(), ks.tolist(), strict=True))

    assert walk() == brute()
    assert all(brute().get(i, 0) >= d for i, d in depth.items())  # no false negatives
    probes = index.probes
    assert walk() == brute() and index.probes == probes  # recurring prompt: no probe
    # a holder evicts the tail of the prompt: the remembered chunks are re-probed for it
    holder = next(i for i, d in depth.items() if d > 40)
    keys = np.concatenate([prompt[:20], rng.integers(0, 2**64 - 1, 500, dtype=np.uint64)])
    e = entries_for(keys, KINDS[holder % 3], 1 + holder % 2, version=2)
    announce(rib, holder, e, seq=2, now_ms=2)
    assert walk() == brute()
    assert walk()[table.by_address[addr(holder)].slot] < depth[holder]
    # a subset of candidates (others expired, say): only those appear
    subset = sum(1 << s for s in range(0, 120, 2))
    hs, ks = index.prefix_lengths(prompt, subset)
    expect = {s: k for s, k in brute().items() if s % 2 == 0}
    assert dict(zip(hs.tolist(), ks.tolist(), strict=True)) == expect


def test_restarted_origin_replaces_its_old_state():
    """A new epoch starts its summary versions again at 1: the RIB drops what the old
    epoch said (every tier and shard) instead of ignoring the new snapshots as old."""
    rng = np.random.default_rng(3)
    rib = RIB(hold_time_ms=10**9)
    before = rng.integers(0, 2**64 - 1, size=400, dtype=np.uint64)
    after = rng.integers(0, 2**64 - 1, size=400, dtype=np.uint64)
    old = entries_for(before, wire.SummaryKind.EXACT, 2, version=5)
    old += entries_for(before, wire.SummaryKind.EXACT, 1, tier=wire.Tier.DRAM, version=5)
    for n, e in enumerate(old):
        rib.accept(advert(str(addr(0)), 1, [e], seq=10 + n, epoch=1), now_ms=1)
    inst = rib.services[7].by_address[addr(0)]
    probe = FleetProbe(rib.services[7])
    assert (inst.lookup(before) > 0).all() and probe.held(before[:5]) == [1] * 5
    # restart: epoch 2, one shard of HBM only, version 1
    new = entries_for(after, wire.SummaryKind.EXACT, 1, version=1)
    rib.accept(advert(str(addr(0)), 1, new, seq=1, epoch=2), now_ms=2)
    assert set(inst.tiers) == {wire.Tier.HBM}
    assert (inst.lookup(after) > 0).all() and not (inst.lookup(before) > 0).any()
    assert probe.held(after[:5]) == [1] * 5 and probe.held(before[:5]) == [0] * 5
    # and a later advertisement of the same epoch merges as usual
    more = entries_for(after[:100], wire.SummaryKind.EXACT, 1, tier=wire.Tier.DRAM, version=1)
    rib.accept(advert(str(addr(0)), 1, more, seq=2, epoch=2), now_ms=3)
    assert set(inst.tiers) == {wire.Tier.HBM, wire.Tier.DRAM}


@pytest.mark.parametrize("spread", [0.0, 50.0])
def test_staged_runs_decide_as_the_linear_walk(monkeypatch, spread):
    """A new prompt held by many instances is not walked key by key: their runs are left
    bounded and the staged search makes exact those the decision reads. Every decision,
    with every term, equals the one of a selector that walks every key, false positives
    (5 % filters) included; with the near-equal margin off it asks fewer pairs."""
    from catsproto.selector import Link, Network, PathSelector, Request, SelectorConfig
    from catsproto.selector import index as index_module

    rng = np.random.default_rng(21)
    prompts = rng.integers(0, 2**64 - 1, size=(6, 128), dtype=np.uint64)
    rib = RIB(hold_time_ms=10**9)
    for i in range(40):
        depth = [0, 20, 40, 64, 100, 128][i % 6] + int(rng.integers(0, 5))
        held = [p[: min(128, depth + 10 * (j % 2))] for j, p in enumerate(prompts)]
        other = rng.integers(0, 2**64 - 1, size=300, dtype=np.uint64)
        entries = entries_for(np.concatenate([*held, other]), wire.SummaryKind.FUSE, 1 + i % 2)
        announce(rib, i, entries)
    net = Network([Link("ingress", f"site{s}", 2 + 3 * s, 10_000) for s in range(1, 5)])
    cfg = SelectorConfig(spread_ms=spread, seed=3)
    staged, walking = PathSelector(rib, net, cfg), PathSelector(rib, net, cfg)
    asks = []
    for p in prompts:  # each prompt, then prompts sharing its first 90 or 30 blocks
        asks += [p, np.concatenate([p[:90], rng.integers(0, 2**63, 38, dtype=np.uint64)])]
        asks += [np.concatenate([p[:30], rng.integers(0, 2**63, 70, dtype=np.uint64)])]
    for n, keys in enumerate(asks):
        req = Request(7, keys, len(keys) * 512, "ingress")
        monkeypatch.setattr(index_module, "STAGE_MIN_LOOKUPS", 0)  # bound whenever it may
        got = staged.decide(req, now_ms=n)
        monkeypatch.setattr(index_module, "STAGE_MIN_SLOTS", 10**9)  # never
        want = walking.decide(req, now_ms=n)
        monkeypatch.undo()
        assert got.chosen == want.chosen and got.runner_up == want.runner_up, n
    staged_pairs = staged._index[7].fleet.pairs
    walk_pairs = walking._index[7].fleet.pairs
    # a 50 ms margin over 40 instances makes nearly every holder worth making exact
    assert staged_pairs < walk_pairs * (1.3 if spread else 0.7), (staged_pairs, walk_pairs)


@pytest.mark.parametrize("spread", [0.0, 5.0])
def test_staged_search_leaves_holders_that_cannot_win_bounded(monkeypatch, spread):
    """Holders of a prompt whose best conceivable estimate (at their bound) cannot reach
    the leaders are pruned: never made exact, their runs left as bounds — here at least
    every busy one. The decision, every term of the chosen and the runner-up, is the
    one-pass walk's."""
    from catsproto.selector import Link, Network, PathSelector, Request, SelectorConfig
    from catsproto.selector import index as index_module

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 2**64 - 1, size=128, dtype=np.uint64)
    rib = RIB(hold_time_ms=10**9)
    for i in range(24):
        busy = i >= 12  # slots 12..23: shallower, and a thousand seconds of backlog
        depth = (50 if busy else 60) + i % 3
        keys = np.concatenate([prompt[:depth], rng.integers(0, 2**64 - 1, 200, np.uint64)])
        for n, e in enumerate(entries_for(keys, wire.SummaryKind.FUSE, 1 + i % 2)):
            adv = advert(str(addr(i)), 1 + i % 4, [e], seq=16 + n, backlog=1e7 if busy else 0)
            rib.accept(adv, now_ms=1)
    net = Network([Link("ingress", f"site{s}", 2 + 3 * s, 10_000) for s in range(1, 5)])
    cfg = SelectorConfig(spread_ms=spread, seed=3)
    staged, walking = PathSelector(rib, net, cfg), PathSelector(rib, net, cfg)
    table = rib.services[7]
    busy_slots = {table.by_address[addr(i)].slot for i in range(12, 24)}
    tail = rng.integers(0, 2**64 - 1, size=40, dtype=np.uint64)
    for n, keys in enumerate([prompt, prompt[:100], np.concatenate([prompt[:80], tail])]):
        req = Request(7, keys, len(keys) * 512, "ingress")
        got = staged.decide(req, now_ms=2 + n)
        monkeypatch.setattr(index_module, "STAGE_MIN_SLOTS", 10**9)  # walk every key
        want = walking.decide(req, now_ms=2 + n)
        monkeypatch.undo()
        assert repr(got) == repr(want), n
        plan = staged._plans[7][(keys.tobytes(), table.live_mask, len(keys) * 512)]
        left = set(plan.hs[plan.loose].tolist())
        assert busy_slots <= left, (n, left)  # none of the busy holders was made exact
        runs = dict(zip(*walking._index[7].prefix_lengths(keys, table.live_mask), strict=True))
        for slot, bound in zip(plan.hs.tolist(), plan.ks.tolist(), strict=True):
            assert bound >= runs[slot]  # a bound never under the run
    assert staged._index[7].fleet.pairs < walking._index[7].fleet.pairs / 2


def test_remembered_row_set_follows_slots_announced_later(fleet):
    rib, held, rng = fleet
    probe = FleetProbe(rib.services[7])
    slots = np.arange(32)  # 30 and 31 hold nothing yet
    query = np.concatenate([held[0][:20], held[29][:20]])
    assert probe.held(query, slots) == reference(rib, query)
    fresh = rng.integers(0, 2**64 - 1, 200, dtype=np.uint64)
    announce(rib, 30, entries_for(fresh, wire.SummaryKind.FUSE, 1))
    asked = np.concatenate([query, fresh[:20]])
    got = probe.held(asked, slots)
    assert got == reference(rib, asked)
    assert all(m >> 30 & 1 for m in got[-20:])


def test_recurring_prompt_makes_its_bounded_runs_exact_once(monkeypatch):
    """A prompt seen again has every bounded run made exact in one pass when a decision
    needs any (as the selector's own load moves its leaders, it would otherwise make a few
    exact in each decision to come); the decisions equal the walk's all along."""
    from catsproto.selector import Link, Network, PathSelector, Request, SelectorConfig
    from catsproto.selector import index as index_module

    rng = np.random.default_rng(9)
    prompt = rng.integers(0, 2**64 - 1, size=128, dtype=np.uint64)
    rib = RIB(hold_time_ms=10**9)
    for i in range(24):
        keys = np.concatenate([prompt[: 60 + i % 5], rng.integers(0, 2**64 - 1, 200, np.uint64)])
        announce(rib, i, entries_for(keys, wire.SummaryKind.FUSE, 1 + i % 2))
    net = Network([Link("ingress", f"site{s}", 2 + 3 * s, 10_000) for s in range(1, 5)])
    staged = PathSelector(rib, net, SelectorConfig(seed=3))
    walking = PathSelector(rib, net, SelectorConfig(seed=3))
    table = rib.services[7]
    name = (prompt.tobytes(), table.live_mask, len(prompt) * 512)
    req = Request(7, prompt, len(prompt) * 512, "ingress")
    asked = []  # pairs each decision asked
    for n in range(12):
        before = staged._index[7].fleet.pairs if n else 0
        got = staged.decide(req, now_ms=2)
        asked.append(staged._index[7].fleet.pairs - before)
        monkeypatch.setattr(index_module, "STAGE_MIN_SLOTS", 10**9)  # walk every key
        want = walking.decide(req, now_ms=2)
        monkeypatch.undo()
        assert repr(got) == repr(want), n
        if n == 0:
            assert staged._plans[7][name].loose.any()  # the first left runs bounded
    again = [k for k in asked[1:] if k]
    assert len(again) == 1, asked  # one pass when the prompt's leaders moved, then none
    assert not staged._plans[7][name].loose.any(), asked


def test_sync_moves_rebuilds_out_of_the_decision():
    """`PathSelector.sync` rebuilds the probe rows of origins whose summaries changed,
    so the next decision rebuilds nothing; a selector left to rebuild lazily inside
    its decision decides the same, every term."""
    from catsproto.selector import Link, Network, PathSelector, Request, SelectorConfig

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 2**64 - 1, size=64, dtype=np.uint64)
    rib = RIB(hold_time_ms=10**9)
    for i in range(12):
        other = rng.integers(0, 2**64 - 1, size=200, dtype=np.uint64)
        entries = entries_for(np.concatenate([prompt[: 4 * i], other]), wire.SummaryKind.FUSE, 2)
        announce(rib, i, entries)
    net = Network([Link("ingress", f"site{s}", 2 + 3 * s, 10_000) for s in range(1, 5)])
    cfg = SelectorConfig(seed=1)
    eager, lazy = PathSelector(rib, net, cfg), PathSelector(rib, net, cfg)
    assert eager.sync(99) == 0  # no such service
    assert eager.sync(7) == 12  # first build of every origin's rows
    req = Request(7, prompt, 64 * 512, "ingress")
    got, want = eager.decide(req, now_ms=1), lazy.decide(req, now_ms=1)
    assert (got.chosen, got.runner_up) == (want.chosen, want.runner_up)
    # two origins re-advertise (one with a longer run), as a batch of updates
    for i, depth in ((3, 60), (8, 2)):
        other = rng.integers(0, 2**64 - 1, size=200, dtype=np.uint64)
        keys = np.concatenate([prompt[:depth], other])
        announce(rib, i, entries_for(keys, wire.SummaryKind.FUSE, 2, version=2), seq=2, now_ms=2)
    fleet = eager._index[7].fleet
    assert eager.sync(7) == 2 and eager.sync(7) == 0
    before = fleet.rebuilds
    got, want = eager.decide(req, now_ms=3), lazy.decide(req, now_ms=3)
    assert fleet.rebuilds == before  # nothing left to rebuild inside the decision
    assert lazy._index[7].fleet.rebuilds == 14  # the lazy one did it there
    assert (got.chosen, got.runner_up) == (want.chosen, want.runner_up)
    assert got.chosen.address == addr(3) and got.chosen.cached_blocks == 60  # the new run


def test_compiled_pass_answers_as_each_filter_for_both_arities():
    """Fuse rows of arity 3 and 4 and several segment sizes, up to four shards per
    instance, slots asked in any order (one unknown): `held` and `hits` give what each
    filter's own `contains_many` gives, members and false positives alike."""
    from catsproto.summary.fuse import FuseSummary

    rng = np.random.default_rng(3)
    rib = RIB(hold_time_ms=10**9)
    members = []
    for i in range(12):
        keys = rng.integers(0, 2**64 - 1, size=50 + 400 * i, dtype=np.uint64)
        shards = 1 + i % 4
        edges = [(2**64 * j) // shards for j in range(shards + 1)]
        entries = []
        for j in range(shards):
            lo, hi = edges[j], edges[j + 1] - 1
            part = keys[(keys >= np.uint64(lo)) & (keys <= np.uint64(hi))]
            s = FuseSummary.from_keys(np.unique(part), 0.05, seed=i * 7 + j, arity=3 + (i + j) % 2)
            entries.append(shard_entry(s, lo, hi, count=max(1, len(part))))
        announce(rib, i, entries)
        members.append(keys[::9])
    probe = FleetProbe(rib.services[7])
    probe.sync()
    four = probe._cols["four"][: probe._rows]
    assert probe._cols["fuse"][: probe._rows].all() and four.any() and not four.all()
    asked = np.concatenate([*members, rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64)])
    expect = reference(rib, asked)
    assert probe.held(asked) == expect
    probe.prefetch = False  # the prefetches only ask for lines early: the same answers
    assert probe.held(asked) == expect and probe.held(asked[:1]) == expect[:1]
    probe.prefetch = True
    own = len(asked) - 3000
    assert all(m != 0 for m in expect[:own])  # no false negatives
    slots = np.array([11, 2, 40, 7, 0, 5])  # 40 is no slot: holds nothing
    hit = probe.hits(asked, slots)
    for c, s in enumerate(slots.tolist()):
        assert hit[:, c].tolist() == [bool(m >> s & 1) for m in expect]
    assert hit[own:].any() and not hit[own:].all()  # false positives, answered alike


def test_corrected_rows_answer_through_many_deltas(fleet):
    """Fuse rows with deltas on top are answered in the compiled pass from their exact
    corrections: through a long run of deltas (each replacing the row's corrections,
    until the correction buffer is compacted) every answer equals the instances' own."""
    rib, _held, rng = fleet
    probe = FleetProbe(rib.services[7])
    senders = {i: SummarySender(0.05, kind=int(wire.SummaryKind.FUSE)) for i in (0, 6, 12)}
    keys = {i: rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64) for i in senders}
    deltas = 0
    compacted_with_corrections = 0
    for round_ in range(40):
        asked = [rng.integers(0, 2**64 - 1, 500, dtype=np.uint64)]
        for i, sender in senders.items():
            step = 10 + 3 * i  # out of step: their snapshots fall in different rounds
            gone = keys[i][:step]
            keys[i] = np.concatenate(
                [keys[i][step:], rng.integers(0, 2**64 - 1, step, dtype=np.uint64)]
            )
            upd = sender.update(keys[i])
            deltas += upd.is_delta
            e = shard_entry(upd.summary, 0, U64, version=upd.version, base=upd.base_version)
            announce(rib, i, [e], seq=round_ + 2, now_ms=2 + round_)
            asked += [gone, keys[i][-step:], keys[i][:200]]
        query = np.concatenate(asked)
        before = probe.correction_compactions
        assert probe.held(query) == reference(rib, query)
        if probe.correction_compactions > before and probe._row_corrections:
            compacted_with_corrections += 1
    assert deltas >= 80  # most updates were deltas on a filter
    assert compacted_with_corrections >= 1
