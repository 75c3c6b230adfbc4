"""Write real DeepSpeed checkpoints on CPU, and DeepSpeed's own view of their weights.

Run as a script (the tests start it in a subprocess, so that DeepSpeed, its CPU accelerator and
its process group never touch the test process)::

    python deepspeed_writer.py SPEC.json

SPEC = {"world_size": 2, "result": "refs.pt", "runs": [{"dir": ..., "stage": 0-3, "dtype":
"fp32"|"bf16", "steps": [2, 4, 6]}, ...]}. One spawn of ``world_size`` gloo processes trains a
tiny model per run with ``deepspeed.initialize`` (torch's Adam, ZeRO stage ``stage``) and calls
``engine.save_checkpoint(dir)`` at each step: ``dir/global_stepN/``, ``dir/latest`` and, for
stages 1-3, ``dir/zero_to_fp32.py``. Rank 0 then writes ``result``: per run, per step,
``"module"`` (the model-states file's ``module``, stages 0-2, loaded by ``torch.load``) and
``"fp32"`` (``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``, stages 1-3).

With ``"two_groups": true`` the optimizer has two parameter groups (matrices; vectors), as
trainers that spare biases and norms weight decay have. With ``"fp16_loss_scaler": true`` the
run's optimizer files then carry the loss scaler an fp16 run pickles (DeepSpeed's
``DynamicLossScaler``; fp16 does not run on CPU), put in by rank 0.

The model covers what ZeRO treats apart: an embedding whose weight the output layer shares
(``shared_params``), a parameter of 3 elements (padding when partitioned), a frozen parameter and
a buffer.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import sys
import warnings

from process_group import free_port, leave_process_group


def _model(torch):  # noqa: ANN001, ANN202 - torch is imported in the worker, after its environment is set
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 8)
            self.head = torch.nn.Linear(8, 32, bias=False)
            self.head.weight = self.emb.weight
            self.scale = torch.nn.Parameter(torch.ones(3))
            self.frozen = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4), requires_grad=False)
            self.register_buffer("pos", torch.arange(4, dtype=torch.float32))

        def forward(self, x):  # noqa: ANN001, ANN202
            h = self.norm(self.emb(x))
            h = h + (self.pos[: x.shape[1], None] * 0.0).to(h.dtype)
            h = self.fc2(torch.relu(self.fc1(h)))
            return self.head(h) * self.frozen.sum() / 4 * self.scale.mean()

    return Tiny()


def _train_and_save(rank: int, world: int, run: dict) -> None:
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = _model(torch)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * world,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": run["stage"]},
        "steps_per_print": 10**9,
    }
    if run["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    params: list = [p for p in model.parameters() if p.requires_grad]
    if run.get("two_groups"):  # as trainers do: no weight decay for biases and norms
        params = [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    done = 0
    for step in run["steps"]:
        while done < step:
            done += 1
            loss = engine(torch.randint(0, 32, (2, 4), generator=generator)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(run["dir"], client_state={"my_client_key": step})
    engine.destroy()


def _give_fp16_loss_scaler(run: dict) -> None:
    import glob

    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    for path in glob.glob(os.path.join(run["dir"], "global_step*", "*optim_states.pt")):
        state = torch.load(path, weights_only=False)
        state["optimizer_state_dict"]["loss_scaler"] = DynamicLossScaler(
            init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
        )
        state["optimizer_state_dict"]["dynamic_loss_scale"] = True
        torch.save(state, path)


def _deepspeed_view(run: dict) -> dict:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = {}
    for step in run["steps"]:
        tag = f"global_step{step}"
        views = {}
        if run["stage"] <= 2:
            states = torch.load(os.path.join(run["dir"], tag, "mp_rank_00_model_states.pt"), weights_only=False)
            views["module"] = dict(states["module"])
        if run["stage"] >= 1:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                views["fp32"] = get_fp32_state_dict_from_zero_checkpoint(run["dir"], tag=tag)
        out[step] = views
    return out


def _worker(rank: int, world: int, port: int, spec: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    warnings.filterwarnings("ignore")
    import deepspeed
    import torch

    torch.set_num_threads(1)
    # The CPU accelerator compiles a shared-memory allreduce on first use (~90 s, needs g++);
    # gloo's collectives are enough. (``import deepspeed.comm.torch as m`` would bind the torch
    # package that deepspeed.comm re-exports, not this module.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in spec["runs"]:
        _train_and_save(rank, world, run)
    torch.distributed.barrier()
    if rank == 0:
        for run in spec["runs"]:
            if run.get("fp16_loss_scaler"):
                _give_fp16_loss_scaler(run)
        torch.save([_deepspeed_view(run) for run in spec["runs"]], spec["result"])
    leave_process_group()


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import torch.multiprocessing as mp

    world = spec["world_size"]
    mp.start_processes(_worker, args=(world, free_port(), spec), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
