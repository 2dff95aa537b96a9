"""The one result every sweep returns: cells, per-prompt values, baseline, intervals, ranking.

A sweep runs *cells* (a head, a head set, a layer, a set of layers, a patched activation) on the
prompts of a task, and records the metric per cell and prompt next to the baseline without the
intervention. :class:`CellResult` holds that and everything computed from it (effects with paired
95% bootstrap intervals, a control's effects and selectivity, ranking, tables, JSON, plots), the
same way for head sweeps (:class:`~gna_lens.interventions.ablation.SweepResult`), layer sweeps
(:class:`~gna_lens.interventions.layers.LayerSweepResult`) and activation patching
(:class:`~gna_lens.interventions.patching.PatchResult`); the subclasses add what only their cells
have (a head grid, the fraction restored by a patch).
"""

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.device import HOST, host_full, to_host
from gna_lens.errors import InterventionError
from gna_lens.render.plotly import cell_result_figure
from gna_lens.stats import Estimate, bootstrap_interval, mean_interval, wilson_interval

__all__ = ["CellResult"]

#: Every concrete result type by name, for :meth:`CellResult.from_dict`.
_TYPES: dict[str, type["CellResult"]] = {}


@dataclass(frozen=True, kw_only=True)
class CellResult:
    """Per-prompt values of a metric under each cell's intervention, and the baseline.

    Attributes:
        cells: One entry per result row: a head set ``((layer, head), ...)``, a layer set
            ``(layer, ...)``, or what the sweep calls a cell.
        kinds: Per cell, what it edits (``"attention"``, ``"ssm"``, ``"block"``, ``"mixed"``...).
        values: The metric under each cell's intervention, per prompt ``[cell, sample]``.
        baseline: The metric without it, per prompt ``[sample]``.
        metric: The metric's name.
        task: The task's description.
        control_values: A control's loss under each cell, per window (or answer) ``[cell,
            window]``; ``None`` where no control was run with the same cells.
        control_baseline: The control's loss without intervention ``[window]``, or ``None``.
        control: The control's description (``""`` when none).
        info: How the numbers were made: paths taken and fallbacks (``paths``, ``fallbacks``),
            forward passes, timings, the Ray executor's record, method details.
    """

    cells: tuple[tuple[Any, ...], ...]
    kinds: tuple[str, ...]
    values: Float[Tensor, "cell sample"]
    baseline: Float[Tensor, " sample"]
    metric: str
    task: str
    control_values: Float[Tensor, "cell window"] | None = None
    control_baseline: Float[Tensor, " window"] | None = None
    control: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    #: The sign of an effect that makes a cell matter: ``-1`` for ablations (the metric falls),
    #: ``+1`` for patching (the clean behaviour comes back).
    important_sign: ClassVar[int] = -1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[cls.__name__] = cls

    def __len__(self) -> int:
        return len(self.cells)

    # ------------------------------------------------------------------ labels (per subclass)
    def label(self, i: int) -> str:
        """A short name of cell ``i`` (``"L3H2+L4H0"``, ``"L12-L15"``...)."""
        return str(self.cells[i])

    def _index_columns(self, i: int) -> dict[str, Any]:
        """The columns that say which cell row ``i`` is (first in :meth:`to_dataframe`)."""
        return {"cell": self.label(i)}

    def _context_columns(self) -> dict[str, Any]:
        """Columns every row repeats (after the numbers): the method's settings."""
        return {}

    def _extra_columns(self) -> dict[str, list[Any]]:
        """Numeric columns only this kind of result has (one value per cell)."""
        return {}

    # ------------------------------------------------------------------ numbers
    @property
    def has_control(self) -> bool:
        """Whether a control was measured with the same cells."""
        return self.control_values is not None and self.control_baseline is not None

    @property
    def baseline_mean(self) -> float:
        """The baseline metric averaged over prompts."""
        return float(self.baseline.float().mean())

    @property
    def effects(self) -> Float[Tensor, " cell"]:
        """Mean metric under each cell's intervention minus the mean baseline."""
        return self.values.float().mean(-1) - self.baseline.float().mean()

    @property
    def control_effects(self) -> Float[Tensor, " cell"]:
        """Change of the control's loss (positive: the intervention hurts it); NaN without one."""
        if self.control_values is None or self.control_baseline is None:
            return host_full(len(self))
        return self.control_values.float().mean(-1) - self.control_baseline.float().mean()

    def effect_intervals(self) -> list[Estimate]:
        """Per cell, the effect's paired 95% percentile-bootstrap interval over prompts."""
        return _paired(self.values, self.baseline)

    def control_intervals(self) -> list[Estimate]:
        """Per cell, the control effect's paired 95% bootstrap interval over windows."""
        if self.control_values is None or self.control_baseline is None:
            return [Estimate(math.nan, math.nan, math.nan, 0, "none")] * len(self)
        return _paired(self.control_values, self.control_baseline)

    def value_intervals(self) -> list[Estimate]:
        """Per cell, the metric under the intervention with its 95% interval (Wilson for
        ``accuracy``, bootstrap over prompts otherwise)."""
        return [_value_interval(row, self.metric) for row in self.values]

    @property
    def baseline_interval(self) -> Estimate:
        """The baseline with its 95% interval (Wilson for ``accuracy``)."""
        return _value_interval(self.baseline, self.metric)

    @property
    def selectivity(self) -> Float[Tensor, " cell"]:
        """Share of the task moved minus share of the control lost, in ``[-1, 1]``.

        ``r - c`` with :func:`~gna_lens.scoring.report.specificity`'s currencies:
        ``r = clip(sign * effect / |baseline|, 0, 1)`` (``sign`` = :attr:`important_sign`: the
        share of the task lost by an ablation) and ``c = clip(1 - exp(-control_effect), 0, 1)``.
        High: the cell carries the task and not the control; about 0: both or neither. Without
        a control, ``r``.
        """
        base = self.baseline_mean
        scale = abs(base) if base and not math.isnan(base) else 1.0
        r = (self.important_sign * self.effects.double() / scale).clamp(0.0, 1.0)
        if not self.has_control:
            return r.float()
        c = (1.0 - torch.exp(-self.control_effects.double())).clamp(0.0, 1.0)
        return (r - c).float()

    def ranking(self, k: int | None = None, by: str | None = None) -> list[tuple[Any, ...]]:
        """Cells from the one that matters most for the task to the least.

        Args:
            k: How many (default all).
            by: ``None``: ``"selectivity"`` when a control was measured, else ``"effect"``;
                ``"effect"``: the task effect, most important first (ablations: most negative;
                patching: most restoring); ``"selectivity"``: highest first, ties by effect;
                ``"control"``: the control effect, largest first.

        Returns:
            The cells, e.g. ``[((16, 0),), ((18, 6),), ...]`` or ``[(17,), (16,), ...]``.
        """
        by = by or ("selectivity" if self.has_control else "effect")
        effect = (-self.important_sign * self.effects.double()).nan_to_num(nan=math.inf)
        if by == "effect":
            key = effect
        elif by == "selectivity":
            sel = self.selectivity.double().nan_to_num(nan=-math.inf)
            order = sorted(range(len(self)), key=lambda i: (-float(sel[i]), float(effect[i])))
            cells = [self.cells[i] for i in order]
            return cells if k is None else cells[:k]
        elif by == "control":
            key = -self.control_effects.double().nan_to_num(nan=-math.inf)
        else:
            raise InterventionError(
                f"ranking(by={by!r}); expected None, 'selectivity', 'effect' or 'control'."
            )
        cells = [self.cells[i] for i in torch.argsort(key, stable=True).tolist()]
        return cells if k is None else cells[:k]

    # ------------------------------------------------------------------ tables
    def to_dataframe(self) -> Any:
        """One row per cell: the cell's columns, ``kind``, ``effect`` with its 95% interval
        (``effect_low``, ``effect_high``), ``value`` with its interval, ``baseline``, the
        result's own columns, ``control_effect`` with its interval (NaN without a control) and
        ``selectivity``; then ``metric``, ``task`` and the method's settings. Every result has
        these columns, whatever its cells."""
        import pandas as pd

        effects = self.effects.tolist()
        e_iv, v_iv = self.effect_intervals(), self.value_intervals()
        extra = self._extra_columns()
        ctrl, c_iv, sel = (
            self.control_effects.tolist(),
            self.control_intervals(),
            self.selectivity.tolist(),
        )
        context = {"metric": self.metric, "task": self.task} | self._context_columns()
        rows = []
        for i in range(len(self)):
            row = self._index_columns(i) | {
                "kind": self.kinds[i],
                "effect": effects[i],
                "effect_low": e_iv[i].low,
                "effect_high": e_iv[i].high,
                "value": v_iv[i].value,
                "value_low": v_iv[i].low,
                "value_high": v_iv[i].high,
                "baseline": self.baseline_mean,
            }
            row |= {name: column[i] for name, column in extra.items()}
            row |= {
                "control_effect": ctrl[i],
                "control_low": c_iv[i].low,
                "control_high": c_iv[i].high,
                "selectivity": sel[i],
            }
            rows.append(row | context)
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-serializable (NaN as ``None``): :meth:`from_dict` reads it back."""
        out: dict[str, Any] = {"type": type(self).__name__}
        for f in fields(self):
            out[f.name] = _json(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CellResult":
        """The result :meth:`to_dict` wrote (its ``type`` names the subclass)."""
        name = data.get("type", cls.__name__)
        target = _TYPES.get(name)
        if target is None:
            raise InterventionError(
                f"from_dict: type {name!r}; expected one of {sorted(_TYPES)} (what to_dict writes)."
            )
        kw: dict[str, Any] = {}
        for f in fields(target):
            if f.name not in data:
                continue
            v = data[f.name]
            if f.name in target._TENSOR_FIELDS and v is not None:
                v = torch.tensor(_nan(v), dtype=torch.float32, device=HOST)
            elif f.name in target._TUPLE_FIELDS:
                v = _tuples(v)
            kw[f.name] = target._field_from_json(f.name, v)
        return target(**kw)

    _TENSOR_FIELDS: ClassVar[tuple[str, ...]] = (
        "values",
        "baseline",
        "control_values",
        "control_baseline",
    )
    _TUPLE_FIELDS: ClassVar[tuple[str, ...]] = ("cells", "kinds")

    @classmethod
    def _field_from_json(cls, name: str, value: Any) -> Any:
        """A subclass's own conversion of a field read back from JSON."""
        return value

    # ------------------------------------------------------------------ plot
    def plot(self, title: str | None = None) -> Any:
        """A plotly figure: the task effect per cell with its 95% interval, and the control
        effect (right axis) where measured.

        Returns:
            A ``plotly.graph_objects.Figure``.
        """
        return cell_result_figure(self, title)

    def _plot_title(self) -> str:
        return f"{type(self).__name__}: {self.task}"

    def _plot_axis(self) -> str:
        return "cell"


_TYPES["CellResult"] = CellResult


def _paired(values: Tensor, baseline: Tensor) -> list[Estimate]:
    if len(values) == 0:
        return []
    out = bootstrap_interval(values.double() - baseline.double()[None])
    assert isinstance(out, list)
    return out


def _value_interval(row: Tensor, metric: str) -> Estimate:
    row = row.double()
    row = row[~row.isnan()]
    if metric == "accuracy":
        return wilson_interval(float(row.sum()), int(row.numel()))
    return mean_interval(row)


def _json(v: Any) -> Any:
    if isinstance(v, Tensor):
        return _json(to_host(v.detach()).tolist())
    if isinstance(v, tuple | list):
        return [_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json(x) for k, x in v.items()}
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "to_dict") and hasattr(v, "columns"):  # a DataFrame
        return v.to_dict(orient="list")
    return v


def _nan(v: Any) -> Any:
    if isinstance(v, list):
        return [_nan(x) for x in v]
    return math.nan if v is None else v


def _tuples(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    return v
