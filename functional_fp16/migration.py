"""Moving a running ``torch.optim`` + ``GradScaler`` job into an :class:`FP16State`, and back.

``from_torch(params, optimizer, scaler)`` reads a torch job between two
iterations and returns the :class:`~functional_fp16.FP16State` that continues
it; ``to_torch(state, optimizer, scaler)`` writes a state into a torch job.
Either way the continued job follows the uninterrupted one: the same skip
decisions and scale trajectory bitwise, the master within a few ulps (the
per-step rounding differences of :mod:`~functional_fp16.sgd` and
:mod:`~functional_fp16.adam`). The mapping, field by field::

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

import math
from typing import Any, NamedTuple

import optree
import torch

from functional_fp16._tree import (
    NAMESPACE,
    PyTree,
    check_same_structure,
    child_steps,
    describe_tensor,
    tree_flatten,
    tree_leaves,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.adam import AdamSpec, ScaleByAdamState, adam, adamw
from functional_fp16.base import ChainSpec, GradientTransformation, chain
from functional_fp16.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from functional_fp16.sgd import (
    DecaySpec,
    LearningRateSpec,
    TraceSpec,
    TraceState,
    add_decayed_weights,
    sgd,
)
from functional_fp16.sgd_plan import replace_at, state_at
from functional_fp16.update import FP16State, fp16_init

__all__ = ["from_torch", "to_torch"]

_SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_KEYS = {
    "SGD": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
    "Adam": ("lr", "betas", "eps", "weight_decay"),
}
# Settings with one supported value: (key, that value, why no other).
_FIXED = {
    "SGD": (("maximize", False, "ff.sgd always descends"),),
    "Adam": (
        ("maximize", False, "ff.adam and ff.adamw always descend"),
        ("amsgrad", False, "ff.adam keeps no running maximum of the second moments (AMSGrad)"),
    ),
}
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_TINY32 = torch.finfo(torch.float32).tiny
_BUILT = (
    "ff.sgd, ff.adam, chain(ff.add_decayed_weights(wd), ff.adam) or ff.adamw, with a constant "
    "learning rate and eps_root=0"
)


class _Recipe(NamedTuple):
    """An update rule in torch's terms, and where its state sits in the chain's state."""

    kind: str  # "SGD", "Adam" (decay added to the gradient, or none) or "AdamW" (decoupled)
    hyper: dict[str, Any]  # param-group key -> value: floats, bools, the betas tuple
    state_path: tuple[int, ...]  # TraceState / ScaleByAdamState inside tx.init's tuple


# -- the optimiser: torch hyperparameters <-> a transform -----------------------


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value)
    if isinstance(value, tuple):
        return tuple(_number(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _optimizer_recipe(optimizer: Any) -> _Recipe:
    """The rule ``optimizer`` runs, checked to be one rule for every param group."""
    if type(optimizer) not in _SUPPORTED:
        got = type(optimizer).__module__ + "." + type(optimizer).__qualname__
        raise TypeError(
            "optimizer must be a torch.optim.SGD, Adam or AdamW (the rules ff.sgd, ff.adam and "
            f"ff.adamw reproduce), got {got}"
        )
    family = "SGD" if type(optimizer) is torch.optim.SGD else "Adam"
    keys = _KEYS[family] + (("decoupled_weight_decay",) if family == "Adam" else ())
    first: dict[str, Any] = {}
    for i, group in enumerate(optimizer.param_groups):
        for key, value, why in _FIXED[family]:
            if bool(group.get(key, value)) != value:
                raise ValueError(
                    f"optimizer.param_groups[{i}]['{key}'] is {group[key]!r}, not supported: {why}"
                )
        values = {k: _number(group[k]) for k in keys if k != "decoupled_weight_decay"}
        if family == "Adam":
            default = type(optimizer) is torch.optim.AdamW
            values["decoupled_weight_decay"] = bool(group.get("decoupled_weight_decay", default))
        if i == 0:
            first = values
            continue
        for key in keys:
            if values[key] != first[key]:
                raise ValueError(
                    f"optimizer.param_groups[{i}]['{key}'] is {values[key]!r} but "
                    f"param_groups[0]['{key}'] is {first[key]!r}: the FP16State has one optimiser "
                    "for all parameters, so every group must have the same hyperparameters; merge "
                    "the groups, or build the state with ff.fp16_init and a transform that treats "
                    "the leaves differently (weight decay on some leaves only: "
                    "add_decayed_weights(wd, mask=...), ff.adamw(..., mask=...); other "
                    "settings per group: ff.multi_transform)"
                )
    if family == "SGD":
        return _Recipe("SGD", first, (1,))
    decoupled = first.pop("decoupled_weight_decay")
    if first["weight_decay"] == 0.0:
        return _Recipe("Adam", first, (0,))
    return _Recipe("AdamW", first, (0,)) if decoupled else _Recipe("Adam", first, (1, 0))


def _transform(recipe: _Recipe) -> GradientTransformation:
    h = recipe.hyper
    try:
        if recipe.kind == "SGD":
            return sgd(
                h["lr"],
                h["momentum"],
                nesterov=h["nesterov"],
                dampening=h["dampening"],
                weight_decay=h["weight_decay"],
            )
        b1, b2 = h["betas"]
        if recipe.kind == "AdamW":
            return adamw(h["lr"], b1, b2, h["eps"], weight_decay=h["weight_decay"])
        if recipe.state_path == (0,):
            return adam(h["lr"], b1, b2, h["eps"])
        return chain(add_decayed_weights(h["weight_decay"]), adam(h["lr"], b1, b2, h["eps"]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"optimizer.param_groups[0]: {err}") from None


def _spec_recipe(spec: Any) -> _Recipe | None:
    """The rule a transform declares, if it is one :func:`from_torch` builds; else ``None``."""
    parts = spec.parts if isinstance(spec, ChainSpec) else ()
    kinds = tuple(type(p) for p in parts)
    path = (0,)
    if kinds == (DecaySpec, ChainSpec):
        # chain(add_decayed_weights(wd), adam(...)), torch's Adam with L2 decay: read its
        # parts in adamw's order, with the state of scale_by_adam one level down.
        decay, parts = parts[0], parts[1].parts
        kinds, path = (AdamSpec, DecaySpec, LearningRateSpec), (1, 0)
        if tuple(type(p) for p in parts) != (AdamSpec, LearningRateSpec):
            return None
        parts = (parts[0], decay, parts[1])
    if not parts or not isinstance(parts[-1], LearningRateSpec):
        return None
    lr = parts[-1]
    if callable(lr.learning_rate) or lr.sign != -1.0:
        return None
    if kinds == (DecaySpec, TraceSpec, LearningRateSpec):
        decay, trace = parts[0], parts[1]
        hyper = {
            "lr": lr.learning_rate,
            "momentum": trace.decay,
            "dampening": trace.dampening,
            "nesterov": trace.nesterov,
            "weight_decay": decay.weight_decay,
        }
        return _Recipe("SGD", hyper, (1,))
    if kinds not in ((AdamSpec, LearningRateSpec), (AdamSpec, DecaySpec, LearningRateSpec)):
        return None
    moments = parts[0]
    if moments.eps_root != 0.0:
        return None
    wd = parts[1].weight_decay if len(parts) == 3 else 0.0
    hyper = {
        "lr": lr.learning_rate,
        "betas": (moments.b1, moments.b2),
        "eps": moments.eps,
        "weight_decay": wd,
    }
    kind = "Adam" if wd == 0.0 or path == (1, 0) else "AdamW"
    return _Recipe(kind, hyper, path)


def _check_same_rule(tx: GradientTransformation, want: _Recipe, optimizer: Any) -> _Recipe:
    got = _spec_recipe(tx.spec)
    name = f"torch.optim.{type(optimizer).__name__}"
    if got is None:
        raise ValueError(
            f"state.tx is not one of the optimisers from_torch builds ({_BUILT}), so it cannot be "
            f"written into a {name}"
        )
    if got.kind != want.kind:
        raise ValueError(
            f"state.tx follows torch.optim.{got.kind}'s rule, but optimizer ({name}, "
            f"weight_decay={want.hyper['weight_decay']}) follows {want.kind}'s"
        )
    for key, value in want.hyper.items():
        if got.hyper[key] != value:
            raise ValueError(
                f"state.tx has {key}={got.hyper[key]!r} but optimizer.param_groups[0]['{key}'] is "
                f"{value!r}: to_torch writes a state only into an optimizer with the same "
                "hyperparameters"
            )
    return got


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


# -- the optimiser state ----------------------------------------------------------


def _read_trace(targets, paths, optimizer, momentum: float, master: PyTree) -> TraceState:
    leaves, spec = tree_flatten(master)
    device = leaves[0].device
    buffers = []
    for p, path in zip(targets, paths):
        buf = optimizer.state.get(p, {}).get("momentum_buffer") if momentum != 0.0 else None
        if buf is not None and buf.shape != p.shape:
            raise ValueError(
                f"params{path}: its momentum buffer has shape {tuple(buf.shape)}, not "
                f"{tuple(p.shape)}"
            )
        buffers.append(buf)
    started = [b is not None for b in buffers]
    if any(started) and not all(started):
        have, lack = paths[started.index(True)], paths[started.index(False)]
        raise ValueError(
            f"params{have} has a momentum buffer but params{lack} has none (it never had a "
            "gradient?): an FP16State keeps one 'initialized' flag for the whole tree"
        )
    trace = [
        b.detach().to(device=device, dtype=torch.float32, copy=True)
        if b is not None
        else torch.zeros_like(m)
        for b, m in zip(buffers, leaves)
    ]
    return TraceState(
        trace=tree_unflatten(spec, trace),
        initialized=torch.tensor(all(started), device=device),
    )


def _read_adam(targets, paths, optimizer, master: PyTree) -> ScaleByAdamState:
    leaves, spec = tree_flatten(master)
    device = leaves[0].device
    entries = [optimizer.state.get(p) or {} for p in targets]
    steps = []
    for entry, path in zip(entries, paths):
        if not entry:
            steps.append(0.0)
            continue
        missing = [k for k in _ADAM_STATE if k not in entry]
        if missing:
            raise ValueError(f"params{path}: its optimizer state lacks {missing}")
        steps.append(float(entry["step"]))
    for step, path in zip(steps, paths):
        if step != steps[0]:
            raise ValueError(
                f"params{path} has taken {step:g} optimizer steps but params{paths[0]} "
                f"{steps[0]:g}: an FP16State keeps one step count for the whole tree"
            )
    count = steps[0]
    if count != int(count) or not 0 <= count <= torch.iinfo(torch.int32).max:
        raise ValueError(f"params{paths[0]}: step {count} is not a count of steps")

    def moments(key: str) -> PyTree:
        return tree_unflatten(
            spec,
            [
                e[key].detach().to(device=device, dtype=torch.float32, copy=True)
                if e
                else torch.zeros_like(m)
                for e, m in zip(entries, leaves)
            ],
        )

    return ScaleByAdamState(
        count=torch.tensor(int(count), dtype=torch.int32, device=device),
        mu=moments("exp_avg"),
        nu=moments("exp_avg_sq"),
    )


def _fresh_step(optimizer: Any, p: torch.Tensor, count: int) -> torch.Tensor:
    """A ``step`` tensor where ``torch.optim.Adam`` would create it (its ``_init_group``)."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    fused = bool(group.get("fused"))
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    if fused or group.get("capturable"):
        return torch.full((), count, dtype=torch.float32 if fused else dtype, device=p.device)
    return torch.tensor(float(count), dtype=dtype, device="cpu")


def _like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(p, memory_format=torch.preserve_format).copy_(value)


def _forget(optimizer: Any, p: torch.Tensor, keys: tuple[str, ...]) -> None:
    entry = optimizer.state.get(p)
    if entry is None:
        return
    removed = [entry.pop(k) for k in keys if k in entry]
    if removed and not entry:
        del optimizer.state[p]


# -- the loss scale <-> the GradScaler --------------------------------------------


def _check_between_iterations(scaler: Any, name: str) -> None:
    # GradScaler's own test before pickling: per-optimizer records exist from
    # unscale_()/step() until update() clears them.
    if getattr(scaler, "_per_optimizer_states", None):
        raise ValueError(
            f"{name} is in the middle of an iteration (unscale_ or step without update); "
            "migrate between iterations, after scaler.update()"
        )


def _check_scaler_type(scaler: Any) -> None:
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )


def _loss_scale_from(scaler: Any, loss_scale: LossScale | None) -> LossScale:
    if scaler is None:
        return NoOpLossScale() if loss_scale is None else loss_scale
    if loss_scale is not None:
        raise ValueError(
            "pass scaler or loss_scale, not both: with a GradScaler the loss scale is its state"
        )
    _check_scaler_type(scaler)
    if not scaler.is_enabled():
        return NoOpLossScale()
    _check_between_iterations(scaler, "scaler")
    sd = scaler.state_dict()
    tracker = int(sd["_growth_tracker"])
    if not 0 <= tracker < sd["growth_interval"]:
        raise ValueError(
            f"scaler's growth tracker ({tracker}) is not in [0, growth_interval = "
            f"{sd['growth_interval']})"
        )
    try:
        scale = DynamicLossScale(
            init_scale=sd["scale"],
            growth_factor=sd["growth_factor"],
            backoff_factor=sd["backoff_factor"],
            growth_interval=sd["growth_interval"],
            min_scale=_TINY32,
            max_scale=math.inf,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"scaler: {err}") from None
    return scale.replace(growth_count=tracker)


def _scaler_state(loss_scale: LossScale, scaler: Any) -> dict[str, Any] | None:
    """What ``scaler.load_state_dict`` gets (``None``: nothing to write), checked against it."""
    kind = type(loss_scale).__name__
    if scaler is not None:
        _check_scaler_type(scaler)
    if scaler is None or not scaler.is_enabled():
        if isinstance(loss_scale, NoOpLossScale):
            return None
        which = "scaler is None" if scaler is None else "scaler is disabled"
        raise ValueError(
            f"state.loss_scale is a {kind} but {which}: pass an enabled torch.amp.GradScaler "
            "to carry the scale over, or state.replace(loss_scale=ff.NoOpLossScale()) to drop it"
        )
    if not isinstance(loss_scale, DynamicLossScale):
        raise ValueError(
            f"state.loss_scale is a {kind}, which an enabled GradScaler cannot hold (it is "
            "always dynamic): pass a disabled GradScaler or scaler=None"
        )
    if loss_scale.hysteresis != 1:
        raise ValueError(
            f"state.loss_scale.hysteresis is {loss_scale.hysteresis}: GradScaler backs off on "
            "every overflow (hysteresis 1)"
        )
    _check_between_iterations(scaler, "scaler")
    settings = {
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
    }
    for key, value in settings.items():
        if getattr(loss_scale, key) != value:
            raise ValueError(
                f"state.loss_scale.{key} is {getattr(loss_scale, key)!r} but the scaler's "
                f"{key} is {value!r}"
            )
    return {
        "scale": float(loss_scale.loss_scale),
        **settings,
        "_growth_tracker": int(loss_scale.growth_count),
    }


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
    says: ``SGD`` becomes :func:`~functional_fp16.sgd` (momentum buffers, none
    before the first step: ``TraceState.initialized`` false), ``Adam`` becomes
    :func:`~functional_fp16.adam` (after ``add_decayed_weights`` for its L2
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
        builds: :func:`~functional_fp16.sgd`, :func:`~functional_fp16.adam`,
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
    masters = tree_leaves(state.master)
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
