"""Whom an int8 coordinator that is itself a GPU peer plans and how it checks them: against the
build it computes its own share with (its CPU's, ``Node.cpu_build``), not its Hello's wgpu build."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.peer.coordinator.handoff import LoopDispatcher
from swarm.peer.coordinator.role import CoordinatorRole
from swarm.peer.net.messages import ADAPTER_PREFIX, INT8_KERNEL_DTYPE, Hello, NumericBuild

CPU = NumericBuild(package="1.0", numpy="2.0", blas="openblas 0.3.27 numba 0.60", arch="x86_64",
                   kernel_dtype=INT8_KERNEL_DTYPE)
GPU = NumericBuild(package="1.0", numpy="2.0", blas=f"wgpu 0.19 vulkan x8:q4_k,q6_k,q8_0 {ADAPTER_PREFIX}NVIDIA H100",
                   arch="x86_64", kernel_dtype=INT8_KERNEL_DTYPE)
OTHER_CPU = NumericBuild(package="1.0", numpy="2.0", blas="mkl 2024 numba 0.60", arch="x86_64",
                         kernel_dtype=INT8_KERNEL_DTYPE)


def _hello(peer: str, build: NumericBuild) -> Hello:
    return Hello(peer_id=peer, protocol_version=1, build=build, model_hash=None, memory_budget=1 << 30,
                 ffn_gflops=1.0, peer_kind="python", adapter_limits={}, adapter_features=(), name=peer)


def _coordinator(own: NumericBuild, **peers: NumericBuild) -> SimpleNamespace:
    """A stand-in for the role (``node`` with its Hello, CPU build and links; no model): enough for
    ``_computes_ours`` and ``_approximate``."""
    node = SimpleNamespace(hello=_hello("coord", own), cpu_build=CPU,
                           links={p: SimpleNamespace(hello=_hello(p, b)) for p, b in peers.items()})
    return SimpleNamespace(node=node, model=None, _x8_refusal=lambda build: None)


def test_a_gpu_coordinator_plans_the_cpu_peers_of_its_cpu_build():
    coord = _coordinator(GPU)
    assert CoordinatorRole._computes_ours(coord, CPU)  # the build it computes its share with
    assert not CoordinatorRole._computes_ours(coord, OTHER_CPU)  # another CPU build: other int8 bits
    assert CoordinatorRole._computes_ours(coord, GPU)  # a GPU peer: its answers are checked by its rows


def test_a_gpu_coordinator_checks_gpu_peers_by_bound_and_its_cpu_build_bit_for_bit():
    # A GPU peer of the coordinator's own wgpu build computes on its GPU, not as the coordinator
    # does: checked by bound (an int8 swarm's: by its down rows), never bit for bit.
    approximate, _ = LoopDispatcher._approximate(_coordinator(GPU, twin=GPU, cpu=CPU, other=OTHER_CPU))
    assert approximate == {"twin", "other"}
    approximate, _ = LoopDispatcher._approximate(_coordinator(CPU, gpu=GPU, cpu=CPU))
    assert approximate == {"gpu"}
