// The wire protocol of colibri-swarm in the browser: frames, fragments and typed messages.
//
// Theory of operation (the specification is docs/protocol.md; the Python twin is
// swarm/peer/net/wire.py + swarm/peer/net/messages.py; both decode tests/vectors/ byte for byte):
// - a frame is a 24-byte header, UTF-8 JSON metadata, a tensor table and 8-byte aligned tensor
//   blocks, viewed zero-copy as typed arrays when aligned;
// - frames above the remote's SCTP max-message-size travel as fragments (Fragmenter) and are
//   put back together with bounded buffers (Reassembler);
// - a message is one kind's plain fields in the JSON plus its tensors in field order; every value
//   is checked against the kind's schema (type, range, length, cross-field rules) before use.
// Sans-I/O: bytes and `now` (seconds) in, bytes and messages out. Errors: FrameError,
// ReassemblyError, VersionMismatchError, MessageError (each names the field), LocalProtocolError
// for a message we cannot encode.

export const PROTOCOL_VERSION = 3;
export const FRAME_MAGIC = 0x5753_4c43;     // "CLSW" little-endian
export const FRAGMENT_MAGIC = 0x4653_4c43;  // "CLSF"
export const HEADER_BYTES = 24;
export const FRAGMENT_HEADER_BYTES = 24;
export const ALIGN = 8;
export const MAX_FRAME_BYTES = 64 * 1024 * 1024;
export const MAX_META_BYTES = 1024 * 1024;
export const MAX_TENSORS = 16;
export const MAX_RANK = 4;
export const DEFAULT_REMOTE_MAX_MESSAGE_SIZE = 65536;
export const MAX_STR = 4096;
export const MAX_INT = Number.MAX_SAFE_INTEGER;  // 2**53 - 1
export const MAX_GPU_MEMORY = 2 ** 50;  // the most GPU memory a Hello may announce (bytes; messages.py)

class WireError extends Error {
  constructor(message) { super(message); this.name = this.constructor.name; }
}
/** A frame that breaks the layout rules (docs/protocol.md §2). */
export class FrameError extends WireError {}
/** A fragment sequence that breaks §3, or a receive limit exceeded. */
export class ReassemblyError extends WireError {}
/** The other side speaks another protocol version. */
export class VersionMismatchError extends WireError {}
/** Metadata or tensors that break a kind's schema (§4, §5). */
export class MessageError extends WireError {}
/** We tried to send something the protocol does not allow (a bug on our side). */
export class LocalProtocolError extends WireError {}

// dtype code → [name, typed array constructor, itemsize]; f16/bf16 travel as raw u16 words.
export const DTYPES = {
  1: ["f32", Float32Array, 4],
  2: ["f16", Uint16Array, 2],
  3: ["bf16", Uint16Array, 2],
  4: ["i32", Int32Array, 4],
  5: ["u8", Uint8Array, 1],
};
const CODE_BY_NAME = Object.fromEntries(Object.entries(DTYPES).map(([c, [n]]) => [n, Number(c)]));

const pad = (n) => (ALIGN - (n % ALIGN)) % ALIGN;
const utf8 = new TextEncoder();
const fromUtf8 = new TextDecoder("utf-8", { fatal: true });

function asBytes(data) {
  if (data instanceof Uint8Array) return data;
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  throw new FrameError(`expected binary data, got ${typeof data}`);
}

/**
 * Lay out one frame. tensors: [{dtype: "f32"|"f16"|"bf16"|"i32"|"u8", shape: number[], data: TypedArray}].
 * Returns a Uint8Array. Throws LocalProtocolError when a receiver limit would be broken.
 */
export function encodeFrame(kind, meta, tensors = [], requestId = 0) {
  const metaBytes = typeof meta === "string" ? utf8.encode(meta) : asBytes(meta);
  if (metaBytes.length > MAX_META_BYTES) throw new LocalProtocolError(`metadata of ${metaBytes.length} bytes exceeds ${MAX_META_BYTES}`);
  if (tensors.length > MAX_TENSORS) throw new LocalProtocolError(`${tensors.length} tensors exceed ${MAX_TENSORS}`);
  const tableAt = HEADER_BYTES + metaBytes.length + pad(metaBytes.length);
  const tableLen = tensors.reduce((s, t) => s + 8 + 4 * t.shape.length, 0);
  let offset = tableAt + tableLen + pad(tableLen);
  const blocks = [];
  for (const t of tensors) {
    const code = CODE_BY_NAME[t.dtype];
    if (!code) throw new LocalProtocolError(`dtype ${t.dtype} cannot travel on the wire`);
    if (t.shape.length > MAX_RANK) throw new LocalProtocolError(`rank ${t.shape.length} exceeds ${MAX_RANK}`);
    const n = t.shape.reduce((a, b) => a * b, 1);
    const ctor = DTYPES[code][1];
    if (!(t.data instanceof ctor) || t.data.length !== n) {
      throw new LocalProtocolError(`tensor data must be a ${ctor.name} of ${n} elements for ${t.dtype}${JSON.stringify(t.shape)}`);
    }
    blocks.push({ code, shape: t.shape, offset, bytes: new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength) });
    offset += t.data.byteLength + pad(t.data.byteLength);
  }
  if (offset > MAX_FRAME_BYTES) throw new LocalProtocolError(`frame of ${offset} bytes exceeds ${MAX_FRAME_BYTES}`);
  const out = new Uint8Array(offset);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, FRAME_MAGIC, true);
  dv.setUint16(4, PROTOCOL_VERSION, true);
  dv.setUint16(6, kind, true);
  dv.setUint16(8, 0, true);
  dv.setUint16(10, tensors.length, true);
  dv.setUint32(12, requestId, true);
  dv.setUint32(16, metaBytes.length, true);
  dv.setUint32(20, offset, true);
  out.set(metaBytes, HEADER_BYTES);
  let pos = tableAt;
  for (const b of blocks) {
    dv.setUint8(pos, b.code);
    dv.setUint8(pos + 1, b.shape.length);
    dv.setUint16(pos + 2, 0, true);
    dv.setUint32(pos + 4, b.offset, true);
    b.shape.forEach((d, i) => dv.setUint32(pos + 8 + 4 * i, d, true));
    pos += 8 + 4 * b.shape.length;
    out.set(b.bytes, b.offset);
  }
  return out;
}

function checkZero(buf, start, stop, what) {
  for (let i = start; i < stop; i++) if (buf[i] !== 0) throw new FrameError(`non-zero padding bytes after the ${what} at offset ${start}`);
}

/**
 * Parse and check one frame (docs/protocol.md §2, the receiver's rules in order).
 * Returns {kind, requestId, meta: Uint8Array, tensors: [{dtype, shape, data}]}; tensor data are
 * zero-copy views when aligned in memory, copies otherwise.
 */
export function decodeFrame(data, maxFrameBytes = MAX_FRAME_BYTES) {
  const buf = asBytes(data);
  if (buf.length < HEADER_BYTES) throw new FrameError(`frame of ${buf.length} bytes is shorter than the ${HEADER_BYTES}-byte header`);
  const dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  const magic = dv.getUint32(0, true), version = dv.getUint16(4, true), kind = dv.getUint16(6, true);
  const flags = dv.getUint16(8, true), nTensors = dv.getUint16(10, true), requestId = dv.getUint32(12, true);
  const metaLen = dv.getUint32(16, true), frameLen = dv.getUint32(20, true);
  if (magic !== FRAME_MAGIC) throw new FrameError(`bad frame magic 0x${magic.toString(16)}, expected "CLSW"`);
  if (version !== PROTOCOL_VERSION) {
    throw new VersionMismatchError(`the other peer speaks protocol version ${version}; this page speaks version ${PROTOCOL_VERSION}: reload the page from the swarm's current server`);
  }
  if (flags !== 0) throw new FrameError(`unknown frame flags 0x${flags.toString(16)}`);
  if (frameLen !== buf.length) throw new FrameError(`frame length field says ${frameLen} bytes but ${buf.length} arrived`);
  if (frameLen > maxFrameBytes) throw new FrameError(`frame of ${frameLen} bytes exceeds the limit of ${maxFrameBytes}`);
  if (nTensors > MAX_TENSORS) throw new FrameError(`${nTensors} tensors exceed the limit of ${MAX_TENSORS}`);
  if (metaLen > MAX_META_BYTES) throw new FrameError(`metadata of ${metaLen} bytes exceeds the limit of ${MAX_META_BYTES}`);
  let pos = HEADER_BYTES + metaLen;
  if (pos + pad(metaLen) > frameLen) throw new FrameError(`metadata length ${metaLen} runs past the end of the frame`);
  const meta = buf.subarray(HEADER_BYTES, pos);
  checkZero(buf, pos, pos + pad(metaLen), "metadata");
  pos += pad(metaLen);
  const specs = [];
  for (let i = 0; i < nTensors; i++) {
    if (pos + 8 > frameLen) throw new FrameError(`tensor table entry ${i} runs past the end of the frame`);
    const code = dv.getUint8(pos), rank = dv.getUint8(pos + 1), reserved = dv.getUint16(pos + 2, true), offset = dv.getUint32(pos + 4, true);
    pos += 8;
    if (!(code in DTYPES)) throw new FrameError(`tensor ${i}: unknown dtype code ${code}`);
    if (rank > MAX_RANK) throw new FrameError(`tensor ${i}: rank ${rank} exceeds the limit of ${MAX_RANK}`);
    if (reserved !== 0) throw new FrameError(`tensor ${i}: reserved field is ${reserved}, must be 0`);
    if (pos + 4 * rank > frameLen) throw new FrameError(`tensor ${i}: dims run past the end of the frame`);
    const shape = [];
    for (let d = 0; d < rank; d++) shape.push(dv.getUint32(pos + 4 * d, true));
    pos += 4 * rank;
    specs.push({ i, code, shape, offset });
  }
  const tableEnd = pos;
  pos += pad(pos);
  if (pos > frameLen) throw new FrameError("tensor table padding runs past the end of the frame");
  checkZero(buf, tableEnd, pos, "tensor table");
  const tensors = [];
  for (const { i, code, shape, offset } of specs) {
    if (offset !== pos) throw new FrameError(`tensor ${i}: data offset ${offset}, expected ${pos} (blocks are packed in order)`);
    const [name, ctor, size] = DTYPES[code];
    const count = shape.reduce((a, b) => a * b, 1);
    const nbytes = size * count;
    const end = pos + nbytes + pad(nbytes);
    if (end > frameLen) throw new FrameError(`tensor ${i}: shape [${shape}] x ${size} bytes runs past the end of the frame`);
    const at = buf.byteOffset + pos;
    const view = at % size === 0
      ? new ctor(buf.buffer, at, count)
      : new ctor(buf.slice(pos, pos + nbytes).buffer);  // unaligned in memory: copy
    tensors.push({ dtype: name, shape, data: view });
    checkZero(buf, pos + nbytes, end, `tensor ${i} data`);
    pos = end;
  }
  if (pos !== frameLen) throw new FrameError(`${frameLen - pos} trailing bytes after the last section`);
  return { kind, requestId, meta, tensors };
}

/** The remote's SCTP max-message-size from its SDP (RFC 8841); 65536 when absent. */
export function maxMessageSizeFromSdp(sdp) {
  const m = /^a=max-message-size:(\d+)\s*$/m.exec(sdp);
  if (!m) return DEFAULT_REMOTE_MAX_MESSAGE_SIZE;
  const size = Number(m[1]);
  return size > 0 ? size : MAX_FRAME_BYTES + FRAGMENT_HEADER_BYTES;
}

/** Splits frames above the remote's max-message-size into fragments (§3). */
export class Fragmenter {
  constructor(maxMessageSize = DEFAULT_REMOTE_MAX_MESSAGE_SIZE) {
    if (maxMessageSize < 1024) throw new LocalProtocolError(`max message size ${maxMessageSize} is below 1024`);
    this.maxMessageSize = maxMessageSize;
    this.nextId = 0;
  }

  /** The data-channel messages (Uint8Array) that carry `frame`. */
  split(frame) {
    if (frame.length <= this.maxMessageSize) return [frame];
    const step = this.maxMessageSize - FRAGMENT_HEADER_BYTES;
    const count = Math.ceil(frame.length / step);
    const id = this.nextId;
    this.nextId = (this.nextId + 1) >>> 0;
    const out = [];
    for (let i = 0; i < count; i++) {
      const payload = frame.subarray(i * step, (i + 1) * step);
      const msg = new Uint8Array(FRAGMENT_HEADER_BYTES + payload.length);
      const dv = new DataView(msg.buffer);
      dv.setUint32(0, FRAGMENT_MAGIC, true);
      dv.setUint16(4, PROTOCOL_VERSION, true);
      dv.setUint16(6, 0, true);
      dv.setUint32(8, id, true);
      dv.setUint32(12, i, true);
      dv.setUint32(16, count, true);
      dv.setUint32(20, frame.length, true);
      msg.set(payload, FRAGMENT_HEADER_BYTES);
      out.push(msg);
    }
    return out;
  }
}

/**
 * Receiver side of §3 with bounded memory: at most maxInflight messages, maxBufferedBytes in
 * all, maxFrameBytes each; a message with no fragment for abandonS seconds is dropped.
 */
export class Reassembler {
  constructor({ maxFrameBytes = MAX_FRAME_BYTES, maxInflight = 4, maxBufferedBytes = 2 * MAX_FRAME_BYTES, abandonS = 30 } = {}) {
    Object.assign(this, { maxFrameBytes, maxInflight, maxBufferedBytes, abandonS });
    this.partial = new Map();
  }

  get bufferedBytes() {
    let s = 0;
    for (const p of this.partial.values()) s += p.buf.length;
    return s;
  }

  /** One data-channel message in; a whole frame (Uint8Array) out when complete, else null. */
  feed(data, now) {
    const msg = asBytes(data);
    if (msg.length < 4) throw new FrameError(`message of ${msg.length} bytes is neither a frame nor a fragment`);
    const dv = new DataView(msg.buffer, msg.byteOffset, msg.byteLength);
    const magic = dv.getUint32(0, true);
    if (magic === FRAME_MAGIC) return msg;
    if (magic !== FRAGMENT_MAGIC) throw new FrameError(`message starts with 0x${magic.toString(16)}: neither a frame nor a fragment`);
    if (msg.length <= FRAGMENT_HEADER_BYTES) throw new ReassemblyError(`fragment of ${msg.length} bytes carries no payload`);
    const version = dv.getUint16(4, true), flags = dv.getUint16(6, true), mid = dv.getUint32(8, true);
    const index = dv.getUint32(12, true), count = dv.getUint32(16, true), total = dv.getUint32(20, true);
    const payload = msg.subarray(FRAGMENT_HEADER_BYTES);
    if (version !== PROTOCOL_VERSION || flags !== 0) throw new ReassemblyError(`fragment of version ${version} / flags ${flags}; expected ${PROTOCOL_VERSION} / 0`);
    const part = this.partial.get(mid);
    if (!part) return this._start(mid, index, count, total, payload, now);
    const last = index === count - 1;
    const want = last ? part.buf.length - part.filled : part.step;
    if (index !== part.nextIndex || count !== part.count || total !== part.buf.length || payload.length !== want) {
      this.partial.delete(mid);
      throw new ReassemblyError(`message ${mid}: fragment ${index}/${count} of ${total} bytes (${payload.length} payload) does not follow fragment ${part.nextIndex - 1}/${part.count}`);
    }
    part.buf.set(payload, part.filled);
    part.filled += want;
    part.nextIndex += 1;
    part.lastS = now;
    if (last) { this.partial.delete(mid); return part.buf; }
    return null;
  }

  _start(mid, index, count, total, payload, now) {
    const step = payload.length;
    if (index !== 0) throw new ReassemblyError(`message ${mid}: fragment ${index} arrived before fragment 0`);
    if (count < 2) throw new ReassemblyError(`message ${mid}: fragment count ${count}; a whole frame is sent unfragmented`);
    if (total > this.maxFrameBytes) throw new ReassemblyError(`message ${mid}: ${total} bytes exceed the frame limit of ${this.maxFrameBytes}`);
    if (!(step * (count - 1) < total && total <= step * count)) throw new ReassemblyError(`message ${mid}: ${count} fragments of ${step} bytes cannot make ${total} bytes`);
    if (this.partial.size >= this.maxInflight) throw new ReassemblyError(`message ${mid}: more than ${this.maxInflight} fragmented messages in flight`);
    if (this.bufferedBytes + total > this.maxBufferedBytes) throw new ReassemblyError(`message ${mid}: ${total} more bytes would exceed the receive buffer of ${this.maxBufferedBytes}`);
    const buf = new Uint8Array(total);
    buf.set(payload, 0);
    this.partial.set(mid, { buf, count, step, nextIndex: 1, filled: step, lastS: now });
    return null;
  }

  /** Drop messages abandoned mid-way; returns their ids. */
  handleTimer(now) {
    const dropped = [];
    for (const [mid, p] of this.partial) if (now - p.lastS >= this.abandonS) dropped.push(mid);
    for (const mid of dropped) this.partial.delete(mid);
    return dropped;
  }
}

// ---- messages (docs/protocol.md §4-5; swarm/peer/net/messages.py) ---------------------------------

export const PEER_ID_RE = /^[a-z2-7]{26}$/;
export const HEX64_RE = /^[0-9a-f]{64}$/;

const ROWS = { tensor: { dtypes: ["f32"], rank: 2 } };
const IDS = { tensor: { dtypes: ["i32"], rank: 1 } };
const PAIR = { pair: ["int", "int"] };
const BUILD = { record: [["package", "str"], ["numpy", "str"], ["blas", "str"], ["arch", "str"], ["kernel_dtype", "str"]] };
// Where a slice can also be fetched over HTTPS (Range requests; swarm/peer/weights/slice_http.py).
const HTTPS_SOURCE = { record: [["urls", { list: "str" }], ["cert_sha256", "str"], ["token", "str"]] };
const STAGE = { record: [["peer", "str"], ["layer_start", "int"], ["layer_stop", "int"]] };
const ASSIGNMENT = { record: [["layer", "int"], ["peer", "str"], ["experts", { list: "int" }], ["dense", { list: PAIR }]] };

// Why a page stands by (a Standby: the plan gives it no work) and the cap on its sentence.
export const STANDBY_REASONS = ["fits_python_peers", "too_slow", "too_little_memory", "slow_link", "layout_excludes_pages", "failed_recently", "other_numerics"];
export const STANDBY_MESSAGE_MAX = 200;

class Invalid extends Error {}
const fail = (msg) => { throw new Invalid(msg); };
const peerId = (v, where) => { if (!PEER_ID_RE.test(v)) fail(`${where}: ${JSON.stringify(v).slice(0, 40)} is not a peer id (26 characters a-z, 2-7)`); };
const hex64 = (v, where) => { if (!HEX64_RE.test(v)) fail(`${where}: expected 64 lower-case hex digits, got ${JSON.stringify(v).slice(0, 80)}`); };
const ranges = (rs, where) => rs.forEach(([a, b], i) => { if (!(a < b)) fail(`${where}[${i}]: empty range [${a}, ${b})`); });

function expertRows(m, rowsField) {
  const ids = m.expert_ids.data, counts = m.row_counts.data;
  if (ids.length !== counts.length) fail(`expert_ids [${ids.length}] and row_counts [${counts.length}] differ in length`);
  if (ids.some((v) => v < 0) || new Set(ids).size !== ids.length) fail("expert_ids must be distinct and non-negative");
  if (counts.some((v) => v < 0)) fail("row_counts must be non-negative");
  const sum = counts.reduce((a, b) => a + b, 0);
  if (sum !== m[rowsField].shape[0]) fail(`row_counts sum to ${sum} but ${rowsField} has ${m[rowsField].shape[0]} rows`);
}

// FFN answers; an int8 swarm's GPU peer adds the int8 rows its down products took
// (swarm/peer/net/messages.py ExpertAnswerInt8, DenseAnswerInt8: a page never sends them).
const EXPERT_ANSWER = [["term", "int"], ["plan_version", "int"], ["layer", "int"], ["expert_ids", IDS], ["row_counts", IDS], ["outputs", ROWS]];
const DENSE_ANSWER = [["term", "int"], ["plan_version", "int"], ["layer", "int"], ["ranges", { list: PAIR }], ["partials", { tensor: { dtypes: ["f32"], rank: 3 } }]];
const DOWN_ROWS = { tensor: { dtypes: ["u8"], rank: 2 } };
const INT8_ROW_ALIGN = 64;
function denseAnswer(m) {
  ranges(m.ranges, "ranges");
  if (m.partials.shape[0] !== m.ranges.length) fail(`${m.partials.shape[0]} partials for ${m.ranges.length} ranges`);
}
function downRows(rows, n, where) {
  if (rows.shape[0] !== n) fail(`down_rows has ${rows.shape[0]} rows but ${where} has ${n}`);
  if (rows.shape[1] === 0 || rows.shape[1] % INT8_ROW_ALIGN) fail(`down_rows: rows of ${rows.shape[1]} bytes, expected a positive multiple of ${INT8_ROW_ALIGN}`);
}

// Runs of rows that belong to one sequence of the step (positive, summing to the rows; none
// crosses two experts' rows). The WGSL kernels compute every row on its own, so they need no more.
function segments(m, n, counts) {
  const seg = m.segments.data;
  if (seg.some((v) => v <= 0)) fail("segments must be positive row counts");
  const total = seg.reduce((a, b) => a + b, 0);
  if (total !== n) fail(`segments sum to ${total} but the request has ${n} rows`);
  if (counts) {
    const cuts = new Set();
    seg.reduce((a, b) => { cuts.add(a + b); return a + b; }, 0);
    let end = 0;
    for (const c of counts) { end += c; if (c > 0 && !cuts.has(end)) fail("a segment crosses the boundary between two experts' rows"); }
  }
}

// The sequences of a stage step: consecutive runs of x's rows, each of one sequence.
const STAGE_SEGMENT = { record: [["sequence", "int"], ["start", "int"], ["rows", "int"]] };
const STAGE_ROWS = [["term", "int"], ["plan_version", "int"], ["segments", { list: STAGE_SEGMENT }], ["layer_start", "int"], ["layer_stop", "int"], ["x", ROWS]];
const STAGE_ANSWER = [...STAGE_ROWS.slice(0, 5), ["compute_s", "float"], STAGE_ROWS[5]];
function stageRows(m) {
  if (m.layer_stop <= m.layer_start) fail(`layers [${m.layer_start}, ${m.layer_stop}): empty range`);
  if (m.x.shape[0] === 0) fail("x: at least one row");
  if (!m.segments.length) fail("segments: at least one sequence");
  if (m.segments.some((s) => s.rows === 0)) fail("segments: every sequence needs at least one row");
  if (new Set(m.segments.map((s) => s.sequence)).size !== m.segments.length) fail("segments: a sequence appears twice");
  const total = m.segments.reduce((a, s) => a + s.rows, 0);
  if (total !== m.x.shape[0]) fail(`segments hold ${total} rows but x has ${m.x.shape[0]}`);
}

/** kind number → {name, rid: has request_id, fields: [[name, type]...] in wire order, check}. */
export const KINDS = {
  1: { name: "AuthHello", fields: [["peer_id", "str"], ["nonce", "str"]], check: (m) => { peerId(m.peer_id, "peer_id"); hex64(m.nonce, "nonce"); } },
  2: { name: "AuthProof", fields: [["key_mac", "str"], ["channel_mac", "str"]], check: (m) => { hex64(m.key_mac, "key_mac"); hex64(m.channel_mac, "channel_mac"); } },
  3: {
    name: "Hello",
    fields: [["peer_id", "str"], ["protocol_version", "int"], ["build", BUILD], ["model_hash", { nullable: "str" }],
      ["memory_budget", "int"], ["ffn_gflops", "float"], ["peer_kind", { literal: ["python", "browser"] }],
      ["adapter_limits", { map: "int" }], ["adapter_features", { list: "str" }], ["name", "str"],
      ["gpu_memory", "int"]],
    check: (m) => {
      peerId(m.peer_id, "peer_id"); if (m.model_hash !== null) hex64(m.model_hash, "model_hash");
      if (m.gpu_memory > MAX_GPU_MEMORY) fail(`gpu_memory: ${m.gpu_memory} bytes is more than any GPU holds`);
      if (m.gpu_memory && (m.peer_kind !== "python" || !/^wgpu .* adapter:/.test(m.build.blas))) {
        fail("gpu_memory: only a Python peer computing on a GPU announces GPU memory; others send 0");
      }
    },
  },
  4: { name: "LinkHeartbeat", fields: [["seq", "int"], ["sent_s", "float"]] },
  5: { name: "Error", rid: true, fields: [["code", "str"], ["message", "str"]] },
  6: { name: "WeightsHeld", fields: [["plan_version", "int"], ["weight_bytes", "int"]] },
  16: { name: "RequestVote", fields: [["term", "int"], ["candidate", "str"]], check: (m) => peerId(m.candidate, "candidate") },
  17: { name: "Vote", fields: [["term", "int"], ["granted", "bool"]] },
  18: { name: "LeaderHeartbeat", fields: [["term", "int"], ["leader", "str"]], check: (m) => peerId(m.leader, "leader") },
  19: {
    name: "PlanMessage", fields: [["term", "int"], ["version", "int"], ["assignments", { list: ASSIGNMENT }]],
    check: (m) => m.assignments.forEach((a, i) => { peerId(a.peer, `assignments[${i}].peer`); ranges(a.dense, `assignments[${i}].dense`); }),
  },
  20: {
    name: "StagePlan", fields: [["term", "int"], ["version", "int"], ["stages", { list: STAGE }]],
    check: (m) => {
      let at = 0;
      m.stages.forEach((st, i) => {
        peerId(st.peer, `stages[${i}].peer`);
        if (st.layer_start !== at || st.layer_stop <= st.layer_start) fail(`stages[${i}]: layers [${st.layer_start}, ${st.layer_stop}) do not follow the previous stage (expected to start at ${at})`);
        at = st.layer_stop;
      });
    },
  },
  21: {
    name: "Standby", fields: [["term", "int"], ["version", "int"], ["reason", { literal: STANDBY_REASONS }], ["message", "str"]],
    check: (m) => {
      const n = [...m.message].length;  // code points, as Python counts them
      if (n < 1 || n > STANDBY_MESSAGE_MAX) fail(`message: 1..${STANDBY_MESSAGE_MAX} characters, got ${n}`);
      if (/[\x00-\x1f\x7f-\x9f]/.test(m.message)) fail("message: control characters are not allowed");
    },
  },
  32: { name: "ExpertRequest", rid: true, fields: [["term", "int"], ["plan_version", "int"], ["layer", "int"], ["expert_ids", IDS], ["row_counts", IDS], ["rows", ROWS], ["segments", IDS]], check: (m) => { expertRows(m, "rows"); segments(m, m.rows.shape[0], m.row_counts.data); } },
  33: { name: "ExpertAnswer", rid: true, fields: EXPERT_ANSWER, check: (m) => expertRows(m, "outputs") },
  34: {
    name: "DenseRequest", rid: true, fields: [["term", "int"], ["plan_version", "int"], ["layer", "int"], ["ranges", { list: PAIR }], ["x", ROWS], ["segments", IDS]],
    check: (m) => { if (!m.ranges.length) fail("ranges: at least one range"); ranges(m.ranges, "ranges"); segments(m, m.x.shape[0]); },
  },
  35: { name: "DenseAnswer", rid: true, fields: DENSE_ANSWER, check: denseAnswer },
  38: {
    name: "ExpertAnswerInt8", rid: true, fields: [...EXPERT_ANSWER, ["down_rows", DOWN_ROWS]],
    check: (m) => { expertRows(m, "outputs"); downRows(m.down_rows, m.outputs.shape[0], "outputs"); },
  },
  39: {
    name: "DenseAnswerInt8", rid: true, fields: [...DENSE_ANSWER, ["down_rows", DOWN_ROWS]],
    check: (m) => {
      denseAnswer(m);
      if (m.ranges.length !== 1) fail(`an int8 dense answer carries one range, got ${m.ranges.length}`);
      downRows(m.down_rows, m.partials.shape[1], "partials");
    },
  },
  36: { name: "StageRequest", rid: true, fields: STAGE_ROWS, check: stageRows },
  37: { name: "StageAnswer", rid: true, fields: STAGE_ANSWER, check: stageRows },
  48: {
    name: "WeightManifest", rid: true,
    fields: [["model_hash", "str"], ["name", "str"], ["encoding", "str"], ["total_bytes", "int"], ["chunk_bytes", "int"], ["chunk_sha256", { list: "str" }],
      ["https", { nullable: HTTPS_SOURCE }]],
    check: (m) => {
      hex64(m.model_hash, "model_hash");
      if (m.https !== null) {
        hex64(m.https.cert_sha256, "https.cert_sha256");
        hex64(m.https.token, "https.token");
        if (m.https.urls.length < 1 || m.https.urls.length > 16 || !m.https.urls.every((u) => u.startsWith("https://"))) fail("https.urls: 1..16 URLs, each starting with https://");
      }
      if (m.chunk_bytes === 0) fail("chunk_bytes must be positive");
      const n = Math.ceil(m.total_bytes / m.chunk_bytes);
      if (m.chunk_sha256.length !== n) fail(`${m.chunk_sha256.length} chunk digests for ${n} chunks`);
      m.chunk_sha256.forEach((d, i) => hex64(d, `chunk_sha256[${i}]`));
    },
  },
  49: { name: "WeightChunkRequest", rid: true, fields: [["model_hash", "str"], ["name", "str"], ["first", "int"], ["count", "int"]], check: (m) => hex64(m.model_hash, "model_hash") },
  50: {
    name: "WeightChunk", rid: true, fields: [["model_hash", "str"], ["name", "str"], ["offset", "int"], ["sha256", "str"], ["data", { tensor: { dtypes: ["u8"], rank: 1 } }]],
    check: (m) => { hex64(m.model_hash, "model_hash"); hex64(m.sha256, "sha256"); },
  },
};
export const KIND_BY_NAME = Object.fromEntries(Object.entries(KINDS).map(([k, s]) => [s.name, Number(k)]));

function checkValue(v, tp, where) {
  if (tp === "int") {
    if (typeof v !== "number" || !Number.isInteger(v) || v < 0 || v > MAX_INT) fail(`${where}: expected an integer in 0..2**53-1, got ${JSON.stringify(v)?.slice(0, 60)}`);
    return v;
  }
  if (tp === "float") {
    if (typeof v !== "number" || !Number.isFinite(v)) fail(`${where}: expected a finite number, got ${JSON.stringify(v)?.slice(0, 60)}`);
    return v;
  }
  if (tp === "str") {
    if (typeof v !== "string" || v.length > MAX_STR) fail(`${where}: expected a string of at most ${MAX_STR} characters`);
    return v;
  }
  if (tp === "bool") {
    if (typeof v !== "boolean") fail(`${where}: expected true or false, got ${JSON.stringify(v)?.slice(0, 60)}`);
    return v;
  }
  if (tp.literal) {
    if (!tp.literal.includes(v)) fail(`${where}: expected one of ${JSON.stringify(tp.literal)}, got ${JSON.stringify(v)?.slice(0, 60)}`);
    return v;
  }
  if (tp.nullable) return v === null ? null : checkValue(v, tp.nullable, where);
  if (tp.list) {
    if (!Array.isArray(v)) fail(`${where}: expected an array`);
    return v.map((x, i) => checkValue(x, tp.list, `${where}[${i}]`));
  }
  if (tp.pair) {
    if (!Array.isArray(v) || v.length !== 2) fail(`${where}: expected an array of 2 items`);
    return v.map((x, i) => checkValue(x, tp.pair[i], `${where}[${i}]`));
  }
  if (tp.map) {
    if (typeof v !== "object" || v === null || Array.isArray(v)) fail(`${where}: expected an object`);
    return Object.fromEntries(Object.entries(v).map(([k, x]) => [checkValue(k, "str", `${where} key`), checkValue(x, tp.map, `${where}.${k}`)]));
  }
  if (tp.record) {
    if (typeof v !== "object" || v === null || Array.isArray(v)) fail(`${where}: expected an object`);
    const want = tp.record.map(([n]) => n);
    const keys = Object.keys(v);
    if (keys.length !== want.length || !want.every((n) => Object.hasOwn(v, n))) fail(`${where}: keys ${JSON.stringify(keys.sort())} differ from ${JSON.stringify([...want].sort())}`);
    return Object.fromEntries(tp.record.map(([n, t]) => [n, checkValue(v[n], t, `${where}.${n}`)]));
  }
  throw new Error(`unsupported schema type at ${where}`);
}

function checkTensor(t, spec, where) {
  if (!t || !spec.dtypes.includes(t.dtype) || t.shape.length !== spec.rank) {
    fail(`${where}: expected rank ${spec.rank} of ${spec.dtypes.join("/")}, got shape [${t?.shape}] ${t?.dtype}`);
  }
  return t;
}

// JSON as Python writes it (compact, declaration order, floats with ".0" when integral), so an
// encoded message equals the Python encoder's bytes.
function pyJson(v, tp) {
  if (v === null) return "null";
  if (tp === "float") return Number.isInteger(v) && Math.abs(v) < 1e16 ? `${v}.0` : JSON.stringify(v);
  if (tp === "int" || tp === "bool" || tp === "str" || tp.literal) return JSON.stringify(v);
  if (tp.nullable) return pyJson(v, tp.nullable);
  if (tp.list) return `[${v.map((x) => pyJson(x, tp.list)).join(",")}]`;
  if (tp.pair) return `[${v.map((x, i) => pyJson(x, tp.pair[i])).join(",")}]`;
  if (tp.map) return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}:${pyJson(x, tp.map)}`).join(",")}}`;
  if (tp.record) return `{${tp.record.map(([n, t]) => `${JSON.stringify(n)}:${pyJson(v[n], t)}`).join(",")}}`;
  throw new Error("unsupported schema type");
}

/** Encode a message object {kind: name, request_id?, ...fields} into one frame (Uint8Array). */
export function encodeMessage(msg) {
  const kind = KIND_BY_NAME[msg.kind];
  if (kind === undefined) throw new LocalProtocolError(`${msg.kind} is not a wire message kind`);
  const spec = KINDS[kind];
  const plain = [], tensors = [];
  try {
    for (const [name, tp] of spec.fields) {
      if (tp.tensor) tensors.push(checkTensor(msg[name], tp.tensor, name));
      else plain.push(`${JSON.stringify(name)}:${pyJson(checkValue(msg[name], tp, name), tp)}`);
    }
    spec.check?.(msg);
  } catch (e) {
    if (e instanceof Invalid) throw new LocalProtocolError(`${spec.name}: ${e.message}`);
    throw e;
  }
  const rid = spec.rid ? msg.request_id : 0;
  if (!Number.isInteger(rid) || rid < 0 || rid > 0xffffffff) throw new LocalProtocolError(`${spec.name}: request_id must be a u32`);
  return encodeFrame(kind, `{${plain.join(",")}}`, tensors, rid);
}

/** Decode one whole frame into {kind: name, request_id?, ...fields, tensors as {dtype, shape, data}}. */
export function decodeMessage(data, maxFrameBytes = MAX_FRAME_BYTES) {
  const frame = decodeFrame(data, maxFrameBytes);
  const spec = KINDS[frame.kind];
  if (!spec) throw new MessageError(`unknown message kind ${frame.kind}`);
  try {
    let obj;
    try {
      obj = JSON.parse(fromUtf8.decode(frame.meta));
    } catch (e) {
      fail(`metadata is not UTF-8 JSON (${e.message})`.slice(0, 200));
    }
    if (typeof obj !== "object" || obj === null || Array.isArray(obj)) fail("metadata is not a JSON object");
    const plain = spec.fields.filter(([, tp]) => !tp.tensor);
    const tspecs = spec.fields.filter(([, tp]) => tp.tensor);
    const keys = Object.keys(obj);
    const missing = plain.map(([n]) => n).filter((n) => !Object.hasOwn(obj, n));
    const extra = keys.filter((k) => !plain.some(([n]) => n === k));
    if (missing.length || extra.length) fail(`metadata keys differ from the schema (missing ${JSON.stringify(missing)}, unexpected ${JSON.stringify(extra)})`);
    const msg = { kind: spec.name };
    for (const [name, tp] of plain) msg[name] = checkValue(obj[name], tp, name);
    if (frame.tensors.length !== tspecs.length) fail(`${frame.tensors.length} tensors, expected ${tspecs.length}`);
    tspecs.forEach(([name, tp], i) => { msg[name] = checkTensor(frame.tensors[i], tp.tensor, name); });
    if (spec.rid) msg.request_id = frame.requestId;
    else if (frame.requestId !== 0) fail(`request id ${frame.requestId} on a kind that has none (must be 0)`);
    spec.check?.(msg);
    return msg;
  } catch (e) {
    if (e instanceof Invalid) throw new MessageError(`${spec.name} (kind ${frame.kind}): ${e.message}`);
    throw e;
  }
}
