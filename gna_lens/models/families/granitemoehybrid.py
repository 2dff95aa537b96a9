"""Granite 4.0 hybrid (``GraniteMoeHybridForCausalLM``): Bamba-style layers with Granite's
multipliers (embeddings, residual branches, attention scale, logits) and its MLP: a shared SwiGLU
MLP plus routed experts when the config has any (``mlp_types`` ``"granite"`` /
``"granite_moe"``)."""

from typing import Any

from gna_lens.models.config import SSMConfig
from gna_lens.models.families.bamba import hybrid_fields
from gna_lens.models.families.base import Family, Renames
from gna_lens.models.mixers.mamba2 import Mamba2Mixer


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a ``GraniteMoeHybridConfig``."""
    n_exp = int(getattr(hf_config, "num_local_experts", 0) or 0)
    granite = dict(
        mlp_types=["granite_moe" if n_exp else "granite"] * hf_config.num_hidden_layers,
        use_rope=getattr(hf_config, "position_embedding_type", None) == "rope",
        attn_scale=float(hf_config.attention_multiplier),
        embedding_multiplier=float(hf_config.embedding_multiplier),
        residual_multiplier=float(hf_config.residual_multiplier),
        logits_scaling=float(hf_config.logits_scaling),
        n_experts=n_exp,
        n_experts_per_tok=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
        moe_shared_d_mlp=int(hf_config.shared_intermediate_size),
    )
    return hybrid_fields(hf_config) | granite


#: ``model.layers.{l}.{input_layernorm, mamba | self_attn, post_attention_layernorm,
#: shared_mlp, block_sparse_moe}``.
RENAMES: Renames = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blocks.\1.ln1."),
    (r"^model\.layers\.(\d+)\.mamba\.", r"blocks.\1.mixer."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"blocks.\1.attn."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blocks.\1.ln2."),
    (r"^model\.layers\.(\d+)\.(shared_mlp|block_sparse_moe)\.", r"blocks.\1.mlp.\2."),
    (r"^model\.norm\.", "ln_final."),
    (r"^lm_head\.", "unembed."),
]


def weight_renames(cfg: SSMConfig) -> Renames:
    """The weight-name mapping (the same for every config)."""
    return RENAMES


FAMILY = Family(
    model_type="granitemoehybrid",
    architecture="granitemoehybrid",
    hf_class="GraniteMoeHybridForCausalLM",
    config_fields=config_fields,
    weight_renames=weight_renames,
    ssm_mixer=Mamba2Mixer,
)
