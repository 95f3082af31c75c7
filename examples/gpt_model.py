"""The model of ``gpt_functional.py``: a decoder-only transformer in the GPT-2 layout.

Token and position embeddings, pre-LayerNorm blocks of causal
self-attention (``F.scaled_dot_product_attention``) and a GELU MLP, a final
LayerNorm and an output head tied to the token embedding, with nanoGPT's
initialisation (:func:`init_weights`). A plain ``nn.Module``: the example
runs it through ``make_apply`` under its precision policies, the stock
recipe (``benchmarks/stock_gpt.py``) calls it under ``torch.autocast``. The
attention core (:class:`CausalAttention`) and the head (:class:`TiedHead`)
are classes of their own so that per-module policies can name them.
:func:`decay_mask` says which parameters AdamW decays, for both.
"""

from __future__ import annotations

import argparse
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class GPTConfig(NamedTuple):
    """The transformer's size."""

    vocab_size: int
    context: int = 128  # the longest sequence (the position embedding's rows)
    layers: int = 4
    heads: int = 4
    width: int = 128  # the embedding width; each head gets width / heads
    dropout: float = 0.0


class CausalAttention(nn.Module):
    r"""Causal scaled dot-product attention of given queries, keys and values.

    .. math:: \operatorname{softmax}\!\Big(\frac{Q K^\top}{\sqrt{d}} + M\Big) V,
        \qquad M_{ij} = -\infty \text{ for } j > i

    A module of its own, with no parameters, so that a per-module policy can
    run it (the logits, the softmax and the weighted sum) in FP32:
    ``(batch, heads, T, d)`` in, the same out.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class HeadProjection(nn.Module):
    r"""The fused query, key and value projection, :math:`[Q; K; V] = x W^\top + b`.

    ``weight`` is ``(3, width, width)`` and ``bias`` ``(3, width)``: the
    ``(3 width, width)`` matrix of one linear layer with its three parts on a
    dimension of their own, so that sharding the middle dimension gives each
    tensor-parallel rank whole heads of all three (``gpt_tp.py``); unsharded it
    is that linear layer, computed as one (``F.linear`` of the flattened weight).
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, width, width))
        self.bias = nn.Parameter(torch.empty(3, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, t, width)`` in, ``(b, t, 3, width)`` out (``width`` this rank's share)."""
        if isinstance(self.weight, DTensor):  # heads sharded: the product keeps them so
            return torch.einsum("btc,sdc->btsd", x, self.weight) + self.bias
        y = F.linear(x, self.weight.flatten(0, 1), self.bias.flatten())
        return y.unflatten(-1, (3, -1))


class SelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused projection for Q, K, V; one for the output."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_width = cfg.width // cfg.heads
        self.qkv = HeadProjection(cfg.width)
        self.attend = CausalAttention(cfg.dropout)
        self.proj = nn.Linear(cfg.width, cfg.width)  # a residual projection
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        qkv = self.qkv(x)
        if isinstance(qkv, DTensor):  # tensor parallel: this rank's heads
            qkv = qkv.to_local()
        qkv = qkv.unflatten(-1, (-1, self.head_width))  # (b, t, 3, heads, width / heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, heads, t, width / heads)
        y = self.attend(q, k, v).transpose(1, 2).flatten(2)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    """``width -> 4 width -> GELU -> width``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.width, cfg.width)  # a residual projection
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    r"""A pre-LayerNorm transformer block: :math:`x + \text{attn}(\text{ln}(x))`, then the MLP's."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TiedHead(nn.Linear):
    """The output layer, ``logits = x W^T`` with ``W`` the token embedding (set by :class:`GPT`).

    A type of its own so that a per-module policy can name it.
    """


class GPT(nn.Module):
    r"""A decoder-only transformer in the GPT-2 layout.

    .. math::
        h_0 = E[x] + P[0..T), \quad h_{l} = \text{Block}_l(h_{l-1}), \quad
        \text{logits} = \text{LN}(h_L)\, E^\top

    ``head.weight`` *is* ``wte.weight`` (one tensor), so ``named_parameters``
    and :func:`~functional_fp16.split_module` list it once, as
    ``wte.weight``. Construction allocates the tensors uninitialised; see
    :func:`init_weights`.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.wpe = nn.Embedding(cfg.context, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = TiedHead(cfg.width, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, T, vocab)`` for token ids ``(batch, T)``, ``T <= context``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight")


@torch.no_grad()
def init_weights(model: GPT, generator: torch.Generator) -> None:
    r"""nanoGPT's initialisation, drawn from ``generator`` in ``named_parameters`` order.

    Weight matrices and embeddings :math:`\sim \mathcal{N}(0, 0.02^2)`, the
    residual projections (each block's ``attn.proj`` and ``mlp.proj``)
    :math:`\sim \mathcal{N}(0, (0.02/\sqrt{2L})^2)` so that the residual
    stream's variance does not grow with the depth :math:`L`; biases 0,
    LayerNorm scales 1 and shifts 0.
    """
    std = 0.02
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, nn.LayerNorm):
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            p.zero_()
        elif name.endswith(RESIDUAL_PROJECTIONS):
            p.normal_(0.0, std / math.sqrt(2 * model.cfg.layers), generator=generator)
        else:
            p.normal_(0.0, std, generator=generator)


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The model on the CPU in FP32, initialised from ``seed``."""
    model = GPT(cfg)
    init_weights(model, torch.Generator().manual_seed(seed))
    return model


def model_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """The model's size from the flags; the vocabulary is the text's (or the preset's if larger)."""
    return GPTConfig(
        vocab_size=max(vocab_size, args.vocab_size),
        context=args.context,
        layers=args.layers,
        heads=args.heads,
        width=args.width,
        dropout=args.dropout,
    )


def decay_mask(model: nn.Module) -> dict[str, bool]:
    """Which parameters AdamW decays: the linear layers' weight matrices, nothing else.

    Keyed like :func:`~functional_fp16.split_module` (tied parameters once,
    under their first name), so the tied ``wte.weight`` is an embedding and
    is not decayed; nor are biases, LayerNorm parameters and ``wpe.weight``.
    """
    mask = {}
    for name, _ in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(module_name)
        mask[name] = isinstance(owner, (nn.Linear, HeadProjection)) and leaf == "weight"
    return mask
