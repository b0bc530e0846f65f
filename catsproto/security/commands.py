"""What `catsproto keygen | authorize | sign | seal | verify` do, without the IO.

Each function takes parsed inputs (JSON objects, bytes, strings) and the caller's
randomness and clock, and returns JSON or bytes; the CLI reads and writes the files.
Bad input raises `CommandError` (one line for stderr) or a `wire.CodecError`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from catsproto import wire
from catsproto.security.identity import KEY_ID_LEN, KeyFormatError, SigningKey, key_id
from catsproto.security.receiver import (
    DEFAULT_MAX_AGE_MS,
    DEFAULT_MAX_FUTURE_MS,
    Policy,
    Verdict,
    check,
)
from catsproto.security.replay import ReplayWindow
from catsproto.security.sealing import CACHE_SECTION, GroupKey, GroupKeyring, seal
from catsproto.security.signing import IPNetwork, sign
from catsproto.security.trust import (
    TRUST_FORMAT,
    TrustFileError,
    TrustStore,
    authorise,
    delegation_from_json,
    delegation_to_json,
)
from catsproto.wire.fields import JSON


class CommandError(Exception):
    """Input a security command cannot use; the message is one line for the user."""


def _network(text: str, what: str) -> IPNetwork:
    try:
        return ipaddress.ip_network(text)
    except ValueError as exc:
        raise CommandError(f"{what}: {exc}") from None


def parse_nlri(text: str) -> IPNetwork:
    try:
        return ipaddress.ip_network(text)
    except ValueError as exc:
        raise CommandError(f"route {text!r}: {exc}") from None


def _signing_key(obj: JSON) -> SigningKey:
    try:
        return SigningKey.from_json(obj)
    except KeyFormatError as exc:
        raise CommandError(str(exc)) from None


def keygen(seed: bytes, name: str = "") -> JSON:
    """A private key file from 32 random bytes (`os.urandom(32)`)."""
    return SigningKey.from_seed(seed).to_json(name)


def public_key(private_key: JSON) -> JSON:
    """What to hand to others: name, public key and key id (no seed)."""
    key = _signing_key(private_key)
    return {
        "name": private_key.get("name", ""),
        "public_key": key.public.raw.hex(),
        "key_id": key.key_id.hex(),
    }


def group_keygen(key_id: int, secret: bytes) -> JSON:
    """A group key file from a key id and 32 random bytes."""
    try:
        return GroupKey.of(key_id, secret).to_json()
    except ValueError as exc:
        raise CommandError(f"--group: {exc}") from None


def authorize(
    operator_key: JSON,
    node_public_key: str,
    *,
    cs_ids: list[int],
    routes: list[str],
    addresses: list[str],
    not_before_ms: int,
    not_after_ms: int,
    sites: list[int] | None = None,
) -> JSON:
    """The operator signs a node key's delegation; returns the delegation's JSON form.
    `sites`: the site ids the node may name in its Origin; none or empty: every site."""
    try:
        node = bytes.fromhex(node_public_key)
    except ValueError:
        raise CommandError(f"node public key {node_public_key[:80]!r} is not hex") from None
    d = authorise(
        _signing_key(operator_key),
        node,
        cs_ids=cs_ids,
        routes=[_network(x, "route") for x in routes],
        addresses=[_network(x, "address") for x in addresses],
        not_before_ms=not_before_ms,
        not_after_ms=not_after_ms,
        sites=_sites(sites or ()),
    )
    return delegation_to_json(d)


def _sites(sites: Iterable[int]) -> list[int]:
    out = list(sites)
    for s in out:
        if not 0 <= s <= 0xFFFFFFFF:
            raise CommandError(f"--site {s}: a site id is 0 to 4294967295")
    return out


def sign_value(
    value: bytes,
    node_key: JSON,
    nlri: IPNetwork,
    attribute_type: int = wire.DEFAULT_ATTRIBUTE_TYPE,
    delegation: JSON | None = None,
) -> bytes:
    """Sign an attribute value for `nlri`; with `delegation`, carry it in-band too."""
    adv = wire.decode(value)
    if delegation is not None:
        try:
            adv = adv.replace(delegation_from_json(delegation))
        except TrustFileError as exc:
            raise CommandError(str(exc)) from None
    return wire.encode(sign(adv, _signing_key(node_key), nlri, attribute_type))


def seal_value(value: bytes, group_keys: list[JSON], nonce: bytes) -> bytes:
    """Seal the cache section of an unsigned value under the first group key. A value
    without one is refused: asked to seal, the command must not hand back plaintext."""
    adv = wire.decode(value)
    keyring = _keyring(group_keys)
    if not any(t.type in CACHE_SECTION for t in adv.tlvs):
        raise CommandError(
            "nothing to seal: the value has no cache-section TLV "
            "(cache model, cache summaries, capacity or hot prefixes)"
        )
    return wire.encode(seal(adv, keyring, nonce))


def _keyring(group_keys: list[JSON]) -> GroupKeyring:
    try:
        keys = [GroupKey.from_json(k) for k in group_keys]
    except (KeyError, TypeError, ValueError) as exc:
        raise CommandError(f"group key file: {exc}") from None
    try:
        return GroupKeyring.of(keys)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def build_trust(
    operators: list[JSON],
    delegations: list[JSON],
    *,
    revoke: Sequence[str] = (),
    previous: JSON | None = None,
) -> JSON:
    """A trust file from operator public keys and delegations. `revoke`: node key ids
    (hex) to write into "revoked_keys". `previous`: the trust file this one replaces;
    its revoked keys stay revoked, and a node key it delegated that `delegations` does
    not is revoked too, so a removed key stays refused after a receiver restarts even
    if the node carries its still valid delegation in-band. A delegation of a revoked
    key is refused: a revoked key stays revoked (authorise a new key instead)."""
    revoked: set[bytes] = set()
    for text in revoke:
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise CommandError(f"--revoke {text[:40]!r} is not a hex key id") from None
        if len(raw) != KEY_ID_LEN:
            raise CommandError(f"--revoke {text[:40]!r} is {len(raw)} bytes, a key id is 8")
        revoked.add(raw)
    keys = []
    for i, d in enumerate(delegations):
        try:
            keys.append(key_id(delegation_from_json(d).node_key))
        except (TrustFileError, wire.CodecError) as exc:
            raise CommandError(f"delegation {i + 1}: {exc}") from None
    if previous is not None:
        try:
            before = TrustStore.from_json(previous)
        except TrustFileError as exc:
            raise CommandError(f"previous trust file: {exc}") from None
        revoked |= before.revoked | (before.authorisations.keys() - set(keys))
    for k in keys:
        if k in revoked:
            raise CommandError(
                f"delegation of key {k.hex()}, which is revoked; authorise a new key instead"
            )
    trust: dict[str, JSON] = {
        "format": TRUST_FORMAT,
        "operators": operators,
        "delegations": delegations,
    }
    if revoked:
        trust["revoked_keys"] = sorted(k.hex() for k in revoked)
    load_trust(trust)  # refuse to write a trust file that would not load
    return trust


def load_trust(obj: JSON) -> TrustStore:
    try:
        return TrustStore.from_json(obj)
    except TrustFileError as exc:
        raise CommandError(f"trust file: {exc}") from None


def verify_value(
    value: bytes,
    nlri: IPNetwork,
    trust: JSON,
    now_ms: int,
    *,
    max_age_ms: int = DEFAULT_MAX_AGE_MS,
    max_future_ms: int = DEFAULT_MAX_FUTURE_MS,
    attribute_type: int = wire.DEFAULT_ATTRIBUTE_TYPE,
    group_keys: list[JSON] | None = None,
) -> Verdict:
    """One advertisement against a trust file (a fresh replay window: a single
    message has nothing to be replayed against)."""
    policy = Policy(max_age_ms, max_future_ms, attribute_type)
    keyring = _keyring(group_keys) if group_keys else None
    return check(value, nlri, now_ms, load_trust(trust), ReplayWindow(), policy, keyring)
