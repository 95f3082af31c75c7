"""A sharded checkpoint's traffic with ``torch.distributed.checkpoint`` (DCP): chunks, a save planner, a checked reader.

Saving hands DCP each rank's part as 1-D chunks (:func:`chunked`) that the
writer gets as aliases of their bytes (:class:`AliasingSavePlanner`).

Loading hands DCP a :class:`CheckedReader`: it returns the metadata that
:func:`~functional_fp16.distributed.dcp_metadata.read_dcp_metadata` read and
checked (DCP's own reader would unpickle ``.metadata`` with plain
:mod:`pickle`), and checks each chunk's ``torch.save`` container before
``torch.load(weights_only=True)`` opens it: records stored uncompressed and
within the chunk's bytes, and a small pickle (a pickle of a few hundred
kilobytes can nest tuples deep enough to overflow the C stack when hashed).
No read of a chunk allocates more than the chunk's bytes.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from functional_fp16.checkpoint.archive import check_archive
from functional_fp16.checkpoint.format import SHOWN_PATH_CHARS, CheckpointCorruptError, show

__all__ = ["chunked", "AliasingSavePlanner", "CheckedReader"]

_MAX_TENSOR_PICKLE = 1 << 14  # a stored chunk's data.pkl (149 bytes in torch 2.14)


# -- saving ------------------------------------------------------------------------------


def chunked(flat: torch.Tensor, total: int, start: int, chunk: int) -> torch.Tensor:
    """``flat`` (elements ``start ..`` of a ``total``-element tensor) as a DCP
    CheckpointableTensor cut into chunks of at most ``chunk`` elements."""
    n = flat.numel()
    cuts = range(0, n, chunk)
    flat.global_shape = (total,)
    flat.global_offsets = tuple((start + s,) for s in cuts)
    flat.local_offsets = tuple((s,) for s in cuts)
    flat.local_sizes = tuple((min(chunk, n - s),) for s in cuts)
    return flat


class AliasingSavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner, handing the writer each CPU chunk as a tensor whose
    storage is exactly the chunk's bytes, aliasing the piece (no copy).

    DCP's writer copies a tensor whose storage is larger than the tensor (a
    chunk of a piece, a slice of ``params``) so as not to write the whole
    storage, and keeps the last tensor of every entry until the rank's file is
    complete; with copies, that would hold one chunk per leaf. An alias of the
    chunk's bytes is written as it is and holds no memory of its own.
    """

    def __init__(self) -> None:
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True
        )

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if (
            isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and data.is_contiguous()
            and data.untyped_storage().nbytes() != data.nbytes
        ):
            start = data.storage_offset() * data.element_size()
            storage = data.untyped_storage()[start : start + data.nbytes]
            data = torch.empty(0, dtype=data.dtype).set_(storage, 0, data.shape, data.stride())
        return data


# -- reading the data ------------------------------------------------------------------------


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

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._length - self._pos)
        return super().read(left if size is None or size < 0 else min(size, left))


class CheckedReader(filesystem.FileSystemReader):
    """DCP's file-system reader for a folder whose metadata :func:`read_dcp_metadata` read.

    It returns that metadata instead of unpickling the file again (and, having
    no ``rank`` argument, never falls back to per-rank metadata files), and
    checks each chunk's ``torch.save`` container before DCP loads it.
    """

    def __init__(self, folder: str, metadata: Metadata):
        super().__init__(folder)
        self.checked_metadata = metadata
        self.name = show(folder, SHOWN_PATH_CHARS)

    def read_metadata(self) -> Metadata:
        self.checked_metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self.checked_metadata

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        view = _Slice(file, sinfo.offset, sinfo.length)
        name = (
            f"{self.name}/{sinfo.relative_path}, bytes [{sinfo.offset}, "
            f"{sinfo.offset + sinfo.length})"
        )
        if check_archive(view, name) > _MAX_TENSOR_PICKLE:
            raise CheckpointCorruptError(
                f"{name}: the chunk's pickle is larger than {_MAX_TENSOR_PICKLE} bytes"
            )
        view.seek(0)
        return view
