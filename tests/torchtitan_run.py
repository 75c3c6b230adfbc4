"""Checkpoints saved, and merged outputs loaded, by torchtitan's own ``CheckpointManager``, for
tests/formats/test_torchtitan.py. Run as a script, in processes of its own (gloo process groups):

    python torchtitan_run.py write RUN --world 1|2 [--fsdp] [--dtype float32|bfloat16]
        trains 6 steps and saves RUN/step-2, step-4 (full: model, optimizer, lr_scheduler,
        dataloader, train_state) and step-6 (model only, in the training dtype: torchtitan's
        last step), and the model's weights at each save in RUN-weights/step-N.safetensors;
        --fsdp shards the model with FSDP2 (DTensor chunks, one .distcp per rank).
    python torchtitan_run.py load FOLDER...
        for each merged FOLDER, a fresh model and manager with an empty checkpoint folder and
        ``initial_load_path=FOLDER`` (what torchtitan offers to start from weights): load(),
        then the weights it holds into FOLDER.loaded.safetensors.

``torchtitan.models`` needs triton, which a CPU machine lacks: the model is a small module whose
names are llama3's (fused qkv), driven by the real optimizer, scheduler, dataloader and manager.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import warnings
from pathlib import Path

from process_group import free_port, leave_process_group

STEPS = (2, 4, 6)


def build_model(torch, dim: int = 16, vocab: int = 64, hidden: int = 32):
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_linear = nn.Module()
            self.qkv_linear.wqkv = nn.Linear(dim, 3 * dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            q, k, v = self.qkv_linear.wqkv(x).chunk(3, -1)
            return self.wo(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim), -1) @ v)

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = Attention()
            self.feed_forward = FeedForward()
            self.attention_norm = nn.RMSNorm(dim)
            self.ffn_norm = nn.RMSNorm(dim)

        def forward(self, x):
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
            self.norm = nn.RMSNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)
            self.register_buffer("rope_cache", torch.zeros(8, dim), persistent=False)  # never saved

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h)
            return self.lm_head(self.norm(h))

    return Llama()


class TrainState:
    """What torchtitan's Trainer saves as ``train_state`` (its own ``state_dict``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def manager(torch, model, folder: str, rank: int, world: int, dtype: str, **config):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    class Tokens(torch.utils.data.IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(7 + rank)
            while True:
                yield torch.randint(0, 64, (8,), generator=generator)

    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=groups, implementation="for-loop"), model_parts=[model]
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS[-1])
    loader = ParallelAwareDataloader(Tokens(), dp_rank=rank, dp_world_size=world, batch_size=2)
    state = TrainState()
    checkpoints = CheckpointManager(
        CheckpointManager.Config(
            enable=True, folder=folder, interval=math.gcd(*STEPS), keep_latest_k=0, export_dtype=dtype, **config
        ),
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
    )
    return checkpoints, optimizers, schedulers, loader, state


def _model(torch, dtype: str, fsdp: bool, world: int):
    torch.manual_seed(0)
    model = build_model(torch).to(getattr(torch, dtype))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _full_weights(model) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def write(rank: int, world: int, args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    run = Path(args.run).resolve()
    model = _model(torch, args.dtype, args.fsdp, world)
    checkpoints, optimizers, schedulers, loader, state = manager(torch, model, str(run), rank, world, args.dtype)
    batches = iter(loader)
    for step in range(1, STEPS[-1] + 1):
        batch = next(batches)
        logits = model(batch[:, :-1]).float().flatten(0, 1)
        torch.nn.functional.cross_entropy(logits, batch[:, 1:].flatten()).backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step, state.ntokens_seen = step, state.ntokens_seen + batch.numel() * world
        if step in STEPS:
            checkpoints.save(step, last_step=step == STEPS[-1])
            weights = _full_weights(model)
            if rank == 0:
                (run.parent / f"{run.name}-weights").mkdir(exist_ok=True)
                save_file(weights, run.parent / f"{run.name}-weights" / f"step-{step}.safetensors")
    checkpoints.close()


def load(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    for folder in map(Path, args.folders):
        model = _model(torch, "float32", False, 1)
        for parameter in model.parameters():
            parameter.data.zero_()
        empty = folder.parent / f"{folder.name}.titan"  # no step-N in it: initial_load_path is read
        checkpoints, *_ = manager(
            torch,
            model,
            str(empty),
            0,
            1,
            "float32",
            initial_load_path=str(folder.resolve()),
            initial_load_model_only=True,
        )
        if not checkpoints.load():
            raise SystemExit(f"torchtitan loaded nothing from {folder}")
        checkpoints.close()
        save_file(_full_weights(model), folder.parent / f"{folder.name}.loaded.safetensors")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    write(rank, world, args) if args.command == "write" else load(args)
    leave_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    writer = commands.add_parser("write")
    writer.add_argument("run")
    writer.add_argument("--world", type=int, default=1)
    writer.add_argument("--fsdp", action="store_true")
    writer.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    loader = commands.add_parser("load")
    loader.add_argument("folders", nargs="+")
    args = parser.parse_args()
    world = args.world if args.command == "write" else 1
    port = free_port()
    if world == 1:
        _worker(0, 1, port, args)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_worker, args=(world, port, args), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
