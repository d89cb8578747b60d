"""Tiny random GLM-4.5 (``glm4_moe``), DeepSeek-V3 (``deepseek_v3``) and MiniMax-M2
(``minimax_m2``) checkpoints built by transformers, and the same weights written as GGUF the way
llama.cpp's ``convert_hf_to_gguf.py`` writes them (arch ``glm4moe``, ``deepseek2``, ``minimax-m2``).

All three route with sigmoid scores and a selection-only bias (``e_score_correction_bias``,
set to random values here so that it changes choices); GLM-4.5 and DeepSeek-V3 add
``routed_scaling_factor`` and a fused shared expert after ``first_k_dense_replace`` dense layers,
DeepSeek-V3 limits the top-k to the best groups of experts. Routers are scaled by ``ROUTER_SCALE`` so the choices are decisive
without saturating the sigmoid (a saturated sigmoid ties at 1.0).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np

from tests.compute.tiny_gguf import add_weight

ROUTER_SCALE = 3.0
_BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=96, intermediate_size=48,
             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, initializer_range=0.08,
             max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0,
            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)

# name → (model_type, config kwargs, seed)
TINY = {
    "glm4_moe": ("glm4_moe", dict(_BASE, num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True,
                                  partial_rotary_factor=0.5, n_group=1, topk_group=1, num_nextn_predict_layers=1), 21),
    "glm4_moe_air": ("glm4_moe", dict(_BASE, num_key_value_heads=2, head_dim=24, attention_bias=True,
                                      use_qk_norm=False, partial_rotary_factor=0.5, first_k_dense_replace=2), 22),
    "deepseek_v3": ("deepseek_v3", dict(_BASE, num_key_value_heads=4, n_group=4, topk_group=2, q_lora_rank=24, kv_lora_rank=32,
                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_parameters=YARN), 23),
    "deepseek_v3_no_q_lora": ("deepseek_v3", dict(_BASE, num_key_value_heads=4, n_group=2, topk_group=1, q_lora_rank=None, kv_lora_rank=32,
                                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16), 24),
    "minimax_m2": ("minimax_m2", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, rotary_dim=16, vocab_size=96, intermediate_size=32,
                                      num_local_experts=8, num_experts_per_tok=2, initializer_range=0.08,
                                      max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      rope_theta=5e6, bos_token_id=1, eos_token_id=2), 25),
}
GGUF_ARCH = {"glm4_moe": "glm4moe", "deepseek_v3": "deepseek2", "minimax_m2": "minimax-m2"}
_NAME_MAPS = {"glm4moe": gguf.MODEL_ARCH.GLM4_MOE, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
              "minimax-m2": gguf.MODEL_ARCH.MINIMAXM2}


def build(name: str, out_dir: Path, **overrides):
    """Create, save and return ``(hf_model, out_dir)`` for one of :data:`TINY` (float32, eval);
    ``overrides``: config values that replace its own.
    A GLM-4.5 file also carries its NextN/MTP layer's tensors (``model.layers.{n_layers}.*``),
    which the engine must skip."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs, seed = TINY[name]
    config = AutoConfig.for_model(model_type, **dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager",
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            owner = gate if hasattr(gate, "e_score_correction_bias") else layer.mlp  # MiniMax-M2: on the block
            if gate is not None and hasattr(owner, "e_score_correction_bias"):
                gate.weight.mul_(ROUTER_SCALE)
                owner.e_score_correction_bias.copy_(torch.randn(owner.e_score_correction_bias.shape) * 0.3)
    model.save_pretrained(out_dir)
    if model_type == "glm4_moe":
        files = sorted(out_dir.glob("*.safetensors"))
        assert len(files) == 1, files
        tensors = load_file(str(files[0]))
        n, rng = config.num_hidden_layers, np.random.default_rng(seed)
        mtp = {f"model.layers.{n}.{k}": rng.standard_normal(shape).astype(np.float32) for k, shape in
               (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                ("self_attn.q_proj.weight", (4 * kwargs["head_dim"], 64)), ("input_layernorm.weight", (64,)))}
        save_file({**tensors, **mtp}, str(files[0]), metadata={"format": "pt"})
    return model, out_dir


def f16_rounded(hf_model):
    """A copy of ``hf_model`` whose matrices are rounded through float16, as a GGUF written
    with F16 matrices holds them (norms and biases stay float32)."""
    import torch

    twin = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in twin.parameters():
            if p.ndim >= 2:
                p.copy_(p.half().float())
    return twin


def write_gguf(hf_model, path: Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               kv_b: bool = False) -> Path:
    """Write ``hf_model`` (glm4_moe or deepseek_v3) as llama.cpp's converter does: its names and
    metadata keys, experts stacked [E, F, H] / [E, H, F], DeepSeek's ``kv_b_proj`` split into
    ``attn_k_b`` [nh, rank, nope] (transposed per head) and ``attn_v_b`` [nh, v, rank] (or kept
    whole as ``attn_kv_b`` with ``kv_b``, as files written before llama.cpp's MLA cache hold it).
    Matrices whose rows fit ``qtype``'s blocks are written in ``qtype``, the rest in F32.
    A GLM file gets a NextN/MTP block after the model's own (``nextn_predict_layers`` = 1)."""
    cfg = hf_model.config
    family = cfg.model_type
    arch = GGUF_ARCH[family]
    n = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if family != "minimax_m2":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    if family == "minimax_m2":
        w.add_block_count(n)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    elif family == "glm4_moe":
        w.add_block_count(n + 1)
        w.add_nextn_predict_layers(1)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
    else:
        rank, rope, nope, vd = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        w.add_block_count(n)
        w.add_head_count_kv(1)
        if cfg.q_lora_rank is not None:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(rank)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(vd)
        w.add_rope_dimension_count(rope)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        rp = cfg.rope_parameters
        if rp.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rp["factor"])
            w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def put(name, a):
        add_weight(w, name, a, qtype)

    # names as convert_hf_to_gguf.py maps them: gguf's TensorNameMap for the architecture, with
    # its rename of e_score_correction_bias to e_score_correction.bias
    names = gguf.get_tensor_name_map(_NAME_MAPS[arch], n)

    def gguf_name(hf_name: str) -> str:
        name = names.get_name(hf_name.replace("e_score_correction_bias", "e_score_correction.bias"),
                              try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        return name

    for hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        put(gguf_name(hf_name), state.pop(hf_name))
    for layer in range(n):
        p = f"model.layers.{layer}."
        for hf_name in [k for k in state if k.startswith(p)]:
            if not hf_name.endswith(("kv_b_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                put(gguf_name(hf_name), state.pop(hf_name))
        kvb = state.pop(p + "self_attn.kv_b_proj.weight", None)
        if kvb is not None and kv_b:
            put(f"blk.{layer}.attn_kv_b.weight", kvb)
        elif kvb is not None:  # llama.cpp: k_b transposed per head, v_b as is
            heads = kvb.reshape(cfg.num_attention_heads, nope + vd, rank)
            put(f"blk.{layer}.attn_k_b.weight", heads[:, :nope].transpose(0, 2, 1))
            put(f"blk.{layer}.attn_v_b.weight", heads[:, nope:])
        gu = state.pop(p + "mlp.experts.gate_up_proj", None)
        if gu is not None:
            F = gu.shape[1] // 2
            put(f"blk.{layer}.ffn_gate_exps.weight", gu[:, :F])
            put(f"blk.{layer}.ffn_up_exps.weight", gu[:, F:])
            put(f"blk.{layer}.ffn_down_exps.weight", state.pop(p + "mlp.experts.down_proj"))
    if family == "glm4_moe":  # the NextN/MTP block: a whole layer plus its own tensors, unused
        rng = np.random.default_rng(0)
        for name, shape in (("attn_norm.weight", (64,)), ("attn_q.weight", (4 * cfg.head_dim, 64)),
                            ("nextn.eh_proj.weight", (64, 128)), ("nextn.enorm.weight", (64,)),
                            ("nextn.hnorm.weight", (64,)), ("nextn.shared_head_norm.weight", (64,))):
            put(f"blk.{n}.{name}", rng.standard_normal(shape))
    assert not [k for k in state if not k.endswith("rotary_emb.inv_freq")], sorted(state)[:5]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def saved_config(out_dir: Path) -> dict:
    return json.loads((out_dir / "config.json").read_text())
