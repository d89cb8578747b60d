"""The int8-activation GEMV candidate (web_peer/int8_activations.py: quantize_x8.wgsl, gemv_x8.wgsl
with x8_q4_k.wgsl or x8_q8_0.wgsl) on lavapipe through wgpu, against its numpy twin, and against
float64 of the dequantized weights times the dequantized int8 activations (an oracle that shares
no code with the twin's integer sums)."""

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


def _f64(w, q, xs):
    """y = dequantized W (float64) @ dequantized int8 rows q * dx (float64): [T, R]."""
    x8 = q.astype(np.float64) * np.repeat(xs[..., 0].astype(np.float64), X8.QX, axis=1)
    return x8 @ K.unpack_matrix(w.matrix.packed).astype(np.float64).T


def test_quantize_kernel_matches_its_twin(new_gpu):
    gpu = new_gpu()
    rng = np.random.default_rng(40)
    x = (rng.standard_normal((3, 512)) * rng.uniform(1e-3, 1e3, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: dx = s = 0, q = 0
    x[2, 100] = 200.0  # an outlier: its block's other values round to few levels
    w = gpu.upload_linear(K.random_blocks(rng, 5, 512, "q8_0"), "q8_0")
    _, q, xs = X8.X8Gemv(gpu).run(w, x)
    qt, xst = X8.quantize_x8(x)
    # x / dx may round differently by one unit in the last place on a GPU (WGSL allows 2.5 ulp):
    # then q differs by one where x / dx sits on a half. On lavapipe it has been exact.
    assert np.abs(q.astype(np.int16) - qt).max() <= 1 and (q != qt).mean() <= 1e-3
    assert np.allclose(xs, xst, rtol=2.0 ** -22, atol=0)
    assert (q[1, 32:64] == 0).all() and (xs[1, 1] == 0).all()
    assert np.abs(q.astype(np.int16)).reshape(-1, 32).max(axis=1).tolist() == [0 if i == 17 else 127 for i in range(48)]
    s = xs[..., 0] * q.reshape(3, 16, 32).astype(np.int64).sum(axis=-1).astype(np.float32)
    assert np.array_equal(xs[..., 1], s)
    assert np.abs(q * np.repeat(xs[..., 0], 32, axis=1) - x).max() <= 0.5001 * xs[..., 0].max()


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"wg{s[0]}-lanes{s[1]}-{'subgroup' if s[2] else 'shared'}")
def test_gemv_matches_twin_and_float64(new_gpu, fmt, split):
    # 37 rows (not a multiple of the rows a workgroup), K 512 (two Q4_K super-blocks, 8 steps a
    # row), T = 1 (decode) and 3 (workgroups along z).
    wg_size, lanes, subgroups = split
    gpu = new_gpu(workgroup_size=wg_size, lanes=lanes, subgroups=subgroups)
    rng = np.random.default_rng(41)
    w = gpu.upload_linear(K.random_blocks(rng, 37, 512, fmt, 2e-3), fmt)
    gemv = X8.X8Gemv(gpu)
    for t in (1, 3):
        x = rng.standard_normal((t, 512)).astype(np.float32)
        y, q, xs = gemv.run(w, x)
        assert y.shape == (t, 37) and y.dtype == np.float32
        twin = X8.gemv_x8(w.matrix.packed, q, xs, lanes)
        assert (np.abs(y - twin) <= X8.twin_bound(w.matrix.packed, q, xs, lanes)).all()
        assert rel_error(y, _f64(w, q, xs)) <= 1e-5  # the int8 rows, dequantized: only f32 rounding
        ref = x.astype(np.float64) @ K.unpack_matrix(w.matrix.packed).astype(np.float64).T
        assert 1e-4 <= rel_error(y, ref) <= 2e-2  # the activations' int8 rounding, llama.cpp's own


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
def test_gemv_over_parts(new_gpu, fmt):
    # A small binding limit cuts the matrix into parts: each dispatch writes its own rows.
    gpu = new_gpu(max_binding=2048)
    rng = np.random.default_rng(42)
    w = gpu.upload_linear(K.random_blocks(rng, 45, 256, fmt, 2e-3), fmt)
    assert len(w.matrix.packed.parts) > 2
    y, q, xs = X8.X8Gemv(gpu).run(w, rng.standard_normal((2, 256)).astype(np.float32))
    twin = X8.gemv_x8(w.matrix.packed, q, xs, gpu.lanes)
    assert (np.abs(y - twin) <= X8.twin_bound(w.matrix.packed, q, xs, gpu.lanes)).all()
    assert rel_error(y, _f64(w, q, xs)) <= 1e-5


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
@pytest.mark.parametrize("split", SPLITS[1:], ids=lambda s: f"wg{s[0]}-lanes{s[1]}-{'subgroup' if s[2] else 'shared'}")
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
    one, q, xs = X8.X8Gemv(gpu).run(w, x)
    assert (np.abs(one - X8.gemv_x8(w.matrix.packed, q, xs, lanes)) <= X8.twin_bound(w.matrix.packed, q, xs, lanes)).all()
    for rows in (2, 4, 8):
        y, q2, _ = X8.X8Gemv(gpu, rows_per_thread=rows).run(w, x)
        assert np.array_equal(q2, q) and np.array_equal(y, one), rows


def test_other_formats_and_shapes_are_refused(new_gpu):
    gpu = new_gpu()
    rng = np.random.default_rng(43)
    gemv = X8.X8Gemv(gpu)
    with pytest.raises(KernelError, match="no int8-activation GEMV"):
        gemv.run(gpu.upload_linear(K.random_blocks(rng, 4, 256, "q6_k"), "q6_k"), np.zeros((1, 256), np.float32))
    with pytest.raises(KernelError, match="columns"):
        gemv.run(gpu.upload_linear(K.random_blocks(rng, 4, 256, "q4_k"), "q4_k"), np.zeros((1, 512), np.float32))
    with pytest.raises(KernelError, match="multiple of 32"):
        X8.quantize_x8(np.zeros((1, 40), np.float32))
    with pytest.raises(KernelError, match="rows_per_thread"):
        X8.X8Gemv(gpu, rows_per_thread=3)
