"""Tiny random MoE checkpoints for the swarm tests, built by transformers (configs and seeds
committed, not weights). Routers are scaled up so top-k choices are decisive rather than
near-ties. Each family has a dense layer too where the family allows one, so both the expert
path and the dense-range path of the swarm are exercised.
"""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)

FAMILIES = {
    # Qwen3-MoE with layer 1 dense (mlp_only_layers): experts and dense ranges in one model.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=16, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                       head_dim=8, norm_topk_prob=True, mlp_only_layers=[1])),
    # Qwen2-MoE: shared expert with a sigmoid gate; norm_topk_prob false.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=16, intermediate_size=48, shared_expert_intermediate_size=24,
                       num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[2])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=16, num_local_experts=6, num_experts_per_tok=2)),
}
ROUTER_SCALE = 30.0
SEED = 0


def build(family: str, root: Path, seed: int = SEED) -> Path:
    """Save a tiny random ``family`` checkpoint under ``root`` and return its directory."""
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router (not shared_expert_gate)
                p.mul_(ROUTER_SCALE)
    out = root / (family if seed == SEED else f"{family}-seed{seed}")
    model.save_pretrained(out)
    return out


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def add_char_tokenizer(model_dir: Path) -> Path:
    """Give a tiny checkpoint (vocab 128) a tokenizer: one token per ASCII character, and a
    minimal chat template, so the API and the chat client can run on it."""
    import json

    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab={chr(i): i for i in range(128)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return model_dir
