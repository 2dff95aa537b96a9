"""What a model family declares: :class:`Family`."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from gna_lens.models.config import SSMConfig
from gna_lens.models.mixers.base import SSMMixer

__all__ = ["Family", "Renames", "attention_fields", "folder_tokenizer", "time_step_limit"]

#: ``(regex, replacement)`` pairs renaming Hugging Face weight names to HookedSSM's; the first
#: pattern that matches a name renames it.
Renames = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family, as HookedSSM assembles it.

    A family module (``gna_lens/models/families/<model_type>.py``) defines one ``FAMILY`` and
    the registry (:data:`gna_lens.models.families.FAMILIES`) lists it.

    Attributes:
        model_type: The Hugging Face ``model_type`` (``"mamba"``).
        architecture: ``SSMConfig.architecture`` of its models (``"mamba1"``).
        hf_class: The ``transformers`` class, for messages (``"MambaForCausalLM"``).
        config_fields: The Hugging Face config -> the :class:`~gna_lens.models.SSMConfig`
            fields of this family (layer kinds, sizes, norms, multipliers), beyond the ones
            every family shares (``d_model``, ``n_layers``, ``d_vocab``, ...). Raises
            :class:`~gna_lens.errors.ConfigError` for an option HookedSSM does not implement.
        weight_renames: The config -> the weight-name mapping (:data:`Renames`).
        ssm_mixer: The class of the SSM layers' mixer (an
            :class:`~gna_lens.models.mixers.SSMMixer`).
        config_class: The :class:`~gna_lens.models.SSMConfig` subclass of its models, when the
            family needs fields of its own (``None``: ``SSMConfig``).
        save: For a family whose checkpoints are gna_lens's own format (no ``transformers``
            class loads them): ``save(model, folder)`` writes one
            (``HookedSSM.save_pretrained``).
        load: ``load(folder, dtype=, device=, tokenizer=)`` reads one back
            (``HookedSSM.from_pretrained`` and ``load_model`` route such folders here).
        build_blocks: The config -> the model's blocks, for a family whose blocks are not one
            :class:`~gna_lens.models.block.SSMBlock` per layer (Zamba2: shared transformer
            blocks with tied weights); ``None``: ``SSMBlock(cfg, layer)`` for every layer.
        hidden_acts: The ``hidden_act`` values of the Hugging Face config the family
            implements (other values raise :class:`~gna_lens.errors.ConfigError`).
        saves: For a family with a ``save``: ``saves(model) -> bool`` says whether it saves a
            model of another architecture (one whose heads :func:`gna_lens.hybrid.swap_heads`
            swapped: ``HookedSSM.save_pretrained`` asks every such family first).
        recognizes: For a family with a ``load`` whose ``config.json`` may lack a
            ``model_type`` (Cartesia's Llamba): ``recognizes(parsed_config) -> bool``.
        checkpoint_format: For a family with a ``load``: the format its provenance records
            (``"gna_lens"``, ``"cartesia"``).
        weights_files: For a family with a ``load``: the weights files :func:`gna_lens.load_model`
            fetches from a hub, the first that exists (a ``.index.json`` brings its shards).
    """

    model_type: str
    architecture: str
    hf_class: str
    config_fields: Callable[[Any], dict[str, Any]]
    weight_renames: Callable[[SSMConfig], Renames]
    ssm_mixer: type[SSMMixer]
    config_class: type[SSMConfig] | None = None
    save: Callable[[Any, Path], None] | None = None
    load: Callable[..., Any] | None = None
    build_blocks: Callable[[SSMConfig], list[nn.Module]] | None = None
    hidden_acts: tuple[str, ...] = ("silu",)
    saves: Callable[[Any], bool] | None = None
    recognizes: Callable[[Any], bool] | None = None
    checkpoint_format: str = "gna_lens"
    weights_files: tuple[str, ...] = ("model.safetensors",)


def folder_tokenizer(path: Path) -> Any:
    """The tokenizer saved in the folder ``path``; ``None`` when it has none or it cannot be read."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        return None


def time_step_limit(value: Any) -> tuple[float, float]:
    """A Hugging Face ``time_step_limit`` (``None`` or ``(lo, hi)``) as floats."""
    if value is None:
        return (0.0, float("inf"))
    lo, hi = value
    return (float(lo), float(hi))


def attention_fields(config: Any) -> dict[str, Any]:
    """The attention layers' SSMConfig fields of a Hugging Face hybrid config: heads, KV heads
    and ``attn_d_head`` (``head_dim``, else ``hidden_size // num_attention_heads``)."""
    H, KV = int(config.num_attention_heads), int(config.num_key_value_heads)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // H)
    return dict(n_attn_heads=H, n_attn_kv_heads=KV, n_key_value_heads=KV, attn_d_head=d)
