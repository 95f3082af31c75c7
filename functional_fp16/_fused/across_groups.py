r"""What the groups of an update share on the plain kernels, done once for all of them.

A masked or labelled optimiser is one op call per group (``fused_plan``'s groups:
weight decay on some leaves, none on others). Each call would unscale and clip
its leaves' gradients (four multi-tensor launches), copy its state into its
fresh outputs (one) and refresh its working copies (four): on CUDA's default,
per group, the same launches again. Where every group's plain kernel only
*reads* its float32 gradients (PyTorch's fused optimiser kernels with
``grad_scale=None`` do not write them), the update does that work itself, once:

1. the unscaled, clipped gradients of every leaf,
   :math:`u = (\operatorname{fl}_{32}(g)\,\mathrm{inv} / c_d)\, c_m`, in one list
   (:func:`~functional_fp16._fused.plain_kernels.unscaled_lists`), which each
   group's op is given as float32 gradients with nothing left to apply;
2. a pure update copies the old state into its new buffers in one multi-tensor
   copy and steps the copies with the donated ops (a donated update steps its
   own state): the groups' ops write in place and copy nothing;
3. the ops step the masters only (every leaf passed as working on its master);
   then every working copy is refreshed from its new master in one pass
   (:func:`~functional_fp16._fused.plain_kernels.refresh_params`).

The arithmetic is each op's own, element for element: the same ``u``, the same
kernel, the same decision, the same selects, so the result is bitwise each op
called whole. With one group the launches are the op's own; what changes is a
donated update's memory: it rounds the working copies into the memory of the
spent gradients ``u`` (its own, or donated float32 gradients it was handed with
nothing to unscale, as ``MultiSteps`` hands its mean) instead of a 2-byte
temporary, so its transient memory is ``u`` alone (4 B a parameter, none where
``u`` is the donated gradients). It applies in plain eager mode only: under
``torch.compile``, ``vmap`` or a dispatch mode each group's op is called whole,
as everywhere else.
"""

from __future__ import annotations

from typing import Any

import torch

from functional_fp16._fused import op_library, plain_kernels
from functional_fp16._fused.op_checks import first_overlap
from functional_fp16.precision.master_split import holds_residuals

__all__ = ["applies", "state_copies", "donated_room", "refresh"]


def applies(fp: Any, masters: list[torch.Tensor]) -> bool:
    """Whether the update of plan ``fp`` does its groups' common work itself (the
    module's steps): every group's plain kernel reads float32 gradients without a copy
    (``Fusable.reads_unscaled``), plain tensors on the plain kernels, a float32 master,
    plain eager mode."""
    if op_library._transformed():  # (first: a trace asks no kernel, it may load one)
        return False
    if any(g.fusable.reads_unscaled is None or not g.fusable.reads_unscaled(g.plan)
           for g in fp.groups):  # fmt: skip
        return False
    first = masters[0]
    return (
        type(first) is torch.Tensor
        and op_library.kernel_for(first.device) == "generic"
        and not holds_residuals(masters)
    )


def state_copies(fp: Any, masters: list, opt: list) -> tuple[list, list]:
    """``(masters, opt)`` with every master and every per-leaf state the groups step
    copied into new tensors, in one multi-tensor copy (a pure update's new state, which
    the donated ops then step in place); the 0-d state is the old one (read only)."""
    positions = sorted({i for g in fp.groups for _, pos in g.roles for i in pos if i >= 0})
    old = masters + [opt[i] for i in positions]
    new = [torch.empty_like(x) for x in old]
    torch._foreach_copy_(new, old)
    new_opt = list(opt)
    for i, t in zip(positions, new[len(masters) :]):
        new_opt[i] = t
    return new[: len(masters)], new_opt


def donated_room(fp: Any, grads: list, params: list) -> list | None:
    """The donated float32 ``grads`` as room for the refresh's rounding of the working
    copies (``None`` where no leaf has one), after refusing them where the memory of a
    leaf's gradient, written there, overlaps another such gradient's or a working copy's
    (both are written); errors name the leaves by their position."""
    own = _own(fp)
    if not own:
        return None
    found = first_overlap([grads[i] for i in own] + [params[i] for i in own])
    if found is not None:
        where = [f"grads[{i}]" for i in own] + [f"params[{i}]" for i in own]
        raise ValueError(
            f"fp16_update: {where[found[0]]} and {where[found[1]]} share memory; the donated "
            "update writes both in place"
        )
    return grads


def _own(fp: Any) -> list[int]:
    """The leaves whose working copy is its own tensor (not the master), in order."""
    return sorted(i for g in fp.groups for i, s in zip(g.leaves, g.separate) if s)


def refresh(fp: Any, apply, new_masters: list, params: list, donate: bool, spent=None) -> list:
    """The working copies after the step: each leaf's that is its own tensor rounded from
    its new master where ``apply`` (the old bits where the step is skipped), in one pass
    over every leaf; a leaf without one is its master. New tensors for a pure update,
    ``params`` written in place for a donated one, which rounds into the memory of
    ``spent`` (the float32 gradients the ops read, where they are the update's own or
    donated) instead of a temporary."""
    own = _own(fp)
    new_params = list(new_masters)
    old = [params[i] for i in own]
    out = old if donate else [torch.empty_like(p) for p in old]
    scratch = None if spent is None else [spent[i] for i in own]
    plain_kernels.refresh_params(apply, [new_masters[i] for i in own], old, out, scratch)
    for i, p in zip(own, out):
        new_params[i] = p
    return new_params
