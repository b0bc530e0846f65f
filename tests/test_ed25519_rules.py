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

from catsproto.security import SigningKey
from catsproto.security.identity import PublicKey
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
    identity = PublicKey.from_bytes(encode(IDENTITY))
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
    keys = {raw: PublicKey.from_bytes(raw) for raw in (canonical, written)}
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
def test_a_small_order_key_loads_and_verifies_a_forgery(index: int) -> None:
    """The draft: keys of small order are not refused on load and then verify signatures
    nobody made, so one must never be trusted (no key RFC 8032 generates has small
    order). A forgery: R = [S]B for any S, on a message whose k makes [k]T the identity."""
    torsion = small_order_points()[index]
    raw = encode(torsion)
    public = PublicKey.from_bytes(raw)
    s = 4242
    big_r = encode(mul(s, BASE))
    for i in range(256):
        message = MESSAGE + i.to_bytes(2, "big")
        k = int.from_bytes(hashlib.sha512(big_r + raw + message).digest(), "little") % L
        if equal(mul(k, torsion), IDENTITY):
            assert public.verify(big_r + s.to_bytes(32, "little"), message)
            return
    raise AssertionError("no message gave a k that the torsion point's order divides")
