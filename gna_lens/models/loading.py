"""``load_model``: one entry point for Transformers (TransformerBridge) and SSMs (HookedSSM)."""

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
    **kwargs: Any,
) -> Any:
    """Load a causal LM for analysis: a HookedSSM for Mamba-family checkpoints, else a bridge.

    Mamba, FalconMamba, Mamba-2 and Bamba checkpoints load as :class:`HookedSSM`; every other
    architecture loads as TransformerLens's ``TransformerBridge`` (``boot_transformers``), so the
    rest of gna_lens sees one (layer, head) interface.

    Args:
        name_or_path: A hub name (where a hub is reachable) or a local checkpoint directory.
        dtype: Weights dtype.
        device: Target device.
        **kwargs: Passed to the loader.

    Returns:
        A ``HookedSSM`` or a ``TransformerBridge``.

    Raises:
        ConfigError: If no config can be read at ``name_or_path``.

    Examples:
        >>> import tempfile
        >>> from gna_lens.testing import tiny_checkpoint
        >>> path = tiny_checkpoint("mamba2", tempfile.mkdtemp())
        >>> type(load_model(path)).__name__
        'HookedSSM'
    """
    from transformers import AutoConfig

    name = str(name_or_path)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"load_model({name!r}): no model config found ({err.__class__.__name__}: {err}). "
            "Pass a local checkpoint directory containing config.json, or a hub name where a hub "
            "is reachable."
        ) from err
    if config.model_type in SUPPORTED_MODEL_TYPES:
        return HookedSSM.from_pretrained(name, dtype=dtype, device=device, **kwargs)
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(name, dtype=dtype, device=device, **kwargs)
