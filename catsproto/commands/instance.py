"""`catsproto instance`: the modelled inference instance and its C-SMA node.

    catsproto instance serve --secret HEX --cs-id 1 --address 10.0.0.5 [...]
        the modelled engine (HTTP + vLLM KV events on ZMQ) and, unless --no-node, the
        node that ingests those events and builds advertisements
    catsproto instance node --secret HEX --cs-id 1 --address 10.0.0.5 \\
        --engine-url http://127.0.0.1:8000 --endpoint tcp://*:5557 \\
        --replay-endpoint tcp://*:5567 --engine-host 127.0.0.1
        only the node, next to a real vLLM: its KV events (the endpoints of its
        --kv-events-config), its /metrics (block size, KV blocks, load), and an HTTP
        face of its own

Advertisements go to --adverts-out as JSON lines: prefix, epoch, sequence, reason and
the attribute value in hex, unsigned; `instance node --signing-key` signs each for its
route (sealing its cache section first under --group-key) and writes the signed value,
and with --spool hands it to ExaBGP's announce process
(`catsproto.adapters.exabgp_announce`) through `adapters/signed_routes.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from catsproto.adapters.stop import StopSignal
from catsproto.commands import UsageError
from catsproto.keys import ENGINE_MOONCAKE, ENGINE_VLLM, BlockKeyer
from catsproto.node import (
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    KeyMode,
    ModelShape,
    RouteAdvertisement,
    TierSpec,
)
from catsproto.wire import Tier

if TYPE_CHECKING:
    from catsproto.adapters.signed_routes import SignedRoutes

DEFAULT_TIERS = ["hbm:2048:5:1600000", "dram:16384:30:400000"]
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20  # the modelled engine's own default (adapters.instance)
DEFAULT_BLOCK_SIZE = 16  # without an engine to ask (instance serve; node without --engine-url)
VLLM_EVENTS_ENDPOINT = "tcp://*:5557"  # vLLM's KVEventsConfig.endpoint default
SUBSCRIBE_WAIT_MS = 10_000  # instance serve: how long its node may take to subscribe
NODE_PORT = 8101  # instance serve's HTTP API is 8100

VLLM_SIDE_EXAMPLE = """\
    vllm serve MODEL --port 8000 --enable-prefix-caching --block-size 32 \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567", "topic": "kv"}'
    catsproto instance node --secret HEX --model-id MODEL --address 10.0.0.5 \\
        --engine-url http://127.0.0.1:8000 --endpoint 'tcp://*:5557' \\
        --replay-endpoint 'tcp://*:5567' --engine-host 127.0.0.1 \\
        --api-token-file node.token --adverts-out adverts.jsonl"""


def parse_tier(text: str) -> TierSpec:
    """``name:capacity_blocks:fetch_latency_us:fetch_bandwidth_mbps``."""
    parts = text.split(":")
    if len(parts) != 4:
        raise UsageError(f"tier {text!r}: expected name:blocks:latency_us:bandwidth_mbps")
    name, *numbers = parts
    try:
        tier = Tier[name.upper()]
    except KeyError:
        raise UsageError(f"tier {text!r}: name must be hbm, dram, ssd or remote") from None
    try:
        cap, lat, bw = (int(n) for n in numbers)
        return TierSpec(tier, cap, lat, bw)
    except ValueError as exc:
        raise UsageError(f"tier {text!r}: {exc}") from None


def _tiers(args: argparse.Namespace) -> list[TierSpec]:
    tiers = sorted((parse_tier(t) for t in (args.tier or DEFAULT_TIERS)), key=lambda s: s.tier)
    if len({s.tier for s in tiers}) != len(tiers):
        raise UsageError("each tier may be given once")
    return tiers


def _secret(args: argparse.Namespace) -> bytes:
    try:
        secret = bytes.fromhex(args.secret)
    except ValueError:
        raise UsageError("--secret must be hex") from None
    if not 16 <= len(secret) <= 64:
        raise UsageError(f"--secret must be 16..64 bytes, got {len(secret)}")
    return secret


def _builder_config(args: argparse.Namespace, tiers: list[TierSpec]) -> BuilderConfig:
    """The node's configuration, checked by building the first (empty-cache) advertisement:
    what the message size must hold depends on the model id, the address family and the
    shard range, so the builder itself is the judge."""
    from catsproto.node import AdvertisementBuilder, TieredCache

    if not 0 < args.target_fpr < 1:  # also refuses NaN
        raise UsageError(f"--target-fpr {args.target_fpr} is not between 0 and 1")
    if not 0 < args.max_message <= 65535:
        raise UsageError(f"--max-message {args.max_message} is not 1..65535")
    if not 0 < args.prefill_rate < math.inf:
        raise UsageError(f"--prefill-rate {args.prefill_rate} is not a positive number")
    try:
        shape = ModelShape(
            args.layers, args.kv_heads, args.head_dim, args.dtype_bytes, args.block_size
        )
        config = BuilderConfig(
            cs_id=args.cs_id,
            address=args.address,
            model_id=args.model_id,
            block_size=args.block_size,
            bytes_per_block=shape.bytes_per_block,
            site_id=args.site_id,
            secret_id=args.secret_id,
            target_fpr=args.target_fpr,
            max_message_bytes=args.max_message,
            shard_range=args.shard_range,
            dampening=DampeningPolicy(
                args.min_interval_ms,
                args.max_interval_ms,
                args.change_threshold,
                score_threshold=args.score_threshold,
                wait_threshold_ms=args.wait_threshold_ms,
            ),
        )
        builder = AdvertisementBuilder(config, TieredCache(tiers), 1)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        builder.poll(0, ComputeState(prefill_rate_tps=args.prefill_rate), force=True)
    except (ValueError, ArithmeticError) as exc:  # AdvertisementTooLarge, or no room to size
        raise UsageError(
            f"the node's first advertisement does not fit --max-message {args.max_message}: {exc}"
        ) from None
    return config


def _writer(path: str | None, signed: SignedRoutes | None = None) -> tuple[Any, TextIO | None]:
    """The node's `on_routes`: each route signed and spooled (`signed`), then written to
    --adverts-out as a JSON line, with the signed value when there is one. Also the file
    to close at the end (None for stdout or no file)."""
    out: TextIO | None = None
    if path is not None:
        try:
            out = sys.stdout if path == "-" else Path(path).open("a", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise UsageError(f"--adverts-out {path}: cannot open: {exc.strerror or exc}") from None
    if out is None and signed is None:
        return None, None
    lock = threading.Lock()

    def on_routes(routes: list[RouteAdvertisement]) -> None:
        from catsproto.adapters.instance import route_json

        values = signed.publish(routes) if signed is not None else None
        if out is None:
            return
        with lock:
            for i, r in enumerate(routes):
                line = route_json(r)
                del line["advertisement"]
                if values is not None:
                    line["value"] = values[i].hex()
                out.write(json.dumps(line) + "\n")
            out.flush()

    return on_routes, (out if out is not sys.stdout else None)


def _key_file(option: str, path: str, read: Callable[[str], Any]) -> Any:
    """A key file an option names, read by `read` (`signed_routes.read_signing_key` or
    `read_group_key`, which refuse a file group or others may use); an error names the
    option and the path once."""
    from catsproto.adapters.file_modes import FileModeError

    try:
        return read(path)
    except FileModeError as exc:
        raise UsageError(f"{option}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"{option} {path}: {exc}") from None


def _signing_summary(signed: SignedRoutes | None) -> dict[str, Any]:
    """For the ready line: the key id that signs, the group key that seals, the spool."""
    keys = signed.group_keys if signed is not None else None
    spool = signed.spool if signed is not None else None
    return {
        "signing_key_id": signed.signer.key_id.hex() if signed is not None else None,
        "group_key_id": keys.active.key_id if keys is not None else None,
        "spool": str(spool.path) if spool is not None else None,
    }


def _signed_routes(args: argparse.Namespace) -> SignedRoutes | None:
    """What --signing-key, --group-key and --spool ask for, or None for unsigned
    advertisements. A spool or a group key without a signing key is refused: receivers
    that hold a trust file refuse unsigned values and open sealed sections only in
    values whose signature they verified, so either would put nothing usable in BGP."""
    from catsproto import security
    from catsproto.adapters.exabgp_announce import Spool
    from catsproto.adapters.file_modes import FileModeError
    from catsproto.adapters.signed_routes import SignedRoutes, read_group_key, read_signing_key

    if args.signing_key is None:
        if args.spool is not None:
            raise UsageError(
                "--spool needs --signing-key: receivers with a trust file refuse unsigned "
                "advertisements, so the routes spooled would carry nothing they accept"
            )
        if args.group_key:
            raise UsageError(
                "--group-key needs --signing-key: receivers open a sealed cache section "
                "only in an advertisement whose signature they verified"
            )
        return None
    signer = _key_file("--signing-key", args.signing_key, read_signing_key)
    group_keys = None
    if args.group_key:
        keys = [_key_file("--group-key", path, read_group_key) for path in args.group_key]
        try:
            group_keys = security.GroupKeyring.of(keys)
        except ValueError as exc:
            raise UsageError(f"--group-key: {exc}") from None
    spool = None
    if args.spool is not None:
        try:
            spool = Spool(args.spool)
        except FileModeError as exc:
            raise UsageError(f"--spool: {exc}") from None
        except OSError as exc:
            raise UsageError(
                f"--spool {args.spool}: cannot make it the spool folder: {exc.strerror or exc}"
            ) from None
        if not os.access(spool.path, os.W_OK | os.X_OK):
            raise UsageError(f"--spool {args.spool}: this user cannot write in it")
    return SignedRoutes(signer, group_keys=group_keys, spool=spool)


def _stop_on_signal() -> StopSignal:
    """SIGINT or SIGTERM ends the command. Installed before the command says it is ready,
    so a supervisor that stops it right after the ready line gets a clean shutdown, not the
    default action of the signal."""
    return StopSignal()


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise UsageError(f"--port {value} is not 0..65535")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    import zmq

    from catsproto.adapters.http import token_option
    from catsproto.adapters.instance import EngineConfig, InstanceServer, ModelledEngine, NodeAgent
    from catsproto.adapters.vllm_events import RankEndpoint

    tiers = _tiers(args)
    port = _port(args.port)
    try:
        token = token_option(args.api_token_file, "--api-token-file")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for name, value in (("--prefill-rate", args.prefill_rate), ("--time-scale", args.time_scale)):
        if not 0 < value < math.inf:  # also refuses NaN
            raise UsageError(f"{name} {value} is not a positive number")
    if args.max_prompt_tokens < 1:
        raise UsageError(f"--max-prompt-tokens {args.max_prompt_tokens} is not >= 1")
    config = _builder_config(args, tiers) if not args.no_node else None
    secret = _secret(args) if not args.no_node else b""
    on_routes, sink = _writer(args.adverts_out) if config is not None else (None, None)
    try:
        engine = ModelledEngine(
            EngineConfig(
                block_size=args.block_size,
                prefill_rate_tps=args.prefill_rate,
                time_scale=args.time_scale,
                tiers=tuple(tiers),
                pub_endpoint=args.pub_endpoint,
                replay_endpoint=args.replay_endpoint,
                accept_open_events=args.accept_open_kv_events,
                max_prompt_tokens=args.max_prompt_tokens,
            )
        )
    except (zmq.ZMQError, ValueError) as exc:
        if sink is not None:
            sink.close()
        raise UsageError(
            f"cannot publish KV events on --pub-endpoint {args.pub_endpoint!r} "
            f"/ --replay-endpoint {args.replay_endpoint!r}: {exc}"
        ) from None
    node = None
    try:
        if config is not None:
            mooncake = args.keys == "mooncake"
            node = NodeAgent(
                config,
                tiers,
                BlockKeyer(secret, args.model_id, args.block_size),
                [RankEndpoint(0, engine.publisher.endpoint, engine.publisher.replay_endpoint)],
                engine.compute_state,
                key_mode=KeyMode.ENGINE_IDS if mooncake else KeyMode.TOKENS,
                engine=ENGINE_MOONCAKE if mooncake else ENGINE_VLLM,
                on_routes=on_routes,
                hits=engine.hits,
            ).start()
            # its node hears the first request's events only once subscribed
            engine.publisher.wait_subscribed(SUBSCRIBE_WAIT_MS)
        try:
            server = InstanceServer(engine, node, args.host, port, api_token=token).start()
        except OSError as exc:
            raise UsageError(
                f"--host {args.host} --port {port}: cannot listen: {exc.strerror or exc}"
            ) from None
    except (OSError, ValueError, UsageError) as exc:
        if node is not None:
            node.close()
        engine.close()
        if sink is not None:
            sink.close()
        raise (exc if isinstance(exc, UsageError) else UsageError(str(exc))) from None
    stop = _stop_on_signal()
    print(
        json.dumps(
            {
                "listening": server.url,
                "kv_events": engine.publisher.endpoint,
                "replay": engine.publisher.replay_endpoint,
            }
        ),
        file=sys.stderr,
        flush=True,
    )
    try:
        stop.wait()
    finally:
        server.close()
        if sink is not None:
            sink.close()
    return 0


def _engine_url(text: str) -> str:
    """``http(s)://HOST:PORT`` of the engine's OpenAI server (the node reads /metrics)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError as exc:
        raise UsageError(f"--engine-url {text}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--engine-url {text}: expected http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise UsageError(
            f"--engine-url {text}: give the engine's base URL, http://HOST:PORT "
            "(the node reads HOST:PORT/metrics)"
        )
    return text.rstrip("/")


def _engine_tiers(args: argparse.Namespace, num_gpu_blocks: int, where: str) -> list[TierSpec]:
    """The node's tiers next to a real engine: HBM holds the engine's own KV blocks
    (vLLM's num_gpu_blocks); a --tier hbm must say the same, other --tier entries (an
    offloading connector's tiers) are kept as given. Without --tier: HBM alone."""
    default_hbm = parse_tier(DEFAULT_TIERS[0])
    given = _tiers(args) if args.tier else []
    hbm = next((t for t in given if t.tier is Tier.HBM), None)
    if hbm is not None and hbm.capacity_blocks != num_gpu_blocks:
        raise UsageError(
            f"--tier hbm capacity {hbm.capacity_blocks} blocks differs from the engine's "
            f"{num_gpu_blocks} (num_gpu_blocks at {where}): write "
            f"--tier hbm:{num_gpu_blocks}:{hbm.fetch_latency_us}:{hbm.fetch_bandwidth_mbps} "
            "or leave --tier hbm out"
        )
    top = TierSpec(
        Tier.HBM,
        num_gpu_blocks,
        (hbm or default_hbm).fetch_latency_us,
        (hbm or default_hbm).fetch_bandwidth_mbps,
    )
    return [top, *(t for t in given if t.tier is not Tier.HBM)]


def _positive(name: str, value: float, *, zero: bool = False) -> float:
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise UsageError(f"{name} {value} is not a {'' if zero else 'positive '}number")
    return value


def _say(line: dict[str, Any]) -> None:
    """One JSON line on stderr, as the ready line is."""
    print(json.dumps(line), file=sys.stderr, flush=True)


def cmd_node(args: argparse.Namespace) -> int:
    from catsproto.adapters.engine_health import HealthGate
    from catsproto.adapters.http import token_option
    from catsproto.adapters.instance import NodeAgent
    from catsproto.adapters.node_http import NodeServer
    from catsproto.adapters.vllm_events import subscriber_endpoints
    from catsproto.adapters.vllm_metrics import (
        EngineMetricsError,
        EngineScraper,
        metrics_url,
        wait_for_engine,
    )
    from catsproto.node.engine_metrics import EngineMetrics

    if args.dp_ranks < 1:
        raise UsageError(f"--dp-ranks {args.dp_ranks} is not >= 1")
    port = _port(args.port)
    try:
        token = token_option(args.api_token_file, "--api-token-file")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    engine_url = _engine_url(args.engine_url) if args.engine_url else None
    _positive("--engine-wait", args.engine_wait, zero=True)
    _positive("--scrape-interval", args.scrape_interval)
    _positive("--health-interval", args.health_interval)
    if args.down_after < 1:
        raise UsageError(f"--down-after {args.down_after} is not >= 1")
    given_block_size = args.block_size
    if given_block_size is not None and given_block_size < 1:
        raise UsageError(f"--block-size {given_block_size} is not >= 1")
    # every option that needs no engine is checked before the node waits for one
    args.block_size = given_block_size or DEFAULT_BLOCK_SIZE
    config = _builder_config(args, _tiers(args))
    secret = _secret(args)
    try:
        endpoints = subscriber_endpoints(
            args.endpoint, args.replay_endpoint, range(args.dp_ranks), args.engine_host
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    signed = _signed_routes(args)
    on_routes, sink = _writer(args.adverts_out, signed)
    server = node = scraper = gate = None
    routes_lock = threading.Lock()

    def publish(routes: list[RouteAdvertisement]) -> None:
        # nothing goes out for an engine that does not answer (the gate withdrew its
        # routes, under the same lock: a publish under way finishes first)
        with routes_lock:
            if (gate is None or gate.up) and on_routes is not None:
                on_routes(routes)

    def engine_down() -> None:
        with routes_lock:
            withdrawn = signed.withdraw_all() if signed is not None else 0
        assert gate is not None
        _say({"engine_down": engine_url, "failed_probes": gate.in_a_row, "withdrawn": withdrawn})

    def engine_back() -> None:
        assert node is not None and scraper is not None
        scraper.scrape_once()  # a new process is found before anything is sent again
        node.readvertise()
        _say({"engine_up": engine_url})

    def engine_restarted(m: EngineMetrics) -> None:
        # another process answers now: what the old one held is gone with it
        assert node is not None
        node.engine_restarted()
        _say({"engine_restarted": engine_url, "process_start_time_s": m.process_start_time_seconds})

    try:
        try:
            server = NodeServer(
                args.host, port, api_token=token, waiting_for=f"its engine at {engine_url}"
            ).start()
        except OSError as exc:
            raise UsageError(
                f"--host {args.host} --port {port}: cannot listen: {exc.strerror or exc}"
            ) from None
        stop = _stop_on_signal()
        if engine_url is None:
            tiers = _tiers(args)
            compute_state: Callable[[], ComputeState] = partial(
                ComputeState, prefill_rate_tps=args.prefill_rate
            )
            hits = None
        else:
            try:
                first = wait_for_engine(
                    engine_url, args.engine_wait, should_stop=lambda: stop.requested
                )
            except EngineMetricsError as exc:
                raise UsageError(str(exc)) from None
            if first is None:  # stopped while waiting
                return 0
            where = metrics_url(engine_url)
            if given_block_size is not None and given_block_size != first.block_size:
                raise UsageError(
                    f"--block-size {given_block_size} differs from the engine's block size "
                    f"{first.block_size} (vllm:cache_config_info at {where}): the node would "
                    "key no block the engine publishes; leave --block-size out (the node "
                    "takes the engine's) or start vLLM with the same --block-size"
                )
            args.block_size = first.block_size
            tiers = _engine_tiers(args, first.num_gpu_blocks, where)
            config = _builder_config(args, tiers)
            scraper = EngineScraper(
                engine_url,
                first,
                args.prefill_rate,
                interval_s=args.scrape_interval,
                on_restart=engine_restarted,
            )
            compute_state, hits = scraper.compute_state, scraper.hits
        try:
            node = NodeAgent(
                config,
                tiers,
                BlockKeyer(secret, args.model_id, args.block_size),
                endpoints,
                compute_state,
                on_routes=publish,
                hits=hits,
            ).start()
        except Exception as exc:
            raise UsageError(f"cannot start the node: {exc}") from None
        if scraper is not None:
            scraper.start()
            gate = HealthGate(
                scraper.engine_url,
                engine_down,
                engine_back,
                interval_s=args.health_interval,
                down_after=args.down_after,
            )
            gate.start()  # named first: its callbacks read `gate`
        server.attach(node, scraper, gate)
        print(
            json.dumps(
                {
                    "listening": server.url,
                    "kv_events": [e.pub for e in endpoints],
                    "replay": [e.replay for e in endpoints],
                    "node_binds": endpoints[0].bind,
                    "engine": engine_url,
                    "block_size": args.block_size,
                    "capacity_blocks": {t.tier.name.lower(): t.capacity_blocks for t in tiers},
                    "prefill_rate_tps": compute_state().prefill_rate_tps,
                    "prefill_rate": scraper.rate.source if scraper is not None else "configured",
                    **_signing_summary(signed),
                }
            ),
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
    finally:
        if gate is not None:
            gate.close()
        if server is not None:
            server.close()
        if scraper is not None:
            scraper.close()
        if node is not None:
            node.close()
        if signed is not None:
            signed.withdraw_all()  # the node no longer speaks for its engine
        if sink is not None:
            sink.close()
    return 0


def _common(
    p: argparse.ArgumentParser,
    *,
    secret_required: bool,
    block_size_default: int | None = DEFAULT_BLOCK_SIZE,
    block_size_help: str = "tokens per block",
    tier_help: str = "",
) -> None:
    g = p.add_argument_group("advertisement")
    g.add_argument(
        "--secret",
        required=secret_required,
        help="block-key secret, hex (16..64 bytes), shared with the selectors",
    )
    g.add_argument(
        "--secret-id",
        type=int,
        default=0,
        help="which secret made the block keys (advertised in the cache-model TLV)",
    )
    g.add_argument("--cs-id", type=int, default=1, help="the service (CS-ID) advertised")
    g.add_argument("--site-id", type=int, default=0, help="the site advertised in the origin")
    g.add_argument("--address", default="127.0.0.1", help="the instance's CSCI-ID address")
    g.add_argument(
        "--model-id",
        default="meta-llama/Llama-3.1-8B-Instruct",
        help="the model, advertised and mixed into every block key",
    )
    g.add_argument(
        "--shard-range",
        help="the instance's own prefix for shard routes, e.g. 10.255.1.0/24 "
        "(default: one route, on the CSCI-ID address)",
    )
    g.add_argument(
        "--max-message",
        type=int,
        default=4096,
        help="largest BGP message in bytes, 1..65535, that each advertisement's UPDATE must fit "
        "(the first is built at start to check): 4096 is BGP's limit, up to 65535 needs "
        "extended messages (RFC 8654) on the sessions",
    )
    g.add_argument(
        "--target-fpr",
        type=float,
        default=0.01,
        help="false-positive rate the cache summaries are sized for",
    )
    g.add_argument(
        "--min-interval-ms",
        type=int,
        default=1000,
        help="dampening: never two advertisements closer than this",
    )
    g.add_argument(
        "--max-interval-ms",
        type=int,
        default=30_000,
        help="dampening: refresh at least this often, even when nothing changed",
    )
    g.add_argument(
        "--change-threshold",
        type=float,
        default=0.05,
        help="dampening: advertise early when this fraction of the advertised block keys changed",
    )
    g.add_argument(
        "--score-threshold",
        type=int,
        default=1,
        help="dampening: advertise early when an L1/L2 score moved by this many points "
        "(1..10; 11: score moves alone never trigger an update)",
    )
    g.add_argument(
        "--wait-threshold-ms",
        type=float,
        default=100.0,
        help="dampening: advertise early when the queue wait is this many ms off what "
        "receivers predict from the last advertisement (inf: never)",
    )
    g.add_argument("--adverts-out", help="append advertisements as JSON lines (- for stdout)")
    g = p.add_argument_group("model")
    g.add_argument("--block-size", type=int, default=block_size_default, help=block_size_help)
    g.add_argument("--layers", type=int, default=32, help="layers (sizes a block's KV bytes)")
    g.add_argument(
        "--kv-heads", type=int, default=8, help="KV heads per layer (sizes a block's KV bytes)"
    )
    g.add_argument(
        "--head-dim", type=int, default=128, help="head dimension (sizes a block's KV bytes)"
    )
    g.add_argument(
        "--dtype-bytes",
        type=int,
        default=2,
        help="bytes per KV element, 2 for fp16/bf16 (sizes a block's KV bytes)",
    )
    g.add_argument(
        "--prefill-rate",
        type=float,
        default=8000.0,
        help="prefill rate in tokens per second: the modelled engine's speed (serve) and "
        "what the node advertises (node --engine-url: until it has measured the engine's "
        "own rate from its /metrics)",
    )
    g.add_argument(
        "--tier",
        action="append",
        help="name:blocks:latency_us:bandwidth_mbps, repeatable "
        f"(default {' '.join(DEFAULT_TIERS)}{tier_help})",
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "instance", help="the modelled inference instance and its node", description=__doc__
    )
    sub = p.add_subparsers(dest="instance_command", required=True, metavar="ACTION")

    s = sub.add_parser(
        "serve",
        help="modelled engine (HTTP, vLLM KV events) plus its node",
        description="Run the modelled inference engine: an HTTP API on --host and --port, "
        "vLLM-format KV events on ZMQ (--pub-endpoint, --replay-endpoint). Unless "
        "--no-node, the node (C-SMA) in the same process ingests those events and builds "
        "advertisements (unsigned; written to --adverts-out). Prints its endpoints as JSON "
        "on stderr; runs until SIGINT or SIGTERM. The KV events carry the prompts' token "
        "ids and ZMQ asks no credential, so by default they go over ipc in a folder of mode "
        "0700 made for the engine, and never where others can connect from another host "
        "(only inproc, loopback tcp, ipc://FOLDER/NAME with FOLDER mode 0700 and owned by "
        "this user) unless --accept-open-kv-events.",
    )
    s.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    s.add_argument("--port", type=int, default=8100, help="port of the HTTP API (0: any)")
    s.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="model seconds per wall-clock second (above 1: the engine runs faster)",
    )
    s.add_argument(
        "--pub-endpoint",
        default="private",
        help="ZMQ endpoint the engine publishes vLLM KV events on; default private: "
        "ipc://FOLDER/events in a folder of mode 0700 made for it (removed at exit; the "
        "ready line names it), which no other local user can reach. Else inproc, loopback "
        "tcp (any local user can connect; *: any port) or ipc in a private folder, unless "
        "--accept-open-kv-events",
    )
    s.add_argument(
        "--replay-endpoint",
        default="private",
        help="ZMQ endpoint of the engine's replay service; default private "
        "(ipc://FOLDER/replay, the same folder); the same rule",
    )
    s.add_argument(
        "--accept-open-kv-events",
        action="store_true",
        help="publish KV events where others can connect: the events carry prompt token "
        "ids and ZMQ asks no credential (no CURVE: subscribers written for vLLM could not "
        "read it), so without this flag a tcp endpoint that is not loopback, ipc://*, "
        "ipc://@NAME and an ipc folder that is not mode 0700 and ours are refused (a "
        "missing ipc folder is made 0700); give it only on a network protected otherwise",
    )
    s.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help="the longest prompt served, as vLLM's max_model_len (a Mooncake input_length "
        "must also fit its hash_ids × --block-size); longer ones get 400 "
        f"(default {DEFAULT_MAX_PROMPT_TOKENS})",
    )
    s.add_argument(
        "--keys",
        choices=["tokens", "mooncake"],
        default="tokens",
        help="key blocks by token ids, or by Mooncake hash_ids",
    )
    s.add_argument(
        "--api-token-file",
        help="file holding the bearer token (16+ printable ASCII characters) that POST "
        "/generate and GET /state, /advertisements, /metrics require (GET /health stays "
        "open); without it /generate answers anyone with the block count only (nothing of "
        "what was cached) and the GET views are refused (403)",
    )
    s.add_argument("--no-node", action="store_true", help="run the engine only")
    _common(s, secret_required=False)
    s.set_defaults(func=_serve_checked, command_prog=s.prog)

    n = sub.add_parser(
        "node",
        help="the node alone, next to a real vLLM (its KV events and /metrics)",
        description="Run the node (C-SMA) next to a real vLLM engine: it subscribes to "
        "the engine's KV events (the endpoints of its --kv-events-config, one pair per "
        "data-parallel rank), reads the engine's block size, KV blocks and load from its "
        "/metrics (--engine-url), builds advertisements and serves GET /health, /state, "
        "/advertisements and /metrics on --host and --port. When it runs it prints one "
        "JSON line on stderr (what it listens to and serves); it runs until SIGINT or "
        "SIGTERM.\n\n"
        "Both sides must name the same endpoints: --endpoint and --replay-endpoint here "
        "are vLLM's endpoint and replay_endpoint. vLLM binds them when they hold * (or "
        "are ipc://), and --engine-host tells the node where to connect. vLLM adds the "
        "data-parallel rank to the port of both, so keep them at least --dp-ranks apart "
        "(5557 and 5567 serve up to ten ranks). Set a replay endpoint on both sides: "
        "without it a lost event batch costs the node all it knew of that rank.\n\n"
        "With --engine-url the node waits (--engine-wait) for the engine's /metrics, takes "
        "its block size (a --block-size that differs is refused) and its KV blocks as the "
        "HBM tier's capacity, and scrapes it every --scrape-interval for the queue, KV "
        "usage and the measured prefill rate it advertises. It also asks the engine's "
        "/health every --health-interval: after --down-after failed probes in a row it "
        "withdraws every spooled route and publishes nothing (a JSON line on stderr says "
        "so, /state shows engine_health), and when the engine answers again it sends every "
        "route afresh. A scrape whose process_start_time_seconds moved is a new engine "
        "process: the node forgets the old one's blocks, replays the new one's events and "
        "says engine_restarted on stderr. Without --engine-url the node advertises "
        "the configured --tier capacities and --prefill-rate, and --block-size (default "
        f"{DEFAULT_BLOCK_SIZE}) must be the engine's.\n\n"
        "Into BGP: with --signing-key every advertisement is signed for its route (its "
        "cache section sealed first under --group-key) and --adverts-out writes the "
        "signed value, the bytes that go into BGP (without --signing-key it writes them "
        "unsigned). With --spool DIR as well, each route's value is written to DIR, one "
        "file per route, for ExaBGP's announce process (python -m "
        "catsproto.adapters.exabgp_announce --spool DIR, in ExaBGP's configuration) to "
        "announce; the node rewrites every file at least once per --max-interval-ms and "
        "removes its files (withdraws its routes) when it stops, so give the announcer a "
        "--lease above that interval to withdraw the routes of a node that was killed. "
        "--spool and --group-key need --signing-key: receivers with a trust file refuse "
        "unsigned values and open a sealed section only in a value whose signature they "
        "verified.\n\n"
        "A vLLM and its node, on one host:\n\n" + VLLM_SIDE_EXAMPLE,
    )
    n.add_argument(
        "--engine-url",
        metavar="http://HOST:PORT",
        help="the engine's OpenAI server: the node reads HOST:PORT/metrics at start (block "
        "size, KV blocks) and then every --scrape-interval (queue, KV usage, prefill rate)",
    )
    n.add_argument(
        "--engine-wait",
        type=float,
        default=300.0,
        help="seconds to wait at start for the engine's /metrics (a vLLM takes a minute "
        "or more to start) before giving up",
    )
    n.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between two scrapes of the engine's /metrics",
    )
    n.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        help="with --engine-url: seconds between two probes of the engine's /health",
    )
    n.add_argument(
        "--down-after",
        type=int,
        default=3,
        help="with --engine-url: failed /health probes in a row after which the node "
        "withdraws its routes until the engine answers again",
    )
    n.add_argument(
        "--endpoint",
        default=VLLM_EVENTS_ENDPOINT,
        help="vLLM's kv-events endpoint: its --kv-events-config endpoint (default "
        f"{VLLM_EVENTS_ENDPOINT}, as vLLM's)",
    )
    n.add_argument(
        "--replay-endpoint",
        help="vLLM's replay endpoint (its --kv-events-config replay_endpoint; vLLM has "
        "none by default): set it on both sides, e.g. tcp://*:5567",
    )
    n.add_argument("--engine-host", default="127.0.0.1", help="replaces * in the endpoints")
    n.add_argument(
        "--dp-ranks",
        type=int,
        default=1,
        help="vLLM data-parallel ranks to subscribe to; rank r's endpoints are the given "
        "ports plus r",
    )
    n.add_argument("--host", default="127.0.0.1", help="address the HTTP face listens on")
    n.add_argument("--port", type=int, default=NODE_PORT, help="port of the HTTP face (0: any)")
    n.add_argument(
        "--api-token-file",
        help="file holding the bearer token (16+ printable ASCII characters) that GET "
        "/state, /advertisements and /metrics require (GET /health stays open); without "
        "it those views are refused (403): they show the cache",
    )
    g = n.add_argument_group("into BGP (signing, sealing, ExaBGP)")
    g.add_argument(
        "--signing-key",
        metavar="FILE",
        help="the node's private key file (`catsproto keygen`; refused if group or others "
        "may use it), which an operator has authorised for --cs-id, the routes (the "
        "--address host route and --shard-range) and --address: every advertisement is "
        "signed for its route, and --adverts-out writes the signed value",
    )
    g.add_argument(
        "--group-key",
        action="append",
        default=[],
        metavar="FILE",
        help="group key file (`catsproto keygen --group ID`): seal each advertisement's "
        "cache section under it before signing; twice during a rotation, the active key "
        "first (the second is read and checked, it does not seal); needs --signing-key",
    )
    g.add_argument(
        "--spool",
        metavar="DIR",
        help="hand every signed route to ExaBGP: its value is written to DIR (made if "
        "missing), one file per route, for `python -m catsproto.adapters.exabgp_announce "
        "--spool DIR` to announce; its files are removed (the routes withdrawn) when the "
        "node stops; needs --signing-key",
    )
    _common(
        n,
        secret_required=True,
        block_size_default=None,
        block_size_help="tokens per block: with --engine-url the engine's (give it only to "
        f"check), else {DEFAULT_BLOCK_SIZE} unless given",
        tier_help="; with --engine-url: hbm alone, holding the engine's num_gpu_blocks, "
        "and a --tier hbm must give that block count",
    )
    n.set_defaults(func=cmd_node, command_prog=n.prog)


def _serve_checked(args: argparse.Namespace) -> int:
    if not args.no_node and args.secret is None:
        raise UsageError("--secret is required unless --no-node")
    return cmd_serve(args)
