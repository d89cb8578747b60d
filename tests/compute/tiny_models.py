"""Tiny random checkpoints built by transformers (the oracle) for the engine tests.

Configs and seeds are committed here; weights are generated at test time and saved with
``save_pretrained`` into a temporary directory. Router weights are scaled up so the top-k
choices are decisive (random tiny routers are near-ties, and a near-tie flips on a 1e-7
difference). ``norm_topk_prob`` is covered true (qwen3_moe), false (qwen2_moe) and absent
from config.json (olmoe; the family default, false, applies).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROUTER_SCALE = 15.0

_COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=96, intermediate_size=48, initializer_range=0.08, max_position_embeddings=256,
               rms_norm_eps=1e-6)

# family → (config kwargs, seed, keys to delete from the saved config.json)
TINY = {
    "llama": (dict(_COMMON, tie_word_embeddings=True, rope_theta=5000.0), 1, ()),
    "qwen2": (dict(_COMMON, tie_word_embeddings=False), 2, ()),
    "mistral": (dict(_COMMON, sliding_window=64), 8, ()),
    "qwen3": (dict(_COMMON, head_dim=24, attention_bias=False), 3, ()),
    "qwen3_moe": (dict(_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=[1]), 4, ()),
    "qwen2_moe": (dict(_COMMON, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=40, norm_topk_prob=False), 5, ()),
    "olmoe": (dict(_COMMON, num_experts=8, num_experts_per_tok=3, clip_qkv=4.0), 6, ("norm_topk_prob",)),
    "mixtral": (dict(_COMMON, num_local_experts=4, num_experts_per_tok=2), 7, ()),
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def build_tiny(family: str, out_dir: Path, **overrides):
    """Create, save and return ``(hf_model, out_dir)`` for one family (float32, eval mode);
    ``overrides``: config values that replace :data:`TINY`'s."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs, seed, drop = TINY[family]
    config = AutoConfig.for_model(family, **dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager",
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.mul_(ROUTER_SCALE)
    model.save_pretrained(out_dir)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return model, out_dir


def save_stacked(hf_model, src_dir: Path, out_dir: Path) -> Path:
    """Re-save ``hf_model`` with experts stacked (``experts.gate_up_proj`` [E, 2F, H],
    ``experts.down_proj`` [E, H, F]) as transformers holds them in memory, split in two shards."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text((src_dir / "config.json").read_text())
    tensors = {k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in tensors), "model holds no stacked experts"
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(out_dir / fname))
        weight_map.update({k: fname for k in part})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out_dir


def hf_logits(hf_model, tokens) -> np.ndarray:
    """transformers' logits [T, V] float32 for one sequence."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([list(tokens)])).logits[0].float().numpy()


def hf_greedy(hf_model, tokens, n: int) -> list[int]:
    """transformers' greedy continuation of ``tokens``: n steps of argmax over full forwards
    (``generate`` is avoided: its default processors may suppress EOS or pad)."""
    seq = list(tokens)
    for _ in range(n):
        seq.append(int(np.argmax(hf_logits(hf_model, seq)[-1])))
    return seq[len(tokens):]
