"""Output formats of a merge: safetensors (Hugging Face shards and index), ``dcp``
(``torch.distributed.checkpoint``) and ``pt`` (``torch.save`` shards and index), each an
:class:`OutputFormat`."""

from __future__ import annotations

from ...errors import ConfigError
from ...io.fs import FileSystem, display
from ..base import CheckpointReader
from .base import OUTPUT_FORMATS, OutputFormat, ShardSink
from .safetensors import SafetensorsOutput
from .torch import DcpOutput, PtOutput


def make_output_format(
    name: str,
    fs: FileSystem,
    folder: str,
    shown: str | None = None,
    source: CheckpointReader | None = None,
    fsync: bool = True,
) -> OutputFormat:
    """The writer of format ``name`` (safetensors, dcp or pt) for the folder ``folder``.

    ``source`` is the source whose other files and trainer state the output carries (the newest
    by default; ``--copy-from``): a DCP output goes where its trainer's loader looks
    (:meth:`CheckpointReader.dcp_placement`: ``model_and_optim/`` for OLMo-core, ``iter_NNNNNNN/``
    and the tracker file for Megatron). ``fsync``: sync every file to a local disk as it is
    closed."""
    classes: dict[str, type[OutputFormat]] = {cls.name: cls for cls in (SafetensorsOutput, DcpOutput, PtOutput)}
    if name not in classes:
        raise ConfigError(f"unknown output format {name!r} (choose from {', '.join(OUTPUT_FORMATS)})")
    return classes[name](fs, folder, shown or display(fs, folder), source, fsync)


__all__ = ["OUTPUT_FORMATS", "OutputFormat", "ShardSink", "make_output_format"]
