"""How much memory this peer can offer, and giving mapped pages back.

The budget rule
---------------
A peer's **limit** is the memory its whole process may use (bytes): the smallest of

* the machine's available memory (``psutil.virtual_memory().available``: free memory plus page
  cache the kernel can drop) plus this process's own anonymous memory (it has that already);
* inside a container or any memory cgroup, the cgroup's limit — which ``psutil`` does not see.
  Version 1 (``memory.limit_in_bytes``) and version 2 (``memory.max``) are read from the
  process's own cgroup as ``/proc/self/cgroup`` names it, under the mount
  ``/proc/self/mountinfo`` lists, and from every ancestor (the tightest wins);
* ``join --memory MIB``: the user's cap on the **whole process**, exactly like a cgroup limit.

Its **allowance** (the ``memory_budget`` of its hello, bytes) is that limit less

* its **baseline**: the process's anonymous memory when it is measured (``RssAnon`` of
  ``/proc/self/status``: interpreter, libraries' heaps, tokenizer, the model's index; mapped
  file pages are left out, they are the weights and the kernel can drop them), ``psutil``'s
  resident set where the OS has no ``RssAnon``;
* a **page-cache headroom**: :data:`PAGE_CACHE_FRACTION` of the limit, at least
  :data:`PAGE_CACHE_FLOOR_BYTES`, so that the mapped weights a peer holds are not evicted and
  re-read from disk each token when the process reaches its limit.

The allowance pays for weights, the KV cache and activations. What those two cost depends on
the layers a peer is planned (a stage peer keeps keys/values of its own layers, a range peer
none), so the coordinator's planner takes them out of it
(:meth:`swarm.peer.plan.ModelShape.weight_budget`, :mod:`~swarm.peer.coordinator.costmodel`),
from the model's shape, the context (:func:`context_tokens`, ``join --context``) and the rows
of one step (:data:`STEP_ROWS`): :func:`kv_cache_bytes`, :func:`activation_bytes`. All of the
arithmetic is in pure functions (:func:`allowance`) fed numbers; :func:`measure_allowance` reads
the OS.

Weights are memory-mapped, so what a peer holds is the pages it touches. :func:`release_pages`
drops the pages of a mapped array from the process (``madvise(MADV_DONTNEED)``: the page cache
keeps them, the process's resident set and its cgroup's mapped memory no longer count them), for
weights read once outside the plan's share (a lost worker's rows recomputed from the file).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

PAGE_CACHE_FRACTION = 0.05  # of a peer's limit, kept free for the page cache beside its mapped weights
PAGE_CACHE_FLOOR_BYTES = 64 << 20  # the page-cache headroom is at least this (bytes)
DEFAULT_CONTEXT = 4096  # tokens of KV cache reserved per layer when join --context is not given
KV_BYTES_PER_VALUE = 4  # the engine keeps keys and values as float32 (swarm.compute.model.KVCache)
ACT_BYTES_PER_VALUE = 4  # activations are float32
# Rows of one step a peer computes: a prefill chunk of every newcomer together (serving's
# PREFILL_ROWS) plus a decode row of each sequence at the most a coordinator batches
# (MAX_BATCH_LIMIT). Constants here, not imported: this module stays free of the engine.
STEP_ROWS = 128 + 64
# Float32 vectors of one row alive at once, beyond q/k/v and the FFN's intermediate: the input,
# the normed copy, the attention output, the residual sums and the answer being sent.
ROW_HIDDEN_COPIES = 8
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def _mounts(fstype: str) -> list[tuple[str, str, str]]:
    """(root inside the hierarchy, mount point, super options) of each ``fstype`` mount."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] == fstype:
                out.append((fields[3], fields[4], tail[2]))
    return out


def _cgroup_dirs() -> list[tuple[Path, Path, str]]:
    """(this process's cgroup directory, its mount point, limit file) for the memory controller."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            mounts, limit = [m for m in _mounts("cgroup") if "memory" in m[2].split(",")], "memory.limit_in_bytes"
        elif hid == "0" and controllers == "":
            mounts, limit = _mounts("cgroup2"), "memory.max"
        else:
            continue
        for root, point, _ in mounts:
            rel = os.path.relpath(path, root) if path.startswith(root) else None
            if rel is not None:
                out.append((Path(point) / ("" if rel == "." else rel), Path(point), limit))
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    with contextlib.suppress(ValueError):
        value = int(text)
        return None if value >= _UNLIMITED else value
    return None


def cgroup_limit() -> int | None:
    """The memory limit (bytes) of this process's cgroup — the tightest of it and its ancestors,
    cgroup v1 or v2 — or None when there is none (or no cgroup file system, as on macOS)."""
    best = None
    for d, top, name in _cgroup_dirs():
        while True:
            value = _read_int(d / name)
            if value is not None:
                best = value if best is None else min(best, value)
            if d == top or top not in d.parents:
                break
            d = d.parent
    return best


def process_rss() -> int:
    """Resident set size of this process (bytes): anonymous and file-backed pages."""
    return int(psutil.Process().memory_info().rss)


def rss_anon(status_text: str) -> int | None:
    """``RssAnon`` of a ``/proc/<pid>/status`` text, in bytes; None when the text has none."""
    for line in status_text.splitlines():
        if line.startswith("RssAnon:"):
            parts = line.split()
            with contextlib.suppress(IndexError, ValueError):
                return int(parts[1]) << 10 if parts[2:3] == ["kB"] or len(parts) == 2 else None
    return None


def process_baseline() -> int:
    """This process's baseline (bytes): its anonymous memory (``RssAnon`` of
    ``/proc/self/status``), or its whole resident set where the OS reports no ``RssAnon``."""
    with contextlib.suppress(OSError):
        anon = rss_anon(Path("/proc/self/status").read_text())
        if anon is not None:
            return anon
    return process_rss()


def least_limit(baseline: int) -> int:
    """The largest limit (bytes) that leaves a process of anonymous memory ``baseline`` no
    allowance (its baseline and :func:`page_cache_headroom` take it all): a limit must pass it."""
    return max(baseline + PAGE_CACHE_FLOOR_BYTES, math.ceil(baseline / (1 - PAGE_CACHE_FRACTION)))


def page_cache_headroom(limit_bytes: int) -> int:
    """Bytes of a ``limit_bytes`` limit kept for the page cache: :data:`PAGE_CACHE_FRACTION` of
    it, at least :data:`PAGE_CACHE_FLOOR_BYTES`."""
    return max(math.ceil(PAGE_CACHE_FRACTION * max(limit_bytes, 0)), PAGE_CACHE_FLOOR_BYTES)


@dataclass(frozen=True)
class Allowance:
    """A peer's memory, in bytes: ``limit`` (what its whole process may use), ``baseline`` (its
    anonymous memory when measured), ``headroom`` (page cache kept free). :attr:`bytes` is what
    weights, the KV cache and activations may take together."""

    limit: int
    baseline: int
    headroom: int

    @property
    def bytes(self) -> int:
        return max(self.limit - self.baseline - self.headroom, 0)

    def describe(self) -> str:
        """One line for the log: the numbers in MiB."""
        m = lambda n: f"{n / (1 << 20):,.0f} MiB"  # noqa: E731
        return (f"memory: limit {m(self.limit)} less baseline {m(self.baseline)} less page-cache headroom "
                f"{m(self.headroom)}: {m(self.bytes)} for weights, KV cache and activations")


def allowance(*, available: int, baseline: int, cgroup_limit: int | None = None,
              cap: int | None = None) -> Allowance:
    """The budget rule, on numbers (bytes): the limit is the smallest of ``available`` (the
    machine's available memory) plus ``baseline``, ``cgroup_limit`` and ``cap`` (``join
    --memory``: the whole process); the allowance is the limit less ``baseline`` less
    :func:`page_cache_headroom` of the limit. Raises ValueError for a negative cap."""
    if cap is not None and cap < 0:
        raise ValueError(f"the memory cap must be ≥ 0 bytes, got {cap}")
    limit = max(available, 0) + max(baseline, 0)
    for bound in (cgroup_limit, cap):
        if bound is not None:
            limit = min(limit, bound)
    return Allowance(limit, max(baseline, 0), page_cache_headroom(limit))


def measure_allowance(cap_bytes: int | None = None) -> Allowance:
    """:func:`allowance` from what the OS says now (``cap_bytes``: ``join --memory``, bytes)."""
    return allowance(available=int(psutil.virtual_memory().available), baseline=process_baseline(),
                     cgroup_limit=cgroup_limit(), cap=cap_bytes)


def weight_budget(cap_bytes: int | None = None) -> int:
    """The allowance this peer offers in its hello (bytes, ≥ 0): weights, KV cache and
    activations together; see :func:`measure_allowance`. Raises ValueError for a negative cap."""
    return measure_allowance(cap_bytes).bytes


# ----------------------------------------------------------------------------- what is not weights
_context: list[int | None] = [None]  # join --context, for this process's plans


def set_context(tokens: int | None) -> None:
    """Reserve KV cache for ``tokens`` tokens per layer (``join --context``; None: the default).
    Raises ValueError below 1."""
    if tokens is not None and tokens < 1:
        raise ValueError(f"--context must be at least 1 token, got {tokens}")
    _context[0] = tokens


def context_tokens(max_positions: int = 0) -> int:
    """Tokens of KV cache a plan reserves per layer, for all sequences in flight together:
    ``join --context`` as given (it may pass the model's context: several sequences, each
    within the model's context ``max_positions``), else :data:`DEFAULT_CONTEXT`, at most
    ``max_positions`` (its ``max_position_embeddings``; 0: unknown)."""
    if _context[0]:
        return _context[0]
    return min(DEFAULT_CONTEXT, max_positions) if max_positions > 0 else DEFAULT_CONTEXT


def kv_cache_bytes(layers: int, tokens: int, n_kv_heads: int, head_dim: int) -> int:
    """Bytes of keys and values of ``tokens`` positions for ``layers`` layers (float32)."""
    return 2 * max(layers, 0) * max(tokens, 0) * n_kv_heads * head_dim * KV_BYTES_PER_VALUE


def activation_bytes(rows: int, hidden: int, attn_width: int, ffn_width: int, vocab: int = 0) -> int:
    """Bytes of float32 activations alive while ``rows`` rows cross one layer: ``hidden``-wide
    copies (:data:`ROW_HIDDEN_COPIES`), ``attn_width`` (q, k and v together), the FFN's
    intermediate ``ffn_width`` twice (gate and up), and ``vocab`` logits per row (the head: the
    coordinator's)."""
    per_row = ROW_HIDDEN_COPIES * hidden + attn_width + 2 * ffn_width + vocab
    return rows * per_row * ACT_BYTES_PER_VALUE


# ----------------------------------------------------------------------------- reading from disk
DISK_READ_BYTES_PER_S = 200e6  # assumed when nothing was measured: a slow SSD or a busy disk
_read_rate: list[float | None] = [None]


def measure_read_rate(path: str | os.PathLike, nbytes: int = 64 << 20) -> float | None:
    """Bytes per second read from ``path`` past the page cache (its pages dropped first with
    ``posix_fadvise(DONTNEED)``, then up to ``nbytes`` read from the middle of the file); None
    where the platform cannot drop them or the file is too small to say. Kept for
    :func:`read_rate`."""
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        n = min(nbytes, size // 2)
        if n < 4 << 20:
            return None
        at = (size - n) // 2 // mmap.PAGESIZE * mmap.PAGESIZE
        os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)
        t, done = time.perf_counter(), 0
        while done < n:
            chunk = os.pread(fd, min(4 << 20, n - done), at + done)
            if not chunk:
                break
            done += len(chunk)
        elapsed = time.perf_counter() - t
        os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)
    except OSError:
        return None
    finally:
        os.close(fd)
    rate = done / elapsed if elapsed > 0 and done else None
    _read_rate[0] = rate
    return rate


def read_rate() -> tuple[float, bool]:
    """(bytes per second this peer reads its model file at, measured?): the last
    :func:`measure_read_rate`, else :data:`DISK_READ_BYTES_PER_S`."""
    return (_read_rate[0], True) if _read_rate[0] else (DISK_READ_BYTES_PER_S, False)


def _mapping_of(a: np.ndarray) -> mmap.mmap | None:
    base = a
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        if isinstance(base, memoryview):
            base = base.obj
            continue
        base = getattr(base, "base", None) if not isinstance(base, (bytes, bytearray)) else None
    return None


def release_pages(a: np.ndarray) -> bool:
    """Drop the pages of ``a`` (a view of a read-only file mapping) from this process's
    resident set; the next access reads them again (from the page cache, or the disk).

    Returns False, doing nothing, when ``a`` is not backed by a file mapping (an in-memory
    copy must never be discarded) or the platform has no ``madvise``.
    """
    mm = _mapping_of(a)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or a.size == 0:
        return False
    start = np.frombuffer(mm, np.uint8).ctypes.data
    ext = [(n - 1) * st for n, st in zip(a.shape, a.strides)]
    lo = a.ctypes.data - start + sum(e for e in ext if e < 0)
    hi = a.ctypes.data - start + sum(e for e in ext if e > 0) + a.itemsize
    page = mmap.PAGESIZE
    first = lo // page * page
    end = min(-(-hi // page) * page, len(mm))
    if not 0 <= first < end:
        return False
    mm.madvise(mmap.MADV_DONTNEED, first, end - first)
    return True
