"""Slices cut from real model files decode to exactly the rows/experts of the whole tensor.

Oracles: ``gguf.quants.dequantize`` of the whole tensor (GGUF), the parameters of the
transformers model that wrote the checkpoint (safetensors), and a float64 numpy MLP
(the sum of dense-range partials equals the whole MLP).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from swarm.errors import ModelFileError, RemoteProtocolError
from swarm.peer.weights.shipping import SliceCache, SliceSource
from swarm.peer.weights.slices import ModelSlicer, SliceSpan, decode_slice


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from swarm.compute.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def smol_slicer(smollm2) -> ModelSlicer:
    return ModelSlicer(smollm2)  # parsing the GGUF header takes ~2 s: once per module


def _silu(x):
    return x / (1 + np.exp(-x))


def test_gguf_dense_ranges_decode_exactly_and_ship_quantized(smollm2, smol_slicer):
    slicer = smol_slicer
    assert slicer.dense_alignment(3) == 32  # Q4_1 blocks
    reader = GGUFReader(smollm2)
    gate, up, down = (
        dequantize(t.data, t.tensor_type) for r in ("gate", "up", "down")
        for t in reader.tensors if t.name == f"blk.3.ffn_{r}.weight"
    )
    assert gate.shape == (1536, 576) and down.shape == (576, 1536)
    x = np.random.default_rng(0).standard_normal((4, 576))
    whole = (_silu(x @ gate.T.astype(np.float64)) * (x @ up.T.astype(np.float64))) @ down.T.astype(np.float64)
    partial_sum = np.zeros_like(whole)
    for start, stop in [(0, 512), (512, 1100), (1100, 1536)]:  # 1100 is not a block boundary
        spec = SliceSpan(3, "dense", start, stop)
        blob, meta = slicer.extract(spec)
        w = decode_slice(blob, meta)
        np.testing.assert_array_equal(w.gate, gate[start:stop])
        np.testing.assert_array_equal(w.up, up[start:stop])
        np.testing.assert_array_equal(w.down, down[:, start:stop])
        assert w.gate.dtype == np.float32
        enc = {t["role"]: t["encoding"] for t in meta["tensors"]}
        assert enc["gate"] == enc["up"] == "Q4_1"
        assert enc["down"] == ("Q4_1" if stop % 32 == 0 and start % 32 == 0 else "F32")
        g, u, d = (a.astype(np.float64) for a in (w.gate, w.up, w.down))
        partial_sum += (_silu(x @ g.T) * (x @ u.T)) @ d.T
    np.testing.assert_allclose(partial_sum, whole, rtol=1e-10, atol=1e-10)
    blob, _ = slicer.extract(SliceSpan(3, "dense", 0, 512))
    assert len(blob) == 3 * 512 * 576 // 32 * 20  # Q4_1: 20 bytes per 32 weights, not 4 bytes each


def _write_moe_gguf(path: Path, experts=4, f=64, h=96, seed=0):
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "qwen3moe")
    full = {}
    for role, shape, qtype in (("gate", (experts, f, h), GGMLQuantizationType.Q8_0),
                               ("up", (experts, f, h), GGMLQuantizationType.Q8_0),
                               ("down", (experts, h, f), GGMLQuantizationType.F32)):
        a = rng.standard_normal(shape).astype(np.float32)
        q = quantize(a, qtype)
        w.add_tensor(f"blk.0.ffn_{role}_exps.weight", q, raw_shape=q.shape, raw_dtype=qtype)
        full[role] = dequantize(q, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return full


def test_gguf_expert_ranges_decode_exactly(tmp_path):
    path = tmp_path / "moe.gguf"
    full = _write_moe_gguf(path)
    slicer = ModelSlicer(path)
    for start, stop in [(0, 1), (1, 3), (0, 4)]:
        blob, meta = slicer.extract(SliceSpan(0, "experts", start, stop))
        w = decode_slice(blob, meta)
        for role in ("gate", "up", "down"):
            np.testing.assert_array_equal(getattr(w, role), full[role][start:stop])
    with pytest.raises(ModelFileError, match="exceeds its 4 experts"):
        slicer.extract(SliceSpan(0, "experts", 2, 5))
    with pytest.raises(ModelFileError, match="not found"):
        slicer.extract(SliceSpan(7, "experts", 0, 1))


def _write_layers_gguf(path: Path, layers=3, experts=4, f=64, h=96, split_max_tensors=0) -> Path:
    """Dense and MoE FFN tensors of ``layers`` layers (Q8_0 and F32), whole or split by gguf-py
    as llama.cpp's gguf-split does; returns the first file."""
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, "qwen3moe", split_max_tensors=split_max_tensors)
    for layer in range(layers):
        for role, shape, qtype in (("gate", (experts, f, h), GGMLQuantizationType.Q8_0),
                                   ("up", (experts, f, h), GGMLQuantizationType.Q8_0),
                                   ("down", (experts, h, f), GGMLQuantizationType.F32)):
            q = quantize(rng.standard_normal(shape).astype(np.float32), qtype)
            w.add_tensor(f"blk.{layer}.ffn_{role}_exps.weight", q, raw_shape=q.shape, raw_dtype=qtype)
            q = quantize(rng.standard_normal(shape[1:]).astype(np.float32), qtype)
            w.add_tensor(f"blk.{layer}.ffn_{role}.weight", q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0]


def test_slices_of_a_split_gguf_are_the_unsplit_files_bytes(tmp_path):
    """Shards of two tensors each: a slice's gate, up and down come from different shards."""
    whole = ModelSlicer(_write_layers_gguf(tmp_path / "whole.gguf"))
    first = _write_layers_gguf(tmp_path / "split.gguf", split_max_tensors=2)
    assert first.name == "split-00001-of-00009.gguf"
    for named in (first, tmp_path / "split-00005-of-00009.gguf"):  # any shard names the model
        split = ModelSlicer(named)
        for spec in [SliceSpan(layer, "experts", 1, 3) for layer in range(3)] + \
                    [SliceSpan(layer, "dense", 32, 64) for layer in range(3)] + [SliceSpan(2, "dense", 0, 40)]:
            blob, meta = split.extract(spec)
            want_blob, want_meta = whole.extract(spec)
            assert blob == want_blob and meta == want_meta


_PEAK_RSS_PROBE = """
import json, sys
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from swarm.peer.weights.slices import ModelSlicer, SliceSpan

path, (e, f, h) = sys.argv[1], (8, 1024, 4096)
w = GGUFWriter(path, "qwen3moe")
for role, shape in (("gate", (e, f, h)), ("up", (e, f, h)), ("down", (e, h, f))):
    blocks = np.zeros((*shape[:2], shape[2] // 32 * 34), np.uint8)  # Q8_0: 34 bytes per 32 weights
    w.add_tensor(f"blk.0.ffn_{role}_exps.weight", blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType.Q8_0)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
del blocks, w

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

slicer = ModelSlicer(path)
open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS:")
blob, meta = slicer.extract(SliceSpan(0, "experts", 0, e))
print(json.dumps({"slice": len(blob), "growth": status("VmHWM:") - before}))
"""


def test_extract_holds_one_copy_of_the_slice(tmp_path):
    """Cutting a 102 MiB slice raises the peak RSS by about the slice, not by several copies of
    it (a blob grown tensor by tensor and copied to bytes peaked at 2.3×). Linux: VmHWM."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_RSS_PROBE, str(tmp_path / "big.gguf")], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[3])
    got = json.loads(out.stdout)
    assert got["slice"] >= 100e6
    assert got["growth"] <= 1.3 * got["slice"], f"peak grew {got['growth'] / got['slice']:.2f}× the slice"


def _tiny_moe(tmp_path: Path, family: str, dtype="float32"):
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    model = model.to(getattr(torch, dtype))
    out = tmp_path / f"{family}-{dtype}"
    model.save_pretrained(out)
    experts = model.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().float().numpy()  # [E, 2F, H]
    f = gate_up.shape[1] // 2
    return out, {"gate": gate_up[:, :f], "up": gate_up[:, f:], "down": experts.down_proj.detach().float().numpy()}


@pytest.mark.parametrize("family, dtype", [("qwen3_moe", "float32"), ("mixtral", "bfloat16")])
def test_safetensors_expert_slices_match_transformers(tmp_path, family, dtype):
    path, oracle = _tiny_moe(tmp_path, family, dtype)
    slicer = ModelSlicer(path)
    blob, meta = slicer.extract(SliceSpan(1, "experts", 1, 3))
    assert {t["encoding"] for t in meta["tensors"]} == {"F32" if dtype == "float32" else "BF16"}
    w = decode_slice(blob, meta)
    for role in ("gate", "up", "down"):
        np.testing.assert_array_equal(getattr(w, role), oracle[role][1:3])

    # The same weights saved in the stacked layout slice to the same arrays.
    from safetensors.numpy import load_file, save_file

    if dtype == "float32":
        tensors = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
        names = [k for k in tensors if ".mlp.experts." in k]
        for k in names:
            del tensors[k]
        for layer in (0, 1):
            pre = f"model.layers.{layer}.mlp.experts"
            tensors[f"{pre}.gate_up_proj"] = np.concatenate([oracle["gate"], oracle["up"]], axis=1) if layer == 1 else \
                np.zeros((4, 48, 32), np.float32)
            tensors[f"{pre}.down_proj"] = oracle["down"] if layer == 1 else np.zeros((4, 32, 24), np.float32)
        stacked = tmp_path / "stacked"
        stacked.mkdir()
        save_file(tensors, stacked / "model.safetensors")
        w2 = ModelSlicer(stacked).load(SliceSpan(1, "experts", 1, 3))
        for role in ("gate", "up", "down"):
            np.testing.assert_array_equal(getattr(w2, role), getattr(w, role))


def test_shipped_slice_through_cache_equals_local_load(tmp_path, smol_slicer):
    """Coordinator extracts, worker downloads into its cache, decodes: same as a local load."""
    slicer = smol_slicer
    spec = SliceSpan(7, "dense", 768, 1536)
    blob, meta = slicer.extract(spec)
    src = SliceSource()
    manifest = src.offer(blob, meta)
    cache = SliceCache(tmp_path)
    dl = cache.open_download(manifest)
    while not dl.complete:
        for req in dl.requests_to_send(0.0):
            for chunk in src.serve(req):
                dl.receive(chunk, 0.0)
    shipped = decode_slice(cache.finish(dl), manifest.meta)
    local = slicer.load(spec)
    for role in ("gate", "up", "down"):
        np.testing.assert_array_equal(getattr(shipped, role), getattr(local, role))


def test_bad_meta_is_refused(smol_slicer):
    blob, meta = smol_slicer.extract(SliceSpan(0, "dense", 0, 64))

    def edit(**changes):
        tensors = [dict(t) for t in meta["tensors"]]
        tensors[2].update(changes)
        return {**meta, "tensors": tensors}

    cases = [
        ({**meta, "version": 99}, "version"),
        ({**meta, "spec": {"layer": -1, "kind": "dense", "start": 0, "stop": 64}}, "slice spec"),
        ({**meta, "tensors": meta["tensors"][:2]}, "tensors must be"),
        (edit(encoding="Q9_9"), "unknown encoding"),
        (edit(shape=[576, 65]), "cannot be"),
        (edit(shape=[576]), "shape"),
        (edit(offset=len(blob)), "outside"),
        (edit(nbytes=10**12), "outside"),
    ]
    for bad, match in cases:
        with pytest.raises(RemoteProtocolError, match=match):
            decode_slice(blob, bad)
    # A shape that is self-consistent in bytes but wrong for the spec.
    with pytest.raises(RemoteProtocolError, match="do not fit"):
        decode_slice(blob, {**meta, "spec": {"layer": 0, "kind": "dense", "start": 0, "stop": 32}})


def test_unreadable_model_paths_name_the_file(tmp_path):
    with pytest.raises(ModelFileError, match="not a .gguf"):
        ModelSlicer(tmp_path)
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(os.urandom(4))
    with pytest.raises(ModelFileError, match="truncated"):
        ModelSlicer(tmp_path)
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError, match="impossible"):
        ModelSlicer(tmp_path)


def test_slices_give_the_engines_weights_bit_for_bit(smollm2, smol_slicer, tmp_path):
    """A worker computing with decoded slices gets exactly what the engine computes locally."""
    from swarm.compute.ffn import dense_partial, swiglu_ffn
    from swarm.compute.model import load_model

    model = load_model(smollm2)
    x = np.random.default_rng(1).standard_normal((3, 576)).astype(np.float32)
    (w,) = smol_slicer.load(SliceSpan(4, "dense", 512, 1024)).mlp_weights().values()
    np.testing.assert_array_equal(dense_partial(w, x, 0, 512), dense_partial(model.dense_weights(4), x, 512, 1024))

    path, _ = _tiny_moe(tmp_path, "qwen3_moe")
    moe = load_model(path)
    experts = ModelSlicer(path).load(SliceSpan(1, "experts", 2, 4)).mlp_weights()
    xm = np.random.default_rng(2).standard_normal((5, 32)).astype(np.float32)
    for e, we in experts.items():
        np.testing.assert_array_equal(swiglu_ffn(we, xm), swiglu_ffn(moe.expert_weights(1, e), xm))


def test_worker_on_shipped_slices_answers_like_a_worker_with_the_model(tmp_path):
    """Every slice a plan gives a worker, shipped and decoded, serves the Worker bit for bit."""
    from swarm.compute.model import load_model
    from swarm.peer.net import messages as M
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.plan import ModelShape
    from swarm.peer.weights.slices import ShippedWeights, specs_for
    from swarm.peer.worker.ffn import Worker

    from tests.peer._swarm_models import build

    path = build("qwen3_moe", tmp_path)  # MoE layers 0 and 2, dense layer 1
    model = load_model(path)
    shape = ModelShape.from_config(model.config)
    coord, w1, w2 = "c" * 26, "d" * 26, "e" * 26
    plan = build_plan(shape, PeerCapacity(coord, 0, 1.0), [PeerCapacity(w1, 10**9, 1.0), PeerCapacity(w2, 10**9, 2.0)],
                      term=1, version=1)
    specs = specs_for(plan, w1)
    assert specs and {s.kind for s in specs} == {"experts", "dense"}
    shipped = ShippedWeights()
    slicer = ModelSlicer(path)
    for spec in specs:
        blob, meta = slicer.extract(spec)
        shipped.add(decode_slice(blob, meta))
    ours, reference = Worker(w1, shape, shipped), Worker(w1, shape, model)
    for w in (ours, reference):
        w.accept_plan(plan)
    assert ours.prepare() == reference.prepare() > 0
    x = np.random.default_rng(3).standard_normal((6, shape.hidden_size)).astype(np.float32)
    for spec in specs:
        if spec.kind == "experts":
            ids = np.arange(spec.start, spec.stop, dtype=np.int32)
            counts = np.full(len(ids), 6 // len(ids) or 1, np.int32)
            counts[-1] = 6 - counts[:-1].sum()
            req = M.ExpertRequest(1, 1, 1, spec.layer, ids, counts, x)
        else:
            req = M.DenseRequest(1, 1, 1, spec.layer, ((spec.start, spec.stop),), x)
        a, b = ours.handle(req), reference.handle(req)
        assert type(a) is type(b) and not isinstance(a, M.Error), a
        got, want = (a.outputs, b.outputs) if spec.kind == "experts" else (a.partials, b.partials)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(Exception, match="not shipped"):
        shipped.expert_weights(0, 99)
