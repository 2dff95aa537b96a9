"""lm-evaluation-harness on gna_lens models with heads removed (``pip install gna-lens[lmeval]``).

Importing this module registers :class:`GnaLM` with lm-eval's model registry as ``"gna_lens"``
(lm-eval 0.4 has no plugin discovery for models, so the plain ``lm_eval`` command does not see
it; use ``python -m gna_lens.lm_eval`` or ``gna-lens lm-eval``, which take lm-eval's own
arguments)::

    python -m gna_lens.lm_eval --model gna_lens \\
        --model_args pretrained=meta-llama/Llama-3.2-1B,remove=L9H25;L4H4,mode=zero \\
        --tasks mmlu,lambada_openai --batch_size 8

- :class:`GnaLM`: ``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` on a
  TransformerBridge or HookedSSM, with heads ablated (``mode``, ``positions``) or G&A patterns
  masked; hooks exist only during each forward pass.
- :func:`evaluate_table`: lm-eval once per row of removed heads (top 0 / 10 / 20 / 30 of a
  ranking, optionally rows of as many random layer-matched heads), the paper's table as a
  :class:`BenchmarkTable` (also ``gna-lens evaluate``); the ranking made on the fly by
  ``logit_diff`` or, the paper's protocol, single-head ``accuracy`` (:data:`RANKING_METRICS`).
- :func:`compare_models`: the paper's comparison of architectures (Llama-3.2-3B vs Llamba-3B):
  the same table for several models, each ranking its own heads, and what each keeps per
  sequence (recurrent states vs KV cache), as a :class:`ModelComparison` (also
  ``gna-lens evaluate MODEL_A MODEL_B``).
- :func:`write_tasks`: the offline tasks (:data:`LOCAL_TASKS`: MMLU letter and cloze, KV
  retrieval) as YAML + JSON lines.
"""

import importlib.util

if importlib.util.find_spec("lm_eval") is None:
    raise ImportError(
        "gna_lens.lm_eval needs lm-evaluation-harness, which is not installed. Fix: "
        "pip install 'gna-lens[lmeval]' (or pip install 'lm-eval>=0.4.13,<0.5')."
    )

from gna_lens.lm_eval._model import GnaLM, Intervention, format_heads, parse_heads, register
from gna_lens.lm_eval.compare import DEFAULT_STATE_LENGTHS, ModelComparison, compare_models
from gna_lens.lm_eval.table import (
    RANKING_METRICS,
    BenchmarkTable,
    TableCell,
    evaluate_table,
    load_ranking,
)
from gna_lens.lm_eval.tasks import LOCAL_TASKS, build_local_task, write_task, write_tasks

register()

__all__ = [
    "DEFAULT_STATE_LENGTHS",
    "LOCAL_TASKS",
    "RANKING_METRICS",
    "BenchmarkTable",
    "GnaLM",
    "Intervention",
    "ModelComparison",
    "TableCell",
    "build_local_task",
    "compare_models",
    "evaluate_table",
    "format_heads",
    "load_ranking",
    "parse_heads",
    "register",
    "write_task",
    "write_tasks",
]
