"""How a merge reads, computes and writes: one object at the library's boundary, built by the
command line from its options and by the training hook from its config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..formats.base import shown_value
from ..formats.layout import DEFAULT_SHARD_SIZE
from ..formats.writers import OUTPUT_FORMATS
from ..units import parse_dtype, parse_size
from .engine import DEFAULT_CHUNK_BYTES, EngineOptions, check_chunk_bytes, check_output_dtype
from .keys import KeyFilter

_SWITCHES = ("mmap", "allow_nonfinite", "force", "keep_identical", "resume", "fsync", "remove_consumed_snapshots")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refused(name: str, value: Any, wanted: str) -> ConfigError:
    return ConfigError(f"MergeOptions.{name} must be {wanted}, got {shown_value(value)}")


COPY_FROM = ("newest", "oldest")


def copy_source(value: Any, what: str = "MergeOptions.copy_from") -> str | int:
    """``--copy-from`` checked (``what`` names it): ``newest``, ``oldest`` or a training step
    (``"1200"`` is 1200)."""
    if isinstance(value, str) and value.lower() in COPY_FROM:
        return value.lower()
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not _is_int(value) or value < 0:
        wanted = "newest, oldest or the step of a source (a whole number >= 0)"
        raise ConfigError(f"{what} must be {wanted}, got {shown_value(value)}")
    return int(value)


@dataclass(frozen=True)
class MergeOptions:
    """The options of one merge (``ckptavg merge``'s, by the same names); checked when built, so
    that a shard or chunk size no merge can use is refused before anything is read.

    Example::

        from ckptavg import KeyFilter, MergeOptions, merge

        options = MergeOptions(dtype=torch.bfloat16, output_format="dcp", keys=KeyFilter(strip_prefix="model."))
        merge("runs/llama", merge_step=5000, window=100, options=options)
    """

    dtype: torch.dtype | None = None
    """Output dtype of floating tensors (``--dtype``); None keeps each input tensor's."""
    shard_size: int = DEFAULT_SHARD_SIZE
    """Largest output file, in bytes (``--shard-size``); a larger tensor gets a file of its own."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Accumulator bytes per chunk (``--chunk-size``): a merge holds a handful of chunks, whatever
    the model's size."""
    workers: int = 2
    """Reader threads (``--workers``)."""
    threads: int | None = None
    """Arithmetic threads (``--threads``); None: the cores this process may use, divided among
    the processes of a torchrun/srun merge on its node (one for a merge in a background thread,
    as the training hook's)."""
    mmap: bool = False
    """Read local files in place through memory mappings (``--mmap``) instead of copying them in
    with positional reads, which measured faster (docs/notes/benchmarks-history.md)."""
    output_format: str = "safetensors"
    """``safetensors`` (Hugging Face shards and index), ``dcp`` (``torch.distributed.checkpoint``)
    or ``pt`` (``pytorch_model*.bin`` and index) (``--format``)."""
    keys: KeyFilter = field(default_factory=KeyFilter)
    """Which keys are averaged, and their output names (``--include``, ``--exclude``,
    ``--strip-prefix``); by default each format's model weights."""
    allow_nonfinite: bool = False
    """Average NaN and Inf values instead of refusing them (``--allow-nonfinite``)."""
    force: bool = False
    """Replace an existing output folder, once the new one is complete (``--force``): the one
    that was there when the merge started, not one another process put there meanwhile. Without
    it, an output that a run of this same merge published (its manifest records the same
    fingerprint) is kept as it is, reading nothing, and any other existing output is refused."""
    keep_identical: bool = False
    """With ``force``: once the new output is complete, keep a published output whose manifest
    equals the new one (every file's sha256 included) as it is, and drop the new one. The
    training hook redoes a merge after a resume this way: its inputs were trained again, so only
    the finished bytes can tell whether they changed (on object stores ``force`` removes the old
    output before writing, so there it is always replaced)."""
    resume: bool = False
    """Pick up an interrupted run of the same merge: reuse its finished files whose sha256 still
    matches, redo the rest (``--resume``)."""
    fsync: bool = True
    """Make every file of a local output durable before the output is published (``--no-fsync``
    turns it off)."""
    remove_consumed_snapshots: bool = False
    """Once the output is published, synced and verified, remove the inputs that are training
    hook snapshots (``stepN-snapshot/``); trainer checkpoints are always kept
    (``--remove-consumed-snapshots``)."""
    copy: tuple[str, ...] = ()
    """Globs over output tensor names (``--copy``): matching tensors are taken from one source
    (``copy_from``) instead of averaged, and may differ between the sources: MoE ``expert_bias``
    buffers, counters, Transformer Engine ``_extra_state``, integer tensors that change."""
    copy_from: str | int = "newest"
    """Which source ``copy`` takes from (``--copy-from``): ``newest``, ``oldest``, or the training
    step of one of the merge's sources."""

    def __post_init__(self) -> None:
        """Every field checked, and spelled as on the command line where it may be (``dtype="bf16"``,
        ``shard_size="2GB"``, ``output_format="DCP"``): one :class:`ConfigError` naming the field
        and the value, not an error from deep inside a merge."""
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", parse_dtype(self.dtype, "MergeOptions.dtype"))
        elif self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise _refused("dtype", self.dtype, "a dtype (torch.bfloat16, 'bf16', ...) or None")
        for name in ("shard_size", "chunk_bytes"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, parse_size(value, f"MergeOptions.{name}"))
            elif not _is_int(value):
                raise _refused(name, value, "a byte count (an integer, or '5GB', '512MiB', ...)")
        if self.shard_size <= 0:
            raise ConfigError(f"shard size must be positive, got {self.shard_size}")
        if not _is_int(self.workers) or self.workers < 1:
            raise _refused("workers", self.workers, "an integer of at least 1")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ConfigError(f"--threads must be at least 1, got {self.threads!r}")
        if not isinstance(self.output_format, str) or self.output_format.lower() not in OUTPUT_FORMATS:
            raise _refused("output_format", self.output_format, f"one of {', '.join(OUTPUT_FORMATS)}")
        object.__setattr__(self, "output_format", self.output_format.lower())
        if not isinstance(self.keys, KeyFilter):
            raise _refused("keys", self.keys, "a KeyFilter")
        if isinstance(self.copy, str) or not all(isinstance(p, str) and p for p in self.copy):
            raise _refused("copy", self.copy, "a tuple of globs ('*.expert_bias', ...)")
        object.__setattr__(self, "copy", tuple(self.copy))
        object.__setattr__(self, "copy_from", copy_source(self.copy_from))
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise _refused(name, getattr(self, name), "True or False")
        if self.remove_consumed_snapshots and not self.fsync:
            raise ConfigError(
                "removing the consumed snapshots needs the output synced to disk first; drop --no-fsync (fsync=False)"
            )
        if self.remove_consumed_snapshots and self.allow_nonfinite:
            # The check before removal refuses NaN and Inf, so such an output could never pass it.
            raise ConfigError(
                "removing the consumed snapshots needs an output verified finite; drop --allow-nonfinite "
                "(allow_nonfinite=True)"
            )
        if self.dtype is not None:
            check_output_dtype(self.dtype, "dtype")
        check_chunk_bytes(self.chunk_bytes)

    def engine_options(self, dtype: torch.dtype | Mapping[str, torch.dtype] | None) -> EngineOptions:
        """The engine's knobs of this merge, with the output ``dtype`` it settled on (one place,
        so that an option the engine gains reaches every kind of merge)."""
        return EngineOptions(
            dtype=dtype,
            allow_nonfinite=self.allow_nonfinite,
            chunk_bytes=self.chunk_bytes,
            workers=self.workers,
            threads=self.threads,
            mmap=self.mmap,
            copy=self.copy,
        )


@dataclass(frozen=True)
class PublishExtras:
    """What the training hook adds to a merge of its own running sums (a plain merge of
    checkpoints needs none of it)."""

    totals: Sequence[float] | None = None
    """The weight each source already sums (the step count, or the summed weights of a
    weighting scheme): the mean divides by their total, and the weighting only describes them."""
    dtypes: Mapping[str, torch.dtype] | None = None
    """Output dtype per tensor name (each trained parameter's own), where no ``dtype`` is set."""
    sources: list[dict[str, Any]] | None = None
    """The manifest's source list, instead of one entry per reader."""
    accumulate_policy: str | None = None
    """How the sums were accumulated, for the manifest's dtype policy."""
    extra_files: Mapping[str, bytes] = field(default_factory=dict)
    """Files (name to bytes, e.g. a ``config.json``) written into the output besides the newest
    source's own."""
    method: Mapping[str, Any] | None = None
    """What the source is when it is no weighted sum of steps (the hook's running EMA): recorded
    as the manifest's method (its ``scheme``) and weighting, instead of a weighting scheme's."""
