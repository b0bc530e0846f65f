"""The scenario loader refuses every bad value with a ScenarioError naming the key.

Each case takes the shipped S1 scenario, sets one key to a bad value (as a scenario file
or `eval --set` would) and loads it; the shipped scenarios themselves must still load,
and their edge values (0 where 0 is allowed, infinity where it means "never") too."""

from __future__ import annotations

import math
import tomllib
from importlib import resources
from typing import Any

import pytest

from catsproto.sim import Scenario, ScenarioError, apply_overrides

SHIPPED = ("s1.toml", "llama70b.toml")


def shipped(name: str = "s1.toml") -> dict[str, Any]:
    text = resources.files("catsproto.sim.scenarios").joinpath(name).read_text()
    return tomllib.loads(text)


def with_value(path: str, value: Any, name: str = "s1.toml") -> dict[str, Any]:
    raw = shipped(name)
    node = raw
    *tables, last = path.split(".")
    for table in tables:
        node = node.setdefault(table, {})
    node[last] = value
    return raw


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_scenarios_load(name: str) -> None:
    sc = Scenario.from_mapping(shipped(name))
    assert sc.sites == ("A", "B", "C", "D") and sc.prefill_tps == 20000.0


BAD: list[tuple[str, Any, str]] = [
    # key, bad value, what the message must say
    ("prefill_tps", math.nan, "prefill_tps nan is not a finite number > 0"),
    ("prefill_tps", math.inf, "prefill_tps inf is not a finite number > 0"),
    ("prefill_tps", 0, "prefill_tps 0 is not a finite number > 0"),
    ("prefill_tps", "fast", "prefill_tps must be a number, not 'fast'"),
    ("prefill_tps", True, "prefill_tps must be a number, not True"),
    ("speedup", -1.0, "speedup -1.0 is not a finite number > 0"),
    ("intra_site_rtt_ms", -1.0, "intra_site_rtt_ms -1.0 is not a finite number >= 0"),
    ("link_bandwidth_mbps", 0, "link_bandwidth_mbps 0 is not a finite number > 0"),
    ("link_bandwidth_mbps", -5.0, "link_bandwidth_mbps -5.0 is not"),
    ("selector_spread_ms", -2.0, "selector_spread_ms -2.0 is not a finite number >= 0"),
    ("site_sticky_ms", math.nan, "site_sticky_ms nan is not"),
    ("remote_margin_ms", -0.5, "remote_margin_ms -0.5 is not"),
    ("request_bytes_per_token", -1, "request_bytes_per_token -1 is not"),
    ("per_hop_ms", math.inf, "per_hop_ms inf is not a finite number >= 0"),
    ("change_threshold", -0.1, "change_threshold -0.1 is not"),
    ("wait_threshold_ms", 0, "wait_threshold_ms 0 is not a number > 0"),
    ("wait_threshold_ms", math.nan, "wait_threshold_ms nan is not a number > 0"),
    ("target_fpr", math.nan, "target_fpr nan is not"),
    ("ingress_index", -1, "ingress_index -1 is not >= 0"),
    ("ingress_index", 1.5, "ingress_index must be an integer, not 1.5"),
    ("snapshot_every", 0, "snapshot_every 0 is not >= 1"),
    ("score_threshold", 0, "score_threshold 0 is not >= 1"),
    ("refresh_interval_ms", 0, "refresh_interval_ms 0 is not >= 1"),
    ("update_interval_ms", -1, "update_interval_ms -1 is not >= 0"),
    ("max_message_bytes", 70000, "max_message_bytes 70000 is not 1..65535"),
    ("hot_prefixes", -3, "hot_prefixes -3 is not >= 0"),
    ("block_tokens", 0, "block_tokens 0 is not >= 1"),
    ("bytes_per_block", -1, "bytes_per_block -1 is not >= 0"),
    ("instances_per_site", True, "instances_per_site must be an integer, not True"),
    ("instances_per_site", "4", "instances_per_site must be an integer, not '4'"),
    ("tiers.hbm.capacity_blocks", -1, "tiers.hbm.capacity_blocks -1 is not >= 0"),
    ("tiers.hbm.fetch_latency_us", 0.5, "tiers.hbm.fetch_latency_us must be an integer"),
    ("tiers.hbm", 5, "tiers.hbm must be a mapping"),
    ("tiers", [], "tiers must be a mapping"),
    ("rtt_ms", 5, "rtt_ms must be a mapping"),
    ("rtt_ms.A-B", True, "rtt_ms A-B must be a finite number >= 0, not True"),
    ("sites", "ABCD", "sites must be a list of names, not 'ABCD'"),
    ("model.layers", 0, "model.layers 0 is not >= 1"),
    ("model", "llama", "model must be a mapping"),
]


@pytest.mark.parametrize(("path", "value", "says"), BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_key(path: str, value: Any, says: str) -> None:
    raw = with_value(path, value)
    if path.startswith("model."):  # S1 has no model table: the 70B scenario's, with the value
        raw = with_value(path, value, "llama70b.toml")
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_mapping(raw)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("prefill_tps=NaN", "prefill_tps nan is not a finite number > 0"),
        ("snapshot_every=0", "snapshot_every 0 is not >= 1"),
        ("selector_spread_ms=-1", "selector_spread_ms -1 is not"),
        ("ingress_index=-2", "ingress_index -2 is not >= 0"),
    ],
)
def test_set_overrides_are_checked_the_same_way(override: str, says: str) -> None:
    raw = apply_overrides(shipped(), [override])
    with pytest.raises(ScenarioError, match=says):
        Scenario.from_mapping(raw)


@pytest.mark.parametrize(
    ("path", "value", "field", "read"),
    [
        ("wait_threshold_ms", math.inf, "wait_threshold_ms", math.inf),  # never on waits
        ("selector_spread_ms", 0, "selector_spread_ms", 0.0),
        ("intra_site_rtt_ms", 0.0, "rtt_ms", 0.0),
        ("update_interval_ms", 0, "update_interval_ms", 0),
        ("max_message_bytes", 65535.0, "max_message_bytes", 65535),  # a whole float
        ("hot_prefixes", 0, "hot_prefixes", 0),
    ],
)
def test_edge_values_that_mean_something_are_kept(
    path: str, value: Any, field: str, read: Any
) -> None:
    sc = Scenario.from_mapping(with_value(path, value))
    got = getattr(sc, field)
    if field == "rtt_ms":
        got = got[("A", "A")]
    assert got == read and type(got) is type(read)
