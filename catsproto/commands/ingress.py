"""`catsproto ingress`: the OpenAI-compatible front door at the C-PS.

    catsproto ingress serve --config steering.json \\
        --model catsproto-tiny=100:lab/engine/tiny-llama:8000 \\
        --listen 10.100.1.1:8000 --api-token-file ingress.token

Each request (POST /v1/completions, /v1/chat/completions, streaming or not) is tokenized
with the model directory's tokenizer, its blocks keyed in the config's key space (its
secret, model id, block size: the engines' C-SMAs' own), steered by the path selector
over the receiver's rib.json, and proxied unchanged to the chosen engine
(docs/ingress.md). Runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from catsproto.commands import UsageError

DEFAULT_LISTEN = "127.0.0.1:8000"


def cmd_serve(args: argparse.Namespace) -> int:
    from catsproto.adapters.http import token_option
    from catsproto.adapters.ingress import IngressService, ModelSpec, load_models
    from catsproto.adapters.ingress_http import IngressServer
    from catsproto.adapters.openai_wire import EnginePool
    from catsproto.adapters.steering import SteeringConfig
    from catsproto.adapters.stop import StopSignal

    try:
        token = token_option(args.api_token_file, "--api-token-file")
        instance_token = token_option(args.instance_token_file, "--instance-token-file")
        specs = [ModelSpec.parse(m) for m in args.model]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not specs:
        raise UsageError("give at least one --model NAME=CS_ID:MODEL_DIR[:ENGINE_PORT]")
    if args.max_connections < 1:
        raise UsageError(f"--max-connections must be at least 1, got {args.max_connections}")

    def config_of(path: str, option: str) -> SteeringConfig:
        try:
            return SteeringConfig.from_json(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise UsageError(f"{option} {path}: cannot read it: {exc.strerror or exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"{option} {path}: {type(exc).__name__}: {exc}") from None

    config = config_of(args.config, "--config")
    own = {}
    for item in args.model_config:
        name, eq, path = item.partition("=")
        if not (eq and name and path):
            raise UsageError(f"--model-config {item!r} is not NAME=STEERING_CONFIG.json")
        if name not in {s.name for s in specs}:
            raise UsageError(f"--model-config {item!r}: no --model named {name!r}")
        own[name] = config_of(path, "--model-config")
    try:
        models = load_models(
            specs,
            config,
            own,
            install_routes=not args.no_install_routes,
            grace_ms=args.grace_ms,
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model: {exc}") from None
    service = IngressService(
        models,
        pool=EnginePool(connect_timeout=args.connect_timeout, read_timeout=args.read_timeout),
        instance_token=instance_token,
    )
    for model in models.values():  # the RIB as it stands, before the first request
        model.service.feed.refresh(int(service.clock() * 1000))
    # the selector's compiled probe pass loads on first use (numba: ~0.7 s); here, not in
    # the first request's decision
    from catsproto.selector import fleet

    if fleet.PASS.get() is None:
        print(
            json.dumps(
                {
                    "warning": "the selector's compiled pass cannot be loaded here "
                    f"({fleet.PASS.why}); decisions ask each filter in numpy: "
                    "the same choices, slower"
                }
            ),
            file=sys.stderr,
            flush=True,
        )

    servers = []
    stop = StopSignal()  # before the ready file: a stop right after it shuts down cleanly
    try:
        for listen in args.listen or [DEFAULT_LISTEN]:
            host, _, port = listen.rpartition(":")
            if not host or not port.isdigit():
                raise UsageError(f"--listen {listen!r} is not ADDRESS:PORT")
            servers.append(
                IngressServer(
                    service,
                    host.strip("[]"),
                    int(port),
                    api_token=token,
                    install_routes=not args.no_install_routes,
                    max_body=args.max_body,
                    max_handlers=args.max_connections,
                ).start()
            )
        urls = [s.url for s in servers]
        if args.ready:
            tmp = Path(args.ready + ".tmp")
            tmp.write_text(json.dumps(urls))
            os.replace(tmp, args.ready)
        print(json.dumps({"ingress": urls, "models": list(models)}), flush=True)
        stop.wait()
    finally:
        for s in servers:
            s.close()
        for model in models.values():
            model.service.forwarder.remove_all()
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ingress", help="the OpenAI-compatible ingress (C-PS front door)", description=__doc__
    )
    sub = p.add_subparsers(dest="ingress_command", required=True, metavar="ACTION")
    s = sub.add_parser(
        "serve",
        help="steer and proxy OpenAI requests to vLLM engines",
        description="Serve POST /v1/completions and /v1/chat/completions (streaming or not), "
        "GET /v1/models, /metrics and /health; steer each request with the path selector "
        "over the receiver's rib.json and proxy it unchanged to the chosen engine. Prints "
        "its URLs as JSON on stdout; runs until SIGINT or SIGTERM.",
    )
    s.add_argument(
        "--config",
        required=True,
        help="SteeringConfig JSON (the lab writes it): graph, sites, rib.json, and the key "
        "space (secret, secret_id, model_id, block_size) the engines' C-SMAs advertise in",
    )
    s.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=CS_ID:MODEL_DIR[:ENGINE_PORT]",
        help="a served model (repeatable): the name clients send, the CS-ID its engines "
        "advertise, its model directory (tokenizer.json, tokenizer_config.json) and its "
        "engines' HTTP port (default: the config's instance_port)",
    )
    s.add_argument(
        "--model-config",
        action="append",
        default=[],
        metavar="NAME=STEERING_CONFIG.json",
        help="a model's own SteeringConfig when its key space differs from --config's "
        "(repeatable; the model then has a selector of its own)",
    )
    s.add_argument("--listen", action="append", default=[], help="ADDRESS:PORT (repeatable)")
    s.add_argument(
        "--api-token-file",
        help="file holding the bearer token (the OpenAI client's api_key) every request but "
        "GET /health needs; with it the decision headers are given in full. Without it "
        "anyone is served, told nothing of where a prompt went or what was cached, and "
        "/metrics is refused",
    )
    s.add_argument(
        "--instance-token-file",
        help="file holding the engines' API key (vLLM --api-key), sent on what is proxied",
    )
    s.add_argument("--ready", help="file written with the URLs once listening")
    s.add_argument(
        "--no-install-routes",
        action="store_true",
        help="decide without installing host routes (engines on the ingress's own host)",
    )
    s.add_argument(
        "--grace-ms",
        type=int,
        default=5_000,
        help="how long a ground-truth miss may stay unexplained before a claim that "
        "survives it is counted a false positive",
    )
    s.add_argument(
        "--max-body", type=int, default=4 << 20, help="largest request body in bytes (413)"
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="client connections served at once; one that has not sent a complete request "
        "head is evicted (oldest first, per source) for a newcomer; 503 only when every "
        "one is serving a request",
    )
    s.add_argument(
        "--connect-timeout", type=float, default=3.0, help="seconds to connect to an engine"
    )
    s.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds an engine may stay silent during an answer",
    )
    s.set_defaults(func=cmd_serve, command_prog="catsproto ingress serve")
