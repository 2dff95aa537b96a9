"""Sample-specific pattern masks (Gather, Aggregate, their complements, your own) and applying
them to attention heads and SSM heads alike.

A mask is a ``[query_pos, key_pos]`` tensor (or ``[batch, query_pos, key_pos]`` for a padded
batch) of *keep* weights: ``True`` / 1 keeps an entry of the pattern, ``False`` / 0 removes it.
Rows a mask does not constrain are all ``True``.

:func:`mask_patterns` applies masks inside a ``with`` block. ``mode="pre"`` sets removed scores
to the dtype's minimum before the softmax of attention heads (a query row with no kept key gets an
all-zero row). SSM heads have no softmax: there ``"pre"`` multiplies the materialized matrix as
``"post"`` does. In a layer of a hybrid student whose heads are of both kinds (no scores hook
covers every head), ``"pre"`` on an attention head keeps the entries a mask keeps and divides each
row by its sum: the softmax over the kept keys, the same numbers.

SSM heads are edited through HookedSSM's materialized ``hook_pattern`` (only the masked heads and
the query rows a mask changes, see ``HookedSSM.pattern_selection``), in float32 or float64.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import InterventionError, PatternEditError
from gna_lens.heads import Head, HeadView, ModelLike, Subject, require_editable
from gna_lens.interventions.hooks import hooked
from gna_lens.tasks import Batch, Sample

__all__ = ["aggregate_mask", "gather_mask", "mask_patterns", "pattern_mask_hooks", "stack_masks"]

MaskMode = Literal["post", "pre"]
HookFn = Callable[..., Tensor]


def _sample_gather(s: Sample, complement: bool) -> Tensor:
    n = s.n_tokens
    m = torch.ones(n, n, dtype=torch.bool, device=HOST)
    for (a, b), p in zip(s.segments, s.summary_positions, strict=True):
        inside = torch.zeros(n, dtype=torch.bool, device=HOST)
        inside[a:b] = True
        m[p] = ~inside if complement else inside
    return m


def _sample_aggregate(s: Sample, complement: bool) -> Tensor:
    n = s.n_tokens
    m = torch.ones(n, n, dtype=torch.bool, device=HOST)
    summary = torch.zeros(n, dtype=torch.bool, device=HOST)
    summary[list(s.summary_positions)] = True
    m[s.query_position] = ~summary if complement else summary
    return m


def stack_masks(batch: Batch, masks: Sequence[Tensor] | Callable[[Sample], Tensor]) -> Tensor:
    """Place per-sample masks ``[n_i, n_i]`` into a padded batch's ``[batch, pos, pos]``.

    Each sample's mask is shifted by its left-padding offset; entries outside the sample are
    ``True`` (padding is masked by the attention mask anyway).

    Args:
        batch: A padded :class:`~gna_lens.tasks.Batch` (``task.batches(...)``).
        masks: One mask per sample, or a function ``sample -> mask``.

    Returns:
        ``[batch, pos, pos]`` bool (or float if any mask is float).
    """
    per = [masks(s) for s in batch.samples] if callable(masks) else list(masks)
    if len(per) != len(batch):
        raise InterventionError(
            f"stack_masks got {len(per)} masks for a batch of {len(batch)} samples; expected one "
            "per sample."
        )
    W = int(batch.input_ids.shape[1])
    dtype = torch.bool if all(m.dtype == torch.bool for m in per) else torch.float32
    out = torch.ones(len(per), W, W, dtype=dtype, device=HOST)
    for b, (m, s, off) in enumerate(zip(per, batch.samples, batch.offsets, strict=True)):
        n = s.n_tokens
        if tuple(m.shape) != (n, n):
            raise InterventionError(
                f"mask {b} has shape {tuple(m.shape)} but sample {batch.indices[b]} has {n} "
                f"tokens; expected [{n}, {n}] (query_pos, key_pos)."
            )
        out[b, off : off + n, off : off + n] = m.to(dtype)
    return out


def _build(x: Sample | Batch, fn: Callable[[Sample, bool], Tensor], complement: bool) -> Tensor:
    if isinstance(x, Sample):
        return fn(x, complement)
    if isinstance(x, Batch):
        return stack_masks(x, lambda s: fn(s, complement))
    raise InterventionError(
        f"expected a gna_lens.tasks.Sample or Batch; got {type(x).__name__}. Build masks from "
        "task[i] or from a batch of task.batches(...)."
    )


def gather_mask(
    sample: Sample | Batch, *, complement: bool = False
) -> Bool[Tensor, "query_pos key_pos"] | Bool[Tensor, "batch query_pos key_pos"]:
    """Each summary token attends only within its own segment (other rows unconstrained).

    Args:
        sample: A :class:`~gna_lens.tasks.Sample` (``[n, n]``) or a padded
            :class:`~gna_lens.tasks.Batch` (``[batch, pos, pos]``, spans shifted per row).
        complement: Instead forbid each summary token its own segment (keep everything else).

    Returns:
        A bool keep-mask.

    Examples:
        >>> from gna_lens.tasks import build_sample
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> tok = word_tokenizer(["red", "blue", "pick"])
        >>> s = build_sample(tok, "red\\nblue\\npick", [(0, 4), (4, 9)], answer_segment=1,
        ...                  choices=[" red", " blue"])
        >>> gather_mask(s)[3].int().tolist()  # summary of segment 1 = tokens 2..3
        [0, 0, 1, 1, 0]
    """
    return _build(sample, _sample_gather, complement)


def aggregate_mask(
    sample: Sample | Batch, *, complement: bool = False
) -> Bool[Tensor, "query_pos key_pos"] | Bool[Tensor, "batch query_pos key_pos"]:
    """The query (final) position attends only to the summary tokens (other rows unconstrained).

    Args:
        sample: A :class:`~gna_lens.tasks.Sample` or a padded :class:`~gna_lens.tasks.Batch`.
        complement: Instead forbid the query the summary tokens (keep everything else).

    Returns:
        A bool keep-mask.

    Examples:
        >>> from gna_lens.tasks import build_sample
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> tok = word_tokenizer(["red", "blue", "pick"])
        >>> s = build_sample(tok, "red\\nblue\\npick", [(0, 4), (4, 9)], answer_segment=1,
        ...                  choices=[" red", " blue"])
        >>> aggregate_mask(s)[4].int().tolist()
        [0, 1, 0, 1, 0]
    """
    return _build(sample, _sample_aggregate, complement)


# ----------------------------------------------------------------------------- applying masks
def _check_masks(
    view: HeadView, masks: Mapping[Head, Any]
) -> dict[tuple[int, int], dict[int, Tensor]]:
    """The masks per part of a layer, keyed ``(layer, part index)`` (a single-part layer's part
    is 0), and within it by the hook tensors' head-axis index."""
    if not isinstance(masks, Mapping) or not masks:
        raise InterventionError(
            f"masks={type(masks).__name__}; expected a non-empty dict {{(layer, head): mask}}, "
            "e.g. {(3, 2): gna_lens.gather_mask(batch)}."
        )
    per_part: dict[tuple[int, int], dict[int, Tensor]] = {}
    for key, mask in masks.items():
        (layer, head) = view.check_heads([key], "masks")[0]
        if not isinstance(mask, Tensor) or mask.ndim not in (2, 3):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise InterventionError(
                f"masks[{key}] is {got}; expected a tensor [query_pos, key_pos] or "
                "[batch, query_pos, key_pos] (e.g. gna_lens.gather_mask(batch))."
            )
        if mask.shape[-1] != mask.shape[-2]:
            raise InterventionError(
                f"masks[{key}] has shape {tuple(mask.shape)}; expected square [.., pos, pos] "
                "(query positions x key positions of the whole input)."
            )
        m = mask if mask.ndim == 3 else mask[None]
        if m.dtype != torch.bool and not m.is_floating_point():
            m = m != 0
        part, local = view.part_of((layer, head))
        index = view[layer].parts.index(part)
        for channel in part.members(local):  # a Mamba-1 group masks each of its channels
            per_part.setdefault((layer, index), {})[channel] = m
    return per_part


def _mask_for(
    layer: int,
    heads: dict[int, Tensor],
    shape: torch.Size,
    head_idx: Tensor | None,
    row_idx: Tensor | None,
    device: torch.device,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """(keep ``[b|1, H_sel, R_sel, L]`` as float, which-heads ``[H_sel]``) for one pattern
    (``offset``: the layer's index of the pattern's first head, for messages)."""
    b, H, R, L = shape
    sel_heads = head_idx.tolist() if head_idx is not None else list(range(H))
    keep = torch.ones((1, H, R, L), device=device)
    touched = torch.zeros(H, dtype=torch.bool, device=device)
    for h, m in heads.items():
        if h not in sel_heads:
            raise PatternEditError(
                f"the mask for ({layer}, {offset + h}) would be silently dropped: this forward pass "
                f"materializes only heads {sel_heads} of layer {layer} (an enclosing "
                "model.pattern_selection(heads=...)). Fix: apply masks with "
                "gna_lens.mask_patterns, which selects the masked heads and rows itself, or "
                f"include head {h} of layer {layer} in pattern_selection."
            )
        if m.shape[-1] != L or m.shape[0] not in (1, b):
            raise PatternEditError(
                f"the mask for ({layer}, {offset + h}) has shape {tuple(m.shape)} but the pattern of this "
                f"forward pass is [batch={b}, head_index, query_pos={L if row_idx is None else 'sel'}"
                f", key_pos={L}]; expected [{L}, {L}] or [{b}, {L}, {L}]. Build masks for the "
                "inputs you run (e.g. gna_lens.gather_mask(batch) for that batch)."
            )
        mm = m.to(device=device, dtype=torch.float32)
        if row_idx is not None:
            _check_rows_selected(layer, offset + h, mm, row_idx.to(device))
            mm = mm.index_select(1, row_idx.to(device))
        if keep.shape[0] != mm.shape[0]:
            keep = keep.expand(mm.shape[0], -1, -1, -1).clone()
        k = sel_heads.index(h)
        keep[:, k] = mm
        touched[k] = True
    return keep, touched


def _changed_rows(m: Tensor) -> Tensor:
    """``[query_pos]`` bool: the rows where a keep-mask ``[b|1, q, k]`` changes the pattern
    (an entry other than 1 on or below the diagonal)."""
    L = m.shape[-1]
    causal = torch.ones(m.shape[-2], L, dtype=torch.bool, device=m.device).tril()
    return ((m.to(torch.float32) != 1) & causal).reshape(-1, m.shape[-2], L).any(0).any(-1)


def _check_rows_selected(layer: int, head: int, mask: Tensor, row_idx: Tensor) -> None:
    """Refuse a mask whose changed rows are not all materialized in this forward pass."""
    selected = torch.zeros(mask.shape[-2], dtype=torch.bool, device=mask.device)
    selected[row_idx] = True
    missing = (_changed_rows(mask) & ~selected).nonzero().flatten().tolist()
    if missing:
        raise PatternEditError(
            f"the mask for ({layer}, {head}) changes query rows {missing}, but this forward pass "
            f"materializes only rows {row_idx.tolist()} of layer {layer} (an enclosing "
            "model.pattern_selection(query_positions=...)): those rows would be silently left "
            "unmasked. Fix: apply masks with gna_lens.mask_patterns, which selects the rows "
            "itself, or include those rows in pattern_selection."
        )


def pattern_mask_hooks(
    model: ModelLike, masks: Mapping[Head, Tensor], mode: MaskMode = "post"
) -> list[tuple[str, HookFn]]:
    """Hooks ``(hook_name, fn)`` applying ``masks`` to head patterns (see :func:`mask_patterns`).

    For a HookedSSM with masked SSM heads, also wrap the forward in
    ``model.pattern_selection(...)`` (as :func:`mask_patterns` does) or every head of those layers
    is materialized; the result is the same.
    """
    if mode not in ("post", "pre"):
        raise InterventionError(f"mode={mode!r}; expected 'post' or 'pre'.")
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    net: Any = model  # the model's own extras (SSM mixers, pattern selection)
    per_part = _check_masks(view, masks)
    parts = {key: view[key[0]].parts[key[1]] for key in per_part}
    attn_layers = sorted({key[0] for key, part in parts.items() if part.kind == "attention"})
    # SSM parts and mixed ones (hybrid students) are edited through the pattern
    other_layers = sorted({key[0] for key, part in parts.items() if part.kind != "attention"})
    if attn_layers:
        require_editable(model, view, attn_layers, "scores" if mode == "pre" else "pattern")
    if other_layers:
        require_editable(model, view, other_layers, "pattern")
    mixers = net.ssm_mixers() if subject.is_ssm else {}
    hooks: list[tuple[str, HookFn]] = []
    for (layer, index), heads in sorted(per_part.items()):
        lh = parts[(layer, index)]
        # the mixer whose pattern_selection says which heads and rows its pattern holds
        mixer = mixers.get(layer) if lh.ssm_mixer else None
        if lh.kind == "attention" and mode == "pre":
            hooks.append((lh.hook("scores"), _scores_hook(layer, heads, lh.offset)))
            empty = _empty_rows(heads)
            if empty is not None:
                require_editable(model, view, [layer], "pattern")
                hooks.append((lh.pattern_hook, _zero_rows_hook(layer, heads, empty)))
        else:
            # "pre" on the attention heads of a mixed layer: keep, then renormalize the rows
            renorm = frozenset(
                h
                for h in heads
                if mode == "pre" and lh.kind == "mixed" and lh.kind_of(h) == "attention"
            )
            heads = {h: (m != 0) if h in renorm else m for h, m in heads.items()}
            hooks.append((lh.pattern_hook, _pattern_hook(layer, heads, mixer, renorm, lh.offset)))
    return hooks


def _pattern_hook(
    layer: int,
    heads: dict[int, Tensor],
    mixer: Any,
    renorm: frozenset[int] = frozenset(),
    offset: int = 0,
) -> HookFn:
    """Multiply the pattern by the keep masks; the rows of the heads in ``renorm`` are then
    divided by their sums (the softmax over the kept keys; an empty row stays zero)."""
    cache: dict[Any, tuple[Tensor, Tensor]] = {}

    def hook(pattern: Tensor, hook: Any) -> Tensor:
        head_idx, row_idx = (None, None)
        if mixer is not None:
            head_idx, row_idx = mixer.last_pattern_index
        key = (
            tuple(pattern.shape),
            None if head_idx is None else tuple(head_idx.tolist()),
            None if row_idx is None else tuple(row_idx.tolist()),
        )
        if key not in cache:
            cache.clear()
            cache[key] = _mask_for(
                layer, heads, pattern.shape, head_idx, row_idx, pattern.device, offset
            )
        keep, _ = cache[key]
        out = pattern * keep.to(pattern.dtype)
        if renorm:
            chosen = range(pattern.shape[1]) if head_idx is None else head_idx.tolist()
            pos = torch.tensor([i for i, c in enumerate(chosen) if c in renorm], device=out.device)
            rows = out.index_select(1, pos)
            total = rows.sum(-1, keepdim=True)
            rows = torch.where(total > 0, rows / total.clamp(min=torch.finfo(rows.dtype).tiny), 0.0)
            out = out.index_copy(1, pos, rows)
        return out

    return hook


def _scores_hook(layer: int, heads: dict[int, Tensor], offset: int = 0) -> HookFn:
    def hook(scores: Tensor, hook: Any) -> Tensor:
        keep, touched = _mask_for(layer, heads, scores.shape, None, None, scores.device, offset)
        removed = (keep == 0) & touched[None, :, None, None]
        return scores.masked_fill(removed, torch.finfo(scores.dtype).min)

    return hook


def _empty_rows(heads: dict[int, Tensor]) -> dict[int, Tensor] | None:
    """Per head, ``[b|1, q]`` rows whose kept keys (within the causal triangle) are none."""
    out = {}
    for h, m in heads.items():
        L = m.shape[-1]
        causal = torch.ones(L, L, dtype=torch.bool, device=m.device).tril()
        rows = ~(m.bool() & causal).any(-1)
        if bool(rows.any()):
            out[h] = rows
    return out or None


def _zero_rows_hook(layer: int, heads: dict[int, Tensor], empty: dict[int, Tensor]) -> HookFn:
    def hook(pattern: Tensor, hook: Any) -> Tensor:
        out = pattern.clone()
        for h, rows in empty.items():
            r = rows.to(pattern.device)
            out[:, h] = out[:, h].masked_fill(r[..., None], 0.0)
        return out

    return hook


def _selection(model: ModelLike, view: HeadView, masks: Mapping[Head, Tensor]) -> Any:
    """(heads per mixer layer, query rows any mask changes) for ``pattern_selection``."""
    heads: dict[int, list[int]] = {}
    rows: set[int] = set()
    whole = False
    for (layer, head), m in masks.items():
        part, local = view.part_of((layer, head))
        if not part.ssm_mixer:  # attention always materializes its pattern
            continue
        heads.setdefault(layer, []).extend(part.members(local))
        idx = _changed_rows(m).nonzero().flatten().tolist()
        if not idx:
            whole = True  # an all-ones mask still runs through the materialized path
        rows.update(idx)
    if not heads:
        return None
    return heads, (None if whole or not rows else sorted(rows))


@contextmanager
def mask_patterns(
    model: ModelLike, masks: Mapping[Head, Tensor], mode: MaskMode = "post"
) -> Iterator[Any]:
    """Apply keep-masks to head patterns inside a ``with`` block.

    Args:
        model: A TransformerBridge or a HookedSSM.
        masks: ``{(layer, head): mask}`` with ``mask`` ``[pos, pos]`` (same for every row) or
            ``[batch, pos, pos]`` (per row; e.g. :func:`gather_mask` of a padded batch), bool or
            float (``"post"`` multiplies by float weights; ``"pre"`` removes the zero entries).
        mode: ``"post"`` (multiply after the softmax, no renormalization) or ``"pre"`` (remove
            before the softmax, renormalized; for SSM heads the same multiply as ``"post"``).

    Yields:
        The model with the masks attached.

    Raises:
        InterventionError: On unknown heads or malformed masks.
        PatternEditError: If the model would ignore the edit (some TransformerBridge attention
            implementations), runs in low precision (HookedSSM SSM layers), or a mask does not
            match the input's shape at run time.

    Examples:
        >>> import torch
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> tokens = torch.tensor([[5, 6, 7, 8, 9]])
        >>> only_self = torch.eye(5, dtype=torch.bool)
        >>> with torch.no_grad():
        ...     clean = model(tokens)
        ...     with mask_patterns(model, {(1, 0): only_self}):
        ...         masked = model(tokens)
        >>> bool((masked != clean).any())
        True
    """
    subject = Subject.of(model)
    hooks = pattern_mask_hooks(subject, masks, mode)
    model, view = subject.model, subject.view
    net: Any = model  # the model's own extras (SSM mixers, pattern selection)
    sel = _selection(model, view, masks) if subject.is_ssm else None
    with ExitStack() as stack:
        if sel is not None:
            heads, rows = sel
            stack.enter_context(net.pattern_selection(heads=heads, query_positions=rows))
        stack.enter_context(hooked(model, hooks))
        yield model
