"""Where the coordinator serves the OpenAI API: the server (:mod:`swarm.peer.coordinator.api`) and
the dashboard on it, opened when this peer coordinates and closed when it steps down, on the port
remembered in the peer's config directory, so a coordinator elected again on this machine serves
at the same URL; a port that is taken gives way to a free one, with a warning."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.peer.tasks import cancel_and_wait

if TYPE_CHECKING:
    from swarm.compute.ffn import FFNBackend
    from swarm.compute.model import Model
    from swarm.compute.tokenizer import TextTokenizer
    from swarm.peer.coordinator.api import ApiServer
    from swarm.peer.coordinator.api_engine import EngineBackend
    from swarm.peer.node import Node
    from swarm.peer.tasks import OwnedTasks

log = logging.getLogger(__name__)

API_PORT_FILE = "api_port"  # in the config directory: the port the API last served on, tried first next time
# After stepping down, the API keeps answering at its address this long (seconds), sending every
# client on to the new coordinator (ApiServer.hand_over): a dashboard open here follows it.
HAND_OVER_LINGER_S = 60.0


def read_api_port(path: Path) -> int:
    """The API port remembered in ``path`` (0: none, or unreadable)."""
    try:
        port = int(path.read_text().strip())
    except (OSError, ValueError):
        return 0
    return port if 0 < port < 65536 else 0


def write_api_port(path: Path, port: int) -> None:
    """Remember ``port`` in ``path``, so a coordinator elected again on this machine serves at the
    same URL; a failure is logged (the port is then chosen afresh next time)."""
    try:
        path.write_text(f"{port}\n")
    except OSError as exc:
        log.warning("could not remember the API port in %s: %s", path, exc)



class ApiHost:
    """The API of ``node``'s coordinator for ``model`` (None: never opened): ``host`` / ``port`` (None: the
    port remembered in the config directory, :data:`API_PORT_FILE`, else a free one, then remembered;
    a port given, once served, is remembered too) / ``tls`` (None: HTTPS unless the host is loopback). ``api``, ``port``: the
    server while open (None otherwise)."""

    def __init__(self, node: Node, model: Model | None, tokenizer: TextTokenizer | None, host: str = "0.0.0.0",
                 port: int | None = None, tls: bool | None = None) -> None:
        self.node, self.model, self._tokenizer = node, model, tokenizer
        self._host, self._port_wanted, self._tls = host, port, tls
        self.api: ApiServer | None = None
        self.port: int | None = None
        self._backend: EngineBackend | None = None  # the API's token loop
        self._closing: asyncio.Task | None = None  # the API of a term stepped down from

    def set_ffn(self, ffn: FFNBackend | None) -> None:
        """The token loop runs ``ffn`` from its next step on."""
        if self._backend is not None:
            self._backend.set_ffn(ffn)

    def running(self) -> int | None:
        """Sequences the API runs now (None while it is not open)."""
        return self._backend.running() if self._backend is not None else None

    async def open(self, term: int, ffn: FFNBackend | None) -> None:
        """Serve the API of ``term`` (advertised by mDNS) with ``ffn``; already open: use ``ffn``."""
        if self._closing is not None:  # the last term's, handed over: its port is the one we want
            await self.closed()
        if self._backend is not None:
            self._backend.set_ffn(ffn)
            return
        from swarm.peer import memory
        from swarm.peer.coordinator.api import ApiServer
        from swarm.peer.coordinator.api_engine import EngineBackend
        from swarm.peer.coordinator.dashboard import Dashboard

        # The KV cache the memory plan reserved (join --context) bounds what the API admits.
        context = memory.context_tokens(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self._backend = EngineBackend(self.model, self._tokenizer, model_id=self.model.path.name, ffn=ffn,
                                      context=context)
        remembered = self.node.status_path.parent / API_PORT_FILE  # in this peer's config directory
        port = self._port_wanted if self._port_wanted is not None else read_api_port(remembered)
        for attempt in (port, 0) if port else (0,):
            self.api = ApiServer.for_swarm_key(self._backend, self.node.swarm_key)
            Dashboard(self.node.status).attach(self.api)  # its page and chat on the API's server
            try:
                self.port = await self.api.start(self._host, attempt, tls=self._tls,
                                                 advertise=(self.node.peer_id, term))  # mDNS: chat finds it
                break
            except OSError as exc:
                if attempt == 0:
                    raise
                with contextlib.suppress(Exception):
                    await self.api.close()
                log.warning("the API's port %d is taken (%s); serving on a free port instead%s", attempt,
                            exc.strerror or exc, "" if self._port_wanted else
                            f" (delete {remembered} to stop trying {attempt})")
        # The port a user chose (--api-port), once served, is this directory's from now on, as the
        # first one chosen here is; a taken one that gave way to a free one is tried again next time.
        if (self.port == self._port_wanted or (self._port_wanted is None and not port)) \
                and read_api_port(remembered) != self.port:
            write_api_port(remembered, self.port)
        log.info("OpenAI API on port %d (%s)", self.port, self.api.scheme)

    def fields(self) -> dict[str, Any]:
        """Where status shows the API: its port and scheme (the local CLI connects by them)."""
        return {"api_port": self.port, "api_scheme": self.api.scheme if self.api is not None else None}

    def close_soon(self, tasks: OwnedTasks) -> None:
        """Step down from serving, in the background (a task of ``tasks``): the API hands its
        requests back and its mDNS record goes at once, so clients find the next coordinator;
        it keeps answering at its address for ``HAND_OVER_LINGER_S``, sending clients there
        (:meth:`ApiServer.hand_over`), then closes. :meth:`closed` (and the next :meth:`open`)
        ends that at once."""
        if self.api is not None and self._closing is None:
            self._closing = tasks.spawn(self._hand_over(self.api), "close-api")

    async def _hand_over(self, api: ApiServer) -> None:
        try:
            await api.hand_over()
            await asyncio.sleep(HAND_OVER_LINGER_S)
        finally:
            if self.api is api:
                await self.close()

    async def closed(self) -> None:
        """End a step-down in progress (:meth:`close_soon`) now: the API closed, its port free."""
        if self._closing is not None:
            closing, self._closing = self._closing, None
            await cancel_and_wait(closing)
            await self.close()  # had the cancel come before the task began

    async def close(self) -> None:
        if self.api is not None:
            api, self.api, self._backend = self.api, None, None
            await api.close()
            self.port = None
