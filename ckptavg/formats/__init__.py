"""One reader per on-disk checkpoint format, behind one small interface (:mod:`.base`), and the
writers of merged outputs (:mod:`.writers`).

The merge engine sees only :class:`CheckpointReader`: a list of :class:`TensorInfo` in storage
order and ``read_into`` of a byte range of one tensor. A new format is a new module here and
one entry in :func:`_readers`; nothing above this package changes.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..io.fs import FileSystem, display
from .base import NON_MODEL_PREFIXES, NOT_COPIED, CheckpointReader, StoredObject, TensorInfo, files_to_copy
from .dcp import DcpReader, HyperParallelReader, MegatronReader, OlmoCoreReader
from .parts import PartsReader
from .safetensors import SafetensorsReader
from .torch_pt import TorchReader


def _readers() -> list[type[CheckpointReader]]:
    # OLMo-core, Megatron and HyperParallel before plain DCP, which would also claim their folders.
    return [SafetensorsReader, PartsReader, OlmoCoreReader, MegatronReader, HyperParallelReader, DcpReader, TorchReader]


def detect_format(fs: FileSystem, path: str) -> type[CheckpointReader] | None:
    """The reader class for the checkpoint folder at ``path``, or None when none applies."""
    for reader in _readers():
        if reader.detect(fs, path):
            return reader
    return None


def open_checkpoint(fs: FileSystem, path: str) -> CheckpointReader:
    """A reader of the checkpoint folder at ``path``, in whichever format it holds."""
    reader = detect_format(fs, path)
    if reader is None:
        raise CheckpointError(f"{display(fs, path)}: no supported checkpoint found in this folder")
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
