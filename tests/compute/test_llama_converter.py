"""GGUF files written by llama.cpp's own ``convert_hf_to_gguf.py`` (tests/compute/llama_converter.py)
from the tiny transformers checkpoints of every family: our GGUF loader gives transformers' greedy
tokens and logits, and the converter's tokenizer metadata gives transformers' token ids.

The converter names the pre-tokenizer by hashing how the checkpoint's tokenizer splits a probe
text, so each checkpoint carries a real tokenizer it knows: the default model's (SmolLM2,
``smollm``), with GLM's chat tokens added for the GLM converter, which reads them. Configs follow
what the released models' config.json say where the converter relies on it (DeepSeek-V3's
``scoring_func``; OLMoE's epsilon, which the converter writes as 1e-5 whatever the config says).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import SamplingParams, generate, load_model
from swarm.compute.tokenizer import load_tokenizer
from tests.compute import tiny_gpt_oss, tiny_models, tiny_sigmoid_moe
from tests.compute.llama_converter import convert
from tests.compute.test_tokenizer import TEXTS
from tests.compute.test_tokenizer_gguf_kinds import CORPUS

GLM_TOKENS = ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>"]
VOCAB = 49152 + 8  # SmolLM2's ids, GLM's chat tokens, a few unused
TOKENS = [int(t) for t in np.random.default_rng(5).integers(0, 49152, 12)]
ATOL = 2e-5  # the float32 bound of the family tests (1e-5 over 96 logits), over 49160 logits here

# name → (builder, config overrides beside the vocabulary, extra config.json keys)
CASES = {
    "llama": (tiny_models.build_tiny, {}, {}),
    "qwen3": (tiny_models.build_tiny, {}, {}),
    "mixtral": (tiny_models.build_tiny, {}, {}),
    "qwen3_moe": (tiny_models.build_tiny, {"mlp_only_layers": []}, {}),  # the converter maps no dense layer
    "olmoe": (tiny_models.build_tiny, {"rms_norm_eps": 1e-5, "clip_qkv": None}, {}),
    "glm4_moe": (tiny_sigmoid_moe.build, {}, {}),
    "deepseek_v3": (tiny_sigmoid_moe.build, {}, {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}),
    "minimax_m2": (tiny_sigmoid_moe.build, {}, {}),
    "gpt_oss": (None, {}, {}),
}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, smollm2_tokenizer):
    """(name, outtype) → (transformers model, GGUF path): built and converted once per module."""
    done: dict = {}

    def get(name: str, outtype: str = "f32"):
        if (name, outtype) not in done:
            builder, overrides, released = CASES[name]
            hf_dir = tmp_path_factory.mktemp(name)
            if builder is None:
                hf, _ = tiny_gpt_oss.build(hf_dir, vocab_size=VOCAB, **overrides)
            else:
                hf, _ = builder(name, hf_dir, vocab_size=VOCAB, **overrides)
            cfg = json.loads((hf_dir / "config.json").read_text())
            (hf_dir / "config.json").write_text(json.dumps({**cfg, **released}))
            smollm2_tokenizer.save_pretrained(hf_dir)
            if name == "glm4_moe":
                from transformers import AutoTokenizer

                glm = AutoTokenizer.from_pretrained(hf_dir)
                glm.add_tokens(GLM_TOKENS, special_tokens=True)
                glm.save_pretrained(hf_dir)
            done[name, outtype] = hf, convert(hf_dir, hf_dir / f"{name}-{outtype}.gguf", outtype)
        return done[name, outtype]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_converted_gguf_gives_transformers_tokens_and_logits(converted, name):
    hf, path = converted(name)
    model = load_model(path)
    assert model.format == "gguf" and model.config.family == hf.config.model_type
    assert model.config.n_layers == hf.config.num_hidden_layers  # GLM's NextN/MTP block skipped
    ours, ref = model.forward(TOKENS, model.new_cache()), tiny_models.hf_logits(hf, TOKENS)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (12, VOCAB)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)
    assert list(generate(model, TOKENS[:5], SamplingParams(max_tokens=6))) == tiny_models.hf_greedy(hf, TOKENS[:5], 6)


def as_q8_0_file(hf_model):
    """A copy of ``hf_model`` holding the values the converter's ``--outtype q8_0`` file holds:
    matrices whose rows fit Q8_0's 32-weight blocks through Q8_0, other matrices through F16,
    routers, norms and biases float32 (its rule for llama-arch and GLM files)."""
    import copy

    import torch

    twin = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.ndim < 2 or name.endswith("mlp.gate.weight"):
                continue
            a = p.numpy()
            if a.shape[-1] % 32:
                p.copy_(p.half().float())
            else:
                q = gguf.quants.dequantize(gguf.quants.quantize(a, QT.Q8_0), QT.Q8_0).reshape(a.shape)
                p.copy_(torch.from_numpy(q))
    return twin


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "glm4_moe"])
def test_q8_0_conversion_gives_the_files_values_tokens(converted, name):
    """Against transformers on the values the file holds: Q8_0 where rows fit its blocks, F16
    where they do not (the converter's fallback), routers and norms float32."""
    hf, path = converted(name, "q8_0")
    model = load_model(path)
    layer = model.config.moe_layers[0]
    assert model.checkpoint.file.qtype(f"blk.{layer}.ffn_up_exps.weight") == QT.Q8_0
    twin = as_q8_0_file(hf)
    ours = model.forward(TOKENS, model.new_cache())
    np.testing.assert_allclose(ours, tiny_models.hf_logits(twin, TOKENS), rtol=0, atol=ATOL)
    assert list(generate(model, TOKENS[:5], SamplingParams(max_tokens=6))) == tiny_models.hf_greedy(twin, TOKENS[:5], 6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "glm4_moe"])
def test_converted_tokenizer_gives_transformers_ids(converted, smollm2_tokenizer, name):
    """The converter's ``tokenizer.ggml.*`` (pre ``smollm``) read by us encodes as the checkpoint's
    own tokenizer does, GLM's added chat tokens included."""
    _, path = converted(name)
    ours = load_tokenizer(path)
    assert load_model(path).metadata["tokenizer.ggml.pre"] == "smollm"
    for text in [*TEXTS, *CORPUS, "[gMASK]<sop><|user|>\nhi<|assistant|>"]:
        want = smollm2_tokenizer.encode(text, add_special_tokens=False)
        if name == "glm4_moe" and "[gMASK]" in text:
            assert ours.encode(text, add_special_tokens=False)[:3] == [49152, 49153, 49154]
            continue
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.decode(want) == smollm2_tokenizer.decode(want, skip_special_tokens=True)
