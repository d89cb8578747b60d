"""Checks the model-family tests share: a batch of sequences against each one alone."""

from __future__ import annotations

import numpy as np


def assert_batch_gives_solo_bits(model, a: list[int], b: list[int], decode: tuple[int, int] = (5, 9)) -> None:
    """Sequences ``a`` and ``b`` prefilled in one ``forward_batch`` step, then one decode token
    each (``decode``) in another, give the bits of each sequence run alone with ``forward``."""
    solo_caches = [model.new_cache(), model.new_cache()]
    solo = [model.forward(t, cache, last_only=True) for t, cache in zip((a, b), solo_caches)]
    caches = [model.new_cache(), model.new_cache()]
    np.testing.assert_array_equal(model.forward_batch([(a, caches[0]), (b, caches[1])]), np.concatenate(solo))
    step = model.forward_batch([([decode[0]], caches[0]), ([decode[1]], caches[1])])
    np.testing.assert_array_equal(step, np.concatenate([model.forward([t], cache, last_only=True)
                                                        for t, cache in zip(decode, solo_caches)]))


def two_stage_logits(model, tokens: list[int], prefill: int, split: int):
    """Logits [T, V] of ``tokens`` (a prefill of ``prefill``, then one decode step a token) run as
    two stages: layers ``0:split`` on one cache, ``split:`` on another, as two stage peers hold
    them; returns (logits, first stage's cache, second's)."""
    from swarm.compute.kernels import rms_norm

    first, second = model.new_cache(capacity=4), model.new_cache(capacity=4)
    staged, start = [], 0
    for chunk in [tokens[:prefill]] + [[t] for t in tokens[prefill:]]:
        x = model.layers(model.embed.take(np.array(chunk)), first, start, 0, split)
        x = model.layers(x, second, start, split, model.config.n_layers)
        start += len(chunk)
        staged.append(model.head.matmul(rms_norm(x, model.final_norm, model.config.rms_norm_eps)))
    return np.concatenate(staged), first, second
