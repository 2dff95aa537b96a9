"""Configuration of :class:`~gna_lens.models.HookedSSM`, converted from Hugging Face configs."""

from dataclasses import dataclass, field
from typing import Any

from transformer_lens.config import TransformerLensConfig

from gna_lens.errors import ConfigError

#: Hugging Face ``model_type`` -> HookedSSM architecture.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "mamba": "mamba1",
    "falcon_mamba": "falcon_mamba",
    "mamba2": "mamba2",
    "bamba": "bamba",
    "nemotron_h": "nemotron_h",
    "granitemoehybrid": "granitemoehybrid",
    "falcon_h1": "falcon_h1",
}

#: Nemotron-H block types (``layers_block_type``) -> HookedSSM layer kind.
_NEMOTRON_KINDS = {
    "linear_attention": "ssm",
    "mamba": "ssm",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "mlp",
}

#: Context length reported for pure SSMs, which have no positional limit.
UNBOUNDED_CTX = 1 << 20


@dataclass
class SSMConfig(TransformerLensConfig):
    """Configuration of a HookedSSM, in TransformerLens vocabulary.

    ``n_heads`` / ``d_head`` describe the SSM heads that ``hook_pattern`` and ``hook_z`` index:
    Mamba-2 heads, or for Mamba-1 one "head" per channel (``n_heads = d_inner``, ``d_head = 1``).
    In a hybrid, attention layers have ``n_attn_heads`` heads of size ``attn_d_head``; use
    :meth:`layer_n_heads` and :attr:`layer_types` for per-layer head counts.

    Attributes:
        architecture: ``"mamba1"``, ``"falcon_mamba"``, ``"mamba2"``, ``"bamba"``,
            ``"nemotron_h"``, ``"granitemoehybrid"`` or ``"falcon_h1"``.
        layer_types: Per layer, ``"ssm"``, ``"attention"`` or ``"mlp"`` (a block with only an
            MLP, Nemotron-H).
        mlp_types: Per layer, the MLP of the block: ``""`` (none), ``"gated"`` (SwiGLU),
            ``"plain"`` (``down(act(up(x)))``) or ``"moe"`` (routed experts plus a shared
            expert). Empty: ``"gated"`` on every layer of a Bamba, none elsewhere.
        mlp_act: Activation of ``"plain"`` MLPs and experts: ``"silu"`` or ``"relu2"``.
        use_rope: Whether attention layers rotate queries and keys (Nemotron-H does not).
        attn_scale: Attention score scale; 0 means ``attn_d_head ** -0.5``.
        embedding_multiplier, residual_multiplier, logits_scaling: Granite's multipliers (the
            embeddings are multiplied, each block's mixer and MLP outputs are multiplied before
            ``hook_*_out``, and the logits are divided by ``logits_scaling``).
        parallel_attention: Falcon-H1: every ``"ssm"`` layer also runs an attention
            (``blocks.{l}.attn``) on the same normed input; both outputs are added to the
            residual stream (``hook_mixer_out`` and ``hook_attn_out``).
        ssm_in_multiplier, ssm_out_multiplier, attn_in_multiplier, attn_out_multiplier,
            key_multiplier, ssm_multipliers, mlp_multipliers: Falcon-H1's multipliers (the
            mixer's input / output, the attention's input / output and keys, the muP vector on
            the sections ``z, x, B, C, dt`` of ``in_proj``, the MLP's gate and down projection).
        mamba_norm: Mamba-2 output norm: ``"gated"`` (``norm(y * SiLU(z))``), ``"norm_gate"``
            (``norm(y) * SiLU(z)``) or ``"none"`` (``y * SiLU(z)``, no norm weight).
        out_proj_bias: Bias of the mixer's ``out_proj`` (``None``: ``proj_bias``).
        d_inner: SSM inner width ``E = expand * d_model``.
        d_state: State size ``N``.
        d_conv: Causal convolution width.
        dt_rank: Mamba-1 low-rank width of ``dt``.
        n_groups: Mamba-2 groups sharing ``B`` and ``C``.
        chunk_size: Chunk length of the fast scans (does not change results beyond rounding).
    """

    d_model: int = 0
    d_head: int = 1
    n_layers: int = 0
    n_ctx: int = UNBOUNDED_CTX
    architecture: str = "mamba2"
    hf_architecture: str = ""
    model_name: str = ""
    layer_types: list[str] = field(default_factory=list)
    d_inner: int = 0
    d_state: int = 16
    d_conv: int = 4
    dt_rank: int = 0
    n_groups: int = 1
    chunk_size: int = 256
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    mixer_rms_eps: float = 1e-6
    conv_bias: bool = True
    proj_bias: bool = False
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False
    n_attn_heads: int = 0
    n_attn_kv_heads: int = 0
    attn_d_head: int = 0
    attn_bias: bool = False
    rope_theta: float = 10000.0
    rotary_dim: int = 0
    mlp_bias: bool = False
    pad_token_id: int | None = None
    mlp_types: list[str] = field(default_factory=list)
    mlp_act: str = "silu"
    use_rope: bool = True
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_d_mlp: int = 0
    moe_shared_d_mlp: int = 0
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_norm_topk_prob: bool = True
    moe_routed_scaling_factor: float = 1.0
    attn_scale: float = 0.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    parallel_attention: bool = False
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    attn_in_multiplier: float = 1.0
    attn_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = ()
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    mamba_norm: str = "gated"
    out_proj_bias: bool | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["ssm"] * self.n_layers
        super().__post_init__()

    def mlp_type(self, layer: int) -> str:
        """The MLP kind of ``layer`` (``""``: none); see :attr:`mlp_types`."""
        if self.mlp_types:
            return self.mlp_types[layer]
        return "gated" if self.architecture in ("bamba", "falcon_h1") else ""

    def layer_n_heads(self, layer: int) -> int:
        """Number of heads of ``layer`` (SSM heads, attention query heads, 0 for MLP blocks)."""
        kind = self.layer_types[layer]
        if kind == "mlp":
            return 0
        return self.n_attn_heads if kind == "attention" else self.n_heads

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are attention layers (or run attention beside the SSM mixer)."""
        return "attention" in self.layer_types or self.parallel_attention

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "SSMConfig":
        """Translate a Hugging Face config of a supported architecture.

        Args:
            hf_config: A ``MambaConfig``, ``FalconMambaConfig``, ``Mamba2Config`` or ``BambaConfig``.

        Returns:
            The matching :class:`SSMConfig`.

        Raises:
            ConfigError: If the architecture or an option is not supported.
        """
        model_type = getattr(hf_config, "model_type", None)
        arch = SUPPORTED_MODEL_TYPES.get(str(model_type))
        archs = getattr(hf_config, "architectures", None) or []
        if arch is None:
            raise ConfigError(
                f"HookedSSM does not support model_type={model_type!r} (architectures={archs}). "
                f"Supported: {sorted(SUPPORTED_MODEL_TYPES)} (MambaForCausalLM, "
                "FalconMambaForCausalLM, Mamba2ForCausalLM, BambaForCausalLM, "
                "NemotronHForCausalLM, GraniteMoeHybridForCausalLM, FalconH1ForCausalLM). For "
                "Transformer architectures use gna_lens.load_model(...), which returns a "
                "TransformerBridge."
            )
        act = getattr(hf_config, "hidden_act", None) or getattr(
            hf_config, "mamba_hidden_act", "silu"
        )
        if act != "silu":
            raise ConfigError(
                f"HookedSSM implements the SiLU activation of the Mamba family; this {model_type} "
                f"config has hidden_act={act!r}."
            )
        common: dict[str, Any] = dict(
            architecture=arch,
            hf_architecture=archs[0] if archs else "",
            model_name=str(getattr(hf_config, "_name_or_path", "") or ""),
            d_model=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            d_vocab=hf_config.vocab_size,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            pad_token_id=getattr(hf_config, "pad_token_id", None),
            uses_rms_norm=True,
            normalization_type="RMS",
            act_fn="silu",
            default_prepend_bos=False,
            device="cpu",
        )
        if arch in ("mamba1", "falcon_mamba"):
            d_inner = int(hf_config.intermediate_size)
            return cls(
                **common,
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
        if arch == "mamba2":
            d_inner = int(hf_config.expand * hf_config.hidden_size)
            n_heads = int(hf_config.num_heads)
            if n_heads * hf_config.head_dim != d_inner:
                raise ConfigError(
                    f"Mamba2 config has num_heads={n_heads} x head_dim={hf_config.head_dim} != "
                    f"expand * hidden_size = {d_inner}; HookedSSM needs the heads to tile d_inner "
                    "(checkpoints with extra MLP channels in in_proj are not supported)."
                )
            return cls(
                **common,
                n_heads=n_heads,
                d_head=int(hf_config.head_dim),
                d_inner=d_inner,
                d_state=hf_config.state_size,
                d_conv=hf_config.conv_kernel,
                n_groups=hf_config.n_groups,
                chunk_size=hf_config.chunk_size,
                time_step_limit=_limit(hf_config.time_step_limit),
                eps=hf_config.layer_norm_epsilon,
                conv_bias=bool(hf_config.use_conv_bias),
                proj_bias=bool(hf_config.use_bias),
                residual_in_fp32=bool(hf_config.residual_in_fp32),
                d_mlp=0,
            )
        if arch == "nemotron_h":
            return cls._from_nemotron_h(hf_config, common)
        granite: dict[str, Any] = {}
        if arch == "falcon_h1":
            granite = cls._falcon_h1_fields(hf_config)
        if arch == "granitemoehybrid":
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
        # bamba
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(
                f"HookedSSM implements default RoPE for Bamba attention layers; this config has "
                f"rope_type={rope_type!r}."
            )
        attn_d_head = int(
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        partial = float(rope.get("partial_rotary_factor", 1.0))
        d_inner = int(hf_config.mamba_expand * hf_config.hidden_size)
        layer_types = [
            "attention" if t in ("full_attention", "attention") else "ssm"
            for t in hf_config.layers_block_type
        ]
        if arch == "falcon_h1":
            d_inner = int(hf_config.mamba_n_heads * hf_config.mamba_d_head)
        return cls(
            **common,
            n_ctx=int(getattr(hf_config, "max_position_embeddings", UNBOUNDED_CTX)),
            layer_types=layer_types,
            n_heads=int(hf_config.mamba_n_heads),
            d_head=int(hf_config.mamba_d_head),
            d_inner=d_inner,
            d_state=hf_config.mamba_d_state,
            d_conv=hf_config.mamba_d_conv,
            n_groups=hf_config.mamba_n_groups,
            chunk_size=hf_config.mamba_chunk_size,
            time_step_limit=_limit(hf_config.time_step_limit),
            eps=hf_config.rms_norm_eps,
            conv_bias=bool(hf_config.mamba_conv_bias),
            proj_bias=bool(hf_config.mamba_proj_bias),
            residual_in_fp32=False,
            n_attn_heads=int(hf_config.num_attention_heads),
            n_attn_kv_heads=int(hf_config.num_key_value_heads),
            n_key_value_heads=int(hf_config.num_key_value_heads),
            attn_d_head=attn_d_head,
            attn_bias=bool(hf_config.attention_bias),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rotary_dim=int(attn_d_head * partial),
            d_mlp=int(hf_config.intermediate_size),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            gated_mlp=True,
            positional_embedding_type="rotary",
            **granite,
        )

    @staticmethod
    def _falcon_h1_fields(hf_config: Any) -> dict[str, Any]:
        """Falcon-H1: attention beside the Mamba-2 mixer in every layer, and its multipliers."""
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
        return dict(
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

    @classmethod
    def _from_nemotron_h(cls, hf_config: Any, common: dict[str, Any]) -> "SSMConfig":
        kinds = list(hf_config.layers_block_type)
        unknown = sorted({k for k in kinds if k not in _NEMOTRON_KINDS})
        if unknown:
            raise ConfigError(
                f"Nemotron-H config has block types {unknown}; HookedSSM knows "
                f"{sorted(_NEMOTRON_KINDS)}."
            )
        if getattr(hf_config, "moe_latent_size", None) is not None:
            raise ConfigError(
                "Nemotron-H with moe_latent_size (latent MoE projections) is not supported yet."
            )
        act = str(hf_config.mlp_hidden_act)
        if act not in ("relu2", "silu"):
            raise ConfigError(f"Nemotron-H mlp_hidden_act={act!r}; HookedSSM knows relu2, silu.")
        n_heads, d_head = int(hf_config.mamba_num_heads), int(hf_config.mamba_head_dim)
        attn_d_head = int(
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        mlp_types = {"mlp": "plain", "moe": "moe"}
        n_experts = int(getattr(hf_config, "n_routed_experts", 0) or 0)
        return cls(
            **common,
            n_ctx=int(getattr(hf_config, "max_position_embeddings", UNBOUNDED_CTX)),
            layer_types=[_NEMOTRON_KINDS[k] for k in kinds],
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
            n_attn_heads=int(hf_config.num_attention_heads),
            n_attn_kv_heads=int(hf_config.num_key_value_heads),
            n_key_value_heads=int(hf_config.num_key_value_heads),
            attn_d_head=attn_d_head,
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


def _limit(value: Any) -> tuple[float, float]:
    if value is None:
        return (0.0, float("inf"))
    lo, hi = value
    return (float(lo), float(hi))
