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

from swarm.compute.sampling import PREFILL_CHUNK, Sampled, Sampler, SamplingParams
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
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    sampler: Sampler | None = None

    def next_rows(self, chunk: int) -> list[int]:
        if self.fed < len(self.prompt):
            return self.prompt[self.fed:min(self.fed + chunk, len(self.prompt))]
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

    def cancel(self) -> None:
        self._scheduler.cancel(self._seq)


class BatchScheduler:
    """Runs the sequences handed to :meth:`submit` in shared forward steps (module docstring).

    ``model``: a :class:`~swarm.compute.model.Model`; ``ffn``: returns the FFN backend for the
    next step (read each step: the swarm swaps it when the plan or term changes); ``max_batch``
    ≥ 1 sequences run at once, ``max_queue`` ≥ 0 wait (None: :func:`set_default_limits`'s, at
    first :data:`MAX_BATCH` and :data:`MAX_QUEUE`); ``chunk`` ≥ 1 prompt rows per prefill
    chunk; ``prefill_rows`` ≥ ``chunk`` prompt rows per step. Raises ValueError for a bad limit.
    """

    def __init__(self, model: Model, ffn: Callable[[], FFNBackend | None] = lambda: None, *, max_batch: int | None = None,
                 max_queue: int | None = None, chunk: int = CHUNK_TOKENS, prefill_rows: int = PREFILL_ROWS,
                 max_positions: int | None = None) -> None:
        max_batch = _limits["max_batch"] if max_batch is None else max_batch
        max_queue = _limits["max_queue"] if max_queue is None else max_queue
        if max_batch < 1 or max_queue < 0 or chunk < 1 or prefill_rows < chunk:
            raise ValueError(f"bad batch limits: max_batch={max_batch} (≥ 1), max_queue={max_queue} (≥ 0), "
                             f"chunk={chunk} (≥ 1), prefill_rows={prefill_rows} (≥ chunk)")
        self.model, self._ffn = model, ffn
        self.max_batch, self.max_queue, self.chunk, self.prefill_rows = max_batch, max_queue, chunk, prefill_rows
        self.max_positions = max_positions  # KV positions all running sequences may claim together (None: no bound)
        self._cond = threading.Condition()
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.steps = 0  # forward steps run (status, tests)
        # The last sequences that left: (id, prompt tokens read, prompt length, tokens generated).
        self.left: deque[tuple[int, int, int, int]] = deque(maxlen=64)
        self.step_s = 0.0  # moving average of a step's wall time
        self.step_s_total = 0.0  # the wall time of every step so far (metrics)
        self.peak_batch = 0  # the most sequences one step has carried

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
            running = sum(not s.cancelled for s in self._running)  # the cancelled leave after this step
            if running + len(self._waiting) >= self.max_batch + self.max_queue:
                raise QueueFullError(
                    f"the server is busy: {running} sequences run and {len(self._waiting)} wait "
                    f"(at most {self.max_batch} + {self.max_queue}); retry later", self._retry_after_s())
            seq.ident = next(self._ids)
            if params.max_tokens == 0:
                seq.out.put(_DONE)
                return TokenStream(self, seq)
            self._waiting.append(seq)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="swarm-batch", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return TokenStream(self, seq)

    def cancel(self, seq: _Seq) -> None:
        """Take ``seq`` out: from the queue now, from the batch at the end of the step in flight."""
        with self._cond:
            seq.cancelled = True
            if seq in self._waiting:
                self._waiting.remove(seq)
                self.left.append((seq.ident, 0, len(seq.prompt), 0))
        seq.out.put(_DONE)

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
                seq.cancelled = True
                seq.out.put(exc)
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
                    for s in self._running), default=1)
        return int(min(max(math.ceil(left * self.step_s), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    # ------------------------------------------------------------ the step thread
    def _run(self) -> None:
        while True:
            with self._cond:
                self.left.extend((s.ident, s.fed, len(s.prompt), s.generated) for s in self._running if s.cancelled)
                self._running = [s for s in self._running if not s.cancelled]
                while self._waiting and len(self._running) < self.max_batch and self._fits(self._waiting[0]):
                    seq = self._waiting.popleft()
                    seq.cache = self.model.new_cache(capacity=16)
                    seq.sampler = Sampler(seq.params)
                    self._running.append(seq)
                if not self._running:
                    self._thread = None
                    return
                step = self._plan_step()
            self._step(step)

    def _fits(self, seq: _Seq) -> bool:
        """Whether ``seq``'s positions (prompt + max_tokens) fit ``max_positions`` beside the
        running sequences' claims; a sequence alone always starts (its request was checked
        against the context when it was encoded)."""
        if self.max_positions is None or not self._running:
            return True
        claimed = sum(len(s.prompt) + s.params.max_tokens for s in self._running)
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

    def _step(self, step: list[tuple[_Seq, list[int]]]) -> None:
        t0 = time.perf_counter()
        try:
            logits = self.model.forward_batch([(rows, seq.cache) for seq, rows in step], ffn=self._ffn())
        except BaseException as exc:  # the step failed: so do its sequences (the rest go on)
            with self._cond:
                for seq, _ in step:
                    seq.cancelled = True
                    seq.out.put(exc)
            return
        dt = time.perf_counter() - t0
        self.step_s = dt if self.steps == 0 else 0.8 * self.step_s + 0.2 * dt
        self.step_s_total += dt
        self.steps += 1
        if len(step) > self.peak_batch:
            self.peak_batch = len(step)
            log.info("%d sequences share a step (the most so far)", len(step))
        for (seq, rows), row in zip(step, logits):
            if seq.fed < len(seq.prompt):
                seq.fed += len(rows)
                if seq.fed < len(seq.prompt):
                    continue  # more prompt to read: this chunk's logits are not needed
            if seq.cancelled:
                continue
            assert seq.sampler is not None  # made when the sequence joined
            try:
                picked = seq.sampler(row)
            except Exception as exc:  # e.g. its constraint failed: this sequence fails, the rest go on
                with self._cond:
                    seq.cancelled = True
                seq.out.put(exc)
                continue
            tok = picked.token
            seq.generated += 1
            seq.last = tok
            seq.out.put(picked)
            if tok in seq.params.stop_tokens or seq.generated >= seq.params.max_tokens:
                with self._cond:
                    seq.cancelled = True  # finished: its slot is free from the next step on
                seq.out.put(_DONE)
