"""Edwards25519 arithmetic, slow and plain, to forge the edge cases of Ed25519 verification.

The library the code verifies with cannot make a signature with a non-canonical S, a
public key of small order or one with a torsion component; these helpers can, so the
tests can measure what `catsproto.security.PublicKey.verify` accepts (the rules the
draft states). Points are extended coordinates (X, Y, Z, T) on -x^2 + y^2 = 1 + d x^2 y^2
over GF(2^255 - 19), as in RFC 8032, Section 5.1. Never used outside the tests.
"""

from __future__ import annotations

import hashlib

P = 2**255 - 19
L = 2**252 + 27742317777372353535851937790883648493  # the prime order of the base point
D = -121665 * pow(121666, P - 2, P) % P
SQRT_M1 = pow(2, (P - 1) // 4, P)

Point = tuple[int, int, int, int]
IDENTITY: Point = (0, 1, 1, 0)


def add(a: Point, b: Point) -> Point:
    x1, y1, z1, t1 = a
    x2, y2, z2, t2 = b
    aa = (y1 - x1) * (y2 - x2) % P
    bb = (y1 + x1) * (y2 + x2) % P
    cc = 2 * D * t1 * t2 % P
    dd = 2 * z1 * z2 % P
    e, f, g, h = bb - aa, dd - cc, dd + cc, bb + aa
    return (e * f % P, g * h % P, f * g % P, e * h % P)


def mul(n: int, q: Point) -> Point:
    out = IDENTITY
    while n:
        if n & 1:
            out = add(out, q)
        q = add(q, q)
        n >>= 1
    return out


def equal(a: Point, b: Point) -> bool:
    return (a[0] * b[2] - b[0] * a[2]) % P == 0 and (a[1] * b[2] - b[1] * a[2]) % P == 0


def x_of(y: int, sign: int) -> int | None:
    """The x with the given sign bit for `y`, or None when `y` is not on the curve."""
    u, v = (y * y - 1) % P, (D * y * y + 1) % P
    x = u * pow(v, 3, P) * pow(u * pow(v, 7, P), (P - 5) // 8, P) % P
    if (v * x * x - u) % P:
        x = x * SQRT_M1 % P
    if (v * x * x - u) % P:
        return None
    if x == 0 and sign:
        return None
    return P - x if x & 1 != sign else x


def decode(raw: bytes) -> Point | None:
    """The point of a 32-octet encoding, y taken as it is (a y of p or more included)."""
    n = int.from_bytes(raw, "little")
    y, sign = n & ((1 << 255) - 1), n >> 255
    x = x_of(y % P, sign)
    return None if x is None else (x, y % P, 1, x * y % P)


def encode(q: Point) -> bytes:
    zi = pow(q[2], P - 2, P)
    x, y = q[0] * zi % P, q[1] * zi % P
    return (y | (x & 1) << 255).to_bytes(32, "little")


BASE = decode((4 * pow(5, P - 2, P) % P).to_bytes(32, "little"))
assert BASE is not None


def _h(*parts: bytes) -> int:
    return int.from_bytes(hashlib.sha512(b"".join(parts)).digest(), "little")


def secret_scalar(seed: bytes) -> tuple[int, bytes]:
    """RFC 8032's clamped scalar of a seed and the prefix that derives nonces."""
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little")
    a &= (1 << 254) - 8
    a |= 1 << 254
    return a, h[32:]


def sign_as(a: int, prefix: bytes, public: bytes, message: bytes) -> tuple[bytes, int]:
    """A signature by scalar `a` under the encoding `public` (which need not be [a]B, so
    a key with a torsion part can be forged), and its challenge k."""
    r = _h(prefix, message) % L
    big_r = encode(mul(r, BASE))
    k = _h(big_r, public, message) % L
    return big_r + ((r + k * a) % L).to_bytes(32, "little"), k


def small_order_points() -> list[Point]:
    """The eight points of order dividing 8 (the torsion subgroup)."""
    torsion: Point | None = None
    y = 2
    while torsion is None:
        q = decode(y.to_bytes(32, "little"))
        if q is not None:
            t = mul(L, q)
            if not equal(mul(4, t), IDENTITY):
                torsion = t  # of order exactly 8
        y += 1
    return [mul(i, torsion) for i in range(8)]
