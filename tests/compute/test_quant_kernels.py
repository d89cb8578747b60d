"""Compact-weight kernels (QMatrix) against float64 products of gguf's own dequantization."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute.quant import SMALL_T, QMatrix

F32 = np.float32
QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4]  # gguf can write these
K_QUANTS = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]  # gguf only reads these
COMPILED_K = [QT.Q4_K, QT.Q5_K, QT.Q6_K]  # K-quants with a block kernel in qkernels.py
IQ = [QT.IQ4_NL, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M]  # read only
LOWBIT = [QT.Q2_K, QT.Q3_K] + IQ  # products by swarm/compute/lowbit.py
# byte offsets of each super-block's float16 scales (d, and dmin where there is one)
K_HALVES = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
PLAIN = [QT.F32, QT.F16, QT.BF16]
ROWS = 67  # odd, and not a multiple of the kernels' 64-row chunks


def encoded(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of ``qtype``: quantized normal weights, or (K-quants and IQ types,
    which gguf cannot write) random blocks, keeping rows whose scales decode to finite values."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS or qtype in IQ:
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
@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS + IQ + PLAIN, ids=lambda q: q.name)
def test_matmul_against_float64_dequantization(qtype, T):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 2 * 256 if qtype in K_QUANTS else 3 * block if qtype in IQ else 3 * 32  # odd counts of 32-blocks
    m = QMatrix(encoded(qtype, ROWS, cols, int(qtype)), qtype, cols)
    assert m.shape == (ROWS, cols) and cols % block == 0
    check_product(m, T, seed=T)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("qtype", COMPILED_K, ids=lambda q: q.name)
def test_k_quant_kernels_at_extreme_scales(qtype, T):
    """Super-block scales at the ends of the float16 range (largest finite, smallest normal,
    subnormal, zero, negative) beside ordinary ones, every 6-bit sub-scale pattern: the compiled
    K-quant kernels still match gguf's dequantization to float32 rounding."""
    cols = 3 * 256
    raw = encoded(qtype, ROWS, cols, 40 + T).copy()
    blocks = raw.reshape(ROWS, cols // 256, -1)
    extremes = np.array([65504.0, -65504.0, 6.1035e-05, 6e-08, 0.0, -0.0, 1.0, -3.5], np.float16)
    rng = np.random.default_rng(T)
    for off in K_HALVES[qtype]:
        picks = extremes[rng.integers(0, extremes.size, blocks.shape[:2])]
        blocks[:, :, off:off + 2] = picks.view(np.uint8).reshape(*blocks.shape[:2], 2)
    with np.errstate(all="ignore"):
        assert np.isfinite(gguf.quants.dequantize(raw, qtype)).all()
    check_product(QMatrix(raw, qtype, cols), T, seed=T)


def test_half_to_float_by_integer_operations_gives_every_halfs_float32_bits():
    """Where the target x86 CPU has no F16C (NUMBA_CPU_NAME=generic, a CPU before 2012) LLVM would
    call compiler-rt's __extendhfsf2 for a half → float conversion, a symbol numba's JIT lacks: the
    process aborted on the first F16 product. The kernels then convert by integer operations,
    which must give numpy's float32 for each of the 65,536 halves (subnormals, ±0, ±inf, NaN
    payloads); and that path is the one taken exactly where the target lacks F16C."""
    from numba import config, njit

    from swarm.compute import qkernels

    @njit
    def convert(bits, out):
        for i in range(bits.shape[0]):
            out[i] = qkernels._h2f_by_bits(bits[i])

    bits = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, np.float32)
    convert(bits, out)
    want = bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))

    x86 = qkernels.platform.machine().lower() in ("x86_64", "amd64")
    saved = (config.CPU_NAME, config.CPU_FEATURES)
    try:
        config.CPU_NAME, config.CPU_FEATURES = "generic", None
        assert qkernels._no_half_conversion() == x86
        config.CPU_NAME, config.CPU_FEATURES = None, "+avx2,+fma,+f16c"
        assert not qkernels._no_half_conversion()
        config.CPU_NAME, config.CPU_FEATURES = None, "+sse4.2"
        assert qkernels._no_half_conversion() == x86
    finally:
        config.CPU_NAME, config.CPU_FEATURES = saved


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda q: q.name)
def test_half_kernels_give_the_bits_of_a_float32_copy(qtype):
    """F16/BF16 weights converted as they are read: the bits of the float32 kernel on the
    decoded matrix, at every T (tile edges, a column tail past the last 32)."""
    cols = 9 * 32 + 5
    raw = encoded(qtype, ROWS, cols, 2)
    m = QMatrix(raw, qtype, cols)
    copy = QMatrix.from_float(gguf.quants.dequantize(raw, qtype))
    for T in (1, 2, 5, SMALL_T + 3):
        x = np.random.default_rng(T).normal(size=(T, cols)).astype(F32)
        np.testing.assert_array_equal(m.matmul(x), copy.matmul(x), err_msg=f"T={T}")


@pytest.fixture
def compiled_only(monkeypatch):
    """gguf-py's numpy decoding made to fail inside QMatrix: what passes ran compiled code."""
    from swarm.compute import quant

    def refuse(raw, qtype):
        raise AssertionError(f"{qtype.name} was decoded by gguf-py's numpy path")
    monkeypatch.setattr(quant, "gguf_dequantize", refuse)


@pytest.mark.parametrize("T", [1, 2, 5, 37, SMALL_T + 1])
@pytest.mark.parametrize("qtype", LOWBIT, ids=lambda q: q.name)
def test_lowbit_kernels_give_the_bits_of_the_float32_kernel_on_ggufs_values(qtype, T, compiled_only):
    """The low-bit kernels decode each block to gguf's float32 values and apply them with the
    float32 kernel's operations: the bits of that kernel on ``gguf.quants.dequantize``'s matrix
    (so, like it, whatever T, tile or thread count), odd row counts and views included."""
    cols = 3 * gguf.GGML_QUANT_SIZES[qtype][0]
    raw = encoded(qtype, ROWS, cols, 30 + T)
    m, copy = QMatrix(raw, qtype, cols), QMatrix.from_float(gguf.quants.dequantize(raw, qtype))
    x = np.random.default_rng(T).normal(size=(T, cols)).astype(F32)
    np.testing.assert_array_equal(m.matmul(x), copy.matmul(x))
    np.testing.assert_array_equal(m.rows(3, 10).matmul(x), copy.rows(3, 10).matmul(x))


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.IQ4_NL], ids=lambda q: q.name)
def test_a_low_bit_decode_tile_of_any_shape_and_form_gives_the_same_bits(qtype):
    """The low-bit types' own decode tile (a decode step of up to 16-32 rows) may take 1, 2 or 4
    weight rows (this CPU's shapes, and 2 × 4) and 1 to 4 activation rows, each block decoded
    once for them (T in runs of at most 4, as even as can be; at T = 1 its weight rows by one),
    in every form this CPU has (vector blocks, the decoders' loops): none changes an operation
    on an element, so every one gives the bits of the float32 kernel on gguf's decoded matrix,
    over ragged row ranges, touching no row past T. A tile of no or more than 4 activation rows,
    and a form the type lacks here, are not built: refused, named."""
    from swarm.compute import lowbit

    cols = 2 * 256
    raw = encoded(qtype, 13, cols, 5)
    forms = [f for f in lowbit.FORMS if f == "scalar" or qtype in lowbit._FORM_TYPES[f]]
    assert lowbit._form(qtype) == forms[0] and len(forms) >= 2 - (qtype == QT.IQ4_NL)
    # None: this CPU's own shapes, one at T = 1, one above; a shape of 2 weight rows in the default form
    cases = [(forms[0], (2, lowbit._MAX_ACTS))] + [(form, None) for form in forms]
    kernels = {(form, tile): lowbit._rows_kernel(qtype, tile, form) for form, tile in cases}
    # a decode step of up to _FUSED_ROWS sequences takes the decode tile (the scalar form's up to
    # _SCALAR_FUSED_ROWS: 4) in runs of at most 4 rows (6: 3 + 3, 7: 4 + 3); one more, the decoders'
    # rows. Rows past T (NaN activations, sentinel outputs) are neither read nor written.
    limit = lowbit._FUSED_ROWS[qtype]
    for T in (1, 2, 3, lowbit._SCALAR_FUSED_ROWS, 5, 6, 7, limit, limit + 1):
        xs = np.full((T + 2, cols), np.nan, F32)
        xs[:T] = np.random.default_rng(T).normal(size=(T, cols))
        x = xs[:T]
        want = QMatrix.from_float(gguf.quants.dequantize(raw, qtype)).matmul(x)
        assert np.isfinite(want).all()
        for (form, tile), fn in kernels.items():
            outs = np.full((T + 2, 13), -7.0, F32)
            out = outs[:T]
            for lo, hi in ((0, 5), (5, 6), (6, 13)):
                fn(raw, x, out, lo, hi)
            np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32), err_msg=f"T={T} {form} {tile}")
            assert (outs[T:] == -7.0).all(), f"T={T} {form} {tile} wrote past its rows"
    for bad in ((2, 0), (1, lowbit._MAX_ACTS + 1)):
        with pytest.raises(ValueError, match=rf"\({bad[0]}, {bad[1]}\)"):
            lowbit._rows_kernel(qtype, bad)
    with pytest.raises(ValueError, match="'words'"):
        lowbit._rows_kernel(QT.Q3_K, None, "words")


@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS + IQ + PLAIN, ids=lambda q: q.name)
def test_dequantize_is_exactly_ggufs(qtype, compiled_only):
    """Every type with a compiled decoder (all of these but F32/F16/BF16, which are views)
    decodes whole rows and embedding rows to gguf's values, bit for bit."""
    cols = 3 * gguf.GGML_QUANT_SIZES[qtype][0] if qtype in K_QUANTS or qtype in IQ else 96
    m = QMatrix(encoded(qtype, ROWS, cols, 1), qtype, cols)
    np.testing.assert_array_equal(m.dequantize(), gguf.quants.dequantize(m.data, qtype))
    np.testing.assert_array_equal(m.dequantize(5, 9), gguf.quants.dequantize(m.data[5:9], qtype))
    np.testing.assert_array_equal(m.take([3, 0, 3]), gguf.quants.dequantize(m.data[[3, 0, 3]], qtype))


@pytest.mark.parametrize("T", [1, 3, 37])
@pytest.mark.parametrize("qtype", QUANTIZED + COMPILED_K + LOWBIT, ids=lambda q: q.name)
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


@pytest.mark.parametrize("qtype", QUANTIZED + COMPILED_K + LOWBIT, ids=lambda q: q.name)
def test_block_kernel_activation_rows_do_not_depend_on_the_other_rows(qtype):
    """An activation row gets the same bits alone (decode), in any batch of up to SMALL_T rows
    and at any place in it (batched decode, a MoE expert's rows), whatever tile of activation
    rows it falls in, and for any weight-row view."""
    assert SMALL_T >= 37
    cols = 3 * gguf.GGML_QUANT_SIZES[qtype][0]  # 3 blocks
    m = QMatrix(encoded(qtype, ROWS, cols, 11), qtype, cols)
    x = np.random.default_rng(4).normal(size=(37, cols)).astype(F32)
    alone = np.concatenate([m.matmul(x[t:t + 1]) for t in range(37)])
    check_against_float64(m, x, alone)
    for a, b in ((0, 37), (0, 3), (1, 4), (5, 21), (2, 37), (30, 37), (36, 37)):
        np.testing.assert_array_equal(m.matmul(x[a:b]), alone[a:b], err_msg=f"rows {a}:{b}")
        np.testing.assert_array_equal(m.rows(5, 12).matmul(x[a:b]), alone[a:b, 5:12], err_msg=f"rows {a}:{b}")


def test_block_kernels_give_the_same_bits_on_several_threads(monkeypatch):
    """Products cut into ranges of output rows over 2 and 3 compute threads give each output the
    bits of the one-thread kernels: block, K-quant, float32, 16-bit and decoded-tile paths."""
    from swarm.compute import quant, threads

    monkeypatch.setattr(quant, "MIN_CHUNK_BYTES", 1)
    before = threads.threads()
    x = np.random.default_rng(5).normal(size=(100, 256)).astype(F32)
    try:
        for q in QUANTIZED + K_QUANTS + IQ + PLAIN:
            m = QMatrix(encoded(q, 3 * ROWS, 256, 13), q, 256)
            for T in (1, 5, 37, 100):
                threads.set_threads(1)
                want = m.matmul(x[:T])
                for n in (2, 3):
                    threads.set_threads(n)
                    np.testing.assert_array_equal(m.matmul(x[:T]), want, err_msg=f"{q.name} T={T} threads={n}")
    finally:
        threads.set_threads(before)


def test_columns_keep_the_encoding_on_block_bounds_else_float32():
    m = QMatrix(encoded(QT.Q4_1, 8, 128, 2), QT.Q4_1, 128)
    full = m.dequantize()
    aligned = m.columns(32, 96)
    assert aligned.qtype == QT.Q4_1 and aligned.shape == (8, 64) and aligned.nbytes == m.nbytes // 2
    np.testing.assert_array_equal(aligned.dequantize(), full[:, 32:96])
    cut = m.columns(10, 50)
    assert cut.qtype == QT.F32 and cut.shape == (8, 40)
    np.testing.assert_array_equal(cut.dequantize(), full[:, 10:50])


def test_read_only_rows_use_the_kernels_already_compiled():
    """Rows decoded from the wire are read-only arrays: a distinct type to numba, which would
    compile (or load) a second signature of each kernel in a worker at its first request."""
    from swarm.compute import qkernels, quant

    quant._kernels()
    for qtype in (QT.Q8_0, QT.F32, QT.F16):
        w = QMatrix(encoded(qtype, 8, 64, seed=0), qtype, 64)
        x = np.ones((3, 64), np.float32)
        want = w.matmul(x)
        before = {f: list(getattr(qkernels, f).signatures) for f in ("matmul", "matmul_f32", "matmul_half")}
        x.flags.writeable = False
        assert np.array_equal(w.matmul(x), want)
        assert {f: list(getattr(qkernels, f).signatures) for f in before} == before, qtype


def test_bad_input_names_what_is_wrong():
    m = QMatrix(encoded(QT.Q8_0, 4, 64, 0), QT.Q8_0, 64)
    with pytest.raises(ValueError, match=r"x must be float32 \[T, 64\], got float64"):
        m.matmul(np.zeros((1, 64)))
    with pytest.raises(ValueError, match=r"x must be float32 \[T, 64\], got float32 \(1, 32\)"):
        m.matmul(np.zeros((1, 32), F32))
    with pytest.raises(ValueError, match=r"out must be float32 \[T, rows\] = \[2, 4\], got float32 \(1, 4\)"):
        m.matmul(np.zeros((2, 64), F32), out=np.zeros((1, 4), F32))
    with pytest.raises(ValueError, match=r"out must be float32 \[T, rows\] = \[1, 4\], got float64"):
        m.matmul(np.zeros((1, 64), F32), out=np.zeros((1, 4)))
    strided = np.full((2, 8), 7.0, F32)  # every other column: the result lands there, the rest untouched
    x = np.random.default_rng(3).normal(size=(2, 64)).astype(F32)
    assert m.matmul(x, out=strided[:, ::2]) is not None
    assert np.array_equal(strided[:, ::2], m.matmul(x)) and (strided[:, 1::2] == 7.0).all()
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


# ---- K-quant writers (gguf reads K-quants but cannot write them) ----------------------------
def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def quantize_k(a: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 ``[..., K]`` (K a multiple of 256) as uint8 Q4_K or Q6_K super-blocks, ggml's
    layouts (``block_q4_K``, ``block_q6_K``), each row on its own: plain min/max rounding, enough
    for a test model whose reference weights are these blocks decoded by ``gguf.quants``."""
    rows = a.reshape(-1, a.shape[-1]).astype(np.float32)
    x = rows.reshape(-1, 256)
    n = x.shape[0]
    if qtype == QT.Q4_K:
        sub = x.reshape(n, 8, 32)
        lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
        scale, mins = (hi - lo) / 15, -lo
        d, dmin = _f16(scale.max(-1) / 63), _f16(mins.max(-1) / 63)
        with np.errstate(all="ignore"):
            sc = np.clip(np.nan_to_num(np.rint(scale / d.astype(F32)[:, None])), 0, 63).astype(np.uint8)
            m = np.clip(np.nan_to_num(np.rint(mins / dmin.astype(F32)[:, None])), 0, 63).astype(np.uint8)
            s = d.astype(F32)[:, None] * sc
            q = np.rint((sub + (dmin.astype(F32)[:, None] * m)[..., None]) / s[..., None])
        q = np.clip(np.nan_to_num(q), 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)
        packed = np.empty((n, 12), np.uint8)
        packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
        blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed, qs], axis=1)
    elif qtype == QT.Q6_K:
        sub = x.reshape(n, 16, 16)
        amax = np.abs(sub).max(-1)
        d = _f16(amax.max(-1) / 31 / 127)
        with np.errstate(all="ignore"):
            sc = np.clip(np.nan_to_num(np.rint(amax / 31 / d.astype(F32)[:, None])), -128, 127).astype(np.int8)
            q = np.rint(sub / (d.astype(F32)[:, None] * sc)[..., None])
        q = (np.clip(np.nan_to_num(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, quarter, l]
        # byte 32c + l of a half: low nibble position 32c + l, high nibble position 64 + 32c + l
        ql = np.concatenate([(q[:, :, c] & 15) | ((q[:, :, c + 2] & 15) << 4) for c in (0, 1)], axis=2).reshape(n, 128)
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
        blocks = np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    else:
        raise ValueError(f"quantize_k writes Q4_K and Q6_K, not {qtype.name}")
    return np.ascontiguousarray(blocks).reshape(*a.shape[:-1], -1)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_k_quant_writer_decodes_to_its_input(qtype):
    """The test writer's blocks decode (gguf) to the input within the format's step."""
    a = np.random.default_rng(1).normal(size=(6, 512)).astype(F32)
    back = gguf.quants.dequantize(quantize_k(a, qtype), qtype)
    step = (np.abs(a).max() / (7 if qtype == QT.Q4_K else 24))
    assert back.shape == a.shape and np.abs(back - a).max() < step


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_k_quant_model_matches_transformers(qtype, tmp_path, monkeypatch):
    """A small Llama (hidden 256, so every matrix but the norms is in K-quant super-blocks)
    written as a Q4_K or Q6_K GGUF, through Model.forward, against transformers running the
    same weights decoded by gguf (float64): logits agree to float32 rounding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from swarm.compute import load_model
    from tests.compute.tiny_gguf import write_gguf_from_hf

    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  rope_theta=10000.0, initializer_range=0.05)
    torch.manual_seed(int(qtype))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    plain = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda a, q: quantize_k(a, q) if q == qtype else plain(a, q))
    path = write_gguf_from_hf(hf, "llama", tmp_path / "k.gguf", qtype)  # rows are quantized one by one,
    monkeypatch.undo()  # so the file's permuted Q/K rows are the permuted blocks of the HF rows
    model = load_model(path)
    assert model.checkpoint.file.qtype("blk.0.attn_q.weight") == qtype
    assert model.checkpoint.file.qtype("blk.1.ffn_down.weight") == qtype
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2 and p.shape[-1] % 256 == 0:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(quantize_k(p.numpy(), qtype), qtype)))
    hf = hf.double()
    tokens = np.random.default_rng(3).integers(0, 128, 40).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    got = model.forward(tokens, model.new_cache())
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), np.abs(got - want).max()


def test_kernels_compiled_in_different_processes_link_to_their_own_code(tmp_path):
    """Each type's kernel compiles in the process that first uses it and is cached; two compiled
    in different processes, then loaded into one, once shared a symbol name (numba's per-process
    counter) and one type ran the other's decoder. Q4_K and Q5_K rows: the cheapest to compile."""
    import subprocess
    import sys

    code = """
import sys, numpy as np, gguf
from gguf import GGMLQuantizationType as QT
from swarm.compute import lowbit
from tests.compute.test_quant_kernels import encoded
for name in sys.argv[1:]:
    raw = encoded(QT[name], 5, 512, 3)
    raw.flags.writeable = False
    out = np.empty((5, 512), np.float32)
    lowbit.kernel(QT[name])(1, raw, out, out, 0, 5)
    assert np.array_equal(out, gguf.quants.dequantize(raw, QT[name])), name
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    for names in (["Q4_K"], ["Q5_K"], ["Q4_K", "Q5_K"], ["Q5_K", "Q4_K"]):
        run = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
        assert run.returncode == 0, (names, run.stderr[-2000:])
