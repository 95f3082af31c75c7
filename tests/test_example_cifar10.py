"""End-to-end tests of examples/cifar10_functional.py on tiny data (fake and ImageFolder).

The example runs in-process through its ``main(argv)``; every run is a few
steps of FP32 or BF16 computation on the CPU.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves
from tests.helpers import assert_within_one_operation_ulp, load_example

pytestmark = pytest.mark.usefixtures("one_thread")


example = load_example("cifar10_functional")
data_mod = sys.modules["cifar10_data"]

TINY = [
    "--dataset",
    "fake",
    "--fake-train-size",
    "96",
    "--fake-test-size",
    "40",
    "--batch-size",
    "16",
    "--eval-batch-size",
    "20",
    "--max-steps-per-epoch",
    "3",
    "--device",
    "cpu",
    "--no-progress",
    "--workers",
    "0",
    "--no-tune-malloc",
]


def final_line(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return out[-1], out


def test_fc1_input_is_the_real_feature_map_size():
    net = example.Net()
    assert net.fc1.in_features == 128 * 6 * 6
    assert example.Net(image_size=40).fc1.in_features == 128 * 8 * 8
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_net_is_the_seed_recipes_two_linear_layer_cnn():
    shapes = {k: tuple(v.shape) for k, v in example.Net().named_parameters()}
    assert shapes == {
        "conv1.weight": (64, 3, 3, 3),
        "conv1.bias": (64,),
        "conv2.weight": (128, 64, 3, 3),
        "conv2.bias": (128,),
        "fc1.weight": (256, 128 * 6 * 6),
        "fc1.bias": (256,),
        "fc2.weight": (10, 256),
        "fc2.bias": (10,),
    }
    assert sum(v.numel() for v in example.Net().parameters()) == 1_258_122


def test_fake_run_writes_metrics_plot_checkpoint_and_final_line(tmp_path, capsys):
    out = tmp_path / "run"
    summary = example.main(
        [*TINY, "--epochs", "2", "--compute-dtype", "bf16", "--out-dir", str(out)]
    )
    last, lines = final_line(capsys)
    assert last.startswith("Accuracy of the network on the 40 synthetic test images: ")
    assert last.endswith(" %")
    assert sum("images/s" in line for line in lines) >= 3  # two epochs and the total
    assert summary["policy"] == "p=f16,c=bf16,o=full"
    assert summary["synthetic"] and len(summary["test_accuracy_per_epoch"]) == 2

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    counters = {"skips", "growths", "backoffs", "since_skip"}
    assert set(rows[0]) == {"step", "epoch", "loss", "loss_scale", "skipped", "lr", *counters}
    assert [r["skips"] for r in rows] == [
        sum(x["skipped"] for x in rows[: i + 1]) for i in range(6)
    ]
    assert all(r["lr"] == 0.001 and r["loss_scale"] > 0 for r in rows)
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text())["steps"] == 6

    ckpt = torch.load(out / "checkpoint_epoch_002.pt", weights_only=True)
    assert ckpt["format"] == "functional_fp16.checkpoint"
    loaded = ff.load_checkpoint(out / "checkpoint_epoch_002.pt")
    assert loaded["epoch"] == 2 and loaded["global_step"] == 6
    for name, master in summary["state"].master.items():
        assert master.dtype == torch.float32
        assert torch.equal(loaded["state"]["master"][name], master)
        assert loaded["state"]["params"][name].dtype == torch.float16


def run_fp16(out, *extra):
    # FP16 params with a huge initial scale and a short growth interval, so the
    # loss scale both backs off and grows: a resumed run must restore all of it.
    return example.main(
        [
            *TINY,
            "--compute-dtype",
            "fp32",
            "--init-scale",
            str(2.0**20),
            "--growth-interval",
            "2",
            "--no-plot",
            "--out-dir",
            str(out),
            *extra,
        ]
    )


def test_resume_from_epoch_1_is_bit_identical(tmp_path, capsys):
    full = run_fp16(tmp_path / "full", "--epochs", "2")
    first = ff.load_checkpoint(tmp_path / "full" / "checkpoint_epoch_001.pt")
    # The run did something between the checkpoints, including loss-scale moves.
    assert not torch.equal(
        first["state"]["master"]["fc1.weight"], full["state"].master["fc1.weight"]
    )
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["skipped"] for r in rows) and len({r["loss_scale"] for r in rows}) > 1
    # A skipped step's row names the leaves that overflowed (some of the model's), no other.
    names = set(full["state"].params)
    for r in rows:
        assert ("nonfinite" in r) == r["skipped"], r
        assert set(r.get("nonfinite", [])) <= names, r
    assert any(r.get("nonfinite") for r in rows)  # some skip was a gradient's overflow

    resumed = run_fp16(
        tmp_path / "resumed",
        "--epochs",
        "2",
        "--resume",
        str(tmp_path / "full" / "checkpoint_epoch_001.pt"),
    )
    a, b = full["state"], resumed["state"]
    for name in a.master:
        assert torch.equal(a.master[name], b.master[name]), name
        assert torch.equal(a.params[name], b.params[name]), name
    for x, y in zip(tree_leaves(a.opt_state), tree_leaves(b.opt_state)):
        assert torch.equal(x, y)
    for x, y in zip(tree_leaves(a.loss_scale), tree_leaves(b.loss_scale)):
        assert torch.equal(x, y)
    assert torch.equal(a.step, b.step) and int(b.step) == 6
    assert resumed["test_accuracy_per_epoch"] == full["test_accuracy_per_epoch"]
    assert "resumed from" in capsys.readouterr().out
    # Resumed into a fresh --out-dir: the metrics and the summary still
    # describe the whole run, the steps before the checkpoint included.
    again = [
        json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert again == rows
    assert resumed["skipped_steps"] == full["skipped_steps"] == sum(r["skipped"] for r in rows)


def test_interrupted_run_continues_its_metrics_file(tmp_path):
    out = tmp_path / "run"
    run_fp16(out, "--epochs", "1")
    run_fp16(out, "--epochs", "2", "--resume", str(out / "checkpoint_epoch_001.pt"))
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_resume_refuses_a_checkpoint_from_different_settings(tmp_path):
    run_fp16(tmp_path / "a", "--epochs", "1")
    ckpt = str(tmp_path / "a" / "checkpoint_epoch_001.pt")
    with pytest.raises(SystemExit, match="lr=0.001.*lr=0.01"):
        run_fp16(tmp_path / "b", "--epochs", "2", "--lr", "0.01", "--resume", ckpt)
    with pytest.raises(SystemExit, match="no such file"):
        run_fp16(tmp_path / "b", "--resume", str(tmp_path / "missing.pt"))
    # A checkpoint of something else, and a damaged file, are one-line errors too.
    ff.save_checkpoint(tmp_path / "other.pt", {"w": torch.ones(2)})
    with pytest.raises(SystemExit, match="not a checkpoint written by this example"):
        run_fp16(tmp_path / "b", "--resume", str(tmp_path / "other.pt"))
    (tmp_path / "torn.pt").write_bytes(Path(ckpt).read_bytes()[:1000])
    with pytest.raises(SystemExit, match="error: --resume: .*torn.pt"):
        run_fp16(tmp_path / "b", "--resume", str(tmp_path / "torn.pt"))


def write_image_tree(root, sizes):
    from PIL import Image

    g = torch.Generator().manual_seed(3)
    pixels = {}
    for split, per_class in (("train", 6), ("test", 3)):
        for c, cls in enumerate(["cat", "dog", "ship"]):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                size = sizes[(i + c) % len(sizes)]
                arr = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8)
                ext = "png" if i % 2 == 0 else "jpg"
                path = folder / f"{i:03d}.{ext}"
                Image.fromarray(arr.numpy()).save(path)
                pixels[(split, cls, i)] = (arr, ext, size)
    return pixels


def test_imagefolder_decodes_once_and_caches(tmp_path):
    pixels = write_image_tree(tmp_path / "data", sizes=(32, 20))
    data = data_mod.load_data("imagefolder", tmp_path / "data", workers=0)
    assert data.classes == ("cat", "dog", "ship") and not data.synthetic
    assert data.train.images.shape == (18, 3, 32, 32) and data.train.images.dtype == torch.uint8
    assert data.test.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # A lossless 32x32 PNG comes back pixel for pixel (ImageFolder sorts files by name).
    arr, ext, size = pixels[("train", "cat", 0)]
    assert (ext, size) == ("png", 32)
    assert torch.equal(data.train.images[0], arr.permute(2, 0, 1))
    assert sorted(p.name for p in (tmp_path / "data" / ".decoded").iterdir()) == [
        "test_32x32.pt",
        "train_32x32.pt",
    ]
    again = data_mod.load_data("imagefolder", tmp_path / "data", workers=0)
    assert again.decode_seconds == 0.0  # read from the cache
    assert torch.equal(again.train.images, data.train.images)
    # Changing a file invalidates the cache.
    (tmp_path / "data" / "train" / "cat" / "000.png").unlink()
    changed = data_mod.load_data("imagefolder", tmp_path / "data", workers=0)
    assert changed.train.images.shape[0] == 17 and changed.decode_seconds > 0


def test_imagefolder_run_end_to_end_via_auto_detection(tmp_path, capsys):
    write_image_tree(tmp_path / "data", sizes=(32,))
    out = tmp_path / "run"
    summary = example.main(
        [
            "--data-dir",
            str(tmp_path / "data"),
            "--epochs",
            "1",
            "--batch-size",
            "4",
            "--eval-batch-size",
            "4",
            "--device",
            "cpu",
            "--no-progress",
            "--workers",
            "0",
            "--no-tune-malloc",
            "--precision",
            "bf16",
            "--out-dir",
            str(out),
        ]
    )
    last, _ = final_line(capsys)
    assert summary["dataset"] == "imagefolder" and not summary["synthetic"]
    assert summary["policy"] == "p=bf16,c=bf16,o=full"
    assert summary["steps"] == 4  # 18 images, batches of 4, the partial batch dropped
    assert (
        last
        == f"Accuracy of the network on the 9 test images: {int(summary['final_test_accuracy'])} %"
    )
    assert (out / "checkpoint_epoch_001.pt").is_file() and (out / "training.png").is_file()


def test_auto_without_data_falls_back_to_synthetic_in_one_line(tmp_path, capsys):
    args = [a for a in TINY if a != "fake"]
    args[args.index("--dataset")] = "--data-dir"
    args.insert(args.index("--data-dir") + 1, str(tmp_path / "nothing"))
    example.main([*args, "--epochs", "1", "--no-plot", "--out-dir", str(tmp_path / "run")])
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "SYNTHETIC" in line]
    assert len(notes) == 1 and "falling back" in notes[0]
    assert "synthetic test images" in captured.out.strip().splitlines()[-1]


def test_cifar10_missing_offline_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit) as info:
        example.main(
            ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--out-dir", str(tmp_path)]
        )
    message = str(info.value)
    assert "--download" in message and "\n" not in message


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--device", "cpu", "--compute-dtype", "bf16"],
            "p=f16,c=bf16,o=full",
        ),
        (
            ["--device", "cpu", "--precision", "fp32"],
            "p=full,c=full,o=full",
        ),
        (
            ["--device", "cpu", "--policy", "p=f16,c=f16,o=f16"],
            "p=f16,c=f16,o=f16",
        ),
    ],
)
def test_policy_flags(argv, expected):
    args = example.parse_args(argv)
    policy = example.resolve_policy(args, torch.device("cpu"))
    assert str(policy) == expected
    scale = example.resolve_loss_scale(args, policy)
    assert isinstance(scale, ff.NoOpLossScale) == ("=f16" not in expected)


def test_cpu_default_computes_fp16_params_in_bf16_or_fp32(monkeypatch):
    args = example.parse_args(["--device", "cpu"])
    for fast, compute in ((True, "bf16"), (False, "full")):
        monkeypatch.setattr(example, "cpu_has_fast_bf16", lambda fast=fast: fast)
        policy = example.resolve_policy(args, torch.device("cpu"))
        assert str(policy) == f"p=f16,c={compute},o=full"
        assert isinstance(example.resolve_loss_scale(args, policy), ff.DynamicLossScale)


def test_cuda_defaults_compute_in_the_parameter_dtype():
    args = example.parse_args([])
    assert str(example.resolve_policy(args, torch.device("cuda"))) == "p=f16,c=f16,o=full"


def test_bad_flags_are_rejected(capsys):
    with pytest.raises(SystemExit):
        example.parse_args(["--policy", "p=f16,c=f8"])
    assert "unknown dtype name 'f8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.parse_args(["--epochs", "0"])
    assert "--epochs must be >= 1" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp16_run_resumes_bit_identically(tmp_path, capsys):
    def run(out, *extra):
        return example.main(
            [
                *TINY,
                "--device",
                "cuda",
                "--deterministic",
                "--epochs",
                "2",
                "--no-plot",
                "--out-dir",
                str(out),
                *extra,
            ]
        )

    full = run(tmp_path / "full")
    assert full["policy"] == "p=f16,c=f16,o=full"
    assert full["device"].startswith("cuda")
    resumed = run(
        tmp_path / "resumed", "--resume", str(tmp_path / "full" / "checkpoint_epoch_001.pt")
    )
    for name, master in full["state"].master.items():
        assert master.is_cuda and master.dtype == torch.float32
        assert torch.equal(master, resumed["state"].master[name]), name
    assert "Accuracy of the network on the 40 synthetic test images" in capsys.readouterr().out


def test_train_step_traces_as_one_graph_for_compile():
    # What --compile relies on: the whole step (casts, torch.func gradients,
    # fp16_update) is one graph. The eager backend checks tracing without codegen.
    args = example.parse_args(["--device", "cpu", "--compute-dtype", "fp32"])
    policy = example.resolve_policy(args, torch.device("cpu"))
    model = example.build_model(10, seed=0)
    state, buffers = example.build_state(
        model, policy, example.resolve_loss_scale(args, policy), args, torch.device("cpu")
    )
    step = example.make_train_step(model, policy)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (4,), generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    s1, _, m1 = compiled(state, buffers, images, labels)
    s2, _, m2 = step(state, buffers, images, labels)
    assert torch.equal(m1.loss, m2.loss) and torch.equal(m1.skipped, m2.skipped)
    # Traced, the update runs the two-rounding multi-tensor code; eager, the
    # fused kernel: within the contract's one ulp at the operation's scale.
    for name in s2.master:
        assert_within_one_operation_ulp(s1.master[name], s2.master[name], state.master[name])
