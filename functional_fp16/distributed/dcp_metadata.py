"""DCP's ``.metadata`` of a sharded checkpoint, read without trusting it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain :mod:`pickle`,
which runs any code a forged file names. :func:`read_dcp_metadata` reads it
instead, on every rank before the ranks' agreement (so before any
collective), and returns a fresh ``Metadata`` rebuilt from checked values
only, which :class:`~functional_fp16.distributed.dcp_io.CheckedReader` hands
to DCP:

* the file is a regular file no larger than a save of the marker's entries
  at the marker's world size and ``bucket_bytes`` writes;
* it is unpickled by :class:`_MetadataUnpickler`, which resolves only DCP's
  metadata classes, ``torch.Size``, dtypes and layouts, builds objects only
  of those classes, and accepts dict keys only of the kinds DCP writes
  (strings and ``MetadataIndex``), so that no key can be a deeply nested
  tuple whose hash overflows the C stack;
* every entry the marker names exists with its dtype and size, and its
  chunks tile it exactly (no gaps, no overlaps, no more than a save writes);
* every chunk's bytes lie inside a regular data file ``__<rank>_<k>.distcp``
  of the folder (no other path), are no more than the chunk's tensor and a
  ``torch.save`` container need, and carry no stream transform (a
  decompressor would expand them).

DCP's data files carry no checksum: a load checks the structure and bounds
every allocation; the values are what the files hold.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
import stat
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from functional_fp16.checkpoint.format import SHOWN_PATH_CHARS, CheckpointCorruptError, show
from functional_fp16.distributed.sharded_format import open_regular

__all__ = ["Expected", "read_dcp_metadata"]

METADATA = ".metadata"
_DATA_FILE = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp")  # FileSystemWriter's names
_METADATA_BASE_BYTES = 1 << 16  # what a .metadata holds besides its entries (the folder's path)
_METADATA_ENTRY_BYTES = 1024  # per entry, besides its path
_METADATA_CHUNK_BYTES = 512  # per chunk, besides its path (about 130 in torch 2.14)
_CONTAINER_BYTES = 1 << 16  # what torch.save adds to a chunk's bytes (about 1.6 KiB in torch 2.14)

_CLASSES = (
    dcp_metadata.Metadata,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata.TensorProperties,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
    filesystem._StorageInfo,
)
_FIELDS = {cls: {f for f in getattr(cls, "__dataclass_fields__", {})} for cls in _CLASSES}
# Called by REDUCE with plain arguments: torch.Size((...)), a layout by name, an
# enum by value, the saving folder's path.
_REDUCIBLE = (
    torch.Size,
    torch.serialization._get_layout,
    dcp_metadata._MEM_FORMAT_ENCODING,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
)
_GLOBALS = {(obj.__module__, obj.__qualname__): obj for obj in _CLASSES + _REDUCIBLE}
_GLOBALS.update(
    {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
)
_ATOMS = (type(None), bool, int, float, str)


def _plain_argument(x: Any) -> bool:
    """A plain value, or a tuple of ints (``torch.Size``'s argument): nothing nested deeper."""
    return type(x) in _ATOMS or (type(x) is tuple and all(type(i) is int for i in x))


def _key_ok(key: Any) -> bool:
    """A dict key DCP writes: a string, or a ``MetadataIndex`` whose hashed fields are plain."""
    if type(key) in (str, int):
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
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # the opcodes' methods, some replaced below

    def __init__(self, data: bytes, name: str):
        super().__init__(io.BytesIO(data))
        self.name = name
        # The objects whose state was set, kept so that their ids stay theirs.
        self.built: dict[int, Any] = {}

    def refuse(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self.name}: {what}; a DCP metadata file holds only DCP's metadata classes, "
            "torch.Size and dtypes (nothing was run)"
        )

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
        self._keys(self.stack[0::2])
        self.load_dict()

    def _setitem(self) -> None:
        self._keys(self.stack[-2:-1])
        self.load_setitem()

    def _setitems(self) -> None:
        self._keys(self.stack[0::2])
        self.load_setitems()

    def _reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if not any(func is f for f in _REDUCIBLE):
            raise self.refuse(f"calls a {show(type(func).__qualname__)}")
        if type(args) is not tuple or not all(_plain_argument(a) for a in args):
            raise self.refuse("calls a constructor with other than plain arguments")
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
            ok = type(state) is tuple and len(state) == 5
        else:
            ok = type(state) is dict and all(type(k) is str and k in _FIELDS[cls] for k in state)
        if not ok:
            raise self.refuse(f"gives a {show(cls.__qualname__)} another state")
        self.built[id(inst)] = inst
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


class Expected(NamedTuple):
    """What the marker says of one DCP entry."""

    dtype: torch.dtype
    size: tuple[int, ...]
    max_chunks: int  # the most chunks a save writes for it


def _metadata_limit(expected: dict[str, Expected]) -> int:
    limit = _METADATA_BASE_BYTES
    for fqn, e in expected.items():
        path = len(fqn.encode("utf-8", "surrogatepass"))
        limit += _METADATA_ENTRY_BYTES + 4 * path
        limit += e.max_chunks * (_METADATA_CHUNK_BYTES + 2 * path)
    return limit


def _unpickle(folder: str, name: str, limit: int) -> Any:
    try:
        with open_regular(os.path.join(folder, METADATA)) as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{name}: missing") from None
    if len(raw) > limit:
        raise CheckpointCorruptError(
            f"{name}: larger than the {limit} bytes a save of this checkpoint's entries writes"
        )
    try:
        return _MetadataUnpickler(raw, name).load()
    except CheckpointCorruptError:
        raise
    except Exception as err:  # whatever else the bytes make fail (RecursionError included)
        text = show(f"{type(err).__name__}: {err}")
        raise CheckpointCorruptError(f"{name}: not a DCP metadata pickle ({text})") from None


def _size(x: Any, ndim: int) -> tuple[int, ...] | None:
    """``x`` as a tuple of ``ndim`` ints if it is such a ``torch.Size``, else ``None``."""
    if type(x) is not torch.Size or len(x) != ndim:
        return None
    return tuple(x)


def _tiles(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], size: tuple[int, ...]) -> bool:
    """Whether the chunks cover the tensor exactly (one whole chunk, or 1-D chunks end to end)."""
    if len(size) != 1:
        return len(chunks) == 1 and chunks[0][1] == size and not any(chunks[0][0])
    at = 0
    for offsets, sizes in sorted(chunks):
        if offsets[0] != at or sizes[0] < 1:
            return False
        at += sizes[0]
    return at == size[0]


def _entry_chunks(md: Any, fqn: str, e: Expected, name: str) -> list[tuple[tuple, tuple]]:
    """The (offsets, sizes) of a stored entry's chunks, checked against the marker."""
    where = f"{name}: the entry {show(fqn, SHOWN_PATH_CHARS)}"
    if type(md) is not TensorStorageMetadata:
        raise CheckpointCorruptError(f"{where} is missing or not a tensor")
    props, size, chunks = (vars(md).get(k) for k in ("properties", "size", "chunks"))
    dtype = vars(props).get("dtype") if type(props) is TensorProperties else None
    if not isinstance(dtype, torch.dtype) or _size(size, len(e.size)) != e.size or dtype != e.dtype:
        shown = "malformed"
        if isinstance(dtype, torch.dtype) and type(size) is torch.Size:
            shown = f"{dtype} of size {show(tuple(size))}"
        raise CheckpointCorruptError(
            f"{where} is {shown}; the marker says {e.dtype} of size {e.size}"
        )
    if type(chunks) is not list:
        raise CheckpointCorruptError(f"{where} has no chunk list")
    if len(chunks) > e.max_chunks:
        raise CheckpointCorruptError(
            f"{where} has {len(chunks)} chunks, more than the {e.max_chunks} a save writes"
        )
    out = []
    for c in chunks:
        fields = vars(c) if type(c) is ChunkStorageMetadata else {}
        offsets = _size(fields.get("offsets"), len(e.size))
        sizes = _size(fields.get("sizes"), len(e.size))
        if offsets is None or sizes is None:
            raise CheckpointCorruptError(f"{where} has a malformed chunk")
        out.append((offsets, sizes))
    if not _tiles(out, e.size):
        raise CheckpointCorruptError(f"{where}: its chunks do not tile it")
    return out


def _storage(info: Any, nbytes: int, files: dict[str, int], folder: str, where: str):
    """A chunk's storage record, checked: a data file of the folder, bytes inside it, no transform."""
    fields = vars(info) if type(info) is filesystem._StorageInfo else None
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
            st = os.stat(os.path.join(folder, path))
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
    return filesystem._StorageInfo(path, offset, length)


def read_dcp_metadata(folder: str, expected: dict[str, Expected]) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, checked against ``expected`` and rebuilt from checked values.

    The result holds the ``expected`` entries only.

    Raises:
      CheckpointCorruptError: the file is missing, too large, not DCP's
        metadata (a global outside DCP's classes is named, not run), or it
        disagrees with the marker or with the data files, naming the entry.
    """
    name = f"{show(folder, SHOWN_PATH_CHARS)}/{METADATA}"
    md = _unpickle(folder, name, _metadata_limit(expected))
    fields = vars(md) if type(md) is Metadata else {}
    entries, storage = fields.get("state_dict_metadata"), fields.get("storage_data")
    if type(entries) is not dict or type(storage) is not dict:
        raise CheckpointCorruptError(f"{name}: not DCP's metadata")
    state_dict_metadata: dict[str, TensorStorageMetadata] = {}
    storage_data: dict[MetadataIndex, Any] = {}
    files: dict[str, int] = {}
    for fqn, e in expected.items():
        chunks = _entry_chunks(entries.get(fqn), fqn, e, name)
        itemsize = e.dtype.itemsize
        rebuilt = []
        for i, (offsets, sizes) in enumerate(chunks):
            nbytes = itemsize
            for d in sizes:
                nbytes *= d
            where = f"{name}: the chunk of {show(fqn, SHOWN_PATH_CHARS)} at {offsets}"
            key = MetadataIndex(fqn, offsets, i)
            storage_data[key] = _storage(storage.get(key), nbytes, files, folder, where)
            rebuilt.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        props = TensorProperties(dtype=e.dtype)
        state_dict_metadata[fqn] = TensorStorageMetadata(props, torch.Size(e.size), rebuilt)
    return Metadata(state_dict_metadata, storage_data=storage_data, storage_meta=StorageMeta())
