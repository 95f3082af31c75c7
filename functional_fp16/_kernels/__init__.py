"""The compiled kernels and their declared arguments: the C kernel (``fused_step.c``,
built on first use by :mod:`.cpu`), the Triton kernels (:mod:`.triton_steps` and the
modules it launches) and the argument tables they share (:mod:`.signatures`).

The bottom layer: nothing here imports the rest of the package.
"""
