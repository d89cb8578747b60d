"""A coordinator woken from a stall (SIGSTOP/SIGCONT, a laptop's sleep) plans nothing from the view
it held before it: its links timed out and its members look unreachable because it was silent, and
another peer may have been elected meanwhile. Once woken it steps down without a plan (once: it
planned over no one and warned that the swarm's memory held 0 MB of the model), or, still leading,
plans once its election has heard the swarm again."""

from __future__ import annotations

import asyncio

from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator import role as role_module
from swarm.peer.coordinator.role import CoordinatorRole
from swarm.peer.node import Node


class Election:
    """What a re-plan reads of the election: its term, whether it leads it, whether it stalled."""

    def __init__(self) -> None:
        self.term, self.leading, self.asleep = 3, True, True

    def stalled(self) -> bool:
        return self.asleep

    def leads(self, term: int) -> bool:
        return self.leading and term == self.term


def woken_coordinator(tmp_path, monkeypatch) -> tuple[CoordinatorRole, Election, list[str]]:
    monkeypatch.setattr(role_module, "STALL_RECHECK_S", 0.01)
    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                status_path=tmp_path / "status.json", model_hash="m" * 64, memory_budget=1 << 30, ffn_gflops=1.0)
    election = Election()
    role = CoordinatorRole(node, None, election)  # type: ignore[arg-type]
    planned: list[str] = []

    async def announce(plan):
        planned.append(plan)

    monkeypatch.setattr(role, "_new_plan", lambda: f"plan of term {election.term}")
    monkeypatch.setattr(role, "_announce", announce)
    monkeypatch.setattr(role, "_use_plan", lambda plan: None)
    monkeypatch.setattr(role, "_start_stages", lambda: None)
    role.ffn = object()  # dispatching a plan of term 3
    return role, election, planned


def test_a_woken_coordinator_that_was_deposed_plans_nothing(tmp_path, monkeypatch):
    role, election, planned = woken_coordinator(tmp_path, monkeypatch)

    async def main():
        role._schedule_replan()  # as its links' time-out on waking does
        await asyncio.sleep(0.1)
        assert planned == [] and role.replan_pending  # still waiting for the election
        election.term, election.leading, election.asleep = 4, False, False  # another peer leads term 4
        await asyncio.sleep(0.1)
        await role._tasks.close()

    asyncio.run(main())
    assert planned == [] and not role.replan_pending


def test_a_woken_coordinator_still_leading_plans_once_the_swarm_is_heard(tmp_path, monkeypatch):
    role, election, planned = woken_coordinator(tmp_path, monkeypatch)

    async def main():
        role._schedule_replan()
        role._schedule_replan()  # several triggers while waiting: one plan
        await asyncio.sleep(0.1)
        assert planned == []
        election.asleep = False
        await asyncio.sleep(0.1)
        await role._tasks.close()

    asyncio.run(main())
    assert planned == ["plan of term 3"] and not role.replan_pending


def test_a_coordinator_that_did_not_stall_plans_at_once(tmp_path, monkeypatch):
    role, election, planned = woken_coordinator(tmp_path, monkeypatch)
    election.asleep = False

    async def main():
        role._schedule_replan()
        await asyncio.sleep(0.05)
        await role._tasks.close()

    asyncio.run(main())
    assert planned == ["plan of term 3"]


def test_a_peer_that_closes_its_link_once_is_planned_again_at_once_one_that_flaps_is_not(tmp_path, monkeypatch):
    """A peer that closes its link (a leave, a restart) is planned again as soon as it links; one
    that closes it again within FLAP_S (a fault of its own that would flap the plans) is kept out
    for READMIT_S, as a lost one is."""
    import time

    role, election, planned = woken_coordinator(tmp_path, monkeypatch)
    election.asleep = False
    monkeypatch.setattr(role.node, "closed_by_peer", lambda peer: True)
    monkeypatch.setattr(role, "_peer_down", lambda *a: None)
    monkeypatch.setattr(role, "_schedule_replan", lambda: None)
    role._link_down("w1")
    assert not role._marked_down("w1", time.monotonic())
    role._link_down("w1")  # it linked again and closed again
    assert role._marked_down("w1", time.monotonic())
    assert not role._marked_down("w1", time.monotonic() + role_module.READMIT_S + 0.1)
    role._link_down("w2")  # another peer's first close
    assert not role._marked_down("w2", time.monotonic())
