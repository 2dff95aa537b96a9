""":func:`score_heads`: the pipeline that turns a model and a task into a
:class:`~gna_lens.scoring.report.GnaReport`, as named stages (decisions, pattern scores, the
ablation and control sweeps, the joint walk, the report), each a function of its own.
"""

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.device import HOST, host_full, to_host
from gna_lens.errors import GnaLensError, GnaLensWarning, InterventionError
from gna_lens.heads import (
    ModelLike,
    Subject,
    describe_head_groups,
    model_of,
)
from gna_lens.interventions import ablation_sweep, attribute_heads, control_sweep
from gna_lens.interventions.ablation import SweepResult, positions_label
from gna_lens.interventions.batching import describe_task
from gna_lens.interventions.engine import shared_clean_runs
from gna_lens.interventions.layers import LayerSweepResult, layer_sweep
from gna_lens.interventions.sources import check_positions, rotated
from gna_lens.models.kernels import path_summary
from gna_lens.models.provenance import portable, provenance_method, provenance_of
from gna_lens.scoring.patterns import SCORE_NAMES, Head, pattern_scores
from gna_lens.scoring.report import (
    JOINT_K,
    MAX_CONTROL,
    SCORE_COLUMNS,
    GnaReport,
    JointSet,
    RejectedHead,
    UnmeasuredHeads,
    specificity,
)
from gna_lens.stats import Estimate, mean_interval
from gna_lens.sweep_policy import (
    DEFAULT_PREFILTER,
    EXACT_BUDGET_S,
    applied_head_groups,
    choose_strategy,
    default_top_layers,
    resolve_sweep_dtype,
    sweep_precision,
)
from gna_lens.tasks import Task, TextControl
from gna_lens.tasks.control import resolve_control

__all__ = [
    "JOINT_BATCH",
    "score_heads",
]


CONTROL_COLUMNS = ("control_effect", "control_effect_low", "control_effect_high")

#: Next candidates of the greedy joint set measured in one control sweep after a candidate was
#: turned down (turned-down heads come in runs): the first that keeps the set within the bound
#: joins. Otherwise a round measures one candidate: on a CPU a sweep costs about its rows, and
#: most candidates join.
JOINT_BATCH = 4


def _model_name(model: ModelLike) -> str:
    """The name the model was loaded by (``"smollm2-135m"``), else its config's, else its class."""
    prov = provenance_of(model)
    if prov.known and prov.name:
        return portable(str(prov.name))
    cfg = getattr(model, "cfg", None)
    for attr in ("model_name", "name_or_path"):
        name = getattr(cfg, attr, None)
        if name:
            return str(name)
    return type(model).__name__


def _examples(model: ModelLike, task: Task, heads: list[Head]) -> dict[str, Any]:
    """Patterns of ``heads`` on the task's first sample (SSM rows as |M| normalized)."""
    from gna_lens.heads import head_patterns
    from gna_lens.scoring.patterns import _capture_part_patterns

    subject = Subject.of(model)
    run, view = subject.model, subject.view
    sample = task[0]
    device = subject.device
    parts = view.parts_of(heads)  # one hook_pattern per part of a layer
    with torch.no_grad(), _capture_part_patterns(run, view, parts) as store:
        run(torch.tensor([sample.input_ids], device=device))
    patterns = {}
    for layer, h in heads:
        part, i = view.part_of((layer, h))
        # Mamba-1 groups: aggregated
        p = head_patterns(store[(layer, part.offset)], part)[0, i].float()
        if view.kind_of((layer, h)) == "ssm":
            p = p.abs().tril()
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
        patterns[f"L{layer}H{h}"] = to_host(p).tolist()
    tokenizer = getattr(run, "tokenizer", None)
    tokens = (
        [tokenizer.decode([i]) for i in sample.input_ids]
        if tokenizer is not None
        else [str(i) for i in sample.input_ids]
    )
    return {"tokens": tokens, "patterns": patterns, "sample": 0}


def _per_head(
    heads: list[Head], sweep: SweepResult
) -> tuple[Tensor, Tensor, Tensor, Float[Tensor, "head sample"]]:
    """Per head of ``heads`` (NaN for heads not in the sweep): the sweep's effect, its 95%
    bootstrap interval over samples (low, high) and the per-sample effects ``[head, sample]``."""
    ivs = sweep.effect_intervals()
    cols = [sweep.effects.tolist(), [iv.low for iv in ivs], [iv.high for iv in ivs]]
    table = torch.tensor(cols, dtype=torch.float32, device=HOST)
    samples = to_host(sweep.values.float() - sweep.baseline.float()[None])
    by_cell = {c[0]: i for i, c in enumerate(sweep.cells)}
    rows = [by_cell.get(h, len(sweep.cells)) for h in heads]  # one past the cells: a NaN row
    table = torch.cat([table, host_full((3, 1))], 1)[:, rows]
    samples = torch.cat([samples, host_full((1, samples.shape[1]))])[rows]
    return table[0], table[1], table[2], samples


def _joint_walk(
    model: ModelLike,
    control: TextControl | Task,
    report: GnaReport,
    control_samples: Tensor,
    joint_k: int,
    *,
    mode: str,
    positions: Any,
    progress: bool,
    measure: Callable[[list[list[Head]]], Tensor] | None = None,
    more: Callable[[], bool] | None = None,
) -> tuple[JointSet, str]:
    """The greedy joint set of :func:`score_heads` (see :class:`JointSet`), and its
    ``method["joint_control"]`` line.

    ``measure`` (head sets -> per-sample control changes ``[sets, samples]``) replaces the
    control sweep; :func:`~gna_lens.scoring.stability.joint_stability` passes one that reads
    cached per-window changes on resampled windows. ``more`` (``control_scope="needed"``)
    measures the control effects alone of the next heads in ablation-effect order, into
    ``report`` and ``control_samples``, when the walk needs candidates beyond those measured
    (``False``: none was left to measure).

    The first candidate joins on its own control effect (already measured, within the bound);
    each later round ablates the accepted heads plus the next candidate together (after a round
    whose first candidate was turned down, each of the next :data:`JOINT_BATCH` candidates, in
    one control sweep), and the first candidate whose set stays within the bound joins (the
    candidates before it are turned down; those after it are tried again with the larger set).
    """
    from tqdm.auto import tqdm

    bound, unit = report.max_control, report.control_unit
    candidates = _candidates(report)
    index = {h: i for i, h in enumerate(report.heads)}
    accepted: list[Head] = []
    effects: list[Estimate] = []
    rejected: list[RejectedHead] = []
    pos = sweeps = cells = 0
    width = 1  # candidates per round: JOINT_BATCH after a turned-down one
    total = joint_k if more is not None else min(joint_k, len(candidates))
    bar = tqdm(total=total, desc="joint control set", disable=not progress, leave=False)
    try:
        while len(accepted) < joint_k:
            while pos + width > len(candidates) and more is not None and more():
                candidates = _candidates(report)  # the same order, further down
            if pos >= len(candidates):
                break
            if not accepted:
                head = candidates[pos]
                pos += 1
                accepted.append(head)
                effects.append(mean_interval(control_samples[index[head]]))
                bar.update(1)
                continue
            batch = candidates[pos : pos + width]
            sets = [[*accepted, c] for c in batch]
            if measure is None:
                res = control_sweep(
                    model, control, sets, mode=mode, positions=positions, progress=False
                )
                diffs = to_host(res.values.double() - res.baseline.double()[None])
            else:
                diffs = measure(sets)
            sweeps, cells = sweeps + 1, cells + len(batch)
            means = diffs.mean(-1).tolist()
            for j, c in enumerate(batch):
                if means[j] <= bound:
                    accepted.append(c)
                    effects.append(mean_interval(diffs[j]))
                    pos += j + 1
                    bar.update(1)
                    break
                rejected.append(RejectedHead(c, float(means[j]), len(accepted)))
            else:
                pos += len(batch)
            width = JOINT_BATCH if means[0] > bound else 1
    finally:
        bar.close()
    exhausted = pos >= len(candidates)
    joint = JointSet(
        heads=tuple(accepted),
        effects=tuple(effects),
        rejected=tuple(rejected),
        bound=bound,
        unit=unit,
        joint_k=joint_k,
        exhausted=exhausted,
        n_candidates=len(candidates),
    )
    reach = "" if more is None else " of those whose control effect alone was measured"
    line = (
        f"greedy joint set: walking the per-head order ({len(candidates)} heads within "
        f"max_control alone{reach}), a head joins only if it and the heads accepted before it, "
        f"{mode}-ablated together at {positions_label(positions)} positions, raise the control "
        f"loss by at most {bound:g} {unit} on average; one candidate per control sweep, "
        f"{JOINT_BATCH} after one is turned down ({sweeps} sweeps of {cells} head sets); "
        f"{len(accepted)} heads accepted (joint_k={joint_k}), "
        f"{len(rejected)} turned down" + ("; every candidate tried" if exhausted else "")
    )
    return joint, line


def _candidates(report: GnaReport) -> list[Head]:
    """The joint walk's candidates: the per-head order (``top(n, joint=False)``) of every head
    whose control effect alone is measured and within the bound."""
    ok = report._eligible()
    return report._first(report.scores["ablation_effect"].double().masked_fill(~ok, math.inf),
                         int(ok.sum()))  # fmt: skip


def _executor_line(*sweeps: SweepResult | None) -> str:
    """The sweeps' executor in one line: workers, where, and restarts per sweep."""
    runs = [
        (s.metric, s.info["executor"]) for s in sweeps if s is not None and "executor" in s.info
    ]
    if not runs:
        return "this process"
    ex = runs[0][1]
    each = (
        f"{ex['gpus_per_worker']:g} GPU" if ex.get("gpus_per_worker")
        else f"{ex['threads_per_worker']} CPU thread(s)"
    )  # fmt: skip
    restarts = ", ".join(
        f"{'control' if metric == 'nll' else 'task'} sweep {e['restarts']} restart(s)"
        for metric, e in runs
    )
    return (
        f"Ray, {ex['workers']} workers x {each} ({ex['address']}); model: {ex['model_source']}; "
        f"{restarts}"
    )


def _unmeasured(heads: list[Head], targets: list[Head], reason: Any) -> list[UnmeasuredHeads]:
    """Per layer, the heads not in ``targets`` with ``reason(layer)``."""
    chosen = set(targets)
    by_layer: dict[int, list[Head]] = {}
    for h in heads:
        if h not in chosen:
            by_layer.setdefault(h[0], []).append(h)
    return [UnmeasuredHeads(layer, tuple(hs), reason(layer)) for layer, hs in by_layer.items()]


def _layer_reason(layers: LayerSweepResult, ranked: list[int], k: int) -> Any:
    effects, ctrl, sel = layers.effects, layers.control_effects, layers.selectivity
    row = {c[0]: i for i, c in enumerate(layers.cells)}
    unit = layers.method.get("control_unit") or ""

    def reason(layer: int) -> str:
        i = row[layer]
        numbers = f"{layers.metric} effect {float(effects[i]):+.3f}"
        if layers.has_control:
            numbers += f", control {float(ctrl[i]):+.3f} {unit}, selectivity {float(sel[i]):+.3f}"
        return (
            f"layer ranked {ranked.index(layer) + 1} of {len(ranked)} by layer removal "
            f"({numbers}); only the heads of the top {k} layers were ablated (top_layers={k})"
        )

    return reason


def score_heads(
    model: ModelLike,
    task: Task,
    ablation: bool = True,
    *,
    control: Any = "auto",
    metric: str = "logit_diff",
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    max_control: float = MAX_CONTROL,
    prefilter: int | None = None,
    strategy: str = "auto",
    top_layers: int | None = None,
    head_groups: Any = "auto",
    sweep_dtype: str | None = None,
    batch_size: int = 8,
    n_examples: int = 4,
    progress: bool = True,
    executor: Any = None,
    exact_budget_s: float = EXACT_BUDGET_S,
    joint_k: int = JOINT_K,
    control_scope: str = "all",
) -> GnaReport:
    """Score every head of ``model`` on ``task``: pattern scores, retrieval and control effects.

    Heads are ablated alone on the task and on the control; effects carry 95% bootstrap
    intervals over the prompts (the control's windows). The default ranking
    (:meth:`GnaReport.top`) is retrieval-specific: the greedy joint set (:class:`JointSet`) of
    up to ``joint_k`` heads whose control effect, alone and *removed together*, stays at most
    ``max_control`` (one control sweep per candidate, of :data:`JOINT_BATCH` after one is
    turned down; ``method["joint_control"]`` says what was done).

    Which heads are ablated (``strategy``): on models with at most :data:`EXACT_ALL_MAX` heads,
    every one (``"exact"``). On larger models, coarse to fine as the paper works
    (``"coarse_to_fine"``): every layer is removed alone on the task and the control
    (:func:`~gna_lens.interventions.layer_sweep`), layers are ranked by selectivity (share of
    the task lost minus share of the control lost), and every head of the ``top_layers`` best
    layers is ablated. ``"attribution"`` ranks every head by attribution patching and ablates
    the ``prefilter`` first. Heads never ablated keep NaN effects and are listed, with the
    reason, in :attr:`GnaReport.unmeasured`.

    Defaults and why: ``mode="zero"`` at every position (``positions=None``) is the paper's
    ablation, so rankings compare with the published ones; the control, not the ablation, keeps
    generic heads out of the top (zeroing some early heads of SmolLM2-135M breaks every
    prediction, mean-ablating them barely does: see the gotchas). ``metric="logit_diff"`` (the
    answer's logit minus the best other choice's) is continuous, so 24 prompts separate heads
    that an accuracy on the same prompts, moving in steps of 1/24, ties at zero;
    ``metric="accuracy"`` with ``prefilter=None`` is the paper's protocol exactly (single-head
    ablation, measure, reinsert, every head).

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A task with spans, e.g. :func:`gna_lens.tasks.kv_retrieval`.
        ablation: Measure each head's ablation effects (batched sweeps).
        control: What needs no in-context retrieval, in any form :func:`resolve_control` takes
            (default ``"auto"``: the zoo's cloze split on a zoo model, else ``"prose"``; ``None``:
            no control, and :meth:`GnaReport.top` needs ``by=``).
        metric: ``"logit_diff"``, ``"accuracy"``, ``"logprob"`` or ``"choice_logprob"``.
        mode: ``"zero"``, ``"mean"`` (the head's mean output over ``reference``, default the task
            itself) or ``"resample"`` (needs a ``reference`` task other than ``task``).
        positions: ``None`` (every position), ``"last"`` (the query position only) or a list.
        reference: The reference of ``"mean"`` / ``"resample"``.
        max_control: Bound (nats/token) of the retrieval-specific ranking.
        prefilter: Heads ablated exactly after attribution patching ranks all of them
            (``strategy="attribution"``; default :data:`DEFAULT_PREFILTER`). Given with
            ``strategy="auto"``, it selects ``"attribution"``.
        strategy: ``"auto"`` (default: ``"exact"`` up to :data:`EXACT_ALL_MAX` heads, and on a
            CUDA device whenever :func:`choose_strategy` estimates every head fits
            ``exact_budget_s``; else ``"coarse_to_fine"``), ``"exact"``, ``"coarse_to_fine"`` or
            ``"attribution"`` (:data:`STRATEGIES`). ``method["strategy_choice"]`` says why.
        top_layers: Layers whose heads a coarse-to-fine scan ablates (default
            :func:`default_top_layers`: 4, fewer where their heads would exceed
            :data:`EXACT_ALL_MAX`).
        head_groups: What a Mamba-1 head is, for this call only (:func:`applied_head_groups`;
            ``"auto"``: blocks of :data:`DEFAULT_CHANNEL_GROUP` channels on a Mamba-1 model
            above :data:`EXACT_ALL_MAX` heads, e.g. 24 per layer of mamba-130m). The report's
            ``(layer, head)`` then address groups (``method["head_groups"]`` says which; ablate
            them inside ``with model.head_groups(size):``).
        sweep_dtype: ``None`` (the model's dtype), ``"bfloat16"`` (autocast of the ablation
            sweeps only) or ``"auto"`` (bfloat16 only where measured faster on this model and
            device and passing :func:`check_bfloat16`: :func:`resolve_sweep_dtype`); recorded in
            ``method``. On SmolLM2-135M bfloat16 was 1.64x faster on one CPU with AVX512-BF16,
            1.78x slower on another, and 10x slower with AVX2 kernels only
            (benchmarks/RESULTS.md).
        batch_size: Prompts per forward pass of the pattern scores.
        n_examples: Top heads whose patterns on the first sample are kept for display.
        progress: Show progress bars.
        executor: ``None`` (this process) or a :class:`gna_lens.distributed.RayExecutor`: the
            head ablation sweeps on the task and the control are sharded over its Ray workers
            (pattern scores, the coarse stage and attribution run here); ``method["executor"]``
            records the workers and any restarts.
        exact_budget_s: On a CUDA device, the seconds within which ``"auto"`` ablates every
            head exactly (:func:`choose_strategy`; default :data:`EXACT_BUDGET_S`).
        joint_k: Heads of the greedy joint set (default :data:`JOINT_K`; 0: none, and
            :meth:`GnaReport.top` bounds each head alone). ``top(k)`` needs ``k <= joint_k``
            unless the walk ran out of candidates.
        control_scope: ``"all"`` (default): every ablated head's control effect alone.
            ``"needed"``: only the heads the joint set can reach, measured on demand in
            ablation-effect order (``2 * joint_k`` first, then ``joint_k`` at a time while the
            walk needs candidates): the same joint set for a fraction of the control sweep; the
            other heads' control effects are NaN, so the per-head order beyond them,
            :func:`~gna_lens.scoring.rank_stability` and
            :func:`~gna_lens.scoring.joint_stability` refuse the report. ``method["control_scope"]``
            says how far it went. With ``joint_k=0`` every head is measured.

    Returns:
        A :class:`GnaReport`.

    Raises:
        InterventionError: For a resample ablation without a distinct reference, or bad modes,
            metrics, positions, strategies, ``top_layers`` or ``joint_k``.
        TaskError: For a prose control the tokenizer does not cover.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> report = score_heads(model, toy_gna_task(model, n_samples=8), control=None,
        ...                      progress=False)
        >>> sorted(report.top(2, by="ablation_effect"))
        [(0, 0), (1, 0)]
        >>> report.top(1, by="correct_share")
        [(1, 0)]

        Coarse to fine (the default above :data:`EXACT_ALL_MAX` heads), here forced:

        >>> report = score_heads(model, toy_gna_task(model, n_samples=8), control=None,
        ...                      strategy="coarse_to_fine", top_layers=1, progress=False)
        >>> report.method["strategy"], report.n_unmeasured, report.unmeasured[0].layer
        ('coarse_to_fine', 2, 1)
    """
    if not isinstance(joint_k, int) or isinstance(joint_k, bool) or joint_k < 0:
        raise InterventionError(
            f"score_heads(joint_k={joint_k!r}); expected an int >= 0: the heads of the greedy "
            f"joint set whose control effect removed together stays within max_control. Fix: "
            f"joint_k={JOINT_K} (default), the k you will ask top(k) for, or 0 for none."
        )
    if control_scope not in ("all", "needed"):
        raise InterventionError(
            f"score_heads(control_scope={control_scope!r}); expected 'all' (every head's control "
            "effect) or 'needed' (only the heads the joint set can reach)."
        )
    with applied_head_groups(model_of(model), head_groups) as groups_choice:
        _check_task(task)
        # A Subject built by the caller stays valid unless the grouping changed just now.
        subject = Subject.of(
            model if isinstance(model, Subject) and not groups_choice else model_of(model)
        )
        positions = check_positions(positions)
        strategy, strategy_why = choose_strategy(
            subject, task, strategy, prefilter=prefilter, top_layers=top_layers,
            exact_budget_s=exact_budget_s,
        )  # fmt: skip
        dtype_choice: dict[str, Any] = {}
        if ablation:  # pattern scores alone run no sweep
            swept = {
                "attribution": DEFAULT_PREFILTER if prefilter is None else prefilter,
                "coarse_to_fine": subject.view.n_layers
                + (top_layers or default_top_layers(subject.view))
                * max(lh.n_heads for lh in subject.view),
            }.get(strategy)
            sweep_dtype, dtype_choice = resolve_sweep_dtype(subject, sweep_dtype, task, swept)
        reference = _reference(task, mode, reference)
        run = _Run(
            subject, task, metric, mode, positions, reference, sweep_dtype, progress, executor,
            control_scope=control_scope if joint_k else "all", joint_k=joint_k,
        )  # fmt: skip
        _pattern_stage(run, batch_size)
        if ablation:
            run.control = resolve_control(
                control, getattr(subject.model, "tokenizer", None), positions=positions
            )
            run.targets = run.heads
            if strategy == "attribution":
                _attribution_stage(
                    run, DEFAULT_PREFILTER if prefilter is None else prefilter, batch_size
                )
            if strategy == "coarse_to_fine":
                _layer_stage(
                    run, default_top_layers(subject.view) if top_layers is None else top_layers
                )
            _sweep_stage(run, strategy, strategy_why)
        description = _describe_control(run, max_control)
        groups = describe_head_groups(subject.view)
        if groups:
            run.method["head_groups"] = groups
        run.method.update(groups_choice)
        run.method.update(dtype_choice)  # {} without ablation
        report = _report(run, ablation, description, max_control)
        if ablation and run.control is not None and report.has_control:
            with shared_clean_runs():  # the walk's sweeps share the control's clean run
                _joint_stage(run, report, joint_k)
        if n_examples:
            with run.timed("examples"):
                _examples_stage(run, report, ablation, n_examples)
        return report


@dataclass
class _Run:
    """One :func:`score_heads` call: its settings, and what its stages fill in, in order."""

    subject: Subject
    task: Task
    metric: str
    mode: str
    positions: Any
    reference: Any
    sweep_dtype: Any
    progress: bool
    executor: Any
    heads: list[Head] = field(default_factory=list)
    kinds: Any = None
    roles: Any = None
    table: dict[str, Tensor] = field(default_factory=dict)
    samples: dict[str, Tensor] = field(default_factory=dict)
    method: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    targets: list[Head] = field(default_factory=list)
    unmeasured: list[UnmeasuredHeads] = field(default_factory=list)
    layers: LayerSweepResult | None = None
    control: Any = None
    baseline: float = math.nan
    control_baseline: float = math.nan
    control_scope: str = "all"
    order: list[Head] = field(default_factory=list)  # measured heads, most harmful first
    measured: int = 0  # of ``order``, the first this many have control effects alone
    joint_k: int = JOINT_K

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the seconds the block takes to ``timings[stage]``."""
        clock = time.perf_counter()
        yield
        self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - clock

    def precision(self) -> Any:
        return sweep_precision(self.subject, self.sweep_dtype)


def _check_task(task: Any) -> None:
    if not isinstance(task, Task) or not len(task):
        what = f"task {task.name!r} has no prompts" if isinstance(task, Task) else (
            f"task is a {type(task).__name__}"
        )  # fmt: skip
        raise GnaLensError(
            f"score_heads: {what}; expected a gna_lens.tasks.Task with at least one prompt "
            "(e.g. kv_retrieval(tokenizer, n_samples=24))."
        )


def _reference(task: Task, mode: str, reference: Any) -> Any:
    """The reference a mean / resample ablation reads (a task rotated by one for resample)."""
    if mode == "resample" and reference is task:
        raise InterventionError(
            "score_heads(mode='resample'): reference is the task itself, so every prompt would "
            "take its own head outputs and nothing would be ablated. Fix: pass reference=<another "
            "task of the same lengths> (e.g. the same generator with another seed), or none (the "
            "task rotated by one), or use mode='mean' / 'zero'."
        )
    if mode == "resample" and reference is None:
        return rotated(task, "score_heads")
    if mode == "mean" and reference is None:
        return task
    return reference


def _pattern_stage(run: _Run, batch_size: int) -> None:
    """Pattern scores of every head; the table's effect columns start as NaN."""
    with run.timed("pattern_scores"):
        scores = pattern_scores(run.subject, run.task, batch_size=batch_size, progress=run.progress)
    run.heads, run.kinds, run.roles = list(scores.heads), scores.kinds, scores.roles
    run.table = {name: getattr(scores, name) for name in SCORE_NAMES}
    nan = host_full(len(run.heads))
    for name in SCORE_COLUMNS[len(SCORE_NAMES) :]:
        run.table[name] = nan.clone()
    task, reference = run.task, run.reference
    run.method = provenance_method(run.subject.model) | {
        "metric": run.metric,
        "mode": run.mode,
        "positions": positions_label(run.positions),
        "reference": "none" if reference is None else (
            "the task itself" if reference is task else describe_task(reference)
            if isinstance(reference, Task) else f"token ids {tuple(reference.shape)}"
        ),
        "n_prompts": len(task),
        "intervals": "95% percentile bootstrap over prompts (control: over windows), paired",
    }  # fmt: skip


def _attribution_stage(run: _Run, cut: int, batch_size: int) -> None:
    """Attribution patching ranks every head; the first ``cut`` are ablated exactly."""
    heads = run.heads
    with run.timed("attribution"):
        est = attribute_heads(run.subject, run.task, metric="logit_diff", batch_size=batch_size)
    by_head = {c[0]: e for c, e in zip(est.cells, est.effects.tolist(), strict=True)}
    attribution = torch.tensor([by_head.get(h, math.nan) for h in heads], device=HOST)
    run.table["attribution"] = attribution
    order = torch.argsort(attribution.nan_to_num(nan=math.inf), stable=True).tolist()
    run.targets = [heads[i] for i in order[:cut]]
    run.unmeasured = _unmeasured(
        heads, run.targets,
        lambda layer: f"ranked below the top {cut} of {len(heads)} heads by attribution "
        "patching (its estimate is in the 'attribution' column)",
    )  # fmt: skip
    run.method.update(prefilter=f"attribution patching, top {cut}")


def _layer_stage(run: _Run, k: int) -> None:
    """Every layer removed alone on the task and the control; the heads of the top ``k`` layers
    are ablated exactly."""
    with run.timed("layer_sweep"), run.precision():
        layers = layer_sweep(
            run.subject, run.task, run.metric, [lh.layer for lh in run.subject.view],
            positions=run.positions, control=run.control, progress=run.progress,
        )  # fmt: skip
    ranked = [c[0] for c in layers.ranking()]
    chosen = set(ranked[:k])
    run.targets = [h for h in run.heads if h[0] in chosen]
    run.unmeasured = _unmeasured(run.heads, run.targets, _layer_reason(layers, ranked, k))
    run.layers = layers
    run.method.update(
        top_layers=k,
        layer_ranking=(
            f"{layers.method['ablation']}, each layer alone, on the task and the control; "
            + ("ranked by selectivity (share of the task lost minus share of the control "
               "lost)" if layers.has_control else "ranked by task effect")
            + f"; the heads of the top {k} layers ablated"
        ),
    )  # fmt: skip


def _sweep_stage(run: _Run, strategy: str, strategy_why: str) -> None:
    """Each target head ablated alone on the task and on the control."""
    subject, heads, targets = run.subject, run.heads, run.targets
    with run.precision() as precision:
        with run.timed("ablation_sweep"):
            sweep = ablation_sweep(
                subject, run.task, metric=run.metric, heads=targets, mode=run.mode,
                positions=run.positions, reference=run.reference, progress=run.progress,
                executor=run.executor,
            )  # fmt: skip
        forward_paths = path_summary(
            cast(torch.nn.Module, subject.model)
        )  # the sweep's last forward: kernels or not
    effect, lo, hi, samples = _per_head(heads, sweep)
    run.table.update(ablation_effect=effect, ablation_effect_low=lo, ablation_effect_high=hi)
    run.samples = {"ablation_effect": samples}
    run.baseline = sweep.baseline_mean
    method = run.method
    method.update(
        strategy=strategy,
        strategy_choice=strategy_why,
        n_exact=len(targets),
        n_unmeasured=len(heads) - len(targets),
        sweep_dtype=precision,
        ablation_path=sweep.method,
        paths={"ablation": sweep.info.get("paths", {})},
        forward_paths=forward_paths,
        fallbacks=[f"ablation sweep: {f}" for f in sweep.info.get("fallbacks", [])],
    )
    if "mean_over" in sweep.info:  # mean ablation: which positions the mean was taken over
        method.update(mean_over=sweep.info["mean_over"], include_bos=sweep.info["include_bos"])
    method.setdefault("prefilter", "none")
    ctrl = None
    if run.control is not None:
        # "needed": the heads the ranking can reach first (most harmful first); the joint walk
        # asks for more (_joint_stage)
        ranked = torch.argsort(effect.nan_to_num(nan=math.inf), stable=True).tolist()
        run.order = [heads[i] for i in ranked if not math.isnan(float(effect[i]))]
        ctrl = _control_chunk(
            run, targets if run.control_scope == "all" else run.order[: 2 * run.joint_k]
        )
    if run.executor is not None:
        method.update(executor=_executor_line(sweep, ctrl))
    if ctrl is not None:
        run.control_baseline = ctrl.baseline_mean
        method.update(control_path=ctrl.method)
        method["paths"]["control"] = ctrl.info.get("paths", {})


def _control_chunk(run: _Run, chunk: list[Head]) -> SweepResult | None:
    """Control effects alone of ``chunk``, merged into ``run.table`` and ``run.samples`` (the
    report holds the same dicts); ``None`` for an empty chunk."""
    if not chunk:
        return None
    with run.timed("control_sweep"), run.precision():
        ctrl = control_sweep(
            run.subject, run.control, chunk, mode=run.mode, positions=run.positions,
            progress=run.progress, executor=run.executor,
        )  # fmt: skip
    run.measured += len(chunk)
    c_eff, c_lo, c_hi, samples = _per_head(run.heads, ctrl)
    new = ~c_eff.isnan()
    run.samples.setdefault("control_effect", samples)[new] = samples[new]  # in place: the walk's
    for name, col in zip(CONTROL_COLUMNS, (c_eff, c_lo, c_hi), strict=True):
        run.table[name] = torch.where(new, col, run.table[name])
    run.table["specificity"] = specificity(
        run.table["ablation_effect"], run.baseline, run.table["control_effect"]
    )
    run.method["fallbacks"] += [f"control sweep: {f}" for f in ctrl.info.get("fallbacks", [])]
    return ctrl


def _describe_control(run: _Run, max_control: float) -> str:
    """The control in words ("" without one); its bound and unit go into ``method``."""
    resolved = run.control
    if resolved is None:
        return ""
    text = isinstance(resolved, TextControl)
    description = (
        resolved.describe()
        if text
        else f"answer NLL among the options on {describe_task(resolved)}"
    )
    unit = "nats/token" if text else "nats/answer"
    run.method.update(control=description, max_control=max_control, control_unit=unit)
    return description


def _report(run: _Run, ablation: bool, description: str, max_control: float) -> GnaReport:
    view = run.subject.view
    return GnaReport(
        model_name=_model_name(run.subject.model),
        task=describe_task(run.task),
        heads=tuple(run.heads),
        kinds=run.kinds,
        scores=run.table,
        metric=run.metric if ablation else "none",
        baseline=run.baseline,
        n_layers=view.n_layers,
        layer_heads=tuple(lh.n_heads if lh is not None else 0 for lh in view.layers),
        roles=run.roles,
        control=description,
        control_baseline=run.control_baseline,
        max_control=max_control,
        method=run.method,
        layers=run.layers,
        unmeasured=tuple(run.unmeasured),
        timings=run.timings,
        head_groups=view.group_spec,
        sample_effects=run.samples,
    )


def _joint_stage(run: _Run, report: GnaReport, joint_k: int) -> None:
    """The greedy joint set: heads whose control effect removed together stays in the bound."""
    if not joint_k:
        line = "off (joint_k=0): top() bounds each head's control effect alone, not the set's"
    else:
        spent = run.timings["control_sweep"]

        def more() -> bool:  # control_scope="needed": the next joint_k heads' control alone
            return _control_chunk(run, run.order[run.measured : run.measured + joint_k]) is not None

        with run.timed("joint_control"), run.precision():
            joint, line = _joint_walk(
                run.subject, run.control, report, run.samples["control_effect"], joint_k,
                mode=run.mode, positions=run.positions, progress=run.progress,
                more=more if run.measured < len(run.order) else None,
            )  # fmt: skip
        run.timings["joint_control"] -= run.timings["control_sweep"] - spent  # counted there
        object.__setattr__(report, "joint_set", joint)
        line += "; the walk's control sweeps share one clean run of the windows"
    run.method["joint_control"] = line
    if run.control_scope != "all":
        run.method["control_scope"] = (
            f"needed: the control effect alone measured for the first {run.measured} of the "
            f"{len(run.order)} ablated heads in ablation-effect order (most harmful first, "
            f"{2 * joint_k} and then {joint_k} at a time, as far as the joint walk reached); "
            "the others' control effects are NaN (score_heads(..., control_scope='all') or "
            "`gna-lens scan --control-all` measures every head)"
        )


def _examples_stage(run: _Run, report: GnaReport, ablation: bool, n_examples: int) -> None:
    """The patterns of the top heads on the first prompt, for display."""
    n = len(run.heads)
    with warnings.catch_warnings():  # fewer heads than n_examples: fewer examples
        warnings.simplefilter("ignore", GnaLensWarning)
        if ablation and report.has_control:
            js = report.joint_set
            k_ex = min(n_examples, n)
            use_joint = False if js is not None and k_ex > js.joint_k else None
            top = report.top(k_ex, joint=use_joint)
        else:
            by = "ablation_effect" if ablation else "aggregate_score"
            top = report.top(min(n_examples, n), by=by)
    if top:
        object.__setattr__(report, "examples", _examples(run.subject, run.task, top))
