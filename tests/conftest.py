"""Shared helpers: tiny checkpoints written the way trainers write them (exact references: references.py)."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from references import correctly_rounded, load_merged, same_bits  # noqa: F401 - for the tests, as before
from safetensors.torch import save_file


def write_checkpoint(
    folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1, config: dict | None = None
) -> Path:
    """Write ``tensors`` as HF safetensors: one ``model.safetensors`` or ``shards`` files + index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            part = names[i * per : (i + 1) * per]
            file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k] for k in part}, str(folder / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file_name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "toy"}))
    if folder.name.endswith("-merged"):  # a finished merge has its manifest; discovery checks it
        (folder / "ckptavg-manifest.json").write_text(json.dumps({"tool": "ckptavg", "files": {}}))
    return folder


def files_of(folder: Path, prefix: str = "model") -> dict[str, bytes]:
    """The bytes of a folder's files whose names start with ``prefix``: by default the weight
    shards and index of a merged output (its manifest names source paths, which differ)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith(prefix)}


def make_run(
    root: Path,
    steps: list[int],
    shapes: dict[str, tuple[int, ...]],
    dtype=torch.bfloat16,
    shards: int = 1,
    seed: int = 0,
):
    """A run folder of checkpoints that drift from a common base, as training does."""
    generator = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=generator, dtype=torch.float64) for k, s in shapes.items()}
    saved = {}
    for step in steps:
        tensors = {
            k: (v + 0.05 * torch.randn(v.shape, generator=generator, dtype=torch.float64)).to(dtype)
            for k, v in base.items()
        }
        write_checkpoint(root / f"step{step}", tensors, shards=shards)
        saved[step] = tensors
    return saved


def tree_of(root: Path) -> dict[str, object]:
    """Every entry under ``root``: file bytes, link targets, folders and special files (links not
    followed)."""
    found: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            key = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_dir():
                found[key] = "folder"
            elif not path.is_file():  # a FIFO or socket: reading it could block
                found[key] = ("special", stat.S_IFMT(path.lstat().st_mode))
            else:
                found[key] = path.read_bytes()
    return found


class Hang(BaseException):
    """Raised by :func:`alarm`: a BaseException, so that no ``except Exception`` in the code under
    test swallows it."""


@contextlib.contextmanager
def alarm(seconds: float = 60) -> Iterator[None]:
    """Fail, rather than wait forever, when the body hangs (a FIFO opened for reading, a link to
    ``/dev/zero`` read to its end)."""

    def on_alarm(_signum: int, _frame: object) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, address_space: int | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run the real entry point (``python -m ckptavg``) in a subprocess; with ``address_space``,
    capped at that many bytes (``ulimit -v``), so that an allocation out of proportion fails at
    once instead of succeeding on this machine or swapping it."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ckptavg", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=timeout,
        preexec_fn=None if address_space is None else functools.partial(_cap_address_space, address_space),
    )


def _cap_address_space(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def run_cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """:func:`run_cli` without a new interpreter: the same typer app, stdout and stderr captured
    apart, for tests that run many commands (a torch import costs ~2 s a process) or patch the
    OS calls of the command. An exception the CLI lets through is written to stderr with its
    traceback and gives status 1, as the interpreter does."""
    import traceback

    from typer.testing import CliRunner

    from ckptavg.cli import app

    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2 mixes stderr into stdout unless told
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps them apart
    result = runner.invoke(app, list(args), prog_name="ckptavg")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["ckptavg", *args], result.exit_code, result.stdout, stderr)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


S3_BUCKET = "ckptavg-test"


class RequestLog:
    """What an S3 server was asked: method, path, Range header and body bytes sent back."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def wrap(self, app):
        """A WSGI middleware that records every request to ``app`` and counts its body bytes."""

        def recorded(environ, start_response):
            record = {
                "method": environ["REQUEST_METHOD"],
                "path": environ.get("PATH_INFO", ""),
                "query": environ.get("QUERY_STRING", ""),
                "range": environ.get("HTTP_RANGE"),
                "bytes": 0,
            }
            with self._lock:
                self.requests.append(record)
            for chunk in app(environ, start_response):
                record["bytes"] += len(chunk)
                yield chunk

        return recorded


_S3_LOG = RequestLog()


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


def other_writer(url: str):
    """A filesystem instance of its own (no shared listing cache), as another process has."""
    protocol = url.split("://", 1)[0]
    fs = fsspec.filesystem(protocol, skip_instance_cache=True)
    return fs, fs._strip_protocol(url).rstrip("/")


def upload(local: Path, url: str) -> None:
    """Copy a local folder tree to ``url``, file by file."""
    fs, root = other_writer(url)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"{root}/{path.relative_to(local).as_posix()}", path.read_bytes())


class _DiskFull:
    """An open file that takes ``budget[0]`` more bytes (the budget is shared by every file),
    then fails as a full disk does."""

    def __init__(self, file, path: str, budget: list[int]) -> None:
        self._file, self._path, self._budget = file, path, budget

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self._budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
        self._budget[0] -= size
        return self._file.write(data)

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def fail_writes(monkeypatch: pytest.MonkeyPatch, prefix: str | Path, code: int, budget: int | None = None) -> None:
    """The OS refuses writes to paths starting with ``prefix`` (a folder: paths inside it):
    everything at once with errno ``code`` (a read-only mount, no permission), or, with
    ``budget``, file data past that many bytes in all (a full disk).

    Tests run as root, so a chmod would stop nothing; the calls the local writers make are
    patched instead: ``os.mkdir`` (``makedirs``), ``os.rename``/``os.replace``, and the ``open``
    that ``ckptavg.io.atomic.open_output`` creates files with. In-process only (see
    :func:`run_cli_in_process`)."""
    import ckptavg.io.atomic

    start = f"{prefix}{os.sep}" if isinstance(prefix, Path) else prefix
    left = [budget or 0]

    def refuse(path) -> None:
        if budget is None and str(path).startswith(start):
            raise OSError(code, os.strerror(code), str(path))

    real_mkdir, real_rename, real_replace = os.mkdir, os.rename, os.replace

    def mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        refuse(dst)
        return real_rename(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        refuse(dst)
        return real_replace(src, dst, *args, **kwargs)

    def fs_open(path, mode="r", *args, **kwargs):
        writing = any(flag in mode for flag in "wax+")
        if writing:
            refuse(path)
        file = open(path, mode, *args, **kwargs)  # noqa: SIM115 - the writer closes it
        if writing and budget is not None and str(path).startswith(start):
            return _DiskFull(file, str(path), left)
        return file

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    # open_output calls the bare name ``open``: a module global there shadows the builtin.
    monkeypatch.setattr(ckptavg.io.atomic, "open", fs_open, raising=False)
