"""The hand-off between the token-loop thread and the event loop that carries the links.

:class:`~swarm.peer.coordinator.dispatch.RemoteFFN` and
:class:`~swarm.peer.coordinator.stages.StagedFFN` run in the token-loop thread and reach the
workers through a :class:`~swarm.peer.coordinator.dispatch.Dispatcher`; :class:`LoopDispatcher`
is that dispatcher: each call is handed to the event loop (thread-safe, never blocking), and the
answers the links receive go back to the dispatch they belong to. It owns that dispatch: the
RemoteFFN of the plan in use and, for layouts other than ranges, the StagedFFN around it. The
coordinator role is one (it says what a failed or not-ready peer means).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from swarm.errors import SwarmError
from swarm.peer.coordinator.dispatch import RemoteFFN
from swarm.peer.coordinator.planning import observed
from swarm.peer.coordinator.stage_verify import VERIFY_FAILED
from swarm.peer.coordinator.stages import StagedFFN
from swarm.peer.coordinator.tracker import Observations
from swarm.peer.net.messages import (DenseAnswer, DenseAnswerInt8, DenseRequest, Error, ExpertAnswer, ExpertAnswerInt8,
                                     ExpertRequest, StageAnswer, StagePlan, StageRequest)
from swarm.peer.plan import ModelShape, Plan, StageLayout
from swarm.peer.tasks import OwnedTasks
from swarm.peer.weights.repack import KERNELS_PREFIX, page_encodings
from swarm.peer.weights.sizes import repacks_for

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.peer.net.link import Link
    from swarm.peer.node import Node

BROWSER_WARMUP_S = 120.0  # a browser peer's "no such weights" answers are not failures this long


class LoopDispatcher:
    """The :class:`~swarm.peer.coordinator.dispatch.Dispatcher` of ``ffn`` and ``stages`` (the
    dispatch of ``model``, remote answers checked at the share ``verify``) over the links of
    ``node``, handing each call to the event loop ``_loop`` (set by the owner's start) as a task
    of ``_tasks``. Subclasses say what a failed or not-ready peer means (:meth:`mark_down`,
    :meth:`resend_plan`)."""

    node: Node
    model: Model | None
    shape: ModelShape | None
    verify: float
    ffn: RemoteFFN | None
    stages: StagedFFN | None
    _tasks: OwnedTasks
    _loop: asyncio.AbstractEventLoop | None

    def observed(self) -> dict[str, Any]:
        """What this coordinator measured, per peer of its plan and stages (status); empty elsewhere. Under
        stages with ``--verify``, what checking their answers cost and whom it caught
        (``stage_verify``)."""
        ffn, st = self.ffn, self.stages
        if ffn is None or self.shape is None:
            return {}
        seen = st.tracker.observations() if st is not None else None
        out = observed(ffn.plan, self.shape, ffn.tracker.observations(), st.layout if st is not None else None, seen)
        if st is not None and seen is not None and st.verifier.share > 0:
            out["stage_verify"] = {**dataclasses.asdict(seen.verify), "distrusted": dict(seen.distrusted)}
        return out

    def _observations(self) -> tuple[Plan | None, Observations | None, Observations | None]:
        """The plan RemoteFFN runs, what its answers showed, what the stage answers showed (None: none)."""
        ffn, st = self.ffn, self.stages
        return (ffn.plan if ffn is not None else None, ffn.tracker.observations() if ffn is not None else None,
                st.tracker.observations() if st is not None else None)

    def _backends(self) -> tuple[RemoteFFN | StagedFFN, ...]:
        return tuple(b for b in (self.ffn, self.stages) if b is not None)

    @property
    def engine_ffn(self) -> RemoteFFN | StagedFFN | None:
        """What the token loop passes to ``Model.forward``: the stage dispatch, or RemoteFFN."""
        return self.stages if self.stages is not None else self.ffn

    def _start_dispatch(self, plan: Plan) -> None:
        """Dispatch ``plan``'s FFN ranges (a new term)."""
        self.ffn = RemoteFFN(self.model, plan, self, verify=self.verify)
        self._copy_rtts(self.ffn)
        self.ffn.set_approximate(*self._approximate())
        self.ffn.warm(self._warming(plan))

    def _use_plan(self, plan: Plan) -> None:
        """RemoteFFN switches to ``plan`` at its next step."""
        self.ffn.set_approximate(*self._approximate())
        self.ffn.set_plan(plan, warming=self._warming(plan))

    def _warming(self, plan: Plan) -> dict[str, float]:
        """Browser workers of ``plan`` install shipped slices after it arrives: their Error answers
        are no failures for ``BROWSER_WARMUP_S``."""
        return {p: BROWSER_WARMUP_S for p in plan.workers()
                if p in self.node.links and self.node.links[p].hello.peer_kind == "browser"}

    def _approximate(self) -> tuple[set[str], set[str]]:
        """Peers of another numeric build than the one this coordinator computes with (its CPU's,
        ``Node.cpu_build``, also when it is a GPU peer: docs/architecture.md §5), so every GPU peer,
        verified within a bound (an int8 swarm's: by their down rows), and
        those of them whose kernels compute some of the model on a Q8_0 repack (a page's or GPU
        peer's build names its kernels: :func:`~swarm.peer.weights.repack.page_encodings`)."""
        ours = self.node.cpu_build  # what this coordinator computes with, a GPU peer's too: its CPU
        other = {p: link.hello for p, link in self.node.links.items()
                 if link.hello.build != ours or link.hello.build.gpu_adapter is not None}  # a GPU's: by bound
        repacked = {p for p, h in other.items() if (h.peer_kind == "browser" or KERNELS_PREFIX in h.build.blas)
                    and repacks_for(self.model, page_encodings(h.build))}  # the file's header only
        return set(other), repacked

    def _use_stages(self, layout: StageLayout | None) -> None:
        """Wrap RemoteFFN in the stage dispatch of ``layout`` (or hand it the new layout); None:
        per-layer ranges, no stage dispatch."""
        if layout is None:
            self.stages = None
            return
        if self.stages is None:
            self.stages = StagedFFN(self.model, layout, self, inner=self.ffn, verify=self.verify)
        else:
            self.stages.set_layout(layout, inner=self.ffn)
        self.stages.set_approximate(self._approximate()[0])
        self._copy_rtts(self.stages)

    def _copy_rtts(self, backend: RemoteFFN | StagedFFN) -> None:
        for peer, link in self.node.links.items():
            if link.rtt_s:
                backend.set_rtt(peer, link.rtt_s)

    def _drop_dispatch(self, reason: str) -> bool:
        """No more dispatch: every request pending at a worker fails now (its rows are recomputed
        here, so a generation in flight finishes without waiting for a deadline). False when
        there was none."""
        if self.ffn is None:
            return False
        backends = self._backends()
        plan, self.ffn, self.stages = self.ffn.plan, None, None
        peers = set(self.node.links) | set(plan.peers)
        for backend in backends:
            peers |= set(backend.timing.copy())  # copy(): the token loop adds
        for peer in peers - {self.node.peer_id}:
            for backend in backends:
                backend.peer_down(peer, reason)
        return True

    # ------------------------------------------------- token-loop thread → event loop
    def send(self, peer: str, msg: ExpertRequest | DenseRequest | StageRequest | StagePlan) -> None:
        """Queue ``msg`` on ``peer``'s link; ConnectionError when there is none."""
        link = self.node.links.get(peer)
        if link is None:
            if self.node.closed_by_peer(peer):  # it left, and the link-down callback may not have run yet
                self._peer_down(peer, "it closed its link (leaving)", left=True)  # the trackers are thread-safe
            raise ConnectionError(f"no link to {peer}")
        # eager: the message is encoded and leaves within this callback, not a loop iteration later
        self._loop.call_soon_threadsafe(lambda: self._tasks.spawn(self._send_request(link, msg), "request", eager=True))

    async def _send_request(self, link: Link, msg: ExpertRequest | DenseRequest | StageRequest | StagePlan) -> None:
        try:
            await link.send(msg)
        except SwarmError as exc:
            self._peer_down(link.peer_id, f"send failed: {exc}")

    def _peer_down(self, peer: str, reason: str, left: bool = False) -> None:
        for backend in self._backends():
            backend.peer_down(peer, reason, left)

    def peer_failed(self, peer: str, reason: str) -> None:
        """Re-plan without ``peer`` (on the event loop); a stage answer ``--verify`` found wrong is
        an event of its own in status, with the VerificationError's text."""
        if reason.startswith(VERIFY_FAILED):
            self._loop.call_soon_threadsafe(self._record_verify_failure, peer, reason)
        self._loop.call_soon_threadsafe(self.mark_down, peer)

    def _record_verify_failure(self, peer: str, reason: str) -> None:
        link = self.node.links.get(peer)
        self.node.record(VERIFY_FAILED, peer, link.hello.name if link is not None and link.hello else "", reason)

    def last_heard(self, peer: str) -> float | None:
        """A link's liveness (monotonic s of its last inbound byte); None without a link."""
        link = self.node.links.get(peer)
        return link.last_heard if link is not None else None

    def peer_not_ready(self, peer: str, reason: str) -> None:
        """Send ``peer`` the plan in use again (on the event loop)."""
        self._loop.call_soon_threadsafe(lambda: self._tasks.spawn(self.resend_plan(peer), "resend-plan"))

    def lead_state(self, term: int) -> bool | None:
        """Always True here: the coordinator role answers from its election."""
        return True

    # ------------------------------------------------- the links → the dispatch
    def _listen(self, node: Node) -> None:
        for answer in (ExpertAnswer, DenseAnswer, ExpertAnswerInt8, DenseAnswerInt8, StageAnswer):
            node.on(answer, self.on_answer)

    def on_answer(self, link: Link, msg: ExpertAnswer | DenseAnswer | StageAnswer) -> None:
        backend = self.stages if isinstance(msg, StageAnswer) else self.ffn
        if backend is not None:
            backend.deliver(link.peer_id, msg)

    def refused(self, link: Link, msg: Error) -> None:
        """A request's ``Error`` (request id > 0): the request ids of the two backends never
        collide, so each drops the other's."""
        for backend in self._backends():
            backend.deliver(link.peer_id, msg)

    # ------------------------------------------------- what the owner decides
    def mark_down(self, peer: str) -> None:
        """``peer`` failed a request (on the event loop)."""
        raise NotImplementedError

    async def resend_plan(self, peer: str) -> None:
        """``peer`` refused a request as not serving the plan in use: send it that plan again."""
        raise NotImplementedError
