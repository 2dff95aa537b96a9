"""One result type for every sweep: head ablation, control, layer, patching (here and on Ray).

Each sweep's result is a CellResult with the same numeric columns, intervals that contain their
effects, a ranking in the direction that kind of cell matters, and a JSON round trip.
"""

import json

import pytest
import torch
from interventions_helpers import model, other_key, task

from gna_lens.interventions import (
    ablation_sweep,
    control_sweep,
    layer_sweep,
    patch_heads,
    patch_residual,
    prune_from_end,
)
from gna_lens.interventions.result import CellResult
from gna_lens.tasks import text_control

COMMON = [
    "kind", "effect", "effect_low", "effect_high", "value", "value_low", "value_high",
    "baseline", "control_effect", "control_low", "control_high", "selectivity", "metric", "task",
]  # fmt: skip


@pytest.fixture(scope="module")
def results():
    m = model("mamba2")
    t = task(n_samples=6)
    control = text_control(m.tokenizer, n_sequences=4, seq_len=12, max_unknown=1.0)
    corrupted = other_key(t)
    kw = dict(progress=False)
    return {
        "ablation": ablation_sweep(m, t, "logit_diff", [(0, 0), (1, 3), [(0, 1), (1, 2)]], **kw),
        "control": control_sweep(m, control, [(0, 0), (1, 3)], **kw),
        "layers": layer_sweep(m, t, "logit_diff", control=control, **kw),
        "pruning": prune_from_end(m, t, "accuracy", control=None, **kw),
        "patch_heads": patch_heads(m, t, corrupted, "logit_diff", heads=[(0, 0), (1, 3)], **kw),
        "patch_resid": patch_residual(m, t, corrupted, "logit_diff", positions=None, **kw),
    }


def test_every_sweep_returns_the_one_result_type_with_the_same_columns(results):
    for name, res in results.items():
        assert isinstance(res, CellResult), name
        df = res.to_dataframe()
        assert [c for c in COMMON if c not in df.columns] == [], name
        assert len(df) == len(res) == len(res.cells) == len(res.kinds), name
        torch.testing.assert_close(
            torch.tensor(df["effect"].tolist()), res.effects.double(), check_dtype=False
        )


def test_intervals_contain_their_effects_and_have_width(results):
    for name, res in results.items():
        for e, iv in zip(res.effects.tolist(), res.effect_intervals(), strict=True):
            assert iv.low - 1e-6 <= e <= iv.high + 1e-6, (name, e, iv)
            assert iv.n == res.values.shape[1], name
        # the values of a cell vary over prompts, so some interval has width
        assert any(iv.high > iv.low for iv in res.effect_intervals()), name
    layers = results["layers"]
    assert layers.has_control and not results["ablation"].has_control
    for e, iv in zip(layers.control_effects.tolist(), layers.control_intervals(), strict=True):
        assert iv.low - 1e-6 <= e <= iv.high + 1e-6
    pruning = results["pruning"]
    assert all(iv.method == "wilson" for iv in pruning.value_intervals())


def test_ranking_puts_what_matters_first_in_each_kind(results):
    abl = results["ablation"]
    assert abl.ranking(1)[0] == abl.cells[int(abl.effects.argmin())]  # the most harmful
    patch = results["patch_heads"]
    assert patch.ranking(1)[0] == patch.cells[int(patch.effects.argmax())]  # the most restoring
    resid = results["patch_resid"]
    # patching every position of the residual entering layer 0 restores the clean run exactly
    assert resid.ranking(1)[0] == (0,)
    torch.testing.assert_close(resid.values[0], resid.clean_baseline)


def test_to_dict_round_trips_through_json_for_every_kind(results):
    for name, res in results.items():
        back = CellResult.from_dict(json.loads(json.dumps(res.to_dict())))
        assert type(back) is type(res), name
        assert back.cells == res.cells and back.kinds == res.kinds, name
        torch.testing.assert_close(back.values, res.values.float(), equal_nan=True)
        torch.testing.assert_close(back.baseline, res.baseline.float(), equal_nan=True)
        assert back.metric == res.metric and back.task == res.task, name
        assert back.ranking() == res.ranking(), name
        assert (
            back.to_dataframe()
            .drop(columns=["layer", "head"], errors="ignore")
            .equals(res.to_dataframe().drop(columns=["layer", "head"], errors="ignore"))
        ), name
    with pytest.raises(Exception, match="from_dict: type 'Nope'"):
        CellResult.from_dict({"type": "Nope"})


def test_every_result_plots_its_effects_with_error_bars(results):
    pytest.importorskip("plotly")
    for name, res in results.items():
        fig = res.plot()
        bars = fig.data[0].error_y
        assert len(fig.data[0].y) == len(res), name
        assert bars.array is not None and len(bars.array) == len(res), name
    assert len(results["layers"].plot().data) == 2  # the control on the right axis
