"""``join --gpu``: a Python worker computes its expert and dense ranges, and the weight products
of its stages, on the GPU with the browser peer's WGSL kernels (``web_peer/*.wgsl``), run
natively through ``wgpu`` (Metal on macOS, Vulkan on Linux, D3D12 on Windows; the optional
dependency ``colibri-swarm[gpu]``).

Theory of operation
-------------------
:class:`GpuFfn` is a :class:`~swarm.peer.worker.ffn.FfnDevice`: when the worker accepts a plan,
each of its SwiGLU blocks (one expert, or one dense range) is uploaded once, in the encoding the
file stores it in — the GGUF blocks Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS as they are, F32 and
F16 as elements — and each request runs ``swiglu.wgsl`` then ``down.wgsl`` over its rows
(:class:`web_peer.wgpu_host.WgpuFfn`, the twin of the page's ``gpu.js``). What the kernels do
not read is requantized to Q8_0 first, as the coordinator does for a page
(:func:`~swarm.peer.weights.repack.requantize_q8_0`): Q5_0/Q5_1, Q2_K/Q3_K, the IQ types, BF16,
and gate/up pairs of two encodings (one kernel reads both); F16 is read on any adapter (as u32
words, no ``shader-f16`` needed). Never float32 but for tensors the file stores as F32 (and a dense range's W_down cut
inside a block, which the engine itself hands over as F32). A block the kernels cannot take at
all — gpt-oss's biased, clamped experts, rows not a multiple of 32 weights — runs on the CPU
through the engine's kernels.

Stages. A GPU peer given a stage (layers ``lo .. hi-1``) runs it with :class:`GpuStage`, one of
two ways, fixed per stage. Whole layers (:meth:`GpuStage.run_layers`) where every layer has
standard attention (:meth:`GpuStage.resident`): one submission a sequence and step runs RMSNorm,
Q/K/V, RoPE on the engine's tables, the new keys/values into the sequence's KV cache kept in GPU
buffers, causal attention over it, O, the residual, RMSNorm and SwiGLU
(``web_peer/{rmsnorm,rope,kv_write,attention,add}.wgsl`` and the products: Q|K|V stacked
where they share a format, O and down adding to the residual themselves); a MoE layer is routed
on the CPU between two submissions. Otherwise products only: the StageRunner's layers are the engine's own
``Model.layers`` on a view of the model whose Q, K, V and O projections go to the GPU
(:meth:`~swarm.compute.model.Model.with_products`; the down kernel is a plain product of
one matrix, so a projection is ``WgpuFfn.upload_linear``), and whose FFN backend runs
each SwiGLU block — the dense MLP, each selected expert, the shared expert — through
:meth:`GpuFfn.run`; norms, RoPE, attention over the KV cache (in host memory), routing and the
combine stay the engine's code. Unlike a range, a stage never computes on a Q8_0 repack: a
matrix the kernels do not read stays on the engine's kernels, so the stage bound
(:func:`~swarm.peer.coordinator.bounds.stage_rtol`, no repack term) holds.

Numerics. The kernels sum in float32 in another order than the engine's CPU kernels: a GPU
peer is another numeric build (its Hello's ``build.blas`` names ``wgpu``, the adapter and the
kernels), so the coordinator checks its answers within the format's bound
(:mod:`swarm.peer.coordinator.bounds`), not bit for bit. Peers with the same
adapter and kernels give each other's bits.

The int8 numerics (``join --gpu auto|on --numerics int8``). Each SwiGLU block's gate, up and
down go up in the file's blocks for the GPU's int8 GEMVs (``web_peer/int8_activations.py``:
Q4_K, Q6_K, Q8_0; a matrix they do not read stays on the engine's int8 product), and a request
runs :func:`~swarm.compute.int8_swiglu.swiglu_int8`: the engine's quantizer on the CPU, gate and
up on the GPU, the engine's SwiGLU and quantizer on the CPU, down on the GPU. The answer carries
the down product's int8 rows, by which an int8 coordinator checks it (another build: a bound,
not bits). Such a peer is planned FFN ranges only, never a stage (one sent anyway runs on the
engine's int8 kernels: :class:`~swarm.peer.worker.role.WorkerRole` gives it no GpuStage).

``--gpu auto`` takes a GPU adapter when ``wgpu`` is installed and one is found, never a CPU
one (Mesa's lavapipe computes the kernels in software, slower than the engine's own kernels);
``--gpu on`` takes whatever adapter there is (lavapipe included: how CI runs it) and fails
loudly without one; ``off`` (the default) keeps the CPU: a mixed swarm's tokens then stay
the local run's bits.
"""

from __future__ import annotations

import itertools
import logging
import platform
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from swarm import __version__
from swarm.compute.ffn import combine, expert_rows, route, segment_ids, swiglu_ffn
from swarm.compute.int8_swiglu import swiglu_int8_many
from swarm.compute.kernels import MLPWeights, sigmoid
from swarm.compute.model import AttentionWeights
from swarm.compute.quant import QMatrix, as_qmatrix, matmul_many
from swarm.errors import KernelError, LocalProtocolError, SwarmError
from swarm.peer.net.messages import ADAPTER_PREFIX, INT8_KERNEL_DTYPE, NumericBuild
from swarm.peer.weights.repack import requantize_q8_0
from swarm.peer.worker.stages import DeviceKVFull

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from web_peer.int8_activations import X8Gemv
    from web_peer.wgpu_host import GpuFfnWeights, GpuLinear, WgpuFfn

log = logging.getLogger(__name__)

GPU_MODES = ("off", "auto", "on")  # `join --gpu`


@dataclass(frozen=True)
class GpuWeights:
    """One SwiGLU block as a GPU peer holds it: ``gpu`` (a ``web_peer.wgpu_host.GpuFfnWeights``)
    or, for a block the kernels cannot take, ``cpu`` (the engine's weights). Under the int8
    numerics, ``cpu`` and ``x8``: gate, up and down each a ``GpuLinear`` of the int8 GEMVs, or
    None where that product runs on the CPU (module docstring, "The int8 numerics")."""

    gpu: GpuFfnWeights | None = None
    cpu: MLPWeights | None = None
    x8: tuple[GpuLinear | None, GpuLinear | None, GpuLinear | None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held: the GPU buffers (both planes of every matrix), or the engine's weights."""
        if self.x8 is not None and self.cpu is not None:
            mats = (self.cpu.gate, self.cpu.up, self.cpu.down)
            return sum(int(g.nbytes) if g is not None else int(m.nbytes) for m, g in zip(mats, self.x8))
        held: GpuFfnWeights | MLPWeights | None = self.gpu if self.gpu is not None else self.cpu
        return int(held.nbytes) if held is not None else 0


def kernel_operand(m: QMatrix, formats: tuple[str, ...], role: str,
                   repack: bool = True) -> tuple[np.ndarray, str] | None:
    """What ``WgpuFfn.upload`` takes for matrix ``m`` (rows × cols, in the file's encoding):
    (uint8 blocks [rows, row bytes], block format) for the block formats in ``formats``, (float32
    [rows, cols], "f32" or "f16") for F32 and F16 elements, else the Q8_0 requantization (None
    without ``repack``). ``role`` names the matrix in errors. Raises LocalProtocolError when a
    requantization is needed and the rows are not a multiple of 32 weights."""
    from web_peer.kernels import block_format

    name = m.qtype.name
    fmt = block_format(name)
    if fmt in formats:
        return np.ascontiguousarray(m.data), fmt
    if name == "F32":
        return np.ascontiguousarray(m.data).view(np.float32), "f32"
    if name == "F16" and "f16" in formats:
        return np.ascontiguousarray(m.data).view(np.float16).astype(np.float32), "f16"
    return (_q8_0(m, role), "q8_0") if repack else None


def x8_format(m: QMatrix) -> str | None:
    """The int8 GEMV's format that reads matrix ``m`` in the file's blocks (``web_peer.int8_activations``:
    Q4_K, Q6_K, and Q8_0 rows of a multiple of 64 weights, where the CPU has an int8 product),
    else None."""
    from web_peer.int8_activations import X8_FORMATS
    from web_peer.kernels import block_format

    fmt = block_format(m.qtype.name)
    return fmt if fmt in X8_FORMATS and m.cols % (64 if fmt == "q8_0" else 256) == 0 else None


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
        self.cpu_products = 0  # int8 numerics: matrices with no int8 GEMV, their products on the CPU
        self._gemv: tuple[object, X8Gemv] | None = None  # (device, the int8 GEMVs' pipelines on it)

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

    def load(self, weights: MLPWeights, repack: bool = True) -> GpuWeights:
        """Upload one SwiGLU block (module docstring); without ``repack``, a block that would
        need a Q8_0 requantization stays on the CPU instead; under the int8 numerics, each matrix
        with an int8 GEMV (:meth:`load_int8`). Raises KernelError on a GPU error."""
        from swarm.compute import numerics

        if numerics.int8():
            return self.load_int8(weights)
        if weights.bias is not None or weights.swiglu_limit:
            self.cpu_blocks += 1
            return GpuWeights(cpu=weights)
        formats = self.host.formats
        try:
            ops = [kernel_operand(m, formats, role, repack) for m, role in (
                (weights.gate, "gate"), (weights.up, "up"), (weights.down, "down"))]
            read = [op for op in ops if op is not None]
            if len(read) < 3 or (not repack and read[0][1] != read[1][1]):
                raise LocalProtocolError("its encodings need a Q8_0 repack, which a stage does not take")
            (g, gf), (u, uf), (d, df) = read
            if gf != uf:  # one kernel reads gate and up together
                g, u, gf = _q8_0(weights.gate, "gate"), _q8_0(weights.up, "up"), "q8_0"
        except LocalProtocolError as exc:
            log.info("a block the GPU kernels cannot read runs on the CPU: %s", exc)
            self.cpu_blocks += 1
            return GpuWeights(cpu=weights)
        return GpuWeights(gpu=self.host.upload(g, u, d, gf, down_fmt=df))

    # ---- the int8 numerics ------------------------------------------------------------------

    def load_int8(self, weights: MLPWeights) -> GpuWeights:
        """Upload one SwiGLU block for the int8 numerics: gate, up and down each in the file's
        blocks where an int8 GEMV reads them (:func:`x8_format`), else left to the engine's int8
        product on the CPU (``cpu_products`` counts those). Raises KernelError on a GPU error."""
        ours = []
        for m in (weights.gate, weights.up, weights.down):
            fmt = x8_format(m)
            ours.append(None if fmt is None else self.host.upload_linear(np.ascontiguousarray(m.data), fmt))
            self.cpu_products += fmt is None
        return GpuWeights(cpu=weights, x8=(ours[0], ours[1], ours[2]))

    def run_rows(self, weights: GpuWeights, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """y [n, H] float32 = the int8 SwiGLU of rows x [n, H] float32 with the int8 rows its down
        product took (:func:`~swarm.compute.int8_swiglu.swiglu_int8`): the products on the GPU's
        int8 GEMVs (on the CPU's int8 rows, quantized here by the engine's quantizer), the
        activation and the quantizer the engine's. Raises KernelError on a GPU error, ValueError
        for a block loaded without :meth:`load_int8` or a matrix without an int8 product."""
        return self.run_rows_many([weights], [x])[0]

    def run_rows_many(self, weights: Sequence[GpuWeights],
                      xs: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``[run_rows(w, x) for w, x in zip(weights, xs)]``, every block's gate and up GEMVs in one
        submission, then their down GEMVs in another (a request's experts). Raises as :meth:`run_rows`."""
        if any(w.x8 is None or w.cpu is None for w in weights):
            raise ValueError("a block was not loaded for the int8 numerics")
        held = {id(m): g for w in weights for m, g in zip((_cpu(w).gate, _cpu(w).up, _cpu(w).down), w.x8 or ())
                if g is not None}
        return swiglu_int8_many([_cpu(w) for w in weights], xs, lambda products: self._x8_products(held, products))

    def _x8_products(self, held: dict[int, GpuLinear], products) -> list[np.ndarray]:
        """The int8 products (matrix, int8 rows): those of a matrix in ``held`` (id → its upload)
        on the GPU in one submission, the others on the CPU."""
        from web_peer.int8_activations import X8Gemv

        gpu = [i for i, (m, rows) in enumerate(products) if id(m) in held and len(rows)]
        if self._gemv is None or self._gemv[0] is not self.host.device:  # pipelines of the device now
            self._gemv = (self.host.device, X8Gemv(self.host))
        done = dict(zip(gpu, self._gemv[1].run_rows([(held[id(products[i][0])], products[i][1]) for i in gpu])))
        return [done[i] if i in done else m.matmul_int8_rows(rows) for i, (m, rows) in enumerate(products)]

    def run_many(self, weights: Sequence[GpuWeights], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``[run(w, x) for w, x in zip(weights, xs)]``, the blocks on the GPU in one submission
        (a request's or a decode step's experts). Raises as :meth:`run`."""
        if any(w.x8 is not None for w in weights):
            return [y for y, _ in self.run_rows_many(weights, xs)]
        on_gpu = [(np.ascontiguousarray(x, dtype=np.float32), w.gpu) for w, x in zip(weights, xs) if w.gpu is not None]
        done = iter(self.host.ffn_many(on_gpu) if on_gpu else ())
        return [next(done) if w.gpu is not None else swiglu_ffn(_cpu(w), x) for w, x in zip(weights, xs)]

    def run(self, weights: GpuWeights, x: np.ndarray) -> np.ndarray:
        """y [n, H] float32 = down(swiglu(x)) for rows x [n, H] float32. Raises KernelError on a
        GPU error (the device is then reset) or a non-finite result."""
        if weights.x8 is not None:
            return self.run_rows(weights, x)[0]
        if weights.gpu is None:
            assert weights.cpu is not None
            return swiglu_ffn(weights.cpu, x)
        return self.host.ffn(np.ascontiguousarray(x, dtype=np.float32), weights.gpu)

    # ---- what the peer announces ----------------------------------------------------------------

    def build(self) -> NumericBuild:
        """This peer's numeric build: ``blas`` reads ``wgpu <version> <backend> kernels:<formats>
        adapter:<name>`` (same adapter and kernels: the same bits), under the int8 numerics
        ``wgpu <version> <backend> x8:<formats> adapter:<name>`` (the int8 GEMVs' formats) and
        ``kernel_dtype`` ``i8``: an int8 swarm's coordinator checks its answers by their down
        rows (module docstring, "The int8 numerics")."""
        import wgpu

        from swarm.compute import numerics
        from web_peer.int8_activations import X8_FORMATS
        from web_peer.kernels import BLOCK_FORMATS

        int8 = numerics.int8()
        kernels = f"x8:{','.join(X8_FORMATS)}" if int8 else f"kernels:{','.join(BLOCK_FORMATS)}"
        return NumericBuild(package=__version__, numpy=np.__version__,
                            blas=f"wgpu {wgpu.__version__} {self.backend} {kernels} {ADAPTER_PREFIX}{self.adapter}",
                            arch=platform.machine(), kernel_dtype=INT8_KERNEL_DTYPE if int8 else "f32")

    def measure_gflops(self, hidden: int = 576, ffn: int = 1536, rows: int = 8, repeats: int = 5) -> float:
        """GFLOP/s of one SwiGLU block (SmolLM2's shape, Q8_0 blocks) on this device, a request's
        whole path (upload of the rows, both kernels, read-back): what the planner prices this
        peer by, as :func:`swarm.peer.node.measure_ffn_gflops` measures the CPU. Best of
        ``repeats`` after one warm-up (pipeline compilation). Under the int8 numerics, the int8
        block (:meth:`run_rows`: the CPU's quantizer and activation between the GPU's GEMVs)."""
        from swarm.compute import numerics
        from swarm.compute.quant import QT
        from web_peer.kernels import quantize_blocks

        rng = np.random.default_rng(0)
        scale = np.float32(hidden**-0.5)
        gate, up, down = (quantize_blocks(rng.standard_normal(shape, dtype=np.float32) * scale, "q8_0")
                          for shape in ((ffn, hidden), (ffn, hidden), (hidden, ffn)))
        x = rng.standard_normal((rows, hidden), dtype=np.float32)
        run: Callable[[], object]
        if numerics.int8():
            block = self.load_int8(MLPWeights(QMatrix(gate, QT.Q8_0, hidden), QMatrix(up, QT.Q8_0, hidden),
                                              QMatrix(down, QT.Q8_0, ffn)))
            run = lambda: self.run_rows(block, x)  # noqa: E731
        else:
            w = self.host.upload(gate, up, down, "q8_0")
            run = lambda: self.host.ffn(x, w)  # noqa: E731
        run()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t)
        return 3 * 2 * rows * hidden * ffn / best / 1e9


DENSE, SHARED = -1, -2  # GpuStage's block keys besides expert indices: a layer's dense MLP, its shared expert


@dataclass
class _Scratch:
    """The buffers of a decode step (T = 1) through stage ``key`` = (lo, hi, device), kept across
    steps with the bind groups made over them (``binds``: WgpuFfn._bind's cache), so a step encodes
    its dispatches without making a bind group again. The kernels whose parameters name the
    position (``kv_write``, ``attention``) read them from ``uniforms``, written once a step, and
    their bind groups, over a sequence's own KV buffers, are kept with those (:attr:`GpuKV.binds`).
    ``scores``: attention's, sized for ``scores_cap`` floats (the longest sequence's heads ×
    positions so far)."""

    key: tuple
    buffers: dict
    binds: dict = field(default_factory=dict)
    scores: object = None
    scores_cap: int = 0
    uniforms: dict = field(default_factory=dict)  # kernel role → Uniform: the parameters naming the position
    readback: object = None  # WgpuFfn.readback of a step's rows: results come back through it


class GpuStage:
    """A GPU peer's stages (module docstring, "Stages") on ``gpu``, for the layers of ``model``:
    whole layers (:meth:`resident`, :meth:`run_layers`: the KV cache in GPU buffers) where every
    layer of a stage allows, else the :class:`~swarm.compute.model.ProductDevice` of a
    StageRunner's model view — each layer's Q, K, V and O projections — and the FFN backend of
    its layers — the dense SwiGLU, or the selected experts and the shared expert — with routing,
    norms, RoPE, attention, biases and the combine the engine's own code.

    Every matrix the kernels do not read in the file's encoding stays on the engine's kernels: a
    stage never computes on a Q8_0 repack (its answers are held to
    :func:`~swarm.peer.coordinator.bounds.stage_rtol`, which has no repack term). Weights are
    uploaded by :meth:`load_layer` when a stage plan is accepted, else on first use. Called
    from the worker's one compute thread only. Raises KernelError on a GPU error (then
    :meth:`reset` drops the uploads; the next request uploads again)."""

    def __init__(self, gpu: GpuFfn, model: Model, whole_layers: bool = True, kv_positions: int | None = None,
                 fuse: bool = True) -> None:
        from swarm.peer import memory

        self.gpu = gpu
        self.model = model
        self.whole_layers = whole_layers  # False: products only, every stage (tests, benchmarks)
        # False: a product per matrix and the residual adds of their own, as before the fusions (tests: the same bits)
        self.fuse = fuse
        # Positions of keys/values a layer's GPU buffers hold at most: the context the plan counted
        # this peer's KV cache for (reserve_of's, from the same --context), never a doubling past it.
        self.kv_positions = kv_positions or memory.context_tokens(getattr(model.config, "max_position_embeddings", 0) or 0)
        self._linear: dict[QMatrix, _Rows | None] = {}  # attention matrix → its rows on the GPU, or None: the CPU
        self._blocks: dict[tuple[int, int], GpuWeights] = {}  # (layer, expert | DENSE | SHARED) → SwiGLU block
        self._vector_buffers: dict[int, dict] = {}  # layer → its norms' and biases' buffers (_vectors)
        self._resident: dict[tuple[int, int], bool] = {}  # stage → whether it runs wholly here (resident)
        self._kv_holders: weakref.WeakSet = weakref.WeakSet()  # caches with keys/values on the GPU
        self._decode_scratch: _Scratch | None = None  # run_layers' buffers of a decode step, kept across steps

    def load_layer(self, layer: int) -> int:
        """Upload layer ``layer``'s attention projections and FFN blocks (every expert of a MoE
        layer) now; returns the bytes held for them."""
        m = self.model
        held = {id(r.linear): r.linear for r in self._attention_linears(layer) if r is not None}  # Q|K|V once
        total = sum(g.nbytes for g in held.values())
        if not m.is_moe_layer(layer):
            return total + self._block(layer, DENSE).nbytes
        keys = [*range(m.config.n_experts), *([SHARED] if m.has_shared_expert(layer) else [])]
        return total + sum(self._block(layer, e).nbytes for e in keys)

    def keep_layers(self, layers: set[int]) -> None:
        """Drop the uploads of every layer outside ``layers`` (a stage plan moved them away)."""
        keep = {q for layer in layers for q in _projections(self.model.attention_weights(layer))}
        self._linear = {q: g for q, g in self._linear.items() if q in keep}
        self._blocks = {k: v for k, v in self._blocks.items() if k[0] in layers}
        self._vector_buffers = {k: v for k, v in self._vector_buffers.items() if k in layers}
        self._decode_scratch = None  # its bind groups hold the weights of the layers before

    def reset(self) -> None:
        """Forget every upload (after a GPU error: the device was reset)."""
        self._linear, self._blocks, self._vector_buffers = {}, {}, {}
        self._decode_scratch = None

    def held(self) -> dict:
        """What is uploaded (status, tests): ``gpu`` matrices and SwiGLU blocks on the GPU,
        ``cpu`` those the kernels do not read (run by the engine), ``formats`` the kernel formats
        in use (a set of names: "q4_k", "f32", ...)."""
        gpu = [r.linear for r in self._linear.values() if r is not None] + [b.gpu for b in self._blocks.values() if b.gpu]
        formats = {g.fmt for g in gpu} | {b.gpu.down_fmt for b in self._blocks.values() if b.gpu}
        return {"gpu": len(gpu), "cpu": len(self._linear) + len(self._blocks) - len(gpu), "formats": formats}

    # ---- whole layers on the GPU, the KV cache in GPU buffers ------------------------------------

    def resident(self, lo: int, hi: int) -> bool:
        """Whether layers ``lo .. hi-1`` run wholly on the GPU (:meth:`run_layers`): each a layer
        of standard attention (Q/K/V and O biases, and Qwen3's norm of each head, taken; no norm
        of the whole Q/K, clipping, sinks, window or output gate), RoPE over whole heads, every
        attention product and a dense MLP on the GPU (a MoE layer is routed on the CPU between two
        submissions, its experts on the GPU), widths a multiple of 4.
        Else the stage runs the engine's layers with only the products here (the same answer for a
        given stage, so a sequence's cache always lives in one place)."""
        key = (lo, hi)
        if key not in self._resident:
            self._resident[key] = self.whole_layers and all(self._plain(layer) for layer in range(lo, hi))
        return self._resident[key]

    def _plain(self, layer: int) -> bool:
        m, c = self.model, self.model.config
        w = m.attention_weights(layer)
        if (not isinstance(w, AttentionWeights) or c.attn_output_gate or c.qk_norm not in (None, "head")
                or c.clip_qkv is not None or c.rope_dim != c.head_dim or c.layer_window(layer) or c.sliding_window
                or w.sinks is not None):
            return False
        widths = (c.hidden_size, c.n_heads * c.head_dim, c.head_dim)
        ffn = m.is_moe_layer(layer) or self._block(layer, DENSE).gpu is not None  # MoE: routed on the CPU
        return ffn and all(n % 4 == 0 for n in widths) and None not in self._attention_linears(layer)

    def run_layers(self, x: np.ndarray, cache, start: int, lo: int, hi: int) -> np.ndarray:
        """Rows x [T, H] float32 at positions ``start ..`` of ``cache``'s sequence through layers
        ``lo .. hi-1`` (:meth:`resident`), all in one submission: RMSNorm, Q/K/V, RoPE, the new
        keys/values into the sequence's GPU KV cache (``cache.device_kv``, grown as needed), causal
        attention over it, O, the residual, RMSNorm, SwiGLU, the residual (biases and the norm of
        each head where the layer has them; a MoE layer's normed rows come back for routing and
        its experts' sum goes up: :meth:`ffn`). Returns [T, H] float32.
        Rows whose scratch would pass a binding's limit go in chunks, one submission each (a chunk's
        attention reads the keys/values the chunks before it wrote). Raises KernelError on a GPU
        error, or when the cache's buffers are on a lost device."""
        host, m, c = self.gpu.host, self.model, self.model.config
        T, H = x.shape
        nh, nkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        nq, nk, heads = nh * hd, nkv * hd, (nh + nkv) * hd
        width = nq + 2 * nk
        cap = self._kv(cache, lo, start, start + T).cap  # the capacity every layer of the stage grows to
        inter = max([_gpu(self._block(layer, DENSE)).inter + 3 for layer in range(lo, hi) if not m.is_moe_layer(layer)]
                    or [H])
        rows = max(1, host.max_binding // (4 * max(nh * cap, width, inter, H)))  # per submission
        if T > rows:
            return np.concatenate([self.run_layers(x[a:a + rows], cache, start + a, lo, hi) for a in range(0, T, rows)])
        cos, ssin = (np.ascontiguousarray(np.broadcast_to(a, (T, nh + nkv, hd)), np.float32)
                     for a in m.qk_tables(start, T))  # [T, nh + nkv, hd] each
        kvs = [self._kv(cache, layer, start, start + T) for layer in range(lo, hi)]
        sizes = {"xb": T * H, "hb": T * H, "qkv": T * width, "qk": T * heads, "att": T * nq, "yb": T * H,
                 "cb": cos.size, "sb": ssin.size, "fb": T * inter}
        if c.qk_norm == "head":  # Qwen3's norm of each head writes a row of its own
            sizes["qkn"] = T * width
        if any(m.is_moe_layer(layer) for layer in range(lo, hi)):  # the experts' sum, computed on the CPU's routing
            sizes["mo"] = T * H
        uniforms: dict = {}
        readback = None
        if T == 1:  # a decode step: the stage's buffers and bind groups of the steps before
            scratch = self._decode_scratch
            if scratch is None or scratch.key != (lo, hi, host.device):
                scratch = self._decode_scratch = _Scratch(
                    (lo, hi, host.device), {n: host.storage(k) for n, k in sizes.items()},
                    uniforms={"kv": host.uniform(48), "attention": host.uniform()}, readback=host.readback(H))
            buf, binds = scratch.buffers, scratch.binds
            if len(binds) > 64 * (hi - lo):  # a step's dozen a layer repeat; more means something else changed
                binds.clear()
            if scratch.scores_cap < nh * cap:  # only attention reads it (bound with each sequence's KV): grown alone
                scratch.scores, scratch.scores_cap = host.storage(nh * cap), nh * cap
            scores = scratch.scores
            uniforms, readback = scratch.uniforms, scratch.readback
        else:
            buf, binds, scores = {n: host.storage(k) for n, k in sizes.items()}, None, host.storage(T * nh * cap)
        for name, a in (("xb", x), ("cb", cos), ("sb", ssin)):
            host.write(buf[name], a)
        xb, hb, qkv, qk, att, yb, cb, sb, fb = (buf[n] for n in ("xb", "hb", "qkv", "qk", "att", "yb", "cb", "sb", "fb"))
        eps = c.rms_norm_eps
        enc = host.encoder()
        head_rows = T * (nh + 2 * nkv)  # Q|K|V as rows of hd, for Qwen3's norm of each head
        qkn = buf.get("qkn", qkv)
        for layer, kv in zip(range(lo, hi), kvs):
            vec = self._vectors(layer)
            q, k, v, o = (_on_gpu(r) for r in self._attention_linears(layer))  # resident: all on the GPU
            host.encode_rms_norm(enc, xb, vec["attn_norm"], hb, T, H, eps, binds=binds)
            for r, col in ((q, 0), (k, nq), (v, nq + nk)):
                if r.row0 == 0:  # the first of a run stacked at load: one dispatch writes the run's columns
                    host.encode_linear(enc, hb, r.linear, qkv, T, width, col, binds=binds)
            if "qkv_bias" in vec:
                host.encode_elementwise(enc, "add", T * width, (width,), [vec["qkv_bias"], qkv], binds)
            if "qk_norm" in vec:  # each Q and K head by its weight row (V's rows normed too, then unused)
                host.encode_rms_norm(enc, qkv, vec["qk_norm"], qkn, head_rows, hd, eps, nh + 2 * nkv, binds)
            host.encode_elementwise(enc, "rope", T * heads, (hd, heads, width), [qkn, cb, sb, qk], binds)
            # the position changes every step (a uniform written once a step), the KV buffers with the sequence
            kv_binds = kv.binds if binds is not None else None
            if kv_binds is not None and len(kv_binds) > 3 * 4:  # the scratch was made again a few times
                kv_binds.clear()
            host.encode_elementwise(enc, "kv_write", T * nk, (hd, nkv, cap, start, heads, nq, width, nq + nk),
                                    [qk, kv.k, qkv, kv.v], kv_binds, uniforms.get("kv"))  # keys after RoPE, values
            host.encode(enc, "attention", struct.pack("<8I", T, nh, nkv, hd, cap, start, heads, 0),
                        [qk, kv.k, kv.v, scores, att], (nh, T, 1), kv_binds, uniforms.get("attention"))
            # O adds its sums to the residual itself, but after a bias: (y + bias) + x, as the engine
            into_x = self.fuse and "o_bias" not in vec
            host.encode_linear(enc, att, o.linear, xb if into_x else yb, T, H, binds=binds, accumulate=into_x)
            if "o_bias" in vec:
                host.encode_elementwise(enc, "add", T * H, (H,), [vec["o_bias"], yb], binds)
            if not into_x:
                host.encode_elementwise(enc, "add", T * H, (T * H,), [yb, xb], binds)
            host.encode_rms_norm(enc, xb, vec["ffn_norm"], hb, T, H, eps, binds=binds)
            if m.is_moe_layer(layer):  # routing on the CPU: the normed rows come back, the experts' sum goes up
                y = self.ffn(layer, host.submit_read(enc, hb, T * H, readback).reshape(T, H))
                enc = host.encoder()
                host.write(buf["mo"], y)
                host.encode_elementwise(enc, "add", T * H, (T * H,), [buf["mo"], xb], binds)
                continue
            host.encode_ffn(enc, hb, _gpu(self._block(layer, DENSE)), fb, xb if self.fuse else yb, T, binds,
                            accumulate=self.fuse)  # down adds its sums to the residual itself
            if not self.fuse:
                host.encode_elementwise(enc, "add", T * H, (T * H,), [yb, xb], binds)
        return host.submit_read(enc, xb, T * H, readback).reshape(T, H)

    def _kv(self, cache, layer: int, start: int, end: int) -> GpuKV:
        """Layer ``layer``'s GPU keys/values of ``cache``'s sequence, room for ``end`` positions
        (capacity doubling up to :attr:`kv_positions`; positions below ``start`` copied when grown).
        Raises KernelError when they are on a lost device, GpuKVFull when ``end`` passes
        :attr:`kv_positions` (the KV cache the plan counted on this GPU), or passes what the
        other sequences' buffers of the layer leave of it."""
        host = self.gpu.host
        kv = cache.device_kv.get(layer)
        if kv is not None and kv.device is not host.device:
            raise KernelError("this sequence's keys and values were on a device that was lost")
        if kv is not None and kv.cap >= end:
            return kv
        if end > self.kv_positions:
            raise GpuKVFull(f"layer {layer}: {end} positions of keys/values on the GPU, but the plan counted "
                            f"{self.kv_positions} (--context) for this peer's GPU memory; give the swarm a "
                            "larger --context (and this peer --gpu-memory for it), or send shorter sequences")
        others = [c.device_kv[layer] for c in list(self._kv_holders)
                  if c is not cache and layer in c.device_kv and c.device_kv[layer].device is host.device]
        room = self.kv_positions - sum(o.cap for o in others)  # the plan counted all sequences' together
        if end > room:
            raise GpuKVFull(f"layer {layer}: {end} positions of keys/values on the GPU beside the "
                            f"{self.kv_positions - room} that {len(others)} other sequence(s) hold there, but the plan "
                            f"counted {self.kv_positions} in all (--context) for this peer's GPU memory; give the swarm "
                            "a larger --context (and this peer --gpu-memory for it), or run fewer sequences at once")
        cap = max(16, kv.cap if kv is not None else 16)
        while cap < end:
            cap *= 2
        cap = min(cap, room)  # doubling stops at what the plan counted
        nkv, hd = self.model.config.n_kv_heads, self.model.config.head_dim
        new = GpuKV(host.storage(nkv * cap * hd), host.storage(nkv * cap * hd), cap, host.device)
        if kv is not None and start > 0:  # each head's positions 0 .. start-1 move to the wider rows
            enc = host.encoder()
            for g in range(nkv):
                for a, b in ((kv.k, new.k), (kv.v, new.v)):
                    host.encode_copy(enc, a, g * kv.cap * hd, b, g * cap * hd, start * hd)
            host.submit_read(enc)
        cache.device_kv[layer] = new
        self._kv_holders.add(cache)
        return new

    def _vectors(self, layer: int) -> dict[str, object]:
        """Layer ``layer``'s float32 vectors in GPU buffers: ``attn_norm``, ``ffn_norm`` [H], and
        where the layer has them ``qkv_bias`` [(nh + 2 nkv) hd], ``o_bias`` [H], ``qk_norm``
        [nh + 2 nkv, hd] (each Q and K head's weight row, ones for V's)."""
        held = self._vector_buffers.get(layer)
        host = self.gpu.host
        if held is None or held["device"] is not host.device:
            w, c = self.model.attention_weights(layer), self.model.config
            assert isinstance(w, AttentionWeights)  # a resident stage's layers are plain attention
            vectors = {"attn_norm": w.attn_norm, "ffn_norm": w.ffn_norm, "qkv_bias": w.qkv_bias, "o_bias": w.o_bias}
            if c.qk_norm == "head":
                vectors["qk_norm"] = np.concatenate([w.q_norm, np.ones((c.n_kv_heads, c.head_dim), np.float32)])
            held = {k: host.storage(a.size, a) for k, a in vectors.items() if a is not None}
            held["device"] = host.device
            self._vector_buffers[layer] = held
        return held

    # ---- ProductDevice: the attention projections ----------------------------------------------

    def matmul_many(self, products: Sequence[tuple[QMatrix, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]:
        """``x @ W.T`` for each (W, x float32 [T, cols], out float32 [T, rows] or None), written
        into ``out`` where given: on the GPU in one submission (matrices stacked at upload, such as
        a layer's Q|K|V, in one product over the same x, each taking its columns), but for
        matrices the kernels do not read, which run through the engine's
        :func:`~swarm.compute.quant.matmul_many`."""
        held = [self._linear_of(w) for w, _, _ in products]
        results: list[np.ndarray | None] = [None] * len(products)
        cpu = [i for i, g in enumerate(held) if g is None]
        gpu = [i for i, g in enumerate(held) if g is not None]
        for i, y in zip(cpu, matmul_many([products[i] for i in cpu]) if cpu else ()):
            results[i] = y
        xs: dict[int, np.ndarray] = {}  # one C-order copy of an x several products share (Q, K, V)
        runs: dict[tuple[int, int], int] = {}  # (stacked matrix, x) → its product's place in operands
        operands: list[tuple[GpuLinear, np.ndarray]] = []
        at = []
        for i in gpu:
            linear = _on_gpu(held[i]).linear
            x = xs.setdefault(id(products[i][1]), np.ascontiguousarray(products[i][1], np.float32))
            at.append(runs.setdefault((id(linear), id(x)), len(operands)))
            if at[-1] == len(operands):
                operands.append((linear, x))
        ys = self.gpu.host.matmul_many(operands) if operands else []
        for i, j in zip(gpu, at):
            r, out = _on_gpu(held[i]), products[i][2]
            y = ys[j] if r.rows == r.linear.rows else np.ascontiguousarray(ys[j][:, r.row0:r.row0 + r.rows])
            if out is not None:
                out[...] = y
            results[i] = y if out is None else out
        return results  # type: ignore[return-value]

    def _linear_of(self, w: QMatrix) -> _Rows | None:
        """Attention matrix ``w`` on the GPU (uploaded alone if it is not yet), or None: the CPU's."""
        if w not in self._linear:
            op = kernel_operand(w, self.gpu.host.formats, "attention", repack=False)
            self._linear[w] = None if op is None else _Rows(self.gpu.host.upload_linear(*op), 0, len(op[0]))
        return self._linear[w]

    def _attention_linears(self, layer: int) -> tuple[_Rows | None, ...]:
        """Layer ``layer``'s Q, K, V, O on the GPU (:meth:`_linear_of`; none for MLA or linear
        attention). At their first upload (with :attr:`fuse`), adjacent ones of Q, K, V in one
        format and width go up as one matrix, their rows stacked in the file's encoding (Q4_K_M:
        Q|K, then V in Q6_K), so one product computes them: each row by the same kernel as alone,
        the same bits, the same bytes held."""
        mats = _projections(self.model.attention_weights(layer))
        if mats and self.fuse and not any(q in self._linear for q in mats[:3]):
            ops = [kernel_operand(q, self.gpu.host.formats, "attention", repack=False) for q in mats[:3]]
            for run in _runs([None if op is None else (op[1], op[0].dtype.str, op[0].shape[1]) for op in ops]):
                read = [(mats[i], op) for i in run if (op := ops[i]) is not None]
                if not read:
                    continue  # the engine's: _linear_of records it
                blocks = [a for _, (a, _) in read]
                linear = self.gpu.host.upload_linear(np.concatenate(blocks) if len(blocks) > 1 else blocks[0],
                                                     read[0][1][1])
                row0 = 0
                for q, (a, _) in read:
                    self._linear[q] = _Rows(linear, row0, len(a))
                    row0 += len(a)
        return tuple(self._linear_of(q) for q in mats)

    # ---- FFNBackend: the layer's MLP or MoE ----------------------------------------------------

    def ffn(self, layer: int, x: np.ndarray, segments: Sequence[int] | None = None) -> np.ndarray:
        """x [T, H] f32 (post-attention-normed) → [T, H] f32: :class:`~swarm.compute.ffn.LocalFFN`'s
        composition (route, each selected expert over its rows, combine in expert order, the
        shared expert last) with every SwiGLU block on the GPU."""
        m = self.model
        if not m.is_moe_layer(layer):
            return self.gpu.run(self._block(layer, DENSE), x)
        T, H = x.shape
        seg = segment_ids(segments, T)
        routing = route(m.router_logits(layer, x, seg), **m.routing_config(layer).kwargs())
        selected = expert_rows(routing)
        blocks, xs = [self._block(layer, e) for e in selected], [x[rows] for rows in selected.values()]
        if m.has_shared_expert(layer):
            blocks, xs = [*blocks, self._block(layer, SHARED)], [*xs, x]
        ys = self.gpu.run_many(blocks, xs)  # every block of the layer in one submission
        outputs = dict(zip(selected, ys))
        shared = None
        if m.has_shared_expert(layer):
            shared = ys[-1]
            gate = m.shared_expert_weights(layer)[1]
            if gate is not None:  # Qwen2-MoE's sigmoid gate, as swarm.compute.ffn.shared_expert
                shared = sigmoid(as_qmatrix(gate).matmul(np.ascontiguousarray(x))) * shared
        return combine(T, H, routing, outputs, shared=shared)

    def _block(self, layer: int, e: int) -> GpuWeights:
        held = self._blocks.get((layer, e))
        if held is None:
            m = self.model
            w = (m.dense_weights(layer) if e == DENSE else m.shared_expert_weights(layer)[0] if e == SHARED
                 else m.expert_weights(layer, e))
            held = self._blocks[(layer, e)] = self.gpu.load(w, repack=False)
        return held


@dataclass(frozen=True)
class _Rows:
    """An attention matrix on the GPU: rows ``row0 .. row0 + rows`` of ``linear`` (a
    ``web_peer.wgpu_host.GpuLinear``, which may hold a layer's Q|K|V stacked)."""

    linear: GpuLinear
    row0: int
    rows: int


def _runs(keys: Sequence[object]) -> list[list[int]]:
    """Indices of ``keys`` in runs of adjacent equal keys, a None key alone: [a, a, b, None, None]
    → [[0, 1], [2], [3], [4]]."""
    runs = itertools.groupby(range(len(keys)), key=lambda i: (0, keys[i]) if keys[i] is not None else (1, i))
    return [list(run) for _, run in runs]  # (1, i): each None a group of its own


class GpuKVFull(DeviceKVFull):
    """The keys/values on the GPU — this sequence's, or all sequences' together — would pass the
    positions the plan counted (:attr:`GpuStage.kv_positions`): the stage refuses the request
    (``bad_request``: the coordinator runs those layers itself) unless dropping finished
    sequences' keys/values makes room, neither crashing nor spilling to host memory."""


@dataclass
class GpuKV:
    """One layer's keys and values of one sequence on the GPU: ``k``, ``v`` float32 buffers
    [nkv, cap, hd] (positions 0 .. the cache's length - 1 filled), on ``device``; ``binds``: the
    decode steps' bind groups over them, which go with them."""

    k: object
    v: object
    cap: int
    device: object
    binds: dict = field(default_factory=dict)  # decode steps' bind groups over k and v (WgpuFfn._bind's cache)


def _projections(w: object) -> tuple[QMatrix, ...]:
    """Q, K, V, O of standard attention weights; none for MLA or linear attention (the CPU's)."""
    return (w.q, w.k, w.v, w.o) if isinstance(w, AttentionWeights) else ()


def _cpu(w: GpuWeights) -> MLPWeights:
    """The engine's weights of a block that stays on the CPU."""
    assert w.cpu is not None
    return w.cpu


def _gpu(w: GpuWeights) -> GpuFfnWeights:
    """The GPU buffers of a block the kernels read (a resident stage's dense blocks all are)."""
    assert w.gpu is not None
    return w.gpu


def _on_gpu(rows: _Rows | None) -> _Rows:
    """A matrix held on the GPU (a resident stage's and the GPU products' all are)."""
    assert rows is not None
    return rows
