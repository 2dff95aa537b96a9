"""G&A scoring and discovery, identical for attention heads and SSM heads.

- :func:`pattern_scores`: gather / aggregate / correct-share / sharpness scores from the heads'
  patterns (attention, or a HookedSSM's materialized implicit attention), each with a null and
  a role label only where the score beats it.
- :func:`score_heads`: those scores plus exact ablation effects on the task and on a control
  (optionally pre-filtered by attribution), as a :class:`GnaReport` whose default ranking is
  retrieval-specific, with ``to_dataframe``, ``top``, ``excluded``, heatmaps, JSON and an
  offline HTML report.
- :func:`find_gna_pairs`: Gather -> Aggregate pairs confirmed by ablation and pattern masks
  (:func:`pair_candidates`, :func:`mask_experiment`).
- :func:`retrieval_vs_knowledge`: accuracy before / after removing heads, per task, with 95%
  intervals, a control and a random-head baseline matched by layer.
"""

from gna_lens.scoring.knowledge import (
    ControlRow,
    KnowledgeTable,
    RandomHeadSets,
    TaskRow,
    matched_random_sets,
    retrieval_vs_knowledge,
)
from gna_lens.scoring.pairs import (
    GnaPair,
    MaskResult,
    find_gna_pairs,
    gna_masks,
    mask_experiment,
    masked_accuracy,
    pair_candidates,
)
from gna_lens.scoring.patterns import NORMALIZATION, PatternScores, pattern_scores, row_sharpness
from gna_lens.scoring.report import (
    MAX_CONTROL,
    ExcludedHead,
    GnaReport,
    resolve_control,
    score_heads,
)

__all__ = [
    "MAX_CONTROL",
    "NORMALIZATION",
    "ControlRow",
    "ExcludedHead",
    "GnaPair",
    "GnaReport",
    "KnowledgeTable",
    "MaskResult",
    "PatternScores",
    "RandomHeadSets",
    "TaskRow",
    "find_gna_pairs",
    "gna_masks",
    "mask_experiment",
    "masked_accuracy",
    "matched_random_sets",
    "pair_candidates",
    "pattern_scores",
    "resolve_control",
    "retrieval_vs_knowledge",
    "row_sharpness",
    "score_heads",
]
