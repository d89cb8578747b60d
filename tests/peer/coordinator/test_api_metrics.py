"""``GET /metrics`` (Prometheus' text format, behind the bearer token) and the access log.

Oracles: the requests the test sent (routes, statuses), the usage each reply reported and the
local tokenizer's prompt lengths, the scheduler's own step count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp
import pytest

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend

KEY = SwarmKey(bytes(range(3, 35)))
HEADERS = {"Authorization": f"Bearer {KEY.api_token}"}
PROMPT = "What is two plus two?"
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                    r'(-?[0-9.]+(?:e[+-]?[0-9]+)?|\+Inf|-Inf|NaN)$')


@pytest.fixture
async def served(engine):
    model, tok = engine
    backend = EngineBackend(model, tok, model_id="m", max_batch=1, max_queue=4)
    api = ApiServer.for_swarm_key(backend, KEY)
    port = await api.start("127.0.0.1", 0)
    yield api, backend, f"http://127.0.0.1:{port}"
    await api.close()


def parse(text: str) -> dict[str, float]:
    """Samples by ``name{labels}``; asserts the exposition format: every line a comment or a
    sample, each family's TYPE before its samples, histogram buckets cumulative up to +Inf = count."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = SAMPLE.match(line)
        assert m, line
        name = m.group(1)
        family = re.sub(r"_(bucket|sum|count|total)$", "", name)
        assert name in types or family in types or f"{family}_total" in types, f"no TYPE before {line}"
        samples[name + (m.group(2) or "")] = float(m.group(3))
    for name, kind in types.items():
        if kind != "histogram":
            continue
        series: dict[str, list[float]] = {}  # per set of labels besides le
        for k, v in samples.items():
            if k.startswith(name + "_bucket"):
                labels = re.sub(r'(,?)le="[^"]*"(,?)', lambda m: "," if m[1] and m[2] else "", k[len(name + "_bucket"):])
                series.setdefault(labels, []).append(v)
        for labels, buckets in series.items():
            assert buckets == sorted(buckets) and buckets[-1] == samples[f"{name}_count{labels if labels != '{}' else ''}"]
    return samples


async def test_metrics_count_requests_tokens_and_first_tokens(served, engine):
    api, backend, url = served
    model, tok = engine
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0}
    usages = []
    async with aiohttp.ClientSession(headers=HEADERS) as s:
        async with s.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401  # the token is required, as for /v1
        for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}):
            async with s.post(f"{url}/v1/chat/completions", json={**body, **extra}) as r:
                assert r.status == 200
                if extra:
                    events = [line async for line in r.content if line.startswith(b"data: {")]
                    usages.append(json.loads(events[-1][6:])["usage"])
                else:
                    usages.append((await r.json())["usage"])
        async with s.post(f"{url}/v1/completions", json={"prompt": "x", "tools": [], "max_tokens": 2}) as r:
            assert r.status == 200  # an empty tools list asks for nothing
            usages.append((await r.json())["usage"])
        async with s.post(f"{url}/v1/chat/completions", json={**body, "echo": True}) as r:
            assert r.status == 400
        async with s.get(f"{url}/nothing-here") as r:
            assert r.status == 404
        async with s.get(f"{url}/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            m = parse(await r.text())
    n_prompt = len(tok.encode_chat(body["messages"]))
    assert [u["prompt_tokens"] for u in usages] == [n_prompt, n_prompt, len(tok.encode("x"))]
    p = "colibri_swarm_"
    assert m[p + 'api_requests_total{method="POST",route="/v1/chat/completions",status="200"}'] == 2
    assert m[p + 'api_requests_total{method="POST",route="/v1/chat/completions",status="400"}'] == 1
    assert m[p + 'api_requests_total{method="GET",route="/metrics",status="401"}'] == 1
    assert m[p + 'api_requests_total{method="GET",route="other",status="404"}'] == 1
    assert m[p + 'api_requests_total{method="POST",route="/v1/completions",status="200"}'] == 1
    assert m[p + "prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert m[p + "completion_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert m[p + "time_to_first_token_seconds_count"] == 3
    assert m[p + "api_request_duration_seconds_count"] == 6  # this /metrics request is counted after it answers
    assert m[p + "sequences_running"] == 0 and m[p + "sequences_waiting"] == 0
    assert m[p + "step_duration_seconds_count"] == backend.scheduler.steps > 0
    assert m[p + "step_duration_seconds_sum"] > 0


async def test_metrics_show_running_and_waiting_sequences(served, engine):
    """With one batch slot, a long stream runs and a second request waits: the gauges say so."""
    api, backend, url = served
    _, tok = engine
    # no end token (a short answer would end the first stream before the second arrives)
    long = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 300, "temperature": 0, "stream": True,
            "logit_bias": {str(i): -100 for i in tok.eos_token_ids}}
    async with aiohttp.ClientSession(headers=HEADERS) as s:
        first = await s.post(f"{url}/v1/chat/completions", json=long)
        await first.content.readline()  # admitted: the role chunk
        second = asyncio.create_task(s.post(f"{url}/v1/chat/completions", json=long))
        seen = []
        for _ in range(500):
            async with s.get(f"{url}/metrics") as r:
                m = parse(await r.text())
            seen.append((m["colibri_swarm_sequences_running"], m["colibri_swarm_sequences_waiting"]))
            if seen[-1] == (1, 1):
                break
            await asyncio.sleep(0.01)
        assert seen[-1] == (1, 1), seen
        first.close()
        (await second).close()


async def test_one_access_log_line_per_request_without_prompt_text(served, caplog):
    api, backend, url = served
    secret = "the secret prompt text"
    with caplog.at_level(logging.INFO, logger="swarm.api.access"):
        async with aiohttp.ClientSession(headers=HEADERS) as s:
            async with s.post(f"{url}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": secret}], "max_tokens": 3,
                                    "temperature": 0}) as r:
                usage = (await r.json())["usage"]
            async with s.get(f"{url}/v1/models") as r:
                assert r.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "swarm.api.access"]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in caplog.records if r.name == "swarm.api.access")
    assert re.fullmatch(r"127\.0\.0\.1 POST /v1/chat/completions 200 [0-9.]+ s prompt_tokens=(\d+) "
                        r"completion_tokens=(\d+)", lines[0])
    assert lines[0].endswith(f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}")
    assert re.fullmatch(r"127\.0\.0\.1 GET /v1/models 200 [0-9.]+ s", lines[1])
    assert not any(secret in r.getMessage() for r in caplog.records)
