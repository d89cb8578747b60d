"""A tiny random Qwen3.5-MoE (``qwen3_5_moe``) checkpoint built by transformers, and the same
weights written as GGUF the way llama.cpp's converter (``Qwen3_5MoeTextModel``,
conversion/qwen.py) writes them: arch ``qwen35moe``, ``A_log`` as ``ssm_a = -exp(A_log)``,
``dt_bias`` as ``ssm_dt.bias``, the conv weight squeezed to [C, K], ``1 + weight`` for every
RMSNorm but the linear attention's own, value heads reordered from grouped to tiled when there
are more of them than key heads, gate/up experts split out of ``gate_up_proj``.

Layers: Gated DeltaNet, gated full attention, Gated DeltaNet (so a two-stage split of 2 + 1
layers puts both kinds on the first stage and a linear layer on the second); 4 value heads
over 2 key heads, so the grouped/tiled order matters."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.compute.tiny_gguf import add_weight

ROUTER_SCALE = 15.0
CONFIG = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8,
              num_experts_per_tok=2, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
SEED = 35


def build(out_dir: Path, **overrides):
    """Create, save and return ``(hf_model, out_dir)`` (float32, eval): random norms (so
    ``1 + weight`` matters), decays, conv taps and shared-expert gates; routers scaled so the
    top-k is decisive."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**dict(CONFIG, **overrides))
    torch.manual_seed(SEED)
    model = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.float32, experts_implementation="eager",
                                                attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            elif name.endswith("norm.weight"):  # zero-centered: the model scales by 1 + weight
                p.copy_(0.2 * torch.randn(p.shape))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 4)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape))
            elif name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
            elif name.endswith("shared_expert_gate.weight"):
                p.copy_(torch.randn(p.shape))
    model.save_pretrained(out_dir)
    return model, out_dir


def _tiled(a: np.ndarray, axis: int, n_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's ``_reorder_v_heads``: value heads grouped by key head → tiled, along ``axis``."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(n_k, per_k, head_dim, *rest).swapaxes(0, 1).reshape(n_k * per_k * head_dim, *rest)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def converted(name: str, a: np.ndarray, cfg) -> tuple[str, np.ndarray]:
    """One HF tensor as llama.cpp's converter rewrites it (name suffix and values) before naming."""
    n_k, n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, per_k = cfg.linear_key_head_dim, cfg.linear_value_head_dim, n_v // n_k
    if "linear_attn." in name and n_k != n_v:
        if ".in_proj_qkv." in name:
            a = np.concatenate([a[:2 * n_k * dk], _tiled(a[2 * n_k * dk:], 0, n_k, per_k, dv)])
        elif ".in_proj_z." in name:
            a = _tiled(a, 0, n_k, per_k, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            a = _tiled(a, 0, n_k, per_k, 1)
        elif ".conv1d." in name:
            a = a.reshape(a.shape[0], -1)
            a = np.concatenate([a[:2 * n_k * dk], _tiled(a[2 * n_k * dk:], 0, n_k, per_k, dv)])
        elif ".out_proj." in name:
            a = _tiled(a, 1, n_k, per_k, dv)
    if name.endswith(".A_log"):
        return name, -np.exp(a)
    if name.endswith(".dt_bias"):
        return name.replace(".dt_bias", ".dt_proj.bias"), a
    if "conv1d" in name:
        return name, a.reshape(a.shape[0], -1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return name, a + 1
    return name, a


def write_gguf(hf_model, path: Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """Write ``hf_model`` as llama.cpp's converter does; 2-D matrices whose rows fit ``qtype``'s
    blocks in ``qtype``, the rest F32."""
    cfg = hf_model.config
    n = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(2)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, n)
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def put(hf_name: str, a: np.ndarray) -> None:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        add_weight(w, name, a, qtype if a.ndim >= 2 and "conv1d" not in name else gguf.GGMLQuantizationType.F32)

    for hf_name in list(state):
        a = state.pop(hf_name)
        if hf_name.endswith("experts.gate_up_proj"):
            F = a.shape[1] // 2
            put(hf_name.replace("gate_up_proj", "gate_proj.weight"), a[:, :F])
            put(hf_name.replace("gate_up_proj", "up_proj.weight"), a[:, F:])
        elif hf_name.endswith("experts.down_proj"):
            put(hf_name + ".weight", a)
        else:
            put(*converted(hf_name, a, cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def add_mtp_layer(out_dir: Path, source_layer: int = 1) -> None:
    """Give the saved checkpoint the multi-token-prediction block Qwen3.5 releases carry
    (``mtp_num_hidden_layers: 1``, ``mtp.*`` tensors: a copy of full-attention layer
    ``source_layer`` and random ``fc`` / norms), which transformers does not build and the
    engine never reads."""
    import json

    from safetensors.numpy import load_file, save_file

    file = out_dir / "model.safetensors"
    tensors = load_file(str(file))
    H = tensors["model.norm.weight"].shape[0]
    prefix = f"model.layers.{source_layer}."
    tensors.update({"mtp.layers.0." + k[len(prefix):]: v.copy() for k, v in tensors.items() if k.startswith(prefix)})
    rng = np.random.default_rng(7)
    tensors["mtp.fc.weight"] = rng.standard_normal((H, 2 * H)).astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = rng.standard_normal(H).astype(np.float32) * 0.1
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}, indent=2))


# Runs llama.cpp's converter with the tokenizer's split named as Qwen3.5 releases get it: the
# converter names it by hashing how the checkpoint's tokenizer encodes a probe text, a hash only
# Qwen3.5's own 248k-token vocabulary gives.
_CONVERT_AS_QWEN35 = """
import runpy, sys
script = sys.argv[1]
sys.path.insert(0, script.rsplit("/", 1)[0])
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def convert_with_llama_cpp(hf_dir: Path, outfile: Path) -> Path:
    """``hf_dir`` converted to F32 GGUF by llama.cpp's ``convert_hf_to_gguf.py``
    (tests/compute/llama_converter.py), ``tokenizer.ggml.pre`` = ``qwen35``.
    Raises ConverterMissing, or RuntimeError with the converter's last lines when it fails."""
    import os
    import subprocess
    import sys

    from tests.compute.llama_converter import converter_script

    script = converter_script()
    env = dict(os.environ, PYTHONPATH=str(script.parent / "gguf-py"))
    done = subprocess.run([sys.executable, "-c", _CONVERT_AS_QWEN35, str(script), str(hf_dir), "--outtype", "f32",
                           "--outfile", str(outfile)], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError("convert_hf_to_gguf.py failed:\n" + "\n".join((done.stdout + done.stderr).splitlines()[-25:]))
    return outfile
