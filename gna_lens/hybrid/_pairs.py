"""Validation of ``(layer, head)`` lists shared by :func:`~gna_lens.hybrid.build_hybrid` and
:func:`~gna_lens.hybrid.swap_heads`."""

from collections.abc import Callable, Iterable
from typing import Any

from gna_lens.errors import ConfigError

#: A head, ``(layer, head)``.
Head = tuple[int, int]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def head_pairs(value: Any, call: str, where: str) -> list[tuple[int, int]]:
    """``value`` as a list of ``(layer, head)`` int pairs, or a ConfigError that repeats it.

    Args:
        value: What the caller passed.
        call: How to name the argument in errors, e.g. ``"build_hybrid(keep"``.
        where: Which heads exist, in words (appended to every error).
    """
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigError(f"{call}={value!r}); expected a list of (layer, head) pairs ({where}).")
    items = list(value)
    if len(items) == 2 and all(_is_int(x) for x in items):
        raise ConfigError(
            f"{call}={value!r}) is one (layer, head) pair; expected a list of pairs, "
            f"e.g. [{tuple(items)!r}]."
        )
    out = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and all(map(_is_int, item))):
            raise ConfigError(
                f"{call}=...) contains {item!r}; expected (layer, head) pairs of ints ({where}), "
                "e.g. [(3, 2), (4, 0)]."
            )
        out.append((int(item[0]), int(item[1])))
    return out


def by_layer(items: list[Head]) -> dict[int, list[int]]:
    """Per layer (in order), its heads of ``items`` (sorted, each once)."""
    return {
        layer: sorted({h for i, h in items if i == layer})
        for layer in sorted({i for i, _ in items})
    }


def check_listed(
    items: list[Any], call: str, what: str, where: str, ok: Callable[..., bool]
) -> None:
    """Refuse an empty ``items``, items out of range (``ok`` false) and items listed twice.

    Args:
        items: The items, e.g. layer indices.
        call: How to name the argument as passed, e.g. ``"swap_layers(layers=[0, 0]"``.
        what: One item in words (``"layer"``).
        where: Which items exist, in words.
    """
    if not items:
        raise ConfigError(f"{call}): no {what} to swap ({where}).")
    bad = [i for i in items if not ok(i)]
    if bad:
        raise ConfigError(f"{call}): {bad} out of range: {where}.")
    twice = sorted({i for i in items if items.count(i) > 1})
    if twice:
        raise ConfigError(f"{call}) names {twice} more than once; list each {what} once.")
