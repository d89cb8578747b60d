"""Continuous batching through a real 2-peer swarm (``join`` in two network namespaces, mDNS,
WebRTC): 4 streaming requests at once through the official ``openai`` client, each reply equal
token for token to the same request run alone on one machine."""

from __future__ import annotations

import os

import pytest

from swarm.keys.swarmkey import SwarmKey
from tests.multihost.test_mesh_multihost import read_status, until
from tests.multihost.test_swarm_multihost import coordinator_of, reference
from tests.peer._swarm_models import add_char_tokenizer, build

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

# One chunk and several (64 prompt tokens a chunk; one character a token here).
PROMPTS = ["hello swarm", "tell me more about the " * 5, "abc", "what is 2+2? " * 7]
TOKENS = 100  # the tiny model has 256 positions

# Runs inside a namespace: the streaming requests at once (one process, so they start together)
# through the official client.
CLIENTS = """
import asyncio, json, sys, openai
url, token, n, *prompts = sys.argv[1:]

async def one(client, model, prompt):
    text = ""
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  stream=True, max_tokens=int(n), temperature=0)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text

async def main():
    client = openai.AsyncOpenAI(base_url=url, api_key=token, max_retries=0, timeout=180)
    model = (await client.models.list()).data[0].id
    got = await asyncio.gather(*[one(client, model, p) for p in prompts], return_exceptions=True)
    print(json.dumps({"event": "done", "texts": [g if isinstance(g, str) else repr(g)[:300] for g in got]}), flush=True)

asyncio.run(main())
"""


async def test_four_concurrent_requests_through_the_swarm_equal_their_solo_runs(netns_lab):
    lab = netns_lab(2)
    model_dir = add_char_tokenizer(build("olmoe", lab.workdir))
    key = SwarmKey(os.urandom(32))
    expected = [reference(model_dir, p, TOKENS) for p in PROMPTS]
    procs = []
    for i in range(2):  # one after the other: each measures its FFN speed at start
        procs.append(lab.spawn(i, ["-m", "swarm", "-v", "join", "--model", str(model_dir), "--key", key.code,
                                   "--name", f"host{i}", "--max-batch", "4", "--layout", "ranges",
                                   "--context", str(4 * 256)],  # KV cache for four sequences of the model's 256 positions
                               env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}))
        await until(lambda: read_status(lab, i) is not None, 60, f"host{i} started", procs)
    docs = lambda: {i: read_status(lab, i) for i in range(2)}  # noqa: E731
    await until(lambda: coordinator_of(docs()) is not None, 90, "a coordinator planning over the worker", procs)
    c, doc = coordinator_of(docs())
    port = doc["placement"]["api_port"]
    from swarm.peer.coordinator.api_tls import write_ca

    ca = write_ca(key, lab.workdir)
    clients = lab.spawn(1 - c, ["-c", CLIENTS, f"https://{lab.addresses[c]}:{port}/v1", key.api_token, str(TOKENS),
                                *PROMPTS], env={"SSL_CERT_FILE": str(ca)})
    answers = await clients.wait_for(lambda e: e.get("event") == "done", 240)
    assert answers["texts"] == expected
    log = procs[c].log_path.read_text(errors="replace")
    assert "marked down" not in log, log[-2000:]  # the worker answered throughout
    assert "4 sequences share a step" in log, log[-2000:]  # they ran together
