"""Shared helpers of the tests: tiny checkpoints written the way trainers write them, the CLI run
in a subprocess or in process, faults injected into the OS calls of the writers. Exact numeric
references are in references.py, trainer-format builders in checkpoint_builders.py, training
loops in training.py; pytest fixtures (and only fixtures) in conftest.py."""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import fsspec
import pytest
import torch
from safetensors.torch import save_file

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def load_script(path: Path, name: str) -> ModuleType:
    """A script of the repository (``benchmarks/gpu_check.py``, ...) imported as the module
    ``name``: registered in ``sys.modules`` (its dataclasses look their module up there), with its
    own folder on the path while it loads, as when it runs as a script and imports its neighbours."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


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


def stat_tree(root: Path) -> dict[str, tuple[object, int, int]]:
    """Every entry under ``root`` and ``root`` itself, hidden ones included: its content (as
    :func:`tree_of`), inode and modification time in nanoseconds, so that a comparison shows
    whether anything was written, replaced or touched."""
    contents = tree_of(root)
    found = {}
    for key in ["", *contents]:
        info = (root / key).lstat()
        found[key] = (contents.get(key, "folder"), info.st_ino, info.st_mtime_ns)
    return found


def poison_tensor_data(*checkpoints: Path) -> None:
    """Overwrite the tensor data of every safetensors file of ``checkpoints`` with 0xFF bytes (NaN
    in every float dtype), headers and sizes unchanged: a merge that reads any tensor of them now
    fails, one that only reads headers cannot tell."""
    for folder in checkpoints:
        for path in folder.glob("*.safetensors"):
            data = path.read_bytes()
            start = 8 + int.from_bytes(data[:8], "little")
            path.write_bytes(data[:start] + b"\xff" * (len(data) - start))


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


TORCHRUN = Path(sys.executable).parent / "torchrun"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the variables of a launcher (the tests may run under one)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def torchrun(processes: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N -m ckptavg ARGS``."""
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(processes), "-m", "ckptavg", *args]
    return subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300)


def run_scripts(*commands: tuple[str, ...], timeout: float = 600) -> None:
    """Run scripts of tests/ (``("lightning_run.py", OUT)``: a framework saving or loading
    checkpoints, in processes of its own), all at once, and wait for them; a failure shows the
    end of its stderr."""
    processes = [
        subprocess.Popen(
            [sys.executable, str(TESTS / script), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for script, *args in commands
    ]
    try:
        for command, process in zip(commands, processes, strict=True):
            _, stderr = process.communicate(timeout=timeout)
            assert process.returncode == 0, f"{' '.join(command)} failed:\n{stderr[-4000:]}"
    finally:
        for process in processes:
            if process.poll() is None:  # another failed first, or this one ran out of time
                process.kill()
                process.wait()


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
    patched instead: ``os.mkdir`` (``makedirs``), ``os.rename``/``os.replace``, the rename that
    publishes an output (``rename_no_replace``), and the ``open`` that
    ``ckptavg.io.atomic.open_output`` creates files with. In-process only (see
    :func:`run_cli_in_process`)."""
    import ckptavg.io.atomic
    import ckptavg.merging.publish

    start = f"{prefix}{os.sep}" if isinstance(prefix, Path) else prefix
    left = [budget or 0]

    def refuse(path) -> None:
        if budget is None and str(path).startswith(start):
            raise OSError(code, os.strerror(code), str(path))

    real_mkdir, real_rename, real_replace = os.mkdir, os.rename, os.replace
    real_no_replace = ckptavg.merging.publish.rename_no_replace

    def mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        refuse(dst)
        return real_rename(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        refuse(dst)
        return real_replace(src, dst, *args, **kwargs)

    def rename_no_replace(src, dst):
        refuse(dst)
        return real_no_replace(src, dst)

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
    monkeypatch.setattr(ckptavg.merging.publish, "rename_no_replace", rename_no_replace)
    # open_output calls the bare name ``open``: a module global there shadows the builtin.
    monkeypatch.setattr(ckptavg.io.atomic, "open", fs_open, raising=False)
