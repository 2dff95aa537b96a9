"""Configuration of :class:`~gna_lens.models.HookedSSM`, converted from Hugging Face configs."""

from dataclasses import dataclass, field
from typing import Any

from transformer_lens.config import TransformerLensConfig

#: Context length reported for pure SSMs, which have no positional limit.
UNBOUNDED_CTX = 1 << 20


@dataclass
class SSMConfig(TransformerLensConfig):
    """Configuration of a HookedSSM, in TransformerLens vocabulary.

    ``n_heads`` / ``d_head`` describe the SSM heads that ``hook_pattern`` and ``hook_z`` index:
    Mamba-2 heads, or for Mamba-1 one "head" per channel (``n_heads = d_inner``, ``d_head = 1``).
    In a hybrid, attention layers have ``n_attn_heads`` heads of size ``attn_d_head``; use
    :attr:`layer_types` for the kind of each layer.

    Attributes:
        architecture: ``"mamba1"``, ``"falcon_mamba"``, ``"mamba2"``, ``"bamba"``,
            ``"nemotron_h"``, ``"granitemoehybrid"``, ``"falcon_h1"``, ``"jamba"``,
            ``"zamba2"`` or ``"llamba"`` (and gna_lens's own ``"gna_hybrid"``).
        layer_types: Per layer, ``"ssm"``, ``"attention"`` or ``"mlp"`` (a block with only an
            MLP, Nemotron-H). Zamba2's hybrid layers are ``"attention"``: their heads are those
            of the shared transformer block invoked there (the layer's Mamba-2 mixer follows).
        mlp_types: Per layer, the MLP of the block: ``""`` (none), ``"gated"`` (SwiGLU),
            ``"plain"`` (``down(act(up(x)))``), ``"moe"`` (routed experts plus a shared
            expert, Nemotron-H), ``"granite"`` / ``"granite_moe"`` (Granite's shared MLP, without
            / with routed experts) or ``"jamba_moe"`` (Jamba's routed experts). Empty:
            ``"gated"`` on every layer of a Bamba, none elsewhere.
        mlp_act: Activation of ``"plain"`` MLPs and experts: ``"silu"`` or ``"relu2"``; of
            Zamba2's shared MLP: ``"gelu"`` or ``"silu"``.
        use_rope: Whether attention layers rotate queries and keys (Nemotron-H does not).
        rope_scaling: The RoPE variant beyond ``rope_theta`` (``{}``: plain RoPE; else a Hugging
            Face ``rope_parameters`` dict of a type :func:`gna_lens.models.ops.rope_inv_freq`
            computes: ``"linear"``, ``"llama3"``).
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
        conv_activation: The activation after the mixer's causal convolution: ``"silu"`` (Mamba,
            Mamba-2 and the hybrids) or ``"identity"`` (Llamba's DiscreteMamba2 by default).
        out_proj_bias: Bias of the mixer's ``out_proj`` (``None``: ``proj_bias``).
        shared_blocks, adapter_rank, attn_adapters: Zamba2's shared transformer blocks: how
            many distinct weight sets the hybrid layers cycle through (``num_mem_blocks``), the
            rank of each invocation's adapters, and whether the attention's ``q``, ``k``, ``v``
            have adapters (the MLP's ``gate_up_proj`` always has).
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
    rope_scaling: dict[str, Any] = field(default_factory=dict)
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
    conv_activation: str = "silu"
    out_proj_bias: bool | None = None
    shared_blocks: int = 0
    adapter_rank: int = 0
    attn_adapters: bool = False

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["ssm"] * self.n_layers
        super().__post_init__()

    def mlp_type(self, layer: int) -> str:
        """The MLP kind of ``layer`` (``""``: none); see :attr:`mlp_types`."""
        if self.mlp_types:
            return self.mlp_types[layer]
        return "gated" if self.architecture in ("bamba", "falcon_h1") else ""

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are attention layers (or run attention beside the SSM mixer)."""
        return "attention" in self.layer_types or self.parallel_attention

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "SSMConfig":
        """Translate a Hugging Face config of a supported architecture.

        The family of ``hf_config.model_type`` (:mod:`gna_lens.models.families`) gives the
        fields beyond the ones every family shares.

        Args:
            hf_config: A ``MambaConfig``, ``FalconMambaConfig``, ``Mamba2Config``,
                ``BambaConfig``, ``NemotronHConfig``, ``GraniteMoeHybridConfig``,
                ``FalconH1Config``, ``JambaConfig`` or ``Zamba2Config``.

        Returns:
            The matching :class:`SSMConfig`.

        Raises:
            ConfigError: If the architecture or an option is not supported.
        """
        from gna_lens.models.families import config_from_hf

        return config_from_hf(hf_config, cls)


def __getattr__(name: str) -> Any:
    # SUPPORTED_MODEL_TYPES is derived from the family registry (which imports this module).
    if name == "SUPPORTED_MODEL_TYPES":
        from gna_lens.models.families import SUPPORTED_MODEL_TYPES

        return SUPPORTED_MODEL_TYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
