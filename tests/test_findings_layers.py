"""The findings' layer experiments: layer pruning (gradual and individual) and KV accuracy
against dictionary size, on the toy model of known circuit and a shipped zoo model, and their
SVG figures."""

import json
import xml.etree.ElementTree as ET

import pytest

from gna_lens.errors import ConfigError, InterventionError, TaskError
from gna_lens.findings.layers import dictionary_size_curves, layer_pruning, zoo_kv_tasks
from gna_lens.render.figures import dictionary_figure, line_chart, pruning_figure
from gna_lens.tasks import evaluate
from gna_lens.testing import (
    TOY_AGGREGATE_HEAD,
    TOY_GATHER_HEAD,
    toy_control,
    toy_gna_model,
    toy_gna_task,
)

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def toy():
    return toy_gna_model()


@pytest.fixture(scope="module")
def toy_pruning(toy):
    task = toy_gna_task(toy, n_samples=16)
    return task, layer_pruning(toy, task, toy_control(toy))


@pytest.fixture(scope="module")
def toy_curves(toy):
    return dictionary_size_curves(
        toy, [TOY_AGGREGATE_HEAD], sizes=(2, 3, 4),
        tasks=lambda n: toy_gna_task(toy, n_pairs=n, n_samples=16), random_draws=3,
    )  # fmt: skip


def test_pruning_nothing_removed_is_the_models_own_accuracy(toy, toy_pruning):
    task, res = toy_pruning
    first = res["gradual"][0]
    assert first["removed"] == 0 and first["layers"] == []
    assert first["accuracy"]["value"] == pytest.approx(evaluate(toy, task).accuracy)
    assert res["baseline"]["value"] == 1.0 and res["n"] == 16
    json.dumps(res)  # JSON-ready: no tensors, no NaN objects


def test_removing_the_aggregate_layer_drops_retrieval_to_chance_not_the_control(toy_pruning):
    _, res = toy_pruning
    by_layer = {p["layer"]: p for p in res["individual"]}
    agg = by_layer[TOY_AGGREGATE_HEAD[0]]
    assert agg["accuracy"]["value"] <= res["chance"]
    assert agg["change"]["high"] < 0  # the drop's interval excludes 0
    # The toy's control (cyclic word chains) uses neither G&A head: removal leaves it alone.
    assert agg["control_change"]["value"] == pytest.approx(0.0, abs=1e-6)
    assert TOY_AGGREGATE_HEAD[0] in res["summary"]["individual_at_chance"]
    # Gradual from the end: removing the last layer (the Aggregate head's) is the first step.
    assert res["gradual"][1]["layers"] == [TOY_AGGREGATE_HEAD[0]]
    assert res["summary"]["first_gradual_at_chance"] == 1


def test_pruning_points_map_to_the_layers_they_remove_on_a_trained_model():
    """zoo-mamba2 retrieves on KV-8 through its first layer: removing layer 0 alone (or every
    layer) sends it to chance, removing layers 1-3 (alone or together) does not. A mix-up of
    cells and rows, or of the order, fails this."""
    from gna_lens import zoo

    model = zoo.load("zoo-mamba2")
    task = zoo_kv_tasks("zoo-mamba2")[8][:40]
    res = layer_pruning(model, task, zoo.control("zoo-mamba2", "eval")[:30])
    acc = {p["layer"]: p["accuracy"]["value"] for p in res["individual"]}
    base = res["baseline"]["value"]
    assert base > 0.8
    assert acc[0] < 0.35 and acc[2] > base - 0.1
    grad = {p["removed"]: p for p in res["gradual"]}
    assert grad[3]["layers"] == [1, 2, 3] and grad[3]["accuracy"]["value"] > base - 0.15
    assert grad[4]["accuracy"]["value"] < 0.35
    assert res["summary"]["first_gradual_at_chance"] == 4
    assert res["control_unit"] == "nats/answer"
    # Removing the last three layers keeps retrieval but costs the cloze answers (knowledge).
    assert grad[3]["control_change"]["low"] > 0
    start = layer_pruning(model, task, None, order="from_start", steps=[1], individual=())
    assert start["gradual"][1]["layers"] == [0] and start["individual"] == []
    assert start["gradual"][1]["accuracy"]["value"] == pytest.approx(acc[0])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"steps": [3]}, r"steps contains 3; .*ints in 1\.\.2"),
        ({"steps": []}, r"steps=\[\] is empty"),
        ({"individual": [5]}, r"individual contains 5"),
        ({"order": "middle"}, r"order='middle'"),
    ],
)
def test_pruning_bad_input_names_it(toy, kw, match):
    with pytest.raises(InterventionError, match=match):
        layer_pruning(toy, toy_gna_task(toy, n_samples=2), None, **kw)


def test_dictionary_curves_removing_the_aggregate_head_hurts_at_every_size(toy_curves):
    res = toy_curves
    assert res["sizes"] == [2, 3, 4] and res["missing"] == []
    assert [p["n_pairs"] for p in res["points"]] == [2, 3, 4]
    for p in res["points"]:
        assert p["chance"] == pytest.approx(1 / p["n_pairs"])
        assert p["before"]["value"] == 1.0
        assert p["after"]["value"] < p["before"]["value"] and p["change"]["high"] < 0
        assert p["random_after"] is not None and p["n"] == 16
    assert res["heads"] == ["L1H0"] and len(res["random_sets"]) == 3
    # The Gather head is the only other head that matters; a random set drawing it hurts too,
    # but the sets are the ones retrieval_vs_knowledge drew: distinct, never the removed head.
    assert all("L1H0" not in s for s in res["random_sets"])
    assert len({tuple(s) for s in res["random_sets"]}) == 3
    json.dumps(res)


def test_dictionary_curves_excluded_heads_stay_out_of_random_sets(toy):
    res = dictionary_size_curves(
        toy, [TOY_AGGREGATE_HEAD], sizes=(2,), exclude=[TOY_GATHER_HEAD],
        tasks=lambda n: toy_gna_task(toy, n_pairs=n, n_samples=8), random_draws=2,
    )  # fmt: skip
    assert all("L0H0" not in s for s in res["random_sets"])
    # Without the Gather head in any random set, random removals leave retrieval intact.
    assert res["points"][0]["random_after"]["value"] == 1.0


def test_dictionary_size_beyond_the_vocabulary_is_named_or_listed(toy):
    def build(n):
        return toy_gna_task(toy, n_pairs=n, n_samples=4)

    # The toy's 12 words give at most 6 pairs with word values (keys and values distinct).
    with pytest.raises(TaskError, match=r"sizes contains 8.*missing='skip'"):
        dictionary_size_curves(toy, [TOY_AGGREGATE_HEAD], sizes=(2, 8), tasks=build,
                               random_draws=0)  # fmt: skip
    res = dictionary_size_curves(
        toy, [TOY_AGGREGATE_HEAD], sizes=(2, 8), tasks=build, random_draws=0, missing="skip"
    )
    assert res["sizes"] == [2] and res["requested_sizes"] == [2, 8]
    assert res["missing"][0]["n_pairs"] == 8 and "n_pairs=8" in res["missing"][0]["reason"]
    assert res["points"][0]["random_after"] is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"sizes": ()}, r"sizes=\(\) is empty"),
        ({"sizes": (2, 0)}, r"sizes contains 0"),
        ({"sizes": 4}, r"sizes=4"),
        ({"sizes": (4,), "tasks": {}}, r"sizes contains 4.*no split with 4 pairs"),
        ({"sizes": (2,), "missing": "drop"}, r"missing='drop'"),
    ],
)
def test_dictionary_bad_input_names_it(toy, kw, match):
    with pytest.raises(TaskError, match=match):
        dictionary_size_curves(toy, [TOY_AGGREGATE_HEAD], random_draws=0, **kw)


def test_dictionary_task_keyed_by_the_wrong_size_is_refused(toy):
    with pytest.raises(TaskError, match=r"given for 4 pairs has n_pairs=2"):
        dictionary_size_curves(
            toy, [TOY_AGGREGATE_HEAD], sizes=(4,), tasks={4: toy_gna_task(toy, n_pairs=2)},
            random_draws=0,
        )  # fmt: skip


# ----------------------------------------------------------------------------- figures
def _parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == SVG + "svg"
    return root


def test_pruning_figure_is_valid_svg_with_one_path_per_series(toy_pruning):
    _, res = toy_pruning
    svg = pruning_figure(res)
    root = _parse(svg)
    paths = root.findall(f"{SVG}path")
    assert len(paths) == 4  # (accuracy, control) x (gradual, individual)
    assert len(root.findall(f"{SVG}polygon")) == 4  # one band each
    assert svg == pruning_figure(json.loads(json.dumps(res)))  # deterministic, JSON round trip
    no_control = dict(res, gradual=[dict(p, control_change=None) for p in res["gradual"]],
                      individual=[dict(p, control_change=None) for p in res["individual"]])  # fmt: skip
    assert len(_parse(pruning_figure(no_control)).findall(f"{SVG}path")) == 2


def test_dictionary_figure_is_valid_svg_with_one_path_per_arm(toy_curves):
    svg = dictionary_figure(toy_curves)
    root = _parse(svg)
    assert len(root.findall(f"{SVG}path")) == 3
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "top 1 heads removed" in texts and "chance" in texts
    chance = [p for p in root.findall(f"{SVG}polyline") if p.get("class") == "reference"]
    assert len(chance) == 1 and len(chance[0].get("points").split()) == 3  # 1/n at each size


def test_line_chart_breaks_lines_at_missing_values_and_escapes_text():
    svg = line_chart(
        [{"name": "a<b & c", "x": [1, 2, 3, 4], "y": [0.1, None, 0.3, 0.4]}],
        "x", "y", title="t & <u>",
    )  # fmt: skip
    root = _parse(svg)
    (path,) = root.findall(f"{SVG}path")
    assert path.get("d").count("M") == 2  # two runs: [1], [3, 4]
    assert "a<b & c" in [t.text for t in root.iter(f"{SVG}text")]


def test_line_chart_bad_series_names_it():
    with pytest.raises(ConfigError, match=r"series 'a' has 2 x values but 3 'y' values"):
        line_chart([{"name": "a", "x": [1, 2], "y": [1, 2, 3]}], "x", "y")
    with pytest.raises(ConfigError, match="expected a list of dicts"):
        line_chart({"x": [1], "y": [1]}, "x", "y")  # type: ignore[arg-type]


def test_findings_run_resumes_finished_experiments_from_its_checkpoint(tmp_path, monkeypatch):
    import gna_lens.findings as findings

    def must_not_run(**kwargs):
        raise AssertionError("finding 3 was rerun although the checkpoint holds it")

    calls = []

    def hybrid_roles(**kwargs):
        calls.append("5")
        return {"measured": True}

    monkeypatch.setattr(findings, "pattern_masks", must_not_run)
    monkeypatch.setattr(findings, "hybrid_roles", hybrid_roles)
    checkpoint = tmp_path / "findings.json.partial"
    checkpoint.write_text(json.dumps({"3": {"from": "before"}, "seconds": {"3": 12.5}}))
    results = findings.run_all(progress=False, only=["3", "5"], checkpoint=checkpoint)
    assert results["3"] == {"from": "before"} and results["seconds"]["3"] == 12.5
    assert results["resumed"] == ["3"] and calls == ["5"]
    # the new experiment is in the checkpoint at once: a second interruption loses nothing
    saved = json.loads(checkpoint.read_text())
    assert saved["5"] == {"measured": True} and saved["3"] == {"from": "before"}


def _comp(data, task, low, value=0.1):
    iv = {"value": value, "low": low, "high": value + 0.1, "n": 64, "method": "bootstrap"}
    return {"k": 8, "task": task, "data": data, "seeds": [0], "n_random": 3,
            "paired_random_mean": iv, "paired_random": iv}  # fmt: skip


@pytest.mark.parametrize(
    ("lows", "pending", "status"),
    [
        ((0.05, 0.05), [], "reproduced"),  # every task above the random students, nothing left
        ((0.05, 0.05), ["top-8 seed=1"], "partly"),  # the plan is not finished
        ((0.05, -0.02), [], "partly"),  # above on one dictionary size only
        ((-0.01, -0.02), [], "not reproduced"),  # the no-KV arm shows nothing
    ],
)
def test_the_hybrid_claim_follows_the_controlled_run(lows, pending, status):
    from gna_lens.findings.status import _students_status

    first = {"comparisons": [_comp("default", "kv-4", 0.4) | {"k": 8}]}
    ctl = {
        "comparisons": [
            _comp("no-kv", t, low) for t, low in zip(("kv-4", "kv-8"), lows, strict=True)
        ],
        "method": {"pending": pending},
    }
    got, why = _students_status(first, ctl)
    assert got == status, why
    assert "no-kv data (seed 0; 3 layer-matched random-8)" in why
    assert "first run" in why  # the default arm comes from the first run until rerun
    assert ("not distilled yet" in why) == bool(pending)
    # without the controlled run, the first run alone grants partly at most
    assert _students_status(first, None)[0] == "partly"


def test_the_hybrid_claim_needs_the_students_knowledge_kept():
    from gna_lens.findings.status import _students_status

    def acc(v, lo, hi):
        return {"value": v, "low": lo, "high": hi, "n": 100, "method": "wilson"}

    ctl = {
        "comparisons": [_comp("no-kv", "kv-4", 0.05)],
        "method": {"pending": []},
        "rows": [
            {"name": "teacher", "kind": "teacher", "knowledge": acc(0.5, 0.4, 0.6)},
            {"name": "top-8 data=no-kv", "kind": "top", "knowledge": acc(0.25, 0.17, 0.34)},
        ],
    }
    got, why = _students_status(None, ctl)
    assert got == "partly" and "not kept" in why
    ctl["rows"][1]["knowledge"] = acc(0.45, 0.35, 0.55)
    assert _students_status(None, ctl)[0] == "reproduced"
    # a student at chance overlaps a weak teacher's interval but keeps nothing (SmolLM2's
    # students: 26-31% against the teacher's 36.0% [27.3, 45.8], chance 25%)
    ctl |= {"chance": {"MMLU cloze": 0.25}, "knowledge_task": "MMLU cloze"}
    ctl["rows"][0]["knowledge"] = acc(0.36, 0.273, 0.458)
    ctl["rows"][1]["knowledge"] = acc(0.31, 0.228, 0.406)
    got, why = _students_status(None, ctl)
    assert got == "partly" and "reaches chance 25%: not kept" in why
