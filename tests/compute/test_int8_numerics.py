"""The numerics ``int8`` (8-bit activations, llama.cpp's): the compiled kernels against a numpy
twin of the same integer and float32 operations, bit for bit; the same bits across T, row
ranges, thread counts and every form that compiles here (AVX-512 VNNI, AVX2, plain vector
arithmetic, portable)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import numerics, quant, threads
from swarm.compute.quant import QMatrix
from tests.compute.test_quant_kernels import encoded

F32, F64 = np.float32, np.float64
KINDS = {QT.Q8_0: 0, QT.Q4_0: 1, QT.Q4_1: 2, QT.Q5_0: 3, QT.Q5_1: 4, QT.Q4_K: 5, QT.Q5_K: 6, QT.Q6_K: 7}  # qkernels' kind numbers
PER32 = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_1: 20, QT.Q5_0: 22, QT.Q5_1: 24}  # activations per 32: block bytes


# ---- the numpy twin ---------------------------------------------------------------------------
def fma32(a, b, c):
    """float32 ``a·b + c`` with one rounding (numpy has no fma): a·b is exact in float64, the sum
    is float64's rounding s plus its exact error e (two-sum), and s is rounded to float32 by its
    neighbours, a tie broken by e's sign — what a single rounding of the exact sum gives."""
    a, b, c = (np.asarray(v, F32).astype(F64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.astype(F32)
    other = np.nextafter(r, np.where(s > r.astype(F64), np.inf, -np.inf).astype(F32))
    mid = (r.astype(F64) + other.astype(F64)) / 2
    tie = (s == mid) & (e != 0) & (s != r.astype(F64))
    up = np.where(e > 0, np.maximum(r, other), np.minimum(r, other))
    return np.where(tie, up, r).astype(F32)


def lane_sum(v):
    """float32 lanes [..., n] summed by halving (lo + hi), as the kernels' fixed order."""
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = (v[..., :h] + v[..., h:]).astype(F32)
    return v[..., 0]


def quantize(x, block):
    """Activation rows float32 [T, K] → int8 values int64 [T, K] and scales float32 [T, K/block]."""
    T, K = x.shape
    xb = x.reshape(T, K // block, block)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.clip(np.rint((xb * iscale[..., None]).astype(F32)), -127, 127).astype(np.int64)
    return q.reshape(T, K), (amax / F32(127)).astype(F32)


def half(raw, off):
    return raw[..., off:off + 2].copy().view(np.float16)[..., 0].astype(F32)


def decode(qtype, w, K):
    """Integer weights int64 [R, K] and per-block scales of ``w`` (ggml's block layouts)."""
    R = w.shape[0]
    if qtype == QT.Q8_0:
        b = w.reshape(R, K // 32, 34)
        return b[..., 2:].view(np.int8).astype(np.int64).reshape(R, K), half(b, 0)
    if qtype in PER32:  # Q4_0, Q4_1, Q5_0, Q5_1
        b = w.reshape(R, K // 32, PER32[qtype])
        qs = b[..., -16:].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [R, nb, 32]
        if qtype in (QT.Q5_0, QT.Q5_1):
            qh = b[..., -20:-16].copy().view(np.uint32).astype(np.int64)  # [R, nb, 1]
            q = q | (((qh >> np.arange(32)) & 1) << 4)
        if qtype in (QT.Q4_1, QT.Q5_1):  # w = d·q + m
            return q.reshape(R, K), half(b, 0), half(b, 2)
        return (q - (8 if qtype == QT.Q4_0 else 16)).reshape(R, K), half(b, 0)
    if qtype in (QT.Q4_K, QT.Q5_K):
        b = w.reshape(R, K // 256, 144 if qtype == QT.Q4_K else 176)
        s = b[..., 4:16].astype(np.int64)
        a, bb, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
        m = np.concatenate([bb & 63, (c >> 4) | ((bb >> 6) << 4)], axis=-1)
        qs = b[..., -128:].astype(np.int64).reshape(R, K // 256, 4, 32)
        q = np.concatenate([qs[..., None, :] & 15, qs[..., None, :] >> 4], axis=-2)  # [R, nsb, 4, 2, 32]
        if qtype == QT.Q5_K:  # bit 2k + h of byte 16 + l: the fifth bit of chunk k's half h
            qh = b[..., 16:48].astype(np.int64)[:, :, None, None, :]
            q = q | (((qh >> (2 * np.arange(4)[:, None, None] + np.arange(2)[:, None])) & 1) << 4)
        q = q.reshape(R, K)
        return q, sc, m, half(b, 0), half(b, 2)
    b = w.reshape(R, K // 256, 210)
    ql, qh = b[..., :128].astype(np.int64).reshape(R, -1, 2, 64), b[..., 128:192].astype(np.int64).reshape(R, -1, 2, 32)
    lo = np.concatenate([ql & 15, ql >> 4], axis=-1)  # [R, nsb, half, 128]
    hb = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    q = (lo | (hb << 4)) - 32
    return q.reshape(R, K), b[..., 192:208].view(np.int8).astype(np.int64), half(b, 208)


def twin(qtype, w, x):
    """The int8 product of weight rows ``w`` and activation rows ``x`` [T, K], in numpy, with the
    kernels' rule (qkernels.py's int8 section): exact integer lane sums, then float32 operations."""
    T, K = x.shape
    R = w.shape[0]
    if qtype in PER32:
        q, dw, *mins = decode(qtype, w, K)
        x8, dx = quantize(x, 32)
        nb = K // 32
        c = np.einsum("rbli,tbli->rtbl", q.reshape(R, nb // 2, 16, 4), x8.reshape(T, nb // 2, 16, 4))
        scale = (dw.reshape(R, 1, nb // 2, 2, 1) * dx.reshape(1, T, nb // 2, 2, 1)).astype(F32)
        scale = np.broadcast_to(scale, (R, T, nb // 2, 2, 8)).reshape(R, T, nb // 2, 16)
        acc = np.zeros((R, T, 16), F32)
        for b in range(nb // 2):
            acc = fma32(scale[:, :, b], c[:, :, b].astype(F32), acc)
        if not mins:
            return lane_sum(acc).T
        bx = (dx * x8.reshape(T, nb, 32).sum(axis=2).astype(F32)).astype(F32)  # [T, nb]
        mn = np.zeros((R, T, 8), F32)
        for b in range(nb // 2):  # lanes 0, 1: the pair's two blocks
            mn[:, :, :2] = fma32(mins[0][:, None, 2 * b:2 * b + 2], bx[None, :, 2 * b:2 * b + 2], mn[:, :, :2])
        return (lane_sum(acc) + lane_sum(mn)).astype(F32).T
    nsb = K // 256
    x8, dx = quantize(x, 256)
    dots = np.einsum("rbkli,tbkli->rtbkl", 0 + decode(qtype, w, K)[0].reshape(R, nsb, 4, 16, 4),
                     x8.reshape(T, nsb, 4, 16, 4))  # [R, T, nsb, k, lane]
    lanes = np.arange(16)
    if qtype in (QT.Q4_K, QT.Q5_K):
        _, sc, m, d, dmin = decode(qtype, w, K)
        scl = sc[:, :, 2 * np.arange(4)[:, None] + lanes[None, :] // 8]  # [R, nsb, k, lane]
    else:
        _, sc, d = decode(qtype, w, K)
        scl = sc[:, :, 4 * np.arange(4)[:, None] + lanes[None, :] // 4]
    ints = (dots * scl[:, None]).sum(axis=3)  # [R, T, nsb, lane]
    assert np.abs(ints).max() < 2**24  # exact in float32
    acc = np.zeros((R, T, 16), F32)
    for b in range(nsb):
        D = (dx[None, :, b] * d[:, None, b]).astype(F32)[..., None]
        acc = fma32(D, ints[:, :, b].astype(F32), acc)
    out = lane_sum(acc)
    if qtype in (QT.Q4_K, QT.Q5_K):
        sums = x8.reshape(T, nsb, 8, 32).sum(axis=3)
        bx = (dx[..., None] * sums.astype(F32)).astype(F32)  # [T, nsb, 8]
        mw = (-(dmin[..., None] * m.astype(F32))).astype(F32)  # [R, nsb, 8]
        mn = np.zeros((R, T, 8), F32)
        for b in range(nsb):
            mn = fma32(mw[:, None, b], bx[None, :, b], mn)
        out = (out + lane_sum(mn)).astype(F32)
    return out.T


@functools.cache
def form_rows(kind, form):
    """Kind's int8 rows kernel in ``form`` (qkernels.I8_FORMS), compiled beside the machine's
    (the machine's own where it is that form)."""
    k = quant._kernels()
    return k._I8_ROWS[kind] if form == k.I8_FORM else k._i8_rows_kernel(kind, form)


def weights(qtype, rows, cols, seed):
    raw = encoded(qtype, rows, cols, seed).copy()
    raw.flags.writeable = False
    return raw


# ---- tests ------------------------------------------------------------------------------------
def test_fma32_rounds_once():
    """The twin's fma: an exact case, and one where rounding the float64 sum to float32 (two
    roundings) differs from one rounding: a·b = 2¹⁶ - 2⁻³⁰ lands the sum 2⁻³⁰ below a float32
    midpoint, which float64 cannot hold (a tie, broken to even: 2⁴⁰ + 2¹⁸)."""
    assert fma32(F32(3), F32(5), F32(1)) == F32(16)
    a, b, c = F32(2**8 * (1 + 2**-23)), F32(2**8 * (1 - 2**-23)), F32(2**40 + 2**17)
    assert F32(F64(a) * F64(b) + F64(c)) == F32(2**40 + 2**18)
    assert fma32(a, b, c) == c


@pytest.mark.parametrize("qtype", list(KINDS), ids=lambda q: q.name)
def test_twin_decodes_gguf_values(qtype):
    """The twin's integer weights and scales give gguf's dequantized values (float32 rounding)."""
    K = 512
    w = weights(qtype, 5, K, 1)
    want = gguf.quants.dequantize(w, qtype).astype(F64)
    parts = decode(qtype, w, K)
    if qtype in PER32:
        got = parts[0] * np.repeat(parts[1], 32, axis=1) + (np.repeat(parts[2], 32, axis=1) if len(parts) > 2 else 0)
    elif qtype in (QT.Q4_K, QT.Q5_K):
        q, sc, m, d, dmin = parts
        got = q * np.repeat(d[..., None] * sc, 32, axis=-1).reshape(5, K) \
            - np.repeat(dmin[..., None] * m, 32, axis=-1).reshape(5, K)
    else:
        q, sc, d = parts
        got = q * np.repeat(d[..., None] * sc, 16, axis=-1).reshape(5, K)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.slow  # compiles every other form that compiles here, for each T: 20-30 s a kind on 2 cores
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("qtype", list(KINDS), ids=lambda q: q.name)
def test_int8_kernels_give_the_twins_bits(qtype, T):
    """Every tile shape (T = 1 … 9, an odd row count, ranges starting at odd rows), the kernel
    compiled for this machine and every other form that compiles here (AVX2's instructions, plain
    vector arithmetic as NEON's, the portable loops): the twin's bits; the result within the
    quantization's error of the float64 product."""
    K, R = 3 * 256 if qtype not in PER32 else 4 * 64, 23
    w = weights(qtype, R, K, 3 + T)
    x = np.random.default_rng(T).standard_normal((T, K), dtype=F32)
    x[0, :40] = 0.0  # an all-zero activation block (scale 0)
    k = quant._kernels()
    kind = KINDS[qtype]
    xq = np.zeros((T, k.int8_row_bytes(kind, K)), np.uint8)
    k.quantize(kind, x, xq)
    xq.flags.writeable = False
    want = twin(qtype, w, x)
    got = np.full((T, R), np.nan, F32)
    k.matmul_int8(kind, w, xq, got, 0, 5)
    k.matmul_int8(kind, w, xq, got, 5, R)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for form in (f for f in k.I8_FORMS_HERE if f != k.I8_FORM):  # the machine's form above
        other = np.full((T, R), np.nan, F32)
        form_rows(kind, form)(w, xq, other, 0, R)
        np.testing.assert_array_equal(other.view(np.uint32), want.view(np.uint32), err_msg=form)
    ref = x.astype(F64) @ gguf.quants.dequantize(w, qtype).astype(F64).T
    assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()


def test_a_chosen_int8_form_is_checked_and_kept_apart_in_the_cache():
    """``COLIBRI_SWARM_INT8_FORM`` names a form that compiles here or the import is refused with
    the forms that do; each value has its own numba cache folder (the tiles compiled in differ)."""
    def run(value, code):
        env = {**os.environ, "COLIBRI_SWARM_INT8_FORM": value}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    k = quant._kernels()
    bad = run("vnni512", "import swarm.compute.qkernels")
    assert bad.returncode != 0
    assert "COLIBRI_SWARM_INT8_FORM='vnni512'" in bad.stderr and ", ".join(k.I8_FORMS_HERE) in bad.stderr
    show = "import swarm.compute.qkernels as k, swarm.compute.quant as q; print(k.I8_FORM, q._numba_cache_dir())"
    folders = set()
    for form in k.I8_FORMS_HERE:
        done = run(form, show)
        assert done.returncode == 0, done.stderr
        got, folder = done.stdout.split()
        assert got == form
        folders.add(folder)
    assert len(folders) == len(k.I8_FORMS_HERE)



@pytest.mark.parametrize("setting, avx2", [
    ({"NUMBA_ENABLE_AVX": "0"}, False),  # numba leaves AVX out: AVX2 code would not compile
    ({"NUMBA_CPU_NAME": "generic"}, False),  # a portable cache: no CPU's features
    ({"NUMBA_CPU_FEATURES": "+avx2,+fma"}, True),  # as named, whatever the host has
    ({"NUMBA_CPU_FEATURES": "+sse4.2"}, False),
])
def test_the_forms_follow_the_cpu_features_numba_compiles_for(setting, avx2):
    """The vector forms and tile shapes are chosen from the features numba compiles the kernels
    for, not the host's alone: a CPU numba is told to treat as without AVX takes the plain vector
    forms, and a chosen AVX2 or VNNI form is refused there (LLVM could not compile its
    instructions); without AVX-512, float32 K-quant tiles of one weight row, and decode tiles of
    two for float32 weights and 4/5-bit blocks of 32."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CPU", "NUMBA_ENABLE_AVX",
                                                                     "COLIBRI_SWARM_INT8_FORM"))}
    show = ("import swarm.compute.qkernels as k; tiles = lambda t: ','.join(f'{a}x{b}' for a, b in t); "
            "print(k.AVX512, k.AVX2, k.VNNI, k.I8_FORM, k.K_FORM, tiles(k._K_TILES), tiles(k._D2_TILES), *k.I8_FORMS_HERE)")
    done = subprocess.run([sys.executable, "-c", show], env={**env, **setting}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    avx512, has_avx2, vnni, form, kform, k_tiles, d2_tiles, *here = done.stdout.split()
    assert (avx512, has_avx2, vnni) == ("False", str(avx2), "False")
    assert (form, kform, k_tiles, d2_tiles) == ("avx2" if avx2 else "vector", "vector", "1x1,1x4,1x2,1x1",
                                               "2x1,2x4,2x2,2x1")
    assert here == (["avx2"] if avx2 else []) + ["vector", "portable"]
    for chosen in ("vnni",) if avx2 else ("vnni", "avx2"):
        refused = subprocess.run([sys.executable, "-c", "import swarm.compute.qkernels"], capture_output=True,
                                 text=True, env={**env, **setting, "COLIBRI_SWARM_INT8_FORM": chosen}, timeout=120)
        assert refused.returncode != 0 and f"COLIBRI_SWARM_INT8_FORM={chosen!r}" in refused.stderr


@pytest.mark.slow  # compiles fifteen kernels: ~1.5 min on 2 cores
@pytest.mark.parametrize("numerics_name, qtype", [("float32", QT.Q4_K), ("float32", QT.Q4_1), ("float32", QT.F16),
                                                  ("int8", QT.Q6_K), ("int8", QT.Q8_0)], ids=lambda v: getattr(v, "name", v))
def test_both_tile_tables_give_the_same_bits(numerics_name, qtype):
    """Every tile table gives the same bits at T = 1, 3, 5, 6 and 8 (every tile shape: 4, 3, 2 and
    1 activation rows), over ragged row ranges, for float32 blocks of 32, K-quants and F16 and
    int8 ones: AVX-512's (4 × 1 decode, then 2 weight rows a tile), and without it the float32
    K-quants' (1 weight row a tile) and the float32 weights' and 4/5-bit blocks of 32's (2 × 1
    decode). Peers on CPUs of either kind, checked bit for bit against each other, compute the
    same rows."""
    k = quant._kernels()
    tables = k._TILES, k._K_TILES_NO_AVX512, k._D2_TILES_NO_AVX512  # the product's tables, whatever this CPU
    f32_kind = {QT.Q4_K: 5, QT.Q4_1: 2}  # qkernels' float32 kind numbers

    def build(table):
        if qtype == QT.F16:
            return k._f32_rows_kernel("_h2f", table)
        if numerics_name == "float32":
            return k._rows_kernel(f32_kind[qtype], "", table)
        return k._i8_rows_kernel(KINDS[qtype], "", table)
    fns = [build(table) for table in tables]
    R, K = 13, 512
    if qtype == QT.F16:
        w = np.random.default_rng(0).standard_normal((R, K)).astype(np.float16).view(np.uint16)
    else:
        w = weights(qtype, R, K, 7)
    for T in (1, 3, 5, 6, 8):
        x = np.random.default_rng(T).standard_normal((T, K), dtype=F32)
        if numerics_name == "int8":
            kind = KINDS[qtype]
            x = np.zeros((T, k.int8_row_bytes(kind, K)), np.uint8)
            k.quantize(kind, np.random.default_rng(T).standard_normal((T, K), dtype=F32), x)
        outs = []
        for fn in fns:
            out = np.full((T, R), np.nan, F32)
            for lo, hi in ((0, 5), (5, 6), (6, R)):
                if qtype == QT.F16:
                    fn(w, x, out, 0, lo, hi)
                else:
                    fn(w, x, out, lo, hi)
            assert np.isfinite(out).all()
            outs.append(out)
        for table, out in zip(tables[1:], outs[1:]):
            np.testing.assert_array_equal(outs[0].view(np.uint32), out.view(np.uint32), err_msg=f"T = {T}, {table}")


@pytest.fixture
def int8():
    """The process's numerics set to int8 for the test, float32 again after it."""
    numerics.set_numerics("int8")
    yield
    numerics.set_numerics("float32")


@pytest.mark.parametrize("qtype", list(KINDS), ids=lambda q: q.name)
def test_int8_products_do_not_depend_on_t_rows_or_threads(qtype, int8):
    """Through QMatrix under the numerics int8 (the group path, the one-thread path, T past
    SMALL_T): each row the twin's bits, whether computed in one call of 70 rows, as rows 0:3 or
    1:4, alone, or beside other products (matmul_many) on 1, 2, 3 and 8 threads."""
    K = 2 * 256
    m = QMatrix(weights(qtype, 45, K, 11), qtype, K)
    other = QMatrix(weights(qtype, 19, K, 12), qtype, K)
    x = np.random.default_rng(5).standard_normal((quant.SMALL_T + 6, K), dtype=F32)
    want = twin(qtype, m.data, x)
    saved = threads.threads()
    try:
        for n in (1, 2, 3, 8):
            threads.set_threads(n)
            np.testing.assert_array_equal(m.matmul(x).view(np.uint32), want.view(np.uint32), err_msg=f"threads={n}")
            for a, b in ((0, 3), (1, 4), (7, 8)):
                got, _ = quant.matmul_many([(m, x[a:b], None), (other, x[:5], None)])
                np.testing.assert_array_equal(got.view(np.uint32), want[a:b].view(np.uint32), err_msg=f"{n} {a}:{b}")
    finally:
        threads.set_threads(saved)


@pytest.mark.parametrize("qtype", list(KINDS), ids=lambda q: q.name)
def test_int8_rows_made_here_and_multiplied_later_give_matmuls_bits(qtype, int8):
    """``int8_rows`` quantizes as the twin does (values, scales, Q4_1/Q5_1/Q4_K/Q5_K's d·Σq per
    32, zero padding to 64 bytes), and ``matmul_int8_rows`` on those rows — copied, as from
    another machine — gives ``matmul``'s bits under the int8 numerics; wrong rows are refused."""
    K = 2 * 256
    m = QMatrix(weights(qtype, 23, K, 13), qtype, K)
    x = np.random.default_rng(6).standard_normal((3, K), dtype=F32)
    x[1, 64:128] = 0.0  # all-zero blocks: scale 0, values 0
    rows = m.int8_rows(x)
    block = 32 if qtype in PER32 else 256
    q, d = quantize(x, block)
    assert rows.dtype == np.uint8 and rows.shape[1] % 64 == 0
    np.testing.assert_array_equal(rows[:, :K].view(np.int8).astype(np.int64), q)
    np.testing.assert_array_equal(rows[:, K:K + 4 * (K // block)].view(F32), d)
    used = K + 4 * (K // block)
    if qtype in (QT.Q4_1, QT.Q5_1, QT.Q4_K, QT.Q5_K):  # d·Σq per 32 values, d the value's block's
        sums = (np.repeat(d, block // 32, axis=1) * q.reshape(3, K // 32, 32).sum(axis=2).astype(F32)).astype(F32)
        np.testing.assert_array_equal(rows[:, used:used + 4 * (K // 32)].view(F32), sums)
        used += 4 * (K // 32)
    assert not rows[:, used:].any()
    got = m.matmul_int8_rows(rows.copy())
    np.testing.assert_array_equal(got.view(np.uint32), m.matmul(x).view(np.uint32))
    with pytest.raises(ValueError, match="int8 rows must be uint8"):
        m.matmul_int8_rows(rows[:, :-64])
    f16 = QMatrix(np.zeros((2, 2 * K), np.uint8), QT.F16, K)
    with pytest.raises(ValueError, match="no int8 product"):
        f16.int8_rows(x)


def test_types_without_an_int8_kernel_keep_float32(int8):
    """MXFP4 and Q2_K rows, and Q8_0 rows of 96 values (not a multiple of 64), under int8: the
    float32 bits."""
    for qtype, K in ((QT.MXFP4, 256), (QT.Q2_K, 256), (QT.Q8_0, 96)):
        m = QMatrix(weights(qtype, 9, K, 2), qtype, K)
        x = np.random.default_rng(1).standard_normal((3, K), dtype=F32)
        got = m.matmul(x)
        numerics.set_numerics("float32")
        np.testing.assert_array_equal(got, m.matmul(x))
        numerics.set_numerics("int8")


def test_numerics_setting_is_checked(monkeypatch):
    """A bad name names the setting and the choices; the environment is read when unset."""
    with pytest.raises(ValueError, match="float32, int8"):
        numerics.set_numerics("int4")
    monkeypatch.setenv(numerics.NUMERICS_ENV, "int8")
    assert numerics.set_numerics(None) == "int8" and numerics.int8()
    monkeypatch.setenv(numerics.NUMERICS_ENV, "fp8")
    with pytest.raises(ValueError, match="COLIBRI_SWARM_NUMERICS"):
        numerics.set_numerics(None)
    monkeypatch.delenv(numerics.NUMERICS_ENV)
    assert numerics.set_numerics(None) == "float32" and not numerics.int8()


# A small dense Qwen3 of random blocks (bench/random_gguf.py) in Q4_K, Q6_K and Q8_0.
def _mix(name, layer, n_layers):
    if name == "output.weight" or ".attn_v." in name or ".ffn_down" in name:
        return QT.Q6_K
    return QT.Q8_0 if ".attn_" in name else QT.Q4_K


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from bench.random_gguf import MoEShape, write_qwen3moe
    from swarm.compute.model import load_model

    path = tmp_path_factory.mktemp("int8") / "dense.gguf"
    shape = MoEShape(layers=2, hidden=256, experts=0, top_k=0, expert_ffn=512, heads=4, kv_heads=2, head_dim=64)
    write_qwen3moe(path, shape, mix=_mix, name="random dense Qwen3 (int8 test)")
    return load_model(str(path))


# Logits of the two numerics apart, of the float32 run's largest |logit|: measured 1.5-1.8e-2 on
# this model (random blocks, 2 layers, every matrix Q4_K, Q6_K or Q8_0), whose top two
# logits are 0.9-11 % of it apart: the greedy tokens agree at every position.
LOGIT_RTOL = 0.05


def test_whole_model_under_int8(small_model):
    """Prompts through the whole model: under int8 the logits are the same bits at 1 and 3 threads
    and for the prompt in one call or token by token (prefill and decode alike); against the
    float32 run, within LOGIT_RTOL of its largest logit and the same greedy token at every
    position (the weights are seeded: the same bits on every machine)."""
    model = small_model
    saved = threads.threads()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [100, 2000, 30000, 5, 9], [42] * 6]
    try:
        for tokens in prompts:
            numerics.set_numerics("float32")
            threads.set_threads(1)
            ref = model.forward(tokens, model.new_cache())
            numerics.set_numerics("int8")
            runs = []
            for n in (1, 3):
                threads.set_threads(n)
                runs.append(model.forward(tokens, model.new_cache()))
            cache = model.new_cache()
            runs.append(np.concatenate([model.forward([t], cache) for t in tokens]))
            for r in runs[1:]:
                np.testing.assert_array_equal(r.view(np.uint32), runs[0].view(np.uint32))
            got = runs[0]
            scale = np.abs(ref).max()
            assert np.abs(got - ref).max() <= LOGIT_RTOL * scale
            assert np.abs(got - ref).max() > 0  # the numerics did change
            assert got.argmax(axis=1).tolist() == ref.argmax(axis=1).tolist()
    finally:
        numerics.set_numerics("float32")
        threads.set_threads(saved)
