"""The coordinator's FFN backend: dispatches each layer's MLP / MoE work to the peers.

Theory of operation
-------------------
:class:`RemoteFFN` is an :class:`~swarm.compute.ffn.FFNBackend`: ``Model.forward``
calls ``ffn(layer, x)`` for every layer, and it answers with the bits
:class:`~swarm.compute.ffn.LocalFFN` would give under the same plan:

* **MoE layer.** Route locally (:func:`~swarm.compute.ffn.route`), group the
  selected experts by the peer the plan gives them to, and send each worker
  **one** :class:`ExpertRequest` with the rows of all its experts. Every request
  is sent before any answer is awaited; meanwhile the coordinator computes its
  own experts and the shared expert. Answers are checked and combined by
  :func:`~swarm.compute.ffn.combine` in its fixed order (experts ascending).
* **Dense layer.** The normed rows go to every range holder in one
  :class:`DenseRequest` each; the partials are summed in span order by
  :func:`~swarm.compute.ffn.sum_partials`, the coordinator's own span included.

Prefill is the same path with more rows: one batch, one request per peer. A step of the batch
scheduler carries several sequences: ``segments`` gives their row counts, every request carries
how its rows split into sequences, and each side computes every sequence's rows as that
sequence alone would (:mod:`swarm.compute.ffn`, "Segments"), so batching changes no bits.

Threading. The forward pass is synchronous numpy, and the FFN seam is a plain
call, so the whole token loop runs in one worker thread and this backend talks
to the asyncio links through a :class:`Dispatcher`, whose methods must be
callable from that thread and must not block (the adapter hands each call to the
event loop); answers come back through
:meth:`RemoteFFN.deliver` / :meth:`RemoteFFN.peer_down`, called from the event
loop, which complete :class:`concurrent.futures.Future` s. The compiled kernels
release the GIL, so the links keep moving while the coordinator computes its own share.
An async forward would have meant rewriting the engine around the seam; a thread
keeps the engine untouched and the event loop free.

Failure. Every request has a deadline that follows what the peer's answers
took (:mod:`swarm.peer.coordinator.tracker`, the rule the stages follow too): a
high quantile of its recent answer times beyond its per-row compute, plus that
compute for the request's rows, times a safety factor, within a floor and a
ceiling. Answers that come after their deadline still count as observations, so
on a loaded machine the deadline grows with the peer's real answer times instead
of cutting it off; a wait ends early when the peer's link has gone silent. A request whose answer is
late, lost (link down), an :class:`Error`, or malformed (ids, term, plan version,
layer, shapes, dtype, non-finite values) is replaced by the coordinator computing
those rows itself — it has the model file mapped, so the result is the same
bits. The peer is marked failed (no more work in this step; ``Dispatcher.peer_failed``
tells the owner, who rebuilds the plan) for a closed link, a malformed answer or
an Error; for lateness only after ``MISS_LIMIT`` misses with no answer within the
ceiling in between (each miss doubles the next deadline, within the ceiling; a
late answer within the ceiling resets the count: that peer is slow, not gone, and
its deadline now covers it), at once when its link has been silent for
``SILENCE_S``, or when it misses its first request under a new share.
After a miss, a peer not heard from since that request was sent is suspect
(:meth:`~swarm.peer.coordinator.tracker.RequestTracker.suspect`): it is sent nothing
and its rows are computed here at once, without waiting or counting misses, until
it is heard again (a heartbeat, its late answer) or fails by silence — so a killed
worker costs one deadline, not ``MISS_LIMIT`` doubled ones.
So a peer that stops answering stalls a generation at most ``MISS_LIMIT``
deadlines, each at most its ceiling (``DEADLINE_MAX_S`` plus the safety factor
times the rows' expected compute: ~6 s for decode steps), or ``FIRST_DEADLINE_S``
right after its share changed; a closed link ends the wait at once.
:meth:`set_plan` takes effect at the next step (layer 0), never inside one.

Plan hand-over. The plan is sent on the same ordered channel before any request
that uses it, and a worker holds requests of a plan until it has installed it, so
requests are sent with the new plan at once. A worker that refuses one with
``stale_term`` (it has not accepted that plan: it lost it, or refused it) is not
failed: its rows are recomputed here, ``Dispatcher.peer_not_ready`` asks the owner to send
it the plan again, and it gets no requests of that plan except one probe every
``NOT_READY_RETRY_S``, until an answer shows it serves the plan.

Memory. The coordinator keeps in memory what only it needs (embeddings,
attention, routers, norms, head) and its planned share; the rest of the file is
mapped but untouched. Experts it computes for a failed peer (or for
``--verify``), and its own experts beyond its budget when the swarm holds too
little (``plan.streamed_bytes``), are read from the mapping and their pages
dropped from the process right after (:func:`swarm.peer.memory.release_pages`),
so neither a fault nor a shortfall grows its resident set past its share.

Warm-up. A peer that was just shipped its slices (a browser peer pulls and
uploads them to its GPU after the plan arrives) may answer "no such weights" for
a while: within its warm-up window (:meth:`set_plan`'s ``warming``) an
:class:`Error` answer is recomputed here without marking the peer failed.

Trust. With ``verify`` > 0 that share of remote answers is recomputed locally
and compared — bit for bit for peers of our numeric build, within the bound of the
format and reduction length for the others (``approximate`` peers, e.g. a WebGPU page or a
GPU peer; ``repacked`` ones compute on a Q8_0 repack: :mod:`~swarm.peer.coordinator.bounds`);
in an int8 swarm a peer of another build (a GPU peer) by the int8 rows of its down products
(:func:`~swarm.compute.int8_swiglu.check_int8_answer`); a mismatch raises :class:`VerificationError`.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from swarm.compute import numerics
from swarm.compute.ffn import (LocalFFN, combine, expert_rows, route, run_lengths, segment_ids, sum_partials,
                               swiglu_rows)
from swarm.compute.int8_swiglu import check_int8_answer
from swarm.compute.kernels import MLPWeights
from swarm.errors import LocalProtocolError, RemoteProtocolError, VerificationError
from swarm.peer.coordinator.bounds import ffn_rtol, int8_product_bound, rows_outside
from swarm.peer.coordinator.tracker import MISS_LIMIT, Missed, Pending, RequestTracker, confirm_lead, wait_answer
from swarm.peer.memory import release_pages
from swarm.peer.net.messages import DenseAnswer, DenseRequest, Error, ExpertAnswer, ExpertRequest, StagePlan, StageRequest
from swarm.peer.plan import Plan

if TYPE_CHECKING:
    from swarm.compute.model import Model

log = logging.getLogger(__name__)

F32 = np.float32


# Rows of each block (an expert, a dense range) of a sampled answer of an int8 GPU peer that are
# checked: the check costs per row (its gate, up and down products recomputed with their bounds),
# and a prompt's answer may hold thousands.
INT8_CHECKED_ROWS = 8


class Dispatcher(Protocol):
    """How :class:`RemoteFFN` and :class:`~swarm.peer.coordinator.stages.StagedFFN` reach the
    workers. Every method is called from the token-loop thread and must not block."""

    def send(self, peer: str, msg: ExpertRequest | DenseRequest | StageRequest | StagePlan) -> None:
        """Hand ``msg`` (a request, or a stage plan sent again) to ``peer``'s link; raises
        ConnectionError when there is no link."""

    def last_heard(self, peer: str) -> float | None:
        """Clock time (monotonic s) of the last byte received from ``peer``; None: unknown."""

    def peer_failed(self, peer: str, reason: str) -> None:
        """``peer`` failed (late, gone or wrong): the owner re-plans without it; once per failure."""

    def peer_not_ready(self, peer: str, reason: str) -> None:
        """``peer`` refused a request as not serving its plan: the owner sends it the plan again."""

    def lead_state(self, term: int) -> bool | None:
        """Whether this peer still coordinates ``term`` (True), no longer does (False), or leads
        without a majority heard from recently (None: it woke from a stall), for
        :func:`~swarm.peer.coordinator.tracker.confirm_lead` at the start of each step."""


def _share(plan: Plan, peer: str) -> set[tuple[str, int, int, int]]:
    """The spans ``plan`` gives ``peer``: what it must hold."""
    return {(kind, layer, s.start, s.stop) for kind, table in (("e", plan.experts), ("d", plan.dense))
            for layer, spans in table.items() for s in spans if s.peer == peer}


class RemoteFFN:
    """FFN backend of the coordinator; see the module docstring.

    ``model``: the model, memory-mapped (a :class:`swarm.compute.model.Model`); ``plan``:
    the placement (``plan.coordinator`` is us); ``dispatcher``: the links (:class:`Dispatcher`:
    requests out; a failed peer once per failure; a peer that refused a request as not serving
    the plan once per plan; when each peer was last heard, so that a silent peer is failed at its
    first miss). ``verify``: share of remote answers (0..1) recomputed locally.
    """

    def __init__(
        self,
        model: Model,
        plan: Plan,
        dispatcher: Dispatcher,
        *,
        verify: float = 0.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= verify <= 1.0:
            raise LocalProtocolError(f"verify share {verify} must be within 0..1")
        self.model = model
        self.plan = plan
        self.dispatcher = dispatcher
        self.verify = verify
        self.tracker = RequestTracker()  # the requests in flight and the failure rule (tracker.py)
        self.timing = self.tracker.timing  # peer → PeerTiming
        self.not_ready = self.tracker.not_ready  # peer → (term, version, next probe time)
        self.failed = self.tracker.failed  # peers given no more work until a new plan
        self.verified = 0  # remote answers recomputed and found equal
        self.remote_rows = 0  # rows answered by peers (status, tests)
        self.local_fallbacks = 0  # requests recomputed here after a failure
        self._rng = rng or random.Random()
        self._clock = clock
        self._ids = itertools.count(1)
        self._next_plan: Plan | None = None
        self._next_warming: dict[str, float] = {}
        self.warming_until: dict[str, float] = {}  # peer → clock time its warm-up window ends
        self.approximate: set[str] = set()  # peers verified within a bound, not bit for bit
        self.int8 = numerics.int8()  # an int8 swarm: its peers of another build are checked by their down rows
        self.repacked: set[str] = set()  # of those, the ones computing on a Q8_0 repack
        self._dense_slices: dict[tuple[int, int, int], object] = {}
        self._streamed = self._streamed_experts(plan)
        self._local, self._whole_here = self._layers_here(plan)

    # ----------------------------------------------------------- event-loop side
    def deliver(self, peer: str, msg: ExpertAnswer | DenseAnswer | Error) -> None:
        """An answer (or Error) arrived from ``peer``. Thread-safe; unknown ids are dropped, a late
        answer (recomputed already) is timed."""
        self.tracker.deliver(peer, msg, self._clock())

    def peer_down(self, peer: str, reason: str = "link closed", left: bool = False) -> None:
        """``peer``'s link went away: its pending requests fail now rather than at their deadline.
        ``left``: it closed the link, as a peer that leaves does: it gets no more work from this
        plan, without being marked down (the owner re-plans without it)."""
        self.tracker.peer_down(peer, reason, left)

    def set_rtt(self, peer: str, rtt_s: float) -> None:
        """Measured link round trip of ``peer`` (from the link's heartbeats)."""
        self.tracker.set_rtt(peer, rtt_s)

    def measure_afresh(self, peer: str) -> None:
        """``peer`` linked anew: its speed is measured afresh (:meth:`RequestTracker.measure_afresh`)."""
        self.tracker.measure_afresh(peer)

    def set_plan(self, plan: Plan, warming: dict[str, float] | None = None) -> None:
        """Use ``plan`` from the next step on (applied at layer 0, never inside a step).

        ``warming``: peer → seconds from then on during which its Error answers are
        recomputed without marking it failed (it is still installing its slices).
        """
        self._next_plan, self._next_warming = plan, dict(warming or {})

    def warm(self, warming: dict[str, float]) -> None:
        """``warming``: peer → seconds from now during which its Error answers are recomputed
        without marking it failed (it is still installing its slices)."""
        now = self._clock()
        self.warming_until.update({p: now + s for p, s in warming.items()})

    def set_approximate(self, peers: set[str], repacked: set[str] = frozenset()) -> None:
        """``peers`` (of another numeric build) are verified within a bound, not bit for bit;
        ``repacked`` (some of them) compute on a Q8_0 repack of the file's blocks: a wider one."""
        self.approximate = set(peers)
        self.repacked = set(repacked) & self.approximate

    @property
    def pending_plan(self) -> Plan | None:
        """The plan :meth:`set_plan` gave until it takes effect at the next step; None after."""
        return self._next_plan

    # ------------------------------------------------------------ token-loop side
    def ffn(self, layer: int, x: np.ndarray, segments: Sequence[int] | None = None) -> np.ndarray:
        """x [T, H] f32 (post-attention-normed rows) → [T, H] f32, as LocalFFN under ``plan``;
        ``segments``: the row counts of the step's sequences (None: one sequence)."""
        if x.dtype != F32 or x.ndim != 2:
            raise LocalProtocolError(f"ffn input must be [T, H] float32, got {x.shape} {x.dtype}")
        if layer == 0:
            self._start_step()
        if layer in self._whole_here:
            return self._local.ffn(layer, x, segments)
        seg = segment_ids(segments, x.shape[0])
        if self.model.is_moe_layer(layer):
            return self._moe(layer, x, seg)
        return self._dense(layer, x, seg)

    def _start_step(self) -> None:
        """A new step (layer 0): the plan set meanwhile takes effect, then the lead is confirmed."""
        if self._next_plan is not None:
            for peer in self._next_plan.peers:  # a changed share means new slices to load first
                if _share(self._next_plan, peer) != _share(self.plan, peer):
                    self.tracker.of(peer).fresh = True
            self.plan, self._next_plan = self._next_plan, None
            now = self._clock()
            self.warming_until.update({p: now + s for p, s in self._next_warming.items()})
            self.tracker.readmit()
            self._dense_slices.clear()
            self._streamed = self._streamed_experts(self.plan)
            self._local, self._whole_here = self._layers_here(self.plan)
        confirm_lead(lambda: self.dispatcher.lead_state(self.plan.term), self._clock)

    def _remote(self, peer: str) -> bool:
        """Whether ``peer``'s rows go to it this step (the tracker's rule: not failed, not suspect, not
        held as not ready); a suspect peer whose link has been silent fails, as at a miss."""
        if peer == self.plan.coordinator:
            return False
        send, why = self.tracker.may_send(peer, self.plan.term, self.plan.version, self._clock(),
                                          self.dispatcher.last_heard(peer))
        if why is not None:
            self._fail(peer, why)
        return send

    def _dispatch(self, peer: str, make: Callable[[int], ExpertRequest | DenseRequest], rows: int) -> Pending:
        rid = next(self._ids) & 0xFFFF_FFFF or next(self._ids)
        req = make(rid)
        p = self.tracker.track(rid, req, peer, rows, self._clock())
        try:
            self.dispatcher.send(peer, req)
        except Exception as exc:  # the link is gone: the rows are recomputed here
            self.tracker.withdraw(p)
            if not p.future.done():  # the link's loss may have failed it already (peer_down)
                p.future.set_exception(ConnectionError(f"send failed: {exc}"))
        return p

    def _await(self, p: Pending) -> ExpertAnswer | DenseAnswer | None:
        """The peer's answer, or None after a failure (already recorded)."""
        try:
            msg = wait_answer(self.tracker, p, self._clock, self.dispatcher.last_heard)
        except ConnectionError as exc:
            self._fail(p.peer, str(exc))
            return None
        if isinstance(msg, Missed):
            self._missed(p, msg)
            return None
        if isinstance(msg, Error):
            if msg.code == "stale_term":  # it has not accepted this plan: not ready, not failed
                self._not_ready(p, msg)
                return None
            if self._clock() < self.warming_until.get(p.peer, 0.0):
                self.local_fallbacks += 1  # still installing its slices: not a failure
                return None
            self._fail(p.peer, f"refused layer {p.request.layer}: {msg.code}: {msg.message}")
            return None
        try:
            self._check_answer(p.request, msg)
        except RemoteProtocolError as exc:
            self._fail(p.peer, f"malformed answer: {exc}")
            return None
        self.tracker.answered(p.sent, self._clock())  # it answers under this plan: it has it
        self.remote_rows += p.rows
        return msg

    def _missed(self, p: Pending, missed: Missed) -> None:
        """``p``'s deadline passed: its rows are recomputed; the peer fails only when that is
        no longer chance (module docstring). Its answer, should it come, is still timed."""
        what = f"no answer within {p.deadline - p.sent_at:.3f} s (layer {p.request.layer})"
        if missed.why is not None:
            self._fail(p.peer, f"{what}; {missed.why}")
            return
        self.local_fallbacks += 1
        log.info("peer %s: %s, miss %d of %d in a row; its rows recomputed here", p.peer, what, missed.misses,
                 MISS_LIMIT)

    def _not_ready(self, p: Pending, msg: Error) -> None:
        """``p.peer`` refused ``p`` for not serving its plan: recompute, hold its requests of this
        plan but for a probe now and then, and have the owner send it the plan again."""
        self.local_fallbacks += 1
        req = p.request
        if self.tracker.hold_not_ready(p.peer, req.term, req.plan_version, self._clock()):
            reason = f"has not accepted plan v{req.plan_version} of term {req.term} yet: {msg.message}"
            log.info("peer %s %s; its rows are recomputed here until it has", p.peer, reason)
            self.dispatcher.peer_not_ready(p.peer, reason)

    def _fail(self, peer: str, reason: str) -> None:
        self.local_fallbacks += 1
        if not self.tracker.fail(peer):
            return
        log.warning("peer %s marked down: %s; its rows are computed by the coordinator", peer, reason)
        self.dispatcher.peer_failed(peer, reason)

    def _check_answer(self, req: ExpertRequest | DenseRequest, msg: object) -> None:
        """Raise RemoteProtocolError unless ``msg`` answers ``req`` exactly, with finite f32 rows."""
        if isinstance(req, ExpertRequest):
            if not isinstance(msg, ExpertAnswer):
                raise RemoteProtocolError(f"{type(msg).__name__} does not answer an ExpertRequest")
            same = (np.array_equal(msg.expert_ids, req.expert_ids) and np.array_equal(msg.row_counts, req.row_counts))
            out, want = msg.outputs, req.rows.shape
        else:
            if not isinstance(msg, DenseAnswer):
                raise RemoteProtocolError(f"{type(msg).__name__} does not answer a DenseRequest")
            same = tuple(msg.ranges) == tuple(req.ranges)
            out, want = msg.partials, (len(req.ranges), *req.x.shape)
        if (msg.term, msg.plan_version, msg.layer) != (req.term, req.plan_version, req.layer) or not same:
            raise RemoteProtocolError(f"answer echoes term {msg.term} v{msg.plan_version} layer {msg.layer}, "
                                      f"not the request's term {req.term} v{req.plan_version} layer {req.layer}")
        if out.dtype != F32 or out.shape != want:
            raise RemoteProtocolError(f"layer {req.layer}: output {out.shape} {out.dtype}, expected {want} float32")
        if not np.isfinite(out).all():
            raise RemoteProtocolError(f"layer {req.layer}: output holds NaN or infinity")

    def _verify_int8(self, peer: str, layer: int, what: str, w: MLPWeights, x: np.ndarray, remote: np.ndarray,
                     msg: ExpertAnswer | DenseAnswer, at: slice = slice(None)) -> None:
        """Check an int8 GPU peer's answer ``remote`` for block ``w`` on rows ``x`` by the down rows
        ``msg`` carries (rows ``at`` of them): :func:`~swarm.compute.int8_swiglu.check_int8_answer`,
        on :data:`INT8_CHECKED_ROWS` of its rows at most, drawn once the answer is here (the peer
        cannot know which): the check of one row takes ~0.1 s and ~16 MiB on 2048 × 8192 blocks."""
        rows = getattr(msg, "down_rows", None)
        if rows is None:
            why: str | None = "it sent no down rows"
        else:
            rows, n = rows[at], x.shape[0]
            pick = sorted(self._rng.sample(range(n), INT8_CHECKED_ROWS)) if n > INT8_CHECKED_ROWS else slice(None)
            why = check_int8_answer(w, x[pick], remote[pick], rows[pick], int8_product_bound) \
                if rows.shape[0] == n else f"{rows.shape[0]} down rows for {n} rows"
        if why is not None:
            raise VerificationError(f"peer {peer} answered layer {layer} ({what}) with an int8 answer that is not "
                                    f"the block's: {why}; stopping. Remove that peer from the swarm or run without "
                                    "--verify to accept its answers.")
        self.verified += 1

    def _rows_checked(self, peer: str) -> bool:
        """Whether ``peer``'s answers are checked by their down rows: an int8 swarm's GPU peer (the
        only peers of another build an int8 coordinator plans)."""
        return self.int8 and peer in self.approximate

    def _should_verify(self) -> bool:
        return self.verify > 0 and self._rng.random() < self.verify

    def _verify(self, peer: str, layer: int, what: str, remote: np.ndarray, local: np.ndarray, inter: int) -> None:
        """Compare ``peer``'s answer with ``local`` (an expert's or a dense range ``inter`` wide)."""
        if peer in self.approximate:
            rtol = ffn_rtol(self.model.config.hidden_size, inter, peer in self.repacked)
            same = not rows_outside(remote, local, rtol).any()
        else:
            same = np.array_equal(remote, local)
        if not same:
            diff = float(np.max(np.abs(remote - local)))
            raise VerificationError(f"peer {peer} answered layer {layer} ({what}) with numbers that differ from "
                                    f"the local recomputation (max |diff| {diff:.3g}); stopping. Remove that "
                                    "peer from the swarm or run without --verify to accept its answers.")
        self.verified += 1

    # --------------------------------------------------------------------- MoE
    def _moe(self, layer: int, x: np.ndarray, seg: np.ndarray | None) -> np.ndarray:
        m, plan = self.model, self.plan
        T, H = x.shape
        routing = route(m.router_logits(layer, x, seg), **m.routing_config(layer).kwargs())
        rows_of = expert_rows(routing)  # expert → rows, experts ascending
        seg_of = {e: None if seg is None else seg[r] for e, r in rows_of.items()}  # each row's sequence
        by_peer: dict[str, list[int]] = {}
        remote: dict[str, bool] = {}  # owner → sent to (asked once per layer)
        for e in rows_of:
            owner = plan.expert_owner(layer, e)
            if owner not in remote:
                remote[owner] = self._remote(owner)
            by_peer.setdefault(owner if remote[owner] else plan.coordinator, []).append(e)

        pending = []
        for peer, experts in by_peer.items():
            if peer == plan.coordinator:
                continue
            counts = np.array([rows_of[e].size for e in experts], dtype=np.int32)
            rows = x[np.concatenate([rows_of[e] for e in experts])]  # [sum n_e, H]
            ids = np.array(experts, dtype=np.int32)
            segs = np.concatenate([run_lengths(seg_of[e], rows_of[e].size) for e in experts])
            pending.append((experts, self._dispatch(
                peer, lambda rid: ExpertRequest(rid, plan.term, plan.version, layer, ids, counts, rows, segs),
                int(counts.sum()))))

        # Our own share while the peers work.
        outputs = {e: self._expert(layer, e, x[rows_of[e]], seg_of[e]) for e in by_peer.get(plan.coordinator, ())}
        shared = m.shared_expert_output(layer, x, seg)

        for experts, p in pending:
            msg = self._await(p)
            if msg is None:  # failed (or warming up): those rows are ours
                outputs.update({e: self._expert(layer, e, x[rows_of[e]], seg_of[e]) for e in experts})
                continue
            bounds = np.concatenate([[0], np.cumsum(msg.row_counts.astype(np.int64))])
            remote = {e: msg.outputs[bounds[i]:bounds[i + 1]] for i, e in enumerate(experts)}
            if self._should_verify():
                for i, e in enumerate(experts):
                    if self._rows_checked(p.peer):
                        w = m.expert_weights(layer, e)
                        self._verify_int8(p.peer, layer, f"expert {e}", w, x[rows_of[e]], remote[e], msg,
                                          slice(bounds[i], bounds[i + 1]))
                        self._give_back(layer, e, w)
                        continue
                    self._verify(p.peer, layer, f"expert {e}", remote[e],
                                 self._expert(layer, e, x[rows_of[e]], seg_of[e]), m.config.moe_intermediate_size)
            outputs.update(remote)
        return combine(T, H, routing, outputs, shared=shared)

    def _layers_here(self, plan: Plan) -> tuple[LocalFFN, frozenset[int]]:
        """The layers whose FFN ``plan`` leaves wholly to the coordinator, none of it streamed
        from the file, and the local engine that runs them: no request to build, nothing to
        combine from elsewhere, so they skip the per-expert dispatch bookkeeping. Under the
        plan's dense ranges, so the partial sums keep their order and the bits stay the same."""
        streamed = {layer for layer, _ in self._streamed}
        here = frozenset(
            layer for layer in range(self.model.config.n_layers)
            if layer not in streamed and all(
                s.peer == plan.coordinator
                for s in (plan.experts if self.model.is_moe_layer(layer) else plan.dense).get(layer, ())))
        return LocalFFN(self.model, plan.dense_ranges()), here

    def _streamed_experts(self, plan: Plan) -> frozenset[tuple[int, int]]:
        """Our experts beyond our budget (``plan.streamed_bytes``, the last ones in layer order):
        read from the file at each use, not kept."""
        left, out = plan.streamed_bytes, set()
        for layer in sorted(plan.experts, reverse=True):
            span = plan.expert_span(layer, plan.coordinator)
            for e in range(span.stop - 1, span.start - 1, -1) if span else ():
                if left <= 0:
                    return frozenset(out)
                out.add((layer, e))
                left -= self.model.expert_weights(layer, e).nbytes
        return frozenset(out)

    def _expert(self, layer: int, e: int, rows: np.ndarray, seg: np.ndarray | None) -> np.ndarray:
        """Expert ``e`` over ``rows`` (of sequences ``seg``) here; an expert the plan gives another
        peer, or one of ours beyond our budget, is read from the mapped file and its pages given
        back after."""
        w = self.model.expert_weights(layer, e)
        out = swiglu_rows(w, rows, seg)
        self._give_back(layer, e, w)
        return out

    def _give_back(self, layer: int, e: int, w: MLPWeights) -> None:
        """After a use of expert ``e``'s weights ``w``: their pages given back when it is another
        peer's or one of ours beyond our budget (read from the mapped file again at its next use)."""
        if (layer, e) in self._streamed or self.plan.expert_owner(layer, e) != self.plan.coordinator:
            for q in (w.gate, w.up, w.down):
                release_pages(q.data)

    # ------------------------------------------------------------------- dense
    def _slice(self, layer: int, lo: int, hi: int):
        key = (layer, lo, hi)
        w = self._dense_slices.get(key)
        if w is None:
            w = self._dense_slices[key] = self.model.dense_weights(layer, lo, hi)
        return w

    def _dense(self, layer: int, x: np.ndarray, seg: np.ndarray | None) -> np.ndarray:
        plan = self.plan
        spans = plan.dense.get(layer)
        if not spans:
            return swiglu_rows(self.model.dense_weights(layer), x, seg)
        segs = run_lengths(seg, x.shape[0])
        pending = {}
        for i, s in enumerate(spans):
            if self._remote(s.peer):
                pending[i] = self._dispatch(
                    s.peer, lambda rid, s=s: DenseRequest(rid, plan.term, plan.version, layer,
                                                          ((s.start, s.stop),), x, segs), x.shape[0])
        partials: list[np.ndarray | None] = [None] * len(spans)
        for i, s in enumerate(spans):
            if i not in pending:
                partials[i] = swiglu_rows(self._slice(layer, s.start, s.stop), x, seg)
        for i, p in pending.items():
            s = spans[i]
            msg = self._await(p)
            if msg is None:  # failed (or warming up): that span is ours
                partials[i] = swiglu_rows(self._slice(layer, s.start, s.stop), x, seg)
                continue
            partials[i] = msg.partials[0]
            if not self._should_verify():
                continue
            w, what = self._slice(layer, s.start, s.stop), f"dense {s.start}:{s.stop}"
            if self._rows_checked(p.peer):
                self._verify_int8(p.peer, layer, what, w, x, partials[i], msg)
            else:
                self._verify(p.peer, layer, what, partials[i], swiglu_rows(w, x, seg), s.stop - s.start)
        return sum_partials(partials)
