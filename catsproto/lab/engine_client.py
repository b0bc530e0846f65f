"""A user of the lab's real engines: the official `openai` client, pointed at the ingress.

Strategy. This is what a vLLM user runs unchanged, with only the base URL and the API key
changed to the ingress's: `ask` sends completions (streaming, so the time to the first
token is what the client sees), and reads from each answer the ingress's decision
headers (``x-catsproto-*``) and the engine's own count of cached prompt tokens (the
usage of the stream's last chunk, asked for with ``stream_options.include_usage``).
`replay` sends a timed workload from several threads, as the benchmark and the demo do.
It runs in the client host's namespace (`catsproto.lab.flows.run_client` style):

    python -m catsproto.lab.engine_client ask --url URL --token-file F --prompt-json P
    python -m catsproto.lab.engine_client replay --url URL --token-file F --workload W

A peer router in the benchmark (`catsproto.lab.peers`) takes no token: without
``--token-file`` the client sends a placeholder key, as an `openai` user of an open
router does.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from catsproto.adapters.file_modes import read_secret_file

DECISION_HEADERS = (
    "x-catsproto-instance",
    "x-catsproto-site",
    "x-catsproto-expected-cached-blocks",
    "x-catsproto-estimated-ttft-ms",
    "x-catsproto-decision-ms",
    "x-catsproto-evicted-blocks",
    "x-catsproto-evict-ms",
)


NO_TOKEN = "no-token"  # the openai client wants some api_key; an open router ignores it


def _client(url: str, token: str, timeout: float = 120.0) -> Any:
    import openai

    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=token, timeout=timeout)


def complete(
    client: Any,
    model: str,
    prompt: str | list[int],
    *,
    max_tokens: int = 1,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One streamed completion: time to first token, the decision headers, the engine's
    cached prompt tokens, the text."""
    started = time.perf_counter()
    raw = client.completions.with_raw_response.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers or {},
    )
    stream = raw.parse()
    ttft_ms: float | None = None
    text: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.choices and ttft_ms is None:
            ttft_ms = 1000 * (time.perf_counter() - started)
        for choice in chunk.choices:
            text.append(choice.text or "")
        if chunk.usage is not None:
            usage = chunk.usage
    total_ms = 1000 * (time.perf_counter() - started)
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft_ms": round(ttft_ms if ttft_ms is not None else total_ms, 3),
        "total_ms": round(total_ms, 3),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
        "decision": {h: raw.headers.get(h) for h in DECISION_HEADERS if raw.headers.get(h)},
        "text": "".join(text),
    }


def ask(
    url: str,
    token: str,
    model: str,
    prompts: list[str | list[int]],
    *,
    max_tokens: int = 1,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The prompts one after the other."""
    client = _client(url, token)
    return [complete(client, model, p, max_tokens=max_tokens, headers=headers) for p in prompts]


def replay(
    url: str,
    token: str,
    model: str,
    workload: list[dict[str, Any]],
    *,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each item ``{"t_s", "prompt", "max_tokens"}`` sent at its time from its own thread;
    the results in the workload's order (an item that failed carries ``error``)."""
    client = _client(url, token)
    results: list[dict[str, Any]] = [{} for _ in workload]
    started = time.monotonic()

    def run(i: int, item: dict[str, Any]) -> None:
        try:
            results[i] = complete(
                client,
                model,
                item["prompt"],
                max_tokens=int(item.get("max_tokens", 1)),
                headers=headers,
            )
        except Exception as exc:  # one failed request is a result, not the end of the run
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}
        results[i]["sent_s"] = round(item["t_s"], 3)

    threads = []
    for i, item in enumerate(workload):
        delay = item["t_s"] - (time.monotonic() - started)
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=run, args=(i, item), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engine_client", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["ask", "replay"])
    p.add_argument("--url", required=True, help="the ingress, http://ADDRESS:PORT")
    p.add_argument(
        "--token-file", help="the ingress's bearer token (none: a router that takes no token)"
    )
    p.add_argument("--model", default="catsproto-tiny")
    p.add_argument("--prompt-json", help="ask: a JSON list of prompts (strings or token ids)")
    p.add_argument("--workload", help="replay: a JSON list of {t_s, prompt, max_tokens}")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--policy", help="x-catsproto-policy header (e.g. nearest: network-only CATS)")
    args = p.parse_args(argv)
    token = (
        read_secret_file(args.token_file, "API token file").decode().strip()
        if args.token_file
        else NO_TOKEN
    )
    headers = {"x-catsproto-policy": args.policy} if args.policy else None
    if args.mode == "ask":
        if not args.prompt_json:
            p.error("ask needs --prompt-json")
        prompts = json.loads(Path(args.prompt_json).read_text())
        out = ask(args.url, token, args.model, prompts, max_tokens=args.max_tokens, headers=headers)
    else:
        if not args.workload:
            p.error("replay needs --workload")
        workload = json.loads(Path(args.workload).read_text())
        out = replay(args.url, token, args.model, workload, headers=headers)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
