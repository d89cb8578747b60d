"""A peer's numeric build announces what it computes for a swarm, which computes float32 (the
coordinator's results are a local run's bits): under the int8 numerics it is refused, naming int8
and where int8 runs instead (docs/weights.md, "Two numerics")."""

from __future__ import annotations

import pytest

from swarm.compute import numerics
from swarm.errors import SwarmError
from swarm.peer.node import numeric_build


@pytest.fixture
def restored_numerics(monkeypatch):
    """The process's numerics as they were, restored after the test; the environment untouched."""
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)


def test_numeric_build_is_refused_under_int8(restored_numerics):
    numerics.set_numerics("int8")
    with pytest.raises(SwarmError) as exc:
        numeric_build()
    message = str(exc.value)
    assert "int8" in message and "float32" in message and "a local run's bits" in message
    assert "generate --numerics int8" in message
    assert "unset $COLIBRI_SWARM_NUMERICS" in message  # what to do


def test_numeric_build_under_float32(restored_numerics):
    numerics.set_numerics("float32")
    assert numeric_build().kernel_dtype == "f32"
