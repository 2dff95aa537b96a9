"""Every plotly figure of gna_lens, and a static PNG export for the docs.

The public figures of reports (:func:`head_heatmap`, :func:`sharpness_comparison`,
:func:`accuracy_vs_dictionary_size`, :func:`save_png`) are re-exported by :mod:`gna_lens.plots`,
where users import them; the others draw the data classes' ``plot()`` / ``figure()``. A figure
is a ``plotly.graph_objects.Figure``; plotly (and pandas) are imported inside the functions, so
importing this module stays cheap.
"""

import math
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from gna_lens.errors import GnaLensError
from gna_lens.render.markdown import head_label, heads_label
from gna_lens.render.svg import hybrid_curve_rows

__all__ = [
    "accuracy_vs_dictionary_size",
    "benchmark_figure",
    "cell_result_figure",
    "distill_figure",
    "find_browser",
    "head_heatmap",
    "hybrid_figure",
    "save_png",
    "sharpness_comparison",
]

#: Short names accepted by :func:`head_heatmap` for the report's columns.
ALIASES = {
    "gather": "gather_score",
    "aggregate": "aggregate_score",
    "effect": "ablation_effect",
    "ablation": "ablation_effect",
}
#: Columns drawn with a diverging colour scale centred on 0 (metric changes).
_SIGNED = ("ablation_effect", "attribution", "control_effect", "gather_score")
#: Executable names searched on ``PATH`` for the PNG export, in order.
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


#: What this module reads of a :class:`~gna_lens.scoring.GnaReport`. The figures sit below the
#: scoring package (whose report draws its HTML heatmaps with them), so they recognise a report
#: by these attributes instead of importing the class.
REPORT_ATTRIBUTES = ("heads", "scores", "n_layers", "model_name", "top", "to_dataframe")


def _is_report(x: Any) -> bool:
    return all(hasattr(x, name) for name in REPORT_ATTRIBUTES)


def _frame(report_or_frame: Any, caller: str) -> tuple[Any, int | None, str]:
    """``(dataframe, n_layers or None, title prefix)`` from a GnaReport or a DataFrame."""
    import pandas as pd

    if _is_report(report_or_frame):
        return report_or_frame.to_dataframe(), report_or_frame.n_layers, report_or_frame.model_name
    if isinstance(report_or_frame, pd.DataFrame):
        return report_or_frame, None, ""
    raise GnaLensError(
        f"{caller}: got {type(report_or_frame).__name__}; expected a GnaReport (from "
        "gna_lens.score_heads) or a pandas DataFrame with 'layer' and 'head' columns "
        "(e.g. report.to_dataframe())."
    )


def _column(df: Any, value: str, caller: str) -> str:
    column = ALIASES.get(value, value)
    numeric = [c for c in df.columns if c not in ("layer", "head", "kind", "model")]
    missing = [c for c in ("layer", "head", column) if c not in df.columns]
    if missing:
        raise GnaLensError(
            f"{caller}(value={value!r}): the table has no column(s) {missing}; it has "
            f"{list(df.columns)}. Pass value= one of {numeric} or the short names "
            f"{sorted(ALIASES)}."
        )
    return column


def head_heatmap(
    report_or_frame: Any,
    value: str = "ablation_effect",
    *,
    title: str | None = None,
    colorscale: str | None = None,
) -> Any:
    """A layer x head heatmap of one score, layer 0 at the top; hover shows ``L{layer}H{head}``.

    Effects (``ablation_effect``, ``attribution``) use a red-blue scale centred on 0, red for
    harmful (negative) changes; other scores a sequential scale. Cells of heads that do not exist
    (a layer with fewer heads) or were not measured are empty.

    Args:
        report_or_frame: A :class:`~gna_lens.scoring.GnaReport`, or a DataFrame with ``layer``,
            ``head`` and the ``value`` column (such as ``report.to_dataframe()``).
        value: A column: ``ablation_effect``, ``gather_score``, ``aggregate_score``,
            ``correct_share``, ``sharpness``, ``entropy``, ``attribution``; or a short name
            ``"gather"``, ``"aggregate"``, ``"effect"``.
        title: Figure title (default: model name and column).
        colorscale: A plotly colour scale name, to override the default.

    Returns:
        A ``plotly.graph_objects.Figure`` with one ``Heatmap`` trace whose ``z[layer][head]`` is
        the score (``None`` for empty cells).

    Raises:
        GnaLensError: For an input that is neither a report nor a DataFrame, or an unknown
            column.

    Examples:
        >>> from gna_lens import score_heads
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> report = score_heads(model, toy_gna_task(model, n_samples=8), control=None,
        ...                      progress=False)
        >>> fig = head_heatmap(report, "gather")
        >>> [[round(v, 2) for v in row] for row in fig.data[0].z]
        [[0.69, -0.06], [-0.2, -0.06]]
    """
    import plotly.graph_objects as go

    df, n_layers, model_name = _frame(report_or_frame, "head_heatmap")
    column = _column(df, value, "head_heatmap")
    layers = [int(v) for v in df["layer"]]
    heads = [int(v) for v in df["head"]]
    n_layers = max([*layers, (n_layers or 0) - 1], default=-1) + 1
    n_heads = max(heads, default=-1) + 1
    z: list[list[float | None]] = [[None] * n_heads for _ in range(n_layers)]
    for layer, head, v in zip(layers, heads, df[column].tolist(), strict=True):
        z[layer][head] = None if v is None or math.isnan(float(v)) else float(v)
    signed = column in _SIGNED
    label = f"L%{{y}}H%{{x}}<br>{column}: %{{z:.4g}}<extra></extra>"
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            colorscale=colorscale or ("RdBu" if signed else "Viridis"),
            zmid=0.0 if signed else None,
            colorbar={"title": {"text": column}},
            hovertemplate=label,
            hoverongaps=False,
        )
    )
    fig.update_layout(
        title=title if title is not None else f"{model_name + ': ' if model_name else ''}{column}",
        xaxis={"title": "head", "dtick": 1 if n_heads <= 32 else None},
        yaxis={"title": "layer", "autorange": "reversed", "dtick": 1 if n_layers <= 32 else None},
        template="plotly_white",
    )
    return fig


def _default_rank(report: Any) -> str | None:
    """The retrieval-specific ranking (``None``) when a control was measured, else
    ``ablation_effect`` when measured, else ``aggregate_score`` (as the HTML report does)."""
    if report.has_control:
        return None
    effects = report.scores["ablation_effect"]
    return "ablation_effect" if not bool(effects.isnan().all()) else "aggregate_score"


def sharpness_comparison(
    reports: Mapping[str, Any],
    top: int = 10,
    *,
    by: str | None = None,
    title: str | None = None,
) -> Any:
    """Sharpness of each model's top heads, one box (with every head as a point) per model.

    Sharpness is the peak of a head's normalized pattern row at the final position (1: all
    weight on one token; 1/n: uniform). Sharp top heads are the attention-like retrieval
    signature; diffuse ones are what SSM heads tend to show.

    Args:
        reports: ``{label: GnaReport}``, e.g. ``{"pythia-160m": r1, "mamba-130m": r2}``; the
            boxes keep this order.
        top: Heads per model, ranked by ``by``.
        by: The column that ranks the heads (see :meth:`GnaReport.top`). Default: the
            retrieval-specific ranking where a control was measured, else ``ablation_effect``
            where it was measured, else ``aggregate_score``.
        title: Figure title.

    Returns:
        A ``plotly.graph_objects.Figure`` with one ``Box`` trace per model; the trace's ``y``
        are the sharpness values of the top heads, its ``text`` their ``L{layer}H{head}``.

    Raises:
        GnaLensError: For an empty mapping, a value that is not a GnaReport, ``top < 1``, or an
            unknown ``by``.

    Examples:
        >>> from gna_lens import score_heads
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> report = score_heads(model, toy_gna_task(model, n_samples=8), control=None,
        ...                      progress=False)
        >>> fig = sharpness_comparison({"toy": report}, top=2)
        >>> fig.data[0].text, [round(v, 2) for v in fig.data[0].y]
        (('L0H0', 'L1H0'), [0.25, 1.0])
    """
    import plotly.graph_objects as go

    if not reports:
        raise GnaLensError(
            "sharpness_comparison(reports={}): pass at least one {label: GnaReport}."
        )
    if top < 1:
        raise GnaLensError(f"sharpness_comparison(top={top!r}): expected a positive head count.")
    fig = go.Figure()
    for label, report in reports.items():
        if not _is_report(report):
            raise GnaLensError(
                f"sharpness_comparison: reports[{label!r}] is {type(report).__name__}; expected a "
                "GnaReport (from gna_lens.score_heads)."
            )
        with warnings.catch_warnings():  # fewer than top: the figure shows what qualifies
            warnings.simplefilter("ignore", UserWarning)
            heads = report.top(top, by=by if by is not None else _default_rank(report))
        index = {h: i for i, h in enumerate(report.heads)}
        sharp = report.scores["sharpness"]
        fig.add_trace(
            go.Box(
                y=[float(sharp[index[h]]) for h in heads],
                text=[head_label(h) for h in heads],
                name=str(label),
                boxpoints="all",
                jitter=0.4,
                pointpos=0.0,
                hovertemplate="%{text}: sharpness %{y:.3f}<extra>%{fullData.name}</extra>",
            )
        )
    fig.update_layout(
        title=title or f"Sharpness of the top {top} heads",
        yaxis={"title": "sharpness (peak weight of the final-position row)", "range": [0, 1.05]},
        xaxis={"title": "model"},
        showlegend=False,
        template="plotly_white",
    )
    return fig


def _accuracy_rows(results: Any) -> dict[str, dict[int, float]]:
    import pandas as pd

    if isinstance(results, pd.DataFrame):
        missing = [c for c in ("model", "n_pairs", "accuracy") if c not in results.columns]
        if missing:
            raise GnaLensError(
                f"accuracy_vs_dictionary_size: the DataFrame lacks column(s) {missing}; it has "
                f"{list(results.columns)}. Expected one row per (model, n_pairs) with columns "
                "'model', 'n_pairs', 'accuracy'."
            )
        rows: dict[str, dict[int, float]] = {}
        for model, n, acc in results[["model", "n_pairs", "accuracy"]].itertuples(index=False):
            rows.setdefault(str(model), {})[int(n)] = float(acc)
        return rows
    if isinstance(results, Mapping) and all(isinstance(v, Mapping) for v in results.values()):
        return {str(k): {int(n): float(a) for n, a in v.items()} for k, v in results.items()}
    raise GnaLensError(
        f"accuracy_vs_dictionary_size: got {type(results).__name__}; expected "
        "{model: {n_pairs: accuracy}} or a DataFrame with columns 'model', 'n_pairs', 'accuracy'."
    )


def accuracy_vs_dictionary_size(
    results: Any,
    *,
    chance: float | Mapping[int, float] | Literal["1/n"] | None = "1/n",
    title: str | None = None,
    log_x: bool = True,
) -> Any:
    """Retrieval accuracy against the number of key-value pairs in the prompt, one line per model.

    Args:
        results: ``{model: {n_pairs: accuracy}}``, or a DataFrame with columns ``model``,
            ``n_pairs`` and ``accuracy`` (one row per model and size).
        chance: The dashed chance line: ``"1/n"`` (guessing among the ``n_pairs`` values in the
            prompt, the chance of :func:`gna_lens.tasks.kv_retrieval` scored by choices), a
            constant, ``{n_pairs: chance}`` (e.g. from ``task.chance``), or ``None`` for none.
        title: Figure title.
        log_x: Logarithmic (base 2) x axis.

    Returns:
        A ``plotly.graph_objects.Figure``: one ``Scatter`` per model (x sorted), then the
        chance line named ``"chance"``.

    Raises:
        GnaLensError: For results of another shape, missing columns, or an unknown ``chance``.

    Examples:
        >>> fig = accuracy_vs_dictionary_size({"pythia": {4: 1.0, 16: 0.8, 64: 0.3}})
        >>> [(t.name, list(t.y)) for t in fig.data]
        [('pythia', [1.0, 0.8, 0.3]), ('chance', [0.25, 0.0625, 0.015625])]
    """
    import plotly.graph_objects as go

    rows = _accuracy_rows(results)
    if not rows or not any(rows.values()):
        raise GnaLensError(
            f"accuracy_vs_dictionary_size: no results in {results!r}; pass at least one model "
            "with one (n_pairs, accuracy)."
        )
    fig = go.Figure()
    for model, by_n in rows.items():
        xs = sorted(by_n)
        fig.add_trace(go.Scatter(x=xs, y=[by_n[n] for n in xs], mode="lines+markers", name=model))
    sizes = sorted({n for by_n in rows.values() for n in by_n})
    if chance is not None:
        if chance == "1/n":
            if min(sizes) < 1:
                raise GnaLensError(
                    f"accuracy_vs_dictionary_size(chance='1/n'): n_pairs {sizes} must be >= 1."
                )
            line = [1.0 / n for n in sizes]
        elif isinstance(chance, Mapping):
            absent = [n for n in sizes if n not in chance]
            if absent:
                raise GnaLensError(
                    f"accuracy_vs_dictionary_size: chance has no value for n_pairs {absent}; "
                    f"it has {sorted(chance)}."
                )
            line = [float(chance[n]) for n in sizes]
        elif isinstance(chance, int | float) and not isinstance(chance, bool):
            line = [float(chance)] * len(sizes)
        else:
            raise GnaLensError(
                f"accuracy_vs_dictionary_size(chance={chance!r}); expected '1/n', a number, "
                "{n_pairs: chance} or None."
            )
        dashed = {"dash": "dash", "color": "gray"}
        fig.add_trace(go.Scatter(x=sizes, y=line, mode="lines", name="chance", line=dashed))
    fig.update_layout(
        title=title or "Retrieval accuracy vs dictionary size",
        xaxis={"title": "key-value pairs in the prompt", "type": "log" if log_x else "linear"},
        yaxis={"title": "accuracy", "range": [0, 1.05]},
        template="plotly_white",
    )
    if log_x:
        fig.update_xaxes(tickvals=sizes, ticktext=[str(n) for n in sizes])
    return fig


def find_browser(browser: str | Path | None = None) -> str | None:
    """The Chrome / Chromium that :func:`save_png` uses, or ``None`` if there is none.

    Looks at ``browser``, then the ``BROWSER_PATH`` environment variable, then ``PATH`` for
    :data:`BROWSER_NAMES`, then kaleido's own search (a Chrome downloaded by
    ``plotly_get_chrome``, typical install paths).

    Args:
        browser: An explicit executable (path or name on ``PATH``).

    Returns:
        The executable's path, or ``None``.
    """
    for candidate in (browser, os.environ.get("BROWSER_PATH")):
        if candidate:
            return shutil.which(str(candidate))
    found = next((path for path in map(shutil.which, BROWSER_NAMES) if path), None)
    if found:
        return found
    try:  # kaleido's own search: a Chrome from plotly_get_chrome, typical install paths
        from choreographer.browsers import Chromium

        return Chromium.find_browser(skip_local=False)
    except Exception:  # choreographer missing, or an API this version does not have
        return None


def _png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` of PNG bytes from the IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise GnaLensError(f"not PNG data (starts with {data[:16]!r}).")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def save_png(
    fig: Any,
    path: str | Path,
    *,
    width: int = 900,
    height: int = 600,
    scale: float = 1.0,
    browser: str | Path | None = None,
    timeout: float = 90.0,
) -> Path:
    """Write a plotly figure as a static PNG, offline (no CDN, MathJax off).

    Uses ``kaleido>=1`` (``pip install 'gna-lens[png]'``), which drives a Chrome or Chromium
    found by :func:`find_browser` (on Debian: ``apt-get install chromium``).

    Args:
        fig: A ``plotly.graph_objects.Figure`` (or its dict).
        path: Output file ending in ``.png``; parent folders are created.
        width: Layout width in CSS pixels.
        height: Layout height in CSS pixels.
        scale: Pixel ratio: the PNG is ``round(width * scale) x round(height * scale)``.
        browser: Chrome / Chromium executable (default: :func:`find_browser`).
        timeout: Seconds to wait for the render.

    Returns:
        The path written.

    Raises:
        GnaLensError: For a path that is not ``.png``, non-positive sizes, a missing kaleido or
            browser (the message says what to install), or a render that failed.

    Examples:
        >>> save_png({"data": []}, "figure.jpg")
        Traceback (most recent call last):
        ...
        gna_lens.errors.GnaLensError: save_png(path='figure.jpg'): expected a path ending in '.png'; use fig.write_image for other formats.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise GnaLensError(
            f"save_png(path={str(path)!r}): expected a path ending in '.png'; use "
            "fig.write_image for other formats."
        )
    if width <= 0 or height <= 0 or scale <= 0:
        raise GnaLensError(
            f"save_png(width={width!r}, height={height!r}, scale={scale!r}): expected positive "
            "numbers."
        )
    try:
        import kaleido
    except ImportError as exc:
        raise GnaLensError(
            f"save_png({str(path)!r}) needs kaleido>=1, which is not installed: "
            "pip install 'gna-lens[png]' (or pip install 'kaleido>=1'); it also needs a Chrome or "
            "Chromium (Debian: apt-get install chromium)."
        ) from exc
    major = int(str(getattr(kaleido, "__version__", "1")).split(".")[0] or 1)
    if major < 1:
        raise GnaLensError(
            f"save_png({str(path)!r}): kaleido {kaleido.__version__} is installed; plotly>=6.1 "
            "needs kaleido>=1: pip install -U 'kaleido>=1'."
        )
    exe = find_browser(browser)
    if exe is None:
        where = f"browser={str(browser)!r}" if browser else "BROWSER_PATH, PATH"
        raise GnaLensError(
            f"save_png({str(path)!r}): no Chrome or Chromium found (looked at {where}; names "
            f"{list(BROWSER_NAMES)}). Install one (Debian/Ubuntu: apt-get install -y chromium; "
            "with network: plotly_get_chrome), or pass browser='/path/to/chrome' or set "
            "BROWSER_PATH."
        )
    fig_dict = fig if isinstance(fig, dict) else fig.to_dict()
    opts = {"format": "png", "width": int(width), "height": int(height), "scale": float(scale)}
    try:
        data = kaleido.calc_fig_sync(
            fig_dict, opts=opts, kopts={"mathjax": False, "path": exe, "timeout": timeout}
        )
    except Exception as exc:
        raise GnaLensError(
            f"save_png({str(path)!r}, width={width}, height={height}, scale={scale}): the render "
            f"with {exe} failed: {type(exc).__name__}: {exc}. Check that the browser starts "
            f"headless ({exe} --headless --no-sandbox --dump-dom about:blank)."
        ) from exc
    _png_size(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- data classes
def cell_result_figure(result: Any, title: str | None = None) -> Any:
    """The figure of :meth:`CellResult.plot <gna_lens.interventions.result.CellResult.plot>`:
    the task effect per cell with its 95% interval, and the control effect (right axis) where
    measured.

    Args:
        result: A :class:`~gna_lens.interventions.result.CellResult` (read through ``label``,
            ``to_dataframe``, ``metric``, ``has_control`` and its plot title and axis).
        title: Figure title (default: the result's kind and task).

    Returns:
        A ``plotly.graph_objects.Figure``.
    """
    import plotly.graph_objects as go

    labels = [result.label(i) for i in range(len(result))]
    df = result.to_dataframe()
    fig = go.Figure()
    lines: list[tuple[str, str, str, str, str | None]] = [
        ("effect", "effect_low", "effect_high", f"{result.metric} effect", None)
    ]
    if result.has_control:
        lines.append(("control_effect", "control_low", "control_high", "control loss change", "y2"))
    for mid, low, high, name, axis in lines:
        bars = _error_bars(df[mid], df[low], df[high])
        fig.add_trace(
            go.Scatter(
                x=labels, y=df[mid], mode="markers+lines", name=name, yaxis=axis, error_y=bars
            )
        )
    fig.update_layout(
        title=title or result._plot_title(),
        xaxis_title=result._plot_axis(),
        yaxis_title=f"{result.metric} change",
        yaxis2=dict(title="control loss change", overlaying="y", side="right"),
        template="plotly_white",
    )
    return fig


def _error_bars(mid: Any, low: Any, high: Any, scale: float = 1.0, **extra: Any) -> dict[str, Any]:
    """Plotly's asymmetric ``error_y`` from the values and their interval ends (times ``scale``)."""
    return dict(
        type="data",
        symmetric=False,
        array=[scale * (h - m) for m, h in zip(mid, high, strict=True)],
        arrayminus=[scale * (m - lo) for m, lo in zip(mid, low, strict=True)],
        **extra,
    )


def _iv_bars(ivs: list[Any], **extra: Any) -> dict[str, Any]:
    """:func:`_error_bars` of intervals (``value``, ``low``, ``high``), in percent."""
    values, lows, highs = ([getattr(iv, k) for iv in ivs] for k in ("value", "low", "high"))
    return _error_bars(values, lows, highs, 100.0, **extra)


def benchmark_figure(table: Any) -> Any:
    """The figure of :meth:`BenchmarkTable.figure <gna_lens.lm_eval.BenchmarkTable.figure>`:
    each task's metric (%, 95% intervals) against heads removed; random rows at their ``k``,
    the draws as open circles, their mean as an open diamond with its interval.

    Args:
        table: A :class:`~gna_lens.lm_eval.BenchmarkTable` (read through ``tasks``,
            ``remove_top``, ``cell(k, task)``, ``random_cells(task)`` and ``model``; a random
            cell through ``kind``, ``label``, ``k``, ``value`` and ``heads``).

    Returns:
        A ``plotly.graph_objects.Figure``: one ``Scatter`` per task, then per task one for its
        random draws and one for their mean (where the table has random rows).
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    for t in table.tasks:
        cs = [table.cell(k, t) for k in table.remove_top]
        fig.add_trace(
            go.Scatter(
                x=list(table.remove_top),
                y=[100 * c.value.value for c in cs],
                error_y=_iv_bars([c.value for c in cs]),
                mode="lines+markers",
                name=t,
            )
        )
    for t in table.tasks:
        for kind, symbol in (("random", "circle-open"), ("random_mean", "diamond-open")):
            cs = [c for c in table.random_cells(t) if c.kind == kind]
            if not cs:
                continue
            fig.add_trace(
                go.Scatter(
                    x=[c.k for c in cs],
                    y=[100 * c.value.value for c in cs],
                    error_y=_iv_bars([c.value for c in cs], visible=kind == "random_mean"),
                    text=[f"{c.label}: {heads_label(c.heads, ';')}" for c in cs],
                    mode="markers",
                    marker={"symbol": symbol, "size": 9},
                    name=f"{t} {cs[0].label.split(' ')[0]}{' mean' if kind != 'random' else ''}",
                )
            )
    fig.update_layout(
        title=f"{table.model}: top-k G&A heads removed",
        xaxis_title="heads removed (top k of the ranking)",
        yaxis_title="metric (%), 95% intervals",
    )
    return fig


def hybrid_figure(table: Any) -> Any:
    """The figure of :meth:`HybridTable.figure <gna_lens.hybrid.HybridTable.figure>`: per KV
    task, accuracy (95% intervals) against k, top-k and random-k students, with the teacher and
    chance as lines.

    Args:
        table: A :class:`~gna_lens.hybrid.HybridTable` (read through ``kv_tasks``, ``rows``,
            ``chance`` and ``teacher``).

    Returns:
        A ``plotly.graph_objects.Figure`` with one panel per KV task.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(table.kv_tasks), subplot_titles=table.kv_tasks)
    colors = {"top": "#1f77b4", "random": "#d62728"}
    for i, t in enumerate(table.kv_tasks, start=1):
        where = {"row": 1, "col": i}
        for kind in ("top", "random"):
            rows = [r for r in hybrid_curve_rows(table, kind) if t in r.kv]
            fig.add_trace(
                go.Scatter(
                    x=[r.k for r in rows],
                    y=[100 * r.kv[t].value for r in rows],
                    error_y=_iv_bars([r.kv[t] for r in rows]),
                    mode="markers+lines",
                    name=f"{kind}-k",
                    marker_color=colors[kind],
                    showlegend=i == 1,
                ),
                **where,
            )
        teacher = next((r for r in table.rows if r.kind == "teacher"), None)
        if teacher is not None and t in teacher.kv:
            fig.add_hline(y=100 * teacher.kv[t].value, line_dash="dash", line_color="gray", **where)
        fig.add_hline(y=100 * table.chance.get(t, 0), line_dash="dot", line_color="black", **where)
        fig.update_xaxes(title_text="heads kept as attention (k)", **where)
    fig.update_yaxes(title_text="held-out accuracy (%), 95% intervals", row=1, col=1)
    fig.update_layout(title=f"Hybrid students of {table.teacher}: top-k vs random-k heads kept")
    return fig


def distill_figure(result: Any) -> Any:
    """The figure of :meth:`DistillResult.figure <gna_lens.hybrid.DistillResult.figure>`: each
    stage's loss (mean over layers in stage 1) against tokens.

    Args:
        result: A :class:`~gna_lens.hybrid.DistillResult` (read through ``to_dataframe``).

    Returns:
        A ``plotly.graph_objects.Figure`` with one panel per stage.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    df = result.to_dataframe()
    names = list(dict.fromkeys(df["stage"]))
    fig = make_subplots(rows=1, cols=max(1, len(names)), subplot_titles=names)
    for i, name in enumerate(names, start=1):
        part = (
            df[df["stage"] == name]
            .groupby("step", as_index=False)
            .agg(loss=("loss", "mean"), tokens=("tokens", "max"))
        )
        fig.add_trace(
            go.Scatter(x=part["tokens"], y=part["loss"], mode="lines", name=name),
            row=1,
            col=i,
        )
        fig.update_xaxes(title_text="tokens", row=1, col=i)
    fig.update_layout(title="distillation loss (stage 1: normalized MSE; stage 2: KL, nats)")
    return fig
