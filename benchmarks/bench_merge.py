"""Benchmark ``ckptavg merge`` against a naive load-all average and the raw read of its inputs.

Run with ``make bench`` (``.venv/bin/python benchmarks/bench_merge.py``). It measures, side by
side and interleaved repetition by repetition (so a noisy neighbour hurts all of them alike):

  a. ``ckptavg merge RUN --steps <4 steps> --out ... --force --quiet`` through the real CLI;
  b. the naive baseline of ``naive_merge.py`` (load_file everything, fp32 sum, save_file);
  c. reading the same input files into one reused buffer (``raw_read.py``), the I/O floor;
  d. ``ckptavg merge`` of 16 inputs, for the claim that memory does not grow with the inputs;
  e. case a with ``--no-fsync``: what making the output durable before publishing costs (ckptavg
     fsyncs every output file, the folders and the parent by default);
  f. case e with ``--threads 1`` and ``--threads 2``, and the engine alone (``engine_only.py``:
     reads and arithmetic into a sink that drops the bytes, so no output hashing or disk write
     bounds it) with 1 and 2 threads, reading the files and with its inputs already in memory
     (``--resident``: the fastest of 3 passes over mapped, populated inputs): how the arithmetic
     scales with threads when it is compute-bound, and how much of that survives the reader
     threads' copies sharing the same two cores; and, for reference, the same in-memory
     arithmetic split between 2 processes of one thread each, passes started together
     (``--processes 2``): what the two cores give side by side with no GIL shared; and the
     in-memory runs once more with torch's ops instead of the compiled mean loop
     (``--no-native``, ckptavg/merging/native.py), what that loop gains; and, between the
     in-memory runs, how fast 1 and 2 cores read memory (``memory_bus.py``), with the engine's
     memory traffic (inputs read, output written) as a share of it: where that share nears 1
     the in-memory rows are memory-bound, and threads cannot scale further;
  g. mergekit 0.1.5 (``mergekit-yaml``, linear merge) on the same 4 inputs, and ckptavg against
     it on 4 larger checkpoints (~2 GB each), when ``.venv-mergekit`` exists (``make bench``
     builds it; the mergekit rows are skipped, with a line saying so, where it cannot). Both
     write their outputs to tmpfs (``/dev/shm``), so that neither pays the disk: mergekit does
     not fsync, ckptavg does, and on a disk that alone would decide the comparison;
  h. the real floor of cases a and g, in the same rounds (``floor.py``): reading the inputs from
     the page cache, and writing the output's size durably (``O_DIRECT`` + fsync) on the
     output's filesystem; every merge is reported as merge seconds / floor seconds.

and prints the medians, their spread, and PASS/FAIL against the targets (ckptavg wall at most
0.6x naive, peak RSS at most 0.5 GB, RSS(16)/RSS(4) at most 1.10, merge GB/s at least 0.4x the
raw read's, 2 threads at least 1.7x one for the engine with its inputs in memory, wall at most
0.35x and peak RSS at most 0.2x mergekit's on the ~2 GB checkpoints). "merge GB/s" is the input read per second of the
merge itself, as ``ckptavg merge --json`` reports it (``seconds``: sources opened to output
published, interpreter start and imports excluded); the wall column includes them.

How it measures, and why:
  * Every measurement is its own child process, reaped with ``os.wait4`` so that wall, CPU and
    peak RSS (``ru_maxrss``) belong to that one process. ``getrusage(RUSAGE_CHILDREN)`` would
    report the largest child so far, not this one. This driver never imports torch: on Linux a
    child's ``ru_maxrss`` starts from the parent's RSS at spawn (vfork + exec), so the parent
    must stay small (its own peak is printed as the floor).
  * Inputs are synthetic Llama-like bf16 checkpoints (``make_checkpoints.py``), generated once
    into the data folder and reused; the 12 extra checkpoints of the 16-input case are only
    generated when that case runs.
  * The page cache is warmed before timing (each input set read end to end, again if that pass
    was disk-speed), so the numbers are about the merge, not the disk; the output says so.
  * The machine may be shared: each run also records the CPU time the rest of the machine
    used meanwhile ("other load", steal included), to tell a noisy sample from a slow program.
  * Before every measurement the previous outputs are deleted and ``os.sync()`` runs, so no
    run pays for another's write-back.
  * Wall times are process start to exit, interpreter start and imports included, because
    that is what a user waits for; the import cost alone is measured as an extra row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from floor import floor_command, parse_floor
from make_checkpoints import SPEC, checkpoint_bytes, missing_steps, spec_with_layers, step_numbers, weight_files
from results import record

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_DATA = REPO / "bench-data"

TARGET_WALL_VS_NAIVE = 0.6
TARGET_RSS_BYTES = 0.5e9
TARGET_RSS_SCALING = 1.10
TARGET_MERGE_VS_READ = 0.4  # at least: merge GB/s over raw-read GB/s of the same warm files
TARGET_THREAD_SCALING = 1.7  # at least: engine GB/s with 2 threads over 1
TARGET_WALL_VS_MERGEKIT = 0.35  # at most, on the ~2 GB checkpoints
TARGET_RSS_VS_MERGEKIT = 0.2  # at most, on the ~2 GB checkpoints
LARGE_LAYERS = 18  # 1.98 GB per checkpoint
MERGEKIT = REPO / ".venv-mergekit" / "bin" / "mergekit-yaml"
# Disk left free besides the inputs: up to three 1-GB outputs and some slack.
DISK_RESERVE_BYTES = 5e9
LOW_DISK_BYTES = 25e9
# Slower than this, a read pass was served (partly) by the disk rather than the page cache.
WARM_GB_PER_S = 2.0
# Where mergekit and ckptavg write the outputs they are compared on: memory, so neither pays the disk.
TMPFS = Path("/dev/shm")


@dataclass
class Sample:
    """One child process: what it cost, as the kernel accounted it."""

    wall_s: float
    cpu_s: float
    rss_bytes: int
    stdout: str = ""
    # Average CPUs busy outside this child during its run (other processes, and time the
    # hypervisor stole): the noise that made this sample slower than it could be.
    other_cpus: float = 0.0
    steal_cpus: float = 0.0
    sys_s: float = 0.0  # kernel share of cpu_s: page faults, copies from the page cache, writes
    minor_faults: int = 0


@dataclass
class Measurement:
    """All repetitions of one thing being measured, and how to summarize them."""

    key: str
    label: str
    command: list[str]
    samples: list[Sample] = field(default_factory=list)
    read_bytes: int = 0

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.samples)

    def spread(self, attr: str) -> tuple[float, float]:
        values = [getattr(s, attr) for s in self.samples]
        return min(values), max(values)

    def summary(self) -> dict[str, Any]:
        wall_lo, wall_hi = self.spread("wall_s")
        rss_lo, rss_hi = self.spread("rss_bytes")
        out: dict[str, Any] = {
            "label": self.label,
            "command": self.command,
            "runs": len(self.samples),
            "median_wall_s": self.median("wall_s"),
            "min_wall_s": wall_lo,
            "max_wall_s": wall_hi,
            "median_cpu_s": self.median("cpu_s"),
            "median_rss_bytes": self.median("rss_bytes"),
            "max_other_cpus": max(s.other_cpus for s in self.samples),
            "min_rss_bytes": rss_lo,
            "max_rss_bytes": rss_hi,
            "samples": [asdict(s) for s in self.samples],
        }
        if self.read_bytes:
            out["read_bytes"] = self.read_bytes
            out["gb_per_s_by_wall"] = self.read_bytes / self.median("wall_s") / 1e9
        return out


class ChildFailed(RuntimeError):
    pass


def _maxrss_bytes(ru_maxrss: int) -> int:
    # Linux reports KiB, macOS bytes.
    return ru_maxrss if sys.platform == "darwin" else ru_maxrss * 1024


def cpu_ticks() -> tuple[float, float]:
    """Seconds of busy and stolen CPU time of the whole machine so far (0, 0 without /proc)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz


def run_child(command: Sequence[str], timeout_s: float) -> Sample:
    """Run ``command`` to completion and return its own wall time, CPU time and peak RSS.

    ``os.wait4`` reaps exactly this child and hands back its rusage, which is robust however
    many children ran before. Output goes to temporary files, not pipes, so a chatty child can
    never block on a full pipe while we wait.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        busy_before, steal_before = cpu_ticks()
        started = time.perf_counter()
        proc = subprocess.Popen(list(command), stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            timer.cancel()
        wall = time.perf_counter() - started
        busy_after, steal_after = cpu_ticks()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        why = f"killed after {timeout_s:.0f} s" if wall >= timeout_s else f"exit status {proc.returncode}"
        raise ChildFailed(f"{' '.join(command)}: {why}\n{stderr[-4000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    other = max(0.0, busy_after - busy_before - cpu) / wall
    steal = max(0.0, steal_after - steal_before) / wall
    return Sample(
        wall,
        cpu,
        _maxrss_bytes(usage.ru_maxrss),
        stdout.strip(),
        round(other, 3),
        round(steal, 3),
        usage.ru_stime,
        usage.ru_minflt,
    )


def inside_rate(sample: Sample) -> float:
    """Input GB/s measured inside the process: a merge's ``--json`` (``read_gb_per_s``), or the
    line of ``raw_read.py`` / ``engine_only.py`` (``gb_per_s``)."""
    record = json.loads(sample.stdout)
    return float(record.get("read_gb_per_s", record.get("gb_per_s")))


def median_seconds(measurement: Measurement) -> float:
    """Median seconds measured inside the process: a merge's ``--json`` ``seconds`` (sources
    opened to output published), or a floor's (``floor.py``: the slower of its read and write)."""
    return statistics.median(json.loads(sample.stdout)["seconds"] for sample in measurement.samples)


def delete_outputs(entries: list[tuple[Measurement, Callable[[], None]]]) -> None:
    """Run the measurements' own clean-up once more after their last round: it deletes their outputs."""
    for _, clean in entries:
        clean()


def fresh(*paths: Path) -> None:
    """Delete earlier outputs and flush dirty pages, so the next run starts from the same state."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    info = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            info[name] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return info


def out_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def free_disk(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def ckptavg_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m ckptavg``."""
    script = Path(sys.executable).parent / "ckptavg"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptavg"]


def git_state() -> str:
    """Commit and number of locally modified files: the code measured is often not a commit."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    changed = [line for line in dirty.stdout.splitlines() if line.strip()]
    return head.stdout.strip() + (f" + {len(changed)} uncommitted changes" if changed else "")


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


class Bench:
    """One benchmark run: data preparation, measurements, report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.data: Path = args.data.resolve()
        self.run_dir = self.data / "run"
        self.notes: list[str] = []
        self.measurements: dict[str, Measurement] = {}
        self.checks: dict[str, Any] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix=".bench-out-", dir=self._ensure_data_dir()))
        self._tmpfs_scratch: Path | None = None

    def _ensure_data_dir(self) -> Path:
        self.data.mkdir(parents=True, exist_ok=True)
        return self.data

    def tmpfs_scratch(self, need_bytes: int) -> Path:
        """A folder on tmpfs with room for ``need_bytes`` of outputs, for comparisons in which
        neither tool should pay the disk; the disk scratch folder, with a note, where there is none.
        What is written there is memory: delete it as soon as it is measured."""
        if self._tmpfs_scratch is None and TMPFS.is_dir():
            self._tmpfs_scratch = Path(tempfile.mkdtemp(prefix="ckptavg-bench-", dir=TMPFS))
        if self._tmpfs_scratch is not None and shutil.disk_usage(self._tmpfs_scratch).free > 1.2 * need_bytes:
            return self._tmpfs_scratch
        self.note(f"no room for {gb(need_bytes)} on {TMPFS}: outputs meant for tmpfs go to disk")
        return self.scratch

    def add_floor(self, key: str, label: str, files: list[Path], write_bytes: int, write_folder: Path) -> Measurement:
        """The floor of a merge of ``files`` whose output of ``write_bytes`` goes to ``write_folder``
        (``floor.py`` in a child): measure it in the same rounds as the merge it is the floor of."""
        command = floor_command(files, write_bytes, write_folder)
        return self.add(key, label, command, sum(f.stat().st_size for f in files))

    def say(self, message: str) -> None:
        print(message, flush=True)

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.say(f"note: {message}")

    # -- data --------------------------------------------------------------------------------

    def affordable_count(self, want: int, floor: int) -> int:
        """The largest prefix of ``want`` steps (at least ``floor + 1``) whose missing folders fit
        on disk beside a reserve; 0 if none does."""
        free = free_disk(self.data)
        per = checkpoint_bytes() * 1.01
        for count in range(want, floor, -1):
            needed = len(missing_steps(self.run_dir, step_numbers(count))) * per + DISK_RESERVE_BYTES
            if needed <= free:
                return count
        return 0

    def ensure_steps(self, steps: list[int]) -> None:
        """The default checkpoints of ``steps`` in the run folder; exits where the disk has no room."""
        if not self.ensure_run(self.run_dir, steps, SPEC):
            raise SystemExit(f"bench: not enough free disk in {self.data} for the checkpoints")

    def ensure_run(self, run_dir: Path, steps: list[int], spec: dict[str, Any]) -> bool:
        """Generate the missing checkpoints of ``spec`` for ``steps`` in ``run_dir``, in a child
        (torch stays out of this process); False, with a note, where the disk has no room."""
        todo = missing_steps(run_dir, steps, spec)
        if not todo:
            self.say(f"data: {len(steps)} checkpoints cached in {run_dir}")
            return True
        free, size = free_disk(self.data), checkpoint_bytes(spec)
        needed = len(todo) * size * 1.01 + DISK_RESERVE_BYTES
        if needed > free:
            self.note(f"need {gb(needed)} free in {self.data} for {len(todo)} checkpoints, have {gb(free)}")
            return False
        self.say(f"data: generating {len(todo)} checkpoint(s) of {gb(size)} in {run_dir} ...")
        started = time.perf_counter()
        command = [sys.executable, str(HERE / "make_checkpoints.py"), str(run_dir), "--steps", ",".join(map(str, todo))]
        command += ["--layers", str(spec["num_hidden_layers"])]
        command += ["--experts", str(spec["num_experts"])] if "num_experts" in spec else []
        subprocess.run(command, check=True)
        if missing_steps(run_dir, steps, spec):
            raise SystemExit("bench: checkpoint generation did not complete")
        self.note(
            f"generated {len(todo)} checkpoint(s) in {time.perf_counter() - started:.0f} s (cached for next runs)"
        )
        return True

    def input_files(self, steps: list[int], run_dir: Path | None = None) -> list[Path]:
        return [f for s in steps for f in weight_files((run_dir or self.run_dir) / f"step{s}")]

    def warm(self, steps: list[int], run_dir: Path | None = None) -> None:
        """Read the inputs, untimed, so that timed runs read from the page cache.

        A pass slower than ``WARM_GB_PER_S`` came (partly) from disk, so it is repeated, up to
        twice more: a pass that is fast the second time shows the inputs now sit in memory; one
        that stays slow shows they do not fit, and the note says so.
        """
        files = self.input_files(steps, run_dir)
        size = sum(f.stat().st_size for f in files)
        available = meminfo().get("MemAvailable", 0)
        rates: list[float] = []
        while not rates or (rates[-1] < WARM_GB_PER_S and len(rates) < 3):
            sample = run_child([sys.executable, str(HERE / "raw_read.py"), *map(str, files)], self.args.timeout)
            rates.append(json.loads(sample.stdout)["gb_per_s"])
        passes = ", then ".join(f"{r:.2f} GB/s" for r in rates)
        self.note(
            f"page cache warmed before timing: read the {len(steps)} input checkpoints ({gb(size)}) "
            f"{len(rates)} time(s) untimed ({passes})"
        )
        if rates[-1] < WARM_GB_PER_S:
            self.note(f"inputs still read at {rates[-1]:.2f} GB/s after warming: timings include disk reads")
        if available and size > 0.8 * available:
            self.note(
                f"the {len(steps)} inputs ({gb(size)}) are close to or above available memory "
                f"({gb(available)}): part of them may be read from disk while timed"
            )

    # -- measuring ---------------------------------------------------------------------------

    def add(self, key: str, label: str, command: list[str], read_bytes: int = 0) -> Measurement:
        measurement = Measurement(key, label, command, read_bytes=read_bytes)
        self.measurements[key] = measurement
        return measurement

    def measure_round(self, entries: list[tuple[Measurement, Callable[[], None]]], repeat: int) -> None:
        """``repeat`` rounds over ``entries``, rotating the order each round so that no
        measurement always runs first (after a quiet spell) or last."""
        for round_index in range(repeat):
            shift = round_index % len(entries)
            for measurement, before in entries[shift:] + entries[:shift]:
                before()
                sample = run_child(measurement.command, self.args.timeout)
                measurement.samples.append(sample)
                self.say(
                    f"  [{round_index + 1}/{repeat}] {measurement.label}: {sample.wall_s:.2f} s wall, "
                    f"{sample.cpu_s:.2f} s CPU ({sample.sys_s:.2f} s sys, {sample.minor_faults} page faults), "
                    f"peak RSS {mb(sample.rss_bytes)}; other load {sample.other_cpus:.2f} CPUs, "
                    f"steal {sample.steal_cpus:.2f}"
                )

    def run(self) -> dict[str, Any]:
        args = self.args
        started = time.perf_counter()
        mem = meminfo()
        self.say(
            f"ckptavg merge benchmark: ckptavg {metadata.version('ckptavg')}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs, {gb(mem.get('MemTotal', 0))} RAM ({gb(mem.get('MemAvailable', 0))} available), "
            f"load average {os.getloadavg()[0]:.2f}, {gb(free_disk(self.data))} free disk"
        )
        self.say(f"code: {git_state()}; CLI: {' '.join(ckptavg_command())}")
        self.say(f"data folder: {self.data}; median of {args.repeat} runs each, every run a fresh process")
        small = step_numbers(args.inputs)
        self.ensure_steps(small)
        files = self.input_files(small)
        read_bytes = sum(f.stat().st_size for f in files)
        output_bytes = sum(f.stat().st_size for f in weight_files(self.run_dir / f"step{small[-1]}"))
        self.warm(small)

        out_ckpt, out_naive = self.scratch / f"ckptavg-{args.inputs}", self.scratch / f"naive-{args.inputs}"
        out_no_fsync = self.scratch / f"ckptavg-no-fsync-{args.inputs}"
        steps_arg = ",".join(map(str, small))
        n = args.inputs

        def merge_command(out: Path, *extra: str) -> list[str]:
            command = [*ckptavg_command(), "merge", str(self.run_dir), "--steps", steps_arg]
            return command + ["--out", str(out), "--force", "--quiet", "--json", *extra]

        merge = self.add("ckptavg", f"ckptavg merge, {n} inputs", merge_command(out_ckpt), read_bytes)
        # The same merge without fsync. Every run starts after os.sync(), so the one with fsync
        # pays for writing its output back inside its wall time; the other leaves that to the
        # kernel, after it exits: the difference is what durability costs.
        no_fsync = self.add(
            "ckptavg_no_fsync",
            f"ckptavg merge --no-fsync, {n} inputs",
            merge_command(out_no_fsync, "--no-fsync"),
            read_bytes,
        )
        naive = self.add(
            "naive",
            f"naive load-all, {n} inputs",
            [sys.executable, str(HERE / "naive_merge.py"), *(str(self.run_dir / f"step{s}") for s in small)]
            + ["--out", str(out_naive)],
            read_bytes,
        )
        raw = self.add(
            "raw_read",
            f"raw read, {n} inputs",
            [sys.executable, str(HERE / "raw_read.py"), *map(str, files)],
            read_bytes,
        )
        floor = self.add_floor(
            "floor", f"floor: read {n} inputs warm, write the output durably", files, output_bytes, self.scratch
        )
        startup = self.add(
            "startup",
            "python + import ckptavg (torch)",
            [sys.executable, "-c", "import ckptavg.cli, ckptavg; ckptavg.average"],
        )
        out_threads = self.scratch / f"ckptavg-threads-{args.inputs}"
        by_threads = [
            self.add(
                f"ckptavg_t{t}",
                f"ckptavg merge --no-fsync --threads {t}, {n} inputs",
                merge_command(out_threads, "--no-fsync", "--threads", str(t)),
                read_bytes,
            )
            for t in (1, 2)
        ]
        folders = [str(self.run_dir / f"step{s}") for s in small]
        engine = [
            self.add(
                f"engine_t{t}",
                f"engine alone, --threads {t}, {n} inputs",
                [sys.executable, str(HERE / "engine_only.py"), *folders, "--threads", str(t)],
                read_bytes,
            )
            for t in (1, 2)
        ]
        in_memory = ["--resident", "--repeat", "3"]
        resident = [
            self.add(
                f"engine_resident_t{t}",
                f"engine, inputs in memory, --threads {t}, {n} inputs",
                [sys.executable, str(HERE / "engine_only.py"), *folders, "--threads", str(t), *in_memory],
                read_bytes,
            )
            for t in (1, 2)
        ]
        torch_ops = [
            self.add(
                f"engine_resident_torch_t{t}",
                f"engine, inputs in memory, torch's ops (--no-native), --threads {t}, {n} inputs",
                [sys.executable, str(HERE / "engine_only.py"), *folders, "--threads", str(t), "--no-native"]
                + in_memory,
                read_bytes,
            )
            for t in (1, 2)
        ]
        # The memory bus, measured between the in-memory runs: the ceiling they work under, which
        # on a VM moves with the host's placement of the virtual CPUs.
        bus = [
            self.add(
                f"memory_bus_t{t}",
                f"memory read, torch.sum over 1 GiB, {t} core(s)",
                [sys.executable, str(HERE / "memory_bus.py"), "--threads", str(t)],
            )
            for t in (1, 2)
        ]
        processes = self.add(
            "engine_resident_p2",
            f"engine, inputs in memory, 2 processes of 1 thread, {n} inputs",
            [sys.executable, str(HERE / "engine_only.py"), *folders, "--processes", "2", *in_memory],
            read_bytes,
        )
        pair = self.mergekit_pair(
            ("ckptavg_tmpfs", "mergekit"), f"{n} inputs", self.run_dir, small, read_bytes, output_bytes
        )
        self.say(f"measuring {n} inputs ({gb(read_bytes)} to read per run):")
        self.measure_round(
            [
                (raw, os.sync),
                (floor, os.sync),
                (merge, lambda: fresh(out_ckpt)),
                (no_fsync, lambda: fresh(out_no_fsync)),
                (by_threads[0], lambda: fresh(out_threads)),
                (by_threads[1], lambda: fresh(out_threads)),
                (engine[0], os.sync),
                (engine[1], os.sync),
                (bus[0], os.sync),
                (resident[0], os.sync),
                (bus[1], os.sync),
                (resident[1], os.sync),
                (torch_ops[0], os.sync),
                (torch_ops[1], os.sync),
                (processes, os.sync),
                (naive, lambda: fresh(out_naive)),
                (startup, os.sync),
                *pair,
            ],
            args.repeat,
        )
        delete_outputs(pair)
        if not json.loads(resident[0].samples[0].stdout)["native"]:
            self.note("the compiled mean loop did not build (no C compiler?): every engine row ran torch's ops")
        if args.check:
            sample = run_child(
                [sys.executable, str(HERE / "compare_checkpoints.py"), str(out_ckpt), str(out_naive)], args.timeout
            )
            self.checks["ckptavg_vs_naive"] = json.loads(sample.stdout)
            verdict = "identical" if self.checks["ckptavg_vs_naive"]["identical"] else "DIFFERENT"
            self.say(f"check: ckptavg output vs naive output: {verdict} ({self.checks['ckptavg_vs_naive']})")
        synced, unsynced = merge.median("wall_s"), no_fsync.median("wall_s")
        self.say(
            f"fsync cost: median {synced:.2f} s with fsync, {unsynced:.2f} s with --no-fsync "
            f"(x{synced / unsynced:.3f}, {synced - unsynced:+.2f} s for {gb(out_bytes(out_ckpt))} of output)"
        )
        if not args.keep_outputs:
            fresh(out_ckpt, out_naive, out_no_fsync, out_threads)
        if args.large and pair:
            self.measure_large()

        if args.scale_inputs > n:
            count = self.affordable_count(args.scale_inputs, n)
            if free_disk(self.data) < LOW_DISK_BYTES and count:
                self.note(f"less than {gb(LOW_DISK_BYTES)} free disk")
            if count == 0:
                self.note(f"not enough disk for more than {n} inputs: RSS scaling not measured")
            else:
                if count < args.scale_inputs:
                    self.note(f"disk space allows {count} inputs, not {args.scale_inputs}: RSS scaling uses {count}")
                self.measure_scaling(step_numbers(count))
        elif args.scale_inputs:
            self.note(f"--scale-inputs {args.scale_inputs} is not above --inputs {n}: RSS scaling not measured")

        report = self.report(time.perf_counter() - started)
        return report

    def mergekit_measurement(self, key: str, label: str, folders: list[str], out: Path) -> Measurement:
        """mergekit's linear merge of ``folders`` (equal weights, bf16)."""
        config = self.scratch / f"{key}.yml"
        models = "".join(f"  - model: {folder}\n    parameters:\n      weight: 1.0\n" for folder in folders)
        config.write_text(f"merge_method: linear\ndtype: bfloat16\nmodels:\n{models}")
        return self.add(key, label, [str(MERGEKIT), str(config), str(out), "--no-copy-tokenizer"])

    def measure_large(self) -> None:
        """Case g on ~2 GB checkpoints: ckptavg against mergekit, wall and peak RSS."""
        spec = spec_with_layers(LARGE_LAYERS)
        run_dir = self.data / "run-large"
        steps = step_numbers(self.args.inputs)
        if not self.ensure_run(run_dir, steps, spec):
            self.note("case g skipped")
            return
        folders = [str(run_dir / f"step{s}") for s in steps]
        files = [f for folder in folders for f in weight_files(Path(folder))]
        read_bytes = sum(f.stat().st_size for f in files)
        for _ in range(2):  # warm the page cache, untimed
            run_child([sys.executable, str(HERE / "raw_read.py"), *map(str, files)], self.args.timeout)
        label = f"{len(steps)} x {gb(checkpoint_bytes(spec))}"
        output_bytes = sum(f.stat().st_size for f in weight_files(Path(folders[-1])))
        pair = self.mergekit_pair(("ckptavg_large", "mergekit_large"), label, run_dir, steps, read_bytes, output_bytes)
        raw = self.add(
            "raw_read_large",
            f"raw read, {label}",
            [sys.executable, str(HERE / "raw_read.py"), *map(str, files)],
            read_bytes,
        )
        floor = self.add_floor(
            "floor_large", f"floor, {label}, output on tmpfs", files, output_bytes, self.tmpfs_scratch(output_bytes)
        )
        self.say(f"measuring {label} ({gb(read_bytes)} to read per run):")
        self.measure_round([(raw, os.sync), (floor, os.sync), *pair], self.args.repeat)
        delete_outputs(pair)

    def mergekit_pair(
        self, keys: tuple[str, str], label: str, run_dir: Path, steps: list[int], read_bytes: int, output_bytes: int
    ) -> list[tuple[Measurement, Callable[[], None]]]:
        """ckptavg and mergekit merging the same checkpoints, both writing to tmpfs so that neither
        pays the disk (mergekit does not fsync, ckptavg does), each output deleted before every
        run (and by ``delete_outputs`` after the last); none without ``.venv-mergekit``."""
        if not MERGEKIT.exists():
            if not any("mergekit" in note for note in self.notes):
                self.note(f"no {MERGEKIT} (make bench builds it): the mergekit rows are skipped")
            return []
        shm = self.tmpfs_scratch(2 * output_bytes)
        out, out_mergekit = shm / keys[0], shm / keys[1]
        merge = self.add(
            keys[0],
            f"ckptavg merge, {label}, output on tmpfs",
            [*ckptavg_command(), "merge", str(run_dir), "--steps", ",".join(map(str, steps))]
            + ["--out", str(out), "--force", "--quiet", "--json"],
            read_bytes,
        )
        folders = [str(run_dir / f"step{s}") for s in steps]
        mergekit = self.mergekit_measurement(
            keys[1], f"mergekit 0.1.5, {label}, output on tmpfs", folders, out_mergekit
        )
        return [(merge, lambda: fresh(out)), (mergekit, lambda: fresh(out_mergekit))]

    def measure_scaling(self, steps: list[int]) -> None:
        """Case d: the same merge over many more inputs; only memory is expected to stay put."""
        self.ensure_steps(steps)
        self.warm(steps)
        out = self.scratch / f"ckptavg-{len(steps)}"
        read_bytes = sum(f.stat().st_size for f in self.input_files(steps))
        big = self.add(
            "ckptavg_scale",
            f"ckptavg merge, {len(steps)} inputs",
            [*ckptavg_command(), "merge", str(self.run_dir), "--steps", ",".join(map(str, steps))]
            + ["--out", str(out), "--force", "--quiet", "--json"],
            read_bytes,
        )
        self.say(f"measuring {len(steps)} inputs ({gb(read_bytes)} to read per run):")
        self.measure_round([(big, lambda: fresh(out))], self.args.repeat)
        if not self.args.keep_outputs:
            fresh(out)

    # -- report ------------------------------------------------------------------------------

    def ratios(self) -> list[dict[str, Any]]:
        m = self.measurements
        rows: list[dict[str, Any]] = []

        def row(name: str, value: float | None, target: float | None, unit: str = "", at_least: bool = False) -> None:
            passed = None if value is None or target is None else (value >= target if at_least else value <= target)
            rows.append(
                {"metric": name, "value": value, "target": target, "unit": unit, "pass": passed, "at_least": at_least}
            )

        def rate(key: str) -> float:
            return statistics.median(inside_rate(s) for s in m[key].samples)

        wall, rss = m["ckptavg"].median("wall_s"), m["ckptavg"].median("rss_bytes")
        row("ckptavg wall / naive wall", wall / m["naive"].median("wall_s"), TARGET_WALL_VS_NAIVE)
        row("  same, fastest runs (min / min)", m["ckptavg"].spread("wall_s")[0] / m["naive"].spread("wall_s")[0], None)
        row("ckptavg wall / raw read wall", wall / m["raw_read"].median("wall_s"), None)

        def floor_ratio(merge: str, floor: str) -> float:
            return median_seconds(m[merge]) / median_seconds(m[floor])

        row(
            "merge s / floor s (floor: warm read or durable write of the output)", floor_ratio("ckptavg", "floor"), None
        )
        row("  same, --no-fsync", floor_ratio("ckptavg_no_fsync", "floor"), None)
        row("ckptavg wall / same with --no-fsync (fsync's cost)", wall / m["ckptavg_no_fsync"].median("wall_s"), None)
        row("ckptavg peak RSS (GB)", rss / 1e9, TARGET_RSS_BYTES / 1e9, "GB")
        row("naive peak RSS / ckptavg peak RSS", m["naive"].median("rss_bytes") / rss, None)
        read = rate("raw_read")
        row("merge GB/s / raw read GB/s (--no-fsync)", rate("ckptavg_no_fsync") / read, TARGET_MERGE_VS_READ, "", True)
        row("  same, with fsync", rate("ckptavg") / read, None)
        row("  engine alone (no output written) / raw read", rate("engine_t2") / read, None)
        row(
            "engine GB/s in memory, 2 threads / 1",
            rate("engine_resident_t2") / rate("engine_resident_t1"),
            TARGET_THREAD_SCALING,
            "",
            True,
        )
        row(
            "  reference: 2 processes of 1 thread / 1 thread, in memory",
            rate("engine_resident_p2") / rate("engine_resident_t1"),
            None,
        )
        row(
            "  2 threads / 2 processes of 1 thread, in memory",
            rate("engine_resident_t2") / rate("engine_resident_p2"),
            None,
        )

        # Bytes the engine moves through memory per second: its inputs read, and its output
        # written, counted twice (a store reads its cache line before writing it).
        def traffic(key: str) -> float:
            return statistics.median(
                (record["bytes"] + 2 * record["written"]) / record["seconds"] / 1e9
                for record in (json.loads(sample.stdout) for sample in m[key].samples)
            )

        row("  memory bus: 2 cores' read GB/s / 1 core's", rate("memory_bus_t2") / rate("memory_bus_t1"), None)
        row(
            "  engine's memory traffic / the bus's read GB/s, 1 thread",
            traffic("engine_resident_t1") / rate("memory_bus_t1"),
            None,
        )
        row(
            "  same, 2 threads / 2 cores",
            traffic("engine_resident_t2") / rate("memory_bus_t2"),
            None,
        )
        row(
            "  torch's ops instead of the compiled loop: 2 threads / 1",
            rate("engine_resident_torch_t2") / rate("engine_resident_torch_t1"),
            None,
        )
        row(
            "  compiled loop / torch's ops, in memory, 1 thread",
            rate("engine_resident_t1") / rate("engine_resident_torch_t1"),
            None,
        )
        row("  same, 2 threads", rate("engine_resident_t2") / rate("engine_resident_torch_t2"), None)
        row("  engine GB/s reading the files, 2 threads / 1", rate("engine_t2") / rate("engine_t1"), None)
        row("merge GB/s --no-fsync, 2 threads / 1 thread", rate("ckptavg_t2") / rate("ckptavg_t1"), None)
        if "mergekit" in m:
            ours, kit = m["ckptavg_tmpfs"], m["mergekit"]
            row("ckptavg wall / mergekit wall (outputs on tmpfs)", ours.median("wall_s") / kit.median("wall_s"), None)
            row("ckptavg peak RSS / mergekit peak RSS", ours.median("rss_bytes") / kit.median("rss_bytes"), None)
        if "mergekit_large" in m:
            large, kit = m["ckptavg_large"], m["mergekit_large"]
            row(
                "ckptavg wall / mergekit wall, ~2 GB inputs",
                large.median("wall_s") / kit.median("wall_s"),
                TARGET_WALL_VS_MERGEKIT,
            )
            row(
                "ckptavg peak RSS / mergekit's, ~2 GB inputs",
                large.median("rss_bytes") / kit.median("rss_bytes"),
                TARGET_RSS_VS_MERGEKIT,
            )
            row("  merge GB/s / raw read GB/s, ~2 GB inputs", rate("ckptavg_large") / rate("raw_read_large"), None)
            row("  merge s / floor s, ~2 GB inputs, output on tmpfs", floor_ratio("ckptavg_large", "floor_large"), None)
        else:
            row("ckptavg wall / mergekit wall, ~2 GB inputs", None, TARGET_WALL_VS_MERGEKIT)
        if "ckptavg_scale" in m:
            scale = m["ckptavg_scale"]
            n = len(scale.command[scale.command.index("--steps") + 1].split(","))
            row(f"ckptavg RSS({n}) / RSS({self.args.inputs})", scale.median("rss_bytes") / rss, TARGET_RSS_SCALING)
            row(f"ckptavg wall({n}) / wall({self.args.inputs})", scale.median("wall_s") / wall, None)
        else:
            row("ckptavg RSS(16) / RSS(4)", None, TARGET_RSS_SCALING)
        return rows

    def report(self, elapsed: float) -> dict[str, Any]:
        header = (
            "measurement",
            "runs",
            "median wall",
            "min-max wall",
            "CPU (sys), med",
            "peak RSS (med)",
            "RSS min-max",
            "other load (max)",
            "",
        )
        table = [header]
        for m in self.measurements.values():
            if not m.samples:
                continue
            lo, hi = m.spread("wall_s")
            rlo, rhi = m.spread("rss_bytes")
            extra = ""
            if m.key.startswith("floor"):
                floor = parse_floor(m.samples[-1].stdout)
                extra = (
                    f"floor {median_seconds(m):.2f} s: read {floor.read_seconds:.2f} s, "
                    f"{'direct' if floor.direct else 'buffered'} write + fsync {floor.write_seconds:.2f} s (last run)"
                )
            elif m.key.startswith(("raw_read", "engine", "ckptavg")):
                inside = statistics.median(inside_rate(s) for s in m.samples)
                extra = f"{m.read_bytes / m.median('wall_s') / 1e9:.2f} GB/s by wall ({inside:.2f} GB/s in-process)"
            elif m.read_bytes:
                extra = f"{m.read_bytes / m.median('wall_s') / 1e9:.2f} GB/s of input"
            table.append(
                (
                    m.label,
                    str(len(m.samples)),
                    f"{m.median('wall_s'):.2f} s",
                    f"{lo:.2f}-{hi:.2f} s",
                    f"{m.median('cpu_s'):.2f} s ({m.median('sys_s'):.2f})",
                    mb(m.median("rss_bytes")),
                    f"{mb(rlo)}-{mb(rhi)}",
                    f"{max(s.other_cpus + s.steal_cpus for s in m.samples):.2f} CPUs",
                    extra,
                )
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        self.say("")
        self.say("results (wall = process start to exit; RSS = the process's own ru_maxrss; GB = 10^9 bytes):")
        for i, r in enumerate(table):
            cells = [c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))]
            self.say("  " + "  ".join(cells))
            if i == 0:
                self.say("  " + "  ".join("-" * w for w in widths))
        self.say(
            "  other load = CPUs busy outside the measured process during a run (other processes + steal), "
            f"of {os.cpu_count()}"
        )
        noisy = max((s.other_cpus + s.steal_cpus for m in self.measurements.values() for s in m.samples), default=0)
        if noisy > 0.3:
            self.note(
                f"some runs shared the CPUs with other work (up to {noisy:.2f} CPUs busy elsewhere): "
                "medians may be inflated; the min-max spread shows how much"
            )
        ratios = self.ratios()
        self.say("")
        self.say("targets:")
        name_w = max(len(r["metric"]) for r in ratios)
        for r in ratios:
            value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
            target = "" if r["target"] is None else f"{'>=' if r['at_least'] else '<='} {r['target']:.2f}"
            verdict = {True: "PASS", False: "FAIL", None: "" if r["target"] is None else "SKIPPED"}[r["pass"]]
            self.say(f"  {r['metric'].ljust(name_w)}  {value:>7}  {target:>8}  {verdict}")
        self.say("")
        return self.closing_record(elapsed, ratios, {k: m.summary() for k, m in self.measurements.items() if m.samples})

    def closing_record(
        self, elapsed: float, targets: list[dict[str, Any]], measurements: dict[str, Any], **extra: Any
    ) -> dict[str, Any]:
        """Print the driver's own figures and return the JSON record every benchmark writes:
        the machine and code, the measurements, the targets, and ``extra`` keys of its own."""
        self.say(f"driver peak RSS (floor of every child's figure): {mb(_maxrss_bytes(self._self_maxrss()))}")
        self.say(f"load average at the end: {os.getloadavg()[0]:.2f}; total time {elapsed:.0f} s")
        return {
            "ckptavg_version": metadata.version("ckptavg"),
            "code": git_state(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "mem_total_bytes": meminfo().get("MemTotal"),
            "data": str(self.data),
            "repeat": self.args.repeat,
            "inputs": self.args.inputs,
            "checkpoint_bytes": checkpoint_bytes(),
            "notes": self.notes,
            "measurements": measurements,
            "checks": self.checks,
            "targets": targets,
            "all_pass": all(r["pass"] is not False for r in targets),
            **extra,
            "elapsed_s": elapsed,
        }

    @staticmethod
    def _self_maxrss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def close(self) -> None:
        if self._tmpfs_scratch is not None:
            shutil.rmtree(self._tmpfs_scratch, ignore_errors=True)  # memory, not kept
        if not self.args.keep_outputs:
            shutil.rmtree(self.scratch, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="cache folder for inputs (default: bench-data/)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; medians reported (default 3)")
    parser.add_argument("--inputs", type=int, default=4, help="checkpoints merged in cases a-c (default 4)")
    parser.add_argument(
        "--scale-inputs",
        type=int,
        default=16,
        help="checkpoints merged in the RSS scaling case d (default 16; 0 skips)",
    )
    parser.add_argument(
        "--no-large", dest="large", action="store_false", help="skip case g on ~2 GB checkpoints (mergekit)"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a child is killed (default 1800)")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the ckptavg == naive output check")
    parser.add_argument(
        "--keep-outputs",
        action="store_true",
        help="keep the merged outputs (hidden folder in --data; not those on tmpfs)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.inputs < 1 or args.scale_inputs < 0:
        parser.error("--repeat and --inputs must be at least 1, --scale-inputs at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_and_report(Bench(args), args)


def run_and_report(bench: Bench, args: argparse.Namespace) -> int:
    """Run a benchmark, always clean up, write ``--json``; the exit status for ``--strict``."""
    try:
        report = bench.run()
    except ChildFailed as exc:
        print(f"bench: a measured command failed: {exc}", file=sys.stderr)
        return 2
    finally:
        bench.close()
    record(Path(sys.argv[0]).stem, report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 1 if args.strict and not report["all_pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
