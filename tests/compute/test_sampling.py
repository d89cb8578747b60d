"""Sampling rules against explicit float64 distributions, and the generation loop."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute import SamplingParams, generate, sample
from swarm.compute.model import KVCache

V = 8
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0], np.float32)


def _freq(params, n=20000, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.bincount([sample(LOGITS, params, rng) for _ in range(n)], minlength=V)
    return counts / n


def _softmax64(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def test_greedy_is_argmax_and_ties_go_low():
    rng = np.random.default_rng(0)
    assert sample(LOGITS, SamplingParams(), rng) == 6
    assert sample(np.array([1, 5, 5, 0], np.float32), SamplingParams(), rng) == 1


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-20, 9.9e-6])
def test_temperature_below_the_floor_is_greedy_never_nan(temperature):
    """1e-45 is float32's smallest subnormal: logits / T overflows to inf and softmax to NaN."""
    from swarm.compute.sampling import TEMPERATURE_FLOOR

    assert temperature < TEMPERATURE_FLOOR
    big = LOGITS * 1000
    for seed in range(5):
        assert sample(big, SamplingParams(temperature=temperature, top_p=0.9, top_k=3),
                      np.random.default_rng(seed)) == int(np.argmax(big))


def test_temperature_at_the_floor_still_samples_finite():
    """Just above the floor the division stays finite in float32: the best token, no NaN."""
    from swarm.compute.sampling import TEMPERATURE_FLOOR

    assert sample(LOGITS, SamplingParams(temperature=TEMPERATURE_FLOOR), np.random.default_rng(0)) == 6


def test_temperature_distribution():
    p = _softmax64(LOGITS.astype(np.float64) / 0.7)
    assert np.abs(_freq(SamplingParams(temperature=0.7)) - p).max() < 0.015


def test_top_k_keeps_only_the_k_best():
    f = _freq(SamplingParams(temperature=1.0, top_k=3))
    keep = [6, 0, 1]
    p = np.zeros(V)
    p[keep] = _softmax64(LOGITS[keep].astype(np.float64))
    assert set(np.flatnonzero(f)) <= set(keep)
    assert np.abs(f - p).max() < 0.015


def test_top_p_keeps_the_smallest_set_reaching_p():
    p_full = _softmax64(LOGITS.astype(np.float64))
    order = np.argsort(-p_full)
    cum = np.cumsum(p_full[order])
    n_keep = int(np.searchsorted(cum, 0.8)) + 1
    keep = order[:n_keep]
    f = _freq(SamplingParams(temperature=1.0, top_p=0.8))
    want = np.zeros(V)
    want[keep] = p_full[keep] / p_full[keep].sum()
    assert set(np.flatnonzero(f)) == set(keep)
    assert np.abs(f - want).max() < 0.015


def test_seed_reproduces_and_params_are_validated():
    a = _freq(SamplingParams(temperature=1.0), n=200, seed=5)
    b = _freq(SamplingParams(temperature=1.0), n=200, seed=5)
    assert np.array_equal(a, b)
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


class _Script:
    """A stand-in model whose next-token logits follow a script (tests the loop, not the net)."""

    def __init__(self, script):
        self.script, self.calls = script, []
        from swarm.compute.config import ModelConfig
        self.config = ModelConfig(family="llama", vocab_size=V, hidden_size=4, n_layers=1, n_heads=1,
                                  n_kv_heads=1, head_dim=4, intermediate_size=4, rms_norm_eps=1e-6,
                                  rope_theta=1e4)

    def new_cache(self):
        return KVCache(self.config, 4)

    def forward(self, tokens, cache, ffn=None, last_only=False):
        self.calls.append(list(tokens))
        cache.length += len(tokens)
        out = np.zeros((1, V), np.float32)
        out[0, self.script[len(self.calls) - 1]] = 1
        return out


def test_generate_prefills_once_then_decodes_and_stops():
    m = _Script([3, 5, 2, 7, 7])
    out = list(generate(m, [1, 4, 4], SamplingParams(max_tokens=10, stop_tokens=(2,))))
    assert out == [3, 5, 2]  # the stop token is yielded, then the loop ends
    assert m.calls == [[1, 4, 4], [3], [5]]
    m = _Script([3, 5, 2, 7])
    assert list(generate(m, [1], SamplingParams(max_tokens=2))) == [3, 5]
    assert m.calls == [[1], [3]]  # no forward after the last token
    assert list(generate(_Script([1]), [1], SamplingParams(max_tokens=0))) == []
