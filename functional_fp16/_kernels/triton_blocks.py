"""What every Triton step kernel is built from: triton itself, and a program's view of its chunk.

A launch covers the leaves of one class (see ``triton_launch``) through an
``int64`` table: one row per leaf (the data address of each of its tensors,
its numel, its group) and one row per chunk (its leaf's row, its first
element and, for the statistics, its slot). Program ``i`` takes chunk ``i``
(:func:`chunk_of`), turns the row's addresses into typed pointers
(:func:`ptr_at`: ``tl.load(row + k).to(tl.pointer_type(dtype))``, hinted
with ``tl.multiple_of`` where the class is 16-byte aligned) and walks the
chunk in unmasked blocks of ``BLOCK`` elements (vector loads where aligned)
and one masked tail (:func:`load_block`). Triton's interpreter implements
that cast as a bit cast and loads through raw addresses, so the same source
runs under ``TRITON_INTERPRET=1`` on CPU tensors.

The parts every step shares, with ``g`` the gradient as stored, ``m`` the
float32 master and per-group scalars ``inv = fl32(1/s)``, ``c_d``/``c_m``
(clipping) and ``f = -lr``:

.. math::
    u = \\operatorname{fl}_{32}(g)\\cdot \\mathrm{inv}, \\quad
    u \\leftarrow (u / c_d)\\, c_m \\text{ (clipping)}, \\qquad
    m' = \\operatorname{fma}(d, f, m), \\quad p' = \\operatorname{rn}_{p}(m')

(:func:`unscaled`; :func:`store_master` with the step's direction ``d``).
``rn_p`` rounds to the working copy's dtype to nearest even (``.to(dtype)``);
a group whose ``apply`` is false keeps every output equal to its input, bit
for bit. Divisions are correctly rounded (``div_rn``).
"""

from __future__ import annotations

import torch

__all__ = ["triton", "tl", "IMPORT_ERROR", "TRITON_DTYPES"]

try:
    import triton
    import triton.language as tl

    IMPORT_ERROR: str | None = None
except ImportError as err:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = tl = None
    IMPORT_ERROR = f"triton is not importable ({err})"

TRITON_DTYPES = (
    {}
    if tl is None
    else {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
    }
)
"""The Triton dtype of each stored torch dtype."""

if triton is not None:
    __all__ += ["chunk_of", "ptr_at", "load_block", "unscaled", "store_master"]

    @triton.jit
    def chunk_of(leaves, chunks, LEAF_W: tl.constexpr, CHUNK_W: tl.constexpr, CHUNK: tl.constexpr):
        """This program's chunk: its leaf's table row, first and end element, group, slot."""
        at = chunks + tl.program_id(0).to(tl.int64) * CHUNK_W
        row = leaves + tl.load(at) * LEAF_W  # row: addresses..., numel, group
        start = tl.multiple_of(tl.load(at + 1), CHUNK)
        end = tl.minimum(start + CHUNK, tl.load(row + LEAF_W - 2))
        return row, start, end, tl.load(row + LEAF_W - 1), tl.load(at + CHUNK_W - 1)

    @triton.jit
    def ptr_at(row, k: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
        """Address ``k`` of a leaf's row as a pointer to ``dtype``."""
        ptr = tl.load(row + k).to(tl.pointer_type(dtype))
        if ALIGNED:  # every address of the class is 16-byte aligned: vector loads
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def load_block(ptr, mask):
        """A full block (``mask`` None: no mask, so aligned loads vectorise) or the tail."""
        if mask is None:
            return tl.load(ptr)
        else:
            return tl.load(ptr, mask=mask, other=0.0)

    @triton.jit
    def unscaled(g_ptr, offs, mask, inv, cdiv, cmul, HAS_INV: tl.constexpr, CLIP: tl.constexpr):
        """The unscaled, clipped gradient u = (fl32(g) * inv / c_div) * c_mul."""
        u = load_block(g_ptr + offs, mask).to(tl.float32)
        if HAS_INV:
            u = u * inv
        if CLIP:
            u = tl.div_rn(u, cdiv) * cmul
        return u

    @triton.jit
    def store_master(mo_ptr, po_ptr, p_ptr, offs, mask, m, nm, apply, P_IS_MASTER: tl.constexpr):
        """m' (the old m where the group skips), then p' = m' rounded to the working
        copy's dtype (the old p where the group skips) unless the working copy is m."""
        nm = tl.where(apply, nm, m)
        tl.store(mo_ptr + offs, nm, mask=mask)
        if not P_IS_MASTER:
            p_new = nm.to(po_ptr.dtype.element_ty)  # round to nearest even
            tl.store(
                po_ptr + offs, tl.where(apply, p_new, load_block(p_ptr + offs, mask)), mask=mask
            )
