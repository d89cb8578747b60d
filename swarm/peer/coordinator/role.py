"""The coordinator role: its life cycle while the election makes this peer the coordinator, and
the swarm's membership as it sees it. Elected, it plans (:mod:`~swarm.peer.coordinator.planning`)
over the peers that can compute — Python peers with our model or none, browser peers linked to
it — hands the plan out (:mod:`~swarm.peer.coordinator.announce`), dispatches with it
(:mod:`~swarm.peer.coordinator.handoff`) and serves the API (:mod:`~swarm.peer.coordinator.api_host`).
A peer that fails or whose link goes down gets no more work: the plan is rebuilt and sent, and the
dispatch switches to it at the next step. A failed peer that is reachable again gets work back
after ``READMIT_S`` (checked every ``PLAN_CHECK_S``: a stalled peer's link never goes down, so no
event says it is back); peers that join get work from the next plan. A worker that refuses a
request as not serving its plan (``stale_term``) keeps its place and is sent the plan again. At
the same check the sequences the API runs are fed to the planner
(:class:`~swarm.peer.coordinator.planning.LoadWatch`): under ``auto`` it re-plans when the load
changes the layout the cost model chooses. A coordinator woken from a stall (SIGSTOP, a laptop's
sleep) plans nothing until its election has heard the swarm again
(:meth:`~swarm.peer.election.driver.ElectionDriver.stalled`): the peers it lost meanwhile were
silent because it was, and another peer may lead by now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from swarm.peer.coordinator import standby
from swarm.peer.coordinator.announce import PlanAnnouncer
from swarm.peer.coordinator.api_host import ApiHost
from swarm.peer.coordinator.handoff import LoopDispatcher
from swarm.peer.coordinator.planner import PeerCapacity
from swarm.peer.coordinator.planning import LoadWatch, Planning, check_layout
from swarm.peer.plan import Plan, plan_workers
from swarm.peer.tasks import OwnedTasks
from swarm.peer.weights.sizes import int8_gpu_refusal, model_shape

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.compute.tokenizer import TextTokenizer
    from swarm.peer.coordinator.api import ApiServer
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.net.link import Link
    from swarm.peer.net.messages import Hello, NumericBuild, Standby
    from swarm.peer.node import Node

log = logging.getLogger(__name__)

READMIT_S = 5.0  # a worker that failed a request gets work again after this, if reachable (seconds)
# A peer that closes its link again within this of its last close (it links, closes, links: a
# fault of its own, not a leave) is kept out of plans for READMIT_S, as a lost one is.
FLAP_S = 30.0
PLAN_CHECK_S = 1.0  # how often the coordinator compares the peers that can work with its plan (seconds)
STALL_RECHECK_S = 0.1  # after a stall, how often a re-plan asks whether the election heard the swarm again (s)


class CoordinatorRole(LoopDispatcher):
    """This peer while it coordinates. ``model``: the whole model (None: it never coordinates);
    ``election``: whose term; ``verify``: share (0..1) of remote answers recomputed here; ``layout``:
    see :mod:`~swarm.peer.coordinator.planning`; ``tokenizer``, ``api_*``: the OpenAI API, served
    if ``serve_api`` (:class:`~swarm.peer.coordinator.api_host.ApiHost`)."""

    def __init__(self, node: Node, model: Model | None, election: ElectionDriver, *, verify: float = 0.0,
                 layout: str = "ranges", tokenizer: TextTokenizer | None = None, serve_api: bool = True,
                 api_host: str = "0.0.0.0", api_port: int | None = None, api_tls: bool | None = None) -> None:
        self.node, self.model, self.election, self.verify = node, model, election, verify
        self.model_hash = node.hello.model_hash
        self.shape = model_shape(model) if model is not None else None  # encoded sizes: budgets
        # GPU peers of the int8 numerics: their GEMVs' types → why this model's FFN blocks cannot go to them
        self._x8_refusals: dict[frozenset[str], str | None] = {}
        check_layout(layout)
        self.planning = Planning(model, self.shape, node.peer_id, layout) if model is not None else None
        self.ffn = self.stages = None  # the dispatch (handoff.LoopDispatcher)
        self._api = ApiHost(node, model, tokenizer, api_host, api_port, api_tls)
        self._serve_api = serve_api
        self.replan_pending = False  # a new plan is on its way
        self._failed_at: dict[str, float] = {}  # peer → when it last failed a request (monotonic s)
        self._left_at: dict[str, float] = {}  # peer → when it last closed its link (monotonic s)
        self._planned: set[str] = set()  # the workers of the newest plan
        self._standby: dict[str, Standby] = {}  # page → why the newest plan gives it no work
        self._other_numerics: set[str] = set()  # peers left out of every plan for their numerics (noted once)
        self._announcer = PlanAnnouncer(node, model, self.shape) if model is not None else None
        self._coordinating: asyncio.Task | None = None
        self._load = LoadWatch()  # the sequences served, fed to the planner
        self._tasks = OwnedTasks("coordinator")
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def plan_version(self) -> int:
        """The version of the newest plan this peer built."""
        return self.planning.version if self.planning is not None else 0

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Take answers from every link, browser peers' links, and start the plan check."""
        self._loop = asyncio.get_running_loop()
        n = self.node
        self._listen(n)
        n.on_link_up.append(self._link_up)
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
        await self._api.closed()  # a step-down's handed-over API: closed now
        await self._tasks.close()
        await self._api.close()
        if self._announcer is not None:
            await self._announcer.close()

    def take_over(self, term: int) -> None:
        """The election made this peer the coordinator of ``term``: plan (which may ship slices:
        its own task, so that the election's heartbeats go on meanwhile), then serve."""
        self._coordinating = self._tasks.spawn(self._become(term), "coordinate")

    async def step_down(self) -> None:
        """Another peer coordinates, or none: stop planning, fail what is in flight (its rows are
        recomputed here), close the API in the background. Returns at once (the election awaits it)."""
        if self._coordinating is not None:
            self._coordinating.cancel()
            self._coordinating = None
        if not self._drop_dispatch("this peer is no longer the coordinator"):
            return
        self.node.set_placement(None)
        log.info("stepped down: no longer the coordinator (term %d now)", self.election.term)
        self._api.close_soon(self._tasks)

    def lead_state(self, term: int) -> bool | None:
        """The election's word on ``term`` (:meth:`ElectionDriver.lead_state`), for the token loop."""
        return self.election.lead_state(term)

    async def _become(self, term: int) -> None:
        if self.model is None:
            return
        plan = self._new_plan()
        await self._announce(plan)
        if not self.election.leads(term):
            return  # deposed while announcing
        self._start_dispatch(plan)
        self._start_stages()
        log.info("coordinator of term %d: plan v%d over %d worker(s)", plan.term, plan.version, self._n_workers(plan))
        self.node.record("coordinator changed", self.node.peer_id, self.node.name, f"this peer, term {term}")
        if self._serve_api:
            await self._open_api(term)
        self.node.update_placement(self._api.fields())
        if {w.peer_id for w in self._workers()} != self._planned:
            self._schedule_replan()  # peers came or went while this plan was being shipped

    # ------------------------------------------------------------------ membership
    def admitted(self, link: Link) -> None:
        """A Python peer became a member: serve its chunk requests (should it need slices), plan it in."""
        if self._announcer is not None:
            self._announcer.attach(link)
        if self.ffn is not None:
            self._schedule_replan()

    def _link_up(self, link: Link) -> None:
        """A new link (a peer that restarted, maybe on other hardware or with other settings, or
        one that linked again): what its old answers showed of its speed no longer counts — the
        next plan prices it by its new hello until it answers again (once a restarted peer kept
        its old speed in every plan and in status)."""
        if link.peer_id is not None:
            for backend in self._backends():
                backend.measure_afresh(link.peer_id)
        self._browser_up(link)

    def _browser_up(self, link: Link) -> None:
        """Browser peers link to the coordinator only: they compute but do not vote."""
        if link.hello is not None and link.hello.peer_kind == "browser":
            self.admitted(link)

    def _link_down(self, peer: str) -> None:
        """A link went down: a peer that closed it (one that leaves does, at Ctrl-C or SIGTERM) is
        said to leave, in an INFO line, and gets no more work; a lost one fails what it had in
        flight (a warning, and it is marked down for ``READMIT_S``). Either way, a new plan."""
        if self.ffn is None:
            return
        left = self.node.closed_by_peer(peer)
        if left:
            name = self.node.known.get(peer, ("", ""))[0]
            log.info("peer %s (%s) closed its link (it is leaving, or it gave this link up); its work goes to "
                     "the others from the next plan", name or "?", peer)
            # A second close within FLAP_S: out of plans for READMIT_S as a lost one is (no warning,
            # no event): a peer that closes its link for a fault of its own and links again at once
            # must not flap the plans. A first one (a leave, a restart) costs nothing more.
            now = time.monotonic()
            if now - self._left_at.get(peer, now - FLAP_S) < FLAP_S:
                self._failed_at[peer] = now
            self._left_at[peer] = now
            self._left_at = {p: t for p, t in self._left_at.items() if now - t < FLAP_S}
        self._peer_down(peer, "it closed its link (leaving)" if left else "link closed", left)
        self._schedule_replan()

    async def resend_plan(self, peer: str) -> None:
        """``peer`` refused a request of the plan in use as not accepted: send it that plan again. Not
        when a newer plan is on its way: it has that one, and the old one would be refused as stale."""
        link, ffn = self.node.links.get(peer), self.ffn
        if link is not None and ffn is not None and ffn.pending_plan is None:
            await self._announcer.resend(link, ffn.plan)

    def mark_down(self, peer: str) -> None:
        """``peer`` is out of every plan for ``READMIT_S`` from now; one new plan if the newest has it
        (a mark-down from a sequence under an older layout, or the other dispatcher, changes nothing)."""
        self._failed_at[peer] = time.monotonic()
        link = self.node.links.get(peer)
        self.node.record("marked down", peer, link.hello.name if link is not None and link.hello else "",
                         "late, gone or wrong: its rows are recomputed here")
        if peer in self._planned:
            self._schedule_replan()

    # ------------------------------------------------------------------ plans
    async def _check_plan_forever(self) -> None:
        """Re-plan when the peers that can work are not those of the last plan: a failed peer whose
        ``READMIT_S`` passed and that is reachable again gets work back (no event would say so)."""
        while True:
            await asyncio.sleep(PLAN_CHECK_S)
            if self.ffn is not None and not self.replan_pending and {w.peer_id for w in self._workers()} != self._planned:
                self._schedule_replan()
            self._watch_load()

    def _watch_load(self) -> None:
        """Feed the sequences the API runs to the planner; re-plan when they change its choice."""
        running = self._api.running()
        if running is None or self.planning is None or self.ffn is None:
            return
        sequences = self._load.observe(time.monotonic(), running, self.planning.choice_for)
        if sequences is not None:
            log.info("%d sequences served at once: re-planning for them", sequences)
            self.planning.sequences = sequences
            self._schedule_replan()

    def _schedule_replan(self) -> None:
        if not self.replan_pending:
            self.replan_pending = True
            self._tasks.spawn(self._replan(), "replan")

    async def _replan(self) -> None:
        await asyncio.sleep(0)  # several link events in one go → one new plan
        term = self.election.term
        while self.election.stalled() and self.ffn is not None:
            # Woken from a stall: the links it dropped and the members it counts as unreachable
            # are its own silence, not theirs, and another peer may lead by now. A plan from that
            # view would be over no one (and warn that the swarm holds none of the model); the
            # election soon says whether this peer still leads.
            await asyncio.sleep(STALL_RECHECK_S)
        self.replan_pending = False
        if self.ffn is None or not self.election.leads(term):
            return
        plan = self._new_plan()
        await self._announce(plan)  # sent (queued in order) before any request that uses it
        if self.ffn is not None:
            self._use_plan(plan)
            self._start_stages()
            log.info("plan v%d over %d worker(s), from the next step", plan.version, self._n_workers(plan))

    def _n_workers(self, plan: Plan) -> int:
        """How many workers ``plan`` and its stages give work (under stages, those of the stages)."""
        return len(plan_workers(plan, self.planning.stage_layout))

    def _workers(self) -> list[PeerCapacity]:
        out = []
        now = time.monotonic()
        self._other_numerics &= self.node.links.keys()  # a peer that left is noted again if it returns
        for peer, link in self.node.links.items():
            h = link.hello
            if (h is None or h.model_hash not in (self.model_hash, None)
                    or self.election.is_refused(peer) or h.memory_budget <= 0):
                continue
            if self._marked_down(peer, now):
                continue  # marked down: out of every plan for a while (whatever a new plan cleared), then tried again
            if h.peer_kind == "python" and not self.election.reachable(peer):
                continue  # silent (a killed process whose link has not timed out yet), or gone
            if not self._computes_ours(h.build):
                self._note_other_numerics(peer, h)
                continue
            out.append(PeerCapacity(peer, h.memory_budget, h.ffn_gflops, link.rtt_s or 0.0, h.peer_kind,
                                    gpu_memory=h.gpu_memory or None))  # 0: none given
        return out

    def _computes_ours(self, build: NumericBuild) -> bool:
        """Whether a peer of numeric build ``build`` may get work here: one of this coordinator's
        numerics, and under int8 one of its own build too, or a GPU peer where the model's FFN
        blocks have the GPU's int8 GEMVs (:func:`~swarm.peer.weights.sizes.int8_gpu_refusal`).
        Answers of the coordinator's build are checked bit for bit, an int8 GPU peer's by the int8
        rows of its down products (:func:`~swarm.compute.int8_swiglu.check_int8_answer`), others
        within a bound of float reassociation (bounds.py), which the rounding of 8-bit activations
        exceeds: a peer of other numerics would be stopped for honest answers (docs/weights.md,
        "Two numerics"). Ours is the build this coordinator computes with: its CPU's
        (``Node.cpu_build``), also when it is a GPU peer, whose Hello names its wgpu build. Left
        out, it is never marked down."""
        ours = self.node.cpu_build
        if build.numerics != ours.numerics:
            return False
        return ours.numerics == "float32" or build == ours or (_int8_gpu(build) and self._x8_refusal(build) is None)

    def _x8_refusal(self, build: NumericBuild) -> str | None:
        """Why this model's FFN blocks cannot go to a GPU peer of the int8 numerics of ``build``
        (None: they can), by the types its Hello's ``x8:`` names (:func:`int8_gpu_refusal`)."""
        types = frozenset(f.upper() for f in build.named("x8:"))
        if types not in self._x8_refusals:
            self._x8_refusals[types] = int8_gpu_refusal(self.model, types) if self.model is not None else "no model"
        return self._x8_refusals[types]

    def _note_other_numerics(self, peer: str, hello: Hello) -> None:
        """Record once that ``peer`` gets no work for its numerics: an event ("left out": ``status
        --watch`` and ``--json``, the dashboard, ``join``'s terminal) and a warning in the log."""
        if peer in self._other_numerics:
            return
        self._other_numerics.add(peer)
        ours = self.node.hello.build.numerics
        theirs = hello.build.numerics
        b = hello.build
        why = (f"it computes {theirs}, this coordinator {ours}" if theirs != ours
               else f"a GPU peer of the int8 numerics, which cannot serve this model: {self._x8_refusal(b)}"
               if _int8_gpu(b)
               else f"another build of the {ours} numerics ({b.package}, numpy {b.numpy}, {b.blas}, {b.arch}), "
                    "whose int8 answers this coordinator cannot check bit for bit")
        self.node.record("left out", peer, hello.name, why)
        log.warning("peer %s (%s) gets no work: %s", hello.name, peer, why)

    def _marked_down(self, peer: str, now: float) -> bool:
        """Whether ``peer`` failed a request less than ``READMIT_S`` before ``now`` (monotonic s)."""
        return now - self._failed_at.get(peer, now - READMIT_S) < READMIT_S

    def _new_plan(self) -> Plan:
        workers = self._workers()
        self._planned = {w.peer_id for w in workers}
        holders = {p for p, link in self.node.links.items() if link.hello is not None  # int8 GPU peers: ranges only
                   and link.hello.model_hash == self.model_hash and not _int8_gpu(link.hello.build)}
        h = self.node.hello
        plan = self.planning.new_plan(self.election.term, h.memory_budget, h.ffn_gflops, workers, holders,
                                      *self._observations())
        self._standby = self._standby_notices(plan, workers, holders)
        return plan

    def _standby_notices(self, plan: Plan, workers: list[PeerCapacity], holders: set[str]) -> dict[str, Standby]:
        """Why ``plan`` gives each linked page without work none (:mod:`~swarm.peer.coordinator.standby`)."""
        pages = [p for p, link in self.node.links.items() if link.hello is not None and link.hello.peer_kind == "browser"]
        now = time.monotonic()
        python = [w for w in workers if w.kind == "python" and w.peer_id in holders]
        planning, shape = self.planning, self.shape
        assert planning is not None and shape is not None  # a plan was made: this peer has the model
        return standby.notices(
            plan, pages, {w.peer_id: w for w in workers}, layout=planning.layout,
            choice=(planning.cost_report or {}).get("choice") if planning.layout != "ranges" else None,
            shape=shape, python_peers=1 + len(python),
            python_bytes=self.node.hello.memory_budget + sum(w.memory_bytes for w in python),
            marked_down={p for p in pages if self._marked_down(p, now)},
            other_numerics=self._other_numerics, numerics=self.node.hello.build.numerics)

    async def _announce(self, plan: Plan) -> None:
        """Offer workers their slices, send them the plan and its stages, and each page without
        work why it stands by; status shows them."""
        await self._announcer.announce(plan, self.planning.stage_layout, {**self._api.fields(), **self.planning.status()},
                                       self._standby)

    # ------------------------------------------------------------------ stages
    def set_layout(self, layout: str) -> None:
        """Use ``layout`` from the next plan on (a coordinator re-plans now; sequences in flight keep
        theirs). LocalProtocolError for a name not in :data:`~swarm.peer.coordinator.planning.LAYOUTS`."""
        check_layout(layout)
        if self.planning is not None:
            self.planning.set_layout(layout)
        if self.ffn is not None:
            self._schedule_replan()

    def _start_stages(self) -> None:
        """Dispatch the newest plan's stages (none under ranges); the API follows."""
        self._use_stages(self.planning.stages_to_run(self.election.term))
        if self.stages is not None:
            self.stages.set_pricer(self.planning.pricer())
        self._api.set_ffn(self.engine_ffn)

    # ------------------------------------------------------------------ the API
    @property
    def api(self) -> ApiServer | None:
        return self._api.api

    @property
    def api_port(self) -> int | None:
        """The port the API serves on while this peer coordinates (None otherwise)."""
        return self._api.port

    async def _open_api(self, term: int) -> None:
        await self._api.open(term, self.engine_ffn)

    async def _close_api(self) -> None:
        await self._api.close()


def _int8_gpu(build: NumericBuild) -> bool:
    """Whether ``build`` is a GPU peer's of the int8 numerics (``join --gpu --numerics int8``): it
    serves FFN ranges with the GPU's int8 GEMVs; its stages would compute float32 attention, so
    it gets none."""
    return build.numerics == "int8" and build.gpu_adapter is not None
