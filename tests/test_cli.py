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


import pytest


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "hi", "--seed", "-1"], "seed must be at least 0"),
        (["join", "--verify", "200"], "percentage from 0 to 100"),
        (["join", "--verify", "nan"], "percentage from 0 to 100"),
        (["join", "--memory", "-5"], "memory budget (MiB) must be at least 1"),
        (["join", "--signal", "ftp://host:1"], "signaling runs over TLS only"),
        (["join", "--signal", "10.0.0.2"], "names no port"),
    ],
)
def test_bad_option_values_get_one_clear_line(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_good_option_values_parse():
    args = build_parser().parse_args(["join", "--verify", "12.5", "--memory", "512", "--signal", "10.0.0.2:8443"])
    assert (args.verify, args.memory, args.signal) == (12.5, 512, "wss://10.0.0.2:8443/ws")


@pytest.mark.parametrize("form", ["10.0.0.2:8443", "https://10.0.0.2:8443", "https://10.0.0.2:8443/",
                                  "wss://10.0.0.2:8443", "wss://10.0.0.2:8443/ws"])
def test_every_documented_signal_form_becomes_one_url(form):
    assert build_parser().parse_args(["join", "--signal", form]).signal == "wss://10.0.0.2:8443/ws"


def test_sampling_params_refuse_a_negative_seed():
    from swarm.compute import SamplingParams

    with pytest.raises(ValueError, match="seed must be >= 0"):
        SamplingParams(seed=-1)
