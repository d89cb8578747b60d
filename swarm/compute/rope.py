"""RoPE variants beyond the plain and llama3 frequencies of :mod:`swarm.compute.kernels`:
YaRN's frequencies and attention factor, partial rotation (only the leading dims of a head)
and the interleaved-pair layout DeepSeek's weights use.

Shape legend: T tokens, n heads, r rotated dims (even), hd head dim. float32 throughout, as
transformers computes them (``modeling_rope_utils._compute_yarn_parameters``).
"""

from __future__ import annotations

import math

import numpy as np

from swarm.compute.config import yarn_mscale as yarn_get_mscale
from swarm.compute.kernels import apply_rope_swapped

F32 = np.float32


def yarn_attention_factor(factor: float, mscale: float = 0.0, mscale_all_dim: float = 0.0,
                          attention_factor: float | None = None, **_) -> float:
    """The factor YaRN multiplies cos and sin by (transformers: explicit ``attention_factor``,
    else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given, else
    ``mscale(factor)``)."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position_embeddings: float,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True, **_) -> np.ndarray:
    """YaRN's inverse frequencies [dim/2] f32 for ``dim`` rotated dims: each frequency blends
    the original (extrapolation) and the one divided by ``factor`` (interpolation) with a linear
    ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times over the original
    context (YaRN paper §3.2; transformers ``_compute_yarn_parameters``)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    pos_freqs = np.power(F32(theta), np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)).astype(F32)
    extrapolation = F32(1.0) / pos_freqs
    interpolation = F32(1.0) / (F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    keep = F32(1.0) - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return (interpolation * (F32(1.0) - keep) + extrapolation * keep).astype(F32)


def deinterleave(x: np.ndarray) -> np.ndarray:
    """``x`` [..., r] with RoPE pairs adjacent ``(x0, x1), (x2, x3), …`` → the rotate-half
    layout ``(x0, x2, …, x1, x3, …)`` (transformers ``apply_rotary_pos_emb_interleave``; a
    query and a key permuted alike keep their dot product)."""
    r = x.shape[-1]
    return np.ascontiguousarray(x.reshape(*x.shape[:-1], r // 2, 2).swapaxes(-1, -2)).reshape(x.shape)


def apply_partial_rope(x: np.ndarray, cos: np.ndarray, ssin: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Rotate the leading r dims of ``x`` [T, n, hd] (rotate-half within them, as transformers'
    ``apply_rotary_pos_emb`` with a ``partial_rotary_factor``); the other dims pass unrotated.
    ``cos``, ``ssin`` [T, n, r] are the tables with ``scale`` already folded in and ``scale``
    [n, 1] is that per-head factor (the attention scale on query heads, 1 on key heads),
    applied to the passing dims here. Returns a new [T, n, hd] f32 array."""
    r = cos.shape[-1]
    out = x * scale
    out[..., :r] = apply_rope_swapped(x[..., :r], cos, ssin)
    return out
