"""ExaBGP's JSON API messages as events: the pure half of the receive daemon.

Strategy: `parse_message` turns one JSON message of ExaBGP's API (`encoder json`,
`receive { parsed; update; }`, `neighbor-changes`) into events, nothing else. An
UPDATE's announced routes share its one attribute value, found by *type code* whatever
flags transit routers set (`attribute-0xFF-0xC0`, `-0xE0` with Partial, `-0xF0` with
Extended Length too): one route gives an `Announced` with its prefix parsed, several an
`AnnouncedMany` with ExaBGP's nlri text, which `cache_rib.CacheRib` judges once for all
of them. A field that cannot be read is handled per route: attribute hex that does not
decode marks the announcement malformed, an unusable `as-path` becomes (), a route
without a usable `nlri` becomes an `Unusable` event. Withdrawals and session changes
are events of their own. Pure: no IO.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from catsproto.wire import DEFAULT_ATTRIBUTE_TYPE

_ATTRIBUTE_KEY = re.compile(r"^attribute-0x([0-9A-Fa-f]{2})-0x([0-9A-Fa-f]{2})$")
Prefix = ipaddress.IPv4Network | ipaddress.IPv6Network


# ---- events -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Announced:
    peer: str
    prefix: Prefix
    flags: int | None  # None: the route carried no cache attribute
    value: bytes | None
    as_path: tuple[int, ...] = ()
    malformed: str = ""  # why the attribute in ExaBGP's JSON could not be read, if so


@dataclasses.dataclass(frozen=True)
class AnnouncedMany:
    """The routes of one UPDATE, which share its one attribute value: ExaBGP's nlri text,
    unparsed. `CacheRib` judges the value once for all of them."""

    peer: str
    nlri: tuple[str, ...]
    flags: int | None
    value: bytes | None
    as_path: tuple[int, ...] = ()
    malformed: str = ""


@dataclasses.dataclass(frozen=True)
class Withdrawn:
    peer: str
    prefix: Prefix


@dataclasses.dataclass(frozen=True)
class EndOfRib:
    """The peer has sent everything it holds (RFC 4724): what it did not resend is gone."""

    peer: str


@dataclasses.dataclass(frozen=True)
class Session:
    peer: str
    state: str  # connected, up, down
    reason: str = ""  # why it went down, as ExaBGP says


@dataclasses.dataclass(frozen=True)
class Unusable:
    """A route in an UPDATE that cannot be keyed (no usable `nlri`): counted, skipped."""

    peer: str
    reason: str


Event = Announced | AnnouncedMany | Withdrawn | EndOfRib | Session | Unusable


def find_attribute(attributes: dict[str, Any], type_code: int) -> tuple[int, bytes] | None:
    """(flags, value) of the attribute of `type_code` in ExaBGP's JSON, any flags; a
    value that is not a hex string raises ValueError naming the key."""
    for key, raw in attributes.items():
        m = _ATTRIBUTE_KEY.match(key)
        if m and int(m.group(1), 16) == type_code:
            if not isinstance(raw, str):
                raise ValueError(f"{key} is {_shown(raw)}, not a hex string")
            text = raw[2:] if raw[:2].lower() == "0x" else raw
            try:
                return int(m.group(2), 16), bytes.fromhex(text)
            except ValueError:
                raise ValueError(f"{key} {_shown(raw)} is not hex") from None
    return None


def _shown(value: Any) -> str:
    """A JSON value as ExaBGP wrote it, cut short for a one-line reason."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _prefix(route: Any) -> Prefix:
    """The prefix of one route object of ExaBGP's JSON ({"nlri": "10.0.0.1/32", ...})."""
    nlri = route.get("nlri") if isinstance(route, dict) else None
    if not isinstance(nlri, str):
        raise ValueError(f"route {_shown(route)} has no nlri string")
    try:
        return ipaddress.ip_network(nlri)
    except ValueError as exc:
        raise ValueError(f"nlri {_shown(nlri)}: {exc}") from None


def _routes(peer: str, routes: Iterable[Any], make: Callable[[Prefix], Event]) -> list[Event]:
    out: list[Event] = []
    for route in routes:
        try:
            prefix = _prefix(route)
        except ValueError as exc:
            out.append(Unusable(peer, str(exc)))
            continue
        out.append(make(prefix))
    return out


def parse_message(obj: dict[str, Any], type_code: int = DEFAULT_ATTRIBUTE_TYPE) -> list[Event]:
    """Events in one ExaBGP JSON message (anything else, e.g. End-of-RIB, gives none)."""
    neighbor = obj.get("neighbor") or {}
    peer = str((neighbor.get("address") or {}).get("peer", "?"))
    if obj.get("type") == "state":
        state, reason = neighbor.get("state", "?"), neighbor.get("reason")
        return [Session(peer, str(state), reason if isinstance(reason, str) else "")]
    if obj.get("type") != "update":
        return []
    message = neighbor.get("message") or {}
    if "eor" in message:
        return [EndOfRib(peer)]
    update = message.get("update") or {}
    events: list[Event] = []
    for routes in (update.get("withdraw") or {}).values():
        events.extend(_routes(peer, routes, lambda p: Withdrawn(peer, p)))
    attributes = update.get("attribute") or {}
    malformed = ""
    try:
        found = find_attribute(attributes, type_code)
    except ValueError as exc:
        found, malformed = None, str(exc)
    flags, value = found if found else (None, None)
    as_path = as_path_of(attributes)

    texts: list[str] = []
    for by_next_hop in (update.get("announce") or {}).values():
        for routes in by_next_hop.values():
            for route in routes:
                nlri = route.get("nlri") if isinstance(route, dict) else None
                if isinstance(nlri, str):
                    texts.append(nlri)
                else:
                    events.append(Unusable(peer, f"route {_shown(route)} has no nlri string"))
    if len(texts) == 1:

        def announced(prefix: Prefix) -> Event:
            return Announced(peer, prefix, flags, value, as_path, malformed)

        events.extend(_routes(peer, [{"nlri": texts[0]}], announced))
    elif texts:
        events.append(AnnouncedMany(peer, tuple(texts), flags, value, as_path, malformed))
    return events


_AS_MAX = 0xFFFFFFFF


def as_path_of(attributes: dict[str, Any]) -> tuple[int, ...]:
    """The AS numbers of ExaBGP's `as-path`: segments ({"0": {"element": ..., "value":
    [...]}}, or a list of them) or a plain list of numbers. Anything that is not an AS
    number (0..2^32-1, an integer or its decimal string) makes the path unknown: ()."""
    raw = attributes.get("as-path") or {}
    if isinstance(raw, dict):
        segments: list[Any] = list(raw.values())
    elif isinstance(raw, list):
        segments = raw
    else:
        return ()
    out: list[int] = []
    for seg in segments:
        values = seg.get("value") if isinstance(seg, dict) else seg
        for v in values if isinstance(values, list) else [values]:
            if isinstance(v, str) and v.isascii() and v.isdigit():
                v = int(v)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _AS_MAX:
                return ()
            out.append(v)
    return tuple(out)
