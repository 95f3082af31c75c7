"""SGD with momentum as a chain of small transforms, following ``torch.optim.SGD``.

``sgd(lr, momentum, nesterov, dampening, weight_decay)`` is::

    chain(add_decayed_weights(weight_decay),   # g <- g + wd * p
          trace(momentum, nesterov, dampening), # b <- m b + (1 - d) g   (b_1 = g)
          scale_by_learning_rate(lr))           # u <- -lr * b

which is ``torch.optim.SGD``'s update rule written as composable pieces. The
three parts are always there (a coefficient of 0 makes a part pass its input
through), so the state has one layout whatever the settings. Each part
declares its hyperparameters as a ``spec`` (:class:`DecaySpec`,
:class:`TraceSpec`, :class:`LearningRateSpec`), from which
:func:`~functional_fp16.fp16_update` builds its fused kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.deprecation import keyword_only
from functional_fp16._util.tree import (
    PyTree,
    check_same_structure,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from functional_fp16.precision.moment_storage import (
    DEFAULT_BLOCK,
    FLOAT32,
    MomentFormat,
    decode,
    encode,
    moment_format,
    zeros_like_moments,
)
from functional_fp16.transforms.base import (
    EmptyState,
    GradientTransformation,
    chain,
    saturating_increment,
)
from functional_fp16.transforms.masking import Mask, masked
from functional_fp16.transforms.schedules import Schedule

__all__ = [
    "TraceState",
    "ScaleByScheduleState",
    "DecaySpec",
    "TraceSpec",
    "LearningRateSpec",
    "trace",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "sgd",
]


class TraceState(NamedTuple):
    """State of :func:`trace`."""

    trace: PyTree  # momentum buffers shaped like the params: their dtype, or accumulator_dtype
    initialized: torch.Tensor  # 0-d bool: whether any step has filled `trace` yet


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a schedule."""

    count: torch.Tensor  # 0-d int32: number of updates applied so far


class DecaySpec(NamedTuple):
    """Declared form of :func:`add_decayed_weights`: ``u + weight_decay * p``."""

    weight_decay: float


class TraceSpec(NamedTuple):
    """Declared form of :func:`trace` (``decay == 0``: the updates pass through)."""

    decay: float
    nesterov: bool
    dampening: float
    accumulator_format: MomentFormat = FLOAT32


class LearningRateSpec(NamedTuple):
    """Declared form of :func:`scale_by_learning_rate`: ``sign * lr * u``.

    ``learning_rate`` is a float, or a schedule of the applied-step count.
    """

    learning_rate: float | Schedule
    sign: float


def _check_hyper(name: str, value: float, *, upper: float | None = None) -> float:
    return validate.real(name, value, upper=upper, tensor=True)


def _nesterov_refused(momentum, dampening) -> bool:
    """Nesterov needs momentum > 0 and no dampening (tensor values are not read here)."""
    bad_momentum = not isinstance(momentum, torch.Tensor) and momentum <= 0.0
    return bad_momentum or not (isinstance(dampening, torch.Tensor) or dampening == 0.0)


def _add_scaled(a: torch.Tensor, b: torch.Tensor, c) -> torch.Tensor:
    """``a + c * b``: ``torch.add(a, b, alpha=c)``, or with a tensor ``c`` the same
    multiply-add as ``addcmul`` (both one fused multiply-add on the CPU)."""
    if isinstance(c, torch.Tensor):
        return torch.addcmul(a, b, c.to(a.dtype))
    return torch.add(a, b, alpha=c)


def _scalar(value, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):  # an injected hyperparameter
        return value.to(dtype=torch.float32, device=like.device)
    # A fill, not a host-to-device copy: stays capturable in CUDA graphs.
    return torch.full((), value, dtype=torch.float32, device=like.device)


@keyword_only("nesterov", "dampening")
def trace(
    decay: float,
    *,
    nesterov: bool = False,
    dampening: float = 0.0,
    accumulator_dtype: torch.dtype | str | None = None,
    block_size: int = DEFAULT_BLOCK,
) -> GradientTransformation:
    r"""Momentum, with ``torch.optim.SGD``'s first step and dampening.

    .. math::
        b_1 = g_1, \qquad b_t = \mu\, b_{t-1} + (1 - d)\, g_t \quad (t > 1)

    and the output is :math:`b_t`, or :math:`g_t + \mu\, b_t` with Nesterov.
    The first buffer is the gradient itself, undampened, as PyTorch creates
    it (bitwise, except that a gradient of -0.0 becomes +0.0);
    ``TraceState.initialized`` records whether that has happened, so a state
    whose first step was skipped has no momentum yet. With ``decay == 0`` the
    updates pass through unchanged and the (zero) buffers are kept untouched,
    so that the state's layout does not depend on the setting.

    Args:
      decay: momentum :math:`\mu \ge 0`.
      nesterov: use Nesterov momentum (needs ``decay > 0`` and ``dampening == 0``).
      dampening: :math:`d \in [0, 1]`.
      accumulator_dtype: how the buffers are stored (optax's name): ``None``
        (the updates' dtype, the default), ``torch.float32``, ``torch.bfloat16``,
        ``torch.float16`` or ``"e4m3"`` (8-bit block codes; ``"int8"`` is an alias); see
        :mod:`functional_fp16.precision.moment_storage`. The arithmetic is the
        updates' dtype whatever the storage.
      block_size: elements per block of an ``"e4m3"`` buffer (a power of two).
    """
    decay = _check_hyper("momentum", decay)
    stored = moment_format("accumulator_dtype", accumulator_dtype, second=False,
                           block_size=block_size)  # fmt: skip
    coded = accumulator_dtype is not None
    if coded and not isinstance(decay, torch.Tensor) and decay == 0.0:
        raise ValueError(
            f"accumulator_dtype={accumulator_dtype!r} needs momentum > 0: without momentum "
            "there is no buffer to store"
        )
    dampening = _check_hyper("dampening", dampening, upper=1.0)
    nesterov = validate.flag("nesterov", nesterov)
    if nesterov and _nesterov_refused(decay, dampening):
        raise ValueError("nesterov momentum requires momentum > 0 and dampening == 0")

    def init(params: PyTree) -> TraceState:
        leaves = tree_flatten(params)[0]
        device = leaves[0].device if leaves else None
        return TraceState(
            trace=zeros_like_moments(stored, params)
            if coded
            else tree_map(torch.zeros_like, params),
            initialized=torch.tensor(False, device=device),
        )

    def update(updates: PyTree, state: TraceState, params: PyTree | None = None):
        del params
        g_leaves, spec = tree_flatten(updates)
        b_leaves = check_same_structure(
            updates, state.trace, name="trace", reference_name="updates"
        )
        if not g_leaves or validate.is_zero(decay):
            return updates, state
        old_b = b_leaves
        if coded:
            b_leaves = [decode(stored, b).to(g.dtype) for b, g in zip(old_b, g_leaves)]
        like = g_leaves[0]
        started = state.initialized
        # On the first step the buffer (all zeros) is multiplied by 0 and the
        # gradient taken whole: b_1 = 0 * 0 + g = g, bitwise.
        # The float32 factors are 0-d tensors: each product is rounded to the
        # leaf's dtype (a no-op unless the leaf is itself 0-d and low-precision,
        # which type promotion would otherwise turn into float32).
        keep = torch.where(started, _scalar(decay, like), _scalar(0.0, like))
        if validate.is_zero(dampening):
            new_b = [torch.add((b * keep).to(b.dtype), g) for b, g in zip(b_leaves, g_leaves)]
        else:
            take = torch.where(started, _scalar(1.0 - dampening, like), _scalar(1.0, like))
            new_b = [
                (b * keep).to(b.dtype) + (g * take).to(g.dtype) for b, g in zip(b_leaves, g_leaves)
            ]
        if nesterov:
            out = [_add_scaled(g, b, decay) for g, b in zip(g_leaves, new_b)]
        else:
            out = new_b
        if coded:
            new_b = [encode(stored, b.float(), old) for b, old in zip(new_b, old_b)]
        new_state = TraceState(
            trace=tree_unflatten(spec, new_b), initialized=torch.ones_like(started)
        )
        return tree_unflatten(spec, out), new_state

    spec = TraceSpec(decay, bool(nesterov), dampening, stored)
    return GradientTransformation(init, update, spec)


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    r"""Multiplies updates by :math:`-\eta` (or :math:`+\eta` with ``flip_sign=False``).

    With a schedule, :math:`\eta_t = \text{schedule}(t)` where :math:`t` is the
    number of updates this transform has produced, kept as ``count`` in its
    state. (Inside :func:`~functional_fp16.fp16_update`, skipped steps roll the
    state back, so :math:`t` counts applied steps.)

    Args:
      learning_rate: a finite float >= 0, or a schedule ``step -> lr``.
      flip_sign: negate, so that the updates descend.
    """
    sign = -1.0 if validate.flag("flip_sign", flip_sign) else 1.0
    if callable(learning_rate):
        schedule = learning_rate

        def init(params: PyTree) -> ScaleByScheduleState:
            leaves = tree_flatten(params)[0]
            device = leaves[0].device if leaves else None
            return ScaleByScheduleState(count=torch.zeros((), dtype=torch.int32, device=device))

        def update(updates: PyTree, state: ScaleByScheduleState, params: PyTree | None = None):
            del params
            lr = schedule(state.count).to(torch.float32) * sign
            new = tree_map(lambda u: u * lr.to(u.dtype), updates)
            count = saturating_increment(state.count)
            return new, ScaleByScheduleState(count=count.to(torch.int32))

        return GradientTransformation(init, update, LearningRateSpec(schedule, sign))

    lr = _check_hyper("learning_rate", learning_rate)

    def init_const(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update_const(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        del params
        return tree_map(lambda u: u * (sign * lr), updates), state

    return GradientTransformation(init_const, update_const, LearningRateSpec(lr, sign))


def add_decayed_weights(weight_decay: float, mask: Mask | None = None) -> GradientTransformation:
    r"""Adds :math:`\lambda p` to the updates (L2 weight decay, ``torch.optim.SGD``'s form).

    .. math:: u_i \leftarrow u_i + \lambda\, p_i \qquad \text{for every leaf } i \text{ with } \text{mask}_i

    (every leaf without a mask; the others pass through unchanged). Inside
    :func:`~functional_fp16.fp16_update`, :math:`u` is the unscaled FP32
    gradient and :math:`p` the FP32 master. With :math:`\lambda = 0` the
    updates pass through unchanged (no ``+ 0 * p``, which would turn -0.0
    into +0.0).

    Args:
      weight_decay: :math:`\lambda \ge 0`.
      mask: which leaves decay, as optax's ``mask``: a tree of Python bools
        with the structure of the parameters (or a prefix of it), or a
        function of the parameters returning one; ``None`` decays every leaf.
        For example ``lambda p: tree_map(lambda x: x.ndim > 1, p)`` spares
        biases and norm scales, like a ``torch.optim`` parameter group with
        ``weight_decay=0``.

    Returns:
      Without a mask, a stateless transform declaring :class:`DecaySpec` (so
      that ``sgd`` and ``chain(add_decayed_weights(wd), sgd(...))`` run the
      fused kernel). With one, ``masked(add_decayed_weights(weight_decay),
      mask)``, state :class:`~functional_fp16.transforms.masking.MaskedState`, which
      declares no spec and runs the multi-tensor path: a kernel that decays
      every leaf never sees it.
    """
    wd = _check_hyper("weight_decay", weight_decay)

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        if validate.is_zero(wd):
            return updates, state
        if params is None:
            raise ValueError("add_decayed_weights needs params; pass params= to update")
        u_leaves, spec = tree_flatten(updates)
        p_leaves = check_same_structure(updates, params, name="params", reference_name="updates")
        out = [_add_scaled(u, p.to(u.dtype), wd) for u, p in zip(u_leaves, p_leaves)]
        return tree_unflatten(spec, out), state

    decay = GradientTransformation(init, update, DecaySpec(wd))
    return decay if mask is None else masked(decay, mask)


@keyword_only("nesterov", "dampening", "weight_decay")
def sgd(
    learning_rate: float | Schedule,
    momentum: float = 0.0,
    *,
    nesterov: bool = False,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    accumulator_dtype: torch.dtype | str | None = None,
    block_size: int = DEFAULT_BLOCK,
) -> GradientTransformation:
    r"""Stochastic gradient descent with ``torch.optim.SGD``'s semantics.

    .. math::
        g &\leftarrow g + \lambda p \\
        b_t &= \mu b_{t-1} + (1-d) g \quad (b_1 = g) \\
        u &= -\eta\,(g + \mu b_t \text{ if Nesterov else } b_t)

    Args:
      learning_rate: :math:`\eta`, a float >= 0 or a schedule.
      momentum: :math:`\mu \ge 0`; 0 disables the momentum buffer.
      nesterov: Nesterov momentum.
      dampening: :math:`d \in [0, 1]`.
      weight_decay: :math:`\lambda \ge 0`.
      accumulator_dtype, block_size: how the momentum buffers are stored; see
        :func:`trace`.

    Returns:
      ``chain(add_decayed_weights(weight_decay), trace(momentum, ...),
      scale_by_learning_rate(learning_rate))``. All three parts are present
      whatever the settings (a coefficient of 0 passes the updates through),
      so the state has one layout and a checkpoint stays loadable when
      momentum or weight decay is changed to or from 0.
    """
    if not callable(learning_rate):
        _check_hyper("learning_rate", learning_rate)
    momentum = _check_hyper("momentum", momentum)
    weight_decay = _check_hyper("weight_decay", weight_decay)
    dampening = _check_hyper("dampening", dampening, upper=1.0)
    nesterov = validate.flag("nesterov", nesterov)
    if nesterov and _nesterov_refused(momentum, dampening):
        raise ValueError("nesterov momentum requires momentum > 0 and dampening == 0")
    return chain(
        add_decayed_weights(weight_decay),
        trace(
            momentum,
            nesterov=nesterov,
            dampening=dampening,
            accumulator_dtype=accumulator_dtype,
            block_size=block_size,
        ),  # fmt: skip
        scale_by_learning_rate(learning_rate),
    )
