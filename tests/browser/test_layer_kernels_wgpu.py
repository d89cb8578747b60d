"""A layer's other WGSL kernels — RMSNorm, RoPE, causal grouped-query attention — through wgpu-py
on lavapipe, against their numpy twins (web_peer/kernels.py), float64 numpy and the engine's own
kernels (swarm.compute.kernels), which a GPU stage must stay within float32 rounding of.
Relative error = max |got - ref| / max |ref|; u = 2⁻²⁴."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute import kernels as engine
from swarm.errors import KernelError
from tests.browser.conftest import rel_error
from web_peer import kernels as K

pytestmark = pytest.mark.browser

U = 2.0**-24


@pytest.fixture(scope="module")
def gpu():
    from web_peer.wgpu_host import WgpuFfn

    with WgpuFfn() as g:
        yield g


@pytest.mark.parametrize("T, D", [(1, 64), (5, 576), (3, 70)])
def test_rms_norm_is_the_engines_within_float32_rounding(gpu, T, D):
    rng = np.random.default_rng(D)
    x = rng.standard_normal((T, D), dtype=np.float32) * np.float32(3)
    w = rng.standard_normal(D, dtype=np.float32)
    x64 = x.astype(np.float64)
    exact = w * x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + 1e-5)
    for got in (K.rms_norm(x, w, 1e-5), gpu.rms_norm(x, w, 1e-5), engine.rms_norm(x, w, 1e-5)):
        assert got.shape == (T, D) and rel_error(got, exact) < 8 * np.sqrt(D) * U
    assert rel_error(gpu.rms_norm(x, w, 1e-5), engine.rms_norm(x, w, 1e-5)) < 8 * np.sqrt(D) * U


def test_rms_norm_of_each_head_takes_its_heads_weight(gpu):
    """Qwen3's norm of each query and key head: rows head after head, a weight row per head."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6, 24), dtype=np.float32)  # [T, heads, hd]
    w = rng.standard_normal((6, 24), dtype=np.float32)
    want = engine.rms_norm(x, w, 1e-6)  # the engine's: weight of x's trailing shape
    for got in (K.rms_norm(x.reshape(24, 24), w, 1e-6), gpu.rms_norm(x.reshape(24, 24), w, 1e-6)):
        assert rel_error(got.reshape(x.shape), want) < 8 * np.sqrt(24) * U


@pytest.mark.parametrize("T, n, hd", [(1, 3, 64), (6, 12, 64), (2, 5, 24)])
def test_rope_is_the_engines_rotation(gpu, T, n, hd):
    rng = np.random.default_rng(hd)
    x = rng.standard_normal((T, n, hd), dtype=np.float32)
    cos, sin = engine.rope_tables(np.arange(40, 40 + T), engine.rope_inv_freq(hd, 10000.0))
    scale = np.where(np.arange(n) < n - 1, np.float32(hd**-0.5), np.float32(1))[None, :, None]  # queries scaled
    c = np.ascontiguousarray(cos[:, None, :] * scale, np.float32)
    s = np.ascontiguousarray(engine.signed_sin(sin)[:, None, :] * scale, np.float32)
    want = engine.apply_rope_swapped(x, c, s)
    exact = engine.apply_rope(x.astype(np.float64), cos.astype(np.float64), sin.astype(np.float64)) * scale
    np.testing.assert_array_equal(K.rope(x, c, s), want)
    assert rel_error(gpu.rope(x, c, s), want) < 4 * U  # a fused multiply-add at most
    assert rel_error(want, exact) < 16 * U


@pytest.mark.parametrize("T, nh, nkv, hd, start, cap", [
    (1, 4, 2, 64, 0, 1), (1, 9, 3, 64, 130, 160), (5, 4, 4, 24, 0, 5), (7, 8, 2, 32, 33, 48)])
def test_attention_is_the_engines_within_float32_rounding(gpu, T, nh, nkv, hd, start, cap):
    """Causal (row t sees positions 0 .. start+t, never the cache past them), grouped-query (head h
    reads key/value head h // (nh / nkv)), over more positions than a workgroup has threads."""
    rng = np.random.default_rng(start + T)
    q = rng.standard_normal((T, nh, hd), dtype=np.float32) * np.float32(hd**-0.5)
    k, v = (rng.standard_normal((nkv, cap, hd), dtype=np.float32) for _ in range(2))
    k[:, start + T:] = v[:, start + T:] = 1e6  # past the last position: must never be read
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    exact = np.empty((T, nh, hd))
    for t in range(T):
        for h in range(nh):
            g = h // (nh // nkv)
            s = k64[g, :start + t + 1] @ q64[t, h]
            e = np.exp(s - s.max())
            exact[t, h] = e @ v64[g, :start + t + 1] / e.sum()
    exact = exact.reshape(T, nh * hd)
    n = start + T + hd  # the longest reduction: scores over hd, weighted sums over the positions
    for got in (K.attention(q, k, v, start), gpu.attention(q, k, v, start), engine.attention(q, k, v, start)):
        assert got.shape == (T, nh * hd) and rel_error(got, exact) < 16 * np.sqrt(n) * U
    assert rel_error(gpu.attention(q, k, v, start), engine.attention(q, k, v, start)) < 16 * np.sqrt(n) * U


def test_layer_kernels_refuse_what_does_not_fit(gpu):
    q = np.zeros((2, 4, 8), np.float32)
    kv = np.zeros((3, 4, 8), np.float32)  # 4 query heads cannot share 3 key/value heads
    with pytest.raises(KernelError, match="does not fit"):
        gpu.attention(q, kv, kv, 0)
    with pytest.raises(KernelError, match="does not fit"):
        gpu.attention(q, kv[:2], kv[:2], 3)  # positions 3, 4 past a cache of 4
    with pytest.raises(KernelError, match="shapes disagree"):
        gpu.rms_norm(np.zeros((2, 8), np.float32), np.zeros(7, np.float32), 1e-6)
    with pytest.raises(KernelError, match="shapes disagree"):  # 3 rows cannot take 2 weight rows in turn
        gpu.rms_norm(np.zeros((3, 8), np.float32), np.zeros((2, 8), np.float32), 1e-6)
    with pytest.raises(KernelError, match="even hd"):
        gpu.rope(*(np.zeros((1, 2, 5), np.float32),) * 3)


def test_kv_write_and_add_are_their_twins(gpu):
    """A stage's new keys and values into their caches at their positions in one dispatch (keys
    and values from two buffers, each at an offset of wider rows of its own), and the residual
    add and a bias on every row: bit for bit (copies and one float32 add)."""
    rng = np.random.default_rng(9)
    T, nkv, hd, cap, start = 3, 2, 8, 10, 4
    (k_stride, k_offset), (v_stride, v_offset) = (40, 16), (48, 32)
    k_src, v_src = (rng.standard_normal((T, n), dtype=np.float32) for n in (k_stride, v_stride))
    k_cache, v_cache = (rng.standard_normal((nkv, cap, hd), dtype=np.float32) for _ in range(2))
    x, y = (rng.standard_normal((5, 7), dtype=np.float32) for _ in range(2))
    ks, kc, vs, vc, xb, yb = (gpu.storage(a.size, a) for a in (k_src, k_cache, v_src, v_cache, x, y))
    enc = gpu.encoder()
    gpu.encode_elementwise(enc, "kv_write", T * nkv * hd, (hd, nkv, cap, start, k_stride, k_offset, v_stride, v_offset),
                           [ks, kc, vs, vc])
    gpu.encode_elementwise(enc, "add", x.size, (x.size,), [yb, xb])
    got_x = gpu.submit_read(enc, xb, x.size).reshape(x.shape)
    for got, cache, src, offset in ((kc, k_cache, k_src, k_offset), (vc, v_cache, v_src, v_offset)):
        want = K.kv_write(cache.copy(), src, start, offset)
        np.testing.assert_array_equal(gpu.submit_read(gpu.encoder(), got, cache.size).reshape(cache.shape), want)
        assert not np.array_equal(want, cache)  # it wrote something
    np.testing.assert_array_equal(got_x, K.add(x.copy(), y))
    bias = rng.standard_normal(7, dtype=np.float32)
    enc = gpu.encoder()
    bb = gpu.storage(bias.size, bias)
    gpu.encode_elementwise(enc, "add", x.size, (bias.size,), [bb, xb])
    np.testing.assert_array_equal(gpu.submit_read(enc, xb, x.size).reshape(x.shape), K.add(got_x.copy(), bias))


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_k"])
@pytest.mark.parametrize("T", [1, 3])
def test_a_product_that_adds_to_its_output_is_the_product_then_add(gpu, fmt, T):
    """encode_linear with ``accumulate`` (the down kernels' ACCUMULATE constant) into a residual
    stream, at a column offset: bit for bit the product into a buffer of its own, then add.wgsl;
    the columns it does not write keep theirs. Refused, each with its own reason, for a kernel
    other than down, for q8 and for an output that is the input."""
    rng = np.random.default_rng(11)
    rows, cols, n_out, col0 = 40, 256, 48, 4
    if fmt == "f32":
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.05)
    elif fmt == "q8_0":
        w = K.quantize_blocks(rng.standard_normal((rows, cols), dtype=np.float32), fmt)
    else:
        w = K.random_blocks(rng, rows, cols, fmt)
    m = gpu.upload_linear(w, fmt)
    x = rng.standard_normal((T, cols), dtype=np.float32)
    res = rng.standard_normal((T, n_out), dtype=np.float32)
    xb, rb, yb = gpu.storage(x.size, x), gpu.storage(res.size, res), gpu.storage(res.size, np.zeros_like(res))
    enc = gpu.encoder()
    gpu.encode_linear(enc, xb, m, rb, T, n_out, col0, accumulate=True)
    got = gpu.submit_read(enc, rb, res.size).reshape(res.shape)
    enc = gpu.encoder()
    gpu.encode_linear(enc, xb, m, yb, T, n_out, col0)
    y = gpu.submit_read(enc, yb, res.size).reshape(res.shape)
    rb2 = gpu.storage(res.size, res)
    enc = gpu.encoder()
    gpu.encode_elementwise(enc, "add", res.size, (res.size,), [yb, rb2])
    np.testing.assert_array_equal(got, gpu.submit_read(enc, rb2, res.size).reshape(res.shape))
    np.testing.assert_array_equal(got, K.add(y.copy(), res))
    assert np.array_equal(got[:, :col0], res[:, :col0]) and not np.array_equal(got, res)
    with pytest.raises(KernelError, match="input buffer as the output .*pass an output buffer other than the input"):
        gpu.encode_linear(gpu.encoder(), xb, m, xb, T, n_out, accumulate=True)
    with pytest.raises(KernelError, match="refused for the 'q8' format.*buffer of its own"):
        gpu.encode_linear(gpu.encoder(), xb, gpu.upload_linear(rng.standard_normal((8, 32), np.float32), "q8"),
                          rb, T, n_out, accumulate=True)
    with pytest.raises(KernelError, match="down kernels only, not 'swiglu': write the swiglu product into a buffer"):
        gpu._dispatch(gpu.encoder(), "swiglu", fmt, T, cols // 4, n_out, xb, [m.matrix], rb,  # noqa: SLF001
                      accumulate=True)


def test_a_uniform_carries_a_new_position_each_submission_and_refuses_two_in_one(gpu):
    """kv_write through one kept bind group and a Uniform: each submission writes at the position
    its parameters name (the twin's result, bit for bit), the bind group is made once, and
    parameters that would change within one encoder — whose dispatches would all read the last
    write — or pass the buffer raise KernelError."""
    rng = np.random.default_rng(10)
    nkv, hd, cap, stride, k_offset, v_offset = 2, 8, 6, 40, 8, 24
    k_cache, v_cache = np.zeros((nkv, cap, hd), np.float32), np.zeros((nkv, cap, hd), np.float32)
    kc, vc = gpu.storage(k_cache.size, k_cache), gpu.storage(v_cache.size, v_cache)
    sb = gpu.storage(stride)  # one step's row, written each step: keys and values at their offsets
    bufs = [sb, kc, sb, vc]
    uniform, binds = gpu.uniform(48), {}
    fields = lambda start: (hd, nkv, cap, start, stride, k_offset, stride, v_offset)  # noqa: E731
    for start in (0, 1, 4):
        src = rng.standard_normal((1, stride), dtype=np.float32)
        gpu.write(sb, src)
        enc = gpu.encoder()
        gpu.encode_elementwise(enc, "kv_write", nkv * hd, fields(start), bufs, binds, uniform)
        got = gpu.submit_read(enc, kc, k_cache.size).reshape(k_cache.shape)
        k_cache, v_cache = K.kv_write(k_cache, src, start, k_offset), K.kv_write(v_cache, src, start, v_offset)
        np.testing.assert_array_equal(got, k_cache)
    np.testing.assert_array_equal(gpu.submit_read(gpu.encoder(), vc, v_cache.size).reshape(v_cache.shape), v_cache)
    assert len(binds) == 1
    assert np.count_nonzero(k_cache.any(axis=2)) == 3 * nkv  # three positions written in each head
    enc = gpu.encoder()
    gpu.encode_elementwise(enc, "kv_write", nkv * hd, fields(2), bufs, binds, uniform)
    with pytest.raises(KernelError, match="within one submission"):
        gpu.encode_elementwise(enc, "kv_write", nkv * hd, fields(3), bufs, binds, uniform)
    with pytest.raises(KernelError, match="64 bytes of parameters for a uniform buffer of 48"):
        gpu.encode(gpu.encoder(), "kv_write", bytes(64), bufs, (1, 1, 1), binds, uniform)
