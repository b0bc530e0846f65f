"""Steering at the ingress: a request API, the path selector, and a pyroute2 forwarder.

Strategy. An L7 gateway or a client asks the ingress where a request should go:

    POST /decide    {"cs_id": 100, "prompt_token_ids": [...]}
                    or {"cs_id": 100, "block_keys": [int | "hex", ...], "prompt_tokens": n}
                    -> {"instance", "url", "site", "path", "route", "chosen", "runner_up",
                        "explanation", "decision_ms", "install_ms", ...}
                    or {"cs_id": 100, "hash_ids": [...], "input_length": n} (Mooncake;
                    n at most ids × block size, since /generate forwards it)
    POST /generate  the same body: decide, install, then proxy it to the chosen
                    instance's /generate and answer with the instance's reply plus the
                    decision ("steering"); a "compute here, pull from there" decision
                    goes with the pull instruction (below)
    GET  /flows     the routes this forwarder installed
    GET  /rib       the instances the selector knows (address, site, freshness, load)
    GET  /stale     stale hits the instances reported for proxied requests
    GET  /health

The decision's detail (cached-block counts, estimates, runner-up, explanation) would
tell anyone who guesses a prompt whether it is cached, so it goes only to callers with
the API token (``--api-token-file``; ``Authorization: Bearer TOKEN``, others get 401);
a daemon started without one answers everybody with the choice alone (`public_answer`),
and on /generate with the instance's reply cut to what tells nothing of its cache
(`public_generate`). The same holds for the views that move with a request's cache
outcome: /stale (every total is about cache hits), /flows (a pull from another instance
installs a route towards it) and /rib (advertisement sequence, age and load move when an
instance caches a new prompt). A daemon without a token refuses /stale and /flows (403)
and shows /rib as who is there only (`public_rib`). /health counts nothing that depends
on a cache and stays open, for probes.

The instances behind the daemon keep their replies to holders of a token of their own
(`instance serve --api-token-file`): the daemon sends it on what it proxies
(``--instance-token-file``; `SteeringService.instance_token`). An instance that refuses
it (401, 403) makes /generate a 502 naming that option, counted in ``instance_refused``;
any other answer but 200 is a 502 quoting it (the caller's body was checked here, so
what the instance refuses is not the caller's fault). Every 502 counts in
``upstream_errors``.

Three small parts, each testable alone:

* `RibFeed` keeps a `selector.RIB` in step with the receiver's ``rib.json`` (what the
  ingress's ExaBGP receive process accepted and verified): re-read when the file changes,
  only changed route values are accepted again, an origin whose routes all vanished is
  withdrawn;
* `PathSelector.decide` (the pure C-PS) picks instance, path and KV source;
* `Forwarder` installs the decision in the ingress's routing table with pyroute2: a host
  route to the chosen instance via the neighbour on the chosen path (protocol
  `ROUTE_PROTO`, with the client-facing address as preferred source so replies to a
  proxied request come back to an address BGP knows). Without that route the ingress
  has no way to the instance at all, so the packets of the flow take the chosen path or
  none. An instance at the ingress's own site needs no route.

When the chosen estimate has a `kv_source`, the decision carries a pull instruction
(`kv_pull`): the source's Origin address, the transfer port (`transfer_tls.TRANSFER_PORT`,
the lab's convention), the key id that signed the source's verified advertisement (the
holder must present exactly that key) and how many leading blocks its summaries claim.
Proxy mode hands it to the computing instance as ``kv_source``, which pulls the prefix
itself over mutually authenticated TLS (docs/transfer.md); an instance at the ingress's
own site also gets a host route towards the source. Every proxied request says what the
selector claimed (``expected_cached_blocks``) and the instance answers whether it was a
stale hit; `GET /stale` sums those answers (`transfer.StaleHitLedger`).

The service takes its whole world from a `SteeringConfig` (JSON): no topology parsing
here; `catsproto.lab.flows` writes the file for the lab.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import numpy as np

from catsproto import wire
from catsproto.adapters.collector import DecisionCollector
from catsproto.adapters.http import (
    MAX_HANDLERS,
    READ_TIMEOUT_S,
    UNAUTHORISED_ERROR,
    BackgroundHTTPServer,
    BodyError,
    bearer_authorised,
    bearer_challenge,
    read_json_body,
    token_option,
    withheld,
)
from catsproto.adapters.instance import PUBLIC_REPLY_FIELDS, mooncake_block_keys
from catsproto.adapters.steering_forwarder import (
    Forwarder,
    InstalledRoute,
    SteeringError,
)
from catsproto.adapters.steering_rib import RibFeed
from catsproto.adapters.stop import StopSignal
from catsproto.adapters.strict_json import json_body
from catsproto.adapters.transfer_tls import TRANSFER_PORT
from catsproto.keys import BlockKeyer
from catsproto.selector import (
    Decision,
    Link,
    Network,
    NoInstanceError,
    PathSelector,
    Request,
    SelectorConfig,
)
from catsproto.transfer import Outcome, StaleHitLedger

DEFAULT_PORT = 8080
LISTEN_BACKLOG = 256
DEFAULT_MAX_BLOCKS = 1 << 16  # blocks one request may name (SteeringConfig.max_blocks)


@dataclass(frozen=True)
class SteeringConfig:
    """What the ingress knows: graph, sites, next hops, keying, where the RIB is."""

    ingress: str
    rib_file: str
    links: tuple[Link, ...]
    sites: dict[int, str]  # site id -> the graph node of its egress
    next_hops: dict[str, str]  # neighbour of the ingress -> its address on the shared link
    secret: bytes
    model_id: str
    block_size: int
    source: str | None = None  # preferred source of installed routes
    instance_port: int = 8100
    netns: str | None = None  # install routes in this namespace (None: the current one)
    transfer_port: int = TRANSFER_PORT  # where instances serve KV pulls (their address)
    # work sent since an instance's advertisement: "count" in full until an advertisement
    # counts it, or "drain" at the advertised rate (when this C-PS alone steers there)
    pending: str = "count"
    # the most blocks one request may name (keys, hash ids, or full blocks of token ids)
    max_blocks: int = DEFAULT_MAX_BLOCKS
    # which keying secret `secret` is (the instances' --secret-id): a request's keys are
    # matched only against instances advertising this secret, model and key scheme
    secret_id: int = 0

    def __post_init__(self) -> None:
        if type(self.max_blocks) is not int or self.max_blocks < 1:
            raise ValueError(f"max_blocks must be a positive integer, got {self.max_blocks!r}")
        if type(self.secret_id) is not int or not 0 <= self.secret_id <= 0xFFFFFFFF:
            raise ValueError(
                f"secret_id must be an integer in 0..4294967295, got {self.secret_id!r}"
            )

    @property
    def key_space(self) -> tuple[str, int, int]:
        """(model id, key scheme, secret id) of the keys this ingress computes."""
        return (self.model_id, int(wire.KeyScheme.BLAKE2B64_CHAINED), self.secret_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "ingress": self.ingress,
            "rib_file": self.rib_file,
            "links": [[k.a, k.b, k.delay_ms, k.bandwidth_mbps] for k in self.links],
            "sites": {str(s): n for s, n in self.sites.items()},
            "next_hops": dict(self.next_hops),
            "secret": self.secret.hex(),
            "model_id": self.model_id,
            "block_size": self.block_size,
            "source": self.source,
            "instance_port": self.instance_port,
            "netns": self.netns,
            "transfer_port": self.transfer_port,
            "pending": self.pending,
            "max_blocks": self.max_blocks,
            "secret_id": self.secret_id,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SteeringConfig:
        return cls(
            ingress=obj["ingress"],
            rib_file=obj["rib_file"],
            links=tuple(Link(a, b, float(d), float(bw)) for a, b, d, bw in obj["links"]),
            sites={int(s): n for s, n in obj["sites"].items()},
            next_hops=dict(obj["next_hops"]),
            secret=bytes.fromhex(obj["secret"]),
            model_id=obj["model_id"],
            block_size=int(obj["block_size"]),
            source=obj.get("source"),
            instance_port=int(obj.get("instance_port", 8100)),
            netns=obj.get("netns"),
            transfer_port=int(obj.get("transfer_port", TRANSFER_PORT)),
            pending=str(obj.get("pending", "count")),
            max_blocks=obj.get("max_blocks", DEFAULT_MAX_BLOCKS),
            secret_id=obj.get("secret_id", 0),
        )


# ---- the service --------------------------------------------------------------------


MAX_PROMPT_TOKENS = (1 << 32) - 1
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _is_uint(value: Any, limit: int) -> bool:
    """An integer in 0..limit; JSON's true/false and 1.0 are not."""
    return type(value) is int and 0 <= value <= limit


def _block_key(k: Any) -> int:
    if isinstance(k, str) and 1 <= len(k) <= 16 and set(k) <= _HEX_DIGITS:
        return int(k, 16)
    if _is_uint(k, (1 << 64) - 1):
        return k
    raise SteeringError(
        f"block_keys: {json.dumps(k)[:40]} is not a u64 (an integer, or 1-16 hex digits)"
    )


def _block_keys(raw: Any) -> np.ndarray:
    if not isinstance(raw, list):
        raise SteeringError("block_keys must be a list of u64 (ints or hex strings)")
    return np.array([_block_key(k) for k in raw], dtype=np.uint64)


@dataclass
class SteeringService:
    """Request in, decision out (and installed); thread-safe around the selector."""

    config: SteeringConfig
    forwarder: Forwarder
    clock: Callable[[], float] = time.time
    selector_config: SelectorConfig | None = None
    feed: RibFeed = field(init=False)
    selector: PathSelector = field(init=False)
    decisions: int = 0
    bad_requests: int = 0  # answered 4xx: the client's body or fields
    unauthorised: int = 0  # answered 401: a missing or wrong API token
    internal_errors: int = 0  # answered 500
    upstream_errors: int = 0  # answered 502: an instance or the routing table failed us
    instance_refused: int = 0  # of those, /generate's instance wanted another token
    # the bearer token sent on every /generate to an instance (--instance-token-file)
    instance_token: bytes | None = None
    ledger: StaleHitLedger = field(default_factory=StaleHitLedger)
    # garbage collected between decisions (the daemon's; None: CPython's own collector)
    collector: DecisionCollector | None = None

    def __post_init__(self) -> None:
        self.feed = RibFeed(self.config.rib_file)
        cfg = self.selector_config or SelectorConfig(
            site_nodes=self.config.sites,
            default_block_size=self.config.block_size,
            pending=self.config.pending,
        )
        self.selector = PathSelector(self.feed.rib, Network(self.config.links), cfg)
        self.keyer = BlockKeyer(self.config.secret, self.config.model_id, self.config.block_size)
        self._lock = threading.Lock()

    def request(self, body: dict[str, Any]) -> Request:
        """The selector's request from an API body (CS-ID and block keys or token ids).
        A prompt of more blocks than `block_limit` is refused before anything is keyed."""
        cs_id = body.get("cs_id")
        if not _is_uint(cs_id, 0xFFFFFFFF):
            raise SteeringError("cs_id must be an integer in 0..4294967295")
        bs, limit = self.config.block_size, self.block_limit
        if "prompt_token_ids" in body:
            tokens = body["prompt_token_ids"]
            if not isinstance(tokens, list) or not all(_is_uint(t, 0xFFFFFFFF) for t in tokens):
                raise SteeringError("prompt_token_ids must be a list of u32 token ids")
            if len(tokens) // bs > limit:
                raise SteeringError(
                    f"prompt_token_ids: {len(tokens)} tokens are {len(tokens) // bs} blocks, "
                    f"over the limit of {limit}"
                )
            keys = np.array(self.keyer.block_keys(tokens), dtype=np.uint64)
            length = body.get("prompt_tokens", len(tokens))
        elif "block_keys" in body:
            raw = body["block_keys"]
            if isinstance(raw, list) and len(raw) > limit:
                raise SteeringError(f"block_keys: {len(raw)} keys, over the limit of {limit}")
            keys = _block_keys(raw)
            length = body.get("prompt_tokens", len(keys) * bs)
        elif "hash_ids" in body:  # Mooncake: the instance's synthetic tokens, keyed alike
            ids = body["hash_ids"]
            if isinstance(ids, list) and len(ids) > limit:
                raise SteeringError(f"hash_ids: {len(ids)} ids, over the limit of {limit} blocks")
            if not isinstance(ids, list) or not all(_is_uint(i, (1 << 64) - 1) for i in ids):
                raise SteeringError("hash_ids must be a list of integers 0..2^64-1")
            length = body.get("input_length")
            if _is_uint(length, MAX_PROMPT_TOKENS) and length > len(ids) * bs:
                # forwarded to the instance, whose FCFS worker would prefill all of it
                raise SteeringError(
                    f"input_length {length} exceeds what the prompt's {len(ids)} blocks of "
                    f"{bs} tokens hold ({len(ids) * bs})"
                )
            keys = mooncake_block_keys(self.keyer, ids)
        else:
            raise SteeringError(
                "give prompt_token_ids, block_keys (and prompt_tokens) or hash_ids "
                "(and input_length)"
            )
        if not _is_uint(length, MAX_PROMPT_TOKENS):
            raise SteeringError(f"prompt_tokens must be an integer in 0..{MAX_PROMPT_TOKENS}")
        return Request(cs_id, keys, length, self.config.ingress, key_space=self.config.key_space)

    @property
    def block_limit(self) -> int:
        """The most blocks a request may name: the configured `max_blocks`, and never more
        than a prompt of MAX_PROMPT_TOKENS tokens has."""
        return min(self.config.max_blocks, MAX_PROMPT_TOKENS // self.config.block_size)

    def decide(self, body: dict[str, Any], *, install: bool = True) -> dict[str, Any]:
        request = self.request(body)
        started = time.perf_counter()
        with self._lock:
            now_ms = int(self.clock() * 1000)
            self.feed.refresh(now_ms)
            decision = self.selector.decide(request, now_ms)
            pull = self.pull_instruction(decision, request)
            self.decisions += 1
        decided = time.perf_counter()
        chosen = decision.chosen
        route = self.forwarder.install(str(chosen.address), chosen.path) if install else None
        if install and pull is not None and len(chosen.path) == 1:
            # the computing instance sits at the ingress, which has no default route
            path = self.selector.network.path(chosen.path[0], pull["site_node"])
            if path is not None and len(path.nodes) > 1:
                self.forwarder.install(pull["address"], path.nodes)
        done = time.perf_counter()
        return self.answer(decision, route, decided - started, done - decided, pull)

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "decisions": self.decisions,
            "bad_requests": self.bad_requests,
            "internal_errors": self.internal_errors,
            "upstream_errors": self.upstream_errors,
            "unauthorised": self.unauthorised,
            "instance_refused": self.instance_refused,
            "bad_rib_routes": self.feed.bad_routes,
        }

    def collect_garbage(self) -> int:
        """Collect garbage if due, while no decision runs (see `DecisionCollector`); the
        generation collected, -1 if none."""
        if self.collector is None:
            return -1
        with self._lock:
            return self.collector.between()

    def pull_instruction(self, decision: Decision, request: Request) -> dict[str, Any] | None:
        """Where the chosen instance pulls the prefix from (None: computed from its own
        cache): the source's address, transfer port, signing key id, and the leading
        blocks its summaries claim. Lock held."""
        src = decision.chosen.kv_source
        if src is None:
            return None
        key_id = self.feed.key_ids.get(str(src))
        table = self.feed.rib.services.get(request.cs_id)
        inst = table.by_address.get(src) if table is not None else None
        if key_id is None or inst is None:
            return None  # unsigned or gone: nobody to authenticate, recompute instead
        held = inst.lookup(request.block_keys) != 0
        claimed = int(np.argmin(held)) if not held.all() else len(held)
        return {
            "address": str(src),
            "port": self.config.transfer_port,
            "key_id": key_id.hex(),
            "expected_blocks": claimed,
            "site_node": self.selector.config.node_of(inst.site_id),
        }

    def answer(
        self,
        decision: Decision,
        route: InstalledRoute | None,
        decide_s: float,
        install_s: float,
        pull: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        c = decision.chosen
        kv_pull = {k: v for k, v in pull.items() if k != "site_node"} if pull else None
        return {
            "instance": str(c.address),
            "url": f"http://{c.address}:{self.config.instance_port}",
            "site": c.site_id,
            "path": list(c.path),
            "kv_source": str(c.kv_source) if c.kv_source else None,
            "kv_pull": kv_pull,
            "expected_cached_blocks": kv_pull["expected_blocks"] if kv_pull else c.cached_blocks,
            "estimated_ttft_ms": round(c.total_ms, 3),
            "route": route.to_json() if route else None,
            "chosen": c.terms(),
            "runner_up": decision.runner_up.terms() if decision.runner_up else None,
            "candidates": decision.candidates,
            "explanation": decision.explain(),
            "decision_ms": round(1000 * decide_s, 3),
            "install_ms": round(1000 * install_s, 3),
        }

    def generate(self, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """Decide, install, and proxy the request to the chosen instance."""
        steering = self.decide(body)
        forward = {k: v for k, v in body.items() if k in ("prompt_token_ids", "hash_ids")}
        if "input_length" in body:
            forward["input_length"] = body["input_length"]
        forward["expected_cached_blocks"] = steering["expected_cached_blocks"]
        if steering["kv_pull"] is not None:
            forward["kv_source"] = steering["kv_pull"]
        started = time.perf_counter()
        status, reply = post_json(
            steering["url"] + "/generate", forward, timeout=timeout, token=self.instance_token
        )
        ttft_ms = 1000 * (time.perf_counter() - started)
        if status in (401, 403):  # the instance's API token, not the caller's fault
            with self._lock:
                self.instance_refused += 1
            sent = "a wrong token" if self.instance_token is not None else "no token"
            raise UpstreamError(
                f"instance {steering['instance']} answered {status} to the proxied request "
                f"({sent} sent): start the steering daemon with --instance-token-file "
                "holding the instances' API token"
            )
        if status != 200:  # the body was checked here: what the instance refuses is
            # its own or the decision's fault (a pull it has no credentials for), not the
            # caller's, who is told what it said
            raise UpstreamError(f"instance {steering['instance']} answered {status}: {reply}")
        if isinstance(reply, dict) and "expected_blocks" in reply:
            outcome = _outcome(reply)
            if outcome is None:
                raise UpstreamError(
                    f"instance {steering['instance']} answered a malformed reply: "
                    "expected_blocks, cached_blocks, blocks must be counts, stale a boolean"
                )
            with self._lock:
                source = "remote" if steering["kv_pull"] else "local"
                self.ledger.record(outcome, source)
        return {"steering": steering, "reply": reply, "proxy_ttft_ms": round(ttft_ms, 3)}

    def rib_view(self) -> list[dict[str, Any]]:
        now_ms = int(self.clock() * 1000)
        with self._lock:
            self.feed.refresh(now_ms)
            out = []
            for table in self.feed.rib.services.values():
                for inst in table.live():
                    out.append(
                        {
                            "cs_id": table.cs_id,
                            "instance": str(inst.address),
                            "site": inst.site_id,
                            "sequence": list(inst.epoch_seq),
                            "age_ms": now_ms - inst.heard_ms,
                            "prefill_tps": inst.prefill_tps,
                            "backlog_tokens": inst.backlog_tokens,
                            "tiers": sorted(t.name.lower() for t in inst.tiers),
                        }
                    )
            return out


class UpstreamError(Exception):
    """The chosen instance could not be asked or gave an answer we cannot use (502)."""


def _outcome(reply: dict[str, Any]) -> Outcome | None:
    """The stale-hit outcome an instance's reply reports, or None if malformed: the
    instance's verdict decides how many of the expected blocks it really found."""
    counts = [
        reply.get(k, 0 if k == "blocks" else None)
        for k in ("expected_blocks", "cached_blocks", "blocks")
    ]
    stale = reply.get("stale")
    if not all(_is_uint(c, 1 << 32) for c in counts) or type(stale) is not bool:
        return None
    expected, cached, blocks = counts
    return Outcome(expected, min(expected, cached) if stale else expected, blocks)


# what a caller without an API token is told of a decision: where to go, nothing of how
# many blocks any instance holds for the prompt (that would answer "is this prompt
# cached?" for anyone who can guess one, which keyed block keys exist to prevent)
PUBLIC_FIELDS = ("instance", "url", "site", "path", "route", "decision_ms", "install_ms")
WITHHELD_NOTE = (
    "no API token configured: cached-block counts, estimates, runner-up and explanation "
    "are withheld (start the daemon with --api-token-file to serve them to token holders)"
)


def public_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """A decision as a caller without a token gets it: the choice only, and why not more."""
    return withheld(answer, PUBLIC_FIELDS, WITHHELD_NOTE)


# what a caller without an API token is told of the chosen instance's /generate reply:
# the instance's own allow-list (`instance.PUBLIC_REPLY_FIELDS`, which says why)
REPLY_WITHHELD_NOTE = (
    "no API token configured: the instance's cached-block and cached-token counts, "
    "stale-hit verdict, transfer and prefill/queue timings are withheld (start the daemon "
    "with --api-token-file to serve them to token holders)"
)


# what a caller without an API token is told of the RIB: which instances serve which
# CS-ID at which site (that changes only when an instance comes or goes in BGP). The rest
# moves with requests: an instance that caches a new prompt re-advertises (sequence up,
# age back to 0) and its queue (`backlog_tokens`) holds the uncached part of the prompts
# sent to it, so diffing the view around one's own request tells whether it was cached
PUBLIC_RIB_FIELDS = ("cs_id", "instance", "site")
RIB_WITHHELD_NOTE = (
    "no API token configured: advertisement sequence, age, load and tiers are withheld "
    "(start the daemon with --api-token-file to serve them to token holders)"
)
# the GET views with no part that is safe to tell a caller without a token, and why: a
# daemon started without one refuses them (403) rather than answer everybody
REFUSED_WITHOUT_TOKEN = {
    "/stale": "its totals move with each proxied request and would tell anyone whether "
    "a prompt of theirs was expected to be cached",
    "/flows": "a decision to compute at the ingress's site and pull the prefix from "
    "another instance installs a route towards that instance, which would tell anyone "
    "where a prompt of theirs is cached",
}


def refused_without_token(path: str) -> str:
    """The error a daemon without an API token answers a GET of `path` with (403)."""
    return (
        f"GET {path} is served only to API token holders and no API token is configured: "
        f"start the daemon with --api-token-file ({REFUSED_WITHOUT_TOKEN[path]})"
    )


def public_rib(view: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The RIB view as a caller without a token gets it: who is there, and why not more."""
    return [withheld(entry, PUBLIC_RIB_FIELDS, RIB_WITHHELD_NOTE) for entry in view]


def public_generate(answer: dict[str, Any]) -> dict[str, Any]:
    """A /generate answer as a caller without a token gets it: the choice, the instance's
    reply without anything that reveals cache state, and the caller's own first-token
    time (`proxy_ttft_ms`, which the caller measures anyway by timing its request)."""
    reply = answer.get("reply")
    if isinstance(reply, dict):
        reply = withheld(reply, PUBLIC_REPLY_FIELDS, REPLY_WITHHELD_NOTE)
    else:  # not a JSON object: nothing in it is known to be safe
        reply = {"withheld": REPLY_WITHHELD_NOTE}
    return {**answer, "steering": public_answer(answer["steering"]), "reply": reply}


def post_json(
    url: str, body: Any, timeout: float = 60.0, token: str | bytes | None = None
) -> tuple[int, Any]:
    """POST JSON on a fresh connection, with ``Authorization: Bearer TOKEN`` when given a
    token; (status, decoded body)."""
    return _request_json("POST", url, json.dumps(body).encode(), timeout, token)


def get_json(url: str, timeout: float = 60.0, token: str | bytes | None = None) -> tuple[int, Any]:
    """GET on a fresh connection, with ``Authorization: Bearer TOKEN`` when given a token;
    (status, decoded body)."""
    return _request_json("GET", url, None, timeout, token)


def _request_json(
    method: str, url: str, data: bytes | None, timeout: float, token: str | bytes | None
) -> tuple[int, Any]:
    parsed = http.client.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout)
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if token is not None:
        headers["Authorization"] = "Bearer " + (
            token.decode("ascii") if isinstance(token, bytes) else token
        )
    try:
        conn.request(method, parsed.path or "/", data, headers)
        resp = conn.getresponse()
        raw = resp.read()
    except http.client.HTTPException as exc:  # a broken answer: not an OSError
        raise UpstreamError(f"{url}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw or b"null")
    except ValueError:
        return resp.status, raw.decode(errors="replace")


# ---- HTTP ---------------------------------------------------------------------------


class SteeringServer(BackgroundHTTPServer):
    """The request API over HTTP (stdlib server, one thread per connection, at most
    `max_handlers` at once, each request within `read_timeout` seconds). With an
    `api_token`, POST /decide, /generate and GET /flows, /rib, /stale take only callers
    that send it as a bearer token (others get 401) and answer in full; without one, the
    POSTs answer everyone with `public_answer` (and /generate with `public_generate`),
    /rib with `public_rib`, and /flows and /stale are refused (403). GET /health is open."""

    def __init__(
        self,
        service: SteeringService,
        host: str = "127.0.0.1",
        port: int = 0,
        read_timeout: float = READ_TIMEOUT_S,
        *,
        api_token: bytes | None = None,
        max_handlers: int = MAX_HANDLERS,
    ):
        self.service = service
        super().__init__(
            _handler(service, read_timeout, api_token),
            host,
            port,
            max_handlers=max_handlers,
            request_deadline=read_timeout,
        )
        # a trace's burst of simultaneous requests must not overflow the stdlib's
        # listen backlog of 5 (Linux takes a second listen() as a new backlog)
        self.httpd.socket.listen(LISTEN_BACKLOG)


def _handler(
    service: SteeringService, read_timeout: float, api_token: bytes | None
) -> type[BaseHTTPRequestHandler]:
    expected = api_token

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # keep-alive replies must not wait for the client's delayed ACK (~40 ms)
        disable_nagle_algorithm = True
        timeout = read_timeout  # per send; the server bounds each request's reads

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
            body = json_body(obj)  # strict JSON: a non-finite figure is null
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":  # counts nothing that depends on any cache (docs)
                self._json(200, {**service.health(), "http": self.server.stats.to_json()})  # type: ignore[attr-defined]
            elif self.path not in ("/flows", "/rib", "/stale"):
                self._json(404, {"error": f"no {self.path}"})
            elif expected is not None and not self._authorised():
                self._refuse_unauthorised()
            elif self.path == "/rib":
                view = service.rib_view()
                self._json(200, view if expected is not None else public_rib(view))
            elif expected is None:
                self._json(403, {"error": refused_without_token(self.path)})
            elif self.path == "/flows":
                self._json(200, [r.to_json() for r in service.forwarder.installed.values()])
            else:
                with service._lock:
                    self._json(200, service.ledger.to_json())

        def _authorised(self) -> bool:
            """True if the caller sent the configured token (compared in constant time)."""
            return bearer_authorised(self.headers, expected)

        def _refuse_unauthorised(self) -> None:
            """401 to a caller without the configured token, counted; any body is unread."""
            service.unauthorised += 1
            self.close_connection = True
            self._json(401, {"error": UNAUTHORISED_ERROR}, bearer_challenge("steering"))

        def do_POST(self) -> None:
            if self.path not in ("/decide", "/generate"):
                self._json(404, {"error": f"no {self.path}"})
                return
            full = expected is not None and self._authorised()
            if expected is not None and not full:
                self._refuse_unauthorised()
                return
            try:
                body = read_json_body(self)
                if not isinstance(body, dict):
                    raise SteeringError("the body must be a JSON object")
                if self.path == "/decide":
                    answer = service.decide(body)
                    self._json(200, answer if full else public_answer(answer))
                else:
                    answer = service.generate(body)
                    if not full:
                        answer = public_generate(answer)
                    self._json(200, answer)
            except BodyError as exc:
                service.bad_requests += 1
                self.close_connection = True  # what follows on the stream is unknown
                self._json(exc.status, {"error": str(exc)})
            except SteeringError as exc:
                service.bad_requests += 1
                self._json(400, {"error": str(exc)})
            except NoInstanceError as exc:
                self._json(503, {"error": str(exc)})
            except (OSError, UpstreamError) as exc:
                service.upstream_errors += 1
                self._json(502, {"error": f"{type(exc).__name__}: {exc}"})
            except Exception as exc:  # a bug of ours: answer, count, log, serve on
                service.internal_errors += 1
                print(f"steering: {self.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
                self._json(500, {"error": f"internal error: {type(exc).__name__}"})
            finally:  # answered: now is when a collection delays no decision
                service.collect_garbage()

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="steering API at the ingress (C-PS + forwarder)")
    p.add_argument("--config", required=True, help="SteeringConfig as JSON")
    p.add_argument("--listen", action="append", default=[], help="ADDRESS:PORT (repeatable)")
    p.add_argument("--ready", help="file written with the API URLs once listening")
    p.add_argument(
        "--api-token-file",
        help="file holding the bearer token that POST /decide, /generate and GET /flows, "
        "/rib, /stale require (GET /health stays open); without it the POSTs answer anyone "
        "but only with the chosen instance (no cached-block counts), /rib with instance, "
        "CS-ID and site only, and /flows and /stale are refused (403)",
    )
    p.add_argument(
        "--instance-token-file",
        help="file holding the bearer token the instances' APIs require (their "
        "--api-token-file), sent on every request POST /generate proxies to them",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_HANDLERS,
        help=f"connections served at once per listener; more get 503 (default {MAX_HANDLERS})",
    )
    args = p.parse_args(argv)
    if args.max_connections < 1:
        p.error(f"--max-connections must be at least 1, got {args.max_connections}")
    try:
        token = token_option(args.api_token_file, "--api-token-file")
        instance_token = token_option(args.instance_token_file, "--instance-token-file")
    except ValueError as exc:
        p.error(str(exc))
    try:
        config = SteeringConfig.from_json(json.loads(Path(args.config).read_text()))
        forwarder = Forwarder(config.next_hops, source=config.source, netns=config.netns)
        collector = DecisionCollector()
        service = SteeringService(
            config, forwarder, collector=collector, instance_token=instance_token
        )
    except (OSError, KeyError, TypeError, ValueError) as exc:
        p.error(f"--config {args.config}: {type(exc).__name__}: {exc}")
    forwarder.kernel_routes()  # open netlink once now, not on the first decision
    service.feed.refresh(int(service.clock() * 1000))  # the RIB as it stands, then frozen
    collector.start()
    servers = []
    for listen in args.listen or [f"127.0.0.1:{DEFAULT_PORT}"]:
        host, _, port = listen.rpartition(":")
        server = SteeringServer(
            service, host, int(port), api_token=token, max_handlers=args.max_connections
        )
        servers.append(server.start())
    stop = StopSignal()  # before the ready file: a stop right after it shuts down cleanly
    if args.ready:
        tmp = Path(args.ready + ".tmp")
        tmp.write_text(json.dumps([s.url for s in servers]))
        os.replace(tmp, args.ready)
    try:
        while not stop.wait(1.0):  # idle or not, garbage is still collected
            service.collect_garbage()
    finally:
        for s in servers:
            s.close()
        forwarder.remove_all()
        collector.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
