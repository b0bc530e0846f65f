"""`catsproto select`: explain one path-selector decision against a running lab.

catsproto select --lab c1234 --site 3            # site 3's demo conversation from the ingress
catsproto select --lab c1234 --tokens prompt.json --install
catsproto select --lab c1234 --block-keys 1f2e...,77aa... --prompt-tokens 1024 --json

The selector is fed exactly as the lab's steering API is (`catsproto.adapters.steering`:
the ingress's verified rib.json, the topology's graph); the route the forwarder would
install is shown, and installed in the ingress's namespace with --install.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from catsproto.commands import UsageError


def _body(args: argparse.Namespace) -> dict[str, Any]:
    from catsproto.lab.instances import demo_prompt

    body: dict[str, Any] = {"cs_id": args.cs_id}
    if args.site is not None:
        body["prompt_token_ids"] = demo_prompt(args.site)
    elif args.tokens:
        try:
            tokens = json.loads(Path(args.tokens).read_text())
        except OSError as exc:
            raise UsageError(f"--tokens {args.tokens}: cannot read it: {exc.strerror}") from None
        except ValueError as exc:  # not JSON, or not UTF-8
            raise UsageError(
                f"--tokens {args.tokens}: not a JSON list of token ids: {exc}"
            ) from None
        body["prompt_token_ids"] = tokens
    elif args.block_keys:
        body["block_keys"] = [k.strip() for k in args.block_keys.split(",") if k.strip()]
    else:
        raise UsageError("give --site N, --tokens FILE or --block-keys K1,K2,...")
    if args.prompt_tokens is not None:
        body["prompt_tokens"] = args.prompt_tokens
    return body


def _find_lab(args: argparse.Namespace) -> Path:
    """The run directory of --lab, looked for where `lab status` looks (both default
    places unless --root)."""
    from catsproto.commands.lab import _running

    labs, where = _running(argparse.Namespace(root=args.root))
    for run_dir in labs:
        if run_dir.name == args.lab:
            return run_dir
    raise UsageError(f"no running lab {args.lab} under {where} (see `catsproto lab status`)")


def _sites(topology: Any) -> list[int]:
    return sorted({spec.site_id for node in topology.nodes.values() for spec in node.instances})


def cmd_select(args: argparse.Namespace) -> int:
    from catsproto.adapters.steering import Forwarder, SteeringError, SteeringService
    from catsproto.lab import flows, runner
    from catsproto.lab.runner import LabError
    from catsproto.selector import NoInstanceError

    lab = runner.attach(_find_lab(args))
    sites = _sites(lab.topology)
    if args.site is not None and args.site not in sites:
        raise UsageError(
            f"--site {args.site}: lab {lab.tag} ({lab.topology.name}) has sites "
            f"{', '.join(map(str, sites))}"
        )
    loopback = flows.is_loopback(lab)
    if args.install and loopback:
        raise UsageError(
            f"--install: lab {lab.tag} runs on loopback, with no forwarding plane to install "
            "a route in (lab up without --embedded, as root, has one)"
        )
    try:
        ingress = flows.ingress_node(lab.topology)
    except LabError as exc:
        raise UsageError(str(exc)) from None
    ns = lab.handle.ns(ingress) if lab.handle.namespaced else None
    config = flows.steering_config(lab, netns_name=ns)
    forwarder = Forwarder(
        config.next_hops, source=config.source, netns=ns, dry_run=not args.install
    )
    body = _body(args)
    # A command started afresh pays, on its first decision, for loading the selector's
    # compiled kernels (numba) and reading rib.json; the steering API pays both once,
    # when it starts. Both are done and timed here before the decision is, on a service
    # of their own (so the decision shown counts no load from the warm-up).
    started = time.perf_counter()
    warm_up = SteeringService(config, Forwarder(config.next_hops, dry_run=True))
    with contextlib.suppress(SteeringError, NoInstanceError):  # the real one says what
        warm_up.decide(body, install=False)
    warm_ms = 1000 * (time.perf_counter() - started)
    service = SteeringService(config, forwarder)
    started = time.perf_counter()
    service.feed.refresh(int(time.time() * 1000))
    load_ms = 1000 * (time.perf_counter() - started)
    try:
        answer = service.decide(body)
        length = service.request(body).prompt_tokens
        blind = service.decide(
            {"cs_id": args.cs_id, "block_keys": [], "prompt_tokens": length}, install=False
        )
    except SteeringError as exc:
        raise UsageError(str(exc)) from None
    except NoInstanceError as exc:
        print(f"no decision: {exc}")
        return 1
    if args.json:
        start_up = {
            "warm_up_ms": round(warm_ms, 3),
            "rib_load_ms": round(load_ms, 3),
            "rib_routes": service.feed.routes,
        }
        doc = {"decision": answer, "network_only": blind, "start_up": start_up}
        print(json.dumps(doc, indent=1))
        return 0
    route = answer["route"]
    verb = "installed" if args.install else "would install"
    print(f"lab {lab.tag}: path selector at {ingress}, CS-ID {args.cs_id}")
    if loopback:
        print(
            "loopback lab: every speaker peers with the receiver directly (no transit "
            "routers, no link delay), and that is the selector's graph"
        )
    print(f"-> {answer['instance']} (site {answer['site']}), path {' > '.join(answer['path'])}")
    print(answer["explanation"])
    print(f"forwarder ({verb}): {route['route']}")
    print(
        f"network-only CATS (no cache knowledge) would pick {blind['instance']} "
        f"(site {blind['site']}), estimated TTFT {blind['estimated_ttft_ms']:.1f} ms "
        f"vs {answer['estimated_ttft_ms']:.1f} ms"
    )
    print(
        f"decision {answer['decision_ms']:.2f} ms over {answer['candidates']} instances "
        f"(the selector alone, warm); before it this command spent {warm_ms:.0f} ms "
        f"warming up (loading the selector's compiled kernels, a first decision) and "
        f"{load_ms:.1f} ms reading rib.json ({service.feed.routes} routes): start-up "
        "costs the steering API pays once"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "select",
        help="explain one path-selector decision against a running lab",
        description="Feed the path selector from a running lab's ingress RIB and explain "
        "where one request goes, every term of the estimate, and the route installed.",
    )
    p.add_argument("--lab", required=True, metavar="TAG", help="the lab's tag (lab status)")
    p.add_argument(
        "--root",
        help="where run directories live (default: both $CATSPROTO_LAB_ROOT, else "
        "/run/catsproto, and /tmp/catsproto-lab, where a loopback lab started without "
        "--root is; the places `lab status` looks)",
    )
    p.add_argument(
        "--cs-id", type=int, default=100, help="the service (CS-ID) the request asks for"
    )
    p.add_argument(
        "--site",
        type=int,
        metavar="N",
        help="the demo conversation cached at site N (one of the lab's sites)",
    )
    p.add_argument("--tokens", help="JSON file with a list of prompt token ids")
    p.add_argument("--block-keys", help="comma-separated block keys (hex)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length (default: from the input)")
    p.add_argument("--install", action="store_true", help="install the route in the ingress")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_select)
