"""HTML: the GnaReport page and the retrieval-vs-knowledge fragment.

The report is read through its attributes and methods (duck typing); this module never imports
:mod:`gna_lens.scoring`.
"""

import html
import warnings
from pathlib import Path
from typing import Any

import torch

from gna_lens.device import HOST
from gna_lens.render.markdown import heads_label
from gna_lens.render.plotly import head_heatmap
from gna_lens.render.svg import heatmap_svg

__all__ = ["FIRST_COLUMNS", "knowledge_html", "report_html", "write_report_html"]

#: Leading columns of the report's top-heads table: what the ranking used, then the rest.
FIRST_COLUMNS = (
    "layer", "head", "kind", "role", "ablation_effect", "ablation_effect_low",
    "ablation_effect_high", "control_effect", "joint_control_effect", "joint_control_low",
    "joint_control_high", "specificity",
)  # fmt: skip
#: The report's SVG heatmaps, of the columns measured.
HEATMAPS = ("ablation_effect", "control_effect", "specificity", "gather_score", "aggregate_score",
            "correct_share", "sharpness")  # fmt: skip


def report_html(report: Any, *, k: int = 6, extra_html: str = "", interactive: bool = False) -> str:
    """The self-contained offline HTML page of a :class:`~gna_lens.scoring.GnaReport`: method,
    top heads, heads left out, heatmaps and the top heads' patterns.

    The patterns are circuitsvis widgets embedded with their local script (no CDN), so the page
    works without a network.

    Args:
        report: The report.
        k: Top heads to list.
        extra_html: More HTML to append (e.g. a retrieval-vs-knowledge table).
        interactive: Also add zoomable plotly heatmaps
            (:func:`~gna_lens.render.plotly.head_heatmap`) with plotly.js inlined (about 5 MB
            more; still offline).

    Returns:
        The page.
    """
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>gna_lens report: {html.escape(report.model_name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;"
        "font-size:13px}h2{margin-top:1.5em}</style></head><body>",
        f"<h1>G&amp;A report: {html.escape(report.model_name)}</h1>",
        f"<p>Task: {html.escape(report.task)}. Metric: {html.escape(report.metric)}"
        f" (baseline {report.baseline:.4f}).</p>",
    ]
    if "weights" in report.method:
        parts.append(f"<p class='weights'>Weights: {html.escape(report.method['weights'])}</p>")
    if report.method:
        rows = "".join(
            f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(_cell(v))}</td></tr>"
            for key, v in report.method.items()
        )
        parts.append(f"<h2>Method</h2><table class='method'>{rows}</table>")
    has_ablation = not bool(torch.isnan(report.scores["ablation_effect"]).all())
    joint = report._joint() if has_ablation and report.has_control else None
    if joint is not None and k > joint.joint_k and not joint.exhausted:
        k = joint.joint_k  # the joint set's first k are all it knows
    if has_ablation and report.has_control:
        with warnings.catch_warnings():  # fewer than k: the table shows what qualifies
            warnings.simplefilter("ignore", UserWarning)
            top = report.top(k)
        title = f"Top {k} retrieval-specific heads ({report.criterion})"
    elif has_ablation:
        top, title = report.top(k, by="ablation_effect"), f"Top {k} heads by ablation effect"
    else:
        top, title = report.top(k, by="aggregate_score"), f"Top {k} heads by aggregate score"
    df = report.joint_table(top)
    first = [c for c in FIRST_COLUMNS if c in df.columns]  # the ranking's numbers first
    df = df[first + [c for c in df.columns if c not in first]]
    parts.append(f"<h2>{html.escape(title)}</h2>")
    if joint is not None and top:
        about = (
            f"Joint set: {joint.describe(len(top))}. joint_control_effect: the control effect of "
            "each head and those above it, removed together (95% paired bootstrap interval over "
            "the control's samples); control_effect: the head alone."
        )
        parts.append(f"<p class='joint'>{html.escape(about)}</p>")
    parts.append(df.to_html(index=False, float_format=lambda x: f"{x:.4f}", na_rep="-"))
    if has_ablation and report.has_control:
        gone = report.excluded(k)
        items = "".join(
            f"<li>L{e.head[0]}H{e.head[1]}: ablation effect {e.ablation_effect:+.3f}; "
            f"{html.escape(e.reason)}</li>"
            for e in gone
        )
        parts.append(
            "<h2>Left out as generic</h2>"
            + (f"<ul class='excluded'>{items}</ul>" if gone else "<p>None.</p>")
        )
    parts += [_coarse_html(report), "<h2>Layer x head heatmaps</h2><div id='heatmaps'>"]
    for name in HEATMAPS:
        if not bool(torch.isnan(report.scores[name]).all()):
            parts.append(heatmap_svg(report.heatmap(name), name))
    parts.append("</div>")
    if interactive:
        parts.append(_plotly_heatmaps(report))
    if report.examples.get("patterns"):
        parts.append("<h2>Patterns of the top heads (one sample)</h2>")
        parts.append(_circuitsvis_patterns(report.examples))
    parts += [extra_html, "</body></html>"]
    return "\n".join(parts)


def write_report_html(
    report: Any, path: str | Path, *, k: int = 6, extra_html: str = "", interactive: bool = False
) -> Path:
    """Write :func:`report_html` to ``path`` (parent folders created, UTF-8).

    Args:
        report: The report; ``k``, ``extra_html`` and ``interactive`` as :func:`report_html`'s.
        path: Output file.

    Returns:
        The path written.
    """
    path = Path(path)
    text = report_html(report, k=k, extra_html=extra_html, interactive=interactive)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _coarse_html(report: Any) -> str:
    """The coarse stage's layer ranking and the heads never measured, as HTML."""
    parts = []
    if report.layers is not None:
        df = report.layer_ranking()
        cols = [
            "rank", "layer", "scanned", "kind", "value", "effect", "effect_low", "effect_high",
            "control_effect", "control_low", "control_high", "selectivity",
        ]  # fmt: skip
        layers = report.layers
        by = "selectivity (share of the task lost minus share of the control lost)"
        about = (
            f"{layers.method.get('ablation', 'layer removal')}, each layer alone, on the task "
            f"({layers.metric}, baseline {layers.baseline_mean:.4f}) and the control "
            f"({layers.control or 'none'}); ranked by {by if layers.has_control else 'task effect'}"
            f". The heads of the top {report.method.get('top_layers', '?')} layers were ablated "
            "one by one."
        )
        table = df[[c for c in cols if c in df.columns]].to_html(
            index=False, float_format=lambda x: f"{x:.4f}", na_rep="-"
        )
        parts.append(f"<h2>Layer ranking (coarse stage)</h2><p>{html.escape(about)}</p>")
        parts.append(f"<div class='layer-ranking'>{table}</div>")
    if report.unmeasured:
        items = "".join(f"<li>{html.escape(u.describe())}</li>" for u in report.unmeasured)
        parts.append(
            f"<h2>Heads never measured ({report.n_unmeasured} of {len(report.heads)})</h2>"
            "<p>Their ablation and control effects are blank (NaN): they were not ablated, "
            "not found harmless.</p>"
            f"<ul class='unmeasured'>{items}</ul>"
        )
    return "".join(parts)


def _plotly_heatmaps(report: Any) -> str:
    """Plotly heatmaps of the measured columns, plotly.js inlined once (no CDN)."""
    names = [
        name
        for name in ("ablation_effect", "gather_score", "aggregate_score", "sharpness")
        if not bool(torch.isnan(report.scores[name]).all())
    ]
    parts = ["<h2>Interactive heatmaps</h2><div id='plotly-heatmaps'>"]
    for i, name in enumerate(names):
        fig = head_heatmap(report, name, title=name)
        fig.update_layout(width=460, height=max(260, 120 + 14 * report.n_layers))
        parts.append(
            "<div style='display:inline-block'>"
            + fig.to_html(full_html=False, include_plotlyjs=i == 0, config={"displaylogo": False})
            + "</div>"
        )
    parts.append("</div>")
    return "".join(parts)


def _circuitsvis_patterns(examples: dict[str, Any]) -> str:
    import circuitsvis.attention as cv

    names = list(examples["patterns"])
    pats = torch.tensor([examples["patterns"][n] for n in names], dtype=torch.float32, device=HOST)
    rendered = cv.attention_heads(
        attention=pats, tokens=list(examples["tokens"]), attention_head_names=names
    )
    return f"<div class='patterns'>{rendered.local_src}</div>"


def _cell(value: Any) -> str:
    """A method-table cell: dicts as ``key: value`` lines (the provenance's fields)."""
    if isinstance(value, dict):
        return "; ".join(
            f"{k}: {_cell(v)}"
            for k, v in value.items()
            if v not in ("", {}, ()) and k != "description"
        )
    return str(value)


def knowledge_html(table: Any) -> str:
    """The retrieval-vs-knowledge table as an HTML fragment (accuracies with 95% intervals, the
    control, the random baseline): what :meth:`KnowledgeTable.to_html
    <gna_lens.scoring.KnowledgeTable.to_html>` returns.

    Args:
        table: A :class:`~gna_lens.scoring.KnowledgeTable` (read through ``heads``,
            ``format_lines``, ``random_sets`` and ``method``).

    Returns:
        The fragment: a heading, one list item per line of ``format_lines()``, the random
        baseline's head sets and the method.
    """
    heads = heads_label(table.heads, ", ")
    body = "".join(f"<li>{html.escape(line)}</li>" for line in table.format_lines())
    sets = "; ".join(heads_label(s) for s in table.random_sets)
    note = (
        f"<p>Random baseline ({html.escape(str(table.method.get('random_sets', '')))}): "
        f"{html.escape(sets)}.</p>"
        if table.random_sets
        else ""
    )
    method = html.escape(
        ", ".join(f"{k}: {v}" for k, v in table.method.items() if k != "provenance")
    )
    return (
        f"<h2>Retrieval vs knowledge (removing {heads})</h2><ul class='knowledge'>{body}"
        f"</ul>{note}<p>{method}</p>"
    )
