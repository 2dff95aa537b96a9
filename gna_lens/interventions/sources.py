"""What replaces an ablated or patched head output: the positions edited (``None``, ``"last"``, a
list), the ablation modes (zero, mean over reference prompts, resample) and their
:class:`Source` of values; activation patching's clean outputs come from the same place."""

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import InterventionError
from gna_lens.heads import HookedModel, LayerHeads, ModelLike, model_of
from gna_lens.interventions.batching import Group, length_groups, row_groups
from gna_lens.interventions.hooks import EMBED_HOOK, bind, hooked
from gna_lens.tasks import Task

__all__ = [
    "MODES",
    "Mode",
    "Positions",
    "SkipBos",
    "Source",
    "bos_token_id",
    "build_source",
    "check_positions",
    "check_resample_pairs",
    "class_positions",
    "collect_z",
    "column_mask",
    "edit_positions",
    "mean_positions",
    "reference_rows",
    "rotated",
]


Positions = None | Literal["last"] | Sequence[int]


Mode = Literal["zero", "mean", "resample"]


MODES = ("zero", "mean", "resample")


def check_positions(positions: Any, allow_each: bool = False) -> Any:
    if positions is None or positions == "last":
        return positions
    if allow_each and positions == "each":
        return positions
    if isinstance(positions, Tensor):
        return positions
    if isinstance(positions, Sequence) and not isinstance(positions, str):
        items = list(positions)
        if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
            return items
    expected = "None (all), 'last', 'each' (one patch per position)" if allow_each else None
    expected = expected or "None (all positions), 'last', or a list of int positions"
    raise InterventionError(
        f"positions={positions!r}; expected {expected} (negative positions count from the end)."
    )


class SkipBos:
    """Edited positions ``positions`` (``None``: all, or a list) minus column 0, where every
    prompt holds its BOS token: what mean ablation edits when BOS is excluded."""

    def __init__(self, positions: Any):
        self.positions = positions

    def __repr__(self) -> str:
        return f"SkipBos({self.positions!r})"


def column_mask(positions: Any, length: int, device: Any) -> Tensor | None:
    """``[pos]`` bool mask of the edited columns of an unpadded length-``length`` input."""
    if isinstance(positions, SkipBos):
        inner = column_mask(positions.positions, length, device)
        if inner is None:
            inner = torch.ones(length, dtype=torch.bool, device=device)
        elif bool(inner[0]):
            raise InterventionError(
                f"positions={positions.positions!r} include position 0 of a {length}-token prompt, "
                "its BOS token; mean ablation leaves BOS out of the mean and unedited. Fix: drop "
                f"that position (0 or -{length}), or pass include_bos=True."
            )
        inner[0] = False
        return inner
    if positions is None:
        return None
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    if positions == "last":
        mask[-1] = True
        return mask
    for p in positions:
        if not -length <= p < length:
            raise InterventionError(
                f"position {p} is out of range for a prompt of {length} tokens; expected "
                f"-{length} <= position < {length}."
            )
        mask[p] = True
    return mask


@dataclasses.dataclass(eq=False)  # compared and hashed by identity, as before
class Source:
    """What replaces a head's output: zero, a mean, or per-sample activations.

    Keyed by what is replaced: the ``hook_z`` name of each part of a layer
    (:attr:`gna_lens.heads.LayerHeads.parts`) for head interventions, the replaced hook for
    layer interventions. ``samples[key][r]`` holds reference row ``r``'s activation (``hook_z``:
    ``[L_r, H, d]``, or ``[1, H, d]`` at its query position when ``last_only``).

    Attributes:
        tokens: The reference rows' token ids (mean and resample sources).
        embeds: The reference rows' ``hook_embed`` outputs, where the model has that hook
            (resample).
        bos_id: The tokenizer's BOS id (``None``: none known).
        info: How the replacement was computed (for the result's ``info``).
        forwards: Forward passes run over the reference.
    """

    kind: Literal["zero", "mean", "samples"]
    mean: dict[Any, Tensor] = dataclasses.field(default_factory=dict)
    samples: dict[Any, list[Tensor]] = dataclasses.field(default_factory=dict)
    last_only: bool = False
    label: str = ""
    tokens: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    embeds: list[Tensor] = dataclasses.field(default_factory=list)
    bos_id: int | None = None
    include_bos: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    forwards: int = 0

    @property
    def n(self) -> int:
        """Reference rows of a per-sample source (``0`` otherwise)."""
        return len(next(iter(self.samples.values()))) if self.samples else 0

    @property
    def skips_bos(self) -> bool:
        """Whether edits leave BOS positions alone (mean ablation without ``include_bos``)."""
        return self.kind == "mean" and not self.include_bos and self.bos_id is not None

    def value(self, key: Any, ref: Tensor, length: int, at_last: bool, like: Tensor) -> Tensor:
        """Replacement broadcastable to ``[rows, pos, H, d]`` for rows mapped to ``ref`` rows
        (``key``: the ``hook_z`` name, or the layer, as the source was built).

        ``at_last``: the edited tensor holds only the last position (incremental step).
        """
        if self.kind == "zero":
            return like.new_zeros(())
        if self.kind == "mean":
            return self.mean[key].to(like)[None, None]
        rows = [self.samples[key][int(r)] for r in ref]
        if self.last_only or at_last:
            return torch.stack([r[-1:] for r in rows]).to(like)
        bad = [(int(r), x.shape[0]) for r, x in zip(ref, rows, strict=True) if x.shape[0] != length]
        if bad:
            raise InterventionError(
                f"{self.label}: reference row {bad[0][0]} has {bad[0][1]} positions but the "
                f"edited input has {length}; replacing every position needs prompts of equal "
                "length. Fix: reference prompts of the same token length, or positions='last'."
            )
        return torch.stack(rows).to(like)


def collect_z(
    model: HookedModel,
    parts: Sequence[LayerHeads],
    groups: Sequence[Group],
    last_only: bool,
    n_rows: int,
    embeds: list[Tensor | None] | None = None,
) -> dict[str, list[Tensor]]:
    """Run the groups and keep each row's ``hook_z`` of ``parts`` (parts of layers, see
    :meth:`gna_lens.heads.HeadView.parts_of`), keyed by the ``hook_z`` name (CPU copies are
    not made).

    ``embeds``: a list of ``n_rows`` filled with each row's ``hook_embed`` output, where the
    model has that hook.
    """
    names = list(dict.fromkeys(part.z_hook for part in parts))
    store: dict[str, list[Tensor | None]] = {name: [None] * n_rows for name in names}
    want_embed = embeds is not None and EMBED_HOOK in getattr(model, "hook_dict", {})
    for g in groups:
        current: dict[str, Tensor] = {}

        def keep(z: Tensor, hook: Any, name: str, current: dict[str, Tensor] = current) -> None:
            current[name] = z[:, -1:].clone() if last_only else z.clone()

        def keep_embed(x: Tensor, hook: Any, current: dict[str, Tensor] = current) -> None:
            current[EMBED_HOOK] = x.detach().clone()

        # Bound to the requested name: a bridge's hook.name can be an alias.
        hooks = [(name, bind(keep, name=name)) for name in names]
        if want_embed:
            hooks.append((EMBED_HOOK, keep_embed))
        with hooked(model, hooks):
            model(g.tokens)
        for name, z in current.items():
            for j, i in enumerate(g.indices.tolist()):
                if name == EMBED_HOOK:
                    assert embeds is not None
                    embeds[i] = z[j]
                else:
                    store[name][i] = z[j]
    return {name: [t for t in rows if t is not None] for name, rows in store.items()}


def bos_token_id(model: ModelLike, *sources: Any) -> int | None:
    """The BOS id of the first tokenizer found on ``sources`` (tasks) or ``model``."""
    for obj in (*sources, model):
        tok = getattr(obj, "tokenizer", None)
        if tok is None:
            continue
        bos = getattr(tok, "bos_token_id", None)
        return int(bos) if isinstance(bos, int) and not isinstance(bos, bool) else None
    return None


def class_positions(
    ids: Sequence[int], positions: Any, bos_id: int | None, include_bos: bool, where: str
) -> tuple[list[int], int]:
    """The positions of prompt ``ids`` in the ablated position class, and how many BOS tokens
    were left out.

    ``positions``: ``None`` (every position), ``"last"`` or a per-row tensor (the last token,
    i.e. the query), or a list (negative from the end). Position 0 is left out when it holds
    the BOS token, unless ``include_bos``; a list naming it raises.
    """
    n = len(ids)
    if positions is None:
        picked = list(range(n))
    elif isinstance(positions, Tensor) or positions == "last":
        picked = [n - 1]
    else:
        picked = []
        for p in positions:
            if not -n <= p < n:
                raise InterventionError(
                    f"position {p} is out of range for {where} ({n} tokens); expected "
                    f"-{n} <= position < {n}."
                )
            picked.append(p % n)
        picked = sorted(set(picked))
    is_bos = bos_id is not None and n > 0 and int(ids[0]) == bos_id
    if include_bos or not is_bos or 0 not in picked:
        return picked, 0
    if isinstance(positions, list):
        raise InterventionError(
            f"positions={positions!r} include position 0 of {where}, its BOS token; mean ablation "
            f"leaves BOS out of the mean and unedited. Fix: drop that position (0 or -{n}), or "
            "pass include_bos=True."
        )
    picked.remove(0)
    return picked, 1


def _class_label(positions: Any, include_bos: bool, bos_id: int | None) -> str:
    if isinstance(positions, Tensor) or positions == "last":
        return "the last (query) token of each reference prompt"
    where = "every position" if positions is None else f"positions {list(positions)}"
    if bos_id is None:
        return f"{where} of each reference prompt (no BOS token known)"
    if include_bos:
        return f"{where} of each reference prompt, BOS included"
    return f"{where} of each reference prompt, except a leading BOS (id {bos_id})"


def reference_rows(
    reference: Any, device: Any, max_rows: int, what: str
) -> tuple[list[Group], str, list[tuple[int, ...]]]:
    """A reference (a :class:`~gna_lens.tasks.Task` or unpadded token ids ``[n, pos]``) as
    unpadded groups of at most ``max_rows`` rows, its label, and each row's token ids.

    ``what``: what the reference is for, in the error message.
    """
    if isinstance(reference, Task):
        if len(reference) == 0:
            raise InterventionError(f"reference task {reference.name!r} has no samples.")
        groups = length_groups(reference, max_rows, device)
        label = f"reference task {reference.name!r}"
        rows = [tuple(int(t) for t in s.input_ids) for s in reference]
        return groups, label, rows
    if isinstance(reference, Tensor) and reference.ndim == 2 and not reference.is_floating_point():
        groups = row_groups(reference, max_rows, device)
        label = f"reference tokens {tuple(reference.shape)}"
        return groups, label, [tuple(r) for r in reference.tolist()]
    got = tuple(reference.shape) if isinstance(reference, Tensor) else type(reference).__name__
    raise InterventionError(
        f"reference={got}; expected a gna_lens.tasks.Task or unpadded token ids [batch, pos] "
        f"(torch.long) {what}."
    )


def mean_positions(
    rows: Sequence[Sequence[int]], positions: Any, bos_id: int | None, include_bos: bool, label: str
) -> tuple[list[list[int]], dict[str, Any]]:
    """Per reference row, the positions a mean ablation averages over (:func:`class_positions`),
    and what a result records about them (``mean_over``, ``mean_tokens``, ``mean_prompts``,
    ``bos_excluded``, ``include_bos``).

    Raises:
        InterventionError: If no token is left to average over, or as :func:`class_positions`.
    """
    picks = []
    n_bos = 0
    for r, ids in enumerate(rows):
        picked, dropped = class_positions(
            ids, positions, bos_id, include_bos, f"reference row {r} of {label}"
        )
        picks.append(picked)
        n_bos += dropped
    n_tokens = sum(len(p) for p in picks)
    where = _class_label(positions, include_bos, bos_id)
    if n_tokens == 0:
        raise InterventionError(
            f"{label}: no token is left to average over ({where}); expected at least one. Fix: "
            "longer reference prompts, or include_bos=True."
        )
    info = {
        "mean_over": where,
        "mean_tokens": n_tokens,
        "mean_prompts": len(rows),
        "bos_excluded": n_bos,
        "include_bos": include_bos,
    }
    return picks, info


def build_source(
    model: ModelLike,
    mode: Any,
    reference: Any,
    parts: Sequence[LayerHeads],
    positions: Any,
    device: Any,
    max_samples: int = 16,
    include_bos: bool = False,
) -> Source:
    """The replacement for ``mode``: zero, the reference's mean, or its per-sample activations.

    ``parts``: the parts of layers whose heads are replaced (:meth:`HeadView.parts_of
    <gna_lens.heads.HeadView.parts_of>`); the source is keyed by their ``hook_z`` names.

    The mean is taken over the ablated position class (:func:`class_positions`): the reference
    prompts' last tokens for ``positions="last"`` (or a per-row tensor, read as the query
    positions), the listed positions for a list, every position for ``None``; each (prompt,
    position) counts once, and a leading BOS is left out unless ``include_bos``.
    """
    if mode not in MODES:
        raise InterventionError(f"mode={mode!r}; expected one of {MODES}.")
    if not isinstance(include_bos, bool):
        raise InterventionError(f"include_bos={include_bos!r}; expected True or False.")
    if mode == "zero":
        if reference is not None:
            raise InterventionError(
                "mode='zero' takes no reference; pass mode='mean' or 'resample' to use one."
            )
        return Source("zero", include_bos=include_bos)
    if reference is None:
        raise InterventionError(
            f"mode={mode!r} needs reference=: a gna_lens.tasks.Task or token ids [batch, pos] "
            "whose head outputs replace the ablated ones."
        )
    groups, label, rows = reference_rows(
        reference, device, max_samples, "whose head outputs replace the ablated ones"
    )
    n = len(rows)
    bos_id = bos_token_id(model, reference)
    # Resample replaces per-row positions from the same positions of the reference row; the
    # mean of per-row positions (e.g. ``batch.query_positions``) is over the reference's queries.
    last = positions == "last" or (mode == "mean" and isinstance(positions, Tensor))
    embeds: list[Tensor | None] = [None] * n
    with torch.no_grad():
        per_row = collect_z(
            model_of(model), parts, groups, last_only=last, n_rows=n,
            embeds=embeds if mode == "resample" else None,
        )  # fmt: skip
    if mode == "resample":
        return Source(
            "samples", samples=per_row, last_only=last, label=label, tokens=rows,
            embeds=[e for e in embeds if e is not None], bos_id=bos_id, include_bos=include_bos,
            forwards=len(groups),
        )  # fmt: skip
    picks, info = mean_positions(rows, positions, bos_id, include_bos, label)
    if last:  # last-only rows hold one position: the last
        picks = [[0] if p else [] for p in picks]
    mean = {}
    for name, zs in per_row.items():
        cat = torch.cat([z[p] for z, p in zip(zs, picks, strict=True) if p])  # [tokens, H, d]
        mean[name] = cat.float().mean(0).to(zs[0].dtype)
    return Source(
        "mean", mean=mean, label=label, tokens=rows, bos_id=bos_id, include_bos=include_bos,
        info=info, forwards=len(groups),
    )  # fmt: skip


def edit_positions(source: Source, positions: Any, prompts: Sequence[Sequence[int]]) -> Any:
    """The positions a sweep edits: ``positions``, minus the BOS column for mean ablation
    without ``include_bos`` (as :class:`SkipBos`), checked on every prompt length."""
    if not source.skips_bos or positions == "last":
        return positions
    starts = [len(p) > 0 and int(p[0]) == source.bos_id for p in prompts]
    if not any(starts):
        return positions
    if not all(starts):
        first = starts.index(False)
        raise InterventionError(
            f"{sum(starts)} of {len(prompts)} prompts start with the BOS token (id "
            f"{source.bos_id}) and prompt {first} does not; mean ablation leaves BOS positions "
            "unedited, so the prompts must agree. Fix: tokenize every prompt the same way, or pass "
            "include_bos=True."
        )
    spec = SkipBos(positions)
    for length in sorted({len(p) for p in prompts}):
        column_mask(spec, length, HOST)
    return spec


def rotated(task: Task, where: str) -> Task:
    """``task`` rotated by one: the reference resample ablation takes where none is given (prompt
    ``i`` takes its head outputs from prompt ``i + 1`` of the same set, the same lengths in a
    generated task such as KV retrieval).

    Raises:
        InterventionError: For a task of fewer than 2 prompts (``where`` names the caller).

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> task = toy_gna_task(toy_gna_model(), n_samples=3)
        >>> rotated(task, "here")[0].prompt == task[1].prompt
        True
    """
    if len(task) < 2:
        raise InterventionError(
            f"{where}: mode='resample' resamples each prompt from another of the same set, and "
            f"{task.name!r} has {len(task)}; expected at least 2 prompts, or reference=."
        )
    return dataclasses.replace(
        task, samples=task.samples[1:] + task.samples[:1], name=f"{task.name}, rotated by one"
    )


def check_resample_pairs(
    prompts: Sequence[Sequence[int]], source: Source, ref_rows: Sequence[int], what: str
) -> None:
    """Raise if a prompt would be resampled from a reference row holding the same prompt."""
    if source.kind != "samples" or not source.tokens:
        return
    same = [
        i for i, (p, r) in enumerate(zip(prompts, ref_rows, strict=True))
        if tuple(int(t) for t in p) == source.tokens[r]
    ]  # fmt: skip
    if not same:
        return
    i = same[0]
    raise InterventionError(
        f"{what}: resample ablation pairs prompt i with {source.label} row i % "
        f"{len(source.tokens)}, and {len(same)} of {len(prompts)} pairs are the same prompt (e.g. "
        f"prompt {i} and reference row {ref_rows[i]}): their heads would take their own outputs and "
        "nothing would be ablated. Fix: a reference of other prompts with the same token lengths "
        "(e.g. the same task generator with another seed, or the task rotated by one: "
        "dataclasses.replace(task, samples=task.samples[1:] + task.samples[:1])), or mode='mean'."
    )
