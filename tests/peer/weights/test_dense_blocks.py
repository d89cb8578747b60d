"""Dense ranges are cut on the ``down`` tensor's blocks, so a K-quant ``down`` slice ships in its
encoding (not a float32 copy) at the bytes the planner budgeted for it."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from swarm.compute.ffn import dense_partial
from swarm.compute.model import load_model
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.weights.sizes import model_shape
from swarm.peer.weights.slices import ModelSlicer, SliceSpan, decode_slice
from tests.compute.test_quant_kernels import quantize_k
from tests.compute.tiny_gguf import write_gguf_from_hf


def _q4_k_llama(tmp_path, monkeypatch):
    """A 2-layer Llama (hidden 256, intermediate 768) whose matrices are Q4_K super-blocks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda a, q: quantize_k(a, q) if q == QT.Q4_K else plain(a, q))
    path = write_gguf_from_hf(hf, "llama", tmp_path / "q4k.gguf", QT.Q4_K)
    monkeypatch.undo()
    return path


def test_k_quant_down_slices_stay_in_their_encoding_at_the_budgeted_bytes(tmp_path, monkeypatch):
    path = _q4_k_llama(tmp_path, monkeypatch)
    model = load_model(path)
    shape = model_shape(model)
    assert model.checkpoint.file.qtype("blk.0.ffn_down.weight") == QT.Q4_K and shape.dense_block == 256
    # shares of 0.28 / 0.72 would cut 768 columns at 213 without the block rule
    plan = build_plan(shape, PeerCapacity("a", 1 << 40, 1.0), [PeerCapacity("b", 1 << 40, 1.3)], term=1, version=1)
    slicer = ModelSlicer(path)
    x = np.random.default_rng(0).normal(size=(3, 256)).astype(np.float32)
    held = {"a": 0, "b": 0}
    for layer, spans in plan.dense.items():
        assert [(s.start, s.stop) for s in spans] == [(0, 256), (256, 768)]
        for s in spans:
            blob, meta = slicer.extract(SliceSpan(layer, "dense", s.start, s.stop))
            assert {t["role"]: t["encoding"] for t in meta["tensors"]} == {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}
            held[s.peer] += len(blob)
            (w,) = decode_slice(blob, meta).mlp_weights().values()
            assert w.down.qtype == QT.Q4_K
            np.testing.assert_array_equal(dense_partial(w, x, 0, len(s)),
                                          dense_partial(model.dense_weights(layer), x, s.start, s.stop))
    assert held == {p: plan.bytes_of(p, shape) for p in ("a", "b")}
