"""The bound ``--verify`` holds a peer of another numeric build to (swarm/peer/coordinator/bounds.py):
honest answers computed in another summation order (the float64 oracle, rounded) or on a Q8_0
repack stay inside the bound of their kind; a lie of a fraction of a percent does not."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from swarm.compute.ffn import swiglu_ffn
from swarm.compute.kernels import MLPWeights
from swarm.compute.quant import QMatrix
from swarm.peer.coordinator.bounds import ffn_rtol, reassociation_rtol, rows_outside, stage_rtol
from swarm.peer.weights.repack import requantize_q8_0

H, F, T = 256, 768, 8


def block(rng, qtype):
    """One SwiGLU block of ``qtype`` weights (gguf's quantizer of Gaussian ones) and its rows."""
    mats = [QMatrix(quantize(rng.standard_normal((r, c), dtype=np.float32) * c ** -0.5, qtype), qtype, c)
            for r, c in ((F, H), (F, H), (H, F))]
    return MLPWeights(*mats), rng.standard_normal((T, H), dtype=np.float32)


def f64(w: MLPWeights, x: np.ndarray) -> np.ndarray:
    """The float64 SwiGLU of the same weights: another summation order, rounded once."""
    g, u, d = (dequantize(m.data, m.qtype).astype(np.float64) for m in (w.gate, w.up, w.down))
    a = x.astype(np.float64) @ g.T
    return ((a / (1 + np.exp(-a))) * (x @ u.T) @ d.T).astype(np.float32)


def test_another_summation_order_is_inside_the_bound_and_a_small_lie_is_not():
    w, x = block(np.random.default_rng(0), QT.Q4_0)
    local, other = swiglu_ffn(w, x), f64(w, x)
    rtol = ffn_rtol(H, F)
    assert not np.array_equal(local, other)  # the bits differ ...
    assert not rows_outside(other, local, rtol).any()  # ... within the bound
    lie = other.copy()
    lie[3, 7] += 0.005 * np.abs(local[3]).max()  # half a percent of the row, one element
    assert rows_outside(lie, local, rtol).tolist() == [i == 3 for i in range(T)]
    assert rows_outside(other * np.float32(1.01), local, rtol).all()
    nan = other.copy()
    nan[0, 0] = np.nan
    assert rows_outside(nan, local, rtol)[0]


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q4_1])
def test_a_q8_0_repack_is_inside_the_repack_bound_only(qtype):
    """A page or GPU peer computing on the Q8_0 requantization of blocks its kernels do not read."""
    w, x = block(np.random.default_rng(1), qtype)
    repack = MLPWeights(*(QMatrix(requantize_q8_0(m.data, qtype.name, list(m.shape), "m"), QT.Q8_0, m.cols)
                          for m in (w.gate, w.up, w.down)))
    local, remote = swiglu_ffn(w, x), swiglu_ffn(repack, x)
    assert not rows_outside(remote, local, ffn_rtol(H, F, repacked=True)).any()
    assert rows_outside(remote, local, ffn_rtol(H, F)).any()  # the file's numbers they are not


def test_the_bound_grows_with_the_reductions_and_refuses_what_float32_cannot_bound():
    assert ffn_rtol(4096, 14336) < 2e-4  # 0.013 % of a row for a large dense MLP
    assert ffn_rtol(4096, 14336, repacked=True) > 0.03
    assert stage_rtol(2, 64, 96, 100) == 2 * stage_rtol(1, 64, 96, 100)
    assert stage_rtol(1, 64, 96, 1000) > stage_rtol(1, 64, 96, 10)  # longer contexts, longer sums
    for n in (0, 1 << 23):
        with pytest.raises(ValueError, match="reduction"):
            reassociation_rtol(n)
