"""Helpers for tests of links: an event loop inside a fresh network namespace, wire messages.

aioice skips 127.0.0.1, so :func:`run_in_netns` runs a coroutine's event loop in a thread that
entered a new network namespace whose loopback carries an extra /32 address (root only; CI runs
as root). The namespace is named ``csb-<random>`` (or another prefix) and always deleted.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import subprocess
import threading
import uuid

import numpy as np

from swarm.peer.net import wire
from swarm.peer.net.messages import Hello, NumericBuild, WeightChunk
from tests.conftest import require

ADDRESS = "10.213.0.1"  # the extra loopback address inside the namespace
VERSION = wire.PROTOCOL_VERSION

CLONE_NEWNET = 0x40000000


# A network that drops IP fragments (some firewalls, VPNs and Wi-Fi gear do): loopback with an
# Ethernet MTU, and no memory to reassemble fragments in (ipfrag_high_thresh is per namespace).
NO_FRAGMENT_REASSEMBLY = ("sysctl", "-q", "-w", "net.ipv4.ipfrag_low_thresh=0", "net.ipv4.ipfrag_high_thresh=1")
DROP_IP_FRAGMENTS = (("ip", "link", "set", "lo", "mtu", "1500"), NO_FRAGMENT_REASSEMBLY)


def run_in_netns(coro_factory, timeout_s: float = 60.0, *, prefix: str = "csb", address: str = ADDRESS,
                 configure=()):
    """Run ``asyncio.run(coro_factory())`` in a thread inside a new network namespace.

    The namespace is named ``<prefix>-<random>`` and its loopback carries ``address``/32;
    ``configure``: commands run inside it first (e.g. :data:`DROP_IP_FRAGMENTS`).
    """
    require(os.geteuid() == 0, "root, for network namespaces (CI runs as root)")
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{address}/32", "dev", "lo"], check=True)
        for argv in configure:
            subprocess.run(["ip", "netns", "exec", name, *argv], check=True)
        outcome: dict = {}

        def target() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            try:
                outcome["value"] = asyncio.run(asyncio.wait_for(coro_factory(), timeout_s))
            except BaseException as exc:  # re-raised in the test's thread
                outcome["error"] = exc

        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        thread.join(timeout_s + 30)  # wait_for cancels at timeout_s; this catches a stuck cancel
        if thread.is_alive():
            raise AssertionError(f"the event loop in {name} did not end within {timeout_s + 30:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def hello(peer_id: str, version: int = VERSION) -> Hello:
    build = NumericBuild(package="test", numpy=np.__version__, blas="?", arch="x86_64", kernel_dtype="f32")
    return Hello(peer_id=peer_id, protocol_version=version, build=build, model_hash=None, memory_budget=1 << 30,
                 ffn_gflops=1.0, peer_kind="python", adapter_limits={}, adapter_features=(), name=peer_id[:1])


def blob(data: bytes, request_id: int = 1) -> WeightChunk:
    """A message carrying arbitrary bytes, with their SHA-256 (checked by ``verify``)."""
    return WeightChunk(request_id=request_id, model_hash="0" * 64, name="blob", offset=0,
                       sha256=hashlib.sha256(data).hexdigest(), data=np.frombuffer(data, np.uint8))
