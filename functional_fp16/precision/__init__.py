"""Precision: loss scales and mixed-precision policies, jmp's two concepts.

Holds :mod:`.loss_scale` (dynamic, static and no-op loss scales, as pytrees of
0-d tensors) and :mod:`.policy` (which dtype parameters, computation and
outputs use). May import only :mod:`functional_fp16._util`.
"""

from functional_fp16.precision.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    loss_scale_for,
    select_tree,
    unscale_factor,
)
from functional_fp16.precision.policy import (
    NORM_MODULES,
    ModulePolicies,
    Policy,
    cast_to,
    default_loss_scale,
    default_module_policies,
    get_policy,
    module_policy,
    norm_policy,
    parse_dtype,
)

__all__ = [
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScale",
    "all_finite",
    "select_tree",
    "unscale_factor",
    "loss_scale_for",
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
