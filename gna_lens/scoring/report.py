"""``score_heads``: one table of G&A evidence per head, and the :class:`GnaReport` it returns."""

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.errors import GnaLensError
from gna_lens.heads import head_view
from gna_lens.interventions import ablation_sweep, attribute_heads
from gna_lens.interventions._common import describe_task
from gna_lens.scoring.patterns import NORMALIZATION, SCORE_NAMES, Head, pattern_scores
from gna_lens.tasks import Task

__all__ = ["GnaReport", "score_heads"]

COLUMNS = ("layer", "head", "kind", *SCORE_NAMES, "ablation_effect", "attribution")


@dataclass(frozen=True)
class GnaReport:
    """Gather / aggregate / sharpness scores and ablation effects of every head on one task.

    Attributes:
        model_name: The model's name (or class).
        task: The task's description.
        heads: ``(layer, head)`` of each row.
        kinds: ``"attention"`` or ``"ssm"`` per row.
        scores: ``{name: [head]}`` for ``gather_score``, ``aggregate_score``, ``correct_share``,
            ``sharpness``, ``entropy``, ``ablation_effect`` (metric change when the head is
            zero-ablated alone; NaN when not measured) and ``attribution`` (gradient estimate of
            that change; NaN when not computed).
        metric: The metric of the ablation effects (e.g. ``"logit_diff"``).
        baseline: The metric without ablation (mean over samples), or NaN.
        n_layers: Layers of the model.
        layer_heads: Heads per layer (0 for a layer without addressable heads).
        normalization: How pattern rows were normalized, per head kind.
        examples: For display, the patterns of the top heads on one sample:
            ``{"tokens": [...], "patterns": {"L3H2": [[...]]}}``.
    """

    model_name: str
    task: str
    heads: tuple[Head, ...]
    kinds: tuple[str, ...]
    scores: dict[str, Float[Tensor, " head"]]
    metric: str
    baseline: float
    n_layers: int
    layer_heads: tuple[int, ...]
    normalization: dict[str, str] = field(default_factory=lambda: dict(NORMALIZATION))
    examples: dict[str, Any] = field(default_factory=dict)

    def to_dataframe(self) -> Any:
        """One row per head with the columns ``layer, head, kind, gather_score,
        aggregate_score, correct_share, sharpness, entropy, ablation_effect, attribution``."""
        import pandas as pd

        data: dict[str, Any] = {
            "layer": [h[0] for h in self.heads],
            "head": [h[1] for h in self.heads],
            "kind": list(self.kinds),
        }
        for name in COLUMNS[3:]:
            data[name] = self.scores[name].tolist()
        return pd.DataFrame(data, columns=list(COLUMNS))

    def top(self, k: int = 10, by: str = "ablation_effect") -> list[Head]:
        """The ``k`` strongest heads by a column.

        ``ablation_effect`` and ``attribution`` rank the most harmful ablation (most negative
        change) first; ``entropy`` ranks the lowest first; other scores the highest first.

        Args:
            k: How many heads.
            by: A score column.

        Returns:
            ``[(layer, head), ...]``.

        Raises:
            GnaLensError: For an unknown column or one that was not measured.
        """
        if by not in self.scores:
            raise GnaLensError(f"GnaReport.top(by={by!r}); expected one of {sorted(self.scores)}.")
        values = self.scores[by].double()
        if bool(torch.isnan(values).all()):
            raise GnaLensError(
                f"GnaReport.top(by={by!r}): this report has no {by} (it was not computed). Run "
                "score_heads(..., ablation=True) for ablation effects."
            )
        ascending = by in ("ablation_effect", "attribution", "entropy")
        key = values.nan_to_num(nan=math.inf if ascending else -math.inf)
        order = torch.argsort(key if ascending else -key, stable=True).tolist()
        return [self.heads[i] for i in order[:k]]

    def heatmap(self, by: str = "ablation_effect") -> Float[Tensor, "layer head_index"]:
        """A ``[n_layers, max_heads]`` grid of a score (NaN where a layer has fewer heads)."""
        if by not in self.scores:
            raise GnaLensError(
                f"GnaReport.heatmap(by={by!r}); expected one of {sorted(self.scores)}."
            )
        grid = torch.full((self.n_layers, max(self.layer_heads, default=0)), math.nan)
        for (layer, h), v in zip(self.heads, self.scores[by].tolist(), strict=True):
            grid[layer, h] = v
        return grid

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (scores as lists, NaN as ``None``)."""

        def clean(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {
            "model_name": self.model_name,
            "task": self.task,
            "metric": self.metric,
            "baseline": clean(self.baseline),
            "n_layers": self.n_layers,
            "layer_heads": list(self.layer_heads),
            "normalization": self.normalization,
            "heads": [
                {"layer": layer, "head": h, "kind": kind}
                | {name: clean(float(self.scores[name][i])) for name in COLUMNS[3:]}
                for i, ((layer, h), kind) in enumerate(zip(self.heads, self.kinds, strict=True))
            ],
        }

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def to_html(
        self, path: str | Path, *, k: int = 6, extra_html: str = "", interactive: bool = False
    ) -> Path:
        """Write a self-contained offline HTML report: heatmaps, top heads, their patterns.

        The patterns are circuitsvis widgets embedded with their local script (no CDN), so the
        page works without a network.

        Args:
            path: Output file.
            k: Top heads to list.
            extra_html: More HTML to append (e.g. a retrieval-vs-knowledge table).
            interactive: Also add zoomable plotly heatmaps (:func:`gna_lens.plots.head_heatmap`)
                with plotly.js inlined (about 5 MB more; still offline).

        Returns:
            The path written.
        """
        path = Path(path)
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>gna_lens report: {html.escape(self.model_name)}</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;"
            "font-size:13px}h2{margin-top:1.5em}</style></head><body>",
            f"<h1>G&amp;A report: {html.escape(self.model_name)}</h1>",
            f"<p>Task: {html.escape(self.task)}. Metric: {html.escape(self.metric)}"
            f" (baseline {self.baseline:.4f}).</p>",
        ]
        has_ablation = not bool(torch.isnan(self.scores["ablation_effect"]).all())
        by = "ablation_effect" if has_ablation else "aggregate_score"
        top = self.top(k, by=by)
        df = self.to_dataframe().set_index(["layer", "head"]).loc[top].reset_index()
        parts.append(f"<h2>Top {k} heads by {by}</h2>")
        parts.append(df.to_html(index=False, float_format=lambda x: f"{x:.4f}", na_rep="-"))
        parts.append("<h2>Layer x head heatmaps</h2><div id='heatmaps'>")
        for name in (
            "ablation_effect",
            "gather_score",
            "aggregate_score",
            "correct_share",
            "sharpness",
        ):
            if not bool(torch.isnan(self.scores[name]).all()):
                parts.append(_svg_heatmap(self.heatmap(name), name))
        parts.append("</div>")
        if interactive:
            parts.append(self._plotly_heatmaps())
        if self.examples.get("patterns"):
            parts.append("<h2>Patterns of the top heads (one sample)</h2>")
            parts.append(_circuitsvis_patterns(self.examples))
        parts.append(extra_html)
        parts.append("</body></html>")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(parts), encoding="utf-8")
        return path

    def _plotly_heatmaps(self) -> str:
        """Plotly heatmaps of the measured columns, plotly.js inlined once (no CDN)."""
        from gna_lens.plots import head_heatmap

        names = [
            name
            for name in ("ablation_effect", "gather_score", "aggregate_score", "sharpness")
            if not bool(torch.isnan(self.scores[name]).all())
        ]
        parts = ["<h2>Interactive heatmaps</h2><div id='plotly-heatmaps'>"]
        for i, name in enumerate(names):
            fig = head_heatmap(self, name, title=name)
            fig.update_layout(width=460, height=max(260, 120 + 14 * self.n_layers))
            parts.append(
                "<div style='display:inline-block'>"
                + fig.to_html(
                    full_html=False, include_plotlyjs=i == 0, config={"displaylogo": False}
                )
                + "</div>"
            )
        parts.append("</div>")
        return "".join(parts)


def _svg_heatmap(grid: Tensor, title: str, cell: int | None = None) -> str:
    """An inline SVG heatmap (diverging for effects, sequential for scores).

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
                t = min(abs(v) / span, 1.0)
                color = (
                    f"rgb(255,{int(255 * (1 - t))},{int(255 * (1 - t))})"
                    if v < 0
                    else (f"rgb({int(255 * (1 - t))},{int(255 * (1 - t))},255)")
                )
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


def _circuitsvis_patterns(examples: dict[str, Any]) -> str:
    import circuitsvis.attention as cv

    names = list(examples["patterns"])
    pats = torch.tensor([examples["patterns"][n] for n in names], dtype=torch.float32)
    rendered = cv.attention_heads(
        attention=pats, tokens=list(examples["tokens"]), attention_head_names=names
    )
    return f"<div class='patterns'>{rendered.local_src}</div>"


def _model_name(model: Any) -> str:
    cfg = getattr(model, "cfg", None)
    for attr in ("model_name", "name_or_path"):
        name = getattr(cfg, attr, None)
        if name:
            return str(name)
    return type(model).__name__


def _examples(model: Any, task: Task, heads: list[Head]) -> dict[str, Any]:
    """Patterns of ``heads`` on the task's first sample (SSM rows as |M| normalized)."""
    from gna_lens.scoring.patterns import _capture_patterns

    view = head_view(model)
    sample = task[0]
    device = next(model.parameters()).device
    layers = sorted({layer for layer, _ in heads})
    with torch.no_grad(), _capture_patterns(model, view, layers) as store:
        model(torch.tensor([sample.input_ids], device=device))
    patterns = {}
    for layer, h in heads:
        p = store[layer][0, h].float()
        if view[layer].kind == "ssm":
            p = p.abs().tril()
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
        patterns[f"L{layer}H{h}"] = p.cpu().tolist()
    tokenizer = getattr(model, "tokenizer", None)
    tokens = (
        [tokenizer.decode([i]) for i in sample.input_ids]
        if tokenizer is not None
        else [str(i) for i in sample.input_ids]
    )
    return {"tokens": tokens, "patterns": patterns, "sample": 0}


def score_heads(
    model: Any,
    task: Task,
    ablation: bool = True,
    *,
    metric: str = "logit_diff",
    prefilter: int | None = None,
    batch_size: int = 8,
    n_examples: int = 4,
    progress: bool = True,
) -> GnaReport:
    """Score every head of ``model`` on ``task``: pattern scores plus ablation effects.

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A task with spans, e.g. :func:`gna_lens.tasks.kv_retrieval`.
        ablation: Measure each head's zero-ablation effect exactly (batched sweep).
        metric: Metric of the ablation effects: ``"logit_diff"`` or ``"accuracy"``.
        prefilter: If given, rank every head by attribution patching first (a few passes) and
            ablate exactly only the ``prefilter`` heads it ranks most harmful; the others keep
            NaN effects and their attribution estimate.
        batch_size: Prompts per forward pass.
        n_examples: Top heads whose patterns on the first sample are kept for display.
        progress: Show progress bars.

    Returns:
        A :class:`GnaReport`.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> report = score_heads(model, toy_gna_task(model, n_samples=8), progress=False)
        >>> sorted(report.top(2))
        [(0, 0), (1, 0)]
        >>> report.top(1, by="correct_share")
        [(1, 0)]
    """
    scores = pattern_scores(model, task, batch_size=batch_size, progress=progress)
    heads = list(scores.heads)
    view = head_view(model)
    n = len(heads)
    effect = torch.full((n,), math.nan)
    attribution = torch.full((n,), math.nan)
    baseline = math.nan
    if ablation:
        targets = heads
        if prefilter is not None:
            est = attribute_heads(model, task, metric="logit_diff", batch_size=batch_size)
            by_head = {c[0]: e for c, e in zip(est.cells, est.effects.tolist(), strict=True)}
            for i, h in enumerate(heads):
                attribution[i] = by_head.get(h, math.nan)
            order = torch.argsort(attribution.nan_to_num(nan=math.inf), stable=True).tolist()
            targets = [heads[i] for i in order[:prefilter]]
        sweep = ablation_sweep(model, task, metric=metric, heads=targets, progress=progress)
        by_cell = {c[0]: e for c, e in zip(sweep.cells, sweep.effects.tolist(), strict=True)}
        for i, h in enumerate(heads):
            effect[i] = by_cell.get(h, math.nan)
        baseline = sweep.baseline_mean
    table = {name: getattr(scores, name) for name in SCORE_NAMES}
    table["ablation_effect"] = effect
    table["attribution"] = attribution
    report = GnaReport(
        model_name=_model_name(model),
        task=describe_task(task),
        heads=tuple(heads),
        kinds=scores.kinds,
        scores=table,
        metric=metric if ablation else "none",
        baseline=baseline,
        n_layers=view.n_layers,
        layer_heads=tuple(lh.n_heads if lh is not None else 0 for lh in view.layers),
    )
    if n_examples:
        by = "ablation_effect" if ablation else "aggregate_score"
        top = report.top(min(n_examples, n), by=by)
        object.__setattr__(report, "examples", _examples(model, task, top))
    return report
