"""Fixtures for multi-host tests: ``netns_lab(n)`` builds a lab of n namespaces (netns.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swarm.compute.quant import prepare_kernels
from tests.conftest import require
from tests.multihost.netns import NetnsLab


@pytest.fixture
def netns_lab(tmp_path: Path) -> Iterator[Callable[[int], NetnsLab]]:
    """A factory: ``lab = netns_lab(3)``; every lab is torn down after the test, pass or fail."""
    require(shutil.which("ip") is not None, "iproute2 (`apt-get install iproute2`) for network namespaces")
    require(os.geteuid() == 0, "root (network namespaces need CAP_NET_ADMIN): run the multi-host tests as root")
    # Compiled (or loaded) here, into the cache every lab's peers read (NetnsLab.env), so that on
    # a machine without them they compile once, not once in every peer of every test.
    prepare_kernels()
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
