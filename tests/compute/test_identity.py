"""The model's identity (``content_hash``): the same model gives the same id wherever it lies,
another model (metadata, sampled tensor bytes, shard set, config.json) another id; a restart
finds it in the cache without reading the model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import gguf
import numpy as np
import pytest

from swarm.compute import identity, load_model
from swarm.compute.identity import WINDOW_BYTES, compute_identity, model_identity, sample_windows
from swarm.compute.tensors import GGUFFile
from tests.compute.tiny_gguf import write_gguf_from_hf


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(tmp_path / "cache"))


def _files(path):
    f = GGUFFile(path)
    return list(zip(f.paths, f.header_bytes))


def _flip(path, at):
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_the_id_is_a_sha256_that_ignores_where_the_model_lies(tiny, tmp_path):
    hf, hf_dir = tiny("qwen3_moe")
    path = write_gguf_from_hf(hf, "qwen3_moe", tmp_path / "m.gguf")
    ident = load_model(path).content_hash()
    assert len(ident) == 64 and int(ident, 16) >= 0 and ident == ident.lower()
    assert ident != hashlib.sha256(path.read_bytes()).hexdigest()  # no longer the whole file's hash
    (tmp_path / "elsewhere").mkdir()
    copy = shutil.copy(path, tmp_path / "elsewhere" / "renamed.gguf")
    assert load_model(copy).content_hash() == ident
    assert compute_identity(_files(copy)) == ident
    hf_copy = shutil.copytree(hf_dir, tmp_path / "hf")
    assert load_model(hf_copy).content_hash() == load_model(hf_dir).content_hash() != ident


def test_changed_metadata_gives_another_id(tiny, tmp_path):
    hf, _ = tiny("llama")
    path = write_gguf_from_hf(hf, "llama", tmp_path / "m.gguf")
    f = GGUFFile(path)
    w = gguf.GGUFWriter(str(tmp_path / "renamed.gguf"), "llama")
    for k, v in f.kv.items():
        if k != "general.architecture":
            w.add_key_value(k, v, f.value_types[k])
    w.add_name("another name")  # the same tensors, one more metadata key
    for name in f.shapes:
        w.add_tensor(name, f.load(name))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert compute_identity(_files(tmp_path / "renamed.gguf")) != compute_identity(_files(path))


def test_changed_config_json_gives_another_id(tiny, tmp_path):
    _, hf_dir = tiny("qwen2")
    hf_copy = shutil.copytree(hf_dir, tmp_path / "hf")
    cfg = hf_copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": ', '"rms_norm_eps": 1e-5, "unused": ', 1))
    assert load_model(hf_copy).content_hash() != load_model(hf_dir).content_hash()


def _big_gguf(path, mib=16, seed=0):
    """One F32 tensor of ``mib`` MiB of random numbers: more data than the windows cover."""
    a = np.random.default_rng(seed).standard_normal((mib << 16, 4)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("t", a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return _files(path)


def test_a_byte_changed_in_a_window_changes_the_id_one_outside_does_not(tmp_path):
    files = _big_gguf(tmp_path / "big.gguf")
    ((path, header),) = files
    windows = sample_windows([(path.stat().st_size, header)])[0]
    assert sum(n for _, n in windows) <= (identity.WINDOWS + 2) * WINDOW_BYTES < path.stat().st_size // 3
    before = compute_identity(files)
    lo, n = windows[len(windows) // 2]
    _flip(path, lo + n // 2)
    inside = compute_identity(files)
    assert inside != before
    gap = windows[1][0] - 1  # just before the second window: read by no window
    assert not any(lo <= gap < lo + n for lo, n in windows)
    _flip(path, gap)
    assert compute_identity(files) == inside  # the documented limit: unsampled bytes are not read


def test_the_shard_set_is_part_of_the_id(tiny, tmp_path):
    hf, _ = tiny("qwen3_moe")
    whole = write_gguf_from_hf(hf, "qwen3_moe", tmp_path / "m.gguf")
    n = len(GGUFFile(whole).shapes)
    ids = {compute_identity(_files(whole))}
    for shards in (2, 3):
        first = write_gguf_from_hf(hf, "qwen3_moe", tmp_path / f"s{shards}.gguf", split_max_tensors=-(-n // shards))
        assert len(_files(first)) == shards
        ids.add(load_model(first).content_hash())
    assert len(ids) == 3


def test_a_restart_reads_the_id_from_the_cache_until_the_file_changes(tmp_path, monkeypatch):
    files = _big_gguf(tmp_path / "big.gguf", mib=1)
    first = model_identity(files)
    assert first == compute_identity(files)

    def no_reading(_files):
        raise AssertionError("the model was read again")

    monkeypatch.setattr(identity, "compute_identity", no_reading)
    assert model_identity(files) == first  # another process, same cache: nothing read
    path = files[0][0]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(AssertionError, match="read again"):
        model_identity(files)  # a newer mtime: computed again
    monkeypatch.undo()
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(tmp_path / "cache"))
    assert model_identity(files) == first  # same bytes, same id


def test_without_a_usable_cache_the_id_is_computed(tmp_path, monkeypatch):
    files = _big_gguf(tmp_path / "big.gguf", mib=1)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # cannot be created
    assert model_identity(files) == compute_identity(files)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / identity.CACHE_FILE).write_text("{not json")
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(cache))
    assert model_identity(files) == compute_identity(files)  # a damaged cache is written anew
    assert list(json.loads((cache / identity.CACHE_FILE).read_text()).values()) == [compute_identity(files)]
