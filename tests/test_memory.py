"""Output buffers of the pure CPU steps (``functional_fp16._fused.memory``).

The pool reuses a dropped state's storages only when nothing else refers to
them, which it asks ``storage_use_count``: the one place that uses a private
torch function. These tests fail loudly if a torch release removes it or
changes what it counts, and show the public fallback still works.
"""

import gc

import torch

from functional_fp16._fused import memory


def test_the_private_use_count_probe_still_exists_and_counts_owners():
    assert hasattr(torch._C, "_storage_Use_Count"), (
        "torch._C._storage_Use_Count is gone in this torch release: the CPU output pool "
        "now allocates plainly (correct, but pure CPU steps page-fault again); "
        "update functional_fp16/_fused/memory.py"
    )
    st = torch.UntypedStorage(1 << 20)
    assert memory.storage_use_count(st) == 1
    t = torch.empty(0, dtype=torch.float32).set_(st, 0, (1 << 18,), (1,))
    view = t[10:20]
    assert memory.storage_use_count(st) >= 2
    del t
    gc.collect()
    assert memory.storage_use_count(st) >= 2  # the view still holds it
    del view
    gc.collect()
    assert memory.storage_use_count(st) == 1


def test_a_storage_is_reused_only_after_every_view_is_gone():
    pool = memory.BufferPool(min_bytes=1024)
    like = torch.empty(100_000)
    (a,) = pool.empty_like([like], [torch.float32])
    ptr = a.untyped_storage().data_ptr()
    view = a[:5]
    del a
    (b,) = pool.empty_like([like], [torch.float32])
    b_ptr = b.untyped_storage().data_ptr()
    assert b_ptr != ptr  # the view keeps the old one alive
    del view, b
    gc.collect()
    (c,) = pool.empty_like([like], [torch.float32])
    assert c.untyped_storage().data_ptr() in (ptr, b_ptr)  # a dropped storage, reused


def test_without_the_probe_the_pool_allocates_plainly(monkeypatch):
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert memory.storage_use_count(torch.UntypedStorage(8)) is None
    pool = memory.BufferPool(min_bytes=0)
    like = torch.empty(3, 4).t()
    (x,) = pool.empty_like([like], [torch.float16])
    assert x.shape == like.shape and x.stride() == like.stride() and x.dtype == torch.float16
    assert not pool._held  # nothing is tracked without the probe


def test_interleaved_states_keep_their_dropped_buffers():
    """Several states updated in turn (an ensemble, a benchmark): each one's dropped
    buffers wait for it, so the steady state allocates nothing (no page faults)."""
    pool = memory.BufferPool(min_bytes=1024)
    sizes = {"a": 100_000, "b": 300_000, "c": 50_000}
    live = {k: pool.empty_like([torch.empty(n)] * 3, [torch.float32] * 3) for k, n in sizes.items()}
    for _ in range(2):  # warm-up: every state's second set of buffers
        for k, n in sizes.items():
            live[k] = pool.empty_like([torch.empty(n)] * 3, [torch.float32] * 3)
    before = pool.created
    for _ in range(10):
        for k, n in sizes.items():
            live[k] = pool.empty_like([torch.empty(n)] * 3, [torch.float32] * 3)
    assert pool.created == before


def test_free_buffers_beyond_the_bytes_in_use_are_released():
    pool = memory.BufferPool(min_bytes=1024)
    big = pool.empty_like([torch.empty(1_000_000)], [torch.float32])
    del big  # free: 4 MB, with nothing in use
    small = pool.empty_like([torch.empty(10_000)], [torch.float32])
    assert all(st.nbytes() <= 40_000 for st, _ in pool._held)  # the 4 MB went back to malloc
    assert small[0].numel() == 10_000
