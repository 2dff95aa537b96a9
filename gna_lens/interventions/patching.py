"""Activation patching of head outputs and of the residual stream, clean -> corrupted.

The corrupted prompts run with one activation taken from the paired clean prompt (sample ``i``
of each task, equal token lengths); the metric is read with the *clean* samples' answers, so
patching an activation that carries the answer moves the metric from the corrupted baseline
towards the clean one. Results have the shape of TransformerLens's
:class:`transformer_lens.patching.PatchingResult` (flat ``index_df`` mode, per-example values,
the corrupted baseline) plus the clean baseline; :meth:`PatchResult.to_patching_result` returns
the TransformerLens object itself.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.device import HOST, host_full, to_host
from gna_lens.errors import InterventionError
from gna_lens.heads import ModelLike, Subject, normalize_head_sets, require_editable
from gna_lens.interventions.ablation import (
    _label,
    cell_kind,
    head_columns,
    positions_label,
)
from gna_lens.interventions.batching import (
    Group,
    describe_task,
    length_groups,
    paired_groups,
    parse_bytes,
    tokens_of,
)
from gna_lens.interventions.engine import HookCell, SweepPlan, run_cells
from gna_lens.interventions.metrics import Metric
from gna_lens.interventions.result import CellResult
from gna_lens.interventions.runner import Runner
from gna_lens.interventions.sources import Source, check_positions, collect_z, column_mask
from gna_lens.tasks import Task

__all__ = ["PatchResult", "patch_heads", "patch_residual"]


@dataclass(frozen=True, kw_only=True)
class PatchResult(CellResult):
    """Activation-patching results: a :class:`~gna_lens.interventions.result.CellResult`
    (effects with 95% intervals, ranking, ``to_dataframe``, ``to_dict``, ``plot``) shaped like
    TransformerLens's ``PatchingResult`` too (:meth:`to_patching_result`).

    The baseline is the *corrupted* run: a positive effect is what a patch restores, and
    :meth:`ranking` puts the most restoring cell first.

    Attributes:
        cells: Per row, the head set patched (head patching) or ``(layer,)`` (residual
            patching); position by position, a cell repeats once per position (``index_df``
            has ``pos``).
        kinds: Per row, the heads' kind, or ``"resid"``.
        values: The metric on the patched corrupted run, ``[cell, batch]`` (one row of
            ``index_df`` per cell; ``batch`` = the task's samples).
        baseline: The metric on the unpatched corrupted run, ``[batch]``.
        task: The clean task's description.
        index_df: One row per cell: ``layer``, ``head`` (head patching) and ``pos`` (when
            patched position by position), ``kind``, ``label``.
        clean_baseline: The metric on the clean run, ``[batch]``.
        activation: ``"hook_z"`` or ``"hook_resid_pre"``.
        corrupted_task: The corrupted task's description.
        positions: The patched positions (``"all"``, ``"last"``, ``"each"`` or a list).
        info: Packing and forward counts, ``info["paths"]`` (which path computed the numbers)
            and ``info["fallbacks"]`` (each shortcut that did not apply, with the reason).
    """

    index_df: Any
    clean_baseline: Float[Tensor, " batch"]
    activation: str
    corrupted_task: str
    positions: str

    important_sign: ClassVar[int] = 1
    _TENSOR_FIELDS: ClassVar[tuple[str, ...]] = (*CellResult._TENSOR_FIELDS, "clean_baseline")

    # TransformerLens's PatchingResult fields (flat index_df mode, per-example values).
    axis_names: ClassVar[list[str]] = []
    reduced: ClassVar[bool] = False
    has_metric_axis: ClassVar[bool] = False
    patch_type_names: ClassVar[list[str] | None] = None

    @property
    def metric_names(self) -> list[str]:
        """``[metric]`` (TransformerLens's name)."""
        return [self.metric]

    def label(self, i: int) -> str:
        row = self.index_df.iloc[i]
        base = str(row["label"]) if "label" in row else f"L{row['layer']}"
        return f"{base}@{row['pos']}" if "pos" in row else base

    def _index_columns(self, i: int) -> dict[str, Any]:
        return {k: _plain(v) for k, v in self.index_df.iloc[i].to_dict().items()}

    def _extra_columns(self) -> dict[str, list[Any]]:
        clean = float(self.clean_baseline.float().mean())
        return {"recovered": self.recovered().tolist(), "clean_baseline": [clean] * len(self)}

    def _context_columns(self) -> dict[str, Any]:
        return {
            "activation": self.activation,
            "corrupted_task": self.corrupted_task,
            "positions": self.positions,
        }

    def _plot_axis(self) -> str:
        return f"{self.activation} patched"

    @classmethod
    def _field_from_json(cls, name: str, value: Any) -> Any:
        if name == "index_df":
            import pandas as pd

            return pd.DataFrame(value)
        return value

    def mean(self) -> Float[Tensor, " cell"]:
        """Batch mean per cell."""
        return self.values.float().mean(-1)

    def effect(self) -> Float[Tensor, "cell batch"]:
        """``values - baseline``: what each patch changes in the corrupted run, per example."""
        return self.values - self.baseline[None]

    def recovered(self) -> Float[Tensor, " cell"]:
        """Per cell, ``(mean patched - mean corrupted) / (mean clean - mean corrupted)``."""
        corrupted = float(self.baseline.float().mean())
        clean = float(self.clean_baseline.float().mean())
        return (self.mean() - corrupted) / (clean - corrupted)

    def to_patching_result(self) -> Any:
        """The same numbers as a ``transformer_lens.patching.PatchingResult``."""
        from transformer_lens.patching import PatchingResult

        return PatchingResult(
            values=self.values,
            axis_names=list(self.axis_names),
            index_df=self.index_df,
            metric_names=list(self.metric_names),
            reduced=self.reduced,
            baseline=self.baseline,
            has_metric_axis=self.has_metric_axis,
            patch_type_names=self.patch_type_names,
        )

    def to_dataframe(self, per_example: bool = False) -> Any:
        """One row per cell: the index columns, ``kind``, ``effect`` and ``value`` with their
        95% intervals, ``recovered``, ``baseline`` (corrupted), ``clean_baseline`` and the
        columns every :class:`~gna_lens.interventions.result.CellResult` has.

        ``per_example=True`` gives TransformerLens's long form instead: one row per (cell,
        example) with ``metric``, the index columns, ``example`` and ``value``.
        """
        if per_example:
            return self.to_patching_result().to_dataframe()
        return super().to_dataframe()


def _plain(v: Any) -> Any:
    """A numpy scalar from a dataframe row as a Python one."""
    return v.item() if hasattr(v, "item") and not isinstance(v, str | tuple | list) else v


def patch_heads(
    model: ModelLike,
    clean: Task,
    corrupted: Task,
    metric: Any = "logit_diff",
    *,
    heads: Any = None,
    positions: Any = None,
    pack: int | None = None,
    max_rows: int = 256,
    memory_budget: int | str = "1GiB",
    progress: bool = True,
) -> PatchResult:
    """Patch head outputs (``hook_z``) from the clean run into the corrupted run, head by head.

    Args:
        model: A TransformerBridge or a HookedSSM.
        clean: The clean task (its answers score the metric).
        corrupted: The corrupted task, sample ``i`` paired with clean sample ``i`` (same length),
            e.g. the same dictionary with another queried key.
        metric: ``"logit_diff"`` (default), ``"accuracy"``, ``"logprob"`` or a callable (see
            :func:`~gna_lens.interventions.ablation.ablation_sweep`), read with the clean answers.
        heads: ``None`` (every head), ``[(layer, head), ...]`` or head sets patched together.
        positions: ``None`` (all positions at once), ``"last"`` (the query position; computed
            incrementally from the corrupted prefix), ``"each"`` (one patch per head and position;
            needs prompts of equal length), or a list of positions patched together.
        pack: Patches per forward pass (default automatic).
        max_rows: Rows per forward pass.
        memory_budget: Bytes (or ``"2GiB"``) a forward pass may use.
        progress: Show a tqdm progress bar.

    Returns:
        A :class:`PatchResult`.

    Raises:
        InterventionError: For unpaired tasks, unknown heads or positions.
        PatternEditError: If the model would ignore edits of ``hook_z``.
    """
    subject, met, positions, groups, lengths = _paired(
        model, clean, corrupted, metric, positions, max_rows, "patch_heads"
    )
    model, view = subject.model, subject.view
    cells = normalize_head_sets(view, heads)
    cell_cols = None
    if positions == "each":
        (length,) = lengths
        cell_cols = [[p] for _ in cells for p in range(length)]
        cells = [c for c in cells for _ in range(length)]
    require_editable(model, view, sorted({layer for c in cells for layer, _ in c}), "z")
    plan = SweepPlan(parse_bytes(memory_budget), max_rows, pack)
    runner = Runner(subject)
    with torch.no_grad():
        parts = view.parts_of(h for c in cells for h in c)  # two hook_z in some hybrid layers
        # The clean run's hook_z per sample: one forward per prompt length.
        by_length = length_groups(clean, len(clean), subject.device)
        samples = collect_z(model, parts, by_length, positions == "last", len(clean))
        source = Source(
            "samples", samples=samples, last_only=positions == "last", label="clean run"
        )
        clean_base = host_full(len(clean))
        for g in groups:
            clean_base[g.indices] = to_host(met(runner.logits_last(g.tokens), g.indices))
        values, baseline, info = _run(
            runner, cells, groups, lambda g: (source, g.indices), met,
            None if cell_cols else positions, plan, corrupted, "patch heads", progress, cell_cols,
        )  # fmt: skip
    rows = [
        head_columns(cell)
        | ({"pos": cell_cols[i][0]} if cell_cols is not None else {})
        | {"kind": cell_kind(view.kind_of, cell), "label": _label(cell)}
        for i, cell in enumerate(cells)
    ]
    return _result(
        rows, clean, corrupted, positions, cells=tuple(tuple(c) for c in cells),
        kinds=tuple(r["kind"] for r in rows), values=values, baseline=baseline, metric=met.name,
        clean_baseline=clean_base, activation="hook_z", info=info,
    )  # fmt: skip


def _paired(
    model: ModelLike,
    clean: Task,
    corrupted: Task,
    metric: Any,
    positions: Any,
    max_rows: int,
    who: str,
) -> tuple[Subject, Metric, Any, list[Group], list[int]]:
    """The subject, metric, positions, paired prompt groups and prompt lengths, checked."""
    subject = Subject.of(model)
    met = Metric(metric, clean)
    positions = check_positions(positions, allow_each=True)
    if isinstance(positions, Tensor):
        raise InterventionError(f"{who}: positions must be None, 'last', 'each' or a list.")
    groups = paired_groups(clean, corrupted, max_rows, subject.device)
    lengths = sorted({g.length for g in groups})
    if positions == "each" and len(lengths) != 1:
        raise InterventionError(
            f"positions='each' needs prompts of one length; the tasks have lengths {lengths}. "
            "Fix: a task with fixed-length prompts (e.g. KV retrieval with single-token keys and "
            "values), or positions=None / 'last' / a list."
        )
    return subject, met, positions, groups, lengths


def _run(
    runner: Runner,
    cells: list[Any],
    groups: list[Group],
    source_for: Any,
    met: Metric,
    positions: Any,
    plan: SweepPlan,
    corrupted: Task,
    desc: str,
    progress: bool,
    cell_cols: Any = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """:func:`~gna_lens.interventions.engine.run_cells` on the corrupted prompts, with a bar."""
    from tqdm.auto import tqdm

    device = runner.subject.device
    n = sum(len(g) for g in groups)
    bar = tqdm(total=len(cells) * n, desc=desc, disable=not progress, leave=False)
    try:
        return run_cells(
            runner, cells, groups, source_for, met, positions, plan, "batched",
            baseline_tokens=lambda g: tokens_of(corrupted, g.indices, device), bar=bar,
            cell_cols=cell_cols,
        )  # fmt: skip
    finally:
        bar.close()


def patch_residual(
    model: ModelLike,
    clean: Task,
    corrupted: Task,
    metric: Any = "logit_diff",
    *,
    layers: Any = None,
    positions: Any = "each",
    max_rows: int = 256,
    progress: bool = True,
) -> PatchResult:
    """Patch the residual stream entering each layer (``hook_resid_pre``) from clean to corrupted.

    ``model``, ``clean``, ``corrupted``, ``metric``, ``max_rows`` and ``progress`` are those of
    :func:`patch_heads`.

    Args:
        layers: Layers to patch (default: all).
        positions: ``"each"`` (default: one patch per layer and position; prompts of equal
            length), ``None`` (all positions at once: restores the clean run exactly),
            ``"last"``, or a list of positions patched together.

    Returns:
        A :class:`PatchResult` with ``layer`` and ``pos`` in ``index_df``.
    """
    subject, met, positions, groups, lengths = _paired(
        model, clean, corrupted, metric, positions, max_rows, "patch_residual"
    )
    view = subject.view
    layers = list(range(view.n_layers)) if layers is None else list(layers)
    bad = [x for x in layers if not isinstance(x, int) or not 0 <= x < view.n_layers]
    if bad or not layers:
        raise InterventionError(
            f"layers={layers!r}; expected a non-empty list of ints in 0..{view.n_layers - 1}."
        )
    if positions == "each":
        cells = [(layer, [p]) for layer in layers for p in range(lengths[0])]
    else:
        if positions not in (None, "last"):
            for length in lengths:
                column_mask(positions, length, HOST)  # raises on out-of-range positions
        cells = [(layer, positions) for layer in layers]
    runner = Runner(subject)
    clean_base = host_full(len(clean))
    names = [view[layer].resid_pre_hook for layer in sorted(set(layers))]
    current: dict[int, dict[str, Tensor]] = {}  # the clean run of the batch being patched

    def clean_cache(g: Group) -> dict[str, Tensor]:
        key = int(g.indices[0])
        if key not in current:
            current.clear()
            lg_c, current[key] = runner.clean(g.tokens, names)
            clean_base[g.indices] = to_host(met(lg_c, g.indices))
        return current[key]

    def patched(layer: int, pos: Any) -> Callable[[Group, Tensor], Tensor]:
        def resid(g: Group, corrupted_resid: Tensor) -> Tensor:
            r = corrupted_resid.clone()
            cols = _resid_cols(pos, g.length)
            r[:, cols] = clean_cache(g)[view[layer].resid_pre_hook][:, cols]
            return r

        return resid

    hook_cells = [
        HookCell(start=layer, resid=patched(layer, pos), label=f"L{layer} {pos}")
        for layer, pos in cells
    ]
    with torch.no_grad():
        values, baseline, info = _run(
            runner, hook_cells, groups, None, met, None, SweepPlan(0, max_rows, None), corrupted,
            "patch residual", progress,
        )  # fmt: skip
    info["forwards"] += len(groups)  # the clean runs the patches are taken from
    rows = [
        {"layer": layer} | ({"pos": pos[0]} if positions == "each" else {}) for layer, pos in cells
    ]
    return _result(
        rows, clean, corrupted, positions, cells=tuple((layer,) for layer, _ in cells),
        kinds=("resid",) * len(cells), values=values, baseline=baseline, metric=met.name,
        clean_baseline=clean_base, activation="hook_resid_pre", info=info,
    )  # fmt: skip


def _resid_cols(positions: Any, length: int) -> Any:
    if positions is None:
        return slice(None)
    if positions == "last":
        return [length - 1]
    mask = column_mask(positions, length, HOST)  # raises on out-of-range positions
    assert mask is not None
    return mask.nonzero().flatten().tolist()


def _result(
    rows: list[dict[str, Any]], clean: Task, corrupted: Task, positions: Any, **fields: Any
) -> "PatchResult":
    """A :class:`PatchResult` with one flat row per patched cell."""
    import pandas as pd

    return PatchResult(
        index_df=pd.DataFrame(rows), task=describe_task(clean),
        corrupted_task=describe_task(corrupted), positions=positions_label(positions), **fields,
    )  # fmt: skip
