"""One head index space over Transformers, SSMs and hybrids: the model-agnostic head view.

Every head of every model is addressed as ``(layer, head)``. :func:`head_view` says, per layer,
whether the layer has attention heads or SSM heads, how many, and which hook points hold what the
interventions of :mod:`gna_lens.interventions` need:

=================  =====================================  =====================================
                   TransformerBridge / HookedSSM attention  HookedSSM SSM layer
=================  =====================================  =====================================
pattern            ``blocks.{l}.attn.hook_pattern``       ``blocks.{l}.mixer.hook_pattern``
per-head outputs   ``blocks.{l}.attn.hook_z``             ``blocks.{l}.mixer.hook_z``
pre-softmax        ``blocks.{l}.attn.hook_attn_scores``   (none: SSM matrices are unnormalized)
residual in        ``blocks.{l}.hook_resid_pre``          ``blocks.{l}.hook_resid_pre``
=================  =====================================  =====================================

``hook_z`` is ``[batch, pos, head_index, d_head]`` everywhere (query heads for grouped-query
attention; Mamba-1 channels with ``d_head = 1``). Nothing else in the package special-cases
architectures.

**Mixed layers.** A layer of a hybrid student (:func:`gna_lens.hybrid.build_hybrid`) holds
attention heads and SSM heads in one ``blocks.{l}.mixer.hook_pattern`` / ``hook_z``: its
:attr:`LayerHeads.kind` is ``"mixed"`` and :meth:`HeadView.kind_of` gives each head's own kind
(``"attention"`` or ``"ssm"``), which is what every function that branches on kind reads.

**Layers of several parts** (Falcon-H1, Zamba2's hybrid layers) list the heads of each set of
hooks, part after part (:attr:`LayerHeads.parts`); every intervention edits each part through its
own hooks. A model family declares its blocks' parts in ``SSMBlock.head_parts``.

**Mamba-1 channel groups.** A Mamba-1 layer's heads are its channels unless the model groups them
(:meth:`HookedSSM.set_head_groups <gna_lens.models.HookedSSM.set_head_groups>`); then
``(layer, g)`` is group ``g`` (:attr:`LayerHeads.channels`), and ablating, patching or masking it
edits all its channels (:meth:`LayerHeads.hook_mask`); its pattern is :func:`head_patterns`'s.

Some TransformerBridge attentions only *report* their pattern and discard edits of it:
:func:`require_editable` checks each layer once and raises
:class:`~gna_lens.errors.PatternEditError` instead of letting an edit be silently dropped.
"""

import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast, runtime_checkable

import torch
from jaxtyping import Float
from torch import Tensor

from gna_lens.device import HOST, DevicePolicy
from gna_lens.errors import InterventionError, PatternEditError

__all__ = [
    "HeadList",
    "HeadView",
    "LayerHeads",
    "describe_head_groups",
    "head_output_weights",
    "head_patterns",
    "head_view",
    "require_editable",
]

HeadKind = Literal["attention", "ssm"]
#: A layer's kind: its heads' kind, or ``"mixed"`` for a layer with heads of both kinds (a hybrid
#: student of :func:`gna_lens.hybrid.build_hybrid`).
LayerKind = Literal["attention", "ssm", "mixed"]
EditTarget = Literal["pattern", "scores", "z"]
Head = tuple[int, int]


@dataclass(frozen=True)
class LayerHeads:
    """The heads of one layer and the hook points that hold them.

    A **multi-part** layer (Falcon-H1: the Mamba-2 mixer and the attention beside it; Zamba2's
    hybrid layers: the shared block's attention, then the layer's Mamba-2 mixer) holds its heads
    behind several sets of hooks: each part (:attr:`parts`) is a :class:`LayerHeads` holding the
    layer's heads ``offset .. offset + n_heads - 1``, with part-local indices in its methods.

    Attributes:
        layer: Layer index.
        kind: ``"attention"`` or ``"ssm"``, or ``"mixed"`` for a layer with heads of both kinds
            (see :attr:`head_kinds`).
        n_heads: Number of heads (query heads for grouped-query attention; channels for Mamba-1).
        d_head: Width of each head's output in ``hook_z`` (a multi-part layer whose parts differ:
            ``0``; read each part's).
        pattern_hook: ``[batch, head_index, query_pos, key_pos]``: the attention pattern
            (post-softmax) or the SSM's materialized implicit attention. ``""`` for a
            multi-part layer (each part has its own).
        z_hook: ``[batch, pos, head_index, d_head]``: each head's slice of the output projection's
            input; editing it ablates or patches a head. ``""`` for a multi-part layer.
        scores_hook: ``[batch, head_index, query_pos, key_pos]`` pre-softmax scores (attention
            only), or ``None``.
        resid_pre_hook: ``[batch, pos, d_model]``: the residual stream entering the layer.
        out_hook: ``[batch, pos, d_model]``: the heads' combined output (the output
            projection of ``hook_z``), before it is added to the residual stream; ``None`` if the
            model has no such hook (and for a multi-part layer: each part has its own).
        verified: ``True`` when edits of the pattern, scores and ``hook_z`` are known to change
            the output (HookedSSM); ``False`` when :func:`require_editable` checks them on first
            use (TransformerBridge and other hooked models).
        channels: Mamba-1 channel groups: per head, the indices of the hook tensors' head axis
            (channels) it covers; ``None`` when head ``h`` is index ``h`` (every other layer).
        n_channels: Size of the head axis of ``hook_z`` / ``hook_pattern`` (``d_inner`` for a
            grouped Mamba-1 layer; ``n_heads`` otherwise).
        head_kinds: Per head, ``"attention"`` or ``"ssm"``, for a layer whose heads are not all
            of kind :attr:`kind` (the hybrid students, whose one ``hook_pattern`` / ``hook_z``
            holds both kinds; multi-part layers); ``None`` when every head is of kind
            :attr:`kind`. Read it with :meth:`kind_of`.
        subparts: A multi-part layer's parts, in head order (``()`` for a single-part layer);
            read :attr:`parts`, which is never empty.
        offset: The layer's index of this part's first head (``0`` for a single-part layer).
        ssm_mixer: Whether the hooks are a HookedSSM SSM mixer's (``blocks.{l}.mixer.*``):
            ``HookedSSM.pattern_selection`` restricts which heads and query rows its
            ``hook_pattern`` holds, and the mixer's ``last_pattern_index`` says which.
    """

    layer: int
    kind: LayerKind
    n_heads: int
    d_head: int
    pattern_hook: str
    z_hook: str
    scores_hook: str | None
    resid_pre_hook: str
    verified: bool
    out_hook: str | None = None
    channels: tuple[tuple[int, ...], ...] | None = None
    n_channels: int = 0
    head_kinds: tuple[HeadKind, ...] | None = None
    subparts: tuple["LayerHeads", ...] = ()
    offset: int = 0
    ssm_mixer: bool = False

    def __post_init__(self) -> None:
        if not self.n_channels:
            object.__setattr__(self, "n_channels", self.n_heads)
        if len(self.subparts) == 1:
            raise InterventionError(
                f"LayerHeads of layer {self.layer}: subparts holds one part; a single-part "
                "layer is its own part (subparts=())."
            )

    @property
    def parts(self) -> tuple["LayerHeads", ...]:
        """The hook sets holding the layer's heads, in head order: ``(self,)`` for a
        single-part layer; for a multi-part layer one :class:`LayerHeads` per part, whose
        ``offset`` is the layer's index of its first head."""
        return self.subparts or (self,)

    @property
    def multipart(self) -> bool:
        """Whether the heads live behind several sets of hooks (see :attr:`parts`)."""
        return bool(self.subparts)

    def kind_of(self, head: int) -> HeadKind:
        """``"attention"`` or ``"ssm"``: the kind of ``head`` (in a ``"mixed"`` layer, its own)."""
        if self.head_kinds is not None:
            return self.head_kinds[head]
        return "attention" if self.kind == "attention" else "ssm"

    def local(self, heads: Iterable[int]) -> list[int]:
        """This part's indices of those of the layer's ``heads`` that it holds (in order).

        A single-part layer holds every head, with the same indices.
        """
        lo, hi = self.offset, self.offset + self.n_heads
        return [h - lo for h in heads if lo <= h < hi]

    def split(self, heads: Iterable[int]) -> list[tuple["LayerHeads", list[int]]]:
        """``heads`` (the layer's indices) grouped by part: ``[(part, part-local heads), ...]``
        in part order, parts holding none of them left out. A single-part layer gives
        ``[(self, heads)]``."""
        chosen = list(heads)
        out = [(part, part.local(chosen)) for part in self.parts]
        return [(part, local) for part, local in out if local]

    def part_of(self, head: int) -> tuple["LayerHeads", int]:
        """The part holding the layer's head ``head``, and its index there."""
        for part in self.parts:
            if part.offset <= head < part.offset + part.n_heads:
                return part, head - part.offset
        raise InterventionError(
            f"head ({self.layer}, {head}) is out of range: layer {self.layer} ({self.kind}) "
            f"has {self.n_heads} heads (0..{self.n_heads - 1})."
        )

    def _single(self, what: str) -> None:
        if self.subparts:
            described = "; ".join(
                f"{p.kind} heads {p.offset}..{p.offset + p.n_heads - 1} at {p.z_hook}"
                for p in self.subparts
            )
            raise InterventionError(
                f"LayerHeads.{what} of layer {self.layer}: its heads live behind "
                f"{len(self.subparts)} sets of hooks ({described}). Fix: ask each part "
                "(lh.parts, lh.split(heads) or lh.part_of(head)), with the part's own head "
                "indices."
            )

    def members(self, head: int) -> tuple[int, ...]:
        """The hook-axis indices (Mamba-1 channels) of ``head``; ``(head,)`` without groups."""
        self._single("members")
        return (head,) if self.channels is None else self.channels[head]

    def hook_mask(self, heads: Iterable[int]) -> Tensor:
        """``[n_channels]`` bool: the entries of the hook tensors' head axis ``heads`` cover."""
        self._single("hook_mask")
        mask = torch.zeros(self.n_channels, dtype=torch.bool, device=HOST)
        for h in heads:
            mask[list(self.members(h))] = True
        return mask

    def membership(self) -> Tensor:
        """``[n_heads, n_channels]`` 0/1 float matrix: row ``h`` marks head ``h``'s channels."""
        self._single("membership")
        if self.channels is None:
            return torch.eye(self.n_heads, device=HOST)
        out = torch.zeros(self.n_heads, self.n_channels, device=HOST)
        for h, chans in enumerate(self.channels):
            out[h, list(chans)] = 1.0
        return out

    def hook(self, target: EditTarget) -> str:
        """The hook name holding ``target`` (``"pattern"``, ``"scores"`` or ``"z"``)."""
        self._single("hook")
        if target == "pattern":
            return self.pattern_hook
        if target == "z":
            return self.z_hook
        if self.scores_hook is None:
            raise PatternEditError(
                f"Layer {self.layer} is an {self.kind} layer: it has no pre-softmax scores hook. "
                "Pre-softmax edits exist for attention layers only; SSM matrices are unnormalized "
                "(use the pattern, mode='post'; mask_patterns(mode='pre') renormalizes the "
                "attention heads of a mixed layer through the pattern)."
            )
        return self.scores_hook


#: Mamba-1 channel groups as a view records them: ``((layer, ((channel, ...), ...)), ...)``,
#: one entry per grouped layer; ``()`` when every head is a real head or a single channel.
GroupSpec = tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]


class HeadList(list):  # type: ignore[type-arg]
    """``(layer, head)`` pairs that remember what a head was when they were chosen.

    On a Mamba-1 model with channel groups (:meth:`~gna_lens.models.HookedSSM.set_head_groups`),
    ``(3, 1)`` means group 1 of layer 3, without groups channel 1: the same pair names other
    weights. :meth:`gna_lens.GnaReport.top` returns a ``HeadList`` carrying the groups the report
    was scored under, and every function that takes heads (:meth:`HeadView.check_heads`) refuses
    it on a model whose groups differ instead of ablating other channels. Slices keep the
    groups; ``list(heads)`` drops them (and the check).

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba1")
        >>> with model.head_groups(16):
        ...     heads = HeadList([(0, 1)], head_view(model).group_spec)
        >>> head_view(model).check_heads(heads)
        Traceback (most recent call last):
        ...
        gna_lens.errors.InterventionError: heads [(0, 1)] were chosen with Mamba-1 channel groups as heads: layer 0: 4 blocks of 16 channels; layer 1: 4 blocks of 16 channels, but the model now has single channels as heads: the same (layer, head) pairs would name other channels. Fix: use them inside `with model.head_groups(spec):` with the groups they were chosen under (for a report: `model.head_groups(report.head_groups_spec())`), or pass list(heads) to mean the model's current heads.
        >>> with model.head_groups(16):
        ...     head_view(model).check_heads(heads[:1])
        [(0, 1)]
    """

    def __init__(self, heads: Iterable[Any] = (), head_groups: GroupSpec = ()) -> None:
        super().__init__(heads)
        self.head_groups: GroupSpec = tuple(head_groups)

    def __getitem__(self, index: Any) -> Any:
        out = super().__getitem__(index)
        return HeadList(out, self.head_groups) if isinstance(index, slice) else out


@dataclass(frozen=True)
class HeadView:
    """Per layer, the heads of a model and the hooks that hold them.

    Attributes:
        model_type: The model's class name (``"HookedSSM"``, ``"TransformerBridge"``, ...).
        model_name: The model's name, where it has one.
        n_layers: Number of layers (blocks).
        layers: Per layer, its :class:`LayerHeads`, or ``None`` for a layer without addressable
            heads (e.g. the SSM layers of a hybrid loaded through a TransformerBridge).

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> view = head_view(tiny_hooked_ssm("bamba"))
        >>> [(lh.layer, lh.kind, lh.n_heads) for lh in view]
        [(0, 'ssm', 8), (1, 'attention', 4), (2, 'ssm', 8)]
        >>> view[1].z_hook
        'blocks.1.attn.hook_z'
    """

    model_type: str
    model_name: str
    n_layers: int
    layers: tuple[LayerHeads | None, ...]

    def __iter__(self) -> Any:
        return (lh for lh in self.layers if lh is not None)

    def __getitem__(self, layer: int) -> LayerHeads:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise InterventionError(f"layer={layer!r}; expected an int in 0..{self.n_layers - 1}.")
        if not 0 <= layer < self.n_layers:
            raise InterventionError(
                f"layer {layer} is out of range: this {self.model_type} has {self.n_layers} layers "
                f"(0..{self.n_layers - 1})."
            )
        lh = self.layers[layer]
        if lh is None:
            with_heads = [x.layer for x in self]
            raise InterventionError(
                f"layer {layer} of this {self.model_type} has no addressable heads (no "
                f"attention hook_pattern/hook_z and no HookedSSM mixer); layers with heads: "
                f"{with_heads}. For SSM layers load the model as a gna_lens.HookedSSM "
                "(gna_lens.load_model)."
            )
        return lh

    def kind(self, layer: int) -> LayerKind:
        """``"attention"`` or ``"ssm"``; ``"mixed"`` for a layer with heads of both kinds (ask
        :meth:`kind_of` for a head's own kind)."""
        return self[layer].kind

    def kind_of(self, head: Head) -> HeadKind:
        """``"attention"`` or ``"ssm"``: the kind of the head ``(layer, head)``.

        Examples:
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> view = head_view(tiny_hooked_ssm("bamba"))
            >>> view.kind_of((1, 0)), view.kind_of((2, 5))
            ('attention', 'ssm')
        """
        layer, h = head
        self[layer].part_of(h)  # raises for a head out of range
        return self[layer].kind_of(h)

    def part_of(self, head: Head) -> tuple[LayerHeads, int]:
        """The part of its layer holding ``head`` (:attr:`LayerHeads.parts`) and its index
        there; for a single-part layer, ``(view[layer], head)``.

        Examples:
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> view = head_view(tiny_hooked_ssm("falcon_h1"))
            >>> [(p.kind, p.offset, p.n_heads) for p in view[1].parts]
            [('ssm', 0, 8), ('attention', 8, 4)]
            >>> part, h = view.part_of((1, 9))
            >>> part.z_hook, h
            ('blocks.1.attn.hook_z', 1)
        """
        layer, h = head
        return self[layer].part_of(h)

    def parts_of(self, heads: Iterable[Head]) -> list[LayerHeads]:
        """The parts holding ``heads`` (each once), in layer and head order: the hook sets an
        edit of those heads touches."""
        seen: dict[tuple[int, int], LayerHeads] = {}
        for layer, h in heads:
            part = self[layer].part_of(h)[0]
            seen.setdefault((layer, part.offset), part)
        return [seen[k] for k in sorted(seen)]

    def heads(self, kind: HeadKind | None = None) -> list[Head]:
        """Every ``(layer, head)`` of the model (only those of ``kind`` when given)."""
        return [
            (lh.layer, h)
            for lh in self
            for h in range(lh.n_heads)
            if kind is None or lh.kind_of(h) == kind
        ]

    @property
    def n_heads_total(self) -> int:
        """Number of heads over all layers."""
        return sum(lh.n_heads for lh in self)

    @property
    def group_spec(self) -> GroupSpec:
        """The Mamba-1 channel groups of this view (``()``: none), as :class:`HeadList` keeps."""
        return tuple((lh.layer, lh.channels) for lh in self if lh.channels is not None)

    def check_group_origin(self, heads: Any, what: str = "heads") -> None:
        """Refuse a :class:`HeadList` chosen under other Mamba-1 channel groups than the view's.

        Raises:
            InterventionError: Naming both groupings and the fix.
        """
        chosen = getattr(heads, "head_groups", None)
        if chosen is not None and tuple(chosen) != self.group_spec:
            raise InterventionError(
                f"{what} {list(heads)!r} were chosen with "
                f"{_describe_group_spec(tuple(chosen), self) or 'single channels as heads'}, "
                "but the model now has "
                f"{_describe_group_spec(self.group_spec, self) or 'single channels as heads'}: "
                "the same (layer, head) pairs would name other channels. Fix: use them "
                "inside `with model.head_groups(spec):` with the groups they were chosen under "
                "(for a report: `model.head_groups(report.head_groups_spec())`), or pass "
                "list(heads) to mean the model's current heads."
            )

    def check_heads(self, heads: Iterable[Any], what: str = "heads") -> list[Head]:
        """Validate a list of ``(layer, head)`` pairs; returns them as int tuples.

        Raises:
            InterventionError: For anything but ``(layer, head)`` pairs of existing heads, or a
                :class:`HeadList` chosen under other Mamba-1 channel groups than the view's.
        """
        self.check_group_origin(heads, what)
        if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(x, int) for x in heads):
            raise InterventionError(
                f"{what}={heads!r} is one (layer, head) pair; expected a list of pairs, e.g. "
                f"[{heads!r}]."
            )
        out: list[Head] = []
        for item in heads:
            if not _is_pair(item):
                raise InterventionError(
                    f"{what} contains {item!r}; expected (layer, head) pairs of ints, e.g. "
                    "[(3, 2), (4, 0)]."
                )
            layer, head = int(item[0]), int(item[1])
            lh = self[layer]
            if not 0 <= head < lh.n_heads:
                raise InterventionError(
                    f"{what} contains ({layer}, {head}) but layer {layer} ({lh.kind}) has "
                    f"{lh.n_heads} heads (0..{lh.n_heads - 1})."
                )
            out.append((layer, head))
        return out

    def to_dataframe(self) -> Any:
        """One row per part of each layer with heads (one row per layer, except for
        multi-part layers): layer, kind, n_heads, d_head, the hook names, the layer's index of
        the part's first head (``first_head``) and, for a ``"mixed"`` part, its
        ``attention_heads``."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "layer": lh.layer,
                    "kind": part.kind,
                    "n_heads": part.n_heads,
                    "d_head": part.d_head,
                    "pattern_hook": part.pattern_hook,
                    "z_hook": part.z_hook,
                    "scores_hook": part.scores_hook,
                    "first_head": part.offset,
                    "attention_heads": [
                        h for h in range(part.n_heads) if part.kind_of(h) == "attention"
                    ]
                    if part.kind == "mixed"
                    else None,
                }
                for lh in self
                for part in lh.parts
            ]
        )


def _is_pair(item: Any) -> bool:
    """Whether ``item`` is a ``(layer, head)`` pair of ints."""
    return (
        isinstance(item, tuple | list)
        and len(item) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
    )


def is_hooked_ssm(model: object) -> bool:
    """Whether ``model`` is a :class:`~gna_lens.models.HookedSSM` (else a TransformerLens model)."""
    from gna_lens.models import HookedSSM

    return isinstance(model, HookedSSM)


def _hooked_ssm_part(
    model: "HookedModel",
    layer: int,
    name: str,
    sets: tuple[tuple[int, ...], ...] | None,
    offset: int,
) -> LayerHeads:
    """The heads of HookedSSM block ``layer`` behind the hooks of its submodule ``name``
    (``"attn"``: an attention; ``"mixer"``: an SSM mixer), the first being the layer's head
    ``offset``."""
    cfg = model.cfg
    if name == "attn":
        return _attention_part(
            layer, cfg.n_attn_heads, cfg.attn_d_head, model.hook_dict, verified=True, offset=offset
        )
    if name != "mixer":
        raise InterventionError(
            f"internal: block {layer} names head part {name!r}; expected 'attn' or 'mixer'."
        )
    pre = f"blocks.{layer}.mixer."
    # A mixer with heads of both kinds (hybrid students) reports them one by one.
    kinds = model.blocks[layer].mixer.head_kinds
    found = set(kinds or ("ssm",))
    layer_kind: LayerKind = "mixed" if len(found) > 1 else found.pop()  # type: ignore[assignment]
    return LayerHeads(
        layer=layer,
        kind=layer_kind,
        n_heads=int(cfg.n_heads) if sets is None else len(sets),
        d_head=int(cfg.d_head),
        pattern_hook=pre + "hook_pattern",
        z_hook=pre + "hook_z",
        # pre-softmax scores cover every head only when all are attention heads
        scores_hook=pre + "hook_attn_scores" if layer_kind == "attention" else None,
        resid_pre_hook=f"blocks.{layer}.hook_resid_pre",
        verified=True,
        out_hook=f"blocks.{layer}.hook_mixer_out",
        channels=sets,
        n_channels=int(cfg.n_heads),
        head_kinds=tuple(kinds) if kinds is not None else None,  # type: ignore[arg-type]
        offset=offset,
        ssm_mixer=True,
    )


def _attention_part(
    layer: int, n_heads: int, d_head: int, hook_dict: Any, verified: bool, offset: int = 0
) -> LayerHeads:
    """The heads of ``blocks.{layer}.attn`` (scores and output hooks where the model has them)."""
    pre = f"blocks.{layer}.attn."
    scores, out = pre + "hook_attn_scores", f"blocks.{layer}.hook_attn_out"
    return LayerHeads(
        layer=layer,
        kind="attention",
        n_heads=int(n_heads),
        d_head=int(d_head),
        pattern_hook=pre + "hook_pattern",
        z_hook=pre + "hook_z",
        scores_hook=scores if scores in hook_dict else None,
        resid_pre_hook=f"blocks.{layer}.hook_resid_pre",
        verified=verified,
        out_hook=out if out in hook_dict else None,
        offset=offset,
    )


def _layer_of_parts(layer: int, parts: Sequence[LayerHeads]) -> LayerHeads | None:
    """A layer from its parts: ``None`` (no heads), the one part, or a multi-part layer."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    kinds = tuple(p.kind_of(h) for p in parts for h in range(p.n_heads))
    d_heads = {p.d_head for p in parts}
    mixed = len(set(kinds)) > 1
    return LayerHeads(
        layer=layer,
        kind="mixed" if mixed else kinds[0],
        n_heads=len(kinds),
        d_head=d_heads.pop() if len(d_heads) == 1 else 0,
        pattern_hook="",
        z_hook="",
        scores_hook=None,
        resid_pre_hook=parts[0].resid_pre_hook,
        verified=all(p.verified for p in parts),
        head_kinds=kinds if mixed else None,
        subparts=tuple(parts),
    )


def hook_points(model: object, who: str) -> tuple[Any, dict[str, Any], int]:
    """A TransformerLens-style model's ``cfg``, ``hook_dict`` and ``cfg.n_layers``.

    Raises:
        InterventionError: If it has no hook points or no ``cfg.n_layers`` (``who`` names the
            caller).
    """
    cfg: Any = getattr(model, "cfg", None)
    hook_dict = getattr(model, "hook_dict", None)
    n_layers = getattr(cfg, "n_layers", None)
    if not isinstance(hook_dict, dict) or not isinstance(n_layers, int):
        raise InterventionError(
            f"{who} got a {type(model).__name__}; expected a TransformerLens model with "
            "hook points and cfg.n_layers (a TransformerBridge or a gna_lens.HookedSSM). Fix: "
            "load it with gna_lens.load_model(name) or TransformerBridge.boot_transformers(name)."
        )
    return cfg, hook_dict, n_layers


def head_view(model: "ModelLike") -> HeadView:
    """The head view of a TransformerBridge, a HookedSSM or any TransformerLens-style model.

    Args:
        model: A ``transformer_lens.model_bridge.TransformerBridge``, a
            :class:`~gna_lens.models.HookedSSM`, or a hooked model exposing ``cfg.n_layers``,
            ``hook_dict`` and ``blocks.{l}.attn.hook_pattern`` / ``hook_z``.

    Returns:
        A :class:`HeadView`.

    Raises:
        InterventionError: If the model has no hook points or no addressable heads.
    """
    if isinstance(model, Subject):
        return model.view
    cfg, hook_dict, n_layers = hook_points(model, "head_view")
    layers: list[LayerHeads | None] = []
    if is_hooked_ssm(model):
        ssm: Any = model
        groups = ssm.head_group_spec
        for layer, block in enumerate(ssm.blocks):
            # The block names the submodules holding its heads, in numbering order
            # (SSMBlock.head_parts): one for most layers, two for Falcon-H1 and Zamba2.
            parts: list[LayerHeads] = []
            for name in block.head_parts:
                offset = sum(p.n_heads for p in parts)
                parts.append(_hooked_ssm_part(model, layer, name, groups.get(layer), offset))
            layers.append(_layer_of_parts(layer, parts))
    else:
        for layer in range(n_layers):
            pre = f"blocks.{layer}.attn."
            if pre + "hook_pattern" in hook_dict and pre + "hook_z" in hook_dict:
                layers.append(_attention_part(layer, cfg.n_heads, cfg.d_head, hook_dict, False))
            else:
                layers.append(None)
    if not any(lh is not None for lh in layers):
        raise InterventionError(
            f"This {type(model).__name__} ({n_layers} layers) exposes no heads: no layer has "
            "blocks.{l}.attn.hook_pattern and hook_z. For Mamba-family models use "
            "gna_lens.HookedSSM (gna_lens.load_model)."
        )
    return HeadView(
        model_type=type(model).__name__,
        model_name=str(getattr(cfg, "model_name", "") or ""),
        n_layers=n_layers,
        layers=tuple(layers),
    )


# Verdicts of require_editable, per model: {(layer, target): None (ok) or the reason}.
_VERDICTS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, str], str | None]]" = (
    weakref.WeakKeyDictionary()
)


@runtime_checkable
class HookedModel(Protocol):
    """What gna_lens needs of a model: a TransformerLens-style hooked model.

    A ``transformer_lens.model_bridge.TransformerBridge`` and a :class:`~gna_lens.HookedSSM` both
    are one (``isinstance(model, HookedModel)``); so is any model with a config, hook points and
    the hooked runs. Every public function that takes a model takes a :data:`ModelLike`: such a
    model, or the :class:`Subject` a caller built from one.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> isinstance(tiny_hooked_ssm("mamba2"), HookedModel), isinstance("gpt2", HookedModel)
        (True, False)
    """

    @property
    def cfg(self) -> Any:
        """The model's config (``n_layers``, ``d_model``, ...)."""

    @property
    def hook_dict(self) -> dict[str, Any]:
        """Every hook point by name (``blocks.{l}.hook_resid_pre``, ...)."""

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any:
        """A forward pass with temporary hooks."""

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any:
        """A forward pass that caches activations."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A forward pass."""

    def __getattr__(self, name: str) -> Any:
        """Anything else the model has (``blocks``, ``tokenizer``, ``to_tokens``, ...), as
        ``torch.nn.Module`` provides it."""


@dataclass(frozen=True)
class Subject:
    """The model under study with the answers to its architecture questions, asked once.

    A public function builds it once (:meth:`of`) and hands it down; every public function that
    takes a model accepts a ``Subject`` too (``Subject.of`` returns it unchanged).

    Attributes:
        model: The TransformerBridge or HookedSSM itself (what runs).
        view: Its :class:`HeadView`.
        policy: Where its tensors live and in what dtype (:class:`~gna_lens.device.DevicePolicy`).
        is_ssm: Whether it is a :class:`~gna_lens.models.HookedSSM` (else a TransformerLens
            model: the bridge's paths).

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> s = Subject.of(tiny_hooked_ssm("bamba"))
        >>> s.is_ssm, s.view.n_layers, s.device.type, Subject.of(s) is s
        (True, 3, 'cpu', True)
    """

    model: HookedModel
    view: HeadView
    policy: DevicePolicy
    is_ssm: bool

    @classmethod
    def of(cls, model: "ModelLike") -> "Subject":
        """The subject of ``model`` (a ``Subject`` is returned as it is).

        Raises:
            InterventionError: If the model has no hook points or no addressable heads (as
                :func:`head_view`).
        """
        if isinstance(model, Subject):
            return model
        return cls(model, head_view(model), DevicePolicy.of(model), is_hooked_ssm(model))

    @property
    def device(self) -> torch.device:
        """The model's device (inputs, masks and caches go here)."""
        return self.policy.device


#: What a public function takes as its model: a :class:`HookedModel` (TransformerBridge,
#: HookedSSM) or the :class:`Subject` built from one.
ModelLike = HookedModel | Subject


def model_of(model: "ModelLike") -> HookedModel:
    """The model itself, from a model or a :class:`Subject`."""
    return model.model if isinstance(model, Subject) else model


def policy_of(model: "ModelLike") -> DevicePolicy:
    """The device / precision policy of a model or a :class:`Subject` (asked once there)."""
    return model.policy if isinstance(model, Subject) else DevicePolicy.of(model)


def probe_tokens(model: HookedModel) -> Tensor:
    """Six fixed token ids ``[1, 6]`` on the model's device, for the probes that check an edit
    takes effect."""
    vocab = int(getattr(model.cfg, "d_vocab", 0) or 0) or 2
    return ((DevicePolicy.of(model).arange(6) * 7 + 3) % vocab)[None]


def uncomparable_outputs(base: Any, out: Any, call: str) -> str | None:
    """Why a probe's outputs without and with an edit cannot show the edit's effect, or ``None``.

    The editability probes fail closed: unless both outputs are finite tensors of one shape,
    the edit is not shown to take effect and the caller refuses the layer.

    Args:
        base: The output without the edit.
        out: The output with the edit.
        call: The call that produced them, for the message.

    Examples:
        >>> uncomparable_outputs(torch.zeros(2), torch.ones(2), "f(x)") is None
        True
        >>> uncomparable_outputs(torch.zeros(2), (torch.ones(2),), "f(x)")
        'cannot be shown to take effect: f(x) returned (Tensor, tuple) without and with the edit, not tensors to compare'
    """
    if not isinstance(out, Tensor) or not isinstance(base, Tensor):
        got = ", ".join(type(x).__name__ for x in (base, out))
        return (
            f"cannot be shown to take effect: {call} returned ({got}) without and with the "
            "edit, not tensors to compare"
        )
    if out.shape != base.shape:
        return (
            f"cannot be shown to take effect: the output of {call} has shape "
            f"{tuple(base.shape)} without the edit and {tuple(out.shape)} with it"
        )
    if not bool(torch.isfinite(base).all()) or not bool(torch.isfinite(out).all()):
        return f"cannot be shown to take effect: the output of {call} is not finite"
    return None


def edit_ignored(
    model: HookedModel,
    name: str,
    edit: Any,
    unchanged: str,
    stop: int | None = None,
    watch: str | None = None,
) -> str | None:
    """Why an edit returned from hook ``name`` would not reach the output, or ``None``.

    Runs a 6-token forward (up to layer ``stop``) without and with ``edit(x) -> x'``, and fails
    closed: unless ``name`` (and ``watch``, when given) fired, both outputs are finite tensors of
    one shape and the edited one is measurably different, it returns the reason (``unchanged``
    when the output did not change).
    """
    fired: set[str] = set()

    def run_edit(x: Tensor, hook: Any) -> Tensor:
        fired.add(name)
        return cast(Tensor, edit(x))

    def seen(x: Tensor, hook: Any) -> None:
        fired.add(str(watch))

    tokens = probe_tokens(model)
    kwargs = {} if stop is None else {"stop_at_layer": stop}
    hooks = [(name, run_edit)] + ([(watch, seen)] if watch else [])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = model(tokens, **kwargs)
        with model.hooks(fwd_hooks=hooks):
            out = model(tokens, **kwargs)
    for hook_name in (name, watch):
        if hook_name and hook_name not in fired:
            return (
                f"would be silently ignored: the hook {hook_name} never fired during a forward pass"
            )
    call = "model(tokens)" if stop is None else f"model(tokens, stop_at_layer={stop})"
    failure = uncomparable_outputs(base, out, call)
    if failure is not None:
        return failure
    if float((out - base).abs().max()) <= 1e-6 * (float(base.abs().max()) + 1e-12):
        return unchanged
    return None


def cached_verdict(store: Any, model: HookedModel, key: Any, probe: Any, *args: Any) -> str | None:
    """``probe(*args)``'s verdict on ``key`` (``None``: the edit takes effect), cached per model
    in ``store`` (a ``WeakKeyDictionary``); a model that cannot be weak-referenced is probed
    every time."""
    try:
        verdicts = store.setdefault(model, {})
    except TypeError:
        verdicts = {}
    if key not in verdicts:
        verdicts[key] = probe(*args)
    return cast("str | None", verdicts[key])


def _probe(model: HookedModel, lh: LayerHeads, target: EditTarget) -> str | None:
    """The reason an edit of ``target`` fails (:func:`edit_ignored`) in the first of the layer's
    parts that holds it (a multi-part layer's scores: its attention parts), or None."""

    def edit(x: Tensor) -> Tensor:
        if target == "scores":
            y = torch.full_like(x, torch.finfo(x.dtype).min)
            y[..., 0] = 0.0  # every query attends to the first key only
            return y
        return torch.zeros_like(x)

    attn = type(_attn_module(model, lh.layer)).__name__
    parts = [p for p in lh.parts if target != "scores" or p.scores_hook is not None]
    for part in parts or lh.parts[:1]:
        name = part.hook(target)
        unchanged = (
            f"would be silently ignored: an edit returned from {name} did not change the "
            f"layer's output: this attention ({attn}) computes its output inside the wrapped "
            "Hugging Face module and only reports the pattern afterwards"
        )
        reason = edit_ignored(model, name, edit, unchanged, stop=lh.layer + 1)
        if reason is not None:
            return reason
    return None


def _attn_module(model: HookedModel, layer: int) -> Any:
    try:
        return model.blocks[layer].attn
    except (AttributeError, IndexError, TypeError):
        return model


def require_editable(
    model: "ModelLike", view: HeadView, layers: Iterable[int], target: EditTarget
) -> None:
    """Make sure edits of ``target`` at ``layers`` change the model's output, or refuse.

    HookedSSM layers always pass. Other models are checked once per (layer, target) with a
    6-token forward pass up to that layer, with and without an edit; the verdict is cached on the
    model.

    Args:
        model: The model ``view`` describes.
        view: Its :func:`head_view`.
        layers: Layers about to be edited.
        target: ``"pattern"`` (post-softmax), ``"scores"`` (pre-softmax) or ``"z"``.

    Raises:
        PatternEditError: If an edit would be discarded, the hook never fires, or the probe cannot
            show the edit takes effect (the output is not a tensor, changes shape or is not
            finite).
    """
    net = model_of(model)
    for layer in sorted(set(layers)):
        lh = view[layer]
        if lh.verified:
            continue
        reason = cached_verdict(_VERDICTS, net, (layer, target), _probe, net, lh, target)
        if reason is not None:
            what = {
                "pattern": "post-softmax pattern edits (mask_patterns mode='post')",
                "scores": "pre-softmax score edits (mask_patterns mode='pre')",
                "z": "head-output edits (ablation, patching)",
            }[target]
            raise PatternEditError(
                f"{view.model_type} layer {layer}: {what} {reason}. Refusing instead of "
                "returning results an edit may not have reached. Fix: load the model with an "
                "attention implementation that computes the pattern itself (for a "
                "TransformerBridge, an architecture whose attention bridge re-implements "
                "attention, e.g. Llama/Mistral/Qwen-style position-embedding attention, with "
                "attn_implementation='eager'), or use the other mode."
            )


def normalize_head_sets(view: HeadView, heads: Any, what: str = "heads") -> list[tuple[Head, ...]]:
    """``None`` -> every head alone; a list of pairs -> each alone; a list of lists -> sets.

    Raises:
        InterventionError: For malformed input, unknown heads or empty sets.
    """
    if heads is None:
        return [(h,) for h in view.heads()]
    if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(x, int) for x in heads):
        view.check_heads(heads, what)  # raises with the right message
    view.check_group_origin(heads, what)
    items = list(heads)
    if not items:
        raise InterventionError(f"{what}=[] is empty; expected (layer, head) pairs or head sets.")
    out: list[tuple[Head, ...]] = []
    for item in items:
        if _is_pair(item):
            out.append(tuple(view.check_heads([item], what)))
        elif isinstance(item, Sequence | set | frozenset) and not isinstance(item, str):
            view.check_group_origin(item, what)
            group = view.check_heads(list(item), what)
            if not group:
                raise InterventionError(f"{what} contains an empty head set; drop it.")
            out.append(tuple(sorted(set(group))))
        else:
            raise InterventionError(
                f"{what} contains {item!r}; expected (layer, head) pairs, or lists of pairs for "
                "head sets ablated together, e.g. [(3, 2), [(4, 0), (4, 1)]]."
            )
    return out


def head_output_weights(model: "ModelLike", layer: int, part: int | None = None) -> Tensor | None:
    """``W_O`` of ``layer``: ``[head_index, d_head, d_model]``, so that the layer's ``out_hook``
    is ``einsum(z, W_O) + bias``; ``None`` when the model does not expose it. Indexed like
    ``hook_z`` (per channel for Mamba-1, whether or not its channels are grouped).

    HookedSSM: the mixer's ``out_proj`` (SSM layers and the hybrid students' mixed layers) or
    the attention's ``o_proj``; other models: ``blocks[layer].attn.W_O`` (TransformerLens's
    convention).

    Args:
        model: The model.
        layer: The layer.
        part: For a multi-part layer (:attr:`LayerHeads.parts`), which part's ``W_O`` (its
            ``hook_z`` and ``out_hook``); ``None`` for a single-part layer.

    Raises:
        InterventionError: For a multi-part layer without ``part``, or a part it does not have.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("falcon_h1")  # SSM heads, then the parallel attention's
        >>> [tuple(head_output_weights(model, 1, part=i).shape) for i in (0, 1)]
        [(8, 8, 32), (4, 8, 32)]
    """
    subject = Subject.of(model)
    model = subject.model
    layer_heads = subject.view[layer]
    if part is None and layer_heads.multipart:
        raise InterventionError(
            f"head_output_weights(model, {layer}): layer {layer} has {len(layer_heads.parts)} "
            "parts, each with its own hook_z and output projection; pass part=i for "
            f"head_view(model)[{layer}].parts[i] (0..{len(layer_heads.parts) - 1})."
        )
    if part is not None and not 0 <= part < len(layer_heads.parts):
        raise InterventionError(
            f"head_output_weights(model, {layer}, part={part}): layer {layer} has "
            f"{len(layer_heads.parts)} part(s) (0..{len(layer_heads.parts) - 1})."
        )
    lh = layer_heads.parts[part or 0]
    in_attn = lh.z_hook.startswith(f"blocks.{layer}.attn.")  # else the mixer's hook_z
    try:
        if subject.is_ssm:
            block = model.blocks[layer]
            proj = block.attn.o_proj if in_attn else block.mixer.out_proj
            weight = proj.weight
        else:
            w = model.blocks[layer].attn.W_O
            return w if isinstance(w, Tensor) and w.shape[:2] == (lh.n_heads, lh.d_head) else None
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    w_o = weight.T.reshape(lh.n_channels, lh.d_head, -1)
    # out_hook is the output times the block's multiplier (Granite, Falcon-H1)
    which = "attention" if in_attn else "ssm"
    mult = float(model.blocks[layer].out_multiplier(which)) if subject.is_ssm else 1.0
    return cast("Tensor | None", w_o if mult == 1.0 else w_o * mult)


def describe_head_groups(view: HeadView) -> str:
    """One line on the view's Mamba-1 channel groups (``""`` when every head is a head).

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba1")
        >>> with model.head_groups({0: 16, 1: [[3, 40], [7]]}):
        ...     print(describe_head_groups(head_view(model)))
        Mamba-1 channel groups as heads: layer 0: 4 blocks of 16 channels; layer 1: 2 channel sets (2, 1 channels)

        The same blocks in every SSM layer of a deeper model are one entry:

        >>> model = tiny_hooked_ssm("mamba1", num_hidden_layers=3)
        >>> with model.head_groups(16):
        ...     print(describe_head_groups(head_view(model)))
        Mamba-1 channel groups as heads: every SSM layer (3): 4 blocks of 16 channels
    """
    return _describe_group_spec(view.group_spec, view)


def _describe_group_spec(spec: GroupSpec, view: HeadView) -> str:
    """:func:`describe_head_groups` of the groups ``spec`` on ``view``'s model (``""``: none)."""
    parts: list[tuple[int, str]] = []
    for layer, channels in spec:
        sizes = [len(c) for c in channels]
        contiguous = all(c == tuple(range(c[0], c[0] + len(c))) for c in channels)
        if contiguous and len(set(sizes)) == 1 and sum(sizes) == view[layer].n_channels:
            parts.append((layer, f"{len(channels)} blocks of {sizes[0]} channels"))
        else:
            shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
            parts.append((layer, f"{len(channels)} channel sets ({shown} channels)"))
    if not parts:
        return ""
    head = "Mamba-1 channel groups as heads: "
    n_ssm = sum(1 for lh in view if lh is not None and lh.kind == "ssm")
    if len(parts) == n_ssm > 2 and len({text for _, text in parts}) == 1:
        return head + f"every SSM layer ({n_ssm}): {parts[0][1]}"
    return head + "; ".join(f"layer {layer}: {text}" for layer, text in parts)


def head_patterns(
    pattern: Float[Tensor, "batch channel query_pos key_pos"], layer_heads: LayerHeads
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """Per head of ``layer_heads``, its pattern from a ``hook_pattern`` tensor.

    For a layer without channel groups the pattern is returned unchanged. For a grouped Mamba-1
    layer, group ``g``'s pattern is the **mean over its channels of the row-normalized absolute
    matrices** ``|α_e[i, j]| / Σ_j' |α_e[i, j']|``, a row-stochastic matrix like an attention
    pattern. Why this aggregation: a channel's ``α`` is signed and its scale varies by orders of
    magnitude across channels (``Δ``, ``B``, ``C`` and the decays), so a plain mean cancels signs
    and an absolute mean is one loud channel; normalizing each channel's rows first is exactly the
    transform every head's rows get before scoring (:data:`gna_lens.scoring.patterns.NORMALIZATION`),
    so each channel counts equally and a group's gather and aggregate shares are the means of its
    channels' shares. :func:`~gna_lens.scoring.pattern_scores` aggregates the same way (with the
    BOS column dropped before normalizing, as for every head).

    Args:
        pattern: ``[batch, channel, query_pos, key_pos]``, the layer's cached ``hook_pattern``
            over every channel (or any rows of it: rows are normalized independently).
        layer_heads: The layer's :class:`LayerHeads` (from :func:`head_view`).

    Returns:
        ``[batch, head_index, query_pos, key_pos]``.

    Raises:
        InterventionError: If ``pattern`` does not have the layer's ``n_channels`` heads.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba1")
        >>> _, cache = model.run_with_cache("a b c", names_filter="blocks.0.mixer.hook_pattern")
        >>> with model.head_groups(16):
        ...     groups = head_patterns(cache["blocks.0.mixer.hook_pattern"], head_view(model)[0])
        >>> tuple(groups.shape), round(float(groups[0, 2, -1].sum()), 6)
        ((1, 4, 4, 4), 1.0)
    """
    if pattern.ndim != 4 or pattern.shape[1] != layer_heads.n_channels:
        raise InterventionError(
            f"head_patterns: pattern of shape {tuple(pattern.shape)}; expected [batch, "
            f"{layer_heads.n_channels}, query_pos, key_pos] (layer {layer_heads.layer}'s "
            "hook_pattern over every channel)."
        )
    if layer_heads.channels is None:
        return pattern
    w = pattern.abs()
    w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
    mean = layer_heads.membership().to(w)
    mean = mean / mean.sum(-1, keepdim=True)
    return torch.einsum("gc,bcqk->bgqk", mean, w)
