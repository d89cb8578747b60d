"""The compute threads of this process: how many, and the one pool that runs kernels on them.

Theory of operation. A kernel call (a matrix product, attention, a norm over many rows) is cut
into *chunks* — ranges of output rows, or of attention heads — each computed by the one-thread
compiled kernel, which releases the GIL. :func:`run_chunks` hands a call's chunks to the
process's shared pool and works on them itself: chunks are taken from one counter, first come
first served, by the calling thread and by the pool's workers, and the call returns when all
are done. (Block-kernel products go further: each thread that takes a chunk runs one
compiled call that takes the products' tiles from an atomic counter, qkernels.run_group.) So

* a chunk's result does not depend on which thread computed it or how the rows were cut: each
  output element keeps its one sequence of float32 operations (the kernels' promise), and the
  logits are the same bits at any thread count;
* several threads may call at once (loopback peers in one process, a coordinator computing its
  share while it serves): no process-wide lock, the calls' chunks interleave on the same
  workers, and a caller never waits for a chunk nobody has started — it takes it itself, so a
  busy machine (workers not scheduled) degrades to about the caller's own speed (plus the wait
  for a chunk that a late worker did start);
* one pool per process: three peers in one process share ``threads() - 1`` workers rather than
  spawning three sets.

The count defaults to the cores this process may use (:func:`available_cores`: CPU affinity and
the cgroup CPU quota); the command line's ``--threads`` sets it (``$COLIBRI_SWARM_THREADS``), as
does :func:`set_threads`.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def available_cores(cgroup_root: Path = _CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The cores this process may use: its CPU affinity (``os.sched_getaffinity``, where the OS
    has it; else ``os.cpu_count()``), capped by the cgroup CPU quota rounded up (v2 ``cpu.max``,
    v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; no quota: no cap). At least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_cpu_quota(cgroup_root: Path = _CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup quota allows (quota / period), or None without a quota.

    The process's own cgroup (``/proc/self/cgroup``) is read first, then the root of the mounted
    hierarchy (what a container sees of its own cgroup); unreadable files count as no quota."""
    own_v2, own_v1 = "", ""
    try:
        for line in proc_cgroup.read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if hid == "0" and controllers == "":
                own_v2 = path.lstrip("/")
            elif "cpu" in controllers.split(","):
                own_v1 = path.lstrip("/")
    except (OSError, ValueError):
        pass
    for base in dict.fromkeys([cgroup_root / own_v2, cgroup_root]):  # v2: "max 100000" or "200000 100000"
        try:
            quota, period = (base / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    for base in dict.fromkeys([cgroup_root / "cpu" / own_v1, cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"]):
        try:
            quota = int((base / "cpu.cfs_quota_us").read_text())
            period = int((base / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


_threads: int | None = None
_pool: "_Pool | None" = None
_pool_lock = threading.Lock()


# A thread count for this process and its children (the command line's ``--threads`` sets it).
THREADS_ENV = "COLIBRI_SWARM_THREADS"
# The most compute threads a process takes: each is an OS thread (a Python pool worker, a
# spinning worker), and far past the cores they only wait for one another; an operating
# system refuses new threads somewhere in the thousands.
MAX_THREADS = 1024


def threads() -> int:
    """The compute threads of this process (the caller's own included): the last
    :func:`set_threads`, else ``$COLIBRI_SWARM_THREADS``, else :func:`available_cores`.
    Raises ValueError for a ``$COLIBRI_SWARM_THREADS`` that is not a count of 1..MAX_THREADS."""
    global _threads
    if _threads is None:
        _threads = threads_from_env() or available_cores()
    return _threads


def threads_from_env() -> int | None:
    """``$COLIBRI_SWARM_THREADS`` as a thread count, None where it is unset or empty. Raises
    ValueError naming the variable for anything but a whole number 1..:data:`MAX_THREADS`."""
    env = os.environ.get(THREADS_ENV, "").strip()
    if not env:
        return None
    if not (env.isascii() and env.isdigit()) or not 1 <= int(env) <= MAX_THREADS:
        raise ValueError(f"${THREADS_ENV} must be a whole number of threads from 1 to {MAX_THREADS}, got {env!r}")
    return int(env)


def set_threads(n: int | None) -> int:
    """Use ``n`` compute threads from now on (None: :func:`available_cores`); returns the count.
    Raises ValueError for ``n`` outside 1..:data:`MAX_THREADS`."""
    global _threads
    if n is not None and (not isinstance(n, int) or not 1 <= n <= MAX_THREADS):
        raise ValueError(f"the thread count must be a whole number from 1 to {MAX_THREADS}, got {n!r}")
    _threads = available_cores() if n is None else n
    return _threads


class _Job:
    """One call's chunks, taken in order from a shared counter by whichever thread is free."""

    __slots__ = ("fn", "chunks", "next", "finished", "done", "error")

    def __init__(self, fn: Callable[..., None], chunks: Sequence[tuple]):
        self.fn, self.chunks = fn, chunks
        self.next, self.finished = itertools.count(), itertools.count(1)  # next() is atomic
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        n = len(self.chunks)
        for i in self.next:
            if i >= n:
                return
            try:
                self.fn(*self.chunks[i])
            except BaseException as exc:  # handed to the caller, which raises it
                self.error = self.error or exc
            if next(self.finished) == n:
                self.done.set()


class _Pool:
    """``size`` daemon worker threads taking jobs from one queue (a job may be queued to several)."""

    def __init__(self, size: int):
        self.size = size
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(size):
            threading.Thread(target=self._serve, name=f"compute-{i + 1}", daemon=True).start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            job.work()

    def close(self) -> None:
        for _ in range(self.size):
            self.jobs.put(None)


def _shared_pool(workers: int) -> _Pool:
    global _pool
    pool = _pool
    if pool is None or pool.size != workers:
        with _pool_lock:
            if _pool is None or _pool.size != workers:
                if _pool is not None:
                    _pool.close()
                _pool = _Pool(workers)
            pool = _pool
    return pool


def run_chunks(fn: Callable[..., None], chunks: Sequence[tuple]) -> None:
    """``fn(*chunk)`` for every chunk, on the calling thread and the shared pool's workers;
    returns when all are done (re-raising the first exception one raised), also when the wait is
    interrupted (the interrupt is raised once the workers are done). The chunks must be
    independent (disjoint outputs)."""
    n = len(chunks)
    if n <= 1 or threads() <= 1:
        for c in chunks:
            fn(*c)
        return
    job = _Job(fn, chunks)
    pool = _shared_pool(threads() - 1)
    for _ in range(min(n - 1, pool.size)):
        pool.jobs.put(job)
    job.work()
    try:
        job.done.wait()
    except BaseException:  # an interrupt (Ctrl-C) in the wait: the workers still write into the
        job.done.wait()    # caller's arrays, which must outlive them, so let them finish first
        raise
    if job.error is not None:
        raise job.error


def split(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``0:n`` cut into at most ``parts`` ranges of nearly equal size, inner bounds on multiples
    of ``align`` (as ``(lo, hi)`` pairs, ascending, none empty)."""
    units = -(-n // align)
    parts = max(1, min(parts, units))
    bounds = [min(n, (units * i // parts) * align) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def split_weighted(sizes: Sequence[tuple[int, float]], parts: int, align: int = 1) -> list[list[tuple[int, int, int]]]:
    """Several ranges cut together into at most ``parts`` chunks of nearly equal work: ``sizes``
    gives each range ``i`` as ``(n_i, work per element)``; a chunk is a list of ``(i, lo, hi)``
    (``lo:hi`` within ``0:n_i``, inner bounds on multiples of ``align``), and may span the end of
    one range and the start of the next. The chunks cover every element once, in order."""
    total = sum(n * w for n, w in sizes)
    target = total / max(1, parts)
    chunks: list[list[tuple[int, int, int]]] = []
    chunk: list[tuple[int, int, int]] = []
    filled = 0.0
    for i, (n, w) in enumerate(sizes):
        lo = 0
        while lo < n:
            take = max(align, int((target - filled) / w) // align * align) if w > 0 else n
            hi = min(n, lo + take)
            chunk.append((i, lo, hi))
            filled += (hi - lo) * w
            lo = hi
            if filled >= target * (1 - 1e-9) and len(chunks) < parts - 1:
                chunks.append(chunk)
                chunk, filled = [], 0.0
    if chunk:
        chunks.append(chunk)
    return chunks


def parts_for(work: float, min_work: float) -> int:
    """How many chunks a call of ``work`` units takes: the thread count, but none smaller than
    ``min_work`` (a chunk must outweigh the cost of handing it to another thread)."""
    return max(1, min(threads(), int(work // min_work)))
