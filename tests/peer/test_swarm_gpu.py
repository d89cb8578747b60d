"""A GPU peer (``join --gpu on``: the WGSL kernels through wgpu, lavapipe in CI) in a real swarm
of two over loopback links: it is shipped its slices in the file's encoding (Q4_1 blocks, F32
where the file has F32), uploads them as they are, computes its share of every layer on the
GPU, and the coordinator, checking every answer (``--verify 100``) against the format's bound,
gets the local run's greedy tokens."""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass

import gguf
import numpy as np
import pytest

from swarm.compute.ffn import LocalFFN
from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.node import Node
from swarm.peer.roles import SwarmRoles
from swarm.peer.worker.gpu import GpuFfn
from swarm.signaling.server import SignalingServer
from tests.compute.tiny_gguf import write_gguf_from_hf
from tests.compute.tiny_models import build_tiny
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import PROMPT, greedy
from tests.peer.test_swarm_loopback import ADDRESS, FAST_LINKS, Peer, agreed, stop_swarm, until

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@dataclass
class CpuAndGpu:
    """A swarm of two over loopback links (:func:`cpu_and_gpu`): ``peers[0]`` holds ``model`` and
    coordinates, ``peers[1]`` computes on ``gpu`` (announcing ``gflops``, measured) without it."""

    peers: list[Peer]
    model: object
    gpu: GpuFfn
    gflops: float
    gpu_id: str


@asynccontextmanager
async def cpu_and_gpu(path, tmp_path, **roles):
    """Start :class:`CpuAndGpu` on the model file ``path`` (lavapipe here: ``--gpu on`` takes a CPU
    adapter too), both peers checking every answer (``--verify 100``), ``roles`` the SwarmRoles'
    other options; stopped on leaving. Yields when the peer with the model coordinates."""
    key = SwarmKey(os.urandom(32))
    cpu, gpu_ident = Identity.generate(), Identity.generate()
    server = SignalingServer(key.secret, cpu.peer_id, config_dir=tmp_path)
    await server.start(ADDRESS, 0)
    model = load_model(path)
    gpu = await asyncio.to_thread(GpuFfn.open, "on")
    peers: list[Peer] = []
    try:
        gflops = await asyncio.to_thread(gpu.measure_gflops)
        for ident, name, has, g, build, device in ((cpu, "cpu", True, 1.0, None, None),
                                                  (gpu_ident, "gpu", False, gflops, gpu.build(), gpu)):
            node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name=name,
                        signal_url=server.url(ADDRESS), ffn_gflops=g, build=build, memory_budget=1 << 30,
                        model_hash=model.content_hash() if has else None,
                        status_path=tmp_path / f"status-{name}.json", link_options=FAST_LINKS)
            await node.start(timeout=10)
            started = SwarmRoles(node, model if has else None, serve_api=False, startup_quiet_s=1.0,
                                 verify=1.0, device=device, **roles)
            await started.start()
            peers.append(Peer(node, started))
        await until(lambda: agreed(peers) == cpu.peer_id, 30, "the peer with the model coordinating")
        yield CpuAndGpu(peers, model, gpu, gflops, gpu_ident.peer_id)
    finally:
        await stop_swarm(server, peers)
        await asyncio.to_thread(gpu.close)


def test_a_gpu_peer_serves_its_share_with_the_wgsl_kernels_and_the_tokens_are_the_local_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(tmp_path / "cache"))
    hf, _ = build_tiny("qwen3_moe", tmp_path / "hf")  # MoE layers 0 and 2, dense layer 1
    path = write_gguf_from_hf(hf, "qwen3_moe", tmp_path / "tiny-q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)

    async def main():
        async with cpu_and_gpu(path, tmp_path) as swarm:
            peers, gpu = swarm.peers, swarm.gpu
            ffn = peers[0].roles.coordinator.ffn
            hello = peers[0].node.links[swarm.gpu_id].hello
            run = await asyncio.to_thread(greedy, swarm.model, ffn)
            shown = {p["peer_id"]: p.get("gpu") for p in peers[0].node.status()["peers"]}
            assert shown == {swarm.gpu_id: gpu.adapter}  # status names the GPU peer's adapter
            worker = peers[1].roles.worker.server
            return (run, ffn.plan, worker.served, ffn.verified, ffn.local_fallbacks, set(ffn.failed), hello.build.blas,
                    gpu.adapter, hello.ffn_gflops, swarm.gflops, gpu.cpu_blocks, type(worker.source).__name__)

    (run, plan, served, verified, fallbacks, failed, blas, adapter, announced, gflops, cpu_blocks,
     source) = run_in_netns(main, timeout_s=240, prefix="csg", address=ADDRESS)
    model = load_model(path)
    ref = greedy(model, LocalFFN(model, plan.dense_ranges()))
    assert run[0] == ref[0]  # greedy tokens: the local run's
    for a, b in zip(run[1], ref[1], strict=True):  # logits: float32 reassociation apart
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    assert served > 0 and verified >= served and fallbacks == 0 and not failed  # every answer checked, none refused
    assert blas.startswith("wgpu ") and blas.endswith(f"adapter:{adapter}") and "kernels:q4_0,q4_1" in blas
    assert announced == gflops > 0  # the planner prices it by what it measured
    assert cpu_blocks == 0 and source == "ShippedWeights"  # every block on the GPU, shipped in the file's encoding
