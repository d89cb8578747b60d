"""Slices for the browser peer: K-quant and Q5_x tensors are repacked to Q8_0 once by the
coordinator (swarm/peer/weights/repack.py), within Q8_0's rounding of gguf-py's float64 dequantization;
Q4_0/Q4_1/Q8_0 and float tensors ship as in the file, and so do Q4_K/Q5_K/Q6_K to a page whose
Hello announces their kernels."""

from __future__ import annotations

import asyncio
import hashlib

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from swarm.errors import LocalProtocolError
from swarm.peer.plan import ModelShape
from swarm.peer.net.messages import NumericBuild
from swarm.peer.weights.repack import K_ENCODINGS, PAGE_ENCODINGS, page_encodings, page_readable, repack_for_page
from swarm.peer.weights.shipping_aio import PlanShipper
from swarm.peer.weights.slices import ModelSlicer, SliceSpan, decode_slice

H, R = 256, 256  # hidden width and dense rows: multiples of the K-quants' 256-weight blocks


def _blocks(rng, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """Valid blocks of `qtype`, uint8 [rows, cols / block * size]: gguf's quantizer where it has
    one, else random bytes with finite f16 scales in the right places."""
    block, size = GGML_QUANT_SIZES[qtype]
    try:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    except (NotImplementedError, gguf.quants.QuantError):
        pass
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = {QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [size - 2], QT.IQ4_XS: [0]}[qtype]  # d (and dmin) offsets
    for at in scales:
        raw[:, at : at + 2] = rng.uniform(1e-3, 4e-3, len(raw)).astype("<f2")[:, None].view(np.uint8)
    return raw.reshape(rows, -1)


def _dense_slice(qtype: QT, seed: int = 0):
    rng = np.random.default_rng(seed)
    blob, tensors = b"", []
    for role, shape in (("gate", (R, H)), ("up", (R, H)), ("down", (H, R))):
        raw = _blocks(rng, qtype, *shape).tobytes()
        tensors.append({"role": role, "encoding": qtype.name, "shape": list(shape), "offset": len(blob), "nbytes": len(raw)})
        blob += raw
    return blob, {"version": 1, "format": "gguf", "spec": {"layer": 0, "kind": "dense", "start": 0, "stop": R}, "tensors": tensors}


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, QT.Q5_0, QT.Q5_1], ids=lambda q: q.name)
def test_repack_to_q8_0_within_its_rounding(qtype):
    blob, meta = _dense_slice(qtype)
    assert not page_readable(meta)
    out, out_meta = repack_for_page(blob, meta)
    assert page_readable(out_meta) and out_meta["spec"] == meta["spec"]
    assert [t["encoding"] for t in out_meta["tensors"]] == ["Q8_0"] * 3
    assert [t["repacked_from"] for t in out_meta["tensors"]] == [qtype.name] * 3
    # 8.5 bits per weight, whatever the file's type was.
    assert len(out) == 3 * R * H // 32 * 34
    got = decode_slice(out, out_meta)  # the slice stays valid for every decoder
    want = decode_slice(blob, meta)
    for role in ("gate", "up", "down"):
        ref = getattr(want, role).astype(np.float64).reshape(-1, 32)
        err = np.abs(getattr(got, role).astype(np.float64).reshape(-1, 32) - ref)
        amax = np.abs(ref).max(axis=1, keepdims=True)
        # Half a Q8_0 step of each 32-weight block, plus the f16 rounding of its scale.
        assert (err <= 0.57 * amax / 127 + 1e-12).all(), f"{qtype.name} {role}: worst {float((err / amax).max())}"
        assert err.max() > 0  # it was requantized, not copied


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.F16], ids=lambda q: q.name)
def test_page_readable_slices_ship_as_in_the_file(qtype):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype).tobytes()
    meta = {"version": 1, "format": "gguf", "spec": {"layer": 0, "kind": "dense", "start": 0, "stop": 64},
            "tensors": [{"role": r, "encoding": qtype.name, "shape": [64, 64], "offset": i * len(raw), "nbytes": len(raw)}
                        for i, r in enumerate(("gate", "up", "down"))]}
    assert qtype.name in PAGE_ENCODINGS
    out, out_meta = repack_for_page(raw * 3, meta)
    assert out == raw * 3 and out_meta == meta


def test_bad_tensors_are_refused():
    blob, meta = _dense_slice(QT.Q6_K)
    short = {**meta, "tensors": [{**meta["tensors"][0], "nbytes": meta["tensors"][0]["nbytes"] - 1}] + meta["tensors"][1:]}
    with pytest.raises(LocalProtocolError, match="cannot be"):
        repack_for_page(blob, short)
    unknown = {**meta, "tensors": [{**meta["tensors"][0], "encoding": "Q9_9"}] + meta["tensors"][1:]}
    with pytest.raises(LocalProtocolError, match="unknown encoding"):
        repack_for_page(blob, unknown)


def _build(blas: str) -> NumericBuild:
    return NumericBuild(package="web_peer", numpy="", blas=blas, arch="webgpu", kernel_dtype="f32")


def test_page_encodings_from_the_hello():
    assert page_encodings(_build("webgpu")) == PAGE_ENCODINGS  # an older page: no K-quant kernels
    assert page_encodings(_build("webgpu kernels:q4_0,q4_1,q8_0,q4_k,q5_k,q6_k,iq4_xs")) == PAGE_ENCODINGS | K_ENCODINGS
    assert page_encodings(_build("webgpu kernels:q4_0,q4_1,q8_0,q4_k,q5_k,q6_k")) == PAGE_ENCODINGS | K_ENCODINGS - {"IQ4_XS"}
    assert page_encodings(_build("webgpu kernels:q4_k,iq2_xxs")) == PAGE_ENCODINGS | {"Q4_K"}  # unknown names ignored
    assert page_encodings(None) == PAGE_ENCODINGS


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS], ids=lambda q: q.name)
def test_k_quants_ship_as_in_the_file_to_a_page_with_their_kernels(qtype):
    blob, meta = _dense_slice(qtype)
    k = page_encodings(_build("webgpu kernels:q4_0,q4_1,q8_0,q4_k,q5_k,q6_k,iq4_xs"))
    assert page_readable(meta, k)
    out, out_meta = repack_for_page(blob, meta, k)
    assert out == blob and out_meta == meta


def test_mixed_gate_and_up_with_a_k_quant_are_repacked():
    # One swiglu kernel reads gate and up in one format, and a page decodes only the older types to
    # float32: a Q4_K gate with a Q8_0 up goes as Q8_0, a Q6_K down stays.
    k = PAGE_ENCODINGS | K_ENCODINGS
    blobs = [_dense_slice(q, seed=3) for q in (QT.Q4_K, QT.Q8_0, QT.Q6_K)]
    parts = [b[m["tensors"][i]["offset"] : m["tensors"][i]["offset"] + m["tensors"][i]["nbytes"]]
             for i, (b, m) in enumerate(blobs)]
    tensors, at = [], 0
    for i, (raw, (_, m)) in enumerate(zip(parts, blobs)):
        tensors.append({**m["tensors"][i], "offset": at})
        at += len(raw)
    meta = {**blobs[0][1], "tensors": tensors}
    assert not page_readable(meta, k)
    out, out_meta = repack_for_page(b"".join(parts), meta, k)
    assert [t["encoding"] for t in out_meta["tensors"]] == ["Q8_0", "Q8_0", "Q6_K"]
    assert out_meta["tensors"][0]["repacked_from"] == "Q4_K" and out.endswith(parts[2])


def test_plan_shipper_repacks_once_and_for_browsers_only(tmp_path):
    # A GGUF whose MLP is Q6_K: Python workers get Q6_K as in the file, a page gets Q8_0.
    rng = np.random.default_rng(2)
    path = tmp_path / "q6k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for role, shape in (("gate", (R, H)), ("up", (R, H)), ("down", (H, R))):
        w.add_tensor(f"blk.0.ffn_{role}.weight", _blocks(rng, QT.Q6_K, *shape), raw_dtype=QT.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shape = ModelShape(hidden_size=H, n_experts=0, moe_intermediate_size=0, intermediate_size=R,
                       moe_layers=(), dense_layers=(0,))
    spec = SliceSpan(0, "dense", 0, R)

    async def manifests():
        shipper = PlanShipper(path, "ab" * 32, shape)
        python, page = await shipper.manifest_for(spec), await shipper.manifest_for(spec, browser=True)
        k_page = await shipper.manifest_for(spec, True, PAGE_ENCODINGS | K_ENCODINGS)
        return python, page, await shipper.manifest_for(spec, browser=True), k_page

    python, page, again, k_page = asyncio.run(manifests())
    assert [t["encoding"] for t in python.meta["tensors"]] == ["Q6_K"] * 3
    assert [t["encoding"] for t in page.meta["tensors"]] == ["Q8_0"] * 3
    # A page with the K-quant kernels gets the file's bytes: the Python workers' slice.
    assert k_page.slice_id == python.slice_id and [t["encoding"] for t in k_page.meta["tensors"]] == ["Q6_K"] * 3
    assert again is page and page.slice_id != python.slice_id  # repacked once, cached by slice
    want = repack_for_page(*ModelSlicer(path).extract(spec))[0]
    assert page.slice_id == hashlib.sha256(want).digest()  # the offered bytes are the repacked slice
