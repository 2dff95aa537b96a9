"""Pattern masks by row position and by sign: the rows a mask changes are the ones the paper's
mechanism names, and on a model built with the mechanism, keeping the G&A patterns does at
least as well as denying them, which hurts."""

import pytest
import torch
from interventions_helpers import task as make_task

from gna_lens.interventions import aggregate_mask, gather_mask
from gna_lens.scoring import masked_accuracy
from gna_lens.testing import TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD, toy_gna_model, toy_gna_task


def _changed_rows(mask):
    return [int(r) for r in torch.nonzero(~mask.all(-1)).flatten()]


@pytest.mark.parametrize("complement", [False, True])
def test_the_aggregate_mask_changes_the_query_row_only_and_keeps_the_summaries(complement):
    for s in make_task(n_pairs=4, n_samples=4):
        m = aggregate_mask(s, complement=complement)
        assert s.query_position == s.n_tokens - 1  # the final position asks
        assert _changed_rows(m) == [s.query_position]
        summary = torch.zeros(s.n_tokens, dtype=torch.bool)
        summary[list(s.summary_positions)] = True
        assert torch.equal(m[s.query_position], ~summary if complement else summary)


@pytest.mark.parametrize("complement", [False, True])
def test_the_gather_mask_changes_each_summary_row_to_its_own_segment(complement):
    for s in make_task(n_pairs=4, n_samples=4):
        m = gather_mask(s, complement=complement)
        assert _changed_rows(m) == sorted(s.summary_positions)
        for (a, b), p in zip(s.segments, s.summary_positions, strict=True):
            assert a <= p < b  # the summary token closes its own segment
            inside = torch.zeros(s.n_tokens, dtype=torch.bool)
            inside[a:b] = True
            assert torch.equal(m[p], ~inside if complement else inside)


def test_keeping_the_gna_patterns_beats_denying_them_on_a_model_built_with_them():
    model = toy_gna_model()
    task = toy_gna_task(model, n_pairs=4, n_samples=16)

    def masks(complement):
        return lambda b: {
            TOY_GATHER_HEAD: gather_mask(b, complement=complement),
            TOY_AGGREGATE_HEAD: aggregate_mask(b, complement=complement),
        }

    clean = masked_accuracy(model, task)
    keep = masked_accuracy(model, task, masks(False))
    deny = masked_accuracy(model, task, masks(True))
    assert clean == 1.0
    assert keep >= deny and keep == 1.0  # the mechanism only reads what the masks keep
    assert deny <= 0.5  # denying it breaks retrieval
