"""Block GEMVs on 8-bit activations through wgpu, on the CPU's own int8 activation rows.

The block kernels (swiglu_blocks.wgsl, down_blocks.wgsl) decode each weight to f32 and spend one
FMA on it; at decode (T = 1) they are bound by that work, not by memory
(bench/results/web_peer_blocks.md). These kernels follow the int8 numerics instead
(swarm/compute/numerics.py, llama.cpp's): the activation row is quantized to int8 by the CPU's
own quantizer (:meth:`swarm.compute.quant.QMatrix.int8_rows`: per 256 values with one float32 dx
for Q4_K and Q6_K, ggml's Q8_K, plus dx·Σq per 32 values for Q4_K's minimums; per 32 for Q8_0),
and the GEMV multiplies packed bytes with ``dot4I8Packed`` (``gemv_x8.wgsl`` with the prelude
``x8_q4_k.wgsl``, ``x8_q6_k.wgsl`` or ``x8_q8_0.wgsl``). Both sides compute one exact sum in
float32 pieces: each block's integer (its weights' integers times the int8 values, exact on both)
times the same float32 product d·dx, less Q4_K's minimum terms (dmin·m)·(dx·Σq), the same on
both; the CPU cuts a block's integer into 16 lanes' parts, the GPU into its steps, and each adds
its pieces in its own order. So a GPU's answer lies within a bound of the CPU's int8 answer that
float32 summation alone gives (:func:`cpu_bound`), whatever the GPU or its shader compiler
(which may contract and reassociate): a coordinator of the int8 numerics can check it.

The weights are the block kernels' own planes (:func:`web_peer.kernels.pack_matrix`), so one
upload serves both.

    host = WgpuFfn()
    gemv = X8Gemv(host, rows_per_thread=2)           # a thread computes 2 weight rows
    m = host.upload_linear(raw_q4_k_rows, "q4_k")   # W [N, K]: the file's blocks
    y, rows = gemv.run(m, x)                        # x [T, K] float32 → y [T, N], and the int8 rows used
    bound = cpu_bound(m.matrix.packed, rows, host.lanes)   # |y - the CPU's int8 answer| ≤ bound
    seconds = gemv.time(m, reps=50)                 # one row's GEMV a rep
"""

from __future__ import annotations

import struct
import time
from importlib import resources

import numpy as np

from swarm.compute.quant import QT, QMatrix
from swarm.errors import KernelError

from . import kernels as K

X8_FORMATS = ("q4_k", "q6_k", "q8_0")  # weight formats with an int8-activation GEMV
_QTYPE = {"q4_k": QT.Q4_K, "q6_k": QT.Q6_K, "q8_0": QT.Q8_0}
_QK = {"q4_k": K.QK_K, "q6_k": K.QK_K, "q8_0": 32}  # activations per dx (the CPU's: Q8_K, Q8_0)
_STEPS = {"q4_k": 4, "q6_k": 8, "q8_0": 1}  # steps a weight block (x8_<fmt>.wgsl STEPS_PER_BLOCK)


def _files(fmt: str, subgroups: bool) -> tuple[str, ...]:
    _check_format(fmt)
    return (f"x8_{fmt}.wgsl", "rows.wgsl", "row_slices.wgsl",
            "sum_subgroup.wgsl" if subgroups else "sum_shared.wgsl", "gemv_x8.wgsl")


ROWS_PER_THREAD = (1, 2, 4, 8)  # weight rows a thread may compute (gemv_x8.wgsl RT)
# gemv_x8.wgsl's body for RT rows, written per row k: an accumulator, its share of each step (the
# step's activations loaded once for all rows), its sum and output
_ROW = "    var acc{k} = vec2<f32>(0.0);\n"
_STEP = """        if (r0 + {k}u < p.n_rows) {{
            acc{k} += row_step(r0 + {k}u, nb, s, sx);
        }}
"""
_OUT = """    let tot{k} = slice_sum(lid, acc{k});
    if (lane == 0u && r0 + {k}u < p.n_rows) {{
        y[t * p.n_out + p.row0 + r0 + {k}u] = tot{k}.x - tot{k}.y;
    }}
"""


def wgsl_source(fmt: str, subgroups: bool = False, rows_per_thread: int = 1) -> str:
    """The GEMV's WGSL for weight format ``fmt``: its prelude, rows.wgsl, row_slices.wgsl, the
    reduction, gemv_x8.wgsl (as kernels.wgsl_source composes the block kernels), its body written
    for ``rows_per_thread`` rows a thread (one of :data:`ROWS_PER_THREAD`, else KernelError)."""
    if rows_per_thread not in ROWS_PER_THREAD:
        raise KernelError(f"rows_per_thread must be one of {ROWS_PER_THREAD}, got {rows_per_thread}")
    rows = range(rows_per_thread)
    body = "".join(_ROW.format(k=k) for k in rows)
    body += "    for (var s = lane; s < ns; s += LANES) {\n        let sx = step_x(t, s);\n"
    body += "".join(_STEP.format(k=k) for k in rows) + "    }\n" + "".join(_OUT.format(k=k) for k in rows)
    files = resources.files(K.__package__)
    code = "\n".join((files / name).read_text() for name in _files(fmt, subgroups))
    if code.count("    //ROWS_BODY\n") != 1:
        raise KernelError("gemv_x8.wgsl must hold the line `    //ROWS_BODY` once: the host writes the body there")
    return f"const RT: u32 = {rows_per_thread}u;\n" + code.replace("    //ROWS_BODY\n", body)


# ---- the CPU's rows, its answer, and the bound between the two -----------------------------------

def _check_format(fmt: str) -> None:
    if fmt not in X8_FORMATS:
        raise KernelError(f"no int8-activation GEMV for {fmt!r}; expected one of {X8_FORMATS}")


def _qmatrix(fmt: str, blocks: np.ndarray, cols: int) -> QMatrix:
    return QMatrix(np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1)), _QTYPE[fmt], cols)


def int8_rows(fmt: str, x: np.ndarray) -> np.ndarray:
    """float32 ``x`` [T, K] → the CPU's int8 activation rows for weights of block format ``fmt``:
    uint8 [T, row bytes] (:meth:`swarm.compute.quant.QMatrix.int8_rows`). Raises KernelError for
    a format without an int8-activation GEMV or a row length without an int8 product (Q8_0: K a
    multiple of 64; Q4_K, Q6_K: of 256)."""
    _check_format(fmt)
    K._f32(x, "x", 2)
    weights, size = K.block_size(fmt)
    if x.shape[1] % weights:
        raise KernelError(f"{fmt} needs rows of a multiple of {weights} values, got {x.shape[1]}")
    try:
        return _qmatrix(fmt, np.zeros((1, x.shape[1] // weights * size), np.uint8), x.shape[1]).int8_rows(x)
    except ValueError as e:
        raise KernelError(f"int8 activations: {e}") from None


def planes(fmt: str, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The CPU's int8 rows uint8 [T, row bytes] of ``k`` values split as the kernel binds them:
    (q int8 [T, k], dx float32 [T, k / QK], Q4_K's dx·Σq float32 [T, k / 32] or None)."""
    qk = _QK[fmt]
    q = rows[:, :k].view(np.int8)
    f = rows[:, k:].view(np.float32)  # row bytes: a multiple of 64
    dx = f[:, :k // qk]
    return q, dx, (f[:, k // qk:k // qk + k // 32] if fmt == "q4_k" else None)


def cpu_product(m: K.PackedMatrix, rows: np.ndarray) -> np.ndarray:
    """The CPU's int8 answer for PackedMatrix ``m`` (a format of :data:`X8_FORMATS`) [R, K] on
    the int8 rows ``rows`` (:func:`int8_rows`): float64 [T, R] of the float32 bits
    ``QMatrix.matmul`` gives under the int8 numerics."""
    _check_format(m.fmt)
    w = _qmatrix(m.fmt, K.file_blocks(m)[:m.rows], m.cols)
    try:
        return w.matmul_int8_rows(rows).astype(np.float64)
    except ValueError as e:
        raise KernelError(f"int8 activations: {e}") from None


def _unit_weights(fmt: str, blocks: np.ndarray) -> np.ndarray:
    """|the integers a block's d scales| of file blocks uint8 [R, nb, size]: float64 [R, nb, QK]
    (Q8_0 |q|; Q4_K sc·q; Q6_K |sc·(q - 32)|): the blocks decoded with d = 1 (dmin = 0)."""
    r, nb, size = blocks.shape
    if fmt == "q8_0":
        return np.abs(blocks[..., 2:].view(np.int8).astype(np.float64))
    ones = blocks.reshape(r * nb, size).copy()
    at = 208 if fmt == "q6_k" else 0
    ones[:, at:at + 2] = np.array([1.0], "<f2").view(np.uint8)
    if fmt == "q4_k":
        ones[:, 2:4] = 0  # dmin
    return np.abs(K.dequantize_k(ones, fmt).astype(np.float64)).reshape(r, nb, K.QK_K)


def _unit_maxima(fmt: str, blocks: np.ndarray) -> tuple[np.ndarray, int]:
    """An upper bound of :func:`_unit_weights` per group of values sharing a sub-scale, read from
    the scales alone (no weight decoded): (float64 [R, nb, groups], values a group) — Q4_K sc·15
    per 32 values, Q6_K |sc|·32 per 16 (|q - 32| ≤ 32); Q8_0 its |q| (exact, already cheap)."""
    r, nb, _ = blocks.shape
    if fmt == "q8_0":
        return _unit_weights(fmt, blocks), 1
    if fmt == "q4_k":
        sc, _ = K._k_scale_min(blocks.reshape(r * nb, -1)[:, :16])
        return (sc.astype(np.float64) * 15).reshape(r, nb, 8), 32
    sc = blocks[..., 192:208].view(np.int8).astype(np.float64)  # Q6_K: 16 int8 scales
    return np.abs(sc) * 32, 16


_TINY = np.finfo(np.float32).tiny  # float32's smallest normal, 2⁻¹²⁶


def _subnormal(a: np.ndarray) -> np.ndarray:
    """Where float32 ``a`` is subnormal (a GPU may read or make it as 0)."""
    return (a != 0) & (np.abs(a) < _TINY)


def _magnitudes(fmt: str, blocks: np.ndarray, q: np.ndarray, dx: np.ndarray,
                xm: np.ndarray | None, coarse: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(M, M_sub), float64 [T, R] each, for file blocks [R, nb, size]: M = Σ_b |fl(d_b dx_b)| Σ |w'|·|q_x|
    over the block's values (w' = :func:`_unit_weights`), plus Q4_K's Σ_j |fl(dmin m_j)|·|dx Σq|_j;
    M_sub the part of M whose float32 factors (dx, d·dx; xm, dmin·m) are subnormal, which a GPU
    may flush to 0 (the f16 d and dmin themselves are decoded from their bits, exactly: they are
    normal float32). Taken value by value, M bounds the sum of |parts| of any cutting of the
    blocks' integers into parts (the CPU's lanes, the GPU's steps): it must stay per value, not
    per block or part. ``coarse``: each value's |w'| taken as its group's bound
    (:func:`_unit_maxima`), a larger M read from the scales alone, many times faster."""
    r, nb, _ = blocks.shape
    qk = _QK[fmt]
    at = 208 if fmt == "q6_k" else 0
    d = blocks[..., at:at + 2].copy().view("<f2")[..., 0].astype(np.float32)  # [R, nb]
    dxb = dx.reshape(-1, 1, nb)
    c32 = d[None] * dxb  # [T, R, nb]: the float32 products both sides take
    qa = np.abs(q.astype(np.float64)).reshape(-1, nb, qk)
    units, group = _unit_maxima(fmt, blocks) if coarse else (_unit_weights(fmt, blocks), 1)
    qa = qa.reshape(len(qa), nb, qk // group, group).sum(axis=-1)  # [T, nb, values or groups]
    # Σ over a block's values (or groups), block by block: a batched product (BLAS), [T, R, nb]
    ints = np.matmul(units.transpose(1, 0, 2), qa.transpose(1, 2, 0)).transpose(2, 1, 0)
    terms = np.abs(c32).astype(np.float64) * ints
    sub = _subnormal(c32) | _subnormal(dxb)
    total, total_sub = terms.sum(axis=-1), np.where(sub, terms, 0.0).sum(axis=-1)
    if fmt == "q4_k":
        _, mn = K._k_scale_min(blocks.reshape(r * nb, -1)[:, :16])
        dmin = blocks[..., 2:4].copy().view("<f2").astype(np.float32).reshape(r * nb, 1)
        mins = (dmin * mn).reshape(1, r, nb * 8)  # fl(dmin m_j)
        xmb = xm.reshape(-1, 1, nb * 8)
        terms = np.abs(mins).astype(np.float64) * np.abs(xmb.astype(np.float64))
        total += terms.sum(axis=-1)
        total_sub += np.where(_subnormal(mins) | _subnormal(xmb), terms, 0.0).sum(axis=-1)
    return total, total_sub


def cpu_bound(m: K.PackedMatrix, rows: np.ndarray, lanes: int, chunk: int = 256) -> np.ndarray:
    """A bound on |GPU - CPU| per output, float64 [T, R], for PackedMatrix ``m`` [R, K] on the
    CPU's int8 rows ``rows`` (:func:`int8_rows`) with ``lanes`` threads a row on the GPU.

    Both sides compute one exact sum S = Σ_b c_b·N_b - Σ_j μ_j·s_j (c_b = fl(d_b·dx_b), N_b the
    block's integer: its weights' integers times the int8 values, exact on both; μ_j = fl(dmin·m_j),
    s_j the row's dx·Σq: Q4_K's minimums), cutting each N_b into parts (the CPU: 16 lanes; the
    GPU: its steps) and adding the pieces c_b·part, each exact before its one rounding (a fused
    multiply-add's or a product's), in its own order. A sum whose every piece passes through at
    most D roundings lies within γ_D·Σ|pieces| of the exact sum, γ_D = D·u / (1 - D·u), u = 2⁻²⁴
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002, §3.1), and Σ|pieces| ≤ M of
    :func:`_magnitudes` on either side, so the answers lie within (γ_Dcpu + γ_Dgpu)·M of each other:
    D_cpu = nb + 8 (a lane's chain over the row's nb blocks, a 16-lane tree, the minimums' lanes
    and their sum: qkernels' int8 section), D_gpu = ⌈steps / lanes⌉ + log₂ lanes + 4 (a lane's
    chain, the slice's tree, the step's own sum and product, sums - mins). The γ bound assumes no
    underflow, which a GPU may flush to zero: pieces whose float32 factors are subnormal may be
    lost whole (M_sub is added: activations near 10⁻³⁸, never real ones), and each of the at most
    2·(24·nb + 64) additions of the two sides may lose 2⁻¹²⁶ (a sum below it flushed). The f16
    scales are decoded from their bits (rows.wgsl ``f16_pair``), so a subnormal f16 d, as most
    of a real file's Q6_K blocks have, is computed exactly. Rigorous, not probabilistic: no
    honest GPU lands outside it."""
    _check_format(m.fmt)
    return blocks_bound(m.fmt, K.file_blocks(m)[:m.rows], rows, lanes, chunk)


def blocks_bound(fmt: str, blocks: np.ndarray, rows: np.ndarray, lanes: int, chunk: int = 256,
                 coarse: bool = False) -> np.ndarray:
    """:func:`cpu_bound` for a matrix given as its file blocks uint8 [R, nb, block bytes] of block
    format ``fmt`` (a format of :data:`X8_FORMATS`, else KernelError): what a coordinator holding
    the file's own blocks computes, with no packing. ``lanes=1`` bounds every lane count (the
    most roundings a piece passes through on the GPU). ``coarse``: M from the sub-scales alone
    (:func:`_magnitudes`), a wider bound (about twice, measured) at a fraction of the cost."""
    _check_format(fmt)
    q, dx, xm = planes(fmt, rows, blocks.shape[1] * K.block_size(fmt)[0])
    nb = blocks.shape[1]
    d_cpu = nb + 8
    # lanes=1: the most roundings over every power-of-two lane count a workgroup may have (a
    # narrow row takes more through a wide slice's tree than through one lane's chain)
    d_gpu = max(-(-nb * _STEPS[fmt] // n) + int(np.log2(n)) + 4 for n in (2 ** k for k in range(11))) \
        if lanes == 1 else -(-nb * _STEPS[fmt] // lanes) + int(np.log2(lanes)) + 4
    gamma = lambda n: n * 2.0 ** -24 / (1 - n * 2.0 ** -24)  # noqa: E731
    parts = [_magnitudes(fmt, blocks[r0:r0 + chunk], q, dx, xm, coarse) for r0 in range(0, len(blocks), chunk)]
    total, sub = (np.concatenate([p[i] for p in parts], axis=1) for i in (0, 1))
    return total * (gamma(d_cpu) + gamma(d_gpu)) + sub + 2 * (24 * nb + 64) * 2.0 ** -126


# ---- host (wgpu) -----------------------------------------------------------------------------------

class X8Gemv:
    """The GEMV's pipelines on a :class:`web_peer.wgpu_host.WgpuFfn`'s device: ``run`` (the CPU
    quantizes x, the GPU multiplies), ``time`` (the GEMV alone, ``reps`` times in one submission)
    and ``time_f32`` (the f32-activation kernel, down_blocks.wgsl, on the same matrix). A slice of
    the host's lanes computes ``rows_per_thread`` adjacent weight rows (one of
    :data:`ROWS_PER_THREAD`; KernelError otherwise), reading each step's activations once for
    them: the same bits at any count."""

    def __init__(self, host, rows_per_thread: int = 1) -> None:
        if rows_per_thread not in ROWS_PER_THREAD:
            raise KernelError(f"rows_per_thread must be one of {ROWS_PER_THREAD}, got {rows_per_thread}")
        self.host = host
        self.rows_per_thread = rows_per_thread
        self._pipes: dict = {}

    def _pipe(self, fmt: str):
        if fmt not in self._pipes:
            dev = self.host._device()
            code = wgsl_source(fmt, self.host.subgroups, self.rows_per_thread)
            self._pipes[fmt] = dev.create_compute_pipeline(layout="auto", compute={
                "module": dev.create_shader_module(code=code), "entry_point": "main",
                "constants": {"WG": self.host.workgroup_size, "LANES": self.host.lanes}})
        return self._pipes[fmt]

    def upload(self, fmt: str, rows: np.ndarray, k: int) -> list:
        """The CPU's int8 rows (:func:`int8_rows`) of ``k`` values as the kernel's storage buffers."""
        h = self.host
        return [h.storage(a.size // 4, np.ascontiguousarray(a).view(np.float32))
                for a in planes(fmt, rows, k) if a is not None]

    def encode_gemv(self, enc, w, xs: list, y, t_rows: int) -> None:
        """y[t, :] = W x8[t] for the GpuLinear ``w`` on the buffers ``xs`` (:meth:`upload`), one
        dispatch per part."""
        pipe = self._pipe(w.fmt)
        rows_per_group = self.host.workgroup_size // self.host.lanes * self.rows_per_thread
        mat = w.matrix
        for i, (r0, r1) in enumerate(mat.packed.parts):
            gx, gy, _ = K.dispatch_grid(r1 - r0, 1, rows_per_group)
            params = struct.pack("<6I", t_rows, mat.packed.cols // 4, r1 - r0, r0, w.rows, gx)
            buffers = [xs[0], xs[1], mat.buffers[i], mat.scales[i], y, *xs[2:]]
            enc.dispatch(pipe, self.host._bind(pipe, params, buffers), (gx, gy, t_rows))

    def rows_per_block(self, products) -> int:
        """Activation rows one submission of :meth:`run_rows` takes: every binding (a row's int8
        values, its largest plane; the outputs of all ``products``, read back into one buffer)
        within the host's ``max_binding``, and the rows within a dispatch's z dimension. As
        WgpuFfn.matmul_many cuts its rows; a row's outputs are computed alone, so the cut changes
        no bit."""
        widest = max(max(w.cols for w, _ in products), sum(4 * w.rows for w, _ in products))
        return max(1, min(self.host.max_binding // widest, K.MAX_WORKGROUPS_PER_DIM))

    def run_rows(self, products) -> list[np.ndarray]:
        """``[W x8 for W, x8 in products]``: each GpuLinear W [R, K] (a format of
        :data:`X8_FORMATS`) times int8 rows uint8 [T, row bytes] (:func:`int8_rows`, quantized
        elsewhere: a peer's own, or another machine's) → float32 [T, R], in one submission per
        block of :meth:`rows_per_block` rows. Raises KernelError on a GPU error (the device is
        then reset), weights on a lost device, or a non-finite result."""
        h = self.host
        if any(w.device is not h.device for w, _ in products):
            raise KernelError("these weights were on a device that was lost")
        for w, _ in products:
            _check_format(w.fmt)
        if not products:
            return []
        block = self.rows_per_block(products)
        longest = max(len(rows) for _, rows in products)
        parts = [self._run_block([(w, rows[t:t + block]) for w, rows in products]) for t in range(0, longest, block)]
        return [np.concatenate([p[i] for p in parts]) if parts else np.zeros((0, w.rows), np.float32)
                for i, (w, _) in enumerate(products)]

    def _run_block(self, products) -> list[np.ndarray]:
        """:meth:`run_rows` on rows that fit its bindings, in one submission and one read-back."""
        h = self.host
        with h._guarded("the int8 GEMVs"):
            enc, outs = h.encoder(), []
            for w, rows in products:
                y = h.storage(max(len(rows), 1) * w.rows)
                if len(rows):
                    self.encode_gemv(enc, w, self.upload(w.fmt, rows, w.cols), y, len(rows))
                outs.append((y, len(rows) * w.rows))
        return [y.reshape(len(rows), w.rows) for (w, rows), y in zip(products, h.submit_read_many(enc, outs))]

    def run(self, w, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x float32 [T, K] → (y float32 [T, R], the CPU's int8 rows of x it multiplied), as
        :meth:`run_rows`."""
        _check_format(w.fmt)
        K._f32(x, "x", 2)
        if x.shape[1] != w.cols:
            raise KernelError(f"x has {x.shape[1]} columns; these weights expect {w.cols}")
        rows = int8_rows(w.fmt, x)
        return self.run_rows([(w, rows)])[0], rows

    def time(self, w, reps: int) -> float:
        """Seconds per decode GEMV (one row of ones·0.5, quantized once before) on the GPU."""
        h = self.host
        xs = self.upload(w.fmt, int8_rows(w.fmt, np.full((1, w.cols), 0.5, np.float32)), w.cols)
        y = h.storage(w.rows)
        return _timed(h, lambda enc: self.encode_gemv(enc, w, xs, y, 1), y, reps)

    def time_f32(self, w, reps: int) -> float:
        """Seconds per decode GEMV of the existing kernel (down_blocks.wgsl, f32 activations) on ``w``."""
        h = self.host
        xb, y = h.storage(w.cols, np.full((1, w.cols), 0.5, np.float32)), h.storage(w.rows)
        return _timed(h, lambda enc: h.encode_linear(enc, xb, w, y, 1, w.rows), y, reps)


def _timed(h, encode, y, reps: int) -> float:
    """Wall seconds per rep of ``reps`` encodings in one submission, until the queue drains (a
    4-byte read-back), after one warm-up; as WgpuFfn.time_kernel."""
    def run(n):
        enc = h.encoder()
        for _ in range(n):
            encode(enc)
        buf = enc.finish()
        t0 = time.perf_counter()
        h.device.queue.submit([buf])
        h.device.queue.read_buffer(y, 0, 4)
        return time.perf_counter() - t0
    run(1)
    return run(reps) / reps
