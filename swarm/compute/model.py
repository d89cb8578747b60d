"""The model: compact weights, the KV cache, the forward pass.

``load_model(path)`` opens a GGUF file or an HF safetensors directory. Weight matrices stay in
the file's encoding, memory-mapped (:class:`~swarm.compute.quant.QMatrix`); only norms,
biases and routers are decoded to float32. Pages of the file are read when first used: the
coordinator touches attention and routers, a worker only the experts
(``expert_weights(layer, e)``) or dense ranges (``dense_weights(layer, lo, hi)``) it holds.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from swarm.compute.attention_mla import MLAWeights, load_mla_weights, mla_attention
from swarm.compute.attention_sinks import sink_attention
from swarm.compute.checkpoint import Checkpoint, open_checkpoint
from swarm.compute.config import ModelConfig
from swarm.compute.decode import MAX_ROWS as MAX_DECODE_ROWS, DecodeRunner, supported as decode_supported
from swarm.compute.deltanet import (DeltaNetWeights, RecurrentState, deltanet_attention, load_deltanet_weights,
                                    prepare_kernel as prepare_deltanet_kernel)
from swarm.compute.ffn import FFNBackend, LayerBackend, LocalFFN, RoutingConfig, shared_expert
from swarm.compute.kernels import (MLPWeights, apply_rope_swapped, attention, rms_norm,
                                   llama3_inv_freq, prepare_row_kernels, rope_inv_freq, rope_tables,
                                   sigmoid, signed_sin)
from swarm.compute.quant import QMatrix, aligned_empty, matmul_many, prepare_kernels
from swarm.compute.rope import apply_partial_rope, yarn_attention_factor, yarn_inv_freq

F32 = np.float32
ATTENTION_MATRICES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "k_b", "v_b",
                      "lin_qkv", "lin_z", "lin_b", "lin_a", "lin_out")


class ProductDevice(Protocol):
    """Where a model view computes its layers' attention projections (Q, K, V, O):
    ``matmul_many`` keeps :func:`swarm.compute.quant.matmul_many`'s contract — each (W
    [rows, cols] QMatrix, x float32 [T, cols], out float32 [T, rows] or None) gives x @ W.T,
    written into ``out`` where given; returns the results in order."""

    def matmul_many(self, products: Sequence[tuple[QMatrix, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]: ...


class KVCache:
    """Keys and values of every layer for one sequence.

    ``k[layer]``, ``v[layer]``: [nkv, capacity, hd] f32, or None for a layer that has not run
    here yet (:meth:`layer` allocates it): under stages a peer keeps the KV cache of the layers
    it computes only, so the memory it plans for is the memory it uses. Positions
    ``0 .. length-1`` are filled. Capacity doubles when a forward call needs more room.
    ``length`` may run ahead of ``capacity``: under stages the coordinator's cache counts every
    position of the sequence while its arrays grow only when its own layers run (never, for a
    coordinator without a stage of its own); a stage that moves to it later writes those
    positions, growing the arrays then.

    Multi-head latent attention (``config.is_mla``) keeps one array per layer, [1, capacity,
    kv_lora_rank + qk_rope_head_dim] (the compressed KV and the RoPE key of each position,
    :mod:`swarm.compute.attention_mla`): ``k[layer]`` and ``v[layer]`` are that same array.

    A Gated DeltaNet layer (``config.linear_layers``) keeps no keys/values: ``states[layer]`` is
    the sequence's :class:`~swarm.compute.deltanet.RecurrentState` there (:meth:`recurrent`),
    which only runs on from its own position, from the one before its last step or from 0
    (:meth:`resumes`).
    """

    def __init__(self, config: ModelConfig, capacity: int = 256):
        self.config = config
        self.length = 0
        self.capacity = 0
        self.k: list[np.ndarray | None] = [None] * config.n_layers
        self.v: list[np.ndarray | None] = [None] * config.n_layers
        self.states: list[RecurrentState | None] = [None] * config.n_layers
        self._grow(capacity)

    def recurrent(self, i: int) -> RecurrentState:
        """Linear-attention layer ``i``'s recurrent state, allocated (zeros, position 0) on first use."""
        state = self.states[i]
        if state is None:
            state = self.states[i] = RecurrentState(self.config)
        return state

    def resumes(self, start: int, lo: int = 0, hi: int | None = None) -> bool:
        """Whether layers ``lo .. hi-1`` can run rows from position ``start``: always for KV rows
        (a suffix re-run overwrites them); a recurrent state only from its own position, the
        one before its last step, or 0 (:class:`~swarm.compute.deltanet.RecurrentState`)."""
        layers = range(lo, self.config.n_layers if hi is None else hi)
        return all(start == 0 if self.states[i] is None else self.states[i].resumes(start)
                   for i in layers if self.config.is_linear_layer(i))

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``i``'s (keys, values), each [nkv, capacity, hd] f32, allocated on first use
        (a linear-attention layer: its recurrent state is allocated instead, and the pair is
        empty [nkv, 0, hd] arrays)."""
        if self.config.is_linear_layer(i):
            self.recurrent(i)
            empty = np.zeros((self.config.n_kv_heads, 0, self.config.head_dim), F32)
            return empty, empty
        if self.k[i] is None:
            shape = (self.config.n_kv_heads, self.capacity, self.config.head_dim)
            self.k[i] = np.zeros(shape, F32)
            self.v[i] = self.k[i] if self._latent else np.zeros(shape, F32)
        return self.k[i], self.v[i]

    @property
    def _latent(self) -> bool:
        return getattr(self.config, "is_mla", False)

    def _grow(self, capacity: int) -> None:
        c = self.config
        shape = (c.n_kv_heads, capacity, c.head_dim)

        def grown(a: np.ndarray) -> np.ndarray:
            b = np.zeros(shape, F32)
            held = min(self.length, a.shape[1])  # see the class docstring: length may pass capacity
            b[:, :held] = a[:, :held]
            return b

        for i, a in enumerate(self.k):
            if a is not None:
                self.k[i] = grown(a)
                self.v[i] = self.k[i] if self._latent else grown(self.v[i])
        self.capacity = capacity

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions: capacity doubles with the sequence, never past the
        model's context (``max_position_embeddings``) unless ``total`` itself is."""
        if total > self.capacity:
            cap = max(self.capacity, 16)
            while cap < total:
                cap *= 2
            context = getattr(self.config, "max_position_embeddings", 0) or cap
            self._grow(max(total, min(cap, context)))

    def truncate(self, length: int) -> None:
        """Forget positions ``length ..`` (e.g. to re-run a suffix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's attention: ``q`` [nh*hd, H], ``k`` and ``v`` [nkv*hd, H], ``o`` [H, nh*hd]
    (compact, PyTorch orientation); ``qkv_bias`` [(nh+2nkv)*hd] or None; norms [H] f32. ``qk_norm == "proj"``: ``q_norm`` [nh*hd], ``k_norm``
    [nkv*hd]; ``"head"``: ``q_norm`` [nh+nkv, hd] (the q weight per query head, then the k
    weight per key head) and ``k_norm`` None. gpt-oss: ``o_bias`` [H] after the output
    projection, ``sinks`` [nh] (:mod:`swarm.compute.attention_sinks`)."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    q: QMatrix
    k: QMatrix
    v: QMatrix
    qkv_bias: np.ndarray | None
    o: QMatrix
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    o_bias: np.ndarray | None = None
    sinks: np.ndarray | None = None


class Model:
    """A loaded decoder-only transformer.

    ``path``: file or directory it came from; ``config``: :class:`ModelConfig`;
    ``metadata``: GGUF key/values (``format == "gguf"``) or the parsed ``config.json``
    (``format == "hf"``; tokenizer files live next to it in ``path``).
    Thread-safety: weight materialisation is guarded by a lock; ``forward`` on distinct caches
    may run concurrently.
    """

    products: ProductDevice | None = None  # None: the engine's kernels; a view's device (with_products)

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.path: Path = checkpoint.path
        self.config: ModelConfig = checkpoint.config
        self.metadata: dict = checkpoint.metadata
        self.format = "hf" if checkpoint.path.is_dir() else "gguf"
        self._lock = threading.RLock()
        prepare_kernels()  # compile or load them now, not inside the first (deadline-bound) request
        prepare_row_kernels()
        if checkpoint.config.linear_layers:
            prepare_deltanet_kernel()
        self._attn: dict[int, AttentionWeights] = {}
        self._dense: dict[int, MLPWeights] = {}
        self._experts: dict[tuple[int, int], MLPWeights] = {}
        self._routers: dict[int, QMatrix] = {}
        self._router_biases: dict[int, np.ndarray] = {}
        self._shared: dict[int, tuple[MLPWeights, np.ndarray | None]] = {}
        self._routing: dict[int, RoutingConfig] = {}
        self._hash: str | None = None
        c = self.config
        self._inv_freq = rope_inv_freq(c.rope_dim, c.rope_theta)
        self._rope_factor = 1.0  # YaRN's attention factor on cos and sin
        rope_type = c.rope_scaling.get("rope_type") if c.rope_scaling else None
        if rope_type == "llama3":
            params = {k: v for k, v in c.rope_scaling.items() if k != "rope_type"}
            self._inv_freq = llama3_inv_freq(self._inv_freq, **params)
        elif rope_type == "yarn":
            self._inv_freq = yarn_inv_freq(c.rope_dim, c.rope_theta, **c.rope_scaling)
            self._rope_factor = yarn_attention_factor(**c.rope_scaling)
        if checkpoint.has("rope_freqs"):  # llama.cpp stores llama3's scaling as per-frequency divisors
            freqs = checkpoint.load("rope_freqs")
            self._inv_freq = (self._inv_freq / freqs).astype(F32)
        self._cos = np.zeros((0, c.rope_dim), F32)
        self._sin = np.zeros((0, c.rope_dim), F32)
        # per-head factor on query/key heads: the softmax scale on queries, 1 on keys
        self._head_scale = np.ones((c.n_heads + c.n_kv_heads, 1), F32)
        self._head_scale[:c.n_heads] = F32(c.attention_scale if c.attention_scale is not None
                                           else 1.0 / np.sqrt(c.head_dim))

    # ---- identity -------------------------------------------------------------------------
    def content_hash(self) -> str:
        """The model's identity (64 hex digits: SHA-256 over its files' headers, sizes and sampled
        data; :func:`swarm.compute.identity.model_identity`), computed once."""
        if self._hash is None:
            self._hash = self.checkpoint.content_hash()
        return self._hash

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.config, capacity)

    def with_products(self, device: ProductDevice) -> Model:
        """A view of this model whose attention projections (Q, K, V, O of standard attention)
        run on ``device`` (a GPU stage peer's); it shares the weights, their lock and caches.
        This model keeps the engine's kernels (it may coordinate, and verify others, meanwhile)."""
        view = copy.copy(self)
        view.products = device
        return view

    def _project(self, products: list[tuple[QMatrix, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]:
        """Attention's products on this view's device (:meth:`with_products`)."""
        return matmul_many(products) if self.products is None else self.products.matmul_many(products)

    def _product(self, w: QMatrix, x: np.ndarray) -> np.ndarray:
        return w.matmul(x) if self.products is None else self.products.matmul_many([(w, x, None)])[0]

    # ---- global weights -------------------------------------------------------------------
    @cached_property
    def embed(self) -> QMatrix:
        """Token embeddings [V, H], compact (``embed.take(ids)`` decodes rows)."""
        return self.checkpoint.matrix("embed")

    @cached_property
    def final_norm(self) -> np.ndarray:
        return self.checkpoint.load("norm")

    @cached_property
    def head(self) -> QMatrix:
        """Output projection [V, H], compact (the embeddings when tied); logits = head.matmul(x)."""
        if self.config.tie_word_embeddings or not self.checkpoint.has("head"):
            return self.embed
        return self.checkpoint.matrix("head")

    # ---- per-layer weights ----------------------------------------------------------------
    def attention_weights(self, layer: int) -> AttentionWeights | MLAWeights | DeltaNetWeights:
        w = self._attn.get(layer)
        if w is None:
            with self._lock:
                w = self._attn.get(layer) or self._load_attention(layer)
                self._attn[layer] = w
        return w

    def _load_attention(self, layer: int) -> AttentionWeights | MLAWeights | DeltaNetWeights:
        ck, c = self.checkpoint, self.config
        if c.is_mla:
            return load_mla_weights(ck, layer)
        if c.is_linear_layer(layer):
            return load_deltanet_weights(ck, layer)
        q, k, v = (ck.matrix(p, layer) for p in ("q", "k", "v"))
        bias = None
        if ck.has("q_bias", layer):
            bias = np.concatenate([ck.load(p, layer) for p in ("q_bias", "k_bias", "v_bias")])
        qn = kn = None
        if c.qk_norm:
            qn, kn = ck.load("q_norm", layer), ck.load("k_norm", layer)
        if c.qk_norm == "head":  # one [nh+nkv, hd] weight for the stacked Q|K heads
            # in row order: concatenating broadcast rows gives a column-major array
            qn = np.ascontiguousarray(np.concatenate([np.broadcast_to(qn, (c.n_heads, c.head_dim)),
                                                      np.broadcast_to(kn, (c.n_kv_heads, c.head_dim))]))
            kn = None
        return AttentionWeights(
            attn_norm=ck.load("attn_norm", layer), ffn_norm=ck.load("ffn_norm", layer),
            q=q, k=k, v=v, qkv_bias=bias, o=ck.matrix("o", layer), q_norm=qn, k_norm=kn,
            o_bias=ck.load("o_bias", layer) if c.output_bias else None,
            sinks=ck.load("sinks", layer) if c.attention_sinks else None)

    def attention_nbytes(self, layer: int) -> int:
        """Bytes of layer ``layer``'s attention matrices as the file stores them (from the
        header; nothing is decoded): Q, K, V, O, or MLA's projections."""
        ck = self.checkpoint
        return sum(ck.matrix_nbytes(p, layer) for p in ck.required_parts(layer) if p in ATTENTION_MATRICES)

    def is_moe_layer(self, layer: int) -> bool:
        return self.config.is_moe_layer(layer)

    @property
    def n_experts(self) -> int:
        return self.config.n_experts

    def dense_intermediate_size(self, layer: int) -> int:
        """F of a dense layer's MLP."""
        return self.config.intermediate_size

    def dense_weights(self, layer: int, lo: int | None = None, hi: int | None = None) -> MLPWeights:
        """The dense MLP of ``layer`` (whole: views of the mapped file) or units ``lo:hi`` of it
        (:meth:`MLPWeights.range`: gate/up rows as views, down's columns as a compact copy)."""
        if self.is_moe_layer(layer):
            raise ValueError(f"layer {layer} is a MoE layer, not dense")
        F = self.dense_intermediate_size(layer)
        full = self._dense.get(layer)
        if full is None and not (lo is None and hi is None):  # a range holder keeps only its range
            return self._load_dense(layer).range(0 if lo is None else lo, F if hi is None else hi)
        if full is None:
            with self._lock:
                full = self._dense.get(layer) or self._load_dense(layer)
                self._dense[layer] = full
        if lo is None and hi is None:
            return full
        return full.range(0 if lo is None else lo, F if hi is None else hi)

    def _load_dense(self, layer: int) -> MLPWeights:
        ck = self.checkpoint
        return MLPWeights(ck.matrix("gate", layer), ck.matrix("up", layer), ck.matrix("down", layer))

    def expert_weights(self, layer: int, e: int) -> MLPWeights:
        """Expert ``e`` of MoE layer ``layer`` (materialised on first use, then cached)."""
        key = (layer, e)
        w = self._experts.get(key)
        if w is None:
            if not self.is_moe_layer(layer):
                raise ValueError(f"layer {layer} is dense; it has no experts")
            if not 0 <= e < self.config.n_experts:
                raise ValueError(f"expert {e} is outside 0..{self.config.n_experts - 1}")
            c = self.config
            bias = self.checkpoint.expert_biases(layer, e) if c.expert_bias else None
            w = MLPWeights(*self.checkpoint.expert_matrices(layer, e), bias=bias,
                           swiglu_limit=c.swiglu_limit, swiglu_alpha=c.swiglu_alpha)
            with self._lock:
                self._experts[key] = w
        return w

    def router(self, layer: int) -> QMatrix:
        """Router weights of MoE layer ``layer``: [E, H], decoded to float32 (an F32 QMatrix)."""
        r = self._routers.get(layer)
        if r is None:
            r = QMatrix.from_float(self.checkpoint.load("router", layer))
            self._routers[layer] = r
        return r

    def router_logits(self, layer: int, x: np.ndarray, seg: np.ndarray | None = None) -> np.ndarray:
        """x [T, H] f32 → router logits [T, E] f32 (:meth:`QMatrix.matmul`: a row's logits depend
        only on the row), plus the router's bias where it has one (gpt-oss). ``seg``: accepted
        for the callers that pass the rows' segment ids; not needed."""
        logits = self.router(layer).matmul(x)
        if self.config.expert_bias:
            logits += self._router_logit_bias(layer)
        return logits

    def _router_logit_bias(self, layer: int) -> np.ndarray:
        b = self._router_biases.get(layer)
        if b is None:
            b = self._router_biases[layer] = self.checkpoint.load("router_logit_bias", layer)
        return b

    def routing_config(self, layer: int) -> RoutingConfig:
        """How MoE layer ``layer`` routes (:func:`swarm.compute.ffn.route`): the config's scoring,
        top-k, renormalisation, groups and routed scaling, and the layer's selection bias
        (``e_score_correction_bias``) when the file has one."""
        c = self.config
        rc = self._routing.get(layer)
        if rc is None:
            bias = self.checkpoint.load("router_bias", layer) if self.checkpoint.has("router_bias", layer) else None
            rc = self._routing[layer] = RoutingConfig(
                n_experts=c.n_experts, top_k=c.top_k, norm_topk_prob=c.norm_topk_prob, scoring=c.scoring,
                selection_bias=bias, n_group=c.n_group, topk_group=c.topk_group,
                routed_scaling_factor=c.routed_scaling_factor)
        return rc

    def has_shared_expert(self, layer: int) -> bool:
        return self.is_moe_layer(layer) and self.config.shared_expert_intermediate_size > 0

    def shared_expert_weights(self, layer: int) -> tuple[MLPWeights, np.ndarray | None]:
        """(shared expert MLP, its sigmoid gate [1, H] or None) of MoE layer ``layer``."""
        s = self._shared.get(layer)
        if s is None:
            ck = self.checkpoint
            w = MLPWeights(*(ck.matrix(p, layer) for p in ("shexp_gate_proj", "shexp_up", "shexp_down")))
            gate = ck.load("shexp_gate", layer) if ck.has("shexp_gate", layer) else None
            s = self._shared[layer] = (w, gate)
        return s

    def shared_expert_output(self, layer: int, x: np.ndarray, seg: np.ndarray | None = None) -> np.ndarray | None:
        """Gated shared-expert output [T, H] f32 for x [T, H], or None when the layer has none.
        ``seg``: the rows' segment ids (:func:`~swarm.compute.ffn.segment_ids`), None: one sequence."""
        if not self.has_shared_expert(layer):
            return None
        w, gate = self.shared_expert_weights(layer)
        return shared_expert(w, gate, x, seg)

    def materialize(self) -> None:
        """Open every weight now (benchmarks; a coordinator that serves everything): views of the
        mapped file, plus the float32 norms, biases and routers."""
        _ = self.embed, self.head, self.final_norm
        for layer in range(self.config.n_layers):
            self.attention_weights(layer)
            if self.is_moe_layer(layer):
                self.router(layer)
                for e in range(self.config.n_experts):
                    self.expert_weights(layer, e)
                if self.has_shared_expert(layer):
                    self.shared_expert_weights(layer)
            else:
                self.dense_weights(layer)

    # ---- forward --------------------------------------------------------------------------
    def _rope(self, start: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        if start + T > self._cos.shape[0]:
            with self._lock:
                n = max(2 * self._cos.shape[0], start + T, 256)
                self._cos, self._sin = rope_tables(np.arange(n), self._inv_freq)
                if self._rope_factor != 1.0:
                    self._cos, self._sin = self._cos * F32(self._rope_factor), self._sin * F32(self._rope_factor)
        return self._cos[start:start + T], self._sin[start:start + T]

    def _qk_tables(self, start: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE tables for Q and K heads side by side, [T, nh+nkv, r] (r rotated dims of a head):
        cos and signed sin, with the attention scale (1/sqrt(hd) unless the config sets one)
        folded into the query rows (once per forward call). For MLA, [T, 1, r] unscaled: one
        table for the query heads and the shared RoPE key (:func:`mla_attention`)."""
        cos, sin = self._rope(start, T)
        if self.config.is_mla:
            return cos[:, None, :], signed_sin(sin)[:, None, :]
        scale = self._head_scale
        return cos[:, None, :] * scale, signed_sin(sin)[:, None, :] * scale

    def qk_tables(self, start: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_qk_tables` for a device that rotates the heads itself (a GPU stage)."""
        return self._qk_tables(start, T)

    def _rotate(self, qk: np.ndarray, cos_qk: np.ndarray, sin_qk: np.ndarray) -> np.ndarray:
        """RoPE on the stacked query and key heads qk [T, nh+nkv, hd] (all dims, or the leading
        ``rotary_dim``); queries come out scaled by the attention scale."""
        if self.config.rope_dim == self.config.head_dim:
            return apply_rope_swapped(qk, cos_qk, sin_qk)
        return apply_partial_rope(qk, cos_qk, sin_qk, self._head_scale)

    def _attention(self, layer: int, h: np.ndarray, cache: KVCache, start: int,
                   cos_qk: np.ndarray, sin_qk: np.ndarray) -> np.ndarray:
        """Self-attention of h [T, H] (normed) at positions ``start ..``; writes K/V to ``cache``."""
        c, w = self.config, self.attention_weights(layer)
        T = h.shape[0]
        if c.is_mla:
            return mla_attention(c, w, layer, h, [(0, T, cache, start)], cos_qk, sin_qk)
        if c.linear_layers or c.attn_output_gate:  # Qwen3.5: one path for one sequence and several
            return self._attention_rows(layer, h, [(0, T, cache, start)], cos_qk, sin_qk)
        nh, nkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        nq = nh * hd
        nk = nkv * hd
        qkv = np.empty((T, nq + 2 * nk), F32)  # [T, (nh + 2 nkv) hd]
        self._project([(w.q, h, qkv[:, :nq]), (w.k, h, qkv[:, nq:nq + nk]), (w.v, h, qkv[:, nq + nk:])])
        if w.qkv_bias is not None:
            qkv += w.qkv_bias
        if c.qk_norm == "proj":  # OLMoE: RMSNorm over the whole Q and K projections
            qkv[:, :nq] = rms_norm(qkv[:, :nq], w.q_norm, c.rms_norm_eps)
            qkv[:, nq:nq + nkv * hd] = rms_norm(qkv[:, nq:nq + nkv * hd], w.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            np.clip(qkv, -F32(c.clip_qkv), F32(c.clip_qkv), out=qkv)
        qk = qkv[:, :nq + nkv * hd].reshape(T, nh + nkv, hd)
        if c.qk_norm == "head":  # Qwen3: RMSNorm over each head (q and k weights stacked per head)
            qk = rms_norm(qk, w.q_norm, c.rms_norm_eps)
        qk = self._rotate(qk, cos_qk, sin_qk)  # queries come out scaled by the attention scale
        end = start + T
        k, v = cache.layer(layer)
        k[:, start:end] = qk[:, nh:].transpose(1, 0, 2)
        v[:, start:end] = qkv[:, nq + nkv * hd:].reshape(T, nkv, hd).transpose(1, 0, 2)
        return self._attend_out(layer, w, qk[:, :nh], k, v, start)

    def _attend_out(self, layer: int, w: AttentionWeights, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    start: int, o_proj: bool = True) -> np.ndarray:
        """Attention of queries q [T, nh, hd] over the cache (``attention``, or with gpt-oss's
        sinks and window), then the output projection (and its bias) unless ``o_proj`` is
        False: [T, H] f32 (or [T, nh*hd])."""
        window = self.config.layer_window(layer)
        if w.sinks is None and not window:
            out = attention(q, k, v, start)
        else:
            out = sink_attention(q, k, v, start, w.sinks, window)
        if not o_proj:
            return out
        y = self._product(w.o, out)
        if w.o_bias is not None:
            y += w.o_bias
        return y

    def forward(self, tokens, cache: KVCache, ffn: FFNBackend | None = None,
                last_only: bool = False) -> np.ndarray:
        """Run ``tokens`` [T] (ints) after what ``cache`` holds; append their keys/values.

        Returns logits [T, V] f32 (``[1, V]`` for the last token with ``last_only``). Every
        MLP / MoE output comes from ``ffn.ffn(layer, x)`` (default: :class:`LocalFFN`). A
        :class:`~swarm.compute.ffn.LayerBackend` (the swarm's stage dispatch) is handed the embedded rows and runs all layers itself (:meth:`layers` on
        its own share), after which forward applies the final norm and the head.
        Raises ValueError for an empty sequence or a token id outside the vocabulary; if the
        backend raises, ``cache.length`` is unchanged (the call can be retried).
        """
        c = self.config
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        lo, hi = (int(ids[0]),) * 2 if ids.size == 1 else (ids.min(), ids.max())
        if lo < 0 or hi >= c.vocab_size:
            raise ValueError(f"token id out of range 0..{c.vocab_size - 1}: {lo}..{hi}")
        if ffn is None:
            ffn = self._local_ffn
        T, start = ids.size, cache.length
        if c.sliding_window and start + T > c.sliding_window:
            raise ValueError(f"sequence of {start + T} positions exceeds the model's attention window "
                             f"({c.sliding_window}); sliding-window attention is not supported")
        x = self.embed.take(ids)  # [T, H] f32
        if type(ffn) is not LocalFFN and isinstance(ffn, LayerBackend):  # whole layers elsewhere (stages)
            x = ffn.run_layers(self, x, cache, start)
        else:
            x = self.layers(x, cache, start, 0, c.n_layers, ffn)
        cache.length = start + T
        if last_only:
            x = x[-1:]
        logits = self.head.matmul(rms_norm(x, self.final_norm, c.rms_norm_eps))  # [T, V]
        assert logits.dtype == F32
        return logits

    def forward_batch(self, parts: list[tuple[Sequence[int], KVCache]], ffn: FFNBackend | None = None
                      ) -> np.ndarray:
        """One step of several sequences: ``parts[i] = (tokens, cache)`` runs sequence i's
        ``tokens`` (a prefill chunk or one decode token) after what its cache holds.

        Returns the logits of each part's last token [n_parts, V] f32. Each row is bit-identical
        to what :meth:`forward` gives the same tokens on the same cache alone (``last_only``):
        attention runs per sequence on its own cache, the rest on the union of the rows, where
        a row's result depends only on the row (swarm/compute/ffn.py, "Segments"). The FFN backend gets the union of the rows and their
        ``segments``. A :class:`~swarm.compute.ffn.LayerBackend` (the stage layout) gets the
        embedded rows of all sequences at once through its ``run_layers_batch``.
        Raises ValueError as :meth:`forward`; if the backend raises, no cache length changes.
        """
        if ffn is None:
            ffn = self._local_ffn
        if not parts:
            raise ValueError("forward_batch needs at least one sequence")
        c = self.config
        ids = [np.asarray(t, dtype=np.int64).reshape(-1) for t, _ in parts]
        lengths = [i.size for i in ids]
        flat = np.concatenate(ids)
        if min(lengths) == 0:
            raise ValueError("forward_batch needs at least one token per sequence")
        if flat.min() < 0 or flat.max() >= c.vocab_size:
            raise ValueError(f"token id out of range 0..{c.vocab_size - 1}: {flat.min()}..{flat.max()}")
        if len({id(cache) for _, cache in parts}) != len(parts):
            raise ValueError("each sequence of a batch needs its own KV cache")
        seqs = [(cache, cache.length, T) for (_, cache), T in zip(parts, lengths)]
        for _, start, T in seqs:
            if c.sliding_window and start + T > c.sliding_window:
                raise ValueError(f"sequence of {start + T} positions exceeds the model's attention window "
                                 f"({c.sliding_window}); sliding-window attention is not supported")
        x = self.embed.take(flat)
        if isinstance(ffn, LayerBackend):  # whole layers elsewhere (stages)
            x = ffn.run_layers_batch(self, x, seqs)
        else:
            x = self.layers_batch(x, seqs, 0, c.n_layers, ffn)
        for cache, start, T in seqs:
            cache.length = start + T
        bounds = np.cumsum(lengths).tolist()
        last = rms_norm(x[[b - 1 for b in bounds]], self.final_norm, c.rms_norm_eps)  # [n, H]
        return self.head.matmul(last)

    def layers_batch(self, x: np.ndarray, seqs: list[tuple[KVCache, int, int]], lo: int, hi: int,
                     ffn: FFNBackend | None = None) -> np.ndarray:
        """:meth:`layers` for the rows of several sequences at once: ``x`` [sum T_i, H] f32 holds
        each sequence's rows in turn, ``seqs[i] = (cache, start, T_i)`` (positions
        ``start .. start+T_i-1``, each sequence its own cache). Attention runs per sequence on its
        own cache, the rest on the union; each row has the bits :meth:`layers` gives its sequence
        alone. ``cache.length`` is left to the caller. Returns [sum T_i, H] f32. A step of
        decode rows (every T_i = 1, up to ``decode.MAX_ROWS`` of them) with the model's own FFN
        takes :class:`~swarm.compute.decode.DecodeRunner`'s steps: the same bits, less Python.
        Raises ValueError for a bad layer range, rows of the wrong shape, a shared cache or a
        sequence past the model's attention window."""
        c = self.config
        if not 0 <= lo < hi <= c.n_layers:
            raise ValueError(f"layer range {lo}:{hi} is outside 0:{c.n_layers}")
        lengths = [T for _, _, T in seqs]
        if x.dtype != F32 or x.ndim != 2 or x.shape != (sum(lengths), c.hidden_size) or min(lengths, default=0) < 1:
            raise ValueError(f"hidden rows must be [sum of the sequences' rows {sum(lengths)}, {c.hidden_size}] "
                             f"float32 with a row per sequence at least, got {x.shape} {x.dtype}")
        if len({id(cache) for cache, _, _ in seqs}) != len(seqs):
            raise ValueError("each sequence of a batch needs its own KV cache")
        if ffn is None:
            ffn = self._local_ffn
        for cache, start, T in seqs:
            if c.sliding_window and start + T > c.sliding_window:
                raise ValueError(f"sequence of {start + T} positions exceeds the model's attention window "
                                 f"({c.sliding_window}); sliding-window attention is not supported")
            cache.reserve(start + T)
        if len(seqs) == 1:  # one sequence: layers' own path (a decode row: DecodeRunner's), the same bits
            return self.layers(x, seqs[0][0], seqs[0][1], lo, hi, ffn)
        if (x.shape[0] == len(seqs) <= MAX_DECODE_ROWS and self.plain_ffn(ffn) and self.products is None
                and self._decode is not None):  # decode rows only, the model's own FFN: DecodeRunner's steps
            return self._decode.rows(x, [(cache, start) for cache, start, _ in seqs], lo, hi, ffn)
        segments = lengths if len(seqs) > 1 else None
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        tables = [self._qk_tables(start, T) for _, start, T in seqs]
        cos_qk = np.concatenate([t[0] for t in tables]) if len(seqs) > 1 else tables[0][0]
        sin_qk = np.concatenate([t[1] for t in tables]) if len(seqs) > 1 else tables[0][1]
        rows = [(bounds[i], bounds[i + 1], cache, start) for i, (cache, start, _) in enumerate(seqs)]
        x = np.array(x, dtype=F32, order="C")  # the residual stream is ours to update in place
        eps = c.rms_norm_eps
        for layer in range(lo, hi):
            w = self.attention_weights(layer)
            x += self._attention_rows(layer, rms_norm(x, w.attn_norm, eps), rows, cos_qk, sin_qk)
            h = rms_norm(x, w.ffn_norm, eps)
            y = ffn.ffn(layer, h) if segments is None else ffn.ffn(layer, h, segments)
            assert y.dtype == F32 and y.shape == x.shape, (layer, y.dtype, y.shape)
            x += y
        return x

    def _attention_rows(self, layer: int, h: np.ndarray, seqs: list, cos_qk: np.ndarray,
                        sin_qk: np.ndarray) -> np.ndarray:
        """:meth:`_attention` over the rows of several sequences (``seqs``: (first row, end row,
        cache, start position) each): projections and the rest on the union of the rows (each
        row's result depends only on the row), keys/values and attention per sequence on its own
        cache."""
        c, w = self.config, self.attention_weights(layer)
        T = h.shape[0]
        if c.is_mla:
            return mla_attention(c, w, layer, h, seqs, cos_qk, sin_qk)
        if c.is_linear_layer(layer):
            return deltanet_attention(c, w, layer, h, seqs)
        nh, nkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        nq, nk = nh * hd, nkv * hd
        qkv = np.empty((T, nq + 2 * nk), F32)
        gate = None
        if c.attn_output_gate:  # Qwen3.5: each head's query, then its output gate: [T, nh, 2 hd]
            q_gate = np.empty((T, 2 * nq), F32)
            self._project([(w.q, h, q_gate), (w.k, h, qkv[:, nq:nq + nk]), (w.v, h, qkv[:, nq + nk:])])
            q_gate = q_gate.reshape(T, nh, 2 * hd)
            qkv[:, :nq] = q_gate[..., :hd].reshape(T, nq)
            gate = sigmoid(q_gate[..., hd:].reshape(T, nq))
        else:
            self._project([(w.q, h, qkv[:, :nq]), (w.k, h, qkv[:, nq:nq + nk]), (w.v, h, qkv[:, nq + nk:])])
        if w.qkv_bias is not None:
            qkv += w.qkv_bias
        if c.qk_norm == "proj":
            qkv[:, :nq] = rms_norm(qkv[:, :nq], w.q_norm, c.rms_norm_eps)
            qkv[:, nq:nq + nk] = rms_norm(qkv[:, nq:nq + nk], w.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            np.clip(qkv, -F32(c.clip_qkv), F32(c.clip_qkv), out=qkv)
        qk = qkv[:, :nq + nk].reshape(T, nh + nkv, hd)
        if c.qk_norm == "head":
            qk = rms_norm(qk, w.q_norm, c.rms_norm_eps)
        qk = self._rotate(qk, cos_qk, sin_qk)
        out = aligned_empty((T, nq))  # the output projection's activation rows
        for a, b, cache, start in seqs:
            end = start + b - a
            k, v = cache.layer(layer)
            k[:, start:end] = qk[a:b, nh:].transpose(1, 0, 2)
            v[:, start:end] = qkv[a:b, nq + nk:].reshape(b - a, nkv, hd).transpose(1, 0, 2)
            out[a:b] = self._attend_out(layer, w, qk[a:b, :nh], k, v, start, o_proj=False)
        if gate is not None:
            out *= gate
        y = self._product(w.o, out)
        if w.o_bias is not None:
            y += w.o_bias
        return y

    def layers(self, x: np.ndarray, cache: KVCache, start: int, lo: int, hi: int,
               ffn: FFNBackend | None = None) -> np.ndarray:
        """Run hidden rows ``x`` [T, H] f32 (positions ``start .. start+T-1``) through layers
        ``lo .. hi-1``; returns the hidden rows after layer ``hi-1`` [T, H] f32.

        Writes those layers' keys/values at positions ``start ..`` into ``cache`` and reads its
        earlier positions; ``cache.length`` is left to the caller (:meth:`forward` sets it once
        for all layers; a stage that holds only ``lo:hi`` sets its own). Same arithmetic, in the
        same order, as :meth:`forward`, so a layer range run here gives the bits forward gives.
        One row (a decode step) takes :class:`~swarm.compute.decode.DecodeRunner` where the
        layers allow it: the same operations with less Python between the kernels.
        Raises ValueError for a bad layer range or rows of the wrong shape/dtype.
        """
        c = self.config
        if not 0 <= lo < hi <= c.n_layers:
            raise ValueError(f"layer range {lo}:{hi} is outside 0:{c.n_layers}")
        if x.dtype != F32 or x.ndim != 2 or x.shape[1] != c.hidden_size:
            raise ValueError(f"hidden rows must be [T, {c.hidden_size}] float32, got {x.shape} {x.dtype}")
        if ffn is None:
            ffn = self._local_ffn
        T = x.shape[0]
        if T == 1 and self.products is None and self._decode is not None:  # a decode row: the short path
            return self._decode.layers(x, cache, start, lo, hi, ffn)
        cache.reserve(start + T)
        cos_qk, sin_qk = self._qk_tables(start, T)
        x = np.array(x, dtype=F32, order="C")  # the residual stream is ours to update in place
        eps = c.rms_norm_eps
        for layer in range(lo, hi):
            w = self.attention_weights(layer)
            x += self._attention(layer, rms_norm(x, w.attn_norm, eps), cache, start, cos_qk, sin_qk)
            y = ffn.ffn(layer, rms_norm(x, w.ffn_norm, eps))
            assert y.dtype == F32 and y.shape == x.shape, (layer, y.dtype, y.shape)
            x += y
        return x

    def plain_ffn(self, ffn: FFNBackend) -> bool:
        """Whether ``ffn`` computes what the model's own :class:`LocalFFN` does: it, or another
        LocalFFN of this model without a dense plan (a stage's local backend)."""
        return ffn is self._local_ffn or (type(ffn) is LocalFFN and ffn.model is self and not ffn.plan)

    @cached_property
    def _local_ffn(self) -> LocalFFN:
        return LocalFFN(self)

    @cached_property
    def _decode(self) -> DecodeRunner | None:
        """The one-row path of :meth:`layers` (swarm/compute/decode.py), where the layers allow it."""
        return DecodeRunner(self) if decode_supported(self) else None


def load_model(path: str | os.PathLike) -> Model:
    """Open a GGUF file or an HF directory (``config.json`` + ``*.safetensors``).

    Only the header/index is read here; weights are decoded on first use.
    Raises ModelFileError naming the file and the tensor/field that is wrong.
    """
    return Model(open_checkpoint(path))
