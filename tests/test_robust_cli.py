"""Bad input to the codec, `decode`/`encode`/`vectors`/`sign`/`verify`, `eval` and
`inspect`: exit 2 with one line naming the field and the value, nothing written, no
traceback; and the codec's one canonical form for binary64 zero."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from catsproto import cli, wire
from catsproto.adapters.trace import TraceFormatError, load_scenario, parse_trace_line, read_trace
from catsproto.commands import UsageError, bytes_from_input
from catsproto.keys import BlockKeyer
from catsproto.sim import PreparedTrace, Scenario, ScenarioError, TraceRequest, apply_overrides
from catsproto.sim.scenario import SEED_MAX
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


# ---- decode / encode / vectors / sign / verify -------------------------------------------


def test_vectors_into_a_missing_folder_or_under_a_file_writes_nothing(tmp_path, capsys):
    regular = tmp_path / "file"
    regular.write_text("x")
    refused(["vectors", str(tmp_path / "missing")], capsys, "does not exist")
    refused(["vectors", str(regular / "sub")], capsys, str(regular / "sub"))
    refused(["vectors", str(regular)], capsys, "is not a directory")
    refused(["vectors", "--check", str(tmp_path / "missing")], capsys, "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert regular.read_text() == "x"


def test_vectors_writes_into_an_existing_folder(tmp_path, capsys):
    status, _, _ = catsproto(["vectors", str(tmp_path)], capsys)
    assert status == 0
    assert json.loads((tmp_path / "wire.json").read_text()) == VECTORS
    assert catsproto(["vectors", "--check", str(tmp_path)], capsys)[0] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["sign", "value.hex", "--key", "node.key", "--route", "192.0.2.10/32"],
        ["verify", "value.hex", "--trust", "trust.json", "--route", "192.0.2.10/32"],
        ["decode", "value.hex"],
        ["decode", "--attribute", "value.hex"],
        ["encode", "adv.json"],
        ["encode", "--attribute", "adv.json"],
        ["inspect", "capture.pcap"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
@pytest.mark.parametrize("code", ["999", "-1", "256", "x"])
def test_type_code_outside_one_octet_is_refused_on_the_command_line(argv, code, capsys):
    refused([*argv, "--type-code", code], capsys, "--type-code", code)


def test_type_codes_0_and_255_are_accepted(tmp_path, capsys):
    vector = POSITIVE["minimal-ipv4"]
    doc = tmp_path / "adv.json"
    doc.write_text(json.dumps(vector["json"]))
    for code in (0, 255):
        status, out, err = catsproto(
            ["encode", "--attribute", "--type-code", str(code), str(doc)], capsys
        )
        assert status == 0, err
        attr = bytes.fromhex(out.strip())
        assert attr[1] == code
        hexfile = tmp_path / f"attr{code}.hex"
        hexfile.write_text(attr.hex())
        status, out, err = catsproto(
            ["decode", "--attribute", "--type-code", str(code), "--compact", str(hexfile)], capsys
        )
        assert status == 0, err
        assert json.loads(out) == vector["json"]


def test_colon_separated_hex_decodes_like_plain_hex(tmp_path, capsys):
    vector = POSITIVE["cache-state"]
    data = bytes.fromhex(vector["hex"])
    pairs = [f"{b:02x}" for b in data]
    colon = ":".join(pairs)
    lines = "\n".join(":".join(pairs[i : i + 16]) for i in range(0, len(pairs), 16))
    for text in (colon, colon.upper(), "0x" + colon, lines + "\n", " ".join(pairs)):
        assert bytes_from_input(text.encode()) == data
        path = tmp_path / "value.hex"
        path.write_text(text)
        status, out, err = catsproto(["decode", "--compact", str(path)], capsys)
        assert status == 0, err
        assert json.loads(out) == vector["json"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("hello world", ["not hex", "'h' at character 1"]),
        ("0001 0001 01 ; version", ["not hex", "';' at character 14"]),
        ("00:01:0", ["colon-separated", "byte pairs"]),
        ("00::01", ["colon-separated"]),
        ("000:100", ["colon-separated"]),
        ("00:01:", ["colon-separated"]),
        ("abc", ["odd number of digits"]),
    ],
)
def test_printable_text_that_is_not_hex_is_refused(text, words, tmp_path, capsys):
    with pytest.raises(UsageError):
        bytes_from_input(text.encode())
    path = tmp_path / "value.txt"
    path.write_text(text)
    line = refused(["decode", str(path)], capsys, *words)
    assert "TLV" not in line  # not a codec error about TLVs read from ASCII codes


def test_raw_bytes_are_kept_as_they_are():
    for vector in VECTORS["positive"]:
        value = bytes.fromhex(vector["hex"])
        attr = bytes.fromhex(vector["attribute"])
        assert bytes_from_input(value) == value
        assert bytes_from_input(attr) == attr
    assert bytes_from_input(b"\x00abc:") == b"\x00abc:"  # a NUL: raw, not text


# ---- eval ------------------------------------------------------------------------------

GOOD_LINE = '{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'
RUN = ["--limit", "5", "--sweep-limit", "0", "--quiet", "--policies", "nearest"]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD_LINE + "\n" + GOOD_LINE.replace("3000", "6000") + "\n")
    return path


def test_a_good_trace_runs(trace, capsys):
    status, out, err = catsproto(["eval", "--trace", str(trace), *RUN], capsys)
    assert status == 0, err
    assert "nearest" in out


def test_non_utf8_trace_names_the_line(tmp_path, capsys):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + b'{"timestamp": 0, "x": "\xe9"}\n')
    with pytest.raises(TraceFormatError, match="trace line 2: not UTF-8"):
        read_trace(path)
    refused(["eval", "--trace", str(path), *RUN], capsys, "trace line 2", "not UTF-8")


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"timestamp": 1e400, "input_length": 1, "hash_ids": [1]}', ["timestamp", "inf"]),
        ('{"timestamp": NaN, "input_length": 1, "hash_ids": [1]}', ["timestamp", "nan"]),
        ('{"timestamp": 1e300, "input_length": 1, "hash_ids": [1]}', ["timestamp", "1e+300"]),
        ('{"timestamp": -1, "input_length": 1, "hash_ids": [1]}', ["timestamp", "-1"]),
        ('{"timestamp": true, "input_length": 1, "hash_ids": [1]}', ["timestamp", "True"]),
        ('{"timestamp": "5", "input_length": 1, "hash_ids": [1]}', ["timestamp", "'5'"]),
        ("[1, 2]", ["must be a JSON object, not list"]),
        ('{"timestamp": 0, "input_length": 5}', ["missing field 'hash_ids'"]),
        ('{"input_length": 5, "hash_ids": []}', ["missing field 'timestamp'"]),
        ('{"timestamp": 0, "input_length": 1.5, "hash_ids": []}', ["input_length", "1.5"]),
        ('{"timestamp": 0, "input_length": false, "hash_ids": []}', ["input_length", "False"]),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": -2, "hash_ids": []}',
            ["output_length", "-2"],
        ),
        ('{"timestamp": 0, "input_length": 1, "hash_ids": "12"}', ["hash_ids must be a list"]),
        ('{"timestamp": 0, "input_length": 1, "hash_ids": [1, true]}', ["hash_ids[1]", "True"]),
        (
            '{"timestamp": 0, "input_length": 1, "hash_ids": [18446744073709551616]}',
            ["hash_ids[0]", "18446744073709551616"],
        ),
        ("{not json", ["not JSON", "column 2"]),
    ],
)
def test_a_bad_trace_line_names_the_field_and_the_value(line, words, tmp_path, capsys):
    with pytest.raises(TraceFormatError) as info:
        parse_trace_line(line, 4)
    assert str(info.value).startswith("trace line 4: ")
    for word in words:
        assert word in str(info.value)
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD_LINE + "\n" + line + "\n")
    refused(["eval", "--trace", str(path), *RUN], capsys, "trace line 2", *words)


def test_trace_lines_keep_their_values():
    req = parse_trace_line(GOOD_LINE, 1)
    assert req == TraceRequest(3000.0, 600, 5, (0, 1))
    req = parse_trace_line('{"timestamp": 1.5, "input_length": 0, "hash_ids": []}', 1)
    assert req == TraceRequest(1.5, 0, 0, ())


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_speedup_must_be_finite_and_positive(value, trace, capsys):
    argv = ["eval", "--trace", str(trace), *RUN, f"--speedup={value}"]  # = keeps -inf a value
    refused(argv, capsys, "--speedup")


def test_a_speedup_that_overflows_the_clock_is_refused(trace, capsys):
    refused(["eval", "--trace", str(trace), *RUN, "--speedup", "1e-300"], capsys, "int64")
    keyer = BlockKeyer(b"0123456789abcdef", "m", 512)
    with pytest.raises(ValueError, match="not an arrival time"):
        PreparedTrace.build([TraceRequest(6000.0, 1, 0, (1,))], keyer, 4, 1e-300)
    with pytest.raises(ValueError, match="finite and > 0"):
        PreparedTrace.build([TraceRequest(6000.0, 1, 0, (1,))], keyer, 4, float("nan"))


@pytest.mark.parametrize("doc", ["[1]", "3", "null", '"s1"'])
def test_a_scenario_must_be_a_mapping(doc, trace, tmp_path, capsys):
    path = tmp_path / "scenario.json"
    path.write_text(doc)
    with pytest.raises(TraceFormatError, match="must be a JSON object"):
        load_scenario(path)
    refused(["eval", "--trace", str(trace), "--scenario", str(path), *RUN], capsys, str(path))
    with pytest.raises(ScenarioError, match="must be a mapping"):
        Scenario.from_mapping(json.loads(doc))
    with pytest.raises(ScenarioError, match="must be a mapping"):
        apply_overrides(json.loads(doc), ["seed=2"])


def test_a_non_utf8_scenario_is_refused(trace, tmp_path, capsys):
    path = tmp_path / "scenario.toml"
    path.write_bytes(b'name = "\xe9"\n')
    refused(["eval", "--trace", str(trace), "--scenario", str(path), *RUN], capsys, "not UTF-8")


def test_report_into_a_file_or_an_impossible_folder_fails_before_the_runs(trace, tmp_path, capsys):
    regular = tmp_path / "results"
    regular.write_text("keep")
    for target in (regular, regular / "sub", Path("/proc/catsproto-no-such-dir")):
        # stdout stays empty: the table is printed after the runs, so none ran
        refused(["eval", "--trace", str(trace), *RUN, "--report", str(target)], capsys, "--report")
    assert regular.read_text() == "keep"


def test_report_folder_is_made_when_missing(trace, tmp_path, capsys):
    out = tmp_path / "a" / "b"
    status, _, err = catsproto(["eval", "--trace", str(trace), *RUN, "--report", str(out)], capsys)
    assert status == 0, err
    assert (out / "results.json").is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["--seed", "-1"],
        ["--seed", str(SEED_MAX + 1)],
        ["--set", "seed=-1"],
        ["--set", f"seed={SEED_MAX + 1}"],
        ["--set", "seed=true"],
        ["--set", "seed=1.5"],
        ["--set", "seed=x"],
        ["--seeds", f"1,{SEED_MAX + 1}"],
    ],
)
def test_seeds_outside_0_to_2_64_are_refused(argv, trace, capsys):
    refused(["eval", "--trace", str(trace), *RUN, *argv], capsys, "seed", str(SEED_MAX))


def test_the_largest_seeds_run(trace, capsys):
    policies = ["--policies", "random", "catsproto"]
    argv = ["eval", "--trace", str(trace), *RUN, *policies, "--seed", str(SEED_MAX)]
    status, _, err = catsproto([*argv, "--set", f"seed={SEED_MAX}"], capsys)
    assert status == 0, err
    status, _, err = catsproto([*argv, "--set", "seed=0"], capsys)
    assert status == 0, err


# ---- inspect ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--count", "-1"),
        ("--count", "x"),
        ("--timeout", "-1"),
        ("--timeout", "nan"),
        ("--timeout", "inf"),
    ],
)
def test_inspect_count_and_timeout_must_be_non_negative(option, value, tmp_path, capsys):
    refused(["inspect", str(tmp_path / "c.pcap"), option, value], capsys, option, value)


def test_inspect_says_a_directory_is_a_directory(tmp_path, capsys):
    refused(["inspect", str(tmp_path)], capsys, "is a directory")
    refused(["inspect", str(tmp_path / "missing.pcap")], capsys, "no such file")
