"""Fault injection on namespaced peers (``colibri-swarm join``, real mDNS, WebRTC, signaling):
stalls (SIGSTOP/SIGCONT), link outages (``ip link set eth0 down`` on the peer's side), blocked
multicast, and during a greedy generation a worker's stall, its link outage, the coordinator's
death, every core taken by busy processes, and a worker's memory capped at its own anonymous
memory. After each fault the swarm must heal within ``HEAL_S`` (docs/reliability.md): one
signaling host, one coordinator planning over every other peer, and a generation through the
API equal to the local run. Every peer runs with the slow-callback check on
(``COLIBRI_SWARM_SLOW_CALLBACK_S``) and none may report a callback that did 100 ms of work on
its event loop.

The model is the tiny OLMoE of the swarm tests; the oracle is the engine run in this process.
The last test joins three peers holding a random OLMoE GGUF with SmolLM2's real 49,152-token
tokenizer: parsing it takes seconds, which once ran on the event loop and split the swarm.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import gguf
import pytest

from swarm.keys.swarmkey import SwarmKey
from tests.conftest import require
from tests.multihost.netns import REPO_ROOT, MemoryCgroup, remove_stale_cgroups
from tests.multihost.test_mesh_multihost import read_status, until
from tests.multihost.test_swarm_multihost import LONG_TOKENS, ask, coordinator_of, reference
from tests.peer._swarm_models import add_char_tokenizer, build

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

HEAL_S = 30.0  # the documented bound: one swarm again within this long after the fault ends
STABLE_S = 3.0  # one swarm must hold this long to count as healed
FORM_S = 60.0  # a peer starts (loads its model, hosts or finds signaling) within this
FORM_SLOW_S = 120.0  # three peers loading a slow-to-parse model at once on 2 shared cores form one swarm
PROMPT = "hello swarm"
SLOW_CALLBACK_ENV = "COLIBRI_SWARM_SLOW_CALLBACK_S"
PEER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", SLOW_CALLBACK_ENV: "0.1"}
UNCAPPED = -1  # memory.limit_in_bytes for no limit
SQUEEZE_MARGIN = 16 << 20  # bytes a capped worker may hold beyond its own anonymous memory
SLOW = re.compile(r"WARNING asyncio: slow callback: .*")


def join(lab, i: int, key: SwarmKey | None, model_dir, *extra: str, cgroup: MemoryCgroup | None = None,
         env: dict[str, str] = PEER_ENV):
    key_args = ["--key", key.code] if key is not None else []
    return lab.spawn(i, ["-m", "swarm", "-v", "join", "--model", str(model_dir), *key_args, "--name", f"host{i}",
                         "--layout", "ranges", *extra], env=env, cgroup=cgroup)


def busy_cores() -> list[subprocess.Popen]:
    """One process spinning on each core this process may use, pinned to that core."""
    return [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
            for cpu in sorted(os.sched_getaffinity(0))]


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def one_swarm(lab, n: int) -> dict | None:
    """The swarm's state when all ``n`` peers are one swarm (one signaling host everyone is on,
    one coordinator planning over all others, all others workers), else None."""
    docs = {i: read_status(lab, i) for i in range(n)}
    if not all(docs.values()):
        return None
    hosts = {d["signaling_host"] for d in docs.values()}
    hosting = [i for i, d in docs.items() if d["hosting_signaling"]]
    found = coordinator_of(docs)
    if len(hosts) != 1 or None in hosts or len(hosting) != 1 or found is None:
        return None
    c, doc = found
    return {"coordinator": c, "host": hosting[0], "api_port": doc["placement"]["api_port"],
            "term": doc["placement"]["term"]}


async def healed(lab, procs, n: int, what: str, since: float, bound_s: float = HEAL_S) -> dict:
    """Wait until the peers are one swarm and stay so for ``STABLE_S`` (a peer woken from a stall
    rewrites its old view at once); the heal time printed is until that state first held."""
    first: list[float] = []

    def settled() -> bool:
        state = one_swarm(lab, n)
        if state is None or (first and first[1] != state):
            first.clear()
            return False
        if not first:
            first.extend((time.monotonic(), state))
        return time.monotonic() - first[0] >= STABLE_S

    await until(settled, bound_s + STABLE_S, f"one swarm after {what}", procs)
    seconds = round(first[0] - since, 2)
    print(json.dumps({"event": "healed", "fault": what, "seconds": seconds, **first[1]}))
    assert seconds <= bound_s
    return first[1]


def lone_coordinators(procs) -> list[str]:
    """Log lines of a peer that coordinated alone (a newcomer that stood before it heard of the others)."""
    return [line for p in procs for line in p.log_path.read_text(errors="replace").splitlines()
            if "coordinator of term" in line and "over 0 worker(s)" in line]


def slow_callbacks(procs) -> list[str]:
    return [m.group(0)[:300] for p in procs for m in SLOW.finditer(p.log_path.read_text(errors="replace"))]


async def fault_during_generation(lab, procs, key: SwarmKey, state: dict, expected: str, what: str, worker: int,
                                  start, end) -> dict:
    """A greedy generation through the API with ``start(worker)`` at its 8th character and
    ``end(worker)`` 3 s later (or when it ends, if later): the text must be the local run's, and
    the peers one swarm again after; returns that swarm's state."""
    c = state["coordinator"]
    client = next(i for i in range(3) if i not in (c, worker))
    hit: list[float] = []

    def strike(chars: int) -> None:
        if chars >= 8 and not hit:
            start(worker)
            hit.append(time.monotonic())

    try:
        answer = await ask(lab, client, c, state["api_port"], key.api_token, PROMPT, strike)
        await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - hit[0])) if hit else 0.0)
    finally:
        if hit:
            end(worker)
    assert hit, f"the generation ended before the fault: {what}"
    assert answer["event"] == "done" and answer["text"] == expected, (what, answer)
    return await healed(lab, procs, 3, what, time.monotonic())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_char_tokenizer(build("olmoe", tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def expected(model_dir) -> str:
    return reference(model_dir, PROMPT)


async def test_faults_heal_into_one_swarm(netns_lab, model_dir, expected):
    require(MemoryCgroup.ROOT.joinpath("cgroup.procs").exists(),
            "the cgroup v1 memory controller at /sys/fs/cgroup/memory (writable as root)")
    lab = netns_lab(3)
    key = SwarmKey(os.urandom(32))

    # Three peers joining at once form one swarm (they once ended as three lone coordinators).
    procs = [join(lab, i, key, model_dir) for i in range(3)]
    t0 = time.monotonic()
    state = await healed(lab, procs, 3, "joining together", t0)
    assert lone_coordinators(procs) == []
    answer = await ask(lab, (state["coordinator"] + 1) % 3, state["coordinator"], state["api_port"],
                       key.api_token, PROMPT)
    assert answer == {"event": "done", "text": expected, "t": answer["t"]}

    async def fault(what: str, target: int, seconds: float, *, stall: bool) -> dict:
        (lab.stop if stall else lab.link_down)(target)
        await asyncio.sleep(seconds)
        (lab.cont if stall else lab.link_up)(target)
        state = await healed(lab, procs, 3, what, time.monotonic())
        client = next(i for i in range(3) if i != state["coordinator"])
        answer = await ask(lab, client, state["coordinator"], state["api_port"], key.api_token, PROMPT)
        assert answer["event"] == "done" and answer["text"] == expected, (what, answer)
        return state

    def non_host(state: dict) -> int:
        return next(i for i in range(3) if i != state["host"])

    state = await fault("non-host stalled 12 s", non_host(state), 12.0, stall=True)
    state = await fault("host stalled 5 s", state["host"], 5.0, stall=True)
    state = await fault("non-host link down 9 s", non_host(state), 9.0, stall=False)
    state = await fault("host link down 4 s", state["host"], 4.0, stall=False)

    async def during_generation(what: str, worker: int, start, end) -> dict:
        return await fault_during_generation(lab, procs, key, state, expected, what, worker, start, end)

    def a_worker(state: dict) -> int:
        return next(i for i in range(3) if i != state["coordinator"])

    state = await during_generation("worker stalled during a generation", a_worker(state), lab.stop, lab.cont)
    state = await during_generation("worker link down during a generation", a_worker(state), lab.link_down,
                                    lab.link_up)

    # The coordinator dies while `colibri-swarm generate` streams its reply: the command sends the
    # request again to the next coordinator, and the text is the local run's, shown once.
    c = state["coordinator"]
    client = next(i for i in range(3) if i != c)
    cli = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", lab.namespaces[client], sys.executable, "-m", "swarm", "generate", "--swarm",
        "--max-tokens", str(LONG_TOKENS), PROMPT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=lab.env(client), cwd=REPO_ROOT)
    first = await asyncio.wait_for(cli.stdout.read(1), 60)
    procs[c].kill()
    out, err = await asyncio.wait_for(cli.communicate(), 120)
    assert cli.returncode == 0, err.decode(errors="replace")[-3000:]
    assert (first + out).decode() == reference(model_dir, PROMPT, LONG_TOKENS) + "\n"
    assert b"trying the next coordinator" in err

    # The killed peer joins again, inside a memory cgroup (uncapped for now): it finds a swarm
    # with a coordinator and joins it as a worker, never acting as a coordinator itself (no term
    # of its own, no API, no plans).
    remove_stale_cgroups()
    group = MemoryCgroup("rejoined", UNCAPPED)
    try:
        rejoined = join(lab, c, key, model_dir, cgroup=group)
        procs.append(rejoined)
        state = await healed(lab, procs, 3, "the killed coordinator rejoined", time.monotonic(), bound_s=FORM_S)
        assert state["coordinator"] != c
        assert "coordinator of term" not in rejoined.log_path.read_text(errors="replace")

        # During a generation: every core taken by a process pinned to it, then that worker's
        # memory capped at its own anonymous memory plus SQUEEZE_MARGIN (about what it is charged
        # for: the files it reads were cached by the other peers first).
        busy: list[subprocess.Popen] = []
        state = await during_generation("CPU loaded during a generation", a_worker(state),
                                        lambda _: busy.extend(busy_cores()), lambda _: stop_all(busy))
        capped: dict[str, int] = {}

        def cap(_) -> None:
            stat = dict(line.split() for line in group.read("memory.stat").splitlines())
            capped.update(rss=int(stat["rss"]), cache=int(stat["cache"]), limit=int(stat["rss"]) + SQUEEZE_MARGIN)
            group.write("memory.limit_in_bytes", capped["limit"])

        state = await during_generation("worker memory capped during a generation", c, cap,
                                        lambda _: group.write("memory.limit_in_bytes", UNCAPPED))
        stats = group.stats()
        print(json.dumps({"event": "memory cap", **capped, "max_usage": stats["max_usage"], "failcnt": stats["failcnt"]}))
        assert stats["oom_kill"] == 0 and procs[-1].poll()
    finally:
        for p in procs:
            p.kill()
        group.close()

    assert slow_callbacks(procs) == []


async def test_faults_during_a_generation_on_uvloop(netns_lab, model_dir, expected):
    """The default event loop (uvloop; the slow-callback check, which needs asyncio's, off): a
    worker stalled, then a worker's link down, during a generation; each text is the local run's
    and the peers are one swarm again after."""
    lab = netns_lab(3)
    key = SwarmKey(os.urandom(32))
    env = {**PEER_ENV, SLOW_CALLBACK_ENV: ""}  # off, even where the environment sets it
    procs = [join(lab, i, key, model_dir, env=env) for i in range(3)]
    state = await healed(lab, procs, 3, "joining together on uvloop", time.monotonic(), bound_s=FORM_S)
    for p in procs:
        assert "event loop: uvloop (uvloop.Loop)" in p.log_path.read_text(errors="replace"), p.log_path

    for what, start, end in (("worker stalled during a generation on uvloop", lab.stop, lab.cont),
                             ("worker link down during a generation on uvloop", lab.link_down, lab.link_up)):
        worker = next(i for i in range(3) if i != state["coordinator"])
        state = await fault_during_generation(lab, procs, key, state, expected, what, worker, start, end)


async def test_multicast_blocked_says_so_and_signal_joins(netns_lab, model_dir, expected):
    """With multicast blocked on the bridge, join says that no swarm was found by mDNS and how
    to use --signal; a peer given --signal HOST:PORT joins the swarm, which then generates.
    Multicast back, a ``join`` without ``--key`` says that another swarm is on the network and
    how to join it."""
    lab = netns_lab(3)
    lab.mcast_block()
    key = SwarmKey(os.urandom(32))
    first = join(lab, 0, key, model_dir)
    await until(lambda: (read_status(lab, 0) or {}).get("signaling_port"), FORM_S, "host0 hosting", [first])
    hint = await first.wait_for(lambda e: "no swarm found by mDNS" in e.get("line", ""), 10)
    assert "multicast may be blocked" in hint["line"] and "--signal HOST:PORT" in hint["line"], hint
    port = read_status(lab, 0)["signaling_port"]
    second = join(lab, 1, key, model_dir, "--signal", f"{lab.addresses[0]}:{port}")
    state = await healed(lab, [first, second], 2, "multicast blocked, --signal given", time.monotonic())
    answer = await ask(lab, 1 - state["coordinator"], state["coordinator"], state["api_port"], key.api_token, PROMPT)
    assert answer["event"] == "done" and answer["text"] == expected
    assert slow_callbacks([first, second]) == []

    lab.mcast_block(False)
    stranger = join(lab, 2, None, model_dir)
    hint = await stranger.wait_for(lambda e: "another swarm is on this network" in e.get("line", ""), FORM_S)
    assert key.swarm_id in hint["line"] and "--key CODE" in hint["line"], hint


def moe_gguf_with_real_tokenizer(out, *, layers: int = 4, experts: int = 32, hidden: int = 256,
                                 expert_ffn: int = 256):
    """A random OLMoE GGUF (Q8_0 weights, routers scaled so top-k is decisive) carrying the
    default model's tokenizer and chat template (49,152 tokens, 48,900 merges): ~56 MB, yet its
    metadata takes seconds to parse, as a 1 GB model's does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from swarm.compute.default_model import default_model_path
    from tests.compute.tiny_gguf import write_gguf_from_hf
    from tests.compute.tiny_models import ROUTER_SCALE, TINY

    source = gguf.GGUFReader(default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    config = AutoConfig.for_model("olmoe", **dict(
        TINY["olmoe"][0], vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_ffn,
        num_hidden_layers=layers, num_experts=experts, num_attention_heads=4, num_key_value_heads=4))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager",
                                          attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    bare = write_gguf_from_hf(hf, "olmoe", out.with_name(out.stem + "-bare.gguf"), qtype=gguf.GGMLQuantizationType.Q8_0)
    weights = gguf.GGUFReader(bare)
    writer = gguf.GGUFWriter(str(out), "olmoe")
    fields = [f for f in weights.fields.values() if not f.name.startswith(("GGUF.", "general.architecture"))]
    fields += [f for f in source.fields.values() if f.name.startswith("tokenizer.")]
    for f in fields:
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in weights.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    bare.unlink()
    return out


async def test_three_peers_with_a_slow_to_parse_model_form_one_swarm(netns_lab, tmp_path):
    """Three peers whose model takes seconds to index start together: one swarm, a generation
    equal to the local run, and no slow callback on any event loop."""
    model = moe_gguf_with_real_tokenizer(tmp_path / "moe-real-tokenizer.gguf")
    expected_text = reference(model, PROMPT)
    lab = netns_lab(3)
    key = SwarmKey(os.urandom(32))
    procs = [join(lab, i, key, model) for i in range(3)]
    state = await healed(lab, procs, 3, "joining together with a slow-to-parse model", time.monotonic(),
                         bound_s=FORM_SLOW_S)
    assert lone_coordinators(procs) == []
    answer = await ask(lab, (state["coordinator"] + 1) % 3, state["coordinator"], state["api_port"],
                       key.api_token, PROMPT)
    assert answer["event"] == "done" and answer["text"] == expected_text, answer
    assert slow_callbacks(procs) == []
