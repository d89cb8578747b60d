"""Fixtures shared by the peer tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def engine():
    """The real SmolLM2 model and its tokenizer, weights materialized: ``(model, tokenizer)``.

    Loaded once for tests/peer: no test changes them (a test wanting another chat template
    serves a copy of the tokenizer, ``dataclasses.replace``)."""
    from swarm.compute.default_model import default_model_path
    from swarm.compute.model import load_model
    from swarm.compute.tokenizer import load_tokenizer

    path = default_model_path()
    model, tokenizer = load_model(path), load_tokenizer(path)
    model.materialize()
    return model, tokenizer
