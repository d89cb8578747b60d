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


# ---------------------------------------------------------------- penalties, logit bias, logprobs


def _penalized64(logits, counts, presence, frequency, bias):
    """OpenAI's rule in float64: mu[j] + bias[j] - c[j] * frequency - (c[j] > 0) * presence."""
    z = logits.astype(np.float64)
    for t, b in bias.items():
        z[t] += b
    for t, c in counts.items():
        z[t] -= c * frequency + (c > 0) * presence
    return z


def test_adjust_logits_follows_openais_formula():
    from swarm.compute.sampling import adjust_logits

    counts = {6: 3, 0: 1, 4: 2}
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.25, logit_bias=((1, 4.0), (6, -0.5)))
    got = adjust_logits(LOGITS, params, counts)
    want = _penalized64(LOGITS, counts, 0.5, 1.25, {1: 4.0, 6: -0.5})
    assert got.dtype == np.float32 and np.allclose(got, want, atol=1e-6)
    assert np.argmax(got) == 1  # the bias beat the best raw token, which the penalties pushed down
    assert adjust_logits(LOGITS, SamplingParams(), counts) is LOGITS  # nothing asked: the same array
    assert np.array_equal(LOGITS, np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0], np.float32))  # not written


def test_a_negative_penalty_rewards_what_was_said():
    from swarm.compute.sampling import adjust_logits

    got = adjust_logits(LOGITS, SamplingParams(presence_penalty=-2.0), {2: 1})
    assert got[2] == LOGITS[2] + 2 == LOGITS[6] == got[6] and np.argmax(got) == 2  # a tie: the lower id


def test_log_softmax_and_top_logprobs_against_float64():
    from swarm.compute.sampling import log_softmax, top_logprobs

    rng = np.random.default_rng(3)
    z = (rng.standard_normal(49152) * 4).astype(np.float32)
    lp = log_softmax(z)
    z64 = z.astype(np.float64)
    want = z64 - z64.max() - np.log(np.exp(z64 - z64.max()).sum())
    assert lp.dtype == np.float32 and np.abs(lp - want).max() < 1e-4
    top = top_logprobs(lp, 5)
    assert [t for t, _ in top] == list(np.argsort(-want, kind="stable")[:5])
    assert all(abs(v - want[t]) < 1e-4 for t, v in top)
    tied = np.array([0.0, 1.0, 1.0, 0.5], np.float32)
    assert [t for t, _ in top_logprobs(log_softmax(tied), 3)] == [1, 2, 3]  # ties: the lower id first
    assert top_logprobs(lp, 0) == ()


def test_sampler_reports_the_raw_distribution_and_counts_its_picks():
    """Logprobs are the model's (raw logits), whatever the penalties made the sampler pick."""
    from swarm.compute.sampling import Sampler

    s = Sampler(SamplingParams(frequency_penalty=2.0, logprobs=2))
    first, second = s(LOGITS), s(LOGITS)
    assert first.token == 6 and second.token == 0  # 3.0 - 2 < 2.0: the repeat is penalized
    lp64 = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert abs(second.logprob - lp64[0]) < 1e-6
    assert [t for t, _ in second.top] == [6, 0] and abs(second.top[0][1] - lp64[6]) < 1e-6
    assert s.counts == {6: 1, 0: 1}
    assert Sampler(SamplingParams())(LOGITS).logprob is None


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                                 dict(logit_bias=((3, 101.0),)), dict(logit_bias=((-1, 1.0),)),
                                 dict(logprobs=21), dict(logprobs=-1)])
def test_penalty_bias_and_logprobs_bounds(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_generate_applies_penalties_as_a_float64_reimplementation(smollm2_model):
    """The CLI's and the swarm's token loop: greedy with penalties and a bias on SmolLM2's own
    logits equals the same rule applied in float64 by hand, and differs from plain greedy."""
    from swarm.compute.sampling import PREFILL_CHUNK

    model = smollm2_model
    prompt = [1, 504, 3, 9, 504, 3, 9, 504]
    params = SamplingParams(max_tokens=12, presence_penalty=0.8, frequency_penalty=1.5, logit_bias=((504, 5.0),))
    cache = model.new_cache()
    for lo in range(0, len(prompt), PREFILL_CHUNK):
        logits = model.forward(prompt[lo:lo + PREFILL_CHUNK], cache, last_only=True)[0]
    want, counts = [], {}
    for _ in range(params.max_tokens):
        tok = int(np.argmax(_penalized64(logits, counts, 0.8, 1.5, {504: 5.0})))
        want.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        logits = model.forward([tok], cache, last_only=True)[0]
    assert list(generate(model, prompt, params)) == want
    assert want != list(generate(model, prompt, SamplingParams(max_tokens=12)))


class _OnlyThese:
    """A constraint that allows ``ids`` only, recording what it was given."""

    def __init__(self, ids):
        self.ids, self.taken = list(ids), []

    def allowed(self):
        mask = np.zeros(V, bool)
        mask[self.ids] = True
        return mask

    def advance(self, token):
        self.taken.append(token)


def test_a_constraint_masks_after_the_adjustments():
    """The best allowed token wins (greedy and sampled), after bias; logprobs stay the raw ones."""
    from swarm.compute.sampling import Sampler

    made = []

    def constraint():
        made.append(_OnlyThese([1, 2, 4]))
        return made[-1]

    s = Sampler(SamplingParams(logit_bias=((4, 2.0),), constraint=constraint, logprobs=1))
    first = s(LOGITS)
    assert first.token == 4 and made[0].taken == [4]  # 0.0 + 2 beats 1.5 and 1.0; 6 and 0 are masked
    assert first.top[0][0] == 6  # the model's own favourite, reported though it was not allowed
    sampled = Sampler(SamplingParams(temperature=1.0, seed=3, constraint=constraint))
    assert {sampled(LOGITS).token for _ in range(200)} <= {1, 2, 4}
