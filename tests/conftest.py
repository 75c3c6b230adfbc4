"""pytest fixtures shared by the tests (and nothing else: helpers are in helpers.py)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster
from helpers import S3_BUCKET, RequestLog

_S3_LOG = RequestLog()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An S3 server (moto) on 127.0.0.1 at a free port, for the whole session; yields the base
    URL of a fresh bucket, ``s3://ckptavg-test/``.

    s3fs finds it through ``AWS_ENDPOINT_URL`` (read by botocore whenever a client is made, so
    in-process CLI runs and subprocesses reach it too), with dummy credentials; the real AWS
    configuration files of the machine are hidden. s3fs instances cached by fsspec before or
    after the session would point elsewhere, so the instance cache is cleared at both ends.
    """
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request on stderr
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    server._server.app = _S3_LOG.wrap(server._server.app)  # werkzeug looks it up per request
    nowhere = str(tmp_path_factory.mktemp("aws") / "none")
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": nowhere,
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            patch.delenv(name, raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(S3_BUCKET)
            yield f"s3://{S3_BUCKET}/"
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            server.stop()


@pytest.fixture
def s3_prefix(s3_server: str) -> str:
    """A fresh folder URL in the test bucket for one test (``s3://ckptavg-test/<hex>``)."""
    return f"{s3_server}{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_requests(s3_server: str) -> RequestLog:
    """The log of the requests the S3 server gets during one test (emptied at its start)."""
    _S3_LOG.clear()
    return _S3_LOG


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
