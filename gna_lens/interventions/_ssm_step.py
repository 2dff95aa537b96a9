"""Incremental last-token forward of a HookedSSM from the state of the prompt's prefix.

``ssm_prefix`` runs the full prompt once, keeping per layer what the last token needs from the
earlier ones: for SSM layers the recurrent state after position ``L-2`` (rebuilt exactly from the
cached ``hook_ssm_input``, ``hook_ssm_dt`` and ``hook_ssm_B``, with reverse cumulative sums as the
model's own kernels) and the last ``d_conv - 1`` convolution inputs; for attention layers the
rotated keys and the values. ``ssm_step`` then recomputes only the last token, firing the model's
own hook points with ``pos = 1``, so hooks on ``hook_z`` (ablation, patching) act on the last
position exactly as in the full forward.

This mirrors ``SSMBlock.forward`` and the mixers' ``forward`` of :mod:`gna_lens.models.hooked_ssm`
step by step; :class:`~gna_lens.interventions._runner.Runner` checks it against the full forward
on every group. (A ``HookedSSM.step``/``past_state`` API would let this live in the model.)
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gna_lens.errors import InterventionError
from gna_lens.models import ops


@dataclass
class SSMPrefix:
    """What the last token of each prompt needs from its prefix, per layer."""

    last: Tensor  # [G, 1] last token ids
    length: int  # full prompt length L
    layers: list[dict[str, Tensor]]
    expanded: dict[int, list[dict[str, Tensor]]] = field(default_factory=dict)

    def for_copies(self, K: int) -> list[dict[str, Tensor]]:
        if K == 1:
            return self.layers
        if K not in self.expanded:
            self.expanded = {
                K: [
                    {k: v.repeat(K, *([1] * (v.ndim - 1))) for k, v in layer.items()}
                    for layer in self.layers
                ]
            }
        return self.expanded[K]


def _tail(x: Tensor, length: int, width: int) -> Tensor:
    """Positions ``[length - width, length)`` of ``x`` ``[G, L, C]``, zero-padded on the left."""
    lo = length - width
    out = x[:, max(lo, 0) : length]
    if lo < 0:
        out = F.pad(out, (0, 0, -lo, 0))
    return out


def _rev_seg(a: Tensor) -> Tensor:
    """``S[:, j] = sum_{k=j+1..n-1} a[:, k]`` along dim 1 (reverse cumsum, no subtraction)."""
    rev = a.flip(1).cumsum(1).flip(1)
    return torch.cat([rev[:, 1:], torch.zeros_like(rev[:, :1])], dim=1)


def ssm_prefix(model: Any, tokens: Tensor) -> tuple[Tensor, SSMPrefix | None]:
    """Run ``tokens`` ``[G, L]`` once; returns (last-position logits, prefix state)."""
    cfg = model.cfg
    G, L = tokens.shape
    P = L - 1  # prefix length
    store: dict[str, Tensor] = {}

    def keep(x: Tensor, hook: Any, name: str) -> None:
        store[name] = x

    names: list[str] = []
    for i, block in enumerate(model.blocks):
        if not block.has_mixer:
            continue
        if block.is_attention or block.has_parallel_attn:
            names += [f"blocks.{i}.attn.hook_rot_k", f"blocks.{i}.attn.hook_v"]
        if not block.is_attention:
            pre = f"blocks.{i}.mixer."
            names += [
                pre + n for n in ("hook_in_proj", "hook_ssm_input", "hook_ssm_dt", "hook_ssm_B")
            ]
    hooks = [(n, _bind(keep, n)) for n in names]
    with model.hooks(fwd_hooks=hooks):
        resid = model(tokens, stop_at_layer=cfg.n_layers)
    logits = model(resid[:, -1:], start_at_layer=cfg.n_layers)[:, 0]

    layers: list[dict[str, Tensor]] = []
    for i, block in enumerate(model.blocks):
        if not block.has_mixer:
            layers.append({})
            continue
        if block.is_attention:
            layers.append(
                {
                    "k": store[f"blocks.{i}.attn.hook_rot_k"][:, :P],
                    "v": store[f"blocks.{i}.attn.hook_v"][:, :P],
                }
            )
            continue
        mixer = block.mixer
        pre = f"blocks.{i}.mixer."
        in_proj = store[pre + "hook_in_proj"]
        x = store[pre + "hook_ssm_input"][:, :P].float()
        dt = store[pre + "hook_ssm_dt"][:, :P].float()
        B = store[pre + "hook_ssm_B"][:, :P].float()
        A = -torch.exp(mixer.A_log.float())
        width = cfg.d_conv - 1
        if cfg.architecture in ("mamba1", "falcon_mamba"):
            E = cfg.d_inner
            conv_in = in_proj[..., :E]
            seg = _rev_seg(dt)  # [G, P, E]
            state = x.new_zeros(G, E, cfg.d_state)
            for j0 in range(0, P, 128):
                j1 = min(j0 + 128, P)
                decay = torch.exp(seg[:, j0:j1, :, None] * A)  # [G, t, E, N]
                write = (dt[:, j0:j1] * x[:, j0:j1])[..., None] * B[:, j0:j1, None, :]
                state = state + (decay * write).sum(1)
        else:
            E, H, Gr = cfg.d_inner, cfg.n_heads, cfg.n_groups
            conv_in = in_proj[..., E : E + mixer.conv_dim]
            hpg = H // Gr
            w = torch.exp(_rev_seg(dt * A)) * dt  # [G, P, H]
            state = torch.einsum(
                "bjgm,bjgmp,bjgn->bgmpn",
                w.view(G, P, Gr, hpg),
                x.view(G, P, Gr, hpg, cfg.d_head),
                B,
            ).reshape(G, H, cfg.d_head, cfg.d_state)
        entry = {"conv": _tail(conv_in, P, width), "state": state}
        if block.has_parallel_attn:  # Falcon-H1: the attention beside the mixer
            entry["k"] = store[f"blocks.{i}.attn.hook_rot_k"][:, :P]
            entry["v"] = store[f"blocks.{i}.attn.hook_v"][:, :P]
        layers.append(entry)
    return logits, SSMPrefix(last=tokens[:, -1:], length=L, layers=layers)


def _bind(fn: Any, name: str) -> Any:
    def bound(x: Tensor, hook: Any) -> None:
        fn(x, hook, name=name)

    return bound


def _conv_last(window: Tensor, conv1d: torch.nn.Conv1d) -> Tensor:
    """The causal convolution's output at the last position of ``window`` ``[R, d_conv, C]``."""
    out = ops.causal_conv1d(window.transpose(1, 2), conv1d.weight, conv1d.bias)
    return out[..., -1:].transpose(1, 2)  # [R, 1, C]


def _mamba2_step(mx: Any, h: Tensor, st: dict[str, Tensor]) -> Tensor:
    cfg = mx.cfg
    R = h.shape[0]
    E, H, G, N, P = cfg.d_inner, cfg.n_heads, cfg.n_groups, cfg.d_state, cfg.d_head
    z, xBC, dt_raw = mx.project(h).split([E, mx.conv_dim, H], dim=-1)
    conv = _conv_last(torch.cat([st["conv"].to(xBC.dtype), xBC], dim=1), mx.conv1d)
    xBC = F.silu(mx.hook_conv(conv))
    x, B, C = xBC.split([E, G * N, G * N], dim=-1)
    x = mx.hook_ssm_input(x.reshape(R, 1, H, P))
    B = mx.hook_ssm_B(B.reshape(R, 1, G, N))
    C = mx.hook_ssm_C(C.reshape(R, 1, G, N))
    lo, hi = cfg.time_step_limit
    dt = mx.hook_ssm_dt(F.softplus(dt_raw + mx.dt_bias).clamp(min=lo, max=hi))
    A = -torch.exp(mx.A_log.float())
    hpg = H // G
    Bh = B[:, 0].float().repeat_interleave(hpg, dim=1)  # [R, H, N]
    Ch = C[:, 0].float().repeat_interleave(hpg, dim=1)
    d = dt[:, 0].float()  # [R, H]
    state = torch.exp(d * A)[..., None, None] * st["state"] + (
        d[..., None, None] * x[:, 0].float()[..., None] * Bh[:, :, None, :]
    )
    y = torch.einsum("rhpn,rhn->rhp", state, Ch)[:, None].to(x.dtype)
    y = mx.hook_ssm_out(y + x * mx.D[:, None])
    normed = mx.gate_norm(y.reshape(R, 1, E), mx.hook_gate(z))
    head_in = mx.hook_z(normed.view(R, 1, H, P))
    return mx.out_proj(head_in.reshape(R, 1, E).to(h.dtype))


def _mamba1_step(mx: Any, h: Tensor, st: dict[str, Tensor]) -> Tensor:
    cfg = mx.cfg
    R = h.shape[0]
    xs, z = mx.hook_in_proj(mx.in_proj(h)).chunk(2, dim=-1)
    conv = _conv_last(torch.cat([st["conv"].to(xs.dtype), xs], dim=1), mx.conv1d)
    u = mx.hook_ssm_input(F.silu(mx.hook_conv(conv)))
    dt_low, B, C = torch.split(mx.x_proj(u), [cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
    if mx.falcon:
        eps = cfg.mixer_rms_eps
        dt_low, B, C = (ops.rms_norm(t, None, eps) for t in (dt_low, B, C))
    delta = mx.hook_ssm_dt(F.softplus(mx.dt_proj(dt_low)))
    B, C = mx.hook_ssm_B(B), mx.hook_ssm_C(C)
    A = -torch.exp(mx.A_log.float())
    d = delta[:, 0]
    write = (d * u[:, 0])[..., None] * B[:, 0, None, :]  # [R, E, N]
    state = torch.addcmul(write, torch.exp(d[..., None] * A), st["state"].to(write.dtype))
    y = torch.einsum("ren,rn->re", state, C[:, 0])[:, None]
    y = mx.hook_ssm_out(y + u * mx.D)
    z = mx.hook_gate(z)
    head_in = mx.hook_z((y * F.silu(z)).view(R, 1, -1, 1))
    return mx.out_proj(head_in.view(R, 1, -1).to(h.dtype))


def _attn_step(
    at: Any, h: Tensor, st: dict[str, Tensor], rope: tuple[Tensor, Tensor] | None
) -> Tensor:
    from gna_lens.models.hooked_ssm import _checked_pattern

    cfg = at.cfg
    R = h.shape[0]
    H, KV, d = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.attn_d_head
    q = at.hook_q(at.q_proj(h).view(R, 1, H, d))
    k = at.hook_k(at.keys(h).view(R, 1, KV, d))
    v = at.hook_v(at.v_proj(h).view(R, 1, KV, d))
    q = at.hook_rot_q(at._rope(q, rope))
    k = at.hook_rot_k(at._rope(k, rope))
    k = torch.cat([st["k"].to(k.dtype), k], dim=1)
    v = torch.cat([st["v"].to(v.dtype), v], dim=1)
    if KV != H:
        k = k.repeat_interleave(H // KV, dim=2)
        v = v.repeat_interleave(H // KV, dim=2)
    scores = at.hook_attn_scores(torch.einsum("bqhd,bkhd->bhqk", q, k) * at.scale)
    pattern = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    pattern = _checked_pattern(at.hook_pattern(pattern), pattern, at.hook_pattern.name)
    z = at.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
    return at.o_proj(z.reshape(R, 1, H * d))


def ssm_step(model: Any, prefix: SSMPrefix, K: int) -> Tensor:
    """Last-token logits ``[K * G, d_vocab]`` for ``K`` packed copies of the prefix states."""
    cfg = model.cfg
    states = prefix.for_copies(K)
    tok = prefix.last.repeat(K, 1)
    resid = model.embed_tokens(tok)
    rope = None
    if model._uses_rope:
        cos, sin = model._rope(prefix.length, resid.device, resid.dtype)
        rope = (cos[-1:], sin[-1:])
    for i, block in enumerate(model.blocks):
        resid = block.hook_resid_pre(resid)
        if not block.has_mixer:
            pass
        elif block.is_attention:
            normed = block.ln1(resid.to(block.ln1.weight.dtype))
            out = _attn_step(block.attn, normed, states[i], rope)
            resid = resid + block.hook_attn_out(block.scaled(out))
        else:
            normed = block.ln1(resid.to(block.ln1.weight.dtype))
            if cfg.residual_in_fp32:
                resid = resid.float()
            mixer = block.mixer
            if mixer.hook_pattern.fwd_hooks or mixer.hook_ssm_state.fwd_hooks:
                raise InterventionError(
                    f"blocks.{i}.mixer.hook_pattern / hook_ssm_state is hooked during a "
                    "last-token step, which does not materialize SSM patterns; edit patterns "
                    "with a full forward (positions=None)."
                )
            step = _mamba1_step if cfg.architecture in ("mamba1", "falcon_mamba") else _mamba2_step
            if block.has_parallel_attn:  # Falcon-H1: mixer and attention on the same input
                ssm = block.hook_mixer_out(block.scaled(step(mixer, normed, states[i]), "ssm"))
                out = _attn_step(block.attn, block.attn_input(normed), states[i], rope)
                attn = block.hook_attn_out(block.scaled(out, "attention"))
                resid = resid + (ssm + attn)
            else:
                out = step(mixer, normed, states[i])
                resid = resid + block.hook_mixer_out(block.scaled(out))
        resid = block.mlp_part(resid)
    logits = model.logits_of(resid)
    return logits[:, 0]
