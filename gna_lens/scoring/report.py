"""``score_heads``: one table of G&A evidence per head, and the :class:`GnaReport` it returns.

A head's retrieval effect alone does not make it a retrieval head: removing a head that every
prediction needs breaks retrieval too. :func:`score_heads` therefore ablates every head on the
task *and* on a control that needs no in-context retrieval (by default, next-token loss on prose
shipped with gna_lens), and :meth:`GnaReport.top` ranks by retrieval effect among the heads whose
control effect stays at most ``max_control`` nats/token (:data:`MAX_CONTROL`); the heads it leaves
out are listed by :meth:`GnaReport.excluded`, each with its reason.

``specificity`` puts both effects in one currency, the share of the model's performance the
ablation removes: ``r = clip(-ablation_effect / |baseline|, 0, 1)`` (the share of the task
metric's baseline lost) and ``c = clip(1 - exp(-control_effect), 0, 1)`` (the share of the
control's per-token probability lost: ``+0.1`` nats/token is 9.5%), and
``specificity = r / (r + c)``: 1 when only retrieval suffers, 0.5 when both lose the same share,
0 when only the control does, NaN when neither.

Specificity does not compose: heads that each pass the bound alone can break the control when
removed together (issue 30: on SmolLM2-135M each of a top 8 passed ``+0.1`` nats/token alone,
and removing the 8 together cost ``+1.08``). :func:`score_heads` therefore also builds a greedy
*joint* set (:class:`JointSet`): walking the per-head order, a head joins only if the control
effect of the set with it, ablated together, stays at most ``max_control``;
:meth:`GnaReport.top` returns that set's first ``k`` heads, whose removal together is bounded,
and ``top(k, joint=False)`` the per-head order.
"""

import contextlib
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.device import HOST, DevicePolicy, host_full, to_host
from gna_lens.errors import GnaLensError, GnaLensWarning, InterventionError
from gna_lens.heads import (
    GroupSpec,
    HeadList,
    ModelLike,
    Subject,
    describe_head_groups,
    head_view,
    model_of,
    policy_of,
)
from gna_lens.interventions import ablation_sweep, attribute_heads, control_sweep
from gna_lens.interventions.ablation import SweepResult, positions_label
from gna_lens.interventions.batching import describe_task
from gna_lens.interventions.layers import LayerSweepResult, layer_sweep
from gna_lens.interventions.sources import check_positions, rotated
from gna_lens.models.kernels import path_summary
from gna_lens.models.provenance import provenance_method, provenance_of
from gna_lens.render.html import write_report_html
from gna_lens.render.markdown import heads_label
from gna_lens.runtime import choose_precision, native_bfloat16
from gna_lens.scoring.patterns import NORMALIZATION, SCORE_NAMES, Head, pattern_scores
from gna_lens.stats import Interval, bootstrap_interval
from gna_lens.tasks import Task, TextControl
from gna_lens.tasks.control import resolve_control

__all__ = [
    "DEFAULT_CHANNEL_GROUP",
    "EXACT_ALL_MAX",
    "EXACT_BUDGET_S",
    "JOINT_BATCH",
    "JOINT_K",
    "MAX_CONTROL",
    "STRATEGIES",
    "ExcludedHead",
    "GnaReport",
    "JointSet",
    "RejectedHead",
    "UnmeasuredHeads",
    "applied_head_groups",
    "auto_head_groups",
    "check_bfloat16",
    "choose_strategy",
    "default_top_layers",
    "native_bfloat16",
    "resolve_control",
    "resolve_sweep_dtype",
    "score_heads",
]

#: Default bound on a head's control effect (nats/token) for the retrieval-specific ranking:
#: ``+0.1`` nats/token multiplies the control's perplexity by 1.105.
MAX_CONTROL = 0.1

#: Heads of the greedy joint set :func:`score_heads` builds by default (see :class:`JointSet`).
JOINT_K = 16

#: Next candidates of the greedy joint set measured in one control sweep after a candidate was
#: turned down (turned-down heads come in runs): the first that keeps the set within the bound
#: joins. Otherwise a round measures one candidate: on a CPU a sweep costs about its rows, and
#: most candidates join.
JOINT_BATCH = 4

#: Models with at most this many heads get every head ablated exactly (``strategy="auto"``).
EXACT_ALL_MAX = 300

#: How :func:`score_heads` chooses the heads it ablates exactly:
#: ``"auto"`` (``"exact"`` up to :data:`EXACT_ALL_MAX` heads, else ``"coarse_to_fine"``),
#: ``"exact"`` (every head), ``"coarse_to_fine"`` (layers ranked by removal first, then every head
#: of the top layers), ``"attribution"`` (attribution patching ranks every head, the top
#: ``prefilter`` are ablated).
STRATEGIES = ("auto", "exact", "coarse_to_fine", "attribution")

#: On a CUDA device, ``strategy="auto"`` ablates every head exactly, even above
#: :data:`EXACT_ALL_MAX` heads, when :func:`choose_strategy` estimates that the task's and the
#: control's sweeps take at most this many seconds (a GPU sweeps a mamba2-1.3b's 3,072 heads in
#: about that; the estimate's basis is recorded in ``method["strategy_choice"]``).
EXACT_BUDGET_S = 120.0

#: Layers whose heads a coarse-to-fine scan ablates, at most (see :func:`default_top_layers`).
DEFAULT_TOP_LAYERS = 4

#: Channels per head of the contiguous groups that ``head_groups="auto"`` makes on a Mamba-1 /
#: FalconMamba model above :data:`EXACT_ALL_MAX` single-channel heads: 64, the head width of
#: Mamba-2 (mamba-130m's 1,536 channels per layer make 24 groups, as many as mamba2-130m's heads;
#: Falcon-Mamba-7B's 8,192 make 128).
DEFAULT_CHANNEL_GROUP = 64

#: Heads ablated exactly after attribution patching when ``strategy="attribution"`` is given no
#: ``prefilter``.
DEFAULT_PREFILTER = 32

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
        return {
            "head": f"L{self.head[0]}H{self.head[1]}",
            "layer": self.head[0],
            "head_index": self.head[1],
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

    def describe(self) -> str:
        """``"L3 (24 heads): layer ranked 7 of 24 by ..."``."""
        n = len(self.heads)
        return f"L{self.layer} ({n} head{'s' if n != 1 else ''}): {self.reason}"


@dataclass(frozen=True)
class RejectedHead:
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
        return {
            "head": f"L{self.head[0]}H{self.head[1]}",
            "layer": self.head[0],
            "head_index": self.head[1],
            "joint_effect": _clean(self.joint_effect),
            "after": self.after,
        }


@dataclass(frozen=True)
class JointSet:
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
        >>> from gna_lens.stats import Interval
        >>> joint = JointSet(
        ...     heads=((0, 0), (1, 0)),
        ...     effects=(Interval(0.01, 0.0, 0.02, 8, "bootstrap"),
        ...              Interval(0.05, 0.03, 0.07, 8, "bootstrap")),
        ...     rejected=(RejectedHead((0, 1), 0.4, 1),), bound=0.1, joint_k=2, n_candidates=3)
        >>> joint.effect(2).value, len(joint)
        (0.05, 2)
        >>> joint.describe()
        'joint control effect of L0H0, L1H0 removed together: +0.050 [+0.030, +0.070] nats/token (bound 0.1); turned down: L0H1 (+0.400 with the 1 before it)'
        >>> JointSet.from_dict(joint.to_dict()) == joint
        True
    """

    heads: tuple[Head, ...]
    effects: tuple[Interval, ...]
    rejected: tuple[RejectedHead, ...]
    bound: float
    unit: str = "nats/token"
    joint_k: int = JOINT_K
    exhausted: bool = False
    n_candidates: int = 0

    def __len__(self) -> int:
        return len(self.heads)

    def effect(self, k: int | None = None) -> Interval:
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
        return {
            "heads": [list(h) for h in self.heads],
            "effects": [iv.to_dict() for iv in self.effects],
            "rejected": [r.to_dict() for r in self.rejected],
            "bound": self.bound,
            "unit": self.unit,
            "joint_k": self.joint_k,
            "exhausted": self.exhausted,
            "n_candidates": self.n_candidates,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JointSet":
        """The joint set written by :meth:`to_dict`."""

        def num(v: Any) -> float:
            return math.nan if v is None else float(v)

        return cls(
            heads=tuple((int(a), int(b)) for a, b in data["heads"]),
            effects=tuple(
                Interval(num(e["value"]), num(e["low"]), num(e["high"]), int(e["n"]), e["method"])
                for e in data["effects"]
            ),
            rejected=tuple(
                RejectedHead(
                    (int(r["layer"]), int(r["head_index"])), num(r["joint_effect"]), int(r["after"])
                )
                for r in data["rejected"]
            ),
            bound=float(data["bound"]),
            unit=str(data.get("unit", "nats/token")),
            joint_k=int(data["joint_k"]),
            exhausted=bool(data["exhausted"]),
            n_candidates=int(data.get("n_candidates", 0)),
        )

    def to_dataframe(self) -> Any:
        """One row per head tried: ``step, layer, head, status`` (``"accepted"`` /
        ``"rejected"``), ``after`` (heads accepted before it was tried), ``joint_effect``,
        ``joint_effect_low``, ``joint_effect_high`` (the interval of accepted heads only), in the
        order they were tried."""
        import pandas as pd

        rows = [
            {"layer": h[0], "head": h[1], "status": "accepted", "after": i,
             "joint_effect": iv.value, "joint_effect_low": iv.low, "joint_effect_high": iv.high}
            for i, (h, iv) in enumerate(zip(self.heads, self.effects, strict=True))
        ] + [
            {"layer": r.head[0], "head": r.head[1], "status": "rejected", "after": r.after,
             "joint_effect": r.joint_effect, "joint_effect_low": math.nan,
             "joint_effect_high": math.nan}
            for r in self.rejected
        ]  # fmt: skip
        rows.sort(key=lambda r: (r["after"], r["status"] == "accepted"))  # tried in this order
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
            >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
            >>> model = toy_gna_model()
            >>> report = score_heads(model, toy_gna_task(model, n_samples=8),
            ...                      control=toy_control(model), progress=False)
            >>> print(report.summary(2).splitlines()[2])
            Task: kv_retrieval(template=toy, n_pairs=4, values=words) (n=8, scoring=choices) on 8 prompts
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
        """
        if by is not None and joint:
            raise GnaLensError(
                f"GnaReport.top(k={k}, by={by!r}, joint=True): the joint set belongs to the "
                "default ranking; a column's raw order has none. Fix: top(k) (joint set) or "
                f"top(k, by={by!r})."
            )
        if by is None:
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
            values = self.scores["ablation_effect"].double()
            ok = self._eligible()
            if int(ok.sum()) < k < len(self.heads):
                _short(
                    k, int(ok.sum()), f"{int(ok.sum())} heads were measured and have a control "
                    f"effect of at most max_control {self.max_control:g} (see excluded({k}) "
                    "and unmeasured)",
                )  # fmt: skip
            key = values.masked_fill(~ok, math.inf)
            order = torch.argsort(key, stable=True).tolist()
            return HeadList(
                [self.heads[i] for i in order[: min(k, int(ok.sum()))]], self.head_groups
            )
        if by not in self.scores:
            raise GnaLensError(
                f"GnaReport.top(by={by!r}); expected None (retrieval-specific) or one of "
                f"{sorted(self.scores)}."
            )
        values = self.scores[by].double()
        if bool(torch.isnan(values).all()):
            raise GnaLensError(
                f"GnaReport.top(by={by!r}): this report has no {by} (it was not computed). Run "
                "score_heads(..., ablation=True) for ablation effects."
            )
        ascending = by in _LOWER_FIRST
        key = values.nan_to_num(nan=math.inf if ascending else -math.inf)
        order = torch.argsort(key if ascending else -key, stable=True).tolist()
        return HeadList([self.heads[i] for i in order[:k]], self.head_groups)

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
            if r is not None:
                reason = (
                    f"joint control effect {r.joint_effect:+.3f} {self.control_unit} with the "
                    f"{r.after} joint-set head{'s' if r.after != 1 else ''} before it > "
                    f"max_control {self.max_control:g} (alone {c:+.3f})"
                )
                out.append(ExcludedHead(self.heads[i], e, c, reason, r.joint_effect))
                continue
            if c <= self.max_control:  # within the bound, tied with the k-th head: not left out
                continue
            reason = (
                f"control effect {c:+.3f} {self.control_unit} > max_control {self.max_control:g}"
                if not math.isnan(c)
                else "control effect not measured"
            )
            out.append(ExcludedHead(self.heads[i], e, c, reason))
        return out

    def joint_table(self, heads: list[Head] | None = None) -> Any:
        """:meth:`to_dataframe`'s rows of ``heads`` (default: the joint set's), in that order,
        with ``joint_control_effect``, ``joint_control_low`` and ``joint_control_high`` after
        ``control_effect``: for a head of the joint set, the control effect of it and the joint
        set's heads before it, removed together, with its 95% interval (NaN for other heads,
        and without a joint set).

        Examples:
            >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
            >>> model = toy_gna_model(generic_head=True)
            >>> report = score_heads(model, toy_gna_task(model, n_samples=8),
            ...                      control=toy_control(model), progress=False)
            >>> report.joint_table(report.top(2))[["layer", "head", "joint_control_effect"]]
               layer  head  joint_control_effect
            0      0     0                   0.0
            1      1     0                   0.0
        """
        joint = self._joint()
        if heads is None:
            heads = list(joint.heads) if joint is not None else []
        df = self.to_dataframe().set_index(["layer", "head"]).loc[list(heads)].reset_index()
        cols: dict[str, list[float]] = {name: [] for name in _JOINT_COLUMNS}
        position = {h: i for i, h in enumerate(joint.heads)} if joint is not None else {}
        for h in heads:
            i = position.get(tuple(h))  # type: ignore[arg-type]
            iv = joint.effects[i] if joint is not None and i is not None else None
            for name, attr in zip(_JOINT_COLUMNS, ("value", "low", "high"), strict=True):
                cols[name].append(math.nan if iv is None else float(getattr(iv, attr)))
        at = list(df.columns).index("control_effect_high") + 1
        for j, name in enumerate(_JOINT_COLUMNS):
            df.insert(at + j, name, cols[name])
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
            >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
            >>> model = toy_gna_model(generic_head=True)
            >>> report = score_heads(model, toy_gna_task(model, n_samples=8),
            ...                      control=toy_control(model), progress=False)
            >>> again = GnaReport.from_json(report.to_json())
            >>> again.top(2) == report.top(2), again.joint_set == report.joint_set
            (True, True)
        """
        if not isinstance(data, dict) or "heads" not in data or "n_layers" not in data:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise GnaLensError(
                f"GnaReport.from_dict: got {keys}; expected the dict of GnaReport.to_dict() "
                "(with 'heads' and 'n_layers'), e.g. a report.json of `gna-lens scan`."
            )

        def num(v: Any) -> float:
            return math.nan if v is None else float(v)

        rows = data["heads"]
        heads = tuple((int(r["layer"]), int(r["head"])) for r in rows)
        scores = {
            name: torch.tensor([num(r.get(name)) for r in rows], dtype=torch.float32, device=HOST)
            for name in SCORE_COLUMNS
        }
        groups = data.get("head_groups") or {}
        index = {h: i for i, h in enumerate(heads)}
        samples: dict[str, Tensor] = {}
        for name, block in (data.get("sample_effects") or {}).items():
            grid = host_full((len(heads), int(block["n_samples"])))
            for (layer, h), values in zip(block["heads"], block["values"], strict=True):
                grid[index[(int(layer), int(h))]] = torch.tensor(
                    [num(v) for v in values], dtype=torch.float32, device=HOST
                )
            samples[name] = grid
        return cls(
            model_name=str(data.get("model_name", "")),
            task=str(data.get("task", "")),
            heads=heads,
            kinds=tuple(str(r.get("kind", "attention")) for r in rows),
            scores=scores,
            metric=str(data.get("metric", "none")),
            baseline=num(data.get("baseline")),
            n_layers=int(data["n_layers"]),
            layer_heads=tuple(int(n) for n in data.get("layer_heads", ())),
            normalization=dict(data.get("normalization") or NORMALIZATION),
            roles=tuple(str(r.get("role", "")) for r in rows),
            control=str(data.get("control", "")),
            control_baseline=num(data.get("control_baseline")),
            max_control=num(data.get("max_control", MAX_CONTROL)),
            method=dict(data.get("method") or {}),
            unmeasured=tuple(
                UnmeasuredHeads(
                    int(u["layer"]),
                    tuple((int(u["layer"]), int(h)) for h in u["head_indices"]),
                    str(u["reason"]),
                )
                for u in data.get("unmeasured", ())
            ),
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


def _model_name(model: Any) -> str:
    """The name the model was loaded by (``"smollm2-135m"``), else its config's, else its class."""
    prov = provenance_of(model)
    if prov.known and prov.name:
        return str(prov.name)
    cfg = getattr(model, "cfg", None)
    for attr in ("model_name", "name_or_path"):
        name = getattr(cfg, attr, None)
        if name:
            return str(name)
    return type(model).__name__


def _examples(model: Any, task: Task, heads: list[Head]) -> dict[str, Any]:
    """Patterns of ``heads`` on the task's first sample (SSM rows as |M| normalized)."""
    from gna_lens.heads import head_patterns
    from gna_lens.scoring.patterns import _capture_part_patterns

    subject = Subject.of(model)
    model, view = subject.model, subject.view
    sample = task[0]
    device = subject.device
    parts = view.parts_of(heads)  # one hook_pattern per part of a layer
    with torch.no_grad(), _capture_part_patterns(model, view, parts) as store:
        model(torch.tensor([sample.input_ids], device=device))
    patterns = {}
    for layer, h in heads:
        part, i = view.part_of((layer, h))
        # Mamba-1 groups: aggregated
        p = head_patterns(store[(layer, part.offset)], part)[0, i].float()
        if view.kind_of((layer, h)) == "ssm":
            p = p.abs().tril()
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
        patterns[f"L{layer}H{h}"] = to_host(p).tolist()
    tokenizer = getattr(model, "tokenizer", None)
    tokens = (
        [tokenizer.decode([i]) for i in sample.input_ids]
        if tokenizer is not None
        else [str(i) for i in sample.input_ids]
    )
    return {"tokens": tokens, "patterns": patterns, "sample": 0}


def _clean(v: float) -> float | None:
    return None if math.isnan(v) else v


def resolve_sweep_dtype(
    model: Any, sweep_dtype: Any, task: Task | None = None
) -> tuple[Any, dict[str, Any]]:
    """The sweep dtype to run (``"auto"`` resolved) and what to record about the choice.

    ``"auto"`` (:func:`gna_lens.runtime.choose_precision`): the model's own arithmetic where
    the model is small (at most :data:`EXACT_ALL_MAX` heads, as grouped now: its exact sweep is
    affordable in float32) or its weights are not float32; else a forward pass like the
    sweep's (:func:`_probe_forward`: 16 of ``task``'s prompts, last-position logits) is timed in
    float32 and under bfloat16 autocast on the model's device, and
    bfloat16 is taken only where it is measured faster (by
    :data:`~gna_lens.runtime.MIN_SPEEDUP`) and passes :func:`check_bfloat16` on the same
    prompts. The record (``sweep_dtype_choice``, ``sweep_dtype_probe``) says what was measured.
    Other values are returned as given.

    Args:
        model: The model.
        sweep_dtype: ``"auto"``, ``None`` / ``"float32"`` or ``"bfloat16"``.
        task: The selection task (the probe's and the check's prompts); needed by ``"auto"``
            on a large model.

    Examples:
        >>> from gna_lens.testing import toy_gna_model
        >>> resolve_sweep_dtype(toy_gna_model(), "auto")
        (None, {'sweep_dtype_choice': 'auto: float32 (4 heads: a small model)'})
    """
    if sweep_dtype != "auto":
        return sweep_dtype, {}
    subject = Subject.of(model)
    model = subject.model
    n = subject.view.n_heads_total
    param = next(iter(model.parameters()), None)
    if param is None:
        return None, {"sweep_dtype_choice": "auto: the model's own dtype (no parameters)"}
    large = n > EXACT_ALL_MAX
    if large and task is None and param.dtype == torch.float32:
        raise GnaLensError(
            "resolve_sweep_dtype(model, 'auto') on a large model needs task= (its prompts are "
            "what bfloat16 is timed and checked on). Fix: pass the selection task."
        )
    run, what = _probe_forward(model, task) if large and task is not None else (None, "")
    choice = choose_precision(
        "auto",
        run=run,
        device=param.device,
        what=what,
        weights_dtype=param.dtype,
        worth_it=(large, f"{n:,} heads: a small model"),
        check=None if task is None else lambda: check_bfloat16(model, task),
    )
    record: dict[str, Any] = {"sweep_dtype_choice": choice.reason}
    if choice.probe is not None:
        record["sweep_dtype_probe"] = choice.probe.to_dict()
        if choice.autocast is not None:
            record["sweep_dtype_choice"] += (
                f"; the model is large ({n:,} heads, more than {EXACT_ALL_MAX}); held-out "
                "numbers are float32; --sweep-dtype float32 (sweep_dtype=None) for exact "
                "arithmetic"
            )
    return choice.autocast, record


def _probe_forward(model: Any, task: Task, rows: int = 16) -> tuple[Any, str]:
    """The work ``sweep_dtype="auto"`` times: a forward pass like the sweep's own (the last
    position's logits only) on ``rows`` selection prompts of the task's most common length (its
    prompts repeated where it has fewer). Matrix shapes decide which precision is faster (on one
    AVX512-BF16 Xeon a 64-row bfloat16 matmul was 2x slower than float32), so the probe runs
    the sweep's batch, not a toy one."""
    from collections import Counter

    from gna_lens.interventions.runner import Runner

    ids = [list(s.input_ids) for s in task]
    length = Counter(len(i) for i in ids).most_common(1)[0][0]
    same = [i for i in ids if len(i) == length]
    subject = Subject.of(model)
    device = subject.device
    batch = torch.tensor(same, device=device).repeat(-(-rows // len(same)), 1)[:rows]
    runner = Runner(subject)

    def run() -> None:
        with torch.no_grad():
            runner.logits_last(batch)

    return run, f"forward of {len(batch)} x {length} selection tokens, last-position logits"


def check_bfloat16(model: Any, task: Task, n: int = 8) -> tuple[bool, str]:
    """Whether bfloat16 autocast keeps ``model``'s clean logit differences on the first ``n``
    prompts of ``task``: the mean absolute change must stay within 0.1 x the mean absolute
    float32 value + 0.02 logits. Returns ``(ok, the numbers in words)``.

    A guard for ``sweep_dtype="auto"``: trained models run in bfloat16 every day, but a model
    whose mechanism needs float32 (e.g. a hand-built one with huge weights) must not be swept in
    it.
    """
    from gna_lens.tasks import evaluate

    sub = task[: min(n, len(task))]
    with torch.no_grad():
        ref = evaluate(model, sub).logit_diffs.double()
        with sweep_precision(model, "bfloat16"):
            low = evaluate(model, sub).logit_diffs.double()
    change, scale = float((low - ref).abs().mean()), float(ref.abs().mean())
    ok = change <= 0.1 * scale + 0.02
    words = (
        f"clean logit difference on {len(sub)} selection prompts moves by {change:.4f} on "
        f"average under bfloat16 (float32 mean |value| {scale:.4f}; allowed 0.1 x that + 0.02)"
    )
    return ok, words


@contextlib.contextmanager
def sweep_precision(model: Any, dtype: str | None) -> Iterator[str]:
    """Autocast for the ablation sweeps: ``None``/``"float32"`` (none) or ``"bfloat16"``."""
    if dtype in (None, "float32", torch.float32):
        yield "float32"
        return
    if dtype not in ("bfloat16", torch.bfloat16):
        raise GnaLensError(
            f"sweep_dtype={dtype!r}; expected None or 'float32' (exact arithmetic of the model's "
            "own dtype), 'bfloat16' (autocast: faster only where the device has native bfloat16) "
            "or 'auto' (bfloat16 where measured faster)."
        )
    with policy_of(model).autocast("bfloat16"):
        yield "bfloat16 (autocast)"


def _intervals(sweep: SweepResult) -> tuple[Tensor, Tensor]:
    """Per-cell 95% bootstrap intervals (over samples) of the paired effect, as tensors."""
    ivs = sweep.effect_intervals()
    return (
        torch.tensor([iv.low for iv in ivs], dtype=torch.float32, device=HOST),
        torch.tensor([iv.high for iv in ivs], dtype=torch.float32, device=HOST),
    )


def _scatter(heads: list[Head], sweep: SweepResult, *cols: Tensor) -> list[Tensor]:
    """Per-head tensors (NaN for heads not in the sweep) of the sweep's effects and ``cols``."""
    by_cell = {c[0]: i for i, c in enumerate(sweep.cells)}
    out = []
    for col in (sweep.effects, *cols):
        full = host_full(len(heads))
        for i, h in enumerate(heads):
            j = by_cell.get(h)
            if j is not None:
                full[i] = float(col[j])
        out.append(full)
    return out


def _scatter_samples(heads: list[Head], sweep: SweepResult) -> Float[Tensor, "head sample"]:
    """Per-head, per-sample effects ``[head, sample]`` (value minus baseline; NaN rows for
    heads not in the sweep)."""
    diffs = to_host(sweep.values.float() - sweep.baseline.float()[None])
    by_cell = {c[0]: i for i, c in enumerate(sweep.cells)}
    full = host_full((len(heads), int(sweep.values.shape[1])))
    for i, h in enumerate(heads):
        j = by_cell.get(h)
        if j is not None:
            full[i] = diffs[j]
    return full


def _joint_walk(
    model: Any,
    control: TextControl | Task,
    report: GnaReport,
    control_samples: Tensor,
    joint_k: int,
    *,
    mode: str,
    positions: Any,
    progress: bool,
    measure: Callable[[list[list[Head]]], Tensor] | None = None,
) -> tuple[JointSet, str]:
    """The greedy joint set of :func:`score_heads` (see :class:`JointSet`), and its
    ``method["joint_control"]`` line.

    ``measure`` (head sets -> per-sample control changes ``[sets, samples]``) replaces the
    control sweep; :func:`~gna_lens.scoring.stability.joint_stability` passes one that reads
    cached per-window changes on resampled windows.

    The first candidate joins on its own control effect (already measured, within the bound);
    each later round ablates the accepted heads plus the next candidate together (after a round
    whose first candidate was turned down, each of the next :data:`JOINT_BATCH` candidates, in
    one control sweep), and the first candidate whose set stays within the bound joins (the
    candidates before it are turned down; those after it are tried again with the larger set).
    """
    from tqdm.auto import tqdm

    bound, unit = report.max_control, report.control_unit
    candidates = list(report.top(len(report.heads), joint=False))
    index = {h: i for i, h in enumerate(report.heads)}
    accepted: list[Head] = []
    effects: list[Interval] = []
    rejected: list[RejectedHead] = []
    pos = sweeps = cells = 0
    width = 1  # candidates per round: JOINT_BATCH after a turned-down one
    bar = tqdm(total=min(joint_k, len(candidates)), desc="joint control set", disable=not progress,
               leave=False)  # fmt: skip
    try:
        while len(accepted) < joint_k and pos < len(candidates):
            if not accepted:
                head = candidates[pos]
                pos += 1
                accepted.append(head)
                effects.append(_paired_interval(control_samples[index[head]]))
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
                    effects.append(_paired_interval(diffs[j]))
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
    line = (
        f"greedy joint set: walking the per-head order ({len(candidates)} heads within "
        f"max_control alone), a head joins only if it and the heads accepted before it, "
        f"{mode}-ablated together at {positions_label(positions)} positions, raise the control "
        f"loss by at most {bound:g} {unit} on average; one candidate per control sweep, "
        f"{JOINT_BATCH} after one is turned down ({sweeps} sweeps of {cells} head sets); "
        f"{len(accepted)} heads accepted (joint_k={joint_k}), "
        f"{len(rejected)} turned down" + ("; every candidate tried" if exhausted else "")
    )
    return joint, line


def _paired_interval(diffs: Tensor) -> Interval:
    """The mean of per-sample effects with its 95% paired bootstrap interval."""
    iv = bootstrap_interval(diffs.double())
    assert isinstance(iv, Interval)
    return iv


def default_top_layers(view: Any) -> int:
    """Layers a coarse-to-fine scan ablates head by head: :data:`DEFAULT_TOP_LAYERS` (4: a
    Gather layer and the Aggregate layer after it, twice over), fewer where that many layers
    hold more than :data:`EXACT_ALL_MAX` heads, at least 1.

    Args:
        view: The model's :func:`~gna_lens.heads.head_view`.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> from gna_lens.heads import head_view
        >>> default_top_layers(head_view(tiny_hooked_ssm("mamba2")))  # 8 heads per layer
        4
        >>> default_top_layers(head_view(tiny_hooked_ssm("mamba1")))  # 64 channels per layer
        4
    """
    widest = max((lh.n_heads for lh in view), default=1)
    return max(1, min(DEFAULT_TOP_LAYERS, EXACT_ALL_MAX // max(widest, 1)))


def _resolve_strategy(strategy: Any, prefilter: Any, top_layers: Any, view: Any) -> str:
    """The strategy to run (``"auto"`` resolved), after checking the arguments that go with it."""
    if strategy not in STRATEGIES:
        raise InterventionError(
            f"strategy={strategy!r}; expected one of {STRATEGIES}: 'auto' (exact up to "
            f"{EXACT_ALL_MAX} heads, else coarse_to_fine), 'exact', 'coarse_to_fine' (layers "
            "first, then the heads of the top layers) or 'attribution' (prefilter)."
        )
    if prefilter is not None and (not isinstance(prefilter, int) or prefilter < 1):
        raise InterventionError(f"prefilter={prefilter!r}; expected a positive int or None.")
    if top_layers is not None and (
        not isinstance(top_layers, int) or isinstance(top_layers, bool) or top_layers < 1
    ):
        raise InterventionError(f"top_layers={top_layers!r}; expected a positive int or None.")
    if prefilter is not None and strategy not in ("auto", "attribution"):
        raise InterventionError(
            f"prefilter={prefilter} with strategy={strategy!r}: the prefilter is the attribution "
            "strategy's cut. Fix: strategy='attribution' (or 'auto'), or drop prefilter."
        )
    if top_layers is not None and strategy in ("exact", "attribution"):
        raise InterventionError(
            f"top_layers={top_layers} with strategy={strategy!r}: top_layers is the "
            "coarse-to-fine scan's. Fix: strategy='coarse_to_fine' (or 'auto'), or drop it."
        )
    if strategy != "auto":
        return str(strategy)
    if prefilter is not None:
        return "attribution"
    return "exact" if view.n_heads_total <= EXACT_ALL_MAX else "coarse_to_fine"


def choose_strategy(
    model: Any,
    task: Task,
    strategy: str = "auto",
    *,
    prefilter: int | None = None,
    top_layers: int | None = None,
    exact_budget_s: float = EXACT_BUDGET_S,
) -> tuple[str, str]:
    """Which heads :func:`score_heads` ablates exactly, and why, in words for the report.

    ``"auto"``: every head (``"exact"``) on models with at most :data:`EXACT_ALL_MAX` heads; on a
    CUDA device also above that whenever the estimated time of the task's and the control's
    sweeps is at most ``exact_budget_s`` (estimate: one timed forward of 16 selection prompts,
    per row, times the prompts, times the heads, times the mean share of the layers a head's
    cell runs through, twice for the control); else ``"coarse_to_fine"`` (CPUs, and models too
    large for the budget). ``prefilter`` selects ``"attribution"``.

    Args:
        model: The model (its device decides whether the estimate is made).
        task: The selection prompts.
        strategy: One of :data:`STRATEGIES`.
        prefilter: As :func:`score_heads`.
        top_layers: As :func:`score_heads`.
        exact_budget_s: Seconds an exact scan may take on a GPU.

    Returns:
        ``(strategy, reason)``.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> choose_strategy(model, toy_gna_task(model))
        ('exact', 'auto: exact, every one of the 4 heads (at most 300)')
    """
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    chosen = _resolve_strategy(strategy, prefilter, top_layers, view)
    n = view.n_heads_total
    if strategy != "auto":
        return chosen, f"{chosen} (asked for)"
    if chosen != "coarse_to_fine":
        why = f"every one of the {n} heads (at most {EXACT_ALL_MAX})" if chosen == "exact" else (
            f"prefilter={prefilter} given"
        )  # fmt: skip
        return chosen, f"auto: {chosen}, {why}"
    policy = subject.policy
    if not _estimate_applies(policy):
        return chosen, (
            f"auto: coarse_to_fine, {n} heads (more than {EXACT_ALL_MAX}) on "
            f"{policy.device.type}; an exact scan of every head is chosen only on a GPU whose "
            "estimated time fits exact_budget_s"
        )
    est, basis = _exact_seconds(model, task, view)
    fits = est <= exact_budget_s
    return ("exact" if fits else "coarse_to_fine"), (
        f"auto: {'exact' if fits else 'coarse_to_fine'}, every one of {n} heads estimated at "
        f"{est:.0f} s on {policy.describe()} ({'within' if fits else 'over'} "
        f"exact_budget_s={exact_budget_s:g}; {basis})"
    )


def _estimate_applies(policy: DevicePolicy) -> bool:
    """Whether ``"auto"`` estimates an exact scan (a seam the CPU tests replace)."""
    return policy.is_cuda


def time_per_row(model: Any, task: Task, rows: int = 16) -> tuple[float, str]:
    """Seconds per prompt of a sweep-like forward (:func:`_probe_forward` of ``rows`` prompts):
    the median of 3 timed runs after a warm-up; and what was timed, in words."""
    run, what = _probe_forward(model, task, rows)
    policy = policy_of(model)
    run()  # warm-up (kernels compiled, memory pools filled)
    times = []
    for _ in range(3):
        policy.synchronize()
        t0 = time.perf_counter()
        run()
        policy.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1] / rows, what


def _exact_seconds(model: Any, task: Task, view: Any) -> tuple[float, str]:
    """Estimated seconds of the task's and the control's exact sweeps over every head."""
    per_row, what = time_per_row(model, task)
    depth = sum((view.n_layers - layer) / view.n_layers for layer, _ in view.heads()) / max(
        view.n_heads_total, 1
    )
    est = 2 * view.n_heads_total * len(task) * depth * per_row
    return est, (
        f"{per_row * 1e3:.3f} ms per row of a {what} x {len(task)} prompts x "
        f"{view.n_heads_total} heads x {depth:.2f} mean depth x 2 for the control"
    )


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


def auto_head_groups(model: Any) -> int | None:
    """The block size ``head_groups="auto"`` gives ``model``, or ``None`` (heads as they are).

    A :class:`~gna_lens.models.HookedSSM` with Mamba-1 layers (Mamba-1, FalconMamba, Jamba)
    without channel groups of its own and with more than :data:`EXACT_ALL_MAX` heads gets
    contiguous blocks of :data:`DEFAULT_CHANNEL_GROUP` channels (the largest divisor of
    ``d_inner`` up to it) in its Mamba-1 layers. Any other model (Transformers, Mamba-2, the
    Mamba-2 hybrids, a small Mamba-1, a Mamba-1 whose groups were set with ``set_head_groups``)
    gets ``None``.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> auto_head_groups(tiny_hooked_ssm("mamba1")) is None  # 128 channels: exact as they are
        True
    """
    from gna_lens.heads import is_hooked_ssm

    if not is_hooked_ssm(model) or not model.channel_heads:
        return None
    if model.head_group_spec or head_view(model).n_heads_total <= EXACT_ALL_MAX:
        return None
    d_inner = int(model.cfg.d_inner)
    return max(k for k in range(1, DEFAULT_CHANNEL_GROUP + 1) if d_inner % k == 0)


@contextlib.contextmanager
def applied_head_groups(model: Any, head_groups: Any) -> Iterator[dict[str, Any]]:
    """Inside the block, ``model``'s heads are grouped as ``head_groups`` says; yields what to
    record in a report's ``method`` (``{}`` when nothing changed).

    Args:
        model: Any model :func:`~gna_lens.head_view` takes.
        head_groups: ``"auto"`` (:func:`auto_head_groups`), ``None`` / ``"none"`` (single
            channels on a Mamba-1 model, even where ``set_head_groups`` grouped them; nothing on
            other models), or a spec of :meth:`~gna_lens.models.HookedSSM.set_head_groups` (an
            int block size or ``{layer: size or channel sets}``; Mamba-1 / FalconMamba only).

    Raises:
        InterventionError: For another value, or a spec the model refuses (a Mamba-2 model, a
            size that does not divide ``d_inner``, ...).
    """
    from gna_lens.heads import is_hooked_ssm

    if isinstance(head_groups, str) and head_groups not in ("auto", "none"):
        raise InterventionError(
            f"head_groups={head_groups!r}; expected 'auto' (contiguous blocks of "
            f"{DEFAULT_CHANNEL_GROUP} channels on a Mamba-1 model above {EXACT_ALL_MAX} heads), "
            "None / 'none' (single channels), an int block size or {layer: size or channel sets}."
        )
    mamba1 = is_hooked_ssm(model) and model.channel_heads
    if head_groups == "auto":
        size = auto_head_groups(model)
        if size is None:
            yield {}
            return
        n = head_view(model).n_heads_total
        note = (
            f"auto: {n:,} single-channel heads is more than EXACT_ALL_MAX ({EXACT_ALL_MAX}), so "
            f"each head is a contiguous block of {size} channels (head_groups=None for single "
            f"channels); these (layer, head) indices address blocks: reuse them inside "
            f"`with model.head_groups({size}):`"
        )
        with model.head_groups(size):
            yield {"head_groups_choice": note, "head_group_size": size}
        return
    if head_groups is None or head_groups == "none":
        if not mamba1 or not model.head_group_spec:
            yield {}
            return
        with model.head_groups(None):
            yield {"head_groups_choice": "none: single channels (the model's groups set aside)"}
        return
    if not mamba1:
        raise InterventionError(
            f"head_groups={head_groups!r} on a {type(model).__name__}"
            + (f" ({model.cfg.architecture})" if is_hooked_ssm(model) else "")
            + ": channel groups are for Mamba-1 layers (Mamba-1, FalconMamba, Jamba), whose "
            "heads are single channels; other models' heads are real heads. Fix: "
            "head_groups='auto' or None."
        )
    with model.head_groups(head_groups):
        choice: dict[str, Any] = {"head_groups_choice": f"given: {head_groups!r}"}
        if isinstance(head_groups, int):
            choice["head_group_size"] = head_groups
        yield choice


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


def _short(k: int, got: int, why: str) -> None:
    """Warn that :meth:`GnaReport.top` returns fewer heads than asked for, and why."""
    warnings.warn(f"GnaReport.top({k}) returns {got} heads: {why}.", GnaLensWarning, stacklevel=3)


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
) -> GnaReport:
    """Score every head of ``model`` on ``task``: pattern scores, retrieval and control effects.

    Heads are ablated alone on the task and on the control; effects carry 95% bootstrap
    intervals over the prompts (the control's windows). The default ranking
    (:meth:`GnaReport.top`) is retrieval-specific: by retrieval effect among the heads whose
    control effect stays at most ``max_control`` nats/token, and, since heads that each pass
    alone can break the control together, a greedy joint set (:class:`JointSet`) of up to
    ``joint_k`` of them whose control effect *removed together* stays at most ``max_control``:
    walking the per-head order, each head joins only if the set with it, ablated together (same
    mode and positions), stays within the bound (one control sweep per candidate, of
    :data:`JOINT_BATCH` candidates after one is turned down). ``method["joint_control"]`` says
    what was done.

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
        control: What needs no in-context retrieval (:func:`resolve_control`): ``"auto"``
            (default: the zoo's cloze split on a zoo model, else ``"prose"``), ``"prose"``,
            ``None``, a :class:`~gna_lens.tasks.TextControl`, a knowledge
            :class:`~gna_lens.tasks.Task`, texts or a ``datasets.Dataset``.
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
        head_groups: What a Mamba-1 head is, for this call only (:func:`applied_head_groups`):
            ``"auto"`` (default: on a Mamba-1 / FalconMamba model with more than
            :data:`EXACT_ALL_MAX` single-channel heads and no groups of its own, contiguous
            blocks of :data:`DEFAULT_CHANNEL_GROUP` channels, e.g. 24 per layer of mamba-130m;
            otherwise the model's heads as they are), ``None`` (single channels), or an int
            block size / ``{layer: ...}`` of :meth:`~gna_lens.models.HookedSSM.set_head_groups`.
            The report's ``(layer, head)`` then address groups (``method["head_groups"]`` says
            which; ablate them inside ``with model.head_groups(size):``).
        sweep_dtype: ``None`` (the model's dtype), ``"bfloat16"`` (autocast of the ablation
            sweeps only) or ``"auto"`` (on models above :data:`EXACT_ALL_MAX` heads, bfloat16
            only where a probe on this model and device measures it faster and it passes
            :func:`check_bfloat16`; see :func:`resolve_sweep_dtype`); recorded in ``method``
            (``sweep_dtype_choice``, and ``sweep_dtype_probe`` with the timings). On SmolLM2-135M
            bfloat16 was 1.64x faster on one CPU with AVX512-BF16, 1.78x slower on another,
            and 10x slower with AVX2 kernels only (benchmarks/RESULTS.md): it is measured.
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
            unless the walk ran out of candidates. Costs a control sweep of one head set per
            candidate tried (of :data:`JOINT_BATCH` after one is turned down).

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
    with applied_head_groups(model_of(model), head_groups) as groups_choice:
        # A Subject built by the caller stays valid unless the grouping changed just now.
        same = isinstance(model, Subject) and not groups_choice
        return _score_heads(
            model if same else model_of(model), task, ablation, control=control, metric=metric, mode=mode,
            positions=positions, reference=reference, max_control=max_control,
            prefilter=prefilter, strategy=strategy, top_layers=top_layers,
            sweep_dtype=sweep_dtype, batch_size=batch_size, n_examples=n_examples,
            progress=progress, groups_choice=groups_choice, executor=executor,
            exact_budget_s=exact_budget_s, joint_k=joint_k,
        )  # fmt: skip


def _score_heads(
    model: Any,
    task: Task,
    ablation: bool,
    *,
    control: Any,
    metric: str,
    mode: str,
    positions: Any,
    reference: Any,
    max_control: float,
    prefilter: int | None,
    strategy: str,
    top_layers: int | None,
    sweep_dtype: str | None,
    batch_size: int,
    n_examples: int,
    progress: bool,
    groups_choice: dict[str, Any],
    executor: Any = None,
    exact_budget_s: float = EXACT_BUDGET_S,
    joint_k: int = JOINT_K,
) -> GnaReport:
    """:func:`score_heads` with the head groups in place (the model's view is built here, once,
    and every step below is handed it)."""
    if not isinstance(task, Task) or not len(task):
        what = f"task {task.name!r} has no prompts" if isinstance(task, Task) else (
            f"task is a {type(task).__name__}"
        )  # fmt: skip
        raise GnaLensError(
            f"score_heads: {what}; expected a gna_lens.tasks.Task with at least one prompt "
            "(e.g. kv_retrieval(tokenizer, n_samples=24))."
        )
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    positions = check_positions(positions)
    strategy, strategy_why = choose_strategy(
        subject, task, strategy, prefilter=prefilter, top_layers=top_layers,
        exact_budget_s=exact_budget_s,
    )  # fmt: skip
    dtype_choice: dict[str, Any] = {}
    if ablation:  # pattern scores alone run no sweep
        sweep_dtype, dtype_choice = resolve_sweep_dtype(subject, sweep_dtype, task)
    if mode == "resample" and reference is task:
        raise InterventionError(
            "score_heads(mode='resample'): reference is the task itself, so every prompt would "
            "take its own head outputs and nothing would be ablated. Fix: pass reference=<another "
            "task of the same lengths> (e.g. the same generator with another seed), or none (the "
            "task rotated by one), or use mode='mean' / 'zero'."
        )
    if mode == "resample" and reference is None:
        reference = rotated(task, "score_heads")
    if mode == "mean" and reference is None:
        reference = task
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    scores = pattern_scores(subject, task, batch_size=batch_size, progress=progress)
    timings["pattern_scores"] = time.perf_counter() - clock
    heads = list(scores.heads)
    n = len(heads)
    nan = host_full(n)
    table: dict[str, Tensor] = {name: getattr(scores, name) for name in SCORE_NAMES}
    sample_effects: dict[str, Tensor] = {}
    for name in SCORE_COLUMNS[len(SCORE_NAMES) :]:
        table[name] = nan.clone()
    baseline = control_baseline = math.nan
    resolved = None
    method: dict[str, Any] = provenance_method(model) | {
        "metric": metric,
        "mode": mode,
        "positions": positions_label(positions),
        "reference": "none" if reference is None else (
            "the task itself" if reference is task else describe_task(reference)
            if isinstance(reference, Task) else f"token ids {tuple(reference.shape)}"
        ),
        "n_prompts": len(task),
        "intervals": "95% percentile bootstrap over prompts (control: over windows), paired",
    }  # fmt: skip
    layers: LayerSweepResult | None = None
    unmeasured: list[UnmeasuredHeads] = []
    if ablation:
        targets = heads
        resolved = resolve_control(control, getattr(model, "tokenizer", None), positions=positions)
        if strategy == "attribution":
            cut = DEFAULT_PREFILTER if prefilter is None else prefilter
            clock = time.perf_counter()
            est = attribute_heads(subject, task, metric="logit_diff", batch_size=batch_size)
            timings["attribution"] = time.perf_counter() - clock
            by_head = {c[0]: e for c, e in zip(est.cells, est.effects.tolist(), strict=True)}
            attribution = torch.tensor([by_head.get(h, math.nan) for h in heads], device=HOST)
            table["attribution"] = attribution
            order = torch.argsort(attribution.nan_to_num(nan=math.inf), stable=True).tolist()
            targets = [heads[i] for i in order[:cut]]
            unmeasured = _unmeasured(
                heads, targets,
                lambda layer: f"ranked below the top {cut} of {n} heads by attribution patching "
                "(its estimate is in the 'attribution' column)",
            )  # fmt: skip
            method.update(prefilter=f"attribution patching, top {cut}")
        if strategy == "coarse_to_fine":
            k = default_top_layers(view) if top_layers is None else top_layers
            clock = time.perf_counter()
            with sweep_precision(subject, sweep_dtype):
                layers = layer_sweep(
                    subject, task, metric, [lh.layer for lh in view], positions=positions,
                    control=resolved, progress=progress,
                )  # fmt: skip
            timings["layer_sweep"] = time.perf_counter() - clock
            ranked = [c[0] for c in layers.ranking()]
            chosen = set(ranked[:k])
            targets = [h for h in heads if h[0] in chosen]
            unmeasured = _unmeasured(heads, targets, _layer_reason(layers, ranked, k))
            method.update(
                top_layers=k,
                layer_ranking=(
                    f"{layers.method['ablation']}, each layer alone, on the task and the control; "
                    + ("ranked by selectivity (share of the task lost minus share of the control "
                       "lost)" if layers.has_control else "ranked by task effect")
                    + f"; the heads of the top {k} layers ablated"
                ),
            )  # fmt: skip
        with sweep_precision(subject, sweep_dtype) as precision:
            clock = time.perf_counter()
            sweep = ablation_sweep(
                subject, task, metric=metric, heads=targets, mode=mode, positions=positions,
                reference=reference, progress=progress, executor=executor,
            )  # fmt: skip
            timings["ablation_sweep"] = time.perf_counter() - clock
            forward_paths = path_summary(model)  # the sweep's last forward: kernels or not
            ctrl = None
            if resolved is not None:
                clock = time.perf_counter()
                ctrl = control_sweep(
                    subject, resolved, targets, mode=mode, positions=positions, progress=progress,
                    executor=executor,
                )  # fmt: skip
                timings["control_sweep"] = time.perf_counter() - clock
        effect, lo, hi = _scatter(heads, sweep, *_intervals(sweep))
        table.update(ablation_effect=effect, ablation_effect_low=lo, ablation_effect_high=hi)
        sample_effects = {"ablation_effect": _scatter_samples(heads, sweep)}
        baseline = sweep.baseline_mean
        method.update(
            strategy=strategy,
            strategy_choice=strategy_why,
            n_exact=len(targets),
            n_unmeasured=n - len(targets),
            sweep_dtype=precision,
            ablation_path=sweep.method,
            paths={"ablation": sweep.info.get("paths", {})},
            forward_paths=forward_paths,
            fallbacks=[f"ablation sweep: {f}" for f in sweep.info.get("fallbacks", [])],
        )
        if executor is not None:
            method.update(executor=_executor_line(sweep, ctrl))
        if "mean_over" in sweep.info:  # mean ablation: which positions the mean was taken over
            method.update(mean_over=sweep.info["mean_over"], include_bos=sweep.info["include_bos"])
        method.setdefault("prefilter", "none")
        if ctrl is not None:
            c_eff, c_lo, c_hi = _scatter(heads, ctrl, *_intervals(ctrl))
            table.update(control_effect=c_eff, control_effect_low=c_lo, control_effect_high=c_hi)
            table["specificity"] = specificity(effect, baseline, c_eff)
            sample_effects["control_effect"] = _scatter_samples(heads, ctrl)
            control_baseline = ctrl.baseline_mean
            method.update(control_path=ctrl.method)
            method["paths"]["control"] = ctrl.info.get("paths", {})
            method["fallbacks"] += [f"control sweep: {f}" for f in ctrl.info.get("fallbacks", [])]
    description = ""
    if resolved is not None:
        description = (
            resolved.describe()
            if isinstance(resolved, TextControl)
            else f"answer NLL among the options on {describe_task(resolved)}"
        )
        unit = "nats/token" if isinstance(resolved, TextControl) else "nats/answer"
        method.update(control=description, max_control=max_control, control_unit=unit)
    groups = describe_head_groups(view)
    if groups:
        method["head_groups"] = groups
    method.update(groups_choice)
    if ablation:
        method.update(dtype_choice)
    report = GnaReport(
        model_name=_model_name(model),
        task=describe_task(task),
        heads=tuple(heads),
        kinds=scores.kinds,
        scores=table,
        metric=metric if ablation else "none",
        baseline=baseline,
        n_layers=view.n_layers,
        layer_heads=tuple(lh.n_heads if lh is not None else 0 for lh in view.layers),
        roles=scores.roles,
        control=description,
        control_baseline=control_baseline,
        max_control=max_control,
        method=method,
        layers=layers,
        unmeasured=tuple(unmeasured),
        timings=timings,
        head_groups=view.group_spec,
        sample_effects=sample_effects,
    )
    if ablation and resolved is not None and report.has_control:
        if joint_k:
            clock = time.perf_counter()
            with sweep_precision(subject, sweep_dtype):
                joint, line = _joint_walk(
                    subject, resolved, report, sample_effects["control_effect"], joint_k,
                    mode=mode, positions=positions, progress=progress,
                )  # fmt: skip
            object.__setattr__(report, "joint_set", joint)
            timings["joint_control"] = time.perf_counter() - clock
        else:
            line = "off (joint_k=0): top() bounds each head's control effect alone, not the set's"
        method["joint_control"] = line
    if n_examples:
        clock = time.perf_counter()
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
            object.__setattr__(report, "examples", _examples(subject, task, top))
        timings["examples"] = time.perf_counter() - clock
    return report
