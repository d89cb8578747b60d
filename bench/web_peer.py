"""Benchmark of the browser peer's WGSL kernels; prints one JSON document.

    python3 bench/web_peer.py [--quick] [--no-chromium] [--e2e] [--shapes T,H,F ...]

For each kernel (swiglu = fused gate/up, down, ffn = both) and weight format (f32, f16, q8 and the
GGUF blocks q4_0, q4_1, q8_0) it reports seconds per call, GFLOP/s and GB/s (weight bytes as held,
block scales included, + activation bytes moved once), and per shape the bytes each format holds
against float32 ("compact"), on:
- lavapipe: the WGSL through wgpu-py on Mesa's Vulkan CPU driver (or on a real GPU: whatever
  adapter wgpu picks, described in the output);
- swiftshader: the same WGSL through the page's own modules in headless Chromium.
Decode is bandwidth-bound (T = 1): GB/s against the device's memory bandwidth is the figure of merit.
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
                w = gpu.upload(wg, wu, wd, fmt)  # block formats: quantized by gguf, as a file holds them
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
      const enc = dev.createCommandEncoder();
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
                        blocks = {"encoding": fmt.upper(), **{name: base64.b64encode(K.quantize_blocks(w, fmt)).decode()
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
    args = ap.parse_args(argv)
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
