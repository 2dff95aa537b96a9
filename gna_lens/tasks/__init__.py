"""Prompts whose structure is known token by token, and evaluation on them.

A task is a sequence of :class:`Sample` objects. Each sample knows its prompt's tokens, the token
ranges of its segments (dictionary lines, option lines), each segment's summary token (its last
token, the one holding the line's ``\\n``), the query position (the last prompt token) and which
segment holds the answer, all computed from the tokenizer's character offsets.

- :func:`kv_retrieval`: the G&A paper's key-value retrieval probe (seeded, any template; the
  ``"facts"`` template cannot be answered by induction, :attr:`KVTemplate.induction_proof`).
- :func:`multiple_choice`: letter (MMLU) and cloze formats over the same questions; records come
  from :func:`load_records` (files, ``datasets``, the hub) or :func:`load_mmlu` (offline MMLU).
- :func:`evaluate`: batched accuracy, per-sample correctness and logit differences.
- :func:`text_control`: windows of prose (shipped: :func:`load_prose`) for the next-token-loss
  control that tells retrieval heads from heads every prediction needs; :func:`resolve_control`
  turns what a user passes as ``control=`` (``"prose"``, texts, a dataset, a task) into one.
"""

from gna_lens.tasks.control import (
    PROSE_SOURCE,
    TextControl,
    load_prose,
    resolve_control,
    text_control,
)
from gna_lens.tasks.core import Batch, Sample, Task, build_sample
from gna_lens.tasks.evaluate import EvalResult, evaluate
from gna_lens.tasks.kv import (
    KV_TEMPLATES,
    KVTemplate,
    copying_oracle,
    kv_retrieval,
    load_words,
    requery,
)
from gna_lens.tasks.mc import format_question, multiple_choice
from gna_lens.tasks.records import MCRecord, load_mmlu, load_records

__all__ = [
    "KV_TEMPLATES",
    "PROSE_SOURCE",
    "Batch",
    "EvalResult",
    "KVTemplate",
    "MCRecord",
    "Sample",
    "Task",
    "TextControl",
    "build_sample",
    "copying_oracle",
    "evaluate",
    "format_question",
    "kv_retrieval",
    "load_mmlu",
    "load_prose",
    "load_records",
    "load_words",
    "multiple_choice",
    "requery",
    "resolve_control",
    "text_control",
]
