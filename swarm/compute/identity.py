"""A model's identity: the hash peers compare to refuse a different model, cheap to compute.

Hashing every byte of the model costs minutes (17 GB: ~110 s; 250 GB: half an hour), at every
start. The identity instead hashes (SHA-256) what pins the model's structure — every file's
size and its whole header (GGUF: header, all metadata and the tensor index with names, types,
shapes and offsets; safetensors: its JSON header; an HF directory's ``config.json`` whole) —
plus samples of the tensor data: ``WINDOWS`` windows of ``WINDOW_BYTES`` spread evenly over the
data of all files together, and the first and last ``WINDOW_BYTES`` of each file's data (a few
MiB in all, whatever the model's size). The result is cached by each file's (path, device,
inode, size, mtime_ns) in the user cache, so a restart reads nothing.

What it guarantees and what it does not: docs/capacity.md ("The model's identity").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

SCHEME = b"colibri-swarm model identity 1\n"  # changes when the sampling rule changes
WINDOWS = 64  # windows spread over the data of the whole model
WINDOW_BYTES = 64 << 10  # 64 windows + 2 per file: ~4 MiB read for a single-file model
CACHE_FILE = "model-identity.json"
CACHE_ENTRIES = 64  # the most recent identities kept


def sample_windows(files: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The windows the identity reads, per file: ``files`` is ``(size, header_bytes)`` per
    file; returns for each file a sorted list of disjoint ``(offset, length)`` ranges within
    its data ``[header_bytes, size)``. Deterministic: it depends on the sizes alone."""
    data = [(max(size - header, 0), header) for size, header in files]
    total = sum(n for n, _ in data)
    wanted: list[list[tuple[int, int]]] = [[] for _ in files]
    for i, (n, header) in enumerate(data):
        if n:
            wanted[i] += [(header, min(WINDOW_BYTES, n)), (header + max(n - WINDOW_BYTES, 0), min(WINDOW_BYTES, n))]
    if total:
        span = max(total - WINDOW_BYTES, 0)
        for j in range(WINDOWS):
            at = span * j // (WINDOWS - 1)
            for i, (n, header) in enumerate(data):  # to the file that holds position ``at``
                if at < n:
                    wanted[i].append((header + at, min(WINDOW_BYTES, n - at)))
                    break
                at -= n
    return [_merged(w) for w in wanted]


def _merged(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, n in sorted(windows):
        if out and lo <= out[-1][0] + out[-1][1]:
            last_lo, last_n = out[-1]
            out[-1] = (last_lo, max(last_n, lo + n - last_lo))
        else:
            out.append((lo, n))
    return out


def compute_identity(files: Sequence[tuple[Path, int]]) -> str:
    """SHA-256 (64 hex digits) of the model in ``files`` (``(path, header_bytes)`` per file, in
    the model's order), read now: each file's size, its header bytes and its sampled windows
    (:func:`sample_windows`). Plain reads, each range's page cache dropped behind it
    (``posix_fadvise(DONTNEED)``): nothing stays charged to a memory-capped peer.

    Raises ModelFileError naming the file when one cannot be read."""
    from swarm.errors import ModelFileError

    sizes = []
    for path, header in files:
        try:
            sizes.append((os.stat(path).st_size, header))
        except OSError as e:
            raise ModelFileError(f"{path}: cannot read to identify the model: {e.strerror}") from None
    h = hashlib.sha256(SCHEME)
    h.update(struct.pack("<Q", len(files)))
    for (path, header), (size, _), windows in zip(files, sizes, sample_windows(sizes)):
        h.update(struct.pack("<QQ", size, header))
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ModelFileError(f"{path}: cannot read to identify the model: {e.strerror}") from None
        try:
            for lo, n in [(0, min(header, size)), *windows]:
                h.update(struct.pack("<QQ", lo, n))
                h.update(_read(fd, path, lo, n))
        finally:
            os.close(fd)
    return h.hexdigest()


def _read(fd: int, path: Path, lo: int, n: int) -> bytes:
    from swarm.errors import ModelFileError

    parts, at = [], lo
    while at < lo + n:
        chunk = os.pread(fd, min(lo + n - at, 8 << 20), at)
        if not chunk:
            raise ModelFileError(f"{path}: ended at byte {at} while identifying the model (truncated while in use?)")
        parts.append(chunk)
        at += len(chunk)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, lo, n, os.POSIX_FADV_DONTNEED)
    return b"".join(parts)


def _cache_key(files: Sequence[tuple[Path, int]]) -> str | None:
    """The files as they are now (path, device, inode, size, mtime_ns, header), or None when
    one cannot be stat'ed. A replaced or rewritten file gets another key."""
    parts = [SCHEME.decode().strip()]
    for path, header in files:
        try:
            st = os.stat(path)
        except OSError:
            return None
        parts.append(f"{Path(path).resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{header}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _cache_path() -> Path | None:
    """The cache file, or None where the user cache directory cannot be created."""
    from swarm.errors import SwarmError
    from swarm.paths import cache_dir

    try:
        return cache_dir() / CACHE_FILE
    except (OSError, SwarmError):  # SwarmError: cache_dir names the directory it could not make
        return None


def _load_cache(path: Path) -> dict[str, str]:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
    return {}


def model_identity(files: Sequence[tuple[Path, int]]) -> str:
    """:func:`compute_identity` of ``files``, from the user cache when none of them changed
    since (same path, device, inode, size and mtime_ns): a restart reads nothing of the model.
    A cache that cannot be read or written is ignored (the identity is computed again)."""
    key, cache = _cache_key(files), _cache_path()
    if key is None or cache is None:
        return compute_identity(files)
    hit = _load_cache(cache).get(key)
    if hit and len(hit) == 64 and all(c in "0123456789abcdef" for c in hit):
        return hit
    ident = compute_identity(files)
    entries = _load_cache(cache)
    entries.pop(key, None)
    entries[key] = ident  # newest last; the oldest go past CACHE_ENTRIES
    entries = dict(list(entries.items())[-CACHE_ENTRIES:])
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, cache)  # whole or not at all: another peer may read it now
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
    return ident
