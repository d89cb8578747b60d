"""The sizes of a model the plans are cut to: its layers, experts, widths and the bytes each unit
takes as a peer holds it, and what a peer keeps besides weights. Pure: built from a config and
numbers; :func:`swarm.peer.weights.sizes.model_shape` reads them from a model file."""

from __future__ import annotations

import math
from typing import Any
from dataclasses import dataclass

Q8_0_BYTES = 34 / 32  # bytes per weight of a Q8_0 block (f16 scale + 32 int8): a browser's repack


@dataclass(frozen=True)
class ModelShape:
    """The sizes the planner needs, from the model config and the weight dtype.

    ``moe_layers``: layer indices with routed experts; ``dense_layers``: layer
    indices with a dense MLP of width ``intermediate_size``. ``bytes_per_weight``:
    the in-memory size of one weight (4.0 for float32), used when the encoded sizes
    are not given. From a model file (:func:`swarm.peer.weights.sizes.model_shape`) the sizes are the real
    encoded ones, in bytes: ``expert_nbytes`` (one routed expert: gate, up, down,
    the largest over layers), ``column_nbytes`` (one dense intermediate unit),
    ``page_expert_nbytes`` / ``page_column_nbytes`` (the same on a browser peer:
    its kernels read Q4_0, Q4_1, Q8_0 and the K-quants as they are; other
    tensors are repacked to Q8_0, 34 bytes per 32 weights) and ``resident_nbytes`` (what only the coordinator holds:
    embeddings, attention, routers as float32, norms, head, shared experts). ``dense_block``:
    the multiple dense ranges are cut on — the block of the dense ``down`` tensors' encoding
    (32 for Q4_0 … Q8_0, 256 for the K-quants, 1 for float elements) — so a ``down`` column
    range keeps its encoding, and its bytes are what ``column_nbytes`` budgets.

    What is not a weight, in bytes (from the config and :func:`swarm.peer.memory.context_tokens`;
    0 when not given): ``kv_layer_bytes``, the KV cache of one layer for the reserved context;
    ``kv_bytes``, per layer, that or a linear-attention layer's recurrent states (:func:`reserve_of`);
    ``step_bytes``, a worker's activations in one step (:data:`swarm.peer.memory.STEP_ROWS` rows);
    ``coordinator_step_bytes``, the coordinator's (its head's logits too); ``record_bytes``, the
    rows it records per worker stage; ``n_layers``; ``top_k``, the experts a token uses.
    """

    hidden_size: int
    n_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    bytes_per_weight: float = 4.0
    expert_nbytes: int = 0
    column_nbytes: int = 0
    page_expert_nbytes: int = 0
    page_column_nbytes: int = 0
    resident_nbytes: int = 0
    dense_block: int = 1
    # what is not a weight, and what sizes it (see above)
    n_layers: int = 0
    top_k: int = 0
    kv_layer_bytes: int = 0
    kv_bytes: tuple[int, ...] = ()
    step_bytes: int = 0
    coordinator_step_bytes: int = 0
    record_bytes: int = 0

    @classmethod
    def from_config(cls, cfg, bytes_per_weight: float = 4.0) -> "ModelShape":
        """From a :class:`swarm.compute.config.ModelConfig`."""
        moe = tuple(cfg.moe_layers) if cfg.n_experts else ()
        dense = tuple(i for i in range(cfg.n_layers) if i not in moe) if cfg.intermediate_size else ()
        r = reserve_of(cfg)
        return cls(cfg.hidden_size, cfg.n_experts, cfg.moe_intermediate_size, cfg.intermediate_size,
                   moe, dense, bytes_per_weight, n_layers=cfg.n_layers, top_k=cfg.top_k if moe else 0, kv_layer_bytes=r["kv_layer_bytes"],
                   kv_bytes=r["kv_bytes"], step_bytes=r["step_bytes"], coordinator_step_bytes=r["coordinator_step_bytes"],
                   record_bytes=r["record_bytes"])

    def worker_weight_budget(self, allowance: int, gpu_memory: int | None = None) -> int:
        """Bytes of expert and MLP ranges a worker of ``allowance`` (its hello's budget) may hold:
        the allowance less one step's activations (a range peer keeps no KV cache); on a GPU peer
        that announced ``gpu_memory`` (bytes; None: none), no more than that less the same
        activations (its ranges' weights live in GPU buffers)."""
        return max(min(allowance, allowance if gpu_memory is None else gpu_memory) - self.step_bytes, 0)

    def coordinator_fixed_bytes(self, worker_stages: int = 0, kv_layers: int | None = None,
                                not_run_bytes: int = 0) -> int:
        """What the coordinator holds besides expert and MLP ranges (bytes): what only it holds
        (``resident_nbytes``) less ``not_run_bytes`` (the attention of layers whose stages run
        elsewhere: it maps them, but touches them only after a failover), the KV cache of the
        ``kv_layers`` layers whose attention it runs (None: every layer; under stages, its own
        stages' layers — a KV cache holds arrays only for the layers that run), its activations
        and the rows it records for ``worker_stages`` stages held by workers."""
        kv = self.n_layers if kv_layers is None else kv_layers
        kv_bytes = sum(self.kv_bytes[:kv]) if self.kv_bytes else kv * self.kv_layer_bytes  # its layers come first
        return (self.resident_nbytes - not_run_bytes + kv_bytes + self.coordinator_step_bytes
                + worker_stages * self.record_bytes)

    def coordinator_weight_budget(self, allowance: int, worker_stages: int = 0, kv_layers: int | None = None,
                                  not_run_bytes: int = 0) -> int:
        """Bytes of expert and MLP ranges the coordinator of ``allowance`` may hold: the allowance
        less :meth:`coordinator_fixed_bytes` (same arguments), never below 0."""
        return max(allowance - self.coordinator_fixed_bytes(worker_stages, kv_layers, not_run_bytes), 0)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert: gate [F, H], up [F, H], down [H, F]."""
        return self.expert_nbytes or math.ceil(3 * self.hidden_size * self.moe_intermediate_size * self.bytes_per_weight)

    @property
    def column_bytes(self) -> int:
        """Bytes of one dense intermediate column: a gate row, an up row, a down column."""
        return self.column_nbytes or math.ceil(3 * self.hidden_size * self.bytes_per_weight)

    def unit_bytes(self, kind: str = "python") -> tuple[int, int]:
        """(bytes of one expert, bytes of one dense column) as a peer of ``kind`` holds them."""
        if kind == "browser":
            return self.page_expert_nbytes or self.expert_bytes, self.page_column_nbytes or self.column_bytes
        return self.expert_bytes, self.column_bytes

    def ffn_bytes(self, kind: str = "python") -> int:
        """Bytes of every routed expert and dense MLP of the model, as a peer of ``kind`` holds them."""
        e, c = self.unit_bytes(kind)
        return len(self.moe_layers) * self.n_experts * e + len(self.dense_layers) * self.intermediate_size * c


def gpu_holds(held_bytes: int, gpu_memory: int | None, step_bytes: int) -> bool:
    """Whether a GPU peer computes work of ``held_bytes`` (bytes it holds for it: weights, and a
    stage's KV cache) on its GPU: they fit ``gpu_memory`` (bytes; None or 0: none announced, the
    host allowance is its only limit) less one step's activations ``step_bytes``. Otherwise it
    computes that work on its CPU from host memory, as a CPU peer does (docs/planner.md, "GPU
    memory"). The one rule both the planner and the worker apply."""
    return not gpu_memory or held_bytes <= max(gpu_memory - step_bytes, 0)


def reserve_of(cfg, context: int | None = None, sequences: int | None = None) -> dict[str, Any]:
    """What a peer keeps besides weights for a model of config ``cfg`` (bytes): ``kv_layer_bytes``
    (one layer's keys and values for ``context`` tokens, default
    :func:`swarm.peer.memory.context_tokens`), ``kv_bytes`` (per layer: that, or for a
    linear-attention layer the recurrent states of ``sequences`` sequences — default the
    process's ``--max-batch`` running and the prefix store's kept ones — whatever the context),
    ``step_bytes`` (a worker's activations of one
    step), ``coordinator_step_bytes`` (the coordinator's, with the head's logits for every row of
    a decode batch), ``record_bytes`` (the rows the coordinator records per worker stage, for
    failover: ``context`` rows of the hidden size), ``context`` (tokens)."""
    from swarm.peer import memory

    ctx = context or memory.context_tokens(getattr(cfg, "max_position_embeddings", 0) or 0)
    H, hd = cfg.hidden_size, cfg.head_dim
    attn = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    ffn = max(cfg.top_k * cfg.moe_intermediate_size + getattr(cfg, "shared_expert_intermediate_size", 0)
              if cfg.n_experts else 0, cfg.intermediate_size or 0)
    step = memory.activation_bytes(memory.STEP_ROWS, H, attn, ffn)
    logits = memory.activation_bytes(memory.STEP_ROWS, 0, 0, 0, vocab=cfg.vocab_size)
    kv_values = getattr(cfg, "kv_values_per_token", 2 * cfg.n_kv_heads * hd)  # MLA: the latent, once
    kv_layer = ctx * kv_values * memory.KV_BYTES_PER_VALUE
    linear = set(getattr(cfg, "linear_layers", ()))
    states = 0
    if linear:
        from swarm.compute.prefix import MAX_STATE_ENTRIES
        from swarm.compute.serving import default_max_batch

        sequences = sequences or default_max_batch() + MAX_STATE_ENTRIES
        states = sequences * cfg.state_values_per_sequence * memory.KV_BYTES_PER_VALUE
    return {"kv_layer_bytes": kv_layer, "kv_bytes": tuple(states if i in linear else kv_layer for i in range(cfg.n_layers)),
            "step_bytes": step, "coordinator_step_bytes": step + logits,
            "record_bytes": ctx * H * memory.ACT_BYTES_PER_VALUE, "context": ctx}

