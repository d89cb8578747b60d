"""Prefix reuse in a chat: the time to first token of each turn of a 10-turn conversation, with
and without prefix reuse, on one machine. Prints one JSON object and writes it to ``--out``.

The conversation goes through the product's path — the OpenAI API (``ApiServer`` over
``EngineBackend``: chat template, batch scheduler) on loopback, the official ``openai`` client
streaming ``/v1/chat/completions`` greedily (``--tokens`` tokens a turn) — and resends the whole
history each turn, as ``colibri-swarm chat`` does. Per turn: the prompt's tokens, those taken
from a kept KV cache (``usage.prompt_tokens_details.cached_tokens``) and the time from the
request to its first text. The two servers alternate turn by turn (``--rounds`` conversations
each), so other work on a shared machine falls on both; the medians over the rounds are reported.

    python3 bench/chat_turns.py [--model smollm2|PATH] [--turns 10] [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, not bench/swarm.py

QUESTIONS = ["Hi! Can you tell me about the Moon?", "How far away is it?", "Why does it have phases?",
             "What causes the tides?", "Who first walked on it?", "What did they bring back?",
             "Could people live there?", "What is the far side like?", "How old is it?",
             "Thanks. Summarize what we talked about."]


async def turn(client, history: list[dict], tokens: int) -> tuple[float, str, int, int]:
    """One streamed turn: (seconds to its first text, its text, prompt tokens, cached tokens)."""
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    stream = await client.chat.completions.create(model="m", messages=history, max_tokens=tokens, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
    assert usage is not None and first is not None
    return first, "".join(text), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


async def main(args) -> dict:
    import openai

    from swarm.compute.default_model import default_model_path
    from swarm.compute.model import load_model
    from swarm.compute.tokenizer import load_tokenizer
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.coordinator.api import ApiServer
    from swarm.peer.coordinator.api_engine import EngineBackend

    path = default_model_path() if args.model == "smollm2" else Path(args.model)
    model, tok = load_model(path), load_tokenizer(path)
    model.materialize()
    key = SwarmKey(os.urandom(32))
    servers, clients = {}, {}
    for reuse in (True, False):
        api = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m", context=args.context,
                                                    prefix_reuse=reuse), key)
        port = await api.start("127.0.0.1", 0)
        servers[reuse] = api
        clients[reuse] = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key.api_token,
                                            max_retries=0, timeout=600)
    await turn(clients[False], [{"role": "user", "content": "warm up"}], 4)  # kernels compiled, pages in
    runs: dict[bool, list[list[dict]]] = {True: [], False: []}
    try:
        for _ in range(args.rounds):
            histories: dict[bool, list[dict]] = {True: [], False: []}
            turns: dict[bool, list[dict]] = {True: [], False: []}
            for q in QUESTIONS[:args.turns]:
                for reuse in (True, False):
                    h = histories[reuse]
                    h.append({"role": "user", "content": q})
                    ttft, text, prompt, cached = await turn(clients[reuse], h, args.tokens)
                    h.append({"role": "assistant", "content": text})
                    turns[reuse].append({"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
                                         "text": text})
            for reuse in (True, False):
                runs[reuse].append(turns[reuse])
    finally:
        for reuse in (True, False):
            await clients[reuse].close()
            await servers[reuse].close()

    def summary(reuse: bool) -> list[dict]:
        out = []
        for i in range(args.turns):
            at = [r[i] for r in runs[reuse]]
            out.append({"turn": i + 1, "prompt_tokens": at[0]["prompt_tokens"], "cached_tokens": at[0]["cached_tokens"],
                        "ttft_ms_median": round(1000 * statistics.median(a["ttft_s"] for a in at), 1),
                        "ttft_ms": [round(1000 * a["ttft_s"], 1) for a in at]})
        return out

    with_reuse, without = summary(True), summary(False)
    same = all(a["text"] == b["text"] for r1, r2 in zip(runs[True], runs[False]) for a, b in zip(r1, r2))
    return {"bench": "chat_turns", "model": path.name, "turns": args.turns, "tokens_per_turn": args.tokens,
            "rounds": args.rounds, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "same_text_with_and_without_reuse": same,
            "ttft_ms_median_sum": {"reuse": round(sum(t["ttft_ms_median"] for t in with_reuse), 1),
                                   "no_reuse": round(sum(t["ttft_ms_median"] for t in without), 1)},
            "last_turn": {"reuse_ms": with_reuse[-1]["ttft_ms_median"], "no_reuse_ms": without[-1]["ttft_ms_median"],
                          "prompt_tokens": without[-1]["prompt_tokens"],
                          "prefilled_with_reuse": with_reuse[-1]["prompt_tokens"] - with_reuse[-1]["cached_tokens"]},
            "reuse": with_reuse, "no_reuse": without}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the default model) or a model path")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=4096, help="the server's KV positions (join --context)")
    ap.add_argument("--out", default="bench/results/chat_turns_smollm2_2core.json")
    args = ap.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        ap.error(f"--turns must be 1..{len(QUESTIONS)}")
    result = asyncio.run(main(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
