"""Memory budgets from the OS and the process's memory cgroup; giving mapped pages back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from swarm.peer import memory
from tests.conftest import require
from tests.multihost.netns import REPO_ROOT, MemoryCgroup

PROBE = ("import json; from swarm.peer import memory as m; "
         "print(json.dumps({'limit': m.cgroup_limit(), 'anon': m.process_baseline(), 'budget': m.weight_budget(), "
         "'capped': m.weight_budget(192 << 20)}))")


def probe_in(group: MemoryCgroup) -> dict:
    """What a Python process started inside ``group`` reports."""
    out = subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.path / "cgroup.procs"),
                          sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_cgroup_limit_caps_the_budget_that_psutil_does_not_see():
    require(os.geteuid() == 0 and MemoryCgroup.ROOT.joinpath("cgroup.procs").exists(),
            "root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    group = MemoryCgroup(f"probe{os.getpid()}", 300 << 20)
    try:
        got = probe_in(group)
    finally:
        group.close()
    assert got["limit"] == 300 << 20
    # the limit less the process's anonymous memory (read a moment apart) less the page-cache headroom
    assert abs(got["budget"] - ((300 << 20) - memory.page_cache_headroom(300 << 20) - got["anon"])) < 8 << 20
    assert 0 < got["budget"] < 300 << 20
    # --memory 192 MiB caps the whole process: its baseline and headroom come out of it
    assert abs(got["capped"] - ((192 << 20) - memory.page_cache_headroom(192 << 20) - got["anon"])) < 8 << 20


def test_without_a_limit_the_budget_is_what_the_machine_has_available():
    import psutil

    budget = memory.weight_budget()
    if memory.cgroup_limit() is None:
        limit = psutil.virtual_memory().available + memory.process_baseline()
        assert abs(budget - (limit - memory.process_baseline() - memory.page_cache_headroom(limit))) < 256 << 20
    assert memory.weight_budget(1 << 20) == 0  # a 1 MiB process cannot even hold its baseline
    with pytest.raises(ValueError, match="must be ≥ 0"):
        memory.weight_budget(-1)


def _rss_file_kib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssFile:"))


def test_release_pages_gives_mapped_pages_back_and_never_touches_copies(tmp_path):
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    data.tofile(path)
    mapped = np.asarray(np.memmap(path, dtype=np.uint8, mode="r")).reshape(-1, 4096)
    before = _rss_file_kib()
    assert int(mapped[:, ::512].sum()) > 0  # touch every page
    touched = _rss_file_kib()
    assert touched - before > 48 << 10  # ≥ 48 of the 64 MiB became resident
    assert memory.release_pages(mapped[1024:])  # a view: its pages only (to page bounds)
    assert touched - _rss_file_kib() > 40 << 10
    assert np.array_equal(mapped[1024:], data.reshape(-1, 4096)[1024:])  # read back from the file
    copy = np.array(mapped[:16])
    assert not memory.release_pages(copy) and np.array_equal(copy, data.reshape(-1, 4096)[:16])


@pytest.mark.parametrize("baseline_mib", [1, 144, 1216, 1300, 2000, 20000])
def test_least_limit_is_where_an_allowance_begins(baseline_mib):
    """``join --memory`` below ``least_limit`` is refused as leaving nothing; the figure it names
    must be the real edge on both sides of the headroom's floor (64 MiB, then 5 % of the limit)."""
    baseline = baseline_mib << 20
    edge = memory.least_limit(baseline)
    assert memory.allowance(available=1 << 50, baseline=baseline, cap=edge).bytes == 0
    assert memory.allowance(available=1 << 50, baseline=baseline, cap=edge + (1 << 20)).bytes > 0
