"""The peer node: one Python peer of the swarm (``colibri-swarm join`` runs one: swarm.cli.join).

:class:`Node` is the reusable asyncio object the election, coordinator and worker build on::

    node = Node(swarm_key=key, certificate=cert, peer_id=pid, name="laptop")
    node.on_link_up.append(lambda link: ...)        # a peer's link opened (link.hello, link.rtt_s)
    node.on_link_down.append(lambda peer_id: ...)   # it closed
    node.on(ExpertRequest, handler)                 # handler(link, message), sync or async
    await node.start()                              # returns once on a signaling server
    node.links[peer_id].send(message)               # open links by peer id
    node.set_role("coordinator")                    # shown by `colibri-swarm status`
    await node.stop()                               # links closed, tasks cancelled, mDNS goodbye

Under it: a :class:`~swarm.discovery.Rendezvous` (find the signaling server by mDNS or host
one; re-host when the host leaves) and a :class:`~swarm.peer.net.mesh.Mesh` (authenticated links to
every Python peer). The node pumps rendezvous events into the mesh, and keeps a status file
(:data:`STATUS_FILE` in the config directory, rewritten every :data:`STATUS_EVERY_S`) that
``colibri-swarm status`` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import platform
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from aiortc.rtcdtlstransport import RTCCertificate

from swarm import __version__, paths
from swarm.discovery import Connected, Rendezvous
from swarm.errors import SwarmError
from swarm.peer.net import wire
from swarm.peer.net.link import Handler, Link
from swarm.peer.net.mesh import Mesh
from swarm.peer.net.messages import INT8_KERNEL_DTYPE, Hello, NumericBuild
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.status import STATUS_EVERY_S, STATUS_FILE
from swarm.signaling.client import PeerJoined, PeerLeft, SignalReceived, SignalRefused
from swarm.signaling.relay import DUPLICATE_NOTICE

log = logging.getLogger(__name__)

EVENTS_KEPT = 50  # the newest swarm events in the status document (dashboard, `status --watch`)
CLOSED_BY_PEER = "closed by the peer"  # a "link down" event's detail when the peer closed it (it left)


def numeric_build() -> NumericBuild:
    """What decides bit-exactness of this peer's FFN results (docs/architecture.md §5): what it
    announces it computes for a swarm, its activation numerics included (``kernel_dtype`` "f32",
    or :data:`~swarm.peer.net.messages.INT8_KERNEL_DTYPE` under the int8 numerics: a coordinator
    gives work only to peers of its own numerics, docs/weights.md "Two numerics")."""
    from swarm.compute import numerics

    blas = "unknown"
    with contextlib.suppress(Exception):
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{info.get('name', '?')} {info.get('version', '?')}"
    with contextlib.suppress(Exception):  # numba compiles every kernel: another numba, another build
        blas += f" numba {importlib.metadata.version('numba')}"
    return NumericBuild(package=__version__, numpy=np.__version__, blas=blas, arch=platform.machine(),
                        kernel_dtype=INT8_KERNEL_DTYPE if numerics.int8() else "f32")


def measure_ffn_gflops(hidden: int = 576, ffn: int = 1536, rows: int = 8, repeats: int = 5) -> float:
    """GFLOP/s of a SwiGLU MLP on this machine through the engine's own compiled kernels (float32
    weights, SmolLM2's shape by default); a few ms once the kernels are compiled and cached.

    The best of ``repeats`` runs after one warm-up (which loads or compiles the kernels):
    placement wants what the machine can do, not scheduler noise.
    """
    from swarm.compute.kernels import MLPWeights, swiglu

    rng = np.random.default_rng(0)
    scale = np.float32(hidden**-0.5)  # keeps activations O(1): no overflow in exp
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    w = MLPWeights.from_torch(rng.standard_normal((ffn, hidden), dtype=np.float32) * scale,
                              rng.standard_normal((ffn, hidden), dtype=np.float32) * scale,
                              rng.standard_normal((hidden, ffn), dtype=np.float32) * scale)
    swiglu(w, x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        swiglu(w, x)
        best = min(best, time.perf_counter() - t)
    return 3 * 2 * rows * hidden * ffn / best / 1e9


def default_memory_budget(cap_bytes: int | None = None) -> int:
    """The allowance this peer offers (bytes): what the OS, its memory cgroup and ``cap_bytes``
    (``--memory``) leave this process, less its baseline and a page-cache headroom; weights, KV
    cache and activations come out of it (swarm/peer/memory.py)."""
    from swarm.peer.memory import weight_budget

    return weight_budget(cap_bytes)


class Node:
    """One Python peer: signaling presence, authenticated links, status. See the module docstring."""

    def __init__(
        self,
        *,
        swarm_key: SwarmKey,
        certificate: RTCCertificate,
        peer_id: str,
        name: str = "",
        signal_url: str | None = None,
        model_hash: str | None = None,
        memory_budget: int | None = None,
        ffn_gflops: float | None = None,
        build: NumericBuild | None = None,
        gpu_memory: int = 0,
        status_path: Path | None = None,
        link_options: dict[str, Any] | None = None,
        rendezvous_options: dict[str, Any] | None = None,
    ) -> None:
        self.swarm_key = swarm_key
        self.peer_id = peer_id
        self.name = name or socket.gethostname()
        self.role = "peer"  # "coordinator" or "worker" once elected: set_role()
        self.placement: dict[str, Any] | None = None  # the plan as this peer knows it, for status: set_placement()
        # What the roles measured (JSON-able dict, e.g. per-peer timings), merged into status() as "observed".
        self._observer: Callable[[], dict[str, Any]] = dict
        self.activity: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)  # see record()
        self.recorded = 0  # events recorded so far (activity keeps the newest EVENTS_KEPT)
        # peer id → (name, kind) from its presence and hello, kept after it leaves: events name it
        self.known: dict[str, tuple[str, str]] = {}
        # The build this peer's CPU computes with: its Hello's, except a GPU peer's (which names its
        # wgpu build), whose share as a coordinator is computed here on the CPU.
        self.cpu_build = build if build is not None and build.gpu_adapter is None else numeric_build()
        self.hello = Hello(
            peer_id=peer_id, protocol_version=wire.PROTOCOL_VERSION, build=build or self.cpu_build,
            model_hash=model_hash,
            memory_budget=default_memory_budget() if memory_budget is None else memory_budget,
            ffn_gflops=measure_ffn_gflops() if ffn_gflops is None else ffn_gflops,
            peer_kind="python", adapter_limits={}, adapter_features=(), name=self.name[:64], gpu_memory=gpu_memory,
        )
        self.status_path = status_path or paths.config_dir() / STATUS_FILE
        self.rendezvous = Rendezvous(swarm_key.secret, peer_id, name=self.name[:64], signal_url=signal_url,
                                     **(rendezvous_options or {}))
        self.mesh = Mesh(local_hello=self.hello, certificate=certificate, auth_key=swarm_key.channel_auth_key,
                         send_signal=self.rendezvous.send_signal, accept_browsers=lambda: self.role == "coordinator",
                         link_options=link_options)
        self.mesh.on_link_up.append(self._link_up)
        self.mesh.on_link_down.append(self._link_down)
        self.started: float | None = None
        self.error: SwarmError | None = None  # why the node stopped working on its own (join exits with it)
        self._tasks: list[asyncio.Task] = []

    # -- the surface other modules build on -----------------------------------------------------

    @property
    def links(self) -> dict[str, Link]:
        """Open, authenticated links by remote peer id."""
        return self.mesh.links

    @property
    def on_link_up(self) -> list[Callable[[Link], Any]]:
        return self.mesh.on_link_up

    @property
    def on_link_down(self) -> list[Callable[[str], Any]]:
        return self.mesh.on_link_down

    def on(self, message_type: type, handler: Handler) -> None:
        """Deliver ``message_type`` from every link to ``handler(link, message)``."""
        self.mesh.on(message_type, handler)

    @property
    def swarm_id(self) -> str:
        return self.swarm_key.swarm_id

    def record(self, what: str, peer_id: str = "", name: str = "", detail: str = "") -> None:
        """Note a swarm event for status, the dashboard and ``join``'s terminal: ``what`` is e.g.
        "joined", "left", "link up", "link down", "marked down", "replanned", "coordinator
        changed", "left out" (a peer of other numerics: no work); ``t`` is Unix s; ``detail`` of
        "joined", "left" and "link up" is the peer's kind, of "link down" :data:`CLOSED_BY_PEER` when
        the peer closed the link (a peer that leaves does; "": the link was lost)."""
        self.activity.append({"t": round(time.time(), 3), "what": what, "peer_id": peer_id, "name": name,
                              "detail": detail})
        self.recorded += 1

    def activity_since(self, seen: int) -> list[dict[str, Any]]:
        """The events recorded after the first ``seen`` (those still kept), oldest first."""
        return list(self.activity)[max(len(self.activity) - (self.recorded - seen), 0):]

    def set_role(self, role: str) -> None:
        """``role``: "coordinator", "worker" or "peer" (none known), for status; a peer takes
        browser links only while it coordinates."""
        self.role = role

    def set_placement(self, placement: dict[str, Any] | None) -> None:
        """The plan as this peer knows it (JSON-able), for status; None: no plan."""
        self.placement = placement

    def update_placement(self, fields: dict[str, Any]) -> None:
        """Add ``fields`` to the placement (to an empty one if there is none)."""
        self.placement = {**(self.placement or {}), **fields}

    def set_observer(self, observer: Callable[[], dict[str, Any]]) -> None:
        """``observer()``: what the roles measured (JSON-able), merged into status() as "observed"."""
        self._observer = observer

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self, timeout: float | None = None) -> None:
        """Find (or host) the signaling server and start linking. Raises what the rendezvous raises."""
        self.started = time.time()
        await self.rendezvous.start(timeout=timeout)
        self._tasks = [asyncio.create_task(self._pump(), name="node-pump"),
                       asyncio.create_task(self._write_status_forever(), name="node-status")]

    async def stop(self) -> None:
        """Leave: close links, cancel tasks, stop the rendezvous (mDNS goodbye), remove the status file."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.mesh.close()
        await self.rendezvous.stop()
        with contextlib.suppress(FileNotFoundError, ValueError):
            if json.loads(self.status_path.read_text()).get("pid") == os.getpid():
                self.status_path.unlink()

    async def _pump(self) -> None:
        """Feed rendezvous events to the mesh until the rendezvous ends; its error, if any, is
        kept in :attr:`error` (``join`` exits with it). One bad event never ends the pump."""
        try:
            async for event in self.rendezvous:
                try:
                    await self._handle(event)
                except Exception:  # a malformed signal of one peer must not cut us off from all
                    log.exception("signaling event %s could not be handled", type(event).__name__)
        except SwarmError as exc:
            self.error = exc
            raise
        if self.error is None and self._tasks:
            self.error = SwarmError("the signaling connection ended for good")

    async def _handle(self, event: Any) -> None:
        match event:
            case Connected(peers=peers):
                log.info("on signaling server %s (host %s%s)", event.url, event.host,
                         ", ours" if event.hosting else "")
                self.known.update({p.peer_id: (p.name, p.kind) for p in peers})
                self.mesh.sync(peers)
                self._refresh_status()
            case PeerJoined(peer=info):
                self.known[info.peer_id] = (info.name, info.kind)
                self.mesh.peer_joined(info)
                self.record("joined", info.peer_id, info.name, info.kind)
            case PeerLeft(peer_id=peer_id):
                self.mesh.peer_left(peer_id)
                name, kind = self.known.get(peer_id, ("", "?"))  # the presence list has dropped it already
                self.record("left", peer_id, name, kind)
            case SignalReceived(sender=sender, data=data):
                await self.mesh.handle_signal(sender, data)
            case SignalRefused(code=code, detail=detail):
                log.log(logging.WARNING if code == DUPLICATE_NOTICE else logging.INFO, "signaling: %s %s", code, detail)

    def _link_up(self, link: Link) -> None:
        hello = link.hello
        if hello is not None and link.peer_id:
            self.known[link.peer_id] = (hello.name, hello.peer_kind)
        self.record("link up", link.peer_id or "?", hello.name if hello else "", hello.peer_kind if hello else "")
        self._refresh_status()

    def closed_by_peer(self, peer_id: str) -> bool:
        """Whether the last link to ``peer_id`` that went down was closed by that peer, as a peer
        that leaves does, rather than lost (:meth:`Mesh.closed_by_peer`)."""
        return self.mesh.closed_by_peer(peer_id)

    def _link_down(self, peer_id: str) -> None:
        self.record("link down", peer_id, self.known.get(peer_id, ("", ""))[0],
                    CLOSED_BY_PEER if self.closed_by_peer(peer_id) else "")
        self._refresh_status()

    def _refresh_status(self) -> None:
        """Write the status file now (the writer task also refreshes it every STATUS_EVERY_S)."""
        if self._tasks:
            try:
                self._write_status()
            except OSError as exc:
                log.warning("cannot write the status file %s: %s", self.status_path, exc)
            except Exception:  # a bug in status() must not end the writer or a link callback
                log.exception("cannot build the status document")

    # -- status ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """This peer's view of the swarm, as written to the status file (JSON-able)."""
        rv = self.rendezvous
        present = rv.peers
        peers = []
        for peer_id in sorted(set(present) | set(self.links)):
            if peer_id == self.peer_id:
                continue
            info, link = present.get(peer_id), self.links.get(peer_id)
            hello = link.hello if link is not None else None
            peers.append({
                "peer_id": peer_id,
                "name": (hello.name if hello else info.name if info else ""),
                "kind": (hello.peer_kind if hello else info.kind if info else "?"),
                "linked": link is not None,
                "rtt_ms": round(link.rtt_s * 1e3, 3) if link is not None and link.rtt_s is not None else None,
                "on_signaling": info is not None,
                "memory_budget": hello.memory_budget if hello else None,
                # what a browser peer allocated for weights, as it reports it (None from Python peers)
                "weight_bytes": link.weights_held.weight_bytes if link is not None and link.weights_held else None,
                "ffn_gflops": round(hello.ffn_gflops, 2) if hello else None,
                "model_hash": hello.model_hash if hello else None,
                "arch": hello.build.arch if hello else None,  # tells a Mac (arm64) from Linux (aarch64, x86_64)
                "numerics": hello.build.numerics if hello else None,  # a coordinator gives work to its own only
                "gpu": hello.build.gpu_adapter if hello else None,  # the adapter a GPU peer computes on
                "gpu_memory": hello.gpu_memory if hello else None,  # bytes its GPU work may fill (0: not given)
            })
        server = rv.server
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),  # a copied config directory's file names another machine's pid
            "updated": time.time(),
            "started": self.started,
            "swarm_id": self.swarm_id,
            "peer_id": self.peer_id,
            "name": self.name,
            "role": self.role,
            "hosting_signaling": rv.hosting,
            "signaling_host": rv.client.host if rv.client is not None else None,
            "signaling_fingerprint": server.certificate.fingerprint if server is not None else None,
            "signaling_port": server.port if server is not None else None,
            "ffn_gflops": round(self.hello.ffn_gflops, 2),
            "gpu": self.hello.build.gpu_adapter,
            "gpu_memory": self.hello.gpu_memory,
            "numerics": self.hello.build.numerics,
            "memory_budget": self.hello.memory_budget,
            "system": platform.system(),
            "placement": self.placement,
            "peers": peers,
            "observed": self._observer(),
            "events": list(self.activity),
        }

    def _write_status(self) -> None:
        tmp = self.status_path.with_name(f".{self.status_path.name}.{os.getpid()}.tmp")
        # default=str: a placement summary from the coordinator must never stop status updates
        tmp.write_text(json.dumps(self.status(), indent=1, default=str))
        os.replace(tmp, self.status_path)

    async def _write_status_forever(self) -> None:
        while True:
            self._refresh_status()
            await asyncio.sleep(STATUS_EVERY_S)
