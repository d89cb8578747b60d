"""web_peer/slices.js decodes shipped weight slices to the same float32 bits as Python's
swarm.peer.weights.slices.decode_slice (gguf-py's dequantize), for every encoding the page knows, and
refuses malformed metas and encodings it does not know."""

from __future__ import annotations

import base64

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from swarm.peer.weights.slices import decode_slice

pytestmark = pytest.mark.browser

DECODE = """async ({blob, meta}) => {
  const { decodeSlice } = await import("/slices.js");
  const b = Uint8Array.from(atob(blob), (c) => c.charCodeAt(0));
  const enc = (a) => { const u = new Uint8Array(a.buffer, a.byteOffset, a.byteLength); let s = "";
    for (let i = 0; i < u.length; i += 8192) s += String.fromCharCode(...u.subarray(i, i + 8192)); return btoa(s); };
  try {
    const s = decodeSlice(b, meta);
    return { gate: enc(s.gate.data), up: enc(s.up.data), down: enc(s.down.data), hidden: s.hidden };
  } catch (e) { return { error: `${e.name}: ${e.message}` }; }
}"""


def dense_slice(encoding: str, r: int = 32, h: int = 64, seed: int = 0):
    """A dense slice of rows [100, 100 + r): gate/up [r, h], down [h, r] (r, h multiples of 32)."""
    rng = np.random.default_rng(seed)
    blob, tensors = b"", []
    for role, shape in (("gate", (r, h)), ("up", (r, h)), ("down", (h, r))):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        raw = a.tobytes() if encoding == "F32" else gguf.quants.quantize(a, GGMLQuantizationType[encoding]).tobytes()
        tensors.append({"role": role, "encoding": encoding, "shape": list(shape), "offset": len(blob), "nbytes": len(raw)})
        blob += raw
    return blob, {"version": 1, "format": "gguf", "spec": {"layer": 2, "kind": "dense", "start": 100, "stop": 100 + r}, "tensors": tensors}


@pytest.mark.parametrize("encoding", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_slice_decodes_bit_for_bit(page, encoding):
    blob, meta = dense_slice(encoding)
    want = decode_slice(blob, meta)
    got = page.evaluate(DECODE, {"blob": base64.b64encode(blob).decode(), "meta": meta})
    assert "error" not in got, got
    for role in ("gate", "up", "down"):
        arr = np.frombuffer(base64.b64decode(got[role]), np.float32).reshape(getattr(want, role).shape)
        assert arr.tobytes() == getattr(want, role).astype(np.float32).tobytes(), f"{encoding} {role}"
    assert got["hidden"] == 64


def test_bad_slices_are_refused(page):
    blob, meta = dense_slice("Q4_1")
    cases = {
        "unknown encoding": {**meta, "tensors": [{**meta["tensors"][0], "encoding": "Q6_K"}] + meta["tensors"][1:]},
        "outside": {**meta, "tensors": [{**meta["tensors"][0], "nbytes": len(blob) + 1}] + meta["tensors"][1:]},
        "order": {**meta, "tensors": meta["tensors"][::-1]},
        "version": {**meta, "version": 2},
        "shapes": {**meta, "spec": {**meta["spec"], "stop": meta["spec"]["stop"] + 1}},
    }
    for what, bad in cases.items():
        got = page.evaluate(DECODE, {"blob": base64.b64encode(blob).decode(), "meta": bad})
        assert got.get("error", "").startswith("SliceError"), (what, got)
    assert "cannot be decoded by the browser peer" in page.evaluate(
        DECODE, {"blob": base64.b64encode(blob).decode(), "meta": cases["unknown encoding"]})["error"]


def test_kernel_blocks_are_kept_as_blocks(page):
    # keepBlocks: Q4_0/Q4_1/Q8_0 tensors come back as the blob's own bytes (no float32 copy), others decode.
    for encoding in ("Q4_0", "Q4_1", "Q8_0", "F16"):
        blob, meta = dense_slice(encoding)
        got = page.evaluate("""async ({blob, meta}) => {
          const { decodeSlice } = await import("/slices.js");
          const b = Uint8Array.from(atob(blob), (c) => c.charCodeAt(0));
          const s = decodeSlice(b, meta, { keepBlocks: true });
          return ["gate", "up", "down"].map((r) => ({ encoding: s[r].encoding ?? null, offset: s[r].bytes ? s[r].bytes.byteOffset : null,
            nbytes: s[r].bytes ? s[r].bytes.length : null, floats: s[r].data ? s[r].data.length : null }));
        }""", {"blob": base64.b64encode(blob).decode(), "meta": meta})
        for t, g in zip(meta["tensors"], got):
            if encoding == "F16":
                assert g == {"encoding": None, "offset": None, "nbytes": None, "floats": int(np.prod(t["shape"]))}
            else:
                assert g == {"encoding": encoding, "offset": t["offset"], "nbytes": t["nbytes"], "floats": None}


INSTALL = """async ({blob, meta, x, t, keys}) => {
  const { GpuContext } = await import("/gpu.js");
  const { BrowserWorker } = await import("/worker.js");
  const { decodeSlice } = await import("/slices.js");
  const u8 = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
  const w = new BrowserWorker(await GpuContext.create(), { peerId: "p" });
  w._install(decodeSlice(u8(blob), meta, { keepBlocks: true }));
  const xs = new Float32Array(u8(x).buffer);
  const out = {};
  for (const key of keys) {
    const b = w.blocks.get(key);
    const y = await b.run(xs, t);
    out[key] = { fmt: b.fmt, downFmt: b.downFmt, gpuBytes: b.gpuBytes,
      y: btoa(String.fromCharCode(...new Uint8Array(y.buffer))) };
  }
  return out;
}"""


def _slice(kind, encodings, shapes, start=0, seed=3):
    """A slice of the given encodings: gguf's quantizer, or random blocks for the K-quants (which it cannot write)."""
    from web_peer import kernels as K

    rng = np.random.default_rng(seed)
    blob, tensors = b"", []
    for role, enc, shape in zip(("gate", "up", "down"), encodings, shapes):
        if enc.lower() in K.K_FORMATS:
            raw = K.random_blocks(rng, int(np.prod(shape[:-1])), shape[-1], enc.lower(), 2e-4).tobytes()
        else:
            a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            raw = gguf.quants.quantize(a.reshape(-1, shape[-1]), GGMLQuantizationType[enc]).tobytes()
        tensors.append({"role": role, "encoding": enc, "shape": list(shape), "offset": len(blob), "nbytes": len(raw)})
        blob += raw
    n = shapes[0][0]
    return blob, {"version": 1, "format": "gguf", "spec": {"layer": 4, "kind": kind, "start": start, "stop": start + n}, "tensors": tensors}


def test_worker_installs_block_slices(page):
    # The page's BrowserWorker on real slices: experts whose gate/up are Q4_1 and down Q8_0 stay in
    # their blocks (each expert's share of the bytes); a dense range whose gate (Q4_0) and up (Q8_0)
    # differ goes as float32 for gate/up (one swiglu kernel reads both), down stays Q8_0.
    from web_peer import kernels as K

    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    cases = [
        (_slice("experts", ("Q4_1", "Q4_1", "Q8_0"), [(3, 96, 64), (3, 96, 64), (3, 64, 96)], start=5),
         {f"4/expert/{5 + i}": (i, "q4_1", "q8_0") for i in range(3)}),
        (_slice("dense", ("Q4_0", "Q8_0", "Q8_0"), [(96, 64), (96, 64), (64, 96)], start=32),
         {"4/dense/32/128": (None, "f32", "q8_0")}),
    ]
    _check_installed(page, cases, x)


def _check_installed(page, cases, x):
    """Install each (slice, {block key: (expert index or None, fmt, down fmt)}) in the page's
    BrowserWorker: each block's formats, and its answer on x against gguf's weights in float64;
    experts' blocks hold the slice's bytes, nothing added."""
    from web_peer import kernels as K

    t, h = x.shape
    for (blob, meta), want in cases:
        got = page.evaluate(INSTALL, {"blob": base64.b64encode(blob).decode(), "meta": meta,
                                      "x": base64.b64encode(x.tobytes()).decode(), "t": t, "keys": list(want)})
        w = decode_slice(blob, meta)
        for key, (i, fmt, down_fmt) in want.items():
            g = got[key]
            assert (g["fmt"], g["downFmt"]) == (fmt, down_fmt), key
            gate, up, down = (w.gate, w.up, w.down) if i is None else (w.gate[i], w.up[i], w.down[i])
            y = np.frombuffer(base64.b64decode(g["y"]), np.float32).reshape(t, h)
            ref = K.swiglu_ffn_f64(x, gate, up, down)
            assert np.abs(y - ref).max() / np.abs(ref).max() <= 1e-5, key
        if meta["spec"]["kind"] == "experts" or all(v[1] != "f32" for v in want.values()):
            assert sum(g["gpuBytes"] for g in got.values()) == len(blob)  # the blocks, nothing added


def test_worker_installs_k_quant_slices(page):
    # Q4_K_M's mix: gate/up Q4_K, down Q6_K (and Q5_K experts) stay in the file's super-blocks on
    # the GPU, the bytes as shipped; the answers equal gguf-py's dequantization in float64. Without
    # keepBlocks a K-quant cannot be decoded to float32 by the page, and says so.
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    cases = [
        (_slice("dense", ("Q4_K", "Q4_K", "Q6_K"), [(512, 256), (512, 256), (256, 512)], start=256, seed=5),
         {"4/dense/256/768": (None, "q4_k", "q6_k")}),
        (_slice("experts", ("Q5_K", "Q5_K", "Q4_K"), [(2, 256, 256), (2, 256, 256), (2, 256, 256)], start=1, seed=5),
         {f"4/expert/{1 + i}": (i, "q5_k", "q4_k") for i in range(2)}),
    ]
    _check_installed(page, cases, x)
    blob, meta = cases[0][0]
    r = page.evaluate(DECODE, {"blob": base64.b64encode(blob).decode(), "meta": meta})
    assert r["error"].startswith("SliceError") and "Q4_K" in r["error"]
