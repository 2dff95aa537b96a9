"""Falcon-H1 (``FalconH1ForCausalLM``): in every layer an attention runs beside the Mamba-2 mixer
on the same normed input (``parallel_attention``), then a SwiGLU MLP; muP multipliers on the
mixer's sections, the attention's input, keys and output, the MLP and the logits; weight names as
Bamba's."""

from typing import Any

from gna_lens.errors import ConfigError
from gna_lens.models.families import bamba
from gna_lens.models.families.base import Family
from gna_lens.models.mixers.mamba2 import Mamba2Mixer


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a ``FalconH1Config``."""
    d_ssm = hf_config.mamba_d_ssm or int(hf_config.mamba_expand * hf_config.hidden_size)
    if int(hf_config.mamba_n_heads) * int(hf_config.mamba_d_head) != d_ssm:
        raise ConfigError(
            f"Falcon-H1 config has mamba_n_heads x mamba_d_head != {d_ssm}; HookedSSM needs "
            "the heads to tile the SSM width."
        )
    if not hf_config.mamba_rms_norm:
        norm = "none"
    else:
        norm = "norm_gate" if hf_config.mamba_norm_before_gate else "gated"
    falcon = dict(
        parallel_attention=True,
        mamba_norm=norm,
        embedding_multiplier=float(hf_config.embedding_multiplier),
        # Falcon-H1 multiplies the logits by lm_head_multiplier.
        logits_scaling=1.0 / float(hf_config.lm_head_multiplier),
        ssm_in_multiplier=float(hf_config.ssm_in_multiplier),
        ssm_out_multiplier=float(hf_config.ssm_out_multiplier),
        attn_in_multiplier=float(hf_config.attention_in_multiplier),
        attn_out_multiplier=float(hf_config.attention_out_multiplier),
        key_multiplier=float(hf_config.key_multiplier),
        ssm_multipliers=tuple(float(v) for v in hf_config.ssm_multipliers),
        mlp_multipliers=tuple(float(v) for v in hf_config.mlp_multipliers),
        out_proj_bias=bool(hf_config.projectors_bias),
    )
    d_inner = int(hf_config.mamba_n_heads * hf_config.mamba_d_head)
    return bamba.hybrid_fields(hf_config, d_inner=d_inner) | falcon


FAMILY = Family(
    model_type="falcon_h1",
    architecture="falcon_h1",
    hf_class="FalconH1ForCausalLM",
    config_fields=config_fields,
    weight_renames=bamba.weight_renames,
    ssm_mixer=Mamba2Mixer,
)
