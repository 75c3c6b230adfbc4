"""DCP copies of the benchmark's safetensors checkpoints, saved the way a 2-rank FSDP2 job saves.

``bench-data/run/stepN`` (from ``make_checkpoints.py``) becomes ``bench-data/dcp-run/step-N``
(torchtitan's folder name), written by ``torch.distributed.checkpoint.save``. By default two
processes (``--ranks 2``) join a gloo process group on 127.0.0.1 and each saves its half of every
tensor as a ``Shard(0)`` DTensor on a 1-D mesh, which is what FSDP2's ``fully_shard`` holds: every
tensor gets two chunks (rows ``[0, n/2)`` and ``[n/2, n)``), rank r writes its chunks to
``__r_0.distcp``, and rank 0 writes ``.metadata``. Each rank reads only its rows of the source
(``safe_open(...).get_slice``). ``--ranks 1`` saves whole tensors from one process instead
(``save(state_dict, checkpoint_id=..., no_dist=True)``: one chunk per tensor, one data file).

Key names are the safetensors ones (``model.layers.0...``), so a merge of the DCP run can be
compared bit for bit with a merge of the safetensors run. Folders are built under a hidden name,
renamed into place, and stamped with ``.bench-complete.json`` (spec, ranks, file sizes) like
``make_checkpoints.py`` does; the completeness checks import nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from make_checkpoints import SPEC, STAMP_FILE, tensor_shapes, weight_files

METADATA_FILE = ".metadata"


def dcp_spec(ranks: int) -> dict[str, Any]:
    return {"version": 1, "ranks": ranks, "layout": "Shard(0) DTensor" if ranks > 1 else "whole tensors", **SPEC}


def step_dir(dcp_run: Path, step: int) -> Path:
    return dcp_run / f"step-{step}"


def data_files(folder: Path) -> list[Path]:
    """The ``.distcp`` files of a DCP folder (what a reader of every tensor reads, besides
    ``.metadata``)."""
    return sorted(folder.glob("*.distcp"))


def is_complete(folder: Path, ranks: int) -> bool:
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("spec") != dcp_spec(ranks):
        return False
    try:
        return all((folder / name).stat().st_size == size for name, size in stamp["files"].items())
    except (OSError, KeyError, AttributeError):
        return False


def missing_steps(dcp_run: Path, steps: list[int], ranks: int) -> list[int]:
    return [s for s in steps if not is_complete(step_dir(dcp_run, s), ranks)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _convert(rank: int, ranks: int, port: int, run_dir: Path, dcp_run: Path, steps: list[int]) -> None:
    """One rank's part of the conversion (the whole of it with ``ranks == 1``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    mesh = None
    if ranks > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
        mesh = init_device_mesh("cpu", (ranks,))
    from torch.distributed.tensor import DTensor, Shard

    order = [name for name, _ in tensor_shapes()]  # model.state_dict() order
    try:
        for step in steps:
            started = time.perf_counter()
            final, tmp = step_dir(dcp_run, step), dcp_run / f".step-{step}.partial"
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            if mesh is not None:
                dist.barrier()
            state: dict[str, torch.Tensor] = {}
            for file in weight_files(run_dir / f"step{step}"):
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                        if mesh is None:
                            state[name] = handle.get_tensor(name)
                            continue
                        rows = handle.get_slice(name)
                        shape = torch.Size(rows.get_shape())
                        # torch.chunk's split, as DTensor's Shard(0) and FSDP2 use: ceil(n / ranks) rows each.
                        per = -(-shape[0] // ranks)
                        lo, hi = min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
                        local = rows[lo:hi].contiguous()
                        state[name] = DTensor.from_local(
                            local, mesh, [Shard(0)], run_check=False, shape=shape, stride=_strides(shape)
                        )
            state = {name: state[name] for name in order}
            if mesh is None:
                dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
            else:
                dcp.save(state, checkpoint_id=str(tmp))
                dist.barrier()
            if rank == 0:
                files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
                stamp = {"spec": dcp_spec(ranks), "step": step, "files": files}
                (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
                size = sum(files.values())
                print(f"  wrote {final} ({size / 1e9:.2f} GB) in {time.perf_counter() - started:.1f} s", flush=True)
            del state
    finally:
        if mesh is not None:
            dist.destroy_process_group()


def _strides(shape: Any) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _rank_main(rank: int, ranks: int, port: int, run_dir: str, dcp_run: str, steps: list[int]) -> None:
    _convert(rank, ranks, port, Path(run_dir), Path(dcp_run), steps)


def convert(run_dir: Path, dcp_run: Path, steps: list[int], ranks: int) -> None:
    dcp_run.mkdir(parents=True, exist_ok=True)
    if ranks == 1:
        _convert(0, 1, 0, run_dir, dcp_run, steps)
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(ranks, _free_port(), str(run_dir), str(dcp_run), steps), nprocs=ranks, join=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="safetensors run folder (stepN/ of make_checkpoints.py)")
    parser.add_argument("dcp_run", type=Path, help="DCP run folder to fill (step-N/)")
    parser.add_argument("--steps", required=True, help="comma-separated step numbers")
    parser.add_argument("--ranks", type=int, default=2, help="processes saving shards (default 2; 1: whole tensors)")
    parser.add_argument("--force", action="store_true", help="rewrite steps that are already complete")
    args = parser.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",") if s.strip()]
    todo = steps if args.force else missing_steps(args.dcp_run, steps, args.ranks)
    if todo:
        convert(args.run_dir, args.dcp_run, todo, args.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
