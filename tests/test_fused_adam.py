"""The plain kernel's Adam/AdamW is PyTorch's fused kernel, bitwise ``torch.optim``'s fused step.

What runs on CUDA by default (and here under ``$FUNCTIONAL_FP16_CPU_KERNEL=cuda-default``,
where ``torch._fused_adam_`` and ``torch._fused_adamw_`` run on the CPU): a float32-moment
Adam group of one member steps its FP32 master with PyTorch's fused kernel. The contract:

* from the same FP32 master, moments, step count, learning rate and unscaled (clipped)
  gradients, master and moments are **bitwise** ``torch.optim.Adam``/``AdamW(fused=True)``'s
  step; the working copies are the new master rounded; a skipped step writes nothing;
* against the reference, the bound that kernel's formula implies,
  ``tests.helpers.fused_adam_excess`` (held in ``tests/test_fused_update.py``, every
  chain of the matrix): ``2 ulp(S) + 4 * 2^-24 * |m' - m|`` at the operation's scale
  ``S``, the moments bitwise on the CPU;
* decisions, loss scale and counts bitwise (``tests/test_cpu_kernel_switch.py``).

CUDA's fused kernel is compiled from the same formula but was not run here.
"""

from __future__ import annotations

import math

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused import device_kernels as dk
from functional_fp16._fused import op_library, steps
from functional_fp16._fused.adam import adam_step, adam_step_
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import assert_states_bitwise_equal, bits, matrices, matrix_grads, random_tree

DECAYS = {"adamw": (0.0, 0.1), "adam_l2": (1e-2, 0.0), "none": (0.0, 0.0)}
B1, B2, EPS = 0.9, 0.95, 1e-8


def _leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (33,), (2, 3, 4, 5), ()]
    master = [torch.randn(s, generator=g) for s in shapes]
    master[2] = master[2].to(memory_format=torch.channels_last)  # dense, not contiguous
    grads = [
        torch.empty_like(m, dtype=torch.float16).copy_(torch.randn(m.shape) * 300) for m in master
    ]
    mu = [torch.randn_like(m) * 0.1 for m in master]
    nu = [torch.rand_like(m) * 0.01 for m in master]
    return grads, master, mu, nu


def _torch_step(master, u, mu, nu, t, lr, l2, decoupled):
    """``torch.optim``'s fused step of these tensors at step ``t`` (its state holds t - 1)."""
    params = [torch.nn.Parameter(m.clone()) for m in master]
    if l2:
        opt = torch.optim.Adam(params, lr=lr, betas=(B1, B2), eps=EPS, weight_decay=l2, fused=True)
    else:
        opt = torch.optim.AdamW(
            params, lr=lr, betas=(B1, B2), eps=EPS, weight_decay=decoupled, fused=True
        )
    for p, g, a, v in zip(params, u, mu, nu):
        p.grad = g.clone()
        opt.state[p] = {
            "step": torch.tensor(t - 1.0),
            "exp_avg": a.clone(),
            "exp_avg_sq": v.clone(),
        }
    opt.step()
    return (
        [p.detach() for p in params],
        [opt.state[p]["exp_avg"] for p in params],
        [opt.state[p]["exp_avg_sq"] for p in params],
    )


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("decay", sorted(DECAYS))
def test_the_plain_kernel_is_torchs_fused_step_bitwise(decay, donate, clip, monkeypatch):
    monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    l2, decoupled = DECAYS[decay]
    grads, master, mu, nu = _leaves()
    params = [m.half() for m in master]
    t, lr = 7.0, float(torch.tensor(3e-3))  # the learning rate a float32 (the op's)
    inv = torch.tensor([2.0**-7])
    clip_div, clip_mul = (torch.tensor([3.5]), torch.tensor([1.25])) if clip else (None, None)
    a = dict(
        inv=inv, clip_div=clip_div, clip_mul=clip_mul, lr=torch.tensor([-lr]),
        apply=torch.tensor([True]), require=None, inv_c1=None, sqrt_c2=None,
        count=torch.tensor([t]), l2=l2, b1=B1, b2=B2, eps=EPS, decoupled=decoupled, members=1,
    )  # fmt: skip
    # The unscaled gradients as every kernel forms them: fl32(g) * inv, then / c_d * c_m.
    u = [g.float() * inv.reshape(()) for g in grads]
    if clip:
        u = [x / clip_div.reshape(()) * clip_mul.reshape(()) for x in u]
    want_m, want_mu, want_nu = _torch_step(master, u, mu, nu, t, lr, l2, decoupled)
    ins = [[x.clone() for x in xs] for xs in (master, mu, nu, params)]
    separate = [True] * len(master)
    if donate:
        out = [[x.clone() for x in xs] for xs in ins]
        adam_step_(grads, *out, separate, **a)
    else:
        *out, _, _ = adam_step(grads, *ins, separate, **a)
    new_m, new_mu, new_nu, new_p = out
    assert_states_bitwise_equal((new_m, new_mu, new_nu), (want_m, want_mu, want_nu))
    assert_states_bitwise_equal(new_p, [m.half() for m in want_m])
    assert_states_bitwise_equal(ins, [master, mu, nu, params])  # the inputs untouched
    # Skipped: nothing is written, bit for bit.
    skip = {**a, "apply": torch.tensor([False])}
    if donate:
        out = [[x.clone() for x in xs] for xs in ins]
        adam_step_(grads, *out, separate, **skip)
    else:
        *out, _, _ = adam_step(grads, *ins, separate, **skip)
    assert_states_bitwise_equal(out, ins)


def _recipe(lr):
    return ff.adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=0.1, mask=matrices)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_the_masked_adamw_update_under_cudas_default_is_torchs_fused_adamw(donate, monkeypatch):
    """Whole updates (a dynamic loss scale, a warmup-cosine schedule, decay on the matrices
    only: two groups), each from the state before it, against ``AdamW(fused=True)`` with
    two parameter groups, given the same unscaled gradients and learning rate."""
    monkeypatch.setenv(dk.CPU_KERNEL_VARIABLE, "cuda-default")
    schedule = ff.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 20, 1e-4)
    state = ff.fp16_init(random_tree(5, scale=0.5), _recipe(schedule), ff.DynamicLossScale(2.0**10))
    fp = steps.fused_plan(state)
    assert {g.fusable.name for g in fp.groups} == {"adam"} and len(fp.groups) == 2
    applied = 0
    for step in range(5):
        grads = matrix_grads(state, step, 3, bad=math.inf if step == 2 else None)
        old = tree_map(lambda x: x.clone(), state)
        state = ff.fp16_update(state, grads, donate=donate)
        opt = tree_leaves(old.opt_state)
        if not bool(state.grads_finite):
            assert_states_bitwise_equal(
                (state.params, state.master, state.opt_state),
                (old.params, old.master, old.opt_state),
            )
            continue
        applied += 1
        inv = ff.unscale_factor(old.loss_scale.loss_scale)
        masters, g = tree_leaves(old.master), tree_leaves(grads)
        new_m, new_opt = tree_leaves(state.master), tree_leaves(state.opt_state)
        for grp in fp.groups:
            roles = dict(grp.roles)
            count = opt[dict(grp.shared)["count"]]
            lr = float(schedule(opt[dict(grp.shared)["lr_count"]]).to(torch.float32))
            m = [masters[i] for i in grp.leaves]
            u = [g[i].float() * inv for i in grp.leaves]
            mu, nu = ([opt[i] for i in roles[r]] for r in ("mu", "nu"))
            decay = grp.plan.decoupled_decay
            want = _torch_step(m, u, mu, nu, float(count) + 1.0, lr, 0.0, decay)
            got = (
                [new_m[i] for i in grp.leaves],
                *([new_opt[i] for i in roles[r]] for r in ("mu", "nu")),
            )
            assert_states_bitwise_equal(got, want)
        for p, m in zip(tree_leaves(state.params), new_m):
            assert torch.equal(bits(p), bits(m.half()))
    assert applied == 4
