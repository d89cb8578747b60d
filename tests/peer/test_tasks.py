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


def test_eager_spawn_runs_the_first_part_now_and_owns_the_rest(caplog):
    async def main():
        tasks, seen = OwnedTasks("test"), []

        async def quick():
            seen.append("quick")

        async def slow():
            seen.append("slow started")
            await asyncio.sleep(3600)
            seen.append("slow resumed")  # never: cancelled first

        async def broken():
            raise RuntimeError("bad request")

        done = tasks.spawn(quick(), "quick", eager=True)
        rest = tasks.spawn(slow(), "slow", eager=True)
        before_any_iteration = list(seen)  # eager parts ran within spawn, not a loop iteration later
        failed = tasks.spawn(broken(), "broken", eager=True)
        await asyncio.sleep(0)
        await tasks.close()
        return done, rest, before_any_iteration, failed, seen

    with caplog.at_level("ERROR"):
        done, rest, before, failed, seen = asyncio.run(main())
    assert done is None and failed is None
    assert before == ["quick", "slow started"]
    assert rest.get_name() == "test-slow" and rest.cancelled() and seen == before
    assert "task test-broken failed" in caplog.text and "bad request" in caplog.text
