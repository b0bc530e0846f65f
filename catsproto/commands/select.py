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
import json
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
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read token ids from {args.tokens}: {exc}") from None
        body["prompt_token_ids"] = tokens
    elif args.block_keys:
        body["block_keys"] = [k.strip() for k in args.block_keys.split(",") if k.strip()]
    else:
        raise UsageError("give --site N, --tokens FILE or --block-keys K1,K2,...")
    if args.prompt_tokens is not None:
        body["prompt_tokens"] = args.prompt_tokens
    return body


def cmd_select(args: argparse.Namespace) -> int:
    from catsproto.adapters.steering import Forwarder, SteeringError, SteeringService
    from catsproto.lab import flows, runner
    from catsproto.lab.runner import DEFAULT_ROOT, LabError
    from catsproto.selector import NoInstanceError

    root = Path(args.root) if args.root else DEFAULT_ROOT
    run_dir = root / args.lab
    if not (run_dir / "state.json").exists():
        raise UsageError(f"no running lab {args.lab} under {root} (see `catsproto lab status`)")
    lab = runner.attach(run_dir)
    try:
        ingress = flows.ingress_node(lab.topology)
    except LabError as exc:
        raise UsageError(str(exc)) from None
    ns = lab.handle.ns(ingress) if lab.handle.namespaced else None
    config = flows.steering_config(lab, netns_name=ns)
    forwarder = Forwarder(
        config.next_hops, source=config.source, netns=ns, dry_run=not args.install
    )
    service = SteeringService(config, forwarder)
    body = _body(args)
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
        print(json.dumps({"decision": answer, "network_only": blind}, indent=1))
        return 0
    route = answer["route"]
    verb = "installed" if args.install else "would install"
    print(f"lab {lab.tag}: path selector at {ingress}, CS-ID {args.cs_id}")
    print(f"-> {answer['instance']} (site {answer['site']}), path {' > '.join(answer['path'])}")
    print(answer["explanation"])
    print(f"forwarder ({verb}): {route['route']}")
    print(
        f"network-only CATS (no cache knowledge) would pick {blind['instance']} "
        f"(site {blind['site']}), estimated TTFT {blind['estimated_ttft_ms']:.1f} ms "
        f"vs {answer['estimated_ttft_ms']:.1f} ms"
    )
    print(f"decision {answer['decision_ms']:.2f} ms over {answer['candidates']} instances")
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
        help="where run directories live (default: $CATSPROTO_LAB_ROOT, else /run/catsproto)",
    )
    p.add_argument(
        "--cs-id", type=int, default=100, help="the service (CS-ID) the request asks for"
    )
    p.add_argument("--site", type=int, metavar="N", help="the demo conversation cached at site N")
    p.add_argument("--tokens", help="JSON file with a list of prompt token ids")
    p.add_argument("--block-keys", help="comma-separated block keys (hex)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length (default: from the input)")
    p.add_argument("--install", action="store_true", help="install the route in the ingress")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_select)
