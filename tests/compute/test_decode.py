"""The one-row decode path (swarm/compute/decode.py): each compiled step gives the bits of the
numpy/kernel steps it replaces, on random inputs of real and odd shapes, and a model's decode
logits are those of the general path, bit for bit, for every family it runs and those it
leaves to the general path."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import LocalFFN, kernels, quant, threads
from swarm.compute.ffn import route
from swarm.compute.kernels import apply_rope_swapped, rms_norm, signed_sin
from swarm.compute.model import load_model
from tests.compute.tiny_gguf import write_gguf_from_hf
from tests.compute.tiny_models import DENSE_FAMILIES, MOE_FAMILIES, build_tiny

F32 = np.float32


@pytest.fixture(scope="module")
def row():
    kernels.prepare_row_kernels()
    return kernels._row


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("D", [1, 7, 8, 13, 64, 2048, 2050])
def test_residual_add_and_norm_is_the_two_steps(row, D):
    """``add_rms_norm``: ``x += y`` then ``rms_norm(x, w)``, bit for bit; rows of any width."""
    rng = np.random.default_rng(D)
    for R in (1, 3):
        x = rng.normal(size=(R, D)).astype(F32) * F32(3)
        y = rng.normal(size=(R, D)).astype(F32)
        w = rng.normal(size=(1, D)).astype(F32)
        want_x = x + y
        want = rms_norm(want_x, w[0], 1e-6)
        out = np.empty_like(x)
        row.add_rms_norm(x, y, w, F32(1e-6), out)
        assert same_bits(x, want_x) and same_bits(out, want)


def general_qk(qkv: np.ndarray, bias, norm, cos, ssin, nh: int, nkv: int, hd: int, eps: float):
    """``Model._attention``'s steps on one row: bias, the heads' RMSNorm, RoPE; → (q [1, nh, hd],
    k [nkv, hd], v [nkv, hd])."""
    qkv = qkv.reshape(1, -1).copy()
    if bias is not None:
        qkv += bias.reshape(-1)
    qk = qkv[:, :(nh + nkv) * hd].reshape(1, nh + nkv, hd)
    if norm is not None:
        qk = rms_norm(qk, norm, eps)
    qk = apply_rope_swapped(qk, cos[None], ssin[None])
    return qk[:, :nh], qk[0, nh:], qkv[0, (nh + nkv) * hd:].reshape(nkv, hd)


@pytest.mark.parametrize("nh, nkv, hd", [(4, 2, 64), (6, 2, 20), (3, 3, 6), (32, 4, 128), (8, 1, 2)])
def test_qk_heads_are_the_general_steps(row, nh, nkv, hd):
    """``qk_rope_row``: Q/K/V bias, RMSNorm of each query and key head, RoPE with the scale in
    the query rows, the key and value written at the position: the general path's bits, with
    and without a bias and a norm."""
    rng = np.random.default_rng(nh * 100 + hd)
    n, pos, C = nh + 2 * nkv, 5, 9
    freqs = np.arange(hd // 2, dtype=F32) * F32(0.37) + F32(pos)
    emb = np.concatenate([freqs, freqs])
    scale = np.ones((nh + nkv, 1), F32)
    scale[:nh] = F32(hd ** -0.5)
    cos = np.cos(emb).astype(F32)[None] * scale
    ssin = signed_sin(np.sin(emb).astype(F32))[None] * scale
    for bias in (None, rng.normal(size=(n, hd)).astype(F32)):
        for norm in (None, (1 + 0.1 * rng.normal(size=(nh + nkv, hd))).astype(F32)):
            qkv = (rng.normal(size=(n, hd)) * 4).astype(F32)
            q_want, k_want, v_want = general_qk(qkv, bias, norm, cos, ssin, nh, nkv, hd, 1e-6)
            q = np.empty((nh, hd), F32)
            k, v = np.zeros((nkv, C, hd), F32), np.zeros((nkv, C, hd), F32)
            none = np.zeros((0, 1), F32)
            row.qk_rope_row(qkv, none if bias is None else bias, none if norm is None else norm, F32(1e-6),
                            cos, ssin, q, k, v, pos)
            assert same_bits(q, q_want[0]) and same_bits(k[:, pos], k_want) and same_bits(v[:, pos], v_want)
            assert not k[:, :pos].any() and not v[:, pos + 1:].any()  # nothing but the position is written


def test_pairwise_sum_is_numpys(row):
    """The compiled sum adds float32 elements in numpy's order (``np.add.reduce`` of a contiguous
    row): every length to 700, across the 8-element and the 128-element steps."""
    from numba import njit

    total = njit(lambda a: row.pairwise_sum(a, 0, a.shape[0]))
    rng = np.random.default_rng(3)
    for n in range(1, 700):
        a = (rng.random(n) * rng.choice([1e-3, 1.0, 1e3])).astype(F32)
        want = np.add.reduce(a[None], axis=-1, keepdims=True, dtype=F32)[0, 0]
        assert same_bits(F32(total(a)), want), n


@pytest.mark.parametrize("E, k", [(4, 2), (7, 3), (60, 4), (64, 8), (128, 8), (129, 6), (256, 8), (300, 1)])
def test_routing_a_row_is_route(row, E, k):
    """shift_max, numpy's exp and ``route_row`` choose the experts ``route`` chooses for one row,
    in its slot order (ties to the lower index) and with its weights, bit for bit, and list
    them ascending; softmax and sigmoid scores, renormalised or not, scaled or not."""
    rng = np.random.default_rng(E * 10 + k)
    for trial in range(6):
        logits = (rng.normal(size=(1, E)) * 3).astype(F32)
        if trial == 1:  # ties: the lower index first
            logits[0, ::2] = logits[0, 0]
        norm, factor = bool(trial % 2), (1.0, 2.5)[trial // 3 % 2]
        for scoring in ("softmax", "sigmoid"):
            want = route(logits, scoring=scoring, top_k=k, norm_topk_prob=norm, routed_scaling_factor=factor)
            s = logits[0].copy()
            if scoring == "softmax":
                row.shift_max(s)
                np.exp(s, out=s)
            else:
                s = kernels.sigmoid(s)
            experts, weights = np.empty((2, k), np.int64), np.empty((2, k), F32)
            row.route_row(s, scoring == "softmax", k, norm, F32(factor), experts, weights)
            assert np.array_equal(experts[0], want.experts[0]), (trial, scoring)
            assert same_bits(weights[0], want.weights[0]), (trial, scoring)
            order = np.argsort(want.experts[0])
            assert np.array_equal(experts[1], want.experts[0][order])
            assert same_bits(weights[1], want.weights[0][order])


def test_expert_tables_are_run_alikes(row):
    """``fill_experts`` writes the gate/up and down tables ``run_alike`` builds for the same
    experts, in ascending order, and the products they run give its bits."""
    from gguf.quants import quantize

    quant.prepare_kernels()
    from swarm.compute import pointers  # compiled: imported once the kernels have set numba up

    rng = np.random.default_rng(9)
    E, k, F, H = 6, 3, 64, 96
    shapes = ((F, H), (F, H), (H, F))  # gate, up, down
    mats = [[quant.QMatrix.from_float(rng.normal(size=s).astype(F32)) for s in shapes] for _ in range(E)]
    mats = [[quant.QMatrix(quantize(m.dequantize(), QT.Q8_0), QT.Q8_0, m.cols) for m in ms] for ms in mats]
    sel = np.array([1, 2, 5], np.int64)
    x = quant.aligned_empty((1, H))
    x[...] = rng.normal(size=(1, H))
    gu = quant.aligned_empty((2 * k, F))
    ys = np.empty((k, H), F32)
    address = quant._pointer
    g0, d0 = mats[0][0], mats[0][2]
    gu_tile, gu_per = quant.alike_tiles(g0, 1, 2 * k)
    d_tile, d_per = quant.alike_tiles(d0, 1, k)
    meta = np.array([[g0._kind, F, g0.data.shape[1], 1, H, gu_tile, gu_per, address(x), 0, address(gu), 4 * F],
                     [d0._kind, H, d0.data.shape[1], 1, F, d_tile, d_per, address(gu), 4 * F, address(ys), 4 * H]],
                    np.int64)
    addresses = np.array([[ms[j]._addr for ms in mats] for j in range(3)], np.int64)
    table = np.empty((3 * k, 10), np.int64)
    pointers.fill_experts(table, meta, addresses, sel)
    gate_up = [mats[e][0] for e in sel] + [mats[e][1] for e in sel]
    want = np.empty((2 * k, 10), np.int64)
    quant._fill_alike(want, g0._kind, F, g0.data.shape[1], 1, H, gu_tile, gu_per,
                      np.array([w._addr for w in gate_up], np.int64), address(x), 0, address(gu), 4 * F)
    assert np.array_equal(table[:2 * k], want)
    want = np.empty((k, 10), np.int64)
    quant._fill_alike(want, d0._kind, H, d0.data.shape[1], 1, F, d_tile, d_per,
                      np.array([mats[e][2]._addr for e in sel], np.int64), address(gu), 4 * F, address(ys), 4 * H)
    assert np.array_equal(table[2 * k:], want)
    quant.run_table(table[:2 * k], 2 * k * gu_per, 1.0)
    for i, w in enumerate(gate_up):
        assert same_bits(gu[i:i + 1], w.matmul(x))


def test_expert_tables_of_several_rows_group_them_as_expert_rows(row):
    """``fill_expert_rows`` runs each selected expert once, over the rows ``expert_rows`` gives it
    (ascending), gathered in expert order; ``rank`` points each row's choices at their outputs."""
    from swarm.compute.ffn import Routing, expert_rows

    quant.prepare_kernels()
    from swarm.compute import pointers  # compiled: imported once the kernels have set numba up

    rng = np.random.default_rng(5)
    n, k, E, H, F = 5, 3, 7, 16, 8
    sel = np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(n)]), axis=1).astype(np.int64)
    x = rng.normal(size=(n, H)).astype(F32)
    xg, rank = np.empty((n * k, H), F32), np.empty((n, k), np.int64)
    addresses = np.arange(3 * E, dtype=np.int64).reshape(3, E) * 1000
    meta = np.array([[7, F, 99, 1, H, 8, 2, 10_000, 4 * H, 50_000, 4 * F],
                     [9, H, 77, 1, F, 8, 3, 50_000, 4 * F, 90_000, 4 * H]], np.int64)
    table = np.full((3 * n * k, 10), -1, np.int64)
    D = pointers.fill_expert_rows(table, meta, addresses, sel, x, xg, rank)
    groups = expert_rows(Routing(sel, np.ones((n, k), F32)))
    assert D == len(groups) < n * k
    first = 0
    for j, (e, rows) in enumerate(groups.items()):
        assert same_bits(xg[first:first + rows.size], x[rows])
        for r, s in zip(rows.tolist(), range(first, first + rows.size)):
            assert rank[r, sel[r].tolist().index(e)] == s
        gate, up, down = table[j], table[D + j], table[2 * D + j]
        assert gate.tolist() == [7, addresses[0, e], F, 99, 10_000 + first * 4 * H, rows.size, H,
                                 50_000 + first * 4 * F, 8, 2 * j]
        assert up.tolist() == [7, addresses[1, e], F, 99, 10_000 + first * 4 * H, rows.size, H,
                               50_000 + (n * k + first) * 4 * F, 8, 2 * (D + j)]
        assert down.tolist() == [9, addresses[2, e], H, 77, 50_000 + first * 4 * F, rows.size, F,
                                 90_000 + first * 4 * H, 8, 3 * j]
        first += rows.size
    assert first == n * k


def general_logits(model, tokens: list[int], prefill: int, ffn=None) -> np.ndarray:
    """A prefill then one decode row per token, the runner on (default) or off."""
    cache = model.new_cache()
    steps = [model.forward(tokens[:prefill], cache, ffn)] + [model.forward([t], cache, ffn) for t in tokens[prefill:]]
    return np.concatenate(steps)


def decode_both_ways(model, tokens: list[int], prefill: int = 5, ffn=None) -> tuple[np.ndarray, np.ndarray]:
    """The logits of :func:`general_logits` through the one-row path, and through the general one."""
    fast = general_logits(model, tokens, prefill, ffn)
    runner = model._decode
    model.__dict__["_decode"] = None  # Model.layers takes the general path
    try:
        return fast, general_logits(model, tokens, prefill, ffn)
    finally:
        model.__dict__["_decode"] = runner


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """family → a Q8_0 GGUF of its tiny model (widths that fit Q8_0's blocks: the one-row steps'
    group tables take every product), built once per module."""
    built: dict = {}

    def get(family):
        if family not in built:
            d = tmp_path_factory.mktemp(family)
            hf, _ = build_tiny(family, d / "hf", intermediate_size=64)
            built[family] = write_gguf_from_hf(hf, family, d / "q8.gguf", qtype=QT.Q8_0)
        return built[family]

    return get


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_decode_rows_have_the_general_paths_bits(tiny, quantized, family):
    """Decode logits through the one-row path equal the general path's, bit for bit, for each
    family, float32 (group tables of float32 products: the dense step; a MoE's experts through
    matmul_many) and Q8_0 (group tables, the one-row MoE and dense steps); OLMoE's norm of the
    whole Q/K stays on the general path."""
    for path in (tiny(family)[1], quantized(family)):
        model = load_model(path)
        assert (model._decode is None) == (family == "olmoe")
        tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, 12).tolist()
        fast, general = decode_both_ways(model, tokens)
        assert np.isfinite(fast).all() and fast.std() > 0
        assert same_bits(fast, general), path
        if model._decode is not None:  # the one-row FFN steps ran (float32 experts: not alike() blocks)
            step = type(model._decode._scratch().layers[0].ffn).__name__
            blocks = path.suffix == ".gguf"
            assert step == ("_Dense" if family in DENSE_FAMILIES else "_MoE" if blocks else "NoneType")
            if family == "qwen2_moe":  # Q/K/V biases and a gated shared expert on the way
                assert model.has_shared_expert(0) and model.attention_weights(0).qkv_bias is not None


def test_other_backends_get_rows_of_their_own(tiny):
    """A backend other than the model's LocalFFN is handed a fresh array per layer (it may keep
    it), and its answers give the LocalFFN's bits; a LocalFFN with a dense plan keeps its plan."""
    _, path = tiny("qwen3")
    model = load_model(path)
    seen: list[np.ndarray] = []

    class Keeping:
        def ffn(self, layer, x, segments=None):
            seen.append(x)
            return model._local_ffn.ffn(layer, x.copy())

    tokens = [3, 5, 7, 11]
    want = general_logits(model, tokens, 3)
    cache = model.new_cache()
    model.forward(tokens[:3], cache, ffn=Keeping())
    seen.clear()
    got = model.forward(tokens[3:], cache, ffn=Keeping())
    assert same_bits(got, want[3:])
    assert len({id(x) for x in seen}) == len(seen) == model.config.n_layers
    assert len({x.tobytes() for x in seen}) == len(seen)  # none overwritten by a later layer
    F = model.dense_intermediate_size(0)
    planned = LocalFFN(model, {0: [(0, F // 2), (F // 2, F)]})
    fast, general = decode_both_ways(model, tokens, 3, ffn=planned)
    assert same_bits(fast, general)


def test_threads_decoding_at_once_keep_their_bits(tiny):
    """Several threads decoding their own sequences at once (each its own scratch) get the
    bits of each alone."""
    _, path = tiny("qwen3_moe")
    model = load_model(path)
    rng = np.random.default_rng(8)
    seqs = [rng.integers(0, model.config.vocab_size, 10).tolist() for _ in range(3)]
    want = [general_logits(model, s, 2) for s in seqs]
    got: list = [None] * 3

    def run(i: int) -> None:
        got[i] = general_logits(model, seqs[i], 2)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert all(same_bits(g, w) for g, w in zip(got, want))


def test_a_batch_of_one_sequence_decodes_on_the_one_row_path(tiny, quantized):
    """A batch scheduler's step of one decoding sequence (``forward_batch`` with one part of one
    token, what one API stream runs) takes the one-row path, and its logits are those of
    ``forward`` and of the general path, bit for bit; a step of two sequences keeps the batch
    path."""
    model = load_model(quantized("qwen3_moe"))
    runner = model._decode
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, 9).tolist()
    calls = []
    real = runner.layers

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    runner.layers = counting
    try:
        cache = model.new_cache()
        model.forward_batch([(tokens[:8], cache)])
        assert calls == []  # a prefill chunk: the general path
        got = model.forward_batch([(tokens[8:], cache)])
        assert calls == [(1, model.config.hidden_size)]
        others = [model.new_cache() for _ in range(2)]
        for c in others:
            model.forward_batch([(tokens[:8], c)])
        calls.clear()
        model.forward_batch([(tokens[8:], c) for c in others])
        assert calls == []
    finally:
        del runner.layers
    _, general = decode_both_ways(model, tokens, 8)
    assert same_bits(got, general[-1:])


def batch_steps(model, prompts: list[list[int]], steps: list[list[int]]) -> np.ndarray:
    """Each prompt's prefill alone, then ``forward_batch`` steps of one token per sequence
    (``steps[j][i]``: sequence i's token at step j): the steps' logits [steps, n, V]."""
    caches = [model.new_cache() for _ in prompts]
    for p, c in zip(prompts, caches):
        model.forward(p, c)
    return np.stack([model.forward_batch([([t], c) for t, c in zip(toks, caches)]) for toks in steps])


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_steps_of_several_decode_rows_have_the_general_paths_bits(tiny, quantized, family, monkeypatch):
    """A batch step of n sequences of one row each (at their own positions: prompts of different
    lengths) takes the decode steps for n rows, and every row's logits are the general batch
    path's and those of its sequence decoded alone, bit for bit: n = 2, 3, 8, float32 and Q8_0,
    at 1, 2 and 3 threads (the work thresholds lowered so that products, activations and
    attention split between them)."""
    before = threads.threads()
    monkeypatch.setattr(quant, "MIN_CHUNK_BYTES", 256)
    monkeypatch.setattr(quant, "GROUP_TILE_BYTES", 256)
    monkeypatch.setattr(kernels, "MIN_ELEMENTWISE", 64)
    monkeypatch.setattr(kernels, "MIN_ATTENTION_WORK", 256)
    rng = np.random.default_rng(11)
    try:
        for path in (tiny(family)[1], quantized(family)):
            model = load_model(path)
            runner = model._decode
            assert (runner is None) == (family == "olmoe")
            V = model.config.vocab_size
            for n, n_threads in ((2, 1), (3, 2), (8, 3), (3, 1)):
                threads.set_threads(n_threads)
                prompts = [rng.integers(0, V, 2 + 3 * i).tolist() for i in range(n)]
                steps = rng.integers(0, V, (3, n)).tolist()
                calls: list[int] = []
                if runner is not None:
                    real = runner.rows
                    runner.rows = lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)  # type: ignore
                try:
                    fast = batch_steps(model, prompts, steps)
                finally:
                    runner is not None and runner.__dict__.pop("rows")
                assert calls == ([] if runner is None else [n] * len(steps))
                model.__dict__["_decode"] = None  # the general paths, one row and batched
                try:
                    general = batch_steps(model, prompts, steps)
                    alone = []
                    for i, p in enumerate(prompts):
                        cache = model.new_cache()
                        model.forward(p, cache)
                        alone.append([model.forward([toks[i]], cache, last_only=True)[0] for toks in steps])
                finally:
                    model.__dict__["_decode"] = runner
                assert np.isfinite(fast).all() and fast.std() > 0
                assert same_bits(fast, general), (path, n, n_threads)
                assert same_bits(fast, np.array(alone, F32).transpose(1, 0, 2)), (path, n, n_threads)
            if runner is not None and path.suffix == ".gguf":  # the n-row FFN steps ran
                step = runner._scratch(3).layers[0].ffn
                assert type(step).__name__ == ("_MoE" if family in MOE_FAMILIES else "_Dense")
    finally:
        threads.set_threads(before)


def test_steps_of_decode_rows_take_the_short_path_for_plain_local_ffns_only(quantized):
    """A step of decode rows takes the n-row steps with the model's LocalFFN or another of the
    same model without a plan (a stage's local backend); a planned LocalFFN and other backends
    keep the general batch path and get each layer's rows with their segments. The same bits
    every way."""
    model = load_model(quantized("qwen3"))
    runner = model._decode
    assert runner is not None
    rng = np.random.default_rng(6)
    V, n = model.config.vocab_size, 3
    prompts = [rng.integers(0, V, 2 + i).tolist() for i in range(n)]
    steps = rng.integers(0, V, (2, n)).tolist()
    want = batch_steps(model, prompts, steps)
    F = model.dense_intermediate_size(0)
    seen: list = []

    class Other:
        def ffn(self, layer, x, segments=None):
            seen.append(segments)
            return model._local_ffn.ffn(layer, x.copy(), segments)

    real = runner.rows
    for ffn, short in ((LocalFFN(model), True), (LocalFFN(model, {0: [(0, F // 2), (F // 2, F)]}), False),
                       (Other(), False)):
        calls: list[int] = []
        runner.rows = lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)  # type: ignore
        try:
            caches = [model.new_cache() for _ in prompts]
            for p, c in zip(prompts, caches):
                model.forward(p, c)
            got = np.stack([model.forward_batch([([t], c) for t, c in zip(toks, caches)], ffn) for toks in steps])
        finally:
            runner.__dict__.pop("rows")
        assert calls == ([n] * len(steps) if short else [])
        if isinstance(ffn, LocalFFN) and ffn.plan:
            continue  # a plan sums the dense partials: other bits, its own path's
        assert same_bits(got, want), ffn
    assert seen and all(s == [1] * n for s in seen[-model.config.n_layers:])


def test_steps_of_many_sizes_keep_bounded_scratch_and_their_bits(quantized):
    """A batch whose size changes step by step keeps the scratch of at most KEPT_SCRATCHES step
    sizes a thread, the layers of one scratch share their FFN buffers (one layer's worth, not
    one per layer), and a size built again after it was dropped gives the same bits."""
    from swarm.compute import decode

    model = load_model(quantized("qwen3_moe"))
    runner = model._decode
    rng = np.random.default_rng(6)
    caches = [model.new_cache() for _ in range(7)]
    for c in caches:
        model.forward_batch([(rng.integers(0, model.config.vocab_size, 5).tolist(), c)])
    first = model.forward_batch([([3], c) for c in caches[:2]])
    for n in range(3, 8):
        model.forward_batch([([3], c) for c in caches[:n]])
    kept = runner._local.scratch
    assert list(kept) == list(range(8 - decode.KEPT_SCRATCHES, 8))  # the most recent sizes, oldest first
    s = kept[7]
    steps = [L.ffn for L in s.layers.values() if isinstance(L.ffn, decode._MoE)]
    assert len(s.layers) == model.config.n_layers and len(steps) >= 2, [type(L.ffn) for L in s.layers.values()]
    assert all(f.g.base is steps[0].g.base and f.ys is steps[0].ys for f in steps)
    # the two first sequences again from their prompts: the same step on a rebuilt scratch
    again = [model.new_cache() for _ in range(2)]
    rng2 = np.random.default_rng(6)
    for c in again:
        model.forward_batch([(rng2.integers(0, model.config.vocab_size, 5).tolist(), c)])
    assert 2 not in kept
    assert same_bits(model.forward_batch([([3], c) for c in again]), first)
