"""The worker: serves the coordinator's FFN requests from its weight slices.

Theory of operation
-------------------
A worker holds no KV cache and no sequence: each request is answered on its own.
It keeps the latest :class:`~swarm.peer.plan.Plan` it accepted from the
coordinator (and a few before it of the same term, for the step in flight
when the plan changed) and answers only requests that carry one of those terms and versions,
for the layer, experts and dense ranges the plan gives *this* peer. Everything
read from the request is checked before it reaches a kernel; a request that
fails a check earns an :class:`~swarm.peer.net.messages.Error` naming what was
wrong, never an exception out of :meth:`Worker.handle` and never a wrong number.

Slices come from a :class:`SliceSource` — the worker's own copy of the model
(:class:`swarm.compute.model.Model`, loaded lazily by memory map, so only the
assigned experts and ranges are ever decoded) or the slices shipped by the
coordinator. They are materialised when a plan is accepted
(:meth:`Worker.prepare`) and kept for that plan.

The numbers are the engine's own: :func:`swarm.compute.ffn.swiglu_ffn` over exactly one
expert's rows, and over :func:`swarm.compute.ffn.dense_partial`'s slice for a range, in one call
over all the rows of the request: every kernel computes a row from that row alone, so the rows
of several sequences (the request's ``segments``, checked by the codec) need no per-sequence
work here, and the coordinator gets the bits its local path would compute.

On a GPU peer (``join --gpu``) an :class:`FfnDevice` other than the CPU's holds the slices
(uploaded once, when a plan is accepted) and runs the same SwiGLU block with the browser peer's
WGSL kernels (:mod:`swarm.peer.worker.gpu`): another numeric build, checked by the coordinator
within a bound rather than bit for bit. A kernel error answers ``internal`` and drops the
uploaded slices (the device was reset); the next plan or request uploads them again. Under the
int8 numerics a GPU peer answers :class:`ExpertAnswerInt8` / :class:`DenseAnswerInt8`, with the
int8 rows its down products took (:class:`RowsDevice`), on the GPU or past its GPU memory alike. A plan
whose slices for this peer pass the GPU memory it announced is computed on the CPU instead, from
host memory, as a CPU peer's (:func:`swarm.peer.plan.gpu_holds`, the planner's rule).

:meth:`Worker.handle` is synchronous and CPU-heavy: the asyncio adapter runs it
in one worker thread (requests in arrival order), never on the event loop.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, cast

import numpy as np

from swarm.compute import numerics
from swarm.compute.ffn import swiglu_ffn
from swarm.compute.int8_swiglu import swiglu_int8_many
from swarm.compute.kernels import MLPWeights, swiglu_many
from swarm.errors import KernelError, RemoteProtocolError, StaleTermError
from swarm.peer.net.messages import (DenseAnswer, DenseAnswerInt8, DenseRequest, Error, ExpertAnswer,
                                     ExpertAnswerInt8, ExpertRequest)
from swarm.peer.plan import ModelShape, Plan, gpu_holds

log = logging.getLogger(__name__)

F32 = np.float32
KEEP_PLANS = 4  # plans of the current term still served (the newest and its predecessors)
MAX_REQUEST_ROWS = 16384  # rows per request a worker computes (a long prefill is still one batch)


class SliceSource(Protocol):
    """Where a worker's weights come from (a Model satisfies it)."""

    def expert_weights(self, layer: int, e: int) -> MLPWeights: ...

    def dense_weights(self, layer: int, lo: int | None = None, hi: int | None = None) -> MLPWeights: ...


class FfnDevice(Protocol):
    """Where a worker's SwiGLU blocks run: ``load`` takes one block's weights as the source gives
    them and returns what ``run`` computes from (it has ``nbytes``: the bytes it holds);
    ``run(weights, x)`` maps rows x [n, H] float32 to [n, H] float32. Raises KernelError when it
    cannot (a GPU error: the device is reset)."""

    def load(self, weights: MLPWeights) -> Any: ...

    def run(self, weights: Any, x: np.ndarray) -> np.ndarray: ...


class RowsDevice(FfnDevice, Protocol):
    """An FfnDevice that also answers with the int8 rows its down product took (an int8 swarm's
    peer of another build: :func:`swarm.compute.int8_swiglu.swiglu_int8_many`): ``run_rows_many(ws,
    xs)`` → for each block (y [n, H] float32, rows uint8 [n, down row bytes]). Raises ValueError
    for a block without an int8 form, KernelError as ``run``."""

    def run_rows_many(self, weights: list[Any], xs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]: ...


class CpuFfn:
    """The engine's own compiled kernels: the weights as the source gives them (mapped file
    views or shipped slices), :func:`swarm.compute.ffn.swiglu_ffn`."""

    def load(self, weights: MLPWeights) -> MLPWeights:
        return weights

    def run(self, weights: MLPWeights, x: np.ndarray) -> np.ndarray:
        return swiglu_ffn(weights, x)

    def run_rows_many(self, weights: list[MLPWeights],
                      xs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The int8 blocks with their down rows (:class:`RowsDevice`): a GPU peer's answers where its
        plan's slices pass its GPU memory."""
        return swiglu_int8_many(weights, xs)

    def run_many(self, weights: list[MLPWeights], xs: list[np.ndarray]) -> list[np.ndarray]:
        """``[run(w, x) for w, x in zip(weights, xs)]`` with the products of all of them handed
        to the compute threads at once (a request's experts, each too small to split well)."""
        return swiglu_many(weights, xs)


class Worker:
    """Answers :class:`ExpertRequest` / :class:`DenseRequest` for peer ``peer_id``.

    ``shape`` gives the model's sizes for validation; ``source`` the weights; ``device`` where
    they are held and computed (default the CPU: :class:`CpuFfn`); ``gpu_memory``: the bytes of
    GPU memory this peer announced (None or 0: none), a plan past which computes on the CPU.
    """

    def __init__(self, peer_id: str, shape: ModelShape, source: SliceSource, device: FfnDevice | None = None,
                 gpu_memory: int | None = None) -> None:
        self.peer_id = peer_id
        self.shape = shape
        self.source = source
        self.device: FfnDevice = device or CpuFfn()
        self.gpu_memory = gpu_memory
        self._cpu = self.device if device is None else CpuFfn()
        self._devices: dict[tuple[int, int], FfnDevice] = {}  # (term, version) → where its slices compute
        self.plan: Plan | None = None  # the newest accepted plan
        self._plans: dict[tuple[int, int], Plan] = {}  # (term, version) → plan still served
        self.term = 0  # the newest term seen in a plan
        # what a device's load made of each slice, keyed by (slice, on the CPU instead of ``device``)
        self._experts: dict[tuple[int, int, bool], Any] = {}
        self._dense: dict[tuple[int, int, int, bool], Any] = {}
        self._lock = threading.Lock()
        self.served = 0  # answered requests (status, tests)
        # An int8 swarm's GPU peer, another build: its answers carry their down rows (ExpertAnswerInt8)
        self.answers_rows = device is not None and numerics.int8()

    def use_source(self, source: SliceSource) -> None:
        """Take weights from ``source`` for plans accepted from now on (slices of the plans
        still served are already decoded)."""
        self.source = source

    # --------------------------------------------------------------------- plans
    def accept_plan(self, plan: Plan) -> None:
        """Adopt ``plan`` (already checked against the model by :meth:`Plan.from_message`).

        The previous plans of the term stay served too (up to ``KEEP_PLANS`` in all): the
        coordinator switches plans between steps, so requests of the step in flight
        still carry an older version.
        Raises StaleTermError when the term is older than the newest seen, or the
        version is not newer than the current plan's within the same term.
        """
        with self._lock:
            cur = self.plan
            if plan.term < self.term or (cur and plan.term == cur.term and plan.version <= cur.version):
                have = f"term {cur.term} v{cur.version}" if cur else f"term {self.term}"
                raise StaleTermError(f"plan term {plan.term} v{plan.version} is stale: this worker has {have}")
            # Recent plans of the same term stay served (the coordinator may rebuild twice while
            # one step is in flight); a new term deposes the old coordinator and all its plans.
            kept = [p for p in self._plans.values() if p.term == plan.term] + [plan]
            self._plans = {(p.term, p.version): p for p in kept[-KEEP_PLANS:]}
            self.plan, self.term = plan, plan.term
            on_gpu = gpu_holds(plan.bytes_of(self.peer_id, self.shape), self.gpu_memory, self.shape.step_bytes)
            self._devices = {k: self._devices.get(k, self.device if on_gpu else self._cpu) for k in self._plans}
            keep_e = {(l, e) for p in self._plans.values() for l, spans in p.experts.items() for s in spans
                      if s.peer == self.peer_id for e in range(s.start, s.stop)}
            keep_d = {(l, s.start, s.stop) for p in self._plans.values() for l, spans in p.dense.items()
                      for s in spans if s.peer == self.peer_id}
            self._experts = {k: v for k, v in self._experts.items() if k[:2] in keep_e}
            self._dense = {k: v for k, v in self._dense.items() if k[:3] in keep_d}

    def serves(self, term: int, version: int) -> bool:
        """True when requests of plan ``version`` of ``term`` are answered (it was accepted)."""
        with self._lock:
            return (term, version) in self._plans

    def prepare(self) -> int:
        """Materialise every slice of the current plan now; returns their bytes."""
        plan = self.plan
        if plan is None:
            return 0
        device = self.device_of(plan)
        total = 0
        for layer, spans in plan.experts.items():
            for s in spans:
                if s.peer == self.peer_id:
                    total += sum(self._expert(device, layer, e).nbytes for e in range(s.start, s.stop))
        for layer, spans in plan.dense.items():
            for s in spans:
                if s.peer == self.peer_id:
                    total += self._dense_slice(device, layer, s.start, s.stop).nbytes
        return total

    def device_of(self, plan: Plan) -> FfnDevice:
        """Where ``plan``'s slices compute (an accepted plan): ``device``, or the CPU where they
        pass the announced GPU memory (:func:`swarm.peer.plan.gpu_holds`)."""
        return self._devices.get((plan.term, plan.version), self.device)

    def _expert(self, device: FfnDevice, layer: int, e: int) -> Any:
        key = (layer, e, device is not self.device)
        w = self._experts.get(key)
        if w is None:
            w = self._experts[key] = device.load(self.source.expert_weights(layer, e))
        return w

    def _dense_slice(self, device: FfnDevice, layer: int, lo: int, hi: int) -> Any:
        key = (layer, lo, hi, device is not self.device)
        w = self._dense.get(key)
        if w is None:
            w = self._dense[key] = device.load(self.source.dense_weights(layer, lo, hi))
        return w

    # ------------------------------------------------------------------ requests
    def handle(self, msg: ExpertRequest | DenseRequest) -> ExpertAnswer | DenseAnswer | Error:
        """Answer one request, or refuse it with an Error (``stale_term``, ``bad_request``;
        ``internal`` when the device failed: its uploaded slices are dropped)."""
        try:
            match msg:
                case ExpertRequest():
                    answer = self._experts_answer(msg)
                case DenseRequest():
                    answer = self._dense_answer(msg)
                case _:
                    raise RemoteProtocolError(f"{type(msg).__name__} is not an FFN request")
        except StaleTermError as exc:
            return Error(msg.request_id, "stale_term", str(exc))
        except RemoteProtocolError as exc:
            log.warning("refused FFN request %s: %s", getattr(msg, "request_id", "?"), exc)
            return Error(getattr(msg, "request_id", 0), "bad_request", str(exc))
        except KernelError as exc:
            log.warning("FFN request %s failed on the device: %s", msg.request_id, exc)
            with self._lock:
                self._experts, self._dense = {}, {}  # uploaded to a device that was reset
            return Error(msg.request_id, "internal", str(exc))
        self.served += 1
        return answer

    def _check_common(self, msg: ExpertRequest | DenseRequest, x: np.ndarray) -> Plan:
        plan = self._plans.get((msg.term, msg.plan_version))
        if plan is None:
            have = ", ".join(f"term {t} v{v}" for t, v in sorted(self._plans)) or "no plan yet"
            raise StaleTermError(f"request of term {msg.term} v{msg.plan_version}: this worker serves {have}")
        H = self.shape.hidden_size
        if x.dtype != F32 or x.ndim != 2 or x.shape[1] != H:
            raise RemoteProtocolError(f"layer {msg.layer}: rows must be [n, {H}] float32, got {x.shape} {x.dtype}")
        if x.shape[0] > MAX_REQUEST_ROWS:
            raise RemoteProtocolError(f"layer {msg.layer}: {x.shape[0]} rows exceed {MAX_REQUEST_ROWS}")
        if not np.isfinite(x).all():
            raise RemoteProtocolError(f"layer {msg.layer}: rows hold NaN or infinity")
        return plan

    def _experts_answer(self, msg: ExpertRequest) -> ExpertAnswer:
        plan = self._check_common(msg, msg.rows)
        span = plan.expert_span(msg.layer, self.peer_id)
        ids = msg.expert_ids.astype(np.int64)
        if span is None:
            raise RemoteProtocolError(f"layer {msg.layer}: plan v{plan.version} gives this worker no experts")
        if ids.size == 0 or ((ids < span.start) | (ids >= span.stop)).any():
            raise RemoteProtocolError(f"layer {msg.layer}: experts {ids.tolist()[:8]} are outside this worker's "
                                      f"{span.start}..{span.stop - 1}")
        counts = msg.row_counts.astype(np.int64)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        outputs = np.empty_like(msg.rows)
        device = self.device_of(plan)
        parts = [(self._expert(device, msg.layer, e), bounds[i], bounds[i + 1]) for i, e in enumerate(ids.tolist())
                 if bounds[i + 1] > bounds[i]]
        if self.answers_rows:
            if not parts:  # no rows at all: no down rows, but rows of the down matrix's width
                parts = [(self._expert(device, msg.layer, int(ids[0])), 0, 0)]
            got = _rows_of(device, [w for w, _, _ in parts], [msg.rows[a:b] for _, a, b in parts], msg.layer)
            for (_, a, b), (y, _) in zip(parts, got):
                outputs[a:b] = y
            return ExpertAnswerInt8(msg.request_id, msg.term, msg.plan_version, msg.layer, msg.expert_ids,
                                    msg.row_counts, outputs, np.concatenate([r for _, r in got]))
        run_many = getattr(device, "run_many", None)
        if run_many is not None:  # the request's experts as one group of products
            ys = run_many([w for w, _, _ in parts], [np.ascontiguousarray(msg.rows[a:b]) for _, a, b in parts])
        else:
            ys = [device.run(w, msg.rows[a:b]) for w, a, b in parts]
        for (_, a, b), y in zip(parts, ys):
            outputs[a:b] = y
        return ExpertAnswer(msg.request_id, msg.term, msg.plan_version, msg.layer,
                            msg.expert_ids, msg.row_counts, outputs)

    def _dense_answer(self, msg: DenseRequest) -> DenseAnswer:
        plan = self._check_common(msg, msg.x)
        span = plan.dense_span(msg.layer, self.peer_id)
        want = ((span.start, span.stop),) if span else None
        if tuple(msg.ranges) != want:
            raise RemoteProtocolError(f"layer {msg.layer}: ranges {list(msg.ranges)} are not this worker's "
                                      f"{list(want) if want else 'none'} in plan v{plan.version}")
        device = self.device_of(plan)
        if self.answers_rows:  # a worker's ranges of a layer are one span
            ((y, rows),) = _rows_of(device, [self._dense_slice(device, msg.layer, *msg.ranges[0])], [msg.x], msg.layer)
            return DenseAnswerInt8(msg.request_id, msg.term, msg.plan_version, msg.layer, msg.ranges, y[None], rows)
        partials = np.stack([device.run(self._dense_slice(device, msg.layer, lo, hi), msg.x) for lo, hi in msg.ranges])
        return DenseAnswer(msg.request_id, msg.term, msg.plan_version, msg.layer, msg.ranges, partials)


def _rows_of(device: FfnDevice, weights: list[Any], xs: list[np.ndarray],
             layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``device.run_rows_many`` (:class:`RowsDevice`); RemoteProtocolError for a block with no int8
    form (the coordinator of an int8 swarm plans none such for a GPU peer)."""
    try:
        return cast(RowsDevice, device).run_rows_many(weights, [np.ascontiguousarray(x) for x in xs])
    except ValueError as exc:
        raise RemoteProtocolError(f"layer {layer}: no int8 answer with down rows here: {exc}") from None
