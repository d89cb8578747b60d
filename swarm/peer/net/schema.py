"""The wire schema engine: a frame's JSON metadata and tensors checked against a dataclass.

Theory of operation: a message is a frame (``swarm.peer.net.wire``) whose metadata is a UTF-8
JSON object holding the message's plain fields, and whose tensors are its ``numpy`` fields in
declaration order. A field named ``request_id`` travels in the frame header instead of the JSON.
The schema of each kind is its dataclass annotations, read once at import; the kinds themselves
(the message catalogue) are in ``swarm.peer.net.messages``, each registered with
``@message(KIND)``.

Schema types (docs/protocol.md, "Metadata"):

* ``int``: a non-negative integer below 2**53 (exact in a JS number); never a bool.
* ``float``: a finite number (JSON integers accepted, as ``JSON.stringify(1.0)`` gives ``1``).
* ``str`` (at most :data:`MAX_STR` characters), ``bool``, ``Literal[...]`` of strings,
  ``X | None``, ``tuple[X, ...]`` (JSON array), ``tuple[X, Y]`` (fixed-length array),
  ``dict[str, X]`` (JSON object), and nested frozen dataclasses (JSON object, exact keys).
* ``Annotated[np.ndarray, TensorSpec(...)]``: a tensor with the allowed wire dtypes and rank.

Decoding checks everything: unknown kind, bad JSON, duplicate, missing or extra keys, wrong
types, out-of-range ints, tensor count/dtype/rank, then the kind's own cross-field rules
(``_check``, raising :class:`Invalid`), and raises :class:`~swarm.errors.MessageError` naming
the kind and field. Encoding the same message locally raises
:class:`~swarm.errors.LocalProtocolError` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, cast, dataclass_transform

import numpy as np

from swarm.errors import LocalProtocolError, MessageError
from swarm.peer.net import wire

MAX_STR = 4096  # characters per string field
MAX_INT = 2**53 - 1  # largest integer a JS number holds exactly
MAX_FLOAT_INT = 2**1023  # integers of a float field below this convert to a finite float

_F = TypeVar("_F", bound=Callable[..., Any])


def _cached(fn: _F) -> _F:
    """``functools.cache`` that keeps ``fn``'s signature for the type checker (mypy takes a class
    for an unhashable argument of the cache's own)."""
    return cast(_F, functools.cache(fn))


@dataclass(frozen=True)
class TensorSpec:
    """Allowed wire dtypes (names from ``wire.DTYPES``) and rank of a tensor field."""

    dtypes: tuple[str, ...]
    rank: int



class Invalid(Exception):
    """A schema violation; mapped to MessageError (decode) or LocalProtocolError (encode)."""


# --- schema -----------------------------------------------------------------------------------


def _check_value(v: Any, tp: Any, where: str) -> Any:
    """Check a JSON-decoded value against a schema type; returns it in its Python form."""
    origin = typing.get_origin(tp)
    if tp is int:
        if type(v) is not int or not 0 <= v <= MAX_INT:
            raise Invalid(f"{where}: expected an integer in 0..2**53-1, got {v!r:.60}")
        return v
    if tp is float:
        try:
            as_float = float(v) if type(v) in (int, float) else math.nan
        except OverflowError:  # an integer of hundreds of digits
            as_float = math.inf
        if not math.isfinite(as_float):
            raise Invalid(f"{where}: expected a finite number, got {v!r:.60}")
        return as_float
    if tp is str:
        if type(v) is not str or len(v) > MAX_STR:
            raise Invalid(f"{where}: expected a string of at most {MAX_STR} characters, got {v!r:.60}")
        return v
    if tp is bool:
        if type(v) is not bool:
            raise Invalid(f"{where}: expected true or false, got {v!r:.60}")
        return v
    if origin is Literal:
        if type(v) is not str or v not in typing.get_args(tp):
            raise Invalid(f"{where}: expected one of {list(typing.get_args(tp))}, got {v!r:.60}")
        return v
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check_value(v, inner, where)
    if origin is tuple:
        args = typing.get_args(tp)
        if type(v) not in (list, tuple):
            raise Invalid(f"{where}: expected an array, got {v!r:.60}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_value(x, args[0], f"{where}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise Invalid(f"{where}: expected an array of {len(args)} items, got {len(v)}")
        return tuple(_check_value(x, a, f"{where}[{i}]") for i, (x, a) in enumerate(zip(v, args)))
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if type(v) is not dict:
            raise Invalid(f"{where}: expected an object, got {v!r:.60}")
        return {_check_value(k, str, f"{where} key"): _check_value(x, val_tp, f"{where}.{k}") for k, x in v.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if type(v) is tp:
            v = _to_json(v, tp)
        if type(v) is not dict:
            raise Invalid(f"{where}: expected an object, got {v!r:.60}")
        fields = _plain_fields(tp)
        if set(v) != set(fields):
            raise Invalid(f"{where}: keys {sorted(v)} differ from {sorted(fields)}")
        return tp(**{name: _check_value(v[name], ftp, f"{where}.{name}") for name, ftp in fields.items()})
    raise TypeError(f"unsupported schema type {tp!r} at {where}")  # a bug in a message definition


def _to_json(v: Any, tp: Any) -> Any:
    """The JSON form of a Python field value (tuples → lists, dataclasses → objects)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(v):
        return {name: _to_json(getattr(v, name), ftp) for name, ftp in _plain_fields(tp).items()}
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType) and v is not None:
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _to_json(v, inner)
    if origin is tuple and isinstance(v, (list, tuple)):
        args = typing.get_args(tp)
        item_tps = [args[0]] * len(v) if len(args) == 2 and args[1] is Ellipsis else list(args)
        return [_to_json(x, t) for x, t in zip(v, item_tps)]
    if origin is dict and isinstance(v, dict):
        val_tp = typing.get_args(tp)[1]
        return {k: _to_json(x, val_tp) for k, x in v.items()}
    return v


# Compiled checkers: the same rules as _check_value and _to_json, resolved once per schema type
# into closures, so the hot path (a stage or expert request per layer or step) does not walk
# typing objects for every value. They raise a bare Invalid; the callers then run the
# interpreting versions above, which raise the message naming the field.


@_cached
def _checker(tp: Any) -> Callable[[Any], Any]:
    """A function: JSON or Python value → its Python form under ``tp``; Invalid when it breaks it."""
    origin = typing.get_origin(tp)
    if tp is int:
        def check(v):
            if type(v) is not int or not 0 <= v <= MAX_INT:
                raise Invalid
            return v
    elif tp is float:
        def check(v):
            if type(v) is float and math.isfinite(v):
                return v
            if type(v) is int and -MAX_FLOAT_INT <= v <= MAX_FLOAT_INT:
                return float(v)
            raise Invalid  # the interpreting check tells which
    elif tp is str:
        def check(v):
            if type(v) is not str or len(v) > MAX_STR:
                raise Invalid
            return v
    elif tp is bool:
        def check(v):
            if type(v) is not bool:
                raise Invalid
            return v
    elif origin is Literal:
        allowed = frozenset(typing.get_args(tp))

        def check(v):
            if type(v) is not str or v not in allowed:
                raise Invalid
            return v
    elif origin in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        inner_check = _checker(inner)

        def check(v):
            return None if v is None else inner_check(v)
    elif origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _checker(args[0])

            def check(v):
                if type(v) not in (list, tuple):
                    raise Invalid
                out = tuple(map(item, v))
                return v if type(v) is tuple and all(a is b for a, b in zip(out, v)) else out
        else:
            items = tuple(_checker(a) for a in args)

            def check(v):
                if type(v) not in (list, tuple) or len(v) != len(items):
                    raise Invalid
                return tuple(c(x) for c, x in zip(items, v))
    elif origin is dict:
        key, value = _checker(str), _checker(typing.get_args(tp)[1])

        def check(v):
            if type(v) is not dict:
                raise Invalid
            return {key(k): value(x) for k, x in v.items()}
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        fields = tuple((name, _checker(ftp)) for name, ftp in _plain_fields(tp).items())
        names = frozenset(_plain_fields(tp))

        def check(v):
            if type(v) is tp:  # a frozen record: itself, when every field checks as it is
                values = {name: c(getattr(v, name)) for name, c in fields}
                return v if all(x is getattr(v, name) for name, x in values.items()) else tp(**values)
            if type(v) is not dict or v.keys() != names:
                raise Invalid
            return tp(**{name: c(v[name]) for name, c in fields})
    else:
        raise TypeError(f"unsupported schema type {tp!r}")  # a bug in a message definition
    return check


@_cached
def _jsonifier(tp: Any) -> Callable[[Any], Any] | None:
    """A function: checked Python value → its JSON form under ``tp``; None where that is the value."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        inner_json = _jsonifier(inner)
        return None if inner_json is None else (lambda v: None if v is None else inner_json(v))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _jsonifier(args[0])
            return list if item is None else (lambda v: list(map(item, v)))
        items = tuple(_jsonifier(a) or (lambda x: x) for a in args)
        return lambda v: [j(x) for j, x in zip(items, v)]
    if origin is dict:
        value = _jsonifier(typing.get_args(tp)[1])
        return None if value is None else (lambda v: {k: value(x) for k, x in v.items()})
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        fields = tuple((name, _jsonifier(ftp) or (lambda x: x)) for name, ftp in _plain_fields(tp).items())
        return lambda v: {name: j(getattr(v, name)) for name, j in fields}
    return None


@_cached
def _compiled_fields(cls: type) -> tuple[tuple[str, Callable[[Any], Any], Callable[[Any], Any] | None], ...]:
    """(name, checker, jsonifier) of each plain field of a message kind."""
    return tuple((name, _checker(tp), _jsonifier(tp)) for name, tp in _plain_fields(cls).items())


@_cached
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _tensor_spec(tp: Any) -> TensorSpec | None:
    if typing.get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, TensorSpec)), None)
    return None


@_cached
def _plain_fields(cls: type) -> dict[str, Any]:
    """JSON fields of a message or nested record, in declaration order."""
    hints = _hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if f.name != "request_id" and _tensor_spec(hints[f.name]) is None
    }


@_cached
def _tensor_fields(cls: type) -> dict[str, TensorSpec]:
    hints = _hints(cls)
    specs = {f.name: _tensor_spec(hints[f.name]) for f in dataclasses.fields(cls)}
    return {name: spec for name, spec in specs.items() if spec is not None}


def _check_tensor(a: Any, spec: TensorSpec, where: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise Invalid(f"{where}: expected a numpy array, got {type(a).__name__}")
    try:
        name = wire.dtype_name(a)
    except LocalProtocolError:
        name = str(a.dtype)
    if name not in spec.dtypes or a.ndim != spec.rank:
        raise Invalid(f"{where}: expected rank {spec.rank} of {'/'.join(spec.dtypes)}, got shape {a.shape} {name}")
    return a


# --- registry ---------------------------------------------------------------------------------

class MessageBase:
    """What every message kind has: its wire ``KIND`` and its cross-field rules (none by default)."""

    KIND: ClassVar[int]

    def _check(self) -> None:
        """Raise Invalid when fields are individually valid but inconsistent together."""


KINDS: dict[int, type[MessageBase]] = {}
"""Message kind (frame header) → message class."""

M = TypeVar("M", bound=type[MessageBase])


@dataclass_transform(frozen_default=True)
def message(kind: int) -> Callable[[M], M]:
    """Class decorator: make a frozen dataclass message of wire ``kind`` and register it."""

    def wrap(cls: M) -> M:
        if kind in KINDS:
            raise TypeError(f"message kind {kind} already used by {KINDS[kind].__name__}")
        has_tensors = any("np.ndarray" in str(a) for a in cls.__annotations__.values())
        # Arrays have no boolean ==; messages with tensors compare by identity (tests compare fields).
        cls = dataclass(frozen=True, eq=not has_tensors)(cls)  # type: ignore[assignment]
        cls.KIND = kind
        KINDS[kind] = cls
        return cls

    return wrap


_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode(msg: MessageBase) -> bytes:
    """The frame that carries ``msg``. LocalProtocolError if a field breaks the kind's schema."""
    cls = type(msg)
    if KINDS.get(getattr(cls, "KIND", -1)) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a registered wire message")
    compiled = _compiled_fields(cls)
    try:
        try:
            fields = {name: check(getattr(msg, name)) for name, check, _ in compiled}
        except Invalid:  # again, for the message naming the field
            fields = {name: _check_value(getattr(msg, name), tp, name) for name, tp in _plain_fields(cls).items()}
        tensors = [_check_tensor(getattr(msg, n), spec, n) for n, spec in _tensor_fields(cls).items()]
        rid = _rid(cls, msg)
        if all(v is getattr(msg, name) for name, v in fields.items()):
            checked = msg  # every field already in its checked form: the cross-field rules on it
        else:
            checked = cls(**fields, **dict(zip(_tensor_fields(cls), tensors)), **rid)
        checked._check()
    except Invalid as exc:
        raise LocalProtocolError(f"{cls.__name__}: {exc}") from None
    meta = _JSON_ENCODER.encode(
        {name: fields[name] if to_json is None else to_json(fields[name]) for name, _, to_json in compiled}
    ).encode()
    return wire.encode_frame(cls.KIND, meta, tensors, request_id=getattr(msg, "request_id", 0))


def _rid(cls: type, msg: Any) -> dict[str, int]:
    if "request_id" not in _hints(cls):
        return {}
    rid = msg.request_id
    if type(rid) is not int or not 0 <= rid <= wire.U32_MAX:
        raise Invalid(f"request_id: expected a u32, got {rid!r:.40}")
    return {"request_id": rid}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise Invalid(f"duplicate key in {[k for k, _ in pairs]!r:.80}")
    return obj


def _no_constants(name: str) -> Any:
    raise Invalid(f"{name} is not a JSON number")


_JSON_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def decode(data: bytes | bytearray | memoryview, max_frame_bytes: int = wire.MAX_FRAME_BYTES) -> MessageBase:
    """Decode one whole frame into its message; tensors are zero-copy views into ``data``.

    Raises FrameError (bad frame), VersionMismatchError (other protocol version) or
    MessageError (unknown kind, schema or cross-field rule broken), each naming what was wrong.
    """
    frame = wire.decode_frame(data, max_frame_bytes)
    return decode_message(frame)


def decode_message(frame: wire.Frame) -> MessageBase:
    """The message carried by an already decoded frame (see :func:`decode`)."""
    cls = KINDS.get(frame.kind)
    if cls is None:
        raise MessageError(f"unknown message kind {frame.kind}")
    name = cls.__name__
    try:
        try:
            obj = _JSON_DECODER.decode(frame.meta.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, ints of > 4300 digits, deep nesting
            raise Invalid(f"metadata is not UTF-8 JSON ({type(exc).__name__}: {exc})"[:200]) from None
        if type(obj) is not dict:
            raise Invalid("metadata is not a JSON object")
        plain = _plain_fields(cls)
        if set(obj) != set(plain):
            missing, extra = sorted(set(plain) - set(obj)), sorted(set(obj) - set(plain))
            raise Invalid(f"metadata keys differ from the schema (missing {missing}, unexpected {extra})")
        try:
            fields = {name: check(obj[name]) for name, check, _ in _compiled_fields(cls)}
        except Invalid:  # again, for the message naming the field
            fields = {n: _check_value(obj[n], tp, n) for n, tp in plain.items()}
        tspecs = _tensor_fields(cls)
        if len(frame.tensors) != len(tspecs):
            raise Invalid(f"{len(frame.tensors)} tensors, expected {len(tspecs)} ({', '.join(tspecs) or 'none'})")
        tensors = {n: _check_tensor(t, spec, n) for (n, spec), t in zip(tspecs.items(), frame.tensors)}
        if "request_id" in _hints(cls):
            fields["request_id"] = frame.request_id
        elif frame.request_id != 0:
            raise Invalid(f"request id {frame.request_id} on a kind that has none (must be 0)")
        msg = cls(**fields, **tensors)
        msg._check()
    except Invalid as exc:
        raise MessageError(f"{name} (kind {frame.kind}): {exc}") from None
    return msg
