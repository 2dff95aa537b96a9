"""What an intervention measures per prompt: :class:`Metric` (``"accuracy"``, ``"logit_diff"``,
``"logprob"``, ``"choice_logprob"`` or a function of the query logits and the samples)."""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gna_lens.device import HOST, to_host
from gna_lens.errors import InterventionError
from gna_lens.tasks import Sample, Task

__all__ = ["METRICS", "Metric", "MetricFn", "MetricName"]


MetricName = Literal["accuracy", "logit_diff", "logprob"]


#: A user metric: logits at each row's query position ``[rows, d_vocab]`` and the rows' samples
#: -> one value per row ``[rows]``.
MetricFn = Callable[[Tensor, Sequence[Sample]], Tensor]


METRICS = ("accuracy", "logit_diff", "logprob", "choice_logprob")


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
