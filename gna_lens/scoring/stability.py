"""How stable the per-head ranking of a :class:`~gna_lens.scoring.GnaReport` is.

:func:`rank_stability` redraws the report's prompts (and, independently, its control samples)
with replacement, ranks the heads again on each resample exactly as
``GnaReport.top(k, joint=False)`` ranks them (by ablation effect, most harmful first, among the
heads whose control effect is at most the bound), and gives each top head a 95% interval of its
rank, for several bounds and, by drawing fewer prompts, several prompt counts. It needs the
report's per-sample effects (:attr:`~gna_lens.scoring.GnaReport.sample_effects`), which
:func:`~gna_lens.scoring.score_heads` keeps.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import GnaLensError
from gna_lens.heads import ModelLike
from gna_lens.scoring.patterns import Head
from gna_lens.scoring.report import GnaReport
from gna_lens.stats import percentile_interval
from gna_lens.table import Record

__all__ = ["JointStability", "RankInterval", "RankStability", "joint_stability", "rank_stability"]


@dataclass(frozen=True)
class RankInterval:
    """One top head's rank at one bound and prompt count, with its 95% bootstrap interval.

    Attributes:
        bound: The control bound of the ranking.
        n_prompts: Prompts drawn per resample.
        rank: Its rank (1: most harmful) in the per-head order of the report's own numbers.
        head: ``(layer, head)``.
        ablation_effect: Its ablation effect (the report's).
        control_effect: Its control effect (the report's).
        rank_low: 2.5th percentile of its rank over the resamples.
        rank_high: 97.5th percentile (``inf`` when in more than 2.5% of the resamples its
            control effect exceeds the bound, so it is not ranked at all).
        p_top_k: Share of the resamples in which it is among their top ``k``.
        p_eligible: Share of the resamples in which its control effect stays within the bound.
    """

    bound: float
    n_prompts: int
    rank: int
    head: Head
    ablation_effect: float
    control_effect: float
    rank_low: float
    rank_high: float
    p_top_k: float
    p_eligible: float

    def to_dict(self) -> dict[str, Any]:
        """A flat dict (``inf`` as ``None``)."""
        return {
            "bound": self.bound,
            "n_prompts": self.n_prompts,
            "rank": self.rank,
            "layer": self.head[0],
            "head": self.head[1],
            "ablation_effect": self.ablation_effect,
            "control_effect": self.control_effect,
            "rank_low": None if math.isinf(self.rank_low) else self.rank_low,
            "rank_high": None if math.isinf(self.rank_high) else self.rank_high,
            "p_top_k": self.p_top_k,
            "p_eligible": self.p_eligible,
        }


#: The keys of :meth:`RankInterval.to_dict`, the columns of :meth:`RankStability.to_dataframe`.
_COLUMNS = (
    "bound", "n_prompts", "rank", "layer", "head", "ablation_effect", "control_effect",
    "rank_low", "rank_high", "p_top_k", "p_eligible",
)  # fmt: skip


@dataclass(frozen=True)
class RankStability(Record):
    """The top ``k`` of the per-head ranking per bound and prompt count, with rank intervals.

    Attributes:
        rows: One :class:`RankInterval` per bound, prompt count and top head, in that order.
        bounds: The control bounds.
        n_prompts: The prompt counts drawn per resample.
        n_available: The report's prompts.
        k: Top heads per ranking.
        n_boot: Resamples.
        seed: Seed of the resampling.
        unit: The control's unit.
        method: How the intervals were made, in one line.
    """

    rows: tuple[RankInterval, ...]
    bounds: tuple[float, ...]
    n_prompts: tuple[int, ...]
    n_available: int
    k: int
    n_boot: int
    seed: int
    unit: str
    method: str

    def top(self, bound: float, n_prompts: int | None = None) -> list[Head]:
        """The top heads at ``bound`` (the per-head order of the report's own numbers).

        Raises:
            GnaLensError: For a bound or prompt count that was not computed.
        """
        n = self.n_prompts[-1] if n_prompts is None else n_prompts
        if bound not in self.bounds or n not in self.n_prompts:
            raise GnaLensError(
                f"RankStability.top(bound={bound!r}, n_prompts={n_prompts!r}); computed for "
                f"bounds {list(self.bounds)} and n_prompts {list(self.n_prompts)}."
            )
        return [r.head for r in self.rows if r.bound == bound and r.n_prompts == n]

    def to_dataframe(self) -> Any:
        """One row per bound, prompt count and top head: ``bound, n_prompts, rank, layer,
        head, ablation_effect, control_effect, rank_low, rank_high, p_top_k, p_eligible``."""
        import pandas as pd

        data = [r.to_dict() | {"rank_low": r.rank_low, "rank_high": r.rank_high} for r in self.rows]
        return pd.DataFrame(data, columns=list(_COLUMNS))


def rank_stability(
    report: GnaReport,
    bounds: Sequence[float] = (0.05, 0.1, 0.2),
    *,
    k: int = 10,
    n_boot: int = 1000,
    seed: int = 0,
    n_prompts: Sequence[int] | None = None,
) -> RankStability:
    """The per-head top ``k`` at each control bound, with a 95% rank interval per top head.

    Each resample draws ``n_prompts`` of the report's prompts with replacement (all of them by
    default; fewer approximates the spread of a scan on fewer prompts) and, independently, all
    of its control samples with replacement; on each, heads are ranked as
    ``GnaReport.top(k, joint=False)`` ranks them: by mean ablation effect (most harmful first)
    among the heads whose mean control effect is at most the bound. The same resamples serve
    every bound. A head's rank in a resample where its control effect exceeds the bound is
    ``inf``. The point ranking is the report's own (``top(k, joint=False)`` at the report's
    ``max_control``).

    Args:
        report: A report of :func:`~gna_lens.scoring.score_heads` with a control (its
            :attr:`~gna_lens.scoring.GnaReport.sample_effects`).
        bounds: Control bounds (the report's unit, e.g. nats/token).
        k: Top heads per ranking.
        n_boot: Resamples.
        seed: Seed of the resampling.
        n_prompts: Prompts drawn per resample, one ranking per value (default: all of them).

    Returns:
        A :class:`RankStability`.

    Raises:
        GnaLensError: For a report without per-sample ablation and control effects, empty or
            non-finite bounds, ``k`` or ``n_boot`` below 1, or a prompt count outside
            ``1..n`` (the report's prompts).

    Examples:
        >>> from gna_lens.scoring import score_heads
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
        >>> model = toy_gna_model(generic_head=True)
        >>> report = score_heads(model, toy_gna_task(model, n_samples=8),
        ...                      control=toy_control(model), progress=False)
        >>> stab = rank_stability(report, bounds=(0.1, 100.0), k=2, n_boot=200,
        ...                       n_prompts=(4, 8))
        >>> stab.top(0.1), stab.top(100.0)  # a loose bound lets the generic head in
        ([(0, 0), (1, 0)], [(0, 2), (0, 0)])
        >>> df = stab.to_dataframe()
        >>> df[df.n_prompts == 8][["bound", "rank", "layer", "head", "rank_low", "rank_high"]]
           bound  rank  layer  head  rank_low  rank_high
        2    0.1     1      0     0       1.0        1.0
        3    0.1     2      1     0       2.0        2.0
        6  100.0     1      0     2       1.0        1.0
        7  100.0     2      0     0       2.0        2.0
    """
    effects, controls = _sample_effects(report, "rank_stability")
    bounds = tuple(float(b) for b in bounds)
    if not bounds or not all(math.isfinite(b) for b in bounds):
        raise GnaLensError(
            f"rank_stability(bounds={bounds!r}); expected one or more finite control bounds in "
            f"{report.control_unit}, e.g. (0.05, 0.1, 0.2)."
        )
    for name, v in (("k", k), ("n_boot", n_boot)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise GnaLensError(f"rank_stability({name}={v!r}); expected a positive int.")
    n_heads, n_total = effects.shape
    counts = (n_total,) if n_prompts is None else tuple(n_prompts)
    bad = [m for m in counts if not isinstance(m, int) or isinstance(m, bool) or m < 1]
    if not counts or bad or max(counts) > n_total:
        raise GnaLensError(
            f"rank_stability(n_prompts={n_prompts!r}); expected prompt counts between 1 and "
            f"{n_total} (the report's prompts), e.g. n_prompts=({max(1, n_total // 3)}, "
            f"{n_total})."
        )
    measured = ~(effects.isnan().any(-1) | controls.isnan().any(-1))
    point_effect = report.scores["ablation_effect"].double()
    point_ctrl = report.scores["control_effect"].double()
    n_windows = controls.shape[1]
    boots = {}  # the same resamples for every bound
    for m in counts:
        gen = torch.Generator(device=HOST).manual_seed(seed)
        a_boot = effects.nan_to_num(0.0) @ _counts(n_total, m, n_boot, gen).T / m  # [head, boot]
        c_boot = controls.nan_to_num(0.0) @ _counts(n_windows, n_windows, n_boot, gen).T
        boots[m] = (a_boot, c_boot / n_windows)
    steps = torch.arange(1, n_heads + 1, dtype=torch.float64, device=HOST)[:, None]
    rows: list[RankInterval] = []
    for bound in bounds:
        ok = ~point_effect.isnan() & ~point_ctrl.isnan() & (point_ctrl <= bound)
        key = point_effect.masked_fill(~ok, math.inf)
        top = torch.argsort(key, stable=True)[: min(k, int(ok.sum()))].tolist()
        for m in counts:
            a_boot, c_boot = boots[m]
            eligible = measured[:, None] & (c_boot <= bound)
            order = torch.argsort(a_boot.masked_fill(~eligible, math.inf), dim=0, stable=True)
            ranks = torch.empty_like(a_boot).scatter_(0, order, steps.expand(-1, n_boot))
            ranks = ranks.masked_fill(~eligible, math.inf)
            for rank, i in enumerate(top, start=1):
                iv = percentile_interval(rank, ranks[i], lower="lower", upper="higher")
                p_top_k = float((ranks[i] <= k).double().mean())
                rows.append(RankInterval(
                    bound, m, rank, report.heads[i], float(point_effect[i]),
                    float(point_ctrl[i]), iv.low, iv.high, p_top_k,
                    p_eligible=float(eligible[i].double().mean()),
                ))  # fmt: skip
    method = (
        f"{n_boot} resamples: prompts drawn with replacement (n_prompts of {n_total}) and, "
        f"independently, the control's {n_windows} samples; each resample ranks heads by mean "
        "ablation effect among those whose mean control effect is within the bound (as "
        "top(k, joint=False)); 2.5th-97.5th percentile of each top head's rank"
    )
    return RankStability(
        rows=tuple(rows),
        bounds=bounds,
        n_prompts=counts,
        n_available=n_total,
        k=k,
        n_boot=n_boot,
        seed=seed,
        unit=report.control_unit,
        method=method,
    )


def _sample_effects(report: GnaReport, name: str) -> tuple[Tensor, Tensor]:
    """The report's per-sample ablation and control effects (``[head, sample]``, float64)."""
    samples = report.sample_effects or {}
    if "ablation_effect" not in samples or "control_effect" not in samples:
        raise GnaLensError(
            f"{name}: the report has per-sample effects {sorted(samples) or 'none'}; expected "
            "'ablation_effect' and 'control_effect' (kept by score_heads with ablation=True and "
            "a control, since issue 30; a report loaded from an older report.json has none). "
            "Fix: score the heads again with score_heads(model, task, control='prose')."
        )
    effects, controls = samples["ablation_effect"], samples["control_effect"]
    if bool((controls.isnan().all(-1) & ~effects.isnan().all(-1)).any()):
        raise GnaLensError(
            f"{name}: the report measured control effects only for the heads its joint walk "
            "reached (control_scope='needed'), and resamples reorder the heads past them. Fix: "
            "score_heads(..., control_scope='all') (`gna-lens scan --control-all`)."
        )
    return samples["ablation_effect"].double().to(HOST), samples["control_effect"].double().to(HOST)


def _counts(n: int, m: int, n_boot: int, gen: torch.Generator) -> Tensor:
    """``[n_boot, n]`` counts of each unit among ``m`` draws with replacement."""
    idx = torch.randint(0, n, (n_boot, m), generator=gen, device=HOST)
    out = torch.zeros(n_boot, n, dtype=torch.float64, device=HOST)
    return out.scatter_add_(1, idx, torch.ones(n_boot, m, dtype=torch.float64, device=HOST))


@dataclass(frozen=True)
class JointStability:
    """How often each head stays in the joint set over resampled selection data.

    Attributes:
        heads: The published joint set's first ``k`` heads (:meth:`GnaReport.top`).
        share: ``{head: share of resamples whose joint top k holds it}`` for every head that
            appeared in one, most frequent first.
        mean_shared: The mean number of the published heads a resample's set keeps.
        same_set: The share of resamples whose joint top k is the published set (any order).
        k: Heads per set.
        n_boot: Resamples.
        seed: Seed of the resampling.
        method: How the sets were redrawn, in one line.
    """

    heads: tuple[Head, ...]
    share: dict[Head, float]
    mean_shared: float
    same_set: float
    k: int
    n_boot: int
    seed: int
    method: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (heads as ``"L{layer}H{head}"``)."""
        from gna_lens.render.markdown import head_label

        return {
            "heads": [head_label(h) for h in self.heads],
            "share": {head_label(h): v for h, v in self.share.items()},
            "mean_shared": self.mean_shared,
            "same_set": self.same_set,
            "k": self.k,
            "n_boot": self.n_boot,
            "seed": self.seed,
            "method": self.method,
        }

    def to_dataframe(self) -> Any:
        """One row per head that entered a resampled set: ``layer, head, share, published``."""
        import pandas as pd

        data = [[h[0], h[1], v, h in self.heads] for h, v in self.share.items()]
        return pd.DataFrame(data, columns=["layer", "head", "share", "published"])


def joint_stability(
    model: ModelLike,
    control: Any,
    report: GnaReport,
    *,
    k: int = 8,
    n_boot: int = 50,
    seed: int = 0,
    positions: Any = None,
    progress: bool = True,
) -> JointStability:
    """Redo the joint walk of :func:`~gna_lens.score_heads` on resampled selection data.

    Each resample draws the report's prompts and, independently, its control windows with
    replacement; ranks the heads as ``top(joint=False)`` does on those means; and walks the joint
    set again, each set's joint control change read on the resampled windows. A set's
    per-window changes are measured once (a control sweep of the set ablated) and reused by
    every resample that meets it, so the cost is the distinct sets the walks try, not
    ``n_boot`` walks.

    Args:
        model: The model the report was scored on.
        control: The control the report was scored with (the same windows).
        report: A :func:`~gna_lens.score_heads` report with a control, per-sample effects and a
            joint set of at least ``k`` heads.
        k: Heads per set.
        n_boot: Resamples.
        seed: Seed of the resampling.
        positions: The ablated positions the report was scored with (``None``: all).
        progress: Show a progress bar.

    Returns:
        A :class:`JointStability`.

    Raises:
        GnaLensError: For a report without per-sample effects of both kinds, or without a joint
            set.
    """
    import dataclasses

    from tqdm.auto import tqdm

    from gna_lens.device import to_host
    from gna_lens.heads import Subject
    from gna_lens.interventions import control_sweep
    from gna_lens.scoring.pipeline import _joint_walk

    effects, controls = _sample_effects(report, "joint_stability")
    if report.joint_set is None:
        raise GnaLensError("joint_stability needs a report with a joint set (joint_k > 0).")
    from gna_lens.interventions.ablation import positions_label

    mode = str(report.method.get("mode", "zero"))
    if report.method.get("positions", positions_label(positions)) != positions_label(positions):
        raise GnaLensError(
            f"joint_stability(positions={positions!r}): the report was scored at "
            f"{report.method['positions']!r} positions. Fix: pass the positions given to "
            "score_heads."
        )
    subject = Subject.of(model)
    published = tuple(report.top(k))
    n_p, n_w = effects.shape[1], controls.shape[1]
    cache: dict[tuple[Head, ...], Tensor] = {}

    def measure_on(windows: Tensor) -> Any:
        def measure(sets: list[list[Head]]) -> Tensor:
            todo = [s for s in sets if tuple(sorted(s)) not in cache]
            if todo:
                res = control_sweep(
                    subject, control, todo, mode=mode, positions=positions, progress=False
                )
                diffs = to_host(res.values.double() - res.baseline.double()[None])
                for s, d in zip(todo, diffs, strict=True):
                    cache[tuple(sorted(s))] = d
            return torch.stack([cache[tuple(sorted(s))][windows] for s in sets])

        return measure

    gen = torch.Generator(device=HOST).manual_seed(seed)
    counts: dict[Head, int] = {}
    shared = same = 0
    for _ in tqdm(range(n_boot), desc="joint stability", disable=not progress, leave=False):
        p_idx = torch.randint(0, n_p, (n_p,), generator=gen, device=HOST)
        w_idx = torch.randint(0, n_w, (n_w,), generator=gen, device=HOST)
        scores = dict(report.scores)
        scores["ablation_effect"] = effects[:, p_idx].nanmean(-1).to(scores["ablation_effect"])
        scores["control_effect"] = controls[:, w_idx].nanmean(-1).to(scores["control_effect"])
        redrawn = dataclasses.replace(report, scores=scores, joint_set=None)
        joint, _ = _joint_walk(
            subject, control, redrawn, controls[:, w_idx], k, mode=mode, positions=positions,
            progress=False, measure=measure_on(w_idx),
        )  # fmt: skip
        got = set(joint.heads[:k])
        for h in got:
            counts[h] = counts.get(h, 0) + 1
        shared += len(got & set(published))
        same += got == set(published)
    share = {h: c / n_boot for h, c in sorted(counts.items(), key=lambda x: (-x[1], x[0]))}
    return JointStability(
        heads=published,
        share=share,
        mean_shared=shared / n_boot,
        same_set=same / n_boot,
        k=k,
        n_boot=n_boot,
        seed=seed,
        method=f"{n_boot} resamples: the {n_p} selection prompts and, independently, the "
        f"{n_w} control windows drawn with replacement; per-head order and joint walk redone "
        f"on each (bound {report.max_control:g} {report.control_unit}); {len(cache)} distinct "
        "sets measured",
    )
