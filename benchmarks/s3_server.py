"""An S3 server (moto) on loopback for the remote benchmark, in a process of its own.

Started as a child by ``bench_formats.py``, so that neither moto nor the objects it holds weigh on
the driver (whose RSS is the floor of every measured child's) or on the measured processes.
Listens on 127.0.0.1 at a free port, prints one JSON line ``{"endpoint": "http://127.0.0.1:PORT"}``
once it accepts connections, and serves until SIGTERM or SIGINT, then exits with status 0 (so the
parent can reap it with ``os.wait4`` and report the server's own peak RSS and CPU time).

Where the objects live: moto keeps each object in a ``tempfile.SpooledTemporaryFile`` of about
5 MB, so large objects roll over to an (unlinked) temporary file in ``$TMPDIR``: disk and page
cache, not the server's heap.

Ranged GETs: moto answers each one by reading the *whole* object and slicing it, so a 16 MiB
range of a 317 MB shard costs a 317 MB read, and reading a file in ranges costs its size times
the number of ranges (measured: 64 MB/s with 16 MiB ranges, 31 MB/s with 8 MiB ones). Real S3
costs per byte asked for, and a benchmark of ranged readers against a server that does not would
mostly measure the server. So by default ``S3Response.get_object`` is wrapped: a GET with one
plain ``Range: bytes=a-b`` (no part number, version or conditional headers) goes
through moto's own authentication, key lookup and headers and then reads only its range from the
key's buffer; every other request (HEAD, LIST, PUT, multipart, conditional or whole-object GET)
is moto's unchanged. ``--plain-moto`` turns this off. Either way the server is pure Python on
one interpreter: loopback moto measures a client's protocol overhead against a slow, CPU-bound
server, not what S3 would deliver.

Latency: ``--latency-ms N`` delays every request by N ms before moto sees it (a sleep in the
request's own server thread, so concurrent requests wait in parallel, as they would on a
network): loopback answers in well under a millisecond where a real object store takes tens, so
a reader that keeps too few requests in flight looks fine here and crawls there. With it, the
server measures whether a client hides latency (``bench_s3_latency.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading
import time
from typing import Any
from urllib.parse import parse_qs

_SIMPLE_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_CONDITIONS = ("If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since")


def serve_ranges_by_range() -> None:
    """Make moto read only the asked-for bytes of a plain ranged GET (see the module docstring)."""
    from moto.s3.responses import S3Response

    whole_object_get = S3Response.get_object

    def get_object(self: Any) -> Any:
        match = _SIMPLE_RANGE.match(self.headers.get("range") or "")
        if (
            match is None
            or self.method != "GET"
            or set(parse_qs(self.parsed_url.query, keep_blank_values=True)) - {"x-id"}
            or any(self.headers.get(name) for name in _CONDITIONS)
        ):
            return whole_object_get(self)
        key, _ = self._get_key()
        begin, end = int(match.group(1)), min(int(match.group(2)), key.size - 1)
        buffer = getattr(key, "_value_buffer", None)
        if buffer is None or begin > end:
            return whole_object_get(self)  # moto's own answer, errors included
        headers = self._get_cors_headers_other()
        headers.update(key.response_dict)
        headers.update(key.metadata)
        headers["Accept-Ranges"] = "bytes"
        # A part of an object carries no checksum of the whole (moto drops them from ranges too).
        with key.lock:
            buffer.seek(begin)
            data = buffer.read(end - begin + 1)
        headers["content-range"] = f"bytes {begin}-{end}/{key.size}"
        headers["content-length"] = str(len(data))
        return 206, headers, data

    S3Response.get_object = get_object


def delay_every_request(seconds: float) -> None:
    """Make every request wait ``seconds`` before moto handles it (see the module docstring)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    handle = DomainDispatcherApplication.__call__

    def delayed(self: Any, environ: dict[str, Any], start_response: Any) -> Any:
        time.sleep(seconds)
        return handle(self, environ, start_response)

    DomainDispatcherApplication.__call__ = delayed  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (default): any free port")
    parser.add_argument(
        "--plain-moto", action="store_true", help="answer ranged GETs by moto's whole-object read and slice"
    )
    parser.add_argument("--latency-ms", type=float, default=0.0, help="delay every request by this many ms (default 0)")
    args = parser.parse_args(argv)

    from moto.server import ThreadedMotoServer

    if not args.plain_moto:
        serve_ranges_by_range()
    if args.latency_ms > 0:
        delay_every_request(args.latency_ms / 1000)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    print(
        json.dumps(
            {
                "endpoint": f"http://{host}:{port}",
                "ranged_gets": "moto" if args.plain_moto else "by range",
                "latency_ms": args.latency_ms,
            }
        ),
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
