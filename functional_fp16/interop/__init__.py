"""Interop with stock PyTorch: moving a ``torch.optim`` + ``GradScaler`` job in and out.

Holds :mod:`.migration` (``from_torch``, ``to_torch``) and the readers and
writers it is built from: :mod:`.torch_optim` (SGD, Adam, AdamW and their
states) and :mod:`.grad_scaler`. May import :mod:`functional_fp16.update` and
the layers below it.
"""

from functional_fp16.interop.migration import from_torch, to_torch

__all__ = ["from_torch", "to_torch"]
