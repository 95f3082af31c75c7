r"""The programs the step-scalars op evaluates: declared schedule forms as numbers.

A form (``transforms.schedules.declared_form``, or one of the counts' functions below)
is encoded as its kind's code and its numbers, a join as its parts' programs in turn;
the op takes, for each count, a sign and a program. :func:`program` encodes,
:func:`decode` reads them back (the reference's and the Triton host code's reading);
the C++ kernel parses the same layout.
"""

from __future__ import annotations

__all__ = ["KINDS", "program", "decode"]

KINDS = {
    "constant": 0, "linear": 1, "polynomial": 2, "exponential": 3, "piecewise": 4,
    "cosine": 5, "join": 6, "count": 7, "inv_c1": 8, "sqrt_c2": 9, "inverse": 10,
}  # fmt: skip
r"""The kinds of program. Besides the schedules, functions of a count that a step reads:
``("count",)`` the step count after this step as PyTorch's fused Adam reads it,
:math:`\operatorname{fl}_{32}(\operatorname{fl}_{32}(c) + 1)` (``step_scalars.count_after``);
``("inv_c1", b1)`` and ``("sqrt_c2", b2)`` Adam's bias corrections at the count after
this step (``transforms.adam.bias_corrections``); ``("inverse",)`` the unscale factor
:math:`\operatorname{fl}_{32}(1/\operatorname{fl}_{64}(s))` of a float32 scale given as
its bits (an int32 view; ``loss_scale.unscale_factor``)."""


def program(form: tuple) -> list[float]:
    """A declared schedule form as the kernels' program: its kind, then its numbers."""
    kind, *args = form
    code = float(KINDS[kind])
    if kind == "exponential":
        v0, steps, rate, begin, staircase, end = args
        has_end = end is not None
        return [code, v0, steps, rate, begin, float(staircase), float(has_end), end or 0.0]
    if kind == "piecewise":
        v0, bounds, values = args
        return [code, v0, float(len(bounds)), *bounds, *values]
    if kind == "join":
        forms, boundaries = args
        out = [code, float(len(forms)), *map(float, boundaries)]
        for f in forms:
            out += program(f)
        return out
    return [code, *map(float, args)]


def decode(programs, n: int) -> list[tuple[int, float, tuple]]:
    """``(start, sign, form)`` of each of the ``n`` signed programs in ``programs`` (the
    inverse of :func:`program`; ``start`` is the sign's index)."""
    numbers = [float(x) for x in programs]
    out, at = [], 0
    for _ in range(n):
        form, end = _read(numbers, at + 1)
        out.append((at, numbers[at], form))
        at = end
    if at != len(numbers):
        raise ValueError("programs: more numbers than the schedules take")
    return out


def _read(x: list[float], at: int) -> tuple[tuple, int]:
    """The form whose program begins at ``x[at]``, and where the next one begins."""
    kind = _NAMES[int(x[at])]
    a = x[at + 1 :]
    if kind in ("count", "inverse"):
        return (kind,), at + 1
    if kind in ("constant", "inv_c1", "sqrt_c2"):
        return (kind, a[0]), at + 2
    if kind == "linear":
        return (kind, a[0], a[1], int(a[2]), int(a[3])), at + 5
    if kind == "polynomial":
        return (kind, a[0], a[1], a[2], int(a[3]), int(a[4])), at + 6
    if kind == "exponential":
        end = a[6] if a[5] else None
        return (kind, a[0], int(a[1]), a[2], int(a[3]), bool(a[4]), end), at + 8
    if kind == "piecewise":
        k = int(a[1])
        return (kind, a[0], tuple(a[2 : 2 + k]), tuple(a[2 + k : 2 + 2 * k])), at + 3 + 2 * k
    if kind == "cosine":
        return (kind, a[0], int(a[1]), a[2], a[3]), at + 5
    k = int(a[0])  # join: its parts' count, their boundaries, their programs
    boundaries = tuple(int(b) for b in a[1:k])
    forms, next_at = [], at + 1 + k
    for _ in range(k):
        form, next_at = _read(x, next_at)
        forms.append(form)
    return (kind, tuple(forms), boundaries), next_at


_NAMES = {v: k for k, v in KINDS.items()}
