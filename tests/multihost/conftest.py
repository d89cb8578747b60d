"""Fixtures for multi-host tests: ``netns_lab(n)`` builds a lab of n namespaces (netns.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import require
from tests.multihost.netns import NetnsLab


@pytest.fixture
def netns_lab(tmp_path: Path) -> Iterator[Callable[[int], NetnsLab]]:
    """A factory: ``lab = netns_lab(3)``; every lab is torn down after the test, pass or fail."""
    require(shutil.which("ip") is not None, "iproute2 (`apt-get install iproute2`) for network namespaces")
    require(os.geteuid() == 0, "root (network namespaces need CAP_NET_ADMIN): run the multi-host tests as root")
    labs: list[NetnsLab] = []

    def make(n: int) -> NetnsLab:
        lab = NetnsLab(n, tmp_path)
        labs.append(lab)
        return lab.setup()

    try:
        yield make
    finally:
        for lab in labs:
            lab.close()
