"""msgpack encoding of the protocol records: versioned envelopes of plain values, never pickle."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgpack

from shared import protocol
from shared.sampling import SamplingParams

PROTOCOL_VERSION = 1

MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        protocol.ExecutorReady,
        protocol.StepPlan,
        protocol.StepResult,
        protocol.SchedulerReady,
        protocol.GenerateRequest,
        protocol.AbortRequest,
        protocol.TokenDeltas,
        protocol.ExecutorHeartbeat,
        protocol.Shutdown,
        protocol.KvStateRequest,
        protocol.KvState,
    )
}


class WireError(ValueError):
    """A message that is not ours, or from another protocol version."""


def encode(message: Any) -> bytes:
    name = type(message).__name__
    if name not in MESSAGE_TYPES:
        raise WireError(f"{name} is not a protocol message")
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": name, "d": _to_plain(message)})


def decode(data: bytes) -> Any:
    envelope = msgpack.unpackb(data, strict_map_key=False)
    if not isinstance(envelope, dict) or envelope.get("v") != PROTOCOL_VERSION:
        raise WireError(f"unsupported message envelope (want protocol v{PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES.get(envelope.get("t"))
    if cls is None:
        raise WireError(f"unknown message type {envelope.get('t')!r}")
    return _from_plain(cls, envelope["d"])


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _from_plain(tp: Any, value: Any) -> Any:
    """Rebuild `value` as type `tp` (dataclasses, lists, tuples, optionals, dicts, scalars)."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_plain(inner[0], value) if len(inner) == 1 else value
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_from_plain(item, v) for v in value]
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_plain(args[0], v) for v in value)
        return tuple(_from_plain(a, v) for a, v in zip(args, value))
    if origin is dict or tp is dict:
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        return tp(**{name: _from_plain(hints[name], v) for name, v in value.items()})
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        namespace = {**vars(protocol), "SamplingParams": SamplingParams}
        _HINTS[cls] = typing.get_type_hints(cls, globalns=namespace)
    return _HINTS[cls]
