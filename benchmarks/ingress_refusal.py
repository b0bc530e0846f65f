"""What a prompt over the model's context costs the ingress, as JSON, measured in one run.

Issue 41, row 9: a 4 MiB text prompt cost about 1.4 s of ingress CPU (tokenized whole,
then forwarded), and a list of a million token ids about 0.2 s, although the model's
context is 4,096 tokens. The ingress now refuses a text longer than the context times
the most bytes one token covers before tokenizing it, and a list of ids longer than the
context before checking its ids (`catsproto.adapters.tokenizer`).

Measured here, in process, on the lab's tiny model (`lab/engine/tiny-llama`), each the
median of `--repeat` runs: `IngressService.prepare` refusing the 4 MiB text and the
million ids (the JSON parse of the body included: what a request costs the ingress
before any answer; `parse_million_ids_body_s` is that parse alone, which no bound
before it can avoid), and beside them the full tokenization of the same text
(`tokenize_whole_s`, what the refusal saves). No engine, no sockets.

    .venv/bin/python benchmarks/ingress_refusal.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from catsproto.adapters.ingress import IngressService, ModelSpec, load_models
from catsproto.adapters.openai_wire import IngressError
from catsproto.adapters.steering import SteeringConfig
from catsproto.lab.engine import MODEL_DIR

MODEL = "catsproto-tiny"


def service(rib: Path) -> IngressService:
    engine = SimpleNamespace(served_model_name=MODEL, block_size=32, port=1)
    config = SteeringConfig(
        ingress="e1",
        rib_file=str(rib),
        links=(),
        sites={1: "e1"},
        next_hops={},
        secret=b"catsproto-refusal-benchmark-0001",
        secret_id=1,
        model_id=engine.served_model_name,
        block_size=engine.block_size,
        instance_port=engine.port,
    )
    models = load_models([ModelSpec(MODEL, 100, MODEL_DIR)], config, install_routes=False)
    return IngressService(models)


def seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def refused(svc: IngressService, raw: bytes) -> None:
    try:
        svc.prepare("/v1/completions", raw)
    except IngressError as exc:
        assert exc.code == "context_length_exceeded", exc
        return
    raise AssertionError("the prompt was not refused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rib = Path(d) / "rib.json"
        rib.write_text(json.dumps({"sessions": {}, "routes": []}))
        svc = service(rib)
        tokenizer = svc.models[MODEL].tokenizer
        text = "hello world " * ((4 << 20) // 12)
        text_body = json.dumps({"model": MODEL, "prompt": text}).encode()
        # a million ids in a body under the 4 MiB limit (one digit each)
        ids_body = json.dumps({"model": MODEL, "prompt": [7] * 1_000_000}).encode()
        text_s = seconds(lambda: refused(svc, text_body), args.repeat)
        ids_s = seconds(lambda: refused(svc, ids_body), args.repeat)
        parse_ids_s = seconds(lambda: json.loads(ids_body), args.repeat)
        whole_s = seconds(
            lambda: tokenizer.tokenizer.encode_batch_fast([text], add_special_tokens=True),
            args.repeat,
        )
    print(
        json.dumps(
            {
                "benchmark": "ingress_refusal",
                "machine": platform.machine(),
                "context_tokens": tokenizer.max_tokens,
                "max_token_bytes": tokenizer.max_token_bytes,
                "text_bytes": len(text),
                "refuse_text_s": round(text_s, 4),
                "refuse_million_ids_s": round(ids_s, 4),
                "parse_million_ids_body_s": round(parse_ids_s, 4),
                "tokenize_whole_s": round(whole_s, 4),
                "saved_ratio": round(whole_s / text_s, 1),
                "repeat": args.repeat,
            }
        )
    )


if __name__ == "__main__":
    main()
