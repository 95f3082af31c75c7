"""``fp16_update`` under ``torch.func.vmap``: an ensemble of FP16 states, member by member.

``torch.func.vmap(fp16_update)(stacked_state, stacked_grads)`` trains K models
at once, each with its own loss scale, skip decision and counters. Inside
``vmap`` the update sees batched tensors, which the fused kernels (raw
pointers) and the multi-tensor path (``torch._foreach_*``, without batching
rules) cannot take. So the update declares its own batching rule, through a
``torch.autograd.Function`` with a ``vmap`` staticmethod: the step runs once
per member on that member's slices, with the implementation it would run
unbatched, and the results are stacked. A vmapped update is therefore
bitwise K unbatched updates: a member that overflows skips alone, and its
loss scale backs off alone.

The cost is K calls of the update (each one pass over that member's memory);
what an ensemble gains from ``vmap`` is in the forward and backward passes,
which run as one batched computation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from functional_fp16._util.multi_tensor import is_batched
from functional_fp16._util.tree import PyTree, first_difference, tree_flatten, tree_unflatten

__all__ = ["tree_stack", "tree_unstack", "is_batched", "per_member"]


def tree_stack(trees: Sequence[PyTree]) -> PyTree:
    r"""Stacks K trees of one structure leaf by leaf: :math:`x \mapsto [x_1, \dots, x_K]` along a new dim 0.

    The input of ``torch.func.vmap``: ``tree_stack([fp16_init(p_k, tx) for p_k
    in members])`` is an ensemble state. Static configuration must be the
    same for every member (build ``tx`` once and pass it to each
    ``fp16_init``; loss scales with equal settings).

    Raises:
      ValueError: ``trees`` is empty, or a tree's structure or static
        configuration differs from the first's (the message names the path).
    """
    trees = list(trees)
    if not trees:
        raise ValueError("tree_stack needs at least one tree")
    first, spec = tree_flatten(trees[0])
    columns = [first]
    for i, tree in enumerate(trees[1:], 1):
        leaves, other = tree_flatten(tree)
        if other != spec:
            where = first_difference(trees[0], tree)
            at = f" at {where[0]} ({where[1]})" if where else ""
            raise ValueError(
                f"trees[{i}] differs from trees[0]{at}; members of a stack need one structure "
                "and the same static configuration (build tx once and share it)"
            )
        columns.append(leaves)
    return tree_unflatten(spec, [torch.stack(xs) for xs in zip(*columns)])


def tree_unstack(tree: PyTree) -> list[PyTree]:
    """The inverse of :func:`tree_stack`: K trees, each leaf a copy of one slice along dim 0.

    Raises:
      ValueError: a leaf is not a tensor with a leading dimension shared by all.
    """
    leaves, spec = tree_flatten(tree)
    sizes = {x.shape[0] if isinstance(x, torch.Tensor) and x.ndim else None for x in leaves}
    if not leaves or len(sizes) != 1 or None in sizes:
        raise ValueError(
            "tree_unstack needs tensor leaves that share a leading (member) dimension, got "
            f"leading sizes {sorted(sizes, key=str)}"
        )
    k = sizes.pop()
    return [tree_unflatten(spec, [x[i].clone() for x in leaves]) for i in range(k)]


def _slice(x: torch.Tensor, dim: int | None, k: int) -> torch.Tensor:
    if dim is None:
        return x
    member = x.select(dim, k)
    return member if member.is_contiguous() else member.contiguous()


class _EachMember(torch.autograd.Function):
    """``forward(run, *leaves)``: ``run(leaves)``; under ``vmap``: ``run`` once per member, stacked."""

    generate_vmap_rule = False

    @staticmethod
    def forward(run: Callable[[list[torch.Tensor]], list[torch.Tensor]], *leaves: torch.Tensor):
        return tuple(run(list(leaves)))

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def vmap(info: Any, in_dims: tuple, run: Callable, *leaves: torch.Tensor):
        dims = in_dims[1:]
        members = [
            run([_slice(x, d, k) for x, d in zip(leaves, dims)]) for k in range(info.batch_size)
        ]
        out = tuple(torch.stack(column) for column in zip(*members))
        return out, (0,) * len(out)


def per_member(fn: Callable[..., PyTree], *trees: PyTree) -> PyTree:
    """``fn(*trees)`` with a batching rule: under ``vmap``, ``fn`` runs once per member.

    ``trees`` are pytrees of tensors (``None`` subtrees allowed); ``fn`` returns
    a pytree of tensors whose structure does not depend on the member.
    """
    leaves, spec = tree_flatten(trees)
    out_spec: list[Any] = []

    def run(member_leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        out_leaves, s = tree_flatten(fn(*tree_unflatten(spec, member_leaves)))
        if not out_spec:
            out_spec.append(s)
        return out_leaves

    out = _EachMember.apply(run, *leaves)
    return tree_unflatten(out_spec[0], list(out))
