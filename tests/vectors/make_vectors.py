"""Write the golden wire vectors in tests/vectors/ (run from the repository root):

    python3 tests/vectors/make_vectors.py

Run it only when the protocol changes on purpose (and bump the protocol version); the Python
and browser test suites both read the files it writes. Layout and JSON format: README.md here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from swarm.peer.net import messages as m  # noqa: E402
from swarm.peer.net import schema  # noqa: E402
from swarm.peer.net import wire  # noqa: E402
from swarm.peer.net.auth import ChannelAuth, Role, transcript  # noqa: E402
from swarm.keys.swarmkey import SwarmKey  # noqa: E402

HERE = Path(__file__).resolve().parent
PA = "abcdefghijklmnopqrstuvwxyz"
PB = "234567abcdefghijklmnopqrst"
HASH = hashlib.sha256(b"colibri-swarm test model").hexdigest()
SWARM_KEY = SwarmKey(bytes(range(32)))


def _f(shape: tuple[int, ...], dtype, scale: float = 0.25) -> np.ndarray:
    """Deterministic values exactly representable in f16 (so f32 and f16 vectors agree)."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 17 - 8) * scale).reshape(shape).astype(dtype)


def samples() -> dict[str, object]:
    chunk = np.frombuffer(b"weights \x00\x01\x02\xff", np.uint8)
    return {
        "auth_hello": m.AuthHello(peer_id=PA, nonce="00" * 16 + "ff" * 16),
        "auth_proof": m.AuthProof(key_mac="0123456789abcdef" * 4, channel_mac="fedcba9876543210" * 4),
        "hello_python": m.Hello(
            peer_id=PA, protocol_version=wire.PROTOCOL_VERSION,
            build=m.NumericBuild(package="0.1.0", numpy="2.3.1", blas="openblas 0.3.29", arch="x86_64", kernel_dtype="f32"),
            model_hash=HASH, memory_budget=8 * 2**30, ffn_gflops=35.5, peer_kind="python",
            adapter_limits={}, adapter_features=(), name="desk",
        ),
        "hello_browser": m.Hello(
            peer_id=PB, protocol_version=wire.PROTOCOL_VERSION,
            build=m.NumericBuild(package="0.1.0", numpy="", blas="webgpu", arch="arm64", kernel_dtype="f16"),
            model_hash=None, memory_budget=2**30, ffn_gflops=120.0, peer_kind="browser",
            adapter_limits={"maxStorageBufferBindingSize": 134217728, "maxComputeInvocationsPerWorkgroup": 256},
            adapter_features=("shader-f16",), name="phone – kitchen",
        ),
        "hello_gpu": m.Hello(
            peer_id=PA, protocol_version=wire.PROTOCOL_VERSION,
            build=m.NumericBuild(package="0.1.0", numpy="2.3.1", blas="wgpu 0.32.0 Vulkan kernels:q8_0,q4_k "
                                 "adapter:NVIDIA GeForce RTX 3060", arch="x86_64", kernel_dtype="f32"),
            model_hash=HASH, memory_budget=16 * 2**30, ffn_gflops=410.0, peer_kind="python",
            adapter_limits={}, adapter_features=(), name="tower", gpu_memory=12 * 2**30,
        ),
        "heartbeat": m.LinkHeartbeat(seq=3, sent_s=1.5),
        "weights_held": m.WeightsHeld(plan_version=5, weight_bytes=123_456_789),
        "error": m.Error(request_id=12, code="stale_term", message="request of term 2; the current term is 3"),
        "request_vote": m.RequestVote(term=3, candidate=PA),
        "vote": m.Vote(term=3, granted=True),
        "leader_heartbeat": m.LeaderHeartbeat(term=3, leader=PA),
        "plan": m.PlanMessage(term=3, version=6, assignments=(
            m.Assignment(layer=0, peer=PA, experts=(0, 1, 2, 3), dense=()),
            m.Assignment(layer=0, peer=PB, experts=(4, 5, 6, 7), dense=()),
            m.Assignment(layer=1, peer=PB, experts=(), dense=((0, 768), (1024, 1536))),
        )),
        "stage_plan": m.StagePlan(term=3, version=6, stages=(
            m.StageAssignment(peer=PA, layer_start=0, layer_stop=10),
            m.StageAssignment(peer=PB, layer_start=10, layer_stop=30),
        )),
        "standby": m.Standby(term=3, version=6, reason="fits_python_peers",
                             message="the model fits the Python peers (2 peers, 12.4 GiB offered); "
                                     "this page would be used if they ran short"),
        "stage_request": m.StageRequest(  # a decode row of sequence 4 and a 2-row chunk of sequence 9
            request_id=2**31 + 7, term=3, plan_version=6,
            segments=(m.StageSegment(sequence=4, start=12, rows=1), m.StageSegment(sequence=9, start=0, rows=2)),
            layer_start=10, layer_stop=30, x=_f((3, 4), np.float32),
        ),
        "stage_answer": m.StageAnswer(
            request_id=2**31 + 7, term=3, plan_version=6,
            segments=(m.StageSegment(sequence=4, start=12, rows=1), m.StageSegment(sequence=9, start=0, rows=2)),
            layer_start=10, layer_stop=30, compute_s=0.0125, x=_f((3, 4), np.float32, -0.75),
        ),
        "expert_request_f32": m.ExpertRequest(
            request_id=40, term=3, plan_version=6, layer=1,
            expert_ids=np.array([6, 4], np.int32), row_counts=np.array([2, 1], np.int32), rows=_f((3, 4), np.float32),
            segments=np.array([1, 1, 1], np.int32),  # expert 6: a row of each of two sequences; expert 4: one
        ),
        "expert_request_runs": m.ExpertRequest(
            request_id=41, term=3, plan_version=6, layer=1,
            expert_ids=np.array([5, 7, 4], np.int32), row_counts=np.array([1, 0, 2], np.int32), rows=_f((3, 4), np.float32),
            segments=np.array([1, 2], np.int32),
        ),
        "expert_answer": m.ExpertAnswer(
            request_id=40, term=3, plan_version=6, layer=1,
            expert_ids=np.array([6, 4], np.int32), row_counts=np.array([2, 1], np.int32), outputs=_f((3, 4), np.float32, -0.5),
        ),
        "dense_request": m.DenseRequest(
            request_id=42, term=3, plan_version=6, layer=2, ranges=((0, 768),), x=_f((2, 4), np.float32),
            segments=np.array([1, 1], np.int32),
        ),
        "dense_answer": m.DenseAnswer(
            request_id=42, term=3, plan_version=6, layer=2, ranges=((0, 768), (1024, 1536)),
            partials=_f((2, 2, 4), np.float32, 0.125),
        ),
        "expert_answer_int8": m.ExpertAnswerInt8(
            request_id=40, term=3, plan_version=6, layer=1,
            expert_ids=np.array([6, 4], np.int32), row_counts=np.array([2, 1], np.int32),
            outputs=_f((3, 4), np.float32, -0.5), down_rows=(np.arange(3 * 64) % 251).astype(np.uint8).reshape(3, 64),
        ),
        "dense_answer_int8": m.DenseAnswerInt8(
            request_id=42, term=3, plan_version=6, layer=2, ranges=((0, 768),),
            partials=_f((1, 2, 4), np.float32, 0.125),
            down_rows=(np.arange(2 * 128) % 253).astype(np.uint8).reshape(2, 128),
        ),
        "weight_manifest": m.WeightManifest(
            request_id=50, model_hash=HASH, name="blk.1.ffn_down[0:768]", encoding="gguf:Q4_1",
            total_bytes=25, chunk_bytes=12, chunk_sha256=(HASH, HASH, HASH),
        ),
        "weight_manifest_https": m.WeightManifest(
            request_id=52, model_hash=HASH, name="blk.1.ffn_down[0:768]", encoding="gguf:Q4_1",
            total_bytes=25, chunk_bytes=12, chunk_sha256=(HASH, HASH, HASH),
            https=m.HttpsSource(urls=("https://192.168.1.20:40123", "https://127.0.0.1:40123"), cert_sha256=HASH, token=HASH),
        ),
        "weight_chunk_request": m.WeightChunkRequest(request_id=51, model_hash=HASH, name="blk.1.ffn_down[0:768]", first=1, count=2),
        "weight_chunk": m.WeightChunk(
            request_id=51, model_hash=HASH, name="blk.1.ffn_down[0:768]", offset=12,
            sha256=hashlib.sha256(chunk).hexdigest(), data=chunk,
        ),
    }


def tensor_json(a: np.ndarray) -> dict:
    name = wire.dtype_name(a)
    out = {"dtype": name, "shape": list(a.shape)}
    if name == "bf16":
        out["data"] = (a.astype(np.uint32) << 16).view(np.float32).reshape(-1).tolist()
    elif name in ("f32", "f16"):
        out["data"] = [float(x) for x in a.reshape(-1)]
    else:
        out["data"] = [int(x) for x in a.reshape(-1)]
    if name in ("f16", "bf16"):
        out["bits"] = [int(x) for x in a.reshape(-1).view(np.uint16)]
    return out


def message_json(msg: object) -> dict:
    """The decoded value of a message as the vector JSON describes it (README.md)."""
    cls = type(msg)
    fields, tensors = {}, {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        if f.name == "request_id":
            continue
        if isinstance(v, np.ndarray):
            tensors[f.name] = tensor_json(v)
        else:
            fields[f.name] = json.loads(json.dumps(schema._to_json(v, schema._hints(cls)[f.name])))
    return {"kind": cls.KIND, "name": cls.__name__, "request_id": getattr(msg, "request_id", 0),
            "fields": fields, "tensors": tensors}


def frame_vectors() -> dict[str, tuple[bytes, dict]]:
    """Raw frames (kind 4095, not a message kind) exercising every dtype, rank 0 and empty tensors."""
    tensors = [
        np.array([1.0, -2.5, 3.25e-3], np.float32),
        np.array([[0.5, -1.0], [65504.0, 6.1035156e-05]], np.float16),
        np.array([0x3F80, 0xC020, 0x0000], np.uint16).view(wire.BF16),  # 1.0, -2.5, 0.0
        np.array([-2147483648, 0, 2147483647], np.int32),
        np.frombuffer(b"\x00\x7f\x80\xff\x01", np.uint8),
        np.array(7.0, np.float32),
        np.zeros((2, 0, 3), np.float32),
    ]
    meta = '{"note":"dtypes"}'
    frame = wire.encode_frame(4095, meta.encode(), tensors, request_id=0xDEADBEEF)
    return {"all_dtypes": (frame, {"kind": 4095, "request_id": 0xDEADBEEF, "meta": meta,
                                   "tensors": [tensor_json(t) for t in tensors]})}


def malformed_vectors() -> dict[str, tuple[bytes, dict]]:
    good = m.encode(samples()["expert_request_f32"])

    def patch(offset: int, value: bytes) -> bytes:
        return good[:offset] + value + good[offset + len(value):]

    import struct

    meta_len = struct.unpack_from("<I", good, 16)[0]
    table = 24 + meta_len + (-meta_len % 8)
    return {
        "bad_magic": (patch(0, b"CLSX"), {"error": "FrameError", "what": "magic"}),
        "other_version": (patch(4, struct.pack("<H", wire.PROTOCOL_VERSION + 1)), {"error": "VersionMismatchError", "what": "version"}),
        "length_mismatch": (good[:-8], {"error": "FrameError", "what": "frame_len"}),
        "trailing_bytes": (patch(20, struct.pack("<I", len(good) + 8)) + bytes(8), {"error": "FrameError", "what": "trailing bytes"}),
        "unknown_dtype": (patch(table, b"\x09"), {"error": "FrameError", "what": "dtype"}),
        "rank_too_high": (patch(table + 1, b"\x05"), {"error": "FrameError", "what": "rank"}),
        "bad_offset": (patch(table + 4, struct.pack("<I", 8)), {"error": "FrameError", "what": "offset"}),
        "shape_past_end": (patch(table + 8, struct.pack("<I", 1000)), {"error": "FrameError", "what": "shape"}),
        "nonzero_padding": (patch(24 + meta_len, b"\x01") if meta_len % 8 else patch(len(good) - 1, b"\x01"),
                            {"error": "FrameError", "what": "padding"}),
        "unknown_kind": (patch(6, struct.pack("<H", 999)), {"error": "MessageError", "what": "kind"}),
        "row_counts_mismatch": (m.wire.encode_frame(32, wire.decode_frame(good).meta,
                                                    [np.array([6, 4], np.int32), np.array([2, 2], np.int32),
                                                     np.zeros((3, 4), np.float32)], request_id=40),
                                {"error": "MessageError", "what": "row_counts"}),
        "f16_rows": (m.wire.encode_frame(32, wire.decode_frame(good).meta,
                                         [np.array([6, 4], np.int32), np.array([2, 1], np.int32),
                                          _f((3, 4), np.float16)], request_id=40),
                     {"error": "MessageError", "what": "rows"}),
        "stage_segments_mismatch": (m.wire.encode_frame(36, wire.decode_frame(m.encode(samples()["stage_request"])).meta,
                                                        [_f((2, 4), np.float32)], request_id=2**31 + 7),
                                    {"error": "MessageError", "what": "segments"}),
        **{f"standby_{name}": (m.wire.encode_frame(21, json.dumps(meta, separators=(",", ":")).encode(), []),
                               {"error": "MessageError", "what": what})
           for name, what, meta in (
               ("unknown_reason", "reason", {"term": 3, "version": 6, "reason": "bored", "message": "x"}),
               ("long_message", "message", {"term": 3, "version": 6, "reason": "too_slow", "message": "x" * 201}),
               ("empty_message", "message", {"term": 3, "version": 6, "reason": "too_slow", "message": ""}),
               ("control_character", "message", {"term": 3, "version": 6, "reason": "too_slow", "message": "a\nb"}),
               ("missing_version", "version", {"term": 3, "reason": "too_slow", "message": "x"}))},
        **{f"hello_gpu_memory_{name}": (m.wire.encode_frame(3, json.dumps(meta, separators=(",", ":")).encode(), []),
                                        {"error": "MessageError", "what": "gpu_memory"})
           for name, meta in (
               ("negative", _hello_gpu_meta(gpu_memory=-1)),
               ("not_an_int", _hello_gpu_meta(gpu_memory="12G")),
               ("absurd", _hello_gpu_meta(gpu_memory=2**51)),
               ("missing", {k: v for k, v in _hello_gpu_meta().items() if k != "gpu_memory"}),
               ("on_a_cpu_peer", _hello_gpu_meta(build={**_hello_gpu_meta()["build"], "blas": "openblas 0.3.29"})),
               ("on_a_page", _hello_gpu_meta(peer_kind="browser")))},
        **_int8_answer_vectors(),
    }


def _int8_answer_vectors() -> dict[str, tuple[bytes, dict]]:
    """An int8 GPU peer's answers (kinds 38, 39) whose ``down_rows`` do not fit their outputs: a
    row too few, rows of 96 bytes (not a multiple of 64), of 0 bytes, or a dense answer of two ranges."""
    expert = wire.decode_frame(m.encode(samples()["expert_answer_int8"]))  # 3 outputs, down_rows [3, 64]
    dense = wire.decode_frame(m.encode(samples()["dense_answer_int8"]))  # one range, T = 2, down_rows [2, 128]
    two = wire.decode_frame(m.encode(samples()["dense_answer"]))  # two ranges, partials [2, 2, 4]

    def frame(f, kind: int, *tensors: np.ndarray) -> bytes:
        return m.wire.encode_frame(kind, f.meta, [*tensors], request_id=f.request_id)

    expert_head, dense_head = expert.tensors[:-1], dense.tensors[:-1]
    rows = lambda n, width: (np.arange(n * width) % 251).astype(np.uint8).reshape(n, width)  # noqa: E731
    return {
        "expert_answer_int8_down_rows_count": (frame(expert, 38, *expert_head, rows(2, 64)),
                                               {"error": "MessageError", "what": "down_rows"}),
        "expert_answer_int8_width_96": (frame(expert, 38, *expert_head, rows(3, 96)),
                                        {"error": "MessageError", "what": "down_rows"}),
        "dense_answer_int8_width_0": (frame(dense, 39, *dense_head, rows(2, 0)),
                                      {"error": "MessageError", "what": "down_rows"}),
        "dense_answer_int8_down_rows_count": (frame(dense, 39, *dense_head, rows(3, 128)),
                                              {"error": "MessageError", "what": "down_rows"}),
        "dense_answer_int8_two_ranges": (frame(two, 39, *two.tensors, rows(2, 128)),
                                         {"error": "MessageError", "what": "ranges"}),
    }


def _hello_gpu_meta(**changed: object) -> dict:
    """The metadata of the ``hello_gpu`` sample with ``changed`` fields."""
    return {**json.loads(wire.decode_frame(m.encode(samples()["hello_gpu"])).meta), **changed}


def fragment_vector() -> tuple[list[bytes], dict]:
    msg = m.DenseRequest(request_id=43, term=3, plan_version=6, layer=0, ranges=((0, 768),), x=_f((8, 64), np.float32))
    frame = m.encode(msg)
    pieces = wire.Fragmenter(1024).split(frame)
    return pieces, {"max_message_size": 1024, "count": len(pieces), "frame_sha256": hashlib.sha256(frame).hexdigest(),
                    "message": message_json(msg)}


def channel_auth_vector() -> dict:
    na, nb = bytes(range(32, 64)), bytes(range(64, 96))
    fa = "sha-256 " + ":".join(f"{i:02X}" for i in range(0, 64, 2))
    fb = "sha-256 " + ":".join(f"{i:02X}" for i in range(255, 191, -2))
    k = SWARM_KEY.channel_auth_key
    offer = ChannelAuth(role=Role.OFFERER, auth_key=k, local_peer_id=PA, local_fingerprint=fa,
                        remote_fingerprint=fb, now=0.0, nonce=na)
    answer = ChannelAuth(role=Role.ANSWERER, auth_key=k, local_peer_id=PB, local_fingerprint=fb,
                         remote_fingerprint=fa, now=0.0, nonce=nb)
    hello_o, hello_a = offer.start()[0], answer.start()[0]
    proof_a = answer.receive(hello_o)[0]
    proof_o = offer.receive(hello_a)[0]
    offer.receive(proof_a)
    answer.receive(proof_o)
    assert offer.authenticated and answer.authenticated
    common = dict(offer_peer_id=PA, answer_peer_id=PB, offer_nonce=na.hex(), answer_nonce=nb.hex())
    head = "colibri-swarm channel-auth v1\n"
    out = {
        "swarm_key_hex": SWARM_KEY.secret.hex(),
        "channel_auth_key_hex": k.hex(),
        "protocol_version": wire.PROTOCOL_VERSION,
        "offerer": {"peer_id": PA, "nonce": na.hex(), "fingerprint": fa},
        "answerer": {"peer_id": PB, "nonce": nb.hex(), "fingerprint": fb},
        "frames_hex": {"offerer_hello": hello_o.hex(), "answerer_hello": hello_a.hex(),
                       "offerer_proof": proof_o.hex(), "answerer_proof": proof_a.hex()},
    }
    for role, proof in (("offerer", proof_o), ("answerer", proof_a)):
        pm = m.decode(proof)
        key_t = head + f"proof=key\nrole={role}\n" + transcript(**common, offer_fingerprint=None, answer_fingerprint=None).decode()
        chan_t = head + f"proof=channel\nrole={role}\n" + transcript(**common, offer_fingerprint=fa, answer_fingerprint=fb).decode()
        out[f"{role}_proof"] = {"key_transcript": key_t, "key_mac": pm.key_mac,
                                "channel_transcript": chan_t, "channel_mac": pm.channel_mac}
    return out


def swarm_key_vector() -> dict:
    k = SWARM_KEY
    return {"key_hex": k.secret.hex(), "code": k.code, "swarm_id": k.swarm_id,
            "signaling_key_hex": k.signaling_key.hex(), "channel_auth_key_hex": k.channel_auth_key.hex(),
            "api_token": k.api_token, "slice_token_key_hex": k.slice_token_key.hex(), "hkdf": "HKDF-SHA256, salt empty, info 'colibri-swarm v1 <label>', 32 bytes (swarm-id: 8)"}


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    for sub in ("messages", "frames", "malformed", "fragments"):
        d = HERE / sub
        d.mkdir(exist_ok=True)
        for old in d.iterdir():
            old.unlink()
    for name, msg in samples().items():
        (HERE / "messages" / f"{name}.bin").write_bytes(m.encode(msg))
        _write_json(HERE / "messages" / f"{name}.json", message_json(msg))
    for name, (data, desc) in frame_vectors().items():
        (HERE / "frames" / f"{name}.bin").write_bytes(data)
        _write_json(HERE / "frames" / f"{name}.json", desc)
    for name, (data, desc) in malformed_vectors().items():
        (HERE / "malformed" / f"{name}.bin").write_bytes(data)
        _write_json(HERE / "malformed" / f"{name}.json", desc)
    pieces, desc = fragment_vector()
    for i, p in enumerate(pieces):
        (HERE / "fragments" / f"dense_request.{i}.bin").write_bytes(p)
    _write_json(HERE / "fragments" / "dense_request.json", desc)
    _write_json(HERE / "channel_auth.json", channel_auth_vector())
    _write_json(HERE / "swarm_key.json", swarm_key_vector())


if __name__ == "__main__":
    main()
