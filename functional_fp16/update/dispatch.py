"""The one place that decides which implementation runs an update.

:func:`route` reads declared configuration only: the ``impl`` asked for, the
optimiser's declared ``spec`` (through the fused plans), the loss scale's type
and the state's leaf metadata (dtypes, shapes, strides, device), and returns a
:class:`Route`: a name, the kernel where one runs, and the function that runs
it. :func:`~functional_fp16.fp16_update` runs the route and
:func:`~functional_fp16.update_path` reports its name, so the two cannot
disagree.

===============  ===========================================================
route name       what runs
===============  ===========================================================
``fused``        one ``functional_fp16::sgd_step``/``adam_step`` op call
                 (kernel ``c`` on the CPU, ``generic`` on CUDA and elsewhere,
                 without a C compiler or with
                 ``$FUNCTIONAL_FP16_CPU_KERNEL=cuda-default``); eager,
                 compiled and vmapped
``foreach-sgd``  the multi-tensor SGD sequence (:mod:`.foreach`), eager only
``foreach``      any optimiser on flat lists of tensors (:mod:`.foreach`)
``reference``    the tree-map specification (:mod:`.reference`)
===============  ===========================================================
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from functional_fp16._fused.device_kernels import cpu_kernel_choice, kernel_for
from functional_fp16._fused.steps import fused_plan, fused_update
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16._util.cache import remember
from functional_fp16._util.tree import tree_flatten, tree_leaves, tree_rebuild
from functional_fp16.update.accumulation import (
    fp16_accumulate_update,
    fp16_accumulates,
    inner_fp16_state,
)
from functional_fp16.update.foreach import foreach_update, sgd_sequence
from functional_fp16.update.master import master_form, narrowed, widened
from functional_fp16.update.reference import reference_update

__all__ = ["IMPLEMENTATIONS", "Route", "route"]

IMPLEMENTATIONS = ("fused", "foreach", "reference")
"""The values of ``impl`` besides ``"auto"`` (which means ``"fused"`` where it applies)."""

_warned: set[str] = set()


class Route(NamedTuple):
    """Which implementation runs a state's update, and how."""

    name: str  # "fused", "foreach-sgd", "foreach" or "reference"
    kernel: str | None  # the fused op's kernel ("c", "generic"); None otherwise
    # (and None while torch.compile traces: the op chooses when it runs)
    run: Callable  # run(state, grads, decision, donate) -> FP16State
    batches: bool  # runs under vmap as it is (else once per member)
    # run_leaves(state, the gradients' leaves, decision, donate, laid_out=): the same, given
    # the leaves fp16_update has already flattened and checked, ``laid_out`` where they were
    # proven laid out like the master (None: the route takes the tree)
    run_leaves: Callable | None = None


def _fused_runner(fp):
    def run_leaves(state, g_leaves, decision, donate, laid_out=False):
        return fused_update(state, g_leaves, fp, decision, donate, laid_out=laid_out)

    def run(state, grads, decision, donate):
        return run_leaves(state, tree_leaves(grads), decision, donate)

    return run, run_leaves


def _warn_generic(device) -> None:
    reason = c_kernel.unavailable_reason() if device.type == "cpu" else f"no kernel for {device}"
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"functional_fp16: {reason}; the fused update runs its plain PyTorch kernel "
        "(correct, but slower)",
        RuntimeWarning,
        stacklevel=5,
    )


def _asked(device) -> bool:
    """Whether ``device`` runs the plain kernel because it was asked to
    (``$FUNCTIONAL_FP16_CPU_KERNEL=cuda-default`` on the CPU), not for want of a kernel."""
    return device.type == "cpu" and cpu_kernel_choice() == "cuda-default"


_ROUTES: dict = {}  # (signature, impl, kernels available) -> Route
_ROUTES_KEPT = 256


def route(state, impl: str = "auto", signature=None) -> Route:
    """The :class:`Route` of ``state``'s update for ``impl`` (``"auto"`` or one of
    :data:`IMPLEMENTATIONS`). Reads metadata only; never a tensor's value.

    ``signature``, the state's static metadata from
    :func:`~functional_fp16.update.state_check.check_state`, lets the answer
    be looked up instead of derived: a route is a function of the signature
    and of which kernels can run (the C library loaded, the declared kernel
    choices), so the lookup returns what deriving it would.
    """
    if impl not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"impl must be 'auto' or one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    if signature is None or torch.compiler.is_compiling():
        return _route(state, impl)
    kernels = (c_kernel.available(), cpu_kernel_choice())
    key = (signature, impl, *kernels)
    found = _ROUTES.get(key)
    if found is None:
        found = remember(_ROUTES, key, _route(state, impl), _ROUTES_KEPT)
    return found


def _float32_twin(state):
    """A state with ``state``'s metadata but a float32 master: what routes a split
    state's update where the fused op does not take it (allocated once per signature)."""
    masters = [torch.empty_like(p, dtype=torch.float32) for p in tree_leaves(state.params)]
    spec = tree_flatten(state.params)[1]
    return state.replace(master=tree_rebuild(spec, state.params, masters))


def _widening(inner: Route) -> Route:
    """``inner`` (a float32-master route) run on a split state: the master decoded before
    the step and the new master split after it (``update.master``). A skipped step gives
    back the params and residuals bitwise, ``split`` being the inverse of ``join`` on
    every pair it makes."""

    def run(state, grads, decision, donate):
        return narrowed(inner.run(widened(state), grads, decision, donate))

    return Route(inner.name, inner.kernel, run, batches=False)


def _route(state, impl: str) -> Route:
    if fp16_accumulates(state.tx):  # MultiSteps: the inner optimiser's route, per micro-batch
        inner = route(inner_fp16_state(state), impl)

        def run(s, grads, decision, donate):
            return fp16_accumulate_update(s, grads, decision, donate, inner.run)

        return Route(inner.name, inner.kernel, run, batches=False)
    fp = fused_plan(state) if impl in ("auto", "fused") else None
    if fp is None and master_form(state) == "split":  # stepped as a float32 master
        return _widening(_route(_float32_twin(state), impl))
    if impl == "reference":
        return Route("reference", None, reference_update, batches=False)
    if fp is not None:
        kernel = None  # under torch.compile the op picks its kernel when it runs
        if not torch.compiler.is_compiling():
            device = tree_leaves(state.master)[0].device
            kernel = kernel_for(device)
            # CUDA's default, and CUDA's default asked for on the CPU: no warning.
            if kernel == "generic" and device.type != "cuda" and not _asked(device):
                _warn_generic(device)
        run, run_leaves = _fused_runner(fp)
        return Route("fused", kernel, run, batches=True, run_leaves=run_leaves)
    name = "foreach-sgd" if sgd_sequence(state) is not None else "foreach"
    return Route(name, None, foreach_update, batches=False)
