"""The fused optimiser steps for CUDA tensors: multi-tensor Triton launches.

The CUDA counterpart of ``fused_step.c``, with the same entry points, argument
names and arithmetic, element by element. With ``g`` the gradient as stored,
``m`` the float32 master, ``b`` the momentum, ``a``/``v`` Adam's moments and
per-group scalars ``inv = fl32(1/s)``, ``c_d``/``c_m`` (clipping) and
``f = -lr``:

.. math::
    u &= \\operatorname{fl}_{32}(g)\\cdot \\mathrm{inv}, \\quad
         u \\leftarrow (u / c_d)\\, c_m \\text{ (clipping)} \\\\
    \\text{SGD:}\\quad u &\\leftarrow \\operatorname{fma}(m, \\lambda, u), \\quad
         b' = \\operatorname{fl}(\\operatorname{fl}(b\\,k) + \\operatorname{fl}(u\\,t)), \\quad
         d = \\operatorname{fma}(b', \\mu, u) \\text{ (Nesterov) or } b' \\\\
    \\text{Adam:}\\quad u &\\leftarrow \\operatorname{fma}(m, \\lambda_2, u), \\quad
         a' = \\operatorname{lerp}(a, u, w), \\quad
         v' = \\operatorname{fma}(c_2 u, u, \\beta_2 v), \\\\
         d &= \\frac{a'}{\\sqrt{v'} / \\sqrt{c_2^{(t)}} + \\epsilon}\\, c_1^{(t)\\,-1}, \\quad
         d \\leftarrow \\operatorname{fma}(m, \\lambda_w, d) \\text{ (decoupled)} \\\\
    m' &= \\operatorname{fma}(d, f, m), \\qquad p' = \\operatorname{rn}_{p}(m')

where ``(k, t) = (mu, 1 - dampening)`` once momentum has started and ``(0, 1)``
before, ``lerp(a, u, w)`` is ``fma(w, u - a, a)`` for ``|w| < 0.5`` and
``fma(w - 1, u - a, u)`` otherwise (torch.lerp), divisions and square roots
are correctly rounded (``div_rn``, ``sqrt_rn``), and the kernels are compiled
with ``enable_fp_fusion=False`` so that only the explicit ``tl.fma`` calls
contract. ``rn_p`` rounds to the working copy's dtype to nearest even
(``.to(dtype)``). A group whose ``apply`` is false keeps every output equal to
its input, bit for bit. :func:`grad_stats` computes per group
``max |g|`` (+inf if any element is inf or NaN) and, on request,
``sum fl32(g * inv)^2`` accumulated in float64.

**Multi-tensor launches.** Leaf ``l`` of ``L`` belongs to group
``l // (L // G)``; per-group scalars are ``(G,)`` device tensors read by the
kernel by group index (no host read of any value). The non-empty leaves are
sorted into classes by what the kernel is compiled for (gradient dtype,
working-copy dtype, whether the working copy is the master, and whether all
of the leaf's addresses are 16-byte aligned), and each class runs as ONE
launch over all its leaves. For each class the host builds an ``int64``
table: one row per leaf (the data address of each of its tensors, its
numel, its group) followed by one row per chunk of at most :data:`CHUNK`
elements (its leaf's row, its first element and, for the statistics, its
slot). Program ``i`` takes chunk ``i``, turns the addresses into typed
pointers with ``tl.load(row + k).to(tl.pointer_type(dtype))`` and walks the
chunk in unmasked blocks of :data:`BLOCK` elements (vector loads where the
class is aligned, hinted with ``tl.multiple_of``) and one masked tail.
Triton's interpreter implements that cast as a bit cast and loads through raw
addresses, so the same source runs under ``TRITON_INTERPRET=1`` on CPU
tensors. All the classes' tables of a call reach the device in one copy: a
pinned host tensor copied with ``non_blocking=True`` (no host sync; PyTorch
records the copy on the pinned block, which is not reused before the copy
has run). A copy made while a CUDA graph is being captured is replayed from
the same pinned memory, so that memory (and the device table) is then kept
for the life of the process. :func:`grad_stats` writes one partial result
per chunk, in slots numbered in leaf order so that a group's slots are
contiguous, and a second kernel with one program per group reduces them in a
fixed order (deterministic).

Nothing here has run on a GPU: the kernels' logic and arithmetic are verified
under ``TRITON_INTERPRET=1`` on CPU tensors and their CUDA compilation only
offline (PTX for sm_90), so launches, the pinned copy and graph capture are
untested.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from functional_fp16._kernels.signatures import SIGNATURES, Arg, dense

__all__ = ["available", "unavailable_reason", "grad_stats", "sgd_update", "adam_update"]

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: str | None = None
except ImportError as err:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = tl = None
    _IMPORT_ERROR = f"triton is not importable ({err})"

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DEVICE_TYPE = "cpu" if _INTERPRET else "cuda"  # the interpreter reads CPU memory

BLOCK = 1024
"""Elements per step of a program (a power of two)."""
CHUNK = 32 * BLOCK
"""Elements per program at most, one table row each (a power of two, at least :data:`BLOCK`)."""

launch_counts: Counter[str] = Counter()
"""Kernel launches so far, by kernel name (for tests and profiling)."""

_GRAPH_TABLES: list[torch.Tensor] = []  # tables copied inside a CUDA graph capture: kept

_TRITON_DTYPES = (
    {}
    if tl is None
    else {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
    }
)


def available() -> bool:
    """Whether the kernels can run on CUDA tensors here (triton importable, a CUDA device)."""
    return _IMPORT_ERROR is None and torch.cuda.is_available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, or ``None``."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    return None if torch.cuda.is_available() else "no CUDA device"


# ---------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _chunk(leaves, chunks, LEAF_W: tl.constexpr, CHUNK_W: tl.constexpr, CHUNK: tl.constexpr):
        """This program's chunk: its leaf's table row, first and end element, group, slot."""
        at = chunks + tl.program_id(0).to(tl.int64) * CHUNK_W
        row = leaves + tl.load(at) * LEAF_W  # row: addresses..., numel, group
        start = tl.multiple_of(tl.load(at + 1), CHUNK)
        end = tl.minimum(start + CHUNK, tl.load(row + LEAF_W - 2))
        return row, start, end, tl.load(row + LEAF_W - 1), tl.load(at + CHUNK_W - 1)

    @triton.jit
    def _ptr(row, k: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
        """Address ``k`` of a leaf's row as a pointer to ``dtype``."""
        ptr = tl.load(row + k).to(tl.pointer_type(dtype))
        if ALIGNED:  # every address of the class is 16-byte aligned: vector loads
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _load(ptr, mask):
        """A full block (``mask`` None: no mask, so aligned loads vectorise) or the tail."""
        if mask is None:
            return tl.load(ptr)
        else:
            return tl.load(ptr, mask=mask, other=0.0)

    @triton.jit
    def _unscaled(g_ptr, offs, mask, inv, cdiv, cmul, HAS_INV: tl.constexpr, CLIP: tl.constexpr):
        """The unscaled, clipped gradient u = (fl32(g) * inv / c_div) * c_mul."""
        u = _load(g_ptr + offs, mask).to(tl.float32)
        if HAS_INV:
            u = u * inv
        if CLIP:
            u = tl.div_rn(u, cdiv) * cmul
        return u

    @triton.jit
    def _store_master(mo_ptr, po_ptr, p_ptr, offs, mask, m, nm, apply, P_IS_MASTER: tl.constexpr):
        """m' (the old m where the group skips), then p' = m' rounded to the working
        copy's dtype (the old p where the group skips) unless the working copy is m."""
        nm = tl.where(apply, nm, m)
        tl.store(mo_ptr + offs, nm, mask=mask)
        if not P_IS_MASTER:
            p_new = nm.to(po_ptr.dtype.element_ty)  # round to nearest even
            tl.store(po_ptr + offs, tl.where(apply, p_new, _load(p_ptr + offs, mask)), mask=mask)

    # -- gradient statistics ------------------------------------------------

    @triton.jit
    def _stats_block(g_ptr, offs, mask, inv, peak, sq, HAS_INV: tl.constexpr, SUM_SQ: tl.constexpr):
        x = _load(g_ptr + offs, mask).to(tl.float32)
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
        row, start, end, grp, slot = _chunk(leaves, chunks, 3, 3, CHUNK)
        g_ptr = _ptr(row, 0, G_TY, ALIGNED)
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
    def _group_reduce_kernel(
        peak_part,
        sq_part,
        bounds,
        peak_out,
        sq_out,
        SUM_SQ: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Group k's result from its contiguous slots bounds[k]:bounds[k + 1]."""
        k = tl.program_id(0).to(tl.int64)
        lo = tl.load(bounds + k)
        hi = tl.load(bounds + k + 1)
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        sq = tl.zeros([BLOCK], dtype=tl.float64)
        for s in range(lo, hi, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            peak = tl.maximum(peak, tl.load(peak_part + offs, mask=offs < hi, other=0.0))
            if SUM_SQ:
                sq += tl.load(sq_part + offs, mask=offs < hi, other=0.0)
        tl.store(peak_out + k, tl.max(peak, axis=0))
        if SUM_SQ:
            tl.store(sq_out + k, tl.sum(sq, axis=0))

    # -- SGD ----------------------------------------------------------------

    @triton.jit
    def _sgd_block(
        ptrs,
        offs,
        mask,
        scalars,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        DECAY: tl.constexpr,
        MOMENTUM: tl.constexpr,
        NESTEROV: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
    ):
        g_ptr, m_ptr, b_ptr, p_ptr, mo_ptr, bo_ptr, po_ptr = ptrs
        apply, lr, inv, cdiv, cmul, wd, mu, keep, take = scalars
        m = _load(m_ptr + offs, mask)
        u = _unscaled(g_ptr, offs, mask, inv, cdiv, cmul, HAS_INV, CLIP)
        if DECAY:
            u = tl.fma(m, wd, u)
        d = u
        if MOMENTUM:
            b = _load(b_ptr + offs, mask)
            nb = b * keep + u * take  # two roundings: fusion is off
            tl.store(bo_ptr + offs, tl.where(apply, nb, b), mask=mask)
            if NESTEROV:
                d = tl.fma(nb, mu, u)
            else:
                d = nb
        _store_master(mo_ptr, po_ptr, p_ptr, offs, mask, m, tl.fma(d, lr, m), apply, P_IS_MASTER)

    @triton.jit
    def _sgd_kernel(
        leaves,
        chunks,
        inv_ptr,
        cdiv_ptr,
        cmul_ptr,
        lr_ptr,
        apply_ptr,
        started_ptr,
        wd,
        mu,
        take_started,
        G_TY: tl.constexpr,
        P_TY: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        DECAY: tl.constexpr,
        MOMENTUM: tl.constexpr,
        STARTED: tl.constexpr,
        NESTEROV: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One SGD step of chunk i (absent per-group scalars point at lr or apply, unused)."""
        # leaf row: grads, master, trace, params, master_out, trace_out, params_out, numel, group
        row, start, end, grp, _ = _chunk(leaves, chunks, 9, 2, CHUNK)
        f32 = tl.float32
        ptrs = (
            _ptr(row, 0, G_TY, ALIGNED),
            _ptr(row, 1, f32, ALIGNED),
            _ptr(row, 2, f32, ALIGNED),
            _ptr(row, 3, P_TY, ALIGNED),
            _ptr(row, 4, f32, ALIGNED),
            _ptr(row, 5, f32, ALIGNED),
            _ptr(row, 6, P_TY, ALIGNED),
        )
        keep = 0.0  # before momentum has started: b' = b * 0 + u * 1
        take = 1.0
        if STARTED:
            started = tl.load(started_ptr + grp) != 0
            keep = tl.where(started, mu, 0.0)
            take = tl.where(started, take_started, 1.0)
        scalars = (
            tl.load(apply_ptr + grp) != 0,
            tl.load(lr_ptr + grp),
            tl.load(inv_ptr + grp),
            tl.load(cdiv_ptr + grp),
            tl.load(cmul_ptr + grp),
            wd,
            mu,
            keep,
            take,
        )
        flags = (HAS_INV, CLIP, DECAY, MOMENTUM, NESTEROV, P_IS_MASTER)
        n_full = (end - start) // BLOCK
        for i in range(0, n_full):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _sgd_block(ptrs, offs, None, scalars, *flags)
        offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
        _sgd_block(ptrs, offs, offs < end, scalars, *flags)

    # -- Adam ---------------------------------------------------------------

    @triton.jit
    def _adam_block(
        ptrs,
        offs,
        mask,
        scalars,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        L2: tl.constexpr,
        DECOUPLED: tl.constexpr,
        SMALL_W: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
    ):
        g_ptr, m_ptr, a_ptr, v_ptr, p_ptr, mo_ptr, ao_ptr, vo_ptr, po_ptr = ptrs
        apply, lr, inv, cdiv, cmul, inv_c1, sqrt_c2, l2, w, b2, c2, eps, wd = scalars
        m = _load(m_ptr + offs, mask)
        u = _unscaled(g_ptr, offs, mask, inv, cdiv, cmul, HAS_INV, CLIP)
        if L2:
            u = tl.fma(m, l2, u)
        a = _load(a_ptr + offs, mask)
        v = _load(v_ptr + offs, mask)
        if SMALL_W:  # torch.lerp(a, u, w)
            na = tl.fma(w, u - a, a)
        else:
            na = tl.fma(w - 1.0, u - a, u)
        nv = tl.fma(c2 * u, u, v * b2)  # torch.addcmul(v * b2, u, u, value=c2)
        d = tl.div_rn(na, tl.div_rn(tl.sqrt_rn(nv), sqrt_c2) + eps) * inv_c1
        if DECOUPLED:
            d = tl.fma(m, wd, d)
        tl.store(ao_ptr + offs, tl.where(apply, na, a), mask=mask)
        tl.store(vo_ptr + offs, tl.where(apply, nv, v), mask=mask)
        _store_master(mo_ptr, po_ptr, p_ptr, offs, mask, m, tl.fma(d, lr, m), apply, P_IS_MASTER)

    @triton.jit
    def _adam_kernel(
        leaves,
        chunks,
        inv_ptr,
        cdiv_ptr,
        cmul_ptr,
        lr_ptr,
        apply_ptr,
        ic1_ptr,
        sc2_ptr,
        l2,
        w,
        b2,
        c2,
        eps,
        wd,
        G_TY: tl.constexpr,
        P_TY: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        L2: tl.constexpr,
        DECOUPLED: tl.constexpr,
        SMALL_W: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One Adam step of chunk i (absent per-group scalars point at lr, unused)."""
        # leaf row: grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out,
        # numel, group
        row, start, end, grp, _ = _chunk(leaves, chunks, 11, 2, CHUNK)
        f32 = tl.float32
        ptrs = (
            _ptr(row, 0, G_TY, ALIGNED),
            _ptr(row, 1, f32, ALIGNED),
            _ptr(row, 2, f32, ALIGNED),
            _ptr(row, 3, f32, ALIGNED),
            _ptr(row, 4, P_TY, ALIGNED),
            _ptr(row, 5, f32, ALIGNED),
            _ptr(row, 6, f32, ALIGNED),
            _ptr(row, 7, f32, ALIGNED),
            _ptr(row, 8, P_TY, ALIGNED),
        )
        scalars = (
            tl.load(apply_ptr + grp) != 0,
            tl.load(lr_ptr + grp),
            tl.load(inv_ptr + grp),
            tl.load(cdiv_ptr + grp),
            tl.load(cmul_ptr + grp),
            tl.load(ic1_ptr + grp),
            tl.load(sc2_ptr + grp),
            l2,
            w,
            b2,
            c2,
            eps,
            wd,
        )
        flags = (HAS_INV, CLIP, L2, DECOUPLED, SMALL_W, P_IS_MASTER)
        n_full = (end - start) // BLOCK
        for i in range(0, n_full):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _adam_block(ptrs, offs, None, scalars, *flags)
        offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
        _adam_block(ptrs, offs, offs < end, scalars, *flags)


def _launch(name: str, kernel: Any, grid: int, *args: Any, **constexprs: Any) -> None:
    """Launches ``kernel`` over ``grid`` programs, counted in :data:`launch_counts`."""
    options = {} if _INTERPRET else {"enable_fp_fusion": False}
    launch_counts[name] += 1
    kernel[(grid,)](*args, **constexprs, **options)


# ---------------------------------------------------------------------------
# Argument checks (device-agnostic; the declarations are signatures.py's)
# ---------------------------------------------------------------------------


class _Checker:
    """Checks one call's arguments against an entry point's declaration, naming the culprit."""

    def __init__(self, entry: str, n_groups: Any, kw: dict[str, Any]) -> None:
        self.where = f"triton_steps.{entry}"
        self.kw = kw
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
            raise TypeError(f"{self.where}: n_groups must be a positive int, got {n_groups!r}")
        grads = kw["grads"]
        if not isinstance(grads, (list, tuple)):
            raise TypeError(f"{self.where}: grads must be a list of tensors")
        self.n_leaves, self.n_groups = len(grads), n_groups
        if self.n_leaves % n_groups:
            raise ValueError(
                f"{self.where}: {self.n_leaves} leaves do not split into {n_groups} groups"
            )
        self.device: torch.device | None = None
        for arg in SIGNATURES[entry].args:
            if arg.name in kw:
                getattr(self, "_" + arg.kind)(arg, kw[arg.name])

    def fail(self, message: str, error: type[Exception] = ValueError) -> None:
        raise error(f"{self.where}: {message}")

    def _on_device(self, name: str, t: torch.Tensor) -> None:
        if self.device is None:
            if t.device.type != _DEVICE_TYPE:
                hint = " (CPU tensors only under TRITON_INTERPRET=1)" if _INTERPRET else ""
                self.fail(f"{name} is on {t.device}; the kernels take {_DEVICE_TYPE} tensors{hint}")
            self.device = t.device
        elif t.device != self.device:
            self.fail(f"{name} is on {t.device}, but the other tensors are on {self.device}")

    def _leaves(self, arg: Arg, value: Any) -> None:
        if value is None:
            if not arg.optional:
                self.fail(f"{arg.name} is required", TypeError)
            return
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) for t in value
        ):
            self.fail(f"{arg.name} must be a list of tensors", TypeError)
        if len(value) != self.n_leaves:
            self.fail(f"{arg.name} has {len(value)} tensors, expected {self.n_leaves}")
        ref = self.kw[arg.like] if arg.like else None
        for i, t in enumerate(value):
            name = f"{arg.name}[{i}]"
            self._on_device(name, t)
            if t.dtype not in arg.dtypes:
                self.fail(f"{name} has dtype {t.dtype}, expected one of {arg.dtypes}", TypeError)
            if not dense(t):
                self.fail(f"{name} is not dense (it must cover its storage span exactly)")
            if ref is not None and (t.shape != ref[i].shape or t.stride() != ref[i].stride()):
                self.fail(
                    f"{name} has shape {tuple(t.shape)} and strides {t.stride()}, but "
                    f"{arg.like}[{i}] has {tuple(ref[i].shape)} and {ref[i].stride()}"
                )

    def _group(self, arg: Arg, value: Any) -> None:
        if value is None:
            if not arg.optional:
                self.fail(f"{arg.name} is required", TypeError)
            return
        if not isinstance(value, torch.Tensor) or value.dtype != arg.dtypes[0]:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            self.fail(f"{arg.name} must be a tensor of dtype {arg.dtypes[0]}, got {got}", TypeError)
        self._on_device(arg.name, value)
        if value.shape != (self.n_groups,) or not value.is_contiguous():
            self.fail(
                f"{arg.name} must be contiguous of shape ({self.n_groups},) (one per group), "
                f"got shape {tuple(value.shape)}"
            )

    def _float(self, arg: Arg, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"{arg.name} must be a number, got {value!r}", TypeError)

    def _int(self, arg: Arg, value: Any) -> None:
        if not isinstance(value, (int, bool)):
            self.fail(f"{arg.name} must be an int, got {value!r}", TypeError)

    def both_or_neither(self, a: str, b: str) -> None:
        if (self.kw[a] is None) != (self.kw[b] is None):
            self.fail(f"{a} and {b} must both be given or both be None")

    def working_copies(self) -> list[bool]:
        """Per leaf: whether its working copy is its master (params_out aliases master_out)."""
        out = []
        for i, (p, po, mo) in enumerate(
            zip(self.kw["params"], self.kw["params_out"], self.kw["master_out"])
        ):
            if p.dtype != po.dtype:
                self.fail(f"params[{i}] is {p.dtype} but params_out[{i}] is {po.dtype}", TypeError)
            is_master = po.numel() > 0 and po.data_ptr() == mo.data_ptr()
            if is_master and po.dtype != torch.float32:
                self.fail(f"params_out[{i}] aliases master_out[{i}] but is {po.dtype}")
            out.append(is_master)
        return out


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def _chunk_rows(numel: list[int], first_slot: list[int] | None) -> torch.Tensor:
    """One row per chunk of the leaves of a class: (leaf in class, first element[, slot])."""
    n = torch.tensor(numel, dtype=torch.int64)
    count = (n + CHUNK - 1) // CHUNK
    leaf = torch.repeat_interleave(torch.arange(len(numel)), count)
    index = torch.arange(leaf.numel()) - (torch.cumsum(count, 0) - count)[leaf]
    cols = [leaf, index * CHUNK]
    if first_slot is not None:
        cols.append(torch.tensor(first_slot, dtype=torch.int64)[leaf] + index)
    return torch.stack(cols, 1)


class _Tables:
    """Every class's table of one call, sent to the device in one copy."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def add(self, values: torch.Tensor) -> tuple[int, int]:
        """Queues ``values``; returns their (offset, length) in the device table."""
        values = values.reshape(-1)
        self.parts.append(values)
        self.size += values.numel()
        return self.size - values.numel(), values.numel()

    def to(self, device: torch.device) -> torch.Tensor:
        """The concatenated table on ``device``, copied without a host sync."""
        host = torch.cat(self.parts) if self.parts else torch.zeros(1, dtype=torch.int64)
        if device.type != "cuda":
            return host
        host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            _GRAPH_TABLES.extend((host, table))  # every replay copies from ``host`` again
        return table


class _Class:
    """The leaves of one dtype class: their rows in the table, and the launch's grid."""

    def __init__(self, tables: _Tables, rows: list[list[int]], chunks: torch.Tensor) -> None:
        self.leaves = tables.add(torch.tensor(rows, dtype=torch.int64))
        self.chunks = tables.add(chunks)
        self.grid = chunks.shape[0]

    def views(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (a, n), (b, k) = self.leaves, self.chunks
        return table[a : a + n], table[b : b + k]


def _classes(
    tables: _Tables,
    roles: Sequence[Sequence[torch.Tensor] | None],
    keys: Sequence[tuple],
    per_group: int,
    first_slot: Sequence[int] | None = None,
) -> dict[tuple, _Class]:
    """Sorts the non-empty leaves into classes and adds each class's rows to ``tables``.

    A leaf's class is its key (the dtypes and flags the kernel is compiled
    for) and whether all its addresses are 16-byte aligned (vector loads), in
    that order. ``roles`` lists the per-leaf tensors in table order (``None``:
    a role the kernel does not use, address 0); a leaf's row is their
    addresses, its numel and its group. ``first_slot``: each leaf's first
    partial-result slot.
    """
    grads = roles[0]
    members: dict[tuple, list[int]] = {}
    rows: dict[int, list[int]] = {}
    for leaf, key in enumerate(keys):
        if grads[leaf].numel() > 0:
            addresses = [0 if r is None else r[leaf].data_ptr() for r in roles]
            aligned = all(a % 16 == 0 for a in addresses)
            rows[leaf] = addresses + [grads[leaf].numel(), leaf // per_group]
            members.setdefault((*key, aligned), []).append(leaf)
    classes = {}
    for key, leaves in members.items():
        slots = None if first_slot is None else [first_slot[i] for i in leaves]
        chunks = _chunk_rows([grads[i].numel() for i in leaves], slots)
        classes[key] = _Class(tables, [rows[i] for i in leaves], chunks)
    return classes


def _f32(x: float) -> float:
    """``x`` rounded to float32, as the kernels receive it."""
    return torch.tensor(x, dtype=torch.float32).item()


def _on(device: torch.device) -> Any:
    """A context that makes ``device`` current for the launches (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _sizes() -> dict[str, int]:
    if BLOCK & (BLOCK - 1) or CHUNK & (CHUNK - 1) or CHUNK < BLOCK:
        raise ValueError(
            f"BLOCK ({BLOCK}) and CHUNK ({CHUNK}) must be powers of two, BLOCK <= CHUNK"
        )
    return {"CHUNK": CHUNK, "BLOCK": BLOCK}


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def grad_stats(
    *,
    n_groups: int,
    grads: Sequence[torch.Tensor],
    inv: torch.Tensor | None,
    sum_squares: int,
    peak_out: torch.Tensor,
    sum_sq_out: torch.Tensor | None,
) -> None:
    """Per group ``k``: ``peak_out[k]`` = the largest ``|g|`` as float32 (+inf if any
    element is inf or NaN, 0 for a group without elements) and, if
    ``sum_squares``, ``sum_sq_out[k]`` = the float64 sum of ``fl32(g * inv[k])^2``.

    ``grads``: float32/float16/bfloat16 tensors; ``inv``: ``(G,)`` float32 or
    ``None`` (1); ``peak_out``: ``(G,)`` float32; ``sum_sq_out``: ``(G,)`` float64
    (``None`` without ``sum_squares``). One launch per gradient dtype, then one
    that reduces each group's per-chunk results in a fixed order.
    """
    kw = dict(
        grads=grads, inv=inv, sum_squares=sum_squares, peak_out=peak_out, sum_sq_out=sum_sq_out
    )
    check = _Checker("grad_stats", n_groups, kw)
    if sum_squares and sum_sq_out is None:
        check.fail("sum_sq_out is required with sum_squares", TypeError)
    sizes = _sizes()
    n_leaves = len(grads)
    per_group = n_leaves // n_groups
    first = [0]  # each leaf's first slot, in leaf order: a group's slots are contiguous
    for g in grads:
        first.append(first[-1] + -(-g.numel() // CHUNK))
    bounds = [first[k * per_group] for k in range(n_groups)] + [first[n_leaves]]
    tables = _Tables()
    classes = _classes(tables, [grads], [(g.dtype,) for g in grads], per_group, first)
    b_at, _ = tables.add(torch.tensor(bounds, dtype=torch.int64))
    device = check.device
    table = tables.to(device)
    peak_part = torch.empty(max(1, first[-1]), dtype=torch.float32, device=device)
    sq_part = torch.empty_like(peak_part, dtype=torch.float64) if sum_squares else peak_part
    with _on(device):
        for (dtype, aligned), c in classes.items():
            _launch(
                "grad_stats",
                _stats_kernel,
                c.grid,
                *c.views(table),
                inv if inv is not None else peak_out,
                peak_part,
                sq_part,
                G_TY=_TRITON_DTYPES[dtype],
                ALIGNED=aligned,
                HAS_INV=inv is not None,
                SUM_SQ=bool(sum_squares),
                **sizes,
            )
        _launch(
            "group_reduce",
            _group_reduce_kernel,
            n_groups,
            peak_part,
            sq_part,
            table[b_at : b_at + n_groups + 1],
            peak_out,
            sum_sq_out if sum_squares else peak_out,
            SUM_SQ=bool(sum_squares),
            BLOCK=BLOCK,
        )


def sgd_update(
    *,
    n_groups: int,
    grads: Sequence[torch.Tensor],
    master: Sequence[torch.Tensor],
    trace: Sequence[torch.Tensor] | None,
    params: Sequence[torch.Tensor],
    master_out: Sequence[torch.Tensor],
    trace_out: Sequence[torch.Tensor] | None,
    params_out: Sequence[torch.Tensor],
    inv: torch.Tensor | None,
    clip_div: torch.Tensor | None,
    clip_mul: torch.Tensor | None,
    lr: torch.Tensor,
    apply: torch.Tensor,
    started: torch.Tensor | None,
    weight_decay: float,
    momentum: float,
    take_started: float,
    nesterov: int,
) -> None:
    """One SGD step of every leaf, with the C kernel's ``ff_sgd_update`` arithmetic.

    ``master``/``trace`` and their outputs are float32; ``grads``, ``params`` and
    ``params_out`` float32, float16 or bfloat16. Per-group ``(G,)`` tensors:
    ``inv`` (float32 or ``None``), ``clip_div``/``clip_mul`` (float32, both or
    neither), ``lr`` (float32, the signed step factor), ``apply`` (bool, required:
    no speculative step) and ``started`` (bool; ``None`` counts as not started).
    Momentum is on iff ``trace`` and ``trace_out`` are given (as in the C
    kernel: a momentum that rounds to 0 in float32 is still momentum);
    ``nesterov`` only counts with momentum.
    ``take_started`` is ``1 - dampening``. A leaf whose ``params_out`` is its
    ``master_out`` has no separate working copy. Outputs may be the inputs. One
    launch per (gradient dtype, working-copy dtype, working copy is master).
    """
    kw = dict(
        grads=grads,
        master=master,
        trace=trace,
        params=params,
        master_out=master_out,
        trace_out=trace_out,
        params_out=params_out,
        inv=inv,
        clip_div=clip_div,
        clip_mul=clip_mul,
        lr=lr,
        apply=apply,
        started=started,
        weight_decay=weight_decay,
        momentum=momentum,
        take_started=take_started,
        nesterov=nesterov,
    )
    check = _Checker("sgd_update", n_groups, kw)
    if apply is None:
        check.fail("apply is required (the CUDA kernel runs decided steps only)", TypeError)
    check.both_or_neither("clip_div", "clip_mul")
    check.both_or_neither("trace", "trace_out")
    has_momentum = trace is not None
    is_master = check.working_copies()
    sizes = _sizes()
    keys = [(g.dtype, p.dtype, m) for g, p, m in zip(grads, params_out, is_master)]
    roles = [grads, master, trace, params, master_out, trace_out, params_out]
    if not has_momentum:
        roles[2] = roles[5] = None
    tables = _Tables()
    classes = _classes(tables, roles, keys, len(grads) // n_groups)
    if not classes:
        return
    table = tables.to(check.device)
    flags = dict(
        HAS_INV=inv is not None,
        CLIP=clip_div is not None,
        DECAY=_f32(weight_decay) != 0.0,
        MOMENTUM=has_momentum,
        STARTED=has_momentum and started is not None,
        NESTEROV=has_momentum and bool(nesterov),
        **sizes,
    )
    with _on(check.device):
        for (g_dtype, p_dtype, p_is_master, aligned), c in classes.items():
            _launch(
                "sgd_update",
                _sgd_kernel,
                c.grid,
                *c.views(table),
                inv if inv is not None else lr,
                clip_div if clip_div is not None else lr,
                clip_mul if clip_mul is not None else lr,
                lr,
                apply,
                started if started is not None else apply,
                float(weight_decay),
                float(momentum),
                float(take_started),
                G_TY=_TRITON_DTYPES[g_dtype],
                P_TY=_TRITON_DTYPES[p_dtype],
                ALIGNED=aligned,
                P_IS_MASTER=p_is_master,
                **flags,
            )


def adam_update(
    *,
    n_groups: int,
    grads: Sequence[torch.Tensor],
    master: Sequence[torch.Tensor],
    mu: Sequence[torch.Tensor],
    nu: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    master_out: Sequence[torch.Tensor],
    mu_out: Sequence[torch.Tensor],
    nu_out: Sequence[torch.Tensor],
    params_out: Sequence[torch.Tensor],
    inv: torch.Tensor | None,
    clip_div: torch.Tensor | None,
    clip_mul: torch.Tensor | None,
    lr: torch.Tensor,
    apply: torch.Tensor,
    inv_c1: torch.Tensor,
    sqrt_c2: torch.Tensor,
    l2: float,
    w: float,
    b2: float,
    c2: float,
    eps: float,
    decoupled: float,
) -> None:
    """One Adam/AdamW step of every leaf, with the C kernel's ``ff_adam_update`` arithmetic.

    ``master``, ``mu``, ``nu`` and their outputs are float32; ``grads``,
    ``params``, ``params_out`` float32, float16 or bfloat16. Per-group ``(G,)``
    tensors: ``inv``, ``clip_div``/``clip_mul``, ``lr`` as in :func:`sgd_update`,
    ``apply`` (bool), ``inv_c1`` = fl32(1 / (1 - b1^t)) and ``sqrt_c2`` =
    fl32(sqrt(1 - b2^t)) (float32). ``w`` = fl32(1 - b1) (torch.lerp's weight),
    ``c2`` = 1 - b2; ``l2`` (Adam's decay) and ``decoupled`` (AdamW's) of 0 are
    off. One launch per (gradient dtype, working-copy dtype, working copy is master).
    """
    kw = dict(
        grads=grads,
        master=master,
        mu=mu,
        nu=nu,
        params=params,
        master_out=master_out,
        mu_out=mu_out,
        nu_out=nu_out,
        params_out=params_out,
        inv=inv,
        clip_div=clip_div,
        clip_mul=clip_mul,
        lr=lr,
        apply=apply,
        inv_c1=inv_c1,
        sqrt_c2=sqrt_c2,
        l2=l2,
        w=w,
        b2=b2,
        c2=c2,
        eps=eps,
        decoupled=decoupled,
    )
    check = _Checker("adam_update", n_groups, kw)
    check.both_or_neither("clip_div", "clip_mul")
    is_master = check.working_copies()
    sizes = _sizes()
    keys = [(g.dtype, p.dtype, m) for g, p, m in zip(grads, params_out, is_master)]
    roles = [grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out]
    tables = _Tables()
    classes = _classes(tables, roles, keys, len(grads) // n_groups)
    if not classes:
        return
    table = tables.to(check.device)
    flags = dict(
        HAS_INV=inv is not None,
        CLIP=clip_div is not None,
        L2=_f32(l2) != 0.0,
        DECOUPLED=_f32(decoupled) != 0.0,
        SMALL_W=abs(_f32(w)) < 0.5,
        **sizes,
    )
    with _on(check.device):
        for (g_dtype, p_dtype, p_is_master, aligned), c in classes.items():
            _launch(
                "adam_update",
                _adam_kernel,
                c.grid,
                *c.views(table),
                inv if inv is not None else lr,
                clip_div if clip_div is not None else lr,
                clip_mul if clip_mul is not None else lr,
                lr,
                apply,
                inv_c1,
                sqrt_c2,
                float(l2),
                float(w),
                float(b2),
                float(c2),
                float(eps),
                float(decoupled),
                G_TY=_TRITON_DTYPES[g_dtype],
                P_TY=_TRITON_DTYPES[p_dtype],
                ALIGNED=aligned,
                P_IS_MASTER=p_is_master,
                **flags,
            )
