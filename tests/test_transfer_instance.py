"""The modelled instance as holder and puller, on loopback: payloads kept in step with its
cache, a prompt's prefix pulled from another instance over mutual TLS and admitted (then
advertised by its C-SMA), refusals that admit nothing, and stale hits it reports."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from catsproto.adapters.instance import (
    EngineConfig,
    KvPuller,
    ModelledEngine,
    NodeAgent,
    PromptError,
)
from catsproto.adapters.transfer_tls import (
    PeerPolicy,
    ServerOptions,
    TransferIdentity,
    TransferServer,
    wall_clock_ms,
)
from catsproto.adapters.vllm_events import RankEndpoint
from catsproto.keys import BlockKeyer
from catsproto.node import BuilderConfig, DampeningPolicy, TierSpec
from catsproto.security import SigningKey, TrustStore, authorise
from catsproto.summary import SummaryReceiver
from catsproto.transfer import block_digest, synthetic_payload
from catsproto.wire import Tier

SECRET = b"t" * 32
BS = 16
PAYLOAD = 4096
TIERS = (TierSpec(Tier.HBM, 16, 5, 1_600_000), TierSpec(Tier.DRAM, 32, 30, 400_000))
OPERATOR = SigningKey.from_seed(b"o" * 32)
KEYS = {n: SigningKey.from_seed(n.encode() * 32) for n in ("a", "b", "c")}  # c: not trusted


def trust_of(*names: str) -> TrustStore:
    store = TrustStore().with_operator(OPERATOR.public.raw, "op")
    now = wall_clock_ms()
    for n in names:
        store = store.with_delegation(
            authorise(
                OPERATOR,
                KEYS[n].public.raw,
                cs_ids=[1],
                routes=["10.0.0.0/8"],
                # the holders below serve on loopback: a puller dials only a holder
                # at an instance address its key is authorised for
                addresses=["10.0.0.0/8", "127.0.0.0/8"],
                not_before_ms=now - 60_000,
                not_after_ms=now + 3_600_000,
            )
        )
    return store


TRUST = trust_of("a", "b")


@dataclass
class Served:
    engine: ModelledEngine
    identity: TransferIdentity
    server: TransferServer

    def close(self) -> None:
        self.server.close()
        self.engine.close()
        self.identity.close()


def serve(name: str, trust: TrustStore = TRUST, tiers: tuple[TierSpec, ...] = TIERS) -> Served:
    identity = TransferIdentity(KEYS[name])
    engine = ModelledEngine(
        EngineConfig(block_size=BS, prefill_rate_tps=1e7, tiers=tiers, payload_bytes=PAYLOAD),
        keyer=BlockKeyer(SECRET, "m", BS),
        puller=KvPuller(identity, trust, source_address="127.0.0.1", timeout=5),
    )
    server = TransferServer(
        identity, PeerPolicy(trust), engine.lookup_payload, "127.0.0.1", 0, ServerOptions(epoch=3)
    ).start()
    return Served(engine, identity, server)


@pytest.fixture
def pair() -> Iterator[tuple[Served, Served]]:
    a, b = serve("a"), serve("b")
    yield a, b
    a.close()
    b.close()


def prompt(seed: int, blocks: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=blocks * BS).tolist()


def test_payloads_follow_the_cache_and_verify(pair: tuple[Served, Served]) -> None:
    a, _ = pair
    tokens = prompt(1, 6)
    a.engine.submit({"prompt_token_ids": tokens}, timeout=10)
    keys = BlockKeyer(SECRET, "m", BS).block_keys(tokens)
    assert sorted(a.engine.payloads) == sorted(keys)
    for k in keys:
        block = a.engine.lookup_payload(k)
        assert block is not None and block.payload == synthetic_payload(k, PAYLOAD)
        assert block.digest == block_digest(k, block.payload)
    # 48 more blocks push the 6 out of both tiers (16 + 32): their payloads go with them
    a.engine.submit({"prompt_token_ids": prompt(2, 48)}, timeout=10)
    assert all(a.engine.lookup_payload(k) is None for k in keys)
    assert len(a.engine.payloads) == 48 == sum(a.engine.state()["blocks"].values())


def test_a_prompt_pulled_from_another_instance_is_admitted_and_reused(
    pair: tuple[Served, Served],
) -> None:
    a, b = pair
    tokens = prompt(3, 10)
    a.engine.submit({"prompt_token_ids": tokens}, timeout=10)
    body = {
        "prompt_token_ids": tokens,
        "kv_source": {**b_source_json(a), "expected_blocks": 10},
    }
    reply = b.engine.submit(body, timeout=10)
    t = reply["transfer"]
    assert t["ok"] and t["blocks"] == 10 and t["recompute_from"] is None
    assert t["holder_key_id"] == a.identity.key_id.hex()
    assert t["payload_bytes"] == 10 * PAYLOAD and t["wire_bytes"] > 10 * PAYLOAD
    assert reply["cached_blocks"] == 10 and reply["prefill_tokens"] == 0
    assert reply["expected_blocks"] == 10 and reply["stale"] is False
    keys = BlockKeyer(SECRET, "m", BS).block_keys(tokens)
    assert [b.engine.lookup_payload(k) for k in keys] == [a.engine.lookup_payload(k) for k in keys]
    assert a.server.served[-1].blocks_sent == 10
    assert a.server.served[-1].peer_key_id == b.identity.key_id.hex()


def b_source_json(holder: Served) -> dict[str, object]:
    host, port = holder.server.address
    return {"address": host, "port": port, "key_id": holder.identity.key_id.hex()}


def test_a_partly_evicted_prefix_is_pulled_up_to_the_gap_and_counted_stale(
    pair: tuple[Served, Served],
) -> None:
    a, b = pair
    tokens = prompt(4, 8)
    a.engine.submit({"prompt_token_ids": tokens[: 5 * BS]}, timeout=10)  # holds 5 of 8
    reply = b.engine.submit(
        {"prompt_token_ids": tokens, "kv_source": {**b_source_json(a), "expected_blocks": 8}},
        timeout=10,
    )
    assert reply["transfer"]["ok"] and reply["transfer"]["recompute_from"] == 5
    assert reply["cached_blocks"] == 5 and reply["prefill_tokens"] == 3 * BS
    assert reply["stale"] is True and reply["stale_cause"] == "holder"
    stale = b.engine.state()["stale_hits"]
    assert stale["stale_hits"] == 1 and stale["stale_blocks"] == 3
    assert a.engine.state()["served_missing"] == {"evicted": 0, "not-held": 1}
    # evicted at the holder: 48 other blocks push the 5 out of its 48-block cache
    a.engine.submit({"prompt_token_ids": prompt(11, 48)}, timeout=10)
    again = b.engine.submit(
        {"prompt_token_ids": prompt(4, 9), "kv_source": b_source_json(a)}, timeout=10
    )
    assert again["transfer"]["blocks"] == 0
    assert a.engine.state()["served_missing"] == {"evicted": 1, "not-held": 1}


def test_wrong_or_untrusted_holder_is_refused_and_nothing_is_admitted(
    pair: tuple[Served, Served],
) -> None:
    a, b = pair
    tokens = prompt(5, 4)
    a.engine.submit({"prompt_token_ids": tokens}, timeout=10)
    wrong = {**b_source_json(a), "key_id": KEYS["b"].key_id.hex()}  # not who answers
    reply = b.engine.submit({"prompt_token_ids": tokens, "kv_source": wrong}, timeout=10)
    assert not reply["transfer"]["ok"] and "wrong-peer" in reply["transfer"]["error"]
    assert reply["transfer"]["attempts"] == 1  # a refusal is not retried
    assert reply["cached_blocks"] == 0 and reply["prefill_tokens"] == 4 * BS
    # a holder whose key the puller's trust store lacks: not even dialled
    c = serve("c", trust=trust_of("a", "b", "c"))
    try:
        c.engine.submit({"prompt_token_ids": tokens}, timeout=10)
        reply = b.engine.submit(
            {"prompt_token_ids": prompt(5, 4), "kv_source": b_source_json(c)}, timeout=10
        )
        assert "not dialled" in reply["transfer"]["error"]
        assert "trust store" in reply["transfer"]["error"]
        assert reply["transfer"]["blocks"] == 0 and reply["cached_blocks"] == 4  # its own
        assert c.server.stats.connections == 0
    finally:
        c.close()
    assert b.engine.state()["transfers"]["failed"] == 2
    assert b.engine.state()["transfers"]["refused"] == 1


def test_a_holder_announcing_blocks_larger_than_the_instance_stores_is_refused() -> None:
    """The instance's puller holds a trusted holder to the payload size it stores itself:
    a holder that sends blocks twice that size is refused at the first block's header,
    and nothing is admitted."""
    big = ModelledEngine(
        EngineConfig(block_size=BS, prefill_rate_tps=1e7, tiers=TIERS, payload_bytes=2 * PAYLOAD),
        keyer=BlockKeyer(SECRET, "m", BS),
    )
    identity = TransferIdentity(KEYS["a"])
    server = TransferServer(
        identity, PeerPolicy(TRUST), big.lookup_payload, "127.0.0.1", 0, ServerOptions(epoch=3)
    ).start()
    b_identity = TransferIdentity(KEYS["b"])
    puller = KvPuller(b_identity, TRUST, source_address="127.0.0.1", timeout=5)
    b = ModelledEngine(
        EngineConfig(block_size=BS, prefill_rate_tps=1e7, tiers=TIERS, payload_bytes=PAYLOAD),
        keyer=BlockKeyer(SECRET, "m", BS),
        puller=dataclasses.replace(puller, max_block_bytes=PAYLOAD),
    )
    try:
        tokens = prompt(12, 3)
        big.submit({"prompt_token_ids": tokens}, timeout=10)
        host, port = server.address
        source = {"address": host, "port": port, "key_id": identity.key_id.hex()}
        reply = b.submit({"prompt_token_ids": tokens, "kv_source": source}, timeout=10)
        assert not reply["transfer"]["ok"] and reply["transfer"]["blocks"] == 0
        assert str(2 * PAYLOAD) in reply["transfer"]["error"]
        assert reply["cached_blocks"] == 0 and reply["prefill_tokens"] == 3 * BS
        # what it holds now it computed itself: its own size, not the holder's
        assert len(b.payloads) == 3
        assert all(len(block.payload) == PAYLOAD for block in b.payloads.values())
    finally:
        b.close()
        server.close()
        big.close()
        identity.close()
        b_identity.close()


def test_bad_instructions_are_refused_before_anything_happens(pair: tuple[Served, Served]) -> None:
    _, b = pair
    before = b.engine.state()
    for bad in (
        {"address": "nowhere", "port": 1, "key_id": "00"},
        {"address": "127.0.0.1", "port": 0, "key_id": "00"},
        {"address": "127.0.0.1", "port": 7470, "key_id": ""},
        {"address": "127.0.0.1", "port": 7470, "key_id": "zz"},
        "10.0.0.1",
    ):
        with pytest.raises(PromptError):
            b.engine.submit({"prompt_token_ids": prompt(6, 2), "kv_source": bad}, timeout=5)
    with pytest.raises(PromptError):
        b.engine.submit({"prompt_token_ids": prompt(6, 2), "expected_cached_blocks": -1})
    after = b.engine.state()
    assert after["transfers"] == before["transfers"] and after["blocks"] == before["blocks"]
    plain = ModelledEngine(EngineConfig(block_size=BS))
    try:  # an instance without transfer credentials cannot be told to pull
        with pytest.raises(PromptError, match="no transfer credentials"):
            plain.submit({"prompt_token_ids": prompt(6, 2), "kv_source": b_source_json(b)})
    finally:
        plain.close()


def test_local_stale_hits_tell_evicted_from_never_held() -> None:
    a = serve("a", tiers=(TierSpec(Tier.HBM, 4, 5, 1_600_000),))
    try:
        tokens = prompt(7, 4)
        a.engine.submit({"prompt_token_ids": tokens}, timeout=10)
        a.engine.submit({"prompt_token_ids": prompt(8, 4)}, timeout=10)  # evicts all 4
        gone = a.engine.submit({"prompt_token_ids": tokens, "expected_cached_blocks": 3})
        assert gone["stale"] and gone["stale_cause"] == "evicted" and gone["cached_blocks"] == 0
        assert gone["evicted_ms_ago"] >= 0
        never = a.engine.submit({"prompt_token_ids": prompt(9, 4), "expected_cached_blocks": 1})
        assert never["stale"] and never["stale_cause"] == "not-held"
        fine = a.engine.submit({"prompt_token_ids": prompt(9, 4), "expected_cached_blocks": 4})
        assert fine["stale"] is False and fine["cached_blocks"] == 4
        ledger = a.engine.state()["stale_hits"]
        assert ledger["requests"] == 3 and ledger["stale_hits"] == 2
    finally:
        a.close()


def test_pulled_blocks_reach_the_pullers_advertisement(pair: tuple[Served, Served]) -> None:
    a, b = pair
    keyer = BlockKeyer(SECRET, "m", BS)
    node = NodeAgent(
        BuilderConfig(
            cs_id=1,
            address="10.0.0.2",
            model_id="m",
            block_size=BS,
            bytes_per_block=PAYLOAD,
            dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=60_000),
        ),
        TIERS,
        keyer,
        [RankEndpoint(0, b.engine.publisher.endpoint, b.engine.publisher.replay_endpoint)],
        b.engine.compute_state,
    )
    try:
        node.step(200)  # subscribed
        tokens = prompt(10, 6)
        a.engine.submit({"prompt_token_ids": tokens}, timeout=10)
        reply = b.engine.submit(
            {"prompt_token_ids": tokens, "kv_source": b_source_json(a)}, timeout=10
        )
        assert reply["transfer"]["blocks"] == 6
        keys = keyer.block_keys(tokens)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(k in node.cache for k in keys):
            node.step(50)
        assert all(k in node.cache for k in keys)
        node.step(0)
        receiver = SummaryReceiver()
        for route in node.latest.values():
            summaries = route.advertisement.cache_summaries
            for entry in summaries.entries if summaries else ():
                receiver.apply_entry(entry)
        assert receiver.contains_many(np.array(keys, dtype=np.uint64)).all()
    finally:
        node.close()
