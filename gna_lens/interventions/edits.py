"""The packed head-output edit: several cells (head sets) of one layer ablated in one batched
forward pass, each row editing only its own heads' outputs."""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import InterventionError
from gna_lens.heads import Head, HeadView, LayerHeads
from gna_lens.interventions.sources import Source

__all__ = ["col_where", "edit_packed", "edited_parts", "packed_edit_hooks", "part_selection"]


def part_selection(cells: Sequence[tuple[Head, ...]], layer: int, part: LayerHeads) -> Tensor:
    """``[cells, n_channels]`` bool: which entries of the head axis of ``part``'s ``hook_z``
    (a part of ``layer``, :attr:`~gna_lens.heads.LayerHeads.parts`) each cell edits (a Mamba-1
    channel group edits all its channels)."""
    sel = torch.zeros(len(cells), part.n_channels, dtype=torch.bool, device=HOST)
    for k, cell in enumerate(cells):
        sel[k] = part.hook_mask(part.local(h for lay, h in cell if lay == layer))
    return sel


def edited_parts(
    view: HeadView, cells: Sequence[tuple[Head, ...]], skip_layer: int | None = None
) -> list[tuple[int, LayerHeads]]:
    """``(layer, part)`` of every part holding a head of ``cells`` (layers in order, parts in
    head order), but those of ``skip_layer``."""
    heads = [h for cell in cells for h in cell if h[0] != skip_layer]
    return [(part.layer, part) for part in view.parts_of(heads)]


def edit_packed(
    z: Tensor,
    sel: Tensor,
    value: Tensor,
    group_size: int,
    cols: Tensor | None,
    what: str,
) -> Tensor:
    """``z`` ``[K * G, P, H, d]`` (cell-major) with cell ``k``'s selected heads ``sel[k]``
    replaced by ``value`` at the columns ``cols`` (``None``: all)."""
    R, P, H, d = z.shape
    K, G = sel.shape[0], group_size
    if R != K * G or sel.shape[1] != H:
        raise InterventionError(
            f"internal: {what} has shape {tuple(z.shape)}; expected [{K * G}, pos, {sel.shape[1]}, "
            "d_head]."
        )
    if value.ndim == 4:  # per-sample: [G, P|1, H, d] -> broadcast over cells
        value = value[None]
    where = sel.to(z.device)[:, None, None, :, None]  # [K, 1, 1, H, 1]
    if cols is not None:
        where = where & col_where(cols, z.device)
    out = torch.where(where, value, z.view(K, G, P, H, d))
    return out.reshape(R, P, H, d)


def packed_edit_hooks(
    view: HeadView,
    cells: Sequence[tuple[Head, ...]],
    group_size: int,
    ref_rows: Tensor,
    source: Source,
    cols: Tensor | None,
    at_last: bool = False,
    skip_layer: int | None = None,
) -> list[tuple[str, Callable[..., Tensor]]]:
    """Hooks on ``hook_z`` editing, for packed cell ``k`` (rows ``k*G .. k*G+G-1``), its heads.

    One hook per part of a layer holding a head of the cells (a multi-part layer's heads live
    behind several ``hook_z``).

    Args:
        view: The head view.
        cells: Head sets, one per block of ``group_size`` rows (cell-major packing).
        group_size: Rows per cell ``G``.
        ref_rows: ``[G]`` reference row of each sample (for per-sample sources).
        source: The replacement (keyed by ``hook_z`` name).
        cols: ``[pos]`` bool mask of edited positions, or ``[cells, pos]`` per cell (``None``:
            all positions).
        at_last: The run is an incremental step (the one position is the last).
        skip_layer: A layer edited otherwise (no hook there).
    """
    hooks = []
    for layer, part in edited_parts(view, cells, skip_layer):
        sel = part_selection(cells, layer, part)

        def hook(z: Tensor, hook: Any, name: str = part.z_hook, sel: Tensor = sel) -> Tensor:
            value = source.value(name, ref_rows, z.shape[1], at_last, z)
            edited = None if at_last else cols
            return edit_packed(z, sel, value, group_size, edited, f"{name} (packed)")

        hooks.append((part.z_hook, hook))
    return hooks


def col_where(cols: Tensor, device: Any) -> Tensor:
    """``[pos]`` or ``[cells, pos]`` column mask as ``[cells|1, 1, pos, 1, 1]``."""
    c = cols.to(device)
    return c[None, None, :, None, None] if c.ndim == 1 else c[:, None, :, None, None]
