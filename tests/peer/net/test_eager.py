"""start_eagerly: a coroutine's first part runs on the caller's stack; what suspends goes on as a
task, exactly where it stopped (results, exceptions and cancellation as a task gives them)."""

from __future__ import annotations

import asyncio

import pytest

from swarm.peer.net.eager import start_eagerly


def test_a_coroutine_that_never_suspends_runs_before_the_call_returns_and_needs_no_task():
    async def main():
        done = []

        async def inner():
            return 5

        async def handler():
            done.append(await inner())  # awaiting a coroutine that returns at once does not suspend

        assert start_eagerly(handler()) is None
        return done

    assert asyncio.run(main()) == [5]


def test_a_coroutine_that_suspends_goes_on_as_a_task_with_its_result_and_order():
    async def main():
        steps = []
        fut = asyncio.get_running_loop().create_future()

        async def handler():
            steps.append("before")
            value = await fut
            steps.append(("after", value))
            await asyncio.sleep(0)  # a bare yield too
            steps.append("end")
            return value * 2

        task = start_eagerly(handler())
        assert steps == ["before"] and isinstance(task, asyncio.Task) and not task.done()
        fut.set_result(21)
        return await task, steps

    result, steps = asyncio.run(main())
    assert result == 42
    assert steps == ["before", ("after", 21), "end"]


def test_an_exception_before_suspending_reaches_the_caller_and_after_it_the_task():
    async def main():
        async def early():
            raise ValueError("early")

        with pytest.raises(ValueError, match="early"):
            start_eagerly(early())

        async def late():
            await asyncio.sleep(0)
            raise KeyError("late")

        task = start_eagerly(late())
        with pytest.raises(KeyError, match="late"):
            await task

    asyncio.run(main())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits():
    async def main():
        seen = []

        async def handler():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                seen.append("cancelled where it waited")
                raise
            finally:
                seen.append("finally")

        task = start_eagerly(handler())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    assert asyncio.run(main()) == ["cancelled where it waited", "finally"]
