"""Tolerances of float32 comparisons, derived from the arithmetic instead of one machine's rounding.

Two evaluations of the same network that differ only in how their sums are ordered (a batched
sweep vs a loop, one BLAS kernel vs another: AVX512 on one CPU, AVX2 on another) agree to the
rounding error of float32 accumulation. Each reduction of ``width`` terms adds a relative error of
about ``sqrt(width) * u`` (u = 2**-24, the unit roundoff; Higham & Mary's probabilistic bound, with
the worst case ``width * u``), and ``depth`` such reductions run one after another, so the values
of two runs, each of scale ``scale``, differ by at most about ``2 * depth * sqrt(width) * u *
scale``. :func:`fp32_tolerance` returns that times a safety factor of 4 (error growth through
nonlinearities and normalizations), far below every effect the tests compare against.
"""

import math

UNIT_ROUNDOFF = 2.0**-24


def fp32_tolerance(scale: float, depth: int, width: int, safety: float = 4.0) -> float:
    """Absolute tolerance between two float32 runs of ``depth`` chained reductions of ``width``
    terms whose results are of magnitude ``scale`` (see the module docstring)."""
    return safety * 2 * depth * math.sqrt(width) * UNIT_ROUNDOFF * scale
