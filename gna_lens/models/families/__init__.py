"""The model families HookedSSM loads, one module each, and the registry of them.

A family module declares a :class:`~gna_lens.models.families.base.Family`: its SSM mixer, its
config translation (layer kinds, norms, multipliers) and its weight-name mapping. Adding a family
is one new module here and one entry in :data:`FAMILIES` (see the docs page "Adding a model
family").

Examples:
    >>> from gna_lens.testing import tiny_hf_config
    >>> FAMILIES["mamba2"].ssm_mixer.__name__
    'Mamba2Mixer'
    >>> config_from_hf(tiny_hf_config("bamba")).layer_types
    ['ssm', 'attention', 'ssm']
"""

import json
import re
from pathlib import Path
from typing import Any

from gna_lens.errors import ConfigError
from gna_lens.models.config import SSMConfig
from gna_lens.models.families import (
    bamba,
    falcon_h1,
    falcon_mamba,
    gna_hybrid,
    gna_swapped,
    granitemoehybrid,
    jamba,
    llamba,
    mamba,
    mamba2,
    nemotron_h,
    zamba2,
)
from gna_lens.models.families.base import Family

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "checkpoint_family",
    "config_from_hf",
    "convert_hf_state_dict",
    "family_of",
]

#: Hugging Face ``model_type`` -> its :class:`Family`.
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        mamba.FAMILY,
        falcon_mamba.FAMILY,
        mamba2.FAMILY,
        bamba.FAMILY,
        nemotron_h.FAMILY,
        granitemoehybrid.FAMILY,
        falcon_h1.FAMILY,
        jamba.FAMILY,
        gna_hybrid.FAMILY,
        gna_swapped.FAMILY,
        zamba2.FAMILY,
        llamba.FAMILY,
    )
}

#: Hugging Face ``model_type`` -> HookedSSM architecture (``SSMConfig.architecture``).
SUPPORTED_MODEL_TYPES: dict[str, str] = {t: f.architecture for t, f in FAMILIES.items()}

_BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES.values()}


def family_of(architecture: str) -> Family:
    """The family of ``SSMConfig.architecture``.

    Raises:
        ConfigError: For an architecture no family declares.

    Examples:
        >>> family_of("mamba1").model_type
        'mamba'
    """
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise ConfigError(
            f"SSMConfig.architecture={architecture!r} is not a HookedSSM architecture; known: "
            f"{sorted(_BY_ARCHITECTURE)}."
        )
    return family


def config_from_hf(hf_config: Any, config_cls: type[SSMConfig] = SSMConfig) -> SSMConfig:
    """Translate a Hugging Face config of a supported family (see ``SSMConfig.from_hf_config``).

    Raises:
        ConfigError: If the architecture or an option is not supported.
    """
    model_type = getattr(hf_config, "model_type", None)
    family = FAMILIES.get(str(model_type))
    archs = getattr(hf_config, "architectures", None) or []
    if family is None:
        classes = ", ".join(f.hf_class for f in FAMILIES.values())
        raise ConfigError(
            f"HookedSSM does not support model_type={model_type!r} (architectures={archs}). "
            f"Supported: {sorted(SUPPORTED_MODEL_TYPES)} ({classes}). For "
            "Transformer architectures use gna_lens.load_model(...), which returns a "
            "TransformerBridge."
        )
    act = getattr(hf_config, "hidden_act", None) or getattr(hf_config, "mamba_hidden_act", "silu")
    if act not in family.hidden_acts:
        raise ConfigError(
            f"HookedSSM implements the {'/'.join(family.hidden_acts)} activation of {model_type} "
            f"models; this config has hidden_act={act!r}."
        )
    common: dict[str, Any] = dict(
        architecture=family.architecture,
        hf_architecture=archs[0] if archs else "",
        model_name=str(getattr(hf_config, "_name_or_path", "") or ""),
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        d_vocab=hf_config.vocab_size,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        pad_token_id=getattr(hf_config, "pad_token_id", None),
        uses_rms_norm=True,
        normalization_type="RMS",
        act_fn="silu",
        default_prepend_bos=False,
        device="cpu",
    )
    return (family.config_class or config_cls)(**common, **family.config_fields(hf_config))


def checkpoint_family(path: Any) -> Family | None:
    """The family of a folder holding a checkpoint no ``transformers`` class reads (a family with
    a ``load``: gna_lens's own formats, Cartesia's Llamba), else ``None``.

    Examples:
        >>> checkpoint_family("no/such/folder") is None
        True
    """
    try:
        data = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(data, dict):
        return None
    family = FAMILIES.get(str(data.get("model_type")))
    if family is None:
        family = next((f for f in FAMILIES.values() if f.recognizes and f.recognizes(data)), None)
    return family if family is not None and family.load is not None else None


def convert_hf_state_dict(cfg: SSMConfig, state: dict[str, Any]) -> dict[str, Any]:
    """Rename a Hugging Face state dict to HookedSSM parameter names (the family's mapping).

    Raises:
        ConfigError: For a weight the family's mapping does not know.
    """
    out: dict[str, Any] = {}
    renames = family_of(cfg.architecture).weight_renames(cfg)
    for key, value in state.items():
        new = key
        for pattern, repl in renames:
            new, n = re.subn(pattern, repl, new)
            if n:
                break
        else:
            raise ConfigError(
                f"Unexpected weight {key!r} in a {cfg.hf_architecture or cfg.architecture} "
                f"checkpoint; HookedSSM knows {sorted(SUPPORTED_MODEL_TYPES)} layouts."
            )
        out[new] = value
    if "unembed.weight" not in out and "embed.weight" in out:
        out["unembed.weight"] = out["embed.weight"]
    return out
