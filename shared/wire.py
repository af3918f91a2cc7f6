"""msgpack encoding of the protocol records: versioned envelopes of plain values, never pickle.

A record travels as the list of its field values in declaration order (no field names: smaller,
and msgpack packs lists faster than maps); the per-step records leave off their trailing fields
at their defaults (a decode's sequence needs none of its optional ones). Each record type gets
an encoder and a decoder built once from its type hints, so a step's plan of hundreds of
sequences costs no per-value type inspection: it is on every step's critical path (the
executor decodes the plan before it can start, and encodes the result before the scheduler can
go on).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import msgpack

from shared import protocol
from shared.sampling import SamplingParams

PROTOCOL_VERSION = 4

MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        protocol.ExecutorReady,
        protocol.StepPlan,
        protocol.StepResult,
        protocol.SchedulerReady,
        protocol.GenerateRequest,
        protocol.AbortRequest,
        protocol.GatewayHello,
        protocol.TokenDeltas,
        protocol.ExecutorHeartbeat,
        protocol.CompileGrammar,
        protocol.GrammarCompiled,
        protocol.ForgetGrammars,
        protocol.Shutdown,
        protocol.KvStateRequest,
        protocol.KvState,
    )
}

_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


class WireError(ValueError):
    """A message that is not ours, or from another protocol version, or malformed."""


def encode(message: Any) -> bytes:
    name = type(message).__name__
    if name not in MESSAGE_TYPES:
        raise WireError(f"{name} is not a protocol message")
    return msgpack.packb([PROTOCOL_VERSION, name, _encoder(type(message))(message)])


def decode(data: bytes) -> Any:
    try:
        envelope = msgpack.unpackb(data, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise WireError(f"not a msgpack message: {exc}") from None
    if not isinstance(envelope, list) or len(envelope) != 3 or envelope[0] != PROTOCOL_VERSION:
        raise WireError(f"unsupported message envelope (want protocol v{PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES.get(envelope[1]) if isinstance(envelope[1], str) else None
    if cls is None:
        raise WireError(f"unknown message type {envelope[1]!r}")
    try:
        return _decoder(cls)(envelope[2])
    except (TypeError, KeyError, IndexError) as exc:
        raise WireError(f"malformed {cls.__name__}: {exc}") from None


# ---- encoding: one function per type, built from the type hints ----------------------------------
_ENCODERS: dict[Any, Callable[[Any], Any] | None] = {}


def _encoder(tp: Any) -> Callable[[Any], Any] | None:
    """The function that turns a value of type `tp` into plain values; None where msgpack packs
    it as it is (scalars, lists, tuples and dicts of scalars)."""
    if tp in _ENCODERS:
        return _ENCODERS[tp]
    _ENCODERS[tp] = None  # a placeholder while building: no record type refers to itself
    origin = typing.get_origin(tp)
    encoder = None
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        item = _encoder(inner[0]) if len(inner) == 1 else None
        if item is not None:
            encoder = lambda v: None if v is None else item(v)  # noqa: E731
    elif origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = {_encoder(a) for a in args}
        if origin is list and len(items) == 1 and None not in items:
            # A list of records (a plan's sequences, a step's tokens and deltas): their encoder
            # directly, not looked up per item.
            (item,) = items
            encoder = lambda v: [item(x) for x in v]  # noqa: E731
        elif items != {None}:
            encoder = _plain_sequence
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        encoder = _record_encoder(tp)
    _ENCODERS[tp] = encoder
    return encoder


def _plain_sequence(value: Any) -> list:
    return [_to_plain(v) for v in value]


def _to_plain(value: Any) -> Any:
    """For values whose type is known only at run time (items of sequences of records)."""
    encoder = _encoder(type(value)) if type(value) not in _SCALARS else None
    return encoder(value) if encoder is not None else value


def _record_encoder(cls: type) -> Callable[[Any], Any]:
    """The list of the record's field values, its trailing fields at their defaults left off.

    Generated as straight-line code, one line per field (as dataclasses generates __init__):
    a plan of 256 decodes is 256 records, and a loop over each one's fields, with a call per
    field to test its default, cost the scheduler about 1 ms a step at that batch."""
    hints = _hints(cls)
    fields = [(f.name, _encoder(hints[f.name])) for f in dataclasses.fields(cls)]
    # Requests from clients travel whole: they are checked field by field on arrival.
    defaults = [_NO_DEFAULT] * len(fields) if cls in _CHECKED else _plain_defaults(cls)
    namespace: dict[str, Any] = {}
    lines = ["def encode_record(value):"]
    for i, (name, enc) in enumerate(fields):
        namespace[f"e{i}"] = enc
        read = f"value.{name}" if enc is None else f"e{i}(value.{name})"
        lines.append(f"    f{i} = {read}")
    # From the last field back: the first that is not at its default (a required field never
    # is) ends the list. Same type too: a False must not travel as a left-off 0 (or 0.0) and
    # come back as one.
    for i in reversed(range(len(fields))):
        kept = "[" + ", ".join(f"f{j}" for j in range(i + 1)) + "]"
        if defaults[i] is _NO_DEFAULT:
            lines.append(f"    return {kept}")
            break
        namespace[f"d{i}"], namespace[f"t{i}"] = defaults[i], type(defaults[i])
        lines.append(f"    if type(f{i}) is not t{i} or f{i} != d{i}:")
        lines.append(f"        return {kept}")
    else:
        lines.append("    return []")
    exec("\n".join(lines), namespace)  # noqa: S102 - our own field names, built at import
    return namespace["encode_record"]


_NO_DEFAULT = object()


def _plain_defaults(cls: type) -> list[Any]:
    """Each field's default as the encoder writes it; _NO_DEFAULT for a required field."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            out.append(_NO_DEFAULT)
            continue
        out.append(_to_plain(default))
    return out


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns={**vars(protocol), "SamplingParams": SamplingParams})


# ---- decoding: one function per type, built from the type hints ----------------------------------
_DECODERS: dict[Any, Callable[[Any], Any] | None] = {}


def _decoder(tp: Any) -> Callable[[Any], Any]:
    decoder = _build(tp)
    return decoder if decoder is not None else _identity


def _identity(value: Any) -> Any:
    return value


def _build(tp: Any) -> Callable[[Any], Any] | None:
    """The function that rebuilds a plain value as type `tp`; None where the plain value
    already is one (scalars, lists of scalars, dicts of scalars)."""
    if tp in _DECODERS:
        return _DECODERS[tp]
    _DECODERS[tp] = None  # a placeholder while building: no record type refers to itself
    decoder = _make(tp)
    _DECODERS[tp] = decoder
    return decoder


def _make(tp: Any) -> Callable[[Any], Any] | None:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        item = _build(inner[0]) if len(inner) == 1 else None
        if item is None:
            return None
        return lambda v: None if v is None else item(v)
    if origin is list:
        item = _build(typing.get_args(tp)[0])
        if item is None:
            return None
        return lambda v: [item(x) for x in v]
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _build(args[0])
            if item is None:
                return tuple
            return lambda v: tuple(item(x) for x in v)
        items = [_build(a) or _identity for a in args]

        def fixed_tuple(v: Any) -> tuple:
            if len(v) != len(items):
                raise TypeError(f"a tuple of {len(items)} items has {len(v)}")
            return tuple(f(x) for f, x in zip(items, v))

        return fixed_tuple
    if origin is dict or tp is dict:
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record_decoder(tp)
    return None


def _record_decoder(cls: type) -> Callable[[Any], Any]:
    hints = _hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    converters = [(i, _build(hints[name])) for i, name in enumerate(fields)]
    converters = [(i, f) for i, f in converters if f is not None]
    # Requests (what the gateway forwards from clients) are checked field by field: a record
    # with a wrong value is refused here, not deep inside the scheduler's intake. The per-step
    # records between our own processes skip the checks: they are on the step's critical path.
    checks = []
    if cls in _CHECKED:
        checks = [(i, name, _wire_types(hints[name])) for i, name in enumerate(fields)]
        checks = [(i, name, types_) for i, name, types_ in checks if types_ is not None]
    num_fields = len(fields)
    # Trailing fields at their defaults are left off by the encoder; the required ones never.
    num_required = sum(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )

    def decode_record(value: Any) -> Any:
        if not isinstance(value, list) or not num_required <= len(value) <= num_fields:
            raise TypeError(f"{cls.__name__} needs {num_fields} fields")
        present = len(value)
        for i, name, allowed in checks:
            if i < present and not isinstance(value[i], allowed):
                raise TypeError(f"field {name} is a {type(value[i]).__name__}")
        for i, convert in converters:
            if i < present and value[i] is not None:
                value[i] = convert(value[i])
        return cls(*value)

    return decode_record


_CHECKED = frozenset(
    {
        protocol.GenerateRequest,
        protocol.AbortRequest,
        protocol.GatewayHello,
        protocol.KvStateRequest,
        protocol.Shutdown,
        SamplingParams,
    }
)
_PLAIN = {int: (int,), float: (int, float), str: (str,), bool: (bool,), bytes: (bytes,)}


def _wire_types(tp: Any) -> tuple[type, ...] | None:
    """What msgpack yields for a field of type `tp`; None where that is not checked (unions of
    several types, Any)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) != 1:
            return None
        allowed = _wire_types(inner[0])
        optional = type(None) in typing.get_args(tp)
        return None if allowed is None else allowed + ((type(None),) if optional else ())
    if origin in (list, tuple) or tp in (list, tuple):
        return (list,)
    if origin is dict or tp is dict:
        return (dict,)
    if tp in _PLAIN:
        return _PLAIN[tp]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return (list,)
    return None
