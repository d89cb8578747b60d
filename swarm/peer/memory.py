"""How much memory this peer can offer for weight slices, and giving mapped pages back.

A peer offers, in its hello, a budget for the weights it keeps (bytes). That budget is what the
operating system says is available to *this process*:

* the machine's available memory (``psutil.virtual_memory().available``: free memory plus
  page cache the kernel can drop);
* inside a container or any memory cgroup, the cgroup's limit — which ``psutil`` does not
  see — minus what the process already uses (its resident set: interpreter, libraries, the
  model's header and tokenizer). Version 1 (``memory.limit_in_bytes``) and version 2
  (``memory.max``) are read from the process's own cgroup as ``/proc/self/cgroup`` names it,
  under the mount ``/proc/self/mountinfo`` lists, and from every ancestor (the tightest wins);
* less :data:`HEADROOM_BYTES` for what is not a weight (activations, KV cache, message
  buffers);
* and never more than ``--memory``.

Weights are memory-mapped, so what a peer holds is the pages it touches. :func:`release_pages`
drops the pages of a mapped array from the process (``madvise(MADV_DONTNEED)``: the page cache
keeps them, the process's resident set and its cgroup's mapped memory no longer count them), for
weights read once outside the plan's share (a lost worker's rows recomputed from the file).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np
import psutil

HEADROOM_BYTES = 64 << 20  # activations, KV cache, message buffers: not offered for weights
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
    """Resident set size of this process (bytes): what it already uses."""
    return int(psutil.Process().memory_info().rss)


def available_bytes() -> int:
    """Bytes this process may still use: the machine's available memory, and within a memory
    cgroup its limit less this process's resident set, whichever is smaller (≥ 0)."""
    avail = int(psutil.virtual_memory().available)
    limit = cgroup_limit()
    if limit is not None:
        avail = min(avail, limit - process_rss())
    return max(avail, 0)


def weight_budget(cap_bytes: int | None = None) -> int:
    """The budget for weights this peer offers (bytes, ≥ 0): :func:`available_bytes` less
    :data:`HEADROOM_BYTES`, and at most ``cap_bytes`` (``join --memory``) when given.

    Raises ValueError for a negative cap.
    """
    if cap_bytes is not None and cap_bytes < 0:
        raise ValueError(f"the memory cap must be ≥ 0 bytes, got {cap_bytes}")
    budget = max(available_bytes() - HEADROOM_BYTES, 0)
    return budget if cap_bytes is None else min(budget, cap_bytes)


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
