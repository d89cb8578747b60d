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

Prefill is the same path with more rows: one batch, one request per peer.

Threading. The forward pass is synchronous numpy, and the FFN seam is a plain
call, so the whole token loop runs in one worker thread and this backend talks
to the asyncio links through thread-safe hand-offs: ``send(peer, msg)`` must be
callable from that thread and must not block (the adapter wraps
``asyncio.run_coroutine_threadsafe``); answers come back through
:meth:`RemoteFFN.deliver` / :meth:`RemoteFFN.peer_down`, called from the event
loop, which complete :class:`concurrent.futures.Future` s. Numpy releases the GIL
in BLAS, so the links keep moving while the coordinator computes its own share.
An async forward would have meant rewriting the engine around the seam; a thread
keeps the engine untouched and the event loop free.

Failure. Every request has a deadline from the peer's measured round trip and
its observed compute time per row. An answer that is late, lost (link down), an
:class:`Error`, or malformed (ids, term, plan version, layer, shapes, dtype,
non-finite values) is replaced by the coordinator computing those rows itself —
it has the model file mapped, so the result is the same bits — and the peer is
marked failed: no more work for it in this step, ``on_peer_failed`` tells the
owner, who rebuilds the plan; :meth:`set_plan` takes effect at the next step
(layer 0), never inside one.

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
and compared — bit for bit for peers of our numeric build, within
``APPROX_RTOL``/``APPROX_ATOL`` for the others (``approximate`` peers, e.g.
WebGPU); a mismatch raises :class:`VerificationError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from swarm.compute.ffn import combine, expert_ffn, expert_rows, route, sum_partials
from swarm.errors import LocalProtocolError, RemoteProtocolError, VerificationError
from swarm.peer.memory import release_pages
from swarm.peer.messages import DenseAnswer, DenseRequest, Error, ExpertAnswer, ExpertRequest
from swarm.peer.planner import Plan

log = logging.getLogger(__name__)

F32 = np.float32

# Deadline of one request, seconds: DEADLINE_MIN_S + RTT_FACTOR × rtt + COMPUTE_FACTOR × the
# peer's observed seconds per row × rows. A peer's first request under a plan that changed its
# share also pays for fetching and decoding its new slices: FIRST_DEADLINE_S covers that.
DEADLINE_MIN_S = 0.25
RTT_FACTOR = 4.0
COMPUTE_FACTOR = 4.0
FIRST_DEADLINE_S = 30.0
EWMA = 0.2  # weight of the newest sample in the per-row compute estimate
# --verify for peers of another numeric build (WebGPU f32 kernels): float32 reassociation only.
APPROX_RTOL = 1e-3
APPROX_ATOL = 1e-4


@dataclass
class PeerTiming:
    """What the coordinator measured about one worker (seconds)."""

    rtt_s: float = 0.002
    s_per_row: float | None = None  # None until a first answer came back
    requests: int = 0
    failures: int = 0
    fresh: bool = True  # no answer yet under its current share (its slices may still be coming)

    def deadline_s(self, rows: int) -> float:
        if self.s_per_row is None or self.fresh:
            return FIRST_DEADLINE_S
        return DEADLINE_MIN_S + RTT_FACTOR * self.rtt_s + COMPUTE_FACTOR * self.s_per_row * rows

    def observe(self, elapsed_s: float, rows: int) -> None:
        sample = max(elapsed_s - self.rtt_s, 0.0) / max(rows, 1)
        if self.s_per_row is None:
            self.s_per_row = sample
        elif not self.fresh:  # a first answer under a new share includes loading it: not a compute sample
            self.s_per_row = (1 - EWMA) * self.s_per_row + EWMA * sample
        self.fresh = False
        self.requests += 1


@dataclass
class _Pending:
    peer: str
    request: ExpertRequest | DenseRequest
    future: cf.Future
    sent_at: float
    deadline: float


Send = Callable[[str, ExpertRequest | DenseRequest], None]


def _share(plan: Plan, peer: str) -> set[tuple[str, int, int, int]]:
    """The spans ``plan`` gives ``peer``: what it must hold."""
    return {(kind, layer, s.start, s.stop) for kind, table in (("e", plan.experts), ("d", plan.dense))
            for layer, spans in table.items() for s in spans if s.peer == peer}


class RemoteFFN:
    """FFN backend of the coordinator; see the module docstring.

    ``model``: the model, memory-mapped (a :class:`swarm.compute.model.Model`); ``plan``:
    the placement (``plan.coordinator`` is us); ``send``: thread-safe, non-blocking
    hand-off of a request to a peer. ``verify``: share of remote answers (0..1)
    recomputed locally. ``on_peer_failed(peer, reason)`` is called (from the
    token-loop thread) once per failed peer.
    """

    def __init__(
        self,
        model,
        plan: Plan,
        send: Send,
        *,
        verify: float = 0.0,
        rng: random.Random | None = None,
        on_peer_failed: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= verify <= 1.0:
            raise LocalProtocolError(f"verify share {verify} must be within 0..1")
        self.model = model
        self.plan = plan
        self.send = send
        self.verify = verify
        self.on_peer_failed = on_peer_failed
        self.timing: dict[str, PeerTiming] = {}
        self.failed: set[str] = set()  # peers given no more work until a new plan
        self.verified = 0  # remote answers recomputed and found equal
        self.remote_rows = 0  # rows answered by peers (status, tests)
        self.local_fallbacks = 0  # requests recomputed here after a failure
        self._rng = rng or random.Random()
        self._clock = clock
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._next_plan: Plan | None = None
        self._next_warming: dict[str, float] = {}
        self.warming_until: dict[str, float] = {}  # peer → clock time its warm-up window ends
        self.approximate: set[str] = set()  # peers verified within a tolerance, not bit for bit
        self._dense_slices: dict[tuple[int, int, int], object] = {}
        self._streamed = self._streamed_experts(plan)

    # ----------------------------------------------------------- event-loop side
    def deliver(self, peer: str, msg: ExpertAnswer | DenseAnswer | Error) -> None:
        """An answer (or Error) arrived from ``peer``. Thread-safe; unknown ids are dropped."""
        with self._lock:
            p = self._pending.get(msg.request_id)
            if p is None or p.peer != peer:
                return  # late answer to a request already recomputed, or a forged id
            del self._pending[msg.request_id]
        if not p.future.done():
            p.future.set_result(msg)

    def peer_down(self, peer: str, reason: str = "link closed") -> None:
        """``peer``'s link went away: its pending requests fail now rather than at their deadline."""
        with self._lock:
            lost = [rid for rid, p in self._pending.items() if p.peer == peer]
            pending = [self._pending.pop(rid) for rid in lost]
        for p in pending:
            if not p.future.done():
                p.future.set_exception(ConnectionError(reason))

    def set_rtt(self, peer: str, rtt_s: float) -> None:
        """Measured link round trip of ``peer`` (from the link's heartbeats)."""
        self.timing.setdefault(peer, PeerTiming()).rtt_s = float(rtt_s)

    def set_plan(self, plan: Plan, warming: dict[str, float] | None = None) -> None:
        """Use ``plan`` from the next step on (applied at layer 0, never inside a step).

        ``warming``: peer → seconds from then on during which its Error answers are
        recomputed without marking it failed (it is still installing its slices).
        """
        self._next_plan, self._next_warming = plan, dict(warming or {})

    # ------------------------------------------------------------ token-loop side
    def ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        """x [T, H] f32 (post-attention-normed rows) → [T, H] f32, as LocalFFN under ``plan``."""
        if x.dtype != F32 or x.ndim != 2:
            raise LocalProtocolError(f"ffn input must be [T, H] float32, got {x.shape} {x.dtype}")
        if layer == 0 and self._next_plan is not None:
            for peer in self._next_plan.peers:  # a changed share means new slices to load first
                if _share(self._next_plan, peer) != _share(self.plan, peer):
                    self.timing.setdefault(peer, PeerTiming()).fresh = True
            self.plan, self._next_plan = self._next_plan, None
            now = self._clock()
            self.warming_until.update({p: now + s for p, s in self._next_warming.items()})
            self.failed.clear()
            self._dense_slices.clear()
            self._streamed = self._streamed_experts(self.plan)
        if self.model.is_moe_layer(layer):
            return self._moe(layer, x)
        return self._dense(layer, x)

    def _remote(self, peer: str) -> bool:
        return peer != self.plan.coordinator and peer not in self.failed

    def _dispatch(self, peer: str, make: Callable[[int], ExpertRequest | DenseRequest], rows: int) -> _Pending:
        rid = next(self._ids) & 0xFFFF_FFFF or next(self._ids)
        req = make(rid)
        now = self._clock()
        timing = self.timing.setdefault(peer, PeerTiming())
        p = _Pending(peer, req, cf.Future(), now, now + timing.deadline_s(rows))
        with self._lock:
            self._pending[rid] = p
        try:
            self.send(peer, req)
        except Exception as exc:  # the link is gone: the rows are recomputed here
            with self._lock:
                self._pending.pop(rid, None)
            p.future.set_exception(ConnectionError(f"send failed: {exc}"))
        return p

    def _await(self, p: _Pending) -> ExpertAnswer | DenseAnswer | None:
        """The peer's answer, or None after a failure (already recorded)."""
        try:
            msg = p.future.result(timeout=max(p.deadline - self._clock(), 0.0))
        except cf.TimeoutError:
            with self._lock:
                self._pending.pop(p.request.request_id, None)
            self._fail(p.peer, f"no answer within {p.deadline - p.sent_at:.3f} s (layer {p.request.layer})")
            return None
        except ConnectionError as exc:
            self._fail(p.peer, str(exc))
            return None
        if isinstance(msg, Error):
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
        rows = p.request.rows.shape[0] if isinstance(p.request, ExpertRequest) else p.request.x.shape[0]
        self.timing[p.peer].observe(self._clock() - p.sent_at, rows)
        self.remote_rows += rows
        return msg

    def _fail(self, peer: str, reason: str) -> None:
        self.local_fallbacks += 1
        t = self.timing.setdefault(peer, PeerTiming())
        t.failures += 1
        if peer in self.failed:
            return
        self.failed.add(peer)
        log.warning("peer %s marked down: %s; its rows are computed by the coordinator", peer, reason)
        if self.on_peer_failed is not None:
            self.on_peer_failed(peer, reason)

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

    def _should_verify(self) -> bool:
        return self.verify > 0 and self._rng.random() < self.verify

    def _verify(self, peer: str, layer: int, what: str, remote: np.ndarray, local: np.ndarray) -> None:
        same = (np.allclose(remote, local, rtol=APPROX_RTOL, atol=APPROX_ATOL) if peer in self.approximate
                else np.array_equal(remote, local))
        if not same:
            diff = float(np.max(np.abs(remote - local)))
            raise VerificationError(f"peer {peer} answered layer {layer} ({what}) with numbers that differ from "
                                    f"the local recomputation (max |diff| {diff:.3g}); stopping. Remove that "
                                    "peer from the swarm or run without --verify to accept its answers.")
        self.verified += 1

    # --------------------------------------------------------------------- MoE
    def _moe(self, layer: int, x: np.ndarray) -> np.ndarray:
        m, plan = self.model, self.plan
        T, H = x.shape
        routing = route(m.router_logits(layer, x), **m.routing_config(layer).kwargs())
        rows_of = expert_rows(routing)  # expert → rows, experts ascending
        by_peer: dict[str, list[int]] = {}
        for e in rows_of:
            owner = plan.expert_owner(layer, e)
            by_peer.setdefault(owner if self._remote(owner) else plan.coordinator, []).append(e)

        pending = []
        for peer, experts in by_peer.items():
            if peer == plan.coordinator:
                continue
            counts = np.array([rows_of[e].size for e in experts], dtype=np.int32)
            rows = x[np.concatenate([rows_of[e] for e in experts])]  # [sum n_e, H]
            ids = np.array(experts, dtype=np.int32)
            pending.append((experts, self._dispatch(
                peer, lambda rid: ExpertRequest(rid, plan.term, plan.version, layer, ids, counts, rows),
                int(counts.sum()))))

        # Our own share while the peers work.
        outputs = {e: self._expert(layer, e, x[rows_of[e]]) for e in by_peer.get(plan.coordinator, ())}
        shared = m.shared_expert_output(layer, x)

        for experts, p in pending:
            msg = self._await(p)
            if msg is None:  # failed (or warming up): those rows are ours
                outputs.update({e: self._expert(layer, e, x[rows_of[e]]) for e in experts})
                continue
            bounds = np.concatenate([[0], np.cumsum(msg.row_counts.astype(np.int64))])
            remote = {e: msg.outputs[bounds[i]:bounds[i + 1]] for i, e in enumerate(experts)}
            if self._should_verify():
                for e in experts:
                    self._verify(p.peer, layer, f"expert {e}", remote[e], self._expert(layer, e, x[rows_of[e]]))
            outputs.update(remote)
        return combine(T, H, routing, outputs, shared=shared)

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

    def _expert(self, layer: int, e: int, rows: np.ndarray) -> np.ndarray:
        """Expert ``e`` over ``rows`` here; an expert the plan gives another peer, or one of ours
        beyond our budget, is read from the mapped file and its pages given back after."""
        w = self.model.expert_weights(layer, e)
        out = expert_ffn(w, rows)
        if (layer, e) in self._streamed or self.plan.expert_owner(layer, e) != self.plan.coordinator:
            for q in (w.gate, w.up, w.down):
                release_pages(q.data)
        return out

    # ------------------------------------------------------------------- dense
    def _slice(self, layer: int, lo: int, hi: int):
        key = (layer, lo, hi)
        w = self._dense_slices.get(key)
        if w is None:
            w = self._dense_slices[key] = self.model.dense_weights(layer, lo, hi)
        return w

    def _dense(self, layer: int, x: np.ndarray) -> np.ndarray:
        plan = self.plan
        spans = plan.dense.get(layer)
        if not spans:
            return expert_ffn(self.model.dense_weights(layer), x)
        pending = {}
        for i, s in enumerate(spans):
            if self._remote(s.peer):
                pending[i] = self._dispatch(
                    s.peer, lambda rid, s=s: DenseRequest(rid, plan.term, plan.version, layer,
                                                          ((s.start, s.stop),), x), x.shape[0])
        partials: list[np.ndarray | None] = [None] * len(spans)
        for i, s in enumerate(spans):
            if i not in pending:
                partials[i] = expert_ffn(self._slice(layer, s.start, s.stop), x)
        for i, p in pending.items():
            s = spans[i]
            msg = self._await(p)
            if msg is None:  # failed (or warming up): that span is ours
                partials[i] = expert_ffn(self._slice(layer, s.start, s.stop), x)
                continue
            partials[i] = msg.partials[0]
            if self._should_verify():
                self._verify(p.peer, layer, f"dense {s.start}:{s.stop}", partials[i],
                             expert_ffn(self._slice(layer, s.start, s.stop), x))
        return sum_partials(partials)
