"""The FFN seam: the one place where the forward pass asks for MLP / MoE outputs.

Theory of operation
-------------------
``Model.forward`` computes attention itself and, for the feed-forward half of every layer,
calls ``backend.ffn(layer, x)`` with the post-attention-normed hidden rows ``x`` [T, H] f32
and adds the [T, H] f32 answer to the residual. :class:`LocalFFN` answers in-process; the
swarm's coordinator backend answers by sending work to peers. Both are compositions of
the pure building blocks below, so a remote backend that runs the same blocks on the same
rows gets the same bits:

* **MoE layer.** ``logits = model.router_logits(layer, x)`` [T, E]; ``routing =
  route(logits, **model.routing_config(layer).kwargs())``; ``rows = expert_rows(routing)``
  gives each selected expert its row indices, ascending. Each expert ``e`` is computed as
  ``swiglu_ffn(model.expert_weights(layer, e), x[rows[e]])`` — over exactly its own rows in
  ascending order, so its result does not depend on which other rows a request carries.
  ``combine(T, H, routing, outputs, shared=model.shared_expert_output(layer, x))`` then
  adds the weighted expert rows in the **fixed order: experts ascending** (for a given row,
  its k contributions are added in ascending expert index — the order transformers' expert
  loop uses), starting from zeros, and adds the shared expert (already sigmoid-gated for
  Qwen2-MoE) last.
* **Dense layer.** The whole MLP is ``swiglu_ffn(model.dense_weights(layer), x)``. Under a
  plan that splits the intermediate dimension into ranges ``[(lo0, hi0), (lo1, hi1), ...]``
  (ascending, covering ``0:F``), each holder computes ``swiglu_ffn(model.dense_weights(layer,
  lo, hi), x)`` (= :func:`dense_partial`) and the partials are summed **in range order** by
  :func:`sum_partials`. The sum equals the full MLP up to float rounding; the same plan
  gives the same bits locally and in the swarm.

``LocalFFN(model, plan)`` follows exactly these steps, so "same plan, local vs swarm" is
bit-identical on the same numeric build.

Segments (continuous batching)
------------------------------
A step of the batch scheduler carries the rows of several sequences: ``segments`` [n] gives
their lengths in row order (a decode row is a segment of 1, a prefill chunk one of up to the
chunk size). A row's result must not depend on the other segments, and it does not: every
step here — matrix products (:meth:`~swarm.compute.quant.QMatrix.matmul`, whatever the
encoding and the row count), norms, routing, activations, the combine — computes each row by
a fixed sequence of float32 operations that depends only on the row. So the union of the rows
goes through each step in one call, the sequence alone gets the same bits, and a coordinator
may resend or regroup rows freely. ``segments`` stays on the wire and in the API where a step
needs it (attention runs per sequence on its own cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from swarm.compute.kernels import (MLPWeights, _row_kernels, one_row_alike, sigmoid, softmax, swiglu,
                                   swiglu_many, swiglu_one_row)
from swarm.compute.quant import as_qmatrix

if TYPE_CHECKING:
    from swarm.compute.model import KVCache, Model

F32 = np.float32

DensePlan = Mapping[int, Sequence[tuple[int, int]]]


class FFNBackend(Protocol):
    """What the forward pass calls for every layer's MLP / MoE output."""

    def ffn(self, layer: int, x: np.ndarray, segments: Sequence[int] | None = None) -> np.ndarray:
        """x [T, H] f32 (already post-attention-normed) → [T, H] f32. ``segments``: the rows'
        sequences (lengths in row order, module docstring); None: one sequence. The forward
        pass passes it only when a step holds more than one sequence."""
        ...


@runtime_checkable
class LayerBackend(FFNBackend, Protocol):
    """An FFN backend that runs whole layers itself (the swarm's stage dispatch): the forward pass
    hands it the embedded rows instead of running the layers, then applies the final norm and the
    head to what it returns."""

    def run_layers(self, model: Model, x: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """x [T, H] f32: embedded rows at positions ``start ..`` of ``cache``'s sequence → the rows
        after the last layer [T, H] f32."""
        ...

    def run_layers_batch(self, model: Model, x: np.ndarray, seqs: list[tuple[KVCache, int, int]]) -> np.ndarray:
        """One step of several sequences: x [sum T_i, H] f32 holds each sequence's embedded rows in
        turn, ``seqs[i] = (cache, start, T_i)`` → the rows after the last layer [sum T_i, H] f32."""
        ...


def segment_ids(segments: Sequence[int] | None, T: int) -> np.ndarray | None:
    """The segment index of each of ``T`` rows [T] int64, or None for one segment.

    Raises ValueError when the lengths are not positive or do not sum to T."""
    if segments is None or len(segments) <= 1:
        if segments is not None and sum(segments) != T:
            raise ValueError(f"segments {list(segments)} do not cover {T} rows")
        return None
    lengths = np.asarray(segments, dtype=np.int64)
    if (lengths <= 0).any() or int(lengths.sum()) != T:
        raise ValueError(f"segments must be positive lengths summing to the {T} rows, got {lengths.tolist()[:16]}")
    return np.repeat(np.arange(lengths.size), lengths)


def run_lengths(seg: np.ndarray | None, n: int) -> np.ndarray:
    """Lengths of the runs of equal segment ids in ``seg`` [n] (None: one run of n) [runs] i32:
    the ``segments`` of a request on the wire (empty for no rows)."""
    if n == 0:
        return np.zeros(0, np.int32)
    if seg is None:
        return np.array([n], np.int32)
    cuts = np.flatnonzero(seg[1:] != seg[:-1]) + 1
    return np.diff(np.concatenate([[0], cuts, [n]])).astype(np.int32)


def swiglu_rows(weights: MLPWeights, x_rows: np.ndarray, seg: np.ndarray | None = None) -> np.ndarray:
    """:func:`swiglu_ffn` over rows of several sequences (``seg`` [n]: each row's segment id;
    None: one sequence) in one call: each row's result depends only on the row, so each gets
    the bits its sequence alone gets (module docstring, "Segments")."""
    return swiglu_ffn(weights, x_rows)


@dataclass(frozen=True)
class Routing:
    """Top-k choice per row: ``experts`` [T, k] int64 (slot order: best first, ties to the
    lower index) and ``weights`` [T, k] f32 (the combine weights of those slots)."""

    experts: np.ndarray
    weights: np.ndarray


@dataclass(frozen=True)
class RoutingConfig:
    """How one MoE layer routes: ``scoring`` ('softmax' | 'sigmoid'), ``top_k``,
    ``norm_topk_prob`` (renormalise the k weights to sum 1), the number of experts, and for the
    DeepSeek-V3 style of router: ``selection_bias`` [E] f32 (``e_score_correction_bias``, added
    for choosing only), ``n_group`` / ``topk_group`` (top-k only within the ``topk_group``
    best of ``n_group`` equal groups of experts) and ``routed_scaling_factor`` (multiplies the
    final weights)."""

    n_experts: int
    top_k: int
    norm_topk_prob: bool
    scoring: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    selection_bias: np.ndarray | None = field(default=None, compare=False)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def kwargs(self) -> dict:
        """Keyword arguments for :func:`route`."""
        return dict(scoring=self.scoring, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                    selection_bias=self.selection_bias, n_group=self.n_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor)


def route(router_logits: np.ndarray, *, scoring: str = "softmax", top_k: int,
          norm_topk_prob: bool, selection_bias: np.ndarray | None = None, n_group: int = 1,
          topk_group: int = 1, routed_scaling_factor: float = 1.0) -> Routing:
    """Choose ``top_k`` experts per row and their combine weights.

    router_logits [T, E] f32. Scores are ``softmax`` over experts (Mixtral, Qwen-MoE,
    OLMoE) or ``sigmoid`` per expert (DeepSeek-V3). ``selection_bias`` [E] f32, if given, is
    added to the scores for *choosing* only; the weights come from the unbiased scores
    (DeepSeek-V3's ``e_score_correction_bias``). Ties go to the lowest expert index
    (a stable sort on descending score). With ``norm_topk_prob`` the k weights are divided
    by their sum (transformers' ``router_top_value /= router_top_value.sum(-1)``).
    Group-limited routing (DeepSeek-V3 ``DeepseekV3TopkRouter``): with ``n_group`` > 1 the
    experts form ``n_group`` equal groups, a group scores the sum of its two best choice scores,
    and only the experts of the ``topk_group`` best groups can be chosen. The weights are then
    multiplied by ``routed_scaling_factor``. ``topk_softmax`` (gpt-oss ``GptOssTopKRouter``)
    chooses the k largest logits and softmaxes over those k only.
    Raises ValueError on a bad shape, dtype, k or grouping.
    """
    if router_logits.ndim != 2 or router_logits.dtype != F32:
        raise ValueError(f"router logits must be [T, E] float32, got {router_logits.shape} {router_logits.dtype}")
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be within 1..{E}")
    if scoring == "topk_softmax":
        experts = np.argsort(-router_logits, axis=-1, kind="stable")[:, :top_k].astype(np.int64)  # [T, k]
        weights = softmax(np.take_along_axis(router_logits, experts, axis=-1), axis=-1)
        return Routing(experts, np.ascontiguousarray(weights, dtype=F32))
    if scoring == "softmax":
        scores = softmax(router_logits, axis=-1)
    elif scoring == "sigmoid":
        scores = sigmoid(router_logits)
    else:
        raise ValueError(f"unknown router scoring {scoring!r} (expected 'softmax', 'sigmoid' or 'topk_softmax')")
    choice = scores
    if selection_bias is not None:
        if selection_bias.shape != (E,):
            raise ValueError(f"selection_bias must have shape ({E},), got {selection_bias.shape}")
        choice = scores + selection_bias.astype(F32)
    if n_group > 1:
        choice = _group_limited(choice, n_group, topk_group)
    if T == 1:  # decode: the same choice and values, without take_along_axis's index arrays
        best = np.argsort(-choice[0], kind="stable")[:top_k]
        experts = best.astype(np.int64).reshape(1, top_k)
        weights = scores[0, best].reshape(1, top_k)
    else:
        experts = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k].astype(np.int64)  # [T, k]
        weights = np.take_along_axis(scores, experts, axis=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / np.add.reduce(weights, axis=-1, keepdims=True, dtype=F32)  # = np.sum
    if routed_scaling_factor != 1.0:
        weights = weights * F32(routed_scaling_factor)
    return Routing(experts, np.ascontiguousarray(weights, dtype=F32))


def _group_limited(choice: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """``choice`` [T, E] with the experts outside each row's ``topk_group`` best groups set to
    -inf; a group's score is the sum of its two best choice scores (ties to the lower group)."""
    T, E = choice.shape
    if E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{E} experts cannot form {n_group} groups of which {topk_group} are kept")
    grouped = choice.reshape(T, n_group, E // n_group)
    best2 = -np.sort(-grouped, axis=-1)[..., :2]  # [T, G, 2]
    group_scores = best2[..., 0] + best2[..., 1] if best2.shape[-1] == 2 else best2[..., 0]
    keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]  # [T, topk_group]
    mask = np.zeros((T, n_group), bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    return np.where(np.repeat(mask, E // n_group, axis=-1), choice, F32(-np.inf)).astype(F32)


def _one_row_slots(routing: Routing) -> list[tuple[int, int]] | None:
    """For one row whose k experts are distinct (top-k always is): ``(expert, slot)`` pairs,
    experts ascending; else None."""
    if routing.experts.shape[0] != 1:
        return None
    chosen = routing.experts[0].tolist()
    pairs = sorted(zip(chosen, range(len(chosen))))
    return pairs if len(set(chosen)) == len(chosen) else None


def _expert_slots(routing: Routing) -> dict[int, np.ndarray]:
    """Expert index → the flat indices ``row * top_k + slot`` routed to it, rows ascending;
    experts ascending."""
    pairs = _one_row_slots(routing)
    if pairs is not None:  # decode: one slot per expert
        return {e: np.array([j]) for e, j in pairs}
    flat = routing.experts.reshape(-1)
    order = np.argsort(flat, kind="stable")  # stable: rows ascending within one expert
    if routing.experts.shape[0] == 1:  # decode: one row's k experts, distinct: one slot each
        slots = {int(flat[i]): order[j:j + 1] for j, i in enumerate(order.tolist())}
        if len(slots) == flat.size:
            return slots
    sorted_e = flat[order]
    cuts = (np.flatnonzero(sorted_e[1:] != sorted_e[:-1]) + 1).tolist()
    return {int(sorted_e[s]): order[s:t] for s, t in zip([0, *cuts], [*cuts, flat.size])}


def expert_rows(routing: Routing) -> dict[int, np.ndarray]:
    """Expert index → the rows routed to it, ascending (int64). Only selected experts appear;
    keys are in ascending order."""
    pairs = _one_row_slots(routing)
    if pairs is not None:  # decode: every expert gets row 0
        return {e: np.zeros(1, np.int64) for e, _ in pairs}
    k = routing.experts.shape[1]
    return {e: (idx // k).astype(np.int64) for e, idx in _expert_slots(routing).items()}


def swiglu_ffn(weights: MLPWeights, x_rows: np.ndarray) -> np.ndarray:
    """One expert (or dense slice) over its rows: x_rows [n, H] f32 → [n, H] f32 (SwiGLU)."""
    assert x_rows.dtype == F32, x_rows.dtype
    return swiglu(weights, np.ascontiguousarray(x_rows))


def dense_partial(weights: MLPWeights, x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``W_down[:, lo:hi] @ (silu(W_gate[lo:hi] x) * W_up[lo:hi] x)`` for x [T, H] f32 → [T, H].

    ``weights`` is the whole layer's MLP. Bit-identical to ``swiglu_ffn(weights.range(lo, hi), x)``,
    which is what a range holder computes from ``model.dense_weights(layer, lo, hi)``.
    Partials of ranges that cover ``0:F`` sum (in range order, :func:`sum_partials`) to the full MLP.
    """
    return swiglu_ffn(weights.range(lo, hi), x)


def sum_partials(partials: Sequence[np.ndarray]) -> np.ndarray:
    """Sum dense-range partials left to right (plan order): ``((p0 + p1) + p2) + ...``."""
    if not partials:
        raise ValueError("no dense partials to sum")
    acc = np.array(partials[0], dtype=F32, copy=True)
    for p in partials[1:]:
        acc += p
    return acc


def combine(T: int, H: int, routing: Routing, outputs: Mapping[int, np.ndarray],
            shared: np.ndarray | None = None) -> np.ndarray:
    """Weighted sum of expert outputs, in the fixed order *experts ascending*, then ``shared``.

    ``outputs[e]`` [n_e, H] f32 holds expert e's results for ``expert_rows(routing)[e]`` in
    that (ascending) row order. ``shared`` [T, H] f32 (gated shared-expert output) is added
    last. Raises ValueError when an expert is missing or has the wrong shape.
    """
    k = routing.experts.shape[1]
    flat_weights = routing.weights.reshape(-1)  # index = row * k + slot, as in _expert_slots
    out = np.zeros((T, H), dtype=F32)
    pairs = _one_row_slots(routing) if T == 1 else None
    if pairs is not None:  # decode: the same float32 multiply and add on the row, in expert order
        row, term = out[0], np.empty(H, F32)
        for e, j in pairs:
            y = outputs.get(e)
            if y is None or y.shape != (1, H) or y.dtype != F32:
                got = None if y is None else (y.shape, y.dtype)
                raise ValueError(f"expert {e}: expected output [1, {H}] float32, got {got}")
            np.multiply(y[0], flat_weights[j], out=term)
            row += term
        if shared is not None:
            out += shared
        return out
    for e, idx in _expert_slots(routing).items():  # ascending expert index
        rows = idx // k
        y = outputs.get(e)
        if y is None or y.shape != (rows.size, H) or y.dtype != F32:
            got = None if y is None else (y.shape, y.dtype)
            raise ValueError(f"expert {e}: expected output [{rows.size}, {H}] float32, got {got}")
        if T == 1:  # decode: the same float32 multiply and add on the row, without fancy indexing
            out[0] += y[0] * flat_weights[idx[0]]
        else:
            out[rows] += y * flat_weights[idx][:, None]
    if shared is not None:
        out += shared
    return out


def combine_rows(H: int, routing: Routing, ys: np.ndarray, shared: np.ndarray | None = None) -> np.ndarray:
    """:func:`combine` for one row whose k experts are distinct, their outputs stacked: ``ys``
    [k, H] f32, row i the output of the i-th selected expert in ascending order. The same float32
    multiplies and adds, in the same order: [1, H] f32."""
    pairs = _one_row_slots(routing)
    if pairs is None or ys.shape != (len(pairs), H) or ys.dtype != F32:
        raise ValueError(f"expected one row's distinct experts' outputs [{routing.experts.shape[1]}, {H}] float32, "
                         f"got {ys.shape} {ys.dtype}")
    weights = routing.weights.reshape(-1)[[j for _, j in pairs]]
    out = np.zeros((1, H), dtype=F32)
    _row_kernels().weighted_sum(out[0], ys, weights)
    if shared is not None:
        out += shared
    return out


def shared_expert(weights: MLPWeights, gate: np.ndarray | None, x: np.ndarray,
                  seg: np.ndarray | None = None) -> np.ndarray:
    """Shared-expert output for x [T, H] f32: ``sigmoid(x @ gate.T) * swiglu(x)`` when a gate
    [1, H] is given (Qwen2-MoE's ``shared_expert_gate``), else plain ``swiglu(x)``. ``seg``:
    the rows' segment ids, accepted and not needed (rows are independent)."""
    x = np.ascontiguousarray(x)
    y = swiglu(weights, x)
    if gate is not None:
        y = sigmoid(as_qmatrix(gate).matmul(x)) * y  # [T, 1] * [T, H]
    return y


def check_dense_plan(ranges: Sequence[tuple[int, int]], F: int, layer: int) -> None:
    """Ranges must be non-empty, ascending, contiguous and cover ``0:F``. Raises ValueError."""
    pos = 0
    for lo, hi in ranges:
        if lo != pos or hi <= lo:
            raise ValueError(f"layer {layer}: dense ranges {list(ranges)} must be contiguous, "
                             f"ascending and cover 0:{F}")
        pos = hi
    if pos != F:
        raise ValueError(f"layer {layer}: dense ranges {list(ranges)} do not cover 0:{F}")


class LocalFFN:
    """In-process FFN backend. ``plan`` maps a dense layer to its ordered (lo, hi) ranges;
    layers not in the plan (and every MoE layer) are computed whole. Weight slices for the
    plan's ranges are materialised once and kept."""

    def __init__(self, model, plan: DensePlan | None = None):
        self.model = model
        self.plan = {int(k): [(int(lo), int(hi)) for lo, hi in v] for k, v in (plan or {}).items()}
        for layer, ranges in self.plan.items():
            if model.is_moe_layer(layer):
                raise ValueError(f"layer {layer} is a MoE layer; a plan gives ranges for dense layers only")
            check_dense_plan(ranges, model.dense_intermediate_size(layer), layer)
        self._slices: dict[tuple[int, int, int], MLPWeights] = {}
        self._moe = [model.is_moe_layer(layer) for layer in range(model.config.n_layers)]
        self._whole: dict[int, MLPWeights] = {}

    def ffn(self, layer: int, x: np.ndarray, segments: Sequence[int] | None = None) -> np.ndarray:
        assert x.dtype == F32 and x.ndim == 2, (x.dtype, x.shape)
        m = self.model
        seg = segment_ids(segments, x.shape[0])
        if self._moe[layer]:
            T, H = x.shape
            routing = route(m.router_logits(layer, x, seg), **m.routing_config(layer).kwargs())
            selected = expert_rows(routing)
            if T == 1:  # decode: every expert takes the one row as it is
                ws = [m.expert_weights(layer, e) for e in selected]
                xs = [np.ascontiguousarray(x)] * len(selected)
                if len(ws) > 1 and one_row_alike(ws, xs):  # the experts' outputs stacked, combined in one pass
                    return combine_rows(H, routing, swiglu_one_row(ws, xs[0]),
                                        shared=m.shared_expert_output(layer, x, seg))
            else:
                xs = [np.ascontiguousarray(x[rows]) for rows in selected.values()]
            outputs = dict(zip(selected, swiglu_many([m.expert_weights(layer, e) for e in selected], xs)))
            return combine(T, H, routing, outputs, shared=m.shared_expert_output(layer, x, seg))
        ranges = self.plan.get(layer)
        if not ranges:
            w = self._whole.get(layer)
            if w is None:
                w = self._whole[layer] = m.dense_weights(layer)
            return swiglu_ffn(w, x)
        partials = []
        for lo, hi in ranges:
            key = (layer, lo, hi)
            if key not in self._slices:
                self._slices[key] = m.dense_weights(layer, lo, hi)
            partials.append(swiglu_ffn(self._slices[key], x))
        return sum_partials(partials)
