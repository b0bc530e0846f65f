"""Receive advertisements from ExaBGP's JSON API and keep a RIB of verified cache state.

Strategy: ExaBGP runs this as `process rx { run python -m
catsproto.adapters.exabgp_receive --out DIR; encoder json; }` with
`api { processes [ rx ]; receive { parsed; update; } neighbor-changes; }`. Each stdin
line is one JSON message. `parse_message` (pure) turns it into events: per announced
prefix the raw attribute value, found by *type code* whatever flags transit routers set
(`attribute-0xFF-0xC0`, `-0xE0` with Partial, `-0xF0` with Extended Length too); per
withdrawn prefix a withdrawal; per neighbor state change a session event. A field that
cannot be read is handled per route: attribute hex that does not decode marks the route
malformed, an unusable `as-path` becomes (), a route without a usable `nlri` becomes an
`Unusable` event; only a message whose shape is not ExaBGP's at all is dropped, counted
(`unparsed_messages`) and logged. `CacheRib` (pure) applies the events, keyed by (peer,
route): a value that fails to decode or verify is RFC 7606 treat-as-withdraw of the state
that route carried — that origin's cache state, nobody else's — and the BGP session is
untouched; a session going down withdraws that peer's routes. A sink (`on_change`)
receives every change, which is where the selector's RIB plugs in; `main` writes changes
as JSON lines and a snapshot file (with the counters).

ExaBGP reads this process's stdout as commands, so nothing here ever writes to it:
`main` points `sys.stdout` at stderr before doing anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import select
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Protocol

from catsproto import wire
from catsproto.adapters.file_modes import read_secret_file, read_trust_file
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


# NOTIFICATION error code 4 is Hold Timer Expired (RFC 4271 section 4.5); ExaBGP reports
# "notification sent (4,0)" when its own hold timer ran out.
_HOLD_TIMER = re.compile(r"hold timer|notification (sent|received) \(4,", re.IGNORECASE)


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


# ---- the RIB ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verification:
    """A verifier's answer: keep the state or not, and whether a signature vouched for it.

    opened: the value with its sealed cache section opened (the verifier holds the group
    key), encoded, its Signature TLV kept, or None. unheld_group_key: the key id of an
    accepted value's sealed section that the verifier holds group keys but not this one
    for (left unopened)."""

    accepted: bool
    verified: bool
    reason: str = ""
    opened: bytes | None = None
    unheld_group_key: int | None = None


UNVERIFIED = Verification(True, False, "no trust configured")
# unknown_sealing_algorithm: accepted values whose Sealed Cache TLV names an AEAD this
# code lacks (kept, metrics used, the section unopened: not malformed); sealed_opened:
# accepted values whose sealed section the receiver opened (`--group-key`);
# unheld_group_key: accepted values sealed under a group key id it does not hold
# (kept, metrics used, the section unopened: a rollover that has not reached it)
COUNTERS = (
    "unparsed_messages",
    "unusable_routes",
    "malformed",
    "not_verified",
    "unknown_sealing_algorithm",
    "sealed_opened",
    "unheld_group_key",
)


class Verifier(Protocol):
    """Checks one value on one route (`catsproto.security` plugs in: `TrustFileVerifier`).

    Without a verifier, decoding is the only check and entries are marked unverified.
    """

    def __call__(self, value: bytes, adv: wire.Advertisement, prefix: Prefix) -> Verification: ...


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TrustFileVerifier:
    """Verifies against a trust file (operator keys, delegations), reloaded when it changes.

    Fail-closed: until the file has loaded once, every value is refused ("trust file
    unavailable"); once it has, a file that goes missing, cannot be read or does not load
    leaves the last good store in force, and the failure is logged once and counted
    (`reload_failures`). A reload keeps the replay window, the counters and the
    delegations learned in-band that the new file still allows (`Receiver.reloaded`).

    `optional` (the lab's `--trust-when-present`): while the file does not exist, values
    are accepted unverified; a file that exists but cannot be read or loaded still never
    leads to acceptance. Signature, scope, freshness and replay are
    `catsproto.security.Receiver`'s; a re-sent identical advertisement (BGP does that)
    stays accepted. `attribute_type` is the type code the values arrive in: it is part
    of every signed message, so it must be the one `run` looks the attribute up by.
    `group_keys` (a `security.GroupKeyring`): sealed cache sections under those keys are
    opened once verified, and the opened value handed on (`Verification.opened`).
    """

    def __init__(
        self,
        path: str | Path,
        clock: Callable[[], float] = time.time,
        *,
        optional: bool = False,
        log: Callable[[str], None] = _stderr,
        attribute_type: int = DEFAULT_ATTRIBUTE_TYPE,
        group_keys: Any = None,
    ) -> None:
        from catsproto import security

        self.policy = security.Policy(attribute_type=attribute_type)
        self.group_keys = group_keys
        self.path = Path(path)
        self.clock = clock
        self.optional = optional
        self.log = log
        self._stamp: tuple[int, ...] | None = None  # the file state last read, or tried
        self._receiver: Any = None  # built from the last good load
        self._loaded: Any = None  # the TrustStore of the last good load
        self._absent = False
        self._expired_ms = 0  # when the replay window was last pruned
        self.loads = 0
        self.reload_failures = 0
        self.error = "not read yet"

    def _failed(self, stamp: tuple[int, ...], error: str) -> None:
        """Count and log a failed (re)load once per state of the file."""
        if stamp == self._stamp:
            return
        self._stamp, self.error = stamp, error
        self.reload_failures += 1
        kept = "keeping the last good trust store" if self._receiver else "refusing every value"
        self.log(f"trust file {self.path}: {error}; {kept}")

    def _current(self) -> Any:
        from catsproto import security

        self._absent = False
        try:
            st = self.path.stat()
        except OSError as exc:
            if self.optional and isinstance(exc, FileNotFoundError):
                self._stamp, self._absent = None, True
                return None
            self._failed((-1,), f"cannot read it: {exc.strerror}")
            return self._receiver
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode)  # a chmod too
        if stamp == self._stamp:
            return self._receiver
        try:
            store = security.TrustStore.from_json(
                json.loads(read_trust_file(self.path, "trust file"))
            )
        except OSError as exc:
            self._failed(stamp, f"cannot read it: {exc.strerror}")
        except (ValueError, RecursionError) as exc:  # JSON, UTF-8, TrustFileError
            self._failed(stamp, f"does not load: {exc}")
        else:
            if self._receiver is None:
                self._receiver = security.Receiver(
                    store, policy=self.policy, group_keys=self.group_keys
                )
            else:
                self._receiver = self._receiver.reloaded(store, self._loaded)
            self._stamp, self._loaded, self.error = stamp, store, ""
            self.loads += 1
        return self._receiver

    @property
    def verifying(self) -> bool:
        """False only while an optional trust file is absent (values accepted unverified)."""
        self._current()
        return not self._absent

    def __call__(self, value: bytes, adv: wire.Advertisement, prefix: Prefix) -> Verification:
        from catsproto.security import Reason

        receiver = self._current()
        if receiver is None:
            if self._absent:
                return UNVERIFIED
            return Verification(False, False, f"trust file unavailable: {self.error}")
        now_ms = int(self.clock() * 1000)
        if now_ms - self._expired_ms >= receiver.policy.max_age_ms // 2:
            # routes silent past the freshness window: their replay entries can go, as
            # anything as old is refused as stale before the window is asked
            receiver = receiver.expire(now_ms)
            self._expired_ms = now_ms
        verdict, self._receiver = receiver.receive(value, prefix, now_ms, decoded=adv)
        if verdict.reason not in (Reason.OK, Reason.DUPLICATE):
            return Verification(False, False, f"{verdict.reason.value}: {verdict.detail}")
        if verdict.unheld_group_key is not None:
            return Verification(True, True, unheld_group_key=verdict.unheld_group_key)
        opened = verdict.advertisement
        if (
            self.group_keys is None
            or adv.get(wire.SealedCache) is None
            or opened is None
            or opened.get(wire.SealedCache) is not None  # an algorithm this code lacks
        ):
            return Verification(True, True)
        return Verification(True, True, opened=wire.encode(opened))

    def status(self) -> dict[str, Any]:
        """For the snapshot: what the trust file gives now, and the tallies."""
        if self._absent:
            state = "absent: accepting unverified"
        elif self._receiver is None:
            state = "unavailable: refusing every value"
        elif self.error:
            state = "verifying with the last good store"
        else:
            state = "verifying"
        out: dict[str, Any] = {
            "path": str(self.path),
            "state": state,
            "loads": self.loads,
            "reload_failures": self.reload_failures,
            "error": self.error,
        }
        if self._receiver is not None:
            counts = self._receiver.counters.as_dict()
            out["verdicts"] = {k: n for k, n in counts.items() if n}
        return out


@dataclasses.dataclass(frozen=True)
class Entry:
    """The accepted state a route carries."""

    peer: str
    prefix: Prefix
    advertisement: wire.Advertisement
    value: bytes
    flags: int
    verified: bool
    received_at: float
    as_path: tuple[int, ...] = ()
    # the value with its sealed cache section opened (the receiver holds the group key);
    # a C-PS beside it reads this instead of `value`. Its Signature TLV names the signer
    # the receiver verified, over the sealed octets of `value`, not over these
    opened_value: bytes | None = None

    def to_json(self) -> dict[str, Any]:
        adv = self.advertisement
        out = {
            "peer": self.peer,
            "prefix": str(self.prefix),
            "origin": str(adv.origin.address),
            "cs_id": adv.origin.cs_id,
            "site_id": adv.origin.site_id,
            "epoch": adv.sequence.epoch,
            "sequence": adv.sequence.sequence,
            "timestamp_ms": adv.timestamp_ms,
            "flags": f"{self.flags:#04x}",
            "as_path": list(self.as_path),
            "bytes": len(self.value),
            "value": self.value.hex(),
            "verified": self.verified,
            "received_at": self.received_at,
        }
        if self.opened_value is not None:
            out["opened_value"] = self.opened_value.hex()
        return out


@dataclasses.dataclass(frozen=True)
class Change:
    """What a RIB update did, for the sink: accepted, withdrawn, refused, session."""

    kind: str  # accept | withdraw | treat-as-withdraw | stale | ignore | session
    peer: str
    prefix: Prefix | None = None
    entry: Entry | None = None
    reason: str = ""
    # an accept of the very value (and flags, AS path) the route already carried: BGP
    # re-sends UPDATEs; the event log then leaves the value's hex out
    unchanged: bool = False
    # one line for this many routes of one UPDATE that had no state (`prefix` is None)
    routes: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "peer": self.peer}
        if self.prefix is not None:
            out["prefix"] = str(self.prefix)
        if self.entry is not None:
            out["entry"] = self.entry.to_json()
            if self.unchanged:
                del out["entry"]["value"]
                out["entry"].pop("opened_value", None)
                out["unchanged"] = True
        if self.routes:
            out["routes"] = self.routes
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclasses.dataclass
class CacheRib:
    """Accepted cache state per (peer, route), with RFC 7606 handling of bad values."""

    verifier: Verifier | None = None
    entries: dict[tuple[str, Prefix], Entry] = dataclasses.field(default_factory=dict)
    sessions: dict[str, str] = dataclasses.field(default_factory=dict)
    # RFC 4724 helper: seconds a restarting peer's routes are kept, marked stale; 0: none.
    restart_time: float = 0.0
    stale: dict[tuple[str, Prefix], float] = dataclasses.field(default_factory=dict)
    # what was dropped, refused or left unread, by kind (in the snapshot): `COUNTERS`
    counters: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # (peer, nlri as text) of every route ever accepted -> its key: an UPDATE's routes are
    # found by ExaBGP's text without parsing each (it writes prefixes in canonical form)
    _keys: dict[tuple[str, str], tuple[str, Prefix]] = dataclasses.field(
        default_factory=dict, repr=False
    )
    # the last value decoded and what came of it: one UPDATE's routes share one value
    _decoded: tuple[bytes, wire.Advertisement | wire.CodecError] | None = dataclasses.field(
        default=None, repr=False
    )

    def apply(self, event: Event, now: float) -> list[Change]:
        changes = self.expire(now)
        if isinstance(event, Unusable):
            self.counters["unusable_routes"] += 1
            return [*changes, Change("ignore", event.peer, reason=f"unusable: {event.reason}")]
        if isinstance(event, Session):
            self.sessions[event.peer] = event.state
            changes.append(Change("session", event.peer, reason=event.state))
            if event.state == "down":
                # RFC 4724 covers a closed TCP session (a restart); a hold timer that
                # expired means the peer is unreachable: withdraw (RFC 8538 not done).
                helper = self.restart_time > 0 and not _HOLD_TIMER.search(event.reason)
                for key in [k for k in self.entries if k[0] == event.peer]:
                    if helper:  # graceful restart: keep, marked stale
                        self.stale[key] = now + self.restart_time
                        changes.append(
                            Change(
                                "stale",
                                event.peer,
                                key[1],
                                self.entries[key],
                                "session down, graceful restart",
                            )
                        )
                        continue
                    del self.entries[key]
                    changes.append(Change("withdraw", event.peer, key[1], reason="session down"))
            return changes
        if isinstance(event, EndOfRib):
            return changes + self._drop_stale(lambda k: k[0] == event.peer, "not resent by EoR")
        if isinstance(event, AnnouncedMany):
            return changes + self._apply_many(event, now)
        return changes + self._apply_route(event, now)

    def _decode(self, value: bytes) -> wire.Advertisement:
        """`wire.decode(value)`, once for the routes of one UPDATE (the same bytes object)."""
        memo = self._decoded
        if memo is None or memo[0] is not value:
            try:
                memo = (value, wire.decode(value))
            except wire.CodecError as exc:
                memo = (value, exc)
            self._decoded = memo
        if isinstance(memo[1], wire.CodecError):
            raise memo[1]
        return memo[1]

    def _verifying(self) -> bool:
        return self.verifier is not None and bool(getattr(self.verifier, "verifying", True))

    def _refusal(self, event: Announced | AnnouncedMany) -> str:
        """Why the value of an announcement is malformed, or "" (RFC 7606, once)."""
        if event.malformed:
            return f"malformed: {event.malformed}"
        wanted = wire.FLAG_OPTIONAL | wire.FLAG_TRANSITIVE
        if event.flags is not None and event.flags & wanted != wanted:
            return (
                f"malformed: attribute flags {event.flags:#04x} "
                f"lack optional+transitive ({wanted:#04x})"
            )
        assert event.value is not None
        try:
            self._decode(event.value)
        except wire.CodecError as exc:
            return f"malformed ({wire.error_action(exc).name.lower()}): {exc}"
        return ""

    def _apply_many(self, event: AnnouncedMany, now: float) -> list[Change]:
        """The routes of one UPDATE: the value judged once. A signature covers one route,
        so a verifying receiver refuses a value found on several (the draft's Verification
        section) without checking it; without verification each route keeps it as one
        announced alone would."""
        n = len(event.nlri)
        if event.value is None and not event.malformed:
            return self._drop_many(event, "ignore", "no cache attribute")
        reason = self._refusal(event)
        if not reason and self._verifying():
            reason = (
                f"not verified: not-authorised: one value on {n} routes of one UPDATE "
                "(a signature covers one route)"
            )
        if reason:
            self.counters["not_verified" if reason.startswith("not verified") else "malformed"] += n
            return self._drop_many(event, "treat-as-withdraw", reason)

        def announced(prefix: Prefix) -> Event:
            return Announced(
                event.peer, prefix, event.flags, event.value, event.as_path, event.malformed
            )

        out: list[Change] = []
        for one in _routes(event.peer, [{"nlri": t} for t in event.nlri], announced):
            out.extend(self.apply(one, now))
        return out

    def _drop_many(self, event: AnnouncedMany, kind: str, reason: str) -> list[Change]:
        """Remove what the routes of `event` carried: a line per route that had state (the
        RIB's consumers need its prefix), one line for all those that had none."""
        out: list[Change] = []
        quiet = 0
        for text in event.nlri:
            key = self._keys.get((event.peer, text))
            had = None
            if key is not None:
                self.stale.pop(key, None)
                had = self.entries.pop(key, None)
            if had is None:
                quiet += 1
                continue
            out.append(Change(kind, event.peer, had.prefix, had, reason))
        if quiet:
            out.append(Change(kind, event.peer, reason=reason, routes=quiet))
        return out

    def expire(self, now: float) -> list[Change]:
        """Drop stale routes whose restart time ran out (their peer never came back)."""
        return self._drop_stale(lambda k: self.stale[k] <= now, "restart time expired")

    def _drop_stale(self, which: Callable[[tuple[str, Prefix]], bool], why: str) -> list[Change]:
        out = []
        for key in [k for k in self.stale if which(k)]:
            del self.stale[key]
            had = self.entries.pop(key, None)
            out.append(Change("withdraw", key[0], key[1], had, f"stale: {why}"))
        return out

    def _apply_route(self, event: Announced | Withdrawn, now: float) -> list[Change]:
        key = (event.peer, event.prefix)
        self.stale.pop(key, None)  # resent or withdrawn: no longer stale
        if isinstance(event, Withdrawn):
            had = self.entries.pop(key, None)
            return [Change("withdraw", event.peer, event.prefix, had, "withdrawn")]
        if event.value is None and not event.malformed:
            had = self.entries.pop(key, None)
            return [Change("ignore", event.peer, event.prefix, had, "no cache attribute")]
        refusal = self._refusal(event)
        if refusal:
            return self._refuse(key, refusal)
        assert event.value is not None
        adv = self._decode(event.value)
        check = UNVERIFIED
        if self.verifier is not None:
            check = self.verifier(event.value, adv, event.prefix)
        if not check.accepted:
            return self._refuse(key, f"not verified: {check.reason}")
        entry = Entry(
            event.peer,
            event.prefix,
            adv,
            event.value,
            event.flags or 0,
            check.verified,
            now,
            event.as_path,
            check.opened,
        )
        had = self.entries.get(key)
        self._keys[(event.peer, str(event.prefix))] = key
        unchanged = (
            had is not None
            and had.value == entry.value
            and had.flags == entry.flags
            and had.as_path == entry.as_path
            and had.verified == entry.verified
        )
        self.entries[key] = entry
        note = ""
        sealed = adv.get(wire.SealedCache)
        if sealed is not None and not sealed.has_known_algorithm:
            self.counters["unknown_sealing_algorithm"] += 1
            note = f"sealed cache section not opened: unknown sealing algorithm {sealed.algorithm}"
        elif check.opened is not None:
            self.counters["sealed_opened"] += 1
            note = "sealed cache section opened"
        elif check.unheld_group_key is not None:
            self.counters["unheld_group_key"] += 1
            key_id = check.unheld_group_key
            note = f"sealed cache section not opened: group key {key_id} is not held"
        return [Change("accept", event.peer, event.prefix, entry, note, unchanged)]

    def _refuse(self, key: tuple[str, Prefix], reason: str) -> list[Change]:
        # RFC 7606 section 2: treat-as-withdraw; the session is left alone.
        self.counters["not_verified" if reason.startswith("not verified") else "malformed"] += 1
        had = self.entries.pop(key, None)
        return [Change("treat-as-withdraw", key[0], key[1], had, reason)]

    def by_origin(self) -> dict[str, list[Entry]]:
        out: dict[str, list[Entry]] = {}
        for entry in self.entries.values():
            out.setdefault(str(entry.advertisement.origin.address), []).append(entry)
        return out

    def to_json(self) -> dict[str, Any]:
        out = {
            "sessions": dict(self.sessions),
            "routes": [
                {**e.to_json(), "stale": k in self.stale}
                for k, e in sorted(self.entries.items(), key=str)
            ],
            "counters": dict(self.counters),
        }
        if isinstance(self.verifier, TrustFileVerifier):
            out["trust"] = self.verifier.status()
        return out


# ---- the API process ----------------------------------------------------------------


def run(
    lines: Iterable[str],
    rib: CacheRib,
    on_change: Callable[[Change], None],
    *,
    type_code: int = DEFAULT_ATTRIBUTE_TYPE,
    clock: Callable[[], float] = time.time,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> None:
    verifier = rib.verifier
    if isinstance(verifier, TrustFileVerifier) and verifier.policy.attribute_type != type_code:
        raise ValueError(
            f"the trust-file verifier checks signatures for attribute type "
            f"{verifier.policy.attribute_type}, the attribute is read as type {type_code}"
        )
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
            events = parse_message(obj, type_code)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            rib.counters["unparsed_messages"] += 1
            log(f"cannot parse ExaBGP message ({type(exc).__name__}: {exc}): {line[:200]}")
            continue
        for event in events:
            for change in rib.apply(event, clock()):
                on_change(change)


EVENTS_MAX_BYTES = 64 * 2**20


class FileSink:
    """Appends each change to `events.jsonl` and rewrites `rib.json` atomically: after
    every change, or with `coalesce` only on `flush()`. `rib.json` is the whole RIB, so
    a rewrite per change costs O(RIB) each, O(n^2) for a burst (docs/scale.md: 20 ms a
    route at 1,240 routes); `main` coalesces and flushes whenever its input runs dry.

    The event log is bounded: a re-sent unchanged value is a short line (no value hex,
    `Change.unchanged`), and once the file reaches `events_max_bytes` it is renamed to
    `events.jsonl.1` (replacing the one before) and a new one is started, so the two
    together stay under twice the limit whatever peers send."""

    def __init__(
        self,
        directory: str | Path,
        rib: CacheRib,
        *,
        coalesce: bool = False,
        events_max_bytes: int = EVENTS_MAX_BYTES,
        private: bool = False,
    ) -> None:
        if events_max_bytes <= 0:
            raise ValueError(f"events_max_bytes {events_max_bytes} is not above 0")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rib = rib
        self.coalesce = coalesce
        self.dirty = False
        self.events_max_bytes = events_max_bytes
        self.events_path = self.dir / "events.jsonl"
        # private: the files hold opened cache state, for the owner's eyes only
        self.private = private
        self.events = self._open_events()
        self._events_bytes = self.events_path.stat().st_size
        self.rotations = 0
        self._counted: dict[str, int] = {}
        self.write_snapshot()

    def __call__(self, change: Change) -> None:
        record = change.to_json()
        record["time"] = time.time()
        line = json.dumps(record) + "\n"  # ASCII (json escapes the rest): chars are bytes
        if self._events_bytes and self._events_bytes + len(line) > self.events_max_bytes:
            self._rotate()
        self.events.write(line)
        self.events.flush()
        self._events_bytes += len(line)
        if self.coalesce:
            self.dirty = True
        else:
            self.write_snapshot()

    def _rotate(self) -> None:
        """events.jsonl becomes events.jsonl.1 (the older one goes); start a new one."""
        self.events.close()
        self.events_path.replace(self.dir / "events.jsonl.1")
        self.events = self._open_events()
        self._events_bytes = 0
        self.rotations += 1

    def _create(self, path: Path, flags: int) -> int:
        """A descriptor of `path`, mode 0600 when private (also a file already there),
        else as the umask makes it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600 if self.private else 0o666)
        if self.private:
            os.fchmod(fd, 0o600)
        return fd

    def _open_events(self) -> IO[str]:
        return os.fdopen(self._create(self.events_path, os.O_APPEND), "a")

    def flush(self) -> None:
        """Write the snapshot if a change (or a count, e.g. a message that did not parse)
        is not in it yet."""
        if self.dirty or self.rib.counters != self._counted:
            self.dirty = False
            self.write_snapshot()

    def write_snapshot(self) -> None:
        self._counted = dict(self.rib.counters)
        tmp = self.dir / "rib.json.tmp"
        with os.fdopen(self._create(tmp, os.O_TRUNC), "w") as out:
            out.write(json.dumps(self.rib.to_json(), indent=1))
        tmp.replace(self.dir / "rib.json")


def drained(stream: IO[str], on_idle: Callable[[], None]) -> Iterator[str]:
    """The lines of `stream`; `on_idle()` runs before each read that would wait for
    more input, and at its end: a burst is taken in whole, then written out once."""
    fd = stream.fileno()
    while True:
        if not select.select([fd], [], [], 0)[0]:
            on_idle()
        line = stream.readline()
        if not line:
            on_idle()
            return
        yield line


def _tee(lines: Iterable[str], path: Path) -> Iterable[str]:
    with open(path, "a") as raw:
        for line in lines:
            raw.write(line)
            raw.flush()
            yield line


def _group_keys(p: argparse.ArgumentParser, paths: list[str]) -> Any:
    """The keyring of `--group-key` files (the first active, a second standby)."""
    from catsproto import security

    keys = []
    for path in paths:
        try:
            keys.append(
                security.GroupKey.from_json(json.loads(read_secret_file(path, "group key file")))
            )
        except OSError as exc:
            p.error(f"--group-key {path}: cannot read it: {exc.strerror}")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            p.error(f"--group-key {path}: not a group key file: {exc}")
    try:
        return security.GroupKeyring.of(keys)
    except ValueError as exc:
        p.error(f"--group-key: {exc}")


def main(argv: list[str] | None = None) -> int:
    from catsproto.adapters.cli_args import attribute_type_code

    sys.stdout = sys.stderr  # ExaBGP would read anything on our stdout as a command
    p = argparse.ArgumentParser(description="ExaBGP API process receiving cache state")
    p.add_argument("--out", required=True, help="directory for events.jsonl and rib.json")
    p.add_argument(
        "--type-code",
        type=attribute_type_code,
        default=DEFAULT_ATTRIBUTE_TYPE,
        help="attribute type code to read and to verify signatures for, 0..255",
    )
    p.add_argument(
        "--events-max-bytes",
        type=int,
        default=EVENTS_MAX_BYTES,
        metavar="BYTES",
        help="rotate events.jsonl to events.jsonl.1 when it would grow past this size",
    )
    trust = p.add_mutually_exclusive_group()
    trust.add_argument(
        "--trust",
        help="trust file (catsproto.security), read when it changes; until it loads every "
        "value is refused, and a later bad or missing file keeps the last good one",
    )
    trust.add_argument(
        "--trust-when-present",
        metavar="TRUST",
        help="lab only: like --trust, but while the file does not exist values are "
        "accepted unverified",
    )
    p.add_argument(
        "--group-key",
        action="append",
        default=[],
        metavar="FILE",
        help="group key file (`catsproto keygen --group ID`): verified sealed cache "
        "sections under it are opened and rib.json gives each route's opened_value; "
        "twice for the active and a standby key during a rotation; needs --trust or "
        "--trust-when-present; rib.json and events.jsonl are then written mode 0600",
    )
    p.add_argument("--raw", action="store_true", help="also keep ExaBGP's lines in raw.jsonl")
    p.add_argument(
        "--graceful-restart",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep a downed peer's routes this long, marked stale, until its End-of-RIB "
        "(RFC 4724; configure the same capability on the session)",
    )
    args = p.parse_args(argv)
    if args.events_max_bytes <= 0:
        p.error(f"--events-max-bytes {args.events_max_bytes}: give a size above 0")
    keyring = None
    if args.group_key:
        if not (args.trust or args.trust_when_present):
            p.error("--group-key: opening sealed sections needs --trust or --trust-when-present")
        keyring = _group_keys(p, args.group_key)
    verifier = None
    if args.trust or args.trust_when_present:
        verifier = TrustFileVerifier(
            args.trust or args.trust_when_present,
            optional=bool(args.trust_when_present),
            attribute_type=args.type_code,
            group_keys=keyring,
        )
    rib = CacheRib(
        verifier=verifier,
        restart_time=args.graceful_restart,
    )
    sink = FileSink(
        args.out,
        rib,
        coalesce=True,
        events_max_bytes=args.events_max_bytes,
        private=keyring is not None,
    )
    lines: Iterable[str] = drained(sys.stdin, sink.flush)
    if args.raw:
        lines = _tee(lines, Path(args.out) / "raw.jsonl")
    with contextlib.suppress(KeyboardInterrupt):
        run(lines, rib, sink, type_code=args.type_code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
