"""Retrieval-guided hybrids: keep the heads retrieval needs as attention, turn the rest into SSM
heads, distill, and measure.

- :func:`build_hybrid`: a student :class:`~gna_lens.models.HookedSSM` of a Llama-style teacher
  in which the kept heads stay attention and every other head becomes a Mamba-2-style SSM head
  initialized from its own projections (Mamba-in-the-Llama, MOHAWK, Llamba); heads keep the
  teacher's numbering, so the student is analyzed head by head like any model.
- :func:`distill`: per-layer alignment, then the teacher's logits, under a budget in tokens or
  minutes (:func:`parse_budget`), with checkpoints and bit-identical resume, on
  :func:`default_distill_data` (offline, disjoint from every evaluation set).
- :func:`swap_heads`: the converse on a pretrained Mamba-2 (or Mamba-2 hybrid): chosen SSM heads
  become attention heads, and only their new parameters train.
- :func:`swap_layers`, :func:`swap_teacher_heads`: the teacher's attention layers, or single
  heads, put back into a student, weights copied and nothing trained.
- :func:`run_experiment` (``gna-lens hybrid``): rank the teacher's heads, distill students
  keeping the top-k or k random heads, and measure held-out KV retrieval, prose loss, knowledge
  and :func:`state_bytes`.

See the docs page "Hybrid students" for the method, its sources and measured tables.
"""

from gna_lens.errors import DistillationDiverged
from gna_lens.hybrid._budget import Budget, parse_budget
from gna_lens.hybrid._build import HEAD_LAYOUTS, build_hybrid
from gna_lens.hybrid._data import (
    DISTILL_DATA,
    DISTILL_SEEDS,
    EVAL_KV_SEED,
    EVALUATION_SEEDS,
    DataComposition,
    DistillData,
    data_composition,
    default_distill_data,
    distill_data,
)
from gna_lens.hybrid._distill import DistillResult, distill
from gna_lens.hybrid._experiment import HybridRow, HybridTable, run_experiment
from gna_lens.hybrid._layer_swap import swap_layers, swap_teacher_heads
from gna_lens.hybrid._swap import swap_heads
from gna_lens.models.state import DEFAULT_LENGTHS, StateBytes, state_bytes

__all__ = [
    "DEFAULT_LENGTHS",
    "DISTILL_DATA",
    "DISTILL_SEEDS",
    "EVALUATION_SEEDS",
    "EVAL_KV_SEED",
    "HEAD_LAYOUTS",
    "Budget",
    "DataComposition",
    "DistillData",
    "DistillResult",
    "DistillationDiverged",
    "HybridRow",
    "HybridTable",
    "StateBytes",
    "build_hybrid",
    "data_composition",
    "default_distill_data",
    "distill",
    "distill_data",
    "parse_budget",
    "run_experiment",
    "state_bytes",
    "swap_heads",
    "swap_layers",
    "swap_teacher_heads",
]
