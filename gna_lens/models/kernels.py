"""The field's kernels on the unhooked fast path, and budgeted pattern materialization.

**Kernels** (user guide: docs/gpu.md, "Kernels on the fast path"). With ``mamba_ssm`` and
``causal_conv1d`` installed (``pip install gna-lens[kernels]``, CUDA only) the SSM mixers run their
scans and convolutions through :data:`KERNELS`. A kernel runs only when kernels are enabled
(default; :func:`use_kernels` ``(False)`` or ``GNA_LENS_KERNELS=0`` turn them off), every tensor
of the call is on CUDA, the package imports (checked once, on the first CUDA call;
:func:`kernel_status` says why one did not), the call's arguments are ones the kernel supports
(float32 / float16 / bfloat16, a convolution width of 2 to 4, ``d_state <= 256`` for the
selective scan), and the mixer is on its fast path (a hook on ``hook_pattern`` or
``hook_ssm_state`` runs PyTorch). Hooks around the scan and the convolution fire as on the
reference path (the convolution's SiLU is fused into the kernel only while ``hook_conv`` is not
hooked). Otherwise the pure-PyTorch reference of :mod:`gna_lens.models.ops` runs; every mixer
records its path in ``mixer.last_path`` (:func:`kernel_paths`). The kernels are not bit-identical
to the reference (the Triton SSD kernel multiplies in TF32 on Ampere and newer, about 1e-3
relative): run parity checks with ``use_kernels(False)`` on one side.

**Budgeted materialization.** :func:`build_pattern` and :func:`apply_pattern` build a pattern in
chunks whose working memory stays under :func:`pattern_budget`, and rebuild it in the backward
pass instead of keeping it.

Examples:
    >>> from gna_lens.models import kernels
    >>> from gna_lens.testing import tiny_hooked_ssm
    >>> model = tiny_hooked_ssm("mamba2")
    >>> _ = model("a b c")
    >>> kernel_paths(model)["blocks.0.mixer"]  # on the CPU: the PyTorch reference
    {'conv': 'torch.conv1d', 'scan': 'torch.ssd'}
    >>> with kernels.use_kernels(False):
    ...     kernels.kernels_enabled()
    False
"""

import functools
import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gna_lens.errors import ConfigError
from gna_lens.models import ops

__all__ = [
    "DEFAULT_PATTERN_BUDGET",
    "KERNELS",
    "PatternJob",
    "apply_pattern",
    "build_pattern",
    "causal_conv1d",
    "current_pattern_budget",
    "kernel_paths",
    "kernel_status",
    "kernels_enabled",
    "mamba1_scan",
    "mamba2_scan",
    "path_summary",
    "pattern_budget",
    "refresh",
    "use_kernels",
]

#: The kernels used when installed: name -> (module, attribute).
KERNELS: dict[str, tuple[str, str]] = {
    "mamba_chunk_scan_combined": (
        "mamba_ssm.ops.triton.ssd_combined",
        "mamba_chunk_scan_combined",
    ),
    "selective_scan_fn": ("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d_fn"),
}

#: Paths recorded in ``mixer.last_path``.
PATH_SSD_KERNEL = "mamba_ssm.mamba_chunk_scan_combined"
PATH_SCAN_KERNEL = "mamba_ssm.selective_scan_fn"
PATH_CONV_KERNEL = "causal_conv1d.causal_conv1d_fn"
PATH_SSD = "torch.ssd"
PATH_SCAN = "torch.scan"
PATH_CONV = "torch.conv1d"

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_env = os.environ.get("GNA_LENS_KERNELS", "1")
_enabled = _env.strip().lower() not in ("0", "false", "off", "no")
_loaded: dict[str, Callable[..., Any] | None] = {}
_errors: dict[str, str] = {}


# ----------------------------------------------------------------------------- switches
@contextmanager
def use_kernels(enabled: bool = True) -> Iterator[None]:
    """Turn the installed kernels on or off inside the block (``False``: the PyTorch reference).

    Args:
        enabled: Whether the fast path may use installed kernels.

    Yields:
        Nothing; the previous setting is restored on exit.

    Examples:
        >>> from gna_lens.models.kernels import kernels_enabled, use_kernels
        >>> with use_kernels(False):
        ...     kernels_enabled()
        False
    """
    global _enabled
    saved = _enabled
    _enabled = bool(enabled)
    try:
        yield
    finally:
        _enabled = saved


def kernels_enabled() -> bool:
    """Whether the fast path may use installed kernels (:func:`use_kernels`,
    ``GNA_LENS_KERNELS``)."""
    return _enabled


def refresh() -> None:
    """Forget which kernels imported (they are looked up again on the next CUDA call)."""
    _loaded.clear()
    _errors.clear()


def _kernel(name: str) -> Callable[..., Any] | None:
    """The kernel ``name`` of :data:`KERNELS`, imported once; ``None`` if it does not import."""
    if name not in _loaded:
        module, attr = KERNELS[name]
        try:
            fn = getattr(importlib.import_module(module), attr)
        except Exception as err:  # ImportError, or a build against another torch / CUDA
            fn = None
            _errors[name] = f"{type(err).__name__}: {err}"
        _loaded[name] = fn
    return _loaded[name]


def _kernel_device_ok(*tensors: Tensor) -> bool:
    """Whether every tensor is on a CUDA device (the kernels' only device)."""
    return all(t.is_cuda for t in tensors)


def _usable(name: str, *tensors: Tensor) -> Callable[..., Any] | None:
    """The kernel ``name`` if enabled, on CUDA tensors, and installed; else ``None``."""
    if not _enabled or not _kernel_device_ok(*tensors):
        return None
    return _kernel(name)


def kernel_status() -> dict[str, str]:
    """Each kernel's state, in words: ``"loaded"``, ``"not checked"`` (no CUDA call yet), or why
    it did not import; and ``"enabled"``.

    Examples:
        >>> from gna_lens.models.kernels import kernel_status
        >>> sorted(kernel_status())
        ['causal_conv1d_fn', 'enabled', 'mamba_chunk_scan_combined', 'selective_scan_fn']
    """
    out = {"enabled": str(_enabled)}
    for name in KERNELS:
        if name not in _loaded:
            out[name] = "not checked"
        else:
            out[name] = "loaded" if _loaded[name] is not None else _errors.get(name, "missing")
    return out


def kernel_paths(model: nn.Module) -> dict[str, dict[str, str]]:
    """The path each mixer took in its last forward pass, keyed by module name.

    Args:
        model: A :class:`~gna_lens.models.HookedSSM` (any module whose submodules record
            ``last_path``).

    Returns:
        ``{"blocks.0.mixer": {"conv": "torch.conv1d", "scan": "torch.ssd"}, ...}``. Scan paths:
        ``"mamba_ssm.mamba_chunk_scan_combined"`` / ``"mamba_ssm.selective_scan_fn"`` (kernels),
        ``"torch.ssd"`` / ``"torch.scan"`` (the reference), ``"torch.recurrent"``
        (``hook_ssm_state`` hooked), ``"materialized"`` (``hook_pattern`` hooked; with a
        selection of heads or rows, ``"materialized+"`` and the path of the rest).

    Examples:
        >>> from gna_lens.models.kernels import kernel_paths
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba1")
        >>> _ = model.run_with_cache("a b", names_filter="blocks.0.mixer.hook_pattern")
        >>> kernel_paths(model)["blocks.0.mixer"]["scan"], kernel_paths(model)["blocks.1.mixer"]
        ('materialized', {'conv': 'torch.conv1d', 'scan': 'torch.scan'})
    """
    return {
        name: dict(path)
        for name, module in model.named_modules()
        if (path := getattr(module, "last_path", None))
    }


def path_summary(model: nn.Module) -> dict[str, list[str]]:
    """The distinct paths of the last forward pass, per operation (what a result records).

    Args:
        model: Any model; one whose modules record no ``last_path`` (a TransformerLens
            ``TransformerBridge``) gives ``{}``.

    Returns:
        ``{"attention": [...], "conv": [...], "scan": [...]}``, each a sorted list of the paths
        the mixers took (:func:`kernel_paths`), only the operations the model has.

    Examples:
        >>> from gna_lens.models.kernels import path_summary
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> _ = model("a b c")
        >>> path_summary(model)
        {'conv': ['torch.conv1d'], 'scan': ['torch.ssd']}
    """
    found: dict[str, set[str]] = {}
    for path in kernel_paths(model).values():
        for op, how in path.items():
            found.setdefault(op, set()).add(how)
    return {op: sorted(hows) for op, hows in sorted(found.items())}


# ----------------------------------------------------------------------------- fast-path ops
def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool) -> tuple[Tensor, str]:
    """Causal depthwise convolution ``[batch, channel, pos]``, with the SiLU when ``silu``.

    ``causal_conv1d_fn`` when usable (widths 2 to 4), else :func:`gna_lens.models.ops.causal_conv1d`
    (then ``F.silu``).

    Args:
        x: ``[batch, channel, pos]`` (channel-first or channel-last strides).
        weight: ``[channel, 1, width]`` (an ``nn.Conv1d`` depthwise weight).
        bias: ``[channel]`` or ``None``.
        silu: Apply SiLU to the output.

    Returns:
        ``(out, path)``: ``out`` ``[batch, channel, pos]`` and the path taken.

    Examples:
        >>> import torch
        >>> from gna_lens.models.kernels import causal_conv1d
        >>> out, path = causal_conv1d(torch.ones(1, 2, 3), torch.ones(2, 1, 2), None, silu=False)
        >>> out[0, 0].tolist(), path
        ([1.0, 2.0, 2.0], 'torch.conv1d')
    """
    fn = _usable("causal_conv1d_fn", x, weight)
    width = weight.shape[-1]
    if (
        fn is not None
        and x.dim() == 3
        and 2 <= width <= 4
        and x.dtype in _KERNEL_DTYPES
        and weight.dtype in _KERNEL_DTYPES
        and (bias is None or bias.dtype == weight.dtype)
    ):
        channels = x.shape[1]
        channel_last_ok = (
            x.stride(1) == 1 and channels % 8 == 0 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0
        )
        if x.stride(2) != 1 and not channel_last_ok:
            x = x.contiguous()
        out = fn(x, weight.squeeze(1), bias, activation="silu" if silu else None)
        return out, PATH_CONV_KERNEL
    out = ops.causal_conv1d(x, weight, bias)
    return (F.silu(out) if silu else out), PATH_CONV


def _common_dtype(*tensors: Tensor) -> torch.dtype:
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors])


def mamba2_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int
) -> tuple[Tensor, str]:
    """Mamba-2's SSD scan without the ``D`` skip: ``mamba_chunk_scan_combined`` when usable,
    else :func:`gna_lens.models.ops.mamba2_ssd`.

    ``dt`` is already ``clamp(softplus(dt_raw + dt_bias), time_step_limit)``, so the kernel gets no
    ``dt_bias``, no softplus and no limits; no ``D``, no ``z`` (the mixer adds ``D x``, fires
    ``hook_ssm_out`` and gates), no initial state (a forward starts from zero).

    Args:
        x: ``[batch, pos, head, d_head]``.
        dt: ``[batch, pos, head]``.
        A: ``[head]``.
        B: ``[batch, pos, group, state]``.
        C: ``[batch, pos, group, state]``.
        chunk_size: The model's chunk length.

    Returns:
        ``(y, path)``, ``y`` ``[batch, pos, head, d_head]``.

    Examples:
        >>> import torch
        >>> from gna_lens.models.kernels import mamba2_scan
        >>> x, dt = torch.ones(1, 3, 2, 4), torch.full((1, 3, 2), 0.5)
        >>> B = C = torch.ones(1, 3, 1, 8)
        >>> y, path = mamba2_scan(x, dt, -torch.ones(2), B, C, chunk_size=2)
        >>> tuple(y.shape), path
        ((1, 3, 2, 4), 'torch.ssd')
    """
    fn = _usable("mamba_chunk_scan_combined", x, dt, A, B, C)
    dtype = _common_dtype(x, B, C)
    if fn is not None and dtype in _KERNEL_DTYPES and dt.dtype in _KERNEL_DTYPES:
        y = fn(x.to(dtype), dt, A.float(), B.to(dtype), C.to(dtype), chunk_size)
        return y, PATH_SSD_KERNEL
    return ops.mamba2_ssd(x, dt, A, B, C, chunk_size), PATH_SSD


def mamba1_scan(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int
) -> tuple[Tensor, str]:
    """Mamba-1's selective scan without ``D`` and the gate: ``selective_scan_fn`` when usable,
    else :func:`gna_lens.models.ops.mamba1_scan`.

    ``delta`` is already ``softplus(dt_proj(dt))`` (the kernel gets no ``delta_bias`` and no
    softplus), and the mixer adds ``D u`` and gates (the kernel gets no ``D``, no ``z``).

    Args:
        u: ``[batch, pos, channel]``.
        delta: ``[batch, pos, channel]``.
        A: ``[channel, state]``.
        B: ``[batch, pos, state]``.
        C: ``[batch, pos, state]``.
        chunk_size: Positions per chunk of the reference scan.

    Returns:
        ``(y, path)``, ``y`` ``[batch, pos, channel]``.

    Examples:
        >>> import torch
        >>> from gna_lens.models.kernels import mamba1_scan
        >>> y, path = mamba1_scan(torch.ones(1, 3, 2), torch.ones(1, 3, 2), -torch.ones(2, 4),
        ...                       torch.ones(1, 3, 4), torch.ones(1, 3, 4), chunk_size=2)
        >>> tuple(y.shape), path
        ((1, 3, 2), 'torch.scan')
    """
    fn = _usable("selective_scan_fn", u, delta, A, B, C)
    dtype = _common_dtype(u, delta, B, C)
    if fn is not None and dtype in _KERNEL_DTYPES and not A.is_complex() and A.shape[-1] <= 256:
        y = fn(
            u.transpose(1, 2).to(dtype),
            delta.transpose(1, 2).to(dtype),
            A.float(),
            B.transpose(1, 2).to(dtype),
            C.transpose(1, 2).to(dtype),
        )
        return y.transpose(1, 2), PATH_SCAN_KERNEL
    y, _ = ops.mamba1_scan(u, delta, A, B, C, chunk_size)
    return y, PATH_SCAN


# ----------------------------------------------------------------------------- pattern budget
#: Working memory (bytes) a pattern's construction may use beside the pattern itself.
DEFAULT_PATTERN_BUDGET = 512 * 2**20

_budget = DEFAULT_PATTERN_BUDGET
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _parse_bytes(value: int | str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().upper()
        number = text.rstrip("KMGIB")
        unit = text[len(number) :].strip()
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if amount > 0 and unit in _UNITS:
            return max(1, int(amount * _UNITS[unit]))
    raise ConfigError(
        f"pattern_budget({value!r}): expected a positive number of bytes or a string like "
        "'512MiB' or '2GiB'."
    )


@contextmanager
def pattern_budget(nbytes: int | str) -> Iterator[None]:
    """Bound the working memory of every pattern built inside the block.

    The pattern itself (``[batch, head, query, key]``, what ``hook_pattern`` receives) is not
    counted: the budget bounds what building it (and, with gradients, rebuilding it in the
    backward pass) needs beside it. Smaller budgets mean more, smaller chunks; the pattern does
    not change (bit-identical on the CPU). A mixer's ``pattern_budget_bytes`` attribute, when set,
    takes precedence.

    Args:
        nbytes: Bytes, or a string like ``"256MiB"``.

    Yields:
        Nothing; the previous budget is restored on exit.

    Raises:
        ConfigError: ``nbytes`` is not a positive size.

    Examples:
        >>> from gna_lens.models.kernels import current_pattern_budget, pattern_budget
        >>> with pattern_budget("64MiB"):
        ...     current_pattern_budget()
        67108864
    """
    global _budget
    saved, _budget = _budget, _parse_bytes(nbytes)
    try:
        yield
    finally:
        _budget = saved


def current_pattern_budget() -> int:
    """The budget (bytes) :func:`pattern_budget` set, or :data:`DEFAULT_PATTERN_BUDGET`."""
    return _budget


#: ``build(dt, A, B, C, heads, rows)`` -> ``[batch, len(heads), len(rows), key]``; ``heads=None``
#: and ``rows=None`` mean all of them.
PatternBuilder = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None], Tensor]


@dataclass(frozen=True)
class PatternJob:
    """How to build one layer's pattern in chunks, and how the layer applies it.

    Attributes:
        build: ``build(dt, A, B, C, heads, rows)``: the pattern of head indices ``heads`` at query
            positions ``rows`` (``None``: all); the same function whatever the chunk.
        shape: ``(batch, heads, rows, keys)`` of the whole pattern.
        rows: The query positions (``None``: all ``keys`` positions).
        cost: ``cost(heads, rows)``: estimated bytes of the intermediates of a chunk of that many
            heads and rows (its output not included).
        budget: Bytes a chunk may use.
        equation: ``y = einsum(equation, pattern, x)``; ``x``'s and ``y``'s head axis is 2.
        itemsize: Bytes per element of the pattern.
    """

    build: PatternBuilder
    shape: tuple[int, int, int, int]
    rows: Tensor | None
    cost: Callable[[int, int], int]
    budget: int
    equation: str
    itemsize: int = 4

    def chunk_bytes(self, heads: int, rows: int) -> int:
        """Intermediates and output of a chunk of ``heads`` heads and ``rows`` rows."""
        batch, _, _, keys = self.shape
        return self.cost(heads, rows) + self.itemsize * batch * heads * rows * keys

    def chunks(self, backward: bool = False) -> list[tuple[slice, slice]]:
        """``(heads, rows)`` slices that fit the budget: whole heads first, query rows only when
        one head alone does not fit (at least one head and one row).

        Forward: one chunk when its intermediates fit (it is returned as the pattern, no copy),
        else chunks whose intermediates and output fit (each is copied into the pattern).
        Backward (rebuilding with autograd, which keeps about every intermediate): chunks whose
        4 x (intermediates + output) fit.
        """
        _, n_heads, n_rows, _ = self.shape

        def fits(h: int, r: int) -> bool:
            return (4 if backward else 1) * self.chunk_bytes(h, r) <= self.budget

        heads, rows = n_heads, n_rows
        if backward or self.cost(heads, rows) > self.budget:
            heads = _largest(n_heads, lambda h: fits(h, n_rows))
            if heads == 0:
                heads, rows = 1, max(1, _largest(n_rows, lambda r: fits(1, r)))
        heads = _balanced(n_heads, heads)
        rows = _balanced(n_rows, rows)
        return [
            (slice(h, min(h + heads, n_heads)), slice(r, min(r + rows, n_rows)))
            for h in range(0, n_heads, heads)
            for r in range(0, n_rows, rows)
        ]

    def part(
        self, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, heads: slice, rows: slice
    ) -> Tensor:
        """The chunk ``[:, heads, rows]`` of the pattern."""
        _, n_heads, n_rows, n_keys = self.shape
        hidx = None
        if heads != slice(0, n_heads):
            hidx = torch.arange(heads.start, heads.stop, device=dt.device)
        q = self.rows
        if rows != slice(0, n_rows):
            q = torch.arange(n_keys, device=dt.device) if q is None else q
            q = q[rows]
        return self.build(dt, A, B, C, hidx, q)


def _largest(n: int, ok: Callable[[int], bool]) -> int:
    """The largest ``k`` in ``[0, n]`` with ``ok(k)`` (``ok`` monotone decreasing, ``ok(0)``)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _balanced(n: int, size: int) -> int:
    """Chunk length for ``n`` items in chunks of at most ``size``, as even as possible."""
    count = -(-n // max(size, 1))
    return -(-n // count)


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _assemble(job: PatternJob, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """The whole pattern, chunk by chunk into one tensor (a single chunk is returned as built)."""
    plan = job.chunks()
    if len(plan) == 1:
        return job.build(dt, A, B, C, None, job.rows)
    out: Tensor | None = None
    for heads, rows in plan:
        part = job.part(dt, A, B, C, heads, rows)
        if out is None:
            out = part.new_empty(job.shape)
        out[:, heads, rows] = part
        del part
    assert out is not None
    return out


def _recompute_grads(
    job: PatternJob,
    inputs: list[Tensor],
    wanted: list[bool],
    outputs_of: Callable[[list[Tensor], slice, slice], tuple[Tensor, Tensor]],
) -> list[Tensor | None]:
    """Gradients of ``inputs`` (where ``wanted``), chunk by chunk: ``outputs_of(leaves, heads,
    rows)`` rebuilds the chunk's output and gives its incoming gradient."""
    leaves = [t.detach().requires_grad_(w) for t, w in zip(inputs, wanted, strict=True)]
    targets = [leaf for leaf, w in zip(leaves, wanted, strict=True) if w]
    grads: list[Tensor | None] = [None] * len(inputs)
    if not targets:
        return grads
    for heads, rows in job.chunks(backward=True):
        with torch.enable_grad():
            out, grad_out = outputs_of(leaves, heads, rows)
            parts = torch.autograd.grad(out, targets, grad_out, allow_unused=True)
        it = iter(parts)
        for i, w in enumerate(wanted):
            if not w:
                continue
            g = next(it)
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g  # type: ignore[operator]
    return grads


class _BudgetedPattern(torch.autograd.Function):
    """The pattern as one autograd node: built in chunks without a graph, rebuilt chunk by chunk
    in the backward pass (only ``dt``, ``A``, ``B``, ``C`` are kept)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, job: PatternJob, dt: Tensor, A: Tensor, B: Tensor, C: Tensor
    ) -> Tensor:
        ctx.job = job
        ctx.save_for_backward(dt, A, B, C)
        return _assemble(job, dt, A, B, C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        job: PatternJob = ctx.job

        def outputs_of(leaves: list[Tensor], heads: slice, rows: slice) -> tuple[Tensor, Tensor]:
            dt, A, B, C = leaves
            return job.part(dt, A, B, C, heads, rows), grad[:, heads, rows]

        grads = _recompute_grads(
            job, list(ctx.saved_tensors), list(ctx.needs_input_grad[1:]), outputs_of
        )
        return (None, *grads)


class _RecomputedApply(torch.autograd.Function):
    """``y = einsum(equation, pattern, x)`` for a pattern the hook did not edit: the forward uses
    the pattern as given (the same operation as the plain path), the backward rebuilds it chunk
    by chunk from ``dt``, ``A``, ``B``, ``C`` instead of keeping it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        job: PatternJob,
        pattern: Tensor,
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
    ) -> Tensor:
        ctx.job = job
        ctx.pattern_dtype = pattern.dtype
        ctx.save_for_backward(x, dt, A, B, C)
        return torch.einsum(job.equation, pattern, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        job: PatternJob = ctx.job
        n_heads = job.shape[1]

        def outputs_of(leaves: list[Tensor], heads: slice, rows: slice) -> tuple[Tensor, Tensor]:
            x, dt, A, B, C = leaves
            pattern = job.part(dt, A, B, C, heads, rows).to(ctx.pattern_dtype)
            if heads != slice(0, n_heads):
                x = x[:, :, heads]
            return torch.einsum(job.equation, pattern, x), grad[:, rows, heads]

        grads = _recompute_grads(
            job, list(ctx.saved_tensors), list(ctx.needs_input_grad[2:]), outputs_of
        )
        return (None, None, *grads)


def build_pattern(job: PatternJob, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """The whole pattern of ``job``, built in chunks within its budget.

    Without gradients the chunks are written into one tensor (one chunk: returned as built, no
    copy). With gradients the pattern is one autograd node that keeps only ``dt``, ``A``, ``B``,
    ``C`` and rebuilds the chunks in the backward pass.

    Args:
        job: What to build (:class:`PatternJob`); ``dt``, ``A``, ``B``, ``C`` are what its
            builder reads.

    Returns:
        The pattern, ``job.shape``.
    """
    if _needs_grad(dt, A, B, C):
        return cast("Tensor", _BudgetedPattern.apply(job, dt, A, B, C))
    return _assemble(job, dt, A, B, C)


def apply_pattern(
    job: PatternJob,
    pattern: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    edited: bool,
) -> Tensor:
    """``y = einsum(job.equation, pattern, x)``; with gradients and an unedited pattern, without
    keeping the pattern for the backward pass (it is rebuilt there, chunk by chunk).

    Args:
        job: The pattern's :class:`PatternJob`.
        pattern: What ``hook_pattern`` returned.
        x: The values (head axis 2); ``dt``, ``A``, ``B``, ``C`` as given to
            :func:`build_pattern`.
        edited: The hook returned another tensor or changed this one in place (or a backward
            hook reads the pattern): then autograd keeps ``pattern`` as usual.

    Returns:
        ``y``.
    """
    if not edited and _needs_grad(x, dt, A, B, C):
        return cast("Tensor", _RecomputedApply.apply(job, pattern.detach(), x, dt, A, B, C))
    return torch.einsum(job.equation, pattern, x)
