"""Continuous batching through a real 2-peer swarm (``join`` in two network namespaces, mDNS,
WebRTC): 4 streaming requests at once through the official ``openai`` client, each reply equal
token for token to the same request run alone on one machine."""

from __future__ import annotations

import asyncio
import os

import pytest

from swarm.keys.swarmkey import SwarmKey
from tests.multihost.test_mesh_multihost import read_status, until
from tests.multihost.test_swarm_multihost import coordinator_of, reference, spawn_client
from tests.peer._swarm_models import add_char_tokenizer, build

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

# One chunk and several (64 prompt tokens a chunk; one character a token here).
PROMPTS = ["hello swarm", "tell me more about the " * 5, "abc", "what is 2+2? " * 7]
TOKENS = 100  # long enough for the four to overlap (the tiny model has 256 positions)


async def test_four_concurrent_requests_through_the_swarm_equal_their_solo_runs(netns_lab):
    lab = netns_lab(2)
    model_dir = add_char_tokenizer(build("olmoe", lab.workdir))
    key = SwarmKey(os.urandom(32))
    expected = [reference(model_dir, p, TOKENS) for p in PROMPTS]
    procs = []
    for i in range(2):  # one after the other: each measures its FFN speed at start
        procs.append(lab.spawn(i, ["-m", "swarm", "-v", "join", "--model", str(model_dir), "--key", key.code,
                                   "--name", f"host{i}", "--max-batch", "4"],
                               env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}))
        await until(lambda: read_status(lab, i) is not None, 60, f"host{i} started", procs)
    docs = lambda: {i: read_status(lab, i) for i in range(2)}  # noqa: E731
    await until(lambda: coordinator_of(docs()) is not None, 90, "a coordinator planning over the worker", procs)
    c, doc = coordinator_of(docs())
    port = doc["placement"]["api_port"]
    clients = [spawn_client(lab, 1 - c, c, port, key.api_token, p, TOKENS) for p in PROMPTS]
    answers = await asyncio.gather(*[cl.wait_for(lambda e: e.get("event") in ("done", "error"), 180)
                                     for cl in clients])
    assert [a["event"] for a in answers] == ["done"] * 4, answers
    assert [a["text"] for a in answers] == expected
    log = procs[c].log_path.read_text(errors="replace")
    assert "marked down" not in log, log[-2000:]  # the worker answered throughout
    assert "4 sequences share a step" in log, log[-2000:]  # they ran together
