"""The fused optimiser steps: ``torch.library`` ops, plans read from declared transforms.

``op_library`` turns a declared step into ops (functional and donated, with
fake kernels, C / Triton / plain PyTorch kernels and ``vmap`` rules);
``steps`` is the fused update that every fusable optimiser plugs into with
:func:`~functional_fp16._fused.steps.register`; ``sgd`` and ``adam`` are the
fusable optimisers (their plans, ops and plain kernels); ``chains`` reads
declared chains; ``memory`` hands out the pure ops' output buffers.
"""

from functional_fp16._fused import adam, sgd  # noqa: F401  (each registers its step)
