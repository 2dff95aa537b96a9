"""Original state-spaces checkpoints (``mamba_ssm``'s format), converted on the fly.

The Mamba and Mamba-2 checkpoints that state-spaces published (``state-spaces/mamba-130m`` ...
``mamba2-2.7b``) are in ``mamba_ssm``'s own format, which ``transformers`` cannot load: a
``config.json`` with ``d_model``, ``n_layer``, ``vocab_size``, ``ssm_cfg`` (``{"layer":
"Mamba2", ...}`` for Mamba-2), ``rms_norm``, ``residual_in_fp32``, ``fused_add_norm``,
``pad_vocab_size_multiple``, ``tie_embeddings``, and a ``pytorch_model.bin`` (or
``model.safetensors``) whose names are those of ``MambaLMHeadModel``.

:func:`gna_lens.load_model` recognizes such a folder (or hub repository), translates the config
into a ``transformers`` ``MambaConfig`` / ``Mamba2Config``, renames the state dict
(``backbone.embedding.weight`` -> ``backbone.embeddings.weight``; the mixer, norm and head names
are the same in both), loads it strictly into the ``transformers`` model class (every weight
must be used and every parameter filled) and builds the :class:`~gna_lens.models.HookedSSM` from
it exactly as for a ``transformers`` checkpoint. Nothing is written to disk.

Options the ``transformers`` classes cannot express (LayerNorm instead of RMSNorm, MLP or
attention layers, Mamba-2's ``norm_before_gate``, ``D_has_hdim`` or ``d_ssm`` < ``d_inner``)
raise :class:`~gna_lens.errors.ConfigError` naming the key.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gna_lens.errors import ConfigError

__all__ = [
    "TOKENIZER",
    "WEIGHTS",
    "hf_config_from_mamba_ssm",
    "hf_state_dict_from_mamba_ssm",
    "is_mamba_ssm_config",
    "read_mamba_ssm_weights",
]

#: The weights files of a mamba_ssm checkpoint, in order of preference.
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
#: The tokenizer state-spaces' models were trained with (their repositories ship none).
TOKENIZER = "EleutherAI/gpt-neox-20b"

_TOP_KEYS = {
    "d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx",
    "attn_cfg", "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple",
    "tie_embeddings",
}  # fmt: skip
#: Keys that only affect initialization or which kernel runs, not the function computed.
_INIT_ONLY = {
    "dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor", "A_init_range", "conv_init",
    "use_fast_path", "use_mem_eff_path", "layer_idx", "process_group", "sequence_parallel",
    "layer",
}  # fmt: skip
_MAMBA1_KEYS = {"d_state", "d_conv", "expand", "dt_rank", "conv_bias", "bias"} | _INIT_ONLY
_MAMBA2_KEYS = {
    "d_state", "d_conv", "expand", "headdim", "d_ssm", "ngroups", "D_has_hdim", "rmsnorm",
    "norm_before_gate", "dt_limit", "bias", "conv_bias", "chunk_size",
} | _INIT_ONLY  # fmt: skip


def is_mamba_ssm_config(data: Any) -> bool:
    """Whether a parsed ``config.json`` is in mamba_ssm's format (not a ``transformers`` one):
    no ``model_type``, no ``mlp_cfg`` (Cartesia's Llamba, which shares the other keys), and one
    of mamba_ssm's own keys (``d_model``, ``n_layer``, ``ssm_cfg``,
    ``pad_vocab_size_multiple``), so that a config missing one required key is still recognized
    (and :func:`hf_config_from_mamba_ssm` names what is missing).

    Examples:
        >>> is_mamba_ssm_config({"d_model": 768, "n_layer": 24, "vocab_size": 50277})
        True
        >>> is_mamba_ssm_config({"model_type": "mamba2", "hidden_size": 768})
        False
    """
    if not isinstance(data, Mapping) or "model_type" in data:
        return False
    if "mlp_cfg" in data:  # Cartesia's Llamba (gna_lens.models.families.llamba), not mamba_ssm
        return False
    return any(k in data for k in ("d_model", "n_layer", "ssm_cfg", "pad_vocab_size_multiple"))


def _fail(where: str, key: str, why: str) -> ConfigError:
    return ConfigError(
        f"load_model({where!r}): mamba_ssm config.json: {key} {why}. gna_lens converts "
        "state-spaces' Mamba and Mamba-2 language models (RMSNorm, SSM layers only) on the fly; "
        "fix the config, or convert the checkpoint to transformers' format yourself."
    )


def _int(data: Mapping[str, Any], key: str, where: str, default: Any = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise _fail(where, repr(key), "is missing (required)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(where, f"{key}={value!r}", "must be a positive int")
    return value


def _bool(data: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise _fail(where, f"{key}={value!r}", "must be true or false")
    return value


def _unknown(data: Mapping[str, Any], known: set[str], prefix: str, where: str) -> None:
    extra = sorted(k for k in data if k not in known and not k.startswith("_"))
    if extra:
        raise _fail(
            where,
            ", ".join(f"{prefix}{k}" for k in extra),
            f"{'is' if len(extra) == 1 else 'are'} not a known mamba_ssm option (known: "
            f"{sorted(known - _INIT_ONLY)}), so its effect cannot be reproduced",
        )


def _padded_vocab(vocab_size: int, multiple: int) -> int:
    """mamba_ssm's embedding rows: ``vocab_size`` rounded up to ``pad_vocab_size_multiple``."""
    return math.ceil(vocab_size / multiple) * multiple


def hf_config_from_mamba_ssm(data: Mapping[str, Any], *, where: str = "?") -> Any:
    """Translate a mamba_ssm ``config.json`` into a ``transformers`` config.

    Args:
        data: The parsed ``config.json``.
        where: The checkpoint's name, for error messages.

    Returns:
        A ``MambaConfig`` (``ssm_cfg.layer`` absent or ``"Mamba1"``) or ``Mamba2Config``.

    Raises:
        ConfigError: Naming the key, for a missing required key (``d_model``, ``n_layer``,
            ``vocab_size``), a value of the wrong type, an option the ``transformers`` classes
            cannot express, or an unknown key.

    Examples:
        >>> cfg = hf_config_from_mamba_ssm({"d_model": 64, "n_layer": 2, "vocab_size": 50,
        ...     "ssm_cfg": {"layer": "Mamba2", "headdim": 16}, "pad_vocab_size_multiple": 16})
        >>> type(cfg).__name__, cfg.num_heads, cfg.vocab_size
        ('Mamba2Config', 8, 64)
        >>> hf_config_from_mamba_ssm({"d_model": 64, "n_layer": 2, "vocab_size": 50,
        ...     "rms_norm": False})
        Traceback (most recent call last):
        ...
        gna_lens.errors.ConfigError: load_model('?'): mamba_ssm config.json: rms_norm=False ...
    """
    from transformers import Mamba2Config, MambaConfig

    if not isinstance(data, Mapping):
        raise _fail(where, "the file", f"holds a {type(data).__name__}, not an object")
    _unknown(data, _TOP_KEYS | {"architectures", "torch_dtype", "dtype"}, "", where)
    d_model = _int(data, "d_model", where)
    n_layer = _int(data, "n_layer", where)
    vocab = _padded_vocab(
        _int(data, "vocab_size", where), _int(data, "pad_vocab_size_multiple", where, 8)
    )
    if not _bool(data, "rms_norm", where, True):
        raise _fail(where, "rms_norm=False", "(LayerNorm blocks) has no transformers equivalent")
    if data.get("d_intermediate", 0) not in (0, None):
        raise _fail(
            where, f"d_intermediate={data['d_intermediate']!r}", "adds MLP layers; expected 0"
        )
    if data.get("attn_layer_idx") or data.get("attn_cfg"):
        raise _fail(
            where,
            f"attn_layer_idx={data.get('attn_layer_idx')!r}",
            "adds attention layers (a hybrid); expected [] (pure SSM)",
        )
    ssm = data.get("ssm_cfg") or {}
    if not isinstance(ssm, Mapping):
        raise _fail(where, f"ssm_cfg={ssm!r}", "must be an object")
    layer = ssm.get("layer", "Mamba1")
    common: dict[str, Any] = dict(
        hidden_size=d_model,
        num_hidden_layers=n_layer,
        vocab_size=vocab,
        residual_in_fp32=_bool(data, "residual_in_fp32", where, True),
        tie_word_embeddings=_bool(data, "tie_embeddings", where, True),
        layer_norm_epsilon=1e-5,  # mamba_ssm's create_block and Mamba2's gated norm
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        architectures=["Mamba2ForCausalLM" if layer == "Mamba2" else "MambaForCausalLM"],
    )
    if layer not in ("Mamba1", "Mamba2"):
        raise _fail(where, f"ssm_cfg.layer={layer!r}", "is not 'Mamba1' or 'Mamba2'")
    _unknown(ssm, _MAMBA1_KEYS if layer == "Mamba1" else _MAMBA2_KEYS, "ssm_cfg.", where)
    common |= dict(
        expand=_int(ssm, "expand", where, 2),
        conv_kernel=_int(ssm, "d_conv", where, 4),
        use_conv_bias=_bool(ssm, "conv_bias", where, True),
        use_bias=_bool(ssm, "bias", where, False),
    )
    if layer == "Mamba1":
        dt_rank = ssm.get("dt_rank", "auto")
        if dt_rank != "auto":
            dt_rank = _int(ssm, "dt_rank", where)
        return MambaConfig(
            **common,
            state_size=_int(ssm, "d_state", where, 16),
            time_step_rank=math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank,
        )
    headdim = _int(ssm, "headdim", where, 64)
    ngroups = _int(ssm, "ngroups", where, 1)
    d_inner = common["expand"] * d_model
    if ssm.get("d_ssm") not in (None, d_inner):
        raise _fail(
            where,
            f"ssm_cfg.d_ssm={ssm['d_ssm']!r}",
            f"runs part of the {d_inner} inner channels as an MLP; expected null or {d_inner}",
        )
    if d_inner % headdim:
        raise _fail(
            where,
            f"ssm_cfg.headdim={headdim}",
            f"does not divide expand * d_model = {d_inner}",
        )
    n_heads = d_inner // headdim
    if n_heads % ngroups:
        raise _fail(where, f"ssm_cfg.ngroups={ngroups}", f"does not divide the {n_heads} heads")
    for key, expected in (("rmsnorm", True), ("norm_before_gate", False), ("D_has_hdim", False)):
        if _bool(ssm, key, where, expected) != expected:
            raise _fail(
                where,
                f"ssm_cfg.{key}={not expected}",
                f"has no transformers equivalent (Mamba2 there has {key}={expected})",
            )
    limit = ssm.get("dt_limit", (0.0, math.inf))
    try:
        lo, hi = (float(x) for x in limit)
    except (TypeError, ValueError) as err:
        raise _fail(where, f"ssm_cfg.dt_limit={limit!r}", "must be a pair of numbers") from err
    return Mamba2Config(
        **common,
        num_heads=n_heads,
        head_dim=headdim,
        n_groups=ngroups,
        state_size=_int(ssm, "d_state", where, 128),
        chunk_size=_int(ssm, "chunk_size", where, 256),
        time_step_limit=(lo, hi),
    )


def read_mamba_ssm_weights(
    folder: str | Path, *, where: str = "?"
) -> tuple[dict[str, Tensor], Path]:
    """The state dict of a mamba_ssm checkpoint folder, and the file it came from.

    ``model.safetensors`` is preferred; ``pytorch_model.bin`` is read with
    ``torch.load(weights_only=True)`` (tensors only: no code in the file runs).

    Raises:
        ConfigError: If the folder holds neither file, or the file is not a state dict.
    """
    folder = Path(folder)
    for name in WEIGHTS:
        file = folder / name
        if file.is_file():
            break
    else:
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        raise ConfigError(
            f"load_model({where!r}): a mamba_ssm checkpoint needs {' or '.join(WEIGHTS)} next "
            f"to its config.json; {folder} holds {present}."
        )
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(file))
        else:
            try:  # memory-mapped: the weights are copied into the HookedSSM once, not twice
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # files saved in torch's legacy (non-zip) format
                state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch raise assorted types for a corrupt file
        raise ConfigError(
            f"load_model({where!r}): cannot read {file} ({type(err).__name__}: {err})."
        ) from err
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(
            f"load_model({where!r}): {file} holds a {type(state).__name__} that is not a flat "
            "state dict of tensors (expected mamba_ssm's MambaLMHeadModel.state_dict())."
        )
    return dict(state), file


def hf_state_dict_from_mamba_ssm(
    state: Mapping[str, Tensor], hf_config: Any, *, where: str = "?"
) -> dict[str, Tensor]:
    """Rename a mamba_ssm state dict to ``transformers`` names.

    ``backbone.embedding.weight`` becomes ``backbone.embeddings.weight``; a leading ``model.``
    is dropped; the layers' ``mixer.*`` and ``norm.weight``, ``backbone.norm_f.weight`` and
    ``lm_head.weight`` keep their names. A tied ``lm_head.weight`` must equal the embedding and
    is dropped (the ``transformers`` model ties it again).

    Raises:
        ConfigError: If the embedding is missing or its rows differ from the padded
            ``vocab_size``, or a tied head differs from the embedding.
    """
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        new = key.removeprefix("model.")
        if new == "backbone.embedding.weight":
            new = "backbone.embeddings.weight"
        out[new] = value
    emb = out.get("backbone.embeddings.weight")
    if emb is None:
        raise ConfigError(
            f"load_model({where!r}): the mamba_ssm state dict has no backbone.embedding.weight "
            f"(its first keys: {list(state)[:5]})."
        )
    if emb.shape[0] != hf_config.vocab_size:
        raise ConfigError(
            f"load_model({where!r}): mamba_ssm config.json: vocab_size and "
            f"pad_vocab_size_multiple give {hf_config.vocab_size} embedding rows, but "
            f"backbone.embedding.weight has shape {tuple(emb.shape)}. Fix the two keys."
        )
    if hf_config.tie_word_embeddings and "lm_head.weight" in out:
        head = out.pop("lm_head.weight")
        if head.shape != emb.shape or not torch.equal(head, emb):
            raise ConfigError(
                f"load_model({where!r}): mamba_ssm config.json: tie_embeddings is true but "
                "lm_head.weight differs from backbone.embedding.weight. Set tie_embeddings to "
                "false."
            )
    return out


def hf_model_from_mamba_ssm(
    state: Mapping[str, Tensor], hf_config: Any, *, where: str = "?"
) -> Any:
    """Load a renamed state dict strictly into the ``transformers`` class of ``hf_config``.

    The model is built on the meta device (no random initialization) and the tensors are
    assigned, so memory holds the weights once.

    Raises:
        ConfigError: Listing the keys, when a weight is left over or a parameter is not filled,
            or a shape differs from what the config implies.
    """
    from transformers import Mamba2ForCausalLM, MambaForCausalLM

    cls = Mamba2ForCausalLM if hf_config.model_type == "mamba2" else MambaForCausalLM
    with torch.device("meta"):
        model = cls(hf_config)
    try:
        missing, unexpected = model.load_state_dict(dict(state), strict=False, assign=True)
    except RuntimeError as err:  # shape mismatches
        raise ConfigError(
            f"load_model({where!r}): the mamba_ssm weights do not fit the shapes its config.json "
            f"implies ({hf_config.model_type}: {err})."
        ) from err
    if hf_config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
        model.tie_weights()
    if missing or unexpected:
        raise ConfigError(
            f"load_model({where!r}): the mamba_ssm state dict does not match its config.json "
            f"({cls.__name__}): missing {sorted(missing)[:8]}, unexpected "
            f"{sorted(unexpected)[:8]}."
        )
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ConfigError(f"load_model({where!r}): parameters not filled: {left[:8]}.")
    return model.eval()


def read_config(folder: str | Path) -> Any:
    """The parsed ``config.json`` of a folder, or ``None`` when absent or not JSON."""
    try:
        return json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
