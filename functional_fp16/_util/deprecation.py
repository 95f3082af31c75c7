"""Keeping old call shapes and import paths working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["keyword_only", "warn", "redirect_moved_modules"]


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


class _MovedModule(types.ModuleType):
    """An old module path: its names are the moved module's, read and written with a warning.

    ``__all__`` (so ``from old import *`` works) and any other name are
    looked up in the moved module when read; setting or deleting a name
    (``mock.patch("old.name")``) changes the moved module, which the library
    reads. A name the moved module lacks raises ``AttributeError`` without
    a warning, so probing tools see an ordinary module.
    """

    def __init__(self, name: str, new_name: str) -> None:
        super().__init__(name, f"Deprecated path of :mod:`{new_name}`.")
        self.__dict__["_new_name"] = new_name
        self.__dict__["__spec__"] = importlib.machinery.ModuleSpec(name, None)

    def _target(self) -> types.ModuleType:
        return importlib.import_module(self.__dict__["_new_name"])

    def _warn(self) -> None:
        new = self.__dict__["_new_name"]
        # One text per old path, so that the warning filters show it once per line.
        warnings.warn(
            f"{self.__name__} moved to {new}; import from there (or from "
            f"{new.partition('.')[0]}). The old path stops working in the next release.",
            DeprecationWarning,
            stacklevel=3,
        )

    def __getattr__(self, attr: str) -> Any:
        target = self._target()
        if (attr.startswith("__") and attr != "__all__") or not hasattr(target, attr):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        self._warn()
        return getattr(target, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        self._warn()
        setattr(self._target(), attr, value)

    def __delattr__(self, attr: str) -> None:
        self._warn()
        delattr(self._target(), attr)

    def __dir__(self) -> list[str]:
        return dir(self._target())


def redirect_moved_modules(moved: Mapping[str, str]) -> None:
    """Keeps each old module path in ``moved`` (old name -> new name) importable for one release.

    ``import old`` gives a module whose attributes are the new module's;
    reading one (``old.name``, ``from old import name``) says, as a
    ``DeprecationWarning`` at the reading line, where the module went. The
    old names are entered in ``sys.modules`` up front, so importing one never
    rebinds the package attribute of the same name (``functional_fp16.sgd``
    stays the function).
    """
    for old, new in moved.items():
        if not isinstance(sys.modules.get(old), _MovedModule):
            sys.modules[old] = _MovedModule(old, new)
