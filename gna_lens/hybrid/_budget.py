"""How much a distillation may spend: tokens or wall-clock minutes (:func:`parse_budget`)."""

import math
import re
from dataclasses import dataclass
from typing import Any

from gna_lens.errors import ConfigError

__all__ = ["Budget", "parse_budget"]

_SCALE = {"": 1, "k": 1_000, "m": 1_000_000, "b": 1_000_000_000, "g": 1_000_000_000}
_TOKEN_UNITS = ("tokens", "token", "tok", "toks")
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
}  # fmt: skip
_RE = re.compile(
    r"^\s*(?P<num>\d[\d_,]*(?:\.\d+)?)\s*(?P<scale>[kKmMbBgG]?)\s*(?P<unit>[A-Za-z]*)\s*$"
)
_EXAMPLES = "e.g. 200000, '2M tokens', '500k tokens', '20 min', '90 s' or '1.5 h'"


@dataclass(frozen=True)
class Budget:
    """A distillation budget: a number of tokens or a wall-clock time (exactly one is set).

    Token budgets are reproducible: the same budget stops at the same step, so a resumed run
    gives the uninterrupted run's weights bit for bit. Time budgets stop wherever the clock
    says, which depends on the machine and its load.

    Attributes:
        tokens: Tokens the model reads (non-padding positions of the batches), or ``None``.
        seconds: Wall-clock seconds, or ``None``.
    """

    tokens: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.seconds is None):
            raise ConfigError(
                f"Budget(tokens={self.tokens!r}, seconds={self.seconds!r}); expected exactly one "
                f"of tokens or seconds ({_EXAMPLES})."
            )

    def describe(self) -> str:
        """``"2,000,000 tokens"`` or ``"20.0 min"``."""
        if self.tokens is not None:
            return f"{self.tokens:,} tokens"
        assert self.seconds is not None
        return f"{self.seconds / 60:.1f} min" if self.seconds >= 60 else f"{self.seconds:g} s"

    def fraction(self, tokens: int, seconds: float) -> float:
        """How much of the budget ``tokens`` read in ``seconds`` have spent (0 to 1)."""
        if self.tokens is not None:
            return min(1.0, tokens / self.tokens)
        assert self.seconds is not None
        return min(1.0, seconds / self.seconds)

    def spent(self, tokens: int, seconds: float) -> bool:
        """Whether the budget is used up."""
        return self.fraction(tokens, seconds) >= 1.0

    def share(self, part: float) -> "Budget":
        """``part`` of this budget (at least one token or one second)."""
        if self.tokens is not None:
            return Budget(tokens=max(1, round(self.tokens * part)))
        assert self.seconds is not None
        return Budget(seconds=max(1.0, self.seconds * part))

    def to_dict(self) -> dict[str, Any]:
        """``{"tokens": ..., "seconds": ..., "text": ...}``."""
        return {"tokens": self.tokens, "seconds": self.seconds, "text": self.describe()}


def parse_budget(value: Any, *, where: str = "budget") -> Budget:
    """A :class:`Budget` from an int (tokens), a string or a :class:`Budget`.

    Strings are a number, an optional ``k`` / ``M`` / ``B`` multiplier and a unit: tokens
    (``"2M tokens"``, ``"500k tok"``) or time (``"20 min"``, ``"90 s"``, ``"1.5 h"``).

    Args:
        value: The budget.
        where: The argument's name, for messages.

    Returns:
        The budget.

    Raises:
        ConfigError: For anything else: a bool, a float without unit, zero or a negative
            number, a string without unit or with an unknown one, ``"2M"`` (million or minutes?).
            The message repeats what was passed.

    Examples:
        >>> parse_budget("2M tokens").tokens, parse_budget(5000).tokens
        (2000000, 5000)
        >>> parse_budget("20 min").seconds, parse_budget("1.5h").describe()
        (1200.0, '90.0 min')
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            f"{where}={value!r} ({type(value).__name__}); expected an int number of tokens or a "
            f"string with a unit, {_EXAMPLES}."
        )
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{where}={value!r}; expected a positive number of tokens.")
        return Budget(tokens=value)
    match = _RE.match(value)
    if match is None:
        raise ConfigError(f"{where}={value!r}: not a number with a unit; expected {_EXAMPLES}.")
    number = float(match["num"].replace("_", "").replace(",", ""))
    scale, unit = match["scale"].lower(), match["unit"].lower()
    if (scale + unit) in _TOKEN_UNITS or (scale + unit) in _TIME_UNITS:
        scale, unit = "", scale + unit  # "20 min", "3 h": the letter was the unit's
    if not unit:
        if scale == "m":
            raise ConfigError(
                f"{where}={value!r} is ambiguous: million tokens or minutes? Write "
                f"'{match['num']}M tokens' or '{match['num']} min'."
            )
        raise ConfigError(
            f"{where}={value!r} has no unit; expected tokens or a time, {_EXAMPLES} (an int "
            "without quotes counts tokens)."
        )
    if unit in _TOKEN_UNITS:
        tokens = number * _SCALE[scale]
        if tokens < 1 or not math.isfinite(tokens):
            raise ConfigError(f"{where}={value!r}; expected at least one token.")
        return Budget(tokens=round(tokens))
    if unit in _TIME_UNITS:
        if scale:
            raise ConfigError(
                f"{where}={value!r}: a multiplier ({match['scale']}) on a time; write the time "
                "itself, e.g. '20 min' or '2 h'."
            )
        seconds = number * _TIME_UNITS[unit]
        if seconds <= 0:
            raise ConfigError(f"{where}={value!r}; expected a positive time.")
        return Budget(seconds=seconds)
    raise ConfigError(
        f"{where}={value!r}: unknown unit {match['unit']!r}; expected tokens ({', '.join(_TOKEN_UNITS)}) "
        f"or a time (s, min, h), {_EXAMPLES}."
    )
