"""GGUF files written by llama.cpp's own ``convert_hf_to_gguf.py`` (tests/compute/llama_converter.py)
from the tiny transformers checkpoints of every family: our GGUF loader gives transformers' greedy
tokens and logits, and the converter's tokenizer metadata gives transformers' token ids.

The converter names the pre-tokenizer by hashing how the checkpoint's tokenizer splits a probe
text, so each checkpoint carries a real tokenizer it knows: the default model's (SmolLM2,
``smollm``; GLM's chat tokens added for the GLM converter, which reads them), or Qwen2's and
Qwen3.5's real vocabularies (tests/compute/qwen_vocab.py). Configs follow what the released
models' config.json say where the converter relies on it (DeepSeek-V3's ``scoring_func``; OLMoE's
epsilon, which the converter writes as 1e-5 whatever the config says).
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import SamplingParams, generate, load_model
from swarm.compute.tensors import GGUFFile
from swarm.compute.tokenizer import load_tokenizer
from tests.compute import qwen_vocab, tiny_gpt_oss, tiny_models, tiny_qwen3_5_moe, tiny_sigmoid_moe
from tests.compute.llama_converter import ENV_VAR, ConverterMissing, convert, start_convert
from tests.compute.test_family_qwen3_5_moe import ATOL as QWEN3_5_MOE_ATOL
from tests.compute.test_tokenizer import TEXTS
from tests.compute.test_tokenizer_gguf_kinds import CORPUS

GLM_TOKENS = ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>"]
VOCAB = 49152 + 8  # SmolLM2's ids, GLM's chat tokens, a few unused
TOKENS = [int(t) for t in np.random.default_rng(5).integers(0, 49152, 12)]
ATOL = 2e-5  # the float32 bound of the family tests (1e-5 over 96 logits), over 49,160 to 248,047 here
FAMILY_ATOL = {"qwen3_5_moe": QWEN3_5_MOE_ATOL}  # its recurrent layers' own bound

# name → (build(out_dir, **config), config overrides, extra config.json keys, Qwen vocabulary or
# None for SmolLM2's): transformers gives qwen2's and qwen3_5_moe's model types Qwen's own split
# whatever tokenizer.json says, so they carry Qwen's real vocabularies (tied embeddings: smaller)
CASES = {
    "llama": (partial(tiny_models.build_tiny, "llama"), {}, {}, None),
    "qwen2": (partial(tiny_models.build_tiny, "qwen2"), {"tie_word_embeddings": True}, {}, "qwen2"),
    "qwen3": (partial(tiny_models.build_tiny, "qwen3"), {}, {}, None),
    "mixtral": (partial(tiny_models.build_tiny, "mixtral"), {}, {}, None),
    # the converter has no name for a dense MLP in a qwen3moe file
    "qwen3_moe": (partial(tiny_models.build_tiny, "qwen3_moe"), {"mlp_only_layers": []}, {}, None),
    "olmoe": (partial(tiny_models.build_tiny, "olmoe"), {"rms_norm_eps": 1e-5, "clip_qkv": None}, {}, None),
    "glm4_moe": (partial(tiny_sigmoid_moe.build, "glm4_moe"), {}, {}, None),
    "deepseek_v3": (partial(tiny_sigmoid_moe.build, "deepseek_v3"), {},
                    {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, None),
    "minimax_m2": (partial(tiny_sigmoid_moe.build, "minimax_m2"), {}, {}, None),
    "gpt_oss": (tiny_gpt_oss.build, {}, {}, None),
    "qwen3_5_moe": (tiny_qwen3_5_moe.build, {"tie_word_embeddings": True}, {}, "qwen35"),
}


def add_mtp_layer(hf_dir: Path) -> None:
    """Give a saved tiny Qwen3.5-MoE checkpoint the MTP module the released ones carry
    (``mtp_num_hidden_layers: 1``; ``mtp.fc``, its norms and one full-attention layer under
    ``mtp.layers.0``, here layer 1's weights), which the converter writes as a NextN block."""
    from safetensors.numpy import load_file, save_file

    file = hf_dir / "model.safetensors"
    tensors = load_file(str(file))
    h = tensors["model.norm.weight"].shape[0]
    rng = np.random.default_rng(0)
    mtp = {k.replace("model.layers.1.", "mtp.layers.0."): v.copy() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    mtp["mtp.fc.weight"] = rng.standard_normal((h, 2 * h)).astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = rng.standard_normal(h).astype(np.float32)
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


# The conversions in the order this module's tests ask for them: each test's request starts the
# next one too, which runs (a subprocess) while the test computes and its own conversion ends.
ORDER = [(name, "f32") for name in CASES if name != "mixtral"] + [("mixtral", "q8_0"), ("gpt_oss", "mxfp4")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, smollm2_tokenizer):
    """(name, outtype) → (transformers model, GGUF path): built and converted once per module.
    Outtype ``mxfp4`` (gpt_oss): a checkpoint with MXFP4 experts, the model holding their values."""
    started: dict = {}  # (name, outtype) → (transformers model, Conversion)
    done: dict = {}

    def start(name: str, outtype: str) -> None:
        builder, overrides, released, qwen = CASES[name]
        hf_dir = tmp_path_factory.mktemp(name)
        vocab = VOCAB if qwen is None else qwen_vocab.write_tokenizer(qwen, hf_dir)
        hf, _ = builder(hf_dir, vocab_size=vocab, **overrides)
        if outtype == "mxfp4":  # experts stored as openai publishes gpt-oss; the rest converted as f32
            tiny_gpt_oss.save_mxfp4(hf, hf_dir)
            hf = tiny_gpt_oss.rounded(hf, QT.F32, QT.MXFP4)
        cfg = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**cfg, **released}))
        if qwen is None:
            smollm2_tokenizer.save_pretrained(hf_dir)
        if name == "glm4_moe":
            from transformers import AutoTokenizer

            glm = AutoTokenizer.from_pretrained(hf_dir)
            glm.add_tokens(GLM_TOKENS, special_tokens=True)
            glm.save_pretrained(hf_dir)
        if name == "qwen3_5_moe":
            add_mtp_layer(hf_dir)
        outfile = hf_dir / f"{name}-{outtype}.gguf"
        started[name, outtype] = hf, start_convert(hf_dir, outfile, "f32" if outtype == "mxfp4" else outtype)

    def get(name: str, outtype: str = "f32"):
        key = (name, outtype)
        if key not in done:
            if key not in started:
                start(*key)
            following = ORDER[ORDER.index(key) + 1:] if key in ORDER else []
            if (upcoming := next((k for k in following if k not in started), None)) is not None:
                start(*upcoming)
            hf, conversion = started[key]
            done[key] = hf, conversion.wait()
        return done[key]

    try:
        yield get
    finally:
        for _, conversion in started.values():
            conversion.kill()  # one started for a test that did not run


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in CASES if name != "mixtral"])  # mixtral: as Q8_0 below
def test_converted_gguf_gives_transformers_tokens_and_logits(converted, name):
    hf, path = converted(name)
    model = load_model(path)
    assert model.format == "gguf" and model.config.family == hf.config.model_type.removesuffix("_text")
    assert model.config.n_layers == hf.config.num_hidden_layers
    if name in ("glm4_moe", "qwen3_5_moe"):  # the file holds their NextN/MTP block, which is skipped
        assert model.metadata[f"{model.metadata['general.architecture']}.nextn_predict_layers"] == 1
    ours, ref = model.forward(TOKENS, model.new_cache()), tiny_models.hf_logits(hf, TOKENS)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (12, hf.config.vocab_size)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=FAMILY_ATOL.get(name, ATOL))
    assert list(generate(model, TOKENS[:5], SamplingParams(max_tokens=6))) == tiny_models.hf_greedy(hf, TOKENS[:5], 6)


def as_q8_0_file(hf_model):
    """A copy of ``hf_model`` holding the values the converter's ``--outtype q8_0`` file holds:
    matrices whose rows fit Q8_0's 32-weight blocks through Q8_0, other matrices through F16,
    routers, norms and biases float32."""
    import copy

    import torch

    twin = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                fits = p.shape[-1] % 32 == 0
                p.copy_(torch.from_numpy(tiny_gpt_oss.through(p.numpy(), QT.Q8_0)) if fits else p.half().float())
    return twin


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral"])
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
@pytest.mark.parametrize(("name", "pre"), [("llama", "smollm"), ("glm4_moe", "smollm"), ("qwen2", "qwen2"),
                                           ("qwen3_5_moe", "qwen35")])
def test_converted_tokenizer_gives_transformers_ids(converted, name, pre):
    """The converter's ``tokenizer.ggml.*`` read by us encodes as transformers' tokenizer of the
    checkpoint does (SmolLM2's; Qwen2's and Qwen3.5's real vocabularies), added chat tokens included."""
    from transformers import AutoTokenizer

    _, path = converted(name)
    oracle = AutoTokenizer.from_pretrained(path.parent)
    ours = load_tokenizer(path)
    assert GGUFFile(path).kv["tokenizer.ggml.pre"] == pre
    for text in [*TEXTS, *CORPUS, "[gMASK]<sop><|user|>\nhi<|assistant|><|im_start|>user\nhi<|im_end|>"]:
        want = oracle.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.decode(want) == oracle.decode(want, skip_special_tokens=True)


@pytest.mark.slow
def test_gpt_oss_mxfp4_checkpoint_converts_to_mxfp4_experts_we_read(converted):
    """gpt-oss as published (MXFP4 ``_blocks``/``_scales``): the converter repacks the experts into
    GGUF MXFP4 blocks, which give transformers' tokens and logits on the same values."""
    hf, path = converted("gpt_oss", "mxfp4")
    model = load_model(path)
    for part in ("gate", "up", "down"):
        assert model.checkpoint.file.qtype(f"blk.0.ffn_{part}_exps.weight") == QT.MXFP4
    np.testing.assert_allclose(model.forward(TOKENS, model.new_cache()), tiny_models.hf_logits(hf, TOKENS),
                               rtol=0, atol=ATOL)
    assert list(generate(model, TOKENS[:5], SamplingParams(max_tokens=6))) == tiny_models.hf_greedy(hf, TOKENS[:5], 6)


def test_a_missing_converter_is_named_with_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(ConverterMissing, match=r"nowhere.*python3 -m tests\.compute\.llama_converter"):
        convert(tmp_path, tmp_path / "m.gguf")
