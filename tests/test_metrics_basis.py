"""The Metrics Basis TLV (type 19, draft revision -01): the measurement window and the
normalisation an origin's metrics were computed with, and what the node sends in it."""

from __future__ import annotations

import pytest

from catsproto import wire
from catsproto.adapters import scapy_layer as sl
from catsproto.node.metrics import DEFAULT_BASIS, ComputeState, ScoreScale, cats_metrics
from catsproto.vectors import HEADER


def _value(basis_hex: str) -> bytes:
    return bytes.fromhex((HEADER + " 0013 000d " + basis_hex).replace(" ", ""))


def test_the_draft_layout_window_normalisation_reference():
    data = _value("0000000000002710 01 000003e8")
    adv = wire.decode(data)
    basis = adv.metrics_basis
    assert basis == wire.MetricsBasis(10_000, wire.NormalisationFunction.QUEUE_REFERENCE, 1000)
    assert isinstance(basis.normalisation, wire.NormalisationFunction)
    assert basis.has_known_normalisation
    assert wire.encode(adv) == data
    assert wire.tlv_name(19) == "metrics-basis"


def test_an_unknown_normalisation_is_kept_as_its_number_and_reencoded():
    data = _value("0000000000002710 c8 000003e8")
    adv = wire.decode(data)
    assert adv.metrics_basis.normalisation == 200
    assert not isinstance(adv.metrics_basis.normalisation, wire.NormalisationFunction)
    assert not adv.metrics_basis.has_known_normalisation
    assert wire.encode(adv) == data


@pytest.mark.parametrize(
    ("basis_hex", "field"),
    [
        ("0000000000000000 01 000003e8", "window_ms 0"),
        ("0000000000002710 00 000003e8", "normalisation 0"),
        ("0000000000002710 01 00000000", "reference_ms 0"),
    ],
)
def test_zero_fields_are_refused_and_cost_only_the_metrics(basis_hex, field):
    with pytest.raises(wire.BadValueError) as info:
        wire.decode(_value(basis_hex))
    assert info.value.tlv_type == 19 and field in str(info.value)
    assert wire.error_action(info.value) is wire.ErrorAction.ATTRIBUTE_DISCARD
    with pytest.raises(wire.BadValueError):
        wire.MetricsBasis(*[int(x, 16) for x in basis_hex.split()])


def test_the_node_states_the_basis_its_scores_were_computed_with():
    state = ComputeState(outstanding_prefill_tokens=2000, prefill_rate_tps=1000.0)
    default = cats_metrics(state)
    assert default.basis == DEFAULT_BASIS == wire.MetricsBasis(10_000, 1, 1000)
    # W = 2000 ms: service = 10 x R / (R + W) is 3 with R = 1000 ms, 5 with R = 2000 ms
    assert {s.category: s.score for s in default.l1.scores}[wire.MetricCategory.SERVICE] == 3
    scaled = cats_metrics(state, ScoreScale(wait_ref_ms=2000.0, window_ms=30_000))
    assert scaled.basis == wire.MetricsBasis(30_000, 1, 2000)
    assert {s.category: s.score for s in scaled.l1.scores}[wire.MetricCategory.SERVICE] == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wait_ref_ms": 0.0}, "wait_ref_ms"),
        ({"wait_ref_ms": 1000.5}, "wait_ref_ms"),
        ({"wait_ref_ms": float("inf")}, "wait_ref_ms"),
        ({"wait_ref_ms": 2.0**32}, "wait_ref_ms"),
        ({"window_ms": 0}, "window_ms"),
    ],
)
def test_a_scale_the_tlv_cannot_state_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScoreScale(**kwargs)


def test_names_follow_the_working_group_and_old_names_still_resolve():
    assert wire.MetricCategory(1).name == "COMPUTING"
    assert wire.MetricCategory.COMPUTE is wire.MetricCategory.COMPUTING
    assert wire.L0MetricType(7).name == "QUEUE_DELAY"
    assert wire.L0MetricType.TTFT is wire.L0MetricType.QUEUE_DELAY
    assert wire.L0_METRIC_NAMES[7] == "queue-delay"
    score = wire.MetricsL1((wire.L1Score(wire.MetricCategory.COMPUTING, 4),))
    assert score.to_json() == {"scores": [{"category": "computing", "score": 4}]}


def test_the_scapy_layer_reads_the_fields():
    tlv = sl.TLV_CLASSES[19](bytes.fromhex("0013000d00000000000075300100000bb8"))
    assert (tlv.window_ms, tlv.normalisation, tlv.reference_ms) == (30_000, 1, 3000)
    assert bytes(sl.TLV_CLASSES[19](window_ms=30_000, reference_ms=3000)) == bytes.fromhex(
        "0013000d00000000000075300100000bb8"
    )
