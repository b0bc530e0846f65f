"""vLLM's own KV-event publisher, driven from stdin (run with the engine python).

    python vllm_publisher_script.py --endpoint E --replay-endpoint R --block-size N [--topic T]

Makes the publisher the way the engine does (`EventPublisherFactory.create` from a
`KVEventsConfig`), prints ``ready``, then obeys one command a line:

    publish K   publish the next K batches (`batch_events`), print ``published <total>``
                once vLLM has sent them and holds them for replay
    quit        shut the publisher down, print ``bye`` and exit

The batches are a pure function of their sequence, so the test (which imports this file
without vllm) knows every block that was stored: batch 2q stores the first two blocks of
prompt q, batch 2q+1 its third block, chained to the second by parent hash.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Any


def block_hash(batch: int, block: int) -> int:
    """A uint64 like the ones vLLM publishes (the tail of a SHA-256)."""
    digest = hashlib.sha256(f"{batch}/{block}".encode()).digest()
    return int.from_bytes(digest[-8:], "big")


def prompt_tokens(prompt: int, block_size: int) -> list[int]:
    return [(prompt * 7919 + t) % 50_000 for t in range(3 * block_size)]


def batch_events(seq: int, block_size: int) -> list[dict[str, Any]]:
    """The BlockStored fields of batch `seq`."""
    prompt, second = divmod(seq, 2)
    tokens = prompt_tokens(prompt, block_size)
    if not second:
        hashes, parent, span = (
            [block_hash(seq, 0), block_hash(seq, 1)],
            None,
            tokens[: 2 * block_size],
        )
    else:
        hashes, parent, span = (
            [block_hash(seq, 2)],
            block_hash(seq - 1, 1),
            tokens[2 * block_size :],
        )
    return [
        {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": span,
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
        }
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay-endpoint", required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--topic", default="")
    args = parser.parse_args()

    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=args.endpoint,
        replay_endpoint=args.replay_endpoint,
        topic=args.topic,
    )
    publisher = EventPublisherFactory.create(config, data_parallel_rank=0)
    print("ready", flush=True)
    sent = 0
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["publish"]:
            for _ in range(int(command[1])):
                events = [BlockStored(**f) for f in batch_events(sent, args.block_size)]
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
                sent += 1
            # the publisher thread marks a batch done once sent and kept for replay
            publisher._event_queue.join()
            print(f"published {sent}", flush=True)
        elif command[:1] == ["quit"]:
            break
    publisher.shutdown()
    print("bye", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
