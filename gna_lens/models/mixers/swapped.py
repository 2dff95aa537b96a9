"""A Mamba-2 mixer some of whose heads were swapped for attention heads
(:func:`gna_lens.hybrid.swap_heads`).

Every head keeps its number. An SSM head computes what it computed before (the layer's
``in_proj``, convolution, scan and ``D`` skip). A swapped head ``h`` of group ``g`` is a causal
softmax attention head with its own projections, started from the head's own read-out:

    q = SiLU(conv(q_proj(u)))   q_proj <- the rows of C of group g    [pos, d_state]
    k = SiLU(conv(k_proj(u)))   k_proj <- the rows of B of group g    [pos, d_state]
    v = SiLU(conv(v_proj(u)))   v_proj <- the rows of x of head h     [pos, d_head]
    y_h = softmax(q k^T / sqrt(d_state), causal) v

where ``u`` is the layer's normed input and each channel's causal convolution (its weights and
bias) starts as the same channel's in the Mamba-2 layer, so ``q``, ``k``, ``v`` start equal to
the head's ``C``, ``B`` and ``x``: the attention head reads what the SSM head read, with a
softmax over every position instead of the decaying sum ``(C_t . B_s) exp(A Σ dt) dt_s``. The
convolution keeps the local mixing Mamba's ``B`` / ``C`` / ``x`` have (a key's line reaches the
value after it), and gives the head a sense of position (there is no RoPE). ``y_h`` then goes,
like every head's, through the layer's gate, gated RMSNorm and ``out_proj`` (no ``D`` skip).
Falcon-H1's input multiplier and muP vector are folded into the copied rows.

The new parameters are ``attn_proj`` (``[q | k | v]`` rows per swapped head) and ``attn_conv``;
everything else is the Mamba-2 layer's, untouched. ``hook_pattern`` holds every head's matrix:
the SSM heads' ``M`` and the swapped heads' softmax pattern; an edit changes the output of both
(``y_h = P_h @ v_h`` for a swapped head).
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.device import HOST
from gna_lens.errors import ConfigError
from gna_lens.models import ops
from gna_lens.models.config import SSMConfig
from gna_lens.models.mixers.attention import allowed_keys
from gna_lens.models.mixers.base import (
    StepState,
    checked_pattern,
    conv_last,
    conv_tail,
    has_hooks,
    masked,
    scatter_rows_heads,
)
from gna_lens.models.mixers.mamba2 import Mamba2Mixer

if TYPE_CHECKING:
    from gna_lens.models.hooked_ssm import HookedSSM

__all__ = ["SwappedMamba2Mixer", "mixed_pattern_output", "splice_attention"]


def mixed_pattern_output(
    mixer: Any,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    P_attn: Tensor,
    x: Tensor,
    v: Tensor,
    heads: Tensor | None,
    rows: Tensor | None,
) -> Tensor:
    """``y`` ``[batch, row, head, d_head]`` of the heads and rows of ``hook_pattern`` in a layer
    whose heads are of both kinds: the SSM matrices with the attention heads' softmax patterns
    spliced in (:func:`splice_attention`), through ``mixer.hook_pattern`` (edits take effect),
    times the values (``x``, the attention heads' ``v`` in their places ``mixer.attn_index``)."""
    index: Tensor = mixer.attn_index
    pattern = splice_attention(
        mixer.materialize(dt, A, B, C, heads, rows), P_attn, mixer.attn_heads, heads, rows
    ).to(x.dtype)
    hook = mixer.hook_pattern
    pattern = checked_pattern(hook(pattern), pattern, hook.name)
    values = x.index_copy(2, index, v.to(x.dtype))
    if heads is not None:
        values = values.index_select(2, heads)
    return torch.einsum("bhrj,bjhp->brhp", pattern, values)


def splice_attention(
    pattern: Tensor,
    P_attn: Tensor,
    attn_heads: Sequence[int],
    heads: Tensor | None,
    rows: Tensor | None,
) -> Tensor:
    """``pattern`` (the SSM matrices of ``heads``, ``None``: all, at query ``rows``) with the
    attention heads' softmax patterns ``P_attn`` ``[batch, attn_head, query, key]`` (one per
    entry of ``attn_heads``) in their places: one ``hook_pattern`` holding every head's matrix
    in a layer whose heads are of both kinds."""
    wanted = list(range(pattern.shape[1])) if heads is None else heads.tolist()
    where = [(j, attn_heads.index(hd)) for j, hd in enumerate(wanted) if hd in attn_heads]
    if not where:
        return pattern
    device = pattern.device
    p = P_attn.index_select(1, torch.tensor([i for _, i in where], device=device))
    if rows is not None:
        p = p.index_select(2, rows)
    at = torch.tensor([j for j, _ in where], device=device)
    return pattern.index_copy(1, at, p.to(pattern.dtype))


class SwappedMamba2Mixer(Mamba2Mixer):
    """A Mamba-2 layer with some heads swapped for attention heads (module docstring).

    Hook points beyond Mamba-2's (``attn_head`` indexes :attr:`attn_heads`):
    ``hook_attn_in`` ``[batch, pos, attn_head * (2 d_state + d_head)]`` (the new projections
    before the convolution), ``hook_q`` / ``hook_k`` ``[batch, pos, attn_head, d_state]``,
    ``hook_v`` ``[batch, pos, attn_head, d_head]``, ``hook_attn_scores`` ``[batch, attn_head,
    query_pos, key_pos]``. Mamba-2's hooks keep every head (``hook_ssm_*`` of a swapped head
    hold what its SSM head would compute, unused; its ``hook_ssm_out`` slice holds the
    attention output); ``hook_pattern`` and ``hook_z`` hold every head.

    Attributes:
        attn_heads: The swapped heads (sorted).
    """

    prefix_hooks: ClassVar[tuple[str, ...]] = (
        *Mamba2Mixer.prefix_hooks,
        "hook_attn_in",
        "hook_k",
        "hook_v",
    )

    def __init__(self, cfg: SSMConfig, attention_heads: Sequence[int]):
        super().__init__(cfg)
        H, N, P = cfg.n_heads, cfg.d_state, cfg.d_head
        heads = sorted({int(h) for h in attention_heads})
        bad = [h for h in heads if not 0 <= h < H]
        if bad or not heads:
            raise ConfigError(
                f"SwappedMamba2Mixer(attention_heads={list(attention_heads)!r}); expected at least "
                f"one head of 0..{H - 1}."
            )
        self.attn_heads = heads
        n = len(heads)
        self.width = 2 * N + P
        self.attn_proj = nn.Linear(cfg.d_model, n * self.width, bias=cfg.proj_bias)
        self.attn_conv = nn.Conv1d(
            n * self.width,
            n * self.width,
            cfg.d_conv,
            groups=n * self.width,
            padding=cfg.d_conv - 1,
            bias=cfg.conv_bias,
        )
        self.scale = N**-0.5
        self.register_buffer("attn_index", torch.tensor(heads, dtype=torch.long), persistent=False)
        keep = torch.ones(H, device=HOST)
        keep[heads] = 0.0
        self.register_buffer("ssm_keep", keep, persistent=False)
        self.hook_attn_in = HookPoint()  # [batch, pos, attn_head * (2 d_state + d_head)]
        self.hook_q = HookPoint()  # [batch, pos, attn_head, d_state]
        self.hook_k = HookPoint()  # [batch, pos, attn_head, d_state]
        self.hook_v = HookPoint()  # [batch, pos, attn_head, d_head]
        self.hook_attn_scores = HookPoint()  # [batch, attn_head, query_pos, key_pos]

    @classmethod
    def from_mamba2(
        cls, mixer: Mamba2Mixer, attention_heads: Sequence[int]
    ) -> "SwappedMamba2Mixer":
        """A copy of ``mixer`` (its weights, exactly) with ``attention_heads`` swapped, the new
        projections and convolution started from the heads' own rows (module docstring)."""
        new = cls(mixer.cfg, attention_heads)
        new.load_state_dict(mixer.state_dict(), strict=False)
        first = next(iter(mixer.parameters()))
        new.to(device=first.device, dtype=first.dtype)
        new.init_from_heads()
        return new

    def _rows(self, head: int) -> list[int]:
        """Rows of ``in_proj`` (z, xBC, dt layout) for the swapped head's ``[q | k | v]``."""
        cfg = self.cfg
        E, G, N, P = cfg.d_inner, cfg.n_groups, cfg.d_state, cfg.d_head
        g = head // (cfg.n_heads // G)
        C = range(E + E + G * N + g * N, E + E + G * N + (g + 1) * N)
        B = range(E + E + g * N, E + E + (g + 1) * N)
        x = range(E + head * P, E + (head + 1) * P)
        return [*C, *B, *x]

    def init_from_heads(self) -> None:
        """Copy each swapped head's ``C`` / ``B`` / ``x`` rows of ``in_proj`` and their
        convolution channels into ``attn_proj`` / ``attn_conv``."""
        E = self.cfg.d_inner
        weight = self.in_proj.weight
        with torch.no_grad():
            m = float(self.cfg.ssm_in_multiplier)
            mup: Tensor | None = self.mup_vector
            for i, h in enumerate(self.attn_heads):
                rows = torch.tensor(self._rows(h), device=weight.device)
                dst = slice(i * self.width, (i + 1) * self.width)
                mu = (
                    mup[rows].to(weight.dtype)
                    if mup is not None
                    else torch.ones_like(weight[rows, 0])
                )
                self.attn_proj.weight[dst] = weight[rows] * (m * mu)[:, None]
                if self.attn_proj.bias is not None:
                    self.attn_proj.bias[dst] = self.in_proj.bias[rows] * mu
                conv = rows - E  # channels of xBC
                self.attn_conv.weight[dst] = self.conv1d.weight[conv]
                src = self.conv1d.bias
                if self.attn_conv.bias is not None and src is not None:
                    self.attn_conv.bias[dst] = src[conv]

    # ------------------------------------------------------------------ attention heads
    def _split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, L, _ = qkv.shape
        N, P, n = self.cfg.d_state, self.cfg.d_head, len(self.attn_heads)
        qkv = qkv.view(b, L, n, self.width)
        q, k, v = qkv.split([N, N, P], dim=-1)
        return self.hook_q(q), self.hook_k(k), self.hook_v(v)

    def _attn_qkv(self, h: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        pre = self.hook_attn_in(self.attn_proj(h))
        conv = ops.causal_conv1d(pre.transpose(1, 2), self.attn_conv.weight, self.attn_conv.bias)
        qkv = F.silu(conv.transpose(1, 2))
        qkv = masked(qkv, mask)
        return self._split(qkv)

    def _attend(self, q: Tensor, k: Tensor, allowed: Tensor | None) -> Tensor:
        scores = torch.einsum("bqhn,bkhn->bhqk", q, k) * self.scale
        if allowed is not None:
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        scores = self.hook_attn_scores(scores)
        return torch.softmax(scores.float(), dim=-1)

    def skip(self) -> Tensor:
        """The ``D`` skip, on the SSM heads only."""
        keep: Tensor = self.ssm_keep  # type: ignore[assignment]
        return self.D * keep.to(self.D.dtype)

    # ------------------------------------------------------------------ forward
    def forward(
        self, h: Float[Tensor, "batch pos d_model"], mask: Tensor | None
    ) -> Float[Tensor, "batch pos d_model"]:
        z, x, B, C, dt, A = self._sequence_inputs(h, mask)
        h = masked(h, mask)
        q, k, v = self._attn_qkv(h, mask)
        P_attn = self._attend(q, k, allowed_keys(h.shape[1], mask, h.device))  # [b, a, L, L] fp32
        y = self._scan_all(x, dt, A, B, C, P_attn, v)
        return self._output(y, x, z, h.dtype)

    def _scan_all(
        self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, P_attn: Tensor, v: Tensor
    ) -> Tensor:
        """Every head's ``y`` (before the ``D`` skip): the SSM heads' scan, the swapped heads'
        ``P @ v``; through ``hook_pattern`` when it is hooked."""
        materialize = has_hooks(self.hook_pattern)
        heads, rows = self._selection(x.shape[1], x.device) if materialize else (None, None)
        index: Tensor = self.attn_index  # type: ignore[assignment]
        y = self._scanned(x, dt, A, B, C, materialize, heads, rows)
        if y is not None:
            y_attn = torch.einsum("bhqk,bkhp->bqhp", P_attn.to(v.dtype), v)
            y = y.index_copy(2, index, y_attn.to(y.dtype))
        if not materialize:
            assert y is not None
            return y
        self._check_dtype(x.dtype)
        y_sel = mixed_pattern_output(self, dt, A, B, C, P_attn, x, v, heads, rows)
        return scatter_rows_heads(y, y_sel, heads, rows, head_dim=2)

    # ------------------------------------------------------------------ incremental
    def prefix_state(self, acts: Mapping[str, Tensor], length: int) -> StepState:
        """Mamba-2's state, plus the swapped heads' keys and values and the last
        ``d_conv - 1`` inputs of their convolution."""
        out = super().prefix_state(acts, length)
        P = length
        out["attn_conv"] = conv_tail(acts["hook_attn_in"], P, self.cfg.d_conv - 1)
        out["k"], out["v"] = acts["hook_k"][:, :P], acts["hook_v"][:, :P]
        return out

    def step(self, state: StepState, h: Float[Tensor, "batch 1 d_model"]) -> Tensor:
        """One token after the prefix (the same hook points as :meth:`forward`, ``pos = 1``;
        not ``hook_pattern`` or ``hook_ssm_state``)."""
        self._refuse_step_patterns()
        z, x, y = self._step_scan(state, h)
        pre = self.hook_attn_in(self.attn_proj(h))
        window = torch.cat([state["attn_conv"].to(pre.dtype), pre], dim=1)
        q, k, v = self._split(F.silu(conv_last(window, self.attn_conv)))
        k = torch.cat([state["k"].to(k.dtype), k], dim=1)
        v = torch.cat([state["v"].to(v.dtype), v], dim=1)
        P_attn = self._attend(q, k, None)
        y_attn = torch.einsum("bhqk,bkhp->bqhp", P_attn.to(v.dtype), v)
        y = y.index_copy(2, self.attn_index, y_attn.to(y.dtype))  # type: ignore[arg-type]
        return self._output(y, x, z, h.dtype)

    def extra_repr(self) -> str:
        return f"attention_heads={self.attn_heads}"


def swapped_heads_of(model: "HookedSSM") -> list[tuple[int, int]]:
    """``(layer, head)`` of every swapped head of ``model`` (a HookedSSM)."""
    out = []
    for layer, block in enumerate(getattr(model, "blocks", [])):
        mixer = getattr(block, "mixer", None)
        if isinstance(mixer, SwappedMamba2Mixer):
            out += [(layer, h) for h in mixer.attn_heads]
    return out
