"""How prompts are batched for the interventions: groups of prompts of one length (:class:`Group`),
clean / corrupted pairs, rows per forward pass under a memory budget."""

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import InterventionError
from gna_lens.heads import HeadView, HookedModel
from gna_lens.tasks import Task, TextControl

__all__ = [
    "Group",
    "check_query_is_last",
    "chunks",
    "describe_task",
    "length_groups",
    "paired_groups",
    "parse_bytes",
    "plan_rows",
    "row_bytes",
    "row_groups",
    "tokens_of",
]


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


def row_groups(tokens: Tensor, max_rows: int, device: Any) -> list[Group]:
    """Unpadded token ids ``[n, pos]`` as groups of at most ``max_rows`` rows, in order."""
    n = tokens.shape[0]
    return [
        Group(
            torch.arange(s, min(s + max_rows, n), device=HOST), tokens[s : s + max_rows].to(device)
        )
        for s in range(0, n, max_rows)
    ]


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


def row_bytes(model: HookedModel, view: HeadView, length: int, logits_positions: int) -> int:
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
    model: HookedModel,
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


def describe_task(task: Task) -> str:
    return f"{task.name} (n={len(task)}, scoring={task.scoring})"


def describe_control(control: Any) -> tuple[str, str]:
    """What a resolved control measures and its unit: ``(description, unit)``; ``("", "")``
    for ``None``. A text control is a next-token loss (nats/token); a knowledge task, the
    answer's NLL among its options (nats/answer)."""
    if control is None:
        return "", ""
    if isinstance(control, TextControl):
        return control.describe(), "nats/token"
    return f"answer NLL among the options on {describe_task(control)}", "nats/answer"
