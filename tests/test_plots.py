"""gna_lens.plots: figures carry the report's numbers at the right cells; PNG export works."""

import math

import pandas as pd
import pytest
import torch

from gna_lens import score_heads
from gna_lens.errors import GnaLensError
from gna_lens.plots import (
    accuracy_vs_dictionary_size,
    find_browser,
    head_heatmap,
    save_png,
    sharpness_comparison,
)
from gna_lens.scoring import GnaReport
from gna_lens.scoring.report import COLUMNS
from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task


@pytest.fixture(scope="module")
def report():
    model = toy_gna_model()
    return score_heads(
        model, toy_gna_task(model, n_samples=8), control=toy_control(model), progress=False
    )


def ragged_report() -> GnaReport:
    """3 layers: 3 heads, none (e.g. an MLP-only layer), 2 heads; distinct values per head."""
    heads = ((0, 0), (0, 1), (0, 2), (2, 0), (2, 1))
    scores = {name: torch.arange(len(heads), dtype=torch.float32) + i for i, name in
              enumerate(COLUMNS[3:])}  # fmt: skip
    scores["ablation_effect"] = torch.tensor([-1.0, 0.5, math.nan, -3.0, 0.25])
    return GnaReport(
        model_name="ragged",
        task="t",
        heads=heads,
        kinds=("attention",) * 3 + ("ssm",) * 2,
        scores=scores,
        metric="logit_diff",
        baseline=1.0,
        n_layers=3,
        layer_heads=(3, 0, 2),
    )


@pytest.mark.parametrize("value", ["ablation_effect", "gather_score", "aggregate", "sharpness"])
def test_heatmap_cells_hold_the_reports_value_at_layer_head(report, value):
    fig = head_heatmap(report, value)
    column = {"aggregate": "aggregate_score"}.get(value, value)
    z = fig.data[0].z
    assert len(z) == report.n_layers and len(z[0]) == max(report.layer_heads)
    for (layer, head), v in zip(report.heads, report.scores[column].tolist(), strict=True):
        assert z[layer][head] == pytest.approx(v)


def test_heatmap_of_a_ragged_report_leaves_missing_heads_empty():
    rep = ragged_report()
    fig = head_heatmap(rep, "ablation_effect")
    z = [list(row) for row in fig.data[0].z]
    assert z == [[-1.0, 0.5, None], [None, None, None], [-3.0, 0.25, None]]
    assert fig.data[0].zmid == 0  # effects: diverging scale centred on no change
    same = head_heatmap(rep.to_dataframe(), "ablation_effect")
    assert [list(row) for row in same.data[0].z] == z
    with pytest.raises(GnaLensError, match=r"value='gathr'.*gather_score"):
        head_heatmap(rep, "gathr")
    with pytest.raises(GnaLensError, match="got list"):
        head_heatmap([1, 2], "gather")


def test_sharpness_comparison_shows_the_top_heads_of_each_model(report):
    rep = ragged_report()
    fig = sharpness_comparison({"toy": report, "ragged": rep}, top=3)
    assert [t.name for t in fig.data] == ["toy", "ragged"]
    for trace, r in zip(fig.data, (report, rep), strict=True):
        top = r.top(len(r.heads))[:3]  # the first 3 that qualify (the ragged report has fewer)
        assert list(trace.text) == [f"L{la}H{h}" for la, h in top]
        expected = [float(r.scores["sharpness"][r.heads.index(h)]) for h in top]
        assert list(trace.y) == pytest.approx(expected)
    by_gather = sharpness_comparison({"toy": report}, top=1, by="gather_score")
    assert list(by_gather.data[0].text) == ["L0H0"]
    with pytest.raises(GnaLensError, match=r"reports\['x'\] is dict"):
        sharpness_comparison({"x": {}})


def test_accuracy_vs_dictionary_size_from_dict_or_frame():
    results = {"a": {16: 0.5, 4: 1.0}, "b": {4: 0.9, 16: 0.2, 64: 0.1}}
    frame = pd.DataFrame(
        [(m, n, acc) for m, by_n in results.items() for n, acc in by_n.items()],
        columns=["model", "n_pairs", "accuracy"],
    )
    for fig in (accuracy_vs_dictionary_size(results), accuracy_vs_dictionary_size(frame)):
        a, b, chance = fig.data
        assert (list(a.x), list(a.y)) == ([4, 16], [1.0, 0.5])  # sorted by size
        assert list(b.y) == [0.9, 0.2, 0.1]
        assert (chance.name, list(chance.x)) == ("chance", [4, 16, 64])
        assert list(chance.y) == pytest.approx([0.25, 1 / 16, 1 / 64])
    custom = accuracy_vs_dictionary_size(results, chance={4: 0.3, 16: 0.2, 64: 0.1})
    assert list(custom.data[-1].y) == [0.3, 0.2, 0.1]
    assert len(accuracy_vs_dictionary_size(results, chance=None).data) == 2
    with pytest.raises(GnaLensError, match=r"lacks column\(s\) \['accuracy'\]"):
        accuracy_vs_dictionary_size(frame.drop(columns="accuracy"))
    with pytest.raises(GnaLensError, match=r"no value for n_pairs \[64\]"):
        accuracy_vs_dictionary_size(results, chance={4: 0.3, 16: 0.2})


def test_save_png_names_the_missing_browser(tmp_path):
    fig = head_heatmap(ragged_report(), "gather")
    with pytest.raises(GnaLensError, match=r"browser='/nonexistent/chrome'.*apt-get install"):
        save_png(fig, tmp_path / "x.png", browser="/nonexistent/chrome")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.skipif(
    find_browser() is None, reason="no Chrome/Chromium for kaleido (apt-get install chromium)"
)
def test_save_png_writes_a_png_of_the_requested_size(report, tmp_path):
    path = save_png(
        head_heatmap(report, "gather"), tmp_path / "docs" / "h.png", width=320, height=200, scale=2
    )
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (640, 400)
    assert len(data) > 2000  # a drawn figure, not an empty image
