"""The config directory is one peer's identity: only one process at a time may run a peer from it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from swarm import paths
from swarm.errors import IdentityInUseError

HOLD = """
import sys, time
from pathlib import Path
from swarm import paths
paths.lock_config_dir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_process_cannot_lock_the_same_config_dir_until_the_first_ends(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(IdentityInUseError) as exc:
            paths.lock_config_dir(tmp_path)
        text = str(exc.value)
        assert f"(pid {holder.pid})" in text and str(tmp_path) in text and "COLIBRI_SWARM_CONFIG_DIR=" in text
    finally:
        holder.kill()  # the OS drops the lock with the process: nothing stale to clean up
        holder.wait()
    try:
        assert paths.lock_config_dir(tmp_path) == tmp_path.resolve() / paths.LOCK_FILE
        assert paths.lock_config_dir(tmp_path) == tmp_path.resolve() / paths.LOCK_FILE  # again: a no-op
    finally:
        paths.unlock_config_dir(tmp_path)


def test_other_config_dirs_are_independent(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    try:
        paths.lock_config_dir(a)
        paths.lock_config_dir(b)
    finally:
        paths.unlock_config_dir(a)
        paths.unlock_config_dir(b)


@pytest.mark.parametrize("which,env", [("cache", "COLIBRI_SWARM_CACHE_DIR"), ("config", "COLIBRI_SWARM_CONFIG_DIR")])
def test_a_directory_that_cannot_be_made_is_one_line_naming_it(tmp_path, monkeypatch, capsys, which, env):
    """A cache or config directory under a file (a mistyped variable, a read-only home) is a
    SwarmError naming the directory, the variable and the OS's reason — in the CLI one line
    and exit 2, not a traceback."""
    from swarm.cli import main
    from swarm.errors import SwarmError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(env, str(blocker / "dir"))
    with pytest.raises(SwarmError, match=rf"cannot create the {which} directory .*a-file/dir \(\${env}\): Not a dir"):
        getattr(paths, f"{which}_dir")()
    assert main(["status"] if which == "config" else ["generate", "--local", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot create the {which} directory" in err and "Traceback" not in err


def test_a_status_probe_holding_the_lock_for_a_moment_does_not_refuse_a_peer(tmp_path, monkeypatch):
    """`status` probes the lock shared for a moment; a peer starting meanwhile waits it out
    (it was refused as if another peer ran there: 68 of 1,836 tries beside a probing loop)."""
    import fcntl
    import threading

    (tmp_path / paths.LOCK_FILE).touch()
    fd = os.open(tmp_path / paths.LOCK_FILE, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the probe's (another open file: it conflicts here too)
    monkeypatch.setattr(paths, "LOCK_RETRY_S", 0.5)  # room for a late timer thread on a loaded machine
    release = threading.Timer(0.04, lambda: os.close(fd))  # a probe's moment
    release.start()
    try:
        assert paths.lock_config_dir(tmp_path) == tmp_path.resolve() / paths.LOCK_FILE
    finally:
        release.join()
