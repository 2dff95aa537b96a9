"""Shared machinery of the interventions: metrics, task groups, positions, replacement sources,
hook contexts and the packed head-output edit."""

import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from gna_lens.device import HOST, to_host
from gna_lens.errors import HookError, InterventionError
from gna_lens.heads import Head, HeadView, LayerHeads
from gna_lens.tasks import Sample, Task

MetricName = Literal["accuracy", "logit_diff", "logprob"]
#: A user metric: logits at each row's query position ``[rows, d_vocab]`` and the rows' samples
#: -> one value per row ``[rows]``.
MetricFn = Callable[[Tensor, Sequence[Sample]], Tensor]
Positions = None | Literal["last"] | Sequence[int]
Mode = Literal["zero", "mean", "resample"]

METRICS = ("accuracy", "logit_diff", "logprob", "choice_logprob")
MODES = ("zero", "mean", "resample")


# ----------------------------------------------------------------------------- metrics
class Metric:
    """A per-row metric on query-position logits, bound to a task's answers.

    ``"accuracy"``: 1 when the answer wins (over the choices for ``scoring="choices"``, over the
    vocabulary for ``"exact"``). ``"logit_diff"``: the answer's logit minus the best other
    choice's (``"exact"``: the best other token's), the per-sample margin of
    :func:`gna_lens.tasks.evaluate`. ``"logprob"``: the answer token's log-probability over
    the vocabulary. ``"choice_logprob"``: its log-probability among the choices only (softmax
    over the choices' logits; ``"exact"`` tasks: over the vocabulary), the smooth twin of
    accuracy, blind to mass moving between the choices and the rest of the vocabulary.
    """

    def __init__(self, metric: Any, task: Task, what: str = "metric"):
        if not isinstance(task, Task):
            raise InterventionError(
                f"task is a {type(task).__name__}; expected a gna_lens.tasks.Task (e.g. "
                "gna_lens.tasks.kv_retrieval(tokenizer, ...))."
            )
        if len(task) == 0:
            raise InterventionError(f"task {task.name!r} has no samples; expected at least one.")
        self.task = task
        self.samples = task.samples
        if callable(metric) and not isinstance(metric, str):
            self.name = getattr(metric, "__name__", "metric")
            self.user_fn: MetricFn | None = metric
            self.differentiable = True
            return
        if metric not in METRICS:
            raise InterventionError(
                f"{what}={metric!r}; expected one of {METRICS} or a callable "
                "fn(logits [rows, d_vocab], samples) -> [rows]."
            )
        self.name = str(metric)
        self.user_fn = None
        self.differentiable = metric != "accuracy"
        exact = task.scoring == "exact"
        for i, s in enumerate(task):
            ids = [s.answer_ids] if exact else s.choice_ids
            if any(len(c) != 1 for c in ids):
                raise InterventionError(
                    f"sample {i} of task {task.name!r} has multi-token "
                    f"{'answer' if exact else 'choices'} {s.choices!r} (ids {ids}); the "
                    f"{metric!r} metric is read from the logits at the query position, so every "
                    "choice must be one token. Fix: build the task with single-token values / "
                    "letter format, or pass a callable metric."
                )
        self.exact = exact
        n_choices = max(len(s.choice_ids) for s in task)
        table = torch.full((len(task), max(n_choices, 1)), -1, dtype=torch.long, device=HOST)
        for i, s in enumerate(task):
            table[i, : len(s.choice_ids)] = torch.tensor([c[0] for c in s.choice_ids], device=HOST)
        self.choice_ids = table
        self.answer_index = torch.tensor(
            [s.answer_index for s in task], dtype=torch.long, device=HOST
        )
        self.answer_token = torch.tensor(
            [s.answer_ids[0] for s in task], dtype=torch.long, device=HOST
        )

    def __call__(self, logits: Tensor, idx: Tensor) -> Tensor:
        """Per-row metric; ``idx`` are the rows' sample indices in the task."""
        if self.user_fn is not None:
            out = self.user_fn(logits, [self.samples[int(i)] for i in idx])
            out = torch.as_tensor(out, device=logits.device)
            if out.shape != (logits.shape[0],):
                raise InterventionError(
                    f"metric {self.name!r} returned shape {tuple(out.shape)} for logits of shape "
                    f"{tuple(logits.shape)}; expected one value per row [{logits.shape[0]}]."
                )
            return out.float()
        logits = logits.float()
        idx = to_host(idx.to(torch.long))
        ans_tok = self.answer_token[idx].to(logits.device)
        if self.name == "logprob" or (self.exact and self.name == "choice_logprob"):
            return logits.log_softmax(-1).gather(1, ans_tok[:, None])[:, 0]
        if self.exact:
            correct = logits.gather(1, ans_tok[:, None])[:, 0]
            other = logits.scatter(1, ans_tok[:, None], float("-inf")).amax(-1)
            if self.name == "accuracy":
                return (correct > other).float()
            return correct - other
        ids = self.choice_ids[idx].to(logits.device)
        valid = ids >= 0
        scores = logits.gather(1, ids.clamp(min=0)).masked_fill(~valid, float("-inf"))
        ans = self.answer_index[idx].to(logits.device)
        if self.name == "accuracy":
            return (scores.argmax(-1) == ans).float()
        if self.name == "choice_logprob":
            return scores.log_softmax(-1).gather(1, ans[:, None])[:, 0]
        correct = scores.gather(1, ans[:, None])[:, 0]
        other = scores.scatter(1, ans[:, None], float("-inf")).amax(-1)
        return correct - other


# ----------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class Group:
    """Samples of one prompt length, unpadded: the query is the last column."""

    indices: Tensor  # [G] sample indices in the task
    tokens: Tensor  # [G, L]

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def check_query_is_last(task: Task) -> None:
    for i, s in enumerate(task):
        if s.query_position != s.n_tokens - 1:
            raise InterventionError(
                f"sample {i} of task {task.name!r} has query_position={s.query_position} but "
                f"{s.n_tokens} tokens; expected the query to be the last prompt token."
            )


def length_groups(task: Task, max_samples: int, device: Any) -> list[Group]:
    """Split a task into unpadded groups of equal prompt length (at most ``max_samples``)."""
    check_query_is_last(task)
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(task):
        by_len.setdefault(s.n_tokens, []).append(i)
    out = []
    for length in sorted(by_len):
        ids = by_len[length]
        for start in range(0, len(ids), max(1, max_samples)):
            chunk = ids[start : start + max_samples]
            tokens = torch.tensor(
                [task[i].input_ids for i in chunk], dtype=torch.long, device=device
            )
            out.append(Group(torch.tensor(chunk, dtype=torch.long, device=HOST), tokens))
    return out


def paired_groups(clean: Task, corrupted: Task, max_samples: int, device: Any) -> list[Group]:
    """Groups over sample indices where clean and corrupted prompts have equal length."""
    if not isinstance(corrupted, Task) or not isinstance(clean, Task):
        raise InterventionError(
            f"clean and corrupted must be gna_lens.tasks.Task objects; got "
            f"{type(clean).__name__} and {type(corrupted).__name__}."
        )
    if len(clean) != len(corrupted):
        raise InterventionError(
            f"clean task {clean.name!r} has {len(clean)} samples but corrupted task "
            f"{corrupted.name!r} has {len(corrupted)}; expected pairs (sample i of each)."
        )
    for i, (a, b) in enumerate(zip(clean, corrupted, strict=True)):
        if a.n_tokens != b.n_tokens:
            raise InterventionError(
                f"sample {i}: the clean prompt has {a.n_tokens} tokens and the corrupted one "
                f"{b.n_tokens}; patching needs aligned positions. Fix: build the corrupted task "
                "with the same template and token lengths (e.g. the same dictionary with another "
                "queried key)."
            )
    return length_groups(clean, max_samples, device)


def tokens_of(task: Task, idx: Tensor, device: Any) -> Tensor:
    return torch.tensor([task[int(i)].input_ids for i in idx], dtype=torch.long, device=device)


# ----------------------------------------------------------------------------- positions
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


# ----------------------------------------------------------------------------- sources
class Source:
    """What replaces a head's output: zero, a mean, or per-sample activations.

    Keyed by what is replaced: the ``hook_z`` name of each part of a layer
    (:attr:`gna_lens.heads.LayerHeads.parts`) for head interventions, the layer for layer
    interventions. ``samples[key][r]`` holds reference row ``r``'s activation (``hook_z``:
    ``[L_r, H, d]``, or ``[1, H, d]`` at its query position when ``last_only``).
    """

    def __init__(
        self,
        kind: Literal["zero", "mean", "samples"],
        mean: dict[Any, Tensor] | None = None,
        samples: dict[Any, list[Tensor]] | None = None,
        last_only: bool = False,
        label: str = "",
        tokens: list[tuple[int, ...]] | None = None,
        embeds: list[Tensor] | None = None,
        bos_id: int | None = None,
        include_bos: bool = False,
        info: dict[str, Any] | None = None,
        forwards: int = 0,
    ):
        self.kind = kind
        self.mean = mean or {}
        self.samples = samples or {}
        self.last_only = last_only
        self.label = label
        self.n = len(next(iter(self.samples.values()))) if self.samples else 0
        #: The reference rows' token ids (mean and resample sources).
        self.tokens = tokens or []
        #: The reference rows' ``hook_embed`` outputs, where the model has that hook (resample).
        self.embeds = embeds or []
        #: The tokenizer's BOS id (``None``: none known).
        self.bos_id = bos_id
        self.include_bos = include_bos
        #: How the replacement was computed (for the result's ``info``).
        self.info = info or {}
        #: Forward passes run over the reference.
        self.forwards = forwards

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
    model: Any,
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
        hooks = [(name, _bind(keep, name=name)) for name in names]
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


#: The hook whose output is the token embeddings ``[batch, pos, d_model]`` (HookedSSM and
#: TransformerBridge): equal rows there are equal tokens.
EMBED_HOOK = "hook_embed"


def _bind(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
    def bound(x: Tensor, hook: Any) -> Any:
        return fn(x, hook, **kw)

    return bound


def bos_token_id(model: Any, *sources: Any) -> int | None:
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
    if positions is None:
        where = "every position"
    elif isinstance(positions, Tensor) or positions == "last":
        where = "the last (query) token"
    else:
        where = f"positions {list(positions)}"
    if where.startswith("the last"):
        return f"{where} of each reference prompt"
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
        toks = reference.to(device)
        groups = [
            Group(
                torch.arange(s, min(s + max_rows, len(toks)), device=HOST), toks[s : s + max_rows]
            )
            for s in range(0, len(toks), max_rows)
        ]
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
    model: Any,
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
            model, parts, groups, last_only=last, n_rows=n,
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


# ----------------------------------------------------------------------------- packed edits
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


# ----------------------------------------------------------------------------- hooks
@contextmanager
def hooked(model: Any, fwd_hooks: Sequence[tuple[Any, Callable[..., Any]]]) -> Iterator[Any]:
    """``model.hooks(fwd_hooks)`` that also fails loudly if a hook survived the context.

    An exception raised inside the block propagates unchanged (a leak found then is added to it
    as a note, never raised in its place); after a clean exit a leak raises
    :class:`~gna_lens.errors.HookError`.
    """
    before = count_hooks(model)
    try:
        with model.hooks(fwd_hooks=list(fwd_hooks)):
            yield model
    except BaseException as err:
        after = count_hooks(model)
        if after != before:
            err.add_note(f"gna_lens: hooks leaked as well: {before} before, {after} after.")
        raise
    after = count_hooks(model)
    if after != before:
        raise HookError(
            f"hooks leaked: the model had {before} hooks before this intervention and {after} "
            "after it. Fix: model.reset_hooks(including_permanent=False), and report this."
        )


def count_hooks(model: Any) -> int:
    """Total forward and backward hooks on the model's hook points."""
    total = 0
    seen: set[int] = set()
    for hp in getattr(model, "hook_dict", {}).values():
        if id(hp) in seen:
            continue
        seen.add(id(hp))
        total += len(getattr(hp, "fwd_hooks", [])) + len(getattr(hp, "bwd_hooks", []))
        total += len(getattr(hp, "_forward_hooks", {})) + len(getattr(hp, "_backward_hooks", {}))
    return total


# ----------------------------------------------------------------------------- budget
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(budget: Any) -> int:
    if isinstance(budget, int | float) and not isinstance(budget, bool) and budget > 0:
        return int(budget)
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", budget)
        if m and m.group(2).upper() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise InterventionError(
        f"memory_budget={budget!r}; expected a number of bytes or a string like '2GiB', '512MB'."
    )


def row_bytes(model: Any, view: HeadView, length: int, logits_positions: int) -> int:
    """A rough upper bound on the transient memory of one row of a no-grad forward pass."""
    cfg = model.cfg
    d = int(cfg.d_model)
    itemsize = torch.finfo(getattr(cfg, "dtype", torch.float32) or torch.float32).bits // 8
    worst = 0
    for lh in (part for layer in view for part in layer.parts):
        if lh.kind != "ssm":  # attention heads' patterns (all of a mixed layer's, at worst)
            worst = max(worst, 4 * lh.n_heads * length)
        if lh.kind != "attention":
            d_inner = int(getattr(cfg, "d_inner", 0) or lh.n_channels * lh.d_head)
            chunk = int(getattr(cfg, "chunk_size", 64) or 64)
            worst = max(worst, 8 * d_inner + 4 * lh.n_channels * min(chunk, length))
    d_mlp = int(getattr(cfg, "d_mlp", 0) or 0)
    per_pos = 16 * d + 3 * d_mlp + worst
    return itemsize * (length * per_pos + logits_positions * int(cfg.d_vocab))


def plan_rows(
    model: Any,
    view: HeadView,
    length: int,
    budget: int,
    max_rows: int,
    logits_positions: int,
    cached_layers: int,
) -> int:
    """Rows per forward within ``budget`` (at least 1)."""
    per_row = row_bytes(model, view, length, logits_positions)
    cache = cached_layers * length * int(model.cfg.d_model) * 4
    return max(1, min(max_rows, budget // max(1, per_row + cache)))


def chunks(seq: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(seq), max(1, size)):
        yield seq[start : start + size]


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    import pandas as pd

    x = pd.Series(to_host(a).double().numpy()).rank()
    y = pd.Series(to_host(b).double().numpy()).rank()
    r = x.corr(y)
    return float(r) if r == r else math.nan


def describe_task(task: Task) -> str:
    return f"{task.name} (n={len(task)}, scoring={task.scoring})"
