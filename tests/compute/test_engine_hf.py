"""The engine against transformers on tiny random checkpoints of every supported family."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute import SamplingParams, generate, load_model
from tests.compute.tiny_models import (DENSE_FAMILIES, MOE_FAMILIES, TINY, build_tiny, hf_greedy,
                                       hf_logits, save_stacked)

FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, 96, 12)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family → (transformers model, checkpoint dir); built lazily, once per module."""
    built: dict = {}

    def get(family):
        if family not in built:
            built[family] = build_tiny(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def chunked_logits(model, tokens):
    """Prefill 8 tokens, decode one, prefill the rest: exercises the KV cache both ways."""
    cache = model.new_cache(capacity=4)  # small: forces the cache to grow
    parts = [model.forward(tokens[:8], cache), model.forward(tokens[8:9], cache),
             model.forward(tokens[9:], cache)]
    assert cache.length == len(tokens)
    return np.concatenate(parts)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny, family):
    hf, path = tiny(family)
    model = load_model(path)
    ours = chunked_logits(model, TOKENS)
    ref = hf_logits(hf, TOKENS)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (12, 96)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(tiny, family):
    hf, path = tiny(family)
    ours = list(generate(load_model(path), TOKENS[:5], SamplingParams(max_tokens=6)))
    assert ours == hf_greedy(hf, TOKENS[:5], 6)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_stacked_layout_loads_to_the_same_logits(tiny, family, tmp_path):
    hf, path = tiny(family)
    stacked = load_model(save_stacked(hf, path, tmp_path / "stacked"))
    assert len(stacked.checkpoint.files) == 2  # sharded through the index
    np.testing.assert_array_equal(chunked_logits(stacked, TOKENS), chunked_logits(load_model(path), TOKENS))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_weights_are_the_checkpoints(tiny, family):
    hf, path = tiny(family)
    model = load_model(path)
    layer = model.config.moe_layers[-1]
    e = model.config.n_experts - 1
    w = model.expert_weights(layer, e)
    experts = hf.model.layers[layer].mlp.experts
    gate_up = experts.gate_up_proj[e].detach().numpy()  # [2F, H]
    np.testing.assert_array_equal(w.gate_up, gate_up.T)
    np.testing.assert_array_equal(w.down, experts.down_proj[e].detach().numpy().T)
    assert set(model._experts) == {(layer, e)}  # nothing else was materialised


def test_routing_options_come_from_the_file(tiny):
    expect = {"qwen3_moe": True, "qwen2_moe": False, "olmoe": False, "mixtral": True}
    for family, norm in expect.items():
        cfg = load_model(tiny(family)[1]).config
        assert cfg.norm_topk_prob is norm, family
        assert cfg.top_k == TINY[family][0]["num_experts_per_tok"]
    qwen3 = load_model(tiny("qwen3_moe")[1])
    assert qwen3.config.moe_layers == (0, 2) and not qwen3.is_moe_layer(1)  # mlp_only_layers=[1]
    assert load_model(tiny("qwen2_moe")[1]).has_shared_expert(0)
    assert load_model(tiny("olmoe")[1]).config.clip_qkv == 4.0
    assert load_model(tiny("qwen3")[1]).config.head_dim == 24
