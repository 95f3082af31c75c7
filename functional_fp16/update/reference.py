r"""``impl="reference"``: the plain tree-map update, the specification every other path is tested against.

.. math::
    \hat g = \operatorname{unscale}(g), \quad \ell_l = \textstyle\bigwedge \operatorname{isfinite}(\hat g_l), \quad
    f = \textstyle\bigwedge_l \ell_l, \quad
    (u, o') = \text{tx.update}(\hat g, o, m), \quad
    m' = f\ ?\ m + u : m, \quad p' = \operatorname{fl}_{16}(m')
"""

from __future__ import annotations

import torch

from functional_fp16._util.tree import PyTree, tree_leaves, tree_map, tree_select
from functional_fp16.precision.scale_stats import stepped_stats
from functional_fp16.transforms.base import apply_updates, update_with_extra_args
from functional_fp16.update.decision import Decision
from functional_fp16.update.state import FP16State

__all__ = ["reference_update"]


def reference_update(state: FP16State, grads: PyTree, decision: Decision, donate: bool):
    """The reference step. It never writes in place, so ``donate`` is accepted and ignored."""
    del donate
    grads32 = state.loss_scale.unscale(grads)
    flags = torch.stack([torch.isfinite(g).all() for g in tree_leaves(grads32)])
    flags, finite = decision.leaves(flags)
    updates, opt_state = update_with_extra_args(
        state.tx, grads32, state.opt_state, state.master, **decision.extra_args()
    )
    master = tree_select(finite, apply_updates(state.master, updates), state.master)
    opt_state = tree_select(finite, opt_state, state.opt_state)
    params = tree_map(lambda m, p: m.to(p.dtype), master, state.params)
    loss_scale = state.loss_scale.adjust(finite)
    return state.replace(
        params=params,
        master=master,
        opt_state=opt_state,
        loss_scale=loss_scale,
        step=state.step + 1,
        grads_finite=finite,
        scale_stats=stepped_stats(state, loss_scale, finite),
        leaf_finite=flags,
    )
