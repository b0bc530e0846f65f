"""RIBs that share one remembering decoder (`sim.control.SharedDecode`) end in the same
state as RIBs that each decode for themselves; a body that does not decode is refused at
every one of them and changes nothing."""

from __future__ import annotations

import dataclasses

import numpy as np

from catsproto import wire
from catsproto.selector import RIB
from catsproto.sim.control import ControlStats, SharedDecode
from catsproto.summary import SummarySender
from tests.selector_fixtures import advert, entry


def _history(
    rng: np.random.Generator, kind: wire.SummaryKind
) -> list[tuple[wire.SummaryEntry, np.ndarray]]:
    """Snapshots and deltas of one cache that churns, as a sender sends them, each with
    the keys held then."""
    sender = SummarySender(0.01, kind=int(kind))
    keys = rng.integers(0, 2**64 - 1, 1500, dtype=np.uint64)
    out = []
    for _ in range(12):
        keys = np.concatenate([keys[60:], rng.integers(0, 2**64 - 1, 60, dtype=np.uint64)])
        upd = sender.update(keys)
        sent = entry(
            keys,
            kind=wire.SummaryKind(upd.summary.kind),
            version=upd.version,
            base_version=upd.base_version,
            summary=upd.summary,
        )
        out.append((sent, keys))
    return out


def _lookups(rib: RIB, asked: np.ndarray) -> list[list[int]]:
    table = rib.services[7]
    return [inst.lookup(asked).tolist() for inst in table.live()]


def test_shared_decoder_gives_every_rib_the_state_of_its_own_decode():
    rng = np.random.default_rng(3)
    streams = {
        "10.0.0.1": _history(rng, wire.SummaryKind.FUSE),
        "10.0.0.2": _history(rng, wire.SummaryKind.BLOOM),
        "10.0.0.3": _history(rng, wire.SummaryKind.EXACT),
    }
    stats = ControlStats()
    shared = SharedDecode(stats)
    together = [RIB(decode=shared) for _ in range(3)]
    alone = [RIB() for _ in range(3)]
    strangers = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    for step in range(12):
        asked = [strangers]
        for n, (address, history) in enumerate(streams.items()):
            sent, keys = history[step]
            adv = advert(address, 1 + n, [sent], seq=step + 1, ts=1000 + step)
            for rib in together + alone:
                rib.accept(adv, now_ms=1000 + step)
            asked.append(keys[::5])
        query = np.concatenate(asked)
        want = _lookups(alone[0], query)
        assert all(_lookups(rib, query) == want for rib in together + alone[1:])
        assert all(sum(held) >= 300 for held in want)  # each holds its 300 keys asked
    # each body was decoded once, and handed to the other two RIBs
    assert stats.decoded == 3 * 12
    assert stats.reused_decodes == 2 * 3 * 12


def test_a_bad_body_is_refused_at_every_rib_sharing_the_decoder():
    rng = np.random.default_rng(4)
    good = _history(rng, wire.SummaryKind.FUSE)[0][0]
    stats = ControlStats()
    shared = SharedDecode(stats)
    ribs = [RIB(decode=shared) for _ in range(3)]
    for rib in ribs:
        rib.accept(advert("10.0.0.1", 1, [good], seq=1), now_ms=1000)
    before = [_lookups(rib, np.array([1, 2, 3], dtype=np.uint64)) for rib in ribs]
    broken = dataclasses.replace(good, version=2, body=good.body[:-7])
    for rib in ribs:
        result = rib.accept(advert("10.0.0.1", 1, [broken], seq=2), now_ms=1001)
        assert result.outcomes[0][2].startswith("rejected:")
        assert rib.rejected_total == 1
    assert [_lookups(rib, np.array([1, 2, 3], dtype=np.uint64)) for rib in ribs] == before
    assert stats.decoded == 1  # the refused body is decoded (and refused) each time, not kept
