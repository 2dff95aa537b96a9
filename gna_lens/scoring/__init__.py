"""G&A scoring and discovery, identical for attention heads and SSM heads.

- :func:`pattern_scores`: gather / aggregate / correct-share / sharpness scores from the heads'
  patterns (attention, or a HookedSSM's materialized implicit attention), each with a null and
  a role label only where the score beats it.
- :func:`score_heads`: those scores plus exact ablation effects on the task and on a control
  (every head up to :data:`EXACT_ALL_MAX` heads; above, coarse to fine: layers ranked by removal,
  then the heads of the top layers; or pre-filtered by attribution), as a :class:`GnaReport`
  whose default ranking is retrieval-specific, with ``to_dataframe``, ``top``, ``excluded``,
  ``unmeasured`` (heads never ablated, and why), heatmaps, JSON and an offline HTML report; its
  :class:`JointSet` is the greedy set of heads whose control effect *removed together* stays
  within the bound (what ``top(k)`` returns).
- :func:`joint_stability`: how often each head stays in the joint set over resampled selection
  data.
- :func:`rank_stability`: 95% bootstrap intervals of the top heads' ranks, per control bound and
  prompt count.
- :func:`find_gna_pairs`: Gather -> Aggregate pairs confirmed by ablation and pattern masks
  (:func:`pair_candidates`, :func:`mask_experiment`).
- :func:`prefix_matching_scores`: the prefix-matching (induction) score of every head on repeated
  random tokens, against a uniform-head baseline: which heads could answer a retrieval prompt by
  copying alone.
- :func:`retrieval_vs_knowledge`: accuracy before / after removing heads, per task, with 95%
  intervals, a control and a random-head baseline matched by layer.
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
