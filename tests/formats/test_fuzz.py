"""Fuzzing of the checkpoint readers: hostile or damaged files get one clean error, nothing else.

Hypothesis mutates small valid checkpoints of each format (safetensors headers and bytes, DCP
``.metadata`` pickles and ``.distcp`` files, ``torch.save`` archives) and reads every tensor of
the result in full. Each example must either read or raise :class:`CkptavgError` with a one-line
message: any other exception, a read that outlasts its alarm, or an allocation out of proportion
to the files (a lying length field believed) fails the test.

``make test`` runs 150 derandomized examples per property (the same ones each run). A long run
explores new ones each time: ``CKPTAVG_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q
tests/test_fuzz.py`` (Linux: the allocation check reads ``/proc/self/statm``).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import io
import json
import os
import pickle
import pickletools
import re
import resource
import shutil
import signal
import struct
import sys
import tempfile
import tracemalloc
import uuid
import zipfile
import zoneinfo
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_builders import deepspeed_states
from helpers import Hang, run_cli, run_cli_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from ckptavg.errors import CkptavgError
from ckptavg.formats import _readers, open_checkpoint, pickle_scan
from ckptavg.formats.base import MergedOutput, TensorInfo
from ckptavg.formats.dcp import _allowed
from ckptavg.formats.layout import TensorSpec
from ckptavg.formats.parts import METADATA_KEY, Block, block_info, write_rank_file
from ckptavg.formats.pickle_scan import MAX_PICKLE_DEPTH, prescan
from ckptavg.formats.safetensors import DTYPES, MAX_HEADER_BYTES
from ckptavg.formats.torch_save import SmallArchives, read_tensor_table
from ckptavg.io.files import RandomAccessFile, parse_json
from ckptavg.io.fs import resolve

# open_checkpoint imports the reader modules on first use: imported now, so that no example's
# allocation peak includes an import.
_readers()

LONG_RUN = "CKPTAVG_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("CKPTAVG_FUZZ_EXAMPLES", "150"))
# Files here are a few kB: reading one takes far less than a second. The deadline reports a slow
# example; the alarm stops a hang (a deadline is only checked once an example returns).
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),
    database=None,
    # The suite replays the same examples on every run; a long run explores new ones each time.
    derandomize=not LONG_RUN,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ALARM_SECONDS = 20
# Reading a few-kB file allocates a few kB; a header length or record size believed without a
# check against the file size allocates far more. A pickle may make objects of some 50 times its
# size (one opcode byte, one tuple): the bound allows 100 times the files' size on top.
MAX_ALLOCATION = 4 * 2**20
ALLOCATION_PER_FILE_BYTE = 100
ADDRESS_SPACE_HEADROOM = 512 * 2**20
READ_CHUNK = 4096  # a multiple of every itemsize, as the engine's reads are

TENSORS = {
    "w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
    "b": torch.linspace(-2, 2, 5).bfloat16(),
    "h": torch.tensor([[0.5, -1.0], [2.0, 3.0]], dtype=torch.float16),
    "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "m": torch.tensor([True, False, True]),
    # torch.save writes these through _rebuild_tensor_v3 and an untyped storage.
    "f8": torch.linspace(-3, 3, 7).to(torch.float8_e4m3fn),
    "u": torch.tensor([1, 2, 60000], dtype=torch.int32).to(torch.uint16),
}
# An integer that Python refuses to write as text (more than 4300 digits); a pickle holds it in 2 kB.
# Drawn through a strategy that Hypothesis shows by name (its repr of HUGE would fail).
HUGE = 10**5000
huge = st.builds(lambda: HUGE) | st.builds(lambda: -HUGE)


class Blob(bytes):
    """File contents that Hypothesis prints short in its reports (print_blob gives the whole
    example back)."""

    def __repr__(self) -> str:
        return f"Blob({len(self)} bytes: {bytes(self[:80])!r}...)"


class Files(dict):
    def __repr__(self) -> str:
        return f"Files({', '.join(f'{name}: {len(data)} bytes' for name, data in self.items())})"


@contextmanager
def bounded() -> Iterator[list[int]]:
    """Fail on a hang (SIGALRM); give the peak of Python allocation (tracemalloc) inside.

    The address space is capped too, a little above its size now: an allocation of gigabytes
    fails at once with MemoryError (a test failure, unless the unpickler turns it into a clean
    error) instead of succeeding in untouched pages that the test would not notice but a smaller
    machine would.
    """

    def on_alarm(_signum: int, _frame: Any) -> None:
        raise Hang(f"reading took more than {ALARM_SECONDS} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, ALARM_SECONDS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + ADDRESS_SPACE_HEADROOM, hard))
    peak = [0]
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_listed(tensors: list[TensorInfo], size: int) -> None:
    """What a reader lists, before a byte is read, is what a merge can act on: every shape one
    that any writer can write and any loader read back (plain integers that torch lays out on
    its meta device: no bool, no size or stride past int64), and no tensor of more bytes than
    the ``size`` bytes of the files (a merge allocates by what is listed: a DCP or ``.pt``
    output gathers each tensor whole)."""
    for info in tensors:
        assert all(type(d) is int for d in info.shape), f"{info.name!r} is listed with shape {info.shape}"
        torch.empty(info.shape, dtype=info.dtype, device="meta")  # raises for a shape past int64
        assert info.nbytes <= size, f"{info.name!r} is listed with {info.nbytes} bytes, the files hold {size}"


def read_everything(folder: Path) -> str | None:
    """Open ``folder`` with the reader the CLI would pick, check what it lists
    (:func:`check_listed`) and read every byte of every tensor; the error message, or None when
    it all read. Any other exception, or an allocation out of proportion to the files, fails the
    caller. A pickle that claims more than it holds (a bytes length past its end, a memo index
    past its size) is refused before CPython's unpickler believes it, so the allocation bound
    holds for every example."""
    message = None
    # A single-file checkpoint (a Lightning .ckpt) is opened as the file.
    size = folder.stat().st_size if folder.is_file() else sum(path.stat().st_size for path in folder.iterdir())
    with bounded() as peak:
        try:
            fs, path = resolve(str(folder))
            with open_checkpoint(fs, path) as reader:
                check_listed(reader.tensors(), size)
                for info in reader.tensors():
                    buffer = memoryview(bytearray(min(info.nbytes, READ_CHUNK)))
                    for offset in range(0, info.nbytes, READ_CHUNK):
                        reader.read_into(info.name, offset, buffer[: min(READ_CHUNK, info.nbytes - offset)])
        except CkptavgError as exc:
            message = str(exc)
    if message is not None:
        assert message.isprintable(), repr(message)  # one line, as the CLI shows it
    # Checked after an error too: a lying length may be believed, allocated, and only then fail.
    limit = MAX_ALLOCATION + ALLOCATION_PER_FILE_BYTE * size
    assert peak[0] < limit, f"reading allocated {peak[0]} bytes at its peak"
    return message


@contextmanager
def checkpoint(root: Path, files: dict[str, bytes], name: str = "") -> Iterator[Path]:
    """A fresh checkpoint folder holding ``files`` (``name``d so where its name tells its format),
    removed afterwards."""
    parent = Path(tempfile.mkdtemp(dir=root))
    folder = parent / name if name else parent
    try:
        folder.mkdir(exist_ok=True)
        for file_name, data in files.items():
            (folder / file_name).write_bytes(data)
        yield folder
    finally:
        shutil.rmtree(parent)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Module-scoped, so that no @given test has a function-scoped fixture: each example writes
    its own folder under it instead."""
    return tmp_path_factory.mktemp("fuzz")


# --- generic byte mutations ---------------------------------------------------------------------

SPECIAL_INTS = [0, 1, 7, 8, 255, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutated_bytes(draw: st.DrawFn, blob: bytes, max_ops: int = 4, keep_length: bool = False) -> bytes:
    """``blob`` after a few random edits: bit flips, overwritten bytes or length-like integers,
    truncation, appended, inserted or deleted bytes (with ``keep_length``, overwrites only)."""
    data = bytearray(blob)
    kinds = ["flip", "set", "int"] + ([] if keep_length else ["truncate", "append", "insert", "delete"])
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(kinds))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "int":
            width = draw(st.sampled_from([1, 2, 4, 8]))
            value = draw(st.sampled_from(SPECIAL_INTS) | st.integers(0, 2 ** (8 * width) - 1)) % 2 ** (8 * width)
            data[at : at + width] = value.to_bytes(width, "little")
        elif kind == "truncate":
            del data[draw(st.integers(0, len(data))) :]
        elif kind == "append":
            data += draw(st.binary(min_size=1, max_size=64))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
    if keep_length:
        del data[len(blob) :]  # an integer written at the end
    return Blob(data)


PICKLE_OPCODES = [op.code.encode("latin-1") for op in pickletools.opcodes]


@st.composite
def mutated_pickle(draw: st.DrawFn, blob: bytes) -> bytes:
    """``blob`` (a pickle) with opcodes spliced in, replaced or removed at opcode boundaries (so
    that the unpickler gets past the edit and into the opcodes' handling), or with byte edits."""
    if draw(st.booleans()):
        return draw(mutated_bytes(blob))
    boundaries = [position for _, _, position in pickletools.genops(blob)]
    data = bytearray(blob)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(boundaries))
        if at > len(data):
            continue
        opcode = draw(st.sampled_from(PICKLE_OPCODES))
        width = draw(st.sampled_from([0, 1, 2, 4, 8]))
        argument = draw(st.sampled_from(SPECIAL_INTS) | st.integers(0, 2 ** (8 * width) - 1)) % 2 ** (8 * width)
        inserted = opcode + argument.to_bytes(width, "little") + draw(st.binary(max_size=8))
        if draw(st.booleans()):
            data[at:at] = inserted
        else:  # replace the opcode byte there, keeping its arguments
            data[at : at + 1] = inserted
    return Blob(data)


# --- safetensors ----------------------------------------------------------------------------------


def split_safetensors(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


BASE_SAFETENSORS = safetensors_bytes(TENSORS, metadata={"format": "pt"})
BASE_HEADER, BASE_DATA = split_safetensors(BASE_SAFETENSORS)
NAMES = list(TENSORS)

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
)
sizes = st.integers(-3, 40) | st.sampled_from([*SPECIAL_INTS, 10**30, -(2**63), 1.5, float("inf"), float("nan")])
shapes = st.lists(sizes, max_size=5) | json_values
offsets = st.lists(st.integers(-5, len(BASE_DATA) + 5) | sizes, max_size=4) | json_values
dtype_names = st.sampled_from([*DTYPES, "F8_E8M0", "I4", "C64", "f32", "", "__class__"]) | json_values
# A placeholder string swapped for raw bytes after json.dumps: nesting too deep for json.dumps.
DEEP = "\x00deep\x00"


@st.composite
def mutated_header(draw: st.DrawFn) -> bytes:
    """The JSON header with a few structured edits, serialized (raw bytes: some edits are not
    JSON that Python would write, or not UTF-8)."""
    header: Any = copy.deepcopy(BASE_HEADER)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(NAMES))
        kind = draw(
            st.sampled_from(
                ["dtype", "shape", "offsets", "drop field", "extra field", "entry", "new", "drop", "metadata"]
                + ["swap offsets", "reverse offsets", "header", "deep"]
            )
        )
        if not isinstance(header, dict):  # replaced by another JSON value: nothing left to edit
            break
        entry = header.get(name)
        if not isinstance(entry, dict):  # dropped or replaced by an earlier edit
            entry = header[name] = copy.deepcopy(BASE_HEADER[name])
        if kind == "dtype":
            entry["dtype"] = draw(dtype_names)
        elif kind == "shape":
            entry["shape"] = draw(shapes)
        elif kind == "offsets":
            entry["data_offsets"] = draw(offsets)
        elif kind == "drop field":
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif kind == "extra field":
            entry[draw(st.text(max_size=6))] = draw(json_values)
        elif kind == "entry":
            header[name] = draw(json_values)
        elif kind == "new":
            header[draw(st.text(max_size=6))] = {
                "dtype": draw(dtype_names),
                "shape": draw(shapes),
                "data_offsets": draw(offsets),
            }
        elif kind == "drop":
            del header[name]
        elif kind == "metadata":
            header["__metadata__"] = draw(json_values)
        elif kind == "swap offsets":  # two tensors overlap, or one of them is the wrong size
            other = header.get(draw(st.sampled_from(NAMES)))
            if isinstance(other, dict):
                entry["data_offsets"], other["data_offsets"] = other.get("data_offsets"), entry.get("data_offsets")
        elif kind == "reverse offsets" and isinstance(entry.get("data_offsets"), list):
            entry["data_offsets"] = entry["data_offsets"][::-1]
        elif kind == "header":
            header = draw(json_values)
        elif kind == "deep":
            entry[draw(st.sampled_from(["shape", "dtype", "data_offsets"]))] = DEEP
    text = json.dumps(header, allow_nan=True).encode()
    depth = draw(st.sampled_from([10, 10_000, 200_000]))
    text = text.replace(json.dumps(DEEP).encode(), b"[" * depth + b"]" * depth)
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "bad utf-8", "utf-16"]))
    if encoding == "utf-16":  # json.loads of bytes detects UTF-16 and decodes it
        text = text.decode().encode("utf-16")
    elif encoding == "bad utf-8":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])) + text[at:]
    return Blob(text + b" " * draw(st.integers(0, 7)))  # writers pad the header with spaces


# JSON objects as lists of pairs, so that keys may repeat: few keys, with ':' and what escapes.
json_keys = st.sampled_from(["a", "b", ":", "a:", '"', "\\", "é", "\u2028"])
paired_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | json_keys,
    lambda inner: (
        st.lists(inner, max_size=3).map(lambda items: ("list", items))
        | st.lists(st.tuples(json_keys, inner), max_size=4).map(lambda pairs: ("object", pairs))
    ),
    max_leaves=12,
)


def json_text(value: Any, draw: st.DrawFn) -> str:
    """``value`` (objects as pairs) as JSON text, each ':' of a string written as it is or as
    ``\\u003a``, each key's ':' with or without spaces."""
    if isinstance(value, tuple) and value[0] == "list":
        return "[" + ",".join(json_text(item, draw) for item in value[1]) + "]"
    if isinstance(value, tuple):
        separators = draw(
            st.lists(st.sampled_from([":", " : ", ":\n"]), min_size=len(value[1]), max_size=len(value[1]))
        )
        return (
            "{"
            + ",".join(
                json_text(k, draw) + c + json_text(v, draw) for (k, v), c in zip(value[1], separators, strict=True)
            )
            + "}"
        )
    text = json.dumps(value)
    return text.replace(":", "\\u003a") if isinstance(value, str) and draw(st.booleans()) else text


def repeats_a_key(value: Any) -> bool:
    if not isinstance(value, tuple):
        return False
    children = value[1] if value[0] == "list" else [v for _, v in value[1]]
    keys = [k for k, _ in value[1]] if value[0] == "object" else []
    return len(set(keys)) < len(keys) or any(map(repeats_a_key, children))


@FUZZ
@given(value=paired_json, data=st.data(), encoding=st.sampled_from(["utf-8", "utf-16", "str"]))
def test_json_with_a_repeated_key_at_any_depth_is_refused(value, data, encoding):
    """parse_json skips the pair-by-pair check only where the text proves no key repeats (its
    count of ':' against the parsed keys): a key repeated in any object, at any depth, amid
    ':' in strings written as they are or escaped, in any encoding JSON allows, is the one-line
    error it always was; any other text reads as ``json.loads`` reads it."""
    text = json_text(value, data.draw)
    raw = text if encoding == "str" else text.encode(encoding)
    if repeats_a_key(value):
        with pytest.raises(CkptavgError, match="^where: not valid JSON \\(duplicate key"):
            parse_json(raw, "where")
    else:
        assert parse_json(raw, "where") == json.loads(raw)


def safetensors_file(header: bytes, data: bytes = BASE_DATA, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def check_safetensors(root: Path, blob: bytes) -> str | None:
    with checkpoint(root, {"model.safetensors": blob}) as folder:
        return read_everything(folder)


@FUZZ
@given(header=mutated_header())
def test_safetensors_header_edits_get_clean_errors(scratch, header):
    check_safetensors(scratch, safetensors_file(header))


@FUZZ
@given(
    length=st.sampled_from([0, 1, 2, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, *SPECIAL_INTS])
    | st.integers(0, len(BASE_SAFETENSORS) + 16)
    | st.integers(0, 2**64 - 1),
    trim=st.integers(0, 64),
)
def test_safetensors_length_field_lies_get_clean_errors(scratch, length, trim):
    header, data = BASE_SAFETENSORS[8:], b""
    message = check_safetensors(scratch, safetensors_file(header[: len(header) - trim], data, length))
    if length > len(BASE_SAFETENSORS):
        assert message is not None and "header length" in message


@FUZZ
@given(blob=mutated_bytes(BASE_SAFETENSORS))
def test_safetensors_byte_edits_get_clean_errors(scratch, blob):
    check_safetensors(scratch, blob)


INDEX = {"metadata": {"total_size": 1}, "weight_map": dict.fromkeys(NAMES, "model.safetensors")}


@FUZZ
@given(
    index=st.sampled_from(["weight_map", "entry", "whole"]).flatmap(
        lambda kind: st.tuples(st.just(kind), json_values, st.sampled_from(NAMES))
    )
)
def test_safetensors_index_edits_get_clean_errors(scratch, index):
    kind, value, name = index
    edited: Any = copy.deepcopy(INDEX)
    if kind == "weight_map":
        edited["weight_map"] = value
    elif kind == "entry":
        edited["weight_map"][name] = value
    else:
        edited = value
    files = {"model.safetensors": BASE_SAFETENSORS, "model.safetensors.index.json": json.dumps(edited).encode()}
    with checkpoint(scratch, files) as folder:
        read_everything(folder)


# --- DCP ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The files of a real single-process DCP save: weights of several dtypes, an integer buffer,
    optimizer state, a scalar and a non-tensor value."""
    folder = tmp_path_factory.mktemp("dcp") / "step-1"
    state = {
        "model": {"w": TENSORS["w"], "b": TENSORS["b"], "count": TENSORS["i"], "scale": torch.tensor(2.5)},
        "optimizer": {"state": {"w": {"exp_avg": torch.ones(3, 4)}}},
        "train_state": {"step": 1},
    }
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return Files({p.name: p.read_bytes() for p in folder.iterdir()})


def data_file(files: dict[str, bytes]) -> str:
    (name,) = [n for n in files if n.endswith(".distcp")]
    return name


@FUZZ
@given(data=st.data())
def test_dcp_metadata_byte_edits_get_clean_errors(scratch, dcp_base, data):
    edited = {**dcp_base, ".metadata": data.draw(mutated_pickle(dcp_base[".metadata"]))}
    with checkpoint(scratch, edited) as folder:
        read_everything(folder)


@FUZZ
@given(data=st.data())
def test_dcp_data_file_edits_get_clean_errors(scratch, dcp_base, data):
    name = data_file(dcp_base)
    with checkpoint(scratch, {**dcp_base, name: data.draw(mutated_bytes(dcp_base[name]))}) as folder:
        read_everything(folder)


def _item_table(path: Path, small: SmallArchives | None) -> tuple[str, Any]:
    """("table", where each tensor lies) or ("error", the message) of the torch.save archive in
    ``path``: read at its two ends first, with what ``small`` learnt from the archives it read
    before (as DCP's reader reads its items), or by zipfile alone (``small`` None)."""
    file = RandomAccessFile(*resolve(str(path)))
    try:
        table = read_tensor_table(file, 0, file.size, str(path), small)
        return "table", {key: (t.dtype, t.shape, t.offset) for key, t in table.items()}
    except CkptavgError as exc:
        return "error", str(exc)
    finally:
        file.close()


@FUZZ
@given(data=st.data())
def test_dcp_items_read_at_their_ends_read_as_zipfile_reads_them(scratch, dcp_base, data):
    """A DCP item (a torch.save archive of one tensor) with bytes edited anywhere, its zip
    directory and pickle included, is read at its two ends to the same table as zipfile reads
    it, or both refuse it: the quick read parses only archives laid out as torch.save lays them
    out, and hands any other to zipfile."""
    metadata = pickle.loads(dcp_base[".metadata"])
    items = sorted((entry.offset, entry.length) for entry in metadata.storage_data.values() if entry.length > 200)
    offset, length = data.draw(st.sampled_from(items))
    item = dcp_base[data_file(dcp_base)][offset : offset + length]
    path = scratch / f"item-{uuid.uuid4().hex}.pt"
    path.write_bytes(data.draw(mutated_bytes(item)))
    try:
        quick, full = _item_table(path, SmallArchives()), _item_table(path, None)
    finally:
        path.unlink()
    assert quick == full


@FUZZ
@given(data=st.data())
def test_dcp_items_of_a_learnt_layout_read_as_zipfile_reads_them(scratch, dcp_base, data):
    """An item read after an intact item of its layout (the reader then compares the bytes the
    layout's parse depended on instead of parsing them again), with bytes edited anywhere, is
    read to the same table as zipfile reads it, or both refuse it: an edit to a byte that the
    parse read is never taken for the learnt layout."""
    metadata = pickle.loads(dcp_base[".metadata"])
    tensors = sorted((entry.offset, entry.length) for key, entry in metadata.storage_data.items() if key.offset)
    offset, length = data.draw(st.sampled_from(tensors))
    item = dcp_base[data_file(dcp_base)][offset : offset + length]
    intact, edited = scratch / f"item-{uuid.uuid4().hex}.pt", scratch / f"item-{uuid.uuid4().hex}.pt"
    intact.write_bytes(item)
    kept = data.draw(st.sampled_from([0, len(item) - 512]))  # edits anywhere, or in its zip directory
    edited.write_bytes(item[:kept] + data.draw(mutated_bytes(item[kept:], keep_length=True)))
    small = SmallArchives()
    try:
        assert _item_table(intact, small)[0] == "table"
        assert small.learnt == 1  # learnt: the edited item is compared with it
        quick, full = _item_table(edited, small), _item_table(edited, None)
    finally:
        intact.unlink()
        edited.unlink()
    assert quick == full


# 2**62 twice overflows int64 even beside a 0 (no elements); True is a bool, not a dimension.
dims = st.integers(-2, 8) | st.sampled_from([2**40, 2**62, 2**63, -(2**63), 1.5, "3", None, True])
tuples_of_dims = st.lists(dims, max_size=3).map(tuple) | json_values
torch_dtypes = st.sampled_from(
    [torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool, torch.float8_e5m2, torch.uint64]
    + [torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.qint8]
)


@st.composite
def edited_metadata(draw: st.DrawFn, blob: bytes) -> bytes:
    """The DCP ``Metadata`` with structured edits (shapes, dtypes, chunks, storage entries), pickled
    again: it passes the allow-list, so the reader's own checks get the values."""
    metadata = pickle.loads(blob)  # our own file: trusted
    entries = metadata.state_dict_metadata
    storage = metadata.storage_data
    tensor_keys = [k for k, v in entries.items() if hasattr(v, "chunks")]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(tensor_keys))
        entry = entries.get(key)
        index = next((i for i in storage if i.fqn == key), None)
        kind = draw(
            st.sampled_from(
                ["size", "dtype", "chunks", "path", "offset", "length", "transform", "no storage"]
                + ["drop key", "key type", "tile", "alias", "wholesale", "deep"]
            )
        )
        if entry is None or index is None:
            continue
        info = storage[index]
        if kind == "size":
            entry.size = draw(tuples_of_dims)
        elif kind == "dtype":
            entry.properties.dtype = draw(torch_dtypes | st.sampled_from(["float32", "BFloat16", "torch.int4", 3]))
        elif kind == "chunks":
            chunk = st.builds(ChunkStorageMetadata, offsets=tuples_of_dims, sizes=tuples_of_dims)
            entry.chunks = draw(st.lists(chunk | json_values, max_size=3))
        elif kind == "path":
            info.relative_path = draw(st.sampled_from(["../x.distcp", ".metadata", "", "a/b", "nope.distcp"]) | dims)
        elif kind in ("offset", "length"):
            setattr(info, kind, draw(dims | st.integers(-2, 10_000)))
        elif kind == "transform":
            info.transform_descriptors = draw(json_values)
        elif kind == "no storage":
            del storage[index]
        elif kind == "drop key":
            del entries[key]
        elif kind == "key type":
            entries[draw(st.integers() | st.none() | st.tuples(st.text(max_size=3)))] = entries.pop(key)
        elif kind == "tile" and isinstance(entry.chunks, list) and entry.chunks:
            # Repeat the first chunk over a grid: the key grows to a multi-chunk tensor whose chunks
            # all point at one stored item, so the block geometry is exercised with real reads.
            base = entry.chunks[0]
            if not isinstance(base, ChunkStorageMetadata) or not all(isinstance(s, int) for s in base.sizes):
                continue
            repeats = draw(st.lists(st.integers(1, 3), min_size=len(base.sizes), max_size=len(base.sizes)))
            entry.size = torch.Size(s * r for s, r in zip(base.sizes, repeats, strict=True))
            cells = [()]
            for size, count in zip(base.sizes, repeats, strict=True):
                cells = [(*cell, i * size) for cell in cells for i in range(count)]
            if draw(st.booleans()) and len(cells) > 1:  # one chunk misplaced: a gap and an overlap
                cells[-1] = cells[0]
            entry.chunks = [ChunkStorageMetadata(torch.Size(c), base.sizes) for c in cells]
            for cell in cells:
                storage[MetadataIndex(key, torch.Size(cell), 0)] = info
        elif kind == "alias":  # another key's stored item: the wrong dtype or shape
            other = draw(st.sampled_from([i for i in storage if i.offset is not None]))
            storage[index] = storage[other]
        elif kind == "wholesale":
            setattr(metadata, draw(st.sampled_from(["state_dict_metadata", "storage_data"])), draw(json_values))
            break
        elif kind == "deep":  # a value nested past the interpreter's recursion limit (not a key: see below)
            target = draw(st.sampled_from(["dtype", "size", "transform_descriptors", "relative_path"]))
            setattr(entry.properties if target == "dtype" else entry if target == "size" else info, target, DEEP)
    # The marker string, pickled (protocol 2: no frames to resize), becomes a list inside 100,000
    # tuples: a pickle nests at no cost, and only what handles it afterwards can recurse.
    marker = b"X" + struct.pack("<I", len(DEEP)) + DEEP.encode()
    return Blob(pickle.dumps(metadata, protocol=2).replace(marker, b"]" + b"\x85" * 100_000))


@FUZZ
@given(data=st.data())
def test_dcp_metadata_value_edits_get_clean_errors(scratch, dcp_base, data):
    edited = {**dcp_base, ".metadata": data.draw(edited_metadata(dcp_base[".metadata"]))}
    with checkpoint(scratch, edited) as folder:
        read_everything(folder)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
megatron_configs = json_values | st.fixed_dictionaries(
    {},
    optional={
        "sharded_backend": st.sampled_from(["torch_dist", "zarr"]) | json_values,
        "sharded_backend_version": st.sampled_from([1, 2]) | json_values,
        "common_backend": st.just("torch") | json_values,
        "common_backend_version": st.just(1) | json_values,
    },
)


def megatron_reads(config: Any) -> bool:
    """Whether Megatron's backend config names what ckptavg reads (absent fields: Megatron's defaults)."""
    if not isinstance(config, dict):
        return False
    backends = [config.get(f"{kind}_backend", default) for kind, default in (("sharded", None), ("common", "torch"))]
    versions = [config.get(f"{kind}_backend_version", 1) for kind in ("sharded", "common")]
    return backends == ["torch_dist", "torch"] and versions == [1, 1]


@FUZZ
@given(config=megatron_configs)
def test_megatron_config_values_read_or_get_one_error_naming_it(scratch, dcp_base, config):
    """A Megatron folder (DCP + common.pt + metadata.json) reads exactly when metadata.json names
    the torch_dist backend ckptavg reads; any other value is refused, naming the file."""
    files = {**dcp_base, "common.pt": b"never read", "metadata.json": json.dumps(config).encode()}
    with checkpoint(scratch, files) as folder:
        message = read_everything(folder)
    assert (message is None) == megatron_reads(config), message
    assert message is None or "metadata.json" in message


MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
trackers = (
    st.sampled_from([b"1", b"1\n", b" 0001 ", b"release", b"2", b"-1", b"1.0", b"one", b"\xff1", b"1" * 65])
    | st.integers(-3, 2**64).map(lambda n: str(n).encode())
    | st.binary(max_size=80)
)
commons = json_values | st.fixed_dictionaries(
    {"iteration": st.sampled_from(SPECIAL_INTS) | json_values}, optional={"args": json_values}
)


@FUZZ
@given(tracker=trackers, common=commons)
def test_megatron_load_folder_and_iteration_read_or_get_one_error_naming_them(scratch, dcp_base, tracker, common):
    """The folder Megatron-LM's --load takes (the tracker file beside iter_0000001/: DCP,
    common.pt, metadata.json) reads exactly when the tracker names iteration 1 in decimal digits
    (Megatron-LM strips the text around it); a DCP output takes its iteration from common.pt
    exactly when it is an integer from 0 to 2**63-1. Anything else is one error naming the file."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    try:
        (root / MEGATRON_TRACKER).write_bytes(tracker)
        folder = root / "iter_0000001"
        folder.mkdir()
        for name, data in dcp_base.items():
            (folder / name).write_bytes(data)
        torch.save(common, folder / "common.pt")
        (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        message = read_everything(root)
        text = tracker.decode("ascii", "replace").strip()
        assert (message is None) == (text.isascii() and text.isdigit() and int(text) == 1), message
        if message is not None:
            assert MEGATRON_TRACKER in message
            return
        iteration = common.get("iteration") if isinstance(common, dict) else None
        with open_checkpoint(*resolve(str(root))) as reader:
            try:
                placement = reader.dcp_placement()
            except CkptavgError as exc:
                assert type(iteration) is not int or not 0 <= iteration < 2**63, iteration
                assert "iter_0000001/common.pt" in str(exc) and str(exc).isprintable()
                return
        assert type(iteration) is int and placement.folder == f"iter_{iteration:07d}"
        assert placement.beside == ((MEGATRON_TRACKER, str(iteration).encode()),)
    finally:
        shutil.rmtree(root)


def _same(a: Any, b: Any) -> bool:
    """Equal values, tensors compared by dtype, shape and bits; Namespaces by their fields."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, argparse.Namespace):
        return isinstance(b, argparse.Namespace) and _same(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


common_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.binary(min_size=1, max_size=6)  # torch.load with weights only refuses b"" (builtins.bytes)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.int64]).flatmap(
        lambda dtype: st.lists(st.integers(-5, 5), max_size=4).map(lambda v: torch.tensor(v, dtype=dtype))
    )
)
common_values = st.recursive(
    common_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), inner, max_size=3)
        | st.dictionaries(st.sampled_from(["lr", "bf16", "tensor_model_parallel_size"]), inner).map(
            lambda fields: argparse.Namespace(**fields)
        )
        | inner.map(lambda shared: [shared, shared])
    ),  # one object in two places (the pickle's memo)
    max_leaves=8,
)


def _megatron_common(scratch: Path, dcp_base: dict[str, bytes], common: bytes) -> bytes:
    """What a DCP output writes for a Megatron folder (``dcp_base``, the common.pt bytes
    ``common``): Megatron's companion_for, or the one error it raises."""
    files = {**dcp_base, "common.pt": common, "metadata.json": json.dumps({"sharded_backend": "torch_dist"}).encode()}
    with checkpoint(scratch, files, "iter_0000001") as folder, open_checkpoint(*resolve(str(folder))) as reader:
        return reader.companion_for("common.pt", MergedOutput(frozenset(), {"tool": "ckptavg"}))


def _loaded(data: bytes) -> Any:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(io.BytesIO(data), weights_only=True)


@FUZZ
@given(common=st.dictionaries(st.text(max_size=6), common_values, max_size=4), data=st.data())
def test_megatron_common_pt_is_written_back_as_saved_or_refused_in_one_line(scratch, dcp_base, common, data):
    """A Megatron checkpoint's common.pt, written anew for a DCP output (formats/repickle.py: no
    global imported or run): any state torch.save writes (tensors, Namespaces, objects in two
    places) loads back, weights only, as it was saved plus the merge's provenance; after any edit
    of its bytes it is either still written back as torch loads it or refused in one line naming
    common.pt, never another exception."""
    buffer = io.BytesIO()
    torch.save(common, buffer)
    written = _loaded(_megatron_common(scratch, dcp_base, buffer.getvalue()))
    assert written.pop("weighted_merge_provenance")["tool"] == "ckptavg"
    common.pop("weighted_merge_provenance", None)
    assert _same(written, common)

    edited = bytearray(buffer.getvalue())
    for _ in range(data.draw(st.integers(1, 3))):
        edited[data.draw(st.integers(0, len(edited) - 1))] = data.draw(st.integers(0, 255))
    try:
        written = _megatron_common(scratch, dcp_base, bytes(edited))
    except CkptavgError as exc:
        assert "iter_0000001/common.pt" in str(exc) and str(exc).isprintable() and "\n" not in str(exc)
        return
    try:
        saved = _loaded(bytes(edited))
    except Exception:  # noqa: BLE001 - torch refuses what it refuses: only ckptavg's own line is checked
        return
    if isinstance(saved, dict):
        saved.pop("weighted_merge_provenance", None)
        assert _same({k: v for k, v in _loaded(written).items() if k != "weighted_merge_provenance"}, saved)


# --- torch.save -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pt_base() -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": dict(TENSORS), "step": 3, "names": ["a"]}, buffer)
    return Blob(buffer.getvalue())


def rezip(records: dict[str, bytes]) -> bytes:
    """A zip archive of ``records``, stored (as torch.save writes), with valid CRCs."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def pt_records(blob: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def check_pt(root: Path, blob: bytes) -> str | None:
    with checkpoint(root, {"model.pt": blob}) as folder:
        return read_everything(folder)


@FUZZ
@given(data=st.data())
def test_pt_byte_edits_get_clean_errors(scratch, pt_base, data):
    check_pt(scratch, data.draw(mutated_bytes(pt_base)))


@FUZZ
@given(data=st.data())
def test_pt_record_edits_get_clean_errors(scratch, pt_base, data):
    """Edits inside the records of a well-formed zip (valid CRCs), so that they reach the pickle
    and the storage table rather than stopping at the zip layer."""
    records = pt_records(pt_base)
    name = data.draw(st.sampled_from(sorted(records)))
    kind = data.draw(st.sampled_from(["pickle", "bytes", "drop", "compress"]))
    if kind == "pickle" or name.endswith("data.pkl"):
        pkl = next(n for n in records if n.endswith("data.pkl"))
        records[pkl] = data.draw(mutated_pickle(records[pkl]))
    elif kind == "bytes":
        records[name] = data.draw(mutated_bytes(records[name]))
    elif kind == "drop":
        del records[name]
    blob = rezip(records)
    if kind == "compress":  # a record compressed with a method torch.save never uses
        buffer = io.BytesIO()
        method = data.draw(st.sampled_from([zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]))
        with zipfile.ZipFile(buffer, "w") as archive:
            for record, content in records.items():
                archive.writestr(record, content, compress_type=method if record == name else zipfile.ZIP_STORED)
        blob = buffer.getvalue()
    check_pt(scratch, blob)


# (offset, width) of the fields of each zip structure, by signature: flags, method, CRC, sizes,
# name/extra/comment lengths, disk numbers, entry counts, directory size and offset.
ZIP_FIELDS = {
    b"PK\x03\x04": [(6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)],
    b"PK\x01\x02": [(8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (34, 2), (42, 4)],
    b"PK\x05\x06": [(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2)],
    b"PK\x06\x06": [(4, 8), (16, 4), (20, 4), (24, 8), (32, 8), (40, 8), (48, 8)],
    b"PK\x06\x07": [(4, 4), (8, 8), (16, 4)],
}


@FUZZ
@given(data=st.data())
def test_pt_zip_field_edits_get_clean_errors(scratch, pt_base, data):
    """Lies in the zip structures' fields (a record's sizes, offset, flags or method; the
    directory's size, offset or entry count): what zipfile believes before any pickle is read."""
    blob = bytearray(pt_base)
    fields = [
        (at + offset, width)
        for signature, layout in ZIP_FIELDS.items()
        for at in range(len(blob))
        if blob.startswith(signature, at)
        for offset, width in layout
    ]
    for at, width in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3)):
        values = st.sampled_from([*SPECIAL_INTS, 1, 8, 0x800, 0x801]) | st.integers(0, 2 ** (8 * width) - 1)
        blob[at : at + width] = (data.draw(values) % 2 ** (8 * width)).to_bytes(width, "little")
    check_pt(scratch, bytes(blob))


class FakeStorage:
    """Pickled as a persistent id, the way torch.save refers to a storage record."""

    def __init__(self, pid: tuple) -> None:
        self.pid = pid


class FakeTensor:
    def __init__(self, *args: Any, rebuild: Any = torch._utils._rebuild_tensor_v2) -> None:
        self.args, self.rebuild = args, rebuild

    def __reduce__(self) -> tuple:
        return self.rebuild, self.args


class TablePickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, FakeStorage) else None


# A tensor that record data/0 (12 float32) holds, described field by field; each example changes
# a few fields, so that every check of the table is reached with the others passing.
VALID_TENSOR = {
    "storage_type": "FloatStorage",
    "key": "0",
    "numel": 12,
    "pid_length": 5,
    "storage_offset": 0,
    "size": (3, 4),
    "stride": (4, 1),
    "nesting": 0,
    "dtype": None,  # a dtype: the tensor is rebuilt as torch writes float8 and uint16-64 ones
}
# The same 12 float32 elements as 48 bytes of an untyped storage, with their dtype beside them.
VALID_V3_TENSOR = {**VALID_TENSOR, "storage_type": "UntypedStorage", "numel": 48, "dtype": torch.float32}
TENSOR_EDITS = {
    "storage_type": st.sampled_from(
        ["BFloat16Storage", "LongStorage", "BoolStorage", "ComplexFloatStorage", "UntypedStorage", "Nope"]
    ),
    "dtype": torch_dtypes | st.sampled_from([torch.float8_e4m3fn, torch.uint16, torch.uint4, "float32", 3]),
    "key": st.sampled_from(["1", "3", "9", "../0", ""]) | dims,
    "numel": dims | st.integers(0, 100),
    "pid_length": st.integers(0, 6),
    "storage_offset": dims | st.integers(0, 13),
    "size": st.lists(st.integers(0, 13), max_size=3).map(tuple) | tuples_of_dims,
    "stride": st.sampled_from([(1, 3), (1,), (), (0, 0), (1, 1, 1), (4, 2)]) | tuples_of_dims,
    "nesting": st.integers(1, 3),
}


@FUZZ
@given(data=st.data())
def test_pt_tensor_table_values_get_clean_errors(scratch, pt_base, data):
    """data.pkl pickled with random storage references, offsets, shapes and strides: they pass the
    allow-list, so the table's own checks get them."""
    fields = dict(data.draw(st.sampled_from([VALID_TENSOR, VALID_V3_TENSOR])))
    for name in data.draw(st.sets(st.sampled_from(sorted(TENSOR_EDITS)), max_size=3)):
        fields[name] = data.draw(TENSOR_EDITS[name], label=name)
    storage_type = fields["storage_type"]
    pid = ("storage", getattr(torch, storage_type, storage_type), fields["key"], "cpu", fields["numel"], "extra")
    storage = FakeStorage(pid[: fields["pid_length"]])
    args = (storage, fields["storage_offset"], fields["size"], fields["stride"], False, {})
    if fields["dtype"] is None:
        tensor = FakeTensor(*args)
    else:
        tensor = FakeTensor(*args, fields["dtype"], rebuild=torch._utils._rebuild_tensor_v3)
    obj: Any = {"t": tensor}
    for _ in range(fields["nesting"]):
        obj = {"n": obj}
    buffer = io.BytesIO()
    TablePickler(buffer, protocol=2).dump(obj)
    records = pt_records(pt_base)
    records[next(n for n in records if n.endswith("data.pkl"))] = buffer.getvalue()
    check_pt(scratch, rezip(records))


# --- DeepSpeed ------------------------------------------------------------------------------------
# Folders laid out as DeepSpeed 0.19 saves them (ZeRO-3 and ZeRO-2, 2 ranks; tests/formats/
# test_deepspeed.py has real saves), built without DeepSpeed (checkpoint_builders.deepspeed_states).
# Each example replaces or drops a few fields of the pickled dicts, so that the reader's checks of
# what DeepSpeed wrote are reached.


def saved(states: dict[str, dict[str, Any]]) -> Files:
    files = Files()
    for name, state in states.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        files[name] = Blob(buffer.getvalue())
    return files


ds_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.sampled_from(SPECIAL_INTS)
    | st.text(max_size=6)
    | st.lists(st.integers(-2, 20), max_size=3).map(torch.Size)
    # Plain tuples keep a bool or 2**63 as it is (torch.Size would make True 1, refuse 2**63).
    | st.lists(st.sampled_from([0, 3, 4, 5, True, 2**62, 2**63]), max_size=3).map(tuple)
    | st.builds(torch.zeros, st.integers(0, 30), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
)
ds_names = st.sampled_from(["w", "b", "f", "h", "pos", "x"]) | st.text(max_size=4)
ds_values = st.recursive(
    ds_leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ds_names, inner, max_size=3), max_leaves=8
)


def edit_field(data: st.DataObject, state: dict) -> None:
    """Replace or drop one entry of ``state`` or of a dict inside it."""
    strange = st.text(max_size=4)  # a key DeepSpeed never writes, now and then
    key = data.draw(st.sampled_from(sorted(state)) if state and data.draw(st.integers(0, 4)) else strange)
    inner = state.get(key)
    if isinstance(inner, list) and inner and isinstance(inner[0], dict) and data.draw(st.booleans()):
        inner = inner[0]  # param_shapes: a dict per group
    if isinstance(inner, dict) and inner and data.draw(st.booleans()):
        edit_field(data, inner)
    elif data.draw(st.integers(0, 4)) == 0:
        state.pop(key, None)
    else:
        state[key] = data.draw(ds_values)


@FUZZ
@given(data=st.data(), stage=st.sampled_from([2, 3]))
def test_deepspeed_field_edits_get_clean_errors(scratch, data, stage):
    states = deepspeed_states(stage)
    for _ in range(data.draw(st.integers(1, 3))):
        edit_field(data, states[data.draw(st.sampled_from(sorted(states)))])
    with checkpoint(scratch, saved(states)) as folder:
        read_everything(folder)


DS_GROUPS = {2: "single_partition_of_fp32_groups", 3: "fp32_flat_groups"}


@FUZZ
@given(data=st.data(), stage=st.sampled_from([2, 3]))
def test_deepspeed_partitions_read_only_as_deepspeed_lays_them_out(scratch, data, stage):
    """Each rank's flat fp32 groups get another dtype or size now and then, and so do ZeRO-3's
    frozen fragments: the folder reads when, and only when, every one of them is what DeepSpeed's
    layout makes it (each parameter's share of its padded group, one floating dtype on every
    rank), and is otherwise refused naming a file, before a value is read as what it is not."""
    states = deepspeed_states(stage)
    places: list[tuple[Any, Any]] = []  # (container, key) of each flat group and fragment
    for name, state in sorted(states.items()):
        if "optim" in name:
            groups = state["optimizer_state_dict"][DS_GROUPS[stage]]
            places += [(groups, i) for i in range(len(groups))]
        elif "frozen_param_fragments" in state:
            places.append((state["frozen_param_fragments"], "f"))
    common = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int32]), label="dtype")
    as_laid_out = True
    for container, key in places:
        original = container[key]
        dtype = original.dtype if isinstance(container, dict) else common  # fragments keep the module's
        if data.draw(st.integers(0, 3)) == 0:
            dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int32]))
        size = max(0, original.numel() + data.draw(st.sampled_from([0, 0, 0, -2, -1, 1, 2])))
        container[key] = torch.ones(size, dtype=dtype)
        as_laid_out &= size == original.numel()
    group_dtypes = {container[key].dtype for container, key in places if isinstance(container, list)}
    fragment_dtypes = {container[key].dtype for container, key in places if isinstance(container, dict)}
    as_laid_out &= len(group_dtypes) == 1 and group_dtypes.pop().is_floating_point and len(fragment_dtypes) <= 1
    with checkpoint(scratch, saved(states)) as folder:
        message = read_everything(folder)
    assert (message is None) == as_laid_out, message
    assert message is None or "_states.pt" in message, message


def test_the_unedited_deepspeed_files_read(scratch):
    for stage in (2, 3):
        with checkpoint(scratch, saved(deepspeed_states(stage))) as folder:
            assert read_everything(folder) is None


# --- the training hook's rank files (snapshots) ---------------------------------------------------
# One process's rank file as the hook writes it (formats.parts.write_rank_file); each example edits
# the JSON table in its header that says what the file holds: fields of any JSON type, tensor
# entries, shapes and dimensions, block offsets.


@pytest.fixture(scope="module")
def rank_file_base(tmp_path_factory: pytest.TempPathFactory) -> Files:
    folder = tmp_path_factory.mktemp("snapshot") / "step1-snapshot"
    table = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in TENSORS.items()]
    blocks = [Block(name, (0,) * t.dim(), t) for name, t in TENSORS.items()]
    write_rank_file(*resolve(str(folder)), 0, 1, table, blocks, {"kind": "weights", "step": 1})
    return Files({p.name: Blob(p.read_bytes()) for p in folder.iterdir()})


@st.composite
def edited_rank_table(draw: st.DrawFn, described: dict[str, Any]) -> dict[str, Any]:
    described = copy.deepcopy(described)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "entry", "shape", "dim", "offsets"]))
        name = draw(st.sampled_from(NAMES))
        tensors, offsets = described.get("tensors"), described.get("offsets")
        entry = tensors.get(name) if isinstance(tensors, dict) else None
        if kind == "field":
            described[draw(st.sampled_from(["tensors", "offsets", "info", "rank", "world_size"]))] = draw(json_values)
        elif kind == "entry" and isinstance(tensors, dict):
            tensors[name] = draw(json_values)
        elif kind == "shape" and isinstance(entry, list) and len(entry) == 2:
            entry[1] = draw(st.lists(dims, max_size=3) | json_values)
        elif kind == "dim" and isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list) and entry[1]:
            entry[1][draw(st.integers(0, len(entry[1]) - 1))] = draw(dims)
        elif kind == "offsets" and isinstance(offsets, dict):
            offsets[name] = draw(st.lists(dims, max_size=3) | json_values)
    return described


@FUZZ
@given(data=st.data())
def test_rank_file_table_edits_get_clean_errors(scratch, rank_file_base, data):
    """A value of another JSON type than the table's (a list where an object is, a bool or 2**63
    as a dimension) is one error naming the snapshot or its file, never a Python error or a
    shape an output cannot hold."""
    name = next(n for n in rank_file_base if n.endswith(".safetensors"))
    header, tensor_data = split_safetensors(rank_file_base[name])
    described = json.loads(header["__metadata__"][METADATA_KEY])
    header["__metadata__"][METADATA_KEY] = json.dumps(data.draw(edited_rank_table(described)))
    edited = {**rank_file_base, name: safetensors_file(json.dumps(header).encode(), tensor_data)}
    with checkpoint(scratch, edited) as folder:
        message = read_everything(folder)
    assert message is None or str(folder) in message, message  # the folder, or its rank file


def test_the_unedited_rank_file_reads(scratch, rank_file_base):
    with checkpoint(scratch, rank_file_base) as folder:
        assert read_everything(folder) is None


# --- the training hook's blocks --------------------------------------------------------------------
# A block as the hook writes it (stepS-block/: one process's rank file whose record says which steps
# it averages and the trained dtypes); each example edits the record: fields of any JSON type,
# numbers near and past their limits, dtype entries.

BLOCK_TENSORS = {"w": TENSORS["w"], "b": TENSORS["b"].float(), "i": TENSORS["i"]}
block_numbers = st.integers(-2, 9) | st.sampled_from([2**63 - 1, 2**63, 1.0, True, "4", None])


@pytest.fixture(scope="module")
def block_base(tmp_path_factory: pytest.TempPathFactory) -> Files:
    folder = tmp_path_factory.mktemp("block") / "step8-block"
    table = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in BLOCK_TENSORS.items()]
    blocks = [Block(name, (0,) * t.dim(), t) for name, t in BLOCK_TENSORS.items()]
    trained = {"w": torch.float32, "b": torch.bfloat16, "i": torch.int64}
    write_rank_file(*resolve(str(folder)), 0, 1, table, blocks, block_info(8, 4, 1, 4, trained))
    return Files({p.name: Blob(p.read_bytes()) for p in folder.iterdir()})


@st.composite
def edited_block_record(draw: st.DrawFn, record: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(record)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["number", "field", "dtype"]))
        if kind == "number":
            record[draw(st.sampled_from(["step", "block", "every", "count"]))] = draw(block_numbers)
        elif kind == "field":
            record[draw(st.sampled_from(["kind", "dtypes", "step", "count"]))] = draw(json_values)
        elif isinstance(record.get("dtypes"), dict):
            record["dtypes"][draw(st.sampled_from([*BLOCK_TENSORS, "x"]))] = draw(dtype_names)
    return record


@FUZZ
@given(data=st.data())
def test_block_record_edits_get_clean_errors(scratch, block_base, data):
    """A block's record that says anything else than the steps of a block it can be (a count
    that does not tile it, another step than its name's, a dtype it cannot have been trained in)
    is one error naming the block; one that reads is a block that can be."""
    name = next(n for n in block_base if n.endswith(".safetensors"))
    header, tensor_data = split_safetensors(block_base[name])
    described = json.loads(header["__metadata__"][METADATA_KEY])
    described["info"] = data.draw(edited_block_record(described["info"]))
    header["__metadata__"][METADATA_KEY] = json.dumps(described)
    edited = {**block_base, name: safetensors_file(json.dumps(header).encode(), tensor_data)}
    with checkpoint(scratch, edited, "step8-block") as folder:
        message = read_everything(folder)
        if message is None:
            with open_checkpoint(*resolve(str(folder))) as reader:
                record = reader.block_record()
            assert record is not None and record.step == 8 and record.step % record.block == 0
            assert record.count * record.every == record.block and set(record.dtypes) == set(BLOCK_TENSORS)
    assert message is None or str(folder) in message, message


def test_the_unedited_block_reads(scratch, block_base):
    with checkpoint(scratch, block_base, "step8-block") as folder:
        assert read_everything(folder) is None


# --- fixed hostile pickles ------------------------------------------------------------------------


def hostile_pickles(marker: Path) -> dict[str, bytes]:
    """Pickles that would run code or change the process if unpickled without an allow-list."""

    class System:
        def __reduce__(self) -> tuple:
            return os.system, (f"touch {marker}",)

    class Eval:
        def __reduce__(self) -> tuple:
            return eval, (f"open({str(marker)!r}, 'w')",)

    global_ = f"cos\nsystem\n(Vtouch {marker}\ntR.".encode()
    return {
        "os.system": pickle.dumps(System()),
        "builtins.eval": pickle.dumps(Eval()),
        "protocol 0": global_,
        "INST": f"(Vtouch {marker}\nios\nsystem\n.".encode(),
        "STACK_GLOBAL": pickle.dumps(System(), protocol=4),
    }


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "protocol 0", "INST", "STACK_GLOBAL"])
def test_hostile_metadata_is_refused_before_it_runs(tmp_path, dcp_base, name):
    marker = tmp_path / "ran"
    with checkpoint(tmp_path, {**dcp_base, ".metadata": hostile_pickles(marker)[name]}) as folder:
        message = read_everything(folder)
    assert message is not None and "refusing to unpickle" in message
    assert not marker.exists()


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "protocol 0", "INST", "STACK_GLOBAL"])
def test_hostile_pt_is_refused_before_it_runs(tmp_path, pt_base, name):
    marker = tmp_path / "ran"
    records = pt_records(pt_base)
    records[next(n for n in records if n.endswith("data.pkl"))] = hostile_pickles(marker)[name]
    message = check_pt(tmp_path, rezip(records))
    assert message is not None and "refusing to unpickle" in message
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name", "attribute"),
    [
        ("torch.distributed.checkpoint.metadata", "Metadata", "state_dict_metadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "fuzzed"),
        ("torch.distributed.checkpoint.planner", "WriteItemType", "fuzzed"),
        ("torch.distributed.checkpoint.planner", "SavePlan", "items"),
        ("torch.serialization", "_get_layout", "cache"),
        ("pathlib", "PosixPath", "fuzzed"),
    ],
)
def test_metadata_cannot_set_attributes_of_allowed_globals(tmp_path, dcp_base, module, name, attribute):
    """BUILD on a global itself (not on an object made from it) would set attributes of a class
    or function that the whole process shares: torch's, in a training process."""
    target = _allowed()[(module, name)]
    before = getattr(target, attribute, None)
    for state in (f"}}V{attribute}\nK\x01s", f"N}}V{attribute}\nK\x01s\x86"):  # dict, then slot state
        build = f"\x80\x02c{module}\n{name}\n{state}b.".encode("latin-1")
        with checkpoint(tmp_path, {**dcp_base, ".metadata": build}) as folder:
            assert read_everything(folder) is not None
        assert getattr(target, attribute, None) is before


class RebuiltThenChanged(FakeTensor):
    """A tensor whose pickle is rebuilt with valid values, then given others by BUILD."""

    def __init__(self, state: Any, *args: Any) -> None:
        super().__init__(*args)
        self.state = state

    def __reduce__(self) -> tuple:
        return torch._utils._rebuild_tensor_v2, self.args, self.state


@pytest.mark.parametrize(
    "state",
    [{"shape": ("3", "4")}, {"shape": (3.0, 4.0)}, (None, {"shape": (3.0, 4.0)})],
    ids=["strings", "floats", "slot-state"],
)
def test_build_cannot_change_a_tensor_reference_after_its_checks(scratch, pt_base, state):
    """``_rebuild_tensor_v2`` checks its arguments; a BUILD after it must not replace them."""
    storage = FakeStorage(("storage", torch.FloatStorage, "0", "cpu", 12))
    buffer = io.BytesIO()
    TablePickler(buffer, protocol=2).dump({"t": RebuiltThenChanged(state, storage, 0, (3, 4), (4, 1), False, {})})
    assert b"b" in buffer.getvalue()[-4:]  # the BUILD opcode, after the REDUCE
    records = pt_records(pt_base)
    records[next(n for n in records if n.endswith("data.pkl"))] = buffer.getvalue()
    message = check_pt(scratch, rezip(records))
    assert message is not None and "model.pt" in message


@pytest.mark.parametrize(
    ("module", "name", "value"),
    [("metadata", "_MEM_FORMAT_ENCODING", 0), ("planner", "WriteItemType", 1)],
)
def test_metadata_cannot_change_objects_that_torch_shares(tmp_path, dcp_base, module, name, value):
    """A DCP metadata pickle names torch's enums (memory formats; Megatron's save plans name the
    write item types), whose members the whole process shares; BUILD on one would change it for
    every later save and load."""
    import importlib

    enum = getattr(importlib.import_module(f"torch.distributed.checkpoint.{module}"), name)
    member = enum(value)
    build = f"\x80\x02ctorch.distributed.checkpoint.{module}\n{name}\nK{value:c}\x85R}}V_value_\nK\x07sb."
    try:
        with checkpoint(tmp_path, {**dcp_base, ".metadata": build.encode("latin-1")}) as folder:
            assert read_everything(folder) is not None
        assert member.value == value and enum(value) is member
    finally:
        member._value_ = value  # for the tests after this one, if it failed


@pytest.mark.parametrize(
    "claim",
    [
        b"NJ\x00\x00\x00\x00r\x00\x00\x00\x01.",  # memo index 2**24: a 128 MiB memo table
        b"Nr\xff\xff\xff\xff.",  # memo index 2**32 - 1: 32 GiB (9 bytes after PROTO)
        b"B\x00\x00\x00\x40.",  # bytes of 1 GiB
        b"\x8e\x00\x00\x00\x00\x01\x00\x00\x00.",  # bytes of 4 GiB
        b"\x96\x00\x00\x00\x10\x00\x00\x00\x00.",  # a bytearray of 256 MiB
        b"\x95\x00\x00\x00\x00\x01\x00\x00\x00N.",  # a frame of 4 GiB
    ],
    ids=["memo-2**24", "memo-2**32", "bytes", "bytes8", "bytearray8", "frame"],
)
@pytest.mark.parametrize("format_", ["dcp", "pt"])
def test_pickles_that_claim_what_they_do_not_hold_are_refused_unread(scratch, dcp_base, pt_base, claim, format_):
    """CPython's unpickler allocates a bytes length, or a memo table up to an index, before it
    reads: a few bytes of pickle would cost gigabytes (the allocation bound of read_everything)."""
    pickled = b"\x80\x04" + claim
    if format_ == "dcp":
        with checkpoint(scratch, {**dcp_base, ".metadata": pickled}) as folder:
            message = read_everything(folder)
    else:
        records = pt_records(pt_base)
        records[next(n for n in records if n.endswith("data.pkl"))] = pickled
        message = check_pt(scratch, rezip(records))
    assert message is not None and "refusing to unpickle it" in message, message


@pytest.mark.parametrize("format_", ["dcp", "pt"])
def test_deep_nesting_is_refused_before_it_can_crash_the_interpreter(tmp_path, dcp_base, pt_base, format_):
    """A tuple nested 10**6 deep as a dict key: hashing it recurses in C until the stack runs
    out (a segmentation fault, no exception). Run in a new interpreter, so that a crash fails
    this test instead of ending the session."""
    deep_key = b"\x80\x02}" + b")" + b"\x85" * 1_000_000 + b"Ns."
    run = tmp_path / "run"
    (run / "step1").mkdir(parents=True)
    if format_ == "dcp":
        files = {**dcp_base, ".metadata": deep_key}
    else:
        records = pt_records(pt_base)
        records[next(n for n in records if n.endswith("data.pkl"))] = deep_key
        files = {"model.pt": rezip(records)}
    for name, data in files.items():
        (run / "step1" / name).write_bytes(data)
    result = run_cli("merge", str(run), "--last", "1")
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    (line,) = result.stderr.splitlines()
    assert line.startswith("ckptavg: error: ") and "step1/" in line and "deeper than" in line, line


plain_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
plain_values = st.recursive(
    plain_leaves | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=4)
        | st.frozensets(st.integers() | st.text(max_size=4), max_size=4)
        | st.sets(st.integers(), max_size=3)
    ),
    max_leaves=30,
)


@FUZZ
@given(value=plain_values, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_the_pre_scan_accepts_what_pickle_writes(value, protocol):
    """The bounds refuse only what no pickler writes: every pickle of ordinary nested values, at
    every protocol, passes (shared references included: ``[value, value]`` uses the memo)."""
    prescan(pickle.dumps([value, value, (value,)], protocol=protocol), "test")


def test_the_pre_scan_bounds_nesting_depth():
    for opener, wrap in ((b")", b"\x85"), (b"]", b"\x85"), (b"}", b"\x85")):
        prescan(b"\x80\x02" + opener + wrap * MAX_PICKLE_DEPTH + b".", "test")
        with pytest.raises(CkptavgError, match="deeper than"):
            prescan(b"\x80\x02" + opener + wrap * (MAX_PICKLE_DEPTH + 1) + b".", "test")
    nested_lists = b"\x80\x02]" + b"]" * MAX_PICKLE_DEPTH + b"a" * MAX_PICKLE_DEPTH + b"."
    prescan(nested_lists, "test")
    with pytest.raises(CkptavgError, match="deeper than"):
        prescan(nested_lists[:3] + b"]" + nested_lists[3:-1] + b"a.", "test")


# A long pickle as DCP's metadata is one: many alike records, then what differs between the
# checkpoints of a run (their path, their save id) at its end.
def _alike_pickle(tail: str, records: int = 2600, protocol: int = 4) -> bytes:
    alike = {("layer", i): (i, [i, i + 1], {"k": (i,)}) for i in range(records)}
    return pickle.dumps([alike, tail], protocol=protocol)


_ALIKE = _alike_pickle("checkpoint-1000")
# Small enough for many examples a second (scans are kept from _SMALL_KEPT bytes on in that
# test), memoized in order (protocol 4: MEMOIZE) and at indices given (protocol 2: BINPUT).
_SMALL_ALIKE = {protocol: _alike_pickle("checkpoint-1000", 200, protocol) for protocol in (2, 4)}
_SMALL_KEPT = 4096


def _scan_outcome(data: bytes) -> str | None:
    try:
        prescan(data, "test")
    except CkptavgError as exc:
        return str(exc)
    return None


def test_a_long_pickle_alike_to_the_last_one_is_scanned_from_near_where_they_differ(monkeypatch):
    """The checkpoints of one run pickle their DCP metadata alike but near its end: the second
    one's scan starts from the first one's state there (a few of its opcodes, not all again)."""
    second = _alike_pickle("checkpoint-2000")
    assert len(second) == len(_ALIKE) >= 64 * 2**10 and second != _ALIKE  # long enough to be kept
    gathered = []
    original = pickle_scan._gather
    monkeypatch.setattr(pickle_scan, "_gather", lambda *args: gathered.append(1) or original(*args))
    prescan(_ALIKE, "test")
    whole = len(gathered)
    prescan(second, "test")
    assert 0 < len(gathered) - whole < whole / 100


@FUZZ
@given(
    protocol=st.sampled_from([2, 4]),
    flips=st.lists(
        st.tuples(st.sampled_from([512, 4096, 2**31]), st.integers(0, 2**31), st.integers(0, 255)), max_size=3
    ),
)
def test_a_resumed_pre_scan_refuses_what_a_fresh_one_refuses(protocol, flips):
    """A long pickle alike to the last one scanned, bytes changed in its last 512 or 4096 bytes
    (where the states kept lie) or anywhere: the scan that starts from the last one's state
    refuses it, or passes it, exactly as a scan from its start does (the same message)."""
    alike = _SMALL_ALIKE[protocol]
    mutated = bytearray(alike)
    for within, position, value in flips:
        mutated[len(mutated) - 1 - position % min(within, len(mutated))] = value
    kept, threshold = pickle_scan._resumable, pickle_scan.RESUMABLE_BYTES
    assert len(mutated) > _SMALL_KEPT
    try:
        pickle_scan._resumable, pickle_scan.RESUMABLE_BYTES = pickle_scan._Resumable(), _SMALL_KEPT
        prescan(alike, "test")  # its states are kept
        resumed = _scan_outcome(bytes(mutated))
        pickle_scan._resumable = pickle_scan._Resumable()
        fresh = _scan_outcome(bytes(mutated))
    finally:
        pickle_scan._resumable, pickle_scan.RESUMABLE_BYTES = kept, threshold
    assert resumed == fresh


# --- Lightning ------------------------------------------------------------------------------------
# A Lightning checkpoint pickles hyper-parameters and callback state of any class beside the
# state_dict; none of it is needed for a merge, so no value there may stop one.


class Outer:
    class Inner:
        """Pickled as ``getattr(Outer, "Inner")``, then an object made of what that call returned."""

        def __init__(self, value: Any) -> None:
            self.value = value


def nested_tuple(depth: int) -> tuple:
    value: tuple = ()
    for _ in range(depth):
        value = (value,)
    return value


# Within the pickle pre-scan's bound of 1000 levels, with room for the dicts around it.
DEEP_TUPLE = nested_tuple(900)
stdlib_objects = st.sampled_from(
    [
        zoneinfo.ZoneInfo("UTC"),  # through a classmethod: getattr(ZoneInfo, "_unpickle")(key, 1)
        datetime(2025, 1, 1, tzinfo=zoneinfo.ZoneInfo("Europe/Paris")),
        Outer.Inner(1),
        Path("/data"),
        Decimal("1.5"),
        Fraction(1, 3),
        uuid.UUID(int=5),
        collections.deque([1, 2]),
        collections.defaultdict(list, a=[1]),
        collections.Counter(a=1),
        complex(1, 2),
        range(3),
        slice(1, 2),
        re.compile("a+"),
    ]
)
# Tensors among trainer state: of a dtype ckptavg reads or not, under any key (read only if named).
tensors = st.sampled_from([torch.ones(2), torch.ones(2, dtype=torch.complex64), torch.ones(2).to(torch.float8_e5m2)])
hyper_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | huge
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | stdlib_objects
    | tensors
)
hyper_keys = (
    st.text(max_size=4)
    | st.integers()
    | huge
    | st.builds(lambda: DEEP_TUPLE)  # shown by name: Hypothesis's repr of it would recurse too deep
    | st.sampled_from([zoneinfo.ZoneInfo("UTC"), "UTC", (1, "a"), "(1, 'a')"])  # two keys, one name
)
hyper_values = st.recursive(
    hyper_leaves,
    # Dicts made of pairs: st.dictionaries shows a key when it filters out a repeat, and HUGE has no repr.
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.lists(st.tuples(hyper_keys, inner), max_size=3).map(dict)
    ),
    max_leaves=10,
)
# What Lightning saves there: dicts (whose tensors the reader names and locates).
hyper_dicts = st.lists(st.tuples(hyper_keys, hyper_values), max_size=4).map(dict)


@FUZZ
@given(hyper_parameters=hyper_dicts, callbacks=hyper_dicts)
def test_lightning_hyper_parameters_never_stop_a_read(scratch, hyper_parameters, callbacks):
    """Any value torch.save pickles among the hyper-parameters or callback state (integers past
    Python's 4300 digits, tuples nested 900 deep as keys, objects that pickle through a
    classmethod or a nested class, tensors of any dtype under any key): the state_dict reads."""
    state = {
        "state_dict": {"w": TENSORS["w"], "b": TENSORS["b"]},
        "global_step": 1,
        "hyper_parameters": hyper_parameters,
        "callbacks": {"Mine": callbacks},
    }
    buffer = io.BytesIO()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # for the pickler, which recurses once per level of the tuple
    try:
        torch.save(state, buffer)
    finally:
        sys.setrecursionlimit(limit)
    with checkpoint(scratch, {"epoch=0-step=1.ckpt": buffer.getvalue()}) as folder:
        assert read_everything(folder / "epoch=0-step=1.ckpt") is None


@pytest.mark.parametrize("layout", ["pt", "lightning"])
def test_names_are_made_only_for_tensors_and_bounded_by_the_file(scratch, layout):
    """One key of 1 MiB above 20,000 entries (a memoized tensor, or an integer), which pickle in
    1.2 MB: joined into every entry's path, their names alone would take 20 GB (MemoryError under
    read_everything's cap). A state dict's tensors are named, within a budget; any other entry,
    and the path the search for skipped globals walks, never is."""
    wide = dict.fromkeys(range(20_000), torch.ones(2) if layout == "pt" else 0)
    buffer = io.BytesIO()
    if layout == "pt":
        torch.save({"x" * 2**20: wide}, buffer)
        message = check_pt(scratch, buffer.getvalue())
        assert message is not None and "tensor names are longer than the file" in message, message
    else:
        torch.save({"state_dict": {"w": TENSORS["w"], "x" * 2**20: wide}, "global_step": 1}, buffer)
        with checkpoint(scratch, {"epoch=0-step=1.ckpt": buffer.getvalue()}) as folder:
            assert read_everything(folder / "epoch=0-step=1.ckpt") is None


# --- end to end -----------------------------------------------------------------------------------


def test_bad_files_are_one_line_errors_from_the_cli(tmp_path, dcp_base, pt_base):
    """``ckptavg merge`` of a run whose checkpoint is damaged: exit status 1 and one error line.
    The first case runs the real entry point in a new interpreter; the others the same typer
    app in this process (a torch import costs seconds a process)."""
    bad = {
        "step1": {"model.pt": pt_base[:100] + bytes(b ^ 0x5A for b in pt_base[100:300]) + pt_base[300:]},
        "step2": {"model.safetensors": safetensors_file(BASE_SAFETENSORS[8:], b"", 2**63)},
        "step3": {"model.safetensors": safetensors_file(b'{"w": {"dtype": "F32", "shape": [Infinity]}}')},
        "step4": {**dcp_base, ".metadata": dcp_base[".metadata"][:200]},
        "step5": {**dcp_base, ".metadata": hostile_pickles(tmp_path / "ran")["os.system"]},
    }
    for step, files in bad.items():
        run = tmp_path / f"run-{step}"
        (run / step).mkdir(parents=True)
        for name, data in files.items():
            (run / step / name).write_bytes(data)
        result = (run_cli if step == "step1" else run_cli_in_process)("merge", str(run), "--last", "1")
        assert result.returncode == 1, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptavg: error: "), result.stderr
        assert "Traceback" not in result.stderr
        assert f"{step}/" in lines[0]
        assert not (run / f"{step}-merged").exists()
    assert not (tmp_path / "ran").exists()


def test_the_unedited_files_read(scratch, dcp_base, pt_base):
    """The fuzzing starts from files that read: the edits, not the bases, cause the errors."""
    assert check_safetensors(scratch, BASE_SAFETENSORS) is None
    assert check_pt(scratch, pt_base) is None
    with checkpoint(scratch, dcp_base) as folder:
        assert read_everything(folder) is None
    assert dataclasses.is_dataclass(pickle.loads(dcp_base[".metadata"]))
