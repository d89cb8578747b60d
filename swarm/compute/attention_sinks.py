"""Attention with learned sinks and a sliding window (gpt-oss).

Theory of operation
-------------------
gpt-oss adds one learned logit per query head, the *sink*, to the softmax's denominator:
``p_s = exp(a_s - m) / (Σ_s' exp(a_s' - m) + exp(sink - m))`` with ``m`` the maximum over the
scores and the sink, so a head may give its attention to no position at all (transformers
``GptOssAttention``: the sink is a column appended to the scores, dropped after the softmax).
Every other layer attends only to the last ``window`` positions: query ``i`` sees keys ``j``
with ``i - window < j <= i`` (transformers' sliding-window mask).

The KV cache keeps every position of a windowed layer too (keys outside the window are simply
not read), so caches, stages and failover treat every layer alike.

Numerics: numpy float32, one key/value head's query rows at a time. A row's result depends on
its query, its position and the cache, but the score and value products are library matrix
products whose rounding may change with the number of rows: a decode step and the same row
inside a prefill agree to float rounding, not bit for bit (the compiled
:func:`swarm.compute.kernels.attention` guarantees bits; it has neither sinks nor windows).
The same call on the same rows gives the same bits, so stages and batches of sequences (each
sequence attends on its own cache with its own rows) keep the local bits.

Shape legend: T query rows, nh query heads, nkv key/value heads, hd head dim, C cache capacity.
"""

from __future__ import annotations

import numpy as np

from swarm.compute.kernels import check_attention_shapes

F32 = np.float32


def sink_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, sinks: np.ndarray | None,
                   window: int = 0) -> np.ndarray:
    """Causal grouped-query attention with optional sinks and window.

    q [T, nh, hd] f32, already multiplied by the softmax scale, query t at position
    ``start + t``; k, v [nkv, C, hd] f32 (positions ``0 .. start+T-1`` filled); ``sinks`` [nh]
    f32 or None; ``window`` 0 for full attention. Query head h uses key/value head
    ``h // (nh / nkv)``. Returns [T, nh*hd] f32. Raises ValueError on other shapes or dtypes."""
    check_attention_shapes(q, k, v, start)
    T, nh, hd = q.shape
    nkv = k.shape[0]
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks must be [{nh}], got {sinks.shape}")
    end = start + T
    lo = max(0, start - window + 1) if window else 0  # the first position any of the rows sees
    pos = np.arange(start, end)[:, None]  # [T, 1]
    keys = np.arange(lo, end)[None, :]  # [1, L]
    hidden = keys > pos
    if window:
        hidden |= keys <= pos - window
    g = nh // nkv
    out = np.empty((T, nh, hd), F32)
    for j in range(nkv):
        heads = slice(j * g, (j + 1) * g)
        scores = np.matmul(q[:, heads].transpose(1, 0, 2), k[j, lo:end].T)  # [g, T, L]
        scores[:, hidden] = -np.inf
        top = scores.max(axis=-1, keepdims=True)  # [g, T, 1]
        if sinks is not None:
            sink = sinks[heads].astype(F32)[:, None, None]  # [g, 1, 1]
            top = np.maximum(top, sink)
        p = np.exp(scores - top)
        denom = p.sum(axis=-1, keepdims=True, dtype=F32)
        if sinks is not None:
            denom = denom + np.exp(sink - top)
        out[:, heads] = (np.matmul(p, v[j, lo:end]) / denom).transpose(1, 0, 2)  # [T, g, hd]
    return out.reshape(T, nh * hd)
