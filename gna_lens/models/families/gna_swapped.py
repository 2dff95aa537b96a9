"""Models with SSM heads swapped for attention heads (``model_type="gna_lens_swapped"``), made
by :func:`gna_lens.hybrid.swap_heads` from a Mamba-2 or a Mamba-2 hybrid HookedSSM.

A swapped model keeps its family (``cfg.architecture`` is still ``"mamba2"``, ``"bamba"``, ...):
only some layers' mixers are :class:`~gna_lens.models.mixers.swapped.SwappedMamba2Mixer`. No
``transformers`` class reads it, so it is saved in gna_lens's own format, a folder with

- ``config.json``: ``model_type`` ``"gna_lens_swapped"``, ``ssm_config`` (the HookedSSM's
  :class:`~gna_lens.models.SSMConfig` fields, from which the model is rebuilt as it was),
  ``swapped_heads`` (``[[layer, head], ...]``) and ``swap`` (how they were trained: source model,
  budget, data, seed, losses);
- ``model.safetensors``: the weights under HookedSSM's names (``unembed.weight`` left out when
  tied);
- the tokenizer's files.

``HookedSSM.save_pretrained`` writes one; ``HookedSSM.from_pretrained`` and
:func:`gna_lens.load_model` read it back bit-identically.
"""

import dataclasses
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gna_lens.errors import ConfigError
from gna_lens.models.config import SSMConfig
from gna_lens.models.families import gna_hybrid
from gna_lens.models.families.base import Family
from gna_lens.models.mixers.mamba2 import Mamba2Mixer
from gna_lens.models.mixers.swapped import SwappedMamba2Mixer, swapped_heads_of

if TYPE_CHECKING:
    from gna_lens.models.hooked_ssm import HookedSSM

__all__ = ["FAMILY", "MODEL_TYPE", "install", "load", "save"]

MODEL_TYPE = "gna_lens_swapped"
HF_CLASS = "GnaLensSwappedForCausalLM"
_SKIP = ("dtype", "device")


def config_fields(config: Any) -> dict[str, Any]:
    """Never used: a swapped checkpoint stores its HookedSSM config whole (see :func:`load`)."""
    raise ConfigError(
        "a gna_lens_swapped config is read by gna_lens.load_model / HookedSSM.from_pretrained "
        "(they rebuild the model from the stored ssm_config), not by config_from_hf."
    )


def install(model: "HookedSSM", heads: dict[int, list[int]]) -> None:
    """Replace the mixers of ``heads``' layers (``{layer: [head, ...]}``) by
    :class:`SwappedMamba2Mixer` copies of them (new parameters from the heads' own rows).

    Raises:
        ConfigError: For a layer whose mixer is not a plain Mamba-2 mixer.
    """
    for layer, hs in sorted(heads.items()):
        mixer = getattr(model.blocks[layer], "mixer", None)
        if type(mixer) is not Mamba2Mixer:
            kind = type(mixer).__name__ if mixer is not None else model.cfg.layer_types[layer]
            raise ConfigError(
                f"swap_heads: layer {layer} of this {model.cfg.architecture} model has a "
                f"{kind} mixer; heads can be swapped in Mamba-2 layers only (Mamba-2, Bamba, "
                "Nemotron-H, Granite 4.0, Falcon-H1). For a hybrid student of build_hybrid, build "
                "it again keeping the head: its teacher has the real attention head."
            )
        model.blocks[layer].mixer = SwappedMamba2Mixer.from_mamba2(mixer, hs)
    model.setup()  # register the new mixers' hook points (hook_dict, names)


def _config_dict(cfg: SSMConfig) -> dict[str, Any]:
    cls = type(cfg)
    fields = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.init and f.name not in _SKIP
    }
    return {"config_class": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}


def _config_from(data: dict[str, Any]) -> SSMConfig:
    module, _, name = str(data["config_class"]).partition(":")
    if not module.startswith("gna_lens."):
        raise ConfigError(
            f"gna_lens_swapped config: config_class {data['config_class']!r} is not gna_lens's."
        )
    cls = getattr(importlib.import_module(module), name)
    fields = dict(data["fields"])
    for f in dataclasses.fields(cls):
        if f.name in fields and isinstance(fields[f.name], list):
            default = f.default if f.default is not dataclasses.MISSING else None
            if isinstance(default, tuple):
                fields[f.name] = tuple(fields[f.name])
    cfg: SSMConfig = cls(**fields)
    return cfg


def save(model: "HookedSSM", path: Path) -> None:
    """Write ``model`` (a HookedSSM with swapped heads) to the folder ``path``."""
    dtype = next(iter(model.parameters())).dtype
    data = {
        "model_type": MODEL_TYPE,
        "architectures": [HF_CLASS],
        "ssm_config": _config_dict(model.cfg),
        "swapped_heads": [list(h) for h in swapped_heads_of(model)],
        "swap": dict(getattr(model, "gna_swap", None) or {}),
        "dtype": str(dtype).removeprefix("torch."),
    }
    gna_hybrid.write_checkpoint(model, path, MODEL_TYPE, data, indent=1)


def load(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: Any | None = None,
) -> Any:
    """Read a model saved by :func:`save` into a HookedSSM (eval mode).

    Raises:
        ConfigError: If the folder has no weights file, or the config is malformed.
    """
    path = Path(path)
    data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    state = gna_hybrid.checkpoint_state(path, "swapped")
    try:
        cfg = _config_from(data["ssm_config"])
        heads: dict[int, list[int]] = {}
        for layer, head in data["swapped_heads"]:
            heads.setdefault(int(layer), []).append(int(head))
    except (KeyError, TypeError, ValueError, AttributeError, ImportError) as err:
        raise ConfigError(
            f"{path}/config.json: a malformed gna_lens_swapped config ({err.__class__.__name__}: "
            f"{err}); expected ssm_config and swapped_heads as HookedSSM.save_pretrained writes."
        ) from err
    if cfg.tie_word_embeddings and "unembed.weight" not in state:
        state["unembed.weight"] = state["embed.weight"]
    model = gna_hybrid.read_checkpoint(
        path, cfg, state, dtype=dtype, device=device, tokenizer=tokenizer,
        prepare=lambda m: install(m, heads),
    )  # fmt: skip
    model.gna_swap = dict(data.get("swap") or {})
    return model


FAMILY = Family(
    model_type=MODEL_TYPE,
    architecture="gna_swapped",
    hf_class=HF_CLASS,
    config_fields=config_fields,
    weight_renames=gna_hybrid.weight_renames,
    ssm_mixer=SwappedMamba2Mixer,
    save=save,
    load=load,
    saves=lambda model: bool(swapped_heads_of(model)),
)
