"""``colibri-swarm join --layout stages`` in network namespaces: real processes, mDNS, WebRTC.
Two hosts hold a tiny OLMoE; the coordinator gives the other one a range of whole layers; a
streaming chat completion through the official client gives the text one machine gives, and
it still does when the stage's host is killed at token 10 (its layers move to the coordinator,
their KV cache rebuilt from the rows that had entered them).
"""

from __future__ import annotations

import os
import time

import pytest

from swarm.keys.swarmkey import SwarmKey
from tests.multihost.test_mesh_multihost import read_status, until
from tests.multihost.test_swarm_multihost import KILL_AT, ask, reference
from tests.peer._links import NO_FRAGMENT_REASSEMBLY
from tests.peer._swarm_models import add_char_tokenizer, build

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def staged_coordinator(docs) -> tuple[int, dict] | None:
    """(index, status) of the coordinator whose stage plan gives the other host a stage."""
    for i, d in docs.items():
        p = (d or {}).get("placement") or {}
        others = {docs[j]["peer_id"] for j in docs if j != i and docs[j]}
        if (d and d.get("role") == "coordinator" and p.get("api_port") and p.get("layout") == "stages"
                and others and others <= {s[0] for s in p.get("stages", ())}):
            return i, d
    return None


async def start_staged_swarm(lab, model_dir, key: SwarmKey, *options: str):
    """``join --layout stages`` (and ``options``) on hosts 0 and 1; (their processes, the
    coordinator's index and status) once its stage plan gives the other host a stage."""
    procs = []
    for i in (0, 1):
        procs.append(lab.spawn(i, ["-m", "swarm", "-v", "join", "--model", str(model_dir), "--key", key.code,
                                   "--name", f"host{i}", "--layout", "stages", *options],
                               env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}))
        await until(lambda: read_status(lab, i) is not None, 60, f"host{i} started", procs)
    docs = lambda: {i: read_status(lab, i) for i in (0, 1)}  # noqa: E731
    await until(lambda: staged_coordinator(docs()) is not None, 60, "a coordinator with a stage on the other host",
                procs)
    return (procs, *staged_coordinator(docs()))


async def test_a_stage_plan_over_namespaced_hosts_and_a_stage_killed_at_token_10(netns_lab):
    lab = netns_lab(3)  # host0, host1: the swarm; ns2: the client
    model_dir = add_char_tokenizer(build("olmoe", lab.workdir))
    key = SwarmKey(os.urandom(32))
    prompts = [p for p in ("hello swarm", "tell me more", "abc", "what is 2+2?", "zzz")
               if len(reference(model_dir, p)) >= KILL_AT + 4][:2]
    assert len(prompts) == 2, "the tiny model ends too soon on every prompt"
    expected = [reference(model_dir, p) for p in prompts]
    procs, c, doc = await start_staged_swarm(lab, model_dir, key)
    worker = 1 - c
    for p in procs:  # join's default event loop
        assert "event loop: uvloop (uvloop.Loop)" in p.log_path.read_text(errors="replace"), p.log_path
    stages = doc["placement"]["stages"]
    assert stages[0][0] == doc["peer_id"] and [s[1:] for s in stages][-1][1] == 3  # all 3 layers, in order
    assert doc["placement"]["cost"]["mode"] == "stages"

    answer = await ask(lab, 2, c, doc["placement"]["api_port"], key.api_token, prompts[0])
    assert answer["event"] == "done", answer
    assert answer["text"] == expected[0]

    killed = []

    def kill_at(chars):
        if chars >= KILL_AT and not killed:
            procs[worker].kill()
            killed.append(time.monotonic())

    answer = await ask(lab, 2, c, doc["placement"]["api_port"], key.api_token, prompts[1], kill_at)
    assert answer["event"] == "done", answer
    assert killed, "the generation ended before token 10"
    assert answer["text"] == expected[1]


async def test_a_host_whose_network_drops_ip_fragments_still_serves_its_stage(netns_lab):
    """Some networks drop IP fragments, which jumbo packets between Python peers travel as. The
    host whose namespace reassembles none still forms the swarm: each side's link finds that
    16 KiB probes do not come back, says so, and keeps MTU-sized packets; the stage host then
    computes every step of a chat completion (its prefill rows are a multi-packet message) with
    no link lost and no peer marked down, and the text is one machine's."""
    lab = netns_lab(3)
    assert lab.exec(1, *NO_FRAGMENT_REASSEMBLY).returncode == 0
    model_dir = add_char_tokenizer(build("olmoe", lab.workdir))
    key = SwarmKey(os.urandom(32))
    prompt = "tell me more about the swarm"
    expected = reference(model_dir, prompt)
    procs, c, doc = await start_staged_swarm(lab, model_dir, key)
    await until(lambda: all("drops IP fragments" in p.log_path.read_text(errors="replace") for p in procs), 30,
                "both links giving up jumbo packets", procs)
    answer = await ask(lab, 2, c, doc["placement"]["api_port"], key.api_token, prompt)
    assert answer["event"] == "done", answer
    assert answer["text"] == expected
    events = read_status(lab, c)["events"]
    lost = [e for e in events if e["what"] in ("link down", "marked down", "left")]
    assert not lost, lost
    log = procs[c].log_path.read_text(errors="replace")
    assert "recomput" not in log.lower() and "missed" not in log.lower(), log[-3000:]
