"""Runs the Triton update kernel on CPU tensors under ``TRITON_INTERPRET=1``.

Started by ``tests/test_cuda_kernel.py`` in a fresh process (the variable must
be set before Triton is imported). Prints one line per configuration and
``ALL OK`` at the end; any failed check raises.

The interpreter evaluates ``tl.fma`` as a product and a sum rounded
separately (NumPy has no fused multiply-add), so where the kernel contracts
weight decay or Nesterov's sum the check here is the two-rounding bound,
two eps of the tensor's magnitude; everything else is held to the contract.
It also truncates float32 to BF16 where the GPU's ``cvt.rn`` rounds to
nearest even, so the BF16 working copy is not compared bitwise here.
"""

import math
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16 import cuda_kernel, fused_update  # noqa: E402
from functional_fp16._tree import tree_leaves, tree_map  # noqa: E402
from functional_fp16.adam_plan import AdamPlan  # noqa: E402
from tests.helpers import assert_within_one_operation_ulp, scaled_error  # noqa: E402


def bits_equal(a, b):
    a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check(tx, param_dtype, loss_scale, exact_arithmetic):
    torch.manual_seed(0)
    params = {"w": torch.randn(3000) * 0.1, "b": torch.randn(3), "s": torch.randn(())}
    state = ff.fp16_init(params, tx, loss_scale, param_dtype=param_dtype)
    plan = fused_update.fused_plan(state)._replace(kernel=cuda_kernel)
    scale = float(state.loss_scale.loss_scale)
    for step in range(4):
        grads = {
            k: (torch.randn(v.shape) * scale * 1e-2).to(param_dtype)
            for k, v in state.params.items()
        }
        if step == 2:
            grads["b"][1] = [math.inf, math.nan][step % 2]
        for donate in (False, True):
            ref = ff.fp16_update(state, grads, impl="reference")
            run = tree_map(lambda x: x.clone(), state)  # a copy that may be donated
            run._kernel_plan = plan  # the Triton kernel, on these CPU tensors
            new = ff.fp16_update(run, grads, donate=donate)
            assert torch.equal(new.grads_finite, ref.grads_finite)
            assert bits_equal(new.loss_scale.loss_scale, ref.loss_scale.loss_scale)
            assert torch.equal(new.step, ref.step)
            if not bool(ref.grads_finite):
                for a, b in zip(
                    tree_leaves((new.params, new.master, new.opt_state)),
                    tree_leaves((state.params, state.master, state.opt_state)),
                ):
                    assert bits_equal(a, b), "a skipped step changed the state"
                continue
            for k in state.master:
                if exact_arithmetic:
                    assert_within_one_operation_ulp(new.master[k], ref.master[k], state.master[k])
                else:
                    assert scaled_error(new.master[k], ref.master[k]) <= 2.0
                if param_dtype != torch.bfloat16:  # the interpreter truncates to BF16 (see above)
                    assert bits_equal(new.params[k], new.master[k].to(param_dtype))
        state = ref
    if isinstance(plan.plan, AdamPlan):  # the moments (fma on a GPU, two roundings here)
        for want, got in zip(tree_leaves(ref.opt_state), tree_leaves(new.opt_state)):
            if want.dtype == torch.int32:
                assert torch.equal(want, got), "the step count differs from the reference's"
            else:
                assert scaled_error(got, want) <= 2.0, "the moments differ from the reference's"
    print("ok", param_dtype, plan.plan)


sched = ff.linear_schedule(0.1, 0.01, 3)
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    scale = ff.DynamicLossScale(2.0**10) if dtype == torch.float16 else ff.NoOpLossScale()
    check(ff.sgd(0.05, momentum=0.9), dtype, scale, True)
check(ff.sgd(0.05, momentum=0.8, dampening=0.3), torch.float16, ff.StaticLossScale(64.0), True)
check(ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(sched, momentum=0.9)), torch.float16, None, True)
check(ff.sgd(0.1), torch.float16, None, True)
check(ff.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2), torch.float16, None, False)
# Adam: the moments' fma and the decays contract where the interpreter rounds twice.
check(ff.adam(1e-3), torch.float16, None, False)
check(ff.adamw(sched, b1=0.3, weight_decay=1e-2), torch.bfloat16, ff.NoOpLossScale(), False)
check(
    ff.chain(ff.clip_by_global_norm(1.0), ff.add_decayed_weights(1e-2), ff.adam(1e-3)),
    torch.float32,
    ff.NoOpLossScale(),
    False,
)
print("ALL OK")
