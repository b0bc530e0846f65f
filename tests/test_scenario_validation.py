"""The scenario loader refuses every bad value with a ScenarioError naming the key.

Each case takes a shipped scenario (S1, or llama70b where the key is its own: the
`[model]` table, pulls), sets one key to a bad value as a scenario file or `eval --set`
would, and loads it; the message must name the key and say what is wrong. Every key the
loader reads has a case (the key walk of test_scenario_reference.py finds them). The
shipped scenarios themselves must still load, and the edge values that mean something
(0 where the docs say what 0 does, infinity where it means "never") too."""

from __future__ import annotations

import math
from typing import Any

import pytest

from catsproto.adapters.trace import SCENARIO_DIR, load_scenario
from catsproto.sim import Scenario, ScenarioError, TraceRequest, apply_overrides
from tests.test_scenario_reference import LOADER, loader_keys

U32 = 0xFFFF_FFFF
L70 = "llama70b"  # the shipped file with a [model] table, two tiers and pulls


def with_values(scenario: str, /, **paths: Any) -> dict[str, Any]:
    """Shipped `scenario` with each dotted path set to its value (a missing table on
    the way is made): ``with_values("s1", **{"tiers.hbm.capacity_blocks": 0})``."""
    raw = load_scenario(scenario)
    for path, value in paths.items():
        node = raw
        *tables, last = path.split(".")
        for table in tables:
            node = node.setdefault(table, {})
        node[last] = value
    return raw


def test_every_shipped_scenario_loads() -> None:
    files = sorted(p for p in SCENARIO_DIR.iterdir() if p.suffix in (".toml", ".json"))
    assert {p.stem for p in files} >= {"s1", "llama70b"}
    for path in files:
        sc = Scenario.from_mapping(load_scenario(path))
        # and what it says of itself loads back the same (to_json leaves out two keys)
        again = {**sc.to_json(), "secret": sc.secret.decode(), "ingress_index": sc.ingress_index}
        assert Scenario.from_mapping(again) == sc


# (scenario, dotted key, bad value, a part of the message, which also names the key)
BAD: list[tuple[str, str, Any, str]] = [
    # ---- numbers: NaN, infinity, sign, zero where it means nothing, type
    ("s1", "prefill_tps", math.nan, "prefill_tps nan is not a finite number > 0"),
    ("s1", "prefill_tps", math.inf, "prefill_tps inf is not a finite number > 0"),
    ("s1", "prefill_tps", 0, "prefill_tps 0 is not a finite number > 0"),
    ("s1", "prefill_tps", -20000.0, "prefill_tps -20000.0 is not a finite number > 0"),
    ("s1", "prefill_tps", 10**400, "is not a finite number > 0"),  # beyond any float
    ("s1", "prefill_tps", "fast", "prefill_tps must be a number, not 'fast'"),
    ("s1", "prefill_tps", True, "prefill_tps must be a number, not True"),
    ("s1", "speedup", -1.0, "speedup -1.0 is not a finite number > 0"),
    ("s1", "speedup", math.nan, "speedup nan is not a finite number > 0"),
    ("s1", "intra_site_rtt_ms", -1.0, "intra_site_rtt_ms -1.0 is not a finite number >= 0"),
    ("s1", "intra_site_rtt_ms", math.nan, "intra_site_rtt_ms nan is not"),
    ("s1", "link_bandwidth_mbps", 0, "link_bandwidth_mbps 0 is not a finite number > 0"),
    ("s1", "link_bandwidth_mbps", -5.0, "link_bandwidth_mbps -5.0 is not"),
    ("s1", "link_bandwidth_mbps", math.inf, "link_bandwidth_mbps inf is not"),
    ("s1", "per_hop_ms", math.inf, "per_hop_ms inf is not a finite number >= 0"),
    ("s1", "per_hop_ms", -1.0, "per_hop_ms -1.0 is not"),
    ("s1", "request_bytes_per_token", -1, "request_bytes_per_token -1 is not"),
    ("s1", "request_bytes_per_token", math.nan, "request_bytes_per_token nan is not"),
    ("s1", "selector_spread_ms", -2.0, "selector_spread_ms -2.0 is not a finite number >= 0"),
    ("s1", "selector_spread_ms", math.nan, "selector_spread_ms nan is not"),
    ("s1", "reuse_horizon_ms", 0, "reuse_horizon_ms 0 is not a finite number > 0"),
    ("s1", "reuse_horizon_ms", math.inf, "reuse_horizon_ms inf is not"),
    ("s1", "site_sticky_ms", math.nan, "site_sticky_ms nan is not"),
    ("s1", "site_sticky_ms", -30.0, "site_sticky_ms -30.0 is not"),
    ("s1", "remote_margin_ms", -0.5, "remote_margin_ms -0.5 is not"),
    ("s1", "remote_margin_ms", math.inf, "remote_margin_ms inf is not"),
    ("s1", "change_threshold", -0.1, "change_threshold -0.1 is not"),
    ("s1", "change_threshold", math.nan, "change_threshold nan is not"),
    ("s1", "wait_threshold_ms", 0, "wait_threshold_ms 0 is not a number > 0"),
    ("s1", "wait_threshold_ms", math.nan, "wait_threshold_ms nan is not a number > 0"),
    ("s1", "wait_threshold_ms", -math.inf, "wait_threshold_ms -inf is not a number > 0"),
    ("s1", "target_fpr", math.nan, "target_fpr nan is not"),
    ("s1", "target_fpr", 1.0, "target_fpr 1.0 is not a finite number >= 0 and below 1"),
    ("s1", "target_fpr", -0.01, "target_fpr -0.01 is not"),
    # ---- integers: sign, zero, fractions, booleans, text, range
    ("s1", "ingress_index", -1, "ingress_index -1 is not >= 0"),
    ("s1", "ingress_index", 1.5, "ingress_index must be an integer, not 1.5"),
    ("s1", "ingress_index", True, "ingress_index must be an integer, not True"),
    ("s1", "snapshot_every", 0, "snapshot_every 0 is not >= 1"),
    ("s1", "snapshot_every", -8, "snapshot_every -8 is not >= 1"),
    ("s1", "score_threshold", 0, "score_threshold 0 is not >= 1"),
    ("s1", "score_threshold", 11.5, "score_threshold must be an integer, not 11.5"),
    ("s1", "refresh_interval_ms", 0, "refresh_interval_ms 0 is not >= 1"),
    ("s1", "refresh_interval_ms", 500, "refresh_interval_ms 500: the least time"),
    ("s1", "update_interval_ms", -1, "update_interval_ms -1 is not >= 0"),
    ("s1", "update_interval_ms", 70_000, "update_interval_ms 70000 exceeds refresh_interval_ms"),
    ("s1", "max_message_bytes", 70000, "max_message_bytes 70000 is not 1..65535"),
    ("s1", "max_message_bytes", 0, "max_message_bytes 0 is not 1..65535"),
    ("s1", "hot_prefixes", -3, "hot_prefixes -3 is not >= 0"),
    ("s1", "hot_prefixes", 0.5, "hot_prefixes must be an integer, not 0.5"),
    ("s1", "block_tokens", 0, "block_tokens 0 is not 1..4294967295"),
    ("s1", "block_tokens", U32 + 1, "block_tokens 4294967296 is not 1..4294967295"),
    ("s1", "bytes_per_block", -1, "bytes_per_block -1 is not 0..4294967295"),
    ("s1", "bytes_per_block", U32 + 1, "bytes_per_block 4294967296 is not 0..4294967295"),
    ("s1", "instances_per_site", True, "instances_per_site must be an integer, not True"),
    ("s1", "instances_per_site", "4", "instances_per_site must be an integer, not '4'"),
    ("s1", "instances_per_site", 0, "instances_per_site 0 is not 1..255"),
    ("s1", "instances_per_site", 256, "instances_per_site 256 is not 1..255"),
    ("s1", "instances_per_site", 65, "instances_per_site 65 = 260 instances, but shard routes"),
    ("s1", "seed", -1, "seed -1 outside 0..18446744073709551615"),
    ("s1", "seed", 2.0, "seed must be an integer 0..18446744073709551615, not 2.0"),
    # ---- text
    ("s1", "name", True, "name must be text, not True"),
    ("s1", "name", ["S1"], "name must be text, not ['S1']"),
    ("s1", "model_id", "", "model_id is 0 bytes of UTF-8, not 1..255"),
    ("s1", "model_id", "é" * 128, "model_id is 256 bytes of UTF-8, not 1..255"),
    ("s1", "model_id", "\ud800", "model_id is not UTF-8 text"),
    ("s1", "secret", "too short", "secret is 9 bytes of UTF-8, not 16..64"),
    ("s1", "secret", "s" * 65, "secret is 65 bytes of UTF-8, not 16..64"),
    ("s1", "secret", None, "secret must be text, not None"),
    # ---- choices and flags
    ("s1", "summary_kind", "cuckoo", "summary_kind 'cuckoo' is not auto"),
    ("s1", "shortest_first", True, "shortest_first True is not none, catsproto or all"),
    ("s1", "arrival_spread", 2, "arrival_spread 2 is not false, true, even or random"),
    ("s1", "selector_site", "Z", "selector_site 'Z' is not 'ingress' or one of"),
    ("s1", "selector_site", True, "selector_site True is not 'ingress' or one of"),
    ("s1", "selector_peers", True, "selector_peers applies to the flat selector only"),
    *(
        ("s1", flag, 0, f"{flag} must be true or false, not 0")
        for flag in (
            "remote_kv",
            "main_on_summary_change",
            "propagation",
            "sharded",
            "decision_rtt",
            "site_dispatch",
            "site_bounce",
            "overflow_signal",
            "physical_arrival",
            "price_evictions",
        )
    ),
    # ---- sites and round trips
    ("s1", "sites", "ABCD", "sites must be a list of names, not 'ABCD'"),
    ("s1", "sites", ["A", "B", "C", "D", "A"], "sites must be distinct and not empty"),
    ("s1", "sites", [], "sites must be distinct and not empty"),
    ("s1", "sites", ["A", "B", "C", "D-E"], "sites: 'D-E' is not a site name"),
    ("s1", "sites", ["A", "B", "C", ""], "sites: '' is not a site name"),
    ("s1", "sites", ["A", "B", "C", "ingress"], "sites: 'ingress' is not a site name"),
    ("s1", "sites", [f"S{i}" for i in range(254)], "sites: 254 sites, the simulator's"),
    ("s1", "rtt_ms", 5, "rtt_ms must be a mapping"),
    ("s1", "rtt_ms.A-B", True, "rtt_ms A-B must be a finite number >= 0, not True"),
    ("s1", "rtt_ms.A-B", -10.0, "rtt_ms A-B must be a finite number >= 0, not -10.0"),
    ("s1", "rtt_ms.A-B", math.nan, "rtt_ms A-B must be a finite number >= 0, not nan"),
    ("s1", "rtt_ms.A-B", 10**400, "rtt_ms A-B must be a finite number >= 0"),
    ("s1", "rtt_ms.A-Z", 3.0, "rtt_ms key 'A-Z' is not 'X-Y' for two distinct sites"),
    # ---- tiers
    ("s1", "tiers", [], "tiers must be a mapping"),
    ("s1", "tiers", {}, "a scenario needs at least one tier"),
    ("s1", "tiers.hbm", 5, "tiers.hbm must be a mapping"),
    ("s1", "tiers.l3", {"capacity_blocks": 1}, "unknown tier 'l3'"),
    ("s1", "tiers.HBM", {"capacity_blocks": 1}, "tiers: 'HBM' names the HBM tier a second time"),
    ("s1", "tiers.hbm.capacity_blocks", -1, "tiers.hbm.capacity_blocks -1 is not >= 0"),
    ("s1", "tiers.hbm.capacity_blocks", 0, "tiers.hbm.capacity_blocks 0: the first tier needs"),
    ("s1", "tiers.hbm.fetch_latency_us", 0.5, "tiers.hbm.fetch_latency_us must be an integer"),
    ("s1", "tiers.hbm.fetch_latency_us", -1, "tiers.hbm.fetch_latency_us -1 is not 0..4294967295"),
    ("s1", "tiers.hbm.fetch_bandwidth_mbps", U32 + 1, "tiers.hbm.fetch_bandwidth_mbps 4294967296"),
    (L70, "tiers.dram.fetch_bandwidth_mbps", 0, "tiers.dram.fetch_bandwidth_mbps 0 with bytes"),
    (L70, "tiers.hbm.fetch_bandwidth_mbps", 0, "tiers.hbm.fetch_bandwidth_mbps 0 with bytes"),
    # ---- the [model] table
    (L70, "model", "llama", "model must be a mapping"),
    (L70, "model.layers", 0, "model.layers 0 is not >= 1"),
    (L70, "model.kv_heads", 2.5, "model.kv_heads must be an integer, not 2.5"),
    (L70, "model.head_dim", -128, "model.head_dim -128 is not >= 1"),
    (L70, "model.dtype_bytes", False, "model.dtype_bytes must be an integer, not False"),
    (L70, "model.layers", 80 * 26, "model.layers x kv_heads x head_dim x 2 x dtype_bytes"),
    (L70, "model.id", "", "model.id is 0 bytes of UTF-8, not 1..255"),
]


def _key(path: str) -> str:
    """The key a message names: a top-level key, `tiers.NAME.field` or `model.field` as
    written (rtt_ms pairs as `rtt_ms X-Y`)."""
    if path.startswith("rtt_ms."):
        return "rtt_ms"
    return path if path.startswith(("tiers.", "model.")) else path.split(".")[0]


@pytest.mark.parametrize(
    ("scenario", "path", "value", "says"),
    BAD,
    ids=[f"{p}={v!r}"[:60] for _, p, v, _ in BAD],
)
def test_a_bad_value_is_refused_naming_the_key(
    scenario: str, path: str, value: Any, says: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_mapping(with_values(scenario, **{path: value}))
    message = str(caught.value)
    assert says in message
    assert _key(path) in message or path.split(".")[-1] in message


def test_every_key_the_loader_reads_has_a_bad_case() -> None:
    keys = loader_keys(LOADER.read_text(encoding="utf-8"))
    cased = {path for _, path, _, _ in BAD}
    tops = {path.split(".")[0] for path in cased}
    assert keys.top - tops == set()
    assert {k for k in keys.tier if not any(p.endswith(f".{k}") for p in cased)} == set()
    assert {k for k in keys.model if f"model.{k}" not in cased} == set()


@pytest.mark.parametrize(
    ("scenario", "paths", "says"),
    [
        ("s1", {"summary_kind": "bloom", "target_fpr": 0}, "summary_kind bloom cannot meet"),
        ("s1", {"summary_kind": "fuse", "target_fpr": 1e-12}, "summary_kind fuse cannot meet"),
        ("s1", {"bytes_per_block": 1000, "tiers.dram": {"capacity_blocks": 10}}, "tiers.dram"),
        (
            "s1",
            {"bytes_per_block": 1000, "remote_kv": True, "tiers.hbm": {"capacity_blocks": 9}},
            "tiers.hbm.fetch_bandwidth_mbps 0 with bytes_per_block 1000",
        ),
    ],
)
def test_keys_that_do_not_go_together_are_refused(
    scenario: str, paths: dict[str, Any], says: str
) -> None:
    with pytest.raises(ScenarioError, match=f"^{says}"):
        Scenario.from_mapping(with_values(scenario, **paths))


def test_more_instances_without_shard_routes() -> None:
    """The 256-instance bound is that of the shard routes: without them 4 x 65 loads."""
    sc = Scenario.from_mapping(with_values("s1", instances_per_site=65, sharded=False))
    assert sc.n_instances == 260


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("prefill_tps=NaN", "prefill_tps nan is not a finite number > 0"),
        ("prefill_tps=Infinity", "prefill_tps inf is not a finite number > 0"),
        ("snapshot_every=0", "snapshot_every 0 is not >= 1"),
        ("selector_spread_ms=-1", "selector_spread_ms -1 is not"),
        ("ingress_index=-2", "ingress_index -2 is not >= 0"),
        ("link_bandwidth_mbps=0", "link_bandwidth_mbps 0 is not a finite number > 0"),
        ("intra_site_rtt_ms=-1", "intra_site_rtt_ms -1 is not"),
        ("name=true", "name must be text, not True"),
    ],
)
def test_set_overrides_are_checked_the_same_way(override: str, says: str) -> None:
    raw = apply_overrides(load_scenario("s1"), [override])
    with pytest.raises(ScenarioError, match=f"^{says}"):
        Scenario.from_mapping(raw)


@pytest.mark.parametrize(
    ("scenario", "path", "value", "field", "read"),
    [
        ("s1", "wait_threshold_ms", math.inf, "wait_threshold_ms", math.inf),  # never on waits
        ("s1", "selector_spread_ms", 0, "selector_spread_ms", 0.0),
        ("s1", "intra_site_rtt_ms", 0.0, "rtt_ms", 0.0),
        ("s1", "rtt_ms.A-B", 0, "rtt_ms", 0.0),
        ("s1", "update_interval_ms", 0, "update_interval_ms", 0),
        ("s1", "change_threshold", 0, "change_threshold", 0.0),
        ("s1", "target_fpr", 0, "target_fpr", 0.0),  # auto: exact summaries
        ("s1", "max_message_bytes", 65535.0, "max_message_bytes", 65535),  # a whole float
        ("s1", "hot_prefixes", 0, "hot_prefixes", 0),
        ("s1", "ingress_index", 1_000_000, "ingress_index", 1_000_000),  # each one's last block
        ("s1", "name", 2024, "name", "2024"),  # `--set name=2024` reads a number
        ("s1", "instances_per_site", 64, "instances_per_site", 64),  # 256 shard routes
        ("s1", "tiers.hbm.fetch_bandwidth_mbps", 0, "tiers", 0),  # S1 moves no bytes
        ("s1", "tiers.hbm.fetch_latency_us", U32, "tiers", U32),
        (L70, "model.id", "m" * 255, "model_id", "m" * 255),
    ],
)
def test_edge_values_that_mean_something_are_kept(
    scenario: str, path: str, value: Any, field: str, read: Any
) -> None:
    sc = Scenario.from_mapping(with_values(scenario, **{path: value}))
    got = getattr(sc, field)
    if field == "rtt_ms":
        got = got[("A", "A")] if path == "intra_site_rtt_ms" else got[("B", "A")]
    elif field == "tiers":
        got = getattr(sc.tiers[0], path.rsplit(".", 1)[1])
    assert got == read and type(got) is type(read)


def test_a_pair_given_both_ways_takes_the_later() -> None:
    """As docs/scenarios.md says: `--set rtt_ms.B-A=30` on S1 (which has A-B) changes A-B."""
    sc = Scenario.from_mapping(apply_overrides(load_scenario("s1"), ["rtt_ms.B-A=30"]))
    assert sc.rtt("A", "B") == sc.rtt("B", "A") == 30.0


@pytest.mark.parametrize(
    ("size", "says"),
    [
        (100, "max_message_bytes 100: instance A1's advertisement at 0 ms does not fit: budget"),
        (600, r"max_message_bytes 600: instance [A-D][1-4]'s advertisement at \d+ ms does not"),
    ],
)
def test_a_message_size_an_advertisement_cannot_fit_stops_the_run_naming_it(
    size: int, says: str
) -> None:
    """In range, yet too small for what the run must advertise (how small depends on the
    cache, so only a run finds it): a ScenarioError naming the key, not a traceback from
    the builder. 100 bytes leave no room for any summary; 600 fit S1's first summaries,
    not those of caches a few hundred blocks full."""
    from catsproto.sim import run_policy
    from tests.test_sim import prepared

    sc = Scenario.from_mapping(with_values("s1", max_message_bytes=size))
    requests = [
        TraceRequest(500.0 * i, 512 * 100, 1, tuple(range(100 * i, 100 * i + 100)))
        for i in range(200)
    ]
    with pytest.raises(ScenarioError, match=says):
        run_policy("catsproto", prepared(sc, requests), sc, seed=1)
