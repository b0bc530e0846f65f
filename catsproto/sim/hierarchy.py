"""A two-level decision: the ingress's C-PS picks the site, the site's own C-PS the instance.

Strategy. In a CATS deployment with a forwarder at each site's egress, a request the
ingress steers to site S passes S's egress, where S's own C-PS sits one LAN hop from
S's instances. So the ingress only needs to choose the *site*; the instance is chosen
where the state is freshest and where every request for that site passes. Here:

- the ingress's C-PS decides as the flat ``catsproto`` does (`PathSelector.decide` on
  every instance's advertised state, delayed across the WAN) and keeps only the site of
  its winner;
- site S's C-PS holds a RIB of S's instances only, fed by the same signed routes
  (verified once per C-PS box; they arrive after the intra-site delay, 1.5 ms in S1),
  and runs its own selector over it. Being the only C-PS that
  sends work to S's instances, its count of work sent since each advertisement is
  complete, so four ingresses inside one millisecond's burst no longer pile onto one
  instance: they can only pile onto one site, whose C-PS spreads the pile. It tells the
  ingress selector in its own box what it placed (`note`), so that selector knows its
  site's instances as well as the site C-PS does;
- scenario rules at the site C-PS: ``site_bounce`` hands a request back to its
  ingress's site when the site's real queue makes it slower there even after the detour
  (which is added to the round trip); ``site_sticky_ms`` leaves a request on the holder
  of a longer prefix when that is at most this much slower, instead of copying the
  prefix; at the ingress, ``remote_margin_ms`` keeps a request home unless a remote site
  is better by that much; ``shortest_first = "catsproto"`` has the site C-PS send the
  requests it placed in one millisecond to each instance least work first, by its own
  estimate (`Choice.work_ms`; the engine orders them, `sim.engine`);
- with pulls (scenario ``remote_kv``) the site C-PS prices pulls among its own
  instances, and a pull the ingress planned from another site's holder travels with
  the request (source, priced pull, remaining prefill) as the selector's request option
  `CarriedPull`: the site C-PS's one `decide` call offers it to each of its instances
  (at one site: to the least-queued) and takes it when that beats its own best.

Every selector here counts the work sent since an instance's advertisement with
`SelectorConfig(pending="drain")`: replayed as an FCFS queue drained at the advertised
prefill rate (each decision's work queued behind what was left at its time), instead
of being counted in full until the next advertisement (`catsproto.selector.pending`).

The instance the engine sees is the site C-PS's choice; its claimed prefix is what that
C-PS believed, so stale and false-positive accounting uses the site C-PS's view.
Pure and deterministic, like the rest of `catsproto.sim`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from catsproto import wire
from catsproto.selector import (
    RIB,
    CarriedPull,
    NoInstanceError,
    PathSelector,
    Request,
    SelectorConfig,
)
from catsproto.selector.rib import ServiceTable
from catsproto.selector.selector import Estimate
from catsproto.sim.cluster import Cluster
from catsproto.sim.control import CS_ID, ControlPlane
from catsproto.sim.policies import CatsprotoPolicy, Choice, Handoff
from catsproto.sim.trace import PreparedTrace

__all__ = ["HierarchicalControlPlane", "HierarchicalPolicy"]


class HierarchicalControlPlane(ControlPlane):
    """The flat control plane plus, at each site, a C-PS over that site's instances."""

    def __init__(self, sc, cluster: Cluster, *, exact: bool = False) -> None:
        if sc.selector_site is not None:
            raise ValueError("site dispatch needs a C-PS at every ingress site")
        super().__init__(sc, cluster, exact=exact)
        self.selectors = [
            PathSelector(x.rib, x.network, dataclasses.replace(x.config, pending="drain"))
            for x in self.selectors
        ]
        self.local_ribs = [RIB(decode=self.decode) for _ in sc.sites]
        network = self.selectors[0].network
        self.local_selectors = [
            PathSelector(
                self.local_ribs[s],
                network,
                SelectorConfig(
                    site_nodes={s + 1: name},
                    request_bytes_per_token=sc.request_bytes_per_token,
                    allow_remote_kv=sc.remote_kv,  # pulls among the site's own instances
                    default_block_size=sc.block_tokens,
                    spread_ms=0.0,  # the only C-PS sending work here: no herd to break
                    pending="drain",  # ... and its count of work sent is complete
                    seed=sc.seed * 1000 + 500 + s,
                    price_evictions=sc.price_evictions,
                    reuse_horizon_ms=sc.reuse_horizon_ms,
                ),
            )
            for s, name in enumerate(sc.sites)
        ]

    def _accepted(self, x: int, i: int, adv: wire.Advertisement, at: int) -> None:
        if self.sc.site_of(i) == x:
            self.local_ribs[x].accept(adv, at)


class HierarchicalPolicy(CatsprotoPolicy):
    """catsproto with a site C-PS choosing the instance (scenario ``site_dispatch``)."""

    name = "catsproto"
    carry_source = True  # a pull the ingress planned from another site travels along

    def __init__(
        self, cluster: Cluster, trace: PreparedTrace, seed: int, *, exact: bool = False
    ) -> None:
        super().__init__(cluster, trace, seed, exact=exact)
        self.control = HierarchicalControlPlane(cluster.sc, cluster, exact=exact)
        if len(trace):
            self.control.start(int(trace.arrival_ms[0]))
        self.handovers = 0  # decisions that left the ingress's own site
        self.site_decisions = [0] * len(cluster.sc.sites)  # by the site's own C-PS
        self.bounces = 0  # handed back to the ingress's site: the chosen site was busy
        self.sticky = 0  # left on the prefix holder though another looked a bit faster
        self.kept_home = 0  # a remote site looked better, but not by the margin
        self.carried_pulls = 0  # the site C-PS took the ingress's pull from another site

    def choose(self, r: int, t: int) -> Choice:
        """Both levels at once: the request reaches its site's C-PS at `t` (the routed
        model, where a request joins its queue the moment it is routed)."""
        out = self.route(r, t)
        while isinstance(out, Handoff):
            out = self.arrive(r, out)
        return out

    def route(self, r: int, t: int) -> Choice | Handoff:
        """The ingress's C-PS picks the site. Its own site's C-PS, in the same box,
        places the request at once; another site's places it when it arrives there
        (`Handoff`: at once in the routed model, one one-way delay later in the
        physical one)."""
        control = self.control
        assert isinstance(control, HierarchicalControlPlane)
        sc = self.cluster.sc
        x = int(self.trace.ingress[r])
        req = self.trace.requests[r]
        ingress = control.selectors[x]
        try:
            top = ingress.decide(
                Request(CS_ID, self.trace.keys[r], req.input_length, self._nodes[x]), t
            )
        except NoInstanceError:
            return self._fallback(x, t)
        self.last_decision = top
        s = int(self.cluster.site[self._index[top.chosen.address]])
        margin = sc.remote_margin_ms
        if s != x and margin > 0:
            # what the ingress knows of a remote site is a WAN delay and an update
            # interval old; stay home unless the remote site is better by the margin
            home = self._site_pick(x, r, t, dry=True)
            if home is not None and home.total_ms <= top.chosen.total_ms + margin:
                s = x
                self.kept_home += 1
        if s == x:
            return self._place(r, t, t, x, top.chosen)
        physical = sc.physical_arrival
        floor = self._floor(x, t) if sc.overflow_signal else 0.0
        home_ms = None
        if physical and sc.site_bounce:  # the ingress's view of home travels along
            pick = self._site_pick(x, r, t, dry=True)
            home_ms = None if pick is None else pick.total_ms
        at = t + sc.rtt(sc.sites[x], sc.sites[s]) / 2 if physical else float(t)
        return Handoff(s, at, t, top.chosen, floor, home_ms)

    def arrive(self, r: int, h: Handoff) -> Choice | Handoff:
        """Site `h.site`'s C-PS places a request from another ingress on arrival; if its
        real queues make it slower than the ingress's own site even after the detour
        back, it hands the request back (`site_bounce`)."""
        control = self.control
        assert isinstance(control, HierarchicalControlPlane)
        sc = self.cluster.sc
        x, s, top = int(self.trace.ingress[r]), h.site, h.top
        assert top is not None  # the two-level decision always hands its winner along
        now = int(h.at_ms)
        if h.bounced:
            return self._place(r, h.sent_ms, now, x, top, extra=h.extra_rtt_ms, bounced=True)
        if h.floor_ms > 0:
            self._signal(x, s, h.floor_ms - (h.at_ms - h.sent_ms), now)
        chosen = self._site_pick(s, r, now, carried=self._carried(s, top))
        if chosen is None:
            return self._fallback(s, now)
        if sc.site_bounce:
            # Site s's C-PS sees its real queue; if that makes it slower than the
            # ingress's own site even after going back there (the detour x -> s -> x),
            # it hands the request back. The ingress preferred s over its own site on the
            # same (fresh) home state, so only a request worse than the ingress expected
            # can be slower: the home site's C-PS is asked only then.
            detour = sc.rtt(sc.sites[x], sc.sites[s])
            seen = chosen.total_ms - chosen.rtt_ms + top.rtt_ms
            if seen > top.total_ms + detour:
                if h.home_ms is not None:
                    home_ms: float | None = h.home_ms
                else:
                    home = self._site_pick(x, r, now, dry=True)
                    home_ms = None if home is None else home.total_ms
                if home_ms is not None and seen > home_ms + detour:
                    control.local_selectors[s].forget_last(CS_ID, chosen.address)
                    self.bounces += 1
                    back = dataclasses.replace(
                        h, site=x, at_ms=h.at_ms + (h.at_ms - h.sent_ms), bounced=True
                    )
                    return dataclasses.replace(back, extra_rtt_ms=detour)
        return self._record(r, h.sent_ms, now, x, s, top, chosen, 0.0)

    def _place(
        self,
        r: int,
        sent: int,
        now: int,
        s: int,
        top: Estimate,
        *,
        extra: float = 0.0,
        bounced: bool = False,
    ) -> Choice:
        """Site s's C-PS places request r now: the ingress's own site (at once, or a
        request handed back to it)."""
        chosen = self._site_pick(s, r, now, carried=None if bounced else self._carried(s, top))
        if chosen is None:
            return self._fallback(s, now)
        return self._record(r, sent, now, int(self.trace.ingress[r]), s, top, chosen, extra)

    def _record(
        self,
        r: int,
        sent: int,
        now: int,
        x: int,
        s: int,
        top: Estimate,
        chosen: Estimate,
        extra: float,
    ) -> Choice:
        """Count the placement (site s's box, the ingress's log) and name the instance."""
        control = self.control
        assert isinstance(control, HierarchicalControlPlane)
        self.handovers += s != x
        self.site_decisions[s] += 1
        if s == x:
            # the ingress's own site placed it: that C-PS's note replaces the ingress's
            # count of its own decision
            ingress = control.selectors[x]
            if now == sent:
                ingress.forget_last(CS_ID, top.address)
            else:  # handed back: later work may have been counted there since
                table = ingress.rib.services[CS_ID]
                tps = table.prefill_tps[table.by_address[top.address].slot]
                work = (top.prefill_ms + top.fetch_ms) / 1000 * tps
                ingress.forget(CS_ID, top.address, sent, work)
        box = control.selectors[s]  # the C-PS box at site s also steers from its ingress
        box.note(CS_ID, chosen.address, now, self._tokens(s, chosen))
        source = chosen.kv_source
        return Choice(
            self._index[chosen.address],
            None if source is None else self._index[source],
            chosen.cached_blocks,
            extra_rtt_ms=extra,
            work_ms=chosen.prefill_ms + chosen.fetch_ms,
        )

    def _carried(self, s: int, wanted: Estimate) -> CarriedPull | None:
        """The ingress's winner `wanted` pulls its prefix from another site's instance:
        that source, and what the ingress priced the pull and the remaining prefill at,
        travel with the request to site s's C-PS, whose RIB holds only its own site
        (None: no pull, or one from site s itself, which that C-PS prices on its own)."""
        if not (self.cluster.sc.remote_kv and self.carry_source):
            return None
        src = wanted.kv_source
        if src is None or src not in self._index:
            return None
        if int(self.cluster.site[self._index[src]]) == s:
            return None
        return CarriedPull(src, wanted.fetch_ms, wanted.prefill_ms)

    def _floor(self, x: int, t: int) -> float:
        """The least queue among ingress x's own instances at t (x's box knows it
        exactly): the overflow signal a request sent away carries."""
        control = self.control
        assert isinstance(control, HierarchicalControlPlane)
        local = control.local_selectors[x]
        home = control.local_ribs[x].services.get(CS_ID)
        if home is None:
            return 0.0
        return min(local.queued_ms(CS_ID, a, t) for a in home.by_address)

    def _signal(self, x: int, s: int, floor: float, t: int) -> None:
        """A request ingress x sent to site s says how busy x's own site is: `floor`,
        its least queue there, drained to t. Site s's box takes it as a floor for each
        route by which it knows x (`_routes_of_site`), so its own ingress does not send
        work back into a site that is itself sending work away."""
        control = self.control
        assert isinstance(control, HierarchicalControlPlane)
        home = control.local_ribs[x].services.get(CS_ID)
        box = control.selectors[s]
        table = box.rib.services.get(CS_ID)
        if home is None or table is None or floor <= 0:
            return
        for address in self._routes_of_site(x, home):
            inst = table.by_address.get(address)
            if inst is None:
                continue
            gap = floor - box.queued_ms(CS_ID, address, t)
            if gap > 0:
                box.note(CS_ID, address, t, gap * float(table.prefill_tps[inst.slot]) / 1000)

    def _routes_of_site(self, x: int, home: ServiceTable) -> Iterable[object]:
        """The addresses by which other sites' boxes know site x: its instances."""
        return home.by_address

    def _site_pick(
        self,
        s: int,
        r: int,
        t: int,
        *,
        dry: bool = False,
        carried: CarriedPull | None = None,
    ) -> Estimate | None:
        """Site s's C-PS places request r (`dry`: only says where, records nothing),
        offered the ingress's pull from another site if `carried` (one `decide`). The
        sticky margin applies to the site's own choice: a carried pull that beat it
        stands, and one that beats the holder the margin kept goes in its place (the
        order of the rules before the selector priced the pull; the margin over the
        carried pull too was measured, docs/evaluation.md decision 8, and not kept)."""
        control = self.control
        assert isinstance(control, HierarchicalControlPlane)
        local = control.local_selectors[s]
        req = self.trace.requests[r]
        try:
            d = local.decide(
                Request(CS_ID, self.trace.keys[r], req.input_length, self._nodes[s], carried),
                t,
            )
        except NoInstanceError:
            return None
        chosen, ru = d.chosen, d.runner_up
        pull = d.carried  # the ingress's pull from another site, at its best instance here
        took = pull is not None and chosen is pull
        margin = self.cluster.sc.site_sticky_ms
        if (
            margin > 0
            and not took  # a carried pull that beat the site's own best stands
            and ru is not None
            and ru.cached_blocks > chosen.cached_blocks
            and ru.total_ms <= chosen.total_ms + margin
        ):  # keep the prefix where it is rather than copying it
            local.forget_last(CS_ID, chosen.address)
            local.note(CS_ID, ru.address, t, self._tokens(s, ru))
            chosen = ru
            self.sticky += 1
            if pull is not None and pull.total_ms < ru.total_ms:
                # the carried pull still beats the holder kept: it goes there instead
                local.forget_last(CS_ID, ru.address)
                local.note(CS_ID, pull.address, t, self._tokens(s, pull))
                chosen, took = pull, True
        self.carried_pulls += took
        if dry:
            local.forget_last(CS_ID, chosen.address)
        return chosen

    def _tokens(self, s: int, est: Estimate) -> float:
        """The work `est` puts on its instance: its prefill, and a fetch or pull, which
        keeps the instance busy as long (0 in single-tier scenarios without pulls)."""
        return (est.prefill_ms + est.fetch_ms) / 1000 * self._tps(s, est.address)

    def _tps(self, s: int, address: object) -> float:
        table = self.control.local_ribs[s].services[CS_ID]
        return float(table.prefill_tps[table.by_address[address].slot])  # type: ignore[index]

    def _fallback(self, s: int, t: int) -> Choice:
        self.fallbacks += 1
        cl = self.cluster
        here = np.nonzero(cl.site == s)[0]
        return Choice(self._least(t, here, cl.waits(t)[here]), fallback=True)

    def view(self, ingress: int, instance: int) -> frozenset[int]:
        """What the deciding C-PS's summaries said about `instance` (its site's C-PS)."""
        return self.control.views[self.cluster.sc.site_of(instance)][instance]
