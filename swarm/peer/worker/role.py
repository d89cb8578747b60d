"""The worker role: accepts the coordinator's plans and serves its requests.

FFN requests (``ExpertRequest``, ``DenseRequest``) are answered by a
:class:`~swarm.peer.worker.ffn.Worker`, stage requests by a
:class:`~swarm.peer.worker.stages.StageRunner`, both in one compute thread, off the event
loop, in arrival order. A request whose term is stale gets an ``Error`` of code ``stale_term``;
a peer without a model answers ``model``.

Weights: a worker that holds the model (same content hash) decodes only its slices from its
own file. One that joined with ``--no-model`` gets them shipped: the coordinator offers the
slices of a plan just before the plan (:class:`~swarm.peer.weights.shipping_aio.SliceFetcher`
per link to a peer that holds the model: SHA-256 per chunk, resumable, cached by hash). The
worker fetches and decodes them when the plan arrives, and holds back requests of that plan
until they are in (up to ``PLAN_WAIT_S``), so shipping delays a step once but never loses one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
from typing import TYPE_CHECKING, Any

from swarm.compute import numerics
from swarm.errors import RemoteProtocolError, StaleTermError, SwarmError
from swarm.peer.net.messages import DenseRequest, Error, ExpertRequest, PlanMessage, StagePlan, StageRequest
from swarm.peer.plan import Plan, StageLayout
from swarm.peer.tasks import send_logged
from swarm.peer.weights.shipping import SliceCache
from swarm.peer.weights.shipping_aio import SliceFetcher, fetch_plan_slices
from swarm.peer.weights.sizes import model_shape
from swarm.peer.weights.slices import SliceSpan
from swarm.peer.worker.ffn import FfnDevice, Worker
from swarm.peer.worker.gpu import GpuFfn, GpuStage
from swarm.peer.worker.stages import StageRunner

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.net.link import Link
    from swarm.peer.node import Node

log = logging.getLogger(__name__)

SHIP_TIMEOUT_S = 600.0  # a worker without the model gives up on a plan's slices after this (seconds)
PLAN_WAIT_S = 60.0  # a request waits at most this long for its plan's slices (seconds)


class WorkerRole:
    """Serves the coordinator's plans and requests on ``node`` (module docstring).

    ``model``: the whole model this peer holds (None: slices are shipped to it); ``election``:
    whose terms and coordinator a plan must match; ``device``: where FFN ranges are held and
    computed (None: the CPU; a :class:`~swarm.peer.worker.gpu.GpuFfn` under ``join --gpu``, which
    then computes the weight products of this peer's stages too: a
    :class:`~swarm.peer.worker.gpu.GpuStage`) — but for work past the GPU memory its hello
    announced, which computes on the CPU (:func:`swarm.peer.plan.gpu_holds`).
    """

    def __init__(self, node: Node, model: Model | None, election: ElectionDriver,
                 device: FfnDevice | None = None) -> None:
        self.node = node
        self.model = model
        self.election = election
        self.device = device
        self.shape = model_shape(model) if model is not None else None  # learned from slices otherwise
        # work past the GPU memory announced computes on the CPU (swarm.peer.plan.gpu_holds)
        self.gpu_memory = node.hello.gpu_memory or None
        self.server: Worker | None = (Worker(node.peer_id, self.shape, model, device, self.gpu_memory)
                                      if model is not None else None)
        # an int8 swarm's GPU peer runs no stage on the GPU (its kernels' attention and products are
        # float32): its coordinator plans it none, and one sent anyway runs on the engine's int8 kernels
        gpu_stages = isinstance(device, GpuFfn) and model is not None and not numerics.int8()
        stage_device = GpuStage(device, model) if gpu_stages else None
        self.stage_runner = (StageRunner(node.peer_id, model, device=stage_device, gpu_memory=self.gpu_memory)
                             if model is not None else None)
        self._fetchers: dict[str, SliceFetcher] = {}  # without a model: per link to a peer that has one
        self._plans_ready: dict[tuple[int, int], asyncio.Event] = {}  # (term, version) → slices in
        self._ship_lock = asyncio.Lock()
        self._compute = cf.ThreadPoolExecutor(1, thread_name_prefix="swarm-worker")
        self._stopped = False  # set by stop(): no request is served after it

    def start(self) -> None:
        """Take plans and requests from every link."""
        n = self.node
        n.on(PlanMessage, self._on_plan)
        n.on(ExpertRequest, self._on_request)
        n.on(DenseRequest, self._on_request)
        n.on(StagePlan, self._on_stage_plan)
        n.on(StageRequest, self._on_stage_request)
        n.on_link_down.append(self._fetchers_pop)

    def stop(self) -> None:
        """Stop the compute thread (requests queued in it are dropped); requests that arrive
        later (while the links close) are not served."""
        self._stopped = True
        self._compute.shutdown(wait=False, cancel_futures=True)

    def admitted(self, link: Link) -> None:
        """A Python peer became a member: without a model, it is where slices may come from."""
        hello = link.hello
        if self.model is None and hello.model_hash is not None and link.peer_id not in self._fetchers:
            self._fetchers[link.peer_id] = SliceFetcher(link, hello.model_hash, SliceCache())

    def _fetchers_pop(self, peer: str) -> None:
        self._fetchers.pop(peer, None)

    # ------------------------------------------------------------------ plans
    async def _on_plan(self, link: Link, msg: PlanMessage) -> None:
        ready = self._plans_ready.setdefault((msg.term, msg.version), asyncio.Event())
        try:
            self.election.check_sender(link.peer_id, msg.term, "plan")
            if self.server is not None and self.server.serves(msg.term, msg.version):
                return  # sent again (the coordinator saw a request of it refused): nothing new
            if self.model is None:
                await self._fetch_slices(link, msg)
            plan = Plan.from_message(msg, link.peer_id, self.shape)
            self.server.accept_plan(plan)
            self._learn_plan(link, plan)
            # Decode our slices now rather than on the first request (which has a deadline).
            await asyncio.get_running_loop().run_in_executor(self._compute, self.server.prepare)
        except (SwarmError, TimeoutError) as exc:  # answered, so the link to the coordinator stays up
            log.warning("plan from %s refused: %s", link.peer_id, exc)
            code = "stale_term" if isinstance(exc, StaleTermError) else "bad_plan"
            await send_logged(link, Error(0, code, f"plan v{msg.version} refused: {exc}"))
        finally:
            ready.set()
            # Older plans' entries (else one stays per re-plan); one still fetching keeps its own.
            for key in [k for k, e in self._plans_ready.items() if k < (msg.term, msg.version) and e.is_set()]:
                del self._plans_ready[key]

    def _learn_plan(self, link: Link, plan: Plan) -> None:
        """A worker keeps the plan it accepted in its status (roles, shares) and notes a new coordinator;
        the stages of the same plan (the mix layout), learned first, are kept beside it."""
        placement = self.node.placement or {}
        known = placement.get("coordinator")
        stages = ({k: placement[k] for k in ("layout", "stages") if k in placement}
                  if _plan_key(placement) == (plan.term, plan.version, link.peer_id) else {})
        self.node.set_placement({"term": plan.term, "version": plan.version, **plan.to_dict(), **stages})
        self._note_coordinator(link, known, plan.term)

    def _learn_stages(self, link: Link, msg: StagePlan) -> None:
        """A worker keeps the stage plan it accepted in its status too, as the coordinator shows its
        ``stages`` ([[peer, first layer, stop layer]]): its status names the layers it runs. The
        ranges of the same plan (the mix layout) are kept beside them; an older plan of this
        coordinator, sent again, changes nothing."""
        placement = self.node.placement or {}
        known = placement.get("coordinator")
        mine = _plan_key(placement)
        if mine[0] == msg.term and mine[2] == link.peer_id and (mine[1] or 0) > msg.version:
            return  # a re-sent older stage plan: the status keeps the newer one
        kept = placement if mine == (msg.term, msg.version, link.peer_id) else {}
        self.node.set_placement({**kept, "term": msg.term, "version": msg.version, "coordinator": link.peer_id,
                                 "layout": "mix" if kept.get("peers") else "stages",
                                 "stages": [[s.peer, s.layer_start, s.layer_stop] for s in msg.stages]})
        self._note_coordinator(link, known, msg.term)

    def _note_coordinator(self, link: Link, known: Any, term: int) -> None:
        if known != link.peer_id:
            self.node.record("coordinator changed", link.peer_id, link.hello.name if link.hello else "",
                             f"term {term}")

    async def _fetch_slices(self, link: Link, msg: PlanMessage) -> None:
        """Without the model: fetch and decode the slices ``msg`` gives this peer (offered just
        before it), learning the model's shape from their manifests; then serve from them."""
        fetcher = self._fetchers.get(link.peer_id)
        if fetcher is None:
            raise RemoteProtocolError(f"plan from {link.peer_id}, which offers no weights to this peer")
        me = self.node.peer_id
        need = {SliceSpan(a.layer, "experts", a.experts[0], a.experts[-1] + 1) for a in msg.assignments
                if a.peer == me and a.experts}
        need |= {SliceSpan(a.layer, "dense", lo, hi) for a in msg.assignments if a.peer == me for lo, hi in a.dense}
        async with self._ship_lock:
            async with asyncio.timeout(SHIP_TIMEOUT_S):
                shipped, shape = await fetch_plan_slices(fetcher, need)
        if shape is None:
            raise RemoteProtocolError(f"plan v{msg.version} gives this peer nothing to compute")
        if self.shape is not None and shape != self.shape:
            raise RemoteProtocolError("the coordinator's model shape changed under this worker")
        self.shape = shape
        if self.server is None:
            self.server = Worker(me, shape, shipped, self.device, self.gpu_memory)
        else:
            self.server.use_source(shipped)  # slices of the plans still served are already decoded

    async def _on_stage_plan(self, link: Link, msg: StagePlan) -> None:
        try:
            self.election.check_sender(link.peer_id, msg.term, "stage plan")
            if self.stage_runner is None:
                raise RemoteProtocolError("this peer holds no model, so it cannot run a stage")
            self.stage_runner.accept(StageLayout.from_message(msg, link.peer_id, self.model.config.n_layers))
            self._learn_stages(link, msg)
            await asyncio.get_running_loop().run_in_executor(self._compute, self.stage_runner.prepare)
        except SwarmError as exc:
            log.warning("stage plan from %s refused: %s", link.peer_id, exc)
            await send_logged(link, Error(0, "bad_plan", f"stage plan v{msg.version} refused: {exc}"))

    # ------------------------------------------------------------------ requests
    async def _on_request(self, link: Link, msg: ExpertRequest | DenseRequest) -> None:
        ready = self._plans_ready.get((msg.term, msg.plan_version))
        if ready is not None and not ready.is_set():  # its plan's slices are still coming
            try:
                await asyncio.wait_for(ready.wait(), PLAN_WAIT_S)
            except TimeoutError:
                pass  # the worker refuses it below: no such plan
        await self._serve(link, msg, self.server)

    async def _on_stage_request(self, link: Link, msg: StageRequest) -> None:
        runner = self.stage_runner
        await self._serve(link, msg, runner, inline=runner is not None and runner.take_inline(msg))

    async def _serve(self, link: Link, msg: ExpertRequest | DenseRequest | StageRequest,
                     server: Worker | StageRunner | None, inline: bool = False) -> None:
        """Answer a request with ``server.handle`` in the compute thread (on the event loop when
        ``inline``: a short stage step): an ``Error`` when this peer holds no model (``server``
        None) or the request's term is stale."""
        if self._stopped:  # leaving: the coordinator recomputes the rows when no answer comes
            return
        if server is None:
            await send_logged(link, Error(msg.request_id, "model", "this peer holds no model"))
            return
        try:
            self.election.check_term(msg.term, link.peer_id)  # a deposed coordinator is told the term
        except StaleTermError as exc:
            await send_logged(link, Error(msg.request_id, "stale_term", str(exc)))
            return
        if inline:
            answer = server.handle(msg)
        elif isinstance(server, StageRunner):  # counted while queued: take_inline must see it
            answer = await asyncio.wrap_future(server.submit(self._compute, msg))
        else:
            answer = await asyncio.get_running_loop().run_in_executor(self._compute, server.handle, msg)
        await send_logged(link, answer)


def _plan_key(placement: dict) -> tuple[Any, Any, Any]:
    """(term, version, coordinator) of a placement dict (None where missing)."""
    return placement.get("term"), placement.get("version"), placement.get("coordinator")
