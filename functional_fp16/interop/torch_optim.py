"""torch.optim's SGD, Adam and AdamW as this library's transforms and optimiser states, and back."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functional_fp16._util.tree import PyTree, tree_flatten, tree_unflatten
from functional_fp16.transforms.adam import AdamSpec, ScaleByAdamState, adam, adamw
from functional_fp16.transforms.base import ChainSpec, GradientTransformation, chain
from functional_fp16.transforms.sgd import (
    DecaySpec,
    LearningRateSpec,
    TraceSpec,
    TraceState,
    add_decayed_weights,
    sgd,
)

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
                nesterov=bool(h["nesterov"]),
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
        if trace.accumulator_format.kind != "float32":  # torch keeps FP32 buffers only
            return None
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
    if (
        moments.eps_root != 0.0
        or "float32" != moments.mu_format.kind
        or (moments.nu_format.kind != "float32")
    ):
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
