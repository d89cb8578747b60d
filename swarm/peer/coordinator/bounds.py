"""How far ``--verify`` lets an answer of another numeric build land from the coordinator's
recomputation: a bound from the format and the reduction lengths, one rule for FFN ranges
(:meth:`~swarm.peer.coordinator.dispatch.RemoteFFN._verify`) and stages
(:mod:`~swarm.peer.coordinator.stage_verify`).

Theory. A peer of another build (a WebGPU page, a GPU peer, a CPU peer of another release or
architecture) multiplies the same weights in float32, summing in another order. A float32 dot
product of n terms has an error of at most γ_n · Σ|a_i b_i|, γ_n = n·u / (1 − n·u), u = 2⁻²⁴
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2002, §3.1), but rounding errors of
independent signs grow as √n·u, not n·u, with a probability that a constant λ makes overwhelming
(Higham and Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci.
Comput. 41(5), 2019: |error| ≤ λ√n·u·Σ|a_i b_i| with probability ≥ 1 − 2 exp(−λ²/2)). The
coordinator does not compute Σ|a_i b_i| (a second product over |W|, the recomputation's cost
again); it scales by each row's largest output magnitude, and a row's terms sum to about √n
times their size, so ``SAFETY`` · √n · u of the row's largest magnitude is the bound, n the
length of the chained reductions (a SwiGLU block: gate and up over the hidden size H, then
down over its intermediate width F).

A peer whose kernels do not read the file's encoding computes on a Q8_0 repack
(:mod:`swarm.peer.weights.repack`): each weight off by up to ``Q8_0_STEP`` of its block's
largest, in each of the two chained products; that adds ``REPACK_RTOL``, 8 steps (3.6 %) of
the row's largest magnitude: these errors too add in quadrature over a row, so a row's error
stays a few steps of its scale (measured, SwiGLU 512 → 1536 → 512 over 16 rows, random blocks:
1.8–2.9 steps for Q4_0, Q8_0, Q4_K and Q6_K weights requantized to Q8_0).

Measured (same shapes, n = 2048): the WGSL kernels on lavapipe differ from the engine's CPU
kernels by at most 5–7 u of a row's largest magnitude (0.11–0.16 √n·u), the engine from
float64 by 4–5 u; the bound, 16 √n·u, is about a hundred times wider, and 0.013 % of the row
for a 4096-wide model's 14336-wide MLP.

A stage of L layers compounds: each layer's FFN and attention (whose longest reduction is the
context) adds its own, so the bound is the sum over its layers. The absolute floor ``ATOL``
keeps rows near zero from demanding more than float32 holds. A GPU peer's stage
(:class:`~swarm.peer.worker.gpu.GpuStage`; never a Q8_0 repack, so no repack term) measured at
most 0.20 % of this bound over SmolLM2-135M's 30 layers (2–50 u of a row's largest magnitude;
bench/gpu_stages.py). It also reassociates the output projection (nh·hd terms, 2H in Qwen3),
RMSNorm's squares (H, twice) and, whole layers on the GPU, each score (hd):
√(6H + F + hd + context) against the bound's √(2H + F + context), at most 1.43× for F ≥ 2H and hd ≤ H/4,
well inside that margin, so the bound is kept.

Bits are the rule for a peer of the coordinator's own build; these bounds let through only a
lie smaller than themselves.
"""

from __future__ import annotations

import math

import numpy as np

from swarm.compute.quant import QMatrix

UNIT_ROUNDOFF = 2.0**-24  # float32's u
SAFETY = 16.0  # λ of the √n·u bound, with the row's largest magnitude for the sums of |terms|
Q8_0_STEP = 0.57 / 127  # a Q8_0 repack's largest error per weight, of its block's largest (repack.py)
REPACK_RTOL = 8 * Q8_0_STEP  # two chained products; measured up to 2.9 steps of a row's largest
ATOL = 1e-4  # absolute floor, per element


def reassociation_rtol(reduction: int) -> float:
    """SAFETY · √n · u for reductions of n = ``reduction`` terms in all: the bound, relative to a
    row's largest magnitude, between two float32 summation orders. Raises ValueError for a
    reduction below 1 or one float32 sums cannot be bounded over (n u ≥ 1/2)."""
    if reduction < 1 or reduction * UNIT_ROUNDOFF >= 0.5:
        raise ValueError(f"no float32 bound for a reduction of {reduction} terms")
    return SAFETY * math.sqrt(reduction) * UNIT_ROUNDOFF


def ffn_rtol(hidden: int, inter: int, repacked: bool = False) -> float:
    """The bound of one SwiGLU answer (an expert, or a dense range ``inter`` wide) over hidden
    size ``hidden``, relative to each row's largest magnitude; ``repacked``: the peer computes on
    a Q8_0 repack of the file's blocks."""
    return reassociation_rtol(hidden + inter) + (REPACK_RTOL if repacked else 0.0)


def stage_rtol(layers: int, hidden: int, inter: int, context: int) -> float:
    """The bound of a stage answer of ``layers`` layers (hidden size, FFN width — an MoE layer's
    top-k experts' together —, and the positions attended), relative to each row's largest magnitude."""
    return layers * reassociation_rtol(2 * hidden + inter + max(context, 1))


def int8_product_bound(m: QMatrix, rows: np.ndarray) -> np.ndarray:
    """The most two honest int8 products of W = ``m`` (Q4_K, Q6_K or Q8_0 blocks) [R, K] on the
    same int8 rows ``rows`` (uint8 [n, row bytes], :meth:`QMatrix.int8_rows`) lie apart, per
    output: float64 [n, R]. Rigorous (web_peer/int8_activations.py ``cpu_bound``: the integers are
    exact on both sides, only the float32 summation orders differ), taken for a GPU of any lane
    count, its magnitudes read from the sub-scales (``coarse``: about twice the value-by-value
    bound, 15-20 times faster on K-quants). Raises KernelError for another type."""
    from web_peer import kernels
    from web_peer.int8_activations import blocks_bound

    fmt = kernels.block_format(m.qtype.name) or m.qtype.name.lower()
    size = kernels.block_size(fmt)[1] if fmt in kernels.BLOCK_FORMATS else 1
    return blocks_bound(fmt, np.asarray(m.data).reshape(m.data.shape[0], -1, size), rows, lanes=1, coarse=True)


def rows_outside(remote: np.ndarray, local: np.ndarray, rtol: float, atol: float = ATOL) -> np.ndarray:
    """bool [n]: the rows of ``remote`` [n, H] with an element farther from ``local`` [n, H]
    than ``rtol`` × that row's largest |local| + ``atol``. NaN or infinity is always outside."""
    scale = np.abs(local).max(axis=1, keepdims=True) if local.size else np.zeros((len(local), 1), local.dtype)
    diff = np.abs(remote.astype(np.float64) - local)
    return ~(diff <= rtol * scale + atol).all(axis=1)
