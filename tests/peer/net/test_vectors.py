"""Golden vectors in tests/vectors/ (shared with the browser peer's tests): decode, re-encode, auth.

Each check compares against the JSON written beside the bytes, not against the code that wrote
them: decoded values are turned into plain JSON shapes here, MACs are recomputed with hmac.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from pathlib import Path

import numpy as np
import pytest

import swarm.errors as errors
from swarm.peer.net import messages as m
from swarm.peer.net import schema
from swarm.peer.net import wire
from swarm.peer.net.auth import ChannelAuth, Role
from swarm.keys.swarmkey import SwarmKey, decode_code

VECTORS = Path(__file__).resolve().parents[2] / "vectors"
MESSAGES = sorted((VECTORS / "messages").glob("*.bin"))
MALFORMED = sorted((VECTORS / "malformed").glob("*.bin"))


def _load(path: Path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


def _plain(v: object) -> object:
    """A decoded field value in JSON shape (tuples → lists, records → objects)."""
    if dataclasses.is_dataclass(v):
        return {k: _plain(x) for k, x in dataclasses.asdict(v).items()}
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _check_tensor(got: np.ndarray, want: dict, where: str) -> None:
    assert wire.dtype_name(got) == want["dtype"], where
    assert list(got.shape) == want["shape"], where
    if want["dtype"] == "bf16":
        values = (got.astype(np.uint32) << 16).view(np.float32)
    else:
        values = got
    np.testing.assert_array_equal(values.reshape(-1).astype(np.float64), np.array(want["data"], np.float64), where)
    if "bits" in want:
        assert got.reshape(-1).view(np.uint16).tolist() == want["bits"], where


def _tensor_from_json(want: dict) -> np.ndarray:
    if want["dtype"] in ("f16", "bf16"):
        a = np.array(want["bits"], np.uint16)
        a = a.view(wire.BF16) if want["dtype"] == "bf16" else a.view(np.float16)
    else:
        a = np.array(want["data"]).astype({"f32": np.float32, "i32": np.int32, "u8": np.uint8}[want["dtype"]])
    return a.reshape(want["shape"])


def test_there_is_a_vector_for_every_kind() -> None:
    kinds = {_load(p)["kind"] for p in MESSAGES}
    assert kinds == set(m.KINDS)


@pytest.mark.parametrize("path", MESSAGES, ids=lambda p: p.stem)
def test_message_vector_decodes_to_its_json(path: Path) -> None:
    want = _load(path)
    msg = m.decode(path.read_bytes())
    assert type(msg).__name__ == want["name"] and type(msg).KIND == want["kind"]
    assert getattr(msg, "request_id", 0) == want["request_id"]
    for name, value in want["fields"].items():
        assert _plain(getattr(msg, name)) == value, name
    for name, t in want["tensors"].items():
        _check_tensor(getattr(msg, name), t, name)
    names = {f.name for f in dataclasses.fields(msg)} - {"request_id"}
    assert names == set(want["fields"]) | set(want["tensors"])


@pytest.mark.parametrize("path", MESSAGES, ids=lambda p: p.stem)
def test_message_built_from_json_encodes_to_the_vector_bytes(path: Path) -> None:
    want = _load(path)
    cls = m.KINDS[want["kind"]]
    hints = schema._hints(cls)
    fields = {name: schema._check_value(v, hints[name], name) for name, v in want["fields"].items()}
    tensors = {name: _tensor_from_json(t) for name, t in want["tensors"].items()}
    rid = {"request_id": want["request_id"]} if "request_id" in hints else {}
    assert m.encode(cls(**fields, **tensors, **rid)) == path.read_bytes()


def test_frame_vector_with_every_dtype() -> None:
    path = VECTORS / "frames" / "all_dtypes.bin"
    want = _load(path)
    frame = wire.decode_frame(path.read_bytes())
    assert (frame.kind, frame.request_id, frame.meta.decode()) == (want["kind"], want["request_id"], want["meta"])
    assert len(frame.tensors) == len(want["tensors"])
    for i, (got, t) in enumerate(zip(frame.tensors, want["tensors"])):
        _check_tensor(got, t, f"tensor {i}")
    tensors = [_tensor_from_json(t) for t in want["tensors"]]
    assert wire.encode_frame(want["kind"], want["meta"].encode(), tensors, want["request_id"]) == path.read_bytes()


@pytest.mark.parametrize("path", MALFORMED, ids=lambda p: p.stem)
def test_malformed_vector_raises_its_error(path: Path) -> None:
    want = _load(path)
    with pytest.raises(getattr(errors, want["error"])):
        m.decode(path.read_bytes())


def test_fragment_vector_reassembles() -> None:
    want = json.loads((VECTORS / "fragments" / "dense_request.json").read_text())
    pieces = [(VECTORS / "fragments" / f"dense_request.{i}.bin").read_bytes() for i in range(want["count"])]
    assert all(len(p) <= want["max_message_size"] for p in pieces)
    r = wire.Reassembler()
    outs = [r.feed(p, now=0.0) for p in pieces]
    assert outs[:-1] == [None] * (len(pieces) - 1)
    frame = bytes(outs[-1])
    assert hashlib.sha256(frame).hexdigest() == want["frame_sha256"]
    msg = m.decode(frame)
    assert msg.request_id == want["message"]["request_id"]
    _check_tensor(msg.x, want["message"]["tensors"]["x"], "x")
    assert wire.Fragmenter(want["max_message_size"]).split(frame) == pieces


def test_channel_auth_vector() -> None:
    v = json.loads((VECTORS / "channel_auth.json").read_text())
    key = SwarmKey(bytes.fromhex(v["swarm_key_hex"]))
    k = bytes.fromhex(v["channel_auth_key_hex"])
    assert key.channel_auth_key == k
    for role in ("offerer", "answerer"):
        p = v[f"{role}_proof"]
        assert f"role={role}\n" in p["key_transcript"] and "fingerprint" not in p["key_transcript"]
        assert v["offerer"]["fingerprint"] in p["channel_transcript"]
        assert hmac.new(k, p["key_transcript"].encode(), hashlib.sha256).hexdigest() == p["key_mac"]
        assert hmac.new(k, p["channel_transcript"].encode(), hashlib.sha256).hexdigest() == p["channel_mac"]
    o, a = v["offerer"], v["answerer"]
    offer = ChannelAuth(role=Role.OFFERER, auth_key=k, local_peer_id=o["peer_id"], local_fingerprint=o["fingerprint"],
                        remote_fingerprint=a["fingerprint"], now=0.0, nonce=bytes.fromhex(o["nonce"]))
    answer = ChannelAuth(role=Role.ANSWERER, auth_key=k, local_peer_id=a["peer_id"], local_fingerprint=a["fingerprint"],
                         remote_fingerprint=o["fingerprint"], now=0.0, nonce=bytes.fromhex(a["nonce"]))
    f = {name: bytes.fromhex(h) for name, h in v["frames_hex"].items()}
    assert offer.start() == [f["offerer_hello"]] and answer.start() == [f["answerer_hello"]]
    assert answer.receive(f["offerer_hello"]) == [f["answerer_proof"]]
    assert offer.receive(f["answerer_hello"]) == [f["offerer_proof"]]
    assert offer.receive(f["answerer_proof"]) == [] and answer.receive(f["offerer_proof"]) == []
    assert offer.authenticated and answer.authenticated
    proof = m.decode(f["answerer_proof"])
    assert (proof.key_mac, proof.channel_mac) == (v["answerer_proof"]["key_mac"], v["answerer_proof"]["channel_mac"])


def test_swarm_key_vector() -> None:
    v = json.loads((VECTORS / "swarm_key.json").read_text())
    key = SwarmKey(bytes.fromhex(v["key_hex"]))
    assert decode_code(v["code"]) == key.secret and key.code == v["code"]
    assert key.swarm_id == v["swarm_id"]
    assert key.signaling_key.hex() == v["signaling_key_hex"]
    assert key.channel_auth_key.hex() == v["channel_auth_key_hex"]
    assert key.api_token == v["api_token"]
    assert key.slice_token_key.hex() == v["slice_token_key_hex"]


# --- the browser's recipe, run in real Chromium ---------------------------------------------------

_JS_AUTH = """
async ({keyHex, v}) => {
  const hex = h => Uint8Array.from(h.match(/../g).map(x => parseInt(x, 16)));
  const toHex = b => [...new Uint8Array(b)].map(x => x.toString(16).padStart(2, "0")).join("");
  const enc = s => new TextEncoder().encode(s);
  const ikm = await crypto.subtle.importKey("raw", hex(keyHex), "HKDF", false, ["deriveBits"]);
  const bits = await crypto.subtle.deriveBits(
    {name: "HKDF", hash: "SHA-256", salt: new Uint8Array(), info: enc("colibri-swarm v1 channel-auth")}, ikm, 256);
  const k = await crypto.subtle.importKey("raw", bits, {name: "HMAC", hash: "SHA-256"}, false, ["sign"]);
  // docs/protocol.md section 6, built from the fields (not from the Python transcript)
  const o = v.offerer, a = v.answerer;
  const out = {key: toHex(bits)};
  for (const role of ["offerer", "answerer"]) {
    for (const proof of ["key", "channel"]) {
      let t = "colibri-swarm channel-auth v1\\n" + `proof=${proof}\\nrole=${role}\\n` +
        `protocol-version=${v.protocol_version}\\noffer-peer-id=${o.peer_id}\\nanswer-peer-id=${a.peer_id}\\n` +
        `offer-nonce=${o.nonce}\\nanswer-nonce=${a.nonce}\\n`;
      if (proof === "channel") t += `offer-fingerprint=${o.fingerprint}\\nanswer-fingerprint=${a.fingerprint}\\n`;
      out[`${role}_${proof}`] = toHex(await crypto.subtle.sign("HMAC", k, enc(t)));
    }
  }
  return out;
}
"""

_JS_FRAME = """
(bytes) => {
  // docs/protocol.md section 2, with zero-copy typed-array views (they throw on misalignment)
  const buf = new Uint8Array(bytes).buffer, dv = new DataView(buf);
  const magic = String.fromCharCode(...new Uint8Array(buf, 0, 4));
  const kind = dv.getUint16(6, true), nT = dv.getUint16(10, true), rid = dv.getUint32(12, true);
  const metaLen = dv.getUint32(16, true), frameLen = dv.getUint32(20, true);
  const meta = new TextDecoder().decode(new Uint8Array(buf, 24, metaLen));
  let pos = 24 + metaLen; pos += (8 - pos % 8) % 8;
  const Views = {1: Float32Array, 2: Uint16Array, 3: Uint16Array, 4: Int32Array, 5: Uint8Array};
  const tensors = [];
  for (let i = 0; i < nT; i++) {
    const code = dv.getUint8(pos), rank = dv.getUint8(pos + 1), off = dv.getUint32(pos + 4, true);
    const shape = []; for (let d = 0; d < rank; d++) shape.push(dv.getUint32(pos + 8 + 4 * d, true));
    pos += 8 + 4 * rank;
    const n = shape.reduce((x, y) => x * y, 1);
    const view = new Views[code](buf, off, n);
    let data = Array.from(view);
    if (code === 3) data = data.map(b => new Float32Array(new Uint32Array([b << 16]).buffer)[0]);
    tensors.push({code, shape, data, bits: code === 2 || code === 3 ? Array.from(view) : null, off});
  }
  return {magic, kind, rid, meta, frameLen, byteLength: buf.byteLength, tensors};
}
"""


@pytest.fixture(scope="module")
def secure_page():
    """A blank page on http://localhost (a secure context: WebCrypto exists) in Debian's Chromium."""
    import os

    from tests.conftest import require
    from tests.static_http import serving

    require(os.path.exists("/usr/bin/chromium"), "Debian's Chromium at /usr/bin/chromium (apt install chromium)")
    from playwright.sync_api import sync_playwright

    with serving(b"<!doctype html><title>vectors</title>", "text/html") as port:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(f"http://localhost:{port}/")
            assert page.evaluate("window.isSecureContext && typeof crypto.subtle === 'object'")
            yield page
            browser.close()


@pytest.mark.browser
def test_webcrypto_reproduces_the_channel_auth_vector(secure_page) -> None:
    v = json.loads((VECTORS / "channel_auth.json").read_text())
    got = secure_page.evaluate(_JS_AUTH, {"keyHex": v["swarm_key_hex"], "v": v})
    assert got["key"] == v["channel_auth_key_hex"]
    for role in ("offerer", "answerer"):
        assert got[f"{role}_key"] == v[f"{role}_proof"]["key_mac"]
        assert got[f"{role}_channel"] == v[f"{role}_proof"]["channel_mac"]


@pytest.mark.browser
def test_js_typed_arrays_view_the_frame_vector_zero_copy(secure_page) -> None:
    path = VECTORS / "frames" / "all_dtypes.bin"
    want = _load(path)
    got = secure_page.evaluate(_JS_FRAME, list(path.read_bytes()))
    assert (got["magic"], got["kind"], got["rid"], got["meta"]) == ("CLSW", want["kind"], want["request_id"], want["meta"])
    assert got["frameLen"] == got["byteLength"] == path.stat().st_size
    codes = {name: code for code, (name, _) in wire.DTYPES.items()}
    for g, w in zip(got["tensors"], want["tensors"], strict=True):
        assert g["code"] == codes[w["dtype"]] and g["shape"] == w["shape"] and g["off"] % 8 == 0
        if w["dtype"] == "f16":
            assert g["bits"] == w["bits"]
        else:
            np.testing.assert_array_equal(np.array(g["data"], np.float64), np.array(w["data"], np.float64))
