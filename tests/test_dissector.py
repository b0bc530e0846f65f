"""The Wireshark Lua dissector under tshark: every TLV field against the codec."""

from __future__ import annotations

import enum
import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from catsproto import wire
from catsproto.cli import main
from catsproto.wire.bgp import build_update
from tests.lab_captures import EXPECTED, LARGE_BODY, lab_capture, require_root

LUA = Path(__file__).resolve().parents[1] / "lab" / "wireshark" / "catsproto.lua"
VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())["positive"]


def _tshark() -> str:
    found = shutil.which("tshark")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tshark is missing and CI=true forbids skipping")
        pytest.skip("tshark not installed")
    return found


def _list(x: Any) -> list:
    return x if isinstance(x, list) else [] if x is None else [x]


def tshark_trees(pcap: Path, *extra: str, lua: bool = True) -> list[dict]:
    """Every catsproto tree tshark shows in `pcap`, in order."""
    argv = [_tshark(), *(["-X", f"lua_script:{LUA}"] if lua else []), "-r", str(pcap)]
    argv += ["-Y", "catsproto", "-T", "json", "--no-duplicate-keys", *extra]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    trees = []
    for frame in json.loads(out.stdout or "[]"):
        trees += _list(frame["_source"]["layers"].get("catsproto"))
    return trees


def assert_fields(record: Any, node: dict, prefix: str, where: str) -> None:
    """Each codec field of `record` equals the tshark field catsproto.<prefix>.<name>."""
    for name, _codec in record._LAYOUT:
        key = f"catsproto.{prefix}.{name}"
        value = getattr(record, name)
        if isinstance(value, tuple):
            subs = _list(node.get(f"{key}_tree"))
            assert len(subs) == len(value), f"{where}.{name}"
            for i, (item, sub) in enumerate(zip(value, subs, strict=True)):
                assert_fields(item, sub, prefix, f"{where}.{name}[{i}]")
        elif isinstance(value, bytes):
            assert bytes.fromhex(node.get(key, "").replace(":", "")) == value, f"{where}.{name}"
        elif isinstance(value, float):
            assert float(node[key]) == value, f"{where}.{name}"
        elif isinstance(value, str):
            assert node[key] == value, f"{where}.{name}"
        elif isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
            shown = node.get(key if value.version == 4 else f"{key}6")
            assert ipaddress.ip_address(shown) == value, f"{where}.{name}"
        else:
            assert isinstance(value, int | enum.IntEnum)
            assert int(node[key], 0) == int(value), f"{where}.{name}: {node.get(key)}"


def assert_tree_matches_codec(tree: dict, value: bytes, where: str) -> None:
    adv = wire.decode(value)
    assert int(tree["catsproto.length"]) == len(value)
    tlvs = _list(tree["catsproto.tlv_tree"])
    assert len(tlvs) == len(adv.tlvs), where
    for tlv, node in zip(adv.tlvs, tlvs, strict=True):
        assert int(node["catsproto.tlv.type"]) == tlv.type
        if isinstance(tlv, wire.UnknownTLV):
            assert bytes.fromhex(node.get("catsproto.unknown.value", "").replace(":", "")) == (
                tlv.value
            )
            continue
        assert_fields(tlv, node, tlv.NAME.replace("-", "_"), f"{where}.{tlv.NAME}")


def test_lab_capture_shows_every_field_as_the_codec_reads_it():
    require_root()
    lab = lab_capture()
    trees = {t["catsproto.nlri"]: t for t in tshark_trees(lab.pcap)}
    assert set(trees) == set(EXPECTED)
    for prefix, tree in trees.items():
        assert tree["catsproto.flags"] in ("0xc0", "0xd0") and tree["catsproto.type_code"] == "255"
        if EXPECTED[prefix] != "malformed":
            assert_tree_matches_codec(tree, lab.values[prefix], prefix)
    big = _list(trees["10.255.0.3/32"]["catsproto.tlv_tree"])
    entry = next(t for t in big if t["catsproto.tlv.type"] == "33")
    body = _list(entry["catsproto.cache_summaries.entries_tree"])[0][
        "catsproto.cache_summaries.body"
    ]
    assert len(body.replace(":", "")) == 2 * LARGE_BODY  # a 20 KB UPDATE: over tshark's 4096
    sealed = _list(trees["10.255.0.2/32"]["catsproto.tlv_tree"])
    assert [t["catsproto.tlv.type"] for t in sealed] == ["1", "2", "3", "4", "18", "36", "255"]


def test_lab_capture_malformed_attribute_is_flagged_not_fatal():
    require_root()
    lab = lab_capture()
    out = subprocess.run(
        [_tshark(), "-X", f"lua_script:{LUA}", "-r", str(lab.pcap), "-V", "-Y", "catsproto"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "TLV length 74 exceeds the 72 bytes left in the attribute" in out.stdout
    assert "Lua Error" not in out.stdout and "Lua Error" not in out.stderr
    assert out.stdout.count("CATS KV-cache state (catsproto)") == len(EXPECTED)


def test_every_tlv_type_of_the_vectors_through_tshark(tmp_path):
    """Every positive vector (all TLV types, IPv6, unknown TLVs) in one crafted capture."""
    pkts, seq = [], 1000
    flow = dict(sport=40000, dport=179)
    pkts.append(Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / TCP(seq=seq - 1, flags="S", **flow))
    for i, v in enumerate(VECTORS):
        msg = build_update(
            [ipaddress.ip_network(f"10.255.2.{i}/32")],
            ipaddress.ip_address("10.0.0.1"),
            [bytes.fromhex(v["attribute"])],
            as_path=(65001,),
        )
        tcp = TCP(seq=seq, flags="PA", **flow)
        pkts.append(Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / tcp / msg)
        seq += len(msg)
    wrpcap(str(tmp_path / "vectors.pcap"), pkts)
    trees = tshark_trees(tmp_path / "vectors.pcap")
    assert len(trees) == len(VECTORS)
    seen_types = set()
    for v, tree in zip(VECTORS, trees, strict=True):
        assert_tree_matches_codec(tree, bytes.fromhex(v["hex"]), v["name"])
        seen_types |= {int(t["catsproto.tlv.type"]) for t in _list(tree["catsproto.tlv_tree"])}
    assert set(wire.DEFAULT_REGISTRY.by_type) <= seen_types


def test_install_puts_it_where_tshark_finds_it(tmp_path, capsys):
    home = tmp_path / "home"
    plugins = home / ".local" / "lib" / "wireshark" / "plugins"
    assert main(["dissector", "install", "--dir", str(plugins)]) == 0
    assert (plugins / "catsproto.lua").read_text() == LUA.read_text()
    assert "installed" in capsys.readouterr().out
    # tshark (no -X) loads it from the personal plugin folder of $HOME
    msg = build_update(
        [ipaddress.ip_network("10.255.3.1/32")],
        ipaddress.ip_address("10.0.0.1"),
        [bytes.fromhex(VECTORS[0]["attribute"])],
    )
    pkt = Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / TCP(sport=40000, dport=179, flags="PA")
    wrpcap(str(tmp_path / "one.pcap"), [pkt / msg])
    argv = [_tshark(), "-r", str(tmp_path / "one.pcap"), "-T", "fields"]
    argv += ["-e", "catsproto.origin.cs_id", "-e", "catsproto.origin.address"]
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=True)
    assert out.stdout.split() == ["100", "192.0.2.10"]
