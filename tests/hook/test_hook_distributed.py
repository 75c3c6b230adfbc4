"""The hook under torch.distributed: FSDP2 and tensor-parallel DTensors, 2 processes on gloo.

Each process captures only its local shards and writes only its own files; the merged output
holds full tensors equal, byte for byte, to what one process merging the full weights writes.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import files_of
from process_group import leave_process_group
from references import correctly_rounded, load_merged, same_bits
from torch import nn
from training import batch, full_weights

import ckptavg
from ckptavg import MergeHook, MergeHookConfig, Weighting
from ckptavg.formats.parts import PartsReader
from ckptavg.plan import sampled_steps

WORLD = 2
MODES = ["accumulate", "snapshot"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, *args) -> None:
    mp.spawn(worker, args=(free_port(), *args), nprocs=WORLD, join=True)


def init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def uneven_model() -> nn.Module:
    """Dimension 0 of 5, 3 and 1 rows: FSDP2 gives the ranks 3+2, 2+1 and 1+0 (one empty)."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model.to(torch.bfloat16)


def fsdp_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    inputs, targets = batch(step, seed=rank)  # each rank its own data, as in data parallelism
    loss = nn.functional.mse_loss(model(inputs.to(torch.bfloat16)).float(), targets[:, :1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def fsdp_worker(rank: int, port: int, folder: str, mode: str, weighting: object = "uniform") -> None:
    from torch.distributed.fsdp import fully_shard

    init(rank, port)
    model = uneven_model()
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = MergeHookConfig(save_folder=folder, merge_steps=[6, 9], window=4, every=1, mode=mode, weighting=weighting)
    hook = MergeHook(config)
    hook.pre_train(0)
    seen = {}
    for step in range(1, 10):
        fsdp_step(model, optimizer, step, rank)
        hook.post_train_batch(step, model)
        seen[step] = {k: v.to(torch.bfloat16) for k, v in full_weights(model).items()}  # all ranks gather
    hook.close()
    if rank == 0:
        torch.save(seen, Path(folder) / "seen.pt")
    leave_process_group()


def _replay(folder: Path, seen: dict, mode: str, weighting: object = "uniform") -> None:
    """One process, no sharding: the same weights through the same hook."""
    config = MergeHookConfig(
        save_folder=str(folder), merge_steps=[6, 9], window=4, mode=mode, release="copy", weighting=weighting
    )
    hook = MergeHook(config)
    hook.pre_train(0)
    for step in sorted(seen):
        hook.post_train_batch(step, seen[step])
    hook.close()


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_merge_equals_the_single_process_result(tmp_path, mode):
    folder = tmp_path / "fsdp"
    spawn(fsdp_worker, str(folder), mode)
    seen = torch.load(folder / "seen.pt", weights_only=True)
    _replay(tmp_path / "single", seen, mode)
    for merge_step in (6, 9):
        assert files_of(folder / f"step{merge_step}-merged") == files_of(
            tmp_path / "single" / f"step{merge_step}-merged"
        )
        steps = sampled_steps(merge_step, 4)
        merged = load_merged(folder / f"step{merge_step}-merged")
        for name, tensor in merged.items():
            mean = sum(seen[s][name].double() for s in steps) / len(steps)
            assert bool(same_bits(tensor, correctly_rounded(mean, torch.bfloat16)).all()), name
    if mode == "snapshot":
        # Each rank wrote its own shards, no rank another's: together exactly the full model once.
        with PartsReader(*_fs(folder / "step9-snapshot")) as reader:
            assert reader.world_size == WORLD
            total = sum(t.nbytes for t in reader.tensors())
        data = [_data_bytes(folder / "step9-snapshot" / f"rank{r:05d}-of-{WORLD:05d}.safetensors") for r in range(2)]
        assert sum(data) == total and all(data)


def test_fsdp2_several_weightings_equal_single_process_hooks_of_each(tmp_path):
    """Two processes, two weightings: each process keeps one sum per weighting of its own shards;
    each output equals what one process with that weighting alone writes."""
    weightings = [Weighting(), Weighting("ema", ema_halflife=2)]
    folder = tmp_path / "fsdp"
    spawn(fsdp_worker, str(folder), "accumulate", weightings)
    seen = torch.load(folder / "seen.pt", weights_only=True)
    for weighting in weightings:
        tag = weighting.tag()
        _replay(tmp_path / tag, seen, "accumulate", weighting)
        for merge_step in (6, 9):
            single = files_of(tmp_path / tag / f"step{merge_step}-merged", "")
            assert files_of(folder / f"step{merge_step}-merged-{tag}", "") == single != {}


def _fs(path: Path):
    from ckptavg.io.fs import resolve

    return resolve(str(path))


def _data_bytes(path: Path) -> int:
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    return len(raw) - 8 - header_len


def tensor_parallel_worker(rank: int, port: int, folder: str) -> None:
    """DTensors placed by hand: column and row sharding, uneven, and a replicated tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    init(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    generator = torch.Generator().manual_seed(1)
    full = {
        "cols.weight": (torch.randn(4, 7, generator=generator), [Shard(1)]),
        "rows.weight": (torch.randn(5, 3, generator=generator), [Shard(0)]),
        "norm.weight": (torch.randn(6, generator=generator), [Replicate()]),
        "cube": (torch.randn(3, 5, 4, generator=generator), [Shard(2)]),
    }
    params = {
        name: nn.Parameter(distribute_tensor(t.to(torch.bfloat16), mesh, placements))
        for name, (t, placements) in full.items()
    }
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    hooks = {
        mode: MergeHook(MergeHookConfig(save_folder=f"{folder}/{mode}", merge_steps=[5], window=3, mode=mode))
        for mode in MODES
    }
    seen = {}
    for hook in hooks.values():
        hook.pre_train(0)
    for step in range(1, 6):
        for name, param in params.items():
            grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step * 10 + len(name)))
            param.grad = distribute_tensor(grad.to(torch.bfloat16), mesh, param.placements)
        optimizer.step()
        state = {name: param.detach() for name, param in params.items()}
        for hook in hooks.values():
            hook.post_train_batch(step, state)
        seen[step] = {name: t.full_tensor().clone() for name, t in state.items()}
    for hook in hooks.values():
        hook.close()
    if rank == 0:
        torch.save(seen, Path(folder) / "seen.pt")
    leave_process_group()


def test_tensor_parallel_and_replicated_dtensors(tmp_path):
    spawn(tensor_parallel_worker, str(tmp_path))
    seen = torch.load(tmp_path / "seen.pt", weights_only=True)
    for mode in MODES:
        merged = load_merged(tmp_path / mode / "step5-merged")
        assert set(merged) == set(seen[5])
        for name, tensor in merged.items():
            mean = sum(seen[s][name].double() for s in (3, 4, 5)) / 3
            assert bool(same_bits(tensor, correctly_rounded(mean, torch.bfloat16)).all()), (mode, name)
    # The replicated tensor is stored once, by rank 0; the sharded ones by both.
    headers = {}
    for r in range(WORLD):
        raw = (tmp_path / "snapshot" / "step5-snapshot" / f"rank{r:05d}-of-{WORLD:05d}.safetensors").read_bytes()
        headers[r] = set(json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])) - {"__metadata__"}
    sharded = {"cols.weight", "rows.weight", "cube"}
    assert headers == {0: sharded | {"norm.weight"}, 1: sharded}


def resume_worker(rank: int, port: int, folder: str) -> None:
    """Interrupted at step 4 inside the window 3-7: the resumed merge equals the straight one.
    The state at step 4 is also kept for a one-process resume (another sharding)."""
    from torch.distributed.fsdp import fully_shard

    init(rank, port)

    def fresh(sub: str) -> tuple[nn.Module, torch.optim.Optimizer, MergeHook]:
        model = uneven_model()
        fully_shard(model)
        hook = MergeHook(MergeHookConfig(save_folder=f"{folder}/{sub}", merge_steps=[7], window=5))
        return model, torch.optim.AdamW(model.parameters(), lr=0.05), hook

    model, optimizer, hook = fresh("straight")
    hook.pre_train(0)
    for step in range(1, 8):
        fsdp_step(model, optimizer, step, rank)
        hook.post_train_batch(step, model)
    hook.close()

    model, optimizer, hook = fresh("resumed")
    hook.pre_train(0)
    seen = {}
    for step in range(1, 5):
        fsdp_step(model, optimizer, step, rank)
        hook.post_train_batch(step, model)
        seen[step] = full_weights(model)
    checkpoint = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    hook_state = hook.state_dict()
    for step in range(5, 7):  # the lost timeline
        fsdp_step(model, optimizer, step, rank + 7)
        hook.post_train_batch(step, model)
    hook.close()
    model, optimizer, hook = fresh("resumed")
    model.load_state_dict(checkpoint[0])
    optimizer.load_state_dict(checkpoint[1])
    hook.load_state_dict(hook_state)
    hook.pre_train(4)
    for step in range(5, 8):
        fsdp_step(model, optimizer, step, rank)
        hook.post_train_batch(step, model)
    hook.close()
    if rank == 0:
        torch.save({"seen": seen, "hook": hook_state}, Path(folder) / "at4.pt")
    leave_process_group()


def test_fsdp2_resume_mid_window_and_on_another_world_size(tmp_path):
    spawn(resume_worker, str(tmp_path))
    assert files_of(tmp_path / "resumed" / "step7-merged") == files_of(tmp_path / "straight" / "step7-merged")
    # The state the two processes saved at step 4, resumed by one process with its own
    # (unsharded) model: the sums of steps 3-4 come back from both processes' files.
    saved = torch.load(tmp_path / "at4.pt", weights_only=True)
    model = uneven_model().to(torch.float64)
    model.load_state_dict(saved["seen"][4])
    model = model.to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hook = MergeHook(MergeHookConfig(save_folder=str(tmp_path / "resumed"), merge_steps=[7], window=5))
    hook.load_state_dict(saved["hook"])
    hook.pre_train(4)
    seen = {3: saved["seen"][3], 4: saved["seen"][4]}
    for step in range(5, 8):
        fsdp_step(model, optimizer, step, 0)
        hook.post_train_batch(step, model)
        seen[step] = full_weights(model)
    hook.close()
    merged = load_merged(tmp_path / "resumed" / "step7-merged")
    for name, tensor in merged.items():
        mean = sum(seen[s][name] for s in range(3, 8)) / 5
        assert bool(same_bits(tensor, correctly_rounded(mean, torch.bfloat16)).all()), name


def retention_worker(rank: int, port: int, folder: str) -> None:
    """Snapshot mode without keeping snapshots: checkpoints (``state_dict``) at steps 7 and 9."""
    from torch.distributed.fsdp import fully_shard

    init(rank, port)
    model = uneven_model()
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = MergeHookConfig(save_folder=folder, merge_steps=[6, 9], window=4, mode="snapshot", keep_snapshots=False)
    hook = MergeHook(config)
    hook.pre_train(0)
    seen, left = {}, {}
    for step in range(1, 10):
        fsdp_step(model, optimizer, step, rank)
        hook.post_train_batch(step, model)
        seen[step] = {k: v.to(torch.bfloat16) for k, v in full_weights(model).items()}
        if step in (7, 9):
            hook.state_dict()
            left[step] = sorted(p.name for p in Path(folder).glob("*-snapshot"))
    hook.close()
    if rank == 0:  # process 0 removes the snapshots, every process's files in them
        torch.save(seen, Path(folder) / "seen.pt")
        (Path(folder) / "left.json").write_text(json.dumps(left))
    leave_process_group()


def test_fsdp2_snapshots_go_once_consumed_and_the_merges_are_unchanged(tmp_path):
    folder = tmp_path / "fsdp"
    spawn(retention_worker, str(folder))
    left = json.loads((folder / "left.json").read_text())
    # Windows 3-6 and 6-9 share step 6: it stays until merge 9 is behind a checkpoint too.
    assert left == {"7": ["step6-snapshot", "step7-snapshot"], "9": []}
    _replay(tmp_path / "single", torch.load(folder / "seen.pt", weights_only=True), "snapshot")
    for merge_step in (6, 9):
        assert files_of(folder / f"step{merge_step}-merged") == files_of(
            tmp_path / "single" / f"step{merge_step}-merged"
        )


RUN_LONG = {"ema": {"mode": "ema", "merge_steps": [6, 9]}, "blocks": {"mode": "blocks", "block": 3}}


def run_long_worker(rank: int, port: int, folder: str, mode: str) -> None:
    """FSDP2, the EMA or the blocks of the whole run, 9 steps."""
    from torch.distributed.fsdp import fully_shard

    init(rank, port)
    model = uneven_model()
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    hook = MergeHook(MergeHookConfig(save_folder=folder, **RUN_LONG[mode]))
    hook.pre_train(0)
    seen = {}
    for step in range(1, 10):
        fsdp_step(model, optimizer, step, rank)
        hook.post_train_batch(step, model)
        seen[step] = {k: v.to(torch.bfloat16) for k, v in full_weights(model).items()}
    hook.close()
    if rank == 0:
        torch.save(seen, Path(folder) / "seen.pt")
    leave_process_group()


@pytest.mark.parametrize("mode", ["ema", "blocks"])
def test_fsdp2_ema_and_blocks_equal_the_single_process_ones(tmp_path, mode):
    """Each process folds and writes only its shards; the EMA's exports, and a merge built from
    the blocks, are the bytes one process holding the full weights writes."""
    folder = tmp_path / "fsdp"
    spawn(run_long_worker, str(folder), mode)
    seen = torch.load(folder / "seen.pt", weights_only=True)
    single = tmp_path / "single"
    hook = MergeHook(MergeHookConfig(save_folder=str(single), release="copy", **RUN_LONG[mode]))
    hook.pre_train(0)
    for step in sorted(seen):
        hook.post_train_batch(step, seen[step])
    hook.close()
    if mode == "ema":
        names = [f"step{s}-merged-ema-horizon0.05" for s in (6, 9)]
    else:
        assert sorted(p.name for p in (folder / "step9-block").glob("*.safetensors")) == [
            f"rank{r:05d}-of-{WORLD:05d}.safetensors" for r in range(WORLD)
        ]
        for run in (folder, single):
            ckptavg.merge(str(run), merge_step=9, window=9)
        names = ["step9-merged"]
    for name in names:
        assert files_of(folder / name) == files_of(single / name) != {}, name
