"""Signed, authorised, replay-proof and confidential advertisements (pure).

Strategy: the codec makes the attribute value canonical, so a signature can cover the
bytes on the wire. This package adds, each in a module of its own:

- `identity`: Ed25519 keys from caller-drawn seeds; key ids derived from public keys.
- `signing`: what a signature covers (label, attribute type, the route's NLRI, every
  TLV but the signature) and `sign`.
- `trust`: operator keys, delegations (`wire.Delegation`) authorising node keys for
  CS-IDs, routes, instance addresses and a validity period; the trust file.
- `replay`: per-route (epoch, sequence) window, an immutable value.
- `sealing`: the cache section under a group key (ChaCha20-Poly1305), two-key rotation.
- `receiver`: `check` (pure) -> `Verdict` with one `Reason`; `Receiver` commits
  accepted verdicts and counts every reason.

No clock, randomness or file access here: `now_ms`, seeds and nonces are arguments.
docs/security-reference.md has the formats, docs/security.md the threat model.
"""

from catsproto.security.errors import (
    ERROR_FOR_REASON,
    BadDelegationError,
    BadSignatureError,
    DecryptionError,
    DuplicateError,
    EquivocationError,
    FutureTimestampError,
    KeyExpiredError,
    MalformedError,
    NotAuthorisedError,
    Reason,
    ReplayedError,
    StaleTimestampError,
    UnknownGroupKeyError,
    UnknownKeyError,
    UnknownSealingAlgorithmError,
    UnsignedError,
)
from catsproto.security.identity import KeyFormatError, PublicKey, SigningKey, key_id
from catsproto.security.receiver import (
    Counters,
    Policy,
    Presigned,
    Receiver,
    Verdict,
    check,
    presign,
    verify_advertisement,
)
from catsproto.security.replay import ReplayWindow, RouteKey, RouteState
from catsproto.security.sealing import (
    CACHE_SECTION,
    GroupKey,
    GroupKeyring,
    associated_data,
    open_sealed,
    seal,
    unknown_algorithm,
)
from catsproto.security.signing import (
    ADVERTISEMENT_LABEL,
    nlri_bytes,
    received_message,
    sign,
    signature_span,
    signed_message,
    without_signature,
)
from catsproto.security.trust import (
    DELEGATION_LABEL,
    Authorisation,
    OperatorKey,
    OperatorScope,
    TrustFileError,
    TrustStore,
    authorise,
    delegation_from_json,
    delegation_message,
    delegation_to_json,
)

__all__ = [name for name in dir() if not name.startswith("_")]
