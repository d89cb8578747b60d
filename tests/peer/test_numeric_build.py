"""A peer's numeric build announces what it computes for a swarm, its activation numerics
included: a coordinator gives work only to peers of its own (docs/weights.md, "Two numerics")."""

from __future__ import annotations

import pytest

from swarm.compute import numerics
from swarm.peer.net.messages import NumericBuild
from swarm.peer.node import numeric_build


@pytest.fixture
def restored_numerics(monkeypatch):
    """The process's numerics as they were, restored after the test; the environment untouched."""
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)


def test_numeric_build_names_the_numerics(restored_numerics):
    numerics.set_numerics("int8")
    int8 = numeric_build()
    assert int8.kernel_dtype == "i8" and int8.numerics == "int8"
    numerics.set_numerics("float32")
    f32 = numeric_build()
    assert f32.kernel_dtype == "f32" and f32.numerics == "float32"
    assert f32 != int8  # another build: never checked bit for bit against the other
    assert " numba " in f32.blas  # numba compiles every kernel: another numba, another build


@pytest.mark.parametrize("dtype", ["f32", "f16", "q4_k", "webgpu", ""])
def test_every_other_kernel_dtype_is_float32(dtype):
    # A page names its weight format there, a GPU peer f32: both take float32 activations.
    assert NumericBuild("0.1", "2.0", "webgpu", "wasm", dtype).numerics == "float32"
