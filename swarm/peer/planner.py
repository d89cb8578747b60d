"""Placement: which peer computes which experts and dense columns of which layer. Pure.

Theory of operation
-------------------
The coordinator turns what the peers said in their hellos (memory budget for
weights, measured FFN throughput, round trip) into a :class:`Plan`:

* every MoE layer's routed experts ``0..E-1`` are cut into contiguous
  :class:`Span` s, one per peer that gets any, in the plan's peer order;
* every dense MLP's intermediate dimension ``0..F-1`` is cut the same way, so
  the partial outputs of the spans sum to the full MLP (the coordinator adds
  them in span order);
* shared experts (Qwen2-MoE) are not in the plan: they stay with the
  coordinator, which holds the whole model.

Shares are proportional to capacity — the measured throughput, with the
coordinator's counted at ``coordinator_share`` of its own because it also runs
attention, routing and sampling. A worker never gets more weight bytes than its
budget: its capped share goes back to the others (water-filling), and what no
worker can hold stays with the coordinator. The round trip sets each request's
deadline rather than the shares: on a LAN it is far below a layer's compute,
and a heartbeat RTT measured while a peer was still loading its model is
inflated for a while. Only a peer whose round trip exceeds ``MAX_RTT_S`` —
a link that would stall every layer — gets nothing.

A plan carries the election term and a version that grows with each rebuild;
the coordinator rebuilds it when membership changes and switches to the new one
between decode steps only, never inside one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.errors import RemoteProtocolError

MAX_RTT_S = 5.0  # a link this slow to answer would stall every layer (seconds)
COORDINATOR_SHARE = 0.5  # the coordinator also runs attention/routing/sampling


@dataclass(frozen=True)
class PeerCapacity:
    """What a peer offers, from its hello.

    ``memory_bytes``: budget for weight slices (bytes, ≥ 0). ``ffn_speed``: measured
    FFN throughput in any unit shared by all peers (e.g. GFLOP/s; > 0 to get work).
    ``rtt_s``: measured round trip to the coordinator (seconds).
    """

    peer_id: str
    memory_bytes: int
    ffn_speed: float
    rtt_s: float = 0.0


@dataclass(frozen=True)
class ModelShape:
    """The sizes the planner needs, from the model config and the weight dtype.

    ``moe_layers``: layer indices with routed experts; ``dense_layers``: layer
    indices with a dense MLP of width ``intermediate_size``. ``bytes_per_weight``:
    the in-memory size of one weight (4.0 for float32).
    """

    hidden_size: int
    n_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    bytes_per_weight: float = 4.0

    @classmethod
    def from_config(cls, cfg, bytes_per_weight: float = 4.0) -> "ModelShape":
        """From a :class:`swarm.compute.config.ModelConfig`."""
        moe = tuple(cfg.moe_layers) if cfg.n_experts else ()
        dense = tuple(i for i in range(cfg.n_layers) if i not in moe) if cfg.intermediate_size else ()
        return cls(cfg.hidden_size, cfg.n_experts, cfg.moe_intermediate_size, cfg.intermediate_size,
                   moe, dense, bytes_per_weight)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert: gate [F, H], up [F, H], down [H, F]."""
        return math.ceil(3 * self.hidden_size * self.moe_intermediate_size * self.bytes_per_weight)

    @property
    def column_bytes(self) -> int:
        """Bytes of one dense intermediate column: a gate row, an up row, a down column."""
        return math.ceil(3 * self.hidden_size * self.bytes_per_weight)


@dataclass(frozen=True)
class Span:
    """``peer`` computes units ``start..stop-1`` (experts, or intermediate columns) of one layer."""

    peer: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    """A versioned placement. ``experts[layer]`` and ``dense[layer]`` are spans in peer order
    that tile ``0..E-1`` (resp. ``0..F-1``) without gaps or overlaps.
    """

    version: int
    term: int
    coordinator: str
    peers: tuple[str, ...]  # coordinator first, then workers by peer id: the span order
    experts: Mapping[int, tuple[Span, ...]] = field(default_factory=dict)
    dense: Mapping[int, tuple[Span, ...]] = field(default_factory=dict)

    def workers(self) -> tuple[str, ...]:
        """Peers other than the coordinator that hold at least one span."""
        used = {s.peer for spans in (*self.experts.values(), *self.dense.values()) for s in spans}
        return tuple(p for p in self.peers if p != self.coordinator and p in used)

    def expert_span(self, layer: int, peer: str) -> Span | None:
        return next((s for s in self.experts.get(layer, ()) if s.peer == peer), None)

    def dense_span(self, layer: int, peer: str) -> Span | None:
        return next((s for s in self.dense.get(layer, ()) if s.peer == peer), None)

    def expert_owner(self, layer: int, expert: int) -> str:
        """The peer that computes ``expert`` of ``layer``; the coordinator when unplanned."""
        for s in self.experts.get(layer, ()):
            if s.start <= expert < s.stop:
                return s.peer
        return self.coordinator

    def dense_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Dense layer → its (lo, hi) ranges in span order: the plan :class:`LocalFFN` takes."""
        return {layer: [(s.start, s.stop) for s in spans] for layer, spans in self.dense.items()}

    def bytes_of(self, peer: str, shape: ModelShape) -> int:
        """Weight bytes ``peer`` must hold for its spans."""
        n_exp = sum(len(s) for spans in self.experts.values() for s in spans if s.peer == peer)
        n_col = sum(len(s) for spans in self.dense.values() for s in spans if s.peer == peer)
        return n_exp * shape.expert_bytes + n_col * shape.column_bytes

    # ------------------------------------------------------------------ wire form
    def to_dict(self) -> dict:
        """JSON-ready form, for the Plan message's metadata."""
        enc = lambda m: {str(l): [[s.peer, s.start, s.stop] for s in spans] for l, spans in m.items()}  # noqa: E731
        return {"version": self.version, "term": self.term, "coordinator": self.coordinator,
                "peers": list(self.peers), "experts": enc(self.experts), "dense": enc(self.dense)}

    @classmethod
    def from_dict(cls, d: object, shape: ModelShape) -> "Plan":
        """Parse and check a plan received from the network against the model's shape.

        Raises RemoteProtocolError naming the field when a type is wrong, a layer
        is not of that kind in the model, or the spans do not tile the layer.
        """
        try:
            version, term, coord = int(d["version"]), int(d["term"]), str(d["coordinator"])
            peers = tuple(str(p) for p in d["peers"])
            experts = {int(l): tuple(Span(str(p), int(a), int(b)) for p, a, b in spans)
                       for l, spans in d["experts"].items()}
            dense = {int(l): tuple(Span(str(p), int(a), int(b)) for p, a, b in spans)
                     for l, spans in d["dense"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RemoteProtocolError(f"malformed plan: {exc!r}") from None
        plan = cls(version, term, coord, peers, experts, dense)
        check_plan(plan, shape)
        return plan


    def to_message(self):
        """The :class:`swarm.peer.messages.Plan` that announces this plan to the workers."""
        from swarm.peer.messages import Assignment, Plan as PlanMessage

        out = [Assignment(layer, s.peer, tuple(range(s.start, s.stop)), ())
               for layer, spans in sorted(self.experts.items()) for s in spans]
        out += [Assignment(layer, s.peer, (), ((s.start, s.stop),))
                for layer, spans in sorted(self.dense.items()) for s in spans]
        return PlanMessage(self.term, self.version, tuple(out))

    @classmethod
    def from_message(cls, msg, coordinator: str, shape: ModelShape) -> "Plan":
        """Rebuild a plan from the Plan message ``coordinator`` sent; checked like :meth:`from_dict`."""
        experts: dict[int, list[Span]] = {}
        dense: dict[int, list[Span]] = {}
        for a in msg.assignments:
            ids = list(a.experts)
            if ids and (a.dense or ids != list(range(ids[0], ids[0] + len(ids)))):
                raise RemoteProtocolError(f"plan v{msg.version}: layer {a.layer} experts of {a.peer} "
                                          "are not one contiguous range")
            if ids:
                experts.setdefault(a.layer, []).append(Span(a.peer, ids[0], ids[-1] + 1))
            for lo, hi in a.dense:
                dense.setdefault(a.layer, []).append(Span(a.peer, lo, hi))
        others = sorted({s.peer for t in (experts, dense) for spans in t.values() for s in spans} - {coordinator})
        order = lambda t: {l: tuple(sorted(v, key=lambda s: s.start)) for l, v in t.items()}  # noqa: E731
        plan = cls(msg.version, msg.term, coordinator, (coordinator, *others), order(experts), order(dense))
        check_plan(plan, shape)
        return plan


def check_plan(plan: Plan, shape: ModelShape) -> None:
    """Raise RemoteProtocolError unless every span list tiles its layer in peer order."""
    if plan.version < 0 or plan.term < 0 or plan.coordinator not in plan.peers:
        raise RemoteProtocolError(f"plan v{plan.version}: bad version/term or coordinator not a peer")
    for kind, table, layers, width in (("experts", plan.experts, shape.moe_layers, shape.n_experts),
                                       ("dense", plan.dense, shape.dense_layers, shape.intermediate_size)):
        for layer, spans in table.items():
            if layer not in layers:
                raise RemoteProtocolError(f"plan v{plan.version}: layer {layer} has no {kind} in this model")
            at, order = 0, [plan.peers.index(s.peer) if s.peer in plan.peers else -1 for s in spans]
            for s in spans:
                if s.start != at or s.stop <= s.start or s.peer not in plan.peers:
                    raise RemoteProtocolError(f"plan v{plan.version}: {kind} spans of layer {layer} do not tile")
                at = s.stop
            if at != width or order != sorted(set(order)):
                raise RemoteProtocolError(f"plan v{plan.version}: {kind} spans of layer {layer} do not tile "
                                          f"0..{width} in peer order")


def _shares(weights: dict[str, float], caps: dict[str, float]) -> dict[str, float]:
    """Water-filling: fractions ∝ weights, none above its cap, excess to the uncapped rest."""
    share = {p: 0.0 for p in weights}
    free = {p for p, w in weights.items() if w > 0}
    left = 1.0
    while free and left > 1e-12:
        total = sum(weights[p] for p in free)
        over = {p for p in free if left * weights[p] / total > caps[p]}
        if not over:
            for p in free:
                share[p] += left * weights[p] / total
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
) -> Plan:
    """Place experts and dense columns over the coordinator and ``workers``.

    Returns a plan whose spans tile every MoE and dense layer; no worker's
    ``plan.bytes_of(peer, shape)`` exceeds its ``memory_bytes``. The coordinator
    holds the whole model, so it has no budget and takes whatever is left.
    """
    workers = sorted((w for w in workers if w.peer_id != coordinator.peer_id), key=lambda w: w.peer_id)
    peers = (coordinator.peer_id, *(w.peer_id for w in workers))
    total_bytes = (len(shape.moe_layers) * shape.n_experts * shape.expert_bytes
                   + len(shape.dense_layers) * shape.intermediate_size * shape.column_bytes)
    weights = {coordinator.peer_id: max(coordinator.ffn_speed, 1e-9) * coordinator_share}
    caps = {coordinator.peer_id: math.inf}
    for w in workers:
        usable = w.ffn_speed > 0 and w.rtt_s <= MAX_RTT_S and w.memory_bytes > 0
        weights[w.peer_id] = w.ffn_speed if usable else 0.0
        caps[w.peer_id] = w.memory_bytes / total_bytes if total_bytes else 0.0
    share = _shares(weights, caps)

    def spans_for(width: int, unit_bytes: int, layers: Sequence[int], used: dict[str, int]) -> dict:
        table = {}
        for layer in layers:
            counts = _cut(width, peers, share, layer)
            # Rounding may push a worker past its budget: hand those units to the coordinator.
            for i, p in enumerate(peers[1:], start=1):
                room = (next(w for w in workers if w.peer_id == p).memory_bytes - used[p]) // unit_bytes
                if counts[i] > room:
                    counts[0] += counts[i] - max(room, 0)
                    counts[i] = max(room, 0)
                used[p] += counts[i] * unit_bytes
            spans, at = [], 0
            for p, c in zip(peers, counts):
                if c:
                    spans.append(Span(p, at, at + c))
                    at += c
            table[layer] = tuple(spans)
        return table

    used = {p: 0 for p in peers}
    experts = spans_for(shape.n_experts, shape.expert_bytes, shape.moe_layers, used) if shape.n_experts else {}
    dense = spans_for(shape.intermediate_size, shape.column_bytes, shape.dense_layers, used) if shape.intermediate_size else {}
    plan = Plan(version, term, coordinator.peer_id, peers, experts, dense)
    check_plan(plan, shape)
    return plan
