"""Causal grouped-query attention of the hybrids, with TransformerBridge hook names.

Its pattern is the softmax itself: when anything hooks ``hook_attn_scores`` or ``hook_pattern``
(a cache, an edit, a mask) the forward computes the scores and the pattern explicitly and runs
them through those hooks. Otherwise, on an unpadded input, it takes the fused path
(``torch.nn.functional.scaled_dot_product_attention``, what Hugging Face runs by default): the same
function up to float rounding, without a ``[batch, head, pos, pos]`` tensor. Every other hook
(``hook_q`` ... ``hook_z``) fires on both paths. Its single-token step reads the prefix's rotated
keys and values.
"""

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.models.config import SSMConfig
from gna_lens.models.mixers.base import StepState, checked_pattern, has_hooks

__all__ = ["Attention", "AttentionHeads", "allowed_keys", "causal_attention", "rotate"]

#: RoPE's ``(cos, sin)`` ``[pos, rotary_dim]``, or ``None`` (no rotation, as in Nemotron-H).
Rope = tuple[Tensor, Tensor] | None


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: Tensor, rope: Rope, rotary_dim: int) -> Tensor:
    """RoPE on the first ``rotary_dim`` channels of ``x`` ``[batch, pos, head, d_head]``
    (``rope=None``: no rotation, as in Nemotron-H)."""
    if rope is None:
        return x
    cos, sin = rope
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x_rot * c + _rotate_half(x_rot) * s, x_pass], dim=-1)


def allowed_keys(length: int, mask: Tensor | None, device: torch.device) -> Tensor:
    """The keys each query may read, ``[1 | batch, 1, query, key]``: causal, without padding."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    return allowed if mask is None else allowed & mask.bool()[:, None, None, :]


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> Float[Tensor, "batch pos head d_head"]:
    """Causal softmax attention ``[batch, pos, head, d_head]`` of per-head ``q``, ``k``, ``v``
    (``scaled_dot_product_attention`` in ``v``'s dtype). With a padding ``mask`` ``[batch, pos]``
    the masked keys get ``finfo.min`` added, as an explicit softmax fills them, so a query with
    no key left (left padding) averages every value."""
    dtype = v.dtype
    qh, kh, vh = q.to(dtype).transpose(1, 2), k.to(dtype).transpose(1, 2), v.transpose(1, 2)
    if mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        allowed = allowed_keys(q.shape[1], mask, q.device)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=q.device)
        bias = bias.masked_fill(~allowed, torch.finfo(dtype).min)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale)
    return out.transpose(1, 2)


class AttentionHeads:
    """Attention heads inside an SSM mixer (:class:`~gna_lens.models.mixers.hybrid.HybridMixer`,
    :class:`~gna_lens.models.mixers.teacher_heads.TeacherHeadsMixer`): RoPE, the grouped-query
    KV heads, the explicit softmax (``hook_attn_scores``) and the fused path.

    The mixer provides ``cfg``, ``attn_heads`` (sorted), ``kv_heads`` (sorted), the buffer
    ``attn_kv`` (each attention head's index in ``kv_heads``), ``scale``, the projections
    ``q_proj`` (a ``d_head`` row block per attention head), ``k_proj`` and ``v_proj`` (per KV
    head), and calls :meth:`_add_attention_hooks`.
    """

    cfg: SSMConfig
    attn_heads: list[int]
    kv_heads: list[int]
    attn_kv: Tensor
    scale: float
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear

    def _add_attention_hooks(self) -> None:
        """The attention heads' hook points (shapes in the comments)."""
        self.hook_q = HookPoint()  # [batch, pos, attn_head, d_head]
        self.hook_k = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_v = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_rot_q = HookPoint()  # [batch, pos, attn_head, d_head]
        self.hook_rot_k = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_attn_scores = HookPoint()  # [batch, attn_head, query_pos, key_pos]

    def _rope(self, x: Tensor, rope: Rope) -> Tensor:
        return rotate(x, rope, self.cfg.rotary_dim)

    def _qkv(self, h: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        """The attention heads' rotated queries, rotated keys and values (KV heads)."""
        b, L, _ = h.shape
        d, n, kv = self.cfg.d_head, len(self.attn_heads), len(self.kv_heads)
        q = self.hook_q(self.q_proj(h).view(b, L, n, d))
        k = self.hook_k(self.k_proj(h).view(b, L, kv, d))
        v = self.hook_v(self.v_proj(h).view(b, L, kv, d))
        return self.hook_rot_q(self._rope(q, rope)), self.hook_rot_k(self._rope(k, rope)), v

    def _per_head(self, t: Tensor) -> Tensor:
        """KV heads -> one entry per attention head (axis 2)."""
        if len(self.kv_heads) == len(self.attn_heads):  # sorted, distinct: the identity
            return t
        return t.index_select(2, self.attn_kv)

    def _attend(self, q: Tensor, k: Tensor, allowed: Tensor | None) -> Tensor:
        """``hook_attn_scores`` and the softmax pattern ``[batch, attn_head, query, key]``."""
        scores = torch.einsum("bqhd,bkhd->bhqk", q, self._per_head(k)) * self.scale
        if allowed is not None:
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        scores = self.hook_attn_scores(scores)
        return torch.softmax(scores.float(), dim=-1).to(q.dtype)

    def _fused_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Causal softmax attention of the attention heads (:func:`causal_attention`),
        ``[batch, pos, attn_head, d_head]``; masked keys get ``finfo.min`` as :meth:`_attend`
        gives them, so a query with no key left (left padding) averages every value."""
        return causal_attention(q, self._per_head(k), self._per_head(v), mask, self.scale)


class Attention(nn.Module):
    """Causal grouped-query attention with (partial) RoPE; TransformerBridge hook names."""

    #: The hook points whose full-prompt activations :meth:`prefix_state` reads.
    prefix_hooks: tuple[str, ...] = ("hook_rot_k", "hook_v")

    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.cfg = cfg
        H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
        self.q_proj = nn.Linear(cfg.d_model, H * d, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(cfg.d_model, KV * d, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(cfg.d_model, KV * d, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(H * d, cfg.d_model, bias=cfg.attn_bias)
        self.last_path: dict[str, str] = {}  # {"attention": "torch.sdpa" | "materialized"}
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

    def _qkv(self, h: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries and keys, and values, through their hook points."""
        cfg = self.cfg
        b, L, _ = h.shape
        H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
        q = self.hook_q(self.q_proj(h).view(b, L, H, d))
        k = self.hook_k(self.keys(h).view(b, L, KV, d))
        v = self.hook_v(self.v_proj(h).view(b, L, KV, d))
        q = self.hook_rot_q(self._rope(q, rope))
        k = self.hook_rot_k(self._rope(k, rope))
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None) -> Tensor:
        """Scores, ``hook_pattern``, ``hook_z`` and ``o_proj`` (``allowed``: the key mask)."""
        cfg = self.cfg
        b, L = q.shape[:2]
        H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
        if KV != H:
            k = k.repeat_interleave(H // KV, dim=2)
            v = v.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        if allowed is not None:
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        scores = self.hook_attn_scores(scores)
        pattern = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        pattern = checked_pattern(self.hook_pattern(pattern), pattern, self.hook_pattern.name)
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return cast("Tensor", self.o_proj(z.reshape(b, L, H * d)))

    def forward(self, h: Tensor, mask: Tensor | None, rope: Rope) -> Tensor:
        q, k, v = self._qkv(h, rope)
        if mask is None and not (has_hooks(self.hook_attn_scores) or has_hooks(self.hook_pattern)):
            self.last_path = {"attention": "torch.sdpa"}
            return self._fused(q, k, v)
        self.last_path = {"attention": "materialized"}
        return self._attend(q, k, v, allowed_keys(h.shape[1], mask, h.device))

    def _fused(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention without the pattern tensor (nothing reads it): ``hook_z`` and
        ``o_proj``."""
        cfg = self.cfg
        b, L = q.shape[:2]
        H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
        z = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.scale,
            enable_gqa=KV != H,
        ).transpose(1, 2)
        z = self.hook_z(z)
        return cast("Tensor", self.o_proj(z.reshape(b, L, H * d)))

    def keys(self, h: Tensor) -> Tensor:
        """``k_proj(h)`` (times Falcon-H1's key_multiplier)."""
        m = self.cfg.key_multiplier
        k = self.k_proj(h)
        return cast("Tensor", k if m == 1.0 else k * m)

    def _rope(self, x: Tensor, rope: Rope) -> Tensor:
        """Rotate ``x`` (``rope=None``: no positional rotation, as in Nemotron-H)."""
        return rotate(x, rope, self.cfg.rotary_dim)

    def prefix_state(self, acts: Mapping[str, Tensor], length: int) -> StepState:
        """The rotated keys and the values of the first ``length`` positions.

        Args:
            acts: The full prompt's ``hook_rot_k`` and ``hook_v`` (``[G, L, kv_head, d_head]``).
            length: The prefix length ``P``.

        Returns:
            ``{"k": [G, P, kv_head, d_head], "v": [G, P, kv_head, d_head]}``.
        """
        return {"k": acts["hook_rot_k"][:, :length], "v": acts["hook_v"][:, :length]}

    def step(self, state: StepState, h: Tensor, rope: Rope) -> Tensor:
        """One token after the prefix (``rope``: its position's rotation): ``[batch, 1, d_model]``.

        Fires the same hook points as :meth:`forward`, with ``query_pos = 1`` and every key.
        """
        q, k, v = self._qkv(h, rope)
        k = torch.cat([state["k"].to(k.dtype), k], dim=1)
        v = torch.cat([state["v"].to(v.dtype), v], dim=1)
        return self._attend(q, k, v, None)
