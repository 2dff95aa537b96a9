"""The HTML report opens in headless Chromium with no network: heatmaps and widgets render.

Runs ``benchmarks/check_report.py``'s check; skipped where no Chromium is installed
(Debian: ``apt-get install -y chromium``).
"""

import pytest
from bench_helpers import load_benchmark

from gna_lens import score_heads
from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task

check = load_benchmark("check_report.py")

pytestmark = pytest.mark.skipif(
    check.find_chromium() is None,
    reason="no chromium on PATH (apt-get install -y chromium); the offline-report check needs it",
)


def test_report_renders_offline_with_heatmaps_widgets_and_plotly(tmp_path):
    model = toy_gna_model()
    report = score_heads(
        model, toy_gna_task(model, n_samples=8), control=toy_control(model), progress=False
    )
    path = report.to_html(tmp_path / "report.html", k=4, interactive=True)
    result = check.check_report(path, screenshot=tmp_path / "shot.png", window=(800, 600))
    # one SVG per measured column, one coloured cell per head with a finite value
    # (specificity is NaN where a head moves neither the task nor the control)
    columns = (
        "ablation_effect",
        "control_effect",
        "specificity",
        "gather_score",
        "aggregate_score",
        "correct_share",
        "sharpness",
    )
    assert result.heatmaps == [int(report.scores[c].isfinite().sum()) for c in columns]
    assert result.heatmaps[0] == 4 and result.heatmaps[1] == 4
    (widget,) = result.widgets.values()
    assert set(widget["titles"]) == {f"L{la}H{h}" for la, h in report.top(4)}
    assert widget["canvas"] >= 4  # one thumbnail per head, drawn by the widget's script
    assert len(result.plotly) == 4 and all(result.plotly.values())
    png = (tmp_path / "shot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (800, 600)


def test_check_fails_on_a_widget_whose_script_never_runs_or_a_cdn_page(tmp_path):
    svg = "<svg class='heatmap'><rect fill='rgb(1,2,3)'/></svg>"
    dead = tmp_path / "dead.html"
    dead.write_text(f"<html><body>{svg}<div id='circuits-vis-x'></div></body></html>")
    with pytest.raises(check.ReportCheckError, match="circuits-vis-x did not render"):
        check.check_report(dead)
    cdn = tmp_path / "cdn.html"
    cdn.write_text(
        f"<html><body>{svg}<script src='https://unpkg.com/circuitsvis'></script></body></html>"
    )
    with pytest.raises(check.ReportCheckError, match="external resources"):
        check.check_report(cdn)
