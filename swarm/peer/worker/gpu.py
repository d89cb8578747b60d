"""``join --gpu``: a Python worker computes its expert and dense ranges on the GPU with the
browser peer's WGSL kernels (``web_peer/*.wgsl``), run natively through ``wgpu`` (Metal on
macOS, Vulkan on Linux, D3D12 on Windows; the optional dependency ``colibri-swarm[gpu]``).

Theory of operation
-------------------
:class:`GpuFfn` is a :class:`~swarm.peer.worker.ffn.FfnDevice`: when the worker accepts a plan,
each of its SwiGLU blocks (one expert, or one dense range) is uploaded once, in the encoding the
file stores it in — the GGUF blocks Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS as they are, F32 and
F16 as elements — and each request runs ``swiglu.wgsl`` then ``down.wgsl`` over its rows
(:class:`web_peer.wgpu_host.WgpuFfn`, the twin of the page's ``gpu.js``). What the kernels do
not read is requantized to Q8_0 first, as the coordinator does for a page
(:func:`~swarm.peer.weights.repack.requantize_q8_0`): Q5_0/Q5_1, Q2_K/Q3_K, the IQ types, BF16,
F16 on an adapter without ``shader-f16``, and gate/up pairs of two encodings (one kernel reads
both). Never float32 but for tensors the file stores as F32 (and a dense range's W_down cut
inside a block, which the engine itself hands over as F32). A block the kernels cannot take at
all — gpt-oss's biased, clamped experts, rows not a multiple of 32 weights — runs on the CPU
through the engine's kernels.

Numerics. The kernels sum in float32 in another order than the engine's CPU kernels: a GPU
peer is another numeric build (its Hello's ``build.blas`` names ``wgpu``, the adapter and the
kernels), so the coordinator checks its answers within the format's bound
(:mod:`swarm.peer.coordinator.bounds`), not bit for bit. Peers with the same
adapter and kernels give each other's bits.

``--gpu auto`` takes a GPU adapter when ``wgpu`` is installed and one is found, never a CPU
one (Mesa's lavapipe computes the kernels in software, slower than the engine's own kernels);
``--gpu on`` takes whatever adapter there is (lavapipe included: how CI runs it) and fails
loudly without one; ``off`` (the default) keeps the CPU: a mixed swarm's tokens then stay
the local run's bits.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from swarm import __version__
from swarm.compute.ffn import swiglu_ffn
from swarm.compute.kernels import MLPWeights
from swarm.compute.quant import QMatrix
from swarm.errors import KernelError, LocalProtocolError, SwarmError
from swarm.peer.net.messages import ADAPTER_PREFIX, NumericBuild
from swarm.peer.weights.repack import requantize_q8_0

if TYPE_CHECKING:
    from web_peer.wgpu_host import GpuFfnWeights, WgpuFfn

log = logging.getLogger(__name__)

GPU_MODES = ("off", "auto", "on")  # `join --gpu`


@dataclass(frozen=True)
class GpuWeights:
    """One SwiGLU block as a GPU peer holds it: ``gpu`` (a ``web_peer.wgpu_host.GpuFfnWeights``)
    or, for a block the kernels cannot take, ``cpu`` (the engine's weights)."""

    gpu: GpuFfnWeights | None = None
    cpu: MLPWeights | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held: the GPU buffers (both planes of every matrix), or the engine's weights."""
        held: GpuFfnWeights | MLPWeights | None = self.gpu if self.gpu is not None else self.cpu
        return int(held.nbytes) if held is not None else 0


def kernel_operand(m: QMatrix, formats: tuple[str, ...], role: str) -> tuple[np.ndarray, str]:
    """What ``WgpuFfn.upload`` takes for matrix ``m`` (rows × cols, in the file's encoding):
    (uint8 blocks [rows, row bytes], block format) for the block formats in ``formats``, (float32
    [rows, cols], "f32" or "f16") for F32 and F16 elements, else the Q8_0 requantization.
    ``role`` names the matrix in errors. Raises LocalProtocolError when a requantization is
    needed and the rows are not a multiple of 32 weights."""
    from web_peer.kernels import block_format

    name = m.qtype.name
    fmt = block_format(name)
    if fmt in formats:
        return np.ascontiguousarray(m.data), fmt
    if name == "F32":
        return np.ascontiguousarray(m.data).view(np.float32), "f32"
    if name == "F16" and "f16" in formats:
        return np.ascontiguousarray(m.data).view(np.float16).astype(np.float32), "f16"
    return _q8_0(m, role), "q8_0"


def _q8_0(m: QMatrix, role: str) -> np.ndarray:
    return requantize_q8_0(np.asarray(m.data), m.qtype.name, [m.shape[0], m.cols], role)


class GpuFfn:
    """The FFN device of a GPU peer (module docstring): ``host`` is a
    ``web_peer.wgpu_host.WgpuFfn`` on the adapter to use. Called from the worker's one compute
    thread only."""

    def __init__(self, host: WgpuFfn) -> None:
        self.host = host
        info = host.adapter.info
        self.adapter = f"{info.get('device') or info.get('vendor') or '?'}".strip()
        self.backend = str(info.get("backend_type", "?"))
        self.cpu_blocks = 0  # blocks the kernels could not take, run on the CPU (status, tests)

    @classmethod
    def open(cls, mode: str) -> GpuFfn | None:
        """The GPU device for ``join --gpu MODE`` (one of :data:`GPU_MODES`), or None for the CPU.

        Raises SwarmError for an unknown mode, and for ``on`` without wgpu or without an adapter."""
        if mode not in GPU_MODES:
            raise SwarmError(f"unknown --gpu mode {mode!r}: use one of {', '.join(GPU_MODES)}")
        if mode == "off":
            return None
        try:
            from web_peer.wgpu_host import WgpuFfn

            host = WgpuFfn()
        except ImportError:
            if mode == "on":
                raise SwarmError("--gpu on needs the wgpu package: pip install 'colibri-swarm[gpu]'") from None
            log.info("GPU: off (wgpu is not installed; pip install 'colibri-swarm[gpu]')")
            return None
        except KernelError as exc:
            if mode == "on":
                raise SwarmError(f"--gpu on: {exc}") from None
            log.info("GPU: off (%s)", exc)
            return None
        if mode == "auto" and host.adapter.info.get("adapter_type") == "CPU":
            log.info("GPU: off (the only adapter, %s, is a CPU one; --gpu on takes it anyway)",
                     host.adapter.info.get("device"))
            host.close()
            return None
        return cls(host)

    def close(self) -> None:
        """Release the device (and its poll thread)."""
        self.host.close()

    # ---- FfnDevice ----------------------------------------------------------------------------

    def load(self, weights: MLPWeights) -> GpuWeights:
        """Upload one SwiGLU block (module docstring). Raises KernelError on a GPU error."""
        if weights.bias is not None or weights.swiglu_limit:
            self.cpu_blocks += 1
            return GpuWeights(cpu=weights)
        formats = self.host.formats
        try:
            (g, gf), (u, uf), (d, df) = (kernel_operand(m, formats, role) for m, role in (
                (weights.gate, "gate"), (weights.up, "up"), (weights.down, "down")))
            if gf != uf:  # one kernel reads gate and up together
                g, u, gf = _q8_0(weights.gate, "gate"), _q8_0(weights.up, "up"), "q8_0"
        except LocalProtocolError as exc:
            log.info("a block the GPU kernels cannot read runs on the CPU: %s", exc)
            self.cpu_blocks += 1
            return GpuWeights(cpu=weights)
        return GpuWeights(gpu=self.host.upload(g, u, d, gf, down_fmt=df))

    def run(self, weights: GpuWeights, x: np.ndarray) -> np.ndarray:
        """y [n, H] float32 = down(swiglu(x)) for rows x [n, H] float32. Raises KernelError on a
        GPU error (the device is then reset) or a non-finite result."""
        if weights.gpu is None:
            assert weights.cpu is not None
            return swiglu_ffn(weights.cpu, x)
        return self.host.ffn(np.ascontiguousarray(x, dtype=np.float32), weights.gpu)

    # ---- what the peer announces ----------------------------------------------------------------

    def build(self) -> NumericBuild:
        """This peer's numeric build: ``blas`` reads ``wgpu <version> <backend> kernels:<formats>
        adapter:<name>`` (same adapter and kernels: the same bits)."""
        import wgpu

        from web_peer.kernels import BLOCK_FORMATS

        return NumericBuild(package=__version__, numpy=np.__version__,
                            blas=f"wgpu {wgpu.__version__} {self.backend} kernels:{','.join(BLOCK_FORMATS)} "
                                 f"{ADAPTER_PREFIX}{self.adapter}",
                            arch=platform.machine(), kernel_dtype="f32")

    def measure_gflops(self, hidden: int = 576, ffn: int = 1536, rows: int = 8, repeats: int = 5) -> float:
        """GFLOP/s of one SwiGLU block (SmolLM2's shape, Q8_0 blocks) on this device, a request's
        whole path (upload of the rows, both kernels, read-back): what the planner prices this
        peer by, as :func:`swarm.peer.node.measure_ffn_gflops` measures the CPU. Best of
        ``repeats`` after one warm-up (pipeline compilation)."""
        from web_peer.kernels import quantize_blocks

        rng = np.random.default_rng(0)
        scale = np.float32(hidden**-0.5)
        gate, up, down = (quantize_blocks(rng.standard_normal(shape, dtype=np.float32) * scale, "q8_0")
                          for shape in ((ffn, hidden), (ffn, hidden), (hidden, ffn)))
        w = self.host.upload(gate, up, down, "q8_0")
        x = rng.standard_normal((rows, hidden), dtype=np.float32)
        self.host.ffn(x, w)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            self.host.ffn(x, w)
            best = min(best, time.perf_counter() - t)
        return 3 * 2 * rows * hidden * ffn / best / 1e9
