// Weight slices shipped by the coordinator, decoded in the page: GGUF Q4_0/Q4_1/Q8_0 and
// Q4_K/Q5_K/Q6_K/IQ4_XS blocks stay blocks (the kernels read them), other encodings decode to float32.
//
// A slice (swarm/peer/weights/slices.py) is one blob of the FFN tensors of one layer — roles gate, up,
// down — in the model file's own encoding, plus a JSON meta:
//   {version: 1, format, spec: {layer, kind: "dense"|"experts", start, stop},
//    tensors: [{role, encoding, shape, offset, nbytes}, ...]}   (gate, up, down in that order)
// dense: gate/up [r, H], down [H, r]; experts: gate/up [n, F, H], down [n, H, F].
// Decoding follows gguf-py's dequantize block for block, in float32, so a slice decodes to the
// same bits as Python's decode_slice (tested). Encodings: F32, F16, BF16, Q8_0, Q4_0, Q4_1, and
// the K-quants Q4_K, Q5_K, Q6_K and IQ4_XS as blocks only (the page announces their kernels in its Hello,
// main.js); the coordinator repacks other types (Q5_x, IQ, ...) to Q8_0 before shipping them.

export class SliceError extends Error {
  constructor(message) { super(message); this.name = "SliceError"; }
}

// ggml type → [weights per block, bytes per block]
export const ENCODINGS = { F32: [1, 4], F16: [1, 2], BF16: [1, 2], Q8_0: [32, 34], Q4_0: [32, 18], Q4_1: [32, 20] };

function f16(bytes, at) {
  return new Float16Array(bytes.buffer.slice(bytes.byteOffset + at, bytes.byteOffset + at + 2))[0];
}

/** Dequantize `n` weights of ggml `encoding` from `bytes` (Uint8Array) into a Float32Array. */
export function dequantize(bytes, encoding, n) {
  const [block, size] = ENCODINGS[encoding] ?? [];
  if (!block) throw new SliceError(`weights in ${encoding} cannot be decoded by the browser peer (it knows ${Object.keys(ENCODINGS).join(", ")})`);
  if (n % block || bytes.length !== (n / block) * size) throw new SliceError(`${n} weights of ${encoding} cannot be ${bytes.length} bytes`);
  const own = bytes.byteOffset % 4 === 0 ? bytes : bytes.slice();
  const out = new Float32Array(n);
  const dv = new DataView(own.buffer, own.byteOffset, own.byteLength);
  switch (encoding) {
    case "F32": for (let i = 0; i < n; i++) out[i] = dv.getFloat32(4 * i, true); break;
    case "F16": out.set(new Float16Array(own.buffer.slice(own.byteOffset, own.byteOffset + 2 * n))); break;
    case "BF16": {  // bfloat16 is the top half of a float32
      const bits = new Uint32Array(out.buffer);
      for (let i = 0; i < n; i++) bits[i] = dv.getUint16(2 * i, true) << 16;
      break;
    }
    default: {
      const d16 = (at) => f16(own, at);
      for (let b = 0, o = 0; o < n; b += size, o += 32) {
        const d = d16(b);
        if (encoding === "Q8_0") {
          for (let j = 0; j < 32; j++) out[o + j] = Math.fround(d * dv.getInt8(b + 2 + j));
        } else if (encoding === "Q4_0") {
          for (let j = 0; j < 16; j++) {
            const q = own[b + 2 + j];
            out[o + j] = Math.fround(d * ((q & 15) - 8));
            out[o + j + 16] = Math.fround(d * ((q >> 4) - 8));
          }
        } else {  // Q4_1: d * q + m, each step rounded to float32 like numpy
          const m = d16(b + 2);
          for (let j = 0; j < 16; j++) {
            const q = own[b + 4 + j];
            out[o + j] = Math.fround(Math.fround(d * (q & 15)) + m);
            out[o + j + 16] = Math.fround(Math.fround(d * (q >> 4)) + m);
          }
        }
      }
    }
  }
  return out;
}

/** ggml types whose blocks the GPU kernels read as they are (gpu.js BLOCK_FORMATS). */
export const KERNEL_BLOCKS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"];
// Super-blocks of 256: [weights, bytes] per block; kept as blocks, never decoded here.
const K_BLOCKS = { Q4_K: [256, 144], Q5_K: [256, 176], Q6_K: [256, 210], IQ4_XS: [256, 136] };

/**
 * Decode a slice: blob (Uint8Array) + meta → {spec, hidden, gate, up, down}, each tensor
 * {shape, data: Float32Array}; with keepBlocks, a tensor of KERNEL_BLOCKS is instead
 * {shape, encoding, bytes: Uint8Array} (its blocks, a view of the blob). Every meta field is
 * checked against the blob; SliceError names what is wrong.
 */
export function decodeSlice(blob, meta, { keepBlocks = false } = {}) {
  if (!meta || meta.version !== 1) throw new SliceError("slice meta: version must be 1");
  const spec = meta.spec;
  if (!spec || !["dense", "experts"].includes(spec.kind) || !Number.isInteger(spec.layer) || !Number.isInteger(spec.start) || !Number.isInteger(spec.stop) || !(0 <= spec.start && spec.start < spec.stop)) {
    throw new SliceError(`slice meta: bad spec ${JSON.stringify(spec).slice(0, 120)}`);
  }
  const tensors = meta.tensors;
  if (!Array.isArray(tensors) || tensors.map((t) => t?.role).join() !== "gate,up,down") throw new SliceError("slice meta: tensors must be gate, up, down in that order");
  const out = { spec };
  for (const t of tensors) {
    const { role, encoding, shape, offset, nbytes } = t;
    if (!Array.isArray(shape) || ![2, 3].includes(shape.length) || !shape.every((s) => Number.isInteger(s) && s > 0)) throw new SliceError(`slice meta: ${role} shape ${JSON.stringify(shape)} must be 2 or 3 positive ints`);
    if (!Number.isInteger(offset) || !Number.isInteger(nbytes) || offset < 0 || offset + nbytes > blob.length) throw new SliceError(`slice meta: ${role} bytes ${offset}+${nbytes} outside the ${blob.length}-byte blob`);
    const n = shape.reduce((a, b) => a * b, 1);
    const bytes = blob.subarray(offset, offset + nbytes);
    if (keepBlocks && KERNEL_BLOCKS.includes(encoding)) {
      const [block, size] = ENCODINGS[encoding] ?? K_BLOCKS[encoding];
      if (shape.at(-1) % block || nbytes !== (n / block) * size) throw new SliceError(`${n} weights of ${encoding} cannot be ${nbytes} bytes`);
      out[role] = { shape, encoding, bytes };
    } else {
      out[role] = { shape, data: dequantize(bytes, encoding, n) };
    }
  }
  const n = spec.stop - spec.start;
  const [g, u, d] = [out.gate.shape, out.up.shape, out.down.shape];
  const ok = spec.kind === "dense"
    ? g.length === 2 && g[0] === n && u.join() === g.join() && d.length === 2 && d[0] === g[1] && d[1] === n
    : g.length === 3 && g[0] === n && u.join() === g.join() && d.length === 3 && d[0] === n && d[1] === g[2] && d[2] === g[1];
  if (!ok) throw new SliceError(`slice meta: shapes gate ${g}, up ${u}, down ${d} disagree with ${spec.kind} [${spec.start}, ${spec.stop})`);
  out.hidden = spec.kind === "dense" ? g[1] : g[2];
  return out;
}
