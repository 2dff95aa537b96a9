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
from gna_lens.tasks._testing import word_tokenizer
from gna_lens.testing import (
    TOY_AGGREGATE_HEAD,
    TOY_GATHER_HEAD,
    TOY_WORDS,
    tiny_checkpoint,
    tiny_hooked_ssm,
    toy_gna_model,
    toy_gna_task,
)


@pytest.fixture(scope="module")
def toy():
    model = toy_gna_model()
    return model, toy_gna_task(model, n_pairs=4, n_samples=12, seed=1)


def test_scores_and_ranking_find_the_known_heads(toy):
    model, task = toy
    report = score_heads(model, task, progress=False)
    df = report.to_dataframe()
    assert list(df.columns[:10]) == [
        "layer", "head", "kind", "gather_score", "aggregate_score", "correct_share",
        "sharpness", "entropy", "ablation_effect", "attribution",
    ]  # fmt: skip
    assert report.top(1, by="gather_score") == [TOY_GATHER_HEAD]
    assert report.top(1, by="correct_share") == [TOY_AGGREGATE_HEAD]
    assert report.top(1, by="aggregate_score") == [TOY_AGGREGATE_HEAD]
    assert set(report.top(2)) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    row = df.set_index(["layer", "head"])
    assert row.loc[TOY_GATHER_HEAD, "gather_score"] > 0.99
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
    report = score_heads(model, task, prefilter=2, progress=False)
    effects = report.scores["ablation_effect"]
    measured = {h for h, e in zip(report.heads, effects.tolist(), strict=True) if not math.isnan(e)}
    assert measured == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    assert set(report.top(2)) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}


def test_pair_finding_confirms_the_known_pair(toy):
    model, task = toy
    pairs = find_gna_pairs(model, task, progress=False)
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
    table = retrieval_vs_knowledge(model, [TOY_AGGREGATE_HEAD], {"kv-4": task}, progress=False)
    df = table.to_dataframe()
    assert df.loc[0, "before"] == 1.0
    assert df.loc[0, "after"] <= 0.5
    assert df.loc[0, "relative_change"] == pytest.approx(df.loc[0, "after"] - 1.0)
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
        for name in ("gather_score", "aggregate_score", "correct_share", "sharpness", "entropy"):
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
        report = score_heads(model, task, progress=False)
        df = report.to_dataframe()
        assert set(df["kind"]) == expected_kinds[arch], arch
        n_heads = sum(report.layer_heads)
        assert len(df) == n_heads
        assert not df[["gather_score", "aggregate_score", "ablation_effect"]].isna().any().any()
        assert ((df["gather_score"] >= 0) & (df["gather_score"] <= 1 + 1e-6)).all()
        assert report.heatmap("gather_score").shape == (report.n_layers, max(report.layer_heads))
        if arch == "bamba":
            attn = df[df["kind"] == "attention"]
            assert set(attn["layer"]) == {1} and len(attn) == model.cfg.n_attn_heads


def test_report_exports_json_and_offline_html(toy):
    model, task = toy
    report = score_heads(model, task, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = report.to_html(Path(tmp) / "report.html")
        text = path.read_text()
        js = report.to_json(Path(tmp) / "report.json")
    assert "<svg class='heatmap'" in text
    assert "CircuitsVis" in text  # the widget's script is embedded
    assert "unpkg.com" not in text and "cdn.jsdelivr" not in text
    assert '"gather_score"' in js
    with pytest.raises(GnaLensError, match="expected one of"):
        report.top(3, by="nonsense")
    no_ablation = score_heads(model, task, ablation=False, progress=False)
    with pytest.raises(GnaLensError, match="not computed"):
        no_ablation.top(3)


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
