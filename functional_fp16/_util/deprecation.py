"""Keeping old call shapes and import paths working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as a view of the module that now holds its code."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.moved:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new_name = self.moved[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new_name}; import it from there (or from "
            f"{spec.name.partition('.')[0]}). The old path stops working in the next release.",
            DeprecationWarning,
            stacklevel=_importer_level(),
        )
        target = importlib.import_module(new_name)
        view = types.ModuleType(spec.name, target.__doc__)
        # PEP 562: every attribute is read from the new module, so the two stay one.
        view.__getattr__ = functools.partial(getattr, target)  # type: ignore[method-assign]
        view.__dir__ = lambda: dir(target)  # type: ignore[method-assign]
        view.__all__ = list(getattr(target, "__all__", ()))
        return view

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _importer_level() -> int:
    """The ``stacklevel`` of the first frame outside the import machinery and this module."""
    # ``warnings.warn`` skips the frozen import machinery's frames itself; the
    # rest (this module, ``importlib.import_module``, the package's
    # ``__getattr__``) are counted here.
    frame, level = sys._getframe(1), 1
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
            continue
        module = frame.f_globals.get("__name__", "")
        if module not in (__name__, "importlib", "functional_fp16"):
            return level
        frame, level = frame.f_back, level + 1
    return level


def redirect_moved_modules(moved: Mapping[str, str]) -> None:
    """Keeps each old module path in ``moved`` (old name -> new name) importable, with a warning.

    ``import old`` and ``from old import name`` give a module whose attributes
    are the new module's, and say once per process, as a ``DeprecationWarning``
    at the importing line, where the module went.
    """
    if not any(isinstance(f, _MovedModules) and f.moved == dict(moved) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules(moved))
