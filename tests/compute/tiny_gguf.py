"""Write tiny GGUF files with ``gguf.GGUFWriter`` for the engine tests.

``write_gguf_from_hf`` converts a tiny transformers model the way llama.cpp's
``convert_hf_to_gguf.py`` does for the tensors we read: llama.cpp names, Q/K rows permuted
for the llama architecture, experts stacked [E, F, H] / [E, H, F].
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# HF family → GGUF architecture name
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_weight(w: gguf.GGUFWriter, name: str, a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    """Add tensor ``a`` to ``w``: in ``qtype`` when it is a matrix whose rows fit the type's
    blocks, else in F32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if a.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and a.shape[-1] % block == 0:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, a)


def write_gguf_from_hf(hf_model, family: str, path: Path,
                       qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                       extra: dict[str, np.ndarray] | None = None, split_max_tensors: int = 0) -> Path:
    """Save ``hf_model`` as a GGUF file; weights whose rows fit ``qtype``'s blocks in ``qtype``,
    the rest (norms, biases, odd widths) in F32. ``extra``: more tensors, written as given.
    ``split_max_tensors``: split it as llama.cpp's gguf-split does, at most that many tensors a
    shard (``path``'s stem + ``-00001-of-0000N.gguf`` …); returns the first file written."""
    cfg = hf_model.config
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])  # llama3 scaling travels as rope_freqs.weight
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    n_exp = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
    if n_exp:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
        if hasattr(cfg, "norm_topk_prob"):
            w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def put(name, a):
        add_weight(w, name, a, qtype)

    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    put("token_embd.weight", state.pop("model.embed_tokens.weight"))
    put("output_norm.weight", state.pop("model.norm.weight"))
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        put("output.weight", state.pop("lm_head.weight"))
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for hf_name, g_name in _LAYER_NAMES.items():
            a = state.pop(p + hf_name, None)
            if a is None:
                continue
            if arch == "llama" and hf_name.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
                a = llama_cpp_permute(a, heads)
            if g_name == "ffn_gate_inp_shexp.weight":
                a = a.reshape(-1)  # llama.cpp stores the shared-expert gate as a vector [H]
            put(f"blk.{layer}.{g_name}", a)
        gu = state.pop(p + "mlp.experts.gate_up_proj", None)
        if gu is not None:
            F = gu.shape[1] // 2
            put(f"blk.{layer}.ffn_gate_exps.weight", gu[:, :F])
            put(f"blk.{layer}.ffn_up_exps.weight", gu[:, F:])
            put(f"blk.{layer}.ffn_down_exps.weight", state.pop(p + "mlp.experts.down_proj"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(Path(path))[0]
