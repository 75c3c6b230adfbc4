"""Output formats of a merge: safetensors (Hugging Face shards and index), ``dcp``
(``torch.distributed.checkpoint``) and ``pt`` (``torch.save`` shards and index), each an
:class:`OutputFormat`."""

from __future__ import annotations

from ...errors import ConfigError
from ...io.fs import FileSystem, display
from .base import OUTPUT_FORMATS, OutputFormat, ShardSink
from .safetensors import SafetensorsOutput
from .torch import DcpOutput, PtOutput


def make_output_format(
    name: str,
    fs: FileSystem,
    folder: str,
    shown: str | None = None,
    source_format: str | None = None,
    fsync: bool = True,
) -> OutputFormat:
    """The writer of format ``name`` (safetensors, dcp or pt) for the folder ``folder``.

    ``source_format`` is the newest source's format name: a DCP output of an OLMo-core run goes
    into ``model_and_optim/``, where OLMo-core's loader looks for it. ``fsync``: sync every file to
    a local disk as it is closed."""
    classes: dict[str, type[OutputFormat]] = {cls.name: cls for cls in (SafetensorsOutput, DcpOutput, PtOutput)}
    if name not in classes:
        raise ConfigError(f"unknown output format {name!r} (choose from {', '.join(OUTPUT_FORMATS)})")
    return classes[name](fs, folder, shown or display(fs, folder), source_format, fsync)


__all__ = ["OUTPUT_FORMATS", "OutputFormat", "ShardSink", "make_output_format"]
