"""Mixed-precision policies: which dtype parameters, computation and outputs use.

A :class:`Policy` names three dtypes, as in jmp:

* ``param_dtype`` — the dtype the working copy of the parameters is stored in
  (the ``param_dtype`` of :func:`~functional_fp16.fp16_init`);
* ``compute_dtype`` — the dtype the forward and backward passes run in;
* ``output_dtype`` — the dtype the model's outputs are returned in (usually
  float32, so that the loss is computed in full precision).

A policy only casts; it keeps no state. Casting a pytree changes floating-point
tensor leaves only: integer and boolean tensors (labels, step counters) and
non-tensor leaves pass through untouched. Because casting is differentiable,
gradients flow back through a cast into the parameters' own dtype, so FP16
parameters computed in FP32 still receive FP16 gradients, which is why such a
policy still needs loss scaling (:func:`default_loss_scale`).

Policies are written as strings too (:func:`get_policy`); a key left out
follows jmp's rule (params default to float32, compute to params, output to
compute)::

    get_policy("params=float16,compute=float16,output=float32")
    get_policy("p=f16,c=bf16,o=f32")
    get_policy("p=f16")              # params, compute and output all float16
    get_policy("c=bf16")             # params float32, compute and output bfloat16
    get_policy("float32")            # one dtype for all three

Per-module policies (jmp's and Haiku's ``set_policy(module_class, policy)``)
are a declared mapping from module types to policies, given to
:func:`~functional_fp16.make_apply`. By default
(:func:`default_module_policies`) the normalisation layers in
:data:`NORM_MODULES` compute in float32 when the compute dtype is float16 or
bfloat16, as ``torch.autocast`` does, and hand their outputs back in the
compute dtype; their buffers (running statistics) stay float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from functional_fp16._util import deprecation
from functional_fp16._util.tree import PyTree, tree_map
from functional_fp16.precision.loss_scale import LossScale, loss_scale_for

__all__ = [
    "Policy",
    "get_policy",
    "parse_dtype",
    "cast_to",
    "default_loss_scale",
    "NORM_MODULES",
    "ModulePolicies",
    "norm_policy",
    "default_module_policies",
    "module_policy",
]

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "f16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "f32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "full": torch.float32,
    "single": torch.float32,
    "float64": torch.float64,
    "f64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}

_KEYS: dict[str, str] = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "o": "output_dtype",
}

# The names ``str(policy)`` writes: jmp's (``jmp.dtype_to_names``' first
# names), so that jmp's ``get_policy`` reads our strings and ours reads jmp's.
_SHORT_NAMES = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "full",
    torch.float64: "f64",
}


def _short_name(dtype: torch.dtype) -> str:
    return _SHORT_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The floating-point ``torch.dtype`` called ``name`` (``"f16"``, ``"bfloat16"``, ...).

    Args:
      name: one of ``float16/f16/fp16/half``, ``bfloat16/bf16``,
        ``float32/f32/fp32/float/full/single``, ``float64/f64/fp64/double``;
        case and surrounding spaces are ignored.

    Returns:
      The dtype.
    """
    if not isinstance(name, str):
        raise TypeError(f"dtype name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key.startswith("torch."):
        key = key[len("torch.") :]
    if key not in _DTYPE_NAMES:
        raise ValueError(
            f"unknown dtype name {name!r}; expected one of {', '.join(sorted(_DTYPE_NAMES))}"
        )
    return _DTYPE_NAMES[key]


def _check_dtype(field: str, dtype: Any) -> torch.dtype:
    if isinstance(dtype, str):
        return parse_dtype(dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{field} must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def cast_to(tree: PyTree, dtype: torch.dtype) -> PyTree:
    r"""Casts every floating-point tensor leaf of ``tree`` to ``dtype`` (tree first, as in jmp).

    .. math:: x \mapsto \operatorname{fl}_{dtype}(x) \text{ if } x \text{ is floating, else } x

    Leaves already in ``dtype`` are returned as they are (no copy); integer,
    boolean and complex tensors and non-tensor leaves are left alone. The cast
    is differentiable, so gradients come back in each leaf's original dtype.

    Args:
      tree: any pytree (``None`` is an empty subtree).
      dtype: the target floating-point dtype.

    Returns:
      A new tree of the same structure.

    The old order ``cast_to(dtype, tree)`` still works for one release, with a
    ``DeprecationWarning``.
    """
    if isinstance(tree, torch.dtype) and not isinstance(dtype, torch.dtype):
        deprecation.warn("cast_to(dtype, tree) is deprecated; call cast_to(tree, dtype)")
        tree, dtype = dtype, tree
    dtype = _check_dtype("dtype", dtype)

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of parameters, computation and outputs (see the module docstring).

    Immutable and hashable. Each field accepts a floating-point ``torch.dtype``
    or a dtype name (see :func:`parse_dtype`); names are converted on construction.
    """

    param_dtype: torch.dtype  # storage dtype of the working parameters (e.g. float16)
    compute_dtype: torch.dtype  # dtype of the forward/backward computation
    output_dtype: torch.dtype  # dtype of the model's outputs (e.g. float32)

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _check_dtype(field, getattr(self, field)))

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Casts the floating-point leaves of ``tree`` to ``param_dtype``."""
        return cast_to(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Casts the floating-point leaves of ``tree`` to ``compute_dtype``."""
        return cast_to(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Casts the floating-point leaves of ``tree`` to ``output_dtype``."""
        return cast_to(tree, self.output_dtype)

    def with_param_dtype(self, dtype: torch.dtype) -> Policy:
        """A copy with ``param_dtype`` replaced."""
        return dataclasses.replace(self, param_dtype=dtype)

    def with_compute_dtype(self, dtype: torch.dtype) -> Policy:
        """A copy with ``compute_dtype`` replaced."""
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_output_dtype(self, dtype: torch.dtype) -> Policy:
        """A copy with ``output_dtype`` replaced."""
        return dataclasses.replace(self, output_dtype=dtype)

    @property
    def uses_float16(self) -> bool:
        """Whether any of the three dtypes is float16 (so loss scaling is needed)."""
        return torch.float16 in (self.param_dtype, self.compute_dtype, self.output_dtype)

    def __str__(self) -> str:
        """jmp's string for the policy, e.g. ``p=f16,c=f16,o=full``.

        The dtype names are jmp's: ``f16``, ``bf16``, ``full`` (float32) and
        ``f64``. :func:`get_policy`, ours or jmp's, parses it back to this policy.
        """
        return (
            f"p={_short_name(self.param_dtype)},c={_short_name(self.compute_dtype)},"
            f"o={_short_name(self.output_dtype)}"
        )


def get_policy(spec: str) -> Policy:
    """Parses a policy string.

    Two forms are accepted:

    * one dtype name, used for all three dtypes: ``"float32"``, ``"bf16"``;
    * comma-separated ``key=dtype`` pairs with keys ``params``/``param``/``p``,
      ``compute``/``c`` and ``output``/``o``, e.g.
      ``"params=float16,compute=float16,output=float32"`` or ``"p=f16,c=bf16,o=f32"``.
      Keys left out are filled as jmp fills them: ``params`` defaults to
      ``float32``, ``compute`` to the params dtype and ``output`` to the
      compute dtype, so ``"p=f16"`` is all float16 and ``"c=f16"`` is float32
      params with float16 compute and output.

    Dtype names are those of :func:`parse_dtype`; keys and names are read
    regardless of case and spaces. Every string ``jmp.get_policy`` accepts
    is accepted and means the same (``half`` is float16, jmp's half dtype
    everywhere but on TPUs). ``str(policy)`` is jmp's string for the policy
    (``"p=f16,c=f16,o=full"``), which this function parses back to it.

    Args:
      spec: the policy string.

    Returns:
      The :class:`Policy`.
    """
    if not isinstance(spec, str):
        raise TypeError(f"policy must be a str, got {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise ValueError("policy string is empty; expected e.g. 'p=f16,c=f16,o=f32' or 'float32'")
    if "=" not in text and "," not in text:
        try:
            dtype = parse_dtype(text)
        except ValueError as err:
            raise ValueError(
                f"invalid policy {spec!r}: {err}; a policy is one dtype name or key=dtype "
                "pairs such as 'params=float16,compute=float16,output=float32'"
            ) from None
        return Policy(dtype, dtype, dtype)
    fields: dict[str, torch.dtype] = {}
    for part in text.split(","):
        part = part.strip()
        if part.count("=") != 1:
            raise ValueError(
                f"invalid policy {spec!r}: {part!r} is not of the form key=dtype "
                "(keys: params/p, compute/c, output/o)"
            )
        key, value = (s.strip() for s in part.split("="))
        field = _KEYS.get(key.lower())
        if field is None:
            raise ValueError(
                f"invalid policy {spec!r}: unknown key {key!r}; expected one of "
                "params (p), compute (c), output (o)"
            )
        if field in fields:
            raise ValueError(f"invalid policy {spec!r}: {field} is given more than once")
        try:
            fields[field] = parse_dtype(value)
        except ValueError as err:
            raise ValueError(f"invalid policy {spec!r}: {key}: {err}") from None
    param = fields.get("param_dtype", torch.float32)
    compute = fields.get("compute_dtype", param)
    return Policy(param, compute, fields.get("output_dtype", compute))


def default_loss_scale(policy: Policy) -> LossScale:
    """The loss scale a policy needs by default.

    A :class:`~functional_fp16.DynamicLossScale` (default configuration) when
    any of the policy's dtypes is float16, since FP16 gradients underflow
    without it; a :class:`~functional_fp16.NoOpLossScale` otherwise, since
    bfloat16 has float32's exponent range and needs no scaling.

    Args:
      policy: the precision policy.

    Returns:
      A fresh loss scale on the CPU (``fp16_init`` moves it to the parameters' device).
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
    return loss_scale_for(policy.param_dtype, policy.compute_dtype, policy.output_dtype)


# -- per-module policies -------------------------------------------------------------

NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d
    nn.GroupNorm,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
)
"""The module types :func:`default_module_policies` computes in float32.

``torch.autocast`` runs ``layer_norm``, ``group_norm`` and the norms in
float32; batch and instance norm keep float32 weights and running statistics
under autocast and accumulate in float32. Subclasses are covered too (the
lookup follows the method resolution order, see :func:`module_policy`).
"""

ModulePolicies = Mapping[type[nn.Module], Policy]
"""A mapping from module types to the :class:`Policy` their instances run under."""

_REDUCED_DTYPES = (torch.float16, torch.bfloat16)


def norm_policy(policy: Policy) -> Policy:
    r"""The policy a normalisation layer runs under inside a model computed with ``policy``.

    .. math::
        c_{norm} = \begin{cases} \text{float32} & c \in \{\text{float16}, \text{bfloat16}\} \\
        c & \text{otherwise} \end{cases}, \qquad o_{norm} = c

    The layer's inputs and parameters are cast to :math:`c_{norm}` and its
    outputs back to the model's compute dtype :math:`c`, so the next layer
    sees the dtype it expects. ``param_dtype`` is kept (it names the storage
    dtype, which the state fixes, not the layer).

    Args:
      policy: the model's policy.

    Returns:
      The policy for its norm layers, e.g. ``p=f16,c=full,o=bf16`` for
      ``p=f16,c=bf16,o=f32``.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
    compute = torch.float32 if policy.compute_dtype in _REDUCED_DTYPES else policy.compute_dtype
    return Policy(policy.param_dtype, compute, policy.compute_dtype)


def default_module_policies(policy: Policy) -> dict[type[nn.Module], Policy]:
    """The per-module policies :func:`~functional_fp16.make_apply` uses unless told otherwise.

    Every type in :data:`NORM_MODULES` runs under :func:`norm_policy` when
    the compute dtype is float16 or bfloat16; with a float32 or float64
    compute dtype there is nothing to override and the mapping is empty.

    Args:
      policy: the model's policy.

    Returns:
      A new ``dict`` from module types to policies (edit it freely, e.g. add
      ``nn.Softmax`` or remove ``nn.LayerNorm``).
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
    if policy.compute_dtype not in _REDUCED_DTYPES:
        return {}
    return dict.fromkeys(NORM_MODULES, norm_policy(policy))


def module_policy(module: nn.Module, module_policies: ModulePolicies) -> Policy | None:
    """The policy ``module`` runs under: that of the nearest of its classes in the mapping.

    Classes are looked up along ``type(module).__mro__``, so an entry for a
    base class (``_NormBase``) covers its subclasses (``BatchNorm2d``) and an
    entry for a subclass overrides its base's.

    Args:
      module: a module instance.
      module_policies: a mapping from module types to policies.

    Returns:
      The policy, or ``None`` when no class of ``module`` is in the mapping.
    """
    for cls in type(module).__mro__:
        if cls in module_policies:
            return module_policies[cls]
    return None


def check_module_policies(module_policies: Any) -> dict[type[nn.Module], Policy]:
    """``module_policies`` as a dict, after checking its keys and values."""
    if not isinstance(module_policies, Mapping):
        raise TypeError(
            "module_policies must be a mapping from nn.Module types to Policy, "
            f"got {type(module_policies).__name__}"
        )
    for cls, policy in module_policies.items():
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"module_policies: key {cls!r} is not an nn.Module subclass")
        if not isinstance(policy, Policy):
            raise TypeError(
                f"module_policies[{cls.__name__}] must be a Policy, got {type(policy).__name__}"
            )
    return dict(module_policies)
