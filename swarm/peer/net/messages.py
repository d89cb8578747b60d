"""Wire messages: one frozen dataclass per kind, one ``encode``/``decode`` pair.

Theory of operation: a message is a frame (``swarm.peer.net.wire``) whose metadata is a UTF-8
JSON object holding the message's plain fields, and whose tensors are its ``numpy`` fields in
declaration order. A field named ``request_id`` travels in the frame header instead of the JSON.
The schema of each kind is its dataclass annotations, read once at import, so adding a kind is
a local change: write the dataclass, decorate it with ``@message(KIND)``, add a row to
docs/protocol.md and a vector to tests/vectors/.

Schema types (docs/protocol.md, "Metadata"):

* ``int``: a non-negative integer below 2**53 (exact in a JS number); never a bool.
* ``float``: a finite number (JSON integers accepted, as ``JSON.stringify(1.0)`` gives ``1``).
* ``str`` (at most :data:`MAX_STR` characters), ``bool``, ``Literal[...]`` of strings,
  ``X | None``, ``tuple[X, ...]`` (JSON array), ``tuple[X, Y]`` (fixed-length array),
  ``dict[str, X]`` (JSON object), and nested frozen dataclasses (JSON object, exact keys).
* ``Annotated[np.ndarray, TensorSpec(...)]``: a tensor with the allowed wire dtypes and rank.

Decoding checks everything: unknown kind, bad JSON, duplicate, missing or extra keys, wrong
types, out-of-range ints, tensor count/dtype/rank, then the kind's own cross-field rules
(``_check``), and raises :class:`~swarm.errors.MessageError` naming the kind and field.
Encoding the same message locally raises :class:`~swarm.errors.LocalProtocolError` instead.

Dispatch with ``match``::

    match decode(data):
        case LinkHeartbeat(seq=seq): ...
        case ExpertRequest() as req: ...
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np

from swarm.errors import LocalProtocolError, MessageError
from swarm.peer.net import wire

MAX_STR = 4096  # characters per string field
MAX_INT = 2**53 - 1  # largest integer a JS number holds exactly
MAX_FLOAT_INT = 2**1023  # integers of a float field below this convert to a finite float
PEER_ID_RE = re.compile(r"[a-z2-7]{26}")  # base32 (RFC 4648, lower case, no padding) of 16 bytes
HEX64_RE = re.compile(r"[0-9a-f]{64}")  # 32 bytes as lower-case hex: nonces, MACs, SHA-256 digests


@dataclass(frozen=True)
class TensorSpec:
    """Allowed wire dtypes (names from ``wire.DTYPES``) and rank of a tensor field."""

    dtypes: tuple[str, ...]
    rank: int


ROWS = TensorSpec(("f32",), 2)  # activations [rows, hidden]: float32 end to end (docs/protocol.md)
IDS = TensorSpec(("i32",), 1)


class _Invalid(Exception):
    """A schema violation; mapped to MessageError (decode) or LocalProtocolError (encode)."""


# --- schema -----------------------------------------------------------------------------------


def _check_value(v: Any, tp: Any, where: str) -> Any:
    """Check a JSON-decoded value against a schema type; returns it in its Python form."""
    origin = typing.get_origin(tp)
    if tp is int:
        if type(v) is not int or not 0 <= v <= MAX_INT:
            raise _Invalid(f"{where}: expected an integer in 0..2**53-1, got {v!r:.60}")
        return v
    if tp is float:
        try:
            as_float = float(v) if type(v) in (int, float) else math.nan
        except OverflowError:  # an integer of hundreds of digits
            as_float = math.inf
        if not math.isfinite(as_float):
            raise _Invalid(f"{where}: expected a finite number, got {v!r:.60}")
        return as_float
    if tp is str:
        if type(v) is not str or len(v) > MAX_STR:
            raise _Invalid(f"{where}: expected a string of at most {MAX_STR} characters, got {v!r:.60}")
        return v
    if tp is bool:
        if type(v) is not bool:
            raise _Invalid(f"{where}: expected true or false, got {v!r:.60}")
        return v
    if origin is Literal:
        if type(v) is not str or v not in typing.get_args(tp):
            raise _Invalid(f"{where}: expected one of {list(typing.get_args(tp))}, got {v!r:.60}")
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
            raise _Invalid(f"{where}: expected an array, got {v!r:.60}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_value(x, args[0], f"{where}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise _Invalid(f"{where}: expected an array of {len(args)} items, got {len(v)}")
        return tuple(_check_value(x, a, f"{where}[{i}]") for i, (x, a) in enumerate(zip(v, args)))
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if type(v) is not dict:
            raise _Invalid(f"{where}: expected an object, got {v!r:.60}")
        return {_check_value(k, str, f"{where} key"): _check_value(x, val_tp, f"{where}.{k}") for k, x in v.items()}
    if dataclasses.is_dataclass(tp):
        if type(v) is tp:
            v = _to_json(v, tp)
        if type(v) is not dict:
            raise _Invalid(f"{where}: expected an object, got {v!r:.60}")
        fields = _plain_fields(tp)
        if set(v) != set(fields):
            raise _Invalid(f"{where}: keys {sorted(v)} differ from {sorted(fields)}")
        return tp(**{name: _check_value(v[name], ftp, f"{where}.{name}") for name, ftp in fields.items()})
    raise TypeError(f"unsupported schema type {tp!r} at {where}")  # a bug in a message definition


def _to_json(v: Any, tp: Any) -> Any:
    """The JSON form of a Python field value (tuples → lists, dataclasses → objects)."""
    if dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(v):
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
# typing objects for every value. They raise a bare _Invalid; the callers then run the
# interpreting versions above, which raise the message naming the field.


@functools.cache
def _checker(tp: Any) -> Callable[[Any], Any]:
    """A function: JSON or Python value → its Python form under ``tp``; _Invalid when it breaks it."""
    origin = typing.get_origin(tp)
    if tp is int:
        def check(v):
            if type(v) is not int or not 0 <= v <= MAX_INT:
                raise _Invalid
            return v
    elif tp is float:
        def check(v):
            if type(v) is float and math.isfinite(v):
                return v
            if type(v) is int and -MAX_FLOAT_INT <= v <= MAX_FLOAT_INT:
                return float(v)
            raise _Invalid  # the interpreting check tells which
    elif tp is str:
        def check(v):
            if type(v) is not str or len(v) > MAX_STR:
                raise _Invalid
            return v
    elif tp is bool:
        def check(v):
            if type(v) is not bool:
                raise _Invalid
            return v
    elif origin is Literal:
        allowed = frozenset(typing.get_args(tp))

        def check(v):
            if type(v) is not str or v not in allowed:
                raise _Invalid
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
                    raise _Invalid
                out = tuple(map(item, v))
                return v if type(v) is tuple and all(a is b for a, b in zip(out, v)) else out
        else:
            items = tuple(_checker(a) for a in args)

            def check(v):
                if type(v) not in (list, tuple) or len(v) != len(items):
                    raise _Invalid
                return tuple(c(x) for c, x in zip(items, v))
    elif origin is dict:
        key, value = _checker(str), _checker(typing.get_args(tp)[1])

        def check(v):
            if type(v) is not dict:
                raise _Invalid
            return {key(k): value(x) for k, x in v.items()}
    elif dataclasses.is_dataclass(tp):
        fields = tuple((name, _checker(ftp)) for name, ftp in _plain_fields(tp).items())
        names = frozenset(_plain_fields(tp))

        def check(v):
            if type(v) is tp:  # a frozen record: itself, when every field checks as it is
                values = {name: c(getattr(v, name)) for name, c in fields}
                return v if all(x is getattr(v, name) for name, x in values.items()) else tp(**values)
            if type(v) is not dict or v.keys() != names:
                raise _Invalid
            return tp(**{name: c(v[name]) for name, c in fields})
    else:
        raise TypeError(f"unsupported schema type {tp!r}")  # a bug in a message definition
    return check


@functools.cache
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
    if dataclasses.is_dataclass(tp):
        fields = tuple((name, _jsonifier(ftp) or (lambda x: x)) for name, ftp in _plain_fields(tp).items())
        return lambda v: {name: j(getattr(v, name)) for name, j in fields}
    return None


@functools.cache
def _compiled_fields(cls: type) -> tuple[tuple[str, Callable[[Any], Any], Callable[[Any], Any] | None], ...]:
    """(name, checker, jsonifier) of each plain field of a message kind."""
    return tuple((name, _checker(tp), _jsonifier(tp)) for name, tp in _plain_fields(cls).items())


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _tensor_spec(tp: Any) -> TensorSpec | None:
    if typing.get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, TensorSpec)), None)
    return None


@functools.cache
def _plain_fields(cls: type) -> dict[str, Any]:
    """JSON fields of a message or nested record, in declaration order."""
    hints = _hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if f.name != "request_id" and _tensor_spec(hints[f.name]) is None
    }


@functools.cache
def _tensor_fields(cls: type) -> dict[str, TensorSpec]:
    hints = _hints(cls)
    specs = {f.name: _tensor_spec(hints[f.name]) for f in dataclasses.fields(cls)}
    return {name: spec for name, spec in specs.items() if spec is not None}


def _check_tensor(a: Any, spec: TensorSpec, where: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise _Invalid(f"{where}: expected a numpy array, got {type(a).__name__}")
    try:
        name = wire.dtype_name(a)
    except LocalProtocolError:
        name = str(a.dtype)
    if name not in spec.dtypes or a.ndim != spec.rank:
        raise _Invalid(f"{where}: expected rank {spec.rank} of {'/'.join(spec.dtypes)}, got shape {a.shape} {name}")
    return a


# --- registry ---------------------------------------------------------------------------------

KINDS: dict[int, type] = {}
"""Message kind (frame header) → message class."""


def message(kind: int):
    """Class decorator: make a frozen dataclass message of wire ``kind`` and register it."""

    def wrap(cls: type) -> type:
        if kind in KINDS:
            raise TypeError(f"message kind {kind} already used by {KINDS[kind].__name__}")
        has_tensors = any("np.ndarray" in str(a) for a in cls.__annotations__.values())
        # Arrays have no boolean ==; messages with tensors compare by identity (tests compare fields).
        cls = dataclass(frozen=True, eq=not has_tensors)(cls)
        cls.KIND = kind
        KINDS[kind] = cls
        return cls

    return wrap


_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode(msg: Any) -> bytes:
    """The frame that carries ``msg``. LocalProtocolError if a field breaks the kind's schema."""
    cls = type(msg)
    if KINDS.get(getattr(cls, "KIND", None)) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a registered wire message")
    compiled = _compiled_fields(cls)
    try:
        try:
            fields = {name: check(getattr(msg, name)) for name, check, _ in compiled}
        except _Invalid:  # again, for the message naming the field
            fields = {name: _check_value(getattr(msg, name), tp, name) for name, tp in _plain_fields(cls).items()}
        tensors = [_check_tensor(getattr(msg, n), spec, n) for n, spec in _tensor_fields(cls).items()]
        rid = _rid(cls, msg)
        if all(v is getattr(msg, name) for name, v in fields.items()):
            checked = msg  # every field already in its checked form: the cross-field rules on it
        else:
            checked = cls(**fields, **dict(zip(_tensor_fields(cls), tensors)), **rid)
        checked._check()
    except _Invalid as exc:
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
        raise _Invalid(f"request_id: expected a u32, got {rid!r:.40}")
    return {"request_id": rid}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Invalid(f"duplicate key in {[k for k, _ in pairs]!r:.80}")
    return obj


def _no_constants(name: str) -> Any:
    raise _Invalid(f"{name} is not a JSON number")


_JSON_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def decode(data: bytes | bytearray | memoryview, max_frame_bytes: int = wire.MAX_FRAME_BYTES) -> Any:
    """Decode one whole frame into its message; tensors are zero-copy views into ``data``.

    Raises FrameError (bad frame), VersionMismatchError (other protocol version) or
    MessageError (unknown kind, schema or cross-field rule broken), each naming what was wrong.
    """
    frame = wire.decode_frame(data, max_frame_bytes)
    return decode_message(frame)


def decode_message(frame: wire.Frame) -> Any:
    """The message carried by an already decoded frame (see :func:`decode`)."""
    cls = KINDS.get(frame.kind)
    if cls is None:
        raise MessageError(f"unknown message kind {frame.kind}")
    name = cls.__name__
    try:
        try:
            obj = _JSON_DECODER.decode(frame.meta.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, ints of > 4300 digits, deep nesting
            raise _Invalid(f"metadata is not UTF-8 JSON ({type(exc).__name__}: {exc})"[:200]) from None
        if type(obj) is not dict:
            raise _Invalid("metadata is not a JSON object")
        plain = _plain_fields(cls)
        if set(obj) != set(plain):
            missing, extra = sorted(set(plain) - set(obj)), sorted(set(obj) - set(plain))
            raise _Invalid(f"metadata keys differ from the schema (missing {missing}, unexpected {extra})")
        try:
            fields = {name: check(obj[name]) for name, check, _ in _compiled_fields(cls)}
        except _Invalid:  # again, for the message naming the field
            fields = {n: _check_value(obj[n], tp, n) for n, tp in plain.items()}
        tspecs = _tensor_fields(cls)
        if len(frame.tensors) != len(tspecs):
            raise _Invalid(f"{len(frame.tensors)} tensors, expected {len(tspecs)} ({', '.join(tspecs) or 'none'})")
        tensors = {n: _check_tensor(t, spec, n) for (n, spec), t in zip(tspecs.items(), frame.tensors)}
        if "request_id" in _hints(cls):
            fields["request_id"] = frame.request_id
        elif frame.request_id != 0:
            raise _Invalid(f"request id {frame.request_id} on a kind that has none (must be 0)")
        msg = cls(**fields, **tensors)
        msg._check()
    except _Invalid as exc:
        raise MessageError(f"{name} (kind {frame.kind}): {exc}") from None
    return msg


class _Base:
    """Common behaviour: the cross-field rules of a kind (none by default)."""

    KIND: ClassVar[int]

    def _check(self) -> None:
        """Raise _Invalid when fields are individually valid but inconsistent together."""


def _peer_id(v: str, where: str) -> None:
    if not PEER_ID_RE.fullmatch(v):
        raise _Invalid(f"{where}: {v!r:.40} is not a peer id (26 characters a-z, 2-7)")


def _hex64(v: str, where: str) -> None:
    if not HEX64_RE.fullmatch(v):
        raise _Invalid(f"{where}: expected 64 lower-case hex digits, got {v!r:.80}")


# --- handshake and liveness -------------------------------------------------------------------


@message(1)
class AuthHello(_Base):
    """First frame each side sends on a new channel: who it claims to be and a fresh nonce."""

    peer_id: str
    nonce: str  # 32 random bytes, lower-case hex

    def _check(self) -> None:
        _peer_id(self.peer_id, "peer_id")
        _hex64(self.nonce, "nonce")


@message(2)
class AuthProof(_Base):
    """HMAC-SHA256 proofs over the channel transcript (docs/protocol.md, "Channel authentication")."""

    key_mac: str  # proves the swarm key (transcript without fingerprints)
    channel_mac: str  # proves the key and both DTLS fingerprints

    def _check(self) -> None:
        _hex64(self.key_mac, "key_mac")
        _hex64(self.channel_mac, "channel_mac")


@dataclass(frozen=True)
class NumericBuild:
    """What decides bit-exactness of a peer's FFN results (docs/architecture.md §5)."""

    package: str  # colibri-swarm version
    numpy: str
    blas: str  # e.g. "openblas 0.3.27"; "webgpu" for browser peers
    arch: str  # platform.machine(), e.g. "x86_64"
    kernel_dtype: str  # "f32", "f16", ...


@message(3)
class Hello(_Base):
    """Sent once after authentication: what this peer is and what it can do."""

    peer_id: str
    protocol_version: int
    build: NumericBuild
    model_hash: str | None  # content hash of the model this peer holds, or None
    memory_budget: int  # bytes this peer gives to weights
    ffn_gflops: float  # measured FFN throughput, GFLOP/s
    peer_kind: Literal["python", "browser"]
    adapter_limits: dict[str, int]  # WebGPU adapter limits ({} for Python peers)
    adapter_features: tuple[str, ...]  # WebGPU features, e.g. ("shader-f16",)
    name: str

    def _check(self) -> None:
        _peer_id(self.peer_id, "peer_id")
        if self.model_hash is not None:
            _hex64(self.model_hash, "model_hash")


@message(4)
class LinkHeartbeat(_Base):
    """Liveness on a channel; the receiver may answer with its own heartbeat."""

    seq: int
    sent_s: float  # sender's clock, seconds


@message(5)
class Error(_Base):
    """The refusal of a request (or of the channel, with request id 0); ``code`` is a short slug."""

    request_id: int
    code: str  # e.g. "stale_term", "bad_request", "version", "model", "internal"
    message: str


@message(6)
class WeightsHeld(_Base):
    """What the sender holds of the model now: ``weight_bytes``, the bytes its weights take in
    the form it computes from (a browser peer: the GPU buffers it allocated, repacked blocks and
    scales included), after installing ``plan_version``'s weights or releasing some. Shown as the
    memory a peer uses; a Python peer's is counted from the plan instead and it sends none."""

    plan_version: int
    weight_bytes: int


# --- election and plan ------------------------------------------------------------------------


@message(16)
class RequestVote(_Base):
    """A candidate asks for a vote in ``term`` (Raft §5.2, adapted: voters rank candidates by
    the ``ffn_gflops`` of their Hello)."""

    term: int
    candidate: str

    def _check(self) -> None:
        _peer_id(self.candidate, "candidate")


@message(17)
class Vote(_Base):
    """A vote for the sender of the RequestVote in ``term``."""

    term: int
    granted: bool


@message(18)
class LeaderHeartbeat(_Base):
    """The coordinator of ``term`` is alive."""

    term: int
    leader: str

    def _check(self) -> None:
        _peer_id(self.leader, "leader")


@dataclass(frozen=True)
class Assignment:
    """One peer's share of one layer: expert ids, or dense ranges [start, stop) of the FFN dim."""

    layer: int
    peer: str
    experts: tuple[int, ...]
    dense: tuple[tuple[int, int], ...]


@message(19)
class PlanMessage(_Base):
    """The coordinator's placement, versioned within a term."""

    term: int
    version: int
    assignments: tuple[Assignment, ...]

    def _check(self) -> None:
        for i, a in enumerate(self.assignments):
            _peer_id(a.peer, f"assignments[{i}].peer")
            _ranges(a.dense, f"assignments[{i}].dense")


@dataclass(frozen=True)
class StageAssignment:
    """One stage: ``peer`` runs layers ``layer_start .. layer_stop-1`` (attention, KV cache, FFN)."""

    peer: str
    layer_start: int
    layer_stop: int


@message(20)
class StagePlan(_Base):
    """The layer stages of plan ``version`` of ``term``, in the order the hidden state visits
    them; they tile the layers ``0 .. n_layers-1`` (checked against the model by the receiver)."""

    term: int
    version: int
    stages: tuple[StageAssignment, ...]

    def _check(self) -> None:
        at = 0
        for i, st in enumerate(self.stages):
            _peer_id(st.peer, f"stages[{i}].peer")
            if st.layer_start != at or st.layer_stop <= st.layer_start:
                raise _Invalid(f"stages[{i}]: layers [{st.layer_start}, {st.layer_stop}) do not follow "
                               f"the previous stage (expected to start at {at})")
            at = st.layer_stop


def _ranges(ranges: tuple[tuple[int, int], ...], where: str) -> None:
    for i, (start, stop) in enumerate(ranges):
        if not start < stop:
            raise _Invalid(f"{where}[{i}]: empty range [{start}, {stop})")


# --- FFN work ---------------------------------------------------------------------------------


def _check_expert_rows(ids: np.ndarray, counts: np.ndarray, rows: np.ndarray, what: str) -> None:
    if ids.shape != counts.shape:
        raise _Invalid(f"expert_ids {ids.shape} and row_counts {counts.shape} differ in length")
    if (ids < 0).any() or len(set(ids.tolist())) != len(ids):
        raise _Invalid("expert_ids must be distinct and non-negative")
    if (counts < 0).any():
        raise _Invalid("row_counts must be non-negative")
    if int(counts.sum(dtype=np.int64)) != rows.shape[0]:
        raise _Invalid(f"row_counts sum to {int(counts.sum(dtype=np.int64))} but {what} has {rows.shape[0]} rows")


def _check_segments(segments: np.ndarray, n: int, counts: np.ndarray | None = None) -> None:
    if (segments <= 0).any():
        raise _Invalid("segments must be positive row counts")
    total = int(segments.sum(dtype=np.int64))
    if total != n:
        raise _Invalid(f"segments sum to {total} but the request has {n} rows")
    if counts is not None:
        cuts = set(np.cumsum(segments, dtype=np.int64).tolist())
        ends = np.cumsum(counts, dtype=np.int64)[counts > 0].tolist()
        if not cuts.issuperset(ends):
            raise _Invalid("a segment crosses the boundary between two experts' rows")


@message(32)
class ExpertRequest(_Base):
    """The batch-union of rows routed to one peer's experts in one layer.

    ``rows`` [sum(row_counts), H] f32: the rows of each expert concatenated in the order of
    ``expert_ids`` [n_e] i32, ``row_counts`` [n_e] i32. ``segments`` [n_s] i32: the lengths of
    consecutive runs of ``rows`` that belong to one sequence of the step (positive, summing to
    the rows; no run crosses from one expert's rows to the next): each run is computed as its
    sequence alone would (docs/serving.md). Left out when constructing: one sequence (a run per
    expert).
    """

    request_id: int
    term: int
    plan_version: int
    layer: int
    expert_ids: Annotated[np.ndarray, IDS]
    row_counts: Annotated[np.ndarray, IDS]
    rows: Annotated[np.ndarray, ROWS]
    segments: Annotated[np.ndarray, IDS] = None

    def __post_init__(self) -> None:
        if self.segments is None:
            counts = np.asarray(self.row_counts)
            object.__setattr__(self, "segments", counts[counts > 0].astype(np.int32))

    def _check(self) -> None:
        _check_expert_rows(self.expert_ids, self.row_counts, self.rows, "rows")
        _check_segments(self.segments, self.rows.shape[0], self.row_counts)


@message(33)
class ExpertAnswer(_Base):
    """Each expert's output for the rows of an ExpertRequest: ``outputs`` [sum(row_counts), H]."""

    request_id: int
    term: int
    plan_version: int
    layer: int
    expert_ids: Annotated[np.ndarray, IDS]
    row_counts: Annotated[np.ndarray, IDS]
    outputs: Annotated[np.ndarray, ROWS]

    def _check(self) -> None:
        _check_expert_rows(self.expert_ids, self.row_counts, self.outputs, "outputs")


@message(34)
class DenseRequest(_Base):
    """Normed hidden rows ``x`` [T, H] for the dense MLP ranges [start, stop) a peer holds;
    ``segments`` [n_s] i32: the row counts of the step's sequences in ``x``, in order (positive,
    summing to T), each computed as its sequence alone would (docs/serving.md); left out when
    constructing: one sequence."""

    request_id: int
    term: int
    plan_version: int
    layer: int
    ranges: tuple[tuple[int, int], ...]
    x: Annotated[np.ndarray, ROWS]
    segments: Annotated[np.ndarray, IDS] = None

    def __post_init__(self) -> None:
        if self.segments is None:
            n = self.x.shape[0]
            object.__setattr__(self, "segments", np.array([n] if n else [], np.int32))

    def _check(self) -> None:
        if not self.ranges:
            raise _Invalid("ranges: at least one range")
        _ranges(self.ranges, "ranges")
        _check_segments(self.segments, self.x.shape[0])


@message(35)
class DenseAnswer(_Base):
    """One partial ``W_down[:, r] @ (silu(W_gate[r] x) * W_up[r] x)`` per range: ``partials`` [R, T, H]."""

    request_id: int
    term: int
    plan_version: int
    layer: int
    ranges: tuple[tuple[int, int], ...]
    partials: Annotated[np.ndarray, TensorSpec(("f32",), 3)]

    def _check(self) -> None:
        _ranges(self.ranges, "ranges")
        if self.partials.shape[0] != len(self.ranges):
            raise _Invalid(f"{self.partials.shape[0]} partials for {len(self.ranges)} ranges")


@dataclass(frozen=True)
class StageSegment:
    """The rows of one sequence in a StageRequest: ``rows`` consecutive rows of ``x`` hold
    positions ``start .. start+rows-1`` of sequence ``sequence``."""

    sequence: int
    start: int
    rows: int


def _check_stage(msg, where: str) -> None:
    if msg.layer_stop <= msg.layer_start:
        raise _Invalid(f"layers [{msg.layer_start}, {msg.layer_stop}): empty range")
    if msg.x.shape[0] == 0:
        raise _Invalid(f"{where}: at least one row")
    if not msg.segments:
        raise _Invalid("segments: at least one sequence")
    if any(s.rows == 0 for s in msg.segments):
        raise _Invalid("segments: every sequence needs at least one row")
    if len({s.sequence for s in msg.segments}) != len(msg.segments):
        raise _Invalid("segments: a sequence appears twice")
    total = sum(s.rows for s in msg.segments)
    if total != msg.x.shape[0]:
        raise _Invalid(f"segments hold {total} rows but {where} has {msg.x.shape[0]}")


@message(36)
class StageRequest(_Base):
    """Hidden rows ``x`` [T, H] f32 for the layers ``layer_start .. layer_stop-1`` a stage holds,
    of one or more sequences (one step of a batch: a single message per stage and step).

    ``segments``: the sequences in ``x``, in order; each holds its rows' positions (an id the
    coordinator gives each sequence, the position of its first row, its row count; the counts
    sum to T, ids are distinct). For each, the stage first truncates its KV cache of that
    sequence to ``start`` positions (``start == 0`` starts it afresh; a smaller ``start`` than it
    holds re-runs a suffix) and answers ``cache_gap`` when it holds fewer than ``start``.
    """

    request_id: int
    term: int
    plan_version: int
    segments: tuple[StageSegment, ...]
    layer_start: int
    layer_stop: int
    x: Annotated[np.ndarray, ROWS]

    def _check(self) -> None:
        _check_stage(self, "x")


@message(37)
class StageAnswer(_Base):
    """The hidden rows after layer ``layer_stop-1`` for a StageRequest: ``x`` [T, H] f32, with
    the request's ``segments`` echoed; ``compute_s``: the seconds the stage spent computing them
    (the coordinator tells the link's cost from the stage's speed with it)."""

    request_id: int
    term: int
    plan_version: int
    segments: tuple[StageSegment, ...]
    layer_start: int
    layer_stop: int
    compute_s: float
    x: Annotated[np.ndarray, ROWS]

    def _check(self) -> None:
        _check_stage(self, "x")


# --- weights ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpsSource:
    """Where a slice can also be fetched in bulk: HTTPS range requests (``swarm.peer.weights.slice_http``).

    ``urls``: base URLs ``https://HOST:PORT`` of the shipper's slice server, best first;
    ``cert_sha256``: SHA-256 of its certificate's DER (hex64), which the fetcher pins;
    ``token``: the bearer token that authorises this slice only (hex64).
    """

    urls: tuple[str, ...]
    cert_sha256: str
    token: str


@message(48)
class WeightManifest(_Base):
    """A weight slice offered for shipping: its size, encoding and the SHA-256 of each chunk;
    ``https``, when set, names a faster bulk path for the same bytes (null: data channel only)."""

    request_id: int
    model_hash: str
    name: str  # slice name, e.g. "blk.3.ffn_gate_exps[0:8]"
    encoding: str  # e.g. "gguf:Q4_1", "f16"
    total_bytes: int
    chunk_bytes: int
    chunk_sha256: tuple[str, ...]
    https: HttpsSource | None = None

    def _check(self) -> None:
        _hex64(self.model_hash, "model_hash")
        if self.https is not None:
            _hex64(self.https.cert_sha256, "https.cert_sha256")
            _hex64(self.https.token, "https.token")
            if not 1 <= len(self.https.urls) <= 16 or not all(u.startswith("https://") for u in self.https.urls):
                raise _Invalid("https.urls: 1..16 URLs, each starting with https://")
        if self.chunk_bytes == 0:
            raise _Invalid("chunk_bytes must be positive")
        n = -(-self.total_bytes // self.chunk_bytes)
        if len(self.chunk_sha256) != n:
            raise _Invalid(f"{len(self.chunk_sha256)} chunk digests for {n} chunks")
        for i, d in enumerate(self.chunk_sha256):
            _hex64(d, f"chunk_sha256[{i}]")


@message(49)
class WeightChunkRequest(_Base):
    """Ask for ``count`` chunks of a slice starting at chunk ``first`` (resumes after a drop)."""

    request_id: int
    model_hash: str
    name: str
    first: int
    count: int

    def _check(self) -> None:
        _hex64(self.model_hash, "model_hash")


@message(50)
class WeightChunk(_Base):
    """One chunk of a slice: bytes at ``offset``, with their SHA-256 (checked by :meth:`verify`)."""

    request_id: int
    model_hash: str
    name: str
    offset: int
    sha256: str
    data: Annotated[np.ndarray, TensorSpec(("u8",), 1)]

    def _check(self) -> None:
        _hex64(self.model_hash, "model_hash")
        _hex64(self.sha256, "sha256")

    def verify(self) -> None:
        """Raise MessageError if ``data`` does not hash to ``sha256`` (the receiver re-fetches)."""
        got = hashlib.sha256(self.data).hexdigest()
        if got != self.sha256:
            raise MessageError(f"weight chunk {self.name}@{self.offset}: SHA-256 {got} differs from {self.sha256}")


__all__ = [
    "KINDS",
    "TensorSpec",
    "message",
    "encode",
    "decode",
    "decode_message",
    *(cls.__name__ for cls in KINDS.values()),
    "NumericBuild",
    "Assignment",
    "StageAssignment",
    "StageSegment",
]
