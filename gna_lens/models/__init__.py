"""Models: HookedSSM (Mamba-1, FalconMamba, Mamba-2, Bamba), ``load_model`` and provenance."""

from gna_lens.models.config import SUPPORTED_MODEL_TYPES, SSMConfig
from gna_lens.models.hooked_ssm import HookedSSM
from gna_lens.models.loading import load_model
from gna_lens.models.ops import channel_groups
from gna_lens.models.provenance import Provenance, provenance_of

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HookedSSM",
    "Provenance",
    "SSMConfig",
    "channel_groups",
    "load_model",
    "provenance_of",
]
