"""Compiled hand-off of a group of product tiles (``quant._run_group``), or of a call's row
work (attention, RMSNorm: ``rowkernels.row_work``), to the compute threads.

Why. A decode token hands its products to the threads in ~5 groups a layer (query/key/value, the
router, the experts' gate and up products, their down products, the output projection): 60–100
groups a token, each a few to a few hundred µs of work. Handing a group to Python worker threads
costs each of them a wake-up and the GIL for a few µs of bytecode, one after the other: tens of
µs a group on 2 threads, more on 16, which is the whole of a 16-thread decode token's budget. Here
the workers wait for groups inside compiled code that holds no GIL: a group is published in a
control block (:data:`CTRL` int64 fields) and every waiting worker sees it within a spin-wait
iteration, takes tiles from the group's atomic counter like the caller (``qkernels.run_group``),
and is back to waiting with no Python between.

Protocol (every access to the control block is a sequentially consistent atomic):

* the caller writes the group's runner (:data:`PRODUCTS`: the pool's ``qkernels.run_group`` or
  ``run_group_i8``; :data:`ROW_WORK`: ``rowkernels.row_work``), table address, rows, counter
  address and tile count, then
  ``OPEN = g`` (a number new to each group), runs tiles itself until none is left to take, sets
  ``OPEN = 0`` and waits until ``ACTIVE == 0``;
* a worker that sees ``OPEN = g`` it has not served adds 1 to ``ACTIVE``, reads ``OPEN`` again
  and, only if it is still ``g``, reads the group and takes tiles; then subtracts 1. A worker
  that announces itself after the caller closed the group sees ``OPEN != g`` and touches nothing,
  so the caller's table and counter are never read after :func:`run` returns.

So a tile's result does not depend on who computed it (each output element keeps its one order
of float32 operations): the bits of one thread. A worker that finds no group for
:data:`SPINS` iterations with a pause and :data:`YIELDS` more giving its core away returns to
Python and sleeps until a caller wakes it (the cost of the old hand-off, paid only after an idle
spell of milliseconds: between requests, not between a token's groups). One caller at a time
uses the spinning workers; another that finds them taken falls back to the Python pool
(``threads.run_chunks``).

Row work. A prefill's attention and norms, handed to the Python pool, cost each part a wake-up
and the GIL in turn: on 16 cores attention took longer on 16 threads than on one. The same
waiting workers take their items (``rowkernels.row_work``: attention's (key/value head, block of
query rows), ranges of a norm's rows) as they take a group's tiles: one set of waiting workers
serves every kind of work.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from swarm.compute.qkernels import NCOLS, _pause, _view, _yield, run_group, run_group_i8
from swarm.compute.rowkernels import row_work
from swarm.compute.threads import available_cores

# Fields of the control block (int64 [CTRL], made by :func:`control_block`), on three 64-byte
# lines: what every idle worker polls (OPEN, STOP), the group the caller writes once (TABLE, ROWS,
# COUNTER, TILES, RUNNER), and the count workers change (ACTIVE): a worker joining a group then
# invalidates no line the others spin on.
OPEN, STOP = 0, 1
TABLE, ROWS, COUNTER, TILES, RUNNER = 8, 9, 10, 11, 12
# RUNNER's values: a group of products (table int64 [ROWS, NCOLS]) or row work (int64 [ROWS])
PRODUCTS, ROW_WORK = 0, 1
ACTIVE = 16
CTRL = 24
# Spin-wait iterations (each one pause instruction: ~25 ns on a Zen 5 core, ~50 on recent Intel)
# before an idle worker only yields: ~0.1-0.2 ms, longer than the Python between one group of a
# decode step and the next.
SPINS = 4000
# Then iterations that give the core to any other runnable thread (sched_yield: ~1 µs when none
# is) before the worker sleeps: ~10-20 ms, longer than the gaps between a token's groups and
# between a batch's steps. A worker woken from its sleep needs the GIL, one after the other:
# on 16 cores, 15 workers sleeping after 0.2 ms and woken for the next group made a decode token
# slower than the Python pool (bench/results/engine.md, "16 cores against llama-bench").
YIELDS = 10000
# On by default from SPIN_FROM_THREADS threads, when the process has a core for each thread: on a
# 16-core Xeon a MoE decode token took 7.9 ms with them against 20.6 ms with the Python pool at 16
# threads, 14.1 against 17.8 at 8, and about the same at 4 (bench/results/engine.md, "16 cores:
# spinning workers"). Below that, or with more threads than cores (a spinning worker then takes a
# core the caller needs, and one preempted inside a group holds the caller), the Python pool is
# kept: on 2 cores with other work running a decode token took longer with them.
# ``COLIBRI_SWARM_SPIN=1`` forces them on (any count > 1), ``=0`` off.
SPIN_FROM_THREADS = 4
_FORCED = os.environ.get("COLIBRI_SWARM_SPIN", "")
if _FORCED not in ("", "0", "1"):
    raise ValueError(f"COLIBRI_SWARM_SPIN must be 0 (Python pool), 1 (spinning workers) or unset "
                     f"(spinning workers from {SPIN_FROM_THREADS} threads), not {_FORCED!r}")
_cores: int | None = None  # available_cores(), read once


def wanted(threads: int) -> bool:
    """Whether a process computing on ``threads`` threads (its caller's included) hands groups to
    spinning workers: ``COLIBRI_SWARM_SPIN`` when set, else from :data:`SPIN_FROM_THREADS` threads
    up to the cores the process may use (``threads.available_cores``)."""
    global _cores
    if threads <= 1:
        return False
    if _FORCED:
        return _FORCED == "1"
    if threads < SPIN_FROM_THREADS:
        return False
    if _cores is None:
        _cores = available_cores()
    return threads <= _cores

_ints = _view(types.int64, False)


def _atomic(op: str | None):
    """An intrinsic on ``ctrl[i]`` (int64 array), sequentially consistent: ``op`` None a load
    ``(ctrl, i)``; else the read-modify-write ``op`` (``"xchg"``, ``"add"``) ``(ctrl, i, value)``,
    returning the value before."""
    if op is None:
        @intrinsic
        def load(typingctx, ctrl, i):
            def codegen(context, builder, sig, args):
                return builder.load_atomic(_element(context, builder, sig, args), "seq_cst", 8)
            return types.int64(ctrl, i), codegen
        return load

    @intrinsic
    def rmw(typingctx, ctrl, i, value):
        def codegen(context, builder, sig, args):
            return builder.atomic_rmw(op, _element(context, builder, sig, args), args[2], "seq_cst")
        return types.int64(ctrl, i, value), codegen
    return rmw


def _element(context, builder, sig, args):
    """The address of ``args[0][args[1]]`` (an int64 array and an index)."""
    return builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])


_load = _atomic(None)  # ctrl[i]
_swap = _atomic("xchg")  # ctrl[i] = value
_add = _atomic("add")  # ctrl[i] += value


def _serving(runner):
    """A worker's wait (:func:`serve`) that runs groups of products with the compiled ``runner``
    (``qkernels.run_group`` or ``run_group_i8``) and row work with ``rowkernels.row_work``: a
    closure, which the cached entry points below link as they link the block kernels."""
    @njit(nogil=True)
    def serve_with(ctrl, seen, spins, yields):
        idle = 0
        while idle < spins + yields:
            if _load(ctrl, STOP) != 0:
                return -1
            g = _load(ctrl, OPEN)
            if g != 0 and g != seen:
                _add(ctrl, ACTIVE, 1)
                if _load(ctrl, OPEN) == g:
                    counter = _ints(_load(ctrl, COUNTER), 1, 2).reshape(2)
                    if _load(ctrl, RUNNER) == ROW_WORK:
                        row_work(_ints(_load(ctrl, TABLE), 1, _load(ctrl, ROWS))[0], counter, _load(ctrl, TILES))
                    else:
                        runner(_ints(_load(ctrl, TABLE), _load(ctrl, ROWS), NCOLS), counter, _load(ctrl, TILES))
                _add(ctrl, ACTIVE, -1)
                seen = g
                idle = 0
            else:
                idle += 1
                if idle <= spins:
                    _pause()
                else:
                    _yield()
        return seen
    return serve_with


def _calling(runner, kind: int):
    """A caller's side (:func:`run`, :func:`run_rows`) publishing groups that workers run with
    RUNNER ``kind``, run here with the compiled ``runner`` (a closure, as :func:`_serving`)."""
    @njit(nogil=True)
    def run_with(ctrl, g, table, counter, tiles):
        _swap(ctrl, RUNNER, kind)
        _swap(ctrl, TABLE, table.ctypes.data)
        _swap(ctrl, ROWS, table.shape[0])
        _swap(ctrl, COUNTER, counter.ctypes.data)
        _swap(ctrl, TILES, tiles)
        _swap(ctrl, OPEN, g)
        done = runner(table, counter, tiles)
        _swap(ctrl, OPEN, 0)
        waited = 0
        while _load(ctrl, ACTIVE) != 0:
            waited += 1
            if waited < 1000:  # ~25 µs: a worker finishing its tile
                _pause()
            else:  # longer: it was likely preempted; let it have a core
                _yield()
        return done
    return run_with


_serve_f32, _run_f32 = _serving(run_group), _calling(run_group, PRODUCTS)
_serve_int8, _run_int8 = _serving(run_group_i8), _calling(run_group_i8, PRODUCTS)
_run_row_work = _calling(row_work, ROW_WORK)


@njit(cache=True, nogil=True)
def serve(ctrl, seen, spins, yields):  # pragma: no cover - compiled
    """A worker's wait: take tiles of every group published in ``ctrl`` (module docstring) until
    ``spins`` iterations with a pause, then ``yields`` giving the core away, pass with none, or
    ``STOP`` is set. ``seen``: the last group served. Returns the last group served (≥ 0), or -1
    once ``STOP`` is set. Releases the GIL."""
    return _serve_f32(ctrl, seen, spins, yields)


@njit(cache=True, nogil=True)
def run(ctrl, g, table, counter, tiles):  # pragma: no cover - compiled
    """The caller's side: publish group ``g`` (> 0, new) of ``table`` (int64 [n, NCOLS]) with its
    ``counter`` (int64 [2]) and ``tiles``, compute tiles until none is left to take, close the
    group and wait for every worker inside it. Returns the tiles this thread computed."""
    return _run_f32(ctrl, g, table, counter, tiles)


@njit(cache=True, nogil=True)
def serve_i8(ctrl, seen, spins, yields):  # pragma: no cover - compiled
    """:func:`serve` for the int8 numerics' groups (``qkernels.run_group_i8``), compiled on
    first use: a float32 process never holds its code."""
    return _serve_int8(ctrl, seen, spins, yields)


@njit(cache=True, nogil=True)
def run_i8(ctrl, g, table, counter, tiles):  # pragma: no cover - compiled
    """:func:`run` for the int8 numerics' groups."""
    return _run_int8(ctrl, g, table, counter, tiles)


@njit(cache=True, nogil=True)
def run_rows(ctrl, g, table, counter, items):  # pragma: no cover - compiled
    """:func:`run` for row work: ``table`` int64 [``rowkernels.ROW_WORK_FIELDS``] (one call of
    attention or RMSNorm), ``counter`` int64 [2] zero, ``items`` its item count; workers of
    either numerics serve it. Returns the items this thread computed."""
    return _run_row_work(ctrl, g, table, counter, items)


def control_block() -> np.ndarray:
    """A zeroed control block: int64 [CTRL] starting on a 64-byte line (its fields' lines are
    then the ones the layout above means)."""
    raw = np.zeros(CTRL + 8, np.int64)
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip:skip + CTRL]


class SpinPool:
    """``size`` daemon threads that wait for groups in compiled code (module docstring)."""

    def __init__(self, size: int, spins: int = SPINS, yields: int = YIELDS, int8: bool = False) -> None:
        self.size, self.spins, self.yields, self.int8 = size, spins, yields, int8
        self._serve_fn, self._run_fn = (serve_i8, run_i8) if int8 else (serve, run)
        self.ctrl = control_block()
        self._busy = threading.Lock()  # one caller at a time publishes
        self._cond = threading.Condition()
        self._sleepers = 0
        self._wakes = 0  # wake-ups called so far (under _cond)
        self._next = 0  # group numbers, the caller's (under _busy)
        self.groups = self.declined = 0  # groups run; groups declined (another caller held the workers)
        self.workers = [threading.Thread(target=self._serve, name=f"compute-spin-{i + 1}", daemon=True)
                        for i in range(size)]
        for t in self.workers:
            t.start()

    def _serve(self) -> None:
        ctrl, seen = self.ctrl, 0
        while True:
            seen = self._serve_fn(ctrl, seen, self.spins, self.yields)
            if seen < 0:
                return
            with self._cond:  # idle: sleep until a caller wakes the sleepers (a group missed meanwhile costs nothing)
                self._sleepers += 1
                wakes = self._wakes
                while self._wakes == wakes and int(ctrl[STOP]) == 0:
                    self._cond.wait()
                self._sleepers -= 1

    def run(self, table: np.ndarray, counter: np.ndarray, tiles: int) -> int | None:
        """Compute group ``table`` (int64 [n, NCOLS], C-order) with ``counter`` (int64 [2], zero)
        over ``tiles`` tiles on the calling thread and the waiting workers. Returns the tiles the
        caller computed itself, or None, doing nothing, when another caller holds the workers
        (the caller then uses the Python pool)."""
        return self._publish(self._run_fn, table, counter, tiles)

    def run_rows(self, table: np.ndarray, counter: np.ndarray, items: int) -> int | None:
        """:meth:`run` for row work (``rowkernels.row_work``): ``table`` int64
        [``rowkernels.ROW_WORK_FIELDS``], ``items`` its item count. Returns the items the caller
        computed itself, or None, doing nothing, when another caller holds the workers."""
        return self._publish(run_rows, table, counter, items)

    def _publish(self, fn, table: np.ndarray, counter: np.ndarray, tiles: int) -> int | None:
        if not self._busy.acquire(blocking=False):
            self.declined += 1  # racy count: statistics only
            return None
        try:
            self._next += 1
            self.groups += 1
            if self._sleepers:  # they join this group if they wake in time, else the next
                with self._cond:
                    self._wakes += 1
                    self._cond.notify_all()
            return int(fn(self.ctrl, self._next, table, counter, tiles))
        finally:
            self._busy.release()

    def close(self) -> None:
        """Stop the workers (each returns from its wait; a sleeping one is woken)."""
        self.ctrl[STOP] = 1
        with self._cond:
            self._cond.notify_all()


_pool: SpinPool | None = None
_pool_lock = threading.Lock()


def pool(workers: int, int8: bool = False) -> SpinPool:
    """The process's spinning workers, ``workers`` of them, running groups of the int8 numerics
    (``int8``) or float32's (made, or remade for a new count or numerics)."""
    global _pool
    p = _pool
    if p is None or p.size != workers or p.int8 != int8:
        with _pool_lock:
            if _pool is None or _pool.size != workers or _pool.int8 != int8:
                if _pool is not None:
                    _pool.close()
                _pool = SpinPool(workers, int8=int8)
            p = _pool
    return p


def _forget_after_fork() -> None:  # a child has none of the parent's threads
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
