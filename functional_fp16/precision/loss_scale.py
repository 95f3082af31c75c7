"""Loss scaling: static configuration plus a few 0-d tensors of state.

A loss scale multiplies the loss before differentiation so that small FP16
gradients do not flush to zero, and divides the gradients afterwards. Each loss
scale here is an immutable pytree: its tensors (the scale, a 0-d float32, and
int32 counters) are leaves, its configuration is static metadata that survives
``optree`` flattening, ``torch.compile`` and checkpoints unchanged. Every method
returns new tensors; nothing is modified in place and nothing reads a tensor's
value on the host.

Three kinds exist:

* :class:`DynamicLossScale` — grows after a run of finite steps, backs off on
  overflow (the rule of ``torch.amp.GradScaler``, ``jmp.DynamicLossScale`` and,
  with ``hysteresis``, Megatron-LM).
* :class:`StaticLossScale` — a fixed scale.
* :class:`NoOpLossScale` — a scale of one (for BF16 or FP32 training).
"""

from __future__ import annotations

import collections
import math
from typing import Any

import optree
import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import (
    NAMESPACE,
    PyTree,
    check_like,
    describe_tensor,
    register_node,
    tree_map,
    tree_select,
)

__all__ = [
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScale",
    "all_finite",
    "select_tree",
    "unscale_factor",
    "unscale_inverse",
    "loss_scale_for",
]


def all_finite(tree: PyTree) -> torch.Tensor:
    """Whether every element of every tensor in ``tree`` is finite.

    Returns a 0-d bool tensor (``True`` for an empty tree) on the device of the
    first leaf. No host synchronisation.
    """
    leaves = [x for x in optree.tree_leaves(tree, namespace=NAMESPACE)]
    if not leaves:
        return torch.tensor(True)
    flags = [torch.isfinite(x).all() for x in leaves]
    return torch.stack(flags).all()


def select_tree(pred: torch.Tensor, a: PyTree, b: PyTree) -> PyTree:
    r"""``a`` where ``pred`` is true, ``b`` otherwise, leaf by leaf (``jmp.select_tree``).

    .. math:: x_i = \operatorname{where}(\text{pred}, a_i, b_i)

    Each leaf is taken bitwise from one side, on the device, without reading
    ``pred`` on the host. :func:`~functional_fp16.fp16_update` makes this
    selection itself; this is for loops written with the transforms alone.

    Args:
      pred: a 0-d bool tensor, e.g. from :func:`all_finite`.
      a, b: trees of the same structure whose leaves agree in shape, dtype
        and device (nothing is broadcast or promoted; the error names the
        path of the first leaf that differs).

    Returns:
      A new tree of that structure.
    """
    if not isinstance(pred, torch.Tensor) or pred.ndim != 0 or pred.dtype != torch.bool:
        shown = describe_tensor(pred) if isinstance(pred, torch.Tensor) else type(pred).__name__
        raise TypeError(f"pred must be a 0-d bool tensor, got {shown}")
    check_like(a, b, name="b", reference_name="a")
    return tree_select(pred, a, b)


def unscale_factor(loss_scale: torch.Tensor) -> torch.Tensor:
    r"""The float32 reciprocal of ``loss_scale``, computed in float64.

    .. math:: s^{-1} = \operatorname{fl}_{32}(1 / \operatorname{fl}_{64}(s))

    This is what ``torch.amp.GradScaler`` multiplies by when it unscales, so
    unscaled gradients are bitwise equal to its own.
    """
    return loss_scale.double().reciprocal().float()


def _scale_leaf(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # The product takes the promoted dtype of the leaf and the float32 scale,
    # as in jmp (JAX promotes against the scale's array): FP16/BF16 losses
    # become float32, so the product cannot overflow in FP16 (2**16 alone is
    # already inf there), and integer leaves are not truncated to integers.
    dtype = torch.promote_types(x.dtype, torch.float32)
    return x.to(dtype) * scale.to(dtype)


def _check_positive_finite(name: str, value: float) -> float:
    return validate.real(name, value, positive=True)


_TINY32 = torch.finfo(torch.float32).tiny


def _check_scale_floor(name: str, value: float) -> float:
    # Below float32's smallest normal number the scale rounds to zero or loses
    # precision, and 1/scale overflows: every step would overflow forever.
    if value < _TINY32:
        raise ValueError(
            f"{name} ({value}) must be >= {_TINY32} (the smallest normal float32) so that "
            "the scale and its reciprocal are finite and non-zero in float32"
        )
    return value


def _check_int(name: str, value: int, minimum: int) -> int:
    return validate.integer(name, value, minimum, int32=True)


class _LossScaleBase:
    """Pytree plumbing and the scaling rule shared by the loss scales.

    A subclass names its tensor leaves in ``TENSOR_FIELDS`` (0-d tensors of the
    dtypes in ``TENSOR_DTYPES``) and its static configuration in
    ``CONFIG_FIELDS``; flattening, rebuilding, device moves, checkpoints and
    the update's state check all derive from these tuples. :meth:`scale` and
    :meth:`unscale` use the ``loss_scale`` leaf; a subclass supplies ``adjust``.
    """

    __slots__ = ("_inverse",)  # (the scale tensor, its unscale factor): see remember_inverse
    TENSOR_FIELDS: tuple[str, ...] = ()
    TENSOR_DTYPES: tuple[torch.dtype, ...] = ()
    CONFIG_FIELDS: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._Config = collections.namedtuple(f"{cls.__name__}Config", cls.CONFIG_FIELDS)

    def config(self) -> tuple[Any, ...]:
        """The static configuration: a hashable NamedTuple of the ``CONFIG_FIELDS``.

        It is the pytree metadata of the loss scale, so a checkpoint stores it
        by field name and names the field that differs from a template.
        """
        return self._Config(*(getattr(self, n) for n in self.CONFIG_FIELDS))

    @classmethod
    def _from_parts(cls, config: tuple[Any, ...], tensors: Any) -> Any:
        obj = object.__new__(cls)
        for name, value in zip(cls.CONFIG_FIELDS, config, strict=True):
            setattr(obj, name, value)
        for name, value in zip(cls.TENSOR_FIELDS, tensors, strict=True):
            setattr(obj, name, value)
        return obj

    def _replace(self, **tensors: torch.Tensor) -> Any:
        values = tuple(tensors.get(n, getattr(self, n)) for n in self.TENSOR_FIELDS)
        return self._from_parts(self.config(), values)

    def replace(self, **changes: Any) -> Any:
        """A copy with the given fields changed; the original is untouched.

        Tensor fields (``TENSOR_FIELDS``: the scale, the counters) take a
        number or a 0-d tensor, converted to the field's dtype on its device;
        configuration fields (``CONFIG_FIELDS``) are checked as the constructor
        checks them. For example ``scale.replace(loss_scale=2.0**10,
        growth_count=0)`` carries a ``GradScaler``'s state over.
        """
        unknown = set(changes) - set(self.TENSOR_FIELDS) - set(self.CONFIG_FIELDS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} has no field(s) {sorted(unknown)}; fields: "
                f"{list(self.TENSOR_FIELDS + self.CONFIG_FIELDS)}"
            )
        config = dict(zip(self.CONFIG_FIELDS, self.config()))
        config.update({k: v for k, v in changes.items() if k in self.CONFIG_FIELDS})
        if config != dict(zip(self.CONFIG_FIELDS, self.config())):
            # The constructor validates the configuration; its tensors are discarded.
            checked = type(self)(**config, init_scale=float(self.loss_scale.float()))
            config = dict(zip(self.CONFIG_FIELDS, checked.config()))
        tensors = []
        for name in self.TENSOR_FIELDS:
            old = getattr(self, name)
            value = changes.get(name, old)
            if not isinstance(value, torch.Tensor):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"{name} must be a number or a 0-d tensor, got {value!r}")
                value = torch.full((), value, dtype=old.dtype, device=old.device)
            if value.ndim != 0 or value.dtype != old.dtype:
                raise TypeError(
                    f"{name} must be a 0-d {old.dtype} tensor, got {describe_tensor(value)}"
                )
            tensors.append(value)
        return self._from_parts(tuple(config[n] for n in self.CONFIG_FIELDS), tensors)

    def to(self, device: torch.device | str) -> Any:
        """A copy whose tensors live on ``device``."""
        return self._replace(**{n: getattr(self, n).to(device) for n in self.TENSOR_FIELDS})

    # -- scaling by s = self.loss_scale (NoOpLossScale overrides both) --
    def scale(self, tree: PyTree) -> PyTree:
        r"""Multiplies every leaf by the scale: :math:`x \cdot s`.

        The product has the dtype that the leaf's and float32 promote to (as
        in jmp): FP16, BF16, integer and bool leaves give float32, so the
        result cannot overflow merely because the scale exceeds the FP16
        range; float64 stays float64.
        """
        return tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: PyTree) -> PyTree:
        r"""Returns the float32 tree :math:`\operatorname{fl}_{32}(g) \cdot s^{-1}`.

        See :func:`unscale_factor` for how :math:`s^{-1}` is rounded.
        """
        inv = unscale_factor(self.loss_scale)
        return tree_map(lambda g: g.float() * inv, tree)


class DynamicLossScale(_LossScaleBase):
    r"""Dynamic loss scale with optional Megatron-LM hysteresis.

    State (tensor leaves): ``loss_scale`` (0-d float32), ``growth_count`` (0-d
    int32, consecutive finite steps since the last change) and
    ``hysteresis_count`` (0-d int32, overflows still tolerated before a backoff).
    Configuration (static): the constructor's other arguments.

    :meth:`adjust` with a finite flag :math:`f` and scale :math:`s`:

    * finite (:math:`f`): ``growth_count += 1``; when it reaches
      ``growth_interval``, :math:`s \leftarrow \min(s\,\gamma, s_{max})` unless
      that product is not finite, ``growth_count`` returns to 0 and
      ``hysteresis_count`` refills to ``hysteresis``;
    * non-finite: ``growth_count`` returns to 0 and ``hysteresis_count`` drops
      by one (never below 0); once it is 0,
      :math:`s \leftarrow \max(s\,\beta, s_{min})`.

    So growth happens on the ``growth_interval``-th consecutive finite step,
    the cadence of ``torch.amp.GradScaler`` and ``jmp.DynamicLossScale``. With
    ``hysteresis=1`` (the default) every overflow backs off. With ``h > 1`` the
    first ``h - 1`` overflows after a growth (or after the start) keep the scale;
    the hysteresis counter refills only when a growth interval completes (the
    scale grows then, unless it already sits at ``max_scale``), as in
    Megatron-LM's ``DynamicGradScaler``, so after ``h`` overflows every further
    overflow backs off until the next growth. The overflowed steps themselves
    are always skipped by :func:`~functional_fp16.fp16_update`.

    The scale lives in float32: products are rounded once to float32 and the
    bounds apply as ``min_scale`` and ``max_scale`` rounded to float32 (the
    same numbers for powers of two).

    Args:
      init_scale: starting scale, in ``[min_scale, max_scale]``.
      growth_factor: :math:`\gamma > 1`.
      backoff_factor: :math:`\beta \in (0, 1)`.
      growth_interval: finite steps per growth, ``>= 1``.
      min_scale: :math:`s_{min} > 0`, the floor of backoff.
      max_scale: :math:`s_{max} \ge s_{min}`, the ceiling of growth (may be inf;
        the scale still never becomes inf).
      hysteresis: overflows tolerated before backing off, ``>= 1``.
    """

    TENSOR_FIELDS = ("loss_scale", "growth_count", "hysteresis_count")
    TENSOR_DTYPES = (torch.float32, torch.int32, torch.int32)
    CONFIG_FIELDS = (
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "min_scale",
        "max_scale",
        "hysteresis",
    )
    __slots__ = TENSOR_FIELDS + CONFIG_FIELDS

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
    ) -> None:
        growth_factor = _check_positive_finite("growth_factor", growth_factor)
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        backoff_factor = _check_positive_finite("backoff_factor", backoff_factor)
        if backoff_factor >= 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        growth_interval = _check_int("growth_interval", growth_interval, 1)
        hysteresis = _check_int("hysteresis", hysteresis, 1)
        min_scale = _check_scale_floor("min_scale", _check_positive_finite("min_scale", min_scale))
        if isinstance(max_scale, bool) or not isinstance(max_scale, (int, float)):
            raise TypeError(f"max_scale must be a real number, got {type(max_scale).__name__}")
        max_scale = float(max_scale)
        if math.isnan(max_scale):
            raise ValueError("max_scale must be a number > 0 or inf, got nan")
        if max_scale < min_scale:
            raise ValueError(f"min_scale ({min_scale}) must be <= max_scale ({max_scale})")
        init_scale = _check_positive_finite("init_scale", init_scale)
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale ({init_scale}) must lie in [min_scale, max_scale] = "
                f"[{min_scale}, {max_scale}]"
            )
        if not math.isfinite(float(torch.tensor(init_scale, dtype=torch.float32))):
            raise ValueError(f"init_scale ({init_scale}) overflows float32")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis
        self.loss_scale = torch.tensor(init_scale, dtype=torch.float32)
        self.growth_count = torch.tensor(0, dtype=torch.int32)
        self.hysteresis_count = torch.tensor(hysteresis, dtype=torch.int32)

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(loss_scale={self.loss_scale!r}, growth_count={self.growth_count!r}, "
            f"hysteresis_count={self.hysteresis_count!r}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"min_scale={self.min_scale}, max_scale={self.max_scale}, hysteresis={self.hysteresis})"
        )

    def adjust(self, grads_finite: torch.Tensor) -> DynamicLossScale:
        r"""The next loss scale given whether this step's gradients were finite.

        With ``n = growth_count + 1`` and ``h = max(hysteresis_count - 1, 0)``:

        * finite: at ``n >= growth_interval`` the scale becomes
          :math:`\min(s\,g, s_{max})` (kept if that overflows float32), the
          count 0 and the hysteresis count reset; else the count is ``n``;
        * not finite: the count is 0, the hysteresis count ``h``, and at
          ``h <= 0`` the scale becomes :math:`\max(s\,b, s_{min})`.

        The products are rounded once to float32 from their exact values, as
        ``torch._amp_update_scale_`` does, so odd factors agree with it bitwise;
        for factors that are powers of two (the defaults) the float32 product is
        already exact and is formed directly.
        """
        return self.adjusted_by(_as_flag(grads_finite, self.loss_scale.device))

    def adjusted_by(self, finite: torch.Tensor) -> DynamicLossScale:
        """:meth:`adjust` without its checks, elementwise: ``finite`` a bool tensor of the
        fields' shape (every member's flag under ``vmap``'s rule for the bookkeeping op)."""
        scale = self.loss_scale

        # Finite branch.
        count = self.growth_count + 1
        grow = count >= self.growth_interval
        grown = _times(scale, self.growth_factor)
        if self.max_scale >= _F32_OVERFLOW:  # no float32 bound: an overflow keeps the scale
            grown = torch.where(torch.isfinite(grown), grown, scale)
        else:  # rounding is monotonic: fl32(min(p, s_max)) = min(fl32(p), fl32(s_max))
            grown = torch.clamp(grown, max=min(self.max_scale, _F32_MAX))
        scale_if_finite = torch.where(grow, grown, scale)
        count_if_finite = torch.where(grow, 0, count)
        hyst_if_finite = torch.where(grow, self.hysteresis, self.hysteresis_count)

        # Non-finite branch.
        hyst_if_overflow = torch.clamp(self.hysteresis_count - 1, min=0)
        backed_off = torch.clamp(_times(scale, self.backoff_factor), min=self.min_scale)
        scale_if_overflow = torch.where(hyst_if_overflow <= 0, backed_off, scale)

        return self._replace(
            loss_scale=torch.where(finite, scale_if_finite, scale_if_overflow),
            growth_count=torch.where(finite, count_if_finite, 0),
            hysteresis_count=torch.where(finite, hyst_if_finite, hyst_if_overflow),
        )


_F32_MAX = (2.0 - 2.0**-23) * 2.0**127
"""The largest float32."""
_F32_OVERFLOW = (2.0 - 2.0**-24) * 2.0**127
"""The smallest number that rounds to inf in float32 (half an ulp above the largest)."""


def _times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """``fl32(scale * factor)`` from the exact product: in float32 directly when ``factor``
    is a power of two (the product is then exact, or overflows to inf as the rounded one
    does; a subnormal result lies below every allowed ``min_scale``), else via float64."""
    if math.frexp(factor)[0] == 0.5:
        return scale * factor
    return (scale.double() * factor).float()


class StaticLossScale(_LossScaleBase):
    r"""A fixed loss scale :math:`s`; :meth:`adjust` returns it unchanged.

    Args:
      scale: the scale, finite and > 0.
    """

    TENSOR_FIELDS = ("loss_scale",)
    TENSOR_DTYPES = (torch.float32,)
    __slots__ = TENSOR_FIELDS

    def __init__(self, scale: float) -> None:
        scale = _check_scale_floor("scale", _check_positive_finite("scale", scale))
        self.loss_scale = torch.tensor(scale, dtype=torch.float32)
        if not torch.isfinite(self.loss_scale):
            raise ValueError(f"scale ({scale}) overflows float32")

    def __repr__(self) -> str:
        return f"StaticLossScale(loss_scale={self.loss_scale!r})"

    def adjust(self, grads_finite: torch.Tensor) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        _as_flag(grads_finite, self.loss_scale.device)
        return self


class NoOpLossScale(_LossScaleBase):
    """A loss scale of one: :meth:`scale` is the identity, :meth:`unscale` casts to float32.

    ``unscale`` returns float32 gradients, as the other loss scales' ``unscale``
    does: :func:`~functional_fp16.fp16_update` unscales the working-dtype
    (e.g. BF16) gradients into the FP32 updates of the master through it. A
    tree whose leaves are all float32 already comes back as it is, as from
    ``jmp.NoOpLossScale``.
    """

    TENSOR_FIELDS = ("loss_scale",)
    TENSOR_DTYPES = (torch.float32,)
    __slots__ = TENSOR_FIELDS

    def __init__(self) -> None:
        self.loss_scale = torch.tensor(1.0, dtype=torch.float32)

    def __repr__(self) -> str:
        return "NoOpLossScale()"

    def scale(self, tree: PyTree) -> PyTree:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: PyTree) -> PyTree:
        """Casts every leaf to float32; values are unchanged (``tree`` itself if already float32)."""
        if all(g.dtype == torch.float32 for g in optree.tree_leaves(tree, namespace=NAMESPACE)):
            return tree
        return tree_map(lambda g: g.float(), tree)

    def adjust(self, grads_finite: torch.Tensor) -> NoOpLossScale:
        """Returns ``self``."""
        _as_flag(grads_finite, self.loss_scale.device)
        return self


LossScale = DynamicLossScale | StaticLossScale | NoOpLossScale
"""Any of the three loss scales, the type of ``FP16State.loss_scale``."""


def _as_flag(grads_finite: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(grads_finite, torch.Tensor):
        raise TypeError(
            f"grads_finite must be a 0-d bool tensor, got {type(grads_finite).__name__}"
        )
    if grads_finite.ndim != 0 or grads_finite.dtype != torch.bool:
        raise ValueError(
            f"grads_finite must be a 0-d bool tensor, got {grads_finite.dtype} of shape "
            f"{tuple(grads_finite.shape)}"
        )
    if grads_finite.device != device:
        raise ValueError(
            f"grads_finite is on {grads_finite.device} but the loss scale is on {device}"
        )
    return grads_finite


for _cls in (DynamicLossScale, StaticLossScale, NoOpLossScale):
    register_node(
        _cls,
        lambda obj: (tuple(getattr(obj, n) for n in obj.TENSOR_FIELDS), obj.config()),
        lambda config, children, _cls=_cls: _cls._from_parts(config, children),
        lambda obj: obj.TENSOR_FIELDS,
    )


def loss_scale_for(*dtypes: torch.dtype) -> LossScale:
    """A fresh :class:`DynamicLossScale` if any of ``dtypes`` is float16, else :class:`NoOpLossScale`.

    FP16 gradients underflow without scaling; bfloat16 has float32's exponent
    range and needs none. The one rule behind ``fp16_init``'s default and
    :func:`~functional_fp16.default_loss_scale`.
    """
    return DynamicLossScale() if torch.float16 in dtypes else NoOpLossScale()


def unscale_inverse(loss_scale: LossScale) -> torch.Tensor | None:
    r"""The factor :math:`\mathrm{inv} = \operatorname{fl}_{32}(1/\operatorname{fl}_{64}(s))`
    of the unscaled gradients :math:`\operatorname{fl}_{32}(g)\cdot\mathrm{inv}` for one of
    the library's loss scales; ``None`` for :class:`NoOpLossScale` (no product at all)."""
    if isinstance(loss_scale, NoOpLossScale):
        return None
    known = known_inverse(loss_scale)
    return unscale_factor(loss_scale.loss_scale) if known is None else known


def known_inverse(loss_scale: LossScale) -> torch.Tensor | None:
    """The inverse :func:`remember_inverse` kept for ``loss_scale`` while it stands for its
    scale (the same tensor, unwritten since), else ``None`` (it must be computed)."""
    scale = loss_scale.loss_scale
    if _eager(scale):
        known = getattr(loss_scale, "_inverse", None)
        if known is not None and known[0] is scale and known[1] == scale._version:
            return known[2]
    return None


def _eager(scale: torch.Tensor) -> bool:
    """Whether a kept inverse may stand for ``scale``'s: not in a ``torch.compile`` trace
    and not in a CUDA graph's capture, which would record the kept tensor instead of the
    scale's reciprocal (a replay after the scale changed would unscale by the old one)."""
    if torch.compiler.is_compiling():
        return False
    return not (scale.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def remember_inverse(loss_scale: LossScale, inverse: torch.Tensor) -> None:
    """Keeps ``inverse`` (``unscale_factor`` of ``loss_scale.loss_scale``, as the update's
    bookkeeping op computed it) with the loss scale, for :func:`unscale_inverse` to return
    while its scale tensor is the same object, unwritten since (its version counter): a
    value derived from the state, not state (a rebuilt or replaced loss scale, or one
    written in place, computes it)."""
    scale = loss_scale.loss_scale
    if _eager(scale):
        loss_scale._inverse = (scale, scale._version, inverse)
