"""torchvision's resnet18 trains through the bridge under reduced-precision policies.

The models of issue 13: BatchNorm everywhere, residual additions of norm
outputs, ``p=f16,c=bf16`` (the README's CPU default) and ``p=f16,c=f16``. The
norm layers compute in float32 (``default_module_policies``), everything else
in the compute dtype. A few steps on one tiny random batch: the loss goes
down, no step overflows, and the dtypes are what the policy declares.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

torchvision = pytest.importorskip("torchvision")

from functional_fp16 import (  # noqa: E402
    DynamicLossScale,
    fp16_init,
    fp16_update,
    get_policy,
    make_apply,
    scaled_grad_and_value,
    sgd,
    split_module,
)

LR = 0.01


@pytest.mark.parametrize(
    "spec, steps",
    [
        ("p=f16,c=bf16", 3),
        # CPUs have no fast FP16 convolutions (about 7 s a step here): two steps.
        pytest.param("p=f16,c=f16", 2, marks=pytest.mark.slow),
    ],
)
def test_resnet18_trains_with_float32_norms(spec, steps):
    policy = get_policy(spec)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    seen = {"norm": set(), "conv": set()}

    def record(kind):
        def hook(module, args, output):
            seen[kind].add((args[0].dtype, module.weight.dtype, output.dtype))

        return hook

    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.register_forward_hook(record("norm"))
        elif isinstance(module, nn.Conv2d):
            module.register_forward_hook(record("conv"))

    params, buffers = split_module(model)
    apply = make_apply(model, train=True, policy=policy)

    def loss_fn(p, buffers, x, y):
        logits, new_buffers = apply(p, buffers, x)
        return F.cross_entropy(logits.float(), y), (logits, new_buffers)

    grad_fn = scaled_grad_and_value(loss_fn, has_aux=True)
    state = fp16_init(
        params, sgd(LR), DynamicLossScale(init_scale=2.0**10), param_dtype=policy.param_dtype
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)

    losses = []
    for _ in range(steps):
        grads, (loss, (logits, buffers)) = grad_fn(state.loss_scale, state.params, buffers, x, y)
        assert {g.dtype for g in grads.values()} == {torch.float16}
        state = fp16_update(state, grads, loss=loss)
        assert bool(state.grads_finite)
        losses.append(float(loss))
    with torch.no_grad():
        losses.append(float(loss_fn(state.params, buffers, x, y)[0]))

    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert logits.dtype == policy.output_dtype == policy.compute_dtype  # jmp's defaults
    compute = policy.compute_dtype
    assert seen["norm"] == {(torch.float32,) * 3}
    assert seen["conv"] == {(compute,) * 3}
    assert buffers["bn1.running_var"].dtype == torch.float32
    assert int(buffers["bn1.num_batches_tracked"]) == steps
