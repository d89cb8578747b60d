"""A measured candidate, not used by the page or the peers: Q4_K decode GEMVs in steps.

The block kernels (down_blocks.wgsl) decode each weight of a 16-byte unit to f32 and multiply it
by x; at decode they reach 27 % of an H100's copy bandwidth (bench/results/web_peer_blocks.md).
The candidate (``steps_q4_k.wgsl``) keeps float32 activations and reads the weights as the int8
candidate does (``gemv_x8.wgsl``): a step is two 32-weight sub-blocks, the sums of nibble times
x per sub-block (the nibble exactly as a float), then the sub-block scales once:
y = sum (d * sc_j) * i_j - sum (dmin * m_j) * sx_j, sx_j the sum of x over sub-block j. A thread
computes ``rows_per_thread`` weight rows from one load of the step's x.

    host = WgpuFfn()
    gemv = StepsQ4K(host, rows_per_thread=2)
    m = host.upload_linear(raw_q4_k_rows, "q4_k")   # W [N, K]: the file's blocks
    y = gemv.run(m, x)                              # x [T, K] float32 → y [T, N]
    seconds = gemv.time(m, reps=50)                 # one row a rep
"""

from __future__ import annotations

import struct
from importlib import resources

import numpy as np

from swarm.errors import KernelError

from . import kernels as K
from .int8_activations import _timed

_ROW = """    var acc{k} = vec2<f32>(0.0);
"""
_STEP = """        if (r0 + {k}u < p.n_rows) {{
            acc{k} += row_step(r0 + {k}u, nb, s, sx);
        }}
"""
_OUT = """    let tot{k} = slice_sum(lid, acc{k});
    if (lane == 0u && r0 + {k}u < p.n_rows) {{
        y[t * p.n_out + p.row0 + r0 + {k}u] = tot{k}.x - tot{k}.y;
    }}
"""


def wgsl_source(rows_per_thread: int, subgroups: bool = False, int8: bool = False) -> str:
    """rows.wgsl, row_slices.wgsl and its reduction, then steps_q4_k.wgsl (``int8``: after
    x8_q4_k.wgsl, steps_x8_q4_k.wgsl) with its body written for ``rows_per_thread`` rows (one
    accumulator each: no arrays)."""
    if rows_per_thread not in (1, 2, 4, 8):
        raise KernelError(f"rows_per_thread must be 1, 2, 4 or 8, got {rows_per_thread}")
    files = resources.files(K.__package__)
    reduce = "sum_subgroup.wgsl" if subgroups else "sum_shared.wgsl"
    body = "".join(_ROW.format(k=k) for k in range(rows_per_thread))
    body += "    for (var s = lane; s < ns; s += LANES) {\n        let sx = step_x(t, s);\n"
    body += "".join(_STEP.format(k=k) for k in range(rows_per_thread)) + "    }\n"
    body += "".join(_OUT.format(k=k) for k in range(rows_per_thread))
    kernel = (files / ("steps_x8_q4_k.wgsl" if int8 else "steps_q4_k.wgsl")).read_text().replace("    //ROWS_BODY\n", body)
    head = "\n".join((files / n).read_text() for n in ("x8_q4_k.wgsl",) * int8 + ("rows.wgsl", "row_slices.wgsl", reduce))
    return f"const RT: u32 = {rows_per_thread}u;\n{head}\n{kernel}"


class StepsQ4K:
    """The candidate's pipeline on a :class:`web_peer.wgpu_host.WgpuFfn`'s device: ``run`` and
    ``time`` on a q4_k :class:`~web_peer.wgpu_host.GpuLinear`, and ``time_f32`` (the block
    kernel, down_blocks.wgsl, on the same matrix and rows)."""

    def __init__(self, host, rows_per_thread: int = 1, int8: bool = False) -> None:
        self.host = host
        self.rows_per_thread = rows_per_thread
        self.int8 = int8  # the int8-activation form: x given as int8_activations' (xq, xs)
        self._pipe = None

    def pipeline(self):
        if self._pipe is None:
            dev = self.host._device()
            code = wgsl_source(self.rows_per_thread, self.host.subgroups, self.int8)
            self._pipe = dev.create_compute_pipeline(layout="auto", compute={
                "module": dev.create_shader_module(code=code), "entry_point": "main",
                "constants": {"WG": self.host.workgroup_size, "LANES": self.host.lanes}})
        return self._pipe

    def encode(self, enc, w, xb, y, t_rows: int) -> None:
        """y[t, :] = W x[t] for the q4_k GpuLinear ``w``, one dispatch per part; ``xb`` a buffer of
        x, or with ``int8`` the pair (xq, xs) of int8_activations.X8Gemv.buffers."""
        if w.fmt != "q4_k":
            raise KernelError(f"the step GEMV reads q4_k weights, got {w.fmt!r}")
        pipe = self.pipeline()
        rows_per_group = self.host.workgroup_size // self.host.lanes * self.rows_per_thread
        mat = w.matrix
        for i, (r0, r1) in enumerate(mat.packed.parts):
            gx, gy, _ = K.dispatch_grid(r1 - r0, 1, rows_per_group)
            params = struct.pack("<6I", t_rows, mat.packed.cols // 4, r1 - r0, r0, w.rows, gx)
            xin = list(xb) if self.int8 else [xb]
            enc.dispatch(pipe, self.host._bind(pipe, params, [*xin, mat.buffers[i], mat.scales[i], y]),
                         (gx, gy, t_rows))

    def run(self, w, x: np.ndarray) -> np.ndarray:
        """x float32 [T, K] → y float32 [T, R]."""
        K._f32(x, "x", 2)
        t, k = x.shape
        if k != w.cols:
            raise KernelError(f"x has {k} columns; these weights expect {w.cols}")
        h = self.host
        xb, y = h.storage(t * k, x), h.storage(t * w.rows)
        enc = h.encoder()
        xin = self._quantized(enc, xb, t, k) if self.int8 else xb
        self.encode(enc, w, xin, y, t)
        return h.submit_read(enc, y, t * w.rows).reshape(t, w.rows)

    def time(self, w, reps: int) -> float:
        """Seconds per decode GEMV (one row of 0.5s)."""
        h = self.host
        xb, y = h.storage(w.cols, np.full((1, w.cols), 0.5, np.float32)), h.storage(w.rows)
        xin = xb
        if self.int8:  # quantized once, before the timed GEMVs (as X8Gemv.time(quantize=False))
            enc = h.encoder()
            xin = self._quantized(enc, xb, 1, w.cols)
            h.submit_read(enc)
        return _timed(h, lambda enc: self.encode(enc, w, xin, y, 1), y, reps)

    def _quantized(self, enc, xb, t: int, k: int) -> tuple:
        """(xq, xs) buffers of x's rows quantized on the GPU by quantize_x8.wgsl, encoded into ``enc``."""
        from .int8_activations import QX, X8Gemv

        x8 = X8Gemv(self.host)
        _, xq, xs = x8.buffers(t, k)
        x8.encode_quantize(enc, xb, xq, xs, t * k // QX)
        return xq, xs
