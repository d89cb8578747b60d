"""The compute threads: a model's logits are the same bits at any thread count, for every
encoding the engine multiplies by; the default count follows affinity and the cgroup quota."""

from __future__ import annotations

import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from swarm.compute import kernels, quant, threads
from swarm.compute.model import load_model
from tests.compute.test_quant_kernels import COMPILED_K, K_HALVES, PLAIN, QUANTIZED

F32 = np.float32
# hidden and expert FFN a multiple of 256 (the K-quants' super-block); 2 key/value heads of 4
H, F, E, TOP_K, HEADS, KV_HEADS, HD, VOCAB, LAYERS = 256, 256, 4, 2, 4, 2, 64, 96, 2


def _matrix(rng: np.random.Generator, shape: tuple[int, ...], qtype: QT, std: float) -> np.ndarray:
    """``shape`` [..., rows, cols] of weights of about ``std`` in ``qtype``'s bytes (F32: floats)."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if qtype in COMPILED_K:  # gguf cannot write K-quants: random blocks with small scales
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
        d = std / 8 if qtype != QT.Q6_K else std / 512  # Q6_K: d · int8 sub-scale · (q - 32)
        for at in K_HALVES[qtype]:
            raw[:, at:at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        return raw.reshape(*shape[:-1], cols // block * size)
    w = (rng.standard_normal(shape, dtype=F32) * F32(std)).astype(F32)
    return w if qtype == QT.F32 else gguf.quants.quantize(w, qtype)


def write_tiny_moe(path: Path, qtype: QT, seed: int = 0) -> Path:
    """A random 2-layer Qwen3-MoE (4 experts, top 2, GQA 4/2) with every matrix in ``qtype``."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(F)

    def put(name: str, shape: tuple[int, ...], std: float) -> None:
        a = _matrix(rng, shape, qtype, std)
        w.add_tensor(name, a, raw_dtype=None if qtype == QT.F32 else qtype)

    put("token_embd.weight", (VOCAB, H), 1.0)
    w.add_tensor("output_norm.weight", np.ones(H, F32))
    put("output.weight", (VOCAB, H), H ** -0.5)
    for i in range(LAYERS):
        b = f"blk.{i}."
        for norm, n in (("attn_norm", H), ("ffn_norm", H), ("attn_q_norm", HD), ("attn_k_norm", HD)):
            w.add_tensor(b + norm + ".weight", (1 + 0.1 * rng.standard_normal(n)).astype(F32))
        w.add_tensor(b + "ffn_gate_inp.weight", rng.standard_normal((E, H), dtype=F32) * F32(H ** -0.5))
        put(b + "attn_q.weight", (HEADS * HD, H), H ** -0.5)
        put(b + "attn_k.weight", (KV_HEADS * HD, H), H ** -0.5)
        put(b + "attn_v.weight", (KV_HEADS * HD, H), H ** -0.5)
        put(b + "attn_output.weight", (H, HEADS * HD), (HEADS * HD) ** -0.5)
        put(b + "ffn_gate_exps.weight", (E, F, H), H ** -0.5)
        put(b + "ffn_up_exps.weight", (E, F, H), H ** -0.5)
        put(b + "ffn_down_exps.weight", (E, H, F), F ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def every_call_split(monkeypatch):
    """No call too small to cut: every product, norm, SwiGLU and attention runs in parts."""
    monkeypatch.setattr(quant, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(quant, "GROUP_TILE_BYTES", 1)  # tiles of 8 rows, every thread asked to join
    monkeypatch.setattr(quant, "MAX_TILE_BYTES", 1)
    monkeypatch.setattr(kernels, "MIN_ELEMENTWISE", 1)
    monkeypatch.setattr(kernels, "MIN_ATTENTION_WORK", 1)
    before = threads.threads()
    yield
    threads.set_threads(before)


@pytest.mark.parametrize("qtype", QUANTIZED + COMPILED_K + PLAIN, ids=lambda q: q.name)
def test_logits_are_the_same_bits_at_any_thread_count(qtype, tmp_path, every_call_split):
    """A 9-token prefill, then two decode steps, of a random MoE in ``qtype``: the logits at 2,
    3 and 8 threads are those at 1, bit for bit."""
    model = load_model(write_tiny_moe(tmp_path / f"{qtype.name}.gguf", qtype))
    tokens = np.random.default_rng(1).integers(0, VOCAB, 11).tolist()

    def logits(n: int) -> np.ndarray:
        threads.set_threads(n)
        cache = model.new_cache()
        steps = [model.forward(tokens[:9], cache), model.forward(tokens[9:10], cache),
                 model.forward(tokens[10:], cache)]
        return np.concatenate(steps)

    one = logits(1)
    assert np.isfinite(one).all() and one.std() > 0
    for n in (2, 3, 8):
        np.testing.assert_array_equal(logits(n), one, err_msg=f"{qtype.name} at {n} threads")


def test_calls_from_several_threads_at_once_share_the_pool(every_call_split):
    """Products started from four threads at once (loopback peers in one process) each get the
    bits of the one-thread call: no lock, no launch that aborts."""
    m = quant.QMatrix(np.ascontiguousarray(_matrix(np.random.default_rng(2), (300, 256), QT.Q4_K, 0.1)),
                      QT.Q4_K, 256)
    x = np.random.default_rng(3).standard_normal((5, 256), dtype=F32)
    threads.set_threads(1)
    want = m.matmul(x)
    threads.set_threads(3)
    got, errors = [], []

    def call() -> None:
        try:
            for _ in range(20):
                got.append(m.matmul(x))
        except Exception as exc:  # reported below
            errors.append(exc)

    callers = [threading.Thread(target=call) for _ in range(4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert not errors and len(got) == 80
    assert all(np.array_equal(g, want) for g in got)


@pytest.mark.parametrize("T", [1, 5, 70])
def test_products_handed_over_together_keep_their_bits(T, every_call_split):
    """Products of several encodings and shapes cut together into chunks that span them: each
    result is its product's one-thread bits at 2, 3 and 8 threads, into a strided ``out`` too,
    and matches the float64 product of the dequantized weights."""
    rng = np.random.default_rng(4)
    ms = [quant.QMatrix(np.ascontiguousarray(_matrix(rng, (rows, 256), qtype, 0.1)).reshape(rows, -1), qtype, 256)
          if qtype != QT.F32 else quant.QMatrix.from_float(_matrix(rng, (rows, 256), qtype, 0.1))
          for rows, qtype in ((300, QT.Q4_K), (8, QT.Q8_0), (96, QT.F32), (40, QT.Q6_K))]
    xs = [rng.standard_normal((T, 256), dtype=F32) for _ in ms]
    threads.set_threads(1)
    want = [m.matmul(x) for m, x in zip(ms, xs)]
    for m, x, y in zip(ms, xs, want):
        np.testing.assert_allclose(y, x.astype(np.float64) @ m.dequantize().astype(np.float64).T, rtol=1e-4, atol=1e-4)
    for n in (1, 2, 3, 8):
        threads.set_threads(n)
        wide = np.full((T, ms[1].shape[0] + 3), np.nan, F32)
        got = quant.matmul_many([(ms[0], xs[0], None), (ms[1], xs[1], wide[:, 3:]), (ms[2], xs[2], None),
                                 (ms[3], xs[3], None)])
        assert got[1].base is wide and np.isnan(wide[:, :3]).all()
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"product {i} at {n} threads")


def test_a_group_is_shared_by_the_threads_that_run_it(every_call_split):
    """Threads running one group call take its tiles from one counter: every tile is computed
    once (the counts add up), and the results are the one-thread products' bits."""
    rng = np.random.default_rng(5)
    ms = [quant.QMatrix(np.ascontiguousarray(_matrix(rng, (rows, 512), QT.Q4_K, 0.1)), QT.Q4_K, 512)
          for rows in (200, 64, 136)]
    x = rng.standard_normal((1, 512), dtype=F32)
    threads.set_threads(1)
    want = [m.matmul(x) for m in ms]
    got = [np.full((1, m.shape[0]), np.nan, F32) for m in ms]
    g = quant._kernels()
    table = np.array([[m._kind, quant._address(m.data), m.shape[0], m.data.shape[1], quant._address(x), 1, 512,
                       quant._address(y), 8, first] for m, y, first in zip(ms, got, (0, 25, 33))], np.int64)
    counter, done = np.zeros(2, np.int64), []
    runners = [threading.Thread(target=lambda: done.append(g.run_group(table, counter, 50))) for _ in range(3)]
    for r in runners:
        r.start()
    done.append(g.run_group(table, counter, 50))
    for r in runners:
        r.join()
    assert sum(done) == 50 and counter[0] >= 50
    for y, w in zip(got, want):
        np.testing.assert_array_equal(y, w)


def test_a_float32_product_runs_in_a_group_with_matmul_f32s_bits(every_call_split):
    """A float32 matrix (a router) takes its own group kind (quant's and qkernels' constants one),
    and its rows in a group shared by threads are matmul_f32's one-thread bits."""
    g = quant._kernels()
    assert quant._FLOAT32_GROUP == g.FLOAT32 and g.FLOAT32 not in quant._KIND.values()
    rng = np.random.default_rng(6)
    m = quant.QMatrix.from_float(rng.standard_normal((136, 512), dtype=F32))
    x = rng.standard_normal((2, 512), dtype=F32)
    want = np.empty((2, 136), F32)
    g.matmul_f32(m.data.view(F32), x, want, 0, 0, 136)
    got = np.full((2, 136), np.nan, F32)
    table, tiles, _ = quant.group_table([(m, x, got)])
    assert table[0, 0] == g.FLOAT32 and tiles > 1
    counter, done = np.zeros(2, np.int64), []
    runners = [threading.Thread(target=lambda: done.append(g.run_group(table, counter, tiles))) for _ in range(3)]
    for r in runners:
        r.start()
    done.append(g.run_group(table, counter, tiles))
    for r in runners:
        r.join()
    assert sum(done) == tiles
    np.testing.assert_array_equal(got, want)


def test_split_weighted_covers_every_range_once():
    chunks = threads.split_weighted([(100, 1.0), (20, 5.0), (3, 1.0)], 4, 8)
    assert len(chunks) == 4
    flat = [piece for chunk in chunks for piece in chunk]
    for i, n in enumerate((100, 20, 3)):  # each range's pieces ascending and adjacent, covering 0:n
        pieces = [(lo, hi) for j, lo, hi in flat if j == i]
        assert pieces[0][0] == 0 and pieces[-1][1] == n and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(lo % 8 == 0 for lo, _ in pieces)
    work = [sum((hi - lo) * (1.0, 5.0, 1.0)[i] for i, lo, hi in chunk) for chunk in chunks]
    assert max(work) <= 223 / 4 + 8 * 5 and [i for i, _, _ in flat] == sorted(i for i, _, _ in flat)
    assert threads.split_weighted([(5, 1.0)], 8) == [[(0, 0, 1)], [(0, 1, 2)], [(0, 2, 3)], [(0, 3, 4)], [(0, 4, 5)]]


def test_an_exception_in_a_part_reaches_the_caller():
    threads.set_threads(3)
    try:
        def part(lo: int, hi: int) -> None:
            if lo > 0:
                raise RuntimeError(f"part {lo}")

        with pytest.raises(RuntimeError, match="part"):
            threads.run_chunks(part, threads.split(30, 3))
    finally:
        threads.set_threads(None)


def test_an_interrupted_wait_returns_only_after_the_workers_are_done():
    """Ctrl-C (SIGINT) while the caller waits for the pool: the KeyboardInterrupt reaches it, but
    only once every worker's chunk is done, since the chunks write into arrays the caller owns
    (freed as the interrupt unwinds it)."""
    import os
    import signal
    import time

    if threading.current_thread() is not threading.main_thread():
        pytest.fail("signals reach the main thread only: run this test there")
    threads.set_threads(3)
    finished: list[int] = []
    on_workers = threading.Semaphore(0)
    both = threading.Event()

    def part(lo: int, hi: int) -> None:
        if threading.current_thread() is threading.main_thread():
            both.wait(10)  # the caller's chunk: done once both workers hold theirs
            return
        on_workers.release()
        time.sleep(0.5)
        finished.append(lo)

    def interrupt() -> None:
        for _ in range(2):
            on_workers.acquire(timeout=10)
        both.set()
        time.sleep(0.1)  # the caller is back in its wait for the workers
        os.kill(os.getpid(), signal.SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            threads.run_chunks(part, [(0, 1), (1, 2), (2, 3)])
        assert len(finished) == 2, "run_chunks returned while workers still ran"
    finally:
        signal.signal(signal.SIGINT, previous)
        threads.set_threads(None)


def test_split_covers_the_range_on_aligned_bounds():
    assert threads.split(100, 3, 8) == [(0, 32), (32, 64), (64, 100)]
    assert threads.split(5, 8) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert threads.split(10, 4, 64) == [(0, 10)]


def test_available_cores_respect_the_cgroup_quota(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/peer.slice\n")
    (tmp_path / "peer.slice").mkdir()
    (tmp_path / "peer.slice" / "cpu.max").write_text("250000 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path, proc) == 2.5
    assert threads.available_cores(tmp_path, proc) == min(3, threads.available_cores(tmp_path / "none", proc))
    (tmp_path / "peer.slice" / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path, proc) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:cpu,cpuacct:/\n")
    assert threads.cgroup_cpu_quota(v1, proc) == 0.5
    assert threads.available_cores(v1, proc) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpu_quota(v1, proc) is None


def test_thread_count_from_the_environment(monkeypatch):
    """``$COLIBRI_SWARM_THREADS`` sets the count; anything but 1..MAX_THREADS is refused by name
    (not silently replaced by the cores), as is such a count given to set_threads."""
    before = threads.threads()
    try:
        monkeypatch.setenv(threads.THREADS_ENV, "5")
        monkeypatch.setattr(threads, "_threads", None)
        assert threads.threads() == 5
        monkeypatch.setenv(threads.THREADS_ENV, "")  # empty: unset
        monkeypatch.setattr(threads, "_threads", None)
        assert threads.threads() == threads.available_cores()
        for bad in ("0", "abc", "-3", str(threads.MAX_THREADS + 1)):
            monkeypatch.setenv(threads.THREADS_ENV, bad)
            monkeypatch.setattr(threads, "_threads", None)
            with pytest.raises(ValueError, match=rf"\$COLIBRI_SWARM_THREADS must be .* 1 to 1024, got '{bad}'"):
                threads.threads()
        for bad in (0, threads.MAX_THREADS + 1):
            with pytest.raises(ValueError, match="whole number from 1 to 1024"):
                threads.set_threads(bad)
    finally:
        threads.set_threads(before)


def test_threads_option_on_the_commands(capsys, monkeypatch):
    """``--threads`` on generate and join, 1..MAX_THREADS (far past the cores a process only waits,
    and the OS refuses threads in the thousands); chat computes nothing here and has none; a bad
    ``$COLIBRI_SWARM_THREADS`` is refused in one line before any work."""
    from swarm.cli import MAX_THREADS, _use_compute_options, build_parser, main
    from swarm.errors import SwarmError

    assert MAX_THREADS == threads.MAX_THREADS  # the CLI's copy (it starts without numpy)
    for command in (["generate", "hi"], ["join"]):
        assert build_parser().parse_args([*command, "--threads", "3"]).threads == 3
        assert build_parser().parse_args(command).threads is None
        for bad, why in (("0", "at least 1, got 0"), ("100000", "at most 1024, got 100000")):
            with pytest.raises(SystemExit):
                build_parser().parse_args([*command, "--threads", bad])
            assert f"--threads must be {why}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--threads", "3"])
    assert "unrecognized arguments: --threads" in capsys.readouterr().err
    before = threads.threads()
    try:
        monkeypatch.setenv(threads.THREADS_ENV, "abc")
        with pytest.raises(SwarmError, match="COLIBRI_SWARM_THREADS must be a whole number"):
            _use_compute_options(build_parser().parse_args(["generate", "hi"]))
        assert main(["generate", "hi", "--local"]) == 2
        assert "COLIBRI_SWARM_THREADS must be a whole number" in capsys.readouterr().err
        monkeypatch.setenv(threads.THREADS_ENV, "3")
        _use_compute_options(build_parser().parse_args(["generate", "hi"]))
        assert threads.threads() == 3  # the environment's count, where no --threads is given
    finally:
        threads.set_threads(before)


def test_a_slow_kernel_load_is_announced(monkeypatch):
    """Past COMPILE_NOTICE_S the user is told the kernels are compiling, once, then each group's
    time; a quick load (numba's cache) says nothing."""
    import time

    lines: list[str] = []
    monkeypatch.setattr(quant, "COMPILE_NOTICE_S", 0.05)
    monkeypatch.setattr(quant, "_told", False)
    quant.on_compiling(lines.append)
    try:
        with quant.compiling("quick"):
            pass
        assert lines == []
        for group in ("first", "second"):
            with quant.compiling(group):
                time.sleep(0.2)
    finally:
        quant.on_compiling(None)
    assert lines[0] == quant.COMPILING and len(lines) == 3
    assert lines[1].startswith("  first: ") and lines[2].startswith("  second: ")
