"""Random-head baselines that compare (issue 30, part 7): intervals over draws and prompts, a
paired test of the removed set against the random sets, layer-matched draws whenever the layers
allow, excluded heads never drawn."""

from dataclasses import replace

import torch

from gna_lens.heads import head_view
from gna_lens.scoring import retrieval_vs_knowledge
from gna_lens.scoring.knowledge import matched_random_sets
from gna_lens.stats import draws_interval, paired_permutation_test, two_level_interval
from gna_lens.testing import (
    TOY_AGGREGATE_HEAD,
    TOY_GATHER_HEAD,
    tiny_hooked_ssm,
    toy_gna_model,
    toy_gna_task,
)


def test_the_two_level_interval_covers_prompt_sampling():
    """Draws that agree on their mean but whose prompts disagree: an interval over the draws
    alone has no width; one over draws and prompts does."""
    gen = torch.Generator().manual_seed(0)
    per_prompt = (torch.rand(40, generator=gen) < 0.5).double()
    x = per_prompt[None].repeat(10, 1)  # 10 draws, identical
    over_draws = draws_interval(x.mean(-1))
    both = two_level_interval(x)
    assert over_draws.high - over_draws.low == 0.0
    assert both.high - both.low > 0.2
    assert both.low < float(x.mean()) < both.high


def test_the_permutation_test_separates_a_shift_from_noise():
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(60, generator=gen)
    assert paired_permutation_test(noise - 1.0) < 0.001
    assert paired_permutation_test(noise - noise.mean()) > 0.5


def test_layer_matched_when_the_layer_allows_and_excluded_heads_never_drawn():
    view = head_view(tiny_hooked_ssm("mamba2"))  # 2 layers x 8 heads
    drawn = matched_random_sets(view, [(1, 0)], 10, exclude=[(1, 1), (1, 2)])
    assert drawn.matching == "layer" and len(drawn.sets) == 5  # every possible one
    assert all(s[0][0] == 1 and s[0] not in {(1, 0), (1, 1), (1, 2)} for s in drawn.sets)
    assert "all used" in drawn.describe() and "2 more heads excluded" in drawn.describe()
    # Fewer than MIN_MATCHED_DRAWS layer-matched sets: matched on kind, and said so.
    drawn = matched_random_sets(view, [(1, 0)], 10, exclude=[(1, h) for h in range(1, 5)])
    assert drawn.matching == "kind" and "too few distinct sets" in drawn.describe()


def test_removing_the_aggregate_head_beats_random_heads_prompt_by_prompt():
    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=24, seed=3)
    table = retrieval_vs_knowledge(
        model, [TOY_AGGREGATE_HEAD], {"kv": task}, random_draws=5, progress=False
    )
    row = table.rows[0]
    # One of the 3 possible random sets is the gather head, which breaks retrieval as well: the
    # set-level interval (over draws and prompts) must then reach 0; the prompt-level test still
    # separates the set from the random sets' mean.
    assert TOY_GATHER_HEAD in {s[0] for s in table.random_sets}
    assert row.vs_random is not None and row.vs_random.high >= 0 > row.vs_random.value
    assert row.vs_random.method == "bootstrap (draws x prompts)"
    clean = retrieval_vs_knowledge(
        model, [TOY_AGGREGATE_HEAD], {"kv": task}, random_draws=5, exclude=[TOY_GATHER_HEAD],
        progress=False,
    ).rows[0]  # fmt: skip
    assert clean.vs_random is not None and clean.vs_random.high < 0
    assert row.p_value is not None and row.p_value < 0.01
    assert row.random_change is not None and row.random_change.method.startswith("bootstrap (draws")
    # The paired difference is the set's change minus the random sets' mean change.
    assert abs(row.vs_random.value - (row.change.value - row.random_change.value)) < 1e-9


def test_random_sets_run_only_where_the_model_is_above_chance_and_the_rest_is_unchanged():
    """``random_if_above_chance``: a task the model does not do gets the set's own numbers and a
    note, no random sets (the scan's held-out stage); a task it does gets the same numbers as
    with every set in one sweep."""
    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=24, seed=3)
    # The same prompts with every answer moved to the next choice: the toy answers 0 of them.
    wrong = replace(
        task,
        samples=tuple(replace(s, answer_index=(s.answer_index + 1) % len(s.choices)) for s in task),
    )
    tasks = {"kv": task, "kv-wrong": wrong}
    kw = dict(random_draws=5, progress=False, exclude=[TOY_GATHER_HEAD])
    full = retrieval_vs_knowledge(model, [TOY_AGGREGATE_HEAD], tasks, **kw)
    lean = retrieval_vs_knowledge(
        model, [TOY_AGGREGATE_HEAD], tasks, random_if_above_chance=True, **kw
    )
    done, skipped = lean.rows
    assert skipped.before.value == 0.0 and skipped.random_after is None
    assert skipped.vs_random is None and skipped.random_draws == ()
    assert skipped.random_note == "not run: the model is not above chance on this task"
    assert skipped.after == full.rows[1].after and skipped.change == full.rows[1].change
    assert (
        "kv-wrong" in lean.format_lines()[1] and "random heads: not run" in lean.format_lines()[1]
    )
    assert done == full.rows[0] and done.random_after is not None and done.random_note == ""
    assert lean.method["random_tasks"].startswith("the tasks the model does above chance")
    assert full.rows[1].random_after is not None  # the default runs them everywhere
