"""Reading a DCP checkpoint without trusting it: :class:`CheckedReader`.

DCP's ``FileSystemReader`` unpickles a checkpoint's ``.metadata`` with plain
:mod:`pickle`, which runs whatever a forged file names. :class:`CheckedReader`
is a ``FileSystemReader`` (DCP's public ``storage_reader`` interface) that
reads it instead with :class:`_MetadataUnpickler` and hands DCP a fresh
``Metadata`` rebuilt from checked values only:

* the pickle may name only DCP's metadata classes, ``torch.Size``, dtypes,
  layouts, memory formats and the saving folder's path (an allow-list of
  module and name strings); nothing else is resolved, called or built, and a
  dict key is a string or a ``MetadataIndex`` of plain fields, so no key can
  be a deeply nested tuple whose hash overflows the C stack;
* what it builds is charged against the file's bytes (a tuple reused through
  the memo is charged at every use), so an ``n``-byte file builds ``O(n)``;
* every entry is a tensor whose chunks lie inside it and tile it exactly, and
  every chunk's bytes lie inside a regular data file ``__<rank>_<k>.distcp``
  of the folder (no other path), are no more than the chunk's elements and a
  ``torch.save`` container need, and go through no stream transform (a
  decompressor would expand them); the files' sizes are read before anything
  is allocated;
* each chunk's container is checked before ``torch.load(weights_only=True)``
  opens it (:func:`~functional_fp16.checkpoint.archive.check_archive`:
  records stored uncompressed and within the chunk's bytes).

Anything else raises :class:`~functional_fp16.CheckpointCorruptError` naming
the file. DCP's data files carry no checksum: the structure is checked and
every allocation bounded; the values are what the files hold.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import stat
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from functional_fp16.checkpoint.archive import check_archive
from functional_fp16.checkpoint.format import (
    SHOWN_PATH_CHARS,
    CheckpointCorruptError,
    CheckpointMismatchError,
    show,
)

__all__ = ["CheckedReader", "read_checked_metadata", "check_entries", "dcp_failure"]

METADATA = ".metadata"
_DATA_FILE = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp")  # FileSystemWriter's names
_MAX_METADATA_BYTES = 1 << 30  # far beyond any save's (about 230 bytes a chunk in torch 2.14)
_CONTAINER_BYTES = 1 << 16  # what torch.save adds to a chunk's bytes (about 1.6 KiB in torch 2.14)
_MAX_TENSOR_PICKLE = 1 << 14  # a stored chunk's data.pkl (149 bytes in torch 2.14)
_MAX_NDIM = 64

_DCP = "torch.distributed.checkpoint.metadata"
# The classes DCP's metadata is made of, by module and name: built by NEWOBJ + BUILD.
_CLASS_NAMES = (
    (_DCP, "Metadata"),
    (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"),
    (_DCP, "TensorProperties"),
    (_DCP, "ChunkStorageMetadata"),
    (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)
# Called by REDUCE with plain arguments: torch.Size((...)), a layout by name, a
# memory format by value, the saving folder's path.
_CALLABLE_NAMES = (
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
)
_ATOMS = (type(None), bool, int, float, str)


def _resolve(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


_CLASSES = tuple(_resolve(m, n) for m, n in _CLASS_NAMES)
_CALLABLES = tuple(_resolve(m, n) for m, n in _CALLABLE_NAMES)
_STORAGE_INFO = _CLASSES[-1]
_GLOBALS = {
    (m, n): obj for (m, n), obj in zip(_CLASS_NAMES + _CALLABLE_NAMES, _CLASSES + _CALLABLES)
}
_GLOBALS.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
_FIELDS = {cls: frozenset(getattr(cls, "__dataclass_fields__", ())) for cls in _CLASSES}


def _plain_argument(x: Any) -> bool:
    """A plain value, or a tuple of ints (``torch.Size``'s argument): nothing nested deeper."""
    return type(x) in _ATOMS or (type(x) is tuple and all(type(i) is int for i in x))


def _key_ok(key: Any) -> bool:
    """A dict key DCP writes: a string, or a ``MetadataIndex`` whose hashed fields are plain."""
    if type(key) is str:
        return True
    if type(key) is not MetadataIndex:
        return False
    fields = vars(key)
    return type(fields.get("fqn")) is str and type(fields.get("offset")) in (torch.Size, type(None))


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles a DCP ``.metadata`` file, allowing only what DCP's metadata is made of.

    It subclasses the pure-Python unpickler (``pickle._Unpickler``, the
    reference implementation the C one mirrors) because the C one offers no
    hook at a dict's insertion: a key that is a tuple nested a few hundred
    thousand levels deep (one byte per level, no global needed) crashes the
    process when it is hashed. Here every opcode that hashes, calls or builds
    checks its operands first, and the ones DCP never writes are refused.
    What REDUCE and BUILD make from memoised operands is charged to a budget
    of the file's size.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # the opcodes' methods, some replaced below

    def __init__(self, data: bytes, name: str):
        self.source = io.BytesIO(data)
        super().__init__(self.source)
        self.name = name
        self.budget = len(data)
        self.built: set[int] = set()  # ids of the objects whose state was set
        self.keep: list[Any] = []  # keeps those objects alive, so their ids stay theirs

    def refuse(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self.name}: {what}; a DCP metadata file holds only DCP's metadata classes, "
            "torch.Size and dtypes (nothing was run)"
        )

    def charge(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise self.refuse("builds more than its bytes can describe")

    def find_class(self, module: str, name: str) -> Any:
        obj = _GLOBALS.get((module, name))
        if obj is None:
            raise self.refuse(f"refers to the global {show(f'{module}.{name}', quoted=True)}")
        return obj

    def _keys(self, keys: list[Any]) -> None:
        for key in keys:
            if not _key_ok(key):
                raise self.refuse(f"holds a dict key of type {show(type(key).__qualname__)}")

    def _dict(self) -> None:
        self._keys(self.stack[0::2])  # the items since the mark: key, value, ...
        self.load_dict()

    def _setitem(self) -> None:
        self._keys(self.stack[-2:-1])
        self.load_setitem()

    def _setitems(self) -> None:
        self._keys(self.stack[0::2])
        self.load_setitems()

    def _reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if not any(func is f for f in _CALLABLES):
            raise self.refuse(f"calls a {show(type(func).__qualname__)}")
        if type(args) is not tuple or not all(_plain_argument(a) for a in args):
            raise self.refuse("calls a constructor with other than plain arguments")
        self.charge(sum(len(a) if type(a) in (tuple, str) else 1 for a in args))
        self.load_reduce()

    def _newobj(self) -> None:
        cls, args = self.stack[-2], self.stack[-1]
        if not any(cls is c for c in _CLASSES) or type(args) is not tuple or args:
            raise self.refuse("creates an object of another class, or with arguments")
        self.load_newobj()

    def _build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        cls = type(inst)
        if cls not in _FIELDS or id(inst) in self.built:
            raise self.refuse("sets the state of another object, or of one twice")
        if cls is TensorProperties:
            ok = (
                type(state) is tuple
                and len(state) == 5
                and all(type(s) is not tuple for s in state)
            )
        else:
            ok = type(state) is dict and all(type(k) is str and k in _FIELDS[cls] for k in state)
        if not ok:
            raise self.refuse(f"gives a {show(cls.__qualname__)} another state")
        self.charge(len(state))
        self.built.add(id(inst))
        self.keep.append(inst)
        self.load_build()

    def _refused(self) -> None:
        raise self.refuse("uses an opcode DCP never writes")


for _op, _method in (
    (pickle.DICT, _MetadataUnpickler._dict),
    (pickle.SETITEM, _MetadataUnpickler._setitem),
    (pickle.SETITEMS, _MetadataUnpickler._setitems),
    (pickle.REDUCE, _MetadataUnpickler._reduce),
    (pickle.NEWOBJ, _MetadataUnpickler._newobj),
    (pickle.BUILD, _MetadataUnpickler._build),
):
    _MetadataUnpickler.dispatch[_op[0]] = _method
for _op in (
    pickle.ADDITEMS,  # sets hash their items
    pickle.EMPTY_SET,
    pickle.FROZENSET,
    pickle.INST,  # older ways to call or build
    pickle.OBJ,
    pickle.NEWOBJ_EX,
    pickle.EXT1,
    pickle.EXT2,
    pickle.EXT4,
    pickle.PERSID,
    pickle.BINPERSID,
    pickle.BYTEARRAY8,
    pickle.NEXT_BUFFER,
    pickle.READONLY_BUFFER,
):
    _MetadataUnpickler.dispatch[_op[0]] = _MetadataUnpickler._refused


def _size(x: Any, ndim: int | None = None) -> tuple[int, ...] | None:
    """``x`` as a tuple of non-negative ints if it is such a ``torch.Size`` (of ``ndim``)."""
    if type(x) is not torch.Size or len(x) > _MAX_NDIM or (ndim is not None and len(x) != ndim):
        return None
    out = tuple(x)
    return out if all(type(i) is int and i >= 0 for i in out) else None


def _volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return n


def _tiles(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], size: tuple[int, ...]) -> bool:
    """Whether the boxes ``(offsets, sizes)`` lie inside ``size`` and cover it exactly once.

    Empty boxes (a rank's empty shard of a tensor with fewer rows than ranks)
    cover nothing but must still lie inside. Inside the tensor, with volumes
    adding up to the tensor's, the boxes cover it exactly when no two
    overlap; that is checked by a sweep along the first dimension (a pair is
    compared only when their first-dimension ranges meet).
    """
    total = 0
    boxes = []
    for offsets, sizes in chunks:
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            return False
        volume = _volume(sizes)
        total += volume
        if volume:
            boxes.append((offsets, sizes))
    if total != _volume(size) or (not size and len(chunks) != 1):
        return False
    boxes.sort()
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if b_off and b_off[0] >= a_off[0] + a_size[0]:
                break  # sorted by first offset: no later box meets this one
            if all(
                bo < ao + asz and ao < bo + bsz
                for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size)
            ):
                return False
    return True


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a seekable binary file, as a file of their own.

    No read returns or allocates more than the slice holds.
    """

    def __init__(self, base: Any, offset: int, length: int):
        super().__init__()
        self._base, self._offset, self._length, self._pos = base, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if start + pos < 0:
            raise ValueError("negative seek position")
        self._pos = start + pos
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        if n == 0:
            return 0
        self._base.seek(self._offset + self._pos)
        got = self._base.readinto(memoryview(b).cast("B")[:n]) or 0
        self._pos += got
        return got


class CheckedReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` and each chunk without trusting them.

    Pass it as ``storage_reader`` to ``torch.distributed.checkpoint.load``.
    :meth:`read_metadata` returns the checked metadata (see the module
    docstring), read once (:func:`check_entries` then compares it with what
    is loaded). Per-rank metadata files (``__<rank>.metadata``)
    are not read. Each chunk's ``torch.save`` container is checked before
    DCP loads it.

    Raises:
      CheckpointCorruptError: from :meth:`read_metadata`, and from DCP's
        load of a chunk whose container is not one ``torch.save`` writes.
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.folder = os.fspath(path)
        self.name = show(self.folder, SHOWN_PATH_CHARS)
        self.checked: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fall-back to per-rank files: never taken
            raise CheckpointCorruptError(f"{self.name}/{METADATA}: missing or unreadable")
        if self.checked is None:
            self.checked = read_checked_metadata(self.folder)
        md = self.checked
        fresh = Metadata(
            dict(md.state_dict_metadata),
            storage_data=dict(md.storage_data),
            storage_meta=StorageMeta(load_id=self.load_id),
        )
        return fresh

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        view = _Slice(file, sinfo.offset, sinfo.length)
        name = (
            f"{self.name}/{show(sinfo.relative_path)}, bytes [{sinfo.offset}, "
            f"{sinfo.offset + sinfo.length})"
        )
        if check_archive(view, name) > _MAX_TENSOR_PICKLE:
            raise CheckpointCorruptError(
                f"{name}: the chunk's pickle is larger than {_MAX_TENSOR_PICKLE} bytes"
            )
        view.seek(0)
        return io.BufferedReader(view)


def _unpickle(folder: str, name: str) -> Any:
    path = os.path.join(folder, METADATA)
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{name}: missing (not a DCP checkpoint)") from None
    except OSError as err:
        raise CheckpointCorruptError(f"{name}: cannot be read ({err.strerror})") from None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{name}: not a regular file")
        if st.st_size > _MAX_METADATA_BYTES:
            raise CheckpointCorruptError(f"{name}: {st.st_size} bytes, larger than any save writes")
        raw = f.read(_MAX_METADATA_BYTES + 1)
    if len(raw) > _MAX_METADATA_BYTES:
        raise CheckpointCorruptError(f"{name}: grew while read")
    unpickler = _MetadataUnpickler(raw, name)
    try:
        md = unpickler.load()
    except CheckpointCorruptError:
        raise
    except Exception as err:  # whatever else the bytes make fail (RecursionError included)
        text = show(f"{type(err).__name__}: {err}")
        if not isinstance(err, pickle.UnpicklingError):  # the pure-Python unpickler's IndexError...
            cause = pickle.UnpicklingError(text)
            cause.__cause__ = err
            err = cause
        raise CheckpointCorruptError(f"{name}: not a DCP metadata pickle ({text})") from err
    if unpickler.source.tell() != len(raw):
        raise CheckpointCorruptError(f"{name}: bytes follow the pickle's end")
    return md


def _entry_chunks(md: Any, fqn: str, name: str) -> tuple[torch.dtype, tuple[int, ...], list]:
    """A stored entry's dtype, size and chunks ``(offsets, sizes)``, checked to tile it."""
    where = f"{name}: the entry {show(fqn, SHOWN_PATH_CHARS, quoted=True)}"
    if type(md) is not TensorStorageMetadata:
        raise CheckpointCorruptError(f"{where} is not a tensor (this library saves tensors only)")
    props, size, chunks = (vars(md).get(k) for k in ("properties", "size", "chunks"))
    dtype = vars(props).get("dtype") if type(props) is TensorProperties else None
    size = _size(size)
    if not isinstance(dtype, torch.dtype) or size is None:
        raise CheckpointCorruptError(f"{where} has a malformed dtype or size")
    if type(chunks) is not list or not all(type(c) is ChunkStorageMetadata for c in chunks):
        raise CheckpointCorruptError(f"{where} has no chunk list")
    out = []
    for c in chunks:
        fields = vars(c)
        offsets, sizes = (
            _size(fields.get("offsets"), len(size)),
            _size(fields.get("sizes"), len(size)),
        )
        if offsets is None or sizes is None:
            raise CheckpointCorruptError(f"{where} has a malformed chunk")
        out.append((offsets, sizes))
    if not _tiles(out, size):
        raise CheckpointCorruptError(f"{where}: its chunks do not tile it")
    return dtype, size, out


def _storage(info: Any, nbytes: int, files: dict[str, int], folder: str, where: str) -> Any:
    """A chunk's storage record, checked: a data file of the folder, bytes inside it, no transform."""
    fields = vars(info) if type(info) is _STORAGE_INFO else None
    if fields is None:
        raise CheckpointCorruptError(f"{where}: no storage record")
    path, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
    if type(path) is not str or not _DATA_FILE.fullmatch(path):
        raise CheckpointCorruptError(
            f"{where}: stored in {show(path, quoted=True)}, not a data file"
        )
    if fields.get("transform_descriptors"):
        raise CheckpointCorruptError(f"{where}: stored through a stream transform")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 1:
        raise CheckpointCorruptError(f"{where}: a malformed byte range")
    if length > nbytes + _CONTAINER_BYTES:
        raise CheckpointCorruptError(
            f"{where}: {length} stored bytes, more than its {nbytes} bytes of data need"
        )
    if path not in files:
        try:
            st = os.stat(os.path.join(folder, path), follow_symlinks=False)
        except OSError as err:
            why = err.strerror or type(err).__name__
            raise CheckpointCorruptError(f"{where}: {path} cannot be read ({why})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{where}: {path} is not a regular file")
        files[path] = st.st_size
    if offset + length > files[path]:
        raise CheckpointCorruptError(
            f"{where}: bytes [{offset}, {offset + length}) lie beyond the end of {path} "
            f"({files[path]} bytes; truncated?)"
        )
    return _STORAGE_INFO(path, offset, length)


def read_checked_metadata(folder: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, checked (see the module docstring) and rebuilt.

    Raises:
      CheckpointCorruptError: the file is missing, too large, not DCP's
        metadata (a global outside the allow-list is named, not run), or it
        disagrees with itself or with the data files, naming the entry.
    """
    folder = os.fspath(folder)
    name = f"{show(folder, SHOWN_PATH_CHARS)}/{METADATA}"
    md = _unpickle(folder, name)
    fields = vars(md) if type(md) is Metadata else {}
    entries, storage = fields.get("state_dict_metadata"), fields.get("storage_data")
    if type(entries) is not dict or type(storage) is not dict:
        raise CheckpointCorruptError(f"{name}: not DCP's metadata")
    state_dict_metadata: dict[str, TensorStorageMetadata] = {}
    storage_data: dict[MetadataIndex, Any] = {}
    files: dict[str, int] = {}
    for fqn, entry in entries.items():
        dtype, size, chunks = _entry_chunks(entry, fqn, name)
        rebuilt = []
        for i, (offsets, sizes) in enumerate(chunks):
            where = f"{name}: the chunk of {show(fqn, SHOWN_PATH_CHARS, quoted=True)} at {offsets}"
            key = MetadataIndex(fqn, offsets, i)  # found by name and offset (index not hashed)
            info = storage.get(key)
            nbytes = _volume(sizes) * dtype.itemsize
            storage_data[key] = _storage(info, nbytes, files, folder, where)
            rebuilt.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        props = TensorProperties(dtype=dtype)
        state_dict_metadata[fqn] = TensorStorageMetadata(props, torch.Size(size), rebuilt)
    return Metadata(state_dict_metadata, storage_data=storage_data, storage_meta=StorageMeta())


def check_entries(wanted: dict[str, torch.Tensor], metadata: Metadata, name: str) -> None:
    """Every entry of ``wanted`` (DCP's flat name to the tensor it loads into) is stored in
    ``metadata`` with the tensor's dtype and (global) shape.

    Raises:
      CheckpointMismatchError: naming the first entry that is missing or differs.
    """
    stored = metadata.state_dict_metadata
    for key, tensor in wanted.items():
        entry = stored.get(key)
        if entry is None:
            raise CheckpointMismatchError(f"{name} holds no entry {show(key, quoted=True)}")
        if entry.properties.dtype != tensor.dtype or tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointMismatchError(
                f"{name}: {show(key, quoted=True)} is {entry.properties.dtype} of shape "
                f"{tuple(entry.size)} in the checkpoint, {tensor.dtype} of shape "
                f"{tuple(tensor.shape)} in like"
            )


def dcp_failure(err: BaseException) -> str:
    """What a DCP error says, for a message: a ``CheckpointException``'s first failing rank
    and its error, else the error itself."""
    failures = err.failures if isinstance(err, CheckpointException) else None
    if failures:
        rank = min(failures)
        wrapped = failures[rank]
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        return f"rank {rank}: {type(inner).__name__}: {show(str(inner))}"
    return f"{type(err).__name__}: {show(str(err))}"
