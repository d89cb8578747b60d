"""Continuous batching: many sequences share each forward step (docs/serving.md).

Theory of operation
-------------------
:class:`BatchScheduler` owns one thread that runs steps while there is work and ends when there
is none. Each step takes, in arrival order, every running sequence's next rows:

* a sequence still reading its prompt contributes its next **chunk**: positions
  ``[k·chunk, (k+1)·chunk)`` of the prompt, fixed by the prompt alone, so a sequence is cut the
  same way whatever else runs; chunks of several newcomers share a step while their rows fit
  ``prefill_rows`` (the first always goes);
* a decoding sequence contributes its last sampled token (one row).

:meth:`~swarm.compute.model.Model.forward_batch` runs the step: attention per sequence on its
own KV cache (which grows with the sequence, never reserved from the prompt), the FFN over the
union of the rows with their segments, so every row is bit-identical to its solo run and the
sequence's tokens do not depend on its neighbours. After the step, each sequence that produced
logits samples its next token with its own :class:`~swarm.compute.sampling.Sampler` (its
generator, its penalties and logit bias, its logprobs), here on the scheduler's machine.

Sequences join and leave between steps. At most ``max_batch`` run, and with ``max_positions``
only as many as whose prompt + ``max_tokens`` fit that many KV positions together (a swarm's
memory plan reserves the KV cache of ``join --context`` positions); up to ``max_queue`` more wait
in arrival order; beyond that :meth:`BatchScheduler.submit` raises :class:`QueueFullError`
with a suggested wait. A cancelled sequence (its client went away) leaves at the end of the step
in flight — within one chunk of prefill or one decode step — and its slot goes to the next.

Prefix reuse (:mod:`swarm.compute.prefix`): a sequence that leaves keeps its KV cache in the
scheduler's (a pool's: shared) :class:`~swarm.compute.prefix.PrefixStore`, within the positions
``max_positions`` leaves beside the running sequences' claims; a sequence that joins with a prompt
starting with those tokens takes the cache over and prefills only the rest of its prompt, in the
same chunk bounds. Its tokens are those of a full prefill (every row's keys/values are its own).

Several schedulers (:class:`SchedulerPool`): when the FFN backend runs stages on other peers,
one scheduler's step waits for every stage in turn; two schedulers sharing the stages keep them
busy, one's step at a stage while the other's is at the next. A pool's schedulers share one
lock and one set of limits — ``max_batch`` running, ``max_queue`` waiting and ``max_positions``
over all of them, admitted in arrival order across them (a newer sequence joins its member while
an older one waits on another only if a slot and its positions are left for that one: it need
not wait for the other's step to end) — and each steps its own sequences on its own thread. A
new sequence goes to the least loaded of the first ``width`` schedulers and stays there until
sequences that finished leave the groups uneven: then a scheduler, between two of its steps,
hands sequences to another (:meth:`SchedulerPool.rebalance`); with ``width`` 1 the pool is one
scheduler as above.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from swarm.compute.ffn import LayerBackend
from swarm.compute.prefix import PrefixStore
from swarm.compute.sampling import PREFILL_CHUNK, Sampled, Sampler, SamplingParams, scored
from swarm.errors import SwarmError

if TYPE_CHECKING:
    from swarm.compute.ffn import FFNBackend
    from swarm.compute.model import Model

CHUNK_TOKENS = PREFILL_CHUNK  # prompt rows per prefill chunk: where generate() cuts a prompt too
PREFILL_ROWS = 128  # prefill rows per step, all newcomers together (the first chunk always goes)
MAX_BATCH = 8  # sequences that run at once
# The most sequences one step may carry, whatever join --max-batch asks: a stage peer keeps the KV
# caches of every sequence in a step it serves, and refuses a request with more.
MAX_BATCH_LIMIT = 64
MAX_QUEUE = 32  # sequences that wait for a slot
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 120

log = logging.getLogger(__name__)
_DONE = object()
_limits = {"max_batch": MAX_BATCH, "max_queue": MAX_QUEUE}  # this process's defaults (join --max-batch/--max-queue)


def set_default_limits(max_batch: int | None = None, max_queue: int | None = None) -> None:
    """Set the limits schedulers made from now on take when given none (None: keep).

    Raises ValueError for max_batch outside 1..MAX_BATCH_LIMIT or max_queue < 0."""
    if (max_batch is not None and not 1 <= max_batch <= MAX_BATCH_LIMIT) or (max_queue is not None and max_queue < 0):
        raise ValueError(f"max_batch must be 1..{MAX_BATCH_LIMIT} and max_queue ≥ 0, got {max_batch} and {max_queue}")
    if max_batch is not None:
        _limits["max_batch"] = max_batch
    if max_queue is not None:
        _limits["max_queue"] = max_queue


def default_max_batch() -> int:
    """Sequences a scheduler runs at once by default in this process (``join --max-batch``)."""
    return _limits["max_batch"]


class QueueFullError(SwarmError):
    """Every slot and every queue place is taken; ``retry_after_s``: a suggested wait (s, ≥ 1)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class _Seq:
    ident: int
    prompt: list[int]
    params: SamplingParams
    cache: Any = None  # its KVCache once admitted
    fed: int = 0  # prompt tokens already in the cache
    last: int | None = None  # the sampled token the next decode step feeds
    generated: int = 0
    cancelled: bool = False
    failed: bool = False  # its step failed: its cache is not kept for reuse
    reused: int = 0  # prompt tokens its cache held when it joined (prefix reuse)
    emitted: list[int] = field(default_factory=list)  # every sampled token, in order
    owner: object | None = None  # the layer backend of its last step (prefix.py), None: KV all here
    prompt_scored: list[Sampled] = field(default_factory=list)  # params.prompt_logprobs: its prompt's tokens
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    sampler: Sampler | None = None
    listener: Callable[[list[Any]], None] | None = None  # TokenStream.listen's: told of new items
    key: Any = None  # what the listener is told

    def next_rows(self, chunk: int) -> list[int]:
        if self.fed < len(self.prompt):  # to the next chunk bound: a reused prefix keeps the cuts
            return self.prompt[self.fed:min((self.fed // chunk + 1) * chunk, len(self.prompt))]
        assert self.last is not None  # a sequence past its prompt has sampled a token
        return [self.last]


class TokenStream:
    """The token ids of one sequence, as the scheduler produces them (a blocking iterator);
    :meth:`sampled` iterates the same tokens as :class:`~swarm.compute.sampling.Sampled`, with
    their logprobs when the sequence's params ask for them.

    Ends after a stop token (yielded) or ``max_tokens``; raises what failed its step (e.g. a
    :class:`~swarm.errors.SwarmError` of the swarm). :meth:`cancel` (any thread) takes the
    sequence out of the batch at the end of the step in flight and ends the iteration.
    """

    def __init__(self, scheduler: BatchScheduler, seq: _Seq) -> None:
        self._scheduler, self._seq = scheduler, seq

    @property
    def ident(self) -> int:
        return self._seq.ident

    @property
    def reused(self) -> int:
        """Prompt tokens taken from a kept KV cache (prefix reuse), not prefilled; known once the
        sequence has joined the batch (before its first token)."""
        return self._seq.reused

    @property
    def prompt_sampled(self) -> list[Sampled]:
        """With ``params.prompt_logprobs``: the prompt's tokens with their logprobs (the first
        with none), complete once the first generated token has come (or the stream ended)."""
        return self._seq.prompt_scored

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        return self.next_sampled().token

    def next_sampled(self) -> Sampled:
        """The next token with its logprobs (blocks); StopIteration at the end."""
        item = self._seq.out.get()
        if item is _DONE:
            self._seq.out.put(_DONE)  # later calls end too
            raise StopIteration
        if isinstance(item, BaseException):
            self._seq.out.put(_DONE)
            raise item
        return item

    def sampled(self) -> Iterator[Sampled]:
        """The remaining tokens as :class:`~swarm.compute.sampling.Sampled`."""
        while True:
            try:
                yield self.next_sampled()
            except StopIteration:
                return

    def listen(self, listener: Callable[[list[Any]], None] | None, key: Any = None) -> None:
        """Have ``listener(keys)`` called (on the scheduler's thread, or the thread that cancels or
        fails the sequence) after items were queued for this stream: ``keys`` holds ``key``, and
        the keys of every other stream with the same listener that the same step fed — one call
        per listener per step, not one per stream. Called at once when items are queued already.
        The listener must not block; it takes the items with :meth:`drain`. None: stop listening."""
        self._seq.key, self._seq.listener = key, listener
        if listener is not None and not self._seq.out.empty():  # queued before it listened
            listener([key])

    def drain(self) -> tuple[list[Sampled], bool | BaseException]:
        """The tokens queued now, without blocking, and how the stream stands after them: False
        (more to come), True (it ended) or the exception that failed it (raised by the blocking
        iteration at that point)."""
        items: list[Sampled] = []
        out = self._seq.out
        while True:
            try:
                item = out.get_nowait()
            except queue.Empty:
                return items, False
            if isinstance(item, BaseException):
                out.put(_DONE)  # later calls end too
                return items, item
            if item is _DONE:
                out.put(_DONE)
                return items, True
            items.append(item)

    def cancel(self) -> None:
        self._scheduler.cancel(self._seq)


def _notify(seqs: Iterator[_Seq] | Sequence[_Seq]) -> None:
    """Tell each listener of ``seqs`` (:meth:`TokenStream.listen`), once, the keys of those it listens to."""
    keys: dict[Any, list[Any]] = {}
    for seq in seqs:
        if seq.listener is not None:
            keys.setdefault(seq.listener, []).append(seq.key)
    for listener, ready in keys.items():
        listener(ready)


class BatchScheduler:
    """Runs the sequences handed to :meth:`submit` in shared forward steps (module docstring).

    ``model``: a :class:`~swarm.compute.model.Model`; ``ffn``: returns the FFN backend for the
    next step (read each step: the swarm swaps it when the plan or term changes); ``max_batch``
    ≥ 1 sequences run at once, ``max_queue`` ≥ 0 wait (None: :func:`set_default_limits`'s, at
    first :data:`MAX_BATCH` and :data:`MAX_QUEUE`); ``chunk`` ≥ 1 prompt rows per prefill
    chunk; ``prefill_rows`` ≥ ``chunk`` prompt rows per step. Raises ValueError for a bad limit.
    ``pool``: the :class:`SchedulerPool` it belongs to (its lock, and its limits held over every
    member), made by the pool; None: on its own. ``prefix_reuse``: keep finished sequences' KV
    caches for later prompts that start with their tokens (module docstring; a pool's setting
    for its members).
    """

    def __init__(self, model: Model, ffn: Callable[[], FFNBackend | None] = lambda: None, *, max_batch: int | None = None,
                 max_queue: int | None = None, chunk: int = CHUNK_TOKENS, prefill_rows: int = PREFILL_ROWS,
                 max_positions: int | None = None, pool: SchedulerPool | None = None,
                 prefix_reuse: bool = True) -> None:
        max_batch = _limits["max_batch"] if max_batch is None else max_batch
        max_queue = _limits["max_queue"] if max_queue is None else max_queue
        if max_batch < 1 or max_queue < 0 or chunk < 1 or prefill_rows < chunk:
            raise ValueError(f"bad batch limits: max_batch={max_batch} (≥ 1), max_queue={max_queue} (≥ 0), "
                             f"chunk={chunk} (≥ 1), prefill_rows={prefill_rows} (≥ chunk)")
        self.model, self._ffn = model, ffn
        self.max_batch, self.max_queue, self.chunk, self.prefill_rows = max_batch, max_queue, chunk, prefill_rows
        self.max_positions = max_positions  # KV positions all running sequences may claim together (None: no bound)
        self._pool = pool
        self._cond = pool.cond if pool is not None else threading.Condition()  # re-entrant: a pool's submit holds it
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._thread: threading.Thread | None = None
        # ids in arrival order (a pool's shared by its members: admission follows them)
        self._ids = pool.ids if pool is not None else itertools.count(1)
        self.steps = 0  # forward steps run (status, tests)
        # The last sequences that left: (id, prompt tokens read, prompt length, tokens generated).
        self.left: deque[tuple[int, int, int, int]] = deque(maxlen=64)
        self.step_s = 0.0  # moving average of a step's wall time
        self.step_s_total = 0.0  # the wall time of every step so far (metrics)
        self.peak_batch = 0  # the most sequences one step has carried
        self.prefix_reuse = prefix_reuse
        self.prefixes = pool.prefixes if pool is not None else PrefixStore()  # kept KV caches
        self.prompt_tokens_prefilled = 0  # prompt rows run through the model (reused ones are not)

    # ------------------------------------------------------------ callers' side
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> TokenStream:
        """Queue one sequence; its tokens come from the returned :class:`TokenStream`.

        Raises ValueError for an empty prompt; :class:`QueueFullError` when ``max_batch``
        sequences run and ``max_queue`` wait.
        """
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        seq = _Seq(0, [int(t) for t in prompt_ids], params)
        with self._cond:
            running = self._running_count()  # the cancelled leave after this step
            waiting = sum(len(m._waiting) for m in self._members())
            if running + waiting >= self.max_batch + self.max_queue:
                raise QueueFullError(
                    f"the server is busy: {running} sequences run and {waiting} wait "
                    f"(at most {self.max_batch} + {self.max_queue}); retry later", self._retry_after_s())
            seq.ident = next(self._ids)
            if params.max_tokens == 0:
                seq.out.put(_DONE)
                return TokenStream(self, seq)
            self._waiting.append(seq)
            self._wake()
            self._cond.notify_all()
        return TokenStream(self, seq)

    def load(self) -> int:
        """Sequences running (not cancelled) and waiting here (a pool sends a new one to the least)."""
        with self._cond:
            return sum(not s.cancelled for s in self._running) + len(self._waiting)

    def _members(self) -> list[BatchScheduler]:
        """The schedulers whose sequences count against the limits: the pool's, or this one."""
        return self._pool.schedulers if self._pool is not None else [self]

    def _running_count(self) -> int:
        return sum(not s.cancelled for m in self._members() for s in m._running)

    def _wake(self) -> None:
        """Start the step thread if none runs (under the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="swarm-batch", daemon=True)
            self._thread.start()

    def cancel(self, seq: _Seq) -> None:
        """Take ``seq`` out: from the queue now, from the batch at the end of the step in flight."""
        with self._cond:
            seq.cancelled = True
            if seq in self._waiting:
                self._waiting.remove(seq)
                self.left.append((seq.ident, 0, len(seq.prompt), 0))
        seq.out.put(_DONE)
        _notify((seq,))

    def fail_all(self, exc: BaseException) -> int:
        """End every running and waiting sequence now with ``exc`` (raised by its
        :class:`TokenStream`); the step in flight finishes and its results are dropped.
        Sequences submitted later run as usual. Returns how many sequences were failed."""
        with self._cond:
            failed = [s for s in self._running if not s.cancelled] + list(self._waiting)
            for seq in self._waiting:
                self.left.append((seq.ident, 0, len(seq.prompt), 0))
            self._waiting.clear()
            for seq in failed:
                seq.cancelled = seq.failed = True
                seq.out.put(exc)
        _notify(failed)
        return len(failed)

    def snapshot(self) -> dict[str, Any]:
        """The slots now (tests, status): ``running`` and ``waiting`` ids, ``prefilling``: id →
        prompt tokens read so far for running sequences still reading their prompt, ``steps``."""
        with self._cond:
            running = [s for s in self._running if not s.cancelled]
            return {"running": [s.ident for s in running], "waiting": [s.ident for s in self._waiting],
                    "prefilling": {s.ident: s.fed for s in running if s.fed < len(s.prompt)},
                    "steps": self.steps}

    def _retry_after_s(self) -> int:
        """Seconds until a slot is likely free: the fewest steps a running sequence has left
        (its max_tokens; it may stop sooner), at the recent step time."""
        left = min((s.params.max_tokens - s.generated + math.ceil((len(s.prompt) - s.fed) / self.chunk)
                    for m in self._members() for s in m._running), default=1)
        return int(min(max(math.ceil(left * self.step_s), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    # ------------------------------------------------------------ the step thread
    def _run(self) -> None:
        while True:
            with self._cond:
                gone = [s for s in self._running if s.cancelled]
                self.left.extend((s.ident, s.fed, len(s.prompt), s.generated) for s in gone)
                self._running = [s for s in self._running if not s.cancelled]
                for seq in gone:
                    self._retire(seq)
                while self._waiting and self._admissible(self._waiting[0]):
                    self._start(self._waiting.popleft())
                if self._pool is not None:
                    self._pool.rebalance(self)
                for other in self._members():  # a slot freed here may be the one another member's head waits for
                    if other is not self and other._waiting and other._admissible(other._waiting[0]):
                        other._wake()
                if not self._running:
                    self._thread = None
                    return
                step = self._plan_step()
            self._step(step)

    def _claimed(self) -> int:
        """KV positions the running sequences claim (prompt + max_tokens each), every member's."""
        return sum(len(s.prompt) + s.params.max_tokens for m in self._members() for s in m._running if not s.cancelled)

    def _room(self) -> int | None:
        """Positions the kept caches may hold: what ``max_positions`` leaves beside the claims."""
        return None if self.max_positions is None else self.max_positions - self._claimed()

    def _start(self, seq: _Seq) -> None:
        """``seq`` joins the batch (under the lock): a kept cache holding a prefix of its prompt,
        or a new one; kept caches are evicted until they fit beside its claim."""
        ffn = self._ffn()
        owner = ffn if isinstance(ffn, LayerBackend) else None
        # prompt logprobs need every prompt row's logits: no prefix is reused for them
        reuse = self.prefix_reuse and not seq.params.prompt_logprobs
        cache, reused = self.prefixes.take(seq.prompt, owner) if reuse else (None, 0)
        if seq.params.prompt_logprobs:
            seq.prompt_scored.append(Sampled(seq.prompt[0]))
        seq.cache = cache if cache is not None else self.model.new_cache(capacity=16)
        seq.fed = seq.reused = reused
        seq.owner = owner
        seq.sampler = Sampler(seq.params)
        self._running.append(seq)
        self.prefixes.make_room(self._room())

    def _retire(self, seq: _Seq) -> None:
        """``seq`` has left (under the lock): its cache is kept for reuse unless its step failed."""
        if self.prefix_reuse and not seq.failed and seq.cache is not None:
            self.prefixes.keep(seq.prompt + seq.emitted, seq.cache, seq.owner, self._room())

    def _admissible(self, seq: _Seq) -> bool:
        """Whether ``seq`` (the head of this queue) starts now: a slot free (``max_batch`` over
        every member) and its positions fit, beside a slot and the positions of every older
        sequence waiting on another member — it never takes what they wait for, and joins without
        waiting for their members' steps to end."""
        members = self._members()  # another member's finished sequences count until its next step ends
        older = [s for m in members if m is not self for s in m._waiting if s.ident < seq.ident]
        return sum(len(m._running) for m in members) + len(older) < self.max_batch and self._fits(seq, older)

    def _fits(self, seq: _Seq, older: Sequence[_Seq] = ()) -> bool:
        """Whether ``seq``'s positions (prompt + max_tokens) fit ``max_positions`` beside the
        running sequences' claims (every member's) and those of ``older`` waiting ones; a sequence
        alone always starts (its request was checked against the context when it was encoded)."""
        ahead = [s for m in self._members() for s in m._running] + list(older)
        if self.max_positions is None or not ahead:
            return True
        claimed = sum(len(s.prompt) + s.params.max_tokens for s in ahead)
        return claimed + len(seq.prompt) + seq.params.max_tokens <= self.max_positions

    def _plan_step(self) -> list[tuple[_Seq, list[int]]]:
        step, prefill = [], 0
        for seq in self._running:
            rows = seq.next_rows(self.chunk)
            if seq.fed < len(seq.prompt):
                if prefill and prefill + len(rows) > self.prefill_rows:
                    continue
                prefill += len(rows)
            step.append((seq, rows))
        return step

    def _forward(self, step: list[tuple[_Seq, list[int]]], ffn: Any) -> list[np.ndarray]:
        """The step's rows through the model: each sequence's last row's logits [V] f32. A
        sequence that asks for its prompt's logprobs runs its prefill chunk alone with every
        row's logits (the same bits: every row is batch-invariant), which score its next prompt
        tokens."""
        whole = [i for i, (seq, _) in enumerate(step) if seq.params.prompt_logprobs and seq.fed < len(seq.prompt)]
        rest = [i for i in range(len(step)) if i not in whole]
        out: list[np.ndarray] = [np.empty(0, np.float32)] * len(step)
        if rest:
            for i, row in zip(rest, self.model.forward_batch([(step[i][1], step[i][0].cache) for i in rest], ffn=ffn)):
                out[i] = row
        for i in whole:
            seq, rows = step[i]
            every = self.model.forward(rows, seq.cache, ffn=ffn)  # [T, V]
            n = min(len(rows), len(seq.prompt) - seq.fed - 1)  # rows whose next token is a prompt token
            nxt = seq.prompt[seq.fed + 1:seq.fed + 1 + n]
            assert seq.params.logprobs is not None  # SamplingParams checks prompt_logprobs needs it
            seq.prompt_scored.extend(scored(every, nxt, seq.params.logprobs))
            out[i] = every[-1]
        return out

    def _step(self, step: list[tuple[_Seq, list[int]]]) -> None:
        t0 = time.perf_counter()
        ffn = self._ffn()
        owner = ffn if isinstance(ffn, LayerBackend) else None
        for seq, _ in step:
            if seq.owner is not owner:  # a cache filled under another backend is never kept
                seq.failed = True
        try:
            logits = self._forward(step, ffn)
        except BaseException as exc:  # the step failed: so do its sequences (the rest go on)
            with self._cond:
                for seq, _ in step:
                    seq.cancelled = seq.failed = True
                    seq.out.put(exc)
            _notify(seq for seq, _ in step)
            return
        dt = time.perf_counter() - t0
        self.step_s = dt if self.steps == 0 else 0.8 * self.step_s + 0.2 * dt
        self.step_s_total += dt
        self.steps += 1
        if len(step) > self.peak_batch:
            self.peak_batch = len(step)
            log.info("%d sequences share a step (the most so far)", len(step))
        fed: list[_Seq] = []  # those given an item this step
        for (seq, rows), row in zip(step, logits):
            if seq.fed < len(seq.prompt):
                seq.fed += len(rows)
                self.prompt_tokens_prefilled += len(rows)
                if seq.fed < len(seq.prompt):
                    continue  # more prompt to read: this chunk's logits are not needed
            if seq.cancelled:
                continue
            assert seq.sampler is not None  # made when the sequence joined
            try:
                picked = seq.sampler(row)
            except Exception as exc:  # e.g. its constraint failed: this sequence fails, the rest go on
                with self._cond:
                    seq.cancelled = seq.failed = True
                seq.out.put(exc)
                fed.append(seq)
                continue
            tok = picked.token
            seq.generated += 1
            seq.last = tok
            seq.emitted.append(tok)
            seq.out.put(picked)
            fed.append(seq)
            if tok in seq.params.stop_tokens or seq.generated >= seq.params.max_tokens:
                with self._cond:
                    seq.cancelled = True  # finished: its slot is free from the next step on
                seq.out.put(_DONE)
        _notify(fed)  # once per listener for the whole step: one wake of its loop, not one per stream


class SchedulerPool:
    """Batch schedulers of ``model`` and ``ffn`` under one set of limits (module docstring):
    ``max_batch`` sequences run and ``max_queue`` wait over all of them (None:
    :func:`set_default_limits`'s), their prompts + ``max_tokens`` within ``max_positions``
    together; ``chunk``, ``prefill_rows`` as :class:`BatchScheduler`'s. :meth:`submit` sends a
    new sequence to the least loaded of the first :attr:`width` schedulers (1 at first; ties:
    the first), or a tile at a time when given a row tile (:meth:`set_width`), where it
    stays until finished ones leave the groups uneven (:meth:`rebalance`). Raises ValueError for
    a bad limit."""

    def __init__(self, model: Model, ffn: Callable[[], FFNBackend | None] = lambda: None, *, max_batch: int | None = None,
                 max_queue: int | None = None, chunk: int = CHUNK_TOKENS, prefill_rows: int = PREFILL_ROWS,
                 max_positions: int | None = None, prefix_reuse: bool = True) -> None:
        self.cond = threading.Condition()  # every member's lock
        self.prefixes = PrefixStore()  # kept KV caches, every member's (prefix reuse)
        self.ids = itertools.count(1)  # every member's sequence ids, in arrival order
        self.max_batch = _limits["max_batch"] if max_batch is None else max_batch  # members made later: the same
        self.max_queue = _limits["max_queue"] if max_queue is None else max_queue
        self.max_positions = max_positions
        self._make = lambda: BatchScheduler(model, ffn, max_batch=self.max_batch, max_queue=self.max_queue, chunk=chunk,
                                            prefill_rows=prefill_rows, max_positions=max_positions, pool=self,
                                            prefix_reuse=prefix_reuse)
        self.schedulers: list[BatchScheduler] = [self._make()]
        self.width = 1
        self.tile: int | None = None

    def set_width(self, n: int, tile: int | None = None) -> None:
        """New sequences go to the first ``n`` schedulers from now on (at least 1, at most
        ``max_batch``: made when first needed); sequences running elsewhere stay where they are
        (but for :meth:`rebalance`).
        ``tile`` (None: none): rows a step's kernels take a pass over the weights, when a group
        past a multiple of it costs every stage another pass (the planner's
        :meth:`~swarm.peer.coordinator.costmodel.GroupPricer.row_tile`); with it the schedulers
        are filled a tile at a time, past ``n`` where that spares a pass (:meth:`submit`)."""
        with self.cond:
            self.width = max(1, min(n, self.max_batch))
            self.tile = tile
            while len(self.schedulers) < self.width:
                self.schedulers.append(self._make())

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> TokenStream:
        """:meth:`BatchScheduler.submit` on the least loaded of the first ``width`` schedulers, or
        with a ``tile`` (:meth:`set_width`): the least loaded of the first ``width`` while one holds
        less than a tile, else the least loaded of those holding part of a tile, else a scheduler
        of its own (made when needed, up to ``max_batch``; else the least loaded), so a step's
        groups fill whole tiles before another pass starts: 16 sequences over three stages run as
        4 + 4 + 4 + 4, not 6 + 5 + 5; 8 over two as 4 + 4 (ties: the first). Loads count running
        and waiting sequences; QueueFullError when the pool's limits are full."""
        with self.cond:
            return self._place().submit(prompt_ids, params)

    def _place(self) -> BatchScheduler:
        """The scheduler a new sequence goes to (:meth:`submit`); the pool's lock is held."""
        loads = [m.load() for m in self.schedulers]
        least = lambda among: self.schedulers[min(among, key=lambda i: (loads[i], i))]  # noqa: E731
        first = range(self.width)
        tile = self.tile
        if tile is None:
            return least(first)
        under = [i for i in first if loads[i] < tile]
        partial = under or [i for i, n in enumerate(loads) if n % tile]
        if partial:
            return least(partial)
        empty = [i for i, n in enumerate(loads) if n == 0]
        if not empty and len(self.schedulers) < self.max_batch:
            self.schedulers.append(self._make())  # idle until this sequence is placed on it
            return self.schedulers[-1]
        return least(empty or range(len(loads)))

    def rebalance(self, member: BatchScheduler) -> None:
        """Move running sequences of ``member`` — between two of its steps, none in flight — to
        other members where the groups were left uneven by sequences that finished (each stays
        where it was placed otherwise; its KV cache, its stages' keys and values and its tokens
        go with it: a row's bits do not depend on the rows beside it). With a ``tile``: the rows
        past ``member``'s last whole tile go to the member whose part of a tile they fill best,
        where they fit its room and the groups stay at least ``width`` (5 + 2 over two stages: 4 + 3,
        one kernel pass fewer a round; 2 + 4 + 2 over two: 4 + 4). Without: one
        sequence at a time to the least loaded of the first ``width`` while ``member`` holds two
        more (4 + 1 → 3 + 2, every stage's groups even). The pool's lock is held."""
        live = [s for s in member._running if not s.cancelled]
        if not live or len(self.schedulers) < 2:
            return
        tile = self.tile
        if tile is None:
            loads = {id(m): m.load() for m in self.schedulers}
            first = [m for m in self.schedulers[:self.width] if m is not member]
            while first and len(live) > 1:
                target = min(first, key=lambda m: loads[id(m)])
                if loads[id(member)] - loads[id(target)] < 2:
                    return
                self._move(member, target, [live.pop()])
                loads[id(member)] -= 1
                loads[id(target)] += 1
            return
        # A group is a member's running sequences: one holding only sequences that wait for room is
        # none (counted, two such handed one sequence back and forth without a step). A member
        # whose own sequences wait keeps its running ones; a target's room counts its waiting ones,
        # which join its group at its next step. Each move spares a kernel pass a round (the sum of
        # ⌈load / tile⌉ falls by one), so sequences never move back and forth.
        extra = len(live) % tile
        if member._waiting or not extra:
            return
        groups = [m for m in self.schedulers if any(not s.cancelled for s in m._running)]
        if extra == len(live) and len(groups) <= self.width:
            return  # moving them would leave a stage without a group
        loads = {id(m): m.load() for m in groups}
        rooms = [m for m in groups if m is not member and loads[id(m)] % tile and tile - loads[id(m)] % tile >= extra]
        if rooms:  # the fullest part of a tile: whole tiles sooner
            target = max(rooms, key=lambda m: loads[id(m)] % tile)
            self._move(member, target, live[len(live) - extra:])

    @staticmethod
    def _move(member: BatchScheduler, target: BatchScheduler, seqs: list[_Seq]) -> None:
        """``seqs`` (running on ``member``, none in a step) run on ``target`` from its next step
        (the pool's lock is held)."""
        member._running = [s for s in member._running if all(s is not q for q in seqs)]
        target._running.extend(seqs)
        target._wake()
        log.debug("%d sequence(s) moved between schedulers to even their groups", len(seqs))

    def fail_all(self, exc: BaseException) -> int:
        """:meth:`BatchScheduler.fail_all` on every member; how many sequences were failed."""
        with self.cond:
            return sum(m.fail_all(exc) for m in self.schedulers)

    def snapshot(self) -> dict[str, Any]:
        """:meth:`BatchScheduler.snapshot` over every member (ids are unique in a pool)."""
        with self.cond:
            snaps = [m.snapshot() for m in self.schedulers]
        return {"running": [i for s in snaps for i in s["running"]], "waiting": [i for s in snaps for i in s["waiting"]],
                "prefilling": {k: v for s in snaps for k, v in s["prefilling"].items()},
                "steps": sum(s["steps"] for s in snaps)}

    def running(self) -> int:
        """Sequences running now (not cancelled), every member's."""
        with self.cond:
            return self.schedulers[0]._running_count()

    @property
    def steps(self) -> int:
        return sum(m.steps for m in self.schedulers)

    @property
    def step_s_total(self) -> float:
        return sum(m.step_s_total for m in self.schedulers)

    @property
    def prompt_tokens_prefilled(self) -> int:
        return sum(m.prompt_tokens_prefilled for m in self.schedulers)

    @property
    def peak_batch(self) -> int:
        return max(m.peak_batch for m in self.schedulers)

    @property
    def left(self) -> list[tuple[int, int, int, int]]:
        """The last sequences that left, every member's (:attr:`BatchScheduler.left`)."""
        with self.cond:
            return [x for m in self.schedulers for x in m.left]
