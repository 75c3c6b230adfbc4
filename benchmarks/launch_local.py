"""Start N copies of a command as one torch.distributed job on this machine (what torchrun or
srun do), optionally pinning process r to CPU r, and wait for all of them.

    python launch_local.py 2 --pin -- ckptavg merge RUN --last 4 --out OUT

Used by bench_scale.py so that "one process on one core" against "two processes on two cores"
can be measured without a launcher's own start-up in the way; the exit status is the worst one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str]) -> int:
    count, rest = int(argv[0]), argv[1:]
    pin = rest[:1] == ["--pin"]
    command = rest[rest.index("--") + 1 :]
    port = str(free_port())
    procs = []
    for rank in range(count):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(count), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if count == 1:
            env.pop("RANK"), env.pop("WORLD_SIZE")
        setup = (lambda r=rank: os.sched_setaffinity(0, {r})) if pin else None
        procs.append(subprocess.Popen(command, env=env, preexec_fn=setup))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
