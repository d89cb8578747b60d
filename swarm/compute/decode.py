"""One decode row (T = 1, one sequence) through a model's layers, with little Python between
the compiled kernels.

``Model.layers`` hands a one-row call to :class:`DecodeRunner` where the layers allow it
(standard attention: no MLA, linear layers, output gate, norm of the whole Q/K, clipping,
partial RoPE, sinks or window; :func:`supported`). A decode token otherwise spends a good share
of its time on the Python that builds arrays, checks shapes and builds group tables between
kernels: ~350 Python calls a layer of a 64-expert MoE, which more threads do not shorten. Here,
per thread, the buffers a layer needs are allocated once and reused by every layer and token,
and per layer the group tables of its products (which hold the addresses of the weights and of
those buffers) are built once, again when the thread count changes. The chains of small steps
are compiled (swarm/compute/rowkernels.py): the residual update with the next RMSNorm, a row's
Q/K head norms with RoPE and the KV write, the routing of a row; the experts' tables are filled
by one compiled call (swarm/compute/pointers.py).

A batch step of n sequences of one row each (``Model.layers_batch``, up to :data:`MAX_ROWS`,
the model's own FFN) takes the same steps on n rows: a scratch and tables per n, every product
over all the rows at once, each row's RoPE, KV write and attention at its own position over its
own cache, each row's routing, and each selected expert once over the rows routed to it
(``pointers.fill_expert_rows`` gathers them and writes the tables), so the Python between the
kernels is paid once a step rather than once a row.

Every step is the general path's sequence of float32 operations — the same kernels, or compiled
twins of numpy steps tested bit for bit (tests/compute/test_decode.py) — so a row's bits are
those ``Model._attention`` and ``LocalFFN.ffn`` give it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from swarm.compute import kernels, quant, threads
from swarm.compute.ffn import LocalFFN
from swarm.compute.kernels import MLPWeights, _row_kernels, silu_mul
from swarm.compute.quant import QMatrix, aligned_empty, alike, alike_tiles, group_table, run_table

if TYPE_CHECKING:
    from swarm.compute.ffn import FFNBackend
    from swarm.compute.model import AttentionWeights, KVCache, Model

F32 = np.float32
_NONE = np.zeros((0, 1), F32)  # "no bias" / "no norm" for rowkernels.qk_rope_row


def supported(model: Model) -> bool:
    """Whether :class:`DecodeRunner` runs this model's layers: standard attention, RoPE over
    whole heads, the engine's own products."""
    c = model.config
    return (model.products is None and not c.is_mla and not c.linear_layers and not c.attn_output_gate
            and c.qk_norm in (None, "head") and c.clip_qkv is None and c.rope_dim == c.head_dim
            and not c.attention_sinks and not any(c.layer_windows))


class _Layer:
    """One layer's share of a thread's scratch: its group tables and FFN step (addresses of the
    weights and of the scratch buffers, tiles sized for the thread count they were built for)."""

    __slots__ = ("w", "attn_norm", "ffn_norm", "bias", "qk_norm", "qkv", "o", "ffn")

    def __init__(self, w: AttentionWeights, s: _Scratch, c):
        self.w = w
        # writable C-ordered copies: the one type the kernels are compiled for when they load
        self.attn_norm = _own(w.attn_norm.reshape(1, -1))
        self.ffn_norm = _own(w.ffn_norm.reshape(1, -1))
        self.bias = _NONE if w.qkv_bias is None else _own(w.qkv_bias.reshape(-1, c.head_dim))
        self.qk_norm = _NONE if w.q_norm is None else _own(w.q_norm)
        self.qkv = _table(s.qkv_products(w))
        self.o = _table([(w.o, s.att, s.o)])
        self.ffn: _MoE | _Dense | None = None


def _own(a: np.ndarray) -> np.ndarray:
    return np.array(a, F32, order="C")


def _table(products: list[tuple[QMatrix, np.ndarray, np.ndarray]]) -> tuple | None:
    """A group table for ``products`` (the scratch's buffers: C-ordered, one row), or None where
    a matrix has no group kind (those products then run through ``matmul_many``)."""
    if all(w._group >= 0 and w._c for w, _, _ in products):
        return group_table(products)
    return None


def _silu_mul(g: np.ndarray, u: np.ndarray, e: np.ndarray, split: bool) -> None:
    """``kernels.silu_mul(g, u)``; where it takes one part, its steps with ``e`` [g's shape] as
    the scratch for exp(-g)."""
    if split:
        silu_mul(g, u)
        return
    np.negative(g, out=e)
    np.exp(e, out=e)
    (kernels._row or _row_kernels()).silu_mul(g, u, e)


class _Dense:
    """A dense layer's whole SwiGLU on a row, ``swiglu_ffn``'s kernels in its order: the gate and
    up products as one group into a [2n, F] buffer (the n gate rows, then the n up rows), the
    activation, the down product."""

    __slots__ = ("g", "u", "e", "split", "gu_table", "down_table", "y")

    def __init__(self, mlp: MLPWeights, s: _Scratch):
        F, n = mlp.gate.shape[0], s.n
        gu = s.buffer("gu", (2 * n, F), aligned=True)
        self.g, self.u, self.e = gu[:n], gu[n:], s.buffer("e", (n, F))
        self.split = threads.parts_for(n * F, kernels.MIN_ELEMENTWISE) > 1
        self.y = s.y
        self.gu_table = _table([(mlp.gate, s.h2, self.g), (mlp.up, s.h2, self.u)])
        self.down_table = _table([(mlp.down, self.g, s.y)])

    def __call__(self, m: Model, s: _Scratch) -> np.ndarray:
        run_table(*self.gu_table)  # type: ignore[misc]
        _silu_mul(self.g, self.u, self.e, self.split)
        run_table(*self.down_table)  # type: ignore[misc]
        return self.y


class _MoE:
    """A MoE layer's step on n rows, ``LocalFFN.ffn``'s operations (softmax routing without
    selection bias or groups; plain SwiGLU experts of one encoding and shape): the router's
    logits, the routing of each row (``rowkernels.route_row``), the selected experts' gate and up
    products as one group, the activation, their down products as another, each row's weighted
    sum in ascending expert order, then the shared expert. One row: each expert reads the row as
    it is (``pointers.fill_experts``); n rows: each selected expert runs once over the rows
    routed to it, gathered (``pointers.fill_expert_rows``), as ``LocalFFN.ffn`` runs it."""

    __slots__ = ("layer", "router", "router_table", "fill", "logits", "k", "norm",
                 "scale", "experts", "weights", "sel", "rank", "xg", "ys_rows", "addresses", "meta", "table",
                 "gu_per", "down_per", "gu_work", "down_work", "g", "u", "e", "split", "ys", "y", "shared")

    def __init__(self, m: Model, layer: int, s: _Scratch, experts: list[MLPWeights]):
        rc = m.routing_config(layer)
        E, k, n = len(experts), rc.top_k, s.n
        nk = n * k
        from swarm.compute import pointers  # compiled: imported once the kernels have set numba up

        self.fill: Callable[..., Any] = pointers.fill_experts if n == 1 else pointers.fill_expert_rows
        self.layer, self.k, self.norm, self.scale = layer, k, rc.norm_topk_prob, F32(rc.routed_scaling_factor)
        self.router = m.router(layer)
        self.logits = s.buffer("logits", (n, E))
        # float32 weights (0.5 MB for 64 experts × 2048), read from memory every layer: on the
        # threads a group reaches (~40 µs a layer on one core)
        self.router_table = _table([(self.router, s.h2, self.logits)])
        self.experts = s.buffer("experts", (n, 2, k), np.int64)  # route_row's [2, k] of each row
        self.weights = s.buffer("weights", (n, 2, k))
        g0, d0 = experts[0].gate, experts[0].down
        F, H = g0.shape[0], d0.shape[0]
        gu = s.buffer("gu", (2 * nk, F), aligned=True)  # gate rows, then up rows, as swiglu_one_row lays them out
        self.g, self.u, self.e = gu[:nk], gu[nk:], s.buffer("e", (nk, F))
        self.split = threads.parts_for(nk * F, kernels.MIN_ELEMENTWISE) > 1
        self.ys = s.buffer("ys", (nk, H))
        self.y = s.y
        self.addresses = np.array([[w.gate._addr for w in experts], [w.up._addr for w in experts],
                                   [w.down._addr for w in experts]], np.int64)
        address = quant._pointer
        gu_tile, self.gu_per = alike_tiles(g0, 1, 2 * nk)
        d_tile, self.down_per = alike_tiles(d0, 1, nk)
        if n == 1:  # every product reads the row; product i writes row i
            self.sel, self.rank, self.xg, self.ys_rows = self.experts[0, 1], None, s.h2, self.ys
            x_step, gu_step, out_step = 0, 4 * F, 4 * H
        else:  # the rows grouped by expert; a product's rows at its first row's offset
            self.sel, self.rank = s.buffer("sel", (n, k), np.int64), s.buffer("rank", (n, k), np.int64)
            self.xg, self.ys_rows = s.buffer("xg", (nk, H), aligned=True), s.buffer("ys_rows", (nk, H))
            x_step, gu_step, out_step = 4 * H, 4 * F, 4 * H
        self.meta = np.array([
            [g0._kind, F, g0.data.shape[1], 1, g0.cols, gu_tile, self.gu_per, address(self.xg), x_step,
             address(gu), gu_step],
            [d0._kind, H, d0.data.shape[1], 1, d0.cols, d_tile, self.down_per, address(gu), 4 * F,
             address(self.ys), out_step],
        ], np.int64)
        self.table = s.buffer("table", (3 * nk, 10), np.int64)
        self.gu_work = 2 * F * g0.data.shape[1]  # run_alike's measure (bytes × (3 + T) / 4), an expert's
        self.down_work = H * d0.data.shape[1]
        self.shared = m.has_shared_expert(layer)

    def __call__(self, m: Model, s: _Scratch) -> np.ndarray:
        row = kernels._row or _row_kernels()
        logits, experts, weights, k, n = self.logits, self.experts, self.weights, self.k, s.n
        if self.router_table is not None:
            run_table(*self.router_table)
        else:
            self.router.matmul(s.h2, logits)
        for i in range(n):
            row.shift_max(logits[i])
        np.exp(logits, out=logits)  # numpy's float32 exp, as softmax takes it
        for i in range(n):
            row.route_row(logits[i], True, k, self.norm, self.scale, experts[i], weights[i])
        if self.rank is None:
            self.fill(self.table, self.meta, self.addresses, self.sel)
            D = k
        else:
            self.sel[...] = experts[:, 1]
            D = self.fill(self.table, self.meta, self.addresses, self.sel, s.h2, self.xg, self.rank)
        run_table(self.table[:2 * D], 2 * D * self.gu_per, D * self.gu_work)
        _silu_mul(self.g, self.u, self.e, self.split)
        run_table(self.table[2 * D:3 * D], D * self.down_per, D * self.down_work)
        ys = self.ys_rows
        if self.rank is not None:  # each row's outputs in its ascending expert order
            np.take(self.ys, self.rank.reshape(-1), axis=0, out=ys)
        y = self.y
        y.fill(0.0)
        for i in range(n):
            row.weighted_sum(y[i], ys[i * k:(i + 1) * k], weights[i, 1])
        if self.shared:
            y += m.shared_expert_output(self.layer, s.h2)
        return y


class _Scratch:
    """One thread's buffers for one model's steps of n decode rows, and its per-layer tables."""

    def __init__(self, c, n: int):
        H, nh, nkv, hd = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim
        self.n, self.nq, self.nk = n, nh * hd, nkv * hd
        self.h = aligned_empty((n, H))  # normed rows: attention's products read them
        self.h2 = aligned_empty((n, H))  # and the FFN's
        self.qkv = aligned_empty((n, (nh + 2 * nkv) * hd))
        # A product writes C-ordered [n, rows]: one row writes straight into its slices of qkv,
        # n rows into buffers of their own, copied into qkv's rows (one head a row per decode row)
        self.proj = None if n == 1 else [aligned_empty((n, w)) for w in (self.nq, self.nk, self.nk)]
        self.heads = [self.qkv[i].reshape(nh + 2 * nkv, hd) for i in range(n)]
        self.q = np.empty((n, nh, hd), F32)
        self.att = aligned_empty((n, nh * hd))
        self.q_rows = [self.q[i] for i in range(n)]  # the views each row's steps take
        self.q_one = [self.q[i:i + 1] for i in range(n)]
        self.att_one = [self.att[i:i + 1] for i in range(n)]
        self.o = np.empty((n, H), F32)
        self.y = np.empty((n, H), F32)
        M = (kernels._row or _row_kernels()).M
        self.scores = np.empty((M, 0), F32)  # attention's scratch, grown with the positions
        self.acc = np.empty((M, hd), F32)
        self.layers: dict[int, _Layer] = {}
        self._buffers: dict[tuple, np.ndarray] = {}

    def buffer(self, name: str, shape: tuple[int, ...], dtype=F32, aligned: bool = False) -> np.ndarray:
        """A buffer every layer's FFN step of this scratch shares (layers run one after another
        on a thread, each consuming its buffers before the next starts): one per name and shape,
        not one per layer (at 64 rows a MoE layer's would be ~17 MB, times the layers)."""
        key = (name, shape, np.dtype(dtype).str, aligned)
        b = self._buffers.get(key)
        if b is None:
            b = self._buffers[key] = aligned_empty(shape) if aligned else np.empty(shape, dtype)
        return b

    def qkv_products(self, w: AttentionWeights) -> list[tuple[QMatrix, np.ndarray, np.ndarray]]:
        nq, nk, qkv = self.nq, self.nk, self.qkv
        if self.proj is not None:
            return [(w.q, self.h, self.proj[0]), (w.k, self.h, self.proj[1]), (w.v, self.h, self.proj[2])]
        return [(w.q, self.h, qkv[:, :nq]), (w.k, self.h, qkv[:, nq:nq + nk]), (w.v, self.h, qkv[:, nq + nk:])]

    def gather_qkv(self) -> None:
        """Copy the n-row products' buffers into qkv's rows (nothing for one row)."""
        if self.proj is not None:
            nq, nk, qkv = self.nq, self.nk, self.qkv
            qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:] = self.proj


MAX_ROWS = quant.SMALL_T  # the most decode rows of one step here (the router's product takes them at once)
# Step sizes whose scratch (buffers and per-layer tables) a thread keeps: a batch's size changes
# as sequences come and go; more would hold memory for sizes no longer running.
KEPT_SCRATCHES = 4


class DecodeRunner:
    """Runs steps of decode rows — one-row calls of :meth:`Model.layers`, and steps of up to
    :data:`MAX_ROWS` sequences of one row each of :meth:`Model.layers_batch` — for a
    :func:`supported` model; thread-safe (scratch per thread)."""

    def __init__(self, model: Model):
        self.model = model
        self._local = threading.local()

    def _scratch(self, n: int = 1) -> _Scratch:
        local = self._local
        key = (threads.threads(), quant.GROUP_TILE_BYTES, quant.MAX_TILE_BYTES, quant.MIN_CHUNK_BYTES,
               kernels.MIN_ELEMENTWISE)
        if getattr(local, "key", None) != key:  # the tables' tiles and the steps' splits are sized for these
            local.scratch, local.key = {}, key
        s = local.scratch.pop(n, None)
        if s is None:
            s = _Scratch(self.model.config, n)
            if len(local.scratch) >= KEPT_SCRATCHES:  # the least recently used step size goes
                del local.scratch[next(iter(local.scratch))]
        local.scratch[n] = s  # most recently used last
        return s

    def _layer(self, s: _Scratch, layer: int) -> _Layer:
        m = self.model
        L = s.layers[layer] = _Layer(m.attention_weights(layer), s, m.config)  # type: ignore[arg-type]
        L.ffn = _ffn_step(m, layer, s)
        return L

    def layers(self, x: np.ndarray, cache: KVCache, start: int, lo: int, hi: int, ffn: FFNBackend) -> np.ndarray:
        """``Model.layers`` of one row x [1, H] f32 at position ``start`` (checked there):
        the rows after layer ``hi-1`` [1, H] f32."""
        return self.rows(x, [(cache, start)], lo, hi, ffn)

    def rows(self, x: np.ndarray, seqs: list[tuple[KVCache, int]], lo: int, hi: int, ffn: FFNBackend) -> np.ndarray:
        """``Model.layers_batch`` of n = len(seqs) ≤ :data:`MAX_ROWS` sequences of one row each:
        x [n, H] f32, row i at position ``seqs[i][1]`` of its own cache ``seqs[i][0]`` (checked
        there) → the rows after layer ``hi-1`` [n, H] f32, each with the bits of its sequence alone."""
        m, c = self.model, self.model.config
        n = len(seqs)
        s = self._scratch(n)
        row = kernels._row or _row_kernels()
        nh, nkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        items = nkv * -(-(nh // nkv) // row.M)  # attention's work items for one query row
        caches, starts = [cache for cache, _ in seqs], [start for _, start in seqs]
        tables, split_attention = [], []
        for cache, start in seqs:
            cache.reserve(start + 1)
            cos_qk, sin_qk = m._qk_tables(start, 1)
            tables.append((cos_qk[0], sin_qk[0]))
            split_attention.append(kernels.attention_shared(nh * (start + 1) * hd))
        if s.scores.shape[1] < max(starts) + 1:
            s.scores = np.empty((row.M, max(2 * s.scores.shape[1], max(starts) + 1, 256)), F32)
        own = m.plain_ffn(ffn)  # the model's own LocalFFN (or its like): the steps here compute what it would
        keeps = type(ffn) is not LocalFFN  # a backend that may keep the rows it is given
        segments = [1] * n if n > 1 else None
        x = np.array(x, dtype=F32, order="C")  # the residual stream is ours to update in place
        eps = F32(c.rms_norm_eps)
        y = None  # the last FFN output, added to x together with the next norm
        for layer in range(lo, hi):
            L = s.layers.get(layer) or self._layer(s, layer)
            w = L.w
            if y is None:
                row.rms_norm(x, L.attn_norm, eps, s.h)
            else:
                row.add_rms_norm(x, y, L.attn_norm, eps, s.h)
            if L.qkv is not None:
                run_table(*L.qkv)
            else:
                quant.matmul_many(s.qkv_products(w))
            s.gather_qkv()
            for i in range(n):  # each row at its own position, over its own cache
                cache, start = caches[i], starts[i]
                k, v = cache.k[layer], cache.v[layer]
                if k is None or v is None:
                    k, v = cache.layer(layer)
                cos, ssin = tables[i]
                row.qk_rope_row(s.heads[i], L.bias, L.qk_norm, eps, cos, ssin, s.q_rows[i], k, v, start)
                if split_attention[i]:
                    kernels.attention(s.q_one[i], k, v, start, s.att_one[i])
                else:
                    row.attention(s.q_one[i], k, v, start, s.att_one[i], s.scores, s.acc, 0, items)
            if L.o is not None:
                run_table(*L.o)
            else:
                w.o.matmul(s.att, s.o)
            if w.o_bias is not None:
                s.o += w.o_bias
            row.add_rms_norm(x, s.o, L.ffn_norm, eps, s.h2)
            if own and L.ffn is not None:
                y = L.ffn(m, s)
            else:
                h2 = s.h2.copy() if keeps else s.h2
                y = ffn.ffn(layer, h2) if segments is None else ffn.ffn(layer, h2, segments)
                assert y.dtype == F32 and y.shape == x.shape, (layer, y.dtype, y.shape)
        if y is not None:
            x += y
        return x


def _ffn_step(m: Model, layer: int, s: _Scratch) -> _MoE | _Dense | None:
    """The layer's FFN step on this scratch, for the model's own LocalFFN (no dense plan): what
    its ``ffn`` computes for one row; None where that takes a path not mirrored here (then
    ``LocalFFN.ffn`` itself runs)."""
    c = m.config
    if not m.is_moe_layer(layer):
        dense = _Dense(m.dense_weights(layer), s)
        return dense if dense.gu_table is not None and dense.down_table is not None else None
    rc = m.routing_config(layer)
    if rc.scoring != "softmax" or rc.selection_bias is not None or rc.n_group > 1 or c.expert_bias:
        return None
    experts = [m.expert_weights(layer, e) for e in range(c.n_experts)]
    w0 = experts[0]
    if (any(w.bias is not None or w.swiglu_limit for w in experts) or w0.gate.data.shape != w0.up.data.shape
            or w0.gate.cols != c.hidden_size
            or not alike([w.gate for w in experts] + [w.up for w in experts]) or not alike([w.down for w in experts])):
        return None
    return _MoE(m, layer, s, experts)
