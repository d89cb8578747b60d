"""GLM-4.5 (``glm4_moe`` / GGUF ``glm4moe``), DeepSeek-V3 (``deepseek_v3`` / GGUF
``deepseek2``) and MiniMax-M2 (``minimax_m2`` / GGUF ``minimax-m2``) against transformers on tiny random checkpoints: HF safetensors and GGUF (F32,
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
FAMILIES = ["glm4_moe", "deepseek_v3", "minimax_m2"]  # one tiny model of each
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


@pytest.mark.parametrize("name", NAMES)
def test_decode_steps_give_the_bits_of_one_prefill(tiny_sig, name):
    """A row's result depends only on the row: chunking the sequence changes no bit."""
    model = load_model(tiny_sig(name)[1])
    np.testing.assert_array_equal(prefill_then_decode(model, TOKENS), model.forward(TOKENS, model.new_cache()))


@pytest.mark.parametrize("name", FAMILIES)
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


@pytest.mark.parametrize("name", FAMILIES)
def test_f16_gguf_matches_transformers_on_the_same_weights(tiny_sig, name, tmp_path):
    hf, _ = tiny_sig(name)
    model = load_model(write_gguf(hf, tmp_path / "m.gguf", QT.F16))
    assert model.checkpoint.file.qtype("blk.1.ffn_gate_exps.weight") == QT.F16
    twin = f16_rounded(hf)
    np.testing.assert_allclose(prefill_then_decode(model, TOKENS), hf_logits(twin, TOKENS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_q8_0_gguf_is_close_and_greedy_agrees(tiny_sig, name, tmp_path):
    hf, _ = tiny_sig(name)
    model = load_model(write_gguf(hf, tmp_path / "m.gguf", QT.Q8_0))
    assert model.checkpoint.file.qtype("blk.1.ffn_up_exps.weight") == QT.Q8_0
    ours, ref = model.forward(TOKENS, model.new_cache()), hf_logits(hf, TOKENS)
    assert 0 < np.abs(ours - ref).max() < 0.05
    np.testing.assert_array_equal(ours.argmax(axis=1), ref.argmax(axis=1))


def test_deepseek_gguf_with_a_whole_kv_b_gives_the_same_logits(tiny_sig, tmp_path):
    """Files written before llama.cpp's MLA cache hold ``attn_kv_b``, not ``attn_k_b``/``attn_v_b``."""
    hf, _ = tiny_sig("deepseek_v3")
    split = load_model(write_gguf(hf, tmp_path / "split.gguf"))
    whole = load_model(write_gguf(hf, tmp_path / "whole.gguf", kv_b=True))
    assert whole.checkpoint.has("kv_b", 0) and not whole.checkpoint.has("k_b", 0)
    np.testing.assert_allclose(prefill_then_decode(whole, TOKENS), prefill_then_decode(split, TOKENS),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", FAMILIES)
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


@pytest.mark.parametrize("name", FAMILIES)
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
    mm = load_model(tiny_sig("minimax_m2")[1])
    rc = mm.routing_config(0)
    assert (rc.scoring, rc.norm_topk_prob, rc.routed_scaling_factor, rc.n_group) == ("sigmoid", True, 1.0, 1)
    assert rc.selection_bias is not None and mm.config.moe_layers == (0, 1, 2) and not mm.has_shared_expert(0)
    assert mm.config.rotary_dim == 16 and mm.config.qk_norm == "proj"


@pytest.mark.parametrize("name", FAMILIES)
def test_route_matches_transformers_router(tiny_sig, name):
    """Our route() with the layer's routing config picks transformers' experts with its weights."""
    import torch

    hf, path = tiny_sig(name)
    model = load_model(path)
    layer = model.config.moe_layers[-1]
    x = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    r = route(model.router_logits(layer, x), **model.routing_config(layer).kwargs())
    mlp = hf.model.layers[layer].mlp
    with torch.no_grad():
        if name == "minimax_m2":  # its router takes the block's bias
            _, weights, experts = mlp.gate(torch.from_numpy(x), mlp.e_score_correction_bias)
        else:
            _, weights, experts = mlp.gate(torch.from_numpy(x))
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

    for name in FAMILIES:
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


# The published configs (the fields the engine reads), to check the sizes at full scale.
DEEPSEEK_V3_CONFIG = dict(
    model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    rope_theta=10000, rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    max_position_embeddings=163840, vocab_size=129280, rms_norm_eps=1e-6, tie_word_embeddings=False,
    hidden_act="silu", bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=1)
GLM45_AIR_CONFIG = dict(
    model_type="glm4_moe", hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
    head_dim=128, partial_rotary_factor=0.5, intermediate_size=10944, moe_intermediate_size=1408,
    n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1,
    topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True, use_qk_norm=False,
    rope_theta=1000000, max_position_embeddings=131072, vocab_size=151552, rms_norm_eps=1e-5,
    num_nextn_predict_layers=1, tie_word_embeddings=False, hidden_act="silu", eos_token_id=[151329, 151336, 151338])


MINIMAX_M2_CONFIG = dict(
    model_type="minimax_m2", hidden_size=3072, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8,
    head_dim=128, rotary_dim=64, intermediate_size=1536, num_local_experts=256, num_experts_per_tok=8,
    use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True, rope_theta=5000000,
    max_position_embeddings=196608, vocab_size=200064, rms_norm_eps=1e-6, tie_word_embeddings=False,
    hidden_act="silu", bos_token_id=200034, eos_token_id=200020)


def test_published_configs_read_at_full_scale():
    from swarm.compute.config import config_from_hf
    from swarm.peer import memory
    from swarm.peer.plan import ModelShape

    ds = config_from_hf(DEEPSEEK_V3_CONFIG, "deepseek-v3/config.json")
    assert ds.is_mla and ds.n_layers == 61 and ds.moe_layers == tuple(range(3, 61))
    assert (ds.n_kv_heads, ds.head_dim, ds.kv_values_per_token) == (1, 576, 576)
    assert ds.shared_expert_intermediate_size == 2048 and (ds.n_group, ds.topk_group) == (8, 4)
    m = 0.1 * 1.0 * np.log(40) + 1.0
    assert ds.attention_scale == pytest.approx(192 ** -0.5 * m * m)
    shape = ModelShape.from_config(ds)
    ctx = memory.context_tokens(163840)
    assert shape.kv_layer_bytes == ctx * 576 * 4  # the latent, not 128 heads of keys (192) and values (128)
    kimi = config_from_hf(dict(DEEPSEEK_V3_CONFIG, model_type="kimi_k2", n_group=1, topk_group=1,
                               num_attention_heads=64, rope_scaling=dict(DEEPSEEK_V3_CONFIG["rope_scaling"], factor=32)),
                          "kimi-k2/config.json")
    assert kimi.family == "deepseek_v3" and kimi.n_heads == 64

    air = config_from_hf(GLM45_AIR_CONFIG, "glm-4.5-air/config.json")
    assert air.n_layers == 46 and air.moe_layers == tuple(range(1, 46)) and air.rotary_dim == 64
    assert air.qk_norm is None and air.attention_bias and air.shared_expert_intermediate_size == 1408
    assert ModelShape.from_config(air).kv_layer_bytes == memory.context_tokens(131072) * 2 * 8 * 128 * 4

    mm = config_from_hf(MINIMAX_M2_CONFIG, "minimax-m2/config.json")
    assert mm.moe_layers == tuple(range(62)) and (mm.n_experts, mm.top_k, mm.moe_intermediate_size) == (256, 8, 1536)
    assert (mm.rotary_dim, mm.qk_norm, mm.scoring, mm.shared_expert_intermediate_size) == (64, "proj", "sigmoid", 0)


def test_fp8_checkpoint_is_refused_by_name():
    from swarm.compute.config import config_from_hf
    from swarm.errors import ModelFileError

    cfg = dict(DEEPSEEK_V3_CONFIG, quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128]))
    with pytest.raises(ModelFileError, match=r"quantized with 'fp8'.*BF16/F16/F32 copy or a GGUF"):
        config_from_hf(cfg, "deepseek-v3/config.json")
