"""G&A scoring and discovery, identical for attention heads and SSM heads.

- :func:`pattern_scores`: gather / aggregate / correct-share / sharpness scores from the heads'
  patterns, each with a null and a role label only where the score beats it.
- :func:`score_heads`: those scores plus exact ablation effects on the task and on a control, as
  a :class:`GnaReport` whose default ranking is retrieval-specific (its :class:`JointSet`: heads
  whose control effect *removed together* stays within the bound).
- :func:`rank_stability` and :func:`joint_stability`: how stable that ranking and that set are
  over resampled prompts and control windows.
- :func:`find_gna_pairs`: Gather -> Aggregate pairs confirmed by ablation and pattern masks.
- :func:`prefix_matching_scores`: induction scores, which heads could answer by copying alone.
- :func:`retrieval_vs_knowledge`: accuracy before / after removing heads, per task, with a
  control and a random-head baseline.
"""

from gna_lens.scoring.induction import InductionScores, prefix_matching_scores
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
from gna_lens.scoring.pipeline import score_heads
from gna_lens.scoring.report import (
    JOINT_K,
    MAX_CONTROL,
    ExcludedHead,
    GnaReport,
    JointSet,
    RejectedHead,
    UnmeasuredHeads,
)
from gna_lens.scoring.stability import (
    JointStability,
    RankInterval,
    RankStability,
    joint_stability,
    rank_stability,
)
from gna_lens.sweep_policy import EXACT_ALL_MAX, STRATEGIES, default_top_layers
from gna_lens.tasks.control import resolve_control

__all__ = [
    "EXACT_ALL_MAX",
    "JOINT_K",
    "MAX_CONTROL",
    "NORMALIZATION",
    "STRATEGIES",
    "ControlRow",
    "ExcludedHead",
    "GnaPair",
    "GnaReport",
    "InductionScores",
    "JointSet",
    "JointStability",
    "KnowledgeTable",
    "MaskResult",
    "PatternScores",
    "RandomHeadSets",
    "RankInterval",
    "RankStability",
    "RejectedHead",
    "TaskRow",
    "UnmeasuredHeads",
    "default_top_layers",
    "find_gna_pairs",
    "gna_masks",
    "joint_stability",
    "mask_experiment",
    "masked_accuracy",
    "matched_random_sets",
    "pair_candidates",
    "pattern_scores",
    "prefix_matching_scores",
    "rank_stability",
    "resolve_control",
    "retrieval_vs_knowledge",
    "row_sharpness",
    "score_heads",
]
