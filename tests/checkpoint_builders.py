"""Real trainer checkpoints, written by the trainers' own writers, for the reader tests.

Every builder writes one checkpoint of a tiny model whose weights depend only on
``(seed, step, scale)`` -- each parameter is ``base + step * scale * noise`` (``base`` and
``noise`` drawn from ``seed``), followed by one real AdamW step where the format carries an
optimizer -- and returns the full (unsharded) model weights exactly as saved, keyed the way a
reader of that format names them (the flattened, dotted key). So several steps of one "run"
differ numerically and a test can compute a float64 reference mean from the returned tensors.

Observed with torch 2.13, ai2-olmo-core 3.0.0, transformers 5.24 (see
``tests/test_checkpoint_builders.py``, which checks every statement below that concerns files):

OLMo-core -- :func:`write_olmo_core_checkpoint`, ``run_dir/stepN/``
    Written by OLMo-core's own ``olmo_core.train.checkpoint.Checkpointer.save(dir, train_module,
    train_state, ephemeral=...)``: it writes everything into ``stepN-tmp/`` (``train/rank0.pt``,
    then ``model_and_optim/``), renames ``stepN-tmp`` to ``stepN``, and only then writes
    ``stepN/.metadata.json`` = ``{"ephemeral": false, "version": "3.0.0"}`` (the completeness
    marker; ``Checkpointer.dir_is_checkpoint`` requires it). ``config.json`` is written after
    that, by ``Checkpointer.write_file`` as the trainer's ``ConfigSaverCallback`` does in
    ``post_checkpoint_saved``. The train module is a stand-in with the exact
    ``state_dict_to_save()`` of ``TransformerTrainModule`` (``get_model_state_dict`` /
    ``get_optimizer_state_dict`` with ``StateDictOptions(flatten_optimizer_state_dict=True,
    cpu_offload=True)``); the model is a real OLMo-core ``Transformer``
    (``TransformerConfig.olmo2_1M(vocab_size=128, n_layers=2)``, 25 tensors, 23k parameters).

    - ``model_and_optim/.metadata`` + ``__0_{k}.distcp`` with ``k = 0 .. thread_count-1``:
      OLMo-core's ``RemoteFileSystemWriter`` spreads one rank's items over one file per writer
      thread. The builder passes ``thread_count=2``; the trainer's default (``None``) is
      ``get_default_thread_count()``, 6 files on the 2-core development machine.
    - keys: ``model.<fqn>`` (the dtype of the model, float32 by default),
      ``optim.state.<fqn>.step`` (float32 scalar), ``optim.state.<fqn>.exp_avg`` and
      ``.exp_avg_sq`` (model dtype), and ``optim.param_groups.<fqn>.<lr|betas|eps|weight_decay|
      amsgrad|maximize|foreach|capturable|differentiable|fused|decoupled_weight_decay>``
      (``BytesStorageMetadata``, pickled Python values).
    - each tensor entry's bytes ``(relative_path, offset, length)`` are a whole ``torch.save``
      archive of that tensor (also true of torch's own ``FileSystemWriter``), not raw data.
    - the ``.metadata`` pickle names ``olmo_core.distributed.checkpoint.filesystem._StorageInfo``
      (OLMo-core's copy of torch's class) besides ``torch.distributed.checkpoint.metadata``
      classes (``Metadata``, ``TensorStorageMetadata``, ``TensorProperties``,
      ``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``MetadataIndex``, ``StorageMeta``,
      ``_MEM_FORMAT_ENCODING``), ``torch.float32``/``torch.bfloat16``, ``torch.Size`` and
      ``torch.serialization._get_layout``: plain ``pickle.load`` needs OLMo-core installed, and
      torch's ``FileSystemReader`` cannot read the folder even then (OLMo-core's ``_StorageInfo``
      has no ``transform_descriptors``: ``AttributeError``); OLMo-core's
      ``RemoteFileSystemReader`` can (:func:`load_dcp` picks it).
    - ``Checkpointer.save`` uses DCP plan caching, and torch reuses a cached plan without
      comparing dtypes: see :func:`_clear_save_plan_cache`, called before every save here.
    - ``train/rank0.pt``: ``torch.save`` of the trainer state (``global_step``,
      ``global_train_tokens_seen``, ``data_loader``, ``rng`` with numpy arrays, ...) -- not
      loadable with ``weights_only=True``.
    - incomplete variants (``incomplete=``): ``"no_marker"`` (``stepN/`` with ``train/`` and
      ``model_and_optim/`` but no ``.metadata.json`` or ``config.json``: a crash between the
      rename and the marker), ``"tmp"`` (only
      ``stepN-tmp/``: a crash before the rename), ``"partial"`` (``stepN-tmp/`` whose
      ``model_and_optim/`` lacks ``.metadata``: a crash during the DCP write).

    Loading back: ``olmo_core.distributed.checkpoint.load_model_and_optim_state(dir, model,
    optim=None)`` loads a ``model_and_optim`` folder (any DCP folder with ``model.*`` keys)
    into ``model`` in place; with ``optim=None`` it requests (and needs) only the ``model.*``
    keys, so a merged output without optimizer state loads too. :func:`load_olmo_core_model`
    wraps it. Saving without the trainer: ``save_model_and_optim_state(dir, model, optim)``
    (the same ``model.*`` and ``optim.state.<fqn>.*`` keys, but unless
    ``flatten_optimizer_state=True`` the param groups are ``optim.param_groups.0.<option>`` and
    ``optim.param_groups.0.params``, the list of fqns).
    ``Checkpointer.load(dir, train_module)`` is the trainer's loader (needs a train module).

torchtitan -- :func:`write_torchtitan_run` / :func:`write_torchtitan_checkpoint`, ``run_dir/step-N/``
    ``world_size`` gloo processes, the model ``fully_shard``-ed per block and at the root (FSDP2,
    ``Shard(0)``), AdamW; saved as torchtitan's ``CheckpointManager`` does:
    ``dcp.save(states, checkpoint_id=step_dir)`` with torch's default ``FileSystemWriter``.
    ``states`` = the model state dict merged into the top level (modern torchtitan's
    ``_flattened_model_states_sd``; ``prefixed=True``: under ``"model"`` as before mid-2025),
    ``"optimizer"`` (``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` as
    torchtitan's ``OptimizersContainer``), ``"lr_scheduler"`` (``LambdaLR.state_dict()`` of the
    first scheduler), ``"dataloader"`` (``{"dp_rank_<r>": pickle bytes, "world_size": W}``) and
    ``"train_state"`` (modern: ``{"step": int, "ntokens_seen": int}``; ``prefixed=True``: the old
    ``TrainState`` with an int32 tensor ``step`` and ``BytesIO`` loss histories).

    - files: ``.metadata`` + ``__{rank}_0.distcp`` for every rank.
    - keys: ``<fqn>`` (or ``model.<fqn>``) float32; ``optimizer.state.<fqn>.exp_avg|exp_avg_sq``
      (float32, sharded like the parameter), ``optimizer.state.<fqn>.step`` (float32 scalar,
      replicated, stored once), ``optimizer.param_groups.<fqn>.<option>`` (bytes),
      ``lr_scheduler.<base_lrs|last_epoch|_step_count|_last_lr|lr_lambdas|...>`` (bytes),
      ``dataloader.dp_rank_<r>``, ``dataloader.world_size``, ``train_state.step``,
      ``train_state.ntokens_seen`` (bytes; old layout: ``train_state.step`` an int32 tensor).
    - every sharded key has one chunk per rank along dimension 0: ``tok_embeddings.weight``
      and ``output.weight`` (11 rows: 6 + 5), ``layers.0.feed_forward.w1|w3.weight`` (5 rows:
      3 + 2), ``value_head.weight`` (1 row: 1 + 0, the second rank's chunk is empty), the norms
      1-D (8 = 4 + 4), ``layers.0.feed_forward.w2.weight`` (8 x 5).
    - the chunk of the 1-row tensor on the second rank is recorded with size 0 (offsets ``(1, 0)``,
      sizes ``(0, 8)``). Replicated entries (``step`` scalars, bytes) are written once, by
      whichever rank the planner picks.
    - the ``.metadata`` pickle names only torch classes and ``pathlib.PosixPath`` (the
      ``StorageMeta.checkpoint_id``): ``torch.distributed.checkpoint.filesystem._StorageInfo``,
      the ``metadata`` classes, ``torch.float32``, ``torch.Size``, ``torch.serialization._get_layout``.
    - ``model_only=True`` saves the model keys only, in ``export_dtype`` (torchtitan's last-step
      save with ``last_save_model_only``).

Hugging Face -- :func:`write_hf_checkpoint`, ``run_dir/checkpoint-N/``
    A ``LlamaForCausalLM`` (hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 128, untied; 21
    tensors) saved with ``save_pretrained``: ``model.safetensors`` or, ``sharded=True``,
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, plus
    ``config.json`` and ``generation_config.json``. transformers 5 has no
    ``safe_serialization=False`` any more; ``safe_serialization=False`` writes what transformers
    4 wrote: ``pytorch_model.bin`` (``torch.save`` of the state dict) or
    ``pytorch_model-0000i-of-0000n.bin`` + ``pytorch_model.bin.index.json`` (same
    ``split_torch_state_dict_into_shards`` plan and index layout). ``trainer_files=True`` adds what
    the HF ``Trainer`` saves beside the weights: ``optimizer.pt``, ``scheduler.pt``,
    ``rng_state.pth``, ``trainer_state.json`` and ``training_args.bin`` (a pickled
    ``TrainingArguments``).

torch.save -- :func:`write_torch_save_checkpoint`, ``run_dir/stepN/model.pt``
    ``torch.save(model.state_dict())`` of a tiny model (keys ``<fqn>``), or nested
    ``{"model": state_dict, "step": N}`` (keys ``model.<fqn>``; ``optimizer=True`` adds
    ``"optimizer": optimizer.state_dict()``). :func:`write_malicious_pt` writes a ``torch.save``
    archive whose unpickling would call a function (``os.system``/``os.mkdir``/``exec``) that
    creates a marker path -- a reader must never create it.

FP8 (DeepSeek-V3 layout) -- :func:`write_fp8_checkpoint`, ``run_dir/stepN/model.safetensors``
    Each linear weight quantized by transformers' own ``FineGrainedFP8`` quantizer
    (``transformers.integrations.finegrained_fp8.Fp8Quantize``, the op its ``save_pretrained``
    reverses a quantized model with; it runs on CPU): ``X.weight`` float8_e4m3fn and beside it
    ``X.weight_scale_inv``, one inverse scale per 4 x 4 block (``weight_block_size``), fp32 or,
    with ``scale_fmt="ue8m0"``, float8_e8m0fnu: the block's largest magnitude over 448. Norms
    stay bf16. ``shared_scales=True`` gives every block the same largest magnitude at every step
    (one element of each block pinned), so that the scales of all steps are the same bits.

DCP of DTensors -- :func:`write_dtensor_dcp_runs`, ``run_dir/step-N/``
    gloo processes ``dcp.save`` the tensors of :func:`dtensor_weights` as DTensors placed as each
    :class:`DTensorRun` says (``Shard(1)`` columns, 2-D meshes, ``Replicate``; uneven chunks),
    with ``FileSystemWriter(thread_count=...)``; :func:`write_whole_dcp_run` saves them whole.

plain DCP -- :func:`write_generic_dcp`, ``run_dir/stepN/``
    ``dcp.save(state_dict, checkpoint_id=dir, no_dist=True)`` in one process: nested dicts,
    float32, bfloat16 and int64 tensors and non-tensor values; ``.metadata`` + ``__0_0.distcp``.
    Keys are flattened with dots (``weights.linear.weight``); ints, strings and lists become
    ``BytesStorageMetadata`` entries. The pickle names the same classes as torchtitan's, plus
    ``torch.bfloat16`` and ``torch.int64``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from process_group import free_port, leave_process_group
from torch import nn

Weights = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Deterministic weights


def set_weights(model: nn.Module, step: int, seed: int = 0, scale: float = 0.01) -> None:
    """Every parameter := ``base + step * scale * noise`` (in float32, then cast to its dtype);
    ``base`` and ``noise`` come from ``seed`` and the parameter's position only."""
    with torch.no_grad():
        for index, (_, param) in enumerate(model.named_parameters()):
            value = _pattern(tuple(param.shape), index, step, seed, scale)
            param.copy_(value.to(param.dtype))


def _pattern(shape: tuple[int, ...], index: int, step: int, seed: int, scale: float) -> torch.Tensor:
    base = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 7919 + index)) * 0.1
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 7919 + index + 1_000_003))
    return base + step * scale * noise


def _clone(state: dict[str, torch.Tensor], prefix: str = "") -> Weights:
    return {prefix + k: v.detach().to("cpu").clone() for k, v in state.items()}


def pickle_classes(path: str | os.PathLike) -> list[tuple[str, str]]:
    """The ``(module, name)`` of every ``find_class`` call when unpickling ``path`` (a DCP
    ``.metadata``), in order, without duplicates. Runs the pickle: only for trusted files."""
    calls: list[tuple[str, str]] = []

    class Logging(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) not in calls:
                calls.append((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Logging(f).load()
    return calls


def read_dcp_metadata(folder: str | os.PathLike) -> Any:
    """The ``Metadata`` of a DCP folder by plain ``pickle.load`` (trusted files only; OLMo-core's
    folders need ``olmo_core`` importable)."""
    with open(Path(folder) / ".metadata", "rb") as f:
        return pickle.load(f)


def load_dcp(folder: str | os.PathLike, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Tensors of a DCP folder loaded by torch's own loader into preallocated tensors
    (``dcp.load(..., no_dist=True)``); ``keys`` defaults to every tensor key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(folder)
    wanted = set(keys) if keys is not None else None
    out: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and (wanted is None or key in wanted):
            out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    reader = _reader_for(folder)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _reader_for(folder: str | os.PathLike) -> Any:
    """torch's ``FileSystemReader`` for torch-written folders, OLMo-core's reader for its own
    (torch's reader cannot use OLMo-core's ``_StorageInfo``: it lacks ``transform_descriptors``)."""
    from torch.distributed.checkpoint import FileSystemReader

    if any(module.startswith("olmo_core") for module, _ in pickle_classes(Path(folder) / ".metadata")):
        from olmo_core.distributed.checkpoint.filesystem import RemoteFileSystemReader

        return RemoteFileSystemReader(str(folder))
    return FileSystemReader(str(folder))


def strip_prefix(weights: Weights, prefix: str) -> Weights:
    """``{"model.x": t}`` -> ``{"x": t}`` for ``prefix="model."``; other keys unchanged."""
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in weights.items()}


# --------------------------------------------------------------------------------------------
# OLMo-core


def olmo_core_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A real OLMo-core ``Transformer``: ``olmo2_1M`` with 2 layers and a 128-token vocabulary."""
    return olmo_core_config().build(init_device="cpu").to(dtype)


def olmo_core_config() -> Any:
    from olmo_core.nn.transformer import TransformerConfig

    return TransformerConfig.olmo2_1M(vocab_size=128, n_layers=2)


class _OlmoTrainModule:
    """The part of ``TransformerTrainModule`` that ``Checkpointer.save`` uses, with its defaults
    (``state_dict_save_opts = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)``)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict_to_save(self, *, optim: bool | None = None) -> dict[str, Any]:
        import torch.distributed.checkpoint.state_dict as dist_cp_sd

        options = dist_cp_sd.StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
        state = {"model": dist_cp_sd.get_model_state_dict(self.model, options=options)}
        if optim is not False:
            state["optim"] = dist_cp_sd.get_optimizer_state_dict(self.model, self.optim, options=options)
        return state


def write_olmo_core_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    seed: int = 0,
    scale: float = 0.01,
    dtype: torch.dtype = torch.float32,
    ephemeral: bool = False,
    incomplete: str | None = None,
    config: bool = True,
    thread_count: int | None = 2,
    model_factory: Callable[[torch.dtype], nn.Module] | None = None,
) -> Weights:
    """OLMo-core's ``Checkpointer.save`` of a tiny OLMo-core model after one real AdamW step into
    ``run_dir/stepN`` (see the module docstring). Returns ``{"model.<fqn>": tensor}`` as saved.

    ``incomplete``: ``None``, ``"no_marker"``, ``"tmp"`` or ``"partial"``.
    """
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.utils import EnvRngStates

    if incomplete not in (None, "no_marker", "tmp", "partial"):
        raise ValueError(f"incomplete={incomplete!r}")
    run_dir = Path(run_dir)
    model = (model_factory or olmo_core_model)(dtype)
    set_weights(model, step, seed, scale)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed * 1000 + step))
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)

    train_state = {  # Trainer.state_dict()
        "global_step": step,
        "global_train_tokens_seen": step * tokens.numel(),
        "global_train_petaflops": 0.0,
        "max_steps": 10**6,
        "data_loader": {
            "dataset_fingerprint_version": "v2",
            "dataset_fingerprint": "0" * 64,
            "batches_processed": step,
            "tokens_processed": step * tokens.numel(),
            "seed": seed,
            "epoch": 1,
            "dataset_type": "fsl",
            "sequence_length": tokens.shape[1],
            "max_target_sequence_length": None,
        },
        "epoch": 1,
        "world_size": 1,
        "rng": EnvRngStates.current_state().as_dict(),
        "callbacks": {},
    }
    _clear_save_plan_cache()
    checkpointer = Checkpointer(work_dir=run_dir / ".olmo-work", save_thread_count=thread_count)
    path = run_dir / Checkpointer.checkpoint_dirname(step)
    checkpointer.save(path, _OlmoTrainModule(model, optim), train_state, ephemeral=ephemeral)
    if config:  # ConfigSaverCallback.post_checkpoint_saved, after the marker
        experiment = {
            "run_name": "ckptavg-tiny",
            "model": olmo_core_config().as_config_dict(),
            "optim": {"name": "adamw", "lr": 1e-3},
            "trainer": {"save_folder": str(run_dir), "max_duration": {"value": 10**6, "unit": "steps"}},
        }
        checkpointer.write_file(path, "config.json", json.dumps(experiment))
    shutil.rmtree(run_dir / ".olmo-work", ignore_errors=True)

    if incomplete is not None:  # a crash before the marker, so before config.json too
        (path / Checkpointer.METADATA_FNAME).unlink()
        (path / "config.json").unlink(missing_ok=True)
    if incomplete in ("tmp", "partial"):
        tmp = path.with_name(path.name + "-tmp")
        path.rename(tmp)
        if incomplete == "partial":
            (tmp / "model_and_optim" / ".metadata").unlink()
    return _clone(model.state_dict(), "model.")


def _clear_save_plan_cache() -> None:
    """Forget the DCP save plans cached by earlier saves in this process.

    ``Checkpointer.save`` saves with ``enable_plan_caching=True``, and torch's
    ``DefaultSavePlanner`` then reuses the previous save's metadata whenever the keys, shapes and
    chunks are the same -- it does not compare dtypes: a bfloat16 save after a float32 one in the
    same process gets ``.metadata`` claiming float32 (the data files hold bfloat16). A trainer
    never changes dtypes mid-run; a test that builds several checkpoints in one process does.
    """
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in dir(SavePlanner):
        if name.startswith("_cached_") and isinstance(getattr(SavePlanner, name), dict):
            getattr(SavePlanner, name).clear()


def load_olmo_core_model(
    folder: str | os.PathLike,
    model_factory: Callable[[torch.dtype], nn.Module] | None = None,
    *,
    dtype: torch.dtype | None = None,
    prefix: str = "model.",
) -> Weights:
    """Load ``folder`` (a ``stepN`` folder or its ``model_and_optim``, or any DCP folder with
    ``model.*`` keys such as a merged output) into a fresh model with OLMo-core's
    ``load_model_and_optim_state(folder, model, optim=None)`` -- model only, strict -- and return
    its state dict keyed ``prefix + fqn``. The model is built in ``dtype``, by default the
    checkpoint's dtype (the loader would cast silently into any other)."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_model_and_optim_state

    folder = Path(folder)
    if (folder / "model_and_optim" / ".metadata").is_file():
        folder = folder / "model_and_optim"
    if dtype is None:
        metadata = get_checkpoint_metadata(str(folder))
        dtypes = {
            meta.properties.dtype for key, meta in metadata.state_dict_metadata.items() if key.startswith("model.")
        }
        if len(dtypes) != 1:
            raise ValueError(f"model keys of {folder} have dtypes {dtypes}; pass dtype=")
        dtype = dtypes.pop()
    model = (model_factory or olmo_core_model)(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))  # nothing survives from initialisation unnoticed
    load_model_and_optim_state(str(folder), model)
    return _clone(model.state_dict(), prefix)


# --------------------------------------------------------------------------------------------
# torchtitan


class TitanToy(nn.Module):
    """torchtitan-Llama-like names; dimension 0 of 11, 5 and 1 rows shards unevenly on 2 ranks."""

    def __init__(self, vocab: int = 11, dim: int = 8, hidden: int = 5) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({"0": TitanBlock(dim, hidden)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.value_head = nn.Linear(dim, 1, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        return self.output(h), self.value_head(h)


class TitanBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention = nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self.attention, name, nn.Linear(dim, dim, bias=False))
        self.attention_norm = nn.RMSNorm(dim)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(dim, hidden, bias=False)
        self.feed_forward.w2 = nn.Linear(hidden, dim, bias=False)
        self.feed_forward.w3 = nn.Linear(dim, hidden, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, h = self.attention, self.attention_norm(x)
        q, k, v = a.wq(h), a.wk(h), a.wv(h)
        x = x + a.wo(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v)
        f, h = self.feed_forward, self.ffn_norm(x)
        return x + f.w2(nn.functional.silu(f.w1(h)) * f.w3(h))


def write_torchtitan_run(
    run_dir: str | os.PathLike,
    steps: Iterable[int],
    world_size: int = 2,
    prefixed: bool = False,
    *,
    seed: int = 0,
    scale: float = 0.01,
    model_only: bool = False,
    export_dtype: torch.dtype = torch.float32,
) -> dict[int, Weights]:
    """One spawn of ``world_size`` gloo processes writes ``run_dir/step-N`` for every step (see
    the module docstring). Returns ``{step: {key: full tensor}}``, keys ``<fqn>`` or, with
    ``prefixed``, ``model.<fqn>``."""
    spec = TitanRun(run_dir, tuple(steps), prefixed, seed, scale, model_only, export_dtype)
    return write_torchtitan_runs([spec], world_size)[0]


def write_torchtitan_checkpoint(
    run_dir: str | os.PathLike, step: int, world_size: int = 2, prefixed: bool = False, **kwargs: Any
) -> Weights:
    """One torchtitan checkpoint ``run_dir/step-N``; see :func:`write_torchtitan_run`."""
    return write_torchtitan_run(run_dir, [step], world_size, prefixed, **kwargs)[step]


@dataclass(frozen=True)
class TitanRun:
    """One torchtitan run for :func:`write_torchtitan_runs`: a fresh model and optimizer that
    train and save at each of ``steps`` (in increasing order)."""

    run_dir: str | os.PathLike
    steps: tuple[int, ...]
    prefixed: bool = False
    seed: int = 0
    scale: float = 0.01
    model_only: bool = False
    export_dtype: torch.dtype = torch.float32


def write_torchtitan_runs(runs: Sequence[TitanRun], world_size: int = 2) -> list[dict[int, Weights]]:
    """Several torchtitan runs written by one spawn of ``world_size`` gloo processes (a spawn
    costs ~8 s of process start-up on 2 cores, the writing well under a second per step)."""
    import torch.multiprocessing as mp

    specs = []
    for run in runs:
        Path(run.run_dir).mkdir(parents=True, exist_ok=True)
        dtype = str(run.export_dtype).removeprefix("torch.")
        specs.append(
            (str(run.run_dir), sorted(set(run.steps)), run.prefixed, run.seed, run.scale, run.model_only, dtype)
        )
    with tempfile.TemporaryDirectory(prefix="titan-weights-") as scratch:
        result = Path(scratch) / "weights.pt"
        mp.spawn(_titan_worker, args=(free_port(), world_size, specs, str(result)), nprocs=world_size, join=True)
        return torch.load(result, weights_only=True)


class _Stateful:
    def __init__(self, fn: Callable[[], dict[str, Any]]) -> None:
        self.fn = fn

    def state_dict(self) -> dict[str, Any]:
        return self.fn()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # pragma: no cover
        raise NotImplementedError


def _titan_worker(rank: int, port: int, world_size: int, specs: list[tuple], result: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out = [_titan_run(rank, world_size, *spec) for spec in specs]
    if rank == 0:
        torch.save(out, result)
    leave_process_group()


def _titan_run(
    rank: int,
    world_size: int,
    run_dir: str,
    steps: list[int],
    prefixed: bool,
    seed: int,
    scale: float,
    model_only: bool,
    export_dtype_name: str,
) -> dict[int, Weights]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    export_dtype = getattr(torch, export_dtype_name)
    model = TitanToy()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))
    plain = TitanToy()
    seen: dict[int, Weights] = {}
    for step in steps:
        set_weights(plain, step, seed, scale)
        set_model_state_dict(model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
        tokens = torch.randint(0, 11, (2, 6), generator=generator)
        logits, value = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + value.square().mean()
        loss.backward()
        optim.step()
        scheduler.step()
        optim.zero_grad(set_to_none=True)

        model_sd = get_model_state_dict(model)
        if model_only:  # torchtitan's _save_last_step with last_save_model_only
            states: dict[str, Any] = {k: v.to(export_dtype) for k, v in model_sd.items()}
        else:
            if prefixed:  # torchtitan before mid-2025: TrainState with tensors and BytesIO
                buffers = {}
                for name in ("global_avg_losses", "global_max_losses", "log_steps"):
                    buffers[name] = io.BytesIO()
                    torch.save([float(step)] if name != "log_steps" else [step], buffers[name])
                train_state = {"step": torch.tensor(step, dtype=torch.int32), **buffers}
            else:
                train_state = {"step": step, "ntokens_seen": step * tokens.numel() * world_size}
            loader_state = {f"dp_rank_{rank}": pickle.dumps({"sample_index": step * 2}), "world_size": world_size}
            states = {
                "optimizer": _Stateful(
                    lambda: get_optimizer_state_dict(
                        model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
                    )
                ),
                "lr_scheduler": _Stateful(scheduler.state_dict),
                "dataloader": _Stateful(lambda state=loader_state: state),
                "train_state": _Stateful(lambda state=train_state: state),
            }
            if prefixed:
                states["model"] = _Stateful(lambda sd=model_sd: sd)
            else:
                states.update(model_sd)
        dcp.save(states, checkpoint_id=os.path.join(run_dir, f"step-{step}"))

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            prefix = "model." if prefixed and not model_only else ""
            dtype = export_dtype if model_only else None
            seen[step] = {prefix + k: v.detach().to(dtype or v.dtype).clone() for k, v in full.items()}
    return seen


# --------------------------------------------------------------------------------------------
# Hugging Face


def hf_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def write_hf_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    sharded: bool = False,
    *,
    safe_serialization: bool = True,
    seed: int = 0,
    scale: float = 0.01,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int = "40KB",
    trainer_files: bool = False,
) -> Weights:
    """A tiny ``LlamaForCausalLM`` after one real AdamW step, saved into ``run_dir/checkpoint-N``
    with ``save_pretrained`` (safetensors; ``sharded`` with ``max_shard_size``), or as transformers
    4 wrote ``safe_serialization=False`` (``pytorch_model.bin``). Returns the state dict as saved."""
    from transformers import LlamaForCausalLM

    folder = Path(run_dir) / f"checkpoint-{step}"
    model = LlamaForCausalLM(hf_config()).to(dtype)
    set_weights(model, step, seed, scale)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed * 1000 + step))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optim.step()
    scheduler.step()
    optim.zero_grad(set_to_none=True)
    size = max_shard_size if sharded else "50GB"
    if safe_serialization:
        model.save_pretrained(folder, max_shard_size=size)
    else:
        _save_bin(model, folder, size)
    if trainer_files:
        _save_trainer_files(folder, step, optim, scheduler)
    return _clone(model.state_dict())


def _save_bin(model: nn.Module, folder: Path, max_shard_size: str | int) -> None:
    """transformers 4.x ``save_pretrained(safe_serialization=False)``: torch.save shards."""
    from huggingface_hub import split_torch_state_dict_into_shards

    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    state_dict = model.state_dict()
    split = split_torch_state_dict_into_shards(
        state_dict, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size
    )
    for file_name, names in split.filename_to_tensors.items():
        torch.save({name: state_dict[name].contiguous() for name in names}, folder / file_name)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _save_trainer_files(folder: Path, step: int, optim: torch.optim.Optimizer, scheduler: Any) -> None:
    from transformers import TrainingArguments

    torch.save(optim.state_dict(), folder / "optimizer.pt")
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    import random

    import numpy as np

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, folder / "rng_state.pth")  # Trainer._save_rng_state
    state = {"global_step": step, "epoch": 0.1 * step, "log_history": [], "max_steps": 10**6}
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    args = TrainingArguments(output_dir=str(folder.parent), report_to=[], use_cpu=True)
    torch.save(args, folder / "training_args.bin")


# --------------------------------------------------------------------------------------------
# torch.save


def write_torch_save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    name: str = "model.pt",
    nested: bool = False,
    *,
    optimizer: bool = False,
    seed: int = 0,
    scale: float = 0.01,
    dtype: torch.dtype = torch.float32,
) -> Weights:
    """``torch.save(model.state_dict())`` (or ``{"model": sd, "step": N}``) into
    ``run_dir/stepN/<name>``. Returns the weights keyed as a reader flattens them
    (``<fqn>``, nested ``model.<fqn>``)."""
    folder = Path(run_dir) / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    model = TitanToy().to(dtype)
    set_weights(model, step, seed, scale)
    state_dict = model.state_dict()
    if not nested:
        torch.save(state_dict, folder / name)
        return _clone(state_dict)
    obj: dict[str, Any] = {"model": state_dict, "step": step}
    if optimizer:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        logits, value = model(torch.arange(6).reshape(1, 6) % 11)
        (logits.float().square().mean() + value.float().square().mean()).backward()
        optim.step()
        state_dict = model.state_dict()
        obj = {"model": state_dict, "optimizer": optim.state_dict(), "step": step}
    torch.save(obj, folder / name)
    return _clone(state_dict, "model.")


class _Payload:
    """Unpickling this calls ``function(*args)``."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Callable[..., Any], tuple]:
        return self.function, self.args


def hostile_object(marker: str | os.PathLike, payload: str = "system") -> Any:
    """An object whose unpickling would create ``marker``: ``payload="system"`` calls
    ``os.system("touch <marker>")``, ``"mkdir"`` ``os.mkdir(marker)``, ``"exec"``
    ``builtins.exec(<python that creates marker>)``."""
    import builtins
    import shlex

    if payload == "system":
        return _Payload(os.system, f"touch {shlex.quote(str(marker))}")
    if payload == "mkdir":
        return _Payload(os.mkdir, str(marker))
    if payload == "exec":
        return _Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()")
    raise ValueError(f"payload={payload!r}")


def write_malicious_pt(
    path: str | os.PathLike, marker: str | os.PathLike | None = None, *, payload: str = "system"
) -> Path:
    """A ``torch.save`` archive with real-looking weights and a :func:`hostile_object` that would
    create ``marker`` (default: ``<path>.pwned`` beside it). Returns the marker path (which must
    not exist after a safe reader looked at the file)."""
    path = Path(path)
    marker = Path(marker) if marker is not None else path.with_name(path.name + ".pwned")
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = {"weight": torch.ones(3, 2), "bias": torch.zeros(3)}
    torch.save({**weights, "config": hostile_object(marker, payload)}, path)
    return marker


# --------------------------------------------------------------------------------------------
# Lightning


def write_lightning_ckpt(
    path: str | os.PathLike, state_dict: dict[str, Any], global_step: int, **trainer_state: Any
) -> None:
    """A ``.ckpt`` laid out as Lightning's ``ModelCheckpoint`` saves one, ``state_dict`` beside
    trainer state (``trainer_state`` adds or replaces top-level keys), without Lightning: for
    what Lightning itself would not write (tests/lightning_run.py saves with Lightning)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    checkpoint = {
        "epoch": 0,
        "global_step": global_step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": state_dict,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 0}}}},
        "callbacks": {"EarlyStopping{'monitor': 'loss'}": {"best_score": torch.tensor(0.5)}},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": []}],
        "lr_schedulers": [],
        "hyper_parameters": {"lr": 0.01},
        **trainer_state,
    }
    torch.save(checkpoint, path)


# --------------------------------------------------------------------------------------------
# FP8 (DeepSeek-V3 layout)

FP8_WEIGHTS = {"layers.0.mlp.down_proj.weight": (8, 12), "layers.0.self_attn.q_proj.weight": (12, 8)}


def write_fp8_checkpoint(
    run_dir: str | os.PathLike, step: int, *, shared_scales: bool, scale_fmt: str = "float", seed: int = 0
) -> Weights:
    """``run_dir/stepN/model.safetensors`` as a FineGrainedFP8 (DeepSeek-V3) checkpoint: float8
    weights quantized by transformers' ``Fp8Quantize``, their ``weight_scale_inv``, a bf16 norm.
    Returns the tensors as saved."""
    import types

    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantizer = Fp8Quantize(
        types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[4, 4], scale_fmt=scale_fmt))
    )
    tensors: Weights = {}
    for index, (name, shape) in enumerate(FP8_WEIGHTS.items()):
        weight = _pattern(shape, index, step, seed, 0.05).clamp(-0.9, 0.9)
        if shared_scales:
            weight[::4, ::4] = 1.0  # the largest magnitude of every 4 x 4 block, at every step
        tensors.update(quantizer.convert({name: weight}))
    tensors["norm.weight"] = _pattern((12,), 9, step, seed, 0.05).to(torch.bfloat16)
    folder = Path(run_dir) / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


# --------------------------------------------------------------------------------------------
# plain DCP


def write_generic_dcp(
    run_dir: str | os.PathLike, step: int, *, seed: int = 0, scale: float = 0.01, name: str | None = None
) -> dict[str, torch.Tensor]:
    """``dcp.save(state_dict, checkpoint_id=run_dir/stepN, no_dist=True)`` of a nested state dict
    with float32, bfloat16 and int64 tensors and non-tensor values. Returns every tensor, keyed
    by its flattened DCP key (``weights.linear.weight``, ``weights.embed``, ``counter``, ...)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(run_dir) / (name or f"step{step}")
    shapes = {"weights.linear.weight": (5, 3), "weights.linear.bias": (5,), "weights.embed": (7, 4), "scale": ()}
    tensors: dict[str, torch.Tensor] = {
        key: _pattern(shape, index, step, seed, scale) for index, (key, shape) in enumerate(shapes.items())
    }
    tensors["weights.embed"] = tensors["weights.embed"].to(torch.bfloat16)
    tensors["counter"] = torch.arange(4, dtype=torch.int64) + 1000 * step
    state_dict = {
        "weights": {
            "linear": {"weight": tensors["weights.linear.weight"], "bias": tensors["weights.linear.bias"]},
            "embed": tensors["weights.embed"],
        },
        "scale": tensors["scale"],
        "counter": tensors["counter"],
        "step": step,
        "note": f"generic dcp, step {step}",
        "lrs": [1e-3, 5e-4],
    }
    dcp.save(state_dict, checkpoint_id=str(folder), no_dist=True)
    return _clone(tensors)


# --------------------------------------------------------------------------------------------
# DCP of DTensors with any placements: tensor-parallel columns, 2-D meshes, uneven chunks


# Shapes and dtypes of the tensors :func:`write_dtensor_dcp_runs` saves: rows and columns that
# 2 and 4 ranks split unevenly (torch.chunk: 13 columns in 4 are 4, 4, 4, 1), a 3-D tensor.
DTENSOR_SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "wide": ((48, 520), torch.bfloat16),
    "cols": ((300, 96), torch.float32),
    "odd": ((7, 13), torch.bfloat16),
    "cube": ((6, 5, 36), torch.float32),
    "vec": ((10,), torch.float32),
}


def dtensor_weights(step: int) -> dict[str, torch.Tensor]:
    """The full tensors of step ``step`` (the same in every process, and in the test)."""
    out = {}
    for index, (name, (shape, dtype)) in enumerate(DTENSOR_SHAPES.items()):
        generator = torch.Generator().manual_seed(1000 * step + index)
        out[name] = (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
    return out


@dataclass(frozen=True)
class DTensorRun:
    """One run for :func:`write_dtensor_dcp_runs`: ``mesh`` (its shape) and the placements of
    each tensor on it, as ``Shard`` dimensions per mesh dimension (None: ``Replicate``), a
    tensor without an entry ``Shard(0)`` on every mesh dimension; ``files_per_rank`` is
    ``FileSystemWriter``'s ``thread_count``: more than one file per rank, the items split
    between them by size, so that a file holds its chunks in another order than the keys."""

    run_dir: str | os.PathLike
    mesh: tuple[int, ...]
    placements: dict[str, tuple[int | None, ...]]
    files_per_rank: int = 1


def write_dtensor_dcp_runs(runs: Sequence[DTensorRun], world_size: int, steps: Sequence[int]) -> None:
    """``run_dir/step-N`` of each run for each step, written by one spawn of ``world_size`` gloo
    processes with torch's own DCP writer (``dcp.save`` of ``distribute_tensor``-ed DTensors)."""
    import torch.multiprocessing as mp

    specs = [(str(r.run_dir), r.mesh, r.placements, r.files_per_rank) for r in runs]
    mp.spawn(_dtensor_worker, args=(free_port(), world_size, specs, list(steps)), nprocs=world_size, join=True)


def write_whole_dcp_run(run_dir: str | os.PathLike, steps: Sequence[int]) -> None:
    """The same tensors saved whole by one process (``no_dist=True``): the layout to compare with."""
    import torch.distributed.checkpoint as dcp

    for step in steps:
        dcp.save(dtensor_weights(step), checkpoint_id=str(Path(run_dir) / f"step-{step}"), no_dist=True)


def _dtensor_worker(rank: int, port: int, world_size: int, specs: list[tuple], steps: list[int]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for run_dir, mesh_shape, placements, files_per_rank in specs:
        mesh = init_device_mesh("cpu", mesh_shape)
        for step in steps:
            state = {}
            for name, full in dtensor_weights(step).items():
                dims = placements.get(name, (0,) * len(mesh_shape))
                chosen = [Replicate() if dim is None else Shard(dim) for dim in dims]
                state[name] = distribute_tensor(full, mesh, chosen)
            writer = dcp.FileSystemWriter(os.path.join(run_dir, f"step-{step}"), thread_count=files_per_rank)
            dcp.save(state, storage_writer=writer)
    leave_process_group()


# --------------------------------------------------------------------------------------------
# HyperParallel (mindspore-ai/hyper-parallel), not installable here: a writer modelled on its
# ``distributed_checkpoint`` code, with stand-ins of its metadata classes under its module names.


def _hyper_parallel_classes() -> tuple[Any, Any]:
    """Dataclasses named and shaped as HyperParallel's (``metadata.py``: ``Metadata``,
    ``TensorStorageMetadata``, ``TensorProperties`` with ``dtype: str``, ``ChunkStorageMetadata``,
    ``BytesStorageMetadata``, ``MetadataIndex``; ``storage.py``: ``StorageInfo`` with
    ``relative_path, offset, length, tensor_key``), registered under its module names so that
    pickle names them as its writer does."""
    import dataclasses
    import sys
    import types

    base = "hyper_parallel.core.distributed_checkpoint"
    if f"{base}.metadata" in sys.modules:
        return sys.modules[f"{base}.metadata"], sys.modules[f"{base}.storage"]
    metadata, storage = types.ModuleType(f"{base}.metadata"), types.ModuleType(f"{base}.storage")

    def define(module: Any, name: str, fields: list, frozen: bool = False) -> None:
        cls = dataclasses.make_dataclass(name, fields, frozen=frozen)
        cls.__module__ = module.__name__
        setattr(module, name, cls)

    define(metadata, "TensorProperties", [("dtype", str), ("requires_grad", bool, False)], frozen=True)
    define(metadata, "ChunkStorageMetadata", [("offsets", tuple), ("sizes", tuple)], frozen=True)
    define(metadata, "TensorStorageMetadata", [("properties", Any), ("size", tuple), ("chunks", list)], frozen=True)
    define(metadata, "BytesStorageMetadata", [])
    define(metadata, "MetadataIndex", [("fqn", str), ("offset", tuple), ("index", Any, None)], frozen=True)
    define(
        metadata,
        "Metadata",
        [
            ("state_dict_metadata", dict),
            ("planner_data", Any, None),
            ("storage_data", Any, None),
            ("version", str, "1.0"),
        ],
    )
    define(
        storage, "StorageInfo", [("relative_path", str), ("offset", int), ("length", int), ("tensor_key", Any, None)]
    )
    # pickle imports the module by name, parents first; none of these can be imported for real.
    for name in ("hyper_parallel", "hyper_parallel.core", base):
        sys.modules.setdefault(name, types.ModuleType(name))
    for module in (metadata, storage):
        sys.modules[module.__name__] = module
    return metadata, storage


def write_hyper_parallel_checkpoint(
    run_dir: str | os.PathLike, step: int, ranks: int = 2, *, seed: int = 0, scale: float = 0.01
) -> Weights:
    """``run_dir/global_step_N/`` as HyperParallel's ``FileSystemWriter`` lays it out: every
    parameter row-sharded over ``ranks`` (``Shard(0)``), rank r's chunks in
    ``_rank{r}_.safetensors`` (key = the flattened fqn), non-tensor values pickled into
    ``_rank{r}_.bytes``, and ``.metadata`` pickling its classes (dtype as ``"torch.float32"``,
    storage ``offset=0, length=-1`` for tensors). Returns ``{"model.<fqn>": full tensor}``."""
    import pickle

    from safetensors.torch import save_file

    md, st = _hyper_parallel_classes()
    folder = Path(run_dir) / f"global_step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    model = TitanToy()
    set_weights(model, step, seed, scale)
    weights = _clone(model.state_dict(), "model.")
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks)]
    entries, storage = {}, {}
    for key, tensor in weights.items():
        rows = torch.tensor_split(torch.arange(tensor.shape[0]), ranks) if tensor.dim() else [None]
        chunks = []
        for rank, part in enumerate(rows):
            if part is None:  # a scalar is replicated: rank 0 stores it
                local, offsets = tensor, ()
            else:
                if not len(part):
                    continue
                local = tensor[int(part[0]) : int(part[-1]) + 1]
                offsets = (int(part[0]),) + (0,) * (tensor.dim() - 1)
            per_rank[rank][key] = local.contiguous()
            chunks.append(md.ChunkStorageMetadata(offsets, tuple(local.shape)))
            storage[md.MetadataIndex(key, offsets, len(chunks) - 1)] = st.StorageInfo(
                f"_rank{rank}_.safetensors", 0, -1
            )
        entries[key] = md.TensorStorageMetadata(md.TensorProperties(str(tensor.dtype)), tuple(tensor.shape), chunks)
    extra = pickle.dumps(step)
    entries["extra_state.global_step"] = md.BytesStorageMetadata()
    storage[md.MetadataIndex("extra_state.global_step", ())] = st.StorageInfo("_rank0_.bytes", 0, len(extra))
    for rank, tensors in enumerate(per_rank):
        save_file(tensors, str(folder / f"_rank{rank}_.safetensors"))
    (folder / "_rank0_.bytes").write_bytes(extra)
    planner = {key: tuple(key.split(".", 1)) for key in entries}
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(md.Metadata(entries, planner, storage), handle)
    return weights


# --------------------------------------------------------------------------------------------
# DeepSpeed's layout without DeepSpeed: the dicts its engine torch.saves (0.19, two ranks), for
# tests that break them field by field (tests/formats/test_deepspeed.py saves with DeepSpeed).


DS_SHAPES = {"w": (3, 4), "b": (5,)}  # trainable; "f" (3,) is frozen, "h" tied to "w", "pos" a buffer


def deepspeed_states(stage: int) -> dict[str, dict[str, Any]]:
    """{file name: the dict DeepSpeed would torch.save there}."""
    shapes = [{name: torch.Size(shape) for name, shape in DS_SHAPES.items()}]
    common = {"buffer_names": ["pos"], "param_shapes": shapes, "mp_world_size": 1}
    common["ds_config"] = {"zero_optimization": {"stage": stage}}
    states: dict[str, dict[str, Any]] = {}
    if stage == 3:  # per parameter ceil(numel / 2) elements a rank: 6 + 3
        for rank in range(2):
            placeholders = {name: torch.empty(0) for name in ("w", "b", "f", "h")}
            states[f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] = {
                **common,
                "module": {**placeholders, "pos": torch.arange(4.0)},
                "frozen_param_shapes": {"f": torch.Size([3])},
                "frozen_param_fragments": {"f": torch.full((2,), float(rank))},
                "shared_params": {"h": "w"} if rank == 0 else {},
            }
            states[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = {
                "optimizer_state_dict": {"zero_stage": 3, "partition_count": 2, "fp32_flat_groups": [torch.ones(9)]}
            }
    else:  # the group's 17 elements padded to 20 and split 10 + 7 (the padding stripped)
        weights = {
            name: torch.randn(shape, generator=torch.Generator().manual_seed(1)) for name, shape in DS_SHAPES.items()
        }
        states["mp_rank_00_model_states.pt"] = {
            **common,
            "module": {**weights, "f": torch.ones(3), "h": weights["w"], "pos": torch.arange(4.0)},
            "shared_params": {"h": "w"},
        }
        for rank, size in enumerate((10, 7)):
            states[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = {
                "optimizer_state_dict": {
                    "zero_stage": stage,
                    "partition_count": [2],
                    "single_partition_of_fp32_groups": [torch.ones(size)],
                    "param_alignment_paddings": [[0, 0]],
                }
            }
    return states


def write_deepspeed_step(folder: str | os.PathLike, states: dict[str, dict[str, Any]]) -> None:
    """``folder`` holding each of ``states`` as the file it names, saved by ``torch.save``."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, state in states.items():
        torch.save(state, Path(folder) / name)
