"""A model file's sizes for the planner: :class:`~swarm.peer.plan.ModelShape` with the encoded
bytes of every FFN unit as the file stores them and as a browser peer holds them: the file's
bytes for what its kernels read as they are (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K,
which every page of this release announces; F32, F16, BF16), Q8_0's for what the coordinator
repacks for it (:func:`~swarm.peer.weights.repack.roles_to_repack`, the rule shipping follows)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

from swarm.peer.plan import Q8_0_BYTES, ModelShape
from swarm.peer.weights.repack import K_ENCODINGS, PAGE_ENCODINGS, roles_to_repack

if TYPE_CHECKING:
    from swarm.compute.model import Model


def model_shape(model: Model) -> ModelShape:
    """From a :class:`swarm.compute.model.Model`, with the encoded size of every FFN tensor as the
    file stores it. Only the file's header is read (no weight bytes)."""
    base = ModelShape.from_config(model.config)
    ck = model.checkpoint

    def sizes(mats, per: int) -> tuple[int, int]:
        own = sum(m.nbytes for m in mats)
        roles = dict(zip(("gate", "up", "down"), mats, strict=True))
        repacked = roles_to_repack({"tensors": [{"role": r, "encoding": m.qtype.name} for r, m in roles.items()]},
                                   PAGE_ENCODINGS | K_ENCODINGS)
        page = sum(math.ceil(m.data.shape[0] * m.cols * Q8_0_BYTES) if r in repacked else m.nbytes
                   for r, m in roles.items())
        return math.ceil(own / per), math.ceil(page / per)

    expert = [sizes(ck.expert_matrices(layer, 0), 1) for layer in base.moe_layers]
    column = [sizes([ck.matrix(p, layer) for p in ("gate", "up", "down")], base.intermediate_size)
              for layer in base.dense_layers]
    e_own, e_page = (max(x) for x in zip(*expert)) if expert else (0, 0)
    c_own, c_page = (max(x) for x in zip(*column)) if column else (0, 0)
    files = sum(os.path.getsize(p) for p in getattr(ck, "files", [model.path]) if os.path.isfile(p))
    ffn = len(base.moe_layers) * base.n_experts * e_own + len(base.dense_layers) * base.intermediate_size * c_own
    routers = len(base.moe_layers) * base.n_experts * base.hidden_size * 4  # decoded to float32
    return dataclasses.replace(base, expert_nbytes=e_own, column_nbytes=c_own, page_expert_nbytes=e_page,
                               page_column_nbytes=c_page, resident_nbytes=max(files - ffn, 0) + routers)
