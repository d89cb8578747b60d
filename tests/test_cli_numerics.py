"""``--numerics float32|int8`` on generate, chat and join: checked, named in the error with its
choices, and set for the process (and the peers it starts) by ``_use_compute_options``."""

from __future__ import annotations

import pytest

from swarm.cli import _use_compute_options, build_parser, main
from swarm.compute import numerics
from swarm.errors import SwarmError


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["join"]])
def test_a_bad_numerics_names_the_flag_and_the_choices(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--numerics", "int4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--numerics" in err and "'int4'" in err and "float32" in err and "int8" in err


def test_numerics_is_set_for_the_process_and_its_peers(monkeypatch):
    monkeypatch.delenv(numerics.NUMERICS_ENV, raising=False)
    args = build_parser().parse_args(["generate", "hi", "--numerics", "int8"])
    try:
        _use_compute_options(args)
        assert numerics.numerics() == "int8"
        import os

        assert os.environ[numerics.NUMERICS_ENV] == "int8"
        monkeypatch.setenv(numerics.NUMERICS_ENV, "fp8")  # a bad environment value, no flag
        with pytest.raises(SwarmError, match="float32, int8"):
            _use_compute_options(build_parser().parse_args(["generate", "hi"]))
    finally:
        numerics.set_numerics("float32")


def test_the_help_says_what_int8_trades():
    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--numerics {float32,int8}" in text and "llama.cpp" in text
