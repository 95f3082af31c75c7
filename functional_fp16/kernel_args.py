"""The arguments of the fused SGD and Adam kernels: one contract for the C and Triton implementations.

:func:`~functional_fp16.fused_update.fused_update` fills the two tuples here
once per step and passes them to :func:`functional_fp16.cpu_kernel.sgd_update`
or :func:`functional_fp16.cuda_kernel.sgd_update`, which read them alike.
Scalars that change from step to step are 0-d tensors that the kernel loads
itself, so no value is read back on the host; the optimiser's fixed
hyperparameters are Python numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["KernelTensors", "KernelScalars", "AdamTensors", "AdamScalars"]


class KernelTensors(NamedTuple):
    """The tensors a step reads and writes, one entry per leaf, in the C kernel's argument order.

    Every leaf's tensors are dense and laid out alike. Outputs may be the
    inputs themselves (donation).
    """

    grads: list[torch.Tensor]  # the gradients as stored: float32, float16 or bfloat16
    master: list[torch.Tensor]  # float32 master weights
    trace: list[torch.Tensor] | None  # float32 momentum buffers; None without momentum
    params: list[torch.Tensor]  # the old working copy: float32, float16 or bfloat16
    master_out: list[torch.Tensor]  # float32: the new master weights
    trace_out: list[torch.Tensor] | None  # float32: the new momentum; None without momentum
    params_out: list[torch.Tensor]  # the new working copy; master_out[i] itself if float32


class KernelScalars(NamedTuple):
    """The step's scalars: 0-d tensors loaded by the kernel, then the fixed hyperparameters."""

    inv: torch.Tensor | None  # 0-d float32 fl32(1 / scale); None: a unit scale, no product
    clip: tuple[torch.Tensor, torch.Tensor] | None  # 0-d float32 divisor and factor; None: off
    lr: torch.Tensor  # 0-d float32: the signed step factor (minus the learning rate)
    apply: torch.Tensor | None  # 0-d bool: apply the step; None: speculative (CPU kernel only)
    started: torch.Tensor | None  # 0-d bool: momentum has started; None without momentum
    weight_decay: float  # lambda, 0.0: no decay
    momentum: float  # mu, 0.0: no momentum
    dampening: float  # d; the kernels take 1 - d rounded once to float32
    nesterov: bool  # Nesterov momentum


class AdamTensors(NamedTuple):
    """The tensors of an Adam step, one entry per leaf, in the C kernel's argument order.

    Every leaf's tensors are dense and laid out alike; the outputs may be the
    inputs themselves (donation).
    """

    grads: list[torch.Tensor]  # the gradients as stored: float32, float16 or bfloat16
    master: list[torch.Tensor]  # float32 master weights
    mu: list[torch.Tensor]  # float32 first moments
    nu: list[torch.Tensor]  # float32 second moments
    params: list[torch.Tensor]  # the old working copy: float32, float16 or bfloat16
    master_out: list[torch.Tensor]  # float32: the new master weights
    mu_out: list[torch.Tensor]  # float32: the new first moments
    nu_out: list[torch.Tensor]  # float32: the new second moments
    params_out: list[torch.Tensor]  # the new working copy; master_out[i] itself if float32


class AdamScalars(NamedTuple):
    """An Adam step's scalars: 0-d tensors loaded by the kernel, then fixed hyperparameters."""

    inv: torch.Tensor | None  # 0-d float32 fl32(1 / scale); None: a unit scale, no product
    clip: tuple[torch.Tensor, torch.Tensor] | None  # 0-d float32 divisor and factor; None: off
    lr: torch.Tensor  # 0-d float32: the signed step factor (minus the learning rate)
    apply: torch.Tensor  # 0-d bool: apply the step
    inv_c1: torch.Tensor  # 0-d float32: fl32(1 / (1 - b1^t))
    sqrt_c2: torch.Tensor  # 0-d float32: fl32(sqrt(1 - b2^t))
    l2_decay: float  # torch.optim.Adam's weight decay, added to the gradient; 0.0: none
    b1: float  # the kernels take w = 1 - b1 rounded once to float32, as torch.lerp's weight
    b2: float  # and 1 - b2 likewise, as addcmul's value
    eps: float
    decoupled_decay: float  # AdamW's weight decay; 0.0: none
