"""gna_lens: Gather-and-Aggregate interpretability for Transformers, SSMs and hybrids.

A TransformerLens plugin. :class:`HookedSSM` runs Mamba-1, FalconMamba, Mamba-2 and the hybrid
(Bamba, Nemotron-H, Granite 4.0, Falcon-H1, Jamba, Zamba2) checkpoints with TransformerLens hooks
and an editable implicit attention (``hook_pattern``); :func:`load_model` returns a HookedSSM or a
TransformerLens ``TransformerBridge``. Every function below addresses attention heads and SSM
heads alike as ``(layer, head)``.
"""

import importlib
from typing import Any

from gna_lens import tasks
from gna_lens.distributed import RayExecutor
from gna_lens.errors import (
    ConfigError,
    GnaLensError,
    GnaLensWarning,
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

#: Public subpackages and modules reachable as ``gna_lens.<name>``. Those not imported above load
#: on first access (PEP 562), so ``import gna_lens`` stays as fast as before.
_SUBMODULES = frozenset(
    {
        "device",
        "distributed",
        "errors",
        "findings",
        "heads",
        "hybrid",
        "interventions",
        "lm_eval",
        "models",
        "plots",
        "runtime",
        "scan",
        "scoring",
        "stats",
        "tasks",
        "testing",
        "zoo",
    }
)


def __getattr__(name: str) -> Any:
    """``gna_lens.zoo``, ``gna_lens.plots``, ...: import a public submodule on first access."""
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}. Public names: gna_lens.__all__; "
        f"public submodules: {sorted(_SUBMODULES)}."
    )


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES)


__all__ = [
    "ConfigError",
    "GnaLensError",
    "GnaLensWarning",
    "GnaReport",
    "HookError",
    "HookedSSM",
    "InterventionError",
    "PatternEditError",
    "RayExecutor",
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
