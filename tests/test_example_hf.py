"""End-to-end tests of examples/hf_gpt2_functional.py: a tiny Hugging Face GPT-2, offline.

Built from a config (no download): one layer of width 32, context 16, batches
of 4, a few steps on generated text, on the CPU, in-process through ``main``.
"""

import json

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves
from tests.helpers import load_example

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

example = load_example("hf_gpt2_functional")

TINY = [
    "--synthetic",
    "--synthetic-chars",
    "4000",
    "--layers",
    "1",
    "--heads",
    "2",
    "--width",
    "32",
    "--context",
    "16",
    "--batch-size",
    "4",
    "--device",
    "cpu",
    "--no-progress",
    "--no-tune-malloc",
    "--no-plot",
    "--eval-batches",
    "2",
]


def run(out, *extra):
    return example.main([*TINY, "--out-dir", str(out), *extra])


def test_trains_keeps_the_tie_and_saves_a_model_from_pretrained_loads(tmp_path, capsys):
    summary = run(tmp_path / "run", "--max-steps", "4", "--eval-interval", "2")
    out = capsys.readouterr().out
    assert "update path: fused" in out and "tied wte/lm_head" in out
    state = summary["state"]
    assert "lm_head.weight" not in state.master  # the tied head is the embedding itself
    losses = summary["val_losses"]
    assert len(losses) == 2 and losses[1][1] < losses[0][1]  # it learns
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "hf_model")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    weights = dict(loaded.named_parameters())
    for name, master in state.master.items():
        assert torch.equal(weights[name], master), name  # the FP32 master, bit for bit
    # The reloaded model, run the stock way, gives the loss the functional run measured.
    x = torch.randint(
        0, loaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    masked = loaded(x, attention_mask=torch.ones_like(x)).logits
    assert torch.equal(masked, loaded(x).logits)


def test_resume_is_bit_identical(tmp_path, capsys):
    full = run(tmp_path / "full", "--max-steps", "4", "--eval-interval", "2", "--grad-accum", "2")
    ckpt = tmp_path / "full" / "checkpoint_step_000002.pt"
    resumed = run(
        tmp_path / "resumed",
        "--max-steps", "4", "--eval-interval", "2", "--grad-accum", "2", "--resume", str(ckpt),
    )  # fmt: skip
    assert "resumed from" in capsys.readouterr().out
    for a, b in zip(tree_leaves(full["state"]), tree_leaves(resumed["state"]), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert resumed["val_losses"] == full["val_losses"]


def test_compare_stock_reports_both_runs(tmp_path, capsys):
    summary = run(tmp_path / "cmp", "--max-steps", "3", "--eval-interval", "3", "--compare-stock")
    out = capsys.readouterr().out
    assert "stock:" in out and "functional - stock" in out
    stock = summary["stock"]
    assert abs(stock["val_loss"] - summary["val_loss"]) < 0.05  # the same recipe, 3 steps
    assert stock["tokens_per_s"] > 0


def test_policies_put_attention_norms_embeddings_and_head_in_fp32():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    policy = ff.get_policy("p=f16,c=bf16,o=f32")
    islands = example.module_policies(policy)
    assert islands[GPT2Attention].compute_dtype == torch.float32
    assert islands[torch.nn.LayerNorm].compute_dtype == torch.float32
    assert islands[torch.nn.Embedding].output_dtype == torch.float32
    assert islands[torch.nn.Linear].output_dtype == torch.float32
    assert example.module_policies(ff.get_policy("p=f32,c=f32,o=f32")) == {}
    mask = example.decay_mask(
        {"transformer.wte.weight": torch.zeros(3, 2), "transformer.h.0.attn.c_attn.weight":
         torch.zeros(2, 6), "transformer.h.0.ln_1.bias": torch.zeros(2)}
    )  # fmt: skip
    assert mask == {
        "transformer.wte.weight": False,
        "transformer.h.0.attn.c_attn.weight": True,
        "transformer.h.0.ln_1.bias": False,
    }


def test_pretrained_unavailable_is_a_clear_error(tmp_path, monkeypatch):
    """What an offline machine gets from the Hub (no network is used here)."""

    def offline(name, *args, **kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", offline)
    with pytest.raises(SystemExit, match="cannot load 'gpt2' from the Hugging Face Hub"):
        run(tmp_path / "p", "--max-steps", "2", "--pretrained", "gpt2")
