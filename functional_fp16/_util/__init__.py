"""Package-internal plumbing: pytree functions, argument checks, deprecations, the all-finite reduction.

Holds :mod:`.tree`, :mod:`.cache`, :mod:`.validate`, :mod:`.deprecation`,
:mod:`.finite` and :mod:`.multi_tensor`. Every other part of the package may import
it; it imports nothing of ``functional_fp16``. Nothing here is public API.
"""
