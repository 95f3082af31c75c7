"""Tensor parallelism for the GPT example, laid out as torchtitan lays out its transformers.

``parallelize(model, tp_mesh)`` applies PyTorch's own parallel styles
(``torch.distributed.tensor.parallel``) to :class:`gpt_model.GPT`, in place:

====================  ==========================================  =====================
module                style                                       parameters
====================  ==========================================  =====================
``wte``               ``RowwiseParallel``, output ``Shard(1)``    ``Shard(0)`` (vocab)
``wpe``               ``RowwiseParallel``, output ``Shard(0)``    ``Shard(0)``
block ``ln_1/ln_2``   ``SequenceParallel``                        ``Replicate()``
``attn``, ``mlp``     ``PrepareModuleInput``: ``Shard(1)`` to     none
                      ``Replicate()``
``attn.qkv``          :class:`HeadParallel`                       ``Shard(1)`` (heads)
``attn.proj``         ``RowwiseParallel``, output ``Shard(1)``    ``Shard(1)``, bias
                                                                  ``Replicate()``
``mlp.fc``            ``ColwiseParallel``                         ``Shard(0)``
``mlp.proj``          ``RowwiseParallel``, output ``Shard(1)``    ``Shard(1)``, bias
                                                                  ``Replicate()``
``ln_f``              ``SequenceParallel``                        ``Replicate()``
``head``              ``ColwiseParallel``, input ``Shard(1)``,    ``Shard(0)`` (vocab),
                      output ``Replicate()``                      tied to ``wte``
====================  ==========================================  =====================

The residual stream between the blocks is sharded along the sequence
(``Shard(1)``), each rank computes its heads of attention and its columns
of the MLP, and the head, tied to the embedding (both ``Shard(0)`` over the
vocabulary), gives every rank the whole logits. ``fully_shard`` over the
data-parallel dimension then adds FSDP2's shards on top (``gpt_fsdp.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["HeadParallel", "parallelize", "plan"]


class HeadParallel(ParallelStyle):
    """Shards :class:`gpt_model.HeadProjection` by heads: its ``(3, width, width)`` weight
    and ``(3, width)`` bias on dimension 1, so each rank holds whole heads of the query,
    key and value. Its input is replicated; its output stays a DTensor sharded on the
    last dimension (the model takes its local heads)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def shard(name, mod, mesh):
            for key, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Shard(1)])))

        return distribute_module(module, device_mesh, shard)


def plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The parallel style of each module of ``model`` (the table in the module docstring)."""
    to_replicated = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    styles: dict[str, ParallelStyle] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        styles.update(
            {
                f"blocks.{i}.ln_1": SequenceParallel(),
                f"blocks.{i}.attn": to_replicated,
                f"blocks.{i}.attn.qkv": HeadParallel(),
                f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                f"blocks.{i}.ln_2": SequenceParallel(),
                f"blocks.{i}.mlp": to_replicated,
                f"blocks.{i}.mlp.fc": ColwiseParallel(),
                f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return styles


def parallelize(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """``model`` tensor-parallel over the 1-D ``tp_mesh`` (in place), its head tied again.

    The heads must divide by the mesh's size (each rank holds whole heads); the
    vocabulary and the sequence need not (DTensor shards them unevenly)."""
    size = tp_mesh.size()
    if model.cfg.heads % size:
        raise ValueError(f"--tp {size}: the model's {model.cfg.heads} heads must divide by it")
    parallelize_module(model, tp_mesh, plan(model))
    model.head.weight = model.wte.weight  # both Shard(0) over the vocabulary: one tensor
    return model
