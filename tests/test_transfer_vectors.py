"""tests/vectors/transfer.json against the transfer code: the file is what its script
writes, every positive frame decodes and encodes again byte for byte (fed whole and byte
by byte), every malformed one raises exactly the error it states, digests follow the
documented formula (recomputed here with hashlib alone), and the exchange is what the
real puller and holder say to each other."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from catsproto.transfer import (
    Cancel,
    Code,
    Completed,
    Data,
    FrameError,
    FrameReader,
    Holder,
    PeerCancelled,
    PeerRefusedError,
    Puller,
    Refuse,
    StoredBlock,
    block_digest,
    encode,
)
from catsproto.transfer.frames import FRAME_TYPES, HEADER_LEN, MAX_REASON, frame_fields

HERE = Path(__file__).parent / "vectors"
TEXT = (HERE / "transfer.json").read_text()
VECTORS = json.loads(TEXT)
FRAMES = VECTORS["frames"]
MALFORMED = VECTORS["malformed"]


def _script():
    spec = importlib.util.spec_from_file_location("make_transfer", HERE / "make_transfer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vector_file_is_what_the_script_writes():
    text = json.dumps(_script().transfer_vectors(), indent=2) + "\n"
    assert text == TEXT, "run python tests/vectors/make_transfer.py > tests/vectors/transfer.json"


def test_the_script_refuses_a_malformed_vector_the_decoder_disagrees_with(monkeypatch):
    script = _script()
    name, description, hexed, message, offset, frame_type = script.MALFORMED[1]
    wrong = (name, description, hexed, message, offset + 1, frame_type)
    monkeypatch.setattr(script, "MALFORMED", [wrong])
    with pytest.raises(SystemExit, match="decoder says"):
        script.malformed_vectors()


# ---- positive frames --------------------------------------------------------------------


def test_every_frame_type_has_a_vector_and_the_special_cases_are_there():
    assert {v["type"] for v in FRAMES} == set(FRAME_TYPES)
    codes = {next(f["value"] for f in v["fields"] if f["name"] == "code") for v in FRAMES
             if v["type"] in (7, 8)}  # fmt: skip
    assert codes - {int(c) for c in Code}, "no vector with an unregistered code"
    assert any(v.get("reason_given_octets", 0) > MAX_REASON for v in FRAMES)


def _decode_whole(raw: bytes):
    [(at, frame)] = FrameReader().feed(raw)
    assert at == 0
    return frame


@pytest.mark.parametrize("vector", FRAMES, ids=lambda v: v["name"])
def test_positive_frame_decodes_and_encodes_again_byte_for_byte(vector):
    raw = bytes.fromhex(vector["hex"])
    frame = _decode_whole(raw)
    assert int(frame.TYPE) == vector["type"] == raw[0]
    assert int.from_bytes(raw[1:HEADER_LEN], "big") == len(raw) - HEADER_LEN
    assert encode(frame) == raw
    pieces = []
    reader = FrameReader()
    for i in range(len(raw)):
        pieces += reader.feed(raw[i : i + 1])
    if isinstance(frame, Data):
        assert b"".join(bytes(f.chunk) for _, f in pieces) == frame.chunk
    else:
        assert [f for _, f in pieces] == [frame]


@pytest.mark.parametrize("vector", FRAMES, ids=lambda v: v["name"])
def test_positive_frame_fields_are_the_decoded_ones(vector):
    raw = bytes.fromhex(vector["hex"])
    fields = frame_fields(_decode_whole(raw))
    assert [f["name"] for f in vector["fields"]] == [f.name for f in fields]
    assert "".join(f["hex"] for f in vector["fields"]) == raw[HEADER_LEN:].hex()
    for want, got in zip(vector["fields"], fields, strict=True):
        assert want["hex"] == got.raw.hex(), want["name"]
        if isinstance(got.value, bytes):
            assert want["value"] == got.value.hex()
        elif got.name.startswith("key"):
            assert int(want["value"], 16) == got.value
        else:
            assert want["value"] == got.value


def test_a_long_reason_is_sent_cut_at_the_character_boundary_before_max_reason():
    [v] = [v for v in FRAMES if "reason_given" in v]
    given = v["reason_given"].encode("utf-8")
    assert len(given) == v["reason_given_octets"] > MAX_REASON
    code = next(f["value"] for f in v["fields"] if f["name"] == "code")
    raw = bytes.fromhex(v["hex"])
    assert encode(Refuse(code, v["reason_given"])) == raw
    sent = raw[HEADER_LEN + 2 :]
    assert given.startswith(sent) and len(sent) <= MAX_REASON
    with pytest.raises(UnicodeDecodeError):  # a cut at MAX_REASON would split a character
        given[:MAX_REASON].decode("utf-8")
    assert MAX_REASON - len(sent) < 4  # and no more than that character is dropped
    assert _decode_whole(raw).reason == sent.decode("utf-8")


def test_an_unregistered_code_decodes_and_is_handled_as_the_procedure_says():
    """The draft: the puller treats a CANCEL of any code but 1 (and any REFUSE) as a
    refusal; the holder stops on any CANCEL. An unregistered code is no exception."""
    [v] = [v for v in FRAMES if v["name"] == "cancel-unregistered-code"]
    raw = bytes.fromhex(v["hex"])
    frame = _decode_whole(raw)
    assert isinstance(frame, Cancel) and frame.code not in {int(c) for c in Code}
    puller = Puller(1, [5])
    puller.start()
    with pytest.raises(PeerRefusedError) as exc:
        puller.receive(raw)
    assert exc.value.code == frame.code and not puller.resume_state().blocks
    holder = Holder(lambda key: None, 1)
    assert holder.receive(raw) == [PeerCancelled(frame.code, frame.reason)] and holder.finished


# ---- digests ----------------------------------------------------------------------------


@pytest.mark.parametrize("vector", VECTORS["digests"], ids=lambda v: f"{v['key']}-{v['size']}")
def test_digest_follows_the_documented_formula(vector):
    label = b"catsproto/v1 kv-block\x00"
    assert VECTORS["digest_label"] == label.hex()
    key, payload = int(vector["key"], 16), bytes.fromhex(vector["payload"])
    assert len(payload) == vector["size"]
    head = label + key.to_bytes(8, "big") + len(payload).to_bytes(8, "big")
    assert head.hex() == vector["hashed_before_payload"]
    assert hashlib.sha256(head + payload).hexdigest() == vector["digest"]
    assert block_digest(key, payload).hex() == vector["digest"]


def test_digests_differ_for_one_payload_under_two_keys():
    by_payload: dict[str, set[str]] = {}
    for v in VECTORS["digests"]:
        by_payload.setdefault(v["payload"], set()).add(v["digest"])
    assert any(len(d) > 1 for d in by_payload.values())


# ---- the exchange -----------------------------------------------------------------------


def test_exchange_is_what_the_puller_and_holder_send():
    x = VECTORS["exchange"]
    keys = [int(k, 16) for k in x["keys"]]
    store = {int(b["key"], 16): StoredBlock.of(int(b["key"], 16), bytes.fromhex(b["payload"]))
             for b in x["held"]}  # fmt: skip
    streams: dict[str, bytes] = {"puller": b"", "holder": b""}
    for f in x["frames"]:
        assert f["offset"] == len(streams[f["from"]])
        raw = bytes.fromhex(f["hex"])
        assert raw[0] == f["type"]
        streams[f["from"]] += raw
    puller = Puller(x["transfer_id"], keys)
    assert puller.start() == streams["puller"]
    holder = Holder(store.get, x["holder_epoch"], chunk=x["chunk"])
    holder.receive(streams["puller"])
    sent = b""
    while not holder.finished:
        sent += holder.send(0.0)
    assert sent == streams["holder"]
    events = puller.receive(streams["holder"])
    puller.end_of_stream()
    [done] = [e for e in events if isinstance(e, Completed)]
    result = {"verified": len(done.blocks), "evicted_at": done.evicted_at,
              "recompute_from": done.recompute_from}  # fmt: skip
    assert result == x["result"]
    assert [b.payload for b in done.blocks] == [store[k].payload for k in keys[: len(store)]]


def test_exchange_frames_each_decode_to_one_frame():
    for f in VECTORS["exchange"]["frames"]:
        raw = bytes.fromhex(f["hex"])
        assert encode(_decode_whole(raw)) == raw


# ---- malformed frames -------------------------------------------------------------------


def _raised(data: bytes, step: int | None) -> tuple[str, str, int | None, int | None]:
    reader = FrameReader()
    parts = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
    with pytest.raises(FrameError) as exc:
        for part in parts:
            reader.feed(part)
    e = exc.value
    return type(e).__name__, e.reason, e.offset, e.frame_type


@pytest.mark.parametrize("vector", MALFORMED, ids=lambda v: v["name"])
def test_malformed_frame_raises_exactly_the_stated_error(vector):
    data = bytes.fromhex(vector["hex"])
    want = (vector["error"], vector["message"], vector["offset"], vector["frame_type"])
    assert _raised(data, None) == want
    assert _raised(data, 1) == want  # byte by byte
    assert _raised(data + b"\x06\x00", None) == want  # whatever follows
