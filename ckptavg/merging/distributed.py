"""Several processes, one merge: who runs where, and the few collective calls a merge needs.

``ckptavg merge`` runs on the launchers users already have: ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and SLURM's ``srun``
(``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, the master from ``MASTER_ADDR`` or
the first host of ``SLURM_STEP_NODELIST``). Processes meet through ``torch.distributed`` with
gloo over TCP (CPU only: a merge moves bytes, not gradients), and exchange only small Python
objects: the temporary folder's name, per-file hashes and errors. Tensor data never crosses: the
processes share the output by bytes (:func:`split_output`), each writing its byte ranges of the
files in place.

Only the CLI looks at the environment: a library call (and the training hook, which runs inside a
torchrun job) stays a single process unless it is handed a :class:`Collective`.
"""

from __future__ import annotations

import bisect
import datetime
import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CkptavgError, ConfigError
from ..formats.layout import ShardPart, ShardSpec

# A merge is long; a peer that dies is noticed at once (its sockets close), a peer that hangs
# only after this. Override with CKPTAVG_DIST_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 3 * 3600
_PORT_BASE = 29500
# srun's rendezvous ports: 20000-32766, below Linux's ephemeral ports (from 32768); 12767 of them, a
# count prime to the job id's factor 7, so that every port can be drawn.
_PORT_BASE_SLURM, _SLURM_PORTS = 20000, 12767
# Cuts between processes' shares of a file fall on its pages: an element boundary whatever the
# dtype, and the page cache (or a shared filesystem's client) never holds a page two processes write.
PAGE_BYTES = 4096
T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a multi-process merge, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" or "slurm"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,09],gpu1`` -> ``node03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None


def launch_from_environment(env: Mapping[str, str] | None = None) -> Launch | None:
    """The multi-process launch this process is part of, or None when it runs alone.

    torchrun's variables win over SLURM's (``srun torchrun ...`` sets both). For SLURM only the
    variables of a job *step* count (``srun``): a batch script also sees ``SLURM_NTASKS`` of its
    allocation but is one process, and waiting for the others would hang.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        if world <= 1:
            return None
        return Launch(
            rank=_int(env, "RANK"),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else _PORT_BASE,
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS")
        if world <= 1:
            return None
        if "MASTER_ADDR" in env:
            master = env["MASTER_ADDR"]
        else:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodes:
                raise ConfigError("srun launch without MASTER_ADDR or SLURM_STEP_NODELIST: cannot find rank 0's host")
            master = first_host(nodes)
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            # One port per job and step, so that two merges on one node do not collide; below
            # Linux's ephemeral range (32768-60999), from which any outgoing connection on the node
            # (srun's own I/O sockets among them) may already hold a port. Every rank computes the
            # same one from the environment alone; MASTER_PORT overrides it.
            job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
            step = _int(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID", "").isdigit() else 0
            port = _PORT_BASE_SLURM + (job * 7 + step) % _SLURM_PORTS
        return Launch(
            rank=_int(env, "SLURM_PROCID"),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=master,
            master_port=port,
            launcher="slurm",
        )
    return None


def assign_shards(shards: Sequence[ShardSpec], world_size: int) -> list[list[ShardSpec]]:
    """Whole output files per process, balanced by bytes: largest file first to the least
    loaded process (ties to the lowest rank), each process's files kept in layout order. Depends
    only on the layout, so every process computes the same assignment."""
    loads = [0] * world_size
    owner: dict[str, int] = {}
    for shard in sorted(shards, key=lambda s: (-s.nbytes, s.file_name)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[shard.file_name] = rank
        loads[rank] += shard.nbytes
    return [[s for s in shards if owner[s.file_name] == rank] for rank in range(world_size)]


def split_output(
    shards: Sequence[ShardSpec], world_size: int, header_size: Callable[[ShardSpec], int | None]
) -> list[list[ShardSpec]]:
    """Each process's share of the output: where every file's layout is known up front
    (``header_size`` of each is not None), the files laid end to end cut into ``world_size``
    contiguous byte ranges of equal size, each cut moved back to a page boundary of its file
    (:data:`PAGE_BYTES`: an element boundary, and no page written by two processes); a file inside
    one range is that process's whole, a file a cut crosses is shared (a :class:`ShardPart` each).
    Else whole files (:func:`assign_shards`). Depends only on the layout, so every process
    computes the same split."""
    if world_size == 1:
        return [list(shards)]
    headers = [header_size(shard) for shard in shards]
    known = [header for header in headers if header is not None]
    if len(known) < len(shards):
        return assign_shards(shards, world_size)
    starts = list(itertools.accumulate((h + s.nbytes for h, s in zip(known, shards, strict=True)), initial=0))
    total = starts[-1]
    cuts = [0, *(_page_cut(starts, total * r // world_size) for r in range(1, world_size)), total]
    return [_share(shards, known, starts, lo, hi) for lo, hi in itertools.pairwise(cuts)]


def _share(
    shards: Sequence[ShardSpec], headers: Sequence[int], starts: Sequence[int], lo: int, hi: int
) -> list[ShardSpec]:
    """The files, or byte ranges of them, that bytes ``[lo, hi)`` of the files laid end to end cover."""
    share: list[ShardSpec] = []
    for shard, header, start in zip(shards, headers, starts, strict=False):
        size = header + shard.nbytes
        first, end = max(lo, start) - start, min(hi, start + size) - start
        if first < end:
            share.append(shard if (first, end) == (0, size) else ShardPart.of(shard, header, first, end))
    return share


def _page_cut(starts: Sequence[int], offset: int) -> int:
    """``offset`` of the files laid end to end, moved back to a page boundary of its file."""
    start = starts[bisect.bisect_right(starts, offset) - 1]
    return start + (offset - start) // PAGE_BYTES * PAGE_BYTES


class Collective:
    """The collective calls of a merge for one process alone: every call is trivial."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def decide(self, decision: Callable[[], T], failure: str = "") -> T:
        """Rank 0 runs ``decision``; every rank returns its value, or fails with its error.

        Alone, a failure is raised as it is. With others, rank 0 tells them why before it raises
        (so that none waits forever for a value that never comes), and they raise
        :class:`CkptavgError` with its message after ``failure`` (e.g. ``rank 0 of 4 failed while
        publishing: ``). Used wherever one process must choose for all: the checkpoints (a listing
        may change while the processes start), the output folder, the publishing."""
        if self.world_size == 1:
            return decision()
        outcome: tuple[Any, str | None] = (None, None)
        if self.rank == 0:
            try:
                outcome = (decision(), None)
            except BaseException as exc:
                self.broadcast((None, str(exc) or type(exc).__name__))
                raise
        value, error = self.broadcast(outcome)
        if error is not None:
            raise CkptavgError(f"{failure}{error}")
        return value

    def close(self, all_done: bool = False) -> None:
        pass

    @property
    def prefix(self) -> str:
        return ""


class TorchCollective(Collective):
    """Processes of one launch, joined by a gloo process group (created here, destroyed on close)."""

    def __init__(self, launch: Launch, timeout_s: float | None = None) -> None:
        import torch.distributed as dist

        self.rank, self.world_size, self.launch = launch.rank, launch.world_size, launch
        if timeout_s is None:
            timeout_s = float(os.environ.get("CKPTAVG_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except (RuntimeError, ValueError) as exc:
            raise CkptavgError(
                f"rank {launch.rank} of {launch.world_size} ({launch.launcher}) could not join the others at "
                f"{launch.master_addr}:{launch.master_port}: {str(exc).splitlines()[0]}"
            ) from None
        self._dist = dist

    @property
    def prefix(self) -> str:
        return f"rank {self.rank}/{self.world_size}: "

    def _call(self, what: str, function: Any, *args: Any) -> None:
        try:
            function(*args)
        except RuntimeError as exc:
            # A peer killed or gone: gloo's sockets close and every collective fails here.
            raise CkptavgError(
                f"rank {self.rank}: lost contact with the other processes during {what} (one was killed or "
                f"crashed; see its log): {str(exc).splitlines()[0]}"
            ) from None

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._call("all_gather", self._dist.all_gather_object, out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._call("broadcast", self._dist.broadcast_object_list, box, 0)
        return box[0]

    def close(self, all_done: bool = False) -> None:
        """Leave the process group. ``all_done`` (every rank finished without error) first meets
        the others at a barrier: gloo retires a collective's work on its own threads, and one still
        doing so while the interpreter exits aborts the process ("terminate called without an
        active exception"). After an error a peer may never come, so no barrier then."""
        if self._dist.is_initialized():
            if all_done:
                self._call("the final barrier", self._dist.barrier)
            self._dist.destroy_process_group()
