"""Tests for the torch.func bridge: split_module, make_apply (with policies),
scaled_grad_and_value, module_state_dict."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch import nn

from functional_fp16 import (
    DynamicLossScale,
    NoOpLossScale,
    Policy,
    StaticLossScale,
    cast_to,
    fp16_init,
    fp16_update,
    get_policy,
    make_apply,
    module_state_dict,
    norm_policy,
    scaled_grad_and_value,
    sgd,
    split_module,
)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class ConvBN(nn.Module):
    """Conv + BatchNorm + Linear: parameters, buffers and a train/eval difference."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))


class Tied(nn.Module):
    """An embedding whose weight is also the output projection (weight tying)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


pytestmark = pytest.mark.usefixtures("one_thread")


def batch(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def clone_tree(tree):
    return {k: v.clone() for k, v in tree.items()}


def assert_trees_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- split_module ---------------------------------------------------------------


def test_split_module_copies_parameters_and_buffers():
    model = ConvBN()
    params, buffers = split_module(model)
    assert list(params) == [n for n, _ in model.named_parameters()]
    assert list(buffers) == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p)
        assert not params[name].requires_grad
        assert params[name].data_ptr() != p.data_ptr()
    before = model.conv.weight.detach().clone()
    params["conv.weight"].add_(1.0)
    buffers["bn.running_mean"].add_(1.0)
    assert torch.equal(model.conv.weight, before)
    assert torch.equal(model.bn.running_mean, torch.zeros(4))


def test_split_module_rejects_non_modules():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        split_module({"w": torch.ones(1)})


# -- make_apply -----------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
def test_apply_matches_the_module(train):
    model = ConvBN().train(train)
    params, buffers = split_module(model)
    x, _ = batch()
    out, _ = make_apply(model, train=train)(params, buffers, x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_train_mode_batchnorm_returns_new_buffers_without_mutating_anything():
    model = ConvBN().train()
    params, buffers = split_module(model)
    module_buffers = {k: v.clone() for k, v in model.named_buffers()}
    params0, buffers0 = clone_tree(params), clone_tree(buffers)
    apply = make_apply(model, train=True)
    x, _ = batch()

    _, new_buffers = apply(params, buffers, x)

    assert_trees_equal(params, params0)
    assert_trees_equal(buffers, buffers0)
    assert_trees_equal(dict(model.named_buffers()), module_buffers)
    # The new buffers are what the module's own forward pass would produce.
    model(x)
    assert_trees_equal(new_buffers, dict(model.named_buffers()))
    assert int(new_buffers["bn.num_batches_tracked"]) == 1
    assert not torch.equal(new_buffers["bn.running_mean"], buffers["bn.running_mean"])

    # Threading them through a second call keeps counting.
    _, newer = apply(params, new_buffers, x)
    assert int(newer["bn.num_batches_tracked"]) == 2
    assert int(new_buffers["bn.num_batches_tracked"]) == 1


def test_eval_mode_uses_running_statistics_and_leaves_buffers_unchanged():
    model = ConvBN()
    params, buffers = split_module(model)
    buffers["bn.running_mean"] = torch.linspace(-1, 1, 4)
    buffers["bn.running_var"] = torch.linspace(0.5, 2, 4)
    x, _ = batch()
    out, new_buffers = make_apply(model, train=False)(params, buffers, x)
    assert_trees_equal(new_buffers, buffers)
    model.bn.running_mean.copy_(buffers["bn.running_mean"])
    model.bn.running_var.copy_(buffers["bn.running_var"])
    torch.testing.assert_close(out, model.eval()(x), rtol=0, atol=0)


def test_apply_is_independent_of_later_changes_to_the_module():
    model = ConvBN().train()
    params, buffers = split_module(model)
    apply_default = make_apply(model)  # keeps the current (training) mode
    x, _ = batch()
    expected, _ = make_apply(model, train=True)(params, buffers, x)
    model.eval()
    with torch.no_grad():
        model.conv.weight.zero_()
    out, new_buffers = apply_default(params, buffers, x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert int(new_buffers["bn.num_batches_tracked"]) == 1  # still in training mode


def test_apply_names_missing_unexpected_and_misshapen_entries():
    model = ConvBN()
    params, buffers = split_module(model)
    apply = make_apply(model)
    x, _ = batch()
    missing = {k: v for k, v in params.items() if k != "fc.bias"}
    with pytest.raises(KeyError, match=r"missing \['fc.bias'\]"):
        apply(missing, buffers, x)
    with pytest.raises(KeyError, match=r"unexpected \['extra'\]"):
        apply({**params, "extra": torch.zeros(1)}, buffers, x)
    with pytest.raises(ValueError, match=r"params\['fc.weight'\]: shape \(5, 100\)"):
        apply({**params, "fc.weight": torch.zeros(5, 100)}, buffers, x)
    with pytest.raises(TypeError, match=r"buffers\['bn.running_var'\]: expected a tensor"):
        apply(params, {**buffers, "bn.running_var": 1.0}, x)
    with pytest.raises(TypeError, match="params must be a dict"):
        apply(list(params.values()), buffers, x)
    with pytest.raises(TypeError, match="train must be a bool"):
        make_apply(model, train="yes")


# -- gradients --------------------------------------------------------------------


def reference_grads(model, x, y):
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def make_loss_fn(apply):
    def loss_fn(params, buffers, x, y):
        logits, new_buffers = apply(params, buffers, x)
        return F.cross_entropy(logits, y), new_buffers

    return loss_fn


@pytest.mark.parametrize("train", [True, False])
def test_functional_grads_equal_module_backward_grads(train):
    model = ConvBN().train(train)
    params, buffers = split_module(model)
    x, y = batch()
    grad_fn = scaled_grad_and_value(make_loss_fn(make_apply(model)), has_aux=True)
    grads, (loss, new_buffers) = grad_fn(NoOpLossScale(), params, buffers, x, y)
    ref_loss, ref = reference_grads(model, x, y)
    assert list(grads) == list(ref)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    if train:
        assert_trees_equal(new_buffers, dict(model.named_buffers()))


def test_grads_are_of_the_scaled_loss_and_the_loss_is_unscaled():
    model = ConvBN()
    params, buffers = split_module(model)
    x, y = batch()
    grad_fn = scaled_grad_and_value(make_loss_fn(make_apply(model)), has_aux=True)
    plain, (loss1, _) = grad_fn(NoOpLossScale(), params, buffers, x, y)
    scaled, (loss2, _) = grad_fn(StaticLossScale(2.0**10), params, buffers, x, y)
    torch.testing.assert_close(loss2, loss1, rtol=0, atol=0)
    for name in plain:
        # Scaling by a power of two commutes with every rounding step.
        torch.testing.assert_close(scaled[name], plain[name] * 2.0**10, rtol=0, atol=0)


def test_tied_weights_get_the_sum_of_both_uses():
    model = Tied()
    params, buffers = split_module(model)
    assert "out.weight" not in params and "embed.weight" in params
    tokens = torch.tensor([[1, 4, 2], [7, 7, 0]])
    targets = torch.tensor([[4, 2, 9], [7, 0, 1]])
    apply = make_apply(model)

    def loss_fn(p, tokens, targets):
        logits, _ = apply(p, buffers, tokens)
        return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    grads, loss = scaled_grad_and_value(loss_fn)(NoOpLossScale(), params, tokens, targets)
    model.zero_grad()
    ref = F.cross_entropy(model(tokens).reshape(-1, 11), targets.reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grads["embed.weight"], model.embed.weight.grad, rtol=1e-6, atol=1e-7)
    # Both uses see the value passed in: zeroing it zeroes the output projection too.
    zeroed = {**params, "embed.weight": torch.zeros(11, 6)}
    logits, _ = apply(zeroed, buffers, tokens)
    assert torch.equal(logits, torch.zeros_like(logits))


def test_fp16_params_get_fp16_grads_that_loss_scaling_keeps_from_underflowing():
    # d/dw of 1e-8 * sum(w) is 1e-8, below FP16's smallest subnormal (6e-8).
    params = {"w": torch.ones(4, dtype=torch.float16)}

    def loss_fn(p):
        return (p["w"].float() * 1e-8).sum()

    grad_fn = scaled_grad_and_value(loss_fn)
    unscaled, _ = grad_fn(NoOpLossScale(), params)
    assert unscaled["w"].dtype == torch.float16
    assert torch.equal(unscaled["w"], torch.zeros(4, dtype=torch.float16))
    scale = DynamicLossScale(init_scale=2.0**16)
    scaled, loss = grad_fn(scale, params)
    assert scaled["w"].dtype == torch.float16
    torch.testing.assert_close(
        scale.unscale(scaled)["w"], torch.full((4,), 1e-8), rtol=1e-3, atol=0
    )
    torch.testing.assert_close(loss, torch.tensor(4e-8), rtol=1e-6, atol=0)


def test_output_feeds_fp16_update():
    model = ConvBN()
    params, buffers = split_module(model)
    x, y = batch()
    apply = make_apply(model, train=True)

    def loss_fn(p, buffers, x, y):
        logits, new_buffers = apply({k: v.float() for k, v in p.items()}, buffers, x)
        return F.cross_entropy(logits, y), new_buffers

    state = fp16_init(params, sgd(0.1, momentum=0.9))
    grad_fn = scaled_grad_and_value(loss_fn, has_aux=True)
    grads, (loss, new_buffers) = grad_fn(state.loss_scale, state.params, buffers, x, y)
    new_state = fp16_update(state, grads, loss=loss)
    assert bool(new_state.grads_finite)
    assert not torch.equal(new_state.master["fc.weight"], state.master["fc.weight"])
    # The FP32 master moved by -lr * grad (first momentum step is the gradient itself).
    _, ref = reference_grads(model.train(), x, y)
    torch.testing.assert_close(
        new_state.master["fc.bias"],
        state.master["fc.bias"] - 0.1 * ref["fc.bias"],
        rtol=2e-3,
        atol=2e-4,
    )


def test_grad_fn_reports_bad_loss_functions():
    params = {"w": torch.ones(3)}
    with pytest.raises(TypeError, match="0-d floating-point tensor"):
        scaled_grad_and_value(lambda p: p["w"] * 2)(NoOpLossScale(), params)
    with pytest.raises(TypeError, match="did you mean has_aux=True"):
        scaled_grad_and_value(lambda p: (p["w"].sum(), 1))(NoOpLossScale(), params)
    with pytest.raises(TypeError, match=r"must return a \(loss, aux\) pair"):
        scaled_grad_and_value(lambda p: p["w"].sum(), has_aux=True)(NoOpLossScale(), params)
    with pytest.raises(TypeError, match="must be a loss scale"):
        scaled_grad_and_value(lambda p: p["w"].sum())(params, params)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        scaled_grad_and_value(3)


def test_the_whole_step_traces_as_one_graph():
    # fullgraph=True fails loudly on any graph break; the eager backend keeps
    # this a test of tracing (no code generation).
    model = ConvBN()
    params, buffers = split_module(model)
    x, y = batch()
    apply = make_apply(model, train=True)
    grad_fn = scaled_grad_and_value(make_loss_fn(apply), has_aux=True)

    def step(state, buffers, x, y, impl="auto"):
        grads, (loss, new_buffers) = grad_fn(state.loss_scale, state.params, buffers, x, y)
        return fp16_update(state, grads, loss=loss, impl=impl), new_buffers, loss

    state = fp16_init(params, sgd(0.1, momentum=0.9), param_dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    s1, b1, l1 = compiled(state, buffers, x, y)
    # Traced, the default update calls the same fused op as in eager mode: bitwise equal.
    s2, b2, l2 = step(state, buffers, x, y)
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    assert_trees_equal(b1, b2)
    assert_trees_equal(s1.master, s2.master)


def test_result_has_the_shape_of_torch_func_grad_and_value():
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    x = torch.randn(5, 4)

    def loss_fn(p, x):
        return (x @ p["w"] + p["b"]).square().mean()

    def loss_aux_fn(p, x):
        out = x @ p["w"] + p["b"]
        return out.square().mean(), {"out": out}

    for fn, has_aux in ((loss_fn, False), (loss_aux_fn, True)):
        ours = scaled_grad_and_value(fn, has_aux=has_aux)(NoOpLossScale(), params, x)
        torch_ = torch.func.grad_and_value(fn, has_aux=has_aux)(params, x)
        assert torch_pytree.tree_structure(ours) == torch_pytree.tree_structure(torch_)
        for a, b in zip(torch_pytree.tree_leaves(ours), torch_pytree.tree_leaves(torch_)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    grads, loss = scaled_grad_and_value(loss_fn)(NoOpLossScale(), params, x)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and not loss.requires_grad


@pytest.mark.parametrize("has_aux", [False, True])
def test_vmap_over_members_needs_no_out_dims(has_aux):
    k = 3
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(k, 4, 3, generator=g), "b": torch.randn(k, 3, generator=g)}
    x, y = torch.randn(k, 8, 4, generator=g), torch.randint(0, 3, (k, 8), generator=g)

    def loss_fn(p, x, y):
        logits = x @ p["w"] + p["b"]
        loss = F.cross_entropy(logits, y)
        return (loss, logits) if has_aux else loss

    grad_fn = scaled_grad_and_value(loss_fn, has_aux=has_aux)
    scale = StaticLossScale(2.0**4)
    batched = torch.func.vmap(grad_fn, in_dims=(None, 0, 0, 0))(scale, params, x, y)
    for i in range(k):
        member = grad_fn(scale, {n: v[i] for n, v in params.items()}, x[i], y[i])
        got = torch_pytree.tree_map(lambda t, i=i: t[i], batched)
        assert torch_pytree.tree_structure(got) == torch_pytree.tree_structure(member)
        for a, b in zip(torch_pytree.tree_leaves(got), torch_pytree.tree_leaves(member)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- policies in make_apply ----------------------------------------------------------


class NoNorms(nn.Module):
    """Conv, pooling and linear layers with a float buffer: nothing a norm policy covers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 3 * 3, 5)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 5))

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(torch.flatten(h, 1)) + self.offset.to(h.dtype)


class Norms(nn.Module):
    """One of each kind of norm between linear layers, with a keyword input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 6 * 6, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 5)

    def forward(self, x, *, shift=None):
        h = self.gn(F.relu(self.bn(self.conv(x))))
        h = self.ln(self.fc(torch.flatten(h, 1)))
        return self.head(h if shift is None else h + shift)


def record_dtypes(model, types):
    """Forward hooks (copied into make_apply's template) logging what each module sees."""
    seen = {}

    def make_hook(name):
        def hook(module, args, output):
            weight = getattr(module, "weight", None)
            dtypes = (args[0].dtype, output.dtype, None if weight is None else weight.dtype)
            seen.setdefault(name, []).append(dtypes)

        return hook

    for name, module in model.named_modules():
        if isinstance(module, types):
            module.register_forward_hook(make_hook(name))
    return seen


@pytest.mark.parametrize("spec", ["p=f16,c=bf16,o=f32", "p=f16,c=f16,o=f32", "p=f32,c=bf16"])
def test_a_model_without_norms_is_bitwise_the_manual_casts(spec):
    policy = get_policy(spec)
    model = NoNorms()
    params, buffers = split_module(model)
    params = policy.cast_to_param(params)
    x, y = batch()
    manual_apply, policy_apply = make_apply(model), make_apply(model, policy=policy)

    def manual(p, x, y):
        logits, _ = manual_apply(policy.cast_to_compute(p), buffers, policy.cast_to_compute(x))
        logits = policy.cast_to_output(logits)
        return F.cross_entropy(logits.float(), y), logits

    def with_policy(p, x, y):
        logits, _ = policy_apply(p, buffers, x)
        return F.cross_entropy(logits.float(), y), logits

    scale = DynamicLossScale(init_scale=2.0**10)
    g1, (l1, out1) = scaled_grad_and_value(manual, has_aux=True)(scale, params, x, y)
    g2, (l2, out2) = scaled_grad_and_value(with_policy, has_aux=True)(scale, params, x, y)
    assert out2.dtype == policy.output_dtype
    torch.testing.assert_close(out2, out1, rtol=0, atol=0)
    torch.testing.assert_close(l2, l1, rtol=0, atol=0)
    assert_trees_equal(g2, g1)
    assert all(g.dtype == policy.param_dtype for g in g2.values())


@pytest.mark.parametrize("compute", [BF16, F16])
def test_norm_layers_compute_in_float32_under_a_reduced_precision_policy(compute):
    policy = Policy(F16, compute, F32)
    model = Norms().train()
    seen = record_dtypes(model, (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm))
    params, buffers = split_module(model)
    params = policy.cast_to_param(params)
    apply = make_apply(model, policy=policy)
    x, _ = batch()

    def loss_fn(p):
        logits, new_buffers = apply(p, buffers, x, shift=torch.ones(6))
        return logits.float().square().mean(), (logits, new_buffers)

    grads, (loss, (logits, new_buffers)) = scaled_grad_and_value(loss_fn, has_aux=True)(
        NoOpLossScale(), params
    )
    # Norms: inputs, weights and outputs float32 inside (as their own hooks see them).
    for name in ("bn", "gn", "ln"):
        assert seen[name] == [(F32, F32, F32)], name
    # Everything else in the compute dtype, norm outputs handed back in it.
    for name in ("conv", "fc", "head"):
        assert seen[name] == [(compute, compute, compute)], name
    assert logits.dtype == F32 and torch.isfinite(loss)
    # FP16 parameters get FP16 gradients, norm weights included.
    assert {g.dtype for g in grads.values()} == {F16}
    assert float(grads["bn.weight"].abs().sum()) > 0
    # Running statistics stay float32 and were updated from the float32 input.
    assert new_buffers["bn.running_mean"].dtype == F32
    assert not torch.equal(new_buffers["bn.running_mean"], buffers["bn.running_mean"])
    assert int(new_buffers["bn.num_batches_tracked"]) == 1
    # The running mean is that of the norm's input: the conv output, widened to float32.
    conv = F.conv2d(
        x.to(compute), params["conv.weight"].to(compute), params["conv.bias"].to(compute)
    )
    expected_mean = 0.1 * conv.float().mean(dim=(0, 2, 3))
    torch.testing.assert_close(new_buffers["bn.running_mean"], expected_mean, rtol=1e-5, atol=1e-6)


def test_module_policies_are_declared_per_type_and_cover_what_is_inside():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(6, 6)

        def forward(self, x):
            return torch.tanh(self.inner(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 6)
            self.block = Block()
            self.ln = nn.LayerNorm(6)

        def forward(self, x):
            return self.ln(self.block(self.stem(x)))

    policy = get_policy("p=f16,c=bf16,o=f32")
    model = Net()
    seen = record_dtypes(model, (nn.Linear, nn.LayerNorm))
    params = policy.cast_to_param(split_module(model)[0])
    x = torch.randn(3, 4)
    # The block in FP32 (its Linear has no policy of its own), LayerNorm left to the policy.
    block_policy = Policy(F16, F32, BF16)
    out, _ = make_apply(model, policy=policy, module_policies={Block: block_policy})(params, {}, x)
    assert seen == {
        "stem": [(BF16, BF16, BF16)],
        "block.inner": [(F32, F32, F32)],
        "ln": [(BF16, BF16, BF16)],
    }
    assert out.dtype == F32
    # {} switches the defaults off: the LayerNorm computes in BF16.
    seen.clear()
    make_apply(model, policy=policy, module_policies={})(params, {}, x)
    assert seen["ln"] == [(BF16, BF16, BF16)]
    # The defaults: the LayerNorm in FP32, handing back BF16.
    seen.clear()
    make_apply(model, policy=policy)(params, {}, x)
    assert seen["ln"] == [(F32, F32, F32)] and seen["block.inner"] == [(BF16, BF16, BF16)]
    # module_policies alone: only the listed modules cast; the rest runs as given.
    seen.clear()
    norms_only = {nn.LayerNorm: norm_policy(policy)}
    out, _ = make_apply(model, module_policies=norms_only)(split_module(model)[0], {}, x)
    assert seen["ln"] == [(F32, F32, F32)] and seen["stem"] == [(F32, F32, F32)]
    assert out.dtype == BF16  # the LayerNorm's output dtype


def test_make_apply_rejects_bad_policies():
    model = Norms()
    with pytest.raises(TypeError, match="policy must be a Policy, a policy string or None"):
        make_apply(model, policy=torch.float16)
    with pytest.raises(ValueError, match="unknown dtype name 'f8'"):
        make_apply(model, policy="p=f8")
    with pytest.raises(TypeError, match="module_policies must be a mapping"):
        make_apply(model, policy="p=f16,c=bf16", module_policies=[nn.LayerNorm])
    with pytest.raises(TypeError, match="key 'LayerNorm' is not an nn.Module subclass"):
        make_apply(model, module_policies={"LayerNorm": get_policy("f32")})
    with pytest.raises(TypeError, match=r"module_policies\[LayerNorm\] must be a Policy"):
        make_apply(model, module_policies={nn.LayerNorm: "f32"})
    # A policy string is parsed.
    out, _ = make_apply(model, policy="p=f32,c=bf16,o=f16")(*split_module(model), batch()[0])
    assert out.dtype == F16


def test_gradients_with_a_policy_trace_as_one_graph():
    # The casts and the norm layers' hooks trace without a graph break.
    model = ConvBN()
    params, buffers = split_module(model)
    params = cast_to(params, F16)
    x, y = batch()
    apply = make_apply(model, train=True, policy=get_policy("p=f16,c=bf16,o=f32"))
    grad_fn = scaled_grad_and_value(make_loss_fn(apply), has_aux=True)
    scale = DynamicLossScale(init_scale=2.0**10)
    torch._dynamo.reset()
    compiled = torch.compile(grad_fn, fullgraph=True, backend="eager")
    g1, (l1, b1) = compiled(scale, params, buffers, x, y)
    g2, (l2, b2) = grad_fn(scale, params, buffers, x, y)
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    assert_trees_equal(b1, b2)
    assert_trees_equal(g1, g2)


# -- module_state_dict: the way back ----------------------------------------------------


class TiedBuffers(nn.Module):
    """A buffer registered in two submodules, and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        shared = torch.zeros(3)
        self.a.register_buffer("shift", shared)
        self.b.register_buffer("shift", shared)
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, x):
        return self.b(self.a(x) + self.a.shift) + self.b.shift * self.scratch


def test_tied_weights_survive_the_round_trip_back_to_the_module():
    model = Tied()
    params, buffers = split_module(model)
    tokens = torch.tensor([[1, 4, 2], [7, 7, 0]])
    targets = torch.tensor([[4, 2, 9], [7, 0, 1]])
    apply = make_apply(model)

    def loss_fn(p):
        logits, _ = apply({k: v.float() for k, v in p.items()}, buffers, tokens)
        return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    state = fp16_init(params, sgd(0.5))
    grads, loss = scaled_grad_and_value(loss_fn)(state.loss_scale, state.params)
    state = fp16_update(state, grads, loss=loss)
    # The old recipe fails: state_dict() names both uses of the tied weight.
    with pytest.raises(RuntimeError, match="out.weight"):
        model.load_state_dict({**state.master, **buffers})

    full = module_state_dict(model, state.master, buffers)
    assert list(full) == list(model.state_dict())
    assert full["out.weight"] is full["embed.weight"] is state.master["embed.weight"]
    model.load_state_dict(full)
    assert model.out.weight is model.embed.weight  # still tied, now trained
    assert torch.equal(model.embed.weight, state.master["embed.weight"])
    expected, _ = apply(state.master, buffers, tokens)
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
    # The FP16 working copy loads too (load_state_dict casts).
    model.load_state_dict(module_state_dict(model, state.params, buffers))
    assert torch.equal(model.embed.weight, state.params["embed.weight"].float())
    assert model.out.weight is model.embed.weight


def test_module_state_dict_restores_tied_buffers_and_skips_non_persistent_ones():
    model = TiedBuffers()
    params, buffers = split_module(model)
    assert sorted(buffers) == ["a.shift", "scratch"]  # tied once, non-persistent included
    buffers = {"a.shift": torch.full((3,), 2.0), "scratch": torch.zeros(3)}
    full = module_state_dict(model, params, buffers)
    assert list(full) == list(model.state_dict())  # a.shift and b.shift, no scratch
    assert full["b.shift"] is buffers["a.shift"]
    model.load_state_dict(full)
    assert model.a.shift is model.b.shift and torch.equal(model.b.shift, torch.full((3,), 2.0))
    assert torch.equal(model.scratch, torch.ones(3))  # not in a state dict, left alone
    # Without buffers the module's own are used.
    own = module_state_dict(model, params)
    assert torch.equal(own["b.shift"], model.b.shift) and not own["b.shift"].requires_grad


def test_module_state_dict_names_mismatched_entries():
    model = ConvBN()
    params, buffers = split_module(model)
    with pytest.raises(KeyError, match=r"missing \['fc.bias'\]"):
        module_state_dict(model, {k: v for k, v in params.items() if k != "fc.bias"}, buffers)
    with pytest.raises(KeyError, match=r"unexpected \['extra'\]"):
        module_state_dict(model, params, {**buffers, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"params\['fc.weight'\]: shape \(5, 100\)"):
        module_state_dict(model, {**params, "fc.weight": torch.zeros(5, 100)}, buffers)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        module_state_dict(params, params, buffers)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_functional_grads_match_module_and_fp16_compute_gives_fp16_grads():
    model = ConvBN().cuda().train()
    params, buffers = split_module(model)
    x, y = (t.cuda() for t in batch())
    apply = make_apply(model)
    grad_fn = scaled_grad_and_value(make_loss_fn(apply), has_aux=True)
    grads, (loss, _) = grad_fn(NoOpLossScale().to("cuda"), params, buffers, x, y)
    _, ref = reference_grads(model, x, y)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-5)

    # All-FP16 BatchNorm (weights and running statistics alike) takes the native kernel.
    half, half_buffers = cast_to(params, torch.float16), cast_to(buffers, torch.float16)
    grads16, (loss16, _) = grad_fn(DynamicLossScale().to("cuda"), half, half_buffers, x.half(), y)
    assert all(g.dtype == torch.float16 and g.is_cuda for g in grads16.values())
    torch.testing.assert_close(loss16.float(), loss, rtol=1e-2, atol=1e-2)
