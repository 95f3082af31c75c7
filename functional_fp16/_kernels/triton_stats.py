"""The Triton kernels of the gradient statistics: per-chunk partial results, then per leaf
and per group.

Per leaf, ``max |g|`` (+inf if any element is inf or NaN) and, on request, per
group ``sum fl32(g * inv)^2`` accumulated in float64 (each square is exact
there). :func:`_stats_kernel` writes one partial result per chunk, into the
chunk's slot; the slots are numbered in leaf order, so a leaf's slots, and a
group's, are contiguous, and :func:`_segment_reduce_kernel`, one program per
segment (a leaf for the peaks, a group for the sums), reduces them in a fixed
order (deterministic). ``triton_steps.grad_stats`` launches them.
"""

from __future__ import annotations

from functional_fp16._kernels.triton_blocks import tl, triton

if triton is not None:
    from functional_fp16._kernels.triton_blocks import chunk_of, load_block, ptr_at

    @triton.jit
    def _stats_block(g_ptr, offs, mask, inv, peak, sq, HAS_INV: tl.constexpr, SUM_SQ: tl.constexpr):
        x = load_block(g_ptr + offs, mask).to(tl.float32)
        a = tl.abs(x)
        peak = tl.maximum(peak, tl.where(a == a, a, float("inf")))  # NaN counts as inf
        if SUM_SQ:
            w = x * inv if HAS_INV else x
            w = w.to(tl.float64)
            sq += w * w  # each square exact in float64
        return peak, sq

    @triton.jit
    def _stats_kernel(
        leaves,
        chunks,
        inv_ptr,
        peak_part,
        sq_part,
        G_TY: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_INV: tl.constexpr,
        SUM_SQ: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Chunk i's largest |g| and sum of squares into slot i of the partial results."""
        # leaf row: grads, numel, group; chunk row: leaf, start, slot
        row, start, end, grp, slot = chunk_of(leaves, chunks, 3, 3, CHUNK)
        g_ptr = ptr_at(row, 0, G_TY, ALIGNED)
        inv = tl.load(inv_ptr + grp)  # a dummy without HAS_INV
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        sq = tl.zeros([BLOCK], dtype=tl.float64)
        n_full = (end - start) // BLOCK
        for i in range(0, n_full):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            peak, sq = _stats_block(g_ptr, offs, None, inv, peak, sq, HAS_INV, SUM_SQ)
        offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
        peak, sq = _stats_block(g_ptr, offs, offs < end, inv, peak, sq, HAS_INV, SUM_SQ)
        tl.store(peak_part + slot, tl.max(peak, axis=0))
        if SUM_SQ:
            tl.store(sq_part + slot, tl.sum(sq, axis=0))

    @triton.jit
    def _segment_reduce_kernel(
        part,
        bounds,
        out,
        SUM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Segment k's result from its contiguous slots bounds[k]:bounds[k + 1]: the largest
        peak (float32; ``SUM`` false) or the sum of squares (float64; ``SUM`` true)."""
        k = tl.program_id(0).to(tl.int64)
        lo = tl.load(bounds + k)
        hi = tl.load(bounds + k + 1)
        if SUM:
            sq = tl.zeros([BLOCK], dtype=tl.float64)
            for s in range(lo, hi, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                sq += tl.load(part + offs, mask=offs < hi, other=0.0)
            tl.store(out + k, tl.sum(sq, axis=0))
        else:
            peak = tl.zeros([BLOCK], dtype=tl.float32)
            for s in range(lo, hi, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                peak = tl.maximum(peak, tl.load(part + offs, mask=offs < hi, other=0.0))
            tl.store(out + k, tl.max(peak, axis=0))
