"""The summary bodies in the test vectors are real: every one decodes with the code's own
summary decoder and answers its probes as the vectors say; the intermediate values the
draft prints are recomputed here from the draft's formulas in plain integer arithmetic
(no numpy, none of the summary modules' helpers), so a slip in either shows."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from catsproto import wire
from catsproto.examples import CACHE_KEYS
from catsproto.summary import Summary
from catsproto.summary.delta import LayeredView, apply_delta

VECTORS = Path(__file__).parent / "vectors"
WIRE = json.loads((VECTORS / "wire.json").read_text())
SECURITY = json.loads((VECTORS / "security.json").read_text())
POSITIVE = {v["name"]: v for v in WIRE["positive"]}
NEGATIVE = {v["name"]: v for v in WIRE["negative"]}
BODIES = [(v["name"], b) for v in WIRE["positive"] for b in v.get("summaries", ())]
MASK = (1 << 64) - 1
KNOWN_KINDS = {int(k) for k in wire.SummaryKind}


def _entries(value_hex: str) -> list[wire.SummaryEntry]:
    summaries = wire.decode(bytes.fromhex(value_hex)).cache_summaries
    return list(summaries.entries) if summaries else []


def _entry(vector_name: str, tier: str) -> wire.SummaryEntry:
    return next(e for e in _entries(POSITIVE[vector_name]["hex"]) if e.tier.name.lower() == tier)


# ---- the draft's formulas, written out -------------------------------------------------


def mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def h(x: int, seed: int, s: int) -> int:
    return mix(x ^ mix((seed + (s + 1) * 0x9E3779B97F4A7C15) & MASK))


def rice_k(n: int) -> int:
    return 0 if n == 0 else max(0, ((1 << 64) * 709 // (1024 * n)).bit_length() - 1)


def rice_decode(body: bytes, at: int = 0) -> tuple[list[int], int]:
    """count u32, n*k remainder bits, n unary quotients, zero padding; gaps d_0 = x_0,
    d_i = x_i - x_(i-1) - 1."""
    (n,) = struct.unpack_from(">I", body, at)
    k = rice_k(n)
    bits = "".join(f"{b:08b}" for b in body[at + 4 :])
    rems = [int(bits[i * k : (i + 1) * k] or "0", 2) for i in range(n)]
    pos = n * k
    keys, previous = [], -1
    for r in rems:
        q = 0
        while bits[pos] == "0":
            q += 1
            pos += 1
        pos += 1
        previous = previous + 1 + ((q << k) | r)
        keys.append(previous)
    return keys, at + 4 + (pos + 7) // 8


def fuse_table(params: bytes, body: bytes) -> tuple[dict, list[int]]:
    arity, seg_log2 = params[0], params[1]
    segments, m = struct.unpack_from(">II", params, 2)
    g, b = params[10], params[11]
    (seed,) = struct.unpack_from(">Q", params, 12)
    slots = segments << seg_log2
    bits = "".join(f"{x:08b}" for x in body)
    values = []
    for i in range(-(-slots // g)):
        group = int(bits[i * b : (i + 1) * b], 2)
        for _ in range(g):
            group, digit = divmod(group, m)
            values.append(digit)
    p = {"arity": arity, "seg_log2": seg_log2, "segments": segments, "m": m, "g": g, "b": b}
    return {**p, "seed": seed, "slots": slots}, values[:slots]


def fuse_probe(p: dict, table: list[int], x: int) -> dict:
    h0, h1 = h(x, p["seed"], 0), h(x, p["seed"], 1)
    length = 1 << p["seg_log2"]
    s = ((h0 >> 32) * (p["segments"] - p["arity"] + 1)) >> 32
    slots = [(s + j) * length + ((h1 >> (16 * j)) % length) for j in range(p["arity"])]
    values = [table[i] for i in slots]
    f = ((h0 & 0xFFFFFFFF) * p["m"]) >> 32
    return {"h0": f"{h0:016x}", "h1": f"{h1:016x}", "segment": s, "slots": slots,
            "slot_values": values, "sum_mod_m": sum(values) % p["m"], "fingerprint": f}  # fmt: skip


def bloom_probe(params: bytes, body: bytes, x: int) -> dict:
    k, seed = params[0], int.from_bytes(params[1:9], "big")
    m = 8 * len(body)
    h1, h2 = h(x, seed, 0), h(x, seed, 1) | 1
    positions = [((h1 + i * h2) & MASK) % m for i in range(k)]
    bits = [(body[p >> 3] >> (p & 7)) & 1 for p in positions]
    return {"h1": f"{h1:016x}", "h2": f"{h2:016x}", "positions": positions, "bits": bits}


# ---- every body decodes and is a real summary of its kind -------------------------------


def test_every_known_kind_body_in_the_vectors_has_its_key_set_and_probes():
    listed = {(name, b["tier"]) for name, b in BODIES}
    for v in WIRE["positive"]:
        for e in _entries(v["hex"]):
            if int(e.kind) in KNOWN_KINDS:
                assert (v["name"], e.tier.name.lower()) in listed, (v["name"], e.tier)
    assert {b["kind"] for _, b in BODIES} == KNOWN_KINDS  # exact, Bloom, fuse and a delta


@pytest.mark.parametrize(("name", "body"), BODIES, ids=lambda x: x if isinstance(x, str) else "")
def test_body_decodes_with_the_codes_decoder_and_answers_its_probes(name, body):
    entry = _entry(name, body["tier"])
    assert int(entry.kind) == body["kind"] and entry.version == body["version"]
    assert entry.base_version == body["base_version"]
    summary = Summary.decode(int(entry.kind), entry.params, entry.body)
    assert summary.params() == entry.params and summary.encode() == entry.body  # canonical
    keys = np.array([int(k, 16) for k in body["keys"]], dtype=np.uint64)
    assert entry.entry_count == keys.size
    state: Summary | LayeredView = summary
    if body["kind"] == int(wire.SummaryKind.DELTA):
        base_entry = _entry(body["base"], body["tier"])
        assert base_entry.version == entry.base_version and base_entry.base_version == 0
        base = Summary.decode(int(base_entry.kind), base_entry.params, base_entry.body)
        state = apply_delta(base, summary)
        assert [f"{k:016x}" for k in summary.added] == body["added"]
        assert [f"{k:016x}" for k in summary.removed] == body["removed"]
        removed = np.array([int(k, 16) for k in body["removed"]], dtype=np.uint64)
        assert not state.contains_many(removed).any()
    assert state.contains_many(keys).all()  # no false negatives, whatever the kind
    probes = np.array([int(p["key"], 16) for p in body["probes"]], dtype=np.uint64)
    answers = [bool(a) for a in state.contains_many(probes)]
    assert answers == [p["member"] for p in body["probes"]]
    assert True in answers and False in answers  # both answers shown


def test_the_signed_security_vectors_carry_the_real_exact_set():
    for adv in SECURITY["advertisements"]:
        value = adv.get("opened_value") or adv["unsigned_value"]
        if adv["name"] == "sealed-algorithm-unknown":  # nothing here can open it
            assert _entries(value) == []
            continue
        (entry,) = _entries(value)
        summary = Summary.decode(int(entry.kind), entry.params, entry.body)
        assert entry.kind == wire.SummaryKind.EXACT
        assert [int(k) for k in summary.keys] == sorted(CACHE_KEYS)  # type: ignore[attr-defined]


# ---- the printed intermediate values follow from the draft's formulas -------------------


@pytest.mark.parametrize(("name", "body"), BODIES, ids=lambda x: x if isinstance(x, str) else "")
def test_intermediate_values_follow_the_draft_formulas(name, body):
    entry = _entry(name, body["tier"])
    kind = body["kind"]
    if kind == int(wire.SummaryKind.DELTA):
        added, mid = rice_decode(entry.body)
        removed, end = rice_decode(entry.body, mid)
        assert end == len(entry.body)
        assert [f"{k:016x}" for k in added] == body["added"]
        assert [f"{k:016x}" for k in removed] == body["removed"]
        assert body["rice_k"] == [rice_k(len(added)), rice_k(len(removed))]
        base_entry = _entry(body["base"], body["tier"])
        p, table = fuse_table(base_entry.params, base_entry.body)
        for probe in body["probes"]:
            x = int(probe["key"], 16)
            got = fuse_probe(p, table, x)
            assert {k: probe[k] for k in got} == got
            in_base = got["sum_mod_m"] == got["fingerprint"]
            assert probe["in_base"] == in_base
            member = probe["key"] in body["added"] or (
                in_base and probe["key"] not in body["removed"]
            )
            assert probe["member"] == member
        return
    if kind == int(wire.SummaryKind.EXACT):
        keys, end = rice_decode(entry.body)
        assert end == len(entry.body) and [f"{k:016x}" for k in keys] == body["keys"]
        assert body["rice_k"] == [rice_k(len(keys))]
        for probe in body["probes"]:
            assert probe["member"] == (probe["key"] in body["keys"])
        return
    seed = int(body["params"]["seed"], 16)
    salts = [f"{mix((seed + (s + 1) * 0x9E3779B97F4A7C15) & MASK):016x}" for s in (0, 1)]
    assert body["params"]["salts"] == salts
    for probe in body["probes"]:
        x = int(probe["key"], 16)
        if kind == int(wire.SummaryKind.FUSE):
            p, table = fuse_table(entry.params, entry.body)
            assert {k: body["params"][k] for k in p if k != "seed"} == {
                k: v for k, v in p.items() if k != "seed"
            }
            got = fuse_probe(p, table, x)
            assert {k: probe[k] for k in got} == got
            assert probe["member"] == (got["sum_mod_m"] == got["fingerprint"])
        else:
            assert body["params"]["m"] == 8 * len(entry.body)
            got = bloom_probe(entry.params, entry.body, x)
            assert {k: probe[k] for k in got} == got
            assert probe["member"] == all(got["bits"])


def test_the_delta_has_a_nonzero_base_on_a_fuse_snapshot():
    (delta,) = [b for _, b in BODIES if b["kind"] == int(wire.SummaryKind.DELTA)]
    assert delta["base_version"] > 0 and delta["base_kind"] == int(wire.SummaryKind.FUSE)
    assert delta["added"] and delta["removed"]
    origin = {wire.decode(bytes.fromhex(POSITIVE[n]["hex"])).origin for n in ("fuse-delta",
              delta["base"])}  # fmt: skip
    assert len(origin) == 1  # the same origin, so the same stream


# ---- negative vectors ---------------------------------------------------------------------


def _tlvs(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, type, length) of every TLV; raises if a length runs past the input."""
    out, pos = [], 0
    while pos < len(data):
        t, n = struct.unpack_from(">HH", data, pos)
        assert pos + 4 + n <= len(data), f"TLV {t} at {pos} runs past the input"
        out.append((pos, t, n))
        pos += 4 + n
    return out


def test_model_id_not_utf8_fails_for_the_utf8_reason_only():
    v = NEGATIVE["model-id-not-utf8"]
    data = bytes.fromhex(v["hex"])
    (at, _, length) = _tlvs(data)[-1]  # framing is sound: the length matches what follows
    value = data[at + 4 : at + 4 + length]
    model_len = value[0]
    assert length == 1 + model_len + 4 + 1 + 4  # model id, block size, scheme, secret id
    with pytest.raises(wire.BadValueError, match="not UTF-8") as info:
        wire.decode(data)
    assert info.value.tlv_type == 32 and info.value.offset == at + 5
    assert v["message"] == str(info.value)
    fixed = bytearray(data)
    fixed[at + 5 : at + 5 + model_len] = b"AA"  # the same bytes with a UTF-8 model id decode
    assert wire.decode(bytes(fixed)).cache_model.model_id == "AA"  # type: ignore[union-attr]


@pytest.mark.parametrize("vector", WIRE["negative"], ids=lambda v: v["name"])
def test_negative_vector_action_is_what_error_action_says(vector):
    with pytest.raises(wire.CodecError) as info:
        wire.decode(bytes.fromhex(vector["hex"]))
    assert vector["action"] == wire.error_action(info.value).value


def test_scope_order_is_octetwise_on_kind_and_value():
    """The IPv6 address entry (17 octets) precedes the IPv4 one (5 octets) because its
    value's second octet is lower; in (Kind, Length, Value) order it would follow."""
    adv = wire.decode(bytes.fromhex(POSITIVE["sealed-delegated"]["hex"]))
    scope = adv.get(wire.Delegation).scope  # type: ignore[union-attr]
    addresses = [e for e in scope if e.kind == wire.ScopeKind.ADDRESS]
    assert [len(e.value) for e in addresses] == [17, 5]
    assert [(e.kind, e.value) for e in scope] == sorted((e.kind, e.value) for e in scope)
    assert sorted(scope, key=lambda e: (e.kind, len(e.value), e.value)) != list(scope)
    v = NEGATIVE["scope-in-length-order"]
    assert v["error"] == "NonCanonicalError" and "scope" in v["message"]


@pytest.mark.parametrize("vector", WIRE["attributes"], ids=lambda v: v["name"])
def test_attribute_vectors(vector):
    data = bytes.fromhex(vector["attribute"])
    if vector["accepted"]:
        adv = wire.decode_attribute_value(data)
        assert wire.encode(adv).hex() == vector["value"] == POSITIVE["minimal-ipv4"]["hex"]
        return
    with pytest.raises(wire.BadValueError) as info:
        wire.decode_attribute_value(data)
    assert info.value.offset == 0 and vector["message"] == str(info.value)


@pytest.mark.parametrize("vector", WIRE["positive"], ids=lambda v: v["name"])
def test_signature_key_ids_follow_the_derivation_rule(vector):
    """A Signature TLV's Key ID is 8 octets (the draft's Key Identifiers), and a carried
    delegation is for the key that signs: its Node Public Key derives that Key ID."""
    from catsproto.security import key_id

    adv = wire.decode(bytes.fromhex(vector["hex"]))
    if adv.signature is None:
        return
    assert len(adv.signature.key_id) == 8
    delegation = adv.get(wire.Delegation)
    if delegation is not None:
        assert key_id(delegation.node_key) == adv.signature.key_id
        assert adv.signature.key_id.hex() in vector["description"]
