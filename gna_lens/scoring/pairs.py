"""G&A pair finding and the retrieval-vs-knowledge split."""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gna_lens.errors import GnaLensError
from gna_lens.interventions import ablate_heads, aggregate_mask, gather_mask, mask_patterns
from gna_lens.interventions._common import describe_task
from gna_lens.scoring.patterns import Head
from gna_lens.scoring.report import GnaReport, score_heads
from gna_lens.tasks import Batch, Task, evaluate

__all__ = [
    "GnaPair",
    "KnowledgeTable",
    "find_gna_pairs",
    "masked_accuracy",
    "retrieval_vs_knowledge",
]


def _single_token_choices(task: Task) -> None:
    bad = [i for i, s in enumerate(task) if any(len(c) != 1 for c in s.choice_ids)]
    if bad:
        raise GnaLensError(
            f"{describe_task(task)}: samples {bad[:5]} have multi-token choices; pair finding "
            "scores choices from one forward pass. Use single-token choices (KV retrieval with "
            "single-token values, or the letter format)."
        )


def masked_accuracy(
    model: Any,
    task: Task,
    masks: Callable[[Batch], Mapping[Head, Tensor]] | None = None,
    *,
    mode: str = "post",
    batch_size: int = 8,
) -> float:
    """Accuracy on ``task`` with per-batch pattern masks applied (``None``: no masks).

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A task with single-token choices.
        masks: ``batch -> {(layer, head): [batch, pos, pos] keep-mask}`` (e.g. from
            :func:`~gna_lens.interventions.gather_mask` of the batch).
        mode: ``"post"`` or ``"pre"`` (see :func:`~gna_lens.interventions.mask_patterns`).
        batch_size: Prompts per forward pass.

    Returns:
        The fraction of samples whose correct choice has the highest logit.
    """
    _single_token_choices(task)
    device = next(model.parameters()).device
    correct = 0
    with torch.no_grad():
        for batch in task.batches(batch_size, padding_side="left"):
            ids = batch.input_ids.to(device)
            attn = batch.attention_mask.to(device)
            if masks is None:
                logits = model(ids, attention_mask=attn)
            else:
                with mask_patterns(model, dict(masks(batch)), mode=mode):  # type: ignore[arg-type]
                    logits = model(ids, attention_mask=attn)
            last = logits[:, -1].float()
            for b, s in enumerate(batch.samples):
                choice = torch.tensor([c[0] for c in s.choice_ids], device=last.device)
                correct += int(int(last[b, choice].argmax()) == s.answer_index)
    return correct / max(len(task), 1)


@dataclass(frozen=True)
class GnaPair:
    """A candidate Gather head and Aggregate head with the causal evidence for the pair.

    Attributes:
        gather: ``(layer, head)`` of the Gather head.
        aggregate: ``(layer, head)`` of the Aggregate head (a later layer).
        gather_score: The gather head's gather score.
        aggregate_score: The aggregate head's aggregate score.
        correct_share: The aggregate head's share on the correct summary token.
        gather_ablation: Metric change when the gather head is ablated.
        aggregate_ablation: Metric change when the aggregate head is ablated.
        baseline_accuracy: Accuracy without intervention.
        kept_accuracy: Accuracy when the gather head keeps only its gather mask and the aggregate
            head only its aggregate mask (the pair's G&A patterns preserved).
        masked_accuracy: Accuracy when both heads are denied those patterns (complement masks).
        chance: The task's chance accuracy.
        confirmed: Ablating either head hurts, keeping only the G&A patterns preserves accuracy
            (within ``tolerance``), and denying them hurts.
    """

    gather: Head
    aggregate: Head
    gather_score: float
    aggregate_score: float
    correct_share: float
    gather_ablation: float
    aggregate_ablation: float
    baseline_accuracy: float
    kept_accuracy: float
    masked_accuracy: float
    chance: float
    confirmed: bool

    def to_dict(self) -> dict[str, Any]:
        """The pair and its evidence as a flat dict."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def find_gna_pairs(
    model: Any,
    task: Task,
    *,
    report: GnaReport | None = None,
    n_candidates: int = 3,
    min_effect: float = 0.05,
    tolerance: float = 0.1,
    batch_size: int = 8,
    progress: bool = True,
) -> list[GnaPair]:
    """Find Gather -> Aggregate head pairs and confirm each causally.

    Candidates: the ``n_candidates`` heads with the highest gather score among those whose
    ablation hurts, and the ``n_candidates`` with the highest ``aggregate_score * correct_share``
    among those whose ablation hurts; every (gather at layer l, aggregate at l' > l) combination is
    tested: accuracy with only the pair's G&A patterns kept (gather mask on the gather head,
    aggregate mask on the aggregate head) and with those patterns denied (complement masks).

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A retrieval task with single-token choices (KV retrieval, letter-format MC).
        report: A :func:`score_heads` report with ablation effects (computed when ``None``).
        n_candidates: Candidates per role.
        min_effect: An ablation "hurts" when it lowers the metric by more than this fraction of
            the metric's baseline magnitude.
        tolerance: Kept accuracy may fall at most this much below the baseline accuracy.
        batch_size: Prompts per forward pass.
        progress: Show progress bars.

    Returns:
        The tested pairs, confirmed ones first, then by the sum of their ablation effects.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> pairs = find_gna_pairs(model, toy_gna_task(model, n_samples=8), progress=False)
        >>> (pairs[0].gather, pairs[0].aggregate, pairs[0].confirmed)
        ((0, 0), (1, 0), True)
    """
    _single_token_choices(task)
    if report is None:
        report = score_heads(model, task, ablation=True, batch_size=batch_size, progress=progress)
    effects = report.scores["ablation_effect"]
    if bool(torch.isnan(effects).all()):
        raise GnaLensError("find_gna_pairs needs a report with ablation effects (ablation=True).")
    scale = abs(report.baseline) if not math.isnan(report.baseline) and report.baseline else 1.0
    hurts = effects.nan_to_num(nan=0.0) < -min_effect * scale
    idx = {h: i for i, h in enumerate(report.heads)}
    gather_key = report.scores["gather_score"].masked_fill(~hurts, -math.inf)
    agg_key = (report.scores["aggregate_score"] * report.scores["correct_share"]).masked_fill(
        ~hurts, -math.inf
    )
    k = min(n_candidates, int(hurts.sum()))
    gathers = [report.heads[i] for i in torch.argsort(-gather_key, stable=True)[:k].tolist()]
    aggregates = [report.heads[i] for i in torch.argsort(-agg_key, stable=True)[:k].tolist()]
    baseline_acc = masked_accuracy(model, task, None, batch_size=batch_size)
    chance = float(sum(1 / len(s.choices) for s in task) / max(len(task), 1))
    pairs = []
    for g in gathers:
        for a in aggregates:
            if a[0] <= g[0]:
                continue

            def keep(b: Batch, g: Head = g, a: Head = a) -> dict[Head, Tensor]:
                return {g: gather_mask(b), a: aggregate_mask(b)}

            def deny(b: Batch, g: Head = g, a: Head = a) -> dict[Head, Tensor]:
                return {g: gather_mask(b, complement=True), a: aggregate_mask(b, complement=True)}

            kept = masked_accuracy(model, task, keep, batch_size=batch_size)
            denied = masked_accuracy(model, task, deny, batch_size=batch_size)
            ge, ae = float(effects[idx[g]]), float(effects[idx[a]])
            confirmed = (
                bool(hurts[idx[g]])
                and bool(hurts[idx[a]])
                and kept >= baseline_acc - tolerance
                and denied < baseline_acc - tolerance
            )
            pairs.append(
                GnaPair(
                    gather=g,
                    aggregate=a,
                    gather_score=float(report.scores["gather_score"][idx[g]]),
                    aggregate_score=float(report.scores["aggregate_score"][idx[a]]),
                    correct_share=float(report.scores["correct_share"][idx[a]]),
                    gather_ablation=ge,
                    aggregate_ablation=ae,
                    baseline_accuracy=baseline_acc,
                    kept_accuracy=kept,
                    masked_accuracy=denied,
                    chance=chance,
                    confirmed=confirmed,
                )
            )
    pairs.sort(key=lambda p: (not p.confirmed, p.gather_ablation + p.aggregate_ablation))
    return pairs


@dataclass(frozen=True)
class KnowledgeTable:
    """Accuracy of a model on several tasks before and after removing some heads.

    Attributes:
        heads: The heads removed (zero-ablated at every position).
        tasks: Task names, in order.
        before: Accuracy per task with every head.
        after: Accuracy per task with ``heads`` removed.
        chance: Chance accuracy per task.
        descriptions: Each task's description.
    """

    heads: tuple[Head, ...]
    tasks: tuple[str, ...]
    before: tuple[float, ...]
    after: tuple[float, ...]
    chance: tuple[float, ...]
    descriptions: tuple[str, ...]

    def to_dataframe(self) -> Any:
        """One row per task: ``task, before, after, change, relative_change, chance``."""
        import pandas as pd

        rows = []
        for name, b, a, c in zip(self.tasks, self.before, self.after, self.chance, strict=True):
            rows.append(
                {
                    "task": name,
                    "before": b,
                    "after": a,
                    "change": a - b,
                    "relative_change": (a - b) / b if b else math.nan,
                    "chance": c,
                }
            )
        return pd.DataFrame(rows)

    def to_html(self) -> str:
        """The table as an HTML fragment."""
        heads = ", ".join(f"L{layer}H{h}" for layer, h in self.heads)
        table = self.to_dataframe().to_html(index=False, float_format=lambda x: f"{x:.3f}")
        return f"<h2>Retrieval vs knowledge (removing {heads})</h2>{table}"


def retrieval_vs_knowledge(
    model: Any,
    heads: Sequence[Head],
    tasks: Mapping[str, Task],
    *,
    batch_size: int = 8,
    progress: bool = True,
) -> KnowledgeTable:
    """Accuracy on each task before and after zero-ablating ``heads`` (the paper's table).

    Pass a retrieval-heavy task (letter-format MC, KV retrieval) and its knowledge-only twin
    (the cloze format over the same questions): removing G&A heads should hurt the first far
    more than the second.

    Args:
        model: A TransformerBridge or a HookedSSM.
        heads: ``[(layer, head), ...]`` to remove, e.g. ``report.top(4)``.
        tasks: ``{name: task}``.
        batch_size: Prompts per forward pass.
        progress: Show progress bars.

    Returns:
        A :class:`KnowledgeTable` (``.to_dataframe()`` has relative changes).

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> table = retrieval_vs_knowledge(model, [(1, 0)], {"kv": toy_gna_task(model, n_samples=8)},
        ...                                progress=False)
        >>> table.before[0], table.after[0] <= 0.25  # retrieval falls to chance
        (1.0, True)
    """
    if not tasks:
        raise GnaLensError("retrieval_vs_knowledge needs at least one task: {name: task}.")
    names = tuple(tasks)
    before = tuple(
        evaluate(model, tasks[n], batch_size=batch_size, progress=progress).accuracy for n in names
    )
    with ablate_heads(model, list(heads)):
        after = tuple(
            evaluate(model, tasks[n], batch_size=batch_size, progress=progress).accuracy
            for n in names
        )
    chance = tuple(float(tasks[n].chance) for n in names)
    return KnowledgeTable(
        heads=tuple(tuple(h) for h in heads),  # type: ignore[misc]
        tasks=names,
        before=before,
        after=after,
        chance=chance,
        descriptions=tuple(describe_task(tasks[n]) for n in names),
    )
