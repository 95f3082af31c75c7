"""Moving a running ``torch.optim`` + ``GradScaler`` job into an :class:`FP16State`, and back.

``from_torch(params, optimizer, scaler)`` reads a torch job between two
iterations and returns the :class:`~functional_fp16.FP16State` that continues
it; ``to_torch(state, optimizer, scaler)`` writes a state into a torch job.
Either way the continued job follows the uninterrupted one: the same skip
decisions and scale trajectory bitwise, the master within a few ulps (the
per-step rounding differences of :mod:`~functional_fp16.transforms.sgd` and
:mod:`~functional_fp16.transforms.adam`). The mapping, field by field::

    torch                                          functional_fp16
    FP32 parameter p (matched by identity)         state.master leaf (a copy); state.params = fl16(master)
    SGD(lr, momentum, dampening,                   sgd(lr, momentum, nesterov=..., dampening=...,
        weight_decay, nesterov)                        weight_decay=...)
    Adam(lr, (b1, b2), eps)                        adam(lr, b1, b2, eps)
    Adam(..., weight_decay=wd)  (L2)               chain(add_decayed_weights(wd), adam(lr, b1, b2, eps))
    AdamW(lr, (b1, b2), eps, weight_decay=wd)      adamw(lr, b1, b2, eps, weight_decay=wd)
    state[p]["momentum_buffer"]                    TraceState.trace leaf
      absent: no step yet                            TraceState.initialized == False (zero buffers)
    state[p]["step"]  (float tensor, per param)    ScaleByAdamState.count  (0-d int32, one for all)
    state[p]["exp_avg"], ["exp_avg_sq"]            ScaleByAdamState.mu, .nu leaves
      no state: no step yet                          count == 0, zero moments
    GradScaler: scale, _growth_tracker             DynamicLossScale: loss_scale, growth_count
    growth_factor, backoff_factor,                 the same DynamicLossScale settings; min_scale the
      growth_interval                                smallest normal float32, max_scale inf (GradScaler
                                                     has no bounds), hysteresis 1
    no GradScaler, or a disabled one               NoOpLossScale

A param group's learning rate is read as the constant it is now: a torch
LR scheduler is not carried over.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from functional_fp16._util.tree import (
    NAMESPACE,
    PyTree,
    check_same_structure,
    child_steps,
    describe_tensor,
    tree_leaves,
    tree_paths,
)
from functional_fp16.interop.grad_scaler import _loss_scale_from, _scaler_state
from functional_fp16.interop.torch_optim import (
    _ADAM_STATE,
    _check_same_rule,
    _forget,
    _fresh_step,
    _like,
    _optimizer_recipe,
    _read_adam,
    _read_trace,
    _transform,
)
from functional_fp16.precision.loss_scale import LossScale
from functional_fp16.transforms.base import replace_at, state_at
from functional_fp16.update import FP16State, fp16_init
from functional_fp16.update.master import master_weights

__all__ = ["from_torch", "to_torch"]


# -- the parameters: a tree <-> the optimizer's list ----------------------------


def _where(optimizer: Any) -> dict[int, str]:
    return {
        id(p): f"optimizer.param_groups[{g}]['params'][{i}]"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    }


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _match_by_identity(params: PyTree, optimizer: Any) -> list[torch.Tensor]:
    """The leaves of ``params``, checked to be the optimizer's parameters, each once, all of them."""
    where = _where(optimizer)
    seen: dict[int, str] = {}
    leaves = tree_leaves(params)
    for path, leaf in zip(tree_paths(params), leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"params{path}: expected one of the optimizer's parameters, got "
                f"{describe_tensor(leaf)}"
            )
        if id(leaf) not in where:
            raise ValueError(
                f"params{path} ({describe_tensor(leaf)}) is not one of the optimizer's "
                "parameters; params is matched to optimizer.param_groups[...]['params'] by "
                "identity: pass the model's own parameters, e.g. dict(model.named_parameters())"
            )
        if id(leaf) in seen:
            raise ValueError(f"params{path} is the same tensor as params{seen[id(leaf)]}")
        seen[id(leaf)] = path
        if leaf.dtype != torch.float32:
            raise TypeError(
                f"params{path}: expected a float32 parameter (the FP32 weights of a "
                f"mixed-precision job), got {describe_tensor(leaf)}"
            )
    for p in _optimizer_params(optimizer):
        if id(p) not in seen:
            raise ValueError(
                f"{where[id(p)]} ({describe_tensor(p)}) is not in params: params must hold "
                "every parameter the optimizer updates"
            )
    return leaves


def _ordered_paths(node: PyTree, path: str = "") -> list[str]:
    """Leaf paths with dicts in insertion order (the order ``model.named_parameters()`` gives)."""
    if optree.tree_is_leaf(node, namespace=NAMESPACE):
        return [path or "<root>"]
    level = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
    children = list(zip(child_steps(node), level.children))
    if type(node) is dict:  # optree lists a dict's keys sorted
        rank = {key: i for i, key in enumerate(node)}
        order = sorted(range(len(children)), key=lambda i: rank[level.entries[i]])
        children = [children[i] for i in order]
    return [leaf for step, child in children for leaf in _ordered_paths(child, path + step)]


def _match_by_order(master: PyTree, optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's parameters, in ``master``'s flattening order, matched by position."""
    paths = tree_paths(master)
    index = {path: i for i, path in enumerate(paths)}
    ordered = [index[path] for path in _ordered_paths(master)]
    targets = _optimizer_params(optimizer)
    if len(targets) != len(paths):
        raise ValueError(
            f"optimizer has {len(targets)} parameters but state.master has {len(paths)} leaves"
        )
    names = [n for group in optimizer.param_groups for n in group.get("param_names", ())]
    where = _where(optimizer)
    out: list[torch.Tensor | None] = [None] * len(paths)
    leaves = tree_leaves(master)
    for k, (i, p) in enumerate(zip(ordered, targets)):
        shown = f"state.master{paths[i]}"
        if len(names) == len(targets) and paths[i] != f"[{names[k]!r}]":
            raise ValueError(
                f"{where[id(p)]} is named {names[k]!r} in the optimizer, but the leaf at its "
                f"position is {shown}; pass params= to match by identity"
            )
        if p.shape != leaves[i].shape:
            raise ValueError(
                f"{where[id(p)]} has shape {tuple(p.shape)} but {shown}, the leaf at its position "
                f"(dicts in insertion order), has shape {tuple(leaves[i].shape)}; pass params= "
                "(the tree of the optimizer's parameters) to match them by identity"
            )
        out[i] = p
    return out  # type: ignore[return-value]


# -- the two directions ---------------------------------------------------------


def from_torch(
    params: PyTree,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    *,
    loss_scale: LossScale | None = None,
    param_dtype: torch.dtype = torch.float16,
) -> FP16State:
    r"""The :class:`FP16State` that continues a running ``torch.optim`` (+ ``GradScaler``) job.

    Call it between two iterations (after ``scaler.update()``). With
    :math:`p` the optimizer's FP32 parameters:

    .. math:: m = \operatorname{fl}_{32}(p), \quad \text{params} = \operatorname{fl}_{16}(m)

    and the optimiser and its state are read as the module docstring's table
    says: ``SGD`` becomes :func:`~functional_fp16.transforms.sgd.sgd` (momentum buffers, none
    before the first step: ``TraceState.initialized`` false), ``Adam`` becomes
    :func:`~functional_fp16.transforms.adam.adam` (after ``add_decayed_weights`` for its L2
    decay), ``AdamW`` :func:`~functional_fp16.adamw` (``step`` becomes the
    int32 ``count``, ``exp_avg``/``exp_avg_sq`` the FP32 moments); a
    ``GradScaler``'s scale, growth tracker, factors and interval become a
    :class:`DynamicLossScale` (no floor or ceiling, as GradScaler has none,
    except the smallest normal float32). ``state.step`` starts at 0. Every
    tensor is copied: later torch steps do not reach the state, and nothing
    of ``params``, ``optimizer`` or ``scaler`` is modified.

    Args:
      params: a pytree of the optimizer's parameters, float32, for example
        ``dict(model.named_parameters())``; matched to
        ``optimizer.param_groups[...]['params']`` by identity, each exactly
        once. It gives the state its tree structure.
      optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (exactly these
        classes), without ``maximize`` or ``amsgrad``. Several param groups
        must share every hyperparameter (a group's ``lr`` is read as the
        constant it is now; an LR scheduler is not carried over).
      scaler: the job's ``torch.amp.GradScaler``; ``None`` or a disabled one
        gives :class:`NoOpLossScale`.
      loss_scale: only without ``scaler``: the loss scale to start with
        (default :class:`NoOpLossScale`, as the torch job had none).
      param_dtype: dtype of the working copy ``state.params`` (default FP16).

    Returns:
      An :class:`FP16State` with ``step == 0`` and ``grads_finite == True``.

    Raises:
      TypeError: an unsupported optimizer or scaler, or a ``params`` leaf
        that is not a float32 tensor.
      ValueError: hyperparameters or state ``FP16State`` cannot hold (named
        by group and key, or by leaf path), or ``params`` not matching the
        optimizer's parameters.
    """
    recipe = _optimizer_recipe(optimizer)
    tx = _transform(recipe)
    targets = _match_by_identity(params, optimizer)
    ls = _loss_scale_from(scaler, loss_scale)
    paths = tree_paths(params)
    state = fp16_init(params, tx, ls, param_dtype=param_dtype)
    if recipe.kind == "SGD":
        inner = _read_trace(targets, paths, optimizer, recipe.hyper["momentum"], state.master)
    else:
        inner = _read_adam(targets, paths, optimizer, state.master)
    return state.replace(opt_state=replace_at(state.opt_state, recipe.state_path, inner))


def to_torch(
    state: FP16State,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    *,
    params: PyTree | None = None,
) -> None:
    r"""Writes ``state`` into a ``torch.optim`` (+ ``GradScaler``) job, which continues it.

    The inverse of :func:`from_torch`, with the same mapping: every parameter
    :math:`p` of the optimizer gets its master, ``p.copy_(m)`` under
    ``no_grad`` (torch optimisers own their parameters); ``optimizer.state[p]``
    gets the momentum buffer (removed if ``TraceState.initialized`` is false)
    or Adam's ``step``, ``exp_avg`` and ``exp_avg_sq`` (removed if ``count``
    is 0), new tensors laid out like :math:`p`, an existing ``step`` tensor's
    dtype and device kept; the scaler gets the scale and growth tracker through
    ``scaler.load_state_dict`` (so its ``_init_scale`` becomes the current
    scale, as a loaded checkpoint does). ``GradScaler`` has no floor or
    ceiling: past ``state.loss_scale``'s ``min_scale``/``max_scale`` the torch
    run's scale goes on where the state's would stop.

    Everything is checked before anything is written: a state whose optimiser
    or loss scale does not match ``optimizer``/``scaler`` (other
    hyperparameters, growth interval, ...) is refused. ``state`` is never
    modified, and no tensor of it is shared with the optimizer afterwards.

    Args:
      state: an :class:`FP16State` whose ``tx`` is one :func:`from_torch`
        builds: :func:`~functional_fp16.transforms.sgd.sgd`, :func:`~functional_fp16.transforms.adam.adam`,
        ``chain(add_decayed_weights(wd), adam(...))`` or
        :func:`~functional_fp16.adamw`, with a constant learning rate.
      optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` with the same
        hyperparameters (``AdamW`` with ``weight_decay=0`` matches ``adam``).
      scaler: an enabled ``torch.amp.GradScaler`` with the same factors and
        interval for a :class:`DynamicLossScale` (hysteresis 1); ``None`` or a
        disabled one for :class:`NoOpLossScale`.
      params: optionally, the optimizer's parameters in ``state.master``'s
        tree structure (e.g. ``dict(model.named_parameters())``), matched by
        identity. Without it, the optimizer's parameters in their order are
        matched to ``state.master``'s leaves with dicts in insertion order
        (the order of ``model.named_parameters()`` for an optimizer built from
        ``model.parameters()``), checked by shape and, where the optimizer
        has ``param_names``, by name.

    Returns:
      ``None``; ``optimizer``'s parameters and state and ``scaler`` are written.

    Raises:
      TypeError: an unsupported optimizer or scaler, or not an ``FP16State``.
      ValueError: a mismatch, named by hyperparameter, field or leaf path.
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    want = _optimizer_recipe(optimizer)
    got = _check_same_rule(state.tx, want, optimizer)
    if params is None:
        targets = _match_by_order(state.master, optimizer)
    else:
        check_same_structure(state.master, params, name="params", reference_name="state.master")
        targets = _match_by_identity(params, optimizer)
    masters = tree_leaves(master_weights(state))  # decoded from a split master
    where = _where(optimizer)
    for p, m in zip(targets, masters):
        if p.dtype != torch.float32 or p.shape != m.shape:
            raise ValueError(
                f"{where[id(p)]} ({describe_tensor(p)}) cannot take a master of shape "
                f"{tuple(m.shape)}: expected float32 of that shape"
            )
    inner = state_at(state.opt_state, got.state_path)
    scaler_state = _scaler_state(state.loss_scale, scaler)

    # Build every tensor first, then write. ``live``: torch keeps state for this rule now.
    if want.kind == "SGD":
        keys: tuple[str, ...] = ("momentum_buffer",) if want.hyper["momentum"] != 0.0 else ()
        live = bool(keys) and bool(inner.initialized)
        columns = {"momentum_buffer": tree_leaves(inner.trace)}
    else:
        keys, count = _ADAM_STATE, int(inner.count)
        live = count > 0
        columns = {"exp_avg": tree_leaves(inner.mu), "exp_avg_sq": tree_leaves(inner.nu)}
    new = []
    for i, p in enumerate(targets):
        entry = {k: _like(p, v[i]) for k, v in columns.items()} if live else {}
        if live and want.kind != "SGD":
            old = optimizer.state.get(p, {}).get("step")
            kept = isinstance(old, torch.Tensor)
            step = torch.full_like(old, count) if kept else _fresh_step(optimizer, p, count)
            entry = {"step": step, **entry}
        new.append(entry)
    with torch.no_grad():
        for p, m in zip(targets, masters):
            p.copy_(m)
    for p, entry in zip(targets, new):
        if entry:
            optimizer.state[p].update(entry)
        else:
            _forget(optimizer, p, keys)
    if scaler_state is not None:
        scaler.load_state_dict(scaler_state)
