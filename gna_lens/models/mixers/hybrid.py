"""The mixer of the retrieval-guided hybrid students: one layer of a Transformer teacher's heads,
each kept as attention or turned into a Mamba-2-style SSM head.

Heads keep the **teacher's numbering** (``0 .. n_heads - 1`` of its attention layer), so a
student's ``(layer, head)`` is the teacher head it came from, whatever its kind. Every head writes
its ``d_head`` slice of ``hook_z`` and all of them go through the teacher's full output projection
(``out_proj``, initialized from ``o_proj``).

**Attention heads** are the teacher's: its query rows, and the key / value rows of the KV heads
they read (grouped-query attention: only the KV heads some kept head needs are kept, and
``attn_kv`` maps each attention head to its KV head), RoPE, causal softmax, scale
``1 / sqrt(d_head)``.

**SSM heads** are Mamba-2 (SSD) heads without the convolution and the gate:

    C = c_proj(h), B = b_proj(h)            [pos, group, d_state]
    x = x_proj(h)                           [pos, head, d_head]
    dt = softplus(dt_proj(h) + dt_bias)     [pos, head]
    y_t = Σ_{s<=t} (C_t · B_s) exp(A Σ_{k=s+1..t} dt_k) dt_s x_s + D x_t,   A = -exp(A_log)

``B`` and ``C`` are per head (``head_layout="head"``) or shared by the SSM heads of one teacher
KV group (``"kv_group"``). The correspondence to attention is the point: with ``A = 0``,
``dt = 1`` and ``D = 0`` the head is causal linear attention ``Σ_{s<=t} (C_t · B_s) x_s``, so
``C <- q``, ``B <- k``, ``x <- v`` (Mamba-in-the-Llama, MOHAWK, Llamba) start it from the
teacher head's own read-out; the decay ``A``, the step ``dt`` and the skip ``D`` are what it
learns beyond that. A convolution or an output gate would break that correspondence (neither has
a counterpart in the teacher's head), so the student has none.

One ``hook_pattern`` ``[batch, head_index, query_pos, key_pos]`` holds every head's matrix: the
softmax pattern of attention heads, ``M = (C_i · B_j) exp(A Σ dt) dt_j`` of SSM heads; an edit
changes the output of both (``z_h = P_h @ v_h``, ``y_h = M_h @ x_h + D_h x_h``). It is
materialized only when hooked (and then only the heads and rows of
``HookedSSM.pattern_selection``: the reference path). Otherwise the layer runs its fast path,
all heads of a kind at once: the attention heads through fused attention
(``torch.nn.functional.scaled_dot_product_attention``, causal; the explicit softmax only while
``hook_attn_scores`` is hooked) and the SSM heads through a chunked SSD scan
(:func:`ssd_chunked`: the within-chunk products in the compute dtype, bfloat16 under bfloat16
autocast, the decays and the state carried between chunks in float32). Both paths give the same
output to float32 rounding (tested).
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.device import HOST
from gna_lens.errors import ConfigError
from gna_lens.models import ops
from gna_lens.models.config import SSMConfig
from gna_lens.models.mixers.attention import AttentionHeads, Rope, allowed_keys
from gna_lens.models.mixers.base import (
    SSMMixer,
    StepState,
    checked_pattern,
    has_hooks,
    masked,
    prefix_inputs,
    scatter_rows_heads,
    ssd_state,
    state_through_hook,
)

__all__ = ["HEAD_LAYOUTS", "TRAIN_CHUNK", "HybridConfig", "HybridMixer", "ssd_chunked"]

#: How the SSM heads of a layer get ``B`` and ``C``: one pair per head, or one pair per teacher
#: KV group (the heads that read the same teacher key / value head share them).
HEAD_LAYOUTS = ("head", "kv_group")

#: Mamba-2's initialization (``mamba_ssm``'s ``Mamba2``): ``dt`` log-uniform in
#: ``[DT_MIN, DT_MAX]`` (floored at ``DT_FLOOR``), ``A`` uniform in ``A_INIT``, ``D = 1``.
DT_MIN, DT_MAX, DT_FLOOR = 0.001, 0.1, 1e-4
A_INIT = (1.0, 16.0)

#: Chunk length of the fast path's SSD scan (:func:`ssd_chunked`; at most ``cfg.chunk_size``).
#: Its within-chunk work and memory grow with the chunk (``[chunk, chunk]`` per head and chunk),
#: the carry between chunks with their number; 64 was the fastest of 32 / 64 / 128 / 256 for the
#: scan's forward and backward at 2 x 512 positions, 14 heads, d_state 64 (58 ms against 166 ms
#: at 256 on one thread of an Intel Xeon; 156 ms for ``ops.mamba2_ssd`` in float32), and is the
#: chunk of Mamba-2's own kernels' inner blocks.
TRAIN_CHUNK = 64


def _segsum_exp(a: Tensor) -> Tensor:
    """``exp(Σ_{k=j+1..i} a_k)`` for ``j <= i``, 0 above the diagonal: ``[..., T] -> [..., T, T]``.

    Each segment sum is a cumulative sum over the segment itself (``a_i`` kept below the
    diagonal, summed down the rows), never a difference of prefix sums.
    """
    T = a.shape[-1]
    lower = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
    strict = lower.tril(-1)
    seg = a[..., :, None].expand(*a.shape, T).masked_fill(~strict, 0.0).cumsum(-2)
    return torch.exp(seg).masked_fill(~lower, 0.0)


def ssd_chunked(
    x: Float[Tensor, "batch pos head d_head"],
    dt: Float[Tensor, "batch pos head"],
    A: Float[Tensor, " head"],
    B: Float[Tensor, "batch pos head d_state"],
    C: Float[Tensor, "batch pos head d_state"],
    chunk_size: int = TRAIN_CHUNK,
) -> Float[Tensor, "batch pos head d_head"]:
    """The SSM heads' scan ``y_t = Σ_{s<=t} (C_t · B_s) exp(A Σ_{k=s+1..t} dt_k) dt_s x_s``
    (no ``D`` term), every head at once, for training: the fast path of :class:`HybridMixer`.

    Chunked state-space duality, as :func:`gna_lens.models.ops.mamba2_ssd` computes it, with the
    dtypes of Mamba-2's kernels: the within-chunk products ``(L ∘ C Bᵀ) (dt x)`` (the only
    ``[chunk, chunk]`` work) run in the compute dtype (bfloat16 under bfloat16 autocast, else the
    promoted dtype of ``x`` and float32), while the decays, each chunk's end state, the state
    carried between chunks and its read-out stay in float32 (or wider). Without autocast and in
    float32 the result equals ``mamba2_ssd``'s to float32 rounding.

    Args:
        x: Values.
        dt: Step sizes after softplus and clamping.
        A: ``-exp(A_log)`` per head.
        B: ``[batch, pos, head, d_state]`` (one per head: heads of a group repeat theirs).
        C: The same.
        chunk_size: Chunk length (an input shorter than a chunk is one chunk, no padding).

    Returns:
        ``y`` of ``x``'s shape, in the compute dtype's promotion with float32 (``x``'s dtype when
        that is float32 or wider).

    Examples:
        >>> import torch
        >>> from gna_lens.models.ops import mamba2_ssd
        >>> g = torch.Generator().manual_seed(0)
        >>> x, B, C = (torch.randn(1, 40, 2, s, generator=g, device="cpu") for s in (3, 4, 4))
        >>> dt = torch.rand(1, 40, 2, generator=g, device="cpu")
        >>> A = -torch.tensor([0.5, 2.0], device="cpu")
        >>> ref = mamba2_ssd(x, dt, A, B, C, chunk_size=40)
        >>> torch.allclose(ssd_chunked(x, dt, A, B, C, chunk_size=16), ref, atol=1e-5)
        True
    """
    batch, length, heads, P = x.shape
    device = x.device
    wide = torch.promote_types(x.dtype, torch.float32)
    autocast = torch.is_autocast_enabled(device.type)
    cd = torch.get_autocast_dtype(device.type) if autocast else wide  # the T x T products
    T = max(1, min(chunk_size, length))
    x, dt, B, C = ops.pad_positions(T, x, dt, B, C)
    n = x.shape[1] // T
    with torch.autocast(device.type, enabled=False):
        a = (dt.to(wide) * A.to(wide)).view(batch, n, T, heads).permute(0, 3, 1, 2)  # [b,h,c,T]
        xdt = (x.to(wide) * dt.to(wide)[..., None]).view(batch, n, T, heads, P)
        Bc = B.reshape(batch, n, T, heads, -1)
        Cc = C.reshape(batch, n, T, heads, -1)
        # 1. Within chunks, in the compute dtype: y = (L ∘ C Bᵀ) (dt x).
        decay = _segsum_exp(a)  # [b,h,c,T,T], wide
        CB = torch.einsum("bclhn,bcshn->bhcls", Cc.to(cd), Bc.to(cd))
        M = CB * decay.to(cd)
        y = torch.einsum("bhcls,bcshp->bclhp", M, xdt.to(cd)).to(wide)
        # 2. Each chunk's end state from its own inputs, wide: Σ_s exp(Σ_{k>s} a_k) dt_s x_s B_sᵀ.
        to_end = decay[..., -1, :]  # [b,h,c,T]: the last row of the chunk's decays
        xw = xdt * to_end.permute(0, 2, 3, 1)[..., None]  # [b,c,T,h,p]
        states = torch.einsum("bcshn,bcshp->bchpn", Bc.to(wide), xw)
        # 3. The state entering each chunk: chunk sums decayed across chunks, wide.
        cs = a.cumsum(-1)  # [b,h,c,T]: Σ_{k<=l} a_k from the chunk's start
        across = _segsum_exp(cs[..., -1])  # [b,h,c,c]
        ends = torch.einsum("bhzc,bchpn->bzhpn", across, states)
        starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
        # 4. The entering state read out at each position: exp(Σ_{k<=l} a_k) C_l · state.
        y = (
            y
            + torch.einsum("bclhn,bchpn->bclhp", Cc.to(wide), starts)
            * torch.exp(cs).permute(0, 2, 3, 1)[..., None]
        )
    return y.reshape(batch, n * T, heads, P)[:, :length]


@dataclass
class HybridConfig(SSMConfig):
    """:class:`~gna_lens.models.SSMConfig` of a hybrid student (architecture ``"gna_hybrid"``).

    ``n_heads`` / ``d_head`` are the teacher's query heads and head width (every layer has all
    of them, each of its own kind); ``n_attn_kv_heads`` its KV heads; ``d_state`` the SSM
    heads' state size.

    Attributes:
        attention_heads: Per layer, the teacher heads kept as attention (sorted); the others
            are SSM heads.
        ssm_head_layout: ``"head"`` or ``"kv_group"`` (see :data:`HEAD_LAYOUTS`).
        teacher: Where the student came from: the teacher's name, class and provenance.
    """

    attention_heads: list[list[int]] = field(default_factory=list)
    ssm_head_layout: str = "head"
    teacher: dict[str, Any] = field(default_factory=dict)


class HybridMixer(AttentionHeads, SSMMixer):
    """One layer of a hybrid student: attention heads and SSM heads in the teacher's numbering
    (see the module docstring).

    Hook points (all ``blocks.{l}.mixer.*``): attention heads ``hook_q``, ``hook_rot_q``
    ``[batch, pos, attn_head, d_head]``, ``hook_k``, ``hook_v``, ``hook_rot_k``
    ``[batch, pos, kv_head, d_head]``, ``hook_attn_scores`` ``[batch, attn_head, query_pos,
    key_pos]`` (``attn_head`` indexes :attr:`attn_heads`, ``kv_head`` :attr:`kv_heads`);
    SSM heads ``hook_ssm_input`` ``[batch, pos, ssm_head, d_head]``, ``hook_ssm_dt``
    ``[batch, pos, ssm_head]``, ``hook_ssm_B`` / ``hook_ssm_C`` ``[batch, pos, group,
    d_state]``, ``hook_ssm_state`` ``[batch, pos, ssm_head, d_head, d_state]``,
    ``hook_ssm_out`` ``[batch, pos, ssm_head, d_head]`` (``y + D x``; ``ssm_head`` indexes
    :attr:`ssm_heads`); every head ``hook_pattern`` ``[batch, head_index, query_pos,
    key_pos]`` and ``hook_z`` ``[batch, pos, head_index, d_head]``. A layer without heads of one
    kind never fires that kind's hooks.

    Attributes:
        attn_heads: Teacher heads kept as attention (sorted).
        ssm_heads: Teacher heads turned into SSM heads (sorted).
        kv_heads: Teacher KV heads the attention heads read (sorted).
        ssm_groups: Per ``B`` / ``C`` group, the teacher KV head it stands for
            (``"kv_group"``), or per SSM head its own index (``"head"``).
    """

    uses_rope: ClassVar[bool] = True
    prefix_hooks: ClassVar[tuple[str, ...]] = (
        "hook_rot_k",
        "hook_v",
        "hook_ssm_input",
        "hook_ssm_dt",
        "hook_ssm_B",
    )

    def __init__(self, cfg: SSMConfig, attention_heads: Sequence[int]):
        super().__init__(cfg)
        H, KV, d, N = cfg.n_heads, cfg.n_attn_kv_heads, cfg.d_head, cfg.d_state
        layout = str(getattr(cfg, "ssm_head_layout", "head"))
        if layout not in HEAD_LAYOUTS:
            raise ConfigError(
                f"ssm_head_layout={layout!r}; expected one of {list(HEAD_LAYOUTS)} (B and C per "
                "SSM head, or shared by the SSM heads of one teacher KV group)."
            )
        if not (isinstance(N, int) and N >= 1):
            raise ConfigError(f"d_state={N!r}; the SSM heads' state size must be an int >= 1.")
        if KV < 1 or H % KV:
            raise ConfigError(
                f"n_heads={H} query heads over n_attn_kv_heads={KV} KV heads; expected a "
                "positive number of KV heads dividing the query heads."
            )
        bad = [h for h in attention_heads if not 0 <= h < H]
        if bad:
            raise ConfigError(
                f"attention heads {bad} are out of range for a layer of {H} heads (0..{H - 1})."
            )
        self.layout = layout
        self.attn_heads = sorted(set(int(h) for h in attention_heads))
        self.ssm_heads = [h for h in range(H) if h not in self.attn_heads]
        per_kv = H // KV
        self.kv_heads = sorted({h // per_kv for h in self.attn_heads})
        if layout == "kv_group":
            self.ssm_groups = sorted({h // per_kv for h in self.ssm_heads})
            group_of = [self.ssm_groups.index(h // per_kv) for h in self.ssm_heads]
        else:
            self.ssm_groups = list(range(len(self.ssm_heads)))
            group_of = list(self.ssm_groups)
        n_attn, n_ssm, n_kv, G = (
            len(self.attn_heads),
            len(self.ssm_heads),
            len(self.kv_heads),
            len(self.ssm_groups),
        )
        D, bias = cfg.d_model, cfg.attn_bias
        if n_attn:
            self.q_proj = nn.Linear(D, n_attn * d, bias=bias)
            self.k_proj = nn.Linear(D, n_kv * d, bias=bias)
            self.v_proj = nn.Linear(D, n_kv * d, bias=bias)
        if n_ssm:
            self.c_proj = nn.Linear(D, G * N, bias=bias)
            self.b_proj = nn.Linear(D, G * N, bias=bias)
            self.x_proj = nn.Linear(D, n_ssm * d, bias=bias)
            self.dt_proj = nn.Linear(D, n_ssm, bias=False)
            self.dt_bias = nn.Parameter(torch.zeros(n_ssm))
            self.A_log = nn.Parameter(torch.zeros(n_ssm))
            self.D = nn.Parameter(torch.ones(n_ssm))
        self.out_proj = nn.Linear(H * d, D, bias=bias)
        self.scale = float(cfg.attn_scale or d**-0.5)
        self._buffer("attn_index", self.attn_heads)
        self._buffer("ssm_index", self.ssm_heads)
        self._buffer("attn_kv", [self.kv_heads.index(h // per_kv) for h in self.attn_heads])
        self._buffer("ssm_group", group_of)
        self._add_attention_hooks()
        self.hook_ssm_input = HookPoint()  # [batch, pos, ssm_head, d_head]
        self.hook_ssm_dt = HookPoint()  # [batch, pos, ssm_head]
        self.hook_ssm_B = HookPoint()  # [batch, pos, group, d_state]
        self.hook_ssm_C = HookPoint()  # [batch, pos, group, d_state]
        self.hook_ssm_state = HookPoint()  # [batch, pos, ssm_head, d_head, d_state]
        self.hook_ssm_out = HookPoint()  # [batch, pos, ssm_head, d_head], y + D x
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_head]

    def _buffer(self, name: str, values: list[int]) -> None:
        self.register_buffer(
            name, torch.tensor(values, dtype=torch.long, device=HOST), persistent=False
        )

    @classmethod
    def for_layer(cls, cfg: SSMConfig, layer: int) -> "HybridMixer":
        """The mixer of ``layer``: its attention heads are ``cfg.attention_heads[layer]``."""
        heads = getattr(cfg, "attention_heads", None)
        if heads is None or len(heads) != cfg.n_layers:
            raise ConfigError(
                f"A gna_hybrid model needs a HybridConfig with attention_heads for each of its "
                f"{cfg.n_layers} layers; got {type(cfg).__name__} with attention_heads={heads!r}."
            )
        return cls(cfg, heads[layer])

    # ------------------------------------------------------------------ initialization
    def init_from_attention(
        self, weights: Mapping[str, Tensor], generator: torch.Generator | None = None
    ) -> None:
        """Copy a teacher attention layer into this layer (see the module docstring).

        Attention heads take their query, key, value rows as they are. SSM heads take
        ``C <- q`` rows (the head's first ``d_state`` dimensions, times ``1 / sqrt(d_head)``,
        zero-padded when ``d_state > d_head``), ``B <- k`` rows of the head's KV head (the same
        slice) and ``x <- v`` rows of its KV head; with ``"kv_group"`` a group's ``C`` is the
        mean of its SSM heads' scaled ``q`` rows. ``dt_proj`` starts at zero (``dt`` then depends
        on the input only through what training adds) and ``dt_bias``, ``A_log`` and ``D``
        follow Mamba-2 (:data:`DT_MIN` .. :data:`DT_MAX`, :data:`A_INIT`, ``D = 1``).

        Args:
            weights: ``q_proj.weight`` ``[n_heads * d_head, d_model]``, ``k_proj.weight``,
                ``v_proj.weight`` ``[n_kv_heads * d_head, d_model]``, ``o_proj.weight``, and the
                ``.bias`` of each when the teacher has attention biases.
            generator: Random generator of the Mamba-2 initialization of ``dt`` and ``A``.
        """
        cfg = self.cfg
        d, N = cfg.d_head, cfg.d_state
        per_kv = cfg.n_heads // cfg.n_attn_kv_heads
        params = {"weight": True, "bias": cfg.attn_bias}

        def rows(name: str, head: int, width: int = d) -> dict[str, Tensor]:
            return {
                p: weights[f"{name}.{p}"][head * d : head * d + width]
                for p, on in params.items()
                if on
            }

        def copy(module: nn.Linear, parts: list[dict[str, Tensor]]) -> None:
            for p, on in params.items():
                if on:
                    getattr(module, p).copy_(torch.cat([part[p] for part in parts]))

        with torch.no_grad():
            self.out_proj.weight.copy_(weights["o_proj.weight"])
            if cfg.attn_bias:
                self.out_proj.bias.copy_(weights["o_proj.bias"])
            if self.attn_heads:
                copy(self.q_proj, [rows("q_proj", h) for h in self.attn_heads])
                copy(self.k_proj, [rows("k_proj", g) for g in self.kv_heads])
                copy(self.v_proj, [rows("v_proj", g) for g in self.kv_heads])
            if not self.ssm_heads:
                return
            width = min(N, d)
            scale = d**-0.5

            def padded(part: dict[str, Tensor], factor: float = 1.0) -> dict[str, Tensor]:
                return {
                    p: F.pad(t * factor, [0, 0] * (t.ndim - 1) + [0, N - width])
                    for p, t in part.items()
                }

            C_parts, B_parts = [], []
            if self.layout == "head":
                for h in self.ssm_heads:
                    C_parts.append(padded(rows("q_proj", h, width), scale))
                    B_parts.append(padded(rows("k_proj", h // per_kv, width)))
            else:
                for g in self.ssm_groups:
                    members = [h for h in self.ssm_heads if h // per_kv == g]
                    qs = [padded(rows("q_proj", h, width), scale) for h in members]
                    C_parts.append({p: torch.stack([q[p] for q in qs]).mean(0) for p in qs[0]})
                    B_parts.append(padded(rows("k_proj", g, width)))
            copy(self.c_proj, C_parts)
            copy(self.b_proj, B_parts)
            copy(self.x_proj, [rows("v_proj", h // per_kv) for h in self.ssm_heads])
            self.dt_proj.weight.zero_()
            n = len(self.ssm_heads)
            u = torch.rand(n, generator=generator, dtype=torch.float64, device=HOST)
            dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
            dt = dt.clamp(min=DT_FLOOR)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            lo, hi = A_INIT
            A = torch.rand(n, generator=generator, dtype=torch.float64, device=HOST)
            A = A * (hi - lo) + lo
            self.A_log.copy_(torch.log(A))
            self.D.fill_(1.0)

    # ------------------------------------------------------------------ shared by both paths
    def _ssm_inputs(self, h: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``hook_ssm_input``, ``hook_ssm_B``, ``hook_ssm_C``, ``hook_ssm_dt`` (padding: ``x`` and
        ``B`` zero, so a padded position writes nothing)."""
        cfg = self.cfg
        b, L, _ = h.shape
        G, N = len(self.ssm_groups), cfg.d_state
        x = self.x_proj(h).view(b, L, len(self.ssm_heads), cfg.d_head)
        B = self.b_proj(h).view(b, L, G, N)
        if mask is not None:
            keep = mask.to(h.dtype)
            x, B = x * keep[..., None, None], B * keep[..., None, None]
        x = self.hook_ssm_input(x)
        B = self.hook_ssm_B(B)
        C = self.hook_ssm_C(self.c_proj(h).view(b, L, G, N))
        lo, hi = cfg.time_step_limit
        dt = F.softplus(self.dt_proj(h) + self.dt_bias).clamp(min=lo, max=hi)
        return x, B, C, self.hook_ssm_dt(dt)

    def _heads_of(self, t: Tensor) -> Tensor:
        """``B`` or ``C`` ``[..., group, d_state]`` -> one entry per SSM head."""
        if self.layout == "head":
            return t
        return t.index_select(2, self.ssm_group)  # type: ignore[arg-type]

    def _combine(self, attn: Tensor | None, ssm: Tensor | None, like: Tensor) -> Tensor:
        """The attention heads' and SSM heads' ``[batch, pos, ., d_head]`` in teacher order."""
        if ssm is None:
            assert attn is not None
            return attn
        if attn is None:
            return ssm
        b, L = like.shape[:2]
        out = attn.new_zeros(b, L, self.cfg.n_heads, self.cfg.d_head)
        out = out.index_copy(2, self.attn_index, attn)  # type: ignore[arg-type]
        return out.index_copy(2, self.ssm_index, ssm.to(out.dtype))  # type: ignore[arg-type]

    def _output(self, y: Tensor, x: Tensor | None, dtype: torch.dtype) -> Tensor:
        """``D`` skip of the SSM heads (``hook_ssm_out``), ``hook_z`` and ``out_proj``."""
        b, L = y.shape[:2]
        if x is not None:
            index: Tensor = self.ssm_index  # type: ignore[assignment]
            ssm = y.index_select(2, index) if self.attn_heads else y
            ssm = self.hook_ssm_out(ssm + x * self.D[:, None])
            y = y.index_copy(2, index, ssm.to(y.dtype)) if self.attn_heads else ssm
        z = self.hook_z(y)
        return cast("Tensor", self.out_proj(z.reshape(b, L, -1).to(dtype)))

    # ------------------------------------------------------------------ forward
    def forward(
        self, h: Float[Tensor, "batch pos d_model"], mask: Tensor | None, rope: Rope = None
    ) -> Float[Tensor, "batch pos d_model"]:
        L = h.shape[1]
        h = masked(h, mask)
        materialize = has_hooks(self.hook_pattern)
        if not materialize:
            return self._forward_fast(h, mask, rope)
        # The reference path: hook_pattern is hooked, so every selected head's matrix is
        # materialized and the output read off it (y = pattern @ values + D x).
        heads, rows = self._selection(L, h.device)
        need_fast = heads is not None or rows is not None
        P_attn = v = x = dt = A = B = C = None
        y_attn = y_ssm = None
        if self.attn_heads:
            q, k, v = self._qkv(h, rope)
            P_attn = self._attend(q, k, allowed_keys(L, mask, h.device))
            v = self._per_head(v)
            if need_fast:
                y_attn = torch.einsum("bhqk,bkhd->bqhd", P_attn, v)
        if self.ssm_heads:
            x, B, C, dt = self._ssm_inputs(h, mask)
            A = -torch.exp(self.A_log.float())
            Bh, Ch = self._heads_of(B), self._heads_of(C)
            # the scans run in fp32 or wider (a bf16 / fp16 student: cast back after)
            if has_hooks(self.hook_ssm_state):
                y_ssm = self._through_states(x, dt, A, Bh, Ch, refuse_edit=True).to(x.dtype)
            elif need_fast:
                y_ssm = ops.mamba2_ssd(x, dt, A, Bh, Ch, self.cfg.chunk_size)
        y = self._combine(y_attn, y_ssm, h) if need_fast else None
        self._check_dtype(h.dtype)
        pattern = self._pattern(P_attn, dt, A, B, C, heads, rows).to(h.dtype)
        pattern = checked_pattern(self.hook_pattern(pattern), pattern, self.hook_pattern.name)
        values = self._combine(v, x, h)
        if heads is not None:
            values = values.index_select(2, heads)
        y_sel = torch.einsum("bhrj,bjhp->brhp", pattern, values.to(pattern.dtype))
        y = scatter_rows_heads(y, y_sel, heads, rows, head_dim=2)
        return self._output(y, x, h.dtype)

    def _forward_fast(self, h: Tensor, mask: Tensor | None, rope: Rope) -> Tensor:
        """The output with nothing hooking ``hook_pattern``: all attention heads in one fused
        attention, all SSM heads in one chunked SSD scan (:func:`ssd_chunked`), no ``[pos, pos]``
        matrix kept (but while ``hook_attn_scores`` is hooked: the explicit softmax)."""
        b, L, _ = h.shape
        y_attn = y_ssm = None
        if self.attn_heads:
            q, k, v = self._qkv(h, rope)
            if has_hooks(self.hook_attn_scores):
                P = self._attend(q, k, allowed_keys(L, mask, h.device))
                y_attn = torch.einsum("bhqk,bkhd->bqhd", P, self._per_head(v))
            else:
                y_attn = self._fused_attention(q, k, v, mask)
        if self.ssm_heads:
            x, B, C, dt = self._ssm_inputs(h, mask)
            A = -torch.exp(self.A_log.float())
            Bh, Ch = self._heads_of(B), self._heads_of(C)
            if has_hooks(self.hook_ssm_state):
                y = self._through_states(x, dt, A, Bh, Ch, refuse_edit=False)
            else:
                y = ssd_chunked(x, dt, A, Bh, Ch, min(TRAIN_CHUNK, self.cfg.chunk_size))
            y_ssm = self.hook_ssm_out(y.to(x.dtype) + x * self.D[:, None])
        z = self.hook_z(self._combine(y_attn, y_ssm, h))
        return cast("Tensor", self.out_proj(z.reshape(b, L, -1).to(h.dtype)))

    def _through_states(
        self, x: Tensor, dt: Tensor, A: Tensor, Bh: Tensor, Ch: Tensor, refuse_edit: bool
    ) -> Tensor:
        """The SSM heads' ``y`` (fp32 or wider) read off every state, through ``hook_ssm_state``
        (``refuse_edit``: an edit raises, as the materialized pattern would drop it)."""
        wide = torch.promote_types(x.dtype, torch.float32)
        xw, dtw, Bw, Cw = (t.to(wide) for t in (x, dt, Bh, Ch))
        states = ops.mamba2_recurrent(xw, dtw, A, Bw, Cw)
        states, edited = state_through_hook(self.hook_ssm_state, states)
        if edited and refuse_edit:
            self._refuse_state_edit()
        return torch.einsum("blhpn,blhn->blhp", states, Cw)

    def _pattern(
        self,
        P_attn: Tensor | None,
        dt: Tensor | None,
        A: Tensor | None,
        B: Tensor | None,
        C: Tensor | None,
        heads: Tensor | None,
        rows: Tensor | None,
    ) -> Tensor:
        """Every selected head's matrix in teacher order ``[batch, head, row, key]``."""
        wanted = list(range(self.cfg.n_heads)) if heads is None else heads.tolist()
        kept = {h: i for i, h in enumerate(self.attn_heads)}
        ssm = {h: i for i, h in enumerate(self.ssm_heads)}
        at = [(j, kept[h]) for j, h in enumerate(wanted) if h in kept]
        sm = [(j, ssm[h]) for j, h in enumerate(wanted) if h in ssm]
        parts: list[tuple[list[int], Tensor]] = []
        if at:
            assert P_attn is not None
            p = P_attn.index_select(1, torch.tensor([i for _, i in at], device=P_attn.device))
            parts.append(([j for j, _ in at], p if rows is None else p.index_select(2, rows)))
        if sm:
            assert dt is not None and A is not None and B is not None and C is not None
            idx = torch.tensor([i for _, i in sm], device=dt.device)
            M = self.materialize(dt, A, B, C, None if len(sm) == len(ssm) else idx, rows)
            parts.append(([j for j, _ in sm], M))
        if len(parts) == 1 and parts[0][0] == list(range(len(wanted))):
            return parts[0][1]
        ref = parts[0][1]
        out = ref.new_zeros(ref.shape[0], len(wanted), ref.shape[2], ref.shape[3])
        for where, t in parts:
            out = out.index_copy(1, torch.tensor(where, device=out.device), t.to(out.dtype))
        return out

    def materialize(
        self,
        dt: Float[Tensor, "batch pos ssm_head"],
        A: Float[Tensor, " ssm_head"],
        B: Float[Tensor, "batch pos group d_state"],
        C: Float[Tensor, "batch pos group d_state"],
        heads: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> Float[Tensor, "batch selected_head query_row pos"]:
        """The SSM heads' matrices ``M_h[i, j] = (C_i · B_j) exp(A_h Σ_{k=j+1..i} dt_k) dt_j``
        (``hook_pattern``'s SSM rows), in fp32 or wider.

        Args:
            dt: ``hook_ssm_dt``.
            A: ``-exp(A_log)``.
            B: ``hook_ssm_B``.
            C: ``hook_ssm_C``.
            heads: Indices into :attr:`ssm_heads` (the SSM hooks' head axis), or ``None``: all.
            rows: Query positions (sorted, non-negative), or ``None``: all.

        Returns:
            ``[batch, len(heads), len(rows), key_pos]``.
        """
        group: Tensor = self.ssm_group  # type: ignore[assignment]
        if heads is not None:
            dt, A, group = (
                dt.index_select(2, heads),
                A.index_select(0, heads),
                group.index_select(0, heads),
            )
        return ops.mamba2_pattern(dt, A, B, C, group, rows)

    # ------------------------------------------------------------------ incremental
    def prefix_state(self, acts: Mapping[str, Tensor], length: int) -> StepState:
        """The attention heads' rotated keys and values and the SSM heads' recurrent state after
        the first ``length`` positions.

        Returns:
            ``{"k", "v": [G, length, kv_head, d_head]}`` (attention heads) and
            ``{"state": [G, ssm_head, d_head, d_state]}`` (SSM heads), as the layer has them.
        """
        P = length
        out: StepState = {}
        if self.attn_heads:
            out["k"], out["v"] = acts["hook_rot_k"][:, :P], acts["hook_v"][:, :P]
        if self.ssm_heads:
            x, dt, B = prefix_inputs(acts, P)
            out["state"] = ssd_state(x, dt, -torch.exp(self.A_log.float()), self._heads_of(B))
        return out

    def step(
        self, state: StepState, h: Float[Tensor, "batch 1 d_model"], rope: Rope = None
    ) -> Tensor:
        """One token after the prefix (``rope``: its position's rotation; see
        :meth:`SSMMixer.step`)."""
        self._refuse_step_patterns()
        y_attn = y_ssm = x = None
        if self.attn_heads:
            q, k, v = self._qkv(h, rope)
            k = torch.cat([state["k"].to(k.dtype), k], dim=1)
            v = torch.cat([state["v"].to(v.dtype), v], dim=1)
            y_attn = torch.einsum("bhqk,bkhd->bqhd", self._attend(q, k, None), self._per_head(v))
        if self.ssm_heads:
            x, B, C, dt = self._ssm_inputs(h, None)
            A = -torch.exp(self.A_log.float())
            Bh, Ch = self._heads_of(B)[:, 0].float(), self._heads_of(C)[:, 0].float()
            d = dt[:, 0].float()  # [R, H]
            s = torch.exp(d * A)[..., None, None] * state["state"] + (
                d[..., None, None] * x[:, 0].float()[..., None] * Bh[:, :, None, :]
            )
            y_ssm = torch.einsum("rhpn,rhn->rhp", s, Ch)[:, None].to(x.dtype)
        return self._output(self._combine(y_attn, y_ssm, h), x, h.dtype)
