"""Wire frames: the binary codec every peer speaks, plus fragmentation and reassembly.

Theory of operation (byte layout in docs/protocol.md, section "Frames"):

* A **frame** is one message: a fixed 24-byte little-endian header (magic ``CLSW``,
  protocol version, message kind, flags, tensor count, request id, metadata length, frame
  length), then the metadata bytes (UTF-8 JSON, schema per kind: ``swarm.peer.net.messages``),
  then a tensor table (dtype, rank, data offset, dims), then the tensor data blocks. Every
  section starts 8-byte aligned from the frame start and is followed by zero padding, so
  ``numpy.frombuffer`` and JS typed arrays view the data without a copy.
* A frame larger than the remote's SCTP max-message-size is sent as **fragments**: a 24-byte
  header (magic ``CLSF``, version, flags, message id, index, count, total length) and a slice
  of the frame. :class:`Reassembler` puts them back together with bounded buffers.

Everything here is sans-I/O: bytes and ``now`` (seconds, any monotonic clock) in, bytes and
dropped-message ids out. Malformed input raises :class:`~swarm.errors.FrameError` (or
:class:`~swarm.errors.ReassemblyError`) naming the field; nothing is trusted before it is checked.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from swarm.errors import FrameError, LocalProtocolError, ReassemblyError, VersionMismatchError

PROTOCOL_VERSION = 3

FRAME_MAGIC = b"CLSW"
FRAGMENT_MAGIC = b"CLSF"
ALIGN = 8  # bytes; every section and tensor data block starts at a multiple of this

# magic, version, kind, flags, n_tensors, request_id, meta_len, frame_len
_HEADER = struct.Struct("<4sHHHHIII")
HEADER_BYTES = _HEADER.size  # 24
# magic, version, flags, message_id, index, count, total_len
_FRAGMENT = struct.Struct("<4sHHIIII")
FRAGMENT_HEADER_BYTES = _FRAGMENT.size  # 24
# dtype code, rank, reserved (0), data offset from frame start; then `rank` u32 dims
_TENSOR_ENTRY = struct.Struct("<BBHI")

MAX_FRAME_BYTES = 64 * 1024 * 1024  # largest frame a receiver accepts by default
MAX_META_BYTES = 1024 * 1024
MAX_TENSORS = 16
MAX_RANK = 4
U32_MAX = 0xFFFF_FFFF

# SCTP max-message-size (RFC 8841): aiortc <-> Chrome advertise 262144; a remote that says
# nothing is assumed to take 65536 (aiortc's REMOTE_DEFAULT_MAX_MESSAGE_SIZE).
DEFAULT_REMOTE_MAX_MESSAGE_SIZE = 65536

BF16 = np.dtype(np.uint16, metadata={"wire": "bf16"})
"""numpy has no bfloat16: bf16 tensors travel as raw u16 with this tagged dtype."""

# wire code -> (name, numpy dtype); names match docs/protocol.md and the browser peer.
DTYPES: dict[int, tuple[str, np.dtype]] = {
    1: ("f32", np.dtype("<f4")),
    2: ("f16", np.dtype("<f2")),
    3: ("bf16", BF16),
    4: ("i32", np.dtype("<i4")),
    5: ("u8", np.dtype("u1")),
}
_CODE_BY_NAME = {name: code for code, (name, _) in DTYPES.items()}


def dtype_name(a: np.ndarray) -> str:
    """The wire dtype name of an array (``f32 f16 bf16 i32 u8``); LocalProtocolError if none fits."""
    meta: Mapping[str, Any] = a.dtype.metadata or {}
    if meta.get("wire") == "bf16":
        return "bf16"
    for name, dt in DTYPES.values():
        if name != "bf16" and a.dtype == dt:
            return name
    raise LocalProtocolError(f"dtype {a.dtype} cannot travel on the wire; use f32, f16, bf16 (BF16), i32 or u8")


def _pad(n: int) -> int:
    return -n % ALIGN


@dataclass(frozen=True, eq=False)
class Frame:
    """One decoded frame. ``meta`` is the raw metadata bytes; ``tensors`` are read-only views."""

    kind: int
    request_id: int
    meta: bytes
    tensors: tuple[np.ndarray, ...] = ()
    flags: int = 0
    version: int = PROTOCOL_VERSION


def encode_frame(
    kind: int,
    meta: bytes,
    tensors: Sequence[np.ndarray] = (),
    request_id: int = 0,
    flags: int = 0,
) -> bytes:
    """Lay out one frame. ``tensors``: arrays of a wire dtype (see :data:`DTYPES`), rank 0-4.

    Raises LocalProtocolError when the frame would break a limit a receiver enforces.
    """
    if not (0 <= kind <= 0xFFFF and 0 <= flags <= 0xFFFF and 0 <= request_id <= U32_MAX):
        raise LocalProtocolError(f"kind {kind}, flags {flags} or request id {request_id} out of range")
    if len(meta) > MAX_META_BYTES:
        raise LocalProtocolError(f"metadata of {len(meta)} bytes exceeds {MAX_META_BYTES}")
    if len(tensors) > MAX_TENSORS:
        raise LocalProtocolError(f"{len(tensors)} tensors exceed the limit of {MAX_TENSORS}")
    table_at = HEADER_BYTES + len(meta) + _pad(len(meta))
    table_len = sum(_TENSOR_ENTRY.size + 4 * t.ndim for t in tensors)
    offset = table_at + table_len + _pad(table_len)
    entries: list[bytes] = []
    blocks: list[bytes | memoryview] = []
    for t in tensors:
        code = _CODE_BY_NAME[dtype_name(t)]
        if t.ndim > MAX_RANK or any(d > U32_MAX for d in t.shape):
            raise LocalProtocolError(f"tensor of shape {t.shape} exceeds rank {MAX_RANK} or u32 dims")
        data = np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("<") if t.dtype.itemsize > 1 else t.dtype)
        entries.append(_TENSOR_ENTRY.pack(code, t.ndim, 0, offset) + struct.pack(f"<{t.ndim}I", *t.shape))
        blocks += [data.reshape(-1).view(np.uint8).data, bytes(_pad(data.nbytes))]
        offset += data.nbytes + _pad(data.nbytes)
    if offset > MAX_FRAME_BYTES:
        raise LocalProtocolError(f"frame of {offset} bytes exceeds {MAX_FRAME_BYTES}")
    header = _HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, kind, flags, len(tensors), request_id, len(meta), offset)
    table = b"".join(entries)
    return b"".join([header, meta, bytes(_pad(len(meta))), table, bytes(_pad(table_len)), *blocks])


def _zero(buf: memoryview, start: int, stop: int, what: str) -> None:
    if any(buf[start:stop]):
        raise FrameError(f"non-zero padding bytes after the {what} at offset {start}")


def decode_frame(data: bytes | bytearray | memoryview, max_frame_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Parse and check one frame; tensors are zero-copy read-only views into ``data``.

    Raises FrameError naming the field when the magic, a length, the tensor table, the
    padding or the total length is wrong; VersionMismatchError naming both versions when the
    protocol version differs (docs/protocol.md, "Frames").
    """
    buf = memoryview(data).cast("B")
    if len(buf) < HEADER_BYTES:
        raise FrameError(f"frame of {len(buf)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, kind, flags, n_tensors, request_id, meta_len, frame_len = _HEADER.unpack_from(buf)
    if magic != FRAME_MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}, expected {FRAME_MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"the other peer speaks protocol version {version}; this peer speaks version {PROTOCOL_VERSION}: "
            "run the same colibri-swarm release on both"
        )
    if flags != 0:
        raise FrameError(f"unknown frame flags 0x{flags:04x}")
    if frame_len != len(buf):
        raise FrameError(f"frame length field says {frame_len} bytes but {len(buf)} arrived")
    if frame_len > max_frame_bytes:
        raise FrameError(f"frame of {frame_len} bytes exceeds the limit of {max_frame_bytes}")
    if n_tensors > MAX_TENSORS:
        raise FrameError(f"{n_tensors} tensors exceed the limit of {MAX_TENSORS}")
    if meta_len > MAX_META_BYTES:
        raise FrameError(f"metadata of {meta_len} bytes exceeds the limit of {MAX_META_BYTES}")
    pos = HEADER_BYTES + meta_len
    if pos + _pad(meta_len) > frame_len:
        raise FrameError(f"metadata length {meta_len} runs past the end of the frame")
    meta = bytes(buf[HEADER_BYTES:pos])
    _zero(buf, pos, pos + _pad(meta_len), "metadata")
    pos += _pad(meta_len)

    specs = []
    for i in range(n_tensors):
        if pos + _TENSOR_ENTRY.size > frame_len:
            raise FrameError(f"tensor table entry {i} runs past the end of the frame")
        code, rank, reserved, offset = _TENSOR_ENTRY.unpack_from(buf, pos)
        pos += _TENSOR_ENTRY.size
        if code not in DTYPES:
            raise FrameError(f"tensor {i}: unknown dtype code {code}")
        if rank > MAX_RANK:
            raise FrameError(f"tensor {i}: rank {rank} exceeds the limit of {MAX_RANK}")
        if reserved != 0:
            raise FrameError(f"tensor {i}: reserved field is {reserved}, must be 0")
        if pos + 4 * rank > frame_len:
            raise FrameError(f"tensor {i}: dims run past the end of the frame")
        shape = struct.unpack_from(f"<{rank}I", buf, pos)
        pos += 4 * rank
        specs.append((i, DTYPES[code][1], shape, offset))
    table_end = pos
    pos += _pad(pos)  # the table starts aligned, so this pads the table to 8
    if pos > frame_len:
        raise FrameError("tensor table padding runs past the end of the frame")
    _zero(buf, table_end, pos, "tensor table")

    tensors = []
    for i, dt, shape, offset in specs:
        if offset != pos:
            raise FrameError(f"tensor {i}: data offset {offset}, expected {pos} (blocks are packed in order)")
        nbytes = dt.itemsize * math.prod(shape)  # Python ints: u32 dims cannot overflow
        end = pos + nbytes + _pad(nbytes)
        if end > frame_len:
            raise FrameError(f"tensor {i}: shape {shape} x {dt.itemsize} bytes runs past the end of the frame")
        tensors.append(np.frombuffer(buf, dtype=dt, count=nbytes // dt.itemsize, offset=pos).reshape(shape))
        _zero(buf, pos + nbytes, end, f"tensor {i} data")
        pos = end
    if pos != frame_len:
        raise FrameError(f"{frame_len - pos} trailing bytes after the last section")
    return Frame(kind=kind, request_id=request_id, meta=meta, tensors=tuple(tensors), flags=flags, version=version)


def max_message_size_from_sdp(sdp: str) -> int:
    """The remote's SCTP max-message-size from its SDP (RFC 8841 ``a=max-message-size``).

    Missing → 65536 (what aiortc assumes); 0 (= no limit) → :data:`MAX_FRAME_BYTES` plus a
    fragment header, since we never send more than that in one message anyway.
    """
    m = re.search(r"^a=max-message-size:(\d+)\s*$", sdp, re.MULTILINE)
    if m is None:
        return DEFAULT_REMOTE_MAX_MESSAGE_SIZE
    size = int(m.group(1))
    return size if size > 0 else MAX_FRAME_BYTES + FRAGMENT_HEADER_BYTES


class Fragmenter:
    """Splits frames that exceed the remote's max-message-size into numbered fragments."""

    MIN_MESSAGE_SIZE = 1024  # bytes; below this the header overhead is silly

    def __init__(self, max_message_size: int = DEFAULT_REMOTE_MAX_MESSAGE_SIZE) -> None:
        if max_message_size < self.MIN_MESSAGE_SIZE:
            raise LocalProtocolError(f"max message size {max_message_size} is below {self.MIN_MESSAGE_SIZE}")
        self.max_message_size = max_message_size
        self._next_id = 0

    def split(self, frame: bytes) -> list[bytes]:
        """The data-channel messages that carry ``frame``: itself if it fits, else fragments."""
        if len(frame) <= self.max_message_size:
            return [frame]
        if len(frame) > U32_MAX:
            raise LocalProtocolError(f"frame of {len(frame)} bytes cannot be fragmented (u32 lengths)")
        step = self.max_message_size - FRAGMENT_HEADER_BYTES
        count = -(-len(frame) // step)
        message_id, self._next_id = self._next_id, (self._next_id + 1) & U32_MAX
        view = memoryview(frame)
        return [
            _FRAGMENT.pack(FRAGMENT_MAGIC, PROTOCOL_VERSION, 0, message_id, i, count, len(frame))
            + view[i * step : (i + 1) * step]
            for i in range(count)
        ]


@dataclass
class _Partial:
    buf: bytearray
    count: int
    step: int
    next_index: int = 1
    filled: int = 0
    last_s: float = 0.0


@dataclass
class Reassembler:
    """Receiver side: turns data-channel messages back into whole frames, with bounded memory.

    Fragments of one message must arrive in order (data channels are ordered and reliable);
    fragments of different messages may interleave. Limits: ``max_inflight`` messages,
    ``max_buffered_bytes`` across them, ``max_frame_bytes`` per message; a message with no
    fragment for ``abandon_s`` seconds is dropped by :meth:`handle_timer`.
    """

    max_frame_bytes: int = MAX_FRAME_BYTES
    max_inflight: int = 4
    max_buffered_bytes: int = 2 * MAX_FRAME_BYTES
    abandon_s: float = 30.0
    _partial: dict[int, _Partial] = field(default_factory=dict, init=False, repr=False)

    @property
    def buffered_bytes(self) -> int:
        return sum(len(p.buf) for p in self._partial.values())

    def feed(self, data: bytes | bytearray | memoryview, now: float) -> bytes | bytearray | memoryview | None:
        """Feed one data-channel message; returns a whole frame when one is complete, else None.

        A message with frame magic is already whole and is returned as is (decode it with
        :func:`decode_frame`). Raises ReassemblyError on an inconsistent fragment sequence or a
        limit exceeded (the message concerned is dropped), FrameError on an unknown magic.
        """
        if isinstance(data, str):
            raise FrameError("a text message arrived; colibri-swarm data channels carry binary frames only")
        head = bytes(data[:4])
        if head == FRAME_MAGIC:
            return data
        if head != FRAGMENT_MAGIC:
            raise FrameError(f"message starts with {head!r}: neither a frame ({FRAME_MAGIC!r}) nor a fragment")
        if len(data) <= FRAGMENT_HEADER_BYTES:
            raise ReassemblyError(f"fragment of {len(data)} bytes carries no payload")
        _, version, flags, mid, index, count, total = _FRAGMENT.unpack_from(data)
        payload = memoryview(data)[FRAGMENT_HEADER_BYTES:]
        if version != PROTOCOL_VERSION or flags != 0:
            raise ReassemblyError(f"fragment of version {version} / flags {flags}; expected {PROTOCOL_VERSION} / 0")
        part = self._partial.get(mid)
        if part is None:
            self._start(mid, index, count, total, payload, now)
            return None
        try:
            if index != part.next_index or count != part.count or total != len(part.buf):
                raise ReassemblyError(
                    f"message {mid}: fragment {index}/{count} of {total} bytes does not follow "
                    f"fragment {part.next_index - 1}/{part.count} of {len(part.buf)} bytes"
                )
            last = index == count - 1
            want = len(part.buf) - part.filled if last else part.step
            if len(payload) != want:
                raise ReassemblyError(f"message {mid}: fragment {index} carries {len(payload)} bytes, expected {want}")
        except ReassemblyError:
            del self._partial[mid]
            raise
        part.buf[part.filled : part.filled + want] = payload
        part.filled += want
        part.next_index += 1
        part.last_s = now
        if last:
            del self._partial[mid]
            return part.buf
        return None

    def _start(self, mid: int, index: int, count: int, total: int, payload: memoryview, now: float) -> None:
        step = len(payload)
        if index != 0:
            raise ReassemblyError(f"message {mid}: fragment {index} arrived before fragment 0")
        if count < 2:
            raise ReassemblyError(f"message {mid}: fragment count {count}; a whole frame is sent unfragmented")
        if total > self.max_frame_bytes:
            raise ReassemblyError(f"message {mid}: {total} bytes exceed the frame limit of {self.max_frame_bytes}")
        if not step * (count - 1) < total <= step * count:
            raise ReassemblyError(f"message {mid}: {count} fragments of {step} bytes cannot make {total} bytes")
        if len(self._partial) >= self.max_inflight:
            raise ReassemblyError(f"message {mid}: more than {self.max_inflight} fragmented messages in flight")
        if self.buffered_bytes + total > self.max_buffered_bytes:
            raise ReassemblyError(
                f"message {mid}: {total} more bytes would exceed the receive buffer of {self.max_buffered_bytes}"
            )
        buf = bytearray(total)
        buf[:step] = payload
        self._partial[mid] = _Partial(buf=buf, count=count, step=step, filled=step, last_s=now)
        return None

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` must next run (seconds, same clock as ``now``), or None."""
        if not self._partial:
            return None
        return min(p.last_s for p in self._partial.values()) + self.abandon_s

    def handle_timer(self, now: float) -> list[int]:
        """Drop messages abandoned mid-way; returns their message ids (for a log line)."""
        dropped = [mid for mid, p in self._partial.items() if now - p.last_s >= self.abandon_s]
        for mid in dropped:
            del self._partial[mid]
        return dropped
