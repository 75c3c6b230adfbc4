"""pytest fixtures shared by the tests (and nothing else: helpers are in helpers.py); those the
docs' examples use too (the S3 server) are in the repository's conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.SlurmCluster]:
    """A real two-node SLURM cluster on loopback for the whole session (tests/slurm_cluster.py):
    slurm-wlm and munge installed where missing, stopped at the end with every process of its
    jobs. Where it cannot be had (not root, no apt-get) its tests skip with the reason, except
    under CI (``CI=true``), where that is a failure."""
    reason = slurm_cluster.unavailable()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true, but no SLURM cluster: {reason}")
        pytest.skip(reason)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
