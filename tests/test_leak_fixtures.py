"""The suite's leak fixtures (tests/conftest.py) fail the tests that leak, and only those."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def test_a_leaked_thread_fails_its_module_and_a_pending_task_its_test(pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(
        test_leaky="""
        import asyncio, threading

        stop = threading.Event()

        def test_starts_a_thread_and_leaves_it():
            threading.Thread(target=stop.wait, name="leaked-worker", daemon=True).start()

        def test_clean_thread_that_ends_after_the_test():
            threading.Thread(target=lambda: stop.wait(0.3), name="short-lived").start()

        async def test_leaves_a_task_pending():
            asyncio.ensure_future(asyncio.sleep(60), loop=asyncio.get_running_loop())

        def test_asyncio_run_with_a_forgotten_task():
            async def main():
                asyncio.ensure_future(asyncio.sleep(60))
            asyncio.run(main())

        def test_last_one_releases_the_thread_too_late():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 5, "errors": 3}, out
    assert "ERROR at teardown of test_leaves_a_task_pending" in out
    assert "ERROR at teardown of test_asyncio_run_with_a_forgotten_task" in out
    # Counted in the ERRORS section only: the short summary repeats each message, cut to the
    # terminal's width, so its count depends on COLUMNS.
    reports = [line for line in out.splitlines()
               if line.startswith("the test left asyncio tasks pending: 'Task-")]
    assert len(reports) == 2, out
    assert "threads left running after the module: 'leaked-worker' (started during " \
           "test_leaky.py::test_starts_a_thread_and_leaves_it)" in out
    assert "short-lived" not in out
