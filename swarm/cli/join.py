"""``colibri-swarm join``: load the model (``--model``, or the default one; none with
``--no-model``), start a :class:`~swarm.peer.node.Node`, and run
:class:`~swarm.peer.roles.SwarmRoles` on it (election, then coordinator or worker), printing the
swarm, its role and peers as they come and go. The peer runs on uvloop's event loop where it is
installed (``--loop``; see :func:`pick_loop`)."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from swarm import paths
from swarm.errors import SwarmError
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.node import CLOSED_BY_PEER, Node, measure_ffn_gflops
from swarm.terminal import esc

if TYPE_CHECKING:
    from swarm.peer.roles import SwarmRoles

log = logging.getLogger(__name__)

ROLE_POLL_S = 0.5  # how often `join` looks for a role change and new events to print
LEAVE_STEP_S = 5.0  # the longest each shutdown step of `join` may take before it is abandoned


def main_join(args: Any) -> int:
    """``colibri-swarm join``: run a peer until Ctrl-C (or SIGTERM); say goodbye on the way out."""
    from swarm.terminal import console as terminal_console

    console = terminal_console()
    dump_stacks_on_sigusr1()
    try:
        run_on_loop(_join(args, console), getattr(args, "loop", "auto"))
    except KeyboardInterrupt:
        pass
    console.print("[bold]goodbye[/] — left the swarm")
    return 0


def dump_stacks_on_sigusr1() -> None:
    """Make ``kill -USR1 PID`` print every thread's Python stack to this process's stderr, and
    go on running: a peer that stopped answering shows where it waits (no-op where the platform
    has no SIGUSR1)."""
    if hasattr(signal, "SIGUSR1"):
        # stderr without a file descriptor (None, a StringIO): nothing to print the stacks to
        with contextlib.suppress(RuntimeError, ValueError, OSError, AttributeError):
            faulthandler.register(signal.SIGUSR1, all_threads=True)


EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # `--loop`: auto = uvloop where it is installed


def pick_loop(asked: str = "auto") -> str:
    """The event loop a peer runs on for ``--loop ASKED`` (one of :data:`EVENT_LOOPS`):
    ``"uvloop"`` or ``"asyncio"``. uvloop's libuv loop halves a data-channel round trip; asyncio's
    is used when asked for, when uvloop is not installed (auto), and while the slow-callback check
    (``$COLIBRI_SWARM_SLOW_CALLBACK_S``) is on: it times callbacks through asyncio's own handle
    and debug hooks, which uvloop does not have. Says why in one log line whenever the answer is
    not the one asked for. Raises SwarmError for an unknown name, or for ``uvloop`` where it is
    not installed."""
    from swarm.peer.loopwatch import SLOW_CALLBACK_ENV

    if asked not in EVENT_LOOPS:
        raise SwarmError(f"unknown event loop {asked!r}: use one of {', '.join(EVENT_LOOPS)}")
    if asked == "asyncio":
        return "asyncio"
    if os.environ.get(SLOW_CALLBACK_ENV):
        log.info("event loop: asyncio, not uvloop, while $%s is set (the slow-callback check times "
                 "callbacks through asyncio's handle hooks, which uvloop lacks)", SLOW_CALLBACK_ENV)
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if asked == "uvloop":
            raise SwarmError("--loop uvloop: uvloop is not installed here; pip install uvloop, or use "
                             "--loop asyncio") from None
        log.info("event loop: asyncio (uvloop is not installed)")
        return "asyncio"
    return "uvloop"


def run_on_loop(main: Coroutine[Any, Any, Any], asked: str = "auto") -> Any:
    """Run ``main`` to its end on a new event loop of the kind :func:`pick_loop` chooses for
    ``asked``, as :func:`asyncio.run` does; returns its result."""
    try:
        name = pick_loop(asked)
    except BaseException:
        main.close()
        raise
    if name == "uvloop":
        import uvloop

        return uvloop.run(main)
    with asyncio.Runner() as runner:  # what asyncio.run does (a bench may stand this function in for it)
        return runner.run(main)


async def freeze_heap() -> None:
    """Put every object alive now (libraries, the model, its tokenizer: they live as long as the
    process) out of the cyclic garbage collector's reach. A full collection runs inside whichever
    event-loop callback triggers it and walks every tracked object: 0.07 s of the loop's CPU in
    a joined peer before; afterwards it walks only what came later. Start-up garbage is collected
    first, as a frozen cycle would never go: in a thread, once at start-up, so that no message
    handler is charged with it (the collection holds the GIL, so the loop pauses meanwhile)."""
    await asyncio.to_thread(gc.collect)
    gc.freeze()


async def _join(args: Any, console: Any) -> None:
    from swarm.peer.loopwatch import watch_slow_callbacks

    loop = asyncio.get_running_loop()
    kind = "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
    log.info("event loop: %s (%s.%s)", kind, type(loop).__module__, type(loop).__qualname__)
    with watch_slow_callbacks(loop):
        await _run_peer(args, console)


async def _run_peer(args: Any, console: Any) -> None:
    from swarm.compute.serving import set_default_limits
    from swarm.keys import identity, swarmkey
    from swarm.peer.roles import SwarmRoles

    paths.lock_config_dir()  # first: one process per identity (and its key file); the OS releases it at exit
    key, created = _swarm_key(args, swarmkey)
    ident = identity.load_or_create()
    model = None if args.no_model else await asyncio.to_thread(_load_model, args.model, console)
    gpu_mib = getattr(args, "gpu_memory", None)  # checked with the other options before any work (check_options)
    gpu = await asyncio.to_thread(_open_gpu, getattr(args, "gpu", "off"), console)  # blocks: adapter, device
    await asyncio.to_thread(_prepare_numerics)
    gflops = await asyncio.to_thread(gpu.measure_gflops if gpu is not None else measure_ffn_gflops)
    allowance = await asyncio.to_thread(_measure_memory, args, model)
    await freeze_heap()
    node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name=args.name or "",
                ffn_gflops=gflops, build=gpu.build() if gpu is not None else None,
                signal_url=args.signal, memory_budget=allowance.bytes,
                gpu_memory=gpu_mib << 20 if gpu is not None and gpu_mib is not None else 0,
                model_hash=model.content_hash() if model is not None else None,
                rendezvous_options={"bind_port": args.port} if getattr(args, "port", None) else None,
                link_options={"jumbo_packets": False} if getattr(args, "mtu_packets", False) else None)
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
                                        api_tls=False if getattr(args, "api_plain_http", False) else None,
                                        api_port=getattr(args, "api_port", None), device=gpu)
        await freeze_heap()  # the tokenizer and the model's index too
        await roles.start()
        _print_header(console, node)
        shown, seen, hosted = (node.role, None), node.recorded, signaling_port(node)
        while True:
            await asyncio.sleep(ROLE_POLL_S)
            for event in node.activity_since(seen):
                _print_event(console, event)
            seen = node.recorded
            if signaling_port(node) != hosted:  # took signaling over from a host that left: new addresses
                hosted = signaling_port(node)
                if hosted is not None:
                    _print_signaling(console, node)
            if node.error is not None:
                raise node.error  # e.g. the key was refused at --signal: exit with one clear line
            api_port = (node.placement or {}).get("api_port") if isinstance(node.placement, dict) else None
            if (node.role, api_port) != shown:
                for line in role_lines(shown[0], node.role, api_port):
                    console.print(line)
                shown = (node.role, api_port)
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
        if gpu is not None:
            await asyncio.to_thread(gpu.close)


def role_lines(shown: str | None, role: str, api_port: int | None) -> list[str]:
    """What ``join`` prints when its role or API port changes (rich markup): the role where it
    changed from ``shown`` (with the port, where the API is up), else the port alone — a
    coordinator's API comes up after its role, and the role is not printed twice."""
    api = f"OpenAI API on port {api_port}" if api_port else ""
    if role != shown:
        return [f"role: [bold]{esc(role)}[/]{', ' + api if api else ''}"]
    return [api] if api else []


def check_options(args: Any) -> None:
    """The options of ``join`` that contradict each other, refused in one line before any work
    (the model is not opened): SwarmError."""
    if args.no_model and args.model:
        raise SwarmError(f"--no-model joins without a model file, but --model {args.model} names one: drop one "
                         "of them")
    check_gpu_memory(getattr(args, "gpu", "off"), getattr(args, "gpu_memory", None))


def check_gpu_memory(mode: str, mib: int | None) -> None:
    """``--gpu-memory MIB`` sizes the GPU of ``--gpu auto|on``: SwarmError when given with ``--gpu
    off`` (``mode``), which computes on no GPU."""
    if mib is not None and mode == "off":
        raise SwarmError(f"--gpu-memory {mib} sizes the GPU this peer computes on, but --gpu is off: "
                         "add --gpu auto or --gpu on, or leave --gpu-memory out")


def _prepare_numerics() -> None:
    """Under the int8 numerics, compile (or load) their kernels before the peer announces itself:
    compiled on a first request instead, they would hold it past its deadline."""
    from swarm.compute import numerics, quant

    if numerics.int8():
        quant.prepare_int8()


def _open_gpu(mode: str, console: Any) -> Any:
    """The FFN device of ``--gpu MODE`` (swarm/peer/worker/gpu.py), said in one line; None: the CPU."""
    from swarm.peer.worker.gpu import GpuFfn

    gpu = GpuFfn.open(mode)
    if gpu is not None:
        console.print(f"GPU: [bold]{esc(gpu.adapter)}[/] ({esc(gpu.backend)}) computes this peer's "
                      "expert and MLP ranges and its stages with the WGSL kernels")
    return gpu


def _measure_memory(args: Any, model: Any) -> Any:
    """This peer's :class:`swarm.peer.memory.Allowance` (``--memory``: the whole process, MiB),
    logged; sets the KV context (``--context``) and measures how fast the model file reads from
    disk (what a swarm too small for the model streams at)."""
    from swarm.peer import memory

    memory.set_context(getattr(args, "context", None))
    if model is not None:
        files = getattr(model.checkpoint, "files", None) or [model.path]
        rate = memory.measure_read_rate(files[0])
        if rate:
            log.info("the model file reads at %.0f MB/s past the page cache", rate / 1e6)
    allowance = memory.measure_allowance(args.memory << 20 if args.memory else None)
    log.info("%s", allowance.describe())
    if args.memory and allowance.limit == args.memory << 20 and allowance.bytes == 0:
        # --memory itself leaves a peer that could hold nothing: a typo (MiB for GiB?)
        raise SwarmError(f"--memory {args.memory} (MiB, the whole process) leaves nothing for weights, the KV "
                         f"cache and activations: this process already takes {allowance.baseline >> 20} MiB and "
                         f"keeps {allowance.headroom >> 20} MiB of page cache free; give more than "
                         f"{memory.least_limit(allowance.baseline) >> 20} MiB, or leave --memory out")
    return allowance


async def _leave(node: Node, roles: SwarmRoles | None) -> None:
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
        path = default_model_path(notice=lambda line: console.print(esc(line)))
    model = load_model(path)
    console.print(f"model {esc(path)} (hash {model.content_hash()[:16]}…)")
    return model


def _swarm_key(args: Any, swarmkey: Any) -> tuple[SwarmKey, bool]:
    if args.key:
        return swarmkey.store(args.key), False
    existing = swarmkey.load()
    return (existing, False) if existing is not None else (swarmkey.create(), True)


def _print_header(console: Any, node: Node) -> None:
    rv = node.rendezvous
    console.print(f"swarm [bold]{esc(node.swarm_id)}[/]  peer [bold]{esc(node.peer_id)}[/] ({esc(node.name)})  "
                  "electing a coordinator…")
    if rv.server is None and rv.client is not None:
        console.print(f"on the signaling server of peer {esc(rv.client.host)}")
    _print_signaling(console, node)


def signaling_port(node: Node) -> int | None:
    """The port of the signaling server this peer hosts, None where it hosts none."""
    server = node.rendezvous.server
    return server.port if server is not None else None


def _print_signaling(console: Any, node: Node) -> None:
    """Where peers and pages reach the swarm's signaling server: the server this peer hosts
    (its port, certificate and ``--signal`` address), and the peer page's link (by the host's
    address). At start, and again when this peer takes hosting over from a host that left —
    the addresses the first host printed are then dead."""
    from web_peer.pageurl import page_addresses, page_link_text  # the peer page's URL (key in the fragment) + QR

    rv = node.rendezvous
    if rv.server is not None:
        console.print(f"hosting signaling on port {rv.server.port}, certificate SHA-256 "
                      f"{esc(rv.server.certificate.fingerprint)}")
        addresses = page_addresses(rv)
        if addresses:
            console.print(f"peers that do not find it by mDNS: colibri-swarm join --signal {esc(addresses[0])}")
    page = page_link_text(rv, node.swarm_key.code)
    if page:
        console.print(page, markup=False, highlight=False, emoji=False)


def _print_dashboard(console: Any, node: Node, roles: SwarmRoles, port: int) -> None:
    """The coordinator's dashboard URL (the key in its fragment), beside the peer page's."""
    from swarm.discovery.addresses import local_addresses
    from swarm.peer.coordinator.dashboard import dashboard_url

    host = (local_addresses() or ["127.0.0.1"])[0]
    scheme = getattr(roles.coordinator.api, "scheme", None) or "http"
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


def _print_event(console: Any, ev: dict[str, Any]) -> None:
    """One event :meth:`Node.record` noted: peers linked, lost, joined or left (others are not printed)."""
    name, peer, kind = esc(ev["name"] or "?"), esc(ev["peer_id"]), esc(ev["detail"] or "?")
    match ev["what"]:
        case "link up":
            console.print(f"[green]+[/] linked  {name} ({peer}, {kind})")
        case "link down" if ev["detail"] == CLOSED_BY_PEER:
            console.print(f"  link closed by {name} ({peer}): it is leaving")
        case "link down":
            console.print(f"[red]-[/] link lost {name} ({peer})")
        case "joined":
            console.print(f"  joined  {name} ({peer}, {kind})")
        case "left":
            console.print(f"  left    {name} ({peer})")
