"""Placement: which peer computes which experts and dense columns of which layer. Pure.

Theory of operation
-------------------
The coordinator turns what the peers said in their hellos (memory budget for
weights, measured FFN throughput, round trip) into a :class:`Plan`:

* every MoE layer's routed experts ``0..E-1`` are cut into contiguous
  :class:`Span` s, one per peer that gets any, in the plan's peer order;
* every dense MLP's intermediate dimension ``0..F-1`` is cut the same way, so
  the partial outputs of the spans sum to the full MLP (the coordinator adds
  them in span order), on multiples of :attr:`ModelShape.dense_block` (the
  ``down`` tensor's block: a column range of whole blocks stays in its encoding);
* shared experts (Qwen2-MoE) are not in the plan: they stay with the
  coordinator, with the embeddings, attention, routers, norms and head.

Shares are proportional to capacity — the measured throughput, with the
coordinator's counted at ``coordinator_share`` of its own because it also runs
attention, routing and sampling. Every peer has a memory budget, counted in the
bytes each holds in its encoding (:class:`ModelShape`: a Python peer keeps the
file's blocks, a browser peer Q8_0 repacks of the types its kernels cannot read);
the coordinator's is what its budget leaves after the weights only it holds. No
peer gets more than its budget: a capped share goes back to the others
(water-filling). What no peer can hold goes to the coordinator beyond its
budget — it has the model file and reads those weights from its mapping for
every token that needs them (slow: disk or page cache, not memory) — and the
plan says how many bytes that is (:attr:`Plan.streamed_bytes`). The round trip sets each request's
deadline rather than the shares: on a LAN it is far below a layer's compute,
and a heartbeat RTT measured while a peer was still loading its model is
inflated for a while. Only a peer whose round trip exceeds ``MAX_RTT_S`` —
a link that would stall every layer — gets nothing.

A plan carries the election term and a version that grows with each rebuild;
the coordinator rebuilds it when membership changes and switches to the new one
between decode steps only, never inside one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from swarm.peer.plan import ModelShape, Plan, Span, check_plan

MAX_RTT_S = 5.0  # a link this slow to answer would stall every layer (seconds)
COORDINATOR_SHARE = 0.5  # the coordinator also runs attention/routing/sampling


@dataclass(frozen=True)
class PeerCapacity:
    """What a peer offers, from its hello.

    ``memory_bytes``: the peer's allowance (bytes, ≥ 0: its hello's ``memory_budget``, what
    weights, KV cache and activations may take together, see :mod:`swarm.peer.memory`); a
    range peer's weights get that less :attr:`ModelShape.step_bytes`. ``ffn_speed``: measured
    FFN throughput in any unit shared by all peers (e.g. GFLOP/s; > 0 to get work).
    ``rtt_s``: measured round trip to the coordinator (seconds). ``gpu_memory``: what the GPU of
    a Python GPU peer holds (bytes, its hello's ``gpu_memory``; None: none given, the host
    allowance is its only limit): its planned weights — and a stage's KV cache — fit that too.
    """

    peer_id: str
    memory_bytes: int
    ffn_speed: float
    rtt_s: float = 0.0
    kind: str = "python"  # "browser": holds Q8_0 repacks of what its kernels cannot read
    gpu_memory: int | None = None


def _shares(weights: dict[str, float], caps: dict[str, float]) -> dict[str, float]:
    """Water-filling: fractions ∝ weights, none above its cap, excess to the uncapped rest."""
    share = {p: 0.0 for p in weights}
    free = {p for p, w in weights.items() if w > 0}
    left = 1.0
    while free and left > 1e-12:
        total = sum(weights[p] for p in free)
        # The ratio first: left * w underflows for subnormal speeds, and shares then sum past 1.
        over = {p for p in free if left * (weights[p] / total) > caps[p]}
        if not over:
            for p in free:
                share[p] += left * (weights[p] / total)
            break
        for p in over:
            share[p] += caps[p]
            left -= caps[p]
        free -= over
    return share


def _cut(width: int, peers: Sequence[str], share: Mapping[str, float], rotate: int) -> list[int]:
    """Largest-remainder counts summing to ``width``; ties rotate with ``rotate`` (the layer)."""
    exact = [share.get(p, 0.0) * width for p in peers]
    counts = [math.floor(x) for x in exact]
    n = len(peers)
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), (i - rotate) % n))
    for i in order[: width - sum(counts)]:
        counts[i] += 1
    return counts


def build_plan(
    shape: ModelShape,
    coordinator: PeerCapacity,
    workers: Iterable[PeerCapacity],
    *,
    term: int,
    version: int,
    coordinator_share: float = COORDINATOR_SHARE,
    coordinator_budget: int | None = None,
    layers: Collection[int] | None = None,
) -> Plan:
    """Place experts and dense columns over the coordinator and ``workers``.

    Returns a plan whose spans tile every MoE and dense layer; no worker's
    ``plan.bytes_of(peer, shape, kind)`` exceeds its weight budget.
    A worker's weights stay within :meth:`ModelShape.worker_weight_budget` of its
    ``memory_bytes`` and ``gpu_memory`` (its activations kept out).
    ``coordinator_budget``: bytes of FFN weights the coordinator can keep besides
    what only it holds, its KV cache and activations (None: unbounded, it holds the whole
    model; :meth:`ModelShape.coordinator_weight_budget` of its allowance). What no peer can
    hold within its budget goes to the coordinator anyway, which reads it from its
    model file; ``plan.streamed_bytes`` says how many bytes that is.
    ``layers``: the layers whose FFN is cut (None: every layer); each other layer is the
    coordinator's whole and uncounted in its budget — a mix runs those as whole-layer stages on
    other peers, and here (from the mapped file) only after a stage fails.
    """
    if layers is not None:
        cut, full = set(layers), shape
        whole = dataclasses.replace(shape, moe_layers=tuple(i for i in shape.moe_layers if i not in cut),
                                    dense_layers=tuple(i for i in shape.dense_layers if i not in cut))
        shape = dataclasses.replace(shape, moe_layers=tuple(i for i in shape.moe_layers if i in cut),
                                    dense_layers=tuple(i for i in shape.dense_layers if i in cut))
        plan = build_plan(shape, coordinator, workers, term=term, version=version,
                          coordinator_share=coordinator_share, coordinator_budget=coordinator_budget)
        c = coordinator.peer_id
        experts = {**plan.experts, **{i: (Span(c, 0, shape.n_experts),) for i in whole.moe_layers if shape.n_experts}}
        dense = {**plan.dense, **{i: (Span(c, 0, shape.intermediate_size),) for i in whole.dense_layers
                                  if shape.intermediate_size}}
        plan = dataclasses.replace(plan, experts=dict(sorted(experts.items())), dense=dict(sorted(dense.items())))
        check_plan(plan, full)
        return plan
    workers = sorted((w for w in workers if w.peer_id != coordinator.peer_id), key=lambda w: w.peer_id)
    cap_of = {w.peer_id: w for w in workers}
    peers = (coordinator.peer_id, *(w.peer_id for w in workers))
    c_budget = math.inf if coordinator_budget is None else max(int(coordinator_budget), 0)
    weights = {coordinator.peer_id: max(coordinator.ffn_speed, 1e-9) * coordinator_share}
    caps = {coordinator.peer_id: c_budget / shape.ffn_bytes() if shape.ffn_bytes() else math.inf}
    held_max = {w.peer_id: shape.worker_weight_budget(w.memory_bytes, w.gpu_memory) for w in workers}
    for w in workers:
        usable = w.ffn_speed > 0 and w.rtt_s <= MAX_RTT_S and held_max[w.peer_id] > 0
        weights[w.peer_id] = w.ffn_speed if usable else 0.0
        total = shape.ffn_bytes(w.kind)
        caps[w.peer_id] = held_max[w.peer_id] / total if total else 0.0
    share = _shares(weights, caps)
    share[coordinator.peer_id] += max(1.0 - sum(share.values()), 0.0)  # what nobody can hold
    budget = {coordinator.peer_id: c_budget, **held_max}
    used = {p: 0 for p in peers}

    def spans_for(width: int, column: bool, layers: Sequence[int], step: int = 1) -> dict:
        """Spans of ``0..width`` on multiples of ``step`` (the last one may end short of one)."""
        units = -(-width // step)
        unit = {p: shape.unit_bytes(cap_of[p].kind if p in cap_of else "python")[column] * step for p in peers}

        def room(p: str) -> int:
            if not unit[p] or budget[p] == math.inf:
                return units  # unbounded: all of a layer
            return max(int((budget[p] - used[p]) // unit[p]), 0)

        table = {}
        for layer in layers:
            counts = _cut(units, peers, share, layer)
            # Rounding may push a worker past its budget: hand those units to the coordinator.
            for i, p in enumerate(peers[1:], start=1):
                if counts[i] > room(p):
                    counts[0] += counts[i] - room(p)
                    counts[i] = room(p)
            # ... and the coordinator past its own: to workers with room left, if any.
            over = counts[0] - room(peers[0])
            for i, p in enumerate(peers[1:], start=1):
                if over <= 0:
                    break
                if weights[p] > 0:
                    take = min(over, room(p) - counts[i])
                    if take > 0:
                        counts[i] += take
                        counts[0] -= take
                        over -= take
            for p, c in zip(peers, counts):
                used[p] += c * unit[p]
            spans, at = [], 0
            for p, c in zip(peers, counts):
                if c:
                    spans.append(Span(p, at * step, min((at + c) * step, width)))
                    at += c
            table[layer] = tuple(spans)
        return table

    experts = spans_for(shape.n_experts, False, shape.moe_layers) if shape.n_experts else {}
    dense = (spans_for(shape.intermediate_size, True, shape.dense_layers, max(shape.dense_block, 1))
             if shape.intermediate_size else {})
    streamed = 0 if coordinator_budget is None else max(used[coordinator.peer_id] - c_budget, 0)
    plan = Plan(version, term, coordinator.peer_id, peers, experts, dense, streamed_bytes=int(streamed))
    check_plan(plan, shape)
    return plan


def shortfall(plan: Plan, shape: ModelShape, read_bytes_per_s: float | None = None,
              coordinator_allowance: int | None = None, worker_stages: int = 0,
              kv_layers: int | None = None, not_run_bytes: int = 0) -> dict | None:
    """What the swarm lacks to hold ``plan`` in memory, and the speed to expect; None when
    nothing is missing. ``coordinator_over_bytes``: how far
    :meth:`ModelShape.coordinator_fixed_bytes` (``worker_stages``, ``kv_layers``,
    ``not_run_bytes``) exceeds its ``coordinator_allowance`` (0 when not given or within). Bytes: ``missing_bytes`` (the coordinator's spans beyond its budget, read
    from its model file), ``held_bytes`` and ``ffn_bytes`` (of every expert and MLP);
    ``read_bytes_per_token``: what one decode token reads of the missing part (a routed expert is
    used by ``top_k / n_experts`` of the tokens, a dense column by every one);
    ``read_bytes_per_s``: the model file's read rate past the page cache (``read_bytes_per_s``,
    else :func:`swarm.peer.memory.read_rate`: measured at start, or an assumed disk) and
    ``measured``; ``s_per_token``: the least a decode token takes to read that (seconds);
    ``message``: all of it in words."""
    from swarm.peer import memory

    fixed = shape.coordinator_fixed_bytes(worker_stages, kv_layers, not_run_bytes)
    over = max(fixed - coordinator_allowance, 0) if coordinator_allowance is not None else 0
    if plan.streamed_bytes <= 0 and not over:
        return None
    total = shape.ffn_bytes()
    e, c = shape.unit_bytes()
    moe = len(shape.moe_layers) * shape.n_experts * e
    dense = len(shape.dense_layers) * shape.intermediate_size * c
    used = (shape.top_k / shape.n_experts if shape.n_experts and shape.top_k else 1.0)
    fraction = (moe * used + dense) / (moe + dense) if moe + dense else 1.0
    per_token = math.ceil(plan.streamed_bytes * fraction)
    rate, measured = (read_bytes_per_s, True) if read_bytes_per_s else memory.read_rate()
    s_token = per_token / rate
    gb = lambda n: f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"  # noqa: E731
    how = "measured" if measured else "assumed"
    message = "" if plan.streamed_bytes <= 0 else (f"the swarm's memory holds {gb(total - plan.streamed_bytes)} of the model's {gb(total)} of expert and "
               f"MLP weights: {gb(plan.streamed_bytes)} is missing, and the coordinator reads it from its model file "
               f"for every token that needs it: about {gb(per_token)} a token, at least {s_token:,.2f} s a token at "
               f"the {rate / 1e6:,.0f} MB/s its disk reads ({how}; less where the page cache keeps some). Add a peer "
               f"with at least {gb(plan.streamed_bytes)} free, raise a peer's --memory, or lower --context.")
    if over:
        message += (" " if message else "") + (f"The coordinator's own part (embeddings, attention, head, the KV cache of the layers it runs, activations: "
                    f"{gb(fixed)}) is {gb(over)} more than its memory allows: lower --context, or let a peer with "
                    "more memory coordinate.")
    return {"coordinator_over_bytes": int(over), "missing_bytes": int(plan.streamed_bytes), "held_bytes": int(total - plan.streamed_bytes),
            "ffn_bytes": int(total), "read_bytes_per_token": per_token, "read_bytes_per_s": rate,
            "measured": measured, "s_per_token": s_token, "message": message}


def shortfall_message(plan: Plan, shape: ModelShape, read_bytes_per_s: float | None = None) -> str | None:
    """:func:`shortfall`'s ``message``; None when nothing is streamed."""
    short = shortfall(plan, shape, read_bytes_per_s)
    return None if short is None else short["message"]
