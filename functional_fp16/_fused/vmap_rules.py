"""The ops' ``vmap`` rules: ``K`` members become ``K`` more groups of the same call.

Under ``vmap`` an op batches inside itself rather than being called once per
member: a batched list argument becomes a leaf that holds ``K`` times as many
members along its first dimension (merged with the members it already holds,
so a nested ``vmap`` stacks members on members), a batched per-group scalar
becomes ``K`` times as many groups, and the outputs are split by member again.
A donated op's state arguments must be batched and their members consecutive
blocks of one tensor (it writes them in place); the functional op copies where
they are not.
"""

from __future__ import annotations

from torch import Tensor

from functional_fp16._fused.step_schema import NS
from functional_fp16._kernels.signatures import dense, members_outermost

__all__ = ["vmap_rule", "by_member", "by_member_all"]


def _batched_first(
    x: Tensor, dim: int | None, size: int, members: int, name: str, mutated: bool
) -> Tensor:
    """``x`` with the vmapped dimension first and merged with the ``members`` it holds.

    The result holds ``size * members`` members as consecutive blocks along its
    first dimension (a nested ``vmap`` stacks members on members).
    """
    if dim is None:
        if mutated:
            raise ValueError(
                f"{NS}: under vmap, {name} is written in place but is not batched; "
                "batch every state tensor, or use the pure update"
            )
        x = x.unsqueeze(0).expand(size, *x.shape).contiguous()
    else:
        x = x.movedim(dim, 0)
        if not (dense(x) and members_outermost(x, size)):
            if mutated:
                raise ValueError(
                    f"{NS}: under vmap, {name} is written in place but its members are not "
                    "consecutive blocks of one tensor; use the pure update"
                )
            x = x.contiguous()
    if members == 1:
        return x
    if not mutated:
        return x.reshape(size * members, *x.shape[2:])
    try:
        return x.view(size * members, *x.shape[2:])
    except RuntimeError as err:
        raise ValueError(
            f"{NS}: under nested vmap, {name} is written in place but its members are not "
            "consecutive blocks of one tensor; use the pure update"
        ) from err


def by_member(out, size: int, members: int):
    """The donated op's outputs (the decision and the leaf flags) with the vmapped
    dimension split off again."""
    finite, leaves = out
    return (finite.reshape(size, -1), leaves.reshape(size, -1)), (0, 0)


def by_member_all(out, size: int, members: int):
    """The functional op's outputs with the vmapped dimension split off again."""
    *lists, finite, leaves = out
    if members > 1:
        lists = [[x.reshape(size, members, *x.shape[1:]) for x in xs] for xs in lists]
    return (*lists, finite.reshape(size, -1), leaves.reshape(size, -1)), (*([0] * len(lists)), 0, 0)


def vmap_rule(op, names, lists, scalars, mutated, outputs):
    """A batching rule: batched lists become more members, batched scalars more groups."""

    def rule(info, in_dims, *args):
        size = info.batch_size
        values, dims = dict(zip(names, args)), dict(zip(names, in_dims))
        members = values["members"]
        for key in lists:
            xs, ds = values[key], dims[key]
            ds = ds if isinstance(ds, (list, tuple)) else [ds] * len(xs)
            values[key] = [
                _batched_first(x, d, size, members, f"{key}[{i}]", key in mutated)
                for i, (x, d) in enumerate(zip(xs, ds))
            ]
        for key in scalars:
            x, d = values[key], dims[key]
            if x is not None:
                x = x.movedim(d, 0) if d is not None else x.unsqueeze(0).expand(size, *x.shape)
                values[key] = x.reshape(-1).contiguous()
        if "groups" in values:
            values["groups"] = values["groups"] * size
        values["members"] = members * size
        return outputs(op(*[values[n] for n in names]), size, members)

    return rule
