"""Finish a C-SMA's routes for BGP: seal, sign, encode, spool; withdraw them at the end.

Strategy. The builder (`catsproto.node`) emits unsigned `RouteAdvertisement`s. Whoever
hands them to ExaBGP takes the same steps for each, in this order: seal the cache
section under the active group key when there is one (with a fresh random nonce, which
is why this is an adapter and not part of the pure `security` package), sign for the
route that will carry the value, encode. `SignedRoutes` does that once per route, writes
the value into an `exabgp_announce.Spool` when it has one, remembers every prefix it
spooled and withdraws them all in `withdraw_all`. The lab's engine sites
(`lab/engine_site.py`) and `catsproto instance node --signing-key --spool` share it.

Fresh spool files: nothing here touches files on a timer. The builder re-sends every
route at least once per dampening max interval (a new sequence and timestamp, so new
bytes), and each re-send rewrites the route's file. An announcer run with `--lease`
longer than that interval therefore withdraws only the routes of a node that stopped
without withdrawing them (killed, or its host gone).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from catsproto import security, wire
from catsproto.adapters.exabgp_announce import Spool
from catsproto.adapters.file_modes import read_secret_file
from catsproto.node import RouteAdvertisement
from catsproto.security.signing import IPNetwork


def sealed(adv: wire.Advertisement, group_keys: security.GroupKeyring | None) -> wire.Advertisement:
    """`adv` with its cache section sealed under `group_keys` (a fresh random nonce), or
    `adv` itself without keys or without a cache section."""
    if group_keys is None:
        return adv
    return security.seal(adv, group_keys, os.urandom(12))


def _key_json(path: str | Path, what: str) -> Any:
    """The JSON of a key file, refused (`FileModeError`) when group or others have any
    permission on it. OSError, or ValueError when it is not UTF-8 JSON."""
    raw = read_secret_file(path, what)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_signing_key(path: str | Path) -> security.SigningKey:
    """A node's private key file, as `catsproto keygen` writes it. OSError (a mode that
    lets others in is a `FileModeError`) or ValueError naming what is wrong."""
    return security.SigningKey.from_json(_key_json(path, "key file"))


def read_group_key(path: str | Path) -> security.GroupKey:
    """A group key file, as `catsproto keygen --group ID` writes it. OSError or
    ValueError, as `read_signing_key`."""
    return security.GroupKey.from_json(_key_json(path, "group key file"))


class SignedRoutes:
    """Each route a C-SMA emits, sealed (with `group_keys`), signed by `signer` for its
    own prefix and encoded; written into `spool` when there is one. Thread-safe."""

    def __init__(
        self,
        signer: security.SigningKey,
        *,
        group_keys: security.GroupKeyring | None = None,
        spool: Spool | None = None,
    ) -> None:
        self.signer, self.group_keys, self.spool = signer, group_keys, spool
        self.spooled: set[IPNetwork] = set()
        self._lock = threading.Lock()

    def value(self, route: RouteAdvertisement) -> bytes:
        """The attribute value that goes out on `route.prefix`."""
        adv = sealed(route.advertisement, self.group_keys)
        return wire.encode(security.sign(adv, self.signer, route.prefix))

    def publish(self, routes: Sequence[RouteAdvertisement]) -> list[bytes]:
        """Every route's value, in order; each also spooled (announced) when there is a
        spool."""
        values = [self.value(r) for r in routes]
        if self.spool is not None:
            with self._lock:
                for route, value in zip(routes, values, strict=True):
                    self.spool.publish(route.prefix, value)
                    self.spooled.add(route.prefix)
        return values

    def withdraw_all(self) -> int:
        """Withdraw every route spooled so far; returns how many there were."""
        with self._lock:
            count = len(self.spooled)
            if self.spool is not None:
                for prefix in self.spooled:
                    self.spool.withdraw(prefix)
            self.spooled.clear()
        return count
