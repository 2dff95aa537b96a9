"""Pattern-based G&A scores: gather, aggregate, correct-summary share and sharpness, per head.

The scores read each head's pattern (``hook_pattern``: softmax attention, or a HookedSSM's
materialized implicit attention) on a task whose spans are known, and average over samples.

- **gather score**: for each segment, the share of its summary token's row that falls inside the
  segment; averaged over segments.
- **aggregate score**: the share of the query (final) position's row on the summary tokens.
- **correct share**: the share of that summary mass on the answer segment's summary token
  (``1 / n_segments`` for a head that does not discriminate).
- **sharpness**: the query row restricted to the summary tokens and normalized to a distribution
  ``r``; ``sharpness = max r`` (1 for one-hot, ``1/k`` for uniform over ``k``) and
  ``entropy = -Σ r log r`` in nats (0 for one-hot, ``log k`` for uniform).

Attention rows are distributions already. SSM matrices are signed and unnormalized: the scores use
``|M|`` and divide each row by its total absolute mass over the causal keys (stated in
:attr:`PatternScores.normalization`).
"""

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from gna_lens.heads import HeadView, head_view
from gna_lens.interventions._common import describe_task
from gna_lens.tasks import Sample, Task

__all__ = ["NORMALIZATION", "PatternScores", "pattern_scores", "row_sharpness"]

Head = tuple[int, int]

#: How each kind of head's rows are normalized before scoring.
NORMALIZATION = {
    "attention": "softmax rows (each row sums to 1 over the causal keys)",
    "ssm": "|M| divided by the row's total |M| over the causal keys",
}

SCORE_NAMES = ("gather_score", "aggregate_score", "correct_share", "sharpness", "entropy")


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
        gather_score: ``[head]``.
        aggregate_score: ``[head]``.
        correct_share: ``[head]``.
        sharpness: ``[head]``, max share of the query row over the summary tokens.
        entropy: ``[head]``, entropy (nats) of that distribution.
        n_samples: Samples averaged over.
        task: The task's description.
        normalization: How rows were normalized, per head kind.
    """

    heads: tuple[Head, ...]
    kinds: tuple[str, ...]
    gather_score: Float[Tensor, " head"]
    aggregate_score: Float[Tensor, " head"]
    correct_share: Float[Tensor, " head"]
    sharpness: Float[Tensor, " head"]
    entropy: Float[Tensor, " head"]
    n_samples: int
    task: str
    normalization: dict[str, str] = field(default_factory=lambda: dict(NORMALIZATION))

    def to_dataframe(self) -> Any:
        """One row per head: ``layer, head, kind`` and the five scores."""
        import pandas as pd

        data: dict[str, Any] = {
            "layer": [h[0] for h in self.heads],
            "head": [h[1] for h in self.heads],
            "kind": list(self.kinds),
        }
        for name in SCORE_NAMES:
            data[name] = getattr(self, name).tolist()
        return pd.DataFrame(data)


def _sample_scores(P: Tensor, sample: Sample) -> Tensor:
    """Scores of every head on one sample; ``P`` is ``[head, n, n]`` non-negative."""
    n = P.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=P.device).tril()
    P = P * causal
    mass = P.sum(-1)  # [head, n]

    def share(num: Tensor, den: Tensor) -> Tensor:
        return torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(num))

    gathers = []
    for (start, _end), t in zip(sample.segments, sample.summary_positions, strict=True):
        gathers.append(share(P[:, t, start : t + 1].sum(-1), mass[:, t]))
    gather = torch.stack(gathers, -1).mean(-1)
    q = sample.query_position
    summary = torch.tensor(sample.summary_positions, device=P.device)
    on_summary = P[:, q].index_select(-1, summary)  # [head, k]
    aggregate = share(on_summary.sum(-1), mass[:, q])
    correct = share(on_summary[:, sample.answer_segment], on_summary.sum(-1))
    sharp, entropy = row_sharpness(on_summary)
    return torch.stack([gather, aggregate, correct, sharp.to(P.dtype), entropy.to(P.dtype)], -1)


@contextmanager
def _capture_patterns(
    model: Any, view: HeadView, layers: Sequence[int]
) -> Iterator[dict[int, Tensor]]:
    """Hooks that store each layer's pattern (keyed by layer: hook names can be aliases)."""
    store: dict[int, Tensor] = {}

    def saver(layer: int) -> Callable[..., None]:
        def save(pattern: Tensor, hook: Any) -> None:
            store[layer] = pattern.detach()

        return save

    hooks = [(view[layer].pattern_hook, saver(layer)) for layer in layers]
    with model.hooks(fwd_hooks=hooks):
        yield store


def pattern_scores(
    model: Any,
    task: Task,
    *,
    heads: Sequence[Head] | None = None,
    batch_size: int = 8,
    padding_side: str = "left",
    progress: bool = True,
) -> PatternScores:
    """Gather, aggregate, correct-share and sharpness scores of every head on ``task``.

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: A task with spans (:mod:`gna_lens.tasks`).
        heads: Only these ``(layer, head)`` (default: every head of :func:`head_view`).
        batch_size: Prompts per forward pass (the scores do not depend on it).
        padding_side: ``"left"`` or ``"right"`` (the scores do not depend on it).
        progress: Show a progress bar.

    Returns:
        :class:`PatternScores`, averaged over the samples.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> scores = pattern_scores(model, toy_gna_task(model, n_samples=4), progress=False)
        >>> df = scores.to_dataframe().set_index(["layer", "head"])
        >>> round(float(df.loc[(0, 0), "gather_score"]), 2), round(float(df.loc[(1, 0), "correct_share"]), 2)
        (1.0, 1.0)
    """
    view = head_view(model)
    wanted = view.check_heads(heads) if heads is not None else view.heads()
    layers = sorted({layer for layer, _ in wanted})
    totals = {
        layer: torch.zeros(view[layer].n_heads, len(SCORE_NAMES), dtype=torch.float64)
        for layer in layers
    }
    device = next(model.parameters()).device
    n_done = 0
    batches = task.batches(batch_size, padding_side=padding_side)  # type: ignore[arg-type]
    bar = tqdm(total=len(task), desc="pattern scores", disable=not progress, leave=False)
    with torch.no_grad():
        for batch in batches:
            ids = batch.input_ids.to(device)
            mask = batch.attention_mask.to(device)
            with _capture_patterns(model, view, layers) as store:
                model(ids, attention_mask=mask)
            for layer in layers:
                pat = store[layer].double()
                if view[layer].kind == "ssm":
                    pat = pat.abs()
                for b, (sample, off) in enumerate(zip(batch.samples, batch.offsets, strict=True)):
                    n = sample.n_tokens
                    totals[layer] += _sample_scores(
                        pat[b, :, off : off + n, off : off + n], sample
                    ).cpu()
            n_done += len(batch)
            bar.update(len(batch))
    bar.close()
    rows = torch.stack([totals[layer][h] / max(n_done, 1) for layer, h in wanted]).float()
    return PatternScores(
        heads=tuple(wanted),
        kinds=tuple(view[layer].kind for layer, _ in wanted),
        gather_score=rows[:, 0],
        aggregate_score=rows[:, 1],
        correct_share=rows[:, 2],
        sharpness=rows[:, 3],
        entropy=rows[:, 4],
        n_samples=n_done,
        task=describe_task(task),
    )


def uniform_entropy(k: int) -> float:
    """Entropy of a uniform distribution over ``k`` items (the least sharp read-out)."""
    return math.log(k) if k > 0 else 0.0
