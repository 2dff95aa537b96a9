"""Bamba (``BambaForCausalLM``): Mamba-2 and attention layers, each followed by a SwiGLU MLP.

:func:`hybrid_fields` is the config translation Granite 4.0 and Falcon-H1 build on.
"""

from typing import Any

from gna_lens.errors import ConfigError
from gna_lens.models.config import UNBOUNDED_CTX, SSMConfig
from gna_lens.models.families.base import Family, Renames, attention_fields, time_step_limit
from gna_lens.models.mixers.mamba2 import Mamba2Mixer


def hybrid_fields(hf_config: Any, d_inner: int | None = None) -> dict[str, Any]:
    """The SSMConfig fields of a Bamba-style hybrid config (``mamba_*`` fields, attention layers
    with default RoPE, ``layers_block_type``); ``d_inner`` defaults to
    ``mamba_expand * hidden_size``."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(
            f"HookedSSM implements default RoPE for Bamba attention layers; this config has "
            f"rope_type={rope_type!r}."
        )
    attention = attention_fields(hf_config)
    partial = float(rope.get("partial_rotary_factor", 1.0))
    if d_inner is None:
        d_inner = int(hf_config.mamba_expand * hf_config.hidden_size)
    layer_types = [
        "attention" if t in ("full_attention", "attention") else "ssm"
        for t in hf_config.layers_block_type
    ]
    return dict(
        n_ctx=int(getattr(hf_config, "max_position_embeddings", UNBOUNDED_CTX)),
        layer_types=layer_types,
        n_heads=int(hf_config.mamba_n_heads),
        d_head=int(hf_config.mamba_d_head),
        d_inner=d_inner,
        d_state=hf_config.mamba_d_state,
        d_conv=hf_config.mamba_d_conv,
        n_groups=hf_config.mamba_n_groups,
        chunk_size=hf_config.mamba_chunk_size,
        time_step_limit=time_step_limit(hf_config.time_step_limit),
        eps=hf_config.rms_norm_eps,
        conv_bias=bool(hf_config.mamba_conv_bias),
        proj_bias=bool(hf_config.mamba_proj_bias),
        residual_in_fp32=False,
        **attention,
        attn_bias=bool(hf_config.attention_bias),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rotary_dim=int(attention["attn_d_head"] * partial),
        d_mlp=int(hf_config.intermediate_size),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        gated_mlp=True,
        positional_embedding_type="rotary",
    )


#: ``model.layers.{l}.{input_layernorm, mamba | self_attn, pre_ff_layernorm, feed_forward}``
#: (Falcon-H1 shares them).
RENAMES: Renames = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blocks.\1.ln1."),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"blocks.\1.ln2."),
    (r"^model\.layers\.(\d+)\.mamba\.", r"blocks.\1.mixer."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"blocks.\1.attn."),
    (r"^model\.layers\.(\d+)\.feed_forward\.", r"blocks.\1.mlp."),
    (r"^model\.final_layernorm\.", "ln_final."),
    (r"^lm_head\.", "unembed."),
]


def weight_renames(cfg: SSMConfig) -> Renames:
    """The weight-name mapping (the same for every config)."""
    return RENAMES


FAMILY = Family(
    model_type="bamba",
    architecture="bamba",
    hf_class="BambaForCausalLM",
    config_fields=hybrid_fields,
    weight_renames=weight_renames,
    ssm_mixer=Mamba2Mixer,
)
