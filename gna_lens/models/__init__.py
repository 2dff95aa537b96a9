"""Models: HookedSSM (Mamba-1, FalconMamba, Mamba-2, hybrids and Llamba), ``load_model`` and
provenance.

Layout: ``mixers/`` (one module per mixer kind), ``families/`` (one module per Hugging Face
family and their registry), ``block.py`` and ``hooked_ssm.py`` (the model that assembles them).
"""

from gna_lens.models.config import SSMConfig
from gna_lens.models.families import SUPPORTED_MODEL_TYPES
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
