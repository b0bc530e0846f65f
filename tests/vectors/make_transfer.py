"""Regenerate transfer.json: `python tests/vectors/make_transfer.py > tests/vectors/transfer.json`.

The vectors pin the KV-transfer frames of `catsproto.transfer` (docs/transfer.md, the
draft's "KV Transfer Between Instances"): one positive vector per frame type and a few
more (an unregistered code, a reason cut at MAX_REASON octets), block digests, a whole
exchange produced by running the real `Puller` and `Holder` against each other, and
malformed frames. The malformed ones are written here by hand, with the error each must
raise (message, stream offset, frame type); this script refuses to write a file in which
the decoder disagrees, and tests/test_transfer_vectors.py checks the same again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from catsproto.transfer import (
    Accept,
    Block,
    Cancel,
    Code,
    Completed,
    Data,
    Done,
    Evicted,
    FrameError,
    FrameReader,
    Holder,
    Pull,
    Puller,
    Refuse,
    StoredBlock,
    block_digest,
    encode,
    synthetic_keys,
    synthetic_payload,
)
from catsproto.transfer.content import DIGEST_LABEL
from catsproto.transfer.frames import (
    HEADER,
    HEADER_LEN,
    MAX_BODY,
    MAX_REASON,
    FrameField,
    frame_fields,
)

JSON = Any

# The small pull of the exchange: three blocks of 24 octets, the holder has the first
# two, sends payload in DATA chunks of at most 16 octets.
KEYS = synthetic_keys(2026, 3)
BLOCK_SIZE = 24
CHUNK = 16
TRANSFER_ID = 7
HOLDER_EPOCH = 3
HELD = 2
STORE = {k: StoredBlock.of(k, synthetic_payload(k, BLOCK_SIZE)) for k in KEYS[:HELD]}

LONG_REASON = "x" + "\u00e9" * 600  # 1,201 octets; octet 1,024 is inside the 512th e-acute


def _positive() -> list[tuple[str, str, object]]:
    """(name, description, frame) of each positive frame vector."""
    b1 = STORE[KEYS[1]]
    return [
        (
            "pull",
            "A resumption: transfer 7 asks for the three blocks from block 1 on, its staged "
            "block 0 having come from holder epoch 3, at 125,000,000 octets per second.",
            Pull(TRANSFER_ID, HOLDER_EPOCH, 1, 125_000_000, tuple(KEYS)),
        ),
        (
            "accept",
            "The holder (still epoch 3) takes it from block 1; the pull named 3 keys.",
            Accept(TRANSFER_ID, HOLDER_EPOCH, 1, 3),
        ),
        (
            "block",
            "Header of block 1: its key, 24 octets of payload, their digest.",
            Block(1, b1.key, len(b1.payload), b1.digest),
        ),
        (
            "data",
            "The first 16 octets of block 1's payload.",
            Data(b1.payload[:CHUNK]),
        ),
        (
            "evicted",
            "Block 2 is no longer held: neither it nor anything after it is sent.",
            Evicted(2, KEYS[2]),
        ),
        (
            "done",
            "Transfer 7 ends; blocks up to 1 were sent, so end is 2.",
            Done(TRANSFER_ID, 2),
        ),
        (
            "cancel",
            "Code 1 (cancelled) with an empty reason: from the holder, a clean end.",
            Cancel(Code.CANCELLED, ""),
        ),
        (
            "refuse",
            "Code 3 (too large), refusing a PULL of 3 keys.",
            Refuse(Code.TOO_LARGE, "3 keys, at most 2"),
        ),
        (
            "cancel-unregistered-code",
            "Code 300 is not registered. The frame is well formed: a puller treats it as "
            "a refusal, as it does every code but 1, and a holder stops as on any CANCEL.",
            Cancel(300, "code 300 is not registered"),
        ),
        (
            "refuse-long-reason",
            f'The reason given is "x" followed by 600 U+00E9 (UTF-8 c3a9), '
            f"{len(LONG_REASON.encode()):,} octets. Cut at {MAX_REASON:,} octets it would end "
            "inside the 512th U+00E9, so the sender cuts at the character boundary "
            "before it: the reason sent is 1,023 octets, 78 and 511 times c3a9.",
            Refuse(Code.BAD_REQUEST, LONG_REASON),
        ),
    ]


# Malformed frames, by hand: (name, description, hex, message, offset, frame type).
DONE_7_2 = "06 0000000c 0000000000000007 00000002"  # 17 octets
MALFORMED: list[tuple[str, str, str, str, int, int | None]] = [
    (
        "unknown-frame-type",
        "Type 9 is not a frame type; the header is refused before any body is read.",
        "09 00000000",
        "unknown frame type 9",
        0,
        None,
    ),
    (
        "unknown-type-after-done",
        "A well-formed DONE, then type 0: offsets count from the first octet of the stream.",
        DONE_7_2 + " 00 00000000",
        "unknown frame type 0",
        17,
        None,
    ),
    (
        "data-over-limit",
        "A DATA header announcing 2^20 + 1 octets, one over the limit.",
        "04 00100001",
        f"length {MAX_BODY + 1} over the limit of {MAX_BODY}",
        0,
        4,
    ),
    (
        "data-empty",
        "A DATA frame carries at least one octet.",
        "04 00000000",
        "data: empty chunk",
        0,
        4,
    ),
    (
        "accept-short",
        "An ACCEPT body of 23 octets: its count lacks an octet.",
        "02 00000017 0000000000000007 0000000000000003 00000001 000003",
        "accept body is 23 bytes, not 24",
        0,
        2,
    ),
    (
        "pull-without-keys",
        "A PULL whose body is its fixed part alone: a pull names at least one key.",
        "01 0000001c 0000000000000007 0000000000000000 00000000 0000000000000000",
        "pull: at least one key",
        0,
        1,
    ),
    (
        "cancel-without-code",
        "A CANCEL body of one octet has no room for its u16 code.",
        "07 00000001 00",
        "cancel body of 1 bytes lacks its code",
        0,
        7,
    ),
    (
        "refuse-reason-cut-inside-character",
        'A reason "x" followed by the first octet of U+00E9 alone: not UTF-8, so the '
        "whole frame is refused (the reason why senders cut at a character boundary).",
        "08 00000004 0002 78c3",
        "refuse reason is not UTF-8",
        0,
        8,
    ),
]


def field_json(field: FrameField) -> JSON:
    """A field as the vectors write it: keys and octet strings as hex, the rest as is."""
    name, value, _ = field
    if isinstance(value, bytes):
        return {"name": name, "value": value.hex(), "hex": field.raw.hex()}
    if name.startswith("key"):
        return {"name": name, "value": f"{value:016x}", "hex": field.raw.hex()}
    return {"name": name, "value": value, "hex": field.raw.hex()}


def split_frames(stream: bytes) -> list[tuple[int, bytes]]:
    """(offset, octets) of each frame of a well-formed stream, by its header's length."""
    out, at = [], 0
    while at < len(stream):
        _, length = HEADER.unpack_from(stream, at)
        out.append((at, stream[at : at + HEADER_LEN + length]))
        at += HEADER_LEN + length
    return out


def frame_vector(name: str, description: str, frame: Any) -> JSON:
    raw = encode(frame)
    [(_, back)] = FrameReader().feed(raw)
    if encode(back) != raw:
        raise SystemExit(f"frame vector {name}: decoding and encoding again differ")
    vector = {
        "name": name,
        "description": description,
        "type": int(frame.TYPE),
        "fields": [field_json(f) for f in frame_fields(back)],
        "hex": raw.hex(),
    }
    if isinstance(frame, Cancel | Refuse) and back.reason != frame.reason:
        vector["reason_given"] = frame.reason
        vector["reason_given_octets"] = len(frame.reason.encode("utf-8"))
    return vector


def digest_vectors() -> list[JSON]:
    named = [
        (0x0123456789ABCDEF, b""),
        (0x0123456789ABCDEF, b"catsproto kv block"),
        (0xFEDCBA9876543210, b"catsproto kv block"),
        (KEYS[0], STORE[KEYS[0]].payload),
    ]
    out = []
    for key, payload in named:
        head = DIGEST_LABEL + key.to_bytes(8, "big") + len(payload).to_bytes(8, "big")
        out.append(
            {
                "key": f"{key:016x}",
                "size": len(payload),
                "payload": payload.hex(),
                "hashed_before_payload": head.hex(),
                "digest": block_digest(key, payload).hex(),
            }
        )
    return out


def exchange() -> JSON:
    """Run the real puller and holder against each other, in process, unpaced."""
    puller = Puller(TRANSFER_ID, KEYS)
    holder = Holder(STORE.get, HOLDER_EPOCH, chunk=CHUNK)
    to_holder = puller.start()
    holder.receive(to_holder)
    to_puller = b""
    while not holder.finished:
        to_puller += holder.send(0.0)
    events = puller.receive(to_puller)
    puller.end_of_stream()
    [done] = [e for e in events if isinstance(e, Completed)]
    frames = [("puller", at, raw) for at, raw in split_frames(to_holder)]
    frames += [("holder", at, raw) for at, raw in split_frames(to_puller)]
    return {
        "description": (
            f"Transfer {TRANSFER_ID}: the puller asks for three blocks of {BLOCK_SIZE} "
            f"octets from the start; the holder (epoch {HOLDER_EPOCH}, DATA chunks of at "
            f"most {CHUNK} octets, unpaced) holds the first two, so it answers EVICTED for "
            "block 2 and DONE. The puller admits blocks 0 and 1 and computes from block 2."
        ),
        "transfer_id": TRANSFER_ID,
        "holder_epoch": HOLDER_EPOCH,
        "chunk": CHUNK,
        "keys": [f"{k:016x}" for k in KEYS],
        "held": [{"key": f"{b.key:016x}", "payload": b.payload.hex()} for b in STORE.values()],
        "frames": [
            {"from": who, "offset": at, "type": raw[0], "hex": raw.hex()} for who, at, raw in frames
        ],
        "result": {
            "verified": len(done.blocks),
            "evicted_at": done.evicted_at,
            "recompute_from": done.recompute_from,
        },
    }


def malformed_vectors() -> list[JSON]:
    out = []
    for name, description, text, message, offset, frame_type in MALFORMED:
        data = bytes.fromhex(text)
        try:
            FrameReader().feed(data)
        except FrameError as exc:
            got = (exc.reason, exc.offset, exc.frame_type)
        else:
            raise SystemExit(f"malformed vector {name} decodes")
        if got != (message, offset, frame_type):
            raise SystemExit(f"malformed vector {name}: the decoder says {got}")
        out.append(
            {
                "name": name,
                "description": description,
                "hex": data.hex(),
                "error": "FrameError",
                "message": message,
                "offset": offset,
                "frame_type": frame_type,
            }
        )
    return out


def transfer_vectors() -> JSON:
    return {
        "description": "catsproto KV-transfer frames (see catsproto/transfer/frames.py)",
        "max_body": MAX_BODY,
        "max_reason": MAX_REASON,
        "digest_label": DIGEST_LABEL.hex(),
        "frames": [frame_vector(*v) for v in _positive()],
        "digests": digest_vectors(),
        "exchange": exchange(),
        "malformed": malformed_vectors(),
    }


def main() -> None:
    json.dump(transfer_vectors(), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
