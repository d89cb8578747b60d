"""Prefix reuse through the API: the official ``openai`` client's second chat turn continues from
the first turn's KV cache, prefills only its new tokens (``usage.prompt_tokens_details.
cached_tokens`` and ``/metrics``' prefilled count) and gets the reply of a server without reuse.

Oracles: the first turn's usage (the second turn's cached tokens are its prompt and every
generated token but the last, which was never fed), the same conversation on a server with
prefix reuse off.
"""

from __future__ import annotations

import aiohttp

from swarm.keys.swarmkey import SwarmKey
from tests.peer.coordinator._api import openai_client, serving
from tests.peer.coordinator.test_api_metrics import parse

KEY = SwarmKey(bytes(range(5, 37)))
TURNS = ["What is the capital of France?", "And the capital of Italy?"]


async def prefilled(url: str) -> float:
    """``prompt_tokens_prefilled_total`` from the server's ``/metrics``."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY.api_token}"}) as s:
        async with s.get(url.removesuffix("/v1") + "/metrics") as r:
            assert r.status == 200
            return parse(await r.text())["colibri_swarm_prompt_tokens_prefilled_total"]


async def two_turns(engine, reuse: bool) -> tuple[list, list[str], list[float]]:
    """Both turns' usage and text and the prefilled count after each, on a fresh server."""
    usages, texts, counts = [], [], []
    async with serving(*engine, KEY, prefix_reuse=reuse) as url:
        client = openai_client(url, KEY)
        history: list[dict] = []
        for turn in TURNS:
            history.append({"role": "user", "content": turn})
            r = await client.chat.completions.create(model="m", messages=history, max_tokens=12, temperature=0)
            history.append({"role": "assistant", "content": r.choices[0].message.content})
            usages.append(r.usage)
            texts.append(r.choices[0].message.content)
            counts.append(await prefilled(url))
        await client.close()
    return usages, texts, counts


async def test_a_chats_second_turn_prefills_only_its_new_tokens(engine):
    (u1, u2), texts, (after1, after2) = await two_turns(engine, reuse=True)
    assert u1.prompt_tokens_details.cached_tokens == 0 and after1 == u1.prompt_tokens
    cached = u2.prompt_tokens_details.cached_tokens
    assert cached == u1.prompt_tokens + u1.completion_tokens - 1
    assert after2 - after1 == u2.prompt_tokens - cached
    assert u2.prompt_tokens - cached < u2.prompt_tokens // 2  # the point: most of the prompt is not prefilled
    (v1, v2), plain, (_, plain2) = await two_turns(engine, reuse=False)
    assert texts == plain and (v1.prompt_tokens, v2.prompt_tokens) == (u1.prompt_tokens, u2.prompt_tokens)
    assert v2.prompt_tokens_details.cached_tokens == 0 and plain2 == v1.prompt_tokens + v2.prompt_tokens
