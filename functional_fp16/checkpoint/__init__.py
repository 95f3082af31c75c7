"""Checkpoints: one atomic, self-checking file per pytree, that ``torch.load`` can open.

Holds :mod:`.save_load` (``save_checkpoint``, ``load_checkpoint``, the
errors), :mod:`.format` (the file's marker, checksum and structural checks),
:mod:`.archive` (the zip and pickle checks before ``torch.load``),
:mod:`.atomic_file`, and the private reader and version-1 converter. May
import :mod:`functional_fp16.update` and the layers below it.
"""

from functional_fp16.checkpoint.atomic_file import atomic_write
from functional_fp16.checkpoint.save_load import (
    FORMAT,
    MAX_DEPTH,
    VERSION,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    atomic_torch_save,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "atomic_torch_save",
    "atomic_write",
    "remove_stale_temporaries",
    "FORMAT",
    "VERSION",
    "MAX_DEPTH",
]
