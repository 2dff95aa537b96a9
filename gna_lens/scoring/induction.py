"""Induction scores: which heads attend to the token that came next last time.

An *induction head* completes ``[A][B] ... [A] -> [B]``: at a token ``A`` it attends to the
token that followed the previous occurrence of ``A`` and copies it. Such a head answers any
retrieval prompt whose query ends the way the sought line continues (the ``"question"`` KV
template ends on ``{key}:``, the dictionary line's own prefix) without a gather or aggregate
step, so a retrieval ranking should be read next to these scores.

**Prefix-matching score** (Olsson et al. 2022, *In-context Learning and Induction Heads*; the
``induction_score`` of TransformerLens demos). Each prompt is ``n_tokens`` random distinct tokens
repeated twice (after the tokenizer's BOS when it adds one). For each query position ``i`` of the
second copy, current token ``t``, the score reads the head's row at ``i`` on the key right after
the first occurrence of ``t`` (``i - n_tokens + 1``): the token that came next last time. Rows are
normalized as for every other pattern score (:data:`~gna_lens.scoring.patterns.NORMALIZATION`:
``|row|`` over the causal keys, BOS dropped, divided by its sum), so attention heads and a
HookedSSM's materialized implicit attention are read the same way. Dropping the BOS column
makes a head's score its share of the mass it does *not* park on the attention sink, so the
scores of heads that sink most of their mass are higher than TransformerLens's raw-pattern ones.

**Random baseline.** A head that spreads its row uniformly over its causal keys gets
``1 / (number of keys)`` at each row, about ``1 / position``; :attr:`InductionScores.baseline`
is that value averaged over the scored rows (``~ log(2) / n_tokens`` for long prompts). A
previous-token head scores 0 (it reads ``i - 1``, never ``i - n_tokens + 1``) and a perfect
induction head 1; :attr:`InductionScores.previous_token` reports the share on ``i - 1`` on the
same rows, which separates the two halves of the classic two-layer induction circuit.
"""

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from gna_lens.device import HOST, to_host
from gna_lens.errors import InterventionError
from gna_lens.heads import HeadList, HookedModel, LayerHeads, ModelLike, Subject
from gna_lens.scoring.patterns import NORMALIZATION, _group_rows

__all__ = ["InductionScores", "prefix_matching_scores"]

Head = tuple[int, int]


@dataclass(frozen=True)
class InductionScores:
    """Per-head prefix-matching (induction) scores on repeated random tokens.

    Attributes:
        heads: ``(layer, head)`` of each entry.
        kinds: ``"attention"`` or ``"ssm"`` per entry.
        prefix_matching: ``[head]``, the mean share of each second-copy row on the token after
            the current token's first occurrence (1: a perfect induction head).
        previous_token: ``[head]``, the mean share of the same rows on the previous token (1: a
            perfect previous-token head).
        per_sample: ``[sample, head]``, ``prefix_matching`` per prompt.
        baseline: What a head with a uniform causal row scores (``~ 1 / position`` per row,
            averaged over the scored rows).
        n_tokens: Length of the random sequence (each prompt has it twice).
        n_samples: Number of prompts.
        seed: Seed of the random tokens.
        bos: Whether each prompt starts with the tokenizer's BOS (then dropped from every row).
        metric: ``"prefix_matching"``.
        normalization: How rows were normalized, per head kind.
        head_groups: The Mamba-1 channel groups the heads were scored under (``()``: none).
    """

    heads: tuple[Head, ...]
    kinds: tuple[str, ...]
    prefix_matching: Float[Tensor, " head"]
    previous_token: Float[Tensor, " head"]
    per_sample: Float[Tensor, "sample head"]
    baseline: float
    n_tokens: int
    n_samples: int
    seed: int
    bos: bool
    metric: str = "prefix_matching"
    normalization: dict[str, str] = field(default_factory=lambda: dict(NORMALIZATION))
    head_groups: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.heads)
        if self.prefix_matching.shape != (n,) or self.previous_token.shape != (n,):
            raise InterventionError(
                f"InductionScores: {n} heads but prefix_matching of shape "
                f"{tuple(self.prefix_matching.shape)} and previous_token of shape "
                f"{tuple(self.previous_token.shape)}; expected ({n},) each."
            )

    def score(self, head: Head) -> float:
        """The prefix-matching score of ``head`` (a ``(layer, head)`` pair).

        Raises:
            InterventionError: If ``head`` was not scored.
        """
        key = (int(head[0]), int(head[1]))
        if key not in self.heads:
            raise InterventionError(
                f"head {head!r} was not scored; expected one of the {len(self.heads)} heads "
                f"{list(self.heads[:4])}{', ...' if len(self.heads) > 4 else ''}."
            )
        return float(self.prefix_matching[self.heads.index(key)])

    def top(self, k: int = 10) -> list[Head]:
        """The ``k`` heads with the highest prefix-matching scores, highest first.

        Returns:
            A :class:`~gna_lens.heads.HeadList` (it remembers the Mamba-1 channel groups).
        """
        if not isinstance(k, int) or k < 0:
            raise InterventionError(f"top(k={k!r}); expected a non-negative int.")
        order = torch.argsort(self.prefix_matching, descending=True, stable=True)
        return HeadList([self.heads[i] for i in order[:k].tolist()], self.head_groups)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python fields (JSON-ready): settings, and one entry per head."""
        return {
            "metric": self.metric,
            "n_tokens": self.n_tokens,
            "n_samples": self.n_samples,
            "seed": self.seed,
            "bos": self.bos,
            "baseline": self.baseline,
            "normalization": dict(self.normalization),
            "heads": [
                {"layer": h[0], "head": h[1], "kind": kind, "prefix_matching": p, "previous": q}
                for h, kind, p, q in zip(
                    self.heads,
                    self.kinds,
                    self.prefix_matching.tolist(),
                    self.previous_token.tolist(),
                    strict=True,
                )
            ],
        }

    def to_dataframe(self) -> Any:
        """One row per head: ``layer, head, kind, prefix_matching, previous_token, baseline``."""
        import pandas as pd

        return pd.DataFrame(
            {
                "layer": [h[0] for h in self.heads],
                "head": [h[1] for h in self.heads],
                "kind": list(self.kinds),
                "prefix_matching": self.prefix_matching.tolist(),
                "previous_token": self.previous_token.tolist(),
                "baseline": [self.baseline] * len(self.heads),
            }
        )


def _adds_bos(tokenizer: Any) -> int | None:
    """The tokenizer's BOS id when it prepends it to encoded text (as tasks encode), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if tokenizer is None or bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def _token_pool(model: HookedModel, tokenizer: Any) -> list[int]:
    """Token ids to draw from: the model's vocabulary minus the tokenizer's special tokens."""
    n_vocab = int(getattr(model.cfg, "d_vocab", 0) or 0)
    if tokenizer is not None:
        n_vocab = min(n_vocab, len(tokenizer)) if n_vocab else len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(n_vocab) if i not in special]


def repeated_tokens(
    pool: Sequence[int], n_tokens: int, n_samples: int, seed: int, bos: int | None
) -> Tensor:
    """``[n_samples, (1 +) 2 * n_tokens]`` prompts: ``n_tokens`` distinct tokens of ``pool``
    drawn with ``seed``, twice, after ``bos`` when given."""
    gen = torch.Generator(device=HOST).manual_seed(seed)
    pool_t = torch.tensor(list(pool), dtype=torch.long, device=HOST)
    rows = []
    for _ in range(n_samples):
        seq = pool_t[torch.randperm(len(pool_t), generator=gen, device=HOST)[:n_tokens]]
        parts = [seq, seq] if bos is None else [torch.tensor([bos], device=HOST), seq, seq]
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _row_scores(
    w: Float[Tensor, "head row key"], rows: Sequence[int], n_tokens: int
) -> tuple[Tensor, Tensor]:
    """Per head, the mean share of normalized rows ``w`` (query positions ``rows``) on the
    induction key ``i - n_tokens + 1`` and on the previous token ``i - 1``."""
    idx = torch.tensor(list(rows), device=w.device)
    r = torch.arange(len(rows), device=w.device)
    induction = w[:, r, idx - n_tokens + 1].mean(-1)
    previous = w[:, r, idx - 1].mean(-1)
    return induction, previous


def _normalize(P: Tensor, rows: Sequence[int], sink: bool) -> Tensor:
    """``|P|`` (``[head, row, key]``) over each row's causal keys, BOS dropped, summing to 1."""
    n = P.shape[-1]
    causal = (
        torch.arange(n, device=P.device)[None, :] <= torch.tensor(rows, device=P.device)[:, None]
    )
    w = P.abs() * causal
    if sink:
        w[..., 0] = 0.0
    return w / w.sum(-1, keepdim=True).clamp(min=1e-300)


def uniform_baseline(n_tokens: int, bos: bool) -> float:
    """The prefix-matching score of a head whose rows are uniform over their causal keys.

    Row ``i`` of the second copy has ``i`` keys after BOS (``i + 1`` without one), so it puts
    ``1 / i`` on the induction key; this is the mean over the ``n_tokens`` scored rows.

    Examples:
        >>> round(uniform_baseline(50, bos=True), 4)
        0.0138
    """
    first = n_tokens + (1 if bos else 0)
    n_keys = [i if bos else i + 1 for i in range(first, first + n_tokens)]
    return sum(1.0 / k for k in n_keys) / n_tokens


def prefix_matching_scores(
    model: ModelLike,
    n_tokens: int = 50,
    n_samples: int = 8,
    seed: int = 0,
    *,
    heads: Sequence[Head] | None = None,
    prepend_bos: bool | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> InductionScores:
    """The prefix-matching (induction) score of every head, on repeated random tokens.

    Each prompt is ``n_tokens`` distinct random tokens (special tokens excluded) repeated twice;
    each head's rows over the second copy are read on the key after the current token's first
    occurrence (see the module docs for the normalization and the random baseline). Works on a
    TransformerBridge and on a HookedSSM (attention heads, and SSM heads through their
    materialized implicit attention: only the second copy's rows and the wanted heads' channels
    are materialized, via ``HookedSSM.pattern_selection``). Each layer is scored inside its
    ``hook_pattern`` hook and its pattern let go.

    Args:
        model: A TransformerBridge or a HookedSSM.
        n_tokens: Length of the random sequence (prompts have ``2 * n_tokens`` tokens, plus BOS).
        n_samples: Number of prompts.
        seed: Seed of the random tokens (same seed, same prompts).
        heads: Only these ``(layer, head)`` (default: every head of :func:`~gna_lens.heads.head_view`).
        prepend_bos: Start each prompt with the tokenizer's BOS (dropped from every row, as an
            attention sink). ``None``: when the model's tokenizer adds one to encoded text.
        batch_size: Prompts per forward pass (the scores do not depend on it).
        progress: Show a progress bar.

    Returns:
        :class:`InductionScores`.

    Raises:
        InterventionError: For ``n_tokens`` < 2, ``n_samples`` < 1, a vocabulary with fewer than
            ``n_tokens`` ordinary tokens, ``prepend_bos=True`` without a BOS token, or pattern
            hooks that do not fire once per forward pass.

    Examples:
        >>> from gna_lens import head_view
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("bamba")
        >>> scores = prefix_matching_scores(model, n_tokens=12, n_samples=2)
        >>> len(scores.heads) == head_view(model).n_heads_total, scores.metric
        (True, 'prefix_matching')
        >>> df = scores.to_dataframe()
        >>> bool(df["prefix_matching"].between(0, 1).all()), sorted(set(df["kind"]))
        (True, ['attention', 'ssm'])
        >>> round(scores.baseline, 4)  # a uniform causal row: ~ 1 / position
        0.0561
    """
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 2:
        raise InterventionError(
            f"prefix_matching_scores: n_tokens={n_tokens!r}; expected an int >= 2 (e.g. 50)."
        )
    if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
        raise InterventionError(
            f"prefix_matching_scores: n_samples={n_samples!r}; expected a positive int."
        )
    subject = Subject.of(model)
    net: Any = subject.model  # the model's own extras (SSM mixers, pattern selection)
    view = subject.view
    tokenizer = getattr(net, "tokenizer", None)
    if prepend_bos is None:
        bos = _adds_bos(tokenizer)
    elif prepend_bos:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            raise InterventionError(
                "prefix_matching_scores: prepend_bos=True but the model's tokenizer has no "
                "bos_token_id. Fix: prepend_bos=False (or None)."
            )
    else:
        bos = None
    pool = _token_pool(net, tokenizer)
    if len(pool) < n_tokens:
        raise InterventionError(
            f"prefix_matching_scores: n_tokens={n_tokens} distinct tokens needed but the "
            f"vocabulary has {len(pool)} ordinary tokens. Fix: n_tokens <= {len(pool)}."
        )
    wanted = view.check_heads(heads) if heads is not None else view.heads()
    parts = {(p.layer, p.offset): p for p in view.parts_of(wanted)}
    part_heads = {
        key: sorted({h - key[1] for lay, h in wanted if lay == key[0] and p.local([h])})
        for key, p in parts.items()
    }
    mixers = net.ssm_mixers() if hasattr(net, "pattern_selection") else {}
    channels: dict[int, list[int]] = {}
    for key, p in parts.items():
        if p.ssm_mixer and key[0] in mixers:
            chans = sorted({c for h in part_heads[key] for c in p.members(h)})
            if len(chans) != p.n_channels:
                channels[key[0]] = chans
    tokens = repeated_tokens(pool, n_tokens, n_samples, seed, bos)
    start = n_tokens + (0 if bos is None else 1)
    rows = list(range(start, start + n_tokens))
    device = subject.device
    out: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = {key: [] for key in parts}
    bar = tqdm(total=n_samples, desc="prefix matching", disable=not progress, leave=False)
    with torch.no_grad():
        for b0 in range(0, n_samples, batch_size):
            ids = tokens[b0 : b0 + batch_size].to(device)
            done: dict[tuple[int, int], int] = {}
            hooks = [
                (p.pattern_hook, _scorer(key, p, part_heads[key], mixers, rows, n_tokens, bos, done, out))
                for key, p in parts.items()
            ]  # fmt: skip
            with ExitStack() as stack:
                if mixers:
                    stack.enter_context(
                        net.pattern_selection(heads=channels or None, query_positions=rows)
                    )
                stack.enter_context(net.hooks(fwd_hooks=hooks))
                net(ids, attention_mask=torch.ones_like(ids))
            missing = [parts[key].pattern_hook for key in parts if done.get(key) != 1]
            if missing:
                raise InterventionError(
                    f"prefix_matching_scores: the pattern hooks {missing} did not fire exactly "
                    "once in a forward pass; their patterns cannot be scored."
                )
            bar.update(len(ids))
    bar.close()
    col = {key: {h: i for i, h in enumerate(part_heads[key])} for key in parts}
    induction, previous = [], []
    for lay, h in wanted:
        p, local = view.part_of((lay, h))
        key = (p.layer, p.offset)
        i = col[key][local]
        induction.append(torch.cat([s[0][:, i] for s in out[key]]))
        previous.append(torch.cat([s[1][:, i] for s in out[key]]))
    per_sample = torch.stack(induction, 1).float()
    return InductionScores(
        heads=tuple(wanted),
        kinds=tuple(view.kind_of(h) for h in wanted),
        prefix_matching=per_sample.mean(0),
        previous_token=torch.stack(previous, 1).float().mean(0),
        per_sample=per_sample,
        baseline=uniform_baseline(n_tokens, bos is not None),
        n_tokens=n_tokens,
        n_samples=n_samples,
        seed=seed,
        bos=bos is not None,
        head_groups=view.group_spec,
    )


def _scorer(
    key: tuple[int, int],
    lh: LayerHeads,
    heads: list[int],
    mixers: dict[int, Any],
    rows: list[int],
    n_tokens: int,
    bos: int | None,
    done: dict[tuple[int, int], int],
    out: dict[tuple[int, int], list[tuple[Tensor, Tensor]]],
) -> Callable[..., None]:
    """A ``hook_pattern`` hook scoring the part ``key``'s heads on ``rows`` of every prompt."""

    def score(pattern: Tensor, hook: Any) -> None:
        done[key] = done.get(key, 0) + 1
        mixer = mixers.get(lh.layer) if lh.ssm_mixer else None
        head_idx, row_idx = mixer.last_pattern_index if mixer is not None else (None, None)
        row_pos = list(range(pattern.shape[-2])) if row_idx is None else row_idx.tolist()
        row_of = {p: r for r, p in enumerate(row_pos)}
        chan_pos = list(range(pattern.shape[1])) if head_idx is None else head_idx.tolist()
        chan_of = {c: i for i, c in enumerate(chan_pos)}
        take = torch.tensor([row_of[r] for r in rows], device=pattern.device)
        P = pattern.detach().index_select(2, take).double()  # [batch, chan, row, key]
        ind, prev = [], []
        for b in range(P.shape[0]):
            if lh.channels is None:
                sel = torch.tensor([chan_of[h] for h in heads], device=P.device)
                w = _normalize(P[b].index_select(0, sel), rows, bos is not None)
            else:
                groups = [[chan_of[c] for c in lh.members(h)] for h in heads]
                w = _group_rows(P[b], rows, groups, bos is not None)
            i, p = _row_scores(w, rows, n_tokens)
            ind.append(i)
            prev.append(p)
        out[key].append((to_host(torch.stack(ind)), to_host(torch.stack(prev))))

    return score
