"""Compact-weight kernels (QMatrix) against float64 products of gguf's own dequantization."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute.quant import SMALL_T, QMatrix

F32 = np.float32
QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]  # gguf can write these
K_QUANTS = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]  # gguf only reads these
PLAIN = [QT.F32, QT.F16, QT.BF16]
ROWS = 67  # odd, and not a multiple of the kernels' 64-row chunks
ROOT = Path(__file__).resolve().parents[2]


def encoded(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of ``qtype``: quantized normal weights, or (K-quants, which gguf
    cannot write) random blocks, keeping rows whose scales decode to finite values."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(8 * rows, cols // block * size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            ok = np.isfinite(gguf.quants.dequantize(raw, qtype)).all(axis=1)
        assert ok.sum() >= rows
        return np.ascontiguousarray(raw[ok][:rows])
    w = rng.normal(size=(rows, cols)).astype(F32)
    if qtype == QT.F32:
        return w.view(np.uint8)
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8)


def check_product(m: QMatrix, T: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(T, m.cols)).astype(F32)
    got = m.matmul(x)
    assert got.dtype == F32 and got.shape == (T, m.shape[0])
    return check_against_float64(m, x, got)


def check_against_float64(m: QMatrix, x: np.ndarray, got: np.ndarray) -> np.ndarray:
    """``got`` is ``x @ W.T`` up to float32 rounding, W as gguf dequantizes it (float64 product)."""
    T = x.shape[0]
    w64 = gguf.quants.dequantize(m.data, m.qtype).astype(np.float64)
    want = x.astype(np.float64) @ w64.T
    # float32 rounding of a K-term dot product is bounded by ~K·eps·Σ|x·w|; allow a tenth of that
    scale = np.abs(x.astype(np.float64)) @ np.abs(w64).T
    bound = 0.1 * m.cols * np.finfo(F32).eps * scale + 1e-30
    bad = np.abs(got - want) > bound
    assert not bad.any(), f"{m.qtype.name} T={T}: {bad.sum()} outputs off, worst {np.abs(got - want).max():.3g}"
    return got


@pytest.mark.parametrize("T", [1, 37, SMALL_T + 1])
@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS + PLAIN, ids=lambda q: q.name)
def test_matmul_against_float64_dequantization(qtype, T):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 2 * 256 if qtype in K_QUANTS else 3 * 32  # an odd number of 32-blocks
    m = QMatrix(encoded(qtype, ROWS, cols, int(qtype)), qtype, cols)
    assert m.shape == (ROWS, cols) and cols % block == 0
    check_product(m, T, seed=T)


@pytest.mark.parametrize("qtype", QUANTIZED + PLAIN, ids=lambda q: q.name)
def test_dequantize_is_exactly_ggufs(qtype):
    m = QMatrix(encoded(qtype, ROWS, 96, 1), qtype, 96)
    np.testing.assert_array_equal(m.dequantize(), gguf.quants.dequantize(m.data, qtype))
    np.testing.assert_array_equal(m.dequantize(5, 9), gguf.quants.dequantize(m.data[5:9], qtype))
    np.testing.assert_array_equal(m.take([3, 0, 3]), gguf.quants.dequantize(m.data[[3, 0, 3]], qtype))


@pytest.mark.parametrize("T", [1, 3, 37])
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_block_kernel_rows_do_not_depend_on_the_other_rows(qtype, T):
    """The block kernels sum each output alone, in one order: rows lo:hi of a call are the bits
    of a call on those rows alone, whatever tile of weight rows they fall in (odd starts, short
    tails)."""
    cols = 256
    m = QMatrix(encoded(qtype, ROWS, cols, 7), qtype, cols)
    x = np.random.default_rng(3).normal(size=(T, cols)).astype(F32)
    whole = m.matmul(x)
    for lo, hi in ((0, 1), (1, 4), (3, 10), (10, 40), (11, 40), (63, 67), (64, 67), (66, 67)):
        part = m.rows(lo, hi)
        assert part.data.base is not None  # a view, not a copy
        np.testing.assert_array_equal(part.matmul(x), whole[:, lo:hi])


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_block_kernel_activation_rows_do_not_depend_on_the_other_rows(qtype):
    """An activation row gets the same bits alone (decode), in any batch of up to SMALL_T rows
    and at any place in it (batched decode, a MoE expert's rows), whatever tile of activation
    rows it falls in, and for any weight-row view."""
    assert SMALL_T >= 37
    cols = 96  # 3 blocks
    m = QMatrix(encoded(qtype, ROWS, cols, 11), qtype, cols)
    x = np.random.default_rng(4).normal(size=(37, cols)).astype(F32)
    alone = np.concatenate([m.matmul(x[t:t + 1]) for t in range(37)])
    check_against_float64(m, x, alone)
    for a, b in ((0, 37), (0, 3), (1, 4), (5, 21), (2, 37), (30, 37), (36, 37)):
        np.testing.assert_array_equal(m.matmul(x[a:b]), alone[a:b], err_msg=f"rows {a}:{b}")
        np.testing.assert_array_equal(m.rows(5, 12).matmul(x[a:b]), alone[a:b, 5:12], err_msg=f"rows {a}:{b}")


_THREADS_CHILD = """
import sys, numpy as np
from swarm.compute import quant
from tests.compute.test_quant_kernels import PLAIN, QUANTIZED, encoded, ROWS
quant.prepare_kernels()
import numba
assert numba.get_num_threads() == 2, numba.get_num_threads()  # so the parallel kernels run
x = np.random.default_rng(5).normal(size=(100, 256)).astype(np.float32)
out = {}
for q in QUANTIZED + PLAIN:
    m = quant.QMatrix(encoded(q, 3 * ROWS, 256, 13), q, 256)
    for T in (1, 5, 37, 100):
        out[f"{q.name}_{T}"] = m.matmul(x[:T])
np.savez(sys.argv[1], **out)
"""


@pytest.mark.slow
def test_block_kernels_give_the_same_bits_on_two_threads(tmp_path):
    """The parallel kernels (``NUMBA_NUM_THREADS`` = 2, rows split in chunks over numba's
    threads) give each output the bits of the one-thread kernels: block and float32 kernels."""
    path = tmp_path / "two_threads.npz"
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _THREADS_CHILD, str(path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(path)
    x = np.random.default_rng(5).normal(size=(100, 256)).astype(F32)
    for q in QUANTIZED + PLAIN:
        m = QMatrix(encoded(q, 3 * ROWS, 256, 13), q, 256)
        for T in (1, 5, 37, 100):
            np.testing.assert_array_equal(got[f"{q.name}_{T}"], m.matmul(x[:T]), err_msg=f"{q.name} T={T}")


def test_columns_keep_the_encoding_on_block_bounds_else_float32():
    m = QMatrix(encoded(QT.Q4_1, 8, 128, 2), QT.Q4_1, 128)
    full = m.dequantize()
    aligned = m.columns(32, 96)
    assert aligned.qtype == QT.Q4_1 and aligned.shape == (8, 64) and aligned.nbytes == m.nbytes // 2
    np.testing.assert_array_equal(aligned.dequantize(), full[:, 32:96])
    cut = m.columns(10, 50)
    assert cut.qtype == QT.F32 and cut.shape == (8, 40)
    np.testing.assert_array_equal(cut.dequantize(), full[:, 10:50])


def test_bad_input_names_what_is_wrong():
    m = QMatrix(encoded(QT.Q8_0, 4, 64, 0), QT.Q8_0, 64)
    with pytest.raises(ValueError, match=r"x must be float32 \[T, 64\], got float64"):
        m.matmul(np.zeros((1, 64)))
    with pytest.raises(ValueError, match=r"x must be float32 \[T, 64\], got float32 \(1, 32\)"):
        m.matmul(np.zeros((1, 32), F32))
    with pytest.raises(ValueError, match=r"Q8_0 rows of 64 columns take 68 bytes"):
        QMatrix(np.zeros((4, 60), np.uint8), QT.Q8_0, 64)
    with pytest.raises(ValueError, match=r"rows 3:9 are outside 0:4"):
        m.rows(3, 9)
    with pytest.raises(ValueError, match=r"columns 0:65 are outside 0:64"):
        m.columns(0, 65)


@pytest.mark.parametrize("T", [1, SMALL_T, SMALL_T + 1])
def test_strided_activations_and_outputs_give_the_same_bits(T):
    """Views that are not C-contiguous (a column slice of activations, of an output buffer) are
    copied or written through, not misread."""
    cols = 128
    m = QMatrix(encoded(QT.Q4_1, ROWS, cols, 5), QT.Q4_1, cols)
    wide = np.random.default_rng(9).normal(size=(T, 2 * cols)).astype(F32)
    x = wide[:, ::2]
    assert not x.flags.c_contiguous
    want = m.matmul(np.ascontiguousarray(x))
    np.testing.assert_array_equal(m.matmul(x), want)
    buf = np.full((T, ROWS + 3), np.nan, F32)
    got = m.matmul(np.ascontiguousarray(x), out=buf[:, 3:])
    assert got.base is buf or got is buf[:, 3:] or np.shares_memory(got, buf)
    np.testing.assert_array_equal(buf[:, 3:], want)
    assert np.isnan(buf[:, :3]).all()
