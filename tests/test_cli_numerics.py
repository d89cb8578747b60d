"""``--numerics float32|int8`` on generate and join: checked, named in the error with its choices,
and set for the process by ``_use_compute_options``; ``generate`` with int8 is this machine's own
compute, so it refuses the swarm's API; ``join`` takes int8, with ``--gpu`` too (the GPU's int8 GEMVs)."""

from __future__ import annotations

import os

import pytest

from swarm.cli import _use_compute_options, build_parser, main
from swarm.compute import numerics
from swarm.errors import SwarmError


@pytest.fixture
def clean_numerics(monkeypatch):
    """float32 in the environment, the process's numerics as they were: both restored after."""
    monkeypatch.setenv(numerics.NUMERICS_ENV, "float32")  # recorded first: undo restores the prior value
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)


def test_a_bad_numerics_names_the_flag_and_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--numerics", "int4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--numerics" in err and "'int4'" in err and "float32" in err and "int8" in err


def test_chat_takes_no_numerics(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--numerics", "int8"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --numerics" in capsys.readouterr().err


def test_numerics_is_set_for_the_process(clean_numerics, monkeypatch):
    _use_compute_options(build_parser().parse_args(["generate", "hi", "--numerics", "int8"]))
    assert numerics.numerics() == "int8" and os.environ[numerics.NUMERICS_ENV] == "int8"
    monkeypatch.setenv(numerics.NUMERICS_ENV, "fp8")  # a bad environment value, no flag
    with pytest.raises(SwarmError, match="float32, int8"):
        _use_compute_options(build_parser().parse_args(["generate", "hi"]))


def test_a_peer_joins_with_int8_from_the_flag_or_the_environment(clean_numerics, monkeypatch):
    _use_compute_options(build_parser().parse_args(["join", "--numerics", "int8"]), peer=True)
    assert numerics.numerics() == "int8"
    monkeypatch.setenv(numerics.NUMERICS_ENV, "float32")
    _use_compute_options(build_parser().parse_args(["join"]), peer=True)
    assert numerics.numerics() == "float32"
    monkeypatch.setenv(numerics.NUMERICS_ENV, "int8")
    _use_compute_options(build_parser().parse_args(["join"]), peer=True)
    assert numerics.numerics() == "int8"


@pytest.mark.parametrize("gpu", ["auto", "on"])
def test_a_gpu_peer_joins_with_int8_or_float32(clean_numerics, monkeypatch, gpu):
    _use_compute_options(build_parser().parse_args(["join", "--gpu", gpu, "--numerics", "int8"]), peer=True)
    assert numerics.numerics() == "int8"  # its int8 GEMVs serve an int8 swarm's ranges
    monkeypatch.setenv(numerics.NUMERICS_ENV, "float32")  # the flag above set it for the peers it starts
    _use_compute_options(build_parser().parse_args(["join", "--gpu", gpu]), peer=True)
    assert numerics.numerics() == "float32"
    assert "int8 GEMVs" in " ".join(build_parser()._subparsers._group_actions[0].choices["join"].format_help().split())


@pytest.mark.parametrize("route", [["--swarm"], ["--api", "https://127.0.0.1:9/v1"]])
def test_generate_with_int8_refuses_the_swarm(clean_numerics, route, capsys):
    assert main(["generate", "hi", "--numerics", "int8", *route]) != 0
    err = capsys.readouterr().err
    assert "--numerics int8 sets this machine's own compute" in err
    assert route[0] in err


def test_generate_with_int8_from_the_environment_goes_to_the_swarm(clean_numerics, monkeypatch):
    # $COLIBRI_SWARM_NUMERICS=int8 may be there for `join` in the same shell: --swarm is a client
    # of the swarm, which computes nothing here, so it is not refused for it.
    import swarm.cli.generate as generate

    monkeypatch.setenv(numerics.NUMERICS_ENV, "int8")
    asked = []
    monkeypatch.setattr(generate, "main_generate_swarm", lambda args: asked.append(args.prompt) or 0)
    assert main(["generate", "hi", "--swarm"]) == 0 and asked == ["hi"]


@pytest.mark.parametrize("command,says", [("generate", "int8 runs on this machine alone (refused with --swarm"),
                                           ("join", "gives work only to peers of its own numerics")])
def test_the_help_says_what_int8_trades(command, says):
    text = " ".join(build_parser()._subparsers._group_actions[0].choices[command].format_help().split())
    assert "--numerics {float32,int8}" in text and "llama.cpp" in text and "VNNI" in text and says in text


@pytest.fixture
def clean_threads(monkeypatch):
    """No ``$COLIBRI_SWARM_THREADS`` (``--threads`` sets it for the peers a command starts) and the
    process's thread count as it was: both restored after."""
    from swarm.compute import threads

    monkeypatch.setenv(threads.THREADS_ENV, "1")  # recorded first: undo restores the prior value (or none)
    monkeypatch.delenv(threads.THREADS_ENV)
    monkeypatch.setattr(threads, "_threads", threads._threads)


@pytest.mark.parametrize("route", [["--swarm"], ["--api", "https://127.0.0.1:9/v1"]])
def test_generate_with_threads_refuses_the_swarm(clean_numerics, clean_threads, route, capsys):
    """``--threads`` is this machine's compute: with the swarm's API it is refused in one line
    (the peers compute on their own ``join --threads``), not silently ignored."""
    assert main(["generate", "hi", "--threads", "2", *route]) == 2
    err = capsys.readouterr().err
    assert "--threads sets this machine's own compute" in err and route[0] in err


def test_generate_with_threads_replies_here_where_a_peer_runs(clean_numerics, clean_threads, monkeypatch):
    """``generate --threads N`` with a peer running here computes the reply on this machine, as
    ``--local`` does (through the swarm its threads would not apply); without it, the swarm."""
    import swarm.cli.generate as generate
    from swarm.compute import threads

    asked: list[str] = []
    monkeypatch.setattr(generate, "main_generate_swarm", lambda args: asked.append("swarm") or 0)
    monkeypatch.setattr(generate, "main_generate", lambda args: asked.append("here") or 0)
    assert main(["generate", "hi", "--threads", "1"]) == 0
    monkeypatch.delenv(threads.THREADS_ENV)  # set by the flag above
    assert main(["generate", "hi"]) == 0
    assert asked == ["here", "swarm"]
