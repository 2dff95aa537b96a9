"""gna_lens: Gather-and-Aggregate interpretability for Transformers, SSMs and hybrids.

A TransformerLens plugin. :class:`HookedSSM` runs Mamba-1, FalconMamba, Mamba-2 and Bamba
checkpoints with TransformerLens hooks and an editable implicit attention (``hook_pattern``);
:func:`load_model` returns a HookedSSM or a TransformerLens ``TransformerBridge``. Every function
below addresses attention heads and SSM heads alike as ``(layer, head)``.
"""

from gna_lens import tasks
from gna_lens.errors import (
    ConfigError,
    GnaLensError,
    HookError,
    InterventionError,
    PatternEditError,
    TaskError,
)
from gna_lens.heads import head_view
from gna_lens.interventions import (
    ablate_heads,
    ablation_sweep,
    aggregate_mask,
    attribute_heads,
    gather_mask,
    layer_sweep,
    mask_patterns,
    patch_heads,
    remove_layers,
)
from gna_lens.models import HookedSSM, SSMConfig, channel_groups, load_model
from gna_lens.scoring import (
    GnaReport,
    find_gna_pairs,
    retrieval_vs_knowledge,
    score_heads,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GnaLensError",
    "GnaReport",
    "HookError",
    "HookedSSM",
    "InterventionError",
    "PatternEditError",
    "SSMConfig",
    "TaskError",
    "__version__",
    "ablate_heads",
    "ablation_sweep",
    "aggregate_mask",
    "attribute_heads",
    "channel_groups",
    "find_gna_pairs",
    "gather_mask",
    "head_view",
    "layer_sweep",
    "load_model",
    "mask_patterns",
    "patch_heads",
    "remove_layers",
    "retrieval_vs_knowledge",
    "score_heads",
    "tasks",
]
