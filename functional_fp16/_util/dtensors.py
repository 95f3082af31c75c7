"""Whether a value is a DTensor, without importing ``torch.distributed.tensor``.

Importing ``torch.distributed.tensor`` takes about a second (it brings in
sympy); most programs never make a DTensor. No DTensor can exist before that
module is imported, so where it is not in ``sys.modules`` nothing is one, and
the modules that only *recognise* DTensors ask here instead of importing it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

__all__ = ["dtensor_type", "is_dtensor", "any_dtensor"]

_MODULE = "torch.distributed.tensor"


def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module is imported, else ``None``."""
    module = sys.modules.get(_MODULE)
    return None if module is None else getattr(module, "DTensor", None)


def is_dtensor(x: object) -> bool:
    """``isinstance(x, DTensor)``, never importing DTensor's module."""
    cls = dtensor_type()
    return cls is not None and isinstance(x, cls)


def any_dtensor(xs: Iterable[object]) -> bool:
    """Whether any of ``xs`` is a DTensor (``False`` at once where none can exist)."""
    cls = dtensor_type()
    return cls is not None and any(isinstance(x, cls) for x in xs)
