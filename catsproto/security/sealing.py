"""Confidentiality of the cache section: AEAD under a group key of the authorised selectors.

Strategy: encrypt-then-sign. `seal` takes the cache-state TLVs out of an advertisement
(by default the whole cache section, types 32-35: cache model, summaries, capacity, hot
prefixes), encrypts their canonical encoding with ChaCha20-Poly1305 and puts one
`SealedCache` TLV (type 36) in their place; the origin then signs as usual. Transit
routers and captures see the origin, sequence, metrics and an opaque blob; any receiver
can still verify the signature; only holders of the group key learn which blocks are
cached. `open_sealed` reverses it.

- Plaintext: the sealed TLVs, header included, in canonical order (what `wire.encode`
  would write for them).
- Associated data: ``"catsproto/v1 sealed-cache" 0x00 || algorithm u8 || key id u32 ||
  Origin TLV || Sequence TLV`` (TLVs as on the wire), binding the ciphertext to its
  origin and sequence: it cannot be moved into another advertisement.
- Nonce: 12 bytes the caller draws at random for every seal (``os.urandom(12)``); never
  derive it from the sequence, which a restarted origin may repeat. Rotate the group key
  well before 2^32 seals under it (random-nonce collision bound).
- Rotation: the key id travels in the clear and a `GroupKeyring` holds at most two keys,
  the active one (used to seal) and a standby one (accepted when opening). Distribute the
  next key as standby everywhere, then make it active (`rotated`): the old key stays as
  standby until the next rotation, so advertisements in flight still open.
- Agility: the algorithm code is open (`SealedCache.has_known_algorithm`). A section
  sealed with an AEAD this code does not have is one no key here opens: `open_sealed`
  raises `UnknownSealingAlgorithmError` (a kind of unknown group key), and the receiver
  accepts the advertisement with the section unopened, as it does without group keys,
  so a sender that adds an algorithm keeps its metrics at old receivers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from catsproto import wire
from catsproto.security.errors import (
    DecryptionError,
    UnknownGroupKeyError,
    UnknownSealingAlgorithmError,
)
from catsproto.wire import (
    Advertisement,
    AeadAlgorithm,
    BadValueError,
    CodecError,
    Reader,
    SealedCache,
    TLVType,
    Writer,
)
from catsproto.wire.fields import JSON
from catsproto.wire.tlvs import CHACHA20_POLY1305_NONCE_LEN, MANDATORY

SEAL_LABEL = b"catsproto/v1 sealed-cache\x00"
GROUP_KEY_LEN = 32
GROUP_KEY_FORMAT = "catsproto-group-key/1"
CACHE_SECTION: tuple[int, ...] = (
    TLVType.CACHE_MODEL,
    TLVType.CACHE_SUMMARIES,
    TLVType.CAPACITY,
    TLVType.HOT_PREFIXES,
)
# Never sealed: what every receiver needs to check the advertisement, and the seal itself.
UNSEALABLE = frozenset(
    {cls.TYPE for cls in MANDATORY} | {TLVType.SEALED_CACHE, TLVType.DELEGATION, TLVType.SIGNATURE}
)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GroupKey:
    """A 32-byte ChaCha20-Poly1305 key shared by the authorised selectors, and its id."""

    key_id: int
    secret: bytes
    _aead: ChaCha20Poly1305

    @classmethod
    def of(cls, key_id: int, secret: bytes) -> GroupKey:
        if not 0 <= key_id <= 0xFFFFFFFF:
            raise ValueError(f"group key id {key_id} outside 0..4294967295")
        if len(secret) != GROUP_KEY_LEN:
            raise ValueError(f"group key is {len(secret)} bytes, not {GROUP_KEY_LEN}")
        return cls(key_id, bytes(secret), ChaCha20Poly1305(secret))

    def to_json(self) -> JSON:
        return {"format": GROUP_KEY_FORMAT, "key_id": self.key_id, "secret": self.secret.hex()}

    @classmethod
    def from_json(cls, obj: JSON) -> GroupKey:
        if not isinstance(obj, dict) or obj.get("format") != GROUP_KEY_FORMAT:
            raise ValueError(f"not a group key file (format {GROUP_KEY_FORMAT})")
        key_id, secret = obj.get("key_id"), obj.get("secret")
        if type(key_id) is not int:
            raise ValueError(f"key_id {json.dumps(key_id)[:40]} is not an integer")
        if not isinstance(secret, str):
            raise ValueError("secret missing or not a hex string")
        try:
            raw = bytes.fromhex(secret)
        except ValueError:
            raise ValueError("secret is not hex") from None  # never echo a secret
        return cls.of(key_id, raw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupKey) and (other.key_id, other.secret) == (
            self.key_id,
            self.secret,
        )

    def __hash__(self) -> int:
        return hash((self.key_id, self.secret))

    def __repr__(self) -> str:  # never print the secret
        return f"GroupKey(key_id={self.key_id})"


@dataclasses.dataclass(frozen=True, slots=True)
class GroupKeyring:
    """The active group key (seals and opens) and at most one standby key (opens)."""

    active: GroupKey
    standby: GroupKey | None = None

    def __post_init__(self) -> None:
        if self.standby is not None and self.standby.key_id == self.active.key_id:
            raise ValueError(f"active and standby group keys share id {self.active.key_id}")

    @classmethod
    def of(cls, keys: Sequence[GroupKey]) -> GroupKeyring:
        """The keyring of one or two keys as a command line gives them, active first."""
        if not 1 <= len(keys) <= 2:
            raise ValueError(f"give one or two group keys (active first), not {len(keys)}")
        return cls(keys[0], keys[1] if len(keys) == 2 else None)

    def get(self, key_id: int) -> GroupKey | None:
        if key_id == self.active.key_id:
            return self.active
        if self.standby is not None and key_id == self.standby.key_id:
            return self.standby
        return None

    def with_standby(self, key: GroupKey) -> GroupKeyring:
        """Step 1 of a rotation: accept `key` as well (the previous standby is dropped)."""
        return GroupKeyring(self.active, key)

    def rotated(self) -> GroupKeyring:
        """Step 2: seal with the standby key; keep the old active key as standby."""
        if self.standby is None:
            raise ValueError("no standby group key to rotate to")
        return GroupKeyring(self.standby, self.active)


def associated_data(adv: Advertisement, algorithm: int, key_id: int) -> bytes:
    w = Writer()
    w.bytes(SEAL_LABEL)
    w.u8(algorithm)
    w.u32(key_id)
    adv.origin.encode_tlv(w)
    adv.sequence.encode_tlv(w)
    return w.getvalue()


def seal(
    adv: Advertisement,
    keyring: GroupKeyring,
    nonce: bytes,
    types: tuple[int, ...] = CACHE_SECTION,
) -> Advertisement:
    """`adv` with the TLVs of `types` replaced by one SealedCache TLV under the active key.

    Unchanged when it has none of them. Refuses a signed advertisement (seal, then sign)
    and one that is already sealed.
    """
    if adv.signature is not None:
        raise BadValueError("seal before signing: the signature must cover the ciphertext")
    if adv.get(SealedCache) is not None:
        raise BadValueError("advertisement is already sealed")
    bad = sorted(set(types) & UNSEALABLE)
    if bad:
        raise BadValueError(f"TLV types {bad} cannot be sealed")
    if len(nonce) != CHACHA20_POLY1305_NONCE_LEN:
        raise BadValueError(f"nonce is {len(nonce)} bytes, not {CHACHA20_POLY1305_NONCE_LEN}")
    chosen = set(types)
    inner = [t for t in adv.tlvs if t.type in chosen]
    if not inner:
        return adv
    w = Writer()
    for t in inner:
        t.encode_tlv(w)
    key = keyring.active
    algorithm = AeadAlgorithm.CHACHA20_POLY1305
    ciphertext = key._aead.encrypt(nonce, w.getvalue(), associated_data(adv, algorithm, key.key_id))
    rest = Advertisement(tuple(t for t in adv.tlvs if t.type not in chosen))
    return rest.replace(SealedCache(algorithm, key.key_id, bytes(nonce), ciphertext))


def unknown_algorithm(adv: Advertisement) -> int | None:
    """The code of `adv`'s sealing algorithm when this implementation has no such AEAD
    (its section cannot be opened here, whatever keys are held); None otherwise."""
    sealed = adv.get(SealedCache)
    if sealed is None or sealed.has_known_algorithm:
        return None
    return int(sealed.algorithm)


def open_sealed(
    adv: Advertisement, keyring: GroupKeyring, registry: wire.Registry = wire.DEFAULT_REGISTRY
) -> Advertisement:
    """`adv` with its SealedCache TLV replaced by the TLVs it holds (unchanged if none).

    Raises UnknownGroupKeyError (key id not in the keyring; its subclass
    UnknownSealingAlgorithmError for an algorithm code this implementation does not have)
    or DecryptionError (tag fails: wrong key, tampered bytes, moved to another origin or
    sequence; or the plaintext is not a canonical run of sealable TLVs absent from the
    clear part).
    """
    sealed = adv.get(SealedCache)
    if sealed is None:
        return adv
    if not sealed.has_known_algorithm:
        raise UnknownSealingAlgorithmError(
            f"cache section sealed with AEAD algorithm {int(sealed.algorithm)}, "
            "which this receiver does not implement",
            tlv_type=TLVType.SEALED_CACHE,
        )
    key = keyring.get(sealed.key_id)
    if key is None:
        raise UnknownGroupKeyError(
            f"cache section sealed under group key {sealed.key_id}, which is not held",
            tlv_type=TLVType.SEALED_CACHE,
        )
    try:
        plaintext = key._aead.decrypt(
            sealed.nonce, sealed.ciphertext, associated_data(adv, sealed.algorithm, key.key_id)
        )
    except InvalidTag:
        raise DecryptionError(
            f"sealed cache section does not authenticate under group key {key.key_id}",
            tlv_type=TLVType.SEALED_CACHE,
        ) from None
    rest = adv.without(TLVType.SEALED_CACHE)
    clear = {t.type for t in rest.tlvs}
    r = Reader(plaintext)
    inner = []
    previous = -1
    try:
        while r.remaining:
            at = r.offset
            tlv = registry.decode_tlv(r)
            if tlv.type <= previous or tlv.type in UNSEALABLE or tlv.type in clear:
                raise BadValueError(f"sealed TLV type {tlv.type} out of place", at, tlv.type)
            previous = tlv.type
            inner.append(tlv)
        if not inner:
            raise BadValueError("sealed cache section is empty")
        # opened, the advertisement must still be one the codec accepts (its TLV count
        # among the rest): a peer's sealed bytes never raise past the receiver
        opened = rest.replace(*inner)
    except CodecError as exc:
        raise DecryptionError(f"sealed plaintext: {exc}", tlv_type=TLVType.SEALED_CACHE) from None
    return opened
