"""A check that nothing slow runs on the event loop: asyncio's debug mode, with CPU time.

With ``$COLIBRI_SWARM_SLOW_CALLBACK_S`` set (seconds, e.g. ``0.1``), :func:`watch_slow_callbacks`
puts the loop in asyncio's debug mode with that ``slow_callback_duration``. asyncio then warns
``Executing <handle> took N seconds`` for each callback that held the loop longer. On a busy
machine a callback can take that long only because the process waited for a core, so each
warning is rewritten to carry the loop thread's CPU time over the same interval as well::

    slow callback: <handle> held the loop 0.412 s wall, 0.230 s CPU

The CPU time comes from a sampler thread that reads the loop thread's CPU clock every
``SAMPLE_S`` (Linux; elsewhere the CPU figure is the wall one). A callback whose CPU time
reaches the limit did slow work on the loop and stays a warning; the others become INFO lines.
The multi-host tests fail on any warning. Blind spot: a blocking call that sleeps in the kernel
(a synchronous read of a slow disk) uses no CPU and is reported at INFO only.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator

from swarm.errors import SwarmError

SLOW_CALLBACK_ENV = "COLIBRI_SWARM_SLOW_CALLBACK_S"
SAMPLE_S = 0.005  # the sampler's period (seconds): the CPU figure's resolution
HISTORY = 4000  # samples kept: 20 s at SAMPLE_S, longer than any callback worth reporting
PREFIX = "slow callback:"


class _CpuSampler(logging.Filter):
    """Rewrites asyncio's slow-callback warnings on the loop thread (see the module docstring)."""

    def __init__(self, limit_s: float) -> None:
        super().__init__()
        self.limit_s = limit_s
        self._times: deque[float] = deque(maxlen=HISTORY)
        self._cpu: deque[float] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._clock: int | None = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):  # no per-thread CPU clock here (macOS): wall time only
            self._clock = None
        if self._clock is not None:
            self._thread = threading.Thread(target=self._sample, name="loopwatch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the sampler thread and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            cpu = time.clock_gettime(self._clock)
            with self._lock:
                self._times.append(time.monotonic())
                self._cpu.append(cpu)

    def _cpu_since(self, start: float) -> float | None:
        with self._lock:
            i = bisect.bisect_right(self._times, start) - 1
            if i < 0:
                return None
            before = self._cpu[i]
        return time.thread_time() - before

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith("Executing") and len(record.args or ()) == 2):
            return True
        handle, wall = record.args  # type: ignore[misc]
        cpu = self._cpu_since(time.monotonic() - wall) if self._clock is not None else None
        cpu = wall if cpu is None else min(cpu, wall)
        record.msg = PREFIX + " %s held the loop %.3f s wall, %.3f s CPU"
        record.args = (handle, wall, cpu)
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
    logger = logging.getLogger("asyncio")
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)  # shown even without -v
    sampler = _CpuSampler(limit)
    logger.addFilter(sampler)
    try:
        yield
    finally:
        logger.removeFilter(sampler)
        sampler.close()
