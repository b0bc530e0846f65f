"""The steering daemon's RIB, fed from the file the BGP receiver writes.

Strategy: `RibFeed` reads the receive daemon's `rib.json` when it changes (its stamp,
with a guard for coarse file times), turns each accepted route into the selector's
advertisement for its CS-ID, and applies only what changed to the `SteeringService`'s
selectors. `catsproto.adapters.steering` is the daemon.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import time
from pathlib import Path
from typing import Any

from catsproto import wire
from catsproto.selector import (
    RIB,
)

RACY_NS = 2_000_000_000  # file timestamps may be this coarse (a kernel tick, a filesystem)


class RibFeed:
    """A selector RIB that follows the receiver's rib.json."""

    def __init__(self, path: str | Path, rib: RIB | None = None) -> None:
        self.path = Path(path)
        self.rib = rib or RIB()
        self._values: dict[tuple[str, str], str] = {}
        self._origins: dict[str, int] = {}  # address -> CS-ID
        self.key_ids: dict[str, bytes] = {}  # address -> key id of its verified signature
        self._stamp: tuple[int, int] | None = None
        # a file changed within RACY_NS of being read may be rewritten at the same size
        # within one tick of a coarse file clock: its content is compared until it is older
        self._digest = b""
        self._racy = False
        self.routes = 0
        self.bad_routes = 0  # routes of rib.json left out as unusable
        self.bad_documents = 0  # rib.json documents refused whole

    def refresh(self, now_ms: int) -> bool:
        """Take in what changed since the last call; False if the file did not change
        (or cannot be read or parsed yet: then the RIB stays as it was, and the file
        is read again next time)."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp and not self._racy:
                return False
            raw = self.path.read_bytes()
            racy = time.time_ns() - st.st_mtime_ns < RACY_NS
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            if stamp == self._stamp and digest == self._digest:
                self._racy = racy
                return False
            doc = json.loads(raw)
        except (OSError, ValueError):
            return False  # not there yet, or caught mid-replace: next time
        if not self.apply(doc, now_ms):
            return False
        self._stamp, self._digest, self._racy = stamp, digest, racy
        return True

    def apply(self, doc: Any, now_ms: int) -> bool:
        """Replace the RIB's content by the document's verified routes. A document that
        is not a receiver's RIB (no list of routes) changes nothing and returns False; a
        route without a usable peer, prefix, hex value or origin is left out and counted
        in `bad_routes`. Everything is checked before the RIB is touched."""
        routes = doc.get("routes", []) if isinstance(doc, dict) else None
        if not isinstance(routes, list):
            self.bad_documents += 1
            return False
        current: dict[tuple[str, str], str] = {}
        origins: dict[str, int] = {}
        owner: dict[tuple[str, str], str] = {}
        heard: dict[tuple[str, str], int] = {}
        for route in routes:
            checked = _rib_route(route)
            if checked is None:
                self.bad_routes += 1
                continue
            key, value, origin = checked
            if value is None:  # refused by the receiver: not ours to use
                continue
            current[key] = value
            at = route.get("received_at")
            if type(at) in (int, float) and math.isfinite(at) and at >= 0:
                # when the receiver took it, not when this file was read: a daemon that
                # starts late must not see an origin that went silent long ago as fresh
                heard[key] = min(now_ms, int(at * 1000))
            if origin is not None:
                origins[origin[0]] = origin[1]
                owner[key] = origin[0]
        # an origin is usable only while its own host route (its CSCI-ID: the way to
        # reach it, and its metrics) stands; until it is back, its shard routes wait
        hosts = {key[1] for key in current}
        for address in [a for a in origins if _host_route(a) not in hosts]:
            del origins[address]
        current = {k: v for k, v in current.items() if k not in owner or owner[k] in origins}
        standing = {key[1] for key in current}  # prefixes still carried by some peer
        for key, value in self._values.items():
            if key not in current and key[1] not in standing:
                # withdrawn or refused wherever it was heard: what it said no longer holds
                # (a copy that still stands via another peer keeps it)
                try:
                    gone = wire.decode(bytes.fromhex(value))
                except wire.CodecError:
                    continue
                if str(gone.origin.address) in origins:  # else the whole origin goes below
                    self.rib.forget_summaries(gone)
        for key, value in current.items():
            if self._values.get(key) != value:
                try:
                    adv = wire.decode(bytes.fromhex(value))
                except wire.CodecError:
                    continue
                self.rib.accept(adv, heard.get(key, now_ms))
                if adv.signature is not None:
                    self.key_ids[str(adv.origin.address)] = adv.signature.key_id
        for address, cs_id in self._origins.items():
            if address not in origins:
                self.rib.withdraw(ipaddress.ip_address(address), cs_id)
                self.key_ids.pop(address, None)
        self._values, self._origins, self.routes = current, origins, len(current)
        return True


def _host_route(address: str) -> str:
    ip = ipaddress.ip_address(address)
    return f"{ip}/{ip.max_prefixlen}"


def _rib_route(
    route: Any,
) -> tuple[tuple[str, str], str | None, tuple[str, int] | None] | None:
    """One route of the receiver's rib.json, checked: ((peer, prefix), value hex or None
    when the receiver refused it, (origin address, CS-ID) or None), or None if unusable.
    The value is the one with its sealed cache section opened when the receiver holds the
    group key (`opened_value`), else the value as received."""
    if not isinstance(route, dict):
        return None
    prefix, value = route.get("prefix"), route.get("opened_value", route.get("value"))
    if not isinstance(prefix, str) or not isinstance(value, str):
        return None
    try:
        bytes.fromhex(value)
    except ValueError:
        return None
    origin = None
    if "origin" in route:
        address, cs_id = route["origin"], route.get("cs_id", 0)
        try:
            address = str(ipaddress.ip_address(address))
        except ValueError:
            return None
        if type(cs_id) is not int or not 0 <= cs_id <= 0xFFFFFFFF:
            return None
        origin = (address, cs_id)
    key = (str(route.get("peer", "")), prefix)
    return key, (None if route.get("verified") is False else value), origin
