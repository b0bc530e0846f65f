"""Replay protection: per route, only a newer (epoch, sequence) than the last accepted.

The window is kept per route, keyed by (CS-ID, instance address, NLRI prefix): an origin
sends one advertisement per prefix (its address, each summary shard), each checked on
its own, and may draw all their sequence numbers from one counter. (epoch, sequence)
compares as a pair, so after a restart an origin that lost its counter starts a higher
epoch (e.g. its boot time in seconds) at any sequence and everything from the old epoch
stays refused. The same (epoch, sequence) again is a duplicate if the signature bytes are
the same (Ed25519 is deterministic, RFC 8032, so same signer and content give the same
signature) and an equivocation otherwise.

The window also keeps, per origin (CS-ID and instance address), the highest epoch
accepted on any of its routes: a per-route window cannot see that the origin restarted
on another route, so a late copy of the previous epoch (another path, a route the
crashed process left announced) would pass it. `origin_epoch` gives that epoch and the
receiver refuses a lower one as replayed (draft, Replay and Freshness).

The window is an immutable value: `with_entry` returns a new window sharing all but one
bucket with the old one (a persistent map of 64 buckets), so committing costs a few
microseconds whatever the number of routes, and an unaccepted advertisement cannot
touch it. Buckets are plain dicts that no code changes once built (copying a dict
reuses its stored hashes; copying a read-only proxy would hash every key again), and
a `RouteKey` hashes its addresses once, when it is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from catsproto.security.signing import IPNetwork
from catsproto.wire.compiled import filling_class
from catsproto.wire.fields import IPAddress

_BUCKETS = 64
_new = object.__new__
_EMPTY: Mapping[RouteKey, RouteState] = {}  # shared by every empty bucket, never written
# An origin as a key: (CS-ID, IP version, address as an integer), cheaper to hash than
# the ipaddress object.
OriginKey = tuple[int, int, int]
_NO_ORIGINS: Mapping[OriginKey, int] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class RouteKey:
    """The unit of replay protection: one origin's advertisement on one prefix."""

    cs_id: int
    address: IPAddress
    nlri: IPNetwork
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", _route_hash(self.cs_id, self.address, self.nlri))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"cs {self.cs_id} {self.address} on {self.nlri}"

    @property
    def origin(self) -> OriginKey:
        """The origin whose route this is (the key of `ReplayWindow.origin_epoch`)."""
        return (self.cs_id, self.address.version, int(self.address))


def _route_hash(cs_id: int, address: IPAddress, nlri: IPNetwork) -> int:
    # ipaddress objects hash through hex() and Python-level __hash__; their ints are
    # as unique (equal keys still compare by their fields)
    return hash((cs_id, int(address), int(nlri.network_address), nlri.prefixlen))


def route_key(cs_id: int, address: IPAddress, nlri: IPNetwork) -> RouteKey:
    """`RouteKey(cs_id, address, nlri)` for values that are already the right types."""
    key = _new(_KEY_FILL)
    key.cs_id = cs_id
    key.address = address
    key.nlri = nlri
    key._hash = _route_hash(cs_id, address, nlri)
    key.__class__ = RouteKey
    return key


@dataclasses.dataclass(frozen=True, slots=True)
class RouteState:
    """What the window remembers of the last accepted advertisement of a route."""

    epoch: int
    sequence: int
    timestamp_ms: int
    signature: bytes

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.sequence)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayWindow:
    """Last accepted (epoch, sequence) per route, and the highest accepted epoch per
    origin; immutable, cheap to update."""

    _buckets: tuple[Mapping[RouteKey, RouteState], ...] = (_EMPTY,) * _BUCKETS
    _size: int = 0
    # origin -> highest epoch accepted on any of its routes; copied only when it rises
    _origins: Mapping[OriginKey, int] = dataclasses.field(default_factory=lambda: _NO_ORIGINS)

    def get(self, route: RouteKey) -> RouteState | None:
        return self._buckets[route._hash % _BUCKETS].get(route)

    def origin_epoch(self, route: RouteKey) -> int | None:
        """The highest epoch accepted from the origin of `route` on any route, or None."""
        return self._origins.get(route.origin)

    def with_entry(self, route: RouteKey, state: RouteState) -> ReplayWindow:
        i = route._hash % _BUCKETS
        old = self._buckets[i]
        bucket = dict(old)  # the old window keeps its own bucket
        bucket[route] = state
        buckets = list(self._buckets)
        buckets[i] = bucket
        origins = self._origins
        origin = route.origin
        held = origins.get(origin)
        if held is None or state.epoch > held:  # a new origin or a restart: rare
            origins = {**origins, origin: state.epoch}
        out = _new(_WINDOW_FILL)  # the fields are valid by construction: skip __init__
        out._buckets = tuple(buckets)
        out._size = self._size + (len(bucket) > len(old))
        out._origins = origins
        out.__class__ = ReplayWindow
        return out

    def expire(self, now_ms: int, max_age_ms: int) -> ReplayWindow:
        """Drop routes whose last accepted timestamp is older than the freshness window.

        Safe when an origin's timestamps do not go down as its (epoch, sequence) goes up
        (our node guarantees it): anything older than a forgotten entry is then stale and
        refused by the timestamp check instead.
        """
        horizon = now_ms - max_age_ms
        buckets = tuple(
            {k: v for k, v in b.items() if v.timestamp_ms >= horizon}
            if any(v.timestamp_ms < horizon for v in b.values())
            else b
            for b in self._buckets
        )
        # an origin is remembered while one of its routes is: at the highest epoch that
        # was accepted, on a route still held or not (a forgotten higher epoch's copies
        # would be stale by then, so the timestamp check refuses them instead)
        held = {k.origin for b in buckets for k in b}
        origins = {o: e for o, e in self._origins.items() if o in held}
        return ReplayWindow(buckets, sum(len(b) for b in buckets), origins)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[tuple[RouteKey, RouteState]]:
        for b in self._buckets:
            yield from b.items()


_KEY_FILL = filling_class(RouteKey)
_WINDOW_FILL = filling_class(ReplayWindow)
assert _KEY_FILL is not None and _WINDOW_FILL is not None
