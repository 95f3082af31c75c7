r"""The bookkeeping of one update, in one op: every 0-d quantity an update advances.

With :math:`f` whether the step was applied (its gradients finite) and the loss
scale's state :math:`(s, n, h)` (scale, growth count, hysteresis count), one call
computes

.. math::
    (s', n', h') &= \operatorname{adjust}(s, n, h; f)
        \quad\text{(}:meth:`DynamicLossScale.adjust <functional_fp16.DynamicLossScale.adjust>`\text{; a fixed scale is kept)} \\
    \text{skips}' &= \text{skips} + [\neg f], \quad
    \text{growths}' = \text{growths} + [s' > s], \quad
    \text{backoffs}' = \text{backoffs} + [s' < s] \\
    \text{since\_skip}' &= f\,(\text{since\_skip} + 1), \qquad
    \text{step}' = \text{step} + 1 \\
    c' &= f \mathbin{?} \min(c + 1, 2^{31} - 1) : c \quad\text{(each int32 counter: a count of applied steps)} \\
    b' &= b \lor f \quad\text{(each bool flag: momentum's ``started``)}

elementwise over any shape (a ``vmap`` over members makes it a vector), in integer
and float32 arithmetic exactly as the reference below (the library's Python
definitions of those quantities) computes them, so scales, counters and flags are
bitwise the same from every kernel.

``functional_fp16::bookkeeping`` is one op call, and each kernel behind it is one
launch: the C++ kernel on the CPU (``functional_fp16_cpu::bookkeeping``), the Triton
kernel on CUDA (:mod:`.triton_bookkeeping`; on the CPU in Triton's interpreter when
CUDA's default is forced there), and the reference's PyTorch ops where neither runs.
It replaces about 30 launches of 0-d ops per update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from functional_fp16._fused import triton_bookkeeping
from functional_fp16._fused.device_kernels import cpp_ready, kernel_for
from functional_fp16._fused.op_library import _define, _transformed
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16.precision.loss_scale import DynamicLossScale, remember_inverse, unscale_factor
from functional_fp16.precision.scale_stats import ScaleStats, advance_stats
from functional_fp16.transforms.base import saturating_increment

__all__ = ["bookkeep", "reference", "BOOKKEEPING"]

_INT32_MAX = 2**31 - 1

SCHEMA = (
    "(Tensor finite, Tensor[] scale, Tensor[] stats, Tensor step, Tensor[] counters, "
    "float[] config, int kind) -> (Tensor[], Tensor[], Tensor, Tensor, Tensor[])"
)
r"""``scale``: the loss scale's tensors (kind 0, dynamic: scale, growth count, hysteresis
count; kind 1, fixed: the scale); ``stats``: the four ``ScaleStats`` counters;
``counters``: int32 counts and bool flags; ``config``: growth factor, backoff factor,
growth interval, min scale, max scale, hysteresis (zeros for a fixed scale). The
outputs: the new scale fields, stats, step, the new scale's unscale factor
:math:`\operatorname{fl}_{32}(1/\operatorname{fl}_{64}(s'))` (which the next update reads
instead of computing it: ``loss_scale.remember_inverse``), and the counters."""


def _scale_object(config, fields):
    """A :class:`DynamicLossScale` with ``config`` and tensor ``fields`` (unchecked)."""
    gf, bf, interval, lo, hi, hyst = config
    out = DynamicLossScale.__new__(DynamicLossScale)
    for name, value in zip(DynamicLossScale.TENSOR_FIELDS, fields, strict=True):
        setattr(out, name, value)
    out.growth_factor, out.backoff_factor = gf, bf
    out.growth_interval, out.hysteresis = int(interval), int(hyst)
    out.min_scale, out.max_scale = lo, hi
    return out


def reference(finite, scale, stats, step, counters, config, kind):
    """The op's outputs by the library's definitions (PyTorch ops, one per quantity)."""
    if kind == 0:
        new = _scale_object(config, scale).adjusted_by(finite)
        scale_out = [getattr(new, n) for n in DynamicLossScale.TENSOR_FIELDS]
    else:
        scale_out = [scale[0].clone()]
    stats_out = list(advance_stats(ScaleStats(*stats), scale[0], scale_out[0], finite))
    step_out = (step + 1).to(torch.int32)
    return scale_out, stats_out, step_out, unscale_factor(scale_out[0]), _advanced(counters, finite)


def _advanced(counters: list[Tensor], finite: Tensor) -> list[Tensor]:
    """Each int32 count advanced on an applied step (saturating), each bool flag set."""
    return [
        c | finite if c.dtype == torch.bool else torch.where(finite, saturating_increment(c), c)
        for c in counters
    ]


def _kernel(finite, scale, stats, step, counters, config, kind):
    """The device's kernel: the C++ kernel where the CPU runs the C kernel, the Triton
    kernel where it runs (CUDA; the CPU in its interpreter), else the reference."""
    device = finite.device
    if cpp_ready(None, kernel_for(device)):
        return c_kernel.run_op("bookkeeping", finite, scale, stats, step, counters, config, kind)
    if triton_bookkeeping.available(device):
        return triton_bookkeeping.run(finite, scale, stats, step, counters, config, kind)
    return reference(finite, scale, stats, step, counters, config, kind)


def _fake(finite, scale, stats, step, counters, config, kind):
    del finite, config, kind
    like = torch.empty_like
    return (
        [like(t) for t in scale],
        [like(t) for t in stats],
        like(step),
        like(scale[0]),
        [like(t) for t in counters],
    )


def _rule(op):
    def rule(info, in_dims, finite, scale, stats, step, counters, config, kind):
        """Elementwise: every input with its batch dimension first (an unbatched one
        expanded to the batch), one call, every output batched at 0."""
        size = info.batch_size

        def first(x, d):
            return (
                x.unsqueeze(0).expand(size, *x.shape).contiguous()
                if d is None
                else (x.movedim(d, 0).contiguous())
            )

        def each(xs, ds):
            return [first(x, d) for x, d in zip(xs, ds or [None] * len(xs))]

        d_f, d_sc, d_st, d_step, d_c = in_dims[:5]
        out = op(
            first(finite, d_f), each(scale, d_sc), each(stats, d_st), first(step, d_step),
            each(counters, d_c), config, kind,
        )  # fmt: skip
        s, st, _, _, c = out
        return out, ([0] * len(s), [0] * len(st), 0, 0, [0] * len(c))

    return rule


BOOKKEEPING = _define("bookkeeping", SCHEMA, _kernel, _fake, _rule)
"""``torch.ops.functional_fp16.bookkeeping.default``."""


_CONFIGS: dict = {}


def _config(loss_scale) -> tuple[int, list[float]] | None:
    """The op's ``kind`` and ``config`` for ``loss_scale``; ``None`` where the op cannot
    take it (counts or hysteresis past int32). Made once per configuration in eager mode;
    in a ``torch.compile`` trace made afresh, so that the graph's guards do not read the
    cache (which the first trace fills: a recompile on the second call)."""
    if torch.compiler.is_compiling():
        return _make_config(loss_scale)
    key = (type(loss_scale), loss_scale.config())
    if key not in _CONFIGS:
        _CONFIGS[key] = _make_config(loss_scale)
    return _CONFIGS[key]


def _make_config(loss_scale) -> tuple[int, list[float]] | None:
    if not isinstance(loss_scale, DynamicLossScale):
        return 1, [0.0] * 6
    if loss_scale.growth_interval > _INT32_MAX or loss_scale.hysteresis > _INT32_MAX:
        return None
    ls = loss_scale
    return 0, [
        float(ls.growth_factor), float(ls.backoff_factor), float(ls.growth_interval),
        float(ls.min_scale), float(ls.max_scale), float(ls.hysteresis),
    ]  # fmt: skip


_DTYPES = {torch.float32, torch.int32, torch.bool}


def _takes(tensors: list[Tensor], like: Tensor) -> bool:
    """Whether the op takes these tensors: plain tensors (no DTensor or other subclass),
    of ``like``'s device and shape, float32, int32 or bool."""
    return all(
        type(t) is Tensor and t.device == like.device and t.shape == like.shape
        and t.dtype in _DTYPES
        for t in tensors
    )  # fmt: skip


def bookkeep(state, finite: Tensor, counters: list[Tensor]) -> tuple[Any, ScaleStats, Tensor, list]:
    """One update's bookkeeping (see the module docstring) for ``state`` given the
    decision ``finite``: ``(loss_scale', scale_stats', step', counters')``, one op call
    (the reference's ops where the op cannot take the state: DTensor states, counts past
    int32)."""
    ls = state.loss_scale
    scale = [getattr(ls, n) for n in ls.TENSOR_FIELDS]
    stats = list(state.scale_stats)
    conf = _config(ls)
    every = [finite, *scale, *stats, state.step, *counters]
    if conf is None or not _takes(every, finite):
        new_ls = ls.adjust(finite)
        new_stats = advance_stats(state.scale_stats, ls.loss_scale, new_ls.loss_scale, finite)
        return new_ls, new_stats, state.step + 1, _advanced(counters, finite)
    kind, config = conf
    args = (finite, scale, stats, state.step, counters, config, kind)
    if not _transformed() and cpp_ready(None, kernel_for(finite.device)):
        s, st, step, inv, out = c_kernel.run_op("bookkeeping", *args)  # the CPU kernel, direct
    else:
        s, st, step, inv, out = BOOKKEEPING(*args)
    new_ls = ls._replace(**dict(zip(ls.TENSOR_FIELDS, s, strict=True)))
    if not _transformed():  # a plain tensor for the next eager call; none in a trace
        remember_inverse(new_ls, inv)
    return new_ls, ScaleStats(*st), step, list(out)
