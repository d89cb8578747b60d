"""OwnedTasks: the tasks of one role, cancelled together when it stops; none start after."""

from __future__ import annotations

import asyncio

from swarm.peer.tasks import OwnedTasks


def test_after_close_spawn_starts_nothing_and_closes_the_coroutine():
    async def main():
        tasks, ran = OwnedTasks("test"), []

        async def work(tag):
            ran.append(tag)
            await asyncio.sleep(3600)

        first = tasks.spawn(work("before"), "before")
        await asyncio.sleep(0)
        await tasks.close()
        late = work("after")
        refused = tasks.spawn(late, "after")
        await asyncio.sleep(0)
        # a closed coroutine cannot be started again (and warns of nothing when collected)
        return first.cancelled(), refused, ran, late.cr_frame is None

    cancelled, refused, ran, closed = asyncio.run(main())
    assert cancelled and refused is None and ran == ["before"] and closed


def test_cancel_all_alone_leaves_the_set_open():
    async def main():
        tasks = OwnedTasks("test")
        await tasks.cancel_all()
        task = tasks.spawn(asyncio.sleep(0, result="ran"), "again")
        return await task

    assert asyncio.run(main()) == "ran"
