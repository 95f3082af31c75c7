"""Train an ensemble of K CIFAR-10 CNNs in one vmapped FP16 step.

The main job's network (``cifar10_functional.Net``, SGD lr 0.001 momentum 0.9,
batch 128, FP16 parameters with FP32 masters) trained K times at once: the
members' states are stacked with ``ff.tree_stack`` into one ``FP16State``
whose leaves have a leading member dimension, and one step is

    stacked, metrics = torch.func.vmap(train_step, in_dims=(0, None, None))(stacked, images, labels)

where ``train_step`` is the unbatched pure step (``torch.func.grad`` of the
loss-scaled loss, then ``ff.fp16_update``). Every member keeps its own
``DynamicLossScale``, skip decision and counters: ``fp16_update`` under
``vmap`` runs each member's update on its own, bitwise as an unbatched call.

    python examples/ensemble_vmap.py --data-dir DIR                 # K=8 seeds, 2 epochs
    python examples/ensemble_vmap.py --data-dir DIR --lrs 0.0005,0.001,0.002,0.004
    python examples/ensemble_vmap.py --dataset fake --members 3 --steps-per-epoch 5 --bench-steps 3

**Members.** By default member k is the network initialised from seed
``--seed + k``. ``--lrs`` makes a learning-rate sweep instead: one member per
learning rate, all from the initialisation of ``--seed``. ``tree_stack`` needs
one optimiser shared by all members (static configuration must match), so a
sweep cannot give each member its own ``ff.sgd(lr)``; the learning rate
becomes optimiser *state* instead: :func:`sgd_with_lr_in_state` is
``chain(add_decayed_weights(0), trace(momentum), scale by -lr)`` with ``lr``
a 0-d tensor in the state, set per member before stacking. It is the same
arithmetic as ``ff.sgd(lr, momentum)`` (bitwise the reference update), but it
runs the library's multi-tensor update rather than the fused SGD kernel.

**Data.** ``--data-order shared`` (the default): every member sees the same
batch each step, so ``vmap`` gets ``in_dims=(0, None, None)``; the members
differ by initialisation (or learning rate) alone. ``--data-order
per-member``: each member draws its own shuffle (seed ``--seed + k``), and
images and labels are stacked too (``in_dims=0``). Either way the throughput
comparison gives the sequential runs exactly the batches the vmapped step
gets, so both do the same arithmetic per member.

**Throughput.** Before training, ``--bench-steps`` steps are timed both ways
from the initial states, in alternating rounds (one vmapped step over all
members; then one unbatched step of each member in turn, the main example's
step), so that both see the same machine load; the images/s are medians over
the rounds after ``--bench-warmup``. The two runs are then compared member by
member: skip decisions and loss scales must agree exactly; the masters agree
closely but not bitwise (a batched convolution accumulates in another order).

**Batching rules for the convolutions and the pooling.** Left to
``vmap``'s own rules, the step is about 3x slower than the members one after
another on a CPU: the rule for max-pooling moves the member dimension into
the batch dimension, which copies the activations into NCHW memory, where
BF16 max-pooling takes a scalar path. Here the convolutions and the pooling
declare their own rules (autograd Functions with a ``vmap`` staticmethod):
the members are folded into the channel dimension, which channels-last
memory holds innermost, so the fold is a view. A convolution becomes one
convolution with K times the output channels (the first layer, whose input
is shared) or a grouped convolution with K groups, bias included; pooling
runs on the folded channels-last tensor. Unbatched, both are the ATen
operators ``nn.Conv2d`` and ``nn.MaxPool2d`` run. What this buys on a small
CPU, and where the time goes, is in docs/ensembles.md and BENCHMARKS.md.

Outputs in ``--out-dir`` (default ``runs/ensemble``): ``summary.json`` and
``ensemble_final.pt`` (the stacked ``FP16State``, an ``ff.save_checkpoint``
file; ``ff.tree_unstack`` gives the members).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import optree
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The main example and its siblings, importable from any working directory.
import cifar10_data  # noqa: E402
import cifar10_functional as main_job  # noqa: E402
from cifar10_loop import epoch_order  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16.precision.policy import Policy  # noqa: E402

aten = torch.ops.aten


# -- batching rules that keep the members in the channel dimension -----------------


def _fold(x: torch.Tensor, dim: int | None, members: int) -> torch.Tensor:
    """A physical batched tensor (member dim ``dim``; ``None``: shared) as ``(N, K*C, H, W)``.

    For the channels-last activations of this network the member dimension
    sits next to the channels, so this is a view; otherwise ``reshape`` copies
    (into channels-last memory on the CPU, as the main example lays out its batches).
    """
    if dim is None:
        x = x.unsqueeze(1).expand(x.shape[0], members, *x.shape[1:])
    else:
        x = x.movedim(dim, 1)
    n, k, c, h, w = x.shape
    x = x.reshape(n, k * c, h, w)
    if x.device.type == "cpu":  # where reshape had to copy (per-member images): channels-last
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def _unfold(y: torch.Tensor, members: int) -> torch.Tensor:
    """``(N, K*C, H, W)`` back to the physical batched layout ``(N, K, C, H, W)`` (member dim 1)."""
    n, kc, h, w = y.shape
    return y.view(n, members, kc // members, h, w)


def _by_member(x: torch.Tensor, dim: int | None, members: int) -> torch.Tensor:
    """A physical batched tensor with the member dimension first (a shared one expanded)."""
    if dim is None:
        return x.unsqueeze(0).expand(members, *x.shape)
    return x.movedim(dim, 0)


def _conv(x, w, b, groups):
    return aten.convolution(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], groups)


class _ConvBackward(torch.autograd.Function):
    """``convolution_backward`` of :class:`_Conv` (input, weight and bias gradients)."""

    @staticmethod
    def forward(grad_out, x, w, input_grad):
        mask = [input_grad, True, True]
        bias = [w.shape[0]]
        return aten.convolution_backward(
            grad_out, x, w, bias, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, mask
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("second derivatives of the ensemble convolution")

    @staticmethod
    def vmap(info, in_dims, grad_out, x, w, input_grad):
        k = info.batch_size
        g_dim, x_dim, w_dim, _ = in_dims
        wk = _by_member(w, w_dim, k)
        wf = wk.reshape(k * wk.shape[1], *wk.shape[2:])
        gf = _fold(grad_out, g_dim, k)
        if x_dim is None:  # a shared input (the images): one convolution, K*O channels
            if input_grad:  # would be K gradients of one tensor; the images never need one
                raise NotImplementedError("the gradient of a shared convolution input")
            xf, groups = x, 1
        else:
            xf, groups = _fold(x, x_dim, k), k
        mask = [input_grad, True, True]
        gx, gw, gb = aten.convolution_backward(
            gf, xf, wf, [wf.shape[0]], [1, 1], [0, 0], [1, 1], False, [0, 0], groups, mask
        )
        gw, gb = gw.view(wk.shape), gb.view(k, -1)
        if gx is None:
            return (None, gw, gb), (None, 0, 0)
        return (_unfold(gx, k), gw, gb), (1, 0, 0)


class _Conv(torch.autograd.Function):
    """A stride-1, unpadded 2-d convolution whose ``vmap`` folds the members into channels."""

    @staticmethod
    def forward(x, w, b):
        return _conv(x, w, b, 1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, _ = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        return _ConvBackward.apply(grad_out, x, w, ctx.needs_input_grad[0])

    @staticmethod
    def vmap(info, in_dims, x, w, b):
        k = info.batch_size
        x_dim, w_dim, b_dim = in_dims
        wk = _by_member(w, w_dim, k)
        wf = wk.reshape(k * wk.shape[1], *wk.shape[2:])
        bf = _by_member(b, b_dim, k).reshape(-1)
        if x_dim is None:  # shared images: one convolution with K*O output channels
            return _unfold(_conv(x, wf, bf, 1), k), 1
        return _unfold(_conv(_fold(x, x_dim, k), wf, bf, k), k), 1


class _MaxPoolBackward(torch.autograd.Function):
    """``max_pool2d_with_indices_backward`` of :class:`_MaxPool`."""

    @staticmethod
    def forward(grad_out, x, indices, size):
        return aten.max_pool2d_with_indices_backward(
            grad_out, x, [size, size], [size, size], [0, 0], [1, 1], False, indices
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("second derivatives of the ensemble max-pooling")

    @staticmethod
    def vmap(info, in_dims, grad_out, x, indices, size):
        k = info.batch_size
        g, xf, i = (_fold(t, d, k) for t, d in zip((grad_out, x, indices), in_dims))
        out = aten.max_pool2d_with_indices_backward(
            g, xf, [size, size], [size, size], [0, 0], [1, 1], False, i
        )
        return _unfold(out, k), 1


class _MaxPool(torch.autograd.Function):
    """Non-overlapping ``size`` x ``size`` max-pooling whose ``vmap`` folds the members into channels."""

    @staticmethod
    def forward(x, size):
        return aten.max_pool2d_with_indices(x, [size, size], [size, size])

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, size = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, output[1])
        ctx.size = size

    @staticmethod
    def backward(ctx, grad_out, _grad_indices):
        x, indices = ctx.saved_tensors
        return _MaxPoolBackward.apply(grad_out, x, indices, ctx.size), None

    @staticmethod
    def vmap(info, in_dims, x, size):
        k = info.batch_size
        out, indices = aten.max_pool2d_with_indices(
            _fold(x, in_dims[0], k), [size, size], [size, size]
        )
        return (_unfold(out, k), _unfold(indices, k)), (1, 1)


class EnsembleConv2d(nn.Conv2d):
    """``nn.Conv2d`` (stride 1, no padding) with the member-folding batching rule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Conv.apply(x, self.weight, self.bias)


class EnsembleMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d(size, size)`` with the member-folding batching rule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MaxPool.apply(x, self.kernel_size)[0]


def ensemble_net(num_classes: int) -> main_job.Net:
    """The main job's ``Net`` with its convolutions and pooling given member-folding ``vmap`` rules.

    The same parameters (names and shapes) and, unbatched, the same ATen
    operators; only what ``vmap`` does with them differs.
    """
    net = main_job.Net(num_classes)
    for name in ("conv1", "conv2"):
        old = getattr(net, name)
        if (
            old.stride != (1, 1)
            or old.padding != (0, 0)
            or old.dilation != (1, 1)
            or old.groups != 1
        ):
            raise ValueError(f"{name}: EnsembleConv2d covers stride-1 unpadded convolutions only")
        setattr(net, name, EnsembleConv2d(old.in_channels, old.out_channels, old.kernel_size))
    net.pool = EnsembleMaxPool2d(net.pool.kernel_size, net.pool.stride)
    return net.requires_grad_(False)


# -- the optimiser of a learning-rate sweep: the learning rate as state -------------------


class LearningRateState(NamedTuple):
    """The state of :func:`scale_by_learning_rate_in_state`: this member's learning rate."""

    learning_rate: torch.Tensor  # 0-d float32


def scale_by_learning_rate_in_state() -> ff.GradientTransformation:
    """Multiplies updates by ``-state.learning_rate``; the learning rate is a state leaf.

    ``init`` sets it to 0; :func:`with_learning_rate` sets a member's value.
    As a leaf it is stacked by ``ff.tree_stack``, so each member of a vmapped
    ensemble has its own, while the transform (static configuration) is shared.
    """

    def init(params):
        leaves = optree.tree_leaves(params)
        device = leaves[0].device if leaves else None
        return LearningRateState(torch.zeros((), dtype=torch.float32, device=device))

    def update(updates, state, params=None):
        del params
        lr = -state.learning_rate
        return optree.tree_map(lambda u: u * lr.to(u.dtype), updates), state

    return ff.GradientTransformation(init, update)


def sgd_with_lr_in_state(momentum: float) -> ff.GradientTransformation:
    """``ff.sgd(lr, momentum)`` with ``lr`` in the optimiser state (set by :func:`with_learning_rate`)."""
    return ff.chain(
        ff.add_decayed_weights(0.0), ff.trace(momentum), scale_by_learning_rate_in_state()
    )


def with_learning_rate(state: ff.FP16State, lr: float) -> ff.FP16State:
    """``state`` (of :func:`sgd_with_lr_in_state`) with its learning rate set to ``lr``."""
    decay, trace, _ = state.opt_state
    value = torch.tensor(lr, dtype=torch.float32, device=state.step.device)
    return state.replace(opt_state=(decay, trace, LearningRateState(value)))


# -- members, steps --------------------------------------------------------------------


class Member(NamedTuple):
    """How one member is set up."""

    seed: int  # the initialisation
    lr: float


class StepMetrics(NamedTuple):
    """What one step reports (0-d tensors; batched to ``(K,)`` by ``vmap``)."""

    loss: torch.Tensor  # float32, unscaled
    loss_scale: torch.Tensor  # the scale this step's gradients were computed with
    skipped: torch.Tensor  # bool


def member_specs(args: argparse.Namespace) -> list[Member]:
    if args.lrs:
        return [Member(args.seed, lr) for lr in args.lrs]
    return [Member(args.seed + k, args.lr) for k in range(args.members)]


def build_members(
    members: Sequence[Member],
    num_classes: int,
    args: argparse.Namespace,
    device: torch.device,
    init_scales: Sequence[float] | None = None,
) -> list[ff.FP16State]:
    """One ``FP16State`` per member: FP16 params, FP32 master, momentum, its own loss scale.

    All members share one ``tx`` (``tree_stack`` requires it): ``ff.sgd`` for
    a seed ensemble, :func:`sgd_with_lr_in_state` for a learning-rate sweep.
    """
    sweep = len({m.lr for m in members}) > 1 or bool(getattr(args, "lrs", None))
    tx = sgd_with_lr_in_state(args.momentum) if sweep else ff.sgd(members[0].lr, args.momentum)
    states = []
    for k, m in enumerate(members):
        model = main_job.build_model(num_classes, m.seed)
        params = {name: p.detach().to(device) for name, p in model.named_parameters()}
        scale = args.init_scale if init_scales is None else init_scales[k]
        loss_scale = ff.DynamicLossScale(init_scale=scale, growth_interval=args.growth_interval)
        state = ff.fp16_init(params, tx, loss_scale, param_dtype=torch.float16)
        states.append(with_learning_rate(state, m.lr) if sweep else state)
    return states


def make_train_step(model: nn.Module, policy: Policy) -> Callable[..., Any]:
    """``train_step(state, images, labels) -> (state, StepMetrics)``: one member, pure.

    The main example's step (forward in the policy's compute dtype, FP32
    cross-entropy, ``grad`` of the scaled loss, ``fp16_update``), written with
    ``torch.func`` directly. Unbatched with ``main_job.Net`` it is the
    sequential baseline; vmapped with :func:`ensemble_net` the ensemble step.
    """

    def train_step(state: ff.FP16State, images: torch.Tensor, labels: torch.Tensor):
        def scaled_loss(params):
            x = main_job.preprocess(images, policy.compute_dtype)
            logits = functional_call(model, policy.cast_to_compute(params), (x,))
            loss = F.cross_entropy(policy.cast_to_output(logits).float(), labels)
            return state.loss_scale.scale(loss), loss

        grads, loss = grad(scaled_loss, has_aux=True)(state.params)
        new_state = ff.fp16_update(state, grads, loss=loss)
        return new_state, StepMetrics(loss, state.loss_scale.loss_scale, ~new_state.grads_finite)

    return train_step


def make_ensemble_step(model: nn.Module, policy: Policy, per_member_data: bool):
    """The vmapped step: ``(stacked_state, images, labels) -> (stacked_state, StepMetrics)``."""
    data_dim = 0 if per_member_data else None
    return vmap(make_train_step(model, policy), in_dims=(0, data_dim, data_dim))


def make_ensemble_logits(model: nn.Module, policy: Policy):
    """``logits(stacked_params, images) -> (K, N, classes)`` float32: every member, one batch."""

    def logits(params, images):
        x = main_job.preprocess(images, policy.compute_dtype)
        return functional_call(model, policy.cast_to_compute(params), (x,)).float()

    return vmap(logits, in_dims=(0, None))


@torch.no_grad()
def evaluate(logits_fn, params, split: cifar10_data.Split, batch_size: int):
    """Test accuracy (percent) of each member and of the ensemble (mean of member probabilities)."""
    correct = None
    ensemble = torch.zeros((), dtype=torch.int64)
    n = split.labels.shape[0]
    for start in range(0, n, batch_size):
        images, labels = (
            split.images[start : start + batch_size],
            split.labels[start : start + batch_size],
        )
        logits = logits_fn(params, images)  # (K, B, classes)
        hits = (logits.argmax(-1) == labels).sum(1)
        correct = hits if correct is None else correct + hits
        mean_prob = logits.softmax(-1).mean(0)
        ensemble = ensemble + (mean_prob.argmax(-1) == labels).sum().cpu()
    members = (100.0 * correct.double() / n).tolist()
    return members, 100.0 * ensemble.item() / n


# -- data order ----------------------------------------------------------------------


class Batches:
    """Each step's indices: one shuffle from ``seed``, or member k's own from ``seed + k``."""

    def __init__(self, members: int, per_member: bool, seed: int) -> None:
        self.per_member = per_member
        seeds = [seed + k for k in range(members)] if per_member else [seed]
        self.rngs = [torch.Generator().manual_seed(s) for s in seeds]

    def epoch(self, n: int, batch_size: int, max_steps: int) -> torch.Tensor:
        """``(steps, B)`` shared or ``(steps, K, B)`` per-member indices of one epoch."""
        orders = [epoch_order(g, n, batch_size, max_steps).view(-1, batch_size) for g in self.rngs]
        return torch.stack(orders, 1) if self.per_member else orders[0]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), with the core and thread counts in use."""
    name = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the throughput comparison ---------------------------------------------------------


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def compare_throughput(
    seq_step, ens_step, states, order, train: cifar10_data.Split, device, warmup: int
) -> dict:
    """Times one vmapped step against K unbatched steps, round by round, over ``order``'s batches.

    Both ways start from ``states`` and get the same batches; which goes
    first alternates between rounds, so both see the same machine load. The
    first ``warmup`` rounds are not timed. Returns images/s (medians over the
    timed rounds), their ratio, and how the two runs agree at the end: skip
    decisions and loss scales (exactly, or not) and the masters (the largest
    difference, absolute and relative to the largest weight).
    """
    k = len(states)
    stacked, alone = ff.tree_stack(states), list(states)
    skips_v, skips_a, times_v, times_a = [], [], [], []

    for r in range(order.shape[0]):
        idx = order[r].to(device)
        images, labels = train.images[idx], train.labels[idx]

        def vmapped():
            nonlocal stacked
            stacked, m = ens_step(stacked, images, labels)
            return m.skipped

        def one_after_another():
            skipped = []
            for j in range(k):
                x, y = (images[j], labels[j]) if idx.ndim == 2 else (images, labels)
                alone[j], m = seq_step(alone[j], x, y)
                skipped.append(m.skipped)
            return torch.stack(skipped)

        first, second = (vmapped, one_after_another) if r % 2 == 0 else (one_after_another, vmapped)
        results = {f: _timed(device, f) for f in (first, second)}
        (tv, sv), (ta, sa) = results[vmapped], results[one_after_another]
        skips_v.append(sv.cpu())
        skips_a.append(sa.cpu())
        if r >= warmup:
            times_v.append(tv)
            times_a.append(ta)

    images_per_step = k * order.shape[-1]
    max_abs = max_rel = 0.0
    for j, s in enumerate(alone):
        for name, m in s.master.items():
            d = (stacked.master[name][j] - m).abs().max().item()
            max_abs = max(max_abs, d)
            max_rel = max(max_rel, d / max(m.abs().max().item(), 1e-30))
    scales_alone = torch.stack([s.loss_scale.loss_scale for s in alone]).cpu()
    vmapped_rate = images_per_step / statistics.median(times_v)
    alone_rate = images_per_step / statistics.median(times_a)
    return {
        "members": k,
        "images_per_step": images_per_step,
        "timed_rounds": len(times_v),
        "warmup_rounds": warmup,
        "vmapped_images_per_s": vmapped_rate,
        "sequential_images_per_s": alone_rate,
        "ratio": vmapped_rate / alone_rate,
        "vmapped_step_ms": 1000 * statistics.median(times_v),
        "sequential_step_ms": 1000 * statistics.median(times_a),
        "skips_agree": bool(torch.equal(torch.stack(skips_v), torch.stack(skips_a))),
        "loss_scales_agree": bool(torch.equal(stacked.loss_scale.loss_scale.cpu(), scales_alone)),
        "skipped_steps": int(torch.stack(skips_v).sum()),
        "master_max_abs_diff": max_abs,
        "master_max_rel_diff": max_rel,
    }


# -- training ------------------------------------------------------------------------------


def train(args, ens_step, ens_logits, stacked, batches: Batches, data, k: int, synthetic: bool):
    """``--epochs`` epochs of the vmapped step; returns the final state and one row per epoch."""
    n_train = data.train.labels.shape[0]
    label = "synthetic test" if synthetic else "test"
    rows = []
    for epoch in range(1, args.epochs + 1):
        order = batches.epoch(n_train, args.batch_size, args.steps_per_epoch)
        steps = order.shape[0]
        metrics = []
        synchronize(stacked.step.device)
        t0 = time.perf_counter()
        for i in range(steps):
            idx = order[i].to(stacked.step.device)
            stacked, m = ens_step(stacked, data.train.images[idx], data.train.labels[idx])
            metrics.append(m)
            if args.log_every and (i + 1) % args.log_every == 0:
                rate = (i + 1) * k * args.batch_size / (time.perf_counter() - t0)
                print(
                    f"  epoch {epoch} step {i + 1}/{steps}: loss {m.loss.mean().item():.4f} "
                    f"(mean of members), {rate:.0f} images/s",
                    flush=True,
                )
        synchronize(stacked.step.device)
        seconds = time.perf_counter() - t0
        losses = torch.stack([x.loss for x in metrics]).cpu()  # (steps, K)
        skipped = torch.stack([x.skipped for x in metrics]).cpu()
        accs, ens_acc = evaluate(ens_logits, stacked.params, data.test, args.eval_batch_size)
        row = {
            "epoch": epoch,
            "steps": steps,
            "images_per_s": steps * k * args.batch_size / seconds,
            "mean_loss": losses.mean(0).tolist(),
            "test_accuracy": accs,
            "ensemble_test_accuracy": ens_acc,
            "loss_scale": stacked.loss_scale.loss_scale.cpu().tolist(),
            "skipped_steps": skipped.sum(0).tolist(),
        }
        rows.append(row)
        print(
            f"epoch {epoch}/{args.epochs}: {steps} steps, {row['images_per_s']:.0f} images/s, "
            f"mean loss {losses.mean().item():.4f}, {label} accuracy by member "
            f"[{' '.join(f'{a:.2f}' for a in accs)}] %, ensemble {ens_acc:.2f} %, loss scales "
            f"[{' '.join(f'{s:g}' for s in row['loss_scale'])}]",
            flush=True,
        )
    return stacked, rows


def report(members: Sequence[Member], rows: list[dict], n_test: int, synthetic: bool) -> None:
    """The final table: each member's test accuracy, loss scale and skipped steps."""
    final = rows[-1]
    print(
        f"{'member':>6}  {'seed':>4}  {'lr':>8}  {'test accuracy':>13}  {'loss scale':>10}  skipped"
    )
    for j, mem in enumerate(members):
        skipped = sum(r["skipped_steps"][j] for r in rows)
        print(
            f"{j:>6}  {mem.seed:>4}  {mem.lr:>8g}  {final['test_accuracy'][j]:>11.2f} %  "
            f"{final['loss_scale'][j]:>10g}  {skipped:>7}"
        )
    images = f"{n_test} {'synthetic ' if synthetic else ''}test images"
    print(
        f"ensemble of {len(members)} (mean of member probabilities) on the {images}: "
        f"{final['ensemble_test_accuracy']:.2f} %",
        flush=True,
    )


# -- flags -------------------------------------------------------------------------------


def parse_lrs(text: str) -> list[float]:
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None
    if not lrs or not all(math.isfinite(x) and x >= 0 for x in lrs):
        raise argparse.ArgumentTypeError(f"learning rates must be finite and >= 0, got {text!r}")
    return lrs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's settings; the data flags are the main example's."""
    p = argparse.ArgumentParser(
        description="Train K CIFAR-10 CNNs at once in one vmapped FP16 step, and time it "
        "against training them one after another.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data (as in cifar10_functional.py)")
    d.add_argument("--dataset", choices=cifar10_data.DATASETS, default="auto")
    d.add_argument("--data-dir", "--data", default="data", help="CIFAR10 root or ImageFolder tree")
    d.add_argument("--download", action="store_true", help="download CIFAR-10 if it is missing")
    d.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    d.add_argument("--fake-train-size", type=int, default=50000)
    d.add_argument("--fake-test-size", type=int, default=10000)
    d.add_argument(
        "--data-order",
        choices=["shared", "per-member"],
        default="shared",
        help="shared: every member sees the same batch (vmap in_dims None); per-member: each "
        "member k its own shuffle, from seed + k (in_dims 0)",
    )
    t = p.add_argument_group("ensemble and training")
    t.add_argument("--members", type=int, default=None, help="K (default 8, or len(--lrs))")
    t.add_argument("--seed", type=int, default=0, help="member k is initialised from seed + k")
    t.add_argument(
        "--lrs",
        type=parse_lrs,
        default=None,
        help="comma-separated learning rates: a sweep, one member per rate, all initialised "
        "from --seed",
    )
    t.add_argument("--lr", type=float, default=0.001)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--batch-size", type=int, default=128, help="per member")
    t.add_argument("--eval-batch-size", type=int, default=250)
    t.add_argument(
        "--steps-per-epoch", type=int, default=0, help="stop each epoch after N steps (0: all)"
    )
    m = p.add_argument_group("precision, device and timing")
    m.add_argument(
        "--compute-dtype",
        choices=["auto", "fp16", "bf16", "fp32"],
        default="auto",
        help="forward/backward dtype of the FP16 parameters; auto as in cifar10_functional.py "
        "(fp16 on CUDA; bf16 on a CPU with native BF16, else fp32)",
    )
    m.add_argument("--init-scale", type=float, default=2.0**16)
    m.add_argument("--growth-interval", type=int, default=2000)
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    m.add_argument(
        "--batching",
        choices=["folded", "torch"],
        default="folded",
        help="folded: the convolutions and pooling fold the members into channels; torch: "
        "vmap's own batching rules, for comparison",
    )
    m.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    m.add_argument("--no-tune-malloc", action="store_true", help="keep glibc's malloc settings")
    m.add_argument(
        "--bench-steps",
        type=int,
        default=30,
        help="timed rounds of the vmapped-against-one-after-another comparison (0: none)",
    )
    m.add_argument("--bench-warmup", type=int, default=3, help="untimed rounds before those")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default="runs/ensemble")
    o.add_argument(
        "--log-every", type=int, default=50, help="a progress line every N steps (0: none)"
    )
    args = p.parse_args(argv)
    if args.lrs is not None:
        if args.members not in (None, len(args.lrs)):
            p.error(f"--members {args.members} but --lrs gives {len(args.lrs)} learning rates")
        args.members = len(args.lrs)
    elif args.members is None:
        args.members = 8
    for name in ("members", "epochs", "batch_size", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("steps_per_epoch", "bench_steps", "bench_warmup", "threads", "log_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


# -- main ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example; returns the summary (also written to ``summary.json``)."""
    args = parse_args(argv)
    device = main_job.resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    main_job.configure_process(args, device)
    policy = main_job.resolve_policy(
        argparse.Namespace(policy=None, precision="fp16", compute_dtype=args.compute_dtype), device
    )
    try:
        data = cifar10_data.load_data(
            args.dataset,
            args.data_dir,
            download=args.download,
            workers=args.workers,
            image_size=main_job.IMAGE_SIZE,
            fake_train_size=args.fake_train_size,
            fake_test_size=args.fake_test_size,
        )
    except cifar10_data.DataError as err:
        raise SystemExit(f"error: {err}") from None
    n_train, n_test = data.train.labels.shape[0], data.test.labels.shape[0]
    if n_train < args.batch_size:
        raise SystemExit(
            f"error: {n_train} training images, fewer than --batch-size {args.batch_size}"
        )
    on_device = main_job.to_device_data(data, device)
    members = member_specs(args)
    k, num_classes = len(members), len(data.classes)
    per_member = args.data_order == "per-member"
    where = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"data: {'SYNTHETIC data' if data.synthetic else data.source}, {n_train} train / "
        f"{n_test} test images, order: {args.data_order}\n"
        f"ensemble: {k} members ({'learning-rate sweep' if args.lrs else 'seeds'}), batch "
        f"{args.batch_size} per member, policy: {policy}, batching rules: {args.batching}\n"
        f"device: {device} ({where})",
        flush=True,
    )
    seq_step = make_train_step(main_job.build_model(num_classes, 0).requires_grad_(False), policy)
    if args.batching == "folded":
        ens_model = ensemble_net(num_classes)
    else:
        ens_model = main_job.build_model(num_classes, 0).requires_grad_(False)
    ens_step = make_ensemble_step(ens_model, policy, per_member)
    summary: dict[str, Any] = {
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "device": str(device),
        "device_name": where,
        "policy": str(policy),
        "dataset": data.source,
        "synthetic": data.synthetic,
        "data_order": args.data_order,
        "batching": args.batching,
        "members": [m._asdict() for m in members],
    }

    if args.bench_steps:  # 1. vmapped against one after another, from the initial states
        order = Batches(k, per_member, args.seed).epoch(
            n_train, args.batch_size, args.bench_warmup + args.bench_steps
        )
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        states = build_members(members, num_classes, args, device)
        bench = compare_throughput(
            seq_step, ens_step, states, order, on_device.train, device, args.bench_warmup
        )
        bench["load_average_before"] = load
        summary["throughput"] = bench
        print(
            f"throughput, {k} members x {args.batch_size} images per step (medians of "
            f"{bench['timed_rounds']} rounds after {args.bench_warmup} untimed; load average "
            f"{load:.2f}): vmapped {bench['vmapped_images_per_s']:.0f} images/s, one after "
            f"another {bench['sequential_images_per_s']:.0f} images/s, ratio {bench['ratio']:.2f}x\n"
            f"agreement after {order.shape[0]} steps each way: skip decisions "
            f"{'identical' if bench['skips_agree'] else 'DIFFER'}, loss scales "
            f"{'identical' if bench['loss_scales_agree'] else 'DIFFER'}, masters within "
            f"{bench['master_max_abs_diff']:.1e} ({bench['master_max_rel_diff']:.1e} of the "
            "largest weight)",
            flush=True,
        )

    # 2. training: the vmapped step alone, from fresh initial states
    stacked = ff.tree_stack(build_members(members, num_classes, args, device))
    ens_logits = make_ensemble_logits(ens_model, policy)
    batches = Batches(k, per_member, args.seed)
    stacked, rows = train(
        args, ens_step, ens_logits, stacked, batches, on_device, k, data.synthetic
    )
    report(members, rows, n_test, data.synthetic)
    summary["epochs"] = rows
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    ff.save_checkpoint(
        out_dir / "ensemble_final.pt", {"state": stacked, "members": summary["members"]}
    )
    summary["state"] = stacked
    return summary


if __name__ == "__main__":
    main()
