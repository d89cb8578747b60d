"""Qwen3.5-MoE (``qwen3_5_moe`` / GGUF ``qwen35moe``) against transformers on a tiny random
checkpoint: Gated DeltaNet layers (causal conv state + recurrent state per sequence), gated full
attention (output gate, per-head QK-norm, partial RoPE), zero-centered RMSNorms, softmax top-k
routing beside a sigmoid-gated shared expert. HF safetensors (text-only and the multimodal
layout), GGUF as llama.cpp's converter writes it (tiled value heads), prefill chunks of any
length against token-by-token decoding, a batch of sequences, layer ranges on separate caches,
and which positions a recurrent state can run on from."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from swarm.compute import SamplingParams, generate, load_model
from tests.compute.family_checks import assert_batch_gives_solo_bits, two_stage_logits
from tests.compute.tiny_models import hf_greedy, hf_logits
from tests.compute.tiny_qwen3_5_moe import build, write_gguf

TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, 96, 12)]
PREFILL = 7  # then one decode step per remaining token
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, HF checkpoint dir), built once per module."""
    return build(tmp_path_factory.mktemp("qwen3_5_moe"))


def in_chunks(model, tokens, sizes):
    """Logits [T, V] of ``tokens`` fed in chunks of ``sizes`` (the last repeated) on one cache."""
    cache, out, at, i = model.new_cache(capacity=4), [], 0, 0
    while at < len(tokens):
        n = sizes[min(i, len(sizes) - 1)]
        out.append(model.forward(tokens[at:at + n], cache))
        at, i = at + n, i + 1
    return np.concatenate(out), cache


def test_config_reads_the_family(tiny):
    c = load_model(tiny[1]).config
    assert c.family == "qwen3_5_moe" and c.linear_layers == (0, 2) and c.attn_output_gate
    assert (c.linear_key_heads, c.linear_value_heads, c.linear_key_head_dim, c.linear_conv_kernel) == (2, 4, 8, 4)
    assert c.rotary_dim == 4 and c.qk_norm == "head" and not c.linear_v_tiled
    assert c.moe_layers == (0, 1, 2) and c.norm_topk_prob and c.shared_expert_intermediate_size == 40


def test_logits_match_transformers(tiny):
    hf, path = tiny
    ours, ref = in_chunks(load_model(path), TOKENS, [PREFILL, 1])[0], hf_logits(hf, TOKENS)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (12, 96)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)


def test_greedy_tokens_match_transformers(tiny):
    hf, path = tiny
    ours = list(generate(load_model(path), TOKENS[:5], SamplingParams(max_tokens=8)))
    assert ours == hf_greedy(hf, TOKENS[:5], 8)


def test_gguf_matches_transformers(tiny, tmp_path):
    """llama.cpp's layout: 1 + weight stored, -exp(A_log), value heads tiled (4 over 2 key heads)."""
    hf, _ = tiny
    model = load_model(write_gguf(hf, tmp_path / "m.gguf"))
    assert model.format == "gguf" and model.config.family == "qwen3_5_moe" and model.config.linear_v_tiled
    assert model.config.linear_layers == (0, 2) and model.config.rotary_dim == 4
    np.testing.assert_allclose(in_chunks(model, TOKENS, [PREFILL, 1])[0], hf_logits(hf, TOKENS), rtol=0, atol=ATOL)


def test_multimodal_layout_reads_the_text_model(tiny, tmp_path):
    """A checkpoint as Qwen3.5-MoE ships (``text_config``, tensors under ``model.language_model.``,
    a vision tower beside them) gives the text-only checkpoint's bits and expert slices."""
    from safetensors.numpy import load_file, save_file

    src = tiny[1]
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(model_type="qwen3_5_moe", text_config=text,
                                                     vision_config=dict(depth=1), tie_word_embeddings=False)))
    for f in src.glob("generation_config.json"):
        shutil.copy(f, out)
    np.testing.assert_array_equal(in_chunks(load_model(out), TOKENS, [5])[0],
                                  in_chunks(load_model(src), TOKENS, [5])[0])
    from swarm.peer.weights.slices import ModelSlicer, SliceSpan  # shipped expert slices too

    span = SliceSpan(layer=1, kind="experts", start=2, stop=5)
    assert ModelSlicer(out).extract(span)[0] == ModelSlicer(src).extract(span)[0]


@pytest.mark.parametrize("sizes", [[12], [1], [3], [5, 2]], ids=["one-chunk", "token-by-token", "chunks-of-3", "5-then-2"])
def test_any_chunking_gives_the_same_state_and_logits_bits(tiny, sizes):
    """The recurrence runs position by position whatever the chunk (swarm/compute/deltanet.py)."""
    model = load_model(tiny[1])
    want, want_cache = in_chunks(model, TOKENS, [7, 1])
    got, cache = in_chunks(model, TOKENS, sizes)
    np.testing.assert_array_equal(got, want)
    for layer in model.config.linear_layers:
        a, b = cache.recurrent(layer), want_cache.recurrent(layer)
        assert a.position == b.position == len(TOKENS)
        np.testing.assert_array_equal(a.ssm, b.ssm)
        np.testing.assert_array_equal(a.conv, b.conv)


def test_a_batch_of_sequences_gives_each_its_solo_bits(tiny):
    assert_batch_gives_solo_bits(load_model(tiny[1]), TOKENS[:PREFILL], TOKENS[3:])


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_layer_ranges_on_separate_caches_give_the_whole_models_bits(tiny, fmt, tmp_path):
    """Stages: layers 0:2 on one peer's cache, 2:3 on another's; each holds only its layers' state."""
    model = load_model(tiny[1] if fmt == "hf" else write_gguf(tiny[0], tmp_path / "m.gguf"))
    staged, first, second = two_stage_logits(model, TOKENS, PREFILL, 2)
    assert first.states[2] is None and second.states[0] is None and second.k[1] is None
    np.testing.assert_array_equal(staged, in_chunks(model, TOKENS, [PREFILL, 1])[0])


def test_a_state_runs_on_from_its_position_the_one_before_or_zero(tiny):
    """A step re-run from the same position (a retried step) gives its bits again; rows from an
    earlier position are refused by name (the sequence must be replayed from 0)."""
    model = load_model(tiny[1])
    cache = model.new_cache()
    model.forward(TOKENS[:PREFILL], cache)
    first = model.forward(TOKENS[PREFILL:PREFILL + 1], cache)
    assert cache.resumes(PREFILL + 1) and cache.resumes(PREFILL) and cache.resumes(0)
    assert not cache.resumes(3) and cache.resumes(3, 1, 2)  # layer 1 keeps KV rows, no state
    cache.truncate(PREFILL)
    np.testing.assert_array_equal(model.forward(TOKENS[PREFILL:PREFILL + 1], cache), first)
    cache.truncate(3)
    with pytest.raises(ValueError, match=r"recurrent state holds position 8; rows from position 3 need the "
                                         r"sequence from position 0"):
        model.forward(TOKENS[3:5], cache)
    cache.truncate(0)
    np.testing.assert_array_equal(model.forward(TOKENS[:PREFILL], cache),
                                  model.forward(TOKENS[:PREFILL], model.new_cache()))


def test_prefix_reuse_takes_a_recurrent_cache_only_where_its_state_runs_on(tiny):
    """A conversation's next turn continues the whole cache (its state's position) with the bits of
    a fresh prefill; a prompt that shares only part of it finds no entry (the state cannot go back)."""
    from swarm.compute.prefix import PrefixStore

    model = load_model(tiny[1])
    store, cache = PrefixStore(), model.new_cache()
    model.forward(TOKENS[:8], cache)
    store.keep(TOKENS[:8], cache, None, None)
    assert store.take(TOKENS[:6] + [1, 2, 3], None) == (None, 0)
    taken, n = store.take(TOKENS, None)
    assert taken is cache and n == 8
    np.testing.assert_array_equal(model.forward(TOKENS[8:], taken, last_only=True),
                                  model.forward(TOKENS, model.new_cache(), last_only=True))


# llama.cpp's regex for tokenizer.ggml.pre "qwen35" as src/llama-vocab.cpp writes it (case folded by hand)
LLAMA_CPP_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_qwen35_gguf_text_split_is_llama_cpps(tmp_path):
    """Qwen3.5 GGUFs name their split ``qwen35``: Qwen2's with combining marks kept inside words
    (Devanagari, Thai, accents written apart), checked against llama.cpp's regex run by ``regex``."""
    import regex

    from swarm.compute.tokenizer import _gguf_pre_tokenizer

    text = "नमस्ते दुनिया! It's 2026, café\u0301 ๑๒ สวัสดี\n\n  def f(x):\treturn x**2 🙂🙂 I'LL"
    ours = [span for _, span in _gguf_pre_tokenizer(tmp_path / "m.gguf", "qwen35").pre_tokenize_str(text)]
    assert ours == [m.span() for m in regex.finditer(LLAMA_CPP_QWEN35, text)]
    qwen2 = [span for _, span in _gguf_pre_tokenizer(tmp_path / "m.gguf", "qwen2").pre_tokenize_str(text)]
    assert qwen2 != ours  # the marks matter on this text


@pytest.mark.parametrize("T", [1, 5])
def test_compiled_recurrence_matches_float64_and_leaves_the_old_state(T):
    """The delta rule (transformers ``torch_recurrent_gated_delta_rule``) in float64 numpy is the
    oracle; odd head sizes; the state handed in stays as it was (a re-sent step needs it)."""
    from swarm.compute.deltanet import gated_delta_rule

    rng = np.random.default_rng(T)
    nv, dk, dv = 3, 5, 7
    q, k = (rng.standard_normal((T, nv, dk)).astype(np.float32) / 3 for _ in range(2))
    v = rng.standard_normal((T, nv, dv)).astype(np.float32)
    decay, beta = (rng.uniform(0.2, 1, (T, nv)).astype(np.float32) for _ in range(2))
    ssm = rng.standard_normal((nv, dk, dv)).astype(np.float32)
    before = ssm.copy()
    out, state = gated_delta_rule(q, k, v, decay, beta, ssm)
    s, want = ssm.astype(np.float64), np.empty((T, nv, dv))
    for t in range(T):
        s = s * decay[t, :, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", s, k[t])) * beta[t, :, None]
        s = s + k[t, :, :, None] * delta[:, None, :]
        want[t] = np.einsum("hkv,hk->hv", s, q[t])
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(state, s, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ssm, before)


@pytest.mark.slow
def test_llama_cpps_converter_output_gives_transformers_logits_and_token_ids(smollm2_path, tmp_path):
    """The checkpoint, with the MTP block releases carry, converted by llama.cpp's own
    ``convert_hf_to_gguf.py`` (its MTP block as an extra layer, value heads tiled, norms
    ``1 + weight``): our loader gives transformers' logits and greedy tokens, and the file's
    ``qwen35`` split over SmolLM2's vocabulary gives the ids of transformers' Qwen3.5 tokenizer
    (which applies that split to any vocabulary) on multilingual, code and emoji text."""
    from transformers import AutoTokenizer

    from swarm.compute.tokenizer import load_tokenizer
    from tests.compute.test_tokenizer import TEXTS
    from tests.compute.test_tokenizer_gguf_kinds import CORPUS
    from tests.compute.tiny_qwen3_5_moe import add_mtp_layer, convert_with_llama_cpp

    hf_dir = tmp_path / "hf"
    hf, _ = build(hf_dir, vocab_size=49160)
    add_mtp_layer(hf_dir)
    AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name).save_pretrained(hf_dir)
    path = convert_with_llama_cpp(hf_dir, tmp_path / "m.gguf")
    model = load_model(path)
    assert model.metadata["qwen35moe.nextn_predict_layers"] == 1 and model.config.n_layers == 3
    assert model.config.linear_layers == (0, 2) and model.config.linear_v_tiled
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 49152, 12)]
    ours = in_chunks(model, tokens, [PREFILL, 1])[0]
    np.testing.assert_allclose(ours, hf_logits(hf, tokens), rtol=0, atol=ATOL)
    assert list(generate(model, tokens[:5], SamplingParams(max_tokens=6))) == hf_greedy(hf, tokens[:5], 6)
    want_tokenizer, ours_tokenizer = AutoTokenizer.from_pretrained(hf_dir), load_tokenizer(path)
    assert type(want_tokenizer).__name__ == "Qwen3_5Tokenizer"
    for text in [*TEXTS, *CORPUS]:
        assert ours_tokenizer.encode(text, add_special_tokens=False) == \
            want_tokenizer.encode(text, add_special_tokens=False), text


def test_the_released_config_reads_at_full_scale():
    """transformers' own Qwen3_5MoeConfig (Qwen3.5-35B-A3B's shape, ``text_config`` nested in the
    multimodal config) read, and sized for the planner."""
    from transformers import Qwen3_5MoeConfig

    from swarm.compute.config import config_from_hf
    from swarm.peer.plan import ModelShape

    c = config_from_hf(Qwen3_5MoeConfig().to_dict(), "Qwen3.5-35B-A3B/config.json")
    assert c.family == "qwen3_5_moe" and c.n_layers == 40 and (c.hidden_size, c.head_dim) == (2048, 256)
    assert c.linear_layers == tuple(i for i in range(40) if i % 4 != 3) and c.rotary_dim == 64
    assert (c.linear_key_heads, c.linear_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (16, 32, 128, 128)
    assert (c.n_experts, c.top_k, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert c.vocab_size == 248320 and not c.tie_word_embeddings
    shape = ModelShape.from_config(c)
    assert shape.moe_layers == tuple(range(40)) and not shape.dense_layers and shape.n_experts == 256


def test_the_memory_plan_prices_states_for_linear_layers_and_kv_for_full_ones():
    """Qwen3.5-35B-A3B's shape: a full-attention layer reserves keys and values of its 2 KV heads
    for the context; a linear-attention layer the states (twice: the one before the last step
    too) of the sequences that may hold one — --max-batch running and the prefix store's kept
    ones — whatever the context. Measured against what the engine allocates."""
    from transformers import Qwen3_5MoeConfig

    from swarm.compute.config import config_from_hf
    from swarm.compute.deltanet import RecurrentState
    from swarm.compute.prefix import MAX_STATE_ENTRIES
    from swarm.compute.serving import default_max_batch
    from swarm.peer import memory
    from swarm.peer.plan import ModelShape
    from swarm.peer.plan.shape import reserve_of

    c = config_from_hf(Qwen3_5MoeConfig().to_dict(), "Qwen3.5-35B-A3B/config.json")
    state = RecurrentState(c)
    state.advance(0, 1, state.conv.copy(), state.ssm.copy())
    state.advance(1, 2, state.conv.copy(), state.ssm.copy())  # now it keeps the previous step's too
    held = sum(a.nbytes for a in (state.conv, state.ssm, *state.previous[1:]))
    assert c.state_values_per_sequence * 4 == held
    r = reserve_of(c, context=4096)
    full = 4096 * 2 * 2 * 256 * 4
    sequences = default_max_batch() + MAX_STATE_ENTRIES
    assert r["kv_bytes"] == tuple(full if i % 4 == 3 else sequences * held for i in range(40))
    assert r["kv_layer_bytes"] == full
    shape = ModelShape.from_config(c)
    whole = shape.coordinator_fixed_bytes()
    assert whole - shape.resident_nbytes - shape.coordinator_step_bytes == sum(shape.kv_bytes)
    assert shape.coordinator_fixed_bytes(kv_layers=4) - shape.coordinator_fixed_bytes(kv_layers=3) == shape.kv_bytes[3]
    assert reserve_of(c, context=4096, sequences=1)["kv_bytes"][0] == held


def test_kept_caches_with_states_are_bounded(tiny):
    """The prefix store keeps at most MAX_STATE_ENTRIES caches holding recurrent states (each a
    state per linear layer, which positions do not bound), dropping the least recently used."""
    from swarm.compute.model import KVCache
    from swarm.compute.prefix import MAX_STATE_ENTRIES, PrefixStore

    model = load_model(tiny[1])
    store = PrefixStore(max_entries=100)
    caches = []
    for n in range(MAX_STATE_ENTRIES + 3):
        cache = KVCache(model.config, 4)
        for layer in model.config.linear_layers:  # as if two positions ran
            state = cache.recurrent(layer)
            state.advance(0, 2, state.conv, state.ssm)
        cache.length = 2
        caches.append(cache)
        store.keep((n, n), cache, None, None)
    assert len(store) == MAX_STATE_ENTRIES and store.evicted == 3
    assert store.take((0, 0, 5), None) == (None, 0)  # the oldest went
    taken, reused = store.take((MAX_STATE_ENTRIES + 2, MAX_STATE_ENTRIES + 2, 5), None)
    assert taken is caches[-1] and reused == 2


def test_planner_sizes_count_the_linear_attention_weights(tiny):
    from swarm.peer.coordinator.costmodel import LayerCosts
    from swarm.peer.weights.sizes import model_shape

    model = load_model(tiny[1])
    shape = model_shape(model)
    assert shape.moe_layers == (0, 1, 2) and shape.expert_nbytes == 3 * 32 * 64 * 4
    C = 2 * 2 * 8 + 4 * 8  # the conv channels: queries, keys, values
    linear = (C * 64 + 32 * 64 + 4 * 64 * 2 + 64 * 32) * 4  # in_proj_qkv, in_proj_z, in_proj_b/a, out_proj
    gated = (2 * 64 * 64 + 2 * 32 * 64 + 64 * 64) * 4  # q with its gate, k, v, o
    assert [model.attention_nbytes(i) for i in range(3)] == [linear, gated, linear]
    assert LayerCosts.from_model(model).attn_bytes[:3] == (linear, gated, linear)


def test_bad_hybrid_configs_are_refused_by_name(tiny):
    from swarm.compute.config import config_from_hf
    from swarm.errors import ModelFileError

    cfg = json.loads((tiny[1] / "config.json").read_text())
    with pytest.raises(ModelFileError, match=r"layer_types must name 'linear_attention' or 'full_attention' for each "
                                             r"of the 3 layers, got \['linear_attention', 'sliding_attention'"):
        config_from_hf(dict(cfg, layer_types=["linear_attention", "sliding_attention", "full_attention"]), "c.json")
    with pytest.raises(ModelFileError, match=r"value heads a multiple of the key heads.*\(4, 2, 3, 8, 8\)"):
        config_from_hf(dict(cfg, linear_num_value_heads=3), "c.json")
    with pytest.raises(ModelFileError, match=r"model_type 'qwen3_5' is not supported"):
        config_from_hf(dict(cfg, model_type="qwen3_5"), "c.json")
