"""Which L0 entries the RIB reads: by metric type, unit and statistic, and which source
of several it prefers (docs/selector.md, "Metrics")."""

from __future__ import annotations

import ipaddress

import pytest

from catsproto import wire
from catsproto.selector import RIB
from catsproto.wire import L0Metric, L0MetricType, Source, Statistic, Unit

ADDRESS = "192.0.2.11"
RATE = L0MetricType.PREFILL_THROUGHPUT
BACKLOG = L0MetricType.OUTSTANDING_PREFILL_TOKENS
WAITING = L0MetricType.WAITING_REQUESTS


def _instance(*metrics: L0Metric):
    adv = wire.Advertisement.build(
        wire.Version(1),
        wire.Origin(7, 1, ipaddress.ip_address(ADDRESS)),
        wire.Sequence(1, 1),
        wire.Timestamp(1000),
        wire.MetricsL0(tuple(sorted(metrics, key=lambda m: m.key()))),
    )
    result = RIB().accept(adv, 1000)
    assert result.metrics_updated
    return result.instance


def m(kind, value, statistic=Statistic.CURRENT, source=Source.MEASURED, unit=None):
    unit = unit or (Unit.TOKENS_PER_SECOND if kind == RATE else Unit.COUNT)
    return L0Metric(kind, unit, statistic, source, float(value))


def test_the_current_value_and_a_mean_are_read():
    inst = _instance(m(RATE, 30_000), m(BACKLOG, 1200), m(WAITING, 3))
    assert (inst.prefill_tps, inst.backlog_tokens, inst.waiting) == (30_000, 1200, 3)
    inst = _instance(m(RATE, 25_000, Statistic.MEAN), m(BACKLOG, 800, Statistic.MEAN))
    assert (inst.prefill_tps, inst.backlog_tokens) == (25_000, 800)  # a site's route


@pytest.mark.parametrize("statistic", [Statistic.MIN, Statistic.MAX, Statistic.P95])
def test_a_percentile_minimum_or_maximum_of_the_backlog_is_not_the_queue(statistic):
    """Entries sort by (type, statistic, source): the p95 comes after the current value and
    used to overwrite it."""
    inst = _instance(m(BACKLOG, 500), m(BACKLOG, 90_000, statistic))
    assert inst.backlog_tokens == 500
    alone = _instance(m(BACKLOG, 90_000, statistic))
    assert alone.backlog_tokens == 0.0  # nothing usable: the default stays


def test_the_current_value_is_preferred_to_a_mean():
    inst = _instance(m(BACKLOG, 400), m(BACKLOG, 7000, Statistic.MEAN))
    assert inst.backlog_tokens == 400


def test_a_measured_value_is_preferred_to_aggregated_estimated_and_nominal_ones():
    inst = _instance(
        m(RATE, 10_000, source=Source.NOMINAL),
        m(RATE, 18_000, source=Source.MEASURED),
        m(RATE, 12_000, source=Source.ESTIMATED),
        m(RATE, 15_000, source=Source.AGGREGATED),
    )
    assert inst.prefill_tps == 18_000
    inst = _instance(
        m(RATE, 10_000, source=Source.NOMINAL), m(RATE, 12_000, source=Source.ESTIMATED)
    )
    assert inst.prefill_tps == 12_000


def test_another_unit_is_skipped():
    """The other unit's entries sort after the usable ones (a higher source code)."""
    inst = _instance(
        m(RATE, 20_000), m(RATE, 4, unit=Unit.REQUESTS_PER_SECOND, source=Source.ESTIMATED)
    )
    assert inst.prefill_tps == 20_000
    inst = _instance(m(BACKLOG, 300), m(BACKLOG, 1 << 20, unit=Unit.BYTES, source=Source.ESTIMATED))
    assert inst.backlog_tokens == 300
