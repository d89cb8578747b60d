"""The worker's side of layer stages: :class:`StageRunner` runs the layers of the stages a layout
(:class:`~swarm.peer.plan.StageLayout`) gives this peer, with a KV cache per sequence
(:class:`StageCache`), and answers each :class:`StageRequest` with the rows after them. It runs
the engine's own ``Model.layers`` on the rows, so the coordinator gets the local run's bits.

KV caches. Each stage holds the keys/values of its layers for every sequence in flight, keyed by
the sequence id the coordinator gives each new cache (``start == 0``). A request for positions
``start ..`` first truncates the stage's cache to ``start`` (re-running a suffix is a smaller
``start``; so is the coordinator's prefix reuse, which continues a finished sequence's cache from
the prefix a new prompt shares with it); a stage that holds fewer positions, or whose layers keep a
recurrent state that cannot run on from ``start`` (:class:`~swarm.compute.deltanet.RecurrentState`),
answers ``cache_gap`` and the coordinator resends the sequence from position 0. A stage peer keeps keys/values for its
own layers only, and those of finished sequences until ``max_sequences`` newer ones push them out;
a sequence stepped within ``IN_FLIGHT_S`` is in flight and never dropped (several batch schedulers
step their own sequences in turn).

GPU. On a GPU peer (``join --gpu``) a :class:`StageDevice`
(:class:`~swarm.peer.worker.gpu.GpuStage`) computes each layer's weight products — Q, K, V, O
and the FFN — through a view of the model (:meth:`~swarm.compute.model.Model.with_products`)
and as the FFN backend of ``Model.layers``: the same layer code, another numeric build, whose
answers the coordinator checks within a bound. A stage whose layers all have standard attention
runs wholly on the device instead (``resident``: norms, RoPE and attention too, each sequence's
keys/values in device buffers on its :class:`StageCache`). A device error answers ``internal``, drops the
uploads (the device was reset) and every sequence's cache (resent from position 0); the next
request uploads again. A stage whose layers' weights and KV cache, as the plan counts them
(:func:`~swarm.peer.weights.sizes.stage_nbytes`), pass the GPU memory the peer announced runs on
the engine's CPU kernels instead, from host memory, as a CPU peer's would — the rule the
planner applies (:func:`~swarm.peer.plan.gpu_holds`), so that the planner prices it there.

Threading. Synchronous and CPU-heavy: run off the event loop, except a short step (a decode
token: :meth:`StageRunner.take_inline`), which runs on the event loop that received it, sparing
the two thread hand-offs to the compute thread and back — never on a GPU peer, whose device is
used from the compute thread only (its FFN ranges share it). The coordinator's side is
:mod:`swarm.peer.coordinator.stages`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import numpy as np

from swarm.compute.ffn import FFNBackend
from swarm.compute.model import KVCache, ProductDevice
from swarm.compute.serving import MAX_BATCH_LIMIT
from swarm.errors import KernelError, RemoteProtocolError, StaleTermError
from swarm.peer.net.messages import Error, StageAnswer, StageRequest
from swarm.peer.plan import INLINE_ROWS, StageLayout, gpu_holds
from swarm.peer.weights.sizes import stage_nbytes

log = logging.getLogger(__name__)

F32 = np.float32
KEEP_PLANS = 4  # stage layouts of the current term a worker still serves
MAX_SEQUENCES = 8  # KV caches a stage keeps beyond those in flight (least recently used dropped first)
# A sequence stepped within this long is in flight: its cache is never dropped. Several batch
# schedulers (the API's pool) step disjoint sequences in turn; keeping only the step at hand's
# made each scheduler's step evict the other's caches, and every step resent them from position 0.
IN_FLIGHT_S = 5.0
MAX_STAGE_ROWS = 16384  # rows per stage request (a long prefill is still one batch)
# A stage step of at most INLINE_ROWS rows whose last such step took at most INLINE_MAX_S is run on
# the event loop that received it: two thread hand-offs (to the compute thread and back) cost more
# than the step on a busy machine, and blocking the loop this long delays no heartbeat.
INLINE_MAX_S = 0.1


class StageCache(KVCache):
    """A KV cache for a stage's layers ``lo .. hi-1``: their arrays from the start, the other
    layers' never (a worker runs only its own; :class:`~swarm.compute.model.KVCache` allocates a
    layer when it first runs). Same interface as :class:`~swarm.compute.model.KVCache`."""

    def __init__(self, config, lo: int, hi: int, capacity: int = 16) -> None:
        self.own = range(lo, hi)
        super().__init__(config, capacity)
        for layer in self.own:
            self.layer(layer)
        self.device_kv: dict = {}  # layer → its keys/values in a device's buffers (a GPU stage's)



class DeviceKVFull(ValueError):
    """A device's keys/values would pass the positions the plan counted for it (all sequences
    together): the request is refused (``bad_request``) unless dropping finished sequences'
    keys/values there makes room."""


class StageDevice(ProductDevice, FFNBackend, Protocol):
    """Where a GPU peer's stage layers compute their weight products (module docstring, "GPU"):
    the attention projections (``matmul_many``) and the FFN (``ffn``) of the layers it holds.
    Its methods raise KernelError when the device fails."""

    def load_layer(self, layer: int) -> int:
        """Upload layer ``layer``'s weights now; returns the bytes held for them."""
        ...

    def keep_layers(self, layers: set[int]) -> None:
        """Drop the weights of every other layer."""
        ...

    def reset(self) -> None:
        """Forget every upload (the device was reset)."""
        ...

    def resident(self, lo: int, hi: int) -> bool:
        """Whether layers ``lo .. hi-1`` run wholly on the device (:meth:`run_layers`), their KV
        cache in its buffers; else ``Model.layers`` runs them with the products on the device."""
        ...

    def run_layers(self, x: np.ndarray, cache: StageCache, start: int, lo: int, hi: int) -> np.ndarray:
        """One sequence's rows x [T, H] f32 at positions ``start ..`` through layers ``lo .. hi-1``
        on the device → [T, H] f32; its keys/values in ``cache.device_kv``."""
        ...


class StageRunner:
    """Answers :class:`StageRequest` s for peer ``peer_id`` from ``model`` (a memory-mapped
    :class:`swarm.compute.model.Model`: only the stage's layers are ever read), keeping a KV
    cache per sequence. Every field of a request is checked before it reaches a kernel; a bad
    one earns an :class:`Error` naming it (codes ``stale_term``, ``bad_request``, ``cache_gap``;
    ``internal`` when ``device`` failed). ``device``: where the layers' weight products run
    (None: the engine's kernels; module docstring, "GPU"); ``gpu_memory``: the bytes of GPU
    memory this peer announced (None or 0: none, the device takes every stage), a stage past
    which runs on the engine's kernels (:meth:`on_device`).
    """

    def __init__(self, peer_id: str, model, max_sequences: int = MAX_SEQUENCES, *,
                 clock: Callable[[], float] = time.monotonic, device: StageDevice | None = None,
                 gpu_memory: int | None = None) -> None:
        self.peer_id = peer_id
        self._clock = clock
        self.model = model
        self.device = device
        self.gpu_memory = gpu_memory
        self._on_device: dict[tuple[int, int], bool] = {}  # stage → on_device's answer
        self._layers = model.with_products(device) if device is not None else model  # runs the layers
        self.max_sequences = max_sequences
        self._layouts: dict[tuple[int, int], StageLayout] = {}
        self.term = 0
        self._caches: OrderedDict[tuple[int, int, int], StageCache] = OrderedDict()  # (sequence, lo, hi) → its cache
        self._used: dict[tuple[int, int, int], float] = {}  # the same keys → when last stepped (clock)
        self._lock = threading.Lock()
        self._busy = 0  # requests queued for the compute thread or being computed
        self._step_s: dict[tuple[int, int], float] = {}  # (lo, hi) → seconds per row of its last short step
        self.served = 0
        self.inline = 0  # requests that take_inline said to run on the receiving thread

    def take_inline(self, msg: StageRequest) -> bool:
        """Whether to run ``msg`` on the thread that received it (the event loop; counted in
        ``inline``): at most ``INLINE_ROWS`` rows, its stage's last short step took at most
        ``INLINE_MAX_S``, and no other request is queued or being computed (they would race for the CPU,
        and a sequence's steps must keep their order)."""
        rows = msg.x.shape[0] if isinstance(msg.x, np.ndarray) and msg.x.ndim == 2 else INLINE_ROWS + 1
        s = self._step_s.get((msg.layer_start, msg.layer_stop))
        short = rows <= INLINE_ROWS and s is not None and s * rows <= INLINE_MAX_S
        if self.device is None and short and not self._busy:
            self.inline += 1
            return True
        return False

    def on_device(self, lo: int, hi: int) -> bool:
        """Whether layers ``lo .. hi-1`` compute on ``device``: it is set and their weights and KV
        cache fit the announced GPU memory (:func:`~swarm.peer.plan.gpu_holds`); else on the
        engine's CPU kernels, their KV cache in host memory."""
        if self.device is None:
            return False
        if (lo, hi) not in self._on_device:
            held, step = stage_nbytes(self.model, lo, hi)
            self._on_device[(lo, hi)] = gpu_holds(held, self.gpu_memory, step)
        return self._on_device[(lo, hi)]

    def submit(self, executor: cf.Executor, msg: StageRequest) -> cf.Future:
        """Queue ``handle(msg)`` on ``executor``; the request counts as busy from now until it is
        answered (or cancelled unstarted), so :meth:`take_inline` never runs a step beside it."""
        with self._lock:
            self._busy += 1
        try:
            fut = executor.submit(self.handle, msg)
        except BaseException:
            self._release()
            raise
        fut.add_done_callback(lambda _: self._release())
        return fut

    def _release(self) -> None:
        with self._lock:
            self._busy -= 1

    def accept(self, layout: StageLayout) -> None:
        """Serve ``layout`` (and up to ``KEEP_PLANS - 1`` earlier ones of its term, for the
        sequences that started under them). StaleTermError for an older term."""
        with self._lock:
            if layout.term < self.term:
                raise StaleTermError(f"stage plan of term {layout.term}: this peer is in term {self.term}")
            kept = [p for p in self._layouts.values() if p.term == layout.term] + [layout]
            self._layouts = {(p.term, p.version): p for p in kept[-KEEP_PLANS:]}
            self.term = layout.term
            ranges = {(s.start, s.stop) for p in self._layouts.values() for s in p.stages if s.peer == self.peer_id}
            for key in [k for k in self._caches if k[1:] not in ranges]:
                del self._caches[key]
                self._used.pop(key, None)

    def forget(self) -> int:
        """Drop every sequence's KV cache (as a restart does); returns how many were held."""
        with self._lock:
            n = len(self._caches)
            self._caches.clear()
            self._used.clear()
        return n

    def _drop_idle_device_kv(self, keep: list[StageCache]) -> int:
        """Drop the caches outside ``keep`` that hold keys/values on the device and were not
        stepped within ``IN_FLIGHT_S`` (finished sequences, kept for reuse): the device's
        buffers go with them, and a later request of theirs gets ``cache_gap``. Returns how many."""
        now, held = self._clock(), {id(c) for c in keep}
        with self._lock:
            idle = [k for k, c in self._caches.items()
                    if id(c) not in held and c.device_kv and now - self._used.get(k, now) > IN_FLIGHT_S]
            for key in idle:
                del self._caches[key]
                self._used.pop(key, None)
        return len(idle)

    def serves(self, term: int, version: int) -> bool:
        """Whether requests of plan ``version`` of ``term`` are served."""
        return (term, version) in self._layouts

    def prepare(self) -> None:
        """Open this peer's layers of the newest layout now — attention, router, every expert or
        the dense MLP, uploaded to the device if it has one — not in its first (deadline-bound)
        requests. Raises KernelError when the device fails."""
        layout = max(self._layouts.values(), key=lambda p: p.version, default=None)
        m = self.model
        if self.device is not None:  # here, on the compute thread: the device is used from it only
            with self._lock:
                mine = {layer for p in self._layouts.values() for s in p.stages
                        if s.peer == self.peer_id and self.on_device(s.start, s.stop)
                        for layer in range(s.start, s.stop)}
            self.device.keep_layers(mine)  # the uploads of stages no layout served gives this peer go
            try:
                for layer in sorted(mine):
                    self.device.load_layer(layer)
            except KernelError:
                self.device.reset()
                raise
        for s in layout.stages if layout else ():
            for layer in range(s.start, s.stop) if s.peer == self.peer_id else ():
                m.attention_weights(layer)
                if not m.is_moe_layer(layer):
                    m.dense_weights(layer)
                    continue
                m.router(layer)
                for e in range(m.config.n_experts):
                    m.expert_weights(layer, e)
                if m.has_shared_expert(layer):
                    m.shared_expert_weights(layer)

    def handle(self, msg: StageRequest) -> StageAnswer | Error:
        """Run the request's rows through its layers, or refuse it with an Error."""
        with self._lock:
            self._busy += 1
        try:
            return self._answer(msg)
        except StaleTermError as exc:
            return Error(msg.request_id, "stale_term", str(exc))
        except _CacheGap as exc:
            return Error(msg.request_id, "cache_gap", str(exc))
        except (RemoteProtocolError, ValueError) as exc:  # ValueError: the model refused the rows
            log.warning("refused stage request %s: %s", msg.request_id, exc)
            return Error(msg.request_id, "bad_request", str(exc))
        except KernelError as exc:
            log.warning("stage request %s failed on the device: %s", msg.request_id, exc)
            if self.device is not None:
                self.device.reset()
                self.forget()  # keys/values in its buffers went with it: the sequences are resent from 0
            return Error(msg.request_id, "internal", str(exc))
        finally:
            self._release()

    def _answer(self, msg: StageRequest) -> StageAnswer:
        layout = self._layouts.get((msg.term, msg.plan_version))
        if layout is None:
            have = ", ".join(f"term {t} v{v}" for t, v in sorted(self._layouts)) or "no stage plan yet"
            raise StaleTermError(f"stage request of term {msg.term} v{msg.plan_version}: this peer serves {have}")
        lo, hi, x = msg.layer_start, msg.layer_stop, msg.x
        if not layout.holds(self.peer_id, lo, hi):
            raise RemoteProtocolError(f"layers {lo}:{hi} are not a stage of this peer in plan v{msg.plan_version}")
        H = self.model.config.hidden_size
        if x.dtype != F32 or x.shape[1] != H or x.shape[0] > MAX_STAGE_ROWS:
            raise RemoteProtocolError(f"rows must be [1..{MAX_STAGE_ROWS}, {H}] float32, got {x.shape} {x.dtype}")
        if not np.isfinite(x).all():
            raise RemoteProtocolError("rows hold NaN or infinity")
        if len(msg.segments) > MAX_BATCH_LIMIT:
            raise RemoteProtocolError(f"{len(msg.segments)} sequences in one step; at most {MAX_BATCH_LIMIT}")
        with self._lock:
            caches: list[StageCache] = []
            gaps: list[str] = []
            for s in msg.segments:  # every sequence is checked before any cache changes
                cache = self._caches.get((s.sequence, lo, hi))
                if s.start == 0:
                    cache = StageCache(self.model.config, lo, hi)
                elif cache is None or cache.length < s.start:
                    gaps.append(f"sequence {s.sequence}: holds {0 if cache is None else cache.length} "
                                f"positions, the request starts at {s.start}")
                    continue
                elif not cache.resumes(s.start, lo, hi):  # a recurrent state cannot go back there
                    gaps.append(f"sequence {s.sequence}: its recurrent state cannot run on from position {s.start}")
                    continue
                caches.append(cache)
            if gaps:
                raise _CacheGap(f"layers {lo}:{hi}: " + "; ".join(gaps) + "; resend from position 0")
            now = self._clock()
            for s, cache in zip(msg.segments, caches):
                self._caches.pop((s.sequence, lo, hi), None)
                self._caches[(s.sequence, lo, hi)] = cache  # most recently used last
                self._used[(s.sequence, lo, hi)] = now
            # Per stage range held, max_sequences beyond those in flight (stepped within
            # IN_FLIGHT_S: this step's, and other schedulers' steps between ours).
            keep = self.max_sequences * len({k[1:] for k in self._caches})
            while len(self._caches) > keep and now - self._used[next(iter(self._caches))] > IN_FLIGHT_S:
                self._used.pop(self._caches.popitem(last=False)[0])
        for s, cache in zip(msg.segments, caches):
            cache.truncate(s.start)
        t0 = time.perf_counter()
        m, ffn = (self._layers, self.device) if self.on_device(lo, hi) else (self.model, None)
        if ffn is not None and ffn.resident(lo, hi):  # each sequence on its own: its cache is on the device
            bounds = np.cumsum([0, *(s.rows for s in msg.segments)]).tolist()
            on_device = lambda: np.concatenate([ffn.run_layers(x[a:b], cache, s.start, lo, hi)  # noqa: E731
                                                for s, cache, a, b in zip(msg.segments, caches, bounds, bounds[1:])])
            try:
                out = on_device()
            except DeviceKVFull:
                if not self._drop_idle_device_kv(caches):
                    raise
                out = on_device()  # a sequence that ran before the shortfall writes the same values again
        elif len(msg.segments) == 1:
            out = m.layers(x, caches[0], msg.segments[0].start, lo, hi, ffn)
        else:
            out = m.layers_batch(x, [(c, s.start, s.rows) for s, c in zip(msg.segments, caches)], lo, hi, ffn)
        compute_s = time.perf_counter() - t0
        if x.shape[0] <= INLINE_ROWS:
            self._step_s[(lo, hi)] = compute_s / x.shape[0]
        for s, cache in zip(msg.segments, caches):
            cache.length = s.start + s.rows
        self.served += 1
        return StageAnswer(msg.request_id, msg.term, msg.plan_version, msg.segments, lo, hi, compute_s, out)


class _CacheGap(Exception):
    """The stage holds fewer positions of a sequence than a request assumes."""

