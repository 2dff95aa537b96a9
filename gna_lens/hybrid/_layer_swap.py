"""Put a teacher's attention layers back into its student: :func:`swap_layers`; or single heads:
:func:`swap_teacher_heads`."""

import copy
import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from gna_lens.errors import ConfigError
from gna_lens.hybrid._build import _hf_weights, check_twin, hf_model, layer_weights
from gna_lens.hybrid._pairs import Head, by_layer, check_listed, head_pairs
from gna_lens.models.block import SSMBlock
from gna_lens.models.config import SSMConfig
from gna_lens.models.families import family_of, gna_hybrid
from gna_lens.models.hooked_ssm import HookedSSM
from gna_lens.models.mixers import GatedMLP, RMSNorm
from gna_lens.models.mixers.hybrid import HybridMixer

__all__ = ["PARTS", "swap_layers", "swap_teacher_heads"]

#: What :func:`swap_layers` takes from the teacher (``part=``).
PARTS = ("mixer", "block")


@dataclass(frozen=True)
class _Teacher:
    """A Llama-style teacher, read once: its name, its Llama fields (``teacher_fields``) and its
    weights under Hugging Face Llama names (``model.layers.{l}.self_attn.q_proj.weight``, ...)."""

    name: str
    fields: dict[str, Any]
    weights: Mapping[str, Tensor]

    @property
    def attention(self) -> dict[str, Any]:
        """The attention and RoPE fields under HookedSSM's config names (as
        :func:`~gna_lens.models.families.gna_hybrid.config_fields` writes a student's)."""
        f, rope = self.fields, dict(self.fields["rope_parameters"])
        return {
            "n_attn_heads": int(f["num_attention_heads"]),
            "n_attn_kv_heads": int(f["num_key_value_heads"]),
            "attn_d_head": int(f["head_dim"]),
            "attn_bias": bool(f["attention_bias"]),
            "key_multiplier": 1.0,
            "use_rope": True,
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "rotary_dim": int(f["head_dim"]),
            "rope_scaling": {} if rope.get("rope_type", "default") == "default" else rope,
        }

    def layer(self, layer: int, prefix: str) -> dict[str, Tensor]:
        """The weights of ``model.layers.{layer}.{prefix}`` with that prefix taken off."""
        return layer_weights(self.weights, layer, prefix)


# ----------------------------------------------------------------------------- the teacher
def _read_teacher(teacher: Any, call: str = "swap_layers") -> _Teacher:
    """The :class:`_Teacher` of a teacher (``call``: the function to name in errors)."""
    if isinstance(teacher, HookedSSM):
        return _twin_teacher(teacher, call)
    hf, name = hf_model(teacher, call)
    fields = gna_hybrid.teacher_fields(hf.config, call)
    return _Teacher(name or type(hf).__name__, fields, _hf_weights(hf))


#: A teacher twin's weight names -> Hugging Face Llama's (the first match renames).
_TWIN_NAMES = (
    (r"^blocks\.(\d+)\.ln1\.", r"model.layers.\1.input_layernorm."),
    (r"^blocks\.(\d+)\.ln2\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blocks\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
    (r"^blocks\.(\d+)\.mixer\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blocks\.(\d+)\.mixer\.([qkv]_proj)\.", r"model.layers.\1.self_attn.\2."),
)


def _twin_teacher(twin: HookedSSM, call: str = "swap_layers") -> _Teacher:
    """A teacher given as its twin: a hybrid student keeping every head as attention."""
    check_twin(twin, call)
    cfg: Any = twin.cfg
    config = gna_hybrid._config_dict(cfg, next(iter(twin.parameters())).dtype)
    config["model_type"] = "llama"
    fields = gna_hybrid.teacher_fields(SimpleNamespace(**config), call)
    weights: dict[str, Tensor] = {}
    for key, value in twin.state_dict().items():
        for pattern, repl in _TWIN_NAMES:
            new, n = re.subn(pattern, repl, key)
            if n:
                weights[new] = value
                break
    name = str((cfg.teacher or {}).get("name") or cfg.model_name or "a teacher twin")
    return _Teacher(name, fields, weights)


# ----------------------------------------------------------------------------- checks
def _check_layers(student: HookedSSM, layers: Any) -> list[int]:
    """``layers`` (an int or a list), distinct layers of the student that have a mixer, sorted."""
    cfg, n_layers = student.cfg, student.cfg.n_layers
    where = f"the student and the teacher have {n_layers} layers (0..{n_layers - 1})"
    items = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise ConfigError(
            f"swap_layers(layers={layers!r}); expected a layer index or a list of them "
            f"({where}), e.g. layers=[1]."
        )
    items = list(items)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(
                f"swap_layers(layers={layers!r}) contains {item!r} "
                f"({type(item).__name__}); expected int layer indices ({where})."
            )
    check_listed(
        items, f"swap_layers(layers={layers!r}", "layer", where, lambda i: 0 <= i < n_layers
    )
    for layer in sorted(items):
        if not student.blocks[layer].has_mixer:
            raise ConfigError(
                f"swap_layers(layers={sorted(items)}): layer {layer} of the student is an MLP-only "
                f"block (layer_types[{layer}]={cfg.layer_types[layer]!r}), with no sequence mixer "
                "to swap for the teacher's attention."
            )
    return sorted(items)


def _check_student(student: Any, call: str) -> None:
    if not isinstance(student, HookedSSM):
        raise ConfigError(
            f"{call}(student={type(student).__name__}); expected a HookedSSM (a hybrid student "
            "of build_hybrid, or a model loaded with gna_lens.load_model)."
        )


def _check_pair(student: HookedSSM, teacher: _Teacher, call: str = "swap_layers") -> None:
    """The student's layers line up with the teacher's."""
    cfg = student.cfg
    shape = int(teacher.fields["num_hidden_layers"]), int(teacher.fields["hidden_size"])
    mine = f"n_layers={cfg.n_layers}, d_model={cfg.d_model}"
    theirs = f"num_hidden_layers={shape[0]}, hidden_size={shape[1]}"
    if (cfg.n_layers, cfg.d_model) != shape:
        raise ConfigError(
            f"{call}: the student ({cfg.architecture}, {mine}) and the teacher "
            f"({teacher.name}, {theirs}) do not align; a layer swap needs the same number of "
            "layers and the same width. Fix: pass the teacher the student was distilled from."
        )
    if family_of(cfg.architecture).build_blocks is not None:
        raise ConfigError(
            f"{call}: a {cfg.architecture} student assembles its blocks its own way (shared "
            "blocks); layer and head swaps need one block per layer (Mamba-2, Llamba, the hybrid "
            "students, Bamba, ...)."
        )
    if cfg.residual_multiplier != 1.0:
        raise ConfigError(
            f"{call}: the student scales each block's output by residual_multiplier="
            f"{cfg.residual_multiplier} (Granite), which would scale the teacher's layers too; "
            f"{call} takes students whose blocks add their outputs unscaled."
        )


def _mismatches(cfg: SSMConfig, want: dict[str, Any]) -> list[str]:
    return [
        f"{k}={getattr(cfg, k)!r} (teacher: {v!r})" for k, v in want.items() if getattr(cfg, k) != v
    ]


# ----------------------------------------------------------------------------- swapping
def _check_hybrid(cfg: SSMConfig, teacher: _Teacher, part: str, call: str) -> None:
    """A hybrid student's heads (``part="block"``: and norms and MLPs) have the teacher's shape."""
    f, a = teacher.fields, teacher.attention
    want: dict[str, Any] = {
        "n_heads": a["n_attn_heads"],
        "n_attn_kv_heads": a["n_attn_kv_heads"],
        "d_head": a["attn_d_head"],
        **{k: a[k] for k in ("attn_bias", "rope_theta", "rope_scaling")},
    }
    if part == "block":
        want |= {
            "eps": float(f["rms_norm_eps"]),
            "d_mlp": int(f["intermediate_size"]),
            "mlp_bias": bool(f["mlp_bias"]),
        }
    bad = _mismatches(cfg, want)
    if bad:
        raise ConfigError(
            f"{call}: this hybrid student's layers differ from the teacher's ({teacher.name}): "
            f"{', '.join(bad)}. Fix: pass the teacher it was built from."
        )


#: A block's norms and MLP, and the teacher's names of them.
_BLOCK_PARTS = (("ln1", "input_layernorm."), ("ln2", "post_attention_layernorm."), ("mlp", "mlp."))


def _hybrid_swap(model: HookedSSM, teacher: _Teacher, layers: list[int], part: str) -> None:
    """A hybrid student's layers become the teacher twin's: a :class:`HybridMixer` keeping
    every head as attention (``part="block"``: and the teacher's norms and MLP)."""
    cfg: Any = model.cfg
    H = teacher.attention["n_attn_heads"]
    _check_hybrid(cfg, teacher, part, "swap_layers")
    device, dtype = model.embed.weight.device, model.embed.weight.dtype
    for layer in layers:
        block: Any = model.blocks[layer]
        mixer = HybridMixer(cfg, list(range(H))).to(device=device, dtype=dtype)
        mixer.init_from_attention(teacher.layer(layer, "self_attn."))
        block.mixer = mixer
        cfg.attention_heads[layer] = list(range(H))
        for name, prefix in _BLOCK_PARTS if part == "block" else ():
            getattr(block, name).load_state_dict(teacher.layer(layer, prefix))


def _attention_fields(model: HookedSSM, teacher: _Teacher, call: str = "swap_layers") -> None:
    """Give ``model``'s config (a copy) the teacher's attention and RoPE fields; refuse when its
    own attention layers have others."""
    cfg, want = model.cfg, teacher.attention
    d = want["attn_d_head"]
    if cfg.is_hybrid or any(m.uses_rope for m in model.ssm_mixers().values()):  # own attention
        bad = _mismatches(cfg, want)
        if cfg.attn_scale not in (0.0, d**-0.5):
            bad.append(f"attn_scale={cfg.attn_scale!r} (teacher: {d**-0.5!r})")
        if bad:
            raise ConfigError(
                f"{call}: the student's own attention layers ({cfg.architecture}) differ "
                f"from the teacher's ({teacher.name}): {', '.join(bad)}; one model config holds "
                "one attention shape. Fix: pass the teacher the student was distilled from."
            )
        return
    for key, value in want.items():
        setattr(cfg, key, value)
    cfg.attn_scale = 0.0


def _new_block(model: HookedSSM, teacher: _Teacher, layer: int, part: str, old: Any) -> SSMBlock:
    """An attention block for ``layer`` with the teacher's attention (``part="mixer"``: the old
    block's norms and MLP; ``"block"``: the teacher's)."""
    cfg = model.cfg
    device, dtype = model.embed.weight.device, model.embed.weight.dtype
    with torch.device("meta"):  # every parameter is replaced or loaded below
        block = SSMBlock(cfg, layer)
    block.attn = _loaded(block.attn, teacher.layer(layer, "self_attn."), device, dtype)
    if part == "mixer":
        block.ln1 = old.ln1
        if block.has_mlp:
            block.ln2, block.mlp = old.ln2, old.mlp
        return block
    f = teacher.fields
    eps = float(f["rms_norm_eps"])
    mlp_cfg = copy.copy(cfg)  # the teacher's MLP, whatever the student's MLPs are
    mlp_cfg.d_mlp, mlp_cfg.mlp_bias = int(f["intermediate_size"]), bool(f["mlp_bias"])
    mlp_cfg.mlp_multipliers = (1.0, 1.0)
    with torch.device("meta"):
        parts = RMSNorm(cfg.d_model, eps), RMSNorm(cfg.d_model, eps), GatedMLP(mlp_cfg)
    for (name, prefix), module in zip(_BLOCK_PARTS, parts, strict=True):
        setattr(block, name, _loaded(module, teacher.layer(layer, prefix), device, dtype))
    return block


def _loaded(
    module: nn.Module, state: Mapping[str, Tensor], device: torch.device, dtype: torch.dtype
) -> Any:
    """``module`` (built on the meta device) on ``device`` in ``dtype`` with ``state`` loaded."""
    module = module.to_empty(device=device).to(dtype)
    module.load_state_dict(dict(state), strict=True)
    return module


def _ensure_rope(model: HookedSSM) -> None:
    """Register RoPE's frequencies on a copy that now has attention (heads) needing them."""
    cfg = model.cfg
    if "rope_inv_freq" not in model._buffers and model._uses_rope:
        from gna_lens.models import ops

        inv_freq = ops.rope_inv_freq(
            cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling, device=model.embed.weight.device
        )
        model.register_buffer("rope_inv_freq", inv_freq, persistent=False)


def _copy(student: HookedSSM) -> HookedSSM:
    """A deep copy of ``student`` sharing its tokenizer (deep-copying a tokenizer is slow and
    pointless: the memo maps it to itself)."""
    return copy.deepcopy(student, {id(student.tokenizer): student.tokenizer})


def _stamped(student: HookedSSM, model: HookedSSM, kind: str, record: dict[str, Any]) -> HookedSSM:
    """``model`` with its hook points registered and ``model.gna_{kind}`` = ``record`` (with the
    student's own record as ``"before"``; a hybrid student also keeps it in ``cfg.teacher``,
    saved with it), in eval mode."""
    model.setup()  # register the new modules' hook points
    before = getattr(student, f"gna_{kind}", None)
    if before:
        record["before"] = before
    setattr(model, f"gna_{kind}", record)
    cfg: Any = model.cfg
    if cfg.architecture == "gna_hybrid":
        cfg.teacher = {**cfg.teacher, kind: record}
    return model.eval()


def _plain_swap(model: HookedSSM, teacher: _Teacher, layers: list[int], part: str) -> None:
    """Any other student's layers become attention layers (``blocks.{l}.attn``) with the
    teacher's weights."""
    cfg = model.cfg
    _attention_fields(model, teacher)
    if part == "block":
        cfg.mlp_types = [cfg.mlp_type(i) for i in range(cfg.n_layers)]
        if not cfg.d_mlp:
            cfg.d_mlp = int(teacher.fields["intermediate_size"])
    for layer in layers:
        old = model.blocks[layer]
        cfg.layer_types[layer] = "attention"
        if part == "block":
            cfg.mlp_types[layer] = "gated"
        model.blocks[layer] = _new_block(model, teacher, layer, part, old)
    _ensure_rope(model)
    # Mamba-1 channel groups of a swapped layer have no channels left to group
    model._head_groups = {k: v for k, v in model._head_groups.items() if k not in layers}


def swap_layers(
    student: HookedSSM, teacher: Any, layers: int | Iterable[int], *, part: str = "mixer"
) -> HookedSSM:
    """A copy of ``student`` whose ``layers`` are the teacher's attention layers again.

    The paper's layer-swap experiment in one call: replace layer 17 of Llamba-8B (a Llama-3.1-8B
    distilled into Mamba-2-style layers) by its teacher's attention layer and MMLU goes from 33%
    to 50%. Each chosen layer's sequence mixer becomes the teacher's attention layer at the same
    index, weights copied (RoPE, grouped-query heads, scale ``1 / sqrt(d_head)``);
    ``part="mixer"`` keeps the student's norms and MLP around it (the paper's experiment),
    ``part="block"`` takes the teacher's whole block (input norm, attention, post norm, MLP).

    In a hybrid student of :func:`~gna_lens.hybrid.build_hybrid` a swapped layer is the teacher
    twin's (a :class:`~gna_lens.models.mixers.hybrid.HybridMixer` keeping every head as
    attention: hooks ``blocks.{l}.mixer.*``, ``save_pretrained`` round-trips it); in any other
    student (Mamba-2, Llamba, Mamba-1, hybrids with attention of the teacher's shape) an
    attention layer (``cfg.layer_types[l] == "attention"``, hooks ``blocks.{l}.attn.*``), the
    copy's config taking the teacher's attention and RoPE fields. Either way
    :func:`~gna_lens.head_view` gives its heads kind ``"attention"``, addressed as ``(layer,
    head)`` in the teacher's numbering.

    Args:
        student: A HookedSSM whose layers line up with the teacher's (same number of layers
            and ``d_model``); it is not modified.
        teacher: A Hugging Face ``LlamaForCausalLM`` (Llama-style: RMSNorm, RoPE attention,
            SwiGLU MLP), a ``TransformerBridge`` over one, its checkpoint folder, or its teacher
            twin (:func:`~gna_lens.hybrid.build_hybrid` keeping every head); it is not modified.
        layers: A layer index or a list of them (each once).
        part: ``"mixer"`` (the teacher's attention only) or ``"block"`` (its whole block).

    Returns:
        The new HookedSSM (eval mode, the student's dtype and device, sharing its tokenizer);
        ``model.gna_layer_swap`` says what was swapped: ``{"layers": [...], "part": ...,
        "teacher": name}`` (with ``"before"``: the student's own record, when it had one).

    Raises:
        ConfigError: For layers out of range, repeated or not ints; an unknown ``part``; a
            teacher that is not Llama-style; a student whose shape (layers, ``d_model``) or own
            attention layers differ from the teacher's, or whose chosen layer has no mixer.
            The message names what was passed.

    Examples:
        >>> import torch
        >>> from gna_lens import head_view
        >>> from gna_lens.hybrid import build_hybrid
        >>> from gna_lens.testing import tiny_hf_model
        >>> teacher = tiny_hf_model("llama")
        >>> student = build_hybrid(teacher, [])  # every head an SSM head
        >>> swapped = swap_layers(student, teacher, [1])
        >>> head_view(swapped).kind(1), head_view(student).kind(1), swapped.gna_layer_swap["layers"]
        ('attention', 'ssm', [1])
        >>> everything = swap_layers(student, teacher, [0, 1])
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> with torch.no_grad():
        ...     bool(torch.allclose(everything(ids), teacher(ids).logits, atol=1e-4))
        True
    """
    _check_student(student, "swap_layers")
    if part not in PARTS:
        raise ConfigError(
            f"swap_layers(part={part!r}); expected 'mixer' (the teacher's attention, the "
            "student's norms and MLP) or 'block' (the teacher's whole block)."
        )
    source = _read_teacher(teacher)
    _check_pair(student, source)
    chosen = _check_layers(student, layers)
    model = _copy(student)
    with torch.no_grad():
        swap = _hybrid_swap if model.cfg.architecture == "gna_hybrid" else _plain_swap
        swap(model, source, chosen, part)
    record = {"layers": chosen, "part": part, "teacher": source.name}
    return _stamped(student, model, "layer_swap", record)


# ----------------------------------------------------------------------------- head swaps
def _check_heads(student: HookedSSM, heads: Any) -> dict[int, list[int]]:
    """``heads`` (distinct SSM heads of the student) per layer, sorted."""
    cfg = student.cfg
    n, H = cfg.n_layers, cfg.n_heads
    where = f"the student has {n} layers of {H} heads: layers 0..{n - 1}, heads 0..{H - 1}"
    items = head_pairs(heads, "swap_teacher_heads(heads", where)
    check_listed(
        items, f"swap_teacher_heads(heads={heads!r}", "head", where,
        lambda p: 0 <= p[0] < n and 0 <= p[1] < H,
    )  # fmt: skip
    not_mixer = sorted({layer for layer, _ in items if not student.blocks[layer].has_mixer})
    not_mixer += sorted({layer for layer, _ in items if student.blocks[layer].is_attention})
    if not_mixer:
        kinds = {layer: cfg.layer_types[layer] for layer in sorted(not_mixer)}
        raise ConfigError(
            f"swap_teacher_heads(heads=...): layers {sorted(not_mixer)} have no SSM heads (layer "
            f"kinds {kinds}); list heads of the student's SSM layers."
        )
    blocks: Any = student.blocks
    attention = [
        (layer, h)
        for layer, h in items
        if (blocks[layer].mixer.head_kinds or ("ssm",) * H)[h] == "attention"
    ]
    if attention:
        raise ConfigError(
            f"swap_teacher_heads(heads=...): {attention} are attention heads already (head_view "
            "kind 'attention'); list only SSM heads."
        )
    return by_layer(items)


def _check_mixers_for_heads(model: HookedSSM, per_layer: dict[int, list[int]]) -> None:
    """Each chosen layer's mixer is one whose heads the teacher's can replace."""
    from gna_lens.models.mixers import Mamba2Mixer

    for layer in per_layer:
        block: Any = model.blocks[layer]
        mixer = block.mixer
        if isinstance(mixer, HybridMixer):
            continue
        name = type(mixer).__name__
        if not isinstance(mixer, Mamba2Mixer) or block.has_parallel_attn:
            raise ConfigError(
                f"swap_teacher_heads: layer {layer} of the student is a {name}"
                f"{' beside a parallel attention' if block.has_parallel_attn else ''}; teacher "
                "head swaps need Mamba-2-style heads added straight to the residual stream "
                "(Mamba-2, Llamba, Bamba's SSM layers) or a hybrid student of build_hybrid. "
                "Fix: swap the whole layer with swap_layers."
            )
        if mixer.head_kinds is not None:
            kept = [h for h, kind in enumerate(mixer.head_kinds) if kind == "attention"]
            raise ConfigError(
                f"swap_teacher_heads: layer {layer} already has attention heads {kept} ({name}, "
                "from swap_heads or an earlier swap_teacher_heads); swap every head of a layer "
                "in one call, on the student before any head swap."
            )


def _check_head_shapes(model: HookedSSM, teacher: _Teacher) -> None:
    """A Mamba-2-style student's heads line up with the teacher's heads."""
    cfg = model.cfg
    H, d = teacher.attention["n_attn_heads"], teacher.attention["attn_d_head"]
    if (cfg.n_heads, cfg.d_head, cfg.d_inner) != (H, d, H * d):
        raise ConfigError(
            f"swap_teacher_heads: the student's heads ({cfg.architecture}: n_heads={cfg.n_heads}, "
            f"d_head={cfg.d_head}, d_inner={cfg.d_inner}) do not line up with the teacher's "
            f"({teacher.name}: num_attention_heads={H}, head_dim={d}, {H * d} channels); a head "
            "swap puts the teacher's head h where the student's head h was, so it needs the same "
            "heads of the same width. Fix: pass the teacher the student was distilled from, or "
            "swap whole layers with swap_layers."
        )


def _rows(t: Tensor, blocks: list[int], width: int) -> Tensor:
    """Rows ``[i * width, (i + 1) * width)`` of ``t`` for each ``i`` of ``blocks``, in order."""
    if not blocks:
        return t[:0]
    return torch.cat([t[i * width : (i + 1) * width] for i in blocks])


def _hybrid_head_swap(
    model: HookedSSM, teacher: _Teacher, layer: int, new: list[int]
) -> HybridMixer:
    """Layer ``layer``'s :class:`HybridMixer` with the heads ``new`` made the teacher's attention
    heads (query and key / value rows, ``o_proj`` columns); every other parameter the student's."""
    cfg: Any = model.cfg
    d, N = cfg.d_head, cfg.d_state
    old: Any = model.blocks[layer].mixer
    first = old.out_proj.weight
    weights = {
        k: v.to(device=first.device, dtype=first.dtype)
        for k, v in teacher.layer(layer, "self_attn.").items()
    }
    mixer = HybridMixer(cfg, sorted(old.attn_heads + new))
    params = ("weight", "bias") if cfg.attn_bias else ("weight",)

    def rows(name: str, p: str, place: int, block: int, own: list[int]) -> Tensor:
        """Row block ``place`` of ``{name}.{p}``: the student's (its block ``own.index(place)``)
        where it has it, else the teacher's (block ``place``)."""
        if place in own:
            return _rows(getattr(getattr(old, name), p), [own.index(place)], block)
        return _rows(weights[f"{name}.{p}"], [place], block)

    # a KV head that the student's own attention heads read keeps the student's weights; the
    # swapped heads reading it must then find the teacher's there
    per_kv = cfg.n_heads // cfg.n_attn_kv_heads
    for g in (g for g in mixer.kv_heads if g in old.kv_heads):
        readers = [h for h in new if h // per_kv == g]
        same = all(
            torch.equal(
                rows(f"{x}_proj", p, g, d, old.kv_heads), _rows(weights[f"{x}_proj.{p}"], [g], d)
            )
            for x in ("k", "v")
            for p in params
        )
        if readers and not same:
            owners = [h for h in old.attn_heads if h // per_kv == g]
            raise ConfigError(
                f"swap_teacher_heads: heads {[(layer, h) for h in readers]} read the teacher's KV "
                f"head {g}, which this student's own attention heads {owners} of layer {layer} "
                "read with key / value weights that are no longer the teacher's (trained); one "
                "KV head has one set of weights. Fix: swap the whole layer (swap_layers), or "
                "swap heads of a student whose attention was not trained."
            )
    state: dict[str, Tensor] = {}
    for p in params:
        state[f"q_proj.{p}"] = torch.cat(
            [rows("q_proj", p, h, d, old.attn_heads) for h in mixer.attn_heads]
        )
        for x in ("k_proj", "v_proj"):
            state[f"{x}.{p}"] = torch.cat([rows(x, p, g, d, old.kv_heads) for g in mixer.kv_heads])
    if mixer.ssm_heads:  # the remaining SSM heads' rows (and groups') of the student
        ssm = [old.ssm_heads.index(h) for h in mixer.ssm_heads]
        groups = [old.ssm_groups.index(g) for g in mixer.ssm_groups]
        groups = ssm if mixer.layout == "head" else groups
        picks = (("c_proj", groups, N), ("b_proj", groups, N), ("x_proj", ssm, d))
        for (name, blocks, width), p in itertools.product(picks, params):
            state[f"{name}.{p}"] = _rows(getattr(getattr(old, name), p), blocks, width)
        for name in ("dt_proj.weight", "dt_bias", "A_log", "D"):
            state[name] = _rows(old.get_parameter(name), ssm, 1)
    state["out_proj.weight"] = out_w = old.out_proj.weight.clone()
    for h in new:  # the swapped heads' output columns are the teacher's
        out_w[:, h * d : (h + 1) * d] = weights["o_proj.weight"][:, h * d : (h + 1) * d]
    if old.out_proj.bias is not None:
        state["out_proj.bias"] = old.out_proj.bias
    mixer = mixer.to(device=first.device, dtype=first.dtype)
    mixer.load_state_dict(state, strict=True)
    return mixer


def swap_teacher_heads(student: HookedSSM, teacher: Any, heads: Iterable[Head]) -> HookedSSM:
    """A copy of ``student`` in which each chosen SSM head is its teacher's attention head again.

    The head-level counterpart of :func:`swap_layers`: SSM head ``h`` of layer ``l`` is replaced
    by the teacher's attention head ``h`` of layer ``l``, weights copied (its query rows, the
    key / value rows of the KV head it reads, RoPE, scale ``1 / sqrt(d_head)``, and its
    ``o_proj`` columns, which replace the student's output columns of that head); every other
    head is untouched. Swapping every head of every layer of a student that has the teacher's
    embeddings, norms and MLPs gives the teacher back.

    In a hybrid student of :func:`~gna_lens.hybrid.build_hybrid` a swapped head joins its
    layer's attention heads (``cfg.attention_heads[l]``; the student saves and loads as before);
    in a Mamba-2-style student whose heads are the teacher's (Llamba, Mamba-2: ``n_heads`` heads
    of the teacher's ``head_dim``) the layer becomes a
    :class:`~gna_lens.models.mixers.teacher_heads.TeacherHeadsMixer` (such a model does not
    save). Either way :func:`~gna_lens.head_view` gives the swapped heads kind
    ``"attention"``, ``hook_pattern`` holds their softmax pattern (editable), ``hook_z`` their
    output, and ``prefix_state`` / ``step`` run them.

    Args:
        student: A HookedSSM whose layers line up with the teacher's (same number of layers and
            ``d_model``, heads as above); it is not modified.
        teacher: As for :func:`swap_layers`; it is not modified.
        heads: ``(layer, head)`` pairs of SSM heads, each once.

    Returns:
        The new HookedSSM, as :func:`swap_layers`'s; ``model.gna_head_swap`` is ``{"heads":
        [[l, h], ...], "teacher": name}``.

    Raises:
        ConfigError: For heads that are out of range, repeated, not pairs of ints, or already
            attention heads; a teacher that is not Llama-style; a student whose shape (layers,
            ``d_model``, heads, head width) differs from the teacher's, whose chosen layer has
            no Mamba-2-style mixer, or already has heads swapped. The message names what was
            passed.

    Examples:
        >>> import torch
        >>> from gna_lens import head_view
        >>> from gna_lens.hybrid import build_hybrid
        >>> from gna_lens.testing import tiny_hf_model
        >>> teacher = tiny_hf_model("llama")
        >>> student = build_hybrid(teacher, [])  # every head an SSM head
        >>> swapped = swap_teacher_heads(student, teacher, [(1, 2)])
        >>> head_view(swapped).kind_of((1, 2)), head_view(swapped).kind(1), swapped.gna_head_swap["heads"]
        ('attention', 'mixed', [[1, 2]])
        >>> everything = swap_teacher_heads(student, teacher, [(l, h) for l in range(2) for h in range(4)])
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> with torch.no_grad():
        ...     bool(torch.allclose(everything(ids), teacher(ids).logits, atol=1e-4))
        True
    """
    from gna_lens.models.mixers.teacher_heads import TeacherHeadsMixer

    call = "swap_teacher_heads"
    _check_student(student, call)
    per_layer = _check_heads(student, heads)
    source = _read_teacher(teacher, call)
    _check_pair(student, source, call)
    _check_mixers_for_heads(student, per_layer)
    model = _copy(student)
    cfg: Any = model.cfg
    with torch.no_grad():
        if cfg.architecture == "gna_hybrid":
            _check_hybrid(cfg, source, "mixer", call)
            for layer, new in per_layer.items():
                block: Any = model.blocks[layer]
                block.mixer = _hybrid_head_swap(model, source, layer, new)
                cfg.attention_heads[layer] = list(block.mixer.attn_heads)
        else:
            _check_head_shapes(model, source)
            _attention_fields(model, source, call)
            for layer, new in per_layer.items():
                block = model.blocks[layer]
                weights = source.layer(layer, "self_attn.")
                block.mixer = TeacherHeadsMixer.from_mixer(block.mixer, new, weights)
            _ensure_rope(model)
    pairs = [[layer, h] for layer, hs in per_layer.items() for h in hs]
    return _stamped(student, model, "head_swap", {"heads": pairs, "teacher": source.name})
