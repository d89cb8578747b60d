"""A GPU peer (``join --gpu on``: the WGSL kernels through wgpu, lavapipe in CI) as a stage peer
in a real swarm of two over loopback links, on the default model (SmolLM2-135M, Q4_1): it runs
its stage's layers wholly on the GPU, weights in the file's Q4_1 blocks and each sequence's keys
and values in GPU buffers; the coordinator checks every
answer (``--verify 100``) within the stage bound of another numeric build, and the greedy tokens
are the local run's."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from swarm.compute.default_model import default_model_path
from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.node import Node
from swarm.peer.roles import SwarmRoles
from swarm.peer.worker.gpu import GpuFfn
from swarm.signaling.server import SignalingServer
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import greedy
from tests.peer.coordinator.test_stages_loopback import staged
from tests.peer.test_swarm_loopback import ADDRESS, FAST_LINKS, Peer, stop_swarm, until

pytestmark = [pytest.mark.slow, pytest.mark.browser]

PROMPTS = ([1, 504, 3458, 314, 253, 1345, 30], [1, 9690, 314, 2151, 28, 1132])  # the default model's stage test prompts
STEPS = 6


async def start_pair(peers: list[Peer], tmp_path, key: SwarmKey, server: SignalingServer,
                     idents: tuple[Identity, Identity], gpu: GpuFfn, speeds: tuple[float, float], budgets: tuple[int, int] = (1 << 30, 1 << 30),
                     gpu_memory: int = 0) -> None:
    """Start a CPU peer, then a GPU peer computing on ``gpu`` (``idents``: theirs), each on its own
    copy of the default model, under ``--layout stages`` and ``--verify 100``, appended to
    ``peers`` as they start: announced ``speeds`` (GFLOP/s), host ``budgets`` (bytes) and the GPU
    peer's ``gpu_memory`` (bytes; 0: none given)."""
    for i, (name, build, device) in enumerate((("cpu", None, None), ("gpu", gpu.build(), gpu))):
        ident = idents[i]
        model = load_model(default_model_path())  # each peer its own copy, as on separate machines
        node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name=name,
                    signal_url=server.url(ADDRESS), ffn_gflops=speeds[i], build=build, memory_budget=budgets[i],
                    gpu_memory=gpu_memory if device else 0, model_hash=model.content_hash(),
                    status_path=tmp_path / f"status-{name}.json", link_options=FAST_LINKS)
        await node.start(timeout=10)
        roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0, verify=1.0, layout="stages", device=device)
        await roles.start()
        peers.append(Peer(node, roles))


def test_a_gpu_stage_peer_gives_the_local_runs_greedy_tokens_over_real_links(tmp_path):
    path = default_model_path()

    async def main():
        key = SwarmKey(os.urandom(32))
        cpu, gpu_ident = Identity.generate(), Identity.generate()
        server = SignalingServer(key.secret, cpu.peer_id, config_dir=tmp_path)
        await server.start(ADDRESS, 0)
        gpu = await asyncio.to_thread(GpuFfn.open, "on")  # lavapipe here: "on" takes a CPU adapter too
        peers = []
        try:
            gflops = await asyncio.to_thread(gpu.measure_gflops)
            # the coordinator announces twice the GPU's measured speed: the GPU peer gets a third of the layers
            await start_pair(peers, tmp_path, key, server, (cpu, gpu_ident), gpu, (2 * gflops, gflops))
            coord, worker = peers
            await until(lambda: staged(coord, [worker]), 60, "a stage plan with the GPU peer in it")
            runs = []
            for prompt in PROMPTS:
                runs.append(await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.engine_ffn,
                                                    prompt, STEPS))
            st = coord.roles.coordinator.stages
            verify = st.tracker.observations().verify
            runner = worker.roles.worker.stage_runner
            mine = st.layout.stages[-1]
            out = (runs, st.layout, runner.served, {p for p, t in st.timing.items() if t.failures},
                   set(st.failed), verify.rows_checked, verify.rows_answered,
                   {**runner.device.held(), "resident": runner.device.resident(mine.start, mine.stop)},
                   coord.node.links[gpu_ident.peer_id].hello.ffn_gflops, gflops)
            # a re-plan prices the GPU peer by the speed its stage answers showed
            version = coord.roles.coordinator.plan_version
            coord.roles.coordinator.set_layout("auto")
            await until(lambda: (coord.node.placement or {}).get("cost", {}).get("mode") == "auto"
                        and coord.roles.coordinator.plan_version > version, 30, "a plan priced in auto mode")
            (priced,) = [p for p in coord.node.placement["cost"]["peers"] if p["peer_id"] == gpu_ident.peer_id]
            return *out, priced
        finally:
            await stop_swarm(server, peers)
            await asyncio.to_thread(gpu.close)

    (runs, layout, served, failures, failed, checked, answered, held, announced,
     gflops, priced) = run_in_netns(main, timeout_s=300, prefix="csgs", address=ADDRESS)
    gpu_stage = layout.stages[-1]
    assert len(layout.stages) == 2 and gpu_stage.peer != layout.coordinator and gpu_stage.stop == 30
    model = load_model(path)
    for prompt, run in zip(PROMPTS, runs, strict=True):
        ref = greedy(model, None, prompt, STEPS)
        assert run[0] == ref[0]  # greedy tokens: the local run's
        for a, b in zip(run[1], ref[1], strict=True):  # logits: float32 reassociation apart
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    assert served == len(PROMPTS) * (STEPS + 1) and not failures and not failed  # none refused, none distrusted
    assert answered > 0 and checked == answered  # every row checked against the stage bound
    assert held["cpu"] == 0 and held["formats"] == {"q4_1"} and held["gpu"] > 0  # the file's blocks, all on the GPU
    assert held["resident"]  # whole layers there: norms, RoPE, attention, the KV cache in GPU buffers
    assert announced == gflops > 0  # the planner prices it by what it measured: first its hello,
    assert priced["observed"] and priced["gflops"] != round(gflops, 2)  # then its stage answers
