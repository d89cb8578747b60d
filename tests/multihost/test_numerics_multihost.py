"""An int8 swarm of real processes (docs/weights.md, "Two numerics"): two namespaced hosts run
``colibri-swarm join --numerics int8 --layout stages --verify 100`` on the default model
(SmolLM2-135M, Q4_1: weights the int8 kernels take), a third joins with the default numerics
(float32) and no model, so it can never coordinate. The coordinator gives the other int8 host a
stage and recomputes every row it answers, finding each equal (nobody distrusted or marked
down); a greedy chat completion through the API gives the text of the local int8 run, which is
not the float32 run's; the float32 host gets no work and is reported left out for its numerics.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from swarm.compute import numerics
from swarm.compute.default_model import default_model_path
from swarm.compute.quant import prepare_kernels
from swarm.keys.swarmkey import SwarmKey
from tests.multihost.test_mesh_multihost import read_status, until
from tests.multihost.test_stages_multihost import start_staged_swarm
from tests.multihost.test_swarm_multihost import ask, reference

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

# Prompts for the reply: the test takes the first whose int8 greedy reply parts from float32's
# within the tokens asked. Which do depends on the CPU (numpy's float32 exp and the kernels'
# vector forms may round an ulp apart across CPUs, which moves near-ties), so none is fixed.
PROMPTS = ("Why is the sky blue?", "What does a compiler do?", "How do bees make honey?",
           "Write a short poem about the sea.", "Describe a sunrise in the mountains.",
           "Explain how a bicycle stays upright.", "What is the difference between weather and climate?",
           "Give three tips for learning a new language.")
LEFT_OUT = "it computes float32, this coordinator int8"


def int8_prompt(model) -> tuple[str, str]:
    """(the first of PROMPTS whose local int8 reply is not float32's, that reply), leaving this
    process's numerics int8; fails when none parts (the int8 kernels did not run)."""
    for prompt in PROMPTS:
        numerics.set_numerics("float32")
        float32_text = reference(model, prompt)
        numerics.set_numerics("int8")
        text = reference(model, prompt)
        if text != float32_text:
            return prompt, text
    pytest.fail(f"the local int8 reply is float32's for each of {len(PROMPTS)} prompts: the int8 kernels did not run")


async def test_an_int8_swarm_of_processes_gives_the_local_int8_text_and_leaves_a_float32_peer_out(
        netns_lab, monkeypatch):
    model = default_model_path()
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)  # this process's numerics restored after
    prompt, expected = int8_prompt(model)
    prepare_kernels()  # compiled once into the cache every peer reads, not once per peer

    lab = netns_lab(3)  # host0, host1: the int8 swarm; host2: float32, and the API's client
    key = SwarmKey(os.urandom(32))
    # --context 512: a KV cache of the size this reply needs, not the default 4096 tokens per peer
    procs, c, doc = await start_staged_swarm(lab, model, key, "--numerics", "int8", "--verify", "100",
                                             "--context", "512")
    stage_host = read_status(lab, 1 - c)
    assert doc["numerics"] == stage_host["numerics"] == "int8"
    assert [s[0] for s in doc["placement"]["stages"]] == [doc["peer_id"], stage_host["peer_id"]]

    procs.append(lab.spawn(2, ["-m", "swarm", "-v", "join", "--no-model", "--key", key.code, "--name", "host2"],
                           env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}))
    await until(lambda: read_status(lab, 2) is not None, 60, "host2 started", procs)
    outsider = read_status(lab, 2)
    assert outsider["numerics"] == "float32"

    def left_out() -> list[dict]:
        return [e for e in (read_status(lab, c) or {}).get("events", ())
                if e["what"] == "left out" and e["peer_id"] == outsider["peer_id"]]

    await until(lambda: left_out(), 60, "the coordinator leaving the float32 peer out", procs)
    assert [(e["name"], e["detail"]) for e in left_out()] == [("host2", LEFT_OUT)]

    def answered() -> dict:
        return (read_status(lab, c) or {}).get("observed", {}).get("stage_verify", {})

    # The stage host computes the reply's rows, every one recomputed here and found equal. A stage
    # host still loading its stage when the first reply runs has that reply's rows computed here
    # (the rule for a peer not yet serving its plan), so ask again, a few times at most, until
    # its answers show in the coordinator's status (written once a second).
    for _ in range(3):
        answer = await ask(lab, 2, c, doc["placement"]["api_port"], key.api_token, prompt)
        assert answer["event"] == "done", answer
        assert answer["text"] == expected
        for _ in range(20):
            if answered().get("rows_answered"):
                break
            await asyncio.sleep(0.5)
        if answered().get("rows_answered"):
            break
    status = read_status(lab, c)
    checked = status["observed"]["stage_verify"]
    assert checked["distrusted"] == {}, checked
    assert checked["rows_answered"] > 0 and checked["rows_checked"] == checked["rows_answered"], checked
    placement = status["placement"]
    assert [s[0] for s in placement["stages"]] == [doc["peer_id"], stage_host["peer_id"]]
    assert outsider["peer_id"] not in placement["peers"]
    seen = {p["peer_id"]: p for p in status["peers"]}
    assert seen[outsider["peer_id"]]["linked"] and seen[outsider["peer_id"]]["numerics"] == "float32"
    assert seen[stage_host["peer_id"]]["numerics"] == "int8"
    lost = [e for e in status["events"] if e["what"] in ("marked down", "left", "link down")]
    assert not lost, lost
    assert len(left_out()) == 1  # noted once, through every re-plan
