"""Shared fixtures for the whole suite.

Tests that need something missing (a package, root for network namespaces, Chromium)
fail loudly with what to install; they are never skipped silently.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

# Keep BLAS deterministic and within the 2 cores of CI.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def require(condition: bool, what: str) -> None:
    """Fail (never skip) when a test prerequisite is missing; `what` says how to get it."""
    if not condition:
        pytest.fail(f"missing test prerequisite: {what}", pytrace=False)


LEAK_GRACE_S = 3.0  # seconds a thread started by a test may take to end after its module (a closing socket, a join)
# Process-wide daemon threads of third-party libraries, started on first use and never stopped.
ALLOWED_THREADS = (
    "tqdm_monitor",  # tqdm's monitor of slow progress bars (default_model's download bar)
    "compute-",  # the engine's process-wide pool of compute threads (swarm/compute/threads.py), by prefix
)

_started_in_module: dict[threading.Thread, str] = {}  # thread → the test during which it started


def _threads_still_running(threads) -> list[threading.Thread]:
    """``threads`` still alive after waiting up to LEAK_GRACE_S for them to end."""
    deadline = time.monotonic() + LEAK_GRACE_S
    while (alive := [t for t in threads if t.is_alive()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.fixture(scope="module", autouse=True)
def no_thread_outlives_its_module():
    """Fail the module whose tests started threads that are still running once its fixtures ended.

    A thread may outlive the test that started it when a module-scoped fixture owns it (a server's
    executor spawns its worker on first use); it must not outlive the module.
    """
    yield
    alive = _threads_still_running(list(_started_in_module))
    started = dict(_started_in_module)
    _started_in_module.clear()
    if alive:
        pytest.fail("threads left running after the module: " + "; ".join(
            f"{t.name!r} (started during {started[t]})" for t in alive) + " (their owner must stop and join them)",
            pytrace=False)


@pytest.fixture(autouse=True)
def no_leaked_threads_or_tasks(request, monkeypatch):
    """Fail a test that leaves asyncio tasks pending when its event loop ends, and note its threads.

    Tasks: those still pending when an ``asyncio.Runner`` (``asyncio.run``, pytest-asyncio's loop)
    closes, before it cancels them. Threads (executors' workers included) that the test started and
    that are still running when it ends are checked again, after a short grace, at the end of the
    module (:func:`no_thread_outlives_its_module`).
    """
    threads_before = set(threading.enumerate())
    pending: list[asyncio.Task] = []
    close = asyncio.Runner.close

    def close_checking_tasks(runner: asyncio.Runner) -> None:
        loop = getattr(runner, "_loop", None)  # None until the runner ran something
        if loop is not None and not loop.is_closed():
            pending.extend(t for t in asyncio.all_tasks(loop) if not t.done())
        close(runner)

    monkeypatch.setattr(asyncio.Runner, "close", close_checking_tasks)
    yield
    # Noted without waiting: the module's end gives each the grace (one wait for all of them), so
    # a thread that a module fixture owns costs no grace here and one that is ending is not failed.
    for thread in threading.enumerate():
        if thread not in threads_before and not thread.name.startswith(ALLOWED_THREADS):
            _started_in_module.setdefault(thread, request.node.nodeid)
    if pending:
        pytest.fail("the test left asyncio tasks pending: " + "; ".join(
            f"{t.get_name()!r} running {t.get_coro()!r}" for t in pending) + " (their owner must cancel and await them)",
            pytrace=False)
