"""G&A scoring and discovery, identical for attention heads and SSM heads.

- :func:`pattern_scores`: gather / aggregate / correct-share / sharpness scores from the heads'
  patterns (attention, or a HookedSSM's materialized implicit attention).
- :func:`score_heads`: those scores plus exact ablation effects (optionally pre-filtered by
  attribution), as a :class:`GnaReport` with ``to_dataframe``, ``top``, heatmaps, JSON and an
  offline HTML report.
- :func:`find_gna_pairs`: Gather -> Aggregate pairs confirmed by ablation and pattern masks.
- :func:`retrieval_vs_knowledge`: accuracy before / after removing heads, per task.
"""

from gna_lens.scoring.pairs import (
    GnaPair,
    KnowledgeTable,
    find_gna_pairs,
    masked_accuracy,
    retrieval_vs_knowledge,
)
from gna_lens.scoring.patterns import NORMALIZATION, PatternScores, pattern_scores, row_sharpness
from gna_lens.scoring.report import GnaReport, score_heads

__all__ = [
    "NORMALIZATION",
    "GnaPair",
    "GnaReport",
    "KnowledgeTable",
    "PatternScores",
    "find_gna_pairs",
    "masked_accuracy",
    "pattern_scores",
    "retrieval_vs_knowledge",
    "row_sharpness",
    "score_heads",
]
