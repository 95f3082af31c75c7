"""End-to-end tests of examples/gpt_functional.py (and benchmarks/stock_gpt.py) on tiny models.

The example runs in-process through its ``main(argv)``: one layer of width
32, context 16, batches of 8, tens of steps on a few thousand characters of
synthetic text, on the CPU.
"""

import contextlib
import hashlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves
from tests.helpers import EXAMPLES, load_example, load_module

pytestmark = pytest.mark.usefixtures("one_thread")

example = load_example("gpt_functional")
model_mod = sys.modules["gpt_model"]
gpt_data = sys.modules["gpt_data"]
stock = load_module(EXAMPLES.parent / "benchmarks" / "stock_gpt.py", "stock_gpt_under_test")

SIZE = ["--layers", "1", "--heads", "2", "--width", "32", "--context", "16", "--batch-size", "8"]
TINY = [
    "--synthetic",
    "--synthetic-chars",
    "6000",
    *SIZE,
    "--device",
    "cpu",
    "--no-progress",
    "--no-tune-malloc",
    "--sample-chars",
    "20",
]


def run(out: Path, *extra: str) -> dict:
    return example.main([*TINY, "--out-dir", str(out), *extra])


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny_model(seed: int = 0, vocab: int = 11):
    cfg = model_mod.GPTConfig(vocab_size=vocab, context=16, layers=2, heads=2, width=32)
    return model_mod.build_model(cfg, seed)


def test_tiny_run_learns_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    summary = run(out, "--max-steps", "40", "--eval-interval", "20", "--lr", "1e-2")
    lines = capsys.readouterr().out.strip().splitlines()
    # Learning: the loss falls well below the uniform guess, log(vocabulary).
    rows = [r for r in jsonl(out / "metrics.jsonl") if "loss" in r]
    evals = [r for r in jsonl(out / "metrics.jsonl") if "val_loss" in r]
    vocab = summary["model"]["vocab_size"]
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert abs(first - math.log(vocab)) < 0.1 and last < first - 0.8, (first, last)
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < math.log(vocab) - 0.5
    assert summary["val_loss"] == evals[-1]["val_loss"]
    # The metrics: every step, the schedule's learning rate, the scale in force.
    assert [r["step"] for r in rows] == list(range(1, 41))
    counters = {"skips", "growths", "backoffs", "since_skip"}
    assert set(rows[0]) == {"step", "loss", "loss_scale", "skipped", "lr", *counters}
    # The loss-scale counters after each step: a row's scale is the one its step used, so
    # step k's growth or backoff shows in row k + 1.
    skips = since = grew = shrank = 0
    for r, after in zip(rows, [*rows[1:], None]):
        skips += r["skipped"]
        since = 0 if r["skipped"] else since + 1
        assert (r["skips"], r["since_skip"]) == (skips, since), r["step"]
        if after is not None:
            grew += after["loss_scale"] > r["loss_scale"]
            shrank += after["loss_scale"] < r["loss_scale"]
            assert (r["growths"], r["backoffs"]) == (grew, shrank), r["step"]
    args = example.parse_args([*TINY, "--max-steps", "40", "--lr", "1e-2"])
    applied = 0
    for r in rows:
        assert r["lr"] == pytest.approx(stock.lr_at(applied, args), rel=1e-6)
        applied += not r["skipped"]
    assert summary["skipped_steps"] == sum(r["skipped"] for r in rows)
    # The summary, the sample, the plot, a checkpoint per evaluation.
    for key in ("val_loss", "train_tokens_per_s", "parameters", "skipped_steps"):
        assert key in json.loads((out / "summary.json").read_text())
    assert summary["parameters"] == sum(p.numel() for p in summary["state"].params.values())
    assert summary["train_tokens_per_s"] > 0 and summary["synthetic"]
    assert summary["policy"] == "p=f16,c=bf16,o=full" or not example.cpu_has_fast_bf16()
    assert len((out / "sample.txt").read_text(encoding="utf-8")) == 20
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.glob("checkpoint_step_*.pt")) == [
        "checkpoint_step_000020.pt",
        "checkpoint_step_000040.pt",
    ]
    # Printed: a line per evaluation, the sample, and a final line that says "synthetic".
    assert sum(line.startswith("step ") and "synthetic val loss" in line for line in lines) == 2
    assert lines[-1] == (
        f"validation loss on synthetic text after 40 steps: {summary['val_loss']:.4f} "
        "nats/character"
    )


def resumable(out: Path, *extra: str) -> dict:
    # A huge initial scale with a short growth interval, so the scale backs
    # off (through the hysteresis) and grows again; dropout draws from the
    # global generator; two micro-batches per step (MultiSteps).
    return run(
        out,
        "--max-steps",
        "8",
        "--eval-interval",
        "4",
        "--grad-accum",
        "2",
        "--dropout",
        "0.1",
        "--init-scale",
        str(2.0**18),
        "--growth-interval",
        "2",
        "--no-plot",
        "--sample-chars",
        "0",
        *extra,
    )


def test_moments_flag_stores_adamw_moments_and_reports_the_bytes(tmp_path, capsys):
    """``--moments int8`` codes the moments of the matrices in one byte;
    the state's bytes are printed at start-up and written to summary.json."""
    wide = ("--width", "64", "--max-steps", "4", "--eval-interval", "4")
    fp32 = run(tmp_path / "fp32", *wide)
    int8 = run(tmp_path / "int8", *wide, "--moments", "int8")
    assert "state: " in capsys.readouterr().out
    assert (fp32["moments"], int8["moments"]) == ("fp32", "int8")
    codes = [x for x in tree_leaves(int8["state"].opt_state) if x.dtype == torch.uint8]
    assert codes and all(c.ndim >= 2 for c in codes)  # the matrices (qkv: (3, width, width))
    a, b = fp32["state_bytes"], int8["state_bytes"]
    assert a["per_param"]["opt_state"] > 7.9 and b["per_param"]["opt_state"] < 0.5 * 8
    assert a["master"] == b["master"] and a["total"] - b["total"] == a["opt_state"] - b["opt_state"]
    assert math.isfinite(int8["val_loss"])


def test_master_flag_splits_the_master_and_reports_the_bytes(tmp_path, capsys):
    """``--master split``: int16 residuals beside FP16 params (2 B/param of master), the
    same model (``master_weights`` is its FP32 master), printed and in summary.json."""
    wide = ("--width", "64", "--max-steps", "4", "--eval-interval", "4")
    fp32 = run(tmp_path / "fp32", *wide)
    split = run(tmp_path / "split", *wide, "--master", "split")
    assert "master: split" in capsys.readouterr().out
    assert (fp32["master"], split["master"]) == ("float32", "split")
    assert ff.master_form(split["state"]) == "split"
    a, b = fp32["state_bytes"]["per_param"], split["state_bytes"]["per_param"]
    assert a["master"] == 4.0 and b["master"] == 2.0 and a["opt_state"] == b["opt_state"]
    # the same training: equal but for weights below 2^-16, each kept within 2^-40
    # (docs/numerics.md); a loose bound that only a different model would break
    assert math.isfinite(split["val_loss"]) and abs(split["val_loss"] - fp32["val_loss"]) < 0.01


def test_decode_marks_ids_past_the_texts_vocabulary():
    """A model with GPT-2's vocabulary on a text of fewer characters samples ids the text
    lacks (``--preset gpt2``): decoded as U+FFFD, not an IndexError."""
    data = gpt_data.load_text(text=None, data_dir=None, download=False, synthetic=True,
                              synthetic_chars=2000, val_fraction=0.1, context=16)  # fmt: skip
    n = data.vocab_size
    assert data.decode([0, n - 1, n, 50256]) == data.chars[0] + data.chars[n - 1] + "\ufffd" * 2


def test_resume_is_bit_identical(tmp_path, capsys):
    full = resumable(tmp_path / "full")
    rows = jsonl(tmp_path / "full" / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert any(r["skipped"] for r in steps) and len({r["loss_scale"] for r in steps}) > 1
    ckpt = tmp_path / "full" / "checkpoint_step_000004.pt"
    halfway = ff.load_checkpoint(ckpt)
    assert not torch.equal(
        halfway["state"]["master"]["wte.weight"], full["state"].master["wte.weight"]
    )

    resumed = resumable(tmp_path / "resumed", "--resume", str(ckpt))
    a, b = full["state"], resumed["state"]
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert int(b.step) == 16  # micro-batches
    assert "resumed from" in capsys.readouterr().out
    # Resumed into a fresh --out-dir, the metrics and summary still cover the whole run.
    assert jsonl(tmp_path / "resumed" / "metrics.jsonl") == rows
    assert resumed["val_losses"] == full["val_losses"]
    assert resumed["skipped_at"] == full["skipped_at"]


def test_resume_refuses_other_settings_and_foreign_files(tmp_path):
    run(tmp_path / "a", "--max-steps", "2", "--eval-interval", "1", "--no-plot")
    ckpt = str(tmp_path / "a" / "checkpoint_step_000001.pt")
    with pytest.raises(SystemExit, match="lr=0.001.*lr=0.002"):
        run(tmp_path / "b", "--max-steps", "2", "--lr", "0.002", "--resume", ckpt)
    with pytest.raises(SystemExit, match="model=.*layers=1.*layers=2"):
        run(tmp_path / "b", "--max-steps", "2", "--layers", "2", "--resume", ckpt)
    ff.save_checkpoint(tmp_path / "other.pt", {"w": torch.ones(2)})
    with pytest.raises(SystemExit, match="not a checkpoint written by this example"):
        run(tmp_path / "b", "--max-steps", "2", "--resume", str(tmp_path / "other.pt"))


def test_injected_overflow_skips_backs_off_and_is_logged(tmp_path, monkeypatch, capsys):
    # A forward hook scales the logits of the 3rd and 4th training forward
    # passes up by 2^16: their FP16 gradients overflow. With the default
    # hysteresis of 2, the first overflow keeps the scale and the second
    # halves it; both steps are skipped.
    calls = {"n": 0}

    def scale_up(module, inputs, output):
        if not module.training:
            return output
        calls["n"] += 1
        return output * 2.0**16 if calls["n"] in (3, 4) else output

    build = example.build_model

    def build_with_hook(cfg, seed):
        model = build(cfg, seed)
        model.head.register_forward_hook(scale_up)
        return model

    monkeypatch.setattr(example, "build_model", build_with_hook)
    out = tmp_path / "run"
    summary = run(
        out, "--max-steps", "6", "--eval-interval", "2", "--keep-checkpoints", "0", "--no-plot"
    )
    rows = [r for r in jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["skipped"] for r in rows] == [False, False, True, True, False, False]
    scales = [r["loss_scale"] for r in rows]
    assert scales[:4] == [2.0**16] * 4 and scales[4] == 2.0**15
    assert rows[2]["loss"] > 1000 * rows[1]["loss"]  # the scaled-up logits' loss, logged
    assert summary["skipped_at"] == [3, 4] and summary["skipped_steps"] == 2
    assert summary["final_loss_scale"] == 2.0**15
    printed = capsys.readouterr().out
    assert "2 skipped steps (2 in all)" in printed
    # Each skipped row names the leaves whose gradients overflowed (the tied embedding's,
    # at least: the head that shares it had its output scaled up), and each skip prints
    # one line that names them too.
    params = set(ff.load_checkpoint(out / "checkpoint_step_000002.pt")["state"]["params"])
    for row in rows:
        if row["skipped"]:
            assert "wte.weight" in row["nonfinite"] and set(row["nonfinite"]) <= params, row
        else:
            assert "nonfinite" not in row, row
    for row in rows[2:4]:
        step = row["step"]
        line = next(x for x in printed.splitlines() if x.startswith(f"step {step}: skipped"))
        assert f"non-finite gradients in {row['nonfinite'][0]}" in line, line
    # A run resumed after the skips writes them into its metrics.jsonl as they were.
    again = tmp_path / "again"
    run(
        again, "--max-steps", "6", "--eval-interval", "2", "--keep-checkpoints", "0",
        "--no-plot", "--resume", str(out / "checkpoint_step_000004.pt"),
    )  # fmt: skip
    assert [r for r in jsonl(again / "metrics.jsonl") if "loss" in r] == rows
    # The skipped steps left the state as it was after step 2.
    before = ff.load_checkpoint(out / "checkpoint_step_000002.pt")["state"]
    after = ff.load_checkpoint(out / "checkpoint_step_000004.pt")["state"]
    for name, master in before["master"].items():
        assert torch.equal(master, after["master"][name]), name
    assert all(
        torch.equal(x, y)
        for x, y in zip(tree_leaves(before["opt_state"]), tree_leaves(after["opt_state"]))
    )


def test_tied_head_stays_tied_after_module_state_dict():
    model = tiny_model()
    params, _ = ff.split_module(model)
    assert "wte.weight" in params and "head.weight" not in params  # one tensor, listed once
    args = example.parse_args([*TINY, "--max-steps", "10", "--layers", "2"])
    policy = example.resolve_policy(args, torch.device("cpu"))
    state = example.build_state(
        model, policy, example.resolve_loss_scale(args, policy), args, "cpu"
    )
    step = example.make_train_step(model, policy, example.lr_schedule(args))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 11, (1, 4, 16), generator=g)
        state, _ = step(state, x, x.roll(-1, dims=-1))
    sd = ff.module_state_dict(model, state.master)
    assert list(sd) == list(model.state_dict())
    assert sd["head.weight"] is sd["wte.weight"] is state.master["wte.weight"]
    fresh = tiny_model(seed=1)
    fresh.load_state_dict(sd)
    assert fresh.head.weight is fresh.wte.weight
    assert torch.equal(fresh.head.weight, state.master["wte.weight"])
    # The module and the pure apply of the master compute the same logits.
    apply = ff.make_apply(model, train=False)
    x = torch.randint(0, 11, (2, 16), generator=g)
    logits, _ = apply(state.master, {}, x)
    assert torch.equal(fresh.eval()(x), logits)


def test_weight_decay_reaches_only_the_matrices():
    model = tiny_model()
    mask = model_mod.decay_mask(model)
    decayed = sorted(k for k, v in mask.items() if v)
    assert decayed == sorted(
        f"blocks.{i}.{name}.weight"
        for i in range(2)
        for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    )
    # One update with zero gradients: Adam's step is 0, so only the decay moves a master.
    args = example.parse_args([*TINY, "--max-steps", "10", "--layers", "2"])
    policy = example.resolve_policy(args, torch.device("cpu"))
    state = example.build_state(
        model, policy, example.resolve_loss_scale(args, policy), args, "cpu"
    )
    zeros = {k: torch.zeros_like(v) for k, v in state.params.items()}
    new = ff.fp16_update(state, zeros)
    lr = stock.lr_at(0, args)
    for name, master in state.master.items():
        if mask[name]:
            expected = master * (1 - lr * args.weight_decay)
            assert torch.allclose(new.master[name], expected, rtol=1e-6, atol=0), name
            assert not torch.equal(new.master[name], master), name
        else:
            assert torch.equal(new.master[name], master), name
    # The stock recipe's parameter groups are the same split.
    recipe = stock.StockGPT(model.cfg, args, torch.device("cpu"), "fp32")
    groups = [{id(p) for p in g["params"]} for g in recipe.opt.param_groups]
    named = dict(recipe.model.named_parameters())
    assert groups[0] == {id(named[k]) for k in decayed}
    assert groups[1] == {id(p) for k, p in named.items() if not mask[k]}
    assert [g["weight_decay"] for g in recipe.opt.param_groups] == [0.1, 0.0]


def test_policies_keep_norms_attention_embeddings_and_head_in_fp32():
    model = tiny_model()
    seen = {}

    def record(name):
        def hook(module, args, kwargs):
            seen[name] = args[0].dtype

        return hook

    for name in (
        "wte",
        "blocks.0.ln_1",
        "blocks.0.attn.qkv",
        "blocks.0.attn.attend",
        "blocks.0.mlp.fc",
        "ln_f",
        "head",
    ):
        model.get_submodule(name).register_forward_pre_hook(record(name), with_kwargs=True)
    policy = ff.Policy(torch.float16, torch.bfloat16, torch.float32)
    loss_fn = example.make_loss_fn(model, policy, train=True)
    params = {k: v.half() for k, v in ff.split_module(model)[0].items()}
    x = torch.randint(0, 11, (2, 16))
    grads = torch.func.grad(loss_fn)(params, x, x)
    f32, bf16 = torch.float32, torch.bfloat16
    assert seen == {
        "wte": torch.int64,
        "blocks.0.ln_1": f32,  # the residual stream
        "blocks.0.attn.qkv": bf16,
        "blocks.0.attn.attend": f32,
        "blocks.0.mlp.fc": bf16,
        "ln_f": f32,
        "head": f32,
    }
    assert all(g.dtype == torch.float16 for g in grads.values())  # FP16 gradients
    assert example.module_policies(ff.Policy(torch.float32, torch.float32, torch.float32)) == {}


def test_precision_flags(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    args = example.parse_args(["--device", "cpu"])
    for fast, compute in ((True, "bf16"), (False, "full")):
        monkeypatch.setattr(example, "cpu_has_fast_bf16", lambda fast=fast: fast)
        policy = example.resolve_policy(args, cpu)
        assert str(policy) == f"p=f16,c={compute},o=full"
        scale = example.resolve_loss_scale(args, policy)
        assert isinstance(scale, ff.DynamicLossScale) and scale.hysteresis == 2
    assert str(example.resolve_policy(example.parse_args([]), cuda)).startswith("p=f16,c=f16")
    for flag, name in (("bf16", "bf16"), ("fp32", "full")):
        policy = example.resolve_policy(example.parse_args(["--precision", flag]), cpu)
        assert str(policy) == f"p={name},c={name},o=full"
        assert isinstance(
            example.resolve_loss_scale(example.parse_args([]), policy), ff.NoOpLossScale
        )


def test_schedule_is_the_stock_recipes_formula():
    args = example.parse_args(["--max-steps", "2000"])
    schedule = example.lr_schedule(args)
    for t in (0, 1, 50, 99, 100, 101, 700, 1999, 2000, 2600):
        want = stock.lr_at(t, args)
        assert float(schedule(torch.tensor(t, dtype=torch.int32))) == pytest.approx(want, rel=1e-7)
    assert stock.lr_at(100, args) == pytest.approx(1e-3) and stock.lr_at(
        2000, args
    ) == pytest.approx(1e-4)
    assert stock.lr_at(0, args) == pytest.approx(1e-5)


def test_presets_and_the_124m_configuration():
    args = example.parse_args(["--preset", "gpt2"])
    assert (args.layers, args.heads, args.width, args.context) == (12, 12, 768, 1024)
    assert (args.batch_size, args.max_steps) == (8, 1)
    cfg = example.model_config(args, vocab_size=65)
    with torch.device("meta"):
        model = model_mod.GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small
    small = example.parse_args(["--preset", "gpt2", "--layers", "2", "--batch-size", "4"])
    assert (small.layers, small.width, small.batch_size) == (2, 768, 4)
    defaults = example.parse_args([])
    assert (defaults.layers, defaults.heads, defaults.width, defaults.context) == (4, 4, 128, 128)
    assert (defaults.batch_size, defaults.max_steps, defaults.eval_interval) == (32, 2000, 250)


def test_nanogpt_initialisation():
    model = tiny_model()
    std = {n: float(p.detach().std()) for n, p in model.named_parameters()}
    assert std["blocks.0.attn.qkv.weight"] == pytest.approx(0.02, rel=0.1)
    assert std["blocks.1.mlp.proj.weight"] == pytest.approx(0.02 / math.sqrt(4), rel=0.1)
    assert torch.equal(model.blocks[0].ln_1.weight, torch.ones(32))
    assert not model.blocks[0].attn.qkv.bias.any()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), tiny_model().parameters()))


def test_text_file_and_the_synthetic_fallback(tmp_path, capsys):
    text = tmp_path / "play.txt"
    text.write_text("To be, or not to be: that is the question.\n" * 60, encoding="utf-8")
    common = ["--max-steps", "2", "--eval-interval", "2", "--no-plot", "--sample-chars", "0"]
    args = [a for a in TINY if a not in ("--synthetic", "--synthetic-chars", "6000")]
    summary = example.main([*args, "--text", str(text), "--out-dir", str(tmp_path / "a"), *common])
    assert summary["dataset"] == "play.txt" and not summary["synthetic"]
    assert summary["model"]["vocab_size"] == len(set(text.read_text()))
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1].startswith("validation loss on play.txt after 2")
    # No text and nothing to find: one line says so, and the final line says "synthetic".
    empty = tmp_path / "nothing"
    example.main(
        [
            *args,
            "--synthetic-chars",
            "6000",
            "--data-dir",
            str(empty),
            "--out-dir",
            str(tmp_path / "b"),
            *common,
        ]
    )
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "SYNTHETIC" in line]
    assert len(notes) == 1 and "--download" in notes[0]
    assert "synthetic" in captured.out.strip().splitlines()[-1]
    with pytest.raises(SystemExit, match="no such file"):
        example.main([*args, "--text", str(tmp_path / "missing.txt"), "--out-dir", str(tmp_path)])


def test_stock_recipe_trains_the_same_model_on_the_same_batches(tmp_path):
    common = [*TINY[:-6], "--max-steps", "6", "--eval-interval", "3"]
    ours = example.main(
        [
            *common,
            "--precision",
            "fp32",
            "--device",
            "cpu",
            "--no-progress",
            "--no-plot",
            "--sample-chars",
            "0",
            "--out-dir",
            str(tmp_path / "ours"),
        ]
    )
    theirs = stock.main(
        [*common, "--precision", "fp32", "--device", "cpu", "--out-dir", str(tmp_path / "stock")]
    )
    a = [r for r in jsonl(tmp_path / "ours" / "metrics.jsonl") if "loss" in r]
    b = [r for r in jsonl(tmp_path / "stock" / "metrics.jsonl") if "loss" in r]
    # Same initialisation and first batch: the same first loss, to rounding.
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-6)
    for x, y in zip(a, b, strict=True):
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-6)
        assert x["loss"] == pytest.approx(y["loss"], rel=2e-3)
    assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=2e-3)
    assert theirs["parameters"] == ours["parameters"]


def test_bad_flags_are_rejected(capsys):
    for argv, message in (
        (["--width", "30", "--heads", "4"], "divisible by --heads"),
        (["--warmup-steps", "10", "--max-steps", "10"], "below --max-steps"),
        (["--grad-accum", "0"], "--grad-accum must be >= 1"),
        (["--min-lr", "1", "--lr", "0.1"], "must not exceed --lr"),
        (["--tp", "2"], "--tp needs --fsdp"),
        (["--fsdp", "--tp", "0"], "--tp must be at least 1"),
    ):
        with pytest.raises(SystemExit):
            example.parse_args(argv)
        assert message in capsys.readouterr().err


def test_nn_module_subclasses_name_the_fp32_islands():
    islands = example.module_policies(ff.Policy(torch.float16, torch.float16, torch.float32))
    for cls in (nn.LayerNorm, model_mod.CausalAttention, nn.Embedding, model_mod.TiedHead):
        assert cls in islands and islands[cls].compute_dtype == torch.float32
    assert islands[model_mod.CausalAttention].output_dtype == torch.float16
    assert islands[model_mod.TiedHead].output_dtype == torch.float32


def test_benchmark_alternates_the_sides_and_prints_its_table(monkeypatch, capsys):
    # Each round's worker runs in this process, from the command line its
    # process would get; the glibc setting it would make is recorded instead.
    bench = load_module(EXAMPLES.parent / "benchmarks" / "bench_gpt_vs_stock.py", "bench_gpt")
    ran, tuned = [], []
    monkeypatch.setattr(ff, "tune_malloc", lambda: tuned.append(True) or False)

    def in_process(args, side):
        cmd = bench.side_command(args, side)
        assert cmd[1].endswith("bench_gpt_vs_stock.py")
        with contextlib.redirect_stdout(io.StringIO()) as out:
            bench.worker(bench.parser().parse_args(cmd[2:]))
        ran.append(side)
        return json.loads(out.getvalue().strip().splitlines()[-1])

    monkeypatch.setattr(bench, "run_side", in_process)
    tiny = [*SIZE[:-2], "--batch-size", "4", "--rounds", "2", "--steps", "2", "--warmup", "1"]
    assert bench.main([*tiny, "--fp32"]) == 0
    sides = ["example", "stock", "stock-tuned", "stock-fp32"]
    assert ran == sides + sides[::-1]
    assert len(tuned) == 4  # the example's two rounds and stock-tuned's
    table = capsys.readouterr().out
    assert "layers 1, heads 2, width 32, context 16, batch size 4; 2 rounds of 2 steps" in table
    for label in (
        "example (functional FP16, defaults)",
        "stock recipe (autocast)",
        "stock recipe, FP32",
    ):
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        assert len(row.split(" | ")[2].split(", ")) == 2  # every round
    assert "**example / stock: " in table and "example / stock FP32: " in table


def test_the_compiled_forward_and_backward_trace_as_one_graph():
    # What --compile relies on: the gradient function (casts, per-module
    # policies, torch.func) is one graph. The eager backend checks tracing
    # without code generation; the update stays eager.
    args = example.parse_args([*TINY, "--max-steps", "10"])
    policy = example.resolve_policy(args, torch.device("cpu"))
    model = tiny_model()
    state = example.build_state(
        model, policy, example.resolve_loss_scale(args, policy), args, "cpu"
    )
    grad_fn = ff.scaled_grad_and_value(example.make_loss_fn(model, policy, train=True))
    x = torch.randint(0, 11, (4, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(grad_fn, fullgraph=True, backend="eager")
    grads, loss = compiled(state.loss_scale, state.params, x, x.roll(-1, dims=-1))
    want_grads, want_loss = grad_fn(state.loss_scale, state.params, x, x.roll(-1, dims=-1))
    assert torch.equal(loss, want_loss)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_train_like_one_process(tmp_path):
    common = [*TINY, "--precision", "fp32", "--max-steps", "4", "--eval-interval", "2", "--no-plot"]
    one = example.main([*common, "--out-dir", str(tmp_path / "one")])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "gpt_functional.py"),
            *common,
            "--distributed",
            "--out-dir",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a bound for a slow shared machine, not a timing assertion
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("step 2/4:") == 1  # rank 0 alone prints
    assert "global batch 8 = 4 per rank" in proc.stdout
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    a, b = jsonl(tmp_path / "one" / "metrics.jsonl"), jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [sorted(r) for r in a] == [sorted(r) for r in b] and len(a) == 6
    for x, y in zip(a, b):  # the ranks' mean loss is the whole batch's; evaluation is split
        key = "loss" if "loss" in x else "val_loss"
        assert x[key] == pytest.approx(y[key], rel=1e-5)
    state = ff.load_checkpoint(tmp_path / "two" / "checkpoint_step_000004.pt")["state"]
    # Elementwise within 1 % of the learning rate: Adam turns the rounding
    # noise of a zero gradient (the keys' bias) into steps of up to lr.
    for name, master in one["state"].master.items():
        assert (state["master"][name] - master).abs().max() <= 1e-5, name


def _torchrun(args: list[str], ranks: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(EXAMPLES / "gpt_functional.py"), *args],
        env=env, capture_output=True, text=True,
        timeout=300,  # a bound for a slow shared machine, not a timing assertion
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_trains_checkpoints_on_dcp_and_resumes_bit_identically(tmp_path):
    common = [*TINY, "--fsdp", "--eval-batches", "2", "--log-every", "1", "--eval-interval", "3"]
    whole = _torchrun([*common, "--max-steps", "6", "--out-dir", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "FSDP2 over 2 ranks (gloo)" in whole.stdout and "update path fused" in whole.stdout
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    rows = jsonl(tmp_path / "whole" / "metrics.jsonl")
    assert summary["world_size"] == 2 and len(rows) == 6
    assert rows[-1]["loss"] < rows[0]["loss"] and math.isfinite(summary["val_loss"])
    assert (tmp_path / "whole" / "dcp_final" / ".metadata").exists()
    # Resume from the checkpoint the run wrote after 3 of its 6 steps.
    rest = _torchrun([*common, "--max-steps", "6", "--resume",
                      str(tmp_path / "whole" / "dcp_step_000003"), "--out-dir", str(tmp_path / "c")])  # fmt: skip
    assert rest.returncode == 0, rest.stdout + rest.stderr
    resumed = jsonl(tmp_path / "c" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert resumed == rows[3:]  # losses, scales and decisions, exactly
    end = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert end["val_loss"] == summary["val_loss"]
    # A scale of 2^24 overflows the FP16 gradients: each skip names the leaves, once, on rank 0.
    storm = _torchrun([*common, "--max-steps", "2", "--init-scale", str(2.0**24),
                       "--out-dir", str(tmp_path / "s")])  # fmt: skip
    assert storm.returncode == 0, storm.stdout + storm.stderr
    skipped = jsonl(tmp_path / "s" / "metrics.jsonl")
    assert [r["skipped"] for r in skipped] == [True, True]
    assert all("wte.weight" in r["nonfinite"] for r in skipped), skipped
    for step in (1, 2):
        lines = [x for x in storm.stdout.splitlines() if x.startswith(f"step {step}: skipped")]
        assert len(lines) == 1 and "non-finite gradients in" in lines[0], storm.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_with_int8_moments_resumes_on_another_number_of_ranks(tmp_path):
    """Block codes and their scales are DTensors sharded by rows: DCP saves them at 2 ranks
    and loads them at 2 or at 1, and the run goes on exactly as it would have."""
    common = [*TINY, "--width", "64", "--fsdp", "--moments", "int8", "--eval-batches", "2",
              "--log-every", "1", "--eval-interval", "3", "--max-steps", "6"]  # fmt: skip
    whole = _torchrun([*common, "--out-dir", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stdout + whole.stderr
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["moments"] == "int8" and summary["state_bytes"]["per_param"]["opt_state"] < 4
    rows = jsonl(tmp_path / "whole" / "metrics.jsonl")
    for ranks in (2, 1):
        out = tmp_path / f"resumed_{ranks}"
        rest = _torchrun(
            [*common, "--resume", str(tmp_path / "whole" / "dcp_step_000003"), "--out-dir",
             str(out)], ranks=ranks,
        )  # fmt: skip
        assert rest.returncode == 0, rest.stdout + rest.stderr
        resumed = jsonl(out / "metrics.jsonl")
        end = json.loads((out / "summary.json").read_text())["val_loss"]
        if ranks == 2:
            assert resumed == rows[3:] and end == summary["val_loss"]
        else:  # the loaded state is exact: step 4's row is the same but for its loss,
            # which one rank sums over the batch's tokens in another order than the mean of
            # two ranks' halves. Each order's float32 sum of n positive per-token losses is
            # within (n - 1) u of the exact mean (u = 2^-24), so the two are within
            # 2 n u of each other (n = batch x context tokens); later steps agree to rounding.
            tokens = 8 * 16  # --batch-size x --context of SIZE
            first, want = resumed[0], rows[3]
            assert {k: v for k, v in first.items() if k != "loss"} == {
                k: v for k, v in want.items() if k != "loss"
            }
            assert abs(first["loss"] - want["loss"]) <= 2 * tokens * 2.0**-24 * want["loss"]
            for a, b in zip(resumed, rows[3:], strict=True):
                assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-4
            assert abs(end - summary["val_loss"]) < 1e-3


def test_download_checks_the_file_and_keeps_it_once(tmp_path, monkeypatch):
    data_mod = sys.modules["gpt_data"]
    blob = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 50).encode()
    served = []

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def urlopen(url, timeout):
        served.append(url)
        return Response(blob)

    monkeypatch.setattr(data_mod.urllib.request, "urlopen", urlopen)
    kwargs = {"text": None, "data_dir": tmp_path, "context": 16}
    # Not the expected size and digest: refused, nothing kept.
    with pytest.raises(data_mod.DataError, match="not Tiny Shakespeare.*nothing was kept"):
        data_mod.load_text(download=True, **kwargs)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(data_mod, "SHAKESPEARE_BYTES", len(blob))
    monkeypatch.setattr(data_mod, "SHAKESPEARE_SHA256", hashlib.sha256(blob).hexdigest())
    data = data_mod.load_text(download=True, **kwargs)
    assert data.source == "tinyshakespeare" and not data.synthetic
    assert data.describe() == "Tiny Shakespeare"
    assert (tmp_path / "tinyshakespeare.txt").read_bytes() == blob
    again = data_mod.load_text(download=True, **kwargs)  # read from data_dir, not fetched
    assert len(served) == 2 and torch.equal(again.train, data.train)
    assert data.decode(torch.cat([data.train, data.val]).tolist()) == blob.decode()

    def offline(url, timeout):
        raise data_mod.urllib.error.URLError("no network")

    monkeypatch.setattr(data_mod.urllib.request, "urlopen", offline)
    with pytest.raises(data_mod.DataError, match="--download failed .*no network"):
        data_mod.load_text(download=True, **{**kwargs, "data_dir": tmp_path / "empty"})


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_with_tensor_parallelism_trains_and_resumes_under_another_layout(tmp_path):
    """``--fsdp --tp 2`` at 4 ranks: a 2 x 2 mesh, torchtitan's plan inside each pair,
    FSDP2 across, each data-parallel pair its half of the batch; it trains, and its DCP
    checkpoint resumes under FSDP2 alone at 2 ranks, where step 4's loss (computed from
    the loaded parameters) agrees to rounding. (Its numbers against one process are
    ``tests/test_dtensor.py``'s.)"""
    common = [*TINY, "--fsdp", "--eval-batches", "2", "--log-every", "1", "--eval-interval",
              "3", "--max-steps", "6"]  # fmt: skip
    tp = _torchrun([*common, "--tp", "2", "--out-dir", str(tmp_path / "tp")], ranks=4)
    assert tp.returncode == 0, tp.stdout + tp.stderr
    assert "FSDP2 over 2 x 2 mesh (FSDP2 x tensor parallel) (gloo)" in tp.stdout
    assert "update path fused" in tp.stdout
    summary = json.loads((tmp_path / "tp" / "summary.json").read_text())
    assert (summary["world_size"], summary["tp"]) == (4, 2)
    rows = jsonl(tmp_path / "tp" / "metrics.jsonl")
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    assert math.isfinite(summary["val_loss"])
    rest = _torchrun(
        [*common, "--resume", str(tmp_path / "tp" / "dcp_step_000003"), "--out-dir",
         str(tmp_path / "resumed")], ranks=2,
    )  # fmt: skip
    assert rest.returncode == 0, rest.stdout + rest.stderr
    resumed = jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert abs(resumed[0]["loss"] - rows[3]["loss"]) < 5e-3
    assert resumed[0]["loss_scale"] == rows[3]["loss_scale"]
