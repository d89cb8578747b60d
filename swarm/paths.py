"""Where colibri-swarm keeps its files.

``config_dir()`` holds secrets (device identity, swarm key; created 0700, files 0600);
``cache_dir()`` holds downloads and shipped weights (safe to delete). Both follow the
platform's conventions (platformdirs) and can be moved with the environment variables
``COLIBRI_SWARM_CONFIG_DIR`` and ``COLIBRI_SWARM_CACHE_DIR`` (tests and several peers on one
machine use these).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "colibri-swarm"


def config_dir() -> Path:
    """The user config directory, created with mode 0700 if missing."""
    path = Path(os.environ.get("COLIBRI_SWARM_CONFIG_DIR") or platformdirs.user_config_dir(APP_NAME))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """The user cache directory, created if missing."""
    path = Path(os.environ.get("COLIBRI_SWARM_CACHE_DIR") or platformdirs.user_cache_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
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
