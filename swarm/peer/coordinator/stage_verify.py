"""``join --verify PERCENT`` for layer stages: the coordinator re-runs a sampled share of the rows
of each stage answer through that stage's layers on its own copy of the model and compares them
with the peer's rows (the FFN ranges' check is :meth:`~swarm.peer.coordinator.dispatch.RemoteFFN._verify`).

Theory of operation
-------------------
Re-running layer l for the row at position t needs layer l's keys and values of positions
``0 .. t-1``; for every layer of a stage but its first they depend on hidden states only the
peer saw. The coordinator records the rows that entered each stage for every sequence
(:mod:`~swarm.peer.coordinator.stages`, "Failover"), so it can rebuild them — and keeps what it
rebuilt: a :class:`Shadow` KV cache per (sequence, stage) holding that stage's layers only,
filled lazily. Each row of an answer is sampled with probability ``share``; the shadow of each
sequence with a sampled row is brought up to its last sampled row (positions ``held .. last``
through the stage's layers, every such sequence of the answer in one ``Model.layers_batch``
call), and every row of the answer it computed is compared with the peer's.

Why this design:

* recomputing a sampled row from position 0 each time costs its whole prefix per sample
  (quadratic over a generation); the shadow computes each position of a sequence at most once
  per stage, so checking never costs more arithmetic than running that stage here once;
* a shadow fed at every step is that full cost whatever the share;
* sampling whole requests would recompute whole prefills and batches in one stall.

So a step with no row sampled costs nothing, and a sampled one one pass over the stage's weights
for the rows its sampled sequences have to catch up: about ``share`` of the stage's weight reads,
but, once rows late in a sequence are sampled, the arithmetic of every position of it — the
price of checking a position-dependent computation without trusting any of its intermediate
states. Measured (SmolLM2-135M, a 15-layer stage, CPU): checking cost 0.54 of the stage peer's
compute at 10 %, 0.64 at 25 %, 1.04 at 100 % over 128 decode steps (docs/security.md, 5a);
:class:`~swarm.peer.coordinator.tracker.VerifyCost` counts rows checked, rows run and seconds.
Memory: a shadow holds the stage's layers' keys/values for its sequence — what the peer holds
for it — and goes with the sequence.

Exactness. The shadow runs the model's own FFN (``LocalFFN``), as a
:class:`~swarm.peer.worker.stages.StageRunner` does, and a row's result depends only on the row,
its position and the cache before it, never on how the positions were cut into steps
(:func:`swarm.compute.kernels.attention`; :mod:`swarm.compute.ffn`, "Segments"): the catch-up
gives each row the bits the peer's own steps gave it. A peer of our numeric build must match
bit for bit; one of another build within :func:`~swarm.peer.coordinator.bounds.stage_rtol` × the
row's largest magnitude (+ ``bounds.ATOL``): float32 reassociation over each layer's reductions
(hidden size, FFN width, positions attended), compounding over the stage's layers.

A mismatch gives a :class:`~swarm.errors.VerificationError` naming the peer, the layers, the
sequence and the position (returned, with what the check cost, not raised);
:class:`~swarm.peer.coordinator.stages.StagedFFN` then discards the answer, runs the stage here
and stops trusting the peer.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from swarm.errors import LocalProtocolError, VerificationError
from swarm.peer.coordinator.bounds import rows_outside, stage_rtol

if TYPE_CHECKING:
    from swarm.compute.model import KVCache, Model

VERIFY_FAILED = "verification failed"  # how a stage peer's mark-down reason begins after a mismatch
SHADOW_CAPACITY = 16  # positions a new shadow cache starts with (it doubles as it fills)


@dataclass
class Shadow:
    """The coordinator's keys/values of one stage's layers for one sequence, positions
    ``0 .. held-1`` (rebuilt from the rows that entered the stage)."""

    cache: KVCache
    held: int = 0


@dataclass(frozen=True)
class Answered:
    """One sequence's rows of a stage answer: the peer's ``answer`` [T, H] f32 for positions
    ``start ..``; ``history`` [start+T, H]: every row that entered the stage, those included."""

    sequence: int
    shadow: Shadow
    history: np.ndarray
    start: int
    answer: np.ndarray


@dataclass(frozen=True)
class Checked:
    """What one check did: rows compared with the peer's, positions run here (the catch-up
    included), seconds."""

    rows_checked: int
    rows_computed: int
    seconds: float


class StageVerifier:
    """Checks a sampled share (0..1) of stage answer rows against ``model``; see the module
    docstring. Called from the token-loop thread (or a pipeline lane) only."""

    def __init__(self, model: Model, share: float, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 <= share <= 1.0:
            raise LocalProtocolError(f"verify share {share} must be within 0..1")
        self.model = model
        self.share = share
        self.approximate: set[str] = set()  # peers of another numeric build: a bound, not bits
        self._rng = rng or random.Random()
        self._clock = clock

    def shadow(self) -> Shadow:
        """A new, empty shadow (its arrays are allocated for the stage's layers as they run)."""
        return Shadow(self.model.new_cache(capacity=SHADOW_CAPACITY))

    def sampled(self, rows: int) -> int:
        """How many leading rows of an answer of ``rows`` rows to check: one past the last row
        sampled (each with probability ``share``), 0 for none."""
        if self.share >= 1.0:
            return rows
        for i in range(rows - 1, -1, -1):
            if self._rng.random() < self.share:
                return i + 1
        return 0

    def check(self, peer: str, lo: int, hi: int, parts: Sequence[Answered]) -> tuple[Checked, VerificationError | None]:
        """Check ``peer``'s answer for layers ``lo .. hi-1`` (``parts``: each sequence's rows of
        it): sample rows, catch the shadows up, compare. Returns what it cost and, on a mismatch,
        the VerificationError naming it (the shadows stay consistent either way: they hold what
        the recorded rows give)."""
        todo = [(a, n) for a in parts if (n := self.sampled(a.answer.shape[0]))]
        if not todo:
            return Checked(0, 0, 0.0), None
        t0 = self._clock()
        runs: list[tuple[KVCache, int, int]] = []
        for a, n in todo:
            sh = a.shadow
            start = min(sh.held, a.start)  # positions from start on are being re-run
            if not sh.cache.resumes(start, lo, hi):  # a recurrent state cannot go back there: replay from 0
                start = 0
            sh.held = sh.cache.length = start
            runs.append((sh.cache, sh.held, a.start + n - sh.held))
        rows = np.concatenate([a.history[a.shadow.held:a.start + n] for a, n in todo])
        out = self.model.layers_batch(rows, runs, lo, hi)  # [sum of catch-up rows, H]
        outs = np.split(out, np.cumsum([T for _, _, T in runs])[:-1])
        firsts = [a.start - a.shadow.held for a, _ in todo]  # where each answer's rows begin in its run
        for a, n in todo:
            a.shadow.held = a.shadow.cache.length = a.start + n
        checked = Checked(sum(n for _, n in todo), out.shape[0], self._clock() - t0)
        for (a, n), y, first in zip(todo, outs, firsts):
            wrong = self._compare(peer, lo, hi, a, a.answer[:n], y[first:])
            if wrong is not None:
                return checked, wrong
        return checked, None

    def _compare(self, peer: str, lo: int, hi: int, a: Answered, remote: np.ndarray,
                 local: np.ndarray) -> VerificationError | None:
        """None if ``remote`` [n, H] equals ``local`` (bit for bit; within the bound for a peer of
        another build), else the VerificationError naming the first row that differs."""
        if peer in self.approximate:
            cfg = self.model.config
            width = max(cfg.intermediate_size or 0, cfg.top_k * cfg.moe_intermediate_size)  # one row's FFN
            bad = rows_outside(remote, local, stage_rtol(hi - lo, cfg.hidden_size, width, a.start + len(remote)))
        else:
            bad = (remote != local).any(axis=1)
        if not bad.any():
            return None
        r = int(np.argmax(bad))
        diff = float(np.max(np.abs(remote[r] - local[r])))
        return VerificationError(
            f"peer {peer} answered layers {lo}:{hi} (layer {lo} to {hi - 1}) of sequence {a.sequence} at "
            f"position {a.start + r} with numbers that differ from the coordinator's recomputation "
            f"(max |diff| {diff:.3g}); its answers are no longer trusted and its layers run on the coordinator")
