"""pytest fixtures shared by the tests (and nothing else: helpers are in helpers.py); those the
docs' examples use too (the S3 server) are in the repository's conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
