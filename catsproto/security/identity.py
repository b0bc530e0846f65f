"""Ed25519 keys, their key ids and their JSON file form.

A key id is derived, never chosen: the first 8 bytes of
``SHA-256("catsproto/v1 key-id" 0x00 || algorithm u8 || public key)``. So a receiver
that holds a public key computes its id itself, and two keys cannot share an id by
accident. Private keys are created from a 32-byte seed the caller draws
(``os.urandom(32)``); nothing here draws randomness or touches files.
"""

from __future__ import annotations

import dataclasses

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from catsproto.wire.fields import JSON
from catsproto.wire.tlvs import ED25519_PUBLIC_KEY_LEN, KEY_ID_LABEL, KEY_ID_LEN, key_id

__all__ = ["KEY_ID_LABEL", "KEY_ID_LEN", "key_id"]  # the derivation lives with the TLVs
SEED_LEN = 32
PRIVATE_KEY_FORMAT = "catsproto-ed25519-private/1"


class KeyFormatError(ValueError):
    """A key or key file that cannot be used (wrong length, wrong format, small order)."""


_P = 2**255 - 19
# the y coordinates of the eight points whose order divides 8 (each y has at most two
# points, both of small order): 1 (the identity), p - 1 (order 2), 0 (order 4) and the
# two of order 8. Any signature can be made to verify under such a key.
_SMALL_ORDER_Y = frozenset(
    {
        0,
        1,
        _P - 1,
        0x05FC536D880238B13933C6D305ACDFD5F098EFF289F4C345B027B2C28F95E826,
        0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7,
    }
)


def has_small_order(raw: bytes) -> bool:
    """True if the 32 octets encode a point of small order, in any encoding: the sign
    bit is ignored and y is read modulo p, as verification decodes it."""
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    return y % _P in _SMALL_ORDER_Y


def x_zero_with_sign(raw: bytes) -> bool:
    """True if the octets name x = 0 with the sign bit set (y is 1 or p - 1, read modulo
    p): RFC 8032, Section 5.1.3, step 4, refuses to decode them, so they verify nothing
    (draft, Signature TLV, rule 5). The library under this code decodes them as the
    point with x = 0 and would verify forgeries under the one of y = 1; hence this check."""
    n = int.from_bytes(raw, "little")
    return n >> 255 == 1 and (n & ((1 << 255) - 1)) % _P in (1, _P - 1)


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Ed25519 verification of octets as the draft's rules 1-5 (Signature TLV) give it,
    for a key taken as it is: a key of small order is not refused here (rule 6 refuses
    it where keys are loaded, `PublicKey.from_bytes`). The vectors' verdicts come from
    this function."""
    if len(public_key) != ED25519_PUBLIC_KEY_LEN or x_zero_with_sign(public_key):
        return False
    try:
        key = Ed25519PublicKey.from_public_bytes(public_key)
        key.verify(signature, message)
    except (ValueError, InvalidSignature):
        return False
    return True


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class PublicKey:
    """An Ed25519 public key ready to verify (the parsed key object is kept, so a
    receiver pays the point decoding once per key, not once per advertisement)."""

    raw: bytes
    key_id: bytes
    _key: Ed25519PublicKey

    @classmethod
    def from_bytes(cls, raw: bytes) -> PublicKey:
        if len(raw) != ED25519_PUBLIC_KEY_LEN:
            raise KeyFormatError(f"Ed25519 public key is {len(raw)} bytes, not 32")
        if x_zero_with_sign(raw):
            raise KeyFormatError(
                "not an Ed25519 public key: x = 0 with the sign bit set does not decode "
                "(RFC 8032, Section 5.1.3)"
            )
        if has_small_order(raw):
            raise KeyFormatError(
                "Ed25519 public key of small order: signatures nobody made verify under it"
            )
        try:
            parsed = Ed25519PublicKey.from_public_bytes(raw)
        except ValueError as exc:
            raise KeyFormatError(f"not an Ed25519 public key: {exc}") from None
        return cls(bytes(raw), key_id(raw), parsed)

    def verify(self, signature: bytes, message: bytes) -> bool:
        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"PublicKey(key_id={self.key_id.hex()})"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SigningKey:
    """An Ed25519 private key, built from a 32-byte seed (RFC 8032 private key)."""

    seed: bytes
    public: PublicKey
    _key: Ed25519PrivateKey

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        if len(seed) != SEED_LEN:
            raise KeyFormatError(f"Ed25519 seed is {len(seed)} bytes, not {SEED_LEN}")
        private = Ed25519PrivateKey.from_private_bytes(seed)
        raw = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return cls(bytes(seed), PublicKey.from_bytes(raw), private)

    @property
    def key_id(self) -> bytes:
        return self.public.key_id

    def sign(self, message: bytes) -> bytes:
        """Deterministic Ed25519 (RFC 8032): the same message always gives the same bytes."""
        return self._key.sign(message)

    def to_json(self, name: str = "") -> JSON:
        """The private key file (keep it mode 0600): seed, public key, key id."""
        return {
            "format": PRIVATE_KEY_FORMAT,
            "name": name,
            "algorithm": "ed25519",
            "seed": self.seed.hex(),
            "public_key": self.public.raw.hex(),
            "key_id": self.key_id.hex(),
        }

    @classmethod
    def from_json(cls, obj: JSON) -> SigningKey:
        if not isinstance(obj, dict) or obj.get("format") != PRIVATE_KEY_FORMAT:
            raise KeyFormatError(f"not a private key file (format {PRIVATE_KEY_FORMAT})")
        try:
            key = cls.from_seed(bytes.fromhex(obj["seed"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise KeyFormatError(f"private key file: bad seed ({exc})") from None
        if "algorithm" in obj and obj["algorithm"] != "ed25519":
            raise KeyFormatError(
                f"private key file: algorithm {obj['algorithm']!r:.40} is not ed25519"
            )
        for field, want in (("public_key", key.public.raw), ("key_id", key.key_id)):
            if field in obj and obj[field] != want.hex():
                raise KeyFormatError(f"private key file: {field} does not match the seed")
        return key

    def __repr__(self) -> str:  # never print the seed
        return f"SigningKey(key_id={self.key_id.hex()})"
