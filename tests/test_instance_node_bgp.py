"""`catsproto instance node` into BGP: --signing-key, --group-key and --spool.

The node runs beside a stand-in engine (vLLM's /metrics as captured in
tests/data/vllm_metrics/idle.txt, its /health, KV events from our `VllmEventPublisher`),
so no root and no real engine are needed. What it spools must verify against a trust
file that authorises its key, stay fresh for the announcer's lease, and go when the node
stops or its engine stops answering /health.
The lab's engine site takes the same step (`adapters/signed_routes.py`), checked here
without the lab; the usage errors come last."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catsproto import security, wire
from catsproto.adapters.exabgp_announce import Spool
from catsproto.adapters.signed_routes import SignedRoutes, sealed
from catsproto.adapters.vllm_events import VllmEventPublisher, stored_event
from catsproto.cli import build_parser
from catsproto.commands import UsageError
from catsproto.keys import BlockKeyer
from catsproto.node import ComputeState
from catsproto.security import commands as security_commands
from catsproto.security.vectors import fixture
from catsproto.summary import SummaryReceiver
from catsproto.wire import Tier
from tests.test_instance_node import (
    MODEL_ID,
    NODE,
    SECRET,
    TOKEN,
    Node,
    free_port,
    http,
    wait_until,
)
from tests.test_vllm_events import reopened

F = fixture()  # the operator, the node key and group key 7
IDLE_METRICS = Path(__file__).parent / "data" / "vllm_metrics" / "idle.txt"
ENGINE_BLOCK = 32  # what idle.txt's vllm:cache_config_info says
ADDRESS = "10.0.0.5"
DAY_MS = 86_400_000


# ---- keys, trust, and a stand-in engine --------------------------------------------------


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def write_private(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj))
    path.chmod(0o600)
    return path


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    """node.key and group.key as `catsproto keygen` writes them, and the trust file a
    selector holds (`catsproto authorize` + `catsproto trust`): the node key authorised
    for CS-IDs 1 and 200, routes and addresses in 10.0.0.0/16, valid a day either side."""
    delegation = security.authorise(
        F.operator,
        F.node.public.raw,
        cs_ids=[1, 200],
        routes=["10.0.0.0/16"],
        addresses=["10.0.0.0/16"],
        not_before_ms=now_ms() - DAY_MS,
        not_after_ms=now_ms() + DAY_MS,
    )
    trust = security_commands.build_trust(
        [security_commands.public_key(F.operator.to_json("operator-1"))],
        [security.delegation_to_json(delegation)],
    )
    token = tmp_path / "node.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    return {
        "node": write_private(tmp_path / "node.key", F.node.to_json("node-1")),
        "group": write_private(tmp_path / "group.key", F.group.active.to_json()),
        "trust": trust,
        "token": token,
    }


def verify(value: bytes, prefix: Any, trust: Any, group: list[Any] | None = None) -> Any:
    """What `catsproto verify --trust trust.json --route PREFIX [--group-key]` decides."""
    return security_commands.verify_value(
        value, ip_network(prefix), trust, now_ms(), group_keys=group
    )


class StandInEngine:
    """An engine's /metrics (block size 32, 512 KV blocks) and /health on 127.0.0.1, as
    vLLM's OpenAI server answers them; `healthy` False makes /health answer 503 (vLLM's
    answer when its engine core has died) while /metrics still answers; `restart` makes
    /metrics say another process serves it (its process start time)."""

    def __init__(self) -> None:
        self.metrics = IDLE_METRICS.read_bytes()  # what /metrics answers (a test may swap it)
        self.healthy = True
        self.health_probes = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                if self.path == "/health":
                    engine.health_probes += 1
                    self.send_response(200 if engine.healthy else 503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                text = engine.metrics
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def restart(self, started_s: float) -> None:
        line = b"process_start_time_seconds 1.79636070774e+09"
        assert line in IDLE_METRICS.read_bytes()
        self.metrics = IDLE_METRICS.read_bytes().replace(
            line, f"process_start_time_seconds {started_s!r}".encode()
        )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_in() -> Iterator[StandInEngine]:
    engine = StandInEngine()
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
def engine_metrics(stand_in: StandInEngine) -> str:
    """The stand-in engine's base URL."""
    return stand_in.url


def summary_holds(adv: wire.Advertisement, keys: np.ndarray) -> bool:
    receiver = SummaryReceiver()
    for entry in adv.cache_summaries.entries:  # type: ignore[union-attr]
        if entry.tier == Tier.HBM:
            receiver.apply_entry(entry)
    return bool(receiver.contains_many(keys).all())


# ---- the node, signed and spooled ---------------------------------------------------------


def signed_node(engine: str, events: int, keys: dict[str, Any], *more: str) -> Node:
    """`instance node` beside the engine at `engine`, its KV events bound on port
    `events` of 127.0.0.1 (no *: vLLM would connect, so the node binds), serving on a
    free port with the token, advertising ADDRESS at most every 0.1 s and at least
    every second, signed by the node key; `more` options after those."""
    return Node(
        "--engine-url",
        engine,
        "--endpoint",
        f"tcp://127.0.0.1:{events}",
        "--port",
        "0",
        "--api-token-file",
        str(keys["token"]),
        "--address",
        ADDRESS,
        "--min-interval-ms",
        "100",
        "--max-interval-ms",
        "1000",
        "--signing-key",
        str(keys["node"]),
        *more,
    )


def test_the_spool_gets_values_a_trusting_receiver_accepts_and_loses_them_on_stop(
    keys: dict[str, Any], engine_metrics: str, tmp_path: Path
) -> None:
    """Signed by the node key, sealed under group key 7: accepted against the trust file,
    the cache section opened with the group key (holding the engine's blocks) and sealed
    without it; --adverts-out writes the same signed values; each route's file is
    rewritten at least once per --max-interval-ms; after SIGTERM the spool is empty."""
    spool = tmp_path / "spool"
    adverts = tmp_path / "adverts.jsonl"
    events = free_port()
    node = signed_node(
        engine_metrics,
        events,
        keys,
        "--change-threshold",
        "0",
        "--group-key",
        str(keys["group"]),
        "--spool",
        str(spool),
        "--adverts-out",
        str(adverts),
    )
    prefix = ip_network(f"{ADDRESS}/32")
    try:
        assert node.ready["block_size"] == ENGINE_BLOCK
        assert (node.ready["signing_key_id"], node.ready["group_key_id"]) == (
            F.node.key_id.hex(),
            7,
        )
        assert node.ready["spool"] == str(spool)
        tokens = list(range(1000, 1000 + 3 * ENGINE_BLOCK))
        blocks = np.array(
            BlockKeyer(bytes.fromhex(SECRET), MODEL_ID, ENGINE_BLOCK).block_keys(tokens),
            dtype=np.uint64,
        )
        group = [F.group.active.to_json()]
        with VllmEventPublisher(f"tcp://127.0.0.1:{events}") as engine:

            def joined() -> bool:  # a PUB drops what it sends before the SUB is there
                engine.publish(time.time(), [])
                _, body = http(node.url + "/state")
                return json.loads(body)["node"]["ingest"]["batches"] > 0

            wait_until("the node taking in a batch", joined)
            engine.publish(
                time.time(),
                [
                    stored_event([b + 1], b or None, tokens[b * 32 : (b + 1) * 32], ENGINE_BLOCK)
                    for b in range(3)
                ],
            )

            def opened() -> Any:
                value = Spool(spool).read().get(prefix, (b"", 0.0))[0]
                if not value:
                    return None
                verdict = verify(value, prefix, keys["trust"], group)
                assert verdict.ok, verdict.detail
                return (
                    verdict.advertisement if summary_holds(verdict.advertisement, blocks) else None
                )

            adv = wait_until("the engine's blocks in a spooled, signed value", opened)
        assert adv.origin.address == ip_network(ADDRESS).network_address
        # a receiver without the group key verifies too, and sees the section sealed
        value, written = Spool(spool).read()[prefix]
        plain = verify(value, prefix, keys["trust"])
        assert plain.ok and plain.advertisement.get(wire.SealedCache) is not None
        assert plain.advertisement.cache_summaries is None

        # --adverts-out holds the signed values, the very bytes spooled (written just after)
        def written_out() -> list[dict[str, Any]]:
            lines = [json.loads(line) for line in adverts.read_text().splitlines()]
            return lines if value.hex() in {x["value"] for x in lines} else []

        lines = wait_until("the spooled value in --adverts-out", written_out, 5)
        assert {line["prefix"] for line in lines} == {str(prefix)}
        assert all(verify(bytes.fromhex(x["value"]), prefix, keys["trust"]).ok for x in lines)
        # nothing changes now, yet the file is rewritten within the max interval
        wait_until(
            "the route's file rewritten", lambda: Spool(spool).read()[prefix][1] > written, 5
        )
    finally:
        assert node.stop() == 0
    assert Spool(spool).read() == {}  # withdrawn: the announcer sends `withdraw route`


def test_an_engine_that_stops_answering_has_its_routes_withdrawn_until_it_is_back(
    keys: dict[str, Any], stand_in: StandInEngine, tmp_path: Path
) -> None:
    """/health answering 503 twice in a row (--down-after 2, --health-interval 0.2): the
    spool is emptied, a JSON line on stderr says so, /state shows the engine down, and
    nothing is spooled while it is, though the builder refreshes every second. When
    /health answers again the route is spooled afresh: a newer value that verifies."""
    spool = tmp_path / "spool"
    node = signed_node(
        stand_in.url,
        free_port(),
        keys,
        "--spool",
        str(spool),
        "--health-interval",
        "0.2",
        "--down-after",
        "2",
    )
    prefix = ip_network(f"{ADDRESS}/32")
    try:
        before = wait_until("a spooled value", lambda: Spool(spool).read().get(prefix))[0]
        stand_in.healthy = False
        wait_until("the route withdrawn", lambda: Spool(spool).read() == {}, 10)
        assert json.loads(node.proc.stderr.readline()) == {  # type: ignore[union-attr]
            "engine_down": stand_in.url,
            "failed_probes": 2,
            "withdrawn": 1,
        }
        health = json.loads(http(node.url + "/state")[1])["engine_health"]
        assert (health["up"], health["times_down"], health["down_after"]) == (False, 1, 2)
        time.sleep(1.5)  # more than --max-interval-ms: a refresh was due, and dropped
        assert Spool(spool).read() == {}
        stand_in.healthy = True
        after = wait_until("the route spooled again", lambda: Spool(spool).read().get(prefix))[0]
        assert json.loads(node.proc.stderr.readline()) == {"engine_up": stand_in.url}  # type: ignore[union-attr]
        old, new = (verify(v, prefix, keys["trust"]) for v in (before, after))
        assert old.ok and new.ok, new.detail
        assert new.advertisement.sequence.sequence > old.advertisement.sequence.sequence
        assert json.loads(http(node.url + "/state")[1])["engine_health"]["up"] is True
    finally:
        assert node.stop() == 0
    assert Spool(spool).read() == {}


def test_a_restarted_engine_is_told_by_its_start_time_and_its_old_blocks_go(
    keys: dict[str, Any], stand_in: StandInEngine, tmp_path: Path
) -> None:
    """Engine A stores prompt 0; the spool claims it. A new process B on the same
    endpoints stores prompt 1 before the node's subscription reaches it: no batch of
    B's arrives, so its sequence cannot tell. Its /metrics can: the start time moved.
    The node says so on stderr, forgets A's blocks and replays B's: the spool then
    claims prompt 1 and not prompt 0, and /state counts the restart."""
    spool = tmp_path / "spool"
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    node = signed_node(
        stand_in.url,
        int(events.rsplit(":", 1)[1]),
        keys,
        "--replay-endpoint",
        replay,
        "--scrape-interval",
        "0.2",
        "--change-threshold",
        "0",
        "--spool",
        str(spool),
    )
    prefix = ip_network(f"{ADDRESS}/32")
    keyer = BlockKeyer(bytes.fromhex(SECRET), MODEL_ID, ENGINE_BLOCK)
    prompts = [list(range(p * 1000, p * 1000 + 3 * ENGINE_BLOCK)) for p in (0, 1)]
    blocks = [np.array(keyer.block_keys(t), dtype=np.uint64) for t in prompts]

    def stores(p: int) -> list[Any]:
        tokens = prompts[p]
        return [
            stored_event(
                [p * 10 + b + 1], p * 10 + b if b else None, tokens[b * 32 : (b + 1) * 32], 32
            )
            for b in range(3)
        ]

    def spooled(holding: int, not_holding: int) -> Any:
        value = Spool(spool).read().get(prefix, (b"", 0.0))[0]
        if not value:
            return None
        verdict = verify(value, prefix, keys["trust"])
        assert verdict.ok, verdict.detail
        adv = verdict.advertisement
        ok = summary_holds(adv, blocks[holding]) and not summary_holds(adv, blocks[not_holding])
        return adv if ok else None

    try:
        with VllmEventPublisher(events, replay) as a:

            def joined() -> bool:  # a PUB drops what it sends before the SUB is there
                a.publish(time.time(), [])
                _, body = http(node.url + "/state")
                return json.loads(body)["node"]["ingest"]["batches"] > 0

            wait_until("the node taking in a batch", joined)
            a.publish(time.time(), stores(0))
            wait_until("prompt 0 in a spooled value", lambda: spooled(0, 1))
        with reopened(events, replay, None) as b:
            b.publish(time.time(), stores(1), lose=True)  # before any subscription
            stand_in.restart(1.8e9)
            wait_until("prompt 1, and not prompt 0, in a spooled value", lambda: spooled(1, 0), 10)
        said = json.loads(node.proc.stderr.readline())  # type: ignore[union-attr]
        assert said == {"engine_restarted": stand_in.url, "process_start_time_s": 1.8e9}
        state = json.loads(http(node.url + "/state")[1])
        assert state["engine"]["restarts"] == 1
        assert state["node"]["subscriber"]["engine_restarts"] == 1
    finally:
        assert node.stop() == 0


# ---- the shared step, and the lab's engine site on it ------------------------------------


def test_signed_routes_seal_sign_spool_and_withdraw(keys: dict[str, Any], tmp_path: Path) -> None:
    from catsproto.lab import sealing
    from catsproto.node import AdvertisementBuilder, BuilderConfig, TieredCache, TierSpec

    assert sealing.sealed is sealed  # the lab imports the moved step, unchanged
    config = BuilderConfig(
        cs_id=1,
        address=ADDRESS,
        model_id=MODEL_ID,
        block_size=16,
        bytes_per_block=4096,
        shard_range="10.0.1.0/24",
    )
    cache = TieredCache([TierSpec(Tier.HBM, 64, 5, 1_600_000)])
    routes = AdvertisementBuilder(config, cache, 1).poll(
        now_ms(), ComputeState(prefill_rate_tps=1000.0), force=True
    )
    assert len(routes) >= 2  # the main route and a shard
    spool = Spool(tmp_path / "spool")
    signed = SignedRoutes(F.node, group_keys=F.group, spool=spool)
    values = signed.publish(routes)
    assert {p: v for p, (v, _) in spool.read().items()} == {
        r.prefix: v for r, v in zip(routes, values, strict=True)
    }
    for r, v in zip(routes, values, strict=True):
        verdict = verify(v, r.prefix, keys["trust"])
        assert verdict.ok, verdict.detail
        assert verdict.advertisement.get(wire.SealedCache) is not None
    assert signed.withdraw_all() == len(routes) and spool.read() == {}
    assert signed.withdraw_all() == 0
    # without a spool: values only (what --adverts-out alone gets), unsealed without keys
    alone = SignedRoutes(F.node).publish(routes[:1])
    assert (
        verify(alone[0], routes[0].prefix, keys["trust"]).advertisement.get(wire.CacheModel)
        is not None
    )


def test_the_lab_engine_site_publishes_through_the_same_step(
    keys: dict[str, Any], tmp_path: Path
) -> None:
    """`EngineCsma` (no engine, no lab: its builder polled by hand): nothing goes out
    while the engine is down; up, every route is sealed, signed and spooled; the
    withdrawal empties the spool and is counted once."""
    from catsproto.lab.engine import EngineSpec
    from catsproto.lab.engine_site import ENGINE_PREFILL_TPS, EngineCsma
    from catsproto.lab.topology import InstanceSpec

    spec = InstanceSpec("e1", ip_network("10.0.0.9/32"), ip_network("10.0.2.0/24"), 200, 1)
    spool = Spool(tmp_path / "spool")
    csma = EngineCsma(
        spec,
        EngineSpec(host="127.0.0.1", ipc_dir=tmp_path),
        spool,
        F.node,
        secret=bytes.fromhex(SECRET),
        secret_id=0,
        group_keys=F.group,
    )
    try:
        routes = csma.node.builder.poll(
            now_ms(), ComputeState(prefill_rate_tps=ENGINE_PREFILL_TPS), force=True
        )
        csma._publish(routes)
        assert spool.read() == {}  # not up: an engine not answering is not advertised
        csma.up = True
        csma._publish(routes)
        spooled = spool.read()
        assert set(spooled) == {r.prefix for r in routes} and csma.state()["routes"] == len(routes)
        for prefix, (value, _) in spooled.items():
            verdict = verify(value, prefix, keys["trust"], [F.group.active.to_json()])
            assert verdict.ok, verdict.detail
            assert verdict.advertisement.cache_model is not None  # opened
        csma._withdraw_all()
        csma._withdraw_all()
        assert spool.read() == {} and csma.withdrawals == 1 and csma.state()["routes"] == 0
    finally:
        csma.node.close()


# ---- usage errors -------------------------------------------------------------------------


def test_a_spool_without_a_signing_key_exits_2_saying_why(tmp_path: Path) -> None:
    r = subprocess.run(
        [*NODE, "--spool", str(tmp_path / "spool")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert r.stderr == (
        "catsproto instance node: --spool needs --signing-key: receivers with a trust file "
        "refuse unsigned advertisements, so the routes spooled would carry nothing they "
        "accept\n"
    )
    assert not (tmp_path / "spool").exists()


def _refusal(*extra: str) -> str:
    args = build_parser().parse_args(["instance", "node", "--secret", SECRET, *extra])
    with pytest.raises(UsageError) as caught:
        args.func(args)
    return str(caught.value)


def test_bad_key_options_are_refused_before_anything_starts(
    keys: dict[str, Any], tmp_path: Path
) -> None:
    node, group = str(keys["node"]), str(keys["group"])
    assert _refusal("--group-key", group).startswith("--group-key needs --signing-key: ")
    assert _refusal("--signing-key", group) == (
        f"--signing-key {group}: not a private key file (format catsproto-ed25519-private/1)"
    )
    assert _refusal("--signing-key", str(tmp_path / "none.key")) == (
        f"--signing-key {tmp_path / 'none.key'}: cannot read: No such file or directory"
    )
    assert _refusal("--signing-key", node, "--group-key", node).startswith(
        f"--group-key {node}: not a group key file"
    )
    three = ("--group-key", group) * 3
    assert _refusal("--signing-key", node, *three) == (
        "--group-key: give one or two group keys (active first), not 3"
    )
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert _refusal("--signing-key", node, "--spool", str(blocker)) == (
        f"--spool {blocker}: cannot make it the spool folder: File exists"
    )
    Path(node).chmod(0o644)
    assert _refusal("--signing-key", node) == (
        f"--signing-key: key file {node} has mode 0644: group and others can read it, and it "
        f"holds a secret; make it private to its owner: chmod 600 {node}"
    )
