"""Attribution patching: a gradient-based linear estimate of every head's ablation (or patching)
effect from one forward and one backward pass.

For a head output ``z`` replaced by ``z'`` the metric changes by about
``Σ_{pos, d} (z' - z) · ∂metric/∂z``, the gradient taken on the unedited run (Nanda 2023,
"Attribution Patching"). With ``z' = 0`` (zero ablation), the reference mean (mean ablation) or the
clean run's ``z`` (patching into the corrupted run), all heads of all layers are ranked in:

- ablation: 1 forward + 1 backward (about 3 forward-equivalents), plus one pass over the
  reference for mean ablation;
- patching: 1 clean forward + 1 corrupted forward + 1 backward (about 4).

The estimate is exact for heads whose effect on the metric is linear and degrades with
non-linearity (softmax saturation, LayerNorm). :meth:`SweepResult.correlation` compares it with
exact ablation (:func:`~gna_lens.interventions.ablation.ablation_sweep`).
"""

from typing import Any

import torch
from torch import Tensor

from gna_lens.device import host_full, to_host
from gna_lens.errors import InterventionError
from gna_lens.heads import HookedModel, ModelLike, Subject, normalize_head_sets, require_editable
from gna_lens.interventions.ablation import (
    SweepResult,
    ablation_info,
    cell_kind,
    positions_label,
)
from gna_lens.interventions.batching import describe_task, length_groups, paired_groups, tokens_of
from gna_lens.interventions.hooks import bind, hooked
from gna_lens.interventions.metrics import Metric
from gna_lens.interventions.sources import (
    build_source,
    check_positions,
    column_mask,
    edit_positions,
)
from gna_lens.tasks import Task

__all__ = ["attribute_heads"]


def attribute_heads(
    model: ModelLike,
    task: Task,
    metric: Any = "logit_diff",
    *,
    corrupted: Task | None = None,
    heads: Any = None,
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
    batch_size: int = 16,
) -> SweepResult:
    """Estimate every head's ablation (or patching) effect with one backward pass.

    ``positions``, ``reference`` and ``include_bos`` are those of
    :func:`~gna_lens.interventions.ablation.head_ablation_hooks` (``positions``: no tensors).

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: The task (single-token choices for a named metric). With ``corrupted``, the clean
            task whose answers score the metric.
        metric: A differentiable metric: ``"logit_diff"`` (default), ``"logprob"``, or a callable
            ``fn(logits [rows, d_vocab], samples) -> [rows]``. ``"accuracy"`` has no gradient.
        corrupted: If given, estimate patching clean -> corrupted (as
            :func:`~gna_lens.interventions.patching.patch_heads`) instead of ablation.
        heads: ``None`` (every head), ``[(layer, head), ...]`` or head sets (estimates add up).
        mode: Ablation replacement, ``"zero"`` or ``"mean"`` (``reference`` needed). Resample
            ablation is estimated as patching with ``corrupted``.
        batch_size: Prompts per forward/backward pass.

    Returns:
        A :class:`~gna_lens.interventions.ablation.SweepResult` with ``method="attribution"``:
        ``values`` = baseline + estimated effect, per sample; ``info["forward_equivalents"]``
        counts the cost (a backward pass counted as two forwards).

    Raises:
        InterventionError: For a non-differentiable metric, unknown heads or modes.
        PatternEditError: If the model would ignore edits of ``hook_z``.
    """
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    net: Any = model  # the model's own extras (SSM mixers, pattern selection)
    cells = normalize_head_sets(view, heads)
    met = Metric(metric, task)
    if not met.differentiable:
        raise InterventionError(
            f"attribute_heads: metric={metric!r} has no gradient; expected 'logit_diff', "
            "'logprob' or a differentiable callable. (Rank with the logit difference, then check "
            "accuracy with ablation_sweep on the top heads.)"
        )
    positions = check_positions(positions)
    if isinstance(positions, Tensor):
        raise InterventionError("attribute_heads: positions must be None, 'last' or a list.")
    if mode not in ("zero", "mean"):
        raise InterventionError(
            f"attribute_heads: mode={mode!r}; expected 'zero' or 'mean' (estimate resampling with "
            "corrupted=... instead)."
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InterventionError(f"batch_size={batch_size!r}; expected a positive int.")
    layers = sorted({layer for c in cells for layer, _ in c})
    require_editable(model, view, layers, "z")
    # The hook_z of each part of those layers holding a head of the cells (Falcon-H1 and Zamba2
    # layers have two), keyed by name.
    parts = {part.z_hook: part for part in view.parts_of(h for c in cells for h in c)}
    device = subject.device
    n = len(task)
    source, edited = None, positions
    if corrupted is not None:
        groups = paired_groups(task, corrupted, batch_size, device)
    else:
        groups = length_groups(task, batch_size, device)
        with torch.no_grad():
            source = build_source(
                model, mode, reference, list(parts.values()), positions, device,
                include_bos=include_bos,
            )  # fmt: skip
        edited = edit_positions(source, positions, [s.input_ids for s in task])
    # Per (layer, head): per-sample estimate.
    est = {layer: host_full((n, view[layer].n_heads), 0.0) for layer in layers}
    baseline = host_full(n)
    forwards = float(source.forwards) if source is not None else 0.0  # the reference's passes
    leaves: dict[str, Tensor] = {}  # per prompt batch: the zero leaves added to each hook_z
    acts: dict[str, Tensor] = {}  # and the hook_z themselves

    def grab(z: Tensor, hook: Any, name: str) -> Tensor:
        leaves[name] = leaf = torch.zeros_like(z, requires_grad=True)
        acts[name] = z.detach()
        return z + leaf

    hooks: list[tuple[Any, Any]] = [(name, bind(grab, name=name)) for name in parts]
    for g in groups:
        tokens = g.tokens if corrupted is None else tokens_of(corrupted, g.indices, device)
        clean_z: dict[str, Tensor] = {}
        if corrupted is not None:
            with torch.no_grad():
                clean_z = _collect(model, list(parts), layers, g.tokens)
            forwards += 1
        with torch.enable_grad(), hooked(model, hooks):
            logits = net(tokens)[:, -1]
            values = met(logits, g.indices)
            grads = torch.autograd.grad(values.sum(), [leaves[name] for name in parts])
        forwards += 3
        baseline[g.indices] = to_host(values.float())
        for (name, part), grad in zip(parts.items(), grads, strict=True):
            z = acts[name]
            if corrupted is not None:
                delta = clean_z[name] - z
            else:
                assert source is not None
                value = source.value(name, g.indices, z.shape[1], False, z)
                delta = value - z
            cols = column_mask(edited, z.shape[1], z.device)
            if cols is not None:
                delta = delta * cols[None, :, None, None]
            contrib = to_host((delta * grad).sum(dim=(1, 3)).float())  # [G, n_channels]
            if part.channels is not None:  # Mamba-1 channel groups: sum their channels
                contrib = contrib @ part.membership().T
            heads = slice(part.offset, part.offset + part.n_heads)  # the layer's indices
            est[part.layer][g.indices, heads] = contrib
    values_out = torch.stack(
        [
            baseline + sum((est[layer][:, h] for layer, h in cell), host_full(n, 0.0))
            for cell in cells
        ]
    )
    return SweepResult(
        cells=tuple(cells),
        kinds=tuple(cell_kind(view.kind_of, c) for c in cells),
        values=values_out,
        baseline=baseline,
        metric=met.name,
        task=describe_task(task),
        mode="patch" if corrupted is not None else mode,
        positions=positions_label(positions),
        method="attribution",
        info={
            "forward_equivalents": forwards / max(1, len(groups)),
            "groups": len(groups),
            "paths": {"gradient": [_gradient_path(subject)]},
            "fallbacks": [],
        }
        | (ablation_info(source, edited) if source is not None else {}),
    )


def _gradient_path(subject: Subject) -> str:
    """How the backward pass runs, for ``info["paths"]`` (the model says, where it can)."""
    describe = getattr(subject.model, "gradient_path", None) if subject.is_ssm else None
    return describe() if callable(describe) else "the model's own forward"


def _collect(
    model: HookedModel, names: list[str], layers: list[int], tokens: Tensor
) -> dict[str, Tensor]:
    """The clean run's ``hook_z`` of ``names`` (in ``layers``), keyed by name."""
    out: dict[str, Tensor] = {}

    def keep(z: Tensor, hook: Any, name: str) -> None:
        out[name] = z.clone()

    with hooked(model, [(name, bind(keep, name=name)) for name in names]):
        model(tokens, **({"stop_at_layer": max(layers) + 1} if layers else {}))
    return out
