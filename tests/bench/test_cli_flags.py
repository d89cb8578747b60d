"""The benches refuse an option that would be ignored: one of ``bench/serve.py --pipeline`` given
without ``--pipeline``, ``bench/web_peer.py --int8-activations`` without ``--blocks`` and its
``--rows-per-thread`` without ``--int8-activations`` or with a count the kernel lacks. Refused by
the parser (exit 2, a message naming both flags and what to do) before any model or device is
touched. And ``--pipeline --profile`` removes its stage workers' stamp directory when the run
ends, as it ends or fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *flags: str) -> subprocess.CompletedProcess:
    """The bench with ``flags``. Each test adds a malformed value of the run they would start
    (``--levels``, ``--shapes``: read before any work), so that a refusal gone missing fails at
    once instead of starting the bench."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *flags], capture_output=True, text=True,
                          timeout=60)


def _serve():
    spec = importlib.util.spec_from_file_location("bench_serve_flags", ROOT / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_refuses_profile_without_pipeline():
    done = _run("serve.py", "--profile", "--levels", "none")
    assert done.returncode == 2 and done.stdout == ""
    assert "--profile only applies to --pipeline runs: add --pipeline, or drop --profile" in done.stderr


def test_serve_refuses_every_pipeline_option_without_pipeline():
    done = _run("serve.py", "--streams", "8", "--cores", "0,1", "--schedulers", "3", "--split", "11",
                "--unpriced", "--lengths", "mixed", "--evening-off", "--out", "x.json", "--levels", "none")
    assert done.returncode == 2 and done.stdout == ""
    assert ("--streams, --cores, --schedulers, --split, --unpriced, --lengths, --evening-off, --out only apply to "
            "--pipeline runs: add --pipeline, or drop --streams and --cores and --schedulers and --split and "
            "--unpriced and --lengths and --evening-off and --out") in done.stderr


def test_serve_pipeline_options_take_their_defaults_with_pipeline():
    serve = _serve()
    parser = argparse.ArgumentParser()
    args = argparse.Namespace(pipeline=True, streams=None, cores=None, schedulers=None, split=None, profile=False,
                              unpriced=False, lengths=None, evening_off=False, out=None)
    serve._check_pipeline_options(parser, args)
    assert vars(args) == {"pipeline": True, "streams": "8,16", "cores": "0,1", "schedulers": "", "split": None,
                          "profile": False, "unpriced": False, "lengths": "equal", "evening_off": False, "out": None}
    given = argparse.Namespace(pipeline=True, streams="4", cores="0-7,8-15", schedulers="3", split="11", profile=True,
                               unpriced=True, lengths="mixed", evening_off=True, out="o.json")
    serve._check_pipeline_options(parser, given)
    assert given.streams == "4" and given.cores == "0-7,8-15" and given.profile


def test_web_peer_refuses_int8_activations_without_blocks():
    done = _run("web_peer.py", "--int8-activations", "--shapes", "none")
    assert done.returncode == 2 and done.stdout == ""
    assert "--int8-activations only applies to --blocks runs: add --blocks, or drop --int8-activations" in done.stderr


@pytest.mark.parametrize("argv,message", [
    (("--rows-per-thread", "2"), "--rows-per-thread only applies to --int8-activations runs"),
    (("--blocks", "--int8-activations", "--rows-per-thread", "1,3"), "--rows-per-thread takes counts from 1, 2, 4, 8"),
    (("--blocks", "--int8-activations", "--rows-per-thread", "two"), "--rows-per-thread takes counts from 1, 2, 4, 8"),
], ids=["without-int8", "count-3", "not-a-number"])
def test_web_peer_refuses_rows_per_thread_it_would_ignore_or_lacks(argv, message):
    done = _run("web_peer.py", *argv)
    assert done.returncode == 2 and done.stdout == ""
    assert message in done.stderr


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "fails"])
def test_profile_stamp_directory_is_removed_when_the_run_ends(fails, tmp_path, monkeypatch):
    """The run itself (model, stage workers) replaced by one that writes a worker's stamp file into
    the directory it is given: after the run, nothing is left in the temporary directory."""
    serve = _serve()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def run(args, stamps):
        assert stamps is not None and stamps.is_dir() and stamps.parent == tmp_path
        (stamps / "worker1.json").write_text("{}")
        seen.append(stamps)
        if fails:
            raise RuntimeError("a stage worker failed")
        return {"runs": {}}

    monkeypatch.setattr(serve, "_pipeline_run", run)
    args = argparse.Namespace(profile=True)
    if fails:
        with pytest.raises(RuntimeError, match="a stage worker failed"):
            serve._pipeline_main(args)
    else:
        assert serve._pipeline_main(args) == {"runs": {}}
    assert len(seen) == 1 and list(tmp_path.iterdir()) == []


def test_no_stamp_directory_without_profile(tmp_path, monkeypatch):
    serve = _serve()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(serve, "_pipeline_run", lambda args, stamps: {"stamps": stamps})
    assert serve._pipeline_main(argparse.Namespace(profile=False)) == {"stamps": None}
    assert list(tmp_path.iterdir()) == []


def test_serve_counts_the_gaps_after_every_stream_started_apart():
    """``p95_token_ms_all_started`` takes only the gaps that begin once every stream has its first
    token: a stream's gap that began while another was still waiting for its first is left out."""
    gaps = _serve()._gaps([[0.0, 1.0, 2.0, 3.0], [2.5, 3.0, 4.0], []])
    assert list(gaps) == [1.0, 1.0, 1.0, 0.5, 1.0]
    assert gaps.steady == [0.5, 1.0]  # from 2.5 on: stream 0's last gap began at 2.0, before stream 1's first token
