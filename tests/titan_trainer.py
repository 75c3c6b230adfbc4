"""torchtitan's real ``Trainer`` (ckptavg's ``MergingTrainer``) on CPU, for tests/hook/test_hook_torchtitan.py
and benchmarks/bench_torchtitan_hook.py. Run as a script, in processes of its own (gloo groups):

    python titan_trainer.py train RUN --mode accumulate|snapshot|ema [--world 2] [--format dcp]
            [--die-at K] [--steps 6] [--async] [--record]
        trains a 2-layer llama3 of torchtitan's own modules for --steps steps in RUN (checkpoints
        at every 2nd step in RUN/checkpoint/, merges in RUN/merges/: step 6 of the last 4 steps,
        or the EMA at step 6); with --record, RUN/weights/step-N.safetensors holds the full weights
        after each step. --world 2 shards the model with FSDP2 over 2 processes; --async checkpoints with
        torchtitan's async_mode="async". --die-at K ends every process before step K (os._exit,
        as a killed job: no close, no last checkpoint); running again resumes from torchtitan's
        newest checkpoint.
    python titan_trainer.py load FOLDER OUT
        a fresh Trainer with ``--checkpoint.initial_load_path FOLDER`` loads it; its weights go to OUT.

CPU shims (torchtitan 0.3 targets GPUs and torch nightly), none of them in what is tested:
MinimalAsyncEP's triton kernels (imported by the trainer, used only with that CUDA dispatcher)
are replaced by functions that refuse; the device module answers for the CPU; the process-group
timeout update after step 1 (``torch.distributed.set_timeout``, newer than this torch) and the 2 s
sleep at the end of ``train()`` are skipped; attention is torch's SDPA (FlexAttention has no CPU
backward); FSDP2 is applied by a parallelize function of the model spec (below).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

from process_group import free_port, leave_process_group

VOCAB, DIM, SEQ, BATCH = 64, 16, 8, 2
MERGE_STEP, WINDOW, INTERVAL = 6, 4, 2


def _join(rank: int, world: int, port: int) -> None:
    """The environment torchtitan's Trainer starts its process group from."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )


def in_this_process() -> None:
    """Let torchtitan's Trainer run in this process, on CPU, as a process group of one;
    :func:`leave` ends that group."""
    _join(0, 1, free_port())
    install_cpu_shims()


def leave() -> None:
    import torch

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def install_cpu_shims() -> None:

    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def cuda_only(*args, **kwargs):
        raise RuntimeError("MinimalAsyncEP's kernels need CUDA and triton")

    for name in (
        "copy_full_counts_to_peers_kernel",
        "copy_rows_to_peers_kernel",
        "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel",
        "fill_dispatch_metadata_kernel",
        "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel",
        "topk_scores_grad_kernel",
    ):
        setattr(kernels, name, cuda_only)
    sys.modules[kernels.__name__] = kernels

    import torchtitan.tools.utils as titan_utils

    class CpuDevice:
        set_device = staticmethod(lambda device: None)
        current_device = staticmethod(lambda: 0)
        device_count = staticmethod(lambda: 1)
        get_device_name = staticmethod(lambda device=None: "cpu")
        get_device_properties = staticmethod(
            lambda device=None: types.SimpleNamespace(total_memory=1 << 30, name="cpu")
        )
        reset_peak_memory_stats = staticmethod(lambda *args: None)
        empty_cache = staticmethod(lambda: None)
        memory_stats = staticmethod(lambda device=None: {})
        synchronize = staticmethod(lambda *args: None)

    titan_utils.device_type, titan_utils.device_module = "cpu", CpuDevice
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.trainer

    dist_utils.set_pg_timeouts = lambda **kwargs: None
    torchtitan.trainer.time = types.SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=time.monotonic, time=time.time, sleep=lambda seconds: None
    )


def parallelize(model, *, parallel_dims, **kwargs):
    """FSDP2 over the data-parallel processes, as torchtitan's ``apply_fsdp_to_decoder`` without its
    gradient pre-scaling (a ``PREMUL_SUM`` reduce-scatter, which gloo lacks)."""
    from torch.distributed.fsdp import fully_shard

    if parallel_dims.dp_shard_enabled:
        mesh = parallel_dims.get_mesh("fsdp")
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def trainer_config(
    dump_folder: str,
    steps: int,
    async_mode: str,
    initial_load_path: str | None = None,
    *,
    dim: int = DIM,
    layers: int = 2,
    vocab: int = VOCAB,
    seq: int = SEQ,
):
    """A ``Trainer.Config`` as a torchtitan config_registry function returns one (a llama3 of
    ``layers`` layers of width ``dim``; benchmarks/bench_torchtitan_hook.py makes it larger)."""
    import torch
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config.configs import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    class Tokens(torch.utils.data.IterableDataset):
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def __iter__(self):
            generator = torch.Generator().manual_seed(7 + self.rank)
            while True:
                tokens = torch.randint(0, vocab, (seq + 1,), generator=generator)
                yield {"input": tokens[:-1]}, tokens[1:]

    class TokenLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, local_batch_size, **kwargs):
            super().__init__(Tokens(dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size)

    class NoTokenizer(BaseTokenizer):  # the tokens are made up
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, **kwargs):
            super().__init__()

        def encode(self, *args, **kwargs):
            return []

        def decode(self, *args, **kwargs):
            return ""

        def get_vocab_size(self):
            return vocab

    heads = 2
    blocks = llama3._build_llama3_layers(
        n_layers=layers,
        dim=dim,
        n_heads=heads,
        hidden_dim=2 * dim,
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq, theta=10000),
        attn_backend="flex",
    )
    for layer in blocks:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=blocks,
    )
    spec = ModelSpec(
        name="llama3",
        flavor="tiny",
        model=model,
        parallelize_fn=parallelize,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
    loading = {"initial_load_path": initial_load_path, "initial_load_model_only": True} if initial_load_path else {}
    return Trainer.Config(
        model_spec=spec,
        dump_folder=dump_folder,
        tokenizer=NoTokenizer.Config(),
        dataloader=TokenLoader.Config(),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=1e-2, implementation="for-loop"),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(
            local_batch_size=BATCH, seq_len=seq, steps=steps, disable_cuda_graphs=True, mixed_precision_param="float32"
        ),
        debug=DebugConfig(seed=0),
        # Plain fully_shard DTensors (parallelize above), not the spmd_types backend's full-mesh ones.
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(
            enable=True, interval=INTERVAL, last_save_model_only=False, async_mode=async_mode, **loading
        ),
    )


def merge_config(mode: str, output_format: str):
    from ckptavg import MergeHookConfig

    if mode == "ema":
        return MergeHookConfig(save_folder="merges", mode="ema", ema_halflife=2, merge_steps=[MERGE_STEP])
    # float64 sums: the merge is then the correctly rounded mean, which the tests check.
    return MergeHookConfig(
        save_folder="merges",
        mode=mode,
        merge_steps=[MERGE_STEP],
        window=WINDOW,
        output_format=output_format,
        float64_accumulator=mode == "accumulate",
    )


def full_weights(model) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def train(rank: int, args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    from ckptavg.hook.integrations.torchtitan import MergingTrainer

    run = Path(args.run).resolve()

    class Recording(MergingTrainer):
        """Keeps the full weights after each step; ends like a killed job before step ``--die-at``."""

        def train_step(self, data_iterator):
            if self.step == args.die_at:
                self.checkpointer.maybe_wait_for_saving()  # killed once the last checkpoint is on disk
                os._exit(0)  # status 0: run_scripts waits for it as for any run
            super().train_step(data_iterator)
            if args.record:
                weights = full_weights(self.model_parts[0])
                if rank == 0:
                    (run / "weights").mkdir(exist_ok=True)
                    save_file(weights, run / "weights" / f"step-{self.step}.safetensors")

    config = MergingTrainer.Config.of(
        trainer_config(str(run), args.steps, args.async_mode), merge_config(args.mode, args.format)
    )
    trainer = Recording(config)
    try:
        trainer.train()
    finally:
        trainer.close()


def load(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file
    from torchtitan.trainer import Trainer

    out = Path(args.out)
    config = trainer_config(str(out.parent / f"{out.name}.titan"), 1, "disabled", str(Path(args.folder).resolve()))
    trainer = Trainer(config)
    if not trainer.checkpointer.load():
        raise SystemExit(f"torchtitan loaded nothing from {args.folder}")
    save_file(full_weights(trainer.model_parts[0]), out)
    trainer.close()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    _join(rank, world, port)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    install_cpu_shims()
    train(rank, args) if args.command == "train" else load(args)
    leave_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    trainer = commands.add_parser("train")
    trainer.add_argument("run")
    trainer.add_argument("--mode", default="accumulate", choices=["accumulate", "snapshot", "ema"])
    trainer.add_argument("--world", type=int, default=1)
    trainer.add_argument("--format", default="safetensors", choices=["safetensors", "dcp"])
    trainer.add_argument("--steps", type=int, default=MERGE_STEP)
    trainer.add_argument("--die-at", type=int, default=None)
    trainer.add_argument("--async", dest="async_mode", action="store_const", const="async", default="disabled")
    trainer.add_argument("--record", action="store_true")
    loader = commands.add_parser("load")
    loader.add_argument("folder")
    loader.add_argument("out")
    args = parser.parse_args()
    world = args.world if args.command == "train" else 1
    port = free_port()
    if world == 1:
        _worker(0, 1, port, args)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_worker, args=(world, port, args), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
