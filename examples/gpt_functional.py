"""Train a character-level GPT on Tiny Shakespeare in FP16 mixed precision, functionally.

A decoder-only transformer in the GPT-2 layout (token and position
embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a
final LayerNorm, an output head tied to the token embedding, nanoGPT's
initialisation) written with ``functional_fp16``: the parameters are a dict
of FP16 tensors with FP32 master copies inside an ``FP16State``, the
optimiser is ``clip_by_global_norm`` + ``adamw`` with weight decay on the
weight matrices only (``masked``) and a warmup-cosine schedule, optionally
inside ``MultiSteps`` for gradient accumulation, and the training step is a
pure function

    state, metrics = train_step(state, inputs, targets)

built from ``torch.func`` (``make_apply`` + ``scaled_grad_and_value``) and
``fp16_update`` (dynamic loss scaling with hysteresis). Per-module policies
keep the LayerNorms, the attention (its logits and softmax), the embeddings
and the tied head with the cross-entropy in FP32, and so the residual stream
too. This file holds the model, the precision and optimiser settings, the
pure steps and :func:`main`; its siblings hold the model (``gpt_model.py``),
the flags (``gpt_cli.py``), the loop (``gpt_loop.py``), what a run writes and
resumes from (``gpt_outputs.py``) and the text (``gpt_data.py``).

    python examples/gpt_functional.py --download                   # Tiny Shakespeare into ./data
    python examples/gpt_functional.py --text PATH                  # any UTF-8 text
    python examples/gpt_functional.py --synthetic --max-steps 50   # seconds, generated text
    torchrun --nproc-per-node 2 examples/gpt_functional.py --distributed   # data parallel
    python examples/gpt_functional.py --preset gpt2 --device cuda  # 124M: one step, its memory

Outputs in ``--out-dir`` (default ``runs/gpt``): ``metrics.jsonl`` (one line
per step: step, loss, loss_scale, skipped, lr; one per evaluation: step,
val_loss), ``summary.json``, ``training.png`` (train and validation loss,
loss scale, learning rate), ``sample.txt`` (the characters sampled at the
end) and a checkpoint per evaluation (``checkpoint_step_NNNNNN.pt``);
``--resume`` continues from one so that the run ends bit-identical to an
uninterrupted one.

With ``--distributed`` (under ``torchrun``) each of the ``WORLD_SIZE`` ranks
takes its ``batch-size / WORLD_SIZE`` share of every micro-batch (all ranks
draw the same windows), the scaled FP16 gradients are averaged with
``tree_all_reduce_mean`` and every rank applies the same ``fp16_update`` with
``agree=agree_finite``; only rank 0 prints and writes files.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The sibling modules, importable from any working directory; the device, CPU
# and output settings are shared with the CIFAR-10 example (run_setup.py,
# run_outputs.py).
import gpt_data  # noqa: E402
import gpt_fsdp  # noqa: E402
import run_cli  # noqa: E402
from gpt_cli import parse_args  # noqa: E402
from gpt_loop import fit  # noqa: E402
from gpt_model import (  # noqa: E402
    GPT,
    CausalAttention,
    TiedHead,
    build_model,
    decay_mask,
    model_config,
)
from gpt_outputs import load_resume, peak_memory, plot_metrics, run_config  # noqa: E402
from run_outputs import counters_of, state_bytes, summary_head, write_summary  # noqa: E402
from run_setup import (  # noqa: E402
    auto_policy,
    configure_process,  # noqa: F401 - the benchmarks call it through this module
    cpu_has_fast_bf16,
    end_process,
    load_data_once,
    loss_scale_from_flags,
    make_out_dir,
    print_distributed,
    resolve_device,  # noqa: F401 - the benchmarks call it through this module
    start_run,
)

import functional_fp16 as ff  # noqa: E402
from functional_fp16 import distributed as ffd  # noqa: E402
from functional_fp16.bridge import make_apply, scaled_grad_and_value, split_module  # noqa: E402
from functional_fp16.precision.policy import Policy  # noqa: E402

# -- precision ---------------------------------------------------------------------


def resolve_policy(args: argparse.Namespace, device: torch.device) -> Policy:
    """The model's policy from ``--precision`` and ``--compute-dtype``.

    As in the CIFAR-10 example: on CUDA the computation runs in the parameter
    dtype; a CPU has no fast FP16 arithmetic, so there FP16 parameters are
    computed in BF16 when the CPU has native BF16 and in FP32 otherwise, and
    still get FP16 gradients (so loss scaling is exercised). Outputs are FP32.
    """
    return auto_policy(args, device, cpu_has_fast_bf16)


def module_policies(policy: Policy) -> dict[type[nn.Module], Policy]:
    r"""Which modules run in FP32 when the model computes in FP16 or BF16.

    * the LayerNorms (:func:`~functional_fp16.default_module_policies`) and
      the attention core :class:`CausalAttention`
      (:func:`~functional_fp16.norm_policy`): inputs and parameters in FP32,
      outputs back in the compute dtype. The attention logits
      :math:`QK^\top/\sqrt d` and their softmax are where FP16 overflows;
    * the embeddings and the tied head (``nn.Embedding``, :class:`TiedHead`):
      FP32 in and out. The head's logits reach the cross-entropy in FP32,
      and the embeddings hand the residual stream over in FP32, so each
      block adds its compute-dtype branches to an FP32 stream (type
      promotion), as under ``torch.autocast``.

    With FP32 compute there is nothing to override: ``{}``.
    """
    islands = ff.default_module_policies(policy)
    if islands:
        islands[CausalAttention] = ff.norm_policy(policy)
        full = Policy(policy.param_dtype, torch.float32, torch.float32)
        islands[nn.Embedding] = full
        islands[TiedHead] = full
    return islands


def resolve_loss_scale(args: argparse.Namespace, policy: Policy) -> ff.LossScale:
    """``--loss-scale`` (``auto``: dynamic when the policy involves FP16), with hysteresis."""
    return loss_scale_from_flags(args, policy, hysteresis=args.hysteresis)


# -- the optimiser -----------------------------------------------------------------


def lr_schedule(args: argparse.Namespace) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""Linear warmup from ``lr / warmup`` to ``lr``, then cosine decay to ``min_lr`` at ``max_steps``.

    .. math::
        \eta_t = \begin{cases}
          \eta_0 + (\eta - \eta_0)\, t / W & t < W, \quad \eta_0 = \eta / W \\
          \eta_{min} + (\eta - \eta_{min})\,\tfrac12\big(1 + \cos\tfrac{\pi (t - W)}{S - W}\big)
            & W \le t \le S
        \end{cases}

    with :math:`t` the number of applied optimiser steps before this one.
    """
    warmup = args.warmup_steps
    return ff.warmup_cosine_decay_schedule(
        init_value=args.lr / warmup if warmup else args.lr,
        peak_value=args.lr,
        warmup_steps=warmup,
        decay_steps=args.max_steps,
        end_value=args.min_lr,
    )


def build_optimizer(args: argparse.Namespace, mask: dict[str, bool]) -> ff.GradientTransformation:
    """``clip_by_global_norm`` then AdamW (decay on ``mask`` only, moments stored as
    ``--moments`` says), in ``MultiSteps`` if accumulating."""
    stored = run_cli.moment_dtype(args)
    adamw = ff.adamw(
        lr_schedule(args),
        b1=args.beta1,
        b2=args.beta2,
        eps=args.eps,
        weight_decay=args.weight_decay,
        mask=mask,
        mu_dtype=stored,
        nu_dtype=stored,
    )
    tx = ff.chain(ff.clip_by_global_norm(args.clip), adamw) if args.clip > 0 else adamw
    return ff.MultiSteps(tx, args.grad_accum) if args.grad_accum > 1 else tx


def build_state(
    model: GPT, policy: Policy, loss_scale: ff.LossScale, args: argparse.Namespace, device
) -> ff.FP16State:
    """The initial ``FP16State``: FP32 master, working copy in the policy's param dtype."""
    params, buffers = split_module(model)
    assert not buffers, "the model has no buffers"
    params = {k: v.to(device) for k, v in params.items()}
    tx = build_optimizer(args, decay_mask(model))
    return ff.fp16_init(
        params,
        tx,
        loss_scale,
        param_dtype=policy.param_dtype,
        master=args.master,
    )


def fsdp_parts(
    args: argparse.Namespace, cfg, loss_scale: ff.LossScale
) -> tuple[GPT, ff.GradientTransformation, ff.LossScale]:
    """The model, optimiser and loss scale of a ``--fsdp`` run: the recipe without
    ``MultiSteps`` (FSDP2 sums the micro-batches' gradients in ``p.grad``)."""
    model = build_model(cfg, args.seed)
    single = argparse.Namespace(**{**vars(args), "grad_accum": 1})
    return model, build_optimizer(single, decay_mask(model)), loss_scale


def applied_steps(opt_state: Any) -> torch.Tensor:
    """The learning-rate schedule's step count in ``opt_state`` (applied optimiser steps)."""
    is_count = lambda x: isinstance(x, ff.ScaleByScheduleState)
    found = [
        x
        for x in optree.tree_leaves(opt_state, is_leaf=is_count, namespace=ff.NAMESPACE)
        if is_count(x)
    ]
    return found[0].count


# -- the pure steps ----------------------------------------------------------------


class StepMetrics(NamedTuple):
    """What one optimiser step reports (0-d tensors, left on the device)."""

    loss: torch.Tensor  # float32: the unscaled loss, mean over the micro-batches
    loss_scale: torch.Tensor  # float32: the scale this step's gradients were computed with
    skipped: torch.Tensor  # bool: the step overflowed and was not applied
    lr: torch.Tensor  # float32: the learning rate of this step
    counters: torch.Tensor  # float32 (4,): the loss-scale counters after it (run_outputs.COUNTERS)
    leaf_finite: torch.Tensor  # bool (leaves,): per parameter, its gradient was finite


def make_loss_fn(model: GPT, policy: Policy, *, train: bool) -> Callable[..., torch.Tensor]:
    r"""``loss_fn(params, inputs, targets)``: the mean cross-entropy in FP32, pure.

    .. math:: L = -\frac{1}{BT} \sum_{b,t} \log \operatorname{softmax}(z_{b,t})_{y_{b,t}}

    with :math:`z` the FP32 logits that :func:`make_apply` returns under
    ``policy`` and :func:`module_policies`.
    """
    apply = make_apply(model, train=train, policy=policy, module_policies=module_policies(policy))

    def loss_fn(params, inputs, targets):
        logits, _ = apply(params, {}, inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return loss_fn


def make_train_step(
    model: GPT,
    policy: Policy,
    schedule: Callable[[torch.Tensor], torch.Tensor],
    *,
    distributed: bool = False,
    compiled: bool = False,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> Callable[..., tuple[ff.FP16State, StepMetrics]]:
    """``train_step(state, inputs, targets) -> (state, StepMetrics)``, pure.

    ``inputs`` and ``targets`` are ``(k, batch, T)``: the ``k`` micro-batches
    of one optimiser step (``k = --grad-accum``; the optimiser is then
    ``MultiSteps``, which applies the step after the ``k``-th
    ``fp16_update``). With ``distributed`` the gradients and the loss are
    averaged over the ranks and the overflow decision is agreed. With
    ``compiled`` the whole step (the schedule, every micro-batch's forward
    and backward pass and ``fp16_update``) is one
    ``torch.compile(fullgraph=True)`` graph; the fused update is one opaque
    op in it. ``loss_fn(params, inputs, targets)`` replaces this model's
    (:func:`make_loss_fn`), so another model's loss trains the same way.
    """
    grad_fn = scaled_grad_and_value(loss_fn or make_loss_fn(model, policy, train=True))

    def train_step(state: ff.FP16State, inputs: torch.Tensor, targets: torch.Tensor):
        # The loop owns its state: each update donates it (master, params and optimiser
        # state written in place, so one state is alive at a time, not two; the loss
        # scale and counters are new tensors, so the metrics below keep this step's).
        scale = state.loss_scale.loss_scale
        lr = schedule(applied_steps(state.opt_state))
        losses = []
        for x, y in zip(inputs.unbind(0), targets.unbind(0)):
            grads, loss = grad_fn(state.loss_scale, state.params, x, y)
            if distributed:
                grads = ff.tree_all_reduce_mean(grads)  # scaled FP16 gradients, mean over ranks
                loss = ff.tree_all_reduce_mean(loss.float())
                state = ff.fp16_update(state, grads, loss=loss, agree=ff.agree_finite, donate=True)
            else:
                state = ff.fp16_update(state, grads, loss=loss, donate=True)
            losses.append(loss.float())
        # After the last micro-batch grads_finite says whether the window was applied.
        metrics = StepMetrics(
            torch.stack(losses).mean(),
            scale,
            ~state.grads_finite,
            lr,
            counters_of(state),
            state.leaf_finite,
        )
        return state, metrics

    return torch.compile(train_step, fullgraph=True) if compiled else train_step


def make_eval_step(model: GPT, policy: Policy) -> Callable[..., torch.Tensor]:
    """``eval_step(params, inputs, targets) -> summed cross-entropy`` (0-d float32), pure."""
    apply = make_apply(model, train=False, policy=policy, module_policies=module_policies(policy))

    def eval_step(params, inputs, targets):
        logits, _ = apply(params, {}, inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")

    return eval_step


@torch.no_grad()
def generate(
    model: GPT,
    policy: Policy,
    params: dict[str, torch.Tensor],
    prompt: list[int],
    n: int,
    seed: int,
) -> list[int]:
    r"""``n`` tokens sampled after ``prompt``, one at a time, from a generator seeded with ``seed``.

    Token :math:`t` is drawn from :math:`\operatorname{softmax}(z_t)`, the
    logits of the last position given the previous ``context`` tokens.
    """
    apply = make_apply(model, train=False, policy=policy, module_policies=module_policies(policy))
    device = next(iter(params.values())).device
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(n):
        window = torch.tensor([ids[-model.cfg.context :]], dtype=torch.int64, device=device)
        logits, _ = apply(params, {}, window)
        probs = torch.softmax(logits[0, -1].float().cpu(), dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids[len(prompt) :]


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example; returns a summary dict (also written to ``summary.json``)."""
    args = parse_args(argv)
    info, device = start_run(args)
    policy = resolve_policy(args, device)
    loss_scale = resolve_loss_scale(args, policy)
    data = load_data_once(
        info,
        args.download,
        lambda: gpt_data.load_text(
            text=args.text,
            data_dir=args.data_dir,
            download=args.download,
            synthetic=args.synthetic,
            synthetic_chars=args.synthetic_chars,
            val_fraction=args.val_fraction,
            context=args.context,
        ),
        gpt_data.DataError,
    )
    out_dir = make_out_dir(args.out_dir)

    cfg = model_config(args, data.vocab_size)
    if args.fsdp:  # FSDP2 on the module itself (examples/gpt_fsdp.py)
        summary = gpt_fsdp.run_fsdp(
            args, data, info, device, out_dir, lambda: fsdp_parts(args, cfg, loss_scale)
        )
        # The group goes before the interpreter does, every rank together: gloo's threads
        # left to exit with it, or a peer's connections torn down while rank 0 still
        # writes, can abort a process at shutdown (functional_fp16.distributed.shutdown).
        ffd.shutdown(wait_for_peers=True)
        return summary
    model = build_model(cfg, args.seed)
    state = build_state(model, policy, loss_scale, args, device)
    if info is not None:  # every rank starts from rank 0's values
        state = ffd.broadcast_state(state)
    n_params = sum(p.numel() for p in state.params.values())
    print(
        f"data: {'SYNTHETIC text' if data.synthetic else data.describe()}, "
        f"{data.train.numel()} train / {data.val.numel()} validation characters, "
        f"vocabulary {data.vocab_size}",
        flush=True,
    )
    print(
        f"model: {cfg.layers} layers, {cfg.heads} heads, width {cfg.width}, context "
        f"{cfg.context}, {n_params} parameters; batch {args.batch_size} x {args.grad_accum} "
        f"micro-batches",
        flush=True,
    )
    print(
        f"device: {device}, policy: {policy}, loss scale: {type(loss_scale).__name__}, "
        f"compile: {args.compile}, moments: {args.moments}, master: {args.master}",
        flush=True,
    )
    print_distributed(info, args.batch_size)
    stored_bytes = state_bytes(state)

    schedule = lr_schedule(args)
    train_step = make_train_step(
        model, policy, schedule, distributed=info is not None, compiled=args.compile
    )
    eval_step = make_eval_step(model, policy)
    config = run_config(args, policy, data, cfg)
    data_rng = torch.Generator().manual_seed(args.seed)
    start = {"step": 0, "rows": [], "evals": []}
    if args.resume:
        ckpt = load_resume(args.resume, state, config)
        state = ckpt["state"]
        data_rng.set_state(ckpt["data_rng"])
        start = {"step": ckpt["step"], "rows": ckpt["rows"], "evals": ckpt["evals"]}
        print(f"resumed from {args.resume} at step {ckpt['step']}", flush=True)
    result = fit(args, data, state, train_step, eval_step, device, config, data_rng, start)
    state = result["state"]

    sample = ""
    if args.sample_chars:
        prompt = [data.chars.index("\n")] if "\n" in data.chars else [0]
        ids = generate(model, policy, state.params, prompt, args.sample_chars, args.sample_seed)
        sample = data.decode(ids)
    memory = peak_memory(device)
    evals = result["evals"]
    val_loss = evals[-1][1] if evals else float("nan")
    skipped_at = [r["step"] for r in result["rows"] if r["skipped"]]
    summary = {
        **summary_head(args, data, device, policy),
        "model": cfg._asdict(),
        "parameters": n_params,
        "moments": args.moments,
        "master": args.master,
        "state_bytes": stored_bytes,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "tokens_per_step": args.batch_size * args.grad_accum * cfg.context,
        "steps": result["step"],
        "val_loss": val_loss,
        "val_losses": [[step, loss] for step, loss in evals],
        "train_tokens_per_s": result["tokens_per_s"],
        "final_loss_scale": float(state.loss_scale.loss_scale),
        "skipped_steps": len(skipped_at),
        "skipped_at": skipped_at,
        "loss_scale_stats": ff.loss_scale_stats(state),
        "peak_memory_mib": memory[0] / 2**20,
        "peak_memory_kind": memory[1],
        "sample_seed": args.sample_seed,
        "sample": sample,
    }
    write_summary(out_dir, summary)
    if ffd.is_main_process():
        (out_dir / "sample.txt").write_text(sample, encoding="utf-8")
        if not args.no_plot:
            title = f"{'SYNTHETIC text' if data.synthetic else data.describe()}, {policy}, {device}"
            plot_metrics(out_dir / "training.png", result["rows"], evals, title)
    print(
        f"training throughput: {result['tokens_per_s']:.0f} tokens/s ({device}, {policy}); "
        f"peak memory {memory[0] / 2**20:.0f} MiB ({memory[1]})"
    )
    if sample:
        print(f"--- {len(sample)} characters sampled with seed {args.sample_seed} ---")
        print(sample)
        print("---")
    print(
        f"validation loss on {data.describe()} after {result['step']} steps: "
        f"{val_loss:.4f} nats/character",
        flush=True,
    )
    summary["state"] = state
    if info is not None:
        ffd.shutdown(wait_for_peers=True)
    return summary


if __name__ == "__main__":
    main()
    end_process()  # a torchrun process ends without Python's finalisation (see there)
