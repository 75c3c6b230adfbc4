"""DeepSpeed checkpoints: a ``global_stepN/`` folder as ``engine.save_checkpoint`` writes it, ZeRO
stages 0 to 3, read without DeepSpeed installed and without running anything from its pickles.

What the folder holds (DeepSpeed 0.19):

- stages 0-2: ``mp_rank_00_model_states.pt``, whose ``module`` is the model's state dict in the
  dtype the model runs in; stages 1-2 add one ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``
  per data-parallel rank, holding rank r's slice of the fp32 master weights
  (``single_partition_of_fp32_groups``: per parameter group, the ranks' slices concatenated are
  the group's parameters, flattened one after another);
- stage 3: every rank writes ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``, whose ``module``
  holds an empty placeholder for every parameter (buffers are whole), and its optimizer file, whose
  ``fp32_flat_groups`` hold the weights: each parameter is padded to a multiple of the world size
  and split evenly, rank r holding the r-th piece, parameters one after another.

What is averaged: stages 0-2 average ``module`` under the model's own names: the weights the model
runs with (bf16 ones under bf16). Stages 1-2 also offer the fp32 master weights, the state dict
DeepSpeed's ``zero_to_fp32.py`` would write, as ``fp32.<name>`` (``--include 'fp32.*' --strip-prefix
fp32.``). Stage 3 has only that state dict, put back together as ``zero_to_fp32.py`` does: trainable
parameters from the flat groups, frozen ones from each rank's ``frozen_param_fragments``, tied ones
from ``shared_params``, buffers from ``module``. Each such tensor is a list of byte ranges in the
ranks' files (:class:`~.blocks.Geometry`), so a read touches only the bytes asked for, never a
whole partition. What cannot be put back together exactly is refused in one line naming
``zero_to_fp32.py``; a ``module`` of placeholders is refused before anything else looks at it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ..errors import CheckpointError, CkptavgError
from ..io.files import MappedRange, RandomAccessFile
from ..io.fs import FileSystem, folder_names, join
from ..units import numel
from .base import CheckpointReader, TensorInfo, shown_value
from .blocks import Geometry, StoredBlock
from .torch_save import StoredTensor, TensorRef, TorchSaveArchive

FP32_PREFIX = "fp32."
CONVERTER = "zero_to_fp32.py"
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_(?P<rank>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt")
_OPTIM_STATES = re.compile(r"(?P<bf16>bf16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt")
_SUFFIXES = ("model_states.pt", "optim_states.pt")


class _Inert:
    """Stands for a DeepSpeed object that holds no weights (a loss scaler, a fragment address):
    made empty and kept empty, its pickled state dropped, so nothing of it runs or survives."""

    __slots__ = ()

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __setstate__(self, _state: Any) -> None:
        pass


# The DeepSpeed classes its optimizer files pickle (found in real saves of stages 1-3, fp32 and
# bf16; DynamicLossScaler is what fp16 runs save, on GPUs, with its dtype). ZeroStageEnum is an
# int enum. A dtype is an immutable value.
_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch", name): getattr(torch, name) for name in ("float16", "bfloat16", "float32")},
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _Inert,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _Inert,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): int,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _Inert,
}


def _not_exact(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {what}; ckptavg cannot put these weights back together exactly "
        f"(DeepSpeed's {CONVERTER}, saved in the run folder, writes them as one state dict, which ckptavg merges)"
    )


@dataclass(frozen=True)
class _Files:
    """The DeepSpeed files of a step folder, by role, from their names alone."""

    model: dict[int, str]  # rank -> file name; one file, rank 0, unless ``partitioned``
    optim: dict[int, str]
    partitioned: bool  # ZeRO-3: a model-states file per rank
    unsupported: str | None  # a layout ckptavg does not read
    missing: str | None  # why the files are not (yet) a whole checkpoint

    @property
    def names(self) -> list[str]:
        return [*self.model.values(), *self.optim.values()]


def _files(fs: FileSystem, path: str) -> _Files:
    model: dict[int, str] = {}
    ranked: dict[int, str] = {}
    optim: dict[int, str] = {}
    unsupported = None
    prefixes = set()
    for name in sorted(folder_names(fs, path)):
        if not name.endswith(_SUFFIXES):
            continue
        match = _MODEL_STATES.fullmatch(name) or _OPTIM_STATES.fullmatch(name)
        if match is None or int(match["mp"]) != 0:
            what = "tensor-parallel" if match else "pipeline-parallel or expert (MoE)"
            unsupported = unsupported or f"{name} belongs to a {what} save, which ckptavg does not read"
            continue
        if name.endswith("optim_states.pt"):
            optim[int(match["rank"])] = name
            prefixes.add(match["bf16"] or "")
        elif match["rank"] is None:
            model[0] = name
        else:
            ranked[int(match["rank"])] = name
    if model and ranked:
        unsupported = unsupported or "it holds model states of both ZeRO-3 (per rank) and ZeRO 0-2 (one file)"
    missing = None
    if len(prefixes) > 1:
        missing = "optimizer files of two saves (bf16_zero_pp_rank_* and zero_pp_rank_*)"
    elif not model and not ranked:
        missing = "no model-states file (*model_states.pt)"
    elif sorted(optim) != list(range(len(optim))):
        missing = f"optimizer files of ranks {sorted(optim)} only"
    elif sorted(ranked) != list(range(len(ranked))) or (ranked and optim and len(ranked) != len(optim)):
        missing = f"model-states files of ranks {sorted(ranked)}, optimizer files of ranks {sorted(optim)}"
    return _Files(ranked or model, optim, bool(ranked), unsupported, missing)


def _get(state: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``state[key]`` if it is a ``kind`` (an unpickled file is checked before it is used)."""
    value = state.get(key) if isinstance(state, dict) else None
    if not isinstance(value, kind):
        raise _not_exact(where, f"its {key!r} is {shown_value(value)}, not what DeepSpeed writes there")
    return value


def _shapes(value: Any, what: str, where: str) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} (DeepSpeed pickles the shapes as ``torch.Size``, a tuple)."""
    if not isinstance(value, dict) or not all(
        isinstance(name, str) and isinstance(s, tuple) and all(isinstance(d, int) and d >= 0 for d in s)
        for name, s in value.items()
    ):
        raise _not_exact(where, f"its {what} is {shown_value(value)}, not parameter shapes")
    return {name: tuple(s) for name, s in value.items()}


def _tensors(archive: TorchSaveArchive, value: Any, what: str, where: str) -> dict[str, StoredTensor]:
    """{name: where its bytes are} of a state dict in ``archive``."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, TensorRef) for k, v in value.items()
    ):
        raise _not_exact(where, f"its {what} is {shown_value(value)}, not a state dict of tensors")
    return {name: archive.locate(ref, f"{where}: tensor {name!r}") for name, ref in value.items()}


def _tied(value: Any, where: str) -> dict[str, str]:
    """``shared_params``: {tied parameter: the parameter it is saved as}."""
    if not isinstance(value, dict) or not all(isinstance(a, str) and isinstance(b, str) for a, b in value.items()):
        raise _not_exact(where, f"its 'shared_params' is {shown_value(value)}, not parameter names")
    return value


@dataclass
class _ModelStates:
    """A model-states file: the model's state dict and what DeepSpeed says about its parameters.
    (Where the tensors are, not the unpickled file: a reader opens a file per rank.)"""

    file: RandomAccessFile
    module: dict[str, StoredTensor]
    buffers: set[str]
    param_shapes: list[dict[str, tuple[int, ...]]] | None  # the optimizer's parameters, per group
    frozen_shapes: dict[str, tuple[int, ...]]
    frozen_fragments: dict[str, StoredTensor]
    shared: dict[str, str]  # tied parameter -> the parameter it is saved as
    configured_stage: int  # zero_optimization.stage of the saved ds_config

    @property
    def stage(self) -> int:
        """The ZeRO stage as this file alone tells it (the optimizer files tell it better)."""
        return 0 if self.param_shapes is None else self.configured_stage

    @classmethod
    def read(cls, file: RandomAccessFile) -> _ModelStates:
        where = file.display_path
        archive = TorchSaveArchive(file, 0, file.size, where, _GLOBALS)
        state = archive.root
        module = _tensors(archive, _get(state, "module", dict, where), "'module'", where)
        mp_world = state.get("mp_world_size", 1)
        if mp_world != 1:
            raise _not_exact(where, f"it is one of {shown_value(mp_world)} tensor-parallel slices (mp_world_size)")
        buffers = _get(state, "buffer_names", list, where)
        shapes = state.get("param_shapes")
        if shapes is not None:
            shapes = [_shapes(group, "'param_shapes'", where) for group in _get(state, "param_shapes", list, where)]
        config = state.get("ds_config")
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        return cls(
            file,
            module,
            {b for b in buffers if isinstance(b, str)},
            shapes,
            _shapes(state.get("frozen_param_shapes") or {}, "'frozen_param_shapes'", where),
            _tensors(archive, state.get("frozen_param_fragments") or {}, "'frozen_param_fragments'", where),
            _tied(state.get("shared_params") or {}, where),
            stage if isinstance(stage, int) else 0,
        )

    def check_no_placeholders(self) -> None:
        """Refuse a ``module`` whose parameters are ZeRO-3's empty placeholders, which would
        otherwise average as (empty) weights."""
        known = {name: s for group in self.param_shapes or [] for name, s in group.items()} | self.frozen_shapes
        for name, stored in self.module.items():
            if name in self.buffers or numel(stored.shape) or numel(known.get(name, (1,))) == 0:
                continue
            raise _not_exact(
                self.file.display_path,
                f"'module' tensor {name!r} is an empty placeholder (shape {list(stored.shape)}), as ZeRO-3 saves "
                "parameters: the weights are in the optimizer files",
            )


@dataclass
class _OptimStates:
    """An optimizer file: this rank's slice of the fp32 master weights, per parameter group."""

    file: RandomAccessFile
    stage: int
    world: int  # the ranks the weights are partitioned over
    groups: list[StoredTensor]
    alignment_paddings: list[list[int]] | None  # stages 1-2: elements after each parameter

    @classmethod
    def read(cls, file: RandomAccessFile) -> _OptimStates:
        where = file.display_path
        archive = TorchSaveArchive(file, 0, file.size, where, _GLOBALS)
        state = _get(archive.root, "optimizer_state_dict", dict, where)
        stage = _get(state, "zero_stage", int, where)
        if stage not in (1, 2, 3):
            raise _not_exact(where, f"its zero_stage is {stage}")
        count = state.get("partition_count")  # stages 1-2: per group
        counts = count if isinstance(count, list) else [count]
        world = max(counts) if counts and all(isinstance(c, int) for c in counts) else None
        if not isinstance(world, int) or world < 1:
            raise _not_exact(where, f"its partition_count is {shown_value(count)}")
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        refs = _get(state, key, list, where)
        if not all(isinstance(ref, TensorRef) for ref in refs):
            raise _not_exact(where, f"its {key!r} is {shown_value(refs)}, not a list of tensors")
        groups = [archive.locate(ref, f"{where}: {key}[{i}]") for i, ref in enumerate(refs)]
        paddings = state.get("param_alignment_paddings")
        if paddings is not None and not (
            isinstance(paddings, list)
            and all(isinstance(p, list) and all(isinstance(n, int) and n >= 0 for n in p) for p in paddings)
        ):
            raise _not_exact(where, f"its param_alignment_paddings is {shown_value(paddings)}")
        return cls(file, stage, world, groups, paddings)


class _Flat:
    """Tensors read as one run of elements, one after another: a rank's flat groups, or the ranks'
    slices of one group."""

    def __init__(self, parts: Sequence[tuple[RandomAccessFile, StoredTensor]], where: str, shown: str) -> None:
        self.parts = list(parts)
        self.shown = shown  # the files, as a tensor read from them names them in messages
        dtypes = {stored.dtype for _, stored in parts}
        if len(dtypes) != 1:
            raise _not_exact(where, f"its flat weights are of {len(dtypes)} dtypes {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.starts = [0]
        for _, stored in parts:
            self.starts.append(self.starts[-1] + numel(stored.shape))
        self.numel = self.starts[-1]
        self.where = where

    def blocks(self, start: int, count: int, at: int) -> list[StoredBlock]:
        """Elements ``[start, start + count)`` of the run, as blocks of a flat tensor whose
        element ``at`` is the first of them."""
        if start + count > self.numel:
            raise _not_exact(self.where, f"a parameter reaches element {start + count} of {self.numel} stored")
        out = []
        for (file, stored), first, end in zip(self.parts, self.starts[:-1], self.starts[1:], strict=True):
            lo, hi = max(first, start), min(end, start + count)
            if lo < hi:
                offset = stored.offset + (lo - first) * stored.dtype.itemsize
                out.append(StoredBlock(file, (at + lo - start,), (hi - lo,), offset))
        return out


@dataclass(frozen=True)
class _Entry:
    info: TensorInfo
    geometry: Geometry  # of the flat tensor: every tensor is read as its row-major elements


class DeepSpeedReader(CheckpointReader):
    """A DeepSpeed ``global_stepN/`` folder, ZeRO stage 0 to 3 (``format_name`` says which)."""

    format_name = "deepspeed"

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return any(name.endswith(_SUFFIXES) for name in folder_names(fs, path))

    @classmethod
    def incomplete_reason(cls, fs: FileSystem, path: str) -> str | None:
        """Some ranks' files not (yet) there: by their names, or fewer optimizer files than the
        ranks the first one says the weights are partitioned over (each rank writes its own)."""
        files = _files(fs, path)
        if files.missing or files.unsupported or not files.optim:
            return files.missing
        try:
            world = _first_optim(fs, path, files).world
        except CkptavgError:
            return None  # not a matter of completeness: opening the folder says what is wrong
        return f"optimizer files of {len(files.optim)} of {world} ranks" if world > len(files.optim) else None

    @classmethod
    def folder_format(cls, fs: FileSystem, path: str) -> str:
        try:
            return f"{cls.format_name}-zero{_stage(fs, path, _files(fs, path))}"
        except CkptavgError:
            return cls.format_name  # a listing shows the folder; merging it says what is wrong

    def __init__(self, fs: FileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._open_files: list[RandomAccessFile] = []
        self._entries: dict[str, _Entry] = {}
        self._weights: set[str] = set()
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _file(self, name: str) -> RandomAccessFile:
        file = RandomAccessFile(self.fs, join(self.fs, self.path, name))
        self._open_files.append(file)
        return file

    def _open(self) -> None:
        files = _files(self.fs, self.path)
        self._names = set(files.names)
        if files.unsupported or files.missing:
            problem = files.unsupported or f"incomplete: {files.missing}"
            raise _not_exact(self.display_path, problem)
        models = [_ModelStates.read(self._file(files.model[r])) for r in sorted(files.model)]
        if files.partitioned:
            if not files.optim:
                self._refuse_placeholders_only(models[0])
            self._open_zero3(models, self._read_optims(files))
            return
        model = models[0]
        model.check_no_placeholders()
        optims = self._read_optims(files) if files.optim else []
        stage = optims[0].stage if optims else model.stage
        if stage not in (0, 1, 2):
            raise _not_exact(model.file.display_path, f"ZeRO stage {stage} does not fit its single model-states file")
        self.format_name = f"deepspeed-zero{stage}"  # type: ignore[misc]  # this folder's stage
        for name, stored in model.module.items():
            self._add(name, model.file, stored)
        self._weights = set(self._entries)
        if optims:
            self._add_fp32_masters(model, optims)

    def _read_optims(self, files: _Files) -> list[_OptimStates]:
        optims = [_OptimStates.read(self._file(files.optim[r])) for r in sorted(files.optim)]
        first = optims[0]
        for optim in optims:
            if optim.stage != (3 if files.partitioned else first.stage):
                raise _not_exact(optim.file.display_path, f"its zero_stage {optim.stage} does not fit the folder")
        if first.world != len(optims):
            raise _not_exact(
                first.file.display_path,
                f"the weights are partitioned over {first.world} ranks (partition_count) but the folder "
                f"holds {len(optims)} optimizer files",
            )
        return optims

    def _refuse_placeholders_only(self, model: _ModelStates) -> NoReturn:
        placeholders = [n for n, t in model.module.items() if n not in model.buffers and not numel(t.shape)]
        raise CheckpointError(
            f"{self.display_path}: ZeRO-3 checkpoint without its optimizer files (*_optim_states.pt), which "
            f"hold its weights: the model-states files hold only empty placeholders ({len(placeholders)} "
            f"parameters, e.g. {shown_value(placeholders[:1])}); nothing to average (DeepSpeed's {CONVERTER} "
            "needs those files too)"
        )

    def _add(self, name: str, file: RandomAccessFile, stored: StoredTensor) -> None:
        count = numel(stored.shape)
        geometry = Geometry((count,), [StoredBlock(file, (0,), (count,), stored.offset)])
        self._put(TensorInfo(name, stored.dtype, stored.shape, file.display_path), geometry)

    def _put(self, info: TensorInfo, geometry: Geometry) -> None:
        if info.name in self._entries:
            raise _not_exact(self.display_path, f"two tensors are named {info.name!r}")
        self._entries[info.name] = _Entry(info, geometry)

    def _alias(self, name: str, target: str) -> None:
        entry = self._entries[target]
        info = entry.info
        self._put(TensorInfo(name, info.dtype, info.shape, info.file), entry.geometry)

    def _add_flat(self, name: str, shape: tuple[int, ...], flat: _Flat, blocks: list[StoredBlock]) -> None:
        self._put(TensorInfo(name, flat.dtype, shape, flat.shown), Geometry((numel(shape),), blocks))

    def _add_fp32_masters(self, model: _ModelStates, optims: list[_OptimStates]) -> None:
        """ZeRO 1-2: ``fp32.<name>``, the state dict zero_to_fp32.py writes: each group's ranks'
        slices concatenated, its parameters one after another (with the alignment padding each
        is followed by); what the optimizer does not hold (buffers, frozen and tied parameters)
        as ``module`` has it."""
        where = optims[0].file.display_path
        shown = f"{self.display_path}/*_optim_states.pt"
        if model.param_shapes is None or any(len(o.groups) != len(model.param_shapes) for o in optims):
            raise _not_exact(where, "the optimizer files' parameter groups do not match 'param_shapes'")
        paddings = optims[0].alignment_paddings or [[0] * len(shapes) for shapes in model.param_shapes]
        if len(paddings) != len(model.param_shapes):
            raise _not_exact(
                where, f"{len(paddings)} groups of alignment paddings, {len(model.param_shapes)} of shapes"
            )
        for g, (shapes, pads) in enumerate(zip(model.param_shapes, paddings, strict=True)):
            flat = _Flat([(o.file, o.groups[g]) for o in optims], where, shown)
            if len(pads) != len(shapes):
                raise _not_exact(where, f"group {g} has {len(pads)} alignment paddings for {len(shapes)} parameters")
            offset = 0
            for (name, shape), pad in zip(shapes.items(), pads, strict=True):
                self._add_flat(FP32_PREFIX + name, shape, flat, flat.blocks(offset, numel(shape), 0))
                offset += numel(shape) + pad
            align = 2 * len(optims)  # what DeepSpeed pads each group to, as zero_to_fp32.py checks
            if math.ceil(offset / align) != math.ceil(flat.numel / align):
                raise _not_exact(where, f"group {g} holds {flat.numel} elements, its parameters {offset}")
        for name in model.module:
            tied = FP32_PREFIX + model.shared.get(name, "")
            if FP32_PREFIX + name not in self._entries:
                self._alias(FP32_PREFIX + name, tied if tied in self._entries else name)

    def _open_zero3(self, models: list[_ModelStates], optims: list[_OptimStates]) -> None:
        """Every parameter as zero_to_fp32.py puts it together, in ``module``'s order."""
        self.format_name = "deepspeed-zero3"  # type: ignore[misc]
        first = models[0]
        where = optims[0].file.display_path
        world = len(optims)
        shown = f"{self.display_path}/*_optim_states.pt"
        flats = [_Flat([(o.file, g) for g in o.groups], o.file.display_path, shown) for o in optims]
        sizes = [numel(g.shape) for g in optims[0].groups]
        for optim in optims:
            if [numel(g.shape) for g in optim.groups] != sizes:
                raise _not_exact(optim.file.display_path, "its flat groups differ in size from rank 0's")
        entries: dict[str, tuple[tuple[int, ...], _Flat, list[StoredBlock]]] = {}
        offset = 0
        for group in first.param_shapes or []:
            for name, shape in group.items():
                count, part = numel(shape), math.ceil(numel(shape) / world)
                blocks = []
                for rank, flat in enumerate(flats):
                    here = max(0, min(part, count - rank * part))
                    blocks += flat.blocks(offset, here, rank * part)
                if name in entries:
                    raise _not_exact(where, f"parameter {name!r} is listed twice in 'param_shapes'")
                entries[name] = (shape, flats[0], blocks)
                offset += part
        if offset != flats[0].numel:
            raise _not_exact(where, f"the flat groups hold {flats[0].numel} elements per rank, the parameters {offset}")
        for name, shape in first.frozen_shapes.items():
            fragments = []
            for model in models:
                if name not in model.frozen_fragments:
                    raise _not_exact(model.file.display_path, f"frozen parameter {name!r} has no fragment here")
                fragments.append((model.file, model.frozen_fragments[name]))
            flat = _Flat(fragments, first.file.display_path, f"{self.display_path}/*_model_states.pt")
            entries[name] = (shape, flat, flat.blocks(0, numel(shape), 0))
        for name in [*first.module, *entries]:
            if name in self._entries:
                continue
            if name in entries:
                self._add_flat(name, *entries[name])
            elif name in first.buffers:
                self._add(name, first.file, first.module[name])
            elif first.shared.get(name) in entries:
                self._add_flat(name, *entries[first.shared[name]])
            else:
                raise _not_exact(
                    first.file.display_path,
                    f"'module' tensor {name!r} is neither a buffer nor a parameter the optimizer files hold",
                )
        self._weights = set(self._entries)

    def tensors(self) -> list[TensorInfo]:
        return [entry.info for entry in self._entries.values()]

    def is_model_weight(self, name: str) -> bool:
        return name in self._weights

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        if len(buffer):
            entry = self._entries[name]
            entry.geometry.read_into(entry.info.dtype.itemsize, byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        entry = self._entries[name]
        return entry.geometry.local_view(entry.info.dtype.itemsize, byte_offset, nbytes)

    def weight_files(self) -> set[str]:
        return set(self._names)

    def close(self) -> None:
        for file in self._open_files:
            file.close()
        self._open_files.clear()


def _first_optim(fs: FileSystem, path: str, files: _Files) -> _OptimStates:
    with RandomAccessFile(fs, join(fs, path, files.optim[min(files.optim)])) as file:
        return _OptimStates.read(file)


def _stage(fs: FileSystem, path: str, files: _Files) -> int:
    """The ZeRO stage of a folder, for a listing: from its layout where that says it, else from the
    first optimizer file (zero_stage), else from the model-states file."""
    if files.partitioned:
        return 3
    if files.optim:
        return _first_optim(fs, path, files).stage
    with RandomAccessFile(fs, join(fs, path, files.model[0])) as file:
        return _ModelStates.read(file).stage
