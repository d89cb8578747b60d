"""The coordinator's side of layer stages: a peer runs a contiguous range of layers — attention
with its KV cache, and the layers' FFN/MoE — so a token crosses the LAN once per stage instead of
once per layer.

Theory of operation
-------------------
A :class:`~swarm.peer.plan.StageLayout` cuts the layers ``0 .. n_layers-1`` into contiguous :class:`Stage` s in
the order the hidden state visits them. The coordinator keeps the embeddings, the final norm,
the head and sampling: ``Model.forward`` embeds the tokens and hands the rows [T, H] to
:meth:`StagedFFN.run_layers`, which runs each stage in turn — its own with
``Model.layers`` (the FFN of those layers through ``inner``, e.g. a
:class:`~swarm.peer.coordinator.dispatch.RemoteFFN` that still hands expert and dense ranges out), a
worker's as one :class:`StageRequest` whose :class:`StageAnswer` carries the rows on (the
worker's side: :mod:`swarm.peer.worker.stages`). A stage runs the engine's own ``Model.layers`` on the same rows, so the logits are the local run's
bits. A step of several sequences (continuous batching: ``Model.forward_batch`` hands
:meth:`StagedFFN.run_layers_batch` the union of their rows) crosses each stage together: one
request per stage peer and step, a segment per sequence, attention per sequence on its own KV
cache and the rest on the union (``Model.layers_batch``), each row with its solo bits.
Everything that fails, misses or rebuilds stays per sequence.

Pipelining. With several sequences over several stages, a step's sequences are cut into groups
(contiguous, about equal rows; how many: :func:`~swarm.peer.coordinator.costmodel.pipeline_groups`,
or ``pipeline_groups`` when set) that cross the stages as a wavefront: one lane per stage takes
the groups in order, so group g is at stage s while group g+1 is at stage s-1 and every stage
peer computes while the others do. A group crosses a stage as a step did before: one request per
stage peer per group, its own sequences' segments. A sequence is in one group, and a group at
one stage at a time, so its records, its KV caches and its failover are as without groups; a
stage that fails for one group runs here for it (the coordinator's own layers and failovers one
group at a time), and the next group meets the same rule. One sequence is never split.

KV caches. Each stage keeps the keys/values of its layers per sequence, keyed by the sequence id
the coordinator gives each new cache; a stage that holds fewer positions than a request assumes
answers ``cache_gap`` and the coordinator resends the sequence from position 0.

Failover. The coordinator records, per sequence, the rows that entered each stage (``[L, H]``
f32 per stage boundary, a few MB for thousands of positions). A stage whose step does not come
back runs that step's layers on the coordinator (its mapped file holds them); before the first
such step the coordinator rebuilds those layers' KV cache by running the recorded rows through
them (whatever the capacity of the coordinator's cache: it grows then). What happens to the
peer follows the FFN ranges' rule (:class:`~swarm.peer.coordinator.tracker.RequestTracker`,
one for both): a link gone, a refusal or a malformed answer fails it at once (the owner re-plans); a
deadline follows its observed answer times, and its first request for a stage it has not
answered yet gets one for reading that stage's layers from disk; a missed deadline is counted
(its answer, should it come, is timed: slow, not gone), and fails it only at ``MISS_LIMIT``
in a row, at its first request for a stage or after ``SILENCE_S`` of silence — otherwise its
next step is sent to it again, with the rows it missed, once it is heard from: until then it
is suspect, and its steps run here at once, with no wait and no miss counted. A failed peer
stays failed for the sequences under older layouts until a layout has it again, so it is
marked down once, not at every step; a ``stale_term`` refusal (it does not
serve the layout: restarted, or the plan was lost) is "not ready": its layers run here, it is
probed every ``NOT_READY_RETRY_S`` and sent that sequence's stage plan again (through
``Dispatcher.send``). A sequence keeps the layout it started with (holders may fail
over, boundaries never move), so its recorded rows always match its stages; a new layout
applies to the next sequence.

Trust. With ``verify`` > 0 (``join --verify PERCENT``) that share of the rows of each stage
answer is re-run here through the stage's layers and compared — bit for bit for a peer of our
numeric build, within a bound for the others — against a lazily rebuilt shadow KV cache per
sequence and stage (:mod:`~swarm.peer.coordinator.stage_verify` says why and what it costs).
A mismatch discards the answer: the stage runs here for that step (as on a failover), the peer
is marked down by the tracker's rule and never trusted again (``RequestTracker.distrust``),
and the owner is told with the VerificationError's text, so the generation goes on with the
local run's tokens.

Threading is RemoteFFN's: ``run_layers`` runs in the token-loop thread, the dispatcher's ``send``
is a thread-safe non-blocking hand-off (a pipelined step's lanes call it from threads of their
own), and answers arrive through :meth:`StagedFFN.deliver` / :meth:`StagedFFN.peer_down` from
the event loop. Steps of separate batches may run at once on separate threads (one batch
scheduler per group, each stepping its own sequences, so a group need not wait for the others'
step to end): the records are per sequence, and the coordinator's own layers run one group at a
time. Request ids have the top bit set, so they never collide with RemoteFFN's on the same link.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from swarm.compute.ffn import FFNBackend, LocalFFN
from swarm.errors import LocalProtocolError, RemoteProtocolError, VerificationError
from swarm.peer.coordinator.dispatch import Dispatcher
from swarm.peer.coordinator.stage_verify import VERIFY_FAILED, Answered, Shadow, StageVerifier
from swarm.peer.coordinator.tracker import MISS_LIMIT, Missed, Pending, RequestTracker, confirm_lead, wait_answer
from swarm.peer.net.messages import Error, StageAnswer, StageRequest, StageSegment
from swarm.peer.plan import INLINE_ROWS, Stage, StageLayout

if TYPE_CHECKING:
    from swarm.compute.model import KVCache, Model
    from swarm.peer.coordinator.costmodel import GroupPricer

log = logging.getLogger(__name__)

F32 = np.float32
REQUEST_ID_BASE = 1 << 31  # stage request ids: top bit set, apart from RemoteFFN's


@dataclass
class _Sequence:
    """What the coordinator knows about one sequence under stages."""

    id: int
    layout: StageLayout
    inputs: dict[int, np.ndarray] = field(default_factory=dict)  # stage's first layer → buffer [≥ L, H]
    held: dict[int, int] = field(default_factory=dict)  # stage's first layer → positions L in its buffer
    local: dict[tuple[int, int], int] = field(default_factory=dict)  # (lo, hi) → positions in our cache
    remote: dict[tuple[str, int, int], int] = field(default_factory=dict)  # (peer, lo, hi) → positions it holds
    shadows: dict[tuple[int, int], Shadow] = field(default_factory=dict)  # (lo, hi) → --verify's KV cache

    def record(self, layer: int, start: int, x: np.ndarray) -> np.ndarray:
        """Keep ``x`` as positions ``start ..`` of the rows entering ``layer``; returns all [start+T, H]
        (a view of a buffer that grows by doubling: a step copies its own rows only, not the
        sequence so far)."""
        held = self.held.get(layer, 0)
        if held < start:
            raise LocalProtocolError(f"sequence {self.id}: rows entering layer {layer} before position {start} "
                                     "were never seen; start the sequence at position 0")
        end = start + x.shape[0]
        buf = self.inputs.get(layer)
        if buf is None or buf.shape[0] < end:
            grown = np.empty((max(end, 2 * (0 if buf is None else buf.shape[0]), 64), x.shape[1]), F32)
            if start and buf is not None:  # held ≥ start: the buffer holds them
                grown[:start] = buf[:start]
            buf = self.inputs[layer] = grown
        buf[start:end] = x
        self.held[layer] = end
        return buf[:end]


@dataclass
class _Part:
    """One sequence of a step on the coordinator: its rows as they cross the stages."""

    seq: _Sequence
    cache: KVCache
    start: int
    x: np.ndarray  # its rows entering the next stage [T, H]
    history: np.ndarray = field(default_factory=lambda: np.empty((0, 0), F32))  # every row that entered the current stage [start+T, H]


class StagedFFN:
    """The coordinator's backend for a stage layout (a :class:`~swarm.compute.ffn.LayerBackend`);
    see the module docstring.

    ``model``: the whole model (mapped); ``layout``: the stages; ``dispatcher``: the links
    (:class:`~swarm.peer.coordinator.dispatch.Dispatcher`; told once per failed stage peer);
    ``inner``: the FFN backend of the coordinator's own layers (default: the model's local one);
    ``verify``: share (0..1) of the rows of stage answers re-run here and compared ("Trust").
    """

    def __init__(self, model: Model, layout: StageLayout, dispatcher: Dispatcher, inner: FFNBackend | None = None, *,
                 verify: float = 0.0, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if layout.n_layers != model.config.n_layers:
            raise LocalProtocolError(f"stage layout covers {layout.n_layers} layers, the model has "
                                     f"{model.config.n_layers}")
        self.model = model
        self.layout = layout
        self.dispatcher = dispatcher
        self.inner = inner if inner is not None else LocalFFN(model)
        self.tracker = RequestTracker()  # the requests in flight and the failure rule (tracker.py)
        self.timing = self.tracker.timing  # peer → PeerTiming
        self.failed = self.tracker.failed  # peers given no more work until a layout has them again
        self.not_ready = self.tracker.not_ready  # peer → (term, version, next probe time)
        self.layer_timing = self.tracker.layer_timing  # each stage peer's compute, from its answers
        self.message_overhead = self.tracker.message_overhead  # peer → a short step's wait beyond RTT and compute
        self.warm: dict[str, set[tuple[int, int]]] = {}  # peer → the stages it has answered (loaded)
        self._layer_bytes: tuple[int, ...] | None = None  # weight bytes per layer (from the file's header)
        self.remote_steps = 0  # stage requests answered by peers
        self.rebuilt_positions = 0  # positions recomputed here to rebuild a failed stage's KV cache
        self._clock = clock
        self._ids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._sequences: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KVCache → _Sequence
        self._lock = threading.Lock()  # warm: the token loop and the event loop update it
        self.misses = 0  # stage steps recomputed here after a missed deadline (the peer kept)
        # groups a step of several sequences splits into, pipelined over the stages (None: the
        # cost model's choice, costmodel.pipeline_groups; 1: none, the stages one after the other)
        self.pipeline_groups: int | None = None
        self.schedulers = 1  # batch schedulers stepping through these stages at once (set_schedulers)
        # the planner's price of a round of groups through this layout's stages (set_pricer)
        self.pricer: GroupPricer | None = None
        self.pipelined_steps = 0  # steps whose sequences crossed the stages in groups, pipelined
        self._compute = threading.Lock()  # layers run here one group at a time
        self.verifier = StageVerifier(model, verify, rng)  # --verify (stage_verify.py)

    # ----------------------------------------------------------- event-loop side
    def deliver(self, peer: str, msg: StageAnswer | Error) -> None:
        """An answer (or Error) from ``peer``. Thread-safe; unknown ids are dropped."""
        if self.tracker.deliver(peer, msg, self._clock()) and isinstance(msg, StageAnswer):  # late, recomputed here: timed
            with self._lock:
                self.warm.setdefault(peer, set()).add((msg.layer_start, msg.layer_stop))

    def peer_down(self, peer: str, reason: str = "link closed", left: bool = False) -> None:
        """``peer``'s link went away: its pending requests fail now. ``left``: as
        :meth:`RemoteFFN.peer_down <swarm.peer.coordinator.dispatch.RemoteFFN.peer_down>`."""
        self.tracker.peer_down(peer, reason, left)

    def set_rtt(self, peer: str, rtt_s: float) -> None:
        self.tracker.set_rtt(peer, rtt_s)

    def measure_afresh(self, peer: str) -> None:
        """``peer`` linked anew: its speed is measured afresh (:meth:`RequestTracker.measure_afresh`),
        and it is cold (a restarted peer loads its stage again: its first request's deadline allows that)."""
        self.tracker.measure_afresh(peer)
        with self._lock:
            self.warm.pop(peer, None)

    def set_layout(self, layout: StageLayout, inner: FFNBackend | None = None) -> None:
        """Use ``layout`` for sequences that start from now on (those in flight keep theirs), and
        ``inner`` (if given) for the FFN of the coordinator's own layers."""
        if layout.n_layers != self.model.config.n_layers:
            raise LocalProtocolError(f"stage layout covers {layout.n_layers} layers, not {self.model.config.n_layers}")
        self.layout = layout
        if inner is not None:
            self.inner = inner
        # A failed peer stays failed for the sequences still under older layouts until a layout
        # has it again (the owner keeps a peer marked down out of its plans for a while).
        self.tracker.readmit(layout.workers())
        for peer in layout.workers():  # a peer caught lying stays out: the owner is told again
            why = self.tracker.distrusted.get(peer)
            if why is not None:
                self.dispatcher.peer_failed(peer, f"{VERIFY_FAILED}: {why}")

    def set_schedulers(self, n: int) -> None:
        """``n`` ≥ 1 batch schedulers step through these stages at once (the API's pool): each
        one's step is a group in flight already, so a step is cut into groups only to fill the
        stages they leave idle (:func:`~swarm.peer.coordinator.costmodel.pipeline_groups`)."""
        if n < 1:
            raise ValueError(f"schedulers must be ≥ 1, got {n}")
        self.schedulers = n

    def set_pricer(self, pricer: GroupPricer | None) -> None:
        """The planner's price of a round of groups through the stages of the layout set last
        (None: not priced; the API then runs one scheduler per stage)."""
        self.pricer = pricer

    def set_approximate(self, peers: set[str]) -> None:
        """``peers`` (of another numeric build) are verified within a bound, not bit for bit."""
        self.verifier.approximate = set(peers)

    # ------------------------------------------------------------ token-loop side
    def ffn(self, layer: int, x: np.ndarray, segments: Sequence[int] | None = None) -> np.ndarray:
        """The FFN of the coordinator's own layers (FFNBackend)."""
        return self.inner.ffn(layer, x, segments)

    def run_layers(self, model: Model, x: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """Run the embedded rows x [T, H] f32 at positions ``start ..`` through every stage; returns
        the rows after the last layer [T, H] f32 (``Model.forward``'s LayerBackend hook)."""
        return self.run_layers_batch(model, x, [(cache, start, x.shape[0])])

    def run_layers_batch(self, model: Model, x: np.ndarray, seqs: list[tuple[KVCache, int, int]]) -> np.ndarray:
        """One step of several sequences (``Model.forward_batch``'s LayerBackend hook): ``x``
        [sum T_i, H] f32 holds each sequence's embedded rows in turn, ``seqs[i] = (cache, start,
        T_i)``. Sequences under the same layout cross each stage together — one StageRequest per
        stage peer and step, the union of their rows — and each row comes back with the bits its
        sequence alone would get. Returns the rows after the last layer [sum T_i, H] f32."""
        confirm_lead(lambda: self.dispatcher.lead_state(self.layout.term), self._clock)
        bounds = np.concatenate([[0], np.cumsum([T for _, _, T in seqs])]).astype(int).tolist()
        parts = []
        with self._lock:  # steps of other batches may run at once (one scheduler per group)
            for i, (cache, start, _) in enumerate(seqs):
                seq = self._sequences.get(cache)
                if start == 0 or seq is None:
                    seq = self._sequences[cache] = _Sequence(next(self._seq_ids), self.layout)
                parts.append(_Part(seq, cache, start, x[bounds[i]:bounds[i + 1]]))
        # Sequences whose layouts have the same stages (a re-plan that moved nothing makes a new
        # version) cross them together, under the newest of those versions.
        groups: dict[tuple, list[_Part]] = {}
        for p in parts:
            groups.setdefault((p.seq.layout.term, p.seq.layout.stages), []).append(p)
        for group in groups.values():
            layout = max((p.seq.layout for p in group), key=lambda lay: lay.version)
            micro = micro_groups(group, self._n_groups(len(group), len(layout.stages)))
            if len(micro) > 1:
                self._pipeline(micro, layout)
            else:
                for stage in layout.stages:
                    self._run_stage(group, stage, layout)
        return parts[0].x if len(parts) == 1 else np.concatenate([p.x for p in parts])

    def _n_groups(self, n_sequences: int, n_stages: int) -> int:
        """How many groups a step of ``n_sequences`` splits into over ``n_stages`` stages (1: none)."""
        if n_stages < 2 or n_sequences < 2 or self.pipeline_groups == 1:
            return 1
        if self.pipeline_groups is not None:
            return min(n_sequences, self.pipeline_groups)
        from swarm.peer.coordinator.costmodel import pipeline_groups

        return pipeline_groups(n_sequences, n_stages, self.schedulers)

    def _run_stage(self, group: list[_Part], stage: Stage, layout: StageLayout) -> None:
        """``group``'s rows through ``stage``: on its peer, or here (its own stage, or a failover)."""
        for p in group:
            p.history = p.seq.record(stage.start, p.start, p.x)
        out = None
        if stage.peer != layout.coordinator and self._may_send(stage.peer, layout):
            out = self._remote(group, stage, layout)
        if out is None:
            out = self._local(group, stage)
        for p, y in zip(group, out):
            p.x = y

    def _pipeline(self, micro: list[list[_Part]], layout: StageLayout) -> None:
        """A step's groups through the stages as a wavefront: one lane per stage takes the groups
        in order, group g entering stage s once it has left stage s-1 and group g-1 has left stage
        s, so group g is at stage s while group g+1 is at stage s-1. Each lane is a thread (the
        last one this thread; the others started for the step and joined); a lane waits on its
        peer's answer or runs the stage here (its own stage, or a failover: one group at a time,
        ``_compute``). A failure stays per group and stage: the lane's failover runs that group
        here and the next group goes through the same rule (``_may_send``)."""
        stages = layout.stages
        done: list[list[cf.Future[None]]] = [[cf.Future() for _ in stages] for _ in micro]

        def lane(s: int) -> None:
            for g, group in enumerate(micro):
                fut = done[g][s]
                try:
                    if s:
                        done[g][s - 1].result()
                    self._run_stage(group, stages[s], layout)
                except BaseException as exc:  # handed on: the caller raises it
                    fut.set_exception(exc)
                else:
                    fut.set_result(None)

        lanes = [threading.Thread(target=lane, args=(s,), name=f"stage-lane-{s}", daemon=True)
                 for s in range(len(stages) - 1)]
        for t in lanes:
            t.start()
        lane(len(stages) - 1)
        for t in lanes:  # each ends once its groups are through (or failed): no wait is unbounded
            t.join()
        with self._lock:
            self.pipelined_steps += 1
        for row in done:
            row[-1].result()

    def _may_send(self, peer: str, layout: StageLayout) -> bool:
        """Whether ``peer`` runs its stage this step (the tracker's rule: not failed, not suspect, not
        held as not ready under ``layout``); a suspect peer whose link has been silent fails, as at
        a miss. Otherwise its layers run here, as on a failover, and the peer is kept."""
        send, why = self.tracker.may_send(peer, layout.term, layout.version, self._clock(),
                                          self.dispatcher.last_heard(peer))
        if why is not None:
            self._fail(peer, why)
        return send

    def _local(self, group: list[_Part], stage: Stage) -> list[np.ndarray]:
        with self._compute:
            return self._local_locked(group, stage)

    def _local_locked(self, group: list[_Part], stage: Stage) -> list[np.ndarray]:
        key = (stage.start, stage.stop)
        for p in group:
            have = min(p.seq.local.get(key, 0), p.start)
            if have < p.start:  # a stage that moved here: rebuild its KV cache from the rows that entered it
                self.model.layers(p.history[have:p.start], p.cache, have, stage.start, stage.stop, self.inner)
                self.rebuilt_positions += p.start - have  # under _compute
        t0 = self._clock()
        if len(group) == 1:
            (p,) = group
            outs = [self.model.layers(p.history[p.start:], p.cache, p.start, stage.start, stage.stop, self.inner)]
        else:
            rows = np.concatenate([p.history[p.start:] for p in group])
            out = self.model.layers_batch(rows, [(p.cache, p.start, p.x.shape[0]) for p in group],
                                          stage.start, stage.stop, self.inner)
            outs = np.split(out, np.cumsum([p.x.shape[0] for p in group])[:-1])
        self.tracker.observe_local(self._clock() - t0, sum(o.shape[0] for o in outs), stage.stop - stage.start)
        for p in group:
            p.seq.local[key] = p.history.shape[0]
        return outs

    def _remote(self, group: list[_Part], stage: Stage, layout: StageLayout) -> list[np.ndarray] | None:
        """Each sequence's output rows of the stage [T_i, H], or None after a failure (recorded)."""
        key = (stage.peer, stage.start, stage.stop)
        # a holder that missed steps of a sequence gets them again
        firsts = [min(p.seq.remote.get(key, 0), p.start) for p in group]
        for _ in range(2):
            msg = self._call(stage, layout, group, firsts)
            if isinstance(msg, Error) and msg.code == "cache_gap" and any(firsts):
                firsts = [0] * len(group)  # it lost a sequence (restarted, evicted): send them all
                continue
            break
        if isinstance(msg, Error) and msg.code == "stale_term":
            self._not_ready(stage.peer, layout, msg)
            return None
        if isinstance(msg, Error):
            self._fail(stage.peer, f"refused layers {stage.start}:{stage.stop}: {msg.code}: {msg.message}")
            return None
        if msg is None:
            return None
        with self._lock:
            self.remote_steps += 1
        outs, at = [], 0
        for p, first in zip(group, firsts):
            p.seq.remote[key] = p.history.shape[0]
            at += p.history.shape[0] - first
            outs.append(np.ascontiguousarray(msg.x[at - p.x.shape[0]:at]))
        if self.verifier.share > 0 and not self._verified(group, stage, outs):
            return None  # a wrong answer: discarded, the stage runs here
        return outs

    def _verified(self, group: list[_Part], stage: Stage, outs: list[np.ndarray]) -> bool:
        """``--verify``: check a sampled share of the rows of ``stage.peer``'s answer ``outs``
        (each sequence's [T_i, H]) against the stage's layers run here (stage_verify.py); on a
        mismatch the peer is distrusted and False returned."""
        key = (stage.start, stage.stop)
        parts = []
        for p, y in zip(group, outs):
            shadow = p.seq.shadows.get(key)
            if shadow is None:
                shadow = p.seq.shadows[key] = self.verifier.shadow()
            parts.append(Answered(p.seq.id, shadow, p.history, p.start, y))
        with self._compute:  # layers run here one group at a time
            checked, wrong = self.verifier.check(stage.peer, stage.start, stage.stop, parts)
        self.tracker.verified(sum(y.shape[0] for y in outs), checked.rows_checked, checked.rows_computed,
                              checked.seconds)
        if wrong is not None:
            self._distrust(stage.peer, wrong)
            return False
        return True

    def _call(self, stage: Stage, lay: StageLayout, group: list[_Part], firsts: list[int]
              ) -> StageAnswer | Error | None:
        rid = REQUEST_ID_BASE | (next(self._ids) & (REQUEST_ID_BASE - 1))
        segments = tuple(StageSegment(p.seq.id, f, p.history.shape[0] - f) for p, f in zip(group, firsts))
        # a copy: the request is encoded on the event loop, and later steps write the history buffers
        rows = (group[0].history[firsts[0]:].copy() if len(group) == 1 else
                np.concatenate([p.history[f:] for p, f in zip(group, firsts)]))
        req = StageRequest(rid, lay.term, lay.version, segments, stage.start, stage.stop, rows)
        span = (stage.start, stage.stop)
        with self._lock:
            cold = span not in self.warm.get(stage.peer, ())
        if cold:  # its first pass may read the layers from disk
            self.tracker.loading(stage.peer, self._stage_bytes(*span))
        p = self.tracker.track(rid, req, stage.peer, rows.shape[0], self._clock())
        try:
            self.dispatcher.send(stage.peer, req)
        except Exception as exc:  # the link is gone
            self.tracker.withdraw(p)
            self._fail(stage.peer, f"send failed: {exc}")
            return None
        try:
            msg = wait_answer(self.tracker, p, self._clock, self.dispatcher.last_heard)
        except ConnectionError as exc:
            self._fail(stage.peer, str(exc))
            return None
        if isinstance(msg, Missed):
            self._missed(p, msg)
            return None
        if isinstance(msg, Error):
            return msg
        try:
            _check_answer(req, msg)
        except RemoteProtocolError as exc:
            self._fail(stage.peer, f"malformed answer: {exc}")
            return None
        elapsed = self._clock() - p.sent.sent_at
        self.tracker.answered(p.sent, self._clock())  # it answers under this layout: it has it
        with self._lock:
            self.warm.setdefault(stage.peer, set()).add(span)
        # For the planner: its compute alone, as it reports it, and what a short step's message
        # cost beyond the round trip.
        self.tracker.observe_stage(stage.peer, msg.compute_s, elapsed, rows.shape[0], stage.stop - stage.start,
                                   short=rows.shape[0] <= INLINE_ROWS)
        return msg

    def _missed(self, p: Pending, missed: Missed) -> None:
        """``p``'s deadline passed (or its link went silent): this step runs its layers here. By
        the FFN ranges' rule (:mod:`~swarm.peer.coordinator.tracker`) the peer fails only at its
        first request under a stage, after ``MISS_LIMIT`` misses in a row, or when its link is
        silent ``SILENCE_S``; otherwise its next step is sent to it again (with the rows it
        missed), and its answer to this one, should it come, is timed: slow, not gone."""
        req, now = p.request, self._clock()
        what = (f"no answer within {now - p.sent.sent_at:.3f} s of a {p.sent.deadline - p.sent.sent_at:.3f} s deadline "
                f"(layers {req.layer_start}:{req.layer_stop})")
        if missed.why is not None:
            self._fail(p.peer, f"{what}; {missed.why}")
            return
        with self._lock:
            self.misses += 1
        log.info("stage peer %s: %s, miss %d of %d in a row; its layers run here this step",
                 p.peer, what, missed.misses, MISS_LIMIT)

    def _stage_bytes(self, lo: int, hi: int) -> int:
        """Weight bytes of layers ``lo .. hi-1`` as stored (the file's header: nothing read)."""
        if self._layer_bytes is None:
            from swarm.peer.coordinator.costmodel import LayerCosts

            costs = LayerCosts.from_model(self.model)
            self._layer_bytes = tuple(costs.layer_bytes(i) for i in range(costs.n_layers))
        return sum(self._layer_bytes[lo:hi])

    def _not_ready(self, peer: str, layout: StageLayout, msg: Error) -> None:
        """``peer`` does not serve ``layout`` (it lost or refused the stage plan): its layers run
        here, it gets one probe every ``NOT_READY_RETRY_S``, and with each refusal ``layout`` again —
        the one this sequence runs under, which a newer plan may have replaced as the newest."""
        if self.tracker.hold_not_ready(peer, layout.term, layout.version, self._clock()):
            log.info("stage peer %s has not accepted stage plan v%d of term %d (%s); its layers run here "
                     "until it has", peer, layout.version, layout.term, msg.message)
        try:  # at every refused probe: the plan sent before may have been lost or refused
            self.dispatcher.send(peer, layout.to_message())
        except ConnectionError:
            pass  # its link is gone: the owner re-plans

    def _distrust(self, peer: str, exc: VerificationError) -> None:
        """``peer``'s answer was wrong: it is marked down and never trusted again
        (``RequestTracker.distrust``); the owner is told why."""
        with self._lock:
            self.warm.pop(peer, None)
        if not self.tracker.distrust(peer, str(exc)):
            return
        reason = f"{VERIFY_FAILED}: {exc}"
        log.warning("stage peer %s marked down: %s", peer, reason)
        self.dispatcher.peer_failed(peer, reason)

    def _fail(self, peer: str, reason: str) -> None:
        with self._lock:
            self.warm.pop(peer, None)  # back in a later layout, it may have to load its stage again
        if not self.tracker.fail(peer):
            return
        log.warning("stage peer %s marked down: %s; its layers run on the coordinator", peer, reason)
        self.dispatcher.peer_failed(peer, reason)


def _check_answer(req: StageRequest, msg: object) -> None:
    """RemoteProtocolError unless ``msg`` answers ``req`` exactly, with finite f32 rows."""
    if not isinstance(msg, StageAnswer):
        raise RemoteProtocolError(f"{type(msg).__name__} does not answer a StageRequest")
    echo = (msg.term, msg.plan_version, msg.segments, msg.layer_start, msg.layer_stop)
    want = (req.term, req.plan_version, req.segments, req.layer_start, req.layer_stop)
    if echo != want:
        raise RemoteProtocolError(f"answer echoes {echo}, not the request's {want}")
    if msg.x.dtype != F32 or msg.x.shape != req.x.shape:
        raise RemoteProtocolError(f"rows {msg.x.shape} {msg.x.dtype}, expected {req.x.shape} float32")
    if not np.isfinite(msg.x).all():
        raise RemoteProtocolError("rows hold NaN or infinity")



def micro_groups(parts: list[_Part], n: int) -> list[list[_Part]]:
    """``parts`` cut into ``n`` contiguous groups of about equal rows (a prefill weighs its rows),
    none empty; in their order, so the step's rows come back in place."""
    n = max(1, min(n, len(parts)))
    if n == 1:
        return [parts]
    rows = np.cumsum([p.x.shape[0] for p in parts])
    total = int(rows[-1])
    groups: list[list[_Part]] = [[] for _ in range(n)]
    g = 0
    for i, (p, r) in enumerate(zip(parts, rows)):
        groups[g].append(p)
        left = len(parts) - i - 1
        if g < n - 1 and (r >= total * (g + 1) / n or left == n - 1 - g):
            g += 1
    return [grp for grp in groups if grp]
