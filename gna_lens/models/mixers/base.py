"""What every mixer shares: the SSM mixer interface (:class:`SSMMixer`), pattern selection, and
small helpers."""

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from gna_lens.errors import InterventionError, PatternEditError
from gna_lens.models import kernels, ops
from gna_lens.models.config import SSMConfig

__all__ = ["PatternSelection", "RMSNorm", "SSMMixer"]

_EXACT_DTYPES = (torch.float32, torch.float64)

#: Which heads / query positions of a pattern to materialize: ``None`` means all.
PatternSelection = tuple[Tensor | None, Tensor | None]

#: A layer's incremental state: tensors whose first axis is the prompt (``[G, ...]``).
StepState = dict[str, Tensor]


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (fp32 statistics, as the reference implementations)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def has_hooks(hook: HookPoint) -> bool:
    """Whether anything hooks ``hook`` (forward or backward)."""
    return bool(hook.fwd_hooks or hook.bwd_hooks)


def reads(hook: HookPoint) -> bool:
    """Whether anything (TransformerLens or a plain torch forward hook) hooks ``hook``."""
    return has_hooks(hook) or bool(hook._forward_hooks) or bool(hook._forward_pre_hooks)


def masked(x: Tensor, mask: Tensor | None) -> Tensor:
    """``x`` ``[batch, pos, ...]`` with the padded positions (``mask == 0``) zeroed."""
    return x if mask is None else x * mask[..., None].to(x.dtype)


def checked_pattern(edited: Any, original: Tensor, name: str | None) -> Tensor:
    """Refuse a pattern edit that cannot take effect exactly."""
    if not isinstance(edited, Tensor) or edited.shape != original.shape:
        got = tuple(edited.shape) if isinstance(edited, Tensor) else type(edited).__name__
        raise PatternEditError(
            f"A hook on {name} returned a pattern of shape {got}; expected "
            f"{tuple(original.shape)} [batch, head_index, query_pos, key_pos] (the shape it was "
            "given). Edit the tensor in place or return a tensor of the same shape."
        )
    return edited.to(original.dtype)


def pattern_through_hook(hook: HookPoint, pattern: Tensor) -> tuple[Tensor, bool]:
    """Pass ``pattern`` through ``hook`` (checked); also say whether the hook may have edited it.

    Edited: the hook returned another tensor (also the case when a backward hook wraps the
    output) or changed this one in place. A caching hook edits nothing.
    """
    version = pattern._version  # type: ignore[attr-defined]
    out = hook(pattern)
    edited = out is not pattern or pattern._version != version  # type: ignore[attr-defined]
    return checked_pattern(out, pattern, hook.name), edited


def state_through_hook(hook: HookPoint, states: Tensor) -> tuple[Tensor, bool]:
    """Pass ``states`` through ``hook``; also say whether the hook edited them.

    Edited: the hook returned another tensor, or changed this one in place (torch's version
    counter moved). A caching hook (``run_with_cache``) returns ``None`` and edits nothing.
    """
    version = states._version  # type: ignore[attr-defined]
    out = hook(states)
    return out, out is not states or states._version != version  # type: ignore[attr-defined]


def scatter_rows_heads(
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


def conv_tail(x: Tensor, length: int, width: int) -> Tensor:
    """Positions ``[length - width, length)`` of ``x`` ``[G, L, C]``, zero-padded on the left
    (the convolution window the token after position ``length - 1`` reads)."""
    lo = length - width
    out = x[:, max(lo, 0) : length]
    if lo < 0:
        out = F.pad(out, (0, 0, -lo, 0))
    return out


def conv_last(window: Tensor, conv1d: nn.Conv1d) -> Tensor:
    """The causal convolution's output at the last position of ``window`` ``[R, d_conv, C]``."""
    out = ops.causal_conv1d(window.transpose(1, 2), conv1d.weight, conv1d.bias)
    return out[..., -1:].transpose(1, 2)  # [R, 1, C]


def prefix_inputs(acts: Mapping[str, Tensor], length: int) -> tuple[Tensor, Tensor, Tensor]:
    """The first ``length`` positions of the cached ``hook_ssm_input``, ``hook_ssm_dt`` and
    ``hook_ssm_B``, in float32 (what an SSM's recurrent state is rebuilt from)."""
    return tuple(  # type: ignore[return-value]
        acts[f"hook_ssm_{n}"][:, :length].float() for n in ("input", "dt", "B")
    )


def ssd_state(x: Tensor, dt: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """The Mamba-2 recurrent state ``[G, head, d_head, d_state]`` after the positions of ``x``
    ``[G, P, head, d_head]`` (``B`` ``[G, P, group, d_state]``, the heads of a group adjacent):
    ``Σ_j exp(A Σ_{k>j} dt_k) dt_j x_j B_jᵀ``, exactly, without a scan."""
    G, P, H, d = x.shape
    groups = B.shape[2]
    w = torch.exp(ops.reverse_segsum(dt * A, dim=1)) * dt  # [G, P, H]
    return torch.einsum(
        "bjgm,bjgmp,bjgn->bgmpn",
        w.view(G, P, groups, H // groups),
        x.view(G, P, groups, H // groups, d),
        B,
    ).reshape(G, H, d, B.shape[3])


class SSMMixer(nn.Module):
    """The interface of an SSM mixer, and its pattern selection.

    ``forward(h, mask)`` runs a fast scan unless ``hook_pattern`` (or ``hook_ssm_state``) is
    hooked; then the layer builds its implicit attention (:meth:`materialize`), passes it through
    ``hook_pattern`` and computes ``y = pattern @ x + D x`` from the returned matrix, so an edit
    changes the output. :meth:`prefix_state` and :meth:`step` are the incremental path of the
    sweeps that edit only the last position.

    Subclasses define the weights, the hook points ``hook_in_proj``, ``hook_conv``,
    ``hook_ssm_input``, ``hook_ssm_dt``, ``hook_ssm_B``, ``hook_ssm_C``, ``hook_ssm_state``,
    ``hook_pattern``, ``hook_ssm_out``, ``hook_gate`` and ``hook_z``, and the methods
    ``forward``, ``materialize``, ``prefix_state`` and ``step``.

    Attributes:
        channel_heads: Each head is one channel (Mamba-1): ``HookedSSM.set_head_groups`` may group
            them, and ``head_groups="auto"`` does above a size.
        backward_note: How gradients run through the fast path, for ``info["paths"]`` of
            attribution (``None``: the plain autograd of the forward).
        prefix_hooks: The mixer's hook points whose full-prompt activations ``prefix_state``
            reads (a hook that does not fire in a forward pass is left out of ``acts``).
        uses_rope: The block passes RoPE's ``(cos, sin)`` to ``forward`` and ``step`` as a
            third argument (a mixer with attention heads: the hybrid students).
        pattern_heads: Heads ``hook_pattern`` holds (``None``: all), set by
            ``HookedSSM.pattern_selection``.
        pattern_rows: Query positions ``hook_pattern`` holds (``None``: all).
        last_pattern_index: Head and query-position indices of the last materialized pattern.
        last_path: The path of the last forward pass, ``{"conv": ..., "scan": ...}`` (see
            :func:`gna_lens.models.kernels.kernel_paths`).
        pattern_budget_bytes: Working memory of the pattern's construction beside the pattern
            (``None``: :func:`gna_lens.models.kernels.pattern_budget`).
    """

    channel_heads: ClassVar[bool] = False
    uses_rope: ClassVar[bool] = False
    #: Why no checkpoint format holds this mixer (``HookedSSM.save_pretrained`` raises it);
    #: ``None``: the family's format does.
    unsaved_reason: ClassVar[str | None] = None
    backward_note: ClassVar[str | None] = None
    prefix_hooks: ClassVar[tuple[str, ...]] = (
        "hook_in_proj",
        "hook_ssm_input",
        "hook_ssm_dt",
        "hook_ssm_B",
    )

    cfg: SSMConfig
    A_log: nn.Parameter
    D: nn.Parameter
    out_proj: nn.Linear
    conv1d: nn.Conv1d
    hook_conv: HookPoint
    hook_pattern: HookPoint
    hook_ssm_state: HookPoint

    def __init__(self, cfg: SSMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pattern_heads: Tensor | None = None
        self.pattern_rows: list[int] | None = None
        #: Head and query-position indices of the last materialized pattern (``None`` = all).
        self.last_pattern_index: PatternSelection = (None, None)
        self.last_path: dict[str, str] = {}
        self.pattern_budget_bytes: int | None = None

    @classmethod
    def for_layer(cls, cfg: SSMConfig, layer: int) -> "SSMMixer":
        """The mixer of layer ``layer`` (a mixer whose weights differ per layer overrides it)."""
        del layer
        return cls(cfg)

    @property
    def head_kinds(self) -> tuple[str, ...] | None:
        """Per head, ``"attention"`` or ``"ssm"`` for a mixer with attention heads
        (``attn_heads``); ``None`` when every head is an SSM head."""
        attn = getattr(self, "attn_heads", None)
        if attn is None:
            return None
        return tuple("attention" if h in attn else "ssm" for h in range(self.cfg.n_heads))

    def materialize(
        self,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        heads: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> Float[Tensor, "batch selected_head query_row pos"]:
        """The implicit attention of ``heads`` at query positions ``rows`` (``None``: all), in
        fp32 or wider: Mamba-2's ``M_h[i, j] = (C_i · B_j) exp(A_h Σ_{k=j+1..i} dt_k) dt_j``,
        Mamba-1's ``α_e[i, j] = C_i · (exp(A_e Σ_{k=j+1..i} Δ_k) Δ_j B_j)`` (channels ``e``).

        Args:
            dt: ``dt`` after softplus and clamping (``hook_ssm_dt``).
            A: ``-exp(A_log)``.
            B: ``hook_ssm_B``.
            C: ``hook_ssm_C``.
            heads: Head (Mamba-1: channel) indices, sorted, or ``None``.
            rows: Query positions (sorted, non-negative), or ``None``.

        Returns:
            ``[batch, len(heads), len(rows), key_pos]``.

        Examples:
            >>> import torch
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> names = [f"blocks.0.mixer.hook_{n}" for n in ("ssm_dt", "ssm_B", "ssm_C", "pattern")]
            >>> model = tiny_hooked_ssm("mamba2")
            >>> mixer = model.blocks[0].mixer
            >>> _, cache = model.run_with_cache("a b c", names_filter=names)
            >>> dt, B, C, pattern = (cache[n] for n in names)
            >>> mine = mixer.materialize(dt, -torch.exp(mixer.A_log.float()), B, C)
            >>> torch.allclose(mine, pattern, atol=1e-6)
            True
            >>> model = tiny_hooked_ssm("mamba1")
            >>> mixer = model.blocks[0].mixer
            >>> _, cache = model.run_with_cache("a b c", names_filter=names)
            >>> dt, B, C, pattern = (cache[n] for n in names)
            >>> A = -torch.exp(mixer.A_log.float())
            >>> rows = torch.tensor([2])
            >>> mine = mixer.materialize(dt, A, B, C, heads=torch.tensor([5]), rows=rows)
            >>> tuple(mine.shape), torch.allclose(mine, pattern[:, 5:6, 2:3], atol=1e-6)
            ((1, 1, 1, 4), True)
        """
        job, dt_sel, A_sel = self._pattern_job(dt, A, B, C, heads, rows)
        return kernels.build_pattern(job, dt_sel, A_sel, B, C)

    def prefix_state(self, acts: Mapping[str, Tensor], length: int) -> StepState:
        """What the token after the first ``length`` positions needs from them.

        Args:
            acts: The full prompt's activations of :attr:`prefix_hooks` (``[G, L, ...]``,
                keyed by the hook's name in the mixer, e.g. ``"hook_ssm_dt"``).
            length: The prefix length ``P`` (usually ``L - 1``).
        """
        raise NotImplementedError

    def step(self, state: StepState, h: Float[Tensor, "batch 1 d_model"]) -> Tensor:
        """The mixer's output ``[batch, 1, d_model]`` for one token after the prefix.

        Fires the same hook points as ``forward`` with ``pos = 1`` (not ``hook_pattern`` or
        ``hook_ssm_state``: a hook on those raises).
        """
        raise NotImplementedError

    def activate(self, conv: Tensor) -> Tensor:
        """The convolution output through ``hook_conv`` and the activation (SiLU)."""
        return F.silu(self.hook_conv(conv))

    def _conv_silu(self, xs: Tensor) -> Tensor:
        """:meth:`activate` of the causal convolution of ``xs`` ``[batch, pos, channel]``; a SiLU
        is fused into the convolution (kernel or not) while nothing hooks ``hook_conv``."""
        fused = self.cfg.conv_activation == "silu" and not reads(self.hook_conv)
        conv, path = kernels.causal_conv1d(
            xs.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, silu=fused
        )
        self.last_path = {"conv": path}
        conv = conv.transpose(1, 2)
        return conv if fused else self.activate(conv)

    def _pattern_job(
        self, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, heads: Tensor | None, rows: Tensor | None
    ) -> tuple[kernels.PatternJob, Tensor, Tensor]:
        """The budgeted construction of the pattern of ``heads`` at ``rows``, and the selected
        ``dt`` and ``A`` it reads."""
        dt_sel = dt if heads is None else dt.index_select(2, heads)
        A_sel = A if heads is None else A.index_select(0, heads)
        batch, length, n_heads = dt_sel.shape
        size = max(torch.promote_types(dt.dtype, A.dtype).itemsize, 4)
        build, cost = self._pattern_builder(heads, A, B, batch * size, length)
        job = kernels.PatternJob(
            build=build,
            shape=(batch, n_heads, length if rows is None else rows.shape[0], length),
            rows=rows,
            cost=cost,
            budget=self.pattern_budget_bytes or kernels.current_pattern_budget(),
            equation=self.pattern_equation,
            itemsize=size,
        )
        return job, dt_sel, A_sel

    #: ``y = einsum(pattern_equation, pattern, x)`` on the materialized path.
    pattern_equation: ClassVar[str]

    def _pattern_builder(
        self, heads: Tensor | None, A: Tensor, B: Tensor, unit: int, length: int
    ) -> tuple[kernels.PatternBuilder, Callable[[int, int], int]]:
        """The :class:`~gna_lens.models.kernels.PatternJob`'s ``build`` and ``cost`` for the
        selected ``heads`` (``unit``: bytes of one number times the batch)."""
        raise NotImplementedError

    def _pattern_output(
        self,
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        y: Tensor | None,
        heads: Tensor | None,
        rows: Tensor | None,
        head_dim: int,
    ) -> Tensor:
        """``y`` with the heads and rows of ``hook_pattern`` read off the (possibly edited)
        pattern: ``pattern @ x`` (``head_dim``: ``x``'s head axis)."""
        self._check_dtype(x.dtype)
        job, dt_sel, A_sel = self._pattern_job(dt, A, B, C, heads, rows)
        pattern = kernels.build_pattern(job, dt_sel, A_sel, B, C).to(x.dtype)
        pattern, edited = pattern_through_hook(self.hook_pattern, pattern)
        x_sel = x if heads is None else x.index_select(head_dim, heads)
        y_sel = kernels.apply_pattern(job, pattern, x_sel, dt_sel, A_sel, B, C, edited)
        return scatter_rows_heads(y, y_sel, heads, rows, head_dim=head_dim)

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

    def _refuse_step_patterns(self) -> None:
        """The last-token step runs no materialized pattern: refuse hooks that need one."""
        if self.hook_pattern.fwd_hooks or self.hook_ssm_state.fwd_hooks:
            raise InterventionError(
                f"{self.hook_pattern.name} / hook_ssm_state is hooked during a "
                "last-token step, which does not materialize SSM patterns; edit patterns "
                "with a full forward (positions=None)."
            )
