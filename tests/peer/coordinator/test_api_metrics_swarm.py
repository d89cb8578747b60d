"""``GET /metrics`` at swarm level: the API over a coordinator whose FFN ranges are computed by two
in-process workers; the plan's version, each worker's answer-time histogram (labelled by peer),
how often each was marked down, and the time per output token.

Oracles: the requests the coordinator sent each worker (a spy on its dispatcher), the plan it
runs, a worker killed mid-run (marked down once), the usage the reply reported.
"""

from __future__ import annotations

import aiohttp
import pytest

from swarm.compute.tokenizer import load_tokenizer
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend
from swarm.peer.net import messages as M
from tests.peer._swarm_models import W1, W2, add_char_tokenizer, build
from tests.peer.coordinator.test_api_metrics import parse
from tests.peer.coordinator.test_coordinator import InProcSwarm

KEY = SwarmKey(bytes(range(7, 39)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return add_char_tokenizer(build("qwen3_moe", tmp_path_factory.mktemp("moe")))


async def test_metrics_show_the_plan_each_peers_answer_times_and_marked_down_counts(checkpoint):
    swarm = InProcSwarm(checkpoint, 2)
    sent = {W1: 0, W2: 0}
    send = swarm.ffn.dispatcher.send

    def spy(peer, msg):
        if isinstance(msg, (M.ExpertRequest, M.DenseRequest)):
            sent[peer] += 1
            if peer == W2 and sent[W2] == 5:
                swarm.net.kill(W2)  # its link goes mid-run: it is marked down, its rows recomputed here
        send(peer, msg)

    swarm.ffn.dispatcher.send = spy
    backend = EngineBackend(swarm.model, load_tokenizer(checkpoint), model_id="m", ffn=swarm.ffn)
    api = ApiServer.for_swarm_key(backend, KEY)
    port = await api.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY.api_token}"}) as s:
            body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "temperature": 0}
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                got = parse(await r.text())
    finally:
        await api.close()
        swarm.close()
    p = "colibri_swarm_"
    assert got[f"{p}plan_version"] == swarm.ffn.plan.version == 1
    assert got[f'{p}peer_answer_seconds_count{{peer="{W1}"}}'] == sent[W1] > 0  # every request answered
    assert got[f'{p}peer_answer_seconds_count{{peer="{W2}"}}'] == 4  # those before its link went
    assert got[f'{p}peer_answer_seconds_bucket{{le="+Inf",peer="{W1}"}}'] == sent[W1]
    assert got[f'{p}peer_answer_seconds_sum{{peer="{W1}"}}'] > 0
    assert got[f'{p}peer_marked_down_total{{peer="{W2}"}}'] == 1 and swarm.failed[0][0] == W2
    assert got[f'{p}peer_marked_down_total{{peer="{W1}"}}'] == 0
    assert usage["completion_tokens"] == 6 and got[f"{p}time_per_output_token_seconds_count"] == 1
    assert got[f"{p}time_per_output_token_seconds_sum"] > 0
