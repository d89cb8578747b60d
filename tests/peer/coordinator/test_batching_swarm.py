"""Continuous batching through the swarm's FFN seam: sequences batched together, their rows sent
to the workers as one request per peer per layer with their segments, get the tokens each gets
alone on one machine (same plan), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute.ffn import LocalFFN
from swarm.compute.model import load_model
from swarm.compute.sampling import SamplingParams
from swarm.compute.serving import BatchScheduler
from swarm.peer.net import messages as M
from tests.compute.tiny_models import build_tiny
from tests.peer.coordinator.test_coordinator import InProcSwarm


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def checkpoint(request, tmp_path_factory):
    """Qwen3-MoE (experts and a dense layer split into ranges), Qwen2-MoE (a gated shared expert).
    F32 weights: every product is one call per sequence (the packing of decode rows under the
    block kernels is checked on one machine, tests/compute/test_batching.py)."""
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))[1]


def test_a_batch_through_the_swarm_equals_each_sequence_alone(checkpoint):
    swarm = InProcSwarm(checkpoint, 2)
    sent: list[M.ExpertRequest | M.DenseRequest] = []
    send = swarm.ffn.dispatcher.send
    swarm.ffn.dispatcher.send = lambda peer, msg: (sent.append(msg), send(peer, msg))[1]
    try:
        rng = np.random.default_rng(3)
        vocab = swarm.model.config.vocab_size
        prompts = [rng.integers(0, vocab, n).tolist() for n in (19, 4, 11, 1)]
        params = [SamplingParams(max_tokens=n) for n in (6, 8, 5, 7)]
        batched = BatchScheduler(swarm.model, lambda: swarm.ffn, max_batch=4, max_queue=0, chunk=8, prefill_rows=16)
        got = [list(t) for t in [batched.submit(p, q) for p, q in zip(prompts, params)]]
        local = load_model(checkpoint)
        alone = BatchScheduler(local, lambda: LocalFFN(local, swarm.plan.dense_ranges()), chunk=8, prefill_rows=16)
        want = [list(alone.submit(p, q)) for p, q in zip(prompts, params)]
        assert got == want
        assert not swarm.failed and swarm.ffn.local_fallbacks == 0 and swarm.ffn.remote_rows > 0
        # One request per peer per layer carried several sequences: their runs are on the wire.
        assert max(r.segments.size for r in sent if isinstance(r, M.ExpertRequest)) > 1
    finally:
        swarm.close()
