"""Numerical kernels of HookedSSM: norms, causal convolution, scans, SSD and implicit attention.

Everything here is a pure function of tensors (no modules, no hooks), written for clarity and
exactness first, then speed. Conventions follow ``shared/design/implicit_attention.md``:
``b`` batch, ``i`` / ``q`` query position, ``j`` key position (``j <= i``), ``h`` head, ``p`` head
dimension, ``g`` group, ``n`` state dimension, ``e`` Mamba-1 channel.

Numerics: every segment sum is built from masked (reverse) cumulative sums, never as a difference
of two prefix sums, so the decays stay accurate at long sequence lengths (the plain
``cumsum_i - cumsum_j`` loses about 3e-5 relative at L=4096 in fp32).
"""

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from gna_lens.device import HOST

__all__ = [
    "Mamba1Scan",
    "causal_conv1d",
    "channel_groups",
    "decay_matrix",
    "gated_rms_norm",
    "mamba1_pattern",
    "mamba1_scan",
    "mamba2_pattern",
    "mamba2_recurrent",
    "mamba2_ssd",
    "pad_positions",
    "reverse_segsum",
    "rms_norm",
    "rope_inv_freq",
    "segsum_rows",
]


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm computed in fp32 and cast back, as Llama / Mamba do.

    Args:
        x: Input ``[..., d]``.
        weight: Scale ``[d]`` or ``None`` for a weightless norm.
        eps: Variance epsilon.

    Returns:
        The normalized tensor in ``x``'s dtype (times ``weight`` if given).
    """
    dtype = x.dtype
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return out if weight is None else weight * out


def gated_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, group_size: int, eps: float) -> Tensor:
    """Mamba-2's gated RMSNorm: ``norm(y * SiLU(gate))`` with the RMS taken per group of channels.

    Args:
        y: SSM output ``[..., E]``.
        gate: Gate ``z`` ``[..., E]``.
        weight: Scale ``[E]``.
        group_size: Channels per normalization group (``E // n_groups``).
        eps: Variance epsilon.

    Returns:
        ``[..., E]`` in ``y``'s dtype.
    """
    dtype = y.dtype
    h = y.float() * F.silu(gate.float())
    shape = h.shape
    h = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(shape).to(dtype)


def causal_conv1d(
    x: Float[Tensor, "batch channel pos"], weight: Tensor, bias: Tensor | None
) -> Tensor:
    """Causal depthwise convolution (left zero padding), output length = input length.

    Args:
        x: ``[batch, channel, pos]``.
        weight: ``[channel, 1, kernel]`` (an ``nn.Conv1d`` depthwise weight).
        bias: ``[channel]`` or ``None``.

    Returns:
        ``[batch, channel, pos]``.
    """
    k = weight.shape[-1]
    return F.conv1d(F.pad(x, (k - 1, 0)), weight, bias, groups=x.shape[1])


def pad_positions(chunk: int, *tensors: Tensor) -> list[Tensor]:
    """Each ``[batch, pos, ...]`` tensor zero-padded after its last position to a multiple of
    ``chunk`` positions."""
    pad = (-tensors[0].shape[1]) % chunk
    return [F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad)) if pad else t for t in tensors]


def reverse_segsum(a: Tensor, dim: int = -1) -> Tensor:
    """``S[..., j] = Σ_{k=j+1..n-1} a[..., k]`` along ``dim`` (a reverse cumulative sum, no
    subtraction).

    Examples:
        >>> import torch
        >>> reverse_segsum(torch.ones(4)).tolist()
        [3.0, 2.0, 1.0, 0.0]
    """
    rev = a.flip(dim).cumsum(dim).flip(dim)
    n = rev.shape[dim]
    return torch.cat([rev.narrow(dim, 1, n - 1), torch.zeros_like(rev.narrow(dim, 0, 1))], dim=dim)


def _rows_tensor(rows: Tensor | None, length: int, device: torch.device) -> Tensor:
    if rows is None:
        return torch.arange(length, device=device)
    return rows.to(device=device, dtype=torch.long)


def segsum_rows(
    a: Float[Tensor, "... pos"], rows: Int[Tensor, " row"] | None = None
) -> tuple[Float[Tensor, "... row pos"], Tensor]:
    """Stable segment sums ``S[..., r, j] = sum_{k=j+1..q_r} a[..., k]`` for ``j <= q_r``.

    Built by masking ``a`` above each query row and taking a reverse cumulative sum, so no prefix
    sums are subtracted. Entries with ``j > q_r`` are 0 in the returned tensor; the boolean causal
    mask ``j <= q_r`` is returned beside it so callers decide how to fill them.

    Args:
        a: Per-position increments (e.g. ``A * dt``), ``[..., L]``.
        rows: Query positions ``q_r`` (``[R]``); all ``L`` positions when ``None``.

    Returns:
        ``(S, causal)`` with ``S`` of shape ``[..., R, L]`` and ``causal`` ``[R, L]`` (bool).

    Examples:
        >>> import torch
        >>> S, causal = segsum_rows(torch.ones(4))
        >>> S[3].tolist()
        [3.0, 2.0, 1.0, 0.0]
    """
    length = a.shape[-1]
    q = _rows_tensor(rows, length, a.device)
    j = torch.arange(length, device=a.device)
    causal = j[None, :] <= q[:, None]  # [R, L]
    # a_k counted for k in (j, q]: shift a one place left (b_k = a_{k+1}), keep b_k for k < q,
    # then reverse cumsum from the end down to j: 0 + a_q + ... + a_{j+1} (0 where j >= q).
    shifted = torch.cat([a[..., 1:], torch.zeros_like(a[..., :1])], dim=-1)  # [..., L]
    keep = (j[None, :] < q[:, None]).to(a.dtype)
    masked = shifted.unsqueeze(-2) * keep  # [..., R, L]
    return masked.flip(-1).cumsum(-1).flip(-1), causal


def mamba1_scan(
    u: Float[Tensor, "batch pos channel"],
    delta: Float[Tensor, "batch pos channel"],
    A: Float[Tensor, "channel state"],
    B: Float[Tensor, "batch pos state"],
    C: Float[Tensor, "batch pos state"],
    chunk_size: int = 256,
    return_states: bool = False,
) -> tuple[Float[Tensor, "batch pos channel"], Tensor | None]:
    """Mamba-1 selective scan ``h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t``, ``y_t = C_t · h_t``.

    Without the states, step by step over tiles of the batch: each step's decay, update and
    read-out work in place on one ``[rows, state, channel]`` buffer that stays in cache
    (:data:`SCAN_TILE_BYTES`; 5x faster on CPU than materializing a chunk's ``[chunk, batch,
    channel, state]`` decays and writes first, 74 MB per layer for 16 prompts of 47 tokens of
    mamba-130m); memory is ``O(batch * channel * state)``. With the states, per chunk of
    ``chunk_size`` positions: decays and writes in one vectorized pass (time-major), the
    recurrence written into a preallocated buffer, one read-out contraction. Either beats a
    log-depth parallel scan on CPU, whose extra passes over ``[batch, pos, channel, state]``
    tensors cost more than the per-step overhead. ``D`` and the gate are applied by the caller.

    Differentiable: when gradients are needed (and the states are not requested) the scan runs
    as one autograd function whose backward recomputes each chunk's states from the state saved
    at the chunk's start and runs the adjoint recurrence backwards (:class:`Mamba1Scan`), so a
    backward pass stores ``O(batch * pos * channel)`` per layer instead of every state. With
    ``return_states=True`` autograd records every step instead (the states are outputs).

    Args:
        u: SSM input (after conv and SiLU).
        delta: ``Δ = softplus(dt_proj(dt) + bias)``.
        A: ``-exp(A_log)``.
        B: Input projection of the state, per position.
        C: Output projection of the state, per position.
        chunk_size: Positions per chunk (bounds memory; no effect on the result).
        return_states: Also return every state ``[batch, pos, channel, state]``.

    Returns:
        ``(y, states)``; ``states`` is ``None`` unless asked for.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (u, delta, A, B, C))
    if needs_grad and not return_states:
        return Mamba1Scan.apply(u, delta, A, B, C, chunk_size), None
    if not return_states:
        return _scan_steps(u, delta, A, B, C), None
    batch, length, channels = u.shape
    state = u.new_zeros(batch, channels, A.shape[-1])
    ys: list[Tensor] = []
    all_states: list[Tensor] = []
    for start in range(0, length, chunk_size):
        sl = slice(start, start + chunk_size)
        decay, write = _chunk_terms(u[:, sl], delta[:, sl], A, B[:, sl])
        if needs_grad:
            steps = []  # autograd cannot record writes into a preallocated buffer
            for t in range(decay.shape[0]):
                state = torch.addcmul(write[t], decay[t], state)
                steps.append(state)
            states = torch.stack(steps)
        else:
            states = _run_chunk(decay, write, state)
            state = states[-1].clone()
        ys.append(torch.einsum("tben,btn->bte", states, C[:, sl]))
        all_states.append(states.transpose(0, 1))
    return torch.cat(ys, dim=1), torch.cat(all_states, dim=1)


#: Bytes of one batch tile's Mamba-1 scan state, which the step loop keeps in a core's cache
#: (mamba-130m, 1 thread: 8-row tiles 1.3x faster than 16 prompts at once, 1.5x than 64).
SCAN_TILE_BYTES = 2**20


def _scan_steps(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int = 0,
    starts: list[Tensor] | None = None,
) -> Tensor:
    """The scan's outputs ``y [batch, pos, channel]`` (contiguous) step by step, no state kept,
    no autograd (see :func:`mamba1_scan`), in the inputs' promoted dtype even under autocast (as
    the Mamba kernels keep their scan in float32). ``starts`` (with ``chunk_size``) collects the
    state ``[batch, channel, state]`` before every ``chunk_size``-th step (for
    :class:`Mamba1Scan`'s backward).
    """
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in (u, delta, A, B, C)))
    u, delta, A, B, C = (t.to(dtype).transpose(0, -1 if t is A else 1) for t in (u, delta, A, B, C))
    (length, batch, channels), At = u.shape, A.contiguous()  # time-major; A^T [n, e]
    d, du = delta[:, :, None], (delta * u)[:, :, None]  # [t, b, 1, e]
    Bt, Ct = B[..., None], C[:, :, None]  # [t, b, n, 1], [t, b, 1, n]
    y = u.new_empty(batch, length, channels)  # written in place: no copy of it at the end
    if starts is not None:
        starts += [y.new_empty(batch, channels, A.shape[0]) for _ in range(0, length, chunk_size)]
    # The state is [rows, n, e], channels innermost: each step's ops run in place over
    # contiguous rows of channels (1.6x faster on CPU than [batch, e, n] for mamba-130m).
    rows = max(1, SCAN_TILE_BYTES // (A.numel() * dtype.itemsize))
    with torch.autocast(u.device.type, enabled=False):  # the state and read-out stay in dtype
        for r in range(0, batch, rows):
            tile, state = slice(r, r + rows), y.new_zeros(min(rows, batch - r), *At.shape)
            decay, row = torch.empty_like(state), y.new_empty(state.shape[0], 1, channels)
            for step in range(length):
                if starts is not None and step % chunk_size == 0:
                    starts[step // chunk_size][tile] = state.transpose(1, 2)
                torch.mul(d[step, tile], At, out=decay).exp_()
                state.mul_(decay).addcmul_(Bt[step, tile], du[step, tile])  # exp(ΔA) h + Δu B
                y[tile, step] = torch.matmul(Ct[step, tile], state, out=row)[:, 0]
    return y


def _chunk_terms(u: Tensor, delta: Tensor, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """Time-major decays ``exp(Δ_t A)`` and writes ``Δ_t u_t B_t`` of one chunk, ``[t, b, e, n]``."""
    d = delta.transpose(0, 1)  # [t, b, e]
    decay = torch.exp(d[..., None] * A)
    write = (d * u.transpose(0, 1))[..., None] * B.transpose(0, 1)[:, :, None, :]
    return decay, write


def _run_chunk(decay: Tensor, write: Tensor, state: Tensor) -> Tensor:
    """Every state ``[t, b, e, n]`` of one chunk from the state before it (no autograd)."""
    states = torch.empty_like(decay)
    for t in range(decay.shape[0]):
        state = torch.addcmul(write[t], decay[t], state, out=states[t])
    return states


class Mamba1Scan(torch.autograd.Function):
    """The Mamba-1 scan as one autograd function: chunked forward, recomputing backward.

    Forward: the chunked scan of :func:`mamba1_scan`, keeping only the state at each chunk's
    start. Backward, chunk by chunk from the last: recompute the chunk's states ``h_t``, run the
    adjoint recurrence ``g_t = gy_t C_t + exp(Δ_{t+1} A) g_{t+1}`` backwards (``g`` is
    ``∂loss/∂h_t``, carried across chunk boundaries), then read every gradient off ``g``, ``h``
    and ``h_{t-1}`` in vectorized contractions:

    - ``∂C_t = Σ_e gy_t h_t``; ``∂u_t = Δ_t Σ_n g_t B_t``; ``∂B_t = Σ_e g_t Δ_t u_t``;
    - with ``X_t = g_t h_{t-1} exp(Δ_t A)``: ``∂Δ_t = u_t Σ_n g_t B_t + Σ_n X_t A`` and
      ``∂A = Σ_{b,t} X_t Δ_t``.

    Memory: four ``[chunk, batch, channel, state]`` buffers during the backward, nothing of that
    size kept between forward and backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int
    ) -> Tensor:
        starts: list[Tensor] = []
        y = _scan_steps(u, delta, A, B, C, chunk_size, starts)
        ctx.save_for_backward(u, delta, A, B, C, torch.stack(starts))
        ctx.chunk_size = chunk_size
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        u, delta, A, B, C, starts = ctx.saved_tensors
        T, length = ctx.chunk_size, u.shape[1]
        du, ddelta = torch.zeros_like(u), torch.zeros_like(delta)
        dB, dC = torch.zeros_like(B), torch.zeros_like(C)
        dA = torch.zeros(A.shape, dtype=starts.dtype, device=A.device)
        carry = torch.zeros_like(starts[0])  # exp(Δ_{t+1} A) g_{t+1} for the step after a chunk
        for c in reversed(range(starts.shape[0])):
            sl = slice(c * T, min((c + 1) * T, length))
            d, uc = delta[:, sl].transpose(0, 1), u[:, sl].transpose(0, 1)  # [t, b, e]
            Bt, Ct = B[:, sl].transpose(0, 1), C[:, sl].transpose(0, 1)  # [t, b, n]
            gyt = gy[:, sl].transpose(0, 1)  # [t, b, e]
            decay, write = _chunk_terms(u[:, sl], delta[:, sl], A, B[:, sl])
            H = _run_chunk(decay, write, starts[c])
            del write
            dC[:, sl] = torch.einsum("tbe,tben->btn", gyt, H)
            G = gyt[..., None] * Ct[:, :, None, :]  # gy_t C_t, then the adjoint in place
            for t in reversed(range(G.shape[0])):
                G[t].add_(carry)
                carry = decay[t] * G[t]
            GB = torch.einsum("tben,tbn->tbe", G, Bt)
            du[:, sl] = (GB * d).transpose(0, 1)
            dB[:, sl] = torch.einsum("tben,tbe->btn", G, d * uc)
            X = G.mul_(decay)  # g_t exp(Δ_t A) h_{t-1}
            X[1:].mul_(H[:-1])
            X[0].mul_(starts[c])
            ddelta[:, sl] = (GB * uc + torch.einsum("tben,en->tbe", X, A.to(X.dtype))).transpose(
                0, 1
            )
            dA += torch.einsum("tben,tbe->en", X, d)
        return du, ddelta, dA.to(A.dtype), dB, dC, None


def mamba1_pattern(
    delta: Float[Tensor, "batch pos channel"],
    A: Float[Tensor, "channel state"],
    B: Float[Tensor, "batch pos state"],
    C: Float[Tensor, "batch pos state"],
    rows: Int[Tensor, " row"] | None = None,
    block_size: int = 16,
) -> Float[Tensor, "batch channel row pos"]:
    """Materialized Mamba-1 implicit attention, one matrix per channel.

    ``α[b,e,i,j] = Σ_n C[b,i,n] · exp(A[e,n] · S[b,e,i,j]) · Δ[b,j,e] · B[b,j,n]`` with
    ``S[b,e,i,j] = Σ_{k=j+1..i} Δ[b,k,e]``, so that ``y = α @ u`` (before ``D`` and the gate).

    Keys are taken in blocks ending at ``r``. For rows ``i >= r`` the decay factorizes exactly,
    ``exp(A S_ij) = exp(A S_ir) · exp(A S_rj)``, both factors at most 1 (no overflow), so each
    block is one batched matrix product over the state dimension. The rows inside a block run
    the recurrence of the block's keys, ``[batch, state, key, channel]`` decayed one position at
    a time (in place unless autograd records it: on CPU a fresh large tensor costs its page
    faults) and read out by ``C`` at each wanted row (:func:`_rows_inside`).

    Args:
        delta: ``Δ`` for the channels to materialize (select channels before calling).
        A: ``-exp(A_log)`` for the same channels.
        B: ``[batch, pos, state]``.
        C: ``[batch, pos, state]``.
        rows: Query positions to materialize (all when ``None``).
        block_size: Keys per block. 16 (measured on CPU, 1 thread, 1536 channels): as fast as
            8 and 1.4x faster than 32 at 8 x 47 tokens, 1.6x faster than 8 at 4 x 200 (32 is
            1.15x faster there, 1.5x for the last row of 1 x 1024).

    Returns:
        ``[batch, channel, row, pos]``, zero above the causal diagonal.
    """
    length = delta.shape[1]
    q = _rows_tensor(rows, length, delta.device)
    d = delta.transpose(1, 2)  # [b, e, L]
    out = d.new_zeros(d.shape[0], d.shape[1], q.shape[0], length)
    Aq = A[None, :, None, :]  # [1, e, 1, n]
    for j0 in range(0, length, block_size):
        j1 = min(j0 + block_size, length)
        # Rows at or after the block's last key: factorized through the reference point r.
        after, to_r, from_r = _through_block_end(d, q, j0, j1)  # S_rj, S_ir
        if after.numel():
            # (in place where autograd allows it: a fresh large tensor costs page faults)
            right = (d[..., j0:j1, None] * B[:, None, j0:j1]).mul_(
                torch.mul(to_r[..., None], Aq).exp_()
            )
            left = torch.mul(C[:, None, q[after]], torch.mul(from_r[..., None], Aq).exp_())
            out[:, :, after, j0:j1] = left @ right.transpose(-1, -2)
        inside = ((q >= j0) & (q < j1 - 1)).nonzero().squeeze(-1)
        if inside.numel():
            sl, at = slice(j0, j1), q[inside] - j0
            out[:, :, inside, sl] = _rows_inside(delta[:, sl], A, B[:, sl], C[:, sl], at)
    return out


def _rows_inside(d: Tensor, A: Tensor, B: Tensor, C: Tensor, rows: Tensor) -> Tensor:
    """:func:`mamba1_pattern` of one key block ``d [batch, key, channel]`` at its ``rows``:
    ``[batch, channel, row, key]``."""
    b, t, e = d.shape
    offsets = sorted(set(rows.tolist()))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (d, A, B, C))
    G = torch.mul(d[:, None], B.transpose(1, 2)[..., None])  # Δ_j B_j, [b, n, key, e]
    d, At, C = d.to(G.dtype), A.t()[:, None, :].to(G.dtype), C.to(G.dtype)
    out = G.new_zeros(b, len(offsets), t, e)
    for i in range(offsets[-1] + 1):
        if i:  # every earlier key decays by exp(Δ_i A); in place unless autograd records it
            decay = torch.exp(d[:, i, None, None] * At)
            if grad:
                G = torch.cat((G[:, :, :i] * decay, G[:, :, i:]), 2)
            else:
                G[:, :, :i].mul_(decay)
        if i in offsets:  # Σ_n C_in G_n, one product and sum at a time: the same bits for any
            acc = G[:, 0, : i + 1] * C[:, i, 0, None, None]  # channel count (a matmul's are not)
            for n in range(1, A.shape[-1]):
                acc = acc + G[:, n, : i + 1] * C[:, i, n, None, None]
            out[:, offsets.index(i), : i + 1] = acc
    pick = torch.tensor([offsets.index(r) for r in rows.tolist()], device=d.device)
    return out.index_select(1, pick).permute(0, 3, 1, 2)


def mamba2_ssd(
    x: Float[Tensor, "batch pos head d_head"],
    dt: Float[Tensor, "batch pos head"],
    A: Float[Tensor, " head"],
    B: Float[Tensor, "batch pos group state"],
    C: Float[Tensor, "batch pos group state"],
    chunk_size: int,
) -> Float[Tensor, "batch pos head d_head"]:
    """Chunked state-space duality (SSD) scan of Mamba-2, without the ``D`` skip term.

    Inside each chunk the output is the masked matrix product (the implicit attention); between
    chunks the state is carried by a short recurrence over chunks. Heads of a group share ``B`` and
    ``C`` without copying them per head.

    Args:
        x: Values ``[batch, pos, head, d_head]``.
        dt: Step sizes after softplus and clamping.
        A: ``-exp(A_log)`` per head.
        B: ``[batch, pos, group, state]``.
        C: ``[batch, pos, group, state]``.
        chunk_size: Chunk length; the result does not depend on it beyond rounding. Inputs
            shorter than a chunk run as one chunk of their own length (no padding).

    Returns:
        ``y`` with the shape of ``x``.
    """
    batch, length, heads, d_head = x.shape
    # In float32 at least (float64 stays float64): A is float32 (-exp(A_log.float())), and the
    # decays exp(segsum) lose most of their digits in bfloat16; mamba_ssm's kernel also
    # accumulates in float32. The result is cast back to x's dtype.
    out_dtype = x.dtype
    work = torch.promote_types(torch.promote_types(x.dtype, A.dtype), torch.float32)
    x, dt, A, B, C = (t.to(work) for t in (x, dt, A, B, C))
    # An input shorter than a chunk is one chunk of its own length: padding it to chunk_size
    # (256 in mamba2-130m) would multiply the [T, T] work and memory by (chunk_size / length)^2
    # for nothing (the padded positions come after every real one).
    chunk_size = max(1, min(chunk_size, length))
    groups = B.shape[2]
    hpg = heads // groups
    x, dt, B, C = pad_positions(chunk_size, x, dt, B, C)
    n_chunks = x.shape[1] // chunk_size
    T = chunk_size
    xdt = (x * dt[..., None]).view(batch, n_chunks, T, groups, hpg, d_head)
    Bc = B.reshape(batch, n_chunks, T, groups, -1)
    Cc = C.reshape(batch, n_chunks, T, groups, -1)
    a = (dt * A).view(batch, n_chunks, T, groups, hpg).permute(0, 3, 4, 1, 2)  # [b,g,m,c,T]

    # 1. Within chunks: y = (L ∘ C Bᵀ) (x dt).
    seg, causal = segsum_rows(a)  # [b,g,m,c,T,T]
    decay = torch.exp(seg) * causal
    CB = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)  # [b,g,c,T,T]
    M = decay * CB[:, :, None]  # [b,g,m,c,T,T]
    y = torch.einsum("bgmcls,bcsgmp->bclgmp", M, xdt)
    if n_chunks == 1:  # no state comes in from before the chunk: steps 2-4 would add zero
        return y.reshape(batch, length, heads, d_head).to(out_dtype)  # T == length here

    # 2. State at each chunk's end, from that chunk's inputs alone.
    to_end = reverse_segsum(a)  # sum_{k=s+1..T-1} a_k
    chunk_states = torch.einsum("bcsgn,bgmcs,bcsgmp->bcgmpn", Bc, torch.exp(to_end), xdt)

    # 3. Carry states across chunks (short sequential recurrence over chunks).
    chunk_decay = torch.exp(a.sum(-1)).permute(0, 3, 1, 2)  # [b,c,g,m]
    carried = torch.zeros_like(chunk_states[:, 0])
    starts = []
    for c in range(n_chunks):
        starts.append(carried)
        carried = chunk_decay[:, c, ..., None, None] * carried + chunk_states[:, c]
    start_states = torch.stack(starts, dim=1)  # [b,c,g,m,p,n]

    # 4. Contribution of the carried state to each position: C_l · state * exp(sum_{k<=l} a_k).
    from_start = torch.exp(a.cumsum(-1)).permute(0, 3, 4, 1, 2)  # [b,c,T,g,m]
    y = y + torch.einsum("bclgn,bcgmpn->bclgmp", Cc, start_states) * from_start[..., None]
    y = y.reshape(batch, n_chunks * T, heads, d_head)
    return y[:, :length].to(out_dtype)


def _through_block_end(a: Tensor, q: Tensor, j0: int, j1: int) -> tuple[Tensor, Tensor, Tensor]:
    """Segment sums through the last key ``r = j1 - 1`` of the key block ``[j0, j1)``.

    Returns ``(after, to_r, from_r)``: the indices of the rows ``q >= r``, ``Σ_{k=j+1..r} a_k``
    for the block's keys ``[..., j1 - j0]`` and ``Σ_{k=r+1..q} a_k`` for those rows
    ``[..., len(after)]``, each a cumulative sum over its own segment.
    """
    r = j1 - 1
    after = (q >= r).nonzero().squeeze(-1)
    to_r = reverse_segsum(a[..., j0:j1])
    tail = torch.cat([torch.zeros_like(a[..., :1]), a[..., r + 1 :].cumsum(-1)], dim=-1)
    return after, to_r, tail.index_select(-1, q[after] - r)


def decay_matrix(
    a: Float[Tensor, "... pos"], rows: Int[Tensor, " row"] | None = None, block_size: int = 64
) -> Float[Tensor, "... row pos"]:
    """``exp(Σ_{k=j+1..q_r} a_k)`` for ``j <= q_r`` (0 above the diagonal), for ``a <= 0``.

    Keys are taken in blocks ending at ``r``: for rows ``q >= r`` the matrix factorizes exactly as
    ``exp(S_qr) · exp(S_rj)`` (both at most 1, so nothing overflows), an outer product per block;
    rows inside a block use the masked segment sum. Every segment sum is a cumulative sum over
    the segment itself, never a difference of prefix sums.

    Args:
        a: Per-position log-decays (``A * dt``), ``[..., L]``.
        rows: Query positions (all when ``None``).
        block_size: Keys per block.

    Returns:
        ``[..., R, L]``.

    Examples:
        >>> import torch
        >>> decay_matrix(torch.full((3,), -1.0))[2]
        tensor([0.1353, 0.3679, 1.0000])
    """
    length = a.shape[-1]
    q = _rows_tensor(rows, length, a.device)
    out = a.new_zeros(*a.shape[:-1], q.shape[0], length)
    for j0 in range(0, length, block_size):
        j1 = min(j0 + block_size, length)
        r = j1 - 1
        blk = a[..., j0:j1]
        after, to_r, from_r = _through_block_end(a, q, j0, j1)
        if after.numel():
            out[..., after, j0:j1] = torch.exp(from_r)[..., :, None] * torch.exp(to_r)[..., None, :]
        inside = ((q >= j0) & (q < r)).nonzero().squeeze(-1)
        if inside.numel():
            seg, causal = segsum_rows(blk, q[inside] - j0)
            out[..., inside, j0:j1] = torch.exp(seg) * causal
    return out


def mamba2_pattern(
    dt: Float[Tensor, "batch pos head"],
    A: Float[Tensor, " head"],
    B: Float[Tensor, "batch pos group state"],
    C: Float[Tensor, "batch pos group state"],
    head_group: Int[Tensor, " head"],
    rows: Int[Tensor, " row"] | None = None,
    scale_keys: bool = True,
) -> Float[Tensor, "batch head row pos"]:
    """Materialized Mamba-2 implicit attention, one matrix per head.

    ``M[b,h,i,j] = (C[b,i,g(h)] · B[b,j,g(h)]) · exp(A[h] · Σ_{k=j+1..i} dt[b,k,h]) · dt[b,j,h]``,
    the form that reconstructs the mixer: ``y = M @ x + D x``. Dropping the trailing ``dt[b,j,h]``
    gives the "attention-like" form ``L ∘ C Bᵀ``.

    Args:
        dt: Step sizes of the heads to materialize ``[batch, pos, head]``.
        A: ``-exp(A_log)`` of those heads.
        B: ``[batch, pos, group, state]`` (all groups).
        C: ``[batch, pos, group, state]`` (all groups).
        head_group: The group index of each materialized head.
        rows: Query positions to materialize (all when ``None``).
        scale_keys: Multiply by ``dt[b,j,h]`` (default). ``False`` gives ``(C_i · B_j) exp(A Σ
            dt)``, the matrix of a mixer whose scan reads ``x / dt`` (DiscreteMamba2, Llamba):
            there ``y = M @ x + D x`` without the trailing ``dt``.

    Returns:
        ``[batch, head, row, pos]``, zero above the causal diagonal.
    """
    q = _rows_tensor(rows, dt.shape[1], dt.device)
    dtT = dt.transpose(1, 2)  # [b, h, L]
    M = decay_matrix(dtT * A[:, None], rows)  # [b, h, R, L]
    if scale_keys:
        M.mul_(dtT[:, :, None, :])
    CB = torch.einsum("brgn,bjgn->bgrj", C[:, q], B)  # [b, g, R, L]
    groups = CB.shape[1]
    heads = dt.shape[2]
    hg = head_group.to(CB.device)
    if heads % groups == 0 and torch.equal(
        hg, torch.arange(heads, device=hg.device) // (heads // groups)
    ):
        M.view(M.shape[0], groups, heads // groups, *M.shape[2:]).mul_(CB[:, :, None])
    else:
        M.mul_(CB.index_select(1, hg))
    return M


def channel_groups(
    pattern: Float[Tensor, "batch channel query_pos key_pos"],
    group_size: int,
    reduce: str = "mean_abs",
) -> Float[Tensor, "batch group query_pos key_pos"]:
    """View a Mamba-1 pattern (one matrix per channel) as channel groups, for display.

    Mamba-1 has no heads: each of its ``d_inner`` channels has its own implicit attention. Grouping
    consecutive channels (e.g. 16 groups) gives a head-like view, for display only. To make groups
    of channels the heads that ablation, attribution, masks and scores address, use
    ``HookedSSM.set_head_groups``; their patterns are :func:`gna_lens.heads.head_patterns` (the
    mean of the channels' row-normalized absolute matrices, not one of the reductions here).

    Args:
        pattern: ``[batch, channel, query_pos, key_pos]`` as cached from ``hook_pattern``.
        group_size: Channels per group; must divide the channel count.
        reduce: ``"mean_abs"`` (default; the matrices are signed), ``"mean"`` or ``"max_abs"``.

    Returns:
        ``[batch, channel // group_size, query_pos, key_pos]``.

    Raises:
        ValueError: If ``group_size`` does not divide the channel count or ``reduce`` is unknown.

    Examples:
        >>> import torch
        >>> channel_groups(torch.ones(1, 8, 3, 3), group_size=4).shape
        torch.Size([1, 2, 3, 3])
    """
    b, e, qn, kn = pattern.shape
    if group_size <= 0 or e % group_size:
        raise ValueError(
            f"channel_groups: group_size={group_size} does not divide the {e} channels of the "
            f"pattern (shape {tuple(pattern.shape)}); pass a divisor of {e}."
        )
    grouped = pattern.reshape(b, e // group_size, group_size, qn, kn)
    if reduce == "mean_abs":
        return grouped.abs().mean(2)
    if reduce == "mean":
        return grouped.mean(2)
    if reduce == "max_abs":
        return grouped.abs().amax(2)
    raise ValueError(
        f"channel_groups: reduce={reduce!r} is not one of 'mean_abs', 'mean', 'max_abs'."
    )


def mamba2_recurrent(
    x: Float[Tensor, "batch pos head d_head"],
    dt: Float[Tensor, "batch pos head"],
    A: Float[Tensor, " head"],
    B: Float[Tensor, "batch pos group state"],
    C: Float[Tensor, "batch pos group state"],
) -> Float[Tensor, "batch pos head d_head state"]:
    """Every state of the Mamba-2 recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ``.

    The eager (sequential) path, used when ``hook_ssm_state`` is hooked. Memory is
    ``batch * pos * head * d_head * state``.

    Args:
        x: Values.
        dt: Step sizes after softplus and clamping.
        A: ``-exp(A_log)``.
        B: ``[batch, pos, group, state]``.
        C: Unused by the recurrence; accepted so the signature matches :func:`mamba2_ssd`.

    Returns:
        ``[batch, pos, head, d_head, state]``.
    """
    del C
    heads = x.shape[2]
    Bh = B.repeat_interleave(heads // B.shape[2], dim=2)  # [b, L, h, n]
    decay = torch.exp(dt * A)  # [b, L, h]
    state = x.new_zeros(x.shape[0], heads, x.shape[3], B.shape[-1])
    states = []
    for t in range(x.shape[1]):
        write = (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        state = decay[:, t, :, None, None] * state + write
        states.append(state)
    return torch.stack(states, dim=1)


#: RoPE variants :func:`rope_inv_freq` computes (``rope_type`` of a Hugging Face config).
ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(
    theta: float,
    dim: int,
    scaling: dict[str, Any] | None = None,
    *,
    device: torch.device | str = HOST,
) -> Tensor:
    """RoPE inverse frequencies ``[dim / 2]`` (fp32), as Hugging Face computes them.

    Args:
        theta: The base (``rope_theta``).
        dim: The rotated width (``rotary_dim``).
        scaling: ``{}`` / ``None`` or ``{"rope_type": "default"}``: plain RoPE;
            ``{"rope_type": "linear", "factor": f}``: frequencies divided by ``f``;
            ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}``: Llama 3.1's smoothed scaling.

    Returns:
        The inverse frequencies.

    Raises:
        ValueError: For another ``rope_type`` (dynamic, YaRN, LongRoPE change with the length
            or scale the rotation itself).

    Examples:
        >>> rope_inv_freq(10000.0, 4)
        tensor([1.0000, 0.0100])
        >>> rope_inv_freq(10000.0, 4, {"rope_type": "linear", "factor": 2.0})
        tensor([0.5000, 0.0050])
    """
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", "default")
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type={kind!r}; implemented: {list(ROPE_TYPES)}.")
