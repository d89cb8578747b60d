"""Time to identify a model: the whole files' SHA-256 (what a peer did at every start before)
against the sampled identity (``swarm.compute.identity``), cold and from the cache.

Each timing starts with the model's pages dropped from the page cache (``posix_fadvise
(DONTNEED)`` on each file: clean pages, so only this model is evicted), so "cold" means read
from the disk. The identity cache lives in a temporary directory; "cached" is a second call,
as a restarted peer makes it.

    python3 bench/model_identity.py MODEL.gguf|HF_DIR [--no-full]

Prints one JSON object: bytes, files, the seconds of each, and the bytes the identity reads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _full_sha256(paths) -> str:
    """The former identity: every byte, 4 MiB plain reads, the page cache dropped behind."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as fh:
            done = 0
            while chunk := fh.read(1 << 22):
                h.update(chunk)
                os.posix_fadvise(fh.fileno(), done, len(chunk), os.POSIX_FADV_DONTNEED)
                done += len(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF file (any shard of a split one) or an HF directory")
    ap.add_argument("--no-full", action="store_true", help="skip the whole-file SHA-256")
    args = ap.parse_args()
    os.environ["COLIBRI_SWARM_CACHE_DIR"] = tempfile.mkdtemp(prefix="identity-cache-")
    from swarm.compute.checkpoint import open_checkpoint
    from swarm.compute.identity import model_identity, sample_windows
    from swarm.compute.tensors import GGUFFile

    t = time.perf_counter()
    if Path(args.model).is_dir():
        files = open_checkpoint(args.model).identity_files
    else:  # any GGUF, a model or not: what the identity reads is the same
        f = GGUFFile(args.model)
        files = list(zip(f.paths, f.header_bytes))
    open_s = time.perf_counter() - t
    paths = [p for p, _ in files]
    sizes = [(p.stat().st_size, header) for p, header in files]
    out = {"model": str(args.model), "files": len(paths), "bytes": sum(s for s, _ in sizes), "open_s": round(open_s, 3),
           "identity_reads_bytes": sum(min(h, s) for s, h in sizes)
           + sum(n for w in sample_windows(sizes) for _, n in w)}
    if not args.no_full:
        _evict(paths)
        t = time.perf_counter()
        _full_sha256(paths)
        out["full_sha256_cold_s"] = round(time.perf_counter() - t, 3)
    _evict(paths)
    t = time.perf_counter()
    ident = model_identity(files)
    out["identity_cold_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    assert model_identity(files) == ident
    out["identity_cached_s"] = round(time.perf_counter() - t, 4)
    out["identity"] = ident
    print(json.dumps(out))


if __name__ == "__main__":
    main()
