"""Identity and CLI-form faults on namespaced peers: real ``colibri-swarm join`` processes.

* A copied config directory (a cloned VM, a copied home) on a second machine: its ``join`` is
  refused by the signaling server and exits naming the identity file to delete; the first peer
  keeps its place and logs who claimed its id. Never two processes taking turns as one peer.
  Two clones started together (both host a server at first) end the same way: one stays.
* ``join`` twice on one HOME: the second exits at once naming the first; the first goes on.
* Multicast blocked on the bridge (guest Wi-Fi): peers given the host's address in each
  documented ``--signal`` form (``HOST:PORT``, ``https://HOST:PORT``, ``wss://HOST:PORT/ws``)
  form one swarm with one coordinator and stay up (the page-URL code once ended them with
  code 2 right after connecting unless the form was ``wss://``).

Bounds (docs/reliability.md): the refused copy exits within ``DUPLICATE_EXIT_S`` of starting;
the ``--signal`` peers are linked and planned within ``SIGNAL_SWARM_S``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import pytest

from swarm.paths import write_private
from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from tests.multihost.test_mesh_multihost import linked, read_status, until
from tests.multihost.test_swarm_multihost import coordinator_of
from tests.peer._swarm_models import add_char_tokenizer, build

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

DUPLICATE_EXIT_S = 30.0  # discovery (≤ 2 s), or hosting and then moving to the older server
SECOND_JOIN_EXIT_S = 30.0  # mostly the interpreter's imports on a loaded machine
SIGNAL_SWARM_S = 90.0
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny OLMoE with a character tokenizer (built once: transformers leaves a progress-bar
    thread behind, which belongs to the module, not to one test)."""
    return add_char_tokenizer(build("olmoe", tmp_path_factory.mktemp("model")))


def join(lab, i: int, code: str, *extra: str, name: str | None = None):
    return lab.spawn(i, ["-m", "swarm", "-v", "join", "--no-model", "--key", code, "--name", name or f"host{i}",
                         *extra], env=ONE_THREAD)


async def exit_code_within(proc, seconds: float) -> int | None:
    """The process's exit code once it ends, or None when it is still running after ``seconds``."""
    deadline = time.monotonic() + seconds
    while proc.popen.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return proc.popen.poll()


def stdout_lines(proc) -> list[str]:
    proc.poll()
    return [e.get("line", "") for e in proc.events]


async def test_a_copied_identity_is_refused_by_name_and_the_original_keeps_its_place(netns_lab):
    lab = netns_lab(2)
    code = SwarmKey(os.urandom(32)).code
    original = join(lab, 0, code)
    await until(lambda: read_status(lab, 0) is not None, 60, "the first peer to start", [original])
    doc = read_status(lab, 0)
    # the second machine gets a copy of the first one's config directory (key, identity, TLS cert)
    src, dst = lab.workdir / "ns0" / "config", lab.workdir / "ns1" / "config"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("status.json", "peer.lock", ".*"))
    copy = join(lab, 1, code, name="clone")

    t0 = time.monotonic()
    returncode = await exit_code_within(copy, DUPLICATE_EXIT_S)
    print(json.dumps({"event": "copy refused", "seconds": round(time.monotonic() - t0, 2)}))
    stderr = copy.stderr_tail()
    assert returncode is not None and returncode != 0, f"the copy kept running ({returncode}):\n{stderr}"
    assert "another machine uses this peer identity" in stderr, stderr
    assert f"delete {dst / 'identity.pem'}" in stderr, stderr
    assert "Traceback" not in stderr, stderr

    # the original never left: same peer, still hosting, still writing its status, and it was told
    assert original.popen.poll() is None, original.stderr_tail()
    await until(lambda: read_status(lab, 0) is not None and read_status(lab, 0)["updated"] > time.time() - 2, 10,
                "the original peer to stay live", [original])
    now = read_status(lab, 0)
    assert now["peer_id"] == doc["peer_id"] and now["pid"] == doc["pid"] and now["hosting_signaling"]
    await until(lambda: "duplicate-peer" in original.stderr_tail(20000), 10,
                "the original to log the refused claim on its id", [original])
    assert lab.addresses[1] in original.stderr_tail(20000)


async def test_two_clones_started_together_end_with_one_peer_not_two_swarms(netns_lab):
    """Cloned VMs that boot together: both find no server and host one; the younger host must
    not take the older one's record for its own (same peer id) but try it, be refused and exit."""
    lab = netns_lab(2)
    code = SwarmKey(os.urandom(32)).code
    pem = Identity.generate().to_pem()
    for i in (0, 1):
        config = lab.workdir / f"ns{i}" / "config"
        config.mkdir(parents=True)
        write_private(config / "identity.pem", pem)
    procs = [join(lab, i, code) for i in (0, 1)]
    t0 = time.monotonic()
    while all(p.popen.poll() is None for p in procs) and time.monotonic() < t0 + DUPLICATE_EXIT_S:
        await asyncio.sleep(0.1)
    print(json.dumps({"event": "one clone left", "seconds": round(time.monotonic() - t0, 2)}))
    ended = [i for i, p in enumerate(procs) if p.popen.poll() is not None]
    assert len(ended) == 1, "\n".join(f"--- {p.namespace} ({p.popen.poll()}):\n{p.stderr_tail()}" for p in procs)
    gone, kept = ended[0], 1 - ended[0]
    stderr = procs[gone].stderr_tail()
    assert procs[gone].popen.returncode != 0 and "another machine uses this peer identity" in stderr, stderr
    assert f"delete {lab.workdir / f'ns{gone}' / 'config' / 'identity.pem'}" in stderr, stderr
    await until(lambda: read_status(lab, kept) is not None and read_status(lab, kept)["hosting_signaling"], 10,
                "the other clone to stay, hosting", [procs[kept]])
    await asyncio.sleep(2)
    assert procs[kept].popen.poll() is None, procs[kept].stderr_tail()


async def test_a_second_join_on_one_home_exits_naming_the_first(netns_lab):
    lab = netns_lab(1)
    code = SwarmKey(os.urandom(32)).code
    first = join(lab, 0, code)
    await until(lambda: read_status(lab, 0) is not None, 60, "the first peer to start", [first])
    key_file = lab.workdir / "ns0" / "config" / "swarm.key"
    stored = key_file.read_bytes()
    second = join(lab, 0, SwarmKey(os.urandom(32)).code, name="again")  # another --key, even

    t0 = time.monotonic()
    returncode = await exit_code_within(second, SECOND_JOIN_EXIT_S)
    print(json.dumps({"event": "second join refused", "seconds": round(time.monotonic() - t0, 2)}))
    stderr = second.stderr_tail()
    assert returncode is not None and returncode != 0, f"the second join kept running ({returncode}):\n{stderr}"
    config = lab.workdir / "ns0" / "config"
    line = f"colibri-swarm: error: another colibri-swarm peer (pid {first.popen.pid}) already runs from {config}"
    assert line in stderr, stderr
    assert "Traceback" not in stderr, stderr

    assert first.popen.poll() is None, first.stderr_tail()
    assert key_file.read_bytes() == stored  # the running peer's swarm key was not replaced
    doc = read_status(lab, 0)
    assert doc is not None and doc["pid"] == first.popen.pid and doc["name"] == "host0"
    await until(lambda: read_status(lab, 0) is not None and read_status(lab, 0)["updated"] > time.time() - 2, 10,
                "the first peer to keep writing its status", [first])


async def test_every_signal_form_forms_one_swarm_with_multicast_blocked(netns_lab, model_dir):
    lab = netns_lab(4)
    lab.mcast_block()
    code = SwarmKey(os.urandom(32)).code
    host = lab.spawn(0, ["-m", "swarm", "-v", "join", "--model", str(model_dir), "--key", code, "--name", "host0",
                         "--layout", "ranges"],
                     env=ONE_THREAD)
    await until(lambda: read_status(lab, 0) is not None and read_status(lab, 0)["signaling_port"], 60,
                "the first peer to host signaling", [host])
    port = read_status(lab, 0)["signaling_port"]
    address = lab.addresses[0]
    # what the host prints for peers that mDNS does not reach
    await until(lambda: any(f"--signal {address}:{port}" in line for line in stdout_lines(host)), 10,
                "the host to print its --signal address", [host])

    forms = [f"{address}:{port}", f"https://{address}:{port}", f"wss://{address}:{port}/ws"]
    procs = [host] + [join(lab, i, code, "--signal", form) for i, form in enumerate(forms, start=1)]
    docs = lambda: {i: read_status(lab, i) for i in range(4)}  # noqa: E731

    def one_swarm() -> bool:
        d = docs()
        if not all(d.values()):
            return False
        ids = {doc["peer_id"] for doc in d.values()}
        return (len(ids) == 4 and all(linked(doc) == ids - {doc["peer_id"]} for doc in d.values())
                and coordinator_of(d) is not None)

    took = await until(one_swarm, SIGNAL_SWARM_S, "four peers linked, one coordinator planning over the three", procs)
    print(json.dumps({"event": "--signal swarm formed", "seconds": round(took, 2)}))
    d = docs()
    assert coordinator_of(d)[0] == 0  # the only peer holding the model
    assert [i for i, doc in d.items() if doc["role"] == "coordinator"] == [0]
    assert all(doc["signaling_host"] == d[0]["peer_id"] for doc in d.values())
    for i, proc in enumerate(procs[1:], start=1):
        assert proc.popen.poll() is None, f"--signal {forms[i - 1]} ended the peer:\n{proc.stderr_tail()}"
        # the page URL (what used to end these peers) points at the host
        assert any(f"https://{address}:{port}/#" in line for line in stdout_lines(proc)), stdout_lines(proc)
