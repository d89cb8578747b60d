"""A GPU peer's FFN device (swarm/peer/worker/gpu.py) on wgpu (lavapipe in CI): every encoding a
file may hold reaches the WGSL kernels as the file stores it — or, where no kernel reads it, as
its Q8_0 requantization — and the answers equal the engine's CPU kernels within the bound
``--verify`` holds another numeric build to (the oracle: swarm.compute.ffn.swiglu_ffn on the
same weights)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from swarm.compute.ffn import swiglu_ffn
from swarm.compute.kernels import MLPWeights
from swarm.compute.quant import QMatrix
from swarm.peer.coordinator.bounds import ffn_rtol, rows_outside
from swarm.peer.worker.gpu import GpuFfn
from web_peer.kernels import random_blocks

pytestmark = pytest.mark.browser

H, F, T = 256, 256, 5


@pytest.fixture(scope="module")
def gpu():
    device = GpuFfn.open("on")
    yield device
    device.close()


def matrix(rng, rows, cols, qtype):
    """[rows, cols] weights of ``qtype`` with outputs of order one."""
    name = qtype.name.lower()
    if name in ("q4_k", "q5_k", "q6_k", "iq4_xs"):  # gguf-py has no quantizer for them: random valid blocks
        return QMatrix(random_blocks(rng, rows, cols, name, scale=2e-4), qtype, cols)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols ** -0.5)
    if qtype == QT.F32:
        return QMatrix.from_float(w)
    if qtype == QT.F16:
        return QMatrix(w.astype(np.float16).view(np.uint8), qtype, cols)
    return QMatrix(quantize(w, qtype), qtype, cols)


@pytest.mark.parametrize("qtype, kernel", [
    (QT.Q4_0, "q4_0"), (QT.Q4_1, "q4_1"), (QT.Q8_0, "q8_0"), (QT.Q4_K, "q4_k"), (QT.Q5_K, "q5_k"),
    (QT.Q6_K, "q6_k"), (QT.IQ4_XS, "iq4_xs"), (QT.F32, "f32"), (QT.F16, "f16"), (QT.Q5_0, "q8_0"),
])
def test_each_encoding_runs_on_the_gpu_as_the_file_stores_it(gpu, qtype, kernel):
    rng = np.random.default_rng(int(qtype))
    w = MLPWeights(matrix(rng, F, H, qtype), matrix(rng, F, H, qtype), matrix(rng, H, F, qtype))
    x = rng.standard_normal((T, H), dtype=np.float32)
    held = gpu.load(w)
    assert held.cpu is None  # on the GPU
    want = kernel  # F16 on any adapter: read as u32 words (no shader-f16)
    assert (held.gpu.fmt, held.gpu.down_fmt) == (want, want)
    repacked = want == "q8_0" and qtype != QT.Q8_0
    if not repacked:
        assert held.nbytes == w.nbytes  # the file's bytes, never float32 for a compact encoding
    local, remote = swiglu_ffn(w, x), gpu.run(held, x)
    assert not rows_outside(remote, local, ffn_rtol(H, F, repacked)).any()


def test_blocks_the_kernels_cannot_take_run_on_the_cpu(gpu):
    rng = np.random.default_rng(7)
    base = MLPWeights(*(matrix(rng, r, c, QT.Q8_0) for r, c in ((F, H), (F, H), (H, F))))
    biased = MLPWeights(base.gate, base.up, base.down, bias=(np.ones(F, np.float32), np.ones(F, np.float32),
                                                             np.ones(H, np.float32)), swiglu_limit=7.0)
    held = gpu.load(biased)
    x = rng.standard_normal((T, H), dtype=np.float32)
    assert held.gpu is None and np.array_equal(gpu.run(held, x), swiglu_ffn(biased, x))  # the engine's bits
    mixed = MLPWeights(base.gate, matrix(rng, F, H, QT.Q4_0), base.down)  # gate and up of two encodings
    held = gpu.load(mixed)
    assert held.gpu.fmt == "q8_0"  # one kernel reads both: requantized together
    assert not rows_outside(gpu.run(held, x), swiglu_ffn(mixed, x), ffn_rtol(H, F, repacked=True)).any()


def test_auto_takes_no_software_adapter_and_a_bad_mode_is_named(gpu):
    from swarm.errors import SwarmError

    assert GpuFfn.open("off") is None
    auto = GpuFfn.open("auto")
    try:
        software = gpu.host.adapter.info["adapter_type"] == "CPU"  # lavapipe in CI
        assert (auto is None) == software
    finally:
        if auto is not None:
            auto.close()
    with pytest.raises(SwarmError, match="unknown --gpu mode 'fast'"):
        GpuFfn.open("fast")


def test_a_worker_on_the_gpu_answers_within_the_bound_and_recovers_from_a_lost_device(gpu, tmp_path):
    """The Worker with this device (join --gpu) answers an expert request of the tiny MoE within
    --verify's bound of the engine; when the device is lost, the request is refused as
    ``internal`` (the coordinator recomputes it) and the next one uploads again and is answered."""
    from swarm.compute.model import load_model
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.net import messages as M
    from swarm.peer.plan import ModelShape
    from swarm.peer.worker.ffn import Worker
    from tests.peer._swarm_models import COORD, W1, build

    model = load_model(build("qwen3_moe", tmp_path))
    shape = ModelShape.from_config(model.config)
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=1, version=1)
    worker = Worker(W1, shape, model, gpu)
    worker.accept_plan(plan)
    assert worker.prepare() > 0  # uploaded when the plan is accepted
    e = plan.expert_span(0, W1).start
    x = np.random.default_rng(3).standard_normal((4, shape.hidden_size), dtype=np.float32)

    def ask(rid):
        return worker.handle(M.ExpertRequest(rid, 1, 1, 0, np.array([e], np.int32), np.array([4], np.int32), x))

    local = swiglu_ffn(model.expert_weights(0, e), x)
    first = ask(1)
    assert not rows_outside(first.outputs, local, ffn_rtol(shape.hidden_size, shape.moe_intermediate_size)).any()
    gpu.host.drop_device()  # as after a GPU error
    refused = ask(2)
    assert isinstance(refused, M.Error) and refused.code == "internal" and "lost" in refused.message
    again = ask(3)
    assert isinstance(again, M.ExpertAnswer) and np.array_equal(again.outputs, first.outputs)  # same kernels, same bits


def test_a_gpu_peer_of_the_int8_numerics_announces_its_int8_gemvs(gpu, monkeypatch):
    # Under int8 its FFN blocks run on the GPU's int8 GEMVs (Q4_K, Q6_K, Q8_0): another build of
    # the int8 numerics, which an int8 coordinator checks by the down rows of its answers.
    from swarm.compute import numerics
    from web_peer.int8_activations import X8_FORMATS

    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)
    numerics.set_numerics("float32")
    f32 = gpu.build()
    assert f32.numerics == "float32" and f32.named("kernels:") and not f32.named("x8:")
    numerics.set_numerics("int8")
    i8 = gpu.build()
    assert i8.numerics == "int8" and i8.kernel_dtype == "i8" and i8.gpu_adapter == gpu.adapter
    assert i8.named("x8:") == frozenset(X8_FORMATS) and not i8.named("kernels:")


def test_an_int8_block_runs_each_product_on_the_gpu_where_an_int8_gemv_reads_it(gpu, monkeypatch):
    """Q4_K gate/up and Q6_K down on the GPU's int8 GEMVs, a Q5_K down on the engine's int8
    product; either way the answer passes the coordinator's check (its down rows a rounding of
    SwiGLU, the answer within the int8 bound of them) — Q5_K against the engine's bits."""
    from swarm.compute import numerics
    from swarm.compute.int8_swiglu import check_int8_answer, swiglu_int8
    from swarm.errors import KernelError
    from swarm.peer.coordinator.bounds import int8_product_bound

    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)
    numerics.set_numerics("int8")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, H), dtype=np.float32)
    w = MLPWeights(matrix(rng, F, H, QT.Q4_K), matrix(rng, F, H, QT.Q4_K), matrix(rng, H, F, QT.Q6_K))
    held = gpu.load(w)
    assert held.gpu is None and all(g is not None for g in held.x8) and held.nbytes == w.nbytes
    y, rows = gpu.run_rows(held, x)
    assert check_int8_answer(w, x, y, rows, int8_product_bound) is None
    assert np.array_equal(gpu.run(held, x), y)
    gpu.host.drop_device()  # as after a GPU error: the worker drops its blocks and loads them again
    with pytest.raises(KernelError, match="lost"):
        gpu.run_rows(held, x)
    held = gpu.load(w)
    assert np.array_equal(gpu.run_rows(held, x)[0], y)  # a fresh device, the same kernels: the same bits
    before = gpu.cpu_products
    w5 = MLPWeights(w.gate, w.up, matrix(rng, H, F, QT.Q5_K))
    held5 = gpu.load(w5)
    assert held5.x8[2] is None and gpu.cpu_products == before + 1  # no int8 GEMV reads Q5_K
    y5, rows5 = gpu.run_rows(held5, x)
    assert np.array_equal(w5.down.matmul_int8_rows(rows5), y5)  # the engine's product on its rows: its bits

    def bound(m, rows):  # the engine's own bits for Q5_K, which no GPU bound covers
        return np.zeros((len(rows), m.shape[0])) if m is w5.down else int8_product_bound(m, rows)
    assert check_int8_answer(w5, x, y5, rows5, bound) is None
    # a request's blocks in two submissions (all gate/up, then all down): each block's own bits
    together = gpu.run_rows_many([held, held5, held], [x, x, x[1:]])
    for (y_i, r_i), (y_a, r_a) in zip(together, [(y, rows), (y5, rows5), gpu.run_rows(held, x[1:])]):
        assert np.array_equal(y_i, y_a) and np.array_equal(r_i, r_a)
    assert rows5.shape == swiglu_int8(w5, x)[1].shape
    f32 = MLPWeights(w.gate, w.up, QMatrix.from_float(np.ones((H, F), np.float32)))
    with pytest.raises(ValueError, match="no int8 product"):  # the worker answers bad_request
        gpu.run_rows(gpu.load(f32), x)

@pytest.mark.parametrize("numerics_name, on_gpu", [("float32", True), ("int8", False)])
def test_an_int8_gpu_peers_stages_run_on_the_engines_int8_kernels(gpu, tmp_path, monkeypatch, numerics_name, on_gpu):
    # Its coordinator plans it ranges only; a stage sent anyway must not compute float32 on the GPU
    import os

    from swarm.compute import numerics
    from swarm.compute.model import load_model
    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.node import Node
    from swarm.peer.worker.gpu import GpuStage
    from swarm.peer.worker.role import WorkerRole
    from tests.peer._swarm_models import build

    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)
    numerics.set_numerics(numerics_name)
    model = load_model(build("qwen3_moe", tmp_path))
    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey(os.urandom(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                status_path=tmp_path / "status.json")
    role = WorkerRole(node, model, ElectionDriver(node, True, on_leader=None, on_admitted=None), device=gpu)
    assert isinstance(role.stage_runner.device, GpuStage) == on_gpu
    assert role.server.answers_rows == (not on_gpu)  # its ranges answer with their down rows under int8
