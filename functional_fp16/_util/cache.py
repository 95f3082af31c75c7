"""Bounded look-up tables that threads share: the library's caches of structures and plans.

Every such cache is a plain ``dict``, read with ``dict.get`` (one atomic
look-up) and written only through :func:`remember`, which evicts and inserts
under one lock. Two threads that learn at once then never evict the same
entry twice (a ``KeyError``) or iterate a table another thread resizes, and
a table never holds more than its bound.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

__all__ = ["remember"]

_V = TypeVar("_V")
_LOCK = threading.Lock()


def remember(table: dict, key: Any, value: _V, kept: int) -> _V:
    """Stores ``value`` under ``key`` in ``table``; returns ``value``.

    A new key first evicts the oldest entries (insertion order) until at most
    ``kept - 1`` remain, so ``len(table) <= kept`` holds at every instant for
    readers that do not take the lock. ``kept`` is at least 1.
    """
    if kept < 1:
        raise ValueError(f"kept must be at least 1, got {kept}")
    with _LOCK:
        if key not in table:
            while len(table) >= kept:
                del table[next(iter(table))]
        table[key] = value
    return value
