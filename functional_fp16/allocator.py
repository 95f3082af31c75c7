"""A process-wide allocator setting for CPU training: :func:`tune_malloc` (opt-in)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(threshold_bytes: int = 1 << 30) -> bool:
    """Keeps large CPU tensors in glibc's heap instead of fresh ``mmap`` pages (opt-in).

    glibc ``malloc`` serves blocks above ``M_MMAP_THRESHOLD`` (at most 32 MiB
    after its own dynamic adjustment) with ``mmap`` and returns them to the
    system on ``free``, so every freshly allocated multi-megabyte tensor is
    page-faulted again, zeroed by the kernel, on every step. A pure update
    allocates its outputs each step and pays this; raising
    ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` lets freed blocks be reused
    instead. This is a process-wide setting: the process keeps up to
    ``threshold_bytes`` of freed memory for reuse rather than returning it.
    Call it once, at start-up, if CPU training with large parameter trees is
    the process's job. It is never called by the library itself.

    Args:
      threshold_bytes: the new ``M_MMAP_THRESHOLD`` (and ``M_TRIM_THRESHOLD``),
        at most ``2**31 - 1``.

    Returns:
      ``True`` if both settings were applied; ``False`` where glibc's
      ``mallopt`` is not available (other C libraries, macOS, Windows).
    """
    if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int):
        raise TypeError("threshold_bytes must be an int")
    if not 0 < threshold_bytes <= 2**31 - 1:
        raise ValueError(f"threshold_bytes must be in (0, 2**31 - 1], got {threshold_bytes}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, threshold_bytes) == 1
    return ok_mmap and ok_trim
