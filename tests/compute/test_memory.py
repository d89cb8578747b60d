"""Peak memory of `colibri-swarm generate` on the default model: weights stay compact and mapped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.compute.default_model import default_model_path

MIB = 1 << 20
HEADROOM = 200 * MIB  # over the file's size: interpreter, libraries, kernels, KV cache, buffers

# Runs the CLI in a fresh interpreter and prints its peak RSS (VmHWM, KiB) as the last line.
# scipy is not a dependency of the package, but numba imports it whenever it is installed (as in
# this test environment, ~30 MiB); hidden here so the figure is that of an install of the package.
_CHILD = """
import sys
sys.modules["scipy"] = None
from swarm.cli import main
code = main(["generate", "--local", "--max-tokens", "24", "Why is the sky blue?"])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("VmHWM", status["VmHWM"].split()[0], flush=True)
sys.exit(code)
"""


@pytest.mark.slow
def test_generate_peak_rss_is_the_file_plus_200_mib():
    path = default_model_path()
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) > 1 and lines[-1].startswith("VmHWM"), out.stdout[-2000:]
    peak = int(lines[-1].split()[1]) * 1024
    size = path.stat().st_size
    assert peak <= size + HEADROOM, f"peak RSS {peak / MIB:.0f} MiB > file {size / MIB:.0f} MiB + 200 MiB"
