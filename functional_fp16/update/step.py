r"""``fp16_update``: the whole mixed-precision step, as one pure function.

.. math::
    \hat g = \operatorname{fl}_{32}(g)\cdot \operatorname{fl}_{32}(1 / \operatorname{fl}_{64}(s)), \quad
    f = \textstyle\bigwedge \operatorname{isfinite}(\hat g), \quad
    (u, o') = \text{tx.update}(\hat g, o, m), \quad
    m' = f\ ?\ m + u : m, \quad p' = \operatorname{fl}_{16}(m'), \quad s' = \operatorname{adjust}(s, f)

Which implementation runs is decided in :mod:`functional_fp16.update.dispatch`.
"""

from __future__ import annotations

import operator

import torch

from functional_fp16._kernels import cpu as c_kernel
from functional_fp16._util.cache import remember
from functional_fp16._util.dtensors import any_dtensor
from functional_fp16._util.tree import PyTree, check_like, tree_flatten, tree_map
from functional_fp16.update.batching import is_batched, per_member
from functional_fp16.update.decision import Decision, FiniteHook, SumHook
from functional_fp16.update.dispatch import IMPLEMENTATIONS, route
from functional_fp16.update.state import FP16State
from functional_fp16.update.state_check import check_disjoint, check_state, mark_checked

__all__ = ["fp16_update", "update_path"]

_SHARDED_MESSAGE = (
    "state holds this rank's Shard(0) DTensors of the FP32 master and optimiser state "
    "beside whole params (from functional_fp16.distributed.shard_state): update it with "
    "functional_fp16.distributed.sharded_update on every rank, or gather it with "
    "unshard_state first"
)


def fp16_update(
    state: FP16State,
    grads: PyTree,
    *,
    impl: str = "auto",
    loss: torch.Tensor | None = None,
    donate: bool = False,
    agree: FiniteHook | None = None,
    global_sum: SumHook | None = None,
) -> FP16State:
    r"""One mixed-precision optimiser step, as a pure function.

    ``grads`` are the gradients of the *scaled* loss with respect to
    ``state.params`` (same structure, shapes, dtypes and device). With
    :math:`s` the loss scale and :math:`m` the FP32 master:

    .. math::
        \hat g &= \operatorname{fl}_{32}(g)\cdot \operatorname{fl}_{32}(1/\operatorname{fl}_{64}(s)) \\
        f &= \textstyle\bigwedge_i \operatorname{isfinite}(\hat g_i) \\
        (u, o') &= \text{tx.update}(\hat g, o, m) \\
        m' &= m + u \text{ if } f \text{ else } m, \qquad o' = o' \text{ if } f \text{ else } o \\
        p' &= \operatorname{fl}_{16}(m'), \qquad s' = \text{adjust}(s, f)

    A skipped step (:math:`f` false) leaves ``master``, ``params`` and every
    optimiser-state tensor bitwise unchanged; only the loss scale, ``step`` and
    ``grads_finite`` move. No input tensor is modified and nothing is read back
    to the host, so the function runs on CUDA without synchronisation and
    compiles with ``torch.compile(fullgraph=True)``.

    Args:
      state: the current :class:`FP16State`.
      grads: gradients of the scaled loss, shaped like ``state.params``.
      loss: optionally, the loss of this step (scaled or not); a non-finite
        loss skips the step like non-finite gradients do.
      impl: which implementation to run: ``"auto"`` (the fused op where
        it applies, else the multi-tensor path; :func:`update_path` tells
        which), ``"fused"`` (the same), ``"foreach"`` or ``"reference"``.
        :mod:`functional_fp16.update.dispatch` decides, from declared
        configuration only.
        Decisions, loss scale and counters are bitwise the same in all;
        the fused kernel contracts multiply-adds (within one ulp of the
        reference's master per step).
      donate: the caller promises never to use ``state`` (or ``grads``) again,
        so the implementation may reuse their memory (like JAX's
        ``donate_argnums``). Off by default: the update is pure.
      agree: maps the local finite flag to the one every replica agrees on
        (e.g. an all-reduce across processes); ``None`` on one process.
      global_sum: for a state that holds one shard of the parameter tree
        (as :func:`~functional_fp16.distributed.sharded_update` steps it),
        maps a float64 partial sum over this shard to the sum over the whole
        tree (e.g. an all-reduce); ``tx.update`` gets it as its
        ``global_sum`` keyword, so that
        :func:`~functional_fp16.transforms.clip_by_global_norm` clips by the
        whole tree's norm. ``None`` (the default): the state holds the
        whole tree.

    Returns:
      The next :class:`FP16State`; ``grads_finite`` says whether it was applied.
    """
    try:
        signature = _check_state(state)
    except (TypeError, ValueError) as err:
        if not (isinstance(state, FP16State) and _params_are_dtensors(state)):
            raise
        # On a mesh, a refusal that only some ranks reach is agreed on first.
        _dtensor_module().dtensor_update(
            state, grads, fp16_update, loss=loss, agree=agree, global_sum=global_sum,
            error=err, impl=impl, donate=donate,
        )  # fmt: skip
        raise  # pragma: no cover - dtensor_update raises
    if _holds_dtensors(state, signature):  # the same update on the local shards
        new = _dtensor_module().dtensor_update(
            state, grads, fp16_update, loss=loss, agree=agree, global_sum=global_sum,
            signature=signature, impl=impl, donate=donate,
            check=lambda: _check_call(state, grads, signature, impl, loss, agree, global_sum,
                                      donate),
        )  # fmt: skip
        return mark_checked(new, signature)
    g_leaves, laid_out = _check_call(state, grads, signature, impl, loss, agree, global_sum, donate)
    # Gradients from an autograd graph (``loss.backward()``, ``torch.autograd.grad``
    # with ``create_graph``) are taken as values: no graph reaches the new state.
    if not laid_out and _any_requires_grad(g_leaves):
        grads = tree_map(torch.Tensor.detach, grads)
        g_leaves = [g.detach() for g in g_leaves]
    chosen = route(state, impl, signature)
    decision = _decision(loss, agree, global_sum)
    # Under torch.func.vmap (a batched state, gradients or loss) the fused op
    # batches inside itself; the other implementations run once per member.
    if not chosen.batches and is_batched([state.step, loss, *g_leaves]):
        return per_member(
            lambda s, g, lo: route(s, impl).run(s, g, _decision(lo, agree, global_sum), False),
            state,
            grads,
            loss,
        )
    # The fused op checks its own arguments; Dynamo traces no data pointers.
    if donate and chosen.name != "fused" and not torch.compiler.is_compiling():
        check_disjoint(state, g_leaves)
    if chosen.run_leaves is not None:  # the leaves flattened once, above
        new = chosen.run_leaves(state, g_leaves, decision, donate, laid_out=laid_out)
        return mark_checked(new, signature)
    return mark_checked(chosen.run(state, grads, decision, donate), signature)


_DTENSOR_STATES: dict = {}  # signature -> whether its params are DTensors


def _check_call(state, grads, signature, impl, loss, agree, global_sum, donate):
    """Refuses a call's arguments (naming the argument or the gradient's path); returns
    ``(the gradients' leaves, laid_out)``, ``laid_out`` where one look at their metadata
    proved them plain tensors without gradient, laid out like the master leaf by leaf (see
    :func:`_grad_leaves`). Reads metadata only: on a mesh, every rank reaches the same
    answer for the same call, and the ranks agree on the calls before they communicate."""
    if impl not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"impl must be 'auto' or one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    g_leaves, laid_out = _grad_leaves(state, grads, signature)
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor or None, got {type(loss).__name__}")
    if agree is not None and not callable(agree):
        raise TypeError(f"agree must be a callable or None, got {type(agree).__name__}")
    if global_sum is not None and not callable(global_sum):
        raise TypeError(f"global_sum must be a callable or None, got {type(global_sum).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be a bool, got {type(donate).__name__}")
    return g_leaves, laid_out


def _holds_dtensors(state: FP16State, signature) -> bool:
    """Whether the params are DTensors (looked up by signature); refuses a sharded
    (ZeRO-1) state, whose DTensor master sits beside plain params."""
    found = None if signature is None else _DTENSOR_STATES.get(signature)
    if found is None:
        found = _dtensor_kind(state)
        if signature is not None:
            remember(_DTENSOR_STATES, signature, found, _LAYOUTS_KEPT)
    if found == "sharded":
        raise ValueError(_SHARDED_MESSAGE)
    return found == "dtensor"


def _params_are_dtensors(state: FP16State) -> bool:
    return any_dtensor(tree_flatten(state.params)[0])


def _dtensor_module():
    """:mod:`functional_fp16.update.dtensor`, imported with DTensor's own module (about a
    second) only once a state of DTensors arrives."""
    from functional_fp16.update import dtensor

    return dtensor


def _dtensor_kind(state: FP16State) -> str:
    if _params_are_dtensors(state):
        return "dtensor"
    if any_dtensor(tree_flatten(state.master)[0]):
        return "sharded"
    return "plain"


_LAYOUTS: dict = {}  # signature -> the params' (tree spec, types, sizes, dtypes, devices)
_FAST_LAYOUTS: dict = {}  # signature -> what leaves_match compares gradients with, or None
_UNKNOWN = object()
_LAYOUTS_KEPT = 256
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _grad_leaves(state: FP16State, grads, signature) -> tuple[list[torch.Tensor], bool]:
    """``(the gradients' leaves, laid_out)``, after checking them against ``state.params``
    (structure, shapes, dtypes, devices; the error names the leaf path).

    For a state with a signature the params' layout is read once and kept, so
    a call compares the gradients' metadata, read in bulk, with it. Where the C++ op
    library is loaded (the CPU's steps load it), one call of
    ``functional_fp16_layout::leaves_match`` compares every
    leaf's sizes, dtype, device, dispatch keys and gradient flag with the params' and its
    strides with the master's (``laid_out``: the update then neither detaches nor lays
    them out again); gradients it does not prove so go through the checks in Python.
    """
    if signature is None or torch.compiler.is_compiling():
        return check_like(state.params, grads, name="grads", reference_name="params"), False
    layout = _LAYOUTS.get(signature)
    if layout is None:
        p_leaves, p_spec = tree_flatten(state.params)
        types = list(map(type, p_leaves))  # plain tensors, or DTensors where params are
        layout = (p_spec, [torch.Tensor if t is torch.nn.Parameter else t for t in types])
        layout += _metadata(p_leaves)
        remember(_LAYOUTS, signature, layout, _LAYOUTS_KEPT)
    leaves, spec = tree_flatten(grads)
    if spec == layout[0] and list(map(type, leaves)) == layout[1]:
        if not torch._C._are_functorch_transforms_active():  # (no op of ours under vmap)
            fast = _FAST_LAYOUTS.get(signature, _UNKNOWN)
            if fast is _UNKNOWN and c_kernel.ops_loaded():  # (loaded by a step, never here)
                fast = _fast_layout(state, layout[1])
                remember(_FAST_LAYOUTS, signature, fast, _LAYOUTS_KEPT)
            if fast is not _UNKNOWN and fast is not None:
                if c_kernel.layout_op("leaves_match", leaves, fast):
                    return leaves, True
        if set(map(_LAYOUT, leaves)) == {torch.strided} and _metadata(leaves) == layout[2:]:
            return leaves, False
    return check_like(state.params, grads, name="grads", reference_name="params"), False


def _fast_layout(state: FP16State, types: list):
    """What ``functional_fp16_layout::leaves_match`` compares gradients with (the params'
    sizes, dtypes, devices and keys, the master's strides), for plain tensors; else
    ``None``. (The C++ op library is loaded by the CPU's steps; a state whose update never
    loads it, CUDA's, is checked in Python and builds nothing.)"""
    params, masters = tree_flatten(state.params)[0], tree_flatten(state.master)[0]
    plain = all(t is torch.Tensor for t in types) and all(type(m) is torch.Tensor for m in masters)
    if not (plain and params and len(masters) == len(params)):
        return None
    if any(p.dim() != m.dim() for p, m in zip(params, masters)):
        return None
    return c_kernel.layout_op("leaves_layout", params, masters)


def _metadata(leaves: list[torch.Tensor]) -> tuple[list, list, list]:
    return (
        list(map(torch.Tensor.size, leaves)),
        list(map(_DTYPE, leaves)),
        list(map(_DEVICE, leaves)),
    )


def _any_requires_grad(leaves: list[torch.Tensor]) -> bool:
    if torch.compiler.is_compiling():  # Dynamo traces no attrgetter
        return any(g.requires_grad for g in leaves)
    return any(map(_REQUIRES_GRAD, leaves))


def _decision(loss, agree, global_sum) -> Decision:
    """The step's rule: a finite ``loss`` (if given) is required, replicas agree."""
    require = None if loss is None else torch.isfinite(loss.detach()).all()
    return Decision(require=require, agree=agree, global_sum=global_sum)


def _check_state(state):
    """Refuses what is not a whole, unsharded state; returns its signature (see ``check_state``)."""
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    return check_state(state)


def update_path(state: FP16State, impl: str = "auto") -> str:
    """Which code :func:`fp16_update` runs for ``state``: the dispatcher's answer.

    Returns one of:

    * ``"fused"`` — one call of the fused op (:mod:`functional_fp16._fused.op_library`):
      the optimiser is a fusable SGD chain (:func:`~functional_fp16.sgd`, alone
      or after ``clip_by_global_norm`` or ``add_decayed_weights``) or Adam chain
      (:func:`~functional_fp16.adam`, :func:`~functional_fp16.adamw`, the same
      prefixes) or Lion chain (:func:`~functional_fp16.lion`, after an optional
      ``clip_by_global_norm``), the state has the plan's layout and the loss scale is one of
      the library's. The op runs the compiled kernel of the state's device
      (the CPU with a C compiler) or its plain PyTorch kernel (CUDA's
      default: PyTorch's multi-tensor ops and fused optimiser kernels), in
      eager mode, under ``torch.compile`` and under ``vmap``;
    * ``"foreach-sgd"`` — the multi-tensor SGD sequence (a fusable SGD chain
      without clipping, ``impl="foreach"``);
    * ``"foreach"`` — any other optimiser, run on flat lists of tensors;
    * ``"reference"`` — the plain tree-map specification (``impl="reference"``).

    ``impl`` is the argument you pass to :func:`fp16_update`. Both ask
    :func:`functional_fp16.update.dispatch.route`.
    """
    _check_state(state)
    if _holds_dtensors(state, None):  # what runs on the local shards
        return route(_dtensor_module().local_state(state)[0], impl).name
    return route(state, impl).name
