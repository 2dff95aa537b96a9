"""The Mamba-2 (SSD) mixer: fast forward, materialized implicit attention, single-token step.

Used by Mamba-2 and by the hybrids (Bamba, Nemotron-H, Granite 4.0, Falcon-H1, Zamba2); the
families' variations (Falcon-H1's multipliers, the output norm's kind) are fields of
:class:`~gna_lens.models.SSMConfig`.
"""

from collections.abc import Callable, Mapping
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.models import kernels, ops
from gna_lens.models.config import SSMConfig
from gna_lens.models.mixers.base import (
    RMSNorm,
    SSMMixer,
    StepState,
    conv_last,
    conv_tail,
    has_hooks,
    masked,
    prefix_inputs,
    ssd_state,
    state_through_hook,
)

__all__ = ["Mamba2Mixer"]


def _mamba2_pattern_part(
    head_group: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    heads: Tensor | None,
    rows: Tensor | None,
    scale_keys: bool = True,
) -> Tensor:
    """:func:`gna_lens.models.ops.mamba2_pattern` of the heads ``heads`` (``None``: all) of
    ``dt`` / ``A`` / ``head_group``, with ``C · B`` computed for their groups only
    (``scale_keys``: as the op's).

    Examples:
        >>> import torch
        >>> from gna_lens.models import ops
        >>> g = torch.Generator().manual_seed(0)
        >>> dt, B, C = torch.rand(1, 5, 4, generator=g), torch.randn(1, 5, 2, 3), torch.randn(1, 5, 2, 3)
        >>> A, hg = -torch.rand(4, generator=g), torch.tensor([0, 0, 1, 1])
        >>> full = ops.mamba2_pattern(dt, A, B, C, hg)
        >>> part = _mamba2_pattern_part(hg, dt, A, B, C, torch.tensor([2, 3]), torch.tensor([1, 4]))
        >>> torch.equal(part, full[:, 2:4][:, :, [1, 4]])
        True
    """
    if heads is None:
        return ops.mamba2_pattern(dt, A, B, C, head_group, rows, scale_keys=scale_keys)
    groups, local = torch.unique(head_group.index_select(0, heads), return_inverse=True)
    return ops.mamba2_pattern(
        dt.index_select(2, heads),
        A.index_select(0, heads),
        B.index_select(2, groups),
        C.index_select(2, groups),
        local,
        rows,
        scale_keys=scale_keys,
    )


class Mamba2Mixer(SSMMixer):
    """Mamba-2 (SSD) mixer with grouped ``B``/``C`` and the gated RMSNorm.

    ``hook_pattern`` is ``[batch, head_index, query_pos, key_pos]`` in the form
    ``M = (C_i · B_j) exp(A Σ_{k=j+1..i} dt_k) dt_j`` (``y = M @ x + D x``).
    """

    #: Whether the pattern carries the key position's step ``dt_j`` (Mamba-2:
    #: ``M = (C_i · B_j) exp(A Σ dt) dt_j``); a variant whose scan input is ``x / dt``
    #: (DiscreteMamba2) has ``M = (C_i · B_j) exp(A Σ dt)`` and sets it ``False``.
    pattern_scales_keys: ClassVar[bool] = True
    #: Where the convolution's input ``xBC`` starts in ``in_proj``'s output (Mamba-2:
    #: after ``z``).
    conv_offset: int

    def __init__(self, cfg: SSMConfig):
        super().__init__(cfg)
        E, H, G, N = cfg.d_inner, cfg.n_heads, cfg.n_groups, cfg.d_state
        self.conv_offset = E
        self.conv_dim = E + 2 * G * N
        self.in_proj = nn.Linear(cfg.d_model, E + self.conv_dim + H, bias=cfg.proj_bias)
        if cfg.ssm_multipliers:  # Falcon-H1's muP vector over the sections z, x, B, C, dt
            sizes = (E, E, G * N, G * N, H)
            self.register_buffer(
                "mup_vector",
                torch.cat(
                    [
                        torch.full((n,), float(v), device=self.in_proj.weight.device)
                        for n, v in zip(sizes, cfg.ssm_multipliers, strict=True)
                    ]
                ),
                persistent=False,
            )
        else:
            self.mup_vector = None
        self.conv1d = self._depthwise_conv()
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        if cfg.mamba_norm != "none":
            self.norm = RMSNorm(E, cfg.eps)
        out_bias = cfg.proj_bias if cfg.out_proj_bias is None else cfg.out_proj_bias
        self.out_proj = nn.Linear(E, cfg.d_model, bias=out_bias)
        self.register_buffer("head_group", torch.arange(H) // (H // G), persistent=False)
        self._add_hook_points()

    # ------------------------------------------------------------------ shared by both paths
    def _add_hook_points(self) -> None:
        """The mixer's hook points (shapes in the comments; ``in_proj``'s sections in the
        family's order)."""
        # [batch, pos, 2 * d_inner + 2 * n_groups * d_state + n_heads]
        self.hook_in_proj = HookPoint()
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

    def project(self, h: Tensor) -> Tensor:
        """``hook_in_proj``: ``in_proj`` of the input (with Falcon-H1's multipliers)."""
        m = self.cfg.ssm_in_multiplier
        out = self.in_proj(h if m == 1.0 else h * m)
        if self.mup_vector is not None:
            out = out * self.mup_vector
        return cast("Tensor", self.hook_in_proj(out))

    def _depthwise_conv(self) -> nn.Conv1d:
        """The causal depthwise convolution over ``conv_dim`` channels (``cfg.d_conv`` wide)."""
        cfg = self.cfg
        return nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            cfg.d_conv,
            groups=self.conv_dim,
            padding=cfg.d_conv - 1,
            bias=cfg.conv_bias,
        )

    def split_projection(self, proj: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(z, xBC, dt_raw)`` of ``in_proj``'s output (Mamba-2's order: ``z``, ``xBC``,
        ``dt``)."""
        cfg = self.cfg
        z, xBC, dt_raw = proj.split([cfg.d_inner, self.conv_dim, cfg.n_heads], dim=-1)
        return z, xBC, dt_raw

    def gate_input(self, z: Tensor) -> Tensor:
        """What ``hook_gate`` holds: ``z`` (a variant adds its bias)."""
        return z

    def scan_values(self, x: Tensor, dt: Tensor) -> Tensor:
        """The values the scan multiplies by ``dt`` (``h_t = exp(dt A) h + dt v_t B_t``):
        ``x`` (a variant divides by ``dt``)."""
        del dt
        return x

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

    def _ssm_inputs(self, xBC: Tensor, dt_raw: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``hook_ssm_input``, ``hook_ssm_B``, ``hook_ssm_C``, ``hook_ssm_dt`` of the activated
        convolution output ``xBC`` and the raw ``dt``."""
        cfg = self.cfg
        b, L = xBC.shape[:2]
        E, H, G, N, P = cfg.d_inner, cfg.n_heads, cfg.n_groups, cfg.d_state, cfg.d_head
        x, B, C = xBC.split([E, G * N, G * N], dim=-1)
        x = self.hook_ssm_input(x.reshape(b, L, H, P))
        B = self.hook_ssm_B(B.reshape(b, L, G, N))
        C = self.hook_ssm_C(C.reshape(b, L, G, N))
        return x, B, C, self.hook_ssm_dt(self.step_size(dt_raw))

    def step_size(self, dt_raw: Tensor) -> Tensor:
        """``dt`` of its ``in_proj`` section: ``softplus(dt_raw + dt_bias)`` clamped to
        ``time_step_limit`` (a variant may drop the bias and the limits)."""
        lo, hi = self.cfg.time_step_limit
        return F.softplus(dt_raw + self.dt_bias).clamp(min=lo, max=hi)

    def skip(self) -> Tensor:
        """The ``D`` skip of each head (a variant zeroes it on heads that have none)."""
        return self.D

    def _output(
        self, y: Tensor, x: Tensor, z: Tensor, dtype: torch.dtype, attn: Tensor | None = None
    ) -> Tensor:
        """``D`` skip, gated norm, ``hook_z`` and ``out_proj`` of the scan output ``y``; with
        ``attn``, the attention heads' output (heads ``attn_index``) replaces their gated
        output in ``hook_z``."""
        cfg = self.cfg
        b, L = y.shape[:2]
        E, H, P = cfg.d_inner, cfg.n_heads, cfg.d_head
        y = self.hook_ssm_out(y + x * self.skip()[:, None])
        normed = self.gate_norm(y.reshape(b, L, E), self.hook_gate(self.gate_input(z)))
        per_head = normed.view(b, L, H, P)
        if attn is not None:
            index: Tensor = self.attn_index  # type: ignore[assignment]
            per_head = per_head.index_copy(2, index, attn.to(normed.dtype))
        head_in = self.hook_z(per_head)
        return cast("Tensor", self.out_proj(head_in.reshape(b, L, E).to(dtype)))

    # ------------------------------------------------------------------ forward
    def forward(
        self, h: Float[Tensor, "batch pos d_model"], mask: Tensor | None
    ) -> Float[Tensor, "batch pos d_model"]:
        z, x, B, C, dt, A = self._sequence_inputs(h, mask)
        y = self._scan(x, dt, A, B, C)
        return self._output(y, x, z, h.dtype)

    def _sequence_inputs(
        self, h: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``z, x, B, C, dt, A`` of a whole sequence (in_proj, causal convolution, SiLU; padded
        positions zeroed before and after the convolution)."""
        h = masked(h, mask)
        z, xBC, dt_raw = self.split_projection(self.project(h))
        xBC = self._conv_silu(xBC)
        xBC = masked(xBC, mask)
        x, B, C, dt = self._ssm_inputs(xBC, dt_raw)
        return z, x, B, C, dt, -torch.exp(self.A_log.float())

    def _scan(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        materialize = has_hooks(self.hook_pattern)
        heads, rows = self._selection(x.shape[1], x.device) if materialize else (None, None)
        y = self._scanned(x, dt, A, B, C, materialize, heads, rows)
        if not materialize:
            assert y is not None
            return y
        out = self._pattern_output(x, dt, A, B, C, y, heads, rows, head_dim=2)
        self._record_scan("materialized" if y is None else f"materialized+{self._scan_path}")
        return out

    def _record_scan(self, path: str) -> None:
        self._scan_path = path
        self.last_path = {**getattr(self, "last_path", {}), "scan": path}

    def _scanned(
        self,
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        materialize: bool,
        heads: Tensor | None,
        rows: Tensor | None,
    ) -> Tensor | None:
        """Every head's ``y`` without the pattern: through ``hook_ssm_state`` when it is hooked,
        else the chunked scan; ``None`` when the materialized pattern will give every head and
        row."""
        if has_hooks(self.hook_ssm_state):
            states = ops.mamba2_recurrent(self.scan_values(x, dt), dt, A, B, C)
            states, edited = state_through_hook(self.hook_ssm_state, states)
            if edited and materialize:
                self._refuse_state_edit()
            Ch = C.repeat_interleave(self.cfg.n_heads // self.cfg.n_groups, dim=2)
            self._record_scan("torch.recurrent")
            return torch.einsum("blhpn,blhn->blhp", states, Ch)
        if not materialize or heads is not None or rows is not None:
            y, path = kernels.mamba2_scan(self.scan_values(x, dt), dt, A, B, C, self.cfg.chunk_size)
            self._record_scan(path)
            return y
        return None

    pattern_equation: ClassVar[str] = "bhrj,bjhp->brhp"

    def _pattern_builder(
        self, heads: Tensor | None, A: Tensor, B: Tensor, unit: int, length: int
    ) -> tuple[kernels.PatternBuilder, Callable[[int, int], int]]:
        hg: Tensor = self.head_group  # type: ignore[assignment]
        hg = hg if heads is None else hg.index_select(0, heads)
        n_groups = B.shape[2]

        def cost(h: int, r: int) -> int:
            # C·B of the chunk's groups, one key block's decays (ops.decay_matrix)
            return unit * r * (min(h, n_groups) * length + h * min(length, 64))

        def build(
            dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h: Tensor | None, r: Tensor | None
        ) -> Tensor:
            return _mamba2_pattern_part(hg, dt, A, B, C, h, r, self.pattern_scales_keys)

        return build, cost

    # ------------------------------------------------------------------ incremental
    def prefix_state(self, acts: Mapping[str, Tensor], length: int) -> StepState:
        """The recurrent state after position ``length - 1`` (rebuilt exactly from the cached
        ``hook_ssm_input``, ``hook_ssm_dt`` and ``hook_ssm_B``) and the last ``d_conv - 1``
        convolution inputs (see :meth:`SSMMixer.prefix_state`).

        Returns:
            ``{"conv": [G, d_conv - 1, conv_dim], "state": [G, n_heads, d_head, d_state]}``.
        """
        cfg = self.cfg
        x, dt, B = prefix_inputs(acts, length)
        state = ssd_state(self.scan_values(x, dt), dt, -torch.exp(self.A_log.float()), B)
        conv_in = acts["hook_in_proj"][..., self.conv_offset : self.conv_offset + self.conv_dim]
        return {"conv": conv_tail(conv_in, length, cfg.d_conv - 1), "state": state}

    def step(self, state: StepState, h: Float[Tensor, "batch 1 d_model"]) -> Tensor:
        """One token after the prefix (see :meth:`SSMMixer.step`).

        Examples:
            The step from the state of the first 5 positions gives the forward's 6th output:

            >>> import torch
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba2")
            >>> mixer = model.blocks[0].mixer
            >>> h = torch.randn(2, 6, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
            >>> acts = {}
            >>> keep = lambda x, hook: acts.setdefault(hook.name.split(".")[-1], x)
            >>> names = [f"blocks.0.mixer.{n}" for n in mixer.prefix_hooks]
            >>> with torch.no_grad(), model.hooks(fwd_hooks=[(n, keep) for n in names]):
            ...     full = mixer(h, None)
            >>> with torch.no_grad():
            ...     last = mixer.step(mixer.prefix_state(acts, 5), h[:, 5:])
            >>> torch.allclose(last, full[:, 5:], atol=1e-5)
            True
        """
        self._refuse_step_patterns()
        z, x, y = self._step_scan(state, h)
        return self._output(y, x, z, h.dtype)

    def _step_scan(self, state: StepState, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``z``, ``x`` and the SSM heads' output ``y`` ``[R, 1, H, P]`` of one token after the
        prefix whose convolution window and SSM state are in ``state``."""
        cfg = self.cfg
        H, G = cfg.n_heads, cfg.n_groups
        z, xBC, dt_raw = self.split_projection(self.project(h))
        conv = conv_last(torch.cat([state["conv"].to(xBC.dtype), xBC], dim=1), self.conv1d)
        xBC = self.activate(conv)
        x, B, C, dt = self._ssm_inputs(xBC, dt_raw)
        A = -torch.exp(self.A_log.float())
        hpg = H // G
        Bh = B[:, 0].float().repeat_interleave(hpg, dim=1)  # [R, H, N]
        Ch = C[:, 0].float().repeat_interleave(hpg, dim=1)
        d = dt[:, 0].float()  # [R, H]
        v = self.scan_values(x, dt)[:, 0].float()
        s = torch.exp(d * A)[..., None, None] * state["state"] + (
            d[..., None, None] * v[..., None] * Bh[:, :, None, :]
        )
        y = torch.einsum("rhpn,rhn->rhp", s, Ch)[:, None].to(x.dtype)
        return z, x, y
