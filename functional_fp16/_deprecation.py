"""Keeping old call shapes working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["keyword_only", "warn"]


def warn(message: str) -> None:
    """Says ``message`` as a ``DeprecationWarning`` pointing at the caller's caller."""
    warnings.warn(message, DeprecationWarning, stacklevel=3)


def keyword_only(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Lets ``names`` (now keyword-only) still be passed positionally, with a warning.

    ``names`` are the parameters that followed the positional ones in the old
    signature, in their old order.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        import inspect

        params = inspect.signature(fn).parameters.values()
        n_positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > n_positional:
                extra = args[n_positional:]
                if len(extra) > len(names):
                    raise TypeError(
                        f"{fn.__name__}() takes {n_positional} positional arguments "
                        f"but {len(args)} were given"
                    )
                moved = names[: len(extra)]
                for name in moved:
                    if name in kwargs:
                        raise TypeError(f"{fn.__name__}() got multiple values for {name!r}")
                warn(
                    f"{fn.__name__}(): passing {', '.join(moved)} positionally is deprecated "
                    "and stops working in the next release; pass "
                    + ", ".join(f"{n}=..." for n in moved)
                )
                kwargs.update(zip(moved, extra))
                args = args[:n_positional]
            return fn(*args, **kwargs)

        return wrapper

    return decorate
