"""The slow-callback check the multi-host tests run every peer with: a callback that works on
the event loop for 150 ms is a warning that says where the loop spent it (and how much of it
went to collecting garbage); one that only waits as long (a sleep, or a core busy elsewhere) is
not; a bad setting is refused by name."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from swarm.errors import SwarmError
from swarm.peer.loopwatch import PREFIX, SLOW_CALLBACK_ENV, watch_slow_callbacks


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _callbacks() -> None:
    loop = asyncio.get_running_loop()
    with watch_slow_callbacks(loop):
        await asyncio.sleep(0.05)  # the sampler has a history to look back on
        loop.call_soon(_burn, 0.15)
        await asyncio.sleep(0.05)
        loop.call_soon(time.sleep, 0.15)
        await asyncio.sleep(0.05)


def test_work_on_the_loop_is_a_warning_waiting_is_not(monkeypatch, caplog):
    monkeypatch.setenv(SLOW_CALLBACK_ENV, "0.1")
    with caplog.at_level(logging.INFO, logger="asyncio"):
        asyncio.run(_callbacks())
    slow = [r for r in caplog.records if r.getMessage().startswith(PREFIX)]
    burned = [r for r in slow if "_burn" in r.getMessage()]
    slept = [r for r in slow if "sleep" in r.getMessage() and "_burn" not in r.getMessage()]
    assert len(burned) == 1 and burned[0].levelno == logging.WARNING, [r.getMessage() for r in slow]
    cpu = float(burned[0].getMessage().rsplit(", ", 1)[1].split()[0])
    assert cpu >= 0.1
    where = burned[0].getMessage().split(" CPU at ", 1)[1]
    assert where.startswith("test_loopwatch.py:") and " _burn < " in where, where  # innermost frame first
    assert len(slept) == 1 and slept[0].levelno == logging.INFO, [r.getMessage() for r in slow]


def test_without_the_setting_the_loop_runs_as_usual(monkeypatch):
    monkeypatch.delenv(SLOW_CALLBACK_ENV, raising=False)

    async def check() -> bool:
        with watch_slow_callbacks(asyncio.get_running_loop()):
            return asyncio.get_running_loop().get_debug()

    assert asyncio.run(check()) is False


@pytest.mark.parametrize("value", ["fast", "0", "-1", "nan"])
def test_a_bad_setting_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(SLOW_CALLBACK_ENV, value)

    async def check() -> None:
        with watch_slow_callbacks(asyncio.get_running_loop()):
            pass

    with pytest.raises(SwarmError, match=SLOW_CALLBACK_ENV):
        asyncio.run(check())


def _collect(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        gc.collect()


def test_a_garbage_collection_on_the_loop_is_named(monkeypatch, caplog):
    monkeypatch.setenv(SLOW_CALLBACK_ENV, "0.1")
    heap = [[i] for i in range(300_000)]  # objects for each full collection to walk

    async def run() -> None:
        loop = asyncio.get_running_loop()
        with watch_slow_callbacks(loop):
            await asyncio.sleep(0.05)
            loop.call_soon(_collect, 0.15)
            await asyncio.sleep(0.05)

    with caplog.at_level(logging.INFO, logger="asyncio"):
        asyncio.run(run())
    del heap
    slow = [r.getMessage() for r in caplog.records if "_collect" in r.getMessage()]
    assert len(slow) == 1, slow
    gc_s = float(slow[0].split(" s of it collecting garbage")[0].rsplit("(", 1)[1])
    assert gc_s >= 0.1, slow  # nearly all of the callback's CPU time
