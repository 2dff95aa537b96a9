"""HookedSSM: Mamba-1, Mamba-2 and the Bamba, Nemotron-H, Granite 4.0 and Falcon-H1 hybrids with
TransformerLens hooks.

The mixers are re-implemented in PyTorch (see :mod:`gna_lens.models.ops`) so that every
intermediate is a :class:`~transformer_lens.hook_points.HookPoint` and so that the implicit
attention of each SSM layer can be materialized as an *editable* ``hook_pattern``: when anything
hooks ``blocks.{l}.mixer.hook_pattern`` that layer computes ``y = pattern @ x + D x`` from the
(possibly edited) matrix; otherwise it runs a fast scan.
"""

import difflib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from gna_lens.errors import ConfigError, HookError, InterventionError, PatternEditError
from gna_lens.models import ops
from gna_lens.models.config import SUPPORTED_MODEL_TYPES, SSMConfig

__all__ = ["HookedSSM"]

_EXACT_DTYPES = (torch.float32, torch.float64)

# Which positions / heads of a pattern to materialize: ``None`` means all.
PatternSelection = tuple[Tensor | None, Tensor | None]

#: Mamba-1 channel groups: ``None`` (single channels), an int (contiguous blocks of that many
#: channels in every SSM layer) or ``{layer: int | [[channel, ...], ...]}``.
HeadGroupsSpec = int | Mapping[int, int | Sequence[Sequence[int]]] | None


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (fp32 statistics, as the reference implementations)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def _has_hooks(hook: HookPoint) -> bool:
    return bool(hook.fwd_hooks or hook.bwd_hooks)


def _checked_pattern(edited: Any, original: Tensor, name: str | None) -> Tensor:
    """Refuse a pattern edit that cannot take effect exactly."""
    if not isinstance(edited, Tensor) or edited.shape != original.shape:
        got = tuple(edited.shape) if isinstance(edited, Tensor) else type(edited).__name__
        raise PatternEditError(
            f"A hook on {name} returned a pattern of shape {got}; expected "
            f"{tuple(original.shape)} [batch, head_index, query_pos, key_pos] (the shape it was "
            "given). Edit the tensor in place or return a tensor of the same shape."
        )
    return edited.to(original.dtype)


def _state_through_hook(hook: HookPoint, states: Tensor) -> tuple[Tensor, bool]:
    """Pass ``states`` through ``hook``; also say whether the hook edited them.

    Edited: the hook returned another tensor, or changed this one in place (torch's version
    counter moved). A caching hook (``run_with_cache``) returns ``None`` and edits nothing.
    """
    version = states._version  # type: ignore[attr-defined]
    out = hook(states)
    return out, out is not states or states._version != version  # type: ignore[attr-defined]


class _SSMMixerBase(nn.Module):
    """Shared pattern-selection and materialization logic of the SSM mixers."""

    cfg: SSMConfig
    hook_pattern: HookPoint
    hook_ssm_state: HookPoint

    def __init__(self) -> None:
        super().__init__()
        self.pattern_heads: Tensor | None = None
        self.pattern_rows: list[int] | None = None
        #: Head and query-position indices of the last materialized pattern (``None`` = all).
        self.last_pattern_index: PatternSelection = (None, None)

    def _selection(self, length: int, device: torch.device) -> PatternSelection:
        heads = None if self.pattern_heads is None else self.pattern_heads.to(device)
        rows = None
        if self.pattern_rows is not None:
            bad = [r for r in self.pattern_rows if not -length <= r < length]
            if bad:
                raise InterventionError(
                    f"pattern_selection(query_positions={self.pattern_rows!r}): positions {bad} "
                    f"are out of range for this input of {length} positions (valid: {-length} "
                    f"to {length - 1}; negative counts from the end). Fix: pass positions of the "
                    "input you run, or 'last'."
                )
            resolved = sorted({r % length for r in self.pattern_rows})
            rows = torch.tensor(resolved, dtype=torch.long, device=device)
        self.last_pattern_index = (heads, rows)
        return heads, rows

    def _refuse_state_edit(self) -> None:
        """A state edit and a materialized pattern in one forward: the edit would be dropped."""
        raise PatternEditError(
            f"A hook on {self.hook_ssm_state.name} edited the SSM states while "
            f"{self.hook_pattern.name} is hooked in the same forward pass. With hook_pattern "
            "hooked, the layer's output is computed from the pattern (y = pattern @ x + D x), "
            "which is built from dt, A, B and C, not from the states, so the state edit would be "
            "silently discarded (for the materialized heads and rows). Fix: run the state edit "
            "and the pattern hook in separate forward passes, or express the edit on the pattern "
            "only (or on hook_ssm_input / hook_ssm_dt / hook_ssm_B / hook_ssm_C, which both paths "
            "read). Reading the states (run_with_cache) together with the pattern is fine."
        )

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in _EXACT_DTYPES:
            raise PatternEditError(
                f"{self.hook_pattern.name} is hooked but the model runs in {dtype}; the "
                "materialized path computes y = pattern @ x + D x exactly only in float32 or "
                "float64. Fix: model.to(torch.float32) before reading or editing hook_pattern."
            )


class Mamba1Mixer(_SSMMixerBase):
    """Mamba-1 (S6) mixer, optionally with FalconMamba's weightless norms on ``dt``, ``B``, ``C``.

    "Heads" are channels: ``hook_pattern`` is ``[batch, d_inner, query_pos, key_pos]`` and
    ``hook_z`` is ``[batch, pos, d_inner, 1]``.
    """

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.cfg = cfg
        E, N, R = cfg.d_inner, cfg.d_state, cfg.dt_rank
        self.in_proj = nn.Linear(cfg.d_model, 2 * E, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(
            E, E, cfg.d_conv, groups=E, padding=cfg.d_conv - 1, bias=cfg.conv_bias
        )
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, E, bias=True)
        self.A_log = nn.Parameter(torch.zeros(E, N))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, cfg.d_model, bias=cfg.proj_bias)
        self.falcon = cfg.architecture == "falcon_mamba"
        self.hook_in_proj = HookPoint()  # [batch, pos, 2 * d_inner]
        self.hook_conv = HookPoint()  # [batch, pos, d_inner], before SiLU
        self.hook_ssm_input = HookPoint()  # [batch, pos, d_inner]
        self.hook_ssm_dt = HookPoint()  # [batch, pos, d_inner], Δ after softplus
        self.hook_ssm_B = HookPoint()  # [batch, pos, d_state]
        self.hook_ssm_C = HookPoint()  # [batch, pos, d_state]
        self.hook_ssm_state = HookPoint()  # [batch, pos, d_inner, d_state]
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_ssm_out = HookPoint()  # [batch, pos, d_inner], y + D u
        self.hook_gate = HookPoint()  # [batch, pos, d_inner], z before SiLU
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_head=1]

    def forward(
        self, h: Float[Tensor, "batch pos d_model"], mask: Tensor | None
    ) -> Float[Tensor, "batch pos d_model"]:
        b, L, _ = h.shape
        if mask is not None:
            h = h * mask[..., None].to(h.dtype)
        xs, z = self.hook_in_proj(self.in_proj(h)).chunk(2, dim=-1)
        conv = ops.causal_conv1d(xs.transpose(1, 2), self.conv1d.weight, self.conv1d.bias)
        u = F.silu(self.hook_conv(conv.transpose(1, 2)))
        if mask is not None:
            u = u * mask[..., None].to(u.dtype)
        u = self.hook_ssm_input(u)
        dt_low, B, C = torch.split(
            self.x_proj(u), [self.cfg.dt_rank, self.cfg.d_state, self.cfg.d_state], dim=-1
        )
        if self.falcon:
            eps = self.cfg.mixer_rms_eps
            dt_low, B, C = (ops.rms_norm(t, None, eps) for t in (dt_low, B, C))
        delta = self.hook_ssm_dt(F.softplus(self.dt_proj(dt_low)))
        B, C = self.hook_ssm_B(B), self.hook_ssm_C(C)
        A = -torch.exp(self.A_log.float())
        y = self._scan(u, delta, A, B, C)
        y = self.hook_ssm_out(y + u * self.D)
        z = self.hook_gate(z)
        head_in = self.hook_z((y * F.silu(z)).view(b, L, -1, 1))
        return self.out_proj(head_in.view(b, L, -1).to(h.dtype))

    def _scan(self, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        materialize = _has_hooks(self.hook_pattern)
        heads, rows = self._selection(u.shape[1], u.device) if materialize else (None, None)
        y: Tensor | None = None
        if _has_hooks(self.hook_ssm_state):
            _, states = ops.mamba1_scan(u, delta, A, B, C, self.cfg.chunk_size, return_states=True)
            assert states is not None
            states, edited = _state_through_hook(self.hook_ssm_state, states)
            if edited and materialize:
                self._refuse_state_edit()
            y = torch.einsum("blen,bln->ble", states, C)
        elif not materialize or heads is not None or rows is not None:
            y, _ = ops.mamba1_scan(u, delta, A, B, C, self.cfg.chunk_size)
        if not materialize:
            assert y is not None
            return y
        self._check_dtype(u.dtype)
        d_sel = delta if heads is None else delta.index_select(-1, heads)
        A_sel = A if heads is None else A.index_select(0, heads)
        u_sel = u if heads is None else u.index_select(-1, heads)
        pattern = ops.mamba1_pattern(d_sel, A_sel, B, C, rows).to(u.dtype)
        pattern = _checked_pattern(self.hook_pattern(pattern), pattern, self.hook_pattern.name)
        y_sel = torch.einsum("berj,bje->bre", pattern, u_sel)  # [b, R, e]
        return _scatter_rows_heads(y, y_sel, heads, rows, head_dim=-1)


class Mamba2Mixer(_SSMMixerBase):
    """Mamba-2 (SSD) mixer with grouped ``B``/``C`` and the gated RMSNorm.

    ``hook_pattern`` is ``[batch, head_index, query_pos, key_pos]`` in the form
    ``M = (C_i · B_j) exp(A Σ_{k=j+1..i} dt_k) dt_j`` (``y = M @ x + D x``).
    """

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.cfg = cfg
        E, H, G, N = cfg.d_inner, cfg.n_heads, cfg.n_groups, cfg.d_state
        self.conv_dim = E + 2 * G * N
        self.in_proj = nn.Linear(cfg.d_model, E + self.conv_dim + H, bias=cfg.proj_bias)
        if cfg.ssm_multipliers:  # Falcon-H1's muP vector over the sections z, x, B, C, dt
            mz, mx, mb, mc, mdt = cfg.ssm_multipliers
            mup = torch.cat(
                [torch.full((n,), float(v)) for n, v in ((E, mz), (E, mx), (G * N, mb))]
                + [torch.full((G * N,), float(mc)), torch.full((H,), float(mdt))]
            )
            self.register_buffer("mup_vector", mup, persistent=False)
        else:
            self.mup_vector = None
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            cfg.d_conv,
            groups=self.conv_dim,
            padding=cfg.d_conv - 1,
            bias=cfg.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        if cfg.mamba_norm != "none":
            self.norm = RMSNorm(E, cfg.eps)
        out_bias = cfg.proj_bias if cfg.out_proj_bias is None else cfg.out_proj_bias
        self.out_proj = nn.Linear(E, cfg.d_model, bias=out_bias)
        self.register_buffer("head_group", torch.arange(H) // (H // G), persistent=False)
        self.hook_in_proj = (
            HookPoint()
        )  # [batch, pos, 2 * d_inner + 2 * n_groups * d_state + n_heads]
        self.hook_conv = HookPoint()  # [batch, pos, conv_dim], before SiLU
        self.hook_ssm_input = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_ssm_dt = HookPoint()  # [batch, pos, head_index]
        self.hook_ssm_B = HookPoint()  # [batch, pos, n_groups, d_state]
        self.hook_ssm_C = HookPoint()  # [batch, pos, n_groups, d_state]
        self.hook_ssm_state = HookPoint()  # [batch, pos, head_index, d_head, d_state]
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_ssm_out = HookPoint()  # [batch, pos, head_index, d_head], y + D x
        self.hook_gate = HookPoint()  # [batch, pos, d_inner], z before SiLU
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_head]

    def forward(
        self, h: Float[Tensor, "batch pos d_model"], mask: Tensor | None
    ) -> Float[Tensor, "batch pos d_model"]:
        cfg = self.cfg
        b, L, _ = h.shape
        E, H, G, N, P = cfg.d_inner, cfg.n_heads, cfg.n_groups, cfg.d_state, cfg.d_head
        if mask is not None:
            h = h * mask[..., None].to(h.dtype)
        z, xBC, dt_raw = self.project(h).split([E, self.conv_dim, H], dim=-1)
        conv = ops.causal_conv1d(xBC.transpose(1, 2), self.conv1d.weight, self.conv1d.bias)
        xBC = F.silu(self.hook_conv(conv.transpose(1, 2)))
        if mask is not None:
            xBC = xBC * mask[..., None].to(xBC.dtype)
        x, B, C = xBC.split([E, G * N, G * N], dim=-1)
        x = self.hook_ssm_input(x.reshape(b, L, H, P))
        B = self.hook_ssm_B(B.reshape(b, L, G, N))
        C = self.hook_ssm_C(C.reshape(b, L, G, N))
        lo, hi = cfg.time_step_limit
        dt = F.softplus(dt_raw + self.dt_bias).clamp(min=lo, max=hi)
        dt = self.hook_ssm_dt(dt)
        A = -torch.exp(self.A_log.float())
        y = self._scan(x, dt, A, B, C)
        y = self.hook_ssm_out(y + x * self.D[:, None])
        normed = self.gate_norm(y.reshape(b, L, E), self.hook_gate(z))
        head_in = self.hook_z(normed.view(b, L, H, P))
        return self.out_proj(head_in.reshape(b, L, E).to(h.dtype))

    def project(self, h: Tensor) -> Tensor:
        """``hook_in_proj``: ``in_proj`` of the input (with Falcon-H1's multipliers)."""
        m = self.cfg.ssm_in_multiplier
        out = self.in_proj(h if m == 1.0 else h * m)
        if self.mup_vector is not None:
            out = out * self.mup_vector
        return self.hook_in_proj(out)

    def gate_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """The gated output norm of ``y`` ``[..., E]`` (see ``SSMConfig.mamba_norm``)."""
        cfg = self.cfg
        E = cfg.d_inner
        if cfg.mamba_norm == "none":
            return y * F.silu(z)
        if cfg.mamba_norm == "gated":
            return ops.gated_rms_norm(y, z, self.norm.weight, E // cfg.n_groups, cfg.eps)
        # norm_gate: per-group RMSNorm of y, then the SiLU gate (Falcon-H1, fp32 as HF)
        shape = y.shape
        h = y.float().view(*shape[:-1], cfg.n_groups, E // cfg.n_groups)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.eps)
        h = self.norm.weight * h.view(shape)
        return (h * F.silu(z.float())).to(y.dtype)

    def _scan(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        materialize = _has_hooks(self.hook_pattern)
        heads, rows = self._selection(x.shape[1], x.device) if materialize else (None, None)
        y: Tensor | None = None
        if _has_hooks(self.hook_ssm_state):
            states = ops.mamba2_recurrent(x, dt, A, B, C)
            states, edited = _state_through_hook(self.hook_ssm_state, states)
            if edited and materialize:
                self._refuse_state_edit()
            Ch = C.repeat_interleave(self.cfg.n_heads // self.cfg.n_groups, dim=2)
            y = torch.einsum("blhpn,blhn->blhp", states, Ch)
        elif not materialize or heads is not None or rows is not None:
            y = ops.mamba2_ssd(x, dt, A, B, C, self.cfg.chunk_size)
        if not materialize:
            assert y is not None
            return y
        self._check_dtype(x.dtype)
        head_group: Tensor = self.head_group  # type: ignore[assignment]
        dt_sel, A_sel, x_sel, hg = dt, A, x, head_group
        if heads is not None:
            dt_sel, A_sel = dt.index_select(2, heads), A.index_select(0, heads)
            x_sel, hg = x.index_select(2, heads), head_group.index_select(0, heads)
        pattern = ops.mamba2_pattern(dt_sel, A_sel, B, C, hg, rows).to(x.dtype)
        pattern = _checked_pattern(self.hook_pattern(pattern), pattern, self.hook_pattern.name)
        y_sel = torch.einsum("bhrj,bjhp->brhp", pattern, x_sel)
        return _scatter_rows_heads(y, y_sel, heads, rows, head_dim=2)


def _scatter_rows_heads(
    y: Tensor | None, y_sel: Tensor, heads: Tensor | None, rows: Tensor | None, head_dim: int
) -> Tensor:
    """Write the materialized rows / heads ``y_sel`` into the fast-path output ``y``."""
    if heads is None and rows is None:
        return y_sel
    assert y is not None
    out = y.clone()
    if rows is None:
        out.index_copy_(head_dim, heads, y_sel)  # type: ignore[arg-type]
        return out
    block = out.index_select(1, rows)
    if heads is None:
        block = y_sel
    else:
        block.index_copy_(head_dim, heads, y_sel)
    out.index_copy_(1, rows, block)
    return out


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention with (partial) RoPE; TransformerBridge hook names."""

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.cfg = cfg
        H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
        self.q_proj = nn.Linear(cfg.d_model, H * d, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(cfg.d_model, KV * d, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(cfg.d_model, KV * d, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(H * d, cfg.d_model, bias=cfg.attn_bias)
        self.hook_q = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_k = HookPoint()  # [batch, pos, kv_head_index, d_head]
        self.hook_v = HookPoint()  # [batch, pos, kv_head_index, d_head]
        self.hook_rot_q = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_rot_k = HookPoint()  # [batch, pos, kv_head_index, d_head]
        self.hook_attn_scores = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_head]
        #: Score scale: ``attn_d_head ** -0.5``, or the family's (Granite's attention_multiplier).
        self.scale = float(cfg.attn_scale or d**-0.5)

    def forward(self, h: Tensor, mask: Tensor | None, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        cfg = self.cfg
        b, L, _ = h.shape
        H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
        q = self.hook_q(self.q_proj(h).view(b, L, H, d))
        k = self.hook_k(self.keys(h).view(b, L, KV, d))
        v = self.hook_v(self.v_proj(h).view(b, L, KV, d))
        q = self.hook_rot_q(self._rope(q, rope))
        k = self.hook_rot_k(self._rope(k, rope))
        if KV != H:
            k = k.repeat_interleave(H // KV, dim=2)
            v = v.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        allowed = torch.ones(L, L, dtype=torch.bool, device=h.device).tril()[None, None]
        if mask is not None:
            allowed = allowed & mask.bool()[:, None, None, :]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        scores = self.hook_attn_scores(scores)
        pattern = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        pattern = _checked_pattern(self.hook_pattern(pattern), pattern, self.hook_pattern.name)
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return self.o_proj(z.reshape(b, L, H * d))

    def keys(self, h: Tensor) -> Tensor:
        """``k_proj(h)`` (times Falcon-H1's key_multiplier)."""
        m = self.cfg.key_multiplier
        k = self.k_proj(h)
        return k if m == 1.0 else k * m

    def _rope(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """Rotate ``x`` (``rope=None``: no positional rotation, as in Nemotron-H)."""
        if rope is None:
            return x
        cos, sin = rope
        r = self.cfg.rotary_dim
        x_rot, x_pass = x[..., :r], x[..., r:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x_rot * c + _rotate_half(x_rot) * s, x_pass], dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP (``down(SiLU(gate(x)) * up(x))``)."""

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        d_mlp = int(cfg.d_mlp or 0)
        self.gate_proj = nn.Linear(cfg.d_model, d_mlp, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, d_mlp, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]
        #: Falcon-H1's gate and down-projection multipliers.
        self.multipliers = tuple(float(v) for v in cfg.mlp_multipliers)

    def forward(self, x: Tensor) -> Tensor:
        gm, dm = self.multipliers
        gate = self.gate_proj(x)
        pre = self.hook_pre(gate if gm == 1.0 else gate * gm)
        lin = self.hook_pre_linear(self.up_proj(x))
        out = self.down_proj(self.hook_post(F.silu(pre) * lin))
        return out if dm == 1.0 else out * dm


def _mlp_act(name: str) -> Callable[[Tensor], Tensor]:
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    return F.silu


class PlainMLP(nn.Module):
    """Non-gated MLP ``down(act(up(x)))`` (Nemotron-H's MLP blocks and shared experts)."""

    def __init__(self, cfg: SSMConfig, d_mlp: int | None = None):
        super().__init__()
        d_mlp = int(d_mlp if d_mlp is not None else cfg.d_mlp or 0)
        self.up_proj = nn.Linear(cfg.d_model, d_mlp, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.act = _mlp_act(cfg.mlp_act)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.hook_post(self.act(self.hook_pre(self.up_proj(x)))))


class NemotronMoE(nn.Module):
    """Nemotron-H MoE: sigmoid top-k routing over expert groups, non-gated experts and a shared
    expert (``experts.up_proj`` / ``down_proj`` are ``[n_experts, out, in]``)."""

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.cfg = cfg
        E, D, M = cfg.n_experts, cfg.d_model, cfg.moe_d_mlp
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(E, D))
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.experts = nn.Module()
        self.experts.up_proj = nn.Parameter(torch.zeros(E, M, D))
        self.experts.down_proj = nn.Parameter(torch.zeros(E, D, M))
        self.shared_experts = PlainMLP(cfg, cfg.moe_shared_d_mlp)
        self.act = _mlp_act(cfg.mlp_act)
        self.hook_expert_weights = HookPoint()  # [batch, pos, n_experts], 0 where not routed

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        b, L, D = x.shape
        E, K = cfg.n_experts, cfg.n_experts_per_tok
        flat = x.reshape(-1, D)
        gate_w: Tensor = self.gate.weight  # type: ignore[assignment]
        bias: Tensor = self.gate.e_score_correction_bias  # type: ignore[assignment]
        scores = F.linear(flat.float(), gate_w.float()).sigmoid()
        choice = scores + bias
        G = cfg.moe_n_group
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=cfg.moe_topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask[:, :, None].expand(-1, G, E // G).reshape(-1, E).bool()
        idx = torch.topk(choice.masked_fill(~keep, float("-inf")), k=K, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if cfg.moe_norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.moe_routed_scaling_factor
        dense = torch.zeros_like(scores).scatter_(1, idx, w)
        dense = self.hook_expert_weights(dense.view(b, L, E)).reshape(-1, E)
        up: Tensor = self.experts.up_proj  # type: ignore[assignment]
        down: Tensor = self.experts.down_proj  # type: ignore[assignment]
        out = torch.zeros_like(flat, dtype=dense.dtype)
        for e in range(E):
            rows = (dense[:, e] != 0).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            h = F.linear(self.act(F.linear(flat[rows], up[e])), down[e])
            out.index_add_(0, rows, (h * dense[rows, e, None]).to(out.dtype))
        return out.to(x.dtype).view(b, L, D) + self.shared_experts(x)


class _GraniteSharedMLP(nn.Module):
    """Granite's shared MLP: ``output_linear(SiLU(gate) * up)``, ``gate, up = input_linear(x)``."""

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        d = cfg.moe_shared_d_mlp
        self.input_linear = nn.Linear(cfg.d_model, 2 * d, bias=False)
        self.output_linear = nn.Linear(d, cfg.d_model, bias=False)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the gate before SiLU
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        gate, up = self.hook_pre(gate), self.hook_pre_linear(up)
        return self.output_linear(self.hook_post(F.silu(gate) * up))


class _GraniteMoE(nn.Module):
    """Granite's routed experts: softmax over the top-k router logits, SwiGLU experts
    (``experts.gate_up_proj`` ``[n_experts, 2 * d_mlp, d_model]``, ``down_proj``)."""

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.cfg = cfg
        E, D, M = cfg.n_experts, cfg.d_model, int(cfg.d_mlp or 0)
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.zeros(E, D))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * M, D))
        self.experts.down_proj = nn.Parameter(torch.zeros(E, D, M))
        self.hook_expert_weights = HookPoint()  # [batch, pos, n_experts], 0 where not routed

    def forward(self, x: Tensor) -> Tensor:
        b, L, D = x.shape
        E, K = self.cfg.n_experts, self.cfg.n_experts_per_tok
        flat = x.reshape(-1, D)
        router_w: Tensor = self.router.weight  # type: ignore[assignment]
        logits = F.linear(flat, router_w).float()
        top, idx = logits.topk(K, dim=-1)
        w = torch.softmax(top, dim=-1).to(x.dtype)
        dense = torch.zeros_like(logits, dtype=x.dtype).scatter_(1, idx, w)
        dense = self.hook_expert_weights(dense.view(b, L, E)).reshape(-1, E)
        gate_up: Tensor = self.experts.gate_up_proj  # type: ignore[assignment]
        down: Tensor = self.experts.down_proj  # type: ignore[assignment]
        return _run_experts(flat, dense, gate_up, down, gated=True).view(b, L, D)


def _run_experts(
    flat: Tensor, dense: Tensor, up: Tensor, down: Tensor, gated: bool, act: Any = F.silu
) -> Tensor:
    """``sum_e dense[:, e] * expert_e(flat)`` over the experts some token is routed to."""
    out = torch.zeros_like(flat, dtype=dense.dtype)
    for e in range(dense.shape[1]):
        rows = (dense[:, e] != 0).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        h = F.linear(flat[rows], up[e])
        if gated:
            g, u = h.chunk(2, dim=-1)
            h = act(g) * u
        else:
            h = act(h)
        out.index_add_(0, rows, (F.linear(h, down[e]) * dense[rows, e, None]).to(out.dtype))
    return out.to(flat.dtype)


class GraniteMLP(nn.Module):
    """Granite 4.0 hybrid MLP: the routed experts (when the config has any) plus the shared MLP."""

    def __init__(self, cfg: SSMConfig, moe: bool):
        super().__init__()
        self.shared_mlp = _GraniteSharedMLP(cfg)
        self.block_sparse_moe = _GraniteMoE(cfg) if moe else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return out


def _make_mlp(cfg: SSMConfig, kind: str) -> nn.Module:
    if kind in ("granite", "granite_moe"):
        return GraniteMLP(cfg, moe=kind == "granite_moe")
    if kind == "gated":
        return GatedMLP(cfg)
    if kind == "plain":
        return PlainMLP(cfg)
    if kind == "moe":
        return NemotronMoE(cfg)
    raise ConfigError(f"internal: unknown MLP kind {kind!r}")


class SSMBlock(nn.Module):
    """One residual block: an SSM mixer or an attention layer, and/or an MLP.

    Layer kinds (``cfg.layer_types``): ``"ssm"`` and ``"attention"`` blocks have ``ln1`` and a
    mixer / attention, followed by ``ln2`` and an MLP when ``cfg.mlp_types`` gives the layer one
    (Bamba); ``"mlp"`` blocks (Nemotron-H) have only ``ln2`` and the MLP.
    """

    def __init__(self, cfg: SSMConfig, layer: int):
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
            self.mixer: Mamba1Mixer | Mamba2Mixer = (
                Mamba1Mixer(cfg)
                if cfg.architecture in ("mamba1", "falcon_mamba")
                else Mamba2Mixer(cfg)
            )
            self.hook_mixer_out = HookPoint()  # [batch, pos, d_model]
            if cfg.parallel_attention:  # Falcon-H1: attention beside the mixer
                self.attn = Attention(cfg)
                self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        #: Whether an attention runs in parallel with the SSM mixer (Falcon-H1).
        self.has_parallel_attn = self.has_mixer and not self.is_attention and cfg.parallel_attention
        mlp_kind = cfg.mlp_type(layer)
        self.has_mlp = bool(mlp_kind)
        if self.has_mlp:
            if self.has_mixer:
                self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
            self.ln2 = RMSNorm(cfg.d_model, cfg.eps)
            self.mlp = _make_mlp(cfg, mlp_kind)
            self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]

    def forward(
        self, resid: Tensor, mask: Tensor | None, rope: tuple[Tensor, Tensor] | None
    ) -> Tensor:
        resid = self.hook_resid_pre(resid)
        if self.has_mixer:
            normed = self.ln1(resid.to(self.ln1.weight.dtype))
            if self.cfg.residual_in_fp32:
                resid = resid.float()
            if self.is_attention:
                resid = resid + self.hook_attn_out(self.scaled(self.attn(normed, mask, rope)))
            elif self.has_parallel_attn:
                ssm = self.hook_mixer_out(self.scaled(self.mixer(normed, mask), "ssm"))
                attn_in = self.attn_input(normed)
                attn = self.hook_attn_out(self.scaled(self.attn(attn_in, mask, rope), "attention"))
                resid = resid + (ssm + attn)
            else:
                resid = resid + self.hook_mixer_out(self.scaled(self.mixer(normed, mask)))
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
        return self.hook_resid_post(resid)


ReturnType = Literal["logits", "loss", "both"] | None
ModelInput = str | list[str] | Int[Tensor, "batch pos"] | Float[Tensor, "batch pos d_model"]


class HookedSSM(HookedRootModule):
    """A Mamba-family language model with TransformerLens hooks and editable implicit attention.

    Supports ``MambaForCausalLM``, ``FalconMambaForCausalLM``, ``Mamba2ForCausalLM`` and the
    hybrids ``BambaForCausalLM``, ``NemotronHForCausalLM``, ``GraniteMoeHybridForCausalLM`` and
    ``FalconH1ForCausalLM`` (attention beside the SSM mixer in every layer).
    Logits match Hugging Face's to about 1e-6 in fp32.

    Hook points (shapes in the docs' hook table): ``hook_embed``;
    ``blocks.{l}.hook_resid_pre`` / ``hook_resid_post``; SSM layers ``blocks.{l}.hook_mixer_out``
    and ``blocks.{l}.mixer.{hook_in_proj, hook_conv, hook_ssm_input, hook_ssm_dt, hook_ssm_B,
    hook_ssm_C, hook_ssm_state, hook_pattern, hook_ssm_out, hook_gate, hook_z}``; attention layers
    (hybrids) ``blocks.{l}.hook_attn_out`` and ``blocks.{l}.attn.{hook_q, hook_k, hook_v,
    hook_rot_q, hook_rot_k, hook_attn_scores, hook_pattern, hook_z}``; hybrids also
    ``blocks.{l}.hook_resid_mid``, ``blocks.{l}.hook_mlp_out`` and ``blocks.{l}.mlp.hook_*``.

    Execution paths: a fast scan (chunked SSD for Mamba-2, a chunked parallel scan for Mamba-1)
    runs unless ``hook_pattern`` (or ``hook_ssm_state``) of a layer is hooked; then that layer
    materializes its implicit attention, passes it through the hook and computes the output
    from the returned matrix, so an edit changes the output. :meth:`pattern_selection`
    restricts materialization to some heads and query positions.

    Mamba-1 heads are single channels (``d_inner`` per layer) unless :meth:`set_head_groups` /
    :meth:`head_groups` make groups of channels the heads of every function that takes heads.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> logits, cache = model.run_with_cache("a b c", names_filter=lambda n: "pattern" in n)
        >>> cache["blocks.0.mixer.hook_pattern"].shape[1] == model.cfg.n_heads
        True
    """

    cfg: SSMConfig

    def __init__(self, cfg: SSMConfig, tokenizer: Any | None = None):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList([SSMBlock(cfg, layer) for layer in range(cfg.n_layers)])
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.unembed.weight = self.embed.weight
        if cfg.is_hybrid and cfg.use_rope:
            r = cfg.rotary_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
            self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        #: Resolved Mamba-1 channel groups, ``{layer: ((channel, ...), ...)}``; empty: every
        #: channel is its own head. Set with :meth:`set_head_groups` / :meth:`head_groups`.
        self._head_groups: dict[int, tuple[tuple[int, ...], ...]] = {}
        self.setup()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf_model(
        cls,
        hf_model: nn.Module,
        tokenizer: Any | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> "HookedSSM":
        """Build a HookedSSM from a loaded Hugging Face model (weights are copied).

        Args:
            hf_model: A ``MambaForCausalLM``, ``FalconMambaForCausalLM``, ``Mamba2ForCausalLM`` or
                ``BambaForCausalLM``.
            tokenizer: Its tokenizer (optional; needed for string inputs).
            dtype: Target dtype (default: the HF model's).
            device: Target device (default: the HF model's).

        Returns:
            The HookedSSM in eval mode.

        Raises:
            ConfigError: If the architecture is not supported.
        """
        config = getattr(hf_model, "config", None)
        if config is None:
            raise ConfigError(
                f"from_hf_model expects a Hugging Face PreTrainedModel with a .config; got "
                f"{type(hf_model).__name__}."
            )
        cfg = SSMConfig.from_hf_config(config)
        state = _convert_hf_state_dict(cfg, hf_model.state_dict())
        first = next(iter(hf_model.parameters()))
        cfg.dtype = dtype or first.dtype
        cfg.device = str(device or first.device)
        model = cls(cfg, tokenizer)
        model.load_state_dict(state, strict=True)
        return model.to(device=cfg.device, dtype=cfg.dtype).eval()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tokenizer: Any | None = None,
        **hf_kwargs: Any,
    ) -> "HookedSSM":
        """Load a Hugging Face checkpoint (hub name, or local directory) into a HookedSSM.

        Args:
            name_or_path: A hub name of a ``transformers``-format checkpoint
                (``state-spaces/mamba-130m-hf``) or a local directory holding ``config.json``
                and weights. Checkpoints in mamba_ssm's original format
                (``state-spaces/mamba2-130m``) load through :func:`gna_lens.load_model`, which
                converts them.
            dtype: Weights dtype; fp32 (default) or fp64 for exact pattern edits.
            device: Target device.
            tokenizer: A tokenizer to use instead of the checkpoint's.
            **hf_kwargs: Passed to ``AutoModelForCausalLM.from_pretrained``.

        Returns:
            The HookedSSM in eval mode.

        Raises:
            ConfigError: If the checkpoint's architecture is not supported.
        """
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(name_or_path)
        SSMConfig.from_hf_config(config)  # fail early, before loading weights
        hf_model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **hf_kwargs)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            except (OSError, ValueError):
                tokenizer = None
        model = cls.from_hf_model(hf_model, tokenizer, dtype=dtype, device=device)
        model.cfg.model_name = str(name_or_path)
        return model

    # ------------------------------------------------------------------ hooks
    def _check_hook_name(self, name: Any) -> None:
        if isinstance(name, str) and name not in self.hook_dict:
            close = difflib.get_close_matches(name, list(self.hook_dict), n=3, cutoff=0.6)
            hint = f" Did you mean {close}?" if close else ""
            raise HookError(
                f"{type(self).__name__} ({self.cfg.architecture}, {self.cfg.n_layers} layers) has no "
                f"hook point named {name!r}.{hint} List them with model.hook_dict.keys()."
            )

    def add_hook(self, name: Any, hook: Callable, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self._check_hook_name(name)
        super().add_hook(name, hook, *args, **kwargs)

    def _enable_hook_with_name(self, name: str, hook: Callable, dir: Literal["fwd", "bwd"]) -> None:
        self._check_hook_name(name)
        super()._enable_hook_with_name(name, hook, dir)

    def run_with_cache(  # type: ignore[override]
        self, *model_args: Any, names_filter: Any = None, **kwargs: Any
    ) -> tuple[Any, ActivationCache]:
        """Run the model and return ``(output, ActivationCache)``; see TransformerLens."""
        if isinstance(names_filter, str):
            self._check_hook_name(names_filter)
        elif isinstance(names_filter, list):
            for name in names_filter:
                self._check_hook_name(name)
        out, cache = super().run_with_cache(*model_args, names_filter=names_filter, **kwargs)
        has_batch = not kwargs.get("remove_batch_dim", False)
        return out, ActivationCache(cache, self, has_batch_dim=has_batch)

    @contextmanager
    def pattern_selection(
        self,
        heads: Sequence[int] | dict[int, Sequence[int]] | None = None,
        query_positions: Sequence[int] | Literal["last"] | None = None,
    ) -> Iterator["HookedSSM"]:
        """Materialize only some heads and query rows of the SSM patterns inside the block.

        The ``hook_pattern`` tensors then have shape ``[batch, len(heads), len(rows), key_pos]``
        (rows sorted, negative positions counted from the end); the other heads and rows run on
        the fast path. The indices used are in ``blocks[l].mixer.last_pattern_index``.

        Args:
            heads: Heads for every SSM layer, or ``{layer: heads}``; ``None`` for all heads.
            query_positions: Query positions, ``"last"`` for the final one, ``None`` for all.

        Yields:
            The model.

        Examples:
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba2")
            >>> with model.pattern_selection(heads=[0], query_positions="last"):
            ...     _, cache = model.run_with_cache("a b c d", names_filter="blocks.0.mixer.hook_pattern")
            >>> tuple(cache["blocks.0.mixer.hook_pattern"].shape[1:3])
            (1, 1)
        """
        rows = [-1] if query_positions == "last" else query_positions
        if rows is not None and (
            isinstance(rows, str)
            or not rows
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
        ):
            raise InterventionError(
                f"pattern_selection: query_positions={query_positions!r}; expected 'last', None or "
                "a non-empty list of int positions (negative counts from the end)."
            )
        mixers = self.ssm_mixers()
        per_layer = self._selection_heads(heads, list(mixers))
        saved = {i: (m.pattern_heads, m.pattern_rows) for i, m in mixers.items()}
        try:
            for i, m in mixers.items():
                layer_heads = per_layer.get(i)
                if layer_heads is not None:
                    m.pattern_heads = torch.tensor(layer_heads, dtype=torch.long)
                m.pattern_rows = None if rows is None else list(rows)
            yield self
        finally:
            for i, m in mixers.items():
                m.pattern_heads, m.pattern_rows = saved[i]

    def _selection_heads(
        self, heads: Sequence[int] | dict[int, Sequence[int]] | None, ssm_layers: list[int]
    ) -> dict[int, list[int]]:
        """Validate ``pattern_selection(heads=...)``; the sorted heads of each selected layer."""
        n = self.cfg.n_heads
        if heads is None:
            return {}
        if isinstance(heads, dict):
            bad_layers = [k for k in heads if k not in ssm_layers]
            if bad_layers:
                raise InterventionError(
                    f"pattern_selection(heads={heads!r}): layers {bad_layers} are not SSM layers "
                    f"of this {self.cfg.architecture} model; its SSM layers are {ssm_layers} (of "
                    f"{self.cfg.n_layers}). Fix: key the dict by SSM layer indices (attention "
                    "layers of a hybrid need no selection: their pattern is always materialized)."
                )
            per = dict(heads)
        else:
            per = {i: heads for i in ssm_layers}
        out: dict[int, list[int]] = {}
        for i, layer_heads in per.items():
            if isinstance(layer_heads, int | str) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in layer_heads
            ):
                raise InterventionError(
                    f"pattern_selection(heads={heads!r}): layer {i} gets {layer_heads!r}; expected "
                    "a list of int head indices, e.g. heads=[0, 3] or heads={1: [0, 3]}."
                )
            bad = [h for h in layer_heads if not 0 <= h < n]
            if bad or not layer_heads:
                raise InterventionError(
                    f"pattern_selection(heads={heads!r}): heads {bad or '[]'} of layer {i} are "
                    f"out of range; the SSM layers have {n} heads (valid: 0 to {n - 1}). Fix: "
                    "pass heads in that range, or heads=None for all."
                )
            out[i] = sorted(set(layer_heads))
        return out

    # ------------------------------------------------------------------ channel groups
    @property
    def head_group_spec(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """The current Mamba-1 channel groups, ``{layer: ((channel, ...), ...)}`` (a copy).

        Empty when every channel is its own head (the default). Layers not listed keep single
        channels.
        """
        return dict(getattr(self, "_head_groups", {}))

    def set_head_groups(self, groups: HeadGroupsSpec) -> None:
        """Make groups of Mamba-1 channels the heads of :func:`gna_lens.head_view`.

        Mamba-1 has no heads: each of its ``d_inner`` channels has its own implicit attention, so
        by default every channel is a head ``(layer, channel)`` (36,864 in mamba-130m). With
        groups, ``(layer, g)`` addresses group ``g`` of ``layer`` in every function that takes
        heads (ablation, sweeps, patching, attribution, masks, pattern scores, score_heads):
        ablating a group ablates all its channels, masking a group masks each of its channels'
        matrices, a group's attribution is the sum of its channels' and its pattern is the mean
        of its channels' row-normalized ``|α|`` (see :func:`gna_lens.heads.head_patterns`).

        The hook points do not change: ``hook_z`` and ``hook_pattern`` stay one entry per channel,
        and :meth:`pattern_selection` keeps taking channel indices. Use :meth:`head_groups` to
        group only inside a ``with`` block.

        Args:
            groups: ``None``: single channels (the default). An int ``k``: contiguous blocks of
                ``k`` channels in every SSM layer (``k`` must divide ``d_inner``; group ``g`` is
                channels ``g*k .. g*k+k-1``). A dict ``{layer: k}`` or ``{layer: [[c, ...], ...]}``:
                per layer, contiguous blocks or explicit disjoint channel sets (e.g. the small
                sets of channels reported as Mamba-1 G&A heads); a layer given explicit sets
                has exactly those heads, and layers not in the dict keep single channels.

        Raises:
            InterventionError: For a Mamba-2 / hybrid model (their SSM heads are real heads), or a
                malformed spec (a size that does not divide ``d_inner``, unknown layers,
                channels out of range, empty or overlapping sets).

        Examples:
            >>> from gna_lens import head_view
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba1")
            >>> head_view(model)[0].n_heads  # d_inner channels
            64
            >>> model.set_head_groups(16)
            >>> lh = head_view(model)[0]
            >>> lh.n_heads, lh.channels[1][:3]
            (4, (16, 17, 18))
            >>> model.set_head_groups({1: [[3, 40], [7]]})
            >>> [lh.n_heads for lh in head_view(model)]
            [64, 2]
            >>> model.set_head_groups(None)
        """
        self._head_groups = self._resolve_head_groups(groups)

    @contextmanager
    def head_groups(self, groups: HeadGroupsSpec) -> Iterator["HookedSSM"]:
        """:meth:`set_head_groups` inside a ``with`` block; the previous groups come back after.

        Examples:
            >>> from gna_lens import ablate_heads
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba1")
            >>> with model.head_groups(8), ablate_heads(model, [(0, 1)]):  # channels 8..15
            ...     logits = model("a b c")
            >>> model.head_group_spec
            {}
        """
        saved = self._head_groups
        self._head_groups = self._resolve_head_groups(groups)
        try:
            yield self
        finally:
            self._head_groups = saved

    def _resolve_head_groups(self, spec: HeadGroupsSpec) -> dict[int, tuple[tuple[int, ...], ...]]:
        cfg = self.cfg
        if spec is None:
            return {}
        if cfg.architecture not in ("mamba1", "falcon_mamba"):
            raise InterventionError(
                f"set_head_groups({spec!r}): this is a {cfg.architecture} model; channel groups "
                "are for Mamba-1 / FalconMamba, whose heads are single channels. Mamba-2 heads "
                "(and attention heads) are real heads already: address them as (layer, head)."
            )
        layers = list(self.ssm_mixers())
        E = cfg.d_inner
        if isinstance(spec, int) and not isinstance(spec, bool):
            per: Mapping[int, Any] = {layer: spec for layer in layers}
        elif isinstance(spec, Mapping):
            per = spec
        else:
            raise InterventionError(
                f"set_head_groups({spec!r}); expected None, an int block size (e.g. 16) or a "
                "dict {layer: block size or [[channel, ...], ...]}."
            )
        out: dict[int, tuple[tuple[int, ...], ...]] = {}
        for layer, item in per.items():
            if layer not in layers:
                raise InterventionError(
                    f"set_head_groups: layer {layer!r} is not an SSM layer of this "
                    f"{cfg.n_layers}-layer model (SSM layers: 0..{cfg.n_layers - 1})."
                )
            if isinstance(item, int) and not isinstance(item, bool):
                if item <= 0 or E % item:
                    divisors = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if E % k == 0]
                    raise InterventionError(
                        f"set_head_groups: block size {item} for layer {layer} does not divide "
                        f"d_inner={E}; expected a divisor, e.g. one of {divisors}. (For groups "
                        "of uneven size pass explicit channel sets.)"
                    )
                out[layer] = tuple(tuple(range(g, g + item)) for g in range(0, E, item))
                continue
            sets = self._channel_sets(layer, item, E)
            out[layer] = sets
        return out

    @staticmethod
    def _channel_sets(layer: int, item: Any, E: int) -> tuple[tuple[int, ...], ...]:
        bad_shape = isinstance(item, str | bytes) or not isinstance(item, Sequence) or not item
        if not bad_shape:
            bad_shape = any(
                isinstance(s, str | bytes)
                or not isinstance(s, Sequence | set | frozenset)
                or not s
                or not all(isinstance(c, int) and not isinstance(c, bool) for c in s)
                for s in item
            )
        if bad_shape:
            raise InterventionError(
                f"set_head_groups: layer {layer} gets {item!r}; expected a block size or a "
                "non-empty list of non-empty channel lists, e.g. {layer: [[3, 17, 40], [5, 6]]}."
            )
        sets = tuple(tuple(sorted(set(s))) for s in item)
        flat = [c for s in sets for c in s]
        out_of_range = sorted({c for c in flat if not 0 <= c < E})
        if out_of_range:
            raise InterventionError(
                f"set_head_groups: layer {layer} lists channels {out_of_range}, out of range for "
                f"d_inner={E} (valid: 0 to {E - 1})."
            )
        if len(flat) != len(set(flat)):
            twice = sorted({c for c in flat if flat.count(c) > 1})
            raise InterventionError(
                f"set_head_groups: channels {twice} of layer {layer} are in more than one set; "
                "groups must be disjoint (ablate overlapping sets as head sets instead)."
            )
        return sets

    def ssm_mixers(self) -> dict[int, "Mamba1Mixer | Mamba2Mixer"]:
        """The SSM mixer module of each SSM layer, keyed by layer index."""
        out: dict[int, Mamba1Mixer | Mamba2Mixer] = {}
        for i, block in enumerate(self.blocks):
            mixer = getattr(block, "mixer", None)
            if isinstance(mixer, Mamba1Mixer | Mamba2Mixer):
                out[i] = mixer
        return out

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input: ModelInput,
        *,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        return_type: ReturnType = "logits",
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        loss_per_token: bool = False,
    ) -> Any:
        """Run the model.

        Args:
            input: Text, a list of texts, token ids ``[batch, pos]``, or, with
                ``start_at_layer``, the residual stream ``[batch, pos, d_model]``.
            attention_mask: ``[batch, pos]`` with 0 on padding (computed for text input).
            return_type: ``"logits"``, ``"loss"``, ``"both"`` or ``None``.
            start_at_layer: Start from this block, treating ``input`` as its ``hook_resid_pre``.
            stop_at_layer: Stop before this block and return the residual stream.
            prepend_bos: For text input: prepend the BOS token (default: the tokenizer's own
                behaviour).
            padding_side: For a list of texts: ``"left"`` or ``"right"`` (default: the
                tokenizer's).
            loss_per_token: Return the per-token loss ``[batch, pos - 1]``.

        Returns:
            Logits ``[batch, pos, d_vocab]``, the loss, both, ``None``, or the residual stream when
            ``stop_at_layer`` is given.
        """
        self._check_layer_bound("start_at_layer", start_at_layer)
        self._check_layer_bound("stop_at_layer", stop_at_layer)
        tokens: Tensor | None = None
        if start_at_layer is None:
            if isinstance(input, Tensor) and input.is_floating_point():
                raise ValueError(
                    f"HookedSSM.forward got a float tensor of shape {tuple(input.shape)} without "
                    "start_at_layer; pass token ids [batch, pos], or the residual stream together "
                    "with start_at_layer=k."
                )
            tokens, text_mask = self._tokens_and_mask(input, prepend_bos, padding_side)
            if attention_mask is None:
                attention_mask = text_mask
            resid = self.embed_tokens(tokens)
        else:
            if not isinstance(input, Tensor) or input.ndim != 3:
                raise ValueError(
                    f"With start_at_layer={start_at_layer}, input must be the residual stream "
                    f"[batch, pos, d_model={self.cfg.d_model}]; got "
                    f"{tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__}."
                )
            resid = input
        mask = self._normalize_mask(attention_mask, resid.shape[:2])
        rope = self._rope(resid.shape[1], resid.device, resid.dtype) if self._uses_rope else None
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(resid, mask, rope)
        if stop_at_layer is not None:
            return resid
        logits = self.logits_of(resid)
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        if tokens is None:
            raise ValueError("return_type='loss' needs token input (not start_at_layer).")
        loss = _lm_loss(logits, tokens, mask, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"return_type={return_type!r}; expected 'logits', 'loss', 'both' or None.")

    def _check_layer_bound(self, what: str, layer: int | None) -> None:
        n = self.cfg.n_layers
        if layer is None:
            return
        if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer <= n:
            raise InterventionError(
                f"{what}={layer!r} is out of range for this {n}-layer model; expected an int "
                f"from {-n} to {n} (negative counts from the end, {n} = after the last block). "
                f"Fix: pass a layer index of this model, or None."
            )

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """``hook_embed``: the token embeddings (times Granite's embedding_multiplier)."""
        emb = self.embed(tokens)
        m = self.cfg.embedding_multiplier
        return self.hook_embed(emb if m == 1.0 else emb * m)

    def logits_of(self, resid: Tensor) -> Tensor:
        """Final norm and unembedding (logits divided by Granite's logits_scaling)."""
        logits = self.unembed(self.ln_final(resid.to(self.ln_final.weight.dtype)))
        s = self.cfg.logits_scaling
        return logits if s == 1.0 else logits / s

    @property
    def _uses_rope(self) -> bool:
        return bool(self.cfg.is_hybrid and self.cfg.use_rope)

    def _rope(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq: Tensor = self.rope_inv_freq  # type: ignore[assignment]
        freqs = torch.arange(length, device=device, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _normalize_mask(self, mask: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
        if mask is None:
            return None
        if tuple(mask.shape) != tuple(shape):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}; expected [batch, pos] = "
                f"{tuple(shape)} to match the input."
            )
        if bool((mask == 1).all()):
            return None
        return mask.to(self.embed.weight.device)

    # ------------------------------------------------------------------ tokens
    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                "This HookedSSM has no tokenizer; pass token ids, or load it with a tokenizer "
                "(HookedSSM.from_pretrained(..., tokenizer=tok) or model.tokenizer = tok)."
            )
        return self.tokenizer

    def _tokens_and_mask(
        self,
        input: str | list[str] | Tensor,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if isinstance(input, Tensor):
            tokens = input if input.ndim == 2 else input[None]
            return tokens.to(self.embed.weight.device), None
        texts = [input] if isinstance(input, str) else list(input)
        tok = self._require_tokenizer()
        rows: list[list[int]] = []
        for text in texts:
            ids = list(tok(text, add_special_tokens=prepend_bos is not False)["input_ids"])
            bos = tok.bos_token_id
            if prepend_bos and bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            rows.append(ids)
        width = max(len(r) for r in rows)
        side = padding_side or getattr(tok, "padding_side", "right")
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        tokens = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            tokens[i, sl] = torch.tensor(r, dtype=torch.long)
            mask[i, sl] = 1
        device = self.embed.weight.device
        return tokens.to(device), mask.to(device)

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Int[Tensor, "batch pos"]:
        """Tokenize text into ``[batch, pos]`` ids (padded on ``padding_side`` for lists).

        Args:
            input: A text or a list of texts.
            prepend_bos: Prepend BOS (default: the tokenizer's behaviour).
            padding_side: ``"left"`` or ``"right"`` for lists of texts.
            move_to_device: Accepted for TransformerLens compatibility (always on the model's
                device).
            truncate: Accepted for TransformerLens compatibility (SSMs have no context limit).

        Returns:
            Token ids.
        """
        del move_to_device, truncate
        return self._tokens_and_mask(input, prepend_bos, padding_side)[0]

    def to_str_tokens(self, input: str | Tensor, prepend_bos: bool | None = None) -> list[str]:
        """Split text (or a 1-D / ``[1, pos]`` token tensor) into its token strings."""
        tok = self._require_tokenizer()
        ids = self.to_tokens(input, prepend_bos=prepend_bos) if isinstance(input, str) else input
        flat = ids.reshape(-1).tolist()
        return [tok.decode([i]) for i in flat]

    def to_string(self, tokens: Tensor | list[int]) -> str | list[str]:
        """Decode token ids (``[pos]`` or ``[batch, pos]``) back to text."""
        tok = self._require_tokenizer()
        t = torch.as_tensor(tokens)
        if t.ndim == 2:
            return [tok.decode(row.tolist()) for row in t]
        return tok.decode(t.tolist())

    def to_single_token(self, string: str) -> int:
        """The id of ``string``, which must be exactly one token."""
        ids = self.to_tokens(string, prepend_bos=False)[0].tolist()
        if len(ids) != 1:
            raise ValueError(f"{string!r} is {len(ids)} tokens ({ids}); expected exactly one.")
        return int(ids[0])


def _lm_loss(logits: Tensor, tokens: Tensor, mask: Tensor | None, per_token: bool) -> Tensor:
    logprobs = logits[:, :-1].float().log_softmax(-1)
    nll = -logprobs.gather(-1, tokens[:, 1:, None])[..., 0]
    if per_token:
        return nll
    if mask is None:
        return nll.mean()
    valid = (mask[:, 1:] * mask[:, :-1]).to(nll.dtype)
    return (nll * valid).sum() / valid.sum().clamp(min=1)


_RENAMES: list[tuple[str, str]] = [
    (r"^backbone\.embeddings\.", "embed."),
    (r"^model\.embed_tokens\.", "embed."),
    (r"^backbone\.layers\.(\d+)\.norm\.", r"blocks.\1.ln1."),
    (r"^backbone\.layers\.(\d+)\.mixer\.", r"blocks.\1.mixer."),
    (r"^backbone\.norm_f\.", "ln_final."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blocks.\1.ln1."),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"blocks.\1.ln2."),
    (r"^model\.layers\.(\d+)\.mamba\.", r"blocks.\1.mixer."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"blocks.\1.attn."),
    (r"^model\.layers\.(\d+)\.feed_forward\.", r"blocks.\1.mlp."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blocks.\1.ln2."),
    (r"^model\.layers\.(\d+)\.(shared_mlp|block_sparse_moe)\.", r"blocks.\1.mlp.\2."),
    (r"^model\.norm\.", "ln_final."),
    (r"^model\.final_layernorm\.", "ln_final."),
    (r"^lm_head\.", "unembed."),
]


def _nemotron_renames(cfg: SSMConfig) -> list[tuple[str, str]]:
    """Nemotron-H: one ``norm`` and one ``mixer`` per block, named by the block's kind."""
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


def _convert_hf_state_dict(cfg: SSMConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a Hugging Face state dict to HookedSSM parameter names."""
    out: dict[str, Tensor] = {}
    renames = _nemotron_renames(cfg) if cfg.architecture == "nemotron_h" else _RENAMES
    for key, value in state.items():
        new = key
        for pattern, repl in renames:
            new, n = re.subn(pattern, repl, new)
            if n:
                break
        else:
            raise ConfigError(
                f"Unexpected weight {key!r} in a {cfg.hf_architecture or cfg.architecture} "
                f"checkpoint; HookedSSM knows {sorted(SUPPORTED_MODEL_TYPES)} layouts."
            )
        out[new] = value
    if "unembed.weight" not in out and "embed.weight" in out:
        out["unembed.weight"] = out["embed.weight"]
    return out
