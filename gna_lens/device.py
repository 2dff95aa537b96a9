"""Where every tensor lives: the model's device and dtype decide, results come back to the host.

One object, :class:`DevicePolicy`, built from the model once (:meth:`DevicePolicy.of`) and carried
down, answers the device questions of every step: inputs go to the model's device
(:meth:`DevicePolicy.put`), results come back to the host as detached tensors (:func:`to_host`,
:func:`host_full`), so a ranking made on a GPU can be saved, compared and plotted anywhere.
``tests/test_device_guard.py`` enforces it: no tensor factory in gna_lens without ``device=``
(module parameters and buffers excepted), no ``.cuda()``, and no ``.cpu()`` / ``.to("cpu")``
outside this module.

Example:
    >>> import torch
    >>> from gna_lens.device import DevicePolicy, resolve_device, to_host
    >>> policy = DevicePolicy(torch.device("cpu"), torch.float32)
    >>> policy.put(torch.tensor([1, 2], device="cpu")).device.type
    'cpu'
    >>> to_host(torch.ones(2, requires_grad=True, device="cpu") * 2).requires_grad
    False
    >>> resolve_device("cpu")
    device(type='cpu')
"""

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gna_lens.errors import ConfigError
from gna_lens.runtime import autocast as _autocast
from gna_lens.runtime import cpu_description

__all__ = [
    "HOST",
    "DevicePolicy",
    "exact_matmul",
    "host_full",
    "resolve_device",
    "resolve_dtype",
    "to_host",
]

#: Where results live: effects, baselines, intervals, tables, everything handed back to the user.
HOST = torch.device("cpu")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The device a model should load on.

    Args:
        device: ``"auto"`` or ``None`` (CUDA where there is one, else the CPU), or any torch
            device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).

    Returns:
        The device; ``"cuda"`` without an index means the current CUDA device.

    Raises:
        ConfigError: The string is not a device, or CUDA was asked for where there is none.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None or (isinstance(device, str) and device.lower() == "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else HOST
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device={device!r} is not a torch device; expected 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={device!r}, but torch {torch.__version__} sees no CUDA device on this "
            "machine; pass device='cpu' (or 'auto', which takes CUDA only where it exists)."
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(
            f"device={device!r}, but this machine has {torch.cuda.device_count()} CUDA "
            f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})."
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The weights' dtype from a name (``"float32"``, ``"bfloat16"``, ``"float16"``) or ``None``.

    Args:
        dtype: A name, a torch dtype, or ``None``/``"auto"`` (keep the checkpoint's dtype and
            let the loader decide).

    Raises:
        ConfigError: An unknown name.

    Example:
        >>> resolve_dtype("bf16")
        torch.bfloat16
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype.lower() == "auto":
        return None
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ConfigError(
            f"dtype={dtype!r} is not a weight dtype; expected one of "
            f"{sorted(set(_DTYPES))} or 'auto'."
        ) from None


def to_host(x: Tensor) -> Tensor:
    """``x`` detached and on the host: how every result leaves the model's device.

    Example:
        >>> to_host(torch.zeros(2, device="cpu")).device.type
        'cpu'
    """
    return x.detach().to(HOST)


def host_full(
    shape: int | Sequence[int], fill: float = float("nan"), dtype: torch.dtype = torch.float32
) -> Tensor:
    """A result buffer on the host, filled with ``fill`` (NaN marks a value not computed).

    Example:
        >>> host_full(2)
        tensor([nan, nan])
    """
    return torch.full((shape,) if isinstance(shape, int) else tuple(shape), fill, dtype=dtype,
                      device=HOST)  # fmt: skip


@contextlib.contextmanager
def exact_matmul() -> Iterator[None]:
    """TF32 off inside (CUDA matmul and cuDNN), restored after, for checks that compare two paths.

    On Ampere and newer GPUs TF32 rounds matmul inputs to 10 mantissa bits when allowed; a parity
    check between a fast and a reference path must not see that rounding on one side only.
    A no-op on the CPU.

    Example:
        >>> with exact_matmul():
        ...     pass
    """
    matmul = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


@dataclass(frozen=True)
class DevicePolicy:
    """Where a model's tensors live and in what dtype; how results come back.

    Attributes:
        device: The model's device: inputs, masks, patched values and caches go here.
        dtype: The dtype of the model's weights.
    """

    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, model: object) -> "DevicePolicy":
        """The policy of a model: the device of its weights (``cfg.device`` where the model
        has no parameters), the dtype of its first floating-point weight.

        Example:
            >>> DevicePolicy.of(torch.nn.Linear(2, 2)).device
            device(type='cpu')
        """
        params = list(getattr(model, "parameters", list)())
        if params:
            dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
            return cls(params[0].device, dtype)
        dev = getattr(getattr(model, "cfg", None), "device", None)
        if dev is None:
            raise ConfigError(
                f"cannot tell where {type(model).__name__} runs: it has no parameters and no "
                "cfg.device; pass a TransformerBridge, a HookedSSM or an nn.Module."
            )
        return cls(torch.device(dev), torch.float32)

    @property
    def is_cuda(self) -> bool:
        """Whether the model runs on a CUDA device."""
        return self.device.type == "cuda"

    def put(self, x: Tensor) -> Tensor:
        """``x`` on the model's device (a no-op where it is there already)."""
        return x.to(self.device, non_blocking=x.device.type == "cpu" and x.is_pinned())

    def tensor(self, data: Any, dtype: torch.dtype | None = None) -> Tensor:
        """A new tensor on the model's device (index lists, token ids)."""
        return torch.as_tensor(data, dtype=dtype, device=self.device)

    def arange(self, n: int) -> Tensor:
        """``0..n-1`` (int64) on the model's device."""
        return torch.arange(n, device=self.device)

    def autocast(self, dtype: Any) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision on the model's device (:func:`gna_lens.runtime.autocast`)."""
        return _autocast(self.device, dtype)

    def synchronize(self) -> None:
        """Wait for queued kernels (timing); a no-op on the CPU."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def peak_memory(self) -> int | None:
        """Peak bytes allocated on the model's CUDA device since the last reset (None on CPU)."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.is_cuda else None

    def machine(self) -> str:
        """What a timing ran on, printed next to it: the GPU and the CPU on CUDA, the CPU and its
        torch threads on the CPU."""
        threads = f"{torch.get_num_threads()} torch thread(s)"
        if self.is_cuda:
            return f"{self.describe()}; host {cpu_description()}; {threads}"
        return f"{cpu_description()}; {threads}"

    def describe(self) -> str:
        """The device in words, for reports: ``"cuda:0 (NVIDIA H100 80GB HBM3), bfloat16"``."""
        where = str(self.device)
        if self.is_cuda:
            where += f" ({torch.cuda.get_device_name(self.device)})"
        return f"{where}, {str(self.dtype).removeprefix('torch.')}"
