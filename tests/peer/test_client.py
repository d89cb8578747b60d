"""``colibri-swarm chat`` and ``generate --swarm`` against a live coordinator API.

The API runs the engine on SmolLM2 in a background event loop; the oracle is the engine's
local greedy run. The API is found by real mDNS (zeroconf) in one test.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import threading

import pytest

from swarm.errors import SwarmError
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend
from swarm.cli.chat import main_chat
from swarm.peer.client import Endpoint, find_endpoint, stream_chat
from swarm.keys.swarmkey import SwarmKey

KEY = SwarmKey(bytes(range(1, 33)))
MODEL_ID = "smollm2"
MAX_TOKENS = 5
PROMPTS = ["What is the capital of France?", "Name a color."]


_ORACLE: dict[str, str] = {}


def _greedy(engine, messages) -> str:
    """The engine's local greedy reply (the oracle), computed once per conversation."""
    import json

    from swarm.compute.sampling import SamplingParams
    from swarm.compute.textgen import generate_text

    key = json.dumps(messages)
    if key not in _ORACLE:
        model, tok = engine
        _ORACLE[key] = "".join(generate_text(model, tok, messages, SamplingParams(max_tokens=MAX_TOKENS)))
    return _ORACLE[key]


class Recording(EngineBackend):
    """The engine backend, remembering the messages of every request (to check chat history)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[list[dict]] = []
        self.stats: list = []  # each request's GenerationStats

    def generate(self, request, stats):
        self.seen.append([dict(m) for m in request.messages])
        self.stats.append(stats)
        return super().generate(request, stats)


@pytest.fixture(scope="module")
def live_api(engine):
    """(base URL, backend, loop) of an API served from a background thread's event loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="api-loop", daemon=True)
    thread.start()
    backend = Recording(*engine, model_id=MODEL_ID)
    server = ApiServer.for_swarm_key(backend, KEY)
    # Announced on mDNS as the coordinator of term 7, as `join` does.
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0, advertise=("c" * 26, 7)), loop).result(30)
    yield f"http://127.0.0.1:{port}/v1", backend, loop, port
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def stored_key(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("COLIBRI_SWARM_API_KEY", raising=False)
    from swarm.keys import swarmkey

    return swarmkey.store(KEY.code)


def _args(**kw) -> argparse.Namespace:
    base = dict(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, top_k=0, seed=None, system=None, api=None)
    return argparse.Namespace(**{**base, **kw})


def test_stream_chat_equals_local_greedy(live_api, engine, stored_key):
    url, *_ = live_api
    endpoint = find_endpoint(url)
    assert endpoint == Endpoint(url, KEY.api_token)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    pieces = list(stream_chat(endpoint, {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}))
    assert "".join(pieces) == _greedy(engine, messages)


def test_chat_repl_keeps_history_and_reset_clears_it(live_api, engine, stored_key, capsys):
    url, backend, *_ = live_api
    script = iter([PROMPTS[0], "", "/bogus", PROMPTS[1], "/reset", PROMPTS[1], "/exit", "never read"])
    backend.seen.clear()
    backend.stats.clear()
    assert main_chat(_args(api=url, system="Be brief."), input_fn=lambda prompt: next(script)) == 0
    out = capsys.readouterr().out
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    reply1 = _greedy(engine, first)
    second = [*first, {"role": "assistant", "content": reply1}, {"role": "user", "content": PROMPTS[1]}]
    third = [first[0], {"role": "user", "content": PROMPTS[1]}]
    assert backend.seen == [first, second, third]  # history grows; /reset keeps only the system prompt
    # the second turn continues from the first's KV cache: its prompt and every generated token
    # but the last (never fed) are not prefilled again (prefix reuse)
    turn1, turn2, _ = backend.stats
    assert turn2.cached_tokens == turn1.prompt_tokens + turn1.completion_tokens - 1 > 0
    assert reply1 in out and _greedy(engine, second) in out and _greedy(engine, third) in out
    assert "unknown command /bogus" in out and "conversation cleared" in out


def test_generate_swarm_finds_the_api_by_mdns(live_api, engine, stored_key, capsys):
    """`colibri-swarm generate --swarm` with nothing but the stored key: the coordinator's
    mDNS record leads to its API, and the reply is the local greedy reply."""
    from swarm.cli import main
    from swarm.discovery.api_record import ApiAdvertiser
    from zeroconf import InterfaceChoice, IPVersion
    from zeroconf.asyncio import AsyncZeroconf

    url, _, loop, port = live_api

    async def decoys():
        zc = AsyncZeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
        # An older term's coordinator (gone, its port closed) and another swarm's: never chosen.
        ads = [ApiAdvertiser(zc, swarm_id=KEY.swarm_id, host="o" * 26, term=6, port=1, addresses=["127.0.0.1"]),
               ApiAdvertiser(zc, swarm_id="0" * 16, host="x" * 26, term=99, port=2, addresses=["127.0.0.1"])]
        for ad in ads:
            await ad.start()
        return zc, ads

    zc, ads = asyncio.run_coroutine_threadsafe(decoys(), loop).result(60)
    try:
        code = main(["generate", "--swarm", "--max-tokens", str(MAX_TOKENS), PROMPTS[0]])
    finally:
        async def withdraw():
            for ad in ads:
                await ad.close()
            await zc.async_close()

        asyncio.run_coroutine_threadsafe(withdraw(), loop).result(30)
    assert code == 0
    assert capsys.readouterr().out == _greedy(engine, [{"role": "user", "content": PROMPTS[0]}]) + "\n"


def test_errors_are_one_clear_line(live_api, stored_key, monkeypatch, capsys, tmp_path):
    url, *_ = live_api
    with pytest.raises(SwarmError, match="refused the request: 401"):
        list(stream_chat(Endpoint(url, "wrong"), {"messages": [{"role": "user", "content": "x"}]}))
    with pytest.raises(SwarmError, match="400 'max_tokens'"):
        list(stream_chat(Endpoint(url, KEY.api_token), {"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": -1}))
    with pytest.raises(SwarmError, match="cannot reach"):
        list(stream_chat(Endpoint("http://127.0.0.1:9/v1", KEY.api_token), {"messages": []}))
    from swarm.discovery import api_record

    monkeypatch.setattr(api_record, "FIND_TIMEOUT_S", 0.5)
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path / "no-key-here"))
    from swarm.cli import main

    assert main(["chat"]) == 2
    assert "no swarm key on this machine" in capsys.readouterr().err


def test_generate_uses_the_local_coordinators_api_by_default(live_api, engine, stored_key, capsys):
    """With a peer running here (its status file), plain `generate` goes through the swarm."""
    import json
    import os
    import time

    from swarm import paths
    from swarm.cli import main
    from swarm.peer.status import STATUS_FILE

    url, backend, loop, port = live_api
    status = {"pid": os.getpid(), "updated": time.time(), "role": "coordinator", "placement": {"api_port": port}}
    (paths.config_dir() / STATUS_FILE).write_text(json.dumps(status))
    backend.seen.clear()
    assert main(["generate", "--max-tokens", str(MAX_TOKENS), PROMPTS[1]]) == 0
    messages = [{"role": "user", "content": PROMPTS[1]}]
    assert backend.seen == [messages]  # it went through the API, not the local engine
    assert capsys.readouterr().out == _greedy(engine, messages) + "\n"


def test_generate_on_a_workers_machine_uses_the_coordinators_api(live_api, engine, stored_key, capsys):
    """A worker runs here (its status names no API): plain `generate` finds the coordinator's API
    by mDNS rather than silently running the model on this machine."""
    import json
    import os
    import time

    from swarm import paths
    from swarm.cli import main
    from swarm.peer.status import STATUS_FILE

    url, backend, loop, port = live_api
    status = {"pid": os.getpid(), "updated": time.time(), "role": "worker", "placement": None}
    (paths.config_dir() / STATUS_FILE).write_text(json.dumps(status))
    backend.seen.clear()
    assert main(["generate", "--max-tokens", str(MAX_TOKENS), PROMPTS[0]]) == 0
    messages = [{"role": "user", "content": PROMPTS[0]}]
    assert backend.seen == [messages]  # through the API the coordinator announced, not the local engine
    assert capsys.readouterr().out == _greedy(engine, messages) + "\n"


def test_generate_api_option_names_the_api(live_api, engine, stored_key, capsys):
    from swarm.cli import main

    url, backend, loop, port = live_api
    backend.seen.clear()
    assert main(["generate", "--api", url, "--max-tokens", str(MAX_TOKENS), PROMPTS[1]]) == 0
    messages = [{"role": "user", "content": PROMPTS[1]}]
    assert backend.seen == [messages]
    assert capsys.readouterr().out == _greedy(engine, messages) + "\n"


def test_a_worker_without_a_reachable_api_says_so(stored_key, monkeypatch, capsys):
    """No coordinator's API on mDNS: one line saying what to do, not a silent local run."""
    import json
    import os
    import time

    from swarm import paths
    from swarm.cli import main
    from swarm.discovery import api_record
    from swarm.peer.status import STATUS_FILE

    from swarm.keys import swarmkey
    from swarm.keys.swarmkey import SwarmKey

    swarmkey.store(SwarmKey(bytes(32)).code)  # a swarm whose coordinator announces nothing
    # mDNS browsed for 0.5 s, not FIND_TIMEOUT_S (3 s; find_api's default, bound when it was defined)
    monkeypatch.setattr(api_record, "find_api", functools.partial(api_record.find_api, timeout_s=0.5))
    status = {"pid": os.getpid(), "updated": time.time(), "role": "worker", "placement": None}
    (paths.config_dir() / STATUS_FILE).write_text(json.dumps(status))
    assert main(["generate", "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert "a peer of the swarm runs here (role worker), but no coordinator API" in err and "--local" in err


def _raw_greedy(engine, prompt: str) -> str:
    """The engine's local greedy continuation of ``prompt`` without the chat template (the oracle)."""
    from swarm.compute.sampling import SamplingParams
    from swarm.compute.textgen import generate_text

    model, tok = engine
    return "".join(generate_text(model, tok, prompt, SamplingParams(max_tokens=MAX_TOKENS)))


def test_generate_raw_through_the_api_skips_the_chat_template(live_api, engine, stored_key, capsys):
    """`generate --api URL --raw` streams /v1/completions: the engine's raw continuation."""
    from swarm.cli import main

    url, backend, *_ = live_api
    prompt = "The capital of France is"
    raw = _raw_greedy(engine, prompt)
    assert raw != _greedy(engine, [{"role": "user", "content": prompt}])  # the template would show
    assert main(["generate", "--api", url, "--raw", "--max-tokens", str(MAX_TOKENS), prompt]) == 0
    assert capsys.readouterr().out == raw + "\n"


def test_the_completions_route_answers_whole_and_refuses_a_bad_prompt(live_api, engine, stored_key):
    import json
    import urllib.error
    import urllib.request

    url, *_ = live_api

    def post(body: dict) -> dict:
        req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {KEY.api_token}"})
        try:
            with urllib.request.urlopen(req, timeout=300) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, **json.loads(exc.read())}

    prompt = "Once upon a time"
    done = post({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert done["object"] == "text_completion" and done["choices"][0]["text"] == _raw_greedy(engine, prompt)
    assert done["usage"]["completion_tokens"] == MAX_TOKENS
    for bad in ({}, {"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": 3}):
        answer = post({**bad, "max_tokens": 1})
        assert answer["status"] == 400 and answer["error"]["param"] == "prompt", answer


def test_chat_with_an_api_that_does_not_answer_fails_before_the_first_turn(stored_key, capsys):
    """``chat --api URL`` where nothing listens: one line and exit 2 at the start (a script piping
    turns in learns it failed), not a REPL whose every turn fails and that then exits 0."""
    import socket

    from swarm.cli import main

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    def turn(prompt: str) -> str:  # a second turn asked for: the start did not fail (EOF ends the REPL)
        asked.append(prompt)
        if len(asked) > 1:
            raise EOFError
        return "hi"

    asked: list[str] = []
    with pytest.raises(SwarmError, match=rf"cannot reach the coordinator's API at http://127.0.0.1:{port}/v1"):
        main_chat(_args(api=f"http://127.0.0.1:{port}/v1"), input_fn=turn)
    assert asked == []
    assert main(["chat", "--api", f"http://127.0.0.1:{port}/v1"]) == 2
    assert "cannot reach the coordinator's API" in capsys.readouterr().err


def test_chat_with_a_wrong_token_fails_before_the_first_turn(live_api, stored_key, monkeypatch):
    url, *_ = live_api
    monkeypatch.setenv("COLIBRI_SWARM_API_KEY", "not-the-token")
    with pytest.raises(SwarmError, match="refused the request: 401"):
        main_chat(_args(api=url), input_fn=lambda prompt: pytest.fail("a turn was asked for"))


class _SlowStart(EngineBackend):
    """The engine, its replies held back ``hold_s`` seconds before the first piece (a request
    waiting for a slot, or a long prefill): iterated in a worker thread, as a reply that cannot
    be polled is."""

    hold_s = 1.5

    def generate(self, request, stats):
        import time

        reply = super().generate(request, stats)

        def held():
            time.sleep(self.hold_s)
            yield from reply

        return held()


def test_a_reply_slow_to_start_keeps_its_stream_alive(engine, stored_key, monkeypatch):
    """While a streamed reply sends no token the API sends keep-alive comments, so a client
    that leaves a silent coordinator after STALL_S (asleep or gone) waits on a slow one: the
    reply is the local greedy reply, where the same client without them would have left."""
    from swarm.peer import client
    from swarm.peer.coordinator import api as api_module

    monkeypatch.setattr(api_module, "KEEPALIVE_S", 0.2)
    monkeypatch.setattr(client, "STALL_S", 0.8)  # held 1.5 s: without keep-alives, left at 0.8
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="slow-api", daemon=True)
    thread.start()
    server = ApiServer.for_swarm_key(_SlowStart(*engine, model_id=MODEL_ID), KEY)
    try:
        port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(30)
        endpoint = find_endpoint(f"http://127.0.0.1:{port}/v1")
        messages = [{"role": "user", "content": PROMPTS[1]}]
        pieces = list(stream_chat(endpoint, {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}))
        assert "".join(pieces) == _greedy(engine, messages)
        monkeypatch.setattr(api_module, "KEEPALIVE_S", 60.0)  # the control: no comment within the hold
        with pytest.raises(SwarmError, match="sent nothing for 0.8 s"):
            list(stream_chat(endpoint, {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}))
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
