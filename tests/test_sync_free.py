"""No host synchronisation inside the update, checked on the CPU two ways.

1. Every ``torch.Tensor`` method that hands a value to Python (``item``,
   ``tolist``, ``__bool__``, ``__float__``, ``numpy``, ...) is patched to raise.
2. A ``TorchDispatchMode`` refuses the ATen operators that read a value to the
   host or whose output shape depends on values (``_local_scalar_dense`` is
   what ``item``/``bool``/``int`` dispatch to; ``nonzero``, ``masked_select``
   and friends synchronise on CUDA to size their output).

Together these catch a sync on any device, since a CUDA synchronisation in
PyTorch is always one of these calls. The CUDA-only checks (sync debug mode,
CUDA-graph capture) live in ``test_cuda.py``.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import functional_fp16 as ff
from functional_fp16._util.tree import tree_map
from tests.helpers import HostSync, no_host_sync, random_tree


@pytest.mark.parametrize(
    "action",
    [
        lambda t: t.item(),
        lambda t: bool(t),
        lambda t: float(t),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: torch.nonzero(t),
        lambda t: t[t > 0],
        lambda t: torch.equal(t, t),
        lambda t: t.sum().cpu(),
        lambda t: [1, 2][t.long()],
    ],
)
def test_the_guard_catches_each_kind_of_sync(action):
    t = torch.ones(())
    with pytest.raises(HostSync):
        with no_host_sync():
            action(t)
    action(t)  # and everything is restored afterwards


def _txs():
    return [
        ff.sgd(0.1),
        ff.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        ff.sgd(ff.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10), momentum=0.9, dampening=0.1),
        ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.05, momentum=0.9)),
        ff.apply_if_finite(ff.sgd(0.05, momentum=0.9), 2),
    ]


def _four_steps_without_a_sync(state, **update_kwargs):
    """Four updates under the host-sync guard: random gradients, an inf in ``scalar`` at the
    second step, a NaN loss at the third."""
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        grads = tree_map(
            lambda p: (torch.randn(p.shape, generator=g) * 64).to(p.dtype), state.params
        )
        if step == 1:
            grads["scalar"] = torch.tensor(math.inf, dtype=torch.float16)
        loss = torch.tensor(math.nan if step == 2 else 1.0)
        with no_host_sync():
            state = ff.fp16_update(state, grads, loss=loss, **update_kwargs)
    return state


@pytest.mark.parametrize("tx_index", range(len(_txs())))
@pytest.mark.parametrize("donate", [False, True])
def test_update_reads_nothing_back(impl, donate, tx_index):
    tx = _txs()[tx_index]
    for loss_scale in (ff.DynamicLossScale(2.0**12, growth_interval=2), ff.NoOpLossScale()):
        state = ff.fp16_init(random_tree(tx_index), tx, loss_scale)
        state = _four_steps_without_a_sync(state, impl=impl, donate=donate, agree=lambda f: f & f)
        assert int(state.step) == 4


def test_whole_training_step_reads_nothing_back(impl):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 8, generator=g) * 0.3, "b": torch.zeros(4)}
    state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)

    def scaled_loss(p):
        logits = x @ p["w"].float().T + p["b"].float()
        loss = F.cross_entropy(logits, y)
        return state.loss_scale.scale(loss), loss.detach()

    for _ in range(3):
        with no_host_sync():
            grads, (_, loss) = torch.func.grad_and_value(scaled_loss, has_aux=True)(state.params)
            state = ff.fp16_update(state, grads, loss=loss, impl=impl)
    assert int(state.step) == 3


def _every_optimiser():
    from tests.helpers import optimiser_matrix

    out = dict(optimiser_matrix())
    out["rmsprop"] = ff.rmsprop(1e-3, momentum=0.9)
    out["multi_steps_recipe"] = ff.MultiSteps(optimiser_matrix()["recipe"], 2)
    out["inject_adamw"] = ff.inject_hyperparams(ff.adamw)(learning_rate=1e-3, weight_decay=0.1)
    return out


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", sorted(_every_optimiser()))
def test_the_cuda_default_reads_nothing_back_for_every_optimiser(name, donate, monkeypatch):
    """The path CUDA runs by default (``FUNCTIONAL_FP16_CPU_KERNEL=cuda-default`` runs it on
    the CPU), for every optimiser, with an overflow and a NaN loss among the steps."""
    monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", "cuda-default")
    tx = _every_optimiser()[name]
    state = ff.fp16_init(random_tree(1), tx, ff.DynamicLossScale(2.0**12, growth_interval=2))
    state = _four_steps_without_a_sync(state, donate=donate)
    assert int(state.step) == 4
