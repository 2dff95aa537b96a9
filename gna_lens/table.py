"""One base for gna_lens's result tables: JSON both ways, a data frame, the files on disk.

:class:`Record` gives a frozen dataclass ``to_dict()`` and ``from_dict()`` field by field
(:class:`~gna_lens.stats.Estimate` as its dict, nested records as theirs, tuples as lists, NaN as
``None``; read back by the fields' types); :class:`Table` adds ``write()``: ``table.md``,
``.csv`` (``to_dataframe()``), ``.json`` (``to_dict()``) and, where the table draws itself,
``.svg``.

Examples:
    >>> from dataclasses import dataclass
    >>> from gna_lens.stats import Estimate
    >>> @dataclass(frozen=True)
    ... class Row(Record):
    ...     heads: tuple[tuple[int, int], ...]
    ...     accuracy: Estimate
    ...     loss: float = float("nan")
    >>> row = Row(((0, 1),), Estimate(0.5, 0.25, 0.75, 12, "wilson"))
    >>> row.to_dict()["heads"], row.to_dict()["loss"]
    ([[0, 1]], None)
    >>> Row.from_dict(row.to_dict()).accuracy == row.accuracy
    True
"""

import json
import math
import types
from abc import ABC, abstractmethod
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar, Self, Union, get_args, get_origin, get_type_hints

from gna_lens.stats import Estimate

__all__ = ["Record", "Table"]


class Record:
    """``to_dict`` / ``from_dict`` for a frozen dataclass, field by field.

    A subclass lists in ``_not_saved`` the fields ``to_dict`` leaves out (their defaults come
    back in ``from_dict``) and overrides :meth:`to_dict` to add derived keys, which
    ``from_dict`` ignores.
    """

    _not_saved: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (NaN and infinities as ``None``)."""
        return {
            f.name: to_json(getattr(self, f.name))
            for f in fields(self)  # type: ignore[arg-type]
            if f.name not in self._not_saved
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The record of :meth:`to_dict` (missing keys: the fields' defaults)."""
        hints = get_type_hints(cls)
        kwargs = {
            f.name: from_json(hints[f.name], data[f.name])
            for f in fields(cls)  # type: ignore[arg-type]
            if f.name in data
        }
        return cls(**kwargs)


class Table(Record, ABC):
    """A :class:`Record` with a data frame, markdown, and files on disk."""

    #: The files' name without the suffix.
    _stem: ClassVar[str] = "table"

    @abstractmethod
    def to_dataframe(self) -> Any:
        """One row per cell of the table (a ``pandas.DataFrame``)."""

    @abstractmethod
    def to_markdown(self) -> str:
        """The table and how it was made, as markdown."""

    def write(self, folder: str | Path) -> dict[str, Path]:
        """Write ``table.md``, ``table.csv``, ``table.json`` and, where the table has
        ``to_svg()``, ``table.svg`` into ``folder`` (made if missing).

        Returns:
            ``{"markdown": ..., "csv": ..., "json": ...}`` and ``"svg"`` when written.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {
            kind: folder / f"{self._stem}.{ext}"
            for kind, ext in [("markdown", "md"), ("csv", "csv"), ("json", "json")]
        }
        paths["markdown"].write_text(self.to_markdown(), encoding="utf-8")
        self.to_dataframe().to_csv(paths["csv"], index=False)
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        to_svg = getattr(self, "to_svg", None)
        if to_svg is not None:
            paths["svg"] = folder / f"{self._stem}.svg"
            paths["svg"].write_text(to_svg(), encoding="utf-8")
        return paths


def to_json(value: Any) -> Any:
    """``value`` as JSON-ready data: anything with ``to_dict()`` (estimates, records) as its dict,
    tuples as lists, dict keys as strings, NaN and infinities as ``None``."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


def from_json(kind: Any, value: Any) -> Any:
    """``value`` (from :func:`to_json`) back as the type ``kind``."""
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType) and value is not None:
        kind = next(a for a in args if a is not type(None))
        origin, args = get_origin(kind), get_args(kind)
    if kind is float:
        return math.nan if value is None else float(value)
    if value is None:
        return None
    if isinstance(kind, type) and issubclass(kind, Estimate | Record):
        return kind.from_dict(value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(args[0], v) for v in value)
        return tuple(from_json(a, v) for a, v in zip(args, value, strict=True))
    if origin is dict:
        return {from_json(args[0], k): from_json(args[1], v) for k, v in value.items()}
    if kind in (int, str, bool):
        return kind(value)
    return value
