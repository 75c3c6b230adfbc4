"""The streaming average: tensor by tensor, step by step, block by block.

A *step* is a range of one tensor's elements (or a run of small tensors that lie one after another
in every source, :meth:`StreamingAverage._units`), read from every source at once: in place through
a memory mapping for local files (:meth:`CheckpointReader.local_view`), else copied by reader
threads into one of two input sets, so the next step is read while this one is computed. The
arithmetic splits a step into cache-sized *blocks* owned by worker threads: each block of every
source is folded into an accumulator block that stays in cache (:mod:`.kernel`), then divided
and cast straight into the output buffer; the common case, means of bf16, fp16 or fp32 tensors in
their own dtype, runs instead as one call per thread and output to a compiled loop that holds no
GIL (:mod:`.native`), to the same bytes. A writer thread per output streams finished steps to
the files while hashing them.

Memory is bounded by a handful of ``chunk_bytes`` whatever the model size and the number of
inputs: the inputs of two steps together take at most ``read_ahead`` chunks (a step covers
fewer elements the more sources there are), each output holds ``_WRITER_DEPTH + 1`` chunk
buffers, and the accumulator blocks are a few MiB per thread.

Several averages of subsets of the same sources (:class:`Candidate`) are computed in one pass
(:meth:`StreamingAverage.run_many`): every block of every source is read once and folded into
each candidate holding it, each candidate's bytes identical to a merge of its sources alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from ..errors import CheckpointError, ConfigError
from ..formats import CheckpointReader, TensorInfo
from ..formats.dtypes import AVERAGED, FLOAT8, float8_scales
from ..formats.layout import ShardSpec, TensorSpec
from ..formats.writers import ShardSink
from ..io.files import MappedRange
from ..units import format_bytes
from ..weighting import normalised
from .kernel import INLINE_ELEMENTS, WeightedSum, finish_mean, finite, fold_in, is_finite, start_sum
from .native import native_mean

DEFAULT_CHUNK_BYTES = 16 * 2**20
MIN_CHUNK_BYTES = 64
# Larger chunks stop paying long before this (reads are already large and sequential), while
# the buffers a merge holds grow with them.
MAX_CHUNK_BYTES = 2**30
_WRITER_DEPTH = 2  # finished chunks queued for the writer thread
# Elements per accumulator block of a thread. Measured on one core (bf16 inputs, fp32 sums):
# 32K-element blocks 2.6 GB/s of input, 256K 5.7-7.0, 1M 7.2, 4M (a whole default chunk, as
# before blocks) 4.1; with two threads 256K and 1M scale 1.5x while 32K-64K get slower (the
# per-op overhead). Not sized to fit L2 (1 MiB per core on the 2-core VM: 256K fp32 sums and
# their scratch block are 2 MiB): blocks that fit it, 64K-128K, ran slower, alone (3.8-5.6 GB/s)
# and in two threads alike; what matters is that a block stays in the caches while every source
# is folded in, instead of streaming a whole chunk's sums through memory once per source.
BLOCK_ELEMENTS = 2**18
_ALIGN = 64  # steps and blocks start at multiples of 64 elements (whole cache lines, vectors)
# Elements per block of a checked weighted sum on torch's ops: eight fp64 blocks of it stay in
# cache (2 MiB).
WEIGHTED_ELEMENTS = 2**15


def default_threads(env: Mapping[str, str] | None = None) -> int:
    """Arithmetic threads by default: the cores this process may use (its CPU affinity, which
    ``taskset``, cgroups' cpusets and ``srun --cpu-bind`` narrow), divided among the processes
    of a multi-process merge on this node (torchrun's ``LOCAL_WORLD_SIZE``, or an ``srun``
    step's tasks per node) when the affinity still spans the whole machine, so that the
    processes do not fight over the same cores."""
    env = os.environ if env is None else env
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on macOS and Windows
        cores = os.cpu_count() or 1
    local = env.get("LOCAL_WORLD_SIZE", "")
    if not local and "SLURM_STEP_NUM_TASKS" in env:  # "4" or "4(x2)": the first node's count
        local = env.get("SLURM_STEP_TASKS_PER_NODE", "").split("(")[0].split(",")[0]
    if local.isdigit() and int(local) > 1 and cores >= (os.cpu_count() or cores):
        cores //= int(local)
    return max(1, cores)


@dataclass(frozen=True)
class EngineOptions:
    """Knobs of the streaming average (the defaults suit a 2-core box and a 100-GB model alike)."""

    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None
    """Output dtype of floating tensors (one for all, or one per tensor name); None keeps the input's."""
    allow_nonfinite: bool = False
    """Average NaN and Inf values instead of refusing them."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Accumulator bytes per chunk."""
    workers: int = 2
    """Reader threads."""
    read_ahead: int = 4
    """Input chunks the two steps in hand (the one computed and the one read) share, all
    sources together (what the former ring of ``read_ahead + 1`` input chunks held)."""
    threads: int | None = None
    """Arithmetic threads; None: :func:`default_threads` for a merge that owns the process, one
    for a merge in a background thread (the training hook's, beside training)."""
    native: bool = True
    """Average bf16 and fp32 tensors with the compiled loop of :mod:`.native` where it can be
    had (same bytes, no GIL: faster, and threads scale); False: torch's ops."""
    mmap: bool = False
    """Read local files in place through memory mappings instead of copying them in. Off by
    default: on a 2-core VM, populating and dropping the mapped pages (page-table work, in the
    kernel) cost more than the copy it saves (the engine alone: 2.2-3.1 GB/s mapped against
    3.0-4.8 GB/s copied, same runs)."""
    copy: tuple[str, ...] = ()
    """Globs over tensor names (the output's): matching tensors are not averaged but copied from
    one source (:class:`StreamingAverage`'s ``copy_from``), whatever the others hold."""

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be at least 1, got {self.threads}")

    @property
    def buffers(self) -> int:
        """Chunk-sized buffers a merge with one output holds at most: the inputs of two steps
        (``read_ahead + 1`` chunks, however many sources), the writer's queue and the output
        being filled, and one for the threads' accumulator blocks (a few MiB together)."""
        return self.read_ahead + 1 + _WRITER_DEPTH + 2


def _proc_bytes(path: str, field: str) -> int | None:
    """A ``Field:  123 kB`` line of a /proc file, in bytes; ``None`` where there is none."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_PROC_CGROUP, _CGROUP_ROOT = "/proc/self/cgroup", "/sys/fs/cgroup"


def _cgroup_memory_left() -> int | None:
    """What the cgroup memory limit of this process leaves (SLURM jobs and containers run in one;
    ``MemAvailable`` then describes the whole host): cgroup v2 ``memory.max``, or v1
    ``memory.limit_in_bytes``. ``None`` without a limit or where the files cannot be read."""
    try:
        with open(_PROC_CGROUP) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    places = []
    for _, controllers, path in (e for e in entries if len(e) == 3):
        if controllers == "":  # v2: one unified hierarchy
            places.append((f"{_CGROUP_ROOT}{path}", "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            places.append((f"{_CGROUP_ROOT}/memory{path}", "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for folder, limit_name, usage_name in places:
        try:
            with open(f"{folder.rstrip('/')}/{limit_name}") as limit_file:
                limit = limit_file.read().strip()
            with open(f"{folder.rstrip('/')}/{usage_name}") as usage_file:
                usage = int(usage_file.read().strip())
        except (OSError, ValueError):
            continue
        # "max" (v2) or a page-rounded 2^63 (v1) mean no limit.
        if limit != "max" and int(limit) < 2**62:
            return int(limit) - usage
    return None


def available_memory() -> int | None:
    """Bytes this process may still allocate, as far as the OS says: ``MemAvailable``, what the
    cgroup's memory limit leaves, and what an address-space limit (``ulimit -v``) leaves; ``None``
    where none is known."""
    limits = [_proc_bytes("/proc/meminfo", "MemAvailable"), _cgroup_memory_left()]
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft - (_proc_bytes("/proc/self/status", "VmSize") or 0))
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        pass
    known = [limit for limit in limits if limit is not None]
    return max(0, min(known)) if known else None


def check_chunk_bytes(chunk_bytes: int) -> None:
    """Refuse a chunk size a merge could not hold: at least 64 bytes, at most 1 GiB, and at most
    what the available memory holds :attr:`EngineOptions.buffers` times."""
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise ConfigError(f"chunk size must be at least {MIN_CHUNK_BYTES} bytes, got {chunk_bytes}")
    buffers = EngineOptions().buffers
    memory = available_memory()
    limit, reason = MAX_CHUNK_BYTES, f"{format_bytes(MAX_CHUNK_BYTES)}, beyond which chunks only cost memory"
    if memory is not None and memory // buffers < limit:
        limit = memory // buffers
        reason = f"a merge holds {buffers} chunks at once and {format_bytes(memory)} of memory is available"
    if chunk_bytes > limit:
        raise ConfigError(f"chunk size {chunk_bytes} bytes is too large: at most {limit} ({reason})")


def is_averaged(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` are averaged (floats) rather than copied (integers, bools,
    float8_e8m0fnu block scales): :data:`ckptavg.formats.dtypes.AVERAGED`."""
    return dtype in AVERAGED


# What --dtype (or the hook's per-parameter dtypes) may turn an averaged tensor into: no float8,
# which would be quantizing (a scale to choose, values to clip), not averaging.
CONVERTIBLE = AVERAGED - FLOAT8


def check_output_dtype(dtype: torch.dtype, what: str) -> None:
    """Refuse an output dtype outside :data:`CONVERTIBLE`; ``what`` says whose, in the message."""
    if dtype not in CONVERTIBLE:
        why = " (writing float8 would be quantizing, which ckptavg does not do)" if dtype in FLOAT8 else ""
        raise ConfigError(f"{what}: ckptavg writes averages as bf16, fp16, fp32 or fp64, not {dtype}{why}")


def accumulator_dtype(input_dtype: torch.dtype, output_dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit floats, fp64 for float8, for fp32/fp64 inputs and for an fp64 output.

    Why 16-bit floats are exact in fp32: the fp32 sum of N bf16 values is exact while one
    element's values span less than 2^(16 - log2 N) in magnitude (neighbouring training steps
    differ far less). Given an exact sum S, ``fp32(S / N)`` is never a spurious midpoint of the
    16-bit grid: ``S - N*m`` is a multiple of ulp(S) >= 2^floor(log2 N) ulp(q) > N ulp(q) / 2, so
    the two roundings (fp32 quotient, then 16-bit cast) give the correctly rounded mean.

    Why float8 is summed in fp64: its values span more than fp32 holds (float8_e5m2 from 2^-16
    to 57344, 32 bits: 57344 + 2^-16 already rounds in fp32). Every float8 value (e4m3fn, e5m2,
    and their fnuz variants) is a multiple of 2^-17 below 2^16, so the fp64 sum S of N of them
    is exact for N <= 2^53 / 2^33 = 2^20 sources. The quotient q = ``fp64(S / N)`` then rounds to
    any output of p <= 24 bits as S / N itself does: a midpoint u of the output grid (below 2^16)
    is a multiple of half its spacing, at least 2^-p |u|, and S a multiple of 2^-17, so where S / N
    is not u it is at least min(2^-17, 2^-p |u|) / N away from it, more than q's rounding error
    2^-53 |u| < 2^-37 for N < 2^20. One rounding of q to the output dtype
    (:func:`.kernel.round_to_odd`, then a cast) is then the correctly rounded mean.
    """
    if input_dtype in FLOAT8 or input_dtype.itemsize >= 4 or output_dtype.itemsize >= 8:
        return torch.float64
    return torch.float32


def check_compatible(readers: Sequence[CheckpointReader]) -> list[TensorInfo]:
    """The tensor list all sources share (in the newest source's storage order), or an error
    naming the first key, shape or dtype that differs and the two places it differs between.
    Keys missing from some sources are never averaged over fewer inputs."""
    reference_reader = readers[-1]
    reference = reference_reader.tensors()
    by_name = {t.name: t for t in reference}
    described = [(t.name, t.shape, t.dtype) for t in reference]
    for reader in readers[:-1]:
        # The common cases, checked without sorting every name (the error names the first): the
        # same tensors in the same order, compared as one list, or in another order.
        if [(t.name, t.shape, t.dtype) for t in reader.tensors()] == described:
            continue
        theirs = {t.name: t for t in reader.tensors()}
        if theirs.keys() == by_name.keys() and all(
            t.shape == by_name[t.name].shape and t.dtype == by_name[t.name].dtype for t in theirs.values()
        ):
            continue
        for name in sorted(set(by_name) | set(theirs)):
            mine, other = by_name.get(name), theirs.get(name)
            if other is None:  # then it is the reference's
                raise CheckpointError(
                    f"tensor {name!r} is in {by_name[name].file} but missing from {reader.display_path}"
                )
            if mine is None:
                raise CheckpointError(
                    f"tensor {name!r} is in {other.file} but missing from {reference_reader.display_path}"
                )
            if mine.shape != other.shape:
                raise CheckpointError(
                    f"tensor {name!r} has shape {list(other.shape)} in {other.file} "
                    f"but {list(mine.shape)} in {mine.file}"
                )
            if mine.dtype != other.dtype:
                raise CheckpointError(
                    f"tensor {name!r} is {other.dtype} in {other.file} but {mine.dtype} in {mine.file}"
                )
    return reference


def copied_by_rules(tensors: Sequence[TensorInfo], patterns: Sequence[str]) -> set[str]:
    """The tensors that copy rules (globs over their names) take from one source instead of
    averaging: those matching, and the scales of matching float8 tensors (a weight copied with
    another source's scale would be another value). A scale that matches while its float8 tensor
    is averaged is refused: that tensor would be averaged over scales never compared."""
    if not patterns:
        return set()
    matched = {t.name for t in tensors if any(fnmatchcase(t.name, p) for p in patterns)}
    files = {t.name: t.file for t in tensors}
    for scale, weight in float8_scales((t.name, t.dtype) for t in tensors).items():
        if weight in matched:
            matched.add(scale)
        elif scale in matched:
            raise ConfigError(
                f"{files[scale]}: --copy takes {scale!r}, the scale of the float8 tensor {weight!r}, but not that "
                "tensor, which would be averaged over scales never compared: copy both or neither"
            )
    return matched


def unused_copy_rules(names: Collection[str], patterns: Sequence[str]) -> list[str]:
    """A note for each copy rule that matches none of the tensors ``names`` (a likely typo)."""
    return [f"--copy {p!r} matches no tensor" for p in patterns if not any(fnmatchcase(n, p) for n in names)]


def output_specs(
    tensors: Sequence[TensorInfo],
    dtype: torch.dtype | Mapping[str, torch.dtype] | None,
    copied: Collection[str] = (),
) -> list[TensorSpec]:
    """Output dtype policy: averaged tensors take ``dtype`` when given (one for all, or one per
    tensor name), everything else keeps its own, the scales of float8 tensors and the tensors
    ``copied`` by copy rules included (a copy is the stored bytes). A
    conversion to float8 is refused (that is quantizing), and so is one of a float8 tensor that
    has a scale (written wider, its raw values would pass for the weights: ckptavg does not
    dequantize)."""
    scales = float8_scales((t.name, t.dtype) for t in tensors)
    scale_of = {weight: scale for scale, weight in scales.items()}
    # Asked once, not per tensor: isinstance of an abstract class is slow.
    per_tensor, one = (dtype, None) if isinstance(dtype, Mapping) else (None, dtype)

    def chosen(t: TensorInfo) -> torch.dtype:
        wanted = per_tensor.get(t.name) if per_tensor is not None else one
        if wanted is None or wanted == t.dtype or not is_averaged(t.dtype) or t.name in scales or t.name in copied:
            return t.dtype
        check_output_dtype(wanted, f"tensor {t.name!r} of {t.file}")
        if t.name in scale_of:
            raise ConfigError(
                f"tensor {t.name!r} of {t.file} is {t.dtype} scaled by {scale_of[t.name]!r}: written as {wanted} "
                "its raw values would pass for the weights (ckptavg does not dequantize float8); merge it in its "
                "own dtype"
            )
        return wanted

    return [TensorSpec(t.name, chosen(t), t.shape) for t in tensors]


@dataclass(frozen=True)
class Candidate:
    """One average computed in a pass: a subset of the sources with its weights."""

    sources: tuple[int, ...]
    """Indices into the engine's readers, ascending (oldest first), non-empty."""
    weights: tuple[float, ...] | None = None
    """One per entry of ``sources`` (normalised by the engine), None for the uniform mean."""
    copy_from: int | None = None
    """The entry of ``sources`` that tensors of the copy rules come from; None: the newest."""


@dataclass(frozen=True)
class _Plan:
    """How one output is computed: its sources newest first (integer tensors are copied from
    the first and compared with the others) and each one's weight; ``divisor`` divides a
    uniform sum, None when the weights already sum to one; ``copy_from`` is the source of the
    tensors copy rules take."""

    order: tuple[int, ...]
    weights: Mapping[int, float]
    divisor: float | None
    copy_from: int

    def checked(self, out_dtype: torch.dtype) -> bool:
        """Whether the output is a weighted sum taken in fp64 and checked element by element
        (:class:`.kernel.WeightedSum`): every weighted one written in fewer than 64 bits, and in
        fp64 those with a negative weight (compensated)."""
        return self.divisor is None and (out_dtype != torch.float64 or any(w < 0 for w in self.weights.values()))


@dataclass(frozen=True)
class _Step:
    """Elements ``[start, start + count)`` of one tensor, inside the chunk ``[chunk_start,
    chunk_start + chunk_count)`` (the unit error messages describe, whatever the step size); or,
    with ``run``, the whole tensors of a run (:meth:`StreamingAverage._units`) one after another,
    ``spec`` and ``info`` the first's, ``start`` 0 and ``count`` all their elements."""

    spec: TensorSpec
    info: TensorInfo
    chunk_start: int
    chunk_count: int
    start: int
    count: int
    run: tuple[TensorInfo, ...] = ()


# (tensor, first element, end element): a tensor, or the part of it one process writes.
_Range = tuple[TensorSpec, int, int]


def _chunks(first: int, end: int, per_chunk: int) -> Iterator[tuple[int, int]]:
    # One at a time: a list would take memory in proportion to the tensor (a tuple per chunk,
    # which may be as small as 64 bytes) before a byte of it is read.
    return ((start, min(per_chunk, end - start)) for start in range(first, end, per_chunk))


def _aligned(count: int) -> int:
    return count - count % _ALIGN if count >= _ALIGN else max(1, count)


def _first_nonfinite(
    step: _Step, out: Sequence[torch.Tensor], bad: Collection[int]
) -> tuple[TensorInfo, int, int, int]:
    """Where a step whose outputs ``bad`` (indices into ``out``) are not all finite fails: the
    tensor, the chunk of it to report (start, count), and the output; in a run, the first tensor
    whose output holds a NaN or Inf, as the step of that tensor alone would have failed."""
    if not step.run:
        return step.info, step.chunk_start, step.chunk_count, min(bad)
    start = 0
    for info in step.run:
        end = start + info.numel
        failing = [k for k in sorted(bad) if not is_finite(out[k][start:end])]
        if failing:
            return info, 0, info.numel, failing[0]
        start = end
    raise AssertionError("no tensor of the run holds the non-finite output")


class _Inputs:
    """The bytes of every source for one step, the next step's fetched meanwhile on a thread
    pool: mapped in place where a reader offers it (its pages populated in advance, dropped
    once consumed), otherwise copied into one of two input sets. What :meth:`next` returns
    stays valid until the following call."""

    def __init__(
        self,
        readers: Sequence[CheckpointReader],
        sources: Sequence[int],
        steps: Iterator[_Step],
        workers: int,
        use_mmap: bool,
    ) -> None:
        self._readers = readers
        self._sources = list(sources)
        self._steps = steps
        self._use_mmap = use_mmap
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptavg-read")
        self._sets = [bytearray(), bytearray()]
        self._turn = 0
        self._pending: deque[tuple[_Step, dict[int, memoryview], list[Future], list[MappedRange]]] = deque()
        self._mapped: list[MappedRange] = []

    def _submit(self) -> None:
        step = next(self._steps, None)
        if step is None:
            return
        item = step.info.dtype.itemsize
        offset, nbytes = step.start * item, step.count * item
        stride = -(-nbytes // _ALIGN) * _ALIGN
        views: dict[int, memoryview] = {}
        futures: list[Future] = []
        mapped: list[MappedRange] = []
        space: memoryview | None = None
        for slot, source in enumerate(self._sources):
            reader = self._readers[source]
            local = reader.local_view(step.info.name, offset, nbytes) if self._use_mmap else None
            if local is not None:
                mapped.append(local)
                views[source] = local.data
                futures.append(self._pool.submit(local.populate))
                continue
            if space is None:
                if len(self._sets[self._turn]) < stride * len(self._sources):
                    # A new buffer, never a resize: views of the old one may still be alive.
                    self._sets[self._turn] = bytearray(stride * len(self._sources))
                space = memoryview(self._sets[self._turn])
            views[source] = space[slot * stride : slot * stride + nbytes]
            futures.append(self._pool.submit(reader.read_into, step.info.name, offset, views[source]))
        self._turn ^= 1
        self._pending.append((step, views, futures, mapped))

    def next(self) -> tuple[_Step, dict[int, memoryview]]:
        self._release()
        while len(self._pending) < 2:
            before = len(self._pending)
            self._submit()
            if len(self._pending) == before:
                break
        step, views, futures, mapped = self._pending.popleft()
        self._mapped = mapped
        for future in futures:
            future.result()
        return step, views

    def _release(self) -> None:
        for local in self._mapped:
            local.release()
        self._mapped = []

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._release()
        for _, _, _, mapped in self._pending:
            for local in mapped:
                local.release()
        self._pending.clear()


class _BackgroundWriter:
    """Writes finished chunks in order on one thread and hands their buffers back.

    Buffers are returned even after a failure, so the producer never waits forever; the
    failure itself is raised in the producer at its next call.
    """

    def __init__(self, depth: int, buffer_bytes: int, on_file_done: Callable[[str, str], None] | None = None) -> None:
        self._on_file_done = on_file_done
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(depth):
            self.free.put(bytearray(buffer_bytes))
        self._tasks: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.hashes: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, name="ckptavg-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            sink, file_name, view, buffer = task
            try:
                if self._error is None:
                    if view is not None:
                        sink.write(view)
                    else:
                        self.hashes[file_name] = sink.close()
                        if self._on_file_done is not None:
                            self._on_file_done(file_name, self.hashes[file_name])
            except BaseException as exc:  # noqa: BLE001 - handed to the producer thread
                self._error = exc
            finally:
                if buffer is not None:
                    self.free.put(buffer)

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def take(self) -> bytearray:
        buffer = self.free.get()
        self.check()
        return buffer

    def write(self, sink: ShardSink, buffer: bytearray, nbytes: int) -> None:
        self.check()
        self._tasks.put((sink, None, memoryview(buffer)[:nbytes], buffer))

    def close_file(self, sink: ShardSink, file_name: str) -> None:
        self.check()
        self._tasks.put((sink, file_name, None, None))

    def finish(self) -> dict[str, str]:
        self._tasks.put(None)
        self._thread.join()
        self.check()
        return self.hashes


class _Blocks:
    """A thread's reused accumulator blocks (one per output), its conversion block, and for
    fp64 sums an fp32 block to round them through (:func:`.kernel.round_to_odd`)."""

    def __init__(self) -> None:
        self._tensors: dict[torch.dtype, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]] = {}
        self._weighted: WeightedSum | None = None

    def weighted(self) -> WeightedSum:
        """The blocks of checked weighted sums (:data:`WEIGHTED_ELEMENTS` each)."""
        if self._weighted is None:
            self._weighted = WeightedSum(WEIGHTED_ELEMENTS)
        return self._weighted

    def get(
        self, dtype: torch.dtype, outputs: int, elements: int
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        if dtype not in self._tensors:
            self._tensors[dtype] = (
                [torch.empty(elements, dtype=dtype) for _ in range(outputs)],
                torch.empty(elements, dtype=dtype),
                torch.empty(elements, dtype=torch.float32) if dtype == torch.float64 else None,
            )
        return self._tensors[dtype]


class StreamingAverage:
    """Averages the same tensors of several checkpoints into the output files of a layout.

    ``totals`` is the weight each source already sums (the training hook's running sums: the
    step count, or the summed weights of a weighting scheme); the mean then divides by their
    total instead of the source count.
    """

    def __init__(
        self,
        readers: Sequence[CheckpointReader],
        weights: Sequence[float] | None,
        options: EngineOptions,
        progress: Callable[[int], None] | None = None,
        totals: Sequence[float] | None = None,
        copy_from: int | None = None,
    ) -> None:
        if not readers:
            raise ConfigError("nothing to average: no sources")
        self.readers = list(readers)
        self.options = options
        self.uniform = weights is None
        if totals is not None and (
            weights is not None or len(totals) != len(readers) or not all(t > 0 and math.isfinite(t) for t in totals)
        ):
            raise ConfigError(f"summed weights {list(totals)} need no other weights and one positive total per source")
        self.divisor = len(readers) if totals is None else math.fsum(totals)
        if weights is not None:
            if len(weights) != len(readers):
                raise ConfigError(f"{len(weights)} weights given for {len(readers)} sources")
            self.weights = normalised(weights, allow_negative=True)
        else:
            self.weights = [1.0 / len(readers)] * len(readers)
        self.progress = progress or (lambda _n: None)
        self.tensors = {t.name: t for t in check_compatible(self.readers)}
        # {scale: the float8 tensor it scales}: copied like integers, so that a float8 tensor is
        # averaged only over sources whose scales are the same (the mean of x_i * s_i is not the
        # mean of x_i times any one scale).
        self.scales = float8_scales((t.name, t.dtype) for t in self.tensors.values())
        self.copied = copied_by_rules(list(self.tensors.values()), options.copy)
        """The tensors the copy rules take from ``copy_from`` (``options.copy``)."""
        self.copy_from = len(self.readers) - 1 if copy_from is None else copy_from
        if not 0 <= self.copy_from < len(self.readers):
            raise ConfigError(f"copy_from {copy_from} is not one of the {len(self.readers)} sources")
        # Newest source first: integer tensors are copied from it and the others compared.
        self._order = list(range(len(self.readers) - 1, -1, -1))

    def _averages(self, info: TensorInfo) -> bool:
        """Whether ``info``'s tensor is averaged; if not, it is copied (from the newest source, or
        by a copy rule from ``copy_from``)."""
        return is_averaged(info.dtype) and info.name not in self.scales and info.name not in self.copied

    def _per_chunk(self, info: TensorInfo, out_dtype: torch.dtype) -> int:
        averaged = self._averages(info)
        width = accumulator_dtype(info.dtype, out_dtype).itemsize if averaged else info.dtype.itemsize
        return max(1, self.options.chunk_bytes // width)

    def read_bytes(self, shards: Sequence[ShardSpec]) -> int:
        """Bytes that writing ``shards`` reads from all sources together."""
        return len(self.readers) * sum(
            (end - first) * self.tensors[spec.name].dtype.itemsize
            for shard in shards
            for spec, first, end in shard.ranges()
        )

    def _per_step(self, info: TensorInfo, out_dtype: torch.dtype, sources: int) -> int:
        """Elements per step: at most a chunk, and few enough that the inputs of two steps of all
        ``sources`` fit in ``read_ahead`` chunks (memory stays flat as sources are added: four
        bf16 sources fill the budget with whole chunks, sixteen with quarter chunks)."""
        budget = self.options.chunk_bytes * self.options.read_ahead // 2
        return min(self._per_chunk(info, out_dtype), _aligned(budget // (sources * info.dtype.itemsize)))

    def _steps(self, spec: TensorSpec, sources: int, first: int, end: int) -> Iterator[_Step]:
        """The steps of one tensor's elements ``[first, end)`` (the whole tensor, or a process's
        share of it): its chunks, each cut into steps of :meth:`_per_step`."""
        info = self.tensors[spec.name]
        per_chunk = self._per_chunk(info, spec.dtype)
        per_step = self._per_step(info, spec.dtype, sources)
        for chunk_start, chunk_count in _chunks(first, end, per_chunk):
            for start in range(chunk_start, chunk_start + chunk_count, per_step):
                count = min(per_step, chunk_start + chunk_count - start)
                yield _Step(spec, info, chunk_start, chunk_count, start, count)

    def _units(self, shard: ShardSpec, sources: Sequence[int]) -> list[tuple[_Range, ...]]:
        """The element ranges an output file (or a process's share of it,
        :meth:`ShardSpec.ranges`) holds, in its order, each alone (its steps are :meth:`_steps`)
        or in a *run*: whole averaged tensors of one input and one output dtype, each smaller
        than a step and all of them together no larger, that lie one right after another in one
        file of every source (:meth:`CheckpointReader.adjacent`, asked of each: writers order and
        align alike, but nothing says they must). A run is read and averaged as one step, which
        costs what one tensor's step does: a model of many small tensors (the experts of a
        fine-grained MoE) is merged at the rate of a dense one. Empty ranges have no step; a
        part of a tensor (a process's share ends inside it) is never in a run."""
        ranges = [r for r in shard.ranges() if r[2] > r[1]]
        names = [spec.name for spec, _, _ in ranges]
        adjacent = [True] * max(0, len(ranges) - 1)
        for source in sources:
            adjacent = [a and b for a, b in zip(adjacent, self.readers[source].adjacent(names), strict=True)]
        units: list[list[_Range]] = []
        room = 0  # elements the last run may still take
        last: tuple[torch.dtype, torch.dtype] | None = None  # the last run's (input, output) dtypes
        for i, (spec, first, end) in enumerate(ranges):
            info = self.tensors[spec.name]
            # None: not in any run (a part of a tensor, or a copied one).
            kind = (info.dtype, spec.dtype) if first == 0 and end == info.numel and self._averages(info) else None
            if kind is not None and kind == last and adjacent[i - 1] and info.numel <= room:
                units[-1].append((spec, first, end))
                room -= info.numel
            else:
                units.append([(spec, first, end)])
                last = kind
                room = 0 if kind is None else self._per_step(info, spec.dtype, len(sources)) - info.numel
        return [tuple(unit) for unit in units]

    def _unit_steps(self, unit: tuple[_Range, ...], sources: int) -> Iterator[_Step]:
        """The steps of a range alone, or the one step of a run."""
        if len(unit) == 1:
            spec, first, end = unit[0]
            yield from self._steps(spec, sources, first, end)
            return
        infos = tuple(self.tensors[spec.name] for spec, _, _ in unit)
        count = sum(info.numel for info in infos)
        yield _Step(unit[0][0], infos[0], 0, count, 0, count, infos)

    def run(
        self,
        shards: Sequence[ShardSpec],
        open_sink: Callable[[ShardSpec], ShardSink],
        on_file_done: Callable[[str, str], None] | None = None,
    ) -> dict[str, str]:
        """Write every shard through ``open_sink``; return each file's sha256. ``on_file_done``
        is told of each finished file (from the writer thread) as soon as it is closed."""
        plan = _Plan(
            tuple(self._order),
            {i: w for i, w in enumerate(self.weights)},
            self.divisor if self.uniform else None,
            self.copy_from,
        )
        return self._run(shards, [plan], [open_sink], [on_file_done])[0]

    def run_many(
        self,
        shards: Sequence[ShardSpec],
        candidates: Sequence[Candidate],
        open_sinks: Sequence[Callable[[ShardSpec], ShardSink]],
        on_file_done: Sequence[Callable[[str, str], None] | None] | None = None,
    ) -> list[dict[str, str]]:
        """Write every shard of every candidate in one pass over the sources: candidate ``k``'s
        files through ``open_sinks[k]``, each byte-identical to what
        ``StreamingAverage([readers[i] for i in sources], weights, options).run(...)`` writes.
        Every block of every source is read once and folded into each candidate holding it.
        Returns each candidate's file sha256s; ``on_file_done[k]`` (if given) is told of each of
        candidate ``k``'s finished files from its writer thread."""
        if not candidates:
            raise ConfigError("nothing to average: no candidates")
        if len(open_sinks) != len(candidates) or (on_file_done is not None and len(on_file_done) != len(candidates)):
            raise ConfigError(f"{len(candidates)} candidates need as many sinks and file callbacks")
        plans = [self._plan(candidate) for candidate in candidates]
        return self._run(shards, plans, open_sinks, on_file_done or [None] * len(plans))

    def _plan(self, candidate: Candidate) -> _Plan:
        sources = candidate.sources
        if not sources or list(sources) != sorted(set(sources)) or not all(0 <= i < len(self.readers) for i in sources):
            raise ConfigError(
                f"candidate sources {list(sources)} must be distinct indices below {len(self.readers)}, ascending"
            )
        copy_from = sources[-1] if candidate.copy_from is None else candidate.copy_from
        if copy_from not in sources:
            raise ConfigError(
                f"candidate copies from source {copy_from}, which is not one of its sources {list(sources)}"
            )
        if candidate.weights is None:
            return _Plan(tuple(reversed(sources)), dict.fromkeys(sources, 1.0 / len(sources)), len(sources), copy_from)
        if len(candidate.weights) != len(sources):
            raise ConfigError(f"{len(candidate.weights)} weights given for {len(sources)} sources")
        weights = normalised(candidate.weights, allow_negative=True)
        return _Plan(tuple(reversed(sources)), dict(zip(sources, weights, strict=True)), None, copy_from)

    def _run(
        self,
        shards: Sequence[ShardSpec],
        plans: Sequence[_Plan],
        open_sinks: Sequence[Callable[[ShardSpec], ShardSink]],
        on_file_done: Sequence[Callable[[str, str], None] | None],
    ) -> list[dict[str, str]]:
        sources = sorted({i for plan in plans for i in plan.order}, reverse=True)  # newest first
        # The process's owner (the CLI: the main thread) gets its cores for the arithmetic. A
        # merge in a background thread (the training hook's) keeps to one thread and to blocks
        # that run inline, so that it never takes training's cores or starts an OpenMP team.
        owns_process = threading.current_thread() is threading.main_thread()
        threads = self.options.threads or (default_threads() if owns_process else 1)
        block = BLOCK_ELEMENTS if owns_process else INLINE_ELEMENTS
        # Several outputs share the cache: smaller blocks keep all their accumulators in it.
        block = max(4096, _aligned(block // len(plans)))

        units = [self._units(shard, sources) for shard in shards]

        def all_steps() -> Iterator[_Step]:
            for shard_units in units:
                for unit in shard_units:
                    yield from self._unit_steps(unit, len(sources))

        inputs = _Inputs(self.readers, sources, all_steps(), self.options.workers, self.options.mmap)
        # Output buffers as large as the largest step written, not a whole chunk: a small model's
        # merge would otherwise start by zero-filling _WRITER_DEPTH chunks per output.
        out_bytes = max((self._largest_step(unit) for shard_units in units for unit in shard_units), default=0)
        writers = [_BackgroundWriter(_WRITER_DEPTH, out_bytes, done) for done in on_file_done]
        pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="ckptavg-sum") if threads > 1 else None
        blocks = [_Blocks() for _ in range(threads)]
        opened: list[ShardSink] = []
        # One intra-op thread on purpose: the worker threads own the cores, and torch's own
        # thread pool contending with them (and with the reader and writer threads) made merges
        # 2-3x slower. The setting is process-wide, so only a merge that owns the process
        # changes it; the training hook's merges must leave training's threads alone.
        torch_threads = torch.get_num_threads()
        if owns_process:
            torch.set_num_threads(1)
        try:
            for shard, shard_units in zip(shards, units, strict=True):
                sinks = []
                for open_sink in open_sinks:
                    sinks.append(open_sink(shard))
                    opened.append(sinks[-1])
                for unit in shard_units:
                    for _ in self._unit_steps(unit, len(sources)):
                        step, views = inputs.next()
                        self.progress(step.count * step.info.dtype.itemsize * len(sources))
                        outs = [writer.take() for writer in writers]
                        if self._averages(step.info):
                            self._average_step(step, views, plans, sources, outs, pool, blocks, block)
                        else:
                            self._copy_exact_step(step, views, plans, outs)
                        for writer, sink, out in zip(writers, sinks, outs, strict=True):
                            writer.write(sink, out, step.count * step.spec.dtype.itemsize)
                for writer, sink in zip(writers, sinks, strict=True):
                    writer.close_file(sink, shard.file_name)
            return [writer.finish() for writer in writers]
        except BaseException:
            for writer in writers:
                with contextlib.suppress(BaseException):  # the first error is the one to report
                    writer.finish()
            for sink in opened:
                sink.abort()
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            inputs.close()
            if owns_process:
                torch.set_num_threads(torch_threads)

    def _largest_step(self, unit: tuple[_Range, ...]) -> int:
        """Output bytes of the largest step of a unit (:meth:`_units`)."""
        spec, first, end = unit[0]
        if len(unit) == 1:
            return min(end - first, self._per_chunk(self.tensors[spec.name], spec.dtype)) * spec.dtype.itemsize
        return sum(end - first for _, first, end in unit) * spec.dtype.itemsize

    def _average_step(
        self,
        step: _Step,
        views: Mapping[int, memoryview],
        plans: Sequence[_Plan],
        sources: Sequence[int],
        outs: Sequence[bytearray],
        pool: ThreadPoolExecutor | None,
        blocks: Sequence[_Blocks],
        block: int,
    ) -> None:
        """One step of every floating output, its blocks shared out between the threads in
        contiguous runs (each thread's inputs and outputs stay apart)."""
        info, count = step.info, step.count
        acc_dtype = accumulator_dtype(info.dtype, step.spec.dtype)
        values = {s: torch.frombuffer(views[s], dtype=info.dtype, count=count) for s in sources}
        out = [torch.frombuffer(o, dtype=step.spec.dtype, count=count) for o in outs]

        # Weighted sums go their own way (in fp64, checked); the others share one schedule,
        # worked out once per step: per source, the outputs it starts (their newest source, with
        # its weight) and those it is added to (with their factors). A uniform sum adds with
        # weight 1 and is divided at the end.
        checked = [k for k, p in enumerate(plans) if p.checked(step.spec.dtype)]
        summed = [(k, p) for k, p in enumerate(plans) if not p.checked(step.spec.dtype)]

        def weight(k: int, s: int) -> float:
            return 1.0 if plans[k].divisor is not None else plans[k].weights[s]

        schedule = [
            (
                values[s],
                [(k, weight(k, s)) for k, p in summed if p.order[0] == s],
                [k for k, p in summed if s in p.order[1:]],
                [(1.0, weight(k, s)) for k, p in summed if s in p.order[1:]],
            )
            for s in sources
        ]
        size = block
        block = min(block, count)
        per_thread = -(-count // (block * len(blocks))) * block
        ranges = [(lo, min(count, lo + per_thread)) for lo in range(0, count, per_thread)]
        check = not self.options.allow_nonfinite
        # The compiled loop covers outputs in their input's dtype, checked for NaN and Inf; the
        # rest keeps torch's ops (a dtype change, a NaN's bits under --allow-nonfinite, fp64, and
        # fp16 on a CPU without F16C).
        native = native_mean() if self.options.native and check and info.dtype == step.spec.dtype else None
        if native is not None and (
            info.dtype not in native.dtypes
            # C reads whole elements: a tensor at an odd offset of a mapped file (no writer we
            # know of stores one) keeps torch's ops.
            or any(t.data_ptr() % info.dtype.itemsize for t in [*values.values(), *out])
        ):
            native = None

        def bound(acc: list[torch.Tensor]) -> list[tuple[list, list[torch.Tensor], list]]:
            """Per source, the schedule with each output's accumulator in place of its index."""
            return [
                ([(acc[k], w) for k, w in starting], [acc[k] for k in adding], factors)
                for _, starting, adding, factors in schedule
            ]

        def work(lo: int, hi: int, mine: _Blocks) -> set[int]:
            for k in checked:
                plan = plans[k]
                mine.weighted().mean(
                    [values[s][lo:hi] for s in plan.order], [plan.weights[s] for s in plan.order], out[k][lo:hi], native
                )
            bad = {k for k in checked if check and not is_finite(out[k][lo:hi])}
            if native is not None:
                # One call per output: each candidate of a sweep computed as its own merge would be.
                item = info.dtype.itemsize
                for k, plan in summed:
                    addresses = [values[s].data_ptr() + lo * item for s in plan.order]
                    target = out[k].data_ptr() + lo * item
                    if not native.mean(info.dtype, addresses, hi - lo, target, plan.divisor or 1.0):
                        bad.add(k)
                return bad
            if not summed:
                return bad
            whole, whole_scratch, whole_near = mine.get(acc_dtype, len(plans), size)
            # Python work between the torch calls holds the GIL that the other threads' calls
            # need back: the run's blocks are cut in one call per tensor, and a whole block
            # reuses one bound schedule.
            whole_schedule = bound(whole)
            parts = [source[lo:hi].split(block) for source, _, _, _ in schedule]
            outputs = [o[lo:hi].split(block) for o in out]
            for i, b in enumerate(range(lo, hi, block)):
                n = min(block, hi - b)
                if n == size:
                    acc, conv, near, steps = whole, whole_scratch, whole_near, whole_schedule
                else:
                    acc = [a[:n] for a in whole]
                    conv, steps = whole_scratch[:n], bound(acc)
                    near = None if whole_near is None else whole_near[:n]
                for (starting, adding, factors), source_parts in zip(steps, parts, strict=True):
                    part = source_parts[i]
                    for total, w in starting:
                        start_sum(total, part, w)
                    if adding:
                        fold_in(adding, part, conv, factors)
                for k, plan in summed:
                    finish_mean(acc[k], outputs[k][i], conv, plan.divisor, near)
            # Checked once per range, on the output: a NaN or Inf in the sum survives the division
            # and the cast, and so does an overflow of the output's own dtype.
            return bad | {k for k, _ in summed if check and not is_finite(out[k][lo:hi])}

        futures = (
            []
            if pool is None
            else [pool.submit(work, *r, mine) for r, mine in zip(ranges[1:], blocks[1:], strict=False)]
        )
        try:
            bad = work(*ranges[0], blocks[0])
        finally:
            wait(futures)
        for future in futures:
            bad |= future.result()
        if bad:
            failed, start, failed_count, k = _first_nonfinite(step, out, bad)
            summed_in = torch.float64 if plans[k].checked(step.spec.dtype) else acc_dtype
            self._raise_nonfinite(failed, step.spec.dtype, start, failed_count, plans[k].order, summed_in)

    def _file_of(self, source: int, name: str) -> str:
        """The file of source ``source`` that holds tensor ``name`` (for error messages only)."""
        return next(t.file for t in self.readers[source].tensors() if t.name == name)

    def _read_chunk(self, source: int, info: TensorInfo, start: int, count: int) -> bytearray:
        buffer = bytearray(count * info.dtype.itemsize)
        self.readers[source].read_into(info.name, start * info.dtype.itemsize, memoryview(buffer))
        return buffer

    def _raise_nonfinite(
        self,
        info: TensorInfo,
        out_dtype: torch.dtype,
        start: int,
        count: int,
        order: Sequence[int],
        summed_in: torch.dtype | None = None,
    ) -> None:
        """The error for a chunk whose average is not finite: the first NaN or Inf of its
        sources, newest first, or an overflow of the sum or of the output's dtype."""
        for source in order:
            values = torch.frombuffer(self._read_chunk(source, info, start, count), dtype=info.dtype, count=count)
            bad = (~finite(values)).nonzero()
            if bad.numel():
                flat = start + int(bad[0])
                kind = "NaN" if bool(values[int(bad[0])].isnan()) else "Inf"
                raise CheckpointError(
                    f"tensor {info.name!r} in {self._file_of(source, info.name)} holds {kind} (element {flat}); "
                    "pass --allow-nonfinite to merge it anyway"
                )
        raise CheckpointError(
            f"tensor {info.name!r}: the average of its finite inputs overflows (a "
            f"{summed_in or accumulator_dtype(info.dtype, out_dtype)} sum written as {out_dtype})"
        )

    def _copy_exact_step(
        self, step: _Step, views: Mapping[int, memoryview], plans: Sequence[_Plan], outs: Sequence[bytearray]
    ) -> None:
        """Copied tensors (integers and bools: step counters, masks; float8 scales) are never
        averaged: all sources must agree, and the newest one's bytes are written, floats among
        them checked for NaN and Inf as averaged ones are. Those of the copy rules are written as
        ``copy_from`` holds them, whatever the others hold."""
        info, nbytes = step.info, step.count * step.info.dtype.itemsize
        check = info.dtype.is_floating_point and not self.options.allow_nonfinite
        ruled = info.name in self.copied
        for plan, out in zip(plans, outs, strict=True):
            out[:nbytes] = views[plan.copy_from if ruled else plan.order[0]]
            if not ruled and any(views[source] != memoryview(out)[:nbytes] for source in plan.order[1:]):
                self._raise_differing(info, step.chunk_start, step.chunk_count, plan.order)
            if check and not is_finite(torch.frombuffer(out, dtype=info.dtype, count=step.count)):
                order = (plan.copy_from,) if ruled else plan.order
                self._raise_nonfinite(info, info.dtype, step.chunk_start, step.chunk_count, order)

    def _raise_differing(self, info: TensorInfo, start: int, count: int, order: Sequence[int]) -> None:
        """The error for a chunk of a copied tensor (an integer tensor, a float8 tensor's scale)
        that the sources disagree on: the first source, newest first, whose bytes differ from the
        newest one's."""
        newest = self._read_chunk(order[0], info, start, count)
        differing = next((s for s in order[1:] if self._read_chunk(s, info, start, count) != newest), order[-1])
        files = f"{self._file_of(differing, info.name)} and {self._file_of(order[0], info.name)}"
        if info.name in self.scales:
            weight = self.scales[info.name]
            raise CheckpointError(
                f"{self.tensors[weight].dtype} tensor {weight!r} is scaled by {info.name!r}, which differs between "
                f"{files}: the mean of scaled values is not the scaled mean of raw ones, so float8 tensors are "
                "averaged only over sources that share their scales (ckptavg does not dequantize them)"
            )
        raise CheckpointError(
            f"{info.dtype} tensor {info.name!r} differs between {files}; integer tensors are not averaged but "
            f"copied from the newest source, so the sources must agree (--copy {info.name!r} takes it from one "
            "source instead)"
        )
