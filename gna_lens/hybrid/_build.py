"""Building a student from its teacher (:func:`build_hybrid`), and reading the teacher."""

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gna_lens.errors import ConfigError
from gna_lens.hybrid._pairs import Head, head_pairs
from gna_lens.models.families import config_from_hf, gna_hybrid
from gna_lens.models.hooked_ssm import HookedSSM
from gna_lens.models.mixers.hybrid import HEAD_LAYOUTS, HybridMixer


def build_hybrid(
    teacher: Any,
    keep: Iterable[Head],
    *,
    d_state: int = 16,
    head_layout: str = "head",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    tokenizer: Any | None = None,
) -> HookedSSM:
    """A hybrid student of ``teacher`` that keeps the heads ``keep`` as attention.

    Every other head becomes an SSM head (``C <- q``, ``B <- k``, ``x <- v`` of that head; see
    :class:`~gna_lens.models.mixers.hybrid.HybridMixer`); embeddings, norms, MLPs, RoPE and the
    output projections are the teacher's. A student keeping every head computes the teacher's
    logits (to float rounding).

    Args:
        teacher: A ``TransformerBridge`` over a Llama-style Hugging Face model (its
            ``original_model``'s weights are read), a Hugging Face ``LlamaForCausalLM``, or the
            folder / hub name of one.
        keep: The teacher heads kept as attention, ``(layer, head)`` pairs (e.g. the top of a
            :class:`~gna_lens.GnaReport`); ``[]`` turns every head into an SSM head.
        d_state: State size ``N`` of the SSM heads (``C`` and ``B`` start from the first ``N``
            dimensions of the head's query and key, zero-padded beyond ``d_head``).
        head_layout: ``"head"`` (``B`` and ``C`` per SSM head) or ``"kv_group"`` (shared by
            the SSM heads of one teacher KV group).
        dtype: The student's dtype (default: the teacher's).
        device: The student's device (default: the teacher's).
        seed: Seed of the Mamba-2 initialization of the SSM heads' ``dt`` and ``A``.
        tokenizer: Its tokenizer (default: the bridge's, or the folder's).

    Returns:
        The student, a HookedSSM in eval mode (``model.cfg.attention_heads`` lists each layer's
        attention heads, ``model.cfg.teacher`` where it came from).

    Raises:
        ConfigError: For a teacher that is not Llama-style (the message names its
            ``model_type``), ``keep`` entries that are not heads of the teacher (the message
            names them and the range), ``d_state < 1`` or an unknown ``head_layout``.

    Examples:
        >>> import tempfile
        >>> from transformer_lens.model_bridge import TransformerBridge
        >>> from gna_lens import head_view
        >>> from gna_lens.testing import tiny_checkpoint
        >>> teacher = TransformerBridge.boot_transformers(str(tiny_checkpoint("llama", tempfile.mkdtemp())))
        >>> student = build_hybrid(teacher, [(1, 2)], d_state=8)
        >>> view = head_view(student)
        >>> view.kind(0), view.kind(1), view.kind_of((1, 2)), view.kind_of((1, 3))
        ('ssm', 'mixed', 'attention', 'ssm')
    """
    hf, tok, info = _teacher_model(teacher)
    tokenizer = tok if tokenizer is None else tokenizer
    fields = gna_hybrid.teacher_fields(hf.config, "build_hybrid")
    n_layers, H = int(fields["num_hidden_layers"]), int(fields["num_attention_heads"])
    kept = _check_keep(keep, n_layers, H)
    if isinstance(d_state, bool) or not isinstance(d_state, int) or d_state < 1:
        raise ConfigError(
            f"build_hybrid(d_state={d_state!r}): the SSM heads' state size must be an int >= 1 "
            f"(the teacher's head width is {fields['head_dim']}; the paper's students use 4 to 64)."
        )
    if head_layout not in HEAD_LAYOUTS:
        raise ConfigError(
            f"build_hybrid(head_layout={head_layout!r}); expected one of {list(HEAD_LAYOUTS)}: "
            "B and C per SSM head, or shared by the SSM heads of one teacher KV group."
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"build_hybrid(dtype={dtype!r}); expected a torch.dtype or None.")
    attention = [sorted(h for layer, h in kept if layer == i) for i in range(n_layers)]
    student_json = gna_hybrid.student_config(fields, attention, d_state, head_layout, info)
    student_json["_name_or_path"] = f"hybrid of {info.get('name') or 'a Llama teacher'}"
    from types import SimpleNamespace

    cfg = config_from_hf(SimpleNamespace(**student_json))
    weights = _hf_weights(hf)
    first = next(iter(hf.parameters()))
    cfg.dtype = dtype or first.dtype
    cfg.device = str(device or first.device)
    model = HookedSSM(cfg, tokenizer)
    model.load_state_dict(_student_state(model, weights, n_layers), strict=False)
    generator = torch.Generator().manual_seed(seed)
    for layer, block in enumerate(model.blocks):
        mixer: HybridMixer = block.mixer  # type: ignore[assignment]
        mixer.init_from_attention(layer_weights(weights, layer, "self_attn."), generator)
    return model.to(device=cfg.device, dtype=cfg.dtype).eval()


def _teacher_model(teacher: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(the Hugging Face model, its tokenizer, what to record of it) of a build_hybrid teacher."""
    from gna_lens.models.provenance import provenance_of

    hf, name = hf_model(teacher, "build_hybrid")
    if isinstance(teacher, str | Path):
        from transformers import AutoTokenizer

        from gna_lens.models.loading import resolve_name

        try:
            tok = AutoTokenizer.from_pretrained(resolve_name(str(teacher)))
        except (OSError, ValueError):
            tok = None
    else:
        tok = getattr(teacher, "tokenizer", None)
    info: dict[str, Any] = {"name": name, "class": type(hf).__name__}
    info["model_type"] = str(getattr(hf.config, "model_type", ""))
    prov = provenance_of(teacher)
    if prov.known:
        info["provenance"] = prov.describe()
    return hf, tok, info


def hf_model(teacher: Any, call: str) -> tuple[Any, str]:
    """The Hugging Face model of a teacher (a folder or hub name loaded; a bridge's
    ``original_model``) and its name; ``call`` names the function in errors."""
    accepts = (
        "a checkpoint folder of a Llama-style model (or a hub name where a hub is reachable), a "
        "LlamaForCausalLM or a TransformerBridge over one"
    )
    if isinstance(teacher, str | Path):
        from transformers import AutoModelForCausalLM

        from gna_lens.models.loading import resolve_name

        try:
            hf = AutoModelForCausalLM.from_pretrained(resolve_name(str(teacher)))
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{call}(teacher={str(teacher)!r}): could not load it as a Hugging Face causal LM "
                f"({err.__class__.__name__}: {err}). Pass {accepts}."
            ) from err
        return hf, str(teacher)
    hf = getattr(teacher, "original_model", None) or teacher
    if not hasattr(hf, "config") or not hasattr(hf, "state_dict"):
        raise ConfigError(f"{call}(teacher={type(teacher).__name__}); expected {accepts}.")
    cfg = getattr(teacher, "cfg", None)
    return hf, str(getattr(cfg, "model_name", "") or getattr(hf.config, "_name_or_path", "") or "")


def check_twin(twin: HookedSSM, call: str) -> None:
    """Refuse a HookedSSM teacher that is not a teacher twin (a hybrid student of
    :func:`build_hybrid` keeping every head as attention)."""
    cfg: Any = twin.cfg
    heads = getattr(cfg, "attention_heads", None)
    if cfg.architecture != "gna_hybrid" or heads is None:
        raise ConfigError(
            f"{call}(teacher=HookedSSM of {cfg.architecture!r}): a HookedSSM teacher must be "
            "a teacher twin (gna_lens.hybrid.build_hybrid(teacher, every head)). Fix: pass the "
            "Llama-style Transformer itself (a LlamaForCausalLM, a TransformerBridge over one, or "
            "its folder)."
        )
    ssm = {layer: cfg.n_heads - len(h) for layer, h in enumerate(heads) if len(h) != cfg.n_heads}
    if ssm:
        raise ConfigError(
            f"{call}(teacher=HookedSSM): this hybrid student has SSM heads ({ssm} per "
            "layer), so it is not a teacher twin (every head kept as attention). Fix: pass the "
            "Transformer teacher itself, or build_hybrid(teacher, every head)."
        )


def _check_keep(keep: Any, n_layers: int, n_heads: int) -> list[Head]:
    """Validate ``keep``: ``(layer, head)`` pairs of the teacher."""
    where = f"the teacher has {n_layers} layers (0..{n_layers - 1}) of {n_heads} heads (0..{n_heads - 1})"
    pairs = head_pairs(keep, "build_hybrid(keep", where)
    for layer, head in pairs:
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise ConfigError(
                f"build_hybrid(keep=...) contains ({layer}, {head}), which is not a head of the "
                f"teacher: {where}."
            )
    return sorted(set(pairs))


def _hf_weights(hf: Any) -> dict[str, Tensor]:
    """The teacher's weights under Hugging Face Llama names (a bridge's wrappers removed)."""
    out: dict[str, Tensor] = {}
    for key, value in hf.state_dict().items():
        out.setdefault(
            key.replace("._original_component", "").replace("_original_component.", ""), value
        )
    return out


def layer_weights(weights: Mapping[str, Tensor], layer: int, prefix: str) -> dict[str, Tensor]:
    """The weights of ``model.layers.{layer}.{prefix}`` with that prefix taken off."""
    start = f"model.layers.{layer}.{prefix}"
    return {k[len(start) :]: v for k, v in weights.items() if k.startswith(start)}


def _student_state(model: HookedSSM, w: dict[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """Embeddings, norms and MLPs of the teacher under the student's names."""
    state = {
        "embed.weight": w["model.embed_tokens.weight"],
        "ln_final.weight": w["model.norm.weight"],
    }
    if not model.cfg.tie_word_embeddings:
        state["unembed.weight"] = w["lm_head.weight"]
    for layer in range(n_layers):
        src, dst = f"model.layers.{layer}.", f"blocks.{layer}."
        state[dst + "ln1.weight"] = w[src + "input_layernorm.weight"]
        state[dst + "ln2.weight"] = w[src + "post_attention_layernorm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for p in ("weight", "bias") if model.cfg.mlp_bias else ("weight",):
                state[f"{dst}mlp.{proj}.{p}"] = w[f"{src}mlp.{proj}.{p}"]
    # the mixers are built from the teacher's attention; a tied unembedding is the embedding
    mixers = {k for k in model.state_dict() if ".mixer." in k} | {"unembed.weight"}
    missing = sorted(set(model.state_dict()) - set(state) - mixers)
    if missing:
        raise ConfigError(f"build_hybrid: no teacher weights for {missing[:5]} ...")
    return {k: v.detach().to(model.embed.weight.dtype) for k, v in state.items()}
