"""The ``torch.func`` bridge: an ``nn.Module`` as pure functions of pytrees.

Three pieces turn an imperative module into the functional form the rest of
the library works on::

    params, buffers = split_module(model)          # dicts of detached copies
    apply = make_apply(model, train=True)          # (params, buffers, *x) -> (out, buffers')
    grad_fn = scaled_grad_and_value(loss_fn, has_aux=True)
    grads, (loss, aux) = grad_fn(state.loss_scale, state.params, *batch)
    state = fp16_update(state, grads, loss=loss)

* :func:`split_module` copies a module's parameters and buffers into two flat
  dicts keyed by qualified name (``"conv1.weight"``), the keys
  ``torch.func.functional_call`` understands. Tied parameters appear once,
  under their first name.
* :func:`make_apply` returns a pure apply function built on
  ``torch.func.functional_call``. It runs a private, storage-free copy of the
  module, so neither the caller's module nor the tensors passed in are ever
  modified: buffers that the forward pass updates in place (BatchNorm's running
  statistics in training mode) are updated on fresh copies, which come back as
  the new buffers.
* :func:`scaled_grad_and_value` wraps ``torch.func.grad`` so that the loss is
  multiplied by the current loss scale before differentiation and the unscaled
  loss comes back alongside the (scaled) gradients, ready for
  :func:`~functional_fp16.fp16_update`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from functional_fp16._tree import PyTree, check_like, describe_tensor

__all__ = [
    "split_module",
    "make_apply",
    "scaled_grad_and_value",
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


def make_apply(module: nn.Module, *, train: bool | None = None) -> ApplyFn:
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

    The function works with any parameter dtype (e.g. FP16 parameters with
    FP32 inputs is the caller's choice; see :class:`~functional_fp16.Policy`),
    composes with ``torch.func.grad`` and compiles with ``torch.compile``.

    Args:
      module: the module; it is copied without its tensor storage when
        ``make_apply`` is called, so later changes to it (including
        ``.train()``/``.eval()``) do not affect ``apply``.
      train: run the copy in training (``True``) or evaluation (``False``)
        mode; ``None`` keeps each submodule's mode as it is now.

    Returns:
      ``apply(params, buffers, *args, **kwargs) -> (outputs, new_buffers)``.
      It checks that ``params`` and ``buffers`` have exactly the module's keys
      and shapes (as dense tensors, of any dtype), and names the offending
      entry when they do not.
    """
    module = _check_module(module)
    if train is not None and not isinstance(train, bool):
        raise TypeError(f"train must be a bool or None, got {type(train).__name__}")
    template = _storage_free_copy(module)
    if train is not None:
        template.train(train)
    module_name = type(module).__name__
    param_refs = dict(template.named_parameters())
    buffer_refs = dict(template.named_buffers())

    def apply(
        params: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        _check_named("params", params, param_refs, module_name=module_name)
        _check_named("buffers", buffers, buffer_refs, module_name=module_name)
        # The forward pass may update buffers in place; it gets fresh copies.
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        outputs = torch.func.functional_call(
            template, (dict(params), new_buffers), args, kwargs, tie_weights=True, strict=False
        )
        return outputs, new_buffers

    return apply


LossFn = Callable[..., Any]
GradFn = Callable[..., tuple[PyTree, tuple[torch.Tensor, Any]]]


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
    :class:`~functional_fp16.NoOpLossScale` leaves the loss as it is),
    differentiates with respect to ``params`` only and returns
    ``(grads, (loss, aux))``:

    * ``grads`` — same tree, dtypes and devices as ``params`` (FP16 parameters
      give FP16 gradients of the *scaled* loss), which is exactly what
      :func:`~functional_fp16.fp16_update` expects;
    * ``loss`` — the *unscaled* loss as ``loss_fn`` returned it, detached; pass
      it as ``fp16_update(state, grads, loss=loss)`` so a non-finite loss skips
      the step;
    * ``aux`` — ``loss_fn``'s auxiliary output when ``has_aux`` (e.g. logits and
      new buffers; like ``torch.func.grad``'s, a pytree of tensors), else ``None``.

    Nothing is read back to the host, so the function runs without
    synchronising and compiles with ``torch.compile(fullgraph=True)``.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a 0-d floating
        tensor, or ``(loss, aux)`` when ``has_aux``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``grad_fn(loss_scale, params, *args, **kwargs) -> (grads, (loss, aux))``.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {type(has_aux).__name__}")

    def grad_fn(
        loss_scale: Any, params: PyTree, *args: Any, **kwargs: Any
    ) -> tuple[PyTree, tuple[torch.Tensor, Any]]:
        if not callable(getattr(loss_scale, "scale", None)):
            raise TypeError(
                "grad_fn's first argument must be a loss scale (e.g. state.loss_scale), "
                f"got {type(loss_scale).__name__}"
            )

        def scaled_loss(p: PyTree) -> tuple[torch.Tensor, tuple[Any, ...]]:
            loss, aux = _split_loss(loss_fn(p, *args, **kwargs), has_aux)
            # torch.func passes only tensors through as auxiliary outputs.
            return loss_scale.scale(loss), ((loss.detach(), aux) if has_aux else (loss.detach(),))

        grads, extra = torch.func.grad(scaled_loss, has_aux=True)(params)
        loss, aux = extra if has_aux else (extra[0], None)
        return grads, (loss, aux)

    return grad_fn
