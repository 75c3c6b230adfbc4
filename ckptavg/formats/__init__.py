"""One reader per on-disk checkpoint format, behind one small interface (:mod:`.base`), and the
writers of merged outputs (:mod:`.writers`).

The merge engine sees only :class:`CheckpointReader`: a list of :class:`TensorInfo` in storage
order and ``read_into`` of a byte range of one tensor. A new format is a new module here and
one entry in :func:`_readers`; nothing above this package changes. A checkpoint is a folder,
or a file for the formats that save one file per checkpoint (:attr:`CheckpointReader.single_file`).
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..io.fs import FileSystem, display
from .base import NON_MODEL_PREFIXES, NOT_COPIED, CheckpointReader, StoredObject, TensorInfo, files_to_copy
from .dcp import DcpReader, HyperParallelReader, MegatronLoadFolderReader, MegatronReader, OlmoCoreReader
from .deepspeed import DeepSpeedReader
from .lightning import LightningReader
from .parts import BlockReader, PartsReader
from .safetensors import SafetensorsReader
from .torch_pt import TorchReader


def _readers() -> list[type[CheckpointReader]]:
    # OLMo-core, Megatron and HyperParallel before plain DCP, DeepSpeed before plain .pt files, and
    # the hook's blocks before its other rank-file folders, which would also claim their folders
    # (and read ZeRO-3's placeholders as weights, a block's means as one step's). Lightning's
    # readers take single files, the others folders.
    return [
        SafetensorsReader,
        BlockReader,
        PartsReader,
        OlmoCoreReader,
        MegatronReader,
        MegatronLoadFolderReader,
        HyperParallelReader,
        DcpReader,
        DeepSpeedReader,
        TorchReader,
        LightningReader,
    ]


def detect_format(fs: FileSystem, path: str, single_file: bool | None = None) -> type[CheckpointReader] | None:
    """The reader class for the checkpoint at ``path`` (a file if ``single_file``, else a folder;
    asked of ``fs`` when None), or None when none applies."""
    if single_file is None:
        single_file = fs.isfile(path)
    for reader in _readers():
        if reader.single_file == single_file and reader.detect(fs, path):
            return reader
    return None


def open_checkpoint(fs: FileSystem, path: str) -> CheckpointReader:
    """A reader of the checkpoint (folder or file) at ``path``, in whichever format it holds."""
    single_file = fs.isfile(path)
    reader = detect_format(fs, path, single_file)
    if reader is None:
        what = "not a checkpoint file ckptavg reads" if single_file else "no supported checkpoint found in this folder"
        raise CheckpointError(f"{display(fs, path)}: {what}")
    return reader(fs, path)


__all__ = [
    "NON_MODEL_PREFIXES",
    "NOT_COPIED",
    "CheckpointReader",
    "StoredObject",
    "TensorInfo",
    "detect_format",
    "files_to_copy",
    "open_checkpoint",
]
