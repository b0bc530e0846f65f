"""One error family for everything the transfer core refuses.

Every refusal is a `TransferError` (a `catsproto.wire.CodecError`, so callers that
already catch the codec's family catch this too). It says *where*: the byte offset in
the stream (counted from the first byte handed to the receiver), the frame type being
read if any, and *why*, e.g. ``block frame at stream offset 4129: block 3 digest does
not match its payload``.
"""

from __future__ import annotations

from catsproto.transfer.codes import frame_name
from catsproto.wire.errors import CodecError


class TransferError(CodecError):
    """Base of every refusal of the transfer core (stream, frames, state, content)."""

    def __init__(
        self,
        reason: str,
        offset: int | None = None,
        tlv_type: int | None = None,
    ) -> None:
        super().__init__(reason, offset, tlv_type)

    @property
    def frame_type(self) -> int | None:
        return self.tlv_type

    def __str__(self) -> str:
        where = []
        if self.tlv_type is not None:
            where.append(f"{frame_name(self.tlv_type)} frame")
        if self.offset is not None:
            where.append(f"at stream offset {self.offset}")
        return f"{' '.join(where)}: {self.reason}" if where else self.reason


class FrameError(TransferError):
    """Malformed framing: bad length, unknown type, a body that does not parse."""


class TruncatedTransferError(TransferError):
    """The stream ended (or was cut) before the transfer finished."""


class DigestMismatchError(TransferError):
    """A block's payload does not hash to the digest that binds it to its key."""


class ProtocolViolationError(TransferError):
    """A well-formed frame at the wrong moment or with inconsistent content
    (a block out of prefix order, a key that was not asked for, too many bytes)."""


class BlockTooLargeError(ProtocolViolationError):
    """A BLOCK header announces more bytes than the puller's limit (the size it expects
    for that block): refused at the header, before any of the payload is read."""


class PeerRefusedError(TransferError):
    """The peer answered with a refusal or cancelled; `code` says which."""

    def __init__(
        self,
        reason: str,
        offset: int | None = None,
        tlv_type: int | None = None,
        code: int = 0,
    ) -> None:
        super().__init__(reason, offset, tlv_type)
        self.code = code

    def located(self, offset: int | None, tlv_type: int | None) -> PeerRefusedError:
        return PeerRefusedError(
            self.reason,
            self.offset if self.offset is not None else offset,
            self.tlv_type if self.tlv_type is not None else tlv_type,
            self.code,
        )
