"""Adam and AdamW as chains of small transforms, following ``torch.optim.Adam``/``AdamW``.

::

    adam(lr)      = chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))
    adamw(lr, wd) = chain(scale_by_adam(b1, b2, eps),
                          add_decayed_weights(wd, mask),   # u <- u + wd * p
                          scale_by_learning_rate(lr))      # u <- -lr * u

as optax composes them. ``torch.optim.Adam(weight_decay=wd)`` (L2 decay,
added to the gradient) is ``chain(add_decayed_weights(wd), adam(lr))``.

The moments are FP32 by default (``mu_dtype``/``nu_dtype`` store them in
fewer bytes, :mod:`~functional_fp16.precision.moment_storage`; the arithmetic
is float32 either way), and the step count is the number of *applied* steps:
inside :func:`~functional_fp16.fp16_update` a skipped step leaves the whole
state, count included, bitwise as it was, so the bias correction stays in
step with an uninterrupted run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import PyTree, check_same_structure, tree_flatten, tree_unflatten
from functional_fp16.precision.moment_storage import (
    DEFAULT_BLOCK,
    FLOAT32,
    MomentFormat,
    decode_all,
    encode_all,
    moment_format,
    zeros_like_moments,
)
from functional_fp16.transforms.base import GradientTransformation, chain, saturating_increment
from functional_fp16.transforms.schedules import Schedule
from functional_fp16.transforms.sgd import add_decayed_weights, scale_by_learning_rate

__all__ = ["ScaleByAdamState", "AdamSpec", "scale_by_adam", "adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`."""

    count: torch.Tensor  # 0-d int32: the number of updates produced (applied steps)
    mu: PyTree  # first moments shaped like the parameters: float32 (or as mu_dtype stores them)
    nu: PyTree  # second moments shaped like the parameters: float32 (or as nu_dtype stores them)


class AdamSpec(NamedTuple):
    """Declared form of :func:`scale_by_adam`."""

    b1: float
    b2: float
    eps: float
    eps_root: float
    mu_format: MomentFormat = FLOAT32
    nu_format: MomentFormat = FLOAT32


def bias_corrections(count: torch.Tensor, b1: float, b2: float):
    """``(1 / (1 - b1^t), sqrt(1 - b2^t))`` for ``t = count``, in float64, rounded once to float32.

    Computed on the count's device (no host read), in double precision as
    ``torch.optim.Adam`` computes them in Python.
    """
    t = count.to(torch.float64)
    one = torch.ones((), dtype=torch.float64, device=count.device)

    def power(b) -> torch.Tensor:  # b^t; a tensor b (an injected hyperparameter) as it is
        base = b.to(one) if isinstance(b, torch.Tensor) else torch.full_like(one, b)
        return torch.pow(base, t)

    c1 = one - power(b1)
    c2 = one - power(b2)
    return (one / c1).to(torch.float32), c2.sqrt().to(torch.float32)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float32 tensor.

    CUDA's ``sqrt`` is correctly rounded; torch's vectorised CPU ``sqrt`` is
    not always (about 1 result in 160 is one ulp off). There it goes through
    float64, whose root of a float32 value rounds to the correctly rounded
    float32 root. The fused kernels use the hardware's correctly rounded root,
    so every implementation agrees.
    """
    if x.device.type == "cuda":
        return x.sqrt()
    return x.double().sqrt().float()


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | str | None = None,
    nu_dtype: torch.dtype | str | None = None,
    nu_scale: str | float | None = None,
    block_size: int = DEFAULT_BLOCK,
    moment_rounding: str = "stochastic",
) -> GradientTransformation:
    r"""Rescales updates by Adam's bias-corrected moment estimates.

    With :math:`t` the number of this transform's previous updates plus one:

    .. math::
        m_t &= m_{t-1} + (1 - \beta_1)(g - m_{t-1})  \qquad (\text{torch's } \operatorname{lerp}) \\
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2)\, g^2 \\
        u &= \frac{m_t}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon}
             \cdot \frac{1}{1 - \beta_1^t}

    which is ``torch.optim.Adam``'s step without the learning rate (the square
    root correctly rounded, see :func:`sqrt_rn`); with
    ``eps_root > 0`` the denominator is optax's
    :math:`\sqrt{v_t / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon`. The bias
    corrections are computed in float64 on the device, as torch computes them
    in Python, and rounded once to float32.

    Args:
      b1: :math:`\beta_1 \in [0, 1)`, the first moment's decay.
      b2: :math:`\beta_2 \in [0, 1)`, the second moment's decay.
      eps: :math:`\epsilon \ge 0`, added to the denominator.
      eps_root: :math:`\epsilon_{root} \ge 0`, added inside the square root.
      mu_dtype: how the first moments are stored: ``None``/``torch.float32``
        (the default), ``torch.bfloat16``, ``torch.float16`` or ``"e4m3"`` (``"int8"``, an alias)
        (8-bit block codes); see :mod:`functional_fp16.precision.moment_storage`.
        The arithmetic is float32 whatever the storage: each step decodes,
        updates and encodes.
      nu_dtype: the same for the second moments; ``torch.float16`` needs ``nu_scale``.
      nu_scale: for ``nu_dtype=torch.float16``: ``"tensor"`` (a power of two
        chosen per tensor each step) or a fixed power of two :math:`s`. A fixed
        scale saturates: an element above :math:`65504\,s` is stored as
        :math:`65504\,s` (never inf, and no host check), under-estimating that
        element's moment; choose :math:`s \ge \max v / 65504`.
      block_size: elements per block of ``"e4m3"`` moments (a power of two).
      moment_rounding: how stored moments are rounded: ``"stochastic"`` (the
        default), up or down with the probabilities that make the stored moment's
        expectation its float32 value, from a hash of the value, the step count and
        the leaf (:mod:`functional_fp16.precision.stochastic_rounding`), so that a
        moving average whose change per step is under half a code step (``b2 =
        0.999``) still follows it (deterministic, resumable bitwise and the same
        under any sharding); or ``"nearest"``, which loses such changes (see
        ``docs/moments.md``). FP32 moments are never rounded.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`ScaleByAdamState` (moments as stored, whatever the updates' dtype).
    """
    for name, value in (("b1", b1), ("b2", b2)):
        checked = validate.real(name, value, tensor=True)
        if not isinstance(checked, torch.Tensor) and checked >= 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    b1, b2 = (validate.real(n, v, tensor=True) for n, v in (("b1", b1), ("b2", b2)))
    eps = validate.real("eps", eps, tensor=True)
    eps_root = validate.real("eps_root", eps_root, tensor=True)
    mu_format = moment_format(
        "mu_dtype", mu_dtype, second=False, block_size=block_size, rounding=moment_rounding
    )
    nu_format = moment_format(
        "nu_dtype", nu_dtype, second=True, scale=nu_scale, scale_name="nu_scale",
        block_size=block_size, rounding=moment_rounding,
    )  # fmt: skip

    def init(params: PyTree) -> ScaleByAdamState:
        leaves = tree_flatten(params)[0]
        device = leaves[0].device if leaves else None
        return ScaleByAdamState(
            count=torch.zeros((), dtype=torch.int32, device=device),
            mu=zeros_like_moments(mu_format, params),
            nu=zeros_like_moments(nu_format, params),
        )

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree | None = None):
        del params
        g_leaves, spec = tree_flatten(updates)
        stored_mu = check_same_structure(updates, state.mu, name="mu", reference_name="updates")
        stored_nu = check_same_structure(updates, state.nu, name="nu", reference_name="updates")
        count = saturating_increment(state.count)
        if not g_leaves:
            return updates, ScaleByAdamState(count, state.mu, state.nu)
        mu, nu = decode_all(mu_format, stored_mu), decode_all(nu_format, stored_nu)
        g32 = [g.to(torch.float32) for g in g_leaves]
        new_mu = [torch.lerp(m, g, 1.0 - b1) for m, g in zip(mu, g32)]
        if isinstance(b2, torch.Tensor):  # fma(c2 * g, g, v * b2), as addcmul's value= form
            new_nu = [torch.addcmul(v * b2, g * (1.0 - b2), g) for v, g in zip(nu, g32)]
        else:
            new_nu = [torch.addcmul(v * b2, g, g, value=1.0 - b2) for v, g in zip(nu, g32)]
        inv_c1, sqrt_c2 = bias_corrections(count, b1, b2)
        if validate.is_zero(eps_root):
            out = [m / (sqrt_rn(v) / sqrt_c2 + eps) * inv_c1 for m, v in zip(new_mu, new_nu)]
        else:
            c2 = sqrt_c2.double().square().float()
            out = [m * inv_c1 / (sqrt_rn(v / c2 + eps_root) + eps) for m, v in zip(new_mu, new_nu)]
        out = [u.to(g.dtype) for u, g in zip(out, g_leaves)]
        new_mu = encode_all(mu_format, new_mu, stored_mu, count, stream=0)
        new_nu = encode_all(nu_format, new_nu, stored_nu, count, stream=1)
        new_state = ScaleByAdamState(
            count, tree_unflatten(spec, new_mu), tree_unflatten(spec, new_nu)
        )
        return tree_unflatten(spec, out), new_state

    spec = AdamSpec(b1, b2, eps, eps_root, mu_format, nu_format)
    return GradientTransformation(init, update, spec)


def adam(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | str | None = None,
    nu_dtype: torch.dtype | str | None = None,
    nu_scale: str | float | None = None,
    block_size: int = DEFAULT_BLOCK,
    moment_rounding: str = "stochastic",
) -> GradientTransformation:
    r"""Adam (Kingma & Ba, 2015) with ``torch.optim.Adam``'s arithmetic.

    .. math:: \theta \leftarrow \theta - \eta\, \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}

    Args:
      learning_rate: :math:`\eta`, a float >= 0 or a schedule of the applied-step count.
      b1, b2, eps, eps_root: see :func:`scale_by_adam`.
      mu_dtype, nu_dtype, nu_scale, block_size, moment_rounding: how the moments are
        stored; see
        :func:`scale_by_adam`.

    Returns:
      ``chain(scale_by_adam(b1, b2, eps, eps_root=eps_root, ...), scale_by_learning_rate(lr))``.
    """
    moments = scale_by_adam(
        b1, b2, eps, eps_root=eps_root, mu_dtype=mu_dtype, nu_dtype=nu_dtype,
        nu_scale=nu_scale, block_size=block_size, moment_rounding=moment_rounding,
    )  # fmt: skip
    return chain(moments, scale_by_learning_rate(learning_rate))


def adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    mask=None,
    mu_dtype: torch.dtype | str | None = None,
    nu_dtype: torch.dtype | str | None = None,
    nu_scale: str | float | None = None,
    block_size: int = DEFAULT_BLOCK,
    moment_rounding: str = "stochastic",
) -> GradientTransformation:
    r"""AdamW (Loshchilov & Hutter, 2019): Adam with decoupled weight decay.

    .. math::
        \theta \leftarrow \theta - \eta\,\Big(\frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}
        + \lambda\, \theta\Big)

    ``torch.optim.AdamW`` writes the decay as :math:`\theta (1 - \eta\lambda)`;
    the two agree to rounding.

    Args:
      learning_rate: :math:`\eta`, a float >= 0 or a schedule of the applied-step count.
      b1, b2, eps: see :func:`scale_by_adam`.
      weight_decay: :math:`\lambda \ge 0` (optax's default, 1e-4; torch's is 1e-2).
      mask: which leaves decay: a pytree of bools shaped like the parameters,
        or a function of the parameters returning one (as optax's ``mask``);
        ``None`` decays every leaf.
      mu_dtype, nu_dtype, nu_scale, block_size, moment_rounding: how the moments are
        stored; see
        :func:`scale_by_adam`.

    Returns:
      ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))``.
    """
    decay = (
        add_decayed_weights(weight_decay)
        if mask is None
        else add_decayed_weights(weight_decay, mask=mask)
    )
    moments = scale_by_adam(
        b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, nu_scale=nu_scale,
        block_size=block_size,
        moment_rounding=moment_rounding,
    )  # fmt: skip
    return chain(moments, decay, scale_by_learning_rate(learning_rate))
