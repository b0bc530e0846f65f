"""Block keys: vectors, an independent recomputation from the spec, and properties."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto.keys import ENGINE_MOONCAKE, ENGINE_VLLM, BlockKeyer, model_person

VECTORS = json.loads((Path(__file__).parent / "vectors" / "keys.json").read_text())
SECRET = bytes.fromhex(VECTORS["secret"])
MODEL = VECTORS["model_id"]


def spec_block_keys(secret: bytes, model: str, block_size: int, tokens: list[int]) -> list[int]:
    """The derivation written out from the keys.py docstring, with hashlib only."""
    person = hashlib.blake2b(model.encode(), digest_size=16, person=b"catsproto-model").digest()
    out, prev = [], bytes(8)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        data = b"\x01" + prev + struct.pack(f"<{block_size}I", *block)
        prev = hashlib.blake2b(data, digest_size=8, key=secret, person=person).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def test_person_vector() -> None:
    assert model_person(MODEL).hex() == VECTORS["person"]
    assert len(model_person("x" * 1000)) == 16


@pytest.mark.parametrize("case", VECTORS["blocks"], ids=lambda c: f"bs{c['block_size']}")
def test_block_vectors(case: dict) -> None:
    keyer = BlockKeyer(SECRET, MODEL, case["block_size"])
    got = [f"{k:016x}" for k in keyer.block_keys(case["tokens"])]
    assert got == case["keys"]
    spec = spec_block_keys(SECRET, MODEL, case["block_size"], case["tokens"])
    assert got == [f"{k:016x}" for k in spec]
    assert len(got) == len(case["tokens"]) // case["block_size"]


@pytest.mark.parametrize("case", VECTORS["engine_ids"], ids=lambda c: f"{c['engine']}-{c['id']}")
def test_engine_vectors(case: dict) -> None:
    keyer = BlockKeyer(SECRET, MODEL, 512)
    assert f"{keyer.engine_key(case['engine'], case['id']):016x}" == case["key"]
    person = model_person(MODEL)
    data = b"\x02" + case["engine"].encode() + b"\x00" + (case["id"] % 2**64).to_bytes(8, "big")
    spec = hashlib.blake2b(data, digest_size=8, key=SECRET, person=person).hexdigest()
    assert case["key"] == spec


def test_signed_vllm_hash_is_taken_mod_2_64() -> None:
    keyer = BlockKeyer(SECRET, MODEL, 16)
    assert keyer.engine_key(ENGINE_VLLM, -1) == keyer.engine_key(ENGINE_VLLM, 2**64 - 1)


def test_engines_and_domains_are_separated() -> None:
    keyer = BlockKeyer(SECRET, MODEL, 1)
    assert keyer.engine_key(ENGINE_VLLM, 5) != keyer.engine_key(ENGINE_MOONCAKE, 5)
    # an engine id never collides with the token-block derivation of the same number
    assert keyer.engine_key(ENGINE_MOONCAKE, 5) != keyer.block_keys([5])[0]


def test_engine_keys_array_matches_scalar() -> None:
    keyer = BlockKeyer(SECRET, MODEL, 512)
    ids = [0, 1, 2, 46, 12345]
    arr = keyer.engine_keys(ENGINE_MOONCAKE, ids)
    assert arr.dtype == np.uint64
    assert [int(k) for k in arr] == [keyer.engine_key(ENGINE_MOONCAKE, i) for i in ids]


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@settings(max_examples=60, deadline=None)
@given(tokens_st, tokens_st, st.integers(1, 5))
def test_keys_agree_exactly_as_far_as_block_prefixes(a: list[int], b: list[int], bs: int) -> None:
    keyer = BlockKeyer(SECRET, MODEL, bs)
    ka, kb = keyer.block_keys(a), keyer.block_keys(b)
    assert len(ka) == len(a) // bs
    common_blocks = 0
    while (
        common_blocks < min(len(ka), len(kb))
        and a[common_blocks * bs : (common_blocks + 1) * bs]
        == b[common_blocks * bs : (common_blocks + 1) * bs]
    ):
        common_blocks += 1
    assert ka[:common_blocks] == kb[:common_blocks]
    # after the first differing block, keys differ (a collision here would be a 2^-64 event)
    for x, y in zip(ka[common_blocks:], kb[common_blocks:], strict=False):
        assert x != y


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=12))
def test_partial_tail_gets_no_key_and_does_not_change_earlier_keys(tokens: list[int]) -> None:
    keyer = BlockKeyer(SECRET, MODEL, 4)
    full = keyer.block_keys(tokens)
    assert keyer.block_keys([*tokens, 1, 2, 3])[: len(full)] == full
    assert len(keyer.block_keys(tokens[: len(tokens) // 4 * 4 + 3])) == len(full)


def test_secret_and_model_change_every_key() -> None:
    tokens = list(range(32))
    base = BlockKeyer(SECRET, MODEL, 8).block_keys(tokens)
    other_secret = BlockKeyer(bytes(32), MODEL, 8).block_keys(tokens)
    other_model = BlockKeyer(SECRET, MODEL + "-v2", 8).block_keys(tokens)
    assert not set(base) & set(other_secret)
    assert not set(base) & set(other_model)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockKeyer(b"short", MODEL, 4)
    with pytest.raises(ValueError):
        BlockKeyer(bytes(65), MODEL, 4)
    with pytest.raises(ValueError):
        BlockKeyer(SECRET, "", 4)
    with pytest.raises(ValueError):
        BlockKeyer(SECRET, MODEL, 0)
    keyer = BlockKeyer(SECRET, MODEL, 2)
    with pytest.raises(ValueError):
        keyer.block_keys([1, 2**32])
    with pytest.raises(ValueError):
        keyer.block_keys([-1, 2])
    with pytest.raises(ValueError):
        keyer.chain(0, [1])
    with pytest.raises(ValueError):
        keyer.engine_key(ENGINE_VLLM, 2**64)
    with pytest.raises(ValueError):
        keyer.engine_key("", 1)
