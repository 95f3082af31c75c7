"""The ``torch.func`` bridge: an ``nn.Module`` as pure functions of pytrees.

Three pieces turn an imperative module into the functional form the rest of
the library works on, and a fourth goes back::

    params, buffers = split_module(model)          # dicts of detached copies
    apply = make_apply(model, train=True, policy=policy)  # (params, buffers, *x) -> (out, buffers')
    grad_fn = scaled_grad_and_value(loss_fn, has_aux=True)
    grads, (loss, aux) = grad_fn(state.loss_scale, state.params, *batch)
    state = fp16_update(state, grads, loss=loss)
    model.load_state_dict(module_state_dict(model, state.master, buffers))

* :func:`split_module` copies a module's parameters and buffers into two flat
  dicts keyed by qualified name (``"conv1.weight"``), the keys
  ``torch.func.functional_call`` understands. Tied parameters appear once,
  under their first name.
* :func:`make_apply` returns a pure apply function built on
  ``torch.func.functional_call``. It runs a private, storage-free copy of the
  module, so neither the caller's module nor the tensors passed in are ever
  modified: buffers that the forward pass updates in place (BatchNorm's running
  statistics in training mode) are updated on fresh copies, which come back as
  the new buffers. Given a :class:`~functional_fp16.Policy` it also does the
  casting, with per-module policies (norm layers in float32 by default).
* :func:`scaled_grad_and_value` wraps ``torch.func.grad`` so that the loss is
  multiplied by the current loss scale before differentiation and the unscaled
  loss comes back alongside the (scaled) gradients, ready for
  :func:`~functional_fp16.fp16_update`. Its result has the shape of
  ``torch.func.grad_and_value``'s: ``(grads, loss)``, or ``(grads, (loss,
  aux))`` with ``has_aux=True``.
* :func:`module_state_dict` is the way back: the state dict that
  ``module.load_state_dict`` takes, with every alias of a tied parameter
  filled in.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from functional_fp16._util.tree import PyTree, check_like, describe_tensor
from functional_fp16.precision.policy import (
    ModulePolicies,
    Policy,
    cast_to,
    check_module_policies,
    default_module_policies,
    get_policy,
    module_policy,
)

__all__ = [
    "split_module",
    "make_apply",
    "scaled_grad_and_value",
    "module_state_dict",
    "write_params",
    "ApplyFn",
]

ApplyFn = Callable[..., tuple[Any, dict[str, torch.Tensor]]]
"""``apply(params, buffers, *args, **kwargs) -> (outputs, new_buffers)``."""


def _check_module(module: Any) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return module


def split_module(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Splits a module into a params dict and a buffers dict of detached copies.

    Keys are qualified names as in ``module.named_parameters()`` /
    ``module.named_buffers()``; a parameter tied to another (``a.weight is
    b.weight``) appears once, under the first name. The values are fresh
    tensors (``detach().clone()``) that share no memory with the module and do
    not require grad, so the module can be discarded or kept as it is.

    Args:
      module: any ``torch.nn.Module``.

    Returns:
      ``(params, buffers)``, two ``dict[str, Tensor]`` in registration order.
    """
    module = _check_module(module)
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return params, buffers


def _storage_free_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers live on the meta device.

    The copy keeps the module's structure, hooks, modes and tied weights (tied
    parameters map to one meta parameter) but allocates no tensor memory.
    """
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
        )
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(module, memo)
    except Exception as err:  # deepcopy of user modules can fail in many ways
        raise TypeError(
            f"make_apply could not copy the {type(module).__name__} module ({err}); "
            "modules passed to make_apply must support copy.deepcopy"
        ) from err


def _check_named(
    name: str, given: Any, expected: Mapping[str, torch.Tensor], *, module_name: str
) -> None:
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{name} must be a dict of tensors keyed by qualified name (as returned by "
            f"split_module), got {type(given).__name__}"
        )
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        raise KeyError(
            f"{name} does not match the {module_name} module's {name}: {'; '.join(parts)}"
        )
    if not expected:  # nothing to compare (and Dynamo cannot trace flattening an empty dict)
        return
    # Shapes and layouts, not dtypes or devices: any dtype may run the module,
    # and the references live on the meta device.
    check_like(
        expected,
        dict(given),
        name=name,
        reference_name=f"the {module_name} module's {name}",
        check_dtype=False,
        check_device=False,
    )


def _resolve_policy(policy: Any) -> Policy | None:
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return get_policy(policy)
    raise TypeError(
        f"policy must be a Policy, a policy string or None, got {type(policy).__name__}"
    )


def _cast_floating(x: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None or not isinstance(x, torch.Tensor):
        return x
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x


def _policy_in_scope(
    template: nn.Module, name: str, module_policies: dict[type[nn.Module], Policy]
) -> Policy | None:
    """The policy of the innermost module on ``name``'s path that has one, if any."""
    path = name.split(".")[:-1]
    for depth in range(len(path), -1, -1):
        found = module_policy(template.get_submodule(".".join(path[:depth])), module_policies)
        if found is not None:
            return found
    return None


def _install_module_policies(
    template: nn.Module, module_policies: dict[type[nn.Module], Policy]
) -> None:
    """Hooks on ``template``'s modules that have a policy: inputs in, outputs out cast."""
    for _, sub in template.named_modules():
        found = module_policy(sub, module_policies)
        if found is None:
            continue

        def cast_inputs(mod, args, kwargs, dtype=found.compute_dtype):
            return cast_to(args, dtype), cast_to(kwargs, dtype)

        def cast_outputs(mod, args, output, dtype=found.output_dtype):
            return cast_to(output, dtype)

        # First in, last out: the module's own hooks run inside its policy.
        sub.register_forward_pre_hook(cast_inputs, prepend=True, with_kwargs=True)
        sub.register_forward_hook(cast_outputs)


def make_apply(
    module: nn.Module,
    *,
    train: bool | None = None,
    policy: Policy | str | None = None,
    module_policies: ModulePolicies | None = None,
) -> ApplyFn:
    r"""A pure apply function for ``module``, built on ``torch.func.functional_call``.

    .. math:: (y, b') = f_{module}(\theta, b, x)

    The returned ``apply(params, buffers, *args, **kwargs)`` runs the module's
    ``forward(*args, **kwargs)`` with the given parameters and buffers and
    returns ``(outputs, new_buffers)``. ``new_buffers`` are copies of
    ``buffers`` on which the forward pass has made its in-place updates (e.g.
    BatchNorm's running statistics and ``num_batches_tracked`` in training
    mode); ``params``, ``buffers`` and the original module are never modified.
    Tied parameters are re-tied, so giving the tied tensor once (as
    :func:`split_module` does) updates every use of it.

    Without a ``policy`` nothing is cast: any parameter dtype runs (e.g. FP16
    parameters with FP32 inputs is the caller's choice). With one, ``apply``
    casts as jmp's policies do, all inside the differentiated function:

    * floating-point parameters to ``policy.compute_dtype`` (straight from the
      dtype they are given in, so gradients come back in that dtype);
    * floating-point positional and keyword inputs to ``policy.compute_dtype``;
    * floating-point outputs to ``policy.output_dtype``.

    ``module_policies`` maps module types to the policy their instances run
    under instead (looked up along the class's MRO, see
    :func:`~functional_fp16.module_policy`): such a module's inputs are cast to
    its policy's compute dtype on the way in (before its own forward
    pre-hooks), its outputs to its policy's output dtype on the way out (after
    its own forward hooks), and the parameters inside it (those of submodules
    without a policy of their own included) to its compute dtype. Its
    ``param_dtype`` is not used: the state fixes the storage dtype. Left as
    ``None`` it is :func:`~functional_fp16.default_module_policies` of
    ``policy``: with float16 or bfloat16 compute, the norm layers
    (:data:`~functional_fp16.NORM_MODULES`) compute in float32 and hand back
    the compute dtype, as under ``torch.autocast``; pass ``{}`` to switch
    that off. Buffers are never cast: keep the norm layers' running
    statistics in float32, as :func:`split_module` gives them for a float32
    module. A model without such modules computes bitwise what the manual
    ``apply(policy.cast_to_compute(params), buffers, policy.cast_to_compute(x))``
    followed by ``policy.cast_to_output`` computes.

    The function composes with ``torch.func.grad`` and ``vmap`` and compiles
    with ``torch.compile``.

    Args:
      module: the module; it is copied without its tensor storage when
        ``make_apply`` is called, so later changes to it (including
        ``.train()``/``.eval()`` and new hooks) do not affect ``apply``.
      train: run the copy in training (``True``) or evaluation (``False``)
        mode; ``None`` keeps each submodule's mode as it is now.
      policy: a :class:`~functional_fp16.Policy` or policy string (see
        :func:`~functional_fp16.get_policy`) to cast with; ``None`` casts
        nothing.
      module_policies: a mapping from module types to policies; ``None``:
        the defaults for ``policy`` (nothing without a policy).

    Returns:
      ``apply(params, buffers, *args, **kwargs) -> (outputs, new_buffers)``.
      It checks that ``params`` and ``buffers`` have exactly the module's keys
      and shapes (as dense tensors, of any dtype), and names the offending
      entry when they do not.
    """
    module = _check_module(module)
    if train is not None and not isinstance(train, bool):
        raise TypeError(f"train must be a bool or None, got {type(train).__name__}")
    policy = _resolve_policy(policy)
    if module_policies is None:
        module_policies = {} if policy is None else default_module_policies(policy)
    else:
        module_policies = check_module_policies(module_policies)
    template = _storage_free_copy(module)
    if train is not None:
        template.train(train)
    module_name = type(module).__name__
    param_refs = dict(template.named_parameters())
    buffer_refs = dict(template.named_buffers())
    # The compute dtype of each parameter, fixed now: no module lookups per call.
    default_dtype = None if policy is None else policy.compute_dtype
    param_dtypes: dict[str, torch.dtype | None] = {}
    for name in param_refs:
        scope = _policy_in_scope(template, name, module_policies)
        param_dtypes[name] = default_dtype if scope is None else scope.compute_dtype
    casts_params = any(d is not None for d in param_dtypes.values())
    _install_module_policies(template, module_policies)

    def apply(
        params: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        _check_named("params", params, param_refs, module_name=module_name)
        _check_named("buffers", buffers, buffer_refs, module_name=module_name)
        if casts_params:
            params = {k: _cast_floating(v, param_dtypes[k]) for k, v in params.items()}
        if policy is not None:
            args = cast_to(args, policy.compute_dtype)
            kwargs = cast_to(kwargs, policy.compute_dtype)
        # The forward pass may update buffers in place; it gets fresh copies.
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        outputs = torch.func.functional_call(
            template, (dict(params), new_buffers), args, kwargs, tie_weights=True, strict=False
        )
        if policy is not None:
            outputs = cast_to(outputs, policy.output_dtype)
        return outputs, new_buffers

    return apply


LossFn = Callable[..., Any]
GradFn = Callable[..., tuple[PyTree, Any]]


def _split_loss(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                "loss_fn was declared has_aux=True, so it must return a (loss, aux) pair, "
                f"got {type(out).__name__}"
            )
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        detail = describe_tensor(loss)
        hint = " (a tuple: did you mean has_aux=True?)" if isinstance(loss, tuple) else ""
        raise TypeError(
            f"loss_fn must return a 0-d floating-point tensor as the loss, got {detail}{hint}"
        )
    return loss, aux


def scaled_grad_and_value(loss_fn: LossFn, *, has_aux: bool = False) -> GradFn:
    r"""Gradients of the loss-scaled loss, with the unscaled loss, via ``torch.func.grad``.

    With :math:`L(\theta, \ldots)` the loss and :math:`s` the current loss scale:

    .. math::
        g = \nabla_\theta\, \big(s \cdot \operatorname{fl}_{32}(L(\theta, \ldots))\big)

    The returned ``grad_fn(loss_scale, params, *args, **kwargs)`` calls
    ``loss_fn(params, *args, **kwargs)``, scales the loss with
    ``loss_scale.scale`` (dynamic and static scales promote low-precision
    losses to float32 first, so the product cannot overflow; a
    :class:`~functional_fp16.NoOpLossScale` leaves the loss as it is) and
    differentiates with respect to ``params`` only. Like
    ``torch.func.grad_and_value`` it returns ``(grads, loss)``, or
    ``(grads, (loss, aux))`` when ``has_aux``:

    * ``grads`` — same tree, dtypes and devices as ``params`` (FP16 parameters
      give FP16 gradients of the *scaled* loss), which is exactly what
      :func:`~functional_fp16.fp16_update` expects;
    * ``loss`` — the *unscaled* loss as ``loss_fn`` returned it, detached; pass
      it as ``fp16_update(state, grads, loss=loss)`` so a non-finite loss skips
      the step;
    * ``aux`` — ``loss_fn``'s auxiliary output (e.g. logits and new buffers;
      like ``torch.func.grad``'s, a pytree of tensors).

    Every output is a tensor or a pytree of tensors, so
    ``torch.func.vmap(grad_fn, in_dims=(None, 0, ...))`` needs no ``out_dims``.
    Nothing is read back to the host, so the function runs without
    synchronising and compiles with ``torch.compile(fullgraph=True)``.

    Changed in this release, without a deprecation period (the library is
    pre-1.0): without ``has_aux`` the result used to be ``(grads, (loss,
    None))``; unpack ``grads, loss = grad_fn(...)`` now.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a 0-d floating
        tensor, or ``(loss, aux)`` when ``has_aux``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``grad_fn(loss_scale, params, *args, **kwargs)``, returning
      ``(grads, loss)``, or ``(grads, (loss, aux))`` when ``has_aux``.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {type(has_aux).__name__}")

    def grad_fn(loss_scale: Any, params: PyTree, *args: Any, **kwargs: Any) -> tuple[PyTree, Any]:
        if not callable(getattr(loss_scale, "scale", None)):
            raise TypeError(
                "grad_fn's first argument must be a loss scale (e.g. state.loss_scale), "
                f"got {type(loss_scale).__name__}"
            )

        def scaled_loss(p: PyTree) -> tuple[torch.Tensor, Any]:
            loss, aux = _split_loss(loss_fn(p, *args, **kwargs), has_aux)
            # torch.func passes only tensors through as auxiliary outputs.
            return loss_scale.scale(loss), ((loss.detach(), aux) if has_aux else loss.detach())

        return torch.func.grad(scaled_loss, has_aux=True)(params)

    return grad_fn


def write_params(module: nn.Module, params: Mapping[str, torch.Tensor]) -> nn.Module:
    r"""Writes ``params`` (e.g. ``state.params`` after a pure update) into ``module``'s own
    parameters, in place: :math:`p_{\text{module}} \leftarrow p` for every name.

    For a module sharded with FSDP2 (``fully_shard``) both sides are DTensors
    with the same placements, so each rank copies its local shard: no
    communication, and FSDP2 all-gathers the new values at the next forward
    pass. A donated update (``fp16_update(..., donate=True)``) of a state
    built from ``dict(module.named_parameters())`` has already written them,
    and a parameter that *is* the new tensor is skipped.

    Args:
      module: the module the parameters belong to.
      params: one tensor per ``module.named_parameters()`` name, of its shape
        (checked, naming the parameter).

    Returns:
      ``module``, for chaining.
    """
    module = _check_module(module)
    refs = dict(module.named_parameters())
    _check_named("params", params, refs, module_name=type(module).__name__)
    with torch.no_grad():
        for name, p in refs.items():
            new = params[name]
            if new is not p:
                p.copy_(new)
    return module


def module_state_dict(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The state dict ``module.load_state_dict`` takes, from :func:`split_module`-style dicts.

    The inverse of :func:`split_module`: ``params`` (and ``buffers``) hold one
    entry per tied group, under its first name; ``module.state_dict()`` names
    every alias (``embed.weight`` and ``head.weight`` when ``head.weight is
    embed.weight``), so each alias gets its group's tensor. Loading it copies
    into the module's own tensors, which keeps them tied (and casts, so the
    FP32 master or the FP16 working copy both load into an FP32 module)::

        model.load_state_dict(module_state_dict(model, state.master, buffers))

    Args:
      module: the module ``params`` and ``buffers`` were split from (or one
        of the same structure).
      params: its parameters keyed by qualified name, e.g. ``state.master``
        or ``state.params``; checked for exactly the module's names and shapes.
      buffers: its buffers likewise; ``None`` takes the module's own.

    Returns:
      A new ``dict`` with exactly ``module.state_dict()``'s keys, in its
      order; non-persistent buffers are left out, as ``state_dict`` leaves
      them, and extra state (``get_extra_state``) is the module's own.
    """
    module = _check_module(module)
    module_name = type(module).__name__
    param_refs = dict(module.named_parameters())
    _check_named("params", params, param_refs, module_name=module_name)
    firsts: dict[int, tuple[str, Mapping[str, torch.Tensor] | None]] = {}
    for name, p in param_refs.items():
        firsts[id(p)] = (name, params)
    if buffers is not None:
        buffer_refs = dict(module.named_buffers())
        _check_named("buffers", buffers, buffer_refs, module_name=module_name)
        for name, b in buffer_refs.items():
            firsts[id(b)] = (name, buffers)
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        name, source = firsts.get(id(value), (key, None))
        if source is not None:
            out[key] = source[name]
        else:  # the module's own buffer or extra state
            out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    return out
