"""The FP16 training state and its one pure update.

``state``: :class:`FP16State` and :func:`fp16_init`; ``step``:
:func:`fp16_update` and :func:`update_path`; ``dispatch``: the one place that
chooses the implementation; ``reference``, ``foreach`` and (in
:mod:`functional_fp16._fused`) the fused op: the implementations;
``accumulation``: the step of a ``MultiSteps`` optimiser; ``batching``:
stacked states for ``vmap``. May import :mod:`functional_fp16._fused` and the
layers below it (transforms, precision, kernels, ``_util``); never checkpoints,
interop or distributed.
"""

from functional_fp16.update.batching import tree_stack, tree_unstack
from functional_fp16.update.master import convert_master, master_form, master_weights
from functional_fp16.update.state import (
    FP16State,
    fp16_init,
    leaf_paths,
    loss_scale_stats,
    nonfinite_leaves,
)
from functional_fp16.update.state_bytes import StateBytes, state_nbytes
from functional_fp16.update.step import fp16_update, update_path

__all__ = ["FP16State", "fp16_init", "fp16_update", "update_path", "tree_stack", "tree_unstack"]
__all__ += ["loss_scale_stats", "nonfinite_leaves", "leaf_paths", "state_nbytes", "StateBytes"]
__all__ += ["master_weights", "convert_master", "master_form"]
