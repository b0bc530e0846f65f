"""The codec's test vectors: positive ones from the examples, negative ones by hand.

Negative vectors are written as hex with the error each must raise stated by hand
(class, offset, TLV type), not derived from the decoder; `wire_vectors()` refuses to
produce a file in which the decoder disagrees. The draft prints these same vectors.
"""

from __future__ import annotations

from catsproto import wire
from catsproto.examples import examples
from catsproto.wire.fields import JSON

# The mandatory TLVs of the `minimal-ipv4` example, one TLV a line (offsets 0..50).
VERSION = "0001 0001 01"
ORIGIN = "0002 000e 00000064 00000001 0001 c000020a"  # cs 100, site 1, 192.0.2.10
SEQUENCE = "0003 000c 00000001 0000000000000001"  # epoch 1, sequence 1
TIMESTAMP = "0004 0008 000001a1ee5661e8"
AFTER_ORIGIN = " ".join([SEQUENCE, TIMESTAMP])
AFTER_VERSION = " ".join([ORIGIN, AFTER_ORIGIN])
HEADER = " ".join([VERSION, AFTER_VERSION])  # 51 bytes; a next TLV's value starts at 55

# (name, hex, error class, offset, TLV type or None)
NEGATIVE: list[tuple[str, str, type[wire.CodecError], int, int | None]] = [
    ("truncated-tlv-header", "0001 00", wire.TruncatedError, 2, None),
    ("truncated-field", "0002 0002 0000", wire.TruncatedError, 4, 2),
    ("length-exceeds-input", "0001 0009 01", wire.BadLengthError, 4, 1),
    ("value-not-consumed", "0001 0002 0100 " + AFTER_VERSION, wire.BadLengthError, 5, 1),
    (
        "types-out-of-order",
        " ".join([VERSION, ORIGIN, TIMESTAMP, SEQUENCE]),
        wire.NonCanonicalError,
        35,
        3,
    ),
    ("type-repeated", VERSION + " " + HEADER, wire.NonCanonicalError, 5, 1),
    ("list-unsorted", HEADER + " 0011 0004 0208 0106", wire.NonCanonicalError, 55, 17),
    ("list-empty", HEADER + " 0010 0000", wire.NonCanonicalError, 55, 16),
    ("unsupported-version", "0001 0001 02 " + AFTER_VERSION, wire.BadValueError, 4, 1),
    (
        "unknown-afi",
        VERSION + " 0002 000e 00000064 00000001 0003 c000020a " + AFTER_ORIGIN,
        wire.BadValueError,
        17,
        2,
    ),
    (
        "free-above-total",
        HEADER + " 0022 0010 0000000000000002 0000000000000001",
        wire.BadValueError,
        55,
        34,
    ),
    (
        "metric-not-finite",
        HEADER + " 0010 000d 0001 02 02 02 7ff8000000000000",
        wire.BadValueError,
        60,
        16,
    ),
    (
        "metric-negative-zero",  # -0.0 equals +0.0: two encodings of one value
        HEADER + " 0010 000d 0001 02 02 02 8000000000000000",
        wire.BadValueError,
        60,
        16,
    ),
    ("mandatory-missing", " ".join([VERSION, ORIGIN, SEQUENCE]), wire.BadValueError, 0, None),
    (
        "model-id-not-utf8",
        HEADER + " 0020 000b 02 ff41 00000200 01 00000007",
        wire.BadValueError,
        56,
        32,
    ),
    (
        "unknown-tier",
        HEADER
        + " 0021 002d 002b 09 01 00000001 00000000 0000000000000000 ffffffffffffffff"
        + " 00000000 00040000 00000005 000c3500 00",
        wire.BadValueError,
        57,
        33,
    ),
    (
        "summary-kind-zero",  # kind 0 is reserved; unnamed kinds 1..255 are kept
        HEADER
        + " 0021 002d 002b 01 00 00000001 00000000 0000000000000000 ffffffffffffffff"
        + " 00000000 00040000 00000005 000c3500 00",
        wire.BadValueError,
        58,
        33,
    ),
    (
        "ed25519-signature-short",
        HEADER + " 00ff 0042 01 01 61 " + "ab" * 63,
        wire.BadLengthError,
        55,
        255,
    ),
]


def _expect_error(name: str, data: bytes, cls: type, offset: int, tlv: int | None) -> str:
    try:
        wire.decode(data)
    except wire.CodecError as exc:
        got = (type(exc), exc.offset, exc.tlv_type)
        if got != (cls, offset, tlv):
            raise AssertionError(
                f"negative vector {name}: expected {(cls, offset, tlv)}, got {got}"
            ) from None
        return str(exc)
    raise AssertionError(f"negative vector {name} decoded without error")


def wire_vectors() -> JSON:
    """The content of tests/vectors/wire.json."""
    positive = []
    for ex in examples():
        value = wire.encode(ex.advertisement)
        positive.append(
            {
                "name": ex.name,
                "description": ex.description,
                "json": ex.advertisement.to_json(),
                "hex": value.hex(),
                "attribute": wire.encode_attribute(value).hex(),
            }
        )
    negative = []
    for name, text, cls, offset, tlv in NEGATIVE:
        data = bytes.fromhex(text)
        message = _expect_error(name, data, cls, offset, tlv)
        negative.append(
            {
                "name": name,
                "hex": data.hex(),
                "error": cls.__name__,
                "offset": offset,
                "tlv_type": tlv,
                "message": message,
            }
        )
    return {"positive": positive, "negative": negative}
