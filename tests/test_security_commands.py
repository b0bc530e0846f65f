"""The pure halves of `catsproto keygen | authorize | sign | seal | verify`."""

from __future__ import annotations

import pytest

from catsproto import wire
from catsproto.examples import T0_MS
from catsproto.security import Reason, commands
from catsproto.security.vectors import DAY_MS, NLRI, NOW_MS, fixture, seed

F = fixture()


def test_keygen_authorize_sign_seal_verify_end_to_end():
    operator = commands.keygen(seed("cli-operator"), "op")
    node = commands.keygen(seed("cli-node"), "node")
    assert "seed" not in commands.public_key(node)
    delegation = commands.authorize(
        operator,
        commands.public_key(node)["public_key"],
        cs_ids=[100],
        routes=["10.0.0.0/16"],
        addresses=["192.0.2.0/24"],
        not_before_ms=T0_MS - DAY_MS,
        not_after_ms=T0_MS + DAY_MS,
    )
    trust = {
        "format": "catsproto-trust/1",
        "operators": [commands.public_key(operator)],
        "delegations": [delegation],
    }
    group = [commands.group_keygen(3, seed("cli-group"))]
    value = commands.seal_value(wire.encode(F.at(1, 43)), group, bytes(12))
    signed = commands.sign_value(value, node, commands.parse_nlri("10.0.1.0/24"))
    verdict = commands.verify_value(signed, NLRI, trust, NOW_MS, group_keys=group)
    assert verdict.ok and verdict.advertisement.cache_summaries == F.base.cache_summaries
    # Without the delegation in the trust file: refused, unless the value carries it.
    bare_trust = {**trust, "delegations": []}
    assert commands.verify_value(signed, NLRI, bare_trust, NOW_MS).reason is Reason.UNKNOWN_KEY
    carried = commands.sign_value(value, node, NLRI, delegation=delegation)
    assert commands.verify_value(carried, NLRI, bare_trust, NOW_MS).ok
    late = commands.verify_value(signed, NLRI, trust, NOW_MS + 10_000, max_age_ms=1_000)
    assert late.reason is Reason.STALE_TIMESTAMP


def test_bad_inputs_raise_command_error():
    with pytest.raises(commands.CommandError, match="route"):
        commands.parse_nlri("10.0.0.1/8")
    with pytest.raises(commands.CommandError, match="private key"):
        commands.public_key({"format": "nope"})
    with pytest.raises(commands.CommandError, match="trust file"):
        commands.verify_value(b"", NLRI, {"format": "nope"}, NOW_MS)
    with pytest.raises(commands.CommandError, match="one or two"):
        commands.seal_value(wire.encode(F.at(1, 43)), [], bytes(12))
    from catsproto.security.sealing import CACHE_SECTION

    full = F.at(1, 43)
    bare = wire.Advertisement(tuple(t for t in full.tlvs if t.type not in CACHE_SECTION))
    group = [commands.group_keygen(3, seed("cli-group"))]
    with pytest.raises(commands.CommandError, match="nothing to seal"):
        commands.seal_value(wire.encode(bare), group, bytes(12))
