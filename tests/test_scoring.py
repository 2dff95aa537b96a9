"""G&A scoring: known heads found on a hand-built model, invariances, sharpness, all architectures."""

import math
import tempfile
from pathlib import Path

import pytest
import torch

from gna_lens.errors import GnaLensError
from gna_lens.scoring import (
    find_gna_pairs,
    pattern_scores,
    retrieval_vs_knowledge,
    row_sharpness,
    score_heads,
)
from gna_lens.tasks import kv_retrieval
from gna_lens.tasks.toy_tokenizers import word_tokenizer
from gna_lens.testing import (
    TOY_AGGREGATE_HEAD,
    TOY_GATHER_HEAD,
    TOY_GENERIC_HEAD,
    TOY_WORDS,
    tiny_checkpoint,
    tiny_hooked_ssm,
    toy_control,
    toy_gna_model,
    toy_gna_task,
)


@pytest.fixture(scope="module")
def toy():
    model = toy_gna_model()
    return model, toy_gna_task(model, n_pairs=4, n_samples=12, seed=1)


@pytest.fixture(scope="module")
def generic():
    """The toy with a generic head that every prediction (and the control) needs."""
    model = toy_gna_model(generic_head=True)
    task = toy_gna_task(model, n_pairs=4, n_samples=12, seed=1)
    return model, task, score_heads(model, task, control=toy_control(model), progress=False)


def test_default_ranking_puts_gna_heads_first_and_lists_the_generic_head_as_excluded(generic):
    _, _, report = generic
    assert set(report.top(2)) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    assert TOY_GENERIC_HEAD not in report.top(6)
    gone = report.excluded(2)
    assert [e.head for e in gone] == [TOY_GENERIC_HEAD]
    assert gone[0].control_effect > report.max_control and "max_control" in gone[0].reason
    # The raw order puts the generic head first: its removal hurts retrieval the most.
    assert report.top(1, by="ablation_effect") == [TOY_GENERIC_HEAD]
    df = report.to_dataframe().set_index(["layer", "head"])
    assert df.loc[TOY_GENERIC_HEAD, "control_effect"] > 1.0
    for h in (TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD):
        assert abs(df.loc[h, "control_effect"]) < 0.05
        assert df.loc[h, "specificity"] == pytest.approx(1.0, abs=0.05)
    assert df.loc[TOY_GENERIC_HEAD, "specificity"] < 0.6
    # Effects carry their bootstrap intervals.
    row = df.loc[TOY_AGGREGATE_HEAD]
    assert row["ablation_effect_low"] <= row["ablation_effect"] <= row["ablation_effect_high"]
    assert report.method["control"].startswith("toy-chains")


def test_a_stricter_or_looser_control_bound_moves_the_generic_head(generic):
    model, task, report = generic
    import dataclasses

    loose = dataclasses.replace(report, max_control=100.0)
    assert loose.top(1) == [TOY_GENERIC_HEAD] and loose.excluded(1) == []
    no_control = score_heads(model, task, control=None, progress=False, n_examples=0)
    with pytest.raises(GnaLensError, match="needs control effects"):
        no_control.top(2)
    assert no_control.top(1, by="ablation_effect") == [TOY_GENERIC_HEAD]


def test_pattern_roles_need_a_score_above_its_null(generic):
    _, _, report = generic
    df = report.to_dataframe().set_index(["layer", "head"])
    assert df.loc[TOY_GATHER_HEAD, "role"] == "gather"
    assert df.loc[TOY_AGGREGATE_HEAD, "role"] == "aggregate"
    # The generic head attends to the token itself: that is not gathering.
    assert df.loc[TOY_GENERIC_HEAD, "gather_share"] < 0.05
    assert df.loc[TOY_GENERIC_HEAD, "role"] == ""
    # Uniform (zero-weight) heads do not beat the nulls.
    assert df.loc[(1, 1), "role"] == "" and df.loc[(0, 1), "role"] == ""
    assert df.loc[TOY_AGGREGATE_HEAD, "correct_chance"] == pytest.approx(0.25)


def test_previous_token_and_self_attending_heads_get_no_gather_score():
    from gna_lens.scoring.patterns import SCORE_NAMES, _sample_scores
    from gna_lens.tasks import Sample

    n = 10
    sample = Sample(
        prompt="", input_ids=list(range(n)), segments=[(1, 4), (4, 7)], segment_chars=[(0, 1)] * 2,
        summary_positions=[3, 6], query_position=9, answer_segment=1, choices=["a", "b"],
        choice_ids=[[1], [2]], answer_index=1,
    )  # fmt: skip
    eye = torch.eye(n)
    prev = torch.zeros(n, n)
    prev[torch.arange(1, n), torch.arange(n - 1)] = 1.0
    prev[0, 0] = 1.0
    gather = torch.zeros(n, n)
    gather[3, 1] = gather[6, 4] = 1.0  # the segment's first tokens, far from t
    gather[torch.arange(n), torch.arange(n)] += 1e-3
    scores = _sample_scores(torch.stack([eye, prev, gather]), sample, sink=True)
    g, share = SCORE_NAMES.index("gather_score"), SCORE_NAMES.index("gather_share")
    # Self-attention is no gathering; a previous-token head gathers no more at the true
    # boundaries than at shifted ones (the local baseline), so its score is 0.
    assert scores[0, share] == 0.0 and scores[0, g] == 0.0
    assert scores[1, share] == 1.0 and scores[1, g] == pytest.approx(0.0)
    assert scores[2, share] == pytest.approx(1.0, abs=1e-2) and scores[2, g] > 0.9
    # Signed SSM-like rows are compared on |row|: negating a pattern changes nothing.
    flipped = _sample_scores(-torch.stack([eye, prev, gather]), sample, sink=True)
    assert torch.allclose(flipped, scores)


def test_scores_and_ranking_find_the_known_heads(toy):
    model, task = toy
    report = score_heads(model, task, control=toy_control(model), progress=False)
    df = report.to_dataframe()
    assert list(df.columns[:9]) == [
        "layer", "head", "kind", "role", "gather_score", "gather_share", "gather_null",
        "aggregate_score", "aggregate_null",
    ]  # fmt: skip
    assert report.top(1, by="gather_score") == [TOY_GATHER_HEAD]
    assert report.top(1, by="correct_share") == [TOY_AGGREGATE_HEAD]
    assert report.top(1, by="aggregate_score") == [TOY_AGGREGATE_HEAD]
    assert set(report.top(2)) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    row = df.set_index(["layer", "head"])
    assert row.loc[TOY_GATHER_HEAD, "gather_share"] > 0.99
    assert row.loc[TOY_GATHER_HEAD, "gather_score"] > 0.5
    assert row.loc[TOY_AGGREGATE_HEAD, "correct_share"] > 0.99
    assert row.loc[TOY_AGGREGATE_HEAD, "sharpness"] > 0.99
    others = [h for h in report.heads if h not in (TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD)]
    for h in others:
        assert row.loc[h, "ablation_effect"] == pytest.approx(0.0, abs=1e-5)
        assert row.loc[h, "correct_share"] == pytest.approx(0.25, abs=1e-5)  # uniform over 4
    assert row.loc[TOY_GATHER_HEAD, "ablation_effect"] < -10
    assert row.loc[TOY_AGGREGATE_HEAD, "ablation_effect"] < -10


def test_attribution_prefilter_keeps_the_known_heads(toy):
    model, task = toy
    report = score_heads(model, task, prefilter=2, control=toy_control(model), progress=False)
    effects = report.scores["ablation_effect"]
    measured = {h for h, e in zip(report.heads, effects.tolist(), strict=True) if not math.isnan(e)}
    assert measured == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    assert set(report.top(2)) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}


def test_pair_finding_confirms_the_known_pair(toy):
    model, task = toy
    pairs = find_gna_pairs(model, task, control=toy_control(model), progress=False)
    best = pairs[0]
    assert (best.gather, best.aggregate, best.confirmed) == (
        TOY_GATHER_HEAD,
        TOY_AGGREGATE_HEAD,
        True,
    )
    assert best.baseline_accuracy == 1.0
    assert best.kept_accuracy == 1.0  # keeping only the G&A patterns preserves retrieval
    assert best.masked_accuracy <= 0.5  # denying them breaks it
    assert best.chance == pytest.approx(0.25)


def test_retrieval_vs_knowledge_table(toy):
    model, task = toy
    table = retrieval_vs_knowledge(
        model, [TOY_AGGREGATE_HEAD], {"kv-4": task}, control=toy_control(model), progress=False
    )
    df = table.to_dataframe()
    assert df.loc[0, "before"] == 1.0
    assert df.loc[0, "after"] <= 0.5
    assert df.loc[0, "relative_change"] == pytest.approx(df.loc[0, "after"] - 1.0)
    # Wilson intervals: 12/12 correct is not "100% for sure".
    assert df.loc[0, "before_low"] < 0.8 and df.loc[0, "before_high"] == 1.0
    assert df.loc[0, "change_high"] < 0  # the paired interval excludes no change
    # The toy has 2 heads per layer: layer 1 allows one random set, not 10 distinct ones, so
    # the baseline draws every set of one head outside the removed one (any layer) and says so.
    assert sorted(table.random_sets) == [((0, 0),), ((0, 1),), ((1, 1),)]
    assert "only 3 possible, 10 requested" in table.method["random_sets"]
    # The draw that removes the gather head breaks retrieval as the aggregate head does.
    draws = dict(zip(table.random_sets, table.rows[0].random_draws, strict=True))
    assert draws[(TOY_GATHER_HEAD,)] <= 0.5 and draws[((0, 1),)] == draws[((1, 1),)] == 1.0
    assert table.control is not None and abs(table.control.change.value) < 0.05
    with pytest.raises(GnaLensError, match="at least one task"):
        retrieval_vs_knowledge(model, [TOY_AGGREGATE_HEAD], {})


def test_sharpness_of_one_hot_and_uniform_rows():
    share, entropy = row_sharpness(torch.tensor([0.0, 0.0, 2.5, 0.0]))
    assert float(share) == 1.0 and float(entropy) == 0.0
    for k in (2, 5, 7):
        share, entropy = row_sharpness(torch.full((k,), 0.3))
        assert float(share) == pytest.approx(1 / k)
        assert float(entropy) == pytest.approx(math.log(k))
    share, entropy = row_sharpness(torch.zeros(3))
    assert float(share) == 0.0 and float(entropy) == 0.0


def _word_task(tokenizer, n_samples=6):
    return kv_retrieval(
        tokenizer,
        n_pairs=3,
        n_samples=n_samples,
        template={"header": "", "line": "{key} {value}\n", "query": "{key}", "answer": " {value}"},
        values="words",
        words=TOY_WORDS,
        add_special_tokens=False,
    )


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "bamba"])
def test_scores_are_invariant_to_batch_size_and_padding_side(arch):
    tok = word_tokenizer([" ".join(TOY_WORDS)])
    model = tiny_hooked_ssm(arch, seed=2, vocab_size=len(tok))
    model.tokenizer = tok
    task = _word_task(tok)
    ref = pattern_scores(model, task, batch_size=1, padding_side="right", progress=False)
    for batch_size, side in [(4, "left"), (6, "right"), (3, "left")]:
        got = pattern_scores(model, task, batch_size=batch_size, padding_side=side, progress=False)
        for name in ("gather_score", "gather_share", "aggregate_score", "aggregate_null",
                     "correct_share", "sharpness", "entropy"):  # fmt: skip
            assert torch.allclose(getattr(got, name), getattr(ref, name), atol=1e-5), (name, side)


def test_same_call_runs_on_bridge_and_every_hooked_ssm(tmp_path):
    from transformer_lens.model_bridge import TransformerBridge

    tok = word_tokenizer([" ".join(TOY_WORDS)])
    models = {}
    for arch in ("mamba1", "mamba2", "bamba"):
        m = tiny_hooked_ssm(arch, seed=3, vocab_size=len(tok))
        m.tokenizer = tok
        models[arch] = m
    path = tiny_checkpoint("llama", tmp_path / "llama", vocab_size=len(tok))
    tok.save_pretrained(path)
    models["llama"] = TransformerBridge.boot_transformers(str(path))
    task = _word_task(tok, n_samples=4)
    expected_kinds = {
        "mamba1": {"ssm"},
        "mamba2": {"ssm"},
        "bamba": {"ssm", "attention"},
        "llama": {"attention"},
    }
    for arch, model in models.items():
        report = score_heads(model, task, control=None, progress=False)
        df = report.to_dataframe()
        assert set(df["kind"]) == expected_kinds[arch], arch
        n_heads = sum(report.layer_heads)
        assert len(df) == n_heads
        assert not df[["gather_share", "aggregate_score", "ablation_effect"]].isna().any().any()
        assert ((df["gather_share"] >= 0) & (df["gather_share"] <= 1 + 1e-6)).all()
        assert report.heatmap("gather_score").shape == (report.n_layers, max(report.layer_heads))
        if arch == "bamba":
            attn = df[df["kind"] == "attention"]
            assert set(attn["layer"]) == {1} and len(attn) == model.cfg.n_attn_heads


def test_report_exports_json_and_offline_html(toy):
    model, task = toy
    report = score_heads(model, task, control=toy_control(model), progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = report.to_html(Path(tmp) / "report.html")
        text = path.read_text()
        js = report.to_json(Path(tmp) / "report.json")
    assert "<svg class='heatmap'" in text
    assert "Method" in text and "Left out as generic" in text
    assert "CircuitsVis" in text  # the widget's script is embedded
    assert "unpkg.com" not in text and "cdn.jsdelivr" not in text
    assert '"gather_score"' in js
    with pytest.raises(GnaLensError, match="or one of"):
        report.top(3, by="nonsense")
    no_ablation = score_heads(model, task, ablation=False, progress=False)
    with pytest.raises(GnaLensError, match="not computed"):
        no_ablation.top(3, by="ablation_effect")


def test_patching_the_aggregate_head_from_a_requeried_run_moves_the_answer(toy):
    from gna_lens.interventions import patch_heads
    from gna_lens.tasks import requery

    model, task = toy
    corrupted = requery(task, seed=3)
    assert all(
        c.info["keys"] == k.info["keys"] and c.info["query_key"] != k.info["query_key"]
        for c, k in zip(corrupted, task, strict=True)
    )
    result = patch_heads(model, task, corrupted, metric="accuracy", progress=False)
    df = result.to_dataframe().set_index(["layer", "head"])
    # Only the aggregate head's output carries the queried value: patching it restores the clean
    # answer everywhere; the gather head reads the (unchanged) dictionary, so patching it does not.
    assert df.loc[TOY_AGGREGATE_HEAD, "value"] == 1.0
    assert df.loc[TOY_GATHER_HEAD, "value"] == 0.0


def test_random_sets_are_distinct_layer_matched_or_say_how_they_were_matched():
    from gna_lens.heads import head_view
    from gna_lens.scoring import matched_random_sets

    view = head_view(tiny_hooked_ssm("mamba2"))  # 2 layers x 8 heads
    drawn = matched_random_sets(view, [(0, 1), (1, 2), (1, 5)], 40, seed=3)
    assert drawn.matching == "layer" and drawn.n_possible == 7 * 15
    assert len(set(drawn.sets)) == 40
    assert all(sorted(layer for layer, _ in s) == [0, 1, 1] for s in drawn.sets)
    assert all(not {(0, 1), (1, 2), (1, 5)} & set(s) for s in drawn.sets)
    assert drawn.sets == matched_random_sets(view, [(0, 1), (1, 2), (1, 5)], 40, seed=3).sets
    # 7 of layer 1's heads removed: one set is left there, so 10 draws match on kind only.
    seven = [(1, h) for h in range(7)]
    kind = matched_random_sets(view, seven, 10)
    assert kind.matching == "kind" and len(set(kind.sets)) == 10 and "any layer" in kind.describe()
    with pytest.raises(GnaLensError, match=r"too few heads to draw.*random_draws=0"):
        matched_random_sets(view, [(la, h) for la in range(2) for h in range(8)], 1)


def test_a_head_in_both_roles_keeps_the_intersection_and_denies_the_union(toy):
    """Issue 30: a head that is both a gather and an aggregate candidate. Each role's keep mask is
    all-True outside its own rows, so their union kept everything (and "kept" measured nothing)."""
    from gna_lens.interventions.masks import aggregate_mask, gather_mask
    from gna_lens.scoring import gna_masks

    _, task = toy
    batch = next(iter(task.batches(4, padding_side="left")))
    head = (1, 0)
    g, a = gather_mask(batch), aggregate_mask(batch)
    kept = gna_masks([head], [head])(batch)[head]
    assert torch.equal(kept, g & a)
    assert not kept.all(dim=(-1, -2)).any(), "a mask that keeps everything masks nothing"
    denied = gna_masks([head], [head], complement=True)(batch)[head]
    gc, ac = gather_mask(batch, complement=True), aggregate_mask(batch, complement=True)
    assert torch.equal(~denied, ~gc | ~ac)
    # Alone, each role's mask is what the role keeps.
    assert torch.equal(gna_masks([head], [])(batch)[head], g)
    assert torch.equal(gna_masks([], [head])(batch)[head], a)


def test_pair_candidates_put_every_gather_below_an_aggregate():
    """Issue 39: a gather must sit before the aggregate it feeds. With the scores swapped (the
    best aggregate score on layer 0, the best gather score on layer 1), the old pick returned
    aggregates in L0 and gathers in L1 (zoo-mamba2's masks did so); now no pair inverts."""
    from gna_lens.scoring import pair_candidates

    model = toy_gna_model()
    report = score_heads(model, toy_gna_task(model), control=toy_control(model), progress=False)
    gathers, aggregates = pair_candidates(report, 2)
    assert gathers == [TOY_GATHER_HEAD] and aggregates == [TOY_AGGREGATE_HEAD]
    sc = report.scores
    swapped = sc["gather_score"].clone(), sc["aggregate_score"].clone()
    sc["gather_score"], sc["aggregate_score"] = swapped[1] * 10, swapped[0] * 10
    sc["gather_null"], sc["aggregate_null"] = sc["aggregate_null"] * 0, sc["gather_null"] * 0
    gathers, aggregates = pair_candidates(report, 2)
    assert all(g[0] < max(a[0] for a in aggregates) for g in gathers), (gathers, aggregates)
    assert all(a[0] > min(g[0] for g in gathers) for a in aggregates), (gathers, aggregates)
