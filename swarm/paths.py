"""Where colibri-swarm keeps its files.

``config_dir()`` holds secrets (device identity, swarm key; created 0700, files 0600);
``cache_dir()`` holds downloads and shipped weights (safe to delete). Both follow the
platform's conventions (platformdirs) and can be moved with the environment variables
``COLIBRI_SWARM_CONFIG_DIR`` and ``COLIBRI_SWARM_CACHE_DIR`` (tests and several peers on one
machine use these).

The config directory is one peer's identity: :func:`lock_config_dir` lets only one process at a
time run a peer from it (two would share a peer id and split the swarm).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import platformdirs

from swarm.errors import IdentityInUseError, SwarmError

APP_NAME = "colibri-swarm"
IDENTITY_FILE = "identity.pem"  # the device key and DTLS certificate (swarm.keys.identity)
LOCK_FILE = "peer.lock"  # held by the process that runs a peer from this config directory
CONFIG_DIR_ENV = "COLIBRI_SWARM_CONFIG_DIR"

_locks: dict[Path, int] = {}  # config dir -> the open, locked file descriptor of this process


CACHE_DIR_ENV = "COLIBRI_SWARM_CACHE_DIR"


def config_dir() -> Path:
    """The user config directory, created with mode 0700 if missing. Raises SwarmError when it
    cannot be created (a path through a file, no permission), naming the variable that moves it."""
    return _made(Path(os.environ.get(CONFIG_DIR_ENV) or platformdirs.user_config_dir(APP_NAME)),
                 "config", CONFIG_DIR_ENV, 0o700)


def cache_dir() -> Path:
    """The user cache directory, created if missing. Raises SwarmError as :func:`config_dir`."""
    return _made(Path(os.environ.get(CACHE_DIR_ENV) or platformdirs.user_cache_dir(APP_NAME)), "cache", CACHE_DIR_ENV)


def _made(path: Path, what: str, env: str, mode: int = 0o777) -> Path:
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        set_by = f"${env}" if os.environ.get(env) else f"the platform's default; ${env} moves it"
        raise SwarmError(f"cannot create the {what} directory {path} ({set_by}): {exc.strerror or exc}") from None
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600, atomically (never a half-written secret).

    The bytes go to a temporary file beside ``path`` (created 0600, exclusively) that then
    replaces ``path``; on any error the temporary file is removed and the error re-raised.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def identity_file() -> Path:
    """``config_dir()/identity.pem``: deleting it gives this machine a new peer id."""
    return config_dir() / IDENTITY_FILE


def lock_config_dir(directory: Path | None = None) -> Path:
    """Lock ``directory`` (default ``config_dir()``) to this process until it exits; return the lock file.

    An exclusive ``flock`` on ``peer.lock``, which also records our pid. The OS releases it when
    the process ends, however it ends, so a crash leaves nothing to clean up. Calling again in
    the same process is a no-op. Raises IdentityInUseError naming the process that holds it.
    """
    import fcntl  # POSIX (Linux, macOS): the platforms a peer runs on

    directory = (directory or config_dir()).resolve()
    path = directory / LOCK_FILE
    if directory in _locks:
        return path
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock_exclusive(fd)
    except BlockingIOError:
        pid = _lock_pid(fd)
        holder = f" (pid {pid})" if pid else ""
        os.close(fd)
        raise IdentityInUseError(
            f"another colibri-swarm peer{holder} already runs from {directory}: one identity serves one "
            f"process. Stop that one first, or run this one with its own identity: "
            f"{CONFIG_DIR_ENV}=<another directory> colibri-swarm join ...") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _locks[directory] = fd
    return path


LOCK_TRIES, LOCK_RETRY_S = 5, 0.025  # `status` probes the lock for a moment (shared): wait that out


def _lock_exclusive(fd: int) -> None:
    """``flock(fd, LOCK_EX | LOCK_NB)``, tried again for ~0.1 s while it is held: a `status`
    probing the directory holds it shared for a moment. BlockingIOError when it stays held."""
    import fcntl
    import time

    for attempt in range(LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == LOCK_TRIES - 1:
                raise
            time.sleep(LOCK_RETRY_S)


def config_dir_holder(directory: Path | None = None) -> int | None:
    """The pid of the process running a peer from ``directory`` (default ``config_dir()``): the
    holder of :func:`lock_config_dir`'s lock; 0 when it holds the lock but wrote no pid (yet);
    None when no process holds it (this process's own lock counts)."""
    import fcntl

    directory = (directory or config_dir()).resolve()
    if directory in _locks:
        return os.getpid()
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:  # another user's directory; a file system without locks
        raise SwarmError(f"cannot read {path} to see whether a peer runs from {directory}: "
                         f"{exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken only when nobody holds it exclusively
    except BlockingIOError:
        return _lock_pid(fd)
    except OSError as exc:
        raise SwarmError(f"cannot lock {path} to see whether a peer runs from {directory}: "
                         f"{exc.strerror or exc}") from None
    finally:
        os.close(fd)  # also releases the probe's shared lock
    return None


def _lock_pid(fd: int) -> int:
    """The pid the lock's holder wrote into the lock file; 0 when unreadable."""
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return 0


def unlock_config_dir(directory: Path | None = None) -> None:
    """Release :func:`lock_config_dir`'s lock early (a peer that stops but whose process goes on)."""
    fd = _locks.pop((directory or config_dir()).resolve(), None)
    if fd is not None:
        os.close(fd)
