"""Placement properties: spans tile every layer, budgets hold, shares follow capacity."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import RemoteProtocolError
from swarm.peer.coordinator.planner import MAX_RTT_S, PeerCapacity, build_plan
from swarm.peer.plan import ModelShape, Plan, Span, check_plan
from swarm.peer.net.messages import NumericBuild
from swarm.peer.weights.repack import page_encodings
from swarm.peer.weights.sizes import model_shape, repacks_for

shapes = st.builds(
    lambda h, e, fm, f, n_moe, n_dense, bpw: ModelShape(
        h, e if n_moe else 0, fm, f, tuple(range(n_moe)), tuple(range(n_moe, n_moe + n_dense)), bpw),
    h=st.integers(8, 64), e=st.integers(1, 64), fm=st.integers(4, 64), f=st.integers(0, 300),
    n_moe=st.integers(0, 4), n_dense=st.integers(0, 4), bpw=st.sampled_from([4.0, 2.0, 0.5625]),
)
workers = st.lists(
    st.builds(PeerCapacity, peer_id=st.text("abcdef", min_size=1, max_size=4),
              memory_bytes=st.integers(0, 2_000_000), ffn_speed=st.floats(0.0, 100.0),
              rtt_s=st.floats(0.0, 0.5)),
    max_size=5, unique_by=lambda w: w.peer_id,
)


def units(plan: Plan, peer: str) -> int:
    return sum(len(s) for t in (plan.experts, plan.dense) for spans in t.values() for s in spans if s.peer == peer)


@given(shape=shapes, ws=workers, speed=st.floats(0.1, 100.0))
@settings(max_examples=300, deadline=None)
def test_spans_tile_and_budgets_hold(shape, ws, speed):
    coord = PeerCapacity("Z-coord", 0, speed)
    plan = build_plan(shape, coord, ws, term=3, version=7)
    check_plan(plan, shape)  # tiles every layer in peer order
    assert set(plan.experts) == (set(shape.moe_layers) if shape.n_experts else set())
    assert set(plan.dense) == (set(shape.dense_layers) if shape.intermediate_size else set())
    for w in ws:
        assert plan.bytes_of(w.peer_id, shape) <= w.memory_bytes
        if w.ffn_speed == 0 or w.rtt_s > MAX_RTT_S:
            assert units(plan, w.peer_id) == 0
    assert (plan.term, plan.version, plan.peers[0]) == (3, 7, "Z-coord")
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())), shape)
    assert again == plan


@given(speeds=st.lists(st.floats(1.0, 50.0), min_size=1, max_size=4), e=st.integers(8, 128))
@settings(max_examples=200, deadline=None)
def test_unbounded_shares_are_proportional_to_speed(speeds, e):
    shape = ModelShape(16, e, 16, 0, (0, 1, 2), ())
    ws = [PeerCapacity(f"w{i}", 10**12, s) for i, s in enumerate(speeds)]
    coord = PeerCapacity("c", 0, 10.0)
    plan = build_plan(shape, coord, ws, term=1, version=1, coordinator_share=0.5)
    total = 5.0 + sum(speeds)
    for layer in shape.moe_layers:
        for w in ws:
            span = plan.expert_span(layer, w.peer_id)
            got = len(span) if span else 0
            assert abs(got - e * w.ffn_speed / total) < 1.0 + 1e-9  # largest remainder: within one unit
        assert sum(len(s) for s in plan.experts[layer]) == e


def test_capped_worker_gets_its_budget_and_the_rest_moves():
    shape = ModelShape(hidden_size=8, n_experts=16, moe_intermediate_size=4, intermediate_size=0,
                       moe_layers=(0, 1), dense_layers=())
    per = shape.expert_bytes  # 3*8*4*4 = 384
    small = PeerCapacity("a", memory_bytes=3 * per, ffn_speed=100.0)
    big = PeerCapacity("b", memory_bytes=10**9, ffn_speed=100.0)
    plan = build_plan(shape, PeerCapacity("c", 0, 1.0), [small, big], term=1, version=1)
    assert plan.bytes_of("a", shape) <= 3 * per and units(plan, "a") == 3
    assert units(plan, "b") > units(plan, "c")  # the excess went to the capable worker, not the coordinator


@given(shape=shapes, ws=workers, speed=st.floats(0.1, 100.0), cut=st.sets(st.integers(0, 7)),
       budget=st.integers(0, 2_000_000))
@settings(max_examples=200, deadline=None)
def test_a_mix_cuts_only_its_layers_and_budgets_still_hold(shape, ws, speed, cut, budget):
    """Under a mix only the coordinator's stage's layers are cut; the others stay the
    coordinator's whole (a stage runs them), counted in no budget and never streamed."""
    c = PeerCapacity("c", 0, speed)
    plan = build_plan(shape, c, ws, term=1, version=1, coordinator_budget=budget, layers=cut)
    check_plan(plan, shape)
    for table in (plan.experts, plan.dense):
        for layer, spans in table.items():
            if layer not in cut:
                assert [s.peer for s in spans] == ["c"]
    for w in ws:
        if w.peer_id != "c":
            assert plan.bytes_of(w.peer_id, shape, w.kind) <= w.memory_bytes
    alone = build_plan(shape, c, ws, term=1, version=1, coordinator_budget=budget,
                       layers=[i for i in cut if i in shape.moe_layers or i in shape.dense_layers])
    assert alone.streamed_bytes == plan.streamed_bytes


def test_dense_spans_are_contiguous_and_cover_the_mlp():
    shape = ModelShape(576, 0, 0, 1536, (), tuple(range(30)))
    plan = build_plan(shape, PeerCapacity("c", 0, 1.0), [PeerCapacity("w", 10**9, 1.0)], term=2, version=1,
                      coordinator_share=1.0)
    for layer in range(30):
        assert plan.dense[layer] == (Span("c", 0, 768), Span("w", 768, 1536))
    assert plan.workers() == ("w",)


def test_alone_the_coordinator_computes_everything():
    shape = ModelShape(8, 4, 4, 32, (1,), (0,))
    plan = build_plan(shape, PeerCapacity("c", 0, 1.0), [], term=1, version=1)
    assert plan.experts[1] == (Span("c", 0, 4),) and plan.dense[0] == (Span("c", 0, 32),)
    assert plan.expert_owner(1, 3) == "c" and plan.workers() == ()


@pytest.mark.parametrize("mutate, what", [
    (lambda d: d["experts"].update({"0": [["c", 0, 2], ["w", 3, 4]]}), "do not tile"),
    (lambda d: d["experts"].update({"0": [["w", 0, 2], ["c", 2, 4]]}), "peer order"),
    (lambda d: d["experts"].update({"9": [["c", 0, 4]]}), "layer 9 has no experts"),
    (lambda d: d["dense"].update({"1": [["c", 0, 31]]}), "do not tile"),
    (lambda d: d.pop("term"), "malformed plan"),
    (lambda d: d.update(peers=5), "malformed plan"),
    (lambda d: d["experts"].update({"0": [["x", 0, 4]]}), "do not tile"),
])
def test_malformed_plans_are_refused(mutate, what):
    shape = ModelShape(8, 4, 4, 32, (0,), (1,))
    d = build_plan(shape, PeerCapacity("c", 0, 1.0), [PeerCapacity("w", 10**9, 1.0)], term=1, version=1).to_dict()
    d = json.loads(json.dumps(d))
    mutate(d)
    with pytest.raises(RemoteProtocolError, match=what):
        Plan.from_dict(d, shape)


@given(ws=workers, speed=st.floats(0.1, 100.0), budget=st.integers(0, 3_000_000),
       share=st.sampled_from([0.25, 0.5, 1.0]))
@settings(max_examples=300, deadline=None)
def test_the_coordinator_budget_holds_and_only_the_shortfall_is_streamed(ws, speed, budget, share):
    shape = ModelShape(hidden_size=16, n_experts=24, moe_intermediate_size=8, intermediate_size=96,
                       moe_layers=(0, 2), dense_layers=(1,), expert_nbytes=500, column_nbytes=60)
    plan = build_plan(shape, PeerCapacity("Z", 0, speed), ws, term=1, version=1, coordinator_share=share,
                      coordinator_budget=budget)
    check_plan(plan, shape)
    mine = plan.bytes_of("Z", shape)
    assert plan.streamed_bytes == max(mine - budget, 0)
    for w in ws:
        assert plan.bytes_of(w.peer_id, shape) <= w.memory_bytes
    if plan.streamed_bytes:  # streaming only when no usable worker has room for one more unit
        usable = [w for w in ws if w.ffn_speed > 0 and w.rtt_s <= MAX_RTT_S]
        assert all(w.memory_bytes - plan.bytes_of(w.peer_id, shape) < 500 for w in usable)


def test_a_swarm_too_small_for_the_model_says_what_is_missing():
    from swarm.peer.coordinator.planner import shortfall_message

    shape = ModelShape(hidden_size=16, n_experts=64, moe_intermediate_size=8, intermediate_size=0,
                       moe_layers=tuple(range(4)), dense_layers=(), expert_nbytes=1 << 20)  # 256 MiB in all
    ws = [PeerCapacity("a", 100 << 20, 1.0), PeerCapacity("b", 50 << 20, 1.0)]
    plan = build_plan(shape, PeerCapacity("c", 0, 1.0), ws, term=1, version=1, coordinator_budget=40 << 20)
    assert (plan.bytes_of("a", shape), plan.bytes_of("b", shape)) == (100 << 20, 50 << 20)
    assert plan.streamed_bytes == (256 - 190) << 20 and plan.bytes_of("c", shape) == 106 << 20
    msg = shortfall_message(plan, shape)
    assert "199 MB of the model's 268 MB" in msg and "69 MB is missing" in msg and "--memory" in msg
    fits = build_plan(shape, PeerCapacity("c", 0, 1.0), ws, term=1, version=1, coordinator_budget=200 << 20)
    assert fits.streamed_bytes == 0 and shortfall_message(fits, shape) is None


def test_a_browser_budget_counts_its_q8_repacks():
    shape = ModelShape(hidden_size=16, n_experts=40, moe_intermediate_size=8, intermediate_size=0,
                       moe_layers=(0,), dense_layers=(), expert_nbytes=100, page_expert_nbytes=190)
    page = PeerCapacity("p", 1900, 100.0, kind="browser")
    python = PeerCapacity("q", 1900, 100.0)
    plan = build_plan(shape, PeerCapacity("c", 0, 1.0), [page, python], term=1, version=1, coordinator_budget=0)
    assert plan.bytes_of("p", shape, "browser") <= 1900 and len(plan.expert_span(0, "p")) == 10
    assert len(plan.expert_span(0, "q")) == 19  # the same budget holds more in the file's own blocks


@pytest.mark.parametrize("down, page_down_bytes", [
    ("Q4_K", 144 / 256),  # the page's and a GPU peer's kernels read Q4_K blocks as they are: the file's size
    ("Q5_0", 34 / 32),  # no kernel reads Q5_0: the coordinator repacks it to Q8_0 for a page
])
def test_model_shape_counts_the_encoded_bytes_of_the_file(tmp_path, down, page_down_bytes):
    from swarm.compute.model import load_model
    from tests.multihost.test_capacity import random_moe_gguf

    qtype = __import__("gguf").GGMLQuantizationType[down]
    path = random_moe_gguf(tmp_path / "m.gguf", layers=2, hidden=256, experts=4, top_k=2, expert_ffn=256,
                           heads=4, kv_heads=2, down=qtype)
    shape = model_shape(load_model(path))
    block, size = __import__("gguf").GGML_QUANT_SIZES[qtype]
    gate_up = 2 * 256 * 256 * 34 // 32  # Q8_0
    assert shape.expert_bytes == gate_up + 256 * 256 * size // block
    assert shape.page_expert_nbytes == gate_up + 256 * 256 * page_down_bytes
    ffn = 2 * 4 * shape.expert_bytes
    assert shape.ffn_bytes() == ffn
    routers = 2 * 4 * 256 * 4
    assert shape.resident_nbytes == path.stat().st_size - ffn + routers
    # --verify widens its bound for a peer whose kernels compute on a repack (bounds.py)
    kernels = NumericBuild("0", "0", "webgpu kernels:q4_0,q4_1,q8_0,q4_k,q5_k,q6_k", "wasm", "f32")
    assert repacks_for(load_model(path), page_encodings(kernels)) == (down == "Q5_0")
    assert repacks_for(load_model(path), page_encodings(dataclasses.replace(kernels, blas="webgpu")))  # no K kernels


def test_subnormal_speeds_still_tile_every_layer():
    """A speed so small that ``left * speed`` underflows once gave shares summing past 1."""
    shape = ModelShape(hidden_size=16, n_experts=24, moe_intermediate_size=8, intermediate_size=96,
                       moe_layers=(0, 2), dense_layers=(1,), expert_nbytes=500, column_nbytes=60)
    ws = [PeerCapacity("a", 29760, 5e-324, 0.0)]
    plan = build_plan(shape, PeerCapacity("Z", 0, 1.0), ws, term=1, version=1, coordinator_share=0.25,
                      coordinator_budget=310)
    check_plan(plan, shape)
    assert plan.bytes_of("a", shape) <= 29760
