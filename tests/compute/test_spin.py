"""The spinning compute workers (swarm/compute/spin.py): a group's tiles computed by the caller
and the workers give one thread's bits; workers do join; no worker reads a group after the
caller's ``run`` returns; several callers at once; idle workers sleep and are woken; close;
attention and RMSNorm items on the workers give one thread's bits, and fall back to the Python
pool while another caller holds them."""

from __future__ import annotations

import threading
import time

import gguf
import numpy as np
import pytest

from swarm.compute import quant
from swarm.compute.quant import QMatrix

QT = gguf.GGMLQuantizationType
R, C = 256, 1024


@pytest.fixture(scope="module")
def spin():
    quant._kernels()
    from swarm.compute import spin as module
    return module


def _matrix(seed: int, rows: int = R) -> QMatrix:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, C // 32 * 34), dtype=np.uint8)
    data.reshape(rows, -1, 34)[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return QMatrix(data, QT.Q8_0, C)


def _group(w: QMatrix, x: np.ndarray, out: np.ndarray, tile: int = 8) -> tuple[np.ndarray, int]:
    """A one-product group table (qkernels' columns) and its tile count."""
    rows = w.shape[0]
    row = (w._kind, w._addr, rows, w.data.shape[1], quant._address(x), x.shape[0], C, quant._address(out), tile, 0)
    return np.array([row], np.int64), -(-rows // tile)


def test_groups_give_one_threads_bits_and_workers_take_tiles(spin):
    w = _matrix(1, rows=2048)
    x = np.random.default_rng(2).standard_normal((3, C)).astype(np.float32)
    want = np.empty((3, 2048), np.float32)
    quant._kernels().matmul(w._kind, w.data, x, want, 0, 2048)
    pool = spin.SpinPool(3)
    try:
        groups = shared = 0
        deadline = time.monotonic() + 20  # a loaded machine may leave the workers no core for a while
        while (groups < 100 or not shared) and time.monotonic() < deadline:
            out = np.full((3, 2048), np.nan, np.float32)
            table, tiles = _group(w, x, out)
            mine = pool.run(table, np.zeros(2, np.int64), tiles)
            assert mine is not None and 0 <= mine <= tiles
            assert np.array_equal(out, want)
            groups += 1
            shared += mine < tiles
        assert shared > 0, f"no worker took a tile of {groups} groups"
    finally:
        pool.close()


def test_no_worker_reads_a_group_after_run_returns(spin):
    # After run returns, the table is pointed at a canary and its counter reset: a worker still
    # holding the old group (the protocol broken) would compute tiles into the canary.
    w = _matrix(3)
    x = np.random.default_rng(4).standard_normal((1, C)).astype(np.float32)
    canary = np.full((1, R), np.nan, np.float32)
    pool = spin.SpinPool(2)
    try:
        for _ in range(5000):
            out = np.empty((1, R), np.float32)
            table, tiles = _group(w, x, out, tile=32)
            counter = np.zeros(2, np.int64)
            assert pool.run(table, counter, tiles) is not None
            table[0, 7] = quant._address(canary)
            counter[0] = 0
        time.sleep(0.05)
        assert np.isnan(canary).all()
    finally:
        pool.close()


def test_int8_groups_quantize_in_their_first_tiles_and_give_one_threads_bits(spin):
    """An int8 group (``qkernels.int8_group``): three products, two sharing their activation
    rows, quantized by the group's first tiles (more parts than rows), then computed — on
    spinning workers of the int8 numerics and on Python-pool threads — give the bits of one
    thread, and every quantizing tile is counted done before the call returns."""
    from swarm.compute import threads

    quant.prepare_int8()
    k = quant._kernels()
    ws = [_matrix(30 + i) for i in range(3)]
    rng = np.random.default_rng(7)
    shared, alone = (rng.standard_normal((T, C)).astype(np.float32) for T in (5, 1))
    xs = [shared, shared, alone]

    def group(parts):
        outs = [np.full((x.shape[0], R), np.nan, np.float32) for x in xs]
        rows = [(w._kind, w._addr, R, w.data.shape[1], quant._address(x), x.shape[0], C, quant._address(o), 8,
                 32 * i) for i, (w, x, o) in enumerate(zip(ws, xs, outs))]
        table, buf, quantizing = k.int8_group(np.array(rows, np.int64), parts)
        return outs, table, buf, quantizing, 3 * 32 + quantizing
    outs, table, buf, quantizing, tiles = group(1)
    assert quantizing == 2  # two distinct activation rows' sets, one tile each
    counter = np.zeros(2, np.int64)
    assert k.run_group_i8(table, counter, tiles) == tiles and counter[1] == quantizing
    want = outs
    pool = spin.SpinPool(3, int8=True)
    before = threads.threads()
    try:
        taken, deadline, groups = False, time.monotonic() + 20, 0
        while (groups < 100 or not taken) and time.monotonic() < deadline:
            outs, table, buf, quantizing, tiles = group(7)
            assert quantizing == 6  # 5 rows in 5 tiles of 1, 1 row in 1
            counter = np.zeros(2, np.int64)
            mine = pool.run(table, counter, tiles)
            assert mine is not None and counter[1] == quantizing
            assert all(np.array_equal(o.view(np.uint32), w.view(np.uint32)) for o, w in zip(outs, want))
            groups += 1
            taken |= mine < tiles
        assert taken, f"no int8 worker took a tile of {groups} groups"
        threads.set_threads(4)
        for _ in range(50):
            outs, table, buf, quantizing, tiles = group(50)
            counter = np.zeros(2, np.int64)
            threads.run_chunks(k.run_group_i8, [(table, counter, tiles)] * 4)
            assert counter[1] == quantizing
            assert all(np.array_equal(o.view(np.uint32), w.view(np.uint32)) for o, w in zip(outs, want))
    finally:
        threads.set_threads(before)
        pool.close()


def test_callers_at_once_each_get_their_bits(spin):
    # One caller holds the workers; the others find them taken (run returns None) and compute
    # alone, as quant's groups then fall back to the Python pool.
    pool = spin.SpinPool(2)
    results: dict[int, bool] = {}
    fallbacks = [0]

    def caller(i: int) -> None:
        w = _matrix(10 + i)
        x = np.random.default_rng(20 + i).standard_normal((2, C)).astype(np.float32)
        want = np.empty((2, R), np.float32)
        quant._kernels().matmul(w._kind, w.data, x, want, 0, R)
        ok = True
        for _ in range(200):
            out = np.full((2, R), np.nan, np.float32)
            table, tiles = _group(w, x, out)
            counter = np.zeros(2, np.int64)
            if pool.run(table, counter, tiles) is None:
                fallbacks[0] += 1
                quant._kernels().run_group(table, counter, tiles)
            ok &= bool(np.array_equal(out, want))
        results[i] = ok

    try:
        callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(120)
        assert results == {0: True, 1: True, 2: True}
    finally:
        pool.close()


def test_idle_workers_sleep_are_woken_and_close_ends_them(spin):
    # A group of ~1 ms (4096 rows, 4 activation rows): longer than a sleeping worker's wake-up.
    w = _matrix(5, rows=4096)
    x = np.random.default_rng(6).standard_normal((4, C)).astype(np.float32)
    want = np.empty((4, 4096), np.float32)
    quant._kernels().matmul(w._kind, w.data, x, want, 0, 4096)
    pool = spin.SpinPool(2, spins=200, yields=200)
    try:
        deadline = time.monotonic() + 10
        while pool._sleepers < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool._sleepers == 2  # idle: both left the spin-wait
        woke, groups, deadline = False, 0, time.monotonic() + 20
        while (groups < 20 or not woke) and time.monotonic() < deadline:
            groups += 1
            out = np.full((4, 4096), np.nan, np.float32)
            table, tiles = _group(w, x, out)
            mine = pool.run(table, np.zeros(2, np.int64), tiles)
            assert np.array_equal(out, want)
            woke |= mine < tiles
            time.sleep(0.002)  # the workers' wait (200 pauses, 200 yields) runs out: each group wakes them
        assert woke, "no sleeping worker was woken into a group"
    finally:
        pool.close()
    for t in pool.workers:
        t.join(5)
    assert not any(t.is_alive() for t in pool.workers)


def test_the_engine_with_spinning_workers_gives_one_threads_logits(spin, tmp_path, monkeypatch):
    """``COLIBRI_SWARM_SPIN=1``: a random MoE's prefill and decode logits at 2, 3 and 8 threads
    through the spinning workers are those at 1, bit for bit (every product cut into tiles of 8
    rows, every attention and norm into items, so every group is shared)."""
    from swarm.compute import kernels, threads
    from swarm.compute.model import load_model
    from tests.compute.test_threads import VOCAB, write_tiny_moe

    monkeypatch.setattr(spin, "_FORCED", "1")
    monkeypatch.setattr(quant, "GROUP_TILE_BYTES", 1)
    monkeypatch.setattr(quant, "MAX_TILE_BYTES", 1)
    monkeypatch.setattr(kernels, "MIN_ATTENTION_WORK", 1)
    monkeypatch.setattr(kernels, "SPIN_ATTENTION_WORK", 1)
    monkeypatch.setattr(kernels, "SPIN_NORM_ITEM", 1)
    model = load_model(write_tiny_moe(tmp_path / "moe.gguf", QT.Q4_K))
    tokens = np.random.default_rng(1).integers(0, VOCAB, 11).tolist()
    before = threads.threads()

    def logits(n: int) -> np.ndarray:
        threads.set_threads(n)
        cache = model.new_cache()
        return np.concatenate([model.forward(tokens[:9], cache), model.forward(tokens[9:10], cache),
                               model.forward(tokens[10:], cache)])

    try:
        one = logits(1)
        for n in (2, 3, 8):
            np.testing.assert_array_equal(logits(n), one, err_msg=f"{n} threads")
        assert spin._pool is not None and spin._pool.size == 7  # the groups went to the spinning workers
    finally:
        threads.set_threads(before)


def test_decode_attention_too_small_for_the_python_pool_goes_to_the_spinning_workers(spin, tmp_path, monkeypatch):
    """A decode row's attention of work at or above ``SPIN_ATTENTION_WORK``, below the Python
    pool's ``MIN_ATTENTION_WORK``, is shared with the spinning workers (at a short context it
    would keep every other thread waiting), with one thread's bits; above it, it stays whole
    on the calling thread."""
    from swarm.compute import kernels, threads
    from swarm.compute.model import load_model
    from tests.compute.test_threads import LAYERS, VOCAB, write_tiny_moe

    monkeypatch.setattr(spin, "_FORCED", "1")
    monkeypatch.setattr(kernels, "MIN_ATTENTION_WORK", 1 << 40)  # the Python pool never takes it
    model = load_model(write_tiny_moe(tmp_path / "moe.gguf", QT.Q8_0))
    assert model._decode is not None  # one-row calls take the decode path
    c = model.config
    tokens = np.random.default_rng(3).integers(0, VOCAB, 12).tolist()
    kinds: list[tuple[int, int]] = []  # each row work call's (OP, query rows)
    run_rows = spin.SpinPool.run_rows

    def recorded(self, table, counter, items):
        kinds.append((int(table[0]), int(table[2])))
        return run_rows(self, table, counter, items)

    monkeypatch.setattr(spin.SpinPool, "run_rows", recorded)
    before = threads.threads()

    def decoded(n: int) -> np.ndarray:
        threads.set_threads(n)
        cache = model.new_cache()
        model.forward(tokens[:10], cache)
        return np.concatenate([model.forward(tokens[10:11], cache), model.forward(tokens[11:], cache)])

    try:
        one = decoded(1)
        row = kernels._row or kernels._row_kernels()
        decode_row = (row.ATTENTION, 1)  # an attention call of one query row (fields OP, A_T)
        assert row.A_T == 2
        for threshold, shared in ((c.n_heads * 11 * c.head_dim, True), (c.n_heads * 13 * c.head_dim, False)):
            monkeypatch.setattr(kernels, "SPIN_ATTENTION_WORK", threshold)  # positions 10 and 11: 11 and 12 a head
            kinds.clear()
            np.testing.assert_array_equal(decoded(2), one)
            assert kinds.count(decode_row) == (2 * LAYERS if shared else 0), (threshold, kinds)
    finally:
        threads.set_threads(before)


# Attention cases (T, start, nh, nkv, hd): GQA groups of 4, 3, 8, 1 and 8 query heads; T on and off
# the blocks of M = 4 rows, a decode row at a long position; head dims with a tail past their
# last multiple of 8 (20, 12).
ATTENTION_CASES = ((64, 0, 8, 2, 64), (9, 5, 6, 2, 20), (1, 300, 8, 1, 16), (17, 3, 3, 3, 24), (33, 12, 16, 2, 12))


@pytest.fixture
def row_work_spun(spin, monkeypatch):
    """Spinning workers forced on, every attention call and norm cut into items (a norm's: one
    row), output arrays made NaN (an item left uncomputed shows); yields the list of each row
    work call's ``(items the caller computed, items)``."""
    from swarm.compute import kernels, threads

    monkeypatch.setattr(spin, "_FORCED", "1")
    monkeypatch.setattr(kernels, "MIN_ATTENTION_WORK", 1)
    monkeypatch.setattr(kernels, "SPIN_ATTENTION_WORK", 1)
    monkeypatch.setattr(kernels, "SPIN_NORM_ITEM", 1)
    monkeypatch.setattr(kernels, "aligned_empty", lambda shape: np.full(shape, np.nan, np.float32))
    calls: list[tuple[int, int]] = []
    run_rows = spin.SpinPool.run_rows

    def recorded(self, table, counter, items):
        mine = run_rows(self, table, counter, items)
        if mine is not None:
            calls.append((mine, items))
        return mine

    monkeypatch.setattr(spin.SpinPool, "run_rows", recorded)
    before = threads.threads()
    yield calls
    threads.set_threads(before)


def _row_work_inputs(seed: int) -> list[tuple]:
    """Inputs of :func:`_row_work`: each attention case's q, k, v (positions past the queries'
    NaN: never read), start; RMSNorm rows with one weight, and heads with one weight each."""
    rng = np.random.default_rng(seed)
    cases = []
    for T, start, nh, nkv, hd in ATTENTION_CASES:
        q = rng.standard_normal((T, nh, hd), dtype=np.float32)
        k, v = (rng.standard_normal((nkv, start + T + 3, hd), dtype=np.float32) for _ in range(2))
        k[:, start + T:] = v[:, start + T:] = np.nan
        cases.append((q, k, v, start))
    cases.append((rng.standard_normal((37, 200), dtype=np.float32), rng.standard_normal(200, dtype=np.float32)))
    cases.append((rng.standard_normal((9, 5, 24), dtype=np.float32), rng.standard_normal((5, 24), dtype=np.float32)))
    qn, kn = rng.standard_normal(24, dtype=np.float32), rng.standard_normal(24, dtype=np.float32)
    stacked = np.concatenate([np.broadcast_to(qn, (8, 24)), np.broadcast_to(kn, (2, 24))])  # Qwen3's, column-major
    assert not stacked.flags.c_contiguous
    cases.append((rng.standard_normal((9, 10, 24), dtype=np.float32), stacked))
    return cases


def _row_work(cases: list[tuple]) -> list[np.ndarray]:
    from swarm.compute import kernels

    return [kernels.attention(*c) if len(c) == 4 else kernels.rms_norm(*c, 1e-6) for c in cases]


@pytest.mark.parametrize("numerics_name", ["float32", "int8"])
def test_attention_and_rms_norm_on_spinning_workers_give_one_threads_bits(row_work_spun, numerics_name):
    """Attention (GQA ratios, T, start, decode) and RMSNorm (one weight, one per head) on 2, 3 and
    8 threads with every call on the spinning workers (float32's pool and int8's, which serve
    row work beside their own groups) give the bits of one thread; workers do take items."""
    from swarm.compute import numerics, threads

    cases = _row_work_inputs(50)
    before = numerics.numerics()
    numerics.set_numerics(numerics_name)
    try:
        threads.set_threads(1)
        want = _row_work(cases)
        assert not row_work_spun and not any(np.isnan(w).any() for w in want)
        for n in (2, 3, 8):
            threads.set_threads(n)
            for got, w in zip(_row_work(cases), want):
                assert np.array_equal(got, w), f"{n} threads"
        assert len(row_work_spun) == 3 * len(cases)  # every call went to the spinning workers
        assert spin_pool_int8() == (numerics_name == "int8")
        deadline = time.monotonic() + 20  # a loaded machine may leave the workers no core for a while
        threads.set_threads(3)
        while all(mine == items for mine, items in row_work_spun) and time.monotonic() < deadline:
            for got, w in zip(_row_work(cases), want):
                assert np.array_equal(got, w)
        assert any(mine < items for mine, items in row_work_spun), "no worker took an item"
    finally:
        numerics.set_numerics(before)


def spin_pool_int8() -> bool:
    from swarm.compute import spin

    assert spin._pool is not None
    return spin._pool.int8


def test_row_work_falls_back_to_the_python_pool_while_another_caller_holds_the_workers(row_work_spun):
    """A caller that finds the spinning workers taken runs attention and RMSNorm on the Python
    pool: the same bits, the workers untouched."""
    from swarm.compute import threads

    cases = _row_work_inputs(51)
    threads.set_threads(1)
    want = _row_work(cases)
    threads.set_threads(3)
    workers = quant.spin_workers()
    assert workers is not None
    assert workers._busy.acquire(blocking=False)  # another caller's group
    try:
        declined = workers.declined
        for got, w in zip(_row_work(cases), want):
            assert np.array_equal(got, w)
        assert workers.declined == declined + len(cases) and not row_work_spun
    finally:
        workers._busy.release()


def test_spinning_workers_are_the_default_from_four_threads_with_a_core_each(spin, monkeypatch):
    """Unset: the Python pool below 4 threads and with more threads than cores, spinning workers
    from 4 up to the cores; ``COLIBRI_SWARM_SPIN`` 1 / 0 force them on / off at any count > 1."""
    monkeypatch.setattr(spin, "_FORCED", "")
    monkeypatch.setattr(spin, "_cores", 16)
    assert [n for n in (1, 2, 3, 4, 8, 16, 17, 32) if spin.wanted(n)] == [4, 8, 16]
    monkeypatch.setattr(spin, "_cores", 2)
    assert not any(spin.wanted(n) for n in (1, 2, 3, 4, 8))
    monkeypatch.setattr(spin, "_FORCED", "1")
    assert [n for n in (1, 2, 3, 4, 8) if spin.wanted(n)] == [2, 3, 4, 8]
    monkeypatch.setattr(spin, "_FORCED", "0")
    monkeypatch.setattr(spin, "_cores", 16)
    assert not any(spin.wanted(n) for n in (1, 2, 4, 16))


def test_a_bad_spin_setting_is_refused_by_name():
    import os
    import subprocess
    import sys

    env = dict(os.environ, COLIBRI_SWARM_SPIN="yes")
    run = subprocess.run([sys.executable, "-c", "import swarm.compute.spin"], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "COLIBRI_SWARM_SPIN must be 0" in run.stderr and "'yes'" in run.stderr
