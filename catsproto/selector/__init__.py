"""The CATS path selector (C-PS): RIB of verified advertisements, network graph, cost
model, and decisions with explanations. Pure: time comes in as `now_ms`."""

from catsproto.selector.index import KeyIndex
from catsproto.selector.network import Link, Network, Path
from catsproto.selector.rib import RIB, AcceptResult, Instance, ServiceTable, TierState
from catsproto.selector.selector import (
    CarriedPull,
    Decision,
    Estimate,
    NoInstanceError,
    PathSelector,
    Request,
    SelectorConfig,
)

__all__ = [name for name in dir() if not name.startswith("_")]
