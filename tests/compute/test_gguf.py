"""GGUF files: every quantisation type, llama.cpp's Q/K permutation, every family, bad files,
and the real SmolLM2 Q4_1 checkpoint against transformers."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import load_model
from swarm.compute.tensors import GGUFFile
from swarm.errors import ModelFileError
from tests.compute.tiny_gguf import write_gguf_from_hf
from tests.compute.tiny_models import TINY, hf_logits

TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, 96, 12)]
COLS = 512  # a multiple of every block size (32 and 256)


def _types(can_quantize: bool) -> list[QT]:
    x = np.zeros((1, COLS), np.float32)
    out = []
    for q in QT:
        if q not in gguf.GGML_QUANT_SIZES:
            continue
        try:
            gguf.quants.quantize(x, q)
            quantizes = True
        except (NotImplementedError, gguf.quants.QuantError):
            quantizes = False
        if quantizes != can_quantize:
            continue
        if not can_quantize:
            block, size = gguf.GGML_QUANT_SIZES[q]
            try:
                gguf.quants.dequantize(np.zeros((1, COLS // block * size), np.uint8), q)
            except NotImplementedError:
                continue
        out.append(q)
    return out


QUANTIZABLE = _types(True)
DEQUANT_ONLY = _types(False)


def test_the_required_types_are_covered():
    names = {q.name for q in QUANTIZABLE + DEQUANT_ONLY}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"} <= names


def _write(path, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (QT.F32,):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_quantized_tensor_loads_to_its_dequantisation(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    mat = rng.normal(size=(6, COLS)).astype(np.float32)
    stack = rng.normal(size=(3, 4, COLS)).astype(np.float32)
    qm, qs = gguf.quants.quantize(mat, qtype), gguf.quants.quantize(stack, qtype)
    _write(tmp_path / "q.gguf", {"m": (qm, qtype), "s": (qs, qtype)})
    f = GGUFFile(tmp_path / "q.gguf")
    assert f.shapes == {"m": (6, COLS), "s": (3, 4, COLS)}
    got = f.load("m")
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, gguf.quants.dequantize(qm, qtype))
    np.testing.assert_array_equal(f.load("s", 2), gguf.quants.dequantize(qs, qtype)[2])  # one expert alone
    if qtype not in (QT.TQ1_0, QT.TQ2_0, QT.MXFP4):  # ternary / fp4 are too coarse to bound tightly
        assert np.abs(got - mat).max() < 0.5 * np.abs(mat).max()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random f16 scales include inf/NaN
@pytest.mark.parametrize("qtype", DEQUANT_ONLY, ids=lambda q: q.name)
def test_dequantize_only_types_load(tmp_path, qtype):
    """Types gguf cannot quantise (K-quants, IQ*): raw random blocks, checked against gguf's decoder."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, size=(3, 4, COLS // block * size), dtype=np.uint8)
    _write(tmp_path / "q.gguf", {"s": (raw, qtype)})
    f = GGUFFile(tmp_path / "q.gguf")
    assert f.shapes["s"] == (3, 4, COLS)
    want = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(f.load("s"), want)  # NaN (random f16 scales) compare equal
    np.testing.assert_array_equal(f.load("s", 1), want[1])


# ---- whole models --------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(TINY))
def test_gguf_of_each_family_matches_transformers(tiny, family, tmp_path):
    hf, _ = tiny(family)
    model = load_model(write_gguf_from_hf(hf, family, tmp_path / f"{family}.gguf"))
    assert model.format == "gguf"
    assert model.config.family == ("llama" if family == "mistral" else family)  # llama.cpp writes Mistral as llama
    np.testing.assert_allclose(model.forward(TOKENS, model.new_cache()), hf_logits(hf, TOKENS), atol=1e-5)


def test_q8_gguf_is_close_to_the_float_model(tiny, tmp_path):
    hf, _ = tiny("llama")
    q8 = load_model(write_gguf_from_hf(hf, "llama", tmp_path / "q8.gguf", QT.Q8_0))
    assert q8.checkpoint.file.qtype("blk.0.attn_q.weight") == QT.Q8_0
    diff = np.abs(q8.forward(TOKENS, q8.new_cache()) - hf_logits(hf, TOKENS)).max()
    assert 0 < diff < 0.05


# ---- bad files ----------------------------------------------------------------------------
def test_truncated_gguf(tiny, tmp_path):
    path = write_gguf_from_hf(tiny("llama")[0], "llama", tmp_path / "m.gguf")
    data = path.read_bytes()
    for cut in (10, 200, len(data) - 1000):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match=f"{bad}.*(truncated|not a readable GGUF)"):
            load_model(bad)


def test_a_corrupt_length_in_the_header_is_named_with_the_file_size(tiny, tmp_path):
    """A string length in the metadata set absurdly high (a flipped bit, a bad tool) is named as
    such — the field's offset, the bytes it claims and where the file ends — not as a header
    running past the end of a file that is much longer."""
    path = write_gguf_from_hf(tiny("llama")[0], "llama", tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    # GGUF v3: magic, version, tensor count, kv count (24 bytes), then the first key's uint64 length
    data[24:32] = (1 << 40).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=rf"the header's field at byte 32 claims 1,099,511,627,776 bytes, "
                       rf"past the file's end at byte {len(data):,} \(a corrupt length"):
        load_model(bad)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        load_model(tmp_path / "nope.gguf")


def test_unknown_architecture(tmp_path, tiny):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFileError, match=r"g\.gguf: general\.architecture 'gpt2' is not supported"):
        load_model(tmp_path / "g.gguf")
    _, hf_dir = tiny("qwen2")
    cfg = json.loads((hf_dir / "config.json").read_text())
    bad_dir = tmp_path / "hf"
    bad_dir.mkdir()
    (bad_dir / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt_neox")))
    with pytest.raises(ModelFileError, match=r"config\.json: model_type 'gpt_neox' is not supported"):
        load_model(bad_dir)


def test_wrong_tensor_shape(tmp_path, tiny):
    hf, hf_dir = tiny("qwen2")
    bad_dir = tmp_path / "hf"
    bad_dir.mkdir()
    (bad_dir / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    cfg = json.loads((hf_dir / "config.json").read_text())
    (bad_dir / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=50)))
    with pytest.raises(ModelFileError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(48, 64\), expected \(50, 64\)"):
        load_model(bad_dir)  # found from the headers, before any weight is decoded
    # the same in a GGUF: metadata says 8 heads of 8, tensors hold 4 heads of 16
    path = write_gguf_from_hf(tiny("llama")[0], "llama", tmp_path / "m.gguf")
    f = GGUFFile(path)
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for k, v in f.kv.items():
        if k.startswith("llama.") and k != "llama.embedding_length":
            w.add_key_value(k, v, f.value_types[k])
    w.add_embedding_length(80)
    for name in f.shapes:
        w.add_tensor(name, f.load(name))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFileError, match=r"bad\.gguf: tensor 'token_embd\.weight' has shape \(96, 64\), expected \(96, 80\)"):
        load_model(tmp_path / "bad.gguf")


def test_missing_expert_tensor(tmp_path, tiny):
    from safetensors.numpy import load_file, save_file

    _, hf_dir = tiny("mixtral")
    bad_dir = tmp_path / "hf"
    bad_dir.mkdir()
    (bad_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    del tensors["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(bad_dir / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"tensor 'model\.layers\.2\.block_sparse_moe\.experts\.3\.w2\.weight' is missing"):
        load_model(bad_dir)


def test_truncated_safetensors(tmp_path, tiny):
    _, hf_dir = tiny("qwen2")
    bad_dir = tmp_path / "hf"
    bad_dir.mkdir()
    (bad_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    data = (hf_dir / "model.safetensors").read_bytes()
    (bad_dir / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ModelFileError, match=r"model\.safetensors: tensor .* lies outside the file \(truncated\?\)"):
        load_model(bad_dir)


# ---- the real default model -----------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_teacher_forced_logits_match_transformers(smollm2_path, smollm2_oracle):
    import torch

    hf, tok = smollm2_oracle  # transformers' reading of the same file, loaded once for the session
    text = ("<|im_start|>user\nWhy is the sky blue? Answer in two sentences.<|im_end|>\n<|im_start|>assistant\n"
            "The sky looks blue because air molecules scatter short blue wavelengths of sunlight much more "
            "strongly than long red ones, so blue light reaches our eyes from every direction. At sunset the "
            "light crosses more air, the blue is scattered away, and the reds and oranges remain.")
    ids = tok(text)["input_ids"][:64]
    assert len(ids) == 64
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    model = load_model(smollm2_path)
    cache = model.new_cache()
    ours = np.concatenate([model.forward(ids[:40], cache)] + [model.forward([t], cache) for t in ids[40:]])
    assert ours.shape == (64, model.config.vocab_size) == ref.shape
    assert np.abs(ours - ref).max() <= 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_bad_config_values_name_the_field(tmp_path, tiny):
    _, hf_dir = tiny("qwen3_moe")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cases = [(dict(num_hidden_layers="three"), r"field 'num_hidden_layers' must be a number, got 'three'"),
             (dict(num_key_value_heads=3), r"4 attention heads are not a multiple of 3 key/value heads"),
             (dict(num_experts_per_tok=9), r"experts per token \(9\) must be within 1\.\.8")]
    for i, (change, message) in enumerate(cases):
        bad_dir = tmp_path / f"hf{i}"
        bad_dir.mkdir()
        (bad_dir / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
        (bad_dir / "config.json").write_text(json.dumps(dict(cfg, **change)))
        with pytest.raises(ModelFileError, match=rf"config\.json: {message}"):
            load_model(bad_dir)
