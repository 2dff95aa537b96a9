"""Zamba2 (``Zamba2ForCausalLM``): Mamba-2 layers, and hybrid layers where a shared transformer
block runs before the layer's Mamba-2 mixer.

A hybrid layer ``l`` (``"attention"`` in ``SSMConfig.layer_types``; its heads are the shared
block's attention heads as invoked there, ``0 .. n_attn_heads - 1``, then the layer's Mamba-2
heads) computes

    x     = ln_attn(concat(resid, embed))         # embed: the token embeddings (hook_embed)
    a     = attn(x)                               # hook_attn_out
    m     = mlp(ln2(a))                           # hook_mlp_out (no residual inside the block)
    s     = shared_proj(m)                        # hook_shared_out
    resid = resid + mixer(ln1(resid + s))         # hook_mixer_out

The weights of ``ln_attn``, ``attn`` and ``mlp`` (and ``ln2``) are shared: hybrid layer ``i``
(counting hybrid layers) uses shared block ``i % num_mem_blocks``, whose parameters are the same
``nn.Parameter`` objects in every block that invokes it. Each invocation has its own low-rank
adapters (``attn.{q,k,v}_proj.adapter`` when ``use_shared_attention_adapter``,
``mlp.gate_up_proj.adapter`` always), its own ``shared_proj`` and its own hook points, so its
attention heads are distinct ``(layer, head)`` entries of the head view and an edit at one
invocation leaves the others unchanged.

Examples:
    >>> from gna_lens.testing import tiny_hooked_ssm
    >>> model = tiny_hooked_ssm("zamba2")
    >>> model.cfg.layer_types
    ['ssm', 'attention', 'ssm', 'attention', 'attention']
    >>> b1, b4 = model.blocks[1], model.blocks[4]  # hybrid layers 0 and 2 share block 0
    >>> b1.attn.q_proj.weight is b4.attn.q_proj.weight, b1.attn.hook_z is b4.attn.hook_z
    (True, False)
"""

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.errors import ConfigError
from gna_lens.models import ops
from gna_lens.models.block import SSMBlock
from gna_lens.models.config import UNBOUNDED_CTX, SSMConfig
from gna_lens.models.families.base import Family, Renames
from gna_lens.models.mixers.attention import Attention
from gna_lens.models.mixers.base import RMSNorm
from gna_lens.models.mixers.mamba2 import Mamba2Mixer

#: Zamba2 block types (``layers_block_type``, legacy names included) -> HookedSSM layer kind.
BLOCK_KINDS = {"linear_attention": "ssm", "mamba": "ssm", "hybrid": "attention"}
#: The shared MLP's activations (``hidden_act``).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"gelu": F.gelu, "silu": F.silu}
#: Hugging Face fixes the epsilon of the Mamba-2 mixer's gated norm.
MIXER_NORM_EPS = 1e-5


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a ``Zamba2Config``."""
    kinds = list(hf_config.layers_block_type)
    unknown = sorted({k for k in kinds if k not in BLOCK_KINDS})
    if unknown:
        raise ConfigError(
            f"Zamba2 config has block types {unknown}; HookedSSM knows {sorted(BLOCK_KINDS)}."
        )
    if len(kinds) != hf_config.num_hidden_layers:
        raise ConfigError(
            f"Zamba2 config has {len(kinds)} layers_block_type entries for "
            f"num_hidden_layers={hf_config.num_hidden_layers}; they must agree."
        )
    d_inner = int(hf_config.mamba_expand * hf_config.hidden_size)
    n_heads, d_head = int(hf_config.n_mamba_heads), int(hf_config.mamba_headdim)
    if n_heads * d_head != d_inner:
        raise ConfigError(
            f"Zamba2 config has n_mamba_heads={n_heads} x mamba_headdim={d_head} != "
            f"mamba_expand * hidden_size = {d_inner}; HookedSSM needs the heads to tile it."
        )
    n_attn, n_kv = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
    if int(hf_config.num_mem_blocks) < 1:
        raise ConfigError(
            f"Zamba2 config has num_mem_blocks={hf_config.num_mem_blocks}; need >= 1."
        )
    attn_adapters = bool(hf_config.use_shared_attention_adapter)
    if attn_adapters and n_kv != n_attn:
        raise ConfigError(
            "Zamba2 config with use_shared_attention_adapter and num_key_value_heads="
            f"{n_kv} != num_attention_heads={n_attn}: the adapters' output does not fit the "
            "keys (Hugging Face cannot run it either)."
        )
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    use_rope = bool(hf_config.use_mem_rope)
    if use_rope and rope.get("rope_type", "default") != "default":
        raise ConfigError(
            "HookedSSM implements default RoPE for Zamba2's shared attention; this config has "
            f"rope_type={rope.get('rope_type')!r}."
        )
    attn_d_head = int(hf_config.attention_head_dim)
    return dict(
        n_ctx=int(getattr(hf_config, "max_position_embeddings", UNBOUNDED_CTX)),
        layer_types=[BLOCK_KINDS[k] for k in kinds],
        n_heads=n_heads,
        d_head=d_head,
        d_inner=d_inner,
        d_state=int(hf_config.mamba_d_state),
        d_conv=int(hf_config.mamba_d_conv),
        n_groups=int(hf_config.mamba_ngroups),
        chunk_size=int(hf_config.chunk_size),
        # HF's Zamba2 mixer clamps dt to (time_step_min, inf).
        time_step_limit=(float(hf_config.time_step_min), float("inf")),
        eps=float(hf_config.rms_norm_eps),
        mixer_rms_eps=MIXER_NORM_EPS,
        conv_bias=True,  # HF's Zamba2 mixer always has a convolution bias
        proj_bias=bool(hf_config.add_bias_linear),
        residual_in_fp32=False,
        n_attn_heads=n_attn,
        n_attn_kv_heads=n_kv,
        n_key_value_heads=n_kv,
        attn_d_head=attn_d_head,
        # Zamba2 scales the scores by (head_dim / 2) ** -0.5.
        attn_scale=(attn_d_head / 2) ** -0.5,
        use_rope=use_rope,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rotary_dim=attn_d_head,
        d_mlp=int(hf_config.intermediate_size),
        mlp_bias=bool(hf_config.add_bias_linear),
        mlp_act=str(hf_config.hidden_act),
        shared_blocks=int(hf_config.num_mem_blocks),
        adapter_rank=int(hf_config.adapter_rank),
        attn_adapters=attn_adapters,
        positional_embedding_type="rotary" if use_rope else "standard",
    )


def _hybrid_layers(cfg: SSMConfig) -> list[int]:
    """The hybrid layers (where the shared transformer blocks run), in order."""
    return [layer for layer, kind in enumerate(cfg.layer_types) if kind == "attention"]


def weight_renames(cfg: SSMConfig) -> Renames:
    """Mamba layers ``model.layers.{l}.{input_layernorm, mamba}``; hybrid layers
    ``model.layers.{l}.{mamba_decoder.*, linear, shared_transformer.*}``, whose adapter lists
    hold slot ``i`` for hybrid layer ``i`` (every hybrid layer's copy names the same tensors)."""
    st = r"^model\.layers\.(\d+)\.shared_transformer\."
    out: list[tuple[str, str]] = [
        (r"^model\.embed_tokens\.", "embed."),
        (r"^model\.final_layernorm\.", "ln_final."),
        (r"^lm_head\.", "unembed."),
        (r"^model\.layers\.(\d+)\.(mamba_decoder\.)?input_layernorm\.", r"blocks.\1.ln1."),
        (r"^model\.layers\.(\d+)\.(mamba_decoder\.)?mamba\.", r"blocks.\1.mixer."),
        (r"^model\.layers\.(\d+)\.linear\.", r"blocks.\1.shared_proj."),
    ]
    for i, layer in enumerate(_hybrid_layers(cfg)):
        attn, mlp = f"blocks.{layer}.attn.", f"blocks.{layer}.mlp."
        out += [
            (st + rf"self_attn\.linear_([qkv])_adapter_list\.{i}\.", attn + r"\2_proj.adapter."),
            (
                st + rf"feed_forward\.gate_up_proj_adapter_list\.{i}\.",
                mlp + "gate_up_proj.adapter.",
            ),
        ]
    out += [
        (st + r"input_layernorm\.", r"blocks.\1.ln_attn."),
        (st + r"pre_ff_layernorm\.", r"blocks.\1.ln2."),
        (st + r"self_attn\.", r"blocks.\1.attn."),
        (st + r"feed_forward\.", r"blocks.\1.mlp."),
    ]
    return out


class Zamba2Mixer(Mamba2Mixer):
    """:class:`~gna_lens.models.mixers.Mamba2Mixer` with Zamba2's gated norm (``norm(y *
    SiLU(z))`` per group, epsilon ``mixer_rms_eps`` rather than the model's)."""

    def gate_norm(self, y: Tensor, z: Tensor) -> Tensor:
        cfg = self.cfg
        group = cfg.d_inner // cfg.n_groups
        return ops.gated_rms_norm(y, z, self.norm.weight, group, cfg.mixer_rms_eps)


class AdaptedLinear(nn.Linear):
    """A linear map shared by the invocations, plus this invocation's low-rank adapter:
    ``W x + b + U (V x)`` (``adapter``: ``V``, ``U``; ``None`` for rank 0)."""

    def __init__(self, d_in: int, d_out: int, rank: int, bias: bool = False):
        super().__init__(d_in, d_out, bias=bias)
        self.adapter = (
            nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))
            if rank
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out if self.adapter is None else out + self.adapter(x)


class SharedAttention(Attention):
    """The shared block's attention as one invocation runs it: input ``[resid, embed]``
    (``2 * d_model``), ``q``, ``k``, ``v`` with this invocation's adapters; hook points and
    incremental state are :class:`~gna_lens.models.mixers.Attention`'s."""

    def __init__(self, cfg: SSMConfig):
        super().__init__(cfg)
        H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
        rank = cfg.adapter_rank if cfg.attn_adapters else 0
        self.q_proj = AdaptedLinear(2 * cfg.d_model, H * d, rank)
        self.k_proj = AdaptedLinear(2 * cfg.d_model, KV * d, rank)
        self.v_proj = AdaptedLinear(2 * cfg.d_model, KV * d, rank)


class SharedMLP(nn.Module):
    """The shared block's MLP: ``down(act(gate) * up)``, ``gate, up = gate_up_proj(x)`` with
    this invocation's adapter on ``gate_up_proj``; hook names as the SwiGLU MLPs'."""

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        d_mlp = int(cfg.d_mlp or 0)
        self.gate_up_proj = AdaptedLinear(cfg.d_model, 2 * d_mlp, cfg.adapter_rank, cfg.mlp_bias)
        self.down_proj = nn.Linear(d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.mlp_act]
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the gate before the activation
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate, up = self.hook_pre(gate), self.hook_pre_linear(up)
        return cast("Tensor", self.down_proj(self.hook_post(self.act(gate) * up)))


class Zamba2HybridBlock(SSMBlock):
    """A hybrid layer: one invocation of a shared transformer block, then the layer's Mamba-2
    mixer (see the module docstring for the computation and hook points).

    Its heads are in two parts (:attr:`head_parts`): the attention heads of the invocation
    (``attn``, the layer's heads ``0 .. n_attn_heads - 1``), then its mixer's SSM heads
    (``mixer``, every SSM hook point as in the Mamba-2 layers; heads ``n_attn_heads ..
    n_attn_heads + n_heads - 1``).
    """

    reads_embed = True

    def __init__(self, cfg: SSMConfig, layer: int):
        super().__init__(cfg, layer)  # an attention block: ln1, attn, hook_attn_out, no MLP
        self.ln_attn = RMSNorm(2 * cfg.d_model, cfg.eps)
        self.attn = SharedAttention(cfg)
        self.ln2 = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = SharedMLP(cfg)
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.shared_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.hook_shared_out = HookPoint()  # [batch, pos, d_model]
        self.mixer = Zamba2Mixer(cfg)
        self.hook_mixer_out = HookPoint()  # [batch, pos, d_model]
        # The invocation's attention heads first (they run first), then the mixer's SSM heads.
        self.head_parts = ("attn", "mixer")

    def share_weights(self, source: "Zamba2HybridBlock") -> None:
        """Make this invocation use ``source``'s shared-block parameters (the same tensors; the
        adapters, ``shared_proj``, ``ln1`` and the mixer stay this layer's own)."""
        for name in SHARED_MODULES:
            mine, theirs = self.get_submodule(name), source.get_submodule(name)
            for pname, param in theirs.named_parameters(recurse=False):
                setattr(mine, pname, param)

    def shared_out(
        self, resid: Tensor, embed: Tensor | None, attend: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """``hook_shared_out``: the invocation's output projected back to ``d_model``."""
        if embed is None:
            raise ValueError(
                f"Zamba2 layer {self.layer} runs a shared transformer block, which reads the "
                "token embeddings: pass the rows' token ids with start_at_layer "
                "(model(resid, start_at_layer=k, tokens=ids))."
            )
        if embed.shape[0] == 1 < resid.shape[0]:  # rows that copy one prompt (expanded sweeps)
            embed = embed.expand(resid.shape[0], -1, -1)
        dtype = self.ln_attn.weight.dtype
        x = self.ln_attn(torch.cat([resid, embed.to(resid.dtype)], dim=-1).to(dtype))
        attn = self.hook_attn_out(attend(x))
        out = self.hook_mlp_out(self.mlp(self.ln2(attn.to(dtype))))
        return cast("Tensor", self.hook_shared_out(self.shared_proj(out)))

    def _run(
        self,
        resid: Tensor,
        embed: Tensor | None,
        attend: Callable[[Tensor], Tensor],
        mix: Callable[[Tensor], Tensor],
    ) -> Tensor:
        resid = self.hook_resid_pre(resid)
        shared = self.shared_out(resid, embed, attend)
        normed = self.ln1((resid + shared).to(self.ln1.weight.dtype))
        out = self.hook_mixer_out(mix(normed))
        return cast("Tensor", self.hook_resid_post(resid + out))


#: The submodules whose own parameters the invocations of one shared block share.
SHARED_MODULES = (
    "ln_attn", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "ln2",
    "mlp.gate_up_proj", "mlp.down_proj",
)  # fmt: skip


def build_blocks(cfg: SSMConfig) -> list[nn.Module]:
    """One block per layer; hybrid layer ``i`` (counting hybrid layers) uses the weights of
    shared block ``i % shared_blocks``, owned by the first hybrid layer that invokes it."""
    blocks: list[nn.Module] = []
    owners: dict[int, Zamba2HybridBlock] = {}
    n_hybrid = 0
    for layer, kind in enumerate(cfg.layer_types):
        if kind != "attention":
            blocks.append(SSMBlock(cfg, layer))
            continue
        block = Zamba2HybridBlock(cfg, layer)
        owner = owners.setdefault(n_hybrid % cfg.shared_blocks, block)
        if owner is not block:
            block.share_weights(owner)
        n_hybrid += 1
        blocks.append(block)
    return blocks


FAMILY = Family(
    model_type="zamba2",
    architecture="zamba2",
    hf_class="Zamba2ForCausalLM",
    config_fields=config_fields,
    weight_renames=weight_renames,
    ssm_mixer=Zamba2Mixer,
    build_blocks=build_blocks,
    hidden_acts=tuple(ACTIVATIONS),
)
