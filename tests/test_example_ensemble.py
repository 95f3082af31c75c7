"""examples/ensemble_vmap.py on tiny synthetic data: the script end to end, and its vmapped
members against the same members trained one at a time with the unbatched step."""

import argparse
import re
import sys

import pytest
import torch

import functional_fp16 as ff
from tests.helpers import load_example

pytestmark = pytest.mark.usefixtures("one_thread")


ensemble = load_example("ensemble_vmap")
main_job = sys.modules["cifar10_functional"]
data_mod = sys.modules["cifar10_data"]

TINY = [
    "--dataset",
    "fake",
    "--fake-train-size",
    "64",
    "--fake-test-size",
    "24",
    "--batch-size",
    "16",
    "--eval-batch-size",
    "12",
    "--steps-per-epoch",
    "2",
    "--epochs",
    "1",
    "--device",
    "cpu",
    "--workers",
    "0",
    "--no-tune-malloc",
    "--log-every",
    "0",
    "--bench-steps",
    "2",
    "--bench-warmup",
    "1",
]

MEMBER_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+) %\s+(\d+)\s+(\d+)$")


@pytest.mark.parametrize(
    "extra", [["--members", "3"], ["--lrs", "0.001,0.01", "--data-order", "per-member"]]
)
def test_script_prints_each_members_accuracy_and_loss_scale(tmp_path, capsys, extra):
    summary = ensemble.main([*TINY, "--out-dir", str(tmp_path), *extra])
    lines = capsys.readouterr().out.strip().splitlines()
    k = 3 if "--members" in extra else 2
    rows = [MEMBER_ROW.match(line).groups() for line in lines if MEMBER_ROW.match(line)]
    assert [int(r[0]) for r in rows] == list(range(k))
    final = summary["epochs"][-1]
    for r, acc, scale in zip(rows, final["test_accuracy"], final["loss_scale"]):
        assert float(r[3]) == pytest.approx(acc, abs=0.005) and int(r[4]) == int(scale) > 0
    if "--lrs" in extra:  # a sweep: one initialisation, one learning rate per member
        assert [(int(r[1]), float(r[2])) for r in rows] == [(0, 0.001), (0, 0.01)]
    assert lines[-1].startswith(
        f"ensemble of {k} (mean of member probabilities) on the 24 synthetic"
    )
    bench = summary["throughput"]
    assert bench["vmapped_images_per_s"] > 0 and bench["sequential_images_per_s"] > 0
    assert bench["skips_agree"] and bench["loss_scales_agree"]
    assert any(line.startswith("throughput, ") and "ratio" in line for line in lines)
    assert (tmp_path / "summary.json").is_file()
    saved = ff.load_checkpoint(tmp_path / "ensemble_final.pt")
    assert saved["state"]["master"]["fc2.weight"].shape == (k, 10, 256)


def policy_for(compute: str):
    args = argparse.Namespace(policy=None, precision="fp16", compute_dtype=compute)
    return main_job.resolve_policy(args, torch.device("cpu"))


def train_both_ways(policy, members, steps=6, batch=16, init_scales=None, per_member=False):
    """``steps`` steps of the vmapped step and of the unbatched step per member, same batches."""
    args = ensemble.parse_args(["--members", str(len(members))])
    states = ensemble.build_members(members, 10, args, torch.device("cpu"), init_scales)
    first = [s.master for s in states]
    stacked = ff.tree_stack(states)
    alone_step = ensemble.make_train_step(main_job.build_model(10, 0).requires_grad_(False), policy)
    vmapped_step = ensemble.make_ensemble_step(ensemble.ensemble_net(10), policy, per_member)
    data = data_mod.make_fake(batch * steps * len(members), 8)
    images = main_job.to_device_images(data.train.images, torch.device("cpu"))
    vmapped_skips, alone_skips = [], []
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch)
        if per_member:
            idx = torch.stack([idx + k * steps * batch for k in range(len(members))])
        x, y = images[idx], data.train.labels[idx]
        stacked, m = vmapped_step(stacked, x, y)
        vmapped_skips.append(m.skipped.tolist())
        row = []
        for k in range(len(members)):
            states[k], mk = alone_step(
                states[k], x[k] if per_member else x, y[k] if per_member else y
            )
            row.append(bool(mk.skipped))
        alone_skips.append(row)
    return stacked, states, first, vmapped_skips, alone_skips


def relative_drift(stacked, states, first):
    """max over members and tensors of |vmapped - alone| / |alone - initial| (Frobenius norms)."""
    worst = 0.0
    for k, s in enumerate(states):
        for name, m in s.master.items():
            moved = (m - first[k][name]).norm().item()
            if moved:
                worst = max(worst, (stacked.master[name][k] - m).norm().item() / moved)
            else:  # a member that never stepped must be exactly where it started
                assert torch.equal(stacked.master[name][k], m), (k, name)
    return worst


# Batched and unbatched convolutions and matmuls accumulate in different orders,
# so the members' masters agree closely, not bitwise. FP32 compute: a gradient
# differs by at most about an FP16 rounding (2**-11 relative) now and then;
# measured worst drift 2.9e-5 of the distance the weights moved in 6 steps,
# bound 2**-10. BF16 compute (the CPU default): activations round to 8
# significant bits, so a rounding flip moves a gradient by up to 2**-8;
# measured worst 1.8e-2, bound 2**-4. Skip decisions and loss scales: exact.
@pytest.mark.parametrize("compute, bound", [("fp32", 2.0**-10), ("bf16", 2.0**-4)])
def test_vmapped_members_are_the_members_trained_alone(compute, bound):
    members = [ensemble.Member(seed, 0.001) for seed in range(3)]
    # member 1 starts with a scale whose FP16 gradients overflow: it alone skips and backs off
    stacked, states, first, vskips, askips = train_both_ways(
        policy_for(compute), members, init_scales=[2.0**16, 2.0**21, 2.0**10]
    )
    assert vskips == askips
    assert [row[1] for row in vskips][:3] == [True] * 3 and not any(r[0] or r[2] for r in vskips)
    assert stacked.loss_scale.loss_scale.tolist() == [
        float(s.loss_scale.loss_scale) for s in states
    ]
    assert stacked.step.tolist() == [int(s.step) for s in states]
    assert relative_drift(stacked, states, first) <= bound


def test_learning_rate_sweep_members_with_per_member_batches():
    members = [ensemble.Member(0, lr) for lr in (0.001, 0.004, 0.0)]
    stacked, states, first, vskips, askips = train_both_ways(
        policy_for("fp32"), members, steps=4, per_member=True
    )
    assert vskips == askips and stacked.tx is states[0].tx
    lrs = torch.tensor([0.001, 0.004, 0.0], dtype=torch.float32)
    assert torch.equal(stacked.opt_state[2].learning_rate, lrs)
    assert relative_drift(stacked, states, first) <= 2.0**-10  # lr 0: master bitwise unmoved


def test_learning_rate_in_state_is_sgds_arithmetic():
    """One update of the sweep's optimiser is bitwise ff.sgd(lr)'s reference update."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 4, generator=g), "b": torch.randn(4, generator=g)}
    lr = 0.003
    plain = ff.fp16_init(params, ff.sgd(lr, momentum=0.9))
    swept = ensemble.with_learning_rate(
        ff.fp16_init(params, ensemble.sgd_with_lr_in_state(0.9)), lr
    )
    for step in range(3):
        grads = {k: (torch.randn(v.shape, generator=g) * 100).half() for k, v in params.items()}
        plain = ff.fp16_update(plain, grads, impl="reference")
        swept = ff.fp16_update(swept, grads)
        for name in params:
            assert torch.equal(plain.master[name], swept.master[name]), (step, name)
            assert torch.equal(plain.opt_state[1].trace[name], swept.opt_state[1].trace[name])
