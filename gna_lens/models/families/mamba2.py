"""Mamba-2 (``Mamba2ForCausalLM``): Mamba-2 mixers between RMSNorms; weight names as Mamba's."""

from typing import Any

from gna_lens.errors import ConfigError
from gna_lens.models.families import mamba
from gna_lens.models.families.base import Family, time_step_limit
from gna_lens.models.mixers.mamba2 import Mamba2Mixer


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a ``Mamba2Config``."""
    d_inner = int(hf_config.expand * hf_config.hidden_size)
    n_heads = int(hf_config.num_heads)
    if n_heads * hf_config.head_dim != d_inner:
        raise ConfigError(
            f"Mamba2 config has num_heads={n_heads} x head_dim={hf_config.head_dim} != "
            f"expand * hidden_size = {d_inner}; HookedSSM needs the heads to tile d_inner "
            "(checkpoints with extra MLP channels in in_proj are not supported)."
        )
    return dict(
        n_heads=n_heads,
        d_head=int(hf_config.head_dim),
        d_inner=d_inner,
        d_state=hf_config.state_size,
        d_conv=hf_config.conv_kernel,
        n_groups=hf_config.n_groups,
        chunk_size=hf_config.chunk_size,
        time_step_limit=time_step_limit(hf_config.time_step_limit),
        eps=hf_config.layer_norm_epsilon,
        conv_bias=bool(hf_config.use_conv_bias),
        proj_bias=bool(hf_config.use_bias),
        residual_in_fp32=bool(hf_config.residual_in_fp32),
        d_mlp=0,
    )


FAMILY = Family(
    model_type="mamba2",
    architecture="mamba2",
    hf_class="Mamba2ForCausalLM",
    config_fields=config_fields,
    weight_renames=mamba.weight_renames,
    ssm_mixer=Mamba2Mixer,
)
