"""The fused steps as ``torch.library`` ops: ``opcheck``, ``torch.compile``, ``vmap``.

* ``torch.library.opcheck`` (schema, fake kernel, autograd registration) on every op
  across parameter dtypes and flags, and ``aot_dispatch_dynamic`` once per structure of
  the arguments (see :func:`_opcheck`);
* the compiled update calls the op: kernel calls are counted over 20 steps
  that include skipped steps and loss-scale changes, with ``fullgraph=True``
  and recompilation made an error;
* under ``vmap`` the op batches inside itself: one kernel call for K members,
  bitwise K unbatched updates (each member its own scale, decision, counters).
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import functional_fp16 as ff
from functional_fp16._fused import op_library
from functional_fp16._fused.adam import adam_step, adam_step_
from functional_fp16._fused.lion import lion_step, lion_step_
from functional_fp16._fused.op_library import grad_stats
from functional_fp16._fused.rmsprop import rmsprop_step, rmsprop_step_
from functional_fp16._fused.sgd import sgd_step, sgd_step_
from functional_fp16._kernels import cpu as cpu_kernel
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import bits, computing_ops, count_c_kernel_calls, top_level_ops

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler here")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _leaves(param_dtype, seed=0, n_leaves=3):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (33,), (2, 3, 4, 5)][:n_leaves]
    master = [torch.randn(s, generator=g) for s in shapes]
    master[-1] = (
        master[-1].to(memory_format=torch.channels_last) if master[-1].dim() == 4 else master[-1]
    )
    grads = [(torch.randn(m.shape, generator=g) * 100).to(torch.float16) for m in master]
    grads = [torch.empty_like(m, dtype=torch.float16).copy_(x) for m, x in zip(master, grads)]
    params = [m.to(param_dtype) for m in master]
    return grads, master, params


def _scalars(skip=False, clip=False, started=True):
    s = dict(
        inv=torch.tensor([2.0**-7]),
        clip_div=torch.tensor([3.0]) if clip else None,
        clip_mul=torch.tensor([1.0]) if clip else None,
        lr=torch.tensor([-0.1]),
        apply=torch.tensor([not skip]),
        require=None,
    )
    return s, torch.tensor([started])


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _opcheck(op, args, kwargs, *, trace: bool) -> None:
    """``torch.library.opcheck``; with ``trace``, also ``test_aot_dispatch_dynamic``.

    That check (nine tenths of opcheck's time) traces the op through AOTAutograd with
    symbolic shapes, where the fake kernel stands for it: what it sees is the arguments'
    structure (which tensors and lists are given, their dtypes, shapes and layouts). Cases
    that differ only in non-tensor hyperparameters (floats and flags, constants of the
    trace) or in the values in a tensor (a skipped step's ``apply``) trace alike, so the
    tests below trace one case of each structure; every case goes through the other three
    checks.
    """
    utils = (*OPCHECK_TESTS, "test_aot_dispatch_dynamic") if trace else OPCHECK_TESTS
    torch.library.opcheck(op, args, kwargs, test_utils=utils)


SGD_FLAGS = [
    dict(weight_decay=0.0, momentum=0.9, dampening=0.0, nesterov=False),
    dict(weight_decay=1e-2, momentum=0.9, dampening=0.1, nesterov=False),
    dict(weight_decay=0.0, momentum=0.9, dampening=0.0, nesterov=True),
    dict(weight_decay=1e-2, momentum=0.0, dampening=0.0, nesterov=False),
]


@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("flags", range(len(SGD_FLAGS)))
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_opcheck_sgd(param_dtype, flags, skip, clip):
    hyper = SGD_FLAGS[flags]
    grads, master, params = _leaves(param_dtype)
    separate = [param_dtype != torch.float32] * len(master)
    own = [p for p, s in zip(params, separate) if s]
    trace = [torch.randn_like(m) for m in master] if hyper["momentum"] else []
    s, started = _scalars(skip, clip)
    args = (grads, master, trace, own, separate)
    kwargs = dict(**s, started=started if hyper["momentum"] else None, **hyper, members=1)
    # flags 1 and 2 differ from 0 in non-tensor arguments; 3 has no momentum (no trace, no
    # started)
    trace_aot = not skip and flags in (0, 3)
    _opcheck(sgd_step, args, kwargs, trace=trace_aot)
    copies = ([m.clone() for m in master], [t.clone() for t in trace], [p.clone() for p in own])
    _opcheck(sgd_step_, (grads, *copies, separate), kwargs, trace=trace_aot)


@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("decay", ["l2", "decoupled", "none"])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("given", ["corrections", "count", "count-generic"])
def test_opcheck_adam(param_dtype, decay, skip, given, monkeypatch):
    # The bias corrections (the C kernels' form) or the step count (the plain kernel's,
    # PyTorch's fused Adam; the C kernels make the corrections of it).
    if given == "count-generic":
        monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    given = given.split("-")[0]
    grads, master, params = _leaves(param_dtype)
    separate = [param_dtype != torch.float32] * len(master)
    own = [p for p, s in zip(params, separate) if s]
    mu = [torch.randn_like(m) for m in master]
    nu = [torch.rand_like(m) for m in master]
    s, _ = _scalars(skip, clip=not skip)
    kwargs = dict(
        **s,
        inv_c1=torch.tensor([10.0]) if given == "corrections" else None,
        sqrt_c2=torch.tensor([0.03]) if given == "corrections" else None,
        count=torch.tensor([7.0]) if given == "count" else None,
        l2=1e-2 if decay == "l2" else 0.0,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        decoupled=1e-2 if decay == "decoupled" else 0.0,
        members=1,
    )
    # the decays differ in floats only; a skipped case has no clip factors (another structure)
    trace_aot = decay == "decoupled"
    _opcheck(adam_step, (grads, master, mu, nu, own, separate), kwargs, trace=trace_aot)
    copies = [[x.clone() for x in xs] for xs in (master, mu, nu, own)]
    _opcheck(adam_step_, (grads, *copies, separate), kwargs, trace=trace_aot)


@pytest.mark.parametrize("kernel", ["c", "generic"])
def test_a_count_that_is_not_float32_is_refused_by_every_kernel(kernel, monkeypatch):
    if kernel == "generic":
        monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    grads, master, params = _leaves(torch.float16)
    mu, nu = [torch.zeros_like(m) for m in master], [torch.zeros_like(m) for m in master]
    s, _ = _scalars()
    hyper = dict(l2=0.0, b1=0.9, b2=0.999, eps=1e-8, decoupled=0.0, members=1)
    with pytest.raises(TypeError, match="count must be torch.float32"):
        adam_step(
            grads, master, mu, nu, params, [True] * 3, **s, inv_c1=None, sqrt_c2=None,
            count=torch.tensor([7]), **hyper,
        )  # fmt: skip


@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("decay", [0.0, 1e-2])
@pytest.mark.parametrize("skip", [False, True])
def test_opcheck_lion(param_dtype, decay, skip):
    grads, master, params = _leaves(param_dtype)
    separate = [param_dtype != torch.float32] * len(master)
    own = [p for p, s in zip(params, separate) if s]
    mu = [torch.randn_like(m) for m in master]
    s, _ = _scalars(skip, clip=not skip)
    kwargs = dict(**s, b1=0.9, b2=0.99, decoupled=decay, members=1)
    trace_aot = decay != 0.0  # the decays differ in a float only; skip also drops the clip
    _opcheck(lion_step, (grads, master, mu, own, separate), kwargs, trace=trace_aot)
    copies = [[x.clone() for x in xs] for xs in (master, mu, own)]
    _opcheck(lion_step_, (grads, *copies, separate), kwargs, trace=trace_aot)


RMS_FLAGS = [
    dict(eps_in_sqrt=True, momentum=0.0, nesterov=False),
    dict(eps_in_sqrt=False, momentum=0.9, nesterov=False),
    dict(eps_in_sqrt=True, momentum=0.9, nesterov=True),
]


@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("flags", range(len(RMS_FLAGS)))
@pytest.mark.parametrize("skip", [False, True])
def test_opcheck_rmsprop(param_dtype, flags, skip):
    grads, master, params = _leaves(param_dtype)
    separate = [param_dtype != torch.float32] * len(master)
    own = [p for p, s in zip(params, separate) if s]
    nu = [torch.rand_like(m) for m in master]
    on = RMS_FLAGS[flags]["momentum"] != 0.0
    trace = [torch.randn_like(m) for m in master] if on else []
    s, started = _scalars(skip, clip=not skip)
    kwargs = dict(**s, started=started if on else None, decay=0.9, eps=1e-8, **RMS_FLAGS[flags])
    kwargs["members"] = 1
    trace_aot = flags in (0, 1)  # 2 differs from 1 in floats and flags; skip drops the clip
    _opcheck(rmsprop_step, (grads, master, nu, trace, own, separate), kwargs, trace=trace_aot)
    copies = [[x.clone() for x in xs] for xs in (master, nu, trace, own)]
    _opcheck(rmsprop_step_, (grads, *copies, separate), kwargs, trace=trace_aot)


@pytest.mark.parametrize("sum_squares", [False, True])
def test_opcheck_grad_stats(sum_squares):
    grads, _, _ = _leaves(torch.float16)
    _opcheck(grad_stats, (grads, torch.tensor([0.5]), 1, 1, sum_squares), {}, trace=True)


@pytest.mark.parametrize("kernel", ["c", "generic"])
@pytest.mark.parametrize("decided", [False, True])
def test_a_skipped_step_is_bitwise_its_input_and_the_op_never_writes_inputs(
    kernel, decided, monkeypatch
):
    """Skipped by the op's own check (a NaN gradient: the C kernel's speculative step is
    undone) or by a given decision; -0.0 and NaN payloads in every state tensor."""
    if kernel == "generic":
        monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    grads, master, params = _leaves(torch.float16)
    trace = [torch.randn_like(m) for m in master]
    for x in [*master, *trace, *params]:
        x[(0,) * x.dim()] = -0.0
        x[(0,) * (x.dim() - 1) + (1,)] = float("nan")
    if not decided:
        grads[1][3] = float("nan")
    before = [bits(x).clone() for x in [*master, *trace, *params]]
    s, started = _scalars(skip=decided)
    if not decided:
        s["apply"] = None
    out = sgd_step(
        grads, master, trace, params, [True] * 3, **s, started=started, **SGD_FLAGS[1], members=1
    )
    assert not bool(out[3][0])
    for new, old in zip([*out[0], *out[1], *out[2]], before):
        assert torch.equal(bits(new), old)
    assert all(torch.equal(bits(x), b) for x, b in zip([*master, *trace, *params], before))


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("optimiser", ["sgd", "sgd_dampening", "adamw"])
@pytest.mark.parametrize("kernel", ["c", "generic"])
def test_a_skipped_step_keeps_working_copies_that_are_not_the_master_rounded(
    kernel, optimiser, donate, monkeypatch
):
    """A working copy need not be its master rounded (a state built or edited by hand):
    a skipped step still gives it back bit for bit, not the master rounded again; every
    kernel's path (PyTorch's fused SGD and Adam, the multi-tensor one, the C kernel)."""
    if kernel == "generic":
        monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    grads, master, params = _leaves(torch.float16)
    params = [(p.view(torch.int16) + 1).view(torch.float16) for p in params]  # next fp16
    s, started = _scalars(skip=True)
    if optimiser == "adamw":
        mu, nu = [torch.randn_like(m) for m in master], [torch.rand_like(m) for m in master]
        states, op, op_ = (mu, nu), adam_step, adam_step_
        hyper = dict(inv_c1=None, sqrt_c2=None, count=torch.tensor([3.0]), l2=0.0, b1=0.9)
        hyper.update(b2=0.999, eps=1e-8, decoupled=1e-2)
    else:
        states, op, op_ = ([torch.randn_like(m) for m in master],), sgd_step, sgd_step_
        hyper = dict(started=started, **SGD_FLAGS[1 if optimiser == "sgd_dampening" else 0])
    before = [bits(x).clone() for x in params]
    if donate:
        copies = [[x.clone() for x in xs] for xs in (master, *states, params)]
        op_(grads, *copies, [True] * 3, **s, **hyper, members=1)
        new = copies[-1]
    else:
        new = op(grads, master, *states, params, [True] * 3, **s, **hyper, members=1)[-3]
    assert all(torch.equal(bits(x), b) for x, b in zip(new, before))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.__setitem__("master", a["master"][:2]), "master has 2 tensors"),
        (lambda a: a.__setitem__("trace", [t[:1] for t in a["trace"]]), r"trace\[0\] has shape"),
        (lambda a: a.__setitem__("master", [m.half() for m in a["master"]]), "master.0. has dtype"),
        (lambda a: a.__setitem__("lr", torch.tensor([-0.1, -0.1])), "lr has shape"),
        (lambda a: a.__setitem__("apply", torch.tensor([1.0])), "apply must be torch.bool"),
        (
            lambda a: a.__setitem__("inv", torch.tensor(0.5)),
            r"inv must be contiguous of shape \(1,\)",
        ),
        (lambda a: a.__setitem__("separate", [True]), "separate has 1 flags"),
        (lambda a: a.__setitem__("started", None), "started is required"),
        (lambda a: a.__setitem__("clip_mul", torch.tensor([1.0])), "given together"),
        (
            lambda a: a.__setitem__("grads", [g.t() for g in a["grads"][:1]] + a["grads"][1:]),
            r"master\[0\] has shape \(7, 5\).*grads\[0\] has \(5, 7\)",
        ),
        (lambda a: a.__setitem__("members", 0), "members must be a positive int"),
    ],
)
def test_bad_arguments_raise_in_python_before_any_kernel(change, message, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernel, "call", lambda *a, **k: calls.append(a))
    grads, master, params = _leaves(torch.float16)
    s, started = _scalars()
    args = dict(
        grads=grads,
        master=master,
        trace=[torch.zeros_like(m) for m in master],
        params=params,
        separate=[True] * 3,
        **s,
        started=started,
        **SGD_FLAGS[0],
        members=1,
    )
    change(args)
    with pytest.raises((TypeError, ValueError), match=message):
        sgd_step(**args)
    assert not calls


# ---------------------------------------------------------------------------
# torch.compile: the compiled step calls the op.
# ---------------------------------------------------------------------------


@pytest.fixture
def count_kernel_calls(monkeypatch):
    return count_c_kernel_calls(monkeypatch, [])


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("tx_name", ["sgd", "adamw", "lion"])
def test_compiled_update_runs_the_kernel_without_breaks_or_recompiles(
    count_kernel_calls, donate, tx_name
):
    torch._dynamo.reset()
    counters.clear()
    tx = {
        "sgd": ff.sgd(0.1, momentum=0.9),
        "adamw": ff.adamw(1e-3, weight_decay=0.1),
        "lion": ff.lion(1e-3, weight_decay=0.1),
    }[tx_name]
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    # growth every 3 steps, so the scale also grows between the overflows
    scale = ff.DynamicLossScale(2.0**10, growth_interval=3)
    state = ff.fp16_init(params, tx, scale)
    eager = state

    @torch.compile(fullgraph=True)
    def step(s, grads, loss):
        return ff.fp16_update(s, grads, loss=loss, donate=donate)

    scales = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled_calls = _run_compiled(
            step, state, eager, params, g, donate, scales, count_kernel_calls
        )
    assert len(scales) >= 3  # skipped steps and growth both moved the scale
    assert counters["stats"]["unique_graphs"] == 1
    update_calls = [c for c in compiled_calls if c == f"{tx_name.rstrip('w')}_update"]
    assert len(update_calls) == 20  # the kernel ran on every compiled step
    torch._dynamo.reset()


def _run_compiled(step, state, eager, params, g, donate, scales, calls):
    """20 compiled steps, each checked against the eager one; the compiled steps' kernel calls."""
    compiled_calls = []
    for i in range(20):
        grads = {k: (torch.randn(v.shape, generator=g) * 50).half() for k, v in params.items()}
        if i in (4, 11):
            grads["w"][0, 0] = float("inf")
        loss = torch.tensor(float("nan") if i == 15 else 1.0)
        # the same kernel as eager mode, so bitwise the eager default update
        eager = ff.fp16_update(eager, grads, loss=loss)
        copy = tree_map(torch.clone, state) if donate else state
        before = len(calls)
        state = step(copy, grads, loss)
        compiled_calls += calls[before:]
        scales.add(float(state.loss_scale.loss_scale))
        for a, b in zip(tree_leaves(state), tree_leaves(eager)):
            assert torch.equal(bits(a), bits(b))
    return compiled_calls


# ---------------------------------------------------------------------------
# vmap: K members in one kernel call.
# ---------------------------------------------------------------------------


def _member(k):
    g = torch.Generator().manual_seed(k)
    return {
        "conv": torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last),
        "w": torch.randn(10, 6, generator=g),
        "b": torch.randn(10, generator=g),
    }


@pytest.mark.parametrize("tx_name", ["sgd", "nesterov-clip", "adamw", "lion"])
@pytest.mark.parametrize("donate", [False, True])
def test_vmapped_update_is_one_kernel_call_and_bitwise_the_members(
    count_kernel_calls, tx_name, donate
):
    tx = {
        "sgd": ff.sgd(0.1, momentum=0.9),
        "nesterov-clip": ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.1, 0.9, nesterov=True)),
        "adamw": ff.adamw(1e-2, weight_decay=0.1),
        "lion": ff.lion(1e-3, weight_decay=0.1),
    }[tx_name]
    K = 4
    members = [ff.fp16_init(_member(k), tx) for k in range(K)]
    stacked = ff.tree_stack(members)
    g = torch.Generator().manual_seed(99)
    for step in range(4):
        grads = [
            {k: (torch.randn(v.shape, generator=g) * 300).half() for k, v in m.params.items()}
            for m in members
        ]
        if step == 1:
            grads[2]["b"][3] = float("nan")  # member 2 skips, the others apply
        count_kernel_calls.clear()
        fn = torch.func.vmap(lambda s, gr: ff.fp16_update(s, gr, donate=donate))
        stacked = fn(stacked, ff.tree_stack(grads))
        updates = [c for c in count_kernel_calls if c.endswith("_update")]
        assert len(updates) == 1
        members = [ff.fp16_update(m, gr) for m, gr in zip(members, grads)]
        for k, alone in enumerate(ff.tree_unstack(stacked)):
            for a, b in zip(tree_leaves(alone), tree_leaves(members[k])):
                assert torch.equal(bits(a), bits(b))
    assert [bool(x) for x in stacked.grads_finite] == [True] * K


def test_vmap_of_the_op_with_a_shared_learning_rate_and_non_leading_batch_dim():
    grads, master, params = _leaves(torch.float16)
    K = 3
    gb = [torch.stack([x * (k + 1) for k in range(K)], dim=-1).movedim(-1, 0) for x in grads]
    mb = [torch.stack([m + k for k in range(K)], dim=1) for m in master]
    pb = [m.movedim(1, 0).half() for m in mb]
    tb = [torch.zeros(K, *m.shape) for m in master]
    s, started = _scalars()
    lr = s.pop("lr")

    def one(g, m, t, p, inv, apply, st):
        return sgd_step(
            g,
            m,
            t,
            p,
            [True] * 3,
            inv,
            s["clip_div"],
            s["clip_mul"],
            lr,
            apply,
            None,
            st,
            **SGD_FLAGS[0],
            members=1,
        )

    inv = torch.tensor([[2.0**-7], [1.0], [2.0**-3]])
    apply = torch.tensor([[True], [False], [True]])
    st = torch.tensor([[True]] * K)
    out = torch.vmap(one, in_dims=(0, 1, 0, 0, 0, 0, 0))(gb, mb, tb, pb, inv, apply, st)
    for k in range(K):

        def member(xs, pick):
            return [pick(x).contiguous() for x in xs]

        alone = one(
            member(gb, lambda x: x[k]),
            member(mb, lambda m: m[:, k]),
            member(tb, lambda t: t[k]),
            member(pb, lambda p: p[k]),
            inv[k],
            apply[k],
            st[k],
        )
        for batched_list, single_list in zip(out[:3], alone[:3]):
            for batched, single in zip(batched_list, single_list):
                assert torch.equal(bits(batched[k]), bits(single))
        assert bool(out[3][k]) == bool(alone[3])


def test_nested_vmap_is_bitwise_the_members_alone():
    tx = ff.sgd(0.1, momentum=0.9)
    outer, inner = 2, 3
    members = [[ff.fp16_init(_member(3 * i + j), tx) for j in range(inner)] for i in range(outer)]
    g = torch.Generator().manual_seed(5)
    grads = [
        [
            {k: (torch.randn(v.shape, generator=g) * 30).half() for k, v in m.params.items()}
            for m in row
        ]
        for row in members
    ]
    grads[1][2]["w"][0, 0] = float("inf")
    stacked = ff.tree_stack([ff.tree_stack(row) for row in members])
    stacked_grads = ff.tree_stack([ff.tree_stack(row) for row in grads])
    new = torch.func.vmap(torch.func.vmap(ff.fp16_update))(stacked, stacked_grads)
    for i, row in enumerate(ff.tree_unstack(new)):
        for j, mine in enumerate(ff.tree_unstack(row)):
            alone = ff.fp16_update(members[i][j], grads[i][j])
            for a, b in zip(tree_leaves(mine), tree_leaves(alone)):
                assert torch.equal(bits(a), bits(b))
    assert not bool(new.grads_finite[1, 2]) and bool(new.grads_finite[0, 0])


def test_a_state_with_an_empty_leaf_stays_fused_and_vmaps():
    tx = ff.sgd(0.1, momentum=0.9)
    members = [
        ff.fp16_init({"w": torch.randn(5) + k, "e": torch.zeros(3, 0, 4)}, tx) for k in range(2)
    ]
    assert ff.update_path(members[0]) == "fused"
    grads = [{"w": torch.randn(5).half(), "e": torch.zeros(3, 0, 4).half()} for _ in members]
    new = torch.func.vmap(ff.fp16_update)(ff.tree_stack(members), ff.tree_stack(grads))
    for mine, m, gr in zip(ff.tree_unstack(new), members, grads):
        for a, b in zip(tree_leaves(mine), tree_leaves(ff.fp16_update(m, gr, impl="reference"))):
            if a.is_floating_point() and a.numel():
                torch.testing.assert_close(a, b, rtol=2**-22, atol=0)
            else:
                assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", ["c", "generic"])
def test_nesterov_without_momentum_is_plain_sgd_in_every_kernel(kernel, monkeypatch):
    if kernel == "generic":
        monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    grads, master, params = _leaves(torch.float16)
    s, _ = _scalars()
    out = sgd_step(
        grads,
        master,
        [],
        params,
        [True] * 3,
        **s,
        started=None,
        weight_decay=0.0,
        momentum=0.0,
        dampening=0.0,
        nesterov=True,
        members=1,
    )
    for new, m, g in zip(out[0], master, grads):
        expected = torch.addcmul(m, g.float() * s["inv"][0], s["lr"][0])
        assert torch.equal(bits(new), bits(expected))


def test_a_momentum_that_rounds_to_zero_in_float32_still_keeps_its_buffer():
    tx = ff.sgd(0.1, momentum=1e-46)  # nonzero, but 0 as a float32
    state = ff.fp16_init({"w": torch.randn(300)}, tx)
    assert ff.update_path(state) == "fused"
    grads = {"w": (torch.randn(300) * 100).half()}
    new = ff.fp16_update(state, grads)
    ref = ff.fp16_update(state, grads, impl="reference")
    new_trace, ref_trace = tree_leaves(new.opt_state), tree_leaves(ref.opt_state)
    for a, b in zip(new_trace, ref_trace):
        assert torch.equal(bits(a), bits(b))


def test_a_million_groups_do_not_overflow_the_stack():
    k = 1_200_000  # per-thread partial results live on the heap, not on the stack
    g = [torch.ones(k, 2, dtype=torch.float16)]
    peak, sq = grad_stats(g, None, k, k, True)
    assert peak.shape == (k,) and bool((peak == 1).all()) and bool((sq == 2).all())


@pytest.mark.parametrize("kernel", ["c", "generic"])
def test_the_donated_op_takes_gradients_that_share_memory_with_each_other(kernel, monkeypatch):
    """Gradients are only read: a donated step given one gradient tensor for two leaves
    (shapes alike) steps them as it steps two copies of it, on every kernel."""
    if kernel == "c" and not cpu_kernel.available():
        pytest.skip("no C compiler here")
    if kernel == "generic":
        monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(6, generator=g) * 100).half()
    s, started = _scalars()

    def step(grads):
        master = [torch.linspace(-1, 1, 6), torch.linspace(2, 3, 6)]
        params = [m.half() for m in master]
        sgd_step_(grads, master, [torch.zeros(6), torch.zeros(6)], params, [True, True], **s,
                  started=started, **SGD_FLAGS[0], members=1)  # fmt: skip
        return master, params

    shared, copied = step([z, z]), step([z.clone(), z.clone()])
    for a, b in zip(shared[0] + shared[1], copied[0] + copied[1]):
        assert torch.equal(bits(a), bits(b))
    master = [torch.zeros(6), torch.zeros(6)]
    on_master = master[1].view(torch.float16)[:6]  # a gradient in a written tensor's memory
    with pytest.raises(ValueError, match="share memory"):
        sgd_step_([z, on_master], master, [torch.zeros(6), torch.zeros(6)],
                  [m.half() for m in master], [True, True], **s, started=started,
                  **SGD_FLAGS[0], members=1)  # fmt: skip


def test_the_donated_op_refuses_arguments_that_share_memory():
    grads, master, params = _leaves(torch.float16)
    s, started = _scalars()
    with pytest.raises(ValueError, match="share memory"):
        sgd_step_(
            grads,
            master,
            master,
            params,
            [True] * 3,
            **s,
            started=started,
            **SGD_FLAGS[0],
            members=1,
        )
    flat = torch.randn(10)
    views = [flat[:6], flat[4:]]  # overlapping views of one buffer
    with pytest.raises(ValueError, match="share memory"):
        sgd_step_(
            [torch.zeros(6).half(), torch.zeros(6).half()],
            views,
            [],
            [],
            [False] * 2,
            **s,
            started=None,
            weight_decay=0.0,
            momentum=0.0,
            dampening=0.0,
            nesterov=False,
            members=1,
        )


@pytest.mark.parametrize(
    "entry, change, message",
    [
        ("grad_stats", dict(sum_squares=1, sum_sq_out=None), "sum_sq_out is required"),
        ("sgd_update", dict(clip_mul=None), "clip_div, clip_mul are given together"),
        ("sgd_update", dict(trace_out=None), "trace, trace_out are given together"),
        ("sgd_update", dict(params_out=[torch.empty(1000)]), "params_out.0. has dtype"),
        ("sgd_update", dict(lr=torch.ones(2)), "lr must be contiguous of shape"),
    ],
)
def test_the_c_interface_refuses_arguments_that_do_not_fit_together(entry, change, message):
    """Each of these reached C before its check existed (a crash or an out-of-bounds read)."""
    g, m = [torch.zeros(1000).half()], [torch.zeros(1000)]
    args = {
        "grad_stats": dict(
            grads=g, inv=None, sum_squares=0, threads=1, peak_out=torch.empty(1), sum_sq_out=None
        ),
        "sgd_update": dict(
            grads=g,
            master=m,
            trace=[torch.zeros(1000)],
            params=[m[0].half()],
            master_out=[torch.empty(1000)],
            trace_out=[torch.empty(1000)],
            params_out=[torch.empty(1000).half()],
            inv=None,
            clip_div=torch.ones(1),
            clip_mul=torch.ones(1),
            lr=torch.ones(1),
            apply=torch.ones(1, dtype=torch.bool),
            started=None,
            weight_decay=0.0,
            momentum=0.9,
            take_started=1.0,
            nesterov=0,
            split=0,
            threads=1,
            require=None,
            decided_out=None,
            leaf_finite_out=None,
        ),
    }[entry]
    args.update(change)
    with pytest.raises((TypeError, ValueError), match=message):
        cpu_kernel.call(entry, n_groups=1, **args)


def test_the_kernels_refuse_gradients_on_several_devices():
    """A CUDA tensor among CPU ones would hand the C kernel a device pointer: the ops'
    kernels check that every gradient is on one device (meta stands in for CUDA here;
    the dispatcher itself would route a call with a meta tensor to the fake kernel)."""
    grads = [torch.ones(4, dtype=torch.float16), torch.ones(4, dtype=torch.float16, device="meta")]
    with pytest.raises(ValueError, match=r"grads\[1\] is on meta"):
        op_library._grad_stats(grads, None, 1, 1, False)
    with pytest.raises(ValueError, match=r"grads\[1\] is on meta"):
        op_library._check_grads("sgd_step", grads, 1)


# -- the CUDA kernel -----------------------------------------------------------------------


def test_cuda_runs_pytorchs_kernels_and_the_retired_triton_choice_says_so(monkeypatch):
    """CUDA's kernel is the plain one (PyTorch's multi-tensor ops and fused optimiser
    kernels); the library's Triton kernels were retired, and asking for them raises,
    naming the variable, rather than silently running something else."""
    from functional_fp16._fused import device_kernels as dk

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(dk.CUDA_KERNEL_VARIABLE, raising=False)
    assert dk.kernel_for(cuda) == dk.CUDA_DEFAULT_KERNEL == "generic"
    monkeypatch.setenv(dk.CUDA_KERNEL_VARIABLE, "torch")
    assert dk.kernel_for(cuda) == "generic"
    monkeypatch.setenv(dk.CUDA_KERNEL_VARIABLE, "triton")
    with pytest.raises(ValueError, match="FUNCTIONAL_FP16_CUDA_KERNEL=triton: .* retired"):
        dk.kernel_for(cuda)
    monkeypatch.setenv(dk.CUDA_KERNEL_VARIABLE, "tirton")
    with pytest.raises(ValueError, match="FUNCTIONAL_FP16_CUDA_KERNEL must be 'torch'"):
        dk.kernel_for(cuda)


@pytest.mark.parametrize(
    "name", ["sgd_momentum", "adam", "recipe", "lion", "rmsprop_momentum_schedule"]
)
def test_the_plain_kernel_runs_a_fixed_number_of_ops_whatever_the_leaves(name, monkeypatch):
    """The plain kernel of one group (CUDA's default) is multi-tensor: the number of
    dispatched ops does not grow with the number of leaves."""
    from tests.helpers import optimiser_matrix

    monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    tx = optimiser_matrix().get(name) or ff.sgd(0.05, momentum=0.9)
    counts = []
    for n in (4, 16):
        params = {f"w{i:02d}": torch.full((3, 5), 0.1, dtype=torch.float16) for i in range(n)}
        state = ff.fp16_init(params, tx)
        grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
        state = ff.fp16_update(state, grads)  # the first call builds the plans
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ff.fp16_update(state, grads)
        # The computing ops (allocations and views launch nothing), and the foreach ones.
        ran = top_level_ops(prof)
        counts.append((len(computing_ops(prof)), sum(n.startswith("aten::_foreach") for n in ran)))
    assert counts[0] == counts[1] and counts[0][1] > 0, counts


@pytest.mark.parametrize(
    ("name", "n_states", "n_hyper", "message"),
    [
        ("lion", 0, 5, "states: 0 lists, expected 1 to 1"),
        ("rmsprop", 0, 5, "states: 0 lists, expected 1 to 2"),
        ("rmsprop", 3, 5, "states: 3 lists, expected 1 to 2"),
        ("rmsprop", 1, 4, "hyper: 4 values, expected 5"),
        ("adam_stored", 1, 5, "takes this op's arguments"),
    ],
)
def test_the_generic_cpp_op_refuses_a_step_its_arguments_do_not_fit(
    name, n_states, n_hyper, message
):
    """The C++ op every argument-block step runs through checks the number of state lists
    and hyperparameters each C step takes (``ff_step_arity``) before calling it."""
    if not cpu_kernel.ops_available():
        pytest.skip("no C++ op library here")
    g, m = [torch.ones(3, dtype=torch.float16)], [torch.ones(3)]
    with pytest.raises(RuntimeError, match=message):
        cpu_kernel.run_op(
            "step", name, g, m, [torch.zeros(3) for _ in range(n_states)], [], [False], None,
            None, None, torch.full((1,), -0.1), None, None, [], [0.5] * n_hyper, 1, 1, False,
        )  # fmt: skip


def _recipe_state_and_grads(n_leaves=12):
    g = torch.Generator().manual_seed(5)
    params = {f"w{i}": (torch.randn(3 + i, 4, generator=g) * 0.1).half() for i in range(n_leaves)}
    grads = {k: (torch.randn(v.shape, generator=g) * 1e-2).half() for k, v in params.items()}
    tx = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(1e-3, weight_decay=0.1))
    return ff.fp16_init(params, tx, ff.DynamicLossScale(init_scale=2.0**10)), grads


_NEEDS_OPS = pytest.mark.skipif(
    not cpu_kernel.ops_available(), reason="the C++ op library is not built here"
)


@_NEEDS_OPS
def test_the_cpp_ops_find_pythons_gil_functions():
    """Loaded into Python, the op library finds the GIL's functions (declared weakly), so
    its ops release their inputs in one hold of the GIL rather than a tensor at a time."""
    import ctypes

    library = ctypes.CDLL(str(cpu_kernel._build_ops()))  # the loaded library, not a copy
    assert library.ff_releases_together() == 1


@_NEEDS_OPS
def test_the_cpp_ops_keep_no_reference_to_their_inputs():
    """The C++ ops release their inputs' references together after the kernel has run
    (``ReleasingInputsTogether``): every input is released, none is kept. The gradients'
    and the previous state's tensors are freed when the caller drops them, and the
    references Python counts on a gradient are the same after the calls as before."""
    import gc
    import sys
    import weakref

    state, grads = _recipe_state_and_grads()
    assert ff.update_path(state) == "fused"
    state = ff.fp16_update(state, grads)  # the route, plan and layout learnt
    probe = grads["w3"]
    before = sys.getrefcount(probe)
    new = ff.fp16_update(state, grads)
    assert sys.getrefcount(probe) == before
    watched = [weakref.ref(t) for t in [*tree_leaves(state), *grads.values()]]
    del state, grads, probe
    gc.collect()
    assert all(w() is None for w in watched)
    assert bool(new.grads_finite)


@_NEEDS_OPS
def test_the_cpp_ops_run_from_a_thread_as_from_the_main_one():
    """An update in another Python thread, whose ops take back the GIL from that thread's
    own state to release their inputs, finishes and is bitwise the main thread's."""
    import threading

    state, grads = _recipe_state_and_grads()
    main = ff.fp16_update(ff.fp16_update(state, grads), grads)
    out = {}

    def run():
        out["state"] = ff.fp16_update(ff.fp16_update(state, grads), grads)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the update in a thread did not finish"
    for a, b in zip(tree_leaves(main), tree_leaves(out["state"])):
        assert torch.equal(bits(a), bits(b))
