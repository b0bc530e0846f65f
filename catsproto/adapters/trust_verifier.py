"""Verifying a received value against a trust file that may change under the daemon.

Strategy: `TrustFileVerifier` is what the receive daemon's RIB (`cache_rib.CacheRib`)
asks about each value on each route. It wraps `catsproto.security.Receiver` (signature,
scope, freshness, replay) and owns the file: reloaded when its stamp changes, the last
good store kept when a reload fails, fail-closed before the first good load. The
`Verifier` protocol is what any other checker plugs in as.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from catsproto import wire
from catsproto.adapters.exabgp_json import Prefix
from catsproto.adapters.file_modes import read_trust_file
from catsproto.wire import DEFAULT_ATTRIBUTE_TYPE


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

    def presign(self, value: bytes, prefix: Prefix) -> Any:
        """`security.presign` of `value` on `prefix` against the trust file as it is now
        (a verifier pool's worker runs this); None while there is no store to ask."""
        from catsproto import security

        receiver = self._current()
        if receiver is None:
            return None
        return security.presign(value, prefix, receiver.trust, receiver.policy)

    def __call__(
        self, value: bytes, adv: wire.Advertisement, prefix: Prefix, presigned: Any = None
    ) -> Verification:
        """The verdict on `value` for `prefix`; `presigned`: `presign` of these very
        bytes and route, done ahead in another process (see `Receiver.receive`)."""
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
        verdict, self._receiver = receiver.receive(
            value, prefix, now_ms, decoded=adv, presigned=presigned
        )
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
