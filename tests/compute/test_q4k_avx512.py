"""Q4_K's decode tiles in AVX-512 code give the bits of the portable form they replace."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from swarm.compute import quant
from swarm.compute.quant import QMatrix
from tests.compute.test_quant_kernels import check_against_float64, encoded

F32 = np.float32


def test_q4_k_decode_in_avx512_code_gives_the_portable_bits():
    """Q4_K rows at T = 1 through the kernel compiled for this machine (the vpermps table form
    where the CPU has AVX-512: ``qkernels.AVX512``) against the portable form compiled beside
    it: the same bits, on random blocks with scales at the ends of the float16 range and an odd
    row count (a short last tile); both match gguf's values to float32 rounding."""
    cols, rows = 3 * 256, 23
    raw = encoded(QT.Q4_K, rows, cols, 7).copy()
    blocks = raw.reshape(rows, 3, 144)
    extremes = np.array([65504.0, 6.1035e-05, 6e-08, 0.0, -0.0, 1.0, -3.5], np.float16)
    for off in (0, 2):  # d, dmin
        picks = extremes[np.random.default_rng(off).integers(0, extremes.size, (rows, 3))]
        blocks[rows // 2:, :, off:off + 2] = picks[rows // 2:].view(np.uint8).reshape(-1, 3, 2)
    raw.flags.writeable = False
    x = np.random.default_rng(8).standard_normal((1, cols), dtype=F32)
    k = quant._kernels()
    portable = k._rows_kernel(5, permute=False)
    want, got = np.full((1, rows), np.nan, F32), np.full((1, rows), np.nan, F32)
    portable(raw, x, want, 0, rows)
    k.matmul(5, raw, x, got, 0, rows)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    check_against_float64(QMatrix(raw, QT.Q4_K, cols), x, got)
