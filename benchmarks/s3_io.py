"""s3fs helpers of the remote benchmark, each run as a child process of ``bench_formats.py``.

  upload LOCAL_DIR URL          copy a folder tree (hidden files left out) to ``URL``, creating
                                the bucket if needed; prints ``{"files": ..., "bytes": ...}``
  read URL [URL ...]            read these objects end to end in byte ranges (``fs.cat_file`` with
                                start and end, ``--threads`` requests in flight), the protocol floor
                                a remote merge cannot beat; prints the same JSON as ``raw_read.py``

The server is found the way ckptavg finds it: ``AWS_ENDPOINT_URL`` and credentials in the
environment (the benchmark sets dummy ones for its loopback moto server).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEFAULT_RANGE = 16 * 2**20


def filesystem():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def upload(local: Path, url: str) -> dict[str, int]:
    fs = filesystem()
    root = url.split("://", 1)[-1].rstrip("/")
    bucket = root.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    files = sorted(
        p
        for p in local.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(local).parts)
    )
    for path in files:
        # One PUT per file (files under 5 GB): moto joins multipart uploads slowly, in memory.
        fs.put_file(str(path), f"{root}/{path.relative_to(local).as_posix()}", chunksize=2**31)
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def read_ranges(urls: list[str], range_bytes: int = DEFAULT_RANGE, threads: int = 1) -> int:
    """Read every byte of ``urls`` in ``range_bytes`` requests, ``threads`` at a time; return the count."""
    fs = filesystem()
    paths = [u.split("://", 1)[-1] for u in urls]
    jobs = [
        (path, start, min(start + range_bytes, size))
        for path in paths
        for size in [int(fs.size(path))]
        for start in range(0, size, range_bytes)
    ]

    def fetch(job: tuple[str, int, int]) -> int:
        path, start, end = job
        data = fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise RuntimeError(f"{path}: asked for {end - start} bytes at {start}, got {len(data)}")
        return len(data)

    if threads <= 1:
        return sum(fetch(job) for job in jobs)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(fetch, jobs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("upload")
    up.add_argument("local", type=Path)
    up.add_argument("url")
    read = commands.add_parser("read")
    read.add_argument("urls", nargs="+")
    read.add_argument("--range-bytes", type=int, default=DEFAULT_RANGE, help="bytes per request (default 16 MiB)")
    read.add_argument("--threads", type=int, default=1, help="requests in flight (default 1)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.command == "upload":
        result = upload(args.local, args.url)
        result["seconds"] = time.perf_counter() - started
        print(json.dumps(result))
        return 0
    total = read_ranges(args.urls, args.range_bytes, args.threads)
    seconds = time.perf_counter() - started
    print(json.dumps({"bytes": total, "seconds": seconds, "gb_per_s": total / max(seconds, 1e-9) / 1e9}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
