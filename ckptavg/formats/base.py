"""The interface every checkpoint reader implements, and what all of them share.

The merge engine sees only :class:`CheckpointReader`: a list of :class:`TensorInfo` in storage
order and ``read_into`` of a byte range of one tensor.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, ClassVar, TypeGuard, TypeVar

import torch

from ..errors import CheckpointError
from ..io.files import MappedRange, read_json
from ..io.fs import FileSystem, display
from ..manifest import MANIFEST_FILE
from ..units import MAX_QUANTITY, numel

# Top-level keys of trainer state, never model weights (OLMo-core ``optim.*``, torchtitan's
# ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*``, ``train_state.*``).
NON_MODEL_PREFIXES = (
    "optimizer.",
    "optim.",
    "optimizer_states.",
    "lr_scheduler.",
    "lr_schedulers.",
    "scheduler.",
    "dataloader.",
    "train_state.",
)
# The training hook's state in a Hugging Face Trainer's checkpoint folder (the transformers
# adapter writes it there): trainer state, which no merged model carries.
HOOK_STATE_FILE = "ckptavg-hook-state.json"
# Files of a source folder that are weights, optimizer or trainer state: never copied.
NOT_COPIED = (
    HOOK_STATE_FILE,
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.distcp",
    "*.pkl",
    "trainer_state.json",
    MANIFEST_FILE,
    ".*",
)


Reader = TypeVar("Reader", bound="CheckpointReader")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What the engine needs to know of a stored tensor, without reading its data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """As given, or the list a reader found in its file: kept as the checked tuple."""
    file: str  # the file that holds it, as shown in messages
    # Computed once here: a merge asks several times per tensor, which for 100k small tensors
    # added up (a cached_property takes a lock on its first use in Python 3.11).
    numel: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every reader's check of a shape read from its file: one no writer or loader can hold
        # must not reach an output. A reader that needs the sizes to check offsets builds its
        # TensorInfo first and uses them, so that each shape is checked once.
        shape = checked_shape(self.shape, f"{self.file}: tensor {self.name!r}", self.dtype.itemsize)
        count = numel(shape)
        # Every source of a merge holds the same names: one string each, not one per source
        # (100k tensors of 8 sources held 800k copies of them).
        if type(self.name) is str:
            object.__setattr__(self, "name", sys.intern(self.name))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "numel", count)
        object.__setattr__(self, "nbytes", count * self.dtype.itemsize)


@dataclass(frozen=True)
class StoredObject:
    """A pickled entry of a checkpoint that is not a tensor (a DCP byte item: a module's extra
    state, an RNG state). Never averaged, and never unpickled here: an output that can hold it
    takes it over byte for byte from the source it carries (the newest by default)."""

    name: str
    nbytes: int
    why: str
    """Why the output carries it (for the manifest)."""


@dataclass(frozen=True)
class DcpPlacement:
    """Where a DCP output puts what it holds, so that the trainer of the source it carries loads the
    output folder as one of its own checkpoints (an OLMo-core step folder, Megatron-LM's
    ``--load`` folder). Paths are relative to the output folder, ``/``-separated."""

    folder: str = ""
    """The counterpart of the source's checkpoint folder: its files go here (Megatron:
    ``iter_NNNNNNN``); "" for the output folder itself."""
    data: str = ""
    """Where the DCP files go inside :attr:`folder` (OLMo-core: ``model_and_optim``)."""
    beside: tuple[tuple[str, bytes], ...] = ()
    """Files the output folder holds beside it, as (name, bytes): Megatron's tracker file."""

    def of(self, name: str) -> str:
        """Where a file of the source's checkpoint folder goes, relative to the output folder."""
        return f"{self.folder}/{name}" if self.folder else name

    @property
    def data_folder(self) -> str:
        """Where the DCP files go, relative to the output folder."""
        return self.of(self.data) if self.data else self.folder


@dataclass(frozen=True)
class MergedOutput:
    """What a merged output holds and how it was made, for a trainer file that the output takes
    over from a source rewritten to say so (:meth:`CheckpointReader.companion_for`)."""

    keys: frozenset[str]
    """The names of the tensors the output holds."""
    provenance: dict[str, Any]
    """The merge, as Megatron-LM's ``weighted_merge.py`` records its own in ``common.pt``."""


@dataclass(frozen=True)
class BlockRecord:
    """What a block of the training hook (``step{S}-block/``) holds: the mean of the weights
    after steps ``first_step, first_step + every, ..., step`` (``count`` of them), in each tensor's
    accumulator dtype; ``dtypes`` are the trained parameters' own, which a merge of blocks
    writes by default."""

    step: int
    block: int
    every: int
    count: int
    dtypes: dict[str, torch.dtype]

    @property
    def first_step(self) -> int:
        return self.step - (self.count - 1) * self.every

    def describe(self) -> dict[str, int]:
        """For a merge's manifest: the steps the block averages."""
        return {"first_step": self.first_step, "last_step": self.step, "every": self.every, "count": self.count}


class CheckpointReader(ABC):
    """Read access to the tensors of one checkpoint: a folder, or a file for a format whose
    checkpoints are single files (:attr:`single_file`; ``path`` is then the file's)."""

    format_name: ClassVar[str]
    single_file: ClassVar[bool] = False

    def __init__(self, fs: FileSystem, path: str) -> None:
        self.fs = fs
        self.path = path
        self.display_path = display(fs, path)

    @classmethod
    @abstractmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        """Cheap check (file names only) whether ``path`` holds this format."""

    @classmethod
    def incomplete_reason(cls, fs: FileSystem, path: str) -> str | None:
        """Why a folder of this format is not (yet) a whole checkpoint, or None when it is."""
        return None

    @classmethod
    def folder_format(cls, fs: FileSystem, path: str) -> str:
        """The format name of the folder at ``path``, as a listing shows it: a format with
        variants (DeepSpeed's ZeRO stages) reads which one, the others are their ``format_name``."""
        return cls.format_name

    @classmethod
    def stored_step(cls, fs: FileSystem, path: str) -> int | None:
        """The training step the checkpoint records inside itself, read cheaply (no tensor is
        located), for a checkpoint whose name tells none; None when it records none."""
        return None

    @abstractmethod
    def tensors(self) -> list[TensorInfo]:
        """All tensors, in the order they are stored (so sequential merging reads sequentially)."""

    def is_model_weight(self, name: str) -> bool:
        """Whether a merge averages ``name`` when the user chose no keys (weights, not optimizer
        or trainer state)."""
        return True

    @abstractmethod
    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the tensor's raw bytes starting ``byte_offset`` bytes in (and on
        past its end into the tensors :meth:`adjacent` says follow it)."""

    def adjacent(self, names: Sequence[str]) -> list[bool]:
        """For each tensor of ``names`` after the first, whether its bytes follow the previous
        one's in the same file with nothing between them. A reader that says so for a tensor
        reads on past the previous one's end, in :meth:`read_into` and :meth:`local_view`, into
        its bytes: the engine reads tensors that lie one right after another in every source as
        one range. False where the bytes are not ranges of files (pickled archives, blocks split
        across files), and by default."""
        return [False] * max(0, len(names) - 1)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        """The same bytes as :meth:`read_into` would copy, in place (a mapped range of one local
        file), or None where they are not one contiguous range of a local file (object stores,
        pickled archives, blocks split across files): the engine then reads them."""
        return None

    @abstractmethod
    def weight_files(self) -> set[str]:
        """Names of the files in the folder that hold weights (never copied to the output)."""

    def extra_files(self) -> list[str]:
        """Non-weight files of the folder that a merged output should carry (config, tokenizer).
        A single-file checkpoint has none: the files beside it are the run's, not its own."""
        return [] if self.single_file else files_to_copy(self.fs, self.path, self.weight_files())

    def companion_files(self) -> list[str]:
        """Files of the folder that its trainer needs beside the objects :meth:`carried_objects`
        lists to load the folder at all (Megatron's ``common.pt`` and ``metadata.json``): trainer
        state, taken over only by an output that holds those objects (DCP); none by default."""
        return []

    def companion_for(self, name: str, output: MergedOutput) -> bytes | None:
        """What the companion file ``name`` becomes in a merged ``output`` that carries it, where
        the file as it is would misdescribe the output; None: taken over as it is."""
        return None

    def carried_objects(self) -> list[StoredObject]:
        """The pickled entries (not tensors) that a merged output able to hold them (DCP) takes
        over from the source it carries (the newest by default), byte for byte; none by default."""
        return []

    def dcp_placement(self) -> DcpPlacement:
        """Where a DCP output that carries this checkpoint's files puts what it holds: the
        output folder itself by default."""
        return DcpPlacement()

    def read_object_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the stored bytes of the object ``name`` from ``byte_offset`` on."""
        raise KeyError(name)

    def block_record(self) -> BlockRecord | None:
        """What the checkpoint averages, where it is a block of the training hook (the mean of
        several steps) rather than one step's weights; None for every other checkpoint."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release open files."""

    def __enter__(self: Reader) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shown_value(value: Any, limit: int = 60) -> str:
    """A value from a checkpoint's own files for a message: a repr of at most about ``limit``
    characters, its start and end, however long or deeply nested the value is (a pickle nests at
    no cost; repr would recurse past the interpreter's limit) and however large the integers in
    it (Python writes none of more than 4300 digits)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply to show>"
    except ValueError:  # the digit limit: the only ValueError a repr of a checkpoint's values raises
        kind = type(value).__name__
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else f"<{kind} too large to show>"
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2) :]}"


def is_natural(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is a count, size or offset as files store them: a plain integer from 0 to
    2**63-1 (int64). ``True`` is a bool, not 1; a float or a string is a corrupt file."""
    return type(value) is int and 0 <= value <= MAX_QUANTITY


def checked_shape(value: Any, where: str, itemsize: int = 1) -> tuple[int, ...]:
    """``value`` as a tensor shape read from a file (``where`` names the file and the tensor): a
    list or tuple of :func:`is_natural` dimensions whose product, zeros counted as ones, times
    ``itemsize`` stays within 2**63-1. torch and the safetensors library multiply dimensions
    (and strides) with overflow checks, each in its own order: a shape within this bound is one
    every output can be written in and read back from; past it, even without elements, one may
    not be. Anything else is one error here."""
    if not isinstance(value, (list, tuple)) or not all(map(is_natural, value)):
        raise CheckpointError(f"{where} has shape {shown_value(value)}, not a list of integers from 0 to 2**63-1")
    extent = itemsize
    for dimension in value:
        extent *= max(dimension, 1)
        if extent > MAX_QUANTITY:  # checked as it grows: a thousand dimensions of 2**62 stay cheap
            raise CheckpointError(
                f"{where} has shape {shown_value(list(value))}: its dimensions (zeros aside) times its element size "
                "exceed 2**63-1, which no loader can hold"
            )
    return tuple(value)


def plain_file_name(name: Any, where: str, suffix: str = "") -> str:
    """``name`` if it is a plain file name (ending in ``suffix``): never trust paths inside index
    or metadata files, which could point out of the checkpoint's folder. A plain name that is a
    symbolic link out of the folder is refused when the file is opened
    (:func:`ckptavg.io.files.local_file_inside_folder`, called by ``RandomAccessFile``)."""
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or name in (".", "..")
        or not name.endswith(suffix)
    ):
        raise CheckpointError(
            f"{where}: refusing file name {shown_value(name, 240)} (not a plain {suffix or 'file'} name in this folder)"
        )
    return name


def read_weight_map(fs: FileSystem, path: str, suffix: str = "") -> dict[str, set[str]]:
    """{shard file name: its tensor names} of a transformers index (``*.index.json``), sorted by
    file name; every file name a plain name in the index's folder."""
    shown = display(fs, path)
    index = read_json(fs, path, "an index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{shown}: not an index (no weight_map object listing tensors)")
    shards: dict[str, set[str]] = {}
    for tensor_name, file_name in weight_map.items():
        # Each file name checked once: an index names a few files for up to 100k tensors.
        if type(file_name) is not str or file_name not in shards:
            shards[plain_file_name(file_name, shown, suffix)] = set()
        shards[file_name].add(tensor_name)
    return dict(sorted(shards.items()))


def files_to_copy(fs: FileSystem, source_dir: str, weight_files: Iterable[str]) -> list[str]:
    """Top-level non-weight files of a source folder (config, tokenizer, generation config).

    A symbolic link to a file counts (fsspec lists it as "other"): one into the same folder is
    copied, and :func:`ckptavg.io.atomic.copy_file` refuses one that leaves it, rather than dropping it silently."""
    skip = set(weight_files)
    names = []
    for entry in fs.ls(source_dir, detail=True):
        if entry.get("type") != "file" and not (entry.get("islink") and fs.isfile(entry["name"])):
            continue
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if name in skip or any(fnmatch(name, pattern) for pattern in NOT_COPIED):
            continue
        names.append(name)
    return sorted(names)
