"""`catsproto inspect` and the pcap adapter: reassembly units, then a real lab capture."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from catsproto import wire
from catsproto.adapters import pcap
from catsproto.cli import main
from catsproto.examples import examples, large_advertisement
from catsproto.wire.bgp import build_update
from tests.lab_captures import EXPECTED, LARGE_BODY, lab_capture, require_root

FLOW = ("10.0.0.1", 40000, "10.0.0.2", 179)


def _update(value: bytes, prefix: str = "10.255.0.1/32") -> bytes:
    return build_update(
        [ipaddress.ip_network(prefix)],
        ipaddress.ip_address("10.0.0.1"),
        [wire.encode_attribute(value)],
        as_path=(65001,),
    )


def _segments(stream: bytes, size: int, isn: int = 1000, syn: bool = True) -> list[pcap.Segment]:
    segs = [pcap.Segment(0.0, FLOW, isn, True, False, False, b"")] if syn else []
    for at in range(0, len(stream), size):
        segs.append(
            pcap.Segment(float(at), FLOW, (isn + 1 + at) % 2**32, False, False, False,
                         stream[at : at + size])
        )  # fmt: skip
    return segs


def _messages(segs: list[pcap.Segment]) -> tuple[list[bytes], pcap.BGPStreams]:
    streams = pcap.BGPStreams()
    return [m.data for m in pcap.bgp_messages(segs, streams)], streams


# ---- reassembly and framing, no root needed ----------------------------------------------

BIG = _update(wire.encode(large_advertisement(60_000)))  # an extended message
MSGS = [_update(wire.encode(ex.advertisement), f"10.255.0.{i}/32") for i, ex in
        enumerate(examples(), 1)] + [BIG]  # fmt: skip
STREAM = b"".join(MSGS)


def test_big_update_is_an_extended_message():
    assert 4096 < len(BIG) <= 65535


@pytest.mark.parametrize("size", [1, 7, 1448, 9000, 70_000])
def test_messages_come_back_whole_whatever_the_segment_size(size):
    got, streams = _messages(_segments(STREAM, size))
    assert got == MSGS and not streams.problems


def test_out_of_order_retransmitted_and_overlapping_segments():
    segs = _segments(STREAM, 700, isn=2**32 - 5000)  # sequence numbers wrap too
    shuffled = [segs[0], *reversed(segs[1:40]), *segs[40:]]
    # retransmit a few, and one segment that overlaps the next by half
    s = segs[50]
    overlap = pcap.Segment(
        1.0, FLOW, s.seq, False, False, False, s.payload + segs[51].payload[:700]
    )
    noisy = [*shuffled[:45], segs[3], segs[10], overlap, *shuffled[45:], segs[60]]
    got, streams = _messages(noisy)
    assert got == MSGS and not streams.problems


def test_capture_started_mid_connection_synchronises_on_a_marker():
    start = len(MSGS[0]) + 5  # in the middle of the second message
    got, _ = _messages(_segments(STREAM[start:], 1000, syn=False))
    assert got == MSGS[2:]


def test_broken_marker_is_reported_and_skipped():
    broken = MSGS[0] + b"\x00" * 10 + MSGS[1]
    got, streams = _messages(_segments(broken, 100))
    assert got == [MSGS[0], MSGS[1]]
    assert "marker" in streams.problems[0].reason


def _write_pcap(path: Path, stream: bytes, size: int = 1448) -> None:
    pkts = []
    for seg in _segments(stream, size):
        flags = "S" if seg.syn else "PA"
        pkt = Ether() / IP(src=FLOW[0], dst=FLOW[2]) / TCP(
            sport=FLOW[1], dport=FLOW[3], seq=seg.seq, flags=flags
        ) / seg.payload  # fmt: skip
        pkt.time = 1_795_000_000 + seg.time / 1e6
        pkts.append(pkt)
    wrpcap(str(path), pkts)


def test_malformed_attribute_is_listed_with_the_codec_error(tmp_path, capsys):
    bad = bytes.fromhex("0001000901")  # a negative vector: length exceeds input
    _write_pcap(tmp_path / "bad.pcap", _update(bad) + MSGS[0])
    assert main(["inspect", str(tmp_path / "bad.pcap"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)["advertisements"]
    assert [a["status"] for a in out] == ["malformed", "not-checked"]
    err = out[0]["error"]
    assert err["kind"] == "BadLengthError" and err["offset"] == 4 and err["tlv_type"] == 1
    assert err["message"] == "version TLV at offset 4: TLV value length 9 exceeds remaining 1 bytes"
    assert err["action"] == "treat-as-withdraw"
    assert out[1]["advertisement"] == examples()[0].advertisement.to_json()


def test_a_truncated_capture_is_shown_up_to_the_cut_with_our_warning_and_exit_1(tmp_path, capsys):
    """A pcap cut short (inside a packet record, or after a part of a record header) is
    read up to the cut; one warning of ours on stderr says so (not scapy's unprefixed
    WARNING line) and the exit status is 1. The whole file is exit 0 and no warning."""
    whole = tmp_path / "whole.pcap"
    _write_pcap(whole, b"".join(MSGS), size=200)
    data = whole.read_bytes()
    assert main(["inspect", str(whole)]) == 0
    assert capsys.readouterr().err == ""
    inside = tmp_path / "inside.pcap"
    inside.write_bytes(data[:-5])  # the last packet record loses 5 bytes
    header = tmp_path / "header.pcap"
    header.write_bytes(data + data[24:32])  # 8 bytes of a next record header, no more
    for cut, words in ((inside, "is cut short"), (header, "8 bytes after packet record")):
        assert main(["inspect", str(cut)]) == 1
        out, err = capsys.readouterr()
        assert err.splitlines() == [err.strip()], err  # one line
        assert err.startswith(f"catsproto inspect: warning: {cut}: truncated: ") and words in err
        assert "advertisement(s)" in out and "WARNING" not in err
    assert main(["inspect", str(inside), "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["advertisements"]) >= len(MSGS) - 1


def test_a_file_that_is_not_a_capture_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "x.pcap").write_bytes(b"not a capture at all")
    assert main(["inspect", str(tmp_path / "x.pcap")]) == 2
    assert "not a pcap" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.pcap")]) == 2
    assert main(["inspect"]) == 2
    with pytest.raises(SystemExit) as refused:  # --type-code is checked while parsing
        main(["inspect", str(tmp_path / "x.pcap"), "--type-code", "300"])
    assert refused.value.code == 2


# ---- a real capture: ExaBGP to ExaBGP through the kernel, tcpdump ------------------------


@pytest.fixture(scope="module")
def lab():
    require_root()
    return lab_capture()


def _by_prefix(out: str) -> dict[str, dict]:
    return {a["prefix"]: a for a in json.loads(out)["advertisements"]}


def test_lab_capture_every_advertisement_verified_and_the_bad_ones_flagged(lab, capsys):
    code = main(["inspect", str(lab.pcap), "--trust", str(lab.trust), "--json"])
    seen = _by_prefix(capsys.readouterr().out)
    assert {p: a["status"] for p, a in seen.items()} == EXPECTED
    assert code == 1  # something was refused
    assert "does not verify for route 10.255.9.1/32" in seen["10.255.9.1/32"]["detail"]
    err = seen["10.255.9.3/32"]["error"]
    assert err["kind"] == "BadLengthError" and err["tlv_type"] == 255
    assert err["message"].endswith("TLV value length 74 exceeds remaining 72 bytes")
    with pytest.raises(wire.BadLengthError) as info:
        wire.decode(lab.values["10.255.9.3/32"])
    assert err["message"] == str(info.value) and err["offset"] == info.value.offset
    # what was on the wire is exactly what was announced, the 20 KB one included
    for prefix, adv in seen.items():
        if adv["status"] != "malformed":
            assert adv["length"] == len(lab.values[prefix])
            assert adv["advertisement"] == wire.decode(lab.values[prefix]).to_json()
    big = seen["10.255.0.3/32"]["advertisement"]["cache-summaries"][0]
    assert len(bytes.fromhex(big["body"])) == LARGE_BODY
    assert seen["10.255.0.1/32"]["flags"] == "0xd0" and seen["10.255.0.1/32"]["partial"] is False


def test_lab_capture_table_and_group_key(lab, capsys):
    main(["inspect", str(lab.pcap), "--trust", str(lab.trust)])
    table = capsys.readouterr().out
    line = next(r for r in table.splitlines() if "10.255.0.2/32" in r)
    assert "sealed" in line and line.rstrip().endswith("verified")
    assert "bad-signature: signature TLV: Ed25519 signature by key" in table
    assert "unknown-key: signing key" in table
    summary = "1 bad-signature, 1 malformed, 1 unknown-key, 4 verified"
    assert f"7 advertisement(s) of attribute type 255: {summary}" in table
    main(["inspect", str(lab.pcap), "--trust", str(lab.trust), "--group-key", str(lab.group_key)])
    line = next(r for r in capsys.readouterr().out.splitlines() if "10.255.0.2/32" in r)
    assert "hbm:exact,dram:exact" in line and " 116 " in line  # 8*2 + 100 blocks, opened


def test_lab_capture_jsonl_and_a_wrong_type_code(lab, capsys):
    main(["inspect", str(lab.pcap), "--jsonl"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 7 and {x["prefix"] for x in lines} == set(EXPECTED)
    assert main(["inspect", str(lab.pcap), "--type-code", "254"]) == 0
    assert "0 advertisement(s) of attribute type 254" in capsys.readouterr().out


def test_follow_a_live_interface_in_a_namespace(tmp_path):
    require_root()
    from catsproto.adapters.capture import Announcement, record_capture

    values = {f"10.255.0.{i}/32": wire.encode(ex.advertisement) for i, ex in
              enumerate(examples(), 1)}  # fmt: skip
    values["10.255.1.1/32"] = wire.encode(large_advertisement(30_000))
    started: dict = {}

    def attach(ns: str, ifname: str) -> None:
        argv = [sys.executable, "-m", "catsproto", "inspect", "--follow", ifname, "--netns", ns,
                "--jsonl", "--count", str(len(values)), "--timeout", "30"]  # fmt: skip
        proc = started["proc"] = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started["out"], started["err"] = [], []
        listening = threading.Event()

        def relay_err() -> None:
            for line in proc.stderr:
                started["err"].append(line)
                if "listening on" in line:
                    listening.set()

        threading.Thread(target=lambda: started["out"].extend(proc.stdout), daemon=True).start()
        threading.Thread(target=relay_err, daemon=True).start()
        # tcpdump inside the follower must be listening before BGP starts
        assert listening.wait(20), f"tcpdump never said it was listening: {started['err']}"

    anns = [Announcement(ipaddress.IPv4Network(p), v) for p, v in values.items()]
    proc = None
    try:
        record_capture(tmp_path / "unused.pcap", anns, before_peering=attach)
        proc = started["proc"]
        proc.wait(timeout=30)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    seen = [json.loads(x) for x in started["out"]]
    assert {x["prefix"] for x in seen} == set(values)
    # tcpdump's lines are passed on with one prefix (they used to read "tcpdump: tcpdump:")
    assert any(line.startswith("tcpdump: listening on ") for line in started["err"])
    assert not any("tcpdump: tcpdump:" in line for line in started["err"]), started["err"]
    for x in seen:
        assert x["advertisement"] == wire.decode(values[x["prefix"]]).to_json()


@pytest.mark.parametrize(
    ("where", "words"),
    [
        (["--follow", "nosuchif0"], "cannot capture on nosuchif0: "),
        (
            ["--follow", "lo", "--netns", "nosuchns0"],
            "cannot capture on lo in namespace nosuchns0: ",
        ),
    ],
)
def test_follow_on_an_interface_or_namespace_that_is_not_there_is_one_line(where, words):
    """tcpdump (or `ip netns exec`) failing before it listens is a one-line error in its
    own words, exit 2 (it was scapy's "No data could be read!" traceback)."""
    require_root()
    proc = subprocess.run(
        [sys.executable, "-m", "catsproto", "inspect", *where, "--timeout", "20"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"catsproto inspect: {words}") and proc.stderr.count("\n") == 1
    assert ("No such" in proc.stderr or "Cannot open" in proc.stderr) and proc.stdout == ""
