"""Start a coroutine now, on the caller's stack, instead of a loop iteration later.

``asyncio.ensure_future(coro)`` runs nothing until the event loop's next iteration: a stage
request's handler, or aiortc's flush of a message just queued on a data channel, waits behind
every callback already queued, and each such hop costs tens of microseconds of cold Python on
a round trip that is all hops. :func:`start_eagerly` runs the coroutine until it first
suspends; only then does a task take it over, exactly where it stopped. Most of these
coroutines never suspend (the SCTP path to ``sendto`` awaits only coroutines that return at
once), so most need no task at all. Python 3.12's ``asyncio.eager_task_factory`` does the same
for every task of a loop; this does it for chosen calls, on Python 3.11 and under uvloop.

The caller must be on the event loop's thread (the coroutine may touch loop-owned state) and
must accept that the coroutine's first part runs before it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any


def start_eagerly(coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    """Run ``coro`` until it first suspends or ends. Returns None when it ended (its result is
    dropped; an exception it raised propagates to the caller), else the task that runs the rest
    (on the running loop)."""
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_rest(coro, yielded))


async def _rest(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    return await _Resume(coro, yielded)


class _Resume:
    """Awaitable that hands ``coro``'s pending yield (a future, or None for a bare yield) to the
    task, then drives ``coro`` as a task would: ``send`` when woken, ``throw`` on cancellation."""

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro, self._yielded = coro, yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                value = yield yielded
            except BaseException as exc:  # cancellation (or a throw) goes to where coro waits
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(value)
                except StopIteration as stop:
                    return stop.value
