"""GLM-4.5 (``glm4_moe`` / GGUF ``glm4moe``) and DeepSeek-V3 (``deepseek_v3`` / GGUF
``deepseek2``) against transformers on tiny random checkpoints: HF safetensors and GGUF (F32,
F16, Q8_0, and DeepSeek's older ``attn_kv_b`` layout), prefill then decode steps, layer ranges
run on separate caches (stages), several sequences in one step, the latent KV cache, and the
routing options against transformers' router."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import SamplingParams, generate, load_model
from swarm.compute.ffn import route
from swarm.compute.kernels import rms_norm
from tests.compute.tiny_models import hf_greedy, hf_logits
from tests.compute.tiny_sigmoid_moe import TINY, build, f16_rounded, write_gguf

NAMES = list(TINY)
TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, 96, 12)]
PREFILL = 7  # then one decode step per remaining token


@pytest.fixture(scope="module")
def tiny_sig(tmp_path_factory):
    """name → (transformers model, HF checkpoint dir), built once per module."""
    built: dict = {}

    def get(name):
        if name not in built:
            built[name] = build(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def prefill_then_decode(model, tokens):
    """Logits [T, V] of a prefill of PREFILL tokens, then one decode step per token (the
    cache starts small so it grows on the way)."""
    cache = model.new_cache(capacity=4)
    parts = [model.forward(tokens[:PREFILL], cache)]
    parts += [model.forward(tokens[i:i + 1], cache) for i in range(PREFILL, len(tokens))]
    assert cache.length == len(tokens)
    return np.concatenate(parts)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(tiny_sig, name):
    hf, path = tiny_sig(name)
    model = load_model(path)
    ours = prefill_then_decode(model, TOKENS)
    ref = hf_logits(hf, TOKENS)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (12, 96)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_greedy_tokens_match_transformers(tiny_sig, name):
    hf, path = tiny_sig(name)
    ours = list(generate(load_model(path), TOKENS[:5], SamplingParams(max_tokens=6)))
    assert ours == hf_greedy(hf, TOKENS[:5], 6)


@pytest.mark.parametrize("name", NAMES)
def test_gguf_matches_transformers(tiny_sig, name, tmp_path):
    hf, _ = tiny_sig(name)
    model = load_model(write_gguf(hf, tmp_path / "m.gguf"))
    assert model.format == "gguf" and model.config.family == hf.config.model_type
    assert model.config.n_layers == hf.config.num_hidden_layers  # GLM's NextN/MTP block skipped
    np.testing.assert_allclose(prefill_then_decode(model, TOKENS), hf_logits(hf, TOKENS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_f16_gguf_matches_transformers_on_the_same_weights(tiny_sig, name, tmp_path):
    hf, _ = tiny_sig(name)
    model = load_model(write_gguf(hf, tmp_path / "m.gguf", QT.F16))
    assert model.checkpoint.file.qtype("blk.1.ffn_gate_exps.weight") == QT.F16
    twin = f16_rounded(hf)
    np.testing.assert_allclose(prefill_then_decode(model, TOKENS), hf_logits(twin, TOKENS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_q8_0_gguf_is_close_and_greedy_agrees(tiny_sig, name, tmp_path):
    hf, _ = tiny_sig(name)
    model = load_model(write_gguf(hf, tmp_path / "m.gguf", QT.Q8_0))
    assert model.checkpoint.file.qtype("blk.1.ffn_up_exps.weight") == QT.Q8_0
    ours, ref = model.forward(TOKENS, model.new_cache()), hf_logits(hf, TOKENS)
    assert 0 < np.abs(ours - ref).max() < 0.05


def test_deepseek_gguf_with_a_whole_kv_b_gives_the_same_logits(tiny_sig, tmp_path):
    """Files written before llama.cpp's MLA cache hold ``attn_kv_b``, not ``attn_k_b``/``attn_v_b``."""
    hf, _ = tiny_sig("deepseek_v3")
    split = load_model(write_gguf(hf, tmp_path / "split.gguf"))
    whole = load_model(write_gguf(hf, tmp_path / "whole.gguf", kv_b=True))
    assert whole.checkpoint.has("kv_b", 0) and not whole.checkpoint.has("k_b", 0)
    np.testing.assert_allclose(prefill_then_decode(whole, TOKENS), prefill_then_decode(split, TOKENS),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_layer_ranges_on_separate_caches_give_the_whole_models_bits(tiny_sig, name):
    """Stages: layers 0:2 on one peer's cache, 2:3 on another's, prefill then decode steps."""
    model = load_model(tiny_sig(name)[1])
    whole = prefill_then_decode(model, TOKENS)
    first, second = model.new_cache(capacity=4), model.new_cache(capacity=4)
    chunks = [TOKENS[:PREFILL]] + [[t] for t in TOKENS[PREFILL:]]
    staged, start = [], 0
    for chunk in chunks:
        x = model.embed.take(np.array(chunk))
        x = model.layers(x, first, start, 0, 2)
        x = model.layers(x, second, start, 2, model.config.n_layers)
        start += len(chunk)
        staged.append(model.head.matmul(rms_norm(x, model.final_norm, model.config.rms_norm_eps)))
    assert first.k[2] is None and second.k[0] is None  # each stage keeps its own layers' cache only
    np.testing.assert_array_equal(np.concatenate(staged), whole)


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_a_batch_of_sequences_gives_each_its_solo_bits(tiny_sig, name):
    model = load_model(tiny_sig(name)[1])
    a, b = TOKENS[:PREFILL], TOKENS[3:]
    solo = [model.forward(t, model.new_cache(), last_only=True) for t in (a, b)]
    caches = [model.new_cache(), model.new_cache()]
    batch = model.forward_batch([(a, caches[0]), (b, caches[1])])
    np.testing.assert_array_equal(batch, np.concatenate(solo))


def test_deepseek_cache_keeps_the_latent_not_expanded_keys(tiny_sig):
    model = load_model(tiny_sig("deepseek_v3")[1])
    c = model.config
    assert c.is_mla and c.n_kv_heads == 1 and c.head_dim == c.kv_lora_rank + c.qk_rope_head_dim == 40
    assert c.kv_values_per_token == 40  # vs 2 * 4 heads * (16 + 8 | 12) = 160 expanded
    cache = model.new_cache(capacity=4)
    model.forward(TOKENS, cache)
    k, v = cache.layer(0)
    assert k is v and k.shape == (1, cache.capacity, 40)
    assert k[0, :len(TOKENS)].any(axis=1).all()
    assert not k[0, len(TOKENS):].any()


def test_routing_options_come_from_the_file(tiny_sig):
    glm = load_model(tiny_sig("glm4_moe")[1])
    rc = glm.routing_config(1)
    assert (rc.scoring, rc.top_k, rc.norm_topk_prob, rc.routed_scaling_factor, rc.n_group) == \
        ("sigmoid", 2, True, 2.5, 1)
    assert rc.selection_bias is not None and rc.selection_bias.shape == (8,)
    assert glm.config.moe_layers == (1, 2) and glm.has_shared_expert(1) and not glm.is_moe_layer(0)
    assert glm.config.rotary_dim == 16 and glm.config.qk_norm == "head" and glm.config.attention_bias
    air = load_model(tiny_sig("glm4_moe_air")[1])
    assert air.config.moe_layers == (2,) and air.config.qk_norm is None
    ds = load_model(tiny_sig("deepseek_v3")[1])
    rc = ds.routing_config(2)
    assert (rc.n_group, rc.topk_group, rc.routed_scaling_factor) == (4, 2, 2.5)
    assert ds.config.rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_route_matches_transformers_router(tiny_sig, name):
    """Our route() with the layer's routing config picks transformers' experts with its weights."""
    import torch

    hf, path = tiny_sig(name)
    model = load_model(path)
    layer = model.config.moe_layers[-1]
    x = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    r = route(model.router_logits(layer, x), **model.routing_config(layer).kwargs())
    with torch.no_grad():
        _, weights, experts = hf.model.layers[layer].mlp.gate(torch.from_numpy(x))
    order = np.argsort(experts.numpy(), axis=1)
    want_e = np.take_along_axis(experts.numpy(), order, axis=1)
    want_w = np.take_along_axis(weights.numpy(), order, axis=1)
    got_order = np.argsort(r.experts, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(r.experts, got_order, axis=1), want_e)
    np.testing.assert_allclose(np.take_along_axis(r.weights, got_order, axis=1), want_w, rtol=0, atol=1e-6)


def test_planner_sizes_of_the_new_families(tiny_sig):
    """The coordinator's sizes and prices read these files; MLA's KV cache is priced as the
    latent it keeps (kv_lora_rank + qk_rope_head_dim float32 values per position)."""
    from swarm.peer import memory
    from swarm.peer.coordinator.costmodel import LayerCosts
    from swarm.peer.weights.sizes import model_shape

    for name in ("glm4_moe", "deepseek_v3"):
        model = load_model(tiny_sig(name)[1])
        shape = model_shape(model)
        assert shape.moe_layers == model.config.moe_layers and shape.n_experts == 8
        assert shape.expert_nbytes == 3 * 32 * 64 * 4
        ctx = memory.context_tokens(model.config.max_position_embeddings)
        per_token = 40 if name == "deepseek_v3" else 2 * 2 * 32
        assert shape.kv_layer_bytes == ctx * per_token * 4
        costs = LayerCosts.from_model(model)
        assert costs.kv_bytes == (shape.kv_layer_bytes,) * 3
        assert costs.attn_bytes[0] == model.attention_nbytes(0) > 0
