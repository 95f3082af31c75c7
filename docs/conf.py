"""Sphinx configuration: the guides (Markdown) and the API reference (from the docstrings).

Build, with every warning an error::

    sphinx-build -W --keep-going -q -b html docs docs/_build/html

Besides Sphinx's own warnings, this configuration warns about

* a public module, class, function, method or property without a docstring,
  whether autodoc documents it (``autodoc-process-docstring``) or leaves it
  out for want of one (``autodoc-skip-member``);
* a name in ``functional_fp16.__all__`` or in a subpackage's ``__all__`` that no
  page of the reference documents (``env-check-consistency``);
* a cross-reference to a ``functional_fp16.*`` path that does not import, or
  that goes through a module path kept only for compatibility
  (``missing-reference``).

A reference to a re-exported name (``functional_fp16.fp16_update``,
``functional_fp16.transforms.sgd``) resolves to the object's one description,
at the module that defines it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
import warnings

from sphinx.util import logging

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import functional_fp16  # noqa: E402

project = "functional_fp16"
author = "functional_fp16 contributors"
copyright = "functional_fp16 contributors"
release = functional_fp16.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "**/README.md", "Thumbs.db", ".DS_Store"]

# No network: no intersphinx, and MathJax is loaded by the reader's browser,
# not by the build.
nitpicky = False

# autodoc: the reference documents each object once, at its defining module,
# in source order, with the signature's annotations as written.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"

# napoleon: Google-style docstrings (``Args:``, ``Returns:``, ``Raises:``).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

# MyST: the guides' ``$...$`` and ``$$...$$`` math, and the ``#section`` links
# between their headings.
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# The guides link to files of the repository outside docs/ (the README,
# BENCHMARKS.md), which work on GitHub; in this build they are not pages, and
# such a link is shown as its text.
nitpick_ignore_regex = [("myst", r"(.*/)?(README|BENCHMARKS)(\.md)?")]

html_theme = "alabaster"
html_title = f"functional_fp16 {release}"
html_static_path: list[str] = []

LOGGER = logging.getLogger(__name__)

PACKAGE = "functional_fp16"
SUBPACKAGES = ("precision", "transforms", "update", "checkpoint", "interop", "distributed")
# The module paths of release 0.1 that moved into subpackages (importable, deprecated).
MOVED: dict[str, str] = getattr(functional_fp16, "_MOVED", {})

# Importing the package's old module paths warns; the reference never does.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"functional_fp16(\..*)?$")


def _is_public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def _generated_class_doc(obj: type) -> bool:
    """True when a class's ``__doc__`` is the one ``dataclass`` or ``NamedTuple`` writes."""
    doc = obj.__dict__.get("__doc__")
    if not doc:
        return True
    fields = getattr(obj, "_fields", None)
    if isinstance(fields, tuple) and doc == f"{obj.__name__}({', '.join(fields)})":
        return True
    if dataclasses.is_dataclass(obj):
        try:
            text = str(inspect.signature(obj)).replace(" -> None", "")
        except (TypeError, ValueError):
            return False
        return doc == obj.__name__ + text
    return False


def _source_location(obj) -> str | None:
    """``path:line`` of an object's definition, for a warning's location."""
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return None


_FIELD_ALIAS = re.compile(r"Alias for field number \d+")


def _missing_docstring(what: str, name: str, obj) -> None:
    target = obj.fget if isinstance(obj, property) else obj
    LOGGER.warning(
        "public %s %s has no docstring",
        what,
        name,
        location=_source_location(target),
        type="fp16",
        subtype="docstring",
    )


def _has_own_doc(obj) -> bool:
    if isinstance(obj, type):
        return not _generated_class_doc(obj)
    return bool((inspect.getdoc(obj) or "").strip())


def _check_docstring(app, what, name, obj, options, lines) -> None:
    """Warns about a documented public module, class, function, method or property
    without a docstring; drops the ``Alias for field number N`` of a NamedTuple field."""
    if (
        what == "attribute"
        and len(lines) <= 2
        and _FIELD_ALIAS.fullmatch(lines[0] if lines else "")
    ):
        lines.clear()
        return
    if what not in {"module", "class", "exception", "function", "method", "property"}:
        return
    if not _is_public(name):
        return
    if what in {"class", "exception"} and isinstance(obj, type):
        missing = _generated_class_doc(obj)
    else:
        missing = not any(line.strip() for line in lines)
    if missing:
        _missing_docstring(what, name, obj)


def _check_skipped_member(app, what, name, obj, skip, options):
    """Warns about a public function, class, method or property that autodoc leaves
    out for want of a docstring (``:members:`` documents only members with one)."""
    if not skip or name.startswith("_"):
        return None
    if isinstance(obj, property):
        kind, source = "property", obj.fget
    elif isinstance(obj, type):
        kind, source = "class", obj
    elif inspect.isroutine(obj):
        kind, source = ("function" if what == "module" else "method"), obj
    else:
        return None
    if not _has_own_doc(obj):
        module = getattr(source, "__module__", None) or "?"
        _missing_docstring(kind, f"{module}.{getattr(source, '__qualname__', name)}", obj)
    return None


def _walk(path: str, module: str | None = None):
    """The objects along a dotted ``functional_fp16.*`` path, as attribute access
    finds them (a re-exported function before a submodule of the same name),
    from the module ``module`` (a prefix of ``path``) or from the top; stops
    early where the path does not import."""
    start = module or path.split(".")[0]
    try:
        obj = importlib.import_module(start)
    except ImportError:
        return
    yield start, obj
    name = start
    for part in path[len(start) :].lstrip(".").split("."):
        if not part:
            return
        name = f"{name}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not inspect.ismodule(obj):
                return
            try:
                obj = importlib.import_module(name)
            except ImportError:
                return
        yield name, obj


def _walk_modules(path: str):
    """The longest importable module prefix of ``path``, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ImportError:
            continue
        yield name, obj
        for part in parts[cut:]:
            name = f"{name}.{part}"
            try:
                obj = getattr(obj, part)
            except AttributeError:
                return
            yield name, obj
        return


@functools.cache
def _import_path(path: str, module: str | None = None):
    """The object at a dotted ``functional_fp16.*`` path, or ``None`` if it does not import.

    As attribute access finds it first (``functional_fp16.transforms.sgd`` is the
    function ``sgd``), else as a module path (``functional_fp16.transforms.sgd.TraceSpec``).
    """
    for walk in (_walk(path, module), _walk_modules(path)):
        steps = list(walk)
        if steps and steps[-1][0] == path:
            return steps[-1][1]
    return None


def _moved_prefix(path: str, module: str | None = None) -> str | None:
    """The compatibility-only module path that ``path`` goes through, if any."""
    if _import_path(path, module) is None:
        return None
    for walk in (_walk(path, module), _walk_modules(path)):
        steps = list(walk)
        if steps and steps[-1][0] == path:
            for name, obj in steps:
                if name in MOVED and inspect.ismodule(obj):
                    return name
            return None
    return None


def _canonical_name(obj) -> str | None:
    if inspect.ismodule(obj):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return None


def _documented_as(domain, name: str, obj) -> str | None:
    """Where ``obj``, known here as ``name``, is described: its defining module, or
    for a constant or an alias (no ``__qualname__``) the description of that
    same object under the same last name."""
    canonical = _canonical_name(obj)
    if canonical in domain.objects:
        return canonical
    last = name.rpartition(".")[2]
    for full_name in domain.objects:
        if full_name.rpartition(".")[2] == last and _import_path(full_name) is obj:
            return full_name
    return None


def _resolve_reexport(app, env, node, contnode):
    """Resolves a reference to a re-exported name at the object's one description.

    ``functional_fp16.fp16_update`` and ``functional_fp16.update.fp16_update``
    lead to ``functional_fp16.update.step.fp16_update``; inside a module's
    docstring, a name that module imports leads to where it is defined.
    """
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target = node.get("reftarget", "").lstrip(".")
    module = node.get("py:module")
    cls = node.get("py:class")
    candidates = []
    if module and cls:
        candidates.append((f"{module}.{cls}.{target}", module))
    if module:
        candidates.append((f"{module}.{target}", module))
    candidates.append((target, None))
    for candidate, start in candidates:
        if candidate.split(".")[0] != PACKAGE:
            continue
        moved = _moved_prefix(candidate, start)
        if moved:
            LOGGER.warning(
                "cross-reference to %s through the deprecated path %s (now %s)",
                target,
                moved,
                MOVED[moved],
                location=node,
                type="fp16",
            )
            return None
        obj = _import_path(candidate, start)
        if obj is None:
            continue
        documented = _documented_as(domain, candidate, obj)
        if documented is None or documented == candidate:
            continue
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], documented, node, contnode
        )
    if "." not in target:
        # A bare name from a module that does not import it: the one object of
        # the reference with that name, if there is exactly one.
        objtypes = set(domain.objtypes_for_role(node["reftype"]) or ())
        matches = [
            full_name
            for full_name, entry in domain.objects.items()
            if full_name.rpartition(".")[2] == target and entry.objtype in objtypes
        ]
        if len(matches) == 1:
            return domain.resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], matches[0], node, contnode
            )
    if target.split(".")[0] == PACKAGE and _import_path(target) is None:
        LOGGER.warning(
            "cross-reference to %s, which does not import", target, location=node, type="fp16"
        )
    return None


def _public_names() -> dict[str, object]:
    """Every name of the package's and its subpackages' ``__all__``, with its object."""
    names = {f"{PACKAGE}.{n}": getattr(functional_fp16, n) for n in functional_fp16.__all__}
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"{PACKAGE}.{sub}")
        for n in module.__all__:
            names[f"{PACKAGE}.{sub}.{n}"] = getattr(module, n)
    return names


def _check_coverage(app, env) -> None:
    """Warns about a public name that no page documents."""
    documented = env.get_domain("py").objects
    by_last_name: dict[str, list[object]] = {}
    for full_name in documented:
        obj = _import_path(full_name)
        by_last_name.setdefault(full_name.rpartition(".")[2], []).append(obj)
    for name, obj in _public_names().items():
        if name in documented or _canonical_name(obj) in documented:
            continue
        if any(other is obj for other in by_last_name.get(name.rpartition(".")[2], [])):
            continue
        LOGGER.warning("public name %s is not in the API reference", name, type="fp16")


def setup(app):
    app.connect("autodoc-process-docstring", _check_docstring)
    app.connect("autodoc-skip-member", _check_skipped_member)
    app.connect("missing-reference", _resolve_reexport)
    app.connect("env-check-consistency", _check_coverage)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
