"""What the election driver, the coordinator role and the worker role share: a set of tasks
each owns (cancelled together when it stops), and sends whose failure is only logged (a peer
whose link breaks is handled by the link-down event, not by the sender)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from swarm.errors import SwarmError
from swarm.peer.net.eager import start_eagerly as eager_start

if TYPE_CHECKING:
    from swarm.peer.net.link import Link

log = logging.getLogger(__name__)


class OwnedTasks:
    """Tasks started by one owner (names prefixed ``prefix``); a failure is logged, never lost."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._tasks: set[asyncio.Task] = set()
        self.closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, *, eager: bool = False) -> asyncio.Task | None:
        """Run ``coro`` as a task of this set (on the running loop). After :meth:`close` it is
        closed unstarted and None is returned: an event that arrives while the owner stops
        (a link going down) must not start work nobody will cancel.

        ``eager``: run it now, on the caller's stack, until it first suspends (see
        swarm/peer/net/eager.py; a request's send saves a loop iteration so); only the rest
        becomes a task, and None is returned when nothing is left. A failure of the eager part
        is logged as a task's would be. The caller must be on the loop's thread."""
        if self.closed:
            coro.close()
            log.debug("%s-%s not started: its owner has stopped", self._prefix, name)
            return None
        if eager:
            try:
                task = eager_start(coro)
            except Exception:
                log.exception("task %s-%s failed", self._prefix, name)
                return None
            if task is None:
                return None
            task.set_name(f"{self._prefix}-{name}")
        else:
            task = asyncio.get_running_loop().create_task(coro, name=f"{self._prefix}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def cancel_all(self) -> None:
        """Cancel every task of the set and wait until each has ended."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def close(self) -> None:
        """Refuse new tasks from now on, then cancel every task and wait until each has ended."""
        self.closed = True
        await self.cancel_all()


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: nothing to do) and wait until it has ended, whatever it raised."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def send_logged(link: Link, msg: object) -> None:
    """Send ``msg`` on ``link``; a failure (link closing, message refused) is logged only."""
    try:
        await link.send(msg)
    except SwarmError as exc:
        log.info("could not send %s to %s: %s", type(msg).__name__, link.peer_id, exc)
