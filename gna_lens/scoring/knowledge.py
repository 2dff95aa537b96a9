"""Retrieval vs knowledge: accuracy before / after removing heads, with intervals, a control and a
random-head baseline matched to the removed heads' layers.

Measure this on prompts *disjoint* from the ones that selected the heads (another seed, other
records): :func:`gna_lens.scan.scan` does, and says how many prompts each side had.
"""

import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gna_lens.errors import GnaLensError
from gna_lens.heads import HeadView, ModelLike, Subject
from gna_lens.interventions import ablate_heads, ablation_sweep, control_sweep
from gna_lens.interventions.ablation import positions_label
from gna_lens.interventions.batching import describe_task
from gna_lens.interventions.engine import shared_clean_runs
from gna_lens.interventions.runner import PathLog
from gna_lens.interventions.sources import rotated
from gna_lens.models.provenance import provenance_method
from gna_lens.render.html import knowledge_html
from gna_lens.render.markdown import heads_label
from gna_lens.scoring.patterns import Head
from gna_lens.stats import (
    Estimate,
    mean_interval,
    paired_permutation_test,
    two_level_interval,
    wilson_interval,
)
from gna_lens.table import Record
from gna_lens.tasks import Task, TextControl, evaluate

__all__ = [
    "ControlRow",
    "KnowledgeTable",
    "RandomHeadSets",
    "TaskRow",
    "matched_random_sets",
    "retrieval_vs_knowledge",
]

#: Random draws of the baseline when none is given.
RANDOM_DRAWS = 10
#: Fewest layer-matched sets kept before the draws are matched on head kind instead: with fewer
#: distinct layer-matched sets than requested but at least this many, every one of them is used.
MIN_MATCHED_DRAWS = 5


@dataclass(frozen=True)
class RandomHeadSets:
    """The random head sets of a baseline and how they were matched to the removed heads.

    Attributes:
        sets: The sets, all distinct, none containing a removed or an excluded head.
        matching: ``"layer"`` (as many heads per layer as the removed set) or ``"kind"`` (as
            many attention / SSM heads, any layer: used when fewer than
            :data:`MIN_MATCHED_DRAWS` distinct layer-matched sets exist, e.g. 3 of a layer's 4
            heads removed).
        n_possible: How many distinct sets that matching allows (capped at 10**9).
        requested: How many draws were asked for; ``len(sets)`` is smaller only when
            ``n_possible`` is (then every possible layer-matched set is used).
        excluded: Heads no set may contain besides the removed ones (e.g. the rest of a
            ranking's top heads, so that a "random" set is not another top head).
    """

    sets: tuple[tuple[Head, ...], ...]
    matching: str
    n_possible: int
    requested: int
    excluded: tuple[Head, ...] = ()

    def describe(self) -> str:
        """One line for method tables, e.g. ``"10 distinct sets, same layers"``."""
        how = {"layer": "same layers", "kind": "same kinds (attention/SSM), any layer"}
        text = f"{len(self.sets)} distinct sets, {how[self.matching]}"
        if self.matching == "kind":
            text += " (too few distinct sets with the same layers)"
        if len(self.sets) < self.requested:
            text += f"; only {self.n_possible} possible, {self.requested} requested: all used"
        if self.excluded:
            text += f"; {len(self.excluded)} more heads excluded from the draws"
        return text


_CAP = 10**9


def _n_sets(pools: Mapping[Any, Sequence[Head]], need: Mapping[Any, int]) -> int:
    total = 1
    for key, k in need.items():
        total = min(total * math.comb(len(pools[key]), k), _CAP)
    return total


def matched_random_sets(
    view: HeadView,
    heads: Sequence[Head],
    n_draws: int,
    seed: int = 0,
    exclude: Sequence[Head] = (),
) -> RandomHeadSets:
    """Distinct random head sets with as many heads per layer as ``heads``, none of them in it.

    When the layers cannot give ``n_draws`` distinct sets but give at least
    :data:`MIN_MATCHED_DRAWS`, every possible layer-matched set is used. With fewer (a layer has
    fewer other heads than ``heads`` takes from it), the sets are matched on head kind instead
    (as many attention and SSM heads, any layer), and the result says so: a baseline that redraws
    the same set ten times has no spread to report.

    Args:
        view: The model's head view.
        heads: The heads whose layers (or kinds) are matched.
        n_draws: Number of sets.
        seed: Seed of the draws.
        exclude: Heads never drawn either (e.g. the other heads of the ranking's top k).

    Returns:
        A :class:`RandomHeadSets`.

    Raises:
        GnaLensError: When no head outside ``heads`` is left to draw.

    Examples:
        >>> from gna_lens import head_view
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> view = head_view(tiny_hooked_ssm("mamba2"))
        >>> [lh.n_heads for lh in view]
        [8, 8]
        >>> drawn = matched_random_sets(view, [(1, 0), (1, 3)], 10)  # 15 pairs left in layer 1
        >>> drawn.matching, len(set(drawn.sets)), {layer for s in drawn.sets for layer, _ in s}
        ('layer', 10, {1})
        >>> drawn = matched_random_sets(view, [(1, 0)], 10)  # 7 left in layer 1: all 7 used
        >>> drawn.matching, len(drawn.sets)
        ('layer', 7)
        >>> drawn = matched_random_sets(view, [(1, h) for h in range(7)], 10)  # 1 left in layer 1
        >>> drawn.matching, len(drawn.sets)
        ('kind', 10)
        >>> drawn.describe()
        '10 distinct sets, same kinds (attention/SSM), any layer (too few distinct sets with the same layers)'
    """
    if not isinstance(n_draws, int) or n_draws < 0:
        raise GnaLensError(f"matched_random_sets(n_draws={n_draws!r}); expected an int >= 0.")
    taken = set(heads)
    banned = taken | set(exclude)
    free = [h for h in view.heads() if h not in banned]

    def matched(key: Callable[[Head], Any]) -> tuple[dict[Any, list[Head]], Counter[Any], int]:
        need = Counter(key(h) for h in taken)
        pools = {k: [h for h in free if key(h) == k] for k in need}
        return pools, need, _n_sets(pools, need)

    pools, need, n_possible = matched(lambda h: h[0])
    matching = "layer"
    if n_possible < min(n_draws, MIN_MATCHED_DRAWS):
        pools, need, n_possible = matched(view.kind_of)
        matching = "kind"
    if n_possible == 0 and n_draws:
        raise GnaLensError(
            f"matched_random_sets: removing {sorted(taken)} leaves too few heads to draw a set "
            f"of as many attention / SSM heads ({dict(need)}) with {len(banned) - len(taken)} "
            f"more excluded; the model has {view.n_heads_total} heads. Fix: remove or exclude "
            "fewer heads, or pass random_draws=0."
        )
    rng = random.Random(seed)
    want = min(n_draws, n_possible)
    seen: set[tuple[Head, ...]] = set()
    sets: list[tuple[Head, ...]] = []
    while len(sets) < want:
        chosen = tuple(
            sorted(h for key, k in sorted(need.items()) for h in rng.sample(pools[key], k))
        )
        if chosen not in seen:
            seen.add(chosen)
            sets.append(chosen)
    return RandomHeadSets(
        sets=tuple(sets),
        matching=matching,
        n_possible=n_possible,
        requested=n_draws,
        excluded=tuple(sorted(banned - taken)),
    )


@dataclass(frozen=True)
class TaskRow(Record):
    """One task of a :class:`KnowledgeTable`.

    Attributes:
        task: The task's name.
        description: The task's description (name, size, scoring).
        n: Prompts.
        chance: Accuracy of uniform guessing.
        before: Accuracy with every head (Wilson 95% interval).
        after: Accuracy with the heads removed (Wilson).
        change: ``after - before`` (paired bootstrap over prompts).
        random_after: Mean accuracy after removing a random matched head set, over the draws
            and prompts (a bootstrap over both: which sets were drawn and which prompts were
            asked); ``None`` without random draws.
        random_change: Mean change of those draws (bootstrap over draws and prompts), or
            ``None``.
        random_draws: Accuracy after each random draw.
        vs_random: The removed set's change minus the random sets' change, per draw and prompt
            (paired by prompt; bootstrap over draws *and* prompts, so the interval covers which
            random sets were drawn; negative: the set hurts more than random sets), or ``None``.
        p_value: Two-sided p-value of ``vs_random`` being 0 (sign-flip permutation test over
            prompts, 10,000 flips), or ``None``.
        random_note: Why there is no random baseline although draws were asked for (e.g. the
            model is not above chance on the task), else ``""``.
    """

    task: str
    description: str
    n: int
    chance: float
    before: Estimate
    after: Estimate
    change: Estimate
    random_after: Estimate | None = None
    random_change: Estimate | None = None
    random_draws: tuple[float, ...] = ()
    vs_random: Estimate | None = None
    p_value: float | None = None
    random_note: str = ""


@dataclass(frozen=True)
class ControlRow(Record):
    """The control of a :class:`KnowledgeTable`: a loss in nats.

    Attributes:
        control: The control's description.
        n: Windows (or prompts of a knowledge task).
        before: Loss with every head.
        after: Loss with the heads removed.
        change: ``after - before`` (paired bootstrap over windows).
        random_change: Mean change over the random draws (bootstrap over draws and windows), or
            ``None``.
        vs_random: The set's change minus the random sets' change, paired by window (bootstrap
            over draws and windows), or ``None``: how much more the set costs than random sets.
        unit: What the loss is: ``"nats/token"`` (text: mean next-token loss) or ``"nats/answer"``
            (a knowledge task: the answer's loss among its options).
    """

    control: str
    n: int
    before: float
    after: float
    change: Estimate
    random_change: Estimate | None = None
    unit: str = "nats/token"
    vs_random: Estimate | None = None


@dataclass(frozen=True)
class KnowledgeTable(Record):
    """Accuracy of a model on several tasks before and after removing some heads.

    Attributes:
        heads: The heads removed.
        tasks: Task names, in order.
        before: Accuracy per task with every head.
        after: Accuracy per task with ``heads`` removed.
        chance: Chance accuracy per task.
        descriptions: Each task's description.
        rows: Per task, the numbers with their 95% intervals and the random baseline.
        control: The control's loss change, or ``None`` when no control was measured.
        random_sets: The random head sets of the baseline (``method["random_sets"]`` says how
            they were matched to ``heads``: same layers, or same kinds when the layers allow
            too few distinct sets).
        method: Which weights (``weights``, one line; ``provenance``, every field), ablation
            mode, positions, random draws, how accuracies were computed.
    """

    heads: tuple[Head, ...]
    tasks: tuple[str, ...]
    before: tuple[float, ...]
    after: tuple[float, ...]
    chance: tuple[float, ...]
    descriptions: tuple[str, ...]
    rows: tuple[TaskRow, ...] = ()
    control: ControlRow | None = None
    random_sets: tuple[tuple[Head, ...], ...] = ()
    method: dict[str, Any] = field(default_factory=dict)

    def to_dataframe(self) -> Any:
        """One row per task: ``task, n, before, after, change, relative_change, chance``, each
        accuracy with ``_low``/``_high`` 95% bounds, and ``random_after`` (mean over the random
        draws, with bounds) when there were draws."""
        import pandas as pd

        records = []
        for r in self.rows:
            rec: dict[str, Any] = {"task": r.task, "n": r.n}
            for name in ("before", "after", "change"):
                iv = getattr(r, name)
                rec |= {name: iv.value, f"{name}_low": iv.low, f"{name}_high": iv.high}
            b = r.before.value
            rec["relative_change"] = (r.after.value - b) / b if b else math.nan
            if r.random_after is not None:
                ra = r.random_after
                rec |= {"random_after": ra.value, "random_low": ra.low, "random_high": ra.high}
            rec["chance"] = r.chance
            records.append(rec)
        return pd.DataFrame(records)

    def __repr__(self) -> str:
        return (
            f"KnowledgeTable({len(self.heads)} heads removed: {heads_label(self.heads)}; "
            f"{len(self.tasks)} tasks{', control' if self.control else ''}; .summary() for the "
            "numbers)"
        )

    def summary(self) -> str:
        """The numbers with their 95% intervals, one line per task and the control."""
        return "\n".join([repr(self), *self.format_lines()])

    def format_lines(self) -> list[str]:
        """Plain-text lines: one per task, then the control."""
        k = len(self.heads)
        lines = []
        for r in self.rows:
            rand = (
                f"; {k} random heads: {r.random_after.format(percent=True)}"
                if r.random_after is not None
                else f"; random heads: {r.random_note}" * bool(r.random_note)
            )
            lines.append(
                f"{r.task} (n={r.n}, chance {100 * r.chance:.1f}%): before "
                f"{r.before.format(percent=True)}, after {r.after.format(percent=True)}, change "
                f"{100 * r.change.value:+.1f} points [{100 * r.change.low:+.1f}, "
                f"{100 * r.change.high:+.1f}]{rand}"
            )
        if self.control is not None:
            c = self.control
            rand = (
                f"; {k} random heads: {c.random_change.format(signed=True)}"
                if c.random_change is not None
                else ""
            )
            lines.append(
                f"control loss ({c.control}): {c.before:.3f} -> {c.after:.3f} {c.unit}, change "
                f"{c.change.format(signed=True)}{rand}"
            )
        return lines

    def to_html(self) -> str:
        """The table as an HTML fragment (accuracies with 95% intervals, the control, the
        random baseline)."""
        return knowledge_html(self)


def _per_sample_correct(
    model: ModelLike,
    task: Task,
    cells: Sequence[tuple[Head, ...]],
    mode: str,
    positions: Any,
    reference: Any,
    batch_size: int,
    progress: bool,
) -> tuple[Tensor, Tensor, str, dict[str, Any]]:
    """``(baseline [n], values [cells, n], path, info)``: per-prompt correctness without and
    with each head set removed, and the sweep's ``paths`` / ``fallbacks``. Single-token choices
    go through the batched ablation sweep (last-position logits only, runs from the lowest
    ablated layer); others through :func:`evaluate`."""
    single = all(s.single_token_choices for s in task) and all(
        s.query_position == s.n_tokens - 1 for s in task
    )
    if single and task.scoring == "choices":
        res = ablation_sweep(
            model, task, "accuracy", [list(c) for c in cells], mode=mode, positions=positions,
            reference=reference, progress=progress,
        )  # fmt: skip
        path_info = {k: res.info.get(k, {} if k == "paths" else []) for k in ("paths", "fallbacks")}
        return res.baseline, res.values, f"ablation_sweep ({res.method})", path_info
    base = evaluate(model, task, batch_size=batch_size, progress=progress).correct.float()
    values = []
    for cell in cells:
        with ablate_heads(model, list(cell), mode=mode, positions=positions, reference=reference):
            res_c = evaluate(model, task, batch_size=batch_size, progress=progress)
        values.append(res_c.correct.float())
    return base, torch.stack(values), "evaluate + ablate_heads", {"paths": {}, "fallbacks": []}


def retrieval_vs_knowledge(
    model: ModelLike,
    heads: Sequence[Head],
    tasks: Mapping[str, Task],
    *,
    control: TextControl | Task | None = None,
    random_draws: int = RANDOM_DRAWS,
    seed: int = 0,
    exclude: Sequence[Head] = (),
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    batch_size: int = 8,
    progress: bool = True,
    random_if_above_chance: bool = False,
) -> KnowledgeTable:
    """Accuracy on each task before and after removing ``heads`` (the paper's table), with 95%
    intervals, a random-head baseline and a control.

    Pass a retrieval-heavy task (letter-format MC, KV retrieval) and its knowledge-only twin
    (the cloze format over the same questions): removing G&A heads should hurt the first far
    more than the second, far more than removing as many random heads from the same layers, and
    barely move the control's next-token loss. Measure on prompts that did not select ``heads``.

    Args:
        model: A TransformerBridge or a HookedSSM.
        heads: ``[(layer, head), ...]`` to remove, e.g. ``report.top(4)``.
        tasks: ``{name: task}``.
        control: A :class:`~gna_lens.tasks.TextControl` (or knowledge task) whose next-token
            loss change is reported; ``None``: none.
        random_draws: Random head sets (each with as many heads per layer as ``heads``) whose
            removal is measured as the baseline; 0 for none. The paper-grade minimum is 10.
            Each row compares the removed set with them prompt by prompt (``vs_random``, with
            a sign-flip ``p_value``).
        seed: Seed of the random draws.
        exclude: Heads the random sets never contain besides ``heads`` (pass the ranking's
            other top heads, so that no "random" set is a top head).
        mode: Ablation mode (``"zero"``, ``"mean"``, ``"resample"``).
        positions: Ablated positions (``None``: all).
        reference: Reference of ``"mean"`` / ``"resample"`` (resample without one: each task
            rotated by one, prompt ``i`` resampled from prompt ``i + 1``).
        batch_size: Prompts per forward pass (multi-token tasks).
        progress: Show progress bars.
        random_if_above_chance: Run the random sets only on the tasks the model does (the
            accuracy's Wilson interval lies above chance; the set itself is measured on every
            task, first, sharing its clean run with the random sets). On a task the model does
            not do, no head set can show what it does for it; the row says so in
            ``random_note`` (:func:`gna_lens.scan.scan` passes ``True``).

    Returns:
        A :class:`KnowledgeTable`.

    Raises:
        GnaLensError: Without tasks, or with negative ``random_draws``.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> table = retrieval_vs_knowledge(model, [(1, 0)], {"kv": toy_gna_task(model, n_samples=8)},
        ...                                random_draws=1, progress=False)
        >>> table.before[0], table.after[0] <= 0.25, table.rows[0].random_after.value  # retrieval falls to chance
        (1.0, True, 1.0)
    """
    if not tasks:
        raise GnaLensError("retrieval_vs_knowledge needs at least one task: {name: task}.")
    if not isinstance(random_draws, int) or random_draws < 0:
        raise GnaLensError(f"random_draws={random_draws!r}; expected an int >= 0 (10 or more).")
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    checked = tuple(view.check_heads(heads))
    drawn = matched_random_sets(view, checked, random_draws, seed, exclude=exclude)
    sets = list(drawn.sets)
    cells = [checked, *sets]
    rows = []
    paths = set()
    step_paths: dict[str, Any] = {}
    fallbacks: list[str] = []
    for name, task in tasks.items():
        ref = rotated(task, "retrieval_vs_knowledge") if (
            mode == "resample" and reference is None
        ) else reference  # fmt: skip
        n, note = len(task), ""
        with shared_clean_runs():  # the set's sweep and the random sets' share the clean run
            base, values, path, path_info = _per_sample_correct(
                model, task, cells[:1] if random_if_above_chance else cells, mode, positions,
                ref, batch_size, progress,
            )  # fmt: skip
            before = wilson_interval(float(base.sum()), n)
            if random_if_above_chance and sets and before.low <= task.chance:
                note = "not run: the model is not above chance on this task"
            elif random_if_above_chance and sets:
                _, rest, _, more = _per_sample_correct(
                    model, task, sets, mode, positions, ref, batch_size, progress
                )
                values = torch.cat([values, rest])
                path_info = PathLog.merged([path_info, more])
        paths.add(path)
        step_paths[name] = path_info["paths"]
        fallbacks += [f"{name}: {why}" for why in dict.fromkeys(path_info["fallbacks"])]
        after = values[0]
        extra: dict[str, Any] = {"random_note": note}
        if len(values) > 1:
            rand = values[1:].double()  # [draws, prompts]
            pairs = after.double()[None] - rand  # the set's change minus each random set's
            extra = dict(
                random_after=two_level_interval(rand, seed=seed),
                random_change=two_level_interval(rand - base.double()[None], seed=seed),
                random_draws=tuple(rand.mean(-1).tolist()),
                vs_random=two_level_interval(pairs, seed=seed),
                p_value=paired_permutation_test(pairs.mean(0), seed=seed),  # prompt by prompt
            )
        rows.append(
            TaskRow(
                task=name,
                description=describe_task(task),
                n=n,
                chance=float(task.chance),
                before=before,
                after=wilson_interval(float(after.sum()), n),
                change=mean_interval(after - base),
                **extra,
            )
        )
    control_row = None
    if control is not None:
        res = control_sweep(model, control, [list(c) for c in cells], mode=mode,
                            positions=positions, progress=progress)  # fmt: skip
        step_paths["control"] = res.info.get("paths", {})
        fallbacks += [f"control: {why}" for why in res.info.get("fallbacks", [])]
        diffs = res.values.double() - res.baseline.double()[None]
        control_row = ControlRow(
            control=control.describe()
            if isinstance(control, TextControl)
            else describe_task(control),
            n=int(res.values.shape[1]),
            before=res.baseline_mean,
            after=float(res.values[0].float().mean()),
            change=mean_interval(diffs[0]),
            random_change=two_level_interval(diffs[1:], seed=seed) if sets else None,
            vs_random=two_level_interval(diffs[:1] - diffs[1:], seed=seed) if sets else None,
            unit="nats/token" if isinstance(control, TextControl) else "nats/answer",
        )
    return KnowledgeTable(
        heads=checked,
        tasks=tuple(tasks),
        before=tuple(r.before.value for r in rows),
        after=tuple(r.after.value for r in rows),
        chance=tuple(r.chance for r in rows),
        descriptions=tuple(r.description for r in rows),
        rows=tuple(rows),
        control=control_row,
        random_sets=tuple(sets),
        method=provenance_method(model)
        | {
            "mode": mode,
            "positions": positions_label(positions),
            "random_draws": random_draws,
            "random_tasks": "the tasks the model does above chance (Wilson interval)"
            if random_if_above_chance
            else "every task",
            "random_sets": drawn.describe() if random_draws else "none",
            "accuracy_path": ", ".join(sorted(paths)),
            "paths": step_paths,
            "fallbacks": fallbacks,
            "intervals": "Wilson 95% for accuracies; paired bootstrap 95% for changes; "
            "bootstrap over draws and prompts for the random baseline and for the set vs the "
            "random sets (paired by prompt), sign-flip permutation p-value over prompts",
        },
    )
