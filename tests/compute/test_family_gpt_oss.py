"""gpt-oss (``gpt_oss`` / GGUF ``gpt-oss``) against transformers on a tiny random checkpoint:
attention sinks, alternating sliding-window (window 4 of 12 positions) and full layers,
attention biases, YaRN, biased experts with the clamped SwiGLU and the top-k-then-softmax
router. HF safetensors and GGUF (F32, F16, Q8_0, MXFP4 experts), prefill then decode steps,
layer ranges on separate caches (stages), several sequences in one step, and the refusal to
cut biased experts into shipped slices."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import SamplingParams, generate, load_model
from swarm.compute.ffn import route
from swarm.compute.kernels import rms_norm
from tests.compute.family_checks import assert_batch_gives_solo_bits, two_stage_logits
from tests.compute.tiny_gpt_oss import build, rounded, write_gguf
from tests.compute.tiny_models import hf_greedy, hf_logits

TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, 96, 12)]
PREFILL = 7  # then one decode step per remaining token
ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, HF checkpoint dir), built once per module."""
    return build(tmp_path_factory.mktemp("gpt_oss"))


def prefill_then_decode(model, tokens):
    cache = model.new_cache(capacity=4)
    parts = [model.forward(tokens[:PREFILL], cache)]
    parts += [model.forward(tokens[i:i + 1], cache) for i in range(PREFILL, len(tokens))]
    assert cache.length == len(tokens)
    return np.concatenate(parts)


def test_config_reads_the_family(tiny):
    c = load_model(tiny[1]).config
    assert c.family == "gpt_oss" and c.layer_windows == (4, 0, 4) and c.attention_sinks and c.output_bias
    assert (c.scoring, c.expert_bias, c.swiglu_limit, c.swiglu_alpha) == ("topk_softmax", True, 7.0, 1.702)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False
    assert c.sliding_window is None  # windowed layers run at any length


def test_logits_match_transformers(tiny):
    hf, path = tiny
    ours, ref = prefill_then_decode(load_model(path), TOKENS), hf_logits(hf, TOKENS)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (12, 96)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)


def test_greedy_tokens_match_transformers(tiny):
    hf, path = tiny
    ours = list(generate(load_model(path), TOKENS[:5], SamplingParams(max_tokens=8)))
    assert ours == hf_greedy(hf, TOKENS[:5], 8)


def test_sinks_window_and_clamp_each_change_the_logits(tiny):
    """The test model exercises what it claims to: without sinks, without the window, the
    logits move far past the tolerance; expert pre-activations pass the clamp's limit."""
    model = load_model(tiny[1])
    base = model.forward(TOKENS, model.new_cache())
    model.config = dataclasses.replace(model.config, layer_windows=())
    assert np.abs(model.forward(TOKENS, model.new_cache()) - base).max() > 1e3 * ATOL
    model = load_model(tiny[1])
    for layer in range(3):
        model.attention_weights(layer)
        model._attn[layer] = dataclasses.replace(model._attn[layer], sinks=None)
    assert np.abs(model.forward(TOKENS, model.new_cache()) - base).max() > 1e3 * ATOL
    w = model.expert_weights(1, 0)
    x = rms_norm(model.embed.take(np.array(TOKENS)), model.attention_weights(1).ffn_norm, 1e-5)
    assert (w.gate.matmul(x) + w.bias[0]).max() > 7.0 and np.abs(w.up.matmul(x) + w.bias[1]).max() > 7.0


def test_gguf_matches_transformers(tiny, tmp_path):
    hf, _ = tiny
    model = load_model(write_gguf(hf, tmp_path / "m.gguf"))
    assert model.format == "gguf" and model.config.family == "gpt_oss"
    assert model.config.layer_windows == (4, 0, 4) and model.config.expert_bias
    np.testing.assert_allclose(prefill_then_decode(model, TOKENS), hf_logits(hf, TOKENS), rtol=0, atol=ATOL)


@pytest.mark.parametrize("qtype, expert_qtype", [(QT.F16, None), (QT.Q8_0, None), (QT.F32, QT.MXFP4)],
                         ids=["F16", "Q8_0", "MXFP4-experts"])
def test_quantized_gguf_matches_transformers_on_the_same_values(tiny, tmp_path, qtype, expert_qtype):
    """F16 and Q8_0 files, and MXFP4 experts (what gpt-oss GGUF files carry; decoded by gguf-py):
    transformers run on the values the file holds gives our logits."""
    hf, _ = tiny
    model = load_model(write_gguf(hf, tmp_path / "m.gguf", qtype, expert_qtype))
    assert model.checkpoint.file.qtype("blk.1.ffn_down_exps.weight") == (expert_qtype or qtype)
    ours = prefill_then_decode(model, TOKENS)
    np.testing.assert_allclose(ours, hf_logits(rounded(hf, qtype, expert_qtype), TOKENS), rtol=0, atol=ATOL)
    if qtype == QT.F16:
        assert ours.argmax(axis=1).tolist() == hf_logits(hf, TOKENS).argmax(axis=1).tolist()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_layer_ranges_on_separate_caches_give_the_whole_models_bits(tiny, fmt, tmp_path):
    """Stages: layers 0:2 on one peer's cache, 2:3 on another's, prefill then decode steps."""
    model = load_model(tiny[1] if fmt == "hf" else write_gguf(tiny[0], tmp_path / "m.gguf"))
    staged, first, second = two_stage_logits(model, TOKENS, PREFILL, 2)
    assert first.k[2] is None and second.k[0] is None
    np.testing.assert_array_equal(staged, prefill_then_decode(model, TOKENS))


def test_a_batch_of_sequences_gives_each_its_solo_bits(tiny):
    assert_batch_gives_solo_bits(load_model(tiny[1]), TOKENS[:PREFILL], TOKENS[3:])


def test_route_matches_transformers_router(tiny):
    import torch

    hf, path = tiny
    model = load_model(path)
    x = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    r = route(model.router_logits(2, x), **model.routing_config(2).kwargs())
    with torch.no_grad():
        _, weights, experts = hf.model.layers[2].mlp.router(torch.from_numpy(x))
    np.testing.assert_array_equal(r.experts, experts.numpy())
    np.testing.assert_allclose(r.weights, weights.numpy(), rtol=0, atol=1e-6)


def test_biased_experts_are_not_cut_into_shipped_slices(tiny, tmp_path):
    from swarm.errors import ModelFileError
    from swarm.peer.weights.slices import ModelSlicer, SliceSpan

    for path in (tiny[1], write_gguf(tiny[0], tmp_path / "m.gguf")):
        with pytest.raises(ModelFileError, match=r"experts of layer 1 have biases.*copy of the model file"):
            ModelSlicer(path).extract(SliceSpan(layer=1, kind="experts", start=0, stop=4))


GPT_OSS_120B_CONFIG = dict(
    model_type="gpt_oss", hidden_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 18, attention_bias=True, swiglu_limit=7.0,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096),
    rope_theta=150000, max_position_embeddings=131072, vocab_size=201088, rms_norm_eps=1e-5,
    tie_word_embeddings=False, hidden_act="silu", eos_token_id=200002, pad_token_id=199999)


def test_published_config_reads_at_full_scale():
    from swarm.compute.config import config_from_hf
    from swarm.errors import ModelFileError

    c = config_from_hf(GPT_OSS_120B_CONFIG, "gpt-oss-120b/config.json")
    assert c.moe_layers == tuple(range(36)) and (c.n_experts, c.top_k, c.moe_intermediate_size) == (128, 4, 2880)
    assert c.layer_windows == (128, 0) * 18 and c.rope_theta == 150000 and c.rope_scaling["factor"] == 32.0
    with pytest.raises(ModelFileError, match=r"quantized with 'mxfp4'.*GGUF"):
        config_from_hf(dict(GPT_OSS_120B_CONFIG, quantization_config=dict(quant_method="mxfp4")), "gpt-oss/config.json")


def test_planner_sizes_and_a_worker_with_the_file(tiny):
    """The coordinator's sizes read the file; a worker that holds the file computes biased
    experts through ``Model.expert_weights`` (biases and clamp included): the engine's bits."""
    from swarm.compute.ffn import expert_rows, swiglu_ffn
    from swarm.peer.coordinator.costmodel import LayerCosts
    from swarm.peer.weights.sizes import model_shape

    model = load_model(tiny[1])
    shape = model_shape(model)
    assert shape.moe_layers == (0, 1, 2) and shape.n_experts == 8 and shape.expert_nbytes == 3 * 32 * 64 * 4
    assert LayerCosts.from_model(model).attn_bytes[0] == model.attention_nbytes(0) > 0
    x = np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32)
    r = route(model.router_logits(1, x), **model.routing_config(1).kwargs())
    e, rows = next(iter(expert_rows(r).items()))
    w = model.expert_weights(1, e)
    assert w.bias is not None and w.swiglu_limit == 7.0
    g = np.minimum(w.gate.matmul(x[rows]) + w.bias[0], np.float32(7))
    u = np.clip(w.up.matmul(x[rows]) + w.bias[1], -7, 7)
    want = w.down.matmul(((u + 1) * g / (1 + np.exp(-1.702 * g))).astype(np.float32)) + w.bias[2]
    np.testing.assert_allclose(swiglu_ffn(w, x[rows]), want, rtol=0, atol=1e-5)
