"""The retrieval-guided hybrid students (``model_type="gna_lens_hybrid"``), built by
:func:`gna_lens.hybrid.build_hybrid` from a Llama-style Transformer.

Llama blocks (RMSNorm, a :class:`~gna_lens.models.mixers.hybrid.HybridMixer` whose heads are
each attention or SSM, RMSNorm, SwiGLU MLP), the teacher's embeddings, RoPE (theta and scaling)
and tied or untied unembedding. No ``transformers`` class reads these checkpoints: they are
gna_lens's own format, a folder with

- ``config.json``: the teacher's Llama fields (``hidden_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rope_parameters``, ...) plus ``attention_heads`` (per
  layer, the teacher heads kept as attention), ``ssm_d_state``, ``ssm_head_layout`` and
  ``teacher`` (name, class and provenance of the teacher);
- ``model.safetensors``: the weights under HookedSSM's own names (``blocks.{l}.mixer.q_proj``,
  ``c_proj``, ...; ``unembed.weight`` left out when tied);
- the tokenizer's files.

``HookedSSM.save_pretrained`` writes one; ``HookedSSM.from_pretrained`` and
:func:`gna_lens.load_model` read it back bit-identically.
"""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch

from gna_lens.device import to_host
from gna_lens.errors import ConfigError
from gna_lens.models import ops
from gna_lens.models.config import SSMConfig
from gna_lens.models.families.base import Family, Renames, folder_tokenizer
from gna_lens.models.mixers.hybrid import HEAD_LAYOUTS, HybridConfig, HybridMixer

if TYPE_CHECKING:
    from gna_lens.models.hooked_ssm import HookedSSM

__all__ = ["FAMILY", "MODEL_TYPE", "TEACHER_MODEL_TYPES", "load", "save", "student_config"]

MODEL_TYPE = "gna_lens_hybrid"
#: The ``architectures`` entry of a student's config.json (a gna_lens format, not a
#: ``transformers`` class).
HF_CLASS = "GnaLensHybridForCausalLM"
#: Teacher ``model_type``s a student can be built from (Llama-style: RMSNorm, RoPE attention
#: with grouped-query heads, SwiGLU MLP; Llama 2 / 3, SmolLM2, TinyLlama, ...).
TEACHER_MODEL_TYPES = ("llama",)
WEIGHTS = "model.safetensors"

#: The teacher config fields a student's config.json copies.
_LLAMA_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _rope_of(config: Any) -> dict[str, Any]:
    """The RoPE parameters of a Llama config (``rope_parameters``, or the older
    ``rope_theta`` / ``rope_scaling``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not rope:
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", float(getattr(config, "rope_theta", 10000.0)))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    return rope


def teacher_fields(config: Any, where: str) -> dict[str, Any]:
    """The Llama fields of a teacher config (the part of a student's config.json that describes
    the teacher's architecture).

    Raises:
        ConfigError: For a teacher that is not Llama-style, or a Llama option the student does
            not implement; the message names what was passed.
    """
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    if model_type not in TEACHER_MODEL_TYPES:
        raise ConfigError(
            f"{where}: the teacher has model_type={model_type!r} (architectures={archs}); "
            f"hybrid students are built from Llama-style teachers only (model_type in "
            f"{list(TEACHER_MODEL_TYPES)}: Llama 2 / 3, SmolLM2, TinyLlama, ...: RMSNorm, RoPE "
            "attention with grouped-query heads, SwiGLU MLP). Fix: pass a LlamaForCausalLM, a "
            "TransformerBridge over one, or its checkpoint folder."
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(
            f"{where}: the teacher's hidden_act={act!r}; the student's MLP is SwiGLU (silu)."
        )
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        raise ConfigError(f"{where}: pretraining_tp={config.pretraining_tp}; expected 1.")
    rope = _rope_of(config)
    if (
        rope["rope_type"] not in ops.ROPE_TYPES
        or float(rope.get("partial_rotary_factor", 1.0)) != 1.0
    ):
        raise ConfigError(
            f"{where}: the teacher's RoPE is {rope}; the student implements rope_type in "
            f"{list(ops.ROPE_TYPES)} over the whole head."
        )
    H = int(config.num_attention_heads)
    KV = int(getattr(config, "num_key_value_heads", None) or H)
    if H % KV:
        raise ConfigError(
            f"{where}: {H} query heads over {KV} KV heads; expected KV to divide them."
        )
    out = {k: getattr(config, k, None) for k in _LLAMA_FIELDS}
    out.update(
        num_key_value_heads=KV,
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // H),
        hidden_act="silu",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        rope_parameters=rope,
    )
    return out


def student_config(
    teacher: dict[str, Any],
    attention_heads: list[list[int]],
    d_state: int,
    head_layout: str,
    teacher_info: dict[str, Any],
) -> dict[str, Any]:
    """A student's config.json: the teacher's Llama fields (:func:`teacher_fields`) and the
    hybrid's own."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": [HF_CLASS],
        **teacher,
        "attention_heads": [sorted(int(h) for h in heads) for heads in attention_heads],
        "ssm_d_state": int(d_state),
        "ssm_head_layout": head_layout,
        "teacher": teacher_info,
    }


def config_fields(config: Any) -> dict[str, Any]:
    """The :class:`~gna_lens.models.mixers.hybrid.HybridConfig` fields of a student's config.

    Raises:
        ConfigError: For a malformed ``attention_heads``, ``ssm_d_state`` or layout.
    """
    n = int(config.num_hidden_layers)
    H = int(config.num_attention_heads)
    KV = int(config.num_key_value_heads)
    d = int(config.head_dim)
    heads = getattr(config, "attention_heads", None)
    if not isinstance(heads, list) or len(heads) != n:
        raise ConfigError(
            f"gna_lens hybrid config: attention_heads={heads!r}; expected one list of teacher "
            f"heads per layer ({n} layers)."
        )
    for layer, kept in enumerate(heads):
        if not isinstance(kept, list) or any(
            not isinstance(h, int) or not 0 <= h < H for h in kept
        ):
            raise ConfigError(
                f"gna_lens hybrid config: attention_heads[{layer}]={kept!r}; expected head "
                f"indices in 0..{H - 1}."
            )
    d_state = getattr(config, "ssm_d_state", None)
    if not isinstance(d_state, int) or isinstance(d_state, bool) or d_state < 1:
        raise ConfigError(f"gna_lens hybrid config: ssm_d_state={d_state!r}; expected an int >= 1.")
    layout = getattr(config, "ssm_head_layout", "head")
    if layout not in HEAD_LAYOUTS:
        raise ConfigError(
            f"gna_lens hybrid config: ssm_head_layout={layout!r}; expected one of {list(HEAD_LAYOUTS)}."
        )
    rope = dict(config.rope_parameters)
    theta = float(rope.get("rope_theta", 10000.0))
    return dict(
        n_ctx=int(getattr(config, "max_position_embeddings", 0) or 2048),
        layer_types=["ssm"] * n,
        mlp_types=["gated"] * n,
        n_heads=H,
        d_head=d,
        d_inner=H * d,
        d_state=d_state,
        n_groups=1,
        eps=float(config.rms_norm_eps),
        residual_in_fp32=False,
        n_attn_heads=H,
        n_attn_kv_heads=KV,
        n_key_value_heads=KV,
        attn_d_head=d,
        attn_bias=bool(config.attention_bias),
        rope_theta=theta,
        rotary_dim=d,
        rope_scaling={} if rope.get("rope_type", "default") == "default" else rope,
        d_mlp=int(config.intermediate_size),
        mlp_bias=bool(config.mlp_bias),
        gated_mlp=True,
        positional_embedding_type="rotary",
        attention_heads=[sorted(kept) for kept in heads],
        ssm_head_layout=layout,
        teacher=dict(getattr(config, "teacher", None) or {}),
    )


def weight_renames(cfg: SSMConfig) -> Renames:
    """The weights are stored under HookedSSM's own names."""
    return [(r"^(embed|blocks|ln_final|unembed)\.", r"\1.")]


def _config_dict(cfg: HybridConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A model's config.json (the inverse of :func:`config_fields`)."""
    rope = dict(cfg.rope_scaling) or {"rope_type": "default"}
    rope["rope_theta"] = cfg.rope_theta
    teacher = {
        "vocab_size": cfg.d_vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_mlp,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_attn_kv_heads,
        "head_dim": cfg.d_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attn_bias,
        "mlp_bias": cfg.mlp_bias,
        "pad_token_id": cfg.pad_token_id,
        "rope_parameters": rope,
    }
    out = student_config(
        teacher, cfg.attention_heads, cfg.d_state, cfg.ssm_head_layout, cfg.teacher
    )
    out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def save(model: "HookedSSM", path: Path) -> None:
    """Write ``model`` (a hybrid student) to the folder ``path`` (see the module docstring)."""
    dtype = next(iter(model.parameters())).dtype
    cfg = cast(HybridConfig, model.cfg)  # a hybrid student's config
    write_checkpoint(model, path, MODEL_TYPE, _config_dict(cfg, dtype), indent=2)


def write_checkpoint(
    model: "HookedSSM", path: Path, model_type: str, config: dict[str, Any], indent: int
) -> None:
    """gna_lens's own checkpoint of a HookedSSM in ``path``: ``model.safetensors`` (HookedSSM's
    parameter names, the tied unembedding left out), ``config.json`` and the tokenizer."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: to_host(v).contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("unembed.weight", None)
    save_file(state, str(path / WEIGHTS), metadata={"format": "pt", "gna_lens": model_type})
    (path / "config.json").write_text(json.dumps(config, indent=indent) + "\n", encoding="utf-8")
    if model.tokenizer is not None and hasattr(model.tokenizer, "save_pretrained"):
        model.tokenizer.save_pretrained(str(path))


def read_config(path: Path) -> SimpleNamespace:
    """A student's config.json as an object (attribute access, as a Hugging Face config)."""
    data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    data.setdefault("_name_or_path", str(path))
    return SimpleNamespace(**data)


def checkpoint_state(path: Path, kind: str) -> dict[str, torch.Tensor]:
    """The weights of a gna_lens checkpoint in ``path`` (``kind`` names it in the error).

    Raises:
        ConfigError: If the folder has no weights file.
    """
    from safetensors.torch import load_file

    weights = path / WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{path}: a gna_lens {kind} checkpoint without {WEIGHTS}.")
    return load_file(str(weights))


def read_checkpoint(
    path: Path,
    cfg: SSMConfig,
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    tokenizer: Any | None,
    prepare: Any = None,
) -> Any:
    """The HookedSSM of a checkpoint written by :func:`write_checkpoint`: built from ``cfg``
    (``prepare(model)`` then changes its modules, e.g. swapped heads), the weights ``state``
    loaded strictly, the folder's tokenizer unless one is given; in eval mode."""
    from gna_lens.models.hooked_ssm import HookedSSM

    if tokenizer is None:
        tokenizer = folder_tokenizer(path)
    cfg.dtype = dtype
    cfg.device = str(device)
    model = HookedSSM(cfg, tokenizer)
    if prepare is not None:
        prepare(model)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def load(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: Any | None = None,
) -> Any:
    """Read a student saved by :func:`save` into a HookedSSM (eval mode).

    Raises:
        ConfigError: If the folder has no weights file, or the config is malformed.
    """
    from gna_lens.models.families import config_from_hf, convert_hf_state_dict

    path = Path(path)
    cfg = config_from_hf(read_config(path))
    state = convert_hf_state_dict(cfg, checkpoint_state(path, "hybrid"))
    return read_checkpoint(path, cfg, state, dtype=dtype, device=device, tokenizer=tokenizer)


FAMILY = Family(
    model_type=MODEL_TYPE,
    architecture="gna_hybrid",
    hf_class=HF_CLASS,
    config_fields=config_fields,
    weight_renames=weight_renames,
    ssm_mixer=HybridMixer,
    config_class=HybridConfig,
    save=save,
    load=load,
)
