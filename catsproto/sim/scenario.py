"""Scenarios: sites, round trips, instances, caches, prefill rate and the control plane.

Strategy. A scenario is a plain nested mapping (JSON or TOML in a file, read by an
adapter) turned into frozen dataclasses here, after `apply_overrides` has replaced any
value by dotted path (``prefill_tps=40000``, ``tiers.hbm.capacity_blocks=500``,
``rtt_ms.A-D=30``). Every number the simulation uses lives in the scenario; nothing is
hidden in code. Pure: no file access.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from catsproto.node import ModelShape
from catsproto.summary import Summary
from catsproto.summary.base import unique_keys
from catsproto.wire import Tier

__all__ = [
    "SEED_MAX",
    "Scenario",
    "ScenarioError",
    "TierConfig",
    "apply_overrides",
    "parse_value",
]


SEED_MAX = (1 << 64) - 1  # the u64 seed field of a summary filter
_U32 = 0xFFFF_FFFF  # a u32 field of the wire: block size, bytes per block, a tier's costs
# The simulator's address plan (catsproto/sim/control.py, aggregate.py): instance j of
# site s is 10.(s+1).0.(j+1), instance i's shard routes 10.255.i.0/24, and 10.254.*
# holds the sites' own shard routes.
_MAX_SITES = 253
_MAX_INSTANCES_PER_SITE = 255
_MAX_SHARDED_INSTANCES = 256


class ScenarioError(ValueError):
    """A scenario or override that cannot be used; the message names the key."""


@dataclass(frozen=True)
class TierConfig:
    """One cache tier of every instance: capacity and the cost of fetching from it."""

    tier: Tier
    capacity_blocks: int
    fetch_latency_us: int
    fetch_bandwidth_mbps: int


@dataclass(frozen=True)
class Scenario:
    """Everything a simulation run needs besides the trace and the policy."""

    name: str
    sites: tuple[str, ...]
    rtt_ms: Mapping[tuple[str, str], float]  # symmetric; (x, x) is the intra-site RTT
    instances_per_site: int
    tiers: tuple[TierConfig, ...]  # fastest first
    block_tokens: int
    prefill_tps: float
    bytes_per_block: int
    link_bandwidth_mbps: float  # between sites, for KV pulls
    remote_kv: bool  # may an instance pull a prefix from another instance?
    ingress_index: int  # which hash_id picks the ingress site (min(this, len-1))
    speedup: float
    update_interval_ms: int  # dampening minimum interval; 0: advertise before every request
    refresh_interval_ms: int  # dampening maximum interval
    change_threshold: float  # dampening: fraction of advertised keys changed
    score_threshold: int  # dampening: an L1/L2 score moved by this many points (0..10)
    wait_threshold_ms: float  # dampening: queue wait off the receivers' prediction by this
    main_on_summary_change: bool  # False: a summary change alone re-sends only its shards
    per_hop_ms: float  # BGP processing per hop, added to the link delay
    propagation: bool  # False: advertisements reach every selector at once (zero delay)
    selector_site: str | None  # None: a C-PS at every ingress site; else one shared C-PS
    decision_rtt: bool  # a shared C-PS: add the ingress's query round trip to it to TTFT
    sharded: bool  # summaries on shard routes of their own (metrics-only main route)
    target_fpr: float
    summary_kind: int | None  # None: smallest; 1 exact, 2 Bloom, 3 fuse
    snapshot_every: int
    max_message_bytes: int
    hot_prefixes: int
    request_bytes_per_token: float  # upload term of the selector; 0 leaves it out
    selector_spread_ms: float  # selector's near-equal margin (power of two choices); 0: off
    selector_peers: bool  # each C-PS counts its own recent decisions once per C-PS
    price_evictions: bool  # selectors price what a placement evicts (selector.occupancy)
    reuse_horizon_ms: float  # ... valuing an evicted block by exp(-its LRU age / this)
    site_dispatch: bool  # ingress C-PS picks the site, the site's own C-PS the instance
    site_sticky_ms: float  # site C-PS: keep a prefix on its holder if within this margin
    site_bounce: bool  # site C-PS: hand a request back to its ingress's site if faster
    shortest_first: str  # "none", "catsproto" or "all": whose dispatch sends a
    # millisecond's requests for one instance least work first (FCFS among them otherwise)
    remote_margin_ms: float  # ingress: a remote site must beat its own site by this much
    overflow_signal: bool  # a request sent away carries its ingress site's least queue
    arrival_spread: str  # "none", "even" or "random": how a shared timestamp's requests arrive
    physical_arrival: bool  # a request joins its queue one one-way delay after it is routed
    seed: int
    secret: bytes
    model_id: str

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Scenario:
        """Validate a nested mapping (a parsed scenario file with overrides applied)."""
        _require_mapping(raw)
        d = dict(raw)
        try:
            sites = _sites(d["sites"])
            _require_mapping(d["rtt_ms"], "rtt_ms")
            rtt = _rtt_table(sites, d["rtt_ms"], _real(d, "intra_site_rtt_ms", 1.0))
            _require_mapping(d["tiers"], "tiers")
            tiers = _tiers(d["tiers"])
            block = _whole(d, "block_tokens", 512, low=1, high=_U32)
            model = d.get("model")
            if model is not None:
                _require_mapping(model, "model")
                shape = ModelShape(
                    _whole(model, "layers", None, low=1, where="model."),
                    _whole(model, "kv_heads", None, low=1, where="model."),
                    _whole(model, "head_dim", None, low=1, where="model."),
                    _whole(model, "dtype_bytes", None, low=1, where="model."),
                    block,
                )
                bytes_per_block = shape.bytes_per_block
                if bytes_per_block > _U32:
                    raise ScenarioError(
                        "model.layers x kv_heads x head_dim x 2 x dtype_bytes x block_tokens "
                        f"= {bytes_per_block} bytes per block, above {_U32} (a u32 on the wire)"
                    )
                model_id = _text(model, "id", "model", low=1, high=255, where="model.")
            else:
                bytes_per_block = _whole(d, "bytes_per_block", 0, high=_U32)
                model_id = _text(d, "model_id", "model", low=1, high=255)
            kind = d.get("summary_kind")
            sc = cls(
                name=_text(d, "name", "scenario"),
                sites=sites,
                rtt_ms=rtt,
                instances_per_site=_whole(
                    d, "instances_per_site", None, low=1, high=_MAX_INSTANCES_PER_SITE
                ),
                tiers=tiers,
                block_tokens=block,
                prefill_tps=_real(d, "prefill_tps", None, positive=True),
                bytes_per_block=bytes_per_block,
                link_bandwidth_mbps=_real(d, "link_bandwidth_mbps", 100_000, positive=True),
                remote_kv=_flag(d, "remote_kv", False),
                ingress_index=_whole(d, "ingress_index", 1),
                speedup=_real(d, "speedup", 1.0, positive=True),
                update_interval_ms=_whole(d, "update_interval_ms", 1000),
                refresh_interval_ms=_whole(d, "refresh_interval_ms", 30_000, low=1),
                change_threshold=_real(d, "change_threshold", 0.05),
                score_threshold=_whole(d, "score_threshold", 1, low=1),
                wait_threshold_ms=_real(d, "wait_threshold_ms", 100.0, positive=True, inf=True),
                main_on_summary_change=_flag(d, "main_on_summary_change", True),
                per_hop_ms=_real(d, "per_hop_ms", 1.0),
                propagation=_flag(d, "propagation", True),
                sharded=_flag(d, "sharded", True),
                selector_site=_optional_site(d.get("selector_site"), sites),
                decision_rtt=_flag(d, "decision_rtt", True),
                target_fpr=_real(d, "target_fpr", 0.01, below=1),
                summary_kind=_summary_kind(kind),
                snapshot_every=_whole(d, "snapshot_every", 8, low=1),
                max_message_bytes=_whole(d, "max_message_bytes", 4096, low=1, high=65535),
                hot_prefixes=_whole(d, "hot_prefixes", 0),
                request_bytes_per_token=_real(d, "request_bytes_per_token", 0.0),
                selector_spread_ms=_real(d, "selector_spread_ms", 0.0),
                selector_peers=_flag(d, "selector_peers", False),
                price_evictions=_flag(d, "price_evictions", True),
                reuse_horizon_ms=_real(d, "reuse_horizon_ms", 120_000.0, positive=True),
                site_dispatch=_flag(d, "site_dispatch", False),
                site_sticky_ms=_real(d, "site_sticky_ms", 0.0),
                site_bounce=_flag(d, "site_bounce", False),
                shortest_first=_shortest_first(d.get("shortest_first", "none")),
                remote_margin_ms=_real(d, "remote_margin_ms", 0.0),
                overflow_signal=_flag(d, "overflow_signal", False),
                arrival_spread=_spread(d.get("arrival_spread", False)),
                physical_arrival=_flag(d, "physical_arrival", False),
                seed=_seed(d.get("seed", 1)),
                secret=_text(d, "secret", "catsproto-eval-secret-0001", low=16, high=64).encode(),
                model_id=model_id,
            )
        except KeyError as exc:
            raise ScenarioError(f"scenario lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ScenarioError):
                raise
            raise ScenarioError(f"scenario: {exc}") from None
        sc.validate()
        return sc

    def validate(self) -> None:
        """The rules across keys, and again those of single keys for a `Scenario` made
        without `from_mapping`; each message names the key and the value."""
        if not 1 <= self.instances_per_site <= _MAX_INSTANCES_PER_SITE:
            raise ScenarioError(
                f"instances_per_site {self.instances_per_site} is not 1..{_MAX_INSTANCES_PER_SITE}"
            )
        if len(self.sites) > _MAX_SITES:
            raise ScenarioError(
                f"sites: {len(self.sites)} sites, the simulator's address plan has room "
                f"for {_MAX_SITES}"
            )
        if self.sharded and self.n_instances > _MAX_SHARDED_INSTANCES:
            raise ScenarioError(
                f"sharded: {len(self.sites)} sites x instances_per_site "
                f"{self.instances_per_site} = {self.n_instances} instances, but shard "
                f"routes (10.255.i.0/24) number at most {_MAX_SHARDED_INSTANCES}; "
                "fewer instances or sharded = false"
            )
        for key in ("prefill_tps", "speedup"):
            value = getattr(self, key)
            if not 0 < value < math.inf:  # NaN too
                raise ScenarioError(f"{key} {value!r} is not a finite number > 0")
        if self.block_tokens < 1:
            raise ScenarioError(f"block_tokens {self.block_tokens} is not >= 1")
        if self.update_interval_ms < 0 or self.refresh_interval_ms <= 0:
            raise ScenarioError(
                f"update_interval_ms {self.update_interval_ms} must be >= 0, "
                f"refresh_interval_ms {self.refresh_interval_ms} > 0"
            )
        if self.update_interval_ms > self.refresh_interval_ms:
            raise ScenarioError(
                f"update_interval_ms {self.update_interval_ms} exceeds refresh_interval_ms "
                f"{self.refresh_interval_ms}: the least time between updates must not be "
                "above the most"
            )
        if not 0 <= self.target_fpr < 1:
            raise ScenarioError(f"target_fpr {self.target_fpr!r} is not in [0, 1)")
        # can the named kind meet the rate at all (Bloom needs > 0, fuse a rate its
        # fingerprints reach, 1e-9 but not 1e-12)? The number of keys does not matter.
        if self.summary_kind is not None and self.summary_kind not in Summary.estimates(
            unique_keys([1]), self.target_fpr
        ):
            kind = {code: name for name, code in _KIND_NAMES.items()}[self.summary_kind]
            raise ScenarioError(
                f"summary_kind {kind} cannot meet target_fpr {self.target_fpr!r} "
                "(exact meets every rate; auto picks a kind that meets it)"
            )
        first = self.tiers[0]
        if first.capacity_blocks < 1:
            raise ScenarioError(
                f"tiers.{first.tier.name.lower()}.capacity_blocks {first.capacity_blocks}: "
                "the first tier needs room for at least one block"
            )
        if self.bytes_per_block > 0:
            for t in self.tiers:
                # HBM is never fetched from (it is where a prefix is used); a pull
                # (remote_kv) reads from any tier
                used = t.tier is not Tier.HBM or self.remote_kv
                if used and t.fetch_bandwidth_mbps == 0:
                    raise ScenarioError(
                        f"tiers.{t.tier.name.lower()}.fetch_bandwidth_mbps 0 with "
                        f"bytes_per_block {self.bytes_per_block}: a fetch or pull from it "
                        "would never end; give it >= 1 (or bytes_per_block 0)"
                    )
        if not 0 <= self.seed <= SEED_MAX:
            raise ScenarioError(f"seed {self.seed} outside 0..{SEED_MAX}")
        if len(self.secret) < 16 or len(self.secret) > 64:
            raise ScenarioError(f"secret is {len(self.secret)} bytes, not 16..64")
        if self.site_dispatch and self.selector_peers and self.selector_site is None:
            raise ScenarioError(
                "selector_peers applies to the flat selector only: the two-level decision "
                "(site_dispatch) counts the work each site's C-PS sent, which is complete"
            )

    # ---- derived -----------------------------------------------------------------------

    @property
    def n_instances(self) -> int:
        return len(self.sites) * self.instances_per_site

    def site_of(self, instance: int) -> int:
        return instance // self.instances_per_site

    def rtt(self, a: str, b: str) -> float:
        return self.rtt_ms[(a, b)]

    def rtt_matrix(self) -> list[list[float]]:
        return [[self.rtt(a, b) for b in self.sites] for a in self.sites]

    def instance_names(self) -> list[str]:
        return [f"{s}{j + 1}" for s in self.sites for j in range(self.instances_per_site)]

    def to_json(self) -> dict[str, Any]:
        pairs = {}
        for i, a in enumerate(self.sites):
            for b in self.sites[i + 1 :]:
                pairs[f"{a}-{b}"] = self.rtt(a, b)
        return {
            "name": self.name,
            "sites": list(self.sites),
            "rtt_ms": pairs,
            "intra_site_rtt_ms": self.rtt(self.sites[0], self.sites[0]),
            "instances_per_site": self.instances_per_site,
            "tiers": {
                t.tier.name.lower(): {
                    "capacity_blocks": t.capacity_blocks,
                    "fetch_latency_us": t.fetch_latency_us,
                    "fetch_bandwidth_mbps": t.fetch_bandwidth_mbps,
                }
                for t in self.tiers
            },
            "block_tokens": self.block_tokens,
            "prefill_tps": self.prefill_tps,
            "bytes_per_block": self.bytes_per_block,
            "link_bandwidth_mbps": self.link_bandwidth_mbps,
            "remote_kv": self.remote_kv,
            "speedup": self.speedup,
            "update_interval_ms": self.update_interval_ms,
            "refresh_interval_ms": self.refresh_interval_ms,
            "change_threshold": self.change_threshold,
            "score_threshold": self.score_threshold,
            "wait_threshold_ms": self.wait_threshold_ms,
            "main_on_summary_change": self.main_on_summary_change,
            "per_hop_ms": self.per_hop_ms,
            "propagation": self.propagation,
            "sharded": self.sharded,
            "selector_site": self.selector_site or "ingress",
            "decision_rtt": self.decision_rtt,
            "target_fpr": self.target_fpr,
            "summary_kind": self.summary_kind,
            "snapshot_every": self.snapshot_every,
            "max_message_bytes": self.max_message_bytes,
            "hot_prefixes": self.hot_prefixes,
            "request_bytes_per_token": self.request_bytes_per_token,
            "selector_spread_ms": self.selector_spread_ms,
            "selector_peers": self.selector_peers,
            "price_evictions": self.price_evictions,
            "reuse_horizon_ms": self.reuse_horizon_ms,
            "site_dispatch": self.site_dispatch,
            "site_sticky_ms": self.site_sticky_ms,
            "site_bounce": self.site_bounce,
            "shortest_first": self.shortest_first,
            "remote_margin_ms": self.remote_margin_ms,
            "overflow_signal": self.overflow_signal,
            "arrival_spread": self.arrival_spread,
            "physical_arrival": self.physical_arrival,
            "seed": self.seed,
            "model_id": self.model_id,
        }


_KIND_NAMES = {"exact": 1, "bloom": 2, "fuse": 3}


def _require_mapping(raw: object, key: str = "") -> None:
    if not isinstance(raw, Mapping):
        what = key or "a scenario"
        raise ScenarioError(
            f"{what} must be a mapping (a TOML table or JSON object), not {type(raw).__name__}"
        )


def _whole(
    d: Mapping[str, Any],
    key: str,
    default: int | None,
    *,
    low: int = 0,
    high: int | None = None,
    where: str = "",
) -> int:
    """An integer key (a whole float such as 4096.0 counts) in low..high; a boolean, a
    string, a fraction or a value out of range is refused naming the key. `default`
    None: the key is required."""
    value = d[key] if default is None else d.get(key, default)
    name = where + key
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{name} must be an integer, not {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise ScenarioError(f"{name} {value} is not {allowed}")
    return value


def _real(
    d: Mapping[str, Any],
    key: str,
    default: float | None,
    *,
    positive: bool = False,
    inf: bool = False,
    below: float | None = None,
) -> float:
    """A number key, >= 0 (> 0 if `positive`) and under `below` if given, finite unless
    `inf` (there infinity means "never"); NaN, a boolean or a string is refused naming
    the key. `default` None: the key is required."""
    value = d[key] if default is None else d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"{key} must be a number, not {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an integer beyond any float
        v = math.inf
    if (
        math.isnan(v)
        or (v == math.inf and not inf)
        or not (v > 0 if positive else v >= 0)
        or (below is not None and not v < below)
    ):
        allowed = "> 0" if positive else ">= 0"
        finite = "" if inf else "finite "
        under = f" and below {below:g}" if below is not None else ""
        raise ScenarioError(f"{key} {value!r} is not a {finite}number {allowed}{under}")
    return v


def _text(
    d: Mapping[str, Any],
    key: str,
    default: str | None,
    *,
    low: int = 0,
    high: int | None = None,
    where: str = "",
) -> str:
    """A text key of low..high bytes of UTF-8. A number is taken as its text (``--set
    name=2024`` reads 2024 as a number); a boolean, a list or a table is refused."""
    value = d[key] if default is None else d.get(key, default)
    name = where + key
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ScenarioError(f"{name} must be text, not {value!r}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate, from JSON's \ud800
        raise ScenarioError(f"{name} is not UTF-8 text") from None
    if size < low or (high is not None and size > high):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise ScenarioError(f"{name} is {size} bytes of UTF-8, not {allowed}")
    return value


def _flag(d: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean key: true or false (a TOML or JSON boolean) and nothing else, so that
    ``--set sharded=False`` (a string) or ``=0`` is refused instead of read as true."""
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ScenarioError(f"{key} must be true or false, not {value!r}")
    return value


def _seed(value: Any) -> int:
    """The scenario seed: it seeds the summary filters as their u64 seed field (and,
    through a hash, the signing keys and the selectors' tie-breaks), so 0..2^64-1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ScenarioError(f"seed must be an integer 0..{SEED_MAX}, not {value!r}")
    if not 0 <= value <= SEED_MAX:
        raise ScenarioError(f"seed {value} outside 0..{SEED_MAX}")
    return value


def _summary_kind(value: Any) -> int | None:
    """None (the smallest meeting the FPR) for "auto", else 1 / 2 / 3 by code or name."""
    if value in (None, "auto"):
        return None
    text = str(value).strip().lower()
    kind = _KIND_NAMES.get(text, int(text) if text.isdigit() else 0)
    if kind not in (1, 2, 3):
        raise ScenarioError(f"summary_kind {value!r} is not auto, exact, bloom, fuse or 1..3")
    return kind


def _shortest_first(value: Any) -> str:
    """Whose dispatch orders the requests of one millisecond for one instance by the work
    it expects of them, least first: "none" (FCFS in trace order), "catsproto" (the site
    C-PS of the two-level decision) or "all" (every policy, by its own estimate)."""
    if value is None or value is False:
        return "none"
    text = value.lower() if isinstance(value, str) else None
    if text in ("none", "catsproto", "all"):
        return text
    raise ScenarioError(f"shortest_first {value!r} is not none, catsproto or all")


def _spread(value: Any) -> str:
    """How requests sharing a trace timestamp arrive: "none" (at once; false), "even"
    (evenly until the next timestamp, in trace order; true) or "random" (uniformly at
    random over that time, so in random order too; a fixed seed, the same every run)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "even"
    text = value.lower() if isinstance(value, str) else None
    if text in ("none", "false"):
        return "none"
    if text in ("even", "true"):
        return "even"
    if text == "random":
        return "random"
    raise ScenarioError(f"arrival_spread {value!r} is not false, true, even or random")


def _sites(value: Any) -> tuple[str, ...]:
    """Distinct site names, at least one: each non-empty text without "-" (an rtt_ms key
    is X-Y) and not "ingress" (what selector_site says for a C-PS at every ingress)."""
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
        raise ScenarioError(f"sites must be a list of names, not {value!r}")
    for site in value:
        if not site or "-" in site or site == "ingress":
            raise ScenarioError(
                f"sites: {site!r} is not a site name (not empty, no '-', not 'ingress')"
            )
    if len(set(value)) != len(value) or not value:
        raise ScenarioError(f"sites must be distinct and not empty, not {value!r}")
    if len(value) > _MAX_SITES:
        raise ScenarioError(
            f"sites: {len(value)} sites, the simulator's address plan has room for {_MAX_SITES}"
        )
    return tuple(value)


def _optional_site(value: Any, sites: Sequence[str]) -> str | None:
    if value in (None, "", "ingress"):
        return None
    if str(value) not in sites:
        raise ScenarioError(f"selector_site {value!r} is not 'ingress' or one of {list(sites)}")
    return str(value)


def _rtt_table(
    sites: Sequence[str], pairs: Mapping[str, Any], intra: float
) -> dict[tuple[str, str], float]:
    table: dict[tuple[str, str], float] = {(s, s): intra for s in sites}
    for name, value in pairs.items():
        a, sep, b = str(name).partition("-")
        if not sep or a not in sites or b not in sites or a == b:
            raise ScenarioError(f"rtt_ms key {name!r} is not 'X-Y' for two distinct sites")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ScenarioError(f"rtt_ms {name} must be a finite number >= 0, not {value!r}")
        try:
            v = float(value)
        except OverflowError:  # an integer beyond any float
            v = math.inf
        if v < 0 or not math.isfinite(v):
            raise ScenarioError(f"rtt_ms {name} must be a finite number >= 0, not {value!r}")
        table[(a, b)] = table[(b, a)] = v
    for a in sites:
        for b in sites:
            if (a, b) not in table:
                raise ScenarioError(f"rtt_ms lacks {a}-{b}")
    return table


def _tiers(raw: Mapping[str, Any]) -> tuple[TierConfig, ...]:
    out: list[TierConfig] = []
    for name, spec in raw.items():
        try:
            tier = Tier[str(name).upper()]
        except KeyError:
            raise ScenarioError(f"unknown tier {name!r} (hbm, dram, ssd, remote)") from None
        if any(t.tier is tier for t in out):
            raise ScenarioError(f"tiers: {name!r} names the {tier.name} tier a second time")
        where = f"tiers.{name}."
        _require_mapping(spec, where[:-1])
        out.append(
            TierConfig(
                tier,
                _whole(spec, "capacity_blocks", None, where=where),
                _whole(spec, "fetch_latency_us", 0, high=_U32, where=where),
                _whole(spec, "fetch_bandwidth_mbps", 0, high=_U32, where=where),
            )
        )
    out.sort(key=lambda t: t.tier)
    if not out:
        raise ScenarioError("tiers: a scenario needs at least one tier")
    return tuple(out)


def parse_value(text: str) -> Any:
    """An override's value: JSON if it parses (numbers, true, null, lists), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `raw` with each ``dotted.key=value`` applied; the key must exist, except
    a new tier, RTT pair or model field, which may be added."""
    _require_mapping(raw)
    out = copy.deepcopy(dict(raw))
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path:
            raise ScenarioError(f"override {item!r} is not key=value")
        parts = path.split(".")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if not isinstance(nxt, dict):
                if isinstance(node, dict) and part not in node and i == 0 and part == "model":
                    nxt = node[part] = {}
                else:
                    raise ScenarioError(
                        f"override {path!r}: {'.'.join(parts[: i + 1])} is not a table"
                    )
            node = nxt
        last = parts[-1]
        growable = len(parts) >= 2 and parts[0] in ("rtt_ms", "tiers", "model")
        if last not in node and not growable and not (len(parts) == 1 and last in _OPTIONAL):
            raise ScenarioError(f"override {path!r}: no such key in the scenario")
        node[last] = parse_value(text)
    return out


_OPTIONAL = {
    "name",
    "intra_site_rtt_ms",
    "block_tokens",
    "bytes_per_block",
    "link_bandwidth_mbps",
    "remote_kv",
    "ingress_index",
    "speedup",
    "update_interval_ms",
    "refresh_interval_ms",
    "change_threshold",
    "score_threshold",
    "wait_threshold_ms",
    "main_on_summary_change",
    "per_hop_ms",
    "propagation",
    "sharded",
    "selector_site",
    "decision_rtt",
    "target_fpr",
    "summary_kind",
    "snapshot_every",
    "max_message_bytes",
    "hot_prefixes",
    "request_bytes_per_token",
    "selector_spread_ms",
    "selector_peers",
    "price_evictions",
    "reuse_horizon_ms",
    "site_dispatch",
    "site_sticky_ms",
    "site_bounce",
    "shortest_first",
    "remote_margin_ms",
    "overflow_signal",
    "arrival_spread",
    "physical_arrival",
    "seed",
    "secret",
    "model_id",
    "model",
}
