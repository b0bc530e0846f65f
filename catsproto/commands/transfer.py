"""`catsproto transfer`: serve KV blocks and pull a prefix over TLS 1.3 (mutual auth).

    catsproto transfer serve --key node.json --trust trust.json --listen 10.0.12.1:7470 \\
        --synthetic 7:64:1048576 [--rate 125000000] [--epoch N]
        holds 64 synthetic blocks of 1 MiB (the prefix of seed 7) and serves pulls until
        SIGTERM; prints {"listening": "host:port"} on stdout when ready
    catsproto transfer pull --key puller.json --trust trust.json --from 10.0.12.1:7470 \\
        --synthetic 7:64[:1048576] [--holder KEY_ID] [--rate BYTES/S]
        pulls that prefix and prints one JSON line: blocks, bytes, seconds, throughput,
        the SHA-256 over the payloads (compare it across runs), any refusal; with BYTES,
        a block announced larger than that is refused before its payload is read

Key and trust files are those of `catsproto keygen` / `catsproto trust`; `serve` reads
its trust file again when it changes (a key revoked there is refused from the next
connection on; a file that stops loading leaves the last good one). `--plaintext`
(both sides) runs the same frames over bare TCP: a benchmark baseline, never a mode to
deploy. The holder's deadlines and caps against peers that hold connections without
pulling (`transfer_tls.ServerOptions`) and the puller's handshake deadline are options
too, checked before anything listens or connects.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from typing import Any

from catsproto.adapters.file_modes import FileModeError, read_secret_file, read_trust_file
from catsproto.adapters.stop import StopSignal
from catsproto.commands import UsageError

# the defaults of `transfer_tls.ServerOptions` and `transfer_tls.pull` (that module is
# imported only when a transfer runs: it is slow to import for every other command);
# tests/test_transfer_cli.py checks that they agree
IO_TIMEOUT_S = 30.0
HANDSHAKE_TIMEOUT_S = 5.0
OFFER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 64
MIN_RATE_BPS = 125_000


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"address {text!r} is not HOST:PORT")
    if not 0 <= int(port) <= 65535:
        raise UsageError(f"address {text!r}: port {int(port)} is not 0..65535")
    return host.strip("[]") or "0.0.0.0", int(port)


def _rate(args: argparse.Namespace) -> int:
    if not 0 <= args.rate < 1 << 64:
        raise UsageError(f"--rate {args.rate} is not 0 (none)..2^64-1 bytes/s")
    return int(args.rate)


def _seconds(option: str, value: float) -> float:
    if not 0 < value < math.inf:  # also refuses NaN
        raise UsageError(f"{option} {value} is not a positive, finite number of seconds")
    return value


def _at_least_one(option: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{option} {value} is not >= 1")
    return value


def server_options(args: argparse.Namespace) -> Any:
    """The holder's `ServerOptions` from `transfer serve`'s arguments; a bad value (or
    two that do not fit together) is a UsageError naming the options."""
    from catsproto.adapters.transfer_tls import ServerOptions

    timeout = _seconds("--timeout", args.timeout)
    handshake = _seconds("--handshake-timeout", args.handshake_timeout)
    request = handshake
    if args.request_timeout is not None:
        request = _seconds("--request-timeout", args.request_timeout)
    offer = min(OFFER_TIMEOUT_S, handshake)
    if args.offer_timeout is not None:
        offer = _seconds("--offer-timeout", args.offer_timeout)
        if offer > handshake:
            raise UsageError(
                f"--offer-timeout {offer} is more than --handshake-timeout {handshake}"
            )
    if not 0 <= args.min_rate < 2**64:  # also refuses NaN
        raise UsageError(f"--min-rate {args.min_rate} is not 0 (no floor)..2^64-1 bytes/s")
    connections = _at_least_one("--max-connections", args.max_connections)
    if args.max_handshakes is None:
        handshakes, named = max(1, connections // 2), "(half of --max-connections)"
    else:
        handshakes = _at_least_one("--max-handshakes", args.max_handshakes)
        named = "--max-handshakes"
        if handshakes > connections:
            raise UsageError(
                f"--max-handshakes {handshakes} is more than --max-connections {connections}"
            )
    per_address = max(1, handshakes // 4)
    if args.max_handshakes_per_address is not None:
        per_address = _at_least_one("--max-handshakes-per-address", args.max_handshakes_per_address)
        if per_address > handshakes:
            raise UsageError(
                f"--max-handshakes-per-address {per_address} is more than the "
                f"{handshakes} unauthenticated connections allowed in all {named}"
            )
    try:
        return ServerOptions(
            epoch=args.epoch,
            rate_bps=_rate(args),
            chunk=args.chunk,
            plaintext=args.plaintext,
            timeout=timeout,
            handshake_timeout=handshake,
            offer_timeout=offer,
            request_timeout=request,
            max_connections=connections,
            max_handshakes=handshakes,
            max_handshakes_per_source=per_address,
            min_rate_bps=args.min_rate,
        )
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None  # epoch, chunk: the message starts with its name


def _synthetic(text: str, parts: int, optional_bytes: bool = False) -> list[int]:
    """SEED:COUNT:BYTES (`parts` 3) or SEED:COUNT (2; with `optional_bytes`, or
    SEED:COUNT:BYTES)."""
    try:
        values = [int(x) for x in text.split(":")]
    except ValueError:
        raise UsageError(f"--synthetic {text!r}: integers separated by ':'") from None
    shape = "SEED:COUNT:BYTES" if parts == 3 else "SEED:COUNT"
    allowed = (parts, 3) if optional_bytes else (parts,)
    if optional_bytes:
        shape = "SEED:COUNT[:BYTES]"
    if len(values) not in allowed or any(v < 0 for v in values):
        raise UsageError(f"--synthetic {text!r} is not {shape}")
    if values[1] < 1:
        raise UsageError(f"--synthetic {text!r}: COUNT {values[1]} is not >= 1")
    if len(values) == 3 and values[2] < 1:
        raise UsageError(f"--synthetic {text!r}: BYTES {values[2]} is not >= 1")
    return values


def _json_file(option: str, path: str, what: str, *, secret: bool) -> Any:
    """The JSON of the `what` file an option names, refused if its mode lets others read
    a secret or write a trust file (`file_modes`); an error names the option and the path
    once."""
    try:
        raw = read_secret_file(path, what) if secret else read_trust_file(path, what)
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not UTF-8 text") from None
    except FileModeError as exc:
        raise UsageError(f"{option}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{option} {path}: not JSON: {exc}") from None


def _credentials(args: argparse.Namespace) -> tuple[Any, Any]:
    from catsproto.adapters.transfer_tls import PeerPolicy, TransferIdentity
    from catsproto.security import KeyFormatError, SigningKey, TrustFileError, TrustStore

    if args.plaintext:
        return None, None
    if not args.key or not args.trust:
        raise UsageError("--key and --trust are required (or --plaintext for a baseline)")
    try:
        key = SigningKey.from_json(_json_file("--key", args.key, "key file", secret=True))
        trust = TrustStore.from_json(_json_file("--trust", args.trust, "trust file", secret=False))
    except (KeyFormatError, TrustFileError) as exc:
        raise UsageError(str(exc)) from None
    expected = None
    if getattr(args, "holder", None):
        try:
            expected = bytes.fromhex(args.holder)
        except ValueError:
            raise UsageError("--holder is a key id in hex") from None
    return TransferIdentity(key), PeerPolicy(trust, expected_key_id=expected)


def _reloading(policy: Any, path: str) -> None:
    """Make `policy` read its trust file again whenever the file changes (checked at
    every connection), starting from the file as it is now."""
    from catsproto.adapters.transfer_tls import TrustFile

    trust = TrustFile(path, read=lambda p: read_trust_file(p, "trust file"))  # its mode too
    if trust.current() is None:  # it loaded a moment ago, in _credentials
        raise UsageError(f"--trust {path}: {trust.error}")
    policy.trust = trust


def cmd_serve(args: argparse.Namespace) -> int:
    from catsproto.adapters.transfer_tls import TransferServer
    from catsproto.transfer import synthetic_keys, synthetic_store

    seed, count, size = _synthetic(args.synthetic, 3)
    host, port = _address(args.listen)
    options = server_options(args)
    store = synthetic_store(synthetic_keys(seed, count), size)
    identity, policy = _credentials(args)
    if policy is not None:
        _reloading(policy, args.trust)
    try:
        server = TransferServer(identity, policy, store.get, host, port, options).start()
    except OSError as exc:
        if identity is not None:
            identity.close()
        raise UsageError(f"--listen {args.listen}: cannot listen: {exc.strerror or exc}") from None
    stop = StopSignal()
    print(json.dumps({"listening": f"{server.address[0]}:{server.address[1]}"}), flush=True)
    try:
        stop.wait()
    finally:
        server.close()
        if identity is not None:
            identity.close()
        for s in server.served:
            print(json.dumps(s.__dict__), file=sys.stderr)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from catsproto.adapters.transfer_tls import pull
    from catsproto.transfer import DEFAULT_MAX_BLOCK, synthetic_keys

    seed, count, *expected = _synthetic(args.synthetic, 2, optional_bytes=True)
    source = _address(args.source)
    rate = _rate(args)
    timeout = _seconds("--timeout", args.timeout)
    handshake_timeout = _seconds("--handshake-timeout", args.handshake_timeout)
    if not 0 <= args.transfer_id < 1 << 64:
        raise UsageError(f"--transfer-id {args.transfer_id} is not 0..2^64-1")
    keys = synthetic_keys(seed, count)
    identity, policy = _credentials(args)
    cpu = time.process_time()
    try:
        r = pull(
            source,
            identity,
            policy,
            keys,
            transfer_id=args.transfer_id,
            rate_bps=rate,
            timeout=timeout,
            handshake_timeout=handshake_timeout,
            max_block_bytes=expected[0] if expected else DEFAULT_MAX_BLOCK,
        )
    finally:
        if identity is not None:
            identity.close()
    digest = hashlib.sha256()
    blocks = r.completed.blocks if r.completed else ()
    for b in blocks:
        digest.update(b.payload)
    out = {
        "ok": r.error is None and r.completed is not None,
        "blocks": len(blocks),
        "requested": len(keys),
        "recompute_from": r.completed.recompute_from if r.completed else None,
        "payload_bytes": sum(len(b.payload) for b in blocks),
        "wire_bytes": r.wire_bytes,
        "seconds": round(r.seconds, 6),
        "payload_mbit_s": round(sum(len(b.payload) for b in blocks) * 8 / r.seconds / 1e6, 3)
        if r.seconds
        else 0.0,
        "sha256": digest.hexdigest() if blocks else None,
        "holder_key_id": r.peer_key_id,
        "error": f"{type(r.error).__name__}: {r.error}" if r.error else None,
        "tls": not args.plaintext,
        "cpu_seconds": round(time.process_time() - cpu, 6),
    }
    print(json.dumps(out))
    return 0 if out["ok"] else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transfer",
        help="serve or pull KV blocks over TLS 1.3 with mutual authentication",
        description=__doc__,
    )
    tsub = p.add_subparsers(dest="transfer_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--key", help="this node's private key file (catsproto keygen)")
        q.add_argument("--trust", help="trust file (catsproto trust)")
        q.add_argument("--rate", type=int, default=0, help="bandwidth budget, bytes/s (0: none)")
        q.add_argument("--plaintext", action="store_true", help="bare TCP (benchmark baseline)")

    s = tsub.add_parser(
        "serve",
        help="hold synthetic blocks and serve pulls until SIGTERM",
        description="Hold a synthetic prefix (--synthetic SEED:COUNT:BYTES) and serve pulls "
        "of it over TLS 1.3 with mutual authentication (bare TCP with --plaintext) until "
        'SIGINT or SIGTERM. Prints {"listening": "HOST:PORT"} on stdout when ready and, at '
        "the end, one JSON line per served transfer on stderr.",
    )
    common(s)
    s.add_argument("--listen", default="127.0.0.1:7470", help="HOST:PORT (port 0: any)")
    s.add_argument("--synthetic", required=True, help="SEED:COUNT:BYTES of the held prefix")
    s.add_argument("--epoch", type=int, default=1, help="holder epoch (bump on restart)")
    s.add_argument("--chunk", type=int, default=256 << 10, help="DATA chunk size in bytes")
    s.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=IO_TIMEOUT_S,
        help="seconds any one read or write may block: a puller that stops reading is "
        "dropped after this long; also the base of each pull's deadline (--min-rate)",
    )
    s.add_argument(
        "--handshake-timeout",
        metavar="SECONDS",
        type=float,
        default=HANDSHAKE_TIMEOUT_S,
        help="seconds from accept until the peer is authenticated (offers and TLS "
        "handshake together); a peer still unauthenticated then is dropped",
    )
    s.add_argument(
        "--offer-timeout",
        metavar="SECONDS",
        type=float,
        help="seconds from accept until the peer's offer is in whole; a peer silent that "
        f"long is dropped (default: {OFFER_TIMEOUT_S:g}, or --handshake-timeout if shorter)",
    )
    s.add_argument(
        "--request-timeout",
        metavar="SECONDS",
        type=float,
        help="seconds from authentication (from accept with --plaintext) until the PULL "
        "has come in whole; a peer that trickles it is dropped (default: the "
        "--handshake-timeout)",
    )
    s.add_argument(
        "--min-rate",
        metavar="BYTES/S",
        type=float,
        default=MIN_RATE_BPS,
        help="bytes/s: the lowest rate a PULL may ask (lower is refused), and a pull must "
        "end within --timeout plus its blocks' bytes at this rate (or at --rate if lower); "
        "0: no floor and no such deadline",
    )
    s.add_argument(
        "--max-connections",
        metavar="N",
        type=int,
        default=MAX_CONNECTIONS,
        help="connections served at once; one more is closed at accept, unserved, unless "
        "one is still unauthenticated: then the oldest such is closed for it",
    )
    s.add_argument(
        "--max-handshakes",
        metavar="N",
        type=int,
        help="of those, how many may still be unauthenticated; one more closes the oldest "
        "of them (default: half of --max-connections, at least 1)",
    )
    s.add_argument(
        "--max-handshakes-per-address",
        metavar="N",
        type=int,
        help="unauthenticated connections from one source at once, an IPv4 address or an "
        "IPv6 /64; one more closes that source's oldest (default: a quarter of "
        "--max-handshakes, at least 1)",
    )
    s.set_defaults(func=cmd_serve)

    q = tsub.add_parser(
        "pull",
        help="pull a synthetic prefix and print the result as JSON",
        description="Pull a synthetic prefix (--synthetic SEED:COUNT) from a holder and print "
        "one JSON line: blocks, bytes, seconds, throughput, the SHA-256 over the payloads, "
        "the holder's key id and any error. Exit 0 if the pull completed without error, 1 "
        "if not.",
    )
    common(q)
    q.add_argument("--from", dest="source", required=True, help="holder HOST:PORT")
    q.add_argument(
        "--synthetic",
        required=True,
        help="SEED:COUNT of the prefix to pull; SEED:COUNT:BYTES also refuses a block "
        "announced larger than BYTES (the expected size) before reading it",
    )
    q.add_argument("--holder", help="the holder's key id (hex): refuse any other node")
    q.add_argument(
        "--transfer-id",
        type=int,
        default=1,
        help="the id this pull carries in its PULL frame; the holder's answers echo it",
    )
    q.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="seconds any one read or write may block before giving up",
    )
    q.add_argument(
        "--handshake-timeout",
        metavar="SECONDS",
        type=float,
        default=HANDSHAKE_TIMEOUT_S,
        help="seconds for the connect, both offers and the TLS handshake together (the "
        "connect alone with --plaintext); a holder not authenticated by then is given up",
    )
    q.set_defaults(func=cmd_pull)
