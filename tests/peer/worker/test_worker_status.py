"""What a worker's status knows of the plans it accepted: the ranges plan (``_learn_plan``) and
the stage plan (``_learn_stages``) of one coordinator's term and version side by side (the mix
layout), a newer plan replacing an older one's fields, an older stage plan sent again changing
nothing."""

from __future__ import annotations

import types

from swarm.peer.net import messages as m
from swarm.peer.plan.plan import Plan, Span
from swarm.peer.worker.role import WorkerRole

C, W, OTHER = "c" * 26, "w" * 26, "o" * 26


class _Node:
    def __init__(self) -> None:
        self.placement: dict | None = None
        self.events: list[tuple] = []

    def set_placement(self, placement: dict | None) -> None:
        self.placement = placement

    def record(self, *event) -> None:
        self.events.append(event)


def _worker() -> types.SimpleNamespace:
    w = types.SimpleNamespace(node=_Node())
    for name in ("_learn_plan", "_learn_stages", "_note_coordinator"):
        setattr(w, name, types.MethodType(getattr(WorkerRole, name), w))
    return w


def _link(peer: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(peer_id=peer, hello=None)


def _stages(version: int, term: int = 2) -> m.StagePlan:
    return m.StagePlan(term=term, version=version, stages=(m.StageAssignment(C, 0, 10), m.StageAssignment(W, 10, 30)))


def _ranges(version: int, term: int = 2) -> Plan:
    return Plan(version, term, C, (W,), {}, {0: (Span(C, 0, 100), Span(W, 100, 200))})


def test_a_workers_status_keeps_its_stage_plan_beside_the_ranges_of_the_same_plan():
    w = _worker()
    w._learn_stages(_link(C), _stages(3))
    assert w.node.placement == {"term": 2, "version": 3, "coordinator": C, "layout": "stages",
                                "stages": [[C, 0, 10], [W, 10, 30]]}
    assert [e[0] for e in w.node.events] == ["coordinator changed"]
    w._learn_plan(_link(C), _ranges(3))  # the same plan's ranges (the mix layout): the stages stay
    assert w.node.placement["stages"] == [[C, 0, 10], [W, 10, 30]] and w.node.placement["dense"]
    w._learn_stages(_link(C), _stages(3))
    assert w.node.placement["layout"] == "mix" and w.node.placement["dense"]
    w._learn_stages(_link(C), _stages(2))  # an older stage plan sent again: nothing changes
    assert w.node.placement["version"] == 3 and w.node.placement["dense"]
    w._learn_stages(_link(C), _stages(4))  # a newer, stages alone: the older ranges go
    assert w.node.placement["version"] == 4 and "dense" not in w.node.placement and "peers" not in w.node.placement
    w._learn_plan(_link(C), _ranges(5))  # a newer ranges plan: the older stages go
    assert "stages" not in w.node.placement and w.node.placement["version"] == 5
    w._learn_stages(_link(OTHER), _stages(1, term=3))  # another coordinator's newer term
    assert w.node.placement["coordinator"] == OTHER and w.node.placement["version"] == 1
    assert [e[0] for e in w.node.events] == ["coordinator changed"] * 2
