"""The averaging loop in C, called through ctypes without the GIL; torch's ops otherwise.

Why: the torch path makes ~9 calls per cache block, and each call takes the GIL back on return,
so the arithmetic threads of one process queue for it; and its passes over each block (convert,
add, divide, cast) cost more than one fused loop. Measured on the 2-core VM with the inputs in
memory (``engine_only.py --resident``, interleaved): torch's ops 6.0 / 9.8 GB/s with 1 / 2
threads, this loop 15-17 / 22-25 GB/s (two processes of one thread: 26), the same bytes; fp16
(x86-64 with F16C) alike: torch's ops 6.3-6.6 / 8.9-10.5, this loop 16.6-18.2 / 23.4-24.8. Nothing
to install: the source (``native.c``, beside this file) is compiled on first use with the
system's C compiler (``$CC``, else ``cc``) into a per-user cache in a fraction of a second, and
reused while source, compiler and machine stay the same; each process checks it against torch's
ops before using it. Without a compiler, or with ``CKPTAVG_NATIVE=0``, merges use torch's ops,
with the same output bytes. ``CKPTAVG_NATIVE_BASELINE=1`` builds the baseline code alone (no
AVX2 + FMA clones, no fp16 loops: what a CPU without AVX2 runs), for tests.
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
from collections.abc import Sequence
from pathlib import Path

import torch

from .kernel import ErrorBound, WeightedSum, exact_parts, finish_mean, fold_in, start_sum

SOURCE = Path(__file__).with_name("native.c")
# Strict IEEE arithmetic (no fused multiply-adds, no reassociation): the bits must be torch's.
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
LIBRARIES = ["-lm"]  # fma() where the CPU has no instruction for it
_POINTERS = ctypes.POINTER(ctypes.c_void_p)


def _flags() -> list[str]:
    """The compiler's flags: :data:`FLAGS`, and the baseline code alone where asked for."""
    return [*FLAGS, "-DCKPTAVG_BASELINE"] if os.environ.get("CKPTAVG_NATIVE_BASELINE") == "1" else FLAGS


def cache_dir() -> Path:
    """``$CKPTAVG_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptavg``, else ``~/.cache/ckptavg``."""
    chosen = os.environ.get("CKPTAVG_CACHE_DIR")
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptavg"


class NativeMean:
    """The compiled loops, one uniform and one weighted per dtype of :attr:`dtypes`: see
    :meth:`mean` and :meth:`weighted`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        loops = [(torch.bfloat16, "bf16", ctypes.c_float), (torch.float32, "f32", ctypes.c_double)]
        # fp16 only with the F16C instructions (x86-64 with AVX2): its conversions written in C
        # did not vectorize (1.2-1.6 GB/s, slower than torch's ops).
        if library.ckptavg_f16_available():
            loops.append((torch.float16, "f16", ctypes.c_float))
        self._functions = {}
        for dtype, suffix, scalar in loops:
            uniform = getattr(library, f"ckptavg_mean_{suffix}")
            uniform.argtypes = [_POINTERS, ctypes.c_int, ctypes.c_int64, scalar, ctypes.c_void_p]
            uniform.restype = ctypes.c_int
            weighted = getattr(library, f"ckptavg_weighted_{suffix}")
            weighted.argtypes = [
                _POINTERS,
                ctypes.POINTER(ctypes.c_double),
                ctypes.POINTER(ctypes.c_double),
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
            weighted.restype = ctypes.c_int64
            self._functions[dtype] = (uniform, weighted)
        self.dtypes = tuple(self._functions)
        """The dtypes averaged here (inputs and output alike); others keep torch's ops."""
        self._fp64_elements = library.ckptavg_fp64_elements
        self._fp64_elements.argtypes = []
        self._fp64_elements.restype = ctypes.c_int64

    def fp64_elements(self) -> int:
        """How many elements :meth:`weighted` has summed in fp64 in this process (for the tests:
        bf16 and fp16 outputs only where the fp32 pass left them in doubt, fp32 outputs all)."""
        return int(self._fp64_elements())

    def mean(self, dtype: torch.dtype, addresses: Sequence[int], count: int, out: int, divisor: float) -> bool:
        """Write to ``out`` the mean of ``count`` elements at each of ``addresses`` (in the order
        they are added: the engine's, newest source first), all of ``dtype``: their sum divided
        by ``divisor``. False when an output element is not finite. Runs without the GIL (a
        ``ctypes.CDLL`` call)."""
        pointers = (ctypes.c_void_p * len(addresses))(*addresses)
        return not self._functions[dtype][0](pointers, len(addresses), count, divisor, out)

    def weighted(
        self,
        sources: Sequence[torch.Tensor],
        weights: Sequence[float],
        out: torch.Tensor,
        bound: ErrorBound,
        doubtful: torch.Tensor,
    ) -> int:
        """``out`` := the fp64 sum of ``weights`` times ``sources`` (1-D, contiguous, of ``out``'s
        dtype and size) rounded once, where ``bound`` does not vouch for that rounding decided
        exactly (:func:`.kernel.exact_parts`) where the loop can, and ``doubtful`` (uint8, as
        many) := 1 where it cannot (:class:`.kernel.WeightedSum` takes rationals there); returns
        how many. Runs without the GIL."""
        pointers = (ctypes.c_void_p * len(sources))(*(s.data_ptr() for s in sources))
        factors = (ctypes.c_double * len(weights))(*weights)
        split = exact_parts(tuple(weights))
        parts = None if split is None else (ctypes.c_double * len(split))(*split)
        function = self._functions[out.dtype][1]
        return function(
            pointers,
            factors,
            parts,
            len(sources),
            out.numel(),
            bound.scale,
            bound.tail,
            int(bound.exact_products),
            out.data_ptr(),
            doubtful.data_ptr(),
        )


def torch_mean(sources: torch.Tensor, weights: Sequence[float] | None = None) -> torch.Tensor:
    """The mean of the rows of ``sources`` (newest first) as torch's ops write it (:mod:`.kernel`,
    called as the engine calls them): what the compiled loops must match bit for bit."""
    dtype, count = sources.dtype, sources.shape[1]
    mean = torch.empty(count, dtype=dtype)
    if weights is not None:
        WeightedSum(count).mean(list(sources), weights, mean)
        return mean
    sum_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    total, scratch = torch.empty(count, dtype=sum_dtype), torch.empty(count, dtype=sum_dtype)
    start_sum(total, sources[0])
    for source in sources[1:]:
        fold_in([total], source, scratch)
    finish_mean(total, mean, scratch, float(len(sources)))
    return mean


def _agrees_with_torch(loops: NativeMean) -> bool:
    """Whether the loops write the bits of torch's ops on this machine, for every dtype, uniform
    and weighted (weights of many bits and of few), over lengths that end inside and outside
    vector widths: a compiler or a torch build that rounds otherwise leaves the work to torch's
    ops rather than changing a byte."""
    generator = torch.Generator().manual_seed(0)
    for dtype in loops.dtypes:
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        for count in (1, 7, 37, 1037):
            scales = torch.exp2(torch.randint(-8, 8, (3, count), generator=generator).double())
            sources = (torch.randn(3, count, generator=generator, dtype=torch.float64) * scales).to(dtype)
            for weights in (None, (0.2, 0.5, 0.3), (0.25, -0.5, 1.25)):
                want = torch_mean(sources, weights)
                got = torch.empty(count, dtype=dtype)
                if weights is None:
                    loops.mean(dtype, [source.data_ptr() for source in sources], count, got.data_ptr(), 3.0)
                else:
                    WeightedSum(count).mean(list(sources), weights, got, loops)
                if not torch.equal(got.view(bits), want.view(bits)):
                    return False
    return True


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _build(compiler: str) -> Path:
    """The cached library for this source, compiler and machine; compiled if missing (to a
    temporary name, then renamed: processes of one job may compile at the same time)."""
    # The compiler's file stands for its version: a stat, not a process started per merge.
    binary = os.stat(os.path.realpath(compiler))
    identity = [SOURCE.read_text(), os.path.realpath(compiler), str(binary.st_mtime_ns), str(binary.st_size)]
    flags = _flags()
    digest = hashlib.sha256("\0".join([*identity, *flags, *LIBRARIES, platform.machine(), sys.platform]).encode())
    key = digest.hexdigest()[:16]
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
            command = [compiler, *flags, "-o", partial, str(SOURCE), *LIBRARIES]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            os.replace(partial, library)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


@functools.cache
def native_mean() -> NativeMean | None:
    """The compiled loops, or None where they cannot be had (then torch's ops do the work):
    ``CKPTAVG_NATIVE=0``, no C compiler, a failed build, an unwritable or shared cache, or loops
    that do not write torch's bits on this machine."""
    if os.environ.get("CKPTAVG_NATIVE", "1") == "0" or sys.byteorder != "little":
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        loops = NativeMean(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError, AttributeError):
        return None
    return loops if _agrees_with_torch(loops) else None
