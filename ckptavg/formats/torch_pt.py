"""``torch.save`` state dicts: ``pytorch_model.bin`` (sharded with an index, as transformers
writes it), or a folder's single ``*.pt`` / ``*.pth`` / ``*.bin`` file.

Files are read as byte-range tables (:mod:`.torch_save`), never with ``torch.load``: a file whose
unpickling would import code is refused before anything runs, and memory stays bounded whatever
the file size, locally and on object stores alike. Nested dicts (``{"model": sd, "step": 3}``)
give dotted keys (``model.<fqn>``); numbers, strings and lists in them are not weights.
"""

from __future__ import annotations

from fnmatch import fnmatch

from ..errors import CheckpointError
from ..io.files import MappedRange, RandomAccessFile
from ..io.fs import FileSystem, folder_names, join
from .base import NON_MODEL_PREFIXES, CheckpointReader, TensorInfo, read_weight_map
from .torch_save import StoredTensor, read_tensor_table

SINGLE_FILE = "pytorch_model.bin"
INDEX_FILE = "pytorch_model.bin.index.json"
PATTERNS = ("*.pt", "*.pth", "*.bin")
# What a transformers Trainer saves beside the weights: never the weights themselves.
NOT_WEIGHTS = ("optimizer.pt", "scheduler.pt", "rng_state*.pth", "training_args.bin", "scaler.pt")


def _weight_files(fs: FileSystem, path: str) -> list[str]:
    """The one weight file of a folder without an index (several would be ambiguous)."""
    names = folder_names(fs, path)
    if SINGLE_FILE in names:
        return [SINGLE_FILE]
    return sorted(
        n
        for n in names
        if any(fnmatch(n, p) for p in PATTERNS)
        and not any(fnmatch(n, p) for p in NOT_WEIGHTS)
        and fs.isfile(join(fs, path, n))
    )


class TorchReader(CheckpointReader):
    format_name = "pt"

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return fs.isfile(join(fs, path, INDEX_FILE)) or len(_weight_files(fs, path)) == 1

    def __init__(self, fs: FileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._files: dict[str, RandomAccessFile] = {}
        self._tensors: dict[str, tuple[TensorInfo, RandomAccessFile, StoredTensor]] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        index_path = join(self.fs, self.path, INDEX_FILE)
        expected: dict[str, set[str]] | None = None
        if self.fs.isfile(index_path):
            expected = read_weight_map(self.fs, index_path)
            self._names = [*expected, INDEX_FILE]
        else:
            self._names = _weight_files(self.fs, self.path)
            if len(self._names) != 1:
                raise CheckpointError(f"{self.display_path}: expected one *.pt/*.pth/*.bin file, found {self._names}")
        for name in self._names:
            if name == INDEX_FILE:
                continue
            file_path = join(self.fs, self.path, name)
            if not self.fs.isfile(file_path):
                raise CheckpointError(f"{self.display_path}/{name}: missing (listed in the index)")
            file = RandomAccessFile(self.fs, file_path)
            self._files[name] = file
            table = read_tensor_table(file, 0, file.size, file.display_path)
            if "" in table:
                raise CheckpointError(f"{file.display_path}: holds a bare tensor, not a state dict")
            if expected is not None and set(table) != expected[name]:
                odd = sorted(set(table) ^ expected[name])[0]
                where = "in the file, not in the index" if odd in table else "in the index, not in the file"
                raise CheckpointError(f"{file.display_path}: tensor {odd!r} is {where}")
            for key, stored in sorted(table.items(), key=lambda item: item[1].offset):
                if key in self._tensors:
                    raise CheckpointError(
                        f"{file.display_path}: tensor {key!r} is stored twice (also in {self._tensors[key][0].file})"
                    )
                self._tensors[key] = (TensorInfo(key, stored.dtype, stored.shape, file.display_path), file, stored)

    def tensors(self) -> list[TensorInfo]:
        return [info for info, _, _ in self._tensors.values()]

    def is_model_weight(self, name: str) -> bool:
        return not name.startswith(NON_MODEL_PREFIXES)

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        _, file, stored = self._tensors[name]
        file.read_into(stored.offset + byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        _, file, stored = self._tensors[name]
        return file.local_view(stored.offset + byte_offset, nbytes)

    def weight_files(self) -> set[str]:
        return set(self._names)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
