"""Vectorised 64-bit mixing shared by the filter kinds.

`mix64` is the SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijection on u64 with
full avalanche, cheap in numpy (three xor-shifts, two multiplies; uint64 arithmetic
wraps mod 2^64). Block keys are already keyed BLAKE2b outputs, so the mixer only has to
decorrelate the filter's hash functions from each other and from the seed.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over a uint64 array (returns a new array)."""
    z = x ^ (x >> np.uint64(30))
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def mix64_int(x: int) -> int:
    """The same finaliser on one Python int."""
    z = x & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def seeded(keys: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """Hash stream ``stream`` of the keys under ``seed``: mix64(key ^ mix64(seed + k*golden))."""
    salt = np.uint64(mix64_int((seed + (stream + 1) * GOLDEN) & _MASK))
    return mix64(keys ^ salt)
