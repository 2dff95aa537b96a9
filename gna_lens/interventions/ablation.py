"""Reversible head ablation (zero, mean, resample; all or chosen positions) and ablation sweeps.

Heads are addressed as ``(layer, head)`` on one index space for attention heads and SSM heads
(:mod:`gna_lens.heads`). An ablation replaces the head's slice of ``hook_z`` (the output
projection's input), through hooks that exist only inside a context manager: weights are never
touched, and no hook survives the call, even when the model or a metric raises.
"""

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.device import HOST, host_full, to_host
from gna_lens.errors import InterventionError
from gna_lens.heads import (
    Head,
    HookedModel,
    ModelLike,
    Subject,
    model_of,
    normalize_head_sets,
    require_editable,
)
from gna_lens.interventions.batching import (
    Group,
    describe_task,
    length_groups,
    parse_bytes,
    row_groups,
)
from gna_lens.interventions.engine import (
    PLANNERS,
    CellSweep,
    SweepJob,
    SweepPlan,
    run_sweeps,
)
from gna_lens.interventions.engine import plan_job as plan_job  # re-exported: older imports
from gna_lens.interventions.hooks import EMBED_HOOK, hooked
from gna_lens.interventions.metrics import Metric
from gna_lens.interventions.result import CellResult
from gna_lens.interventions.runner import Runner
from gna_lens.interventions.sources import (
    SkipBos,
    Source,
    build_source,
    check_positions,
    check_resample_pairs,
    column_mask,
    edit_positions,
    rotated,
)
from gna_lens.render.markdown import heads_label
from gna_lens.stats import spearman
from gna_lens.tasks import Task, TextControl

__all__ = [
    "SweepResult",
    "ablate_heads",
    "ablation_sweep",
    "control_sweep",
    "head_ablation_hooks",
]

HookFn = Callable[..., Tensor | None]


# ----------------------------------------------------------------------------- hooks for users
def head_ablation_hooks(
    model: ModelLike,
    heads: Sequence[Head],
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
) -> list[tuple[str, HookFn]]:
    """Hooks ``(hook_name, fn)`` that ablate ``heads``; pass them to ``model.hooks`` /
    ``run_with_hooks``.

    Args:
        model: A TransformerBridge or a HookedSSM.
        heads: ``[(layer, head), ...]``.
        mode: ``"zero"``; ``"mean"``: the head's mean output over ``reference``, taken over the
            positions that are ablated (the reference prompts' last tokens for
            ``positions="last"`` or a per-row tensor, the listed positions for a list, every
            position for ``None``), a leading BOS left out of the mean and unedited unless
            ``include_bos``; ``"resample"``: row ``b`` of the input takes the head output of
            reference row ``b % n_reference`` at the same positions (its last token for
            ``positions="last"``). The "Ablate a head" recipe works an example.
        positions: ``None`` (every position), ``"last"`` (the last column: use left padding, or
            pass per-row positions for right-padded batches), a list of positions (negative from
            the end), or a ``[batch]`` int tensor with one position per row (e.g.
            ``batch.query_positions``).
        reference: A :class:`~gna_lens.tasks.Task` or unpadded token ids ``[n, pos]`` (for
            ``"mean"`` and ``"resample"``; the reference forward passes run here, once).
        include_bos: Mean ablation only: average over (and edit) the BOS position too. In the
            reference, a BOS is a prompt's first token when it is the tokenizer's
            ``bos_token_id``; in the inputs, every position holding that token (found from
            ``hook_embed``, so a left-padded BOS too) is left unedited. Zero ablation edits every
            chosen position, BOS included (the paper's protocol); resample swaps BOS for the
            reference's BOS, the same activation in a causal model.

    Returns:
        A list of ``(hook name, hook function)`` pairs (for mean and resample ablation, also a
        read-only hook on ``hook_embed`` that finds BOS rows and self-paired rows).

    Raises:
        InterventionError: On unknown heads, modes, positions or references; at run time,
            when resample ablation would replace a row by the same prompt's own outputs.
        PatternEditError: If the model would ignore edits of ``hook_z``.
    """
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    checked = view.check_heads(heads)
    if not checked:
        raise InterventionError("heads=[] is empty; expected at least one (layer, head) pair.")
    positions = check_positions(positions)
    layers = sorted({layer for layer, _ in checked})
    require_editable(model, view, layers, "z")
    device = subject.device
    parts = view.parts_of(checked)  # one hook_z per part of a layer (two in Falcon-H1, Zamba2)
    with torch.no_grad():
        source = build_source(
            model, mode, reference, parts, positions, device, include_bos=include_bos
        )
    inputs = _InputRows(model, source, positions, device)
    hooks: list[tuple[str, HookFn]] = inputs.hooks()
    for part in parts:
        head_mask = part.hook_mask(part.local(h for lay, h in checked if lay == part.layer))
        hooks.append(
            (part.z_hook, _ablation_hook(part.z_hook, head_mask, source, positions, inputs))
        )
    return hooks


class _InputRows:
    """What the ablation hooks need to know about the input rows, read from ``hook_embed``:
    which positions hold BOS (mean ablation leaves them unedited) and which rows are the same
    prompt as their reference row (resample ablation would change nothing there)."""

    def __init__(self, model: HookedModel, source: Source, positions: Any, device: Any):
        self.source = source
        self.embed: Tensor | None = None
        self.has_hook = EMBED_HOOK in getattr(model, "hook_dict", {})
        self.bos_embed: Tensor | None = None
        self.skip_bos = (
            source.skips_bos and positions != "last" and not isinstance(positions, Tensor)
        )
        if self.skip_bos and self.has_hook:
            self.bos_embed = _embedding_of(model, int(source.bos_id or 0), device)
        self.check_self = source.kind == "samples" and bool(source.embeds)

    def hooks(self) -> list[tuple[str, HookFn]]:
        if not self.has_hook or not (self.skip_bos or self.check_self):
            return []

        def read(x: Tensor, hook: Any) -> None:
            self.embed = x.detach()

        return [(EMBED_HOOK, read)]

    def current(self, R: int, P: int) -> Tensor | None:
        e = self.embed
        return e if e is not None and tuple(e.shape[:2]) == (R, P) else None

    def bos_mask(self, R: int, P: int, device: Any) -> Tensor:
        """``[R, P]`` bool: the input positions holding the BOS token (left unedited); with
        left padding, the BOS after the padding."""
        e = self.current(R, P)
        if e is not None and self.bos_embed is not None:
            return (e == self.bos_embed.to(e)).all(-1).to(device)
        # No hook_embed: assume the inputs start with BOS where every reference prompt does.
        bos = self.source.bos_id
        every = bool(self.source.tokens) and all(t[:1] == (bos,) for t in self.source.tokens)
        mask = torch.zeros(R, P, dtype=torch.bool, device=device)
        mask[:, 0] = every and P > 1
        return mask

    def edited(self, cols: Tensor | None, positions: Any, R: int, P: int, device: Any) -> Tensor:
        """``[R, P]`` bool: the chosen columns ``cols`` (``[P]``; ``None``: all) minus the
        positions holding BOS.

        Raises:
            InterventionError: If a listed position holds an input row's BOS.
        """
        bos = self.bos_mask(R, P, device)
        if cols is not None and bool((cols[None, :] & bos).any()):
            row, col = (int(i) for i in (cols[None, :] & bos).nonzero()[0])
            raise InterventionError(
                f"positions={positions!r} include column {col}, the BOS token of input row {row}; "
                "mean ablation leaves BOS out of the mean and unedited. Fix: drop that position, "
                "or pass include_bos=True."
            )
        return ~bos if cols is None else cols[None, :] & ~bos

    def check_pairs(self, R: int, P: int, ref: Tensor, where: Any) -> None:
        if not self.check_self:
            return
        e = self.current(R, P)
        if e is None:
            return
        same = [
            b for b in range(R)
            if (r := self.source.embeds[int(ref[b])]).shape == e[b].shape
            and torch.equal(r.to(e), e[b])
        ]  # fmt: skip
        if same:
            b = same[0]
            raise InterventionError(
                f"resample ablation at {where}: input row {b} is the same prompt as "
                f"{self.source.label} row {int(ref[b])} (row b takes reference row b % "
                f"{self.source.n}), so its heads would take their own outputs and nothing would "
                f"be ablated ({len(same)} of {R} rows). Fix: a reference of other prompts (e.g. "
                "the inputs rotated by one: torch.roll(tokens, 1, dims=0)), or mode='mean'."
            )


def _embedding_of(model: HookedModel, token: int, device: Any) -> Tensor | None:
    """``hook_embed``'s output for one token (one forward pass of one token)."""
    out: dict[str, Tensor] = {}

    def read(x: Tensor, hook: Any) -> None:
        out["e"] = x[0, 0].detach().clone()

    with torch.no_grad(), hooked(model, [(EMBED_HOOK, read)]):
        model(torch.tensor([[token]], device=device))
    return out.get("e")


def _ablation_hook(
    name: str,
    head_mask: Tensor,
    source: Source,
    positions: Any,
    inputs: _InputRows,
) -> HookFn:
    """The hook on ``name`` (a ``hook_z``) replacing the heads ``head_mask`` by ``source``."""

    def hook(z: Tensor, hook: Any) -> Tensor:
        R, P, H, _ = z.shape
        if head_mask.shape[0] != H:
            raise InterventionError(
                f"{name} has {H} heads (shape {tuple(z.shape)}); the head view expected "
                f"{head_mask.shape[0]}."
            )
        where = head_mask.to(z.device)[None, None, :, None]
        if isinstance(positions, Tensor):
            pos = positions.to(z.device).long().reshape(-1)
            if pos.shape[0] != R:
                raise InterventionError(
                    f"positions is a tensor of {pos.shape[0]} per-row positions but the input "
                    f"has {R} rows; expected one position per row."
                )
            if bool(((pos < -P) | (pos >= P)).any()):
                raise InterventionError(
                    f"positions {pos.tolist()} are out of range for inputs of {P} positions "
                    f"(valid: {-P} to {P - 1}, one per row). Fix: per-row positions of the "
                    "batch you run, e.g. batch.query_positions."
                )
            rows = torch.zeros(R, P, dtype=torch.bool, device=z.device)
            rows[torch.arange(R, device=z.device), pos % P] = True
            where = where & rows[:, :, None, None]
        else:
            cols = column_mask(positions, P, z.device)
            if inputs.skip_bos:
                where = where & inputs.edited(cols, positions, R, P, z.device)[:, :, None, None]
            elif cols is not None:
                where = where & cols[None, :, None, None]
        ref = torch.arange(R, device=HOST) % max(source.n, 1)
        inputs.check_pairs(R, P, ref, name)
        value = source.value(name, ref, P, False, z)
        return torch.where(where, value, z)

    return hook


@contextmanager
def ablate_heads(
    model: ModelLike,
    heads: Sequence[Head],
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
) -> Iterator[Any]:
    """Ablate heads inside a ``with`` block; the model is untouched afterwards.

    The arguments, and the errors, are those of :func:`head_ablation_hooks`.

    Yields:
        The model, with the ablation hooks attached.

    Examples:
        >>> import torch
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("bamba")
        >>> tokens = torch.tensor([[5, 6, 7, 8]])
        >>> with torch.no_grad():
        ...     clean = model(tokens)
        ...     with ablate_heads(model, [(0, 3), (1, 0)]):
        ...         ablated = model(tokens)
        ...     again = model(tokens)
        >>> bool((ablated != clean).any()), torch.equal(again, clean)
        (True, True)
    """
    hooks = head_ablation_hooks(model, heads, mode, positions, reference, include_bos)
    with hooked(model_of(model), hooks):
        yield model_of(model)


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True, kw_only=True)
class SweepResult(CellResult):
    """The effect on a metric of ablating (or patching) each head, or each head set.

    A :class:`~gna_lens.interventions.result.CellResult` (effects with 95% intervals, ranking,
    ``to_dataframe``, ``to_dict``, ``plot``, ``info``) whose cells are head sets.

    Attributes (beyond :class:`~gna_lens.interventions.result.CellResult`'s meaning):
        cells: The head sets, one per result row (a single head is a one-element set).
        kinds: Per cell, its heads' kind, ``"attention"`` or ``"ssm"``, or ``"mixed"`` for a
            cell of both kinds.
        mode: The ablation mode (``"zero"``, ``"mean"``, ``"resample"``) or ``"patch"``.
        positions: The positions edited (``"all"``, ``"last"`` or a list).
        method: How it was computed (``"batched"``, ``"incremental"``, ``"loop"``,
            ``"attribution"``).
        info: Other details (packing, forward counts, timings), and which path computed the
            numbers: ``info["paths"]`` (``{step: [path, ...]}``) and ``info["fallbacks"]`` (each
            shortcut that did not apply to this model, with the reason; ``[]`` when none).
    """

    mode: str
    positions: str
    method: str

    def __repr__(self) -> str:
        eff = self.effects
        worst = int(eff.argmin()) if len(eff) else -1
        top = (
            f", strongest={_label(self.cells[worst])} ({float(eff[worst]):+.3f})"
            if len(eff)
            else ""
        )
        return (
            f"SweepResult({self.metric} on {self.task}, mode={self.mode!r}, "
            f"positions={self.positions!r}, cells={len(self)}, baseline={self.baseline_mean:.4f}"
            f"{top}, method={self.method!r})"
        )

    def label(self, i: int) -> str:
        return _label(self.cells[i])

    def _index_columns(self, i: int) -> dict[str, Any]:
        return head_columns(self.cells[i])

    def _context_columns(self) -> dict[str, Any]:
        return {"mode": self.mode, "positions": self.positions}

    def _extra_columns(self) -> dict[str, list[Any]]:
        return {"heads": [self.label(i) for i in range(len(self))]}

    def _plot_axis(self) -> str:
        return "heads ablated"

    def effect(self, *heads: Head) -> float:
        """The effect of the cell made of exactly ``heads``."""
        key = tuple(sorted(heads))
        for cell, e in zip(self.cells, self.effects.tolist(), strict=True):
            if tuple(sorted(cell)) == key:
                return float(e)
        raise InterventionError(
            f"no cell {list(heads)} in this result; cells are e.g. {self.cells[:3]}."
        )

    def grid(self) -> Float[Tensor, "layer head_index"]:
        """Effects of single-head cells as a ``[n_layers, max_heads]`` grid (NaN elsewhere)."""
        singles = [
            (c[0], e) for c, e in zip(self.cells, self.effects.tolist(), strict=True) if len(c) == 1
        ]
        if not singles:
            raise InterventionError("grid() needs single-head cells; this result has head sets.")
        n_layers = max(layer for (layer, _), _ in singles) + 1
        n_heads = max(h for (_, h), _ in singles) + 1
        out = host_full((n_layers, n_heads))
        for (layer, h), e in singles:
            out[layer, h] = e
        return out

    def correlation(self, other: "SweepResult") -> float:
        """Spearman correlation of the effects with ``other``'s over their common cells."""
        mine = {tuple(sorted(c)): e for c, e in zip(self.cells, self.effects.tolist(), strict=True)}
        pairs = [
            (mine[k], e)
            for c, e in zip(other.cells, other.effects.tolist(), strict=True)
            if (k := tuple(sorted(c))) in mine
        ]
        if len(pairs) < 2:
            raise InterventionError("correlation needs at least two cells in common.")
        a, b = zip(*pairs, strict=True)
        return spearman(torch.tensor(a, device=HOST), torch.tensor(b, device=HOST))


def _label(cell: Sequence[Head]) -> str:
    return heads_label(cell, "+")


def head_columns(cell: Sequence[Head]) -> dict[str, Any]:
    """A head set's ``layer`` and ``head`` columns (tuples for a set of several heads)."""
    single = len(cell) == 1
    return {
        "layer": cell[0][0] if single else tuple(lay for lay, _ in cell),
        "head": cell[0][1] if single else tuple(h for _, h in cell),
    }


def cell_kind(kind_of: Callable[[Any], str], cell: Sequence[Any]) -> str:
    """The kind of a cell's members (``kind_of`` each), or ``"mixed"``."""
    kinds = {kind_of(x) for x in cell}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def positions_label(positions: Any) -> str:
    if isinstance(positions, SkipBos):
        return positions_label(positions.positions)
    if positions is None:
        return "all"
    if isinstance(positions, str):
        return positions
    return str(list(positions))


def ablation_info(source: Source, edited: Any) -> dict[str, Any]:
    """What a result records about its replacement: for mean ablation, the positions the mean
    was taken over, how many tokens, and whether BOS was left out and unedited."""
    if source.kind != "mean":
        return {}
    return source.info | {
        "bos_unedited": isinstance(edited, SkipBos),
    }


# ----------------------------------------------------------------------------- sweep
def ablation_sweep(
    model: ModelLike,
    task: Task,
    metric: Any = "accuracy",
    heads: Any = None,
    *,
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
    method: str = "batched",
    pack: int | None = None,
    max_rows: int = 256,
    memory_budget: int | str = "1GiB",
    progress: bool = True,
    executor: Any = None,
) -> SweepResult:
    """The effect on ``metric`` of ablating each head alone (or each head set) on ``task``.

    Computed without waste: the clean residual stream below each ablated layer is cached and
    reused (runs start at the ablated layer); several ablations are packed into the batch
    dimension; with ``positions="last"`` the prompt minus its last token runs once and each
    ablation recomputes only the last token (KV cache / SSM states). The numbers equal those of
    a loop of single ablated forward passes (``method="loop"``) up to float rounding.

    ``mode``, ``reference`` and ``include_bos`` are those of :func:`head_ablation_hooks`
    (``info["mean_over"]`` says what a mean was taken over); in resample mode sample ``i`` of the
    task takes reference sample ``i % len(reference)``, and a pair of identical prompts raises.

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A :class:`~gna_lens.tasks.Task` with single-token choices (or a callable metric).
        metric: ``"accuracy"``, ``"logit_diff"``, ``"logprob"``, ``"choice_logprob"`` (see
            :class:`~gna_lens.interventions.metrics.Metric`), or
            ``fn(logits [rows, d_vocab], samples) -> [rows]`` on the query-position logits.
        heads: ``None`` (every head alone), ``[(layer, head), ...]`` (each alone), or a list of
            head sets ``[[(l, h), (l2, h2)], ...]`` (each set ablated together).
        positions: ``None`` (all positions), ``"last"`` (the query position only), or a list of
            positions (negative from the end).
        method: ``"batched"`` (default) or ``"loop"`` (one full ``run_with_hooks`` per head set
            and group of prompts: the reference the batched numbers are checked against).
        pack: Ablations per forward pass (default: as many as fit ``max_rows`` rows).
        max_rows: Rows (prompts x ablations) per forward pass.
        memory_budget: Bytes (or ``"2GiB"``) a forward pass may use; fewer rows are packed when
            a rough estimate exceeds it.
        progress: Show a tqdm progress bar.
        executor: ``None`` (this process) or a :class:`gna_lens.distributed.RayExecutor`: the
            cells (and, for large prompt sets, the prompt batches) are sharded over Ray workers,
            each holding its own copy of the model; the numbers are those of this process (see
            the "Sweeps on a Ray cluster" recipe) and ``info["executor"]`` records the workers
            and any restarts.

    Returns:
        A :class:`SweepResult` (``.to_dataframe()`` has ``layer, head, kind, effect``).

    Raises:
        InterventionError: On unknown heads, metrics, modes or positions, multi-token choices
            with a named metric, or a resample reference that pairs a prompt with itself.
        PatternEditError: If the model would ignore edits of ``hook_z``.

    Examples:
        >>> from gna_lens.tasks import kv_retrieval
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> keys = ["apple", "river", "stone", "cloud", "lamp"]
        >>> tok = word_tokenizer(["Memorize the following dictionary:",
        ...                       "The value of the key '", " is"] + keys)
        >>> model = tiny_hooked_ssm("mamba2", vocab_size=len(tok))
        >>> task = kv_retrieval(tok, n_pairs=3, n_samples=4, words=keys)
        >>> res = ablation_sweep(model, task, "logit_diff", progress=False)
        >>> list(res.to_dataframe().columns[:4]), len(res) == 2 * 8
        (['layer', 'head', 'kind', 'effect'], True)
    """

    args: dict[str, Any] = dict(
        task=task, metric=metric, mode=mode, positions=positions, reference=reference,
        include_bos=include_bos, method=method, pack=pack, max_rows=max_rows,
        memory_budget=memory_budget,
    )  # fmt: skip
    sweep, result = _run_sweep(model, heads, "ablation", args, executor, progress)
    return dataclasses.replace(result, metric=sweep.metric.name, task=describe_task(task))


def _run_sweep(
    model: ModelLike, heads: Any, kind: str, args: dict[str, Any], executor: Any, progress: bool
) -> tuple[CellSweep, SweepResult]:
    """Run a head sweep of ``kind``: its plan, and its result without ``metric`` and ``task``."""
    subject = Subject.of(model)
    cells = normalize_head_sets(subject.view, heads)
    args = args | {"cells": cells}
    ((sweep, (values, baseline, info)),) = run_sweeps(
        subject, [SweepJob(kind, args)], f"{kind} sweep", executor, progress
    )
    method = args["method"]
    if method == "batched" and sweep.positions == "last" and not info["incremental_fallbacks"]:
        method = "incremental"
    return sweep, SweepResult(
        cells=tuple(cells),
        kinds=tuple(cell_kind(subject.view.kind_of, c) for c in cells),
        values=values,
        baseline=baseline,
        metric="",
        task="",
        mode=args["mode"],
        positions=positions_label(sweep.positions),
        method=method,
        info=info,
    )


# ----------------------------------------------------------------------------- plans
def _plan_heads(
    model: ModelLike,
    cells: list[tuple[Head, ...]],
    mode: str,
    positions: Any,
    include_bos: bool,
    method: str,
    max_rows: int,
    memory_budget: int | str,
    task: Task | None = None,
    metric: Any = None,
    reference: Any = None,
    pack: int | None = None,
    control: TextControl | None = None,
    n_scored: int | None = None,
    check_edits: bool = True,
) -> CellSweep:
    """Check and plan :func:`ablation_sweep` (``task``) or :func:`control_sweep` on a text
    control (``control``); ``check_edits=False``: the workers of an executor check their copies."""
    subject = Subject.of(model)
    model, view, device = subject.model, subject.view, subject.device
    who = "ablation_sweep" if control is None else "control_sweep"
    met: Any = Metric(metric, task) if task is not None else None
    positions = sweep_positions(positions, method, who)
    if control is None:
        assert task is not None
        if pack is not None and (not isinstance(pack, int) or pack < 1):
            raise InterventionError(f"pack={pack!r}; expected a positive int or None (automatic).")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise InterventionError(f"max_rows={max_rows!r}; expected a positive int.")
        runner, groups, extra = Runner(subject), length_groups(task, max_rows, device), {}
        prompts, shift = [s.input_ids for s in task], 0
    else:
        runner, met, groups, inputs = _windows(subject, control, positions, n_scored, max_rows)
        if mode == "resample" and inputs.shape[0] < 2:
            raise InterventionError(
                f"control_sweep(mode='resample') on {control.describe()}: one window cannot be "
                "resampled from another; expected at least 2 windows."
            )
        reference = None if mode == "zero" else inputs.to(device)
        prompts, shift, extra = inputs.tolist(), int(mode == "resample"), {"n_scored": runner.keep}
    plan = SweepPlan(parse_bytes(memory_budget), max_rows, pack)
    if check_edits:
        require_editable(model, view, sorted({layer for c in cells for layer, _ in c}), "z")
    source = build_source(
        model, mode, reference, view.parts_of(h for c in cells for h in c), positions, device,
        include_bos=include_bos,
    )  # fmt: skip
    edited = edit_positions(source, positions, prompts)
    n = len(prompts)
    check_resample_pairs(prompts, source, [(i + shift) % max(source.n, 1) for i in range(n)], who)

    def source_for(g: Group) -> tuple[Source, Tensor]:
        return source, (g.indices + shift) % max(source.n, 1)

    return CellSweep(
        runner, list(cells), groups, source_for, met, edited, plan, method, n,
        extra=extra | ablation_info(source, edited),
    )  # fmt: skip


# ----------------------------------------------------------------------------- control sweep
#: Rows (positions) per block of the control's next-token loss.
NLL_ROWS = 64


class _NextTokenNLL:
    """Per-row mean NLL (nats/token) of a :class:`TextControl` window's last ``k`` tokens, from
    the logits of the input's last ``k`` positions (``[rows, d_vocab]`` for ``k == 1``)."""

    name = "nll"

    def __init__(self, tokens: Tensor, k: int):
        self.tokens = tokens
        self.k = k

    def __call__(self, logits: Tensor, idx: Tensor) -> Tensor:
        targets = self.tokens[to_host(idx.long()), -self.k :].to(logits.device).reshape(-1)
        lg = logits.reshape(len(idx) * self.k, -1)
        # In the logits' own dtype: float32 is exact; under bfloat16 autocast this is 7x faster
        # than an upcast logsumexp and rounds each token's NLL to ~3 significant digits. In
        # blocks of NLL_ROWS rows (bit-identical: each row's loss is its own): one log-softmax
        # of a whole pack (3,008 x 49,152 floats for SmolLM2) ran 2.6x slower, out of cache.
        nll = torch.cat([
            torch.nn.functional.cross_entropy(lg[i : i + NLL_ROWS], targets[i : i + NLL_ROWS],
                                              reduction="none")
            for i in range(0, len(lg), NLL_ROWS)
        ])  # fmt: skip
        return nll.float().view(len(idx), self.k).mean(-1)


def sweep_positions(positions: Any, method: Any, who: str) -> Any:
    """A sweep's ``positions`` (checked) after checking its ``method``.

    Raises:
        InterventionError: For per-row position tensors (those are for :func:`ablate_heads` on
            your own batches) or a method other than ``"batched"`` / ``"loop"``.
    """
    positions = check_positions(positions)
    if isinstance(positions, Tensor):
        raise InterventionError(
            f"{who}: positions must be None, 'last' or a list of positions (per-row tensors are "
            "for ablate_heads on your own batches)."
        )
    if method not in ("batched", "loop"):
        raise InterventionError(f"method={method!r}; expected 'batched' or 'loop'.")
    return positions


def _windows(
    subject: Subject, control: TextControl, positions: Any, n_scored: int | None, max_rows: int
) -> tuple[Runner, _NextTokenNLL, list[Group], Tensor]:
    """A text control's runner, metric (:class:`_NextTokenNLL`), groups and inputs (each window
    minus its final token); raises unless ``1 <= n_scored < seq_len``."""
    last = positions == "last"
    k = 1 if last else (n_scored or max(1, control.seq_len // 2))
    if not 1 <= k < control.seq_len or (last and k != 1):
        raise InterventionError(
            f"n_scored={n_scored} on control windows of {control.seq_len} tokens; expected "
            f"1 <= n_scored < {control.seq_len} (and 1 with positions='last'; windows of at "
            "least 2 tokens)."
        )
    inputs = control.tokens[:, :-1]
    metric = _NextTokenNLL(control.tokens, k)
    return Runner(subject, keep=k), metric, row_groups(inputs, max_rows, subject.device), inputs


def control_sweep(
    model: ModelLike,
    control: TextControl | Task,
    heads: Any = None,
    *,
    mode: str = "zero",
    positions: Any = None,
    include_bos: bool = False,
    method: str = "batched",
    n_scored: int | None = None,
    max_rows: int = 64,
    memory_budget: int | str = "1GiB",
    progress: bool = True,
    executor: Any = None,
) -> SweepResult:
    """The change in next-token loss (nats/token) on a control when each head (set) is ablated.

    The same ablation as on the task (``mode``, ``positions``), applied to text that needs no
    in-context retrieval:

    - a :class:`~gna_lens.tasks.TextControl` (prose windows): each window minus its final token
      is the input, and the loss is the mean NLL of the window's last ``n_scored`` tokens (default:
      half the window, so every scored token has at least as much context before it); with
      ``positions="last"``, the NLL of its final token (the prose analogue of the query).
      ``"mean"`` ablation takes the mean over the control's own windows (as
      :func:`head_ablation_hooks`); ``"resample"`` takes window ``i``'s head output from window
      ``i + 1``.
    - a :class:`~gna_lens.tasks.Task` (e.g. cloze questions answered from the weights): the NLL
      of each sample's answer among its choices (metric ``"choice_logprob"``, so that moving mass
      between answer formats is no knowledge effect), under the ablation of
      :func:`ablation_sweep` with ``reference=control`` for mean, and sample ``i`` resampled from
      sample ``i + 1`` for resample.

    The other arguments are those of :func:`ablation_sweep` (``max_rows``: windows x
    ablations; full-window logits are large).

    Args:
        control: The control.
        n_scored: Tokens scored at the end of each window (default ``seq_len // 2``; 1 with
            ``positions="last"``).

    Returns:
        A :class:`SweepResult` with ``metric="nll"``: ``values`` are per-window (per-sample)
        losses, ``effects`` the loss change (positive: the ablation hurts the control).

    Raises:
        InterventionError: On a control that is neither, bad positions, or a resample control
            of one window (or of identical neighbouring windows / samples).

    Examples:
        >>> from gna_lens.tasks import text_control
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> control = text_control(model.tokenizer, n_sequences=2, seq_len=16, max_unknown=1.0)
        >>> res = control_sweep(model, control, [(0, 1), (1, 2)], progress=False)
        >>> res.metric, tuple(res.values.shape)
        ('nll', (2, 2))
    """

    if isinstance(control, Task):
        reference: Task | None = None
        if mode == "resample":
            if len(control) < 2:
                raise InterventionError(
                    f"control_sweep(mode='resample') on {describe_task(control)}: one sample "
                    "cannot be resampled from another; expected at least 2 samples."
                )
            reference = rotated(control, "control_sweep")
        elif mode != "zero":
            reference = control
        res = ablation_sweep(
            model, control, "choice_logprob", heads, mode=mode, positions=positions,
            reference=reference, include_bos=include_bos, method=method, max_rows=max_rows,
            memory_budget=memory_budget, progress=progress, executor=executor,
        )  # fmt: skip
        return dataclasses.replace(res, values=-res.values, baseline=-res.baseline, metric="nll")
    if not isinstance(control, TextControl):
        raise InterventionError(
            f"control is a {type(control).__name__}; expected a gna_lens.tasks.TextControl "
            "(gna_lens.tasks.text_control(tokenizer)) or a gna_lens.tasks.Task."
        )
    args: dict[str, Any] = dict(
        control=control, mode=mode, positions=positions, include_bos=include_bos, method=method,
        n_scored=n_scored, max_rows=max_rows, memory_budget=memory_budget,
    )  # fmt: skip
    _, result = _run_sweep(model, heads, "control", args, executor, progress)
    return dataclasses.replace(result, metric="nll", task=control.describe())


PLANNERS["ablation"] = PLANNERS["control"] = _plan_heads
