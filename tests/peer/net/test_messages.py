"""Wire messages (swarm.peer.net.messages): round trips, schema enforcement, cross-field rules."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import typing
from typing import Literal

import numpy as np
import pytest

from swarm.errors import LocalProtocolError, MessageError
from swarm.peer.net import messages as m
from swarm.peer.net import schema
from swarm.peer.net import wire

PA, PB = "a" * 26, "b2" * 13
HASH = hashlib.sha256(b"model").hexdigest()


def samples() -> list[object]:
    """One message of every kind, with non-trivial values."""
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 256, 1000, dtype=np.uint8)
    return [
        m.AuthHello(peer_id=PA, nonce="0f" * 32),
        m.AuthProof(key_mac="1a" * 32, channel_mac="2b" * 32),
        m.Hello(
            peer_id=PA,
            protocol_version=1,
            build=m.NumericBuild(package="0.1.0", numpy="2.3.1", blas="openblas 0.3.29", arch="x86_64", kernel_dtype="f32"),
            model_hash=HASH,
            memory_budget=3 * 2**30,
            ffn_gflops=41.5,
            peer_kind="browser",
            adapter_limits={"maxStorageBufferBindingSize": 134217728, "maxComputeInvocationsPerWorkgroup": 256},
            adapter_features=("shader-f16",),
            name="kitchen tablet ✓",
        ),
        m.LinkHeartbeat(seq=17, sent_s=1234.5),
        m.Error(request_id=99, code="stale_term", message="term 3 < 4"),
        m.RequestVote(term=4, candidate=PB),
        m.Vote(term=4, granted=True),
        m.LeaderHeartbeat(term=4, leader=PB),
        m.PlanMessage(
            term=4,
            version=8,
            assignments=(
                m.Assignment(layer=0, peer=PA, experts=(0, 1, 5), dense=()),
                m.Assignment(layer=1, peer=PB, experts=(), dense=((0, 512), (1024, 1536))),
            ),
        ),
        m.ExpertRequest(
            request_id=7, term=4, plan_version=8, layer=3,
            expert_ids=np.array([5, 0, 1], np.int32), row_counts=np.array([2, 0, 3], np.int32),
            rows=rng.standard_normal((5, 16)).astype(np.float32),
        ),
        m.ExpertAnswer(
            request_id=7, term=4, plan_version=8, layer=3,
            expert_ids=np.array([5, 0, 1], np.int32), row_counts=np.array([2, 0, 3], np.int32),
            outputs=rng.standard_normal((5, 16)).astype(np.float32),
        ),
        m.DenseRequest(
            request_id=8, term=4, plan_version=8, layer=2, ranges=((0, 512), (1024, 1536)),
            x=rng.standard_normal((4, 16)).astype(np.float32),
        ),
        m.DenseAnswer(
            request_id=8, term=4, plan_version=8, layer=2, ranges=((0, 512), (1024, 1536)),
            partials=rng.standard_normal((2, 4, 16)).astype(np.float32),
        ),
        m.ExpertAnswerInt8(
            request_id=9, term=4, plan_version=8, layer=1, expert_ids=np.array([3, 9], np.int32),
            row_counts=np.array([2, 1], np.int32), outputs=rng.standard_normal((3, 16)).astype(np.float32),
            down_rows=rng.integers(0, 256, (3, 128), dtype=np.uint8),
        ),
        m.DenseAnswerInt8(
            request_id=10, term=4, plan_version=8, layer=2, ranges=((0, 512),),
            partials=rng.standard_normal((1, 4, 16)).astype(np.float32),
            down_rows=rng.integers(0, 256, (4, 576), dtype=np.uint8),
        ),
        m.WeightManifest(
            request_id=1, model_hash=HASH, name="blk.3.ffn_gate_exps[0:8]", encoding="gguf:Q4_1",
            total_bytes=2500, chunk_bytes=1000, chunk_sha256=(HASH, HASH, HASH),
        ),
        m.WeightChunkRequest(request_id=2, model_hash=HASH, name="blk.3.ffn_gate_exps[0:8]", first=1, count=2),
        m.WeightChunk(
            request_id=2, model_hash=HASH, name="blk.3.ffn_gate_exps[0:8]", offset=1000,
            sha256=hashlib.sha256(chunk).hexdigest(), data=chunk,
        ),
        m.StagePlan(term=4, version=8, stages=(m.StageAssignment(PA, 0, 5), m.StageAssignment(PB, 5, 24))),
        m.StageRequest(request_id=2**31 + 1, term=4, plan_version=8,
                       segments=(m.StageSegment(2, 9, 1), m.StageSegment(5, 0, 2)), layer_start=5,
                       layer_stop=24, x=rng.standard_normal((3, 16)).astype(np.float32)),
        m.StageAnswer(request_id=2**31 + 1, term=4, plan_version=8, segments=(m.StageSegment(2, 9, 3),),
                      layer_start=5, layer_stop=24, compute_s=0.004, x=rng.standard_normal((3, 16)).astype(np.float32)),
        m.WeightsHeld(plan_version=7, weight_bytes=3 * 2**30 + 5),  # at the end: tests index the others
        m.Standby(term=4, version=8, reason="too_slow", message="this page's measured speed (2.1 GFLOP/s) would slow the swarm"),
    ]


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y and type(x) is type(y), f.name


def test_every_kind_has_a_sample() -> None:
    assert {type(s) for s in samples()} == set(m.KINDS.values())


def test_the_message_union_names_every_kind() -> None:
    assert set(typing.get_args(m.Message)) == set(m.KINDS.values())


@pytest.mark.parametrize("msg", samples(), ids=lambda s: type(s).__name__)
def test_round_trip(msg: object) -> None:
    data = m.encode(msg)
    assert_same(m.decode(data), msg)
    assert m.encode(m.decode(data)) == data  # encoding is deterministic
    frame = wire.decode_frame(data)
    assert frame.kind == type(msg).KIND
    assert frame.request_id == getattr(msg, "request_id", 0)


def test_tensors_decode_zero_copy() -> None:
    req = samples()[9]
    data = bytearray(m.encode(req))
    got = m.decode(data)
    assert np.shares_memory(got.rows, np.frombuffer(data, np.uint8))


def test_match_dispatch() -> None:
    def handle(msg: object) -> str:
        match msg:
            case m.LinkHeartbeat(seq=seq):
                return f"heartbeat {seq}"
            case m.ExpertRequest(layer=layer, rows=rows):
                return f"experts layer {layer} rows {rows.shape[0]}"
            case _:
                return "other"

    assert [handle(m.decode(m.encode(s))) for s in samples()[3:4] + samples()[9:10]] == [
        "heartbeat 17",
        "experts layer 3 rows 5",
    ]


# --- decoding enforces the schema ----------------------------------------------------------------


def _frame(kind: int, meta: object, tensors=(), request_id: int = 0) -> bytes:
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    return wire.encode_frame(kind, raw, tensors, request_id=request_id)


HB = m.LinkHeartbeat.KIND


def test_js_style_integral_floats_are_accepted() -> None:
    # JSON.stringify(1.0) === "1": a float field may arrive as an integer
    got = m.decode(_frame(HB, b'{"seq":1,"sent_s":2}'))
    assert got == m.LinkHeartbeat(seq=1, sent_s=2.0) and type(got.sent_s) is float


BAD_META = {
    "bool for int": (HB, b'{"seq":true,"sent_s":1.0}', "seq: expected an integer"),
    "negative int": (HB, b'{"seq":-1,"sent_s":1.0}', "seq: expected an integer"),
    "int beyond 2**53": (HB, b'{"seq":9007199254740992,"sent_s":1.0}', "seq: expected an integer"),
    "float for int": (HB, b'{"seq":1.5,"sent_s":1.0}', "seq: expected an integer"),
    "NaN": (HB, b'{"seq":1,"sent_s":NaN}', "NaN is not a JSON number"),
    "Infinity": (HB, b'{"seq":1,"sent_s":Infinity}', "Infinity"),
    "huge float": (HB, b'{"seq":1,"sent_s":1e999}', "finite number"),
    "integer beyond float": (HB, b'{"seq":1,"sent_s":' + b"9" * 400 + b'}', "finite number"),
    "string for float": (HB, b'{"seq":1,"sent_s":"1"}', "finite number"),
    "duplicate key": (HB, b'{"seq":1,"seq":2,"sent_s":1.0}', "duplicate key"),
    "missing key": (HB, b'{"seq":1}', r"missing \['sent_s'\]"),
    "extra key": (HB, b'{"seq":1,"sent_s":1.0,"x":0}', r"unexpected \['x'\]"),
    "not an object": (HB, b"[1,2]", "not a JSON object"),
    "not JSON": (HB, b"{seq:1}", "not UTF-8 JSON"),
    "not UTF-8": (HB, b'{"seq":1,"sent_s":1.0,"\xff":1}', "not UTF-8 JSON"),
    "integer of 5000 digits": (HB, b'{"seq":' + b"9" * 5000 + b',"sent_s":1.0}', "not UTF-8 JSON"),
    "deep nesting": (HB, b"[" * 100000 + b"]" * 100000, "not UTF-8 JSON|not a JSON object"),
    "literal out of set": (
        m.Vote.KIND, b'{"term":1,"granted":"yes"}', "granted: expected true or false",
    ),
    "bad peer id": (m.LeaderHeartbeat.KIND, b'{"term":1,"leader":"Alice"}', "not a peer id"),
    "nested record keys": (
        m.PlanMessage.KIND, b'{"term":1,"version":1,"assignments":[{"layer":0,"peer":"' + PA.encode() + b'"}]}',
        r"assignments\[0\]: keys",
    ),
    "empty range": (
        m.PlanMessage.KIND,
        b'{"term":1,"version":1,"assignments":[{"layer":0,"peer":"' + PA.encode() + b'","experts":[],"dense":[[5,5]]}]}',
        "empty range",
    ),
    "pair of three": (
        m.PlanMessage.KIND,
        b'{"term":1,"version":1,"assignments":[{"layer":0,"peer":"' + PA.encode() + b'","experts":[],"dense":[[1,2,3]]}]}',
        "array of 2 items",
    ),
    "long string": (m.Error.KIND, json.dumps({"code": "x", "message": "y" * 5000}).encode(), "at most 4096"),
}


@pytest.mark.parametrize("name", sorted(BAD_META))
def test_bad_metadata_raises_message_error_naming_the_field(name: str) -> None:
    kind, meta, needle = BAD_META[name]
    with pytest.raises(MessageError, match=needle):
        m.decode(_frame(kind, meta))


def _expert_meta() -> dict:
    return {"term": 1, "plan_version": 1, "layer": 0}


def test_tensor_rules() -> None:
    ids, counts = np.array([3, 4], np.int32), np.array([1, 2], np.int32)
    rows = np.ones((3, 8), np.float32)
    seg = np.array([1, 1, 1], np.int32)  # each row its own sequence's
    k = m.ExpertRequest.KIND
    cases = [
        ((ids, counts, rows), "3 tensors, expected 4"),
        ((ids, counts, rows, seg, seg), "5 tensors, expected 4"),
        ((ids, counts, rows.astype(np.int32), seg), "rows: expected rank 2 of f32"),
        ((ids, counts, rows[0], seg), "rows: expected rank 2"),
        ((ids, counts, rows.astype(np.float16), seg), "rows: expected rank 2 of f32"),  # activations are f32 only
        ((ids.astype(np.float32), counts, rows, seg), "expert_ids: expected rank 1 of i32"),
        ((ids, np.array([1, 1], np.int32), rows, seg), "sum to 2 but rows has 3 rows"),
        ((ids, np.array([4, -1], np.int32), rows, seg), "row_counts must be non-negative"),
        ((np.array([3, 3], np.int32), counts, rows, seg), "distinct"),
        ((ids, counts[:1], rows, seg), "differ in length"),
        ((ids, counts, rows, np.array([0, 3], np.int32)), "segments must be positive"),
        ((ids, counts, rows, np.array([1, 1], np.int32)), "segments sum to 2 but the request has 3 rows"),
        ((ids, counts, rows, np.array([3], np.int32)), "crosses the boundary"),
    ]
    for tensors, needle in cases:
        with pytest.raises(MessageError, match=needle):
            m.decode(_frame(k, _expert_meta(), tensors, request_id=1))
    partials = np.ones((3, 2, 8), np.float32)
    with pytest.raises(MessageError, match="3 partials for 2 ranges"):
        m.decode(_frame(m.DenseAnswer.KIND, {**_expert_meta(), "ranges": [[0, 1], [1, 2]]}, [partials]))


def test_the_down_rows_of_an_int8_answer_are_checked() -> None:
    ids, counts, out = np.array([3, 4], np.int32), np.array([1, 2], np.int32), np.ones((3, 8), np.float32)
    rows = np.zeros((3, 64), np.uint8)
    m.decode(_frame(m.ExpertAnswerInt8.KIND, _expert_meta(), [ids, counts, out, rows], request_id=1))  # well formed
    cases = [
        ([ids, counts, out], "3 tensors, expected 4"),
        ([ids, counts, out, rows[:2]], "down_rows has 2 rows but outputs has 3"),
        ([ids, counts, out, np.zeros((3, 96), np.uint8)], "rows of 96 bytes, expected a positive multiple of 64"),
        ([ids, counts, out, np.zeros((3, 0), np.uint8)], "rows of 0 bytes"),
        ([ids, counts, out, rows.view(np.int32)], "down_rows: expected rank 2 of u8"),
        ([ids, counts, out, rows.reshape(3, 1, 64)], "down_rows: expected rank 2"),
        ([ids, np.array([1, 1], np.int32), out, rows], "row_counts sum to 2"),  # the ExpertAnswer's own rules too
    ]
    for tensors, needle in cases:
        with pytest.raises(MessageError, match=needle):
            m.decode(_frame(m.ExpertAnswerInt8.KIND, _expert_meta(), tensors, request_id=1))
    partials, rows = np.ones((1, 2, 8), np.float32), np.zeros((2, 64), np.uint8)
    one, two = {**_expert_meta(), "ranges": [[0, 64]]}, {**_expert_meta(), "ranges": [[0, 64], [64, 128]]}
    m.decode(_frame(m.DenseAnswerInt8.KIND, one, [partials, rows], request_id=1))
    for meta, tensors, needle in [
        (two, [np.ones((2, 2, 8), np.float32), rows], "carries one range, got 2"),
        (one, [partials, rows[:1]], "down_rows has 1 rows but partials has 2"),
        (one, [partials[:, :, :4].reshape(2, 1, 4), rows], "2 partials for 1 ranges"),
    ]:
        with pytest.raises(MessageError, match=needle):
            m.decode(_frame(m.DenseAnswerInt8.KIND, meta, tensors, request_id=1))


def test_request_id_only_on_kinds_that_have_one() -> None:
    with pytest.raises(MessageError, match="request id 5 on a kind that has none"):
        m.decode(_frame(HB, {"seq": 1, "sent_s": 1.0}, request_id=5))


def test_unknown_kind() -> None:
    with pytest.raises(MessageError, match="unknown message kind 999"):
        m.decode(_frame(999, {}))


def test_encode_checks_locally() -> None:
    with pytest.raises(LocalProtocolError, match="seq: expected an integer"):
        m.encode(m.LinkHeartbeat(seq=np.int64(3), sent_s=1.0))
    with pytest.raises(LocalProtocolError, match="sum to"):
        s = samples()[9]
        m.encode(dataclasses.replace(s, rows=s.rows[:2]))
    with pytest.raises(LocalProtocolError, match="not a registered"):
        m.encode(object())


def test_weight_chunk_verify() -> None:
    chunk = next(s for s in samples() if isinstance(s, m.WeightChunk))
    m.decode(m.encode(chunk)).verify()
    with pytest.raises(MessageError, match="SHA-256"):
        dataclasses.replace(chunk, data=chunk.data[::-1].copy()).verify()


def test_a_new_kind_is_a_local_change() -> None:
    @m.message(4000)
    class Probe(m.MessageBase):
        request_id: int
        tags: tuple[str, ...]
        scale: float | None
        x: m.Annotated[np.ndarray, m.TensorSpec(("f16",), 1)]

    try:
        p = Probe(request_id=3, tags=("a", "b"), scale=None, x=np.ones(3, np.float16))
        assert_same(m.decode(m.encode(p)), p)
        with pytest.raises(TypeError, match="already used"):
            m.message(4000)(type("Other", (m.MessageBase,), {"__annotations__": {}}))
    finally:
        del m.KINDS[4000]


# --- property-based round trips ------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ints = st.integers(0, schema.MAX_INT)
floats = st.floats(allow_nan=False, allow_infinity=False)
peer_ids = st.text("abcdefghijklmnopqrstuvwxyz234567", min_size=26, max_size=26)
texts = st.text(max_size=40)
ranges = st.tuples(st.integers(0, 10_000), st.integers(1, 10_000)).map(lambda p: (p[0], p[0] + p[1]))


@st.composite
def expert_requests(draw):
    n = draw(st.integers(0, 6))
    ids = draw(st.lists(st.integers(0, 255), min_size=n, max_size=n, unique=True))
    counts = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    hidden = draw(st.integers(1, 9))
    rows = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal((sum(counts), hidden)).astype(np.float32)
    return m.ExpertRequest(
        request_id=draw(st.integers(0, 2**32 - 1)), term=draw(ints), plan_version=draw(ints), layer=draw(ints),
        expert_ids=np.array(ids, np.int32), row_counts=np.array(counts, np.int32), rows=rows,
    )


messages_strategy = st.one_of(
    st.builds(m.LinkHeartbeat, seq=ints, sent_s=floats),
    st.builds(m.Error, request_id=st.integers(0, 2**32 - 1), code=texts, message=st.text(max_size=300)),
    st.builds(m.Vote, term=ints, granted=st.booleans()),
    st.builds(
        m.PlanMessage, term=ints, version=ints,
        assignments=st.lists(
            st.builds(m.Assignment, layer=ints, peer=peer_ids,
                      experts=st.lists(ints, max_size=5).map(tuple), dense=st.lists(ranges, max_size=3).map(tuple)),
            max_size=5,
        ).map(tuple),
    ),
    st.builds(
        m.Hello, peer_id=peer_ids, protocol_version=ints,
        build=st.builds(m.NumericBuild, package=texts, numpy=texts, blas=texts, arch=texts, kernel_dtype=texts),
        model_hash=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
        memory_budget=ints, ffn_gflops=floats, peer_kind=st.sampled_from(["python", "browser"]),
        adapter_limits=st.dictionaries(texts, ints, max_size=4),
        adapter_features=st.lists(texts, max_size=4).map(tuple), name=texts,
    ),
    expert_requests(),
)


@settings(max_examples=300, deadline=None)
@given(messages_strategy)
def test_property_round_trip(msg: object) -> None:
    data = m.encode(msg)
    assert_same(m.decode(data), msg)
    assert m.encode(m.decode(data)) == data


def _leaf_paths(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaf_paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaf_paths(v, (*path, i))
    yield path


def _replaced(obj, path, value):
    if not path:
        return value
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[path[0]] = _replaced(obj[path[0]], path[1:], value)
    return out


def test_mutated_frames_of_every_kind_give_defined_errors() -> None:
    """Random byte flips and JSON values of the wrong type: decoding succeeds or raises RemoteProtocolError."""
    from swarm.errors import RemoteProtocolError

    rng = np.random.default_rng(2)
    junk = [None, True, -1, float("inf"), "x", [], {}, [[1, 2, 3]], 2**53 + 1, 0.5, "é" * 5000, {"a": 1}]
    for msg in samples():
        good = m.encode(msg)
        frame = wire.decode_frame(good)
        obj = json.loads(frame.meta)
        paths = list(_leaf_paths(obj))
        for _ in range(200):
            buf = bytearray(good)
            for i in rng.integers(0, len(buf), rng.integers(1, 4)):
                buf[i] = int(rng.integers(0, 256))
            path = paths[rng.integers(len(paths))]
            meta = json.dumps(_replaced(obj, path, junk[rng.integers(len(junk))])).encode()
            for data in (bytes(buf), wire.encode_frame(frame.kind, meta, frame.tensors, frame.request_id)):
                try:
                    m.decode(data)
                except RemoteProtocolError:
                    pass


_SCHEMA_TYPES = (int, float, str, bool, Literal["a", "b"], int | None, tuple[int, ...], tuple[int, str],
                 dict[str, float], m.StageSegment, tuple[m.StageSegment, ...])
_VALUES = (0, 1, -1, 2**53, 2**53 - 1, 1.5, 2.0, float("nan"), float("inf"), 10**400, True, False, None, "a",
           "c", "x" * (schema.MAX_STR + 1), [], [1, 2], (1, "a"), [1, "a", 2], {"k": 1.0}, {"k": "v"}, {1: 1.0},
           {"sequence": 1, "start": 0, "rows": 2}, {"sequence": 1, "start": 0}, m.StageSegment(1, 0, 2),
           [{"sequence": 1, "start": 0, "rows": 2}], [m.StageSegment(1, 0, 2)])


@pytest.mark.parametrize("tp", _SCHEMA_TYPES, ids=str)
def test_compiled_checks_agree_with_the_schema_rules(tp) -> None:
    # the per-type closures used on the hot path accept, refuse and convert exactly as the rules do
    for v in _VALUES:
        try:
            want = schema._check_value(v, tp, "f")
        except schema.Invalid:
            with pytest.raises(schema.Invalid):
                schema._checker(tp)(v)
            continue
        got = schema._checker(tp)(v)
        assert got == want and type(got) is type(want), (tp, v)
        to_json = schema._jsonifier(tp)
        assert (got if to_json is None else to_json(got)) == schema._to_json(got, tp), (tp, v)


def _gpu_hello(**changed: object) -> m.Hello:
    """A Python GPU peer's Hello (its build names the adapter) announcing 12 GiB of GPU memory."""
    build = m.NumericBuild(package="0.1.0", numpy="2.3.1", blas="wgpu 0.32.0 Vulkan kernels:q8_0 adapter:RTX 3060",
                           arch="x86_64", kernel_dtype="f32")
    fields: dict = dict(peer_id=PA, protocol_version=2, build=build, model_hash=HASH, memory_budget=2**34,
                        ffn_gflops=400.0, peer_kind="python", adapter_limits={}, adapter_features=(), name="tower",
                        gpu_memory=12 * 2**30)
    return m.Hello(**{**fields, **changed})


def test_a_gpu_peers_hello_carries_its_gpu_memory() -> None:
    back = m.decode(m.encode(_gpu_hello()))
    assert isinstance(back, m.Hello) and back.gpu_memory == 12 * 2**30 and back == _gpu_hello()


@pytest.mark.parametrize("value, why", [(-1, "0..2**53-1"), ("12G", "0..2**53-1"), (1.5, "0..2**53-1"),
                                        (True, "0..2**53-1"), (2**51, "more than any GPU holds")])
def test_a_bad_gpu_memory_is_refused_naming_it(value: object, why: str) -> None:
    meta = json.loads(wire.decode_frame(m.encode(_gpu_hello())).meta)
    frame = wire.encode_frame(m.Hello.KIND, json.dumps({**meta, "gpu_memory": value}).encode(), [])
    with pytest.raises(MessageError, match=f"gpu_memory.*{re.escape(why)}"):
        m.decode(frame)
    with pytest.raises(LocalProtocolError, match="gpu_memory"):
        m.encode(_gpu_hello(gpu_memory=value))


def test_only_a_python_gpu_peer_announces_gpu_memory() -> None:
    cpu = m.NumericBuild(package="0.1.0", numpy="2.3.1", blas="openblas 0.3.29", arch="x86_64", kernel_dtype="f32")
    for bad in (_gpu_hello(build=cpu), _gpu_hello(peer_kind="browser")):
        with pytest.raises(LocalProtocolError, match="gpu_memory: only a Python peer computing on a GPU"):
            m.encode(bad)
    assert m.decode(m.encode(_gpu_hello(build=cpu, gpu_memory=0))).gpu_memory == 0  # nothing announced: fine
