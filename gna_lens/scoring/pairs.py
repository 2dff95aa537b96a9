"""G&A pair finding: candidates from the report, confirmation by pattern masks.

One implementation of each step, used by :func:`find_gna_pairs` and the findings page alike:
:func:`pair_candidates` (which heads to test), :func:`gna_masks` (the keep / deny masks of a set of
gather and aggregate heads) and :func:`mask_experiment` (accuracy with no mask, kept, denied).
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import GnaLensError
from gna_lens.heads import ModelLike, Subject
from gna_lens.interventions import aggregate_mask, gather_mask, mask_patterns
from gna_lens.interventions.batching import describe_task
from gna_lens.render.markdown import head_label
from gna_lens.scoring.patterns import Head
from gna_lens.scoring.pipeline import score_heads
from gna_lens.scoring.report import GnaReport
from gna_lens.stats import Estimate, wilson_interval
from gna_lens.tasks import Batch, Task

__all__ = [
    "GnaPair",
    "MaskResult",
    "find_gna_pairs",
    "gna_masks",
    "mask_experiment",
    "masked_accuracy",
    "pair_candidates",
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
    model: ModelLike,
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
    return float(_masked_correct(model, task, masks, mode=mode, batch_size=batch_size).mean())


def _masked_correct(
    model: ModelLike,
    task: Task,
    masks: Callable[[Batch], Mapping[Head, Tensor]] | None,
    *,
    mode: str = "post",
    batch_size: int = 8,
) -> Tensor:
    """Per-sample correctness ``[n]`` (float) under ``masks``."""
    _single_token_choices(task)
    subject = Subject.of(model)
    device, run = subject.device, subject.model
    correct = torch.zeros(len(task), device=HOST)
    with torch.no_grad():
        for batch in task.batches(batch_size, padding_side="left"):
            ids = batch.input_ids.to(device)
            attn = batch.attention_mask.to(device)
            if masks is None:
                logits = run(ids, attention_mask=attn)
            else:
                with mask_patterns(subject, dict(masks(batch)), mode=mode):  # type: ignore[arg-type]
                    logits = run(ids, attention_mask=attn)
            last = logits[:, -1].float()
            for b, (s, i) in enumerate(zip(batch.samples, batch.indices, strict=True)):
                choice = torch.tensor([c[0] for c in s.choice_ids], device=last.device)
                correct[i] = float(int(last[b, choice].argmax()) == s.answer_index)
    return correct


def pair_candidates(
    report: GnaReport, k: int = 3, min_effect: float = 0.0
) -> tuple[list[Head], list[Head]]:
    """The ``k`` best Gather candidates and ``k`` best Aggregate candidates of a report.

    Among the heads whose ablation hurts (effect below ``-min_effect * |baseline|``) and, when
    the report measured a control, whose control effect is at most its ``max_control`` (generic
    heads are no candidates): gather candidates by gather score above its null
    (``gather_score - gather_null``), aggregate candidates by aggregate score above its null times
    the correct share.

    A Gather head feeds an Aggregate head, so it must sit in an earlier layer: the aggregates
    are picked first, then the gathers among the heads below the highest aggregate's layer, then
    the aggregates again among the heads above the lowest gather's layer (every aggregate has a
    gather below it, every gather an aggregate above it). A model whose candidates all sit in
    one layer gets no pair: ``([], [])``.

    Args:
        report: A :func:`~gna_lens.score_heads` report with ablation effects.
        k: Candidates per role.
        min_effect: How much an ablation must lower the metric, as a share of the baseline.

    Returns:
        ``(gathers, aggregates)``.

    Raises:
        GnaLensError: For a report without ablation effects.
    """
    effects = report.scores["ablation_effect"]
    if bool(torch.isnan(effects).all()):
        raise GnaLensError(
            "pair_candidates needs a report with ablation effects (score_heads(ablation=True))."
        )
    scale = abs(report.baseline) if not math.isnan(report.baseline) and report.baseline else 1.0
    ok = effects.nan_to_num(nan=0.0) < -min_effect * scale  # min_effect 0: -0.0, i.e. < 0
    if report.has_control:
        ok &= report.scores["control_effect"].nan_to_num(nan=math.inf) <= report.max_control
    sc = report.scores
    g = (sc["gather_score"] - sc["gather_null"].nan_to_num(nan=0.0)).masked_fill(~ok, -math.inf)
    a = ((sc["aggregate_score"] - sc["aggregate_null"]) * sc["correct_share"]).masked_fill(
        ~ok, -math.inf
    )
    layer = torch.tensor([h[0] for h in report.heads], device=g.device)

    def best(score: Tensor, allowed: Tensor) -> list[Head]:
        score = score.masked_fill(~allowed, -math.inf)
        n = min(k, int((allowed & ok).sum()))
        return [report.heads[i] for i in torch.argsort(-score, stable=True)[:n].tolist()]

    everywhere = torch.ones_like(ok)
    first = best(a, everywhere)
    if not first:
        return [], []
    gathers = best(g, layer < max(h[0] for h in first))
    if not gathers:
        return [], []
    aggregates = best(a, layer > min(h[0] for h in gathers))
    return gathers, aggregates


def gna_masks(
    gathers: Sequence[Head], aggregates: Sequence[Head], *, complement: bool = False
) -> Callable[[Batch], dict[Head, Tensor]]:
    """Per-batch masks: gather heads see only their segment, aggregate heads only the summary
    tokens (``complement=True``: exactly those attentions removed).

    A head in both lists plays both roles: it keeps what both roles keep (the intersection of
    the keep masks: its summary rows see only their segment *and* its final row only the summary
    tokens) and is denied what either role is denied (the union of the denied entries). Both are
    the ``&`` of the masks, since each role's mask is all-True outside its own rows (their
    ``|`` would keep everything: the bug of issue 30, caught by
    ``test_a_head_in_both_roles_keeps_the_intersection_and_denies_the_union``)."""

    def masks(b: Batch) -> dict[Head, Tensor]:
        out: dict[Head, Tensor] = {}
        for h in gathers:
            out[h] = gather_mask(b, complement=complement)
        for h in aggregates:
            m = aggregate_mask(b, complement=complement)
            out[h] = out[h] & m if h in out else m
        return out

    return masks


@dataclass(frozen=True)
class MaskResult:
    """Accuracy with no mask, with only the G&A patterns kept, and with them denied.

    Attributes:
        gathers: The gather heads masked.
        aggregates: The aggregate heads masked.
        baseline: No mask (Wilson 95% interval).
        kept: Only the G&A patterns kept.
        denied: The G&A patterns removed.
        chance: Chance accuracy of the task.
    """

    gathers: tuple[Head, ...]
    aggregates: tuple[Head, ...]
    baseline: Estimate
    kept: Estimate
    denied: Estimate
    chance: float

    def to_dict(self) -> dict[str, Any]:
        """Flat dict with the intervals as dicts and heads as ``"L3H2"``."""
        return {
            "gather_heads": [head_label(h) for h in self.gathers],
            "aggregate_heads": [head_label(h) for h in self.aggregates],
            "baseline": self.baseline.to_dict(),
            "kept": self.kept.to_dict(),
            "denied": self.denied.to_dict(),
            "chance": self.chance,
        }


def mask_experiment(
    model: ModelLike,
    task: Task,
    gathers: Sequence[Head],
    aggregates: Sequence[Head],
    *,
    mode: str = "post",
    batch_size: int = 16,
) -> MaskResult:
    """Accuracy on ``task`` with no mask, with only the G&A patterns kept, and with them denied.

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A task with single-token choices.
        gathers: Gather heads (keep / deny their own-segment attention from summary tokens).
        aggregates: Aggregate heads (keep / deny the final row's attention to summary tokens).
        mode: ``"post"`` or ``"pre"`` softmax masking.
        batch_size: Prompts per forward pass.

    Returns:
        A :class:`MaskResult` with Wilson intervals.
    """
    n = len(task)

    def acc(masks: Callable[[Batch], Mapping[Head, Tensor]] | None) -> Estimate:
        c = _masked_correct(model, task, masks, mode=mode, batch_size=batch_size)
        return wilson_interval(float(c.sum()), n)

    none = not gathers and not aggregates
    base = acc(None)
    return MaskResult(
        gathers=tuple(gathers),
        aggregates=tuple(aggregates),
        baseline=base,
        kept=base if none else acc(gna_masks(gathers, aggregates)),
        denied=base if none else acc(gna_masks(gathers, aggregates, complement=True)),
        chance=float(task.chance),
    )


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
    model: ModelLike,
    task: Task,
    *,
    report: GnaReport | None = None,
    control: Any = "auto",
    n_candidates: int = 3,
    min_effect: float = 0.05,
    tolerance: float = 0.1,
    batch_size: int = 8,
    progress: bool = True,
) -> list[GnaPair]:
    """Find Gather -> Aggregate head pairs and confirm each causally.

    Candidates come from :func:`pair_candidates` (heads whose ablation hurts and, with a control,
    that are not generic); every (gather at layer l, aggregate at l' > l) combination is tested:
    accuracy with only the pair's G&A patterns kept (gather mask on the gather head, aggregate
    mask on the aggregate head) and with those patterns denied (complement masks).

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A retrieval task with single-token choices (KV retrieval, letter-format MC).
        report: A :func:`score_heads` report with ablation effects (computed when ``None``).
        control: The control of that :func:`score_heads` call when ``report`` is ``None``.
        n_candidates: Candidates per role.
        min_effect: An ablation "hurts" when it lowers the metric by more than this fraction of
            the metric's baseline magnitude.
        tolerance: Kept accuracy may fall at most this much below the baseline accuracy.
        batch_size: Prompts per forward pass.
        progress: Show progress bars.

    Returns:
        The tested pairs, confirmed ones first, then by the sum of their ablation effects.

    Examples:
        >>> from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> pairs = find_gna_pairs(model, toy_gna_task(model, n_samples=8),
        ...                        control=toy_control(model), progress=False)
        >>> (pairs[0].gather, pairs[0].aggregate, pairs[0].confirmed)
        ((0, 0), (1, 0), True)
    """
    _single_token_choices(task)
    if report is None:
        report = score_heads(
            model, task, control=control, batch_size=batch_size, progress=progress, n_examples=0
        )
    effects = report.scores["ablation_effect"]
    gathers, aggregates = pair_candidates(report, n_candidates, min_effect)
    scale = abs(report.baseline) if not math.isnan(report.baseline) and report.baseline else 1.0
    hurts = effects.nan_to_num(nan=0.0) < -min_effect * scale
    idx = {h: i for i, h in enumerate(report.heads)}
    pairs = []
    for g in gathers:
        for a in aggregates:
            if a[0] <= g[0]:
                continue
            res = mask_experiment(model, task, [g], [a], batch_size=batch_size)
            baseline_acc, kept, denied = res.baseline.value, res.kept.value, res.denied.value
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
                    chance=res.chance,
                    confirmed=confirmed,
                )
            )
    pairs.sort(key=lambda p: (not p.confirmed, p.gather_ablation + p.aggregate_ablation))
    return pairs
