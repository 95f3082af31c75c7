r"""Gradient accumulation: ``MultiSteps`` applies an optimiser once every ``k`` micro-batches.

``MultiSteps(opt, every_k_schedule)`` is optax's wrapper, with optax's names
and state: it sums the gradients of ``k`` consecutive calls into an FP32
accumulator and hands their mean to ``opt`` on the ``k``-th. Given to
:func:`~functional_fp16.fp16_init` as the optimiser, one
:func:`~functional_fp16.fp16_update` call per micro-batch trains like a
``GradScaler`` loop that calls ``scaler.scale(loss / k).backward()`` on ``k``
micro-batches and then ``scaler.step(opt)``, ``scaler.update()`` and
``opt.zero_grad()``. With micro-batch gradients :math:`g_1..g_k` of the scaled
loss, all scaled by the same :math:`s`:

.. math::
    \hat g_i &= \operatorname{fl}_{32}(g_i) \cdot \operatorname{fl}_{32}(1/\operatorname{fl}_{64}(s))
        \qquad a_i = a_{i-1} + \hat g_i \quad (a_0 = 0, \text{ FP32}) \\
    f &= \textstyle\bigwedge_i \operatorname{isfinite}(\hat g_i) \wedge \operatorname{isfinite}(a_k / k) \\
    (u, o') &= \text{opt.update}(a_k / k, o, m) \qquad
    m' = m + u,\ o' \text{ if } f \text{ else } m,\ o \\
    s' &= \text{adjust}(s, f) \text{ once, after the } k\text{-th micro-batch}

How it meets loss scaling (the choices, made to match ``GradScaler``):

* **One scale per window.** The loss scale changes only when a window closes,
  so every micro-batch of a window is scaled by the same :math:`s`, as with
  ``GradScaler``, whose scale moves only in ``scaler.update()``. Each
  micro-batch is unscaled on arrival, so the accumulator holds unscaled FP32
  gradients; it is never rounded to FP16.
* **An overflow skips the whole window.** An inf or NaN in any micro-batch
  (or a non-finite ``loss=``) makes the window's step skipped: master, FP16
  params and the inner optimiser state stay bitwise as they were, the
  accumulator is emptied, and the scale backs off *once* when the window
  closes (``adjust`` sees one overflow per window, so ``growth_interval`` and
  ``hysteresis`` count windows, i.e. optimiser steps, as ``GradScaler``'s
  do). The micro-batches after the overflow are still consumed, so windows
  stay aligned with the data.
* **Counters.** ``state.step`` counts ``fp16_update`` calls (micro-batches);
  ``opt_state.mini_step`` the micro-batches in the open window;
  ``opt_state.gradient_step`` the *applied* windows (the argument of
  ``every_k_schedule``, and like every counter inside the optimiser state it
  does not move on a skipped step). After a skipped window the whole
  :class:`MultiStepsState` is bitwise what it was when the window opened.
  ``state.grads_finite`` is the window's flag so far: ``True`` while no
  micro-batch of the open window has overflowed, and on a window's last
  micro-batch, whether the window was applied. A step was applied by the
  call that returned ``state`` iff ``opt_state.mini_step == 0`` and
  ``state.grads_finite``.
* **Mean, not sum** (optax's default, ``use_grad_mean=True``): the inner
  optimiser sees :math:`a_k / k`, the full-batch gradient of a loss that is
  the mean over micro-batches; a ``GradScaler`` user gets it by dividing each
  micro-batch's loss by ``k``. ``use_grad_mean=False`` hands over the sum.
  The accumulator holds the running sum either way (optax's holds a running
  mean), so its contents say exactly which gradients were added.

Inside ``fp16_update`` the wrapper is recognised from its declared ``spec``
(:class:`MultiStepsSpec`) and :func:`~functional_fp16.update.accumulation.fp16_accumulate_update` runs instead of
the plain update; the inner optimiser is then stepped by the implementation
``fp16_update`` was asked for (the fused kernels included), on the FP32
mean, with the step applied only on a window's last, finite micro-batch. No
value is read on the host, so this runs under ``torch.compile`` and CUDA
graphs: like optax's ``MultiSteps`` under ``jax.jit``, the inner update is
evaluated on every micro-batch and selected with ``torch.where``, which costs
one optimiser step's arithmetic per micro-batch. ``MultiSteps`` must be the
outermost transform given to ``fp16_init`` (``MultiSteps(chain(...), k)``).

Used on its own (``tx.update``, e.g. for FP32 training outside
``fp16_update``) it follows optax: zeros on the first ``k - 1`` calls, the
inner update of the mean on the ``k``-th, no skipping (``acc_finite`` still
records whether the window's gradients were finite); the mean is cast to the
updates' dtype when handed to the inner transform, as optax casts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.finite import grads_finite
from functional_fp16._util.multi_tensor import zero_where
from functional_fp16._util.tree import (
    PyTree,
    check_like,
    describe_tensor,
    tree_flatten,
    tree_select,
    tree_unflatten,
)
from functional_fp16.transforms.base import (
    GradientTransformation,
    saturating_increment,
    update_with_extra_args,
)

__all__ = ["MultiSteps", "MultiStepsState", "MultiStepsSpec"]

_INT32_MAX = torch.iinfo(torch.int32).max

EveryK = int | Callable[[torch.Tensor], Any]


class MultiStepsState(NamedTuple):
    """State of :func:`MultiSteps` (optax's ``MultiStepsState``, plus the window's finite flag)."""

    mini_step: torch.Tensor  # 0-d int32: micro-batches accumulated in the open window
    gradient_step: torch.Tensor  # 0-d int32: windows applied so far
    inner_opt_state: Any  # the wrapped transform's state
    acc_grads: PyTree  # float32, shaped like the parameters: the sum of the window's gradients
    acc_finite: torch.Tensor  # 0-d bool: whether every gradient in acc_grads was finite


class MultiStepsSpec(NamedTuple):
    """Declared form of :func:`MultiSteps`; what ``fp16_update`` reads to accumulate."""

    inner: GradientTransformation  # the wrapped transform
    every_k_schedule: EveryK  # an int >= 1, or a function of gradient_step
    use_grad_mean: bool  # hand the inner transform the mean (True) or the sum


def _check_every_k(every_k_schedule: Any) -> EveryK:
    if callable(every_k_schedule):
        return every_k_schedule
    if isinstance(every_k_schedule, bool) or not isinstance(every_k_schedule, int):
        raise TypeError(
            "every_k_schedule must be an int >= 1 or a function of the gradient step, "
            f"got {type(every_k_schedule).__name__}"
        )
    return validate.integer("every_k_schedule", every_k_schedule, 1, int32=True)


def window_size(every_k_schedule: EveryK, gradient_step: torch.Tensor) -> torch.Tensor:
    """``k`` for the window that ``gradient_step`` opens, as a 0-d int32 tensor on its device.

    An int is used as it is. A schedule is called with ``gradient_step``; an
    int result is checked (``>= 1``), a 0-d tensor result is rounded to the
    nearest integer and clamped to ``[1, 2**31 - 1]`` on the device (checking
    it would read it on the host).
    """
    k = every_k_schedule(gradient_step) if callable(every_k_schedule) else every_k_schedule
    device = gradient_step.device
    if isinstance(k, torch.Tensor):
        if k.ndim != 0 or k.dtype == torch.bool or k.is_complex():
            raise TypeError(
                "every_k_schedule(gradient_step) must return an int or a 0-d real tensor, "
                f"got {describe_tensor(k)}"
            )
        k = k.to(device)
        if k.is_floating_point():
            k = torch.nan_to_num(k.double().round(), nan=1.0)
        return torch.clamp(k, min=1, max=_INT32_MAX).to(torch.int32)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(
            "every_k_schedule(gradient_step) must return an int or a 0-d real tensor, "
            f"got {type(k).__name__}"
        )
    k = validate.integer("every_k_schedule(gradient_step)", k, 1, int32=True)
    return torch.full((), k, dtype=torch.int32, device=device)


def window_closes(state: MultiStepsState, k: torch.Tensor) -> torch.Tensor:
    """Whether this call is the window's last micro-batch."""
    return state.mini_step + 1 >= k


def next_counters(state: MultiStepsState, emit: torch.Tensor, applied: torch.Tensor):
    """``(mini_step, gradient_step)`` after this call."""
    mini_step = torch.where(emit, torch.zeros_like(state.mini_step), state.mini_step + 1)
    bumped = saturating_increment(state.gradient_step)
    return mini_step, torch.where(applied, bumped, state.gradient_step)


def hand_over(acc: list[torch.Tensor], k: torch.Tensor, mean: bool) -> list[torch.Tensor]:
    """What the inner transform sees: ``acc / k`` (fresh tensors) or the sum itself."""
    if not mean:
        return acc
    return torch._foreach_div(acc, k.to(torch.float32))


def empty_unless(
    emit: torch.Tensor, acc: list[torch.Tensor], in_place: bool = False
) -> list[torch.Tensor]:
    """The accumulator after this call: +0.0 where the window closed, else ``acc`` (bit for
    bit, inf and NaN kept); multi-tensor ops outside ``vmap``. ``in_place``: ``acc`` is
    the caller's own and may be written (no second buffer where the multi-tensor form
    runs)."""
    return zero_where(emit, acc, in_place=in_place)


def MultiSteps(  # optax's name (a class there), kept for its users
    opt: GradientTransformation,
    every_k_schedule: EveryK,
    *,
    use_grad_mean: bool = True,
) -> GradientTransformation:
    r"""Accumulates gradients over ``k`` calls and applies ``opt`` once per ``k`` (optax's ``MultiSteps``).

    With :math:`a` the FP32 sum of the window's gradients and :math:`k` the
    window size:

    .. math::
        a_i = a_{i-1} + \operatorname{fl}_{32}(g_i), \qquad
        u_i = \begin{cases} \text{opt.update}(a_k / k) & i = k \\ 0 & i < k\end{cases}

    and the accumulator starts again from zero. Inside
    :func:`~functional_fp16.fp16_update` the gradients are unscaled first, a
    window with any overflow is skipped as a whole and the loss scale moves
    once per window; see :mod:`functional_fp16.transforms.accumulation` for the rules.

    Args:
      opt: the optimiser to apply once per window.
      every_k_schedule: micro-batches per window: an int ``>= 1``, or a
        function of ``gradient_step`` (0-d int32, the number of applied
        windows) returning an int or a 0-d tensor.
      use_grad_mean: hand ``opt`` the mean of the window's gradients (the
        default, as optax) or, with ``False``, their sum.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`MultiStepsState` and spec :class:`MultiStepsSpec`.
    """
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"opt must be a GradientTransformation, got {type(opt).__name__}")
    every_k = _check_every_k(every_k_schedule)
    if not isinstance(use_grad_mean, bool):
        raise TypeError(f"use_grad_mean must be a bool, got {type(use_grad_mean).__name__}")

    def init(params: PyTree) -> MultiStepsState:
        leaves, spec = tree_flatten(params)
        device = leaves[0].device if leaves else None
        zero = torch.zeros((), dtype=torch.int32, device=device)
        acc = [torch.zeros_like(p, dtype=torch.float32) for p in leaves]
        return MultiStepsState(
            mini_step=zero,
            gradient_step=zero.clone(),
            inner_opt_state=opt.init(params),
            acc_grads=tree_unflatten(spec, acc),
            acc_finite=torch.ones((), dtype=torch.bool, device=device),
        )

    def update(updates: PyTree, state: MultiStepsState, params: PyTree | None = None, **extra_args):
        check_multi_steps_state(state)
        g_leaves = check_like(
            state.acc_grads,
            updates,
            name="updates",
            reference_name="opt_state.acc_grads",
            check_dtype=False,
        )
        spec = tree_flatten(updates)[1]
        acc_leaves = tree_flatten(state.acc_grads)[0]
        if not g_leaves:
            return updates, state
        k = window_size(every_k, state.gradient_step)
        emit = window_closes(state, k)
        window_ok = state.acc_finite & grads_finite(g_leaves, None)
        acc = torch._foreach_add(acc_leaves, [g.float() for g in g_leaves])
        handed = [x.to(g.dtype) for x, g in zip(hand_over(acc, k, use_grad_mean), g_leaves)]
        inner_updates, inner_state = update_with_extra_args(
            opt, tree_unflatten(spec, handed), state.inner_opt_state, params, **extra_args
        )
        u_leaves, u_spec = tree_flatten(inner_updates)
        out = tree_unflatten(u_spec, [torch.where(emit, u, torch.zeros_like(u)) for u in u_leaves])
        mini_step, gradient_step = next_counters(state, emit, emit)
        return out, MultiStepsState(
            mini_step=mini_step,
            gradient_step=gradient_step,
            inner_opt_state=tree_select(emit, inner_state, state.inner_opt_state),
            acc_grads=tree_unflatten(tree_flatten(state.acc_grads)[1], empty_unless(emit, acc)),
            acc_finite=emit | window_ok,
        )

    return GradientTransformation(init, update, MultiStepsSpec(opt, every_k, use_grad_mean))


def check_multi_steps_state(state: Any) -> None:
    if not isinstance(state, MultiStepsState):
        raise TypeError(
            f"the optimiser state of MultiSteps must be a MultiStepsState, got {type(state).__name__}"
        )
