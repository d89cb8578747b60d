"""The FFN seam: router rules, expert batches, dense ranges, combine order, LocalFFN plans."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute import (LocalFFN, MLPWeights, combine, dense_partial, swiglu_ffn, expert_rows,
                           load_model, route, sum_partials)
from swarm.compute.ffn import Routing
from tests.compute.tiny_models import build_tiny

F32 = np.float32


def _softmax64(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ---- router -------------------------------------------------------------------------------
def test_route_ties_go_to_the_lowest_expert_index():
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0],
                       [2.0, 2.0, 2.0, 2.0, 2.0]], F32)
    r = route(logits, top_k=2, norm_topk_prob=False)
    assert r.experts.tolist() == [[1, 2], [0, 1]]
    np.testing.assert_allclose(r.weights, np.take_along_axis(_softmax64(logits.astype(np.float64)),
                                                             r.experts, -1), rtol=1e-6)


def test_route_all_negative_logits():
    logits = np.array([[-9.0, -1.0, -5.0, -0.5], [-3.0, -3.5, -80.0, -2.0]], F32)
    r = route(logits, top_k=2, norm_topk_prob=True)
    assert r.experts.tolist() == [[3, 1], [3, 0]]
    p = np.take_along_axis(_softmax64(logits.astype(np.float64)), r.experts, -1)
    np.testing.assert_allclose(r.weights, p / p.sum(-1, keepdims=True), rtol=1e-6)
    assert r.weights.dtype == F32
    np.testing.assert_allclose(r.weights.sum(-1), 1.0, rtol=1e-6)


def test_route_selection_bias_changes_choice_not_weights():
    logits = np.array([[0.0, 1.0, 2.0, 3.0]], F32)
    bias = np.array([5.0, 0.0, 0.0, 0.0], F32)
    r = route(logits, scoring="sigmoid", top_k=2, norm_topk_prob=False, selection_bias=bias)
    assert r.experts.tolist() == [[0, 3]]  # expert 0 chosen only because of the bias
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(r.weights, sig[:, [0, 3]], rtol=1e-6)  # unbiased scores


def test_route_rejects_bad_input():
    with pytest.raises(ValueError, match="float32"):
        route(np.zeros((2, 4)), top_k=1, norm_topk_prob=False)
    with pytest.raises(ValueError, match="top_k"):
        route(np.zeros((2, 4), F32), top_k=5, norm_topk_prob=False)
    with pytest.raises(ValueError, match="scoring"):
        route(np.zeros((2, 4), F32), scoring="relu", top_k=1, norm_topk_prob=False)


def test_expert_rows_ascending_and_complete():
    rng = np.random.default_rng(1)
    r = route(rng.normal(size=(50, 8)).astype(F32), top_k=3, norm_topk_prob=True)
    rows = expert_rows(r)
    assert list(rows) == sorted(rows)
    for e, idx in rows.items():
        assert np.all(np.diff(idx) > 0)
        assert np.array_equal(idx, np.flatnonzero((r.experts == e).any(-1)))
    assert sum(len(v) for v in rows.values()) == 50 * 3


# ---- experts and dense ranges -------------------------------------------------------------
def _random_mlp(rng, H=32, F=40):
    g, u = rng.normal(size=(F, H)).astype(F32) / 6, rng.normal(size=(F, H)).astype(F32) / 6
    d = rng.normal(size=(H, F)).astype(F32) / 6
    return MLPWeights.from_torch(g, u, d), (g, u, d)


def _swiglu64(g, u, d, x):
    x, g, u, d = (a.astype(np.float64) for a in (x, g, u, d))
    a = x @ g.T
    return ((a / (1 + np.exp(-a))) * (x @ u.T)) @ d.T


def test_swiglu_ffn_matches_float64():
    rng = np.random.default_rng(2)
    w, (g, u, d) = _random_mlp(rng)
    x = rng.normal(size=(7, 32)).astype(F32)
    y = swiglu_ffn(w, x)
    assert y.dtype == F32
    np.testing.assert_allclose(y, _swiglu64(g, u, d, x), atol=2e-6)


def test_expert_batch_rows_in_any_order_equal_per_row_results():
    rng = np.random.default_rng(3)
    w, (g, u, d) = _random_mlp(rng)
    x = rng.normal(size=(9, 32)).astype(F32)
    perm = rng.permutation(9)
    batch = swiglu_ffn(w, x[perm])
    rows = np.concatenate([swiglu_ffn(w, x[i:i + 1]) for i in perm])
    np.testing.assert_allclose(batch, rows, atol=1e-6)
    np.testing.assert_allclose(batch, _swiglu64(g, u, d, x[perm]), atol=2e-6)


def test_dense_ranges_sum_to_the_full_mlp():
    rng = np.random.default_rng(4)
    w, (g, u, d) = _random_mlp(rng, F=40)
    x = rng.normal(size=(5, 32)).astype(F32)
    ranges = [(0, 7), (7, 8), (8, 31), (31, 40)]
    parts = [dense_partial(w, x, lo, hi) for lo, hi in ranges]
    for (lo, hi), p in zip(ranges, parts):
        np.testing.assert_allclose(p, _swiglu64(g[lo:hi], u[lo:hi], d[:, lo:hi], x), atol=2e-6)
        np.testing.assert_array_equal(p, swiglu_ffn(w.range(lo, hi), x))  # what a range holder computes
    np.testing.assert_allclose(sum_partials(parts), swiglu_ffn(w, x), atol=2e-6)
    with pytest.raises(ValueError):
        w.range(30, 41)


def test_route_of_one_row_equals_its_row_of_the_batch():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(9, 16)).astype(F32) * 3
    logits[4, 3] = logits[4, 7] = logits[4].max() + 1  # a tie inside one row
    for kw in (dict(top_k=4, norm_topk_prob=True), dict(top_k=3, norm_topk_prob=False, scoring="sigmoid")):
        batch = route(logits, **kw)
        for t in range(logits.shape[0]):  # decode takes the one-row path
            one = route(logits[t:t + 1], **kw)
            np.testing.assert_array_equal(one.experts, batch.experts[t:t + 1])
            np.testing.assert_array_equal(one.weights, batch.weights[t:t + 1])
            assert one.experts.dtype == np.int64 and one.weights.dtype == F32
            rows = expert_rows(one)
            assert list(rows) == sorted(batch.experts[t].tolist())
            assert all(v.tolist() == [0] and v.dtype == np.int64 for v in rows.values())


def test_combine_weights_experts_ascending_then_shared():
    rng = np.random.default_rng(5)
    T, H, E = 6, 4, 5
    r = route(rng.normal(size=(T, E)).astype(F32) * 4, top_k=2, norm_topk_prob=False)
    rows = expert_rows(r)
    outs = {e: rng.normal(size=(len(v), H)).astype(F32) for e, v in rows.items()}
    shared = rng.normal(size=(T, H)).astype(F32)
    got = combine(T, H, r, outs, shared=shared)
    want = np.zeros((T, H), F32)  # the documented order, written out row by row
    for t in range(T):
        for e in sorted(r.experts[t]):
            slot = list(r.experts[t]).index(e)
            i = list(rows[e]).index(t)
            want[t] += outs[e][i] * r.weights[t, slot]
        want[t] += shared[t]
    np.testing.assert_array_equal(got, want)
    for t in range(T):  # one row alone (decode's path) gives that row's bits
        one = Routing(r.experts[t:t + 1], r.weights[t:t + 1])
        outs_t = {e: outs[e][list(rows[e]).index(t)][None] for e in r.experts[t]}
        np.testing.assert_array_equal(combine(1, H, one, outs_t, shared=shared[t:t + 1]), got[t:t + 1])
    with pytest.raises(ValueError, match="expert"):
        combine(T, H, r, {e: v for e, v in outs.items() if e != min(outs)})


# ---- LocalFFN on real (tiny) checkpoints ---------------------------------------------------
@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    return load_model(build_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))[1])


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return load_model(build_tiny("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"))[1])


TOKENS = [3, 17, 52, 9, 88, 41, 5]


def test_local_ffn_with_a_plan_matches_the_whole_mlp(dense_model):
    plan = {0: [(0, 20), (20, 48)], 2: [(0, 1), (1, 30), (30, 48)]}
    planned = dense_model.forward(TOKENS, dense_model.new_cache(), ffn=LocalFFN(dense_model, plan))
    whole = dense_model.forward(TOKENS, dense_model.new_cache())
    np.testing.assert_allclose(planned, whole, atol=1e-5)
    again = dense_model.forward(TOKENS, dense_model.new_cache(), ffn=LocalFFN(dense_model, plan))
    np.testing.assert_array_equal(planned, again)
    with pytest.raises(ValueError, match="cover"):
        LocalFFN(dense_model, {0: [(0, 20), (21, 48)]})


class _RemoteLike:
    """Composes the public blocks the way a coordinator does: one batch-union per 'peer'
    (experts split in two groups, dense ranges held by separate 'peers' as weight copies)."""

    def __init__(self, model, plan):
        self.m, self.plan = model, plan
        self.slices = {(l, lo, hi): model.dense_weights(l, lo, hi) for l, rs in plan.items() for lo, hi in rs}

    def ffn(self, layer, x):
        m = self.m
        if m.is_moe_layer(layer):
            routing = route(m.router_logits(layer, x), **m.routing_config(layer).kwargs())
            rows = expert_rows(routing)
            outputs = {}
            for peer in ([e for e in rows if e % 2 == 0], [e for e in rows if e % 2 == 1]):
                union = np.unique(np.concatenate([rows[e] for e in peer])) if peer else np.array([], int)
                xu = x[union].copy()  # what goes on the wire
                for e in peer:
                    outputs[e] = swiglu_ffn(m.expert_weights(layer, e), xu[np.searchsorted(union, rows[e])])
            return combine(*x.shape, routing, outputs, shared=m.shared_expert_output(layer, x))
        return sum_partials([swiglu_ffn(self.slices[(layer, lo, hi)], x.copy()) for lo, hi in self.plan[layer]])


def test_remote_composition_is_bit_identical_to_local(moe_model):
    plan = {l: [(0, 10), (10, 48)] for l in range(moe_model.config.n_layers) if not moe_model.is_moe_layer(l)}
    local = moe_model.forward(TOKENS, moe_model.new_cache(), ffn=LocalFFN(moe_model, plan))
    remote = moe_model.forward(TOKENS, moe_model.new_cache(), ffn=_RemoteLike(moe_model, plan))
    np.testing.assert_array_equal(local, remote)


def test_per_expert_results_do_not_depend_on_other_rows(moe_model):
    x = np.random.default_rng(6).normal(size=(10, 64)).astype(F32)
    w = moe_model.expert_weights(0, 1)
    rows = np.array([1, 4, 7])
    alone = swiglu_ffn(w, x[rows])
    union = np.array([0, 1, 2, 4, 5, 7, 9])
    from_union = swiglu_ffn(w, x[union][np.searchsorted(union, rows)])
    np.testing.assert_array_equal(alone, from_union)


@pytest.mark.parametrize("fmt", ["hf", "gguf_q8"])
def test_dense_range_loaded_alone_equals_the_slice_of_the_whole(tmp_path, fmt):
    import gguf

    from tests.compute.tiny_gguf import write_gguf_from_hf

    hf, path = build_tiny("qwen3", tmp_path / "hf")
    if fmt == "gguf_q8":  # gate/up rows stay Q8_0 blocks; down's columns 10:30 cut blocks: F32
        path = write_gguf_from_hf(hf, "qwen3", tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0)
    alone = load_model(path).dense_weights(1, 10, 30)  # nothing else materialised
    whole = load_model(path).dense_weights(1)
    ref = whole.range(10, 30)
    for got, want in ((alone.gate, ref.gate), (alone.up, ref.up), (alone.down, ref.down)):
        assert got.qtype == want.qtype and got.shape == want.shape
        np.testing.assert_array_equal(got.data, want.data)
    np.testing.assert_array_equal(alone.down.dequantize(), whole.down.dequantize()[:, 10:30])
    if fmt == "gguf_q8":
        assert alone.gate.qtype.name == "Q8_0" and alone.down.qtype.name == "F32"


def test_a_failing_backend_leaves_the_cache_reusable(dense_model):
    class Failing:
        def ffn(self, layer, x):
            if layer == 1:
                raise ConnectionError("peer lost")
            return LocalFFN(dense_model).ffn(layer, x)

    cache = dense_model.new_cache()
    dense_model.forward(TOKENS[:4], cache)
    with pytest.raises(ConnectionError):
        dense_model.forward(TOKENS[4:], cache, ffn=Failing())
    assert cache.length == 4
    retried = dense_model.forward(TOKENS[4:], cache)
    fresh_cache = dense_model.new_cache()
    dense_model.forward(TOKENS[:4], fresh_cache)
    np.testing.assert_array_equal(retried, dense_model.forward(TOKENS[4:], fresh_cache))
