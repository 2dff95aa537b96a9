"""The sweep engine: every cell (a head set, maybe at some positions) on every prompt group.

Three ways to run a cell, all returning the same numbers up to float rounding:

- **loop** (``method="loop"``): one full ``run_with_hooks`` forward per cell and group: the
  reference.
- **from the ablated layer** (all / chosen positions): the clean run caches
  ``hook_resid_pre`` of every layer where a cell starts; cells then run from there. Where the
  layer exposes its heads' combined output (``out_hook``) and the output weights ``W_O``, one
  prompt's layer runs *once* for many cells: its ``hook_z`` is read, each cell's edited ``z``
  gives ``out + (z_edit - z) @ W_O`` and the batch grows from 1 to ``K`` rows right there
  (the residual add broadcasts), so neither the layers below nor the mixer of the ablated layer
  are repeated per cell. Checked once per model against the plain packed run (dropped on a
  mismatch). Otherwise ``K`` cells are packed into the batch dimension, ``G`` prompts each.
- **a shared prefix** (packed head-set cells, zero or mean ablation): where a group's prompts open
  with the same tokens (a template's first line), those positions run once per cell from a KV
  cache, not once per prompt (:class:`~gna_lens.interventions.runner.SharedPrefix`; bridge only,
  checked once per model, recorded under ``paths["prefix"]``).
- **incremental** (``positions="last"``): the prompt minus its last token runs once, each packed
  group of cells recomputes only the last token (:class:`~gna_lens.interventions.runner.Runner`).

Cells that are not head sets (layers, residual patches) are :class:`HookCell` and run on the same
scheduler from their start layer. How many cells go into one forward pass is measured, not
guessed (:class:`PackTuner`, from :data:`START_ROWS` rows up): a larger batch is not always
faster (on CPU, once a layer's activations leave the cache).
"""

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gna_lens.device import HOST, host_full, to_host
from gna_lens.errors import InterventionError
from gna_lens.heads import Head, HeadView, LayerHeads, ModelLike, head_output_weights
from gna_lens.interventions.batching import Group, plan_rows
from gna_lens.interventions.edits import col_where, edit_packed, packed_edit_hooks, part_selection
from gna_lens.interventions.metrics import Metric
from gna_lens.interventions.runner import (
    Hooks,
    PathLog,
    Runner,
    SharedPrefix,
    _attempt,
    _close,
    autocast_dtype,
    shortcut_run,
)
from gna_lens.interventions.sources import Source, column_mask


@dataclass(frozen=True)
class HookCell:
    """A cell that is not a head set: it runs from layer ``start``.

    Attributes:
        start: The first layer the cell changes; the clean run's ``hook_resid_pre`` there is
            where it starts.
        hooks: Hooks the cell runs with (e.g. a layer's ablation); the cell runs alone in its
            forward pass.
        resid: ``fn(group, resid) -> resid``: the residual entering ``start`` for the group's
            rows, from the clean (baseline) run's (e.g. residual patching). Cells of one layer
            with a ``resid`` and no ``hooks`` are packed into one forward pass.
        label: What the cell is, for errors and logs.
    """

    start: int
    hooks: tuple[tuple[str, Callable[..., Any]], ...] = ()
    resid: Callable[[Any, Tensor], Tensor] | None = None
    label: str = ""

    @property
    def packable(self) -> bool:
        return self.resid is not None and not self.hooks


#: A cell of the engine: a head set, or a :class:`HookCell`.
AnyCell = tuple[Head, ...] | HookCell

#: What a cell's logits are scored with: a task :class:`Metric`, or any per-row callable
#: ``(logits, sample indices) -> [rows]`` (e.g. the control's next-token loss).
MetricLike = Metric | Callable[[Tensor, Tensor], Tensor]


@dataclass
class SweepPlan:
    """Limits of a sweep: memory budget (bytes), rows per forward, fixed pack size or None."""

    budget: int
    max_rows: int
    pack: int | None

    def rows(self, runner: Runner, length: int, n_cached: int) -> int:
        logit_pos = runner.keep if (runner.is_ssm or runner.keep_last) else length
        return plan_rows(
            runner.model, runner.view, length, self.budget, self.max_rows, logit_pos, n_cached
        )


#: Positions a packed run must save per cell (shared prefix x (prompts - 1)) to run the prompts'
#: shared prefix once per cell: below it the extra pass costs about what it saves.
MIN_SHARED_TOKENS = 64


def shared_prefix_length(tokens: Tensor, keep: int = 1) -> int:
    """Leading positions every row of ``tokens`` ``[rows, pos]`` holds alike (leaving the last
    ``keep``), where running them once per cell saves :data:`MIN_SHARED_TOKENS`; else 0.

    Examples:
        >>> shared_prefix_length(torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]]).repeat(40, 1))
        2
    """
    if len(tokens) < 2:
        return 0
    same = (tokens == tokens[:1]).all(0).long().cumprod(0)
    P = min(int(same.sum()), tokens.shape[1] - keep)
    return P if P * (len(tokens) - 1) >= MIN_SHARED_TOKENS else 0


def shared_prefixes(prompts: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    """Per prompt length: ``(prompts of that length, positions a sweep runs once per cell)``
    (the prompts of one length are one group; :func:`shared_prefix_length`)."""
    groups: dict[int, list[list[int]]] = {}
    for ids in prompts:
        groups.setdefault(len(ids), []).append(list(ids))
    return {
        n: (len(g), shared_prefix_length(torch.tensor(g, device=HOST))) for n, g in groups.items()
    }


#: Rows (cells x prompts) of the first packed forward pass; the tuner doubles from there.
START_ROWS = 64


class PackTuner:
    """Cells per forward pass: fixed, or found by doubling while the time per cell-layer drops
    by more than 10% (within ``max_rows`` and the memory budget), from :data:`START_ROWS` rows.

    Where it starts matters: past about a hundred rows of ~50 tokens a forward's activations
    leave the CPU's caches and every elementwise pass slows, and below a few dozen the matrix
    products run under their peak; doubling only moves up. Measured per token on 2 Xeon cores
    (rows: 32 / 64 / 128 / 384): Mamba-2 130M 43 / 46 / 67 / 74 us, Mamba-1 130M 79 / 77 / 91 /
    85 us, SmolLM2-135M (22 layers) 857 / 728 / 752 / 965 us."""

    def __init__(self, fixed: int | None):
        self.fixed = fixed
        self.k = 0  # set from the rows per cell on first use
        self.best = 0
        self.best_t = math.inf
        self.done = fixed is not None

    def size(self, cap: int, rows_per_cell: int = 1) -> int:
        """Cells of ``rows_per_cell`` rows each to run next (at most ``cap``)."""
        if self.fixed is not None:
            return max(1, self.fixed)
        if not self.k:
            self.k = self.best = max(1, START_ROWS // max(1, rows_per_cell))
        return max(1, min(self.best if self.done else self.k, cap))

    def report(self, k: int, seconds: float, work: float, cap: int) -> None:
        if self.done or k != self.k:
            return
        per = seconds / max(work, 1e-9)
        if per < 0.9 * self.best_t:
            self.best_t, self.best = per, k
            if k >= cap:
                self.done = True
            else:
                self.k = min(2 * k, cap)
        else:
            self.done = True


def expand_hooks(
    view: HeadView,
    layer: int,
    W: Sequence[Tensor],
    cells: Sequence[tuple[Head, ...]],
    ref_rows: Tensor,
    source: Source,
    cols: Tensor | None,
) -> list[tuple[str, Callable[..., Tensor]]]:
    """Hooks turning one prompt's run into ``len(cells)`` rows at ``layer``'s output.

    ``W``: per part of the layer (:attr:`~gna_lens.heads.LayerHeads.parts`), its ``W_O``. Each
    part's ``hook_z`` is read and its ``out_hook`` gets every cell's edit, ``out + (z_edit - z)
    @ W_O``, growing the batch from 1 to ``K`` rows. A part that runs after the rows grew (Zamba2:
    the mixer reads the shared block's attention) has ``K`` rows already in its ``hook_z``:
    there each cell's row is edited in place, as in a packed run of one prompt.
    """
    K = len(cells)
    hooks: list[tuple[str, Callable[..., Tensor]]] = []
    for part, W_part in zip(view[layer].parts, W, strict=True):
        assert part.out_hook is not None
        sel = part_selection(cells, layer, part)
        store: dict[str, Tensor] = {}

        def read_z(
            z: Tensor, hook: Any, name: str = part.z_hook, sel: Tensor = sel, store: dict = store
        ) -> Tensor:
            if z.shape[0] == K > 1:  # an earlier part of the layer grew the batch already
                value = source.value(name, ref_rows, z.shape[1], False, z)
                return edit_packed(z, sel, value, 1, cols, f"{name} (expanded)")
            store["z"] = z
            return z

        def expand(
            out: Tensor,
            hook: Any,
            name: str = part.z_hook,
            sel: Tensor = sel,
            store: dict = store,
            W: Tensor = W_part,
        ) -> Tensor:
            z = store.pop("z", None)  # [1, P, H, d]
            if z is None:
                return out
            P = z.shape[1]
            value = source.value(name, ref_rows, P, False, z)
            where = sel.to(z.device)[:, None, None, :, None]  # [K, 1, 1, H, 1]
            if cols is not None:
                where = where & col_where(cols, z.device)
            edited = torch.where(where, value if value.ndim < 4 else value[None], z[None])
            delta = torch.einsum("kbphd,hdm->kbpm", edited - z[None], W.to(z.dtype))
            return out + delta.reshape(K, P, -1).to(out.dtype)

        hooks += [(part.z_hook, read_z), (part.out_hook, expand)]
    return hooks


def _output_weights(model: ModelLike, lh: LayerHeads) -> list[Tensor] | None:
    """``W_O`` of each part of a layer, or ``None`` where a part has no ``out_hook`` or ``W_O``."""
    if any(part.out_hook is None for part in lh.parts):
        return None
    many = lh.multipart
    out = [head_output_weights(model, lh.layer, i if many else None) for i in range(len(lh.parts))]
    return None if any(w is None for w in out) else out  # type: ignore[return-value]


def _subgroups(
    runner: Runner, cells: Sequence[AnyCell], groups: Sequence[Group], plan: SweepPlan
) -> list[tuple[Group, int]]:
    """The prompt batches a sweep runs, in order: each group split to the rows a forward pass may
    hold, with that cap (``(batch, cap)``). Depends on the model's config and the whole cell list,
    never on timing: every worker of a sharded sweep computes the same list. :class:`HookCell`
    sweeps take the groups as they come (at most ``plan.max_rows`` rows each)."""
    start_layer = _start_layers(runner.view, cells)
    hook = _hook_cells(cells)
    out = []
    for g0 in groups:
        cap = plan.max_rows if hook else plan.rows(runner, g0.length, len(set(start_layer)))
        size = max(1, min(len(g0), cap))
        for s0 in range(0, len(g0), size):
            out.append((Group(g0.indices[s0 : s0 + size], g0.tokens[s0 : s0 + size]), cap))
    return out


def _start_layers(view: HeadView, cells: Sequence[AnyCell]) -> list[int]:
    return [
        c.start
        if isinstance(c, HookCell)
        else (min(layer for layer, _ in c) if c else view.n_layers - 1)
        for c in cells
    ]


def _hook_cells(cells: Sequence[AnyCell]) -> bool:
    """Whether ``cells`` are :class:`HookCell` (all of them; a mix raises)."""
    hook = [isinstance(c, HookCell) for c in cells]
    if any(hook) and not all(hook):
        raise TypeError("internal: a sweep's cells are all head sets or all HookCells")
    return bool(hook) and all(hook)


def run_cells(
    runner: Runner,
    cells: Sequence[AnyCell],
    groups: Sequence[Group],
    source_for: Callable[[Group], tuple[Source, Tensor]] | None,
    metric: "MetricLike",
    positions: Any,
    plan: SweepPlan,
    method: str,
    baseline_tokens: Callable[[Group], Tensor] | None = None,
    bar: Any = None,
    cell_cols: Sequence[Any] | None = None,
    only: Sequence[int] | None = None,
    parts: Sequence[int] | None = None,
    memo: dict[Any, Any] | None = None,
    base_hooks: Sequence[tuple[str, Callable[..., Any]]] = (),
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Run every cell on every group; returns (values [cell, sample], baseline [sample], info).

    Args:
        runner: The model's runner.
        cells: Head sets, or :class:`HookCell` (layers, residual patches): all of one sort.
        groups: Unpadded prompt groups (equal length within a group).
        source_for: The replacement for a group and each row's reference row (head sets;
            ``None`` for :class:`HookCell` sweeps, whose cells carry their own edit).
        metric: The metric (read with each group's sample indices).
        positions: ``None``, ``"last"`` or a list (for every cell).
        plan: Limits.
        method: ``"batched"`` or ``"loop"``.
        baseline_tokens: The tokens the cells run on (default: the group's own; patching: the
            corrupted prompts).
        bar: A tqdm bar updated by prompts x cells.
        cell_cols: Per-cell positions overriding ``positions`` (patching position by position).
        only: Indices of the cells to run (default all; the others stay NaN). A sharded sweep's
            worker runs its share this way: the plan (prompt batches, rows per forward) is the
            one of the whole cell list, so each cell is computed as in one process.
        parts: Indices into :func:`_subgroups` of the prompt batches to run (default all; the
            baseline and values of the other samples stay NaN).
        memo: Kept by the caller between calls on the same sweep: the clean runs (or prefix
            states) of the prompt batches and the pack tuners are reused from it.
        base_hooks: Hooks every run has, the baseline's included (:class:`HookCell` sweeps only:
            e.g. layers removed throughout).
    """
    n = int(max(int(g.indices.max()) for g in groups)) + 1
    keep = memo is not None  # else each batch's clean run is dropped once its cells are done
    memo = {} if memo is None else memo
    ctx = _Ctx(
        runner=runner,
        cells=list(cells),
        values=host_full((len(cells), n)),
        baseline=host_full(n),
        metric=metric,
        bar=bar,
        info={"forwards": 0, "rows": 0, "incremental_fallbacks": 0, "expanded": False},
        tuners=memo.setdefault(
            "tuners", {"packed": PackTuner(plan.pack), "expand": PackTuner(plan.pack)}
        ),
        ids=list(range(len(cells))) if only is None else sorted(set(only)),
    )
    start_layer = _start_layers(runner.view, cells)
    hook = _hook_cells(cells)
    if base_hooks and not hook:
        raise TypeError("internal: base_hooks are for HookCell sweeps")
    batches = memo.get("_subgroups")
    if batches is None:
        batches = memo["_subgroups"] = _subgroups(runner, cells, groups, plan)
    for part in range(len(batches)) if parts is None else parts:
        g, cap = batches[part]
        tokens = baseline_tokens(g) if baseline_tokens is not None else g.tokens
        idx = g.indices
        if hook:
            _hook_run(ctx, g, tokens, idx, start_layer, base_hooks, method, memo, part, cap)
            if not keep:
                memo.pop(("clean", part), None)
            continue
        if source_for is None:
            raise TypeError("internal: a head-set sweep needs source_for")
        source, ref_rows = source_for(g)
        if method == "loop":
            runner.log.used("cells", "loop")
            _loop(ctx, g, tokens, source, ref_rows, idx, positions, cell_cols)
            continue
        if positions == "last":
            if ("prefix", part) not in memo:
                memo[("prefix", part)] = runner.prefix(tokens)
                ctx.info["forwards"] += 1
            logits, state = memo[("prefix", part)]
            if state is not None:
                ctx.baseline[g.indices] = to_host(metric(logits, idx))
                _steps(ctx, g, state, source, ref_rows, idx, cap)
                if not keep:
                    memo.pop(("prefix", part), None)
                continue
            ctx.info["incremental_fallbacks"] += 1
        _layers(
            ctx, g, tokens, source, ref_rows, idx, positions, cell_cols, start_layer, cap,
            memo, part,
        )  # fmt: skip
        if not keep:
            memo.pop(("clean", part), None)
            memo.pop(("prefix", part), None)
    ctx.info.update(runner.log.as_info())
    return ctx.values, ctx.baseline, ctx.info


@dataclass
class _Ctx:
    runner: Runner
    cells: list[Any]  # head sets, or HookCells
    values: Tensor
    baseline: Tensor
    metric: MetricLike
    bar: Any
    info: dict[str, Any]
    tuners: dict[str, PackTuner]
    ids: list[int]

    def store(self, chunk: Sequence[int], indices: Tensor, v: Tensor) -> None:
        rows = torch.tensor(list(chunk), device=HOST)
        self.values[rows[:, None], indices[None, :]] = to_host(v.float())
        self.info["forwards"] += 1
        self.info["rows"] += v.numel()
        if self.bar is not None:
            self.bar.update(v.numel())

    def clean(
        self, g: Group, tokens: Tensor, idx: Tensor, start: list[int], memo: dict, part: int,
        base: Hooks = (),
    ) -> dict[str, Tensor]:  # fmt: skip
        """The clean run's ``hook_resid_pre`` at each start layer (kept in ``memo`` per prompt
        batch); records the batch's baseline."""
        if ("clean", part) not in memo:
            shared, view = _SHARED.get(), self.runner.view
            if shared is None or base:
                names = [view[layer].resid_pre_hook for layer in sorted(set(start))]
                memo[("clean", part)] = self.runner.clean(tokens, names, base)
                self.info["forwards"] += 1
            else:  # every layer's, for whichever cells come next
                key = (
                    id(self.runner.model), self.runner.keep, autocast_dtype(),
                    tuple(tokens.shape), tuple(tokens.flatten().tolist()),
                )  # fmt: skip
                if key not in shared:
                    names = [view[layer].resid_pre_hook for layer in range(view.n_layers)]
                    shared[key] = self.runner.clean(tokens, names)
                    self.info["forwards"] += 1
                memo[("clean", part)] = shared[key]
        cache: dict[str, Tensor]
        logits, cache = memo[("clean", part)]
        self.baseline[g.indices] = to_host(self.metric(logits, idx))
        return cache


_SHARED: ContextVar[dict[Any, Any] | None] = ContextVar("gna_lens_clean_runs", default=None)


@contextlib.contextmanager
def shared_clean_runs() -> Iterator[None]:
    """Within the block, head-set sweeps of this process on the same prompts share one clean run
    (its ``hook_resid_pre`` at every layer): :func:`~gna_lens.scoring.score_heads`' control
    sweeps and joint walk. The caller must not change the model inside the block."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _loop(
    ctx: _Ctx,
    g: Group,
    tokens: Tensor,
    source: Source,
    ref_rows: Tensor,
    idx: Tensor,
    positions: Any,
    cell_cols: Sequence[Any] | None,
) -> None:
    runner, view = ctx.runner, ctx.runner.view
    ctx.baseline[g.indices] = to_host(ctx.metric(runner.logits_last(tokens), idx))
    ctx.info["forwards"] += 1
    for i in ctx.ids:
        cell = ctx.cells[i]
        cols = column_mask(cell_cols[i] if cell_cols else positions, g.length, HOST)
        hooks = packed_edit_hooks(view, [cell], len(g), ref_rows, source, cols)
        lg = runner._pick(runner.model.run_with_hooks(tokens, fwd_hooks=hooks))
        ctx.store([i], g.indices, ctx.metric(lg, idx)[None])


def _steps(
    ctx: _Ctx, g: Group, state: Any, source: Source, ref_rows: Tensor, idx: Tensor, cap: int
) -> None:
    runner, view, G = ctx.runner, ctx.runner.view, len(g)
    runner.log.used("cells", "incremental (last token)")
    order = ctx.ids
    K = max(1, min(cap // G, len(order)))
    if ctx.tuners["packed"].fixed is not None:
        K = ctx.tuners["packed"].fixed or 1
    for start in range(0, len(order), K):
        chunk = order[start : start + K]
        cs = [ctx.cells[i] for i in chunk] + [()] * (K - len(chunk))  # reuse the expanded state
        hooks = packed_edit_hooks(view, cs, G, ref_rows, source, None, at_last=True)
        lg = runner.step(state, K, hooks)
        v = ctx.metric(lg, idx.repeat(K)).view(K, G)[: len(chunk)]
        ctx.store(chunk, g.indices, v)


def _hook_run(
    ctx: _Ctx,
    g: Group,
    tokens: Tensor,
    idx: Tensor,
    start_layer: list[int],
    base_hooks: Sequence[tuple[str, Callable[..., Any]]],
    method: str,
    memo: dict[Any, Any],
    part: int,
    cap: int,
) -> None:
    """:class:`HookCell` cells on one prompt batch: from the clean run's residual at each start
    layer (residual cells of one layer packed), or a full forward per cell (``loop``)."""
    runner, view, G = ctx.runner, ctx.runner.view, len(g)
    base = list(base_hooks)
    cells: list[HookCell] = ctx.cells
    if method == "loop":
        runner.log.used("cells", "loop")
        ctx.baseline[g.indices] = to_host(ctx.metric(runner.logits_last(tokens, base), idx))
        ctx.info["forwards"] += 1
        for i in ctx.ids:
            if cells[i].resid is not None:
                raise TypeError("internal: residual cells run batched only")
            lg = runner.logits_last(tokens, base + list(cells[i].hooks))
            ctx.store([i], g.indices, ctx.metric(lg, idx)[None])
        return
    runner.log.used("cells", "from the start layer's cached residual")
    cache = ctx.clean(g, tokens, idx, start_layer, memo, part, base)
    K = max(1, ctx.tuners["packed"].fixed or (min(cap, START_ROWS) // G))  # see PackTuner
    for s0 in range(0, len(ctx.ids), K):
        chunk = ctx.ids[s0 : s0 + K]
        packed: dict[int, list[int]] = {}
        for i in chunk:
            if cells[i].packable:
                packed.setdefault(cells[i].start, []).append(i)
                continue
            cell = cells[i]
            resid = cache[view[cell.start].resid_pre_hook]
            if cell.resid is not None:
                resid = cell.resid(g, resid)
            lg = runner.from_layer(cell.start, resid, tokens, base + list(cell.hooks))
            ctx.store([i], g.indices, ctx.metric(lg, idx)[None])
        for layer, ids in packed.items():
            clean = cache[view[layer].resid_pre_hook]
            resid = torch.cat([cells[i].resid(g, clean) for i in ids])  # type: ignore[misc]
            lg = runner.from_layer(layer, resid, tokens, base)
            ctx.store(ids, g.indices, ctx.metric(lg, idx.repeat(len(ids))).view(len(ids), G))


def _layers(
    ctx: _Ctx,
    g: Group,
    tokens: Tensor,
    source: Source,
    ref_rows: Tensor,
    idx: Tensor,
    positions: Any,
    cell_cols: Sequence[Any] | None,
    start_layer: list[int],
    cap: int,
    memo: dict[Any, Any],
    part: int,
) -> None:
    runner, view, G = ctx.runner, ctx.runner.view, len(g)
    model = runner.model
    cache = ctx.clean(g, tokens, idx, start_layer, memo, part)
    by_key: dict[tuple[int, Any], list[int]] = {}
    for i in ctx.ids:  # cells with different positions share a run
        by_key.setdefault((start_layer[i], None), []).append(i)
    for (layer, _), ids in sorted(by_key.items(), key=lambda kv: kv[0][0]):
        run = _LayerRun(
            ctx, g, tokens, source, ref_rows, idx, layer, cap, cache, cell_cols, positions, ids
        )
        W = _output_weights(runner.subject, view[layer])  # per part of the layer
        chosen = _STRATEGY.setdefault(model, {})
        why_not = _STRATEGY_WHY.setdefault(model, {})
        strategy = "packed" if W is None else chosen.get(runner.keep > 1)
        rest = ids
        if strategy is None:
            assert W is not None
            strategy, rest, why = run.choose(W)
            chosen[runner.keep > 1] = strategy
            if why is not None:
                why_not[runner.keep > 1] = why
        why = why_not.get(runner.keep > 1) if W is not None else None
        path = "expanded at the layer's output" if strategy == "expand" else "packed"
        runner.log.fell_back("cells", path, why if strategy == "packed" else None)
        ctx.info["expanded"] = ctx.info["expanded"] or strategy == "expand"
        if strategy == "expand":
            assert W is not None
            for r in range(G):
                run.expand_all(W, rest, r)
        else:
            run.packed_all(rest)


# Per model and output kind (last position / every position): "expand" (one prompt per run, the
# ablated layer's mixer shared by the cells) or "packed" (cells x prompts per run), whichever
# measured faster per cell on first use.
_STRATEGY: "weakref.WeakKeyDictionary[Any, dict[bool, str]]" = weakref.WeakKeyDictionary()
# Why "expand" was ruled out (it does not apply, or does not reproduce "packed"); absent when it
# was only slower.
_STRATEGY_WHY: "weakref.WeakKeyDictionary[Any, dict[bool, str]]" = weakref.WeakKeyDictionary()


@dataclass
class _LayerRun:
    ctx: _Ctx
    g: Group
    tokens: Tensor
    source: Source
    ref_rows: Tensor
    idx: Tensor
    layer: int
    cap: int
    cache: dict[str, Tensor]
    cell_cols: Sequence[Any] | None
    positions: Any
    ids: list[int]

    @property
    def resid(self) -> Tensor:
        return self.cache[self.ctx.runner.view[self.layer].resid_pre_hook]

    def cols(self, chunk: Sequence[int]) -> Tensor | None:
        """Edited positions: ``[pos]`` shared, or ``[cells, pos]`` per cell."""
        if not self.cell_cols:
            return column_mask(self.positions, self.g.length, HOST)
        per = [column_mask(self.cell_cols[i], self.g.length, HOST) for i in chunk]
        full = torch.ones(self.g.length, dtype=torch.bool, device=HOST)
        return torch.stack([full if c is None else c for c in per])

    @property
    def work(self) -> int:
        return self.ctx.runner.view.n_layers - self.layer

    @functools.cached_property
    def shared_length(self) -> int:
        """The group's shared prefix (:func:`shared_prefix_length`); 0 where the edit differs by
        row (resample, patching)."""
        if self.source.kind == "samples":
            return 0
        return shared_prefix_length(self.tokens, self.ctx.runner.keep)

    def packed(self, chunk: Sequence[int], share: bool = True) -> tuple[Tensor, float]:
        """Last logits ``[k * G, V]`` of ``chunk``'s cells packed over the group's prompts
        (``share``: the prompts' shared prefix once per cell, where the runner may)."""
        runner, G, P = self.ctx.runner, len(self.g), self.shared_length if share else 0
        cs = [self.ctx.cells[i] for i in chunk]
        cols = self.cols(chunk)

        def edits(rows: int, ref: Tensor, span: slice) -> Hooks:
            part = None if cols is None else cols[..., span]
            return packed_edit_hooks(runner.view, cs, rows, ref, self.source, part)

        split = None
        if P:
            split = SharedPrefix(P, len(cs), edits(1, self.ref_rows[:1], slice(None, P)),
                                 edits(G, self.ref_rows, slice(P, None)))  # fmt: skip
        t0 = time.perf_counter()
        resid = self.resid.repeat(len(cs), 1, 1)
        lg = runner.from_layer(self.layer, resid, self.tokens, edits(G, self.ref_rows, slice(None)),
                               split)  # fmt: skip
        return lg, time.perf_counter() - t0

    def expanded(self, W: Sequence[Tensor], chunk: Sequence[int], r: int) -> tuple[Tensor, float]:
        """Last logits ``[k, V]`` of ``chunk``'s cells on prompt ``r`` alone, expanded at the
        layer's output."""
        runner, view = self.ctx.runner, self.ctx.runner.view
        one = slice(r, r + 1)
        cs = [self.ctx.cells[i] for i in chunk]
        ref = self.ref_rows[one]
        cols = self.cols(chunk)
        hooks = expand_hooks(view, self.layer, W, cs, ref, self.source, cols)
        hooks += packed_edit_hooks(view, cs, 1, ref, self.source, cols, skip_layer=self.layer)
        t0 = time.perf_counter()
        lg = runner.from_layer(self.layer, self.resid[one], self.tokens[one], hooks)
        return lg, time.perf_counter() - t0

    def choose(self, W: Sequence[Tensor]) -> tuple[str, list[int], str | None]:
        """Run the first chunk both ways (results kept), check they agree, pick the faster.

        Returns the strategy, the cells still to run, and why "expand" was ruled out (``None``
        when it applies and was merely slower).
        """
        G = len(self.g)
        # A pinned pack size packs the probe like every other chunk, so the values do not depend
        # on which layer (or, in a sharded sweep, which worker) happened to probe.
        k = min(self.ctx.tuners["packed"].size(max(1, self.cap // G), G), len(self.ids))
        chunk = self.ids[:k]
        # The runner verifies its shortcuts once per model by running both ways: do that on two
        # rows first, or the packed timing below includes it and "expand" wins when it is slower
        # (two: a residual swap that holds for one row can fail for more, as OPT's does).
        runner = self.ctx.runner
        runner.from_layer(self.layer, self.resid[:2], self.tokens[:2], [])
        lg_p, t_p = self.packed(chunk, share=False)  # expand runs no shared prefix either
        self._store_packed(chunk, lg_p)

        def expand() -> Tensor:
            with shortcut_run("expanding the cells at the layer's output"):
                return self.expanded(W, chunk, 0)[0]

        t_e, lg_e, why = math.inf, None, None
        for _ in range(2):  # two timings each, the faster counts: the machine may be shared
            t0 = time.perf_counter()
            lg_e, why = _attempt(expand)
            t_e = min(t_e, time.perf_counter() - t0)
            if lg_e is None:
                break
        if lg_e is not None:
            e, p = lg_e.reshape(k, -1), lg_p.reshape(k, G, -1)[:, 0]
            if e.shape != p.shape or not _close(e, p, 2e-6):
                diff = float((e - p).abs().max()) if e.shape == p.shape else math.nan
                why = f"expanding does not reproduce the packed run (max abs diff {diff:.2e})"
        same = lg_e is not None and why is None

        def faster() -> bool:
            # Expanding saves at most the ablated layer's mixer per cell and runs smaller
            # batches, so it must win clearly.
            return t_e / k < 0.75 * t_p / (k * G)

        if same and faster():
            # Packed is timed once more (its first run may have paid one-time costs) only when
            # that could change the choice: a second packed timing can only favour packed. On
            # the first layer of a deep model the rerun is a whole chunk of cells, paid by every
            # process (each worker of a sharded sweep).
            t_p = min(t_p, self.packed(chunk, share=False)[1])
        return ("expand" if same and faster() else "packed"), self.ids[k:], why

    def _store_packed(self, chunk: Sequence[int], lg: Tensor) -> None:
        G = len(self.g)
        v = self.ctx.metric(lg, self.idx.repeat(len(chunk))).view(len(chunk), G)
        self.ctx.store(chunk, self.g.indices, v)

    def _tuned(
        self, which: str, cap: int, ids: Sequence[int], run: Callable[..., float], rows: int
    ) -> None:
        """``run(chunk)`` (its seconds) on chunks of ``ids`` (``rows`` rows per cell) sized by the
        ``which`` tuner."""
        tuner, pos = self.ctx.tuners[which], 0
        while pos < len(ids):
            k = min(tuner.size(cap, rows), len(ids) - pos)
            tuner.report(k, run(ids[pos : pos + k]), k * self.work, cap)
            pos += k

    def packed_all(self, ids: Sequence[int]) -> None:
        def run(chunk: Sequence[int]) -> float:
            lg, dt = self.packed(chunk)
            self._store_packed(chunk, lg)
            return dt

        self._tuned("packed", max(1, self.cap // len(self.g)), ids, run, len(self.g))

    def expand_all(self, W: Sequence[Tensor], ids: Sequence[int], r: int) -> None:
        one = slice(r, r + 1)

        def run(chunk: Sequence[int]) -> float:
            lg, dt = self.expanded(W, chunk, r)
            v = self.ctx.metric(lg, self.idx[one].repeat(len(chunk))).view(len(chunk), 1)
            self.ctx.store(chunk, self.g.indices[one], v)
            return dt

        self._tuned("expand", self.cap, ids, run, 1)


# ----------------------------------------------------------------------------- plans and jobs
@dataclass(frozen=True)
class SweepJob:
    """What a worker needs to plan a sweep again on its own copy of the model: the kind (a key
    of :data:`PLANNERS`: ``"ablation"``, ``"control"``, ``"layers"``), the planner's arguments,
    and the autocast dtype in effect where the sweep was called."""

    kind: str
    args: dict[str, Any]
    autocast: torch.dtype | None = field(default_factory=autocast_dtype)


@dataclass
class CellSweep:
    """One sweep planned on one model: everything :func:`run_cells` needs.

    Built by the caller, and again by each worker of a sharded sweep (from the same
    :class:`SweepJob`), so that a worker's share of the cells runs exactly as in one process.
    Head sets and :class:`HookCell` (layers) alike.
    """

    runner: Runner
    cells: list[Any]
    groups: list[Group]
    source_for: Callable[[Group], tuple[Source, Tensor]] | None
    metric: Any
    positions: Any
    plan: SweepPlan
    method: str
    n_samples: int
    extra: dict[str, Any] = field(default_factory=dict)
    memo: dict[Any, Any] = field(default_factory=dict)
    base_hooks: Sequence[tuple[str, Callable[..., Any]]] = ()

    def batches(self) -> list[Tensor]:
        """The sample indices of each prompt batch the sweep runs (the shardable parts)."""
        out = self.memo.get("_subgroups")
        if out is None:
            out = self.memo["_subgroups"] = _subgroups(
                self.runner, self.cells, self.groups, self.plan
            )
        return [g.indices for g, _ in out]

    def batch_bytes(self) -> list[int]:
        """A rough size of what a worker keeps per prompt batch between its shares (the clean
        residual streams the cells start from)."""
        self.batches()
        d = int(getattr(self.runner.model.cfg, "d_model", 0) or 0)
        layers = len(set(self.start_layers()))
        return [layers * g.tokens.numel() * d * 4 for g, _ in self.memo["_subgroups"]]

    def start_layers(self) -> list[int]:
        """Per cell, the first layer it edits (cells of one layer share a run)."""
        return _start_layers(self.runner.view, self.cells)

    def run(
        self,
        bar: Any = None,
        only: Sequence[int] | None = None,
        parts: Sequence[int] | None = None,
        keep: bool = False,
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Values ``[cell, sample]``, baseline ``[sample]`` and info of the cells ``only`` on
        the prompt batches ``parts`` (default: all); ``keep``: reuse clean runs between calls
        (a worker's shares of one sweep)."""
        memo = self.memo if keep else None
        if keep and parts is not None:
            wanted = set(parts)
            for key in [k for k in self.memo if isinstance(k, tuple) and k[1] not in wanted]:
                del self.memo[key]  # another block of prompts: drop what the last one kept
        values, baseline, info = run_cells(
            self.runner, self.cells, self.groups, self.source_for, self.metric, self.positions,
            self.plan, self.method, bar=bar, only=only, parts=parts, memo=memo,
            base_hooks=self.base_hooks,
        )  # fmt: skip
        return values, baseline, info | self.extra


#: How each kind of :class:`SweepJob` is planned on a model: ``planner(model, **job.args)``.
#: Filled by the modules that define the sweeps (``ablation``, ``layers``) when
#: ``gna_lens.interventions`` is imported.
PLANNERS: dict[str, Callable[..., CellSweep]] = {}


def plan_job(model: ModelLike, job: SweepJob) -> CellSweep:
    """Plan ``job`` on ``model`` (a worker's copy): the same plan the caller made. The
    planners register on import of :mod:`gna_lens.interventions` (the worker imports it)."""
    planner = PLANNERS.get(job.kind)
    if planner is None:
        raise InterventionError(
            f"internal: unknown sweep kind {job.kind!r}; known: {sorted(PLANNERS)}"
        )
    return planner(model, **job.args)


def execute(
    model: ModelLike, sweep: CellSweep, job: SweepJob, executor: Any, bar: Any
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Run a planned sweep here, or through ``executor`` (its workers plan it again)."""
    if executor is None:
        return sweep.run(bar)
    run = getattr(executor, "run_sweep", None)
    if not callable(run):
        raise InterventionError(
            f"executor={type(executor).__name__}; expected None (this process) or a "
            "gna_lens.distributed.RayExecutor."
        )
    values, baseline, info = run(model, job, sweep, bar=bar)
    return values, baseline, info | sweep.extra


def run_sweeps(
    model: object, jobs: Sequence[SweepJob], desc: str, executor: Any, progress: bool
) -> list[tuple[CellSweep, tuple[Tensor, Tensor, dict[str, Any]]]]:
    """Plan each job on ``model`` (:data:`PLANNERS`) and run it here or on ``executor``, under one
    progress bar (cells x samples, ``desc``) and one path log; returns each plan with its values,
    baseline and info. ``model``: what the planners take (a subject)."""
    from tqdm.auto import tqdm

    log = PathLog()  # one log for a task and its control (this process)
    out = []
    with torch.no_grad():
        # With an executor the workers edit their own copies and check them (a probe forward
        # per layer); checking this copy too would add that to the sweep's serial time.
        sweeps = [PLANNERS[j.kind](model, **j.args, check_edits=executor is None) for j in jobs]
        bar = tqdm(
            total=sum(len(s.cells) * s.n_samples for s in sweeps),
            desc=f"{desc} ({len(sweeps[0].cells)} cells)",
            disable=not progress,
            leave=False,
        )
        try:
            for sweep, job in zip(sweeps, jobs, strict=True):
                sweep.runner.log = log
                out.append((sweep, execute(sweep.runner.model, sweep, job, executor, bar)))
        finally:
            bar.close()
    return out
