"""Nemotron-H (``NemotronHForCausalLM``): one mixer per block, of the block's own kind: Mamba-2,
attention without RoPE, a plain MLP (``relu2``) or an MoE (``layers_block_type``)."""

from typing import Any

from gna_lens.errors import ConfigError
from gna_lens.models.config import UNBOUNDED_CTX, SSMConfig
from gna_lens.models.families.base import Family, Renames, attention_fields
from gna_lens.models.mixers.mamba2 import Mamba2Mixer

#: Nemotron-H block types (``layers_block_type``) -> HookedSSM layer kind.
BLOCK_KINDS = {
    "linear_attention": "ssm",
    "mamba": "ssm",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "mlp",
}


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a ``NemotronHConfig``."""
    kinds = list(hf_config.layers_block_type)
    unknown = sorted({k for k in kinds if k not in BLOCK_KINDS})
    if unknown:
        raise ConfigError(
            f"Nemotron-H config has block types {unknown}; HookedSSM knows {sorted(BLOCK_KINDS)}."
        )
    if getattr(hf_config, "moe_latent_size", None) is not None:
        raise ConfigError(
            "Nemotron-H with moe_latent_size (latent MoE projections) is not supported yet."
        )
    act = str(hf_config.mlp_hidden_act)
    if act not in ("relu2", "silu"):
        raise ConfigError(f"Nemotron-H mlp_hidden_act={act!r}; HookedSSM knows relu2, silu.")
    n_heads, d_head = int(hf_config.mamba_num_heads), int(hf_config.mamba_head_dim)
    attention = attention_fields(hf_config)
    mlp_types = {"mlp": "plain", "moe": "moe"}
    n_experts = int(getattr(hf_config, "n_routed_experts", 0) or 0)
    return dict(
        n_ctx=int(getattr(hf_config, "max_position_embeddings", UNBOUNDED_CTX)),
        layer_types=[BLOCK_KINDS[k] for k in kinds],
        mlp_types=[mlp_types.get(k, "") for k in kinds],
        mlp_act=act,
        use_rope=False,
        n_heads=n_heads,
        d_head=d_head,
        d_inner=n_heads * d_head,
        d_state=int(hf_config.ssm_state_size),
        d_conv=int(hf_config.conv_kernel),
        n_groups=int(hf_config.n_groups),
        chunk_size=int(hf_config.chunk_size),
        # HF's Nemotron-H mixer clamps dt to (time_step_min, inf), not time_step_limit.
        time_step_limit=(float(hf_config.time_step_min), float("inf")),
        eps=float(hf_config.layer_norm_epsilon),
        conv_bias=bool(hf_config.use_conv_bias),
        proj_bias=bool(hf_config.use_bias),
        residual_in_fp32=False,
        **attention,
        attn_bias=bool(getattr(hf_config, "attention_bias", False)),
        d_mlp=int(hf_config.intermediate_size),
        mlp_bias=bool(hf_config.mlp_bias),
        n_experts=n_experts,
        n_experts_per_tok=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
        moe_d_mlp=int(getattr(hf_config, "moe_intermediate_size", 0) or 0),
        moe_shared_d_mlp=int(getattr(hf_config, "moe_shared_expert_intermediate_size", 0) or 0),
        moe_n_group=int(getattr(hf_config, "n_group", 1) or 1),
        moe_topk_group=int(getattr(hf_config, "topk_group", 1) or 1),
        moe_norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
        moe_routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)),
        positional_embedding_type="standard",
    )


def weight_renames(cfg: SSMConfig) -> Renames:
    """One ``norm`` and one ``mixer`` per block, named by the block's kind."""
    out = [
        (r"^model\.embeddings\.", "embed."),
        (r"^backbone\.embeddings\.", "embed."),
        (r"^(model|backbone)\.norm_f\.", "ln_final."),
        (r"^lm_head\.", "unembed."),
    ]
    sub = {"ssm": ("ln1", "mixer"), "attention": ("ln1", "attn"), "mlp": ("ln2", "mlp")}
    for layer, kind in enumerate(cfg.layer_types):
        norm, mod = sub[kind]
        pre = rf"^(model|backbone)\.layers\.{layer}\."
        out += [
            (pre + r"norm\.", f"blocks.{layer}.{norm}."),
            (pre + r"mixer\.", f"blocks.{layer}.{mod}."),
        ]
    return out


FAMILY = Family(
    model_type="nemotron_h",
    architecture="nemotron_h",
    hf_class="NemotronHForCausalLM",
    config_fields=config_fields,
    weight_renames=weight_renames,
    ssm_mixer=Mamba2Mixer,
)
