"""Sealing a lab instance's cache section before it is signed (modelled and real engines)."""

from __future__ import annotations

import os

from catsproto import security, wire


def sealed(adv: wire.Advertisement, group_keys: security.GroupKeyring | None) -> wire.Advertisement:
    """`adv` with its cache section sealed under `group_keys` (a fresh random nonce), or
    `adv` itself without keys or without a cache section."""
    if group_keys is None:
        return adv
    return security.seal(adv, group_keys, os.urandom(12))
