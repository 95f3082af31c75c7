"""Reading checkpoint format version 1 (written by functional_fp16 0.1).

A version-1 file holds ``{"format", "version": 1, "tree", "tensors",
"tensor_info", "checksum"}``, where ``tree`` is a nest of nodes with a
``"kind"``: ``tensor`` (an index into ``tensors``), ``value``, ``list``,
``tuple``, ``dict`` (keys and values in insertion order), ``namedtuple`` (its
class name, fields and items), or a registered node of the library by class
name, with ``fields`` (its children by name) and, for a loss scale,
``config`` (its static configuration by name).

:func:`convert` checks the version-1 checksum and rewrites the file's
contents into the version-2 form (``structure``, ``leaves``, ``tensors``), so
that one loader, with one set of checks against the template, serves both.
It is given only what :func:`functional_fp16.checkpoint.format.check_objects`
has passed: a tree of bounded depth, so its recursion is bounded too, whose
text, counted at each reference, is bounded by the file's size, so its
checksum's ``repr`` is too.
"""

from __future__ import annotations

from typing import Any

from functional_fp16.checkpoint import format as fmt

__all__ = ["convert"]


def _node(node: dict, payload: dict, leaves: list[dict]) -> dict:
    kind = node["kind"]
    if kind == "tensor":
        index = node["index"]
        if type(index) is not int or not 0 <= index < len(payload["tensors"]):
            raise ValueError(f"tensor index {index!r} out of range")
        record = dict(payload["tensor_info"][index], tensor=index)
        leaves.append(record)
        return {"leaf": len(leaves) - 1}
    if kind == "value":
        if node["value"] is None:  # optree's None: a node without children
            return {"type": "NoneType", "kind": "NONE", "entries": [], "children": []}
        leaves.append({"path": "<value>", "value": node["value"]})
        return {"leaf": len(leaves) - 1}
    if kind in ("list", "tuple", "namedtuple"):
        items = node["items"]
        entries = node["fields"] if kind == "namedtuple" else list(range(len(items)))
        return {
            "type": node["name"] if kind == "namedtuple" else kind,
            "kind": kind.upper(),
            "entries": list(entries),
            "children": [_node(item, payload, leaves) for item in items],
        }
    if kind == "dict":
        return {
            "type": "dict",
            "kind": "DICT",
            "entries": list(node["keys"]),
            "children": [_node(v, payload, leaves) for v in node["values"]],
        }
    fields = node["fields"]  # a registered node (FP16State, a loss scale), by class name
    out = {"type": kind, "kind": "CUSTOM", "entries": list(fields)}
    if "config" in node:
        out["meta"] = dict(node["config"])
    out["children"] = [_node(child, payload, leaves) for child in fields.values()]
    return out


def convert(payload: dict[str, Any], name: str) -> dict[str, Any]:
    """Verifies a version-1 payload and returns it as version 2's ``structure``/``leaves``/``tensors``.

    Raises:
      CheckpointCorruptError: an entry is missing or malformed, or the checksum differs.
    """
    corrupt = fmt.CheckpointCorruptError
    missing = [k for k in ("tree", "tensors", "tensor_info", "checksum") if k not in payload]
    if missing:
        raise corrupt(f"{name}: checkpoint lacks the entries {missing}")
    tensors, info = payload["tensors"], payload["tensor_info"]
    if type(tensors) is not list or type(info) is not list or len(tensors) != len(info):
        raise corrupt(f"{name}: the tensor table is malformed")
    header = (fmt.FORMAT, 1, payload["tree"], info)
    try:
        expected = fmt.checksum(header, tensors)
    except Exception as err:
        raise corrupt(f"{name}: cannot checksum the contents: {fmt.show(str(err))}") from None
    if expected != payload["checksum"]:
        raise corrupt(
            f"{name}: checksum mismatch, the file was modified or damaged after it was written "
            f"(stored {fmt.show(payload['checksum'], 16)}, computed {expected[:16]}...)"
        )
    leaves: list[dict] = []
    try:
        structure = _node(payload["tree"], payload, leaves)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise corrupt(f"{name}: malformed version-1 structure: {fmt.show(err)}") from None
    fmt.check_payload(structure, leaves, tensors, name)
    return {"structure": structure, "leaves": leaves, "tensors": tensors}
