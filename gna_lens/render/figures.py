"""Dependency-free SVG line charts: the findings page's figures (no matplotlib, no browser).

The output is deterministic (the same input gives the same bytes) and valid XML: each series is
one ``<path class="series">``, each band one ``<polygon class="band">``, each reference line one
``<polyline class="reference">``. Missing values (``None`` or NaN) break a line.

The figures read the JSON-ready dicts the findings experiments return (or their JSON read back);
this module never imports :mod:`gna_lens.findings`.
"""

import math
from collections.abc import Mapping, Sequence
from itertools import groupby
from typing import Any, cast
from xml.sax.saxutils import escape

from gna_lens.errors import ConfigError

__all__ = ["chart_grid", "dictionary_figure", "line_chart", "pruning_figure"]

#: Series colours, in order (colour-blind-safe Tableau tones).
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
#: Panel size and margins, in pixels.
PANEL_W, PANEL_H = 380, 240
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 30, 42
LEGEND_H = 18
#: Width of one character of the 11 px sans-serif text, for layout (a generous estimate).
CHAR_W = 6.6
#: Reference lines: chance, and the others' default look.
_CHANCE = {"name": "chance", "dash": "5 4", "color": "black"}
REF_DASH, REF_COLOR = "2 3", "#777"


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) or math.isinf(f) else f


def _fmt(v: float) -> str:
    """A coordinate with one decimal (``-0.0`` written ``0.0``): the same input, the same bytes."""
    s = f"{v:.1f}"
    return "0.0" if s == "-0.0" else s


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering ``[lo, hi]``."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out = []
    v = first
    while v <= hi + 1e-9 * step:
        out.append(round(v, 10))
        v += step
    return out


def _tick_label(v: float, percent: bool) -> str:
    if percent:
        return f"{100 * v:.0f}%"
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


def _check_series(series: Sequence[Mapping[str, Any]], where: str) -> None:
    if isinstance(series, Mapping) or not isinstance(series, Sequence):
        raise ConfigError(
            f"{where}: series={series!r}; expected a list of dicts like {{'name': 'top-4 "
            "removed', 'x': [2, 4], 'y': [0.9, 0.5], 'low': [...], 'high': [...]}."
        )
    for s in series:
        if not isinstance(s, Mapping) or "x" not in s or "y" not in s:
            raise ConfigError(
                f"{where}: a series is {s!r}; expected a dict with 'name', 'x' and 'y' (and "
                "optional 'low' / 'high' band values, 'color', 'dash')."
            )
        n = len(s["x"])
        for key in ("y", "low", "high"):
            if s.get(key) is not None and len(s[key]) != n:
                raise ConfigError(
                    f"{where}: series {s.get('name', '?')!r} has {n} x values but "
                    f"{len(s[key])} {key!r} values; expected one per x."
                )


def _panel(x0: float, y0: float, p: Mapping[str, Any], size: tuple[int, int]) -> list[str]:
    """One panel's elements (``p``: :func:`line_chart`'s arguments), its plot box starting at
    ``(x0 + LEFT, y0 + TOP)``."""
    series, chance, x_ticks = p["series"], p.get("chance"), p.get("x_ticks")
    y_range: tuple[float, float] | None = p.get("y_range")
    bands, x_log2, percent = p.get("bands", True), p.get("x_log2", False), p.get("percent", False)
    refs = list(p.get("references", ()))
    if chance is not None:
        if isinstance(chance, int | float):
            xs_ok = [x for s in series for x in map(_num, s["x"]) if x is not None]
            if xs_ok:
                refs.append({"x": [min(xs_ok), max(xs_ok)], "y": [chance, chance]} | _CHANCE)
        else:
            refs.append({"x": list(series[0]["x"]), "y": list(chance)} | _CHANCE)
    xs = [
        x
        for s in list(series) + refs
        for x in (_num(v) for v in s["x"])
        if x is not None and (not x_log2 or x > 0)
    ]
    ys = [
        y
        for s in list(series) + refs
        for key in ("y", "low", "high")
        if s.get(key) is not None and (key == "y" or bands)
        for y in (_num(v) for v in s[key])
        if y is not None
    ]
    fx = math.log2 if x_log2 else (lambda v: v)
    x_lo, x_hi = (min(map(fx, xs)), max(map(fx, xs))) if xs else (0.0, 1.0)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    if y_range is not None:
        y_lo, y_hi = y_range
    else:
        y_lo, y_hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
        pad = 0.05 * (y_hi - y_lo) or 0.5
        y_lo, y_hi = y_lo - pad, y_hi + pad
    w, h = size[0] - LEFT - RIGHT, size[1] - TOP - BOTTOM
    bx, by = x0 + LEFT, y0 + TOP

    def px(v: float) -> float:
        return bx + w * (fx(v) - x_lo) / (x_hi - x_lo)

    def py(v: float) -> float:
        v = min(max(v, y_lo), y_hi)  # clip what lies outside a fixed y_range
        return by + h * (1 - (v - y_lo) / (y_hi - y_lo))

    out = [
        f'<text x="{_fmt(bx + w / 2)}" y="{_fmt(y0 + 16)}" text-anchor="middle" '
        f'font-size="12">{escape(str(p.get("title", "")))}</text>',
        f'<rect x="{_fmt(bx)}" y="{_fmt(by)}" width="{_fmt(w)}" height="{_fmt(h)}" '
        'fill="none" stroke="#888"/>',
    ]
    for t in _ticks(y_lo, y_hi):
        out.append(
            f'<line x1="{_fmt(bx)}" x2="{_fmt(bx + w)}" y1="{_fmt(py(t))}" y2="{_fmt(py(t))}" '
            'stroke="#e5e5e5"/>'
            f'<text x="{_fmt(bx - 5)}" y="{_fmt(py(t) + 4)}" text-anchor="end">'
            f"{escape(_tick_label(t, percent))}</text>"
        )
    if x_ticks is None:
        x_ticks = (
            sorted({x for x in xs if x > 0})
            if x_log2
            else [t for t in _ticks(x_lo, x_hi, 7) if x_lo - 1e-9 <= t <= x_hi + 1e-9]
        )
    for t in x_ticks:
        out.append(
            f'<text x="{_fmt(px(t))}" y="{_fmt(by + h + 14)}" text-anchor="middle">'
            f"{escape(_tick_label(t, False))}</text>"
        )
    out.append(
        f'<text x="{_fmt(bx + w / 2)}" y="{_fmt(by + h + 32)}" text-anchor="middle">'
        f"{escape(str(p.get('x_label', '')))}</text>"
        f'<text transform="translate({_fmt(x0 + 14)},{_fmt(by + h / 2)}) rotate(-90)" '
        f'text-anchor="middle">{escape(str(p.get("y_label", "")))}</text>'
    )
    for ref in refs:
        pts = [
            (px(x), py(y))
            for x, y in zip(map(_num, ref["x"]), map(_num, ref["y"]), strict=True)
            if x is not None and y is not None and (not x_log2 or x > 0)
        ]
        if pts:
            dash, color = ref.get("dash", REF_DASH), ref.get("color", REF_COLOR)
            out.append(
                '<polyline class="reference" points="'
                + " ".join(f"{_fmt(a)},{_fmt(b)}" for a, b in pts)
                + f'" fill="none" stroke="{color}" stroke-dasharray="{dash}"/>'
            )
    for i, s in enumerate(series):
        color = s.get("color", PALETTE[i % len(PALETTE)])
        xv = [_num(v) for v in s["x"]]
        yv = [_num(v) for v in s["y"]]
        if bands and s.get("low") is not None and s.get("high") is not None:
            for run in _runs(xv, [_num(v) for v in s["low"]], [_num(v) for v in s["high"]]):
                upper = [(px(x), py(hi)) for x, _, hi in run]
                lower = [(px(x), py(lo)) for x, lo, _ in reversed(run)]
                out.append(
                    '<polygon class="band" points="'
                    + " ".join(f"{_fmt(a)},{_fmt(b)}" for a, b in upper + lower)
                    + f'" fill="{color}" fill-opacity="0.15" stroke="none"/>'
                )
        runs = _runs(xv, yv, yv)
        d = " ".join("M" + " L".join(f"{_fmt(px(x))},{_fmt(py(y))}" for x, y, _ in r) for r in runs)
        dash = f' stroke-dasharray="{s["dash"]}"' if s.get("dash") else ""
        out.append(
            f'<path class="series" d="{d}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>'
        )
        for run in runs:
            for x, y, _ in run:
                out.append(
                    f'<circle cx="{_fmt(px(x))}" cy="{_fmt(py(y))}" r="2.5" fill="{color}"/>'
                )
                if not y_lo <= y <= y_hi:  # drawn at the edge: say where it really is
                    up = y > y_hi
                    out.append(
                        f'<text class="clipped" x="{_fmt(px(x) + 4)}" '
                        f'y="{_fmt(py(y) + (11 if up else -4))}" fill="{color}">'
                        f"{'&#8593;' if up else '&#8595;'} {_tick_label(y, percent)}</text>"
                    )
    return out


def _runs(
    xs: Sequence[float | None], a: Sequence[float | None], b: Sequence[float | None]
) -> list[list[tuple[float, float, float]]]:
    """Consecutive points where ``x``, ``a`` and ``b`` are all present, as runs."""
    points = [None if None in t else t for t in zip(xs, a, b, strict=True)]
    runs = [list(run) for full, run in groupby(points, lambda t: t is not None) if full]
    return cast(list[list[tuple[float, float, float]]], runs)


def _legend(
    x0: float, y: float, width: float, entries: Sequence[tuple[str, str, str]]
) -> tuple[list[str], int]:
    """The legend's ``(label, colour, dash)`` entries in rows no wider than ``width``; its
    elements and its number of rows."""
    out = []
    x, rows = x0, 1
    for label, color, dash in entries:
        size = 36 + CHAR_W * len(label)
        if x > x0 and x + size > x0 + width:
            x, y, rows = x0, y + LEGEND_H, rows + 1
        style = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{_fmt(x)}" x2="{_fmt(x + 18)}" y1="{_fmt(y)}" y2="{_fmt(y)}" '
            f'stroke="{color}" stroke-width="2"{style}/>'
            f'<text x="{_fmt(x + 22)}" y="{_fmt(y + 4)}">{escape(label)}</text>'
        )
        x += size
    return out, rows


def _wrap(text: str, width: float, char_w: float) -> list[str]:
    """``text`` in lines that fit ``width`` pixels (words kept whole)."""
    limit = max(10, int(width / char_w))
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= limit:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def chart_grid(
    panels: Sequence[Mapping[str, Any]],
    *,
    title: str = "",
    note: str = "",
    cols: int = 2,
    panel_size: tuple[int, int] = (PANEL_W, PANEL_H),
) -> str:
    """Several :func:`line_chart` panels in a grid, one legend for all, as one SVG document.

    Args:
        panels: One dict of :func:`line_chart` keyword arguments per panel (``series``
            required; the panel's own ``title``).
        title: The figure's title.
        note: A line of small print under the legend (e.g. the intervals' method).
        cols: Panels per row.
        panel_size: Each panel's ``(width, height)`` in pixels, axes and labels included.

    Returns:
        The SVG document.

    Raises:
        ConfigError: For no panels, or a series that is not a dict of equal-length lists.
    """
    if not panels:
        raise ConfigError("chart_grid(panels=[]); expected at least one panel.")
    if not isinstance(cols, int) or cols < 1:
        raise ConfigError(f"cols={cols!r}; expected a positive int.")
    pw, ph = panel_size
    if min(pw, ph) < 160:
        raise ConfigError(
            f"panel_size={panel_size!r}; expected (width, height) of at least 160 px."
        )
    cols = min(cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    width = cols * pw + 10
    title_lines = _wrap(title, width - 20, 1.2 * CHAR_W)
    head = 8 + 17 * len(title_lines)
    entries: list[tuple[str, str, str]] = []  # each line's (label, colour, dash), once
    for p in panels:
        _check_series(p["series"], f"panel {p.get('title', '')!r}")
        for i, s in enumerate(p["series"]):
            color = s.get("color", PALETTE[i % len(PALETTE)])
            entries.append((str(s.get("name", "")), color, str(s.get("dash", ""))))
        refs = [*p.get("references", ()), *([_CHANCE] if p.get("chance") is not None else [])]
        entries += [(str(r.get("name", "")), r.get("color", REF_COLOR), r.get("dash", REF_DASH))
                    for r in refs]  # fmt: skip
    entries = list(dict.fromkeys(entries))
    ly = head + rows * ph + 10
    legend, n_rows = _legend(5 + LEFT, ly, width - LEFT - 10, entries)
    note_lines = _wrap(note, width - LEFT - 10, CHAR_W)
    height = ly + n_rows * LEGEND_H + 15 * len(note_lines)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for i, line in enumerate(title_lines):
        out.append(f'<text x="10" y="{18 + 17 * i}" font-size="13">{escape(line)}</text>')
    for k, p in enumerate(panels):
        r, c = divmod(k, cols)
        out += _panel(5 + c * pw, head + r * ph, p, (pw, ph))
    out += legend
    for i, line in enumerate(note_lines):
        y = ly + n_rows * LEGEND_H + 2 + 15 * i
        out.append(f'<text x="{5 + LEFT}" y="{y}" fill="#555">{escape(line)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def line_chart(
    series: Sequence[Mapping[str, Any]],
    x_label: str,
    y_label: str,
    title: str = "",
    y_range: tuple[float, float] | None = None,
    bands: bool = True,
    *,
    chance: float | Sequence[float] | None = None,
    references: Sequence[Mapping[str, Any]] = (),
    x_ticks: Sequence[float] | None = None,
    x_log2: bool = False,
    percent: bool = False,
    note: str = "",
    size: tuple[int, int] = (520, 300),
) -> str:
    """A line chart as a self-contained SVG document: lines with 95% bands, chance, a legend.

    Args:
        series: ``[{"name", "x", "y", "low", "high", "color", "dash"}, ...]``: ``low`` /
            ``high`` (optional) draw the band; ``None`` or NaN values break the line.
        x_label: The x axis's label.
        y_label: The y axis's label.
        title: The chart's title.
        y_range: ``(low, high)`` of the y axis (default: the data's, padded); values outside
            are drawn at the edge.
        bands: Draw the interval bands.
        chance: A dashed black chance line: one value (horizontal) or one per x of the first
            series (e.g. ``1 / n_pairs``).
        references: More dashed lines ``{"name", "x", "y", "dash", "color"}`` (e.g. a
            baseline).
        x_ticks: Where the x ticks go (default: round values; with ``x_log2``, the data's).
        x_log2: A log2 x axis (dictionary sizes 2, 4, ... 32).
        percent: Label the y ticks as percentages (for accuracies in ``[0, 1]``).
        note: Small print under the legend.
        size: The panel's ``(width, height)`` in pixels.

    Returns:
        The SVG document (a string ending in a newline).

    Raises:
        ConfigError: If a series is not a dict of equal-length ``x`` / ``y`` / ``low`` /
            ``high`` lists.

    Examples:
        >>> import xml.etree.ElementTree as ET
        >>> svg = line_chart([{"name": "top-4 removed", "x": [2, 4, 8], "y": [0.9, 0.6, None],
        ...                    "low": [0.8, 0.5, None], "high": [0.95, 0.7, None]}],
        ...                  "pairs", "accuracy", chance=0.25, percent=True)
        >>> root = ET.fromstring(svg)
        >>> len(root.findall("{http://www.w3.org/2000/svg}path"))
        1
    """
    panel = dict(
        series=series, title="", x_label=x_label, y_label=y_label, y_range=y_range,
        bands=bands, chance=chance, references=references, x_ticks=x_ticks, x_log2=x_log2,
        percent=percent,
    )  # fmt: skip
    return chart_grid([panel], title=title, note=note, cols=1, panel_size=size)


# ----------------------------------------------------------------------------- page figures
def _series(
    name: str, xs: list[Any], points: Sequence[Mapping[str, Any]], key: str
) -> dict[str, Any]:
    """A series of the points' ``key`` intervals: their values, with their ends as the band."""
    ivs = [p.get(key) or {} for p in points]
    y, low, high = ([iv.get(k) for iv in ivs] for k in ("value", "low", "high"))
    return {"name": name, "x": xs, "y": y, "low": low, "high": high}


def _check_result(result: Any, caller: str, maker: str, need: Sequence[str]) -> None:
    """Refuse a ``result`` that lacks the keys ``maker`` (a findings experiment) writes."""
    if not isinstance(result, Mapping) or any(k not in result for k in need):
        have = sorted(result) if isinstance(result, Mapping) else type(result).__name__
        raise ConfigError(
            f"{caller} got a result with keys {have}; expected {maker}'s dict (keys "
            f"{list(need)}). Fix: pass gna_lens.findings.layers.{maker}(...)."
        )


def _model_name(result: Mapping[str, Any]) -> str:
    """The model's short name, else its description."""
    return str(result.get("model_name") or result.get("model", ""))


def _control_range(
    grad: Sequence[Mapping[str, Any]], ind: Sequence[Mapping[str, Any]], n_layers: int
) -> tuple[float, float] | None:
    """The control panel's y range: the data's, unless removing every layer costs more than
    twice what any other point does (a bigram model's loss dwarfs the rest); that point is then
    drawn at the edge with its value written next to it."""

    def span(points: Sequence[Mapping[str, Any]]) -> list[float]:
        ivs = [p.get("control_change") or {} for p in points]
        values = [_num(iv.get(k)) for iv in ivs for k in ("value", "low", "high")]
        return [v for v in values if v is not None]

    rest = span([p for p in grad if p.get("removed") != n_layers] + list(ind))
    every = span([p for p in grad if p.get("removed") == n_layers])
    if not rest or not every:
        return None
    lo, hi = min(*rest, 0.0), max(*rest, 0.0)
    if max(every) <= 2 * hi or hi <= lo:
        return None
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


def pruning_figure(result: Mapping[str, Any], title: str | None = None) -> str:
    """:func:`~gna_lens.findings.layers.layer_pruning`'s result as an SVG figure.

    Two panels against the layer index: retrieval accuracy (chance dashed, baseline dotted)
    and the control's loss change (no change dotted), each with two series, gradual pruning
    (the point at layer ``l`` removes layers ``l`` .. ``n-1``, or ``0`` .. ``l`` from the
    start; the point at ``n`` (``-1``) removes none) and each layer removed alone, with 95%
    bands. Without a control, the accuracy panel alone. Where removing every layer costs the
    control more than twice what any other point does, that point is drawn at the panel's
    edge with its value written next to it.

    Args:
        result: The dict :func:`~gna_lens.findings.layers.layer_pruning` returned (or its JSON).
        title: The figure's title (default: the model and task).

    Returns:
        The SVG document.

    Raises:
        ConfigError: If ``result`` lacks the keys ``layer_pruning`` writes.

    Examples:
        >>> from gna_lens.findings.layers import layer_pruning
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
        >>> model = toy_gna_model()
        >>> res = layer_pruning(model, toy_gna_task(model, n_samples=8), toy_control(model))
        >>> pruning_figure(res).count('class="series"')  # 2 panels x (gradual, individual)
        4
    """
    _check_result(result, "pruning_figure", "layer_pruning",
                  ("gradual", "individual", "n_layers", "chance", "baseline", "order"))  # fmt: skip
    n = int(result["n_layers"])
    from_end = result["order"] == "from_end"
    grad = list(result["gradual"])
    gx = [
        (n - p["removed"] if from_end else p["removed"] - 1) for p in grad
    ]  # the lowest (highest) layer removed
    ind = list(result["individual"])
    ix = [p["layer"] for p in ind]
    g_name = "gradual: layers l..end removed" if from_end else "gradual: layers 0..l removed"
    has_control = any(p.get("control_change") for p in grad[1:] + ind)
    span, base = [min(gx + ix), max(gx + ix)], result["baseline"]["value"]

    def series(key: str) -> list[dict[str, Any]]:
        return [_series(g_name, gx, grad, key), _series("layer l removed alone", ix, ind, key)]

    panels = [dict(
        series=series("accuracy"), title="retrieval accuracy", x_label="layer l",
        y_label="retrieval accuracy", y_range=(0.0, 1.0), chance=float(result["chance"]),
        percent=True, references=[{"name": "nothing removed", "x": span, "y": [base, base],
                                   "dash": "2 3"}],
    )]  # fmt: skip
    if has_control:
        panels.append(dict(
            series=series("control_change"), title="control", x_label="layer l",
            y_label=f"control loss change ({result.get('control_unit', '')})",
            references=[{"name": "no change", "x": span, "y": [0.0, 0.0], "dash": "2 3"}],
            y_range=_control_range(grad, ind, n),
        ))  # fmt: skip
    default = f"Layer removal: {_model_name(result)} on {result.get('task', '')}"
    return chart_grid(
        panels, title=title or default, cols=2,
        note="95% intervals: accuracy Wilson; loss change paired bootstrap"
        + (f". Control: {result.get('control')}" if has_control else ""),
    )  # fmt: skip


def dictionary_figure(result: Mapping[str, Any], title: str | None = None) -> str:
    """:func:`~gna_lens.findings.layers.dictionary_size_curves`' result as an SVG figure.

    KV accuracy against the number of pairs (log2 axis): nothing removed, the heads removed,
    as many random heads removed (mean over the draws), each with its 95% band; chance
    (``1 / n_pairs``) dashed.

    Args:
        result: The dict :func:`~gna_lens.findings.layers.dictionary_size_curves` returned.
        title: The figure's title (default: the model and heads).

    Returns:
        The SVG document.

    Raises:
        ConfigError: If ``result`` lacks the keys ``dictionary_size_curves`` writes.

    Examples:
        >>> from gna_lens.findings.layers import dictionary_size_curves
        >>> from gna_lens.testing import TOY_AGGREGATE_HEAD, toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> res = dictionary_size_curves(model, [TOY_AGGREGATE_HEAD], sizes=(2, 4),
        ...     tasks=lambda n: toy_gna_task(model, n_pairs=n, n_samples=8), random_draws=2)
        >>> dictionary_figure(res).count('class="series"')
        3
    """
    _check_result(result, "dictionary_figure", "dictionary_size_curves", ("points", "heads"))
    pts = list(result["points"])
    xs = [p["n_pairs"] for p in pts]
    k = len(result["heads"])
    arms = [("before", "nothing removed"), ("after", f"top {k} heads removed")]
    if any(p.get("random_after") for p in pts):
        arms.append(("random_after", f"{k} random heads removed"))
    series = [_series(name, xs, pts, key) for key, name in arms]
    missing = [m["n_pairs"] for m in result.get("missing", ())]
    note = "95% intervals: Wilson; random heads: bootstrap over draws and prompts"
    if missing:
        note += f"; not measured: {', '.join(map(str, missing))} pairs"
    heads = " ".join(result["heads"])
    default = f"KV accuracy vs dictionary size: {_model_name(result)}, removing {heads}"
    panel = dict(
        series=series, title="", x_label="pairs in the dictionary", y_label="KV accuracy",
        y_range=(0.0, 1.0), chance=[p["chance"] for p in pts], x_log2=True, percent=True,
    )  # fmt: skip
    return chart_grid([panel], title=title or default, note=note, cols=1, panel_size=(520, 300))
