"""Markdown: the lm-eval and hybrid tables (``BenchmarkTable``, ``HybridTable`` and
``ModelComparison.to_markdown``), and the formatting helpers of the findings page: pure
formatting of JSON-ready numbers (interval dicts ``{"value", "low", "high"}``, ``None`` for
missing).
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "benchmark_markdown",
    "comparison_markdown",
    "format_bytes",
    "format_nats",
    "format_number",
    "format_percent",
    "format_points",
    "format_share",
    "heads_text",
    "hybrid_markdown",
    "md_table",
]


# ----------------------------------------------------------------------------- formatting
def _interval(iv: Mapping[str, Any] | None, fmt: str, scale: float, unit: str = "") -> str:
    """The value (times ``scale``, through ``fmt``, then ``unit``) and its ends in brackets."""
    if not iv or iv.get("value") is None:
        return "n/a"
    lo, hi = iv.get("low"), iv.get("high")
    core = fmt.format(scale * iv["value"]) + unit
    if lo is None or hi is None:
        return core
    return f"{core} [{fmt.format(scale * lo)}, {fmt.format(scale * hi)}]"


def format_percent(iv: Mapping[str, Any] | None) -> str:
    """``"77.1% [63.5, 86.7]"`` from an interval dict."""
    return _interval(iv, "{:.1f}", 100, "%")


def format_points(iv: Mapping[str, Any] | None) -> str:
    """``"-56.2 points [-68.8, -41.7]"`` from a change interval dict."""
    return _interval(iv, "{:+.1f}", 100, " points")


def format_nats(iv: Mapping[str, Any] | None) -> str:
    """``"+0.012 [-0.004, +0.030]"`` (nats/token) from a change interval dict."""
    return _interval(iv, "{:+.3f}", 1)


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table: the header, its rule and one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def format_number(v: Any, fmt: str = "{:+.3f}") -> str:
    """``v`` through ``fmt``, or ``"n/a"`` for ``None`` and NaN."""
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def format_share(v: Any) -> str:
    """A share in ``[0, 1]`` as ``"12.5%"``, or ``"n/a"`` for ``None``."""
    return "n/a" if v is None else f"{100 * v:.1f}%"


def head_label(head: tuple[int, int]) -> str:
    """The name gna_lens gives a head everywhere it prints one: ``(3, 1)`` -> ``"L3H1"``.

    Examples:
        >>> head_label((16, 0)), heads_label([(3, 1), (5, 0)], "+")
        ('L16H0', 'L3H1+L5H0')
    """
    return f"L{head[0]}H{head[1]}"


def heads_label(heads: Sequence[tuple[int, int]], sep: str = " ") -> str:
    """:func:`head_label` of each head, joined by ``sep`` (``""`` for no heads)."""
    return sep.join(head_label(h) for h in heads)


def heads_text(heads: Sequence[tuple[int, int]]) -> str:
    """``"L3H1 L5H0"``, or ``"none"`` for no heads."""
    return heads_label(heads) or "none"


def _points(iv: dict[str, Any]) -> str:
    return _interval(iv, "{:+.1f}", 100)


# ----------------------------------------------------------------------------- tables
def benchmark_markdown(table: Any) -> str:
    """The lm-eval table (rows: heads removed; columns: tasks) and its method, as markdown:
    what :meth:`BenchmarkTable.to_markdown <gna_lens.lm_eval.BenchmarkTable.to_markdown>`
    returns. Random rows (``random-10 #1``, ..., ``random-10 mean``) follow the top-``k`` rows,
    and the notes say how their heads were drawn and which metric ranked the heads.

    Args:
        table: A :class:`~gna_lens.lm_eval.BenchmarkTable` (read through ``tasks``,
            ``remove_top``, ``cells``, ``cell(row, task)``, ``random_cells(task)``,
            ``ranking``, ``model``, ``method`` and ``seconds``; a cell through ``kind``,
            ``label``, ``heads``, ``format()``, ``metric``, ``n`` and ``chance``).

    Returns:
        The markdown, ending in a newline.
    """
    head = "| heads removed | " + " | ".join(
        f"{t} ({table.cell(table.remove_top[0], t).metric.split(',')[0]}, %)" for t in table.tasks
    )
    lines = [head + " |", "|---" * (len(table.tasks) + 1) + "|"]
    # the top-k rows, then any random rows (random-k #1, ..., random-k mean)
    randoms = list(dict.fromkeys(c.label for c in table.cells if c.kind != "top"))
    for r in [*table.remove_top, *randoms]:
        cells = " | ".join(table.cell(r, t).format() for t in table.tasks)
        lines.append(f"| {r} | {cells} |")
    m = table.method
    n = ", ".join(f"{t} {table.cell(table.remove_top[0], t).n}" for t in table.tasks)
    chance = ", ".join(
        f"{t} {100 * c:.1f}%"
        for t in table.tasks
        if (c := table.cell(table.remove_top[0], t).chance) is not None
    )
    notes = []
    if m.get("ranking_metric"):
        notes.append(f"Heads ranked by: {m['ranking_metric_description']}.")
    random_heads = []
    if randoms:
        rk = m["random"]
        notes.append(
            f"Rows random-{rk['k']} #i: {rk['k']} random heads each "
            f"({rk['matching_description']}); random-{rk['k']} mean: the mean over the draws, "
            f"{rk['interval']}."
        )
        random_heads.append(
            "- Random heads: "
            + "; ".join(
                f"{c.label} {heads_label(c.heads, ';')}"
                for c in table.random_cells(table.tasks[0])
                if c.heads
            )
        )
    lines += [
        "",
        "Values: the metric over the items with a 95% interval (Wilson for 0/1 metrics); "
        "in later rows the change from 0 heads removed in points with a paired bootstrap "
        "95% interval over the same items, and the relative change.",
        *notes,
        "",
        f"- Model: {table.model}; weights: {m.get('weights', 'not recorded')}",
        f"- Heads removed (most critical first): {heads_label(table.ranking, ';') or 'none'}",
        f"- Ranking: {m.get('ranking_source', '')}",
        *random_heads,
        f"- Ablation: {m.get('mode')} at {m.get('positions')} positions; items per task: "
        f"{n}" + (f"; chance: {chance}" if chance else ""),
        f"- Versions: {m.get('versions', '')}",
        f"- Time: {table.seconds.get('total', math.nan):.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in table.seconds.items() if k != "total")
        + ")",
    ]
    return "\n".join(lines) + "\n"


def format_bytes(n: float) -> str:
    """A byte count in decimal units (1 MB = 10^6 bytes, as the paper's state-size table).

    Examples:
        >>> format_bytes(512), format_bytes(1536), format_bytes(4_194_304), format_bytes(3.5e9)
        ('512 B', '1.5 kB', '4.2 MB', '3.50 GB')
    """
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {unit}" if unit == "GB" else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def comparison_markdown(comparison: Any) -> str:
    """Several models' lm-eval tables side by side (per task: rows of heads removed, one column
    per model, each removing its own top heads) and what each keeps per sequence: what
    :meth:`ModelComparison.to_markdown <gna_lens.lm_eval.ModelComparison.to_markdown>` returns.

    Args:
        comparison: A :class:`~gna_lens.lm_eval.ModelComparison` (read through ``tables``,
            ``states`` and ``method``; each table as :func:`benchmark_markdown` reads it, each
            state through ``model``, ``attention_heads``, ``ssm_heads``, ``element_bytes``,
            ``recurrent_bytes``, ``kv_bytes_per_token``, ``total_bytes(L)``).

    Returns:
        The markdown, ending in a newline.
    """
    tables, m = comparison.tables, comparison.method
    models = [t.model for t in tables]
    lines: list[str] = []
    for task in tables[0].tasks:
        metric = tables[0].cell(tables[0].remove_top[0], task).metric.split(",")[0]
        lines += [f"### {task} ({metric}, %)", ""]
        labels = list(dict.fromkeys(c.label for t in tables for c in t.cells if c.task == task))
        rows = []
        for label in labels:
            cells = [[c for c in t.cells if c.task == task and c.label == label] for t in tables]
            rows.append([label, *(found[0].format() if found else "-" for found in cells)])
        lines += [*md_table(["heads removed", *models], rows), ""]
    lengths = list(m.get("state_lengths", []))
    dtype = m.get("state_dtype", "")
    header = ["model", "attention heads", "SSM heads", "recurrent state", "KV cache per token"]
    header += [f"total at {L:,} tokens" for L in lengths]
    state_rows = [
        [s.model, s.attention_heads, s.ssm_heads, format_bytes(s.recurrent_bytes),
         format_bytes(s.kv_bytes_per_token), *(format_bytes(s.total_bytes(L)) for L in lengths)]
        for s in comparison.states
    ]  # fmt: skip
    lines += [
        "### State kept per sequence while generating",
        "",
        *md_table(header, state_rows),
        "",
        f"Counted in {dtype} ({comparison.states[0].element_bytes} bytes per number): the SSM "
        "heads' recurrent states and convolution windows (fixed), and the attention layers' "
        "keys and values (growing with the sequence). Decimal units (1 MB = 10^6 bytes).",
        "",
        "Values: the metric over the items with a 95% interval (Wilson for 0/1 metrics); in "
        "later rows the change from 0 heads removed in points with a paired bootstrap 95% "
        "interval over the same items, and the relative change. Each model removes its own top "
        "heads.",
        "",
    ]
    for t in tables:
        tm = t.method
        lines += [
            f"- {t.model}: weights {tm.get('weights', 'not recorded')}; ranking: "
            f"{tm.get('ranking_source', '')}"
            + (f" ({tm['ranking_metric_description']})" if tm.get("ranking_metric") else "")
            + f"; top heads {heads_label(t.ranking[: max(t.remove_top)], ';') or 'none'}; "
            f"ablation {tm.get('mode')} at {tm.get('positions')} positions"
        ]
    return "\n".join(lines) + "\n"


def hybrid_markdown(table: Any) -> str:
    """The hybrid experiment's table, its comparisons and its method, as markdown: what
    :meth:`HybridTable.to_markdown <gna_lens.hybrid.HybridTable.to_markdown>` returns.

    Args:
        table: A :class:`~gna_lens.hybrid.HybridTable` (read through ``lengths``, ``kv_tasks``,
            ``knowledge_task``, ``rows``, ``chance``, ``method``, ``comparisons()`` and
            ``seconds``).

    Returns:
        The markdown, ending in a newline.
    """
    lengths = table.lengths
    head = ["model", "k", "heads kept"]
    head += [f"{t} (%)" for t in table.kv_tasks]
    head += ["prose loss (nats/token)", f"{table.knowledge_task or 'knowledge'} (%)"]
    head += [f"bytes/token L={L} (state + KV)" for L in lengths]
    rows = []
    for r in table.rows:
        cells = [r.name, "all" if r.kind == "teacher" else str(r.k)]
        cells.append("all" if r.kind == "teacher" else heads_text(r.heads))
        cells += [
            r.kv[t].format(percent=True).replace("%", "") if t in r.kv else "not measured"
            for t in table.kv_tasks
        ]
        cells.append(r.prose.format() if r.prose else "n/a")
        cells.append(r.knowledge.format(percent=True).replace("%", "") if r.knowledge else "n/a")
        cells += [
            f"{r.state[L]['bytes_per_token']:,.0f} ({r.state[L]['recurrent_bytes'] / L:,.0f} + "
            f"{r.state[L]['kv_cache_bytes'] / L:,.0f})"
            for L in lengths
        ]
        rows.append(cells)
    lines = md_table(head, rows)
    chance = ", ".join(f"{k} {100 * v:.1f}%" for k, v in table.chance.items())
    m = table.method
    lines += [
        "",
        "Accuracies over the choices with 95% Wilson intervals; prose loss: mean next-token "
        "loss with a 95% bootstrap interval over the windows; bytes/token: (recurrent state "
        "+ KV cache) / L per sequence while generating, each part in parentheses, at the stored "
        "dtype "
        f"({m.get('state_dtype', '')}). Chance: {chance}.",
        "",
    ]
    comps = table.comparisons()
    if comps:
        lines += [
            "Top-k against random-k and k = 0, per distillation data (several training "
            "seeds: the top-k students' mean): the other students' best (with their mean "
            "where there are several); Wilson intervals apart (above / below: every top-k "
            "student's interval beyond the best other's) or overlapping; paired: the "
            "difference over the same prompts with a 95% bootstrap interval over the "
            "prompts, against the best other student and ('vs mean') against the mean of "
            "them all:",
            "",
        ]
        several_data = len({c["data"] for c in comps}) > 1
        for c in comps:
            where = f" [{c['data']} data]" if several_data or c["data"] != "default" else ""
            top = f"top {100 * c['top']:.1f}%"
            if len(c["seeds"]) > 1:
                top += f" (mean of {len(c['seeds'])} seeds)"
            parts = [f"k={c['k']} {c['task']}{where}: {top}"]
            for label in ("random", "k=0"):
                if label not in c:
                    continue
                sep = "above" if c[f"above_{label}"] else (
                    "below" if c[f"below_{label}"] else "overlapping"
                )  # fmt: skip
                n = c.get(f"n_{label}", 1)
                text = f"{label} {100 * c[label]:.1f}%"
                if n > 1:
                    lo, hi = c[f"{label}_range"]
                    text = (
                        f"{label} best {100 * c[label]:.1f}% of {n} (mean "
                        f"{100 * c[f'{label}_mean']:.1f}%, range {100 * lo:.1f}-{100 * hi:.1f}%)"
                    )
                text += f" ({sep}"
                pv = c.get(f"paired_{label}")
                if pv is not None:
                    text += f"; paired {_points(pv)}"
                pm = c.get(f"paired_{label}_mean")
                if pm is not None and n > 1:
                    text += f"; vs mean {_points(pm)}"
                parts.append(text + (" points)" if pv is not None else ")"))
            lines.append("- " + ", ".join(parts))
            per = c.get("per_seed") or []
            if len(per) > 1:
                seeds = [
                    f"seed {p['seed']}: top {100 * p['top']:.1f}%, random mean "
                    f"{100 * p['random_mean']:.1f}% of {p['n_random']}"
                    + (
                        f", paired {_points(p['paired_random_mean'])} points"
                        if "paired_random_mean" in p
                        else ""
                    )
                    for p in per
                ]
                lines.append("  - per seed: " + "; ".join(seeds))
        lines.append("")
    composition = m.get("data_composition_text") or {}
    if composition:
        lines += ["Distillation data composition (share of texts / of tokens per source):", ""]
        lines += [*(f"- {choice}: {text}" for choice, text in composition.items()), ""]
    lines += ["Method:", ""]
    for key in (
        "teacher", "ranking", "selection", "held_out", "knowledge", "prose", "distillation",
        "budget", "data", "stages", "student", "random_heads", "seeds", "controls", "only",
        "pending", "unmeasured", "machine", "versions",
    ):  # fmt: skip
        if key in m:
            lines.append(f"- {key.replace('_', ' ')}: {m[key]}")
    total = table.seconds.get("total", math.nan)
    lines.append(
        f"- time: {total / 60:.1f} min ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in table.seconds.items() if k != "total")
        + ")"
    )
    return "\n".join(lines) + "\n"
