"""Stable leadership on namespaced peers (``colibri-swarm join``, real mDNS, WebRTC, signaling),
on one swarm of three: a worker restarted within 0.3 s, 1 s and 4 s, after which a request
through the API completes within three times its fault-free time plus the fault's length, with
the local run's text; a worker stalled (SIGSTOP/SIGCONT) for 3 s, after which the same peer
coordinates the same term on the same API port; a coordinator stalled long enough to be deposed
while a following client (generate's) streams through it, which on SIGCONT steps down promptly
and hands the request back, the client finishing it at the new coordinator with the local text;
both workers stalled 5 s at once (one swarm again after, the same port where the same peer
leads, a request within three times fault-free); and the coordinator restarted within 0.3 s and
4 s (one coordinator, the local text, its API port kept when it leads again). Worst stalls:
docs/reliability.md."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from swarm.keys.swarmkey import SwarmKey
from tests.multihost.test_faults import FORM_S, PROMPT, expected, healed, join, model_dir  # noqa: F401 (fixtures)
from tests.multihost.test_mesh_multihost import read_status, until
from tests.multihost.test_swarm_multihost import LONG_TOKENS, ask, reference

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

RESTARTS_S = (0.3, 1.0, 4.0)  # how long a worker stays dead before it starts over
COORDINATOR_RESTARTS_S = (0.3, 4.0)  # how long the coordinator stays dead before it starts over
HAND_BACK_S = 1.0  # a deposed coordinator hands its requests back within this of stepping down
WORKER_STALL_S = 3.0
# the others elect within ~2 s; the stalled coordinator wakes well after. Below the client's
# STALL_S (10 s): this tests the hand-back on waking, not the client leaving a silent stream.
DEPOSED_STALL_S = 6.0
BOTH_STALL_S = 5.0  # both workers stopped at once
STEP_DOWN_S = 3.0  # a woken, deposed coordinator leaves its role within this (status is rewritten every 1 s)


def leadership(state: dict) -> tuple:
    return state["coordinator"], state["term"], state["api_port"]


def a_worker(state: dict) -> int:
    """A worker that does not host signaling (its restart would move the signaling host)."""
    return next(i for i in range(3) if i not in (state["coordinator"], state["host"]))


async def timed_ask(lab, key, state: dict, expected_text: str) -> float:
    client = next(i for i in range(3) if i != state["coordinator"])
    t = time.monotonic()
    answer = await ask(lab, client, state["coordinator"], state["api_port"], key.api_token, PROMPT)
    took = time.monotonic() - t
    assert answer["event"] == "done" and answer["text"] == expected_text, answer
    return took


# Runs inside a peer's namespace: the client ``generate`` and ``chat`` use (the API found by the
# local peer's status, sent again to the next coordinator when the first goes away or hands the
# request back); one JSON line per piece, per retry, and at the end.
FOLLOWING_CLIENT = """
import json, sys
from swarm.peer.client import find_endpoint, stream_chat_retrying
prompt, n = sys.argv[1], int(sys.argv[2])
body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0}
retry = lambda exc: print(json.dumps({"event": "retry", "error": str(exc)}), flush=True)
text = ""
try:
    for piece in stream_chat_retrying(find_endpoint(None, mdns=True), body, on_retry=retry):
        text += piece
        print(json.dumps({"event": "piece", "chars": len(text)}), flush=True)
    print(json.dumps({"event": "done", "text": text}), flush=True)
except Exception as exc:
    print(json.dumps({"event": "error", "error": repr(exc)[:500], "text": text}), flush=True)
"""


@pytest.fixture(scope="module")
def long_expected(model_dir) -> str:  # noqa: F811
    text = reference(model_dir, PROMPT, LONG_TOKENS)
    assert len(text) >= 40, "the tiny model ends too soon to be in flight during a stall"
    return text


async def test_restart_and_stalls_keep_one_coordinator(netns_lab, model_dir, expected, long_expected):  # noqa: F811
    lab = netns_lab(3)
    key = SwarmKey(os.urandom(32))
    procs = [join(lab, i, key, model_dir) for i in range(3)]
    state = await healed(lab, procs, 3, "joining together", time.monotonic(), bound_s=FORM_S)
    base = min([await timed_ask(lab, key, state, expected) for _ in range(2)])

    # A worker killed and started again within 0.3 s / 1 s, then a request at once. The fault
    # lasts from the kill until the swarm is whole again (the new process up and linked).
    for down_s in RESTARTS_S:
        worker = a_worker(state)
        killed = time.monotonic()
        procs[worker].kill()
        await asyncio.sleep(down_s)
        procs[worker] = join(lab, worker, key, model_dir)
        took = await timed_ask(lab, key, state, expected)
        after = await healed(lab, procs, 3, f"worker restarted after {down_s} s", time.monotonic(), bound_s=FORM_S)
        fault_s = time.monotonic() - killed
        print(json.dumps({"event": "stall", "fault": f"worker restarted after {down_s} s", "seconds": round(took, 2),
                          "fault_free_s": round(base, 2), "fault_s": round(fault_s, 2)}))
        assert took <= 3 * base + max(down_s, fault_s), (down_s, took, base, fault_s)
        assert leadership(after) == leadership(state), "a restarted worker must not depose the coordinator"

    # A worker stalled for 3 s: the same coordinator, term and API port after it.
    worker = a_worker(state)
    lab.stop(worker)
    await asyncio.sleep(WORKER_STALL_S)
    lab.cont(worker)
    await asyncio.sleep(2.0)  # time enough for a woken peer to have called an election
    after = await healed(lab, procs, 3, "worker stalled 3 s", time.monotonic())
    assert leadership(after) == leadership(state), "a woken worker must not depose the coordinator"
    took = await timed_ask(lab, key, state, expected)
    print(json.dumps({"event": "stall", "fault": "after a worker stalled 3 s", "seconds": round(took, 2)}))

    # The coordinator stalled until deposed while a client that follows the swarm (generate's
    # own retrying client, on a worker's machine) streams through it: on SIGCONT it steps down
    # promptly and hands the request back at once; the client sends it to the new coordinator
    # and shows the local text once. One coordinator after.
    old = state["coordinator"]
    follower = a_worker(state)
    for _ in range(3):  # the tiny model may finish its reply before SIGSTOP lands: then again
        client = lab.spawn(follower, ["-c", FOLLOWING_CLIENT, PROMPT, str(LONG_TOKENS)])
        await client.wait_for(lambda e: e.get("event") == "piece", 60)
        lab.stop(old)
        # A stopped coordinator sends nothing: a "done" the client reads from now on left before
        # the stop (a client on a busy machine may read it well after), so any "done" means again.
        await asyncio.sleep(1.0)
        client.poll()
        if not any(e.get("event") == "done" for e in client.events):
            break
        lab.cont(old)
        await asyncio.sleep(1.0)
    await asyncio.sleep(DEPOSED_STALL_S)
    lab.cont(old)
    woke = time.monotonic()
    await until(lambda: (read_status(lab, old) or {}).get("role") not in (None, "coordinator"), STEP_DOWN_S + 2,
                "the deposed coordinator to step down", procs)
    stepped = time.monotonic() - woke
    retry = await client.wait_for(lambda e: e.get("event") in ("retry", "done", "error"), 30)
    assert retry["event"] == "retry" and "stopped coordinating" in retry["error"], retry  # not finished there
    done = await client.wait_for(lambda e: e.get("event") in ("done", "error"), 120)
    print(json.dumps({"event": "step down", "fault": f"coordinator stalled {DEPOSED_STALL_S} s with a request "
                      "streaming", "seconds": round(stepped, 2), "handed_back_after_wake_s": round(retry["t"] - woke, 2),
                      "finished_after_wake_s": round(done["t"] - woke, 2)}))
    assert stepped <= STEP_DOWN_S
    assert retry["t"] - woke <= STEP_DOWN_S + HAND_BACK_S, "the request must be handed back as the coordinator steps down"
    assert done == {**done, "event": "done", "text": long_expected}, done
    state = await healed(lab, procs, 3, "deposed coordinator woken", woke)
    assert state["coordinator"] != old
    base = min(base, await timed_ask(lab, key, state, expected))

    # Both workers stalled at once (two laptops' lids closed): the coordinator, hearing no
    # majority for REACHABLE_S, steps down (check-quorum: a coordinator cut off in a minority stops
    # serving); once they wake the swarm is one again, at the same API port where the same peer
    # leads, and a request gives the local text in fault-free time.
    workers = [i for i in range(3) if i != state["coordinator"]]
    for i in workers:
        lab.stop(i)
    await asyncio.sleep(BOTH_STALL_S)
    for i in workers:
        lab.cont(i)
    woke = time.monotonic()
    after = await healed(lab, procs, 3, f"both workers stalled {BOTH_STALL_S} s", woke)
    if after["coordinator"] == state["coordinator"]:
        assert after["api_port"] == state["api_port"], "the same coordinator serves at the same API port"
    took = await timed_ask(lab, key, after, expected)
    print(json.dumps({"event": "stall", "fault": f"both workers stalled {BOTH_STALL_S} s", "seconds": round(took, 2),
                      "healed_after_wake_s": round(time.monotonic() - woke - took, 2), "fault_free_s": round(base, 2)}))
    assert took <= 3 * base, (took, base)
    state = after

    # The coordinator killed and started again within 0.3 s / 4 s from its config directory: one
    # coordinator again, the local text, and the same API port wherever the same peer leads.
    for down_s in COORDINATOR_RESTARTS_S:
        old = state["coordinator"]
        killed = time.monotonic()
        procs[old].kill()
        await asyncio.sleep(down_s)
        procs[old] = join(lab, old, key, model_dir)
        after = await healed(lab, procs, 3, f"coordinator restarted after {down_s} s", killed, bound_s=FORM_S)
        if after["coordinator"] == old:
            assert after["api_port"] == state["api_port"], "a coordinator re-elected on its machine keeps its API port"
        took = await timed_ask(lab, key, after, expected)
        print(json.dumps({"event": "stall", "fault": f"coordinator restarted after {down_s} s",
                          "seconds": round(took, 2), "healed_s": round(time.monotonic() - killed, 2),
                          "same_leader": after["coordinator"] == old}))
        assert took <= 3 * base + down_s, (down_s, took, base)
        state = after
    for p in procs:
        p.kill()
