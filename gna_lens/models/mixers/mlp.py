"""The MLP kinds of the blocks (``SSMConfig.mlp_types``): SwiGLU, plain, and the MoEs.

``"gated"``: SwiGLU (Bamba, Falcon-H1); ``"plain"``: ``down(act(up(x)))`` (Nemotron-H);
``"moe"``: Nemotron-H's routed experts and shared expert; ``"granite"`` / ``"granite_moe"``:
Granite 4.0's shared MLP, with or without routed experts; ``"jamba_moe"``: Jamba's routed
experts.
"""

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.errors import ConfigError
from gna_lens.models.config import SSMConfig

__all__ = ["GatedMLP", "GraniteMLP", "JambaMoE", "NemotronMoE", "PlainMLP", "make_mlp"]


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
        return cast("Tensor", out if dm == 1.0 else out * dm)


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
        out: Tensor = self.down_proj(self.hook_post(self.act(self.hook_pre(self.up_proj(x)))))
        return out


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
        return cast("Tensor", out.to(x.dtype).view(b, L, D) + self.shared_experts(x))


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
        return cast("Tensor", self.output_linear(self.hook_post(F.silu(gate) * up)))


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

    def route(self, logits: Tensor) -> Tensor:
        """The routing weights ``[tokens, n_experts]`` (0 where not routed) of the router's
        logits: a softmax over the top-k logits."""
        top, idx = logits.float().topk(self.cfg.n_experts_per_tok, dim=-1)
        w = torch.softmax(top, dim=-1)
        return logits.new_zeros(logits.shape, dtype=w.dtype).scatter_(1, idx, w)

    def forward(self, x: Tensor) -> Tensor:
        b, L, D = x.shape
        E = self.cfg.n_experts
        flat = x.reshape(-1, D)
        router_w: Tensor = self.router.weight  # type: ignore[assignment]
        dense = self.route(F.linear(flat, router_w)).to(x.dtype)
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
        return cast("Tensor", out)


class JambaMoE(_GraniteMoE):
    """Jamba's mixture of experts (``"jamba_moe"``): the top-k of the softmax over all router
    logits, not renormalized; SwiGLU experts laid out as Granite's."""

    def route(self, logits: Tensor) -> Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = probs.topk(self.cfg.n_experts_per_tok, dim=-1)
        return torch.zeros_like(probs).scatter_(1, idx, top)


def make_mlp(cfg: SSMConfig, kind: str) -> nn.Module:
    """The MLP of kind ``kind`` (see ``SSMConfig.mlp_types``)."""
    if kind in ("granite", "granite_moe"):
        return GraniteMLP(cfg, moe=kind == "granite_moe")
    if kind == "gated":
        return GatedMLP(cfg)
    if kind == "plain":
        return PlainMLP(cfg)
    if kind == "moe":
        return NemotronMoE(cfg)
    if kind == "jamba_moe":
        return JambaMoE(cfg)
    raise ConfigError(f"internal: unknown MLP kind {kind!r}")
