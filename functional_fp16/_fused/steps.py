"""``impl="fused"``: a declared optimiser as a few calls of ``torch.library`` ops.

Every fusable optimiser registers a :class:`Fusable` here
(:mod:`functional_fp16._fused.sgd`, :mod:`functional_fp16._fused.adam`): how
to read its plan from a leaf's declared parts, where a leaf's state tensors
are, and its step. :func:`fused_plan` resolves a state's optimiser once per
structure (masks and labels included, see :mod:`functional_fp16._fused.groups`)
into a :class:`FusedPlan`: groups of leaves with one plan each, and the
positions of every tensor the step reads, in the flattened state. A call then
does no more than the arithmetic needs:

1. with clipping, several groups or a cross-replica ``agree``, one
   ``functional_fp16::grad_stats`` call over all leaves: each leaf's peak
   magnitude for its finite flag (``state.leaf_finite``) and the decision, and
   the sum of squares for the global norm; otherwise the op decides and
   returns the leaves' flags, found in its own pass over the gradients;
2. one ``functional_fp16::sgd_step`` / ``adam_step`` call per group
   (``sgd_step_`` / ``adam_step_`` when donating, and on the plain kernels'
   shared path below), which reads gradient,
   master and optimiser state once and writes them and the working copy once:
   22 bytes per parameter for SGD with momentum and FP16 gradients and
   parameters, 30 for Adam. A pure CPU SGD step of one group without step 1
   finds the gradients' peak while it updates, and undoes a skipped step
   afterwards (20 bytes per parameter). On the plain kernels (CUDA's default)
   the update does its groups' unscale, state copy and refresh itself, once
   (:mod:`functional_fp16._fused.across_groups`), where their kernels only read
   the gradients: each group's op then steps its masters only.

The scalars a step needs (the unscale factor, the learning rate of each
schedule, each Adam part's bias corrections, the new counters) are computed
once per call and shared by the groups. Decisions, loss scale, counters and
skipped steps are bitwise the reference's, the master within one ulp.

Because each step is an op, ``torch.compile`` calls the same kernel (the op
is opaque to Inductor), ``vmap`` batches inside it (``K`` members are ``K``
groups of one call) and a CUDA graph captures it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._fused import across_groups, plain_kernels
from functional_fp16._fused.bookkeeping import bookkeep
from functional_fp16._fused.chains import chain_parts
from functional_fp16._fused.device_kernels import finite_from_peak
from functional_fp16._fused.groups import leaf_parts
from functional_fp16._fused.op_library import _transformed, call_grad_stats
from functional_fp16._fused.step_scalars import step_scalars
from functional_fp16._kernels.signatures import DTYPE_CODES, dense
from functional_fp16._util.tree import tree_flatten, tree_leaves, tree_rebuild
from functional_fp16.precision.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    known_inverse,
    unscale_inverse,
)
from functional_fp16.precision.master_split import holds_residuals
from functional_fp16.transforms.base import saturating_increment
from functional_fp16.transforms.clipping import clip_factors, norm_of_leaf_sums, wants_leaf_sums
from functional_fp16.transforms.hyperparams import InjectHyperparamsState, InjectSpec
from functional_fp16.transforms.schedules import declared_form
from functional_fp16.transforms.sgd import LearningRateSpec

__all__ = ["Fusable", "register", "Group", "FusedPlan", "fused_plan", "why_not_fused"]
__all__ += ["fused_update", "incremented"]


class Fusable(NamedTuple):
    """A fusable optimiser: what its module registers with :func:`register`.

    Its plan (a NamedTuple, hashable) has at least ``max_norm`` (``None``: no
    clipping), ``learning_rate`` (a number or a schedule), ``sign`` and
    ``lr_path`` (the key of its learning-rate part).
    """

    name: str
    read: Callable[[list[tuple[Any, tuple]]], Any]  # a leaf's (spec, key) parts -> plan or None
    # (plan, {part key: state positions}) -> (per-leaf role positions, shared 0-d positions)
    positions: Callable[[Any, dict], tuple[dict[str, int], dict[str, int]]]
    # (plan, grads, masters, roles, shared, own params, common, donate, memo)
    #   -> (masters', roles', params', finite, shared')
    step: Callable[..., tuple]
    # (plan, {part key: state positions}) -> the leaf's index among its optimiser part's
    # leaves (the stochastic rounding's leaf salt); None: the step does not need it
    index: Callable[[Any, dict], int] | None = None
    # (plan, shared positions, masters) -> [(memo key, count position, forms)]: what the
    # step reads of a count (``step_scalars``' programs, e.g. ("count",)), made before it
    # runs; the memo holds one output, or a tuple of them for several forms
    counts: Callable[[Any, dict, list], list[tuple[Any, int, tuple]]] | None = None
    # plan -> whether its plain kernel only reads float32 gradients given with nothing to
    # unscale or clip (PyTorch's fused kernels): then the update unscales, copies and
    # refreshes once for all its groups (``across_groups``)
    reads_unscaled: Callable[[Any], bool] | None = None


_FUSABLE: list[Fusable] = []


def register(fusable: Fusable) -> None:
    """Makes ``fusable`` one of the optimisers :func:`fused_plan` recognises."""
    _FUSABLE.append(fusable)


class Group(NamedTuple):
    """Leaves that one op call steps: one plan, one set of shared counters."""

    fusable: Fusable
    plan: Any
    leaves: tuple[int, ...]  # positions among the master's leaves, increasing
    whole: bool  # the group holds every leaf, in order
    roles: tuple[tuple[str, tuple[int, ...]], ...]  # per-leaf state: (role, opt positions)
    shared: tuple[tuple[str, int], ...]  # 0-d state: (name, opt position)
    separate: tuple[bool, ...]  # per leaf of the group: the working copy is its own tensor
    # per leaf of the group: its index among its optimiser part's leaves (Fusable.index)
    indices: tuple[int, ...] = ()


class FusedPlan(NamedTuple):
    """What the fused update needs to know about a state: derived from its static metadata."""

    groups: tuple[Group, ...]
    max_norm: float | None  # the global clip of every leaf (None: no clipping)
    n_leaves: int
    opt_spec: Any  # the optimiser state's tree structure
    strides: tuple[tuple[int, ...], ...]  # the master's strides, leaf by leaf
    decides: bool  # one group, no clipping: the op decides the step itself
    # inject_hyperparams: the learning-rate parts that take the injected learning rate
    # (None: no injection), and the transform built with the initial Python values.
    injected: tuple | None = None
    probe: Any = None

    @property
    def fusable(self) -> Fusable:
        """The optimiser of the first group (every group's, unless labels mix them)."""
        return self.groups[0].fusable


def _group_leaves(state, parts: list[list]) -> tuple[str | None, FusedPlan | None]:
    """Reads each leaf's parts as a chain and groups the leaves with equal plans."""
    found: dict[Any, list[int]] = {}
    chosen: dict[Any, tuple[Fusable, dict]] = {}
    indices: dict[int, int] = {}
    for leaf, leaf_parts_ in enumerate(parts):
        chain = [(spec, key) for spec, key, _ in leaf_parts_]
        if any(isinstance(x, torch.Tensor) for spec, _ in chain for x in spec):
            # The fused ops take their hyperparameters as numbers (a tensor's value is not
            # read on the host; ``inject_hyperparams`` is how a value changes between steps)
            return "a hyperparameter given as a tensor", None
        for fusable in _FUSABLE:
            plan = fusable.read(chain)
            if plan is not None:
                break
        else:
            return "an optimiser that is not a fusable chain", None
        by_key = {key: where for _, key, where in leaf_parts_}
        try:
            roles, shared = fusable.positions(plan, by_key)
        except KeyError:  # a declared part whose state has another layout
            return "an optimiser state of another layout", None
        if callable(plan.learning_rate):
            shared = {**shared, "lr_count": by_key[plan.lr_path]["count"]}
        if fusable.index is not None:
            indices[leaf] = fusable.index(plan, by_key)
        group_key = (fusable.name, plan, tuple(sorted(shared.items())))
        found.setdefault(group_key, []).append(leaf)
        chosen.setdefault(group_key, (fusable, {}))[1][leaf] = roles
    clips = {(k[1].max_norm, _clip_key(parts[v[0]])) for k, v in found.items()}
    if len(clips) != 1:
        return "clipping that does not cover every leaf alike", None
    max_norm = next(iter(clips))[0]
    params = tree_leaves(state.params)
    n = len(params)
    groups = []
    for group_key, leaves in found.items():
        fusable, roles_by_leaf = chosen[group_key]
        names = sorted(roles_by_leaf[leaves[0]])
        roles = tuple((r, tuple(roles_by_leaf[i][r] for i in leaves)) for r in names)
        separate = tuple(params[i].dtype != torch.float32 for i in leaves)
        whole = len(leaves) == n
        own = tuple(indices[i] for i in leaves) if fusable.index is not None else ()
        groups.append(
            Group(fusable, group_key[1], tuple(leaves), whole, roles, group_key[2], separate, own)
        )
    masters = tree_leaves(state.master)
    strides = tuple(m.stride() for m in masters)
    decides = len(groups) == 1 and max_norm is None
    opt_spec = tree_flatten(state.opt_state)[1]
    return None, FusedPlan(tuple(groups), max_norm, n, opt_spec, strides, decides)


def _clip_key(parts: list) -> Any:
    """The key of the clipping part acting on a leaf (``None``: none)."""
    from functional_fp16.transforms.clipping import ClipSpec

    for spec, key, _ in parts:
        if isinstance(spec, ClipSpec):
            return key
    return None


def _injected_lr(spec: InjectSpec) -> tuple[str | None, Any, tuple]:
    """``(why not, probe, paths)`` of an injected transform: the transform built with the
    initial values, and the keys of its learning-rate parts that take the injected learning
    rate (found by building it with a second value: exactly those parts change)."""
    if spec.schedules:
        return "injected schedules (evaluated each update)", None, ()
    names = [n for n, _ in spec.numeric]
    if names != ["learning_rate"]:
        others = ", ".join(n for n in names if n != "learning_rate") or "no learning rate"
        return f"injected hyperparameters other than the learning rate ({others})", None, ()
    lr0 = spec.initial()["learning_rate"]
    probe = spec.build({"learning_rate": lr0})
    other = spec.build({"learning_rate": 2.0 * lr0 + 1.0})
    a, b = chain_parts(probe.spec), chain_parts(other.spec)
    if a is None or b is None or len(a) != len(b):
        return "an optimiser that is not a fusable chain", None, ()
    paths = []
    for (sa, pa), (sb, _) in zip(a, b):
        if sa == sb:
            continue
        if not (
            isinstance(sa, LearningRateSpec)
            and isinstance(sb, LearningRateSpec)
            and sa.learning_rate == lr0
            and sb.learning_rate == 2.0 * lr0 + 1.0
        ):
            return "an injected learning rate that enters more than a learning-rate part", None, ()
        paths.append(pa)
    return None, probe, tuple(paths)


def _examine(state) -> tuple[str | None, FusedPlan | None]:
    """``(why not, plan)``: the reason ``state`` cannot take the fused op, or its plan."""
    spec = getattr(state.tx, "spec", None)
    if isinstance(spec, InjectSpec):
        if not isinstance(state.opt_state, InjectHyperparamsState):
            return "an injected transform's state of another type", None
        why, probe, paths = _injected_lr(spec)
        if why is not None:
            return why, None
        why, fp = _examine(state.replace(tx=probe, opt_state=state.opt_state.inner_state))
        return why, None if fp is None else fp._replace(injected=paths, probe=probe)
    if not isinstance(state.loss_scale, (DynamicLossScale, StaticLossScale, NoOpLossScale)):
        return "a loss scale of another type", None
    parts = leaf_parts(getattr(state.tx, "spec", None), state.master, state.opt_state)
    if parts is None:
        return "an optimiser that is not a fusable chain", None
    masters = tree_leaves(state.master)
    params = tree_leaves(state.params)
    opt = tree_leaves(state.opt_state)
    device = masters[0].device
    if any(t.device != device for t in [*masters, *params]):
        return "tensors on several devices", None
    why, fp = _group_leaves(state, parts)
    if fp is None:
        return why, None
    if holds_residuals(masters):  # a split master
        if any(p.dtype != torch.float16 for p in params):
            return "a split master beside params that are not float16", None
    elif any(m.dtype != torch.float32 for m in masters):
        return "a master that is not float32", None
    for g in fp.groups:
        allowed = getattr(g.plan, "state_dtypes", (torch.float32,))
        if any(opt[i].dtype not in allowed for r, pos in g.roles if r not in _SIDE for i in pos):
            return "an optimiser state that is not float32", None
    for p in params:
        if p.dtype not in DTYPE_CODES:
            return f"a working copy of dtype {p.dtype}", None
    layout = [(m.shape, m.stride()) for m in masters]
    if [(p.shape, p.stride()) for p in params] != layout or not all(dense(m) for m in masters):
        return "state tensors that are not dense with one layout", None
    for g in fp.groups:
        for r, pos in g.roles:
            if r in _SIDE:
                continue  # block scales: the op checks them
            if [(opt[i].shape, opt[i].stride()) for i in pos] != [layout[i] for i in g.leaves]:
                return "state tensors that are not dense with one layout", None
    return None, fp


_SIDE = ("mu_scales", "nu_scales", "trace_scales")
"""Roles that hold a coded moment's block scales (-1 where a leaf's moment is not coded)."""


def why_not_fused(state) -> str | None:
    """Why ``state`` cannot take the fused op (``None``: it can). Reads metadata only."""
    return _examine(state)[0]


def fused_plan(state) -> FusedPlan | None:
    """The fused plan of ``state``, or ``None`` when it runs another path.

    A pure function of the state's static metadata (its ``tx``, the masks and
    labels it declares, and the leaves' dtypes, shapes and strides); the
    dispatcher computes it once per state signature.
    """
    return _examine(state)[1]


_STORED = frozenset(DTYPE_CODES)


def _grads_like(g: list[torch.Tensor], masters: list[torch.Tensor], strides) -> list[torch.Tensor]:
    """The gradients laid out like the master (a copy only where strides or dtype differ)."""
    if tuple(map(torch.Tensor.stride, g)) == strides and {x.dtype for x in g} <= _STORED:
        return g
    out = []
    for x, m in zip(g, masters):
        if x.stride() == m.stride() and x.dtype in DTYPE_CODES:
            out.append(x)
        else:
            dtype = x.dtype if x.dtype in DTYPE_CODES else torch.float32
            out.append(torch.empty_like(m, dtype=dtype).copy_(x))
    return out


def _one(x: torch.Tensor | None) -> torch.Tensor | None:
    """A 0-d per-step scalar as the op's one-group form (shape ``(1,)``)."""
    return None if x is None else x.reshape(1)


def _scalars_before(fp: FusedPlan, g, inv, decision, memo: dict, schedules: list):
    """``(apply, require, clip_div, clip_mul, leaf_finite)``: what the ops are told before
    they run, and the leaves' flags where they are known before; the declared schedules'
    signed factors go into ``memo``.

    With one group, no clipping and no cross-replica hook the op decides
    itself (``apply=None``), with the rule's ``require`` (the loss is finite),
    and returns the leaves' flags; otherwise one ``grad_stats`` call gives each
    leaf's peak, hence its flag, the rule (``decision``) the decision from
    them, and the sum of squares the clipping norm. Without hooks one
    ``step_scalars`` call computes the decision, the clip factors and the
    schedules together; a hook (an all-reduce) runs between them otherwise.
    """
    device = g[0].device
    require = decision.require
    require = None if require is None else _one(require.to(device))
    if fp.decides and decision.agree is None:
        _call_step_scalars(schedules, memo, None, None, None, None, 0.0)
        return None, require, None, None, None
    clipping = fp.max_norm is not None
    # A hook that counts leaves differently (a DTensor state's) gets one sum per leaf.
    groups = len(g) if clipping and wants_leaf_sums(decision.global_sum) else 1
    inv_groups = _one(inv)
    if groups > 1 and inv is not None:
        inv_groups = inv_groups.expand(groups).contiguous()
    peak, sum_sq = call_grad_stats(g, inv_groups, groups, 1, clipping)
    if decision.agree is None and decision.global_sum is None:
        sum_sq = sum_sq if clipping else None
        leaves, finite, div, mul = _call_step_scalars(
            schedules, memo, peak, _one(inv), require, sum_sq, fp.max_norm or 0.0
        )
        return finite, None, (div if clipping else None), (mul if clipping else None), leaves
    _call_step_scalars(schedules, memo, None, None, None, None, 0.0)
    leaves, finite = decision.leaves(finite_from_peak(peak, _one(inv)))
    clip_div = clip_mul = None
    if clipping:
        norm = norm_of_leaf_sums(sum_sq, decision.global_sum)
        clip_div, clip_mul = (_one(x) for x in clip_factors(norm, fp.max_norm))
    return _one(finite), None, clip_div, clip_mul, leaves


def _call_step_scalars(schedules: list, memo: dict, peak, inv, require, sum_sq, max_norm):
    """One ``step_scalars`` call (where it has anything to compute): the programs'
    outputs into ``memo`` (under the keys the steps read); returns the decision's and
    the clip's outputs."""
    if peak is None and sum_sq is None and not schedules:
        return None
    programs = [(c, sign, form) for _, c, sign, forms in schedules for form in forms]
    leaves, finite, div, mul, lrs = step_scalars(peak, inv, require, sum_sq, max_norm, programs)
    outputs = iter(lrs)
    for key, _, _, forms in schedules:
        made = [next(outputs) for _ in forms]
        memo[key] = made[0] if len(made) == 1 else tuple(made)
    return leaves, finite, div, mul


def _inverse(loss_scale, schedules: list, memo: dict) -> tuple[torch.Tensor | None, list]:
    """``(the unscale factor, the programs still to run)``: the factor the last update's
    bookkeeping kept, else made by a ``step_scalars`` call before the gradients are
    read, which runs the step's programs with it (a trace, or the first update of a
    state: one launch instead of its three)."""
    if isinstance(loss_scale, NoOpLossScale):
        return None, schedules
    known = known_inverse(loss_scale)
    scale = loss_scale.loss_scale
    if known is not None or type(scale) is not torch.Tensor or scale.dtype != torch.float32:
        return (unscale_inverse(loss_scale) if known is None else known), schedules
    mine = ("inverse", scale.view(torch.int32), 1.0, (("inverse",),))  # the scale's bits
    _call_step_scalars([mine, *schedules], memo, None, None, None, None, 0.0)
    return memo["inverse"].reshape(()), []


def _declared_schedules(fp: FusedPlan, memo: dict, masters: list) -> list:
    """``(memo key, count, sign, declared form)`` of each distinct schedule the groups
    evaluate (an injected learning rate's parts excepted), and of each count a step reads
    as float32 (``Fusable.counts``)."""
    out, seen = [], set()
    injected = memo.get("injected", ((),))[0]
    for grp in fp.groups:
        plan, shared = grp.plan, dict(grp.shared)
        if grp.fusable.counts is not None:
            for key, position, forms in grp.fusable.counts(plan, shared, masters):
                if key not in seen:
                    seen.add(key)
                    out.append((key, memo["opt"][position], 1.0, forms))
        if not callable(plan.learning_rate) or plan.lr_path in injected:
            continue
        form = declared_form(plan.learning_rate)
        if form is None:
            continue
        position = shared["lr_count"]
        key = ("lr", position, plan.learning_rate, plan.sign)
        if key not in seen:
            seen.add(key)
            out.append((key, memo["opt"][position], float(plan.sign), (form,)))
    return out


def _lr_factor(plan, shared: dict, like: torch.Tensor, memo: dict):
    if "injected" in memo and plan.lr_path in memo["injected"][0]:
        return (memo["injected"][1] * plan.sign).to(torch.float32).reshape(1)
    return _planned_lr_factor(plan, shared, like, memo)


_CONSTANTS: dict = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a ``(1,)`` float32 tensor on ``device``: kept across calls in eager
    mode, a fresh fill where it would be traced or captured."""
    if _transformed() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.full((1,), value, dtype=torch.float32, device=device)
    key = (value, device)
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 256:  # learning rates that change by hand, call after call
            _CONSTANTS.clear()
        _CONSTANTS[key] = torch.full((1,), value, dtype=torch.float32, device=device)
    return _CONSTANTS[key]


def _planned_lr_factor(plan, shared: dict, like: torch.Tensor, memo: dict):
    r"""The signed step factor :math:`\sigma\,\eta_t` as a ``(1,)`` float32 tensor.

    A constant :math:`\eta` is made once per value and device and kept (no op reads
    more than its value, none writes it); in a trace (``torch.compile``, a CUDA graph's
    capture) it is a fill, so that the graph holds it. A schedule is evaluated at its
    count (the number of applied steps), once per call for every group that shares it.
    """
    if not callable(plan.learning_rate):
        key = ("lr", plan.sign * plan.learning_rate)
        if key not in memo:
            memo[key] = _constant(key[1], like.device)
        return memo[key]
    key = ("lr", shared["lr_count"], plan.learning_rate, plan.sign)
    if key not in memo:
        lr = plan.learning_rate(memo["opt"][shared["lr_count"]]).to(torch.float32) * plan.sign
        memo[key] = lr.reshape(1)
    return memo[key]


def incremented(memo: dict, position: int) -> torch.Tensor:
    """The counter at ``position`` of the optimiser state plus one (saturating), once per call."""
    key = ("incremented", position)
    if key not in memo:
        memo[key] = saturating_increment(memo["opt"][position])
    return memo[key]


def _injected_update(state, g_leaves, fp: FusedPlan, decision, donate: bool, laid_out: bool):
    """The fused step of an injected transform: the inner state stepped with the state's
    learning rate tensor, the injection's count advanced on an applied step."""
    outer = state.opt_state
    lr = outer.hyperparams["learning_rate"].to(device=tree_leaves(state.master)[0].device)
    inner = state.replace(tx=fp.probe, opt_state=outer.inner_state)
    new = fused_update(
        inner,
        g_leaves,
        fp._replace(injected=None),
        decision,
        donate,
        (fp.injected, lr),
        laid_out=laid_out,
    )
    count = torch.where(new.grads_finite, saturating_increment(outer.count), outer.count)
    opt_state = InjectHyperparamsState(count, outer.hyperparams, new.opt_state)
    return new.replace(tx=state.tx, opt_state=opt_state)


def fused_update(
    state, g_leaves, fp: FusedPlan, decision, donate: bool, injected=None, *, laid_out=False
):
    """One fused step of ``state`` (see the module docstring); returns the new state.

    ``g_leaves`` are the gradients' leaves, in the params' flattening order
    (``laid_out``: already proven laid out like the master, dtypes the params');
    ``decision`` is the step's
    :class:`~functional_fp16.update.decision.Decision` (what must also hold,
    and the cross-replica agreement).
    """
    if fp.injected is not None:
        return _injected_update(state, g_leaves, fp, decision, donate, laid_out)
    masters, m_spec = tree_flatten(state.master)
    params, p_spec = tree_flatten(state.params)
    opt = tree_leaves(state.opt_state)
    g = g_leaves if laid_out else _grads_like(g_leaves, masters, fp.strides)
    memo: dict = {"opt": opt}
    if injected is not None:
        memo["injected"] = injected
    schedules = _declared_schedules(fp, memo, masters)
    inv, schedules = _inverse(state.loss_scale, schedules, memo)
    apply, require, clip_div, clip_mul, leaf_finite = _scalars_before(
        fp, g, inv, decision, memo, schedules
    )
    new_m, new_p, new_opt = list(masters), list(params), list(opt)
    pending: dict[int, None] = {}  # positions of the counts and flags to advance, in order
    finite = None
    once = across_groups.applies(fp, masters)
    stepped, stepped_opt = masters, opt  # what the ops step
    if once:  # the groups' unscale, state copy and refresh once (``across_groups``)
        u = plain_kernels.read_unscaled(g, masters, inv, clip_div, clip_mul)
        # spent after the ops: the update's own, or the caller's if donated
        spent = u if any(x is not y for x, y in zip(u, g)) else None
        if spent is None and donate:
            spent = across_groups.donated_room(fp, u, params)
        g = u
        inv = clip_div = clip_mul = None
        if not donate:
            stepped, stepped_opt = across_groups.state_copies(fp, masters, opt)
    for grp in fp.groups:
        if grp.whole:
            gg, mm, pp = g, stepped, params
        else:
            gg = [g[i] for i in grp.leaves]
            mm = [stepped[i] for i in grp.leaves]
            pp = [params[i] for i in grp.leaves]
        separate = (False,) * len(mm) if once else grp.separate  # once: masters only
        own = [p for p, s in zip(pp, separate) if s]
        roles = {r: [stepped_opt[i] for i in pos if i >= 0] for r, pos in grp.roles}
        shared = dict(grp.shared)
        memo["indices"] = grp.indices
        lr = _lr_factor(grp.plan, shared, masters[0], memo)
        common = dict(inv=_one(inv), clip_div=clip_div, clip_mul=clip_mul, lr=lr, apply=apply)
        common.update(require=require, separate=list(separate), members=1)
        m_out, roles_out, p_out, (flag, leaves), shared_out = grp.fusable.step(
            grp.plan, gg, mm, roles, shared, own, common, donate or once, memo
        )
        finite = flag.reshape(())
        if apply is None:
            apply = flag  # one group decides; no other group follows it
            leaf_finite = leaves
        if grp.whole and len(p_out) == len(m_out):  # every leaf, each with its working copy
            new_m, new_p = list(m_out), list(p_out)
        else:
            it = iter(p_out)
            for j, (i, s) in enumerate(zip(grp.leaves, separate)):
                new_m[i] = m_out[j]
                new_p[i] = next(it) if s else m_out[j]
        for r, pos in grp.roles:
            for i, t in zip([i for i in pos if i >= 0], roles_out[r]):
                new_opt[i] = t
        for name, pos in grp.shared:
            if name in shared_out:
                new_opt[pos] = shared_out[name]
            else:  # a count (advanced on an applied step) or a flag (set): bookkeeping's
                pending[pos] = None
    if once:  # every group's decision: ``apply`` given, or the one group's own
        del g, gg, u
        new_p = across_groups.refresh(fp, apply, new_m, params, donate, spent)
        del spent
    loss_scale, stats, step, advanced = bookkeep(state, finite, [opt[p] for p in pending])
    for pos, t in zip(pending, advanced):
        new_opt[pos] = t
    return state.replace(
        params=tree_rebuild(p_spec, state.params, new_p),
        master=tree_rebuild(m_spec, state.master, new_m),
        opt_state=tree_rebuild(fp.opt_spec, state.opt_state, new_opt),
        loss_scale=loss_scale,
        step=step,
        grads_finite=finite,
        scale_stats=stats,
        leaf_finite=leaf_finite,
    )
