"""A measured candidate, not used by the page or the peers: block GEMVs on 8-bit activations.

The block kernels (swiglu_blocks.wgsl, down_blocks.wgsl) decode each weight to f32 and spend one
FMA on it; at decode (T = 1) they are bound by that work, not by memory
(bench/results/web_peer_blocks.md). The candidate follows llama.cpp's numerics for 8-bit
activations (ggml's Q8_1): each activation row is quantized per 32 values to int8 with an f32
scale dx and the block's s = dx * sum(q) (``quantize_x8.wgsl``, twin :func:`quantize_x8`), and
the GEMV multiplies packed bytes with ``dot4I8Packed`` (``gemv_x8.wgsl`` with the prelude
``x8_q4_k.wgsl`` or ``x8_q8_0.wgsl``, twin :func:`gemv_x8`). Over the 32-weight sub-blocks j of
a Q4_K row, y = sum ((d * sc_j) * dx_j) * i_j - sum (dmin * m_j) * s_j, i_j the exact integer sum
of nibble times int8, the two sums kept apart and subtracted once a row (as llama.cpp's sum_d and
sum_m); Q8_0: y = sum (d * dx_j) * i_j. The weights are the block kernels' own planes
(:func:`web_peer.kernels.pack_matrix`), so one upload serves both.

The twins compute the integer sums exactly (int64) and every float32 operation in the kernels'
order: each lane's running sum over its steps, then row_slices' tree over the lanes (lane 0 of
sum_subgroup.wgsl's butterfly adds in the same order). A shader compiler may still contract a
multiply and an add into one FMA or reassociate additions (WGSL allows both), so a GPU's answer
is checked against its twin within a bound (:func:`twin_bound`), not for equal bits.

    host = WgpuFfn()
    gemv = X8Gemv(host, rows_per_thread=2)           # a thread computes 2 weight rows
    m = host.upload_linear(raw_q4_k_rows, "q4_k")   # W [N, K]: the file's blocks
    y, xq, xs = gemv.run(m, x)                      # x [T, K] float32 → y [T, N], and the GPU's int8 x
    seconds = gemv.time(m, reps=50)                 # one row: quantize + GEMV a rep
"""

from __future__ import annotations

import struct
import time
from importlib import resources

import numpy as np

from swarm.errors import KernelError

from . import kernels as K

X8_FORMATS = ("q4_k", "q8_0")  # weight formats with an int8-activation GEMV
QX = 32  # activations per int8 block (one dx, one s)
_STEPS = {"q4_k": 4, "q8_0": 1}  # steps a weight block (x8_<fmt>.wgsl STEPS_PER_BLOCK)


def _files(fmt: str, subgroups: bool) -> tuple[str, ...]:
    if fmt not in X8_FORMATS:
        raise KernelError(f"no int8-activation GEMV for {fmt!r}; expected one of {X8_FORMATS}")
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


def quantize_source() -> str:
    """The activation quantization's WGSL (quantize_x8.wgsl: no prelude)."""
    return (resources.files(K.__package__) / "quantize_x8.wgsl").read_text()


# ---- twins ---------------------------------------------------------------------------------------

def quantize_x8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Twin of quantize_x8.wgsl: x float32 [T, K] (K a multiple of 32) → (q int8 [T, K], xs
    float32 [T, K / 32, 2] of (dx, s)): dx = amax / 127, q = clamp(round(x / dx), ±127) (ties to
    even, as WGSL's round), s = dx * sum(q); an all-zero block has dx = s = 0, q = 0."""
    K._f32(x, "x", 2)
    t, k = x.shape
    if k % QX:
        raise KernelError(f"int8 activations need rows of a multiple of {QX} values, got {k}")
    b = x.reshape(t, k // QX, QX)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    dx = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax > 0, np.clip(np.rint(b / dx), -127, 127), np.float32(0)).astype(np.int8)
    s = dx[..., 0] * q.astype(np.int64).sum(axis=-1).astype(np.float32)
    return q.reshape(t, k), np.stack([dx[..., 0], s], axis=-1).astype(np.float32)


def _steps_q4_k(blocks: np.ndarray, xq: np.ndarray, xs: np.ndarray, magnitude: bool = False) -> np.ndarray:
    """float32 [2, T, R, nb * 4]: step() of x8_q4_k.wgsl (scaled sums, min terms) for rows of
    file blocks uint8 [R, nb, 144]; with ``magnitude``, of every factor's magnitude instead
    (the sums of |terms| that :func:`twin_bound` takes)."""
    r, nb, _ = blocks.shape
    t = xq.shape[0]
    flat = blocks.reshape(r * nb, -1)
    sc, mn = (a.reshape(r, nb, 8) for a in K._k_scale_min(flat[:, :16]))
    f16 = lambda at: flat[:, at:at + 2].copy().view("<f2").astype(np.float32).reshape(r, nb, 1)  # noqa: E731
    d, dmin = f16(0), f16(2)
    if magnitude:
        d, dmin, xq, xs = np.abs(d), np.abs(dmin), np.abs(xq.astype(np.int16)), np.abs(xs)
    qs = flat[:, 16:].reshape(r, nb, 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15).reshape(r, nb * 8, 32)  # sub-block 2j + nibble
    isum = np.einsum("rgl,tgl->trg", q.astype(np.int64), xq.reshape(t, nb * 8, 32).astype(np.int64))
    dx, s = xs[..., 0][:, None, :], xs[..., 1][:, None, :]  # [T, 1, nb * 8]
    a = ((d * sc).reshape(1, r, nb * 8) * dx) * isum.astype(np.float32)  # ((d * sc) * dx) * i, i exact: |i| < 2^16
    m = (dmin * mn).reshape(1, r, nb * 8) * s
    return np.stack([a[..., 0::2] + a[..., 1::2], m[..., 0::2] + m[..., 1::2]])


def _steps_q8_0(blocks: np.ndarray, xq: np.ndarray, xs: np.ndarray, magnitude: bool = False) -> np.ndarray:
    """float32 [2, T, R, nb]: step() of x8_q8_0.wgsl for rows of file blocks uint8 [R, nb, 34]
    (``magnitude``: as :func:`_steps_q4_k`)."""
    r, nb, _ = blocks.shape
    d = blocks[..., :2].copy().view("<f2").astype(np.float32).reshape(1, r, nb)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.int64)  # [R, nb, 32]
    if magnitude:
        d, q, xq, xs = np.abs(d), np.abs(q), np.abs(xq.astype(np.int16)), np.abs(xs)
    isum = np.einsum("rbl,tbl->trb", q, xq.reshape(xq.shape[0], nb, 32).astype(np.int64)).astype(np.float32)
    a = (d * xs[..., 0][:, None, :]) * isum
    return np.stack([a, np.zeros_like(a)])


def gemv_x8(m: K.PackedMatrix, xq: np.ndarray, xs: np.ndarray, lanes: int, chunk: int = 512) -> np.ndarray:
    """Twin of gemv_x8.wgsl with ``lanes`` threads a row: m a Q4_K or Q8_0 PackedMatrix [R, K],
    xq int8 [T, K], xs float32 [T, K / 32, 2] (:func:`quantize_x8`, or the GPU's) → y float32
    [T, R]. Lane l adds steps l, l + lanes, ... in order to a float32 pair (scaled sums, min
    terms) starting at 0; the lanes' pairs are added as row_slices' tree (lane i += lane i + o,
    o = lanes / 2 .. 1); y = sums - mins."""
    if m.fmt not in X8_FORMATS:
        raise KernelError(f"no int8-activation GEMV for {m.fmt!r}; expected one of {X8_FORMATS}")
    if xq.shape[1] != m.cols or xs.shape[1] != m.cols // QX:
        raise KernelError(f"activations of {xq.shape[1]} columns for a matrix of {m.cols}")
    blocks = K.file_blocks(m)
    steps_of = _steps_q4_k if m.fmt == "q4_k" else _steps_q8_0
    out = []
    for r0 in range(0, m.rows, chunk):  # rows at a time: the int64 sums of a whole matrix are large
        steps = steps_of(blocks[r0:r0 + chunk], xq, xs)  # [2, T, R', ns]
        ns = steps.shape[-1]
        acc = np.zeros((*steps.shape[:3], lanes), np.float32)
        for k in range(0, ns, lanes):
            n = min(lanes, ns - k)  # lanes past the row's steps add nothing
            acc[..., :n] = acc[..., :n] + steps[..., k:k + n]
        o = lanes // 2
        while o:
            acc[..., :o] = acc[..., :o] + acc[..., o:2 * o]
            o //= 2
        out.append(acc[0, ..., 0] - acc[1, ..., 0])
    return np.concatenate(out, axis=1).astype(np.float32)


def twin_bound(m: K.PackedMatrix, xq: np.ndarray, xs: np.ndarray, lanes: int) -> np.ndarray:
    """A bound on |GPU - twin| per output [T, R] for a shader compiler that contracts a multiply
    and an add into an FMA or reassociates additions (WGSL allows both; lavapipe's compiler was
    seen to reassociate ``(a + b) - c``): each side's sum of n terms in any order of depth D is
    within D * 2^-24 * sum |terms| of the exact sum, so the two are within 2 D 2^-24 sum |terms|,
    D = the steps of a lane + log2(lanes) + 4 (the products and the pair inside a step)."""
    steps_of = _steps_q4_k if m.fmt == "q4_k" else _steps_q8_0
    blocks = K.file_blocks(m)
    depth = -(-blocks.shape[1] * _STEPS[m.fmt] // lanes) + int(np.log2(lanes)) + 4
    out = [steps_of(blocks[r0:r0 + 512], xq, xs, magnitude=True).astype(np.float64).sum(axis=(0, -1))
           for r0 in range(0, m.rows, 512)]
    return np.concatenate(out, axis=1) * (2 * depth * 2.0 ** -24)


# ---- host (wgpu) -----------------------------------------------------------------------------------

class X8Gemv:
    """The candidate's pipelines on a :class:`web_peer.wgpu_host.WgpuFfn`'s device, for benchmarks
    and tests: ``run`` (quantize x on the GPU, then the GEMV), ``time`` (both, or the GEMV alone,
    ``reps`` times in one submission) and ``time_f32`` (the existing f32-activation kernel,
    down_blocks.wgsl, on the same matrix and rows). A slice of the host's lanes computes
    ``rows_per_thread`` adjacent weight rows (one of :data:`ROWS_PER_THREAD`; KernelError
    otherwise), reading each step's activations once for them: the same bits at any count."""

    def __init__(self, host, rows_per_thread: int = 1) -> None:
        if rows_per_thread not in ROWS_PER_THREAD:
            raise KernelError(f"rows_per_thread must be one of {ROWS_PER_THREAD}, got {rows_per_thread}")
        self.host = host
        self.rows_per_thread = rows_per_thread
        self._pipes: dict = {}

    def _pipe(self, name: str):
        if name not in self._pipes:
            dev = self.host._device()
            code = quantize_source() if name == "quantize" else wgsl_source(name, self.host.subgroups, self.rows_per_thread)
            constants = {"WG": self.host.workgroup_size}
            if name != "quantize":
                constants["LANES"] = self.host.lanes
            self._pipes[name] = dev.create_compute_pipeline(layout="auto", compute={
                "module": dev.create_shader_module(code=code), "entry_point": "main", "constants": constants})
        return self._pipes[name]

    def _bind(self, pipe, params: bytes, buffers: list):
        return self.host._bind(pipe, params, buffers)

    def buffers(self, t_rows: int, k: int, x: np.ndarray | None = None):
        """(x, xq, xs) storage buffers for ``t_rows`` rows of ``k`` activations (x holding ``x``)."""
        h = self.host
        xb = h.storage(t_rows * k, x)
        return xb, h.storage(t_rows * k // 4), h.storage(t_rows * k // QX * 2)

    def encode_quantize(self, enc, xb, xq, xs, n_blocks: int) -> None:
        wgs = -(-n_blocks // self.host.workgroup_size)
        gx = max(1, min(wgs, K.MAX_WORKGROUPS_PER_DIM))
        gy = -(-wgs // gx)
        pipe = self._pipe("quantize")
        params = struct.pack("<4I", n_blocks, gx * self.host.workgroup_size, 0, 0)
        enc.dispatch(pipe, self._bind(pipe, params, [xb, xq, xs]), (gx, gy, 1))

    def encode_gemv(self, enc, w, xq, xs, y, t_rows: int) -> None:
        """y[t, :] = W x8[t] for the GpuLinear ``w`` (q4_k or q8_0), one dispatch per part."""
        pipe = self._pipe(w.fmt)
        rows_per_group = self.host.workgroup_size // self.host.lanes * self.rows_per_thread
        mat = w.matrix
        for i, (r0, r1) in enumerate(mat.packed.parts):
            gx, gy, _ = K.dispatch_grid(r1 - r0, 1, rows_per_group)
            params = struct.pack("<6I", t_rows, mat.packed.cols // 4, r1 - r0, r0, w.rows, gx)
            enc.dispatch(pipe, self._bind(pipe, params, [xq, xs, mat.buffers[i], mat.scales[i], y]), (gx, gy, t_rows))

    def run(self, w, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x float32 [T, K] → (y float32 [T, R], the GPU's q int8 [T, K], its xs float32 [T, K / 32, 2])."""
        if w.fmt not in X8_FORMATS:
            raise KernelError(f"no int8-activation GEMV for {w.fmt!r}; expected one of {X8_FORMATS}")
        K._f32(x, "x", 2)
        t, k = x.shape
        if k != w.cols:
            raise KernelError(f"x has {k} columns; these weights expect {w.cols}")
        h = self.host
        xb, xq, xs = self.buffers(t, k, x)
        y = h.storage(t * w.rows)
        enc = h.encoder()
        self.encode_quantize(enc, xb, xq, xs, t * k // QX)
        self.encode_gemv(enc, w, xq, xs, y, t)
        yv = h.submit_read(enc, y, t * w.rows)
        q = np.frombuffer(h.device.queue.read_buffer(xq, 0, t * k), np.int8).reshape(t, k).copy()
        s = np.frombuffer(h.device.queue.read_buffer(xs, 0, 8 * t * k // QX), np.float32).reshape(t, k // QX, 2).copy()
        return yv.reshape(t, w.rows), q, s

    def time(self, w, reps: int, quantize: bool = True) -> float:
        """Seconds per decode GEMV (one row of ones·0.5) on the GPU, with its activation
        quantization (``quantize``) or without (the int8 row made once before)."""
        h = self.host
        xb, xq, xs = self.buffers(1, w.cols, np.full((1, w.cols), 0.5, np.float32))
        y = h.storage(w.rows)
        enc = h.encoder()
        self.encode_quantize(enc, xb, xq, xs, w.cols // QX)
        h.submit_read(enc)

        def encode(enc):
            if quantize:
                self.encode_quantize(enc, xb, xq, xs, w.cols // QX)
            self.encode_gemv(enc, w, xq, xs, y, 1)
        return _timed(h, encode, y, reps)

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
