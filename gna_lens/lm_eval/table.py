"""The paper's benchmark table: lm-eval once per number of top G&A heads removed
(:func:`evaluate_table`, whose result is a :class:`BenchmarkTable`)."""

import contextlib
import importlib.metadata
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gna_lens.device import HOST
from gna_lens.errors import ConfigError, GnaLensError
from gna_lens.heads import Head, HeadList, HookedModel, head_view
from gna_lens.lm_eval._model import GnaLM, _device, _dtype, format_heads, parse_heads
from gna_lens.lm_eval.tasks import LOCAL_TASKS, is_local, write_tasks
from gna_lens.render.markdown import benchmark_markdown
from gna_lens.render.plotly import benchmark_figure
from gna_lens.render.svg import benchmark_svg
from gna_lens.runtime import output_folder
from gna_lens.scoring import RandomHeadSets, matched_random_sets
from gna_lens.stats import Estimate, mean_interval, two_level_interval, wilson_interval
from gna_lens.table import Record, Table

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_TASKS",
    "RANKING_METRICS",
    "BenchmarkTable",
    "TableCell",
    "evaluate_table",
    "load_ranking",
]

#: Tasks of ``gna-lens evaluate`` when none are named: offline, retrieval vs knowledge.
DEFAULT_TASKS = ("gna_kv", "gna_mmlu_letter", "gna_mmlu_cloze")
#: Items per task by default (lm-eval's ``limit``; local tasks are written with this many).
DEFAULT_LIMIT = 100
#: Metrics tried in order when a task's metric is not given.
_METRIC_ORDER = ("acc", "exact_match", "em", "f1", "acc_norm", "word_perplexity")
#: Metrics of the ranking computed by :func:`evaluate_table` (``ranking_metric``).
RANKING_METRICS = ("logit_diff", "accuracy")
_CHANCE = {"gna_mmlu_letter": 0.25, "gna_mmlu_cloze": 0.25, "gna_kv": 1 / 6, "gna_kv_paper": 1 / 6}


_RANDOM_ONLY = ("kind", "draw", "heads")


@dataclass(frozen=True)
class TableCell(Record):
    """One task in one row of the table.

    Attributes:
        k: Heads removed (the top ``k`` of the ranking, or ``k`` random heads).
        task: lm-eval's task (or group) name.
        metric: The metric (``"acc"``, ``"exact_match"``, ...) and lm-eval's filter
            (``"acc,none"``).
        n: Items scored.
        value: The metric with its 95% interval over the items (Wilson for 0/1 metrics, else a
            percentile bootstrap).
        stderr: lm-eval's own standard error (NaN when it reports none).
        change: The change from ``k = 0`` with a paired 95% bootstrap interval over the same
            items; ``None`` in the ``k = 0`` row.
        relative: ``change / value at k = 0`` (NaN when that is 0 or in the ``k = 0`` row).
        chance: The task's chance level where known (local tasks), else ``None``.
        items: Per-item metric values, in lm-eval's (sub-task, doc_id) order (the mean over the
            draws in a ``"random_mean"`` row).
        kind: ``"top"`` (the top ``k`` of the ranking), ``"random"`` (``k`` random heads, one
            draw) or ``"random_mean"`` (the mean of the random draws: ``value`` and ``change``
            with 95% intervals over the draws and the items,
            :func:`~gna_lens.stats.two_level_interval`).
        draw: The random draw (1, 2, ...); 0 in the other rows.
        heads: The heads a ``"random"`` row removed; ``()`` in the others (a top row removes
            :attr:`BenchmarkTable.ranking` ``[:k]``).
    """

    k: int
    task: str
    metric: str
    n: int
    value: Estimate
    stderr: float
    change: Estimate | None
    relative: float
    chance: float | None = None
    items: tuple[float, ...] = field(default=(), repr=False)
    kind: str = "top"
    draw: int = 0
    heads: tuple[Head, ...] = ()

    @property
    def label(self) -> str:
        """The row's name in the rendered table: ``"10"``, ``"random-10 #1"``,
        ``"random-10 mean"``."""
        if self.kind == "random":
            return f"random-{self.k} #{self.draw}"
        if self.kind == "random_mean":
            return f"random-{self.k} mean"
        return str(self.k)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (per-item values included; ``kind``, ``draw`` and ``heads`` in random rows)."""
        out = super().to_dict()
        return (
            {k: v for k, v in out.items() if k not in _RANDOM_ONLY} if self.kind == "top" else out
        )

    def format(self) -> str:
        """``"53.0 [43.3, 62.5]"``, plus ``"; -7.0 [-12.0, -2.0] pts, -12%"`` for ``k > 0``."""
        text = self.value.format(percent=True).replace("%", "")
        if self.change is not None:
            ch = self.change
            rel = "" if math.isnan(self.relative) else f", {100 * self.relative:+.0f}%"
            text += f"; {100 * ch.value:+.1f} [{100 * ch.low:+.1f}, {100 * ch.high:+.1f}] pts{rel}"
        return text


@dataclass(frozen=True)
class BenchmarkTable(Table):
    """lm-eval results for the top 0 / k1 / k2 ... heads removed: the paper's table.

    Attributes:
        model: The model's name.
        tasks: The tasks (columns).
        remove_top: The numbers of heads removed (rows).
        ranking: The ranking the rows take their heads from (most critical first).
        cells: One :class:`TableCell` per row and task: the top-``k`` rows, then any random
            rows (``random-10 #1``, ``random-10 #2``, ..., ``random-10 mean``).
        method: How it was made: ablation mode and positions, ranking source and metric,
            weights provenance, item limit, lm-eval and gna_lens versions, seeds, and under
            ``"random"`` how the random heads were drawn.
        seconds: Wall time, total and per row (``{"total": ..., "k=0": ...,
            "random-10 #1": ...}``).
    """

    model: str
    tasks: tuple[str, ...]
    remove_top: tuple[int, ...]
    ranking: tuple[Head, ...]
    cells: tuple[TableCell, ...]
    method: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def cell(self, row: int | str, task: str) -> TableCell:
        """The cell of ``row`` and ``task``.

        Args:
            row: ``k`` for the top-``k`` row, or a row's label (``"random-10 #1"``,
                ``"random-10 mean"``; :attr:`TableCell.label`).
            task: The task.

        Raises:
            GnaLensError: For a row or task the table does not have.
        """
        label = str(row)
        for c in self.cells:
            if c.label == label and c.task == task:
                return c
        raise GnaLensError(
            f"BenchmarkTable.cell({row!r}, {task!r}): no such cell; rows {self.rows()}, "
            f"tasks {list(self.tasks)}."
        )

    def rows(self) -> list[str]:
        """The rows' labels in order: ``["0", "10", ..., "random-10 #1", ..., "random-10 mean"]``."""
        return list(dict.fromkeys(c.label for c in self.cells))

    def random_cells(self, task: str) -> list[TableCell]:
        """The random rows of ``task`` (the draws, then their mean); ``[]`` without random rows."""
        return [c for c in self.cells if c.kind != "top" and c.task == task]

    def to_dataframe(self) -> Any:
        """One row per (row, task): ``row, k, heads, task, metric, n, value, low, high, stderr,
        change, change_low, change_high, relative, chance``; ``row`` is the label
        (``"10"``, ``"random-10 #1"``, ``"random-10 mean"``), ``heads`` the heads removed
        (empty in the mean of the random draws)."""
        import pandas as pd

        rows = []
        for c in self.cells:
            ch = c.change
            heads = self.ranking[: c.k] if c.kind == "top" else c.heads
            rows.append(
                {
                    "row": c.label,
                    "k": c.k,
                    "heads": format_heads(heads),
                    "task": c.task,
                    "metric": c.metric,
                    "n": c.n,
                    "value": c.value.value,
                    "low": c.value.low,
                    "high": c.value.high,
                    "stderr": c.stderr,
                    "change": ch.value if ch else 0.0,
                    "change_low": ch.low if ch else math.nan,
                    "change_high": ch.high if ch else math.nan,
                    "relative": c.relative,
                    "chance": c.chance,
                }
            )
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        return (
            f"BenchmarkTable({self.model!r}, remove_top {list(self.remove_top)}, tasks "
            f"{list(self.tasks)}, {len(self.cells)} cells; .to_markdown() for the table)"
        )

    def to_markdown(self) -> str:
        """The table (rows: heads removed, then any random rows; columns: tasks) and the
        method, as markdown."""
        return benchmark_markdown(self)

    def figure(self) -> Any:
        """A plotly figure: each task's metric (%, 95% intervals) against heads removed (random
        draws as open circles at their ``k``, their mean as an open diamond)."""
        return benchmark_figure(self)

    def to_svg(self, width: int = 560, height: int = 320) -> str:
        """The figure as a small self-contained SVG (no plotly, no browser; random draws as
        open circles beside their top-``k`` point, their mean as an open diamond)."""
        return benchmark_svg(self, width, height)


# ----------------------------------------------------------------------------- ranking
def load_ranking(path: str | Path) -> tuple[Sequence[Head], str]:
    """The retrieval-specific head ranking of a ``gna-lens scan`` report (``report.json``).

    The report lists every head's ablation and control effects; the ranking is the scan's own
    (:meth:`~gna_lens.scoring.GnaReport.top`): the heads of its joint set first, in order
    (removed together, their control effect stays within the report's ``max_control``), then
    the others by ablation effect, most harmful first, among the heads whose control effect is
    at most ``max_control``. It is checked to start with the report's ``top`` list. A JSON list
    of heads (``[[16, 0], [17, 2]]``) or a ``{"ranking": [...]}`` file works too.

    Args:
        path: The JSON file.

    Returns:
        ``(heads, description of the source)``; ``heads`` is a :class:`~gna_lens.heads.HeadList`
        that carries the report's Mamba-1 channel groups when its heads were groups
        (:func:`evaluate_table` sets them on the model).

    Raises:
        ConfigError: For a file that is missing, not JSON, or holds no ranking.
    """
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"--ranking {str(path)!r}: cannot read it as JSON ({err.__class__.__name__}: {err}). "
            "Expected the report.json of `gna-lens scan`, or a JSON list of [layer, head]."
        ) from err
    if isinstance(data, list):
        return parse_heads(data, "ranking"), f"heads listed in {file}"
    if isinstance(data, dict) and "ranking" in data and "heads" not in data:
        return parse_heads(data["ranking"], "ranking"), f"heads listed in {file}"
    if not isinstance(data, dict) or "heads" not in data:
        raise ConfigError(
            f"--ranking {str(path)!r}: no 'heads' (per-head effects) in it; expected the "
            "report.json written by `gna-lens scan --out DIR`."
        )
    rows = data["heads"]
    max_control = float(data.get("max_control", math.inf))

    def num(r: dict[str, Any], name: str) -> float:
        return math.nan if r.get(name) is None else float(r[name])

    scored = [r for r in rows if not math.isnan(num(r, "ablation_effect"))]
    eligible = [r for r in scored if num(r, "control_effect") <= max_control]  # NaN never is
    ranked = sorted(eligible or scored, key=lambda r: num(r, "ablation_effect"))  # stable, as top()
    if eligible:
        how = f"retrieval-specific ({data.get('criterion', '')})"
    else:
        how = "raw ablation effect (the report has no control effects)"
    heads = tuple((int(r["layer"]), int(r["head"])) for r in ranked)
    joint = data.get("joint_set") or {}
    if eligible and joint.get("heads") and joint.get("bound") == data.get("max_control"):
        # The scan's top is its joint set (removed together, within the bound): it leads.
        first = tuple((int(a), int(b)) for a, b in joint["heads"])
        heads = first + tuple(h for h in heads if h not in set(first))
        how += f"; its joint set of {len(first)} heads first, then the per-head order"
    top = parse_heads(data.get("top") or [], "top")
    if top and heads[: len(top)] != top:
        raise ConfigError(
            f"--ranking {str(path)!r}: the ranking rebuilt from the per-head effects starts "
            f"{format_heads(heads[: len(top)])} but the report's top is {format_heads(top)}; "
            "the file is inconsistent (edited?). Re-run `gna-lens scan`."
        )
    task = data.get("task", "")
    model = data.get("model_name", "")
    groups = data.get("head_groups") or {}
    spec = tuple(
        (int(layer), tuple(tuple(int(c) for c in chans) for chans in sets))
        for layer, sets in sorted(groups.items(), key=lambda kv: int(kv[0]))
    )
    unit = "; heads are Mamba-1 channel groups" if spec else ""
    return HeadList(heads, spec), f"gna-lens scan report {file} ({model}, {task}; {how}{unit})"


#: What each of :data:`RANKING_METRICS` measures, for ``method`` and ``table.md``.
_RANKING_TEXT = {
    "logit_diff": "logit_diff (each head's ablation effect on the answer's logit minus the "
    "best other choice's, on KV-retrieval prompts)",
    "accuracy": "accuracy (the paper's protocol: every head ablated alone, ranked by the "
    "drop in KV-retrieval accuracy)",
}


# ----------------------------------------------------------------------------- lm-eval rows
def _leaves(name: str, group_subtasks: dict[str, list[str]]) -> list[str]:
    subs = group_subtasks.get(name) or []
    return [leaf for s in subs for leaf in _leaves(s, group_subtasks)] if subs else [name]


def _pick_metric(result: dict[str, Any], metric: str | None, task: str) -> str:
    keys = [k for k in result if "," in k and "_stderr" not in k]  # "acc,none": metric,filter
    if metric is not None:
        found = [k for k in keys if metric in (k, k.split(",")[0])]
        if not found:
            raise ConfigError(
                f"--metric {metric!r}: task {task!r} reports {sorted(keys)}; expected one of them."
            )
        return found[0]
    ordered = [k for m in _METRIC_ORDER for k in keys if k.split(",")[0] == m] + keys
    if not ordered:
        raise ConfigError(f"task {task!r}: lm-eval reported no metric ({sorted(result)}).")
    return ordered[0]


def _items(out: dict[str, Any], task: str, key: str) -> tuple[list[tuple[str, int]], list[float]]:
    metric, filt = key.split(",", 1)
    ids: list[tuple[str, int]] = []
    values: list[float] = []
    for leaf in _leaves(task, out.get("group_subtasks", {})):
        for s in out.get("samples", {}).get(leaf, []):
            if s.get("filter", filt) != filt or metric not in s:
                continue
            ids.append((leaf, int(s["doc_id"])))
            values.append(float(s[metric]))
    return ids, values


def _value_interval(values: list[float]) -> Estimate:
    if values and all(v in (0.0, 1.0) for v in values):
        return wilson_interval(sum(values), len(values))
    return mean_interval(values)


def _versions() -> str:
    found = []
    for n in ("gna-lens", "lm_eval", "torch", "transformers", "transformer-lens"):
        try:
            found.append(f"{n} {importlib.metadata.version(n)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def evaluate_table(
    model: HookedModel,
    tasks: Sequence[str] = DEFAULT_TASKS,
    remove_top: Sequence[int] = (0, 10, 20, 30),
    ranking: Any = None,
    *,
    mode: str = "zero",
    positions: str = "all",
    limit: int | None = DEFAULT_LIMIT,
    batch_size: int = 8,
    metric: str | None = None,
    num_fewshot: int | None = None,
    task_dir: str | Path | None = None,
    ranking_samples: int = 16,
    ranking_metric: str | None = None,
    sweep_dtype: str | None = None,
    random_draws: int = 0,
    random_k: int | None = None,
    seed: int = 0,
    out: str | Path | None = None,
    dtype: Any = "float32",
    device: str | None = None,
    progress: bool = True,
) -> BenchmarkTable:
    """Run lm-eval once per row of ``remove_top`` with the top ``k`` heads of ``ranking`` removed.

    Args:
        model: A loaded TransformerBridge / HookedSSM, or what :func:`gna_lens.load_model` loads
            (``"smollm2-135m"``, a folder, a hub name).
        tasks: lm-eval task names: the offline :data:`~gna_lens.lm_eval.LOCAL_TASKS` (written for
            this model's tokenizer into ``task_dir``) and any of lm-eval's own (``mmlu``,
            ``lambada_openai``, ...; these need a hub).
        remove_top: Numbers of heads removed, one row each (``0`` is the unablated model and the
            baseline of every change).
        ranking: ``None`` (computed here: :func:`~gna_lens.score_heads` on ``ranking_samples``
            KV-retrieval prompts with the prose control, as ``gna-lens scan``), a path to a
            ``gna-lens scan`` ``report.json`` (:func:`load_ranking`), or a list of heads.
        mode: ``"zero"`` or ``"mean"`` ablation.
        positions: ``"all"`` or ``"last"`` (the last context token of each request).
        limit: Items per task (local tasks are written with this many; lm-eval's ``limit`` for
            the others); ``None`` for all.
        batch_size: Rows per forward pass.
        metric: The metric of every task (default: the first of ``acc``, ``exact_match``, ...
            that the task reports).
        num_fewshot: lm-eval's few-shot count (default: the task's).
        task_dir: Where the local tasks are written (default ``out/tasks``, else a temporary
            folder); it may hold your own task YAMLs too (e.g. from :func:`write_task`), found
            by file name without lm-eval's built-in index.
        ranking_samples: Selection prompts when the ranking is computed here.
        ranking_metric: The metric of the ranking computed here (:data:`RANKING_METRICS`):
            ``"logit_diff"`` (default; continuous, so few prompts separate heads) or
            ``"accuracy"``, the paper's protocol: every head ablated alone (no prefilter, one
            sweep per head) and ranked by the drop in accuracy (use more ``ranking_samples``:
            accuracy moves in steps of ``1 / ranking_samples``). Recorded in ``method`` and
            ``table.md``. Only with ``ranking=None``.
        sweep_dtype: The ranking sweeps' autocast: ``None`` (float32), ``"bfloat16"`` or
            ``"auto"`` (:func:`~gna_lens.sweep_policy.resolve_sweep_dtype`).
        random_draws: Extra rows ``random-K #1`` ... ``#N``, each removing ``random_k`` random
            heads matched to the ranking's top ``random_k``, none of them
            (:func:`~gna_lens.scoring.matched_random_sets`, seeded by ``seed``; how they were
            drawn is in ``method["random"]``), then a ``random-K mean`` row: the mean over the
            draws with 95% intervals over the draws and the items.
        random_k: Heads removed per random draw; one of ``remove_top`` (default: its largest),
            so that each random row has its top-``k`` row to compare with.
        seed: Seed of the local tasks' MMLU sample, of the ranking's prompts and of the random
            draws.
        out: Folder to write the table into (``None``: nothing written).
        dtype: Weights dtype when ``model`` is a name (``"float32"``, ``"bfloat16"``).
        device: Device when ``model`` is a name (default: CUDA where there is one, else CPU).
        progress: Progress bars and one line per row on stderr.

    Returns:
        A :class:`BenchmarkTable`.

    Raises:
        ConfigError: For an empty or unsorted ``remove_top``, a ranking shorter than its largest
            ``k``, an unknown metric or ranking metric, a ``ranking_metric`` with a ranking
            given, or a ``random_k`` that is not a non-zero row of ``remove_top`` (or given
            without ``random_draws``).
    """
    from gna_lens.models.provenance import portable, provenance_of

    t0 = time.perf_counter()
    ks, rk = _check_table_args(remove_top, tasks, ranking, ranking_metric, random_draws, random_k)
    output_folder(out, "evaluate_table(out=...)")  # checked before the model loads
    if isinstance(model, str | Path):
        from gna_lens.models import load_model

        model = load_model(str(model), dtype=_dtype(dtype), device=_device(device))
    prov = provenance_of(model)

    def stage(text: str) -> None:
        if progress:
            print(f"gna-lens evaluate: {text}", file=sys.stderr, flush=True)

    r_metric = ranking_metric or "logit_diff"
    heads, source, groups = _table_ranking(
        model, ranking, max(ks), stage, mode=mode, positions=positions,
        ranking_samples=ranking_samples, seed=seed, sweep_dtype=sweep_dtype, progress=progress,
        metric=r_metric,
    )  # fmt: skip
    # The rows: (label, k, kind, draw, heads removed); the first is the baseline.
    rows: list[_Row] = [(str(k), k, "top", 0, tuple(heads[:k])) for k in ks]
    outputs, written, drawn, times = _run_rows(
        model, rows, heads, groups, tasks, stage, rk=rk, random_draws=random_draws, mode=mode,
        positions=positions, limit=limit, batch_size=batch_size, num_fewshot=num_fewshot,
        task_dir=task_dir, out=out, seed=seed, progress=progress,
    )  # fmt: skip
    cells, base = _table_cells(rows, outputs, tasks, metric, seed)
    if drawn is not None:
        cells += [_random_mean(cells, task, rk, base[task][1], seed) for task in tasks]
    method = {
        "mode": mode,
        "positions": positions,
        "ranking_source": source,
        # Only for a ranking computed here; a given one's metric is in its source.
        "ranking_metric": None if ranking is not None else r_metric,
        "ranking_metric_description": None if ranking is not None else _RANKING_TEXT[r_metric],
        "ranking": format_heads(heads),
        "head_groups": {layer: [list(c) for c in sets] for layer, sets in groups},
        "weights": prov.describe(),
        "provenance": prov.to_dict(),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "seed": seed,
        "local_tasks": {
            n: {"description": LOCAL_TASKS[n], "gna_lens_task": t.name, "items": len(t)}
            | {k: v for k, v in t.info.items() if isinstance(v, str | int | float)}
            for n, t in written.items()
        },
        "interval": "Wilson 95% for 0/1 metrics, else bootstrap; changes: paired bootstrap "
        "95% over the same items",
        "versions": _versions(),
        "torch_threads": torch.get_num_threads(),
    }
    if drawn is not None:
        method["random"] = _random_method(drawn, rk, random_draws, seed)
    table = BenchmarkTable(
        model=portable(str(prov.name if prov.name else getattr(model.cfg, "model_name", "model"))),
        tasks=tuple(tasks),
        remove_top=ks,
        ranking=tuple(heads),
        cells=tuple(cells),
        method=method,
        seconds={"total": time.perf_counter() - t0} | times,
    )
    if out is not None:
        table.write(out)
    return table


#: One row of the table: (label, k, kind, draw, heads removed).
_Row = tuple[str, int, str, int, tuple[Head, ...]]


def _check_table_args(
    remove_top: Sequence[int],
    tasks: Sequence[str],
    ranking: Any,
    ranking_metric: str | None,
    random_draws: Any,
    random_k: int | None,
) -> tuple[tuple[int, ...], int]:
    """The rows' sizes and the random rows' size, after checking every argument that goes with
    them (before any model loads)."""
    ks = tuple(int(k) for k in remove_top)
    if not ks or any(k < 0 for k in ks) or list(ks) != sorted(set(ks)):
        raise ConfigError(
            f"remove_top={list(remove_top)!r}; expected distinct non-negative ints in increasing "
            "order, e.g. 0,10,20,30 (0 is the baseline)."
        )
    if not tasks:
        raise ConfigError("tasks is empty; expected at least one lm-eval task name.")
    if ranking_metric is not None and ranking_metric not in RANKING_METRICS:
        raise ConfigError(
            f"ranking_metric={ranking_metric!r}; expected one of {list(RANKING_METRICS)} "
            "('accuracy' is the paper's protocol)."
        )
    if ranking_metric is not None and ranking is not None:
        raise ConfigError(
            f"ranking_metric={ranking_metric!r} with a ranking given ({str(ranking)[:80]}): the "
            "metric only applies to the ranking computed here. Fix: drop the ranking (or "
            "--ranking), or rank with `gna-lens scan --metric ...` and drop ranking_metric."
        )
    if not isinstance(random_draws, int) or isinstance(random_draws, bool) or random_draws < 0:
        raise ConfigError(f"random_draws={random_draws!r}; expected an int >= 0 (e.g. 5).")
    if random_k is not None and not random_draws:
        raise ConfigError(
            f"random_k={random_k!r} without random_draws: no random row would be made. Fix: "
            "random_draws=5 (--random-draws 5), or drop random_k."
        )
    rk = max(ks) if random_k is None else random_k
    if random_draws and (rk not in ks or rk == 0):
        raise ConfigError(
            f"random_k={rk!r} with remove_top={list(ks)}; expected one of its non-zero rows, "
            "whose top-k row the random rows are compared with. Fix: random_k in "
            f"{[k for k in ks if k] or 'a remove_top with a non-zero row'}, or add it to "
            "remove_top."
        )
    return ks, rk


def _table_ranking(
    model: HookedModel,
    ranking: Any,
    k_max: int,
    stage: Any,
    *,
    mode: str,
    positions: str,
    ranking_samples: int,
    seed: int,
    sweep_dtype: Any,
    progress: bool,
    metric: str,
) -> tuple[Sequence[Head], str, tuple[Any, ...]]:
    """The ranked heads (computed here, read from a report, or given), where they came from,
    and their channel groups; the first ``k_max`` of them."""  # fmt: skip
    heads: Sequence[Head]
    if ranking is None:  # as `gna-lens scan` ranks them
        from gna_lens.scan import EXACT_ALL_MAX, build_tasks, default_exact
        from gna_lens.scoring import JOINT_K, resolve_control, score_heads

        stage(f"ranking heads on {ranking_samples} KV-retrieval prompts (score_heads, {metric})")
        where = None if positions == "all" else "last"
        sets = build_tasks(model.tokenizer, "kv", n_samples=ranking_samples, seed=seed, n_eval=1)
        control = resolve_control("prose", model.tokenizer, positions=where, split="select")
        n_heads = head_view(model).n_heads_total
        # metric="accuracy" ablates every head alone (no attribution prefilter, no coarse
        # stage): the paper's protocol.
        exact = metric == "accuracy" or n_heads <= EXACT_ALL_MAX
        report = score_heads(
            model, sets.selection, control=control, metric=metric, mode=mode, positions=where,
            prefilter=None if exact else min(default_exact(k_max), n_heads),
            strategy="exact" if metric == "accuracy" else "auto",
            sweep_dtype=sweep_dtype, progress=progress, joint_k=max(JOINT_K, k_max),
        )  # fmt: skip
        # A HeadList: keeps the channel groups the report was scored under.
        heads = report.top(k_max)
        source = (
            f"computed on the fly: score_heads on {len(sets.selection)} KV-retrieval prompts "
            f"(question template, seed {seed}), {mode} ablation, prose control, metric {metric}; "
            f"{report.criterion}"
        )
    elif isinstance(ranking, str | Path):
        heads, source = load_ranking(ranking)
    else:
        given = parse_heads(ranking, "ranking")
        heads, source = HeadList(given, getattr(ranking, "head_groups", ())), "heads given"
        source += " by the caller"
    groups = tuple(getattr(heads, "head_groups", ()))
    if groups and not getattr(model, "channel_heads", False):
        raise ConfigError(
            f"the ranking ({source}) addresses Mamba-1 channel groups, but the model "
            f"({type(model).__name__}) has no channel heads. Fix: evaluate the model the "
            "ranking was made on."
        )
    if len(heads) < k_max:
        raise ConfigError(
            f"remove_top up to {k_max} needs {k_max} ranked heads but the ranking ({source}) has "
            f"{len(heads)}. Fix: smaller k, or a longer ranking (gna-lens scan --top {k_max})."
        )
    return heads[:k_max], source, groups


def _run_rows(
    model: HookedModel,
    rows: list[_Row],
    heads: Sequence[Head],
    groups: tuple[Any, ...],
    tasks: Sequence[str],
    stage: Any,
    *,
    rk: int,
    random_draws: int,
    mode: str,
    positions: str,
    limit: int | None,
    batch_size: int,
    num_fewshot: int | None,
    task_dir: Any,
    out: Any,
    seed: int,
    progress: bool,
) -> tuple[list[Any], dict[str, Any], RandomHeadSets | None, dict[str, float]]:
    """lm-eval once per row (the random rows are added to ``rows`` here, drawn among the heads
    as the rows address them); returns its outputs, the local tasks written, the random draw
    and the seconds per row."""  # fmt: skip
    import tempfile

    import lm_eval
    from lm_eval.tasks import TaskManager

    log = logging.getLogger("lm_eval")
    times: dict[str, float] = {}
    outputs: list[Any] = []
    drawn = None
    with contextlib.ExitStack() as stack:
        stack.callback(log.setLevel, log.level)
        if not progress:
            log.setLevel(logging.WARNING)
        if task_dir is None:
            task_dir = (
                Path(out) / "tasks"
                if out is not None
                else stack.enter_context(tempfile.TemporaryDirectory())
            )
        local = [t for t in tasks if is_local(t)]
        written = write_tasks(task_dir, model.tokenizer, local, limit=limit, seed=seed)
        # lm-eval's index of its ~thousand built-in tasks takes ~10 s: only when needed.
        found = {p.stem for p in Path(task_dir).glob("*.yaml")}
        tm = TaskManager(
            include_path=str(task_dir), include_defaults=any(t not in found for t in tasks)
        )
        # A ranking of channel groups removes the same groups: the model's heads become them.
        if groups:
            spec = {layer: [list(c) for c in sets] for layer, sets in groups}
            stack.enter_context(model.head_groups(spec))
        if random_draws:
            # As many heads per layer as the top rk, none of them (the baseline of
            # retrieval_vs_knowledge).
            drawn = matched_random_sets(head_view(model), list(heads[:rk]), random_draws, seed)
            rows += [
                (f"random-{rk} #{i}", rk, "random", i, tuple(s))
                for i, s in enumerate(drawn.sets, 1)
            ]
        for label, k, kind, _, removed in rows:
            t = time.perf_counter()
            what = f"the top {k}" if kind == "top" else f"{k} random ({label})"
            stage(f"lm-eval with {what} heads removed ({format_heads(removed) or 'none'})")
            lm = GnaLM(
                model=model, remove=list(removed), mode=mode, positions=positions,
                batch_size=batch_size,
            )  # fmt: skip
            result = lm_eval.simple_evaluate(
                model=lm, tasks=list(tasks), task_manager=tm, limit=limit,
                num_fewshot=num_fewshot, log_samples=True, bootstrap_iters=1000,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                fewshot_random_seed=seed,
            )  # fmt: skip
            if result is None:  # pragma: no cover - only on non-zero ranks
                raise GnaLensError("lm_eval.simple_evaluate returned nothing.")
            outputs.append(result)
            times[f"k={k}" if kind == "top" else label] = time.perf_counter() - t
    return outputs, written, drawn, times


def _table_cells(
    rows: list[_Row], outputs: list[Any], tasks: Sequence[str], metric: str | None, seed: int
) -> tuple[list[TableCell], dict[str, tuple[list[tuple[str, int]], list[float]]]]:
    """One cell per row and task, each with its change from the baseline row, paired by item;
    and the baseline's items per task."""
    cells = []
    base: dict[str, tuple[list[tuple[str, int]], list[float]]] = {}
    for (_, k, kind, draw, removed), res in zip(rows, outputs, strict=True):
        for task in tasks:
            if task not in res["results"]:
                raise GnaLensError(
                    f"lm-eval returned no result for task {task!r} (got {sorted(res['results'])})."
                )
            r = res["results"][task]
            key = _pick_metric(r, metric, task)
            ids, values = _items(res, task, key)
            if not values:
                raise GnaLensError(
                    f"task {task!r}: lm-eval logged no per-item {key!r}; cannot compute intervals."
                )
            name, filt = key.split(",", 1)
            se = r.get(f"{name}_stderr,{filt}")
            stderr = float(se) if isinstance(se, int | float) else math.nan
            change, relative = None, math.nan
            if not base.get(task):
                base[task] = (ids, values)
            else:
                b_ids, b_values = base[task]
                if b_ids != ids:
                    raise GnaLensError(
                        f"task {task!r}: the rows scored different items ({len(b_ids)} vs "
                        f"{len(ids)}); cannot pair them."
                    )
                # Both in float64: the baseline was rounded to float32 before (exact for 0/1
                # accuracies, not for other metrics).
                diff = torch.tensor(values, dtype=torch.float64, device=HOST) - torch.tensor(
                    b_values, dtype=torch.float64, device=HOST
                )
                change = mean_interval(diff, seed=seed)
                b_mean = sum(b_values) / len(b_values)
                relative = change.value / b_mean if b_mean else math.nan
            cells.append(
                TableCell(
                    k=k,
                    task=task,
                    metric=key,
                    n=len(values),
                    value=_value_interval(values),
                    stderr=stderr,
                    change=change,
                    relative=relative,
                    chance=_CHANCE.get(task) if is_local(task) else None,
                    items=tuple(values),
                    kind=kind,
                    draw=draw,
                    heads=removed if kind == "random" else (),
                ),
            )
    return cells, base


def _random_method(drawn: RandomHeadSets, rk: int, requested: int, seed: int) -> dict[str, Any]:
    return {
        "k": rk,
        "draws": len(drawn.sets),
        "requested": requested,
        "seed": seed,
        "pool": f"heads not in the ranking's top {rk}",
        "matching": drawn.matching,
        "matching_description": _matching_text(drawn, rk),
        "sets": [format_heads(s) for s in drawn.sets],
        "interval": "95% bootstrap over the draws and the items (two-level)"
        if len(drawn.sets) > 1
        else "95% bootstrap over the items only (a single draw: no spread over draws)",
    }


def _matching_text(drawn: RandomHeadSets, k: int) -> str:
    """How the random sets were drawn, for ``method["random"]`` and ``table.md``."""
    if drawn.matching == "layer":
        text = f"as many heads per layer as the top {k}, none of them"
    else:
        text = (
            f"from any layer (as many attention / SSM heads as the top {k}, none of them): "
            "the top set's layers have too few other heads for distinct layer-matched sets"
        )
    if len(drawn.sets) < drawn.requested:
        text += f"; only {drawn.n_possible} distinct sets exist, {drawn.requested} requested"
    return text


def _random_mean(
    cells: Sequence[TableCell], task: str, k: int, base: Sequence[float], seed: int
) -> TableCell:
    """The ``random-k mean`` cell of ``task``: value and change over the draws and the items
    (:func:`~gna_lens.stats.two_level_interval`)."""
    draws = [c for c in cells if c.kind == "random" and c.task == task]
    values = torch.tensor([c.items for c in draws], dtype=torch.float64, device=HOST)
    diff = values - torch.tensor(base, dtype=torch.float64, device=HOST)
    change = two_level_interval(diff, seed=seed)
    b_mean = sum(base) / len(base)
    return TableCell(
        k=k,
        task=task,
        metric=draws[0].metric,
        n=draws[0].n,
        value=two_level_interval(values, seed=seed),
        stderr=math.nan,
        change=change,
        relative=change.value / b_mean if b_mean else math.nan,
        chance=draws[0].chance,
        items=tuple(values.mean(0).tolist()),
        kind="random_mean",
    )
