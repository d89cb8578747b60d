"""Numpy twins of the browser peer's WGSL kernels, and the weight layout both sides share.

Theory of operation. A peer computes SwiGLU feed-forward blocks (Shazeer 2020, "GLU Variants
Improve Transformer"; the Llama/Mixtral/OLMoE MLP) for the coordinator:

    h = silu(x @ W_gate.T) * (x @ W_up.T)      # [T, F]   swiglu.wgsl
    y = h @ W_down.T                           # [T, H]   down.wgsl

An **expert FFN** is that block for one expert over the batch of rows routed to it; a **dense
range** is the same block over a contiguous slice r of a dense MLP's intermediate dimension
(W_gate[r], W_up[r], W_down[:, r]); the coordinator sums range partials in range order. The two
WGSL files are the kernels; ``weights_{f32,f16,q8}.wgsl`` are preludes that give the weight format.
The functions here compute exactly what the kernels compute (float32, same formulas) so the GPU
results can be checked against them, and them against float64.

Weight formats (one name used by Python, JS and the wire):
- ``f32``: float32, 4 bytes per weight.
- ``f16``: IEEE float16, 2 bytes; needs the adapter feature ``shader-f16``; sums stay in f32.
- ``q8``: int8 per row with one float32 scale per row (``w = q * scale``), ~1 byte per weight:
  4x what f32 holds in the same memory. Quantization: scale = max|row| / 127, q = round(w / scale).

Layout rules. Every weight matrix is row-major ``[rows, K]`` with K padded to a multiple of 4 with
zeros (a WGSL ``vec4``/packed ``u32`` holds 4 weights). A matrix is cut into **parts** of whole rows
so no GPU buffer binding exceeds the adapter's ``maxStorageBufferBindingSize`` (128 MiB on many
phones); each part is one dispatch writing its own output columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np

from swarm.errors import KernelError

FORMATS = ("f32", "f16", "q8")
KERNELS = ("swiglu", "down")
TB = 8  # activation rows per workgroup; must equal `const TB` in swiglu.wgsl and down.wgsl
MAX_WORKGROUPS_PER_DIM = 65535  # WebGPU default maxComputeWorkgroupsPerDimension


def _f32(a: np.ndarray, name: str, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim:
        raise KernelError(f"{name} must be a float32 array with {ndim} dims, got "
                          f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    return a


def silu(v: np.ndarray) -> np.ndarray:
    """SiLU(v) = v * sigmoid(v) = v / (1 + exp(-v)), in v's dtype (the WGSL form)."""
    with np.errstate(over="ignore"):
        return v / (v.dtype.type(1) + np.exp(-v))


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray) -> np.ndarray:
    """Twin of swiglu.wgsl: h = silu(x @ w_gate.T) * (x @ w_up.T).

    x [T, K] float32, w_gate and w_up [F, K] float32 (dequantized if stored compactly).
    Returns h [T, F] float32. Raises KernelError on other shapes or dtypes.
    """
    for name, a in (("x", x), ("w_gate", w_gate), ("w_up", w_up)):
        _f32(a, name, 2)
    if w_gate.shape != w_up.shape or w_gate.shape[1] != x.shape[1]:
        raise KernelError(f"swiglu shapes disagree: x {x.shape}, w_gate {w_gate.shape}, w_up {w_up.shape}")
    return silu(x @ w_gate.T) * (x @ w_up.T)  # [T, F]


def down(h: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Twin of down.wgsl: y = h @ w_down.T. h [T, F], w_down [H, F] float32 → y [T, H] float32."""
    _f32(h, "h", 2)
    _f32(w_down, "w_down", 2)
    if w_down.shape[1] != h.shape[1]:
        raise KernelError(f"down shapes disagree: h {h.shape}, w_down {w_down.shape}")
    return h @ w_down.T  # [T, H]


def expert_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """One SwiGLU expert over a batch of rows: x [T, H] → [T, H] float32.

    w_gate, w_up [F, H]; w_down [H, F]. A dense range is the same call with W_gate[r], W_up[r],
    W_down[:, r]; its output is that range's partial sum of the full MLP.
    """
    return down(swiglu(x, w_gate, w_up), w_down)


dense_range = expert_ffn


def expert_ffn_f64(x, w_gate, w_up, w_down) -> np.ndarray:
    """The float64 reference of :func:`expert_ffn` (inputs upcast), for checking the twin itself."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    g = x @ w_gate.T
    return ((g / (1.0 + np.exp(-g))) * (x @ w_up.T)) @ w_down.T


# ---- compact formats -------------------------------------------------------------------------

def quantize_q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8: w [N, K] float32 → (q [N, K] int8, scale [N] float32).

    scale = max|w[n]| / 127 (1 for an all-zero row), q = clip(round(w / scale), -127, 127).
    """
    _f32(w, "w", 2)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_q8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_q8`: q [N, K] int8, scale [N] float32 → [N, K] float32."""
    return q.astype(np.float32) * scale[:, None]


def as_format(w: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 weights a kernel of format `fmt` effectively multiplies by (its twin's view)."""
    if fmt == "f32":
        return w
    if fmt == "f16":
        return w.astype(np.float16).astype(np.float32)
    if fmt == "q8":
        return dequantize_q8(*quantize_q8(w))
    raise KernelError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


def bytes_per_weight(fmt: str) -> int:
    """Storage bytes per weight of `fmt` (the q8 per-row scale is counted separately)."""
    try:
        return {"f32": 4, "f16": 2, "q8": 1}[fmt]
    except KeyError:
        raise KernelError(f"unknown weight format {fmt!r}; expected one of {FORMATS}") from None


def pad4(n: int) -> int:
    """n rounded up to a multiple of 4 (vec4 / packed-u32 granularity)."""
    return (n + 3) // 4 * 4


def pad_matrix(w: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """w [N, K] zero-padded to [rows, cols] (rows ≥ N, cols ≥ K), dtype kept."""
    out = np.zeros((rows, cols), dtype=w.dtype)
    out[: w.shape[0], : w.shape[1]] = w
    return out


@dataclass(frozen=True)
class PackedMatrix:
    """A weight matrix in a kernel's layout: rows [N, K4] of WVec words, split into parts.

    data: the packed bytes of all rows (f32/f16 little-endian floats, q8 int8 bytes).
    scale: float32 [N] per-row scales for q8, None otherwise.
    parts: (first_row, end_row) per GPU binding, each at most the binding limit.
    """

    fmt: str
    rows: int
    cols: int  # K padded to a multiple of 4
    data: bytes
    scale: np.ndarray | None
    parts: tuple[tuple[int, int], ...]

    @property
    def row_bytes(self) -> int:
        return self.cols * bytes_per_weight(self.fmt)

    def part_bytes(self, part: int) -> bytes:
        r0, r1 = self.parts[part]
        return self.data[r0 * self.row_bytes : r1 * self.row_bytes]


def split_rows(rows: int, row_bytes: int, max_binding: int) -> tuple[tuple[int, int], ...]:
    """Cut `rows` rows of `row_bytes` bytes into parts of at most `max_binding` bytes each.

    Also keeps each part within MAX_WORKGROUPS_PER_DIM**2 rows (the dispatch grid). Raises
    KernelError when one row alone exceeds the limit (the adapter cannot hold this matrix).
    """
    if row_bytes > max_binding:
        raise KernelError(f"one weight row is {row_bytes} bytes, above this adapter's "
                          f"maxStorageBufferBindingSize of {max_binding} bytes; this peer cannot serve it")
    per = max(1, min(max_binding // row_bytes, MAX_WORKGROUPS_PER_DIM ** 2))
    return tuple((r, min(r + per, rows)) for r in range(0, rows, per))


def pack_matrix(w: np.ndarray, fmt: str, max_binding: int, rows: int | None = None) -> PackedMatrix:
    """Pack float32 w [N, K] as `fmt`, zero-padded to [rows or N, pad4(K)], in parts ≤ max_binding."""
    _f32(w, "w", 2)
    rows = w.shape[0] if rows is None else rows
    wp = pad_matrix(w, rows, pad4(w.shape[1]))
    scale = None
    if fmt == "f32":
        data = wp.astype("<f4").tobytes()
    elif fmt == "f16":
        data = wp.astype("<f2").tobytes()
    elif fmt == "q8":
        q, scale = quantize_q8(wp)
        data = q.tobytes()
    else:
        raise KernelError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
    parts = split_rows(rows, wp.shape[1] * bytes_per_weight(fmt), max_binding)
    return PackedMatrix(fmt, rows, wp.shape[1], data, scale, parts)


def unpack_matrix(m: PackedMatrix) -> np.ndarray:
    """The float32 [rows, cols] a kernel reads from a PackedMatrix (for twins and tests)."""
    if m.fmt == "f32":
        return np.frombuffer(m.data, "<f4").reshape(m.rows, m.cols).astype(np.float32)
    if m.fmt == "f16":
        return np.frombuffer(m.data, "<f2").reshape(m.rows, m.cols).astype(np.float32)
    q = np.frombuffer(m.data, np.int8).reshape(m.rows, m.cols)
    return dequantize_q8(q, m.scale)


def dispatch_grid(n_rows: int, t_rows: int) -> tuple[int, int, int]:
    """Workgroup counts (x, y, z) for one part: x*y ≥ n_rows weight rows, z = blocks of TB rows."""
    tile_x = min(n_rows, MAX_WORKGROUPS_PER_DIM)
    return tile_x, -(-n_rows // tile_x), -(-t_rows // TB)


# ---- WGSL sources ----------------------------------------------------------------------------

def wgsl_source(kernel: str, fmt: str) -> str:
    """The WGSL a host compiles: the weight prelude ``weights_<fmt>.wgsl`` then ``<kernel>.wgsl``.

    The page (gpu.js) assembles the same two files the same way: one source of truth.
    """
    if kernel not in KERNELS:
        raise KernelError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    bytes_per_weight(fmt)
    files = resources.files(__package__)
    return (files / f"weights_{fmt}.wgsl").read_text() + "\n" + (files / f"{kernel}.wgsl").read_text()
