"""The rules that turn intervals into verdicts, in one place (the findings page prints them).

A verdict follows the 95% interval, never the point estimate alone:

- an *effect* (a drop, a gain) counts only when its interval excludes 0 (:func:`effect`);
- *no effect* / *flat* / *within bound* is an equivalence claim: it holds only when the whole
  interval lies inside the stated margin (:func:`within_margin`); an interval that straddles
  the margin is **inconclusive**, whatever its point estimate (absence of evidence is not
  evidence of absence);
- *partly* needs an effect whose interval excludes 0;
- a family of decisions made from one table (the per-layer removals, the per-size dictionary
  points, the status table's p-values) is corrected with Holm's step-down method
  (:func:`holm`), which controls the family-wise error at 5% without assuming independence.

Every function takes interval dicts as the results store them (``{"value", "low", "high"}``).
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "FLAT_NATS",
    "FLAT_POINTS",
    "INCONCLUSIVE",
    "RULES",
    "effect",
    "holm",
    "interval_p_value",
    "p_text",
    "within_margin",
]

#: The equivalence margin of text that needs no retrieval: a prose loss change (nats/token)
#: whose whole interval lies below this counts as flat.
FLAT_NATS = 0.1
#: The equivalence margin of a knowledge task: an accuracy change whose whole interval lies
#: within +-5 points counts as flat.
FLAT_POINTS = 0.05
INCONCLUSIVE = "inconclusive"

#: The rule table printed on the findings page: ``(verdict or test, rule)``.
RULES: tuple[tuple[str, str], ...] = (
    ("effect", "an accuracy or loss change counts only when its 95% interval excludes 0"),
    (
        "flat / within bound (equivalence)",
        f"the whole 95% interval lies inside the margin: +-{100 * FLAT_POINTS:.0f} points for "
        f"knowledge accuracy, at most +{FLAT_NATS} nats/token for prose loss; an interval that "
        "crosses the margin is *inconclusive*",
    ),
    (
        "beats random heads",
        "the set's change minus the layer-matched random sets' change, paired by prompt, has a "
        "95% interval (bootstrap over draws and prompts) below 0, and its Holm-adjusted "
        "sign-flip p-value is below 0.05",
    ),
    (
        "retrieval-specific as a set",
        "the KV drop beats random heads (above) and the prose cost exceeds the random sets' by "
        f"at most {FLAT_NATS} nats/token over the whole interval",
    ),
    ("partly", "part of the claim holds with an effect whose interval excludes 0"),
    (
        "masks",
        "keeping the G&A patterns counts only when denying them lowers accuracy (denied's "
        "interval below no mask's): if denying does not hurt, keeping shows nothing",
    ),
    (
        "diminishing returns",
        "the top h heads beat random sets of h, and the accuracy the first h remove minus what "
        "the next h remove further, paired by prompt, has a 95% interval above 0",
    ),
    (
        "multiple comparisons",
        "Holm's step-down correction across each family: the layers of a pruning curve, the "
        "sizes of a dictionary curve, the p-values of the status table; p-values at the floor of "
        "their permutation count are printed as 'p <= floor'",
    ),
)


def effect(iv: Mapping[str, Any] | None) -> str:
    """``"negative"`` / ``"positive"`` when the interval excludes 0, else ``"null"``.

    Examples:
        >>> effect({"value": 5.8, "low": -0.5, "high": 11.9}), effect({"value": -1, "low": -2, "high": -0.1})
        ('null', 'negative')
    """
    if not iv or iv.get("low") is None or iv.get("high") is None:
        return "null"
    if iv["high"] < 0:
        return "negative"
    if iv["low"] > 0:
        return "positive"
    return "null"


def within_margin(iv: Mapping[str, Any], margin: float, *, two_sided: bool = True) -> str:
    """The equivalence verdict of ``iv`` against ``margin``: ``"within"`` (the whole interval
    inside), ``"outside"`` (the whole interval beyond it) or :data:`INCONCLUSIVE`.

    ``two_sided=False`` tests a cost: only the upper end must stay below ``margin``.

    Examples:
        >>> within_margin({"value": 0.054, "low": -0.033, "high": 0.139}, 0.1, two_sided=False)
        'inconclusive'
        >>> within_margin({"value": 0.02, "low": -0.01, "high": 0.04}, 0.05)
        'within'
        >>> within_margin({"value": 0.3, "low": 0.2, "high": 0.4}, 0.1, two_sided=False)
        'outside'
    """
    low, high = iv.get("low"), iv.get("high")
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return INCONCLUSIVE
    floor = -margin if two_sided else -math.inf
    if floor <= low and high <= margin:
        return "within"
    if low > margin or high < floor:
        return "outside"
    return INCONCLUSIVE


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (``None`` stays ``None`` and does not count).

    Examples:
        >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03])]
        [0.03, 0.06, 0.06]
    """
    ranked = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m = len(ranked)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def interval_p_value(iv: Mapping[str, Any]) -> float | None:
    """A two-sided p-value of "the mean is 0" read off a 95% interval (normal approximation:
    standard error = width / 3.92); for stored results that kept no p-value of their own.

    Examples:
        >>> round(interval_p_value({"value": -0.167, "low": -0.283, "high": -0.067}), 4)
        0.0024
    """
    low, high, value = iv.get("low"), iv.get("high"), iv.get("value")
    if low is None or high is None or value is None or not high > low:
        return None
    se = (high - low) / (2 * 1.959963984540054)
    return math.erfc(abs(value) / se / math.sqrt(2))


def p_text(p: float | None, n_perm: int | None = 10_000, adjusted: float | None = None) -> str:
    """``"p = 0.012"``, or ``"p <= 1e-04 (the floor of 10,000 sign flips)"`` at the floor, with
    the Holm-adjusted value after it when given.

    Examples:
        >>> p_text(9.999000099990002e-05)
        'p <= 1.0e-04 (the floor of 10,000 sign flips)'
        >>> p_text(0.012, adjusted=0.036)
        'p = 0.012 (Holm 0.036)'
    """
    if p is None:
        return "p n/a"
    floor = 1 / (n_perm + 1) if n_perm else 0.0
    if n_perm and p <= floor * (1 + 1e-9):
        text = f"p <= {1 / n_perm:.1e} (the floor of {n_perm:,} sign flips)"
    else:
        text = f"p = {p:.2g}"
    if adjusted is not None and adjusted != p:
        text += f" (Holm {adjusted:.2g})"
    return text
