"""Kernels against float64 numpy written straight from the formulas."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute.kernels import (apply_rope, apply_rope_swapped, attention, rms_norm,
                                   rope_inv_freq, rope_tables, signed_sin, silu_mul)

F32 = np.float32
rng = np.random.default_rng(0)


def test_rms_norm_float32_against_float64():
    x = rng.normal(size=(5, 96)).astype(F32) * 3
    w = rng.normal(size=96).astype(F32)
    y = rms_norm(x, w, 1e-6)
    x64 = x.astype(np.float64)
    ref = w * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    assert y.dtype == F32
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6)


def test_rms_norm_rows_alone_equal_the_batch_and_head_weights():
    x = rng.normal(size=(6, 4, 32)).astype(F32) * 2
    w = rng.normal(size=(4, 32)).astype(F32)  # one weight per head (Qwen3's q/k norm)
    y = rms_norm(x, w, 1e-6)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, w * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6), rtol=2e-6, atol=2e-6)
    for t in range(6):
        np.testing.assert_array_equal(rms_norm(x[t:t + 1], w, 1e-6), y[t:t + 1])
    np.testing.assert_array_equal(rms_norm(x[:, 1:3], w[1:3], 1e-6), y[:, 1:3])  # a strided view
    with pytest.raises(ValueError, match="trailing shape"):
        rms_norm(x, w[0, :16], 1e-6)
    with pytest.raises(ValueError, match="float32"):
        rms_norm(x.astype(np.float64), w, 1e-6)


def test_silu_mul_is_the_numpy_expression_bit_for_bit():
    g = rng.normal(size=(5, 96)).astype(F32) * 6
    u = rng.normal(size=(5, 96)).astype(F32)
    want = g / (F32(1.0) + np.exp(-g)) * u
    got = silu_mul(g.copy(), u)
    np.testing.assert_array_equal(got, want)
    for t in range(5):
        np.testing.assert_array_equal(silu_mul(g[t:t + 1].copy(), u[t:t + 1]), want[t:t + 1])


def test_rope_swapped_form_equals_rotate_half_exactly():
    x = rng.normal(size=(7, 5, 16)).astype(F32)
    cos, sin = rope_tables(np.arange(3, 10), rope_inv_freq(16, 10000.0))
    ref = apply_rope(x, cos, sin)
    got = apply_rope_swapped(x, np.broadcast_to(cos[:, None], x.shape), np.broadcast_to(signed_sin(sin)[:, None], x.shape))
    np.testing.assert_array_equal(got, ref)
    # and rotate-half itself, in float64: pairs (i, i + hd/2) turn by angle pos * theta^(-2i/hd)
    pos = np.arange(3, 10)[:, None, None]
    i = np.arange(8)
    ang = pos * 10000.0 ** (-2 * i / 16)
    x64 = x.astype(np.float64)
    a, b = x64[..., :8], x64[..., 8:]
    want = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)
    np.testing.assert_allclose(ref, want, atol=1e-5)


@pytest.mark.parametrize("threads_n", [1, 3])
def test_rope_compiled_pass_is_the_numpy_expression_bit_for_bit(threads_n):
    """The compiled rotation (rows over the threads) against numpy's ``x * cos`` then
    ``+= swapped * ssin``: query/key heads with their own tables, one table row for every head
    (MLA), a strided view of a wider projection, and shapes it leaves to numpy."""
    from swarm.compute import threads

    def numpy_form(x, cos, ssin):
        half = x.shape[-1] // 2
        out = x * cos
        out += np.concatenate([x[..., half:], x[..., :half]], axis=-1) * ssin
        return out
    before = threads.threads()
    threads.set_threads(threads_n)
    try:
        for T, n, hd, m in [(64, 40, 128, 40), (5, 9, 64, 1), (1, 3, 2, 3), (300, 12, 64, 12)]:
            wide = (rng.normal(size=(T, n, hd + 8)) * 4).astype(F32)
            cos, ssin = (rng.normal(size=(T, m, hd)).astype(F32) for _ in range(2))
            for x in (wide[:, :, :hd], np.ascontiguousarray(wide[:, :, :hd])):
                got = apply_rope_swapped(x, cos, ssin)
                assert got.shape == x.shape and got.dtype == F32
                assert np.array_equal(got.view(np.uint32), numpy_form(x, cos, ssin).view(np.uint32)), (T, n, hd, m)
        x4 = rng.normal(size=(2, 3, 4, 8)).astype(F32)  # four axes: numpy's broadcasting
        c4, s4 = rng.normal(size=(2, 1, 4, 8)).astype(F32), rng.normal(size=(2, 1, 4, 8)).astype(F32)
        np.testing.assert_array_equal(apply_rope_swapped(x4, c4, s4), numpy_form(x4, c4, s4))
    finally:
        threads.set_threads(before)


def test_attention_grouped_causal_against_float64():
    nh, nkv, T, start, hd = 6, 2, 4, 3, 12  # hd: a multiple of 8 plus a tail
    S = start + T
    q = rng.normal(size=(nh, T, hd)).astype(F32)
    k = rng.normal(size=(nkv, S + 5, hd)).astype(F32)  # a cache with room past the sequence
    v = rng.normal(size=(nkv, S + 5, hd)).astype(F32)
    scale = F32(1 / np.sqrt(hd))
    got = attention((q * scale).transpose(1, 0, 2), k, v, start)
    want = np.zeros((T, nh * hd))
    for h in range(nh):
        kv = h // (nh // nkv)
        for t in range(T):
            s = (k[kv, :start + t + 1].astype(np.float64) @ q[h, t].astype(np.float64)) / np.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            want[t, h * hd:(h + 1) * hd] = p @ v[kv, :start + t + 1]
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, atol=1e-5)
    # one decode step sees every cached key
    one = attention((q[:, -1:] * scale).transpose(1, 0, 2), k, v, S - 1)
    np.testing.assert_allclose(one[0], want[-1], atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        attention((q * scale).transpose(1, 0, 2), k, v, S + 2)  # past the cache's room


def test_rope_warm_up_compiles_the_views_a_prefill_passes():
    """A prefill's query/key heads are a view of the wider projection (numba layout "A"): the
    warm-up of ``prepare_row_kernels`` compiles that form too, not only C-ordered arrays, so the
    first prefill does not compile (a fresh process: this one's other tests compile as they go)."""
    import subprocess
    import sys

    child = ("from swarm.compute import kernels, rowkernels\n"
             "kernels.prepare_row_kernels()\n"
             "print(sorted({(s[0].layout, s[1].layout) for s in rowkernels.rope_rows.signatures}))")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    layouts = eval(out.stdout.strip().splitlines()[-1])
    assert {("C", "C"), ("A", "C"), ("A", "A"), ("C", "A")} <= set(layouts), layouts
