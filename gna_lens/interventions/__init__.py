"""Interventions on one head index space: ablation, sweeps, masks, patching and attribution.

Every function takes a TransformerLens ``TransformerBridge`` or a :class:`~gna_lens.HookedSSM`
(attention heads, SSM heads, both in a hybrid) and addresses heads as ``(layer, head)``
(:func:`gna_lens.heads.head_view`). Hooks exist only inside context managers, weights are never
edited, and no hook survives a call, even when the model or a metric raises.

- heads: :func:`ablate_heads` / :func:`head_ablation_hooks` (zero, mean or resample ablation),
  :func:`ablation_sweep` and :func:`control_sweep` (every head or head set, on a task or a
  control), :func:`mask_patterns` with :func:`gather_mask` / :func:`aggregate_mask`,
  :func:`patch_heads` / :func:`patch_residual` (activation patching), :func:`attribute_heads`
  (attribution patching);
- layers: :func:`remove_layers`, :func:`ablate_layers` / :func:`layer_ablation_hooks`, and the
  paper's pruning protocols :func:`layer_sweep` and :func:`prune_from_end`.

Every sweep returns a :class:`CellResult` (``SweepResult``, ``LayerSweepResult`` and
``PatchResult`` are its kinds); head sets, layers and residual patches all run on one engine,
here or sharded over Ray (``executor=``).
"""

from gna_lens.interventions.ablation import (
    SweepResult,
    ablate_heads,
    ablation_sweep,
    control_sweep,
    head_ablation_hooks,
)
from gna_lens.interventions.attribution import attribute_heads
from gna_lens.interventions.layers import (
    LayerSweepResult,
    ablate_layers,
    layer_ablation_hooks,
    layer_sweep,
    prune_from_end,
    remove_layers,
)
from gna_lens.interventions.masks import (
    aggregate_mask,
    gather_mask,
    mask_patterns,
    pattern_mask_hooks,
    stack_masks,
)
from gna_lens.interventions.patching import PatchResult, patch_heads, patch_residual
from gna_lens.interventions.result import CellResult

__all__ = [
    "CellResult",
    "LayerSweepResult",
    "PatchResult",
    "SweepResult",
    "ablate_heads",
    "ablate_layers",
    "ablation_sweep",
    "aggregate_mask",
    "attribute_heads",
    "control_sweep",
    "gather_mask",
    "head_ablation_hooks",
    "layer_ablation_hooks",
    "layer_sweep",
    "mask_patterns",
    "patch_heads",
    "patch_residual",
    "pattern_mask_hooks",
    "prune_from_end",
    "remove_layers",
    "stack_masks",
]
