"""Issue #41 row 16: a trusted holder may not announce blocks far larger than expected
even when nobody set the puller's limit: the instance's puller defaults to the block size
the instance itself stores (the advertisement it pulls for is of the same model and
shape), not to the 256 MiB that only bounds what no block can exceed."""

from __future__ import annotations

from catsproto.adapters.instance import EngineConfig, KvPuller, ModelledEngine
from catsproto.adapters.transfer_tls import (
    PeerPolicy,
    ServerOptions,
    TransferIdentity,
    TransferServer,
)
from catsproto.keys import BlockKeyer
from tests.test_transfer_instance import BS, KEYS, PAYLOAD, SECRET, TIERS, TRUST, prompt


def test_the_instance_puller_s_default_limit_is_the_block_size_it_stores() -> None:
    big = ModelledEngine(
        EngineConfig(block_size=BS, prefill_rate_tps=1e7, tiers=TIERS, payload_bytes=64 * PAYLOAD),
        keyer=BlockKeyer(SECRET, "m", BS),
    )
    identity = TransferIdentity(KEYS["a"])
    server = TransferServer(
        identity, PeerPolicy(TRUST), big.lookup_payload, "127.0.0.1", 0, ServerOptions(epoch=3)
    ).start()
    b_identity = TransferIdentity(KEYS["b"])
    puller = KvPuller(b_identity, TRUST, source_address="127.0.0.1", timeout=5)
    assert puller.max_block_bytes is None  # nobody set it
    b = ModelledEngine(
        EngineConfig(block_size=BS, prefill_rate_tps=1e7, tiers=TIERS, payload_bytes=PAYLOAD),
        keyer=BlockKeyer(SECRET, "m", BS),
        puller=puller,
    )
    try:
        tokens = prompt(12, 3)
        big.submit({"prompt_token_ids": tokens}, timeout=10)
        host, port = server.address
        source = {"address": host, "port": port, "key_id": identity.key_id.hex()}
        reply = b.submit({"prompt_token_ids": tokens, "kv_source": source}, timeout=10)
        assert not reply["transfer"]["ok"] and reply["transfer"]["blocks"] == 0
        error = reply["transfer"]["error"]
        assert error.startswith("BlockTooLargeError") and str(64 * PAYLOAD) in error
        assert str(PAYLOAD) in error
        assert reply["cached_blocks"] == 0 and len(b.payloads) == 3
        assert all(len(block.payload) == PAYLOAD for block in b.payloads.values())
    finally:
        b.close()
        server.close()
        big.close()
        identity.close()
        b_identity.close()
