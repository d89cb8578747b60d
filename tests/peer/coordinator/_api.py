"""What the API tests share: a live server over the engine on loopback, and the official client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import openai

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend


@contextlib.asynccontextmanager
async def serving(model: Any, tokenizer: Any, key: SwarmKey, model_id: str = "m", **backend: Any
                  ) -> AsyncIterator[str]:
    """The API over ``model`` on a free loopback port (plain HTTP); yields its base URL ``…/v1``.
    ``backend``: more :class:`EngineBackend` arguments (e.g. ``prefix_reuse=False``)."""
    api = ApiServer.for_swarm_key(EngineBackend(model, tokenizer, model_id=model_id, **backend), key)
    port = await api.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await api.close()


def openai_client(url: str, key: SwarmKey) -> openai.AsyncOpenAI:
    """The official client at ``url`` with the swarm's API token, no retries of its own."""
    return openai.AsyncOpenAI(base_url=url, api_key=key.api_token, max_retries=0, timeout=120)
