"""The coordinator's next plan: its layout (per-layer ranges, stages, a mix of both, or whichever
the cost model prices fastest), the cost model's inputs — the peers' hellos and what their answers
showed (the dispatchers' :class:`~swarm.peer.coordinator.tracker.Observations`) — the
coordinator's budget, and the placement (:func:`~swarm.peer.coordinator.planner.build_plan`).
Pure: the role hands it the peers and the observations, and sends what it returns.

The load: under ``auto`` the cost model prices a plan for the sequences served at once
(:attr:`Planning.sequences`). :class:`LoadWatch`, fed the running sequences and the time, says
when a new count changes the layout chosen — the most sequences over ``LOAD_WINDOW_S``, the
changed choice held ``LOAD_HOLD_S``, at most one such re-plan per ``LOAD_REPLAN_GAP_S`` — so a
load that comes and goes does not re-plan at every request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import TYPE_CHECKING, Any

from swarm.errors import LocalProtocolError
from swarm.peer.coordinator import costmodel
from swarm.peer.coordinator.costmodel import MESSAGE_OVERHEAD_S, GroupPricer, LayerCosts, PeerCost, observed_gflops
from swarm.peer.coordinator.planner import PeerCapacity, build_plan, shortfall
from swarm.peer.coordinator.tracker import Observations
from swarm.peer.plan import ModelShape, Plan, Stage, StageLayout, gpu_holds, held_bytes, plan_workers, split_layers

if TYPE_CHECKING:
    from swarm.compute.model import Model

log = logging.getLogger(__name__)

LAYOUTS = ("ranges", "stages", "mix", "auto")
LOAD_WINDOW_S = 10.0  # the load planned for: the most sequences running at once over this window (seconds)
LOAD_HOLD_S = 5.0  # a layout choice changed by the load must hold this long before it re-plans (seconds)
LOAD_REPLAN_GAP_S = 30.0  # at least this long between two re-plans for the load (seconds)


def check_layout(layout: str) -> str:
    """``layout`` if it names one; LocalProtocolError naming the choices otherwise."""
    if layout not in LAYOUTS:
        raise LocalProtocolError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    return layout


def choose_stages(mode: str, costs, coord, workers, range_only=(), sequences: int = 1
                  ) -> tuple[tuple[Stage, ...] | None, dict]:
    """The stages of the next plan, or None for per-layer ranges; and the cost report (its
    ``choice`` is ``"mix"`` when the coordinator's stage's FFN is to be cut into ranges).

    ``mode``: ``"stages"`` splits the layers over the coordinator and ``workers`` in proportion
    to their speed — where that puts a peer past its memory (weights, KV cache, activations:
    :func:`~swarm.peer.coordinator.costmodel.stage_fit`), each peer as many layers as it holds
    instead, and ranges when no stage layout fits; ``"mix"`` takes the cost model's best mix
    (the coordinator's stage ``0 .. k-1`` with its FFN cut into ranges over every peer,
    whole-layer stages of the workers after it), or the fastest placement when no mix fits;
    ``"auto"`` takes the fastest placement that fits by the cost model
    (:func:`swarm.peer.coordinator.costmodel.choose`; the coordinator alone is one stage of all
    layers): local, ranges, stages or mix.
    ``costs``: :class:`~swarm.peer.coordinator.costmodel.LayerCosts`; ``coord``, ``workers``:
    :class:`~swarm.peer.coordinator.costmodel.PeerCost` (workers that hold the model);
    ``range_only``: peers that can take FFN ranges only (browser pages, peers without the model
    file), priced under ranges alone. ``sequences``: how many sequences run at once; above one,
    ``"auto"`` may split a model the coordinator holds into pipelined stages for throughput
    (:func:`~swarm.peer.coordinator.costmodel.choose`; the choice's ``note`` says why). Raises
    LocalProtocolError for another mode.
    """
    best, estimates = _best(mode, costs, coord, workers, range_only, sequences)
    return _stages_and_report(mode, costs, coord, workers, range_only, sequences, best, estimates)


def _stages_and_report(mode: str, costs, coord, workers, range_only, sequences: int, best, estimates
                       ) -> tuple[tuple[Stage, ...] | None, dict]:
    """:func:`choose_stages`'s answer for ``best`` of ``estimates``."""
    report = costmodel.report(costs, coord, [*workers, *range_only], best, estimates)
    report["mode"] = mode
    report["sequences"] = sequences
    if best.note:
        report["why"] = best.note
    if best.layout == "ranges":
        return None, report
    return tuple(Stage(p, lo, hi) for p, lo, hi in best.stages), report


def _best(mode: str, costs, coord, workers, range_only, sequences: int) -> tuple[costmodel.Estimate, list]:
    """(the estimate :func:`choose_stages` takes, every estimate priced)."""
    if mode not in ("stages", "mix", "auto"):
        raise LocalProtocolError(f"layout {mode!r}: stages are planned for 'stages', 'mix' or 'auto' only")
    best, estimates = costmodel.choose(costs, coord, workers, range_only=range_only,
                                       sequences=sequences if mode == "auto" else 1)
    if mode == "stages":
        split = split_layers(costs.n_layers, [coord.peer_id, *(w.peer_id for w in workers)],
                             [coord.gflops, *(w.gflops for w in workers)])
        best = costmodel.estimate_stages(costs, coord, workers, tuple((s.peer, s.start, s.stop) for s in split))
        estimates = [*estimates, best]
        if not best.fits:  # a split by speed past someone's memory: each peer as many layers as it holds
            best = next(e for e in estimates if e.layout == "stages")
        if not best.fits:  # no stage layout fits: ranges, the coordinator streaming what nobody holds
            best = next(e for e in estimates if e.layout == "ranges")
    mix = next(e for e in estimates if e.layout == "mix")
    if mode == "mix" and mix.fits:
        best = mix
    return best, estimates


def choose_ways(mode: str, costs, coord, workers, range_only=(), sequences: int = 1,
                cpu_gflops: Mapping[str, float] | None = None) -> tuple[tuple[Stage, ...] | None, dict, list, list]:
    """:func:`choose_stages` with each GPU peer of ``cpu_gflops`` (peer → its CPU's speed, GFLOP/s)
    priced both ways: as given (its GPU: room within its ``gpu_memory``, its GPU's speed) and
    ``on_cpu`` (its host allowance, that speed; :class:`~swarm.peer.coordinator.costmodel.PeerCost`).
    Peer by peer, the CPU way is kept where the placement then fits and the others do not, or
    prices faster. Returns (stages, report, ``workers`` and ``range_only`` as priced)."""
    holders, others = list(workers), list(range_only)
    best, estimates = _best(mode, costs, coord, holders, others, sequences)
    for side in (holders, others):
        for i, w in enumerate(side):
            speed = (cpu_gflops or {}).get(w.peer_id)
            if speed is None or w.gpu_memory is None:
                continue
            side[i] = dataclasses.replace(w, gflops=speed, on_cpu=True, observed=False)
            trial, priced = _best(mode, costs, coord, holders, others, sequences)
            if (not trial.fits, trial.decode_s, trial.prefill_s) < (not best.fits, best.decode_s, best.prefill_s):
                best, estimates = trial, priced
            else:
                side[i] = w
    stages, report = _stages_and_report(mode, costs, coord, holders, others, sequences, best, estimates)
    return stages, report, holders, others


class Planning:
    """The plans of the coordinator ``peer_id`` for ``model`` (its ``shape``: the encoded sizes):
    the ``layout`` asked for, and the newest plan's ``version``, ``stage_layout`` (None: ranges),
    ``cut_layers`` (a mix: the coordinator's stage, whose FFN is cut into ranges; None: all),
    ``shortfall`` (what it lacks, :func:`~swarm.peer.coordinator.planner.shortfall`) and
    ``cost_report`` (the cost model's inputs and prices, for ``status --json``)."""

    def __init__(self, model: Model, shape: ModelShape, peer_id: str, layout: str = "ranges") -> None:
        self.model, self.shape, self.peer_id = model, shape, peer_id
        self.layout = check_layout(layout)
        self.version = 0
        self.stage_layout: StageLayout | None = None
        self.cut_layers: range | None = None
        self.shortfall: dict | None = None
        self.cost_report: dict | None = None
        # GPU peers whose newest plan's work passes their GPU (gpu_holds): they compute it on their CPU
        self.on_cpu: frozenset[str] = frozenset()
        self.costs = LayerCosts.from_model(model) if layout != "ranges" else None
        # sequences served at once, as the serving side last reported (1: price for one user);
        # under "auto", several may split a model the coordinator holds into pipelined stages
        self.sequences = 1
        self._priced: tuple | None = None  # the last plan's cost-model inputs (choice_for)
        self._priced_workers: tuple[PeerCost, tuple[PeerCost, ...]] | None = None  # and its peers as chosen (pricer)
        self._choices: dict[int, Hashable] = {}  # sequences → choice_for's answer under those inputs

    def set_layout(self, layout: str) -> None:
        """Use ``layout`` from the next plan on; LocalProtocolError for another name."""
        self.layout = check_layout(layout)
        if layout != "ranges" and self.costs is None:
            self.costs = LayerCosts.from_model(self.model)

    def new_plan(self, term: int, memory_budget: int, gflops: float, workers: list[PeerCapacity],
                 holders: Collection[str], in_use: Plan | None = None, ranges: Observations | None = None,
                 stages: Observations | None = None) -> Plan:
        """The next plan of ``term`` over the coordinator (its hello's ``memory_budget`` and
        ``gflops``) and ``workers``; ``holders``: the peers with the model file (they may run
        stages); ``in_use`` and ``ranges``: the plan RemoteFFN runs and what its answers showed,
        ``stages``: what the stage answers showed (None: none yet)."""
        self.version += 1
        me = PeerCapacity(self.peer_id, 0, gflops)
        takers = self._plan_layout(term, memory_budget, gflops, workers, holders, in_use, ranges, stages)
        lay = self.stage_layout
        stage_workers = len(lay.workers()) if lay is not None else 0
        own = {i for s in lay.stages if s.peer == self.peer_id for i in range(s.start, s.stop)} if lay else None
        own_layers = len(own) if own is not None else None
        # Our allowance less what only we hold (embeddings, attention, routers, norms, head), the KV
        # cache and activations. Under stages the attention of the workers' layers is not ours to
        # keep (the cost model's rule).
        not_run = sum(b for i, b in enumerate(self._layer_costs().attn_bytes) if i not in own) if own is not None else 0
        budget = self.shape.coordinator_weight_budget(memory_budget, stage_workers, own_layers, not_run)
        cut: Collection[int] | None = self.cut_layers
        if own is not None and cut is None:
            # Whole stages: the budget covers the coordinator's own stages' FFN; the workers' layers
            # run here only after a stage fails (from the mapped file), outside the budget.
            cut = sorted(own)
        plan = build_plan(self.shape, me, takers, term=term, version=self.version, coordinator_budget=budget, layers=cut)
        self.shortfall = shortfall(plan, self.shape, coordinator_allowance=memory_budget, worker_stages=stage_workers,
                                   kv_layers=own_layers, not_run_bytes=not_run)
        if self.shortfall:
            log.warning("plan v%d: %s", plan.version, self.shortfall["message"])
        self.on_cpu = frozenset(w.peer_id for w in workers if not self._on_gpu(w, plan))
        return plan

    def _on_gpu(self, w: PeerCapacity, plan: Plan) -> bool:
        """Whether ``w`` computes each part of its work in ``plan`` and the stage layout — its stage,
        its FFN ranges — on its GPU, by the rule its worker applies (:func:`swarm.peer.plan.gpu_holds`)."""
        lay, c = self.stage_layout, self._layer_costs
        stage = sum(c().stage_bytes(i) for s in (lay.stages if lay else ()) if s.peer == w.peer_id
                    for i in range(s.start, s.stop))
        ranges = plan.bytes_of(w.peer_id, self.shape, w.kind)
        return all(gpu_holds(b, w.gpu_memory, self.shape.step_bytes) for b in (stage, ranges))

    def _plan_layout(self, term: int, memory_budget: int, gflops: float, workers: list[PeerCapacity],
                     holders: Collection[str], in_use: Plan | None, ranges: Observations | None,
                     stages: Observations | None) -> list[PeerCapacity]:
        """Choose the next plan's layout: sets the stage layout (None: per-layer ranges), the
        layers whose FFN is cut (a mix: the coordinator's stage; None: all) and the cost report;
        returns the workers that get FFN ranges (none under stages; under a mix each with the
        memory its stage leaves)."""
        self.stage_layout = self.cut_layers = None
        if self.layout == "ranges":
            cpu = self._cpu_gflops(gflops, [w.ffn_speed for w in workers if w.kind == "python" and w.gpu_memory is None])
            return [self._range_way(w, cpu) for w in workers]
        holding = [w for w in workers if w.kind == "python" and w.peer_id in holders]
        m = self.model
        own = m.embed.nbytes + (0 if m.head is m.embed else m.head.nbytes)
        me = PeerCost(self.peer_id, max(memory_budget - own, 0), gflops)
        mine = stages.local_s_per_row_layer if stages is not None else None
        seen_here = observed_gflops(self._layer_flops(), mine)  # our own layers, in the unit the workers' are priced in
        if seen_here is not None:
            me = PeerCost(me.peer_id, me.memory_bytes, seen_here, observed=True)
        costs: list[PeerCost] = []
        range_only: list[PeerCost] = []
        cpu_seen: dict[str, float] = {}  # GPU peers whose answers timed their CPU (the last plan put them there)
        for w in workers:  # a peer that cannot run a stage (a page, no model file) still takes ranges
            gflops_w, seen = self._speed(w.peer_id, w.ffn_speed, in_use, ranges, stages)
            if seen and w.gpu_memory is not None and w.peer_id in self.on_cpu:
                cpu_seen[w.peer_id], gflops_w, seen = gflops_w, w.ffn_speed, False
            o = stages.of(w.peer_id) if stages is not None else None
            overhead = o.overhead_s if o is not None and o.overhead_s is not None else MESSAGE_OVERHEAD_S
            (costs if w in holding else range_only).append(PeerCost(
                w.peer_id, w.memory_bytes, gflops_w, w.rtt_s, observed=seen, overhead_s=overhead,
                gpu_memory=w.gpu_memory))
        speed = {c.peer_id: c.gflops for c in [*costs, *range_only]}
        cpu = self._cpu_gflops(me.gflops, [speed[w.peer_id] for w in workers
                                           if w.kind == "python" and w.gpu_memory is None])
        cpu_gflops = {w.peer_id: cpu_seen.get(w.peer_id, cpu) for w in workers
                      if w.kind == "python" and w.gpu_memory is not None}
        self._priced, self._choices = (self.layout, me, tuple(costs), tuple(range_only), cpu_gflops), {}
        chosen, self.cost_report, priced, priced_ro = choose_ways(self.layout, self._layer_costs(), me, costs,
                                                                  range_only, self.sequences, cpu_gflops)
        self._priced_workers = (me, tuple(priced))  # as chosen: a GPU peer on its CPU priced so
        on_cpu = {c.peer_id for c in [*priced, *priced_ro] if c.on_cpu}
        takers = [dataclasses.replace(w, gpu_memory=None, ffn_speed=cpu_gflops[w.peer_id]) if w.peer_id in on_cpu
                  else w for w in workers]
        if chosen is None:
            return takers
        self.stage_layout = StageLayout(term, self.version, self.peer_id, chosen)
        if self.cost_report.get("choice") != "mix":
            return []
        first = chosen[0]  # a mix: the coordinator's stage comes first, its FFN cut over the holders
        self.cut_layers = range(first.start, first.stop)
        held = {s.peer: sum(self._layer_costs().stage_bytes(i) for i in range(s.start, s.stop)) for s in chosen[1:]}
        left = lambda w, b: max(b - held.get(w.peer_id, 0), 0)  # noqa: E731  (bytes its stage leaves)
        return [dataclasses.replace(w, memory_bytes=0 if w.peer_id in on_cpu else left(w, w.memory_bytes),
                                    gpu_memory=None if w.gpu_memory is None else left(w, w.gpu_memory))
                for w in takers if w.peer_id in {h.peer_id for h in holding}]

    @staticmethod
    def _cpu_gflops(coordinator: float, cpu_peers: list[float]) -> float:
        """What a GPU peer's CPU is priced at (GFLOP/s) until its answers time it (its hello gives
        its GPU's speed only): the slowest of the coordinator and ``cpu_peers``, the speeds of the
        Python peers without a GPU limit."""
        return min([coordinator, *cpu_peers])

    def _range_way(self, w: PeerCapacity, cpu_gflops: float) -> PeerCapacity:
        """Under ``ranges`` (no cost model): a GPU peer whose GPU holds not one expert nor one block
        of MLP columns takes ranges on its CPU (its host allowance, ``cpu_gflops``); others as given."""
        s = self.shape
        if w.kind != "python" or w.gpu_memory is None:
            return w
        units = [b for b in (s.expert_bytes if s.moe_layers else 0,
                             s.column_bytes * s.dense_block if s.dense_layers else 0) if b]
        if s.worker_weight_budget(w.memory_bytes, w.gpu_memory) >= min(units, default=0):
            return w
        return dataclasses.replace(w, gpu_memory=None, ffn_speed=cpu_gflops)

    def choice_for(self, sequences: int) -> Hashable:
        """What the last plan's layout choice would be with ``sequences`` running (the layout and
        its stages), from that plan's inputs; the same for every count under a layout other than
        ``auto`` or before the first plan (the load changes nothing there)."""
        if self._priced is None or self._priced[0] != "auto":
            return None
        if sequences not in self._choices:
            _, me, costs, range_only, cpu_gflops = self._priced
            chosen, report, _, _ = choose_ways("auto", self._layer_costs(), me, list(costs), list(range_only), sequences,
                                               cpu_gflops)
            self._choices[sequences] = (report.get("choice"), chosen)
        return self._choices[sequences]

    def pricer(self) -> GroupPricer | None:
        """The price of a round of groups through the newest plan's stages, from the peers as that
        plan priced them when it chose (a GPU peer computing on its CPU at its CPU's speed:
        :class:`~swarm.peer.coordinator.costmodel.GroupPricer`); None without stages on other
        peers, under a mix (its first stage's FFN is cut over the holders, which this price does
        not model) or before a plan."""
        lay = self.stage_layout
        if self._priced_workers is None or lay is None or len(lay.stages) < 2 or self.cut_layers is not None:
            return None
        me, costs = self._priced_workers
        priced = {c.peer_id for c in (me, *costs)}
        if any(s.peer not in priced for s in lay.stages):
            return None
        return GroupPricer(self._layer_costs(), me, costs, [(s.peer, s.start, s.stop) for s in lay.stages])

    def _layer_costs(self) -> LayerCosts:
        if self.costs is None:
            self.costs = LayerCosts.from_model(self.model)
        return self.costs

    def _layer_flops(self) -> float:
        """FLOPs of one row through one average layer (attention and FFN)."""
        costs = self._layer_costs()
        return (sum(costs.attn_flops) + sum(costs.ffn_flops)) / costs.n_layers

    def _speed(self, peer: str, claimed: float, in_use: Plan | None, ranges: Observations | None,
               stages: Observations | None) -> tuple[float, bool]:
        """(GFLOP/s, observed?): from its answers (stage or FFN) when it gave any, else its hello's figure."""
        o = stages.of(peer) if stages is not None else None
        seen = observed_gflops(self._layer_flops(), o.s_per_row_layer) if o is not None else None
        if seen is not None:
            return seen, True
        o = ranges.of(peer) if ranges is not None else None
        if o is not None and o.s_per_row and in_use is not None:  # its FFN answers: FLOPs of one row of its share
            c, plan = self.model.config, in_use
            span = next((plan.dense_span(layer, peer) for layer in plan.dense if plan.dense_span(layer, peer)), None)
            width = len(span) if span else (c.moe_intermediate_size if plan.experts else 0)
            seen = observed_gflops(2.0 * 3 * c.hidden_size * width, o.s_per_row)
            if seen is not None:
                return seen, True
        return claimed, False

    def stages_to_run(self, term: int) -> StageLayout | None:
        """The stage layout to dispatch: the newest plan's, or under a layout other than ranges
        that chose ranges, the coordinator alone as one stage of every layer; None under ranges."""
        if self.layout == "ranges":
            return None
        me = self.peer_id
        return self.stage_layout or StageLayout(term, self.version, me, (Stage(me, 0, self.model.config.n_layers),))

    def status(self) -> dict[str, Any]:
        """What status shows of the newest plan besides its spans: what it lacks (if anything) and,
        under a layout other than ranges, the layout it took, its stages and the cost report; ``on_cpu``:
        the GPU peers that compute their work on their CPU (it passes their GPU memory)."""
        out: dict[str, Any] = {"shortfall": self.shortfall} if self.shortfall else {}
        if self.on_cpu:
            out["on_cpu"] = sorted(self.on_cpu)
        if self.layout != "ranges":
            lay = self.stage_layout
            out.update({"layout": ("mix" if self.cut_layers else "stages") if lay else "ranges",
                        "stages": [[s.peer, s.start, s.stop] for s in lay.stages] if lay else [],
                        "cost": self.cost_report})
        return out


def observed(plan: Plan, shape: ModelShape, seen: Observations, layout: StageLayout | None = None,
             stage_seen: Observations | None = None) -> dict[str, Any]:
    """What the coordinator measured, per peer of ``plan`` and its stage ``layout`` (its peers,
    then the stage workers: :func:`~swarm.peer.plan.plan_workers`): FFN weight bytes held
    (:func:`~swarm.peer.plan.held_bytes`), ms per row of FFN work and, of a stage, ms per row and
    layer (averages over recent answers), requests and failures, of ranges (``seen``) and stages
    (``stage_seen``) together (``status --json``)."""
    peers = {}
    for peer in dict.fromkeys((*plan.peers, *plan_workers(plan, layout))):
        o = seen.of(peer)
        so = stage_seen.of(peer) if stage_seen is not None else None
        peers[peer] = {"weight_bytes": held_bytes(plan, layout, peer, shape),
                       "ms_per_row": round(o.s_per_row * 1e3, 4) if o is not None and o.s_per_row else None,
                       "ms_per_row_layer": (round(so.s_per_row_layer * 1e3, 4)
                                            if so is not None and so.s_per_row_layer else None),
                       "requests": sum(x.requests for x in (o, so) if x is not None),
                       "failed": peer in seen.failed or (stage_seen is not None and peer in stage_seen.failed)}
    return {"peers": peers}


class LoadWatch:
    """When the load served changes the plan (module docstring). Pure: :meth:`observe` is fed
    the time and the sequences running; ``planned``: the count the newest plan was priced for."""

    def __init__(self) -> None:
        self.planned = 1
        self._seen: deque[tuple[float, int]] = deque()  # (now s, sequences running)
        self._changed_since: float | None = None  # when the choice first differed from the plan's
        self._replanned_at: float | None = None

    def observe(self, now: float, running: int, choice: Callable[[int], Hashable]) -> int | None:
        """Record ``running`` sequences at ``now`` (monotonic s); the count to plan for when the
        load changes the layout ``choice`` (a count → the choice it gives) and has held
        ``LOAD_HOLD_S``, ``LOAD_REPLAN_GAP_S`` after the last such re-plan; None otherwise."""
        self._seen.append((now, running))
        while self._seen and self._seen[0][0] < now - LOAD_WINDOW_S:
            self._seen.popleft()
        load = max(1, max(n for _, n in self._seen))
        if load == self.planned or choice(load) == choice(self.planned):
            self._changed_since = None
            return None
        if self._changed_since is None:
            self._changed_since = now
        if now - self._changed_since < LOAD_HOLD_S:
            return None
        if self._replanned_at is not None and now - self._replanned_at < LOAD_REPLAN_GAP_S:
            return None
        self.planned, self._changed_since, self._replanned_at = load, None, now
        return load
