"""Numpy twins of the browser peer's WGSL kernels, and the weight layout both sides share.

Theory of operation. A peer computes SwiGLU feed-forward blocks (Shazeer 2020, "GLU Variants
Improve Transformer"; the Llama/Mixtral/OLMoE MLP) for the coordinator:

    h = silu(x @ W_gate.T) * (x @ W_up.T)      # [T, F]   swiglu.wgsl
    y = h @ W_down.T                           # [T, H]   down.wgsl

An **expert FFN** is that block for one expert over the batch of rows routed to it; a **dense
range** is the same block over a contiguous slice r of a dense MLP's intermediate dimension
(W_gate[r], W_up[r], W_down[:, r]); the coordinator sums range partials in range order. The two
WGSL files are the kernels; ``weights_{f32,f16,q8}.wgsl`` are preludes that give the weight format.
The GGUF block formats use ``swiglu_blocks.wgsl`` / ``down_blocks.wgsl`` with preludes
``weights_{q4_0,q4_1,q8_0,q4_k,q5_k,q6_k,iq4_xs}.wgsl`` (same bindings, per-block scales; a
workgroup computes ROWS weight rows of LANES threads each, ``row_slices.wgsl``).
The functions here compute exactly what the kernels compute (float32, same formulas) so the GPU
results can be checked against them, and them against float64.

A GPU stage peer (swarm/peer/worker/gpu.py) runs the rest of a layer too, with kernels of no
weight format (:data:`LAYER_KERNELS`): ``rmsnorm.wgsl``, ``rope.wgsl`` (on the engine's tables),
``attention.wgsl`` (causal, grouped-query, over a KV cache), ``kv_write.wgsl`` (new keys and values
into that cache, both in one dispatch) and ``add.wgsl`` (a bias, or the residual where a product
does not add it itself: the down kernels' ``ACCUMULATE`` constant); their twins are
:func:`rms_norm`, :func:`rope`, :func:`attention`, :func:`kv_write` (once for the keys, once for
the values) and :func:`add`. Only the native host (``wgpu_host.py``) runs
them: the page serves ranges, not stages, so no JS module owns them yet.

Weight formats (one name used by Python, JS and the wire):
- ``f32``: float32, 4 bytes per weight.
- ``f16``: IEEE float16, 2 bytes, read as u32 words and decoded exactly (``f16_pair``), on any
  adapter (no ``shader-f16``); sums stay in f32.
- ``q8``: int8 per row with one float32 scale per row (``w = q * scale``), ~1 byte per weight:
  4x what f32 holds in the same memory. Quantization: scale = max|row| / 127, q = round(w / scale).
- ``q4_0``, ``q4_1``, ``q8_0``: the GGUF files' own 32-weight blocks (llama.cpp's block_q4_0,
  block_q4_1, block_q8_0), dequantized inside the kernel, sums in f32:
  q4_0 w = d * (q - 8) (18 bytes a block), q4_1 w = d * q + m (20), q8_0 w = d * q (34);
  d and m are f16, q 4-bit unsigned nibbles or int8. 4.5 to 8.5 bits per weight: 3.8-7x what f32
  holds in the same memory.
- ``q4_k``, ``q5_k``, ``q6_k``: the K-quant super-blocks of 256 weights (block_q4_K, block_q5_K,
  block_q6_K; 144, 176 and 210 bytes: 4.5, 5.5 and 6.56 bits per weight), dequantized inside the
  kernel exactly as gguf-py's ``dequantize``: q4_k/q5_k w = (d * sc) * q - dmin * m with 6-bit
  sc, m per 32 weights; q6_k w = (d * sc) * (q - 32) with int8 sc per 16 weights.
- ``iq4_xs``: block_iq4_xs, 256 weights in 136 bytes (4.25 bits per weight): w = (d * (ls - 32)) *
  kv[q], q a 4-bit index into IQ4_NL's 16 int8 levels, ls a 6-bit scale per 32 weights. Its
  8-byte head (d, scales_h, scales_l) goes to the scale plane, qs to the quant plane.

Block layout on the GPU. WGSL reads storage as u32 words, and 18- and 34-byte blocks sit at
2-byte offsets every other block. Rather than assemble every quant word from two loads and
shifts, a matrix is repacked once on arrival into two planes with the file's bytes, in order:
``data``, the quant bytes of every block (4 words a block for q4_*, byte j holding weight j in
its low nibble and weight j + 16 in its high one, as in the file; 8 words for q8_0), and
``scale``, the f16 scales (q4_0/q8_0: d per block; q4_1: d, m per block), read with
rows.wgsl's f16_pair (exact for subnormal f16 too). The K-quants split the same way: q4_k/q5_k
keep their 16-byte head (d, dmin, 12 bytes of 6-bit scales) in the scale plane and qs (q5_k:
qh, qs) in the quant plane; q6_k keeps ql, qh and its int8 scales (208 bytes) as quant and its
trailing f16 d as scale. Same bytes as
the file (a part whose block count is odd pads 2 bytes), and each plane is aligned, so every word
is one load.

Layout rules. Every weight matrix is row-major ``[rows, K]`` with K padded to a multiple of 4 with
zeros (a WGSL ``vec4``/packed ``u32`` holds 4 weights); block formats need K a multiple of their
block (32 weights; 256 for the K-quants). A matrix is cut into **parts** of whole rows
so no GPU buffer binding exceeds the adapter's ``maxStorageBufferBindingSize`` (128 MiB on many
phones); each part is one dispatch writing its own output columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL
from gguf.quants import quantize as gguf_quantize

from swarm.errors import KernelError

BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs")  # GGUF types the kernels read in their own blocks
K_FORMATS = ("q4_k", "q5_k", "q6_k", "iq4_xs")  # super-blocks of 256 weights; gguf-py has no quantizer for them
FORMATS = ("f32", "f16", "q8") + BLOCK_FORMATS
QK = 32  # weights per block of q4_0, q4_1, q8_0
QK_K = 256  # weights per K-quant super-block
# block format → the byte range [a, b) of a file block that goes to the scale plane (the rest, in
# order, is the quant plane; module docstring)
_SCALE_BYTES = {"q4_0": (0, 2), "q4_1": (0, 4), "q8_0": (0, 2), "q4_k": (0, 16), "q5_k": (0, 16), "q6_k": (208, 210),
                "iq4_xs": (0, 8)}
KERNELS = ("swiglu", "down")
TB = 8  # activation rows per workgroup; must equal `const TB` in rows.wgsl
DECODE_TB = 1  # TB of the kernels a one-row (decode) dispatch runs: no loop over absent rows
_TB_LINE = "const TB: u32 = {}u;"  # how rows.wgsl declares TB (wgsl_source sets it)
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


def swiglu_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """One SwiGLU expert over a batch of rows: x [T, H] → [T, H] float32.

    w_gate, w_up [F, H]; w_down [H, F]. A dense range is the same call with W_gate[r], W_up[r],
    W_down[:, r]; its output is that range's partial sum of the full MLP.
    """
    return down(swiglu(x, w_gate, w_up), w_down)


dense_range = swiglu_ffn


def swiglu_ffn_f64(x, w_gate, w_up, w_down) -> np.ndarray:
    """The float64 reference of :func:`swiglu_ffn` (inputs upcast), for checking the twin itself."""
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


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise KernelError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


def ggml_type(fmt: str) -> GGMLQuantizationType:
    """The GGUF type of block format `fmt` ("q4_1" → Q4_1, "q4_k" → Q4_K)."""
    if fmt not in BLOCK_FORMATS:
        raise KernelError(f"{fmt!r} is not a block format; expected one of {BLOCK_FORMATS}")
    return GGMLQuantizationType[fmt.upper()]


def block_size(fmt: str) -> tuple[int, int]:
    """(weights, bytes) of one block of block format `fmt` in the file (q4_k: 256, 144)."""
    return GGML_QUANT_SIZES[ggml_type(fmt)]


def _plane_bytes(fmt: str) -> tuple[int, int]:
    """(quant bytes, scale bytes) of one block of `fmt` on the GPU."""
    a, b = _SCALE_BYTES[fmt]
    return block_size(fmt)[1] - (b - a), b - a


def block_format(encoding: str) -> str | None:
    """The kernel format reading GGUF type name `encoding` in its own blocks ("Q4_1" → "q4_1"), else None."""
    fmt = str(encoding).lower()
    return fmt if fmt in BLOCK_FORMATS else None


def quantize_blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    """float32 w [N, K] (K a multiple of 32) → the file's blocks, uint8 [N, K / 32 * block bytes] (gguf's quantizer).

    K-quants have no quantizer in gguf-py: KernelError (take the file's blocks, or :func:`random_blocks`).
    """
    _f32(w, "w", 2)
    if fmt in K_FORMATS:
        raise KernelError(f"gguf-py cannot quantize to {fmt}; give the file's blocks")
    if w.shape[1] % QK:
        raise KernelError(f"{fmt} needs rows of a multiple of {QK} weights, got {w.shape[1]}")
    return gguf_quantize(w, ggml_type(fmt))


# Byte offsets of the f16 fields that scale a K-quant block: d, and dmin where it has one.
_K_SCALE_FIELDS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}
IQ4_NL_LEVELS = np.array(IQ4_NL.kvalues, np.float32)  # IQ4_XS's 16 levels (ggml's kvalues_iq4nl)


def random_blocks(rng: np.random.Generator, rows: int, cols: int, fmt: str, scale: float = 1e-3) -> np.ndarray:
    """Random valid blocks of block format `fmt` for a [rows, cols] matrix: uint8 [rows, cols /
    block * block bytes]. Every quant and sub-scale bit is random; the f16 d (and dmin) fields are
    uniform in [scale, 4 scale) so every weight is finite. For tests and benchmarks of the K-quants,
    which gguf-py cannot quantize to."""
    weights, size = block_size(fmt)
    if cols % weights:
        raise KernelError(f"{fmt} needs rows of a multiple of {weights} weights, got {cols}")
    n = rows * cols // weights
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in _K_SCALE_FIELDS.get(fmt, (0,) if fmt != "q4_1" else (0, 2)):
        raw[:, at:at + 2] = rng.uniform(scale, 4 * scale, n).astype("<f2")[:, None].view(np.uint8)
    return raw.reshape(rows, cols // weights * size)


def matrix_shape(w: np.ndarray, name: str, fmt: str) -> tuple[int, int]:
    """Logical [rows, K] of a matrix given to :func:`pack_matrix` as `fmt` (float32 or the file's
    blocks). Raises KernelError naming `name` when it is neither."""
    _check_format(fmt)
    if fmt in BLOCK_FORMATS and isinstance(w, np.ndarray) and w.dtype == np.uint8 and w.ndim == 2:
        weights, size = block_size(fmt)
        if w.shape[1] % size:
            raise KernelError(f"{name}: {fmt} rows must be whole {size}-byte blocks, got {w.shape[1]} bytes")
        return w.shape[0], w.shape[1] // size * weights
    return _f32(w, name, 2).shape


def as_format(w: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 weights a kernel of format `fmt` effectively multiplies by (its twin's view)."""
    _check_format(fmt)
    if fmt == "f32":
        return w
    if fmt == "f16":
        return w.astype(np.float16).astype(np.float32)
    if fmt == "q8":
        return dequantize_q8(*quantize_q8(w))
    return unpack_matrix(pack_matrix(quantize_blocks(w, fmt), fmt, 1 << 62))


def bytes_per_weight(fmt: str) -> float:
    """Storage bytes per weight of `fmt` (the q8 per-row scale is counted separately; block
    formats count their scales: 18/32, 20/32, 34/32)."""
    _check_format(fmt)
    if fmt in BLOCK_FORMATS:
        weights, size = block_size(fmt)
        return size / weights
    return {"f32": 4, "f16": 2, "q8": 1}[fmt]


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
    """A weight matrix in a kernel's layout: rows of `row_bytes` bytes, split into parts.

    data: the packed bytes of all rows (f32/f16 little-endian floats, q8 int8 bytes, block
    formats the quant plane). scale: q8 float32 [rows] per-row scales; block formats uint16
    [rows * scales_per_row], the scale plane's bytes (f16 bits; the K-quants' heads); None otherwise.
    parts: (first_row, end_row) per GPU binding, each at most the binding limit.
    """

    fmt: str
    rows: int
    cols: int  # K padded to a multiple of 4 (block formats: K, whole blocks)
    data: bytes
    scale: np.ndarray | None
    parts: tuple[tuple[int, int], ...]

    @property
    def row_bytes(self) -> int:
        if self.fmt in BLOCK_FORMATS:
            return self.cols // block_size(self.fmt)[0] * _plane_bytes(self.fmt)[0]
        return self.cols * bytes_per_weight(self.fmt)

    @property
    def scales_per_row(self) -> int:
        if self.fmt in BLOCK_FORMATS:
            return self.cols // block_size(self.fmt)[0] * _plane_bytes(self.fmt)[1] // 2
        return 1 if self.scale is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes held: both planes (what the page's memory budget counts)."""
        return len(self.data) + (self.scale.nbytes if self.scale is not None else 0)

    def part_bytes(self, part: int) -> bytes:
        r0, r1 = self.parts[part]
        return self.data[r0 * self.row_bytes : r1 * self.row_bytes]

    def part_scale(self, part: int) -> bytes:
        """The scale plane of one part (a float32 1.0 placeholder for formats without scales)."""
        if self.scale is None:
            return np.ones(1, "<f4").tobytes()
        r0, r1 = self.parts[part]
        return self.scale[r0 * self.scales_per_row : r1 * self.scales_per_row].tobytes()


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
    """Pack w [N, K] as `fmt`, zero-padded to [rows or N, K'], in parts ≤ max_binding.

    Float formats take float32 w (K' = pad4(K)). Block formats take the file's blocks, uint8
    [N, K / block * block bytes] (K' = K), or float32 w [N, K], quantized here by gguf's quantizer
    (not the K-quants); padding rows are zero blocks (d = dmin = 0: zero weights).
    """
    _check_format(fmt)
    if fmt in BLOCK_FORMATS:
        return _pack_blocks(w if w.dtype == np.uint8 else quantize_blocks(w, fmt), fmt, max_binding, rows)
    _f32(w, "w", 2)
    rows = w.shape[0] if rows is None else rows
    wp = pad_matrix(w, rows, pad4(w.shape[1]))
    scale = None
    if fmt == "f32":
        data = wp.astype("<f4").tobytes()
    elif fmt == "f16":
        data = wp.astype("<f2").tobytes()
    else:
        q, scale = quantize_q8(wp)
        data = q.tobytes()
    parts = split_rows(rows, wp.shape[1] * bytes_per_weight(fmt), max_binding)
    return PackedMatrix(fmt, rows, wp.shape[1], data, scale, parts)


def _pack_blocks(raw: np.ndarray, fmt: str, max_binding: int, rows: int | None) -> PackedMatrix:
    """The file's blocks uint8 [N, row bytes] → the two planes (module docstring)."""
    weights, size = block_size(fmt)
    a, b = _SCALE_BYTES[fmt]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise KernelError(f"{fmt} rows must be whole {size}-byte blocks, got an array of shape {raw.shape}")
    n, nb = raw.shape[0], raw.shape[1] // size
    rows = n if rows is None else rows
    blocks = np.zeros((rows, nb, size), np.uint8)
    blocks[:n] = raw.reshape(n, nb, size)
    scale = np.ascontiguousarray(blocks[..., a:b]).view("<u2").reshape(-1)
    data = np.concatenate([blocks[..., :a], blocks[..., b:]], axis=-1).tobytes()
    quant_bytes = _plane_bytes(fmt)[0]
    assert quant_bytes % 16 == 0 and len(data) == rows * nb * quant_bytes
    parts = split_rows(rows, nb * quant_bytes, max_binding)
    return PackedMatrix(fmt, rows, nb * weights, data, scale, parts)


def file_blocks(m: PackedMatrix) -> np.ndarray:
    """The file's blocks of a block-format PackedMatrix (padding rows included): uint8 [rows, nb, size]."""
    weights, size = block_size(m.fmt)
    a, b = _SCALE_BYTES[m.fmt]
    nb = m.cols // weights
    quant = np.frombuffer(m.data, np.uint8).reshape(m.rows, nb, size - (b - a))
    scale = m.scale.view(np.uint8).reshape(m.rows, nb, b - a)
    return np.concatenate([quant[..., :a], scale, quant[..., a:]], axis=-1)


def unpack_matrix(m: PackedMatrix) -> np.ndarray:
    """The float32 [rows, cols] a kernel reads from a PackedMatrix (for twins and tests).

    Block formats dequantize as llama.cpp and gguf-py do, in float32: q4_0 d * (q - 8),
    q4_1 d * q + m, q8_0 d * q; the K-quants as :func:`dequantize_k` (the kernels' twin).
    """
    if m.fmt == "f32":
        return np.frombuffer(m.data, "<f4").reshape(m.rows, m.cols).astype(np.float32)
    if m.fmt == "f16":
        return np.frombuffer(m.data, "<f2").reshape(m.rows, m.cols).astype(np.float32)
    if m.fmt == "q8":
        return dequantize_q8(np.frombuffer(m.data, np.int8).reshape(m.rows, m.cols), m.scale)
    if m.fmt in K_FORMATS:
        return dequantize_k(file_blocks(m).reshape(-1, block_size(m.fmt)[1]), m.fmt).reshape(m.rows, m.cols)
    nb = m.cols // QK
    sc = m.scale.view("<f2").astype(np.float32).reshape(m.rows, nb, -1)
    d = sc[..., :1]
    if m.fmt == "q8_0":
        q = np.frombuffer(m.data, np.int8).reshape(m.rows, nb, QK).astype(np.float32)
        return (d * q).reshape(m.rows, m.cols)
    b = np.frombuffer(m.data, np.uint8).reshape(m.rows, nb, QK // 2)
    q = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.float32)  # weights j and j + 16 of byte j
    w = d * (q - np.float32(8)) if m.fmt == "q4_0" else d * q + sc[..., 1:]
    return w.reshape(m.rows, m.cols)


def _k_scale_min(head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit (sc, m) of the 8 sub-blocks of Q4_K/Q5_K blocks: head uint8 [n, 16] (d, dmin, scales[12])
    → two float32 [n, 8] (ggml's get_scale_min_k4; blocks_k.wgsl k_scale_min)."""
    q = head[:, 4:16].astype(np.uint32)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 15) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def dequantize_k(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """Twin of the K-quant preludes: blocks uint8 [n, block bytes] as in the file → float32 [n, 256].

    q4_k/q5_k: w[32s + l] = (d * sc[s]) * q - dmin * m[s], q = nibble (s % 2) of qs[32 (s / 2) + l]
    (q5_k: plus bit s of qh[l] as bit 4). q6_k: w[128n + 32g + l] = (d * sc[8n + 2g + l / 16]) * (q - 32),
    q = nibble (g / 2) of ql[64n + 32 (g % 2) + l] | bits 2g of qh[32n + l] << 4. iq4_xs:
    w[32s + l] = (d * (ls[s] - 32)) * kv[q], q = nibble (l / 16) of qs[16s + l % 16], ls[s] = nibble s of
    scales_l | bits 2s of scales_h << 4. ggml's dequantize_row_q{4,5,6}_K and _iq4_xs; every product
    rounded to float32 in that order, as gguf-py's dequantize.
    """
    n = blocks.shape[0]
    f16 = lambda at: blocks[:, at:at + 2].copy().view("<f2").astype(np.float32)  # noqa: E731  [n, 1]
    if fmt in ("q4_k", "q5_k"):
        sc, mn = _k_scale_min(blocks[:, :16])
        d, dmin = f16(0) * sc, f16(2) * mn  # [n, 8]
        qs = blocks[:, -128:].reshape(n, 4, 1, 32)  # [n, j, 1, l]
        q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 8, 32)  # sub-block 2j + nibble
        if fmt == "q5_k":
            qh = blocks[:, 16:48].reshape(n, 1, 32)
            q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
        return (d[..., None] * q.astype(np.float32) - dmin[..., None]).reshape(n, QK_K)
    if fmt == "q6_k":
        ql = blocks[:, :128].reshape(n, 2, 1, 2, 32)    # [n, half n, nibble, g % 2, l]
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)    # [n, half n, 1, l]
        low = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & 15
        q = low.reshape(n, 2, 4, 32) | (((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3) << 4)
        d = f16(208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
        return (d.reshape(n, 16, 1) * (q.reshape(n, 16, 16).astype(np.float32) - np.float32(32))).reshape(n, QK_K)
    if fmt == "iq4_xs":
        s = np.arange(8)
        high = blocks[:, 2:4].copy().view("<u2").astype(np.uint32)  # [n, 1] scales_h
        low = blocks[:, 4:8].astype(np.uint32)  # [n, 4] scales_l
        ls = ((low[:, s // 2] >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4)  # [n, 8]
        dl = f16(0) * (ls.astype(np.int32) - 32).astype(np.float32)  # [n, 8]
        qs = blocks[:, 8:].reshape(n, 8, 1, 16)
        q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 8, 32)
        return (dl[..., None] * IQ4_NL_LEVELS[q]).reshape(n, QK_K)
    raise KernelError(f"{fmt!r} is not a K-quant; expected one of {K_FORMATS}")


def dispatch_grid(n_rows: int, t_rows: int, rows_per_group: int = 1) -> tuple[int, int, int]:
    """Workgroup counts (x, y, z) for one part: x*y ≥ n_rows / rows_per_group groups of weight
    rows (one workgroup each: 1 for the float kernels, ROWS of row_slices.wgsl for the block
    kernels), z = blocks of TB rows; x and y ≤ MAX_WORKGROUPS_PER_DIM."""
    groups = -(-n_rows // rows_per_group)
    tile_x = min(groups, MAX_WORKGROUPS_PER_DIM)
    return tile_x, -(-groups // tile_x), -(-t_rows // TB)


# ---- a layer's other kernels: RMSNorm, RoPE, attention ------------------------------------------

LAYER_KERNELS = ("rmsnorm", "rope", "attention", "kv_write", "add")  # WGSL files of their own name, no weight prelude


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Twin of rmsnorm.wgsl: ``w[t % Rw] * (x[t] * (1 / sqrt(mean(x[t]²) + eps)))`` per row t, float32.

    x [T, D] float32, w [D] or [Rw, D] float32 (T a multiple of Rw: a weight row per head, rows
    head after head) → [T, D] float32. Raises KernelError on other shapes or dtypes."""
    _f32(x, "x", 2)
    w2 = _f32(w, "w", w.ndim if w.ndim in (1, 2) else 1).reshape(-1, w.shape[-1])
    if w2.shape[1] != x.shape[1] or x.shape[0] % w2.shape[0]:
        raise KernelError(f"rms_norm shapes disagree: x {x.shape}, w {w.shape}")
    inv = np.float32(1) / np.sqrt(np.mean(x * x, axis=1, dtype=np.float32, keepdims=True) + np.float32(eps))
    return np.tile(w2, (x.shape[0] // w2.shape[0], 1)) * (x * inv)


def rope(x: np.ndarray, cos: np.ndarray, ssin: np.ndarray) -> np.ndarray:
    """Twin of rope.wgsl: ``x * cos + swap_halves(x) * ssin`` over the last axis (``ssin``: sin
    with its first half negated; the engine's :func:`swarm.compute.kernels.apply_rope_swapped`).

    x, cos, ssin [T, n, hd] float32 (hd even) → [T, n, hd] float32. Raises KernelError otherwise."""
    for name, a in (("x", x), ("cos", cos), ("ssin", ssin)):
        _f32(a, name, 3)
    if cos.shape != x.shape or ssin.shape != x.shape or x.shape[2] % 2:
        raise KernelError(f"rope needs x, cos, ssin of one [T, n, even hd] shape, "
                          f"got {x.shape}, {cos.shape}, {ssin.shape}")
    half = x.shape[2] // 2
    return x * cos + np.concatenate([x[..., half:], x[..., :half]], axis=-1) * ssin


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Twin of attention.wgsl: causal grouped-query attention of q [T, nh, hd] (already scaled;
    row t at position ``start + t``) over the cache k, v [nkv, C, hd] (positions 0 .. start+T-1
    filled); query head h reads key/value head h // (nh / nkv). Softmax with the row's max
    subtracted, normalised after the weighted sum. Returns [T, nh * hd] float32. Raises
    KernelError on shapes that do not fit."""
    check_attention(q, k, v, start)
    T, nh, hd = q.shape
    out = np.empty((T, nh, hd), np.float32)
    group = nh // k.shape[0]
    for t in range(T):
        n = start + t + 1
        for h in range(nh):
            s = k[h // group, :n] @ q[t, h]  # [n]
            e = np.exp(s - s.max())
            out[t, h] = (e @ v[h // group, :n]) / e.sum(dtype=np.float32)
    return out.reshape(T, nh * hd)


def kv_write(cache: np.ndarray, src: np.ndarray, start: int, offset: int) -> np.ndarray:
    """Twin of kv_write.wgsl's keys (or its values), in place: ``cache[g, start + t] = src[t,
    offset + g hd : offset + (g+1) hd]`` for every row t of src [T, stride] and head g of cache
    [nkv, C, hd] (float32). Returns cache."""
    nkv, _, hd = cache.shape
    T = src.shape[0]
    cache[:, start:start + T] = src[:, offset:offset + nkv * hd].reshape(T, nkv, hd).transpose(1, 0, 2)
    return cache


def add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Twin of add.wgsl, in place: x += y, y of x's shape (the residual stream) or of its rows'
    (a bias on every row), float32. Returns x."""
    x += y
    return x


def check_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> None:
    """Raise KernelError unless q [T, nh, hd], k, v [nkv, C, hd] are float32, nh a multiple of
    nkv, and positions ``start .. start+T-1`` fit the cache."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        _f32(a, name, 3)
    T, nh, hd = q.shape
    nkv, C, _ = k.shape
    if v.shape != k.shape or k.shape[2] != hd or nh % nkv or not 0 <= start <= C - T:
        raise KernelError(f"attention: q {q.shape} at position {start} does not fit k {k.shape}, v {v.shape}")


def layer_source(kernel: str) -> str:
    """The WGSL of one of :data:`LAYER_KERNELS` (a file of its own: no weight format)."""
    if kernel not in LAYER_KERNELS:
        raise KernelError(f"unknown layer kernel {kernel!r}; expected one of {LAYER_KERNELS}")
    return (resources.files(__package__) / f"{kernel}.wgsl").read_text()


# ---- WGSL sources ----------------------------------------------------------------------------

def wgsl_files(kernel: str, fmt: str, subgroups: bool = False) -> tuple[str, ...]:
    """The WGSL files of `kernel` for `fmt`, in order: the weight prelude ``weights_<fmt>.wgsl``
    (and the block preludes' helpers: ``blocks.wgsl``, then ``blocks_32.wgsl`` or, for the
    K-quants, ``blocks_k.wgsl``), ``rows.wgsl`` (what all kernels share), for block formats
    ``row_slices.wgsl`` and its reduction (``sum_subgroup.wgsl`` when `subgroups`, else
    ``sum_shared.wgsl``), then the body ``<kernel>.wgsl`` (``<kernel>_blocks.wgsl`` for block formats)."""
    if kernel not in KERNELS:
        raise KernelError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    _check_format(fmt)
    if fmt in BLOCK_FORMATS:
        helpers = "blocks_k.wgsl" if fmt in K_FORMATS else "blocks_32.wgsl"
        reduce = "sum_subgroup.wgsl" if subgroups else "sum_shared.wgsl"
        return (f"weights_{fmt}.wgsl", "blocks.wgsl", helpers, "rows.wgsl", "row_slices.wgsl", reduce,
                f"{kernel}_blocks.wgsl")
    return f"weights_{fmt}.wgsl", "rows.wgsl", f"{kernel}.wgsl"


def wgsl_source(kernel: str, fmt: str, subgroups: bool = False, tb: int = TB) -> str:
    """The WGSL a host compiles: :func:`wgsl_files` joined by newlines, with `tb` activation
    rows a workgroup (rows.wgsl's ``TB``: :data:`TB`, or :data:`DECODE_TB` for a dispatch of one
    row; a function's array size must be a constant, so it is set in the text). Each row's sum
    is the same whatever `tb`: the choice changes speed, never bits.

    The page (gpu.js) assembles the same files the same way: one source of truth. With
    `subgroups` the page also puts ``enable subgroups;`` first (browsers require it); naga (wgpu)
    rejects that directive and takes the subgroup builtins once the device has the feature.
    """
    files = resources.files(__package__)
    code = "\n".join((files / name).read_text() for name in wgsl_files(kernel, fmt, subgroups))
    if tb != TB:
        if _TB_LINE.format(TB) not in code:
            raise KernelError(f"rows.wgsl does not declare `{_TB_LINE.format(TB)}`; kernels.TB must match it")
        code = code.replace(_TB_LINE.format(TB), _TB_LINE.format(tb), 1)
    return code
