"""``ckptavg merge`` from an object store with per-request latency, against parallel ranged GETs.

A loopback S3 server (``s3_server.py``, moto, in its own process) delays every request by
``--latency-ms`` (20 ms by default; loopback itself answers in well under 1 ms), holds ``--inputs``
small Llama-like safetensors checkpoints (``make_checkpoints.py`` with a reduced spec, cached in
``bench-data/s3-latency-run``), and then, ``--repeat`` rounds, interleaved:

  a. baseline: ``s3_io.py read`` of every weight file in ranges of ``--range-bytes`` (default: the
     part size ckptavg splits a chunk's read into), ``--connections`` requests in flight (default:
     ckptavg's cap on concurrent range requests, ``ckptavg.io.files.REMOTE_REQUESTS``);
  b. ``ckptavg merge s3://bench/run --last N --out <local> --force --no-fsync`` (``--no-fsync``:
     the figure is about reading through latency, not this machine's disk).

Printed: median wall (min-max) of each, GB/s of weight bytes read, the ratio merge/baseline
throughput (for the whole command, and for its averaging phase alone, the ``seconds`` of its
``--json`` summary: the start-up, listing and headers are then left out), the load average
before each round, and whether the merge's output equals a local merge of the same checkpoints
byte for byte. Each run is a fresh process, as a user's would be, so
start-up (``import torch``, listing and headers through the latency) is inside the merge's wall.

The server is pure Python on one interpreter: on a small machine it is CPU-bound well below real
S3's bandwidth, so the absolute GB/s say little; the ratio to the baseline through the same server
with the same latency says whether the merge keeps enough requests in flight.

Needs ``moto[server]`` and ``s3fs`` (the ``test`` extra). ``PYTHONPATH`` chooses which ckptavg runs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from make_checkpoints import SPEC, generate, missing_steps, step_numbers, weight_files  # noqa: E402

from ckptavg.io.files import REMOTE_REQUESTS, split_range  # noqa: E402  (fsspec only, no torch)

# Two layers of a 2048-wide Llama with a small vocabulary: 119M parameters, 238 MB bf16, so that
# 4 of them fit the loopback server on a small machine; tensors of 8-23 MB, as in large models.
BENCH_SPEC = {**SPEC, "num_hidden_layers": 2, "vocab_size": 8000, "shards": 2, "noise_pool": 2**24}
# A merge's read of one chunk: 16 MiB of float32 accumulator is 8 MiB of bf16 input.
CHUNK_READ_BYTES = 8 * 2**20
BUCKET = "bench"


def run(command: list[str], env: dict[str, str], timeout: float) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def start_server(latency_ms: float, tmpdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    tmpdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "s3_server.py"), "--latency-ms", str(latency_ms)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    line = proc.stdout.readline() if proc.stdout else b""
    try:
        return proc, json.loads(line)["endpoint"]
    except (ValueError, KeyError):
        proc.kill()
        raise SystemExit("bench: the S3 server did not start") from None


def s3_env(endpoint: str, nowhere: Path) -> dict[str, str]:
    """The loopback endpoint, dummy credentials, the machine's AWS configuration hidden."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")}
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(nowhere),
        AWS_SHARED_CREDENTIALS_FILE=str(nowhere),
    )
    return env


def digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.suffix == ".safetensors"
    }


def summary(walls: list[float], nbytes: int) -> str:
    median = statistics.median(walls)
    return f"{median:6.2f} s ({min(walls):.2f}-{max(walls):.2f})  {nbytes / median / 1e9:6.3f} GB/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=20.0, help="delay per request (default 20)")
    parser.add_argument("--inputs", type=int, default=4, help="checkpoints merged (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument(
        "--connections", type=int, default=REMOTE_REQUESTS, help=f"baseline requests in flight ({REMOTE_REQUESTS})"
    )
    default_range = split_range(CHUNK_READ_BYTES)[0][1]
    parser.add_argument(
        "--range-bytes", type=int, default=default_range, help=f"baseline bytes per request ({default_range})"
    )
    parser.add_argument("--workers", type=int, default=None, help="pass --workers to the merge (default: its own)")
    parser.add_argument("--data", type=Path, default=REPO / "bench-data", help="cache folder (default bench-data/)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child (default 900)")
    args = parser.parse_args(argv)

    missing = [name for name in ("moto", "s3fs") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"bench_s3_latency: skipped, {', '.join(missing)} not installed (pip install 'moto[server]' s3fs)")
        return 0
    run_dir = args.data / "s3-latency-run"
    steps = step_numbers(args.inputs)
    if missing_steps(run_dir, steps, BENCH_SPEC):
        generate(run_dir, missing_steps(run_dir, steps, BENCH_SPEC), BENCH_SPEC)
    files = [f for s in steps for f in weight_files(run_dir / f"step{s}")]
    nbytes = sum(f.stat().st_size for f in files)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-s3-latency-", dir=args.data))
    server, endpoint = start_server(args.latency_ms, scratch / "moto-tmp")
    try:
        env = s3_env(endpoint, scratch / "no-aws-config")
        run_url = f"s3://{BUCKET}/run"
        for step in steps:
            upload = [sys.executable, str(HERE / "s3_io.py"), "upload", str(run_dir / f"step{step}")]
            run([*upload, f"{run_url}/step{step}"], env, args.timeout)
        urls = [f"{run_url}/{f.parent.name}/{f.name}" for f in files]
        baseline = [sys.executable, str(HERE / "s3_io.py"), "read", *urls]
        baseline += ["--range-bytes", str(args.range_bytes), "--threads", str(args.connections)]
        out = scratch / "merged"
        ckptavg = [sys.executable, "-m", "ckptavg"]
        merge = [*ckptavg, "merge", run_url, "--last", str(args.inputs), "--out", str(out), "--force", "--quiet"]
        merge += ["--no-fsync", "--json"] + (["--workers", str(args.workers)] if args.workers else [])
        print(
            f"bench_s3_latency: {args.inputs} checkpoints, {nbytes / 1e9:.2f} GB of weights on loopback S3 "
            f"({endpoint}), {args.latency_ms:g} ms per request; {os.cpu_count()} CPUs"
        )
        run(baseline, env, args.timeout)  # untimed: warms the server's files and code paths
        run(merge, env, args.timeout)
        walls: dict[str, list[float]] = {"baseline": [], "merge": [], "averaging": []}
        loads = []
        for _ in range(args.repeat):
            loads.append(os.getloadavg()[0])
            walls["baseline"].append(run(baseline, env, args.timeout)[0])
            shutil.rmtree(out, ignore_errors=True)
            seconds, stdout = run(merge, env, args.timeout)
            walls["merge"].append(seconds)
            walls["averaging"].append(json.loads(stdout)["seconds"])
        local = scratch / "local"
        run([*ckptavg, "merge", str(run_dir), "--last", str(args.inputs), "--out", str(local), "--quiet"], env, 900)
        identical = digests(out) == digests(local) and bool(digests(out))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        shutil.rmtree(scratch, ignore_errors=True)
    label = f"ranged GETs, {args.range_bytes / 2**20:.2f} MiB x {args.connections} in flight"
    print(f"  {'baseline: ' + label:<58} {summary(walls['baseline'], nbytes)}")
    workers = f"--workers {args.workers}" if args.workers else "default settings"
    print(f"  {'ckptavg merge (' + workers + ', --no-fsync), whole command':<58} {summary(walls['merge'], nbytes)}")
    print(
        f"  {'  of which averaging (the JSON seconds: reads, sums, writes)':<58} {summary(walls['averaging'], nbytes)}"
    )
    base = statistics.median(walls["baseline"])
    print(
        f"  merge / baseline throughput (medians of {args.repeat}): whole command "
        f"{base / statistics.median(walls['merge']):.2f}, averaging {base / statistics.median(walls['averaging']):.2f}"
    )
    print(f"  merge output identical to a local merge of the same checkpoints: {'yes' if identical else 'NO'}")
    print(f"  load average before each round: {', '.join(f'{x:.2f}' for x in loads)}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
