"""How a fused optimiser step becomes ``torch.library`` ops: one builder for every optimiser.

:func:`define_step` turns a :class:`StepSpec` into two ops in the
``functional_fp16`` namespace: the functional ``<name>`` that returns fresh
tensors and the donated ``<name>_`` that writes its state arguments in place
(declared in its schema, ``Tensor(a!)[]``). Each gets a fake (meta) kernel, a
CPU kernel (the compiled C library), a CUDA kernel (multi-tensor Triton
launches), a plain PyTorch kernel for any other device or where no compiler
exists, and a ``vmap`` rule. :data:`grad_stats` is the gradient reduction
every fused step shares.

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
  the decision (still ANDed with ``require``). The decision is returned.

A skipped group's outputs are bitwise its inputs. No op reads a value on the
host, so they run under ``torch.compile`` (Inductor calls them as extern
kernels), in CUDA graphs and under ``vmap``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_fp16._fused.memory import fresh_like
from functional_fp16._fused.triton_fallback import with_triton
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16._kernels.signatures import DTYPE_CODES, dense, members_outermost

__all__ = [
    "StepSpec",
    "define_step",
    "grad_stats",
    "finite_from_peak",
    "kernel_for",
    "member_views",
    "f32",
]

NS = "functional_fp16"
STORED = tuple(DTYPE_CODES)
COMMON_SCALARS = ("inv", "clip_div", "clip_mul", "lr", "apply", "require")
_BOOL_SCALARS = ("apply", "require")


def kernel_for(device: torch.device) -> str:
    """The kernel that runs on ``device``: ``"c"``, ``"triton"`` or ``"generic"``.

    ``$FUNCTIONAL_FP16_NO_KERNEL`` makes the C library unavailable, so the CPU
    runs the plain PyTorch kernel.
    """
    if device.type == "cpu" and c_kernel.available():
        return "c"
    if device.type == "cuda" and _triton().available():
        return "triton"
    return "generic"


def _triton():
    """The Triton kernels' module (imported on first use: it imports triton)."""
    from functional_fp16._kernels import triton_steps

    return triton_steps


def _launches() -> int:
    return sum(_triton().launch_counts.values())


def _dtypes(xs: list[Tensor]) -> tuple[str, ...]:
    """The distinct dtypes of ``xs``, in a fixed order (part of a Triton configuration)."""
    return tuple(sorted({str(x.dtype) for x in xs}))


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python number (no tensor, no device)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _threads() -> int:
    return torch.get_num_threads()


def member_views(xs: list[Tensor] | None, members: int) -> list[Tensor] | None:
    """Each leaf's members as separate views, member-major (``[x[b] for b for x]``)."""
    if xs is None or members == 1:
        return xs
    return [x[b] for b in range(members) for x in xs]


# ---------------------------------------------------------------------------
# Argument checks: before anything reaches a kernel.
# ---------------------------------------------------------------------------


def fail(op: str, message: str, kind: type[Exception] = ValueError) -> None:
    """Raises ``kind`` with the op's name in front of ``message``."""
    raise kind(f"{NS}::{op}: {message}")


def _check_list(op: str, name: str, xs: list[Tensor], like: list[Tensor], dtypes) -> None:
    """Every ``xs[i]`` has a dtype of ``dtypes`` and ``like[i]``'s device, shape and strides.

    The common case is checked in bulk; a failure is then explained leaf by leaf.
    """
    if (
        len(xs) == len(like)
        and all(x.dtype in dtypes for x in xs)
        and [(x.device, x.shape, x.stride()) for x in xs]
        == [(r.device, r.shape, r.stride()) for r in like]
    ):
        return
    if len(xs) != len(like):
        fail(op, f"{name} has {len(xs)} tensors, expected {len(like)} (one per leaf)")
    for i, (x, ref) in enumerate(zip(xs, like)):
        if x.dtype not in dtypes:
            fail(op, f"{name}[{i}] has dtype {x.dtype}, expected one of {dtypes}", TypeError)
        if x.device != ref.device:
            fail(op, f"{name}[{i}] is on {x.device}, the gradients on {ref.device}")
        if x.shape != ref.shape or x.stride() != ref.stride():
            fail(
                op,
                f"{name}[{i}] has shape {tuple(x.shape)} and strides {x.stride()}; "
                f"grads[{i}] has {tuple(ref.shape)} and {ref.stride()}",
            )


def _check_group(op: str, name: str, x: Tensor | None, groups: int, dtype, device) -> None:
    if x is None:
        return
    if not isinstance(x, Tensor) or x.dtype != dtype or x.device != device:
        got = f"{x.dtype} on {x.device}" if isinstance(x, Tensor) else type(x).__name__
        fail(op, f"{name} must be {dtype} on {device}, got {got}", TypeError)
    if x.shape != (groups,) or not x.is_contiguous():
        fail(
            op,
            f"{name} must be contiguous of shape ({groups},) (one per group), "
            f"got shape {tuple(x.shape)} and strides {x.stride()}",
        )


def _check_grads(op: str, grads: list[Tensor], members: int) -> None:
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        fail(op, f"members must be a positive int, got {members!r}", TypeError)
    if not grads:
        fail(op, "grads is empty")
    device = grads[0].device
    for i, g in enumerate(grads):
        if g.device != device:
            fail(op, f"grads[{i}] is on {g.device}, grads[0] on {device}: one device per call")
        if g.dtype not in STORED:
            fail(op, f"grads[{i}] has dtype {g.dtype}, expected one of {STORED}", TypeError)
        if not dense(g):
            fail(op, f"grads[{i}] is not dense")
        if not members_outermost(g, members):
            fail(op, f"grads[{i}] does not hold {members} members along its first dimension")


def _check_step(op: str, spec: StepSpec, a: dict[str, Any]) -> list[str]:
    """Checks a step's arguments; returns the names of the state lists in use."""
    grads, members = a["grads"], a["members"]
    _check_grads(op, grads, members)
    _check_list(op, "master", a["master"], grads, (torch.float32,))
    used = spec.check(op, a)
    for name in spec.states:
        if name in used:
            _check_list(op, name, a[name], grads, (torch.float32,))
        elif a[name]:
            fail(op, f"{name} must be empty here (it is not used)")
    if len(a["separate"]) != len(grads):
        fail(op, f"separate has {len(a['separate'])} flags, expected {len(grads)}")
    own = [g for g, s in zip(grads, a["separate"]) if s]
    _check_list(op, "params", a["params"], own, STORED)
    lr = a["lr"]
    if (
        lr.dim() != 1
        or lr.numel() < 1
        or lr.numel() % members
        or len(grads) % (lr.numel() // members)
    ):
        fail(
            op,
            f"lr has shape {tuple(lr.shape)}: expected one entry per group, {members} member(s) "
            f"of groups that split {len(grads)} leaves evenly",
        )
    for name in (*COMMON_SCALARS, *spec.scalars):
        dtype = torch.bool if name in (*_BOOL_SCALARS, *spec.bool_scalars) else torch.float32
        _check_group(op, name, a[name], lr.numel(), dtype, grads[0].device)
    if (a["clip_div"] is None) != (a["clip_mul"] is None):
        fail(op, "clip_div and clip_mul are given together or not at all")
    return used


# ---------------------------------------------------------------------------
# grad_stats
# ---------------------------------------------------------------------------


def _stats_generic(grads, inv, groups, members, sum_squares, peak, sq) -> None:
    per_member = groups // members
    per_group = len(grads) // per_member
    peaks: list[list[Tensor]] = [[] for _ in range(groups)]
    sums: list[list[Tensor]] = [[] for _ in range(groups)]
    for b in range(members):
        for leaf, x in enumerate(grads):
            k = b * per_member + leaf // per_group
            g = x if members == 1 else x[b]
            if g.numel() == 0:
                continue
            top = g.abs().amax().float()
            peaks[k].append(torch.where(torch.isfinite(g).all(), top, float("inf")))
            if sum_squares:
                w = g.float() if inv is None else g.float() * inv[k]
                sums[k].append(w.double().square().sum())
    for k in range(groups):
        peak[k] = torch.stack(peaks[k]).amax() if peaks[k] else 0.0
        if sum_squares:
            sq[k] = torch.stack(sums[k]).sum() if sums[k] else 0.0


def _stats(grads, inv, groups, members, sum_squares) -> tuple[Tensor, Tensor]:
    device = grads[0].device
    peak = torch.empty(groups, dtype=torch.float32, device=device)
    sq = torch.zeros(groups, dtype=torch.float64, device=device)
    kernel = kernel_for(device)
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
    elif kernel == "triton":
        with_triton(
            ("grad_stats", *_dtypes(grads), sum_squares, inv is None),
            device,
            lambda: _triton().grad_stats(
                n_groups=groups,
                grads=member_views(grads, members),
                inv=inv,
                sum_squares=sum_squares,
                peak_out=peak,
                sum_sq_out=sq if sum_squares else None,
            ),
            lambda: _stats_generic(grads, inv, groups, members, sum_squares, peak, sq),
            _launches,
            writes_inputs=False,
        )
    else:
        _stats_generic(grads, inv, groups, members, sum_squares, peak, sq)
    return peak, sq


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


def _grad_stats(
    grads: list[Tensor], inv: Tensor | None, groups: int, members: int, sum_squares: bool
) -> tuple[Tensor, Tensor]:
    r"""Per group: the gradients' peak magnitude and the sum of squares of the unscaled ones.

    .. math:: M_k = \max_{i \in k} |g_i|, \qquad
              S_k = \textstyle\sum_{i \in k} \big(\operatorname{fl}_{32}(g_i)\, s_k^{-1}\big)^2

    ``M_k`` is ``+inf`` if any element is inf or NaN; ``S_k`` is accumulated in
    float64 (zeros unless ``sum_squares``). Returns two ``(groups,)`` tensors.
    """
    _check_grads("grad_stats", grads, members)
    if groups < 1 or groups % members or len(grads) % (groups // members):
        fail("grad_stats", f"{len(grads)} leaves of {members} member(s) in {groups} groups")
    _check_group("grad_stats", "inv", inv, groups, torch.float32, grads[0].device)
    return _stats(grads, inv, groups, members, sum_squares)


def _grad_stats_fake(grads, inv, groups, members, sum_squares):
    device = grads[0].device
    return (
        torch.empty(groups, dtype=torch.float32, device=device),
        torch.empty(groups, dtype=torch.float64, device=device),
    )


# ---------------------------------------------------------------------------
# Step ops.
# ---------------------------------------------------------------------------


class StepSpec(NamedTuple):
    """A fused optimiser step, declared once; :func:`define_step` makes its ops."""

    name: str  # the functional op's name; the donated one adds "_"
    states: tuple[str, ...]  # per-parameter FP32 state lists, e.g. ("trace",)
    scalars: tuple[str, ...]  # per-group scalars after the common ones, e.g. ("started",)
    bool_scalars: tuple[str, ...]  # which of ``scalars`` are bool
    hyper: tuple[tuple[str, str], ...]  # fixed hyperparameters: (name, schema type)
    entry: str  # the kernel entry: C (signatures.py) and Triton (triton_steps.py) alike
    check: Callable[[str, dict], list[str]]  # optimiser checks; returns the states in use
    kernel_args: Callable[[dict, list[str]], dict]  # op arguments -> the kernel's keywords
    generic: Callable[..., None]  # the plain PyTorch kernel (the kernel's keywords + members)
    c_extra: dict[str, Any] = {}  # keywords only the C entry takes, as a decided step passes them
    # The C entry can run a pure step before its decision: apply=None, then it decides
    # (require, decided_out) and undoes the groups that skip, in the same call.
    speculative: bool = False


def _schema(spec: StepSpec, donated: bool) -> str:
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
    out = "Tensor" if donated else "(" + ", ".join(["Tensor[]"] * n_lists + ["Tensor"]) + ")"
    return f"({', '.join(parts)}) -> {out}"


def _names(spec: StepSpec) -> list[str]:
    names = ["grads", "master", *spec.states, "params", "separate", "inv", "clip_div", "clip_mul"]
    names += ["lr", "apply", "require", *spec.scalars, *[n for n, _ in spec.hyper], "members"]
    return names


def first_overlap(tensors: list[Tensor]) -> tuple[int, int] | None:
    """Indices of two dense tensors whose memory overlaps, or ``None``.

    A dense tensor covers ``[data_ptr, data_ptr + nbytes)``; empty ones cover nothing.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.nbytes, k) for k, t in enumerate(tensors) if t.nbytes
    )
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            return first, second
    return None


def _check_disjoint(op: str, a: dict, names: list[str]) -> None:
    """Refuses written tensors whose memory overlaps another argument's (donation)."""
    tensors = [t for name in ["grads", *names] for t in a[name]]
    found = first_overlap(tensors)
    if found is not None:
        where = [f"{name}[{i}]" for name in ["grads", *names] for i in range(len(a[name]))]
        fail(
            op,
            f"{where[found[0]]} and {where[found[1]]} share memory; the donated step writes "
            "in place",
        )


def _full(master: list[Tensor], params: list[Tensor], separate: list[bool]) -> list[Tensor]:
    """One working copy per leaf: ``params`` where ``separate``, else the master itself."""
    it = iter(params)
    return [next(it) if s else m for m, s in zip(master, separate)]


def finite_from_peak(peak: Tensor, inv: Tensor | None, require: Tensor | None = None) -> Tensor:
    """Per group: ``fl32(peak) * inv`` is finite (as ``grads_finite`` decides), and ``require``."""
    finite = torch.isfinite(peak if inv is None else peak * inv)
    return finite if require is None else finite & require


def _run(
    spec: StepSpec, a: dict, used: list[str], out: dict, speculate: bool, donated: bool = False
) -> Tensor:
    """Runs the step into ``out`` (``master``, the states, ``params``: one per leaf); returns ``finite``.

    ``a`` has passed :func:`_check_step`, which checks every tensor the kernels
    are given by the rules of the C interface (``signatures.py``); ``out`` is
    made from those tensors (fresh ones like them, or themselves). So the C
    kernel's packing checks only the lists' lengths and the scalars again.
    """
    groups, members = a["lr"].numel(), a["members"]
    kernel = kernel_for(a["grads"][0].device)
    inputs = {**a, "params": _full(a["master"], a["params"], a["separate"])}
    kw = spec.kernel_args({**inputs, **{f"{k}_out": v for k, v in out.items()}}, used)
    if kernel == "c" and speculate and spec.speculative and a["apply"] is None:
        # The C kernel steps before it decides, then decides and undoes the groups that skip.
        finite = torch.empty(groups, dtype=torch.bool)
        decided = {"apply": None, "require": a["require"], "decided_out": finite}
    elif a["apply"] is not None:
        finite = a["apply"].clone() if a["require"] is None else a["apply"] & a["require"]
        decided = {"apply": finite}
    else:
        peak, _ = _stats(a["grads"], a["inv"], groups, members, False)
        finite = finite_from_peak(peak, a["inv"], a["require"])
        decided = {"apply": finite}
    if kernel == "c":
        c_kernel.call(
            spec.entry,
            n_groups=groups,
            members=members,
            leaves_checked=True,
            threads=_threads(),
            **{**spec.c_extra, **decided},
            **kw,
        )
    elif kernel == "triton":
        views = {k: member_views(v, members) if isinstance(v, list) else v for k, v in kw.items()}
        given = tuple(sorted(k for k, v in kw.items() if v is not None and not isinstance(v, list)))
        with_triton(
            (spec.entry, *_dtypes(a["grads"]), *_dtypes(inputs["params"]), *sorted(used), *given),
            a["grads"][0].device,
            lambda: getattr(_triton(), spec.entry)(n_groups=groups, apply=finite, **views),
            lambda: spec.generic(members=members, apply=finite, **kw),
            _launches,
            writes_inputs=donated,
        )
    else:
        spec.generic(members=members, apply=finite, **kw)
    return finite


def define_step(spec: StepSpec, doc: str) -> tuple[Any, Any]:
    """The functional and the donated op of ``spec`` (with fake kernels and ``vmap`` rules)."""
    names = _names(spec)

    def functional(*args):
        a = dict(zip(names, args))
        used = _check_step(spec.name, spec, a)
        # One request for every output: the pool then keeps the dropped state's
        # buffers (as many as this step takes) for the next step.
        written = ["master", *[s for s in spec.states if s in used], "params"]
        fresh = iter(fresh_like([x for n in written for x in a[n]]))
        out = {n: [next(fresh) for _ in a[n]] for n in written}
        out.update({s: [] for s in spec.states if s not in used})
        fresh_params = out["params"]
        out["params"] = _full(out["master"], fresh_params, a["separate"])
        finite = _run(spec, a, used, out, speculate=True)
        return (out["master"], *[out[s] for s in spec.states], fresh_params, finite)

    def donated(*args):
        a = dict(zip(names, args))
        used = _check_step(spec.name + "_", spec, a)
        _check_disjoint(spec.name + "_", a, ["master", *used, "params"])
        out = {"master": a["master"], **{s: a[s] for s in spec.states}}
        out["params"] = _full(a["master"], a["params"], a["separate"])
        return _run(spec, a, used, out, speculate=False, donated=True)

    functional.__doc__ = doc
    donated.__doc__ = (
        f"``{spec.name}`` written into its state arguments (donation); returns ``finite``."
    )
    mutated = ("master", *spec.states, "params")

    def fake(*args):
        a = dict(zip(names, args))
        lists = [[torch.empty_like(x) for x in a[n]] for n in ("master", *spec.states, "params")]
        return (*lists, torch.empty(a["lr"].shape, dtype=torch.bool, device=a["lr"].device))

    def fake_(*args):
        lr = dict(zip(names, args))["lr"]
        return torch.empty(lr.shape, dtype=torch.bool, device=lr.device)

    lists = ("grads", "master", *spec.states, "params")
    scalars = (*COMMON_SCALARS, *spec.scalars)
    op = _define(
        spec.name,
        _schema(spec, False),
        functional,
        fake,
        lambda op: _vmap_rule(op, names, lists, scalars, (), _by_member_all),
    )
    op_ = _define(
        spec.name + "_",
        _schema(spec, True),
        donated,
        fake_,
        lambda op: _vmap_rule(op, names, lists, scalars, mutated, _by_member),
    )
    return op, op_


# ---------------------------------------------------------------------------
# vmap: K members become K more groups of the same call.
# ---------------------------------------------------------------------------


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


def _by_member(out, size: int, members: int):
    return out.reshape(size, -1), 0


def _by_member_all(out, size: int, members: int):
    """The functional op's outputs with the vmapped dimension split off again."""
    *lists, finite = out
    if members > 1:
        lists = [[x.reshape(size, members, *x.shape[1:]) for x in xs] for xs in lists]
    return (*lists, finite.reshape(size, -1)), (*([0] * len(lists)), 0)


def _vmap_rule(op, names, lists, scalars, mutated, outputs):
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


grad_stats = _define(
    "grad_stats",
    "(Tensor[] grads, Tensor? inv, int groups, int members, bool sum_squares) -> (Tensor, Tensor)",
    _grad_stats,
    _grad_stats_fake,
    lambda op: _vmap_rule(
        op,
        ["grads", "inv", "groups", "members", "sum_squares"],
        ("grads",),
        ("inv",),
        (),
        lambda out, size, members: ((out[0].reshape(size, -1), out[1].reshape(size, -1)), (0, 0)),
    ),
)
"""``functional_fp16::grad_stats``: see :func:`_grad_stats`."""


# ---------------------------------------------------------------------------
# Helpers of the plain PyTorch kernels.
# ---------------------------------------------------------------------------


def walk(n_leaves: int, groups: int, members: int):
    """``(b, leaf, k)`` for every member ``b`` and leaf, with the leaf's group ``k``."""
    per_member = groups // members
    per_group = n_leaves // per_member
    for b in range(members):
        for leaf in range(n_leaves):
            yield b, leaf, b * per_member + leaf // per_group


def member(x: Tensor, b: int, members: int) -> Tensor:
    """Member ``b`` of a leaf tensor that holds ``members`` of them."""
    return x if members == 1 else x[b]


def unscaled(g: Tensor, inv, clip_div, clip_mul, k: int) -> Tensor:
    """``fl32(g) * inv[k]``, then ``(u / clip_div[k]) * clip_mul[k]`` when clipping."""
    u = g.float()
    if inv is not None:
        u = u * inv[k]
    if clip_div is not None:
        u = (u / clip_div[k]) * clip_mul[k]
    return u


def write_member(b: int, leaf: int, members: int, apply: Tensor, new: dict, **lists) -> None:
    """Writes ``where(apply, new, old)`` into the outputs of one leaf of one member.

    ``new`` maps ``"master"`` and the state names to their new values (``None``:
    a state not in use); ``lists`` holds each name's input and ``<name>_out``
    lists, and ``params``/``params_out`` (one working copy per leaf, the master
    itself where it has none).
    """

    def at(name: str) -> Tensor:
        return member(lists[name][leaf], b, members)

    mo, po = at("master_out"), at("params_out")
    if po.data_ptr() != mo.data_ptr():
        po.copy_(torch.where(apply, new["master"].to(po.dtype), at("params")))
    for name, value in new.items():
        if value is not None:
            at(f"{name}_out").copy_(torch.where(apply, value, at(name)))
