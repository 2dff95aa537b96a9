"""Layer-level interventions and the paper's layer-pruning protocols.

A layer is addressed by its index ``l`` on every model kind (TransformerBridge, HookedSSM, hybrids)
through TransformerLens hook names:

===========  ==================================================  ===============================
target       what is replaced                                    hooks
===========  ==================================================  ===============================
``block``    the block's contribution to the residual stream     ``blocks.{l}.hook_resid_pre``,
             (``resid_post - resid_pre``): ``"zero"`` makes the  ``blocks.{l}.hook_resid_post``
             block the identity (the layer is *removed*)
``mixer``    the whole token-mixing sublayer: the attention's    ``blocks.{l}.hook_attn_out``
             or the SSM mixer's output; on a two-part layer      and / or
             (Falcon-H1, Zamba2's hybrid layers) the outputs of  ``blocks.{l}.hook_mixer_out``
             both parts
``attn``     the attention part only                             ``blocks.{l}.hook_attn_out``
``ssm``      the SSM mixer part only                             ``blocks.{l}.hook_mixer_out``
``mlp``      the MLP's output, where the block has one           ``blocks.{l}.hook_mlp_out``
===========  ==================================================  ===============================

**Two-part layers.** A layer whose heads live behind two sets of hooks
(:attr:`gna_lens.heads.LayerHeads.parts`) mixes tokens with both: Falcon-H1 adds its Mamba-2
mixer's output (``hook_mixer_out``) and its parallel attention's (``hook_attn_out``) to the
residual stream; a Zamba2 hybrid layer runs the shared transformer block's attention
(``hook_attn_out``, then the shared MLP ``hook_mlp_out`` and ``hook_shared_out``), whose result
enters the layer's Mamba-2 mixer (``hook_mixer_out``). ``target="mixer"`` replaces both outputs,
each by zero or by its own mean; ``"attn"`` and ``"ssm"`` address one part (on a one-part layer,
the one its mixer is: ``"mixer"`` there). On Zamba2, ``"mlp"`` is the shared block's MLP.

``mode="zero"`` replaces it by zero, ``mode="mean"`` by its mean over a reference, as for heads
(:func:`layer_ablation_hooks`). The paper's protocols (Bick et al. 2025) are :func:`layer_sweep`
(individual removal) and :func:`prune_from_end` (gradual pruning from the end).
"""

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gna_lens.device import HOST, DevicePolicy
from gna_lens.errors import InterventionError, PatternEditError
from gna_lens.heads import (
    HeadView,
    HookedModel,
    LayerHeads,
    ModelLike,
    Subject,
    cached_verdict,
    edit_ignored,
    hook_points,
    is_hooked_ssm,
    model_of,
)
from gna_lens.interventions.ablation import (
    _InputRows,
    _windows,
    ablation_info,
    cell_kind,
    positions_label,
    sweep_positions,
)
from gna_lens.interventions.batching import (
    describe_control,
    describe_task,
    length_groups,
)
from gna_lens.interventions.engine import (
    PLANNERS,
    CellSweep,
    HookCell,
    SweepJob,
    SweepPlan,
    run_sweeps,
)
from gna_lens.interventions.hooks import bind, hooked
from gna_lens.interventions.metrics import Metric
from gna_lens.interventions.result import CellResult
from gna_lens.interventions.runner import PathLog, Runner
from gna_lens.interventions.sources import (
    Source,
    bos_token_id,
    column_mask,
    edit_positions,
    mean_positions,
    reference_rows,
)
from gna_lens.tasks import Task, TextControl

__all__ = [
    "LayerSweepResult",
    "ablate_layers",
    "layer_ablation_hooks",
    "layer_sweep",
    "prune_from_end",
    "remove_layers",
]

#: What a layer intervention replaces.
LAYER_TARGETS = ("block", "mixer", "attn", "ssm", "mlp")
#: The output hook of each part a target may name (``"mixer"``: every part).
_PART_HOOKS = {"attn": "hook_attn_out", "ssm": "hook_mixer_out"}
#: What it replaces it with.
LAYER_MODES = ("zero", "mean")

HookFn = Callable[..., Any]
Cell = tuple[int, ...]


# ----------------------------------------------------------------------------- layer view
@dataclass(frozen=True)
class LayerInfo:
    """The hook points of one layer (block).

    Attributes:
        layer: Layer index.
        kind: ``"attention"``, ``"ssm"``, ``"mixed"`` (a hybrid student's layer with heads of
            both kinds) or ``"block"`` (a layer without addressable heads).
        resid_pre_hook: ``[batch, pos, d_model]`` residual entering the block.
        resid_post_hook: ``[batch, pos, d_model]`` residual leaving it.
        mixer_hooks: The token-mixing sublayer's outputs ``[batch, pos, d_model]``
            (``hook_attn_out`` / ``hook_mixer_out``), one per part in head order; ``()``: none.
        mixer_kinds: Per entry of :attr:`mixer_hooks`, its heads' kind (``""``: unknown).
        mlp_hook: The MLP's output before the residual add, or ``None``.
        verified: Edits are known to take effect (HookedSSM); else checked on first use.
    """

    layer: int
    kind: str
    resid_pre_hook: str
    resid_post_hook: str
    mixer_hooks: tuple[str, ...]
    mixer_kinds: tuple[str, ...]
    mlp_hook: str | None
    verified: bool


def layer_infos(model: ModelLike) -> tuple[LayerInfo, ...]:
    """The per-layer hooks of a TransformerBridge, a HookedSSM or a TransformerLens-style model.

    Raises:
        InterventionError: If the model has no ``blocks.{l}.hook_resid_pre`` / ``hook_resid_post``.
    """
    return _layer_subject(model).infos


@dataclass(frozen=True)
class _LayerSubject:
    """A model's subject (every layer in its head view, :func:`_runner_view`) and layer hooks."""

    subject: Subject
    infos: tuple[LayerInfo, ...]


def _layer_subject(model: "ModelLike | _LayerSubject") -> _LayerSubject:
    """The layer subject of a model, a :class:`~gna_lens.heads.Subject` or a layer subject."""
    if isinstance(model, _LayerSubject):
        return model
    plain = model_of(model)
    try:
        base: Subject | None = Subject.of(model)
    except InterventionError:  # no addressable heads: layers still are
        base = None
    heads = base.view if base is not None else None
    ssm = base.is_ssm if base is not None else is_hooked_ssm(plain)
    infos = _layer_infos(plain, heads, ssm)
    policy = base.policy if base is not None else DevicePolicy.of(plain)
    subject = Subject(plain, _runner_view(plain, heads, infos), policy, ssm)
    return _LayerSubject(subject, infos)


def _layer_infos(model: ModelLike, heads: HeadView | None, ssm: bool) -> tuple[LayerInfo, ...]:
    _, hook_dict, n_layers = hook_points(model, "layer interventions")
    out = []
    for layer in range(n_layers):
        pre, post = f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.hook_resid_post"
        if pre not in hook_dict or post not in hook_dict:
            raise InterventionError(
                f"this {type(model).__name__} has no {pre} / {post} hook points; layer "
                "interventions need both (TransformerBridge and HookedSSM have them)."
            )
        lh = heads.layers[layer] if heads is not None else None
        kind = lh.kind if lh is not None else "block"
        # The mixing sublayer's outputs: each head part's (two on Falcon-H1 / Zamba2 layers),
        # else the one hook the block has.
        parts = [p for p in lh.parts if p.out_hook in hook_dict] if lh is not None else []
        if lh is not None and len(parts) == len(lh.parts):
            mixers = tuple(str(p.out_hook) for p in parts)
            kinds = tuple(str(p.kind) for p in parts)
        else:
            mixers = tuple(
                name
                for name in (f"blocks.{layer}.hook_attn_out", f"blocks.{layer}.hook_mixer_out")
                if name in hook_dict
            )[:1]
            kinds = (kind if lh is not None else "",) * len(mixers)
        mlp = f"blocks.{layer}.hook_mlp_out"
        out.append(
            LayerInfo(
                layer=layer,
                kind=kind,
                resid_pre_hook=pre,
                resid_post_hook=post,
                mixer_hooks=mixers,
                mixer_kinds=kinds,
                mlp_hook=mlp if mlp in hook_dict else None,
                verified=ssm,
            )
        )
    return tuple(out)


# Verdicts of the editability probe, per model: {hook name: None (ok) or the reason}.
_VERDICTS: "weakref.WeakKeyDictionary[Any, dict[str, str | None]]" = weakref.WeakKeyDictionary()


def _require_editable(
    model: ModelLike, infos: Sequence[LayerInfo], layers: Sequence[int], target: str
) -> None:
    """Make sure the edits of ``target`` at ``layers`` change the output, or refuse."""
    for layer in sorted(set(layers)):
        info = infos[layer]
        if info.verified:
            continue
        watch = info.resid_pre_hook if target == "block" else None
        for name in _target_hooks(info, target):
            unchanged = f"would be silently ignored: zeroing {name} did not change the logits"
            reason = cached_verdict(
                _VERDICTS, model_of(model), name, edit_ignored, model_of(model), name, torch.zeros_like, unchanged,
                None, watch,
            )  # fmt: skip
            if reason is not None:
                raise PatternEditError(
                    f"{type(model).__name__} layer {layer}: a {target} intervention is refused, "
                    f"since it {reason}: refusing instead of returning results the edit "
                    "may not have changed. Fix: load the model as a gna_lens.HookedSSM or with "
                    "an architecture whose TransformerBridge blocks pass hook edits on (Llama, "
                    "Qwen2, GPT-2, ...)."
                )


def _target_hooks(info: LayerInfo, target: str) -> tuple[str, ...]:
    """The hooks whose tensors ``target`` replaces at ``info``'s layer (``"block"``: the
    ``hook_resid_post`` it restores); raises if the layer has nothing ``target`` names."""
    if target == "block":
        return (info.resid_post_hook,)
    if target == "mlp":
        if info.mlp_hook is None:
            raise InterventionError(
                f"target='mlp' at layer {info.layer}: this layer has no MLP (no "
                f"blocks.{info.layer}.hook_mlp_out; kind {info.kind!r}). Fix: target='block' "
                "(the whole layer)" + (", or 'mixer'" if info.mixer_hooks else "") + "."
            )
        return (info.mlp_hook,)
    if not info.mixer_hooks:
        raise InterventionError(
            f"target={target!r} at layer {info.layer}: this layer has no token mixer (no "
            f"blocks.{info.layer}.hook_attn_out / hook_mixer_out hook; kind {info.kind!r}). "
            "Fix: target='block' (the whole layer)" + (", or 'mlp'" if info.mlp_hook else "") + "."
        )
    if target == "mixer":
        return info.mixer_hooks
    suffix = _PART_HOOKS[target]
    names = tuple(n for n in info.mixer_hooks if n.endswith("." + suffix))
    has = " and ".join(
        f"{n.rsplit('.', 1)[-1]} ({k or 'unknown'} heads)"
        for n, k in zip(info.mixer_hooks, info.mixer_kinds, strict=True)
    )
    if "mixed" in info.mixer_kinds and len(info.mixer_hooks) == 1:
        kind = {"attn": "attention", "ssm": "SSM"}[target]
        raise InterventionError(
            f"target={target!r} at layer {info.layer}: its one mixer holds attention and SSM "
            f"heads together ({has}), so its output has no {kind}-only part. Fix: "
            f"target='mixer' (the whole mixer), or ablate the {kind} heads "
            "(gna_lens.interventions.ablate_heads)."
        )
    if not names:
        what = {"attn": "attention", "ssm": "SSM mixer"}[target]
        raise InterventionError(
            f"target={target!r} at layer {info.layer}: this layer has no {what} (its token "
            f"mixer: {has}). Fix: target='mixer' (the layer's whole token mixer) or 'block'."
        )
    return names


# ----------------------------------------------------------------------------- validation
def _not_one_layer(layers: Any, what: str = "layers") -> None:
    if isinstance(layers, int) and not isinstance(layers, bool):
        raise InterventionError(
            f"{what}={layers!r} is one layer; expected a list, e.g. [{layers}]."
        )


def _check_layers(infos: Sequence[LayerInfo], layers: Any, what: str = "layers") -> list[int]:
    n = len(infos)
    _not_one_layer(layers, what)
    try:
        items = list(layers)
    except TypeError:
        raise InterventionError(
            f"{what}={layers!r}; expected a list of layer indices (ints in 0..{n - 1})."
        ) from None
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < n:
            raise InterventionError(
                f"{what} contains {item!r}; expected layer indices, ints in 0..{n - 1} (this "
                f"model has {n} layers)."
            )
    return sorted(set(items))


def _check_args(
    infos: Sequence[LayerInfo],
    layers: Sequence[int],
    target: Any,
    mode: Any,
    positions: Any,
    method: Any,
    reference: Any,
    include_bos: Any,
) -> Any:
    """The checked ``positions`` of a layer intervention, after checking its other arguments
    and that each of ``layers`` has what ``target`` names."""
    if not isinstance(include_bos, bool):
        raise InterventionError(f"include_bos={include_bos!r}; expected True or False.")
    if target not in LAYER_TARGETS:
        raise InterventionError(
            f"target={target!r}; expected one of {LAYER_TARGETS}: 'block' (the whole layer; "
            "mode='zero' removes it), 'mixer' (the token mixer's output: attention, SSM mixer, "
            "or both parts of a two-part layer), 'attn' / 'ssm' (one part), 'mlp'."
        )
    if mode not in LAYER_MODES:
        raise InterventionError(
            f"mode={mode!r}; expected one of {LAYER_MODES} for layer interventions ('zero' on "
            "target='block' removes the layer; 'mean' needs reference=)."
        )
    positions = sweep_positions(positions, method, "layer interventions")
    for layer in layers:
        _target_hooks(infos[layer], target)
    if mode == "zero" and reference is not None:
        raise InterventionError("mode='zero' takes no reference; pass mode='mean' to use one.")
    return positions


# ----------------------------------------------------------------------------- hooks
def _layer_source(
    subject: Subject,
    infos: Sequence[LayerInfo],
    layers: Sequence[int],
    target: str,
    reference: Any,
    positions: Any,
    include_bos: bool = False,
    max_rows: int = 16,
) -> Source:
    """The mean over ``reference`` of what ``target`` replaces (``source.mean[hook]``), over the
    ablated positions as for heads (:func:`~gna_lens.interventions.sources.mean_positions`)."""
    if reference is None:
        raise InterventionError(
            "mode='mean' needs reference=: a gna_lens.tasks.Task or token ids [batch, pos] whose "
            "mean layer output replaces the ablated one."
        )
    groups, label, rows = reference_rows(
        reference, subject.device, max_rows, "whose mean replaces the layer's output"
    )
    model = subject.model
    bos_id = bos_token_id(model, reference)
    picks, info = mean_positions(rows, positions, bos_id, include_bos, label)
    sums: dict[str, Tensor] = {}
    pre: dict[int, Tensor] = {}
    picked: dict[str, Tensor] = {}

    def add(name: str, x: Tensor) -> None:
        flat = x.detach()[picked["rows"].to(x.device)].double()  # [tokens, d_model]
        sums[name] = sums.get(name, 0) + flat.sum(0)  # type: ignore[assignment]

    hooks: list[tuple[str, HookFn]] = []
    for layer in layers:
        info_l = infos[layer]
        if target == "block":

            def keep(x: Tensor, hook: Any, layer: int = layer) -> None:
                pre[layer] = x

            def delta(x: Tensor, hook: Any, layer: int = layer) -> None:
                add(infos[layer].resid_post_hook, x - pre.pop(layer).to(x.dtype))

            hooks += [(info_l.resid_pre_hook, keep), (info_l.resid_post_hook, delta)]
        else:
            for name in _target_hooks(info_l, target):

                def value(x: Tensor, hook: Any, name: str = name) -> None:
                    add(name, x)

                hooks.append((name, value))
    with torch.no_grad(), hooked(model, hooks):
        for g in groups:
            mask = torch.zeros(len(g), g.length, dtype=torch.bool, device=HOST)
            for j, i in enumerate(g.indices.tolist()):
                mask[j, picks[i]] = True
            picked["rows"] = mask.to(g.tokens.device)
            model(g.tokens)
    n = info["mean_tokens"]
    mean = {name: (total / n).float() for name, total in sums.items()}
    return Source(
        "mean", mean=mean, label=label, tokens=rows, bos_id=bos_id, include_bos=include_bos,
        info=info, forwards=len(groups),
    )  # fmt: skip


def _edit_hooks(
    info: LayerInfo,
    target: str,
    means: dict[Any, Tensor] | None,
    positions: Any,
    inputs: _InputRows | None = None,
) -> list[tuple[str, HookFn]]:
    """The hooks replacing ``target`` of one layer by zero (``means=None``) or by each replaced
    hook's mean at ``positions`` (maybe a ``SkipBos``), BOS positions found by ``inputs``."""
    skip = inputs is not None and inputs.skip_bos

    def edited(R: int, full: int, P: int, device: Any) -> Tensor | None:
        """``[R or 1, P]`` bool: which of the last ``P`` of ``full`` positions are edited
        (``None``: all)."""
        cols = column_mask(positions, full, device)
        if inputs is not None and skip:
            return inputs.edited(cols, positions, R, full, device)[:, -P:]
        return None if cols is None else cols[-P:][None]

    if target == "block":
        mean = None if means is None else means[info.resid_post_hook]
        store: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            store["pre"] = x

        def restore(x: Tensor, hook: Any) -> Tensor:
            pre = store.get("pre")
            if pre is None or pre.shape[0] != x.shape[0]:
                raise InterventionError(
                    f"internal: {info.resid_pre_hook} did not fire before {info.resid_post_hook} "
                    f"for this batch (resid_post {tuple(x.shape)})."
                )
            full = pre.shape[1]
            P = x.shape[1]
            new = pre[:, -P:]  # a runner may keep only the last positions after the last mixer
            if mean is not None:
                new = new + mean.to(device=new.device, dtype=new.dtype)
            where = edited(x.shape[0], full, P, x.device)
            if where is not None:
                new = torch.where(where[:, :, None], new.to(x.dtype), x)
            return new.to(x.dtype)

        return [(info.resid_pre_hook, keep), (info.resid_post_hook, restore)]

    length: dict[str, int] = {}

    def measure(x: Tensor, hook: Any) -> None:
        length["pos"] = x.shape[1]

    def replace(x: Tensor, hook: Any, mean: Tensor | None) -> Tensor:
        value = x.new_zeros(()) if mean is None else mean.to(device=x.device, dtype=x.dtype)
        P = x.shape[1]
        # A runner may keep only the last positions after the last mixer: the MLP's output then
        # holds the last P of the block's full length.
        where = edited(x.shape[0], max(length.get("pos", P), P), P, x.device)
        if where is None:
            return value.expand_as(x).clone()
        return torch.where(where[:, :, None], value, x)

    hooks: list[tuple[str, HookFn]] = [
        (name, bind(replace, mean=None if means is None else means[name]))
        for name in _target_hooks(info, target)
    ]
    return [(info.resid_pre_hook, measure), *hooks] if positions is not None or skip else hooks


def _hooks_for(
    infos: Sequence[LayerInfo],
    layers: Sequence[int],
    target: str,
    source: Source | None,
    positions: Any,
    inputs: _InputRows | None = None,
) -> list[tuple[str, HookFn]]:
    hooks: list[tuple[str, HookFn]] = []
    for layer in layers:
        means = None if source is None else source.mean
        hooks += _edit_hooks(infos[layer], target, means, positions, inputs)
    return hooks


def layer_ablation_hooks(
    model: ModelLike,
    layers: Sequence[int],
    *,
    target: str = "block",
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
) -> list[tuple[str, HookFn]]:
    """Hooks ``(hook_name, fn)`` that ablate whole layers; pass them to ``model.hooks`` /
    ``run_with_hooks``.

    Args:
        model: A TransformerBridge or a HookedSSM.
        layers: Layer indices, e.g. ``[16, 17]``.
        target: ``"block"`` (with ``mode="zero"`` the layer is removed), ``"mixer"`` (both
            parts of a two-part layer), ``"attn"``, ``"ssm"`` or ``"mlp"`` (the module's table).
        mode: ``"zero"`` or ``"mean"``: the replaced quantity's mean over ``reference`` at the
            ablated positions, BOS left out and unedited unless ``include_bos``, as for heads
            (:func:`~gna_lens.interventions.head_ablation_hooks`).
        positions: ``None`` (every position), ``"last"`` or a list of positions (negative from
            the end).
        reference: A :class:`~gna_lens.tasks.Task` or token ids ``[n, pos]`` (``"mean"`` only;
            its forward passes run here, once).
        include_bos: Mean ablation only: average over (and edit) the BOS position too (as
            :func:`~gna_lens.interventions.head_ablation_hooks`; a list of positions naming a
            BOS raises).

    Returns:
        A list of ``(hook name, hook function)`` pairs (a removed block's: one reads
        ``hook_resid_pre``, the other returns it from ``hook_resid_post``).

    Raises:
        InterventionError: On unknown layers, targets, modes or positions, a target the layer
            lacks, or (mean ablation) positions naming a BOS unless ``include_bos``.
        PatternEditError: If the model would ignore the edit.
    """
    ls = _layer_subject(model)
    model, infos = ls.subject.model, ls.infos
    checked = _check_layers(infos, layers)
    if not checked:
        raise InterventionError("layers=[] is empty; expected at least one layer index.")
    positions = _check_args(
        infos, checked, target, mode, positions, "batched", reference, include_bos
    )
    _require_editable(model, infos, checked, target)
    if mode == "zero":
        return _hooks_for(infos, checked, target, None, positions)
    source = _layer_source(ls.subject, infos, checked, target, reference, positions, include_bos)
    inputs = _InputRows(model, source, positions, ls.subject.device)
    return inputs.hooks() + _hooks_for(infos, checked, target, source, positions, inputs)


@contextmanager
def ablate_layers(
    model: ModelLike,
    layers: Sequence[int],
    *,
    target: str = "block",
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
) -> Iterator[Any]:
    """Ablate whole layers inside a ``with`` block; the model is untouched afterwards.

    The arguments, and the errors, are those of :func:`layer_ablation_hooks`.

    Yields:
        The model, with the hooks attached.

    Examples:
        >>> import torch
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("bamba")  # SSM, attention, SSM layers, each with an MLP
        >>> tokens = torch.tensor([[5, 6, 7, 8]])
        >>> with torch.no_grad():
        ...     clean = model(tokens)
        ...     with ablate_layers(model, [1], target="mixer"):  # the attention's output zeroed
        ...         no_attn = model(tokens)
        ...     again = model(tokens)
        >>> bool((no_attn != clean).any()), torch.equal(again, clean)
        (True, True)
    """
    hooks = layer_ablation_hooks(
        model, layers, target=target, mode=mode, positions=positions, reference=reference,
        include_bos=include_bos,
    )  # fmt: skip
    with hooked(model_of(model), hooks):
        yield model


@contextmanager
def remove_layers(model: ModelLike, layers: Sequence[int]) -> Iterator[Any]:
    """Remove layers inside a ``with`` block: each block becomes the identity on the residual
    stream, as if it were deleted from the model (the paper's layer pruning).

    The same as ``ablate_layers(model, layers, target="block", mode="zero")``; the logits equal
    those of the Hugging Face model with those blocks deleted from its layer list.

    Yields:
        The model, with the hooks attached (errors as :func:`layer_ablation_hooks`).

    Examples:
        >>> import torch
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> tokens = torch.tensor([[5, 6, 7, 8]])
        >>> with torch.no_grad(), remove_layers(model, [0]):
        ...     _, cache = model.run_with_cache(tokens, names_filter=lambda n: "resid" in n)
        >>> torch.equal(cache["blocks.0.hook_resid_post"], cache["blocks.0.hook_resid_pre"])
        True
    """
    with ablate_layers(model, layers, target="block", mode="zero"):
        yield model


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True, kw_only=True)
class LayerSweepResult(CellResult):
    """The effect on a task and on a control of ablating layers (each alone, or cumulatively).

    A :class:`~gna_lens.interventions.result.CellResult` (effects with 95% intervals, control
    effects, selectivity, ranking, ``to_dataframe``, ``to_dict``, ``plot``) whose cells are
    layer sets.

    Attributes (beyond :class:`~gna_lens.interventions.result.CellResult`'s meaning):
        cells: The layers ablated together, one tuple per row (``(l,)`` for individual removal,
            ``(n-k, ..., n-1)`` for gradual pruning).
        kinds: Per cell, the layers' kinds (``"attention"``, ``"ssm"``, ``"block"``; ``"mixed"``
            for sets of several kinds).
        baseline: The task metric with only the ``removed`` layers removed, ``[sample]``.
        control_values: The control's loss (nats/token, or nats/answer for a knowledge task).
        info: How the numbers were made: protocol, target, mode, positions, metric, control,
            layers removed throughout, intervals, path, timings; for mean ablation, what the
            mean was taken over, as for heads (``mean_over``, ``mean_tokens``, ``mean_prompts``,
            ``bos_excluded``, ``include_bos``, ``bos_unedited``; the same with a ``control_``
            prefix for the control's own mean). Also readable as ``method``.
    """

    def __repr__(self) -> str:
        order = self.ranking(1)
        top = f", strongest={_cell_label(order[0])}" if order else ""
        ctrl = f", control={self.control!r}" if self.control else ", no control"
        return (
            f"LayerSweepResult({self.method.get('protocol', 'layers')}: {self.metric} on "
            f"{self.task}, target={self.method.get('target')!r}, cells={len(self)}"
            f"{top}{ctrl})"
        )

    @property
    def method(self) -> dict[str, Any]:
        """How the numbers were made (the same dict as ``info``)."""
        return self.info

    def label(self, i: int) -> str:
        return _cell_label(self.cells[i])

    def _index_columns(self, i: int) -> dict[str, Any]:
        cell = self.cells[i]
        return {
            "layer": cell[0] if len(cell) == 1 else cell,
            "layers": _cell_label(cell),
            "n_removed": len(cell),
        }

    def _context_columns(self) -> dict[str, Any]:
        return {"target": self.info.get("target", ""), "mode": self.info.get("mode", "")}

    def _plot_title(self) -> str:
        return f"{self.info.get('protocol', 'layer ablation')}: {self.task}"

    def _plot_axis(self) -> str:
        return "layers ablated"


def _cell_label(cell: Cell) -> str:
    if len(cell) > 2 and list(cell) == list(range(cell[0], cell[-1] + 1)):
        return f"L{cell[0]}-L{cell[-1]}"
    return "+".join(f"L{layer}" for layer in cell)


# ----------------------------------------------------------------------------- sweeps
def _runner_view(model: HookedModel, view: HeadView | None, infos: Sequence[LayerInfo]) -> HeadView:
    """A head view whose every layer names its ``hook_resid_pre`` (what the runner needs)."""
    layers = []
    for info in infos:
        lh = view.layers[info.layer] if view is not None else None
        layers.append(
            lh
            if lh is not None
            else LayerHeads(
                layer=info.layer,
                kind="attention",
                n_heads=0,
                d_head=0,
                pattern_hook="",
                z_hook="",
                scores_hook=None,
                resid_pre_hook=info.resid_pre_hook,
                verified=info.verified,
            )
        )
    cfg: Any = model.cfg
    return HeadView(
        model_type=type(model).__name__,
        model_name=str(getattr(cfg, "model_name", "") or ""),
        n_layers=len(infos),
        layers=tuple(layers),
    )


#: What each (target, mode) of a layer ablation does, in words (``method["ablation"]``).
_ABLATION = {
    ("block", "zero"): "block removed: the identity on the residual stream",
    ("block", "mean"): "block's residual contribution replaced by its mean",
    ("mixer", "zero"): "mixer output zeroed (attention / SSM; both parts of a two-part layer)",
    ("mixer", "mean"): "mixer output replaced by its mean (attention / SSM; both parts of "
    "a two-part layer, each by its own mean)",
} | {
    (target, mode): f"{what} output " + ("zeroed" if mode == "zero" else "replaced by its mean")
    for target, what in (("attn", "attention"), ("ssm", "SSM mixer"), ("mlp", "MLP"))
    for mode in LAYER_MODES
}


def _sweep_cells(
    model: "ModelLike | _LayerSubject",
    task: Task,
    metric: Any,
    cells: list[Cell],
    *,
    target: str,
    mode: str,
    positions: Any,
    reference: Any,
    include_bos: bool,
    removed: list[int],
    control: Any,
    method: str,
    max_rows: int,
    progress: bool,
    protocol: str,
    executor: Any = None,
) -> LayerSweepResult:
    from gna_lens.tasks.control import resolve_control

    t0 = time.perf_counter()
    ls = _layer_subject(model)
    model, infos = ls.subject.model, ls.infos
    layers = sorted({layer for c in cells for layer in c})
    positions = _check_args(infos, layers, target, mode, positions, method, reference, include_bos)
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise InterventionError(f"max_rows={max_rows!r}; expected a positive int.")
    met = Metric(metric, task)
    resolved = resolve_control(control, getattr(model, "tokenizer", None), positions=positions)
    common = dict(
        cells=cells, target=target, mode=mode, positions=positions, include_bos=include_bos,
        removed=removed, method=method, max_rows=max_rows,
    )  # fmt: skip
    jobs = [SweepJob("layers", common | dict(on=task, metric=metric, reference=reference))]
    if resolved is not None:
        jobs.append(SweepJob("layers", common | dict(on=resolved, metric=None, reference=None)))
    (task_sweep, (values, baseline, t_info)), *ctrl = run_sweeps(
        ls, jobs, protocol, executor, progress
    )
    run_infos = [t_info] + [run[2] for _, run in ctrl]
    c_values = c_base = None
    mean_info = dict(task_sweep.extra)  # what the mean was taken over (mean ablation; else {})
    if ctrl:
        c_sweep, (c_values, c_base, _) = ctrl[0]
        mean_info |= {f"control_{k}": v for k, v in c_sweep.extra.items()}
    description, unit = describe_control(resolved)
    info = {
        "protocol": protocol,
        "target": target,
        "mode": mode,
        "ablation": _ABLATION[(target, mode)],
        "positions": positions_label(positions),
        "metric": met.name,
        "task": describe_task(task),
        "n_prompts": len(task),
        "reference": "none" if reference is None else (
            describe_task(reference) if isinstance(reference, Task)
            else f"token ids {tuple(reference.shape)}"
        ),
        "removed_throughout": list(removed),
        "control": description or "none",
        "control_unit": unit,
        "intervals": "95% percentile bootstrap over prompts (control: over windows), paired; "
        "accuracy values: Wilson",
        "path": "batched (each cell from its lowest layer's cached residual)"
        if method == "batched" else "loop (a full forward per cell)",
        "forwards": sum(i["forwards"] for i in run_infos),
        "seconds": round(time.perf_counter() - t0, 3),
    } | PathLog.merged(run_infos) | mean_info  # fmt: skip
    # The Ray executor's record of the task's run (executor) and the control's.
    for key, run_info in zip(("executor", "control_executor"), run_infos, strict=False):
        if "executor" in run_info:
            info[key] = run_info["executor"]
    return LayerSweepResult(
        cells=tuple(cells),
        kinds=tuple(cell_kind(lambda layer: infos[layer].kind, c) for c in cells),
        values=values,
        baseline=baseline,
        metric=met.name,
        task=describe_task(task),
        control_values=c_values,
        control_baseline=c_base,
        control=description,
        info=info,
    )


def _plan_layers(
    model: "ModelLike | _LayerSubject",
    on: Task | TextControl,
    metric: Any,
    cells: list[Cell],
    target: str,
    mode: str,
    positions: Any,
    reference: Any,
    include_bos: bool,
    removed: list[int],
    method: str,
    max_rows: int,
    check_edits: bool = True,
) -> CellSweep:
    """Plan the layer cells (``HookCell``) on the task, or on a control (``metric=None``), with
    ``removed`` layers removed in every run; ``check_edits``: as in ``ablation._plan_heads``."""
    ls = _layer_subject(model)
    subject, infos = ls.subject, ls.infos
    model = subject.model
    layers = sorted({layer for c in cells for layer in c})
    if check_edits:
        _require_editable(model, infos, layers, target)
        if removed:
            _require_editable(model, infos, removed, "block")
    device = subject.device
    run_metric: Callable[[Tensor, Tensor], Tensor]
    if isinstance(on, TextControl):
        runner, run_metric, groups, inputs = _windows(subject, on, positions, None, max_rows)
        ref: Any = inputs
        prompts = inputs.tolist()
    elif metric is None:  # a knowledge task as the control
        runner = Runner(subject)
        choice = Metric("choice_logprob", on)

        def run_metric(logits: Tensor, idx: Tensor) -> Tensor:
            return -choice(logits, idx)  # the answer's NLL among its options

        groups = length_groups(on, max_rows, device)
        ref, prompts = on, [s.input_ids for s in on]
    else:
        runner = Runner(subject)
        run_metric = Metric(metric, on)
        groups = length_groups(on, max_rows, device)
        ref, prompts = reference, [s.input_ids for s in on]
    # Mean ablation: BOS columns of the prompts left unedited unless include_bos.
    source = None
    if mode == "mean":
        source = _layer_source(subject, infos, layers, target, ref, positions, include_bos)
    edited = positions if source is None else edit_positions(source, positions, prompts)
    hook_cells = [
        HookCell(
            start=min(c), hooks=tuple(_hooks_for(infos, c, target, source, edited)),
            label=_cell_label(c),
        )
        for c in cells
    ]  # fmt: skip
    return CellSweep(
        runner, hook_cells, groups, None, run_metric, None,
        SweepPlan(0, max_rows, None), method, len(prompts),
        extra={} if source is None else ablation_info(source, edited),
        base_hooks=_hooks_for(infos, removed, "block", None, None),
    )  # fmt: skip


PLANNERS["layers"] = _plan_layers


def _layer_cells(infos: Sequence[LayerInfo], layers: Any, removed: list[int]) -> list[Cell]:
    """``None`` -> every layer not removed, alone; ints -> each alone; lists -> sets."""
    if layers is None:
        cells: list[Cell] = [(i.layer,) for i in infos if i.layer not in removed]
    else:
        _not_one_layer(layers)
        items = list(layers)
        if not items:
            raise InterventionError("layers=[] is empty; expected layer indices or layer sets.")
        cells = []
        for item in items:
            one = isinstance(item, int) and not isinstance(item, bool)
            if not one and (
                not isinstance(item, Sequence | set | frozenset) or isinstance(item, str)
            ):
                raise InterventionError(
                    f"layers contains {item!r}; expected layer indices or lists of them (sets "
                    "ablated together), e.g. [3, [4, 5]]."
                )
            group = _check_layers(infos, [item] if one else item)
            if not group:
                raise InterventionError("layers contains an empty layer set; drop it.")
            cells.append(tuple(group))
    clash = sorted({layer for c in cells for layer in c} & set(removed))
    if clash:
        raise InterventionError(
            f"layers {clash} are also in removed= (removed in every run, the baseline "
            "included); ablating them again measures nothing. Drop them from one of the two."
        )
    if not cells:
        raise InterventionError("every layer is in removed=; nothing is left to sweep.")
    return cells


def layer_sweep(
    model: ModelLike,
    task: Task,
    metric: Any = "logit_diff",
    layers: Any = None,
    *,
    target: str = "block",
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
    removed: Sequence[int] = (),
    control: Any = "auto",
    method: str = "batched",
    max_rows: int = 64,
    progress: bool = True,
    executor: Any = None,
) -> LayerSweepResult:
    """Individual layer removal: remove each layer alone, measure the task and the control,
    reinsert (the paper's "individual pruning").

    The clean run keeps the residual stream entering each layer; each removal then runs from
    its layer only (the layers below are not repeated). The numbers equal a loop of full forward
    passes (``method="loop"``) up to float rounding.

    ``target``, ``mode``, ``positions``, ``reference`` and ``include_bos`` are those of
    :func:`layer_ablation_hooks` (a mean for the control is over its own windows;
    ``method["mean_over"]`` says which); ``method``, ``max_rows`` (prompts, or control windows),
    ``progress`` and ``executor`` those of :func:`~gna_lens.interventions.ablation.ablation_sweep`
    (``method["executor"]`` records the workers).

    Args:
        model: A TransformerBridge or a HookedSSM (attention, SSM and hybrid layers alike).
        task: A :class:`~gna_lens.tasks.Task` (e.g. :func:`~gna_lens.tasks.kv_retrieval`).
        metric: ``"logit_diff"`` (default), ``"accuracy"`` (the paper's), ``"logprob"``,
            ``"choice_logprob"`` or ``fn(logits [rows, d_vocab], samples) -> [rows]``.
        layers: ``None`` (every layer not in ``removed``, alone), ``[l, ...]`` (each alone) or
            layer sets ``[[16, 17], ...]`` (each set ablated together).
        removed: Layers removed in every run, the baseline included (the paper first removes
            every layer above L17 of Llama-3.1-8B, then sweeps the rest).
        control: What needs no in-context retrieval (:func:`~gna_lens.tasks.resolve_control`):
            ``"auto"`` (default: the zoo's cloze split on a zoo model, else ``"prose"``),
            ``"prose"`` (next-token loss on prose shipped with gna_lens), ``None``, a
            :class:`~gna_lens.tasks.TextControl`, a knowledge :class:`~gna_lens.tasks.Task`
            (answer NLL among its options), texts or a ``datasets.Dataset``.

    Returns:
        A :class:`LayerSweepResult`: ``ranking()``, ``to_dataframe()`` (effects with 95%
        intervals, control effects, selectivity), ``plot()``.

    Raises:
        InterventionError: On unknown layers, metrics, targets, modes or positions.
        PatternEditError: If the model would ignore the edit.
        TaskError: For a prose control the tokenizer does not cover.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
        >>> model = toy_gna_model()  # Gather head in layer 0, Aggregate head in layer 1
        >>> res = layer_sweep(model, toy_gna_task(model, n_samples=8), "accuracy",
        ...                   control=toy_control(model), progress=False)
        >>> res.baseline_mean, res.values.mean(-1).tolist(), res.control_effects.tolist()
        (1.0, [0.125, 0.125], [0.0, 0.0])
    """
    ls = _layer_subject(model)
    removed_list = _check_layers(ls.infos, removed, "removed")
    cells = _layer_cells(ls.infos, layers, removed_list)
    return _sweep_cells(
        ls, task, metric, cells, target=target, mode=mode, positions=positions,
        reference=reference, include_bos=include_bos, removed=removed_list, control=control,
        method=method, max_rows=max_rows, progress=progress, protocol="individual removal",
        executor=executor,
    )  # fmt: skip


def prune_from_end(
    model: ModelLike,
    task: Task,
    metric: Any = "logit_diff",
    *,
    n_steps: int | None = None,
    target: str = "block",
    mode: str = "zero",
    positions: Any = None,
    reference: Any = None,
    include_bos: bool = False,
    control: Any = "auto",
    method: str = "batched",
    max_rows: int = 64,
    progress: bool = True,
    executor: Any = None,
) -> LayerSweepResult:
    """Gradual pruning from the end: remove the last layer, then the last two, ... (cumulative),
    measuring the task and the control after each step (the paper's "gradual pruning").

    Where the task falls to chance while the control holds, the layers just removed carry what
    the task needs; the paper finds Llama-3.1-8B keeps MMLU until L17 is removed.

    The other arguments are those of :func:`layer_sweep`.

    Args:
        n_steps: Pruning steps (default ``n_layers - 1``: every step that leaves a layer).

    Returns:
        A :class:`LayerSweepResult` whose cell ``k`` removes the last ``k + 1`` layers.

    Raises:
        InterventionError: For ``n_steps`` outside ``1..n_layers``, or as :func:`layer_sweep`.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> res = prune_from_end(model, toy_gna_task(model, n_samples=8), "accuracy",
        ...                      control=None, progress=False)
        >>> res.cells, res.values.mean(-1).tolist()
        (((1,),), [0.125])
    """
    ls = _layer_subject(model)
    n = len(ls.infos)
    steps = n - 1 if n_steps is None else n_steps
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= n:
        raise InterventionError(
            f"n_steps={n_steps!r}; expected an int in 1..{n} (this model has {n} layers; "
            f"default {n - 1})."
        )
    cells = [tuple(range(n - k, n)) for k in range(1, steps + 1)]
    return _sweep_cells(
        ls, task, metric, cells, target=target, mode=mode, positions=positions,
        reference=reference, include_bos=include_bos, removed=[], control=control, method=method,
        max_rows=max_rows, progress=progress, protocol="gradual pruning from the end",
        executor=executor,
    )  # fmt: skip
