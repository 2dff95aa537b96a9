"""Pattern-based G&A scores: gather, aggregate, correct-summary share and sharpness, per head,
each against a null, and a role label only where a score beats its null.

The scores read each head's pattern (``hook_pattern``: softmax attention, or a HookedSSM's
materialized implicit attention) on a task whose spans are known, per sample.

**One normalization for every kind of head** (:data:`NORMALIZATION`). A row ``r_i`` over the causal
keys ``j <= i`` becomes ``w_ij = |r_ij|`` with the first token dropped when it is the tokenizer's
BOS (attention heads park unused mass there, an attention sink; SSM rows are treated the same way),
divided by its sum over the keys that remain. Attention rows are non-negative already; SSM matrices
are signed and unnormalized, and this makes their shares comparable with attention's. A Mamba-1
channel group (:meth:`HookedSSM.set_head_groups <gna_lens.models.HookedSSM.set_head_groups>`) is
scored on the mean of its channels' rows each normalized this way (see
:func:`gna_lens.heads.head_patterns`): every channel counts equally, and the group's gather and
aggregate shares are the means of its channels' shares.

- **gather share**: for each segment with summary token ``t``, the share of ``t``'s row on the
  other tokens of its own segment (the token itself is no part of what it gathers: attention to
  ``t`` stays in the row's total and counts against the share), averaged over segments. A
  self-attending head scores 0.
- **gather null**: the same share with every segment shifted back by 1 and 2 tokens (pseudo
  segments ``[start - d, t - d]`` and pseudo summary tokens ``t - d``: boundaries in the wrong
  place), averaged: the local-attention baseline. A previous-token head (or any head that
  attends locally wherever it is) gets the same share there as at the true boundaries.
  Share and null are averaged over the same segments: those whose shifted copies still have a
  token to gather (the first segment of a prompt without a header often has not). When no
  segment qualifies the null is NaN.
- **gather score** ``= gather share - gather null``: gathering measured against the local
  baseline; about 0 for previous-token and self-attending heads, up to 1 for a head whose summary
  tokens read their own segment and whose other tokens do not.
- **aggregate score**: the share of the query (final) position's row on the summary tokens.
- **aggregate null**: the query row's share on the pseudo summary tokens ``t - 1`` and ``t - 2``.
- **correct share**: the share of the summary mass on the answer segment's summary token;
  **correct chance** is ``1 / n_segments``, what a head that does not discriminate gets.
- **sharpness**: the query row restricted to the summary tokens and normalized to a distribution
  ``r``; ``sharpness = max r`` (1 for one-hot, ``1/k`` for uniform over ``k``) and
  ``entropy = -Σ r log r`` in nats (0 for one-hot, ``log k`` for uniform).

**Roles.** A head is labelled ``"gather"`` when its gather share beats the gather null by at least
:data:`ROLE_MARGIN` on average (its gather score) with the 95% bootstrap interval (over samples)
of the difference above 0; ``"aggregate"`` when its aggregate score beats the aggregate null the same way *and* its
correct share beats chance (interval of ``correct - chance`` above 0). Both can hold
(``"gather+aggregate"``); neither gives ``""``. Roles come from patterns alone: whether a head
matters is what ablation measures (:func:`~gna_lens.scoring.score_heads`).
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from gna_lens.device import HOST, to_host
from gna_lens.errors import InterventionError
from gna_lens.heads import HeadView, HookedModel, LayerHeads, ModelLike, Subject
from gna_lens.interventions.batching import describe_task
from gna_lens.tasks import Sample, Task

__all__ = ["NORMALIZATION", "PatternScores", "pattern_scores", "row_sharpness"]

Head = tuple[int, int]

#: How each kind of head's rows are normalized before scoring (the same transform for both).
NORMALIZATION = {
    "attention": "|row| over the causal keys, BOS dropped, divided by its sum (softmax rows are "
    "non-negative already)",
    "ssm": "|row| over the causal keys, BOS dropped, divided by its sum (the materialized matrix "
    "is signed and unnormalized); a Mamba-1 channel group: each channel's row normalized so, "
    "then averaged over the group's channels",
}

#: Per-head score columns, in order.
SCORE_NAMES = (
    "gather_score",
    "gather_share",
    "gather_null",
    "aggregate_score",
    "aggregate_null",
    "correct_share",
    "correct_chance",
    "sharpness",
    "entropy",
)
#: A role needs its score to beat the null by this much on average (and significantly).
ROLE_MARGIN = 0.1
#: Pseudo-segment shifts of the nulls.
NULL_SHIFTS = (1, 2)


def row_sharpness(weights: Float[Tensor, "... k"]) -> tuple[Tensor, Tensor]:
    """Max share and entropy (nats) of non-negative weights normalized over the last axis.

    Args:
        weights: Non-negative weights, e.g. a query row restricted to the summary tokens.

    Returns:
        ``(max_share, entropy)``; both 0 where the weights sum to 0.

    Examples:
        >>> import torch
        >>> row_sharpness(torch.tensor([0.0, 3.0, 0.0]))
        (tensor(1.), tensor(0.))
        >>> share, ent = row_sharpness(torch.ones(4))
        >>> round(float(share), 4), round(float(ent), 4)
        (0.25, 1.3863)
    """
    w = weights.double()
    total = w.sum(-1, keepdim=True)
    r = torch.where(total > 0, w / total.clamp(min=1e-300), torch.zeros_like(w))
    logs = torch.where(r > 0, r.log(), torch.zeros_like(r))
    entropy = -(r * logs).sum(-1) + 0.0  # + 0.0: no negative zero
    return r.amax(-1).float(), entropy.float()


@dataclass(frozen=True)
class PatternScores:
    """Per-head pattern scores averaged over a task's samples.

    Attributes:
        heads: ``(layer, head)`` of each entry.
        kinds: ``"attention"`` or ``"ssm"`` per entry.
        gather_score: ``[head]``, ``gather_share - gather_null``.
        gather_share: ``[head]``, the summary tokens' share on their own segment.
        gather_null: ``[head]``, the same share on shifted segment boundaries.
        aggregate_score: ``[head]``.
        aggregate_null: ``[head]``, the query row's share on shifted summary positions.
        correct_share: ``[head]``.
        correct_chance: ``[head]``, ``1 / n_segments`` averaged over samples.
        sharpness: ``[head]``, max share of the query row over the summary tokens.
        entropy: ``[head]``, entropy (nats) of that distribution.
        roles: Per head, ``"gather"``, ``"aggregate"``, ``"gather+aggregate"`` or ``""``.
        per_sample: ``[sample, head, score]`` per-sample values in :data:`SCORE_NAMES` order.
        n_samples: Samples averaged over.
        task: The task's description.
        normalization: How rows were normalized, per head kind.
    """

    heads: tuple[Head, ...]
    kinds: tuple[str, ...]
    gather_score: Float[Tensor, " head"]
    gather_share: Float[Tensor, " head"]
    gather_null: Float[Tensor, " head"]
    aggregate_score: Float[Tensor, " head"]
    aggregate_null: Float[Tensor, " head"]
    correct_share: Float[Tensor, " head"]
    correct_chance: Float[Tensor, " head"]
    sharpness: Float[Tensor, " head"]
    entropy: Float[Tensor, " head"]
    roles: tuple[str, ...]
    per_sample: Float[Tensor, "sample head score"]
    n_samples: int
    task: str
    normalization: dict[str, str] = field(default_factory=lambda: dict(NORMALIZATION))

    def to_dataframe(self) -> Any:
        """One row per head: ``layer, head, kind, role`` and the scores of :data:`SCORE_NAMES`."""
        import pandas as pd

        data: dict[str, Any] = {
            "layer": [h[0] for h in self.heads],
            "head": [h[1] for h in self.heads],
            "kind": list(self.kinds),
            "role": list(self.roles),
        }
        for name in SCORE_NAMES:
            data[name] = getattr(self, name).tolist()
        return pd.DataFrame(data)


def _shares(r: Tensor, keys: Tensor, drop: Sequence[int], count: Sequence[int] = ()) -> Tensor:
    """``[head]`` share of the row ``r`` (``[head, row + 1]``: the row's causal keys) on ``keys``.

    ``drop``: keys removed from the row (neither numerator nor total); ``count``: keys kept in
    the total but never in the numerator.
    """
    row = r.shape[-1] - 1
    r = r.clone()
    for j in drop:
        if 0 <= j <= row:
            r[:, j] = 0.0
    total = r.sum(-1)
    for j in count:
        if 0 <= j <= row:
            r[:, j] = 0.0
    keys = keys[(keys >= 0) & (keys <= row)]
    num = r.index_select(-1, keys).sum(-1) if keys.numel() else torch.zeros_like(total)
    return torch.where(total > 0, num / total.clamp(min=1e-300), torch.zeros_like(total))


def scored_rows(sample: Sample) -> list[int]:
    """The query rows the scores of ``sample`` read, sorted: every summary token ``t``, its null
    shifts ``t - d`` (:data:`NULL_SHIFTS`) and the query position. :func:`pattern_scores`
    materializes only these rows of the SSM patterns."""
    rows = {sample.query_position}
    for t in sample.summary_positions:
        rows.update(t - d for d in (0, *NULL_SHIFTS) if t - d >= 0)
    return sorted(rows)


def _sample_scores(
    P: Tensor, sample: Sample, sink: bool, positions: Sequence[int] | None = None
) -> Tensor:
    """Scores of every head on one sample, ``[head, len(SCORE_NAMES)]``.

    Args:
        P: ``[head, row, n]`` the sample's pattern rows at ``positions`` over its ``n`` keys (any
            sign; absolute values are taken). Must hold every row of :func:`scored_rows`.
        sample: The sample (its segments, summary tokens, query and answer).
        sink: Whether position 0 is the tokenizer's BOS (dropped from every row).
        positions: The query position of each row of ``P`` (sample coordinates); ``None``: row
            ``i`` is position ``i`` (``P`` is ``[head, n, n]``).
    """
    n = P.shape[-1]
    positions = list(range(P.shape[-2])) if positions is None else list(positions)
    dev = P.device
    index = {p: r for r, p in enumerate(positions)}
    causal = torch.arange(n, device=dev)[None, :] <= torch.tensor(positions, device=dev)[:, None]
    w = P.abs() * causal
    first = [0] if sink else []
    lo = 1 if sink else 0

    def causal_row(i: int) -> Tensor:
        return w[:, index[i], : i + 1]

    def share_at(start: int, t: int) -> Tensor:
        keys = torch.arange(max(start, lo), t, device=dev)  # own segment, t itself excluded
        return _shares(causal_row(t), keys, first, count=[t])

    shares, paired, nulls = [], [], []
    for (start, _end), t in zip(sample.segments, sample.summary_positions, strict=True):
        g = share_at(start, t)
        shares.append(g)
        # The null needs a pseudo segment with a token to gather at every shift; share and null
        # are averaged over the same segments so that position in the prompt cancels.
        if t - 1 >= max(start, lo) and all(t - d - 1 >= max(start - d, lo) for d in NULL_SHIFTS):
            paired.append(g)
            nulls.append(torch.stack([share_at(start - d, t - d) for d in NULL_SHIFTS]).mean(0))
    if paired:
        gather_share = torch.stack(paired, -1).mean(-1)
        gather_null = torch.stack(nulls, -1).mean(-1)
    else:  # segments too short to shift: no null, so no gather score and no gather role
        gather_share = torch.stack(shares, -1).mean(-1)
        gather_null = torch.full_like(gather_share, float("nan"))
    q = sample.query_position
    summary = torch.tensor(sample.summary_positions, device=dev)
    aggregate = _shares(causal_row(q), summary, first)
    agg_nulls = [_shares(causal_row(q), summary - d, first) for d in NULL_SHIFTS]
    aggregate_null = torch.stack(agg_nulls, -1).mean(-1)
    row = w[:, index[q]].clone()
    if sink:
        row[:, 0] = 0.0
    on_summary = row.index_select(-1, summary)  # [head, k]
    total = on_summary.sum(-1)
    correct = torch.where(
        total > 0, on_summary[:, sample.answer_segment] / total.clamp(min=1e-300), 0.0
    )
    chance = torch.full_like(correct, 1.0 / len(sample.summary_positions))
    sharp, entropy = row_sharpness(on_summary)
    cols = [gather_share - gather_null, gather_share, gather_null, aggregate, aggregate_null]
    cols += [correct, chance]
    return torch.stack([*cols, sharp.to(P.dtype), entropy.to(P.dtype)], -1)


def _roles(per_sample: Tensor, chunk: int = 1024) -> tuple[str, ...]:
    """Role labels from per-sample scores ``[sample, head, score]`` (see the module docs).

    A role needs a mean difference of at least its margin, so only the heads whose mean passes
    are bootstrapped, ``chunk`` heads at a time (the resamples are shared by every head, so each
    head's interval does not depend on which others are computed with it). Memory stays bounded
    for the 36,864 channels of a Mamba-1 130M model.
    """
    from gna_lens.stats import bootstrap_interval

    col = {name: i for i, name in enumerate(SCORE_NAMES)}
    n_heads = per_sample.shape[1]

    def beats(a: str, b: str, margin: float, among: Tensor) -> Tensor:
        diff = (per_sample[..., col[a]] - per_sample[..., col[b]]).T.double()  # [head, sample]
        mean = diff.nanmean(-1)
        out = torch.zeros(n_heads, dtype=torch.bool, device=HOST)
        todo = (among & (mean >= margin - 1e-9)).nonzero().flatten().tolist()  # iv.value decides
        for start in range(0, len(todo), chunk):
            idx = todo[start : start + chunk]
            ivs = bootstrap_interval(diff[idx])
            assert isinstance(ivs, list)
            for h, iv in zip(idx, ivs, strict=True):
                out[h] = iv.value >= margin and iv.low > 0
        return out

    every = torch.ones(n_heads, dtype=torch.bool, device=HOST)
    gather = beats("gather_share", "gather_null", ROLE_MARGIN, every)
    aggregate = beats("aggregate_score", "aggregate_null", ROLE_MARGIN, every)
    discriminates = beats("correct_share", "correct_chance", 0.0, aggregate)
    roles = []
    for g, a, c in zip(gather.tolist(), aggregate.tolist(), discriminates.tolist(), strict=True):
        parts = (["gather"] if g else []) + (["aggregate"] if a and c else [])
        roles.append("+".join(parts))
    return tuple(roles)


@contextmanager
def _capture(model: HookedModel, hooks: dict[Any, str]) -> Iterator[dict[Any, Tensor]]:
    """Hooks that store the pattern of each hook name of ``hooks`` (``{key: name}``) by key."""
    store: dict[Any, Tensor] = {}

    def saver(key: Any) -> Callable[..., None]:
        def save(pattern: Tensor, hook: Any) -> None:
            store[key] = pattern.detach()

        return save

    with model.hooks(fwd_hooks=[(name, saver(key)) for key, name in hooks.items()]):
        yield store


def _capture_patterns(
    model: HookedModel, view: HeadView, layers: Sequence[int]
) -> AbstractContextManager[dict[int, Tensor]]:
    """Each single-part layer's pattern, keyed by layer (hook names can be aliases);
    :func:`_capture_part_patterns` for layers of several parts."""
    return _capture(model, {layer: view[layer].hook("pattern") for layer in layers})


def _capture_part_patterns(
    model: HookedModel, view: HeadView, parts: Sequence[LayerHeads]
) -> AbstractContextManager[dict[tuple[int, int], Tensor]]:
    """The pattern of each of ``parts`` (parts of layers,
    :attr:`~gna_lens.heads.LayerHeads.parts`), keyed by ``(layer, offset)``."""
    return _capture(model, {(p.layer, p.offset): p.pattern_hook for p in parts})


def pattern_scores(
    model: ModelLike,
    task: Task,
    *,
    heads: Sequence[Head] | None = None,
    batch_size: int = 8,
    padding_side: str = "left",
    progress: bool = True,
) -> PatternScores:
    """Gather, aggregate, correct-share and sharpness scores of every head on ``task``.

    Cost: one forward pass per batch. Each layer is scored inside its ``hook_pattern`` hook and
    its pattern is freed before the next layer runs, so memory does not grow with the number of
    layers; SSM layers of a HookedSSM materialize only the rows the scores read
    (:func:`scored_rows`: the summary tokens, their null shifts and the query, through
    ``HookedSSM.pattern_selection``) and only the wanted heads' channels, ``[batch, heads,
    rows, L]`` instead of ``[batch, heads, L, L]``. Attention layers compute their full pattern
    anyway.

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A task with spans (:mod:`gna_lens.tasks`).
        heads: Only these ``(layer, head)`` (default: every head of :func:`head_view`).
        batch_size: Prompts per forward pass (the scores do not depend on it).
        padding_side: ``"left"`` or ``"right"`` (the scores do not depend on it).
        progress: Show a progress bar.

    Returns:
        :class:`PatternScores`, averaged over the samples, with role labels.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> scores = pattern_scores(model, toy_gna_task(model, n_samples=4), progress=False)
        >>> df = scores.to_dataframe().set_index(["layer", "head"])
        >>> round(float(df.loc[(0, 0), "gather_share"]), 2), round(float(df.loc[(1, 0), "correct_share"]), 2)
        (1.0, 1.0)
        >>> df.loc[(0, 0), "role"], df.loc[(1, 0), "role"], df.loc[(0, 1), "role"]
        ('gather', 'aggregate', '')
    """
    subject = Subject.of(model)
    scan = _Parts(subject, heads)
    bos = getattr(task.tokenizer or getattr(subject.model, "tokenizer", None), "bos_token_id", None)
    per_part: dict[tuple[int, int], list[Tensor]] = {key: [] for key in scan.parts}
    n_done = 0
    batches = task.batches(batch_size, padding_side=padding_side)  # type: ignore[arg-type]
    bar = tqdm(total=len(task), desc="pattern scores", disable=not progress, leave=False)
    with torch.no_grad():
        for batch in batches:
            rows = [scored_rows(sample) for sample in batch.samples]
            padded = sorted(
                {off + r for off, rs in zip(batch.offsets, rows, strict=True) for r in rs}
            )
            score = partial(_score_batch, scan, batch=batch, rows=rows, bos=bos, out=per_part)
            ids, mask = batch.input_ids.to(subject.device), batch.attention_mask.to(subject.device)
            scan.forward("pattern_scores", ids, mask, padded, score)
            n_done += len(batch)
            bar.update(len(batch))
    bar.close()
    per_sample = scan.per_head({key: torch.stack(rows) for key, rows in per_part.items()})
    means = per_sample.mean(0).float()  # NaN nulls stay NaN
    cols = {name: means[:, i] for i, name in enumerate(SCORE_NAMES)}
    return PatternScores(
        heads=tuple(scan.wanted),
        kinds=tuple(scan.view.kind_of(h) for h in scan.wanted),
        **cols,  # type: ignore[arg-type]
        roles=_roles(per_sample),
        per_sample=per_sample.float(),
        n_samples=n_done,
        task=describe_task(task),
    )


class _Parts:
    """The wanted heads by part of a layer (one ``hook_pattern`` each; Falcon-H1 and Zamba2
    layers have two), keyed ``(layer, offset)``, with the part's own head indices.

    :meth:`forward` scores each part inside its hook, so one layer's pattern is alive at a time,
    and of an SSM layer only the given query rows and the wanted heads' channels are
    materialized (``HookedSSM.pattern_selection``).
    """

    def __init__(self, subject: Subject, heads: Sequence[Head] | None):
        self.net: Any = subject.model  # the model's own extras (SSM mixers, pattern selection)
        self.view = view = subject.view
        self.wanted = wanted = view.check_heads(heads) if heads is not None else view.heads()
        self.parts = {(p.layer, p.offset): p for p in view.parts_of(wanted)}
        self.heads = {
            key: sorted({h - key[1] for lay, h in wanted if lay == key[0] and p.local([h])})
            for key, p in self.parts.items()
        }
        self.mixers = self.net.ssm_mixers() if hasattr(self.net, "pattern_selection") else {}
        self.channels: dict[int, list[int]] = {}  # SSM layers: the wanted channels, if not all
        for key, p in self.parts.items():
            if p.ssm_mixer and key[0] in self.mixers:
                chans = sorted({c for h in self.heads[key] for c in p.members(h)})
                if len(chans) != p.n_channels:
                    self.channels[key[0]] = chans

    def forward(
        self, name: str, ids: Tensor, mask: Tensor, rows: list[int], score: Callable[..., None]
    ) -> None:
        """One forward pass that calls ``score(key, pattern)`` once per part, materializing the
        query positions ``rows`` of SSM patterns.

        Raises:
            InterventionError: When a part's hook does not fire exactly once.
        """
        done: dict[tuple[int, int], int] = {}

        def hook(key: tuple[int, int]) -> Callable[..., None]:
            def run(pattern: Tensor, hook: Any) -> None:
                done[key] = done.get(key, 0) + 1
                score(key, pattern.detach())

            return run

        with ExitStack() as stack:
            if self.mixers:
                stack.enter_context(
                    self.net.pattern_selection(heads=self.channels or None, query_positions=rows)
                )
            hooks = [(p.pattern_hook, hook(key)) for key, p in self.parts.items()]
            stack.enter_context(self.net.hooks(fwd_hooks=hooks))
            self.net(ids, attention_mask=mask)
        missing = [p.pattern_hook for key, p in self.parts.items() if done.get(key) != 1]
        if missing:
            raise InterventionError(
                f"{name}: the pattern hooks {missing} did not fire exactly once in a forward "
                "pass; their patterns cannot be scored."
            )

    def index(self, key: tuple[int, int], pattern: Tensor) -> tuple[dict[int, int], dict[int, int]]:
        """``pattern``'s row per query position and index per channel (an SSM mixer
        materializes a selection of both)."""
        lh = self.parts[key]
        mixer = self.mixers.get(lh.layer) if lh.ssm_mixer else None
        head_idx, row_idx = mixer.last_pattern_index if mixer is not None else (None, None)
        rows = range(pattern.shape[-2]) if row_idx is None else row_idx.tolist()
        chans = range(pattern.shape[1]) if head_idx is None else head_idx.tolist()
        return {p: r for r, p in enumerate(rows)}, {c: i for i, c in enumerate(chans)}

    def per_head(self, per_part: dict[tuple[int, int], Tensor]) -> Tensor:
        """``[sample, head, ...]`` in :attr:`wanted` order from ``[sample, part head, ...]``."""
        col = {key: {h: i for i, h in enumerate(hs)} for key, hs in self.heads.items()}
        where = [self.view.part_of(h) for h in self.wanted]
        return torch.stack(
            [per_part[(p.layer, p.offset)][:, col[(p.layer, p.offset)][h]] for p, h in where], 1
        )


def _score_batch(
    scan: _Parts,
    key: tuple[int, int],
    pattern: Tensor,
    *,
    batch: Any,
    rows: list[list[int]],
    bos: int | None,
    out: dict[tuple[int, int], list[Tensor]],
) -> None:
    """The scores of part ``key``'s heads on each sample of ``batch`` (its ``rows``)."""
    lh, heads = scan.parts[key], scan.heads[key]
    row_of, chan_of = scan.index(key, pattern)
    for b, (sample, off) in enumerate(zip(batch.samples, batch.offsets, strict=True)):
        n, rs = sample.n_tokens, rows[b]
        sink = bos is not None and sample.input_ids[0] == bos
        take = torch.tensor([row_of[off + r] for r in rs], device=pattern.device)
        P = pattern[b].index_select(1, take)[..., off : off + n].double()  # [chan, R, n]
        if lh.channels is None:
            sel = torch.tensor([chan_of[h] for h in heads], device=pattern.device)
            P = P.index_select(0, sel)
        else:
            P = _group_rows(P, rs, [[chan_of[c] for c in lh.members(h)] for h in heads], sink)
        out[key].append(to_host(_sample_scores(P, sample, sink, rs)))


def _normalize(P: Tensor, positions: Sequence[int], sink: bool) -> Tensor:
    """``|P|`` (``[head, row, key]``, row ``i`` at query position ``positions[i]``) over each
    row's causal keys, BOS dropped when ``sink``, divided by its sum (:data:`NORMALIZATION`)."""
    n = P.shape[-1]
    causal = (
        torch.arange(n, device=P.device)[None, :]
        <= torch.tensor(positions, device=P.device)[:, None]
    )
    w = P.abs() * causal
    if sink:
        w[..., 0] = 0.0
    return w / w.sum(-1, keepdim=True).clamp(min=1e-300)


def _group_rows(P: Tensor, positions: Sequence[int], groups: list[list[int]], sink: bool) -> Tensor:
    """Mamba-1 channel groups: each group's rows as the mean of its channels' rows, each
    normalized first (:func:`_normalize`), so each channel counts equally (see
    :func:`gna_lens.heads.head_patterns`)."""
    w = _normalize(P, positions, sink)
    return torch.stack([w[g].mean(0) for g in groups])
