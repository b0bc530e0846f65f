"""`catsproto inspect` on damaged captures: pcap, pcapng and gzip files cut short at many
offsets, corrupt gzip data, pcapng blocks with wrong lengths, and a stream over a pipe.

Every capture is written by scapy's own writers (pcapng then compressed with the gzip
module, as `gzip` would) from real UPDATEs carrying our attribute. The oracle for what
a damaged file must show is the same capture written whole with only the packets before
the damage: exactly those advertisements, one line on stderr saying where (and no line of
scapy's), exit 1; stderr is read at the file descriptor, where scapy's logger writes."""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import PcapNgWriter, PcapWriter

from catsproto.adapters import pcap
from catsproto.cli import main
from tests.test_inspect import FLOW, MSGS, _segments

STREAM = b"".join(MSGS[:-1] * 2)  # twelve UPDATEs of 100 to 500 bytes, twice
PACKET_BLOCKS = (2, 3, 6)


def _packets() -> list:
    pkts = []
    for seg in _segments(STREAM, 300):
        pkt = Ether() / IP(src=FLOW[0], dst=FLOW[2]) / TCP(
            sport=FLOW[1], dport=FLOW[3], seq=seg.seq, flags="S" if seg.syn else "PA"
        ) / seg.payload  # fmt: skip
        pkt.time = 1_795_000_000 + seg.time / 1e6
        pkts.append(pkt)
    return pkts


PKTS = _packets()


def _write(path: Path, kind: str, count: int | None = None) -> bytes:
    """The first `count` packets (all by default) as a `kind` capture; its bytes."""
    pkts = PKTS[:count]
    plain = path.with_suffix(".plain")
    writer = PcapNgWriter(str(plain)) if kind.startswith("pcapng") else PcapWriter(str(plain))
    for pkt in pkts:
        writer.write(pkt)
    if not pkts:  # scapy writes the header with the first packet
        writer.linktype = 1  # Ethernet
        writer._write_header(None)
    writer.close()
    data = plain.read_bytes()
    if kind.endswith(".gz"):
        with gzip.open(path, "wb") as out:  # the file name goes in the header, as gzip(1)
            out.write(data)
        return path.read_bytes()
    path.write_bytes(data)
    return data


def _records(data: bytes) -> list[tuple[int, int, bool]]:
    """(start, end, is a packet) of every record of a whole capture: the pcap header and
    packet records, or the pcapng blocks."""
    if data[:4] != b"\x0a\x0d\x0d\x0a":
        out, at = [(0, 24, False)], 24
        while at < len(data):
            end = at + 16 + struct.unpack("<I", data[at + 8 : at + 12])[0]
            out.append((at, end, True))
            at = end
        return out
    out, at = [], 0
    while at < len(data):
        kind, length = struct.unpack("<II", data[at : at + 8])
        out.append((at, at + length, kind in PACKET_BLOCKS))
        at += length
    return out


def _inspect(path: Path, capfd) -> tuple[int, list[dict], str]:
    code = main(["inspect", str(path), "--json"])
    out, err = capfd.readouterr()
    return code, json.loads(out)["advertisements"] if out else [], err


def _shown_by_whole(tmp_path: Path, kind: str, count: int, capfd) -> list[dict]:
    path = tmp_path / f"whole-{count}.{kind}"
    _write(path, kind, count)
    code, ads, err = _inspect(path, capfd)
    assert code == 0 and err == "", err
    return ads


def _one_line(err: str, path: Path, level: str, kind: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    head = f"catsproto inspect: {level}: {path}: {kind}: "
    assert err.startswith(head), err
    assert "WARNING" not in err and "Traceback" not in err
    return err[len(head) :].strip()


# ---- cut short: plain files -------------------------------------------------------------

# (which record: an index into the packet records, or "header"; bytes into it)
PLACES = [("header", 10), (0, 5), (0, 16), (7, 3), (7, 30), (-1, 15), (-1, -1)]


@pytest.mark.parametrize("kind", ["pcap", "pcapng"])
@pytest.mark.parametrize(("record", "into"), PLACES)
def test_a_capture_cut_short_shows_what_precedes_the_cut_and_says_where(
    tmp_path, capfd, kind, record, into
):
    data = _write(tmp_path / f"all.{kind}", kind)
    records = _records(data)
    packets = [r for r in records if r[2]]
    start, end, _ = records[0] if record == "header" else packets[record]
    cut = (end if into < 0 else start) + into
    before = sum(1 for r in packets if r[1] <= cut)
    path = tmp_path / f"cut.{kind}"
    path.write_bytes(data[:cut])
    code, ads, err = _inspect(path, capfd)
    assert code == 1
    assert ads == _shown_by_whole(tmp_path, kind, before, capfd)
    said = _one_line(err, path, "warning", "truncated")
    if record == "header":
        header = "section header block (pcapng block 1, at byte 0)" if kind == "pcapng" else (
            "the pcap file header (10 of 24"
        )  # fmt: skip
        assert header in said and said.endswith("no packet record comes before it")
    elif 0 <= into < (8 if kind == "pcapng" else 16):  # the record's header is cut
        assert f"the file ends with {into} bytes after " in said and f"from byte {start}" in said
        shown = "what came before them is shown" if before else "no packet record comes before them"
        assert said.endswith(shown)
    else:
        assert said.startswith(f"packet record {before + 1} (") and f"at byte {start})" in said
        assert f"is cut short (the file ends inside it, {cut - start} of {end - start} " in said


def test_a_cut_inside_a_later_section_header_block(tmp_path, capfd):
    """Two sections one after the other (as `cat a.pcapng b.pcapng`), the file cut inside
    the second one's section header block."""
    data = _write(tmp_path / "a.pcapng", "pcapng")
    path = tmp_path / "two.pcapng"
    path.write_bytes(data + data[:20])
    code, ads, err = _inspect(path, capfd)
    assert code == 1 and ads == _shown_by_whole(tmp_path, "pcapng", len(PKTS), capfd)
    blocks = len(_records(data))
    said = _one_line(err, path, "warning", "truncated")
    assert said.startswith(
        f"the section header block (pcapng block {blocks + 1}, at byte {len(data)}) is cut "
        "short (the file ends inside it, 20 of 28 bytes there)"
    )


# ---- cut short: gzip ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pcap.gz", "pcapng.gz"])
@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.93])
def test_a_gzip_capture_cut_inside_its_compressed_data(tmp_path, capfd, kind, fraction):
    packed = _write(tmp_path / f"all.{kind}", kind)
    plain = gzip.decompress(packed)
    cut = int(len(packed) * fraction)
    got = len(zlib.decompressobj(31).decompress(packed[:cut]))  # all that can come out
    packets = [r for r in _records(plain) if r[2]]
    before = sum(1 for r in packets if r[1] <= got)
    path = tmp_path / f"cut.{kind}"
    path.write_bytes(packed[:cut])
    code, ads, err = _inspect(path, capfd)
    assert code == 1
    assert ads == _shown_by_whole(tmp_path, kind, before, capfd)
    said = _one_line(err, path, "warning", "truncated")
    assert said.startswith(
        f"the gzip file ends at byte {cut} inside its compressed data, after {got} bytes "
        "of capture; "
    )
    # the decompressed data ends inside a record, or (by chance) just after one
    assert f"packet record {before + 1} (" in said or f"({before} whole packet records)" in said


@pytest.mark.parametrize("kind", ["pcap.gz", "pcapng.gz"])
@pytest.mark.parametrize("lost", [1, 5, 8])
def test_a_gzip_capture_without_its_trailer(tmp_path, capfd, kind, lost):
    packed = _write(tmp_path / f"all.{kind}", kind)
    path = tmp_path / f"cut.{kind}"
    path.write_bytes(packed[:-lost])
    code, ads, err = _inspect(path, capfd)
    whole = _shown_by_whole(tmp_path, kind, len(PKTS), capfd)
    assert code == 1 and ads == whole
    assert len(whole) == 2 * (len(MSGS) - 1)  # and the same as plain pcap shows
    assert whole == _shown_by_whole(tmp_path, "pcap", len(PKTS), capfd)
    said = _one_line(err, path, "warning", "truncated")
    assert said == (
        f"the gzip file ends at byte {len(packed) - lost} inside its trailer ({8 - lost} of "
        "the 8 bytes of CRC-32 and size there), so the data cannot be checked; what was read "
        f"({len(PKTS)} whole packet records) is shown"
    )


# ---- corrupt gzip ------------------------------------------------------------------------


def _header_len(packed: bytes) -> int:
    assert packed[3] == 0x08  # only FNAME, as the gzip module writes it
    return packed.index(0, 10) + 1


def test_a_gzip_capture_whose_crc_or_size_is_wrong(tmp_path, capfd):
    packed = _write(tmp_path / "all.pcap.gz", "pcap.gz")
    whole = _shown_by_whole(tmp_path, "pcap.gz", len(PKTS), capfd)
    for at, words in ((-8, "the gzip CRC-32 check fails (the trailer at byte"),
                      (-2, "the gzip trailer at byte")):  # fmt: skip
        bad = bytearray(packed)
        bad[at] ^= 0x5A
        path = tmp_path / "bad.pcap.gz"
        path.write_bytes(bytes(bad))
        code, ads, err = _inspect(path, capfd)
        assert code == 1 and ads == whole
        said = _one_line(err, path, "error", "corrupt")
        assert said.startswith(f"{words} {len(packed) - 8}")


def test_garbage_right_after_the_gzip_header_is_a_usage_error(tmp_path, capfd):
    packed = _write(tmp_path / "all.pcap.gz", "pcap.gz")
    end = _header_len(packed)
    path = tmp_path / "garbage.pcap.gz"
    path.write_bytes(packed[:end] + b"\xff" * 300)
    assert main(["inspect", str(path)]) == 2
    out, err = capfd.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"catsproto inspect: {path} is a gzip file whose capture cannot be read")
    assert f"stops being valid deflate within bytes {end}-{end + 64} (invalid block type)" in err


def test_garbage_inside_or_after_the_gzip_data_is_an_error_line(tmp_path, capfd):
    packed = _write(tmp_path / "all.pcap.gz", "pcap.gz")
    whole = _shown_by_whole(tmp_path, "pcap.gz", len(PKTS), capfd)
    middle = len(packed) // 2
    inside = tmp_path / "inside.pcap.gz"
    inside.write_bytes(packed[:middle] + b"\xff" * 64 + packed[middle + 64 :])
    code, ads, err = _inspect(inside, capfd)
    said = _one_line(err, inside, "error", "corrupt")
    assert code == 1 and "gzip" in said
    assert 0 < len(ads) < len(whole) and ads == whole[: len(ads)]
    after = tmp_path / "after.pcap.gz"
    after.write_bytes(packed + b"\0\0not gzip")
    code, ads, err = _inspect(after, capfd)
    assert code == 1 and ads == whole
    assert _one_line(err, after, "error", "corrupt") == (
        f"the bytes from {len(packed) + 2} on, after the end of the gzip data, are not gzip; "
        f"what was read ({len(PKTS)} whole packet records) is shown"
    )
    padded = tmp_path / "padded.pcap.gz"  # zero padding after the data is no damage
    padded.write_bytes(packed + b"\0" * 100)
    assert _inspect(padded, capfd) == (0, whole, "")


# ---- pcapng blocks with a wrong length ---------------------------------------------------


def _poke(data: bytes, at: int, value: int) -> bytes:
    return data[:at] + struct.pack("<I", value) + data[at + 4 :]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("longer", "its two length fields disagree ({n} at the start, 6 at the end)"),
        ("shorter", "its two length fields disagree ({n} at the start, "),
        ("closing", "its two length fields disagree ({m} at the start, {n} at the end)"),
        ("odd", "gives its length as {n} bytes (a block is a multiple of 4 bytes, 12 to "),
        ("tiny", "gives its length as 8 bytes (a block is a multiple of 4 bytes, 12 to "),
        ("huge", "gives its length as 2147483648 bytes (a block is a multiple of 4 "),
        ("caplen", "is too short for the captured length it gives (4000 bytes in a block"),
    ],
)
def test_a_pcapng_block_with_a_wrong_length_is_an_error_line(tmp_path, capfd, change, words):
    data = _write(tmp_path / "all.pcapng", "pcapng")
    packets = [r for r in _records(data) if r[2]]
    start, end, _ = packets[9]
    length = end - start
    new = {"longer": length + 4, "shorter": length - 4, "closing": length + 8,
           "odd": length + 1, "tiny": 8, "huge": 1 << 31, "caplen": 4000}[change]  # fmt: skip
    at = {"closing": end - 4, "caplen": start + 20}.get(change, start + 4)
    path = tmp_path / "bad.pcapng"
    path.write_bytes(_poke(data, at, new))
    code, ads, err = _inspect(path, capfd)
    assert code == 1 and ads == _shown_by_whole(tmp_path, "pcapng", 9, capfd)
    said = _one_line(err, path, "error", "corrupt")
    assert said.startswith(
        f"packet record 10 (pcapng block {packets.index((start, end, True)) + 3}, "
        f"enhanced packet block, at byte {start})"
    )
    assert words.format(n=new, m=length) in said and said.endswith("what came before it is shown")


def test_a_block_whose_contents_the_reader_cannot_parse(tmp_path, capfd):
    """Lengths that agree around a body scapy's reader gives up on (an interface block
    of 4 bytes): it stops there in silence; we say where."""
    data = _write(tmp_path / "all.pcapng", "pcapng")
    packets = [r for r in _records(data) if r[2]]
    at = packets[4][1]
    path = tmp_path / "odd.pcapng"
    path.write_bytes(data[:at] + struct.pack("<IIII", 1, 16, 0, 16) + data[at:])
    code, ads, err = _inspect(path, capfd)
    assert code == 1 and ads == _shown_by_whole(tmp_path, "pcapng", 5, capfd)
    said = (
        f"the reader stopped at pcapng block 8 (interface description block, at byte {at}), "
        "whose contents it could not make sense of; what came before it is shown"
    )
    assert _one_line(err, path, "error", "corrupt") == said
    # in a process of its own, where scapy's logger has the real stderr: not its
    # "WARNING: PcapNg: IDB is too small" line as well
    run = subprocess.run(
        [sys.executable, "-m", "catsproto", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and run.stderr == f"{err.splitlines()[0]}\n"


def test_a_pcap_record_claiming_more_than_a_capture_holds(tmp_path, capfd):
    data = _write(tmp_path / "all.pcap", "pcap")
    start = [r for r in _records(data) if r[2]][6][0]
    path = tmp_path / "huge.pcap"
    path.write_bytes(_poke(data, start + 8, 0xFFFFFFF0))
    code, ads, err = _inspect(path, capfd)
    assert code == 1 and ads == _shown_by_whole(tmp_path, "pcap", 6, capfd)
    assert _one_line(err, path, "error", "corrupt") == (
        f"packet record 7 (at byte {start}) claims 4294967280 captured bytes, more than the "
        "262144 a capture can hold; what came before it is shown"
    )


# ---- a stream, as --follow reads tcpdump ---------------------------------------------------


def _over_a_pipe(payload: bytes) -> tuple[list[dict], list]:
    """inspect_capture reading `payload` from a pipe written in pieces, as from tcpdump."""
    read, write = os.pipe()

    def feed() -> None:
        with os.fdopen(write, "wb") as out:
            for at in range(0, len(payload), 777):
                out.write(payload[at : at + 777])
                out.flush()

    writer = threading.Thread(target=feed)
    writer.start()
    streams = pcap.BGPStreams()
    try:
        with os.fdopen(read, "rb") as stream:
            got = [f.to_json() for f in pcap.inspect_capture(stream, streams=streams)]
    finally:
        writer.join()
    return got, streams.capture_notes


def _from_file(path: Path) -> list[dict]:
    streams = pcap.BGPStreams()
    found = [f.to_json() for f in pcap.inspect_capture(path, streams=streams)]
    assert streams.capture_notes == [] and not streams.problems
    return found


@pytest.mark.parametrize("kind", ["pcap", "pcap.gz"])
def test_a_capture_stream_over_a_pipe_whole_and_cut_short(tmp_path, kind):
    """What --follow reads: tcpdump's stream. Whole, it is read as the file is; cut
    short, the note says where, as for a file (a gzip stream needs no seeking)."""
    data = _write(tmp_path / f"all.{kind}", kind)
    assert _over_a_pipe(data) == (_from_file(tmp_path / f"all.{kind}"), [])
    before = _from_file(Path(_write(tmp_path / f"less.{kind}", kind, len(PKTS) - 1) and
                             tmp_path / f"less.{kind}"))  # fmt: skip
    if kind == "pcap":
        start = [r for r in _records(data) if r[2]][-1][0]
        got, notes = _over_a_pipe(data[: start + 20])  # inside the last record
        assert got == before and [str(n) for n in notes] == [
            f"truncated: packet record {len(PKTS)} (at byte {start}) is cut short (the file "
            "ends inside it, 20 of "
            f"{len(data) - start} bytes there); what came before it is shown"
        ]
    else:
        got, notes = _over_a_pipe(data[:-30])
        assert got == before and len(notes) == 1
        assert str(notes[0]).startswith(f"truncated: the gzip file ends at byte {len(data) - 30} ")
