"""A plan: which peer computes which experts and dense columns of each layer, as spans that tile
every layer in the plan's peer order; its wire form and the check of one received. Pure.
:func:`swarm.peer.coordinator.planner.build_plan` makes plans; both roles read them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import RemoteProtocolError
from swarm.peer.net.messages import Assignment, PlanMessage
from swarm.peer.plan.shape import ModelShape


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
    # Bytes of the coordinator's spans beyond its budget, read from its mapped file when used
    # (the swarm holds too little); not sent to workers.
    streamed_bytes: int = field(default=0, compare=False)

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

    def bytes_of(self, peer: str, shape: ModelShape, kind: str = "python") -> int:
        """Weight bytes ``peer`` (a peer of ``kind``) must hold for its spans."""
        n_exp = sum(len(s) for spans in self.experts.values() for s in spans if s.peer == peer)
        n_col = sum(len(s) for spans in self.dense.values() for s in spans if s.peer == peer)
        e, c = shape.unit_bytes(kind)
        return n_exp * e + n_col * c

    # ------------------------------------------------------------------ wire form
    def to_dict(self) -> dict:
        """JSON-ready form, for the PlanMessage's metadata."""
        enc = lambda m: {str(l): [[s.peer, s.start, s.stop] for s in spans] for l, spans in m.items()}  # noqa: E731
        return {"version": self.version, "term": self.term, "coordinator": self.coordinator,
                "peers": list(self.peers), "experts": enc(self.experts), "dense": enc(self.dense)}

    @classmethod
    def from_dict(cls, d: Any, shape: ModelShape) -> "Plan":
        """Parse and check a plan received from the network (``d``: decoded JSON, untrusted) against
        the model's shape.

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


    def to_message(self) -> PlanMessage:
        """The :class:`swarm.peer.net.messages.PlanMessage` that announces this plan to the workers."""
        out = [Assignment(layer, s.peer, tuple(range(s.start, s.stop)), ())
               for layer, spans in sorted(self.experts.items()) for s in spans]
        out += [Assignment(layer, s.peer, (), ((s.start, s.stop),))
                for layer, spans in sorted(self.dense.items()) for s in spans]
        return PlanMessage(self.term, self.version, tuple(out))

    @classmethod
    def from_message(cls, msg: PlanMessage, coordinator: str, shape: ModelShape) -> "Plan":
        """Rebuild a plan from the PlanMessage ``coordinator`` sent; checked like :meth:`from_dict`."""
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

