"""``colibri-swarm status``: a real swarm of three peers (aiohttp signaling, aiortc links, in a
network namespace) writes its status files; the view of a worker's file names every peer whole
with its role, the plan and each share in words, within 80 columns; the events say who linked
and who coordinates; the coordinator's file carries what it measured.
"""

from __future__ import annotations

import asyncio
import io
import re

import pytest
from rich.console import Console

from swarm.peer.status import compress_ints, describe_share, read_status, render, share_fraction
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import build, greedy
from tests.peer.test_swarm_loopback import ADDRESS, agreed, start_swarm, until

pytestmark = pytest.mark.slow


def _text(doc, **kw) -> str:
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False, color_system=None).print(render(doc, **kw))
    return out.getvalue()


def test_compressed_words_of_a_plan():
    plan = {"version": 3, "term": 1, "coordinator": "c", "peers": ["c", "w"],
            "experts": {"0": [["c", 0, 5], ["w", 5, 8]], "2": [["c", 0, 5], ["w", 5, 8]]},
            "dense": {"1": [["c", 0, 1024], ["w", 1024, 1536]], "3": [["w", 0, 1536]]}}
    assert compress_ints([7, 0, 1, 2, 5, 3, 9, 10]) == "0–3, 5, 7, 9–10"
    assert describe_share(plan, "w") == ("layer 0: experts 5–7 · layer 1: MLP rows 1024–1536 · "
                                         "layer 2: experts 5–7 · layer 3: MLP rows 0–1536")
    assert describe_share(plan, "c") == "layer 0: experts 0–4 · layer 1: MLP rows 0–1024 · layer 2: experts 0–4"
    assert describe_share(plan, "x") == "nothing"
    same = {"dense": {str(layer): [["c", 0, 1274], ["w", 1274, 1536]] for layer in range(30)}}
    assert describe_share(same, "w") == "layers 0–29: MLP rows 1274–1536"
    assert share_fraction(plan, "w") == pytest.approx((3 / 8 + 512 / 1536 + 3 / 8 + 1) / 4)
    assert share_fraction(plan, "c") + share_fraction(plan, "w") == pytest.approx(1)
    staged = {**same, "stages": [["s", 10, 20]]}  # a stage runs its layers whole: they leave the spans
    assert describe_share(staged, "s") == "layers 10–19: whole (attention, KV cache, MLP)"
    assert describe_share(staged, "w") == "layers 0–9: MLP rows 1274–1536 · layers 20–29: MLP rows 1274–1536"
    assert share_fraction(staged, "s") == pytest.approx(1 / 3)


def test_status_of_a_worker_shows_the_swarm_within_80_columns(tmp_path):
    model_dir = build("qwen3_moe", tmp_path)  # MoE layers 0 and 2, dense layer 1

    async def main():
        server, peers = await start_swarm(tmp_path, model_dir, [1.0, 2.0, 3.0])
        try:
            await until(lambda: agreed(peers) == peers[2].node.peer_id, 30, "the most capable peer coordinating")
            coord = peers[2]
            await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.ffn)  # some measured work
            for p in peers:
                p.node._refresh_status()
            return [read_status(tmp_path / f"status{i}.json") for i in range(3)]
        finally:
            for p in peers:
                await p.stop()
            await server.stop()

    worker, _, coord = run_in_netns(main, timeout_s=240, prefix="css", address=ADDRESS)
    ids = {d["name"]: d["peer_id"] for d in (worker, coord)} | {p["name"]: p["peer_id"] for p in worker["peers"]}
    # The worker learnt the plan from the coordinator: roles and shares, not blank.
    plan = worker["placement"]
    assert plan["coordinator"] == coord["peer_id"] and plan["version"] >= 1
    assert set(plan["peers"]) == set(ids.values())
    if plan["version"] == coord["placement"]["version"]:
        assert (plan["experts"], plan["dense"]) == (coord["placement"]["experts"], coord["placement"]["dense"])
    events = [(e["what"], e["peer_id"]) for e in worker["events"]]
    assert ("coordinator changed", coord["peer_id"]) in events
    assert {("link up", ids["peer1"]), ("link up", ids["peer2"])} <= set(events)
    # The coordinator measured its workers and knows what each holds.
    observed = coord["observed"]["peers"]
    assert {ids["peer0"], ids["peer1"]} <= set(observed)
    assert all(observed[ids[n]]["weight_bytes"] > 0 and observed[ids[n]]["requests"] > 0 for n in ("peer0", "peer1"))
    assert any(e["what"] == "replanned" for e in coord["events"])

    text = _text(worker, events=8, width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    for peer_id in ids.values():  # whole ids: nothing cut to "kydzk…"
        assert re.search(rf"(^|\s){peer_id}(\s|$)", text, re.M), (peer_id, text)
    assert "…" not in text
    row = {name: next(line for line in lines if line.strip().startswith(name)) for name in ("peer0", "peer1", "peer2")}
    assert "coordinator" in row["peer2"] and "worker" in row["peer0"] and "worker" in row["peer1"], text
    for name in ("peer0", "peer1", "peer2"):  # each share in words, e.g. "layer 0: experts 6–7 · …"
        assert f"  {name}: {describe_share(plan, ids[name])}\n" in text, (name, text)
    assert f"plan v{plan['version']} of term {plan['term']}, coordinator peer2" in text
    assert "events" in text and "coordinator changed" in text


def test_status_watch_redraws_until_interrupted(tmp_path):
    """`colibri-swarm status --watch` in a terminal: the view of the live status file, redrawn,
    and a clean exit on Ctrl-C (SIGINT)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    doc = {"pid": os.getpid(), "updated": time.time() + 60, "swarm_id": "59a5996c7f649f5e", "peer_id": "p" * 26,
           "name": "laptop", "role": "coordinator", "hosting_signaling": True, "system": "Darwin",
           "ffn_gflops": 12.5, "memory_budget": 8 << 30,
           "peers": [{"peer_id": "q" * 26, "name": "pixel", "kind": "browser", "linked": True, "rtt_ms": 4.2,
                      "memory_budget": 1 << 30, "ffn_gflops": 3.0}],
           "placement": {"version": 2, "term": 5, "coordinator": "p" * 26, "peers": ["p" * 26, "q" * 26],
                         "dense": {str(i): [["p" * 26, 0, 1274], ["q" * 26, 1274, 1536]] for i in range(30)}},
           "events": [{"t": time.time(), "what": "replanned", "peer_id": "", "name": "", "detail": "plan v2"}]}
    (tmp_path / "status.json").write_text(json.dumps(doc))
    env = {**os.environ, "COLIBRI_SWARM_CONFIG_DIR": str(tmp_path), "COLUMNS": "80", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "status", "--watch"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Ctrl-C only once two views are drawn: a signal during the interpreter's start-up (seconds on a
    # loaded machine) is not what this test is about.
    shown, deadline = [], time.monotonic() + 60
    while sum(line.startswith("-- ") for line in shown) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        shown.append(line)
    assert proc.poll() is None, proc.communicate()  # still watching
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    out = "".join(shown) + out
    assert proc.returncode == 0, err
    assert "pixel" in out and "phone" in out and "Mac" in out and "coordinator" in out
    assert "q" * 26 in out and "pixel: layers 0–29: MLP rows 1274–1536" in out
    assert "replanned" in out and "Traceback" not in err


def test_a_gpu_peer_is_shown_with_its_adapter():
    """A GPU peer (join --gpu) announces its adapter in its build; status names it under the machine."""
    from swarm.peer.net.messages import NumericBuild
    from swarm.peer.status import peer_kind

    gpu = NumericBuild("0.1.0", "2.0", "wgpu 0.32.0 Metal kernels:q4_0,q4_k adapter:Apple M2 Pro", "arm64", "f32")
    assert gpu.gpu_adapter == "Apple M2 Pro"
    for blas in ("openblas 0.3.27", "webgpu kernels:q4_0,q4_k", "wgpu 0.32.0 Vulkan kernels:q4_0"):
        assert NumericBuild("0.1.0", "2.0", blas, "x86_64", "f32").gpu_adapter is None, blas
    doc = {"peer_id": "me", "system": "Linux", "gpu": None}
    assert peer_kind({"peer_id": "p", "kind": "python", "arch": "arm64", "gpu": gpu.gpu_adapter}, doc) == \
        "Mac\nGPU Apple M2 Pro"
    assert peer_kind({"peer_id": "me", "kind": "python"}, {**doc, "gpu": "llvmpipe"}) == "Linux\nGPU llvmpipe"
    assert peer_kind({"peer_id": "q", "kind": "python", "arch": "x86_64"}, doc) == "Linux"


def test_status_says_why_a_page_stands_by():
    """A page the plan gives no work is listed with the coordinator's reason, not left blank."""
    doc = {"peer_id": "me", "name": "mac", "role": "coordinator", "swarm_id": "s", "system": "Darwin",
           "peers": [{"peer_id": "pg", "name": "pixel", "kind": "browser", "linked": True, "rtt_ms": 3.0}],
           "placement": {"version": 2, "term": 1, "coordinator": "me", "peers": [],
                         "standby": {"pg": {"reason": "fits_python_peers",
                                            "message": "the model fits the Python peers (1 peer, 1.0 GiB offered)"}}}}
    out = _text(doc)
    assert "pixel: standing by — the model fits the Python peers (1 peer, 1.0 GiB offered)" in out


def test_status_says_a_gpu_peer_computes_on_its_cpu():
    """A GPU peer whose work passes its GPU memory (the plan's ``on_cpu``) is shown computing on its
    CPU under its adapter; one whose work fits is not."""
    gpu = {"kind": "python", "linked": True, "rtt_ms": 1.0, "arch": "x86_64", "gpu": "RTX 3050"}
    doc = {"peer_id": "me", "name": "mac", "role": "coordinator", "swarm_id": "s", "system": "Darwin",
           "peers": [{**gpu, "peer_id": "small", "name": "laptop"}, {**gpu, "peer_id": "big", "name": "tower"}],
           "placement": {"version": 2, "term": 1, "coordinator": "me", "peers": [], "on_cpu": ["small"]}}
    rows = [line for line in _text(doc).splitlines() if "GPU RTX 3050" in line or "on its CPU" in line]
    assert len(rows) == 3 and "on its CPU" in rows[1]


def test_status_lists_the_plan_in_layer_order():
    """The plan's lines (and the dashboard's rows, through ``shares``' order) follow the layers: by
    the first layer each peer works on — a stage's start, a range's layer — then by where its part of
    that layer starts; peers without work last. Once this peer came first whatever layers it ran."""
    from swarm.peer.status import shares

    peer = {"kind": "python", "linked": True, "rtt_ms": 1.0}
    doc = {"peer_id": "me", "name": "mac", "role": "coordinator", "swarm_id": "s", "system": "Darwin",
           "peers": [{**peer, "peer_id": "w1", "name": "alpha"}, {**peer, "peer_id": "w2", "name": "zulu"},
                     {**peer, "peer_id": "w3", "name": "idle"}],
           "placement": {"version": 2, "term": 1, "coordinator": "me", "peers": ["me", "w1", "w2"],
                         "stages": [["me", 8, 16], ["w1", 16, 24], ["w2", 0, 8]]}}
    lines = [line.strip() for line in _text(doc).splitlines() if ": layers " in line]
    assert lines == ["zulu: layers 0–7: whole (attention, KV cache, MLP)",
                     "mac: layers 8–15: whole (attention, KV cache, MLP)",
                     "alpha: layers 16–23: whole (attention, KV cache, MLP)"]
    assert shares(doc["placement"], ["me", "w1", "w2", "w3"])["order"] == ["w2", "me", "w1", "w3"]
    ranges = {**doc, "placement": {"version": 3, "term": 1, "coordinator": "me", "peers": ["me", "w1", "w2"],
                                   "experts": {"0": [["w1", 0, 3], ["me", 3, 6], ["w2", 6, 8]],
                                               "1": [["w1", 0, 3], ["me", 3, 6], ["w2", 6, 8]]}}}
    lines = [line.strip() for line in _text(ranges).splitlines() if ": layers " in line]
    assert [line.split(":")[0] for line in lines] == ["alpha", "mac", "zulu"]
    assert shares(ranges["placement"], ["me", "w2", "w1", "w3"])["order"] == ["w1", "me", "w2", "w3"]


def test_status_says_what_a_file_no_live_peer_keeps_names_and_what_to_do(tmp_path):
    """A status file no live peer keeps: whether a peer runs from its directory is the directory
    lock's word, not the file's pid. Copied with a config directory from another machine, it says
    so (once it said the copy's pid was 'not running', a pid of that other machine); a peer that
    stopped, a pid that is another process now, and a peer that runs but is stalled, each in words."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from swarm.errors import SwarmError
    from swarm.peer.status import STALE_AFTER_S

    here = socket.gethostname()
    path = tmp_path / "status.json"

    def said(**fields) -> str:
        doc = {"pid": os.getpid(), "host": here, "updated": 1000.0, "peers": [], **fields}
        path.write_text(json.dumps(doc))
        with pytest.raises(SwarmError) as caught:
            read_status(path, now=1000.0 + 7200)
        return str(caught.value)

    copied = said(host="studio-mac", pid=4242)
    assert f"written 2 h ago on a machine named 'studio-mac' (pid 4242; this one is named {here!r})" in copied
    assert (f"the configuration directory {tmp_path} was copied from another machine, or this one's name changed, "
            "and no peer runs from it here") in copied
    assert copied.endswith("if only the name changed, just start a peer with `colibri-swarm join`")
    assert f"delete {tmp_path / 'identity.pem'}" in copied and "COLIBRI_SWARM_CONFIG_DIR" in copied
    assert "not running" not in copied
    gone = said(pid=2**22 + 12345)  # above pid_max: no such process
    assert gone == (f"no peer runs from {tmp_path}: the peer that wrote its status file (pid {2**22 + 12345}) stopped "
                    "2 h ago; start a peer with `colibri-swarm join`")
    assert "or the file was copied" in said(pid=2**22 + 12345, host=None)  # a file of an older version: no host
    reused = said()  # this test's own pid: alive, but not a peer of that directory
    assert f"pid {os.getpid()}, which wrote it, is another process on this machine now: the peer stopped" in reused

    lock = ("import sys, time; from pathlib import Path; from swarm import paths; "
            "paths.lock_config_dir(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", lock, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        stalled = said(pid=holder.pid, updated=1000.0 + 7200 - STALE_AFTER_S - 10)
        assert stalled.startswith(f"the peer (pid {holder.pid}) running from {tmp_path} has not updated its status "
                                  "for 15 s: it is stopped (SIGSTOP")
        assert said(pid=2**22 + 12345).startswith(f"a peer (pid {holder.pid}) runs from {tmp_path} but has not "
                                                  "written its status yet")
        assert f"A peer runs from it here (pid {holder.pid})" in said(host="studio-mac")
    finally:
        holder.kill()
        holder.wait()


def test_status_names_the_workers_of_a_stage_plan_and_of_a_mix():
    """Under stages the coordinator's per-layer plan holds it alone (``peers``: itself, every
    layer's span its own); the stage workers are workers all the same, in the role column and in
    ``shares``' workers. Under a mix the coordinator's stage's FFN is cut into ranges: a worker
    with a range there and no stage is a worker too, and its share names its rows."""
    from swarm.peer.status import plan_workers, shares

    peer = {"kind": "python", "linked": True, "rtt_ms": 1.0}
    doc = {"peer_id": "me", "name": "mac", "role": "coordinator", "swarm_id": "s", "system": "Darwin",
           "peers": [{**peer, "peer_id": "w1", "name": "alpha"}, {**peer, "peer_id": "w2", "name": "zulu"},
                     {**peer, "peer_id": "w3", "name": "idle"}],
           "placement": {"version": 8, "term": 8, "coordinator": "me", "peers": ["me"], "layout": "stages",
                         "dense": {str(i): [["me", 0, 1536]] for i in range(30)},
                         "stages": [["me", 0, 6], ["w1", 6, 14], ["w2", 14, 30]]}}
    assert _roles(_text(doc)) == {"mac": "coordinator", "alpha": "worker", "zulu": "worker", "idle": ""}
    assert plan_workers(doc["placement"]) == ["w1", "w2"]
    assert shares(doc["placement"], ["me", "w1", "w2", "w3"])["workers"] == ["w1", "w2"]
    assert describe_share(doc["placement"], "me") == "layers 0–5: whole (attention, KV cache, MLP)"
    mix = {**doc["placement"], "layout": "mix", "peers": ["me", "w1", "w3"],
           "dense": {**doc["placement"]["dense"],
                     **{str(i): [["me", 0, 1024], ["w1", 1024, 1280], ["w3", 1280, 1536]] for i in range(6)}}}
    assert plan_workers(mix) == ["w1", "w3", "w2"]  # in layer order: w3's rows of layer 0 before w2's stage
    assert describe_share(mix, "w3") == "layers 0–5: MLP rows 1280–1536"
    assert describe_share(mix, "w1") == "layers 0–5: MLP rows 1024–1280 · layers 6–13: whole (attention, KV cache, MLP)"
    assert describe_share(mix, "me") == "layers 0–5: MLP rows 0–1024"
    assert share_fraction(mix, "me") + share_fraction(mix, "w1") + share_fraction(mix, "w2") + share_fraction(
        mix, "w3") == pytest.approx(1)
    assert _roles(_text({**doc, "placement": mix})) == {"mac": "coordinator", "alpha": "worker", "zulu": "worker",
                                                        "idle": "worker"}


def _roles(text: str) -> dict[str, str]:
    """name → the role column of each peer's row of ``status``'s table (a row's first line: its kind's)."""
    lines = text.splitlines()
    header = next(line for line in lines if line.split()[:3] == ["peer", "kind", "role"])
    kind, role, rtt = header.index("kind"), header.index("role"), header.index("RTT")
    table = lines[lines.index(header) + 1:]
    table = table[:next((i for i, line in enumerate(table) if not line.startswith(" ")), len(table))]
    rows = [line for line in table if line[kind:role].strip()]
    return {line.split()[0]: line[role:rtt].strip() for line in rows}
