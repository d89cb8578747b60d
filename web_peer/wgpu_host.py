"""Run the browser peer's WGSL kernels natively through wgpu-py (Vulkan: Mesa lavapipe, or a GPU).

This host mirrors the page's gpu.js / ffn.js step for step — same WGSL files, same weight parts,
same dispatch grid — so the kernels are tested and benchmarked outside the browser, and a Python
peer computes with them on its own GPU (`join --gpu`, swarm/peer/worker/gpu.py). `wgpu` is the
optional dependency `colibri-swarm[gpu]`, imported only here. Every call blocks until the GPU
is done: a peer makes them off its event loop (the worker's compute thread).

    gpu = WgpuFfn(max_binding=64 << 20)          # cap bindings below the adapter's limit
    w = gpu.upload(w_gate, w_up, w_down, "q8")   # [F, H], [F, H], [H, F] float32 → GPU parts
    y = gpu.ffn(x, w)                            # x [T, H] float32 → y [T, H] float32
    w = gpu.upload(raw_g, raw_u, raw_d, "q4_1")  # GGUF Q4_1 blocks as in the file (uint8 rows)
    m = gpu.upload_linear(raw_q, "q8_0")         # one matrix W [N, K] for y = x @ W.T
    q, k = gpu.matmul_many([(m, x), (m2, x)])    # x [T, K] float32 → [T, N] float32 each, one submit

Errors: KernelError for bad shapes/formats, limits that cannot be met, and any GPU error (the
device is then dropped and a fresh one made on the next call).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from swarm.errors import KernelError

from . import kernels as K

GPU_WORKGROUP_SIZE = 64
CPU_WORKGROUP_SIZE = 8  # lavapipe: one AVX2 SIMD row; 2-5x faster than 64 (bench/web_peer.py)
GPU_LANES = 32  # block kernels: threads per weight row on GPUs (a subgroup on most; WG / 32 rows a workgroup)
_PARAMS = struct.Struct("<6I")  # t_rows, k4, n_rows, row0, n_out, tile_x (the WGSL Params)
MAX_WORKGROUPS = K.MAX_WORKGROUPS_PER_DIM


def norm_params(rows: int, d: int, eps: float, w_rows: int = 1) -> bytes:
    """rmsnorm.wgsl's parameters: ``rows`` rows of ``d``, a weight row per row modulo ``w_rows``."""
    return struct.pack("<IIfIIIII", rows, d, eps, _grid(rows)[0], w_rows, 0, 0, 0)


def subgroup_min_size(adapter) -> int:
    """The adapter's smallest subgroup (wgpu-native's adapter info; 0 when it does not say)."""
    info = adapter.info
    for key in ("subgroup_min_size", "stackgroup_min_size"):  # the latter: wgpu-py 0.32's spelling
        if info.get(key):
            return int(info[key])
    return 0


def _grid(n: int) -> tuple[int, int]:
    """Workgroups (x, y) covering ``n`` (x ≤ 65535, the WebGPU default limit per dimension)."""
    x = max(1, min(n, MAX_WORKGROUPS))
    return x, -(-n // x) if n else 1


@dataclass
class GpuMatrix:
    """A PackedMatrix resident on the GPU: one weight buffer and one scale buffer per part."""

    packed: K.PackedMatrix
    buffers: list = field(default_factory=list)
    scales: list = field(default_factory=list)


@dataclass
class GpuFfnWeights:
    """One SwiGLU block on the GPU: H (model width) and F (intermediate rows) before padding;
    ``fmt`` of W_gate/W_up, ``down_fmt`` of W_down."""

    fmt: str
    hidden: int
    inter: int
    gate: GpuMatrix
    up: GpuMatrix
    down: GpuMatrix
    device: object = None  # the device holding the buffers; a fresh device needs a new upload
    down_fmt: str = ""
    # decode requests' bind groups over these weights and WgpuFfn's kept slot buffers: they go
    # with the weights (a replan drops the weights, and with them every bind group holding them)
    binds: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.down_fmt = self.down_fmt or self.fmt

    @property
    def nbytes(self) -> int:
        """Weight bytes held (both planes of every matrix)."""
        return sum(m.packed.nbytes for m in (self.gate, self.up, self.down))


@dataclass
class GpuLinear:
    """One weight matrix W [rows, cols] on the GPU for y = x @ W.T, through the down kernel (its
    product is exactly that); ``fmt`` as :class:`GpuFfnWeights`'."""

    fmt: str
    rows: int
    cols: int
    matrix: GpuMatrix
    device: object = None  # the device holding the buffers; a fresh device needs a new upload

    @property
    def nbytes(self) -> int:
        """Weight bytes held (both planes)."""
        return self.matrix.packed.nbytes


class Encoder:
    """A command encoder whose dispatches share one compute pass, until a copy or the submit ends
    it. WebGPU runs a pass's dispatches in order, each seeing the writes of those before (each is
    its own usage scope), so this changes no result; a pass per dispatch cost the host and the
    driver time of their own per pass (bench/web_peer.py --dispatch-cost)."""

    def __init__(self, enc):
        self.enc = enc
        self._pass = None

    def compute_pass(self):
        """The open compute pass (begun if there is none)."""
        if self._pass is None:
            self._pass = self.enc.begin_compute_pass()
        return self._pass

    def dispatch(self, pipe, bind, grid: tuple[int, int, int]) -> None:
        """One dispatch of ``pipe`` with bind group 0 ``bind`` over workgroups ``grid``."""
        cpass = self.compute_pass()
        cpass.set_pipeline(pipe)
        cpass.set_bind_group(0, bind)
        cpass.dispatch_workgroups(*grid)

    def end_pass(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def copy(self, src, src_at: int, dst, dst_at: int, nbytes: int) -> None:
        """copy_buffer_to_buffer (byte offsets), after the dispatches encoded so far."""
        self.end_pass()
        self.enc.copy_buffer_to_buffer(src, src_at, dst, dst_at, nbytes)

    def finish(self):
        """The command buffer of everything encoded."""
        self.end_pass()
        return self.enc.finish()


class Uniform:
    """A uniform buffer of parameters that change between submissions (a decode step's position)
    while the bind groups over it stay (:meth:`WgpuFfn._bind`): ``buffer`` is written only when
    the parameters differ from the last written (``params``)."""

    def __init__(self, buffer) -> None:
        self.buffer = buffer
        self.params: bytes | None = None
        self._encoder: Encoder | None = None  # the last encoder that bound it

    def set(self, queue, params: bytes, enc: Encoder | None) -> None:
        """Write ``params`` for the dispatches of ``enc``. A queue write lands before the next
        submission, so every dispatch of one command buffer reads the last one: KernelError if
        ``enc`` already bound other parameters."""
        if params != self.params:
            if len(params) > self.buffer.size:
                raise KernelError(f"{len(params)} bytes of parameters for a uniform buffer of {self.buffer.size}")
            if enc is not None and enc is self._encoder:
                raise KernelError("a uniform buffer's parameters changed within one submission")
            queue.write_buffer(self.buffer, 0, params + b"\0" * (-len(params) % 4))
            self.params = params
        self._encoder = enc


class _FfnScratch:
    """:meth:`WgpuFfn._ffn_blocks`' kept buffers on the host's current device (made anew with it): per slot (a block's place in a
    request) its rows, intermediate and output (float32 storage, grown to the largest asked),
    while a slot stays within :data:`KEPT_SLOT_BYTES` and all within :data:`KEPT_BYTES`, and one
    mappable read-back buffer for all slots' outputs (up to :data:`KEPT_READBACK_BYTES`). Other
    asks (a prompt's rows, more blocks than a decode step has) get buffers of their own, freed
    after the request: what stays is a decode step's size. The bind groups over a kept slot and
    a block's weights are kept with the weights (``GpuFfnWeights.binds``), so they go with them."""

    KEPT_SLOT_BYTES = 1 << 20
    KEPT_BYTES = 16 << 20
    KEPT_READBACK_BYTES = 4 << 20
    MAX_WEIGHT_BINDS = 64  # bind groups kept per block (its slots, parts and kernels), then made anew

    def __init__(self) -> None:
        self.slots: list[tuple[int, int, tuple]] = []  # (elements of a row buffer, of an intermediate, buffers)
        self.kept = 0  # bytes of the slots' buffers
        self.readback, self.readback_n = None, 0

    def slot(self, host: WgpuFfn, i: int, n: int, nf: int, w: GpuFfnWeights) -> tuple[tuple, dict | None]:
        """Slot ``i``'s (rows, intermediate, output) buffers, holding ≥ ``n``, ``nf``, ``n``
        elements, and the bind-group cache to use with them and block ``w`` (None: buffers for
        this request alone)."""
        while len(self.slots) <= i:
            self.slots.append((0, 0, ()))
        cap, cap_f, bufs = self.slots[i]
        if not bufs or n > cap or nf > cap_f:
            grown = max(n, cap), max(nf, cap_f)
            size = 4 * (2 * grown[0] + grown[1])
            if size > self.KEPT_SLOT_BYTES or self.kept - 4 * (2 * cap + cap_f) + size > self.KEPT_BYTES:
                return (host.storage(n), host.storage(nf), host.storage(n)), None
            self.kept += size - 4 * (2 * cap + cap_f)
            (cap, cap_f), bufs = grown, (host.storage(grown[0]), host.storage(grown[1]), host.storage(grown[0]))
            self.slots[i] = (cap, cap_f, bufs)  # bind groups over the old ones stay with their weights, unused
        if len(w.binds) > self.MAX_WEIGHT_BINDS:
            w.binds.clear()
        return bufs, w.binds

    def readback_of(self, host: WgpuFfn, n: int):
        """A read-back buffer holding ≥ ``n`` float32 elements: the kept one, or one for this request."""
        if 4 * n > self.KEPT_READBACK_BYTES:
            return host.readback(n)
        if n > self.readback_n or self.readback is None:
            self.readback, self.readback_n = host.readback(n), n
        return self.readback


class WgpuFfn:
    """A wgpu device with the swiglu and down pipelines for every weight format it supports.

    max_binding: bytes per storage binding to stay under (defaults to the adapter's
    maxStorageBufferBindingSize; pass a phone's 128 MiB or less to force splitting).
    workgroup_size: the WG override (a power of two ≤ maxComputeInvocationsPerWorkgroup);
    default 64 on GPUs, 8 on CPU adapters such as lavapipe (as the page's gpu.js).
    lanes: the block kernels' threads per weight row (LANES of row_slices.wgsl, a power of two
    ≤ workgroup_size); default 32 on GPUs, workgroup_size (one row a workgroup) on CPU adapters.
    subgroups: reduce a row through subgroup shuffles (sum_subgroup.wgsl); default when the
    adapter has the feature and its smallest subgroup holds `lanes` threads. KernelError when
    forced on an adapter without it.
    """

    def __init__(self, max_binding: int | None = None, workgroup_size: int | None = None,
                 power_preference: str = "high-performance", lanes: int | None = None,
                 subgroups: bool | None = None):
        import wgpu  # the [gpu] extra

        self._wgpu = wgpu
        self.adapter = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
        if self.adapter is None:
            raise KernelError("no WebGPU adapter: install a Vulkan driver (mesa-vulkan-drivers)")
        limits = self.adapter.limits
        self.adapter_binding = limits["max-storage-buffer-binding-size"]
        cpu = self.adapter.info["adapter_type"] == "CPU"
        if workgroup_size is None:  # as gpu.js defaultWorkgroupSize: barriers are costly on CPU adapters
            workgroup_size = CPU_WORKGROUP_SIZE if cpu else GPU_WORKGROUP_SIZE
        self.max_binding = min(max_binding or self.adapter_binding, self.adapter_binding)
        if workgroup_size & (workgroup_size - 1) or not (
                0 < workgroup_size <= limits["max-compute-invocations-per-workgroup"]):
            raise KernelError(f"workgroup size {workgroup_size} must be a power of two ≤ "
                              f"{limits['max-compute-invocations-per-workgroup']}")
        self.workgroup_size = workgroup_size
        self.lanes = lanes or (workgroup_size if cpu else min(GPU_LANES, workgroup_size))
        if self.lanes & (self.lanes - 1) or self.lanes > workgroup_size:
            raise KernelError(f"lanes {self.lanes} must be a power of two ≤ the workgroup size {workgroup_size}")
        self.subgroup_min_size = subgroup_min_size(self.adapter)
        has_subgroups = "subgroup" in self.adapter.features
        if subgroups is None:
            subgroups = has_subgroups and self.lanes <= self.subgroup_min_size
        elif subgroups and not has_subgroups:
            raise KernelError("this adapter lacks the feature 'subgroup'; leave subgroups unset")
        self.subgroups = subgroups
        self.formats = K.FORMATS  # f16 too: decoded from u32 words, no shader-f16 needed
        self.largest_binding = 0  # the largest buffer this host ever bound, for limit tests
        self.device = None
        self._pipelines: dict = {}
        self._ffn_scratch = _FfnScratch()  # ffn_many's kept buffers, on the current device

    # ---- device -----------------------------------------------------------------------------

    def _device(self):
        if self.device is None:
            feats = ["subgroup"] * self.subgroups
            self.device = self.adapter.request_device_sync(
                required_features=feats,
                required_limits={"max-storage-buffer-binding-size": self.adapter_binding})
            self._pipelines = {}
        return self.device

    def drop_device(self) -> None:
        """Forget the device (after a GPU error): the next call makes a fresh one and re-uploads."""
        dev, self.device, self._pipelines = self.device, None, {}
        self._ffn_scratch = _FfnScratch()  # its buffers were on that device
        if dev is not None:
            dev.destroy()  # also ends wgpu's poll thread of that device

    def close(self) -> None:
        """Release the device (and its poll thread); a later call makes a fresh one."""
        self.drop_device()

    def __enter__(self) -> WgpuFfn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pipeline(self, kernel: str, fmt: str | None, tb: int = K.TB, accumulate: bool = False):
        """The compute pipeline of ``kernel`` for weight format ``fmt`` (None: a layer kernel,
        :data:`web_peer.kernels.LAYER_KERNELS`), ``tb`` activation rows a workgroup; with
        ``accumulate`` (the down kernels) adding its sums to what the output holds."""
        key = (kernel, fmt, tb, accumulate)
        if key not in self._pipelines:
            if fmt is not None and fmt not in self.formats:
                raise KernelError(f"unknown weight format {fmt}; expected one of {', '.join(self.formats)}")
            dev = self._device()
            code = K.wgsl_source(kernel, fmt, self.subgroups, tb) if fmt is not None else K.layer_source(kernel)
            module = dev.create_shader_module(code=code)
            constants = {"WG": self.workgroup_size}
            if fmt in K.BLOCK_FORMATS:
                constants["LANES"] = self.lanes
            if accumulate:
                constants["ACCUMULATE"] = True
            self._pipelines[key] = dev.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": "main", "constants": constants})
        return self._pipelines[key]

    def _buffer(self, data: bytes, usage):
        size = max(16, -(-len(data) // 4) * 4)
        self.largest_binding = max(self.largest_binding, size)
        buf = self._device().create_buffer(size=size, usage=usage | self._wgpu.BufferUsage.COPY_DST)
        if data:
            self.device.queue.write_buffer(buf, 0, data + b"\0" * (-len(data) % 4))
        return buf

    # ---- weights ----------------------------------------------------------------------------

    def _upload_matrix(self, m: K.PackedMatrix) -> GpuMatrix:
        g = GpuMatrix(m)
        storage = self._wgpu.BufferUsage.STORAGE
        for i in range(len(m.parts)):
            g.buffers.append(self._buffer(m.part_bytes(i), storage))
            g.scales.append(self._buffer(m.part_scale(i), storage))
        return g

    def upload(self, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, fmt: str,
               down_fmt: str | None = None) -> GpuFfnWeights:
        """Pack and upload one SwiGLU block: w_gate, w_up [F, H], w_down [H, F].

        Float formats take float32. Block formats (q4_0, q4_1, q8_0) take the file's blocks,
        uint8 [rows, K / 32 * block bytes], or float32 (quantized here by gguf's quantizer).
        ``down_fmt``: W_down's format when it differs from W_gate/W_up's.
        """
        down_fmt = down_fmt or fmt
        (f, h), up_shape, d_shape = (K.matrix_shape(w, name, fm) for w, name, fm in (
            (w_gate, "w_gate", fmt), (w_up, "w_up", fmt), (w_down, "w_down", down_fmt)))
        if up_shape != (f, h) or d_shape != (h, f):
            raise KernelError(f"SwiGLU weights disagree: gate {(f, h)}, up {up_shape}, down {d_shape}")
        self._pipeline("swiglu", fmt)
        self._pipeline("down", down_fmt)
        fp = K.pad4(f)
        try:
            return GpuFfnWeights(
                fmt, h, f,
                self._upload_matrix(K.pack_matrix(w_gate, fmt, self.max_binding, rows=fp)),
                self._upload_matrix(K.pack_matrix(w_up, fmt, self.max_binding, rows=fp)),
                self._upload_matrix(K.pack_matrix(w_down, down_fmt, self.max_binding)),
                self.device, down_fmt)
        except self._wgpu.GPUError as e:
            self.drop_device()
            raise KernelError(f"GPU error while uploading weights: {e}") from e

    def upload_linear(self, w: np.ndarray, fmt: str) -> GpuLinear:
        """Pack and upload one matrix W [N, K] for :meth:`matmul_many`: float32 for the float
        formats, the file's blocks (uint8 [N, K / block * block bytes]) or float32 for the block
        formats, as :meth:`upload`. Raises KernelError on a bad shape or format, or a GPU error."""
        rows, cols = K.matrix_shape(w, "w", fmt)
        self._pipeline("down", fmt)
        with self._guarded("uploading weights"):
            return GpuLinear(fmt, rows, cols, self._upload_matrix(K.pack_matrix(w, fmt, self.max_binding)), self.device)

    def matmul_many(self, products: Sequence[tuple[GpuLinear, np.ndarray]]) -> list[np.ndarray]:
        """``[x @ W.T for W, x in products]``: each x float32 [T, W.cols] → float32 [T, W.rows],
        all in one submission (an x shared by several products is uploaded once). Raises
        KernelError for weights of a lost device, a shape mismatch, non-finite input or output,
        or a GPU error (the device is then reset)."""
        for w, x in products:
            self._check(w, x, w.cols)
        if not products:
            return []
        widest = max(max(w.matrix.packed.cols, w.rows) for w, _ in products) * 4  # bytes of an activation row
        block = max(1, self.max_binding // widest)
        longest = max(x.shape[0] for _, x in products)
        parts = [self._linear_block([(w, x[t:t + block]) for w, x in products]) for t in range(0, longest, block)]
        return [np.concatenate([p[i] for p in parts]) if parts else np.zeros((0, w.rows), np.float32)
                for i, (w, _) in enumerate(products)]

    def _linear_block(self, products: list[tuple[GpuLinear, np.ndarray]]) -> list[np.ndarray]:
        """:meth:`matmul_many` on rows that fit one binding, in one submission and one read-back."""
        wg = self._wgpu
        with self._guarded():
            dev = self._device()
            inputs: dict[int, object] = {}  # id(x) → its buffer: q, k and v share their rows
            outs = []
            enc = self.encoder()
            for w, x in products:
                t_rows, kp = x.shape[0], w.matrix.packed.cols
                if t_rows == 0:
                    outs.append(None)
                    continue
                key = (id(x), kp)
                if key not in inputs:
                    inputs[key] = self._buffer(K.pad_matrix(x, t_rows, kp).tobytes(), wg.BufferUsage.STORAGE)
                yb = dev.create_buffer(size=max(16, t_rows * w.rows * 4),
                                       usage=wg.BufferUsage.STORAGE | wg.BufferUsage.COPY_SRC)
                self.largest_binding = max(self.largest_binding, t_rows * w.rows * 4)
                self._dispatch(enc, "down", w.fmt, t_rows, kp // 4, w.rows, inputs[key], [w.matrix], yb)
                outs.append(yb)
            got = self._submit_reading(enc, [(yb, x.shape[0] * w.rows) for (w, x), yb in zip(products, outs)])
        return [y.reshape(x.shape[0], w.rows) for (w, x), y in zip(products, got)]

    # ---- a layer's other kernels ----------------------------------------------------------------

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """rmsnorm.wgsl: x [T, D] float32, w [D] or [Rw, D] float32 → [T, D] float32 (twin:
        kernels.rms_norm)."""
        K.rms_norm(x, w, eps)  # the twin's shape checks
        T, D = x.shape
        gx, gy = _grid(T)
        (y,) = self._run("rmsnorm", norm_params(T, D, eps, w.size // D), [x, w], [T * D], (gx, gy, 1))
        return y.reshape(T, D)

    def rope(self, x: np.ndarray, cos: np.ndarray, ssin: np.ndarray) -> np.ndarray:
        """rope.wgsl: x, cos, ssin [T, n, hd] float32 → [T, n, hd] float32 (twin: kernels.rope)."""
        K.rope(x[:0], cos[:0], ssin[:0])
        gx, gy = _grid(-(-x.size // self.workgroup_size))
        row = x.shape[1] * x.shape[2]
        (y,) = self._run("rope", struct.pack("<8I", x.size, gx * self.workgroup_size, x.shape[2], row, row, 0, 0, 0),
                         [x, cos, ssin], [x.size], (gx, gy, 1))
        return y.reshape(x.shape)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
        """attention.wgsl: q [T, nh, hd] (scaled), k, v [nkv, C, hd] float32 → [T, nh * hd]
        float32 (twin: kernels.attention). Raises KernelError as the twin, or for T > 65535."""
        K.check_attention(q, k, v, start)
        T, nh, hd = q.shape
        nkv, C, _ = k.shape
        if T > MAX_WORKGROUPS:
            raise KernelError(f"attention takes at most {MAX_WORKGROUPS} rows a call, got {T}")
        params = struct.pack("<8I", T, nh, nkv, hd, C, start, nh * hd, 0)
        _, out = self._run("attention", params, [q, k, v], [T * nh * C, T * nh * hd], (nh, T, 1))
        return out.reshape(T, nh * hd)

    # ---- a stage's layers resident on the GPU: buffers and dispatches into one encoder ---------

    def storage(self, n: int, data: np.ndarray | None = None):
        """A float32 storage buffer of ``n`` elements (≥ 1), holding ``data`` (float32) if given;
        it can be copied from and to (read back, grown)."""
        usage = self._wgpu.BufferUsage.STORAGE | self._wgpu.BufferUsage.COPY_SRC
        if data is not None:
            return self._buffer(np.ascontiguousarray(data, np.float32).tobytes(), usage)
        self.largest_binding = max(self.largest_binding, 4 * n)
        return self._device().create_buffer(size=max(16, 4 * n), usage=usage | self._wgpu.BufferUsage.COPY_DST)

    def encoder(self) -> Encoder:
        """An :class:`Encoder` on the current device (made if there is none)."""
        return Encoder(self._device().create_command_encoder())

    def encode_copy(self, enc: Encoder, src, src_at: int, dst, dst_at: int, n: int) -> None:
        """Copy ``n`` float32 elements of buffer ``src`` from element ``src_at`` to ``dst`` at ``dst_at``."""
        enc.copy(src, 4 * src_at, dst, 4 * dst_at, 4 * n)

    def write(self, buf, data: np.ndarray) -> None:
        """Write float32 ``data`` at the start of storage buffer ``buf`` (:meth:`storage` without data)."""
        self.device.queue.write_buffer(buf, 0, np.ascontiguousarray(data, np.float32).tobytes())

    def uniform(self, nbytes: int = 32) -> Uniform:
        """A :class:`Uniform` of ``nbytes`` (a multiple of 4) on the current device."""
        return Uniform(self._device().create_buffer(
            size=max(16, nbytes), usage=self._wgpu.BufferUsage.UNIFORM | self._wgpu.BufferUsage.COPY_DST))

    def _bind(self, pipe, params: bytes, buffers: list, binds: dict | None = None,
              uniform: Uniform | None = None, enc: Encoder | None = None):
        """The bind group of ``pipe``: a uniform buffer holding ``params``, then ``buffers`` in
        binding order. With ``binds`` (a cache the caller keeps no longer than its buffers: a
        stage's decode scratch), one made before for the same pipeline, parameters and buffers is
        taken from it: making a bind group and its uniform buffer cost the host more than the
        dispatch (bench/results/web_peer_blocks.md). An entry holds its buffers, so their ids
        cannot pass to other buffers while it lives. With ``uniform`` (and ``binds``), the
        parameters go into that buffer (written when they change) and the bind group is kept
        whatever they are: parameters that change every step (a position) cost a write, not a
        bind group. Raises KernelError if they would change within encoder ``enc``, whose
        dispatches all read the buffer's last contents."""
        if uniform is not None and binds is not None:
            uniform.set(self.device.queue, params, enc)
            key: tuple | None = (id(pipe), uniform, *map(id, buffers))
        else:
            key = (id(pipe), params, *map(id, buffers)) if binds is not None else None
        if key is not None and key in binds:
            return binds[key][0]
        head = uniform.buffer if key is not None and uniform is not None else self._buffer(params, self._wgpu.BufferUsage.UNIFORM)
        bind = self.device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": b, "resource": {"buffer": buf}} for b, buf in enumerate([head, *buffers])])
        if key is not None:
            binds[key] = (bind, pipe, buffers)
        return bind

    def encode(self, enc: Encoder, kernel: str, params: bytes, buffers: list, grid: tuple[int, int, int],
               binds: dict | None = None, uniform: Uniform | None = None) -> None:
        """One dispatch of layer kernel ``kernel`` (bindings: params, then ``buffers`` in order);
        ``binds``, ``uniform``: :meth:`_bind`'s cache and parameter buffer."""
        pipe = self._pipeline(kernel, None)
        enc.dispatch(pipe, self._bind(pipe, params, buffers, binds, uniform, enc), grid)

    def encode_elementwise(self, enc, kernel: str, n: int, fields: tuple[int, ...], buffers: list,
                           binds: dict | None = None, uniform: Uniform | None = None) -> None:
        """:meth:`encode` of a kernel of one invocation per element over ``n`` elements (rope,
        kv_write, add): its params are (n, tile_x, ``fields`` …), zero-padded to a multiple of 4
        words."""
        gx, gy = _grid(-(-n // self.workgroup_size))
        words = (n, gx * self.workgroup_size, *fields)
        size = -(-len(words) // 4) * 4
        self.encode(enc, kernel, struct.pack(f"<{size}I", *words, *(0,) * (size - len(words))), buffers, (gx, gy, 1),
                    binds, uniform)

    def encode_rms_norm(self, enc, x, w, y, rows: int, d: int, eps: float, w_rows: int = 1,
                        binds: dict | None = None) -> None:
        """rmsnorm.wgsl over ``rows`` rows of ``d`` in buffer x into y, weight row ``t % w_rows`` of w."""
        self.encode(enc, "rmsnorm", norm_params(rows, d, eps, w_rows), [x, w, y], (*_grid(rows), 1), binds)

    def encode_linear(self, enc, x, w: GpuLinear, y, t_rows: int, n_out: int, col0: int = 0,
                      binds: dict | None = None, accumulate: bool = False) -> None:
        """y[t, col0 : col0 + W.rows] = x[t] @ W.T for rows t of x [T, W's padded cols] (buffers);
        with ``accumulate``, += (:meth:`_dispatch`)."""
        self._check(w)
        self._dispatch(enc, "down", w.fmt, t_rows, w.matrix.packed.cols // 4, n_out, x, [w.matrix], y, col0, binds,
                       accumulate)

    def encode_ffn(self, enc, x, w: GpuFfnWeights, h, y, t_rows: int, binds: dict | None = None,
                   accumulate: bool = False) -> None:
        """y = down(swiglu(x)) for x [T, pad4(H)] into y [T, pad4(H)], through h [T, pad4(F)]
        (buffers); with ``accumulate``, y += (a residual stream updated in place: :meth:`_dispatch`)."""
        self._check(w)
        hp, fp = K.pad4(w.hidden), K.pad4(w.inter)
        self._dispatch(enc, "swiglu", w.fmt, t_rows, hp // 4, fp, x, [w.gate, w.up], h, binds=binds)
        self._dispatch(enc, "down", w.down_fmt, t_rows, fp // 4, hp, h, [w.down], y, binds=binds, accumulate=accumulate)

    def readback(self, n: int):
        """A buffer of ``n`` float32 elements that :meth:`submit_read` can copy a result into and
        map, for a caller that reads results of that size again and again (a decode step): kept,
        it spares each read a buffer, a command encoder and a submission of its own."""
        usage = self._wgpu.BufferUsage.MAP_READ | self._wgpu.BufferUsage.COPY_DST
        return self._device().create_buffer(size=max(16, 4 * n), usage=usage)

    def submit_read(self, enc, buf=None, n: int = 0, readback=None) -> np.ndarray:
        """Submit ``enc`` and read ``n`` float32 elements of ``buf`` back (none without ``buf``);
        through ``readback`` (:meth:`readback`, ≥ n elements) if given, the copy in ``enc``'s
        own submission. Raises KernelError on a GPU error (the device is then reset) or a
        non-finite result."""
        if readback is not None and buf is not None:
            return self._submit_reading(enc, [(buf, n)], readback)[0]
        with self._guarded():
            self.device.queue.submit([enc.finish()])
            if buf is None:
                return np.zeros(0, np.float32)
            y = np.frombuffer(self.device.queue.read_buffer(buf, 0, 4 * n), np.float32).copy()
        return self._finite([y])[0]

    def submit_read_many(self, enc, outs: list[tuple[object, int]]) -> list[np.ndarray]:
        """Submit ``enc`` and read the first n float32 elements of each (buffer, n) of ``outs``
        back, in one submission and one mapping. Raises as :meth:`submit_read`."""
        return self._submit_reading(enc, outs)

    def _submit_reading(self, enc, outs: list[tuple[object, int]], readback=None) -> list[np.ndarray]:
        """Submit ``enc`` with the first n float32 elements of each (buffer, n) of ``outs``
        copied in the same submission into one mappable buffer (``readback``, else the kept
        one or one for this request), then read them back: each output's elements (float32
        [n]). Nothing is submitted when there are none. Raises as :meth:`submit_read`."""
        total = sum(n for _, n in outs)
        if total == 0:
            return [np.zeros(0, np.float32) for _ in outs]
        with self._guarded():
            if readback is None:
                readback = self._ffn_scratch.readback_of(self, total)
            at = 0
            for buf, n in outs:
                if n:
                    enc.copy(buf, 0, readback, 4 * at, 4 * n)
                at += n
            self.device.queue.submit([enc.finish()])
            got = self._finite([self._map_read(readback, total)])[0]
        bounds = np.cumsum([0, *(n for _, n in outs)])
        return [got[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def _map_read(self, readback, n: int) -> np.ndarray:
        """The first ``n`` float32 elements of mappable buffer ``readback``, after the submissions so far."""
        if n == 0:
            return np.zeros(0, np.float32)
        if readback.map_state == "mapped":  # an error between map and unmap left it so
            readback.unmap()
        try:
            if readback.map_state != "unmapped":  # a map that failed leaves it pending for good
                raise RuntimeError(f"the read-back buffer is {readback.map_state}")
            try:  # as wgpu-py's own read_buffer maps after its copy: plain READ adds an empty submission
                readback.map_sync("READ_NOSYNC", 0, 4 * n)
            except (KeyError, ValueError):  # a wgpu-py without that mode
                readback.map_sync(self._wgpu.MapMode.READ, 0, 4 * n)
        except (RuntimeError, ValueError) as e:  # not mapped (a lost device): a fresh device, a fresh buffer
            self.drop_device()
            raise KernelError(f"could not read the result back; the device was reset: {e}") from e
        try:
            return np.frombuffer(readback.read_mapped(0, 4 * n), np.float32).copy()
        finally:
            readback.unmap()

    def _run(self, kernel: str, params: bytes, inputs: list[np.ndarray], outputs: list[int],
             grid: tuple[int, int, int]) -> list[np.ndarray]:
        """One dispatch of a layer kernel: bindings params, ``inputs`` (float32, uploaded), then
        one read-write float32 buffer per ``outputs`` entry (its element count), read back."""
        wg = self._wgpu
        for a in inputs:
            if not np.isfinite(a).all():
                raise KernelError(f"{kernel}: an input holds NaN or infinity; refusing to compute")
        with self._guarded(kernel):
            dev = self._device()
            pipe = self._pipeline(kernel, None)
            res = [self._buffer(params, wg.BufferUsage.UNIFORM)]
            res += [self._buffer(np.ascontiguousarray(a, np.float32).tobytes(), wg.BufferUsage.STORAGE) for a in inputs]
            outs = [dev.create_buffer(size=max(16, 4 * n), usage=wg.BufferUsage.STORAGE | wg.BufferUsage.COPY_SRC)
                    for n in outputs]
            bind = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
                {"binding": b, "resource": {"buffer": buf}} for b, buf in enumerate(res + outs)])
            enc = self.encoder()
            enc.dispatch(pipe, bind, grid)
            dev.queue.submit([enc.finish()])
            ys = [np.frombuffer(dev.queue.read_buffer(b), np.float32)[:n].copy() for b, n in zip(outs, outputs)]
        self._finite(ys[-1:])
        return ys

    # ---- compute ----------------------------------------------------------------------------

    def _dispatch(self, enc, kernel, fmt, t_rows, k4, n_out, inp, mats, out, col0=0, binds=None, accumulate=False):
        """Encode one dispatch per weight part of `kernel`: mats = [GpuMatrix, ...] sharing parts;
        output row t's columns col0 + (the part's rows) of a row of n_out; `binds`: _bind's cache.
        `accumulate` (down only): out[i] = sum + out[i], the same f32 add as a separate add.wgsl
        pass, so the same bits; `inp` must not be `out`. Not for q8, whose per-row scale product
        a compiler may fuse with that add (one rounding: other bits)."""
        if accumulate:
            if kernel != "down":
                raise KernelError(f"accumulate is for the down kernels only, not {kernel!r}: write the {kernel} "
                                  "product into a buffer of its own, then add it with the add kernel")
            if fmt == "q8":
                raise KernelError("accumulate is refused for the 'q8' format: its per-row scale product and the "
                                  "add may be fused into one rounding by the shader compiler, other bits than a "
                                  "separate add; write the product into a buffer of its own, then add it with the "
                                  "add kernel (or upload the matrix in another format)")
            if inp is out:
                raise KernelError(f"accumulate with the input buffer as the output ({kernel} of {fmt!r}): its "
                                  "workgroups would write rows that others still read (a race); pass an output "
                                  "buffer other than the input")
        pipe = self._pipeline(kernel, fmt, K.DECODE_TB if t_rows == 1 else K.TB, accumulate)
        rows_per_group = self.workgroup_size // self.lanes if fmt in K.BLOCK_FORMATS else 1
        for i, (r0, r1) in enumerate(mats[0].packed.parts):
            gx, gy, gz = K.dispatch_grid(r1 - r0, t_rows, rows_per_group)
            params = _PARAMS.pack(t_rows, k4, r1 - r0, col0 + r0, n_out, gx)
            res = [inp] + [m.buffers[i] for m in mats] + [m.scales[i] for m in mats] + [out]
            enc.dispatch(pipe, self._bind(pipe, params, res, binds), (gx, gy, gz))

    @contextlib.contextmanager
    def _guarded(self, what: str = "the request"):
        """Turn a GPU error inside into KernelError, the device reset (the next call makes a fresh one)."""
        try:
            yield
        except self._wgpu.GPUError as e:
            self.drop_device()
            raise KernelError(f"GPU error in {what}; the device was reset: {e}") from e

    @staticmethod
    def _finite(ys: list[np.ndarray]) -> list[np.ndarray]:
        if not all(np.isfinite(y).all() for y in ys):
            raise KernelError("the GPU returned NaN or infinity; refusing to pass it on")
        return ys

    def _check(self, w: GpuFfnWeights | GpuLinear, x: np.ndarray | None = None, cols: int = 0) -> None:
        """KernelError unless ``w`` is on this device and rows x (if given) are finite float32 [T, cols]."""
        if w.device is not self.device or self.device is None:
            raise KernelError("these weights were uploaded to a device that was lost; upload them again")
        if x is None:
            return
        K._f32(x, "x", 2)
        if x.shape[1] != cols:
            raise KernelError(f"x has {x.shape[1]} columns; these weights expect {cols}")
        if not np.isfinite(x).all():
            raise KernelError("x holds NaN or infinity; refusing to compute")

    def _rows_per_block(self, w: GpuFfnWeights) -> int:
        widest = max(K.pad4(w.hidden), K.pad4(w.inter)) * 4  # bytes of one activation row
        return max(1, self.max_binding // widest)

    def ffn(self, x: np.ndarray, w: GpuFfnWeights) -> np.ndarray:
        """y = down(swiglu(x)) for x [T, H] float32 → [T, H] float32 (both kernels, one submit per block)."""
        self._check(w, x, w.hidden)
        block = self._rows_per_block(w)
        return np.concatenate([self._ffn_block(x[t:t + block], w) for t in range(0, len(x), block)]
                              or [np.zeros((0, w.hidden), np.float32)])

    def ffn_many(self, items: Sequence[tuple[np.ndarray, GpuFfnWeights]]) -> list[np.ndarray]:
        """``[ffn(x, w) for x, w in items]`` (x [T_i, H] float32 → [T_i, H] float32), in one
        submission when each x fits one binding (a decode step's experts). Raises as :meth:`ffn`."""
        for x, w in items:
            self._check(w, x, w.hidden)
        if any(len(x) > self._rows_per_block(w) for x, w in items):
            return [self.ffn(x, w) for x, w in items]
        return self._ffn_blocks(list(items))

    def _ffn_block(self, x: np.ndarray, w: GpuFfnWeights) -> np.ndarray:
        return self._ffn_blocks([(x, w)])[0]

    def _ffn_blocks(self, items: list[tuple[np.ndarray, GpuFfnWeights]]) -> list[np.ndarray]:
        """Each SwiGLU block over its rows (each within one binding), all in one submission and
        one read-back. Block i's rows, intermediate and output live in slot i of kept buffers
        (:class:`_FfnScratch`), grown as needed, and its bind groups are kept with them: a decode
        step's experts cost the host a write and two dispatches each, not three buffers, two bind
        groups and a read-back of their own."""
        with self._guarded():
            dev = self._device()
            scratch = self._ffn_scratch
            enc = self.encoder()
            outs = []
            for i, (x, w) in enumerate(items):
                t_rows, hp, fp = len(x), K.pad4(w.hidden), K.pad4(w.inter)
                if t_rows == 0:  # an expert no row was routed to: nothing to compute
                    outs.append((None, 0))
                    continue
                (xb, hb, yb), binds = scratch.slot(self, i, t_rows * hp, t_rows * fp, w)
                self.largest_binding = max(self.largest_binding, 4 * t_rows * fp, 4 * t_rows * hp)
                dev.queue.write_buffer(xb, 0, K.pad_matrix(x, t_rows, hp).tobytes())
                self._dispatch(enc, "swiglu", w.fmt, t_rows, hp // 4, fp, xb, [w.gate, w.up], hb, binds=binds)
                self._dispatch(enc, "down", w.down_fmt, t_rows, fp // 4, hp, hb, [w.down], yb, binds=binds)
                outs.append((yb, t_rows * hp))
            got = self._submit_reading(enc, outs)
        return [y.reshape(len(x), K.pad4(w.hidden))[:, :w.hidden].copy() for (x, w), y in zip(items, got)]

    def time_kernel(self, kernel: str, w: GpuFfnWeights, t_rows: int, reps: int) -> float:
        """Seconds per run of one kernel ("swiglu", "down" or "ffn" for both) over t_rows rows.

        `reps` runs are encoded into one submission and timed by wall clock until the queue drains
        (a 4-byte read-back), so per-submit overhead is amortized. For benchmarks only.
        """
        import time

        wg = self._wgpu
        hp, fp = K.pad4(w.hidden), K.pad4(w.inter)
        dev = self._device()
        xb = self._buffer(np.ones((t_rows, hp), np.float32).tobytes(), wg.BufferUsage.STORAGE)
        hb = self._buffer(np.full((t_rows, fp), 0.5, np.float32).tobytes(), wg.BufferUsage.STORAGE)
        yb = dev.create_buffer(size=t_rows * hp * 4, usage=wg.BufferUsage.STORAGE | wg.BufferUsage.COPY_SRC)

        def run(n):
            enc = self.encoder()
            for _ in range(n):
                if kernel in ("swiglu", "ffn"):
                    self._dispatch(enc, "swiglu", w.fmt, t_rows, hp // 4, fp, xb, [w.gate, w.up], hb)
                if kernel in ("down", "ffn"):
                    self._dispatch(enc, "down", w.down_fmt, t_rows, fp // 4, hp, hb, [w.down], yb)
            t0 = time.perf_counter()
            dev.queue.submit([enc.finish()])
            dev.queue.read_buffer(yb, 0, 4)
            return time.perf_counter() - t0

        run(1)  # warm-up: pipeline creation, first-touch of buffers
        return run(reps) / reps
