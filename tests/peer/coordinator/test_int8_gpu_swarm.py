"""A GPU peer in an int8 swarm (docs/weights.md, "GPU GEMVs on the CPU's int8 rows"): the worker
computes its experts and dense range with the GPU's int8 GEMVs (wgpu on lavapipe here) and
answers with the int8 rows of its down products; the coordinator, checking every answer
(``--verify 100``) by those rows, gets the local int8 run's greedy tokens, and stops a peer that
lies in its down answer or in its down rows. Over a LoopbackNet carrying every message through
the wire codec; a tiny Qwen3-MoE in Q8_0 (experts and a dense layer, widths multiples of 64)."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest

from swarm.compute import numerics
from swarm.compute.ffn import LocalFFN
from swarm.compute.model import load_model
from swarm.errors import VerificationError
from swarm.peer.coordinator.dispatch import RemoteFFN
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.net import messages as M
from swarm.peer.plan import Plan
from swarm.peer.weights.sizes import int8_gpu_refusal, model_shape
from swarm.peer.worker.ffn import Worker
from swarm.peer.worker.gpu import GpuFfn
from tests.compute.tiny_gguf import write_gguf_from_hf
from tests.compute.tiny_models import build_tiny
from tests.fakes import LoopbackNet
from tests.peer._swarm_models import COORD, W1, greedy
from web_peer.int8_activations import planes

pytestmark = pytest.mark.browser

DECODE = 6


@pytest.fixture(scope="module")
def gpu():
    device = GpuFfn.open("on")  # lavapipe here: "on" takes a CPU adapter too
    yield device
    device.close()


@pytest.fixture(scope="module")
def q8_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8-gpu")
    hf, _ = build_tiny("qwen3_moe", root / "hf", intermediate_size=128, moe_intermediate_size=64)
    return write_gguf_from_hf(hf, "qwen3_moe", root / "tiny-q8_0.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture
def int8(monkeypatch):
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)
    numerics.set_numerics("int8")


class GpuInt8Swarm:
    """A coordinator and one GPU worker of the int8 numerics over a LoopbackNet (``tamper``: a
    hook on the frames); ``gpu_memory``: what the worker announced (its slices past it: the CPU)."""

    def __init__(self, path, gpu: GpuFfn, tamper=None, gpu_memory: int | None = None) -> None:
        self.model = load_model(path)
        self.shape = model_shape(self.model)
        self.plan = build_plan(self.shape, PeerCapacity(COORD, 10**9, 1.0), [PeerCapacity(W1, 10**9, 1.0)],
                               term=1, version=1)
        self.net = LoopbackNet(tamper)
        self.failed: list[tuple[str, str]] = []
        dispatcher = self.net.dispatcher(COORD, on_peer_failed=lambda p, r: self.failed.append((p, r)))
        self.ffn = RemoteFFN(self.model, self.plan, dispatcher, verify=1.0, rng=random.Random(0))
        self.ffn.set_approximate({W1})  # another build: the coordinator's role says so from its Hello
        self.net.attach(COORD, self.ffn.deliver)
        self.worker = Worker(W1, self.shape, load_model(path), gpu, gpu_memory)
        self.kinds: set[str] = set()

        def handle(src, msg):
            match msg:
                case M.PlanMessage():
                    self.worker.accept_plan(Plan.from_message(msg, src, self.shape))
                case M.ExpertRequest() | M.DenseRequest():
                    answer = self.worker.handle(msg)
                    self.kinds.add(type(answer).__name__)
                    self.net.send(W1, src, answer)
        self.net.attach(W1, handle)
        self.net.send(COORD, W1, self.plan.to_message())

    def local(self):
        model = load_model(self.model.path)
        return greedy(model, LocalFFN(model, self.plan.dense_ranges()), n=DECODE)

    def close(self):
        self.net.close()


def test_the_model_is_one_the_gpus_int8_gemvs_read(q8_moe, int8):
    model = load_model(q8_moe)
    assert int8_gpu_refusal(model) is None
    assert model_shape(model).dense_block == 64  # Q8_0's int8 product takes 64 values at a time


@pytest.mark.parametrize("gpu_memory", [None, 1], ids=["on-the-gpu", "past-its-gpu-memory"])
def test_an_int8_swarm_with_a_gpu_peer_gives_the_local_int8_runs_tokens(q8_moe, gpu, int8, gpu_memory):
    swarm = GpuInt8Swarm(q8_moe, gpu, gpu_memory=gpu_memory)
    try:
        assert {s.peer for spans in swarm.plan.dense.values() for s in spans} >= {W1}
        assert any(s.peer == W1 for spans in swarm.plan.experts.values() for s in spans)
        tokens, logits = greedy(swarm.model, swarm.ffn, n=DECODE)
        ref_tokens, ref_logits = swarm.local()
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits, strict=True):  # another summation order, a rare step apart
            assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
        assert not swarm.failed and swarm.ffn.local_fallbacks == 0
        assert swarm.worker.served > 0 and swarm.ffn.verified >= swarm.worker.served  # every answer checked
        assert swarm.kinds == {"ExpertAnswerInt8", "DenseAnswerInt8"}
        if gpu_memory is None:  # the GPU's sums: another order than the engine's, not its bits
            assert any(not np.array_equal(a, b) for a, b in zip(logits, ref_logits))
    finally:
        swarm.close()


def _down(model, msg):
    """The down matrix of each block of answer ``msg`` with its rows: [(QMatrix, slice of rows)]."""
    if isinstance(msg, M.DenseAnswer):
        (lo, hi), = msg.ranges
        return [(model.dense_weights(msg.layer, lo, hi).down, slice(None))]
    at = np.concatenate([[0], np.cumsum(msg.row_counts)])
    return [(model.expert_weights(msg.layer, int(e)).down, slice(at[i], at[i + 1]))
            for i, e in enumerate(msg.expert_ids)]


def lying(model, kind: str):
    """A tamper hook making W1 lie: ``answer`` moves one output by 1e-3 of the largest, the
    down rows honest; ``rows`` feeds down the rounding of 1.5 × its SwiGLU, the answer that
    product (self-consistent: only the rounding check can see it)."""
    def tamper(src, dst, data):
        msg = M.decode(data)
        if src != W1 or not isinstance(msg, (M.ExpertAnswerInt8, M.DenseAnswerInt8)):
            return data
        out = np.array(msg.outputs if isinstance(msg, M.ExpertAnswer) else msg.partials[0])
        rows = np.array(msg.down_rows)
        if kind == "answer":
            out.reshape(-1)[0] += 1e-3 * np.abs(out).max()
        else:
            for down, at in _down(model, msg):
                q, dx, _ = planes("q8_0", rows[at], down.cols)
                h = q.astype(np.float32) * np.repeat(dx, 32, axis=1)
                rows[at] = down.int8_rows(np.ascontiguousarray(1.5 * h))
                out[at] = down.matmul_int8_rows(rows[at])
        if isinstance(msg, M.ExpertAnswer):
            return M.encode(M.ExpertAnswerInt8(msg.request_id, msg.term, msg.plan_version, msg.layer, msg.expert_ids,
                                               msg.row_counts, out, rows))
        return M.encode(M.DenseAnswerInt8(msg.request_id, msg.term, msg.plan_version, msg.layer, msg.ranges,
                                          out[None], rows))
    return tamper


@pytest.mark.parametrize("kind, why", [("answer", "beyond the int8 bound of its own rows"),
                                       ("rows", "down-row")])
def test_verify_stops_a_gpu_peer_that_lies_in_its_answer_or_its_down_rows(q8_moe, gpu, int8, kind, why):
    model = load_model(q8_moe)
    swarm = GpuInt8Swarm(q8_moe, gpu, tamper=lying(model, kind))
    try:
        with pytest.raises(VerificationError, match=f"peer {W1} answered layer .*{why}"):
            greedy(swarm.model, swarm.ffn, n=DECODE)
    finally:
        swarm.close()


def test_an_int8_gpu_peer_without_down_rows_is_stopped(q8_moe, gpu, int8):
    def plain(src, dst, data):  # the answer of an older peer, or one that leaves the rows out
        msg = M.decode(data)
        if src == W1 and isinstance(msg, M.ExpertAnswerInt8):
            return M.encode(M.ExpertAnswer(msg.request_id, msg.term, msg.plan_version, msg.layer, msg.expert_ids,
                                           msg.row_counts, msg.outputs))
        return data

    swarm = GpuInt8Swarm(q8_moe, gpu, tamper=plain)
    try:
        with pytest.raises(VerificationError, match="it sent no down rows"):
            greedy(swarm.model, swarm.ffn, n=DECODE)
    finally:
        swarm.close()


@pytest.mark.slow
def test_honest_gpu_answers_on_smollm2s_real_activations_pass_the_check(gpu, int8):
    """Real, heavy-tailed activations: SmolLM2-135M's FFN inputs for 40 tokens through its 30
    layers, its MLPs requantized to Q8_0 (their widths, 576 and 1536, have int8 GEMVs). Every
    honest GPU answer passes the coordinator's check, though its down rows are not the
    coordinator's bits (scales an ulp apart, values a step apart near a rounding boundary)."""
    from swarm.compute.default_model import default_model_path
    from swarm.compute.int8_swiglu import check_int8_answer, swiglu_int8
    from swarm.compute.kernels import MLPWeights
    from swarm.compute.quant import QT, QMatrix
    from swarm.peer.coordinator.bounds import int8_product_bound
    from swarm.peer.weights.repack import requantize_q8_0

    model = load_model(default_model_path())
    local, inputs = LocalFFN(model), {}

    class Recording:
        def ffn(self, layer, x, segments=None):
            inputs[layer] = x.copy()
            return local.ffn(layer, x, segments)

    model.forward(list(range(100, 140)), model.new_cache(), ffn=Recording())
    differ = 0
    for layer, x in inputs.items():
        w = model.dense_weights(layer)
        q8 = MLPWeights(*(QMatrix(requantize_q8_0(np.asarray(m.data), m.qtype.name, [m.shape[0], m.cols], role),
                                  QT.Q8_0, m.cols) for m, role in ((w.gate, "gate"), (w.up, "up"), (w.down, "down"))))
        y, rows = gpu.run_rows(gpu.load(q8), x)
        assert check_int8_answer(q8, x, y, rows, int8_product_bound) is None, layer
        differ += not np.array_equal(rows, swiglu_int8(q8, x)[1])
    assert len(inputs) == 30 and differ > 0  # another build's rows: the check is not one of bits
