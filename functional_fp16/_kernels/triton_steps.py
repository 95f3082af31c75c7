"""The fused optimiser steps for CUDA tensors: multi-tensor Triton launches.

The CUDA counterpart of ``fused_step.c``, with the same entry points, argument
names and arithmetic, element by element: :func:`grad_stats`,
:func:`sgd_update` and :func:`adam_update` check their arguments against the
declarations in ``signatures.py``, sort the leaves into classes (one launch
each) and launch the kernels. The kernels and their arithmetic are in
``triton_sgd`` (SGD), ``triton_adam`` (Adam/AdamW) and ``triton_stats`` (the
gradient statistics), built from ``triton_blocks``; ``triton_launch`` holds
the argument checker, the leaf classes and their tables, and the counted
launch. :data:`BLOCK` and :data:`CHUNK` size the programs.

Nothing here has run on a GPU: the kernels' logic and arithmetic are verified
under ``TRITON_INTERPRET=1`` on CPU tensors and their CUDA compilation only
offline (PTX for sm_90), so launches, the pinned copy and graph capture are
untested.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functional_fp16._kernels.triton_blocks import IMPORT_ERROR, TRITON_DTYPES, triton
from functional_fp16._kernels.triton_launch import (
    Checker,
    Tables,
    classes,
    device_context,
    f32,
    launch,
    launch_counts,
    launch_step,
)

if triton is not None:
    from functional_fp16._kernels.triton_adam import _adam_kernel
    from functional_fp16._kernels.triton_sgd import _sgd_kernel
    from functional_fp16._kernels.triton_stats import _segment_reduce_kernel, _stats_kernel

__all__ = [
    "available",
    "unavailable_reason",
    "launch_counts",
    "grad_stats",
    "sgd_update",
    "adam_update",
]

BLOCK = 1024
"""Elements per step of a program (a power of two)."""
CHUNK = 32 * BLOCK
"""Elements per program at most, one table row each (a power of two, at least :data:`BLOCK`)."""


def available() -> bool:
    """Whether the kernels can run on CUDA tensors here (triton importable, a CUDA device)."""
    return IMPORT_ERROR is None and torch.cuda.is_available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, or ``None``."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    return None if torch.cuda.is_available() else "no CUDA device"


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
    """Per leaf ``l``: ``peak_out[l]`` = the largest ``|g_l|`` as float32 (+inf if any
    element is inf or NaN, 0 for an empty leaf); per group ``k``, if ``sum_squares``,
    ``sum_sq_out[k]`` = the float64 sum of ``fl32(g * inv[k])^2``.

    ``grads``: float32/float16/bfloat16 tensors; ``inv``: ``(G,)`` float32 or
    ``None`` (1); ``peak_out``: ``(L,)`` float32; ``sum_sq_out``: ``(G,)`` float64
    (``None`` without ``sum_squares``). One launch per gradient dtype, then one
    that reduces each leaf's per-chunk peaks in a fixed order (and one for the
    groups' sums).
    """
    kw = dict(
        grads=grads, inv=inv, sum_squares=sum_squares, peak_out=peak_out, sum_sq_out=sum_sq_out
    )
    check = Checker("grad_stats", n_groups, kw)
    if sum_squares and sum_sq_out is None:
        check.fail("sum_sq_out is required with sum_squares", TypeError)
    sizes = _sizes()
    n_leaves = len(grads)
    per_group = n_leaves // n_groups
    first = [0]  # each leaf's first slot, in leaf order: a group's slots are contiguous
    for g in grads:
        first.append(first[-1] + -(-g.numel() // CHUNK))
    bounds = [first[k * per_group] for k in range(n_groups)] + [first[n_leaves]]
    tables = Tables()
    leaf_classes = classes(tables, [grads], [(g.dtype,) for g in grads], per_group, CHUNK, first)
    leaf_at, _ = tables.add(torch.tensor(first, dtype=torch.int64))
    b_at, _ = tables.add(torch.tensor(bounds, dtype=torch.int64))
    device = check.device
    table = tables.to(device)
    peak_part = torch.empty(max(1, first[-1]), dtype=torch.float32, device=device)
    sq_part = torch.empty_like(peak_part, dtype=torch.float64) if sum_squares else peak_part
    with device_context(device):
        for (dtype, aligned), c in leaf_classes.items():
            launch(
                "grad_stats",
                _stats_kernel,
                c.grid,
                *c.views(table),
                inv if inv is not None else peak_out,
                peak_part,
                sq_part,
                G_TY=TRITON_DTYPES[dtype],
                ALIGNED=aligned,
                HAS_INV=inv is not None,
                SUM_SQ=bool(sum_squares),
                **sizes,
            )
        if n_leaves:
            launch(
                "leaf_reduce",
                _segment_reduce_kernel,
                n_leaves,
                peak_part,
                table[leaf_at : leaf_at + n_leaves + 1],
                peak_out,
                SUM=False,
                BLOCK=BLOCK,
            )
        if sum_squares:
            launch(
                "group_reduce",
                _segment_reduce_kernel,
                n_groups,
                sq_part,
                table[b_at : b_at + n_groups + 1],
                sum_sq_out,
                SUM=True,
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
    check = Checker("sgd_update", n_groups, kw)
    if apply is None:
        check.fail("apply is required (the CUDA kernel runs decided steps only)", TypeError)
    check.both_or_neither("clip_div", "clip_mul")
    check.both_or_neither("trace", "trace_out")
    has_momentum = trace is not None
    roles = [grads, master, trace, params, master_out, trace_out, params_out]
    if not has_momentum:
        roles[2] = roles[5] = None
    flags = dict(
        HAS_INV=inv is not None,
        CLIP=clip_div is not None,
        DECAY=f32(weight_decay) != 0.0,
        MOMENTUM=has_momentum,
        STARTED=has_momentum and started is not None,
        NESTEROV=has_momentum and bool(nesterov),
    )
    scalars = [inv if inv is not None else lr, clip_div if clip_div is not None else lr]
    scalars += [clip_mul if clip_mul is not None else lr, lr, apply]
    scalars.append(started if started is not None else apply)
    numbers = [weight_decay, momentum, take_started]
    launch_step("sgd_update", _sgd_kernel, check, roles, scalars, numbers, flags, _sizes())


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
    check = Checker("adam_update", n_groups, kw)
    check.both_or_neither("clip_div", "clip_mul")
    roles = [grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out]
    flags = dict(
        HAS_INV=inv is not None,
        CLIP=clip_div is not None,
        L2=f32(l2) != 0.0,
        DECOUPLED=f32(decoupled) != 0.0,
        SMALL_W=abs(f32(w)) < 0.5,
    )
    scalars = [inv if inv is not None else lr, clip_div if clip_div is not None else lr]
    scalars += [clip_mul if clip_mul is not None else lr, lr, apply, inv_c1, sqrt_c2]
    numbers = [l2, w, b2, c2, eps, decoupled]
    launch_step("adam_update", _adam_kernel, check, roles, scalars, numbers, flags, _sizes())
