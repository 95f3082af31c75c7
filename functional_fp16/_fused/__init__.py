"""The fused optimiser steps: ``torch.library`` ops, plans read from declared transforms.

``op_library`` turns a declared step (``step_schema``) into ops (functional
and donated, with fake kernels and ``vmap`` rules from ``vmap_rules``): each
checks its arguments (``op_checks``) and runs the device's kernel, C or
plain PyTorch (``device_kernels``, ``plain_kernels``);
``steps`` is the fused update that every fusable optimiser plugs into with
:func:`~functional_fp16._fused.steps.register`; ``sgd`` and ``adam`` are the
fusable optimisers (their plans, ops and plain kernels); ``chains`` reads
declared chains; ``memory`` hands out the pure ops' output buffers. May
import :mod:`functional_fp16._kernels`, the transforms, precision and
``_util``; never the update that calls it.
"""

from functional_fp16._fused import adam, lion, rmsprop, sgd  # noqa: F401  (each registers its step)
