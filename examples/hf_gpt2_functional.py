"""Train a Hugging Face GPT-2 (``GPT2LMHeadModel``) in FP16 mixed precision, functionally.

The model is ``transformers``' own; ``functional_fp16`` only takes its
parameters apart and puts them back:

* ``split_module(model)`` gives a dict of its parameters (the tied
  ``transformer.wte.weight`` / ``lm_head.weight`` once, under the first name),
  ``fp16_init`` an ``FP16State`` with FP16 parameters and FP32 master copies;
* ``make_apply(model, policy=..., module_policies=...)`` runs the module's own
  ``forward`` on them with ``torch.func.functional_call`` (the tie kept). The
  LayerNorms, the attention (``GPT2Attention``: its logits and softmax), the
  embeddings and the tied head run in FP32; the rest computes in the policy's
  dtype;
* the optimiser is the transformer recipe: ``clip_by_global_norm`` + ``adamw``
  with weight decay on the weight matrices only (not the embeddings, biases and
  norms), a warmup-cosine schedule, and ``MultiSteps`` for gradient
  accumulation; the step is ``fp16_update`` with dynamic loss scaling;
* at the end ``module_state_dict`` loads the FP32 master weights into a fresh
  ``GPT2LMHeadModel``, which ``save_pretrained`` writes to ``OUT/hf_model``:
  ``GPT2LMHeadModel.from_pretrained(OUT/hf_model)`` loads it.

The training loop, checkpoints (``--resume`` continues bit-identically),
``metrics.jsonl``, the progress bar and ``training.png`` are the GPT
example's (``gpt_loop.py``, ``gpt_outputs.py``). With ``--compare-stock`` the
same model, batches and recipe are trained once more the stock way
(``torch.autocast`` with ``torch.optim.AdamW(fused=True)``, plus
``torch.amp.GradScaler`` when the autocast dtype is FP16), and both
validation losses and throughputs are printed and written to
``summary.json``.

    python examples/hf_gpt2_functional.py --data-file ../shared/data/tinyshakespeare.txt
    python examples/hf_gpt2_functional.py --synthetic --max-steps 20       # seconds, offline
    python examples/hf_gpt2_functional.py --data-file F --compare-stock     # against stock
    python examples/hf_gpt2_functional.py --config gpt2 --device cuda       # GPT-2 small's shape
    python examples/hf_gpt2_functional.py --pretrained gpt2 --data-file F   # downloads, if asked

By default nothing is downloaded: ``--config tiny`` (2 layers, 4 heads, width
128) or ``gpt2`` (GPT-2 small's 12 x 12 x 768) is built from a config, on
the text's characters as its vocabulary. ``--pretrained NAME`` fetches the
checkpoint and its tokenizer from the Hugging Face Hub (or its cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt_cli  # noqa: E402
import gpt_data  # noqa: E402
import gpt_functional as gpt  # noqa: E402
import run_cli  # noqa: E402
from gpt_loop import fit  # noqa: E402
from gpt_outputs import load_resume, plot_metrics, run_config  # noqa: E402
from run_outputs import state_bytes, summary_head, write_summary  # noqa: E402
from run_setup import load_data_once, make_out_dir, start_run, synchronize  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16.bridge import make_apply, module_state_dict, split_module  # noqa: E402
from functional_fp16.precision.policy import Policy  # noqa: E402

CONFIGS = {
    "tiny": {"layers": 2, "heads": 4, "width": 128, "context": 128},
    "gpt2": {"layers": 12, "heads": 12, "width": 768, "context": 1024},
}
"""The models ``--config`` builds offline (on the text's characters as the vocabulary)."""

DEFAULTS = {"batch_size": 16, "max_steps": 300}


class ModelConfig(NamedTuple):
    """What the run's model is (recorded in checkpoints; a resume must match it)."""

    name: str  # "tiny", "gpt2" or the --pretrained name
    layers: int
    heads: int
    width: int
    context: int
    vocab_size: int


# -- flags -------------------------------------------------------------------------


def _job_flags(o: argparse._ArgumentGroup) -> None:
    o.add_argument(
        "--compare-stock",
        action="store_true",
        help="train the same model on the same batches the stock way too (torch.autocast + "
        "AdamW(fused), GradScaler with FP16) and print both results",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's settings; ``--help`` lists them."""
    p = argparse.ArgumentParser(
        description="Train a Hugging Face GPT-2 with functional FP16 mixed precision.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data")
    gpt_cli.add_data_flags(d)
    d.add_argument("--data-file", dest="text", metavar="PATH", help="the same as --text")
    m = p.add_argument_group("model")
    m.add_argument("--config", choices=sorted(CONFIGS), default="tiny", help="built offline")
    m.add_argument(
        "--pretrained",
        default=None,
        metavar="NAME",
        help="start from this Hub checkpoint and its tokenizer (downloads unless cached)",
    )
    m.add_argument("--layers", type=int, default=None, help="blocks (default: --config's)")
    m.add_argument("--heads", type=int, default=None, help="attention heads (--config's)")
    m.add_argument("--width", type=int, default=None, help="n_embd (--config's)")
    m.add_argument("--context", type=int, default=None, help="sequence length in tokens")
    m.add_argument("--dropout", type=float, default=0.0)
    gpt_cli.add_training_flags(p.add_argument_group("training"))
    gpt_cli.add_precision_flags(p.add_argument_group("precision and device"))
    run_cli.add_output_flags(
        p.add_argument_group("output"),
        out_dir="runs/hf_gpt2",
        resume_help="continue from a checkpoint of this script",
        keep_help="keep only the newest N checkpoints (0: keep all)",
        job_flags=_job_flags,
    )
    p.set_defaults(eval_interval=100)
    args = p.parse_args(argv)
    shape = CONFIGS[args.config]
    for key, value in {**shape, **DEFAULTS}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.warmup_steps is None:
        args.warmup_steps = min(100, args.max_steps // 10)
    args.grad_accum = max(args.grad_accum, 1)
    gpt_cli.check_args(p, args)
    if args.distributed:
        p.error("--distributed is the GPT example's; this one runs in one process")
    return args


# -- the model ---------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - the hf extra installs it
        raise SystemExit("this example needs transformers: pip install -e '.[hf]'") from err
    return transformers


def from_hub(load: Callable[[str], Any], name: str) -> Any:
    """``load(name)`` (a ``from_pretrained``), with a one-line error when it cannot be had."""
    try:
        return load(name)
    except OSError as err:
        raise SystemExit(
            f"cannot load {name!r} from the Hugging Face Hub or its cache "
            f"(offline?): {str(err).splitlines()[0]}"
        ) from err


def build_model(args: argparse.Namespace, vocab_size: int) -> tuple[nn.Module, ModelConfig]:
    """A ``GPT2LMHeadModel``: from ``--pretrained`` (the Hub), else from ``--config`` offline."""
    tf = _transformers()
    if args.pretrained:
        model = from_hub(tf.GPT2LMHeadModel.from_pretrained, args.pretrained)
        c = model.config
        return model, ModelConfig(
            args.pretrained, c.n_layer, c.n_head, c.n_embd, args.context, c.vocab_size
        )
    cfg = tf.GPT2Config(
        vocab_size=vocab_size,
        n_positions=args.context,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    model = tf.GPT2LMHeadModel(cfg)
    info = ModelConfig(args.config, args.layers, args.heads, args.width, args.context, vocab_size)
    return model, info


def module_policies(policy: Policy) -> dict[type[nn.Module], Policy]:
    """Which of the model's modules run in FP32 when it computes in FP16 or BF16.

    * ``nn.LayerNorm`` (:func:`~functional_fp16.default_module_policies`) and
      ``GPT2Attention`` (:func:`~functional_fp16.norm_policy`: inputs and
      parameters in FP32, outputs back in the compute dtype), where the
      attention logits and their softmax would overflow FP16;
    * ``nn.Embedding`` and ``nn.Linear`` (in GPT-2 only the tied ``lm_head``:
      its other layers are ``Conv1D``), FP32 in and out, so the logits reach the
      cross-entropy in FP32 and the residual stream is FP32.
    """
    islands = ff.default_module_policies(policy)
    if islands:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

        islands[GPT2Attention] = ff.norm_policy(policy)
        full = Policy(policy.param_dtype, torch.float32, torch.float32)
        islands[nn.Embedding] = full
        islands[nn.Linear] = full
    return islands


def decay_mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Weight decay on the weight matrices only: not the embeddings, biases or norms."""
    return {
        k: p.ndim >= 2 and not k.endswith(("wte.weight", "wpe.weight")) for k, p in params.items()
    }


def make_loss_fns(model: nn.Module, policy: Policy, buffers: dict) -> tuple[Callable, Callable]:
    r"""``(train_loss, eval_sum)``: the mean and the summed cross-entropy of the FP32 logits.

    .. math:: L = -\frac{1}{BT} \sum_{b,t} \log \operatorname{softmax}(z_{b,t})_{y_{b,t}}
    """
    islands = module_policies(policy)
    train = make_apply(model, train=True, policy=policy, module_policies=islands)
    evaluate = make_apply(model, train=False, policy=policy, module_policies=islands)

    def logits(apply, params, inputs):
        out, _ = apply(params, buffers, inputs)
        return out.logits.flatten(0, 1).float()

    def train_loss(params, inputs, targets):
        return F.cross_entropy(logits(train, params, inputs), targets.flatten())

    def eval_sum(params, inputs, targets):
        return F.cross_entropy(logits(evaluate, params, inputs), targets.flatten(), reduction="sum")

    return train_loss, eval_sum


# -- the text ----------------------------------------------------------------------


def load_data(args: argparse.Namespace) -> gpt_data.TextData:
    """The text as characters (``--config``) or as the pretrained tokenizer's ids."""
    data = gpt_data.load_text(
        text=args.text,
        data_dir=args.data_dir,
        download=args.download,
        synthetic=args.synthetic,
        synthetic_chars=args.synthetic_chars,
        val_fraction=args.val_fraction,
        context=args.context,
    )
    if not args.pretrained:
        return data
    tokenizer = from_hub(_transformers().AutoTokenizer.from_pretrained, args.pretrained)
    text = data.decode(torch.cat([data.train, data.val]).tolist())
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
    n_val = max(int(len(ids) * args.val_fraction), args.context + 1)
    vocab = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    return data._replace(train=ids[:-n_val], val=ids[-n_val:], chars=vocab)


# -- the stock recipe --------------------------------------------------------------


def train_stock(args, data, policy, device, evaluate_batches: int) -> dict:
    """The same model, batches and recipe, the stock way: FP32 parameters under
    ``torch.autocast(compute dtype)``, ``AdamW(fused=True)`` with the same parameter
    groups and schedule (``LambdaLR``), ``clip_grad_norm_``, ``GradScaler`` for FP16.
    Returns the final validation loss and the training tokens/s."""
    model, _ = build_model(args, data.vocab_size)
    model = model.to(device).train()
    params = dict(model.named_parameters())
    mask = decay_mask(params)
    groups = [
        {"params": [p for k, p in params.items() if mask[k]], "weight_decay": args.weight_decay},
        {"params": [p for k, p in params.items() if not mask[k]], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, fused=True
    )
    schedule = gpt.lr_schedule(args)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: float(schedule(torch.tensor(t, dtype=torch.int32))) / args.lr
    )
    compute = policy.compute_dtype
    amp = compute != torch.float32
    scaler = torch.amp.GradScaler(device.type, enabled=compute == torch.float16)
    rng = torch.Generator().manual_seed(args.seed)
    train = data.train.to(device)
    tokens = args.batch_size * args.grad_accum * args.context * args.max_steps
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.max_steps):
        for _ in range(args.grad_accum):
            x, y = gpt_data.sample_batch(train, rng, args.batch_size, args.context)
            with torch.autocast(device.type, dtype=compute, enabled=amp):
                logits = model(x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / args.grad_accum
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
    synchronize(device)
    seconds = time.perf_counter() - t0
    model.eval()
    inputs, targets = (t.to(device) for t in gpt_data.val_windows(data.val, args.context))
    n = (
        inputs.shape[0]
        if not evaluate_batches
        else min(inputs.shape[0], evaluate_batches * args.batch_size)
    )
    total = 0.0
    with torch.no_grad(), torch.autocast(device.type, dtype=compute, enabled=amp):
        for s in range(0, n, args.batch_size):
            logits = model(inputs[s : s + args.batch_size]).logits
            total += float(
                F.cross_entropy(
                    logits.flatten(0, 1).float(),
                    targets[s : s + args.batch_size].flatten(),
                    reduction="sum",
                )
            )
    return {"val_loss": total / (n * args.context), "tokens_per_s": tokens / seconds}


# -- the run -----------------------------------------------------------------------


def save_model(model: nn.Module, state: ff.FP16State, buffers: dict, path) -> None:
    """The FP32 master weights, in a fresh copy of ``model``, written by ``save_pretrained``."""
    fresh = type(model)(model.config)
    fresh.load_state_dict(module_state_dict(fresh, ff.master_weights(state), buffers))
    fresh.save_pretrained(path)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example; returns a summary dict (also written to ``summary.json``)."""
    args = parse_args(argv)
    _, device = start_run(args)
    policy = gpt.resolve_policy(args, device)
    loss_scale = gpt.resolve_loss_scale(args, policy)
    data = load_data_once(None, args.download, lambda: load_data(args), gpt_data.DataError)
    out_dir = make_out_dir(args.out_dir)
    model, cfg = build_model(args, data.vocab_size)
    model = model.to(device)
    params, buffers = split_module(model)
    tx = gpt.build_optimizer(args, decay_mask(params))
    state = ff.fp16_init(params, tx, loss_scale, param_dtype=policy.param_dtype, master=args.master)
    n_params = sum(p.numel() for p in state.params.values())
    print(
        f"data: {'SYNTHETIC text' if data.synthetic else data.describe()}, "
        f"{data.train.numel()} train / {data.val.numel()} validation tokens, "
        f"vocabulary {data.vocab_size}",
        flush=True,
    )
    print(
        f"model: GPT2LMHeadModel ({cfg.name}): {cfg.layers} layers, {cfg.heads} heads, width "
        f"{cfg.width}, context {cfg.context}, {n_params} parameters (tied wte/lm_head); batch "
        f"{args.batch_size} x {args.grad_accum} micro-batches",
        flush=True,
    )
    print(
        f"device: {device}, policy: {policy}, update path: {ff.update_path(state)}, "
        f"moments: {args.moments}, master: {args.master}",
        flush=True,
    )
    stored_bytes = state_bytes(state)
    train_loss, eval_sum = make_loss_fns(model, policy, buffers)
    train_step = gpt.make_train_step(
        model, policy, gpt.lr_schedule(args), compiled=args.compile, loss_fn=train_loss
    )
    config = run_config(args, policy, data, cfg)
    data_rng = torch.Generator().manual_seed(args.seed)
    start = {"step": 0, "rows": [], "evals": []}
    if args.resume:
        ckpt = load_resume(args.resume, state, config)
        state = ckpt["state"]
        data_rng.set_state(ckpt["data_rng"])
        start = {"step": ckpt["step"], "rows": ckpt["rows"], "evals": ckpt["evals"]}
        print(f"resumed from {args.resume} at step {ckpt['step']}", flush=True)
    result = fit(args, data, state, train_step, eval_sum, device, config, data_rng, start)
    state = result["state"]
    save_model(model, state, buffers, out_dir / "hf_model")
    evals = result["evals"]
    val_loss = evals[-1][1] if evals else float("nan")
    skipped_at = [r["step"] for r in result["rows"] if r["skipped"]]
    summary = {
        "moments": args.moments,
        "master": args.master,
        "state_bytes": stored_bytes,
        **summary_head(args, data, device, policy),
        "model": cfg._asdict(),
        "parameters": n_params,
        "steps": result["step"],
        "val_loss": val_loss,
        "val_losses": [[step, loss] for step, loss in evals],
        "train_tokens_per_s": result["tokens_per_s"],
        "final_loss_scale": float(state.loss_scale.loss_scale),
        "skipped_steps": len(skipped_at),
        "skipped_at": skipped_at,
        "loss_scale_stats": ff.loss_scale_stats(state),
        "hf_model": str(out_dir / "hf_model"),
    }
    print(
        f"functional: validation loss {val_loss:.4f} after {result['step']} steps, "
        f"{result['tokens_per_s']:.0f} tokens/s ({device}, {policy})",
        flush=True,
    )
    if args.compare_stock:
        stock = train_stock(args, data, policy, device, args.eval_batches)
        summary["stock"] = stock
        print(
            f"stock:      validation loss {stock['val_loss']:.4f} after {args.max_steps} steps, "
            f"{stock['tokens_per_s']:.0f} tokens/s (torch.autocast({policy.compute_dtype}) + "
            f"AdamW(fused)); functional - stock: {val_loss - stock['val_loss']:+.4f} nats, "
            f"{result['tokens_per_s'] / stock['tokens_per_s']:.3f}x the tokens/s",
            flush=True,
        )
    write_summary(out_dir, summary)
    if not args.no_plot:
        title = f"GPT2LMHeadModel ({cfg.name}), {data.describe()}, {policy}, {device}"
        plot_metrics(out_dir / "training.png", result["rows"], evals, title)
    print(f"saved the trained model for from_pretrained: {out_dir / 'hf_model'}", flush=True)
    summary["state"] = state
    return summary


if __name__ == "__main__":
    main()
