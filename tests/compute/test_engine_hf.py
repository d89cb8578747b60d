"""The engine against transformers on tiny random checkpoints of every supported family."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute import SamplingParams, generate, load_model
from tests.compute.tiny_models import (DENSE_FAMILIES, MOE_FAMILIES, TINY, hf_greedy,
                                       hf_logits, save_stacked)

FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, 96, 12)]


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
    np.testing.assert_array_equal(np.concatenate([w.gate.dequantize(), w.up.dequantize()]), gate_up)
    np.testing.assert_array_equal(w.down.dequantize(), experts.down_proj[e].detach().numpy())
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
    assert load_model(tiny("mistral")[1]).config.sliding_window == 64


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)


def _llama3_tiny(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.compute.tiny_models import _COMMON

    cfg = LlamaConfig(**dict(_COMMON, rope_parameters=LLAMA3_ROPE))
    torch.manual_seed(11)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    hf = _llama3_tiny(tmp_path)
    model = load_model(tmp_path / "hf")
    assert model.config.rope_scaling["factor"] == 8.0
    np.testing.assert_allclose(chunked_logits(model, TOKENS * 3), hf_logits(hf, TOKENS * 3), atol=1e-5)


def test_llama3_rope_factors_in_gguf_match_transformers(tmp_path):
    """llama.cpp writes llama3 scaling as ``rope_freqs.weight`` divisors (convert_hf_to_gguf.py)."""
    import math

    from tests.compute.tiny_gguf import write_gguf_from_hf

    hf = _llama3_tiny(tmp_path)
    head_dim = 64 // 4
    p = LLAMA3_ROPE
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wl = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for f in freqs:  # llama.cpp's LlamaModel.generate_extra_tensors, written out
        wavelen = 2 * math.pi / f
        if wavelen < high_wl:
            factors.append(1.0)
        elif wavelen > low_wl:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    path = write_gguf_from_hf(hf, "llama", tmp_path / "m.gguf",
                              extra={"rope_freqs.weight": np.array(factors, np.float32)})
    model = load_model(path)
    assert model.checkpoint.has("rope_freqs")
    np.testing.assert_allclose(chunked_logits(model, TOKENS * 3), hf_logits(hf, TOKENS * 3), atol=1e-5)


def test_sliding_window_beyond_the_window_is_refused(tiny):
    import dataclasses

    _, path = tiny("qwen2")
    model = load_model(path)
    model.config = dataclasses.replace(model.config, sliding_window=8)
    cache = model.new_cache()
    model.forward(TOKENS[:8], cache)
    with pytest.raises(ValueError, match="attention window"):
        model.forward(TOKENS[8:9], cache)


def test_bfloat16_checkpoint_decodes_exactly(tiny, tmp_path):
    """numpy has no bfloat16: the safetensors reader widens it by hand; torch is the oracle."""
    import copy

    import torch

    hf = copy.deepcopy(tiny("qwen3_moe")[0]).to(torch.bfloat16)  # the shared model stays float32
    hf.save_pretrained(tmp_path / "bf16")
    model = load_model(tmp_path / "bf16")
    want = hf.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(model.checkpoint.load("q", 0), want)
    w = model.expert_weights(0, 2)
    gate_up = hf.model.layers[0].mlp.experts.gate_up_proj[2].detach().float().numpy()
    assert w.gate.qtype.name == "BF16"  # kept as stored
    np.testing.assert_array_equal(np.concatenate([w.gate.dequantize(), w.up.dequantize()]), gate_up)
