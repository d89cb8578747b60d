"""Split GGUF models (llama.cpp's gguf-split layout, written by gguf-py's ``GGUFWriter``): the
engine maps tensors across the shards and gives the unsplit file's logits bit for bit; shards
that do not make one model are refused, naming the file and what to do."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import load_model
from swarm.compute.tensors import GGUFFile
from swarm.errors import ModelFileError
from tests.compute.tiny_gguf import write_gguf_from_hf

TOKENS = [int(t) for t in np.random.default_rng(1).integers(0, 96, 10)]


def _write_split(hf, family, path, shards=3, qtype=QT.F32):
    """``hf`` written once whole (``path``) and once split into ``shards`` files; returns
    (whole, the split's files in order)."""
    whole = write_gguf_from_hf(hf, family, path, qtype)
    per_shard = -(-len(GGUFFile(whole).shapes) // shards)
    first = write_gguf_from_hf(hf, family, path.with_name("split.gguf"), qtype, split_max_tensors=per_shard)
    files = [first.with_name(f"split-{i:05d}-of-{shards:05d}.gguf") for i in range(1, shards + 1)]
    assert first == files[0] and all(f.is_file() for f in files)
    return whole, files


@pytest.mark.parametrize("family,qtype", [("qwen3_moe", QT.F32), ("llama", QT.Q8_0)])
def test_split_model_gives_the_unsplit_logits_bit_for_bit(tiny, tmp_path, family, qtype):
    hf, _ = tiny(family)
    whole, files = _write_split(hf, family, tmp_path / "whole.gguf", qtype=qtype)
    want = load_model(whole).forward(TOKENS, load_model(whole).new_cache())
    for named in (files[0], files[2]):  # any shard names the model
        model = load_model(named)
        assert model.path == files[0] and model.checkpoint.files == files
        assert model.metadata == load_model(whole).metadata | {
            k: model.metadata[k] for k in ("split.no", "split.count", "split.tensors.count")}
        np.testing.assert_array_equal(model.forward(TOKENS, model.new_cache()), want)


def _shard(path):
    """One shard as gguf-py reads it: (metadata key → (value, type), tensor name → array)."""
    r = gguf.GGUFReader(path)
    kv = {f.name: (f.contents(), f.types[0]) for f in r.fields.values() if not f.name.startswith("GGUF.")}
    return kv, {t.name: np.array(t.data) for t in r.tensors}


def _rewrite(path, arch, kv, tensors):
    """Write ``path`` anew with gguf-py: metadata ``kv`` (key → (value, type)) and ``tensors``."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in kv.items():
        if key != "general.architecture":
            w.add_key_value(key, value, vtype)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.fixture
def split3(tiny, tmp_path):
    hf, _ = tiny("qwen3_moe")
    return _write_split(hf, "qwen3_moe", tmp_path / "whole.gguf")[1]


def test_a_missing_shard_is_named(split3):
    split3[1].unlink()
    with pytest.raises(ModelFileError, match=r"split-00002-of-00003\.gguf: shard 2 of 3 of this model is missing: "
                                             r"download every shard"):
        load_model(split3[0])


def test_a_shard_of_another_split_is_refused(split3):
    kv, tensors = _shard(split3[2])
    kv["split.count"] = (4, kv["split.count"][1])
    _rewrite(split3[2], "qwen3moe", kv, tensors)
    with pytest.raises(ModelFileError, match=r"split-00003-of-00003\.gguf: says it is shard 3 of 4, its name shard 3 "
                                             r"of 3: shards of different splits are mixed; download all shards"):
        load_model(split3[0])


def test_a_duplicate_tensor_is_refused(split3):
    kv, tensors = _shard(split3[2])
    name, a = next(iter(_shard(split3[1])[1].items()))
    _rewrite(split3[2], "qwen3moe", kv, {name: a, **tensors})
    with pytest.raises(ModelFileError, match=rf"split-00003-of-00003\.gguf: tensor '{name}' is also in "
                                             r"split-00002-of-00003\.gguf: a shard of another model or a copy of one"):
        load_model(split3[1])


def test_a_shard_of_a_different_model_is_refused(tiny, tmp_path, split3):
    (tmp_path / "other").mkdir()
    other = _write_split(tiny("llama")[0], "llama", tmp_path / "other" / "whole.gguf")[1]
    split3[1].write_bytes(other[1].read_bytes())  # same name and place, another model's shard 2
    with pytest.raises(ModelFileError, match=r"split-00002-of-00003\.gguf: a shard of a different model "
                                             r"\(split\.tensors\.count = \d+, split-00001-of-00003\.gguf has \d+\)"):
        load_model(split3[0])
    kv, tensors = _shard(split3[2])
    # gguf-py names the architecture in every file it writes whole: here one that is not this model's
    _rewrite(split3[1], "llama", {**kv, "split.no": (1, kv["split.no"][1])}, {})
    with pytest.raises(ModelFileError, match=r"split-00002-of-00003\.gguf: a shard of a different model "
                                             r"\(general\.architecture = 'llama', split-00001-of-00003\.gguf has "
                                             r"'qwen3moe'\)"):
        load_model(split3[0])


def test_a_wrong_tensor_count_is_refused(split3):
    kv, tensors = _shard(split3[2])
    tensors.popitem()
    _rewrite(split3[2], "qwen3moe", kv, tensors)
    with pytest.raises(ModelFileError, match=r"split-00001-of-00003\.gguf: the 3 shards hold (\d+) tensors, "
                                             r"split\.tensors\.count says \d+: a shard is from another model or "
                                             r"damaged; download all shards again"):
        load_model(split3[0])


def test_a_renamed_shard_cannot_find_the_others(split3):
    renamed = split3[0].with_name("model.gguf")
    split3[0].rename(renamed)
    with pytest.raises(ModelFileError, match=r"model\.gguf: shard 1 of a model split in 3 files, but its name is not "
                                             r"llama\.cpp's PREFIX-00001-of-00003\.gguf"):
        load_model(renamed)


def test_the_default_model_split_by_gguf_py_tokenizes_and_computes_as_the_whole(smollm2_path, smollm2_model, tmp_path):
    """SmolLM2 (Q4_1, its tokenizer in the metadata) rewritten by gguf-py in 3 shards: named by
    its last shard, the same tokens and bit-identical logits as the one file."""
    from swarm.compute.tokenizer import tokenizer_for

    r = gguf.GGUFReader(smollm2_path)
    w = gguf.GGUFWriter(str(tmp_path / "smol.gguf"), "llama", split_max_tensors=-(-len(r.tensors) // 3))
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    del r, w
    split = load_model(tmp_path / "smol-00003-of-00003.gguf")
    assert len(split.checkpoint.files) == 3
    text = "The sky is blue because"
    ids = tokenizer_for(split).encode(text)
    assert ids == tokenizer_for(smollm2_model).encode(text)
    np.testing.assert_array_equal(split.forward(ids, split.new_cache()),
                                  smollm2_model.forward(ids, smollm2_model.new_cache()))
