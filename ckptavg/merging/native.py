"""The uniform mean's loop in C, called through ctypes without the GIL; torch's ops otherwise.

Why: the torch path makes ~9 calls per cache block, and each call takes the GIL back on return,
so the arithmetic threads of one process queue for it. Measured on the 2-core VM with the inputs
in memory (``engine_only.py --resident``, interleaved, 4 rounds): torch's ops 6.0 / 9.9 GB/s with
1 / 2 threads (1.64x), this loop 6.8 / 12.3 GB/s (1.81x), the same bytes. Nothing to install: the
source (``native.c``, beside this file) is compiled on first use with the system's C compiler
(``$CC``, else ``cc``) into a per-user cache, in well under a second, and reused while source,
compiler and machine stay the same. Without a compiler, or with ``CKPTAVG_NATIVE=0``, merges use
torch's ops, exactly as fast as before and with the same output bytes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.c")
# Strict IEEE arithmetic (no fused multiply-adds, no reassociation): the bits must be torch's.
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_POINTERS = ctypes.POINTER(ctypes.c_void_p)


def cache_dir() -> Path:
    """``$CKPTAVG_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptavg``, else ``~/.cache/ckptavg``."""
    chosen = os.environ.get("CKPTAVG_CACHE_DIR")
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptavg"


class NativeMean:
    """The compiled loops: ``mean(dtype, pointers, count, divisor, out)`` for bf16, fp16, fp32."""

    DTYPES = (torch.bfloat16, torch.float16, torch.float32)

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for dtype, name, scalar in (
            (torch.bfloat16, "ckptavg_mean_bf16", ctypes.c_float),
            (torch.float16, "ckptavg_mean_f16", ctypes.c_float),
            (torch.float32, "ckptavg_mean_f32", ctypes.c_double),
        ):
            function = getattr(library, name)
            function.argtypes = [_POINTERS, ctypes.c_int, ctypes.c_int64, scalar, ctypes.c_void_p]
            function.restype = ctypes.c_int
            self._functions[dtype] = function

    def mean(self, dtype: torch.dtype, addresses: list[int], count: int, divisor: float, out: int) -> bool:
        """Write the mean of ``count`` elements at each of ``addresses`` (in the order they are
        added: the engine's, newest source first) to ``out``, all of ``dtype``; False when an
        output element is not finite. Runs without the GIL (a ``ctypes.CDLL`` call)."""
        pointers = (ctypes.c_void_p * len(addresses))(*addresses)
        return not self._functions[dtype](pointers, len(addresses), count, divisor, out)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _build(compiler: str) -> Path:
    """The cached library for this source, compiler and machine; compiled if missing (to a
    temporary name, then renamed: processes of one job may compile at the same time)."""
    # The compiler's file stands for its version: a stat, not a process started per merge.
    binary = os.stat(os.path.realpath(compiler))
    identity = [SOURCE.read_text(), os.path.realpath(compiler), str(binary.st_mtime_ns), str(binary.st_size)]
    key = hashlib.sha256("\0".join([*identity, *FLAGS, platform.machine(), sys.platform]).encode()).hexdigest()[:16]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    # A library is code this process runs: only from a folder nobody else can write to.
    status = folder.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise PermissionError(f"{folder} is writable by others")
    library = folder / f"native-{key}.so"
    if not library.exists():
        handle, partial = tempfile.mkstemp(dir=folder, prefix=".native-", suffix=".so")
        os.close(handle)
        try:
            subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], check=True, capture_output=True, timeout=120)
            os.replace(partial, library)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


@functools.cache
def native_mean() -> NativeMean | None:
    """The compiled loops, or None where they cannot be had (then torch's ops do the work):
    ``CKPTAVG_NATIVE=0``, no C compiler, a failed build, an unwritable cache."""
    if os.environ.get("CKPTAVG_NATIVE", "1") == "0" or sys.byteorder != "little":
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        return NativeMean(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError, AttributeError):
        return None
