"""The coordinator role: what this peer does while the election makes it the coordinator.

It builds a :class:`~swarm.peer.plan.Plan` from the hellos of the peers that can
compute (Python peers with our model or none, and the browser peers linked to it), sends it to
them, wraps the model in a :class:`~swarm.peer.coordinator.dispatch.RemoteFFN` and serves the
OpenAI API with it. A peer that fails or whose link goes down gets no more work: the plan is
rebuilt and sent, and RemoteFFN switches to it at the next step. A failed peer that is reachable
again gets work back after ``READMIT_S`` (checked every ``PLAN_CHECK_S``: a stalled peer's link
never goes down, so no event says it is back). Peers that join get work from the next plan the
same way. A worker that refuses a request as not serving its plan (``stale_term``) keeps its
place and is sent the plan again.

Layouts (``layout``): ``"ranges"`` cuts every layer's FFN over the peers; ``"stages"`` gives the
peers that hold the model contiguous layer ranges (:mod:`swarm.peer.coordinator.stages`: a
``StagePlan`` follows the ``Plan``, a :class:`~swarm.peer.coordinator.stages.StagedFFN` wraps
RemoteFFN); ``"auto"`` lets the cost model (:mod:`swarm.peer.coordinator.costmodel`) pick
whichever is fastest from the peers' memory, observed speed and RTT. The prices go to
``status --json``.

Weights: before it announces a plan, the coordinator offers each worker without the model the
slices the plan gives it (:class:`~swarm.peer.weights.shipping_aio.PlanShipper`: the file's own
encoding, SHA-256 per chunk, resumable). A browser peer answers "no such weights" until it has
installed them; within ``BROWSER_WARMUP_S`` those rows are recomputed without counting against
it. Answers of peers with another numeric build (WebGPU) are verified within a tolerance, not
bit for bit.

This object is the :class:`~swarm.peer.coordinator.dispatch.Dispatcher` of its RemoteFFN and
StagedFFN: rows leave through :meth:`CoordinatorRole.send` on the peer's link, answers come back
through the node's handlers to :meth:`RemoteFFN.deliver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import LocalProtocolError, SwarmError
from swarm.peer.coordinator.costmodel import MESSAGE_OVERHEAD_S, LayerCosts, PeerCost, observed_gflops
from swarm.peer.coordinator.dispatch import RemoteFFN
from swarm.peer.coordinator.planner import PeerCapacity, build_plan, shortfall
from swarm.peer.coordinator.stages import LAYOUTS, StagedFFN, choose_stages
from swarm.peer.plan import Plan, Stage, StageLayout
from swarm.peer.net.messages import DenseAnswer, DenseRequest, Error, ExpertAnswer, ExpertRequest, StageAnswer, StageRequest
from swarm.peer.tasks import OwnedTasks, send_logged
from swarm.peer.weights.shipping_aio import PlanShipper
from swarm.peer.weights.sizes import model_shape

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.compute.tokenizer import TextTokenizer
    from swarm.peer.coordinator.api import ApiServer, EngineBackend
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.net.link import Link
    from swarm.peer.node import Node

log = logging.getLogger(__name__)

BROWSER_WARMUP_S = 120.0  # a browser peer's "no such weights" answers are not failures this long
READMIT_S = 5.0  # a worker that failed a request gets work again after this, if reachable (seconds)
PLAN_CHECK_S = 1.0  # how often the coordinator compares the peers that can work with its plan (seconds)
API_PORT_FILE = "api_port"  # in the config directory: the port the API last served on, tried first next time


def read_api_port(path: Path) -> int:
    """The API port remembered in ``path`` (0: none, or unreadable)."""
    try:
        port = int(path.read_text().strip())
    except (OSError, ValueError):
        return 0
    return port if 0 < port < 65536 else 0


def write_api_port(path: Path, port: int) -> None:
    """Remember ``port`` in ``path``, so a coordinator elected again on this machine serves at the
    same URL; a failure is logged (the port is then chosen afresh next time)."""
    try:
        path.write_text(f"{port}\n")
    except OSError as exc:
        log.warning("could not remember the API port in %s: %s", path, exc)


def check_layout(layout: str) -> str:
    """``layout`` if it names one; LocalProtocolError naming the choices otherwise."""
    if layout not in LAYOUTS:
        raise LocalProtocolError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    return layout


class CoordinatorRole:
    """Plans, dispatch and the API of this peer while it coordinates (module docstring).

    ``model``: the whole model (None: this peer never coordinates); ``election``: whose term it
    coordinates; ``verify``: share (0..1) of remote answers recomputed here; ``layout``: see the
    module docstring; ``tokenizer`` for the API; ``api_host`` / ``api_port`` (0: any free port;
    None: the port remembered in the config directory, :data:`API_PORT_FILE`, else a free one,
    then remembered; see :attr:`api_port`) / ``api_tls`` (None: HTTPS unless the host is
    loopback): where the OpenAI API is served, if ``serve_api``. A port that is taken gives way
    to a free one, with a warning.
    """

    def __init__(self, node: Node, model: Model | None, election: ElectionDriver, *, verify: float = 0.0,
                 layout: str = "ranges", tokenizer: TextTokenizer | None = None, serve_api: bool = True,
                 api_host: str = "0.0.0.0", api_port: int | None = None, api_tls: bool | None = None) -> None:
        self.node = node
        self.model = model
        self.election = election
        self.model_hash = node.hello.model_hash
        self.shape = model_shape(model) if model is not None else None  # encoded sizes: budgets
        self.verify = verify
        self.layout = check_layout(layout)
        self.ffn: RemoteFFN | None = None
        self.stages: StagedFFN | None = None  # the stage dispatch (layouts other than ranges)
        self._stage_layout: StageLayout | None = None  # of the newest plan
        self._cut_layers: range | None = None  # a mix: the coordinator's stage, whose FFN is cut into ranges
        self._shortfall: dict | None = None  # what the newest plan lacks (planner.shortfall), shown by status
        self._cost_report: dict | None = None
        self._costs = LayerCosts.from_model(model) if model is not None and layout != "ranges" else None
        self.api: ApiServer | None = None
        self._backend: EngineBackend | None = None  # the API's token loop
        self.api_port: int | None = None
        self._tokenizer = tokenizer
        self._api_host, self._api_port_wanted, self._serve_api, self._api_tls = api_host, api_port, serve_api, api_tls
        self.plan_version = 0  # of the newest plan this peer built
        self.replan_pending = False  # a new plan is on its way
        self._failed_at: dict[str, float] = {}  # peer → when it last failed a request (monotonic s)
        self._planned: set[str] = set()  # the workers of the newest plan
        self._shipper = (PlanShipper(model.path, self.model_hash, self.shape, token_key=node.swarm_key.slice_token_key)
                         if model is not None else None)
        self._coordinating: asyncio.Task | None = None
        self._api_closing: asyncio.Task | None = None  # the API of a term we stepped down from
        self._tasks = OwnedTasks("coordinator")
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Take answers from every link, browser peers' links, and start the plan check."""
        self._loop = asyncio.get_running_loop()
        n = self.node
        for answer in (ExpertAnswer, DenseAnswer, StageAnswer):
            n.on(answer, self._on_answer)
        n.on_link_up.append(self._browser_up)
        n.on_link_down.append(self._link_down)
        for link in list(n.links.values()):
            self._browser_up(link)
        n.set_observer(self.observed)
        if self.model is not None:
            self._tasks.spawn(self._check_plan_forever(), "plan-check")

    async def stop(self) -> None:
        """Cancel every task (none starts after), drop the dispatch (so that link events that
        come while the node closes its links plan nothing), close the API and the slice server."""
        self.ffn = self.stages = None
        self._coordinating = None
        if self._api_closing is not None:  # a step-down's close: let it finish, not cancel it midway
            await asyncio.wait([self._api_closing])
        await self._tasks.close()
        await self._close_api()
        if self._shipper is not None:
            await self._shipper.close()  # the HTTPS slice server

    def take_over(self, term: int) -> None:
        """The election made this peer the coordinator of ``term``: plan (which may ship slices:
        its own task, so that the election's heartbeats go on meanwhile), then serve."""
        self._coordinating = self._tasks.spawn(self._become(term), "coordinate")

    async def step_down(self) -> None:
        """Another peer coordinates, or none: stop planning, fail what is in flight, close the API.

        Returns at once (the election awaits it): every request pending at a worker fails now
        (its rows are recomputed here, so a generation in flight finishes without waiting for a
        deadline), and the API closes in the background — its mDNS record first, so clients
        find the next coordinator."""
        if self._coordinating is not None:
            self._coordinating.cancel()
            self._coordinating = None
        if self.ffn is None:
            return
        ffn, self.ffn = self.ffn, None
        stages, self.stages = self.stages, None
        peers = set(self.node.links) | set(ffn.plan.peers) | set(ffn.timing.copy())  # copy(): the token loop adds
        if stages is not None:
            peers |= set(stages.timing.copy())
        for peer in peers - {self.node.peer_id}:
            ffn.peer_down(peer, "this peer is no longer the coordinator")
            if stages is not None:
                stages.peer_down(peer, "this peer is no longer the coordinator")
        self.node.set_placement(None)
        log.info("stepped down: no longer the coordinator (term %d now)", self.election.term)
        if self.api is not None:
            self._api_closing = self._tasks.spawn(self._close_api(), "close-api")

    @property
    def engine_ffn(self) -> RemoteFFN | StagedFFN | None:
        """What the token loop passes to ``Model.forward``: the stage dispatch, or RemoteFFN."""
        return self.stages if self.stages is not None else self.ffn

    async def _become(self, term: int) -> None:
        if self.model is None:
            return
        plan = self._new_plan()
        await self._announce(plan)
        if not self.election.leads(term):
            return  # deposed while announcing
        self.ffn = RemoteFFN(self.model, plan, self, verify=self.verify)
        for peer, link in self.node.links.items():
            if link.rtt_s:
                self.ffn.set_rtt(peer, link.rtt_s)
        self.ffn.set_approximate(self._approximate())
        self._start_stages()
        self.ffn.warm(self._warming(plan))
        log.info("coordinator of term %d: plan v%d over %d worker(s)", plan.term, plan.version, len(plan.workers()))
        self.node.record("coordinator changed", self.node.peer_id, self.node.name, f"this peer, term {term}")
        if self._serve_api:
            await self._open_api(term)
        self.node.update_placement(self._api_fields())
        if {w.peer_id for w in self._workers()} != set(plan.peers) - {self.node.peer_id}:
            self._schedule_replan()  # peers came or went while this plan was being shipped

    def _warming(self, plan: Plan) -> dict[str, float]:
        """Browser workers of ``plan`` install shipped slices after it arrives: give them time."""
        return {p: BROWSER_WARMUP_S for p in plan.workers()
                if p in self.node.links and self.node.links[p].hello.peer_kind == "browser"}

    def _approximate(self) -> set[str]:
        """Peers of another numeric build (docs/architecture.md §5): verified within a tolerance."""
        ours = self.node.hello.build
        return {p for p, link in self.node.links.items() if link.hello.build != ours}

    # ------------------------------------------------------------------ membership
    def admitted(self, link: Link) -> None:
        """A Python peer became a member: serve its chunk requests (should it need slices), plan it in."""
        if self._shipper is not None:
            self._shipper.attach(link)
        if self.ffn is not None:
            self._schedule_replan()

    def _browser_up(self, link: Link) -> None:
        """Browser peers link to the coordinator only: they compute but do not vote."""
        if link.hello is None or link.hello.peer_kind != "browser" or self._shipper is None:
            return
        self._shipper.attach(link)
        if self.ffn is not None:
            self._schedule_replan()

    def _link_down(self, peer: str) -> None:
        if self.ffn is not None:
            self.ffn.peer_down(peer, "link closed")
            if self.stages is not None:
                self.stages.peer_down(peer, "link closed")
            self._schedule_replan()

    # ------------------------------------------------------------------ the Dispatcher
    # RemoteFFN and StagedFFN call these from the token-loop thread; each hands its work to the event loop.
    def send(self, peer: str, msg: ExpertRequest | DenseRequest | StageRequest) -> None:
        """Queue ``msg`` on ``peer``'s link; ConnectionError when there is none."""
        link = self.node.links.get(peer)
        if link is None:
            raise ConnectionError(f"no link to {peer}")
        # eager: the message is encoded and leaves within this callback, not a loop iteration later
        self._loop.call_soon_threadsafe(lambda: self._tasks.spawn(self._send_request(link, msg), "request", eager=True))

    async def _send_request(self, link: Link, msg: ExpertRequest | DenseRequest | StageRequest) -> None:
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
        self._loop.call_soon_threadsafe(lambda: self._tasks.spawn(self._resend_plan(peer), "resend-plan"))

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
        await send_logged(link, ffn.plan.to_message())

    def _peer_failed(self, peer: str) -> None:
        """``peer`` is out of every plan for ``READMIT_S`` from now; one new plan, and only when
        the newest one still has it (a mark-down from a sequence under an older layout, or from
        the other dispatcher, changes nothing)."""
        self._failed_at[peer] = time.monotonic()
        link = self.node.links.get(peer)
        self.node.record("marked down", peer, link.hello.name if link is not None and link.hello else "",
                         "late, gone or wrong: its rows are recomputed here")
        if peer in self._planned:
            self._schedule_replan()

    def _on_answer(self, link: Link, msg: ExpertAnswer | DenseAnswer | StageAnswer) -> None:
        backend = self.stages if isinstance(msg, StageAnswer) else self.ffn
        if backend is not None:
            backend.deliver(link.peer_id, msg)

    def refused(self, link: Link, msg: Error) -> None:
        """A request's ``Error`` (request id > 0): the request ids of the two backends never
        collide, so each drops the other's."""
        for backend in (self.ffn, self.stages):
            if backend is not None:
                backend.deliver(link.peer_id, msg)

    # ------------------------------------------------------------------ plans
    async def _check_plan_forever(self) -> None:
        """Re-plan when the peers that can work are not those of the last plan: a failed peer
        whose ``READMIT_S`` passed and that is reachable again gets work back (no event
        would say so: a stalled peer's link never went down)."""
        while True:
            await asyncio.sleep(PLAN_CHECK_S)
            if self.ffn is not None and not self.replan_pending and {w.peer_id for w in self._workers()} != self._planned:
                self._schedule_replan()

    def _schedule_replan(self) -> None:
        if not self.replan_pending:
            self.replan_pending = True
            self._tasks.spawn(self._replan(), "replan")

    async def _replan(self) -> None:
        await asyncio.sleep(0)  # several link events in one go → one new plan
        self.replan_pending = False
        if self.ffn is None:
            return
        plan = self._new_plan()
        await self._announce(plan)  # sent (queued in order) before any request that uses it
        if self.ffn is not None:
            self.ffn.set_approximate(self._approximate())
            self.ffn.set_plan(plan, warming=self._warming(plan))
            self._start_stages()
            log.info("plan v%d over %d worker(s), from the next step", plan.version, len(plan.workers()))

    def _workers(self) -> list[PeerCapacity]:
        out = []
        now = time.monotonic()
        for peer, link in self.node.links.items():
            h = link.hello
            if (h is None or h.model_hash not in (self.model_hash, None)
                    or self.election.is_refused(peer) or h.memory_budget <= 0):
                continue
            if now - self._failed_at.get(peer, now - READMIT_S) < READMIT_S:
                continue  # marked down: out of every plan for a while (whatever a new plan cleared), then tried again
            if h.peer_kind == "python" and not self.election.reachable(peer):
                continue  # silent (a killed process whose link has not timed out yet), or gone
            out.append(PeerCapacity(peer, h.memory_budget, h.ffn_gflops, link.rtt_s or 0.0, h.peer_kind))
        return out

    def _new_plan(self) -> Plan:
        self.plan_version += 1
        me = PeerCapacity(self.node.peer_id, 0, self.node.hello.ffn_gflops)
        workers = self._workers()
        self._planned = {w.peer_id for w in workers}
        # Our allowance less what only we hold (embeddings, attention, routers, norms, head), the KV
        # cache and activations.
        takers = self._plan_layout(workers)
        lay = self._stage_layout
        stage_workers = len(lay.workers()) if lay is not None else 0
        own = {i for s in lay.stages if s.peer == self.node.peer_id for i in range(s.start, s.stop)} if lay else None
        own_layers = len(own) if own is not None else None
        # Under stages the attention of the workers' layers is not ours to keep (the cost model's rule).
        not_run = sum(b for i, b in enumerate(self._costs.attn_bytes) if i not in own) if own is not None else 0
        budget = self.shape.coordinator_weight_budget(self.node.hello.memory_budget, stage_workers, own_layers, not_run)
        cut = self._cut_layers
        if lay is not None and cut is None:
            # Whole stages: the budget covers the coordinator's own stages' FFN; the workers' layers
            # run here only after a stage fails (from the mapped file), outside the budget.
            cut = sorted(own)
        plan = build_plan(self.shape, me, takers, term=self.election.term, version=self.plan_version,
                          coordinator_budget=budget, layers=cut)
        self._shortfall = shortfall(plan, self.shape, coordinator_allowance=self.node.hello.memory_budget,
                                    worker_stages=stage_workers, kv_layers=own_layers, not_run_bytes=not_run)
        if self._shortfall:
            log.warning("plan v%d: %s", plan.version, self._shortfall["message"])
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
        await asyncio.gather(*(send_logged(link, msg) for link in links.values()))
        self.node.record("replanned", detail=f"plan v{plan.version} of term {plan.term}: {len(plan.workers())} worker(s)")
        self.node.set_placement({"term": plan.term, "version": plan.version, **self._api_fields(),
                                 "streamed_bytes": plan.streamed_bytes, **plan.to_dict(),
                                 **({"shortfall": self._shortfall} if self._shortfall else {})})
        await self._announce_stages()

    def observed(self) -> dict[str, Any]:
        """What this coordinator measured, per peer of its plan: weight bytes held, ms per row
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

    # ------------------------------------------------------------------ stages
    def set_layout(self, layout: str) -> None:
        """Use ``layout`` (``"ranges"``, ``"stages"`` or ``"auto"``) from the next plan on; a
        coordinator re-plans now. Sequences in flight finish under the layout they started with.
        Raises LocalProtocolError for another name."""
        self.layout = check_layout(layout)
        if layout != "ranges" and self._costs is None and self.model is not None:
            self._costs = LayerCosts.from_model(self.model)
        if self.ffn is not None:
            self._schedule_replan()

    def _plan_layout(self, workers: list[PeerCapacity]) -> list[PeerCapacity]:
        """Choose the next plan's layout: sets the stage layout (None: per-layer ranges), the
        layers whose FFN is cut (a mix: the coordinator's stage; None: all) and the cost report;
        returns the workers that get FFN ranges (none under stages; under a mix each with the
        memory its stage leaves)."""
        self._stage_layout = self._cut_layers = None
        if self.layout == "ranges":
            return workers
        holders = [w for w in workers if w.kind == "python" and w.peer_id in self.node.links
                   and self.node.links[w.peer_id].hello.model_hash == self.model_hash]
        h = self.node.hello
        own = self.model.embed.nbytes + (0 if self.model.head is self.model.embed else self.model.head.nbytes)
        me = PeerCost(self.node.peer_id, max(h.memory_budget - own, 0), h.ffn_gflops)
        mine = self.stages.tracker.local_timing.s_per_row_layer if self.stages is not None else None
        if mine:  # our own layers' timing, in the unit the workers' answers are priced in
            me = PeerCost(me.peer_id, me.memory_bytes, observed_gflops(self._layer_flops(), mine), observed=True)
        costs, range_only = [], []
        overhead = self.stages.message_overhead if self.stages is not None else {}
        for w in workers:  # a peer that cannot run a stage (a page, no model file) still takes ranges
            gflops, seen = self._speed(w.peer_id, w.ffn_speed)
            (costs if w in holders else range_only).append(PeerCost(
                w.peer_id, w.memory_bytes, gflops, w.rtt_s, observed=seen,
                overhead_s=overhead.get(w.peer_id, MESSAGE_OVERHEAD_S)))
        stages, self._cost_report = choose_stages(self.layout, self._costs, me, costs, range_only)
        if stages is None:
            return workers
        self._stage_layout = StageLayout(self.election.term, self.plan_version, self.node.peer_id, stages)
        if self._cost_report.get("choice") != "mix":
            return []
        first = stages[0]  # a mix: the coordinator's stage comes first, its FFN cut over the holders
        self._cut_layers = range(first.start, first.stop)
        held = {s.peer: sum(self._costs.stage_bytes(i) for i in range(s.start, s.stop)) for s in stages[1:]}
        return [dataclasses.replace(w, memory_bytes=max(w.memory_bytes - held.get(w.peer_id, 0), 0)) for w in holders]

    def _layer_flops(self) -> float:
        """FLOPs of one row through one average layer (attention and FFN)."""
        return (sum(self._costs.attn_flops) + sum(self._costs.ffn_flops)) / self._costs.n_layers

    def _speed(self, peer: str, claimed: float) -> tuple[float, bool]:
        """(GFLOP/s, observed?): from its answers (stage or FFN) when it gave any, else its hello's figure."""
        timing = self.stages.layer_timing.get(peer) if self.stages is not None else None
        if timing is not None and timing.s_per_row_layer:
            return observed_gflops(self._layer_flops(), timing.s_per_row_layer), True
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
            await asyncio.gather(*(send_logged(self.node.links[p], msg) for p in lay.workers() if p in self.node.links))
        if self.layout != "ranges" and self.node.placement is not None:
            self.node.update_placement({"layout": ("mix" if self._cut_layers else "stages") if lay else "ranges",
                                        "stages": [[s.peer, s.start, s.stop] for s in lay.stages] if lay else [],
                                        "cost": self._cost_report})

    def _start_stages(self) -> None:
        """Wrap RemoteFFN in the stage dispatch (or hand it the new layout); the API follows."""
        if self.layout == "ranges":
            self.stages = None
        else:
            n = self.model.config.n_layers
            lay = self._stage_layout or StageLayout(self.election.term, self.plan_version, self.node.peer_id,
                                                    (Stage(self.node.peer_id, 0, n),))
            if self.stages is None:
                self.stages = StagedFFN(self.model, lay, self, inner=self.ffn)
            else:
                self.stages.set_layout(lay, inner=self.ffn)
            for peer, link in self.node.links.items():
                if link.rtt_s:
                    self.stages.set_rtt(peer, link.rtt_s)
        if self._backend is not None:
            self._backend.set_ffn(self.engine_ffn)

    # ------------------------------------------------------------------ the API
    async def _open_api(self, term: int) -> None:
        if self._api_closing is not None:  # of the last term: its port may be the one we want
            await asyncio.shield(self._api_closing)
            self._api_closing = None
        if self._backend is not None:
            self._backend.set_ffn(self.engine_ffn)
            return
        from swarm.peer import memory
        from swarm.peer.coordinator.api import ApiServer, EngineBackend
        from swarm.peer.coordinator.dashboard import Dashboard

        # The KV cache the memory plan reserved (join --context) bounds what the API admits.
        context = memory.context_tokens(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self._backend = EngineBackend(self.model, self._tokenizer, model_id=self.model.path.name, ffn=self.engine_ffn,
                                      context=context)
        remembered = self.node.status_path.parent / API_PORT_FILE  # in this peer's config directory
        port = self._api_port_wanted if self._api_port_wanted is not None else read_api_port(remembered)
        for attempt in (port, 0) if port else (0,):
            self.api = ApiServer.for_swarm_key(self._backend, self.node.swarm_key)
            Dashboard(self.node.status).attach(self.api)  # its page and chat on the API's server
            try:
                self.api_port = await self.api.start(self._api_host, attempt, tls=self._api_tls,
                                                     advertise=(self.node.peer_id, term))  # mDNS: chat finds it
                break
            except OSError as exc:
                if attempt == 0:
                    raise
                with contextlib.suppress(Exception):
                    await self.api.close()
                log.warning("the API's port %d is taken (%s); serving on a free port instead%s", attempt,
                            exc.strerror or exc, "" if self._api_port_wanted else
                            f" (delete {remembered} to stop trying {attempt})")
        if self._api_port_wanted is None and not port:  # the first port chosen here is kept
            write_api_port(remembered, self.api_port)
        log.info("OpenAI API on port %d (%s)", self.api_port, self.api.scheme)

    def _api_fields(self) -> dict[str, Any]:
        """Where status shows the API: its port and scheme (the local CLI connects by them)."""
        return {"api_port": self.api_port, "api_scheme": self.api.scheme if self.api is not None else None}

    async def _close_api(self) -> None:
        if self.api is not None:
            api, self.api, self._backend = self.api, None, None
            await api.close()
            self.api_port = None
