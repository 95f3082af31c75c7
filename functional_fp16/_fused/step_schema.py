"""What a fused step op is: its declaration (:class:`StepSpec`) and its schema.

Conventions of every step op (the schema's argument order)::

    grads, master, <states...>, params, separate,
    inv, clip_div, clip_mul, lr, apply, require, <scalars...>, <hyperparameters...>, members

* ``grads``, ``master`` and each per-parameter FP32 state are lists with one
  tensor per leaf; ``params`` holds the working copies of the leaves whose
  ``separate`` flag is set (a leaf without one works on its FP32 master);
* every per-step scalar is a 1-d tensor with one entry per *group* (``lr``
  gives the count ``G``): leaf ``l`` of member ``b`` belongs to group
  ``b * G0 + l // (L // G0)``, ``G0 = G / members``. A plain update is one
  member and one group; under ``vmap`` ``K`` members are ``K`` more groups of
  the same call, each with its own scale, decision and counters;
* ``apply=None``: the op decides itself, a group applies when all its unscaled
  gradients are finite and ``require`` (if given) holds; a given ``apply`` is
  the decision (still ANDed with ``require``). The decision is returned, and
  with it ``leaf_finite``: where the op decided, per leaf of each member
  (``members * L`` flags, member-major) whether that leaf's unscaled gradient
  is finite, found in the same pass over the gradients; where it was given
  ``apply`` it does not look at them, and ``leaf_finite`` is empty.

The functional op ``<name>`` returns fresh tensors; the donated ``<name>_``
writes its state arguments in place, declared in its schema (``Tensor(a!)[]``),
and returns ``(finite, leaf_finite)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

__all__ = [
    "NS",
    "COMMON_SCALARS",
    "BOOL_SCALARS",
    "StepSpec",
    "schema",
    "arg_names",
    "working_copies",
]

NS = "functional_fp16"
"""The namespace of the ops (``functional_fp16::<name>``)."""
COMMON_SCALARS = ("inv", "clip_div", "clip_mul", "lr", "apply", "require")
"""The per-group scalars every step op takes, before its own."""
BOOL_SCALARS = ("apply", "require")
"""Which of :data:`COMMON_SCALARS` are bool."""


class StepSpec(NamedTuple):
    """A fused optimiser step, declared once; ``op_library.define_step`` makes its ops."""

    name: str  # the functional op's name; the donated one adds "_"
    states: tuple[str, ...]  # per-parameter FP32 state lists, e.g. ("trace",)
    scalars: tuple[str, ...]  # per-group scalars after the common ones, e.g. ("started",)
    bool_scalars: tuple[str, ...]  # which of ``scalars`` are bool
    hyper: tuple[tuple[str, str], ...]  # fixed hyperparameters: (name, schema type)
    entry: str  # the C kernel's ctypes entry (signatures.py); "" for none (its C++ op only)
    check: Callable[[str, dict], list[str]]  # optimiser checks; returns the states in use
    kernel_args: Callable[[dict, list[str]], dict]  # op arguments -> the kernel's keywords
    generic: Callable[..., None]  # the plain PyTorch kernel (the kernel's keywords + members)
    c_extra: dict[str, Any] = {}  # keywords only the C entry takes, as a decided step passes them
    # The C entry can run a pure step before its decision: apply=None, then it decides
    # (require, decided_out) and undoes the groups that skip, in the same call.
    speculative: bool = False
    # The C++ op that runs the step on the CPU (functional_fp16_cpu::<cpp_op>, see
    # _kernels/cpu.py) and its trailing hyperparameters, from the op's arguments.
    cpp_op: str = ""
    cpp_hyper: Callable[[dict], tuple] | None = None
    # The C entry takes one argument block (fused_step.h): it runs through the generic C++
    # op functional_fp16_cpu::step, found there by the name cpp_op, with cpp_hyper as its
    # `hyper` array. Without the C++ op library such a step runs the plain kernel.
    c_block: bool = False
    # Which of ``scalars`` are int64 (a step count).
    int_scalars: tuple[str, ...] = ()
    # State lists that are not laid out like the leaves (the block scales of coded moments):
    # ``check`` checks them; the op's common checks leave them alone.
    side: tuple[str, ...] = ()
    # The dtypes the states laid out like the leaves may have (float32 unless stored).
    state_dtypes: tuple = ()
    # A step with stored states: the C kernel's name for it ("adam_stored"), run through the
    # C++ op functional_fp16_cpu::stored_step, and the state coded through its root (-1:
    # none). Its op takes int scalar ``count`` and hyperparameters ``block_size``,
    # ``rounding`` and ``salt_ids``.
    stored: str = ""
    root_state: int = -1
    # A split master on the plain kernels (CUDA's default): the step of the stored-state op
    # that takes this one's float32 states, called with the kernel's keywords (+ members,
    # apply, used); it returns False where it does not apply (the master is then joined,
    # stepped and split around ``generic``). None: always so.
    split_generic: Callable[..., bool] | None = None
    # Kernel keywords and scalars only the plain kernel takes (PyTorch's fused optimiser
    # kernels read them); the C entry and the C++ op are called without them.
    generic_only: tuple[str, ...] = ()
    # The arguments the C kernels need from those the plain kernel's form gives (the bias
    # corrections from a step count): op arguments by name -> the same, completed.
    for_c: Callable[[dict], dict] | None = None


def schema(spec: StepSpec, donated: bool) -> str:
    """The op's schema: the functional op's, or the donated one's (state lists ``(x!)``)."""
    marks = iter("abcdefghijklmnopqrstuvwxyz")
    mutable = ["master", *spec.states, "params"]

    def lst(name: str) -> str:
        return (
            f"Tensor({next(marks)}!)[] {name}"
            if donated and name in mutable
            else f"Tensor[] {name}"
        )

    parts = [lst("grads"), lst("master"), *[lst(s) for s in spec.states], lst("params")]
    parts.append("bool[] separate")
    parts += [f"Tensor? {s}" for s in ("inv", "clip_div", "clip_mul")] + ["Tensor lr"]
    parts += ["Tensor? apply", "Tensor? require"] + [f"Tensor? {s}" for s in spec.scalars]
    parts += [f"{kind} {name}" for name, kind in spec.hyper] + ["int members"]
    n_lists = 2 + len(spec.states)
    out = (
        "(Tensor, Tensor)"
        if donated
        else "(" + ", ".join(["Tensor[]"] * n_lists + ["Tensor"] * 2) + ")"
    )
    return f"({', '.join(parts)}) -> {out}"


def arg_names(spec: StepSpec) -> list[str]:
    """The op's argument names, in the schema's order."""
    names = ["grads", "master", *spec.states, "params", "separate", "inv", "clip_div", "clip_mul"]
    names += ["lr", "apply", "require", *spec.scalars, *[n for n, _ in spec.hyper], "members"]
    return names


def working_copies(
    master: list[Tensor], params: list[Tensor], separate: list[bool]
) -> list[Tensor]:
    """One working copy per leaf: ``params`` where ``separate``, else the master itself."""
    it = iter(params)
    return [next(it) if s else m for m, s in zip(master, separate)]
