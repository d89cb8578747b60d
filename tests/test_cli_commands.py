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
