"""Merge cost per byte of one model saved as DCP in five layouts (issues 31 and 32).

Run with ``.venv/bin/python benchmarks/bench_layouts_dcp.py`` (``--repeat``, ``--data``). The same
4 checkpoints (120 bf16 tensors, 0.39 GB each, every value a function of the step and the tensor)
are saved as DCP:

  1 rank        ``dcp.save(..., no_dist=True)``: one chunk per tensor, one data file;
  8 x Shard(0)  8 gloo processes, each saving its rows as a DTensor on a 1-D mesh (FSDP2);
  2 x Shard(1)  2 gloo processes, each saving its columns (tensor-parallel column style);
  4 x Shard(1)  the same with 4;
  64 x Shard(0) generated in one process with torch's own DCP pieces (the default save planner's
                global plan and metadata, ``FileSystemWriter.write_data`` once per rank, its
                ``finish``): what 64 ranks would write, without 64 processes on a small machine.

``--layouts 1rank 2x1`` runs (and builds) only the layouts named (``<ranks>x<dimension>``; the
1-rank one always, the reference of the ratios). Then ``ckptavg merge <layout> --last 4
--no-fsync`` of each, interleaved repetition by repetition
(A, B, C, ..., A, B, C, ...: a noisy neighbour slows all alike), each run its own child process
reaped with ``os.wait4`` (its wall time and peak RSS; ``bench_merge.run_child``), and prints per
layout the medians of ckptavg's own ``seconds`` (sources opened to output published) and of the
wall time, the ratio to the 1-rank layout, the layout's read floor (its data files read from the
page cache, in the same rounds: ``raw_read.py``) and ``seconds`` over it, and the peak RSS.
Untimed, it checks that every layout's merge is bit-identical to the 1-rank one. Data is cached
in ``bench-data/layouts-dcp``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_merge import ChildFailed, ckptavg_command, fresh, run_child
from raw_read import read_all
from results import record

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent / "bench-data" / "layouts-dcp"
STEPS = (1000, 2000, 3000, 4000)
LAYERS = 15
HIDDEN = 1024
FFN = 2816
# (layout name, ranks, sharded dimension; None: whole tensors from one process)
LAYOUTS = (
    ("1 rank", 1, None),
    ("8 x Shard(0)", 8, 0),
    ("2 x Shard(1)", 2, 1),
    ("4 x Shard(1)", 4, 1),
    ("64 x Shard(0)", 64, 0),
)
GENERATED_RANKS = 16  # layouts with more ranks than this are generated in one process
STAMP = ".bench-complete"


def tensor_shapes() -> list[tuple[str, tuple[int, int]]]:
    """120 two-dimensional tensors (8 a layer), so every one can be split on either dimension."""
    shapes = []
    for layer in range(LAYERS):
        p = f"layers.{layer}"
        shapes += [(f"{p}.attn.{n}.weight", (HIDDEN, HIDDEN)) for n in ("q", "k", "v", "o")]
        shapes += [(f"{p}.mlp.gate.weight", (FFN, HIDDEN)), (f"{p}.mlp.up.weight", (FFN, HIDDEN))]
        shapes += [(f"{p}.mlp.down.weight", (HIDDEN, FFN)), (f"{p}.router.weight", (256, HIDDEN))]
    return shapes


def full_tensor(step: int, index: int, shape: tuple[int, int]):  # noqa: ANN201 (torch imported lazily)
    import torch

    generator = torch.Generator().manual_seed(step * 1000 + index)
    return (torch.randn(shape, generator=generator) * 0.02).bfloat16()


def local_part(tensor, rank: int, ranks: int, dim: int):  # noqa: ANN001, ANN201
    """Rank ``rank``'s part as DTensor's ``Shard(dim)`` cuts it (torch.chunk: ceil(n / ranks) each)."""
    per = -(-tensor.shape[dim] // ranks)
    lo, hi = min(rank * per, tensor.shape[dim]), min((rank + 1) * per, tensor.shape[dim])
    return tensor.narrow(dim, lo, hi - lo).contiguous(), lo


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _save_rank(rank: int, ranks: int, dim: int, port: int, folder: str, step: int) -> None:
    """One gloo process of a sharded save: its part of every tensor as a DTensor."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    state = {}
    for index, (name, shape) in enumerate(tensor_shapes()):
        local, _ = local_part(full_tensor(step, index, shape), rank, ranks, dim)
        strides = (shape[1], 1)
        state[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=strides)
    dcp.save(state, checkpoint_id=folder)
    dist.barrier()
    dist.destroy_process_group()


def _generated_save(ranks: int, dim: int, folder: str, step: int) -> None:
    """What ``ranks`` processes saving ``Shard(dim)`` DTensors write, from one process: each
    rank's local plan built as DTensor's write items are, the default planner's global plan and
    metadata, ``FileSystemWriter.write_data`` per rank and rank 0's ``finish``."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class LocalPlanner(DefaultSavePlanner):
        def lookup_object(self, index):  # noqa: ANN001, ANN202 (a rank's chunk, whatever its offset)
            return self.state_dict[index.fqn]

    tensors = [(name, full_tensor(step, i, shape)) for i, (name, shape) in enumerate(tensor_shapes())]
    plans, locals_ = [], []
    for rank in range(ranks):
        items, state = [], {}
        for name, tensor in tensors:
            local, lo = local_part(tensor, rank, ranks, dim)
            offsets = [0, 0]
            offsets[dim] = lo
            state[name] = local
            items.append(
                WriteItem(
                    index=MetadataIndex(name, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape),
                        properties=TensorProperties.create_from_tensor(local),
                        size=tensor.shape,
                    ),
                )
            )
        plans.append(SavePlan(items))
        locals_.append(state)
    plans, metadata = create_default_global_save_plan(plans)
    writer = FileSystemWriter(folder)
    writer.set_up_storage_writer(True, rank=0)
    writer.prepare_local_plan(SavePlan([]))  # makes the folder
    plans = writer.prepare_global_plan(plans)
    results = []
    for rank, plan in enumerate(plans):
        rank_writer = FileSystemWriter(folder)
        rank_writer.set_up_storage_writer(rank == 0, rank=rank)
        planner = LocalPlanner()
        planner.set_up_planner(locals_[rank], is_coordinator=rank == 0)
        future = rank_writer.write_data(planner.finish_plan(plan), planner)
        future.wait()
        results.append(future.value())
    writer.finish(metadata, results)


def _run_name(ranks: int, dim: int | None) -> str:
    return f"{ranks}x{dim}" if dim is not None else "1rank"


def build_layout(root: Path, ranks: int, dim: int | None) -> Path:
    """``root/<layout>/step-N`` for every step, built once (a stamp marks each finished step)."""
    run = root / _run_name(ranks, dim)
    for step in STEPS:
        folder = run / f"step-{step}"
        if (folder / STAMP).exists():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        print(f"  building {folder}", flush=True)
        if dim is None:
            import torch.distributed.checkpoint as dcp

            state = {name: full_tensor(step, i, shape) for i, (name, shape) in enumerate(tensor_shapes())}
            dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        elif ranks > GENERATED_RANKS:
            _generated_save(ranks, dim, str(folder), step)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_save_rank, args=(ranks, dim, _free_port(), str(folder), step), nprocs=ranks, join=True)
        (folder / STAMP).write_text(json.dumps({"ranks": ranks, "dim": dim}))
    return run


def same_outputs(first: Path, other: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(file)))
        return out

    a, b = tensors(first), tensors(other)
    return a.keys() == b.keys() and all(
        a[k].flatten().view(torch.uint8).equal(b[k].flatten().view(torch.uint8)) for k in a
    )


def _merge(version: list[str], run: Path, out: Path) -> list[str]:
    return [*version, "merge", str(run), "--last", "4", "--out", str(out), "--force", "--quiet", "--no-fsync"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="a folder with another version's ckptavg package")
    names = [_run_name(ranks, dim) for _, ranks, dim in LAYOUTS]
    parser.add_argument("--layouts", nargs="+", choices=names, default=names, help="the layouts to run")
    # Internal: the steps that import torch run in a child process, since a child's peak RSS
    # (ru_maxrss) starts from the RSS of the process that spawns it (see bench_merge.py).
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--same", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    layouts = [layout for layout in LAYOUTS if _run_name(*layout[1:]) in {*args.layouts, "1rank"}]
    if args.same:
        return 0 if same_outputs(*args.same) else 3
    args.data.mkdir(parents=True, exist_ok=True)
    if args.build:
        for _, ranks, dim in layouts:
            build_layout(args.data, ranks, dim)
        return 0
    chosen = ["--layouts", *(_run_name(ranks, dim) for _, ranks, dim in layouts)]
    subprocess.run([sys.executable, __file__, "--build", "--data", str(args.data), *chosen], check=True)
    runs = {name: args.data / _run_name(ranks, dim) for name, ranks, dim in layouts}
    versions = {"this": ckptavg_command()}
    if args.baseline is not None:
        # The console script, not ``python -m ckptavg``: that puts the working folder (this
        # checkout, where make bench runs) on sys.path ahead of PYTHONPATH, so "baseline" ran this.
        versions["baseline"] = ["env", f"PYTHONPATH={args.baseline.resolve()}", *ckptavg_command()]
    scratch = Path(tempfile.mkdtemp(prefix="bench-layouts-", dir=args.data))
    cases = [(version, name) for name in runs for version in versions]
    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    cpu: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    walls: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    rss: dict[tuple[str, str], list[int]] = {case: [] for case in cases}
    # Each layout's read floor: its data files read from the page cache, in the same rounds. The
    # page cache copies some files slower than others (many small files, written by many ranks:
    # smaller folios), which no reader can avoid.
    floors: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for run in runs.values():  # warm the page cache, and the bit-identity check
            run_child(_merge(versions["this"], run, scratch / run.name), 600)
        first = scratch / runs[LAYOUTS[0][0]].name
        identical = {
            name: subprocess.run([sys.executable, __file__, "--same", str(first), str(scratch / run.name)]).returncode
            == 0
            for name, run in runs.items()
        }
        for repetition in range(args.repeat):
            turn = repetition % len(cases)
            for version, name in cases[turn:] + cases[:turn]:  # a rotating order
                out = scratch / runs[name].name
                fresh(out)
                sample = run_child([*_merge(versions[version], runs[name], out), "--json"], 600)
                seconds[version, name].append(float(json.loads(sample.stdout)["seconds"]))
                cpu[version, name].append(sample.cpu_s)
                walls[version, name].append(sample.wall_s)
                rss[version, name].append(sample.rss_bytes)
            for name, run in runs.items():
                started = time.perf_counter()
                read_all(sorted(run.glob("step-*/*.distcp")))
                floors[name].append(time.perf_counter() - started)
    except ChildFailed as exc:
        print(f"bench_layouts_dcp: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"ckptavg merge --last 4 --no-fsync of 4 x 0.39 GB bf16 (120 tensors), medians of {args.repeat}, interleaved")
    header = f"{'version':<9}{'layout':<15}{'seconds':>9}{'(min-max)':>12}{'cpu s':>8}{'wall s':>8}"
    print(f"{header}{'vs 1 rank':>11}{'read floor':>12}{'/ floor':>9}{'peak RSS':>11}  identical")
    for version, name in sorted(cases):
        base = statistics.median(seconds[version, LAYOUTS[0][0]])
        median = statistics.median(seconds[version, name])
        spread = f"{min(seconds[version, name]):.2f}-{max(seconds[version, name]):.2f}"
        print(
            f"{version:<9}{name:<15}{median:>9.2f}{spread:>12}{statistics.median(cpu[version, name]):>8.2f}"
            f"{statistics.median(walls[version, name]):>8.2f}{median / base:>10.2f}x"
            f"{statistics.median(floors[name]):>10.2f} s{median / statistics.median(floors[name]):>8.2f}x"
            f"{max(rss[version, name]) / 1e6:>8.0f} MB  {identical[name] if version == 'this' else ''}"
        )
    figures = {"seconds": {n: seconds["this", n] for n in runs}, "rss_bytes": {n: rss["this", n] for n in runs}}
    record("bench_layouts_dcp", {**figures, "identical": identical})
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
