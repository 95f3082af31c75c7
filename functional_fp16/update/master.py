r"""The two forms of a state's FP32 master: ``"float32"`` and ``"split"``.

A state made with ``fp16_init(..., master="split")`` keeps in ``state.master`` one
``int16`` residual per parameter instead of a float32 copy; with the FP16 params it
holds the FP32 master exactly (:mod:`functional_fp16.precision.master_split`):

.. math:: m = p + q\,u(p), \qquad (p, q) = \operatorname{split}(m)

:func:`master_weights` reads the FP32 master of either form, :func:`convert_master`
converts a state between the forms, and :func:`master_form` says which one a state has.
Every update path takes either form; the fused op reads :math:`p` and :math:`q` and writes
:math:`p'` and :math:`q'` in its one pass, and every other path steps the float32 master
between a :func:`widened` state and a :func:`narrowed` one.
"""

from __future__ import annotations

import torch

from functional_fp16._util.tree import PyTree, tree_flatten, tree_rebuild
from functional_fp16.precision import master_split
from functional_fp16.precision.master_split import MASTER_FORMS
from functional_fp16.update.state import FP16State

__all__ = ["master_form", "master_weights", "convert_master", "widened", "narrowed"]


def master_form(state: FP16State) -> str:
    """``"split"`` where every leaf of ``state.master`` is an ``int16`` residual, else
    ``"float32"``. Reads dtypes only."""
    return "split" if master_split.holds_residuals(tree_flatten(state.master)[0]) else "float32"


def _join_leaves(state: FP16State) -> list[torch.Tensor]:
    params = tree_flatten(state.params)[0]
    residuals = tree_flatten(state.master)[0]
    return [master_split.join_leaf(p, q) for p, q in zip(params, residuals)]


def master_weights(state: FP16State) -> PyTree:
    r"""The FP32 master weights of ``state``, a tree shaped like ``state.params``.

    For a ``"float32"`` state, ``state.master`` itself (no copy). For a ``"split"``
    state, the master decoded from params and residuals, :math:`m = p + q\,u(p)` (a new
    float32 tree, bitwise the FP32 master wherever it is at least :math:`2^{-16}` in
    magnitude; :mod:`~functional_fp16.precision.master_split` gives the bound below).
    DTensor leaves come back as DTensors placed like the params.

    This is what loads into an FP32 module (``module_state_dict(model,
    master_weights(state))``), what ``to_torch`` copies into ``torch.optim``'s
    parameters and what a checkpoint's reader wants as the weights.

    Args:
      state: an :class:`~functional_fp16.FP16State`.

    Returns:
      The float32 master tree.
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    if master_form(state) == "float32":
        return state.master
    return tree_rebuild(tree_flatten(state.params)[1], state.params, _join_leaves(state))


def widened(state: FP16State) -> FP16State:
    """A split state as a ``"float32"`` one: its master decoded (the params shared)."""
    return state.replace(master=master_weights(state))


def narrowed(state: FP16State) -> FP16State:
    r"""A ``"float32"`` state as a ``"split"`` one: :math:`(p, q) = \operatorname{split}(m)`
    of every master leaf (the params rebuilt from the master, as every update does)."""
    masters, spec = tree_flatten(state.master)
    pairs = [master_split.split_leaf(m) for m in masters]
    params, residuals = [p for p, _ in pairs], [q for _, q in pairs]
    return state.replace(
        params=tree_rebuild(spec, state.params, params),
        master=tree_rebuild(spec, state.master, residuals),
    )


def convert_master(state: FP16State, master: str) -> FP16State:
    r"""``state`` with its FP32 master held as ``master`` (``"float32"`` or ``"split"``).

    * ``"split"`` from ``"float32"``: :math:`(p, q) = \operatorname{split}(m)`. The
      params are the FP16 rounding of the master as before (bitwise, wherever
      :math:`|m| \ge 2^{-16}`; below, of the master put on the grid of :math:`2^{-39}`),
      and the residuals replace the float32 copy: 2 bytes per parameter instead of 4.
    * ``"float32"`` from ``"split"``: the decoded master
      (:func:`master_weights`) becomes ``state.master``; the params are kept.
    * The form the state already has: the state itself.

    A round trip split → float32 → split gives back params and residuals bitwise. The
    optimiser state, loss scale and counters are shared, never copied; the input is not
    modified. Params must be float16 for ``"split"``.

    Args:
      state: an :class:`~functional_fp16.FP16State`.
      master: the form wanted.

    Returns:
      The converted state.
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    if master not in MASTER_FORMS:
        raise ValueError(f"master must be one of {MASTER_FORMS}, got {master!r}")
    have = master_form(state)
    if have == master:
        return state
    if master == "float32":
        return widened(state)
    for x in tree_flatten(state.params)[0]:
        if x.dtype != master_split.PARAM_DTYPE:
            raise ValueError(
                f"master='split' needs float16 params, got {x.dtype}: the residual holds the "
                "FP32 master exactly only beside FP16 params"
            )
    for x in tree_flatten(state.master)[0]:
        if x.dtype != torch.float32:
            raise TypeError(f"state.master: expected float32 leaves, got {x.dtype}")
    return narrowed(state)
