"""Retrieval-guided hybrids: keep the heads retrieval needs as attention, turn the rest into SSM
heads, distill, and measure.

:func:`build_hybrid` makes, from a Llama-style Transformer (the teacher) and a list of its heads
to keep, a student :class:`~gna_lens.models.HookedSSM` with the teacher's embeddings, norms and
MLPs, in which every kept head stays attention with the teacher's weights and every other head
becomes a Mamba-2-style SSM head initialized from the teacher head's own projections
(``Q -> C``, ``K -> B``, ``V -> x``: Mamba-in-the-Llama, MOHAWK, Llamba). Heads keep the
teacher's numbering, so the student is scanned, ablated, patched and masked head by head like
any model (:func:`gna_lens.head_view` gives each head's kind). The student saves with
``student.save_pretrained(folder)`` and loads back with :func:`gna_lens.load_model`.

:func:`distill` trains a student from its teacher: per-layer alignment of each mixer's output to
the teacher's attention output on the teacher's input, then KL to the teacher's logits; with a
budget in tokens or minutes (:func:`parse_budget`), checkpoints and bit-identical resume, on
:func:`default_distill_data` (offline; seeds and splits disjoint from every evaluation set). A
stage whose loss runs away stops with :class:`DistillationDiverged`.

:func:`swap_heads` does the converse on a pretrained Mamba-2 (or Mamba-2 hybrid): chosen SSM
heads become attention heads started from the head's own ``C`` / ``B`` / ``x``, and only the new
parameters train.

:func:`swap_layers` and :func:`swap_teacher_heads` put the teacher back into a student, weights
copied and nothing trained: whole layers, or single heads (SSM head ``h`` of layer ``l`` becomes
the teacher's attention head ``h`` of layer ``l``).

:func:`run_experiment` (``gna-lens hybrid``) runs the whole loop: rank the teacher's heads,
distill students keeping the top-k or k random heads, and measure held-out KV retrieval, prose
loss, knowledge and :func:`state_bytes` (recurrent states and KV cache per token).

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
