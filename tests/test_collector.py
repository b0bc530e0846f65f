"""DecisionCollector: no automatic collection while it runs, the same garbage collected
between decisions, and CPython's collector handed back afterwards."""

from __future__ import annotations

import gc
import weakref

import pytest

from catsproto.adapters.collector import DecisionCollector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_cycles_wait_for_between_and_are_collected_there():
    collector = DecisionCollector(fill=0.5)
    was = gc.isenabled()
    collector.start()
    try:
        assert not gc.isenabled()
        gone = cycle()
        # far past the youngest generation's threshold: CPython would have collected
        keep = [Node() for _ in range(3 * gc.get_threshold()[0])]
        assert gone() is not None  # nothing collected it on the way
        assert collector.between() >= 0
        assert gone() is None
        assert sum(collector.collections) == 1
        assert collector.between() == -1  # nothing due right after
        del keep
    finally:
        collector.stop()
    assert gc.isenabled() == was
    assert gc.get_freeze_count() == 0


def test_what_was_alive_at_start_is_frozen():
    collector = DecisionCollector()
    kept = [Node() for _ in range(100)]
    before = {id(k) for k in kept}
    assert before <= {id(o) for o in gc.get_objects()}  # tracked before start
    collector.start()
    try:
        # frozen objects move to the permanent generation, which get_objects() leaves out
        tracked = {id(o) for o in gc.get_objects()}
        assert not before & tracked
    finally:
        collector.stop()
    assert before <= {id(o) for o in gc.get_objects()}  # and back after stop


def test_fill_must_be_a_fraction():
    with pytest.raises(ValueError, match="fill"):
        DecisionCollector(fill=0.0)
