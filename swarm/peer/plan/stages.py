"""Layer stages: a peer runs a contiguous range of whole layers (attention with its KV cache and
the layers' FFN), so a token crosses the LAN once per stage. The layout both roles share: the
coordinator's side in :mod:`swarm.peer.coordinator.stages`, the worker's in
:mod:`swarm.peer.worker.stages`. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.errors import LocalProtocolError, RemoteProtocolError
from swarm.peer.net.messages import StageAssignment, StagePlan
from swarm.peer.plan.plan import Plan, Span
from swarm.peer.plan.shape import ModelShape

# A short step (a decode token): at most this many rows. A worker may run it on the event loop that
# received it; the coordinator measures a message's cost beyond the round trip on such steps.
INLINE_ROWS = 8


@dataclass(frozen=True)
class Stage(Span):
    """``peer`` runs layers ``start .. stop-1`` (a span whose units are layers)."""


@dataclass(frozen=True)
class StageLayout:
    """Stages of plan ``version`` in ``term``, in the order the hidden state visits them,
    tiling ``0 .. n_layers-1``; ``coordinator`` runs its stages itself."""

    term: int
    version: int
    coordinator: str
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        at = 0
        for s in self.stages:
            if s.start != at or s.stop <= s.start:
                raise LocalProtocolError(f"stage layout v{self.version}: {s} does not follow layer {at}")
            at = s.stop

    @property
    def n_layers(self) -> int:
        return self.stages[-1].stop if self.stages else 0

    def workers(self) -> tuple[str, ...]:
        """Peers other than the coordinator that run a stage, in visiting order."""
        return tuple(dict.fromkeys(s.peer for s in self.stages if s.peer != self.coordinator))

    def holds(self, peer: str, start: int, stop: int) -> bool:
        return Stage(peer, start, stop) in self.stages

    def to_message(self) -> StagePlan:
        return StagePlan(self.term, self.version, tuple(StageAssignment(s.peer, s.start, s.stop) for s in self.stages))

    @classmethod
    def from_message(cls, msg: StagePlan, coordinator: str, n_layers: int) -> "StageLayout":
        """The layout ``coordinator`` announced; RemoteProtocolError unless it tiles ``0:n_layers``."""
        stages = tuple(Stage(a.peer, a.layer_start, a.layer_stop) for a in msg.stages)
        if not stages or stages[-1].stop != n_layers:
            raise RemoteProtocolError(f"stage plan v{msg.version} covers layers 0:{stages[-1].stop if stages else 0}, "
                                      f"not the model's 0:{n_layers}")
        return cls(msg.term, msg.version, coordinator, stages)


def plan_workers(plan: Plan, layout: StageLayout | None) -> tuple[str, ...]:
    """The workers of ``plan`` and its stage ``layout`` (None: ranges alone): the peers other than
    the coordinator that hold a span (:meth:`Plan.workers`, in span order), then those that run a
    stage and hold none (:meth:`StageLayout.workers`, in visiting order). Under stages the
    per-layer plan holds the coordinator alone, so its workers are the layout's."""
    return tuple(dict.fromkeys((*plan.workers(), *(layout.workers() if layout is not None else ()))))


def held_bytes(plan: Plan, layout: StageLayout | None, peer: str, shape: ModelShape, kind: str = "python") -> int:
    """FFN weight bytes ``peer`` holds under ``plan`` and its stage ``layout`` (None: ranges alone):
    its spans of the layers no other peer's stage runs, and the whole FFN of each layer its
    stages run. The per-layer plan gives the coordinator every layer a worker's stage runs,
    which it reads from its model file only after that stage fails: not held."""
    owner = {i: s.peer for s in (layout.stages if layout is not None else ()) for i in range(s.start, s.stop)}
    e, c = shape.unit_bytes(kind)
    total = 0
    for table, unit in ((plan.experts, e), (plan.dense, c)):
        for layer, spans in table.items():
            run_by = owner.get(layer, plan.coordinator)
            if run_by == plan.coordinator:
                total += sum(len(s) for s in spans if s.peer == peer) * unit
            elif run_by == peer:
                total += sum(len(s) for s in spans) * unit
    return total


def split_layers(n_layers: int, peers: Sequence[str], weights: Sequence[float]) -> tuple[Stage, ...]:
    """Contiguous layer ranges in ``peers`` order, sizes ∝ ``weights`` (largest remainder);
    a peer of weight 0 gets none, every other peer at least one layer when there are enough.
    Raises LocalProtocolError when no weight is positive."""
    used = [(p, w) for p, w in zip(peers, weights, strict=True) if w > 0]
    if not used or n_layers <= 0:
        raise LocalProtocolError("split_layers needs layers and at least one peer of positive weight")
    used = used[:n_layers]
    total = sum(w for _, w in used)
    exact = [n_layers * w / total for _, w in used]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > n_layers:  # the minimum of one layer each overshot: take from the largest
        counts[max(range(len(counts)), key=lambda i: counts[i] - exact[i])] -= 1
    for i in sorted(range(len(used)), key=lambda i: counts[i] - exact[i])[: n_layers - sum(counts)]:
        counts[i] += 1
    out, at = [], 0
    for (p, _), c in zip(used, counts):
        if c:
            out.append(Stage(p, at, at + c))
            at += c
    return tuple(out)

