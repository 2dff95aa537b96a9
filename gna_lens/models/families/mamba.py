"""Mamba-1 (``MambaForCausalLM``, model_type ``mamba``): Mamba-1 mixers between RMSNorms.

Every layer is an SSM layer (no MLP); its heads are the ``d_inner`` channels.

Examples:
    >>> from gna_lens.testing import tiny_hf_config
    >>> fields = config_fields(tiny_hf_config("mamba1"))
    >>> fields["n_heads"] == fields["d_inner"], fields["d_head"]
    (True, 1)
"""

from typing import Any

from gna_lens.models.config import SSMConfig
from gna_lens.models.families.base import Family, Renames
from gna_lens.models.mixers.mamba1 import Mamba1Mixer


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a ``MambaConfig`` (also FalconMamba's)."""
    d_inner = int(hf_config.intermediate_size)
    return dict(
        n_heads=d_inner,
        d_head=1,
        d_inner=d_inner,
        d_state=hf_config.state_size,
        d_conv=hf_config.conv_kernel,
        dt_rank=int(hf_config.time_step_rank),
        eps=hf_config.layer_norm_epsilon,
        mixer_rms_eps=float(getattr(hf_config, "mixer_rms_eps", 1e-6)),
        conv_bias=bool(hf_config.use_conv_bias),
        proj_bias=bool(hf_config.use_bias),
        residual_in_fp32=bool(hf_config.residual_in_fp32),
        chunk_size=256,
        d_mlp=0,
    )


#: ``backbone.*`` names (Mamba, FalconMamba and Mamba-2 share them).
RENAMES: Renames = [
    (r"^backbone\.embeddings\.", "embed."),
    (r"^backbone\.layers\.(\d+)\.norm\.", r"blocks.\1.ln1."),
    (r"^backbone\.layers\.(\d+)\.mixer\.", r"blocks.\1.mixer."),
    (r"^backbone\.norm_f\.", "ln_final."),
    (r"^lm_head\.", "unembed."),
]


def weight_renames(cfg: SSMConfig) -> Renames:
    """The weight-name mapping (the same for every config)."""
    return RENAMES


FAMILY = Family(
    model_type="mamba",
    architecture="mamba1",
    hf_class="MambaForCausalLM",
    config_fields=config_fields,
    weight_renames=weight_renames,
    ssm_mixer=Mamba1Mixer,
)
