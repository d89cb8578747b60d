"""Frame codec and fragmentation/reassembly (swarm.peer.net.wire), checked against hand-built bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from swarm.errors import FrameError, ReassemblyError, RemoteProtocolError, VersionMismatchError
from swarm.peer.net import wire
from swarm.peer.net.wire import (
    BF16,
    FRAGMENT_HEADER_BYTES,
    Fragmenter,
    Reassembler,
    decode_frame,
    encode_frame,
    max_message_size_from_sdp,
)

KIB = 1024


def sample_tensors() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((3, 5)).astype(np.float32),
        rng.standard_normal((2, 3, 1)).astype(np.float16),
        rng.integers(0, 2**16, (7,), dtype=np.uint16).view(BF16),
        np.array([-5, 0, 2**31 - 1], np.int32),
        np.frombuffer(b"hello", np.uint8),
        np.zeros((0, 4), np.float32),
        np.array(1.5, np.float32),
        np.arange(16, dtype=np.float32).reshape(1, 2, 2, 4),
    ]


def test_header_layout_matches_the_spec() -> None:
    # docs/protocol.md: magic, version, kind, flags, n_tensors, request_id, meta_len, frame_len (LE).
    frame = encode_frame(3, b'{"a":1}', [np.array([1.0, 2.0], np.float32)], request_id=0x01020304)
    meta_end = 24 + 7 + 1  # padded to 8
    table_end = meta_end + 8 + 4 + 4  # entry (dtype, rank, reserved, offset) + 1 dim, padded
    expected = (
        b"CLSW" + struct.pack("<HHHHIII", wire.PROTOCOL_VERSION, 3, 0, 1, 0x01020304, 7, table_end + 8)
        + b'{"a":1}' + b"\0"
        + struct.pack("<BBHII", 1, 1, 0, table_end, 2) + b"\0" * 4
        + struct.pack("<2f", 1.0, 2.0)
    )
    assert frame == expected


def test_round_trip_every_dtype_and_rank_zero_copy_and_aligned() -> None:
    tensors = sample_tensors()
    frame = bytearray(encode_frame(9, b"{}", tensors, request_id=42))
    assert len(frame) % wire.ALIGN == 0
    got = decode_frame(frame)
    assert (got.kind, got.request_id, got.meta) == (9, 42, b"{}")
    base = np.frombuffer(frame, np.uint8).ctypes.data
    for want, t in zip(tensors, got.tensors, strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape
        assert wire.dtype_name(t) == wire.dtype_name(want)
        np.testing.assert_array_equal(t, want)
        assert (t.ctypes.data - base) % wire.ALIGN == 0
    # zero-copy: the decoded tensor is a view of the received buffer
    frame[-8:-4] = struct.pack("<f", 99.0)
    assert got.tensors[-1].reshape(-1)[-2] == 99.0


def test_decoded_tensors_of_bytes_are_read_only() -> None:
    got = decode_frame(encode_frame(1, b"", [np.ones(3, np.float32)]))
    assert not got.tensors[0].flags.writeable


def test_encode_refuses_what_a_receiver_would_refuse() -> None:
    from swarm.errors import LocalProtocolError

    with pytest.raises(LocalProtocolError, match="cannot travel"):
        encode_frame(1, b"", [np.ones(2, np.float64)])
    with pytest.raises(LocalProtocolError, match="rank"):
        encode_frame(1, b"", [np.ones((1,) * 5, np.float32)])
    with pytest.raises(LocalProtocolError, match="tensors exceed"):
        encode_frame(1, b"", [np.ones(1, np.float32)] * 17)


# --- malformed frames: each defect is named ------------------------------------------------------

GOOD = encode_frame(5, b'{"k":2}', [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7], np.int32)], 3)
TABLE_AT = 32  # 24-byte header + 7 bytes of metadata, padded


def _patch(frame: bytes, offset: int, fmt: str, *values: int) -> bytes:
    buf = bytearray(frame)
    struct.pack_into(fmt, buf, offset, *values)
    return bytes(buf)


def _with_len(frame: bytes) -> bytes:
    """Fix the frame_len field after a frame was lengthened or shortened."""
    return _patch(frame, 20, "<I", len(frame))


MALFORMED = {
    "short header": (GOOD[:10], "shorter than the 24-byte header"),
    "bad magic": (b"XXXX" + GOOD[4:], "bad frame magic"),
    "flags": (_patch(GOOD, 8, "<H", 1), "unknown frame flags"),
    "length field": (_patch(GOOD, 20, "<I", len(GOOD) + 8), "frame length field"),
    "trailing bytes": (_with_len(GOOD + b"\0" * 8), "trailing bytes"),
    "too many tensors": (_patch(GOOD, 10, "<H", 17), "exceed the limit of 16"),
    "meta past end": (_patch(GOOD, 16, "<I", len(GOOD)), "runs past the end"),
    "meta too large": (_patch(GOOD, 16, "<I", wire.MAX_META_BYTES + 1), "metadata of"),
    "unknown dtype": (_patch(GOOD, TABLE_AT, "<B", 99), "unknown dtype code 99"),
    "rank": (_patch(GOOD, TABLE_AT + 1, "<B", 5), "rank 5 exceeds"),
    "reserved": (_patch(GOOD, TABLE_AT + 2, "<H", 1), "reserved field"),
    "offset": (_patch(GOOD, TABLE_AT + 4, "<I", 0), "data offset"),
    "shape too big": (_patch(GOOD, TABLE_AT + 8, "<I", 2**32 - 1), "runs past the end"),
    "shape too small": (_patch(GOOD, TABLE_AT + 8, "<I", 1), "non-zero padding"),
    "meta padding": (_patch(GOOD, 24 + 7, "<B", 1), "non-zero padding"),
    "more tensors than the table holds": (_patch(GOOD, 10, "<H", 9), "tensor 2: unknown dtype"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frame_raises_frame_error_naming_the_defect(name: str) -> None:
    data, needle = MALFORMED[name]
    with pytest.raises(FrameError, match=needle):
        decode_frame(data)


def test_other_protocol_version_names_both_versions() -> None:
    with pytest.raises(VersionMismatchError, match=f"version 7.*version {wire.PROTOCOL_VERSION}"):
        decode_frame(_patch(GOOD, 4, "<H", 7))
    with pytest.raises(VersionMismatchError, match="version 2; this peer speaks version 3: run the same"):
        decode_frame(_patch(GOOD, 4, "<H", 2))


def test_frame_over_the_receivers_limit() -> None:
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode_frame(GOOD, max_frame_bytes=len(GOOD) - 8)


def test_every_truncation_and_byte_flip_gives_a_defined_error() -> None:
    for n in range(len(GOOD)):
        with pytest.raises(RemoteProtocolError):
            decode_frame(GOOD[:n])
    rng = np.random.default_rng(1)
    for _ in range(3000):
        buf = bytearray(GOOD)
        for i in rng.integers(0, len(buf), rng.integers(1, 4)):
            buf[i] = int(rng.integers(0, 256))
        try:
            decode_frame(buf)
        except RemoteProtocolError:
            pass  # any other exception type fails the test


# --- fragmentation and reassembly -----------------------------------------------------------------

SIZES = [1, 64 * KIB - 1, 64 * KIB, 64 * KIB + 1, 256 * KIB - 1, 256 * KIB, 256 * KIB + 1, 8 * 1024 * KIB]


@pytest.mark.parametrize("limit", [64 * KIB, 256 * KIB])
def test_reassembly_at_boundary_sizes(limit: int) -> None:
    rng = np.random.default_rng(limit)
    fragmenter, reassembler = Fragmenter(limit), Reassembler()
    for size in SIZES:
        payload = rng.integers(0, 256, size, dtype=np.uint8)
        frame = encode_frame(50, b"{}", [payload], request_id=size)
        pieces = fragmenter.split(frame)
        assert all(len(p) <= limit for p in pieces)
        assert (len(pieces) == 1) == (len(frame) <= limit)
        out = [reassembler.feed(p, now=0.0) for p in pieces]
        assert all(o is None for o in out[:-1])
        assert bytes(out[-1]) == frame
        got = decode_frame(out[-1])
        assert got.request_id == size
        np.testing.assert_array_equal(got.tensors[0], payload)
        assert reassembler.buffered_bytes == 0 and reassembler.get_timer() is None


def test_interleaved_messages_reassemble() -> None:
    fragmenter, reassembler = Fragmenter(4 * KIB), Reassembler()
    frames = [encode_frame(50, b"{}", [np.full(20 * KIB + i, i, np.uint8)]) for i in range(3)]
    queues = [fragmenter.split(f) for f in frames]
    done = []
    while any(queues):
        for q in queues:
            if q and (out := reassembler.feed(q.pop(0), now=0.0)) is not None:
                done.append(bytes(out))
    assert sorted(done) == sorted(frames)


def _fragments(size: int = 10 * KIB, limit: int = 4 * KIB) -> list[bytes]:
    return Fragmenter(limit).split(encode_frame(50, b"{}", [np.zeros(size, np.uint8)]))


def _fragment(mid: int, index: int, count: int, total: int, payload: bytes) -> bytes:
    return b"CLSF" + struct.pack("<HHIIII", wire.PROTOCOL_VERSION, 0, mid, index, count, total) + payload


def test_inconsistent_fragment_sequences_are_refused_and_dropped() -> None:
    f = _fragments()
    assert len(f) == 3
    cases = {
        "skipped fragment": ([f[0], f[2]], "does not follow"),
        "repeated fragment": ([f[0], f[0]], "does not follow"),
        "starts mid-way": ([f[1]], "before fragment 0"),
        "count changes": ([f[0], _patch(f[1], 16, "<I", 4)], "does not follow"),
        "total changes": ([f[0], _patch(f[1], 20, "<I", 1)], "does not follow"),
        "short middle fragment": ([f[0], f[1][:-1]], "carries"),
        "long last fragment": ([f[0], f[1], f[2] + b"\0"], "carries"),
        "count of one": ([_fragment(9, 0, 1, 10, b"x" * 10)], "sent unfragmented"),
        "count cannot make total": ([_fragment(9, 0, 2, 100, b"x" * 10)], "cannot make"),
        "empty fragment": ([f[0][:FRAGMENT_HEADER_BYTES]], "no payload"),
        "bad version": ([_patch(f[0], 4, "<H", 7)], "version 7"),
    }
    for name, (seq, needle) in cases.items():
        r = Reassembler()
        with pytest.raises(ReassemblyError, match=needle):
            for piece in seq:
                r.feed(piece, now=0.0)
        assert r.buffered_bytes == 0, name
        # the receiver keeps working after a bad sequence
        assert [r.feed(p, now=1.0) for p in f][-1] is not None, name


def test_unknown_magic_is_a_frame_error() -> None:
    with pytest.raises(FrameError, match="neither a frame"):
        Reassembler().feed(b"GET / HTTP/1.1\r\n", now=0.0)


def test_receive_buffers_are_bounded() -> None:
    r = Reassembler(max_inflight=2, max_buffered_bytes=1 << 20, max_frame_bytes=1 << 19)
    r.feed(_fragment(1, 0, 2, 1000, b"a" * 500), now=0.0)
    r.feed(_fragment(2, 0, 2, 1000, b"a" * 500), now=0.0)
    with pytest.raises(ReassemblyError, match="more than 2 fragmented messages"):
        r.feed(_fragment(3, 0, 2, 1000, b"a" * 500), now=0.0)
    with pytest.raises(ReassemblyError, match="frame limit"):
        Reassembler(max_frame_bytes=1 << 19).feed(_fragment(1, 0, 2, (1 << 19) + 2, b"a" * (1 << 18 | 1)), 0.0)
    r = Reassembler(max_buffered_bytes=1500)
    r.feed(_fragment(1, 0, 2, 1000, b"a" * 500), now=0.0)
    with pytest.raises(ReassemblyError, match="receive buffer"):
        r.feed(_fragment(2, 0, 2, 1000, b"a" * 500), now=0.0)
    assert r.buffered_bytes == 1000


def test_abandoned_messages_are_dropped_after_the_limit() -> None:
    r = Reassembler(abandon_s=5.0)
    f = _fragments()
    r.feed(f[0], now=10.0)
    r.feed(f[1], now=12.0)
    assert r.get_timer() == 17.0
    assert r.handle_timer(16.9) == []
    assert r.handle_timer(17.0) == [0]
    assert r.buffered_bytes == 0 and r.get_timer() is None
    with pytest.raises(ReassemblyError, match="before fragment 0"):
        r.feed(f[2], now=18.0)


def test_max_message_size_from_sdp() -> None:
    assert max_message_size_from_sdp("v=0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n") == 65536
    assert max_message_size_from_sdp("v=0\r\na=sctp-port:5000\r\na=max-message-size:262144\r\n") == 262144
    assert max_message_size_from_sdp("a=max-message-size:0\r\n") > wire.MAX_FRAME_BYTES


# --- property-based ------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

WIRE_DTYPES = [np.float32, np.float16, BF16, np.int32, np.uint8]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(WIRE_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    n = int(np.prod(shape))
    raw = draw(st.binary(min_size=n * np.dtype(dtype).itemsize, max_size=n * np.dtype(dtype).itemsize))
    return np.frombuffer(raw, dtype).reshape(shape)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.integers(0, 0xFFFF),
    request_id=st.integers(0, 2**32 - 1),
    meta=st.binary(max_size=64),
    ts=st.lists(tensors(), max_size=5),
    limit=st.integers(1024, 4096),
)
def test_property_frame_and_fragment_round_trip(kind, request_id, meta, ts, limit) -> None:
    frame = encode_frame(kind, meta, ts, request_id=request_id)
    got = decode_frame(frame)
    assert (got.kind, got.request_id, got.meta) == (kind, request_id, meta)
    for want, t in zip(ts, got.tensors, strict=True):
        assert wire.dtype_name(t) == wire.dtype_name(want) and t.shape == want.shape
        assert t.tobytes() == want.tobytes()  # bit-exact, NaN payloads included
    padded = frame + bytes(limit * 3)  # make sure fragmentation happens for some examples
    big = encode_frame(kind, meta, [*ts, np.frombuffer(padded, np.uint8)], request_id=request_id)
    r = Reassembler()
    outs = [r.feed(p, now=0.0) for p in Fragmenter(limit).split(big)]
    assert bytes(outs[-1]) == big and all(o is None for o in outs[:-1])


def test_text_message_is_refused() -> None:
    with pytest.raises(FrameError, match="text message"):
        Reassembler().feed("hello", now=0.0)
