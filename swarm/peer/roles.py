"""Roles: the election over a node's links, and what this peer does with the outcome.

Theory of operation
-------------------
:class:`SwarmRoles` is the thin asyncio adapter around the sans-I/O cores. It
feeds the :class:`~swarm.peer.election.core.Election` with the node's links — every
Python peer whose link opens becomes a voting member, eligible when its hello
names our model hash — with election messages (``RequestVote``, ``Vote``,
``LeaderHeartbeat``) and with the links' liveness, and sends what the core
wants sent. Its outcome switches this peer's role:

* **coordinator** — builds a :class:`~swarm.peer.coordinator.planner.Plan` from the hellos
  of the peers that can compute (Python peers with our model or none, and the
  browser peers linked to it), sends it to them, wraps the model in a
  :class:`~swarm.peer.coordinator.dispatch.RemoteFFN` and serves the OpenAI API with it.
  A peer that fails or whose link goes down gets no more work: the plan is
  rebuilt and sent, and RemoteFFN switches to it at the next step. A failed
  peer that is reachable again gets work back after ``READMIT_S`` (checked on
  a timer: a stalled peer's link never goes down, so no event says it is back). Peers that
  join get work from the next plan the same way. A worker that refuses a request as not
  serving its plan (``stale_term``) keeps its place and is sent the plan again.
* **worker** — accepts the coordinator's plans and serves its FFN requests with a
  :class:`~swarm.peer.worker.ffn.Worker`, in one compute thread, off the event loop.

Layouts (``layout``): ``"ranges"`` cuts every layer's FFN over the peers; ``"stages"`` gives
the peers that hold the model contiguous layer ranges (:mod:`swarm.peer.coordinator.stages`: a
``StagePlan`` follows the ``Plan``, the coordinator's :class:`~swarm.peer.coordinator.stages.StagedFFN`
wraps its RemoteFFN, each worker answers with a :class:`~swarm.peer.coordinator.stages.StageRunner`);
``"auto"`` lets the cost model (:mod:`swarm.peer.coordinator.costmodel`) pick whichever is fastest from
the peers' memory, observed speed and RTT. The prices go to ``status --json``.

Weights: a worker that holds the model (same content hash) decodes only its
slices from its own file. One that joined with ``--no-model`` gets them shipped:
before the coordinator announces a plan, it offers such a worker the slices the
plan gives it (:class:`~swarm.peer.weights.shipping_aio.PlanShipper`: the file's own
encoding, SHA-256 per chunk, resumable, cached on the worker by hash). The
worker fetches and decodes them when the plan arrives, and holds back requests
of that plan until they are in (the first request of a plan has a generous
deadline), so shipping delays a step once but never loses one. A browser peer
answers "no such weights" until it has installed them; within its warm-up window
those rows are recomputed without counting against it. Answers of peers with
another numeric build (WebGPU) are verified within a tolerance, not bit for bit.

Trust: a peer whose hello names another model is refused by name (logged, kept
out of the election and the plan, told with an ``Error`` of code ``model``). A
peer with no model votes but cannot lead.

Every task this object starts is owned by it and cancelled by :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import random
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from swarm.errors import LocalProtocolError, RemoteProtocolError, StaleTermError, SwarmError
from swarm.peer.election import core as el
from swarm.peer.coordinator.dispatch import RemoteFFN
from swarm.peer.coordinator.costmodel import LayerCosts, PeerCost, observed_gflops
from swarm.peer.net.messages import (
    DenseAnswer, DenseRequest, Error, ExpertAnswer, ExpertRequest, LeaderHeartbeat, PlanMessage,
    RequestVote, StageAnswer, StagePlan, StageRequest, Vote,
)
from swarm.peer.coordinator.planner import ModelShape, PeerCapacity, Plan, build_plan, shortfall_message
from swarm.peer.weights.shipping import SliceCache
from swarm.peer.weights.shipping_aio import PlanShipper, SliceFetcher, shape_from_meta
from swarm.peer.weights.slices import ShippedWeights, SliceSpan, decode_slice
from swarm.peer.coordinator.stages import LAYOUTS, Stage, StagedFFN, StageLayout, StageRunner, choose_stages
from swarm.peer.worker.ffn import Worker

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.peer.net.link import Link
    from swarm.peer.node import Node

log = logging.getLogger(__name__)

TICK_S = 0.05  # the election driver wakes at least this often (seconds)
BROWSER_WARMUP_S = 120.0  # a browser peer's "no such weights" answers are not failures this long
# A fresh peer neither stands nor votes this long (seconds): enough for the mesh to form, so
# peers that start together elect one coordinator instead of each leading a quorum of one.
STARTUP_QUIET_S = 2.0
# A joining peer does not stand while Python peers it sees on signaling are not linked yet,
# for at most this long (seconds): one of them may coordinate already.
JOIN_GRACE_S = 10.0
LEFT_SILENCE_S = 2.0  # link silence (seconds) that, with no signaling presence, means a peer left
SHIP_TIMEOUT_S = 600.0  # a worker without the model gives up on a plan's slices after this (seconds)
READMIT_S = 5.0  # a worker that failed a request gets work again after this, if reachable (seconds)
PLAN_CHECK_S = 1.0  # how often the coordinator compares the peers that can work with its plan (seconds)
PLAN_WAIT_S = 60.0  # a request waits at most this long for its plan's slices (seconds)


class SwarmRoles:
    """Election and roles for one :class:`~swarm.peer.node.Node`.

    ``model``: the whole model this peer holds (None: it holds none); ``tokenizer``
    for the API (default: the model's own). ``verify``: share (0..1) of remote
    answers the coordinator recomputes. ``layout``: ``"ranges"``, ``"stages"`` or ``"auto"`` (module
    docstring). ``api_host`` / ``api_port``: where the
    coordinator serves the OpenAI API (port 0: any free port, see :attr:`api_port`); ``api_tls``:
    HTTPS or not (None: HTTPS unless ``api_host`` is loopback; see ``ApiServer.start``).
    """

    def __init__(self, node: Node, model: Model | None = None, *, tokenizer: Any = None, verify: float = 0.0,
                 api_host: str = "0.0.0.0", api_port: int = 0, rng: random.Random | None = None,
                 serve_api: bool = True, startup_quiet_s: float = STARTUP_QUIET_S, layout: str = "ranges",
                 api_tls: bool | None = None) -> None:
        self.node = node
        self.model = model
        self.model_hash = node.hello.model_hash
        # The model this peer's swarm runs: its own, or (without one) the model most of its Python
        # peers hold — a peer without a model must not bridge two swarms of different models.
        self.swarm_model: str | None = self.model_hash
        if model is not None and model.content_hash() != self.model_hash:
            raise LocalProtocolError("the node's hello must name the hash of the model it serves")
        self.shape = ModelShape.from_model(model) if model is not None else None  # encoded sizes: budgets
        self.verify = verify
        self.election = el.Election(node.peer_id, eligible=model is not None, capability=node.hello.ffn_gflops,
                                    now=time.monotonic(), rng=rng, startup_quiet_s=startup_quiet_s)
        self.worker = Worker(node.peer_id, self.shape, model) if model is not None else None
        self.ffn: RemoteFFN | None = None
        if layout not in LAYOUTS:
            raise LocalProtocolError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
        self.layout = layout
        self.stage_runner = StageRunner(node.peer_id, model) if model is not None else None
        self.stages: StagedFFN | None = None  # the coordinator's stage dispatch (layouts other than ranges)
        self._stage_layout: StageLayout | None = None  # of the newest plan
        self._cost_report: dict | None = None
        self._costs = LayerCosts.from_model(model) if model is not None and layout != "ranges" else None
        self.refused: dict[str, str] = {}  # peer id → why it gets no work
        self.api = None
        self.api_port: int | None = None
        if tokenizer is None and model is not None and serve_api:
            from swarm.compute.tokenizer import tokenizer_for

            tokenizer = tokenizer_for(model)  # now, not when elected: that must not stall the event loop
        self._tokenizer = tokenizer
        self._api_host, self._api_port_wanted, self._serve_api = api_host, api_port, serve_api
        self._api_tls = api_tls
        self._plan_version = 0
        self._last_leader_term = 0  # the last term in which this peer knew a coordinator
        self._replan_pending = False
        self._failed_at: dict[str, float] = {}  # peer → when it last failed a request (monotonic s)
        self._planned: set[str] = set()  # the workers of the newest plan
        self._next_plan_check = 0.0
        self._shipper = (PlanShipper(model.path, self.model_hash, self.shape, token_key=node.swarm_key.slice_token_key)
                         if model is not None else None)
        self._fetchers: dict[str, SliceFetcher] = {}  # without a model: per link to a peer that has one
        self._plans_ready: dict[tuple[int, int], asyncio.Event] = {}  # (term, version) → slices in
        self._ship_lock = asyncio.Lock()
        self._coordinating: asyncio.Task | None = None
        self._compute = cf.ThreadPoolExecutor(1, thread_name_prefix="swarm-worker")
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = time.monotonic()  # reset by start()
        self._wake = asyncio.Event()
        node.observed = self._observed

    @classmethod
    async def create(cls, node: Node, model: Model | None = None, **options: Any) -> SwarmRoles:
        """Construct in a worker thread: building the tokenizer and indexing the model file
        take seconds on a large model, and the event loop must keep serving links meanwhile."""
        return await asyncio.to_thread(cls, node, model, **options)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Hook into the node and start the election driver."""
        self._loop = asyncio.get_running_loop()
        self._started = time.monotonic()
        n = self.node
        n.on(RequestVote, self._on_request_vote)
        n.on(Vote, self._on_vote)
        n.on(LeaderHeartbeat, self._on_leader_heartbeat)
        n.on(PlanMessage, self._on_plan)
        n.on(ExpertRequest, self._on_request)
        n.on(DenseRequest, self._on_request)
        n.on(ExpertAnswer, self._on_answer)
        n.on(DenseAnswer, self._on_answer)
        n.on(Error, self._on_error)
        n.on(StagePlan, self._on_stage_plan)
        n.on(StageRequest, self._on_stage_request)
        n.on(StageAnswer, self._on_answer)
        n.on_link_up.append(self._link_up)
        n.on_link_down.append(self._link_down)
        for link in list(n.links.values()):
            self._link_up(link)
        self._spawn(self._drive(), "election")

    async def stop(self) -> None:
        """Cancel every task, close the API, stop the compute thread."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self._close_api()
        if self._shipper is not None:
            await self._shipper.close()  # the HTTPS slice server
        self._compute.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=f"roles-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("roles task %s failed", task.get_name(), exc_info=task.exception())

    @property
    def role(self) -> str:
        return {el.Role.LEADER: "coordinator"}.get(self.election.role, "worker" if self.election.leader else "peer")

    # ------------------------------------------------------------------- election
    async def _drive(self) -> None:
        """The election driver: must outlive any one bad tick, or this peer would never elect again."""
        failures = 0
        while True:
            try:
                await self._tick()
                failures = 0
            except Exception:
                failures += 1
                if failures == 1:
                    log.exception("election tick failed; going on")
                await asyncio.sleep(TICK_S)

    async def _tick(self) -> None:
        """One round: liveness and membership from the links, the election's timers, its messages."""
        now = time.monotonic()
        for peer, link in list(self.node.links.items()):
            self.election.heard_from(peer, link.last_heard)  # any inbound byte, link heartbeats included
        self._forget_departed(now)
        self._readmit_returned(now)
        self._check_plan(now)
        if now < self._started + JOIN_GRACE_S and self._unlinked_peers():
            self.election.hold_candidacy(now + TICK_S)
        self.election.handle_timer(now)
        await self._flush()
        self._wake.clear()
        delay = min(max(self.election.get_timer() - time.monotonic(), 0.0), TICK_S)
        try:
            await asyncio.wait_for(self._wake.wait(), delay)
        except TimeoutError:
            pass

    def _unlinked_peers(self) -> set[str]:
        """Python peers on our signaling server with no open link to us yet (refused ones aside)."""
        present = getattr(self.node.rendezvous, "peers", None) or {}
        return {p for p, info in present.items()
                if info.kind == "python" and p != self.node.peer_id and p not in self.node.links
                and p not in self.refused}

    def _forget_departed(self, now: float) -> None:
        """Members the signaling server no longer lists, whose link is closed or silent for
        ``LEFT_SILENCE_S``, have left (a killed process drops its signaling connection at once;
        its link only times out later): they stop counting toward the quorum, so the
        survivors of a small swarm can still elect.

        A peer cut off by the network (not by leaving) stays listed by the signaling server of
        its side and keeps counting. If a partition also splits signaling, each side ends up
        with its own coordinator; each holds the whole model, so each still gives the right
        tokens, and the sides merge again through the election when they meet.
        """
        present = getattr(self.node.rendezvous, "peers", None)
        if not present:
            return  # between signaling servers: we are the one cut off, not them
        for peer in self.election.members:
            if peer == self.node.peer_id or peer in present:
                continue
            link = self.node.links.get(peer)
            heard = link.last_heard if link is not None else None
            if heard is None or now - heard > LEFT_SILENCE_S:
                log.info("peer %s left the swarm", peer)
                self.election.remove_member(peer, now)

    def _readmit_returned(self, now: float) -> None:
        """A peer forgotten by :meth:`_forget_departed` whose link stayed open and speaks again
        (it was stalled, or cut off for less than the link timeout) is a member again: its
        link never went down, so no link-up event would bring it back."""
        for peer, link in list(self.node.links.items()):
            hello = link.hello
            if (hello is None or hello.peer_kind != "python" or peer in self.election.members
                    or peer in self.refused or now - link.last_heard > LEFT_SILENCE_S):
                continue
            log.info("peer %s is back", peer)
            self._admit(link)

    async def _flush(self) -> None:
        """Send what the election wants sent, then act on its events."""
        e = self.election
        for dest, msg in e.messages_to_send():
            match msg:
                case el.LeaderHeartbeat():
                    wire = LeaderHeartbeat(msg.term, msg.leader, self._plan_version)
                case el.RequestVote():
                    wire = RequestVote(msg.term, msg.candidate, self._last_leader_term, self._plan_version,
                                       e.capability)
                case el.Vote():
                    wire = Vote(msg.term, msg.granted)
            targets = [dest] if dest else [p for p in e.members if p != self.node.peer_id]
            for peer in targets:
                link = self.node.links.get(peer)
                if link is not None:
                    self._spawn(self._send(link, wire), "send")
        while (event := e.next_event()) is not None:
            log.info("term %d: coordinator %s", event.term, event.leader or "none (election due)")
            if event.leader is not None:
                self._last_leader_term = event.term
            if event.leader == self.node.peer_id:
                # Planning may ship slices: its own task, so heartbeats keep going meanwhile.
                self._coordinating = self._spawn(self._become_coordinator(event.term), "coordinate")
            else:
                if self._coordinating is not None:
                    self._coordinating.cancel()
                    self._coordinating = None
                await self._stop_coordinating()
            self.node.role = self.role

    async def _send(self, link: Link, msg: Any) -> None:
        try:
            await link.send(msg)
        except SwarmError as exc:
            log.info("could not send %s to %s: %s", type(msg).__name__, link.peer_id, exc)

    def _receive(self, link: Link, msg: Any) -> None:
        if link.peer_id not in self.election.members:
            return  # refused peers (another model) and browser peers take no part in the election
        try:
            self.election.receive(link.peer_id, msg, time.monotonic())
        except RemoteProtocolError as exc:
            log.warning("election message from %s refused: %s", link.peer_id, exc)
        self._wake.set()

    def _on_request_vote(self, link: Link, msg: RequestVote) -> None:
        self._receive(link, el.RequestVote(msg.term, msg.candidate))

    def _on_vote(self, link: Link, msg: Vote) -> None:
        self._receive(link, el.Vote(msg.term, link.peer_id, msg.granted))

    def _on_leader_heartbeat(self, link: Link, msg: LeaderHeartbeat) -> None:
        self._receive(link, el.LeaderHeartbeat(msg.term, msg.leader))

    # ---------------------------------------------------------------- membership
    def _link_up(self, link: Link) -> None:
        hello = link.hello
        if hello is None:
            return
        if hello.peer_kind == "browser":
            # Browser peers link to the coordinator only: they compute but do not vote.
            if self._shipper is not None:
                self._shipper.attach(link)
                if self.ffn is not None:
                    self._schedule_replan()
            return
        if self.model is None and self._choose_model():
            return  # every link, this one included, was weighed again
        self._admit(link)

    def _admit(self, link: Link) -> None:
        """Make a Python peer a voting member (eligible when it holds this swarm's model), or
        refuse it by name when it holds another model."""
        hello, peer = link.hello, link.peer_id
        if self._refuse_other_model(link):
            return
        eligible = hello.model_hash is not None and self.swarm_model in (None, hello.model_hash)
        if self._shipper is not None:
            self._shipper.attach(link)  # answer its chunk requests, should it need slices
        elif hello.model_hash is not None and peer not in self._fetchers:
            self._fetchers[peer] = SliceFetcher(link, hello.model_hash, SliceCache())
        self.election.add_member(peer, eligible=eligible, capability=hello.ffn_gflops, now=time.monotonic())
        if self.ffn is not None:
            self._schedule_replan()
        self._wake.set()

    def _choose_model(self) -> bool:
        """Without a model: this swarm's model is the one most linked Python peers hold (ties keep
        the current choice). Returns True when the choice changed and every peer was re-admitted."""
        counts = Counter(link.hello.model_hash for link in self.node.links.values()
                         if link.hello is not None and link.hello.peer_kind == "python" and link.hello.model_hash)
        if not counts:
            return False
        best = max(counts, key=lambda h: (counts[h], h == self.swarm_model))
        if best == self.swarm_model:
            return False
        log.info("joining the swarm of model %s… (held by %d peer(s))", best[:12], counts[best])
        self.swarm_model = best
        for link in list(self.node.links.values()):
            if link.hello is not None and link.hello.peer_kind == "python":
                if link.hello.model_hash in (None, best):
                    self.refused.pop(link.peer_id, None)
                self._admit(link)
        return True

    def _refuse_other_model(self, link: Link) -> bool:
        """Refuse ``link``'s peer by name if it holds another model than this swarm runs.

        Another model is another swarm in effect: no vote, no work (a member that could
        never vote for us would only block the quorum).
        """
        hello, peer = link.hello, link.peer_id
        if hello.model_hash is None or self.swarm_model is None or hello.model_hash == self.swarm_model:
            return False
        why = (f"peer {hello.name!r} ({peer}) holds model {hello.model_hash[:12]}…, "
               f"this swarm runs {self.swarm_model[:12]}…")
        if peer not in self.refused:
            self.refused[peer] = why
            log.warning("refused %s", why)
            self._spawn(self._send(link, Error(0, "model", f"refused: {why}")), "refuse")
        self.election.remove_member(peer, time.monotonic())
        return True

    def _link_down(self, peer: str) -> None:
        self._fetchers.pop(peer, None)
        if self.ffn is not None:
            self.ffn.peer_down(peer, "link closed")
            if self.stages is not None:
                self.stages.peer_down(peer, "link closed")
            self._schedule_replan()

    # --------------------------------------------------------------- coordinator
    def _workers(self) -> list[PeerCapacity]:
        out = []
        failed = (self.ffn.failed if self.ffn is not None else set()) | (self.stages.failed if self.stages else set())
        now = time.monotonic()
        for peer, link in self.node.links.items():
            h = link.hello
            if (h is None or h.model_hash not in (self.model_hash, None)
                    or peer in self.refused or h.memory_budget <= 0):
                continue
            if peer in failed and now - self._failed_at.get(peer, now) < READMIT_S:
                continue  # it failed a step: out of the plans for a while, then tried again
            if h.peer_kind == "python" and not self.election.reachable(peer, now):
                continue  # silent (a killed process whose link has not timed out yet), or gone
            out.append(PeerCapacity(peer, h.memory_budget, h.ffn_gflops, link.rtt_s or 0.0, h.peer_kind))
        return out

    def _new_plan(self) -> Plan:
        self._plan_version += 1
        me = PeerCapacity(self.node.peer_id, 0, self.node.hello.ffn_gflops)
        workers = self._workers()
        self._planned = {w.peer_id for w in workers}
        # Our budget less what only we hold (embeddings, attention, routers, norms, head).
        budget = max(self.node.hello.memory_budget - self.shape.resident_nbytes, 0)
        plan = build_plan(self.shape, me, self._plan_layout(workers), term=self.election.term, version=self._plan_version,
                          coordinator_budget=budget)
        short = shortfall_message(plan, self.shape)
        if short and self._stage_layout is None:  # under stages the FFN plan is the coordinator's stage only
            log.warning("plan v%d: %s", plan.version, short)
        return plan

    async def _announce(self, plan: Plan) -> None:
        """Offer workers without the model their slices, then send the plan to every worker."""
        links = {p: self.node.links[p] for p in plan.workers() if p in self.node.links}
        for link in links.values():
            if link.hello.model_hash is None:
                try:
                    await self._shipper.offer_plan(link, plan)
                except SwarmError as exc:
                    log.warning("could not offer slices to %s: %s", link.peer_id, exc)
        msg = plan.to_message()
        await asyncio.gather(*(self._send(link, msg) for link in links.values()))
        self.node.record("replanned", detail=f"plan v{plan.version} of term {plan.term}: {len(plan.workers())} worker(s)")
        self.node.placement = {"term": plan.term, "version": plan.version, **self._api_fields(),
                               "streamed_bytes": plan.streamed_bytes, **plan.to_dict()}
        await self._announce_stages()

    # ------------------------------------------------------------------- stages
    def _plan_layout(self, workers: list[PeerCapacity]) -> list[PeerCapacity]:
        """Choose the next plan's layout: sets the stage layout (None: per-layer ranges) and the
        cost report; returns the workers that get FFN ranges (none under stages)."""
        self._stage_layout = None
        if self.layout == "ranges":
            return workers
        holders = [w for w in workers if w.kind == "python" and w.peer_id in self.node.links
                   and self.node.links[w.peer_id].hello.model_hash == self.model_hash]
        h = self.node.hello
        own = self.model.embed.nbytes + (0 if self.model.head is self.model.embed else self.model.head.nbytes)
        me = PeerCost(self.node.peer_id, max(h.memory_budget - own, 0), h.ffn_gflops)
        mine = self.stages.local_timing.s_per_row_layer if self.stages is not None else None
        if mine:  # our own layers' timing, in the unit the workers' answers are priced in
            per_layer = (sum(self._costs.attn_flops) + sum(self._costs.ffn_flops)) / self._costs.n_layers
            me = PeerCost(me.peer_id, me.memory_bytes, observed_gflops(per_layer, mine), observed=True)
        costs = []
        for w in holders:
            gflops, seen = self._speed(w.peer_id, w.ffn_speed)
            costs.append(PeerCost(w.peer_id, w.memory_bytes, gflops, w.rtt_s, observed=seen))
        stages, self._cost_report = choose_stages(self.layout, self._costs, me, costs)
        if stages is None:
            return workers
        self._stage_layout = StageLayout(self.election.term, self._plan_version, self.node.peer_id, stages)
        return []

    def _speed(self, peer: str, claimed: float) -> tuple[float, bool]:
        """(GFLOP/s, observed?): from its answers (stage or FFN) when it gave any, else its hello's figure."""
        timing = self.stages.layer_timing.get(peer) if self.stages is not None else None
        if timing is not None and timing.s_per_row_layer:
            per_layer = (sum(self._costs.attn_flops) + sum(self._costs.ffn_flops)) / self._costs.n_layers
            return observed_gflops(per_layer, timing.s_per_row_layer), True
        timing = self.ffn.timing.get(peer) if self.ffn is not None else None
        if timing is not None and timing.s_per_row:  # its FFN answers: FLOPs of one row of its share
            c, plan = self.model.config, self.ffn.plan
            span = next((plan.dense_span(layer, peer) for layer in plan.dense if plan.dense_span(layer, peer)), None)
            width = len(span) if span else (c.moe_intermediate_size if plan.experts else 0)
            seen = observed_gflops(2.0 * 3 * c.hidden_size * width, timing.s_per_row)
            if seen is not None:
                return seen, True
        return claimed, False

    async def _announce_stages(self) -> None:
        """Send the newest plan's stages to the workers that hold one; show them and the prices."""
        lay = self._stage_layout
        if lay is not None:
            msg = lay.to_message()
            await asyncio.gather(*(self._send(self.node.links[p], msg) for p in lay.workers() if p in self.node.links))
        if self.layout != "ranges" and self.node.placement is not None:
            self.node.placement = {**self.node.placement, "layout": "stages" if lay else "ranges",
                                   "stages": [[s.peer, s.start, s.stop] for s in lay.stages] if lay else [],
                                   "cost": self._cost_report}

    def set_layout(self, layout: str) -> None:
        """Use ``layout`` (``"ranges"``, ``"stages"`` or ``"auto"``) from the next plan on; a
        coordinator re-plans now. Sequences in flight finish under the layout they started with.
        Raises LocalProtocolError for another name."""
        if layout not in LAYOUTS:
            raise LocalProtocolError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
        self.layout = layout
        if layout != "ranges" and self._costs is None and self.model is not None:
            self._costs = LayerCosts.from_model(self.model)
        if self.ffn is not None:
            self._schedule_replan()

    def _start_stages(self) -> None:
        """Coordinator: wrap RemoteFFN in the stage dispatch (or hand it the new layout)."""
        if self.layout == "ranges":
            self.stages = None
            if self.api is not None:
                self.api.backend.ffn = self.ffn
            return
        n = self.model.config.n_layers
        lay = self._stage_layout or StageLayout(self.election.term, self._plan_version, self.node.peer_id,
                                                (Stage(self.node.peer_id, 0, n),))
        if self.stages is None:
            self.stages = StagedFFN(self.model, lay, self, inner=self.ffn)
        else:
            self.stages.inner = self.ffn
            self.stages.set_layout(lay)
        for peer, link in self.node.links.items():
            if link.rtt_s:
                self.stages.set_rtt(peer, link.rtt_s)
        if self.api is not None:
            self.api.backend.ffn = self.stages

    @property
    def engine_ffn(self) -> Any:
        """What the token loop passes to ``Model.forward``: the stage dispatch, or RemoteFFN."""
        return self.stages if self.stages is not None else self.ffn

    async def _on_stage_plan(self, link: Link, msg: StagePlan) -> None:
        try:
            self.election.check_term(msg.term, time.monotonic())
            if link.peer_id != self.election.leader and msg.term == self.election.term and self.election.leader:
                raise StaleTermError(f"stage plan from {link.peer_id}, but {self.election.leader} coordinates")
            if self.stage_runner is None:
                raise RemoteProtocolError("this peer holds no model, so it cannot run a stage")
            self.stage_runner.accept(StageLayout.from_message(msg, link.peer_id, self.model.config.n_layers))
            await asyncio.get_running_loop().run_in_executor(self._compute, self.stage_runner.prepare)
        except (RemoteProtocolError, LocalProtocolError) as exc:
            log.warning("stage plan from %s refused: %s", link.peer_id, exc)
            await self._send(link, Error(0, "bad_plan", f"stage plan v{msg.version} refused: {exc}"))

    async def _on_stage_request(self, link: Link, msg: StageRequest) -> None:
        runner = self.stage_runner
        await self._serve(link, msg, runner, inline=runner is not None and runner.take_inline(msg))

    async def _serve(self, link: Link, msg: Any, server: Any, inline: bool = False) -> None:
        """Answer a worker request with ``server.handle`` in the compute thread: an ``Error``
        when this peer holds no model (``server`` None) or the request's term is stale."""
        if server is None:
            await self._send(link, Error(msg.request_id, "model", "this peer holds no model"))
            return
        try:
            self.election.check_term(msg.term, time.monotonic())
        except StaleTermError as exc:
            await self._send(link, Error(msg.request_id, "stale_term", str(exc)))
            return
        answer = server.handle(msg) if inline else await asyncio.get_running_loop().run_in_executor(
            self._compute, server.handle, msg)
        await self._send(link, answer)

    async def _become_coordinator(self, term: int) -> None:
        if self.model is None:
            return
        plan = self._new_plan()
        await self._announce(plan)
        if self.election.role is not el.Role.LEADER or self.election.term != term:
            return  # deposed while announcing
        self.ffn = RemoteFFN(self.model, plan, self, verify=self.verify)
        for peer, link in self.node.links.items():
            if link.rtt_s:
                self.ffn.set_rtt(peer, link.rtt_s)
        self._mark_builds()
        self._start_stages()
        self.ffn.warming_until.update({p: time.monotonic() + s for p, s in self._warming(plan).items()})
        log.info("coordinator of term %d: plan v%d over %d worker(s)", plan.term, plan.version, len(plan.workers()))
        self.node.record("coordinator changed", self.node.peer_id, self.node.name, f"this peer, term {term}")
        if self._serve_api:
            await self._open_api()
        self.node.placement = {**(self.node.placement or {}), **self._api_fields()}
        if {w.peer_id for w in self._workers()} != set(plan.peers) - {self.node.peer_id}:
            self._schedule_replan()  # peers came or went while this plan was being shipped

    def _warming(self, plan: Plan) -> dict[str, float]:
        """Browser workers of ``plan`` install shipped slices after it arrives: give them time."""
        return {p: BROWSER_WARMUP_S for p in plan.workers()
                if p in self.node.links and self.node.links[p].hello.peer_kind == "browser"}

    def _mark_builds(self) -> None:
        """Peers of another numeric build (docs/architecture.md §5) are verified within a tolerance, not bit for bit."""
        ours = self.node.hello.build
        self.ffn.approximate = {p for p, link in self.node.links.items() if link.hello.build != ours}

    async def _stop_coordinating(self) -> None:
        if self.ffn is None:
            return
        ffn, self.ffn = self.ffn, None
        stages, self.stages = self.stages, None
        for peer in list(self.node.links):
            ffn.peer_down(peer, "this peer is no longer the coordinator")
            if stages is not None:
                stages.peer_down(peer, "this peer is no longer the coordinator")
        self.node.placement = None
        await self._close_api()

    # The coordinator's Dispatcher (swarm.peer.coordinator.dispatch): RemoteFFN and StagedFFN
    # call these from the token-loop thread; each hands its work to the event loop.
    def send(self, peer: str, msg: ExpertRequest | DenseRequest | StageRequest) -> None:
        """Queue ``msg`` on ``peer``'s link; ConnectionError when there is none."""
        link = self.node.links.get(peer)
        if link is None:
            raise ConnectionError(f"no link to {peer}")
        self._loop.call_soon_threadsafe(lambda: self._spawn(self._send_request(link, msg), "request"))

    async def _send_request(self, link: Link, msg: Any) -> None:
        try:
            await link.send(msg)
        except SwarmError as exc:
            for backend in (self.ffn, self.stages):
                if backend is not None:
                    backend.peer_down(link.peer_id, f"send failed: {exc}")

    def peer_failed(self, peer: str, reason: str) -> None:
        """Re-plan without ``peer`` (on the event loop)."""
        self._loop.call_soon_threadsafe(self._peer_failed, peer)

    def last_heard(self, peer: str) -> float | None:
        """A link's liveness (monotonic s of its last inbound byte); None without a link."""
        link = self.node.links.get(peer)
        return link.last_heard if link is not None else None

    def peer_not_ready(self, peer: str, reason: str) -> None:
        """Send ``peer`` the plan in use again (on the event loop)."""
        self._loop.call_soon_threadsafe(lambda: self._spawn(self._resend_plan(peer), "resend-plan"))

    async def _resend_plan(self, peer: str) -> None:
        """``peer`` refused a request of the plan in use as not accepted (it lost or refused the
        plan): send it that plan again, with its slices' offer if it has no model. Not when a
        newer plan is on its way: it has that one, and the old one would be refused as stale."""
        link, ffn = self.node.links.get(peer), self.ffn
        if link is None or ffn is None or ffn.pending_plan is not None:
            return
        if link.hello.model_hash is None:
            try:
                await self._shipper.offer_plan(link, ffn.plan)
            except SwarmError as exc:
                log.warning("could not offer slices to %s: %s", peer, exc)
                return
        await self._send(link, ffn.plan.to_message())

    def _peer_failed(self, peer: str) -> None:
        self._failed_at[peer] = time.monotonic()
        link = self.node.links.get(peer)
        self.node.record("marked down", peer, link.hello.name if link is not None and link.hello else "",
                         "late, gone or wrong: its rows are recomputed here")
        self._schedule_replan()

    def _check_plan(self, now: float) -> None:
        """Re-plan when the peers that can work are not those of the last plan: a failed peer
        whose ``READMIT_S`` passed and that is reachable again gets work back (no event
        would say so: a stalled peer's link never went down)."""
        if self.ffn is None or self._replan_pending or now < self._next_plan_check:
            return
        self._next_plan_check = now + PLAN_CHECK_S
        if {w.peer_id for w in self._workers()} != self._planned:
            self._schedule_replan()

    def _schedule_replan(self) -> None:
        if not self._replan_pending:
            self._replan_pending = True
            self._spawn(self._replan(), "replan")

    async def _replan(self) -> None:
        await asyncio.sleep(0)  # several link events in one go → one new plan
        self._replan_pending = False
        if self.ffn is None:
            return
        plan = self._new_plan()
        await self._announce(plan)  # sent (queued in order) before any request that uses it
        if self.ffn is not None:
            self._mark_builds()
            self.ffn.set_plan(plan, warming=self._warming(plan))
            self._start_stages()
            log.info("plan v%d over %d worker(s), from the next step", plan.version, len(plan.workers()))

    def _on_answer(self, link: Link, msg: Any) -> None:
        backend = self.stages if isinstance(msg, StageAnswer) else self.ffn
        if backend is not None:
            backend.deliver(link.peer_id, msg)

    def _on_error(self, link: Link, msg: Error) -> None:
        if msg.request_id == 0:
            log.warning("peer %s: %s: %s", link.peer_id, msg.code, msg.message)
            if msg.code == "model":  # it runs another model: it will never vote for us
                self.refused.setdefault(link.peer_id, msg.message)
                self.election.remove_member(link.peer_id, time.monotonic())
        else:  # request ids of the two backends never collide: each drops the other's
            for backend in (self.ffn, self.stages):
                if backend is not None:
                    backend.deliver(link.peer_id, msg)

    async def _open_api(self) -> None:
        if self.api is not None:
            self.api.backend.ffn = self.engine_ffn
            return
        from swarm.peer.coordinator.api import ApiServer, EngineBackend
        from swarm.peer.coordinator.dashboard import Dashboard

        backend = EngineBackend(self.model, self._tokenizer, model_id=self.model.path.name, ffn=self.engine_ffn)
        self.api = ApiServer.for_swarm_key(backend, self.node.swarm_key)
        Dashboard(self.node.status).attach(self.api)  # its page and chat on the API's server
        self.api_port = await self.api.start(self._api_host, self._api_port_wanted, tls=self._api_tls,
                                             advertise=(self.node.peer_id, self.election.term))  # mDNS: chat finds it
        log.info("OpenAI API on port %d (%s)", self.api_port, self.api.scheme)

    def _api_fields(self) -> dict[str, Any]:
        """Where status shows the API: its port and scheme (the local CLI connects by them)."""
        return {"api_port": self.api_port, "api_scheme": self.api.scheme if self.api is not None else None}

    async def _close_api(self) -> None:
        if self.api is not None:
            api, self.api = self.api, None
            await api.close()
            self.api_port = None

    # -------------------------------------------------------------------- worker
    async def _on_plan(self, link: Link, msg: PlanMessage) -> None:
        ready = self._plans_ready.setdefault((msg.term, msg.version), asyncio.Event())
        try:
            self.election.check_term(msg.term, time.monotonic())
            if link.peer_id != self.election.leader and msg.term == self.election.term and self.election.leader:
                raise StaleTermError(f"plan from {link.peer_id}, but {self.election.leader} coordinates term {msg.term}")
            if self.worker is not None and self.worker.serves(msg.term, msg.version):
                return  # sent again (the coordinator saw a request of it refused): nothing new
            if self.model is None:
                await self._fetch_slices(link, msg)
            plan = Plan.from_message(msg, link.peer_id, self.shape)
            self.worker.accept_plan(plan)
            self._learn_plan(link, plan)
            # Decode our slices now rather than on the first request (which has a deadline).
            await asyncio.get_running_loop().run_in_executor(self._compute, self.worker.prepare)
        except (RemoteProtocolError, TimeoutError) as exc:
            log.warning("plan from %s refused: %s", link.peer_id, exc)
            code = "stale_term" if isinstance(exc, StaleTermError) else "bad_plan"
            await self._send(link, Error(0, code, f"plan v{msg.version} refused: {exc}"))
        finally:
            ready.set()
            for key in [k for k in self._plans_ready if k[0] < msg.term]:
                del self._plans_ready[key]

    def _learn_plan(self, link: Link, plan: Plan) -> None:
        """A worker keeps the plan it accepted in its status (roles, shares) and notes a new coordinator."""
        known = (self.node.placement or {}).get("coordinator")
        self.node.placement = {"term": plan.term, "version": plan.version, **plan.to_dict()}
        if known != link.peer_id:
            self.node.record("coordinator changed", link.peer_id, link.hello.name if link.hello else "",
                             f"term {plan.term}")

    def _observed(self) -> dict[str, Any]:
        """What the coordinator measured, per peer of its plan: weight bytes held, ms per row
        of FFN work (an average over recent answers), requests and failures. Empty elsewhere."""
        ffn = self.ffn
        if ffn is None or self.shape is None:
            return {}
        plan, timing = ffn.plan, dict(ffn.timing)  # a copy: the token loop updates it meanwhile
        peers = {}
        for peer in plan.peers:
            t = timing.get(peer)
            peers[peer] = {"weight_bytes": plan.bytes_of(peer, self.shape),
                           "ms_per_row": round(t.s_per_row * 1e3, 4) if t is not None and t.s_per_row else None,
                           "requests": t.requests if t is not None else 0,
                           "failed": peer in ffn.failed}
        return {"peers": peers}

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
        shipped, shape = ShippedWeights(), None
        async with self._ship_lock:
            async with asyncio.timeout(SHIP_TIMEOUT_S):
                while need:
                    manifest = await fetcher.offers.get()
                    spec = SliceSpan.from_json(manifest.meta.get("spec", {}))
                    if spec not in need:
                        continue  # an offer of an older plan
                    shape = shape_from_meta(manifest.meta)
                    blob = await fetcher.fetch(manifest)
                    shipped.add(await asyncio.to_thread(decode_slice, blob, manifest.meta))
                    need.discard(spec)
        if shape is None:
            raise RemoteProtocolError(f"plan v{msg.version} gives this peer nothing to compute")
        if self.shape is not None and shape != self.shape:
            raise RemoteProtocolError("the coordinator's model shape changed under this worker")
        self.shape = shape
        if self.worker is None:
            self.worker = Worker(me, shape, shipped)
        else:
            self.worker.source = shipped  # slices of the plans still served are already decoded

    async def _on_request(self, link: Link, msg: ExpertRequest | DenseRequest) -> None:
        ready = self._plans_ready.get((msg.term, msg.plan_version))
        if ready is not None and not ready.is_set():  # its plan's slices are still coming
            try:
                await asyncio.wait_for(ready.wait(), PLAN_WAIT_S)
            except TimeoutError:
                pass  # the worker refuses it below: no such plan
        await self._serve(link, msg, self.worker)
