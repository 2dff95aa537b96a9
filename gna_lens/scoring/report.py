"""The data :func:`~gna_lens.scoring.score_heads` returns: :class:`GnaReport` (one table of G&A
evidence per head), its :class:`JointSet` and the small records of heads left out.

A head's retrieval effect alone does not make it a retrieval head: removing a head that every
prediction needs breaks retrieval too. :func:`~gna_lens.scoring.score_heads` therefore ablates
every head on the task *and* on a control that needs no in-context retrieval (by default,
next-token loss on prose shipped with gna_lens), and :meth:`GnaReport.top` ranks by retrieval
effect among the heads whose control effect stays at most ``max_control`` nats/token
(:data:`MAX_CONTROL`); the heads it leaves out are listed by :meth:`GnaReport.excluded`, each
with its reason.

``specificity`` puts both effects in one currency, the share of the model's performance the
ablation removes: ``r = clip(-ablation_effect / |baseline|, 0, 1)`` (the share of the task
metric's baseline lost) and ``c = clip(1 - exp(-control_effect), 0, 1)`` (the share of the
control's per-token probability lost: ``+0.1`` nats/token is 9.5%), and
``specificity = r / (r + c)``: 1 when only retrieval suffers, 0.5 when both lose the same share,
0 when only the control does, NaN when neither.

Specificity does not compose: heads that each pass the bound alone can break the control when
removed together (issue 30: on SmolLM2-135M each of a top 8 passed ``+0.1`` nats/token alone,
and removing the 8 together cost ``+1.08``). The pipeline therefore also builds a greedy *joint*
set (:class:`JointSet`): walking the per-head order, a head joins only if the control effect of
the set with it, ablated together, stays at most ``max_control``; :meth:`GnaReport.top` returns
that set's first ``k`` heads, whose removal together is bounded, and ``top(k, joint=False)`` the
per-head order.
"""

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.device import HOST, host_full
from gna_lens.errors import GnaLensError, GnaLensWarning
from gna_lens.heads import (
    GroupSpec,
    HeadList,
)
from gna_lens.interventions.layers import LayerSweepResult
from gna_lens.render.html import write_report_html
from gna_lens.render.markdown import heads_label
from gna_lens.scoring.patterns import NORMALIZATION, SCORE_NAMES, Head
from gna_lens.stats import Estimate
from gna_lens.table import Record, from_json

__all__ = [
    "COLUMNS",
    "JOINT_K",
    "MAX_CONTROL",
    "SCORE_COLUMNS",
    "ExcludedHead",
    "GnaReport",
    "JointSet",
    "RejectedHead",
    "UnmeasuredHeads",
    "specificity",
]


#: Default bound on a head's control effect (nats/token) for the retrieval-specific ranking:
#: ``+0.1`` nats/token multiplies the control's perplexity by 1.105.
MAX_CONTROL = 0.1


#: Heads of the greedy joint set :func:`score_heads` builds by default (see :class:`JointSet`).
JOINT_K = 16


#: Numeric columns of :meth:`GnaReport.to_dataframe`, after ``layer, head, kind, role``.
SCORE_COLUMNS = (
    *SCORE_NAMES,
    "ablation_effect",
    "ablation_effect_low",
    "ablation_effect_high",
    "control_effect",
    "control_effect_low",
    "control_effect_high",
    "specificity",
    "attribution",
)


COLUMNS = ("layer", "head", "kind", "role", *SCORE_COLUMNS)


_LOWER_FIRST = ("ablation_effect", "attribution", "entropy", "control_effect")


def specificity(effect: Tensor, baseline: float, control_effect: Tensor) -> Float[Tensor, " head"]:
    """``r / (r + c)`` from retrieval and control effects (see the module docs).

    Examples:
        >>> import torch
        >>> specificity(torch.tensor([-1.0, -1.0, 0.5]), 2.0, torch.tensor([0.0, 0.693, 0.0]))
        tensor([1.0000, 0.5000,    nan])
    """
    scale = abs(baseline) if baseline and not math.isnan(baseline) else 1.0
    r = (-effect.double() / scale).clamp(0.0, 1.0)
    c = (1.0 - torch.exp(-control_effect.double())).clamp(0.0, 1.0)
    total = r + c
    out = torch.where(total > 0, r / total.clamp(min=1e-300), torch.full_like(r, math.nan))
    return out.where(~(effect.isnan() | control_effect.isnan()), math.nan).float()


@dataclass(frozen=True)
class ExcludedHead:
    """A head the retrieval-specific ranking passed over, and why.

    Attributes:
        head: ``(layer, head)``.
        ablation_effect: Its retrieval effect.
        control_effect: Its control effect (nats/token).
        reason: Why it was left out.
        joint_control_effect: For a head the joint set turned down, the control effect of it
            and the joint set's heads before it, removed together (NaN otherwise).
    """

    head: Head
    ablation_effect: float
    control_effect: float
    reason: str
    joint_control_effect: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """The head and its reason as a flat dict."""
        return _head_keys(self.head) | {
            "ablation_effect": self.ablation_effect,
            "control_effect": self.control_effect,
            "joint_control_effect": _clean(self.joint_control_effect),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class UnmeasuredHeads:
    """Heads that were never ablated exactly, and why (their effects are NaN in the report).

    Attributes:
        layer: The layer they belong to.
        heads: ``(layer, head)`` of each.
        reason: Why they were not measured (e.g. the layer's rank in the coarse stage).
    """

    layer: int
    heads: tuple[Head, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """``{"layer", "n_heads", "head_indices", "reason"}``."""
        return {
            "layer": self.layer,
            "n_heads": len(self.heads),
            "head_indices": [h for _, h in self.heads],
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "UnmeasuredHeads":
        """The heads of :meth:`to_dict`."""
        layer = int(data["layer"])
        return cls(layer, tuple((layer, int(h)) for h in data["head_indices"]), str(data["reason"]))

    def describe(self) -> str:
        """``"L3 (24 heads): layer ranked 7 of 24 by ..."``."""
        n = len(self.heads)
        return f"L{self.layer} ({n} head{'s' if n != 1 else ''}): {self.reason}"


@dataclass(frozen=True)
class RejectedHead(Record):
    """A head the greedy joint set passed over: alone it stays within the bound, added to the
    heads accepted before it it does not.

    Attributes:
        head: ``(layer, head)``.
        joint_effect: Mean control effect of the accepted heads and this one, ablated together.
        after: How many heads were accepted when it was tried (it was added to
            ``JointSet.heads[:after]``).
    """

    head: Head
    joint_effect: float
    after: int

    def to_dict(self) -> dict[str, Any]:
        """``{"head": "L0H2", "layer", "head_index", "joint_effect", "after"}``."""
        return _head_keys(self.head) | {
            "joint_effect": _clean(self.joint_effect),
            "after": self.after,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RejectedHead":
        """The head of :meth:`to_dict`."""
        head = (int(data["layer"]), int(data["head_index"]))
        return cls(head, from_json(float, data["joint_effect"]), int(data["after"]))


@dataclass(frozen=True)
class JointSet(Record):
    """A set of heads whose control effect *together* stays within the bound, built greedily.

    :func:`score_heads` walks the per-head retrieval-specific order (``top(k, joint=False)``);
    a head joins when the control effect of the heads accepted so far plus it, ablated together
    with the sweep's mode and positions, has a mean at most :attr:`bound`; the set is measured
    again as it grows, and the walk stops at :attr:`joint_k` heads or when the candidates run
    out. A head turned down is never tried again.

    Attributes:
        heads: The accepted heads in the order they joined (the per-head order, minus those
            turned down).
        effects: Per accepted head, the joint control effect of ``heads[: i + 1]`` removed
            together, with a 95% paired bootstrap interval over the control's samples.
        rejected: The heads turned down, each with the joint effect that turned it down.
        bound: The bound (the report's ``max_control``).
        unit: ``"nats/token"`` (a text control) or ``"nats/answer"`` (a knowledge task).
        joint_k: Heads the walk was asked for.
        exhausted: Whether every candidate was tried (the walk ran out of candidates, so no
            larger ``joint_k`` would accept more).
        n_candidates: Heads the walk could try (those passing the bound alone).

    Examples:
        >>> from gna_lens.stats import Estimate
        >>> joint = JointSet(
        ...     heads=((0, 0), (1, 0)),
        ...     effects=(Estimate(0.01, 0.0, 0.02, 8, "bootstrap"),
        ...              Estimate(0.05, 0.03, 0.07, 8, "bootstrap")),
        ...     rejected=(RejectedHead((0, 1), 0.4, 1),), bound=0.1, joint_k=2, n_candidates=3)
        >>> joint.effect(2).value, len(joint)
        (0.05, 2)
        >>> joint.describe()
        'joint control effect of L0H0, L1H0 removed together: +0.050 [+0.030, +0.070] nats/token (bound 0.1); turned down: L0H1 (+0.400 with the 1 before it)'
        >>> JointSet.from_dict(joint.to_dict()) == joint
        True
    """

    heads: tuple[Head, ...]
    effects: tuple[Estimate, ...]
    rejected: tuple[RejectedHead, ...]
    bound: float
    unit: str = "nats/token"
    joint_k: int = JOINT_K
    exhausted: bool = False
    n_candidates: int = 0

    def __len__(self) -> int:
        return len(self.heads)

    def effect(self, k: int | None = None) -> Estimate:
        """The joint control effect of the first ``k`` heads (default: all) removed together.

        Raises:
            GnaLensError: For ``k`` outside ``1..len(self)``.
        """
        k = len(self.heads) if k is None else k
        if not 1 <= k <= len(self.heads):
            raise GnaLensError(
                f"JointSet.effect(k={k}); expected 1 <= k <= {len(self.heads)} (the heads in the "
                "joint set)."
            )
        return self.effects[k - 1]

    def describe(self, k: int | None = None) -> str:
        """The joint control effect of the first ``k`` heads, and the heads turned down before
        the ``k``-th, in one line."""
        if not self.heads:
            return f"joint set empty: no head passes the bound {self.bound:g} {self.unit}"
        k = len(self.heads) if k is None else min(k, len(self.heads))
        names = heads_label(self.heads[:k], ", ")
        line = (
            f"joint control effect of {names} removed together: "
            f"{self.effect(k).format(signed=True)} {self.unit} (bound {self.bound:g})"
        )
        gone = [r for r in self.rejected if r.after < k]
        if gone:
            line += "; turned down: " + ", ".join(
                f"L{r.head[0]}H{r.head[1]} ({r.joint_effect:+.3f} with the {r.after} before it)"
                for r in gone
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (NaN as ``None``); :meth:`from_dict` reads it back."""
        return super().to_dict() | {"bound": self.bound}  # an infinite bound stays one

    def to_dataframe(self) -> Any:
        """One row per head tried: ``step, layer, head, status`` (``"accepted"`` /
        ``"rejected"``), ``after`` (heads accepted before it was tried), ``joint_effect``,
        ``joint_effect_low``, ``joint_effect_high`` (the interval of accepted heads only), in the
        order they were tried."""
        import pandas as pd

        nan = math.nan
        rows = [(*h, "accepted", i, iv.value, iv.low, iv.high) for i, (h, iv) in enumerate(
            zip(self.heads, self.effects, strict=True))]  # fmt: skip
        rows += [(*r.head, "rejected", r.after, r.joint_effect, nan, nan) for r in self.rejected]
        rows.sort(key=lambda r: (r[3], r[2] == "accepted"))  # tried in this order
        df = pd.DataFrame(
            rows,
            columns=["layer", "head", "status", "after", "joint_effect", "joint_effect_low",
                     "joint_effect_high"],
        )  # fmt: skip
        df.insert(0, "step", range(1, len(df) + 1))
        return df


@dataclass(frozen=True)
class GnaReport:
    """Pattern scores, retrieval and control effects of every head on one task.

    Attributes:
        model_name: The model's name (or class).
        task: The task's description.
        heads: ``(layer, head)`` of each row.
        kinds: ``"attention"`` or ``"ssm"`` per row.
        scores: ``{name: [head]}`` for every column of :data:`SCORE_COLUMNS`:
            the pattern scores and their nulls (:mod:`gna_lens.scoring.patterns`);
            ``ablation_effect`` (mean change of the metric over the prompts when the head alone
            is ablated; NaN when not measured) with its 95% bootstrap interval
            (``ablation_effect_low``/``_high``); ``control_effect`` (change of the control's
            next-token loss, nats/token; NaN when not measured) with its interval;
            ``specificity`` (module docs); ``attribution`` (gradient estimate of the ablation
            effect; NaN when not computed).
        metric: The metric of the ablation effects (e.g. ``"logit_diff"``).
        baseline: The metric without ablation (mean over prompts), or NaN.
        n_layers: Layers of the model.
        layer_heads: Heads per layer (0 for a layer without addressable heads).
        normalization: How pattern rows were normalized, per head kind.
        examples: For display, the patterns of the top heads on one sample:
            ``{"tokens": [...], "patterns": {"L3H2": [[...]]}}``.
        roles: Pattern role per row (``"gather"``, ``"aggregate"``, ``"gather+aggregate"``,
            ``""``).
        control: Description of the control, ``""`` when none was measured.
        control_baseline: The control's loss without ablation (nats/token), or NaN.
        max_control: The bound of the retrieval-specific ranking (nats/token).
        method: How the numbers were made: which weights (``weights``, one line, and
            ``provenance``, every field of :func:`~gna_lens.models.provenance_of`), metric,
            ablation mode, positions, reference, number of prompts, control, sweep dtype,
            strategy, heads ablated exactly, paths used.
        layers: The coarse stage of ``strategy="coarse_to_fine"``: every layer removed alone
            on the task and the control (:func:`~gna_lens.interventions.layer_sweep`), or
            ``None``.
        unmeasured: The heads never ablated exactly, per layer, with the reason (layers below
            the top ``top_layers`` of the coarse stage, or heads below the attribution
            prefilter's cut).
        timings: Seconds per step of :func:`score_heads`: ``pattern_scores``, ``attribution``,
            ``layer_sweep`` (the coarse stage), ``ablation_sweep``, ``control_sweep`` and
            ``examples``, those that ran (not in :meth:`to_dict`: the report's numbers do not
            depend on them); ``joint_control`` (the greedy joint set).
        head_groups: The Mamba-1 channel groups the heads address (``()``: the model's heads).
        joint_set: The greedy set of heads whose control effect *together* stays within
            :attr:`max_control` (:class:`JointSet`; the default :meth:`top` returns its first
            ``k``), or ``None`` (no control measured, or ``joint_k=0``).
        sample_effects: Per-sample effects of each head ablated alone, NaN where not measured:
            ``{"ablation_effect": [head, prompt], "control_effect": [head, control sample]}``
            (what :func:`~gna_lens.scoring.rank_stability` resamples; ``{}`` without ablation).
            Not compared by ``==``.
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
    roles: tuple[str, ...] = ()
    control: str = ""
    control_baseline: float = math.nan
    max_control: float = MAX_CONTROL
    method: dict[str, Any] = field(default_factory=dict)
    layers: LayerSweepResult | None = None
    unmeasured: tuple[UnmeasuredHeads, ...] = ()
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    head_groups: GroupSpec = ()
    joint_set: JointSet | None = None
    sample_effects: dict[str, Float[Tensor, "head sample"]] = field(
        default_factory=dict, compare=False
    )

    def head_groups_spec(self) -> dict[int, list[list[int]]] | None:
        """The Mamba-1 channel groups the report's heads address, as
        :meth:`~gna_lens.models.HookedSSM.head_groups` takes them (``None``: heads are the
        model's own heads, or single channels).

        Examples:
            >>> report = GnaReport("m", "t", heads=((0, 0), (0, 1)), kinds=("ssm", "ssm"),
            ...                    scores={}, metric="none", baseline=math.nan, n_layers=1,
            ...                    layer_heads=(2,), head_groups=((0, ((0, 1), (2, 3))),))
            >>> report.head_groups_spec()
            {0: [[0, 1], [2, 3]]}
        """
        if not self.head_groups:
            return None
        return {layer: [list(c) for c in sets] for layer, sets in self.head_groups}

    @property
    def n_unmeasured(self) -> int:
        """Heads never ablated exactly (see :attr:`unmeasured`)."""
        return sum(len(u.heads) for u in self.unmeasured)

    def __repr__(self) -> str:
        n_ablated = int((~self.scores["ablation_effect"].isnan()).sum())
        control = f"control {self.control!r}" if self.has_control else "no control"
        return (
            f"GnaReport({self.model_name!r}, {len(self.heads)} heads, {n_ablated} ablated, "
            f"metric {self.metric}, {control}; .summary() for the top heads)"
        )

    def summary(self, k: int = 5) -> str:
        """What was measured and the top ``k`` heads with their 95% intervals, as text.

        Examples:
            See :meth:`top`.
        """
        heads: list[Head] = []
        lines = [repr(self), f"Weights: {self.method.get('weights', 'not recorded')}"]
        lines.append(f"Task: {self.task} on {self.method.get('n_prompts', '?')} prompts")
        if self.has_control:
            lines.append(f"Ranking: {self.criterion}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GnaLensWarning)
                heads = self.top(k)
        elif not bool(self.scores["ablation_effect"].isnan().all()):
            lines.append("Ranking: raw ablation effect (no control: not retrieval-specific)")
            heads = self.top(k, by="ablation_effect")
        if heads:
            df = self.to_dataframe().set_index(["layer", "head"]).loc[list(heads)].reset_index()
            cols = ["layer", "head", "kind", "role", "ablation_effect", "ablation_effect_low"]
            cols += ["ablation_effect_high", "control_effect"]
            table = df[cols].dropna(axis=1, how="all")
            lines.append(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
        if len(heads) < k:
            lines.append(f"({len(heads)} of the {k} asked for qualify; see excluded({k}))")
        if self.n_unmeasured:
            lines.append(f"{self.n_unmeasured} heads never measured (report.unmeasured)")
        return "\n".join(lines)

    def layer_ranking(self) -> Any:
        """The coarse stage's layers in rank order: a dataframe with ``rank``, ``scanned``
        (whether its heads were ablated) and the columns of
        :meth:`~gna_lens.interventions.LayerSweepResult.to_dataframe`; ``None`` without one."""
        if self.layers is None:
            return None
        df = self.layers.to_dataframe()
        order = [self.layers.cells.index(c) for c in self.layers.ranking()]
        df = df.iloc[order].reset_index(drop=True)
        skipped = {u.layer for u in self.unmeasured}
        df.insert(0, "rank", range(1, len(df) + 1))
        df.insert(2, "scanned", [layer not in skipped for layer in df["layer"]])
        return df

    def to_dataframe(self) -> Any:
        """One row per head: ``layer, head, kind, role`` and every column of
        :data:`SCORE_COLUMNS`."""
        import pandas as pd

        data: dict[str, Any] = {
            "layer": [h[0] for h in self.heads],
            "head": [h[1] for h in self.heads],
            "kind": list(self.kinds),
            "role": list(self.roles) if self.roles else [""] * len(self.heads),
        }
        for name in SCORE_COLUMNS:
            data[name] = self.scores[name].tolist()
        return pd.DataFrame(data, columns=list(COLUMNS))

    @property
    def has_control(self) -> bool:
        """Whether control effects were measured."""
        return not bool(torch.isnan(self.scores["control_effect"]).all())

    @property
    def criterion(self) -> str:
        """The rule of the default ranking, in words."""
        line = (
            f"heads ranked by {self.metric} ablation effect (most harmful first) among those whose "
            f"control effect is at most {self.max_control:g} {self.control_unit} "
            f"({self.control or 'none'})"
        )
        joint = self._joint()
        if joint is not None:
            line += (
                "; a head joins only if the control effect of it and the heads before it, "
                f"removed together, also stays at most {self.max_control:g} (greedy joint set "
                f"of {len(joint)} heads, joint_k={joint.joint_k})"
            )
        return line

    @property
    def control_unit(self) -> str:
        """``"nats/token"`` (a text control) or ``"nats/answer"`` (a knowledge task's answer
        among its options)."""
        return str(self.method.get("control_unit", "nats/token"))

    def _eligible(self) -> Tensor:
        effect, ctrl = self.scores["ablation_effect"], self.scores["control_effect"]
        return ~effect.isnan() & ~ctrl.isnan() & (ctrl <= self.max_control)

    def _joint(self) -> JointSet | None:
        """The joint set, where it was built for this report's bound (a report copied with
        another ``max_control`` ranks by the per-head rule of its new bound)."""
        js = self.joint_set
        return js if js is not None and js.bound == self.max_control else None

    def top(self, k: int = 10, by: str | None = None, *, joint: bool | None = None) -> list[Head]:
        """The ``k`` strongest heads.

        Args:
            k: How many heads.
            by: ``None`` (default): the retrieval-specific ranking (:attr:`criterion`). With a
                joint set (:attr:`joint_set`, built by :func:`score_heads` by default), its first
                ``k`` heads: a set whose control effect *removed together* stays at most
                :attr:`max_control`. Without one (or ``joint=False``), by ablation effect (most
                harmful first) among the heads whose control effect *alone* is at most
                :attr:`max_control`. Heads left out are in :meth:`excluded`. A column name: the
                raw order of that column (``ablation_effect``, ``attribution``,
                ``control_effect`` and ``entropy`` lowest first, other scores highest first).
            joint: ``None`` (default): the joint set where the report has one (built for its
                :attr:`max_control`), else the per-head order; ``False``: the per-head order
                (a full ranking, not a set to remove together); ``True``: the joint set, or an
                error.

        Returns:
            ``[(layer, head), ...]``, a :class:`~gna_lens.heads.HeadList` that remembers the
            Mamba-1 channel groups the report was scored under (functions given these heads
            refuse a model whose groups differ). Fewer than ``k`` when fewer heads qualify, with
            a :class:`GnaLensWarning` that says why (none when ``k`` covers every head: "all
            that qualify").

        Raises:
            GnaLensError: For an unknown column, one that was not measured, the default ranking
                on a report without control effects, ``k`` above the joint set's ``joint_k``
                while candidates were left untried, or ``joint=True`` without a joint set or
                with ``by``.

        Examples:
            >>> from gna_lens.scoring import score_heads
            >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
            >>> model = toy_gna_model(generic_head=True)
            >>> report = score_heads(model, toy_gna_task(model, n_samples=8),
            ...                      control=toy_control(model), progress=False)
            >>> sorted(report.top(2)), report.top(1, by="ablation_effect")
            ([(0, 0), (1, 0)], [(0, 2)])
            >>> report.excluded(2)[0].head
            (0, 2)
            >>> report.joint_set.effect(2).value  # the two removed together: the control keeps
            0.0
            >>> report.top(2, joint=False) == report.top(2)  # nothing turned down here
            True
            >>> report.joint_table(report.top(2))[["layer", "head", "joint_control_effect"]]
               layer  head  joint_control_effect
            0      0     0                   0.0
            1      1     0                   0.0
            >>> print(report.summary(2).splitlines()[2])
            Task: kv_retrieval(template=toy, n_pairs=4, values=words) (n=8, scoring=choices) on 8 prompts
            >>> again = GnaReport.from_json(report.to_json())  # JSON both ways
            >>> again.top(2) == report.top(2), again.joint_set == report.joint_set
            (True, True)
        """
        if by is not None:
            if joint:
                raise GnaLensError(
                    f"GnaReport.top(k={k}, by={by!r}, joint=True): the joint set belongs to the "
                    "default ranking; a column's raw order has none. Fix: top(k) (joint set) or "
                    f"top(k, by={by!r})."
                )
            if by not in self.scores:
                raise GnaLensError(
                    f"GnaReport.top(by={by!r}); expected None (retrieval-specific) or one of "
                    f"{sorted(self.scores)}."
                )
            if bool(torch.isnan(self.scores[by]).all()):
                raise GnaLensError(
                    f"GnaReport.top(by={by!r}): this report has no {by} (it was not computed). "
                    "Run score_heads(..., ablation=True) for ablation effects."
                )
            sign = 1.0 if by in _LOWER_FIRST else -1.0  # NaN last either way
            return self._first((sign * self.scores[by].double()).nan_to_num(nan=math.inf), k)
        if not self.has_control:
            raise GnaLensError(
                "GnaReport.top(): the default ranking is retrieval-specific and needs control "
                "effects, which this report has not measured (control=None, or no exact "
                "ablation). Fix: score_heads(..., control='prose') (or a knowledge task), or "
                "top(k, by='ablation_effect') for the raw order."
            )
        js = self._joint() if joint is None or joint else None
        if joint and js is None:
            why = (
                "it has none (score_heads(..., joint_k=0))"
                if self.joint_set is None
                else f"its joint set was built for max_control {self.joint_set.bound:g}, not "
                f"{self.max_control:g}"
            )
            raise GnaLensError(
                f"GnaReport.top(k={k}, joint=True): {why}. Fix: score_heads(..., "
                f"max_control={self.max_control:g}, joint_k={max(k, JOINT_K)}), or top({k}, "
                "joint=False) for the per-head order."
            )
        if js is not None:
            if k > js.joint_k and not js.exhausted:
                raise GnaLensError(
                    f"GnaReport.top(k={k}): the joint set was built for joint_k={js.joint_k} "
                    f"heads (it holds {len(js)}; candidates were left untried), so its first "
                    f"{k} are unknown. Fix: score_heads(..., joint_k={k}) for a joint set of "
                    f"{k} heads, or top({k}, joint=False) for the per-head order (bounded one "
                    "head at a time, not together)."
                )
            if len(js) < k < len(self.heads):  # (k >= every head: "all that qualify")
                why = (
                    f"the model has {len(self.heads)} heads"
                    if len(js) == len(self.heads)
                    else f"the joint set holds {len(js)}: each other candidate, removed with "
                    f"them, pushes the control effect above max_control {self.max_control:g} "
                    f"or was never measured (see excluded({k}) and unmeasured)"
                )
                _short(k, len(js), why)
            return HeadList(list(js.heads[: max(k, 0)]), self.head_groups)
        ok = self._eligible()
        n_ok = int(ok.sum())
        left = int(
            (self.scores["control_effect"].isnan() & ~self.scores["ablation_effect"].isnan()).sum()
        )
        if n_ok < k and left and str(self.method.get("control_scope", "")).startswith("needed"):
            raise GnaLensError(
                f"GnaReport.top(k={k}, joint=False): control effects were measured only as far as "
                f"the joint walk needed (control_scope='needed'): {n_ok} heads qualify among them "
                f"and {left} ablated heads have none, so the per-head order past {n_ok} is "
                "unknown. Fix: score_heads(..., control_scope='all') (`gna-lens scan "
                f"--control-all`), or top(k) with k <= {n_ok}."
            )
        if n_ok < k < len(self.heads):
            _short(
                k, n_ok, f"{n_ok} heads were measured and have a control effect of at most "
                f"max_control {self.max_control:g} (see excluded({k}) and unmeasured)",
            )  # fmt: skip
        key = self.scores["ablation_effect"].double().masked_fill(~ok, math.inf)
        return self._first(key, min(k, n_ok))

    def _first(self, key: Tensor, n: int) -> HeadList:
        """The heads of the ``n`` lowest ``key`` (ties in head order)."""
        order = torch.argsort(key, stable=True).tolist()
        return HeadList([self.heads[i] for i in order[:n]], self.head_groups)

    def excluded(self, k: int = 10, *, joint: bool | None = None) -> list[ExcludedHead]:
        """The heads the default :meth:`top` ``(k)`` passes over for being generic.

        Those whose retrieval effect would have placed them in the top ``k`` by the raw
        ``ablation_effect`` order (before the ``k``-th retrieval-specific head), most harmful
        first, each with the reason.

        With a joint set, the heads it turned down are listed too, with the joint control
        effect that turned them down.

        Args:
            k: The ``k`` of :meth:`top`.
            joint: As in :meth:`top`.

        Raises:
            GnaLensError: On a report without control effects, or as :meth:`top`.
        """
        with warnings.catch_warnings():  # top(k) short of k: these are why
            warnings.simplefilter("ignore", GnaLensWarning)
            chosen = self.top(k, joint=joint)
        effect, ctrl = self.scores["ablation_effect"], self.scores["control_effect"]
        idx = {h: i for i, h in enumerate(self.heads)}
        cutoff = float(effect[idx[chosen[-1]]]) if chosen and len(chosen) == k else math.inf
        js = self._joint() if joint is None or joint else None
        turned_down = {r.head: r for r in js.rejected} if js is not None else {}
        out = []
        for i in torch.argsort(effect.nan_to_num(nan=math.inf), stable=True).tolist():
            e, c = float(effect[i]), float(ctrl[i])
            if math.isnan(e) or e > cutoff:
                break
            if self.heads[i] in chosen:
                continue
            r = turned_down.get(self.heads[i])
            if r is None and c <= self.max_control:  # tied with the k-th head: not left out
                continue
            if r is not None:
                reason = (
                    f"joint control effect {r.joint_effect:+.3f} {self.control_unit} with the "
                    f"{r.after} joint-set head{'s' if r.after != 1 else ''} before it > "
                    f"max_control {self.max_control:g} (alone {c:+.3f})"
                )
            elif math.isnan(c):
                reason = "control effect not measured"
            else:
                reason = f"control effect {c:+.3f} {self.control_unit} > max_control "
                reason += f"{self.max_control:g}"
            joint_effect = math.nan if r is None else r.joint_effect
            out.append(ExcludedHead(self.heads[i], e, c, reason, joint_effect))
        return out

    def joint_table(self, heads: list[Head] | None = None) -> Any:
        """:meth:`to_dataframe`'s rows of ``heads`` (default: the joint set's), in that order,
        with ``joint_control_effect``, ``joint_control_low`` and ``joint_control_high`` after
        ``control_effect``: for a head of the joint set, the control effect of it and the joint
        set's heads before it, removed together, with its 95% interval (NaN for other heads,
        and without a joint set).

        Examples:
            See :meth:`top`.
        """
        joint = self._joint()
        effects = dict(zip(joint.heads, joint.effects, strict=True)) if joint is not None else {}
        heads = list(effects) if heads is None else heads
        df = self.to_dataframe().set_index(["layer", "head"]).loc[list(heads)].reset_index()
        at = list(df.columns).index("control_effect_high") + 1
        ivs = [effects.get(tuple(h)) for h in heads]  # type: ignore[arg-type]
        for j, attr in enumerate(("value", "low", "high")):
            column = [math.nan if iv is None else float(getattr(iv, attr)) for iv in ivs]
            df.insert(at + j, _JOINT_COLUMNS[j], column)
        return df

    def heatmap(self, by: str = "ablation_effect") -> Float[Tensor, "layer head_index"]:
        """A ``[n_layers, max_heads]`` grid of a score (NaN where a layer has fewer heads)."""
        if by not in self.scores:
            raise GnaLensError(
                f"GnaReport.heatmap(by={by!r}); expected one of {sorted(self.scores)}."
            )
        grid = host_full((self.n_layers, max(self.layer_heads, default=0)))
        for (layer, h), v in zip(self.heads, self.scores[by].tolist(), strict=True):
            grid[layer, h] = v
        return grid

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (scores as lists, NaN as ``None``)."""
        roles = self.roles or ("",) * len(self.heads)
        out = {
            "model_name": self.model_name,
            "task": self.task,
            "metric": self.metric,
            "baseline": _clean(self.baseline),
            "control": self.control,
            "control_baseline": _clean(self.control_baseline),
            "max_control": self.max_control,
            "criterion": self.criterion,
            "method": self.method,
            "n_layers": self.n_layers,
            "layer_heads": list(self.layer_heads),
            "normalization": self.normalization,
            "heads": [
                {"layer": layer, "head": h, "kind": kind, "role": role}
                | {name: _clean(float(self.scores[name][i])) for name in SCORE_COLUMNS}
                for i, ((layer, h), kind, role) in enumerate(
                    zip(self.heads, self.kinds, roles, strict=True)
                )
            ],
            "unmeasured": [u.to_dict() for u in self.unmeasured],
        }
        if self.head_groups:
            out["head_groups"] = {str(k): v for k, v in (self.head_groups_spec() or {}).items()}
        if self.layers is not None:
            ranking = self.layer_ranking()
            out["layer_ranking"] = [
                {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                for r in ranking.drop(columns=["task"]).to_dict(orient="records")
            ]
            out["layer_ranking_method"] = self.layers.method
        if self.joint_set is not None:
            out["joint_set"] = self.joint_set.to_dict()
        if self.sample_effects:
            blocks: dict[str, Any] = {}
            out["sample_effects"] = blocks
            for name, grid in self.sample_effects.items():
                rows = [i for i in range(grid.shape[0]) if not bool(grid[i].isnan().all())]
                blocks[name] = {
                    "n_samples": int(grid.shape[1]),
                    "heads": [list(self.heads[i]) for i in rows],
                    "values": [[_clean(v) for v in grid[i].tolist()] for i in rows],
                }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GnaReport":
        """The report written by :meth:`to_dict` (or a ``gna-lens scan`` ``report.json``).

        Everything :meth:`to_dict` writes comes back, except the coarse stage's
        :attr:`layers` (its ranking stays in ``data["layer_ranking"]``), :attr:`examples`
        and :attr:`timings`, which it does not write.

        Raises:
            GnaLensError: For a dict without the report's per-head rows.

        Examples:
            See :meth:`top`.
        """
        if not isinstance(data, dict) or "heads" not in data or "n_layers" not in data:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise GnaLensError(
                f"GnaReport.from_dict: got {keys}; expected the dict of GnaReport.to_dict() "
                "(with 'heads' and 'n_layers'), e.g. a report.json of `gna-lens scan`."
            )

        rows = data["heads"]
        heads = tuple((int(r["layer"]), int(r["head"])) for r in rows)

        def floats(values: Any) -> Tensor:
            return torch.tensor(
                [from_json(float, v) for v in values], dtype=torch.float32, device=HOST
            )

        scores = {name: floats(r.get(name) for r in rows) for name in SCORE_COLUMNS}
        groups = data.get("head_groups") or {}
        index = {h: i for i, h in enumerate(heads)}
        samples: dict[str, Tensor] = {}
        for name, block in (data.get("sample_effects") or {}).items():
            grid = samples[name] = host_full((len(heads), int(block["n_samples"])))
            for (layer, h), values in zip(block["heads"], block["values"], strict=True):
                grid[index[(int(layer), int(h))]] = floats(values)
        return cls(
            model_name=str(data.get("model_name", "")),
            task=str(data.get("task", "")),
            heads=heads,
            kinds=tuple(str(r.get("kind", "attention")) for r in rows),
            scores=scores,
            metric=str(data.get("metric", "none")),
            baseline=from_json(float, data.get("baseline")),
            n_layers=int(data["n_layers"]),
            layer_heads=tuple(int(n) for n in data.get("layer_heads", ())),
            normalization=dict(data.get("normalization") or NORMALIZATION),
            roles=tuple(str(r.get("role", "")) for r in rows),
            control=str(data.get("control", "")),
            control_baseline=from_json(float, data.get("control_baseline")),
            max_control=from_json(float, data.get("max_control", MAX_CONTROL)),
            method=dict(data.get("method") or {}),
            unmeasured=tuple(UnmeasuredHeads.from_dict(u) for u in data.get("unmeasured", ())),
            head_groups=tuple(
                (int(layer), tuple(tuple(int(c) for c in chans) for chans in sets))
                for layer, sets in sorted(groups.items(), key=lambda kv: int(kv[0]))
            ),
            joint_set=JointSet.from_dict(data["joint_set"]) if data.get("joint_set") else None,
            sample_effects=samples,
        )

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON; also written to ``path`` when given (:meth:`from_json` reads
        it back)."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> "GnaReport":
        """The report of :meth:`to_json`: JSON text, or the path of a file holding it (see
        :meth:`from_dict`).

        Raises:
            GnaLensError: For a file that cannot be read, or text that is not JSON.
        """
        text = str(source)
        if isinstance(source, Path) or not text.lstrip().startswith("{"):
            try:
                text = Path(source).read_text(encoding="utf-8")
            except OSError as err:
                raise GnaLensError(
                    f"GnaReport.from_json({str(source)[:80]!r}): cannot read it "
                    f"({err.__class__.__name__}: {err}); expected JSON text or the path of a "
                    "report.json."
                ) from err
        try:
            data = json.loads(text)
        except ValueError as err:
            raise GnaLensError(
                f"GnaReport.from_json: not JSON ({err}); expected the text of "
                "GnaReport.to_json() or a report.json path."
            ) from err
        return cls.from_dict(data)

    def to_html(
        self, path: str | Path, *, k: int = 6, extra_html: str = "", interactive: bool = False
    ) -> Path:
        """Write a self-contained offline HTML report: method, top heads, heads left out,
        heatmaps and the top heads' patterns.

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
        return write_report_html(self, path, k=k, extra_html=extra_html, interactive=interactive)


#: Columns :meth:`GnaReport.joint_table` adds.
_JOINT_COLUMNS = ("joint_control_effect", "joint_control_low", "joint_control_high")


def _clean(v: float) -> float | None:
    return None if math.isnan(v) else v


def _head_keys(head: Head) -> dict[str, Any]:
    return {"head": f"L{head[0]}H{head[1]}", "layer": head[0], "head_index": head[1]}


def _short(k: int, got: int, why: str) -> None:
    """Warn that :meth:`GnaReport.top` returns fewer heads than asked for, and why."""
    warnings.warn(f"GnaReport.top({k}) returns {got} heads: {why}.", GnaLensWarning, stacklevel=3)
