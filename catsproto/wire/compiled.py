"""Compiled decoders: one straight-line Python function per record class, for speed.

Strategy: `Record.decode_from` (the *reference* decoder) walks a record's layout with a
`Reader`, calling one codec method per field; it is the authority on what is accepted
and says exactly where and why something is refused. On the receive path that
generality costs more than the rest of the checks together (about 3 µs per record), so
`compile_record` turns the same layout, once per class when a `Registry` is built, into
the code one would write by hand for that class: a precompiled `struct` per run of
fixed-width fields, range checks inlined as comparisons, enum lookups as dict gets,
lists of fixed-width items unpacked with `iter_unpack`, and the frozen object filled
through its slot-compatible twin (`filling_class`; its range checks already done while
reading). The function works on
`(data, pos, end)` integers, with no `Reader` and no intermediate objects. On top,
`compile_sequence` inlines the registered TLV types' bodies into one function that
decodes an advertisement's TLVs in increasing type order without a call per TLV.

A compiled decoder never says *why*: on anything it does not accept (a short field, a
value out of range, a failing `validate`) it raises `Fallback`, and the caller
(`advertisement.decode`) re-runs the reference decoder on the same bytes, which either
raises the precise `CodecError` or, should the compiled code ever be stricter than the
reference, returns the reference's answer. So the compiled path can only change speed:
`tests/test_wire_compiled.py` checks that it gives the same objects (by repr: enum
members, not ints) as the reference on every vector and on mutated inputs. Codecs this
module does not know are called through a `Reader` from the generated code, so a
record with a new field type still compiles (at the reference speed for that field).
"""

from __future__ import annotations

import math
import operator
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

from catsproto.wire.buffer import Reader
from catsproto.wire.fields import (
    Address,
    Blob,
    EnumCodec,
    FieldCodec,
    Float64,
    Items,
    OpenEnumCodec,
    Record,
    Text,
    UInt,
    _FixedRun,
)

FastDecoder = Callable[[bytes, int, int], tuple[Any, int]]
_FLOAT_MAX = 1.7976931348623157e308  # NaN and the infinities fail -max <= v <= max


class Fallback(Exception):  # a signal, not an error: the reference decides
    """The compiled decoder does not accept these bytes; ask the reference decoder."""


class _Source:
    """The generated function's lines and the constants they refer to."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, object] = {
            "Fallback": Fallback,
            "new": object.__new__,
            "setattr_": object.__setattr__,
            "Reader": Reader,
            "FMAX": _FLOAT_MAX,
            "copysign": math.copysign,
        }
        self._n = 0

    def const(self, prefix: str, value: object) -> str:
        self._n += 1
        name = f"{prefix}{self._n}"
        self.names[name] = value
        return name

    def var(self, prefix: str = "v") -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)


def _is_fixed(cls: type[Record]) -> bool:
    return len(cls._STEPS) == 1 and isinstance(cls._STEPS[0], _FixedRun)


def _convert(src: _Source, ind: int, codec: FieldCodec, v: str) -> None:
    """Lines that range-check (and for enums, replace) the freshly unpacked `v`."""
    if isinstance(codec, OpenEnumCodec):  # any code in range; known ones become members
        _convert(src, ind, codec.inner, v)
        members = src.const("M", codec.members)
        src.emit(ind, f"{v} = {members}.get({v}, {v})")
    elif isinstance(codec, EnumCodec):  # an unknown code raises KeyError: fallback
        members = src.const("M", codec.members)
        src.emit(ind, f"{v} = {members}[{v}]")
    elif isinstance(codec, UInt):
        full = (1 << (8 * codec.width)) - 1
        if codec.lo > 0 and codec.hi < full:
            src.emit(ind, f"if not {codec.lo} <= {v} <= {codec.hi}: raise Fallback")
        elif codec.lo > 0:
            src.emit(ind, f"if {v} < {codec.lo}: raise Fallback")
        elif codec.hi < full:
            src.emit(ind, f"if {v} > {codec.hi}: raise Fallback")
    elif isinstance(codec, Float64):
        src.emit(ind, f"if not -FMAX <= {v} <= FMAX: raise Fallback")
        src.emit(ind, f"if {v} == 0.0 and copysign(1.0, {v}) < 0: raise Fallback")  # -0.0
    else:  # a fixed-width codec of someone else's: its own convert (CodecError -> fallback)
        c = src.const("C", codec)
        src.emit(ind, f"{v} = {c}.convert({v}, '', 0, None)")


def _setter(cls: type[Record], name: str) -> Callable[[object, object], None] | None:
    """The slot's own `__set__` (a frozen dataclass refuses `setattr`; the slot does not)."""
    for klass in cls.__mro__:
        slot = klass.__dict__.get(name)
        if slot is not None:
            return getattr(slot, "__set__", None)
    return None


_TWINS: dict[type, type | None] = {}


def filling_class(cls: type) -> type | None:
    """A class with `cls`'s bases and slots but no `__setattr__` of its own, or None.

    Filling a frozen slotted dataclass costs one slot `__set__` call per field (the
    class's `__setattr__` refuses). Its twin takes plain attribute stores, the fastest
    way CPython fills slots, and then becomes a `cls` by `__class__` assignment, which
    CPython allows between classes of the same base and slot layout:

        obj = object.__new__(twin); obj.a = 1; obj.b = 2; obj.__class__ = cls

    The result is an ordinary frozen `cls` (about 0.6 of the setter calls' cost at five
    fields); the twin is never seen outside the code that fills it. None when `cls`
    has no slots of its own or a base has its own `__setattr__`.
    """
    if cls in _TWINS:
        return _TWINS[cls]
    slots = cls.__dict__.get("__slots__")
    twin: type | None = None
    if isinstance(slots, tuple) and not any("__setattr__" in k.__dict__ for k in cls.__mro__[1:-1]):
        twin = type(f"{cls.__name__}Filling", cls.__bases__, {"__slots__": slots})
        probe = object.__new__(twin)
        try:
            probe.__class__ = cls
        except TypeError:  # layouts differ after all: fill slot by slot
            twin = None
    _TWINS[cls] = twin
    return twin


def _twin(cls: type[Record]) -> type | None:
    """`filling_class(cls)` when every layout field is one of its own slots."""
    twin = filling_class(cls)
    slots = cls.__dict__.get("__slots__", ())
    if twin is None or not {name for name, _ in cls._LAYOUT} <= set(slots):
        return None
    return twin


def _int_keys(item: type[Record], keys: tuple[str, ...]) -> bool:
    """Whether every key field of `item` decodes to an int (a -1 sentinel then sorts first)."""
    codecs = dict(item._LAYOUT)
    return all(isinstance(codecs.get(k), UInt | EnumCodec) for k in keys)


def _inline_order(cls: type[Record]) -> tuple[str, tuple[str, ...]] | None:
    """`cls.SORTED_BY` when the compiled code checks it while reading the list (the
    record's `validate` is the base one, which checks nothing else)."""
    if cls.SORTED_BY is None or cls.validate is not Record.validate:
        return None
    field, keys = cls.SORTED_BY
    codec = dict(cls._LAYOUT).get(field)
    if not isinstance(codec, Items) or not _int_keys(codec.item, keys):
        return None
    return cls.SORTED_BY


def _build(src: _Source, ind: int, cls: type[Record], values: list[str], out: str) -> None:
    """Lines making `out`, an instance of `cls` holding `values`, then its `validate`
    (unless its only rule, the list order, was checked while reading)."""
    k = src.const("K", cls)
    twin = _twin(cls)
    if twin is not None:
        src.emit(ind, f"{out} = new({src.const('T', twin)})")
        for (name, _), v in zip(cls._LAYOUT, values, strict=True):
            src.emit(ind, f"{out}.{name} = {v}")
        src.emit(ind, f"{out}.__class__ = {k}")
    else:
        src.emit(ind, f"{out} = new({k})")
        for (name, _), v in zip(cls._LAYOUT, values, strict=True):
            setter = _setter(cls, name)
            if setter is None:
                src.emit(ind, f"setattr_({out}, {name!r}, {v})")
            else:
                src.emit(ind, f"{src.const('set_' + name + '_', setter)}({out}, {v})")
    if cls.validate is not Record.validate or (
        cls.SORTED_BY is not None and _inline_order(cls) is None
    ):
        src.emit(ind, f"{out}.validate()")


def _fixed_run(src: _Source, ind: int, run: _FixedRun) -> list[str]:
    s = src.const("S", run.struct)
    values = [src.var() for _ in run.fields]
    size = run.struct.size
    src.emit(ind, f"if end - pos < {size}: raise Fallback")
    unpacked = ", ".join(values) + ("," if len(values) == 1 else "")
    src.emit(ind, f"{unpacked} = {s}.unpack_from(data, pos)")
    src.emit(ind, f"pos += {size}")
    for (_, codec), v in zip(run.fields, values, strict=True):
        _convert(src, ind, codec, v)
    return values


def _blob(src: _Source, ind: int, codec: Blob, v: str) -> None:
    n = src.var("n")
    if codec.width == 0:
        src.emit(ind, f"{n} = end - pos")
    elif codec.width == 1:
        src.emit(ind, "if pos >= end: raise Fallback")
        src.emit(ind, f"{n} = data[pos]")
        src.emit(ind, "pos += 1")
    else:
        u16 = src.const("S", struct.Struct(">H"))
        src.emit(ind, "if end - pos < 2: raise Fallback")
        src.emit(ind, f"{n}, = {u16}.unpack_from(data, pos)")
        src.emit(ind, "pos += 2")
    if codec.min_len > 0:
        src.emit(ind, f"if {n} < {codec.min_len}: raise Fallback")
    src.emit(ind, f"if {n} > {codec.max_len} or {n} > end - pos: raise Fallback")
    src.emit(ind, f"{v} = data[pos:pos + {n}]")
    src.emit(ind, f"pos += {n}")


_ADDRESSES: dict[bytes, object] = {}  # interned: ipaddress objects are immutable
_ADDRESSES_MAX = 4096


def _address(src: _Source, ind: int, v: str) -> None:
    """Lines reading an AFI-tagged address into `v`. Addresses recur (one origin sends
    many advertisements), and making an ipaddress object costs as much as the rest of
    its TLV, so each distinct address is made once, up to `_ADDRESSES_MAX` of them."""
    import ipaddress

    u16 = src.const("S", struct.Struct(">H"))
    v4 = src.const("A", ipaddress.IPv4Address)
    v6 = src.const("A", ipaddress.IPv6Address)
    seen = src.const("AD", _ADDRESSES)
    afi, raw = src.var("afi"), src.var("raw")
    src.emit(ind, "if end - pos < 2: raise Fallback")
    src.emit(ind, f"{afi}, = {u16}.unpack_from(data, pos)")
    src.emit(ind, f"if {afi} == 1 and end - pos >= 6:")
    src.emit(ind + 1, f"{raw} = data[pos + 2:pos + 6]")
    src.emit(ind + 1, "pos += 6")
    src.emit(ind, f"elif {afi} == 2 and end - pos >= 18:")
    src.emit(ind + 1, f"{raw} = data[pos + 2:pos + 18]")
    src.emit(ind + 1, "pos += 18")
    src.emit(ind, "else: raise Fallback")
    src.emit(ind, f"{v} = {seen}.get({raw})")
    src.emit(ind, f"if {v} is None:")
    src.emit(ind + 1, f"{v} = {v4}({raw}) if len({raw}) == 4 else {v6}({raw})")
    src.emit(ind + 1, f"if len({seen}) < {_ADDRESSES_MAX}: {seen}[{raw}] = {v}")


def _order_check(src: _Source, ind: int, key: str, prev: str) -> None:
    k = src.var("key")
    src.emit(ind, f"{k} = {key}")
    src.emit(ind, f"if {k} <= {prev}: raise Fallback  # not strictly increasing")
    src.emit(ind, f"{prev} = {k}")


def _items(src: _Source, ind: int, codec: Items, v: str, order: tuple[str, ...] = ()) -> None:
    """Lines reading a list into `v`; with `order`, also that it is strictly increasing
    by those (integer) item fields."""
    item = codec.item
    acc, prev = src.var("items"), src.var("prev")
    src.emit(ind, f"{acc} = []")
    if order:
        src.emit(ind, f"{prev} = {'-1' if len(order) == 1 else '(-1,)'}")
    if codec.prefix == 0 and _is_fixed(item):
        run = item._STEPS[0]
        assert isinstance(run, _FixedRun)
        s = src.const("S", run.struct)
        size = run.struct.size
        src.emit(ind, f"if pos == end or (end - pos) % {size}: raise Fallback")
        values = [src.var() for _ in run.fields]
        unpacked = ", ".join(values) + ("," if len(values) == 1 else "")
        src.emit(ind, f"for {unpacked} in {s}.iter_unpack(data[pos:end]):")
        for (_, fc), fv in zip(run.fields, values, strict=True):
            _convert(src, ind + 1, fc, fv)
        if order:
            by_name = {name: fv for (name, _), fv in zip(run.fields, values, strict=True)}
            parts = [by_name[k] for k in order]
            key = parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
            _order_check(src, ind + 1, key, prev)
        obj = src.var("o")
        _build(src, ind + 1, item, values, obj)
        src.emit(ind + 1, f"{acc}.append({obj})")
        src.emit(ind, "pos = end")
    else:
        decode = src.const("D", compile_record(item))
        obj, stop = src.var("o"), src.var("stop")
        src.emit(ind, "while pos < end:")
        if codec.prefix == 0:
            src.emit(ind + 1, f"{obj}, pos = {decode}(data, pos, end)")
        else:
            if codec.prefix == 1:
                src.emit(ind + 1, "if pos >= end: raise Fallback")
                src.emit(ind + 1, f"{stop} = pos + 1 + data[pos]")
                src.emit(ind + 1, "pos += 1")
            else:
                u16 = src.const("S", struct.Struct(">H"))
                src.emit(ind + 1, "if end - pos < 2: raise Fallback")
                src.emit(ind + 1, f"{stop} = pos + 2 + {u16}.unpack_from(data, pos)[0]")
                src.emit(ind + 1, "pos += 2")
            src.emit(ind + 1, f"if {stop} > end: raise Fallback")
            src.emit(ind + 1, f"{obj}, pos = {decode}(data, pos, {stop})")
            src.emit(ind + 1, f"if pos != {stop}: raise Fallback")
        if order:
            getter = src.const("KEY", operator.attrgetter(*order))
            _order_check(src, ind + 1, f"{getter}({obj})", prev)
        src.emit(ind + 1, f"{acc}.append({obj})")
        src.emit(ind, f"if not {acc}: raise Fallback")
    src.emit(ind, f"{v} = tuple({acc})")


def _field(
    src: _Source, ind: int, name: str, codec: FieldCodec, order: tuple[str, ...] = ()
) -> str:
    v = src.var()
    if isinstance(codec, Text):
        raw = src.var("raw")
        _blob(src, ind, codec.blob, raw)
        src.emit(ind, f"{v} = {raw}.decode('utf-8')")  # UnicodeDecodeError -> fallback
    elif type(codec) is Blob:
        _blob(src, ind, codec, v)
    elif type(codec) is Address:
        _address(src, ind, v)
    elif type(codec) is Items:
        _items(src, ind, codec, v, order)
    else:  # unknown codec: through a Reader, as the reference does
        c, r = src.const("C", codec), src.var("r")
        src.emit(ind, f"{r} = Reader(data, pos, end)")
        src.emit(ind, f"{v} = {c}.read({r}, {name!r})")
        src.emit(ind, f"pos = {r}.offset")
    return v


def compile_record(cls: type[Record]) -> FastDecoder:
    """`decode(data, pos, end) -> (record, pos_after)` for `cls`; raises `Fallback`.

    Reads one `cls` from `data[pos:end]`, leaving any bytes after it to the caller.
    The generated source is kept as the function's `source` attribute.
    """
    src = _Source()
    out = _body(src, 1, cls)
    src.emit(1, f"return {out}, pos")
    return _define(src, f"decode_{cls.__name__}", "data, pos, end")  # type: ignore[return-value]


def compile_tlv_value(cls: type[Record]) -> Callable[[bytes, int, int], Any]:
    """`decode(data, pos, end) -> record` for a TLV value that must fill `[pos, end)`."""
    src = _Source()
    out = _body(src, 1, cls)
    src.emit(1, "if pos != end: raise Fallback")
    src.emit(1, f"return {out}")
    return _define(src, f"decode_{cls.__name__}", "data, pos, end")


SequenceDecoder = Callable[[bytes, int, int], tuple[list[Any], int, int, int]]


def compile_sequence(
    classes: Mapping[int, type[Record]], mandatory: frozenset[int]
) -> SequenceDecoder:
    """`decode(data, pos, end) -> (tlvs, pos, last_type, mandatory_seen)`: the leading
    TLVs of `data[pos:end]` whose types are registered, in increasing order, each
    decoded inline (no call, no dispatch per TLV). It stops at the first TLV it does not
    expect there (an unregistered type, or one out of order) and returns where: the
    caller goes on from `pos` with its TLV-by-TLV loop, which knows unknown types and
    refuses disorder. Raises `Fallback` like the record decoders.
    """
    src = _Source()
    header = src.const("H", struct.Struct(">HH"))

    def next_header(ind: int) -> None:
        src.emit(ind, "if end - at >= 4:")
        src.emit(ind + 1, f"t, n = {header}.unpack_from(data, at)")
        src.emit(ind + 1, "stop = at + 4 + n")
        src.emit(ind + 1, "if stop > end: raise Fallback")
        src.emit(ind, "else:")
        src.emit(ind + 1, "t = -1  # done, or a tail too short for a header")

    src.emit(1, "tlvs = []")
    src.emit(1, "append = tlvs.append")
    src.emit(1, "previous = -1")
    src.emit(1, "mandatory = 0")
    src.emit(1, "at = pos")
    next_header(1)
    for code in sorted(classes):
        src.emit(1, f"if t == {code}:")
        src.emit(2, "pos = at + 4")
        first = len(src.lines)
        out = _body(src, 2, classes[code])
        # the body reads up to its TLV's end, `stop`, not the window's
        src.lines[first:] = [re.sub(r"\bend\b", "stop", line) for line in src.lines[first:]]
        src.emit(2, "if pos != stop: raise Fallback")
        src.emit(2, f"append({out})")
        src.emit(2, f"previous = {code}")
        if code in mandatory:
            src.emit(2, "mandatory += 1")
        src.emit(2, "at = stop")
        next_header(2)
    src.emit(1, "return tlvs, at, previous, mandatory")
    return _define(src, "decode_sequence", "data, pos, end")  # type: ignore[return-value]


def _body(src: _Source, ind: int, cls: type[Record]) -> str:
    """Lines reading one `cls` from `pos` (window end `end`); returns the object's name."""
    values: list[str] = []
    sorted_by = _inline_order(cls)
    for step in cls._STEPS:
        if isinstance(step, _FixedRun):
            values += _fixed_run(src, ind, step)
        else:
            name, codec = step
            order = sorted_by[1] if sorted_by is not None and sorted_by[0] == name else ()
            values.append(_field(src, ind, name, codec, order))
    out = src.var("obj")
    _build(src, ind, cls, values, out)
    return out


def _define(src: _Source, name: str, args: str) -> Callable[..., Any]:
    text = f"def {name}({args}):\n" + "\n".join(src.lines) + "\n"
    exec(compile(text, f"<compiled {name}>", "exec"), src.names)
    fn = src.names[name]
    fn.source = text  # type: ignore[attr-defined]
    return fn  # type: ignore[no-any-return]
