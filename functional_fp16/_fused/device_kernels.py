"""Which kernel runs an op on a device, and the call into it: C or plain PyTorch.

:func:`kernel_for` names the device's kernel: the compiled C library on the
CPU (or, with ``$FUNCTIONAL_FP16_CPU_KERNEL=cuda-default``, the kernel CUDA
runs by default), and the plain PyTorch kernel (``plain_kernels``: PyTorch's
multi-tensor ops and fused optimiser kernels) on CUDA, on any other device and
where no compiler exists. :func:`stats` runs ``grad_stats`` and
:func:`run_step` a step on the kernel the op chose; both take arguments that
have passed the op's checks (``op_checks``).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from functional_fp16._fused.op_checks import fail
from functional_fp16._fused.plain_kernels import largest_magnitudes, stats_generic
from functional_fp16._fused.step_schema import StepSpec, working_copies
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16.precision import master_split

__all__ = [
    "CPU_KERNEL_VARIABLE",
    "CUDA_KERNEL_VARIABLE",
    "CUDA_DEFAULT_KERNEL",
    "cpu_kernel_choice",
    "cuda_kernel_choice",
    "kernel_for",
    "finite_from_peak",
    "decide_from_leaf_peaks",
    "stats",
    "run_step",
]
__all__ += ["cpp_ready", "cpp_step", "cpp_stats"]


CUDA_KERNEL_VARIABLE = "FUNCTIONAL_FP16_CUDA_KERNEL"
"""The environment variable that once chose the retired Triton kernels on CUDA: ``torch``
(PyTorch's kernels, the only CUDA kernel) is accepted; ``triton`` raises, saying so."""


def cuda_kernel_choice() -> str:
    """The declared CUDA kernel: ``"torch"`` (PyTorch's multi-tensor ops and fused optimiser
    kernels). The library's own Triton kernels were retired: asking for them raises."""
    choice = os.environ.get(CUDA_KERNEL_VARIABLE, "torch").strip().lower() or "torch"
    if choice == "triton":
        raise ValueError(
            f"${CUDA_KERNEL_VARIABLE}=triton: the library's Triton kernels were retired; CUDA "
            "runs PyTorch's own multi-tensor ops and fused optimiser kernels (unset the variable)"
        )
    if choice != "torch":
        raise ValueError(f"${CUDA_KERNEL_VARIABLE} must be 'torch' (or unset), got {choice!r}")
    return choice


CPU_KERNEL_VARIABLE = "FUNCTIONAL_FP16_CPU_KERNEL"
"""The environment variable that chooses the CPU kernel: ``c`` (the default, where the C
library is available) or ``cuda-default`` (the kernel CUDA runs by default, on the CPU)."""

CUDA_DEFAULT_KERNEL = "generic"
"""What :func:`kernel_for` answers for a CUDA device without opt-ins: the plain PyTorch
kernel (PyTorch's multi-tensor ops)."""


def cpu_kernel_choice() -> str:
    """The declared CPU kernel: ``"c"`` (the compiled C library where it is available, the
    default) or ``"cuda-default"`` (the CPU runs what CUDA runs by default,
    :data:`CUDA_DEFAULT_KERNEL`, so that path can be run and measured without a GPU)."""
    choice = os.environ.get(CPU_KERNEL_VARIABLE, "c").strip().lower() or "c"
    if choice not in ("c", "cuda-default"):
        raise ValueError(f"${CPU_KERNEL_VARIABLE} must be 'c' or 'cuda-default', got {choice!r}")
    return choice


def kernel_for(device: torch.device) -> str:
    """The kernel that runs on ``device``: ``"c"`` or ``"generic"``.

    * the CPU: the compiled C library (``$FUNCTIONAL_FP16_NO_KERNEL`` makes it
      unavailable, so the CPU runs the plain PyTorch kernel), unless
      ``$FUNCTIONAL_FP16_CPU_KERNEL=cuda-default``: then the CPU runs exactly
      the kernel a CUDA device runs by default (:data:`CUDA_DEFAULT_KERNEL`,
      the plain PyTorch kernel) and no C or C++ kernel runs in the update, so
      CUDA's default path can be tested, profiled and counted on a machine
      without a GPU (``benchmarks/bench_cuda_default.py``);
    * CUDA: the plain PyTorch kernel, whose one-group form is a fixed number of
      PyTorch's own multi-tensor ops (``torch._foreach_*``) and fused optimiser
      kernels (``torch._fused_sgd_``);
    * any other device: the plain PyTorch kernel.

    Each of the two variables is read on every call; a value other than those
    above raises a ``ValueError`` that names the variable.
    """
    if device.type == "cpu":
        if cpu_kernel_choice() == "cuda-default":
            return CUDA_DEFAULT_KERNEL
        return "c" if c_kernel.available() else "generic"
    if device.type == "cuda":
        cuda_kernel_choice()  # a retired choice raises
        return CUDA_DEFAULT_KERNEL
    return "generic"


def _threads() -> int:
    return torch.get_num_threads()


def finite_from_peak(peak: Tensor, inv: Tensor | None, require: Tensor | None = None) -> Tensor:
    """Per peak (a group's or a leaf's): ``fl32(peak) * inv`` is finite (as
    ``grads_finite`` decides), and ``require``; ``inv`` broadcasts against ``peak``."""
    finite = torch.isfinite(peak if inv is None else peak * inv)
    return finite if require is None else finite & require


def decide_from_leaf_peaks(
    peak: Tensor, inv: Tensor | None, require: Tensor | None, groups: int
) -> tuple[Tensor, Tensor]:
    r"""``(finite, leaf_finite)`` from the leaves' peaks (member-major, ``(L,)``).

    .. math:: \ell_l = \operatorname{isfinite}(\operatorname{fl}_{32}(M_l)\, s_{k(l)}^{-1}),
              \qquad f_k = r_k \wedge \textstyle\bigwedge_{l \in k} \ell_l

    the per-leaf flags and, per group, their AND with ``require`` (:math:`r`).
    Rounding is monotonic, so :math:`f_k` is ``finite_from_peak`` of the group's
    largest peak: the decision does not change.
    """
    by_group = peak.reshape(groups, -1)
    leaves = finite_from_peak(by_group, None if inv is None else inv.reshape(groups, 1))
    finite = leaves.all(dim=1)
    return (finite if require is None else finite & require), leaves.reshape(-1)


def decide_from_leaf_peaks_one(peak: Tensor, inv: Tensor | None, require: Tensor | None):
    """:func:`decide_from_leaf_peaks` of one group: ``(leaf_finite, finite)``."""
    finite, leaves = decide_from_leaf_peaks(peak, inv, require, 1)
    return leaves, finite


def stats(grads, inv, groups, members, sum_squares, kernel: str) -> tuple[Tensor, Tensor]:
    """``grad_stats`` on ``kernel``: per leaf the peak (float32; ``members * L`` of them,
    member-major) and per group the sum of squares (float64)."""
    device = grads[0].device
    peak = torch.empty(len(grads) * members, dtype=torch.float32, device=device)
    # zeros where nothing is summed; else every entry is written (no fill to launch)
    make = torch.empty if sum_squares and kernel == "generic" else torch.zeros
    sq = make(groups, dtype=torch.float64, device=device)
    if kernel == "c":
        c_kernel.call(
            "grad_stats",
            n_groups=groups,
            members=members,
            leaves_checked=True,
            grads=grads,
            inv=inv,
            sum_squares=sum_squares,
            threads=_threads(),
            peak_out=peak,
            sum_sq_out=sq if sum_squares else None,
        )
    else:
        stats_generic(grads, inv, groups, members, sum_squares, peak, sq)
    return peak, sq


DECIDE_FROM_PEAKS: list = [decide_from_leaf_peaks_one]
"""``(leaf_finite, finite)`` of one group from its leaves' peaks: ``step_scalars``'s
one launch, which that module puts here when it is imported (it imports this one)."""


def run_step(
    spec: StepSpec,
    a: dict,
    used: list[str],
    out: dict,
    kernel: str,
    speculate: bool,
) -> Tensor:
    """Runs the step on ``kernel`` into ``out`` (``master``, the states, ``params``: one per
    leaf); returns ``(finite, leaf_finite)``: the decision per group and, where the step
    decided it (``apply=None``), per leaf whether its unscaled gradient is finite (else an
    empty tensor).

    ``a`` has passed the op's checks (``op_checks``), which check every tensor
    the kernels are given by the rules of the C interface (``signatures.py``);
    ``out`` is made from those tensors (fresh ones like them, or themselves).
    So the C kernel's packing checks only the lists' lengths and the scalars
    again.
    """
    split = master_split.holds_residuals(a["master"])
    if split and not spec.stored and (kernel != "generic" or spec.split_generic is None):
        return _run_split(spec, a, used, out, kernel, speculate)
    groups, members = a["lr"].numel(), a["members"]
    if kernel == "c" and spec.for_c is not None:
        a = spec.for_c(a)
    inputs = {**a, "params": working_copies(a["master"], a["params"], a["separate"])}
    kw = spec.kernel_args({**inputs, **{f"{k}_out": v for k, v in out.items()}}, used)
    if kernel == "c" and speculate and spec.speculative and a["apply"] is None:
        # The C kernel steps before it decides, then decides and undoes the groups that skip.
        finite = torch.empty(groups, dtype=torch.bool)
        leaves = torch.empty(len(a["grads"]) * members, dtype=torch.bool)
        decided = {"apply": None, "require": a["require"], "decided_out": finite}
        decided["leaf_finite_out"] = leaves
    elif a["apply"] is not None:
        finite = a["apply"].clone() if a["require"] is None else a["apply"] & a["require"]
        leaves = torch.empty(0, dtype=torch.bool, device=finite.device)
        # The kernel is given the decision itself (the output is its copy): the skip flag
        # derived from it is the update's, made once for all its groups.
        decided = {"apply": a["apply"] if a["require"] is None else finite}
    elif kernel == "generic" and groups == members == 1:  # the peaks, then one launch
        peak = largest_magnitudes(a["grads"])
        leaves, finite = DECIDE_FROM_PEAKS[0](peak, a["inv"], a["require"])
        decided = {"apply": finite}
    else:
        peak, _ = stats(a["grads"], a["inv"], groups, members, False, kernel)
        finite, leaves = decide_from_leaf_peaks(peak, a["inv"], a["require"], groups)
        decided = {"apply": finite}
    given = finite if decided["apply"] is None else decided["apply"]
    if split and not spec.stored:  # the plain kernels' split step (see StepSpec)
        if not spec.split_generic(members=members, apply=given, used=used, **kw):
            return _run_split(spec, a, used, out, kernel, speculate)
    elif kernel == "c" and (spec.c_block or not spec.entry):  # C only through the C++ op
        spec.generic(members=members, apply=given, **kw)
    elif kernel == "c":
        c_kernel.call(
            spec.entry,
            n_groups=groups,
            members=members,
            leaves_checked=True,
            threads=_threads(),
            **{**spec.c_extra, **decided},
            **{k: v for k, v in kw.items() if k not in spec.generic_only},
        )
    else:
        spec.generic(members=members, apply=given, **kw)
    return finite, leaves


def _run_split(spec: StepSpec, a: dict, used: list[str], out: dict, kernel: str, speculate):
    """:func:`run_step` of a split master (int16 residuals beside float16 params) on a
    kernel that steps a float32 master: the master joined, stepped and split
    into ``out`` (the C++ op instead joins and splits inside its one pass): 8 bytes a
    parameter of float32 temporaries. A skipped step's master is the joined one, which
    splits back into the same params and residuals bitwise."""
    wide = [master_split.join(p, q) for p, q in zip(a["params"], a["master"])]
    inner = {**a, "master": wide, "separate": [False] * len(wide), "params": []}
    # A fresh float32 master out (the kernels may use it as scratch before they read the
    # master), the working copy the master itself.
    new = [torch.empty_like(m) for m in wide]
    stepped = {**out, "master": new, "params": new}
    finite, leaves = run_step(spec, inner, used, stepped, kernel, speculate)
    for m, p_out, q_out in zip(new, out["params"], out["master"]):
        p, q = master_split.split(m)
        p_out.copy_(p)
        q_out.copy_(q)
    return finite, leaves


def cpp_ready(spec: StepSpec | None, kernel: str) -> bool:
    """Whether the C++ op library runs this call (the C kernel, on the CPU)."""
    return kernel == "c" and (spec is None or bool(spec.cpp_op)) and c_kernel.ops_available()


def cpp_step(spec: StepSpec, a: dict, donated: bool):
    """The step through ``functional_fp16_cpu::<spec.cpp_op>``: the op's outputs.

    The C++ op checks every tensor, allocates the outputs (from its pool of
    storages that nothing refers to any more), decides the step as
    :func:`run_step` does and calls the same C kernel.
    """
    if spec.for_c is not None:
        a = spec.for_c(a)
    if spec.c_block:
        return _cpp_block_step(spec, a, donated)
    if spec.stored:
        return _cpp_stored_step(spec, a, donated)
    lists = [a[n] for n in ("grads", "master", *spec.states, "params")]
    scalars = [a[n] for n in ("inv", "clip_div", "clip_mul", "lr", "apply", "require")]
    scalars += [a[n] for n in spec.scalars if n not in spec.generic_only]
    return c_kernel.run_op(
        spec.cpp_op,
        *lists,
        list(a["separate"]),
        *scalars,
        *spec.cpp_hyper(a),
        a["members"],
        _threads(),
        donated,
    )


def _cpp_block_step(spec: StepSpec, a: dict, donated: bool):
    """The step through the generic ``functional_fp16_cpu::step``: its states go in
    state-major as one list and come back split, so the outputs read as ``cpp_step``'s."""
    _check_block(spec, a, donated)
    states = [x for name in spec.states for x in a[name]]
    master, flat, params, finite, leaves = c_kernel.run_op(
        "step",
        spec.cpp_op,
        a["grads"],
        a["master"],
        states,
        a["params"],
        list(a["separate"]),
        *[a[n] for n in ("inv", "clip_div", "clip_mul", "lr", "apply", "require")],
        _block_scalars([a[n] for n in spec.scalars]),
        [float(x) for x in spec.cpp_hyper(a)],
        a["members"],
        _threads(),
        donated,
    )
    if donated:
        return (finite, leaves)
    n = len(a["grads"])
    split = [flat[j * n : (j + 1) * n] for j in range(len(spec.states))]
    return (master, *split, params, finite, leaves)


def _check_block(spec: StepSpec, a: dict, donated: bool) -> None:
    """What the generic C++ op cannot know of a step: which state lists it uses (each one
    tensor per leaf, the others empty) and its scalars' dtypes (the C++ op checks every
    tensor's layout, device and the scalars' shapes)."""
    op = spec.name + ("_" if donated else "")
    used = spec.check(op, a)
    n = len(a["grads"])
    for name in spec.states:
        if name in used and len(a[name]) != n:
            fail(op, f"{name} has {len(a[name])} tensors, expected {n} (one per leaf)")
        if name not in used and a[name]:
            fail(op, f"{name} must be empty here (it is not used)")
    given = [name for name in spec.scalars if a[name] is not None]
    if given != list(spec.scalars[: len(given)]):
        fail(op, f"{spec.scalars[len(given)]} is required with {given[-1]}", TypeError)
    for name in given:
        dtype = torch.bool if name in spec.bool_scalars else torch.float32
        x = a[name]
        if not isinstance(x, Tensor) or x.dtype != dtype:
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            fail(op, f"{name} must be {dtype}, got {got}", TypeError)


def _block_scalars(scalars: list) -> list[Tensor]:
    """The per-group scalars as the block convention takes them, in order: float32 (a
    bool flag as 1.0 or 0.0); those not given (``None``: a state not in use) last, left
    out (checked by :func:`_check_block`)."""
    return [s if s.dtype == torch.float32 else s.float() for s in scalars if s is not None]


def _cpp_stored_step(spec: StepSpec, a: dict, donated: bool):
    """A step with stored states through ``functional_fp16_cpu::stored_step``: the states
    and the block scales go in state-major as two lists and come back split, so the
    outputs read as ``cpp_step``'s."""
    states = [s for s in spec.states if s not in spec.side]
    flat_states = [x for name in states for x in a[name]]
    flat_scales = [x for name in spec.side for x in a[name]]
    floats = [a[n] for n in spec.scalars if n not in spec.int_scalars]
    master, s_out, sc_out, params, finite, leaves = c_kernel.run_op(
        "stored_step",
        spec.stored,
        a["grads"],
        a["master"],
        flat_states,
        flat_scales,
        a["params"],
        list(a["separate"]),
        *[a[n] for n in ("inv", "clip_div", "clip_mul", "lr", "apply", "require")],
        floats,
        a["count"],
        [float(x) for x in spec.cpp_hyper(a)],
        a["block_size"],
        a["rounding"],
        spec.root_state,
        list(a["salt_ids"]),
        a["members"],
        _threads(),
        donated,
    )
    if donated:
        return (finite, leaves)
    n = len(a["grads"])
    out = [s_out[j * n : (j + 1) * n] for j in range(len(states))]
    start = 0
    for name in spec.side:
        out.append(sc_out[start : start + len(a[name])])
        start += len(a[name])
    return (master, *out, params, finite, leaves)


def cpp_stats(grads, inv, groups, members, sum_squares) -> tuple[Tensor, Tensor]:
    """``grad_stats`` through ``functional_fp16_cpu::grad_stats``."""
    return c_kernel.run_op("grad_stats", grads, inv, groups, members, sum_squares, _threads())
