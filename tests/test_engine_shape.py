"""The engine's C-SMA sizes a KV block from the model's own config, not from constants."""

from __future__ import annotations

import json

import pytest

from catsproto.lab.engine import MODEL_DIR
from catsproto.lab.engine_site import model_shape


def test_the_shipped_model_gives_the_block_size_vllm_allocates():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    shape = model_shape(MODEL_DIR, 32)
    # K and V, per layer, per KV head, head_dim values of 2 octets (bfloat16), 32 tokens
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
    expected = per_token * config["head_dim"] * 2 * 32
    assert shape.bytes_per_block == expected


def test_a_model_without_head_dim_or_kv_heads_uses_hidden_over_heads(tmp_path):
    config = {"num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 512}
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    shape = model_shape(tmp_path, 16)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes) == (3, 8, 64, 4)


def test_an_unknown_dtype_is_refused_by_name(tmp_path):
    config = {"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "int3"}))
    with pytest.raises(KeyError, match="int3"):
        model_shape(tmp_path, 16)
