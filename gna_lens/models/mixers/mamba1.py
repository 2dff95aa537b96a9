"""The Mamba-1 (S6) mixer: fast forward, materialized implicit attention, single-token step.

Mamba-1 has no heads: each of its ``d_inner`` channels has its own scalar recurrence, so each
channel is a "head" (``hook_pattern`` is ``[batch, d_inner, query_pos, key_pos]``, ``hook_z``
``[batch, pos, d_inner, 1]``). ``HookedSSM.set_head_groups`` can make groups of channels the heads.
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
    SSMMixer,
    StepState,
    conv_last,
    conv_tail,
    has_hooks,
    masked,
    prefix_inputs,
    state_through_hook,
)

__all__ = ["Mamba1Mixer"]


def _mamba1_pattern_part(
    dt: Tensor, A: Tensor, B: Tensor, C: Tensor, channels: Tensor | None, rows: Tensor | None
) -> Tensor:
    """:func:`gna_lens.models.ops.mamba1_pattern` of ``channels`` (``None``: all)."""
    if channels is not None:
        dt, A = dt.index_select(-1, channels), A.index_select(0, channels)
    return ops.mamba1_pattern(dt, A, B, C, rows)


class Mamba1Mixer(SSMMixer):
    """Mamba-1 (S6) mixer (FalconMamba's and Jamba's variants add norms on ``dt``, ``B``, ``C``).

    "Heads" are channels: ``hook_pattern`` is ``[batch, d_inner, query_pos, key_pos]`` and
    ``hook_z`` is ``[batch, pos, d_inner, 1]``.
    """

    channel_heads: ClassVar[bool] = True
    backward_note: ClassVar[str | None] = (
        "Mamba-1 scans through their chunked autograd function "
        "(recomputing backward, no materialized pattern)"
    )

    def __init__(self, cfg: SSMConfig):
        super().__init__(cfg)
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

    # ------------------------------------------------------------------ shared by both paths
    def norm_dt_B_C(self, dt_low: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A variant's transform of ``x_proj``'s outputs (identity here; FalconMamba's and
        Jamba's norms)."""
        return dt_low, B, C

    def _dt_B_C(self, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``hook_ssm_dt``, ``hook_ssm_B``, ``hook_ssm_C`` of the SSM input ``u``."""
        cfg = self.cfg
        dt_low, B, C = torch.split(self.x_proj(u), [cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        dt_low, B, C = self.norm_dt_B_C(dt_low, B, C)
        delta = self.hook_ssm_dt(F.softplus(self.dt_proj(dt_low)))
        return delta, self.hook_ssm_B(B), self.hook_ssm_C(C)

    def _output(self, y: Tensor, u: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
        """``D`` skip, gate, ``hook_z`` and ``out_proj`` of the scan output ``y``."""
        b, L = y.shape[:2]
        y = self.hook_ssm_out(y + u * self.D)
        z = self.hook_gate(z)
        head_in = self.hook_z((y * F.silu(z)).view(b, L, -1, 1))
        return cast("Tensor", self.out_proj(head_in.view(b, L, -1).to(dtype)))

    # ------------------------------------------------------------------ forward
    def forward(
        self, h: Float[Tensor, "batch pos d_model"], mask: Tensor | None
    ) -> Float[Tensor, "batch pos d_model"]:
        h = masked(h, mask)
        xs, z = self.hook_in_proj(self.in_proj(h)).chunk(2, dim=-1)
        u = self.hook_ssm_input(masked(self._conv_silu(xs), mask))
        delta, B, C = self._dt_B_C(u)
        A = -torch.exp(self.A_log.float())
        y = self._scan(u, delta, A, B, C)
        return self._output(y, u, z, h.dtype)

    def _scan(self, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        materialize = has_hooks(self.hook_pattern)
        heads, rows = self._selection(u.shape[1], u.device) if materialize else (None, None)
        y: Tensor | None = None
        path = "materialized"
        if has_hooks(self.hook_ssm_state):
            _, states = ops.mamba1_scan(u, delta, A, B, C, self.cfg.chunk_size, return_states=True)
            assert states is not None
            states, edited = state_through_hook(self.hook_ssm_state, states)
            if edited and materialize:
                self._refuse_state_edit()
            y, path = torch.einsum("blen,bln->ble", states, C), "torch.recurrent"
        elif not materialize or heads is not None or rows is not None:
            y, path = kernels.mamba1_scan(u, delta, A, B, C, self.cfg.chunk_size)
        if not materialize:
            assert y is not None
            self.last_path["scan"] = path
            return y
        self.last_path["scan"] = "materialized" if y is None else f"materialized+{path}"
        return self._pattern_output(u, delta, A, B, C, y, heads, rows, head_dim=-1)

    pattern_equation: ClassVar[str] = "berj,bje->bre"

    def _pattern_builder(
        self, heads: Tensor | None, A: Tensor, B: Tensor, unit: int, length: int
    ) -> tuple[kernels.PatternBuilder, Callable[[int, int], int]]:
        n_state = A.shape[-1]

        def cost(e: int, r: int) -> int:
            # per key block (ops.mamba1_pattern): the rows' C·exp terms and the block's
            # products; the block's keys' states and rows inside it (ops._rows_inside)
            return unit * e * (r * (n_state + 16) + 16 * (2 * n_state + 2 * 16))

        return _mamba1_pattern_part, cost

    # ------------------------------------------------------------------ incremental
    def prefix_state(self, acts: Mapping[str, Tensor], length: int) -> StepState:
        """The recurrent state after position ``length - 1`` (rebuilt exactly from the cached
        ``hook_ssm_input``, ``hook_ssm_dt`` and ``hook_ssm_B``, with reverse cumulative sums as the
        scan's own kernel) and the last ``d_conv - 1`` convolution inputs (see
        :meth:`SSMMixer.prefix_state`).

        Returns:
            ``{"conv": [G, d_conv - 1, d_inner], "state": [G, d_inner, d_state]}``.
        """
        cfg = self.cfg
        P = length
        x, dt, B = prefix_inputs(acts, P)
        A = -torch.exp(self.A_log.float())
        E = cfg.d_inner
        conv_in = acts["hook_in_proj"][..., :E]
        seg = ops.reverse_segsum(dt, dim=1)  # [G, P, E]
        state = x.new_zeros(x.shape[0], E, cfg.d_state)
        for j0 in range(0, P, 128):
            j1 = min(j0 + 128, P)
            decay = torch.exp(seg[:, j0:j1, :, None] * A)  # [G, t, E, N]
            write = (dt[:, j0:j1] * x[:, j0:j1])[..., None] * B[:, j0:j1, None, :]
            state = state + (decay * write).sum(1)
        return {"conv": conv_tail(conv_in, P, cfg.d_conv - 1), "state": state}

    def step(self, state: StepState, h: Float[Tensor, "batch 1 d_model"]) -> Tensor:
        """One token after the prefix (see :meth:`SSMMixer.step`)."""
        self._refuse_step_patterns()
        xs, z = self.hook_in_proj(self.in_proj(h)).chunk(2, dim=-1)
        conv = conv_last(torch.cat([state["conv"].to(xs.dtype), xs], dim=1), self.conv1d)
        u = self.hook_ssm_input(self.activate(conv))
        delta, B, C = self._dt_B_C(u)
        A = -torch.exp(self.A_log.float())
        d = delta[:, 0]
        write = (d * u[:, 0])[..., None] * B[:, 0, None, :]  # [R, E, N]
        s = torch.addcmul(write, torch.exp(d[..., None] * A), state["state"].to(write.dtype))
        y = torch.einsum("ren,rn->re", s, C[:, 0])[:, None]
        return self._output(y, u, z, h.dtype)
