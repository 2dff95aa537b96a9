"""One residual block of a HookedSSM, assembled from the family's mixers (see
:mod:`gna_lens.models.families`): its full forward and its single-token step."""

from collections.abc import Callable
from typing import cast

from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.models.config import SSMConfig
from gna_lens.models.mixers.attention import Attention, Rope
from gna_lens.models.mixers.base import RMSNorm, SSMMixer, StepState
from gna_lens.models.mixers.mlp import make_mlp

__all__ = ["SSMBlock"]


class SSMBlock(nn.Module):
    """One residual block: an SSM mixer or an attention layer, and/or an MLP.

    Layer kinds (``cfg.layer_types``): ``"ssm"`` and ``"attention"`` blocks have ``ln1`` and a
    mixer / attention, followed by ``ln2`` and an MLP when ``cfg.mlp_types`` gives the layer one
    (Bamba); ``"mlp"`` blocks (Nemotron-H) have only ``ln2`` and the MLP. The SSM mixer's class
    is the family's (``Family.ssm_mixer``).
    """

    #: Whether the block reads the token embeddings (``forward`` / ``step``'s ``embed``: Zamba2's
    #: shared transformer blocks); ``HookedSSM`` computes them only when such a block runs.
    reads_embed: bool = False

    def __init__(self, cfg: SSMConfig, layer: int):
        # Imported here: a family module may subclass SSMBlock (the registry imports it).
        from gna_lens.models.families import family_of

        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.kind = cfg.layer_types[layer]
        self.is_attention = self.kind == "attention"
        self.has_mixer = self.kind != "mlp"
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        if self.has_mixer:
            self.ln1 = RMSNorm(cfg.d_model, cfg.eps)
        if self.is_attention:
            self.attn = Attention(cfg)
            self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        elif self.has_mixer:
            self.mixer: SSMMixer = family_of(cfg.architecture).ssm_mixer.for_layer(cfg, layer)
            self.hook_mixer_out = HookPoint()  # [batch, pos, d_model]
            if cfg.parallel_attention:  # Falcon-H1: attention beside the mixer
                self.attn = Attention(cfg)
                self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        #: Whether an attention runs in parallel with the SSM mixer (Falcon-H1).
        self.has_parallel_attn = self.has_mixer and not self.is_attention and cfg.parallel_attention
        #: The submodules whose hooks hold the block's heads, in the order the head view
        #: numbers them (``"attn"``: ``blocks.{l}.attn.*``, ``"mixer"``: ``blocks.{l}.mixer.*``;
        #: ``()``: no heads). Two entries make a multi-part layer: Falcon-H1's SSM heads come
        #: first (``0 .. n_heads - 1``), then its parallel attention's.
        self.head_parts: tuple[str, ...] = ()
        if self.is_attention:
            self.head_parts = ("attn",)
        elif self.has_mixer:
            self.head_parts = ("mixer", "attn") if self.has_parallel_attn else ("mixer",)
        mlp_kind = cfg.mlp_type(layer)
        self.has_mlp = bool(mlp_kind)
        if self.has_mlp:
            if self.has_mixer:
                self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
            self.ln2 = RMSNorm(cfg.d_model, cfg.eps)
            self.mlp = make_mlp(cfg, mlp_kind)
            self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]

    def forward(
        self, resid: Tensor, mask: Tensor | None, rope: Rope, embed: Tensor | None = None
    ) -> Tensor:
        """The block on ``resid`` ``[batch, pos, d_model]`` (``embed``: the token embeddings, for
        blocks that read them, :attr:`reads_embed`)."""
        return self._run(
            resid,
            embed,
            lambda x: self.attn(x, mask, rope),
            lambda x: self.mixer(x, mask, rope) if self.mixer.uses_rope else self.mixer(x, mask),
        )

    def _run(
        self,
        resid: Tensor,
        embed: Tensor | None,
        attend: Callable[[Tensor], Tensor],
        mix: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """The block on ``resid`` with ``attend`` / ``mix`` the attention's / mixer's output of
        their normed input (the full forward's or the single-token step's)."""
        del embed  # read by a block whose reads_embed is set
        resid = self.hook_resid_pre(resid)
        if self.has_mixer:
            normed = self.ln1(resid.to(self.ln1.weight.dtype))
            if self.cfg.residual_in_fp32:
                resid = resid.float()
            if self.is_attention:
                resid = resid + self.hook_attn_out(self.scaled(attend(normed)))
            elif self.has_parallel_attn:  # Falcon-H1: mixer and attention on the same input
                ssm = self.hook_mixer_out(self.scaled(mix(normed), "ssm"))
                attn = attend(self.attn_input(normed))
                resid = resid + (ssm + self.hook_attn_out(self.scaled(attn, "attention")))
            else:
                resid = resid + self.hook_mixer_out(self.scaled(mix(normed)))
        return self.mlp_part(resid)

    def attn_input(self, normed: Tensor) -> Tensor:
        """The parallel attention's input (Falcon-H1's attention_in_multiplier)."""
        m = self.cfg.attn_in_multiplier
        return normed if m == 1.0 else normed * m

    def out_multiplier(self, kind: str | None = None) -> float:
        """The factor between a sublayer's output projection and its ``hook_*_out``."""
        m = self.cfg.residual_multiplier
        if self.has_parallel_attn and kind == "ssm":
            m *= self.cfg.ssm_out_multiplier
        elif self.has_parallel_attn and kind == "attention":
            m *= self.cfg.attn_out_multiplier
        return m

    def scaled(self, out: Tensor, kind: str | None = None) -> Tensor:
        """A sublayer's output as added to the residual stream (Granite's residual_multiplier,
        Falcon-H1's ssm / attention output multipliers)."""
        m = self.out_multiplier(kind)
        return out if m == 1.0 else out * m

    def mlp_part(self, resid: Tensor) -> Tensor:
        """The block after its mixer: ``hook_resid_mid``, the MLP, ``hook_resid_post``."""
        if self.has_mlp:
            if self.has_mixer:
                resid = self.hook_resid_mid(resid)
            out = self.mlp(self.ln2(resid.to(self.ln2.weight.dtype)))
            resid = resid + self.hook_mlp_out(self.scaled(out))
        return cast("Tensor", self.hook_resid_post(resid))

    # ------------------------------------------------------------------ incremental
    def prefix_hooks(self) -> list[str]:
        """The hook points (model-level names) whose full-prompt activations
        :meth:`prefix_state` reads."""
        names: list[str] = []
        pre = f"blocks.{self.layer}."
        if "attn" in self.head_parts:
            names += [pre + "attn." + n for n in Attention.prefix_hooks]
        if "mixer" in self.head_parts:
            names += [pre + "mixer." + n for n in self.mixer.prefix_hooks]
        return names

    def prefix_state(self, acts: dict[str, Tensor], length: int) -> StepState:
        """What the token after the first ``length`` positions needs from them, from the full
        prompt's activations ``acts`` (keyed by :meth:`prefix_hooks`' names)."""
        pre = f"blocks.{self.layer}."
        state: StepState = {}
        if "mixer" in self.head_parts:
            fired = {
                n: acts[pre + "mixer." + n]
                for n in self.mixer.prefix_hooks
                if pre + "mixer." + n in acts
            }
            state |= self.mixer.prefix_state(fired, length)
        if "attn" in self.head_parts:
            names = Attention.prefix_hooks
            state |= self.attn.prefix_state({n: acts[pre + "attn." + n] for n in names}, length)
        return state

    def step(
        self, resid: Tensor, state: StepState, rope: Rope, embed: Tensor | None = None
    ) -> Tensor:
        """:meth:`forward` for one token after the prefix whose ``state`` it is
        (``resid`` ``[batch, 1, d_model]``; ``rope`` of that token's position)."""
        return self._run(
            resid,
            embed,
            lambda x: self.attn.step(state, x, rope),
            lambda x: (
                self.mixer.step(state, x, rope)  # type: ignore[call-arg]
                if self.mixer.uses_rope
                else self.mixer.step(state, x)
            ),
        )
