"""The streaming average: tensor by tensor, chunk by chunk, into reused buffers.

Memory is bounded by a handful of ``chunk_bytes`` buffers whatever the model size and the
number of inputs: reader threads fill a small ring of input buffers ahead of the main thread,
the main thread accumulates each chunk of every source into one accumulator, and a writer
thread streams finished chunks to the output files while hashing them.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import CheckpointError, ConfigError
from ..formats import CheckpointReader, TensorInfo
from ..formats.layout import ShardSpec, TensorSpec
from ..formats.writers import ShardSink
from ..units import format_bytes
from ..weighting import normalised

DEFAULT_CHUNK_BYTES = 16 * 2**20
MIN_CHUNK_BYTES = 64
# Larger chunks stop paying long before this (reads are already large and sequential), while
# the buffers a merge holds grow with them.
MAX_CHUNK_BYTES = 2**30
_WRITER_DEPTH = 2  # finished chunks queued for the writer thread


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
    """Input chunks in flight."""

    @property
    def buffers(self) -> int:
        """Chunk-sized buffers a merge holds at once: the read-ahead ring and the one being
        consumed, the writer's queue, and the accumulator with its conversion buffer."""
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


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def accumulator_dtype(input_dtype: torch.dtype, output_dtype: torch.dtype) -> torch.dtype:
    """fp32 for 8- and 16-bit floats, fp64 for fp32/fp64 inputs or an fp64 output.

    Why this is exact: the fp32 sum of N bf16 values is exact while one element's values
    span less than 2^(16 - log2 N) in magnitude (neighbouring training steps differ far less).
    Given an exact sum S, ``fp32(S / N)`` is never a spurious midpoint of the 16-bit grid:
    ``S - N*m`` is a multiple of ulp(S) >= 2^floor(log2 N) ulp(q) > N ulp(q) / 2, so the two
    roundings (fp32 quotient, then 16-bit cast) give the correctly rounded mean.
    """
    if input_dtype.itemsize >= 4 or output_dtype.itemsize >= 8:
        return torch.float64
    return torch.float32


def check_compatible(readers: Sequence[CheckpointReader]) -> list[TensorInfo]:
    """The tensor list all sources share (in the newest source's storage order), or an error
    naming the first key, shape or dtype that differs and the two places it differs between.
    Keys missing from some sources are never averaged over fewer inputs."""
    reference_reader = readers[-1]
    reference = reference_reader.tensors()
    by_name = {t.name: t for t in reference}
    for reader in readers[:-1]:
        theirs = {t.name: t for t in reader.tensors()}
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


def output_specs(
    tensors: Sequence[TensorInfo], dtype: torch.dtype | Mapping[str, torch.dtype] | None
) -> list[TensorSpec]:
    """Output dtype policy: floats take ``dtype`` when given (one for all, or one per tensor
    name), everything else keeps its own."""

    def chosen(t: TensorInfo) -> torch.dtype:
        wanted = dtype.get(t.name) if isinstance(dtype, Mapping) else dtype
        return wanted if wanted is not None and is_floating(t.dtype) else t.dtype

    return [TensorSpec(t.name, chosen(t), t.shape) for t in tensors]


@dataclass(frozen=True)
class Candidate:
    """One average computed in a pass: a subset of the sources with its weights."""

    sources: tuple[int, ...]
    """Indices into the readers, ascending (oldest first), non-empty."""
    weights: tuple[float, ...] | None = None
    """One per entry of ``sources`` (normalised by the engine, as :class:`StreamingAverage` does);
    None for the exact uniform mean."""


@dataclass(frozen=True)
class _Plan:
    """A candidate as :meth:`StreamingAverage.run_many` computes it: the same operations, in the
    same order, as a :class:`StreamingAverage` of its sources alone."""

    sources: tuple[int, ...]
    weights: dict[int, float] | None  # normalised, by source; None for the uniform mean

    @property
    def newest(self) -> int:
        return self.sources[-1]


@dataclass(frozen=True)
class _ReadJob:
    source: int
    name: str
    offset: int
    nbytes: int


class _Prefetcher:
    """Reads jobs in order on a thread pool, ``depth`` buffers ahead of the consumer.

    A buffer handed out by :meth:`next` stays valid until the following call.
    """

    def __init__(
        self, readers: Sequence[CheckpointReader], jobs: Iterator[_ReadJob], workers: int, depth: int, buffer_bytes: int
    ) -> None:
        self._readers = readers
        self._jobs = jobs
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptavg-read")
        self._free = [bytearray(buffer_bytes) for _ in range(depth + 1)]
        self._inflight: deque[tuple[_ReadJob, Future, bytearray]] = deque()
        self._current: bytearray | None = None

    def _fill(self) -> None:
        while self._free:
            job = next(self._jobs, None)
            if job is None:
                return
            buffer = self._free.pop()
            view = memoryview(buffer)[: job.nbytes]
            future = self._pool.submit(self._readers[job.source].read_into, job.name, job.offset, view)
            self._inflight.append((job, future, buffer))

    def next(self) -> tuple[_ReadJob, bytearray]:
        if self._current is not None:
            self._free.append(self._current)
            self._current = None
        self._fill()
        job, future, buffer = self._inflight.popleft()
        future.result()
        self._current = buffer
        return job, buffer

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


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


def _chunks(numel: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(start, min(per_chunk, numel - start)) for start in range(0, numel, per_chunk)]


class _Scratch:
    """The main thread's reused buffers: the accumulator and one converted input."""

    def __init__(self, chunk_bytes: int) -> None:
        self.accumulator = bytearray(chunk_bytes)
        self.converted = bytearray(chunk_bytes)


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
            self.weights = normalised(weights)
        else:
            self.weights = [1.0 / len(readers)] * len(readers)
        self.progress = progress or (lambda _n: None)
        self.tensors = {t.name: t for t in check_compatible(self.readers)}
        # Newest source first: integer tensors are copied from it and the others compared.
        self._order = list(range(len(self.readers) - 1, -1, -1))

    def _per_chunk(self, info: TensorInfo, out_dtype: torch.dtype) -> int:
        floating = is_floating(info.dtype)
        width = accumulator_dtype(info.dtype, out_dtype).itemsize if floating else info.dtype.itemsize
        return max(1, self.options.chunk_bytes // width)

    def read_bytes(self, shards: Sequence[ShardSpec]) -> int:
        """Bytes that writing ``shards`` reads from all sources together."""
        return sum(self.tensors[t.name].nbytes for shard in shards for t in shard.tensors) * len(self.readers)

    def _jobs(self, shards: Sequence[ShardSpec], order: Sequence[int] | None = None) -> Iterator[_ReadJob]:
        for shard in shards:
            for spec in shard.tensors:
                info = self.tensors[spec.name]
                for start, count in _chunks(info.numel, self._per_chunk(info, spec.dtype)):
                    item = info.dtype.itemsize
                    for source in self._order if order is None else order:
                        yield _ReadJob(source, spec.name, start * item, count * item)

    def run(
        self,
        shards: Sequence[ShardSpec],
        open_sink: Callable[[ShardSpec], ShardSink],
        on_file_done: Callable[[str, str], None] | None = None,
    ) -> dict[str, str]:
        """Write every shard through ``open_sink``; return each file's sha256. ``on_file_done``
        is told of each finished file (from the writer thread) as soon as it is closed."""
        chunk = self.options.chunk_bytes
        prefetch = _Prefetcher(self.readers, self._jobs(shards), self.options.workers, self.options.read_ahead, chunk)
        writer = _BackgroundWriter(depth=_WRITER_DEPTH, buffer_bytes=chunk, on_file_done=on_file_done)
        scratch = _Scratch(chunk)
        sinks: list[ShardSink] = []
        # One intra-op thread on purpose: the reader and writer threads keep the other cores
        # busy, and torch's own thread pool contending with them made merges 2-3x slower.
        # The setting is process-wide, so only a merge that owns the process (the main thread,
        # as in the CLI) changes it; the training hook's merges run in a background thread and
        # must leave training's threads alone.
        torch_threads = torch.get_num_threads()
        owns_process = threading.current_thread() is threading.main_thread()
        if owns_process:
            torch.set_num_threads(1)
        try:
            for shard in shards:
                sink = open_sink(shard)
                sinks.append(sink)
                for spec in shard.tensors:
                    info = self.tensors[spec.name]
                    for start, count in _chunks(info.numel, self._per_chunk(info, spec.dtype)):
                        out_buffer = writer.free.get()
                        writer.check()
                        if is_floating(info.dtype):
                            self._average_chunk(prefetch, info, spec.dtype, start, count, scratch, out_buffer)
                        else:
                            self._copy_exact_chunk(prefetch, info, start, count, out_buffer)
                        writer.write(sink, out_buffer, count * spec.dtype.itemsize)
                writer.close_file(sink, shard.file_name)
            return writer.finish()
        except BaseException:
            with contextlib.suppress(BaseException):  # the first error is the one to report
                writer.finish()
            for sink in sinks:
                sink.abort()
            raise
        finally:
            prefetch.close()
            if owns_process:
                torch.set_num_threads(torch_threads)

    def _plans(self, candidates: Sequence[Candidate]) -> list[_Plan]:
        plans = []
        for candidate in candidates:
            sources = tuple(candidate.sources)
            if (
                not sources
                or any(not 0 <= i < len(self.readers) for i in sources)
                or any(b <= a for a, b in zip(sources, sources[1:], strict=False))
            ):
                raise ConfigError(
                    f"candidate sources {list(sources)} must be ascending, distinct indices of the "
                    f"{len(self.readers)} sources"
                )
            weights = None
            if candidate.weights is not None:
                if len(candidate.weights) != len(sources):
                    raise ConfigError(f"{len(candidate.weights)} weights given for {len(sources)} sources")
                weights = dict(zip(sources, normalised(candidate.weights), strict=True))
            plans.append(_Plan(sources, weights))
        return plans

    def run_many(
        self,
        shards: Sequence[ShardSpec],
        candidates: Sequence[Candidate],
        open_sinks: Sequence[Callable[[ShardSpec], ShardSink]],
        on_file_done: Sequence[Callable[[str, str], None] | None] | None = None,
    ) -> list[dict[str, str]]:
        """Write every shard once per candidate, reading every block of every source once.

        Candidate ``k``'s files go through ``open_sinks[k]`` (``on_file_done[k]`` is told of
        each as :meth:`run`'s callback is); its bytes are those of a :class:`StreamingAverage`
        of its sources alone with its weights. Returns each candidate's {file name: sha256}."""
        plans = self._plans(candidates)
        if len(open_sinks) != len(plans) or (on_file_done is not None and len(on_file_done) != len(plans)):
            raise ConfigError(f"{len(plans)} candidates need one sink opener (and callback) each")
        used = sorted({source for plan in plans for source in plan.sources}, reverse=True)  # newest first
        chunk = self.options.chunk_bytes
        prefetch = _Prefetcher(
            self.readers, self._jobs(shards, used), self.options.workers, self.options.read_ahead, chunk
        )
        writers = [
            _BackgroundWriter(_WRITER_DEPTH, chunk, None if on_file_done is None else on_file_done[k])
            for k in range(len(plans))
        ]
        accumulators = [bytearray(chunk) for _ in plans]
        converted = bytearray(chunk)
        sinks: list[ShardSink] = []
        torch_threads = torch.get_num_threads()
        owns_process = threading.current_thread() is threading.main_thread()
        if owns_process:  # as in run()
            torch.set_num_threads(1)
        try:
            for shard in shards:
                opened = [open_sink(shard) for open_sink in open_sinks]
                sinks.extend(opened)
                for spec in shard.tensors:
                    info = self.tensors[spec.name]
                    for start, count in _chunks(info.numel, self._per_chunk(info, spec.dtype)):
                        outs = []
                        for writer in writers:
                            outs.append(writer.free.get())
                            writer.check()
                        if is_floating(info.dtype):
                            self._average_chunk_many(
                                prefetch, used, plans, info, spec.dtype, start, count, accumulators, converted, outs
                            )
                        else:
                            self._copy_exact_chunk_many(prefetch, used, plans, info, count, outs)
                        for writer, sink, out in zip(writers, opened, outs, strict=True):
                            writer.write(sink, out, count * spec.dtype.itemsize)
                for writer, sink in zip(writers, opened, strict=True):
                    writer.close_file(sink, shard.file_name)
            return [writer.finish() for writer in writers]
        except BaseException:
            for writer in writers:
                with contextlib.suppress(BaseException):  # the first error is the one to report
                    writer.finish()
            for sink in sinks:
                sink.abort()
            raise
        finally:
            prefetch.close()
            if owns_process:
                torch.set_num_threads(torch_threads)

    def _average_chunk_many(
        self,
        prefetch: _Prefetcher,
        used: Sequence[int],
        plans: Sequence[_Plan],
        info: TensorInfo,
        out_dtype: torch.dtype,
        start: int,
        count: int,
        accumulators: Sequence[bytearray],
        scratch: bytearray,
        outs: Sequence[bytearray],
    ) -> None:
        """:meth:`_average_chunk` for several candidates: each source chunk, read once, goes into
        the accumulator of every candidate holding it, by the same operations in the same order
        (its newest source copied first, then the others added, newest first)."""
        acc_dtype = accumulator_dtype(info.dtype, out_dtype)
        accs = [torch.frombuffer(a, dtype=acc_dtype, count=count) for a in accumulators]
        converted = torch.frombuffer(scratch, dtype=acc_dtype, count=count)
        for source in used:
            job, buffer = prefetch.next()
            assert job.source == source
            self.progress(job.nbytes)
            values = torch.frombuffer(buffer, dtype=info.dtype, count=count)
            is_converted = False
            for plan, acc in zip(plans, accs, strict=True):
                if source not in plan.sources:
                    continue
                weight = 1.0 if plan.weights is None else plan.weights[source]
                if source == plan.newest:
                    acc.copy_(values)
                    if plan.weights is not None:
                        acc.mul_(weight)
                    continue
                if not is_converted:
                    converted.copy_(values)
                    is_converted = True
                if plan.weights is None:
                    acc.add_(converted)
                else:
                    acc.add_(converted, alpha=weight)
        for plan, acc, out_buffer in zip(plans, accs, outs, strict=True):
            if (
                not self.options.allow_nonfinite
                and not bool(torch.isfinite(acc.sum()))
                and not bool(torch.isfinite(acc).all())
            ):
                self._raise_nonfinite(info, start, count, plan.sources)
            out = torch.frombuffer(out_buffer, dtype=out_dtype, count=count)
            if plan.weights is not None:
                out.copy_(acc)
                continue
            torch.div(acc, len(plan.sources), out=converted)
            out.copy_(converted)

    def _copy_exact_chunk_many(
        self,
        prefetch: _Prefetcher,
        used: Sequence[int],
        plans: Sequence[_Plan],
        info: TensorInfo,
        count: int,
        outs: Sequence[bytearray],
    ) -> None:
        """:meth:`_copy_exact_chunk` for several candidates: each copies its newest source's
        bytes, and its other sources must agree with them."""
        nbytes = count * info.dtype.itemsize
        for source in used:
            job, buffer = prefetch.next()
            assert job.source == source
            self.progress(job.nbytes)
            for plan, out_buffer in zip(plans, outs, strict=True):
                if source == plan.newest:
                    out_buffer[:nbytes] = memoryview(buffer)[:nbytes]
                elif source in plan.sources and memoryview(buffer)[:nbytes] != memoryview(out_buffer)[:nbytes]:
                    raise CheckpointError(
                        f"{info.dtype} tensor {info.name!r} differs between {self._file_of(source, info.name)} and "
                        f"{self._file_of(plan.newest, info.name)}; integer tensors are not averaged but copied "
                        "from the newest source, so the sources must agree"
                    )

    def _average_chunk(
        self,
        prefetch: _Prefetcher,
        info: TensorInfo,
        out_dtype: torch.dtype,
        start: int,
        count: int,
        scratch: _Scratch,
        out_buffer: bytearray,
    ) -> None:
        acc_dtype = accumulator_dtype(info.dtype, out_dtype)
        acc = torch.frombuffer(scratch.accumulator, dtype=acc_dtype, count=count)
        converted = torch.frombuffer(scratch.converted, dtype=acc_dtype, count=count)
        for position in range(len(self.readers)):
            job, buffer = prefetch.next()
            self.progress(job.nbytes)
            values = torch.frombuffer(buffer, dtype=info.dtype, count=count)
            weight = self.weights[job.source]
            # Converting into a reused buffer first is ~2x faster than a mixed-dtype add_,
            # which allocates a fresh temporary per call.
            if position == 0:
                acc.copy_(values)
                if not self.uniform:
                    acc.mul_(weight)
            else:
                converted.copy_(values)
                if self.uniform:
                    acc.add_(converted)
                else:
                    acc.add_(converted, alpha=weight)
        # The cheap reduction first; the elementwise check only when the sum is not finite.
        if (
            not self.options.allow_nonfinite
            and not bool(torch.isfinite(acc.sum()))
            and not bool(torch.isfinite(acc).all())
        ):
            self._raise_nonfinite(info, start, count)
        out = torch.frombuffer(out_buffer, dtype=out_dtype, count=count)
        if not self.uniform:
            out.copy_(acc)
            return
        torch.div(acc, self.divisor, out=converted)
        out.copy_(converted)

    def _file_of(self, source: int, name: str) -> str:
        """The file of source ``source`` that holds tensor ``name`` (for error messages only)."""
        return next(t.file for t in self.readers[source].tensors() if t.name == name)

    def _raise_nonfinite(self, info: TensorInfo, start: int, count: int, sources: Sequence[int] | None = None) -> None:
        buffer = bytearray(count * info.dtype.itemsize)
        for source in self._order if sources is None else sorted(sources, reverse=True):
            self.readers[source].read_into(info.name, start * info.dtype.itemsize, memoryview(buffer))
            values = torch.frombuffer(buffer, dtype=info.dtype, count=count)
            bad = (~torch.isfinite(values)).nonzero()
            if bad.numel():
                flat = start + int(bad[0])
                kind = "NaN" if bool(values[int(bad[0])].isnan()) else "Inf"
                raise CheckpointError(
                    f"tensor {info.name!r} in {self._file_of(source, info.name)} holds {kind} (element {flat}); "
                    "pass --allow-nonfinite to average it anyway"
                )
        raise CheckpointError(
            f"tensor {info.name!r}: the sum of finite inputs overflows {accumulator_dtype(info.dtype, info.dtype)}"
        )

    def _copy_exact_chunk(
        self, prefetch: _Prefetcher, info: TensorInfo, start: int, count: int, out_buffer: bytearray
    ) -> None:
        """Integer and bool tensors (step counters, masks) are never averaged: all sources
        must agree, and the newest one's bytes are written."""
        nbytes = count * info.dtype.itemsize
        newest = self._order[0]
        for position in range(len(self.readers)):
            job, buffer = prefetch.next()
            self.progress(job.nbytes)
            if position == 0:
                out_buffer[:nbytes] = memoryview(buffer)[:nbytes]
            elif memoryview(buffer)[:nbytes] != memoryview(out_buffer)[:nbytes]:
                raise CheckpointError(
                    f"{info.dtype} tensor {info.name!r} differs between {self._file_of(job.source, info.name)} and "
                    f"{self._file_of(newest, info.name)}; integer tensors are not averaged but copied "
                    "from the newest source, so the sources must agree"
                )
