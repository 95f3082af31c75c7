"""The compiled kernels and their declared arguments: the C kernel (``fused_step.c``,
built on first use by :mod:`.cpu`) and its argument tables (:mod:`.signatures`).

The bottom layer: nothing here imports the rest of the package.
"""
