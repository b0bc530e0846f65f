"""Scenario 6, hostile peer: crafted and fuzzed attributes at a sustained rate.

The hostile speaker (`speaker.py`, replacing the `evil` node's ExaBGP) peers directly
with the receiver and announces i1's own main route — the honest route next to it
arrives over t1 and t2 — with attribute values that are truncated, oversized (a TLV
length past the end; a value padded to the UPDATE limit), non-canonical (TLVs out of
order), with a duplicated TLV, forged (altered body, altered signature, a key nobody
trusts, a trusted key outside its scope), unsigned, replayed (an older sequence), stale
or from the future, and mutations from the codec fuzzer, round robin at `rate` UPDATEs
per second. Every one must be refused with its reason (treat-as-withdraw of what *that
peer* announced on that route, RFC 7606) and counted; the session must stay up; the
honest routes must keep being accepted and the selector must keep steering.

Forged values carry a sequence far above the honest one, so that a forgery that got
through would push the replay window up and the honest updates would start failing as
`replayed`: the scenario would see it. Wrong attribute flags go on a route of i1's shard
range that the honest instance does not use, with values that are otherwise valid.
"""

from __future__ import annotations

import importlib.util
import json
import random
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from catsproto import wire
from catsproto.lab.faults.harness import (
    HOSTILE,
    RECEIVER,
    ChaosLab,
    Result,
    Steerer,
    rejected_by_reason,
)
from catsproto.lab.faults.speaker import write_plan
from catsproto.lab.instances import demo_prefix_keys, lab_key
from catsproto.lab.topology import InstanceSpec

I1, I2 = "10.101.0.11", "10.102.0.11"
FORGED_SEQUENCE = 1_000_000_000
FLAGS_PREFIX = "10.201.11.15/32"  # in i1's shard range, never used by the instance
OPTIONAL_TRANSITIVE = 0xC0

# expected refusals per case; None: any reason (fuzzer output). A cut just before the
# signature TLV leaves a canonical advertisement without one: unsigned, rightly.
EXPECTED: dict[str, str | frozenset[str] | None] = {
    "truncated": frozenset({"malformed", "unsigned"}),
    "oversized-length": "malformed",
    "oversized-value": "bad-signature",
    "non-canonical": "malformed",
    "duplicated-tlv": "malformed",
    "forged-body": "bad-signature",
    "forged-signature": "bad-signature",
    "unknown-key": "unknown-key",
    "out-of-scope-key": "not-authorised",
    "unsigned": "unsigned",
    "replayed": "replayed",
    "stale": "stale-timestamp",
    "future": "future-timestamp",
    "fuzz": None,
    "wrong-flags": "ignored",  # RFC 4271: ExaBGP quietly ignores an unknown non-transitive
}
HANDLED = ("treat-as-withdraw", "accept", "ignore")


# ---- the speaker process ------------------------------------------------------------------


def start_speaker(lab: ChaosLab) -> Path:
    """Replace the hostile node's ExaBGP with the test speaker; its directory."""
    lab.lab.handle.stop(lab.process(HOSTILE, "exabgp"))
    node = lab.lab.topology.nodes[HOSTILE]
    address = lab.address_of(HOSTILE, RECEIVER)
    base = lab.lab.node_dir(HOSTILE) / "speaker"
    argv = [sys.executable, "-m", "catsproto.lab.faults.speaker", "--dir", str(base)]
    argv += ["--asn", str(node.asn), "--router-id", address, "--listen", address]
    lab.lab.handle.start(HOSTILE, "speaker", argv)
    return base


def speaker_status(base: Path) -> dict[str, Any]:
    try:
        return json.loads((base / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_established(base: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while speaker_status(base).get("state") != "established":
        if time.monotonic() > deadline:
            raise TimeoutError(f"hostile speaker not established after {timeout:g}s")
        time.sleep(0.05)


# ---- the cases ------------------------------------------------------------------------------


def split_tlvs(value: bytes) -> list[bytes]:
    out, at = [], 0
    while at + 4 <= len(value):
        length = struct.unpack_from("!H", value, at + 2)[0]
        out.append(value[at : at + 4 + length])
        at += 4 + length
    return out


def _fuzz_mutator() -> Callable[[random.Random, bytes], bytes]:
    """tests/fuzz_wire.py's `mutate` when this is a source checkout; else bit flips."""
    path = Path(__file__).resolve().parents[3] / "tests" / "fuzz_wire.py"
    if path.is_file():
        spec = importlib.util.spec_from_file_location("catsproto_fuzz_wire", path)
        if spec and spec.loader:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.mutate

    def flip(rng: random.Random, data: bytes) -> bytes:
        buf = bytearray(data)
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        return bytes(buf)

    return flip


class CaseFactory:
    """Builds each hostile case's (prefix, flags, value) for i1's main route."""

    def __init__(self, lab: ChaosLab, seed: int = 11) -> None:
        self.topology = lab.lab.topology
        _, self.spec = lab.instance("i1")
        _, self.other = lab.instance("i2")
        self.rng = random.Random(seed)
        self.mutate = _fuzz_mutator()
        self.keys = demo_prefix_keys(1)
        self.flags_sequence = FORGED_SEQUENCE

    def _value(
        self,
        sequence: int,
        *,
        signer: str | None = "i1",
        now_ms: int | None = None,
        score: int = 5,
        spec: InstanceSpec | None = None,
        prefix: str | None = None,
    ) -> bytes:
        spec = spec or self.spec
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        key = lab_key(self.topology, signer) if signer else None
        adv = wire.Advertisement.build(  # as instance_routes builds the main route
            wire.Version(1),
            wire.Origin(spec.cs_id, spec.site_id, spec.address),
            wire.Sequence(epoch=1, sequence=sequence),
            wire.Timestamp(now_ms),
            wire.MetricsL2(score),
            wire.Capacity(free_blocks=60_000, total_blocks=65_536),
        )
        if key is None:
            return wire.encode(adv)
        from catsproto import security

        target = spec.csci if prefix is None else wire_prefix(prefix)
        return wire.encode(security.sign(adv, key, target))

    def build(self, case: str) -> tuple[str, int, bytes]:
        csci = str(self.spec.csci)
        forged = self._value(FORGED_SEQUENCE)
        tlvs = split_tlvs(forged)
        if case == "truncated":
            return csci, OPTIONAL_TRANSITIVE, forged[: self.rng.randrange(1, len(forged))]
        if case == "oversized-length":
            first = bytearray(tlvs[0])
            first[2:4] = struct.pack("!H", len(forged) + 100)
            return csci, OPTIONAL_TRANSITIVE, bytes(first) + b"".join(tlvs[1:])
        if case == "oversized-value":
            pad = struct.pack("!HH", 200, 3800) + bytes(3800)
            return csci, OPTIONAL_TRANSITIVE | 0x10, b"".join(tlvs[:-1]) + pad + tlvs[-1]
        if case == "non-canonical":
            return csci, OPTIONAL_TRANSITIVE, tlvs[1] + tlvs[0] + b"".join(tlvs[2:])
        if case == "duplicated-tlv":
            return csci, OPTIONAL_TRANSITIVE, tlvs[0] + b"".join(tlvs)
        if case == "forged-body":
            other = split_tlvs(self._value(FORGED_SEQUENCE, score=9))
            return csci, OPTIONAL_TRANSITIVE, b"".join(other[:-1]) + tlvs[-1]
        if case == "forged-signature":
            buf = bytearray(forged)
            buf[-1 - self.rng.randrange(64)] ^= 1 << self.rng.randrange(8)
            return csci, OPTIONAL_TRANSITIVE, bytes(buf)
        if case == "unknown-key":
            return csci, OPTIONAL_TRANSITIVE, self._value(FORGED_SEQUENCE, signer=HOSTILE)
        if case == "out-of-scope-key":
            return csci, OPTIONAL_TRANSITIVE, self._value(FORGED_SEQUENCE, signer="i2")
        if case == "unsigned":
            return csci, OPTIONAL_TRANSITIVE, self._value(FORGED_SEQUENCE, signer=None)
        if case == "replayed":
            return csci, OPTIONAL_TRANSITIVE, self._value(0)
        if case == "stale":
            old = int(time.time() * 1000) - 600_000
            return csci, OPTIONAL_TRANSITIVE, self._value(FORGED_SEQUENCE, now_ms=old)
        if case == "future":
            ahead = int(time.time() * 1000) + 600_000
            return csci, OPTIONAL_TRANSITIVE, self._value(FORGED_SEQUENCE, now_ms=ahead)
        if case == "fuzz":
            while True:
                mutated = self.mutate(self.rng, forged)
                if mutated != forged and 0 < len(mutated) <= 4000:
                    flags = OPTIONAL_TRANSITIVE | (0x10 if len(mutated) > 255 else 0)
                    return csci, flags, mutated
        if case == "wrong-flags":
            # otherwise valid (fresh sequence, signed for this route): only the flags lie
            self.flags_sequence += 1
            value = self._value(self.flags_sequence, prefix=FLAGS_PREFIX)
            return FLAGS_PREFIX, 0x80, value  # optional, NOT transitive
        raise KeyError(case)


def wire_prefix(text: str) -> Any:
    import ipaddress

    return ipaddress.ip_network(text)


def plan(lab: ChaosLab, rate: float, seconds: float, cases: list[str]) -> dict[str, Any]:
    factory = CaseFactory(lab)
    messages = []
    for i in range(int(rate * seconds)):
        case = cases[i % len(cases)]
        prefix, flags, value = factory.build(case)
        messages.append({"case": case, "prefix": prefix, "flags": flags, "value": value.hex()})
    return {"rate": rate, "messages": messages}


# ---- the scenario -------------------------------------------------------------------------


def run(root: Path, *, full: bool = False) -> Result:
    result = Result("hostile", "hostile peer (crafted, forged, replayed, fuzzed attributes)")
    rate = 100.0
    seconds = 60.0 if full else 8.0
    cases = list(EXPECTED)
    with ChaosLab(root) as lab:
        evil = lab.address_of(HOSTILE, RECEIVER)
        base = start_speaker(lab)
        lab.start_feeder("i1", 0.5)
        lab.start_feeder("i2", 0.5)
        lab.wait_for(lambda: lab.origins() >= {I1, I2}, 30, "both instances")
        wait_established(base, 30)
        the_plan = plan(lab, rate, seconds, cases)
        sent_per_case: dict[str, int] = {}
        for m in the_plan["messages"]:
            sent_per_case[m["case"]] = sent_per_case.get(m["case"], 0) + 1
        steer = Steerer(lab, demo_prefix_keys(1))
        steer.start()
        mark = len(lab.events())
        started = time.time()
        write_plan(base, "000.json", the_plan)
        try:
            total = len(the_plan["messages"])
            lab.wait_for(
                lambda: (
                    speaker_status(base).get("sent_total", 0) >= total
                    or speaker_status(base).get("notifications")
                ),
                seconds * 8 + 30,
                "the hostile plan sent",
            )
            sent_at = time.time()

            def handled() -> int:
                return sum(
                    1
                    for e in lab.events()[mark:]
                    if e.get("peer") == evil and e.get("kind") in HANDLED
                )

            lab.wait_for(lambda: handled() >= total, 60, "every hostile UPDATE handled")
            time.sleep(1.0)
        finally:
            samples = steer.stop()
        events = lab.events()[mark:]
        status = speaker_status(base)
        sessions = lab.receiver_sessions()
        rib_peers = {(r["peer"], r["origin"]) for r in lab.routes()}
        transits = set(lab.transit_peers())
        downs = lab.session_downs(started, [evil, *transits])
    from_evil = [e for e in events if e.get("peer") == evil]
    refused = [e for e in from_evil if e["kind"] == "treat-as-withdraw"]
    accepted = [e for e in from_evil if e["kind"] == "accept"]
    by_case_reason = _match_cases(the_plan["messages"], from_evil)
    honest = [e for e in events if e.get("kind") == "accept" and e.get("peer") in transits]
    honest_seq = {
        o: max((e["entry"]["sequence"] for e in honest if e["entry"]["origin"] == o), default=0)
        for o in (I1, I2)
    }
    mismatched = {
        case: reasons
        for case, reasons in by_case_reason.items()
        if (want := EXPECTED.get(case)) is not None
        and not set(reasons) <= (want if isinstance(want, frozenset) else {want})
    }
    accepted_cases = {c: r.get("accepted", 0) for c, r in by_case_reason.items() if "accepted" in r}
    wrong_choice = [s for s in samples if s.chosen != I1]
    result.time_label = "duration"
    result.time_s = sent_at - started
    result.misrouted = len(wrong_choice)
    result.rejected = rejected_by_reason(refused)
    ignored = sum(e["kind"] == "ignore" for e in from_evil)
    if ignored:
        result.rejected["ignored (flags 0x80)"] = ignored
    result.figures = {
        "sent": status.get("sent_total", 0),
        "rate_per_s": round(status.get("sent_total", 0) / max(sent_at - started, 1e-9), 1),
        "refused": len(refused),
        "accepted_from_hostile": len(accepted),
        "reasons_by_case": by_case_reason,
        "notifications": status.get("notifications", []),
        "speaker_sessions": status.get("sessions"),
        "receiver_session_to_hostile": sessions.get(evil),
        "honest_accepts_during_attack": len(honest),
        "honest_latest_sequence": honest_seq,
        "decisions": len(samples),
        "site1_decisions_not_to_i1": len(wrong_choice),
        "receiver_holds": sorted(f"{p} {o}" for p, o in rib_peers),
    }
    result.check("every hostile UPDATE sent", status.get("sent_total", 0) == total)
    result.check("no NOTIFICATION, one session", not status.get("notifications"))
    result.check("session to the hostile peer up at the end", sessions.get(evil) == "up")
    result.check("no receiver session went down", not downs)
    result.check("each crafted case refused with its reason", not mismatched)
    flagged = accepted_cases.pop("wrong-flags", 0)
    result.check("nothing else accepted from the hostile peer", not accepted_cases)
    result.check("wrong attribute flags never accepted", flagged == 0)
    result.check("honest updates kept flowing", min(honest_seq.values()) > 0 and len(honest) > 0)
    result.check("site-1 requests kept on i1", not wrong_choice and bool(samples))
    if flagged:
        result.notes.append(
            f"{flagged} values with flags 0x80 (optional, non-transitive) were accepted"
        )
    if mismatched:
        result.notes.append(f"cases refused for other reasons than expected: {mismatched}")
    return result


def _match_cases(
    messages: list[dict[str, Any]], events: list[dict[str, Any]]
) -> dict[str, dict[str, int]]:
    """Per case, how the receiver answered: UPDATEs are handled in order, one event
    each (one NLRI per UPDATE), so the n-th event from the hostile peer is message n."""
    out: dict[str, dict[str, int]] = {}
    handled = [e for e in events if e["kind"] in HANDLED]
    for m, e in zip(messages, handled, strict=False):
        outcome = {"accept": "accepted", "ignore": "ignored"}.get(e["kind"]) or _reason(e)
        per = out.setdefault(m["case"], {})
        per[outcome] = per.get(outcome, 0) + 1
    return out


def _reason(event: dict[str, Any]) -> str:
    from catsproto.lab.faults.harness import reason_of

    return reason_of(event.get("reason", ""))
