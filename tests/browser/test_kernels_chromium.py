"""The same WGSL kernels inside headless Chromium (SwiftShader WebGPU), driven through the page's
own modules (gpu.js, swiglu.js, down.js, ffn.js), against the numpy twins and float64."""

from __future__ import annotations

import numpy as np
import pytest

from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tests.browser.conftest import b64, ffn_block, rel_error, unb64
from web_peer import kernels as K

pytestmark = pytest.mark.browser

# Runs FfnBlock in the page. Arguments: base64 little-endian float32 arrays (or, with `blocks`,
# GGUF blocks of that encoding for wg/wu/wd, and `downBlocks` false to keep wd float32) and options.
RUN_FFN = """async ({x, wg, wu, wd, t, h, f, fmt, maxBinding, workgroupSize, lanes, subgroups, ranges, blocks, downBlocks}) => {
  const { GpuContext } = await import("/gpu.js");
  const { FfnBlock, sliceColumns } = await import("/ffn.js");
  const f32 = (s) => new Float32Array(Uint8Array.from(atob(s), (c) => c.charCodeAt(0)).buffer);
  const ctx = await GpuContext.create({ maxBinding, workgroupSize, lanes: lanes ?? undefined, subgroups: subgroups ?? undefined });
  const u8 = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
  const outs = [], gpuBytes = [];
  for (const [a, b] of ranges ?? [[0, f]]) {
    let args;
    if (blocks) {
      args = { wGate: { encoding: blocks, bytes: u8(wg) }, wUp: { encoding: blocks, bytes: u8(wu) },
        wDown: downBlocks === false ? f32(wd) : { encoding: blocks, bytes: u8(wd) } };
    } else {
      const wG = f32(wg), wU = f32(wu), wD = f32(wd);
      args = { wGate: wG.subarray(a * h, b * h), wUp: wU.subarray(a * h, b * h), wDown: sliceColumns(wD, h, f, a, b) };
    }
    const block = new FfnBlock(ctx, { hidden: h, inter: b - a, fmt, ...args });
    const y = await block.run(f32(x), t);
    outs.push(btoa(String.fromCharCode(...new Uint8Array(y.buffer))));
    gpuBytes.push(block.gpuBytes);
  }
  return { outs, gpuBytes, largest: ctx.largestBinding, formats: ctx.formats, maxBinding: ctx.maxBinding,
           lanes: ctx.lanes, subgroups: ctx.subgroups, features: [...ctx.adapter.features] };
}"""


def _run(page, x, wg, wu, wd, fmt, max_binding=None, workgroup_size=None, ranges=None, blocks=None, f=None,
         down_blocks=True, lanes=None, subgroups=None):
    (t, h), f = x.shape, f or wg.shape[0]
    r = page.evaluate(RUN_FFN, dict(x=b64(x), wg=b64(wg), wu=b64(wu), wd=b64(wd), t=t, h=h, f=f, fmt=fmt,
                                    maxBinding=max_binding, workgroupSize=workgroup_size, ranges=ranges,
                                    blocks=blocks, downBlocks=down_blocks, lanes=lanes, subgroups=subgroups))
    r["ys"] = [unb64(o, np.float32).reshape(t, h) for o in r["outs"]]
    return r


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8"])
@pytest.mark.parametrize("shape", [(1, 64, 128), (13, 576, 512)])
def test_swiglu_ffn_in_chromium_matches_twin(page, fmt, shape):
    rng = np.random.default_rng(11)
    x, wg, wu, wd = ffn_block(rng, *shape)
    r = _run(page, x, wg, wu, wd, fmt)
    assert r["formats"] == ["f32", "f16", "q8", *K.BLOCK_FORMATS]  # f16 needs no shader-f16 (SwiftShader lacks it)
    eff = [K.as_format(w, fmt) for w in (wg, wu, wd)]
    assert rel_error(r["ys"][0], K.swiglu_ffn(x, *eff)) <= 1e-5
    assert rel_error(r["ys"][0], K.swiglu_ffn_f64(x, *eff)) <= 1e-5


def test_dense_ranges_and_phone_limits_in_chromium(page):
    # Uneven intermediate ranges with bindings capped at 16 KiB: every partial matches its twin,
    # the partials sum to the whole MLP, and no buffer bound exceeds the cap.
    rng = np.random.default_rng(12)
    x, wg, wu, wd = ffn_block(rng, 11, 576, 250)
    cuts = [0, 37, 128, 250]
    r = _run(page, x, wg, wu, wd, "f32", max_binding=16 << 10, workgroup_size=32,
             ranges=list(zip(cuts, cuts[1:])))
    assert r["largest"] <= 16 << 10
    for (a, b), y in zip(zip(cuts, cuts[1:]), r["ys"]):
        assert rel_error(y, K.dense_range(x, wg[a:b], wu[a:b], np.ascontiguousarray(wd[:, a:b]))) <= 1e-5
    assert rel_error(sum(r["ys"]), K.swiglu_ffn_f64(x, wg, wu, wd)) <= 1e-5


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8"])
def test_js_packing_equals_python(page, fmt):
    rng = np.random.default_rng(13)
    w = rng.standard_normal((7, 10)).astype(np.float32)
    w[3] = 0
    w[4, :3] = [127 * 0.5, -0.25, 63.5]  # exact halves: JS must round half to even like numpy
    r = page.evaluate("""async ({w, fmt}) => {
      const { packMatrix } = await import("/ffn.js");
      const f32 = (s) => new Float32Array(Uint8Array.from(atob(s), (c) => c.charCodeAt(0)).buffer);
      const b = (a) => btoa(String.fromCharCode(...new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
      const m = packMatrix(f32(w), 7, 10, fmt, 100, 8);
      return { data: b(m.data), scale: m.scale ? b(m.scale) : null, parts: m.parts, cols: m.cols };
    }""", dict(w=b64(w), fmt=fmt))
    m = K.pack_matrix(w, fmt, 100, rows=8)
    assert unb64(r["data"], np.uint8).tobytes() == m.data
    assert r["cols"] == m.cols and [tuple(p) for p in r["parts"]] == list(m.parts)
    if fmt == "q8":
        assert unb64(r["scale"], np.float32).tobytes() == m.scale.tobytes()


def test_gpu_errors_fail_the_request_then_recover(page):
    r = page.evaluate("""async () => {
      const { GpuContext, KernelError } = await import("/gpu.js");
      const { FfnBlock } = await import("/ffn.js");
      const ctx = await GpuContext.create();
      const h = 8, f = 12, t = 2;
      const w = (n) => Float32Array.from({ length: n }, (_, i) => Math.sin(i + n));
      const block = new FfnBlock(ctx, { hidden: h, inter: f, fmt: "f32", wGate: w(f * h), wUp: w(f * h + 1).subarray(1), wDown: w(h * f + 2).subarray(2) });
      const x = w(t * h + 3).subarray(3);
      const good = Array.from(await block.run(x, t));
      const out = { good };
      // 1. A validation error inside a request → KernelError, fresh device.
      const gen0 = ctx.generation;
      try {
        await ctx.guarded("a broken request", (dev) => dev.createBuffer({ size: 3, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.STORAGE }));
        out.validation = "no error";
      } catch (e) { out.validation = `${e.name}: ${e.message}`; }
      out.genBumped = ctx.generation > gen0;
      out.afterValidation = Array.from(await block.run(x, t));
      // 2. The device is lost under a live request → that request fails, the next one is right.
      const pending = block.run(x, t);
      ctx.device.destroy();
      try { await pending; out.lost = "no error"; } catch (e) { out.lost = `${e.name}: ${e.message}`; }
      out.afterLost = Array.from(await block.run(x, t));
      // 3. Bad input → KernelError before any GPU work.
      try { await block.run(new Float32Array(t * h).fill(NaN), t); out.nan = "no error"; } catch (e) { out.nan = `${e.name}: ${e.message}`; }
      try { await ctx.pipeline("swiglu", "f64"); out.f64 = "no error"; } catch (e) { out.f64 = `${e.name}: ${e.message}`; }
      return out;
    }""")
    assert r["validation"].startswith("KernelError: GPU error during a broken request"), r["validation"]
    assert r["genBumped"]
    assert r["lost"].startswith("KernelError"), r["lost"]
    assert "NaN" in r["nan"] and r["f64"].startswith("KernelError: unknown weight format f64")
    # Recovery gives exactly the numbers of the first device (same kernel, same adapter).
    assert r["afterValidation"] == r["good"] and r["afterLost"] == r["good"]
    assert any(abs(v) > 1e-3 for v in r["good"])


def test_no_webgpu_is_a_clear_cannot_serve(chromium, web_peer_url):
    # A browser without WebGPU (navigator.gpu hidden, as on an HTTP page or an old browser) → NoWebGPUError.
    from tests.browser.conftest import BLANK
    ctx = chromium.new_context()
    pg = ctx.new_page()
    pg.goto(web_peer_url.rstrip("/") + BLANK)
    r = pg.evaluate("""async () => {
      const { GpuContext } = await import("/gpu.js");
      const saved = Object.getOwnPropertyDescriptor(Navigator.prototype, "gpu");
      Object.defineProperty(Navigator.prototype, "gpu", { get: () => undefined, configurable: true });
      try { await GpuContext.create(); return "created"; } catch (e) { return `${e.name}: ${e.message}`; }
      finally { Object.defineProperty(Navigator.prototype, "gpu", saved); }
    }""")
    ctx.close()
    assert r.startswith("NoWebGPUError: this browser has no WebGPU"), r


BLOCKS_32 = tuple(f for f in K.BLOCK_FORMATS if f not in K.K_FORMATS)


def _raws(rng, fmt, wg, wu, wd):
    """The file's blocks of each matrix: gguf's quantizer, or random K-quant blocks of the same shape."""
    if fmt in K.K_FORMATS:
        return [K.random_blocks(rng, *w.shape, fmt, 2e-4) for w in (wg, wu, wd)]
    return [K.quantize_blocks(w, fmt) for w in (wg, wu, wd)]


@pytest.mark.parametrize("fmt,shape", [(f, s) for f in BLOCKS_32 for s in [(1, 64, 128), (37, 576, 256)]]
                         + [(f, s) for f in K.K_FORMATS for s in [(1, 256, 256), (9, 512, 256)]])
def test_block_ffn_in_chromium_matches_twin_and_gguf(page, fmt, shape):
    # The file's blocks handed to FfnBlock as they are: repacked in JS, computed in the kernels.
    rng = np.random.default_rng(14)
    x, wg, wu, wd = ffn_block(rng, *shape)
    raws = _raws(rng, fmt, wg, wu, wd)
    r = _run(page, x, *raws, "f32", blocks=fmt.upper(), f=shape[2])
    twin = [K.unpack_matrix(K.pack_matrix(raw, fmt, 1 << 30)) for raw in raws]
    assert rel_error(r["ys"][0], K.swiglu_ffn(x, *twin)) <= 1e-5
    gguf64 = [dequantize(raw, GGMLQuantizationType[fmt.upper()]).astype(np.float64) for raw in raws]
    assert rel_error(r["ys"][0], K.swiglu_ffn_f64(x, *gguf64)) <= 1e-5
    # Compact on the GPU: the file's bytes (f = 128, 256 rows: no padding rows).
    assert r["gpuBytes"][0] == sum(raw.nbytes for raw in raws)


@pytest.mark.parametrize("fmt,shape", [("q4_0", (3, 96, 160)), ("q8_0", (9, 96, 160)), ("q4_k", (2, 256, 256)),
                                       ("q6_k", (1, 256, 512))])
@pytest.mark.parametrize("subgroups", [None, False], ids=["default", "shared"])
def test_block_rows_split_across_a_workgroup_in_chromium(page, fmt, shape, subgroups):
    # 8 rows a workgroup of 32 (4 lanes each; H = 96 ends in a part-filled workgroup), through
    # the page's dispatch grid, reduced by default through subgroups where SwiftShader has them,
    # else (and with subgroups off) in workgroup memory.
    rng = np.random.default_rng(17)
    x, wg, wu, wd = ffn_block(rng, *shape)
    raws = _raws(rng, fmt, wg, wu, wd)
    r = _run(page, x, *raws, "f32", blocks=fmt.upper(), f=shape[2], workgroup_size=32, lanes=4, subgroups=subgroups)
    assert r["lanes"] == 4 and r["subgroups"] == (subgroups is None and "subgroups" in r["features"])
    gguf64 = [dequantize(raw, GGMLQuantizationType[fmt.upper()]).astype(np.float64) for raw in raws]
    assert rel_error(r["ys"][0], K.swiglu_ffn_f64(x, *gguf64)) <= 1e-5


def test_q4_1_blocks_with_float_down_in_chromium(page):
    # An unaligned dense range: gate/up Q4_1 blocks, down float32 (two kernel formats in one block).
    rng = np.random.default_rng(15)
    x, wg, wu, wd = ffn_block(rng, 3, 64, 33)
    rg, ru = K.quantize_blocks(wg, "q4_1"), K.quantize_blocks(wu, "q4_1")
    r = _run(page, x, rg, ru, wd, "f32", blocks="Q4_1", f=33, down_blocks=False)
    g64 = [dequantize(a, GGMLQuantizationType.Q4_1).astype(np.float64) for a in (rg, ru)]
    assert rel_error(r["ys"][0], K.swiglu_ffn_f64(x, *g64, wd)) <= 1e-5


@pytest.mark.parametrize("fmt", K.BLOCK_FORMATS)
def test_js_block_packing_equals_python(page, fmt):
    rng = np.random.default_rng(16)
    cols = 3 * K.block_size(fmt)[0]  # an odd block count: the scale plane ends mid-word
    raw = _raws(rng, fmt, *[rng.standard_normal((5, cols)).astype(np.float32)] * 3)[0]
    cap = 2 * K.pack_matrix(raw, fmt, 1 << 20).row_bytes  # parts of two rows
    r = page.evaluate("""async ({raw, fmt, cols, cap}) => {
      const { packBlocks } = await import("/ffn.js");
      const u8 = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
      const b = (a) => btoa(String.fromCharCode(...new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
      const m = packBlocks(u8(raw), 5, cols, fmt, cap, 8);
      let bad;
      try { packBlocks(u8(raw).subarray(1), 5, cols, fmt, cap); } catch (e) { bad = `${e.name}: ${e.message}`; }
      return { data: b(m.data), scale: b(m.scale), parts: m.parts, cols: m.cols, bad };
    }""", dict(raw=b64(raw), fmt=fmt, cols=cols, cap=cap))
    m = K.pack_matrix(raw, fmt, cap, rows=8)
    assert unb64(r["data"], np.uint8).tobytes() == m.data
    assert unb64(r["scale"], np.uint8).tobytes() == m.scale.tobytes()
    assert r["cols"] == m.cols == cols and [tuple(p) for p in r["parts"]] == list(m.parts) and len(m.parts) == 4
    assert r["bad"].startswith("KernelError") and "Uint8Array" in r["bad"]


def test_f16_is_offered_only_where_the_browser_has_float16array(page):
    # The page packs f16 weights with Float16Array; a WebGPU browser without it (Chrome before
    # 135) is offered every other format, and its page then asks f32 (main.js), never a
    # ReferenceError while packing.
    r = page.evaluate("""async () => {
      const gpu = await import("/gpu.js");
      const ctx = await gpu.GpuContext.create();
      const saved = globalThis.Float16Array;
      delete globalThis.Float16Array;
      try { return { with: ctx.formats, without: new gpu.GpuContext(ctx.adapter).formats }; }
      finally { globalThis.Float16Array = saved; }
    }""")
    assert r["with"] == list(K.FORMATS)
    assert r["without"] == [f for f in K.FORMATS if f != "f16"]


def test_page_constants_and_sources_equal_kernels_py(page):
    # One source of truth: gpu.js's constants and the WGSL it compiles (TB rows, or DECODE_TB for
    # a decode dispatch) are kernels.py's; a rows.wgsl without the TB line is refused.
    r = page.evaluate("""async (kernels) => {
      const gpu = await import("/gpu.js");
      const ctx = await gpu.GpuContext.create();
      const srcs = {};
      for (const k of kernels) for (const fmt of ctx.formats) for (const tb of [gpu.TB, gpu.DECODE_TB]) {
        srcs[`${k}/${fmt}/${tb}`] = await ctx.source(k, fmt, tb);
      }
      const fetch0 = globalThis.fetch;
      globalThis.fetch = async (url, ...rest) => {
        const r = await fetch0(url, ...rest);
        return String(url).endsWith("/rows.wgsl") ? new Response((await r.text()).replace("const TB: u32 = 8u;", "const TB: u32 = 4u;")) : r;
      };
      let bad;
      try { await new gpu.GpuContext(ctx.adapter).source("down", "f32", gpu.DECODE_TB); bad = "no error"; } catch (e) { bad = `${e.name}: ${e.message}`; }
      globalThis.fetch = fetch0;
      return { srcs, bad, subgroups: ctx.subgroups, TB: gpu.TB, DECODE_TB: gpu.DECODE_TB,
               MAX: gpu.MAX_WORKGROUPS_PER_DIM, BLOCK_FORMATS: gpu.BLOCK_FORMATS };
    }""", list(K.KERNELS))
    assert (r["TB"], r["DECODE_TB"], r["MAX"]) == (K.TB, K.DECODE_TB, K.MAX_WORKGROUPS_PER_DIM)
    assert r["BLOCK_FORMATS"] == list(K.BLOCK_FORMATS)
    assert len(r["srcs"]) == 2 * 2 * len(K.FORMATS)  # every format, f16 included, on any adapter
    for key, src in r["srcs"].items():
        kernel, fmt, tb = key.split("/")
        if fmt in K.BLOCK_FORMATS and r["subgroups"]:
            src = src.removeprefix("enable subgroups;\n")  # browsers need it, naga rejects it (kernels.py)
        assert src == K.wgsl_source(kernel, fmt, r["subgroups"], int(tb)), key
    assert r["bad"].startswith("KernelError") and "const TB: u32 = 8u;" in r["bad"], r["bad"]


# Runs FfnBlock.run on x [t, h] (rows 0..t) and then on each of `rows` alone, counting the page's
# compute passes and dispatches and recording the TB of each shader module it compiles.
RUN_DECODE_ROWS = """async ({x, wg, wu, wd, t, h, f, fmt, blocks, rows, maxBinding}) => {
  const { GpuContext } = await import("/gpu.js");
  const { FfnBlock } = await import("/ffn.js");
  const f32 = (s) => new Float32Array(Uint8Array.from(atob(s), (c) => c.charCodeAt(0)).buffer);
  const u8 = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
  const b64 = (a) => btoa(String.fromCharCode(...new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
  const count = { passes: 0, dispatches: 0, tbs: [] };
  const wrap = (proto, name, fn) => { const m = proto[name]; proto[name] = function (...a) { fn(...a); return m.apply(this, a); }; };
  wrap(GPUCommandEncoder.prototype, "beginComputePass", () => { count.passes++; });
  wrap(GPUComputePassEncoder.prototype, "dispatchWorkgroups", () => { count.dispatches++; });
  wrap(GPUDevice.prototype, "createShaderModule", (d) => { count.tbs.push(Number(/const TB: u32 = (\\d+)u;/.exec(d.code)?.[1])); });
  const ctx = await GpuContext.create({ maxBinding });
  const w = blocks
    ? { wGate: { encoding: blocks, bytes: u8(wg) }, wUp: { encoding: blocks, bytes: u8(wu) }, wDown: { encoding: blocks, bytes: u8(wd) } }
    : { wGate: f32(wg), wUp: f32(wu), wDown: f32(wd) };
  const block = new FfnBlock(ctx, { hidden: h, inter: f, fmt: "f32", ...w });
  const xs = f32(x);
  const batch = b64(await block.run(xs, t));
  const batchCount = { ...count, tbs: [...count.tbs] };
  const one = [];
  for (const r of rows) one.push(b64(await block.run(xs.slice(r * h, (r + 1) * h), 1)));
  return { batch, one, batchCount, count };
}"""


@pytest.mark.parametrize("fmt", ["f32", *K.BLOCK_FORMATS])
def test_a_decode_row_has_the_bits_it_has_in_a_batch_in_chromium(page, fmt):
    # A one-row request runs kernels built for one row (DECODE_TB), a batch those of TB rows: each
    # row's sum is the same either way, so a sequence's bits do not depend on its batch.
    rng = np.random.default_rng(33)
    x, wg, wu, wd = ffn_block(rng, 5, 256, 256)
    raws = [wg, wu, wd] if fmt == "f32" else _raws(rng, fmt, wg, wu, wd)
    rows = [0, 3]
    r = page.evaluate(RUN_DECODE_ROWS, dict(x=b64(x), wg=b64(raws[0]), wu=b64(raws[1]), wd=b64(raws[2]), t=5, h=256,
                                            f=256, fmt=fmt, blocks=None if fmt == "f32" else fmt.upper(), rows=rows,
                                            maxBinding=None))
    assert sorted(r["batchCount"]["tbs"]) == [K.TB, K.TB]  # swiglu and down
    assert sorted(r["count"]["tbs"]) == [K.DECODE_TB, K.DECODE_TB, K.TB, K.TB]  # compiled once each
    batch = unb64(r["batch"], np.float32).reshape(5, 256)
    for t, one in zip(rows, r["one"]):
        assert np.abs(batch[t]).max() > 1e-3
        assert np.array_equal(unb64(one, np.float32), batch[t]), t


def test_an_ffn_request_encodes_its_dispatches_in_one_compute_pass(page):
    # Bindings capped at 16 KiB: several weight parts, one dispatch each, all in one pass.
    rng = np.random.default_rng(34)
    x, wg, wu, wd = ffn_block(rng, 3, 64, 200)
    r = page.evaluate(RUN_DECODE_ROWS, dict(x=b64(x), wg=b64(wg), wu=b64(wu), wd=b64(wd), t=3, h=64, f=200,
                                            fmt="f32", blocks=None, rows=[1], maxBinding=16 << 10))
    assert r["batchCount"]["passes"] == 1 and r["batchCount"]["dispatches"] > 2
    assert r["count"]["passes"] == 2 and r["count"]["dispatches"] == 2 * r["batchCount"]["dispatches"]
    y = unb64(r["batch"], np.float32).reshape(3, 64)
    assert rel_error(y, K.swiglu_ffn_f64(x, wg, wu, wd)) <= 1e-5
    assert np.array_equal(unb64(r["one"][0], np.float32), y[1])


RUN_BLOCKS = """async ({xs, ws, h, f, rows, maxBinding}) => {
  const { GpuContext } = await import("/gpu.js");
  const { FfnBlock, runBlocks } = await import("/ffn.js");
  const f32 = (s) => new Float32Array(Uint8Array.from(atob(s), (c) => c.charCodeAt(0)).buffer);
  const b64 = (a) => btoa(String.fromCharCode(...new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
  const ctx = await GpuContext.create({ maxBinding });
  const blocks = ws.map(([g, u, d]) => new FfnBlock(ctx, { hidden: h, inter: f, fmt: "f32", wGate: f32(g), wUp: f32(u), wDown: f32(d) }));
  const items = xs.map((x, i) => ({ block: blocks[i], x: f32(x), tRows: rows[i] }));
  for (const it of items) await it.block.run(it.x, it.tRows);  // uploads and pipelines first
  const count = { passes: 0, maps: 0, scopes: 0, submits: 0 };
  const wrap = (proto, name, fn) => { const m = proto[name]; proto[name] = function (...a) { fn(...a); return m.apply(this, a); }; };
  wrap(GPUCommandEncoder.prototype, "beginComputePass", () => { count.passes++; });
  wrap(GPUBuffer.prototype, "mapAsync", () => { count.maps++; });
  wrap(GPUDevice.prototype, "pushErrorScope", () => { count.scopes++; });
  wrap(GPUQueue.prototype, "submit", () => { count.submits++; });
  const together = (await runBlocks(ctx, items)).map(b64);
  const counted = { ...count };
  const alone = [];
  for (const it of items) alone.push(b64(await it.block.run(it.x, it.tRows)));
  return { together, alone, counted };
}"""


@pytest.mark.parametrize("max_binding", [None, 512])
def test_a_requests_blocks_run_in_one_submission_and_one_read_back_in_chromium(page, max_binding):
    # A request's experts (or dense ranges) in one error scope, one submission and one map: each a
    # round trip to the GPU process. Rows past one binding (512 bytes: 2 rows) go block by block. Either
    # way each block's rows have the bits of that block run alone.
    rng = np.random.default_rng(35)
    h, f, rows = 64, 48, [1, 3, 2]
    blocks = [ffn_block(rng, t, h, f) for t in rows]
    r = page.evaluate(RUN_BLOCKS, dict(xs=[b64(b[0]) for b in blocks], ws=[[b64(w) for w in b[1:]] for b in blocks],
                                       h=h, f=f, rows=rows, maxBinding=max_binding))
    one = {"passes": 1, "maps": 1, "scopes": 3, "submits": 1}
    assert (r["counted"] == one) == (max_binding is None), r["counted"]
    for (x, wg, wu, wd), got, alone in zip(blocks, r["together"], r["alone"]):
        y = unb64(got, np.float32).reshape(len(x), h)
        assert rel_error(y, K.swiglu_ffn_f64(x, wg, wu, wd)) <= 1e-5
        assert np.array_equal(y, unb64(alone, np.float32).reshape(len(x), h))
