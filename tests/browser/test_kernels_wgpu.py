"""The WGSL kernels run natively through wgpu-py on Mesa lavapipe, against their numpy twins.

Oracles: the float32 twin in web_peer.kernels (same formats, same math) and float64 numpy.
Relative error = max |got - ref| / max |ref|.
"""

from __future__ import annotations

import numpy as np
import pytest

from swarm.errors import KernelError
from tests.browser.conftest import ffn_block, rel_error
from tests.conftest import require
from web_peer import kernels as K

pytestmark = pytest.mark.browser

SHAPES = [(1, 64, 128), (5, 70, 33), (13, 576, 1536)]  # (T rows, H hidden, F intermediate)


def _gpu(**kw):
    try:
        from web_peer.wgpu_host import WgpuFfn
    except ImportError as e:
        require(False, f"wgpu-py (pip install -e '.[test]'): {e}")
    try:
        return WgpuFfn(**kw)
    except KernelError as e:
        if "no WebGPU adapter" not in str(e):
            raise
        require(False, f"a Vulkan adapter for wgpu (apt install mesa-vulkan-drivers libvulkan1): {e}")


@pytest.fixture(scope="module")
def gpu():
    return _gpu()


def test_lavapipe_has_shader_f16(gpu):
    # The design relies on lavapipe to test the f16 path; without the feature that path is untested.
    assert gpu.has_f16, f"adapter {gpu.adapter.info['device']} lacks shader-f16"
    assert gpu.formats == ("f32", "f16", "q8")


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_expert_ffn_matches_twin(gpu, fmt, shape):
    rng = np.random.default_rng(hash((fmt, shape)) % 2**32)
    x, wg, wu, wd = ffn_block(rng, *shape)
    y = gpu.ffn(x, gpu.upload(wg, wu, wd, fmt))
    assert y.shape == (shape[0], shape[1]) and y.dtype == np.float32
    eff = [K.as_format(w, fmt) for w in (wg, wu, wd)]  # what the kernel multiplies by
    assert rel_error(y, K.expert_ffn(x, *eff)) <= 1e-5
    assert rel_error(y, K.expert_ffn_f64(x, *eff)) <= 1e-5
    # Against the original float32 weights: exact for f32, the format's rounding otherwise.
    assert rel_error(y, K.expert_ffn_f64(x, wg, wu, wd)) <= {"f32": 1e-5, "f16": 2e-3, "q8": 3e-2}[fmt]


def test_dense_ranges_sum_to_full_mlp(gpu):
    # A dense MLP cut into intermediate ranges: partials summed in range order = the full MLP.
    rng = np.random.default_rng(7)
    x, wg, wu, wd = ffn_block(rng, 3, 96, 250)
    cuts = [0, 37, 128, 250]  # uneven, not multiples of 4: the host pads each range
    total = np.zeros((3, 96), np.float32)
    for a, b in zip(cuts, cuts[1:]):
        part = gpu.ffn(x, gpu.upload(wg[a:b], wu[a:b], np.ascontiguousarray(wd[:, a:b]), "f32"))
        assert rel_error(part, K.dense_range(x, wg[a:b], wu[a:b], np.ascontiguousarray(wd[:, a:b]))) <= 1e-5
        total += part
    assert rel_error(total, K.expert_ffn_f64(x, wg, wu, wd)) <= 1e-5


@pytest.mark.parametrize("fmt", ["f32", "q8"])
def test_phone_limits_split_bindings(fmt):
    # A binding cap far below the adapter's forces weights and activations into many parts;
    # no buffer bound may exceed it, and the numbers must not change.
    cap = 16 << 10
    gpu = _gpu(max_binding=cap, workgroup_size=32)
    rng = np.random.default_rng(3)
    x, wg, wu, wd = ffn_block(rng, 11, 576, 700)
    w = gpu.upload(wg, wu, wd, fmt)
    assert len(w.gate.packed.parts) > 4 and len(w.down.packed.parts) > 1
    y = gpu.ffn(x, w)
    assert gpu.largest_binding <= cap
    eff = [K.as_format(m, fmt) for m in (wg, wu, wd)]
    assert rel_error(y, K.expert_ffn_f64(x, *eff)) <= 1e-5


def test_workgroup_size_override_within_limits():
    with pytest.raises(KernelError, match="power of two"):
        _gpu(workgroup_size=4096)
    gpu = _gpu(workgroup_size=256)
    rng = np.random.default_rng(4)
    x, wg, wu, wd = ffn_block(rng, 9, 128, 64)
    assert rel_error(gpu.ffn(x, gpu.upload(wg, wu, wd, "f32")), K.expert_ffn_f64(x, wg, wu, wd)) <= 1e-5


def test_row_larger_than_binding_is_refused():
    gpu = _gpu(max_binding=1024)
    w = np.zeros((4, 512), np.float32)  # one f32 row = 2048 bytes > 1024
    with pytest.raises(KernelError, match="maxStorageBufferBindingSize"):
        gpu.upload(w, w, np.zeros((512, 4), np.float32), "f32")


def test_bad_inputs_are_refused(gpu):
    rng = np.random.default_rng(5)
    x, wg, wu, wd = ffn_block(rng, 2, 32, 16)
    w = gpu.upload(wg, wu, wd, "f32")
    with pytest.raises(KernelError, match="columns"):
        gpu.ffn(x[:, :31].copy(), w)
    with pytest.raises(KernelError, match="float32"):
        gpu.ffn(x.astype(np.float64), w)
    x[1, 3] = np.nan
    with pytest.raises(KernelError, match="NaN"):
        gpu.ffn(x, w)
    with pytest.raises(KernelError, match="disagree"):
        gpu.upload(wg, wu, wd.T.copy(), "f32")
    with pytest.raises(KernelError, match="format"):
        gpu.upload(wg, wu, wd, "q4")


def test_lost_device_fails_the_request_then_recovers():
    gpu = _gpu()
    rng = np.random.default_rng(6)
    x, wg, wu, wd = ffn_block(rng, 4, 64, 48)
    w = gpu.upload(wg, wu, wd, "f32")
    gpu.device.destroy()  # the GPU goes away under a live request
    with pytest.raises(KernelError):
        gpu.ffn(x, w)
    with pytest.raises(KernelError, match="upload them again"):
        gpu.ffn(x, w)  # stale weights are never used on the fresh device
    w = gpu.upload(wg, wu, wd, "f32")
    assert rel_error(gpu.ffn(x, w), K.expert_ffn_f64(x, wg, wu, wd)) <= 1e-5


def test_q8_packing_round_trip():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((5, 10)).astype(np.float32)
    w[2] = 0  # an all-zero row gets scale 1, not a division by zero
    m = K.pack_matrix(w, "q8", 1 << 20, rows=8)
    assert (m.rows, m.cols, len(m.data)) == (8, 12, 96)
    back = K.unpack_matrix(m)
    assert np.array_equal(back[5:], np.zeros((3, 12), np.float32)) and np.all(back[:, 10:] == 0)
    assert np.abs(back[:5, :10] - w).max() <= np.abs(w).max(axis=1).max() / 127 / 2 + 1e-7
