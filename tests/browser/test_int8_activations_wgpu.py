"""The int8-activation GEMVs (web_peer/int8_activations.py: gemv_x8.wgsl with x8_q4_k.wgsl,
x8_q6_k.wgsl or x8_q8_0.wgsl) on lavapipe through wgpu, on the CPU's own int8 rows: against the
CPU's int8 kernel within :func:`cpu_bound`, and against float64 of the dequantized weights times
the dequantized int8 rows (an oracle that shares no code with either side's integer sums)."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.errors import KernelError
from tests.browser.conftest import rel_error
from tests.browser.test_kernels_wgpu import new_gpu  # noqa: F401  (a fixture: a fresh host per call)
from web_peer import int8_activations as X8
from web_peer import kernels as K

pytestmark = pytest.mark.browser

# (workgroup size, lanes, subgroups): one row a workgroup (lavapipe's default, 8 lanes); 4 rows of
# 2 lanes (a lane adds several steps; 37 rows leave the last workgroup 3 slices short); 8 rows of
# 4 lanes reduced through subgroup shuffles.
SPLITS = [(8, 8, False), (8, 2, False), (32, 4, True)]
SPLIT_IDS = lambda s: f"wg{s[0]}-lanes{s[1]}-{'subgroup' if s[2] else 'shared'}"  # noqa: E731


def _f64(w, rows):
    """y = dequantized W (float64) @ the dequantized int8 rows q·dx (float64): [T, R]."""
    q, dx, _ = X8.planes(w.fmt, rows, w.cols)
    x8 = q.astype(np.float64) * np.repeat(dx.astype(np.float64), w.cols // dx.shape[1], axis=1)
    return x8 @ K.unpack_matrix(w.matrix.packed)[:w.rows].astype(np.float64).T


def _check(gpu, w, x, lanes):
    """The GPU's answer: within the bound of the CPU's int8 answer, which lies far inside it of
    float64 on the same int8 rows; returns (y, rows)."""
    y, rows = X8.X8Gemv(gpu).run(w, x)
    assert y.shape == (x.shape[0], w.rows) and y.dtype == np.float32
    cpu = X8.cpu_product(w.matrix.packed, rows)
    bound = X8.cpu_bound(w.matrix.packed, rows, lanes)
    assert (np.abs(y.astype(np.float64) - cpu) <= bound).all()
    assert bound.max() <= 1e-4 * np.abs(cpu).max()  # a bound of float32 sums, two orders below int8's rounding
    assert rel_error(y, _f64(w, rows)) <= 1e-5
    return y, rows


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
@pytest.mark.parametrize("split", SPLITS, ids=SPLIT_IDS)
def test_gemv_lands_within_its_bound_of_the_cpus_int8_answer(new_gpu, fmt, split):
    # 37 rows (not a multiple of the rows a workgroup), K 512 (two super-blocks: 8 Q4_K steps a
    # row, 16 Q6_K, 16 Q8_0), T = 1 (decode) and 3 (workgroups along z); activations of wide range.
    wg_size, lanes, subgroups = split
    gpu = new_gpu(workgroup_size=wg_size, lanes=lanes, subgroups=subgroups)
    rng = np.random.default_rng(41)
    w = gpu.upload_linear(K.random_blocks(rng, 37, 512, fmt, 2e-3), fmt)
    for t in (1, 3):
        x = (rng.standard_normal((t, 512)) * rng.uniform(1e-2, 1e2, (t, 1))).astype(np.float32)
        x[:, 256:288] = 0.0  # an all-zero stretch: a Q8_0 block of dx = 0, a Q4_K sub-block's sums 0
        y, rows = _check(gpu, w, x, lanes)
        ref = x.astype(np.float64) @ K.unpack_matrix(w.matrix.packed)[:37].astype(np.float64).T
        assert 1e-4 <= rel_error(y, ref) <= 5e-2  # the activations' int8 rounding, llama.cpp's own


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
def test_the_bound_stops_an_answer_missing_one_step(new_gpu, fmt):
    # An answer that leaves out 32 of a row's 512 products (a dropped step) lands outside the
    # bound on every row, while the GPU's lands inside: the bound is not vacuous.
    gpu = new_gpu()
    rng = np.random.default_rng(45)
    w = gpu.upload_linear(K.random_blocks(rng, 16, 512, fmt, 2e-3), fmt)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    y, rows = _check(gpu, w, x, gpu.lanes)
    short = rows.copy()
    short[:, 288:320] = 0  # 32 int8 activations (Q8_0: a block; Q6_K: a step; Q4_K: a sub-block, half a step)
    wrong = X8.cpu_product(w.matrix.packed, short)
    bound = X8.cpu_bound(w.matrix.packed, rows, gpu.lanes)
    assert (np.abs(wrong - y.astype(np.float64)) > bound).all()


@pytest.mark.parametrize("fmt,fields", [("q4_k", (0,)), ("q4_k", (2,)), ("q4_k", (0, 2)), ("q6_k", (208,)),
                                        ("q8_0", (0,))], ids=lambda v: str(v))
def test_subnormal_f16_scales_are_computed_exactly(new_gpu, fmt, fields):
    # llama.cpp's Q6_K d (about max |w| / 4096) is an f16 subnormal in most blocks of a real file:
    # every block's d (and/or Q4_K's dmin) here is one, of the file's usual size; the GPU decodes
    # them from their bits, so its answer lies within the bound of the CPU's, which stays as tight
    # as with normal scales (nothing of it for a flushed scale).
    gpu = new_gpu()
    rng = np.random.default_rng(47)
    size = K.block_size(fmt)[1]
    raw = K.random_blocks(rng, 16, 512, fmt, 2e-3).reshape(16, -1, size)
    for at in fields:
        sub = rng.uniform(1e-6, 6e-5, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2]) if at != 2 else \
            rng.uniform(1e-6, 6e-5, raw.shape[:2])
        raw[..., at:at + 2] = sub.astype("<f2")[..., None].view(np.uint8)
        assert (np.abs(raw[..., at:at + 2].copy().view("<f2")) < np.finfo(np.float16).tiny).all()
    w = gpu.upload_linear(raw.reshape(16, -1), fmt)
    x = np.abs(rng.standard_normal((2, 512))).astype(np.float32)  # Q4_K's minimum terms: large dx·Σq
    y, rows = _check(gpu, w, x, gpu.lanes)
    total, sub = X8._magnitudes(fmt, K.file_blocks(w.matrix.packed)[:16], *X8.planes(fmt, rows, 512))
    assert (sub == 0).all() and np.abs(y).max() > 0


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
def test_the_bound_covers_a_gpu_that_flushes_subnormal_activation_scales(fmt):
    # Activations near 10⁻³⁶ make the rows' float32 dx (and d·dx, Q4_K's dx·Σq) subnormal, which
    # a GPU may read as 0: the CPU's answer with those scales 0 lies within the bound of its answer
    # with them, and would not without the bound's subnormal part.
    rng = np.random.default_rng(48)
    m = K.pack_matrix(K.random_blocks(rng, 8, 512, fmt, 0.5), fmt, 1 << 27)  # answers above the 2⁻¹²⁶ terms
    x = rng.standard_normal((2, 512)).astype(np.float32) * np.float32(3e-37)  # dx = amax / 127 < 2⁻¹²⁶
    rows = X8.int8_rows(fmt, x)
    flushed = rows.copy()
    f = flushed[:, 512:].view(np.float32)
    f[X8._subnormal(f)] = 0
    assert (flushed != rows).any()
    diff = np.abs(X8.cpu_product(m, flushed) - X8.cpu_product(m, rows))
    bound = X8.cpu_bound(m, rows, 8)
    _, sub = X8._magnitudes(fmt, K.file_blocks(m)[:8], *X8.planes(fmt, rows, 512))
    assert (diff <= bound).all() and (diff > bound - sub).any()


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
def test_gemv_over_parts(new_gpu, fmt):
    # A small binding limit cuts the matrix into parts: each dispatch writes its own rows.
    gpu = new_gpu(max_binding=2048)
    rng = np.random.default_rng(42)
    w = gpu.upload_linear(K.random_blocks(rng, 45, 256, fmt, 2e-3), fmt)
    assert len(w.matrix.packed.parts) > 2
    _check(gpu, w, rng.standard_normal((2, 256)).astype(np.float32), gpu.lanes)


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
@pytest.mark.parametrize("split", SPLITS[1:], ids=SPLIT_IDS)
def test_rows_a_thread_change_no_bit(new_gpu, fmt, split):
    # A thread computing 2, 4 or 8 adjacent weight rows from one load of a step's activations
    # (gemv_x8.wgsl's RT) gives every row the bits of one row a thread: 37 rows leave the last
    # slice of every count short, T = 3 spreads over z, and a small binding limit cuts the matrix
    # into parts of 9 rows each (none a multiple of 2, 4 or 8 rows a thread).
    wg_size, lanes, subgroups = split
    row_bytes = 512 // K.block_size(fmt)[0] * K._plane_bytes(fmt)[0]  # a row's quant plane
    gpu = new_gpu(workgroup_size=wg_size, lanes=lanes, subgroups=subgroups, max_binding=9 * row_bytes)
    rng = np.random.default_rng(44)
    w = gpu.upload_linear(K.random_blocks(rng, 37, 512, fmt, 2e-3), fmt)
    assert [r1 - r0 for r0, r1 in w.matrix.packed.parts][:4] == [9, 9, 9, 9]
    x = rng.standard_normal((3, 512)).astype(np.float32)
    one, rows = _check(gpu, w, x, lanes)
    for n in (2, 4, 8):
        y, rows_n = X8.X8Gemv(gpu, rows_per_thread=n).run(w, x)
        assert np.array_equal(rows_n, rows) and np.array_equal(y, one), n


def test_other_formats_and_shapes_are_refused(new_gpu):
    gpu = new_gpu()
    rng = np.random.default_rng(43)
    gemv = X8.X8Gemv(gpu)
    with pytest.raises(KernelError, match="no int8-activation GEMV"):
        gemv.run(gpu.upload_linear(K.random_blocks(rng, 4, 256, "q5_k"), "q5_k"), np.zeros((1, 256), np.float32))
    with pytest.raises(KernelError, match="columns"):
        gemv.run(gpu.upload_linear(K.random_blocks(rng, 4, 256, "q4_k"), "q4_k"), np.zeros((1, 512), np.float32))
    with pytest.raises(KernelError, match="int8 product"):  # the CPU's Q8_0 rows take pairs of blocks
        gemv.run(gpu.upload_linear(K.random_blocks(rng, 4, 96, "q8_0"), "q8_0"), np.zeros((1, 96), np.float32))
    with pytest.raises(KernelError, match="multiple of 256"):
        X8.int8_rows("q6_k", np.zeros((1, 320), np.float32))
    with pytest.raises(KernelError, match="rows_per_thread"):
        X8.X8Gemv(gpu, rows_per_thread=3)


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
def test_activation_rows_cut_to_the_binding_limit_change_no_bit(new_gpu, fmt):
    # A long prefill's outputs (T × R float32) exceeded maxStorageBufferBindingSize in one binding
    # (lavapipe: 1100 rows × 32768 → 144 MB > 128 MiB; the peer reset its device each time): the
    # rows are cut into blocks whose bindings fit the host's max_binding, with the bits of one
    # dispatch. A binding of 3 rows of the two products' outputs together (48 + 32 float32, more
    # than a row's 256 int8 values) cuts 7 rows into 3, 3, 1.
    rng = np.random.default_rng(46)
    whole, cut = new_gpu(), new_gpu(max_binding=3 * 4 * (48 + 32))
    blocks = {n: K.random_blocks(rng, n, 256, fmt, 2e-3) for n in (48, 32)}
    x = rng.standard_normal((7, 256)).astype(np.float32)
    rows = X8.int8_rows(fmt, x)
    answers = []
    for gpu in (whole, cut):
        ws = [gpu.upload_linear(blocks[n], fmt) for n in (48, 32)]
        gemv = X8.X8Gemv(gpu)
        answers.append((gemv.rows_per_block([(w, rows) for w in ws]), gemv.run_rows([(w, rows) for w in ws])))
    (n_whole, one), (n_cut, blocked) = answers
    assert n_whole >= 7 and n_cut == 3
    for a, b in zip(one, blocked):
        assert a.shape == b.shape and np.array_equal(a, b)
    assert np.array_equal(X8.X8Gemv(cut).run(cut.upload_linear(blocks[48], fmt), x)[0], one[0])


def test_a_prefill_whose_outputs_exceeded_the_adapters_binding_runs(new_gpu):
    # The review's case on lavapipe (max binding 128 MiB): Q8_0, H = 64, F = 32768, 1100 rows,
    # 144 MB of outputs; it raised "Buffer binding 5 range 144179200 exceeds ..." and reset the device.
    gpu = new_gpu()
    rng = np.random.default_rng(47)
    w = gpu.upload_linear(K.random_blocks(rng, 32768, 64, "q8_0", 2e-3), "q8_0")
    x = rng.standard_normal((1100, 64)).astype(np.float32)
    y, rows = X8.X8Gemv(gpu).run(w, x)
    assert y.shape == (1100, 32768) and np.isfinite(y).all()
    some = [0, 549, 1099]
    assert np.array_equal(y[some], X8.X8Gemv(gpu).run(w, x[some])[0])
