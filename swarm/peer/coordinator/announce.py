"""How the coordinator hands its plans out: it offers each worker without the model the slices a
plan gives it (:class:`~swarm.peer.weights.shipping_aio.PlanShipper`: the file's own encoding,
SHA-256 per chunk, resumable, over HTTPS range requests or the data channel), then sends the plan,
and the stage plan when there is one, on the same ordered channel before any request that uses
them; status shows what it sent."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from swarm.errors import SwarmError
from swarm.peer.coordinator.standby import reads_standby
from swarm.peer.plan import plan_workers
from swarm.peer.tasks import send_logged
from swarm.peer.weights.shipping_aio import PlanShipper

if TYPE_CHECKING:
    from swarm.compute.model import Model
    from swarm.peer.net.link import Link
    from swarm.peer.net.messages import Standby
    from swarm.peer.node import Node
    from swarm.peer.plan import ModelShape, Plan, StageLayout

log = logging.getLogger(__name__)


class PlanAnnouncer:
    """Sends the plans of ``node``'s coordinator for ``model`` (of ``shape``) to its workers."""

    def __init__(self, node: Node, model: Model, shape: ModelShape) -> None:
        self.node = node
        self._shipper = PlanShipper(model.path, node.hello.model_hash, shape, token_key=node.swarm_key.slice_token_key)

    def attach(self, link: Link) -> None:
        """Serve ``link``'s chunk requests (should its peer need slices)."""
        self._shipper.attach(link)

    async def close(self) -> None:
        await self._shipper.close()  # the HTTPS slice server

    async def _offer(self, link: Link, plan: Plan) -> bool:
        """Offer ``link``'s peer its slices of ``plan`` if it has no model; False if that failed."""
        if link.hello.model_hash is not None:
            return True
        try:
            await self._shipper.offer_plan(link, plan)
            return True
        except SwarmError as exc:
            log.warning("could not offer slices to %s: %s", link.peer_id, exc)
            return False

    async def announce(self, plan: Plan, layout: StageLayout | None, placement: dict[str, Any],
                       standby: Mapping[str, Standby] | None = None) -> None:
        """Offer workers without the model their slices, then send ``plan`` (and the stage
        ``layout``, if any) to every worker, and each page of ``standby`` (peer → notice) that
        reads it its notice; status shows ``placement`` with the plan."""
        links = {p: self.node.links[p] for p in plan.workers() if p in self.node.links}
        for link in links.values():
            await self._offer(link, plan)
        msg = plan.to_message()
        await asyncio.gather(*(send_logged(link, msg) for link in links.values()))
        workers = len(plan_workers(plan, layout))  # under stages the per-layer plan holds the coordinator alone
        self.node.record("replanned", detail=f"plan v{plan.version} of term {plan.term}: {workers} worker(s)")
        # why each page without work stands by, for status and the dashboard
        standing = {peer: {"reason": n.reason, "message": n.message} for peer, n in (standby or {}).items()}
        self.node.set_placement({"term": plan.term, "version": plan.version, "streamed_bytes": plan.streamed_bytes,
                                 **plan.to_dict(), **placement, **({"standby": standing} if standing else {})})
        if layout is not None:
            stage_msg = layout.to_message()
            await asyncio.gather(*(send_logged(self.node.links[p], stage_msg) for p in layout.workers()
                                   if p in self.node.links))
        notices = []
        for peer, notice in (standby or {}).items():
            page = self.node.links.get(peer)
            if page is not None and page.hello is not None and reads_standby(page.hello.build, notice.reason):
                notices.append(send_logged(page, notice))
        await asyncio.gather(*notices)

    async def resend(self, link: Link, plan: Plan) -> None:
        """``link``'s peer refused a request of ``plan`` as not accepted (it lost or refused the
        plan): send it that plan again, with its slices' offer if it has no model."""
        if await self._offer(link, plan):
            await send_logged(link, plan.to_message())
