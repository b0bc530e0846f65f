"""Why an advertisement was refused: a fixed set of reasons, one error class each.

Every check in this package raises a `BadSignatureError` subclass (itself a
`wire.CodecError`, so a receiver that already catches the codec's family catches these
too). The receiver turns each into a `Verdict` carrying the `Reason`, counts it and moves
on: a refused advertisement is never a crash and never changes state.
"""

from __future__ import annotations

import enum

from catsproto.wire import CodecError


class Reason(enum.Enum):
    """The outcome of verifying one advertisement. Values are the names used in logs,
    counters, JSON and the CLI."""

    OK = "ok"
    DUPLICATE = "duplicate"  # the very advertisement already accepted (BGP re-sends these)
    MALFORMED = "malformed"  # the codec refused the bytes (truncated signature included)
    UNSIGNED = "unsigned"  # no signature TLV: a downgrade
    UNKNOWN_KEY = "unknown-key"  # no delegation from a trusted operator key names the signer
    BAD_DELEGATION = "bad-delegation"  # a carried delegation's operator signature fails
    KEY_EXPIRED = "key-expired"  # now is outside the delegation's validity period
    NOT_AUTHORISED = "not-authorised"  # CS-ID, route or instance address outside the scope
    BAD_SIGNATURE = "bad-signature"  # Ed25519 check fails: forged, altered or moved
    STALE_TIMESTAMP = "stale-timestamp"  # older than the freshness window
    FUTURE_TIMESTAMP = "future-timestamp"  # further ahead than the allowed clock skew
    REPLAYED = "replayed"  # (epoch, sequence) not newer than the last accepted
    EQUIVOCATION = "equivocation"  # same (epoch, sequence) as accepted, other content
    # sealed under a group key id not held: open_sealed's error; a receiver accepts such
    # an advertisement with the section unopened (Verdict.unheld_group_key)
    UNKNOWN_GROUP_KEY = "unknown-group-key"
    DECRYPTION_FAILED = "decryption-failed"  # AEAD tag fails, or the plaintext is malformed

    @property
    def accepted(self) -> bool:
        return self is Reason.OK


class BadSignatureError(CodecError):
    """Base of every verification failure: the advertisement is not to be believed.

    `why` says which check failed; `reason` (inherited) is the human-readable detail.
    """

    why: Reason = Reason.BAD_SIGNATURE


class MalformedError(BadSignatureError):
    why = Reason.MALFORMED


class UnsignedError(BadSignatureError):
    why = Reason.UNSIGNED


class UnknownKeyError(BadSignatureError):
    why = Reason.UNKNOWN_KEY


class BadDelegationError(BadSignatureError):
    why = Reason.BAD_DELEGATION


class KeyExpiredError(BadSignatureError):
    why = Reason.KEY_EXPIRED


class NotAuthorisedError(BadSignatureError):
    why = Reason.NOT_AUTHORISED


class StaleTimestampError(BadSignatureError):
    why = Reason.STALE_TIMESTAMP


class FutureTimestampError(BadSignatureError):
    why = Reason.FUTURE_TIMESTAMP


class ReplayedError(BadSignatureError):
    why = Reason.REPLAYED


class EquivocationError(BadSignatureError):
    why = Reason.EQUIVOCATION


class DuplicateError(BadSignatureError):
    """Not an attack: the same signed advertisement again (route refresh, a second peer)."""

    why = Reason.DUPLICATE


class UnknownGroupKeyError(BadSignatureError):
    why = Reason.UNKNOWN_GROUP_KEY


class UnknownSealingAlgorithmError(UnknownGroupKeyError):
    """Sealed with an AEAD this implementation does not have: no key held here can open
    it, so it is the same case as a group key not held. A receiver accepts the
    advertisement with that section unopened (`Verdict.unknown_algorithm`)."""


class DecryptionError(BadSignatureError):
    why = Reason.DECRYPTION_FAILED


ERROR_FOR_REASON: dict[Reason, type[BadSignatureError]] = {
    cls.why: cls
    for cls in (
        BadSignatureError,
        MalformedError,
        UnsignedError,
        UnknownKeyError,
        BadDelegationError,
        KeyExpiredError,
        NotAuthorisedError,
        StaleTimestampError,
        FutureTimestampError,
        ReplayedError,
        EquivocationError,
        DuplicateError,
        UnknownGroupKeyError,
        DecryptionError,
    )
}
