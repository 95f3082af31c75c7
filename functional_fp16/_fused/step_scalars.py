r"""The scalars a fused step needs before it runs, in one op: decision, clip factors, schedules.

Per member :math:`k` (one, or the members of a ``vmap``), from the leaves' peak
magnitudes :math:`M_l` (``grad_stats``), the unscale factor :math:`s^{-1}`, the
condition :math:`r` (a finite loss), the float64 sum of squares :math:`S` of the
unscaled gradients and the counts :math:`c_j` of the schedules:

.. math::
    \ell_l &= \operatorname{isfinite}(\operatorname{fl}_{32}(M_l\, s^{-1})), \qquad
    f = r \wedge \textstyle\bigwedge_l \ell_l \\
    n &= \operatorname{fl}_{32}(\sqrt{S}), \qquad
    (d, c) = \begin{cases} (1, 1) & n < \operatorname{fl}_{32}(C) \\
                           (n, \operatorname{fl}_{32}(C)) & \text{otherwise} \end{cases} \\
    \eta_j &= \sigma_j\, v_j(c_j)

(the decision of ``Decision.leaves``, the factors of ``clip_by_global_norm``, each
schedule's signed step factor), each part only where it is asked for. A schedule is
given by its declared form (``transforms.schedules.declared_form``) and evaluated with
the float64 operations of its definition, in their order, rounded once to float32:
the same bits as the schedule called on its count.

``functional_fp16::step_scalars`` is one op call, and each kernel behind it one
launch: the C++ kernel on the CPU (``functional_fp16_cpu::step_scalars``), the Triton
kernel on CUDA (:mod:`.triton_step_scalars`; on the CPU in Triton's interpreter when
CUDA's default is forced there), the reference's PyTorch ops elsewhere. Under
``torch.compile`` it is one opaque call, whose scalars Inductor does not generate
kernels for.

A float64 operation taken in another order than the definition's would change the
float32 result only where the float64 value lies within an ulp of a float32 rounding
boundary; ``tests/test_step_scalars.py`` finds what changes more (a float32
intermediate fails it), and the kernel takes the definition's order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from functional_fp16._fused import device_kernels, plain_kernels, triton_step_scalars
from functional_fp16._fused.device_kernels import cpp_ready, kernel_for
from functional_fp16._fused.op_library import _define, _transformed
from functional_fp16._fused.programs import decode, program
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16.precision.loss_scale import unscale_factor
from functional_fp16.transforms import schedules as sch
from functional_fp16.transforms.adam import bias_corrections
from functional_fp16.transforms.base import saturating_increment
from functional_fp16.transforms.clipping import clip_factors, norm_of_sum_of_squares

__all__ = ["STEP_SCALARS", "program", "reference", "step_scalars"]

SCHEMA = (
    "(Tensor? peak, Tensor? inv, Tensor? require, Tensor? sum_sq, float max_norm, "
    "Tensor[] counts, float[] programs, int members) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])"
)
r"""``peak``: ``members * L`` float32 peaks, member-major (``None``: no decision);
``inv``, ``require``, ``sum_sq`` (``None``: no clipping): one per member; ``counts``:
int32, one per member each; ``programs``: for each count its sign :math:`\sigma_j`,
then its schedule's program (:func:`.programs.program`). The outputs: the leaves' flags, the
decisions, the skips (``1.0`` where a member skips: the ``found_inf`` of PyTorch's
fused optimisers), the clip divisor and factor (empty without clipping), one signed
factor per count."""


def _correction(count: Tensor, kind: str, b: float) -> Tensor:
    """One of Adam's bias corrections at the count after this step."""
    inv_c1, sqrt_c2 = bias_corrections(saturating_increment(count), b, b)
    return inv_c1 if kind == "inv_c1" else sqrt_c2


def count_after(count: Tensor) -> Tensor:
    r""":math:`\operatorname{fl}_{32}(\operatorname{fl}_{32}(c) + 1)`: the step count after
    this step, in float32 as ``torch.optim`` keeps it (exact below 2^24 steps)."""
    return count.to(torch.float32).add_(1.0)


def _schedule(form: tuple):
    """The library's schedule that ``form`` declares (the reference's definition)."""
    kind, *args = form
    if kind == "constant":
        return sch.constant_schedule(*args)
    if kind == "linear":
        return sch.linear_schedule(*args)
    if kind == "polynomial":
        return sch.polynomial_schedule(*args)
    if kind == "exponential":
        v0, steps, rate, begin, staircase, end = args
        return sch.exponential_decay(v0, steps, rate, begin, staircase, end)
    if kind == "piecewise":
        v0, bounds, values = args
        return sch.piecewise_values(v0, bounds, values)
    if kind == "cosine":
        return sch.cosine_decay_schedule(*args)
    if kind == "count":
        return count_after
    if kind in ("inv_c1", "sqrt_c2"):
        return lambda count: _correction(count, kind, args[0])
    if kind == "inverse":
        return lambda bits: unscale_factor(bits.view(torch.float32))
    forms, boundaries = args
    return sch.join_schedules([_schedule(f) for f in forms], list(boundaries))


def reference(peak, inv, require, sum_sq, max_norm, counts, programs, members):
    """The op's outputs by the library's definitions: ``finite_from_peak``'s flags and
    ``Decision``'s AND, ``norm_of_sum_of_squares`` and ``clip_factors``, each schedule
    called on its count (PyTorch ops, one per quantity)."""
    device = (peak if peak is not None else counts[0] if counts else sum_sq).device
    leaves = torch.empty(0, dtype=torch.bool, device=device)
    finite = torch.empty(0, dtype=torch.bool, device=device)
    skip = torch.empty(0, dtype=torch.float32, device=device)
    if peak is not None:
        by = peak.reshape(members, -1)
        leaves = torch.isfinite(by if inv is None else by * inv.reshape(members, 1))
        finite = leaves.all(dim=1)
        finite = finite if require is None else finite & require
        leaves = leaves.reshape(-1)
        skip = torch.where(finite, 0.0, 1.0)
    div = mul = torch.empty(0, dtype=torch.float32, device=device)
    if sum_sq is not None:
        div, mul = clip_factors(norm_of_sum_of_squares(sum_sq), max_norm)
    lrs = []
    for count, (sign, form) in zip(
        counts, [(sign, form) for _, sign, form in decode(programs, len(counts))]
    ):
        schedule = _schedule(form)
        if members == 1:  # the schedule on the 0-d count, as the transforms call it
            lrs.append((schedule(count.reshape(())) * sign).reshape(1))
        else:
            lrs.append(torch.stack([schedule(c) for c in count.unbind()]) * sign)
    return leaves, finite, skip, div, mul, lrs


def _kernel(peak, inv, require, sum_sq, max_norm, counts, programs, members):
    """The device's kernel: the C++ kernel where the CPU runs the C kernel, the Triton
    kernel where it runs (CUDA; the CPU in its interpreter), else the reference."""
    args = (peak, inv, require, sum_sq, max_norm, counts, programs, members)
    device = next(t for t in (peak, sum_sq, *counts) if t is not None).device
    if cpp_ready(None, kernel_for(device)):
        return c_kernel.run_op("step_scalars", *args)
    if triton_step_scalars.available(device):
        return triton_step_scalars.run(*args, reference=reference)
    return reference(peak, inv, require, sum_sq, max_norm, counts, programs, members)


def _fake(peak, inv, require, sum_sq, max_norm, counts, programs, members):
    del inv, require, max_norm, programs
    like = next(t for t in (peak, sum_sq, *counts) if t is not None)
    device = like.device
    n = 0 if peak is None else peak.numel()
    deciding = members if peak is not None else 0
    clipping = members if sum_sq is not None else 0
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.empty(n, dtype=torch.bool, device=device),
        torch.empty(deciding, dtype=torch.bool, device=device),
        torch.empty(deciding, **f32),
        torch.empty(clipping, **f32),
        torch.empty(clipping, **f32),
        [torch.empty(members, **f32) for _ in counts],
    )


def _rule(op):
    def rule(info, in_dims, peak, inv, require, sum_sq, max_norm, counts, programs, members):
        """Every input with its batch dimension first (an unbatched one expanded to the
        batch) and flattened: ``K`` batches of ``members`` are ``K * members`` members of
        one call; every output batched at 0."""
        size = info.batch_size

        def first(x, d):
            if x is None:
                return None
            x = x.unsqueeze(0).expand(size, *x.shape) if d is None else x.movedim(d, 0)
            return x.reshape(-1).contiguous()

        d_peak, d_inv, d_req, d_sq, _, d_counts = in_dims[:6]
        out = op(
            first(peak, d_peak), first(inv, d_inv), first(require, d_req), first(sum_sq, d_sq),
            max_norm, [first(c, d) for c, d in zip(counts, d_counts or [None] * len(counts))],
            programs, members * size,
        )  # fmt: skip
        *scalars, lrs = out
        shaped = (*(x.reshape(size, -1) for x in scalars), [x.reshape(size, -1) for x in lrs])
        return shaped, (0, 0, 0, 0, 0, [0] * len(lrs))

    return rule


STEP_SCALARS = _define("step_scalars", SCHEMA, _kernel, _fake, _rule)
"""``torch.ops.functional_fp16.step_scalars.default``."""


def step_scalars(
    peak: Tensor | None,
    inv: Tensor | None,
    require: Tensor | None,
    sum_sq: Tensor | None,
    max_norm: float,
    schedules: list[tuple[Tensor, float, Any]],
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """One op call for one member (shapes ``(1,)``): ``schedules`` are ``(count, sign,
    declared form)``. Returns ``(leaf flags, decision, clip divisor, clip factor, signed
    factors)``; the decision's skip flag is kept for :func:`plain_kernels.skip_flag`. See
    the module docstring."""
    counts = [c.reshape(1) for c, _, _ in schedules]
    programs: list[float] = []
    for _, sign, form in schedules:
        programs += [float(sign), *program(form)]
    args = (peak, inv, require, sum_sq, float(max_norm), counts, programs, 1)
    given = [t for t in (peak, inv, require, sum_sq, *counts) if t is not None]
    if not all(type(t) is Tensor for t in given):  # a DTensor's loss: its own ops
        leaves, finite, skip, div, mul, lrs = reference(*args)
    elif not _transformed() and cpp_ready(None, kernel_for(given[0].device)):
        leaves, finite, skip, div, mul, lrs = c_kernel.run_op("step_scalars", *args)  # direct
    else:
        leaves, finite, skip, div, mul, lrs = STEP_SCALARS(*args)
    if peak is not None:
        plain_kernels.remember("skip", finite, skip.reshape(()))
    return leaves, finite, div, mul, lrs


def _decide_from_peaks(peak: Tensor, inv: Tensor | None, require: Tensor | None):
    """``(leaf_finite, finite)`` of one group from its leaves' peaks, in one launch."""
    leaves, finite, _, _, _ = step_scalars(peak, inv, require, None, 0.0, [])
    return leaves, finite


device_kernels.DECIDE_FROM_PEAKS[0] = _decide_from_peaks
