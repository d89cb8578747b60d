"""The families added for the big open models — GLM-4.5 MoE, DeepSeek-V3 (MLA, latent KV cache),
MiniMax-M2, gpt-oss, Qwen3.5-MoE (linear attention: a recurrent state per sequence) — over real
links, two peers on this machine, the oracle the local engine:

- stages: the worker (half the coordinator's speed) holds layer 2 — attention, its KV cache
  (DeepSeek-V3's latent one, gpt-oss's sliding-window layer with sinks; Qwen3.5's is a
  linear-attention layer, its recurrent state rebuilt instead) and the MoE FFN; the logits are
  the local run's bits until the
  worker is stopped at decode step 4, and its layers then move to the coordinator, their cache
  rebuilt from the rows that had entered them: the same tokens and bits to the end;
- ranges: every MoE layer's experts cut between the two peers, and the dense first layers
  (GLM-4.5, DeepSeek-V3) cut into MLP ranges; the bits of the local run under the same plan.
  gpt-oss's biased experts are not cut into shipped slices (the slicer refuses them), so its
  worker computes its expert range from its own copy of the model file through
  ``Model.expert_weights`` (biases and clamped SwiGLU included), as every worker here does.

Each tiny random checkpoint (tests/compute/tiny_sigmoid_moe.py, tiny_gpt_oss.py,
tiny_qwen3_5_moe.py) is built once.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from swarm.compute.ffn import LocalFFN
from swarm.compute.model import load_model
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import PROMPT, greedy
from tests.peer.coordinator.test_stages_loopback import ADDRESS, run_stage_swarm, start_stage_swarm
from tests.peer.test_swarm_loopback import until

pytestmark = pytest.mark.slow

FAMILIES = ["glm4_moe", "deepseek_v3", "minimax_m2", "gpt_oss", "qwen3_5_moe"]
DECODE, KILL_AT = 8, 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """family → its tiny HF checkpoint directory, built lazily, once per module."""
    built: dict = {}

    def get(family):
        if family not in built:
            out = tmp_path_factory.mktemp(family)
            if family == "gpt_oss":
                from tests.compute.tiny_gpt_oss import build
                built[family] = build(out)[1]
            elif family == "qwen3_5_moe":
                from tests.compute.tiny_qwen3_5_moe import build as build_qwen
                built[family] = build_qwen(out)[1]
            else:
                from tests.compute.tiny_sigmoid_moe import build
                built[family] = build(family, out)[1]
        return built[family]

    return get


def assert_same_run(run, ref):
    tokens, logits = run
    assert tokens == ref[0]
    assert all(np.array_equal(a, b) for a, b in zip(logits, ref[1], strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stage_plan_over_a_real_link_gives_the_local_bits_and_survives_its_peer(checkpoint, family, tmp_path):
    model_dir = checkpoint(family)
    run, layout, served, rebuilt, failed, _ = run_stage_swarm(tmp_path, model_dir, PROMPT, DECODE, kill_at=KILL_AT)
    assert [(s.start, s.stop) for s in layout.stages] == [(0, 2), (2, 3)]
    assert layout.stages[0].peer == layout.coordinator
    assert_same_run(run, greedy(load_model(model_dir), None, PROMPT, DECODE))
    # the prefill and the decode steps before the loss ran on the worker; after it, here
    assert failed == {layout.stages[1].peer} and served >= KILL_AT and rebuilt >= len(PROMPT) + KILL_AT


def run_range_swarm(tmp_path, model_dir, prompt, n):
    """Two peers (speeds 2:1) under ``layout="ranges"``: once the worker serves the plan, one
    greedy run through the coordinator's remote FFN; returns (run, plan, worker id, requests the
    worker served, failed peers)."""
    async def main():
        server, peers = await start_stage_swarm(tmp_path, model_dir, [2.0, 1.0], layout="ranges")
        try:
            coord, worker = peers
            me = worker.node.peer_id

            def planned():
                ffn = coord.roles.coordinator.ffn
                server = worker.roles.worker.server
                return (ffn is not None and ffn.pending_plan is None and me in ffn.plan.workers()
                        and server is not None and server.serves(ffn.plan.term, ffn.plan.version))

            await until(planned, 40, "a range plan with the worker in it")
            c = coord.roles.coordinator
            assert c.stages is None and c.engine_ffn is c.ffn
            run = await asyncio.to_thread(greedy, coord.roles.model, c.engine_ffn, prompt, n)
            return run, c.ffn.plan, me, worker.roles.worker.server.served, set(c.ffn.failed)
        finally:
            for p in peers:
                await p.stop()
            await server.stop()

    return run_in_netns(main, timeout_s=240, prefix="cst", address=ADDRESS)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_ranges_over_a_real_link_give_the_local_bits(checkpoint, family, tmp_path):
    model_dir = checkpoint(family)
    model = load_model(model_dir)
    run, plan, worker_id, served, failed = run_range_swarm(tmp_path, model_dir, PROMPT, DECODE)
    c = model.config
    assert all(plan.expert_span(layer, worker_id) is not None for layer in c.moe_layers)
    dense = [layer for layer in range(c.n_layers) if layer not in c.moe_layers]
    assert dense == ([] if family in ("minimax_m2", "gpt_oss", "qwen3_5_moe") else [0])
    assert all(plan.dense_span(layer, worker_id) is not None for layer in dense)
    assert_same_run(run, greedy(model, LocalFFN(model, plan.dense_ranges()), PROMPT, DECODE))
    # a request whose deadline a stall on a loaded machine outran is recomputed here (same bits)
    assert served > 0 and not failed
