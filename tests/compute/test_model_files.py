"""A checkpoint missing a tensor its config needs is refused by name at load, not computed around."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from swarm.compute import load_model
from swarm.errors import ModelFileError


def _without(src, dst, tensor: str):
    """A copy of the HF directory ``src`` whose safetensors lack ``tensor``."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        state = load_file(shard)
        if tensor in state:
            del state[tensor]
            save_file(state, shard, metadata={"format": "pt"})
            return dst
    raise AssertionError(f"{tensor} is not in {src}")


@pytest.mark.parametrize("family, tensor", [
    ("qwen2", "lm_head.weight"),  # config: tie_word_embeddings = false
    ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight"),
])
def test_missing_required_tensor_is_named(tiny, tmp_path, family, tensor):
    _, src = tiny(family)
    load_model(src)  # the whole checkpoint loads
    with pytest.raises(ModelFileError, match=rf"tensor '{tensor}' is missing"):
        load_model(_without(src, tmp_path / family, tensor))


def test_kv_cache_grows_with_the_sequence_up_to_the_context(smollm2_model):
    """Room follows the tokens written (doubling), never past the model's context."""
    from swarm.compute.model import KVCache

    c = smollm2_model.config
    cache = smollm2_model.new_cache()
    start = cache.capacity
    assert start <= 256
    smollm2_model.forward(list(range(10, 10 + start + 1)), cache, last_only=True)
    assert cache.length == start + 1 and cache.capacity == 2 * start  # grown by what was written
    odd = dataclasses.replace(c, max_position_embeddings=1000)  # doubling from 16 would give 1024
    big = KVCache(odd, capacity=16)
    big.reserve(990)
    assert big.capacity == 1000 and big.layer(0)[0].shape == (c.n_kv_heads, 1000, c.head_dim)


def test_kv_cache_holds_arrays_only_for_the_layers_that_ran_here(smollm2_model):
    """A stage's layers fill their KV arrays; the layers another peer runs never get any (the
    memory a peer plans for under stages is its own layers' KV cache), and growing keeps it so."""
    import numpy as np

    c = smollm2_model.config
    cache = smollm2_model.new_cache(16)
    x = np.random.default_rng(0).standard_normal((20, c.hidden_size)).astype(np.float32)
    smollm2_model.layers(x, cache, 0, 3, 7)  # 20 rows: the arrays grow past 16
    held = [i for i, k in enumerate(cache.k) if k is not None]
    assert held == [3, 4, 5, 6] and [i for i, v in enumerate(cache.v) if v is not None] == held
    assert all(cache.k[i].shape == (c.n_kv_heads, cache.capacity, c.head_dim) for i in held)
    assert cache.capacity >= 20 and np.abs(cache.k[3][:, :20]).sum() > 0
