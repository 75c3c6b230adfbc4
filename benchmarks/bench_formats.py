"""Benchmark ``ckptavg merge`` on DCP inputs and on an S3 store, against their baselines and floors.

Run with ``make bench`` (``.venv/bin/python benchmarks/bench_formats.py``). It measures the way
``bench_merge.py`` does and reuses its machinery (every measurement a child process reaped with
``os.wait4`` for its own wall, CPU and peak RSS; repetitions interleaved with a rotating order;
medians and min-max; page cache warmed; outputs deleted and ``os.sync()`` before every run; the
driver never imports torch, because a child's ``ru_maxrss`` starts from the driver's RSS).

A. DCP inputs (``bench-data/dcp-run/step-N``: the safetensors checkpoints of ``bench_merge.py``
   converted by ``make_dcp.py``: two gloo processes save ``Shard(0)`` DTensors as a 2-rank FSDP2
   job does, so every tensor has two chunks in two ``__r_0.distcp`` files):
     a. ``ckptavg merge dcp-run --last 4 --out X --force --quiet --json``;
     b. the naive baseline of ``naive_dcp_merge.py`` (``dcp.load(no_dist=True)`` of each whole
        checkpoint into preallocated tensors, fp32 sum, divide, ``save_file``);
     c. ``raw_read.py`` of the same ``.distcp`` files, the I/O floor;
     d. ``ckptavg merge dcp-run --last 2``: peak RSS must not depend on the number of inputs;
     e. ``ckptavg merge run --steps <the same 4>`` of the safetensors originals, for the cost of
        the format (same tensors, same bytes);
   and checks, untimed, that the DCP merge is bit-identical to the safetensors merge and to the
   naive DCP average.
B. Remote: an S3 server (``s3_server.py``: moto's ThreadedMotoServer on 127.0.0.1, in its own
   process) gets the safetensors checkpoints uploaded (``s3_io.py upload``); then, with
   ``AWS_ENDPOINT_URL`` and dummy credentials in the children's environment:
     a. ``ckptavg merge s3://bench/run --last N --out <local folder> --force --quiet --json``;
     b. ``s3_io.py read`` of the same objects in 16 MiB ranges (``fs.cat_file``), as many requests
        in flight as ckptavg has reader threads (2): the protocol floor (ckptavg's own requests
        for bf16 inputs are 8 MiB, half its 16 MiB fp32 chunk; through this server 8 MiB and
        16 MiB ranges read at about the same rate);
   and checks that the remote merge is bit-identical to the local one. Loopback moto is pure
   Python and CPU-bound (and shares the 2 CPUs with the client), so its absolute GB/s say little
   about S3; the ratio of ckptavg to the raw read through the same server is the figure that
   matters. The server answers plain ranged GETs by reading only the range (``s3_server.py``
   explains why; ``--plain-moto`` for moto's whole-object read). Its own CPU time per run and
   its peak RSS are reported. N is 4 unless free memory says fewer (moto holds the objects in
   temporary files, i.e. page cache, and its RSS peaked at 2.9 GB while receiving 4 of them).

Data preparation (generation, conversion, upload) is timed and reported but not part of any
measurement; generated data is cached in ``bench-data/`` for the next runs (the upload is not:
the server keeps nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import make_dcp
from bench_merge import (
    DEFAULT_DATA,
    DISK_RESERVE_BYTES,
    HERE,
    TARGET_RSS_BYTES,
    TARGET_RSS_SCALING,
    TARGET_WALL_VS_NAIVE,
    WARM_GB_PER_S,
    Bench,
    ChildFailed,
    Measurement,
    _maxrss_bytes,
    ckptavg_command,
    free_disk,
    fresh,
    gb,
    git_state,
    mb,
    median_seconds,
    meminfo,
    run_and_report,
    run_child,
)
from make_checkpoints import checkpoint_bytes, missing_steps, step_numbers, weight_files

S3_BUCKET = "bench"
# Besides the objects themselves (kept by moto in temporary files, i.e. page cache): moto's peak
# while it receives uploads (2.9 GB measured for 4 checkpoints) plus the merging client.
S3_MEMORY_RESERVE = 4e9
SERVER_START_TIMEOUT_S = 60


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process so far (0 without /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class S3Server:
    """``s3_server.py`` as a child process: started, then stopped and reaped with ``os.wait4``."""

    def __init__(self, tmpdir: Path, log: Path, plain_moto: bool) -> None:
        tmpdir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(HERE / "s3_server.py")] + (["--plain-moto"] if plain_moto else [])
        self.log = log
        self._stderr = open(log, "wb")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "TMPDIR": str(tmpdir)}  # where moto's object files go
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL, env=env
        )
        timer = threading.Timer(SERVER_START_TIMEOUT_S, self.proc.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline() if self.proc.stdout else b""
        finally:
            timer.cancel()
        self.peak_rss_bytes = 0
        self.cpu_s = 0.0
        try:
            info = json.loads(line)
            self.endpoint: str = info["endpoint"]
            self.ranged_gets: str = info["ranged_gets"]
        except (ValueError, KeyError, TypeError):
            self.stop()
            raise ChildFailed(f"{' '.join(command)}: did not start\n{log.read_text()[-4000:]}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        """SIGTERM, then reap it (SIGKILL after 30 s) and keep its own peak RSS and CPU time."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            timer = threading.Timer(30, self.proc.kill)
            timer.start()
            try:
                _, status, usage = os.wait4(self.proc.pid, 0)
            finally:
                timer.cancel()
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.peak_rss_bytes = _maxrss_bytes(usage.ru_maxrss)
            self.cpu_s = usage.ru_utime + usage.ru_stime
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()


@contextmanager
def s3_environment(endpoint: str, nowhere: Path) -> Iterator[dict[str, str]]:
    """The environment every S3 child inherits (as in tests/conftest.py's ``s3_server``): the
    loopback endpoint, dummy credentials, the machine's AWS configuration hidden."""
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(nowhere),
        "AWS_SHARED_CREDENTIALS_FILE": str(nowhere),
    }
    dropped = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
    saved = {name: os.environ.get(name) for name in (*env, *dropped)}
    os.environ.update(env)
    for name in dropped:
        os.environ.pop(name, None)
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class FormatsBench(Bench):
    """Cases A (DCP) and B (S3); data, warming and the rounds come from ``bench_merge.Bench``."""

    def close(self) -> None:
        if self.server is not None and self.server.proc.returncode is None:
            self.server.stop()
        super().close()

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.dcp_run = self.data / "dcp-run"
        self.setup: dict[str, float] = {}  # seconds spent preparing data, by what
        self.groups: dict[str, list[str]] = {"dcp": [], "s3": []}  # measurement keys per case
        self.server: S3Server | None = None
        self.server_cpu: dict[str, list[float]] = {}  # server CPU seconds per sample, by measurement
        self.s3_info: dict[str, Any] = {}
        self.targets: list[dict[str, Any]] = []
        self.reference: tuple[list[int], Path] | None = None  # (steps, local safetensors merge of them)

    # -- helpers -----------------------------------------------------------------------------

    def timed_child(self, what: str, command: list[str]) -> Any:
        """Run a preparation or check step (untimed as a measurement, but its time is kept)."""
        started = time.perf_counter()
        sample = run_child(command, self.args.timeout)
        self.setup[what] = self.setup.get(what, 0.0) + time.perf_counter() - started
        return sample

    def selected_steps(self, run: str, count: int) -> list[int]:
        """The steps ``ckptavg merge RUN --last COUNT`` picks, from its own dry run."""
        command = [*ckptavg_command(), "merge", run, "--last", str(count), "--dry-run", "--json"]
        sample = run_child(command, self.args.timeout)
        return [source["step"] for source in json.loads(sample.stdout)["sources"]]

    def warm_files(self, label: str, files: list[Path]) -> None:
        """``Bench.warm`` for any list of files: untimed reads until they come from memory."""
        size = sum(f.stat().st_size for f in files)
        rates: list[float] = []
        while not rates or (rates[-1] < WARM_GB_PER_S and len(rates) < 3):
            sample = run_child([sys.executable, str(HERE / "raw_read.py"), *map(str, files)], self.args.timeout)
            rates.append(json.loads(sample.stdout)["gb_per_s"])
        passes = ", then ".join(f"{r:.2f} GB/s" for r in rates)
        self.note(f"page cache warmed: read {label} ({gb(size)}) {len(rates)} time(s) untimed ({passes})")
        if rates[-1] < WARM_GB_PER_S:
            self.note(f"{label} still read at {rates[-1]:.2f} GB/s after warming: timings include disk reads")

    def compare(self, name: str, a: Path, b: Path) -> None:
        sample = self.timed_child("checks", [sys.executable, str(HERE / "compare_checkpoints.py"), str(a), str(b)])
        result = json.loads(sample.stdout)
        self.checks[name] = result
        verdict = "identical" if result["identical"] else "DIFFERENT"
        self.say(f"check: {name.replace('_', ' ')}: {verdict} ({result})")

    def measure_round(self, entries: list[tuple[Measurement, Callable[[], None]]], repeat: int) -> None:
        """``Bench.measure_round``, plus the S3 server's CPU time during each run when one is up."""
        if self.server is None:
            super().measure_round(entries, repeat)
            return
        pid = self.server.pid
        for round_index in range(repeat):
            shift = round_index % len(entries)
            for measurement, before in entries[shift:] + entries[:shift]:
                before()
                server_before = proc_cpu_seconds(pid)
                sample = run_child(measurement.command, self.args.timeout)
                server = proc_cpu_seconds(pid) - server_before
                measurement.samples.append(sample)
                self.server_cpu.setdefault(measurement.key, []).append(server)
                self.say(
                    f"  [{round_index + 1}/{repeat}] {measurement.label}: {sample.wall_s:.2f} s wall, "
                    f"{sample.cpu_s:.2f} s CPU ({sample.sys_s:.2f} s sys), peak RSS {mb(sample.rss_bytes)}; "
                    f"server {server:.2f} s CPU; other load {sample.other_cpus:.2f} CPUs (server included), "
                    f"steal {sample.steal_cpus:.2f}"
                )

    def add_to(self, group: str, key: str, label: str, command: list[str], read_bytes: int = 0) -> Measurement:
        self.groups[group].append(key)
        return self.add(key, label, command, read_bytes)

    # -- A: DCP ------------------------------------------------------------------------------

    def ensure_steps(self, steps: list[int]) -> None:
        """``Bench.ensure_steps`` (the safetensors originals, cached), its time kept when it generates."""
        started = time.perf_counter()
        generating = bool(missing_steps(self.run_dir, steps))
        super().ensure_steps(steps)
        if generating:
            what = "generate safetensors checkpoints"
            self.setup[what] = self.setup.get(what, 0.0) + time.perf_counter() - started

    def ensure_dcp(self, steps: list[int]) -> None:
        self.ensure_steps(steps)
        ranks = self.args.dcp_ranks
        todo = make_dcp.missing_steps(self.dcp_run, steps, ranks)
        if not todo:
            self.say(f"data: {len(steps)} DCP checkpoints cached in {self.dcp_run}")
            return
        needed = len(todo) * checkpoint_bytes() * 1.01 + DISK_RESERVE_BYTES
        if needed > free_disk(self.data):
            raise SystemExit(f"bench: need {gb(needed)} free in {self.data} for {len(todo)} DCP checkpoints")
        self.say(f"data: converting {len(todo)} checkpoint(s) to DCP ({ranks} rank(s)) in {self.dcp_run} ...")
        started = time.perf_counter()
        command = [sys.executable, str(HERE / "make_dcp.py"), str(self.run_dir), str(self.dcp_run)]
        subprocess.run([*command, "--steps", ",".join(map(str, todo)), "--ranks", str(ranks)], check=True)
        if make_dcp.missing_steps(self.dcp_run, steps, ranks):
            raise SystemExit("bench: DCP conversion did not complete")
        seconds = time.perf_counter() - started
        self.setup["convert to DCP"] = seconds
        self.note(f"converted {len(todo)} checkpoint(s) to DCP in {seconds:.0f} s (cached for next runs)")

    def dcp_files(self, steps: list[int]) -> list[Path]:
        return [f for s in steps for f in make_dcp.data_files(make_dcp.step_dir(self.dcp_run, s))]

    def run_dcp(self) -> None:
        args = self.args
        n, fewer = args.inputs, args.fewer_inputs
        self.ensure_dcp(step_numbers(n))
        steps = self.selected_steps(str(self.dcp_run), n)
        self.ensure_steps(steps)  # the originals of what --last picks (more may have been made before)
        few = steps[-fewer:]
        files = self.dcp_files(steps)
        read_bytes = sum(f.stat().st_size for f in files)
        few_bytes = sum(f.stat().st_size for f in self.dcp_files(few))
        st_files = self.input_files(steps)
        st_bytes = sum(f.stat().st_size for f in st_files)
        self.say(
            f"case A, DCP: steps {','.join(map(str, steps))}; {len(files) // n} data files of "
            f"{gb(files[0].stat().st_size)} per checkpoint, {gb(read_bytes)} to read per {n}-input run"
        )
        self.warm_files(f"the {n} DCP inputs", files)
        self.warm_files(f"the {n} safetensors inputs", st_files)
        output_bytes = sum(f.stat().st_size for f in weight_files(self.run_dir / f"step{steps[-1]}"))
        floors = {
            kind: self.add_floor(f"floor_{kind}", f"floor of the {kind} merge", inputs, output_bytes, self.scratch)
            for kind, inputs in (("dcp", files), ("safetensors", st_files))
        }
        self.groups["dcp"] += [f"floor_{kind}" for kind in floors]

        out = {k: self.scratch / k for k in ("dcp", "dcp-naive", "dcp-few", "safetensors")}
        quiet = ["--force", "--quiet", "--json"]
        merge = self.add_to(
            "dcp",
            "dcp_ckptavg",
            f"ckptavg merge, DCP, {n} inputs",
            [*ckptavg_command(), "merge", str(self.dcp_run), "--last", str(n), "--out", str(out["dcp"]), *quiet],
            read_bytes,
        )
        naive = self.add_to(
            "dcp",
            "dcp_naive",
            f"naive dcp.load-all, {n} inputs",
            [sys.executable, str(HERE / "naive_dcp_merge.py")]
            + [str(make_dcp.step_dir(self.dcp_run, s)) for s in steps]
            + ["--out", str(out["dcp-naive"])],
            read_bytes,
        )
        raw = self.add_to(
            "dcp",
            "dcp_raw",
            f"raw read of .distcp, {n} inputs",
            [sys.executable, str(HERE / "raw_read.py"), *map(str, files)],
            read_bytes,
        )
        few_merge = self.add_to(
            "dcp",
            "dcp_ckptavg_few",
            f"ckptavg merge, DCP, {fewer} inputs",
            [*ckptavg_command(), "merge", str(self.dcp_run), "--last", str(fewer), "--out", str(out["dcp-few"])]
            + quiet,
            few_bytes,
        )
        st_merge = self.add_to(
            "dcp",
            "st_ckptavg",
            f"ckptavg merge, safetensors, {n} inputs",
            [*ckptavg_command(), "merge", str(self.run_dir), "--steps", ",".join(map(str, steps))]
            + ["--out", str(out["safetensors"]), *quiet],
            st_bytes,
        )
        self.say(f"measuring case A ({args.repeat} rounds):")
        self.measure_round(
            [
                (raw, os.sync),
                (floors["dcp"], os.sync),
                (floors["safetensors"], os.sync),
                (merge, lambda: fresh(out["dcp"])),
                (naive, lambda: fresh(out["dcp-naive"])),
                (few_merge, lambda: fresh(out["dcp-few"])),
                (st_merge, lambda: fresh(out["safetensors"])),
            ],
            args.repeat,
        )
        if args.check:
            self.compare("dcp_merge_vs_safetensors_merge", out["dcp"], out["safetensors"])
            self.compare("dcp_merge_vs_naive_dcp", out["dcp"], out["dcp-naive"])
        self.reference = (steps, out["safetensors"])
        if not args.keep_outputs:
            fresh(out["dcp"], out["dcp-naive"], out["dcp-few"])

    # -- B: S3 -------------------------------------------------------------------------------

    def s3_count(self, want: int) -> int:
        """How many checkpoints the loopback server can hold: moto's objects sit in temporary
        files (page cache, then disk) and moto peaked at 2.9 GB while receiving 4 checkpoints."""
        available = meminfo().get("MemAvailable", 0)
        disk = free_disk(self.scratch)
        per = checkpoint_bytes() * 1.01
        for count in range(want, 1, -1):
            if count * per + S3_MEMORY_RESERVE <= available and count * per + DISK_RESERVE_BYTES <= disk:
                if count < want:
                    self.note(
                        f"S3 case uses {count} checkpoints, not {want}: {gb(available)} memory available, "
                        f"{gb(disk)} free disk"
                    )
                return count
        return 0

    def run_s3(self) -> None:
        args = self.args
        # Looked up, not imported: the driver must stay small (and moto runs in its own child).
        absent = [name for name in ("moto", "s3fs") if importlib.util.find_spec(name) is None]
        if absent:
            self.note(f"S3 case skipped: {', '.join(absent)} not installed (pip install 'moto[server]' s3fs)")
            return
        count = self.s3_count(args.s3_inputs)
        if count == 0:
            self.note("S3 case skipped: not enough memory or disk for 2 checkpoints in the loopback server")
            return
        steps = step_numbers(count)
        self.ensure_steps(steps)
        started = time.perf_counter()
        self.server = S3Server(self.scratch / "moto-tmp", self.scratch / "s3-server.log", args.plain_moto)
        self.setup["start S3 server"] = time.perf_counter() - started
        self.say(
            f"case B, S3: server at {self.server.endpoint} (pid {self.server.pid}), "
            f"ranged GETs {self.server.ranged_gets}"
        )
        try:
            with s3_environment(self.server.endpoint, self.scratch / "no-aws-config") as env:
                self.s3_info["environment"] = env
                self._run_s3(steps)
        finally:
            self.server.stop()
            self.s3_info.update(
                server_peak_rss_bytes=self.server.peak_rss_bytes,
                server_cpu_s=self.server.cpu_s,
                ranged_gets=self.server.ranged_gets,
            )
            self.say(
                f"S3 server stopped: peak RSS {mb(self.server.peak_rss_bytes)}, {self.server.cpu_s:.0f} s CPU in all"
            )

    def _run_s3(self, steps: list[int]) -> None:
        args = self.args
        n = len(steps)
        run_url = f"s3://{S3_BUCKET}/run"
        self.s3_info["steps"] = steps
        uploaded = 0
        started = time.perf_counter()
        for step in steps:
            sample = self.timed_child(
                "upload to S3",
                [sys.executable, str(HERE / "s3_io.py"), "upload", str(self.run_dir / f"step{step}")]
                + [f"{run_url}/step{step}"],
            )
            uploaded += json.loads(sample.stdout)["bytes"]
        seconds = time.perf_counter() - started
        self.s3_info.update(uploaded_bytes=uploaded, upload_s=seconds)
        self.note(
            f"uploaded {n} checkpoints ({gb(uploaded)}) to the loopback S3 server in {seconds:.0f} s "
            f"({uploaded / seconds / 1e9:.3f} GB/s, not a measurement)"
        )
        chosen = self.selected_steps(run_url, n)
        if chosen != steps:
            raise SystemExit(f"bench: ckptavg picks steps {chosen} on S3, expected {steps}")
        files = [f for s in steps for f in weight_files(self.run_dir / f"step{s}")]
        urls = [f"{run_url}/{f.parent.name}/{f.name}" for f in files]
        read_bytes = sum(f.stat().st_size for f in files)
        read = [sys.executable, str(HERE / "s3_io.py"), "read", *urls]
        read += ["--range-bytes", str(args.s3_range_bytes), "--threads", str(args.s3_threads)]
        sample = run_child(read, args.timeout)  # untimed: warms the server's files and code paths
        self.note(
            f"S3 objects read once untimed before timing ({json.loads(sample.stdout)['gb_per_s']:.3f} GB/s in-process)"
        )
        out = self.scratch / "s3-merge"
        merge = self.add_to(
            "s3",
            "s3_ckptavg",
            f"ckptavg merge, S3, {n} inputs",
            [*ckptavg_command(), "merge", run_url, "--last", str(n), "--out", str(out), "--force", "--quiet", "--json"],
            read_bytes,
        )
        raw = self.add_to(
            "s3",
            "s3_raw",
            f"raw S3 read, {args.s3_range_bytes // 2**20} MiB ranges x{args.s3_threads}, {n} inputs",
            read,
            read_bytes,
        )
        self.say(f"measuring case B ({args.repeat} rounds, {gb(read_bytes)} per run):")
        self.measure_round([(raw, os.sync), (merge, lambda: fresh(out))], args.repeat)
        if args.check:
            reference = self.reference_merge(steps)
            self.compare("s3_merge_vs_local_merge", out, reference)
        if not args.keep_outputs:
            fresh(out)

    def reference_merge(self, steps: list[int]) -> Path:
        """A local safetensors merge of ``steps``: case A's when it has one, else made now."""
        if self.reference is not None and self.reference[0] == steps and self.reference[1].exists():
            return self.reference[1]
        out = self.scratch / "reference"
        command = [*ckptavg_command(), "merge", str(self.run_dir), "--steps", ",".join(map(str, steps))]
        self.timed_child("checks", [*command, "--out", str(out), "--force", "--quiet"])
        return out

    # -- report ------------------------------------------------------------------------------

    def in_process_gb_per_s(self, m: Measurement) -> float | None:
        """The rate the child reported itself (``ckptavg --json``'s read_gb_per_s, the raw
        readers' gb_per_s): without interpreter start and imports."""
        values = []
        for s in m.samples:
            try:
                data = json.loads(s.stdout)
            except ValueError:
                return None
            if "read_gb_per_s" in data:
                values.append(data["bytes_read"] / max(data["seconds"], 1e-9) / 1e9)
            elif "gb_per_s" in data:
                values.append(data["gb_per_s"])
            else:
                return None
        return statistics.median(values) if values else None

    def table(self, keys: list[str]) -> None:
        header = (
            "measurement",
            "runs",
            "median wall",
            "min-max wall",
            "CPU (sys), med",
            "peak RSS (med)",
            "RSS min-max",
            "other load (max)",
            "GB/s by wall",
            "GB/s in-process",
            "server CPU (med)",
        )
        rows = [header]
        for key in keys:
            m = self.measurements[key]
            if not m.samples:
                continue
            lo, hi = m.spread("wall_s")
            rlo, rhi = m.spread("rss_bytes")
            inside = self.in_process_gb_per_s(m)
            server = self.server_cpu.get(key)
            rows.append(
                (
                    m.label,
                    str(len(m.samples)),
                    f"{m.median('wall_s'):.2f} s",
                    f"{lo:.2f}-{hi:.2f} s",
                    f"{m.median('cpu_s'):.2f} s ({m.median('sys_s'):.2f})",
                    mb(m.median("rss_bytes")),
                    f"{mb(rlo)}-{mb(rhi)}",
                    f"{max(s.other_cpus + s.steal_cpus for s in m.samples):.2f} CPUs",
                    f"{m.read_bytes / m.median('wall_s') / 1e9:.3f}" if m.read_bytes else "",
                    "" if inside is None else f"{inside:.3f}",
                    "" if not server else f"{statistics.median(server):.2f} s",
                )
            )
        shown = [i for i in range(len(header)) if any(r[i] for r in rows[1:])]  # no all-empty columns
        rows = [tuple(r[i] for i in shown) for r in rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(shown))]
        for i, r in enumerate(rows):
            cells = [c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))]
            self.say("  " + "  ".join(cells).rstrip())
            if i == 0:
                self.say("  " + "  ".join("-" * w for w in widths))

    def target(
        self,
        case: str,
        name: str,
        value: float | None,
        target: float | None,
        higher: bool = False,
        passed: bool | None = None,
    ) -> None:
        if passed is None and value is not None and target is not None:
            passed = value >= target if higher else value <= target
        self.targets.append(
            {"case": case, "metric": name, "value": value, "target": target, "higher_is_better": higher, "pass": passed}
        )

    def ratios(self) -> list[dict[str, Any]]:  # replaces Bench.ratios (other measurements)
        m = self.measurements
        self.targets = []
        if m.get("dcp_ckptavg") and m["dcp_ckptavg"].samples:
            wall, rss = m["dcp_ckptavg"].median("wall_s"), m["dcp_ckptavg"].median("rss_bytes")
            few = m["dcp_ckptavg_few"]
            n, k = self.args.inputs, self.args.fewer_inputs
            self.target(
                "A", "ckptavg DCP wall / naive DCP wall", wall / m["dcp_naive"].median("wall_s"), TARGET_WALL_VS_NAIVE
            )
            self.target("A", "ckptavg DCP wall / raw read wall", wall / m["dcp_raw"].median("wall_s"), None)
            local = m["st_ckptavg"]
            for kind, merge in (("dcp", m["dcp_ckptavg"]), ("safetensors", local)):
                floor_ratio = median_seconds(merge) / median_seconds(m[f"floor_{kind}"])
                self.target("A", f"ckptavg {kind} merge s / floor s", floor_ratio, None)
            self.target("A", "ckptavg DCP wall / ckptavg safetensors wall", wall / local.median("wall_s"), None)
            inside_dcp, inside_local = self.in_process_gb_per_s(m["dcp_ckptavg"]), self.in_process_gb_per_s(local)
            if inside_dcp and inside_local:
                # Without start-up: the DCP reader imports torch.distributed.checkpoint (~1 s here).
                self.target("A", "  same, in-process (safetensors GB/s / DCP GB/s)", inside_local / inside_dcp, None)
            self.target("A", "ckptavg DCP peak RSS (GB)", rss / 1e9, TARGET_RSS_BYTES / 1e9)
            self.target(
                "A", "naive DCP peak RSS / ckptavg DCP peak RSS", m["dcp_naive"].median("rss_bytes") / rss, None
            )
            self.target("A", f"ckptavg DCP RSS({n}) / RSS({k})", rss / few.median("rss_bytes"), TARGET_RSS_SCALING)
            self.target("A", f"ckptavg DCP wall({n}) / wall({k})", wall / few.median("wall_s"), None)
            for name in ("dcp_merge_vs_safetensors_merge", "dcp_merge_vs_naive_dcp"):
                self.identity_target("A", name)
        if m.get("s3_ckptavg") and m["s3_ckptavg"].samples:
            merge, raw = m["s3_ckptavg"], m["s3_raw"]
            self.target(
                "B",
                "ckptavg S3 GB/s / raw S3 read GB/s (by wall)",
                raw.median("wall_s") / merge.median("wall_s"),
                None,
                True,
            )
            inside_merge, inside_raw = self.in_process_gb_per_s(merge), self.in_process_gb_per_s(raw)
            if inside_merge and inside_raw:
                self.target("B", "  same, in-process rates", inside_merge / inside_raw, None, True)
            local = m.get("st_ckptavg")
            if local is not None and local.samples and self.reference and self.reference[0] == self.s3_info["steps"]:
                # The same merge from local files (case A, page cache warm): what remote reading costs.
                local_wall = local.median("wall_s")
                self.target(
                    "B", "ckptavg S3 wall / ckptavg local wall (case A)", merge.median("wall_s") / local_wall, None
                )
                # 1.0: as slow as merging locally and then reading through the server, one after the
                # other (no overlap); on 2 CPUs shared with the server little overlap is possible.
                self.target(
                    "B",
                    "ckptavg S3 wall / (local merge wall + raw S3 read wall)",
                    merge.median("wall_s") / (local_wall + raw.median("wall_s")),
                    None,
                )
            self.target("B", "ckptavg S3 peak RSS (GB)", merge.median("rss_bytes") / 1e9, TARGET_RSS_BYTES / 1e9)
            self.identity_target("B", "s3_merge_vs_local_merge")
        return self.targets

    def identity_target(self, case: str, name: str) -> None:
        """A bit-identity check as a row: elements that differ, must be 0 (and the names the same)."""
        if name in self.checks:
            check = self.checks[name]
            label = f"{name.replace('_', ' ')}: elements differing"
            self.target(case, label, check["elements_differing"], 0, passed=bool(check["identical"]))

    def report(self, elapsed: float) -> dict[str, Any]:
        self.say("")
        self.say("results (wall = process start to exit; RSS = the process's own ru_maxrss; GB = 10^9 bytes;")
        self.say("GB/s = input file bytes / median wall; in-process = as the child timed itself, without start-up):")
        for group, title in (
            ("dcp", "A. DCP inputs (2-rank FSDP-style save, page cache warm)"),
            ("s3", "B. S3 protocol on loopback (moto)"),
        ):
            if self.groups[group]:
                self.say("")
                self.say(title)
                self.table(self.groups[group])
        self.say("")
        self.say(
            "  other load = CPUs busy outside the measured process during a run (other processes + steal), "
            f"of {os.cpu_count()}; in case B it includes the S3 server, whose own CPU time is the last column"
        )
        if self.groups["s3"]:
            self.say(
                "  loopback moto is CPU-bound pure Python sharing the CPUs with the client: its absolute GB/s say "
                "little about real S3; the ratio to the raw read through the same server is the figure that matters"
            )
        rows = self.ratios()
        self.say("")
        self.say("ratios and targets:")
        name_w = max((len(r["metric"]) for r in rows), default=0)
        for r in rows:
            value = r["value"]
            value = "n/a" if value is None else str(value) if isinstance(value, int) else f"{value:.3f}"
            target = "" if r["target"] is None else f"{'>=' if r['higher_is_better'] else '<='} {r['target']:.2f}"
            verdict = {True: "PASS", False: "FAIL", None: ""}[r["pass"]]
            self.say(f"  {r['case']}  {r['metric'].ljust(name_w)}  {value:>7}  {target:>8}  {verdict}")
        self.say("")
        if self.s3_info.get("server_peak_rss_bytes"):
            info = self.s3_info
            self.say(
                f"S3 server: peak RSS {mb(info['server_peak_rss_bytes'])}, {info['server_cpu_s']:.0f} s CPU in all; "
                f"ranged GETs {info['ranged_gets']}; upload of {gb(info.get('uploaded_bytes', 0))} took "
                f"{info.get('upload_s', 0):.0f} s"
            )
        setup = ", ".join(f"{what} {seconds:.0f} s" for what, seconds in self.setup.items())
        self.say(f"data preparation and checks (not measured): {setup or 'none'}")
        measurements = {
            k: {
                **m.summary(),
                "case": next(g for g, keys in self.groups.items() if k in keys),
                "gb_per_s_in_process": self.in_process_gb_per_s(m),
                "server_cpu_s": self.server_cpu.get(k),
            }
            for k, m in self.measurements.items()
            if m.samples
        }
        return self.closing_record(
            elapsed,
            rows,
            measurements,
            fewer_inputs=self.args.fewer_inputs,
            dcp_ranks=self.args.dcp_ranks,
            s3=self.s3_info,
            setup_s=self.setup,
        )

    def run(self) -> dict[str, Any]:
        args = self.args
        started = time.perf_counter()
        mem = meminfo()
        self.say(
            f"ckptavg formats benchmark: ckptavg {metadata.version('ckptavg')}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs, {gb(mem.get('MemTotal', 0))} RAM ({gb(mem.get('MemAvailable', 0))} available), "
            f"load average {os.getloadavg()[0]:.2f}, {gb(free_disk(self.data))} free disk"
        )
        self.say(f"code: {git_state()}; CLI: {' '.join(ckptavg_command())}")
        self.say(f"data folder: {self.data}; median of {args.repeat} runs each, every run a fresh process")
        if "dcp" in args.cases:
            self.run_dcp()
        if "s3" in args.cases and args.s3_inputs:
            self.run_s3()
        return self.report(time.perf_counter() - started)


def parse_size_arg(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="cache folder for inputs (default: bench-data/)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; medians reported (default 3)")
    parser.add_argument("--inputs", type=int, default=4, help="checkpoints merged in case A (default 4)")
    parser.add_argument(
        "--fewer-inputs", type=int, default=2, help="checkpoints of the RSS comparison in A (default 2)"
    )
    parser.add_argument("--dcp-ranks", type=int, default=2, help="processes saving each DCP checkpoint (default 2)")
    parser.add_argument(
        "--s3-inputs", type=int, default=4, help="checkpoints uploaded and merged in B (default 4; 0 skips)"
    )
    parser.add_argument(
        "--s3-range-bytes", type=parse_size_arg, default=16 * 2**20, help="raw S3 read request size (16MiB)"
    )
    parser.add_argument(
        "--s3-threads", type=int, default=2, help="raw S3 read requests in flight (default 2 = ckptavg's workers)"
    )
    parser.add_argument(
        "--plain-moto", action="store_true", help="let moto answer ranged GETs by reading the whole object"
    )
    parser.add_argument("--cases", default="dcp,s3", help="comma-separated: dcp, s3 (default both)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a child is killed (default 1800)")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the bit-identity checks")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the merged outputs (hidden folder in --data)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args(argv)
    args.cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if args.cases - {"dcp", "s3"}:
        parser.error(f"--cases: unknown {sorted(args.cases - {'dcp', 's3'})}")
    if args.repeat < 1 or args.inputs < 1 or not 1 <= args.fewer_inputs < args.inputs or args.s3_inputs < 0:
        parser.error("--repeat, --inputs at least 1; --fewer-inputs from 1 to --inputs - 1; --s3-inputs at least 0")
    if args.s3_inputs == 1:
        parser.error("--s3-inputs must be 0 (skip) or at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_and_report(FormatsBench(args), args)


if __name__ == "__main__":
    sys.exit(main())
