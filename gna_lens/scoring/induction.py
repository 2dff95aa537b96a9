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

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from gna_lens.device import HOST, to_host
from gna_lens.errors import InterventionError
from gna_lens.heads import HeadList, HookedModel, ModelLike, Subject
from gna_lens.scoring.patterns import NORMALIZATION, _group_rows, _normalize, _Parts

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
    for name, v, least, want in (("n_tokens", n_tokens, 2, "an int >= 2 (e.g. 50)"),
                                 ("n_samples", n_samples, 1, "a positive int")):  # fmt: skip
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise InterventionError(f"prefix_matching_scores: {name}={v!r}; expected {want}.")
    subject = Subject.of(model)
    scan = _Parts(subject, heads)
    tokenizer = getattr(scan.net, "tokenizer", None)
    if prepend_bos is None:
        bos = _adds_bos(tokenizer)
    else:
        bos = getattr(tokenizer, "bos_token_id", None) if prepend_bos else None
    if prepend_bos and bos is None:
        raise InterventionError(
            "prefix_matching_scores: prepend_bos=True but the model's tokenizer has no "
            "bos_token_id. Fix: prepend_bos=False (or None)."
        )
    pool = _token_pool(scan.net, tokenizer)
    if len(pool) < n_tokens:
        raise InterventionError(
            f"prefix_matching_scores: n_tokens={n_tokens} distinct tokens needed but the "
            f"vocabulary has {len(pool)} ordinary tokens. Fix: n_tokens <= {len(pool)}."
        )
    tokens = repeated_tokens(pool, n_tokens, n_samples, seed, bos)
    start = n_tokens + (0 if bos is None else 1)
    rows = list(range(start, start + n_tokens))
    out: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = {key: [] for key in scan.parts}
    score = partial(_score, scan, rows=rows, n_tokens=n_tokens, sink=bos is not None, out=out)
    bar = tqdm(total=n_samples, desc="prefix matching", disable=not progress, leave=False)
    with torch.no_grad():
        for b0 in range(0, n_samples, batch_size):
            ids = tokens[b0 : b0 + batch_size].to(subject.device)
            scan.forward("prefix_matching_scores", ids, torch.ones_like(ids), rows, score)
            bar.update(len(ids))
    bar.close()
    per_sample = scan.per_head({k: torch.cat([s[0] for s in v]) for k, v in out.items()}).float()
    previous = scan.per_head({k: torch.cat([s[1] for s in v]) for k, v in out.items()}).float()
    return InductionScores(
        heads=tuple(scan.wanted),
        kinds=tuple(scan.view.kind_of(h) for h in scan.wanted),
        prefix_matching=per_sample.mean(0),
        previous_token=previous.mean(0),
        per_sample=per_sample,
        baseline=uniform_baseline(n_tokens, bos is not None),
        n_tokens=n_tokens,
        n_samples=n_samples,
        seed=seed,
        bos=bos is not None,
        head_groups=scan.view.group_spec,
    )


def _score(
    scan: _Parts,
    key: tuple[int, int],
    pattern: Tensor,
    *,
    rows: list[int],
    n_tokens: int,
    sink: bool,
    out: dict[tuple[int, int], list[tuple[Tensor, Tensor]]],
) -> None:
    """Part ``key``'s heads scored on ``rows`` of every prompt (a ``hook_pattern`` hook's work)."""
    lh, heads = scan.parts[key], scan.heads[key]
    row_of, chan_of = scan.index(key, pattern)
    take = torch.tensor([row_of[r] for r in rows], device=pattern.device)
    P = pattern.index_select(2, take).double()  # [batch, chan, row, key]
    ind, prev = [], []
    for b in range(P.shape[0]):
        if lh.channels is None:
            sel = torch.tensor([chan_of[h] for h in heads], device=P.device)
            w = _normalize(P[b].index_select(0, sel), rows, sink)
        else:
            w = _group_rows(P[b], rows, [[chan_of[c] for c in lh.members(h)] for h in heads], sink)
        i, p = _row_scores(w, rows, n_tokens)
        ind.append(i)
        prev.append(p)
    out[key].append((to_host(torch.stack(ind)), to_host(torch.stack(prev))))
