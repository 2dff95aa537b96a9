"""Accuracy of a model on a task, batched, with per-sample correctness and logit differences."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from gna_lens.device import HOST, DevicePolicy
from gna_lens.errors import ConfigError, TaskError
from gna_lens.heads import ModelLike, Subject, model_of
from gna_lens.tasks.core import PaddingSide, Task, pad_sequences

__all__ = ["EvalResult", "evaluate"]

#: A forward-pass row: (sample index, token ids, the (choice index, continuation ids) it scores).
_Row = tuple[int, list[int], list[tuple[int, list[int]]]]


@dataclass(frozen=True)
class EvalResult:
    """The outcome of :func:`evaluate`.

    Attributes:
        task: The task's name.
        scoring: ``"choices"`` or ``"exact"``.
        correct: Whether each sample was answered correctly.
        logit_diffs: Per sample, the correct answer's score minus the best wrong answer's.
            ``"choices"`` with single-token choices: the logit difference at the query position;
            with multi-token choices: the difference of the (length-normalized) log-likelihoods.
            ``"exact"``: the answer token's logit minus the best other token's over the whole
            vocabulary (for a multi-token answer, the smallest such margin along the answer).
            Positive exactly when the sample is correct (ties aside).
        predictions: Per sample, the index of the chosen choice (``"choices"``) or the argmax
            token id at the query position (``"exact"``).
        choice_scores: Per sample, each choice's score (log-likelihood, length-normalized as the
            task says); empty for ``"exact"``.
        answer_indices: Per sample, the index of the correct choice.
        chance: Accuracy of uniform guessing (the baseline).
        metric: ``"accuracy"``.
    """

    task: str
    scoring: str
    correct: Bool[Tensor, " batch"]
    logit_diffs: Float[Tensor, " batch"]
    predictions: Int[Tensor, " batch"]
    choice_scores: tuple[tuple[float, ...], ...]
    answer_indices: Int[Tensor, " batch"]
    chance: float
    metric: str = "accuracy"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        """The fraction of samples answered correctly."""
        return float(self.correct.float().mean()) if len(self.correct) else float("nan")

    def __len__(self) -> int:
        return len(self.correct)

    def __repr__(self) -> str:
        return (
            f"EvalResult({self.task!r}, accuracy={self.accuracy:.3f}, chance={self.chance:.3f}, "
            f"n={len(self)}, scoring={self.scoring!r})"
        )

    def to_dataframe(self) -> Any:
        """One row per sample: ``sample``, ``correct``, ``logit_diff``, ``prediction``, ``answer``.

        Task-level columns ``task``, ``scoring``, ``metric`` and ``chance`` repeat on every row.
        """
        import pandas as pd

        return pd.DataFrame(
            {
                "sample": range(len(self)),
                "correct": self.correct.tolist(),
                "logit_diff": self.logit_diffs.tolist(),
                "prediction": self.predictions.tolist(),
                "answer": self.answer_indices.tolist(),
                "task": self.task,
                "scoring": self.scoring,
                "metric": self.metric,
                "chance": self.chance,
            }
        )


def checked_logits(model: Callable[..., Any], ids: Tensor, mask: Tensor) -> Tensor:
    """``model(ids, attention_mask=mask)``'s logits ``[batch, pos, d_vocab]``, or a ``TaskError``
    that says what the model returned instead."""
    out = model(ids, attention_mask=mask)
    if not isinstance(out, Tensor):
        out = getattr(out, "logits", None)
        if not isinstance(out, Tensor):
            raise TaskError(
                f"model(input_ids, attention_mask=...) returned {type(out).__name__}; expected "
                "logits [batch, pos, d_vocab] (a tensor, or an output with .logits)."
            )
    if out.ndim != 3 or out.shape[:2] != ids.shape:
        raise TaskError(
            f"model returned a tensor of shape {tuple(out.shape)} for input_ids of shape "
            f"{tuple(ids.shape)}; expected logits [batch, pos, d_vocab]."
        )
    return out


def _device(model: Callable[..., Any]) -> torch.device:
    """The model's device (:meth:`DevicePolicy.of`); the host for a plain callable, which has no
    parameters and no ``cfg.device`` to tell."""
    try:
        return DevicePolicy.of(model).device
    except ConfigError:
        return HOST


def _declared(model: Callable[..., Any], names: Sequence[tuple[str, str]]) -> int | None:
    """The first positive int ``model.<holder>.<name>`` of ``names``, if any."""
    for holder, name in names:
        v = getattr(getattr(model, holder, None), name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _check_vocab(task: Task, max_id: int, vocab: int | None) -> None:
    if vocab is not None and max_id >= vocab:
        raise TaskError(
            f"task {task.name!r} uses token id {max_id} but the model has d_vocab={vocab}; "
            "expected the task to be built with the model's own tokenizer (model.tokenizer)."
        )


def model_context_length(model: Callable[..., Any]) -> int | None:
    """The model's maximum sequence length, where it declares one (``cfg.n_ctx`` etc.)."""
    names = ("n_ctx", "max_position_embeddings", "n_positions")
    return _declared(model, [(holder, name) for holder in ("cfg", "config") for name in names])


def _check_lengths(task: Task, rows: Sequence[_Row], limit: int | None) -> None:
    for i, ids, _ in rows:
        if limit is not None and len(ids) > limit:
            raise TaskError(
                f"sample {i} needs {len(ids)} tokens (prompt {task[i].n_tokens} + continuation) "
                f"but the model's context is {limit} tokens; expected at most {limit}. Fix: build "
                f"the task with fewer pairs / shots (task {task.name!r}), or use a model with a "
                "longer context."
            )


def _normalizer(task: Task, i: int, c: int) -> float:
    mode = task.length_normalize
    if mode is True or mode == "tokens":
        return float(len(task[i].choice_ids[c]))
    if mode == "chars":
        return float(max(len(task[i].choices[c]), 1))
    return 1.0


def _best_other(x: Tensor, k: int) -> float:
    if x.numel() < 2:
        return float("-inf")
    other = x.clone()
    other[k] = float("-inf")
    return float(other.max())


def _rows(task: Task, single: bool) -> list[_Row]:
    """One row per forward pass: the bare prompt scoring every choice's (one) token at once, or
    ``prompt + continuation`` for each scored continuation (the answer alone for ``"exact"``)."""
    rows: list[_Row] = []
    for i, s in enumerate(task):
        if task.scoring == "exact":
            scored = [(s.answer_index, s.answer_ids)]
        else:
            scored = list(enumerate(s.choice_ids))
        if single:
            rows.append((i, list(s.input_ids), scored))
        else:
            rows += [(i, list(s.input_ids) + ids, [(c, ids)]) for c, ids in scored]
    return rows


@torch.no_grad()
def evaluate(
    model: ModelLike | Callable[..., Any],
    task: Task,
    batch_size: int = 8,
    *,
    padding_side: PaddingSide = "right",
    pad_token_id: int | None = None,
    method: Literal["auto", "single_pass", "per_choice"] = "auto",
    progress: bool = True,
) -> EvalResult:
    """Accuracy of ``model`` on ``task``.

    The model is called as ``model(input_ids, attention_mask=attention_mask)`` and must return
    logits ``[batch, pos, d_vocab]`` (a TransformerLens ``TransformerBridge``, a ``HookedSSM``, or
    any module; an output with ``.logits`` works too). When every choice is one token, one forward
    pass per batch scores all of them from the logits at the query position; otherwise each
    ``prompt + choice`` is scored by the log-probability of the choice's tokens, ``batch_size``
    rows at a time.

    Args:
        model: The model.
        task: A :class:`Task`.
        batch_size: Rows per forward pass.
        padding_side: ``"right"`` (default; positions unchanged) or ``"left"``.
        pad_token_id: Pad id; defaults to ``task.pad_token_id``.
        method: ``"auto"``, ``"single_pass"`` (requires single-token choices) or ``"per_choice"``
            (one row per prompt + choice; the reference the single pass is checked against).
        progress: Show a tqdm progress bar.

    Returns:
        An :class:`EvalResult`.

    Raises:
        TaskError: If a prompt (plus continuation) exceeds the model's context, the tokenizer's
            ids exceed the model's vocabulary, or the model does not return logits.

    Examples:
        >>> import torch
        >>> from gna_lens.tasks import kv_retrieval
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> keys = ["present", "scallops", "river", "lamp", "cloud"]
        >>> tok = word_tokenizer(["Memorize the following dictionary:",
        ...                       "The value of the key '", " is"] + keys)
        >>> task = kv_retrieval(tok, n_pairs=4, n_samples=6, words=keys)
        >>> _ = torch.manual_seed(0)
        >>> emb = torch.nn.Embedding(len(tok), 8)
        >>> def model(ids, attention_mask=None):  # any callable returning logits
        ...     return emb(ids) @ emb.weight.T
        >>> res = evaluate(model, task, batch_size=4, progress=False)
        >>> res.correct.tolist(), res.accuracy, res.chance  # a random model, 6 prompts, 4 choices
        ([True, True, False, True, False, False], 0.5, 0.25)
    """
    from tqdm import tqdm

    if not isinstance(task, Task):
        raise TaskError(f"task is a {type(task).__name__}; expected a gna_lens.tasks.Task.")
    if method not in ("auto", "single_pass", "per_choice"):
        raise TaskError(f"method={method!r}; expected 'auto', 'single_pass' or 'per_choice'.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise TaskError(f"batch_size={batch_size!r}; expected a positive int.")
    if not len(task):
        raise TaskError(
            f"task {task.name!r} has no prompts; an accuracy of nothing is undefined. Fix: a task "
            "with at least one prompt (n_samples >= 1)."
        )
    pad = task.pad_token_id if pad_token_id is None else int(pad_token_id)
    exact = task.scoring == "exact"
    single = all(len(s.answer_ids) == 1 if exact else s.single_token_choices for s in task)
    if method == "single_pass" and not single:
        raise TaskError(
            f"method='single_pass' but task {task.name!r} has multi-token choices; expected "
            "single-token choices. Fix: method='auto' or 'per_choice'."
        )
    use_single = single and method != "per_choice"
    net = model_of(model) if isinstance(model, Subject) else model
    device = _device(net)
    rows = _rows(task, use_single)
    _check_lengths(task, rows, model_context_length(net))
    scores: list[list[float]] = [[0.0] * len(s.choices) for s in task]
    # Per sample: the answer's score minus the best other one's, and the prediction.
    margins, preds = [float("inf")] * len(task), [-1] * len(task)
    max_id = max(max(ids) for s in task for ids in (s.input_ids, *s.choice_ids))
    _check_vocab(task, max_id, _declared(net, [("cfg", "d_vocab"), ("config", "vocab_size")]))
    with tqdm(
        total=len(rows), desc=f"evaluate {task.name}", disable=not progress, leave=False
    ) as bar:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            batch_ids, mask, offsets = pad_sequences(
                [r[1] for r in chunk], padding_side=padding_side, pad_token_id=pad, device=device
            )
            logits = checked_logits(net, batch_ids, mask)
            _check_vocab(task, max_id, logits.shape[-1])
            for b, (i, _, scored) in enumerate(chunk):
                # The positions predicting the continuation: from the prompt's last token on.
                first = offsets[b] + task[i].n_tokens - 1
                step = logits[b, first : first + max(len(ids) for _, ids in scored)].float()
                if exact:
                    ((_, ids),) = scored
                    margins[i] = min(
                        float(step[t, k]) - _best_other(step[t], k) for t, k in enumerate(ids)
                    )
                    preds[i] = int(step[0].argmax())
                    continue
                logp = torch.log_softmax(step, dim=-1)
                for c, ids in scored:
                    tgt = torch.tensor(ids, device=logp.device)
                    total = float(logp[: len(ids)].gather(-1, tgt[:, None]).sum())
                    scores[i][c] = total / _normalizer(task, i, c)
            bar.update(len(chunk))

    if not exact:
        for i, sc in enumerate(scores):
            t = torch.tensor(sc, dtype=torch.float64, device=HOST)
            k = task[i].answer_index
            preds[i], margins[i] = int(t.argmax()), float(t[k]) - _best_other(t, k)
    answers = torch.tensor([s.answer_index for s in task], dtype=torch.long, device=HOST)
    predictions = torch.tensor(preds, dtype=torch.long, device=HOST)
    diffs = torch.tensor(margins, dtype=torch.float32, device=HOST)
    return EvalResult(
        task=task.name,
        scoring=task.scoring,
        correct=diffs > 0 if exact else predictions == answers,
        logit_diffs=diffs,
        predictions=predictions,
        choice_scores=() if exact else tuple(tuple(sc) for sc in scores),
        answer_indices=answers,
        chance=task.chance,
        info={
            "method": "single_pass" if use_single else "per_choice",
            "padding_side": padding_side,
        },
    )
