"""How a fused optimiser step becomes ``torch.library`` ops: one builder for every optimiser.

:func:`define_step` turns a :class:`~functional_fp16._fused.step_schema.StepSpec`
into two ops in the ``functional_fp16`` namespace: the functional ``<name>``
that returns fresh tensors and the donated ``<name>_`` that writes its state
arguments in place (declared in its schema, ``Tensor(a!)[]``; the argument
conventions are ``step_schema``'s). Each gets one Python kernel for every
device, a fake (meta) kernel and a ``vmap`` rule (``vmap_rules``). The
kernel checks its arguments (``op_checks``), asks :func:`kernel_for` which
kernel runs on the gradients' device (the compiled C library on the CPU,
plain PyTorch on CUDA, on any other device and where no compiler exists) and runs it (``device_kernels``). ``kernel_for`` is
looked up in this module when an op runs, so this one name decides for every
op. :data:`grad_stats` is the gradient reduction every fused step shares.

A skipped group's outputs are bitwise its inputs. No op reads a value on the
host, so they run under ``torch.compile`` (Inductor calls them as extern
kernels), in CUDA graphs and under ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_fp16._fused.device_kernels import (
    cpp_ready,
    cpp_stats,
    cpp_step,
    kernel_for,
    run_step,
    stats,
)
from functional_fp16._fused.memory import fresh_like
from functional_fp16._fused.op_checks import (
    _check_disjoint,
    _check_grads,
    _check_group,
    _check_step,
    fail,
)
from functional_fp16._fused.step_schema import (
    COMMON_SCALARS,
    NS,
    StepSpec,
    arg_names,
    schema,
    working_copies,
)
from functional_fp16._fused.vmap_rules import by_member, by_member_all, vmap_rule

__all__ = ["StepOps", "call_grad_stats", "define_step", "grad_stats"]

_LIB = torch.library.Library(NS, "DEF")
"""The ``functional_fp16`` namespace of ops; every op is defined through it."""


def _define(name: str, schema: str, kernel: Callable, fake: Callable, rule: Callable | None):
    """Defines the op ``functional_fp16::<name>``: its schema, one Python kernel for every
    device (it picks the device's kernel itself, see :func:`kernel_for`), its fake kernel
    and its ``vmap`` rule. Returns the op (an ``OpOverload``)."""
    _LIB.define(name + schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.functional_fp16, name).default
    if rule is not None:
        torch.library.register_vmap(op, rule(op), lib=_LIB)
    return op


_PLAIN = frozenset({Tensor})


def _transformed() -> bool:
    """Whether an op call would pass through more than its kernel: a ``torch.compile``
    trace, a functorch transform (``vmap``, ``grad``), a torch-function or dispatch mode."""
    return (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
    )


def _direct(spec: StepSpec | None, lists: list[list]) -> bool:
    """Whether an op's dispatch would reach the C++ op unchanged: plain eager mode (see
    :func:`_transformed`), the CPU's C++ kernel for ``spec``, plain tensors in ``lists``
    (the first holds the gradients)."""
    grads = lists[0]
    return (
        bool(grads)
        and not _transformed()
        and cpp_ready(spec, kernel_for(grads[0].device))
        and all(set(map(type, xs)) <= _PLAIN for xs in lists)
    )


# ---------------------------------------------------------------------------
# grad_stats
# ---------------------------------------------------------------------------


def _grad_stats(
    grads: list[Tensor], inv: Tensor | None, groups: int, members: int, sum_squares: bool
) -> tuple[Tensor, Tensor]:
    r"""Per leaf the gradient's peak magnitude; per group the sum of squares of the
    unscaled gradients.

    .. math:: M_l = \max_{i \in l} |g_i|, \qquad
              S_k = \textstyle\sum_{i \in k} \big(\operatorname{fl}_{32}(g_i)\, s_k^{-1}\big)^2

    ``M_l`` is ``+inf`` if any element is inf or NaN (0 for an empty leaf);
    ``S_k`` is accumulated in float64 (zeros unless ``sum_squares``). Returns
    ``(M, S)``: ``M`` of shape ``(members * len(grads),)`` (member-major), ``S``
    of shape ``(groups,)``.
    """
    if grads and isinstance(grads[0], Tensor) and cpp_ready(None, kernel_for(grads[0].device)):
        try:
            return cpp_stats(grads, inv, groups, members, sum_squares)
        except RuntimeError:
            _checked_stats(grads, inv, groups, members)  # raises what is wrong, by name
            raise
    _checked_stats(grads, inv, groups, members)
    return stats(grads, inv, groups, members, sum_squares, kernel_for(grads[0].device))


def _checked_stats(grads, inv, groups, members) -> None:
    _check_grads("grad_stats", grads, members)
    if groups < 1 or groups % members or len(grads) % (groups // members):
        fail("grad_stats", f"{len(grads)} leaves of {members} member(s) in {groups} groups")
    _check_group("grad_stats", "inv", inv, groups, torch.float32, grads[0].device)


def _grad_stats_fake(grads, inv, groups, members, sum_squares):
    device = grads[0].device
    return (
        torch.empty(len(grads) * members, dtype=torch.float32, device=device),
        torch.empty(groups, dtype=torch.float64, device=device),
    )


grad_stats = _define(
    "grad_stats",
    "(Tensor[] grads, Tensor? inv, int groups, int members, bool sum_squares) -> (Tensor, Tensor)",
    _grad_stats,
    _grad_stats_fake,
    lambda op: vmap_rule(
        op,
        ["grads", "inv", "groups", "members", "sum_squares"],
        ("grads",),
        ("inv",),
        (),
        lambda out, size, members: ((out[0].reshape(size, -1), out[1].reshape(size, -1)), (0, 0)),
    ),
)
"""``functional_fp16::grad_stats``: see :func:`_grad_stats`."""


def call_grad_stats(grads, inv, groups: int, members: int, sum_squares: bool):
    """``grad_stats`` on these arguments; in plain eager mode on the CPU (see
    ``call`` in :func:`define_step`) its C++ op directly."""
    if _direct(None, [grads]):
        return _grad_stats(grads, inv, groups, members, sum_squares)
    return grad_stats(grads, inv, groups, members, sum_squares)


# ---------------------------------------------------------------------------
# Step ops.
# ---------------------------------------------------------------------------


class StepOps(NamedTuple):
    """A step's two ops and the call that runs one of them (see ``call`` in :func:`define_step`)."""

    functional: Any  # functional_fp16::<name>: fresh outputs
    donated: Any  # functional_fp16::<name>_: written into its state arguments
    call: Callable[[bool, dict], Any]  # call(donated, arguments by name)


def define_step(spec: StepSpec, doc: str) -> StepOps:
    """The functional and the donated op of ``spec`` (with fake kernels and ``vmap`` rules),
    and the call that runs them."""
    names = arg_names(spec)

    def via_cpp(a: dict, donated: bool) -> Any:
        """The C++ op's outputs; a refusal is explained by the Python checks, by name."""
        try:
            return cpp_step(spec, a, donated)
        except RuntimeError:
            op = spec.name + ("_" if donated else "")
            used = _check_step(op, spec, a)
            if donated:
                _check_disjoint(op, a, ["master", *used, "params"])
            raise

    def functional(*args):
        a = dict(zip(names, args))
        if a["grads"] and isinstance(a["grads"][0], Tensor):
            if cpp_ready(spec, kernel_for(a["grads"][0].device)):
                return tuple(via_cpp(a, donated=False))
        used = _check_step(spec.name, spec, a)
        # One request for every output: the pool then keeps the dropped state's
        # buffers (as many as this step takes) for the next step.
        written = ["master", *[s for s in spec.states if s in used], "params"]
        fresh = iter(fresh_like([x for n in written for x in a[n]]))
        out = {n: [next(fresh) for _ in a[n]] for n in written}
        out.update({s: [] for s in spec.states if s not in used})
        fresh_params = out["params"]
        out["params"] = working_copies(out["master"], fresh_params, a["separate"])
        kernel = kernel_for(a["grads"][0].device)
        finite, leaves = run_step(spec, a, used, out, kernel, speculate=True)
        return (out["master"], *[out[s] for s in spec.states], fresh_params, finite, leaves)

    def donated(*args):
        a = dict(zip(names, args))
        if a["grads"] and isinstance(a["grads"][0], Tensor):
            if cpp_ready(spec, kernel_for(a["grads"][0].device)):
                return tuple(via_cpp(a, donated=True)[-2:])
        used = _check_step(spec.name + "_", spec, a)
        _check_disjoint(spec.name + "_", a, ["master", *used, "params"])
        out = {"master": a["master"], **{s: a[s] for s in spec.states}}
        out["params"] = working_copies(a["master"], a["params"], a["separate"])
        kernel = kernel_for(a["grads"][0].device)
        return run_step(spec, a, used, out, kernel, speculate=False)

    def call(donated: bool, a: dict) -> Any:
        """The op (``donated``: the donated one) on the arguments ``a``, by name.

        Where the op's dispatch would go straight to its kernel and that
        kernel to the C++ op (plain eager mode: no ``torch.compile`` trace,
        no ``vmap`` or other functorch transform, no torch-function or
        dispatch mode; plain CPU tensors), the C++ op is called directly:
        the same kernel and checks, without converting every list through
        the outer op's dispatch twice.
        """
        if _direct(spec, [a[n] for n in lists]):
            out = via_cpp(a, donated)
            return tuple(out[-2:]) if donated else tuple(out)
        return (op_ if donated else op)(*[a[n] for n in names])

    functional.__doc__ = doc
    donated.__doc__ = (
        f"``{spec.name}`` written into its state arguments (donation); returns "
        "``(finite, leaf_finite)``."
    )
    mutated = ("master", *spec.states, "params")

    def decisions(a: dict) -> tuple[Tensor, Tensor]:
        lr = a["lr"]
        n = 0 if a["apply"] is not None else len(a["grads"]) * a["members"]
        return (
            torch.empty(lr.shape, dtype=torch.bool, device=lr.device),
            torch.empty(n, dtype=torch.bool, device=lr.device),
        )

    def fake(*args):
        a = dict(zip(names, args))
        lists = [[torch.empty_like(x) for x in a[n]] for n in ("master", *spec.states, "params")]
        return (*lists, *decisions(a))

    def fake_(*args):
        return decisions(dict(zip(names, args)))

    lists = ("grads", "master", *spec.states, "params")
    scalars = (*COMMON_SCALARS, *spec.scalars)
    op = _define(
        spec.name,
        schema(spec, False),
        functional,
        fake,
        lambda op: vmap_rule(op, names, lists, scalars, (), by_member_all),
    )
    op_ = _define(
        spec.name + "_",
        schema(spec, True),
        donated,
        fake_,
        lambda op: vmap_rule(op, names, lists, scalars, mutated, by_member),
    )
    return StepOps(op, op_, call)
