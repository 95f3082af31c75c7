"""Tests for the torch.func bridge: split_module, make_apply, scaled_grad_and_value."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from functional_fp16 import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    cast_to,
    fp16_init,
    fp16_update,
    make_apply,
    scaled_grad_and_value,
    sgd,
    split_module,
)


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

    grads, (loss, aux) = scaled_grad_and_value(loss_fn)(NoOpLossScale(), params, tokens, targets)
    assert aux is None
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
    scaled, (loss, _) = grad_fn(scale, params)
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
    # Traced, every implementation runs the multi-tensor code: bitwise its eager result.
    s2, b2, l2 = step(state, buffers, x, y, impl="foreach")
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    assert_trees_equal(b1, b2)
    assert_trees_equal(s1.master, s2.master)


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
