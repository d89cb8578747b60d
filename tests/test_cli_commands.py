"""The command line as a whole: every option documented, every --help described, a closed pipe
ends any command quietly."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.cli import EXIT_BROKEN_PIPE, build_parser

REPO = Path(__file__).resolve().parents[1]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_is_in_the_readme_table(name):
    rows = [line for line in (REPO / "README.md").read_text().splitlines()
            if line.startswith(f"| `colibri-swarm {name}")]
    assert len(rows) == 1, f"README's command table has no single row for {name}"
    options = [o for a in _commands()[name]._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    missing = [o for o in options if not re.search(rf"`{re.escape(o)}[` ]", rows[0])]
    assert not missing, f"README's row for {name} lacks {missing}"


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_help_opens_with_a_description(name):
    parser = _commands()[name]
    assert parser.description and "\n" not in parser.description
    assert parser.format_help().split("\n\n")[1].replace("\n", " ").split() == parser.description.split()


@pytest.mark.parametrize("argv", [["key"], ["status", "--help"], ["--help"]])
def test_a_closed_pipe_ends_quietly(tmp_path, argv):
    """`colibri-swarm key | head -c 1`: no BrokenPipeError traceback; SIGPIPE's exit code (argparse's
    help swallows the error itself and exits 0)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), COLIBRI_SWARM_CONFIG_DIR=str(tmp_path))
    # A pipe whose reader has already gone: the first write fails, whatever its size.
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "-m", "swarm", *argv], stdout=write, stderr=subprocess.PIPE, env=env,
                          cwd=REPO, timeout=120)
    os.close(write)
    assert proc.stderr.decode() == ""
    assert proc.returncode == (0 if "--help" in argv else EXIT_BROKEN_PIPE)


def _env(config_dir: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLIBRI_SWARM_CONFIG_DIR=str(config_dir))
    env.pop("COLIBRI_SWARM_API_KEY", None)
    return env


def test_a_new_key_is_refused_while_a_peer_runs_from_the_config_dir(tmp_path, monkeypatch, capsys):
    """The running peer would go on with the old key; once it stops, --new replaces the key."""
    from swarm.cli import main
    from swarm.keys import swarmkey

    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path))
    old = swarmkey.create()
    # A real process holding the config directory's lock, as a running `join` does.
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from swarm.paths import lock_config_dir; "
                               "lock_config_dir(); print('locked', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["key", "--new"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"colibri-swarm: error: a colibri-swarm peer (pid {holder.pid}) runs from {tmp_path} with the current "
            "key and would go on using it: stop that `colibri-swarm join` first, then run `colibri-swarm key --new`"]
        assert swarmkey.load() == old
    finally:
        holder.communicate("", timeout=60)  # EOF on stdin: it exits and the OS drops the lock
    assert main(["key", "--new"]) == 0
    assert swarmkey.load() not in (None, old)


def test_status_runs_without_the_webrtc_stack(tmp_path):
    """`status` only reads the status file: the whole command runs without importing aiortc."""
    import json
    import time

    from swarm.peer.status import STATUS_FILE

    doc = {"pid": os.getpid(), "updated": time.time() + 3600, "swarm_id": "swarm-no-rtc", "peer_id": "p" * 26,
           "name": "here", "role": "coordinator", "peers": [], "placement": None, "events": []}
    (tmp_path / STATUS_FILE).write_text(json.dumps(doc))
    code = ("import sys; from swarm.cli import main; rc = main(['status']); "
            "print('modules', sorted(m for m in sys.modules if m.split('.')[0] in ('aiortc', 'aioice', 'av'))); "
            "sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path),
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "swarm-no-rtc" in out.stdout
    assert "modules []" in out.stdout, out.stdout


def test_status_watch_into_a_pipe_prints_a_snapshot_per_interval(tmp_path):
    """No terminal to redraw: plain snapshots, each with the swarm, never silence."""
    import json
    import threading
    import time

    from swarm.peer.status import STATUS_FILE

    doc = {"pid": os.getpid(), "updated": time.time() + 3600, "swarm_id": "swarm-in-a-pipe", "peer_id": "p" * 26,
           "name": "here", "role": "coordinator", "peers": [], "placement": None, "events": []}
    (tmp_path / STATUS_FILE).write_text(json.dumps(doc))
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "status", "--watch"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=REPO)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if sum("swarm-in-a-pipe" in x for x in lines) >= 2:
                seen.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(120), f"two snapshots expected, got {''.join(lines)!r}"
    finally:
        proc.kill()
        proc.wait(30)
    text = "".join(lines)
    assert "\x1b" not in text  # plain text: no cursor movement or colours into a pipe
    assert "this peer here (" + "p" * 26 + "), coordinator" in text


def test_piped_chat_ends_its_output_with_a_newline(tmp_path):
    """Input ending at once (EOF) leaves the prompt's line ended. The REPL first asks the API for
    its models (a chat whose API does not answer fails at the start): an HTTP server answers that."""
    from tests.static_http import serving

    env = _env(tmp_path)
    env["COLIBRI_SWARM_API_KEY"] = "t" * 64
    with serving(b'{"object": "list", "data": []}', "application/json") as port:
        proc = subprocess.run([sys.executable, "-m", "swarm", "chat", "--api", f"http://127.0.0.1:{port}/v1"],
                              input="", capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("> \n")


def test_join_with_a_memory_cap_that_leaves_nothing_is_refused(tmp_path):
    """``join --memory 10``: ten MiB is below what the process itself takes, so the peer could
    hold nothing and would run far past its cap; it is refused in one line naming the numbers
    (a typo — MiB for GiB — is the usual cause), not joined with a warning in the log."""
    proc = subprocess.run([sys.executable, "-m", "swarm", "join", "--no-model", "--memory", "10"],
                          capture_output=True, text=True, env=_env(tmp_path), cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "--memory 10 (MiB, the whole process) leaves nothing for weights" in line
    assert "already takes" in line and "give more than" in line and "Traceback" not in proc.stderr
