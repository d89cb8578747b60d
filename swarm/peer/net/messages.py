"""Wire messages: the catalogue, one frozen dataclass per kind, and the ``encode``/``decode`` pair.

Each kind is a frozen dataclass registered with ``@message(KIND)``; its annotations are its
schema, checked by the engine in ``swarm.peer.net.schema`` (the types allowed, and what decoding
checks). Its ``_check`` holds the cross-field rules. Adding a kind is a local change: write the
dataclass here, add it to :data:`Message`, a row to docs/protocol.md and a vector to
tests/vectors/.

Dispatch with ``match``::

    match decode(data):
        case LinkHeartbeat(seq=seq): ...
        case ExpertRequest() as req: ...
"""

from __future__ import annotations

import hashlib
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Literal, Union, cast

import numpy as np

from swarm.errors import MessageError
from swarm.peer.net import schema, wire
from swarm.peer.net.schema import KINDS, Invalid, MessageBase, TensorSpec, message

PEER_ID_RE = re.compile(r"[a-z2-7]{26}")  # base32 (RFC 4648, lower case, no padding) of 16 bytes
HEX64_RE = re.compile(r"[0-9a-f]{64}")  # 32 bytes as lower-case hex: nonces, MACs, SHA-256 digests
ROWS = TensorSpec(("f32",), 2)  # activations [rows, hidden]: float32 end to end (docs/protocol.md)
IDS = TensorSpec(("i32",), 1)


def _peer_id(v: str, where: str) -> None:
    if not PEER_ID_RE.fullmatch(v):
        raise Invalid(f"{where}: {v!r:.40} is not a peer id (26 characters a-z, 2-7)")


def _hex64(v: str, where: str) -> None:
    if not HEX64_RE.fullmatch(v):
        raise Invalid(f"{where}: expected 64 lower-case hex digits, got {v!r:.80}")


# --- handshake and liveness -------------------------------------------------------------------


@message(1)
class AuthHello(MessageBase):
    """First frame each side sends on a new channel: who it claims to be and a fresh nonce."""

    peer_id: str
    nonce: str  # 32 random bytes, lower-case hex

    def _check(self) -> None:
        _peer_id(self.peer_id, "peer_id")
        _hex64(self.nonce, "nonce")


@message(2)
class AuthProof(MessageBase):
    """HMAC-SHA256 proofs over the channel transcript (docs/protocol.md, "Channel authentication")."""

    key_mac: str  # proves the swarm key (transcript without fingerprints)
    channel_mac: str  # proves the key and both DTLS fingerprints

    def _check(self) -> None:
        _hex64(self.key_mac, "key_mac")
        _hex64(self.channel_mac, "channel_mac")


ADAPTER_PREFIX = "adapter:"  # the last word of a GPU peer's build.blas: its adapter's name
# The most GPU memory a Hello may announce (bytes, 1 PiB): more is no card's, but a bad value.
MAX_GPU_MEMORY = 1 << 50
INT8_KERNEL_DTYPE = "i8"  # NumericBuild.kernel_dtype of a Python peer computing with the int8 numerics


@dataclass(frozen=True)
class NumericBuild:
    """What decides bit-exactness of a peer's FFN results (docs/architecture.md §5)."""

    package: str  # colibri-swarm version
    numpy: str
    blas: str  # e.g. "openblas 0.3.27"; "webgpu" for browser peers
    arch: str  # platform.machine(), e.g. "x86_64"
    kernel_dtype: str  # "f32", "i8" (a Python peer under the int8 numerics); a page's: its weight format

    @property
    def numerics(self) -> str:
        """The activation numerics this build computes with (swarm/compute/numerics.py): "int8" for
        a Python peer announcing :data:`INT8_KERNEL_DTYPE` (a GPU peer of an int8 swarm too: its
        GEMVs take the CPU's int8 rows), else "float32" (pages always)."""
        return "int8" if self.kernel_dtype == INT8_KERNEL_DTYPE else "float32"

    @property
    def gpu_adapter(self) -> str | None:
        """The GPU adapter a Python GPU peer computes on (``join --gpu``: ``blas`` reads ``wgpu …
        adapter:NAME``, swarm/peer/worker/gpu.py), else None."""
        head, sep, name = self.blas.partition(" " + ADAPTER_PREFIX)
        return name if sep and head.startswith("wgpu ") else None

    def named(self, prefix: str) -> frozenset[str]:
        """The comma-separated names in the words of ``blas`` that start with ``prefix``: a page's
        ``kernels:q4_0,q4_k`` (its block kernels), ``notices:standby`` (the notices it reads)."""
        return frozenset(n for w in self.blas.split() if w.startswith(prefix) for n in w[len(prefix):].split(",") if n)


@message(3)
class Hello(MessageBase):
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
    # Bytes of GPU memory a Python GPU peer's planned GPU work may fill (weights, a stage's KV
    # cache): ``join --gpu-memory``; 0 when it computes on no GPU or gave none (its host
    # ``memory_budget`` is then the only limit: a GPU that shares the host memory).
    gpu_memory: int = 0

    def _check(self) -> None:
        _peer_id(self.peer_id, "peer_id")
        if self.model_hash is not None:
            _hex64(self.model_hash, "model_hash")
        if self.gpu_memory > MAX_GPU_MEMORY:
            raise Invalid(f"gpu_memory: {self.gpu_memory} bytes is more than any GPU holds "
                          f"(at most {MAX_GPU_MEMORY})")
        if self.gpu_memory and (self.peer_kind != "python" or self.build.gpu_adapter is None):
            raise Invalid("gpu_memory: only a Python peer computing on a GPU (its build.blas names the adapter) "
                          "announces GPU memory; others send 0")


@message(4)
class LinkHeartbeat(MessageBase):
    """Liveness on a channel; the receiver may answer with its own heartbeat."""

    seq: int
    sent_s: float  # sender's clock, seconds


@message(5)
class Error(MessageBase):
    """The refusal of a request (or of the channel, with request id 0); ``code`` is a short slug."""

    request_id: int
    code: str  # e.g. "stale_term", "bad_request", "version", "model", "internal"
    message: str


@message(6)
class WeightsHeld(MessageBase):
    """What the sender holds of the model now: ``weight_bytes``, the bytes its weights take in
    the form it computes from (a browser peer: the GPU buffers it allocated, repacked blocks and
    scales included), after installing ``plan_version``'s weights or releasing some. Shown as the
    memory a peer uses; a Python peer's is counted from the plan instead and it sends none."""

    plan_version: int
    weight_bytes: int


# --- election and plan ------------------------------------------------------------------------


@message(16)
class RequestVote(MessageBase):
    """A candidate asks for a vote in ``term`` (Raft §5.2, adapted: voters rank candidates by
    the ``ffn_gflops`` of their Hello)."""

    term: int
    candidate: str

    def _check(self) -> None:
        _peer_id(self.candidate, "candidate")


@message(17)
class Vote(MessageBase):
    """A vote for the sender of the RequestVote in ``term``."""

    term: int
    granted: bool


@message(18)
class LeaderHeartbeat(MessageBase):
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
class PlanMessage(MessageBase):
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
class StagePlan(MessageBase):
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
                raise Invalid(f"stages[{i}]: layers [{st.layer_start}, {st.layer_stop}) do not follow "
                               f"the previous stage (expected to start at {at})")
            at = st.layer_stop


StandbyReason = Literal["fits_python_peers", "too_slow", "too_little_memory", "slow_link", "layout_excludes_pages",
                        "failed_recently", "other_numerics"]
STANDBY_REASONS: tuple[str, ...] = typing.get_args(StandbyReason)
"""Why a page stands by (docs/protocol.md, Standby)."""
STANDBY_MESSAGE_MAX = 200  # characters of a Standby's sentence: one line on a phone's screen or two
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@message(21)
class Standby(MessageBase):
    """The coordinator's plan ``version`` of ``term`` gives this page no work: it stands by.
    ``reason``: one of :data:`STANDBY_REASONS`; ``message``: the reason as one sentence for the
    page's status line (1..:data:`STANDBY_MESSAGE_MAX` characters, no control characters). Sent
    only to pages whose Hello reads it (``notices:standby`` in ``build.blas``; for a reason of
    :data:`~swarm.peer.coordinator.standby.LATER_REASONS`, named in that list too)."""

    term: int
    version: int
    reason: StandbyReason
    message: str

    def _check(self) -> None:
        if not 1 <= len(self.message) <= STANDBY_MESSAGE_MAX:
            raise Invalid(f"message: 1..{STANDBY_MESSAGE_MAX} characters, got {len(self.message)}")
        if _CONTROL_RE.search(self.message):
            raise Invalid("message: control characters are not allowed")


def _ranges(ranges: tuple[tuple[int, int], ...], where: str) -> None:
    for i, (start, stop) in enumerate(ranges):
        if not start < stop:
            raise Invalid(f"{where}[{i}]: empty range [{start}, {stop})")


# --- FFN work ---------------------------------------------------------------------------------


def _check_expert_rows(ids: np.ndarray, counts: np.ndarray, rows: np.ndarray, what: str) -> None:
    if ids.shape != counts.shape:
        raise Invalid(f"expert_ids {ids.shape} and row_counts {counts.shape} differ in length")
    if (ids < 0).any() or len(set(ids.tolist())) != len(ids):
        raise Invalid("expert_ids must be distinct and non-negative")
    if (counts < 0).any():
        raise Invalid("row_counts must be non-negative")
    if int(counts.sum(dtype=np.int64)) != rows.shape[0]:
        raise Invalid(f"row_counts sum to {int(counts.sum(dtype=np.int64))} but {what} has {rows.shape[0]} rows")


def _check_segments(segments: np.ndarray, n: int, counts: np.ndarray | None = None) -> None:
    if (segments <= 0).any():
        raise Invalid("segments must be positive row counts")
    total = int(segments.sum(dtype=np.int64))
    if total != n:
        raise Invalid(f"segments sum to {total} but the request has {n} rows")
    if counts is not None:
        cuts = set(np.cumsum(segments, dtype=np.int64).tolist())
        ends = np.cumsum(counts, dtype=np.int64)[counts > 0].tolist()
        if not cuts.issuperset(ends):
            raise Invalid("a segment crosses the boundary between two experts' rows")


@message(32)
class ExpertRequest(MessageBase):
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
    segments: Annotated[np.ndarray, IDS] = None  # type: ignore[assignment]  # filled in below

    def __post_init__(self) -> None:
        if self.segments is None:
            counts = np.asarray(self.row_counts)
            object.__setattr__(self, "segments", counts[counts > 0].astype(np.int32))

    def _check(self) -> None:
        _check_expert_rows(self.expert_ids, self.row_counts, self.rows, "rows")
        _check_segments(self.segments, self.rows.shape[0], self.row_counts)


@message(33)
class ExpertAnswer(MessageBase):
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
class DenseRequest(MessageBase):
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
    segments: Annotated[np.ndarray, IDS] = None  # type: ignore[assignment]  # filled in below

    def __post_init__(self) -> None:
        if self.segments is None:
            n = self.x.shape[0]
            object.__setattr__(self, "segments", np.array([n] if n else [], np.int32))

    def _check(self) -> None:
        if not self.ranges:
            raise Invalid("ranges: at least one range")
        _ranges(self.ranges, "ranges")
        _check_segments(self.segments, self.x.shape[0])


@message(35)
class DenseAnswer(MessageBase):
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
            raise Invalid(f"{self.partials.shape[0]} partials for {len(self.ranges)} ranges")


INT8_ROW_ALIGN = 64  # bytes an int8 activation row is padded to (QMatrix.int8_rows)
DOWN_ROWS = TensorSpec(("u8",), 2)  # int8 activation rows [rows, row bytes]: values, scales, padding


def _down_rows(rows: np.ndarray, n: int, where: str) -> None:
    if rows.shape[0] != n:
        raise Invalid(f"down_rows has {rows.shape[0]} rows but {where} has {n}")
    if rows.shape[1] == 0 or rows.shape[1] % INT8_ROW_ALIGN:
        raise Invalid(f"down_rows: rows of {rows.shape[1]} bytes, expected a positive multiple of {INT8_ROW_ALIGN}")


@message(38)
class ExpertAnswerInt8(ExpertAnswer):
    """An ExpertAnswer of a peer of an int8 swarm whose numeric build is not the coordinator's (a
    GPU peer): also ``down_rows`` uint8 [sum(row_counts), row bytes], the int8 rows each expert's
    down product took (:func:`swarm.compute.int8_swiglu.swiglu_int8`), by which ``--verify`` checks
    it (:func:`~swarm.compute.int8_swiglu.check_int8_answer`). The row bytes are checked against
    the expert's down matrix by the coordinator, which knows its encoding."""

    down_rows: Annotated[np.ndarray, DOWN_ROWS]

    def _check(self) -> None:
        super()._check()
        _down_rows(self.down_rows, self.outputs.shape[0], "outputs")


@message(39)
class DenseAnswerInt8(DenseAnswer):
    """A DenseAnswer of such a peer (:class:`ExpertAnswerInt8`): one range (``partials`` [1, T, H])
    and ``down_rows`` uint8 [T, row bytes], the int8 rows its down product took."""

    down_rows: Annotated[np.ndarray, DOWN_ROWS]

    def _check(self) -> None:
        super()._check()
        if len(self.ranges) != 1:
            raise Invalid(f"an int8 dense answer carries one range, got {len(self.ranges)}")
        _down_rows(self.down_rows, self.partials.shape[1], "partials")


@dataclass(frozen=True)
class StageSegment:
    """The rows of one sequence in a StageRequest: ``rows`` consecutive rows of ``x`` hold
    positions ``start .. start+rows-1`` of sequence ``sequence``."""

    sequence: int
    start: int
    rows: int


def _check_stage(msg, where: str) -> None:
    if msg.layer_stop <= msg.layer_start:
        raise Invalid(f"layers [{msg.layer_start}, {msg.layer_stop}): empty range")
    if msg.x.shape[0] == 0:
        raise Invalid(f"{where}: at least one row")
    if not msg.segments:
        raise Invalid("segments: at least one sequence")
    if any(s.rows == 0 for s in msg.segments):
        raise Invalid("segments: every sequence needs at least one row")
    if len({s.sequence for s in msg.segments}) != len(msg.segments):
        raise Invalid("segments: a sequence appears twice")
    total = sum(s.rows for s in msg.segments)
    if total != msg.x.shape[0]:
        raise Invalid(f"segments hold {total} rows but {where} has {msg.x.shape[0]}")


@message(36)
class StageRequest(MessageBase):
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
class StageAnswer(MessageBase):
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
class WeightManifest(MessageBase):
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
                raise Invalid("https.urls: 1..16 URLs, each starting with https://")
        if self.chunk_bytes == 0:
            raise Invalid("chunk_bytes must be positive")
        n = -(-self.total_bytes // self.chunk_bytes)
        if len(self.chunk_sha256) != n:
            raise Invalid(f"{len(self.chunk_sha256)} chunk digests for {n} chunks")
        for i, d in enumerate(self.chunk_sha256):
            _hex64(d, f"chunk_sha256[{i}]")


@message(49)
class WeightChunkRequest(MessageBase):
    """Ask for ``count`` chunks of a slice starting at chunk ``first`` (resumes after a drop)."""

    request_id: int
    model_hash: str
    name: str
    first: int
    count: int

    def _check(self) -> None:
        _hex64(self.model_hash, "model_hash")


@message(50)
class WeightChunk(MessageBase):
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
        got = hashlib.sha256(self.data.data).hexdigest()
        if got != self.sha256:
            raise MessageError(f"weight chunk {self.name}@{self.offset}: SHA-256 {got} differs from {self.sha256}")


Message = Union[
    AuthHello, AuthProof, Hello, LinkHeartbeat, Error, WeightsHeld,
    RequestVote, Vote, LeaderHeartbeat, PlanMessage, StagePlan, Standby,
    ExpertRequest, ExpertAnswer, DenseRequest, DenseAnswer, ExpertAnswerInt8, DenseAnswerInt8,
    StageRequest, StageAnswer, WeightManifest, WeightChunkRequest, WeightChunk,
]
"""Every message kind (tests/peer/net/test_messages.py checks it names each registered one)."""


def encode(msg: Message) -> bytes:
    """The frame that carries ``msg``. LocalProtocolError if a field breaks the kind's schema."""
    return schema.encode(msg)


def decode(data: bytes | bytearray | memoryview, max_frame_bytes: int = wire.MAX_FRAME_BYTES) -> Message:
    """Decode one whole frame into its message; tensors are zero-copy views into ``data``.

    Raises FrameError (bad frame), VersionMismatchError (other protocol version) or
    MessageError (unknown kind, schema or cross-field rule broken), each naming what was wrong.
    """
    return cast(Message, schema.decode(data, max_frame_bytes))


def decode_message(frame: wire.Frame) -> Message:
    """The message carried by an already decoded frame (see :func:`decode`)."""
    return cast(Message, schema.decode_message(frame))


__all__ = [
    "KINDS",
    "Message",
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
