"""Regenerate keys.json: `python tests/vectors/make_keys.py > tests/vectors/keys.json`.

The vectors pin the block-key derivation of `catsproto.keys` (see its docstring); the
test also recomputes them from the description with hashlib alone.
"""

from __future__ import annotations

import json
import sys

from catsproto.keys import ENGINE_MOONCAKE, ENGINE_VLLM, BlockKeyer, model_person

SECRET = bytes(range(32))
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def main() -> None:
    cases = []
    for block_size, tokens in [
        (4, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
        (4, [1, 2, 3, 4, 5, 6, 7, 9]),
        (2, [0, 4294967295, 128000, 42]),
        (3, [7, 7]),
        (16, list(range(100, 148))),
    ]:
        keyer = BlockKeyer(SECRET, MODEL, block_size)
        cases.append(
            {
                "block_size": block_size,
                "tokens": tokens,
                "keys": [f"{k:016x}" for k in keyer.block_keys(tokens)],
            }
        )
    keyer = BlockKeyer(SECRET, MODEL, 512)
    engines = [
        {"engine": engine, "id": i, "key": f"{keyer.engine_key(engine, i):016x}"}
        for engine, i in [
            (ENGINE_MOONCAKE, 0),
            (ENGINE_MOONCAKE, 1),
            (ENGINE_MOONCAKE, 46),
            (ENGINE_VLLM, 1),
            (ENGINE_VLLM, -1),
            (ENGINE_VLLM, (1 << 64) - 1),
            (ENGINE_VLLM, 0x123456789ABCDEF0),
        ]
    ]
    doc = {
        "description": "catsproto block keys: chained keyed BLAKE2b-64 (see catsproto/keys.py)",
        "secret": SECRET.hex(),
        "model_id": MODEL,
        "person": model_person(MODEL).hex(),
        "blocks": cases,
        "engine_ids": engines,
    }
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
