"""functional_fp16: pure, composable FP16 mixed-precision training for PyTorch.

The public API, re-exported from the subpackages:

- :mod:`functional_fp16.precision`: loss scales and mixed-precision policies;
- :mod:`functional_fp16.transforms`: optax-style gradient transformations;
- :mod:`functional_fp16.update`: the FP16 state and ``fp16_update``;
- :mod:`functional_fp16.checkpoint`: checkpoint files;
- :mod:`functional_fp16.interop`: moving a ``torch.optim`` + ``GradScaler`` job in and out;
- :mod:`functional_fp16.distributed`: data parallelism and sharding on ``torch.distributed``;
- :mod:`functional_fp16.bridge`, :mod:`functional_fp16.stuck_scale`,
  :mod:`functional_fp16.allocator`: the ``torch.func`` bridge, stuck-scale
  detection and the CPU allocator setting.
"""

from functional_fp16._util.deprecation import redirect_moved_modules
from functional_fp16._util.tree import NAMESPACE
from functional_fp16.allocator import tune_malloc
from functional_fp16.bridge import (
    make_apply,
    module_state_dict,
    scaled_grad_and_value,
    split_module,
    write_params,
)
from functional_fp16.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    load_checkpoint,
    save_checkpoint,
)
from functional_fp16.distributed import agree_finite, all_reduce_mean, tree_all_reduce_mean
from functional_fp16.interop import from_torch, to_torch
from functional_fp16.precision import (
    NORM_MODULES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    Policy,
    StaticLossScale,
    all_finite,
    cast_to,
    default_loss_scale,
    default_module_policies,
    get_policy,
    module_policy,
    norm_policy,
    parse_dtype,
    select_tree,
    unscale_factor,
)
from functional_fp16.stuck_scale import (
    StuckScaleError,
    StuckScaleMonitor,
    StuckScaleState,
    stuck_scale_check,
    stuck_scale_init,
    stuck_scale_observe,
)
from functional_fp16.transforms import (
    ApplyIfFiniteState,
    EmptyState,
    GradientTransformation,
    InjectHyperparamsState,
    LeafSums,
    MaskedNode,
    MaskedState,
    MultiSteps,
    MultiStepsState,
    MultiTransformState,
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByRmsState,
    ScaleByRStdDevState,
    ScaleByScheduleState,
    TraceState,
    ZeroNansState,
    adam,
    adamw,
    add_decayed_weights,
    apply_if_finite,
    apply_updates,
    chain,
    clip,
    clip_by_global_norm,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    global_norm,
    identity,
    inject_hyperparams,
    join_schedules,
    linear_schedule,
    lion,
    masked,
    multi_transform,
    piecewise_constant_schedule,
    polynomial_schedule,
    rmsprop,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_stddev,
    set_to_zero,
    sgd,
    trace,
    warmup_cosine_decay_schedule,
    zero_nans,
)
from functional_fp16.update import (
    FP16State,
    convert_master,
    fp16_init,
    fp16_update,
    leaf_paths,
    loss_scale_stats,
    master_form,
    master_weights,
    nonfinite_leaves,
    state_nbytes,
    update_path,
)
from functional_fp16.update.batching import tree_stack, tree_unstack

# Module paths of release 0.1 that moved into subpackages: importable for one
# more release, with a DeprecationWarning.
_MOVED = {
    f"functional_fp16.{old}": f"functional_fp16.{new}"
    for old, new in {
        "loss_scale": "precision.loss_scale",
        "policy": "precision.policy",
        "base": "transforms.base",
        "sgd": "transforms.sgd",
        "adam": "transforms.adam",
        "clipping": "transforms.clipping",
        "schedules": "transforms.schedules",
        "masking": "transforms.masking",
        "combining": "transforms.combining",
        "conditionality": "transforms.conditionality",
        "accumulation": "transforms.accumulation",
        "atomic_file": "checkpoint.atomic_file",
        "migration": "interop.migration",
        "torch_optim": "interop.torch_optim",
        "grad_scaler": "interop.grad_scaler",
    }.items()
}
redirect_moved_modules(_MOVED)


def __getattr__(name: str):
    """``functional_fp16.policy`` and the other moved modules, as attributes (deprecated)."""
    if f"{__name__}.{name}" in _MOVED:
        import sys

        return sys.modules[f"{__name__}.{name}"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "clip",
    "clip_by_global_norm",
    "global_norm",
    "LeafSums",
    "apply_if_finite",
    "ApplyIfFiniteState",
    "zero_nans",
    "ZeroNansState",
    "MultiSteps",
    "MultiStepsState",
    # schedules
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "exponential_decay",
    "piecewise_constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "warmup_cosine_decay_schedule",
    # loss scaling
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScale",
    "all_finite",
    "select_tree",
    "unscale_factor",
    # the FP16 state and update
    "FP16State",
    "fp16_init",
    "loss_scale_stats",
    "nonfinite_leaves",
    "leaf_paths",
    "fp16_update",
    "state_nbytes",
    "master_weights",
    "convert_master",
    "master_form",
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
    "write_params",
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
