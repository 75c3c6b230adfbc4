"""PyTorch Lightning checkpoints: one ``.ckpt`` file per save (``ModelCheckpoint``), all of a
run in one folder: ``epoch=0-step=10.ckpt``, ``epoch=1-step=20.ckpt``, ``last.ckpt``.

A ``.ckpt`` is a ``torch.save`` archive of a dict: ``state_dict`` (the LightningModule's weights
and buffers, keyed as the module names them), and the trainer's ``optimizer_states``,
``lr_schedulers``, ``callbacks``, ``loops``, ``hyper_parameters``, ``epoch``, ``global_step``.
It is read as a byte-range table (:mod:`.torch_save`), never with ``torch.load``. Lightning
pickles hyper-parameters and callback state of any class (``pathlib.Path``, numpy scalars, the
user's own config classes): outside ``state_dict`` every such global stands as an object that
imports and runs nothing and is never read; inside it, one refuses the file, naming it.

Keys: those of ``state_dict`` under their own names (what ``load_state_dict`` of the module
takes), averaged by default; tensors in the other dicts under dotted names (``callbacks.<state
key>.best_score``), never averaged unless ``--include`` chooses them.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from ..io.files import MappedRange, RandomAccessFile
from ..io.fs import FileSystem
from .base import CheckpointReader, TensorInfo, shown_value
from .torch_save import StoredTensor, TorchSaveArchive

SUFFIX = ".ckpt"
WEIGHTS = "state_dict"


def _open_archive(file: RandomAccessFile) -> tuple[TorchSaveArchive, dict[Any, Any]]:
    """The archive of a Lightning checkpoint and its top-level dict (which holds ``state_dict``)."""
    archive = TorchSaveArchive(file, 0, file.size, file.display_path, skip_unknown=True)
    root = archive.root
    if not isinstance(root, dict) or not isinstance(root.get(WEIGHTS), dict):
        raise CheckpointError(f"{file.display_path}: not a Lightning checkpoint (no {WEIGHTS} dict)")
    return archive, root


class LightningReader(CheckpointReader):
    format_name = "lightning"
    single_file = True

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return path.endswith(SUFFIX)

    @classmethod
    def stored_step(cls, fs: FileSystem, path: str) -> int | None:
        file = RandomAccessFile(fs, path)
        try:
            _, root = _open_archive(file)
        finally:
            file.close()
        step = root.get("global_step")
        if step is None:
            return None
        # A step is an int64, as trainers count them: anything else is a damaged or hostile file
        # (a 5000-digit integer could not even be printed in a listing).
        if type(step) is not int or not 0 <= step < 2**63:
            raise CheckpointError(
                f"{file.display_path}: global_step is {shown_value(step)}, not a step from 0 to 2**63-1"
            )
        return step

    def __init__(self, fs: FileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._file = RandomAccessFile(fs, path)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        archive, root = _open_archive(self._file)
        archive.check_readable(root[WEIGHTS], WEIGHTS)
        weights = archive.tensors(root[WEIGHTS])
        # Trainer state and hyper-parameters never stop a merge: a tensor there that cannot be
        # named, read or told apart (from another, or from a weight) is left out; the others are
        # averaged only if --include asks for them.
        others = archive.tensors({key: value for key, value in root.items() if key != WEIGHTS}, lenient=True)
        self._weights = set(weights)
        stored = sorted({**others, **weights}.items(), key=lambda item: item[1].offset)
        self._tensors: dict[str, tuple[TensorInfo, StoredTensor]] = {
            key: (TensorInfo(key, entry.dtype, entry.shape, self.display_path), entry) for key, entry in stored
        }

    def tensors(self) -> list[TensorInfo]:
        return [info for info, _ in self._tensors.values()]

    def is_model_weight(self, name: str) -> bool:
        return name in self._weights

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        self._file.read_into(self._tensors[name][1].offset + byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        return self._file.local_view(self._tensors[name][1].offset + byte_offset, nbytes)

    def weight_files(self) -> set[str]:
        return {self.path.rstrip("/").rsplit("/", 1)[-1]}

    def close(self) -> None:
        self._file.close()
