"""A GPU peer's stages (swarm/peer/worker/gpu.py, GpuStage) on wgpu (lavapipe in CI): a
StageRunner with the GPU device runs each layer's Q, K, V, O and FFN products with the WGSL
kernels on the file's own encoding, and its answers — a prefill, decode steps, a step of two
sequences — equal the CPU StageRunner's within the bound ``--verify`` holds another numeric
build's stage answers to (bounds.stage_rtol; the oracle: the engine's own layers on the same
weights). A lost device answers ``internal``; the next request uploads again."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import web_peer.wgpu_host as wgpu_host

from swarm.compute.model import load_model
from swarm.peer.coordinator.bounds import rows_outside, stage_rtol
from swarm.peer.net import messages as M
from swarm.peer.plan import Stage, StageLayout
from swarm.compute.quant import QMatrix
from swarm.peer.worker.gpu import GpuFfn, GpuStage, _runs
from swarm.peer.worker.stages import StageRunner
from tests.compute.test_quant_kernels import quantize_k
from tests.compute.tiny_gguf import write_gguf_from_hf
from tests.compute.tiny_models import build_tiny
from tests.peer._swarm_models import COORD, W1

pytestmark = pytest.mark.browser

# Every matrix of this llama fits a K-quant super-block (256 weights), so Q4_K covers them all.
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
KERNEL = {QT.F32: "f32", QT.F16: "f16", QT.Q8_0: "q8_0", QT.Q4_K: "q4_k"}


@pytest.fixture(scope="module")
def gpu():
    device = GpuFfn.open("on")
    yield device
    device.close()


def gguf_model(tmp_path, monkeypatch, family: str, qtype: QT, **overrides):
    """The tiny ``family`` checkpoint as a GGUF of ``qtype`` (K-quants by the tests' writer)."""
    hf, _ = build_tiny(family, tmp_path / "hf", **overrides)
    if qtype == QT.Q4_K:  # gguf-py cannot write K-quants
        plain = gguf.quants.quantize
        monkeypatch.setattr(gguf.quants, "quantize", lambda a, q: quantize_k(a, q) if q == QT.Q4_K else plain(a, q))
    return load_model(write_gguf_from_hf(hf, family, tmp_path / f"{family}-{qtype.name}.gguf", qtype))


def runners(model, gpu, stop: int, whole_layers: bool = True,
            fuse: bool = True) -> tuple[StageRunner, StageRunner, GpuStage]:
    """A CPU StageRunner and a GPU one, both serving layers 0:stop of ``model`` as peer W1."""
    layout = StageLayout(1, 1, COORD, (Stage(W1, 0, stop),) + ((Stage(COORD, stop, model.config.n_layers),)
                                                               if stop < model.config.n_layers else ()))
    device = GpuStage(gpu, model, whole_layers, fuse=fuse)
    cpu, on_gpu = StageRunner(W1, model), StageRunner(W1, model, device=device)
    for r in (cpu, on_gpu):
        r.accept(layout)
        r.prepare()
    return cpu, on_gpu, device


def request(rid: int, segments: list[tuple[int, int, int]], x: np.ndarray, stop: int) -> M.StageRequest:
    """Rows x of ``segments`` ((sequence, start, rows) each) for layers 0:stop."""
    return M.StageRequest(rid, 1, 1, tuple(M.StageSegment(*s) for s in segments), 0, stop, x)


def assert_within_bound(model, stop: int, cpu: StageRunner, on_gpu: StageRunner, req: M.StageRequest) -> np.ndarray:
    """Both runners answer ``req``; the GPU's rows are within the stage bound of the CPU's
    (bit-identical answers would mean the GPU computed nothing). Returns the GPU's rows."""
    local, remote = cpu.handle(req), on_gpu.handle(req)
    assert isinstance(local, M.StageAnswer) and isinstance(remote, M.StageAnswer), (local, remote)
    c = model.config
    width = max(c.intermediate_size or 0, c.top_k * c.moe_intermediate_size)
    context = max(s.start + s.rows for s in req.segments)
    assert not rows_outside(remote.x, local.x, stage_rtol(stop, c.hidden_size, width, context)).any()
    assert not np.array_equal(remote.x, local.x)
    return remote.x


@pytest.mark.parametrize("whole_layers", [True, False], ids=["whole-layers", "products"])
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_K], ids=lambda q: q.name)
def test_a_gpu_stage_of_each_encoding_answers_within_the_stage_bound(gpu, tmp_path, monkeypatch, qtype, whole_layers):
    """Dense llama layers: wholly on the GPU (norms, RoPE, attention, the KV cache in GPU
    buffers), or only their products there (the engine's layers around them)."""
    model = gguf_model(tmp_path, monkeypatch, "llama", qtype, **WIDE)
    stop = model.config.n_layers
    cpu, on_gpu, device = runners(model, gpu, stop, whole_layers)
    assert device.resident(0, stop) == whole_layers
    held = device.held()
    assert held["cpu"] == 0 and held["formats"] == {KERNEL[qtype]}  # every product on the GPU, as the file stores it
    H = model.config.hidden_size
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((7, H), np.float32)
    assert_within_bound(model, stop, cpu, on_gpu, request(1, [(5, 0, 7)], x, stop))
    for step in range(3):  # decode steps over the cached keys/values
        x = rng.standard_normal((1, H), np.float32)
        assert_within_bound(model, stop, cpu, on_gpu, request(2 + step, [(5, 7 + step, 1)], x, stop))


@pytest.mark.parametrize("whole_layers", [True, False], ids=["whole-layers", "products"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_gpu_moe_stage_of_two_sequences_answers_within_the_stage_bound(gpu, tmp_path, monkeypatch, family,
                                                                          whole_layers):
    """MoE layers (the selected experts on the GPU; Qwen2-MoE's gated shared expert too) and a
    dense layer (Qwen3-MoE's layer 1), Q8_0 blocks; a step of two sequences (prefill beside a
    decode row): whole layers (routing on the CPU between two submissions, the KV cache on the
    GPU) or products only (the batch path of the engine's layers)."""
    model = gguf_model(tmp_path, monkeypatch, family, QT.Q8_0)
    cpu, on_gpu, device = runners(model, gpu, 2, whole_layers)
    assert device.resident(0, 2) == whole_layers
    held = device.held()  # matrices of 40 or 48 columns are F32 in the file (no whole Q8_0 blocks)
    assert held["cpu"] == 0 and "q8_0" in held["formats"] <= {"q8_0", "f32"}
    H = model.config.hidden_size
    rng = np.random.default_rng(3)
    assert_within_bound(model, 2, cpu, on_gpu, request(1, [(1, 0, 6)], rng.standard_normal((6, H), np.float32), 2))
    x = rng.standard_normal((5, H), np.float32)
    assert_within_bound(model, 2, cpu, on_gpu, request(2, [(1, 6, 1), (2, 0, 4)], x, 2))


def test_a_lost_device_answers_internal_and_the_next_step_uploads_again(gpu, tmp_path, monkeypatch):
    model = gguf_model(tmp_path, monkeypatch, "qwen3_moe", QT.F32)
    cpu, on_gpu, device = runners(model, gpu, 3)
    H = model.config.hidden_size
    x = np.random.default_rng(5).standard_normal((4, H), np.float32)
    first = assert_within_bound(model, 3, cpu, on_gpu, request(1, [(1, 0, 4)], x, 3))
    assert not on_gpu.take_inline(request(2, [(1, 4, 1)], x[:1], 3))  # the device is the compute thread's
    gpu.host.drop_device()  # as after a GPU error
    refused = on_gpu.handle(request(2, [(1, 0, 4)], x, 3))
    assert isinstance(refused, M.Error) and refused.code == "internal" and "lost" in refused.message
    again = on_gpu.handle(request(3, [(1, 0, 4)], x, 3))
    assert isinstance(again, M.StageAnswer) and np.array_equal(again.x, first)  # same kernels, same bits


def test_a_whole_layer_gpu_stage_keeps_each_sequences_cache_on_the_gpu(gpu, tmp_path, monkeypatch):
    """Two sequences in one step, decode steps past the cache's first capacity (16 positions:
    the GPU buffers grow and keep what they held), a suffix re-run from an earlier position;
    then a lost device answers ``internal`` and drops every sequence's cache, so a step that
    continues one answers ``cache_gap`` (the coordinator resends it from 0)."""
    model = gguf_model(tmp_path, monkeypatch, "llama", QT.Q8_0, **WIDE)
    cpu, on_gpu, device = runners(model, gpu, 2)
    assert device.resident(0, 2)
    H = model.config.hidden_size
    rng = np.random.default_rng(11)
    rows = lambda n: rng.standard_normal((n, H), np.float32)  # noqa: E731
    assert_within_bound(model, 2, cpu, on_gpu, request(1, [(1, 0, 9), (2, 0, 3)], rows(12), 2))
    for step in range(10):  # sequence 1 to 19 positions, sequence 2 beside it to 13
        assert_within_bound(model, 2, cpu, on_gpu, request(2 + step, [(1, 9 + step, 1), (2, 3 + step, 1)], rows(2), 2))
    (held,) = {kv.cap for c in on_gpu._caches.values() for kv in c.device_kv.values() if c.length > 16}
    assert held == 32
    assert_within_bound(model, 2, cpu, on_gpu, request(20, [(1, 15, 3)], rows(3), 2))  # re-run a suffix
    gpu.host.drop_device()
    refused = on_gpu.handle(request(21, [(1, 18, 1)], rows(1), 2))
    assert isinstance(refused, M.Error) and refused.code == "internal"
    gap = on_gpu.handle(request(22, [(1, 18, 1)], rows(1), 2))
    assert isinstance(gap, M.Error) and gap.code == "cache_gap"
    cpu.forget()
    assert_within_bound(model, 2, cpu, on_gpu, request(23, [(1, 0, 5)], rows(5), 2))  # from 0: uploaded again


def test_a_gpu_kv_cache_past_the_planned_context_is_refused_not_grown(gpu, tmp_path, monkeypatch):
    """The plan counted 24 positions of KV cache on this GPU (``kv_positions``, --context): the
    buffers double 16 → 24, not 32; a step past position 24 answers ``bad_request`` naming the
    limit (the coordinator runs the layers itself), and the sequence's cache is untouched."""
    model = gguf_model(tmp_path, monkeypatch, "llama", QT.Q8_0, **WIDE)
    cpu, on_gpu, device = runners(model, gpu, 2)
    device.kv_positions = 24
    assert device.resident(0, 2)
    H = model.config.hidden_size
    rng = np.random.default_rng(12)
    rows = lambda n: rng.standard_normal((n, H), np.float32)  # noqa: E731
    assert_within_bound(model, 2, cpu, on_gpu, request(1, [(1, 0, 20)], rows(20), 2))
    assert_within_bound(model, 2, cpu, on_gpu, request(2, [(1, 20, 4)], rows(4), 2))  # exactly the limit
    assert {kv.cap for c in on_gpu._caches.values() for kv in c.device_kv.values()} == {24}
    refused = on_gpu.handle(request(3, [(1, 24, 1)], rows(1), 2))
    assert isinstance(refused, M.Error) and refused.code == "bad_request"
    assert "25 positions" in refused.message and "counted 24 (--context)" in refused.message
    too_long = on_gpu.handle(request(4, [(2, 0, 30)], rows(30), 2))  # a prefill past it, from 0
    assert isinstance(too_long, M.Error) and too_long.code == "bad_request" and "30 positions" in too_long.message
    assert {kv.cap for c in on_gpu._caches.values() for kv in c.device_kv.values()} == {24}
    assert_within_bound(model, 2, cpu, on_gpu, request(5, [(1, 23, 1)], rows(1), 2))  # within it: still served


def test_the_gpu_kv_caches_of_all_sequences_together_stay_within_the_planned_context(gpu, tmp_path, monkeypatch):
    """The plan counted 48 positions of KV cache on this GPU for all sequences together. A
    sequence of 20 holds 32 (a doubling); a second of 20 would pass 48 beside it and is refused
    while the first is in flight; once the first has been idle ``IN_FLIGHT_S`` (finished, kept
    for reuse) its buffers are dropped for the second, which is served, and the first's next
    step gets ``cache_gap`` (the coordinator resends it from 0). A third takes what is left
    (16, not a doubling past it); a fourth is refused. The buffers never pass 48."""
    from swarm.peer.worker import stages

    model = gguf_model(tmp_path, monkeypatch, "llama", QT.Q8_0, **WIDE)
    cpu, on_gpu, device = runners(model, gpu, 2)
    device.kv_positions = 48
    now = [0.0]
    on_gpu._clock = lambda: now[0]  # noqa: SLF001
    H = model.config.hidden_size
    rng = np.random.default_rng(13)
    rows = lambda n: rng.standard_normal((n, H), np.float32)  # noqa: E731

    def held(layer: int) -> int:
        return sum(c.device_kv[layer].cap for c in on_gpu._caches.values() if layer in c.device_kv)  # noqa: SLF001

    assert_within_bound(model, 2, cpu, on_gpu, request(1, [(1, 0, 20)], rows(20), 2))
    assert held(0) == held(1) == 32
    refused = on_gpu.handle(request(2, [(2, 0, 20)], rows(20), 2))
    assert isinstance(refused, M.Error) and refused.code == "bad_request"
    assert "beside the 32 that 1 other sequence(s) hold" in refused.message and "counted 48 in all" in refused.message
    assert held(0) <= 48 and held(1) <= 48
    now[0] += stages.IN_FLIGHT_S + 1
    assert_within_bound(model, 2, cpu, on_gpu, request(3, [(2, 0, 20)], rows(20), 2))
    assert held(0) == held(1) == 32  # the second's; the first's went with its cache
    gap = on_gpu.handle(request(4, [(1, 20, 1)], rows(1), 2))
    assert isinstance(gap, M.Error) and gap.code == "cache_gap"
    # a short sequence takes the 16 left beside the second's 32; a fourth finds none while they run
    assert_within_bound(model, 2, cpu, on_gpu, request(5, [(3, 0, 8)], rows(8), 2))
    assert held(0) == held(1) == 48
    full = on_gpu.handle(request(6, [(4, 0, 1)], rows(1), 2))
    assert isinstance(full, M.Error) and full.code == "bad_request" and "beside the 48" in full.message
    assert held(0) == held(1) == 48


def test_a_long_prefill_goes_through_whole_layers_in_chunks(tmp_path, monkeypatch):
    """Bindings capped at 8 KiB (a phone's limits, scaled down): a 12-row prefill's scratch does
    not fit one submission, so it runs in chunks of 3 rows, each attending over the keys/values
    the ones before it wrote; the answer is still within the bound of the CPU's."""
    from web_peer.wgpu_host import WgpuFfn

    model = gguf_model(tmp_path, monkeypatch, "llama", QT.Q8_0, **WIDE)
    small = GpuFfn(WgpuFfn(max_binding=8 << 10))
    try:
        cpu, on_gpu, device = runners(model, small, 2)
        assert device.resident(0, 2)
        x = np.random.default_rng(2).standard_normal((12, model.config.hidden_size), np.float32)
        assert_within_bound(model, 2, cpu, on_gpu, request(1, [(1, 0, 12)], x, 2))
        assert small.host.largest_binding <= 8 << 10
    finally:
        small.close()


def test_blocks_in_one_submission_give_each_blocks_own_bits(gpu):
    """A layer's (or request's) experts in one submission: each block's rows get the bits the
    block alone gives them (the same kernels, only the submission shared)."""
    from web_peer.kernels import quantize_blocks

    rng = np.random.default_rng(4)
    blocks = [gpu.host.upload(*(quantize_blocks(rng.standard_normal(s, dtype=np.float32) * np.float32(0.05), "q8_0")
                                for s in ((96, 64), (96, 64), (64, 96))), "q8_0") for _ in range(3)]
    xs = [rng.standard_normal((n, 64), dtype=np.float32) for n in (1, 4, 2)]
    together = gpu.host.ffn_many(list(zip(xs, blocks)))
    for x, w, y in zip(xs, blocks, together, strict=True):
        assert y.shape == x.shape and np.array_equal(y, gpu.host.ffn(x, w))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_biases_and_the_norm_of_each_head_run_in_whole_gpu_layers(gpu, tmp_path, monkeypatch, family):
    """Qwen2's Q/K/V biases and Qwen3's RMSNorm of each query and key head, on the GPU with the
    rest of the layer: within the bound of the CPU's, prefill and decode steps."""
    model = gguf_model(tmp_path, monkeypatch, family, QT.Q8_0)
    stop = model.config.n_layers
    cpu, on_gpu, device = runners(model, gpu, stop)
    assert device.resident(0, stop)
    w = model.attention_weights(0)
    assert (w.qkv_bias is not None) if family == "qwen2" else (model.config.qk_norm == "head")
    H = model.config.hidden_size
    rng = np.random.default_rng(6)
    assert_within_bound(model, stop, cpu, on_gpu, request(1, [(1, 0, 5)], rng.standard_normal((5, H), np.float32), stop))
    for step in range(3):
        x = rng.standard_normal((1, H), np.float32)
        assert_within_bound(model, stop, cpu, on_gpu, request(2 + step, [(1, 5 + step, 1)], x, stop))


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q4_K], ids=lambda q: q.name)
def test_decode_steps_reuse_the_stages_buffers_and_give_a_fresh_stages_bits(gpu, tmp_path, monkeypatch, qtype):
    """Decode steps (a row a sequence) through whole GPU layers keep the stage's scratch buffers
    and the bind groups made over them from step to step, two sequences of different lengths
    taking turns (past the first KV capacity of 16): no bind group is made but at the first step
    and where a sequence's keys/values grow (the position is a uniform written once a step), and
    a sequence's step is one submission, its rows read back through a kept buffer; each answer
    equals, bit for bit, that of a stage that makes everything again for every step."""
    model = gguf_model(tmp_path, monkeypatch, "llama", qtype, **WIDE)
    _, reused, device = runners(model, gpu, 2)
    _, fresh, fresh_device = runners(model, gpu, 2)
    H = model.config.hidden_size
    rng = np.random.default_rng(14)
    rows = lambda n: rng.standard_normal((n, H), np.float32)  # noqa: E731
    made: list[int] = []  # bind groups the reused stage made, per request
    submitted: list[int] = []  # and its submissions
    dev = gpu.host.device
    make, submit = dev.create_bind_group, dev.queue.submit

    def counted(**kwargs):
        made[-1] += 1
        return make(**kwargs)

    def counted_submit(buffers):
        submitted[-1] += 1
        return submit(buffers)

    def both(req: M.StageRequest) -> None:
        fresh_device._decode_scratch = None  # noqa: SLF001
        made.append(0)
        submitted.append(0)
        monkeypatch.setattr(dev, "create_bind_group", counted)
        monkeypatch.setattr(dev.queue, "submit", counted_submit)
        a = reused.handle(req)
        monkeypatch.setattr(dev, "create_bind_group", make)
        monkeypatch.setattr(dev.queue, "submit", submit)
        b = fresh.handle(req)
        assert isinstance(a, M.StageAnswer) and isinstance(b, M.StageAnswer), (a, b)
        assert np.array_equal(a.x, b.x)

    both(request(1, [(1, 0, 9), (2, 0, 3)], rows(12), 2))
    sizes = []
    for step in range(12):
        both(request(2 + step, [(1, 9 + step, 1), (2, 3 + step, 1)], rows(2), 2))
        sizes.append(len(device._decode_scratch.binds))  # noqa: SLF001
    assert sizes[0] > 0 and set(sizes) == {sizes[0]}  # made at the first step, then only reused
    decode = made[1:]  # sequence 1 passes 16 positions at step 7: its KV buffers (and the scores) grow
    assert decode[0] > 0 and decode[7] > 0, made
    assert decode[1:7] == [0] * 6 and decode[8:] == [0] * 4, made
    assert submitted[1:8] + submitted[9:] == [2] * 11, submitted  # one a sequence (step 7 also copies the grown KV)


def test_runs_of_one_format_stack_only_neighbours():
    """Q, K, V go up stacked only where adjacent ones share a format (their columns of the qkv
    row are then adjacent too); a matrix the kernels do not read (None) stays alone."""
    assert _runs(["q4_k", "q4_k", "q6_k"]) == [[0, 1], [2]]
    assert _runs(["q8_0", "q8_0", "q8_0"]) == [[0, 1, 2]]
    assert _runs(["q4_k", "q6_k", "q4_k"]) == [[0], [1], [2]]
    assert _runs([None, None, "f32"]) == [[0], [1], [2]]


@pytest.mark.parametrize("case", ["F32", "Q4_K", "Q8_0-V-F32", "products"])
def test_a_fused_layer_takes_fewer_dispatches_and_gives_the_same_bits(gpu, tmp_path, monkeypatch, case):
    """Decode steps through whole GPU layers with Q|K|V stacked at upload (one product per run of
    one format) and the O and down products adding their sums to the residual themselves: 9
    dispatches a dense layer (10 where V is of another format than Q and K) where a product per
    matrix and two adds of their own take 13 (``fuse=False``; 14 when keys and values took a
    kv_write each), and the stage's rows, prefill and each step, bit for bit those of the
    unfused stage, with the same bytes held. The products-only path too takes Q|K|V as one
    product: the same bits."""
    qtype = {"F32": QT.F32, "Q4_K": QT.Q4_K}.get(case, QT.Q8_0)
    model = gguf_model(tmp_path, monkeypatch, "llama", qtype, **WIDE)
    stop = model.config.n_layers
    if case == "Q8_0-V-F32":  # as Q4_K_M files keep V in Q6_K: Q|K stacked, V alone
        for layer in range(stop):
            w = model.attention_weights(layer)
            model._attn[layer] = dataclasses.replace(w, v=QMatrix.from_float(w.v.dequantize()))  # noqa: SLF001
    whole = case != "products"
    _, fused, device = runners(model, gpu, stop, whole)
    _, plain, plain_device = runners(model, gpu, stop, whole, fuse=False)
    assert device.resident(0, stop) == plain_device.resident(0, stop) == whole
    assert [device.load_layer(n) for n in range(stop)] == [plain_device.load_layer(n) for n in range(stop)]  # bytes held
    H = model.config.hidden_size
    rng = np.random.default_rng(21)
    dispatches: list[int] = []
    dispatch = wgpu_host.Encoder.dispatch

    def counted(self, *args):
        dispatches[-1] += 1
        return dispatch(self, *args)

    def both(req: M.StageRequest) -> None:
        answers = []
        for runner in (fused, plain):
            dispatches.append(0)
            monkeypatch.setattr(wgpu_host.Encoder, "dispatch", counted)
            answers.append(runner.handle(req))
            monkeypatch.setattr(wgpu_host.Encoder, "dispatch", dispatch)
        a, b = answers
        assert isinstance(a, M.StageAnswer) and isinstance(b, M.StageAnswer), (a, b)
        assert a.x.dtype == b.x.dtype == np.float32 and np.array_equal(a.x, b.x)

    both(request(1, [(1, 0, 9)], rng.standard_normal((9, H), np.float32), stop))
    for step in range(4):
        both(request(2 + step, [(1, 9 + step, 1)], rng.standard_normal((1, H), np.float32), stop))
    fused_steps, plain_steps = dispatches[2::2], dispatches[3::2]
    if not whole:  # Q|K|V as one product, O, swiglu and down: 4 dispatches a layer, not 6 (the rest on the CPU)
        assert set(fused_steps) == {4 * stop} and set(plain_steps) == {6 * stop}, dispatches
        return
    layer = 10 if case == "Q8_0-V-F32" else 9
    assert set(fused_steps) == {layer * stop} and set(plain_steps) == {13 * stop}, dispatches


def assert_fused_bits(model, gpu, stop: int, whole: bool, requests: list[M.StageRequest]) -> StageRunner:
    """A fused stage and an unfused one (``fuse=False``) of ``model``'s layers 0:stop hold the
    same bytes and answer every request of ``requests``, in turn, with the same bits. Returns
    the fused stage's runner."""
    _, fused, device = runners(model, gpu, stop, whole)
    _, plain, plain_device = runners(model, gpu, stop, whole, fuse=False)
    assert device.resident(0, stop) == plain_device.resident(0, stop) == whole
    assert [device.load_layer(n) for n in range(stop)] == [plain_device.load_layer(n) for n in range(stop)]
    for req in requests:
        a, b = fused.handle(req), plain.handle(req)
        assert isinstance(a, M.StageAnswer) and isinstance(b, M.StageAnswer), (req.request_id, a, b)
        assert a.x.dtype == b.x.dtype == np.float32 and np.array_equal(a.x, b.x), req.request_id
    return fused


FUSED_CASES = {  # case: (family, qtype, whole layers)
    "qwen2-qkv-bias": ("qwen2", QT.Q8_0, True),
    "qwen3-qk-norm-Q8_0": ("qwen3", QT.Q8_0, True),
    "qwen3-qk-norm-F32": ("qwen3", QT.F32, True),
    "qwen2_moe": ("qwen2_moe", QT.Q8_0, True),
    "mixtral": ("mixtral", QT.Q8_0, True),
    "qwen3_moe-F16": ("qwen3_moe", QT.F16, True),
    "o-bias": ("llama", QT.Q8_0, True),
    "kv-growth": ("llama", QT.Q8_0, True),
    "chunked": ("llama", QT.Q8_0, True),
    "chunked-products": ("llama", QT.Q8_0, False),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_a_fused_stage_gives_the_unfused_bits_for_each_kind_of_layer(gpu, tmp_path, monkeypatch, case):
    """Beyond plain llama layers: Qwen2's Q/K/V biases, Qwen3's norm of each head (Q8_0 and
    F32), MoE layers (Qwen2-MoE's shared expert, Mixtral, Qwen3-MoE's F16 and its dense layer; a
    prefill of two sequences, then decode steps), an O with a bias (O keeps its own adds), a
    12-row prompt in chunks (bindings capped at 8 KiB; whole layers and products only), and the
    KV cache growing past 16 positions (two sequences taking turns to 32): the fused stage's
    rows are bit for bit the unfused stage's, with the same bytes held."""
    from web_peer.wgpu_host import WgpuFfn

    family, qtype, whole = FUSED_CASES[case]
    model = gguf_model(tmp_path, monkeypatch, family, qtype, **(WIDE if family == "llama" else {}))
    stop = model.config.n_layers
    H = model.config.hidden_size
    rng = np.random.default_rng(31)
    rows = lambda n: rng.standard_normal((n, H), np.float32)  # noqa: E731
    if case == "o-bias":  # as gpt-oss's attn_output.bias
        for layer in range(stop):
            bias = rng.standard_normal(H).astype(np.float32)
            model._attn[layer] = dataclasses.replace(model.attention_weights(layer), o_bias=bias)  # noqa: SLF001
    if case.startswith("chunked"):
        small = GpuFfn(WgpuFfn(max_binding=8 << 10))
        try:
            assert_fused_bits(model, small, stop, whole, [request(1, [(1, 0, 12)], rows(12), stop),
                                                          request(2, [(1, 12, 1)], rows(1), stop)])
            assert small.host.largest_binding <= 8 << 10
        finally:
            small.close()
        return
    reqs = [request(1, [(1, 0, 6), (2, 0, 3)], rows(9), stop)]  # a prefill of two sequences
    steps = 23 if case == "kv-growth" else 3  # sequence 1 to 29 positions, 2 beside it to 26
    reqs += [request(2 + s, [(1, 6 + s, 1), (2, 3 + s, 1)], rows(2), stop) for s in range(steps)]
    if case == "kv-growth":  # then each alone, in turn, past 32: the buffers grow again
        reqs += [request(30 + s, [(1 + s % 2, (29, 26)[s % 2] + s // 2, 1)], rows(1), stop) for s in range(8)]
    fused = assert_fused_bits(model, gpu, stop, whole, reqs)
    if case == "kv-growth":  # grown twice (16 → 32 → 64) for sequence 1, once for sequence 2
        assert {kv.cap for c in fused._caches.values() for kv in c.device_kv.values()} == {32, 64}  # noqa: SLF001
