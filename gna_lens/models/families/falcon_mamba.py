"""FalconMamba (``FalconMambaForCausalLM``): Mamba-1 with weightless RMSNorms on ``dt``, ``B``
and ``C`` inside the mixer; config and weight names as Mamba's."""

from torch import Tensor

from gna_lens.models import ops
from gna_lens.models.families import mamba
from gna_lens.models.families.base import Family
from gna_lens.models.mixers.mamba1 import Mamba1Mixer


class FalconMambaMixer(Mamba1Mixer):
    """:class:`~gna_lens.models.mixers.Mamba1Mixer` with FalconMamba's norms on ``dt``, ``B``,
    ``C`` (RMSNorm without weight, ``eps = mixer_rms_eps``), in the forward and the step."""

    def norm_dt_B_C(self, dt_low: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        eps = self.cfg.mixer_rms_eps
        dt_low, B, C = (ops.rms_norm(t, None, eps) for t in (dt_low, B, C))
        return dt_low, B, C


FAMILY = Family(
    model_type="falcon_mamba",
    architecture="falcon_mamba",
    hf_class="FalconMambaForCausalLM",
    config_fields=mamba.config_fields,
    weight_renames=mamba.weight_renames,
    ssm_mixer=FalconMambaMixer,
)
