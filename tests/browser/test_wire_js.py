"""web_peer/wire.js against the golden vectors in tests/vectors/ (the Python codec's bytes), inside
headless Chromium: every message kind decodes to the vector's value and re-encodes to the same
bytes; malformed frames raise the same error class; fragments reassemble and split identically."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from swarm import errors
from swarm.peer.net import messages

pytestmark = pytest.mark.browser

VECTORS = Path(__file__).resolve().parents[1] / "vectors"

DECODE = """async ({bins}) => {
  const w = await import("/wire.js");
  const bytes = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
  const b64 = (u8) => { let s = ""; for (let i = 0; i < u8.length; i += 8192) s += String.fromCharCode(...u8.subarray(i, i + 8192)); return btoa(s); };
  const out = {};
  for (const [name, bin] of Object.entries(bins)) {
    try {
      const m = w.decodeMessage(bytes(bin));
      const kind = w.KIND_BY_NAME[m.kind];
      const fields = {}, tensors = {};
      for (const [n, tp] of w.KINDS[kind].fields) {
        if (!tp.tensor) { fields[n] = m[n]; continue; }
        const t = m[n], raw = t.dtype === "f16" || t.dtype === "bf16";
        tensors[n] = { dtype: t.dtype, shape: t.shape, [raw ? "bits" : "data"]: Array.from(t.data) };
      }
      out[name] = { value: { kind, name: m.kind, request_id: m.request_id ?? 0, fields, tensors }, reencoded: b64(w.encodeMessage(m)) };
    } catch (e) {
      out[name] = { error: e.name, message: e.message };
    }
  }
  return out;
}"""


def _b64(p: Path) -> str:
    return base64.b64encode(p.read_bytes()).decode()


def _same_tensor(got: dict, want: dict) -> bool:
    if got["dtype"] != want["dtype"] or got["shape"] != want["shape"]:
        return False
    if want["dtype"] in ("f16", "bf16"):
        return got["bits"] == want["bits"]
    return np.array_equal(np.array(got["data"], np.float64), np.array(want["data"], np.float64))


def test_every_message_vector_decodes_and_reencodes(page):
    bins = {p.stem: _b64(p) for p in sorted((VECTORS / "messages").glob("*.bin"))}
    assert len(bins) >= len(messages.KINDS), "a vector per message kind is expected"
    out = page.evaluate(DECODE, {"bins": bins})
    kinds = set()
    for name, res in out.items():
        want = json.loads((VECTORS / "messages" / f"{name}.json").read_text())
        assert "error" not in res, f"{name}: {res}"
        got = res["value"]
        kinds.add(got["kind"])
        assert (got["kind"], got["name"], got["request_id"]) == (want["kind"], want["name"], want["request_id"]), name
        assert got["fields"] == want["fields"], name
        assert got["tensors"].keys() == want["tensors"].keys(), name
        for t in want["tensors"]:
            assert _same_tensor(got["tensors"][t], want["tensors"][t]), f"{name}.{t}"
        assert base64.b64decode(res["reencoded"]) == (VECTORS / "messages" / f"{name}.bin").read_bytes(), \
            f"{name}: wire.js encodes other bytes than the Python codec"
    assert kinds == set(messages.KINDS), "every message kind has been decoded"


def test_malformed_frames_raise_the_same_error_class(page):
    bins = {p.stem: _b64(p) for p in sorted((VECTORS / "malformed").glob("*.bin"))}
    out = page.evaluate(DECODE, {"bins": bins})
    assert len(out) >= 10
    for name, res in out.items():
        want = json.loads((VECTORS / "malformed" / f"{name}.json").read_text())
        assert res.get("error") == want["error"], f"{name}: {res}"


def test_a_malformed_standby_is_refused_naming_the_field(page):
    # What the page shows when a coordinator sends a bad Standby: the kind and the field, as Python says.
    names = [p.stem for p in sorted((VECTORS / "malformed").glob("standby_*.bin"))]
    assert len(names) >= 5
    out = page.evaluate(DECODE, {"bins": {n: _b64(VECTORS / "malformed" / f"{n}.bin") for n in names}})
    for name, res in out.items():
        what = json.loads((VECTORS / "malformed" / f"{name}.json").read_text())["what"]
        assert res.get("error") == "MessageError" and res["message"].startswith("Standby (kind 21): "), (name, res)
        assert what in res["message"], (name, res)
        with pytest.raises(errors.MessageError) as python:
            messages.decode((VECTORS / "malformed" / f"{name}.bin").read_bytes())
        said = str(python.value).replace("'", '"')  # Python's repr of a list, JSON's in the page
        assert said.split(":")[:2] == res["message"].split(":")[:2], (name, res, said)



def test_an_int8_answer_whose_down_rows_do_not_fit_is_refused_as_python_refuses_it(page):
    # An int8 GPU peer's answers (kinds 38, 39): down_rows a row short or long, rows of 96 or 0
    # bytes, a dense answer of two ranges; wire.js names the fault in Python's words.
    names = [p.stem for p in sorted((VECTORS / "malformed").glob("*_answer_int8_*.bin"))]
    assert len(names) >= 5
    out = page.evaluate(DECODE, {"bins": {n: _b64(VECTORS / "malformed" / f"{n}.bin") for n in names}})
    for name, res in out.items():
        with pytest.raises(errors.MessageError) as python:
            messages.decode((VECTORS / "malformed" / f"{name}.bin").read_bytes())
        assert res.get("error") == "MessageError" and res["message"] == str(python.value), (name, res)

def test_raw_frame_with_every_dtype(page):
    want = json.loads((VECTORS / "frames" / "all_dtypes.json").read_text())
    got = page.evaluate("""async ({bin}) => {
      const w = await import("/wire.js");
      const f = w.decodeFrame(Uint8Array.from(atob(bin), (c) => c.charCodeAt(0)));
      const again = w.encodeFrame(f.kind, f.meta, f.tensors, f.requestId);
      return { kind: f.kind, request_id: f.requestId, meta: new TextDecoder().decode(f.meta),
               tensors: f.tensors.map((t) => ({ dtype: t.dtype, shape: t.shape,
                 [t.dtype === "f16" || t.dtype === "bf16" ? "bits" : "data"]: Array.from(t.data) })),
               same: btoa(String.fromCharCode(...again)) === bin };
    }""", {"bin": _b64(VECTORS / "frames" / "all_dtypes.bin")})
    assert (got["kind"], got["request_id"], got["meta"]) == (want["kind"], want["request_id"], want["meta"])
    assert len(got["tensors"]) == len(want["tensors"])
    for g, w in zip(got["tensors"], want["tensors"]):
        assert _same_tensor(g, w), (g, w)
    assert got["same"]


def test_fragments_reassemble_and_split_like_python(page):
    meta = json.loads((VECTORS / "fragments" / "dense_request.json").read_text())
    parts = [_b64(VECTORS / "fragments" / f"dense_request.{i}.bin") for i in range(meta["count"])]
    got = page.evaluate("""async ({parts, max}) => {
      const w = await import("/wire.js");
      const bytes = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
      const r = new w.Reassembler();
      let frame = null;
      parts.forEach((p, i) => { const f = r.feed(bytes(p), i); if (f) frame = f; });
      const split = new w.Fragmenter(max).split(frame).map((u8) => btoa(String.fromCharCode(...u8)));
      const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", frame));
      // Out of order: fragment 1 before fragment 0 is refused, and the reassembler stays usable.
      const r2 = new w.Reassembler();
      let refused = "";
      try { r2.feed(bytes(parts[1]), 0); } catch (e) { refused = e.name; }
      return { sha: Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join(""), split, refused,
               kind: w.decodeMessage(frame).kind, left: r.partial.size };
    }""", {"parts": parts, "max": meta["max_message_size"]})
    assert got["sha"] == meta["frame_sha256"]
    assert got["split"] == parts
    assert got["kind"] == "DenseRequest" and got["left"] == 0
    assert got["refused"] == "ReassemblyError"


def test_python_decodes_what_wire_js_encodes(page):
    # A message built in the page (not copied from a vector) decodes in Python to the same values.
    got = page.evaluate("""async () => {
      const w = await import("/wire.js");
      const rows = new Float32Array([0.5, -1.25, 3, 1e-3, 7, -8]);
      const m = w.encodeMessage({ kind: "ExpertAnswer", request_id: 77, term: 2, plan_version: 5, layer: 11,
        expert_ids: { dtype: "i32", shape: [2], data: new Int32Array([9, 3]) },
        row_counts: { dtype: "i32", shape: [2], data: new Int32Array([2, 1]) },
        outputs: { dtype: "f32", shape: [3, 2], data: rows } });
      let bad = "";
      try { w.encodeMessage({ kind: "LinkHeartbeat", seq: -1, sent_s: 0 }); } catch (e) { bad = e.name; }
      return { frame: btoa(String.fromCharCode(...m)), bad };
    }""")
    msg = messages.decode(base64.b64decode(got["frame"]))
    assert isinstance(msg, messages.ExpertAnswer)
    assert (msg.request_id, msg.term, msg.plan_version, msg.layer) == (77, 2, 5, 11)
    assert msg.expert_ids.tolist() == [9, 3] and msg.row_counts.tolist() == [2, 1]
    assert np.array_equal(msg.outputs, np.array([[0.5, -1.25], [3, 1e-3], [7, -8]], np.float32))
    assert got["bad"] == "LocalProtocolError"
