"""Benchmark of the browser peer's WGSL kernels; prints one JSON document.

    python3 bench/web_peer.py [--quick] [--no-chromium] [--e2e] [--shapes T,H,F ...]
    python3 bench/web_peer.py --blocks [--blocks-shape H,F] [--reps N] [--lanes L] [--subgroups auto|on|off]
                              [--formats q4_k,q6_k,q8_0] [--int8-activations [--rows-per-thread 1,2,4]]
    python3 bench/web_peer.py --dispatch-cost [--reps N]

For each kernel (swiglu = fused gate/up, down, ffn = both) and weight format (f32, f16, q8 and the
GGUF blocks q4_0, q4_1, q8_0, q4_k, q5_k, q6_k) it reports seconds per call, GFLOP/s and GB/s (weight bytes as held,
block scales included, + activation bytes moved once), and per shape the bytes each format holds
against float32 ("compact"), on:
- lavapipe: the WGSL through wgpu-py on Mesa's Vulkan CPU driver (or on a real GPU: whatever
  adapter wgpu picks, described in the output);
- swiftshader: the same WGSL through the page's own modules in headless Chromium.
Decode is bandwidth-bound (T = 1): GB/s against the device's memory bandwidth is the figure of merit.
With --blocks, only the wgpu adapter, per block type on one shape (default H 4096, F 14336, a
Mixtral expert): GB/s of weights read at T = 1 and GFLOP/s at T = 64 (both kernels), beside the
device's buffer-to-buffer copy bandwidth (read + write bytes per second, wgpu's copy_buffer_to_buffer).
Block weights are random valid blocks (K.random_blocks): timing does not depend on their values.
With --blocks --int8-activations, the int8-activation GEMVs instead (web_peer/int8_activations.py):
decode GEMVs (T = 1) of Q4_K, Q6_K and Q8_0 weights on the CPU's own int8 activation rows (per 256
values for the K-quants, per 32 for Q8_0; dot4I8Packed), beside the f32-activation kernel
(down_blocks.wgsl) on the same matrix, device and rows: W [F, H] (a gate or up) and W [H, F] (a
down), ms alternating old, new, old, new; GB/s of weight bytes and their fraction of the copy
bandwidth; the GPU's answer against the CPU's int8 kernel (within cpu_bound: its largest fraction)
and both kernels' against float64 of the dequantized weights and float x. The activation row is
quantized on the CPU, once, outside the timing (cpu_quantize_ms says what that costs here).
--rows-per-thread times the GEMV also with a thread computing 2, 4 or 8 weight rows from one load
of a step's activations, and says whether each count gave the bits of one.
With --dispatch-cost, what one small dispatch costs beyond its work (a GPU stage encodes a dozen
a layer): N dispatches of add.wgsl over 4096 floats, each with its own uniform buffer and bind
group as the host makes them, encoded a compute pass each or all in one pass; per dispatch the
host's encode time, the wall time from submit to the read-back, and the GPU's own time between
the first and the last dispatch (timestamp queries, where the adapter has them; nanoseconds
assume a timestamp period of 1 ns, NVIDIA's).
With --e2e, through the real page (signaling, authenticated WebRTC link, worker.js): MiB/s of
weight shipping to the page and DenseRequest round-trip latency as the coordinator sees it.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from web_peer import kernels as K  # noqa: E402


def flops_bytes(kernel: str, fmt: str, t: int, h: int, f: int) -> tuple[float, float]:
    """Useful FLOPs and bytes moved for one call (weights read once; activations in and out)."""
    bpw = K.bytes_per_weight(fmt)
    scale = 4 if fmt == "q8" else 0  # one f32 scale per weight row (block formats count theirs in bpw)
    swiglu = (4.0 * t * h * f, 2 * f * (h * bpw + scale) + 4.0 * t * (h + f))
    down = (2.0 * t * h * f, h * (f * bpw + scale) + 4.0 * t * (h + f))
    if kernel == "swiglu":
        return swiglu
    if kernel == "down":
        return down
    return swiglu[0] + down[0], swiglu[1] + down[1]


def _entry(backend, kernel, fmt, t, h, f, seconds):
    fl, by = flops_bytes(kernel, fmt, t, h, f)
    return {"backend": backend, "kernel": kernel, "format": fmt, "T": t, "H": h, "F": f,
            "ms": round(seconds * 1e3, 4), "gflops": round(fl / seconds / 1e9, 3),
            "gbps": round(by / seconds / 1e9, 3)}


def _weights(h, f, seed=0):
    rng = np.random.default_rng(seed)
    wg = (rng.standard_normal((f, h)) / np.sqrt(h)).astype(np.float32)
    wu = (rng.standard_normal((f, h)) / np.sqrt(h)).astype(np.float32)
    wd = (rng.standard_normal((h, f)) / np.sqrt(f)).astype(np.float32)
    return wg, wu, wd


def _upload(gpu, fmt, wg, wu, wd):
    """Upload one SwiGLU block as `fmt`: float formats from the float32 weights, block formats as the
    file's blocks (gguf's quantizer; random valid K-quant blocks, which gguf-py cannot quantize to)."""
    if fmt in K.K_FORMATS:
        rng = np.random.default_rng(0)
        return gpu.upload(*(K.random_blocks(rng, *w.shape, fmt, 1e-4) for w in (wg, wu, wd)), fmt)
    return gpu.upload(wg, wu, wd, fmt)


COPY_WGSL = """
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let stride = nw.x * 256u;
    for (var i = gid.x; i < arrayLength(&src); i += stride) {
        dst[i] = src[i];
    }
}
"""


def copy_bandwidth(gpu, nbytes: int = 1 << 27, reps: int = 20) -> dict:
    """The device's copy rates, read + write bytes per second (GB/s): ``copy_buffer_to_buffer``
    and a WGSL copy kernel (vec4 loads and stores, 65535 workgroups of 256 striding), 128 MiB buffers."""
    wg = gpu._wgpu
    dev = gpu._device()
    usage = wg.BufferUsage.COPY_SRC | wg.BufferUsage.COPY_DST | wg.BufferUsage.STORAGE
    a, b = dev.create_buffer(size=nbytes, usage=usage), dev.create_buffer(size=nbytes, usage=usage)
    probe = dev.create_buffer(size=16, usage=wg.BufferUsage.COPY_DST | wg.BufferUsage.MAP_READ)
    pipe = dev.create_compute_pipeline(layout="auto", compute={
        "module": dev.create_shader_module(code=COPY_WGSL), "entry_point": "main"})
    bind = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": a}}, {"binding": 1, "resource": {"buffer": b}}])

    def run(n, shader):
        enc = dev.create_command_encoder()
        for _ in range(n):
            if shader:
                cpass = enc.begin_compute_pass()
                cpass.set_pipeline(pipe)
                cpass.set_bind_group(0, bind)
                cpass.dispatch_workgroups(min(65535, nbytes // 16 // 256), 1, 1)
                cpass.end()
            else:
                enc.copy_buffer_to_buffer(a, 0, b, 0, nbytes)
        enc.copy_buffer_to_buffer(b, 0, probe, 0, 16)
        t0 = time.perf_counter()
        dev.queue.submit([enc.finish()])
        probe.map_sync("READ")
        probe.unmap()
        return time.perf_counter() - t0

    out = {}
    for name, shader in (("copy_buffer_to_buffer_gbps", False), ("wgsl_copy_gbps", True)):
        run(1, shader)
        out[name] = round(2 * nbytes * reps / min(run(reps, shader) for _ in range(3)) / 1e9, 1)
    for buf in (a, b, probe):
        buf.destroy()
    try:  # the same figure from CUDA where torch is installed (not through Vulkan)
        import torch

        if torch.cuda.is_available():
            x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
            y = torch.empty_like(x)
            y.copy_(x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                y.copy_(x)
            torch.cuda.synchronize()
            out["torch_cuda_copy_gbps"] = round(2 * nbytes * reps / (time.perf_counter() - t0) / 1e9, 1)
    except ImportError:
        pass
    return out


def dispatch_cost(reps: int) -> dict:
    """Per small dispatch: encode µs (host), wall µs (submit → read-back) and GPU µs (timestamps),
    a compute pass per dispatch against one pass for all (module docstring)."""
    import struct

    import wgpu

    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    stamps = "timestamp-query" in adapter.features
    dev = adapter.request_device_sync(required_features=["timestamp-query"] * stamps)
    usage = wgpu.BufferUsage
    pipe = dev.create_compute_pipeline(layout="auto", compute={
        "module": dev.create_shader_module(code=K.layer_source("add")), "entry_point": "main",
        "constants": {"WG": 64}})
    n = 4096
    x = dev.create_buffer(size=4 * n, usage=usage.STORAGE | usage.COPY_SRC)
    y = dev.create_buffer_with_data(data=np.ones(n, np.float32).tobytes(), usage=usage.STORAGE)
    qs = dev.create_query_set(type="timestamp", count=2) if stamps else None
    resolved = dev.create_buffer(size=16, usage=usage.QUERY_RESOLVE | usage.COPY_SRC) if stamps else None

    def run(one_pass: bool) -> tuple[float, float, float | None]:
        t0 = time.perf_counter()
        enc = dev.create_command_encoder()
        cpass = None
        for i in range(reps):
            params = dev.create_buffer_with_data(data=struct.pack("<4I", n, n, n, 0), usage=usage.UNIFORM)
            bind = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
                {"binding": 0, "resource": {"buffer": params}}, {"binding": 1, "resource": {"buffer": y}},
                {"binding": 2, "resource": {"buffer": x}}])
            if cpass is None:
                writes = {}
                if stamps and i == 0:
                    writes["beginning_of_pass_write_index"] = 0
                if stamps and (one_pass or i == reps - 1):
                    writes["end_of_pass_write_index"] = 1
                cpass = enc.begin_compute_pass(timestamp_writes={"query_set": qs, **writes} if writes else None)
            cpass.set_pipeline(pipe)
            cpass.set_bind_group(0, bind)
            cpass.dispatch_workgroups(n // 64, 1, 1)
            if not one_pass:
                cpass.end()
                cpass = None
        if cpass is not None:
            cpass.end()
        if stamps:
            enc.resolve_query_set(qs, 0, 2, resolved, 0)
        buf = enc.finish()
        t1 = time.perf_counter()
        dev.queue.submit([buf])
        dev.queue.read_buffer(x, 0, 16)
        t2 = time.perf_counter()
        gpu = None
        if stamps:
            a, b = np.frombuffer(dev.queue.read_buffer(resolved), np.uint64)
            gpu = (int(b) - int(a)) / 1e3 / reps
        return (t1 - t0) * 1e6 / reps, (t2 - t1) * 1e6 / reps, gpu

    out: dict = {"adapter": {k: adapter.info[k] for k in ("vendor", "device", "description", "backend_type")},
                 "dispatches": reps, "timestamps": stamps}
    for name, one_pass in (("pass_per_dispatch", False), ("one_pass", True)):
        run(one_pass)  # warm-up
        best = min((run(one_pass) for _ in range(5)), key=lambda r: r[1])
        out[name] = {"encode_us": round(best[0], 2), "wall_us": round(best[1], 2),
                     "gpu_us": None if best[2] is None else round(best[2], 2)}
    dev.destroy()
    return out


def _block_adapter(gpu) -> dict:
    """The adapter section of the block benches: what it is, and how the block kernels split rows
    (lanes, rows a workgroup) and whether they reduce through subgroups."""
    info = gpu.adapter.info
    adapter = {k: info[k] for k in ("vendor", "device", "description", "backend_type", "adapter_type")}
    adapter.update({"subgroup_feature": "subgroup" in gpu.adapter.features,
                    "subgroup_min_size": gpu.subgroup_min_size, "subgroups_used": gpu.subgroups,
                    "lanes": gpu.lanes, "rows_per_workgroup": gpu.workgroup_size // gpu.lanes})
    return adapter


def bench_blocks(h, f, reps, workgroup_size, lanes=None, subgroups=None,
                 formats=("f32", "f16") + K.BLOCK_FORMATS):
    """Per weight format, both kernels on one SwiGLU block [F, H]: T = 1 GB/s of weights read,
    T = 8 ms and T = 64 GFLOP/s, each format on a fresh device (see bench_wgpu), beside the copy
    bandwidth. The adapter section says how the block kernels split rows (lanes, rows a workgroup)
    and whether they reduce through subgroups."""
    from web_peer.wgpu_host import WgpuFfn

    opts = {"workgroup_size": workgroup_size, "lanes": lanes, "subgroups": subgroups}
    with WgpuFfn(**opts) as gpu:
        adapter = _block_adapter(gpu)
        out = {"adapter": adapter, "workgroup_size": gpu.workgroup_size, "H": h, "F": f,
               "copy": copy_bandwidth(gpu), "formats": []}
        out["copy_gbps"] = max(out["copy"].values())  # the reference: the best copy this device showed
        formats = [fm for fm in formats if fm in gpu.formats]
    wg, wu, wd = _weights(h, f)
    for fmt in formats:
        with WgpuFfn(**opts) as gpu:
            w = _upload(gpu, fmt, wg, wu, wd)
            t1 = gpu.time_kernel("ffn", w, 1, reps)
            t8 = gpu.time_kernel("ffn", w, 8, reps)
            t64 = gpu.time_kernel("ffn", w, 64, max(3, reps // 4))
            # The answer on this device against the twin's weights in float64 (not timed).
            x = np.random.default_rng(1).standard_normal((2, h)).astype(np.float32)
            y = gpu.ffn(x, w)
            ref = K.swiglu_ffn_f64(x, *(K.unpack_matrix(m.packed) for m in (w.gate, w.up, w.down)))
        e1, e64 = _entry("wgpu", "ffn", fmt, 1, h, f, t1), _entry("wgpu", "ffn", fmt, 64, h, f, t64)
        weight_gbps = w.nbytes / t1 / 1e9
        out["formats"].append({"format": fmt, "weight_bytes": w.nbytes,
                               "bits_per_weight": round(8 * w.nbytes / (3 * h * f), 3),
                               "t1_ms": e1["ms"], "t1_weight_gbps": round(weight_gbps, 1),
                               "t1_of_copy": round(weight_gbps / out["copy_gbps"], 3),
                               "t8_ms": _entry("wgpu", "ffn", fmt, 8, h, f, t8)["ms"],
                               "t64_ms": e64["ms"], "t64_gflops": e64["gflops"],
                               "rel_error_vs_twin_f64": float(np.abs(y - ref).max() / np.abs(ref).max())})
    return out


def bench_int8_activations(h, f, reps, workgroup_size, lanes=None, subgroups=None, formats=("q4_k", "q6_k", "q8_0"),
                           rows_per_thread=(1,)):
    """Per format of web_peer.int8_activations.X8_FORMATS and matrix shape ([F, H], [H, F]), on a
    fresh device: decode GEMV ms of the f32-activation block kernel and of the int8-activation
    GEMV (at each count of ``rows_per_thread``, ``x8_gemv_rtN``), alternating twice; GB/s of
    weight bytes and of copy; errors (module docstring). Random valid blocks."""
    from web_peer import int8_activations as X8
    from web_peer.wgpu_host import WgpuFfn

    opts = {"workgroup_size": workgroup_size, "lanes": lanes, "subgroups": subgroups}
    with WgpuFfn(**opts) as gpu:
        adapter = _block_adapter(gpu)
        out = {"adapter": adapter, "workgroup_size": gpu.workgroup_size, "H": h, "F": f,
               "activation_quantization": "the CPU's (QMatrix.int8_rows), once before the timed GEMVs",
               "copy": copy_bandwidth(gpu), "gemvs": []}
        out["copy_gbps"] = max(out["copy"].values())
    for fmt in (fm for fm in formats if fm in X8.X8_FORMATS):
        for name, (rows, cols) in (("gate [F, H]", (f, h)), ("down [H, F]", (h, f))):
            x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
            X8.int8_rows(fmt, x)  # loads the CPU's kernels
            t0 = time.perf_counter()
            X8.int8_rows(fmt, x)
            quantize_ms = (time.perf_counter() - t0) * 1e3
            with WgpuFfn(**opts) as gpu:
                rng = np.random.default_rng(0)
                w = gpu.upload_linear(K.random_blocks(rng, rows, cols, fmt, 1e-4), fmt)
                gemvs = {rt: X8.X8Gemv(gpu, rows_per_thread=rt) for rt in sorted({1, *rows_per_thread})}
                runs: dict[str, list[float]] = {"f32_ms": [], **{f"x8_gemv_rt{rt}_ms": [] for rt in gemvs}}
                for _ in range(2):
                    runs["f32_ms"].append(gemvs[1].time_f32(w, reps) * 1e3)
                    for rt, g in gemvs.items():
                        runs[f"x8_gemv_rt{rt}_ms"].append(g.time(w, reps) * 1e3)
                # Answers on this device (not timed): x ~ N(0, 1), one row.
                y8, xrows = gemvs[1].run(w, x)
                same_bits = {rt: bool(np.array_equal(g.run(w, x)[0], y8)) for rt, g in gemvs.items() if rt != 1}
                y32 = gpu.matmul_many([(w, x)])[0]
                lanes_used = gpu.lanes
            m = w.matrix.packed
            cpu = X8.cpu_product(m, xrows)
            bound = X8.cpu_bound(m, xrows, lanes_used)
            ref = x.astype(np.float64) @ K.unpack_matrix(m)[:rows].astype(np.float64).T
            scale = float(np.abs(ref).max())
            entry = {"format": fmt, "matrix": name, "rows": rows, "K": cols, "weight_bytes": m.nbytes,
                     "cpu_quantize_ms": round(quantize_ms, 4)}
            for key, ms in runs.items():
                best = min(ms)
                entry[key] = [round(v, 4) for v in ms]
                entry[key.replace("_ms", "_weight_gbps")] = round(m.nbytes / best / 1e6, 2)
                entry[key.replace("_ms", "_of_copy")] = round(m.nbytes / best / 1e6 / out["copy_gbps"], 3)
            diff = np.abs(y8.astype(np.float64) - cpu)
            entry.update({
                "x8_vs_cpu_max_abs": float(diff.max()),
                "x8_vs_cpu_rel": float(diff.max() / np.abs(cpu).max()),
                "x8_vs_cpu_of_bound": float((diff / bound).max()),
                "bound_rel": float(bound.max() / np.abs(cpu).max()),
                "x8_equal_bits_to_cpu": bool(np.array_equal(y8, cpu)),
                **{f"x8_rt{rt}_equal_bits_to_rt1": same for rt, same in same_bits.items()},
                "x8_rel_error_vs_f64": float(np.abs(y8 - ref).max() / scale),
                "f32_rel_error_vs_f64": float(np.abs(y32 - ref).max() / scale),
            })
            out["gemvs"].append(entry)
    return out


def bench_wgpu(shapes, reps, workgroup_size):
    from web_peer.wgpu_host import WgpuFfn

    with WgpuFfn(workgroup_size=workgroup_size) as gpu:
        info = gpu.adapter.info
        out = {"adapter": {k: info[k] for k in ("vendor", "device", "description", "backend_type", "adapter_type")},
               "workgroup_size": gpu.workgroup_size, "max_binding": gpu.max_binding, "results": [], "compact": []}
        formats = gpu.formats
    for t, h, f in shapes:
        wg, wu, wd = _weights(h, f)
        for fmt in formats:
            # A fresh device per format: on the H200 a kernel timed after other formats' uploads on the
            # same device ran up to 4x slower (buffer placement), which would skew the comparison.
            with WgpuFfn(workgroup_size=workgroup_size) as gpu:
                w = _upload(gpu, fmt, wg, wu, wd)  # block formats: the file's blocks
                if not any((c["format"], c["H"], c["F"]) == (fmt, h, f) for c in out["compact"]):
                    out["compact"].append({"format": fmt, "H": h, "F": f, "bytes": w.nbytes,
                                           "f32_bytes": 3 * h * f * 4, "of_f32": round(w.nbytes / (3 * h * f * 4), 4)})
                for kernel in ("swiglu", "down", "ffn"):
                    out["results"].append(_entry("wgpu", kernel, fmt, t, h, f, gpu.time_kernel(kernel, w, t, reps)))
    return out


# blocks: {encoding, gate, up, down} base64 GGUF blocks for a block format, else null (random f32).
CHROMIUM_BENCH = """async ({h, f, t, fmt, reps, seed, blocks}) => {
  const { GpuContext } = await import("/gpu.js");
  const { FfnBlock, pad4 } = await import("/ffn.js");
  const ctx = await GpuContext.create();
  let s = seed;
  const rnd = (n, k) => { const a = new Float32Array(n); for (let i = 0; i < n; i++) { s = (s * 1103515245 + 12345) >>> 0; a[i] = (s / 2 ** 32 - 0.5) * k; } return a; };
  const u8 = (b) => Uint8Array.from(atob(b), (c) => c.charCodeAt(0));
  const w = blocks
    ? { wGate: { encoding: blocks.encoding, bytes: u8(blocks.gate) }, wUp: { encoding: blocks.encoding, bytes: u8(blocks.up) },
        wDown: { encoding: blocks.encoding, bytes: u8(blocks.down) } }
    : { fmt, wGate: rnd(f * h, 0.1), wUp: rnd(f * h, 0.1), wDown: rnd(h * f, 0.1) };
  const block = new FfnBlock(ctx, { hidden: h, inter: f, ...w });
  await block.run(rnd(t * h, 1), t);  // uploads weights, compiles pipelines
  const dev = ctx.device, hp = pad4(h), fp = pad4(f);
  const xb = ctx.buffer(rnd(t * hp, 1)), hb = ctx.buffer(rnd(t * fp, 1)), yb = ctx.buffer(t * hp * 4);
  const res = {};
  for (const kernel of ["swiglu", "down", "ffn"]) {
    const run = async (n) => {
      const enc = ctx.encoder();
      for (let i = 0; i < n; i++) {
        if (kernel !== "down") await block.swiglu.encode(enc, block.fmt, { tRows: t, k4: hp / 4, nOut: fp, x: xb, gate: block.gpu.gate, up: block.gpu.up, h: hb });
        if (kernel !== "swiglu") await block.down.encode(enc, block.downFmt, { tRows: t, k4: fp / 4, nOut: hp, h: hb, down: block.gpu.down, y: yb });
      }
      const t0 = performance.now();
      dev.queue.submit([enc.finish()]);
      await dev.queue.onSubmittedWorkDone();
      return (performance.now() - t0) / 1e3;
    };
    await run(1);
    res[kernel] = (await run(reps)) / reps;
  }
  // Whole requests through FfnBlock.run (upload of x, both kernels, read-back), ms each.
  const x = rnd(t * h, 1);
  const t0 = performance.now();
  for (let i = 0; i < reps; i++) await block.run(x, t);
  res.request_ms = (performance.now() - t0) / reps;
  res.adapter = ctx.describe();
  res.gpu_bytes = block.gpuBytes;
  return res;
}"""


def bench_chromium(shapes, reps, formats=("f32", "q8") + K.BLOCK_FORMATS):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import functools
    import http.server
    import threading

    from playwright.sync_api import sync_playwright

    from tests.browser.conftest import BLANK, CHROMIUM, CHROMIUM_ARGS, WEB_PEER, _Quiet

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(WEB_PEER)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    out = {"results": [], "requests": []}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.goto(f"http://localhost:{server.server_address[1]}{BLANK}")
            for t, h, f in shapes:
                wg, wu, wd = _weights(h, f)
                for fmt in formats:
                    blocks = None
                    if fmt in K.BLOCK_FORMATS:
                        rng = np.random.default_rng(0)
                        raw = (lambda w: K.random_blocks(rng, *w.shape, fmt)) if fmt in K.K_FORMATS else (
                            lambda w: K.quantize_blocks(w, fmt))
                        blocks = {"encoding": fmt.upper(), **{name: base64.b64encode(raw(w)).decode()
                                                             for name, w in (("gate", wg), ("up", wu), ("down", wd))}}
                    r = page.evaluate(CHROMIUM_BENCH, dict(h=h, f=f, t=t, fmt=fmt, reps=reps, seed=1, blocks=blocks))
                    out["adapter"] = r["adapter"]
                    for kernel in ("swiglu", "down", "ffn"):
                        out["results"].append(_entry("swiftshader", kernel, fmt, t, h, f, r[kernel]))
                    out["requests"].append({"format": fmt, "T": t, "H": h, "F": f, "gpu_bytes": r["gpu_bytes"],
                                            "request_ms": round(r["request_ms"], 3)})
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    return out


def bench_e2e(reps: int) -> dict:
    """Through the real page: MiB/s of weight shipping to it, and DenseRequest round trips (ms)."""
    import os
    import statistics
    import tempfile
    from pathlib import Path as _P

    from playwright.sync_api import sync_playwright

    from swarm.peer.net.messages import DenseAnswer, DenseRequest
    from swarm.peer.weights.slices import ModelSlicer, SliceSpan
    from swarm.keys.swarmkey import SwarmKey
    from tests.browser.conftest import CHROMIUM
    from tests.browser.test_page_e2e import E2E_ARGS, PythonSwarm, _page_url, _wait_state, lan_address, smollm2_path

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        swarm = PythonSwarm(_P(tmp), SwarmKey(os.urandom(32)), lan_address())
        browser = p.chromium.launch(executable_path=CHROMIUM, args=E2E_ARGS)
        try:
            page = browser.new_context(ignore_https_errors=True).new_page()
            t0 = time.perf_counter()
            page.goto(_page_url(swarm, swarm.key.code, name="bench"))
            _wait_state(page, "authenticated")
            out["join_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            # Shipping: a 24 MiB F32 dense slice (H 1024, 2048 rows), chunks of 1 MiB.
            rng = np.random.default_rng(0)
            h, r = 1024, 2048
            mats = [rng.standard_normal(s).astype(np.float32) for s in ((r, h), (r, h), (h, r))]
            blob, tensors = b"", []
            for role, a in zip(("gate", "up", "down"), mats):
                tensors.append({"role": role, "encoding": "F32", "shape": list(a.shape), "offset": len(blob), "nbytes": a.nbytes})
                blob += a.tobytes()
            meta = {"version": 1, "format": "safetensors", "spec": {"layer": 0, "kind": "dense", "start": 0, "stop": r}, "tensors": tensors}
            manifest = swarm.source.offer(blob, meta)
            t0 = time.perf_counter()
            swarm.call(swarm.slices.offer(swarm.browser_link(), manifest))
            page.wait_for_function("window.colibri.worker.blocks.size === 1", timeout=300_000)
            s = time.perf_counter() - t0
            out["shipping"] = {"bytes": len(blob), "seconds": round(s, 3), "mib_per_s": round(len(blob) / s / 2**20, 2)}
            # Requests: SmolLM2's whole layer-5 MLP (Q4_1 shipped, Q4_1 blocks on the GPU).
            b2, m2 = ModelSlicer(smollm2_path()).extract(SliceSpan(layer=5, kind="dense", start=0, stop=1536))
            swarm.offer(b2, m2)
            page.wait_for_function("window.colibri.worker.blocks.size === 2", timeout=60_000)
            out["requests"] = []
            for t in (1, 8):
                x = rng.standard_normal((t, 576)).astype(np.float32)
                times = []
                for i in range(reps + 1):
                    t0 = time.perf_counter()
                    ans = swarm.request(DenseRequest(request_id=100 + i, term=0, plan_version=0, layer=5, ranges=((0, 1536),), x=x))
                    times.append(time.perf_counter() - t0)
                    assert isinstance(ans, DenseAnswer), ans
                times = times[1:]  # the first one uploads the weights to the GPU
                out["requests"].append({"T": t, "H": 576, "F": 1536, "median_ms": round(statistics.median(times) * 1e3, 2),
                                        "max_ms": round(max(times) * 1e3, 2)})
        finally:
            browser.close()
            swarm.stop()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="T,H,F triples (default: an OLMoE-sized expert and a SmolLM2 MLP, T=1 and 8)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workgroup-size", type=int, default=None, help="WG override (default: 64 on GPUs, 8 on CPU adapters)")
    ap.add_argument("--no-chromium", action="store_true", help="only the native wgpu adapter")
    ap.add_argument("--e2e", action="store_true",
                    help="also the page end to end: weight shipping MiB/s and request latency over WebRTC")
    ap.add_argument("--quick", action="store_true", help="small shapes, few reps (a smoke run)")
    ap.add_argument("--blocks", action="store_true",
                    help="only wgpu, per block type: T=1 GB/s and T=64 GFLOP/s beside the copy bandwidth")
    ap.add_argument("--blocks-shape", default="4096,14336", help="H,F of --blocks")
    ap.add_argument("--lanes", type=int, default=None,
                    help="block kernels' threads per weight row (default: 32 on GPUs, the workgroup on CPU adapters)")
    ap.add_argument("--subgroups", choices=("auto", "on", "off"), default="auto",
                    help="block kernels' row reduction through subgroup shuffles (auto: when the adapter allows)")
    ap.add_argument("--formats", default=None, help="comma-separated formats of --blocks (default: all the adapter has)")
    ap.add_argument("--int8-activations", action="store_true",
                    help="with --blocks: the int8-activation GEMVs (q4_k, q6_k, q8_0) beside the f32-activation kernel")
    ap.add_argument("--rows-per-thread", default="1",
                    help="with --int8-activations: comma-separated weight rows a thread of the int8 GEMV computes "
                         "(1, 2, 4, 8); each count is timed beside the others")
    ap.add_argument("--dispatch-cost", action="store_true",
                    help="only wgpu: what a small dispatch costs, a pass each against one pass (--reps dispatches)")
    args = ap.parse_args(argv)
    if args.int8_activations and not args.blocks:
        ap.error("--int8-activations only applies to --blocks runs: add --blocks, or drop --int8-activations")
    if args.rows_per_thread != "1" and not args.int8_activations:
        ap.error("--rows-per-thread only applies to --int8-activations runs: add --blocks --int8-activations")
    try:
        bad = [v for v in args.rows_per_thread.split(",") if int(v) not in (1, 2, 4, 8)]
    except ValueError:
        bad = [args.rows_per_thread]
    if bad:
        ap.error(f"--rows-per-thread takes counts from 1, 2, 4, 8 separated by commas, got {args.rows_per_thread!r}")
    if args.dispatch_cost:
        json.dump({"bench": "web_peer dispatch cost", **dispatch_cost(max(args.reps, 2))}, sys.stdout, indent=1)
        print()
        return
    if args.blocks:
        h, f = (int(v) for v in args.blocks_shape.split(","))
        t0 = time.perf_counter()
        name, run = (("web_peer int8-activation GEMVs", bench_int8_activations) if args.int8_activations
                     else ("web_peer block kernels", bench_blocks))
        extra = {"rows_per_thread": tuple(int(v) for v in args.rows_per_thread.split(","))} if args.int8_activations else {}
        if args.formats:
            extra["formats"] = tuple(args.formats.split(","))
        report = {"bench": name, "reps": args.reps,
                  "wgpu": run(h, f, args.reps, args.workgroup_size, args.lanes,
                              {"auto": None, "on": True, "off": False}[args.subgroups], **extra)}
        report["wall_s"] = round(time.perf_counter() - t0, 2)
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    elif args.quick:
        shapes, args.reps = [(1, 256, 512)], 3
    else:
        shapes = [(1, 2048, 1024), (8, 2048, 1024), (1, 576, 1536)]
    t0 = time.perf_counter()
    report = {"bench": "web_peer kernels", "shapes": shapes, "reps": args.reps,
              "wgpu": bench_wgpu(shapes, args.reps, args.workgroup_size)}
    if not args.no_chromium:
        report["chromium"] = bench_chromium(shapes, args.reps)
    if args.e2e:
        report["e2e"] = bench_e2e(args.reps)
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
