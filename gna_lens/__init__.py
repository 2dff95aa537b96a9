"""gna_lens: Gather-and-Aggregate interpretability for Transformers, SSMs and hybrids.

A TransformerLens plugin. :class:`HookedSSM` runs Mamba-1, FalconMamba, Mamba-2 and Bamba
checkpoints with TransformerLens hooks and an editable implicit attention (``hook_pattern``);
:func:`load_model` returns a HookedSSM or a TransformerLens ``TransformerBridge``.
"""

from gna_lens import tasks
from gna_lens.errors import (
    ConfigError,
    GnaLensError,
    HookError,
    PatternEditError,
    TaskError,
)
from gna_lens.models import HookedSSM, SSMConfig, channel_groups, load_model

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GnaLensError",
    "HookError",
    "HookedSSM",
    "PatternEditError",
    "SSMConfig",
    "TaskError",
    "__version__",
    "channel_groups",
    "load_model",
    "tasks",
]
