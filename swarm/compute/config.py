"""Model hyper-parameters, read from a GGUF header or an HF ``config.json``.

Every option comes from the file; a field the file leaves out takes the default of the
family's transformers configuration class (transformers 5.x ``configuration_<family>.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swarm.errors import ModelFileError

# HF ``model_type`` → the family name used inside the engine.
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral")

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
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of one decoder-only transformer.

    ``family`` is the HF ``model_type`` the numerics follow (``llama`` for SmolLM2 and any
    llama GGUF). ``qk_norm`` is ``None``, ``"head"`` (RMSNorm over each head, Qwen3) or
    ``"proj"`` (RMSNorm over the whole Q / K projection, OLMoE). ``moe_layers`` lists the
    layer indices whose MLP is a mixture of experts; the others are dense.
    ``eos_token_ids`` is a tuple (HF allows a list). ``rope_scaling`` is None or llama3's
    frequency-scaling parameters. ``extra`` keeps the raw config.json (HF).
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
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


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
    raise ModelFileError(f"{where}: rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")


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
               "bos_token_id", "sliding_window")


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
    return c


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed HF ``config.json`` dict.

    ``where`` names the file in error messages. Raises ModelFileError for an unknown
    ``model_type``, a missing required field, a field of the wrong type or inconsistent sizes.
    """
    family = cfg.get("model_type")
    if family not in HF_FAMILIES:
        raise ModelFileError(
            f"{where}: model_type {family!r} is not supported (supported: {', '.join(HF_FAMILIES)})")
    _check_numbers(cfg, _HF_NUMERIC, where)
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

    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}.get(family)
    if family in ("qwen2", "qwen2_moe"):
        attention_bias = bool(cfg.get("qkv_bias", True))
    else:
        attention_bias = bool(cfg.get("attention_bias", d["attention_bias"]))
    bos = cfg.get("bos_token_id", d["bos_token_id"])
    eos = cfg.get("eos_token_id", d["eos_token_id"])
    rope_theta, rope_scaling = _rope(cfg, d["rope_theta"], where)
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
    )


# GGUF ``{arch}.`` metadata we read as numbers.
_GGUF_NUMERIC = ("embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
                 "attention.key_length", "vocab_size", "expert_count", "expert_used_count",
                 "expert_feed_forward_length", "expert_shared_feed_forward_length", "feed_forward_length",
                 "attention.layer_norm_rms_epsilon", "rope.freq_base", "context_length")

# GGUF ``general.architecture`` → engine family.
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                 "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}


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

    scaling = kv.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelFileError(f"{where}: metadata {arch}.rope.scaling.type = {scaling!r} is not supported")
    hidden = int(need("embedding_length"))
    n_layers = int(need("block_count"))
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
        norm = {"mixtral": True, "qwen3_moe": True, "qwen2_moe": False, "olmoe": False}[family]
        norm = bool(kv.get(f"{arch}.expert_weights_norm", norm))
        layers = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes)
        moe = dict(n_experts=n_exp, top_k=int(need("expert_used_count")),
                   moe_intermediate_size=moe_ff, norm_topk_prob=norm, moe_layers=layers)
        if family == "qwen2_moe":
            moe["shared_expert_intermediate_size"] = int(kv.get(
                f"{arch}.expert_shared_feed_forward_length",
                tensor_shapes.get("blk.0.ffn_gate_shexp.weight", (0,))[0]))
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}.get(family)
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
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm=qk_norm,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_tuple(eos),
        max_position_embeddings=int(kv.get(f"{arch}.context_length", 0)),
        **moe,
    )
