"""Llamba (Cartesia's ``cartesia-ai/Llamba-1B`` / ``-3B`` / ``-8B``): Llama-3.x distilled into
DiscreteMamba2 mixers (MOHAWK), in Llama blocks.

Each block is ``x + mixer(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``
(:class:`~gna_lens.models.mixers.discrete_mamba2.DiscreteMamba2Mixer`, no positional encoding),
the final RMSNorm, the LM head (tied to the embedding or not). No ``transformers`` class reads
these checkpoints: they are Cartesia's own format (``cartesia-pytorch``, ``LlambaLMHeadModel``),
a folder with

- ``config.json``: ``d_model``, ``n_layer``, ``vocab_size``, ``pad_vocab_size_multiple``,
  ``tie_embeddings``, ``lm_head_bias``, ``norm_epsilon``, ``mlp_cfg`` (``intermediate_size``,
  ``bias``, ``act_fn``) and ``ssm_cfg`` (``d_state``, ``n_v_heads``, ``n_qk_heads``, ``expand``
  or ``d_inner``, ``d_conv``, ``chunk_size``, ``activation``, ``bias``, ``conv_bias``); a
  ``model_type`` of ``"llamba"`` where the writer added one;
- the weights (``model.safetensors``, sharded safetensors with their index, or
  ``pytorch_model.bin``) under ``backbone.embedding``, ``backbone.layers.{l}.input_layernorm``,
  ``.mixer.{in_proj, z_bias, conv1d, D, out_proj}``, ``.post_attention_layernorm``,
  ``.mlp.{gate_proj, up_proj, down_proj}``, ``backbone.final_layernorm`` and ``lm_head``;
- no tokenizer: Llamba uses its Llama teacher's (:data:`TOKENIZERS`), which
  :func:`gna_lens.load_model` loads where a hub answers (or pass ``tokenizer=``).

:func:`gna_lens.load_model` reads such a folder or hub name (its ``config.json`` is recognized
by its fields); ``HookedSSM.save_pretrained`` writes a Llamba model back in the same layout.
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from gna_lens.device import to_host
from gna_lens.errors import ConfigError
from gna_lens.models.config import UNBOUNDED_CTX, SSMConfig
from gna_lens.models.families.base import Family, Renames, folder_tokenizer
from gna_lens.models.mixers.discrete_mamba2 import CONV_ACTIVATIONS, DiscreteMamba2Mixer

if TYPE_CHECKING:
    from gna_lens.models.hooked_ssm import HookedSSM

__all__ = [
    "FAMILY",
    "MODEL_TYPE",
    "TOKENIZERS",
    "WEIGHTS",
    "cartesia_state_dict",
    "config_dict",
    "is_llamba_config",
    "load",
    "save",
    "tokenizer_name",
]

MODEL_TYPE = "llamba"
HF_CLASS = "LlambaLMHeadModel"
#: Weights files of a Llamba checkpoint, in the order they are looked for.
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
#: The Llama-3 tokenizer of each published Llamba (its distillation teacher's).
TOKENIZERS = {
    "cartesia-ai/Llamba-1B": "meta-llama/Llama-3.2-1B",
    "cartesia-ai/Llamba-3B": "meta-llama/Llama-3.2-3B",
    "cartesia-ai/Llamba-8B": "meta-llama/Llama-3.1-8B",
}
#: The tokenizer of a Llamba checkpoint none of :data:`TOKENIZERS` names (Llama 3.x share one
#: vocabulary of 128,256 tokens).
DEFAULT_TOKENIZER = "meta-llama/Llama-3.2-1B"
#: The RMSNorm epsilon of Cartesia's blocks (fixed in ``cartesia-pytorch``; ``norm_epsilon``
#: sets the final norm's).
BLOCK_EPS = 1e-5

RENAMES: Renames = [
    (r"^backbone\.embedding\.", "embed."),
    (r"^backbone\.layers\.(\d+)\.input_layernorm\.", r"blocks.\1.ln1."),
    (r"^backbone\.layers\.(\d+)\.post_attention_layernorm\.", r"blocks.\1.ln2."),
    (r"^backbone\.layers\.(\d+)\.mixer\.", r"blocks.\1.mixer."),
    (r"^backbone\.layers\.(\d+)\.mlp\.", r"blocks.\1.mlp."),
    (r"^backbone\.final_layernorm\.", "ln_final."),
    (r"^lm_head\.", "unembed."),
]
#: HookedSSM's names back to Cartesia's (:func:`cartesia_state_dict`).
_BACK: Renames = [
    (r"^embed\.", "backbone.embedding."),
    (r"^blocks\.(\d+)\.ln1\.", r"backbone.layers.\1.input_layernorm."),
    (r"^blocks\.(\d+)\.ln2\.", r"backbone.layers.\1.post_attention_layernorm."),
    (r"^blocks\.(\d+)\.mixer\.", r"backbone.layers.\1.mixer."),
    (r"^blocks\.(\d+)\.mlp\.", r"backbone.layers.\1.mlp."),
    (r"^ln_final\.", "backbone.final_layernorm."),
    (r"^unembed\.", "lm_head."),
]


def is_llamba_config(data: Any) -> bool:
    """Whether a parsed ``config.json`` is a Llamba config (``model_type`` ``"llamba"``, or
    Cartesia's ``ssm_cfg`` and ``mlp_cfg`` without a ``model_type``: mamba_ssm's configs have
    ``ssm_cfg`` but no ``mlp_cfg``).

    Examples:
        >>> is_llamba_config({"d_model": 64, "n_layer": 2, "ssm_cfg": {}, "mlp_cfg": {}})
        True
        >>> is_llamba_config({"d_model": 64, "n_layer": 2, "ssm_cfg": {}})  # mamba_ssm's
        False
        >>> is_llamba_config({"model_type": "llama", "hidden_size": 64})
        False
    """
    if not isinstance(data, dict):
        return False
    if data.get("model_type") == MODEL_TYPE:
        return True
    return "model_type" not in data and {"ssm_cfg", "mlp_cfg"} <= set(data)


def _padded_vocab(data: dict[str, Any]) -> int:
    vocab = int(data["vocab_size"])
    multiple = int(data.get("pad_vocab_size_multiple", 8) or 1)
    return vocab + (-vocab) % multiple


def read_config(path: Path) -> SimpleNamespace:
    """A Llamba ``config.json`` as a config object with the fields every family shares
    (``hidden_size``, ``num_hidden_layers``, ``vocab_size`` padded as Cartesia pads it, ...)
    beside Cartesia's own.

    Raises:
        ConfigError: For a config without Cartesia's fields (the message names the missing one).
    """
    file = Path(path) / "config.json"
    data = json.loads(file.read_text(encoding="utf-8"))
    for key in ("d_model", "n_layer", "vocab_size"):
        if key not in data:
            raise ConfigError(
                f"{file}: a Llamba config without {key!r}; expected Cartesia's LlambaConfig "
                "fields (d_model, n_layer, vocab_size, ssm_cfg, mlp_cfg)."
            )
    mlp = dict(data.get("mlp_cfg") or {})
    fields = dict(data)
    fields.update(
        model_type=MODEL_TYPE,
        architectures=[HF_CLASS],
        _name_or_path=str(path),
        hidden_size=int(data["d_model"]),
        num_hidden_layers=int(data["n_layer"]),
        vocab_size=_padded_vocab(data),  # the embedding's rows: Cartesia pads the vocabulary
        unpadded_vocab_size=int(data["vocab_size"]),
        tie_word_embeddings=bool(data.get("tie_embeddings", False)),
        hidden_act=str(mlp.get("act_fn", "silu")),
    )
    return SimpleNamespace(**fields)


def config_fields(config: Any) -> dict[str, Any]:
    """The SSMConfig fields of a Llamba config (:func:`read_config`).

    Raises:
        ConfigError: For an option HookedSSM does not implement (an LM head bias, a final norm
            epsilon other than the blocks', an unknown convolution activation, heads that do not
            tile ``d_inner``).
    """
    ssm = dict(getattr(config, "ssm_cfg", None) or {})
    mlp = dict(getattr(config, "mlp_cfg", None) or {})
    d_model = int(config.hidden_size)
    d_inner = int(ssm.get("d_inner") or int(ssm.get("expand", 1)) * d_model)
    n_v = int(ssm.get("n_v_heads", 32))
    n_qk = int(ssm.get("n_qk_heads", 32))
    where = f"Llamba config ({getattr(config, '_name_or_path', '')})"
    if d_inner % n_v or n_v % n_qk:
        raise ConfigError(
            f"{where}: ssm_cfg n_v_heads={n_v}, n_qk_heads={n_qk}, d_inner={d_inner}; expected "
            "n_v_heads to divide d_inner and n_qk_heads to divide n_v_heads."
        )
    act = str(ssm.get("activation", "identity"))
    if act == "swish":
        act = "silu"
    if act not in CONV_ACTIVATIONS:
        raise ConfigError(
            f"{where}: ssm_cfg activation={act!r}; DiscreteMamba2 implements {list(CONV_ACTIVATIONS)}."
        )
    if bool(getattr(config, "lm_head_bias", False)):
        raise ConfigError(f"{where}: lm_head_bias=true; HookedSSM's unembedding has no bias.")
    eps = float(getattr(config, "norm_epsilon", BLOCK_EPS))
    if eps != BLOCK_EPS:
        raise ConfigError(
            f"{where}: norm_epsilon={eps}; HookedSSM uses one RMSNorm epsilon and Cartesia's "
            f"blocks use {BLOCK_EPS}, so only norm_epsilon={BLOCK_EPS} loads exactly."
        )
    d_mlp = int(mlp.get("intermediate_size", 0))
    if d_mlp < 1:
        raise ConfigError(f"{where}: mlp_cfg={mlp!r}; expected an intermediate_size >= 1.")
    n = int(config.num_hidden_layers)
    return dict(
        n_ctx=UNBOUNDED_CTX,
        layer_types=["ssm"] * n,
        mlp_types=["gated"] * n,
        n_heads=n_v,
        d_head=d_inner // n_v,
        d_inner=d_inner,
        d_state=int(ssm.get("d_state", 64)),
        d_conv=int(ssm.get("d_conv", 4)),
        n_groups=n_qk,
        chunk_size=int(ssm.get("chunk_size", 128)),
        eps=BLOCK_EPS,
        conv_bias=bool(ssm.get("conv_bias", True)),
        proj_bias=bool(ssm.get("bias", False)),
        conv_activation=act,
        mamba_norm="none",
        residual_in_fp32=False,
        d_mlp=d_mlp,
        mlp_bias=bool(mlp.get("bias", False)),
        gated_mlp=True,
        use_rope=False,
    )


def weight_renames(cfg: SSMConfig) -> Renames:
    """Cartesia's weight names -> HookedSSM's (the same for every config)."""
    return RENAMES


def config_dict(cfg: SSMConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A Llamba model's ``config.json`` in Cartesia's layout (the inverse of
    :func:`config_fields`)."""
    out: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "d_model": cfg.d_model,
        "n_layer": cfg.n_layers,
        "vocab_size": cfg.d_vocab,
        "pad_vocab_size_multiple": 8,
        "tie_embeddings": bool(cfg.tie_word_embeddings),
        "lm_head_bias": False,
        "norm_epsilon": cfg.eps,
        "resid_dropout": 0.0,
        "mlp_cfg": {"intermediate_size": cfg.d_mlp, "bias": cfg.mlp_bias, "act_fn": "silu"},
        "ssm_cfg": {
            "d_state": cfg.d_state,
            "n_v_heads": cfg.n_heads,
            "n_qk_heads": cfg.n_groups,
            "expand": 1,
            "d_inner": cfg.d_inner,
            "d_conv": cfg.d_conv,
            "chunk_size": cfg.chunk_size,
            "activation": cfg.conv_activation,
            "bias": cfg.proj_bias,
            "conv_bias": cfg.conv_bias,
        },
    }
    if cfg.d_vocab % 8:
        out["pad_vocab_size_multiple"] = 1
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def _cartesia_name(key: str) -> str:
    """HookedSSM's name of a Llamba weight -> Cartesia's.

    Raises:
        ConfigError: For a weight Cartesia's layout has no name for.
    """
    for pattern, repl in _BACK:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    raise ConfigError(f"{key!r} has no name in Cartesia's Llamba layout.")


def cartesia_state_dict(model: "HookedSSM") -> dict[str, torch.Tensor]:
    """``model``'s weights under Cartesia's names (on the host; the tied LM head left out)."""
    return {
        _cartesia_name(key): to_host(value).contiguous()
        for key, value in model.state_dict().items()
        if not (key == "unembed.weight" and model.cfg.tie_word_embeddings)
    }


def save(model: "HookedSSM", path: Path) -> None:
    """Write a Llamba ``model`` to the folder ``path`` in Cartesia's layout (``config.json``,
    ``model.safetensors``; the tokenizer's files beside them when it has any)."""
    from safetensors.torch import save_file

    kinds = list(model.cfg.layer_types)
    if any(k != "ssm" for k in kinds) or any(
        type(b.mixer) is not DiscreteMamba2Mixer for b in model.blocks if hasattr(b, "mixer")
    ):
        raise ConfigError(
            f"save_pretrained: this Llamba has layers that are not DiscreteMamba2 layers "
            f"(layer kinds {kinds}; e.g. attention swapped in by swap_layers), which Cartesia's "
            "layout cannot hold. Keep the swap as code (swap_layers on the saved Llamba and its "
            "teacher reproduces it), or save the unswapped model."
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(model.parameters())).dtype
    save_file(cartesia_state_dict(model), str(path / WEIGHTS[0]), metadata={"format": "pt"})
    text = json.dumps(config_dict(model.cfg, dtype), indent=2) + "\n"
    (path / "config.json").write_text(text, encoding="utf-8")
    if model.tokenizer is not None and hasattr(model.tokenizer, "save_pretrained"):
        model.tokenizer.save_pretrained(str(path))


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """The state dict of a Llamba folder and the files it came from.

    Raises:
        ConfigError: If the folder has none of :data:`WEIGHTS`.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if (path / WEIGHTS[0]).is_file():
        return load_file(str(path / WEIGHTS[0])), [path / WEIGHTS[0]]
    if (path / WEIGHTS[1]).is_file():
        index = json.loads((path / WEIGHTS[1]).read_text(encoding="utf-8"))
        files = sorted({path / f for f in index.get("weight_map", {}).values()})
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state, files
    if (path / WEIGHTS[2]).is_file():
        state = torch.load(path / WEIGHTS[2], map_location="cpu", weights_only=True)
        return dict(state), [path / WEIGHTS[2]]
    raise ConfigError(
        f"{path}: a Llamba config.json without weights; expected one of {list(WEIGHTS)} beside it."
    )


def tokenizer_name(name: str, config: Any = None) -> str:
    """The hub name of the Llama-3 tokenizer of the Llamba checkpoint ``name`` (its config's
    ``tokenizer`` / ``tokenizer_name`` field when it has one, else :data:`TOKENIZERS`, else
    :data:`DEFAULT_TOKENIZER`).

    Examples:
        >>> tokenizer_name("cartesia-ai/Llamba-3B")
        'meta-llama/Llama-3.2-3B'
    """
    for key in ("tokenizer", "tokenizer_name"):
        value = getattr(config, key, None) if config is not None else None
        if isinstance(value, str) and value:
            return value
    return TOKENIZERS.get(name, DEFAULT_TOKENIZER)


def _tokenizer(path: Path, config: Any, name: str) -> tuple[Any, str]:
    """The folder's tokenizer, else (where a hub answers) the Llama-3 tokenizer the checkpoint
    names; ``(tokenizer, where it came from)`` (``""``: the folder's or none)."""
    from transformers import AutoTokenizer

    from gna_lens.models.gguf import hub_reachable

    own = folder_tokenizer(path)
    if own is not None:
        return own, ""
    hub = tokenizer_name(name, config)
    try:
        return AutoTokenizer.from_pretrained(hub, local_files_only=not hub_reachable()), hub
    except (OSError, ValueError):
        return None, ""


def load(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: Any | None = None,
    name: str | None = None,
) -> Any:
    """Read a Llamba checkpoint folder (module docstring) into a HookedSSM (eval mode).

    Args:
        path: The folder (``config.json`` and weights).
        dtype: Weights dtype.
        device: Target device.
        tokenizer: A tokenizer to use instead of the folder's / the one the checkpoint names.
        name: The name it was asked for (a hub name picks its tokenizer from
            :data:`TOKENIZERS`); default the folder.

    Raises:
        ConfigError: If the config has an option HookedSSM does not implement, the weights are
            missing, or a weight is unknown or missing (the message names it).
    """
    from gna_lens.models.families import config_from_hf, convert_hf_state_dict
    from gna_lens.models.hooked_ssm import HookedSSM

    path = Path(path)
    config = read_config(path)
    cfg = config_from_hf(config)
    state, files = _read_weights(path)
    state = convert_hf_state_dict(cfg, state)
    source = ""
    if tokenizer is None:
        tokenizer, source = _tokenizer(path, config, name or str(path))
    cfg.dtype = dtype
    cfg.device = str(device)
    cfg.model_name = name or str(path)
    model = HookedSSM(cfg, tokenizer)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{path}: the Llamba weights do not match its config.json: missing "
            f"{sorted(_cartesia_name(k) for k in missing)}, unexpected "
            f"{sorted(_cartesia_name(k) for k in unexpected)} (Cartesia's names). Fix: the config's "
            "sizes and options (ssm_cfg bias / conv_bias, tie_embeddings) must be those the "
            "weights were saved with."
        )
    # What load_model's provenance reads: the files the weights came from, and where the
    # tokenizer came from when not from the folder.
    object.__setattr__(model, "gna_weights_files", [str(f) for f in files])
    object.__setattr__(model, "gna_tokenizer_source", source)
    return model.to(device=device, dtype=dtype).eval()


FAMILY = Family(
    model_type=MODEL_TYPE,
    architecture="llamba",
    hf_class=HF_CLASS,
    config_fields=config_fields,
    weight_renames=weight_renames,
    ssm_mixer=DiscreteMamba2Mixer,
    save=save,
    load=load,
    recognizes=is_llamba_config,
    checkpoint_format="cartesia",
    weights_files=WEIGHTS,
)
