"""Churn on one two-host stage swarm (``join --layout stages``, the tiny OLMoE, a third namespace
for clients), in one test: the fault-free request time; the stage peer stalled (SIGSTOP/SIGCONT)
2 s while a request streams; the stage peer stalled 30 s, far longer than its link's dead-after,
with a request sent 3.5 s into the stall (its layers run on the coordinator); and sixteen 1 MB prompts,
each refused 400 for its context, sent at once while a normal request streams. Each request must
give the local run's text within three times the fault-free time plus the fault's length, and
after each fault the same peer coordinates the same term on the same API port. Each step prints
its stall as a JSON line; worst stalls: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api_tls import write_ca
from tests.multihost.test_mesh_multihost import read_status, until
from tests.multihost.test_stages_multihost import staged_coordinator, start_staged_swarm
from tests.multihost.test_swarm_multihost import LONG_TOKENS, reference, spawn_client
from tests.peer._swarm_models import add_char_tokenizer, build

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

PROMPT = "hello swarm"
CLIENT_NS = 2
SHORT_STALL_S = 2.0
LONG_STALL_S = 30.0  # a laptop's lid closed for half a minute: far past a link's 5 s dead-after (the
# stage moves to the coordinator) and past the time the coordinator waits before planning it out
SEND_INTO_STALL_S = 3.5  # past check-quorum's 2.5 s: the coordinator, alone, must still serve
STOP_AT_CHARS = 4  # the short stall starts once this much of the reply has streamed
HEAL_S = 30.0  # one swarm again, the stage peer holding a stage, within this after SIGCONT
STABLE_S = 3.0
FLOOD = 16
FLOOD_CHARS = 1_000_000  # the body stays under the API's 1 MiB limit; far past the model's context
FLOOD_S = 10.0  # every refusal comes within this of the flood's start

# Runs inside the client namespace: FLOOD concurrent chat requests, each with a 1 MB prompt,
# started once the file GO exists; prints each one's status, error code and seconds.
FLOOD_CLIENT = """
import asyncio, json, os, ssl, sys, time
import aiohttp
url, token, ca, go, n, chars = sys.argv[1:7]

async def one(session, model):
    t = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": "a" * int(chars)}], "max_tokens": 8}
    async with session.post(url + "/chat/completions", json=body) as r:
        doc = await r.json(content_type=None)
    return {"status": r.status, "code": (doc.get("error") or {}).get("code"), "seconds": time.monotonic() - t}

async def main():
    headers = {"Authorization": "Bearer " + token}
    connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=ca), limit=0)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        async with session.get(url + "/models") as r:
            model = (await r.json())["data"][0]["id"]
        print(json.dumps({"event": "ready"}), flush=True)
        while not os.path.exists(go):
            await asyncio.sleep(0.01)
        t = time.monotonic()
        results = await asyncio.gather(*(one(session, model) for _ in range(int(n))))
        print(json.dumps({"event": "flood", "results": results, "seconds": time.monotonic() - t}), flush=True)

asyncio.run(main())
"""


async def test_stage_peer_stalls_and_a_flood_of_huge_prompts(netns_lab):
    lab = netns_lab(3)  # host0, host1: the swarm; ns2: the clients
    model_dir = add_char_tokenizer(build("olmoe", lab.workdir))
    key = SwarmKey(os.urandom(32))
    expected = reference(model_dir, PROMPT, LONG_TOKENS)  # long enough that the stalls fall within it
    assert len(expected) >= 4 * STOP_AT_CHARS, "the tiny model ends too soon on the prompt"
    procs, c, doc = await start_staged_swarm(lab, model_dir, key)
    worker = 1 - c
    port, term = doc["placement"]["api_port"], doc["placement"]["term"]
    loop = asyncio.get_running_loop()

    def leadership() -> tuple | None:
        docs = {i: read_status(lab, i) for i in (0, 1)}
        found = staged_coordinator(docs)
        if found is None or (docs[1 - found[0]] or {}).get("role") != "worker":
            return None
        i, d = found
        return i, d["placement"]["api_port"], d["placement"]["term"]

    def stages_held_by(i: int) -> set[str]:
        placement = (read_status(lab, i) or {}).get("placement") or {}
        return {s[0] for s in placement.get("stages", ())}

    async def healed(what: str, since: float) -> tuple:
        """The (coordinator, API port, term) once the stage plan over both hosts has held STABLE_S."""
        first: list = []

        def settled() -> bool:
            state = leadership()
            if state is None or (first and first[1] != state):
                first.clear()
                return False
            if not first:
                first.extend((time.monotonic(), state))
            return time.monotonic() - first[0] >= STABLE_S

        await until(settled, HEAL_S + STABLE_S, f"one staged swarm after {what}", procs)
        print(json.dumps({"event": "healed", "fault": what, "seconds": round(first[0] - since, 2),
                          "coordinator": first[1][0], "api_port": first[1][1], "term": first[1][2]}))
        return first[1]

    async def timed(on_piece=None) -> float:
        """Seconds a streaming request from the client namespace takes; its text must be the local one."""
        t = time.monotonic()
        proc = spawn_client(lab, CLIENT_NS, c, port, key.api_token, PROMPT, LONG_TOKENS)
        seen = 0
        while True:
            answer = await proc.wait_for(lambda e: e.get("event") in ("piece", "done", "error"), 120, since=seen)
            seen = proc.events.index(answer) + 1
            if answer["event"] != "piece":
                break
            if on_piece:
                on_piece(answer["chars"])
        took = time.monotonic() - t
        assert answer["event"] == "done" and answer["text"] == expected, answer
        return took

    def stall(what: str, took: float, base: float, fault_s: float) -> None:
        print(json.dumps({"event": "stall", "fault": what, "seconds": round(took, 2), "fault_free_s": round(base, 2),
                          "fault_s": fault_s, "bound_s": round(3 * base + fault_s, 2)}))

    # 1. Fault-free: the local text; the time of the faster of two requests.
    base = min([await timed() for _ in range(2)])
    stall("fault-free request", base, base, 0.0)

    # 2. The stage peer stalled 2 s while a request streams.
    stopped: list[float] = []
    stopped_at_chars: list[int] = []

    def stop_after_a_few_pieces(chars: int) -> None:
        if chars >= STOP_AT_CHARS and not stopped:
            lab.stop(worker)
            stopped.append(time.monotonic())
            stopped_at_chars.append(chars)
            loop.call_later(SHORT_STALL_S, lab.cont, worker)

    try:
        took = await timed(stop_after_a_few_pieces)
    finally:
        if stopped:
            await asyncio.sleep(max(0.0, stopped[0] + SHORT_STALL_S - time.monotonic()))
        lab.cont(worker)
    assert stopped and stopped_at_chars[0] < len(expected) // 2, "the stall came late in the generation"
    stall(f"stage peer stalled {SHORT_STALL_S:g} s during a request", took, base, SHORT_STALL_S)
    assert took <= 3 * base + SHORT_STALL_S, (took, base)
    after = await healed(f"stage peer stalled {SHORT_STALL_S:g} s", stopped[0] + SHORT_STALL_S)
    assert after == (c, port, term), "the same coordinator, API port and term"

    # 3. The stage peer stalled 30 s, a request sent during the stall: its layers move to the
    # coordinator; after SIGCONT the stage plan covers both hosts again and requests take
    # fault-free time.
    lab.stop(worker)
    stopped_at = time.monotonic()
    cont = loop.call_later(LONG_STALL_S, lab.cont, worker)
    try:
        await asyncio.sleep(SEND_INTO_STALL_S)
        took = await timed()
        await until(lambda: stages_held_by(c) == {doc["peer_id"]},
                    max(0.0, stopped_at + LONG_STALL_S - time.monotonic()), "the stage moved to the coordinator",
                    procs)
    finally:
        await asyncio.sleep(max(0.0, stopped_at + LONG_STALL_S - time.monotonic()))
        cont.cancel()
        lab.cont(worker)
    stall(f"request during a {LONG_STALL_S:g} s stall of the stage peer", took, base, LONG_STALL_S)
    assert took <= 3 * base + LONG_STALL_S, (took, base)
    after = await healed(f"stage peer stalled {LONG_STALL_S:g} s", stopped_at + LONG_STALL_S)
    assert after == (c, port, term), "the same coordinator, API port and term"
    took = await timed()
    stall(f"request after the stage peer stalled {LONG_STALL_S:g} s", took, base, 0.0)
    assert took <= 3 * base, (took, base)

    # 4. Sixteen 1 MB prompts at once while a normal request streams: each refused 400 for its
    # context, quickly; the normal request unharmed; no election.
    go = lab.workdir / "flood-go"
    ca = write_ca(key, lab.workdir)
    flood = lab.spawn(CLIENT_NS, ["-c", FLOOD_CLIENT, f"https://{lab.addresses[c]}:{port}/v1", key.api_token, str(ca),
                                  str(go), str(FLOOD), str(FLOOD_CHARS)])
    await flood.wait_for(lambda e: e.get("event") == "ready", 60)

    released: list[int] = []

    def release(chars: int) -> None:
        if not released:
            go.touch()
            released.append(chars)

    took = await timed(release)
    assert released and released[0] < len(expected) // 2, "the flood came late in the generation"
    report = await flood.wait_for(lambda e: e.get("event") == "flood", 60)
    results = report["results"]
    print(json.dumps({"event": "flood", "requests": len(results), "statuses": sorted({r["status"] for r in results}),
                      "slowest_s": round(max(r["seconds"] for r in results), 2), "all_s": round(report["seconds"], 2)}))
    stall(f"request during {FLOOD} concurrent 1 MB prompts", took, base, 1.0)
    assert [(r["status"], r["code"]) for r in results] == [(400, "context_length_exceeded")] * FLOOD, results
    assert report["seconds"] <= FLOOD_S, report
    assert took <= 3 * base + 1.0, (took, base)
    assert leadership() == (c, port, term), "no election: the same coordinator, API port and term"
    for p in procs:
        p.kill()
