"""The peer node: one Python peer of the swarm, and ``colibri-swarm join``.

``join`` loads the model (``--model``, or the default one; none with ``--no-model``), starts a
:class:`Node`, and runs :class:`~swarm.peer.roles.SwarmRoles` on it (election, then coordinator
or worker), printing the swarm, its role and peers as they come and go.

:class:`Node` is the reusable asyncio object the election, coordinator and worker build on::

    node = Node(swarm_key=key, certificate=cert, peer_id=pid, name="laptop")
    node.on_link_up.append(lambda link: ...)        # a peer's link opened (link.hello, link.rtt_s)
    node.on_link_down.append(lambda peer_id: ...)   # it closed
    node.on(ExpertRequest, handler)                 # handler(link, message), sync or async
    await node.start()                              # returns once on a signaling server
    node.links[peer_id].send(message)               # open links by peer id
    node.role = "coordinator"                       # shown by `colibri-swarm status`
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
import gc
import json
import logging
import os
import platform
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
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
from swarm.peer.net.messages import Hello, NumericBuild
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.status import STATUS_EVERY_S, STATUS_FILE
from swarm.signaling.client import PeerJoined, PeerLeft, SignalReceived, SignalRefused
from swarm.signaling.relay import DUPLICATE_NOTICE
from swarm.terminal import esc

log = logging.getLogger(__name__)

ROLE_POLL_S = 0.5  # how often `join` looks for a role change to print
LEAVE_STEP_S = 5.0  # the longest each shutdown step of `join` may take before it is abandoned
EVENTS_KEPT = 50  # the newest swarm events in the status document (dashboard, `status --watch`)


@dataclass(frozen=True)
class PeerEvent:
    """For the terminal: ``what`` is joined, left, link-up or link-down."""

    what: str
    peer_id: str
    name: str
    kind: str
    rtt_s: float | None = None


def numeric_build() -> NumericBuild:
    """What decides bit-exactness of this peer's FFN results (docs/architecture.md §5)."""
    blas = "unknown"
    with contextlib.suppress(Exception):
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{info.get('name', '?')} {info.get('version', '?')}"
    return NumericBuild(package=__version__, numpy=np.__version__, blas=blas, arch=platform.machine(),
                        kernel_dtype="f32")


def measure_ffn_gflops(hidden: int = 576, ffn: int = 1536, rows: int = 8, repeats: int = 5) -> float:
    """GFLOP/s of a SwiGLU MLP on this machine (float32, SmolLM2's shape by default); ~20 ms.

    The best of ``repeats`` runs: placement wants what the machine can do, not scheduler noise.
    """
    rng = np.random.default_rng(0)
    scale = np.float32(hidden**-0.5)  # keeps activations O(1): no overflow in exp
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    w_gate = rng.standard_normal((ffn, hidden), dtype=np.float32) * scale
    w_up = rng.standard_normal((ffn, hidden), dtype=np.float32) * scale
    w_down = rng.standard_normal((hidden, ffn), dtype=np.float32) * scale
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        g = x @ w_gate.T  # [rows, ffn]
        h = (g / (1.0 + np.exp(-g))) * (x @ w_up.T)
        _ = h @ w_down.T  # [rows, hidden]
        best = min(best, time.perf_counter() - t)
    return 3 * 2 * rows * hidden * ffn / best / 1e9


def default_memory_budget(cap_bytes: int | None = None) -> int:
    """Bytes of weights this peer offers: what the OS (and its memory cgroup, if any) leaves this
    process, less a headroom, at most ``cap_bytes`` (``--memory``); see swarm/peer/memory.py."""
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
        status_path: Path | None = None,
        link_options: dict[str, Any] | None = None,
        rendezvous_options: dict[str, Any] | None = None,
    ) -> None:
        self.swarm_key = swarm_key
        self.peer_id = peer_id
        self.name = name or socket.gethostname()
        self.role = "peer"  # the election sets "coordinator" or "worker"
        self.placement: Any = None  # the plan as this peer knows it (JSON-able): set by the roles, for status
        # What the roles measured (JSON-able dict, e.g. per-peer timings), merged into status() as "observed".
        self.observed: Callable[[], dict[str, Any]] = dict
        self.activity: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)  # see record()
        # peer id → (name, kind) from its presence and hello, kept after it leaves: events name it
        self.known: dict[str, tuple[str, str]] = {}
        self.hello = Hello(
            peer_id=peer_id, protocol_version=wire.PROTOCOL_VERSION, build=numeric_build(), model_hash=model_hash,
            memory_budget=default_memory_budget() if memory_budget is None else memory_budget,
            ffn_gflops=measure_ffn_gflops() if ffn_gflops is None else ffn_gflops,
            peer_kind="python", adapter_limits={}, adapter_features=(), name=self.name[:64],
        )
        self.events: asyncio.Queue[PeerEvent] = asyncio.Queue()
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
        """Note a swarm event for status and the dashboard: ``what`` is e.g. "joined", "left",
        "link up", "link down", "marked down", "replanned", "coordinator changed"; ``t`` is Unix s."""
        self.activity.append({"t": round(time.time(), 3), "what": what, "peer_id": peer_id, "name": name,
                              "detail": detail})

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
                self.events.put_nowait(PeerEvent("joined", info.peer_id, info.name, info.kind))
                self.record("joined", info.peer_id, info.name, info.kind)
            case PeerLeft(peer_id=peer_id):
                self.mesh.peer_left(peer_id)
                name, kind = self.known.get(peer_id, ("", "?"))  # the presence list has dropped it already
                self.events.put_nowait(PeerEvent("left", peer_id, name, kind))
                self.record("left", peer_id, name)
            case SignalReceived(sender=sender, data=data):
                await self.mesh.handle_signal(sender, data)
            case SignalRefused(code=code, detail=detail):
                log.log(logging.WARNING if code == DUPLICATE_NOTICE else logging.INFO, "signaling: %s %s", code, detail)

    def _link_up(self, link: Link) -> None:
        hello = link.hello
        if hello is not None and link.peer_id:
            self.known[link.peer_id] = (hello.name, hello.peer_kind)
        self.events.put_nowait(PeerEvent("link-up", link.peer_id or "?", hello.name if hello else "",
                                         hello.peer_kind if hello else "?", link.rtt_s))
        self.record("link up", link.peer_id or "?", hello.name if hello else "", hello.peer_kind if hello else "")
        self._refresh_status()

    def _link_down(self, peer_id: str) -> None:
        name, kind = self.known.get(peer_id, ("", ""))
        self.events.put_nowait(PeerEvent("link-down", peer_id, name, kind))
        self.record("link down", peer_id, name)
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
            })
        server = rv.server
        return {
            "pid": os.getpid(),
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
            "memory_budget": self.hello.memory_budget,
            "system": platform.system(),
            "placement": self.placement,
            "peers": peers,
            "observed": self.observed(),
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


# -- colibri-swarm join ------------------------------------------------------------------------------


def main_join(args: Any) -> int:
    """``colibri-swarm join``: run a peer until Ctrl-C (or SIGTERM); say goodbye on the way out."""
    from swarm.terminal import console as terminal_console

    console = terminal_console()
    try:
        asyncio.run(_join(args, console))
    except KeyboardInterrupt:
        pass
    console.print("[bold]goodbye[/] — left the swarm")
    return 0


async def freeze_heap() -> None:
    """Put every object alive now (libraries, the model, its tokenizer: they live as long as the
    process) out of the cyclic garbage collector's reach. A full collection runs inside whichever
    event-loop callback triggers it and walks every tracked object: 0.07 s of the loop's CPU in
    a joined peer before; afterwards it walks only what came later. Start-up garbage is collected
    first (in a thread: nothing on the loop waits for it), as a frozen cycle would never go."""
    await asyncio.to_thread(gc.collect)
    gc.freeze()


async def _join(args: Any, console: Any) -> None:
    from swarm.peer.loopwatch import watch_slow_callbacks

    with watch_slow_callbacks(asyncio.get_running_loop()):
        await _run_peer(args, console)


async def _run_peer(args: Any, console: Any) -> None:
    from swarm.keys import identity, swarmkey
    from swarm.compute.serving import set_default_limits
    from swarm.peer.roles import SwarmRoles

    paths.lock_config_dir()  # first: one process per identity (and its key file); the OS releases it at exit
    key, created = _swarm_key(args, swarmkey)
    ident = identity.load_or_create()
    model = None if args.no_model else await asyncio.to_thread(_load_model, args.model, console)
    gflops = await asyncio.to_thread(measure_ffn_gflops)
    await freeze_heap()
    node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name=args.name or "",
                ffn_gflops=gflops,
                signal_url=args.signal, memory_budget=default_memory_budget(args.memory << 20 if args.memory else None),
                model_hash=model.content_hash() if model is not None else None,
                rendezvous_options={"bind_port": args.port} if getattr(args, "port", None) else None)
    if created:
        console.print("created a new swarm key; other peers join with:")
        console.print(f"  [bold]colibri-swarm join --key {esc(key.code)}[/]")
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError):  # SIGTERM ends the peer as cleanly as Ctrl-C
        loop.add_signal_handler(signal.SIGTERM, main.cancel)  # type: ignore[union-attr]
    roles = None
    try:
        # On signaling first, so that peers starting together see each other while each builds its
        # tokenizer (none leads alone). A plan that reaches this peer meanwhile finds no handler;
        # the coordinator sends it again when this peer refuses a request of it.
        with console.status("looking for the swarm on this network…"):
            await node.start()
        _print_discovery_hints(console, node, key_created=created)
        set_default_limits(getattr(args, "max_batch", None), getattr(args, "max_queue", None))  # the API's batch
        roles = await SwarmRoles.create(node, model, verify=args.verify / 100, layout=getattr(args, "layout", "ranges"),
                                        api_tls=False if getattr(args, "api_plain_http", False) else None)
        await freeze_heap()  # the tokenizer and the model's index too
        await roles.start()
        _print_header(console, node)
        shown = (node.role, None)
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                _print_event(console, await asyncio.wait_for(node.events.get(), ROLE_POLL_S))
            if node.error is not None:
                raise node.error  # e.g. the key was refused at --signal: exit with one clear line
            api_port = (node.placement or {}).get("api_port") if isinstance(node.placement, dict) else None
            if (node.role, api_port) != shown:
                shown = (node.role, api_port)
                api = f", OpenAI API on port {api_port}" if api_port else ""
                console.print(f"role: [bold]{esc(node.role)}[/]{api}")
                if api_port and node.placement.get("api_scheme") == "https":
                    from swarm.peer.coordinator.api_tls import ca_fingerprint

                    console.print(f"the API speaks HTTPS; its CA certificate SHA-256 {esc(ca_fingerprint(key))} "
                                  "(`colibri-swarm key` writes it to a file for other clients)")
                if api_port:
                    _print_dashboard(console, node, roles, api_port)
    except asyncio.CancelledError:
        pass
    finally:
        await _leave(node, roles)


async def _leave(node: Node, roles: Any) -> None:
    """Stop the roles, then the node; each step bounded so Ctrl-C always ends the peer."""
    steps = [("roles", roles.stop)] if roles is not None else []
    for what, stop in steps + [("links and signaling", node.stop)]:
        log.info("leaving: stopping %s", what)
        try:
            await asyncio.wait_for(stop(), LEAVE_STEP_S)
        except asyncio.TimeoutError:
            log.warning("leaving: stopping %s took over %g s; going anyway", what, LEAVE_STEP_S)
        except Exception:  # leaving must not fail halfway
            log.exception("leaving: stopping %s failed", what)
    log.info("leaving: done")


def _load_model(path: str | None, console: Any) -> Any:
    from swarm.compute.default_model import default_model_path
    from swarm.compute.model import load_model

    if path is None:
        path = default_model_path()
    model = load_model(path)
    console.print(f"model {esc(path)} (hash {model.content_hash()[:16]}…)")
    return model


def _swarm_key(args: Any, swarmkey: Any) -> tuple[SwarmKey, bool]:
    if args.key:
        return swarmkey.store(args.key), False
    existing = swarmkey.load()
    return (existing, False) if existing is not None else (swarmkey.create(), True)


def _print_header(console: Any, node: Node) -> None:
    from web_peer.pageurl import page_addresses, page_link_text  # the peer page's URL (key in the fragment) + QR

    rv = node.rendezvous
    console.print(f"swarm [bold]{esc(node.swarm_id)}[/]  peer [bold]{esc(node.peer_id)}[/] ({esc(node.name)})  "
                  "electing a coordinator…")
    if rv.server is not None:
        console.print(f"hosting signaling on port {rv.server.port}, certificate SHA-256 "
                      f"{esc(rv.server.certificate.fingerprint)}")
        addresses = page_addresses(rv)
        if addresses:
            console.print(f"peers that do not find it by mDNS: colibri-swarm join --signal {esc(addresses[0])}")
    elif rv.client is not None:
        console.print(f"on the signaling server of peer {esc(rv.client.host)}")
    page = page_link_text(rv, node.swarm_key.code)
    if page:
        console.print(page, markup=False, highlight=False, emoji=False)


def _print_dashboard(console: Any, node: Node, roles: Any, port: int) -> None:
    """The coordinator's dashboard URL (the key in its fragment), beside the peer page's."""
    from swarm.discovery.addresses import local_addresses
    from swarm.peer.coordinator.dashboard import dashboard_url

    host = (local_addresses() or ["127.0.0.1"])[0]
    scheme = getattr(roles.api, "scheme", None) or "http"
    console.print(f"dashboard and chat, for a browser on this network:\n  "
                  f"{dashboard_url(scheme, host, port, node.swarm_key.code)}", markup=False, highlight=False,
                  soft_wrap=True)  # one line: a terminal must not break the URL


def _print_discovery_hints(console: Any, node: Node, *, key_created: bool) -> None:
    """Say why this peer started a swarm of its own, and what to do if that was not meant."""
    rv = node.rendezvous
    if not rv.found_none:
        return
    if rv.other_swarms:
        ids = ", ".join(sorted(rv.other_swarms))
        console.print(f"[yellow]another swarm is on this network (swarm {ids}); this peer started swarm "
                      f"{node.swarm_id}{' with a new key' if key_created else ''}.[/] To join that one instead, "
                      "stop this peer (Ctrl-C) and run `colibri-swarm join --key CODE` with the code "
                      "`colibri-swarm key` shows on one of its peers.", markup=True)
        return
    console.print("[yellow]no swarm found by mDNS on this network: this peer started one.[/] If peers already "
                  "run here, multicast may be blocked (guest Wi-Fi, some VPNs): join them with "
                  "`colibri-swarm join --signal HOST:PORT`, the address their signaling host prints.")


def _print_event(console: Any, ev: PeerEvent) -> None:
    match ev.what:
        case "link-up":
            console.print(f"[green]+[/] linked  {esc(ev.name or '?')} ({esc(ev.peer_id)}, {esc(ev.kind)})")
        case "link-down":
            console.print(f"[red]-[/] link lost {esc(ev.name or '?')} ({esc(ev.peer_id)})")
        case "joined":
            console.print(f"  joined  {esc(ev.name or '?')} ({esc(ev.peer_id)}, {esc(ev.kind)})")
        case "left":
            console.print(f"  left    {esc(ev.name or '?')} ({esc(ev.peer_id)})")
