"""A tiny random gpt-oss (``gpt_oss``) checkpoint built by transformers, and the same weights
written as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` (``GptOssModel``) writes a
checkpoint whose experts are not MXFP4: arch ``gpt-oss``, gate/up split out of the interleaved
``gate_up_proj`` (and its bias), expert matrices transposed to [E, out, in], ``sinks`` as
``attn_sinks.weight``, YaRN and the sliding window in the metadata."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np

from tests.compute.tiny_gguf import add_weight

ROUTER_SCALE = 3.0
EXPERT_SCALE = 0.5  # gate/up weights large enough that the SwiGLU clamp (limit 7) bites
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
            beta_slow=1.0, truncate=False)
CONFIG = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=96, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
              max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.08,
              rope_parameters=YARN, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SEED = 31


def build(out_dir: Path, **overrides):
    """Create, save and return ``(hf_model, out_dir)`` (float32, eval): random sinks and biases,
    routers scaled so the top-k is decisive."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", **dict(CONFIG, **overrides))
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager",
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.sinks.copy_(torch.randn(attn.sinks.shape))
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                lin.bias.copy_(torch.randn(lin.bias.shape) * 0.1)
            mlp.router.weight.copy_(torch.randn(mlp.router.weight.shape) * 0.08 * ROUTER_SCALE)
            mlp.router.bias.copy_(torch.randn(mlp.router.bias.shape) * 0.3)
            ex = mlp.experts
            ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape) * EXPERT_SCALE)
            ex.gate_up_proj_bias.copy_(torch.randn(ex.gate_up_proj_bias.shape))
            ex.down_proj.copy_(torch.randn(ex.down_proj.shape) * 0.05)
            ex.down_proj_bias.copy_(torch.randn(ex.down_proj_bias.shape) * 0.1)
    model.save_pretrained(out_dir)
    return model, out_dir


def through(a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """``a`` [..., in] as a GGUF of ``qtype`` holds it (rows that fit its blocks; else as is)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F32 or a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return a
    return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape)


def rounded(hf_model, qtype: gguf.GGMLQuantizationType, expert_qtype: gguf.GGMLQuantizationType | None = None):
    """A copy of ``hf_model`` holding the values :func:`write_gguf` writes with these types:
    every matrix through ``qtype`` (the experts, in the file's [E, out, in] orientation,
    through ``expert_qtype`` when given); biases, norms and sinks stay float32."""
    import torch

    twin = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            a = p.numpy()
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                t = through(a.transpose(0, 2, 1), expert_qtype or qtype).transpose(0, 2, 1)
                p.copy_(torch.from_numpy(np.ascontiguousarray(t)))
            elif p.ndim >= 2 and not name.endswith("_bias"):
                p.copy_(torch.from_numpy(through(a, qtype)))
    return twin


def write_gguf(hf_model, path: Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               expert_qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """Write ``hf_model`` as llama.cpp's converter does; matrices whose rows fit ``qtype``'s
    blocks in ``qtype`` (the experts in ``expert_qtype`` when given, e.g. MXFP4), the rest (biases
    included, stacked or not) F32."""
    cfg = hf_model.config
    n = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, n)
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def put(hf_name: str, a: np.ndarray, qt: gguf.GGMLQuantizationType = qtype) -> None:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        add_weight(w, name, a, gguf.GGMLQuantizationType.F32 if name.endswith(".bias") else qt)

    for name in list(state):
        a = state.pop(name)
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.endswith("sinks"):
            put(name + ".weight", a)
        elif name.endswith("experts.gate_up_proj_bias"):
            put(name.replace("gate_up_proj_bias", "gate_proj.bias"), a[..., 0::2])
            put(name.replace("gate_up_proj_bias", "up_proj.bias"), a[..., 1::2])
        elif name.endswith("experts.gate_up_proj"):
            t = a.transpose(0, 2, 1)  # [E, 2F, H]
            put(name.replace("gate_up_proj", "gate_proj.weight"), t[:, 0::2], expert_qtype or qtype)
            put(name.replace("gate_up_proj", "up_proj.weight"), t[:, 1::2], expert_qtype or qtype)
        elif name.endswith("experts.down_proj_bias"):
            put(name.replace("down_proj_bias", "down_proj.bias"), a)
        elif name.endswith("experts.down_proj"):
            put(name.replace("down_proj", "down_proj.weight"), a.transpose(0, 2, 1), expert_qtype or qtype)
        else:
            put(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def mxfp4_blocks(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a`` [..., out, in] (in a multiple of 32) as gpt-oss's safetensors hold MXFP4 experts:
    ``(blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32])``, one E8M0 exponent per
    32 weights and two E2M1 codes a byte, the even element in the low nibble (transformers'
    ``convert_moe_packed_tensors``). The values are gguf-py's MXFP4 quantization of ``a``, whose
    block keeps the exponent, then element j in the low and j + 16 in the high nibble of byte j."""
    q = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)
    q = q.reshape(*a.shape[:-1], a.shape[-1] // 32, 17)
    codes = np.concatenate([q[..., 1:] & 0x0F, q[..., 1:] >> 4], axis=-1)  # [..., in/32, 32] in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(q[..., 0])


def save_mxfp4(hf_model, out_dir: Path) -> Path:
    """Re-save ``out_dir`` (``hf_model`` saved there) with its experts in MXFP4 as openai
    publishes gpt-oss: ``experts.{gate_up,down}_proj_{blocks,scales}`` [E, out, …] beside float
    biases, and ``quantization_config.quant_method = "mxfp4"``. Their values are those
    :func:`rounded` gives with ``expert_qtype`` MXFP4."""
    import json

    from safetensors.numpy import save_file

    tensors = {k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items()}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_blocks(tensors.pop(name).transpose(0, 2, 1))  # [E, in, out] → [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    for old in out_dir.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir
