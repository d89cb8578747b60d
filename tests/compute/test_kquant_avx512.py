"""The K-quant tiles in vector code (AVX-512's, or any CPU's) give the bits of the portable form
they replace."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import quant
from swarm.compute.quant import QMatrix
from tests.compute.test_quant_kernels import K_HALVES, check_against_float64, encoded

F32 = np.float32
KINDS = {QT.Q4_K: 5, QT.Q5_K: 6, QT.Q6_K: 7}  # qkernels' kind numbers


@pytest.mark.slow  # compiles the portable tiles beside the vector ones: ~15-20 s a kind on 2 cores
@pytest.mark.parametrize("qtype", list(KINDS), ids=lambda q: q.name)
def test_k_quant_tiles_in_avx512_code_give_the_portable_bits(qtype):
    """Q4_K, Q5_K and Q6_K rows at T = 1, 2, 3, 4, 5, 7 and 8 (every tile shape, and short ones)
    through the kernel compiled for this machine (``qkernels.K_FORM``: AVX-512 vector code where
    the CPU has it, else the vector form) and, where that is AVX-512, the vector form beside it,
    against the portable form compiled beside them: the same bits, on random
    blocks with scales at the ends of the float16 range, an odd row count (a short last tile)
    and whole row ranges starting at odd rows; both match gguf's values to float32 rounding."""
    cols, rows = 3 * 256, 23
    raw = encoded(qtype, rows, cols, 7).copy()
    blocks = raw.reshape(rows, 3, -1)
    extremes = np.array([65504.0, 6.1035e-05, 6e-08, 0.0, -0.0, 1.0, -3.5], np.float16)
    for off in K_HALVES[qtype]:  # d, and dmin where there is one
        picks = extremes[np.random.default_rng(off).integers(0, extremes.size, (rows, 3))]
        blocks[rows // 2:, :, off:off + 2] = picks[rows // 2:].view(np.uint8).reshape(-1, 3, 2)
    raw.flags.writeable = False
    k = quant._kernels()
    portable = k._rows_kernel(KINDS[qtype], "portable")
    vector = k._rows_kernel(KINDS[qtype], "vector") if k.K_FORM != "vector" else None
    for T in (1, 2, 3, 4, 5, 7, 8):
        x = np.random.default_rng(T).standard_normal((T, cols), dtype=F32)
        want, got = np.full((T, rows), np.nan, F32), np.full((T, rows), np.nan, F32)
        portable(raw, x, want, 0, rows)
        k.matmul(KINDS[qtype], raw, x, got, 0, 5)  # a call over rows 0:5, then 5:rows
        k.matmul(KINDS[qtype], raw, x, got, 5, rows)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"T={T}")
        if vector is not None:
            other = np.full((T, rows), np.nan, F32)
            vector(raw, x, other, 0, rows)
            np.testing.assert_array_equal(other.view(np.uint32), want.view(np.uint32), err_msg=f"vector, T={T}")
        check_against_float64(QMatrix(raw, qtype, cols), x, got)
