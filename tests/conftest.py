"""Shared fixtures for the whole suite.

Tests that need something missing (a package, root for network namespaces, Chromium)
fail loudly with what to install; they are never skipped silently.
"""

from __future__ import annotations

import os

import pytest

# Keep BLAS deterministic and within the 2 cores of CI.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def require(condition: bool, what: str) -> None:
    """Fail (never skip) when a test prerequisite is missing; `what` says how to get it."""
    if not condition:
        pytest.fail(f"missing test prerequisite: {what}", pytrace=False)
