"""Bounds on a pickle, checked before CPython's unpickler sees a byte.

The unpickler believes what a pickle claims: it allocates a bytes length, and grows its memo
table to a memo index, before it reads either (a 9-byte pickle costs gigabytes); and it builds a
tuple nested a million deep, which crashes the interpreter once hashed (as a dict key), in C,
with no exception to catch. :func:`prescan` walks the opcodes once and refuses a pickle that
claims more than it holds or nests deeper than :data:`MAX_PICKLE_DEPTH`.

The walk follows the unpickler's stack, marks and memo as ``_pickle.c`` does (a POP takes the
top mark when no object lies above it), keeping for each object how deeply it nests: a new
object 0, a tuple or a call's result one more than the deepest object it takes, and a list, dict
or instance one more than the deepest object added to it. An object added to after it was
memoized or duplicated keeps its old depth in the other places; such an object is a list, dict
or instance, which hashing does not enter (unhashable, or hashed by identity), while tuples are
complete when made. The one other object an allow-list lets a pickle hash by its contents is
DCP's storage key, whose fields are checked flat when set (:class:`ckptavg.formats.dcp._MetadataIndex`).

The cost is one pass in Python, with the common opcodes inline: DCP metadata of 57,600 chunks
(8 MB, 4 million opcodes) takes 0.74 s, where unpickling it takes 1.0 s, opening the checkpoint
without the pass 1.8 s, and ``pickletools.genops`` alone 1.1 s. The checkpoints of one run
pickle their DCP metadata alike but near its end: each long pickle's scan starts where the last
one's could be kept (:class:`_Resumable`), so a run pays about one pass.
"""

from __future__ import annotations

import array
import pickletools
import struct
import threading

from ..errors import CheckpointError

# A state dict or DCP metadata nests objects about ten deep; hashing a tuple recurses in C once
# per level, which a thread's stack bears for tens of thousands of levels.
MAX_PICKLE_DEPTH = 1000

# What an opcode does to the unpickler's stack, as far as the bounds need to know: the common
# ones first (tested in this order), then those that :func:`_rare` handles.
(
    _MEMOIZE,  # stores the top object at the next memo index
    _GET1,  # BINGET: pushes the object at a 1-byte memo index
    _GET4,  # LONG_BINGET: at a 4-byte memo index
    _LEAF,  # pushes a new object; a fixed-size argument
    _MARK,
    _WRAP1,  # pops an object, pushes one that may hold it (TUPLE1)
    _WRAP2,  # pops two objects, pushes one that may hold them (TUPLE2, REDUCE, NEWOBJ)
    _ADD1,  # pops an object into the object below it (APPEND, BUILD)
    _WRAP_MARK,  # pops the objects above the top mark, pushes one that may hold them
    _ADD_MARK,  # pops the objects above the top mark into the object below them
    _WRAP3,  # TUPLE3, NEWOBJ_EX
    _ADD2,  # SETITEM
    _SIZED_LEAF,  # pushes a new object; a counted or newline-ended argument
    _GET_TEXT,  # GET: pushes the object at a decimal memo index
    _PUT,  # stores the top object at the memo index given
    _INST,  # like _WRAP_MARK, with a module and a name line
    _POP,
    _POP_MARK,
    _DUP,
    _FRAME,  # announces the length of the opcodes that follow
    _NOTHING,
    _STOP,
    _INVALID,  # a byte that is no opcode
) = range(23)
# How an argument is laid out: a fixed number of bytes (>= 0), or one of these.
_LINE, _TWO_LINES, _COUNTED1, _COUNTED4, _COUNTED4_SIGNED, _COUNTED8 = -1, -2, -3, -4, -5, -6
_LAYOUTS = {
    **dict.fromkeys(("long1", "string1", "bytes1", "unicodestring1"), _COUNTED1),
    **dict.fromkeys(("bytes4", "unicodestring4"), _COUNTED4),
    **dict.fromkeys(("long4", "string4"), _COUNTED4_SIGNED),
    **dict.fromkeys(("bytes8", "bytearray8", "unicodestring8"), _COUNTED8),
    "stringnl_noescape_pair": _TWO_LINES,  # GLOBAL and INST
}
_NAMED = {
    "MEMOIZE": _MEMOIZE,
    "BINGET": _GET1,
    "LONG_BINGET": _GET4,
    "GET": _GET_TEXT,
    "APPEND": _ADD1,
    "BUILD": _ADD1,
    "SETITEM": _ADD2,
    "APPENDS": _ADD_MARK,
    "SETITEMS": _ADD_MARK,
    "ADDITEMS": _ADD_MARK,
    "MARK": _MARK,
    "INST": _INST,
    "PUT": _PUT,
    "BINPUT": _PUT,
    "LONG_BINPUT": _PUT,
    "POP": _POP,
    "POP_MARK": _POP_MARK,
    "DUP": _DUP,
    "FRAME": _FRAME,
    "PROTO": _NOTHING,
    "READONLY_BUFFER": _NOTHING,  # the top object, as a read-only buffer
    "STOP": _STOP,
}
_U4 = struct.Struct("<I").unpack_from
_I4 = struct.Struct("<i").unpack_from
_U8 = struct.Struct("<Q").unpack_from


def _tables() -> tuple[list[int], list[int]]:
    """Per opcode byte: its effect, and its argument's layout (from pickletools' description of
    every opcode)."""
    effects, layouts = [_INVALID] * 256, [0] * 256
    for op in pickletools.opcodes:
        code = ord(op.code)
        before = [item.name for item in op.stack_before]
        if op.arg is not None:
            layout = _LAYOUTS.get(op.arg.name, op.arg.n)
            layouts[code] = _LINE if layout == pickletools.UP_TO_NEWLINE else layout
        if op.name in _NAMED:
            effects[code] = _NAMED[op.name]
        elif "mark" in before:
            effects[code] = _WRAP_MARK
        elif before:
            effects[code] = (_WRAP1, _WRAP2, _WRAP3)[len(before) - 1]
        else:
            effects[code] = _LEAF if layouts[code] >= 0 else _SIZED_LEAF
    return effects, layouts


_EFFECTS, _LAYOUT = _tables()


class _Unbounded(Exception):
    """The pickle claims what it does not hold, or nests past the bound."""


def _argument_end(data: bytes, start: int, layout: int) -> int:
    """Where an argument at ``start`` ends; past ``len(data)`` when it claims more than remains,
    which the caller checks before anything believes the claim."""
    if layout >= 0:
        return start + layout
    if layout == _COUNTED1:
        return start + 1 + data[start]
    if layout == _COUNTED4:
        return start + 4 + _U4(data, start)[0]
    if layout == _COUNTED4_SIGNED:
        (length,) = _I4(data, start)
        if length < 0:
            raise ValueError(f"a negative length {length}")
        return start + 4 + length
    if layout == _COUNTED8:
        return start + 8 + _U8(data, start)[0]
    end = data.index(b"\n", start) + 1
    return data.index(b"\n", end) + 1 if layout == _TWO_LINES else end


def prescan(data: bytes, where: str) -> None:
    """Refuse ``data`` unless every claim in it is bounded by what it holds: each length (bytes,
    strings, long integers, a frame) by the bytes that remain, each memo index by the bytes
    before it, and the nesting of objects by :data:`MAX_PICKLE_DEPTH`. A pickle broken in
    another way is refused as corrupt; one that passes is left to the unpickler to judge."""
    try:
        _scan(data)
    except _Unbounded as exc:
        raise CheckpointError(f"{where}: refusing to unpickle it: {exc}") from None
    except _Corrupt as exc:
        at, cause = exc.args
        # Past the end, an object, mark or memo entry that is not there, a malformed number: a
        # broken pickle, which the unpickler would refuse too.
        what = cause if isinstance(cause, ValueError) and str(cause) else "it breaks off or does not add up"
        raise CheckpointError(f"{where}: corrupt pickle (at byte {at}: {what})") from None


class _Corrupt(Exception):
    """(where, the exception): the pickle breaks off or does not add up there."""


# A pickle at least this long has its scan kept (:class:`_Resumable`): the checkpoints of one run
# pickle their DCP metadata alike but for a few bytes near the end (the checkpoint's path and
# save id), and scanning it costs ~9 ms at 8 ranks (160 KB), ~90 ms at 64 (1 MB), each checkpoint again.
RESUMABLE_BYTES = 64 * 2**10
# The longest pickle whose scan is kept. What is kept, the pickle and two states (mostly their
# memo), is about twice its size (measured on DCP metadata), where each checkpoint's unpickled
# metadata takes about 14 times its size.
_RESUMABLE_MAX = 8 * 2**20
# How far before the end the scan's state is kept: where the pickles of one run differ (DCP's
# storage_meta, the checkpoint's path and save id, is the last field pickled).
_SNAPSHOTS_BEFORE_END = (2**12, 2**9)


# A scan's state at an opcode boundary, as :class:`_Resumable` keeps it: (position, stack,
# marks, memo: :func:`_kept_memo`).
_State = tuple[int, list[int], list[int], "array.array[int] | dict[int, int]"]


def _kept_memo(memo: dict[int, int]) -> array.array[int] | dict[int, int]:
    """``memo`` as a state keeps it: its depths in order where its indices are 0, 1, 2, ... (a
    pickle of protocol 4 or 5 memoizes so), a tenth of the dict's memory; else a copy."""
    if list(memo) == list(range(len(memo))):
        return array.array("q", memo.values())
    return dict(memo)


def _memo_from(kept: array.array[int] | dict[int, int]) -> dict[int, int]:
    """A memo to scan on with, from one :func:`_kept_memo` kept."""
    return dict(enumerate(kept)) if isinstance(kept, array.array) else dict(kept)


class _Resumable:
    """The last long pickle scanned, and the scan's state (how deeply each object on the stack,
    behind each mark and in the memo nests) at two opcode boundaries near its end. The scan
    of a pickle is a function of its bytes: another pickle of the same length with the same
    bytes up to such a boundary has the same state there (every claim checked before it, a
    length against the bytes that remain, a memo index against the position, came out the
    same), so its scan starts there. Scans run in the opening threads: one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = b""
        self._states: list[_State] = []

    def start(self, data: bytes) -> tuple[list[_State], tuple[int, list[int], list[int], dict[int, int]]]:
        """The kept states that hold for ``data`` too (those up to the latest whose bytes before
        it ``data`` shares), and the state to scan ``data`` from: a copy of the latest of them,
        else the start."""
        with self._lock:
            if len(data) == len(self._data):
                for index in reversed(range(len(self._states))):
                    at, stack, marks, memo = self._states[index]
                    if data[:at] == self._data[:at]:
                        return self._states[: index + 1], (at, list(stack), list(marks), _memo_from(memo))
        return [], (0, [], [], {})

    def keep(self, data: bytes, states: list[_State]) -> None:
        with self._lock:
            self._data, self._states = data, states


_resumable = _Resumable()
_NEVER = 2**63  # past any position: the scan goes on to STOP, or to an error


def _scan(data: bytes) -> None:
    """:func:`prescan`'s walk; for a long pickle, from a state of the last one where they agree,
    keeping its own states near its end for the next."""
    kept = RESUMABLE_BYTES <= len(data) <= _RESUMABLE_MAX
    states, (at, stack, marks, memo) = _resumable.start(data) if kept else ([], (0, [], [], {}))
    states = list(states)
    stops = sorted(len(data) - back for back in _SNAPSHOTS_BEFORE_END) if kept else []
    for stop in [*stops, _NEVER]:  # the last run ends at STOP, or refuses the pickle
        if stop <= at:
            continue
        at = _run(data, at, stop, stack, marks, memo)
        if at < 0:
            break
        states.append((at, list(stack), list(marks), _kept_memo(memo)))
    if kept:
        _resumable.keep(data, states)


def _run(data: bytes, at: int, stop: int, stack: list[int], marks: list[int], memo: dict[int, int]) -> int:
    """Scan from the opcode at ``at`` to the first opcode at or past ``stop``: where that is, or
    -1 at STOP."""
    effects, layouts, limit = _EFFECTS, _LAYOUT, MAX_PICKLE_DEPTH
    try:
        while at < stop:  # the common opcodes inline: this loop runs once per opcode, millions of times
            code = data[at]
            effect = effects[code]
            if effect == _MEMOIZE:
                memo[len(memo)] = stack[-1]
                at += 1
            elif effect == _GET1:
                stack.append(memo[data[at + 1]])
                at += 2
            elif effect == _GET4:
                stack.append(memo[_U4(data, at + 1)[0]])
                at += 5
            elif effect == _LEAF:
                stack.append(0)
                at += 1 + layouts[code]
            elif effect == _MARK:
                marks.append(len(stack))
                at += 1
            elif effect <= _ADD_MARK:  # one of those below (the order of the effects above)
                if effect == _WRAP1:
                    depth = stack[-1] + 1
                    stack[-1] = depth
                elif effect == _WRAP2:
                    last, below = stack.pop(), stack[-1]
                    depth = (last if last > below else below) + 1  # not max(): a call costs more here
                    stack[-1] = depth
                elif effect == _ADD1:
                    depth = stack.pop() + 1
                    if depth > stack[-1]:
                        stack[-1] = depth
                else:  # _WRAP_MARK or _ADD_MARK
                    depth = _gather(stack, marks.pop(), effect == _ADD_MARK)
                if depth > limit:
                    raise _Unbounded(f"it nests objects deeper than {limit} levels (byte {at})")
                at += 1
            else:
                at = _rare(data, at, effect, stack, marks, memo)
                if at < 0:
                    return -1
    except (IndexError, KeyError, ValueError, struct.error) as exc:
        raise _Corrupt(at, exc) from None
    return at


def _gather(stack: list[int], first: int, adds: bool) -> int:
    """Pop the objects from ``first`` on; push one that holds them, or with ``adds`` add them to
    the object below. Their holder's depth."""
    if first < adds or first > len(stack):  # no object to add to; a mark above the stack
        raise IndexError
    depth = max(stack[first:], default=-1) + 1
    del stack[first:]
    if not adds:
        stack.append(depth)
    elif depth > stack[-1]:
        stack[-1] = depth
    return depth


def _rare(data: bytes, at: int, effect: int, stack: list[int], marks: list[int], memo: dict[int, int]) -> int:
    """:func:`prescan` for the opcodes that are not among the common ones, and for those with
    an argument of variable length: where the next opcode starts, or -1 at STOP."""
    if effect == _INVALID:
        raise ValueError(f"byte {data[at]:#04x} is no opcode")
    layout = _LAYOUT[data[at]]
    end = _argument_end(data, at + 1, layout)
    if end > len(data):
        raise _Unbounded(f"the opcode at byte {at} claims {end - at - 1} bytes; the pickle ends first")
    if effect == _SIZED_LEAF:
        stack.append(0)
    elif effect == _GET_TEXT:
        stack.append(memo[int(data[at + 1 : end - 1])])
    elif effect == _PUT:
        index = (
            int(data[at + 1 : end - 1]) if layout == _LINE else data[at + 1] if layout == 1 else _U4(data, at + 1)[0]
        )
        if index > at:  # the memo table grows to the index
            raise _Unbounded(f"the opcode at byte {at} claims memo index {index}; the pickle is too short")
        memo[index] = stack[-1]
    elif effect in (_INST, _WRAP3, _ADD2):
        adds = effect == _ADD2
        depth = _gather(stack, marks.pop() if effect == _INST else len(stack) - 3 + adds, adds)
        if depth > MAX_PICKLE_DEPTH:
            raise _Unbounded(f"it nests objects deeper than {MAX_PICKLE_DEPTH} levels (byte {at})")
    elif effect == _POP:
        if marks and marks[-1] == len(stack):  # nothing above the top mark: POP takes the mark
            marks.pop()
        else:
            stack.pop()
    elif effect == _POP_MARK:
        del stack[marks.pop() :]
    elif effect == _DUP:
        stack.append(stack[-1])
    elif effect == _FRAME:
        (length,) = _U8(data, at + 1)
        if end + length > len(data):
            raise _Unbounded(f"the frame at byte {at} claims {length} bytes; the pickle ends first")
    elif effect == _STOP:
        return -1
    return end
