"""A GPU peer (``join --gpu on --numerics int8``: the GPU's int8 GEMVs through wgpu, lavapipe in
CI) in a real int8 swarm of two over loopback links: the coordinator's role plans it (another
build of the int8 numerics, ranges only) for a Q8_0 model, it is shipped its slices and answers
with the int8 rows of its down products, and the coordinator, checking every answer
(``--verify 100``) by those rows, gets the local int8 run's greedy tokens."""

from __future__ import annotations

import asyncio

import gguf
import numpy as np
import pytest

from swarm.compute import numerics
from swarm.compute.ffn import LocalFFN
from swarm.compute.int8_swiglu import swiglu_int8
from swarm.compute.model import load_model
from tests.compute.tiny_gguf import write_gguf_from_hf
from tests.compute.tiny_models import build_tiny
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import greedy
from tests.peer.test_swarm_gpu import cpu_and_gpu
from tests.peer.test_swarm_loopback import ADDRESS, until

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_an_int8_gpu_peer_serves_its_ranges_checked_by_its_down_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)
    numerics.set_numerics("int8")  # both peers of this process: the coordinator's numerics and the GPU peer's
    hf, _ = build_tiny("qwen3_moe", tmp_path / "hf", intermediate_size=128, moe_intermediate_size=64)
    path = write_gguf_from_hf(hf, "qwen3_moe", tmp_path / "tiny-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    swiglu_int8(load_model(path).dense_weights(1), np.ones((1, 64), np.float32))  # the int8 kernels, from their cache
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(tmp_path / "cache"))  # the shipped slices: this test's own

    async def main():
        async with cpu_and_gpu(path, tmp_path, layout="ranges") as swarm:  # its gflops: the int8 path's
            ffn = swarm.peers[0].roles.coordinator.ffn
            await until(lambda: swarm.gpu_id in ffn.plan.workers(), 30, "the GPU peer planned")
            run = await asyncio.to_thread(greedy, swarm.model, ffn)
            worker = swarm.peers[1].roles.worker.server
            left_out = [e for e in swarm.peers[0].node.activity if e["what"] == "left out"]
            return (run, ffn.plan, worker.served, ffn.verified, ffn.local_fallbacks, set(ffn.failed),
                    swarm.gpu_id in ffn.approximate, worker.answers_rows, swarm.gpu.cpu_products, left_out)

    (run, plan, served, verified, fallbacks, failed, approximate, rows, cpu_products,
     left_out) = run_in_netns(main, timeout_s=240, prefix="csi", address=ADDRESS)
    model = load_model(path)
    ref = greedy(model, LocalFFN(model, plan.dense_ranges()))
    assert run[0] == ref[0]  # greedy tokens: the local int8 run's
    for a, b in zip(run[1], ref[1], strict=True):  # another summation order; a rare down value a step apart
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
    assert approximate and rows and cpu_products == 0 and not left_out
    assert served > 0 and verified >= served and fallbacks == 0 and not failed  # every answer checked, none refused
