"""Gradient transformations in optax's style: pure ``(init, update)`` pairs that chain.

Holds the interface (:mod:`.base`), the optimisers (:mod:`.sgd`, :mod:`.adam`,
:mod:`.rmsprop`), :mod:`.clipping`, :mod:`.zero_nans`, :mod:`.schedules`,
:mod:`.masking`, :mod:`.combining`, :mod:`.conditionality` and the
``MultiSteps`` transform (:mod:`.accumulation`; its FP16 update step lives in
:mod:`functional_fp16.update`). May import
:mod:`functional_fp16.precision` and :mod:`functional_fp16._util`, never the
update or its kernels.
"""

from functional_fp16.transforms.accumulation import MultiSteps, MultiStepsState
from functional_fp16.transforms.adam import ScaleByAdamState, adam, adamw, scale_by_adam
from functional_fp16.transforms.base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    chain,
    identity,
    update_with_extra_args,
)
from functional_fp16.transforms.clipping import LeafSums, clip, clip_by_global_norm, global_norm
from functional_fp16.transforms.combining import MultiTransformState, multi_transform, set_to_zero
from functional_fp16.transforms.conditionality import ApplyIfFiniteState, apply_if_finite
from functional_fp16.transforms.hyperparams import InjectHyperparamsState, inject_hyperparams
from functional_fp16.transforms.lion import ScaleByLionState, lion, scale_by_lion
from functional_fp16.transforms.masking import MaskedNode, MaskedState, masked
from functional_fp16.transforms.rmsprop import (
    ScaleByRmsState,
    ScaleByRStdDevState,
    rmsprop,
    scale_by_rms,
    scale_by_stddev,
)
from functional_fp16.transforms.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_cosine_decay_schedule,
)
from functional_fp16.transforms.sgd import (
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    scale_by_learning_rate,
    sgd,
    trace,
)
from functional_fp16.transforms.zero_nans import ZeroNansState, zero_nans

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "identity",
    "chain",
    "apply_updates",
    "update_with_extra_args",
    "sgd",
    "trace",
    "TraceState",
    "scale_by_learning_rate",
    "ScaleByScheduleState",
    "add_decayed_weights",
    "adam",
    "adamw",
    "scale_by_adam",
    "ScaleByAdamState",
    "rmsprop",
    "scale_by_rms",
    "ScaleByRmsState",
    "scale_by_stddev",
    "ScaleByRStdDevState",
    "inject_hyperparams",
    "InjectHyperparamsState",
    "lion",
    "scale_by_lion",
    "ScaleByLionState",
    "clip",
    "clip_by_global_norm",
    "global_norm",
    "LeafSums",
    "masked",
    "MaskedState",
    "MaskedNode",
    "multi_transform",
    "MultiTransformState",
    "set_to_zero",
    "apply_if_finite",
    "ApplyIfFiniteState",
    "zero_nans",
    "ZeroNansState",
    "MultiSteps",
    "MultiStepsState",
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "exponential_decay",
    "piecewise_constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "warmup_cosine_decay_schedule",
]
