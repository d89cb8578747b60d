"""The planner's prices: how long a decode step and a prefill take under each placement. Pure.

Theory of operation
-------------------
A placement is one of

* ``local`` — the coordinator runs everything (only when its memory holds the model);
* ``ranges`` — every layer's experts / dense MLP columns are cut over the peers
  (:func:`swarm.peer.coordinator.planner.build_plan`): they compute one layer together, so each layer
  costs one round trip to every worker that gets work;
* ``stages`` — each peer runs a contiguous range of whole layers
  (:mod:`swarm.peer.coordinator.stages`): the hidden state crosses the network once per stage.

Inputs (:class:`PeerCost`): each peer's memory allowance in bytes (weights as it holds them —
compact: the file's blocks —, its KV cache and activations together), its compute speed in GFLOP/s — *observed* from answer timings
when there are any, the start-up measurement otherwise — and its link's round trip.
:class:`LayerCosts` gives, per layer, the FLOPs of one token through attention and through
the FFN (only the routed top-k experts count) and the bytes of each part, and what is not a
weight: the KV cache of each layer for the reserved context, a step's activations, the rows the
coordinator records per worker stage.

Memory. A worker's weights and KV cache fit in its allowance less one step's activations; a
stage worker keeps the KV cache of its own layers (:meth:`LayerCosts.stage_bytes`), a range
worker none. A GPU peer that announced its GPU memory (``join --gpu-memory``) holds them in GPU
buffers: they fit that less the activations too (:meth:`LayerCosts.worker_room`); priced
``on_cpu`` (the planner prices it both ways, :mod:`swarm.peer.coordinator.planning`) it holds
them in host memory and computes at its CPU's speed. The coordinator keeps the KV cache of the
layers whose attention it runs (every
layer without stages, its own stages' layers with them: a cache holds arrays only for the layers
that run), its activations and head logits, and under stages the rows it records per worker
stage (:meth:`LayerCosts.coordinator_reserve`). A placement fits when every peer's
planned bytes are within that; only such placements are chosen.

The estimate of one step of ``T`` tokens (``T = 1``: decode; the prompt length: prefill):

* compute: FLOPs / speed, per peer; the coordinator also runs the head (``head_flops``);
* a message costs ``rtt + MESSAGE_OVERHEAD_S + bytes / LINK_BYTES_PER_S`` (the overhead is
  the framing, thread hand-offs and scheduling measured on top of the raw round trip; the
  rate is what one aiortc data channel moves);
* ``ranges``: per layer, attention on the coordinator, then the slowest of the coordinator's
  FFN share and each worker's (its message + its share of the FFN FLOPs);
* ``stages``: the sum over stages of their layers' FLOPs / their speed, plus one message per
  stage held by a worker. For one sequence stages run one after the other, so the layers go to
  the fastest peers first, as many as each one's memory holds: every stage added costs a
  message, none saves compute.

Several sequences (:class:`GroupPricer`, :func:`serving_step_s`): the API runs at least one
batch scheduler per stage, each stepping its group of the sequences through every stage with no
drain, so the stage peers compute at once; a token of every sequence costs the longer of the
slowest group's pass and the busiest peer's work for every group.
A call costs its weights read once a kernel pass (``WEIGHT_BYTES_PER_S``; ``ROW_TILE`` rows a
pass on a CPU) plus FLOPs per row, so a step of many rows on one machine is cheaper per row,
groups pay that fixed part once each, and the groups are cut on the tile. Of a MoE
layer a call reads only the routed experts its rows chose (:func:`distinct_experts`), a share
that grows with the rows (64 experts, top 8: 8 for one row, 26.5 for 4, 42 for 8), so groups
re-read experts that one step would read once.
:func:`choose` given ``sequences`` > 1 prices the coordinator alone against its layers split
by speed over the holders, pipelined, and takes the stages when they serve ``REMOTE_MARGIN``
faster (``serving_tok_s`` of each, and a note).

:func:`choose` prices every candidate that fits in memory and picks the lowest decode time
(prefill time breaks ties). Its inputs and every estimate are returned as plain dicts for
``status --json``; ``docs/planner.md`` writes the model out with numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

MESSAGE_OVERHEAD_S = 0.0008  # a message's cost beyond the raw RTT (namespace LAN: 1.18 ms vs 0.42 ms)
LINK_BYTES_PER_S = 10 * 2**20  # one aiortc data channel, pure-Python SCTP (bench/link.py)
COORDINATOR_SHARE = 0.5  # the coordinator's speed counted for FFN ranges (it also runs attention)
PREFILL_TOKENS = 128  # prompt length the prefill estimate is given for
ROW_BYTES_PER_HIDDEN = 4  # float32 activations on the wire
# A placement that gives other peers work must beat the coordinator alone by this fraction of its
# decode estimate: what a shared machine adds beyond the observed waits (the other process's CPU,
# the coordinator's own speed measured while its event loop is busy) is not priced, and on a
# 2-core machine a 5 % predicted gain measured as a 20 % loss.
REMOTE_MARGIN = 0.15


@dataclass(frozen=True)
class PeerCost:
    """What the planner knows of one peer. ``memory_bytes``: budget for weights, bytes as it
    holds them; ``gflops``: compute speed (GFLOP/s, > 0); ``rtt_s``: round trip to the
    coordinator (seconds; 0 for the coordinator); ``observed``: ``gflops`` comes from answer
    timings rather than the start-up measurement; ``overhead_s``: what one request/answer to it
    costs beyond ``rtt_s`` and the rows' transfer (seconds): ``MESSAGE_OVERHEAD_S`` until its
    stage answers, which say how long the computing took, show it. ``gpu_memory``: what a GPU
    peer's GPU holds (bytes; None: none given), which its layers' weights and KV cache fit too
    (:meth:`LayerCosts.worker_room`). ``on_cpu``: such a peer priced the other way, as a CPU
    peer — its host allowance, ``gflops`` its CPU's speed —, for work past its GPU
    (:func:`swarm.peer.plan.gpu_holds`); it then takes no FFN ranges beside a stage
    (:func:`estimate_mix`), since the worker places each of the two on its own."""

    peer_id: str
    memory_bytes: int
    gflops: float
    rtt_s: float = 0.0
    observed: bool = False
    overhead_s: float = MESSAGE_OVERHEAD_S
    gpu_memory: int | None = None
    on_cpu: bool = False


@dataclass(frozen=True)
class LayerCosts:
    """Per layer ``i``: ``attn_flops[i]`` / ``ffn_flops[i]`` (FLOPs of one token: 2 per weight
    used), ``attn_bytes[i]`` / ``ffn_bytes[i]`` (bytes of the weights as stored). ``head_flops``:
    FLOPs of the head for one token; ``hidden_size``: H (a row on the wire is 4·H bytes).
    Not weights (bytes; empty or 0 when not counted): ``kv_bytes[i]`` the KV cache of layer ``i``
    for the reserved context, ``step_bytes`` a worker's activations of one step,
    ``coord_step_bytes`` the coordinator's, ``record_bytes`` the rows it records per worker stage
    (:func:`swarm.peer.plan.reserve_of`).
    Routed experts (empty or 0 for a dense layer): ``expert_bytes[i]`` the bytes of all of layer
    ``i``'s routed experts (a part of ``ffn_bytes[i]``), ``n_experts[i]`` how many it has and
    ``top_k[i]`` how many each row is routed to: a call reads only the experts its rows chose
    (:meth:`read_bytes`)."""

    attn_flops: tuple[float, ...]
    ffn_flops: tuple[float, ...]
    attn_bytes: tuple[int, ...]
    ffn_bytes: tuple[int, ...]
    head_flops: float
    hidden_size: int
    kv_bytes: tuple[int, ...] = ()
    step_bytes: int = 0
    coord_step_bytes: int = 0
    record_bytes: int = 0
    expert_bytes: tuple[int, ...] = ()
    n_experts: tuple[int, ...] = ()
    top_k: tuple[int, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.attn_flops)

    def layer_bytes(self, i: int) -> int:
        """Weight bytes of layer ``i`` (attention and FFN)."""
        return self.attn_bytes[i] + self.ffn_bytes[i]

    def read_bytes(self, i: int, rows: float) -> float:
        """Weight bytes a call of ``rows`` rows reads of layer ``i``: all of a dense layer; of a
        MoE layer what is not a routed expert once, and each routed expert's bytes times the
        experts its rows are expected to choose between them (:func:`distinct_experts`): one pass
        (:meth:`pass_bytes` with no tile)."""
        return self.pass_bytes(i, rows, None)

    def pass_bytes(self, i: int, rows: float, tile: int | None = None) -> float:
        """Weight bytes a call of ``rows`` rows reads of layer ``i`` when its kernels take ``tile``
        rows a pass, each pass reading (decoding) the weights it multiplies again (None: one pass
        whatever the rows, as on a GPU): a dense layer ``⌈rows / tile⌉`` times; of a MoE layer what is
        not a routed expert that many times, and each of the experts its rows are expected to
        choose between them (:func:`distinct_experts`) once per ``tile`` of the rows it is
        expected to get (``rows · top_k / distinct``)."""
        passes = (lambda r: 1 if tile is None else max(1, math.ceil(r / tile - 1e-9)))  # noqa: E731
        experts = self.expert_bytes[i] if self.expert_bytes else 0
        n = self.n_experts[i] if experts and self.n_experts else 0
        if not n:
            return float(self.layer_bytes(i)) * passes(rows)
        chosen = distinct_experts(n, self.top_k[i], rows)
        return ((self.layer_bytes(i) - experts) * passes(rows)
                + experts / n * chosen * passes(rows * min(self.top_k[i], n) / max(chosen, 1e-9)))

    def stage_bytes(self, i: int) -> int:
        """What a worker's stage holds for layer ``i``: its weights and its KV cache (bytes)."""
        return self.layer_bytes(i) + (self.kv_bytes[i] if self.kv_bytes else 0)

    def coordinator_reserve(self, worker_stages: int = 0, kv_layers: range | None = None) -> int:
        """What the coordinator keeps besides weights (bytes): the KV cache of ``kv_layers`` (the
        layers whose attention it runs; None: every layer, as without stages — a KV cache holds
        arrays only for the layers that run, :class:`swarm.compute.model.KVCache`), its
        activations, and the recorded rows of ``worker_stages`` stages held by workers."""
        kv = self.kv_bytes if kv_layers is None else [self.kv_bytes[i] for i in kv_layers] if self.kv_bytes else ()
        return sum(kv) + self.coord_step_bytes + worker_stages * self.record_bytes

    def worker_room(self, p: "PeerCost") -> int:
        """A worker's allowance less one step's activations (bytes, ≥ 0); on a GPU peer that
        announced its ``gpu_memory``, no more than that less the same activations: a GPU stage's
        weights and KV cache (:meth:`stage_bytes`), and a range's weights, live in GPU buffers —
        unless it is priced ``on_cpu`` (host memory, :func:`swarm.peer.plan.gpu_holds`)."""
        held = p.memory_bytes if p.gpu_memory is None or p.on_cpu else min(p.memory_bytes, p.gpu_memory)
        return max(held - self.step_bytes, 0)

    @classmethod
    def from_model(cls, model, context: int | None = None) -> "LayerCosts":
        """From a :class:`swarm.compute.model.Model`: sizes from the file's header (no weight is
        read); the KV cache for ``context`` tokens (default :func:`swarm.peer.memory.context_tokens`)."""
        from swarm.peer.plan import reserve_of
        from swarm.peer.weights.sizes import layer_nbytes

        c = model.config
        H = c.hidden_size
        attn_w = H * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * H
        moe_f = 3 * H * c.moe_intermediate_size * c.top_k + 3 * H * c.shared_expert_intermediate_size
        ffn_f = [2.0 * (moe_f if c.is_moe_layer(layer) else 3 * H * c.intermediate_size) for layer in range(c.n_layers)]
        attn_b, ffn_b = layer_nbytes(model)
        moe = [c.is_moe_layer(layer) for layer in range(c.n_layers)]
        r = reserve_of(c, context)
        return cls(tuple([2.0 * attn_w] * c.n_layers), tuple(ffn_f), attn_b, ffn_b,
                   2.0 * H * c.vocab_size, H, kv_bytes=r["kv_bytes"],
                   step_bytes=r["step_bytes"], coord_step_bytes=r["coordinator_step_bytes"], record_bytes=r["record_bytes"],
                   # layer_nbytes counts a MoE layer's FFN as its routed experts, all of them
                   expert_bytes=tuple(b if m else 0 for b, m in zip(ffn_b, moe, strict=True)),
                   n_experts=tuple(c.n_experts if m else 0 for m in moe), top_k=tuple(c.top_k if m else 0 for m in moe))


def distinct_experts(n_experts: int, top_k: int, rows: float) -> float:
    """Expected number of distinct experts, of ``n_experts``, that ``rows`` rows each routed to
    ``top_k`` of them choose between them: ``E · (1 - (1 - k/E)^rows)`` (an expert is missed by
    one row with probability 1 - k/E, by every row independently). Assumes uniform independent
    routing; real routers are skewed, so fewer distinct experts are read in practice and the
    bytes priced with this are an upper bound. ``rows`` may be fractional (a step's mean group)."""
    if n_experts <= 0 or rows <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - min(top_k, n_experts) / n_experts) ** rows)


@dataclass(frozen=True)
class Estimate:
    """One priced placement: ``decode_s`` (one token), ``prefill_s`` (``PREFILL_TOKENS``),
    ``fits`` (every peer within its memory), and what it places: ``stages`` (peer, first layer,
    stop layer) or ``shares`` (peer → fraction of every layer's FFN)."""

    layout: str
    decode_s: float
    prefill_s: float
    fits: bool
    stages: tuple[tuple[str, int, int], ...] = ()
    shares: tuple[tuple[str, float], ...] = ()
    note: str = ""
    serving_tok_s: float | None = None  # tokens per second with ``choose``'s sequences running (local, stages)


def _message_s(peer: PeerCost, rows: int, costs: LayerCosts) -> float:
    """One request and its answer of ``rows`` hidden rows each way."""
    return peer.rtt_s + peer.overhead_s + 2 * rows * costs.hidden_size * ROW_BYTES_PER_HIDDEN / LINK_BYTES_PER_S


def _gflops(p: PeerCost) -> float:
    return max(p.gflops, 1e-6) * 1e9


def estimate_local(costs: LayerCosts, coord: PeerCost) -> Estimate:
    total = sum(costs.attn_flops) + sum(costs.ffn_flops) + costs.head_flops
    need = sum(costs.layer_bytes(i) for i in range(costs.n_layers)) + costs.coordinator_reserve()
    step = lambda T: T * total / _gflops(coord)  # noqa: E731
    return Estimate("local", step(1), step(PREFILL_TOKENS), need <= coord.memory_bytes,
                    stages=((coord.peer_id, 0, costs.n_layers),))


def _water_fill(weights: dict[str, float], caps: dict[str, float]) -> dict[str, float]:
    """Fractions ∝ weights summing to 1, none above its cap (excess to the uncapped rest)."""
    share, free, left = {p: 0.0 for p in weights}, {p for p, w in weights.items() if w > 0}, 1.0
    while free and left > 1e-12:
        total = sum(weights[p] for p in free)
        over = {p for p in free if left * weights[p] / total > caps[p]}
        for p in over:
            share[p] += caps[p]
            left -= caps[p]
        if not over:
            for p in free:
                share[p] += left * weights[p] / total
            left = 0.0
        free -= over
    return share


def estimate_ranges(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost]) -> Estimate:
    """Every layer's FFN cut over the peers ∝ speed (the coordinator's at ``COORDINATOR_SHARE``),
    within each worker's memory; the coordinator keeps attention and what no worker holds."""
    ffn_total = sum(costs.ffn_bytes)
    weights = {coord.peer_id: _gflops(coord) * COORDINATOR_SHARE, **{w.peer_id: _gflops(w) for w in workers}}
    caps = {coord.peer_id: 1.0, **{w.peer_id: (costs.worker_room(w) / ffn_total if ffn_total else 0.0) for w in workers}}
    share = _water_fill(weights, caps)
    attn_bytes = sum(costs.attn_bytes)
    fits = attn_bytes + costs.coordinator_reserve() + share[coord.peer_id] * ffn_total <= coord.memory_bytes

    def step(T: int) -> float:
        t = T * costs.head_flops / _gflops(coord)
        for i in range(costs.n_layers):
            mine = T * (costs.attn_flops[i] + share[coord.peer_id] * costs.ffn_flops[i]) / _gflops(coord)
            theirs = [_message_s(w, T, costs) + T * share[w.peer_id] * costs.ffn_flops[i] / _gflops(w)
                      for w in workers if share[w.peer_id] > 0]
            t += max([mine, *[T * costs.attn_flops[i] / _gflops(coord) + x for x in theirs]])
        return t

    return Estimate("ranges", step(1), step(PREFILL_TOKENS), fits,
                    shares=tuple(share.items()))


def stage_layers(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost]) -> tuple[tuple[str, int, int], ...] | None:
    """Contiguous stages, fastest peers first, each given as many layers as its memory holds
    (``coord.memory_bytes``: what the coordinator's allowance leaves after embeddings and head,
    less :meth:`LayerCosts.coordinator_reserve`; a worker's: :meth:`LayerCosts.worker_room`, each
    layer with its KV cache, :meth:`LayerCosts.stage_bytes`). The coordinator's stage, if any,
    comes first; then the workers' in order of speed. None when the peers together cannot hold
    every layer."""
    order = sorted([coord, *workers], key=lambda p: (-p.gflops, p.peer_id != coord.peer_id, p.peer_id))
    count: dict[str, int] = {}
    at = 0
    reserve = costs.coordinator_reserve(len(workers), kv_layers=range(0))  # its layers' KV counts with them
    if coord.memory_bytes < reserve:
        return None  # the coordinator cannot hold its activations and recorded rows: no layer anywhere helps
    for p in order:
        mine = p.peer_id == coord.peer_id
        room, n = (p.memory_bytes - reserve if mine else costs.worker_room(p)), 0
        while at + n < costs.n_layers and costs.stage_bytes(at + n) <= room:
            room -= costs.stage_bytes(at + n)
            n += 1
        if n:
            count[p.peer_id] = n
            at += n
        if at == costs.n_layers:
            break
    if at < costs.n_layers:
        return None
    # Visiting order: the coordinator first (its layers follow the embeddings with no message).
    seq = sorted(count, key=lambda pid: (pid != coord.peer_id, order.index(next(p for p in order if p.peer_id == pid))))
    out, at = [], 0
    for pid in seq:
        out.append((pid, at, at + count[pid]))
        at += count[pid]
    return tuple(out)


def estimate_stages(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost],
                    stages: tuple[tuple[str, int, int], ...] | None = None) -> Estimate:
    """Whole layers per peer (``stages``, default :func:`stage_layers`)."""
    peers = {p.peer_id: p for p in (coord, *workers)}
    stages = stages if stages is not None else stage_layers(costs, coord, workers)
    if stages is None:
        need = sum(costs.stage_bytes(i) for i in range(costs.n_layers))
        room = (sum(costs.worker_room(w) for w in workers)
                + max(coord.memory_bytes - costs.coordinator_reserve(len(workers), kv_layers=range(0)), 0))
        return Estimate("stages", float("inf"), float("inf"), False,
                        note=f"the peers together hold too little: the layers with their KV cache need {need / 1e9:.2f} GB, "
                        f"the peers have {room / 1e9:.2f} GB for them ({max(need - room, 0) / 1e9:.2f} GB missing; "
                        "whole layers do not split, so a little more may be needed)")

    def step(T: int) -> float:
        t = T * costs.head_flops / _gflops(coord)
        for pid, lo, hi in stages:
            p = peers[pid]
            t += T * sum(costs.attn_flops[i] + costs.ffn_flops[i] for i in range(lo, hi)) / _gflops(p)
            if pid != coord.peer_id:
                t += _message_s(p, T, costs)
        return t

    fits = all(planned <= room for planned, room in stage_fit(costs, coord, workers, stages).values())
    return Estimate("stages", step(1), step(PREFILL_TOKENS), fits, stages=tuple(stages))


def stage_fit(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost],
              stages: Sequence[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """Per peer of ``stages``: (bytes it would hold, bytes it may hold). Each peer holds its
    layers' weights and KV cache (:meth:`LayerCosts.stage_bytes`); the coordinator also its
    activations and recorded rows (:meth:`LayerCosts.coordinator_reserve`), against its memory;
    a worker against :meth:`LayerCosts.worker_room`."""
    peers = {p.peer_id: p for p in (coord, *workers)}
    n_worker = len({pid for pid, _, _ in stages if pid != coord.peer_id})
    out: dict[str, tuple[int, int]] = {coord.peer_id: (costs.coordinator_reserve(n_worker, kv_layers=range(0)),
                                                        coord.memory_bytes)}
    for pid, lo, hi in stages:
        mine = pid == coord.peer_id
        held = sum(costs.stage_bytes(i) for i in range(lo, hi))
        before = out.get(pid, (0, 0))[0]
        room = peers[pid].memory_bytes if mine else costs.worker_room(peers[pid])
        out[pid] = (before + held, room)
    return out


def _worker_stages(costs: LayerCosts, workers: Sequence[PeerCost], lo: int) -> tuple[tuple[str, int, int], ...] | None:
    """Layers ``lo .. n-1`` as whole-layer stages of ``workers``, fastest first, each as many as
    its memory holds; None when they cannot hold them all."""
    out, at = [], lo
    for w in sorted(workers, key=lambda p: (-p.gflops, p.peer_id)):
        room, n = costs.worker_room(w), 0
        while at + n < costs.n_layers and costs.stage_bytes(at + n) <= room:
            room -= costs.stage_bytes(at + n)
            n += 1
        if n:
            out.append((w.peer_id, at, at + n))
            at += n
        if at == costs.n_layers:
            return tuple(out)
    return tuple(out) if at == costs.n_layers else None


def estimate_mix(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost]) -> Estimate:
    """The coordinator's stage ``0 .. k-1`` with its FFN cut into ranges over every peer (as
    ``ranges`` does, within what each has left), then whole-layer stages of the workers for the
    rest. Priced for every ``k`` that fits; the fastest is returned (``stages`` and ``shares``
    say what it places). Wins where a peer cannot hold its layers' FFN whole (big MoE layers)
    and round trips are dear: ``k`` round trips per token instead of one per layer."""
    best = Estimate("mix", float("inf"), float("inf"), False, note="no split of the layers fits")
    for k in range(1, costs.n_layers):
        tail = _worker_stages(costs, workers, k)
        if tail is None:
            continue
        held = {pid: sum(costs.stage_bytes(i) for i in range(lo, hi)) for pid, lo, hi in tail}
        ffn_k = sum(costs.ffn_bytes[:k])
        left_c = coord.memory_bytes - sum(costs.attn_bytes[:k]) - costs.coordinator_reserve(len(tail), kv_layers=range(k))
        if left_c < 0:
            continue  # the coordinator cannot hold attention for this many layers and its cache
        weights = {coord.peer_id: _gflops(coord) * COORDINATOR_SHARE, **{w.peer_id: _gflops(w) for w in workers}}
        caps = {coord.peer_id: left_c / ffn_k if ffn_k else 1.0,
                **{w.peer_id: max(costs.worker_room(w) - held.get(w.peer_id, 0), 0) / ffn_k
                   if ffn_k and not w.on_cpu else 0.0 for w in workers}}
        share = _water_fill(weights, caps)
        if sum(share.values()) < 1 - 1e-9:
            continue
        peers = {p.peer_id: p for p in (coord, *workers)}

        def step(T: int) -> float:
            t = T * costs.head_flops / _gflops(coord)
            for i in range(k):
                mine = T * (costs.attn_flops[i] + share[coord.peer_id] * costs.ffn_flops[i]) / _gflops(coord)
                theirs = [T * costs.attn_flops[i] / _gflops(coord) + _message_s(w, T, costs)
                          + T * share[w.peer_id] * costs.ffn_flops[i] / _gflops(w) for w in workers if share[w.peer_id] > 0]
                t += max([mine, *theirs])
            for pid, lo, hi in tail:
                t += T * sum(costs.attn_flops[i] + costs.ffn_flops[i] for i in range(lo, hi)) / _gflops(peers[pid])
                t += _message_s(peers[pid], T, costs)
            return t

        e = Estimate("mix", step(1), step(PREFILL_TOKENS), True, stages=((coord.peer_id, 0, k), *tail),
                     shares=tuple(share.items()))
        if (e.decode_s, e.prefill_s) < (best.decode_s, best.prefill_s):
            best = e
    return best


BUILDABLE = ("local", "ranges", "stages", "mix")  # the layouts a coordinator can set up


def choose(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost],
           layouts: Sequence[str] = BUILDABLE, range_only: Sequence[PeerCost] = (),
           sequences: int = 1) -> tuple[Estimate, list[Estimate]]:
    """Price the ``layouts`` asked for and return (the fastest that fits, all estimates).

    ``workers`` can run anything; ``range_only`` peers compute FFN ranges only (browser pages,
    peers without the model file), so they count in ``ranges`` alone. The coordinator alone
    (``local``, when it fits) is kept unless another placement's decode estimate is at least
    ``REMOTE_MARGIN`` lower. Falls back to ``ranges`` (the coordinator streams what nobody
    holds) when none fits.

    ``sequences`` > 1 (several users served): the coordinator alone, when chosen, is also priced
    against its stages split over every holder by speed, pipelined (:func:`serving_step_s`):
    the stages are chosen when a step of that many sequences takes ``REMOTE_MARGIN`` less time
    than alone, with a note saying so (throughput, not one user's latency). With one sequence
    nothing changes.
    """
    makers = {"local": lambda: estimate_local(costs, coord),
              "ranges": lambda: estimate_ranges(costs, coord, [*workers, *range_only]),
              "stages": lambda: estimate_stages(costs, coord, workers),
              "mix": lambda: estimate_mix(costs, coord, workers)}
    unknown = set(layouts) - set(makers)
    if unknown:
        raise ValueError(f"unknown layouts {sorted(unknown)}; choose from {sorted(makers)}")
    estimates = [makers[name]() for name in layouts]
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return next((e for e in estimates if e.layout == "ranges"), estimates[0]), estimates
    best = min(fitting, key=lambda e: (e.decode_s, e.prefill_s))
    alone = next((e for e in fitting if e.layout == "local"), None)
    if alone is not None and best.decode_s > (1 - REMOTE_MARGIN) * alone.decode_s:
        best = alone
    if sequences > 1 and best is alone and alone is not None and workers and "stages" in layouts:
        best, estimates = _choose_for_throughput(costs, coord, workers, alone, estimates, sequences)
    return best, estimates


def _choose_for_throughput(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost], alone: Estimate,
                           estimates: list[Estimate], sequences: int) -> tuple[Estimate, list[Estimate]]:
    """The coordinator alone against its layers split over it and ``workers`` by speed,
    pipelined, with ``sequences`` running; the stages when they serve ``REMOTE_MARGIN`` faster."""
    layout = throughput_split(costs, coord, workers)
    local_s = serving_step_s(costs, coord, workers, alone.stages, sequences)
    alone = replace(alone, serving_tok_s=sequences / local_s)
    estimates = [alone if e.layout == "local" else e for e in estimates]
    if len(layout) < 2:
        return alone, estimates
    staged = estimate_stages(costs, coord, workers, layout)
    pricer = GroupPricer(costs, coord, workers, layout)
    sizes = pricer.best_groups(sequences)
    staged_s = pricer.round_s(sizes)
    staged = replace(staged, serving_tok_s=sequences / staged_s)
    if not staged.fits or staged_s > (1 - REMOTE_MARGIN) * local_s:
        return alone, [*estimates, staged]
    why = (f"{sequences} sequences pipelined over {len(layout)} stages (groups of {' + '.join(map(str, sizes))}): "
           f"{staged.serving_tok_s:.1f} tok/s against "
           f"{alone.serving_tok_s:.1f} on the coordinator alone (one sequence: {1 / staged.decode_s:.1f} against "
           f"{1 / alone.decode_s:.1f})")
    staged = replace(staged, note=why)
    return staged, [*estimates, staged]


def throughput_split(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost]) -> tuple[tuple[str, int, int], ...]:
    """The layers cut over the coordinator and ``workers`` (in that order) so that every peer is
    busy as long per token when the stages are pipelined: each peer's share of all the FLOPs ∝
    its speed, the head's counted in the coordinator's (it runs the head for every row), so the
    coordinator takes that many fewer layers — at least one. ``(peer, start, stop)`` per stage.
    (SmolLM2-135M: the head is a fifth of a token's FLOPs; 15/15 layers leave the coordinator
    the bottleneck, 11/19 balance two equal peers.)"""
    from swarm.peer.plan import split_layers

    speeds = [_gflops(p) for p in (coord, *workers)]
    layer_flops = sum(costs.attn_flops) + sum(costs.ffn_flops)
    shares = [(layer_flops + costs.head_flops) * v / sum(speeds) for v in speeds]  # FLOPs per token each
    shares[0] = max(shares[0] - costs.head_flops, 0.5 * layer_flops / costs.n_layers)  # its layers: ≥ one
    split = split_layers(costs.n_layers, [coord.peer_id, *(w.peer_id for w in workers)], shares)
    return tuple((st.peer, st.start, st.stop) for st in split)


def report(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost], best: Estimate,
           estimates: Sequence[Estimate]) -> dict:
    """The cost model's inputs and outputs as JSON-ready data (``status --json``'s ``cost``)."""
    return {
        "constants": {"message_overhead_s": MESSAGE_OVERHEAD_S, "link_bytes_per_s": LINK_BYTES_PER_S,
                      "coordinator_share": COORDINATOR_SHARE, "prefill_tokens": PREFILL_TOKENS},
        "model": {"layers": costs.n_layers, "flops_per_token": sum(costs.attn_flops) + sum(costs.ffn_flops)
                  + costs.head_flops, "weight_bytes": sum(costs.attn_bytes) + sum(costs.ffn_bytes)},
        "peers": [asdict(p) for p in (coord, *workers)],
        # a placement that cannot be built (no split fits) has no time: null, not Infinity (not JSON)
        "estimates": [{**asdict(e), **{k: None for k in ("decode_s", "prefill_s") if not math.isfinite(getattr(e, k))}}
                      for e in estimates],
        "choice": best.layout,
    }


def observed_gflops(flops_per_row: float, s_per_row: float | None) -> float | None:
    """GFLOP/s from an answer timing (seconds per row, the link's round trip already taken
    off), or None before any answer."""
    if not s_per_row or s_per_row <= 0 or flops_per_row <= 0:
        return None
    return flops_per_row / s_per_row / 1e9


PIPELINE_GROUPS_PER_STAGE = 1  # groups per stage a step of many sequences splits into (one in flight at each)


def pipeline_groups(n_sequences: int, n_stages: int, schedulers: int = 1) -> int:
    """How many groups a step of ``n_sequences`` is cut into over ``n_stages`` stages, pipelined
    (:mod:`swarm.peer.coordinator.stages`): 1 (none) for one sequence or one stage; otherwise
    ``PIPELINE_GROUPS_PER_STAGE`` per stage, at most one per sequence. A step of G groups over S
    stages takes G + S - 1 group-stage times: more groups fill the pipeline better (G of every
    G + S - 1 stage slots busy), but each costs every stage a message and its fixed per-call
    time (on a CPU a group of 2 decode rows costs far more than a quarter of 8:
    bench/results/pipeline.md measured 4 and 8 groups of 8 streams slower than 2).

    ``schedulers`` batch schedulers stepping through the stages at once (the API's pool) each
    keep a step in flight already: a step is cut only into the groups they leave the stages
    short of, none once there are as many schedulers as stages."""
    if n_sequences < 2 or n_stages < 2 or schedulers >= n_stages:
        return 1
    return min(n_sequences, PIPELINE_GROUPS_PER_STAGE * -(-n_stages // max(1, schedulers)))


# a CPU reads a layer's weights once per pass of its kernels (SmolLM2 on this project's 2-core
# bench machine: one decode row 6 ms, eight 22 ms — bench/results/pipeline.md); of a MoE layer, the
# experts its rows chose (LayerCosts.read_bytes)
WEIGHT_BYTES_PER_S = 20e9
# Rows a CPU peer's kernels take a pass (swarm.compute.qkernels: its tiles' largest count of
# activation rows): a call of r rows decodes its weights ⌈r / 4⌉ times, so on 8 cores of a Xeon
# a dense 4B Q4_K_M step of 5 rows took 134 ms against 76.5 for 4 and 166 for 8
# (bench/results/pipeline.md, "What a step of r rows costs on one peer"). Q2_K, Q3_K and IQ4_NL
# take 4 rows a pass too (swarm.compute.lowbit's decode tile, to 16-32 rows, 4 in its scalar
# form); the other IQ types decode a step's rows once and take float32 tiles over them, so for
# those this over-prices the passes.
ROW_TILE = 4


def _row_tile(peer: PeerCost) -> int | None:
    """Rows ``peer``'s kernels take a pass: ``ROW_TILE`` on a CPU, None (one pass) on a GPU."""
    return ROW_TILE if peer.gpu_memory is None or peer.on_cpu else None


def _stage_call_s(costs: LayerCosts, peer: PeerCost, lo: int, hi: int, rows: int, remote: bool) -> float:
    """One call of layers ``lo .. hi-1`` on ``peer`` for ``rows`` rows (seconds): its weights
    read once a pass of its kernels — of a MoE layer only the experts its rows choose
    (:meth:`LayerCosts.pass_bytes`) —, its FLOPs per row, and a message when it is not the
    coordinator's."""
    tile = _row_tile(peer)
    t = sum(costs.pass_bytes(i, rows, tile) for i in range(lo, hi)) / WEIGHT_BYTES_PER_S
    t += rows * sum(costs.attn_flops[i] + costs.ffn_flops[i] for i in range(lo, hi)) / _gflops(peer)
    return t + (_message_s(peer, max(1, rows), costs) if remote else 0.0)


def balanced_groups(sequences: int, groups: int) -> list[int]:
    """``sequences`` cut into ``groups`` groups of as equal sizes as can be (the larger first)."""
    g = max(1, min(sequences, groups))
    return [sequences // g + (i < sequences % g) for i in range(g)]


def tiled_groups(sequences: int, groups: int, tile: int = ROW_TILE) -> list[int]:
    """``sequences`` cut into up to ``groups`` groups of whole tiles of ``tile`` rows (fewer when
    there are fewer tiles), the tiles as evenly as can be (the larger groups first) and the rows a
    last tile lacks taken from the last group: ``⌈sequences / tile⌉`` kernel passes in all, the
    fewest any cut takes (50 sequences in 3 groups: 20 + 16 + 14; evenly, 17 + 17 + 16 would
    take 14 passes, not 13). [] for none."""
    if sequences < 1:
        return []
    tiles = math.ceil(sequences / tile)
    sizes = [tile * t for t in balanced_groups(tiles, groups)]
    sizes[-1] -= tile * tiles - sequences
    return sizes


class GroupPricer:
    """The time a round of groups takes through ``stages`` (:meth:`round_s`), each stage call's
    price computed once per row count (the API's pool asks at every new sequence)."""

    def __init__(self, costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost],
                 stages: Sequence[tuple[str, int, int]]) -> None:
        self.costs, self.coord, self.stages = costs, coord, tuple(stages)
        self._peers = {p.peer_id: p for p in (coord, *workers)}
        self._calls: dict[int, list[float]] = {}
        self._best: dict[int, list[int]] = {}

    def calls(self, rows: int) -> list[float]:
        """Each stage's call of ``rows`` rows (seconds, :func:`_stage_call_s`), in stage order."""
        if rows not in self._calls:
            self._calls[rows] = [_stage_call_s(self.costs, self._peers[pid], lo, hi, rows, pid != self.coord.peer_id)
                                 for pid, lo, hi in self.stages]
        return self._calls[rows]

    def round_s(self, sizes: Sequence[int]) -> float:
        """Seconds for groups of ``sizes`` sequences (one batch scheduler each, as the API's pool
        keeps them) to decode a token each, pipelined with no drain between steps (docs/serving.md,
        "Stage layout"): the longer of the slowest group's own pass — every stage's call of its
        rows, then the head for them on the coordinator — and the busiest peer's work for every
        group: its calls (the coordinator's with the heads). A call costs its weights read once a
        kernel pass (``ROW_TILE`` rows a pass on a CPU) plus its FLOPs per row, so a group is
        cheapest per row at a multiple of the tile, and each group costs every stage one more call
        and message. Empty groups are left out; 0.0 for none."""
        busy: dict[str, float] = {self.coord.peer_id: 0.0}
        slowest = 0.0
        for rows in (r for r in sizes if r > 0):
            calls = self.calls(rows)
            head = rows * self.costs.head_flops / _gflops(self.coord)
            slowest = max(slowest, sum(calls) + head)
            busy[self.coord.peer_id] += head
            for (pid, _, _), call in zip(self.stages, calls):
                busy[pid] = busy.get(pid, 0.0) + call
        return max(slowest, max(busy.values()))

    def best_groups(self, sequences: int) -> list[int]:
        """The sizes of the groups ``sequences`` running sequences are best served in (largest
        first): at least one per stage (every stage busy), cut evenly or in whole tiles of
        ``ROW_TILE`` rows (:func:`tiled_groups`: on CPUs a group past a multiple of the tile costs
        every stage a kernel pass more), the count and cut whose round prices lowest, the fewest
        groups and then the even cut on a tie: 16 sequences over three CPU stages go as four
        groups of 4, not 6 + 5 + 5 (six passes a stage) nor 8 + 4 + 4 (the group of 8 goes round
        slowest). More groups than ``⌈sequences / ROW_TILE⌉`` add passes and messages without
        saving one, so none are tried."""
        if sequences < 1:
            return []
        if sequences not in self._best:
            lo = min(sequences, len(self.stages))
            hi = max(lo, math.ceil(sequences / ROW_TILE))
            cuts = [(g, even, balanced_groups(sequences, g) if even else tiled_groups(sequences, g))
                    for g in range(lo, hi + 1) for even in (True, False)]
            cuts = [c for c in cuts if len(c[2]) >= lo]  # every stage busy: never fewer groups than stages
            # to the µs: cuts the same but for the order of their sums tie
            _, _, best = min(cuts, key=lambda c: (round(self.round_s(c[2]) * 1e6), c[0], not c[1]))
            self._best[sequences] = sorted(best, reverse=True)
        return list(self._best[sequences])

    def row_tile(self) -> int | None:
        """``ROW_TILE`` when a tile's worth of sequences more than the stages hold at a tile each
        is best served as one more group rather than spread over one group per stage (12
        sequences over two stages as 4 + 4 + 4, not 6 + 6: a group past a tile costs every stage
        another pass — dense models on CPUs), else None (a MoE whose smaller groups read more
        experts a row keeps one group per stage). What the API's pool fills its schedulers by
        (:meth:`swarm.compute.serving.SchedulerPool.set_width`)."""
        s = len(self.stages)
        if s < 2:
            return None
        return ROW_TILE if len(self.best_groups((s + 1) * ROW_TILE)) > s else None


def serving_step_s(costs: LayerCosts, coord: PeerCost, workers: Sequence[PeerCost],
                   stages: Sequence[tuple[str, int, int]], sequences: int, groups: int | None = None) -> float:
    """Seconds for every one of ``sequences`` running sequences to decode a token through
    ``stages`` (the coordinator alone: one stage of every layer), as the API serves them: in
    :meth:`GroupPricer.best_groups`'s cut, or in ``groups`` batch schedulers with their sequences
    cut as evenly as can be (:meth:`GroupPricer.round_s`)."""
    pricer = GroupPricer(costs, coord, workers, stages)
    sizes = pricer.best_groups(sequences) if groups is None else balanced_groups(sequences, groups)
    return pricer.round_s(sizes)
