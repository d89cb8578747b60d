"""Checkpoints: one naming scheme over GGUF files and HF safetensors directories.

The engine asks for tensors by *part* (``"q"``, ``"ffn_norm"``, ``"router"``, …) and layer;
a checkpoint maps that to the file's own tensor names and returns, in PyTorch orientation
(``[out, in]``), a weight matrix as a compact :class:`~swarm.compute.quant.QMatrix` over the
mapped file (``matrix``) or a small tensor as float32 (``load``). Experts are read one at a
time (``expert_matrices(layer, e)``),
whatever the layout on disk: per-expert tensors (``mlp.experts.N.{gate,up,down}_proj``),
Mixtral's ``block_sparse_moe.experts.N.{w1,w3,w2}``, transformers' stacked
``experts.gate_up_proj`` [E, 2F, H] / ``experts.down_proj`` [E, H, F], or GGUF's stacked
``ffn_{gate,up,down}_exps`` [E, F, H] / [E, H, F].

llama.cpp's converter permutes the rows of Q and K of llama-architecture models so its RoPE
can rotate adjacent pairs (``convert_hf_to_gguf.py: LlamaModel.permute``); we undo it at
load so both formats use transformers' rotate-half convention.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from swarm.compute.config import ModelConfig, config_from_gguf, config_from_hf
from swarm.compute.identity import model_identity
from swarm.compute.quant import QMatrix
from swarm.compute.tensors import GGUFFile, SafetensorsDir
from swarm.errors import ModelFileError

# Gated DeltaNet's parts (swarm/compute/deltanet.py); ``lin_decay`` is A = -exp(A_log).
_LINEAR_PARTS = ("lin_qkv", "lin_z", "lin_b", "lin_a", "lin_out", "lin_conv", "lin_dt", "lin_decay", "lin_norm")
# Qwen3.5 scales by (1 + weight) in these RMSNorms; llama.cpp's converter stores 1 + weight.
_ZERO_CENTERED_NORMS = ("attn_norm", "ffn_norm", "norm", "q_norm", "k_norm")
# Per-layer parts the engine asks for.
LAYER_PARTS = ("attn_norm", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",
               "ffn_norm", "gate", "up", "down", "router", "shexp_gate_proj", "shexp_up",
               "shexp_down", "shexp_gate", "router_bias", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm",
               "kv_b", "k_b", "v_b", "o_bias", "sinks", "router_logit_bias", *_LINEAR_PARTS)

_HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
    "shexp_gate_proj": "mlp.shared_expert.gate_proj.weight", "shexp_up": "mlp.shared_expert.up_proj.weight",
    "shexp_down": "mlp.shared_expert.down_proj.weight", "shexp_gate": "mlp.shared_expert_gate.weight",
    "router_bias": "mlp.gate.e_score_correction_bias",
    "q_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b": "self_attn.q_b_proj.weight", "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b": "self_attn.kv_b_proj.weight",
    "o_bias": "self_attn.o_proj.bias", "sinks": "self_attn.sinks", "router_logit_bias": "mlp.router.bias",
    "lin_qkv": "linear_attn.in_proj_qkv.weight", "lin_z": "linear_attn.in_proj_z.weight",
    "lin_b": "linear_attn.in_proj_b.weight", "lin_a": "linear_attn.in_proj_a.weight",
    "lin_out": "linear_attn.out_proj.weight", "lin_conv": "linear_attn.conv1d.weight", "lin_dt": "linear_attn.dt_bias",
    "lin_decay": "linear_attn.A_log", "lin_norm": "linear_attn.norm.weight",
}
# GLM-4.5 and DeepSeek-V3 name their (fused) shared experts in the plural.
_HF_SHARED_EXPERTS = {"shexp_gate_proj": "mlp.shared_experts.gate_proj.weight",
                      "shexp_up": "mlp.shared_experts.up_proj.weight",
                      "shexp_down": "mlp.shared_experts.down_proj.weight"}
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    "router": "ffn_gate_inp.weight",
    "shexp_gate_proj": "ffn_gate_shexp.weight", "shexp_up": "ffn_up_shexp.weight",
    "shexp_down": "ffn_down_shexp.weight", "shexp_gate": "ffn_gate_inp_shexp.weight",
    "router_bias": "exp_probs_b.bias",
    "q_a": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight", "q_b": "attn_q_b.weight",
    "kv_a": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight", "kv_b": "attn_kv_b.weight",
    "k_b": "attn_k_b.weight", "v_b": "attn_v_b.weight",
    "o_bias": "attn_output.bias", "sinks": "attn_sinks.weight", "router_logit_bias": "ffn_gate_inp.bias",
    "lin_qkv": "attn_qkv.weight", "lin_z": "attn_gate.weight", "lin_b": "ssm_beta.weight", "lin_a": "ssm_alpha.weight",
    "lin_out": "ssm_out.weight", "lin_conv": "ssm_conv1d.weight", "lin_dt": "ssm_dt.bias", "lin_decay": "ssm_a",
    "lin_norm": "ssm_norm.weight",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute(w, n_head)`` of the rows of Q/K ([n_head*hd, ...] or bias)."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class Checkpoint:
    """Lazy access to one model's tensors: weight matrices compact (``matrix``), the rest float32
    (``load``). Subclasses map names to files.

    ``path``: the file (GGUF; a split GGUF's first shard) or directory (HF). ``files``: every
    file the tensors live in. ``config``: the :class:`ModelConfig`.
    ``metadata``: GGUF key/values, or the parsed ``config.json``.
    """

    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    files: list[Path]

    @property
    def identity_files(self) -> list[tuple[Path, int]]:
        """``(path, header_bytes)`` of each file that makes the model, in the model's order."""
        raise NotImplementedError

    def has(self, part: str, layer: int | None = None) -> bool:
        raise NotImplementedError

    def load(self, part: str, layer: int | None = None) -> np.ndarray:
        """Float32 tensor of ``part`` (global parts: ``embed``, ``norm``, ``head``).

        Raises ModelFileError naming the file and tensor when it is missing or misshapen.
        """
        raise NotImplementedError

    def matrix(self, part: str, layer: int | None = None) -> QMatrix:
        """Weight matrix ``part`` compact, in the file's encoding (``embed``, ``head``, ``q``, …,
        ``gate``, ``up``, ``down``, ``shexp_*``). Raises ModelFileError when missing or misshapen."""
        raise NotImplementedError

    def expert_matrices(self, layer: int, e: int) -> tuple[QMatrix, QMatrix, QMatrix]:
        """``(gate [F,H], up [F,H], down [H,F])`` of expert ``e`` of MoE layer ``layer``, compact."""
        raise NotImplementedError

    def expert_biases(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(gate [F], up [F], down [H])`` biases of expert ``e`` (gpt-oss), float32.
        Raises ModelFileError when missing or misshapen."""
        raise NotImplementedError

    def _check_matrix(self, name: str, m: QMatrix, shape: tuple[int, ...]) -> QMatrix:
        if m.shape != tuple(shape):
            raise ModelFileError(f"{self.path}: tensor {name!r} has shape {m.shape}, expected {tuple(shape)}")
        return m

    def _check(self, name: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if tuple(a.shape) != tuple(shape):
            raise ModelFileError(f"{self.path}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        assert a.dtype == np.float32
        return a

    def expected_shape(self, part: str) -> tuple[int, ...]:
        """The shape ``part`` must have under ``config`` (PyTorch orientation)."""
        c = self.config
        H, hd = c.hidden_size, c.head_dim
        q, kv = c.n_heads * hd, c.n_kv_heads * hd
        qn = {"head": (hd,), "proj": (q,)}.get(c.qk_norm or "", ())
        kn = {"head": (hd,), "proj": (kv,)}.get(c.qk_norm or "", ())
        Fs = c.shared_expert_intermediate_size
        if c.attn_output_gate:  # the query projection carries each head's output gate beside its query
            q *= 2
        if c.linear_layers:
            nv, vd = c.linear_value_heads, c.linear_value_heads * c.linear_value_head_dim
            conv = 2 * c.linear_key_heads * c.linear_key_head_dim + vd
            linear = {"lin_qkv": (conv, H), "lin_z": (vd, H), "lin_b": (nv, H), "lin_a": (nv, H), "lin_out": (H, vd),
                      "lin_conv": (conv, c.linear_conv_kernel), "lin_dt": (nv,), "lin_decay": (nv,),
                      "lin_norm": (c.linear_value_head_dim,)}
            if part in linear:
                return linear[part]
        if c.is_mla:  # per head: query/key nope + rope dims, value v_head_dim; cache rank + rope
            nope, rope, vd, rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
            q, nh = c.n_heads * (nope + rope), c.n_heads
            mla = {"q": (q, H), "q_a": (c.q_lora_rank, H), "q_a_norm": (c.q_lora_rank,), "q_b": (q, c.q_lora_rank),
                   "kv_a": (rank + rope, H), "kv_a_norm": (rank,), "kv_b": (nh * (nope + vd), rank),
                   "k_b": (nh, rank, nope), "v_b": (nh, vd, rank), "o": (H, nh * vd)}
            if part in mla:
                return mla[part]
        return {
            "embed": (c.vocab_size, H), "head": (c.vocab_size, H), "norm": (H,), "rope_freqs": (hd // 2,),
            "attn_norm": (H,), "ffn_norm": (H,), "q": (q, H), "k": (kv, H), "v": (kv, H),
            "o": (H, c.n_heads * hd),
            "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": qn, "k_norm": kn,
            "gate": (c.intermediate_size, H), "up": (c.intermediate_size, H), "down": (H, c.intermediate_size),
            "router": (c.n_experts, H), "shexp_gate_proj": (Fs, H), "shexp_up": (Fs, H),
            "shexp_down": (H, Fs), "shexp_gate": (1, H), "router_bias": (c.n_experts,),
            "o_bias": (H,), "sinks": (c.n_heads,), "router_logit_bias": (c.n_experts,),
        }[part]

    def shape_of(self, part: str, layer: int | None = None) -> tuple[int, ...] | None:
        """Stored shape of ``part`` from the file header (nothing decoded), or None if absent."""
        name = self._name(part, layer)
        return self._shapes.get(name)

    def required_parts(self, layer: int) -> list[str]:
        """The per-layer parts ``config`` says this layer must have."""
        c = self.config
        if c.is_mla:
            parts = ["attn_norm", "ffn_norm", "kv_a", "kv_a_norm", "o"]
            parts += ["q_a", "q_a_norm", "q_b"] if c.q_lora_rank else ["q"]
            # llama.cpp's converter splits kv_b into k_b (transposed per head) and v_b
            parts += ["k_b", "v_b"] if self.has("k_b", layer) else ["kv_b"]
        elif c.is_linear_layer(layer):
            parts = ["attn_norm", "ffn_norm", *_LINEAR_PARTS]
        else:
            parts = ["attn_norm", "ffn_norm", "q", "k", "v", "o"]
        if c.attention_bias:
            parts += ["q_bias", "k_bias", "v_bias"]
        if c.output_bias:
            parts.append("o_bias")
        if c.attention_sinks:
            parts.append("sinks")
        if c.qk_norm and not c.is_linear_layer(layer):
            parts += ["q_norm", "k_norm"]
        if not c.is_moe_layer(layer):
            parts += ["gate", "up", "down"]
        else:
            parts.append("router")
            if c.shared_expert_intermediate_size:
                parts += ["shexp_gate_proj", "shexp_up", "shexp_down"]
            if c.shared_expert_intermediate_size and c.family in ("qwen2_moe", "qwen3_5_moe"):  # a sigmoid gate scales it
                parts.append("shexp_gate")
            if self.has("router_bias", layer):
                parts.append("router_bias")
            if c.expert_bias:
                parts.append("router_logit_bias")
        return parts

    def mla_heads(self, layer: int) -> tuple[list[QMatrix], list[QMatrix]]:
        """Multi-head latent attention's per-head up-projections of layer ``layer``, as the
        latent cache uses them: ``(k_absorb, v_up)``, one QMatrix per head, ``k_absorb[h]``
        [kv_lora_rank, qk_nope_head_dim] (the key up-projection transposed: it maps head h's
        query into the latent space) and ``v_up[h]`` [v_head_dim, kv_lora_rank].

        From llama.cpp's ``attn_k_b`` / ``attn_v_b`` (compact, as stored), else from
        ``kv_b_proj`` [nh*(nope+v), rank]: the value rows compact, the key rows decoded to
        float32 and transposed. Raises ModelFileError when missing or misshapen."""
        c = self.config
        nh, nope, vd = c.n_heads, c.qk_nope_head_dim, c.v_head_dim
        if self.has("k_b", layer):
            return [self._stacked_matrix("k_b", layer, h) for h in range(nh)], \
                   [self._stacked_matrix("v_b", layer, h) for h in range(nh)]
        kv_b = self.matrix("kv_b", layer)
        keys = self.load("kv_b", layer).reshape(nh, nope + vd, c.kv_lora_rank)[:, :nope]  # [nh, nope, rank]
        k_absorb = [QMatrix.from_float(np.ascontiguousarray(keys[h].T)) for h in range(nh)]
        v_up = [kv_b.rows(h * (nope + vd) + nope, (h + 1) * (nope + vd)) for h in range(nh)]
        return k_absorb, v_up

    def _stacked_matrix(self, part: str, layer: int, index: int) -> QMatrix:
        """Matrix ``index`` of the 3-D tensor ``part`` (GGUF only)."""
        raise NotImplementedError

    def matrix_nbytes(self, part: str, layer: int | None = None) -> int:
        """Bytes of weight matrix ``part`` (a 3-D stack of per-head matrices too) as stored."""
        shape = self.expected_shape(part)
        if len(shape) == 3:
            return self._stacked_matrix(part, layer, 0).nbytes * shape[0]
        return self.matrix(part, layer).nbytes

    def validate(self) -> None:
        """Check every tensor the config needs is present with the right shape, from the
        headers alone. Raises ModelFileError naming the file and the first bad tensor."""
        c = self.config
        checks = [("embed", None), ("norm", None)]
        if not c.tie_word_embeddings:  # an untied head is its own tensor, never the embeddings
            checks.append(("head", None))
        for layer in range(c.n_layers):
            checks += [(part, layer) for part in self.required_parts(layer)]
        for part, layer in checks:
            got = self.shape_of(part, layer)
            name = self._name(part, layer)
            if got is None:
                raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
            want = self.expected_shape(part)
            if part == "shexp_gate" and got == want[1:]:
                continue
            if part == "lin_conv" and tuple(got) == (want[0], 1, want[1]):  # HF's Conv1d weight [C, 1, K]
                continue
            if tuple(got) != want:
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {tuple(got)}, expected {want}")
        for layer in c.moe_layers:
            self._validate_experts(layer)

    def _validate_experts(self, layer: int) -> None:
        raise NotImplementedError

    def content_hash(self) -> str:
        """The model's identity (64 hex digits): the hash peers compare to refuse a different
        model. SHA-256 over every file's size and whole header and a few MiB of sampled tensor
        data (:mod:`swarm.compute.identity`), cached by the files' path, size and mtime, so a
        restart reads nothing. Raises ModelFileError when a file cannot be read."""
        return model_identity(self.identity_files)

class GGUFCheckpoint(Checkpoint):
    """A GGUF checkpoint (llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe): one file, or the
    shards of a split one (``path`` names any shard; ``self.path`` is then the first)."""

    def __init__(self, path: str | os.PathLike):
        self.file = GGUFFile(path)
        self.path = self.file.path
        self.files = list(self.file.paths)
        self.metadata = self.file.kv
        self.config = config_from_gguf(self.file.kv, self.file.shapes, str(self.path))
        # llama.cpp permutes Q/K rows for its llama architecture only (Mixtral is written as llama).
        self._permuted = self.file.kv.get("general.architecture") == "llama"
        # GLM-4.5's norm before the MLP is post_attention_norm in llama.cpp's glm4moe files
        self._ffn_norm = "post_attention_norm.weight" if self.file.kv.get("general.architecture") in (
            "glm4moe", "gpt-oss", "qwen35moe") else _GGUF_LAYER["ffn_norm"]

    @property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return self.file.shapes

    @property
    def identity_files(self) -> list[tuple[Path, int]]:
        return list(zip(self.file.paths, self.file.header_bytes))

    def _validate_experts(self, layer: int) -> None:
        c = self.config
        F, H, E = c.moe_intermediate_size, c.hidden_size, c.n_experts
        for part, shape in (("gate", (E, F, H)), ("up", (E, F, H)), ("down", (E, H, F))):
            name = f"blk.{layer}.ffn_{part}_exps.weight"
            got = self.file.shapes.get(name)
            if got is None:
                raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
            if got != shape:
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {got}, expected {shape}")

    def _name(self, part: str, layer: int | None) -> str:
        if layer is None:
            return {"embed": "token_embd.weight", "norm": "output_norm.weight",
                    "head": "output.weight", "rope_freqs": "rope_freqs.weight"}[part]
        if part == "ffn_norm":
            return f"blk.{layer}.{self._ffn_norm}"
        return f"blk.{layer}.{_GGUF_LAYER[part]}"

    def has(self, part: str, layer: int | None = None) -> bool:
        return self._name(part, layer) in self.file

    def load(self, part: str, layer: int | None = None) -> np.ndarray:
        name = self._name(part, layer)
        a = self.file.load(name)
        c = self.config
        if self._permuted and part in ("q", "k", "q_bias", "k_bias"):
            a = self._check(name, a, self.expected_shape(part))
            a = _unpermute(a, c.n_heads if part.startswith("q") else c.n_kv_heads)
        if part == "shexp_gate" and a.ndim == 1:
            a = a.reshape(1, -1)
        return self._check(name, a, self.expected_shape(part))

    def matrix(self, part: str, layer: int | None = None) -> QMatrix:
        name = self._name(part, layer)
        m = self._check_matrix(name, self.file.matrix(name), self.expected_shape(part))
        if self._permuted and part in ("q", "k"):
            heads = self.config.n_heads if part == "q" else self.config.n_kv_heads
            m = m.permuted_rows(_unpermute(np.arange(m.shape[0]), heads))
        return m

    def _expert_tensors(self, layer: int) -> list[tuple[str, tuple[int, int]]]:
        c = self.config
        F, H = c.moe_intermediate_size, c.hidden_size
        out = []
        for part, shape in (("gate", (F, H)), ("up", (F, H)), ("down", (H, F))):
            name = f"blk.{layer}.ffn_{part}_exps.weight"
            full = self.file.shapes.get(name)
            if full is None:
                raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
            if full != (c.n_experts, *shape):
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {full}, "
                                     f"expected {(c.n_experts, *shape)}")
            out.append((name, shape))
        return out

    def expert_matrices(self, layer: int, e: int) -> tuple[QMatrix, QMatrix, QMatrix]:
        g, u, d = (self.file.matrix(name, e) for name, _ in self._expert_tensors(layer))
        return g, u, d

    def expert_biases(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.config
        out = []
        for part, n in (("gate", c.moe_intermediate_size), ("up", c.moe_intermediate_size), ("down", c.hidden_size)):
            name = f"blk.{layer}.ffn_{part}_exps.bias"
            if self.file.shapes.get(name) != (c.n_experts, n):
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {self.file.shapes.get(name)}, "
                                     f"expected {(c.n_experts, n)}")
            out.append(self._check(name, self.file.load(name, e), (n,)))
        return out[0], out[1], out[2]

    def _stacked_matrix(self, part: str, layer: int, index: int) -> QMatrix:
        name = self._name(part, layer)
        return self._check_matrix(name, self.file.matrix(name, index), self.expected_shape(part)[1:])


class HFCheckpoint(Checkpoint):
    """A HF directory: ``config.json`` + ``*.safetensors`` (sharded or not)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise ModelFileError(f"{cfg_path}: missing (an HF model directory needs config.json)")
        try:
            self.metadata = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(self.metadata, dict):
            raise ModelFileError(f"{cfg_path}: expected a JSON object")
        self.config = config_from_hf(self.metadata, str(cfg_path))
        self.st = SafetensorsDir(self.path)
        self.files = [f.path for f in self.st.files]

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return self.st.shapes

    @cached_property
    def _model(self) -> str:
        """Where the text model's tensors live: ``model``, or ``model.language_model`` in a
        multimodal checkpoint (Qwen3.5-MoE's), whose vision tower is never read."""
        return "model.language_model" if "model.language_model.embed_tokens.weight" in self.st else "model"

    def _validate_experts(self, layer: int) -> None:
        c = self.config
        F, H, E = c.moe_intermediate_size, c.hidden_size, c.n_experts
        base = f"{self._model}.layers.{layer}"
        if self._expert_layout == "stacked":
            prefix = next((p for p in ("mlp", "block_sparse_moe")
                           if f"{base}.{p}.experts.gate_up_proj" in self.st), "mlp")
            want = {f"{base}.{prefix}.experts.gate_up_proj": (E, 2 * F, H),
                    f"{base}.{prefix}.experts.down_proj": (E, H, F)}
            if c.family == "gpt_oss":  # [in, out] per expert, gate and up rows interleaved; biases
                want = {f"{base}.mlp.experts.gate_up_proj": (E, H, 2 * F), f"{base}.mlp.experts.down_proj": (E, F, H),
                        f"{base}.mlp.experts.gate_up_proj_bias": (E, 2 * F),
                        f"{base}.mlp.experts.down_proj_bias": (E, H)}
        else:
            want = {}
            for e in range(E):
                names = self._expert_names(layer, e)
                want.update(zip(names, ((F, H), (F, H), (H, F))))
        for name, shape in want.items():
            got = self._shapes.get(name)
            if got is None:
                raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
            if tuple(got) != shape:
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {tuple(got)}, expected {shape}")

    def _expert_names(self, layer: int, e: int) -> list[str]:
        """Per-expert tensor names (gate, up, down) of expert ``e``."""
        base = f"{self._model}.layers.{layer}"
        if f"{base}.block_sparse_moe.experts.{e}.w1.weight" in self.st:
            return [f"{base}.block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")]
        return [f"{base}.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]

    def _name(self, part: str, layer: int | None) -> str:
        if layer is None:
            return {"embed": f"{self._model}.embed_tokens.weight", "norm": f"{self._model}.norm.weight",
                    "head": "lm_head.weight", "rope_freqs": "(none)"}[part]
        name = f"{self._model}.layers.{layer}.{_HF_LAYER[part]}"
        if part == "router" and name not in self.st:
            name = next((n for n in (f"{self._model}.layers.{layer}.{p}.weight" for p in ("block_sparse_moe.gate", "mlp.router"))
                         if n in self.st), f"{self._model}.layers.{layer}.block_sparse_moe.gate.weight")
        if part in _HF_SHARED_EXPERTS and name not in self.st:
            name = f"{self._model}.layers.{layer}.{_HF_SHARED_EXPERTS[part]}"
        if part == "router_bias" and name not in self.st:  # MiniMax-M2 keeps it on the MoE block
            name = next((n for n in (f"{self._model}.layers.{layer}.{p}.e_score_correction_bias"
                                     for p in ("mlp", "block_sparse_moe")) if n in self.st), name)
        return name

    def has(self, part: str, layer: int | None = None) -> bool:
        return part in _HF_LAYER and self._name(part, layer) in self.st if layer is not None else \
            self._name(part, layer) in self.st

    @property
    def identity_files(self) -> list[tuple[Path, int]]:
        # config.json changes the numbers too: all of it is header
        cfg = self.path / "config.json"
        shards = sorted(self.st.files, key=lambda f: f.path)
        return [(cfg, cfg.stat().st_size), *((f.path, f.header_bytes) for f in shards)]

    def load(self, part: str, layer: int | None = None) -> np.ndarray:
        name = self._name(part, layer)
        a = self.st.load(name)
        if part == "lin_conv":  # Conv1d's [C, 1, K] as GGUF stores it, [C, K]
            a = a.reshape(a.shape[0], -1)
        elif part == "lin_decay":  # A_log → A = -exp(A_log), as llama.cpp's converter stores it
            a = -np.exp(a)
        elif part in _ZERO_CENTERED_NORMS and self.config.family == "qwen3_5_moe":
            a = a + np.float32(1)
        return self._check(name, a, self.expected_shape(part))

    def matrix(self, part: str, layer: int | None = None) -> QMatrix:
        name = self._name(part, layer)
        return self._check_matrix(name, self.st.matrix(name), self.expected_shape(part))

    @cached_property
    def _expert_layout(self) -> str:
        """``stacked`` when the file holds ``experts.gate_up_proj``, else ``per_expert``."""
        layer = self.config.moe_layers[0]
        for prefix in ("mlp", "block_sparse_moe"):
            if f"{self._model}.layers.{layer}.{prefix}.experts.gate_up_proj" in self.st:
                return "stacked"
        return "per_expert"

    def _stacked_names(self, layer: int) -> tuple[str, str] | None:
        """(gate_up, down) names of a stacked-experts layer (shapes checked), else None."""
        c = self.config
        F, H = c.moe_intermediate_size, c.hidden_size
        base = f"{self._model}.layers.{layer}"
        if self._expert_layout == "stacked":
            prefix = next(p for p in ("mlp", "block_sparse_moe")
                          if f"{base}.{p}.experts.gate_up_proj" in self.st)
            gu_name, d_name = f"{base}.{prefix}.experts.gate_up_proj", f"{base}.{prefix}.experts.down_proj"
            for name, shape in ((gu_name, (c.n_experts, 2 * F, H)), (d_name, (c.n_experts, H, F))):
                if name not in self.st:
                    raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
                if self.st.shapes[name] != shape:
                    raise ModelFileError(f"{self.path}: tensor {name!r} has shape {self.st.shapes[name]}, "
                                         f"expected {shape}")
            return gu_name, d_name
        return None

    def expert_matrices(self, layer: int, e: int) -> tuple[QMatrix, QMatrix, QMatrix]:
        c = self.config
        F, H = c.moe_intermediate_size, c.hidden_size
        if c.family == "gpt_oss":  # stored [in, out] with gate/up interleaved: decoded, transposed
            base = f"{self._model}.layers.{layer}.mlp.experts"
            gu = self.st.load(f"{base}.gate_up_proj", e)  # [H, 2F]: gate, up, gate, up, ...
            down = self.st.load(f"{base}.down_proj", e)  # [F, H]
            return (QMatrix.from_float(np.ascontiguousarray(gu[:, 0::2].T)),
                    QMatrix.from_float(np.ascontiguousarray(gu[:, 1::2].T)),
                    QMatrix.from_float(np.ascontiguousarray(down.T)))
        stacked = self._stacked_names(layer)
        if stacked:
            gu = self.st.matrix(stacked[0], e)  # [2F, H]: gate rows then up rows
            return gu.rows(0, F), gu.rows(F, 2 * F), self.st.matrix(stacked[1], e)
        names = self._expert_names(layer, e)
        shapes = ((F, H), (F, H), (H, F))
        g, u, d = (self._check_matrix(n, self.st.matrix(n), s) for n, s in zip(names, shapes))
        return g, u, d


    def expert_biases(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.config
        base = f"{self._model}.layers.{layer}.mlp.experts"
        gu = self._check(f"{base}.gate_up_proj_bias", self.st.load(f"{base}.gate_up_proj_bias", e),
                         (2 * c.moe_intermediate_size,))
        down = self._check(f"{base}.down_proj_bias", self.st.load(f"{base}.down_proj_bias", e), (c.hidden_size,))
        return np.ascontiguousarray(gu[0::2]), np.ascontiguousarray(gu[1::2]), down


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a GGUF file or an HF directory and check every tensor's shape against the config
    (headers only). Raises ModelFileError naming the file and tensor/field that is wrong."""
    p = Path(path)
    if p.is_dir() or p.is_file():
        ck = HFCheckpoint(p) if p.is_dir() else GGUFCheckpoint(p)
        ck.validate()
        return ck
    raise ModelFileError(f"{p}: no such file or directory (expected a .gguf file or an HF model directory)")
