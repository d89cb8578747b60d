"""A model file's sizes for the planner: :class:`~swarm.peer.plan.ModelShape` with the encoded
bytes of every FFN unit as the file stores them and as a browser peer holds them: the file's
bytes for what its kernels read as they are (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K,
which every page of this release announces; F32, F16, BF16), Q8_0's for what the coordinator
repacks for it (:func:`~swarm.peer.weights.repack.roles_to_repack`, the rule shipping follows)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection
from typing import TYPE_CHECKING

from gguf import GGML_QUANT_SIZES

from swarm.compute import numerics
from swarm.peer.plan import Q8_0_BYTES, ModelShape
from swarm.peer.weights.repack import K_ENCODINGS, PAGE_ENCODINGS, roles_to_repack

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.compute.quant import QMatrix


def _units(model: Model, base: ModelShape) -> tuple[list[dict[str, QMatrix]], list[dict[str, QMatrix]]]:
    """gate/up/down of one expert of each MoE layer, and of each dense MLP (header reads only)."""
    ck = model.checkpoint
    roles = ("gate", "up", "down")
    return ([dict(zip(roles, ck.expert_matrices(layer, 0), strict=True)) for layer in base.moe_layers],
            [{r: ck.matrix(r, layer) for r in roles} for layer in base.dense_layers])


def _repacked_roles(unit: dict[str, QMatrix], encodings: frozenset[str]) -> set[str]:
    return roles_to_repack({"tensors": [{"role": r, "encoding": m.qtype.name} for r, m in unit.items()]}, encodings)


def repacks_for(model: Model, encodings: frozenset[str]) -> bool:
    """True when a peer whose kernels read ``encodings`` as they are (a page's or a GPU peer's:
    :func:`~swarm.peer.weights.repack.page_encodings`) computes some FFN block of ``model`` on a
    Q8_0 repack. Only the file's header is read."""
    experts, dense = _units(model, ModelShape.from_config(model.config))
    return any(_repacked_roles(unit, encodings) for unit in experts + dense)


X8_TYPES = ("Q4_K", "Q6_K", "Q8_0")  # the types the GPU's int8 GEMVs read (web_peer/int8_activations.py)


def int8_gpu_refusal(model: Model, types: Collection[str] = X8_TYPES) -> str | None:
    """Why a GPU peer of the int8 numerics whose GEMVs read ``types`` (GGUF type names, of
    :data:`X8_TYPES`: what its Hello's ``x8:`` names) cannot serve ``model``'s FFN blocks, or
    None: every gate, up and down (one expert of each MoE layer, each dense MLP) must be of
    those types, Q8_0 rows a multiple of 64 weights, and no SwiGLU clamped (gpt-oss) — its
    answers are checked by their int8 down rows against a bound the other types and widths do
    not have. Only the file's header is read."""
    types = [t for t in X8_TYPES if t in types]
    if model.config.swiglu_limit:
        return "its experts' SwiGLU is clamped and biased (gpt-oss), which has no int8 form"
    experts, dense = _units(model, ModelShape.from_config(model.config))
    for kind, units in (("an expert's", experts), ("a dense MLP's", dense)):
        for unit in units:
            for role, m in unit.items():
                name = m.qtype.name
                if name not in types:
                    return f"{kind} {role} is {name}; its int8 GEMVs read {', '.join(types) or 'none'}"
                if name == "Q8_0" and m.cols % 64:
                    return f"{kind} {role} is Q8_0 of rows of {m.cols} weights, not a multiple of 64"
    return None


def model_shape(model: Model) -> ModelShape:
    """From a :class:`swarm.compute.model.Model`, with the encoded size of every FFN tensor as the
    file stores it. Only the file's header is read (no weight bytes)."""
    base = ModelShape.from_config(model.config)
    ck = model.checkpoint

    def sizes(unit: dict[str, QMatrix], per: int) -> tuple[int, int]:
        own = sum(m.nbytes for m in unit.values())
        repacked = _repacked_roles(unit, PAGE_ENCODINGS | K_ENCODINGS)
        page = sum(math.ceil(m.data.shape[0] * m.cols * Q8_0_BYTES) if r in repacked else m.nbytes
                   for r, m in unit.items())
        return math.ceil(own / per), math.ceil(page / per)

    experts, dense = _units(model, base)
    expert = [sizes(unit, 1) for unit in experts]
    column = [sizes(unit, base.intermediate_size) for unit in dense]
    # dense ranges are cut on whole blocks of every dense layer's down (its columns are in blocks)
    block = math.lcm(1, *(GGML_QUANT_SIZES[unit["down"].qtype][0] for unit in dense))
    if block == 32 and numerics.int8():  # blocks of 32 have an int8 product on 64 values at a time
        block = 64
    e_own, e_page = (max(x) for x in zip(*expert)) if expert else (0, 0)
    c_own, c_page = (max(x) for x in zip(*column)) if column else (0, 0)
    files = sum(os.path.getsize(p) for p in getattr(ck, "files", [model.path]) if os.path.isfile(p))
    ffn = len(base.moe_layers) * base.n_experts * e_own + len(base.dense_layers) * base.intermediate_size * c_own
    routers = len(base.moe_layers) * base.n_experts * base.hidden_size * 4  # decoded to float32
    return dataclasses.replace(base, expert_nbytes=e_own, column_nbytes=c_own, page_expert_nbytes=e_page,
                               page_column_nbytes=c_page, resident_nbytes=max(files - ffn, 0) + routers,
                               dense_block=block)


def layer_nbytes(model: Model) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer, (bytes of its attention, bytes of its FFN — every routed expert, or the dense
    MLP), as the file stores them (header reads only): what a stage's weights count for the
    planner (:class:`swarm.peer.coordinator.costmodel.LayerCosts`) and for a GPU worker's choice
    of device (:func:`stage_nbytes`)."""
    c, ck = model.config, model.checkpoint
    attn, ffn = [], []
    for layer in range(c.n_layers):
        attn.append(model.attention_nbytes(layer))
        if c.is_moe_layer(layer):
            ffn.append(sum(q.nbytes for q in ck.expert_matrices(layer, 0)) * c.n_experts)
        else:
            ffn.append(sum(ck.matrix(p, layer).nbytes for p in ("gate", "up", "down")))
    return tuple(attn), tuple(ffn)


def stage_nbytes(model: Model, lo: int, hi: int) -> tuple[int, int]:
    """(bytes a stage of layers ``lo .. hi-1`` holds — their weights, :func:`layer_nbytes`, and
    their KV cache for the context the plan reserves, :func:`swarm.peer.plan.reserve_of` —, one
    step's activations): the planner's counts (``LayerCosts.stage_bytes``, ``step_bytes``)."""
    from swarm.peer.plan import reserve_of

    attn, ffn = layer_nbytes(model)
    r = reserve_of(model.config)
    return sum(attn[i] + ffn[i] + r["kv_bytes"][i] for i in range(lo, hi)), r["step_bytes"]
