"""One module per mixer kind: each has its fast forward, its pattern materialization and its
single-token step (see :mod:`gna_lens.models.mixers.base` for the interface)."""

from gna_lens.models.mixers.attention import Attention
from gna_lens.models.mixers.base import RMSNorm, SSMMixer
from gna_lens.models.mixers.discrete_mamba2 import DiscreteMamba2Mixer
from gna_lens.models.mixers.mamba1 import Mamba1Mixer
from gna_lens.models.mixers.mamba2 import Mamba2Mixer
from gna_lens.models.mixers.mlp import GatedMLP, GraniteMLP, NemotronMoE, PlainMLP, make_mlp
from gna_lens.models.mixers.teacher_heads import TeacherHeadsMixer

__all__ = [
    "Attention",
    "DiscreteMamba2Mixer",
    "GatedMLP",
    "GraniteMLP",
    "Mamba1Mixer",
    "Mamba2Mixer",
    "NemotronMoE",
    "PlainMLP",
    "RMSNorm",
    "SSMMixer",
    "TeacherHeadsMixer",
    "make_mlp",
]
