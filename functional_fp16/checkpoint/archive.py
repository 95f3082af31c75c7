"""Step 1 of a checkpoint's checks, before ``torch.load``: its zip container and its pickle.

(Steps 2 and 3 are in :mod:`functional_fp16.checkpoint.format`.)
Package-public, not part of the API.

:func:`check_archive` reads the zip container's directory from the open
file that ``torch.load`` will read next: records stored uncompressed under
names of their own, adding up to no more than the file, so nothing the
loader reads is larger than the file.

Then :func:`check_pickle` reads the opcodes of its ``data.pkl``.
``torch.load(weights_only=True)`` runs no pickled code, but it does call
what its allow-list names, and that list serves every use of ``torch.save``,
not only checkpoints: ``bytearray(n)`` and ``torch.UntypedStorage(n)``
allocate ``n`` bytes for a file of a few hundred, and
``collections.OrderedDict(view)`` walks a stride-0 view of a few bytes row
by row. So the opcodes are read once (:func:`pickletools.genops`, in time
and memory bounded by the pickle's size) and what they would put on the
stack is followed symbolically, building nothing. Only what ``torch.save``
writes for a checkpoint of either format passes:

- the protocol-2 opcodes for dicts, lists, tuples, strings, numbers,
  booleans, ``None`` and the memo (:data:`OPCODES`);
- references (``GLOBAL``) to :data:`ALLOWED_GLOBALS` only: the two tensor
  rebuild functions, ``collections.OrderedDict``, the storage classes that
  name a dtype (:data:`STORAGE_ITEM_BYTES`) and the dtypes (:data:`DTYPES`);
- two kinds of call (``REDUCE``): ``collections.OrderedDict()`` without
  arguments (a tensor's empty hook table), and
  ``torch._utils._rebuild_tensor_v2`` / ``_v3`` with exactly ``(storage,
  offset, size, stride, requires_grad, hooks)`` (and a dtype for ``_v3``) of
  those types. A rebuild makes a view of a storage read from a record;
  such a storage cannot be resized, so a view larger than its storage fails
  instead of allocating (and step 2 refuses any tensor that is not exactly
  its storage);
- storages (``BINPERSID``) only as ``("storage", storage class, key,
  location, numel)``, where the archive's record ``data/<key>`` holds
  exactly ``numel`` items of the class's size.

Whatever else a pickle holds is refused with a
:class:`~functional_fp16.checkpoint.format.CheckpointCorruptError` that
names it, escaped.
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from typing import Any, BinaryIO

import torch

from functional_fp16.checkpoint.format import CheckpointCorruptError, corrupt, show

_LEGACY_STORAGES = {
    "Bool": torch.bool,
    "Byte": torch.uint8,
    "Char": torch.int8,
    "Short": torch.int16,
    "Int": torch.int32,
    "Long": torch.int64,
    "Half": torch.float16,
    "BFloat16": torch.bfloat16,
    "Float": torch.float32,
    "Double": torch.float64,
    "ComplexFloat": torch.complex64,
    "ComplexDouble": torch.complex128,
}
STORAGE_ITEM_BYTES: dict[str, int] = {
    **{f"torch.{name}Storage": dtype.itemsize for name, dtype in _LEGACY_STORAGES.items()},
    "torch.storage.UntypedStorage": 1,
}
"""The storage classes ``torch.save`` names for a CPU tensor, and their items' sizes.

``torch.FloatStorage`` and the like for the dtypes that have one (written
with ``_rebuild_tensor_v2``), ``torch.storage.UntypedStorage`` (bytes) for the
others (``_rebuild_tensor_v3``, which names the dtype too).
"""

DTYPES = frozenset(
    str(v)
    for v in list(vars(torch).values())
    if isinstance(v, torch.dtype) and not str(v).startswith("torch.q")  # not quantized
)
"""The dtypes a ``_rebuild_tensor_v3`` call may name: every dtype of this torch but the quantized."""

_REBUILD = {"torch._utils._rebuild_tensor_v2": False, "torch._utils._rebuild_tensor_v3": True}
_ORDERED_DICT = "collections.OrderedDict"

ALLOWED_GLOBALS = frozenset(_REBUILD) | {_ORDERED_DICT} | frozenset(STORAGE_ITEM_BYTES) | DTYPES
"""Every module-level name a checkpoint's pickle may refer to."""

OPCODES = frozenset(
    "PROTO STOP MARK EMPTY_DICT EMPTY_LIST EMPTY_TUPLE NONE NEWTRUE NEWFALSE "
    "BININT BININT1 BININT2 LONG1 BINFLOAT BINUNICODE BINPUT LONG_BINPUT BINGET "
    "LONG_BINGET TUPLE TUPLE1 TUPLE2 TUPLE3 APPEND APPENDS SETITEM SETITEMS "
    "GLOBAL REDUCE BINPERSID".split()
)
"""The pickle opcodes a checkpoint's pickle may use: those ``torch.save`` writes for one."""

_VALUE_OPCODES = frozenset("BININT BININT1 BININT2 LONG1 BINFLOAT BINUNICODE".split())
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}


class _Made:
    """What an opcode made, where it is not a plain value: a global, a storage, a tensor..."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str = "") -> None:
        self.kind, self.name = kind, name


def _is(x: Any, kind: str) -> bool:
    return type(x) is _Made and x.kind == kind


def _ints(x: Any) -> bool:
    return type(x) is tuple and all(type(n) is int for n in x)


def _unreadable(file: str, why: str) -> CheckpointCorruptError:
    return corrupt(
        file,
        f"not a readable checkpoint (truncated, corrupted, or not written by save_checkpoint): {why}",
    )


def check_archive(f: BinaryIO, file: str) -> int:
    """Checks the zip container and the pickle ``torch.load`` will read from ``f``.

    ``f`` is an open binary file, at the archive's start, and is left there.
    The file must be in ``torch.save``'s zip format (the older format declares
    its storages' sizes itself, so it is refused), with one ``data.pkl``
    record, every record stored uncompressed under its own name, and the
    records' sizes adding up to no more than the file's: a record compressed
    1000:1, or two directory entries for the same bytes, would make the loader
    read more than the file holds. Then :func:`check_pickle` checks the pickle.

    Returns:
      The pickle's size in bytes, which bounds what it can stand for
      (:func:`~functional_fp16.checkpoint.format.check_objects`).

    Raises:
      CheckpointCorruptError: the container or the pickle is not one
        ``save_checkpoint`` writes.
    """
    try:
        start = f.tell()
        magic = f.read(4)
        f.seek(0, os.SEEK_END)
        size = f.tell() - start
        f.seek(start)
        if magic != b"PK\x03\x04":
            raise _unreadable(file, "not a zip archive of torch.save")
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
            pickle = _check_records(records, size, file)
            data = archive.read(pickle)
        f.seek(start)
    except CheckpointCorruptError:
        raise
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, AttributeError) as err:
        raise _unreadable(file, f"{type(err).__name__}: {show(str(err))}") from None
    prefix = pickle.filename[: -len("data.pkl")]
    check_pickle(data, {r.filename: r.file_size for r in records}, prefix, file)
    return len(data)


def _check_records(records: list[zipfile.ZipInfo], size: int, file: str) -> zipfile.ZipInfo:
    """The records are stored, named once, and fit in the file; returns the pickle's."""
    names = [r.filename for r in records]
    pickles = [r for r in records if r.filename.endswith("/data.pkl")]
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.compress_size != r.file_size:
            raise corrupt(
                file,
                f"record {show(r.filename)} is compressed; checkpoints store records as they are",
            )
        if r.flag_bits & 0x1:
            raise corrupt(file, f"record {show(r.filename)} is encrypted")
    if len(set(names)) != len(names) or len(pickles) != 1:
        raise corrupt(
            file,
            "the archive's records are not those of one torch.save (a name twice, or not one data.pkl)",
        )
    declared = sum(r.file_size for r in records)
    if declared > size:
        raise corrupt(
            file, f"the archive's records declare {declared} bytes, more than the file's {size}"
        )
    return pickles[0]


MAX_TUPLE_DEPTH = 16
"""The deepest nesting of tuples a checkpoint's pickle may hold (``torch.save`` writes 2)."""


def check_pickle(data: bytes, records: dict[str, int], prefix: str, file: str) -> None:
    """Checks that the pickle ``data`` uses only what ``torch.save`` writes for a checkpoint.

    ``records`` maps the archive's record names to their sizes, and ``prefix``
    is the folder of ``data.pkl`` in it. See the module's description for
    what passes. One pass over the opcodes; the symbolic stack and memo hold
    no more than the pickle does.

    Raises:
      CheckpointCorruptError: the first thing found that ``torch.save`` would
        not write for a checkpoint, named.
    """
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    # Nesting of tuples: unpickling hashes a tuple used as a dict key recursively
    # (in C), so a deep one crashes the process. torch.save nests them 2 deep.
    depth: dict[int, int] = {}
    made: list[tuple] = []  # the tuples whose ids ``depth`` holds, kept alive

    def tuple_of(items: list[Any]) -> tuple:
        t = tuple(items)
        d = 1 + max((depth.get(id(x), 0) for x in items if isinstance(x, tuple)), default=0)
        if d > MAX_TUPLE_DEPTH:
            raise corrupt(file, f"its pickle nests tuples more than {MAX_TUPLE_DEPTH} deep")
        depth[id(t)] = d
        made.append(t)
        return t

    def pop_mark() -> list[Any]:
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def add_to(kind: str) -> None:
        if not _is(stack[-1], kind):
            raise IndexError(f"adds to something other than a {kind}")

    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name not in OPCODES:
                raise corrupt(
                    file,
                    f"its pickle uses the opcode {name} (at byte {pos}), which torch.save "
                    "does not write for a checkpoint",
                )
            if name in _VALUE_OPCODES:
                stack.append(arg)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name in ("EMPTY_LIST", "EMPTY_DICT"):
                stack.append(_Made(name[6:].lower()))
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "TUPLE":
                stack.append(tuple_of(pop_mark()))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                if len(stack) < n:
                    raise IndexError("a tuple of more items than the stack holds")
                stack[-n:] = [tuple_of(stack[-n:])]
            elif name in ("APPEND", "SETITEM"):
                n = 1 if name == "APPEND" else 2
                if len(stack) <= n:
                    raise IndexError(f"{name} without a container and {n} item(s)")
                del stack[-n:]
                add_to("list" if name == "APPEND" else "dict")
            elif name in ("APPENDS", "SETITEMS"):
                pop_mark()
                add_to("list" if name == "APPENDS" else "dict")
            elif name == "GLOBAL":
                stack.append(_global(arg, file))
            elif name == "BINPERSID":
                stack.append(_storage(stack.pop(), records, prefix, file))
            elif name == "REDUCE":
                args = stack.pop()
                stack[-1] = _call(stack[-1], args, file)
    except CheckpointCorruptError:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as err:  # genops's; a stack out of step
        raise _unreadable(
            file, f"a malformed pickle: {type(err).__name__}: {show(str(err))}"
        ) from None


def _global(arg: str, file: str) -> _Made:
    """What ``GLOBAL module name`` refers to, named as the loader resolves it (Python 2's
    ``__builtin__`` is ``builtins``)."""
    module, _, attr = arg.partition(" ")
    if (module, attr) in NAME_MAPPING:
        module, attr = NAME_MAPPING[module, attr]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    name = f"{module}.{attr}"
    if name not in ALLOWED_GLOBALS:
        raise corrupt(
            file,
            f"its pickle refers to {show(name)}, which save_checkpoint never writes (a "
            "checkpoint's pickle names tensor rebuild functions, storage classes, dtypes and "
            "collections.OrderedDict only)",
        )
    return _Made("global", name)


def _storage(pid: Any, records: dict[str, int], prefix: str, file: str) -> _Made:
    """A storage read from a record: ``("storage", storage class, key, location, numel)``."""
    if not (
        type(pid) is tuple
        and len(pid) == 5
        and pid[0] == "storage"
        and _is(pid[1], "global")
        and pid[1].name in STORAGE_ITEM_BYTES
        and type(pid[2]) is str
        and type(pid[3]) is str
        and type(pid[4]) is int
    ):
        raise corrupt(file, "its pickle refers to a storage in a form torch.save does not write")
    _, cls, key, _, numel = pid
    declared = numel * STORAGE_ITEM_BYTES[cls.name]
    stored = records.get(f"{prefix}data/{key}")
    if stored != declared:
        holds = "is missing" if stored is None else f"holds {stored} bytes"
        raise corrupt(
            file,
            f"its pickle declares a storage of {declared} bytes ({numel} items of "
            f"{cls.name}) in the record data/{show(key)}, which {holds}",
        )
    return _Made("storage")


def _call(fn: Any, args: Any, file: str) -> _Made:
    """The result of a REDUCE of ``fn(*args)``, if it is one torch.save writes for a checkpoint."""
    if not _is(fn, "global"):
        raise corrupt(file, "its pickle calls something that is not a function it named")
    if fn.name == _ORDERED_DICT:
        if args != ():
            raise corrupt(
                file,
                "its pickle calls collections.OrderedDict with arguments; torch.save writes "
                "only the empty OrderedDict() of a tensor's hooks",
            )
        return _Made("ordered_dict")
    if fn.name not in _REBUILD:
        raise corrupt(
            file, f"its pickle calls {show(fn.name)}, which save_checkpoint's files never call"
        )
    with_dtype = _REBUILD[fn.name]
    if not (
        type(args) is tuple
        and len(args) == 6 + with_dtype
        and _is(args[0], "storage")
        and type(args[1]) is int
        and _ints(args[2])
        and _ints(args[3])
        and type(args[4]) is bool
        and _is(args[5], "ordered_dict")
        and (not with_dtype or (_is(args[6], "global") and args[6].name in DTYPES))
    ):
        raise corrupt(
            file,
            f"its pickle calls {fn.name} with arguments other than (storage, offset, size, "
            "stride, requires_grad, hooks" + (", dtype)" if with_dtype else ")"),
        )
    return _Made("tensor")
