"""Small shared utilities for the tests: random trees, float distances, a host-sync trap."""

import contextlib
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functional_fp16 as ff
from functional_fp16._util.tree import NAMESPACE
from functional_fp16.update.dispatch import IMPLEMENTATIONS

SIZES = (1, 7, 8, 9, 64, 65)


class Block(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor


def random_tree(seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    """A nested tree (dict, tuple, NamedTuple) with a 0-d leaf and awkward sizes."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    return {
        "scalar": r(),
        "vecs": tuple(r(n) for n in SIZES),
        "block": Block(weight=r(9, 7), bias=r(9)),
    }


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two tensors of one float dtype."""
    assert a.dtype == b.dtype and a.dtype in (torch.float32, torch.float16, torch.bfloat16)
    half_range = 2 ** (8 * a.element_size() - 1)
    ia, ib = bits(a).long(), bits(b).long()
    # Map the sign-magnitude bit patterns onto a monotonic integer line.
    ia = torch.where(ia < 0, -half_range - ia, ia)
    ib = torch.where(ib < 0, -half_range - ib, ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def scaled_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of float32 epsilon times the tensor's magnitude.

    Plain ulp counts blow up wherever a value passes near zero (the operands
    were large, the result small), so results computed with different but
    equally valid rounding sequences are compared at the scale of the tensor.
    """
    assert a.dtype == b.dtype == torch.float32
    if a.numel() == 0:
        return 0.0
    magnitude = float(torch.maximum(a.abs().max(), b.abs().max()))
    if magnitude == 0.0:
        return 0.0
    return float((a - b).abs().max()) / (torch.finfo(torch.float32).eps * magnitude)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The float32 spacing above |x|, elementwise."""
    x = x.abs().float()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


FUSED_ADAM_STEP_ROUNDINGS = 4
"""How many float32 roundings (units of 2^-24) of the step ``|m' - m|`` PyTorch's fused
Adam and the reference may differ by, beyond their own final roundings: each forms the
Adam term with three (the reference ``a'/d``, ``* (1/c1)``, the decay's sum; PyTorch's
``fl32(lr/c1)``, ``* a'``, ``/ d``), and where they differ in sign the sum stays below
four of the step's, the decay's own product being below 0.1 of the master's ulp for
``lr * weight_decay <= 0.1``."""


def fused_adam_excess(ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    r"""What a master stepped by PyTorch's fused Adam/AdamW may differ from the reference's
    beyond :func:`assert_within_one_operation_ulp`'s one ulp at the operation's scale
    :math:`S`: one more ulp of :math:`S` (PyTorch's AdamW rounds the decayed master
    :math:`m(1 - \eta\lambda)` before the Adam term is subtracted: two roundings at the
    master's scale to the reference's one, contracted) and
    :data:`FUSED_ADAM_STEP_ROUNDINGS` roundings of the step:

    .. math:: |m'_{\mathrm{torch}} - m'_{\mathrm{ref}}| \le 2\,\mathrm{ulp}(S)
              + 4 \cdot 2^{-24}\, |m'_{\mathrm{ref}} - m|

    The moments take no extra: PyTorch's CPU kernel forms them as ``lerp`` and
    ``addcmul`` do, bitwise (measured; CUDA's kernel is not run here).
    """
    scale = torch.maximum(torch.maximum(old.abs(), ref.abs()), (ref - old).abs())
    return ulp(scale) + FUSED_ADAM_STEP_ROUNDINGS * 2.0**-24 * (ref - old).abs()


def assert_within_one_operation_ulp(new, ref, old, extra=None):
    """|new - ref| <= ulp(max(|old|, |ref|, |ref - old|)) (+ ``extra``), elementwise.

    The numerical contract's bound for one step that contracts ``old + f * v``
    into a fused multiply-add where ``ref`` rounds ``f * v`` first: one ulp at
    the scale of the operation (see ``tests/test_fused_update.py``).
    """
    scale = torch.maximum(torch.maximum(old.abs(), ref.abs()), (ref - old).abs())
    excess = (new - ref).abs() - ulp(scale) - (0.0 if extra is None else extra)
    assert bool((excess <= 0).all()), (
        f"{int((excess > 0).sum())} elements beyond 1 ulp (worst by {float(excess.max()):.3g}, "
        f"{float((excess / ulp(scale)).max()):.3g} ulp more)"
    )


def assert_transform_step_preserves(tx, params, updates):
    """One ``init`` + ``update`` of ``tx``: structure, shapes and dtypes kept, inputs untouched.

    The updates come back in the tree structure, shapes and dtypes of
    ``updates``; the new state has the old state's structure, shapes and
    dtypes (so ``fp16_update`` can select between them and a checkpoint of one
    loads into the other); ``params``, ``updates`` and the old state are left
    bitwise as they were. Returns ``(new_updates, new_state)``.
    """

    def leaves(tree):
        return optree.tree_leaves(tree, namespace=NAMESPACE)

    inputs = [x.clone() for x in leaves((params, updates))]
    state = tx.init(params)
    old_state = [x.clone() for x in leaves(state)]
    new_updates, new_state = tx.update(updates, state, params)

    def shapes_and_dtypes(tree):
        return [(tuple(x.shape), x.dtype) for x in leaves(tree)]

    structure = optree.tree_structure(updates, namespace=NAMESPACE)
    got = optree.tree_structure(new_updates, namespace=NAMESPACE)
    assert got == structure, f"updates: {got} != {structure}"
    got, want = shapes_and_dtypes(new_updates), shapes_and_dtypes(updates)
    assert got == want, f"updates' shapes and dtypes: {got} != {want}"
    structure = optree.tree_structure(state, namespace=NAMESPACE)
    got = optree.tree_structure(new_state, namespace=NAMESPACE)
    assert got == structure, f"state: {got} != {structure}"
    got, want = shapes_and_dtypes(new_state), shapes_and_dtypes(state)
    assert got == want, f"state's shapes and dtypes: {got} != {want}"
    for a, b in zip(leaves((params, updates)), inputs, strict=True):
        assert torch.equal(a, b), "params or updates modified"
    for a, b in zip(leaves(state), old_state, strict=True):
        assert torch.equal(a, b), "the old state modified"
    return new_updates, new_state


# Reading a tensor's value on the host, by method or by ATen operator.
_METHODS = [
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__complex__",
    "__index__",
    "__array__",
    "cpu",
    "numpy",
]

_OPS = {
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "allclose",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
    "argwhere",
}


class HostSync(AssertionError):
    pass


class _RefuseSyncOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _OPS:
            raise HostSync(f"aten.{name} inside the update (host sync)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    """Raises :class:`HostSync` on any value read-back inside the block."""
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostSync(f"Tensor.{name} inside the update (host sync)")

        return method

    try:
        for name in _METHODS:
            setattr(torch.Tensor, name, refuse(name))
        with _RefuseSyncOps():
            yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of ``t`` (so NaN == NaN and -0.0 != 0.0)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_VIEWS[t.element_size()])


def bit_snapshot(tree) -> list[torch.Tensor]:
    """The bit patterns of every leaf of ``tree`` (NaN payloads and -0.0 included)."""
    return [bits(x).clone() for x in optree.tree_leaves(tree, namespace=NAMESPACE)]


def assert_bitwise_unchanged(tree, before: list[torch.Tensor]) -> None:
    """Every leaf of ``tree`` still has the bit pattern :func:`bit_snapshot` recorded."""
    after = optree.tree_leaves(tree, namespace=NAMESPACE)
    assert len(after) == len(before)
    for x, b in zip(after, before, strict=True):
        assert torch.equal(bits(x), b)


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_module(path: Path, name: str) -> ModuleType:
    """Imports the file ``path`` as module ``name`` (a worker file, an example script)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example(name: str) -> ModuleType:
    """Imports ``examples/<name>.py``, with ``examples/`` on the path for its sibling modules."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return load_module(EXAMPLES / f"{name}.py", name)


# -- the optimiser matrix every implementation is held to --------------------------------

STEPS = 6


def optimiser_matrix() -> dict:
    """The optimisers every implementation is held to, by name (fresh transforms each call)."""
    sched = ff.linear_schedule(0.1, 0.01, transition_steps=4)
    return {
        "sgd": ff.sgd(0.1),
        "momentum": ff.sgd(0.05, momentum=0.9),
        "nesterov": ff.sgd(0.05, momentum=0.9, nesterov=True),
        "dampening": ff.sgd(0.05, momentum=0.8, dampening=0.3),
        "wd": ff.sgd(0.05, momentum=0.9, weight_decay=1e-2),
        "wd_nesterov": ff.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        "schedule": ff.sgd(sched, momentum=0.9),
        "schedule_wd_no_momentum": ff.sgd(sched, weight_decay=1e-3),
        "wd_zero_kept": ff.chain(
            ff.add_decayed_weights(0.0), ff.trace(0.9), ff.scale_by_learning_rate(0.1)
        ),
        "zero_momentum_trace": ff.chain(ff.trace(0.0), ff.scale_by_learning_rate(0.1)),
        "clip": ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.05, momentum=0.9)),
        "clip_trace": ff.chain(
            ff.clip_by_global_norm(0.5), ff.trace(0.9), ff.scale_by_learning_rate(0.1)
        ),
        "apply_if_finite": ff.apply_if_finite(ff.sgd(0.05, momentum=0.9), 2),
        "identity": ff.identity(),
        "ascent": ff.chain(ff.trace(0.9), ff.scale_by_learning_rate(0.1, flip_sign=False)),
        "adam": ff.adam(1e-3),
        "adamw_schedule_small_b1": ff.adamw(sched, b1=0.3, weight_decay=1e-2),
        "clip_l2_adam": ff.chain(
            ff.clip_by_global_norm(1.0), ff.add_decayed_weights(1e-2), ff.adam(1e-3)
        ),
        # The transformer recipe: clip + AdamW, a warmup-cosine schedule, no decay on vectors.
        "recipe": ff.chain(
            ff.clip_by_global_norm(1.0),
            ff.adamw(
                ff.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 20, 1e-4),
                b2=0.95,
                weight_decay=0.1,
                mask=matrices,
            ),
        ),
        "lion": ff.lion(1e-3, weight_decay=0.1),
        "clip_lion_schedule": ff.chain(
            ff.clip_by_global_norm(1.0), ff.lion(sched, b1=0.5, weight_decay=0.0)
        ),
        "lion_masked": ff.lion(1e-3, b2=0.9, weight_decay=1e-2, mask=matrices),
        "rmsprop_momentum_schedule": ff.rmsprop(sched, momentum=0.9),
        "masked_sgd_decay": ff.chain(
            ff.add_decayed_weights(1e-2, mask=matrices), ff.sgd(0.05, momentum=0.9)
        ),
        # Labels as torch.optim parameter groups: SGD on the matrices, Adam on the rest.
        "labels_sgd_adam": ff.multi_transform(
            {"matrix": ff.sgd(0.05, momentum=0.9), "vector": ff.adam(1e-3)},
            lambda tree: optree.tree_map(
                lambda p: "matrix" if p.ndim >= 2 else "vector", tree, namespace=NAMESPACE
            ),
        ),
    }


def matrices(tree):
    """A weight-decay mask: the leaves with two or more dimensions."""
    return optree.tree_map(lambda p: p.ndim >= 2, tree, namespace=NAMESPACE)


TX_NAMES = sorted(optimiser_matrix())


def matrix_grads(state, step, seed, scale=2.0**10, bad=None):
    """Scaled FP16 gradients like a backward pass would produce; ``bad`` injects a value."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    out = optree.tree_map(
        lambda p: (torch.randn(p.shape, generator=g) * scale).to(p.dtype),
        state.params,
        namespace=NAMESPACE,
    )
    if bad is not None:
        leaves, spec = optree.tree_flatten(out, namespace=NAMESPACE)
        leaf = leaves[(step + seed) % len(leaves)]
        leaf.view(-1)[step % leaf.numel()] = bad
    return out


def assert_states_bitwise_equal(a, b):
    """Every leaf of two states has the same dtype, shape and bit pattern."""
    la = optree.tree_leaves(a, namespace=NAMESPACE)
    lb = optree.tree_leaves(b, namespace=NAMESPACE)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (x, y)


# -- the implementation matrix: every value of ``impl`` the library declares ---------------


class Implementation(NamedTuple):
    """One value of ``fp16_update``'s ``impl`` and what the tests may expect of it."""

    name: str  # the ``impl`` argument
    routes: tuple[str, ...]  # the names ``update_path(state, impl)`` may answer
    default: bool  # what ``impl="auto"`` runs wherever its plan applies
    specification: bool  # the tree-map reference every other implementation is held to
    bitwise_reference: bool  # results bit for bit the reference's (else within the contract)
    traced_as: str | None  # an operator name prefix its compiled graph holds (None: plain aten)

    def __str__(self) -> str:
        return self.name


IMPLEMENTATION_PROPERTIES = {
    "fused": Implementation(
        "fused",
        routes=("fused", "foreach-sgd", "foreach"),  # the op where a plan applies, else foreach
        default=True,
        specification=False,
        bitwise_reference=False,  # contracted multiply-adds: within one ulp of the operation
        traced_as="functional_fp16.",
    ),
    "foreach": Implementation(
        "foreach",
        routes=("foreach-sgd", "foreach"),
        default=False,
        specification=False,
        bitwise_reference=True,
        traced_as="_foreach_",
    ),
    "reference": Implementation(
        "reference",
        routes=("reference",),
        default=False,
        specification=True,
        bitwise_reference=True,
        traced_as=None,
    ),
}

IMPLEMENTATION_MATRIX: tuple[Implementation, ...] = tuple(
    IMPLEMENTATION_PROPERTIES[name]
    for name in sorted(IMPLEMENTATIONS)
    if name in IMPLEMENTATION_PROPERTIES
)
"""The implementations every "against every implementation" test runs, in the order of
their names: ``functional_fp16.update.dispatch.IMPLEMENTATIONS`` with the properties
declared above (``tests/test_update.py`` fails when the two differ)."""

IMPL_NAMES: tuple[str, ...] = tuple(i.name for i in IMPLEMENTATION_MATRIX)


def implementations(where=None) -> list[str]:
    """The names of the matrix's implementations, or of those for which ``where(impl)`` holds
    (a subset by declared property: ``implementations(lambda i: not i.specification)``)."""
    return [i.name for i in IMPLEMENTATION_MATRIX if where is None or where(i)]


def implementation(name: str) -> Implementation:
    """The matrix's record of ``name`` (``"auto"``: the default implementation's)."""
    if name == "auto":
        return next(i for i in IMPLEMENTATION_MATRIX if i.default)
    return next(i for i in IMPLEMENTATION_MATRIX if i.name == name)


_CPP_ENTRIES = {"sgd": "sgd_update", "adam": "adam_update", "grad_stats": "grad_stats"}


def count_c_kernel_calls(monkeypatch, calls: list[str]) -> list[str]:
    """Records the C kernel's entries (``sgd_update``, ``adam_update``, ``lion_update``,
    ``grad_stats``) as
    they run, through ctypes (``cpu.call``) or the C++ op library (``cpu.run_op``).

    A C++ step that decides itself runs its ``grad_stats`` inside; it counts as its
    update entry alone, like the speculative C step.
    """
    from functional_fp16._kernels import cpu

    real_call, real_op = cpu.call, cpu.run_op

    def call(entry, **kw):
        calls.append(entry)
        return real_call(entry, **kw)

    def run_op(name, *args):
        if name in ("bookkeeping", "step_scalars"):  # the update's 0-d work, not a step's
            return real_op(name, *args)
        # the generic ``step`` op names its kernel first: ``step("lion", ...)`` is lion_update
        named = name in ("step", "stored_step")  # these name their kernel first
        calls.append(f"{args[0]}_update" if named else _CPP_ENTRIES[name])
        return real_op(name, *args)

    monkeypatch.setattr(cpu, "call", call)
    monkeypatch.setattr(cpu, "run_op", run_op)
    return calls


NO_LAUNCH = ("empty", "view", "reshape", "alias", "as_strided", "detach", "lift", "unsqueeze")
"""Parts of the names of aten ops that compute nothing (allocations and views)."""


def top_level_ops(prof) -> list[str]:
    """The aten ops a profile ran from Python or from a ``functional_fp16`` op's kernel (not
    the ones an aten op runs inside itself, as the CPU's foreach ops do per tensor)."""
    return [
        e.name
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]


def computing_ops(prof) -> list[str]:
    """:func:`top_level_ops` that compute (each at least one launch on a GPU)."""
    return [n for n in top_level_ops(prof) if not any(w in n for w in NO_LAUNCH)]


def stored_step_grads(state, seed, bad=None):
    """Gradients of the stored-state step tests: seeded, scaled by the loss scale, in the
    params' dtypes; ``bad`` put at ``v[7, 290]``."""
    g = torch.Generator().manual_seed(100 + seed)
    s = float(state.loss_scale.loss_scale)
    out = {
        k: (torch.randn(m.shape, generator=g) * (0.5 + seed % 3) * s).to(p.dtype)
        for (k, m), p in zip(state.master.items(), state.params.values())
    }
    if bad is not None:
        out["v"][7, 290] = bad
    return out


def fresh_json(code: str, env: dict | None = None) -> dict:
    """Runs ``code`` (dedented) in a new interpreter at the repository's root, with
    ``env`` added to the environment; returns the JSON it prints last."""
    import json
    import os
    import subprocess
    import textwrap

    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cases_in_interpreter(test_file: str, runner: str, at_least: int, skips=False) -> str:
    """Runs the cases of ``test_file`` but ``runner`` (the test calling this) in a child
    pytest with ``TRITON_INTERPRET=1`` (Triton interprets only where that was set before
    it was imported) and no forced CPU kernel; requires it to pass ``at_least`` cases and
    (unless ``skips``: the file's parent-only cases) skip none. Returns its output."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from functional_fp16._fused import device_kernels as dk

    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(dk.CPU_KERNEL_VARIABLE, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += [str(test_file), "-k", f"not {runner}"]
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= at_least, out[-3000:]
    assert skips or not re.search(r"\d+ skipped", out), out[-3000:]
    return out
