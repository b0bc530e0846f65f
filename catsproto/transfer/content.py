"""Block contents: the digest that binds a payload to its block key, stored blocks,
and deterministic synthetic payloads for the modelled instance and the benchmarks.

    digest = SHA-256("catsproto/v1 kv-block" 0x00 || key u64 || size u64 || payload)

(integers big-endian). SHA-256 rather than BLAKE2b because it is what CPUs accelerate
(SHA-NI): on the lab machines it hashes at about twice BLAKE2b's rate, and the puller
hashes every byte it receives.

The key is inside the hash, so a payload that is intact but belongs to another block
(a mix-up in a store, a replayed frame) does not verify under the wrong key. A holder
keeps the digest computed when the block was admitted, next to the payload
(`StoredBlock`), so corruption at rest is caught by the puller too, not only in flight.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DIGEST_LABEL = b"catsproto/v1 kv-block\x00"
_KEY_SIZE = struct.Struct(">QQ")


def digester(key: int, size: int) -> hashlib._Hash:  # type: ignore[name-defined]
    """A SHA-256 object primed with the label, key and size; `update` it with the payload."""
    h = hashlib.sha256(DIGEST_LABEL)
    h.update(_KEY_SIZE.pack(key, size))
    return h


def block_digest(key: int, payload: bytes | memoryview) -> bytes:
    h = digester(key, len(payload))
    h.update(payload)
    return h.digest()


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block as a holder keeps it: payload and the digest taken at admission."""

    key: int
    payload: bytes
    digest: bytes

    @classmethod
    def of(cls, key: int, payload: bytes) -> StoredBlock:
        return cls(key, bytes(payload), block_digest(key, payload))

    def verify(self) -> bool:
        return block_digest(self.key, self.payload) == self.digest


def synthetic_payload(key: int, size: int) -> bytes:
    """Deterministic stand-in bytes for block `key` (SHAKE-128 of the key): the modelled
    instance stores these, scaled to a lab-friendly size."""
    return hashlib.shake_128(b"catsproto synthetic kv\x00" + key.to_bytes(8, "big")).digest(size)


def synthetic_keys(seed: int, count: int) -> list[int]:
    """A chain of `count` distinct 64-bit keys derived from `seed` (a synthetic prefix)."""
    keys: list[int] = []
    previous = seed.to_bytes(8, "big", signed=False)
    for _ in range(count):
        previous = hashlib.blake2b(previous, digest_size=8, person=b"catsproto/synkey").digest()
        keys.append(int.from_bytes(previous, "big"))
    return keys


def synthetic_store(keys: Iterable[int], size: int) -> dict[int, StoredBlock]:
    return {k: StoredBlock.of(k, synthetic_payload(k, size)) for k in keys}


def prefix_bytes(blocks: Mapping[int, StoredBlock], keys: Iterable[int]) -> int:
    return sum(len(blocks[k].payload) for k in keys if k in blocks)
