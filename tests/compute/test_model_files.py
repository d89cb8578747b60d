"""A checkpoint missing a tensor its config needs is refused by name at load, not computed around."""

from __future__ import annotations

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
