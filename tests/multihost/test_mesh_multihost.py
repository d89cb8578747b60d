"""``colibri-swarm join`` in three network namespaces on one bridge: real processes, real mDNS
multicast, real WebRTC; no address given anywhere.

Checks that the peers find each other and open authenticated links (each status file lists
the two others as linked), that ``colibri-swarm status --json`` reports it, and that killing
the signaling host's process (SIGKILL, like a pulled plug) lets the swarm re-form within 10 s:
a survivor hosts signaling anew, both survivors are on it, linked to each other, and the
dead peer is gone from their view; the new host prints its server's port and certificate
(the addresses printed at start are dead). Then Ctrl-C on a survivor ends it cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from swarm.keys.swarmkey import SwarmKey

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

REFORM_S = 10.0


def read_status(lab, i: int) -> dict | None:
    path = lab.workdir / f"ns{i}" / "config" / "status.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if time.time() - doc["updated"] < 3 else None


def linked(doc: dict | None) -> set[str]:
    return {p["peer_id"] for p in doc["peers"] if p["linked"]} if doc else set()


def stuck_report(procs) -> str:
    """What a timed-out wait shows: each peer's state in one line, then each one's log tail, then
    the stacks of its threads (asked for by SIGUSR1 after the rest was read)."""
    lines = "\n".join(p.diagnosis() for p in procs)
    tails = "\n".join(f"--- {p.namespace}:\n{p.stderr_tail(4000)}" for p in procs)
    sizes = [p.log_size() for p in procs]
    for p in procs:
        p.dump_stacks()
    time.sleep(0.5)  # the dumps are written by each peer's signal handler
    stacks = "\n".join(f"--- {p.namespace} stacks:\n{p.log_since(size, 12000)}" for p, size in zip(procs, sizes)
                       if p.popen.poll() is None)
    return f"{lines}\n{tails}\n{stacks}"


async def until(predicate, timeout_s: float, what: str, procs) -> float:
    """Seconds it took for ``predicate()`` to hold; fails with the peers' stderr when it does not."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{stuck_report(procs)}")
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_join_in_three_namespaces_forms_a_mesh_and_reforms_without_the_host(netns_lab):
    lab = netns_lab(3)
    code = SwarmKey(os.urandom(32)).code
    procs = [lab.spawn(i, ["-m", "swarm", "-v", "join", "--no-model", "--key", code, "--name", f"host{i}"]) for i in range(3)]

    def statuses():
        return [read_status(lab, i) for i in range(3)]

    def full_mesh() -> bool:
        docs = statuses()
        if not all(docs):
            return False
        ids = {d["peer_id"] for d in docs}
        return len(ids) == 3 and all(linked(d) == ids - {d["peer_id"]} for d in docs)

    await until(full_mesh, 40, "three peers linked to each other", procs)
    docs = statuses()
    ids = [d["peer_id"] for d in docs]
    assert len({d["swarm_id"] for d in docs}) == 1 and docs[0]["swarm_id"] == SwarmKey.from_code(code).swarm_id
    hosts = [i for i, d in enumerate(docs) if d["hosting_signaling"]]
    assert len(hosts) == 1, docs
    host = hosts[0]
    assert all(d["signaling_host"] == ids[host] for d in docs)
    for d in docs:
        for p in d["peers"]:
            assert p["kind"] == "python" and p["name"] == f"host{ids.index(p['peer_id'])}"

    # the command a user types reads the same view
    env = lab.env(0)
    out = subprocess.run(["ip", "netns", "exec", lab.namespaces[0], sys.executable, "-m", "swarm", "status", "--json"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=lab.workdir)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["peer_id"] == ids[0] and {p["peer_id"] for p in shown["peers"] if p["linked"]} == set(ids) - {ids[0]}

    # pull the plug on the signaling host
    survivors = [i for i in range(3) if i != host]
    printed = {i: (procs[i].poll(), len(procs[i].events))[1] for i in survivors}  # each one's lines so far
    procs[host].kill()

    def reformed() -> bool:
        docs = statuses()
        if not all(docs[i] for i in survivors):
            return False
        a, b = (docs[i] for i in survivors)
        hosting = [d for d in (a, b) if d["hosting_signaling"]]
        return (
            len(hosting) == 1
            and a["signaling_host"] == b["signaling_host"] == hosting[0]["peer_id"]
            and linked(a) == {b["peer_id"]} and linked(b) == {a["peer_id"]}
            and all(ids[host] not in {p["peer_id"] for p in d["peers"]} for d in (a, b))
        )

    took = await until(reformed, REFORM_S, "the swarm to re-form without its signaling host", procs)
    print(json.dumps({"event": "reformed", "seconds": round(took, 2)}))

    # the peer that took hosting over prints its new server (the addresses the first host printed
    # are dead): port and certificate, as `join` prints them at start
    new_host = next(i for i in survivors if read_status(lab, i)["hosting_signaling"])
    doc = read_status(lab, new_host)
    line = await procs[new_host].wait_for(
        lambda e: f"hosting signaling on port {doc['signaling_port']}" in e.get("line", ""), 5, printed[new_host])
    assert doc["signaling_fingerprint"][:20] in line["line"], line

    # Ctrl-C on a survivor: a clean exit with a goodbye, its links closed (the other peer sees the
    # link go at once, well before heartbeats would time out) and its status file removed
    leaver, stayer = survivors
    os.killpg(procs[leaver].popen.pid, signal.SIGINT)
    await procs[leaver].wait_for(lambda e: "goodbye" in e.get("line", ""), timeout=15)
    assert procs[leaver].popen.wait(timeout=10) == 0, procs[leaver].stderr_tail()
    assert not (lab.workdir / f"ns{leaver}" / "config" / "status.json").exists()
    # the goodbye comes after the links were closed; heartbeats alone would take DEAD_AFTER_S (5 s)
    await until(lambda: linked(read_status(lab, stayer)) == set(), 3.0,
                "the remaining peer to see the link close", procs)
