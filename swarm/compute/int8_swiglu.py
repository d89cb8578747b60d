"""A SwiGLU block of the int8 numerics cut at its down product's int8 rows, and the check that a
block computed elsewhere is one.

A peer of another build (a GPU peer of an int8 swarm: docs/weights.md, "GPU GEMVs on the CPU's
int8 rows") cannot give the coordinator's bits: its gate and up products sum in another order,
and one ulp of difference in an activation can move its 8-bit rounding a whole step. So it
answers with the int8 rows it fed its down product (:func:`swiglu_int8`), and the coordinator
checks the answer in two tight steps (:func:`check_int8_answer`):

1. each down-input value is a rounding of its own SwiGLU output h = silu(g)·u within the bound
   between the two sides' gate and up products (``product_bound``, rigorous: the integers are
   exact on both, only float32 summation orders differ): |q·dx − h| ≤ dx/2 + Δ, Δ the bound
   carried through silu (|silu'| ≤ 1.1) and the product, plus a few roundings of the
   activation itself; so a value may be a step away from the coordinator's own rounding only
   where h lies within Δ of a rounding boundary. The scale dx of each block must be its largest
   |h| / 127 within the same bound, the Q4_K minimums' dx·Σq exactly the quantizer's;
2. the down answer lies within ``product_bound`` of the coordinator's own down product *on
   the peer's rows*.

An honest peer passes both whatever its summation order; a peer that changes its down answer by
more than float32 rounding, or feeds down rows that are not a rounding of SwiGLU (zeros, another
row's), is caught by one or the other.

Shapes: x [n, H] float32, the block's gate/up [F, H] and down [H, F]; rows uint8
[n, :meth:`~swarm.compute.quant.QMatrix.int8_rows` bytes of F values].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from swarm.compute.kernels import MLPWeights, silu_mul
from swarm.compute.quant import QT, QMatrix

F32 = np.float32
U = 2.0**-24  # float32's unit roundoff
SILU_SLOPE = 1.1  # max |d silu(z) / dz| (1.0998 at z ≈ 2.40): |silu(a) - silu(b)| ≤ 1.1 |a - b|
ACTIVATION_ROUNDINGS = 32  # ulps of silu(g)·u, both sides together (exp of a few ulps, add, divide, multiply)
MINIMUMS = (QT.Q4_1, QT.Q5_1, QT.Q4_K, QT.Q5_K)  # types whose rows carry dx·Σq per 32 values
QUANTIZE_SLACK = 512  # units of u·dx: iscale = fl(127/amax), fl(x·iscale), dx = fl(amax/127) and their use

# (matrix, rows) → float32 [n, rows of the matrix]: a list of products computed together
Products = Callable[[Sequence[tuple[QMatrix, np.ndarray]]], list[np.ndarray]]


def cpu_products(products: Sequence[tuple[QMatrix, np.ndarray]]) -> list[np.ndarray]:
    """The engine's own int8 products (:meth:`QMatrix.matmul_int8_rows`) on int8 rows."""
    return [m.matmul_int8_rows(rows) for m, rows in products]


def gate_up_rows(w: MLPWeights, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 rows of x float32 [n, H] for the gate and for the up product (the same array
    where both matrices take the same rows). Raises ValueError for a type without an int8 product."""
    xg = w.gate.int8_rows(x)
    same = (w.up.qtype, w.up.cols) == (w.gate.qtype, w.gate.cols)
    return xg, xg if same else w.up.int8_rows(x)


def swiglu_int8(w: MLPWeights, x: np.ndarray, products: Products = cpu_products) -> tuple[np.ndarray, np.ndarray]:
    """``W_down (silu(W_gate x) * W_up x)`` under the int8 numerics for x float32 [n, H], with its
    down product's int8 rows: (y float32 [n, H], rows uint8 [n, down row bytes]). ``products``
    computes the int8 products (default the engine's; a GPU peer's: its GEMVs); the activation
    and the quantizer are the engine's. Raises ValueError for a matrix without an int8 product."""
    return swiglu_int8_many([w], [x], products)[0]


def swiglu_int8_many(ws: Sequence[MLPWeights], xs: Sequence[np.ndarray],
                     products: Products = cpu_products) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[swiglu_int8(w, x, products) for w, x in zip(ws, xs)]`` with every gate and up product
    in one call of ``products``, then every down product in another (a request's experts: one GPU
    submission each, not two per expert). Each block's answer is the one it gets alone."""
    if any(w.bias is not None or w.swiglu_limit for w in ws):
        raise ValueError("a SwiGLU with biases or a clamp (gpt-oss) has no int8 form here")
    inputs = [gate_up_rows(w, np.ascontiguousarray(x, F32)) for w, x in zip(ws, xs)]
    gu = products([p for w, (xg, xu) in zip(ws, inputs) for p in ((w.gate, xg), (w.up, xu))])
    rows = [w.down.int8_rows(silu_mul(np.ascontiguousarray(g, F32), np.ascontiguousarray(u, F32)))
            for w, g, u in zip(ws, gu[0::2], gu[1::2])]
    return list(zip(products([(w.down, r) for w, r in zip(ws, rows)]), rows))


ProductBound = Callable[[QMatrix, np.ndarray], np.ndarray]  # (W [R, K], int8 rows [n, ·]) → float64 [n, R]


def check_int8_answer(w: MLPWeights, x: np.ndarray, y: np.ndarray, rows: np.ndarray,
                      product_bound: ProductBound) -> str | None:
    """None when ``y`` float32 [n, H] and ``rows`` uint8 (its down rows) answer the block ``w`` on
    x float32 [n, H] as an honest int8 peer of another build may (module docstring), else what is
    wrong. ``product_bound(W, rows)``: the largest distance between two honest int8 products of
    W on those rows (float64 [n, R]). Raises ValueError for a matrix without an int8 product."""
    down = w.down
    want = down.int8_rows(np.zeros((0, down.cols), F32)).shape[1]
    if rows.dtype != np.uint8 or rows.shape != (x.shape[0], want):
        return f"down rows {rows.dtype} {rows.shape}, expected uint8 {(x.shape[0], want)}"
    xg, xu = gate_up_rows(w, np.ascontiguousarray(x, F32))
    g, u = cpu_products([(w.gate, xg), (w.up, xu)])
    bg, bu = product_bound(w.gate, xg), product_bound(w.up, xu)
    with np.errstate(over="ignore"):
        s = g.astype(np.float64) / (1.0 + np.exp(-g.astype(np.float64)))  # silu(g)
    h = silu_mul(g.copy(), u)
    lin = np.abs(s) * bu + SILU_SLOPE * bg * (np.abs(u) + bu)
    delta = lin + ACTIVATION_ROUNDINGS * U * (np.abs(h) + lin) + 2.0**-120
    why = _rounding_of(down, rows, h.astype(np.float64), delta)
    if why is not None:
        return why
    local = down.matmul_int8_rows(rows).astype(np.float64)
    off = np.abs(y.astype(np.float64) - local) - product_bound(down, rows)
    if not (off <= 0).all():
        return f"the down answer lies {float(np.max(off)):.3g} beyond the int8 bound of its own rows"
    return None


def _rounding_of(down: QMatrix, rows: np.ndarray, h: np.ndarray, delta: np.ndarray) -> str | None:
    """None when ``rows`` (uint8, the down product's int8 rows) round the SwiGLU output ``h``
    float64 [n, F] within ``delta`` [n, F] (module docstring, step 1), else what is wrong."""
    n, k = h.shape
    qk = 32 if _per32(down.qtype) else 256
    q = rows[:, :k].view(np.int8).astype(np.float64)
    dx = rows[:, k:k + 4 * (k // qk)].view(np.float32)  # [n, k / qk]
    if not np.isfinite(dx).all() or (dx < 0).any():
        return "a down-row scale is negative or not finite"
    if (q == -128).any():
        return "a down-row value is -128, outside the quantizer's ±127"
    canon = np.zeros_like(rows)
    canon[:, :k + 4 * (k // qk)] = rows[:, :k + 4 * (k // qk)]
    if down.qtype in MINIMUMS:  # the minimums' dx·Σq of each 32 values, as the quantizer
        sums = q.reshape(n, k // 32, 32).sum(axis=2).astype(F32)  # exact: |Σq| < 2²⁴
        at = k + 4 * (k // qk)
        canon[:, at:at + 4 * (k // 32)] = (np.repeat(dx, qk // 32, axis=1) * sums).astype(F32).view(np.uint8)
    if not np.array_equal(canon, rows):
        return "the down rows' other bytes (padding, dx·Σq) are not the quantizer's"
    d = np.repeat(dx.astype(np.float64), qk, axis=1)  # [n, k]
    hb, qb, db = (a.reshape(n, k // qk, qk) for a in (h, q, delta))
    amax, top = np.abs(hb).max(axis=2), np.abs(qb).max(axis=2)
    scale = dx.astype(np.float64)
    slack = db.max(axis=2) + QUANTIZE_SLACK * U * np.maximum(amax, 127 * scale)
    if not (np.abs(127 * scale - amax) <= slack).all():
        return "a down-row scale is not its block's largest |SwiGLU| / 127"
    if not ((scale == 0) | (top == 127)).all():
        return "a down-row block has no value at ±127"
    if not (np.abs(q * d - h) <= d / 2 + delta + QUANTIZE_SLACK * U * d).all():
        return "a down-row value is not a rounding of its SwiGLU output"
    return None


def _per32(qtype: QT) -> bool:
    """Whether the int8 rows of a matrix of ``qtype`` take one scale per 32 values (else 256)."""
    return qtype not in (QT.Q4_K, QT.Q5_K, QT.Q6_K)
