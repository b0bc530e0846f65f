"""Block keys: chained, keyed 64-bit hashes naming a block of prompt tokens and its prefix.

Strategy. A prompt's token ids are cut into blocks of ``block_size`` tokens; a trailing
partial block gets no key (an engine cannot reuse half a block either). Each block key is

    key_i = BLAKE2b-64(key = secret, person = P(model_id),
                       data = 0x01 || key_{i-1} (8 bytes, big-endian) || tokens_i (u32 LE each))

with key_0 = 0 (eight zero bytes), so a key names a block *and every block before it*:
two prompts share a key exactly as far as they share a block-aligned prefix. Without the
secret nobody can compute a key, so a captured summary does not let anyone test whether
a known prompt is cached. BLAKE2b's personalisation string is at most 16 bytes, so the
model identifier is first reduced with an unkeyed BLAKE2b-128 (domain ``catsproto-model``)
to exactly 16 bytes: ``P(model_id) = BLAKE2b-128(person="catsproto-model", data=utf8(id))``.

Engines already name their blocks: vLLM with 64-bit block hashes, the Mooncake trace
with chained integer ``hash_ids``. Both are chained already, so one keyed hash per id is
enough to carry them into our key space without leaking them:

    key = BLAKE2b-64(key = secret, person = P(model_id),
                     data = 0x02 || engine name (ASCII) || 0x00 || id (u64 big-endian))

The leading domain byte (0x01 token blocks, 0x02 engine ids) keeps the two derivations
apart, and the engine name keeps vLLM and Mooncake ids apart. Signed vLLM hashes
(Python ``hash()`` values) are taken modulo 2**64. Keys are unsigned 64-bit ints; the
8-byte digest is read big-endian, so ``f"{key:016x}"`` equals the digest's hex.

Pure: no IO, clocks or randomness; the secret is a parameter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ENGINE_MOONCAKE",
    "ENGINE_VLLM",
    "BlockKeyer",
    "model_person",
]

ENGINE_VLLM = "vllm"
ENGINE_MOONCAKE = "mooncake"

_DOMAIN_TOKENS = b"\x01"
_DOMAIN_ENGINE = b"\x02"
_MODEL_PERSON = b"catsproto-model"
_U64 = 1 << 64
_U32 = 1 << 32


def model_person(model_id: str) -> bytes:
    """The 16-byte BLAKE2b personalisation derived from a model identifier."""
    if not model_id:
        raise ValueError("model_id must not be empty")
    return hashlib.blake2b(model_id.encode("utf-8"), digest_size=16, person=_MODEL_PERSON).digest()


@dataclass(frozen=True)
class BlockKeyer:
    """Derives block keys for one model under one keying secret.

    secret: 16..64 bytes shared by the authorised components (BLAKE2b accepts at most 64).
    model_id: the model identifier also carried in the cache-model TLV.
    block_size: tokens per block (the advertised block size), >= 1.
    """

    secret: bytes
    model_id: str
    block_size: int
    _person: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 16 <= len(self.secret) <= 64:
            raise ValueError(f"secret must be 16..64 bytes, got {len(self.secret)}")
        if not 1 <= self.block_size < _U32:
            raise ValueError(f"block_size must be 1..2^32-1, got {self.block_size}")
        object.__setattr__(self, "_person", model_person(self.model_id))

    def _hash(self, data: bytes) -> int:
        digest = hashlib.blake2b(data, digest_size=8, key=self.secret, person=self._person).digest()
        return int.from_bytes(digest, "big")

    def chain(self, previous: int, block_tokens: Sequence[int]) -> int:
        """The key of one full block given the key of the block before it (0 for the first)."""
        if not 0 <= previous < _U64:
            raise ValueError(f"previous key {previous} is not a u64")
        if len(block_tokens) != self.block_size:
            raise ValueError(
                f"block has {len(block_tokens)} tokens, block size is {self.block_size}"
            )
        tokens = np.asarray(block_tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= _U32):
            raise ValueError("token ids must be 0..2^32-1")
        data = _DOMAIN_TOKENS + previous.to_bytes(8, "big") + tokens.astype("<u4").tobytes()
        return self._hash(data)

    def block_keys(self, tokens: Sequence[int]) -> list[int]:
        """Keys of every full block of a prompt, in order; a partial tail gets none."""
        keys: list[int] = []
        previous = 0
        full = len(tokens) - len(tokens) % self.block_size
        for start in range(0, full, self.block_size):
            previous = self.chain(previous, tokens[start : start + self.block_size])
            keys.append(previous)
        return keys

    def engine_key(self, engine: str, engine_id: int) -> int:
        """The block key for an engine's own block id (vLLM hash, Mooncake hash_id).

        engine: a short ASCII name (``vllm``, ``mooncake``); ids from different engines
        never collide by construction. engine_id: any int in -2^63..2^64-1, taken mod 2^64.
        """
        if not engine or not engine.isascii() or "\x00" in engine:
            raise ValueError(f"engine name must be non-empty ASCII without NUL: {engine!r}")
        if not -(1 << 63) <= engine_id < _U64:
            raise ValueError(f"engine id {engine_id} does not fit 64 bits")
        data = (
            _DOMAIN_ENGINE
            + engine.encode("ascii")
            + b"\x00"
            + (engine_id % _U64).to_bytes(8, "big")
        )
        return self._hash(data)

    def engine_keys(self, engine: str, engine_ids: Iterable[int]) -> np.ndarray:
        """`engine_key` over many ids, as a uint64 array (one hash per id)."""
        return np.fromiter((self.engine_key(engine, int(i)) for i in engine_ids), dtype=np.uint64)
