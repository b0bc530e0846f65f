"""The Ed25519 verification rules the draft states (Signature TLV), measured on the code.

`PublicKey.verify` is what the receiver checks node signatures with and what the trust
store checks operator signatures with. Each test forges one edge case with the plain
curve arithmetic of `tests/ed25519_points.py` and asserts the verdict the draft gives;
if the library under the code changed its behaviour, one of these fails and the draft's
text has to be measured again.
"""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from catsproto.security import KeyFormatError, SigningKey, TrustStore
from catsproto.security.errors import BadDelegationError
from catsproto.security.identity import PublicKey, has_small_order, key_id
from catsproto.security.trust import authorise
from tests.ed25519_points import (
    BASE,
    IDENTITY,
    L,
    P,
    add,
    decode,
    encode,
    equal,
    mul,
    secret_scalar,
    sign_as,
    small_order_points,
)

SEED = bytes(range(32))
MESSAGE = b"the octets an advertisement's signature covers"


def _as_held(raw: bytes) -> PublicKey:
    """A public key as the library loads it, without the small-order refusal of
    `PublicKey.from_bytes`: to measure what verification alone does with such a key."""
    return PublicKey(raw, key_id(raw), Ed25519PublicKey.from_public_bytes(raw))


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.from_seed(SEED)


def test_the_arithmetic_here_is_the_library_s(key: SigningKey) -> None:
    a, prefix = secret_scalar(SEED)
    assert encode(mul(a, BASE)) == key.public.raw
    assert sign_as(a, prefix, key.public.raw, MESSAGE)[0] == key.sign(MESSAGE)
    assert key.public.verify(key.sign(MESSAGE), MESSAGE)


@pytest.mark.parametrize("extra", [L, 2 * L, 8 * L])
def test_an_s_of_l_or_more_is_refused_not_reduced(key: SigningKey, extra: int) -> None:
    sig = key.sign(MESSAGE)
    s = int.from_bytes(sig[32:], "little")
    assert (s + extra) % L == s  # the same S mod L: a lenient verifier would accept it
    assert not key.public.verify(sig[:32] + (s + extra).to_bytes(32, "little"), MESSAGE)


def test_r_is_compared_by_its_canonical_encoding() -> None:
    """Under the identity key, R = identity and S = 0 satisfy the equation; the same R
    written with y = p + 1 (not canonical) does not verify."""
    identity = _as_held(encode(IDENTITY))
    assert identity.verify(encode(IDENTITY) + bytes(32), MESSAGE)
    assert not identity.verify((1 + P).to_bytes(32, "little") + bytes(32), MESSAGE)


def test_the_equation_is_the_cofactorless_one(key: SigningKey) -> None:
    """A key with a torsion part (A + T, T of order 8): a signature made with the key's
    scalar satisfies [8][S]B = [8]R + [8][k]A' always, [S]B = R + [k]A' only when
    [k]T is the identity (k a multiple of 8). Only the second kind verifies."""
    a, prefix = secret_scalar(SEED)
    torsion = small_order_points()[1]
    mixed = encode(add(mul(a, BASE), torsion))
    public = PublicKey.from_bytes(mixed)
    verdicts: dict[bool, set[bool]] = {True: set(), False: set()}
    for i in range(64):
        message = MESSAGE + bytes([i])
        sig, k = sign_as(a, prefix, mixed, message)
        verdicts[k % 8 == 0].add(public.verify(sig, message))
    assert verdicts == {True: {True}, False: {False}}


def test_a_non_canonical_key_is_its_point_but_hashed_as_written() -> None:
    """A key written with y of p or more is taken as y mod p, and k = SHA-512(R || A ||
    M) hashes A's octets as held, not re-encoded. Seen on a point of order 4 (y = 0),
    written canonically (y = 0) and not (y = p): a forgery R = [S]B verifies under a key
    exactly when 4 divides the k of that key's octets."""
    canonical, written = bytes(32), P.to_bytes(32, "little")
    point = decode(canonical)
    assert point is not None and equal(mul(4, point), IDENTITY)
    assert decode(written) is not None and equal(decode(written), point)  # type: ignore[arg-type]
    keys = {raw: _as_held(raw) for raw in (canonical, written)}
    s = 777
    big_r = encode(mul(s, BASE))
    seen = set()
    for i in range(64):
        message = MESSAGE + bytes([i])
        for raw, public in keys.items():
            k = int.from_bytes(hashlib.sha512(big_r + raw + message).digest(), "little") % L
            verdict = public.verify(big_r + s.to_bytes(32, "little"), message)
            assert verdict == (k % 4 == 0), (raw.hex(), i)
            seen.add(verdict)
    assert seen == {True, False}


def test_a_key_off_the_curve_loads_and_verifies_nothing(key: SigningKey) -> None:
    y = 2
    while decode(y.to_bytes(32, "little")) is not None:
        y += 1
    off = PublicKey.from_bytes(y.to_bytes(32, "little"))
    assert not off.verify(key.sign(MESSAGE), MESSAGE)
    assert not off.verify(encode(IDENTITY) + bytes(32), MESSAGE)


@pytest.mark.parametrize("index", range(8))
def test_a_small_order_key_verifies_a_forgery_so_it_is_refused_on_load(index: int) -> None:
    """The draft: verification alone does not refuse keys of small order, and they
    verify signatures nobody made (no key RFC 8032 generates has small order), so a
    receiver may refuse them when it loads them, and this one does. A forgery: R = [S]B
    for any S, on a message whose k makes [k]T the identity."""
    torsion = small_order_points()[index]
    raw = encode(torsion)
    with pytest.raises(KeyFormatError, match="small order"):
        PublicKey.from_bytes(raw)
    public = _as_held(raw)
    s = 4242
    big_r = encode(mul(s, BASE))
    for i in range(256):
        message = MESSAGE + i.to_bytes(2, "big")
        k = int.from_bytes(hashlib.sha512(big_r + raw + message).digest(), "little") % L
        if equal(mul(k, torsion), IDENTITY):
            assert public.verify(big_r + s.to_bytes(32, "little"), message)
            return
    raise AssertionError("no message gave a k that the torsion point's order divides")


def _encodings(raw: bytes) -> set[bytes]:
    """Every 32-octet encoding of the point `raw` encodes: y and y + p (where that fits
    in 255 bits), each with the sign bit clear and set."""
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    out = set()
    for yy in (y, y + P):
        if yy < 1 << 255:
            for sign in (0, 1 << 255):
                out.add((yy | sign).to_bytes(32, "little"))
    return out


def test_every_encoding_of_a_small_order_point_is_refused_and_nothing_else_is(
    key: SigningKey,
) -> None:
    """The eight points and their other encodings (non-canonical y, either sign bit) are
    all refused; a generated key, a key with a torsion part and keys near them are not."""
    refused = set()
    for q in small_order_points():
        for raw in _encodings(encode(q)):
            assert has_small_order(raw), raw.hex()
            with pytest.raises(KeyFormatError):
                PublicKey.from_bytes(raw)
            refused.add(raw)
    assert len(refused) == 14  # 5 y values, 2 more as y + p (y = 0, 1), each with both signs
    a, _ = secret_scalar(SEED)
    mixed = encode(add(mul(a, BASE), small_order_points()[1]))
    for raw in (key.public.raw, mixed, (2).to_bytes(32, "little"), (P - 2).to_bytes(32, "little")):
        assert not has_small_order(raw)
    assert PublicKey.from_bytes(mixed).raw == mixed


def test_a_trust_store_refuses_a_small_order_operator_key_and_its_delegation(
    key: SigningKey,
) -> None:
    """An operator key of small order is refused when the trust configuration loads; a
    Delegation TLV of a small-order node key, though signed by a real operator, is
    refused as a bad delegation and authorises nothing."""
    with pytest.raises(KeyFormatError, match="small order"):
        TrustStore().with_operator(encode(IDENTITY))
    store = TrustStore().with_operator(key.public.raw)
    for q in small_order_points():
        delegation = authorise(
            key,
            encode(q),
            cs_ids=[1],
            routes=["10.0.0.0/8"],
            addresses=["10.0.0.0/8"],
            not_before_ms=0,
            not_after_ms=1 << 40,
        )
        with pytest.raises(BadDelegationError, match="small order"):
            store.with_delegation(delegation)
    good = SigningKey.from_seed(bytes(32))
    fine = authorise(
        key,
        good.public.raw,
        cs_ids=[1],
        routes=["10.0.0.0/8"],
        addresses=["10.0.0.0/8"],
        not_before_ms=0,
        not_after_ms=1 << 40,
    )
    assert store.with_delegation(fine).lookup(good.key_id) is not None
