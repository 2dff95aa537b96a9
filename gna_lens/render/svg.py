"""Dependency-free SVG figures: no plotly, no matplotlib, no browser.

- :func:`heatmap_svg`: a layer x head heatmap, inline in the HTML report
  (:func:`gna_lens.render.html.report_html`).
- :func:`benchmark_svg`: the lm-eval table's figure (``BenchmarkTable.to_svg``).
- :func:`hybrid_svg`: the hybrid experiment's figure (``HybridTable.to_svg``).

The line charts of the findings page are in :mod:`gna_lens.render.figures`.
"""

import html
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

__all__ = ["benchmark_svg", "heatmap_svg", "hybrid_curve_rows", "hybrid_svg"]


def heatmap_svg(grid: Tensor, title: str, cell: int | None = None) -> str:
    """An inline SVG heatmap (diverging for effects, sequential for scores), in a ``<figure>``
    with its caption (the HTML report's layer x head heatmaps).

    Layers are rows (L0 at the top), heads columns; each cell's tooltip gives its value. The
    title and value range sit in a caption above, so they are never clipped by a narrow grid.
    """
    n_layers, n_heads = grid.shape
    if cell is None:  # about 360 px for the larger side, 6 to 24 px a cell
        cell = max(6, min(24, 360 // max(n_heads, 1), 360 // max(n_layers, 1)))
    finite = grid[~torch.isnan(grid)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    span = max(abs(lo), abs(hi)) or 1.0
    left, top = 30, 16
    rects = []
    for layer in range(n_layers):
        for h in range(n_heads):
            v = float(grid[layer, h])
            if math.isnan(v):
                continue
            if lo < 0:  # diverging: red for harmful (negative) effects
                c = int(255 * (1 - min(abs(v) / span, 1.0)))
                color = f"rgb(255,{c},{c})" if v < 0 else f"rgb({c},{c},255)"
            else:
                t = (v - lo) / ((hi - lo) or 1.0)
                color = f"rgb({int(255 * (1 - t))},{int(255 * (1 - 0.6 * t))},255)"
            rects.append(
                f"<rect x='{left + h * cell}' y='{top + layer * cell}' width='{cell}' "
                f"height='{cell}' fill='{color}' stroke='#ddd' stroke-width='0.5'>"
                f"<title>L{layer}H{h}: {v:.4f}</title></rect>"
            )
    width, height = left + n_heads * cell + 4, top + n_layers * cell + 4
    every = max(1, math.ceil(11 / cell))  # label every row / column that has room
    labels = "".join(
        f"<text x='{left - 3}' y='{top + layer * cell + cell / 2 + 3:g}' font-size='10' "
        f"text-anchor='end'>L{layer}</text>"
        for layer in range(0, n_layers, every)
    ) + "".join(
        f"<text x='{left + h * cell + cell / 2:g}' y='{top - 4}' font-size='10' "
        f"text-anchor='middle'>{h}</text>"
        for h in range(0, n_heads, max(every, math.ceil(16 / cell)))
    )
    frame = (
        f"<rect x='{left}' y='{top}' width='{n_heads * cell}' height='{n_layers * cell}' "
        "fill='#f4f4f4' stroke='#999' stroke-width='0.5'/>"
    )
    return (
        "<figure style='display:inline-block;margin:8px;vertical-align:top'>"
        f"<figcaption style='font-size:12px'><b>{html.escape(title)}</b> "
        f"[{lo:.3g}, {hi:.3g}]<br><span style='color:#666'>layer x head</span></figcaption>"
        f"<svg class='heatmap' width='{width}' height='{height}'>{frame}{labels}"
        f"{''.join(rects)}</svg></figure>"
    )


def benchmark_svg(table: Any, width: int = 560, height: int = 320) -> str:
    """The lm-eval table's figure as a small self-contained SVG (no plotly, no browser): each
    task's metric with its 95% intervals against heads removed, chance dashed; random rows as
    open circles (each draw, ``random-k #i`` in its tooltip) and an open diamond (their mean,
    with its interval, dotted) just right of the top-``k`` point.

    Args:
        table: A :class:`~gna_lens.lm_eval.BenchmarkTable` (read through ``tasks``,
            ``remove_top``, ``cells``, ``cell(k, task)``, ``random_cells(task)``, ``model`` and
            ``method["random"]["k"]``; a random cell through ``kind``, ``label``, ``k`` and
            ``value``).
        width: Width in pixels.
        height: Height in pixels.

    Returns:
        The SVG document (ending in a newline).
    """
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
    left, right, top, bottom = 56, 150, 30, 44
    w, h = width - left - right, height - top - bottom
    ks = list(table.remove_top)
    kmax = max(max(ks), 1)

    def x(k: float) -> float:
        return cast("float", left + w * k / kmax)

    def y(v: float) -> float:
        return top + h * (1 - v)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="16" font-size="12">{html.escape(table.model)}: top-k heads removed '
        "(95% intervals; dashed: chance)</text>",
    ]
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        out.append(
            f'<line x1="{left}" x2="{left + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{100 * v:.0f}%</text>'
        )
    for k in ks:
        out.append(f'<text x="{x(k):.1f}" y="{top + h + 16}" text-anchor="middle">{k}</text>')
    out.append(
        f'<text x="{left + w / 2:.1f}" y="{height - 8}" text-anchor="middle">heads removed</text>'
    )
    for i, t in enumerate(table.tasks):
        col = colors[i % len(colors)]
        cs = [table.cell(k, t) for k in ks]
        if cs[0].chance is not None:  # chance level, dashed
            out.append(
                f'<line x1="{left}" x2="{left + w}" y1="{y(cs[0].chance):.1f}" '
                f'y2="{y(cs[0].chance):.1f}" stroke="{col}" stroke-dasharray="4 3" '
                'stroke-opacity="0.6"/>'
            )
        pts = " ".join(f"{x(c.k):.1f},{y(c.value.value):.1f}" for c in cs)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="2"/>')
        for c in cs:
            if not math.isnan(c.value.low):
                out.append(
                    f'<line x1="{x(c.k):.1f}" x2="{x(c.k):.1f}" y1="{y(c.value.low):.1f}" '
                    f'y2="{y(c.value.high):.1f}" stroke="{col}"/>'
                )
            out.append(
                f'<circle cx="{x(c.k):.1f}" cy="{y(c.value.value):.1f}" r="3" fill="{col}"/>'
            )
        ly = top + 14 + 18 * i
        out.append(
            f'<rect x="{left + w + 12}" y="{ly - 8}" width="10" height="10" fill="{col}"/>'
            f'<text x="{left + w + 26}" y="{ly + 1}">{html.escape(t)}</text>'
        )
    if any(c.kind != "top" for c in table.cells):
        out += _random_marks(
            table, x, y, colors, legend=(left + w, top + 14 + 18 * len(table.tasks))
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _random_marks(
    table: Any,
    x: Callable[[float], float],
    y: Callable[[float], float],
    colors: Sequence[str],
    legend: tuple[int, int],
) -> list[str]:
    """:func:`benchmark_svg`'s random rows, in its layout (``x``, ``y``, ``colors``): each task's
    draws (open circles) 6 px and their mean (open diamond, its interval dotted) 12 px right of
    the point of the same ``k``; and their legend below the tasks' at ``legend`` (the plot's
    right edge, the entry's baseline)."""
    out = []
    for i, t in enumerate(table.tasks):
        col = colors[i % len(colors)]
        for c in table.random_cells(t):
            cx = x(c.k) + (6 if c.kind == "random" else 12)
            tip = f"<title>{html.escape(c.label)} {html.escape(t)}: {c.value.format(percent=True)}</title>"
            if not math.isnan(c.value.low) and c.kind == "random_mean":
                out.append(
                    f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(c.value.low):.1f}" '
                    f'y2="{y(c.value.high):.1f}" stroke="{col}" stroke-dasharray="2 2"/>'
                )
            cy = y(c.value.value)
            if c.kind == "random":
                out.append(
                    f'<circle class="random" cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="white" '
                    f'stroke="{col}">{tip}</circle>'
                )
            else:
                out.append(
                    f'<polygon class="random-mean" points="{cx:.1f},{cy - 4:.1f} {cx + 4:.1f},'
                    f'{cy:.1f} {cx:.1f},{cy + 4:.1f} {cx - 4:.1f},{cy:.1f}" fill="white" '
                    f'stroke="{col}">{tip}</polygon>'
                )
    k = table.method.get("random", {}).get("k", "k")
    n = sum(c.kind == "random" for c in table.random_cells(table.tasks[0]))
    lx, ly = legend
    out.append(
        f'<circle cx="{lx + 17}" cy="{ly - 3}" r="3" fill="white" stroke="#555"/>'
        f'<text x="{lx + 26}" y="{ly + 1}">random-{k} #1-#{n}</text>'
        f'<polygon points="{lx + 17},{ly + 11} {lx + 21},{ly + 15} '
        f'{lx + 17},{ly + 19} {lx + 13},{ly + 15}" fill="white" stroke="#555"/>'
        f'<text x="{lx + 26}" y="{ly + 19}">random-{k} mean</text>'
    )
    return out


def hybrid_curve_rows(table: Any, kind: str) -> list[Any]:
    """The rows of one curve of the hybrid table's figures (:func:`hybrid_svg`,
    :func:`gna_lens.render.plotly.hybrid_figure`): ``kind`` (``"top"``, ``"random"``) and
    ``k = 0``, of the first distillation data only (a no-kv arm is another experiment, not more
    points), by ``k``."""
    data = next((r.data for r in table.rows if r.kind != "teacher"), "default")
    rows = [r for r in table.rows if r.kind in (kind, "none") and r.data == data]
    return sorted(rows, key=lambda r: r.k)


def hybrid_svg(table: Any, panel: int = 240, height: int = 300) -> str:
    """The hybrid experiment's figure as a small self-contained SVG (no plotly, no browser): one
    panel per KV task, top-k (blue) and random-k (red) students against k, teacher dashed,
    chance dotted.

    Args:
        table: A :class:`~gna_lens.hybrid.HybridTable` (read through ``kv_tasks``, ``rows``,
            ``chance`` and ``teacher``).
        panel: Width of one panel in pixels.
        height: Height in pixels.

    Returns:
        The SVG document (ending in a newline).
    """
    n = max(1, len(table.kv_tasks))
    left, top, bottom, gap = 48, 34, 40, 16
    width = left + n * (panel + gap) + 90
    h = height - top - bottom
    ks = sorted({r.k for r in table.rows if r.kind != "teacher"}) or [0]
    kmax = max(max(ks), 1)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="16" font-size="12">{html.escape(table.teacher)}: held-out KV '
        "accuracy of students keeping k heads as attention (95% intervals)</text>",
    ]

    def y(v: float) -> float:
        return top + h * (1 - v)

    for i, t in enumerate(table.kv_tasks):
        x0 = left + i * (panel + gap)

        def x(k: float, x0: float = x0) -> float:
            return cast("float", x0 + panel * k / kmax)

        out.append(
            f'<text x="{x0 + panel / 2}" y="{top - 6}" text-anchor="middle">{html.escape(t)}</text>'
        )
        for v in (0, 0.25, 0.5, 0.75, 1.0):
            out.append(
                f'<line x1="{x0}" x2="{x0 + panel}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
            )
            if i == 0:
                out.append(
                    f'<text x="{x0 - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{100 * v:.0f}%</text>'
                )
        for k in ks:
            out.append(f'<text x="{x(k):.1f}" y="{top + h + 14}" text-anchor="middle">{k}</text>')
        teacher = next((r for r in table.rows if r.kind == "teacher"), None)
        taught = teacher.kv[t].value if teacher is not None and t in teacher.kv else None
        for line, col, dash in ((taught, "gray", "6 3"), (table.chance.get(t), "black", "2 3")):
            if line is not None:
                out.append(
                    f'<line x1="{x0}" x2="{x0 + panel}" y1="{y(line):.1f}" y2="{y(line):.1f}" '
                    f'stroke="{col}" stroke-dasharray="{dash}"/>'
                )
        for kind, col, dx in (("top", "#1f77b4", -3), ("random", "#d62728", 3)):
            rows = [r for r in hybrid_curve_rows(table, kind) if t in r.kv]
            pts = " ".join(f"{x(r.k) + dx:.1f},{y(r.kv[t].value):.1f}" for r in rows)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="1.5"/>')
            for r in rows:
                iv = r.kv[t]
                out.append(
                    f'<line x1="{x(r.k) + dx:.1f}" x2="{x(r.k) + dx:.1f}" y1="{y(iv.low):.1f}" '
                    f'y2="{y(iv.high):.1f}" stroke="{col}"/>'
                    f'<circle cx="{x(r.k) + dx:.1f}" cy="{y(iv.value):.1f}" r="3" fill="{col}"/>'
                )
    lx = left + n * (panel + gap)
    for j, (label, col, dash) in enumerate(
        (("top-k", "#1f77b4", ""), ("random-k", "#d62728", ""), ("teacher", "gray", "6 3"),
         ("chance", "black", "2 3"))
    ):  # fmt: skip
        ly = top + 10 + 16 * j
        out.append(
            f'<line x1="{lx}" x2="{lx + 18}" y1="{ly}" y2="{ly}" stroke="{col}" '
            f'stroke-width="2" stroke-dasharray="{dash}"/><text x="{lx + 22}" y="{ly + 4}">{label}</text>'
        )
    out.append(
        f'<text x="{left + n * (panel + gap) / 2:.0f}" y="{height - 8}" text-anchor="middle">'
        "heads kept as attention (k)</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"
