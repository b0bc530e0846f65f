"""The Lua dissector's expert info under tshark: it flags exactly what the codec refuses.

A seeded corpus of mutated vectors (overwritten, cut and inserted bytes) goes through
real tshark in one capture; every attribute the codec refuses must carry an expert info
and every attribute it accepts none. Hand-made cases pin the messages of the rules the
dissector checks, the registry names it shows and the IPv6 route of an MP_REACH_NLRI.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import random
import re
import subprocess
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from catsproto import wire
from catsproto.wire.bgp import build_update
from tests.test_dissector import LUA, _list, _tshark, tshark_trees
from tests.test_error_actions import CACHE_MODEL, CAP, HEADER, L0

VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())
# explicit addresses: without them scapy looks the MAC up for every packet (slow)
ETHER = Ether(dst="02:00:00:00:00:02", src="02:00:00:00:00:01")
ALL_VALUES = [bytes.fromhex(v["hex"]) for v in VECTORS["positive"] + VECTORS["negative"]]


def _pcap(
    path: Path, values: list[bytes], mp_reach: bytes | None = None, flags: list[int] | None = None
) -> Path:
    """One UPDATE per value (attribute 255, extended length; flags 0xD0 unless `flags`
    gives one per value), on one TCP flow."""
    pkts, seq = [], 1
    nlri = [] if mp_reach else [ipaddress.ip_network("10.0.1.0/24")]
    for i, value in enumerate(values):
        flag = 0xD0 if flags is None else flags[i]
        attrs = [bytes([flag, 255]) + len(value).to_bytes(2, "big") + value]
        if mp_reach is not None:
            attrs.insert(0, mp_reach)
        msg = build_update(nlri, ipaddress.ip_address("192.0.2.1"), attrs, (65001,))
        tcp = TCP(sport=179, dport=40000, flags="PA", seq=seq)
        pkts.append(ETHER / IP(src="192.0.2.1", dst="192.0.2.2") / tcp / msg)
        seq += len(msg)
    wrpcap(str(path), pkts)
    return path


MALFORMED_GROUP = 0x07000000  # Wireshark's PI_MALFORMED: the refusals
UNDECODED_GROUP = 0x05000000  # PI_UNDECODED: the note on an unknown sealing algorithm
WARN_SEVERITY = 0x00600000  # PI_WARN: the flags lacking Optional or Transitive


def _experts(pcap: Path) -> list[list[tuple[str, int]]]:
    """The (message, group) of every expert info of each frame, in frame order."""
    argv = [_tshark(), "-X", f"lua_script:{LUA}", "-r", str(pcap), "-T", "fields"]
    argv += ["-e", "_ws.expert.message", "-e", "_ws.expert.group"]
    argv += ["-E", "occurrence=a", "-E", "aggregator=|"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    assert "Lua Error" not in out.stdout + out.stderr
    frames = []
    for line in out.stdout.split("\n")[:-1]:
        messages, groups = line.split("\t")
        pairs = zip(messages.split("|"), groups.split("|"), strict=True) if groups else ()
        frames.append([(m, int(g)) for m, g in pairs])
    return frames


def _expert_messages(pcap: Path) -> list[str]:
    """The refusals (malformed-group expert infos) of each frame, '|'-joined ('' when
    none), in frame order; notes of other groups are not refusals."""
    return ["|".join(m for m, g in frame if g == MALFORMED_GROUP) for frame in _experts(pcap)]


def _mutations(seed: int = 10, per_value: int = 40) -> list[bytes]:
    rnd = random.Random(seed)
    out = []
    for value in ALL_VALUES:
        for _ in range(per_value):
            b = bytearray(value)
            for _ in range(rnd.randint(1, 3)):
                op = rnd.random()
                if op < 0.6 and b:
                    b[rnd.randrange(len(b))] = rnd.randrange(256)
                elif op < 0.8 and b:
                    del b[rnd.randrange(len(b)) :]
                else:
                    b.insert(rnd.randrange(len(b) + 1), rnd.randrange(256))
            out.append(bytes(b))
    return out


def _refused(value: bytes) -> bool:
    try:
        wire.decode(value)
    except wire.CodecError:
        return True
    return False


def test_tshark_flags_exactly_the_attributes_the_codec_refuses(tmp_path):
    values = ALL_VALUES + _mutations()
    messages = _expert_messages(_pcap(tmp_path / "fuzz.pcap", values))
    assert len(messages) == len(values)
    refused = [_refused(v) for v in values]
    unflagged = [v.hex() for v, r, m in zip(values, refused, messages, strict=True) if r and not m]
    falsely = [v.hex() for v, r, m in zip(values, refused, messages, strict=True) if m and not r]
    assert sum(refused) > len(values) // 2  # the corpus exercises refusals
    assert unflagged == []
    assert falsely == []


def _tlv(tlv_type: int, value: bytes) -> bytes:
    return tlv_type.to_bytes(2, "big") + len(value).to_bytes(2, "big") + value


def _signature(length: int = 64, key: bytes = b"key-id-1") -> bytes:
    return _tlv(255, bytes([1, len(key)]) + key + bytes(length))  # Ed25519


SIG = _signature()
NODE, OPSIG = bytes(range(1, 33)), bytes(64)
SCOPE = bytes.fromhex("01 04 00000064 02 05 200a000000 03 05 18c0000200")


def _delegation(
    node: bytes = NODE, opsig: bytes = OPSIG, scope: bytes = SCOPE, operator: bytes = b"operator"
) -> bytes:
    value = (
        bytes([1, len(operator)])
        + operator
        + bytes([len(node)])
        + node
        + (1).to_bytes(8, "big")
        + (2).to_bytes(8, "big")
        + bytes([len(opsig)])
        + opsig
        + scope
    )
    return _tlv(254, value)


CASES = {
    "version": (b"\x00\x01\x00\x01\x02" + HEADER[5:], "version 2 outside 1..1"),
    "unit": (
        HEADER + bytes.fromhex("0010000d 0001 09 02 02 4010000000000000"),
        "unit 9 is not a registered value",
    ),
    "statistic": (
        HEADER + bytes.fromhex("0010000d 0001 02 00 02 4010000000000000"),
        "statistic 0 is not a registered value",
    ),
    "tier": (
        HEADER
        + bytes.fromhex(
            "0021002d 002b 09 01 00000001 00000000 0000000000000000 ffffffffffffffff"
            "00000000 00040000 00000005 000c3500 00"
        ),
        "tier 9 is not a registered value",
    ),
    "key scheme zero": (
        HEADER + CACHE_MODEL[:-5] + b"\x00" + CACHE_MODEL[-4:],
        "key_scheme 0 outside 1..max",
    ),
    "sealed algorithm zero": (
        HEADER + bytes.fromhex("00240026 00 00000007 0c") + bytes(12) + bytes(20),
        "algorithm 0 outside 1..max",
    ),
    "order": (HEADER + CAP + L0, "type 16 comes after capacity: types must be strictly"),
    "repeat": (HEADER + L0 + L0, "type 16 repeats metrics-l0: types must be strictly"),
    "mandatory": (HEADER[:23] + HEADER[39:] + L0, "mandatory sequence TLV is missing"),
    "signature length": (HEADER + _signature(63), "Ed25519 signature is 63 bytes, not 64"),
    "node key length": (
        HEADER + _delegation(node=NODE[:31]),
        "Ed25519 node_key is 31 bytes, not 32",
    ),
    "operator signature length": (
        HEADER + _delegation(opsig=bytes(65)),
        "Ed25519 operator_signature is 65 bytes, not 64",
    ),
    "scope kinds": (HEADER + _delegation(scope=SCOPE[:6]), "scope has no address, route entry"),
    "key id length": (HEADER + _signature(key=b"k1"), "Ed25519 key_id is 2 bytes, not 8"),
    "operator key id length": (
        HEADER + _delegation(operator=b"op"),
        "Ed25519 operator_key_id is 2 bytes, not 8",
    ),
    "site scope length": (
        HEADER + _delegation(scope=SCOPE + bytes.fromhex("04 02 0001")),
        "site scope value is 2 bytes, not 4",
    ),
    "metric type zero": (
        HEADER + bytes.fromhex("0010000d 0000 02 02 02 4010000000000000"),
        "metric_type 0 outside 1..max",
    ),
    "nan": (
        HEADER + bytes.fromhex("0010000d 0001 02 02 02 7ff8000000000000"),
        "value is not a finite number",
    ),
    "l0 order": (
        HEADER
        + bytes.fromhex("0010001a 0002 02 02 02 4010000000000000 0001 02 02 02 4010000000000000"),
        "metrics not strictly increasing by (metric_type, statistic, source)",
    ),
}


def test_each_rule_has_its_expert_message(tmp_path):
    names = sorted(CASES)
    values = [CASES[n][0] for n in names]
    for name, value in zip(names, values, strict=True):
        assert _refused(value), name
    messages = _expert_messages(_pcap(tmp_path / "cases.pcap", values))
    for name, shown in zip(names, messages, strict=True):
        assert CASES[name][1] in shown, (name, shown)
    assert _expert_messages(_pcap(tmp_path / "good.pcap", [HEADER + L0 + SIG])) == [""]
    assert not _refused(HEADER + L0 + _delegation() + SIG)
    assert _expert_messages(_pcap(tmp_path / "del.pcap", [HEADER + L0 + _delegation() + SIG])) == [
        ""
    ]


def test_attribute_flags_without_optional_or_transitive_are_a_warning(tmp_path):
    """The codec refuses an attribute whose flags lack Optional or Transitive (the
    draft's Format and Flags); tshark warns on its flags field, in the malformed group,
    and not when both are set, with or without the Partial bit."""
    value = HEADER + L0 + SIG
    flags = [0x90, 0x50, 0x10, 0xD0, 0xF0, 0xDF]
    for flag in flags:
        attr = bytes([flag, 255]) + len(value).to_bytes(2, "big") + value
        if flag & 0xC0 == 0xC0:
            assert wire.decode_attribute_value(attr) == wire.decode(value)
        else:
            with pytest.raises(wire.BadValueError, match="lack optional"):
                wire.decode_attribute_value(attr)
    pcap = _pcap(tmp_path / "flags.pcap", [value] * len(flags), flags=flags)
    argv = [_tshark(), "-X", f"lua_script:{LUA}", "-r", str(pcap), "-T", "fields"]
    argv += ["-e", "_ws.expert.message", "-e", "_ws.expert.severity", "-e", "_ws.expert.group"]
    argv += ["-E", "occurrence=a", "-E", "aggregator=|"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    assert "Lua Error" not in out.stdout + out.stderr
    rows = [line.split("\t") for line in out.stdout.split("\n")[:-1]]
    warn = f"{WARN_SEVERITY}"
    assert rows == [
        ["attribute flags 0x90 lack optional+transitive (0xc0)", warn, f"{MALFORMED_GROUP}"],
        ["attribute flags 0x50 lack optional+transitive (0xc0)", warn, f"{MALFORMED_GROUP}"],
        ["attribute flags 0x10 lack optional+transitive (0xc0)", warn, f"{MALFORMED_GROUP}"],
        ["", "", ""],
        ["", "", ""],
        ["", "", ""],
    ]


def _sealed(algorithm: int, nonce_len: int) -> bytes:
    return _tlv(
        36, bytes([algorithm]) + (7).to_bytes(4, "big") + bytes([nonce_len]) + bytes(nonce_len + 20)
    )


def test_an_unknown_sealing_algorithm_is_a_note_not_a_refusal(tmp_path):
    """Algorithm 200 (any nonce length) is well formed: the codec keeps it, tshark shows
    it with a note of the undecoded group and no refusal; algorithm 1 with its 12-octet
    nonce gets neither, and with 11 octets the nonce refusal."""
    values = [
        HEADER + L0 + _sealed(200, 24) + SIG,
        HEADER + _sealed(1, 12),
        HEADER + _sealed(1, 11),
    ]
    assert [_refused(v) for v in values] == [False, False, True]
    frames = _experts(_pcap(tmp_path / "aead.pcap", values))
    assert frames[0] == [
        (
            "unknown algorithm 200: the sealed section cannot be opened here, "
            "the attribute is well formed",
            UNDECODED_GROUP,
        )
    ]
    assert frames[1] == []
    assert frames[2] == [("ChaCha20-Poly1305 nonce is 11 bytes, not 12", MALFORMED_GROUP)]


def test_an_unknown_key_scheme_is_a_note_not_a_refusal(tmp_path):
    """Key Scheme 200 is an open code (the RIB keeps the metrics and refuses the
    summaries): tshark notes it in the undecoded group, refuses nothing; scheme 1 gets no
    note and scheme 0 stays a refusal."""

    def model(scheme: int) -> bytes:
        return CACHE_MODEL[:-5] + bytes([scheme]) + CACHE_MODEL[-4:]

    values = [HEADER + L0 + model(200) + SIG, HEADER + L0 + model(1) + SIG, HEADER + model(0)]
    assert [_refused(v) for v in values] == [False, False, True]
    frames = _experts(_pcap(tmp_path / "scheme.pcap", values))
    assert frames[0] == [
        (
            "unknown key scheme 200: the cache summaries cannot be matched here, "
            "the metrics stand and the attribute is well formed",
            UNDECODED_GROUP,
        )
    ]
    assert frames[1] == []
    assert [group for _, group in frames[2]] == [MALFORMED_GROUP]


def _lua_table(name: str) -> dict[int, str]:
    text = LUA.read_text()
    m = re.search(rf"\b{name} = (?:names\()?\{{(.*?)\}}", text, re.S)
    assert m, name
    return {int(k): v for k, v in re.findall(r'\[(\d+)\] = "([^"]+)"', m.group(1))}


def _names(e: type[enum.IntEnum]) -> dict[int, str]:
    return {m.value: m.name.lower().replace("_", "-") for m in e}


@pytest.mark.parametrize(
    ("table", "enum_type"),
    [
        ("TLV_NAMES", wire.TLVType),
        ("tier", wire.Tier),
        ("kind", wire.SummaryKind),
        ("key_scheme", wire.KeyScheme),
        ("category", wire.MetricCategory),
        ("unit", wire.Unit),
        ("statistic", wire.Statistic),
        ("source", wire.Source),
        ("signature_algorithm", wire.SignatureAlgorithm),
        ("aead", wire.AeadAlgorithm),
        ("scope_kind", wire.ScopeKind),
        ("metric_type", wire.L0MetricType),
    ],
)
def test_the_lua_names_every_registry_value_the_codec_names(table, enum_type):
    assert _lua_table(table) == _names(enum_type)


def test_metric_type_eleven_is_named_under_tshark(tmp_path):
    value = HEADER + bytes.fromhex("0010000d 000b 01 01 02 40c3880000000000")
    assert wire.decode(value).metrics_l0.metrics[0].metric_type == (
        wire.L0MetricType.OUTSTANDING_PREFILL_TOKENS
    )
    argv = [_tshark(), "-X", f"lua_script:{LUA}", "-r", str(_pcap(tmp_path / "m.pcap", [value]))]
    out = subprocess.run([*argv, "-V"], capture_output=True, text=True, timeout=60, check=True)
    assert "outstanding-prefill-tokens (11)" in out.stdout


def test_an_ipv6_route_in_mp_reach_nlri_is_the_route_shown(tmp_path):
    ipv6 = next(v for v in VECTORS["positive"] if "ipv6" in v["name"])
    value = bytes.fromhex(ipv6["hex"])
    hop = ipaddress.ip_address("2001:db8::1").packed
    mp = bytes([0, 2, 1, 16]) + hop + b"\x00"
    mp += bytes([128]) + ipaddress.ip_address("2001:db8:ff::10").packed
    mp += bytes([48]) + ipaddress.ip_address("2001:db8:aa::").packed[:6]
    attr = bytes([0x90, 14]) + len(mp).to_bytes(2, "big") + mp
    (tree,) = tshark_trees(_pcap(tmp_path / "v6.pcap", [value], mp_reach=attr))
    assert tree["catsproto.nlri"] == "2001:db8:ff::10/128, 2001:db8:aa::/48"
    assert _list(tree["catsproto.tlv_tree"])  # the TLVs are shown as well
