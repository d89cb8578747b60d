"""A check that nothing slow runs on the event loop: asyncio's debug mode, with CPU time.

With ``$COLIBRI_SWARM_SLOW_CALLBACK_S`` set (seconds, e.g. ``0.1``), :func:`watch_slow_callbacks`
puts the loop in asyncio's debug mode with that ``slow_callback_duration``. asyncio then warns
``Executing <handle> took N seconds`` for each callback that held the loop longer. The loop's
``get_debug()`` keeps answering False, so asyncio does not capture a stack at every handle,
future and task it creates: that bookkeeping would run inside the callbacks being timed. On a busy
machine a callback can take that long only because the process waited for a core, so each
warning is rewritten to carry the CPU time the loop thread spent in that callback, and where
it spent it::

    slow callback: <handle> held the loop 0.412 s wall, 0.230 s CPU at swarm/x.py:120 f < swarm/y.py:88 g < … (9 of 12 samples)

The CPU time is exact: while the check is on, each callback's start reads the thread's CPU
clock (``time.thread_time``; asyncio runs every callback through ``asyncio.Handle._run``,
which is wrapped for the duration). The place is the stack seen most often among samples of
the loop thread's stack taken every ``SAMPLE_S`` by a thread during the callback, innermost
frame first; the share of the CPU time the cyclic garbage collector took within the callback
is named too (a full collection runs inside whichever callback happens to trigger it). A
callback whose CPU time reaches the limit did slow work on the loop and stays a
warning; the others become INFO lines. The multi-host tests fail on any warning. Blind spot: a
blocking call that sleeps in the kernel (a synchronous read of a slow disk) uses no CPU and is
reported at INFO only.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path

from swarm.errors import SwarmError

SLOW_CALLBACK_ENV = "COLIBRI_SWARM_SLOW_CALLBACK_S"
SAMPLE_S = 0.005  # the stack sampler's period (seconds)
HISTORY = 4000  # stack samples kept: 20 s at SAMPLE_S, longer than any callback worth reporting
PREFIX = "slow callback:"
GC_SHOWN_S = 0.005  # a callback's garbage-collection CPU time is named from this many seconds
STACK_DEPTH = 12  # frames shown of the stack a slow callback spent its time in, innermost first

Frames = tuple[tuple[str, int, str], ...]


def _stack(frame) -> Frames:
    out = []
    while frame is not None and len(out) < STACK_DEPTH:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(out)


def _short(path: str) -> str:
    """A path from the package root (``swarm/…``, ``aiortc/…``), not the machine's."""
    parts = Path(path).parts
    for root in ("swarm", "site-packages", "lib"):
        if root in parts:
            i = len(parts) - 1 - parts[::-1].index(root)
            return "/".join(parts[i + (root != "swarm"):])
    return Path(path).name


class _Watch(logging.Filter):
    """Times each callback's CPU on the loop thread, samples its stack, and rewrites asyncio's
    slow-callback warnings (see the module docstring)."""

    def __init__(self, limit_s: float) -> None:
        super().__init__()
        self.limit_s = limit_s
        self._loop_thread = threading.get_ident()
        self._started_cpu = 0.0  # thread CPU time when the running callback started
        self._gc_cpu = 0.0  # of which the cyclic garbage collector took, since that start
        self._gc_started = 0.0
        self._times: deque[float] = deque(maxlen=HISTORY)
        self._stacks: deque[Frames] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._run = asyncio.Handle._run
        watch, run = self, self._run

        def timed_run(handle: asyncio.Handle) -> None:
            if threading.get_ident() == watch._loop_thread:
                watch._started_cpu, watch._gc_cpu = time.thread_time(), 0.0
            run(handle)

        asyncio.Handle._run = timed_run  # type: ignore[method-assign]
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._sample, name="loopwatch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Restore ``Handle._run``, stop the sampler thread and wait for it."""
        asyncio.Handle._run = self._run  # type: ignore[method-assign]
        gc.callbacks.remove(self._on_gc)
        self._stop.set()
        self._thread.join()

    def _on_gc(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self._loop_thread:
            return
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            self._gc_cpu += time.thread_time() - self._gc_started

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            stack = _stack(sys._current_frames().get(self._loop_thread))
            with self._lock:
                self._times.append(time.monotonic())
                self._stacks.append(stack)

    def _where(self, start: float) -> str:
        """The loop thread's stack seen most often since ``start``, in one line ('' if none)."""
        with self._lock:
            i = bisect.bisect_left(self._times, start)
            seen = Counter(self._stacks[j] for j in range(i, len(self._stacks)))
        seen.pop((), None)
        if not seen:
            return ""
        stack, n = seen.most_common(1)[0]
        frames = " < ".join(f"{_short(f)}:{line} {name}" for f, line, name in stack)
        return f" at {frames} ({n} of {sum(seen.values())} samples)"

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith("Executing") and len(record.args or ()) == 2):
            return True
        handle, wall = record.args  # type: ignore[misc]
        cpu = min(time.thread_time() - self._started_cpu, wall)
        gc_cpu = f" ({self._gc_cpu:.3f} s of it collecting garbage)" if self._gc_cpu >= GC_SHOWN_S else ""
        record.msg = PREFIX + " %s held the loop %.3f s wall, %.3f s CPU%s%s"
        record.args = (handle, wall, cpu, gc_cpu, self._where(time.monotonic() - wall))
        if cpu < self.limit_s:  # it waited for a core, it did not work: not a finding
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


@contextlib.contextmanager
def watch_slow_callbacks(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Within the block, check ``loop`` when ``$COLIBRI_SWARM_SLOW_CALLBACK_S`` is set (a no-op
    otherwise); enter it on the loop's thread. Raises SwarmError for a value that is not a
    number of seconds > 0."""
    text = os.environ.get(SLOW_CALLBACK_ENV)
    if not text:
        yield
        return
    try:
        limit = float(text)
    except ValueError:
        limit = -1.0
    if not limit > 0:
        raise SwarmError(f"${SLOW_CALLBACK_ENV} must be a number of seconds > 0, got {text!r}")
    loop.set_debug(True)
    loop.slow_callback_duration = limit
    # Debug mode's timing of callbacks (read from loop._debug) without its capture of a stack at
    # every handle, future and task created (read through get_debug()): that bookkeeping ran
    # inside the callbacks being timed, up to 0.08 s of CPU in one under load, and the product
    # never pays it. Where a slow callback spent its time comes from the sampler instead.
    loop.get_debug = lambda: False  # type: ignore[method-assign]
    logger = logging.getLogger("asyncio")
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)  # shown even without -v
    watch = _Watch(limit)
    logger.addFilter(watch)
    try:
        yield
    finally:
        logger.removeFilter(watch)
        watch.close()
        del loop.get_debug
