"""KV block transfer between instances and between tiers (pure protocol core).

Strategy: like h11, this package speaks the protocol and does no IO. A `Puller` names a
prefix of block keys and turns the holder's bytes into events; a `Holder` turns a pull
into paced bytes, looking blocks up only when their turn comes. Every block travels
with a SHA-256 digest over its key and payload (`content`), checked before the block
is staged; only a completed run is handed out (`Completed.blocks`), so a transfer that
is cut, tampered with or refused admits nothing it has not verified, and
`resume_state()` lets a new pull continue from the first missing block. Pacing is a
token bucket on the caller's clock (`pacing`); `tiers` moves blocks between HBM, DRAM
and SSD over the same path on a modelled clock; `consistency` counts stale hits.
Errors are one family, `TransferError` (a `wire.CodecError`) with a stream offset.
The TLS 1.3 adapter is `catsproto.adapters.transfer_tls`; docs/transfer.md has the frames.
"""

from catsproto.transfer.consistency import Outcome, StaleHitLedger
from catsproto.transfer.content import (
    StoredBlock,
    block_digest,
    synthetic_keys,
    synthetic_payload,
    synthetic_store,
)
from catsproto.transfer.errors import (
    BlockTooLargeError,
    DigestMismatchError,
    FrameError,
    PeerRefusedError,
    ProtocolViolationError,
    TransferError,
    TruncatedTransferError,
)
from catsproto.transfer.frames import (
    Accept,
    Block,
    Cancel,
    Code,
    Data,
    Done,
    Evicted,
    FrameReader,
    FrameType,
    Pull,
    Refuse,
    encode,
)
from catsproto.transfer.holder import Holder, HolderState, PeerCancelled, PullReceived
from catsproto.transfer.pacing import TokenBucket
from catsproto.transfer.puller import (
    DEFAULT_MAX_BLOCK,
    Accepted,
    BlockVerified,
    Cancelled,
    Completed,
    Puller,
    PullerEvent,
    PullerState,
    ResumeState,
)
from catsproto.transfer.tiers import TierLink, TierMove, TierStores

__all__ = [name for name in dir() if not name.startswith("_")]
