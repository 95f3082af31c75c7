"""functional_fp16: pure, composable FP16 mixed-precision training for PyTorch."""

from functional_fp16._tree import NAMESPACE
from functional_fp16.accumulation import MultiSteps, MultiStepsState
from functional_fp16.adam import ScaleByAdamState, adam, adamw, scale_by_adam
from functional_fp16.allocator import tune_malloc
from functional_fp16.base import EmptyState, GradientTransformation, apply_updates, chain, identity
from functional_fp16.bridge import (
    make_apply,
    module_state_dict,
    scaled_grad_and_value,
    split_module,
)
from functional_fp16.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    load_checkpoint,
    save_checkpoint,
)
from functional_fp16.clipping import clip_by_global_norm, global_norm
from functional_fp16.combining import MultiTransformState, multi_transform, set_to_zero
from functional_fp16.conditionality import ApplyIfFiniteState, apply_if_finite
from functional_fp16.distributed import agree_finite, all_reduce_mean, tree_all_reduce_mean
from functional_fp16.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    unscale_factor,
)
from functional_fp16.masking import MaskedNode, MaskedState, masked
from functional_fp16.migration import from_torch, to_torch
from functional_fp16.policy import (
    NORM_MODULES,
    Policy,
    cast_to,
    default_loss_scale,
    default_module_policies,
    get_policy,
    module_policy,
    norm_policy,
    parse_dtype,
)
from functional_fp16.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    join_schedules,
    linear_schedule,
    warmup_cosine_decay_schedule,
)
from functional_fp16.sgd import (
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    scale_by_learning_rate,
    sgd,
    trace,
)
from functional_fp16.stuck_scale import (
    StuckScaleError,
    StuckScaleMonitor,
    StuckScaleState,
    stuck_scale_check,
    stuck_scale_init,
    stuck_scale_observe,
)
from functional_fp16.update import FP16State, fp16_init, fp16_update, update_path
from functional_fp16.update.batching import tree_stack, tree_unstack

__version__ = "0.1.0"

__all__ = [
    "NAMESPACE",
    # transforms
    "GradientTransformation",
    "EmptyState",
    "identity",
    "chain",
    "apply_updates",
    "tree_stack",
    "tree_unstack",
    "adam",
    "adamw",
    "scale_by_adam",
    "ScaleByAdamState",
    "sgd",
    "trace",
    "TraceState",
    "scale_by_learning_rate",
    "ScaleByScheduleState",
    "add_decayed_weights",
    "masked",
    "MaskedState",
    "MaskedNode",
    "multi_transform",
    "MultiTransformState",
    "set_to_zero",
    "clip_by_global_norm",
    "global_norm",
    "apply_if_finite",
    "ApplyIfFiniteState",
    "MultiSteps",
    "MultiStepsState",
    # schedules
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "warmup_cosine_decay_schedule",
    # loss scaling
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScale",
    "all_finite",
    "unscale_factor",
    # the FP16 state and update
    "FP16State",
    "fp16_init",
    "fp16_update",
    "update_path",
    "tune_malloc",
    # moving a torch.optim + GradScaler job in and out
    "from_torch",
    "to_torch",
    # the torch.func bridge
    "split_module",
    "make_apply",
    "scaled_grad_and_value",
    "module_state_dict",
    # precision policies
    "Policy",
    "get_policy",
    "parse_dtype",
    "cast_to",
    "default_loss_scale",
    "NORM_MODULES",
    "norm_policy",
    "default_module_policies",
    "module_policy",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    # stuck-scale detection
    "StuckScaleMonitor",
    "StuckScaleState",
    "StuckScaleError",
    "stuck_scale_init",
    "stuck_scale_observe",
    "stuck_scale_check",
    # data parallelism (more in functional_fp16.distributed)
    "all_reduce_mean",
    "tree_all_reduce_mean",
    "agree_finite",
]
