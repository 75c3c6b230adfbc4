"""Megatron-core ``dist_checkpointing`` (``torch_dist``) checkpoints written and read back by the
real ``megatron-core`` package, on CPU over gloo, for the Megatron reader tests.

:class:`MegatronWorkers` keeps two worker processes alive for a test session (megatron takes
~5 s to import and its first save starts a helper process: paid once). Each request runs on
the first ``world`` workers, in a fresh gloo group, so the same workers save a 2-process
tensor-parallel run and a 1-process run, and load a folder with either parallelism.

What a saved run holds (observed with megatron-core 0.16.1, torch 2.13):

* ``RUN/iter_{step:07d}/`` for each step and ``RUN/latest_checkpointed_iteration.txt`` (the
  newest step, no newline), as Megatron-LM's ``save_checkpoint`` lays them out.
* A real ``GPTModel`` (2 layers, hidden 16, 4 heads, ffn 32, vocab 64, the local layer spec:
  no Transformer Engine), ``TransformerConfig(use_cpu_initialization=True)``, trained a few
  synthetic steps with Adam, and saved as Megatron-LM's ``generate_state_dict`` builds the
  state: ``args`` (a Namespace), ``checkpoint_version``, ``iteration``, ``model``
  (``model.sharded_state_dict()``), ``optimizer`` (the optimizer's own ``sharded_state_dict``),
  ``opt_param_scheduler``, ``rng_state`` (a ``ShardedObject`` keyed by the (pp, tp) grid) and
  ``content_metadata``, through ``dist_checkpointing.save``.
* fp32 runs use megatron's ``FP32Optimizer``; bf16 runs (the whole model in bf16, as Megatron's
  ``Float16Module`` casts it) its ``Float16OptimizerWithFloat16Params`` (fp32 master weights
  saved as ``optimizer.state.fp32_param.<key>``). Both are built without
  their ``__init__`` (which allocates CUDA tensors) and save through their real
  ``sharded_state_dict``.
* DCP keys are the ``ShardedTensor`` keys: layers stacked (``decoder.layers.*``, global shape
  ``(layers, ...)``), ``optimizer.state.{exp_avg,exp_avg_sq}.<key>``; byte items
  ``<linear>._extra_state/shard_{layer}_{layers}`` and ``rng_state/shard_{pp}.{tp}_{PP}.{TP}``;
  ``common.pt`` holds the rest; ``metadata.json`` (written last) names the backend.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from process_group import free_port

WORKERS = 2
_TIMEOUT_S = 300


@dataclass(frozen=True)
class LoadedShard:
    """One tensor a rank got back from ``dist_checkpointing.load``: where it sits in the global
    tensor (``prepend`` leading axes of size 1 are implied, as for stacked layers)."""

    key: str
    offset: tuple[int, ...]
    prepend: int
    tensor: torch.Tensor

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The same region of the global tensor ``full``."""
        sizes = (1,) * self.prepend + tuple(self.tensor.shape)
        region = full[tuple(slice(o, o + s) for o, s in zip(self.offset, sizes, strict=True))]
        return region.reshape(self.tensor.shape)


class MegatronWorkers:
    """Two spawned processes that run megatron-core on request (see the module docstring)."""

    def __init__(self) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self._requests = [context.Queue() for _ in range(WORKERS)]
        self._replies = context.Queue()
        self._processes = [
            # Not daemonic: megatron's writer starts a helper process of its own.
            context.Process(target=_serve, args=(rank, self._requests[rank], self._replies))
            for rank in range(WORKERS)
        ]
        for process in self._processes:
            process.start()

    def _call(self, world: int, command: str, **kwargs: Any) -> list[Any]:
        port = free_port()
        for rank in range(WORKERS):
            self._requests[rank].put((world, port, command, kwargs))
        replies = {
            rank: (ok, value) for rank, ok, value in (self._replies.get(timeout=_TIMEOUT_S) for _ in range(WORKERS))
        }
        errors = [value for ok, value in replies.values() if not ok]
        if errors:
            raise RuntimeError(f"megatron worker failed in {command}:\n{errors[0]}")
        return [replies[rank][1] for rank in range(world)]

    def save_run(self, run_dir: Path, steps: list[int], world: int, dtype: str = "fp32") -> None:
        """``run_dir/iter_NNNNNNN`` for each step, saved by ``world`` processes with
        tensor parallelism ``world``; ``dtype`` ``fp32`` or ``bf16`` (with fp32 master weights)."""
        self._call(world, "save", run_dir=str(run_dir), steps=sorted(steps), dtype=dtype)

    def load(
        self, folder: Path, world: int, dtype: str = "fp32", optimizer: bool = False, rng: bool = True
    ) -> list[list[LoadedShard] | Any]:
        """``dist_checkpointing.load`` of ``folder`` into the model's sharded state dict (with
        the optimizer's and the RNG state if asked) on ``world`` processes with tensor
        parallelism ``world``. Per rank: ``(shards, rng_state)``."""
        with tempfile.TemporaryDirectory(prefix="megatron-load-") as scratch:
            paths = self._call(
                world,
                "load",
                folder=str(folder),
                dtype=dtype,
                optimizer=optimizer,
                rng=rng,
                scratch=scratch,
            )
            out = []
            for path in paths:
                records, rng_state = torch.load(path, weights_only=False)  # written by our own worker
                out.append(([LoadedShard(*record) for record in records], rng_state))
            return out

    def resume(
        self, load_dir: Path, world: int, dtype: str = "fp32", flags: tuple[str, ...] = ()
    ) -> list[tuple[int, list[LoadedShard], torch.Tensor | None]]:
        """Megatron-LM's ``--load load_dir`` with ``flags`` (``--no-load-optim``,
        ``--no-load-rng``, ``--finetune``) on ``world`` processes with tensor parallelism
        ``world`` (:func:`_resume`), then one more training step. Per rank: ``(iteration resumed
        from, the model's parameters after loading, torch's RNG state once restored or None)``."""
        with tempfile.TemporaryDirectory(prefix="megatron-resume-") as scratch:
            paths = self._call(world, "resume", load_dir=str(load_dir), dtype=dtype, scratch=scratch, flags=flags)
            out = []
            for path in paths:
                iteration, records, restored = torch.load(path, weights_only=False)  # written by our own worker
                out.append((iteration, [LoadedShard(*record) for record in records], restored))
            return out

    def close(self) -> None:
        for queue in self._requests:
            queue.put(None)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


# ------------------------------------------------------------------------------------------
# Inside a worker


def _serve(rank: int, requests: Any, replies: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # megatron-core 0.16.1 calls torch.cuda.synchronize() and torch.cuda.current_device() while
    # saving; both raise on a CPU-only torch.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    commands = {"save": _save, "load": _load, "resume": _resume}
    while (request := requests.get()) is not None:
        world, port, command, kwargs = request
        if rank >= world:
            replies.put((rank, True, None))
            continue
        try:
            with _group(rank, world, port) as parallel:
                replies.put((rank, True, commands[command](parallel, **kwargs)))
        except BaseException:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            replies.put((rank, False, traceback.format_exc()))


@dataclass(frozen=True)
class _Parallel:
    rank: int
    world: int


def _group(rank: int, world: int, port: int) -> Any:
    import contextlib
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.core import parallel_state

    @contextlib.contextmanager
    def group() -> Iterator[_Parallel]:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
            yield _Parallel(rank, world)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()

    return group()


class _Trainer:
    """A GPTModel and its megatron optimizer on this rank."""

    def __init__(self, parallel: _Parallel, dtype: str) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.parallel, self.bf16 = parallel, dtype == "bf16"
        torch.manual_seed(1234)  # every rank alike: replicated parameters start equal
        config = TransformerConfig(
            num_layers=2,
            hidden_size=16,
            num_attention_heads=4,
            ffn_hidden_size=32,
            use_cpu_initialization=True,
            tensor_model_parallel_size=parallel.world,
            params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
            bf16=self.bf16,
        )
        self.model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8
        )
        if self.bf16:
            self.model.bfloat16()  # all of it, norms included, as Megatron's Float16Module does
        self.optimizer = self._optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=self.bf16))

    def _optimizer(self, config: Any) -> Any:
        from megatron.core.optimizer.optimizer import (
            Float16OptimizerWithFloat16Params,
            FP32Optimizer,
            MegatronOptimizer,
        )

        def init_state(optimizer: torch.optim.Optimizer, config: Any = None) -> None:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not optimizer.state[param]:
                        optimizer.state[param]["exp_avg"] = torch.zeros_like(param)
                        optimizer.state[param]["exp_avg_sq"] = torch.zeros_like(param)

        params = list(self.model.parameters())
        # One param group as megatron's _get_param_groups makes them: its keys match the groups
        # of a checkpoint to the optimizer's when the optimizer loads its state.
        group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
        # Both classes' __init__ allocate CUDA tensors: built from their parts instead.
        if self.bf16:
            optimizer = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
            self.main_params = [p.detach().clone().float() for p in params]
            adam = torch.optim.Adam([{**group, "params": self.main_params}], lr=1e-2)
            MegatronOptimizer.__init__(optimizer, adam, config, init_state)
            optimizer.grad_scaler = None
            optimizer._dummy_overflow_buf = None  # as __init__ sets it for bf16: plain copies
            optimizer.float16_groups = [params]
            optimizer.fp32_from_float16_groups = [self.main_params]
            optimizer.fp32_from_fp32_groups = [[]]
        else:
            optimizer = FP32Optimizer.__new__(FP32Optimizer)
            self.main_params = params
            adam = torch.optim.Adam([{**group, "params": params}], lr=1e-2)
            MegatronOptimizer.__init__(optimizer, adam, config, init_state)
            optimizer._scale = torch.tensor([1.0])
        optimizer.is_stub_optimizer = False
        return optimizer

    def train_to(self, step: int, done: int) -> None:
        """Adam steps ``done+1 .. step`` on synthetic gradients (the same on every rank, so that
        replicated parameters stay equal), master weights copied to the model as megatron does."""
        for index in range(done + 1, step + 1):
            generator = torch.Generator().manual_seed(1000 * index)
            for main in self.main_params:
                main.grad = torch.randn(main.shape, generator=generator).to(main.dtype)
            self.optimizer.optimizer.step()
        if self.bf16:
            with torch.no_grad():
                for param, main in zip(self.model.parameters(), self.main_params, strict=True):
                    param.copy_(main)

    def state_dict(self, optimizer: bool, rng: Any, loading: bool = False, metadata: Any = None) -> dict[str, Any]:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        state: dict[str, Any] = {"model": self.model.sharded_state_dict(metadata=metadata)}
        if optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=loading)
        if rng is not False:
            tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), self.parallel.world
            state["rng_state"] = ShardedObject(
                "rng_state", rng, (1, tp), (0, tp_rank), replica_id=parallel_state.get_data_parallel_rank()
            )
        return state


def _rng_state(step: int) -> list[dict[str, Any]]:
    import random

    import numpy as np

    random.seed(step)
    np.random.seed(step)
    torch.manual_seed(step)
    return [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            # Megatron-LM refuses an empty one; its CUDA generators' states, here a CPU one's.
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()},
        }
    ]


def _save(parallel: _Parallel, run_dir: str, steps: list[int], dtype: str) -> None:
    import argparse

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    trainer = _Trainer(parallel, dtype)
    done = 0
    for step in steps:
        trainer.train_to(step, done)
        done = step
        folder = os.path.join(run_dir, f"iter_{step:07d}")
        os.makedirs(folder, exist_ok=True)
        dist.barrier()
        state = trainer.state_dict(optimizer=True, rng=_rng_state(step))
        state.update(
            args=argparse.Namespace(num_layers=2, tensor_model_parallel_size=parallel.world, bf16=dtype == "bf16"),
            checkpoint_version=3.0,
            iteration=step,
            opt_param_scheduler={"max_lr": 1e-2, "num_steps": step, "decay_style": "cosine"},
            num_floating_point_operations_so_far=0,
        )
        dist_checkpointing.save(
            state,
            folder,
            content_metadata={"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False},
        )
        if parallel.rank == 0:
            Path(run_dir, "latest_checkpointed_iteration.txt").write_text(str(step))
        dist.barrier()


def _leaves(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    else:
        yield path, value


def _load(parallel: _Parallel, folder: str, dtype: str, optimizer: bool, rng: bool, scratch: str) -> str:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    trainer = _Trainer(parallel, dtype)
    request = trainer.state_dict(optimizer=optimizer, rng=None if rng else False, loading=True)
    where = {
        path: (leaf.key, tuple(leaf.global_offset), leaf.prepend_axis_num)
        for path, leaf in _leaves(request)
        if isinstance(leaf, ShardedTensor)
    }
    loaded = dist_checkpointing.load(request, folder)
    records = [(*where[path], leaf.detach().clone()) for path, leaf in _leaves(loaded) if path in where]
    assert len(records) == len(where), "dist_checkpointing.load returned a different structure"
    rng_state = loaded.get("rng_state") if rng else None
    path = os.path.join(scratch, f"rank{parallel.rank}.pt")
    torch.save((records, rng_state), path)
    return path


def _model_shards(trainer: _Trainer) -> list[tuple[str, tuple[int, ...], int, torch.Tensor]]:
    """This rank's part of every parameter of the model, as ``(key, global offset, prepended
    axes, tensor)`` of its sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [
        (leaf.key, tuple(leaf.global_offset), leaf.prepend_axis_num, leaf.data.detach().clone())
        for _, leaf in _leaves(trainer.model.sharded_state_dict())
        if isinstance(leaf, ShardedTensor)
    ]


def _resume(parallel: _Parallel, load_dir: str, dtype: str, scratch: str, flags: tuple[str, ...]) -> str:
    """What Megatron-LM's ``load_checkpoint`` (megatron/training/checkpointing.py) does with a
    torch_dist checkpoint given the command-line ``flags`` (of ``--no-load-optim``,
    ``--no-load-rng``, ``--finetune``), step by step with megatron-core's own calls (Megatron-LM's
    training loop is not installed): the tracker file names the iteration (``read_metadata``) and
    so the folder ``iter_NNNNNNN`` (``get_checkpoint_name``), which must be a distributed
    checkpoint (``_get_checkpoint_format``); rank 0's common state (``load_common_state_dict``)
    gives the checkpoint's args and content metadata. The state dict asked for
    (``generate_state_dict``) holds the model, the optimizer's state unless ``--finetune``,
    ``--no-load-optim`` or the args' ``no_save_optim``, and the RNG state at the saved tensor
    parallelism unless ``--finetune``, ``--no-load-rng`` or the args' ``no_save_rng``; it is loaded
    with Megatron-LM's default ``--dist-ckpt-strictness assume_ok_unexpected`` and the model's
    part put into the model strictly. Then, unless ``--finetune`` or ``--no-load-optim``, the
    optimizer loads its state (a KeyError stops the run with Megatron-LM's message); else a bf16
    optimizer takes its fp32 master weights from the model (``reload_model_params``). The RNG
    state, if asked, is restored (Megatron-LM refuses an empty ``rng_tracker_states``). The
    iteration is common.pt's, 0 with ``--finetune``. One training step follows."""
    import random

    import numpy as np
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    finetune = "--finetune" in flags
    tracker = Path(load_dir, "latest_checkpointed_iteration.txt").read_text().strip()
    folder = os.path.join(load_dir, f"iter_{int(tracker):07d}")
    assert dist_checkpointing.check_is_distributed_checkpoint(folder), folder
    common = dist_checkpointing.load_common_state_dict(folder)
    saved = common.get("args")
    load_rng = not finetune and "--no-load-rng" not in flags
    load_optim = not finetune and "--no-load-optim" not in flags
    rng = load_rng and saved.tensor_model_parallel_size == parallel.world and not getattr(saved, "no_save_rng", False)
    optim = load_optim and not getattr(saved, "no_save_optim", False)
    content = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    trainer = _Trainer(parallel, dtype)
    request = trainer.state_dict(optimizer=optim, rng=None if rng else False, loading=True, metadata=content)
    loaded = dist_checkpointing.load(request, folder, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    trainer.model.load_state_dict(loaded["model"], strict=True)
    if load_optim:
        try:
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        except KeyError as exc:
            raise RuntimeError(
                f"Unable to load optimizer from checkpoint {folder}. Specify --no-load-optim or --finetune to "
                "prevent attempting to load the optimizer state, exiting ..."
            ) from exc
    elif trainer.bf16:
        trainer.optimizer.reload_model_params()
        masters = zip(trainer.model.parameters(), trainer.main_params, strict=True)
        assert all(torch.equal(main, param.float()) for param, main in masters), "master weights not reloaded"
    restored = None
    if rng:
        state = loaded["rng_state"][0]
        if not state["rng_tracker_states"]:
            raise RuntimeError("Unable to load rng state: specify --no-load-rng or --finetune")
        random.setstate(state["random_rng_state"])
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        restored = torch.get_rng_state()
    iteration = 0 if finetune else common["iteration"]
    resumed = _model_shards(trainer)
    trainer.train_to(iteration + 1, iteration)
    moved = _model_shards(trainer)
    assert all(not torch.equal(a[3], b[3]) for a, b in zip(resumed, moved, strict=True)), "the step changed nothing"
    path = os.path.join(scratch, f"rank{parallel.rank}.pt")
    torch.save((iteration, resumed, restored), path)
    return path
