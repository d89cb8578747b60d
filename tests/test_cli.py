import subprocess
import sys

from swarm.cli import build_parser, main


def test_help_lists_every_command(capsys):
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("generate", "join", "key", "status", "chat"):
        assert cmd in text


def test_bad_argument_exits_nonzero():
    proc = subprocess.run([sys.executable, "-m", "swarm", "generate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "prompt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert "colibri-swarm 0.1.0" in capsys.readouterr().out
