"""An S3 server (moto) on loopback for the remote benchmark, in a process of its own.

Started as a child by ``bench_formats.py``, so that neither moto nor the objects it holds weigh on
the driver (whose RSS is the floor of every measured child's) or on the measured processes.
Listens on 127.0.0.1 at a free port, prints one JSON line ``{"endpoint": "http://127.0.0.1:PORT"}``
once it accepts connections, and serves until SIGTERM or SIGINT, then exits with status 0 (so the
parent can reap it with ``os.wait4`` and report the server's own peak RSS and CPU time).

Where the objects live: moto keeps each object in a ``tempfile.SpooledTemporaryFile`` of about
5 MB, so large objects roll over to an (unlinked) temporary file in ``$TMPDIR``: disk and page
cache, not the server's heap. But moto answers every ranged GET by reading the *whole* object
and slicing it, so each range request costs a read of its object, and the server is pure Python
on one interpreter: loopback moto measures the client's protocol overhead against a slow,
CPU-bound server, not what S3 would deliver.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (default): any free port")
    args = parser.parse_args(argv)

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    print(json.dumps({"endpoint": f"http://{host}:{port}"}), flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
