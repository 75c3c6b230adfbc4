"""Getting a step's weights to the CPU side without stalling the training loop.

The training thread only starts a capture; a background worker reads it. What it reads:

* CPU tensors (CPU training, CPU-offloaded FSDP) are read in place, with no copy at all. The
  next ``torch.optim.Optimizer.step()`` of the process — the first thing that changes them —
  waits until the worker has read them (a global optimizer step pre-hook).
* CUDA tensors are copied into reused pinned host buffers by non-blocking copies on a side
  stream; the next optimizer step's CUDA stream waits for the copy on the device, so the
  training thread never blocks on it. Two buffer sets rotate; the training thread waits only
  when both are still being read.
* Other devices are copied synchronously.

``release="copy"`` is for loops that change weights without an optimizer step: CPU tensors are
then copied into reused buffers and CUDA copies are ordered before the next kernel at once.

Under FSDP2 or tensor parallelism, each process reads only its local shard (DTensor); a shard
replicated over several processes is read by one of them only.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import ConfigError
from ..formats.layout import TensorSpec
from ..formats.parts import Block
from ..formats.safetensors import DTYPE_NAMES
from ..units import numel
from .workers import inline_copy

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

RELEASE_MODES = ("optimizer", "copy")
BUFFER_SETS = 2


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside torch.distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class Entry:
    """One state-dict entry as this process holds it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the full tensor
    offsets: tuple[int, ...]  # of this process's block in the full tensor
    local_shape: tuple[int, ...]
    owned: bool  # this process stores the block (a replica held elsewhere too is owned by one process)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True)
class ModelLayout:
    """Which blocks of which tensors this process holds; fixed for the whole run."""

    entries: tuple[Entry, ...]
    rank: int
    world_size: int

    @property
    def table(self) -> list[TensorSpec]:
        return [e.spec for e in self.entries]

    @property
    def owned(self) -> list[Entry]:
        return [e for e in self.entries if e.owned and numel(e.local_shape)]


def _is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    if not torch.distributed.is_available():
        return False
    # Here, not at the top: torch.distributed may be absent from a build (the check above).
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _entry(name: str, tensor: torch.Tensor, rank: int) -> tuple[Entry, torch.Tensor]:
    if tensor.dtype not in DTYPE_NAMES:
        raise ConfigError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
    if _is_dtensor(tensor):
        return _sharded_entry(name, tensor)
    # A plain tensor in a multi-process run is a replica (DDP): process 0 stores it.
    zeros = (0,) * tensor.dim()
    shape = tuple(tensor.shape)
    return Entry(name, tensor.dtype, shape, zeros, shape, rank == 0), tensor


def _sharded_entry(name: str, tensor: DTensor) -> tuple[Entry, torch.Tensor]:
    """This process's block of a DTensor (FSDP2, tensor parallelism), owned by one process of
    those that hold a replica of it."""
    try:
        chunks = tensor.__create_chunk_list__()  # the blocks torch.distributed.checkpoint writes
    except RuntimeError as exc:
        raise ConfigError(f"tensor {name!r} cannot be captured: {exc}") from exc
    local = tensor.to_local()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise ConfigError(f"tensor {name!r}: unsupported sharding {tensor.placements} (not one block per process)")
    coordinate = tensor.device_mesh.get_coordinate()
    owned = coordinate is not None and all(
        index == 0 for index, placement in zip(coordinate, tensor.placements, strict=True) if placement.is_replicate()
    )
    entry = Entry(name, tensor.dtype, tuple(tensor.shape), tuple(chunks[0].offsets), tuple(local.shape), owned)
    return entry, local


def local_tensors(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
) -> tuple[list[Entry], list[torch.Tensor], list[bool]]:
    """The model's state-dict entries, this process's local tensor of each, and whether each is
    a parameter (changed only by the optimizer step; buffers may change in the forward pass)."""
    if isinstance(model, Mapping):
        state = model
        parameters = {name for name, tensor in model.items() if isinstance(tensor, torch.nn.Parameter)}
    else:
        state = model.state_dict()
        parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    rank, _ = process_rank()
    entries, tensors, is_parameter = [], [], []
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        entry, local = _entry(name, tensor.detach(), rank)
        entries.append(entry)
        tensors.append(local)
        is_parameter.append(name in parameters)
    return entries, tensors, is_parameter


def layout_of(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> ModelLayout:
    entries, _, _ = local_tensors(model)
    rank, world = process_rank()
    return ModelLayout(tuple(entries), rank, world)


class Capture:
    """One step's owned blocks, as the worker reads them. The worker calls :meth:`wait_ready`
    before reading and :meth:`release` (always, in a ``finally``) when done."""

    def __init__(
        self,
        step: int,
        blocks: list[Block],
        events: list[Any],
        on_release: Callable[[], None] | None,
        in_place: frozenset[str] = frozenset(),
    ) -> None:
        self.step = step
        self.blocks = blocks
        self.in_place = in_place  # names of blocks whose data is the live parameter itself
        self.events = events  # CUDA events recorded after the copies into host buffers
        self._on_release = on_release
        self.released = threading.Event()

    def wait_ready(self) -> None:
        for event in self.events:
            event.synchronize()

    def detached(self, staging: dict[str, torch.Tensor]) -> list[Block]:
        """The blocks, with those read in place from live parameters first copied into
        ``staging`` (reused host buffers, by name), so that :meth:`release_parameters` may come
        before slow work on them such as a file write."""
        blocks = []
        for block in self.blocks:
            if block.name in self.in_place:
                buffer = staging.get(block.name)
                if buffer is None or buffer.shape != block.data.shape or buffer.dtype != block.data.dtype:
                    buffer = staging[block.name] = torch.empty_like(block.data, memory_format=torch.contiguous_format)
                inline_copy(buffer, block.data)
                block = Block(block.name, block.offsets, buffer)
            blocks.append(block)
        return blocks

    def release_parameters(self) -> None:
        """The live parameters are read (or copied): the optimizer step may change them."""
        self.released.set()

    def release(self) -> None:
        """Done with everything: the host buffers go back to the pool, too."""
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()
        self.released.set()


@dataclass
class _Pending:
    """A capture whose parameters the next optimizer step must not change before they are read."""

    capture: Capture
    copies: dict[torch.device, Any]  # device -> event after the parameters' device-to-host copies


class _BufferSets:
    """A fixed number of reusable sets of host buffers; :meth:`take` waits while all are out."""

    def __init__(self, count: int) -> None:
        self._free: queue.Queue[list[torch.Tensor]] = queue.Queue()
        self._left_to_make = count

    def take(self, make: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            if self._left_to_make:
                self._left_to_make -= 1
                return make()
        return self._free.get()  # the one place the training thread may wait

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        self._free.put(buffers)


class WeightCapture:
    """Starts captures in the training thread and keeps parameters unchanged until read."""

    def __init__(self, release: str = "optimizer") -> None:
        if release not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {', '.join(RELEASE_MODES)}, got {release!r}")
        self.release_mode = release
        self.layout: ModelLayout | None = None
        self.optimizer_steps = 0
        self._pending: _Pending | None = None
        self._buffers = _BufferSets(BUFFER_SETS)
        self._streams: dict[torch.device, Any] = {}
        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1
        self._hold_back_changes()

    def _hold_back_changes(self) -> None:
        """The weights are about to change: order that after the pending capture's reads. CUDA
        copies are waited for by the training stream, on the device (the training thread goes
        on); only CPU parameters that the worker reads in place make the training thread wait."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        for device, event in pending.copies.items():
            torch.cuda.current_stream(device).wait_event(event)
        if pending.capture.in_place:
            pending.capture.released.wait()

    def take(self, step: int, model: torch.nn.Module | Mapping[str, torch.Tensor]) -> Capture:
        """Start capturing this process's owned blocks (the training thread returns at once)."""
        entries, tensors, is_parameter = local_tensors(model)
        self._check_layout(entries)
        self._settle_pending(step)
        owned = [(e, t, p) for e, t, p in zip(entries, tensors, is_parameter, strict=True) if e.owned and t.numel()]
        # Parameters wait for the next optimizer step; buffers (which the forward pass may
        # change, e.g. running statistics) and everything under release="copy" are copied now.
        now = [t for _, t, p in owned if self.release_mode == "copy" or not p]
        later = [t for _, t, p in owned if self.release_mode == "optimizer" and p and t.device.type != "cpu"]
        copied = now + later
        buffers = self._buffers.take(lambda: [self._host_buffer(t) for t in copied]) if copied else []
        target = {id(t): buffer for t, buffer in zip(copied, buffers, strict=True)}
        copied_now = self._copy([(t, target[id(t)]) for t in now])
        for device, event in copied_now.items():
            torch.cuda.current_stream(device).wait_event(event)  # before the next kernel changes them
        copied_later = self._copy([(t, target[id(t)]) for t in later])
        blocks = [Block(e.name, e.offsets, target.get(id(t), t)) for e, t, _ in owned]
        on_release = (lambda: self._buffers.give_back(buffers)) if buffers else None
        in_place = frozenset(e.name for e, t, _ in owned if id(t) not in target)
        capture = Capture(step, blocks, [*copied_now.values(), *copied_later.values()], on_release, in_place)
        if in_place or copied_later:
            self._pending = _Pending(capture, copied_later)
        return capture

    def _check_layout(self, entries: list[Entry]) -> None:
        if self.layout is None:
            rank, world = process_rank()
            self.layout = ModelLayout(tuple(entries), rank, world)
        elif tuple(entries) != self.layout.entries:
            changed = next(
                (a.name for a, b in zip(entries, self.layout.entries, strict=False) if a != b),
                f"{len(entries)} entries instead of {len(self.layout.entries)}",
            )
            raise ConfigError(f"the model's state dict changed during training ({changed})")

    def _settle_pending(self, step: int) -> None:
        """A new capture while the previous one still waits for an optimizer step. A skipped
        step (an AMP overflow) changes nothing; a loop with no optimizer at all changes the
        weights while they are read, so that is refused."""
        pending = self._pending
        if pending is None:
            return
        if self.optimizer_steps == 0:
            self._pending = None
            raise ConfigError(
                f"no torch.optim optimizer step ran between the captures of steps {pending.capture.step} and "
                f"{step}; the hook reads weights until the next optimizer step, so a loop that changes them "
                "another way needs release='copy'"
            )
        # Not a wait for the worker to finish: a CUDA capture's host buffers stay its own until
        # the worker gives them back, so after a skipped step training goes on at once.
        self._hold_back_changes()

    @staticmethod
    def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.device.type == "cuda"
        return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=pinned)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[torch.device, Any]:
        """Copy tensors into host buffers: CUDA ones asynchronously on a side stream that first
        waits for the training stream (the step's writes); returns an event per CUDA device."""
        events: dict[torch.device, Any] = {}
        for tensor, buffer in pairs:
            if tensor.device.type != "cuda":
                buffer.copy_(tensor)
                continue
            stream = self._streams.get(tensor.device)
            if stream is None:
                stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
            if tensor.device not in events:
                stream.wait_stream(torch.cuda.current_stream(tensor.device))
                # blocking: the worker's synchronize() then sleeps until the copy is done; a
                # default event busy-waits, taking a host core from training for every copy.
                events[tensor.device] = torch.cuda.Event(blocking=True)
            with torch.cuda.stream(stream):
                buffer.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory is not reused before the copy is done
        for device, event in events.items():
            event.record(self._streams[device])
        return events

    def close(self) -> None:
        self._hook.remove()
        if self._pending is not None:
            self._pending.capture.released.wait()
            self._pending = None
