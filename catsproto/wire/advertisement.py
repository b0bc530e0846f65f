"""An advertisement: one origin's TLVs in canonical order, and its lossless JSON form.

Strategy: the advertisement *is* its canonical TLV sequence. Building one sorts nothing
behind the caller's back except in `build` and `from_json`, where order carries no
meaning; decoding refuses any type that is not strictly above the previous one, so two
byte strings never decode to the same advertisement and `encode(decode(b)) == b`.
The signature therefore covers exactly the bytes on the wire.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TypeVar

from catsproto.wire.buffer import Reader, Writer
from catsproto.wire.codes import MANDATORY_TYPES, MAX_TLVS, tlv_name
from catsproto.wire.compiled import Fallback
from catsproto.wire.errors import BadLengthError, BadValueError, CodecError, NonCanonicalError
from catsproto.wire.fields import JSON
from catsproto.wire.tlv import TLV, AnyTLV, Registry, UnknownTLV, too_many_tlvs
from catsproto.wire.tlvs import (
    DEFAULT_REGISTRY,
    MANDATORY,
    CacheModel,
    CacheSummaries,
    Capacity,
    HotPrefixes,
    MetricsBasis,
    MetricsL0,
    MetricsL1,
    MetricsL2,
    Origin,
    Sequence,
    Signature,
    Timestamp,
)

T = TypeVar("T", bound=TLV)
MAX_VALUE_LEN = 0xFFFF  # an extended-length path attribute carries at most this much


@dataclasses.dataclass(frozen=True, slots=True)
class Advertisement:
    """One origin's bundle of TLVs for one CS-ID at one (epoch, sequence)."""

    tlvs: tuple[AnyTLV, ...]

    def __post_init__(self) -> None:
        if len(self.tlvs) > MAX_TLVS:
            raise BadLengthError(
                f"{len(self.tlvs)} TLVs: an advertisement holds at most {MAX_TLVS}"
            )
        for i in range(1, len(self.tlvs)):
            if self.tlvs[i - 1].type >= self.tlvs[i].type:
                raise NonCanonicalError(
                    f"{tlv_name(self.tlvs[i].type)} TLV after {tlv_name(self.tlvs[i - 1].type)}"
                    ": types must be strictly increasing",
                    tlv_type=self.tlvs[i].type,
                )
        present = {t.type for t in self.tlvs}
        for cls in MANDATORY:
            if cls.TYPE not in present:
                raise BadValueError(f"mandatory {cls.NAME} TLV is missing")

    @classmethod
    def build(cls, *tlvs: AnyTLV) -> Advertisement:
        """Put `tlvs` in canonical order (a repeated type is still refused)."""
        return cls(tuple(sorted(tlvs, key=lambda t: t.type)))

    def get(self, cls: type[T]) -> T | None:
        for t in self.tlvs:
            if type(t) is cls:
                return t
        return None

    def replace(self, *tlvs: AnyTLV) -> Advertisement:
        """A copy with `tlvs` added, each replacing any TLV of its type."""
        types = {t.type for t in tlvs}
        return Advertisement.build(*(t for t in self.tlvs if t.type not in types), *tlvs)

    def without(self, tlv_type: int) -> Advertisement:
        return Advertisement(tuple(t for t in self.tlvs if t.type != tlv_type))

    @property
    def origin(self) -> Origin:
        return self.get(Origin)  # type: ignore[return-value]  # mandatory

    @property
    def sequence(self) -> Sequence:
        return self.get(Sequence)  # type: ignore[return-value]  # mandatory

    @property
    def timestamp_ms(self) -> int:
        return self.get(Timestamp).ms  # type: ignore[union-attr]  # mandatory

    @property
    def metrics_l0(self) -> MetricsL0 | None:
        return self.get(MetricsL0)

    @property
    def metrics_l1(self) -> MetricsL1 | None:
        return self.get(MetricsL1)

    @property
    def metrics_l2(self) -> MetricsL2 | None:
        return self.get(MetricsL2)

    @property
    def metrics_basis(self) -> MetricsBasis | None:
        return self.get(MetricsBasis)

    @property
    def cache_model(self) -> CacheModel | None:
        return self.get(CacheModel)

    @property
    def cache_summaries(self) -> CacheSummaries | None:
        return self.get(CacheSummaries)

    @property
    def capacity(self) -> Capacity | None:
        return self.get(Capacity)

    @property
    def hot_prefixes(self) -> HotPrefixes | None:
        return self.get(HotPrefixes)

    @property
    def signature(self) -> Signature | None:
        return self.get(Signature)

    @property
    def unknown(self) -> tuple[UnknownTLV, ...]:
        return tuple(t for t in self.tlvs if isinstance(t, UnknownTLV))

    # ---- JSON ------------------------------------------------------------------------

    def to_json(self) -> JSON:
        """A dict keyed by TLV name, in type order; one-field TLVs show just that field."""
        out: dict[str, JSON] = {}
        unknown = []
        for t in self.tlvs:
            if isinstance(t, UnknownTLV):
                unknown.append(t.to_json())
                continue
            body = t.to_json()
            out[t.NAME] = next(iter(body.values())) if len(body) == 1 else body
        if unknown:
            out["unknown"] = unknown
        return out

    @classmethod
    def from_json(cls, obj: JSON, registry: Registry = DEFAULT_REGISTRY) -> Advertisement:
        if not isinstance(obj, dict):
            raise BadValueError("an advertisement must be a JSON object")
        tlvs: list[AnyTLV] = []
        for name, value in obj.items():
            if name == "unknown":
                tlvs.extend(_unknown_from_json(value, registry))
                continue
            tlv_cls = registry.by_name.get(name)
            if tlv_cls is None:
                raise BadValueError(
                    f"no TLV named {name!r} (known: {', '.join(registry.by_name)}, unknown)"
                )
            fields = [n for n, _ in tlv_cls._LAYOUT]
            try:
                if len(fields) == 1:
                    tlvs.append(tlv_cls.from_json({fields[0]: value}, name))
                else:
                    tlvs.append(tlv_cls.from_json(value, name))
            except CodecError as exc:
                raise exc.located(None, tlv_cls.TYPE) from None
        return cls.build(*tlvs)


def _unknown_from_json(value: JSON, registry: Registry) -> list[UnknownTLV]:
    if not isinstance(value, list):
        raise BadValueError("unknown must be a list of {type, value}")
    out = []
    for i, item in enumerate(value):
        if not (isinstance(item, dict) and set(item) == {"type", "value"}):
            raise BadValueError(f"unknown[{i}] must be an object with type and value")
        code = item["type"]
        if not (isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 0xFFFF):
            raise BadValueError(f"unknown[{i}].type must be an integer 0..65535, not {code!r}")
        if code in registry.by_type:
            raise BadValueError(
                f"unknown[{i}] has type {code}, which is the known {tlv_name(code)} TLV"
            )
        try:
            raw = bytes.fromhex(item["value"])
        except (TypeError, ValueError):
            raise BadValueError(f"unknown[{i}].value must be a hex string") from None
        out.append(UnknownTLV(code, raw))
    return out


def encode(adv: Advertisement) -> bytes:
    """The attribute value: the TLVs of `adv`, in canonical order."""
    w = Writer()
    for t in adv.tlvs:
        t.encode_tlv(w)
    if len(w) > MAX_VALUE_LEN:
        raise CodecError(f"advertisement of {len(w)} bytes exceeds {MAX_VALUE_LEN}")
    return w.getvalue()


def decode_from(r: Reader, registry: Registry = DEFAULT_REGISTRY) -> Advertisement:
    """Decode the TLVs filling the window of `r` (offsets stay those of `r`'s buffer);
    errors carry what `wire.error_action` needs (`Registry.decode_tlvs`)."""
    start = r.offset
    if r.remaining > MAX_VALUE_LEN:  # encode refuses it too, so encode(decode(b)) == b holds
        raise BadLengthError(
            f"attribute value of {r.remaining} bytes exceeds {MAX_VALUE_LEN}", start
        )
    tlvs = registry.decode_tlvs(r)
    try:
        return Advertisement(tlvs)
    except CodecError as exc:
        raise exc.located(start, None) from None


_TLV_HEADER = struct.Struct(">HH")
# What a compiled decoder may raise on bytes it does not take (Fallback from its own
# checks, KeyError from an enum lookup, CodecError from a record's validate, ValueError
# from bytes.decode): the reference decoder then decides.
_FALLBACK = (Fallback, CodecError, ValueError, KeyError, IndexError, struct.error)


class _Decided(Exception):  # not an error of its own: it carries one
    """The compiled decoder's verdict on a value the reference decoder would refuse with
    the very same error (`error`), raised without asking it."""

    def __init__(self, error: CodecError) -> None:
        self.error = error


def _decode_compiled(data: bytes, pos: int, end: int, registry: Registry) -> Advertisement:
    """The TLVs of `data[pos:end]` through the compiled decoders; raises Fallback (or
    what `_FALLBACK` names) on anything the reference decoder must look at.

    The registry's sequence decoder takes the registered types in increasing order,
    inline; whatever it leaves (an unregistered type, disorder) goes TLV by TLV here.
    """
    if end - pos > MAX_VALUE_LEN:
        raise Fallback
    tlvs, pos, previous, mandatory = registry.compiled_sequence(data, pos, end)
    if pos < end:
        compiled, header = registry.compiled.get, _TLV_HEADER.unpack_from
        new, setattr_ = object.__new__, object.__setattr__
        while pos < end:
            if end - pos < 4:
                raise Fallback
            tlv_type, length = header(data, pos)
            pos += 4
            stop = pos + length
            if stop > end:
                raise Fallback
            if len(tlvs) == MAX_TLVS:
                # the reference decoder's error too, as every TLV before is well formed
                raise _Decided(too_many_tlvs(pos - 4, tlv_type).as_framing())
            if tlv_type <= previous:
                raise Fallback
            previous = tlv_type
            if tlv_type in MANDATORY_TYPES:
                mandatory += 1
            decoder = compiled(tlv_type)
            if decoder is None:
                tlv = new(UnknownTLV)
                setattr_(tlv, "type", tlv_type)
                setattr_(tlv, "value", data[pos:stop])
            else:
                tlv = decoder(data, pos, stop)
            tlvs.append(tlv)
            pos = stop
    if mandatory != len(MANDATORY_TYPES):
        raise Fallback
    adv = object.__new__(Advertisement)
    object.__setattr__(adv, "tlvs", tuple(tlvs))
    return adv


def decode_window(
    data: bytes, start: int, end: int, registry: Registry = DEFAULT_REGISTRY
) -> Advertisement:
    """Decode the attribute value `data[start:end]` (error offsets count from 0 of `data`):
    the compiled decoders first, the reference decoder (`decode_from`) for anything
    they do not accept, so errors are always the reference's."""
    try:
        return _decode_compiled(data, start, end, registry)
    except _Decided as verdict:
        raise verdict.error from None
    except _FALLBACK:
        return decode_from(Reader(data, start, end), registry)


def decode(data: bytes, registry: Registry = DEFAULT_REGISTRY) -> Advertisement:
    """Decode an attribute value; raises CodecError (and nothing else) on bad input."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"decode needs bytes, not {type(data).__name__}")
    data = bytes(data)
    return decode_window(data, 0, len(data), registry)
