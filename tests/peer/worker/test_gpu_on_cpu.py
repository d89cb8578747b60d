"""A GPU peer's work that passes the GPU memory it announced (docs/planner.md, "GPU memory")
runs on its CPU, as a CPU peer's would: its stage through the engine's own layers, its FFN
slices through the engine's kernels — the CPU peer's bits exactly, nothing uploaded to the GPU —
by the rule the planner prices it with (swarm.peer.plan.gpu_holds). The same worker given a
GPU that holds the work computes there (another numeric build: not the CPU's bits), so the
equality is not the GPU's."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.peer.net import messages as M
from swarm.peer.plan import Stage, StageLayout
from swarm.peer.weights.sizes import stage_nbytes
from swarm.peer.worker.gpu import GpuFfn, GpuStage
from swarm.peer.worker.stages import StageRunner
from tests.peer._swarm_models import COORD, W1
from tests.peer.worker.test_gpu_stages import WIDE, gguf_model, request

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def gpu():
    device = GpuFfn.open("on")
    yield device
    device.close()


def answers(runner: StageRunner, model, stop: int) -> list[np.ndarray]:
    """The runner's rows for a prefill of 6 rows and two decode steps of one sequence, then a step
    of that sequence beside a new one, through layers 0:stop."""
    layout = StageLayout(1, 1, COORD, (Stage(W1, 0, stop), Stage(COORD, stop, model.config.n_layers)))
    runner.accept(layout)
    runner.prepare()
    rng = np.random.default_rng(11)
    H = model.config.hidden_size
    steps = [[(1, 0, 6)], [(1, 6, 1)], [(1, 7, 1)], [(1, 8, 1), (2, 0, 3)]]
    out = []
    for rid, segments in enumerate(steps, 1):
        x = rng.standard_normal((sum(s[2] for s in segments), H), np.float32)
        answer = runner.handle(request(rid, segments, x, stop))
        assert isinstance(answer, M.StageAnswer), answer
        out.append(answer.x)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_stage_past_the_gpu_memory_computes_on_the_cpu_with_the_cpu_peers_bits(gpu, tmp_path, monkeypatch, family):
    model = gguf_model(tmp_path, monkeypatch, family, QT.Q8_0, **(WIDE if family == "llama" else {}))
    stop = model.config.n_layers - 1
    held, step = stage_nbytes(model, 0, stop)
    cpu_peer = answers(StageRunner(W1, model), model, stop)

    small = GpuStage(gpu, model)  # a GPU that holds not even the stage's first layer with its KV cache
    too_small = StageRunner(W1, model, device=small, gpu_memory=step + stage_nbytes(model, 0, 1)[0] // 2)
    assert not too_small.on_device(0, stop)
    for got, want in zip(answers(too_small, model, stop), cpu_peer):
        assert np.array_equal(got, want)
    assert small.held() == {"gpu": 0, "cpu": 0, "formats": set()}  # nothing uploaded: the GPU untouched

    big = GpuStage(gpu, model)
    fits = StageRunner(W1, model, device=big, gpu_memory=step + held)  # exactly the stage: the GPU's
    assert fits.on_device(0, stop)
    on_gpu = answers(fits, model, stop)
    assert big.held()["gpu"] > 0 and not all(np.array_equal(a, b) for a, b in zip(on_gpu, cpu_peer))


def test_ffn_slices_past_the_gpu_memory_compute_on_the_cpu_with_the_engines_bits(gpu, tmp_path):
    from swarm.compute.ffn import swiglu_ffn
    from swarm.compute.model import load_model
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.plan import ModelShape
    from swarm.peer.worker.ffn import Worker
    from tests.peer._swarm_models import build

    model = load_model(build("qwen3_moe", tmp_path))
    shape = ModelShape.from_config(model.config)
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=1, version=1)
    held = plan.bytes_of(W1, shape)
    e = plan.expert_span(0, W1).start
    x = np.random.default_rng(3).standard_normal((4, shape.hidden_size), dtype=np.float32)
    local = swiglu_ffn(model.expert_weights(0, e), x)

    def answer(gpu_memory: int) -> np.ndarray:
        worker = Worker(W1, shape, model, gpu, gpu_memory)
        worker.accept_plan(plan)
        worker.prepare()
        got = worker.handle(M.ExpertRequest(1, 1, 1, 0, np.array([e], np.int32), np.array([4], np.int32), x))
        assert isinstance(got, M.ExpertAnswer), got
        return got.outputs

    assert np.array_equal(answer(shape.step_bytes + held - 1), local)  # one byte short: the CPU's kernels
    assert not np.array_equal(answer(shape.step_bytes + held), local)  # they fit: the GPU's
