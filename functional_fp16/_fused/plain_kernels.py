r"""The plain PyTorch kernels' parts: CUDA's kernel, and any device's without a compiled one.

Where the C library (CPU) does not run, an op computes with PyTorch's own
operations (multi-tensor ops and fused optimiser kernels, which PyTorch
verifies on GPUs; under ``vmap`` each member's group as a call of its own where
PyTorch's fused kernels step it (:func:`calls`), else leaf by leaf), the same
arithmetic as the C kernel up to the multiply-adds PyTorch's kernels contract. This
module holds what every such kernel shares: the walk over ``(member, leaf, group)``,
a member's view of a leaf,
the unscaled and clipped gradient

.. math:: u = \operatorname{fl}_{32}(g)\cdot \mathrm{inv}_k, \qquad
          u \leftarrow (u / c_{d,k})\, c_{m,k} \text{ (clipping)}

and the write of ``where(apply, new, old)`` into the outputs, plus
:func:`stats_generic`, the plain kernel of ``grad_stats``. Each optimiser's
own plain kernel (its update rule) lives with its op (``sgd.py``,
``adam.py``).
"""

from __future__ import annotations

import operator
import struct
import threading

import torch
from torch import Tensor

from functional_fp16._util.multi_tensor import by_bit_width

_DTYPE = operator.attrgetter("dtype")

__all__ = ["f32", "walk", "calls", "member", "unscaled", "write_member", "stats_generic"]
__all__ += [
    "one_group",
    "unscaled_lists",
    "read_unscaled",
    "unscaled_into",
    "skip_flag",
    "descending",
    "derived",
    "remember",
    "start_from",
    "fma_step_",
    "correct_sqrt",
    "pieces",
]
__all__ += [
    "restore_skipped_",
    "select_into",
    "write_lists",
    "refresh_params",
    "largest_magnitudes",
]


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python number (no tensor, no device)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def walk(n_leaves: int, groups: int, members: int):
    """``(b, leaf, k)`` for every member ``b`` and leaf, with the leaf's group ``k``."""
    per_member = groups // members
    per_group = n_leaves // per_member
    for b in range(members):
        for leaf in range(n_leaves):
            yield b, leaf, b * per_member + leaf // per_group


def calls(n_leaves: int, groups: int, members: int):
    """``(k, of, at)`` for every group ``k`` of every member, each as a call of its own:
    ``of(xs)`` the group's leaves of member ``b`` (views), ``at(x)`` a per-group scalar's
    entry ``k`` (shape ``(1,)``; ``None`` stays ``None``). A kernel that steps each this
    way gives a batched call (``vmap``) exactly its members' unbatched results."""
    per_member = groups // members
    per_group = n_leaves // per_member
    for k in range(groups):
        b, first = divmod(k, per_member)
        leaves = range(first * per_group, (first + 1) * per_group)

        def of(xs, b=b, leaves=leaves):
            return [member(xs[i], b, members) for i in leaves]

        def at(x, k=k):
            if x is None or x.shape == (1,):  # one group: the scalar itself (no view), so
                return x  # that what is derived from it once serves every group's call
            return x[k : k + 1]

        yield k, of, at


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


def stats_generic(grads, inv, groups, members, sum_squares, peak, sq) -> None:
    """``grad_stats`` into ``peak`` and ``sq``: per leaf of each member (member-major) the
    largest ``|g|`` (+inf if any element is inf or NaN, 0 if it is empty) and, if
    ``sum_squares``, per group the float64 sum of ``fl32(g * inv)^2``."""
    if groups == 1 and members == 1:
        return stats_lists(grads, inv, sum_squares, peak, sq)
    per_member = groups // members
    per_group = len(grads) // per_member
    sums: list[list[Tensor]] = [[] for _ in range(groups)]
    for b in range(members):
        for leaf, x in enumerate(grads):
            k = b * per_member + leaf // per_group
            g = x if members == 1 else x[b]
            if g.numel() == 0:
                peak[b * len(grads) + leaf] = 0.0
                continue
            top = g.abs().amax().float()
            peak[b * len(grads) + leaf] = torch.where(torch.isfinite(g).all(), top, float("inf"))
            if sum_squares:
                w = g.float() if inv is None else g.float() * inv[k]
                sums[k].append(w.double().square().sum())
    if sum_squares:
        for k in range(groups):
            sq[k] = torch.stack(sums[k]).sum() if sums[k] else 0.0


# ---------------------------------------------------------------------------
# The multi-tensor form: one group of one member, on flat lists.
# ---------------------------------------------------------------------------


def one_group(lr: Tensor, members: int) -> bool:
    """Whether a call is one group of one member: the form the list kernels take."""
    return members == 1 and lr.numel() == 1


def unscaled_lists(grads, like, inv, clip_div, clip_mul) -> list[Tensor]:
    r"""New float32 buffers (laid out like ``like``) holding :func:`unscaled` of every
    gradient: :math:`u = \operatorname{fl}_{32}(g)\cdot\mathrm{inv}`, then
    :math:`(u / c_d)\, c_m` when clipping; a few multi-tensor ops, whatever the
    number of leaves."""
    return unscaled_into([torch.empty_like(m, dtype=torch.float32) for m in like], grads, inv,
                         clip_div, clip_mul)  # fmt: skip


def read_unscaled(grads, like, inv, clip_div, clip_mul) -> list[Tensor]:
    """:func:`unscaled_lists` for a kernel that only reads them (PyTorch's fused optimiser
    kernels without ``grad_scale``): ``grads`` themselves where they are float32 with
    nothing to unscale or clip (the plain kernels' update unscales every leaf once before
    its groups' ops: ``across_groups``); no copy, no launch. ``grads`` are laid out like
    ``like`` (the op's checks and the update's layout leave them so)."""
    if inv is None and clip_div is None and set(map(_DTYPE, grads)) == {torch.float32}:
        return list(grads)
    return unscaled_lists(grads, like, inv, clip_div, clip_mul)


def unscaled_into(u: list[Tensor], grads, inv, clip_div, clip_mul) -> list[Tensor]:
    """:func:`unscaled_lists` into the float32 tensors ``u`` (returned)."""
    torch._foreach_copy_(u, grads)
    if inv is not None:
        torch._foreach_mul_(u, inv.reshape(()))
    if clip_div is not None:
        torch._foreach_div_(u, clip_div.reshape(()))
        torch._foreach_mul_(u, clip_mul.reshape(()))
    return u


def _unscaled_pieces(grads, inv):
    """:func:`unscaled_lists` of ``grads`` in pieces of at most ``SQRT_BATCH`` elements
    (flat slices of the contiguous ones, as :func:`pieces` cuts them), made one piece at
    a time; a tree with a non-contiguous gradient is unscaled whole first, then cut."""
    if all(g.is_contiguous() for g in grads):
        for (piece,) in pieces([grads], SQRT_BATCH):
            yield unscaled_lists(piece, piece, inv, None, None)
        return
    u = unscaled_lists(grads, grads, inv, None, None)
    for (piece,) in pieces([u], SQRT_BATCH):
        yield piece


def skip_flag(apply: Tensor) -> Tensor:
    """``1.0`` where the step is skipped, else ``0.0``: the ``found_inf`` PyTorch's fused
    optimiser kernels take (a float32 0-d tensor on ``apply``'s device; no host read).
    Made once per decision (:func:`derived`): the groups of one update share it, and the
    one ``step_scalars`` made with the decision (:func:`remember`) needs no launch."""
    return derived("skip", apply, lambda a: torch.where(a.reshape(()), 0.0, 1.0))


def _as_integer(apply: Tensor, kind: torch.dtype) -> Tensor:
    """The decision as a 0-d integer ``0`` or ``1`` of ``kind`` (the selects' factor on bit
    patterns), once per decision and width (:func:`derived`): every state list and group
    of an update shares it."""
    return derived(f"as {kind}", apply, lambda a: a.reshape(()).to(kind))


def descending(lr: Tensor) -> Tensor:
    """``-lr`` as a 0-d tensor: the learning rate PyTorch's fused kernels descend by, from
    the op's signed factor; once per factor (:func:`derived`)."""
    return derived("neg", lr, lambda x: torch.neg(x.reshape(())))


_DERIVED: dict = {}  # (name, id of the tensor) -> (the tensor, its version, the value)
_DERIVED_KEPT = 64
_DERIVED_LOCK = threading.Lock()  # updates in several threads share it


def _kept(x: Tensor) -> bool:
    """Whether a value derived from ``x`` may be kept: a plain tensor (a DTensor holds its
    mesh, whose process group the cache would keep alive into interpreter exit), in plain
    eager mode, not a trace, a transform, or, for a CUDA tensor, a CUDA graph's capture
    (which must record every launch that makes it; only CUDA's launches are captured)."""
    return type(x) is Tensor and not (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or (x.is_cuda and torch.cuda.is_current_stream_capturing())
    )


def remember(name: str, x: Tensor, value: Tensor) -> None:
    """Records ``value`` as ``derived(name, x)`` (made by the op that made ``x``)."""
    if _kept(x):
        with _DERIVED_LOCK:
            while len(_DERIVED) >= _DERIVED_KEPT:  # the least recently used goes
                _DERIVED.pop(next(iter(_DERIVED)))
            _DERIVED[(name, id(x))] = (x, x._version, value)


def derived(name: str, x: Tensor, make) -> Tensor:
    """``make(x)``, made once for the tensor ``x`` while it is unwritten (the same object,
    the same version counter): several groups of one update derive the same 0-d value
    from the same decision or learning rate without a launch each."""
    if not _kept(x):
        return make(x)
    key = (name, id(x))
    with _DERIVED_LOCK:
        found = _DERIVED.get(key)
        if found is not None and found[0] is x and found[1] == x._version:
            _DERIVED[key] = _DERIVED.pop(key)  # the most recently used
            return found[2]
    value = make(x)
    remember(name, x, value)
    return value


def start_from(out: list[Tensor], old: list[Tensor]) -> list[Tensor]:
    """``out`` holding ``old``'s values (one multi-tensor copy where they are other
    tensors; nothing where ``out`` is ``old``, a donated step)."""
    if out and any(o is not x for o, x in zip(out, old)):
        torch._foreach_copy_(out, old)
    return out


def fma_step_(out: list[Tensor], master: list[Tensor], v: list[Tensor], lr: Tensor, skip: Tensor):
    r"""``out = fma(v, lr, master)`` per element where the step applies, else ``master``
    bit for bit; in place in ``out`` (which may be ``master``), no temporary.

    .. math:: m' = \operatorname{fl}_{32}(m + v\,\eta)

    rounded once, as the compiled kernels contract it. It is PyTorch's fused SGD
    kernel (``torch._fused_sgd_``) with no momentum or decay, ascending by the
    signed ``lr`` (``maximize``: :math:`m + \eta v`), and ``found_inf = skip``:
    a skipped step returns before it writes. A multi-tensor op would take
    ``lr`` as a device tensor only as a separate product (two roundings); this
    kernel contracts it (PyTorch's CPU kernel is measured exact against the
    float64 reference; CUDA's is compiled with contraction).
    """
    if not out:
        return
    start_from(out, master)
    torch._fused_sgd_(
        out, v, [], weight_decay=0.0, momentum=0.0, lr=lr.reshape(()), dampening=0.0,
        nesterov=False, maximize=True, is_first_step=False, grad_scale=None, found_inf=skip,
    )  # fmt: skip


def correct_sqrt(x: list[Tensor], out: list[Tensor] | None = None) -> list[Tensor]:
    """The correctly rounded square roots of float32 tensors (see ``sqrt_rn``), on lists,
    into ``out`` where given (which may be ``x``), else into new tensors.

    CUDA's square root is correctly rounded: one multi-tensor op. The CPU's
    multi-tensor square root is not always (about 0.6 % of float32 inputs are
    one ulp off), so there it is taken in float64 (exact to round once to
    float32), a batch of at most :data:`SQRT_BATCH` elements at a time, so that
    its temporary stays bounded (three multi-tensor ops a batch).
    """
    if out is None:
        out = [torch.empty_like(t) for t in x]
    if not x:
        return out
    if x[0].device.type == "cuda":
        start_from(out, x)
        torch._foreach_sqrt_(out)
        return out
    for src, dst in pieces([x, out], SQRT_BATCH):
        wide = [torch.empty_like(t, dtype=torch.float64) for t in src]
        torch._foreach_copy_(wide, src)
        torch._foreach_sqrt_(wide)
        torch._foreach_copy_(dst, wide)
    return out


SQRT_BATCH = 1 << 20
"""The most elements a float64 conversion takes at once (8 MiB): the CPU's square root and
the sum of squares of the clipping norm."""


def pieces(lists: list[list[Tensor]], size: int):
    """Aligned pieces of several lists of tensors of the same shapes: per piece, one list
    per input list, of at most ``size`` elements in all (a list's tensor ``i`` and its
    slices match every other list's).

    A tensor larger than ``size`` is cut into flat slices where the tensors of every list
    are contiguous at its position (views: writing a piece writes the tensor), else it is
    a piece of its own, whole. A kernel that works piece by piece keeps its temporaries
    to a piece's size, whatever the number of parameters, in a number of multi-tensor ops
    that grows with the elements, never with the leaves.
    """
    if any(len(xs) != len(lists[0]) for xs in lists):
        raise ValueError(f"pieces: lists of {[len(xs) for xs in lists]} tensors, not aligned")
    held, out = 0, [[] for _ in lists]
    for i, first in enumerate(lists[0]):
        n = first.numel()
        row = [xs[i] for xs in lists]
        if n <= size or not all(t.is_contiguous() for t in row):
            cut = [row]
        else:
            flat = [t.view(-1) for t in row]
            cut = [[f[j : j + size] for f in flat] for j in range(0, n, size)]
        for part in cut:
            if held and held + part[0].numel() > size:
                yield out
                held, out = 0, [[] for _ in lists]
            for xs, t in zip(out, part):
                xs.append(t)
            held += part[0].numel()
    if held or out[0]:
        yield out


def restore_skipped_(
    apply: Tensor, out: list[Tensor], old: list[Tensor], into_old: bool = False
) -> None:
    r"""``out[i] = out[i] if apply else old[i]``, bit for bit, in place and without a
    temporary: on the bit patterns as integers, :math:`o \leftarrow o_{old} + (o - o_{old})\,a`
    with :math:`a \in \{0, 1\}` (integer arithmetic wraps, so it is exact for every
    pattern). ``out`` holds new values the step computed in its own buffers. With
    ``into_old`` the result goes into ``old`` instead (``out`` is then a spent temporary)."""
    for kind, idx in by_bit_width(out):
        o = [out[i].view(kind) for i in idx]
        old_bits = [old[i].view(kind) for i in idx]
        torch._foreach_sub_(o, old_bits)
        torch._foreach_mul_(o, _as_integer(apply, kind))
        if into_old:
            torch._foreach_add_(old_bits, o)
        else:
            torch._foreach_add_(o, old_bits)


def select_into(
    apply: Tensor, new: list[Tensor], old: list[Tensor], out: list[Tensor], consume: bool = False
) -> None:
    r"""``out[i] = new[i] if apply else old[i]``, bit for bit, on lists and without reading
    ``apply`` on the host.

    On the bit patterns as integers of the same width, with :math:`a \in \{0, 1\}`:
    :math:`o = n\,a + o_{\text{old}}\,(1 - a)`, exact (one term is zero, the other a
    product by one), for every value, inf, NaN and signed zero. ``out`` may be
    ``old`` (a donated step); every ``new`` is computed before. With ``consume`` the
    ``new`` tensors are the caller's temporaries and are overwritten (no further buffer).
    """
    for kind, idx in by_bit_width(new):
        a = _as_integer(apply, kind)
        keep = 1 - a
        n = [new[i].view(kind) for i in idx]
        o = [out[i].view(kind) for i in idx]
        if any(out[i] is not old[i] for i in idx):
            torch._foreach_copy_(o, [old[i].view(kind) for i in idx])
        torch._foreach_mul_(o, keep)
        if consume:
            torch._foreach_mul_(n, a)  # ``new`` is a temporary of the caller's: no other
            torch._foreach_add_(o, n)
        else:
            torch._foreach_add_(o, torch._foreach_mul(n, a))


def write_lists(apply: Tensor, new: dict, direction: list[Tensor], lr: Tensor, **lists) -> None:
    """:func:`write_member` for every leaf at once, consuming the temporaries it is given.

    The master steps in place in ``master_out`` (:func:`fma_step_`: ``m + lr * direction``
    where ``apply``); each state of ``new`` (its new values, the caller's temporaries) is
    selected into its ``<name>_out``; then the working copies are refreshed
    (:func:`refresh_params`). ``lists`` holds each name's input and output lists."""
    fma_step_(lists["master_out"], lists["master"], direction, lr, skip_flag(apply))
    for name, value in new.items():
        if value is not None:
            select_into(apply, value, lists[name], lists[f"{name}_out"], consume=True)
    refresh_params(apply, lists["master_out"], lists["params"], lists["params_out"])


def adam_direction_(u, new_mu, denom, master, inv_c1, sqrt_c2, eps, decoupled) -> list:
    r"""Adam's direction on lists, in ``u``'s buffers (returned), from the new first
    moments and the square roots of the new second moments (``denom``, overwritten):

    .. math:: \sigma = \frac{a'}{\sqrt{v'} / \sqrt{c_2} + \epsilon}\, c_1^{-1}
              \;(+\, \lambda_d\, m)
    """
    torch._foreach_div_(denom, sqrt_c2.reshape(()))
    torch._foreach_add_(denom, eps)
    step = start_from(u, new_mu)  # u's buffers: a' / denom, as one division
    torch._foreach_div_(step, denom)
    torch._foreach_mul_(step, inv_c1.reshape(()))
    if decoupled != 0.0:
        torch._foreach_add_(step, master, alpha=decoupled)
    return step


def refresh_params(apply: Tensor, master_out, params, params_out, scratch=None) -> None:
    r"""The working copies that are their own tensors: ``fl16`` of the new master where
    ``apply``, else the old ones bit for bit, without reading ``apply`` on the host.

    On the bit patterns as integers, :math:`p' = p + (\operatorname{fl}_{16}(m') - p)\,a`
    with :math:`a \in \{0, 1\}` (exact: integer arithmetic wraps), a fixed number of
    multi-tensor ops. A pure step rounds into its fresh outputs and restores the skipped
    bits there (no temporary); a donated one rounds into a temporary (2 B a parameter
    for FP16 copies), or into the memory of ``scratch`` (float32 tensors of the same
    leaves that are spent), and adds the difference into the copies in place.
    """
    own = [
        i for i, (m, p) in enumerate(zip(master_out, params_out)) if p.data_ptr() != m.data_ptr()
    ]
    if not own:
        return
    old = [params[i] for i in own]
    out = [params_out[i] for i in own]
    rounded_from = [master_out[i] for i in own]
    if any(o is not x for o, x in zip(out, old)):  # fresh outputs
        torch._foreach_copy_(out, rounded_from)
        restore_skipped_(apply, out, old)
        return
    spent = [None] * len(out) if scratch is None else [scratch[i] for i in own]
    rounded = [_room(p, s) for p, s in zip(out, spent)]
    torch._foreach_copy_(rounded, rounded_from)
    restore_skipped_(apply, rounded, out, into_old=True)


def _room(p: Tensor, spent: Tensor | None) -> Tensor:
    """A tensor like ``p`` to round into: in the memory of the spent float32 tensor
    ``spent`` (of ``p``'s elements, at least as wide) where both are dense, else new."""
    if (
        spent is not None
        and spent.numel() == p.numel()
        and spent.element_size() >= p.element_size()
        and spent.is_contiguous()
        and p.is_contiguous()
    ):
        return spent.reshape(-1).view(p.dtype)[: p.numel()].view(p.shape)
    return torch.empty_like(p)


def largest_magnitudes(grads: list[Tensor]) -> Tensor:
    """Per leaf its largest ``|g|`` as float32 (NaN where it holds a NaN, 0 for an empty
    leaf), one multi-tensor norm and a stack."""
    shown = grads
    if not all(map(Tensor.numel, grads)):  # an empty leaf's peak is 0: the norm of one zero
        shown = [g if g.numel() else g.new_zeros(1) for g in grads]
    return torch.stack(torch._foreach_norm(shown, float("inf"), dtype=torch.float32))


def stats_lists(grads, inv, sum_squares, peak, sq) -> None:
    """:func:`stats_generic` of one group of one member, with multi-tensor ops."""
    tops = largest_magnitudes(grads)
    inf = float("inf")  # a NaN anywhere makes the leaf's peak +inf (norms are never -inf)
    torch.nan_to_num(tops, nan=inf, posinf=inf, out=peak)
    if sum_squares:
        sums = []
        for src in _unscaled_pieces(grads, inv):  # bounded float32 and float64 temporaries
            wide = [torch.empty_like(x, dtype=torch.float64) for x in src]
            torch._foreach_copy_(wide, src)
            del src
            torch._foreach_mul_(wide, wide)  # the squares, exact in float64
            sums += torch._foreach_norm(wide, 1)  # each piece's sum
        torch.sum(torch.stack(sums).reshape(1, -1), dim=1, out=sq)  # into the output
