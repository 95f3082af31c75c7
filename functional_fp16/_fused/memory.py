"""Output buffers for pure CPU updates, reused once the caller has dropped them.

:func:`fresh_like` is what the fused ops allocate their outputs with.

A pure update returns a new state in fresh memory every step. On the CPU,
glibc's ``malloc`` serves large blocks with ``mmap`` and unmaps them on
``free``, so each step's multi-megabyte outputs are page-faulted (and zeroed by
the kernel) anew: about 25,000 faults per step for 10M parameters, more time
than the update itself. CUDA's caching allocator avoids this for GPU tensors;
this pool does the same, narrowly, for the storages that the fused CPU update
hands out.

The pool keeps a reference to every storage it has handed out. A storage
whose only remaining reference is the pool's (no tensor or view of it is
alive anywhere) is free, and the next request of the same size takes it.
Free storages that no request of a call takes are released at the end of
that call, so in a loop ``state = fp16_update(state, grads)`` the pool holds
the live state and the one just dropped, and no more.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["BufferPool", "POOL", "fresh_like", "storage_use_count"]


def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """How many owners ``storage`` has (tensors, views, the pool), or ``None`` if unknown.

    PyTorch documents no public way to ask this; this one function uses the
    private ``torch._C._storage_Use_Count`` and returns ``None`` where it is
    missing, and the pool then allocates plainly (``torch.empty_like``).
    ``tests/test_memory.py`` fails loudly if a release changes it.
    """
    probe = getattr(torch._C, "_storage_Use_Count", None)
    if probe is None:
        return None
    return int(probe(storage._cdata))


class BufferPool:
    """Hands out CPU tensors, reusing storages nothing else refers to any more.

    The pool tracks every storage it has handed out while it is in use. Once
    its last tensor is dropped the storage is free: the next request of its
    size takes it. The pool keeps at most as many free bytes as it has in use
    (the most recently used first) and releases the rest to ``malloc``. So a
    loop that updates one state keeps one dropped state's memory, and one that
    interleaves the updates of several states (an ensemble, a benchmark) keeps
    one dropped copy of each, instead of page-faulting them anew.

    Tensors smaller than ``min_bytes`` come from the ordinary allocator: glibc
    serves them from its heap without new page faults, and a plain allocation
    costs less Python than a pool lookup.
    """

    def __init__(self, min_bytes: int = 1 << 18) -> None:
        self.min_bytes = min_bytes
        self._held: list[tuple[torch.UntypedStorage, int]] = []  # (storage, last call in use)
        self._calls = 0
        self.created = 0  # storages allocated so far (the rest of the requests reused one)
        self._lock = threading.Lock()

    def empty_like(self, tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]):
        """One uninitialised tensor per input, with its shape and strides and the given dtype.

        The inputs must be dense (contiguous in some memory format).
        """
        if not hasattr(torch._C, "_storage_Use_Count"):  # no probe: plain allocation
            return [torch.empty_like(t, dtype=d) for t, d in zip(tensors, dtypes)]
        with self._lock:
            self._calls += 1
            now = self._calls
            free: dict[int, list[tuple[torch.UntypedStorage, int]]] = {}
            kept = []
            for st, seen in self._held:
                if storage_use_count(st) == 1:
                    free.setdefault(st.nbytes(), []).append((st, seen))
                else:
                    kept.append((st, now))  # in use: tracked until it is dropped
            out = []
            for like, dtype in zip(tensors, dtypes):
                nbytes = like.numel() * dtype.itemsize
                if nbytes < self.min_bytes:
                    out.append(torch.empty_like(like, dtype=dtype))
                    continue
                bucket = free.get(nbytes)
                if bucket:
                    st = bucket.pop()[0]
                else:
                    st = torch.UntypedStorage(nbytes)
                    self.created += 1
                kept.append((st, now))
                t = torch.empty(0, dtype=dtype)
                out.append(t.set_(st, 0, like.shape, like.stride()))
            # Free storages not taken stay, the most recently used first, up to
            # as many bytes as are in use; the rest go back to malloc.
            budget = sum(st.nbytes() for st, _ in kept)
            for st, seen in sorted((x for b in free.values() for x in b), key=lambda x: -x[1]):
                if st.nbytes() <= budget:
                    budget -= st.nbytes()
                    kept.append((st, seen))
            self._held = kept
            return out

    def clear(self) -> None:
        """Releases every storage the pool holds (live tensors keep their own)."""
        with self._lock:
            self._held = []


POOL = _POOL = BufferPool()
"""The pool that the fused CPU updates' outputs come from."""


def fresh_like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Uninitialised tensors shaped, strided and typed like ``tensors``.

    CPU tensors come from the pool of dropped outputs; others from
    ``torch.empty_like`` (CUDA's caching allocator already reuses blocks).
    """
    if not tensors or tensors[0].device.type != "cpu":
        return list(map(torch.empty_like, tensors))
    if max(map(torch.Tensor.nbytes.__get__, tensors)) < _POOL.min_bytes:
        return list(map(torch.empty_like, tensors))  # all small: the heap serves them
    return _POOL.empty_like(tensors, [t.dtype for t in tensors])
