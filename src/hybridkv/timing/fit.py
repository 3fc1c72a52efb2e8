"""Least-squares fit of the step-cost coefficients to measured steps (stdlib only).

``fit_coefficients`` minimises the *relative* error ``Σ ((pred − t) / t)²`` over the
measured steps with every coefficient ``≥ 0`` (active set: solve the normal equations on
the free coefficients, pin the most negative one to 0, repeat), so a handful of long
prefills does not drown the many short decode steps.

>>> rows = [[1.0, 2.0], [1.0, 4.0], [1.0, 8.0]]          # t = 0.5 + 0.25 x
>>> [round(c, 6) for c in fit_coefficients(rows, [1.0, 1.5, 2.5])]
[0.5, 0.25]
>>> [round(c, 6) for c in fit_coefficients([[1.0, 1.0], [1.0, 2.0]], [2.0, 1.0])]
[1.2, 0.0]

(The slope would be negative: pinned to 0; then ``c`` minimises ``((c − 2) / 2)² +
(c − 1)²``: ``c = 1.2``.)
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.errors import ConfigError


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular column gets 0."""
    n = len(vector)
    a = [[*row, vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            continue
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col and a[r][col]:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] if abs(a[i][i]) >= 1e-300 else 0.0 for i in range(n)]


def fit_coefficients(rows: Sequence[Sequence[float]], targets: Sequence[float],
                     fixed_zero: Sequence[int] = (),
                     lower: Sequence[float] | None = None) -> list[float]:
    """Coefficients ``c >= lower`` (default 0) minimising ``Σ_i ((rows_i · c − t_i) / t_i)²``.

    ``fixed_zero``: coefficients kept at their lower bound (terms the calibration cannot
    see); ``lower``: floors, e.g. 1.0 for an efficiency term (nothing runs above the
    datasheet peak).

    >>> [round(c, 4) for c in fit_coefficients([[1.0, 1.0], [1.0, 2.0]], [2.0, 3.0],
    ...                                         lower=[0.0, 1.5])]
    [0.3462, 1.5]

    (The slope stays at its floor 1.5; ``c₀`` minimises ``((c₀ − 0.5) / 2)² + (c₀ / 3)²``:
    ``c₀ = 0.125 / (1/4 + 1/9)``.)
    """
    if not rows or len(rows) != len(targets) or any(t <= 0 for t in targets):
        raise ConfigError("targets", len(targets), "one positive time per feature row")
    width = len(rows[0])
    floor = [float(x) for x in lower] if lower is not None else [0.0] * width
    scaled = [[x / t for x in row] for row, t in zip(rows, targets, strict=True)]
    rest = [1.0 - sum(f * x for f, x in zip(floor, row, strict=True))
            for row in scaled]   # (t − floor · row) / t: what the free part must explain
    # columns scaled to unit norm so the elimination sees similar magnitudes
    norms = [max(sum(r[j] ** 2 for r in scaled) ** 0.5, 1e-300) for j in range(width)]
    skip = set(fixed_zero)
    free = [j for j in range(width) if j not in skip and norms[j] > 1e-300]
    solution: list[float] = []
    while free:
        gram = [[sum(r[i] * r[j] for r in scaled) / (norms[i] * norms[j]) for j in free]
                for i in free]
        rhs = [sum(r[i] * y for r, y in zip(scaled, rest, strict=True)) / norms[i]
               for i in free]
        solution = _solve(gram, rhs)
        worst = min(range(len(free)), key=lambda k: solution[k])
        if solution[worst] >= 0:
            break
        free.pop(worst)
        solution = []
    coefficients = list(floor)
    for j, value in zip(free, solution, strict=True):
        coefficients[j] += value / norms[j]
    return coefficients


def relative_errors(rows: Sequence[Sequence[float]], targets: Sequence[float],
                    coefficients: Sequence[float]) -> list[float]:
    """``(predicted − measured) / measured`` per row.

    >>> relative_errors([[1.0, 2.0]], [2.0], [0.5, 1.0])
    [0.25]
    """
    return [(sum(c * x for c, x in zip(coefficients, row, strict=True)) - t) / t
            for row, t in zip(rows, targets, strict=True)]
