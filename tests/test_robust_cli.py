"""Bad input to the codec, `decode`/`encode`/`vectors`/`sign`/`verify`, `eval` and
`inspect`: exit 2 with one line naming the field and the value, nothing written, no
traceback; and the codec's one canonical form for binary64 zero."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from catsproto import cli, wire
from catsproto.wire import Reader

VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())
POSITIVE = {v["name"]: v for v in VECTORS["positive"]}


def catsproto(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`catsproto ARGV` in this process: exit status, stdout, stderr."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse refusing the command line
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """Run ARGV; it must exit 2 with one line on stderr containing every one of `words`
    and print nothing on stdout."""
    status, out, err = catsproto(argv, capsys)
    assert status == 2, (status, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---- the codec: binary64 has one zero; messages ----------------------------------------


def _with_metric_value(value: float) -> bytes:
    """The metrics-ipv6 vector with its first L0 value (63.5) replaced by `value`."""
    data = bytes.fromhex(POSITIVE["metrics-ipv6"]["hex"])
    at = data.index(struct.pack(">d", 63.5))
    return data[:at] + struct.pack(">d", value) + data[at + 8 :]


def test_negative_zero_is_refused_where_positive_zero_decodes():
    plus = _with_metric_value(0.0)
    adv = wire.decode(plus)
    assert adv.metrics_l0.metrics[0].value == 0.0 and wire.encode(adv) == plus
    minus = _with_metric_value(-0.0)
    at = bytes.fromhex(POSITIVE["metrics-ipv6"]["hex"]).index(struct.pack(">d", 63.5))
    with pytest.raises(wire.BadValueError) as info:
        wire.decode(minus)
    assert (info.value.offset, info.value.tlv_type) == (at, 16)
    assert "value is -0.0" in str(info.value)


def test_negative_zero_is_refused_by_the_reference_decoder_too():
    minus = _with_metric_value(-0.0)
    with pytest.raises(wire.BadValueError, match=r"-0\.0"):
        wire.decode_from(Reader(minus))
    with pytest.raises(wire.BadValueError, match=r"-0\.0"):
        Reader(struct.pack(">d", -0.0)).f64("x")
    assert Reader(struct.pack(">d", 0.0)).f64("x") == 0.0


@pytest.mark.parametrize("value", [-0.0, float("nan"), float("inf")])
def test_from_json_refuses_what_decode_refuses(value):
    doc = json.loads(json.dumps(POSITIVE["metrics-ipv6"]["json"]))
    doc["metrics-l0"][0]["value"] = value
    with pytest.raises(wire.BadValueError) as info:
        wire.Advertisement.from_json(doc)
    assert "metrics-l0.metrics[0].value" in str(info.value)
    with pytest.raises(wire.BadValueError):
        wire.decode(_with_metric_value(value))


def test_negative_zero_vector_is_in_the_file():
    (vector,) = [v for v in VECTORS["negative"] if v["name"] == "metric-negative-zero"]
    with pytest.raises(wire.BadValueError) as info:
        wire.decode(bytes.fromhex(vector["hex"]))
    assert str(info.value) == vector["message"]


def test_truncation_message_counts_one_byte_in_the_singular():
    with pytest.raises(wire.TruncatedError, match="x needs 1 byte, only 0 remain"):
        Reader(b"").u8("x")
    with pytest.raises(wire.TruncatedError, match="x needs 2 bytes, only 1 remain"):
        Reader(b"\x00").u16("x")


@pytest.mark.parametrize("code", [[1], True, False, 1.0, "7", None, -1, 65536])
def test_unknown_tlv_type_must_be_an_integer_in_range(code, tmp_path, capsys):
    doc = json.loads(json.dumps(POSITIVE["unknown-tlv"]["json"]))
    doc["unknown"][0]["type"] = code
    with pytest.raises(wire.BadValueError, match=r"unknown\[0\]\.type must be an integer"):
        wire.Advertisement.from_json(doc)
    path = tmp_path / "adv.json"
    path.write_text(json.dumps(doc))
    refused(["encode", str(path)], capsys, "unknown[0].type", "0..65535", repr(code))


def test_unknown_tlv_refuses_a_bool_type():
    with pytest.raises(wire.BadValueError, match=r"outside 0\.\.65535"):
        wire.UnknownTLV(True, b"")
