"""A peer of the other activation numerics (``--numerics int8``: 8-bit activations) answers
within ``--verify``'s bound once the activation term is added (bounds.INT8_RTOL), and not within
the float32 bound; a lie beyond the bound is still caught."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from bench.random_gguf import random_blocks
from swarm.compute import numerics
from swarm.compute.ffn import swiglu_ffn
from swarm.compute.kernels import MLPWeights
from swarm.compute.quant import QMatrix
from swarm.peer.coordinator.bounds import INT8_KERNELS, ffn_rtol, int8_either, rows_outside, stage_rtol

H, F, T = 256, 768, 8


def block(qtype, seed):
    rng = np.random.default_rng(seed)
    if qtype == QT.Q8_0:
        mats = [QMatrix(quantize(rng.standard_normal((r, c), dtype=np.float32) * c ** -0.5, qtype), qtype, c)
                for r, c in ((F, H), (F, H), (H, F))]
    else:  # random K-quant blocks of a Gaussian's spread (gguf cannot write them)
        mats = [QMatrix(random_blocks(rng, r, c, qtype, c ** -0.5), qtype, c) for r, c in ((F, H), (F, H), (H, F))]
    return MLPWeights(*mats), rng.standard_normal((T, H), dtype=np.float32)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_an_int8_answer_is_inside_the_int8_bound_and_a_lie_is_not(qtype):
    w, x = block(qtype, 3)
    local = swiglu_ffn(w, x)
    numerics.set_numerics("int8")
    try:
        remote = swiglu_ffn(w, x)
    finally:
        numerics.set_numerics("float32")
    rtol = ffn_rtol(H, F, int8=True)
    assert not rows_outside(remote, local, rtol).any()
    assert rows_outside(remote, local, ffn_rtol(H, F)).any()  # not the float32 numbers
    lie = remote.copy()
    lie[5, 9] += 2 * rtol * np.abs(local[5]).max()
    assert rows_outside(lie, local, rtol).tolist() == [i == 5 for i in range(T)]
    assert rows_outside(remote * np.float32(1.1), local, rtol).all()


def test_the_int8_term_applies_where_either_side_quantizes():
    assert int8_either("f32", INT8_KERNELS) and int8_either(INT8_KERNELS, "f32")
    assert int8_either(INT8_KERNELS, INT8_KERNELS) and not int8_either("f32", "f32")
    assert stage_rtol(4, H, F, 10, int8=True) > stage_rtol(4, H, F, 10) + 4 * 0.03


def test_a_peer_under_int8_is_another_numeric_build():
    from swarm.peer.node import numeric_build

    ours = numeric_build()
    numerics.set_numerics("int8")
    try:
        theirs = numeric_build()
    finally:
        numerics.set_numerics("float32")
    assert (ours.kernel_dtype, theirs.kernel_dtype) == ("f32", INT8_KERNELS) and ours != theirs


def test_the_coordinator_widens_the_bound_for_peers_of_the_other_numerics():
    """LoopDispatcher._approximate: a CPU peer whose build differs only in kernel_dtype is
    approximate and quantized; one of our own build is neither; a float32 peer of another
    release is approximate but not quantized."""
    from dataclasses import replace
    from types import SimpleNamespace

    from swarm.peer.coordinator.handoff import LoopDispatcher
    from swarm.peer.node import numeric_build

    ours = numeric_build()

    def link(build):
        return SimpleNamespace(hello=SimpleNamespace(build=build, peer_kind="python"))
    node = SimpleNamespace(hello=SimpleNamespace(build=ours), links={
        "same": link(ours), "int8": link(replace(ours, kernel_dtype=INT8_KERNELS)),
        "older": link(replace(ours, package="0.0.1"))})
    peers, repacked, quantized = LoopDispatcher._approximate(SimpleNamespace(node=node, model=None))
    assert peers == {"int8", "older"} and repacked == set() and quantized == {"int8"}
