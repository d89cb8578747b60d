"""Model hyper-parameters, read from a GGUF header or an HF ``config.json``.

Every option comes from the file; a field the file leaves out takes the default of the
family's transformers configuration class (transformers 5.x ``configuration_<family>.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import ModelFileError

# HF ``model_type`` → the family name used inside the engine.
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral",
               "glm4_moe", "deepseek_v3", "minimax_m2", "gpt_oss", "qwen3_5_moe")
# HF ``model_type`` values read as another family (Kimi-K2 is DeepSeek-V3's architecture; a
# Qwen3.5-MoE text-only checkpoint names its text model's type).
HF_ALIASES = {"kimi_k2": "deepseek_v3", "qwen3_5_moe_text": "qwen3_5_moe"}

# Per-family defaults of transformers' configuration classes for the fields we read.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, head_dim=None,
                  bos_token_id=1, eos_token_id=2),
    "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, head_dim=None,
                    bos_token_id=1, eos_token_id=2),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True, head_dim=None,
                  bos_token_id=None, eos_token_id=None),
    "qwen3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, head_dim=128,
                  bos_token_id=None, eos_token_id=None),
    "qwen2_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True, head_dim=None,
                      bos_token_id=None, eos_token_id=None, norm_topk_prob=False,
                      decoder_sparse_step=1, num_experts_per_tok=4, num_experts=60),
    "qwen3_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, head_dim=None,
                      bos_token_id=None, eos_token_id=None, norm_topk_prob=False,
                      decoder_sparse_step=1, num_experts_per_tok=8, num_experts=128),
    "olmoe": dict(rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False, head_dim=None,
                  bos_token_id=None, eos_token_id=50279, norm_topk_prob=False,
                  num_experts_per_tok=8, num_experts=64),
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, attention_bias=False, head_dim=None,
                    bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, num_local_experts=8),
    "glm4_moe": dict(rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False, head_dim=None,
                     bos_token_id=None, eos_token_id=None, norm_topk_prob=True, num_experts_per_tok=8,
                     n_routed_experts=128, n_shared_experts=1, routed_scaling_factor=1.0, n_group=1,
                     topk_group=1, first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=False),
    "deepseek_v3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, head_dim=None,
                        bos_token_id=0, eos_token_id=1, norm_topk_prob=True, num_experts_per_tok=8,
                        n_routed_experts=256, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True),
    "minimax_m2": dict(rms_norm_eps=1e-6, rope_theta=5e6, attention_bias=False, head_dim=128, bos_token_id=200034,
                       eos_token_id=200020, num_experts_per_tok=8, num_local_experts=256, use_qk_norm=True),
    "gpt_oss": dict(rms_norm_eps=1e-5, rope_theta=150000.0, attention_bias=True, head_dim=64, bos_token_id=None,
                    eos_token_id=None, num_experts_per_tok=4, num_local_experts=128, sliding_window=128,
                    swiglu_limit=7.0, swiglu_alpha=1.702),
    "qwen3_5_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, head_dim=256, bos_token_id=None,
                        eos_token_id=None, num_experts_per_tok=8, num_experts=256, partial_rotary_factor=0.25,
                        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of one decoder-only transformer.

    ``family`` is the HF ``model_type`` the numerics follow (``llama`` for SmolLM2 and any
    llama GGUF). ``qk_norm`` is ``None``, ``"head"`` (RMSNorm over each head, Qwen3) or
    ``"proj"`` (RMSNorm over the whole Q / K projection, OLMoE). ``moe_layers`` lists the
    layer indices whose MLP is a mixture of experts; the others are dense.
    ``eos_token_ids`` is a tuple (HF allows a list). ``rope_scaling`` is None, llama3's
    frequency-scaling parameters or YaRN's. ``rotary_dim`` is how many leading dims of each
    head RoPE rotates (0: all; GLM-4.5 rotates half). ``extra`` keeps the raw config.json (HF).

    Routing (MoE layers): ``scoring`` is ``"softmax"`` or ``"sigmoid"``; ``n_group`` /
    ``topk_group`` limit the top-k to the best groups of experts and ``routed_scaling_factor``
    multiplies the combine weights (DeepSeek-V3, GLM-4.5; :func:`swarm.compute.ffn.route`).

    Multi-head latent attention (DeepSeek-V3; ``kv_lora_rank`` > 0): queries through a rank
    ``q_lora_rank`` bottleneck (0: one projection), keys and values from one compressed vector
    of ``kv_lora_rank`` per position plus a ``qk_rope_head_dim`` RoPE key shared by the heads;
    each head's query/key is ``qk_nope_head_dim + qk_rope_head_dim`` wide, its value
    ``v_head_dim``. The KV cache keeps the compressed vector and the RoPE key only: one
    "key/value head" (``n_kv_heads == 1``) of ``head_dim == kv_lora_rank + qk_rope_head_dim``,
    as llama.cpp counts it. ``attention_scale`` overrides the softmax scale
    (``1/sqrt(head_dim)`` when None).

    gpt-oss: ``layer_windows`` gives each layer's attention window (0: full attention; empty:
    every layer full), ``attention_sinks`` a learned logit per query head in each softmax's
    denominator, ``output_bias`` a bias on the attention output projection, ``expert_bias``
    biases on every expert's projections, ``swiglu_limit`` > 0 its clamped SwiGLU
    (:func:`swarm.compute.kernels.swiglu`, with ``swiglu_alpha``) and ``scoring ==
    "topk_softmax"`` a softmax over the top-k router logits (the router has a bias too).

    Qwen3.5-MoE (hybrid attention): ``linear_layers`` lists the Gated DeltaNet layers
    (:mod:`swarm.compute.deltanet`: ``linear_key_heads`` query/key heads of
    ``linear_key_head_dim``, ``linear_value_heads`` value heads of ``linear_value_head_dim``, a
    causal convolution of ``linear_conv_kernel`` taps; ``linear_v_tiled``: value heads stored
    in llama.cpp's tiled order, value head j reading key head j % ``linear_key_heads`` instead of
    j // (value heads per key head)); the other layers are full attention whose query projection
    carries an output gate per head (``attn_output_gate``).
    """

    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (F)
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    # Mixture of experts (n_experts == 0: dense model).
    n_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 0
    rope_scaling: dict | None = field(default=None, compare=False)
    sliding_window: int | None = None  # attention window; longer sequences are refused
    rotary_dim: int = 0
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    attention_scale: float | None = None
    layer_windows: tuple[int, ...] = ()
    attention_sinks: bool = False
    output_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    linear_layers: tuple[int, ...] = ()
    linear_conv_kernel: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_v_tiled: bool = False
    attn_output_gate: bool = False
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s attention window in positions (0: it attends to every earlier one)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def state_values_per_sequence(self) -> int:
        """Float32 values one sequence's recurrent state keeps in one linear-attention layer
        (:class:`swarm.compute.deltanet.RecurrentState`): the convolution's last K-1 rows of C
        channels and the [value heads, key dim, value dim] state, twice (the state before the last
        step is kept so a step can be re-run); 0 for a model without linear attention."""
        if not self.linear_layers:
            return 0
        channels = 2 * self.linear_key_heads * self.linear_key_head_dim + self.linear_value_heads * self.linear_value_head_dim
        return 2 * ((self.linear_conv_kernel - 1) * channels
                    + self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` is Gated DeltaNet linear attention (a recurrent state, no KV cache)."""
        return layer in self.linear_layers

    @property
    def rope_dim(self) -> int:
        """How many leading dims of a query/key head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3): the cache keeps the compressed KV."""
        return self.kv_lora_rank > 0

    @property
    def kv_values_per_token(self) -> int:
        """Float32 values one layer's KV cache keeps per position: keys and values of every
        key/value head, or for MLA the compressed vector and the RoPE key (kept once)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.n_kv_heads * self.head_dim


def _need(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelFileError(f"{where}: required field {key!r} is missing")
    return cfg[key]


def _rope(cfg: dict, default: float, where: str) -> tuple[float, dict | None]:
    """``(rope theta, scaling)`` from ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` / ``rope_scaling`` keys. ``scaling`` is None for plain RoPE or
    the llama3 parameters (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings). Other RoPE types raise ModelFileError."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default)))
    if rope_type in ("default", None):
        return theta, None
    if rope_type == "llama3":
        try:
            scaling = {k: float(params[k]) for k in
                       ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{where}: llama3 rope parameters are incomplete: {params}") from None
        return theta, dict(scaling, rope_type="llama3")
    if rope_type == "yarn":
        try:
            factor = float(params["factor"]) if params.get("factor") is not None else (
                float(cfg["max_position_embeddings"]) / float(params["original_max_position_embeddings"]))
            scaling = dict(rope_type="yarn", factor=factor,
                           original_max_position_embeddings=float(params["original_max_position_embeddings"]),
                           beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                           mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                           attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{where}: yarn rope parameters are incomplete: {params}") from None
        return theta, scaling
    raise ModelFileError(f"{where}: rope_type {rope_type!r} is not supported (only 'default', 'llama3' and 'yarn')")


def _sliding_window(cfg: dict, family: str) -> int | None:
    """The attention window when the family's modeling code applies one, else None."""
    window = cfg.get("sliding_window")
    if family in ("mistral", "mixtral"):
        return int(window) if window else None
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and cfg.get("use_sliding_window"):
        return int(window) if window else None
    return None


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


_HF_NUMERIC = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
               "num_experts", "num_local_experts", "num_experts_per_tok", "decoder_sparse_step",
               "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "clip_qkv",
               "bos_token_id", "sliding_window", "n_routed_experts", "n_shared_experts", "routed_scaling_factor",
               "n_group", "topk_group", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
               "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "partial_rotary_factor", "rotary_dim",
               "swiglu_limit", "swiglu_alpha", "linear_conv_kernel_dim", "linear_key_head_dim",
               "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval")


def _check_numbers(values: dict, keys, where: str) -> None:
    """Fields that must be numbers (when present and not null) are numbers."""
    for key in keys:
        v = values.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ModelFileError(f"{where}: field {key!r} must be a number, got {v!r}")


def check_config(c: "ModelConfig", where: str) -> "ModelConfig":
    """Cross-field sanity (positive sizes, heads divisible, top-k within experts)."""
    for key in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
        if getattr(c, key) <= 0:
            raise ModelFileError(f"{where}: {key} must be positive, got {getattr(c, key)}")
    if c.n_heads % c.n_kv_heads:
        raise ModelFileError(f"{where}: {c.n_heads} attention heads are not a multiple of "
                             f"{c.n_kv_heads} key/value heads")
    if c.head_dim % 2:
        raise ModelFileError(f"{where}: head_dim {c.head_dim} must be even for RoPE")
    if c.n_experts and not 1 <= c.top_k <= c.n_experts:
        raise ModelFileError(f"{where}: experts per token ({c.top_k}) must be within 1..{c.n_experts}")
    if c.moe_layers and c.moe_intermediate_size <= 0:
        raise ModelFileError(f"{where}: expert intermediate size must be positive")
    if len(c.moe_layers) < c.n_layers and c.intermediate_size <= 0:
        raise ModelFileError(f"{where}: intermediate_size must be positive for the dense layers")
    if c.linear_layers:
        sizes = (c.linear_conv_kernel, c.linear_key_heads, c.linear_value_heads, c.linear_key_head_dim,
                 c.linear_value_head_dim)
        if min(sizes) <= 0 or c.linear_value_heads % c.linear_key_heads:
            raise ModelFileError(f"{where}: linear attention needs positive sizes and value heads a multiple of "
                                 f"the key heads, got (conv kernel, key heads, value heads, key dim, value dim) "
                                 f"= {sizes}")
    return c


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed HF ``config.json`` dict.

    ``where`` names the file in error messages. Raises ModelFileError for an unknown
    ``model_type``, a missing required field, a field of the wrong type or inconsistent sizes.
    """
    if isinstance(cfg.get("text_config"), dict):  # a multimodal checkpoint: its text model is read
        cfg = {**cfg, **cfg["text_config"]}
    family = HF_ALIASES.get(cfg.get("model_type"), cfg.get("model_type"))
    if family not in HF_FAMILIES:
        raise ModelFileError(
            f"{where}: model_type {family!r} is not supported (supported: {', '.join(HF_FAMILIES)})")
    _check_numbers(cfg, _HF_NUMERIC, where)
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        raise ModelFileError(
            f"{where}: weights quantized with {quant['quant_method']!r} (quantization_config) are not supported; "
            "use a BF16/F16/F32 copy or a GGUF file of the model")
    return check_config(_config_from_hf(cfg, family, where), where)


def _config_from_hf(cfg: dict, family: str, where: str) -> ModelConfig:
    d = _FAMILY_DEFAULTS[family]
    hidden = int(_need(cfg, "hidden_size", where))
    n_layers = int(_need(cfg, "num_hidden_layers", where))
    n_heads = int(_need(cfg, "num_attention_heads", where))
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or d["head_dim"] or hidden // n_heads
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelFileError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ModelFileError(f"{where}: mlp_bias=true is not supported")

    moe: dict[str, Any] = {}
    if family in ("qwen2_moe", "qwen3_moe"):
        n_exp = int(cfg.get("num_experts", cfg.get("num_local_experts", d["num_experts"])))
        step = int(cfg.get("decoder_sparse_step", d["decoder_sparse_step"]) or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(n_layers)
                       if n_exp > 0 and i not in only and (i + 1) % step == 0)
        moe = dict(n_experts=n_exp, top_k=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
                   moe_intermediate_size=int(_need(cfg, "moe_intermediate_size", where)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", d["norm_topk_prob"])),
                   moe_layers=layers)
        if family == "qwen2_moe":
            moe["shared_expert_intermediate_size"] = int(_need(cfg, "shared_expert_intermediate_size", where))
    elif family == "olmoe":
        n_exp = int(cfg.get("num_experts", d["num_experts"]))
        moe = dict(n_experts=n_exp, top_k=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
                   moe_intermediate_size=int(_need(cfg, "intermediate_size", where)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", d["norm_topk_prob"])),
                   moe_layers=tuple(range(n_layers)))
    elif family == "mixtral":
        n_exp = int(cfg.get("num_local_experts", d["num_local_experts"]))
        # Mixtral always renormalises the top-k probabilities (MixtralTopKRouter).
        moe = dict(n_experts=n_exp, top_k=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
                   moe_intermediate_size=int(_need(cfg, "intermediate_size", where)),
                   norm_topk_prob=True, moe_layers=tuple(range(n_layers)))
    elif family in ("glm4_moe", "deepseek_v3"):
        moe = _sigmoid_moe_from_hf(cfg, d, n_layers, where)
    elif family == "minimax_m2":  # every layer routed, sigmoid + selection bias, renormalised; no shared expert
        n_exp = int(cfg.get("num_local_experts", cfg.get("num_experts", d["num_local_experts"])))
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ModelFileError(f"{where}: scoring_func {scoring!r} is not supported (only 'sigmoid')")
        moe = dict(n_experts=n_exp, top_k=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
                   moe_intermediate_size=int(_need(cfg, "intermediate_size", where)), norm_topk_prob=True,
                   moe_layers=tuple(range(n_layers)), scoring="sigmoid")

    if family == "gpt_oss":
        moe = _gpt_oss_from_hf(cfg, d, n_layers, where)
    attn: dict[str, Any] = {}
    if family == "qwen3_5_moe":
        moe, attn = _qwen3_5_moe_from_hf(cfg, d, n_layers, int(head_dim), where)
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj", "qwen3_5_moe": "head"}.get(family)
    rope_theta, rope_scaling = _rope(cfg, d["rope_theta"], where)
    if family == "glm4_moe":
        qk_norm = "head" if cfg.get("use_qk_norm", d["use_qk_norm"]) else None
        factor = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get(
            "partial_rotary_factor", d["partial_rotary_factor"]))
        attn["rotary_dim"] = int(int(head_dim) * float(factor))
    elif family == "deepseek_v3":
        attn = _mla_from_hf(cfg, d, rope_scaling, where)
        n_kv, head_dim = 1, attn["kv_lora_rank"] + attn["qk_rope_head_dim"]
    elif family == "minimax_m2":  # RMSNorm over the whole Q / K projections; RoPE on rotary_dim dims
        qk_norm = "proj" if cfg.get("use_qk_norm", d["use_qk_norm"]) else None
        factor = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor"))
        rotary = cfg.get("rotary_dim") or (int(int(head_dim) * float(factor)) if factor else 0)
        attn["rotary_dim"] = int(rotary) if rotary and int(rotary) < int(head_dim) else 0
    if family in ("qwen2", "qwen2_moe"):
        attention_bias = bool(cfg.get("qkv_bias", True))
    else:
        attention_bias = bool(cfg.get("attention_bias", d["attention_bias"]))
    bos = cfg.get("bos_token_id", d["bos_token_id"])
    eos = cfg.get("eos_token_id", d["eos_token_id"])
    return ModelConfig(
        family=family,
        vocab_size=int(_need(cfg, "vocab_size", where)),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", d["rms_norm_eps"])),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        sliding_window=_sliding_window(cfg, family),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=qk_norm,
        clip_qkv=cfg.get("clip_qkv") if family == "olmoe" else None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_tuple(eos),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        extra=dict(cfg),
        **moe,
        **attn,
    )


def _gpt_oss_from_hf(cfg: dict, d: dict, n_layers: int, where: str) -> dict[str, Any]:
    """gpt-oss's fields: every layer routed (top-k logits, then softmax), biased experts with the
    clamped SwiGLU, attention sinks and output bias, ``layer_types`` choosing sliding-window or
    full attention per layer (transformers ``GptOssConfig``: even layers slide by default)."""
    n_exp = int(cfg.get("num_local_experts", d["num_local_experts"]))
    window = int(cfg.get("sliding_window") or d["sliding_window"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelFileError(f"{where}: layer_types must name 'sliding_attention' or 'full_attention' "
                             f"for each of the {n_layers} layers, got {types}")
    return dict(n_experts=n_exp, top_k=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
                moe_intermediate_size=int(_need(cfg, "intermediate_size", where)), moe_layers=tuple(range(n_layers)),
                scoring="topk_softmax", expert_bias=True, attention_sinks=True, output_bias=True,
                swiglu_limit=float(cfg.get("swiglu_limit") or d["swiglu_limit"]),
                swiglu_alpha=float(cfg.get("swiglu_alpha") or d["swiglu_alpha"]),
                layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types))


def _qwen3_5_moe_from_hf(cfg: dict, d: dict, n_layers: int, head_dim: int,
                         where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3.5-MoE's (MoE fields, attention fields): every layer routed (softmax, top-k
    renormalised) beside a sigmoid-gated shared expert; ``layer_types`` (default: every
    ``full_attention_interval``-th layer full) choosing Gated DeltaNet or gated full attention,
    whose RoPE turns ``partial_rotary_factor`` of each head (transformers ``Qwen3_5MoeTextConfig``)."""
    n_exp = int(cfg.get("num_experts", d["num_experts"]))
    moe = dict(n_experts=n_exp, top_k=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
               moe_intermediate_size=int(_need(cfg, "moe_intermediate_size", where)),
               shared_expert_intermediate_size=int(_need(cfg, "shared_expert_intermediate_size", where)),
               norm_topk_prob=True, moe_layers=tuple(range(n_layers)))
    interval = int(cfg.get("full_attention_interval") or d["full_attention_interval"])
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                       for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ModelFileError(f"{where}: layer_types must name 'linear_attention' or 'full_attention' "
                             f"for each of the {n_layers} layers, got {types}")
    factor = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor", d["partial_rotary_factor"]))
    rotary = int(head_dim * float(factor))
    attn = dict(rotary_dim=rotary if rotary < head_dim else 0, attn_output_gate=True,
                linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim") or d["linear_conv_kernel_dim"]),
                linear_key_heads=int(cfg.get("linear_num_key_heads") or d["linear_num_key_heads"]),
                linear_value_heads=int(cfg.get("linear_num_value_heads") or d["linear_num_value_heads"]),
                linear_key_head_dim=int(cfg.get("linear_key_head_dim") or d["linear_key_head_dim"]),
                linear_value_head_dim=int(cfg.get("linear_value_head_dim") or d["linear_value_head_dim"]))
    return moe, attn


def _sigmoid_moe_from_hf(cfg: dict, d: dict, n_layers: int, where: str) -> dict[str, Any]:
    """The MoE fields of GLM-4.5 / DeepSeek-V3: ``first_k_dense_replace`` dense layers, then
    routed experts (sigmoid scores, selection bias, groups, routed scaling) beside
    ``n_shared_experts`` shared experts fused into one MLP."""
    n_exp = int(cfg.get("n_routed_experts", d["n_routed_experts"]) or 0)
    first = int(cfg.get("first_k_dense_replace", d["first_k_dense_replace"]) or 0)
    step = int(cfg.get("moe_layer_freq", 1) or 1)
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ModelFileError(f"{where}: scoring_func {scoring!r} is not supported (only 'sigmoid')")
    moe_ff = int(_need(cfg, "moe_intermediate_size", where))
    n_shared = int(cfg.get("n_shared_experts", d["n_shared_experts"]) or 0)
    return dict(n_experts=n_exp, top_k=int(cfg.get("num_experts_per_tok", d["num_experts_per_tok"])),
                moe_intermediate_size=moe_ff, shared_expert_intermediate_size=moe_ff * n_shared,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", d["norm_topk_prob"])),
                moe_layers=tuple(i for i in range(n_layers) if n_exp > 0 and i >= first and i % step == 0),
                scoring="sigmoid", n_group=int(cfg.get("n_group", d["n_group"]) or 1),
                topk_group=int(cfg.get("topk_group", d["topk_group"]) or 1),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", d["routed_scaling_factor"])))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1;
    transformers ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mla_from_hf(cfg: dict, d: dict, rope_scaling: dict | None, where: str) -> dict[str, Any]:
    """The attention fields of DeepSeek-V3's multi-head latent attention."""
    nope = int(cfg.get("qk_nope_head_dim", d["qk_nope_head_dim"]))
    rope = int(cfg.get("qk_rope_head_dim", d["qk_rope_head_dim"]))
    scale = (nope + rope) ** -0.5
    if rope_scaling and rope_scaling.get("rope_type") == "yarn" and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale = scale * m * m  # transformers yarn_apply_mscale: the non-rotary dims too
    q_rank = cfg.get("q_lora_rank", d["q_lora_rank"])
    return dict(q_lora_rank=int(q_rank or 0), kv_lora_rank=int(cfg.get("kv_lora_rank", d["kv_lora_rank"])),
                qk_nope_head_dim=nope, qk_rope_head_dim=rope, rotary_dim=rope,
                v_head_dim=int(cfg.get("v_head_dim", d["v_head_dim"])),
                rope_interleave=bool(cfg.get("rope_interleave", d["rope_interleave"])), attention_scale=scale)


# GGUF ``{arch}.`` metadata we read as numbers.
_GGUF_NUMERIC = ("embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
                 "attention.key_length", "vocab_size", "expert_count", "expert_used_count",
                 "expert_feed_forward_length", "expert_shared_feed_forward_length", "feed_forward_length",
                 "attention.layer_norm_rms_epsilon", "rope.freq_base", "context_length",
                 "rope.dimension_count", "nextn_predict_layers", "leading_dense_block_count", "expert_shared_count",
                 "expert_weights_scale", "expert_group_count", "expert_group_used_count", "expert_gating_func",
                 "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length_mla",
                 "attention.value_length_mla", "attention.value_length", "rope.scaling.factor",
                 "rope.scaling.original_context_length", "rope.scaling.yarn_log_multiplier",
                 "attention.sliding_window", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
                 "ssm.time_step_rank", "ssm.inner_size")

# GGUF ``general.architecture`` → engine family.
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                 "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "glm4moe": "glm4_moe", "deepseek2": "deepseek_v3",
                 "minimax-m2": "minimax_m2", "gpt-oss": "gpt_oss", "qwen35moe": "qwen3_5_moe"}
# llama.cpp's ``{arch}.expert_gating_func`` (llama_expert_gating_func_type).
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def config_from_gguf(kv: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], where: str) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata (``kv``: key → python value).

    ``tensor_shapes`` (name → numpy shape) fills what llama.cpp leaves implicit (vocab size,
    tied embeddings). A llama GGUF with expert tensors is Mixtral-style MoE (llama.cpp writes
    Mixtral as ``llama``).
    """
    arch = kv.get("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ModelFileError(
            f"{where}: general.architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_FAMILIES)})")
    _check_numbers(kv, [f"{arch}.{k}" for k in _GGUF_NUMERIC]
                   + ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"], where)
    return check_config(_config_from_gguf(kv, tensor_shapes, arch, where), where)


def _config_from_gguf(kv: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], arch: str,
                      where: str) -> ModelConfig:
    family = GGUF_FAMILIES[arch]

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in kv:
            raise ModelFileError(f"{where}: required metadata field {full!r} is missing")
        return kv[full]

    rope_scaling = _gguf_rope_scaling(kv, arch, where)
    hidden = int(need("embedding_length"))
    # llama.cpp counts GLM-4.5's NextN/MTP layers as blocks after the model's own; we skip them
    n_layers = int(need("block_count")) - int(kv.get(f"{arch}.nextn_predict_layers", 0))
    n_heads = int(need("attention.head_count"))
    n_kv = int(kv.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(kv.get(f"{arch}.attention.key_length", hidden // n_heads))
    if "token_embd.weight" not in tensor_shapes:
        raise ModelFileError(f"{where}: tensor 'token_embd.weight' is missing")
    vocab = int(kv.get(f"{arch}.vocab_size", tensor_shapes["token_embd.weight"][0]))
    n_exp = int(kv.get(f"{arch}.expert_count", 0))
    if family == "llama" and n_exp > 0:
        family = "mixtral"
    moe: dict[str, Any] = {}
    if n_exp > 0:
        first = "blk.0.ffn_gate_exps.weight"
        moe_ff = int(kv.get(f"{arch}.expert_feed_forward_length",
                            tensor_shapes.get(first, (0, 0, 0))[1]))
        norm = {"qwen2_moe": False, "olmoe": False}.get(family, True)
        norm = bool(kv.get(f"{arch}.expert_weights_norm", norm))
        layers = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes)
        moe = dict(n_experts=n_exp, top_k=int(need("expert_used_count")),
                   moe_intermediate_size=moe_ff, norm_topk_prob=norm, moe_layers=layers)
        shexp = f"blk.{layers[0] if layers else 0}.ffn_gate_shexp.weight"
        if family in ("qwen2_moe", "qwen3_5_moe"):
            moe["shared_expert_intermediate_size"] = int(kv.get(
                f"{arch}.expert_shared_feed_forward_length", tensor_shapes.get(shexp, (0,))[0]))
        elif family in ("glm4_moe", "deepseek_v3", "minimax_m2"):
            gating = int(kv.get(f"{arch}.expert_gating_func", 1 if family == "deepseek_v3" else 2))
            if gating not in _GGUF_GATING:
                raise ModelFileError(f"{where}: metadata {arch}.expert_gating_func = {gating} is not supported")
            moe.update(shared_expert_intermediate_size=tensor_shapes.get(shexp, (0,))[0] if shexp in tensor_shapes
                       else moe_ff * int(kv.get(f"{arch}.expert_shared_count", 0)),
                       scoring=_GGUF_GATING[gating],
                       n_group=int(kv.get(f"{arch}.expert_group_count", 0) or 1),
                       topk_group=int(kv.get(f"{arch}.expert_group_used_count", 0) or 1),
                       routed_scaling_factor=float(kv.get(f"{arch}.expert_weights_scale", 1.0) or 1.0))
    if family == "gpt_oss":  # llama.cpp: every other layer slides, the first included (swa pattern 2)
        window = int(need("attention.sliding_window"))
        moe.update(scoring="topk_softmax", norm_topk_prob=False, swiglu_limit=7.0, swiglu_alpha=1.702,
                   expert_bias="blk.0.ffn_gate_exps.bias" in tensor_shapes,
                   attention_sinks="blk.0.attn_sinks.weight" in tensor_shapes,
                   output_bias="blk.0.attn_output.bias" in tensor_shapes,
                   layer_windows=tuple(0 if i % 2 else window for i in range(n_layers)))
        if rope_scaling:  # as transformers' GptOssConfig: YaRN's ramp without rounding its ends
            rope_scaling["truncate"] = False
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}.get(family)
    attn: dict[str, Any] = {}
    if family == "glm4_moe":
        qk_norm = "head" if "blk.0.attn_q_norm.weight" in tensor_shapes else None
        attn["rotary_dim"] = int(kv.get(f"{arch}.rope.dimension_count", head_dim))
    elif family == "deepseek_v3":
        attn = _mla_from_gguf(kv, arch, n_heads, rope_scaling, where)
        n_kv, head_dim = 1, attn["kv_lora_rank"] + attn["qk_rope_head_dim"]
    elif family == "minimax_m2":
        qk_norm = "proj" if "blk.0.attn_q_norm.weight" in tensor_shapes else None
        rotary = int(kv.get(f"{arch}.rope.dimension_count", head_dim))
        attn["rotary_dim"] = rotary if rotary < head_dim else 0
    elif family == "qwen3_5_moe":
        qk_norm = "head"
        attn = _qwen3_5_moe_from_gguf(kv, arch, n_layers, head_dim, tensor_shapes, need)
    bos = kv.get("tokenizer.ggml.bos_token_id")
    eos = kv.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=int(kv.get(f"{arch}.feed_forward_length", 0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(kv.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm=qk_norm,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_tuple(eos),
        max_position_embeddings=int(kv.get(f"{arch}.context_length", 0)),
        **moe,
        **attn,
    )


def _qwen3_5_moe_from_gguf(kv: dict[str, Any], arch: str, n_layers: int, head_dim: int,
                           tensor_shapes: dict[str, tuple[int, ...]], need) -> dict[str, Any]:
    """Qwen3.5-MoE's attention fields from llama.cpp's ``qwen35moe`` keys: a layer with an
    ``ssm_a`` tensor is Gated DeltaNet (``ssm.group_count`` key heads of ``ssm.state_size``,
    ``ssm.time_step_rank`` value heads sharing ``ssm.inner_size``, ``ssm.conv_kernel`` taps;
    its converter stores value heads tiled when there are more of them than key heads)."""
    rotary = int(kv.get(f"{arch}.rope.dimension_count", head_dim))
    n_k, n_v = int(need("ssm.group_count")), int(need("ssm.time_step_rank"))
    return dict(rotary_dim=rotary if rotary < head_dim else 0, attn_output_gate=True,
                linear_layers=tuple(i for i in range(n_layers) if f"blk.{i}.ssm_a" in tensor_shapes),
                linear_conv_kernel=int(need("ssm.conv_kernel")), linear_key_heads=n_k, linear_value_heads=n_v,
                linear_key_head_dim=int(need("ssm.state_size")),
                linear_value_head_dim=int(need("ssm.inner_size")) // max(n_v, 1), linear_v_tiled=n_k != n_v)


def _gguf_rope_scaling(kv: dict[str, Any], arch: str, where: str) -> dict | None:
    """None for plain RoPE, or YaRN's parameters as :func:`_rope` gives them, from llama.cpp's
    ``{arch}.rope.scaling.*`` keys (it writes ``yarn_log_multiplier = 0.1 * mscale_all_dim``;
    ``mscale`` is taken equal to it, as in DeepSeek-V3's and Kimi-K2's configs)."""
    scaling = kv.get(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling != "yarn":
        raise ModelFileError(f"{where}: metadata {arch}.rope.scaling.type = {scaling!r} is not supported "
                             f"(only 'none' and 'yarn')")
    try:
        mscale_all = float(kv.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        return dict(rope_type="yarn", factor=float(kv[f"{arch}.rope.scaling.factor"]),
                    original_max_position_embeddings=float(kv[f"{arch}.rope.scaling.original_context_length"]),
                    beta_fast=float(kv.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(kv.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                    mscale=mscale_all, mscale_all_dim=mscale_all, attention_factor=None, truncate=True)
    except KeyError as e:
        raise ModelFileError(f"{where}: yarn rope scaling needs metadata {e.args[0]!r}") from None


def _mla_from_gguf(kv: dict[str, Any], arch: str, n_heads: int, rope_scaling: dict | None,
                   where: str) -> dict[str, Any]:
    """The attention fields of multi-head latent attention from llama.cpp's ``deepseek2`` keys:
    ``key_length_mla`` / ``value_length_mla`` per head (files written before llama.cpp's MLA
    cache carry the per-head sizes in ``key_length`` / ``value_length`` instead)."""
    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in kv:
            raise ModelFileError(f"{where}: required metadata field {full!r} is missing")
        return kv[full]

    rope = int(need("rope.dimension_count"))
    key = int(kv.get(f"{arch}.attention.key_length_mla", need("attention.key_length")))
    value = int(kv.get(f"{arch}.attention.value_length_mla", need("attention.value_length")))
    hf = {"qk_nope_head_dim": key - rope, "qk_rope_head_dim": rope, "v_head_dim": value,
          "q_lora_rank": int(kv.get(f"{arch}.attention.q_lora_rank", 0)),
          "kv_lora_rank": int(need("attention.kv_lora_rank")), "rope_interleave": True}
    return _mla_from_hf(hf, _FAMILY_DEFAULTS["deepseek_v3"], rope_scaling, where)
