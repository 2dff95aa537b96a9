"""Jamba (``JambaForCausalLM``): Mamba-1 and attention layers, each followed by a SwiGLU MLP or a
mixture of experts.

Layer ``l`` is an attention layer when ``l % attn_layer_period == attn_layer_offset`` (no RoPE),
else a Mamba-1 layer whose heads are its ``d_inner`` channels, as in Mamba; its MLP is an MoE
(``mlp_types`` ``"jamba_moe"``: top-k of the router's softmax, weights not renormalized) when
``l % expert_layer_period == expert_layer_offset`` and ``num_experts > 1``, else a SwiGLU MLP.
The Mamba-1 mixer adds RMSNorms with learned weights on ``dt``, ``B`` and ``C``. Weight names are
Bamba's.

Examples:
    >>> from gna_lens.testing import tiny_hf_config
    >>> fields = config_fields(tiny_hf_config("jamba"))
    >>> fields["layer_types"], fields["mlp_types"][:2]
    (['ssm', 'attention', 'ssm', 'ssm', 'attention'], ['gated', 'jamba_moe'])
"""

from typing import Any

from torch import Tensor

from gna_lens.models.config import UNBOUNDED_CTX, SSMConfig
from gna_lens.models.families import bamba
from gna_lens.models.families.base import Family
from gna_lens.models.mixers.base import RMSNorm
from gna_lens.models.mixers.mamba1 import Mamba1Mixer


class JambaMambaMixer(Mamba1Mixer):
    """:class:`~gna_lens.models.mixers.Mamba1Mixer` with Jamba's RMSNorms (learned weights,
    ``eps = rms_norm_eps``) on ``x_proj``'s ``dt``, ``B`` and ``C`` sections, in the forward and
    the step; ``hook_ssm_B`` / ``hook_ssm_C`` hold the normed values."""

    def __init__(self, cfg: SSMConfig):
        super().__init__(cfg)
        eps = cfg.mixer_rms_eps
        self.dt_layernorm = RMSNorm(cfg.dt_rank, eps)
        self.b_layernorm = RMSNorm(cfg.d_state, eps)
        self.c_layernorm = RMSNorm(cfg.d_state, eps)

    def norm_dt_B_C(self, dt_low: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.dt_layernorm(dt_low), self.b_layernorm(B), self.c_layernorm(C)


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a ``JambaConfig``."""
    n = int(hf_config.num_hidden_layers)
    layer_types = [
        "attention" if k == "attention" else "ssm" for k in hf_config.layers_block_type[:n]
    ]
    moe = [int(k) > 1 for k in hf_config.layers_num_experts[:n]]
    d_inner = int(hf_config.mamba_expand * hf_config.hidden_size)
    n_attn = int(hf_config.num_attention_heads)
    eps = float(hf_config.rms_norm_eps)
    return dict(
        n_ctx=int(getattr(hf_config, "max_position_embeddings", UNBOUNDED_CTX)),
        layer_types=layer_types,
        mlp_types=["jamba_moe" if m else "gated" for m in moe],
        # Mamba-1 heads: one per channel.
        n_heads=d_inner,
        d_head=1,
        d_inner=d_inner,
        d_state=int(hf_config.mamba_d_state),
        d_conv=int(hf_config.mamba_d_conv),
        dt_rank=int(hf_config.mamba_dt_rank),
        eps=eps,
        mixer_rms_eps=eps,
        conv_bias=bool(hf_config.mamba_conv_bias),
        proj_bias=bool(hf_config.mamba_proj_bias),
        residual_in_fp32=False,
        chunk_size=256,
        use_rope=False,
        n_attn_heads=n_attn,
        n_attn_kv_heads=int(hf_config.num_key_value_heads),
        n_key_value_heads=int(hf_config.num_key_value_heads),
        attn_d_head=int(getattr(hf_config, "head_dim", hf_config.hidden_size // n_attn)),
        attn_bias=False,
        d_mlp=int(hf_config.intermediate_size),
        mlp_bias=False,
        n_experts=int(hf_config.num_experts),
        n_experts_per_tok=int(hf_config.num_experts_per_tok),
        positional_embedding_type="standard",
    )


FAMILY = Family(
    model_type="jamba",
    architecture="jamba",
    hf_class="JambaForCausalLM",
    config_fields=config_fields,
    weight_renames=bamba.weight_renames,
    ssm_mixer=JambaMambaMixer,
)
