"""Compact weight matrices and the kernels that multiply by them.

A :class:`QMatrix` is one ``[rows, cols]`` weight matrix (PyTorch orientation: ``y = x @ W.T``)
kept in its file's encoding: GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, …) or
plain F32/F16/BF16 elements. ``data`` is uint8 ``[rows, row_bytes]``; each row is whole blocks,
so a range of rows is a view (``rows(lo, hi)``) and a slice of a memory-mapped file stays
mapped — nothing is expanded to float32 beyond one tile at a time.

Numerics of :meth:`QMatrix.matmul` (``x`` float32 ``[T, cols]`` → float32 ``[T, rows]``), in
calls of at most ``SMALL_T`` activation rows (a longer prefill is cut into such calls):

* **Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4**: a compiled block kernel (numba) decodes each block of a few
  weight rows once, to float32 ``d·q + m``, and applies it to a few float32 activation rows;
  each (weight row, activation row) pair keeps float32 lane sums (one per position in a block),
  each accumulated by fused multiply-add over the blocks in order, then reduced in one fixed
  order.
* **F32**: the compiled float32 kernel on the mapped matrix: the same tiles, element k into
  lane k % 32 by fused multiply-add in ascending k, the lanes reduced in the same fixed order.
* **Q4_K, Q5_K, Q6_K** (super-blocks of 256): a compiled kernel of the same tiles; per
  super-block and weight row the sub-block scales (and minimums) are decoded once, each weight
  to float32 (``fma(d·sc, q, -dmin·m)``, or ``(d·sc)·(q - 32)`` for Q6_K), applied to the tile's
  activation rows: 32 float32 lane sums per pair, fused multiply-add in a fixed order, reduced
  in one fixed order.
* **F16, BF16**: the float32 kernel with each weight converted (exactly) as it is read: the
  bits of a float32 copy of the matrix, without one.
* **Q2_K, Q3_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M**: a
  compiled kernel per type (swarm/compute/lowbit.py) decodes each (super-)block of a few weight
  rows once to gguf's float32 values and applies them with the float32 kernel's operations: the
  bits of the float32 kernel on ``gguf.quants.dequantize``'s matrix, without decoding it.
* **every other type** (TQ1_0, TQ2_0, …): tiles of weight rows decoded to float32 by
  ``gguf.quants.dequantize`` (exact values) into a reused buffer, then the float32 kernel.

Rows for an embedding lookup (:meth:`QMatrix.take`) are decoded by compiled kernels for every
type above (the K-quants' by lowbit.py's decoders, gguf's values bit for bit).

**A row's result depends only on the row.** Every tile shape performs the same sequence of
operations per output element, so an output's bits do not depend on T, on which other weight
or activation rows a call holds, or on the thread count: a product is cut into ranges of output
rows spread over the process's compute threads (swarm/compute/threads.py). No path calls BLAS, whose kernels — and
so a row's bits — change with the number of rows in the call: a row resent with another, a KV
cache rebuilt from a whole history in one call, a prompt cut into other chunks, or a batch of
several sequences all give each row its solo bits.

Weights enter as float32 values (exact, or for Q4_1/Q5_1/Q4_K/Q5_K one fused multiply-add from
the stored integers: within float32 rounding of gguf's decoding) and activations stay float32,
so results differ from a float64 product by float32 rounding only (no activation quantization).

That is the default numerics, ``float32``. Under ``int8`` (swarm/compute/numerics.py: llama.cpp's)
the products of Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights quantize their activation rows to 8 bits, once per
call or group (:func:`run_table`, ``qkernels.int8_group``), and sum the integer products exactly
(qkernels.py's int8 section) — still one fixed sequence per output element, the same bits at
any T, row range or thread count; every other type keeps the float32 kernels.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from swarm.compute import numerics, threads

if TYPE_CHECKING:
    from swarm.compute.spin import SpinPool

F32 = np.float32
# Activation rows per kernel call: a longer prefill is cut into calls of this many rows, which
# stay in cache while the weights stream past (the kernels run at ~70 GFLOP/s on one core at
# any T ≥ 4; bench/results/kernels.md).
SMALL_T = 64
# Smallest share of a matrix product handed to another thread, in weight bytes (scaled up with
# the activation rows): below it, handing it over (waking a thread: tens of µs on a busy
# machine) costs more than it saves. A decode product of 512 KiB takes ~80 µs on one core.
MIN_CHUNK_BYTES = 512 << 10
# Work of one tile of a group of block-kernel products (weight bytes, scaled up with the
# activation rows as above): ~5 µs on one core, small enough to even out 16 threads' shares,
# large enough that handing it out (an atomic add, ~0.1 µs) costs nothing.
GROUP_TILE_BYTES = 48 << 10
# A group's tiles grow up to this when its work is large (a quarter of a thread's share): each
# thread then streams long runs of rows. Tiles of GROUP_TILE_BYTES across one large matrix gave a
# thread a new stream every ~33 KiB, which the prefetchers do not follow: a 103 MB head on 2
# threads read 23 GB/s with them against 37 GB/s with 1 MiB tiles (20 on one thread).
MAX_TILE_BYTES = 1 << 20
# Largest decoded float32 tile of weight rows (bytes): little memory next to the compact weights.
_TILE_BYTES = 4 << 20

# ggml types with a compiled kernel → kernel code used by the numba functions below.
_KIND = {QT.Q8_0: 0, QT.Q4_0: 1, QT.Q4_1: 2, QT.Q5_0: 3, QT.Q5_1: 4, QT.Q4_K: 5, QT.Q5_K: 6, QT.Q6_K: 7,
         QT.MXFP4: 8}
_FLOAT32_GROUP = 15  # qkernels.FLOAT32: an F32 matrix's kind in a group table (the kernels load lazily)
# 16-bit float types → kernel code of ``qkernels.matmul_half``.
_HALF = {QT.F16: 0, QT.BF16: 1}
# Kinds whose compiled decoder gives gguf's values (the K-quants are decoded by lowbit.py's).
_DEQUANT_KIND = {q: k for q, k in _KIND.items() if k <= 4 or q == QT.MXFP4}
# Types with a kernel of their own in swarm/compute/lowbit.py (decoding; products where not in _KIND).
_LOWBIT = frozenset((QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ2_XS,
                     QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M))


def block_size(qtype: QT) -> tuple[int, int]:
    """``(elements, bytes)`` of one block of ``qtype`` (1 element for F32/F16/BF16)."""
    return GGML_QUANT_SIZES[qtype]


class QMatrix:
    """One ``[rows, cols]`` weight matrix in a compact encoding.

    ``data``: uint8 ``[rows, row_bytes]`` (may be a read-only memmap view); ``qtype``: its
    ``gguf.GGMLQuantizationType``; ``cols``: logical columns (a multiple of the block size).
    Raises ValueError when the byte count does not fit the shape and encoding.
    """

    __slots__ = ("data", "qtype", "cols", "_kind", "_group", "_addr", "_c")

    def __init__(self, data: np.ndarray, qtype: QT, cols: int):
        qtype = QT(qtype)
        block, type_size = block_size(qtype)
        data = np.asarray(data)  # a plain ndarray view of a memmap (the kernels take no subclasses)
        if data.dtype != np.uint8 or data.ndim != 2:
            raise ValueError(f"QMatrix data must be uint8 [rows, row_bytes], got {data.dtype} {data.shape}")
        if cols <= 0 or cols % block or data.shape[1] != cols // block * type_size:
            raise ValueError(f"{qtype.name} rows of {cols} columns take {cols // block * type_size} bytes "
                             f"(block {block} elements / {type_size} bytes), got {data.shape[1]}")
        if data.flags.writeable:  # one read-only view type for every source: one compiled kernel
            data = data.view()
            data.flags.writeable = False
        self.data, self.qtype, self.cols = data, qtype, int(cols)
        self._kind = _KIND.get(qtype, -1)  # looked up once: matmul runs hundreds of times a token
        # its kind in a group table (qkernels.run_group): a block kind, or float32's; -1: none
        self._group = self._kind if self._kind >= 0 else _FLOAT32_GROUP if qtype == QT.F32 else -1
        self._addr = _address(data)  # for the group table (a decode token builds hundreds of rows)
        self._c = data.flags.c_contiguous  # what the group tables need

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_float(cls, a: np.ndarray) -> "QMatrix":
        """A float32 ``[rows, cols]`` array as an F32 QMatrix (shares memory when already f32, C-order)."""
        a = np.ascontiguousarray(a, dtype=F32)
        if a.ndim != 2:
            raise ValueError(f"expected a 2-D float array, got shape {a.shape}")
        return cls(a.view(np.uint8).reshape(a.shape[0], -1), QT.F32, a.shape[1])

    @classmethod
    def stacked(cls, data: np.ndarray, qtype: QT, cols: int) -> list["QMatrix"]:
        """One QMatrix per leading index of uint8 ``[n, rows, row_bytes]`` (views, e.g. experts)."""
        return [cls(data[i], qtype, cols) for i in range(data.shape[0])]

    # ---- shape -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded matrix."""
        return int(self.data.nbytes)

    def __repr__(self) -> str:
        return f"QMatrix({self.qtype.name}, {self.shape})"

    # ---- slicing ------------------------------------------------------------------------------
    def rows(self, lo: int, hi: int) -> "QMatrix":
        """Rows ``lo:hi`` (a view; still in the file's encoding). Raises ValueError out of range."""
        if not 0 <= lo < hi <= self.shape[0]:
            raise ValueError(f"rows {lo}:{hi} are outside 0:{self.shape[0]}")
        return QMatrix(self.data[lo:hi], self.qtype, self.cols)

    def columns(self, lo: int, hi: int) -> "QMatrix":
        """Columns ``lo:hi``: a view in the file's encoding when both ends fall on block
        boundaries, else an F32 copy of exactly those columns (the rule weight slices follow)."""
        if not 0 <= lo < hi <= self.cols:
            raise ValueError(f"columns {lo}:{hi} are outside 0:{self.cols}")
        block, type_size = block_size(self.qtype)
        if lo % block == 0 and hi % block == 0:  # contiguous copy: the kernels take C-order rows
            raw = np.ascontiguousarray(self.data[:, lo // block * type_size:hi // block * type_size])
            return QMatrix(raw, self.qtype, hi - lo)
        return QMatrix.from_float(self.dequantize()[:, lo:hi])

    def permuted_rows(self, order: np.ndarray) -> "QMatrix":
        """A copy with rows in ``order`` (int [rows]); still compact."""
        return QMatrix(np.ascontiguousarray(self.data[order]), self.qtype, self.cols)

    # ---- decoding -----------------------------------------------------------------------------
    def dequantize(self, lo: int = 0, hi: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``lo:hi`` as float32 ``[hi-lo, cols]`` (exactly ``gguf.quants.dequantize``'s values)."""
        hi = self.shape[0] if hi is None else hi
        raw = self.data[lo:hi]
        if out is None:
            out = np.empty((hi - lo, self.cols), F32)
        if self.qtype == QT.F32:
            out[...] = raw.view(F32)
        elif self.qtype in _DEQUANT_KIND:
            _kernels().dequant(_DEQUANT_KIND[self.qtype], raw, out)
        elif self.qtype in _LOWBIT:
            _lowbit(self.qtype)(1, raw, out, out, 0, hi - lo)
        elif self.qtype == QT.F16:  # exact widening, as gguf's, without its per-call reshaping
            out[...] = raw.view(np.float16)
        elif self.qtype == QT.BF16:
            np.left_shift(raw.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
        else:
            out[...] = gguf_dequantize(raw, self.qtype)
        return out

    def int8_rows(self, x: np.ndarray) -> np.ndarray:
        """float32 ``x`` [T, cols] quantized as the int8 numerics quantize it for this matrix
        (qkernels' int8 section: per 256 values for the K-quants, per 32 for the blocks of 32):
        uint8 [T, row bytes], each row its int8 values, then its float32 scales, then (types with
        minimums) its float32 d·Σq per 32 values. The same bits on every machine (each value's
        operations are fixed). Raises ValueError for a type or row length without an int8 product."""
        k = _compiled or _kernels()
        if not k.int8_kind(self._kind, self.cols):
            raise ValueError(f"{self.qtype.name} rows of {self.cols} values have no int8 product")
        x = self._activations(x)
        rows = np.zeros((x.shape[0], k.int8_row_bytes(self._kind, self.cols)), np.uint8)  # padding: zeros
        k.quantize(self._kind, x, rows)
        return rows

    def matmul_int8_rows(self, rows: np.ndarray) -> np.ndarray:
        """Quantized activation rows ``rows`` (uint8 [T, row bytes], :meth:`int8_rows`) times W:
        float32 [T, rows of W], on this thread; the bits ``matmul`` gives under the int8 numerics
        for the x those rows came from (each output element's one order: qkernels' int8 section).
        For a product on rows another machine quantized. Raises ValueError for a type without an
        int8 product or rows of another length."""
        k = _compiled or _kernels()
        if not k.int8_kind(self._kind, self.cols):
            raise ValueError(f"{self.qtype.name} rows of {self.cols} values have no int8 product")
        n = k.int8_row_bytes(self._kind, self.cols)
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != n:
            raise ValueError(f"int8 rows must be uint8 [T, {n}], got {rows.dtype} {rows.shape}")
        rows = np.ascontiguousarray(rows).view()
        rows.flags.writeable = False  # the kernels' one read-only type
        out = aligned_empty((rows.shape[0], self.data.shape[0]))
        k.matmul_int8(self._kind, self.data, rows, out, 0, out.shape[1])
        return out

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (int [n]) as float32 ``[n, cols]`` (embedding lookup)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.size, self.cols), F32)
        for i, r in enumerate(ids):
            self.dequantize(int(r), int(r) + 1, out[i:i + 1])
        return out

    # ---- multiplication ----------------------------------------------------------------------
    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x @ W.T``: x float32 ``[T, cols]`` → float32 ``[T, rows]`` (numerics: module docstring).

        Row t of the result depends only on row t of x (never on T or the other rows).
        ``out``: float32 ``[T, rows]`` to write the result into (any strides), or None.
        Raises ValueError on a shape or dtype mismatch of ``x`` or ``out``.
        """
        x, dst = self._operands(x, out)
        k = _compiled or _kernels()
        T, R = dst.shape
        if self._kind >= 0 and T <= SMALL_T and threads.threads() == 1 and not numerics.int8():
            k.matmul(self._kind, self.data, x, dst, 0, R)  # decode on one thread: the hot path, kept short
        else:
            _run_products(k, [(self, x, dst)])
        if out is None:
            return dst
        if dst is not out:
            out[...] = dst
        return out

    def _operands(self, x: np.ndarray, out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """``x`` as the kernels take it (float32 C-order, writable) and a C-contiguous result
        array (``out`` itself where it is one). Raises ValueError on a shape or dtype mismatch."""
        x = self._activations(x)
        T, R = x.shape[0], self.data.shape[0]
        if out is not None and (out.dtype != F32 or out.shape != (T, R)):  # the kernels write without bounds checks
            raise ValueError(f"out must be float32 [T, rows] = [{T}, {R}], got {out.dtype} {out.shape}")
        return x, (out if out is not None and out.flags.c_contiguous else aligned_empty((T, R)))

    def _activations(self, x: np.ndarray) -> np.ndarray:
        """``x`` as the kernels take it: float32 [T, cols], C-ordered and writable (copied where
        it is not). Raises ValueError on a shape or dtype mismatch."""
        if x.dtype != F32 or x.ndim != 2 or x.shape[1] != self.cols:
            raise ValueError(f"x must be float32 [T, {self.cols}], got {x.dtype} {x.shape}")
        if not (x.flags.c_contiguous and x.flags.writeable):
            # One compiled signature per kernel: to numba a read-only array (rows decoded from the
            # wire) is another type, which a worker would compile on its first request (a minute
            # of CPU and hundreds of MB of LLVM memory for the block kernels).
            x = np.array(x, dtype=F32, order="C")
        return x

    def _matmul_rows(self, k, x: np.ndarray, dst: np.ndarray, lo: int, hi: int) -> None:
        """Columns ``lo:hi`` of ``dst`` [T, R] = ``x @ W[lo:hi].T`` on this thread."""
        T = x.shape[0]
        if numerics.int8() and k.int8_kind(self._kind, self.cols):  # quantized activations
            xq = np.empty((min(T, SMALL_T), k.int8_row_bytes(self._kind, self.cols)), np.uint8)
            for t0 in range(0, T, SMALL_T):
                rows = xq[:min(SMALL_T, T - t0)]
                k.quantize(self._kind, x[t0:t0 + SMALL_T], rows)
                rows = rows.view()
                rows.flags.writeable = False  # the kernels' one read-only type
                k.matmul_int8(self._kind, self.data, rows, dst[t0:t0 + SMALL_T], lo, hi)
        elif self._kind >= 0:
            for t0 in range(0, T, SMALL_T):
                k.matmul(self._kind, self.data, x[t0:t0 + SMALL_T], dst[t0:t0 + SMALL_T], lo, hi)
        elif self.qtype == QT.F32:
            w = self.data.view(F32)
            for t0 in range(0, T, SMALL_T):
                k.matmul_f32(w, x[t0:t0 + SMALL_T], dst[t0:t0 + SMALL_T], 0, lo, hi)
        elif self.qtype in _HALF:  # converted to float32 as read: the bits of decoded tiles
            w = self.data.view(np.uint16)
            for t0 in range(0, T, SMALL_T):
                k.matmul_half(_HALF[self.qtype], w, x[t0:t0 + SMALL_T], dst[t0:t0 + SMALL_T], lo, hi)
        elif self.qtype in _LOWBIT and self.qtype not in _KIND:
            kernel = _lowbit(self.qtype)
            for t0 in range(0, T, SMALL_T):
                kernel(0, self.data, x[t0:t0 + SMALL_T], dst[t0:t0 + SMALL_T], lo, hi)
        else:  # decoded to float32 a tile of weight rows at a time, then the float32 kernel
            tile = max(16, min(hi - lo, _TILE_BYTES // (4 * self.cols)))
            buf = _tile_buffer(tile * self.cols).reshape(tile, self.cols)
            for r0 in range(lo, hi, tile):
                r1 = min(hi, r0 + tile)
                w = self.dequantize(r0, r1, buf[:r1 - r0])
                for t0 in range(0, T, SMALL_T):
                    k.matmul_f32(w, x[t0:t0 + SMALL_T], dst[t0:t0 + SMALL_T], r0, 0, r1 - r0)


LINE = 64  # bytes: a cache line, and one AVX-512 vector


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """``np.empty(shape, float32)`` starting on a 64-byte boundary: the block kernels read
    activation rows as whole vectors, and rows off a line cost ~15 % at 4 and more rows. (numpy
    aligns to 16 bytes.)"""
    n = math.prod(shape)  # numpy's prod costs ~2 µs, and a decode step makes hundreds of these
    raw = np.empty(n + LINE // 4, F32)
    skip = (-raw.__array_interface__["data"][0] % LINE) // 4
    return raw[skip:skip + n].reshape(shape)


def as_qmatrix(w) -> QMatrix:
    """``w`` when it is a QMatrix, else a float32 2-D array wrapped as an F32 QMatrix."""
    return w if isinstance(w, QMatrix) else QMatrix.from_float(w)


def matmul_many(products: Sequence[tuple[QMatrix, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]:
    """``[w.matmul(x, out) for w, x, out in products]`` handed to the compute threads at once:
    the output rows of all the products are cut together into one chunk per thread (a chunk may
    end one product and start the next), so several small products — a decode step's experts,
    a layer's query, key and value projections — keep every thread busy where each alone is too
    small to split. Each element's bits are those of its product computed alone.

    Each ``x`` float32 [T_i, cols_i]; each ``out`` float32 [T_i, rows_i] or None. Returns the
    results in order (``out`` where given). Raises ValueError as :meth:`QMatrix.matmul` does."""
    operands = [(w, *w._operands(x, out)) for w, x, out in products]
    _run_products(_compiled or _kernels(), operands)
    results = []
    for (w, x, dst), (_, _, out) in zip(operands, products):
        if out is not None and dst is not out:
            out[...] = dst
        results.append(dst if out is None else out)
    return results


def _run_products(k, operands: Sequence[tuple[QMatrix, np.ndarray, np.ndarray]]) -> None:
    """``dst = x @ W.T`` for each ``(W, x, dst)``, output rows spread over the compute threads:
    block-kernel and float32 products of at most SMALL_T rows as one compiled group (:func:`_run_group`),
    the rest in ranges of rows handed out from Python."""
    grouped = [o for o in operands if o[0]._group >= 0 and o[1].shape[0] <= SMALL_T and o[0]._c]
    if grouped:
        _run_group(grouped)
        if len(grouped) == len(operands):
            return
        operands = [o for o in operands if not any(o is g for g in grouped)]
    # A weight row's work: its bytes, weighted up with the activation rows it meets.
    sizes = [(w.data.shape[0], w.data.shape[1] * (3 + min(x.shape[0], SMALL_T)) / 4) for w, x, _ in operands]
    parts = threads.parts_for(sum(n * b for n, b in sizes), MIN_CHUNK_BYTES)
    if parts == 1:
        for w, x, dst in operands:
            w._matmul_rows(k, x, dst, 0, dst.shape[1])
        return

    def part(chunk: list[tuple[int, int, int]]) -> None:
        for i, lo, hi in chunk:
            w, x, dst = operands[i]
            w._matmul_rows(k, x, dst, lo, hi)

    threads.run_chunks(part, [(c,) for c in threads.split_weighted(sizes, parts, 8)])


def _run_group(operands: Sequence[tuple[QMatrix, np.ndarray, np.ndarray]]) -> None:
    """Block-kernel and float32 products (C-contiguous weights, x and dst checked by ``_operands``;
    T ≤ SMALL_T) in tiles of about GROUP_TILE_BYTES of work, which the calling thread and the pool's
    workers take from one atomic counter in compiled code (``qkernels.run_group``)."""
    run_table(*group_table(operands))


def group_table(operands: Sequence[tuple[QMatrix, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, int, float]:
    """The group of :func:`_run_group` as ``(table, tiles, work)`` for :func:`run_table`: the
    table holds the addresses of every weight, x and dst, which must stay alive (and in place)
    as long as it is run. Tiles are sized for the current thread count."""
    address = _pointer
    rows = []
    per_row = [w.data.shape[1] * (3 + x.shape[0]) / 4 for w, x, _ in operands]  # a weight row's work
    work = sum(w.data.shape[0] * r for (w, _, _), r in zip(operands, per_row))
    tile_bytes = _tile_bytes(work)
    first = 0
    for (w, x, dst), row_work in zip(operands, per_row):
        R, RB = w.data.shape
        tile = max(8, int(tile_bytes / row_work) // 8 * 8)
        rows.append((w._group, w._addr, R, RB, address(x), x.shape[0], x.shape[1], address(dst), tile, first))
        first += -(-R // tile)
    return np.array(rows, np.int64), first, work


def _tile_bytes(work: float) -> float:
    """A group's tile size (bytes of weights, weighted by activation rows) for ``work`` in all:
    GROUP_TILE_BYTES, or up to MAX_TILE_BYTES where every thread still gets about four."""
    return min(MAX_TILE_BYTES, max(GROUP_TILE_BYTES, work / (4 * threads.threads())))


def run_alike(ws: Sequence[QMatrix], x_base: int, x_step: int, out_base: int, out_step: int, T: int) -> None:
    """``out_i = x_i @ ws[i].T`` for matrices of one encoding and shape (a step's experts), as one
    group whose table is built with array operations rather than row by row. ``x_i``: float32
    [T, cols] at address ``x_base + i * x_step`` (step 0: one x for all), ``out_i``: float32
    [T, rows] at ``out_base + i * out_step``, every one C-ordered and alive through the call.
    The caller checks what ``_operands`` would (:func:`alike`); the bits of each product alone."""
    k = _compiled or _kernels()
    w0 = ws[0]
    (R, RB), n = w0.data.shape, len(ws)
    row_work = RB * (3 + T) / 4
    tile, per = alike_tiles(w0, T, n)
    table = np.empty((n, k.NCOLS), np.int64)
    _fill_alike(table, w0._kind, R, RB, T, w0.cols, tile, per, np.array([w._addr for w in ws], np.int64),
                x_base, x_step, out_base, out_step)
    run_table(table, n * per, n * R * row_work)


def alike_tiles(w: QMatrix, T: int, n: int) -> tuple[int, int]:
    """``(tile rows, tiles per product)`` of :func:`run_alike`'s group of ``n`` products like
    ``w`` (rows, bytes) on ``T`` activation rows, at the current thread count."""
    R, RB = w.data.shape
    row_work = RB * (3 + T) / 4
    tile = max(8, int(_tile_bytes(n * R * row_work) / row_work) // 8 * 8)
    return tile, -(-R // tile)


def alike(ws: Sequence[QMatrix]) -> bool:
    """Whether :func:`run_alike` takes ``ws``: block-kernel matrices of one encoding and shape,
    C-contiguous."""
    return ws[0]._kind >= 0 and len({(w._kind, w.data.shape, w._c) for w in ws}) == 1 and ws[0]._c


def run_table(table: np.ndarray, first: int, work: float) -> None:
    """Run a group ``table`` of ``first`` tiles and ``work`` units on the threads that join."""
    k = _compiled or _kernels()
    runner, int8 = k.run_group, numerics.int8()
    if int8:  # products with an int8 kernel take their rows quantized by the group's first tiles
        _prepare_int8(k)
        table, quantized, quantizing = k.int8_group(table, threads.threads())  # noqa: F841 - alive while it runs
        first += quantizing
        runner = k.run_group_i8
    counter = np.zeros(2, np.int64)  # the next tile; the quantizing tiles done
    # Spinning workers join a group of 4 tiles or more: one that comes late finds the tiles taken
    # and costs the caller nothing. Python workers are asked one per MIN_CHUNK_BYTES of work: each
    # costs a wake-up and the GIL in turn. On 16 cores a 2.4 MB Q4_K product took 0.33 ms on one
    # thread, 0.20 ms asking 3 others and 0.37 ms asking 15 (one per 4 tiles, as spinning workers
    # are), so a decode token on 16 threads ran no faster than on 4 (bench/results/engine.md).
    if threads.parts_for(work, 4 * GROUP_TILE_BYTES) == 1:
        runner(table, counter, first)
    elif (workers := spin_workers()) is not None and workers.run(table, counter, first) is not None:
        pass  # the spinning workers took tiles beside the caller (swarm/compute/spin.py)
    elif (parts := threads.parts_for(work, MIN_CHUNK_BYTES)) == 1:
        runner(table, counter, first)
    else:  # the Python pool: one call per thread that joins, each taking tiles until none is left
        threads.run_chunks(runner, [(table, counter, first)] * parts)


def spin_workers() -> "SpinPool | None":
    """The process's spinning workers (``spin.SpinPool``, for the numerics in use) when
    ``spin.wanted`` at the current thread count, else None. The block kernels must be loaded."""
    n = threads.threads()
    if not spin.wanted(n):
        return None
    int8 = numerics.int8()
    if int8:
        _prepare_int8(_compiled or _kernels())  # the workers run the int8 groups' runner
    return spin.pool(n - 1, int8)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


_pointer = _address  # the compiled twin once the kernels load (swarm/compute/pointers.py)
_fill_alike = None  # pointers.fill_alike once the kernels load
spin = None  # swarm/compute/spin.py once the kernels load (it imports them)


# ---- helpers ----------------------------------------------------------------------------------
_local = threading.local()


def _tile_buffer(n: int) -> np.ndarray:
    """A per-thread float32 scratch buffer of at least ``n`` elements, reused across calls."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(n, F32)
    return buf[:n]


_compiled = None
_import_lock = threading.Lock()


_int8_ready = False
_int8_lock = threading.Lock()


def _prepare_int8(k) -> None:
    """Load (or compile) the int8 numerics' entry points of module ``k`` (qkernels) and their
    spinning-worker twins, once."""
    global _int8_ready
    if _int8_ready:
        return
    with _int8_lock:
        if _int8_ready:
            return
        with compiling("int8 kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K times 8-bit activations)"):
            w, xq = np.zeros((1, 2 * 34), np.uint8), np.zeros((1, 128), np.uint8)  # a Q8_0 row of 64 values
            x, out = np.zeros((1, 64), F32), np.empty((1, 1), F32)
            k.int8_kind(0, 64)
            k.quantize(0, x, xq)
            w.flags.writeable = xq.flags.writeable = False
            k.matmul_int8(0, w, xq, out, 0, 1)
            table = np.array([[0, _address(w), 1, w.shape[1], _address(x), 1, 64, _address(out), 8, 0]], np.int64)
            table, buf, quantizing = k.int8_group(table, 1)
            counter = np.zeros(2, np.int64)
            k.run_group_i8(table, counter, 1 + quantizing)
            from swarm.compute import spin as spin_module

            ctrl = spin_module.control_block()
            spin_module.serve_i8(ctrl, 0, 1, 1)
            spin_module.run_i8(ctrl, 1, table, np.zeros(2, np.int64), 1 + quantizing)
        _int8_ready = True


def prepare_int8() -> None:
    """Load (or, the first time on a machine, compile) the int8 numerics' kernels now: an
    install step (as ``kernels.prepare_row_kernels``) fills the cache for a later ``--numerics int8``."""
    _prepare_int8(_compiled or _kernels())


def _kernels():
    """The numba kernels, imported (and compiled or loaded from numba's cache) on first use."""
    global _compiled, _pointer, _fill_alike, spin
    if _compiled is None:
        with _import_lock:
            if _compiled is None:
                os.environ.setdefault("NUMBA_CACHE_DIR", _numba_cache_dir())
                # numba's own thread pool is never started (the kernels are one-thread; threads.py
                # spreads them): one thread keeps it from sizing itself to the machine if asked.
                os.environ.setdefault("NUMBA_NUM_THREADS", "1")
                with _without_scipy():
                    with compiling("block kernels (Q4_0 … Q8_0, K-quants, MXFP4)"):
                        from swarm.compute import qkernels as k
                        # Run each once on a tiny input: compiles (first run on a machine) or loads the cache.
                        w = np.zeros((1, 34), np.uint8)
                        w.flags.writeable = False
                        x = np.zeros((1, 32), F32)
                        k.matmul(0, w, x, np.empty((1, 1), F32), 0, 1)
                        k.dequant(0, w, np.empty((1, 32), F32))
                        out = np.empty((1, 1), F32)
                        table = np.array([[0, _address(w), 1, 34, _address(x), 1, 32, _address(out), 8, 0]], np.int64)
                        k.run_group(table, np.zeros(2, np.int64), 1)
                    with compiling("float kernels (F32, F16, BF16)"):
                        f = np.zeros((1, 32), F32)  # float32 weights: writable (decoded tiles), read-only (F32 files)
                        k.matmul_f32(f, x, np.empty((1, 1), F32), 0, 0, 1)
                        f.flags.writeable = False
                        k.matmul_f32(f, x, np.empty((1, 1), F32), 0, 0, 1)
                        h = np.zeros((1, 32), np.uint16)
                        h.flags.writeable = False
                        k.matmul_half(0, h, x, np.empty((1, 1), F32), 0, 1)
                    from swarm.compute import pointers
                    pointers.address(x)  # activations and outputs: float32 [T, n] C-order, writable
                    _pointer = pointers.address
                    one = np.zeros(1, np.int64)
                    pointers.fill_alike(np.empty((1, k.NCOLS), np.int64), 0, 1, 34, 1, 32, 8, 1, one, 0, 0, 0, 0)
                    _fill_alike = pointers.fill_alike
                    pointers.fill_experts(np.empty((3, k.NCOLS), np.int64), np.zeros((2, 11), np.int64),
                                          np.zeros((3, 1), np.int64), one)  # swarm/compute/decode.py's
                    from swarm.compute import spin as spin_module
                    ctrl = spin_module.control_block()
                    spin_module.serve(ctrl, 0, 1, 1)
                    spin_module.run(ctrl, 1, table, np.zeros(2, np.int64), 1)
                    spin = spin_module
                    if numerics.int8():  # else on first use or prepare_int8(): a float32 process never holds them
                        _prepare_int8(k)
                _release_clean_pages("llvmlite")
                _compiled = k
    return _compiled


_lowbit_kernels: dict = {}
_lowbit_lock = threading.Lock()


def _lowbit(qtype: QT):
    """``qtype``'s kernel in swarm/compute/lowbit.py, loaded (or compiled: seconds) on first use."""
    kernel = _lowbit_kernels.get(qtype)
    if kernel is None:
        _kernels()  # numba's environment as the block kernels set it up
        with _lowbit_lock:
            kernel = _lowbit_kernels.get(qtype)
            if kernel is None:
                from swarm.compute import lowbit
                block, type_size = block_size(qtype)
                w = np.zeros((1, type_size), np.uint8)
                w.flags.writeable = False
                out = np.empty((1, block), F32)
                kernel = lowbit.kernel(qtype)
                with compiling(f"{qtype.name} kernels"):  # run once on a tiny input: load or compile
                    kernel(1, w, out, out, 0, 1)
                _lowbit_kernels[qtype] = kernel
    return kernel


# Loading the kernels from numba's cache takes well under this; compiling them (the first run of
# an installation, or after an update), one to three minutes (120-170 s on 2 cores): past it, the
# user is told.
COMPILE_NOTICE_S = 2.0
COMPILING = "compiling kernels for this CPU, once per installation: 1-3 min"
_notice: Callable[[str], None] | None = None
_told = False


def on_compiling(notice: Callable[[str], None] | None) -> None:
    """Have ``notice(line)`` called while the kernels compile rather than load from numba's
    cache: :data:`COMPILING` once, when a kernel group has taken COMPILE_NOTICE_S, then a line as
    each group is done (the command line prints them on stderr). None: say nothing."""
    global _notice
    _notice = notice


@contextlib.contextmanager
def compiling(group: str):
    """Around loading (or compiling) one group of kernels: tells :func:`on_compiling`'s callback
    when it takes longer than loading from the cache does."""
    notice = _notice
    if notice is None:
        yield
        return
    told = threading.Event()

    def tell() -> None:
        global _told
        if not _told:
            _told = True
            notice(COMPILING)
        told.set()

    start = time.monotonic()
    timer = threading.Timer(COMPILE_NOTICE_S, tell)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
    if told.is_set() or _told:
        notice(f"  {group}: {time.monotonic() - start:.0f} s")


@contextlib.contextmanager
def _without_scipy():
    """numba imports scipy (when installed) on import and when its CPU target starts, only to
    check its version and find BLAS for ``np.dot`` in compiled code: ~30 MiB of RSS that the
    block kernels (no BLAS calls) never use. scipy is hidden while that happens and importable
    again right after; where it is already loaded, nothing changes."""
    if "scipy" in sys.modules:
        yield
        return
    sys.modules["scipy"] = None  # `import scipy` raises ImportError, which numba allows
    try:
        yield
    finally:
        if "scipy" in sys.modules and sys.modules["scipy"] is None:
            del sys.modules["scipy"]


def _release_clean_pages(library: str) -> int:
    """Hand the resident pages of ``library``'s read-only, unmodified file mappings back to the
    page cache (``madvise(MADV_DONTNEED)``); returns the bytes released. Linux only (0 elsewhere).

    LLVM's code (~65 MiB of llvmlite's shared library) is touched while numba loads or compiles
    the kernels and not afterwards: the kernels are machine code of their own. Dropping only
    clean, non-writable mappings is safe — a later access (numba compiling again) faults the
    pages back in from the file — and the process's resident set no longer carries them."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes
    import re

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    released, span, perms, path, dirty, rss = 0, None, "", "", 0, 0

    def release() -> None:
        nonlocal released
        if span and library in path and "w" not in perms and dirty == 0 and rss > 0:
            if madvise(span[0], span[1] - span[0], 4) == 0:  # 4: MADV_DONTNEED
                released += rss

    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ *(.*)", line)
            if head:
                release()
                span = (int(head[1], 16), int(head[2], 16))
                perms, path, dirty, rss = head[3], head[4], 0, 0
            elif line.startswith(("Private_Dirty:", "Shared_Dirty:")):
                dirty += int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
        release()
    return released


def prepare_kernels() -> None:
    """Load (or, an installation's first time, compile: one to three minutes) the block kernels now,
    and the int8 numerics' when they are in use (set after the block kernels first loaded)."""
    k = _kernels()
    if numerics.int8():
        _prepare_int8(k)


# The files whose functions numba caches. numba checks a cached function against its own file
# only, and some inline functions of others (lowbit.py and rowkernels.py use qkernels.py's): the
# cache lives in a folder named by all of their contents, so a change to any (an upgrade, an
# edit) starts a fresh one rather than loading a stale kernel.
_CACHED_SOURCES = ("qkernels.py", "lowbit.py", "rowkernels.py", "deltakernel.py", "pointers.py", "spin.py")


def _numba_cache_dir() -> str:
    import hashlib

    from swarm.paths import cache_dir

    digest = hashlib.sha256()
    for name in _CACHED_SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    digest.update(os.environ.get("COLIBRI_SWARM_INT8_FORM", "").encode())  # picks the tiles compiled in
    return str(cache_dir() / "numba" / digest.hexdigest()[:16])
