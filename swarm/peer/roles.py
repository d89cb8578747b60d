"""Roles: the election over a node's links, and what this peer does with the outcome.

:class:`SwarmRoles` composes three objects that each own their state:

* :class:`~swarm.peer.election.driver.ElectionDriver` (``election``) — membership and the
  election over the links; each outcome switches this peer's role;
* :class:`~swarm.peer.coordinator.role.CoordinatorRole` (``coordinator``) — while this peer
  coordinates: plans, dispatch of rows to the workers (RemoteFFN, StagedFFN), the OpenAI API;
* :class:`~swarm.peer.worker.role.WorkerRole` (``worker``) — the plans and requests of another
  coordinator (or of this one: a coordinator works for itself through its own model only).

This module only wires them: the election's outcomes and admissions to the roles, a channel
``Error`` to whichever it concerns, and the role to the node's status. Every task is owned by
one of the three and cancelled by :meth:`SwarmRoles.stop`.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

from swarm.errors import LocalProtocolError
from swarm.peer.coordinator.planning import check_layout
from swarm.peer.coordinator.role import CoordinatorRole
from swarm.peer.election.driver import MESH_FORMING_QUIET_S, ElectionDriver
from swarm.peer.net.messages import Error
from swarm.peer.worker.role import WorkerRole

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.compute.tokenizer import TextTokenizer
    from swarm.peer.net.link import Link
    from swarm.peer.node import Node
    from swarm.peer.worker.ffn import FfnDevice


class SwarmRoles:
    """Election and roles for one :class:`~swarm.peer.node.Node`.

    ``model``: the whole model this peer holds (None: it holds none); ``tokenizer`` for the API
    (default: the model's own). ``verify``: share (0..1) of remote answers the coordinator
    recomputes. ``layout``: ``"ranges"``, ``"stages"``, ``"mix"`` or ``"auto"``
    (:mod:`swarm.peer.coordinator.role`). ``api_host`` / ``api_port``: where the coordinator
    serves the OpenAI API (port 0: any free port; None: the port this config directory
    remembers, so a coordinator elected again here keeps its URL; see ``coordinator.api_port``); ``api_tls``:
    HTTPS or not (None: HTTPS unless ``api_host`` is loopback). ``device``: where this peer's
    FFN ranges run as a worker (None: the CPU; ``join --gpu``: :mod:`swarm.peer.worker.gpu`). Raises LocalProtocolError when
    the node's hello names another model than ``model``, or for an unknown layout.
    """

    def __init__(self, node: Node, model: Model | None = None, *, tokenizer: TextTokenizer | None = None,
                 verify: float = 0.0, api_host: str = "0.0.0.0", api_port: int | None = None, rng: random.Random | None = None,
                 serve_api: bool = True, startup_quiet_s: float = MESH_FORMING_QUIET_S, layout: str = "ranges",
                 api_tls: bool | None = None, device: FfnDevice | None = None) -> None:
        if model is not None and model.content_hash() != node.hello.model_hash:
            raise LocalProtocolError("the node's hello must name the hash of the model it serves")
        check_layout(layout)
        self.node = node
        self.model = model
        if tokenizer is None and model is not None and serve_api:
            from swarm.compute.tokenizer import tokenizer_for

            tokenizer = tokenizer_for(model)  # now, not when elected: that must not stall the event loop
        self.election = ElectionDriver(node, model is not None, on_leader=self._leader_changed,
                                       on_admitted=self._admitted, rng=rng, startup_quiet_s=startup_quiet_s)
        self.coordinator = CoordinatorRole(node, model, self.election, verify=verify, layout=layout,
                                           tokenizer=tokenizer, serve_api=serve_api, api_host=api_host,
                                           api_port=api_port, api_tls=api_tls)
        self.worker = WorkerRole(node, model, self.election, device)

    @classmethod
    async def create(cls, node: Node, model: Model | None = None, **options: Any) -> SwarmRoles:
        """Construct in a worker thread: building the tokenizer and indexing the model file
        take seconds on a large model, and the event loop must keep serving links meanwhile."""
        return await asyncio.to_thread(cls, node, model, **options)

    async def start(self) -> None:
        """Hook the three into the node; start the election."""
        self.worker.start()
        self.coordinator.start()
        self.node.on(Error, self._on_error)
        self.election.start()

    async def stop(self) -> None:
        """Stop the election, the coordinator (its tasks and API), the worker's compute thread."""
        await self.election.stop()
        await self.coordinator.stop()
        self.worker.stop()

    @property
    def role(self) -> str:
        return self.election.role

    async def _leader_changed(self, term: int, leader: str | None) -> None:
        if leader == self.node.peer_id:
            self.coordinator.take_over(term)
        else:
            await self.coordinator.step_down()
        self.node.set_role(self.election.role)

    def _admitted(self, link: Link) -> None:
        self.coordinator.admitted(link)
        self.worker.admitted(link)

    def _on_error(self, link: Link, msg: Error) -> None:
        if msg.request_id == 0:
            self.election.refused_by(link, msg)
        else:
            self.coordinator.refused(link, msg)
