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
from swarm.peer import messages as m
from swarm.peer import wire
from swarm.peer.auth import ChannelAuth, Role
from swarm.peer.swarmkey import SwarmKey, decode_code

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
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
    hints = m._hints(cls)
    fields = {name: m._check_value(v, hints[name], name) for name, v in want["fields"].items()}
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
