"""Multi-head latent attention (MLA; DeepSeek-V2 §2.1, DeepSeek-V3) over a latent KV cache.

Theory of operation
-------------------
Per position the model projects the hidden row to one compressed vector ``c`` [R]
(RMS-normed, R = ``kv_lora_rank``) and one RoPE key ``k_pe`` [r] shared by all heads. The
heads' keys and values are up-projections of ``c``: ``k_h = [W_UK_h c, k_pe]``,
``v_h = W_UV_h c``. The KV cache keeps only ``[c, k_pe]`` [R + r] per position (one
"key/value head", as llama.cpp counts it) and the up-projections are absorbed into the query
and the output instead of expanded per cached position:

    q_h · k_h = (W_UK_hᵀ q_nope_h) · c + q_pe_h · k_pe        score over the cached rows
    o_h      = W_UV_h (Σ_s p_s c_s)                          value up-projected once per query

so attention itself is multi-query attention with keys ``[c, k_pe]`` and values ``c``:
:func:`swarm.compute.kernels.attention` runs it with the cached rows as both keys and values
and the value's first R dims are kept. Matches transformers' ``DeepseekV3Attention`` (which
expands K/V) up to float rounding.

Shape legend: T rows, nh heads, R = kv_lora_rank, r = qk_rope_head_dim, n = qk_nope_head_dim,
dv = v_head_dim, H hidden size, C cache capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from swarm.compute.config import ModelConfig
from swarm.compute.kernels import apply_rope_swapped, attention, rms_norm
from swarm.compute.quant import QMatrix
from swarm.compute.rope import deinterleave

F32 = np.float32


@dataclass(frozen=True)
class MLAWeights:
    """One MLA layer: ``q`` [nh*(n+r), H] (no query bottleneck) or ``q_a`` [Rq, H], ``q_a_norm``
    [Rq], ``q_b`` [nh*(n+r), Rq]; ``kv_a`` [R+r, H], ``kv_a_norm`` [R]; per head ``k_absorb[h]``
    [R, n] and ``v_up[h]`` [dv, R] (:meth:`~swarm.compute.checkpoint.Checkpoint.mla_heads`);
    ``o`` [H, nh*dv]; the layer's norms [H] f32."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    q: QMatrix | None
    q_a: QMatrix | None
    q_a_norm: np.ndarray | None
    q_b: QMatrix | None
    kv_a: QMatrix
    kv_a_norm: np.ndarray
    k_absorb: list[QMatrix]
    v_up: list[QMatrix]
    o: QMatrix


def load_mla_weights(checkpoint, layer: int) -> MLAWeights:
    """Layer ``layer``'s MLA weights from a checkpoint (compact where the file allows)."""
    ck, c = checkpoint, checkpoint.config
    lora = c.q_lora_rank > 0
    k_absorb, v_up = ck.mla_heads(layer)
    return MLAWeights(
        attn_norm=ck.load("attn_norm", layer), ffn_norm=ck.load("ffn_norm", layer),
        q=None if lora else ck.matrix("q", layer),
        q_a=ck.matrix("q_a", layer) if lora else None,
        q_a_norm=ck.load("q_a_norm", layer) if lora else None,
        q_b=ck.matrix("q_b", layer) if lora else None,
        kv_a=ck.matrix("kv_a", layer), kv_a_norm=ck.load("kv_a_norm", layer),
        k_absorb=k_absorb, v_up=v_up, o=ck.matrix("o", layer))


def mla_attention(c: ModelConfig, w: MLAWeights, layer: int, h: np.ndarray, seqs: list,
                  cos: np.ndarray, ssin: np.ndarray) -> np.ndarray:
    """MLA of the normed rows ``h`` [T, H] f32 of one or more sequences.

    ``seqs``: ``(first row, end row, cache, start position)`` per sequence; each writes its
    rows' ``[c, k_pe]`` into ``cache.layer(layer)[0]`` [1, C, R+r] at its positions and attends
    over its own cache. ``cos``, ``ssin`` [T, 1, r]: the RoPE tables of the rows' positions
    (signed sin, YaRN's attention factor folded in). Returns [T, H] f32; a row's result depends
    only on the row, its position and its cache."""
    T = h.shape[0]
    nh, n, r, R, dv = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
    eps = c.rms_norm_eps
    if w.q is not None:
        q = w.q.matmul(h)
    else:
        q = w.q_b.matmul(rms_norm(w.q_a.matmul(h), w.q_a_norm, eps))
    q = q.reshape(T, nh, n + r)
    kv = w.kv_a.matmul(h)  # [T, R + r]
    q_pe, k_pe = q[..., n:], kv[:, None, R:]  # [T, nh, r], [T, 1, r]
    if c.rope_interleave:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    scale = F32(c.attention_scale if c.attention_scale is not None else 1.0 / np.sqrt(n + r))
    query = np.empty((T, nh, R + r), F32)  # [absorbed nope part, rope part], times the softmax scale
    for head in range(nh):
        query[:, head, :R] = w.k_absorb[head].matmul(np.ascontiguousarray(q[:, head, :n]))
    query[:, :, R:] = apply_rope_swapped(q_pe, cos, ssin)
    query *= scale
    rows = np.empty((T, R + r), F32)  # what the cache keeps: [c, k_pe]
    rows[:, :R] = rms_norm(np.ascontiguousarray(kv[:, :R]), w.kv_a_norm, eps)
    rows[:, R:] = apply_rope_swapped(k_pe, cos, ssin)[:, 0]
    latent_out = np.empty((T, nh, R + r), F32)
    for a, b, cache, start in seqs:
        k, _ = cache.layer(layer)  # [1, C, R + r]; the values are the same rows
        k[0, start:start + b - a] = rows[a:b]
        latent_out[a:b] = attention(query[a:b], k, k, start).reshape(b - a, nh, R + r)
    out = np.empty((T, nh * dv), F32)
    for head in range(nh):
        out[:, head * dv:(head + 1) * dv] = w.v_up[head].matmul(np.ascontiguousarray(latent_out[:, head, :R]))
    return w.o.matmul(out)
