"""Prompts whose structure is known token by token, and evaluation on them."""

from gna_lens.tasks._core import Batch, Sample, Task, build_sample
from gna_lens.tasks.kv import KV_TEMPLATES, KVTemplate, kv_retrieval, load_words

__all__ = [
    "KV_TEMPLATES",
    "Batch",
    "KVTemplate",
    "Sample",
    "Task",
    "build_sample",
    "kv_retrieval",
    "load_words",
]
