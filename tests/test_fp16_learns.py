"""The FP16 path learns: FP16 parameters reach the FP32 model's accuracy on a generated task.

Both models start from the same initialisation, see the same batches and run
the same SGD-momentum; only the precision differs. A second case shrinks the
loss by 2**-20 (and raises the learning rate by 2**20, so the FP32 updates are
unchanged): the FP16 gradients then fall below FP16's smallest subnormal, so
without loss scaling the FP16 model cannot learn at all, and with dynamic loss
scaling it matches FP32 again.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from functional_fp16 import (
    DynamicLossScale,
    NoOpLossScale,
    fp16_init,
    fp16_update,
    get_policy,
    make_apply,
    scaled_grad_and_value,
    sgd,
    split_module,
)

CLASSES, DIM, HIDDEN = 4, 16, 64
STEPS, BATCH, LR, MOMENTUM = 150, 64, 0.05, 0.9
MARGIN = 0.02  # FP16 accuracy may trail FP32 by at most two points


pytestmark = pytest.mark.usefixtures("one_thread")


def make_task(seed=0):
    """Gaussian blobs: class means on a sphere of radius 2.5, unit noise (some overlap)."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(CLASSES, DIM, generator=g)
    means = 2.5 * means / means.norm(dim=1, keepdim=True)

    def sample(n):
        labels = torch.randint(0, CLASSES, (n,), generator=g)
        return means[labels] + torch.randn(n, DIM, generator=g), labels

    return sample(STEPS * BATCH), sample(2048)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def train(policy_spec, loss_scale, *, loss_factor=1.0):
    policy = get_policy(policy_spec)
    (x, y), (x_test, y_test) = make_task()
    model = make_model()
    params, buffers = split_module(model)
    apply = make_apply(model, train=True)

    def loss_fn(p, xb, yb):
        logits, _ = apply(policy.cast_to_compute(p), buffers, policy.cast_to_compute(xb))
        return F.cross_entropy(policy.cast_to_output(logits), yb) * loss_factor

    grad_fn = scaled_grad_and_value(loss_fn)
    state = fp16_init(
        params, sgd(LR / loss_factor, momentum=MOMENTUM), loss_scale, param_dtype=policy.param_dtype
    )
    skipped = 0
    for i in range(STEPS):
        sl = slice(i * BATCH, (i + 1) * BATCH)
        grads, loss = grad_fn(state.loss_scale, state.params, x[sl], y[sl])
        assert all(g.dtype == policy.param_dtype for g in grads.values())
        state = fp16_update(state, grads, loss=loss)
        skipped += int(not state.grads_finite)
    with torch.no_grad():
        logits, _ = apply(
            policy.cast_to_compute(state.params), buffers, policy.cast_to_compute(x_test)
        )
    accuracy = (logits.argmax(1) == y_test).float().mean().item()
    return accuracy, state, skipped


@pytest.fixture(scope="module")
def fp32_accuracy():
    accuracy, _, skipped = train("float32", NoOpLossScale())
    assert skipped == 0
    assert accuracy > 0.85  # the task is learnable in STEPS steps
    return accuracy


@pytest.mark.parametrize("policy", ["p=f16,c=f16,o=f32", "p=f16,c=f32,o=f32"])
def test_fp16_params_reach_fp32_accuracy(policy, fp32_accuracy):
    accuracy, state, skipped = train(policy, DynamicLossScale())
    assert state.params["0.weight"].dtype == torch.float16
    assert state.master["0.weight"].dtype == torch.float32
    assert skipped < STEPS // 10
    assert accuracy >= fp32_accuracy - MARGIN, (accuracy, fp32_accuracy)


def test_loss_scaling_is_what_makes_tiny_fp16_gradients_learn(fp32_accuracy):
    factor = 2.0**-20
    # Without scaling, every FP16 gradient flushes to zero: the model never moves.
    accuracy, state, _ = train("p=f16,c=f16,o=f32", NoOpLossScale(), loss_factor=factor)
    assert accuracy < 0.5
    init = split_module(make_model())[0]
    assert all(torch.equal(state.master[k], init[k]) for k in init)
    # Dynamic loss scaling (growing quickly from 1) recovers the FP32 result.
    scale = DynamicLossScale(init_scale=1.0, growth_interval=5, max_scale=2.0**30)
    accuracy, state, _ = train("p=f16,c=f16,o=f32", scale, loss_factor=factor)
    assert float(state.loss_scale.loss_scale) >= 2.0**16
    assert accuracy >= fp32_accuracy - MARGIN, (accuracy, fp32_accuracy)
