"""Numerical kernels of the forward pass: functions on float32 arrays (numpy, and compiled passes).

Shape legend: T tokens in this call, S cached positions (keys), H hidden size, F
intermediate size, E experts, nh / nkv query / key-value heads, hd head dim.
Weight matrices are compact :class:`~swarm.compute.quant.QMatrix` (``x @ W.T`` by
``W.matmul(x)``). Every function keeps float32: constants are ``np.float32`` so NumPy 2's promotion rules
never widen an intermediate to float64 (RMSNorm's sum of squares aside: float64 by design, see
:func:`rms_norm`). Formulas follow transformers' modeling code.

A row's result depends only on the row: every function here (and every ``QMatrix.matmul``)
computes an output row from its input row — for :func:`attention`, from its query, its position
and the cache up to it — by one fixed sequence of float32 operations, never by a library kernel
chosen by the row count. So a row gets the same bits alone, resent with others, in any prefill
chunk, beside other sequences' rows, or at any thread count (rows, heads and elements are
spread over the process's compute threads by swarm/compute/threads.py, or attention's and
RMSNorm's items over its spinning workers, swarm/compute/spin.py: never a reduction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from swarm.compute import threads
from swarm.compute import quant as quant_module
from swarm.compute.quant import (QMatrix, _address, _kernels, aligned_empty, alike, as_qmatrix, compiling,
                                 matmul_many, run_alike)

if TYPE_CHECKING:
    from swarm.compute.spin import SpinPool

F32 = np.float32
# Smallest share of an element-wise pass (elements) and of attention (query rows × positions ×
# head dim) handed to another thread: below them, handing it over costs more than it saves.
MIN_ELEMENTWISE = 1 << 16
MIN_ATTENTION_WORK = 1 << 18
# Attention's work (query rows × heads × positions × head dim) from which its items go to the
# spinning workers: handing one out is an atomic add, so a decode row's attention at a short
# context (Qwen3-30B-A3B's 32 heads over 100 positions: 8 items of ~5 µs), which the Python
# pool's threshold above leaves to the calling thread while the others wait, is shared too.
SPIN_ATTENTION_WORK = 1 << 14
# An RMSNorm item on the spinning workers (elements: ~5 µs on one core): handing one out costs
# an atomic add, so a norm too small for two Python-pool parts still spreads over the threads.
SPIN_NORM_ITEM = 1 << 13


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``w * x / sqrt(mean(x²) + eps)`` (LlamaRMSNorm).

    x [..., D] f32; weight f32 of x's trailing shape ([D], or [n, D] for x [T, n, D]). Returns a
    new [..., D] f32 array. Compiled, one pass per row (swarm/compute/rowkernels.py): the mean
    square is summed in eight float64 lanes (element i into lane i % 8, a tail past the last
    multiple of 8 into lane 0, the lanes added pairwise) and rounded once to float32, the rest is
    float32 as transformers computes it; each row's bits do not depend on the other rows. Raises ValueError on other dtypes/shapes."""
    if x.dtype != F32 or weight.dtype != F32 or weight.shape != x.shape[x.ndim - weight.ndim:]:
        raise ValueError(f"rms_norm needs float32 x [..., D] and a float32 weight of its trailing shape, "
                         f"got x {x.dtype} {x.shape}, weight {weight.dtype} {weight.shape}")
    D = x.shape[-1]
    out = aligned_empty(x.shape)  # the next product's activation rows
    row = _row or _row_kernels()
    kernel = row.rms_norm
    # the spinning workers read the weight row by row: another layout is copied (a row-ordered one is not)
    xs, ws, outs = x.reshape(-1, D), np.ascontiguousarray(weight.reshape(-1, D)), out.reshape(-1, D)
    R, Rw = xs.shape[0], ws.shape[0]
    per = max(1, SPIN_NORM_ITEM // max(1, D))  # rows of a spinning workers' item
    if (R > per and xs.flags.c_contiguous
            and (workers := quant_module.spin_workers()) is not None
            and _run_rows(workers, [row.RMS_NORM, _address(xs), R, D, _address(ws), Rw, _address(outs),
                                    int(F32(eps).view(np.int32)), per], -(-R // per))):
        return out
    parts = threads.parts_for(R * D, MIN_ELEMENTWISE)
    if parts == 1:
        kernel(xs, ws, F32(eps), outs)
    else:  # ranges of whole weight periods (row r takes weight row r % Rw), one per thread
        threads.run_chunks(lambda lo, hi: kernel(xs[lo:hi], ws, F32(eps), outs[lo:hi]), threads.split(R, parts, Rw))
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``, float32 in and out."""
    return x / (F32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1.0) / (F32(1.0) + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float32 along ``axis``."""
    # the ufuncs' reduce is what np.max / np.sum call, without their Python wrappers
    e = np.exp(x - np.maximum.reduce(x, axis=axis, keepdims=True))
    return e / np.add.reduce(e, axis=axis, keepdims=True, dtype=F32)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """RoPE inverse frequencies [hd/2] f32, computed in float32 as transformers does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)
    return (F32(1.0) / np.power(F32(theta), exponents)).astype(F32)


def llama3_inv_freq(inv_freq: np.ndarray, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: float) -> np.ndarray:
    """Llama 3's long-context rescaling of RoPE frequencies [hd/2] f32
    (transformers ``_compute_llama3_parameters``): long wavelengths divided by ``factor``,
    short ones kept, the band between interpolated smoothly."""
    old_ctx = original_max_position_embeddings
    low_wavelen, high_wavelen = old_ctx / low_freq_factor, old_ctx / high_freq_factor
    wavelen = F32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / F32(factor), inv_freq).astype(F32)
    smooth = ((F32(old_ctx) / wavelen - F32(low_freq_factor))
              / F32(high_freq_factor - low_freq_factor)).astype(F32)
    smoothed = (F32(1) - smooth) * scaled / F32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` [T, hd] f32 for integer ``positions`` [T] (rotate-half layout: halves repeat)."""
    freqs = positions.astype(F32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(F32), np.sin(emb).astype(F32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` [T, n, hd] by position (transformers' ``rotate_half`` convention)."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def signed_sin(sin: np.ndarray) -> np.ndarray:
    """``sin`` [..., hd] with its first half negated, for :func:`apply_rope_swapped`."""
    half = sin.shape[-1] // 2
    return np.concatenate([-sin[..., :half], sin[..., half:]], axis=-1)


def apply_rope_swapped(x: np.ndarray, cos: np.ndarray, ssin: np.ndarray) -> np.ndarray:
    """:func:`apply_rope` with tables already broadcast to x's shape and ``ssin = signed_sin(sin)``:
    ``rotate_half(x) * sin == swap_halves(x) * ssin`` exactly. x float32 [T, n, hd] with tables
    float32 [T, n or 1, hd]: one compiled pass (``rowkernels.rope_rows``), rows spread over the
    compute threads; other shapes: numpy. Either way ``x * cos`` and ``swapped * ssin`` rounded,
    then added: the same bits. Returns a new array of x's shape."""
    half = x.shape[-1] // 2
    if (x.ndim == 3 and x.dtype == F32 and cos.dtype == F32 and ssin.dtype == F32 and cos.shape == ssin.shape
            and cos.ndim == 3 and cos.shape[0] == x.shape[0] and cos.shape[2] == x.shape[2]
            and cos.shape[1] in (1, x.shape[1]) and half * 2 == x.shape[2]):
        out = aligned_empty(x.shape)
        kernel = (_row or _row_kernels()).rope_rows
        parts = threads.parts_for(x.size, MIN_ELEMENTWISE)
        if parts == 1:
            kernel(x, cos, ssin, out)
        else:
            threads.run_chunks(lambda lo, hi: kernel(x[lo:hi], cos[lo:hi], ssin[lo:hi], out[lo:hi]),
                               threads.split(x.shape[0], parts))
        return out
    out = x * cos
    out += np.concatenate([x[..., half:], x[..., :half]], axis=-1) * ssin
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, out: np.ndarray | None = None) -> np.ndarray:
    """Causal grouped-query attention of T new queries against the cached keys and values.

    q [T, nh, hd] f32, **already multiplied by 1/sqrt(hd)**, query t at position ``start + t``;
    k, v [nkv, C, hd] f32 (a KV cache: positions ``0 .. start+T-1`` filled, the new keys
    included, C ≥ start + T). Query t sees positions ``0 .. start+t``; query head h uses
    key/value head ``h // (nh / nkv)`` (transformers' ``repeat_kv``); softmax with the row's max
    subtracted, normalised after the weighted sum of values. Returns [T, nh*hd] f32.

    Compiled (swarm/compute/rowkernels.py): each query row in one fixed order of float32
    operations, rows sharing a key/value head taken four at a time so that each key and value
    load feeds four of them, every row still performing exactly the operations it performs
    alone: a row's result depends only on that query, its position and the cache up to it,
    never on T or the other rows (a matrix-product library gives no such promise: its kernels
    change with the row count). ``out``: float32 [T, nh*hd] C-contiguous to write the result
    into, or None. Raises ValueError on other shapes or dtypes."""
    check_attention_shapes(q, k, v, start)
    T, nh, hd = q.shape
    nkv = k.shape[0]
    if out is None:
        out = aligned_empty((T, nh * hd))  # the output projection's activation rows
    elif out.shape != (T, nh * hd) or out.dtype != F32 or not out.flags.c_contiguous:  # written unchecked
        raise ValueError(f"attention: out must be float32 [{T}, {nh * hd}] C-contiguous, got {out.dtype} {out.shape}")
    row = _row or _row_kernels()
    q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
    items = nkv * -(-T * (nh // nkv) // row.M)  # (key/value head, block of M query rows)

    def part(i0: int, i1: int) -> None:  # scratch of its own: parts run on several threads
        row.attention(q, k, v, start, out, np.empty((row.M, start + T), F32), np.empty((row.M, hd), F32), i0, i1)

    work = T * nh * (start + T) * hd
    if items > 1 and work >= SPIN_ATTENTION_WORK and (workers := quant_module.spin_workers()) is not None and _run_rows(
            workers, [row.ATTENTION, _address(q), T, nh, hd, _address(k), _address(v), nkv, k.shape[1], start,
                      _address(out)], items):
        pass  # items taken one at a time from a counter: later query rows' larger items even out
    elif items == 1 or (parts := threads.parts_for(work, MIN_ATTENTION_WORK)) == 1:
        part(0, items)
    else:  # later query rows see more positions: more parts than threads even out their sizes
        threads.run_chunks(part, threads.split(items, parts if T == 1 else 4 * parts))
    return out


def attention_shared(work: int) -> bool:
    """Whether :func:`attention` of ``work`` (T × nh × (start + T) × hd) hands items to other
    threads (the spinning workers, or the Python pool) rather than computing them all on the
    calling thread. The block kernels must be loaded."""
    if work >= SPIN_ATTENTION_WORK and quant_module.spin_workers() is not None:
        return True
    return threads.parts_for(work, MIN_ATTENTION_WORK) > 1


def _run_rows(workers: "SpinPool", fields: list[int], items: int) -> bool:
    """Run ``items`` items of the row work ``fields`` (``rowkernels.row_work``'s table: the
    addresses of arrays the caller keeps alive) on the calling thread and the spinning
    ``workers`` (``quant.spin_workers()``): True once done; False, having done nothing, when
    another caller holds them (the caller then takes the Python pool)."""
    table = np.zeros((_row or _row_kernels()).ROW_WORK_FIELDS, np.int64)
    table[:len(fields)] = fields
    return workers.run_rows(table, np.zeros(2, np.int64), items) is not None


def check_attention_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> None:
    """Raise ValueError unless q [T, nh, hd] and k, v [nkv, C, hd] are float32, nh is a multiple
    of nkv and positions ``start .. start+T-1`` fit the cache."""
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.dtype != F32 or k.dtype != F32 or v.dtype != F32:
        raise ValueError(f"attention needs float32 q [T, nh, hd] and k, v [nkv, C, hd], got q {q.dtype} "
                         f"{q.shape}, k {k.dtype} {k.shape}, v {v.dtype} {v.shape}")
    T, nh, hd = q.shape
    nkv, C, _ = k.shape
    if k.shape[2] != hd or nh % nkv or not 0 <= start <= C - T:
        raise ValueError(f"attention: q [T={T}, nh={nh}, hd={hd}] at position {start} does not fit "
                         f"k, v [nkv={nkv}, C={C}, hd={k.shape[2]}] (nh a multiple of nkv, start + T <= C)")


@dataclass(frozen=True)
class MLPWeights:
    """One SwiGLU MLP (a dense MLP, a slice of one, an expert, or a shared expert), compact.

    ``gate``, ``up`` [F, H] and ``down`` [H, F] are :class:`~swarm.compute.quant.QMatrix` in
    PyTorch orientation, in the file's encoding (views of the mapped file where they come from
    one). Construct from float32 arrays with :meth:`from_torch`.

    gpt-oss's experts: ``bias`` = (gate [F], up [F], down [H]) f32 added after each product,
    and ``swiglu_limit`` > 0 selects its clamped SwiGLU (:func:`swiglu`) with ``swiglu_alpha``.
    """

    gate: QMatrix
    up: QMatrix
    down: QMatrix
    bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    @classmethod
    def from_torch(cls, gate, up, down) -> "MLPWeights":
        """From ``gate``/``up`` [F, H] and ``down`` [H, F]: QMatrix, or float32 arrays (wrapped as F32)."""
        return cls(as_qmatrix(gate), as_qmatrix(up), as_qmatrix(down))

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded weights."""
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def range(self, lo: int, hi: int) -> "MLPWeights":
        """Intermediate units ``lo:hi``: rows of W_gate/W_up (views) and columns of W_down (see
        :meth:`QMatrix.columns`: in the file's encoding when ``lo``/``hi`` fall on block bounds)."""
        F = self.intermediate_size
        if not 0 <= lo < hi <= F:
            raise ValueError(f"dense range {lo}:{hi} is outside 0:{F}")
        if self.bias is not None or self.swiglu_limit:
            raise ValueError("an MLP with biases or a clamped SwiGLU (gpt-oss) is not cut into ranges")
        return MLPWeights(self.gate.rows(lo, hi), self.up.rows(lo, hi), self.down.columns(lo, hi))


def swiglu(w: MLPWeights, x: np.ndarray) -> np.ndarray:
    """``W_down (silu(W_gate x) * W_up x)`` for rows x [n, H] f32 → [n, H] f32.

    With ``w.swiglu_limit`` > 0 (gpt-oss, transformers ``GptOssExperts``): ``g = W_gate x + b_g``
    clamped above at the limit, ``u = W_up x + b_u`` clamped to ±limit, then
    ``W_down ((u + 1) * g * sigmoid(alpha * g)) + b_d``. Every step is element-wise on a row."""
    return swiglu_many([w], [x])[0]


def swiglu_many(ws: Sequence[MLPWeights], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``[swiglu(w, x) for w, x in zip(ws, xs)]`` (each x float32 [n_i, H] → [n_i, H] f32), the
    bits of each, with the products of all of them handed to the compute threads together
    (:func:`~swarm.compute.quant.matmul_many`): every gate and up product at once, then every
    down product — so a decode step's experts, each too small to split well, share all the
    threads."""
    n = len(ws)
    if n > 1 and one_row_alike(ws, xs):
        ys = swiglu_one_row(ws, xs[0])
        return [ys[i:i + 1] for i in range(n)]
    if n > 1 and all(w.bias is None and not w.swiglu_limit for w in ws):
        # Gate and up products written into two flat buffers, so the activation (element-wise)
        # is one call for all of them: a decode step's experts, ~3 µs each called one by one.
        sizes = [x.shape[0] * w.gate.shape[0] for w, x in zip(ws, xs)]
        ends = np.cumsum(sizes).tolist()
        g_all, u_all = np.empty(ends[-1], F32), np.empty(ends[-1], F32)
        gs = [g_all[e - k:e].reshape(x.shape[0], -1) for e, k, x in zip(ends, sizes, xs)]
        us = [u_all[e - k:e].reshape(x.shape[0], -1) for e, k, x in zip(ends, sizes, xs)]
        matmul_many([(w.gate, x, g) for w, x, g in zip(ws, xs, gs)] + [(w.up, x, u) for w, x, u in zip(ws, xs, us)])
        silu_mul(g_all.reshape(1, -1), u_all.reshape(1, -1))
        hs = gs
    else:
        gu = matmul_many([(w.gate, x, None) for w, x in zip(ws, xs)] + [(w.up, x, None) for w, x in zip(ws, xs)])
        hs = [_activation(w, g, u) for w, g, u in zip(ws, gu[:n], gu[n:])]  # [n_i, F] each
    ys = matmul_many([(w.down, h, None) for w, h in zip(ws, hs)])  # [n_i, H] each
    for w, y in zip(ws, ys):
        if w.bias is not None:
            y += w.bias[2]
    return ys


def one_row_alike(ws: Sequence[MLPWeights], xs: Sequence[np.ndarray]) -> bool:
    """A decode step's experts: one row x [1, H] float32 (C-order, writable) for all, plain SwiGLU
    blocks whose gate, up and down matrices each share an encoding and shape."""
    x = xs[0]
    return (x.shape[0] == 1 and x.dtype == F32 and x.flags.c_contiguous and x.flags.writeable
            and all(xi is x for xi in xs) and all(w.bias is None and not w.swiglu_limit for w in ws)
            and ws[0].gate.data.shape == ws[0].up.data.shape and ws[0].gate.cols == x.shape[1]
            and alike([w.gate for w in ws] + [w.up for w in ws]) and alike([w.down for w in ws]))


def swiglu_one_row(ws: Sequence[MLPWeights], x: np.ndarray) -> np.ndarray:
    """:func:`swiglu_many` for :func:`one_row_alike`'s case: the gate and up products as one
    group whose table is built with array operations (:func:`~swarm.compute.quant.run_alike`),
    one activation, the down products as another group. Returns [n, H] f32, row i expert i's
    output, the bits of :func:`swiglu` on it alone."""
    n, F, H = len(ws), ws[0].gate.shape[0], ws[0].down.shape[0]
    gu = np.empty((2 * n, F), F32)  # gate rows, then up rows
    address = quant_module._pointer
    run_alike([w.gate for w in ws] + [w.up for w in ws], address(x), 0, address(gu), 4 * F, 1)
    silu_mul(gu[:n].reshape(1, -1), gu[n:].reshape(1, -1))
    ys = np.empty((n, H), F32)
    run_alike([w.down for w in ws], address(gu), 4 * F, address(ys), 4 * H, 1)
    return ys


def _activation(w: MLPWeights, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SwiGLU's element-wise step on the gate and up products g, u [n, F] f32 (g may be reused)."""
    if w.bias is not None:
        g += w.bias[0]
        u += w.bias[1]
    if not w.swiglu_limit:
        return silu_mul(g, u)
    limit = F32(w.swiglu_limit)
    np.minimum(g, limit, out=g)
    np.clip(u, -limit, limit, out=u)
    return np.ascontiguousarray((u + F32(1.0)) * (g * sigmoid(g * F32(w.swiglu_alpha))), dtype=F32)


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``g <- silu(g) * u = g / (1 + exp(-g)) * u`` in place and returned; g, u float32 [n, F]
    C-contiguous (as :meth:`QMatrix.matmul` returns them). numpy's float32 exp, then one
    compiled pass for the rest: the bits of the numpy expression, in three calls instead of five."""
    kernel = (_row or _row_kernels()).silu_mul

    def part(lo: int, hi: int) -> None:  # elements lo:hi of the flattened arrays, as [1, hi-lo]
        gp, up = g.reshape(1, -1)[:, lo:hi], u.reshape(1, -1)[:, lo:hi]
        e = np.negative(gp)
        np.exp(e, out=e)
        kernel(gp, up, e)

    parts = threads.parts_for(g.size, MIN_ELEMENTWISE)
    if parts == 1:
        part(0, g.size)
    else:
        threads.run_chunks(part, threads.split(g.size, parts, 64))
    return g


_row = None


def prepare_row_kernels() -> None:
    """Load (or, the first time on a machine, compile) the element-wise kernels and the block
    kernels of the numerics in use now (an install step that wants the int8 numerics' in the
    cache too calls ``quant.prepare_int8()``: a float32 process never holds them)."""
    _row_kernels()


def _row_kernels():
    """The compiled element-wise kernels (swarm/compute/rowkernels.py), loaded on first use
    after the block kernels, which set numba's cache directory."""
    if _row is None:
        _kernels()
        with compiling("row kernels (norms, SwiGLU, attention)"):
            _load_row_kernels()
    return _row


def _load_row_kernels() -> None:
    global _row
    if _row is None:
        from swarm.compute import rowkernels
        one = np.ones((1, 1), F32)
        rowkernels.silu_mul(one.copy(), one, one)  # compile or load from the cache now
        rowkernels.weighted_sum(np.zeros(1, F32), one, np.ones(1, F32))
        rowkernels.rms_norm(one, one, F32(1e-6), one.copy())
        rowkernels.add_rms_norm(one.copy(), one, one, F32(1e-6), one.copy())
        two = np.ones((2, 2), F32)  # one query head, one key/value head of 2 dims
        none = np.zeros((0, 2), F32)
        cache = np.zeros((1, 1, 2), F32)
        rowkernels.qk_rope_row(np.ones((3, 2), F32), none, two, F32(1e-6), two, two, np.empty((1, 2), F32),
                               cache, cache.copy(), 0)
        logits = np.ones(2, F32)
        rowkernels.shift_max(logits)
        rows, strided = np.ones((2, 2, 2), F32), np.ones((2, 2, 4), F32)[:, :, :2]  # C-ordered or views
        for x in (rows, strided):
            for table in (rows, strided):
                rowkernels.rope_rows(x, table, table, rows.copy())  # (a prefill's q/k: views)
        rowkernels.route_row(logits, True, 1, True, F32(1.0), np.zeros((2, 1), np.int64), np.zeros((2, 1), F32))
        rowkernels.attention(np.ones((1, 1, 1), F32), np.ones((1, 4, 1), F32), np.ones((1, 4, 1), F32), 0,
                             one.copy(), np.ones((rowkernels.M, 4), F32), np.ones((rowkernels.M, 1), F32), 0, 1)
        from swarm.compute import spin  # the caller's side of row work on the spinning workers
        work = np.zeros(rowkernels.ROW_WORK_FIELDS, np.int64)
        work[rowkernels.OP] = rowkernels.RMS_NORM  # no items: nothing is read
        spin.run_rows(spin.control_block(), 1, work, np.zeros(2, np.int64), 0)
        _row = rowkernels
