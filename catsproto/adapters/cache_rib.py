"""The receive daemon's RIB: accepted cache state per (peer, route), RFC 7606 handling.

Strategy: `CacheRib` applies the events of `exabgp_json` in order, keyed by (peer,
route). A value that fails to decode or verify is RFC 7606 treat-as-withdraw of the
state that route carried (that origin's cache state, nobody else's) and the BGP session
is untouched; a session going down withdraws that peer's routes, or keeps them marked
stale for a graceful restart. An UPDATE's value is judged once for all its routes. Every
application returns `Change`s for a sink. Pure: the clock comes in as `now`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from catsproto import wire
from catsproto.adapters.exabgp_json import (
    Announced,
    AnnouncedMany,
    EndOfRib,
    Event,
    Prefix,
    Session,
    Unusable,
    Withdrawn,
    _routes,
)
from catsproto.adapters.trust_verifier import UNVERIFIED, TrustFileVerifier, Verifier

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

# NOTIFICATION error code 4 is Hold Timer Expired (RFC 4271 section 4.5); ExaBGP reports
# "notification sent (4,0)" when its own hold timer ran out.
_HOLD_TIMER = re.compile(r"hold timer|notification (sent|received) \(4,", re.IGNORECASE)


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

    def apply(self, event: Event, now: float, presigned: Any = None) -> list[Change]:
        """The changes `event` makes at `now`. `presigned`: for an `Announced`, the
        signature check of its value and route done ahead (`TrustFileVerifier.presign`
        in a verifier pool), handed on to the verifier."""
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
        return changes + self._apply_route(event, now, presigned)

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

    def _apply_route(
        self, event: Announced | Withdrawn, now: float, presigned: Any = None
    ) -> list[Change]:
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
            if presigned is None:
                check = self.verifier(event.value, adv, event.prefix)
            else:  # only a verifier that presigns (TrustFileVerifier) is handed one
                call: Any = self.verifier
                check = call(event.value, adv, event.prefix, presigned)
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
