"""Set-level specificity (issue 30): heads that each pass the control bound alone can break the
control together; the default ranking is a greedy joint set whose removal together is bounded,
and rank_stability says how stable the per-head ranking is."""

import json
import math

import pytest
import torch

from gna_lens.errors import GnaLensError, InterventionError
from gna_lens.interventions import control_sweep
from gna_lens.scoring import GnaReport, JointSet, rank_stability, score_heads
from gna_lens.scoring.report import SCORE_COLUMNS
from gna_lens.stats import bootstrap_interval
from gna_lens.testing import (
    TOY_AGGREGATE_HEAD,
    TOY_GATHER_HEAD,
    TOY_GENERIC_HEAD,
    toy_control,
    toy_gna_model,
    toy_gna_task,
)

HALVES = ((0, 1), TOY_GENERIC_HEAD)  # the generic head split in two


def split_generic_model():
    """The toy with its generic head (0, 2) split over two heads, (0, 1) and (0, 2), each with
    half its output: either half alone still carries the control (the next word keeps most of
    its logit), the two together are the generic head, whose removal breaks it."""
    model = toy_gna_model(generic_head=True)
    attn = model.blocks[0].attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(attn, name).weight
            w[32:64] = w[64:96]
        attn.o_proj.weight[:, 64:96] *= 0.5
        attn.o_proj.weight[:, 32:64] = attn.o_proj.weight[:, 64:96]
    return model


@pytest.fixture(scope="module")
def split():
    model = split_generic_model()
    task, control = toy_gna_task(model, n_samples=8, seed=1), toy_control(model)
    report = score_heads(model, task, control=control, progress=False, n_examples=0)
    return model, task, control, report


@pytest.fixture(scope="module")
def generic():
    model = toy_gna_model(generic_head=True)
    task = toy_gna_task(model, n_samples=8, seed=1)
    return model, score_heads(model, task, control=toy_control(model), progress=False)


def _joint_mean(model, control, heads):
    res = control_sweep(model, control, [list(heads)], progress=False)
    return res.values.double() - res.baseline.double()[None]


def test_heads_that_pass_alone_but_not_together_stay_out_of_the_joint_top(split):
    model, _, control, report = split
    df = report.to_dataframe().set_index(["layer", "head"])
    bound = report.max_control
    # Each half passes the bound alone; removed together they break the control.
    assert all(df.loc[h, "control_effect"] <= bound for h in HALVES)
    together = float(_joint_mean(model, control, HALVES).mean())
    assert together > 10 * bound
    # The per-head order (the old top) puts both halves first: they hurt retrieval the most.
    assert set(report.top(2, joint=False)) == set(HALVES)
    # The joint top keeps one half and turns the other down, with the joint effect that did.
    joint = report.top(3)
    assert len(set(joint) & set(HALVES)) == 1
    kept = joint[0]
    dropped = next(h for h in HALVES if h != kept)
    assert set(joint[1:]) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    js = report.joint_set
    assert [r.head for r in js.rejected] == [dropped] and js.rejected[0].after == 1
    assert js.rejected[0].joint_effect == pytest.approx(together, rel=1e-4)
    # Every prefix of the joint set, removed together, stays within the bound.
    for k in range(1, len(js) + 1):
        assert float(_joint_mean(model, control, js.heads[:k]).mean()) <= bound
    gone = report.excluded(2)
    assert [e.head for e in gone] == [dropped]
    assert "joint control effect +" in gone[0].reason and "> max_control 0.1" in gone[0].reason
    assert gone[0].joint_control_effect == pytest.approx(together, rel=1e-4)
    assert report.excluded(2, joint=False) == []  # the per-head rule sees nothing wrong
    assert "joins only if" in report.criterion and "joint_k=16" in report.criterion
    line = report.method["joint_control"]
    assert "1 turned down" in line and "every candidate tried" in line
    assert report.timings["joint_control"] > 0


def test_recorded_joint_effects_equal_an_independent_measurement(split):
    model, task, control, _ = split
    # A loose bound accepts both halves, so the joint effects are far from zero.
    report = score_heads(model, task, control=control, max_control=100.0, progress=False,
                         n_examples=0)  # fmt: skip
    js = report.joint_set
    assert js.rejected == () and set(js.heads[:2]) == set(HALVES) and js.exhausted
    assert js.effects[1].value > 1.0
    for k in range(1, len(js) + 1):
        diffs = _joint_mean(model, control, js.heads[:k])[0]
        expected = bootstrap_interval(diffs)
        got = js.effect(k)
        assert got.value == pytest.approx(float(diffs.mean()), abs=1e-5)
        assert (got.low, got.high) == pytest.approx((expected.low, expected.high), abs=1e-5)
        assert got.low <= got.value <= got.high and got.n == len(control.tokens)


def test_top_beyond_joint_k_raises_with_the_fix(generic, split):
    model, report = generic
    task, control = toy_gna_task(model, n_samples=8, seed=1), toy_control(model)
    small = score_heads(model, task, control=control, joint_k=2, progress=False, n_examples=0)
    assert len(small.joint_set) == 2 and not small.joint_set.exhausted
    assert small.top(2) == report.top(2)
    with pytest.raises(GnaLensError, match=r"top\(k=3\).*joint_k=2.*joint_k=3.*joint=False"):
        small.top(3)
    with pytest.raises(GnaLensError, match="joint_k=2"):
        small.excluded(3)
    assert len(small.top(3, joint=False)) == 3
    # A walk that ran out of candidates knows every head it could accept: no error.
    assert report.joint_set.exhausted and report.top(10) == list(report.joint_set.heads)
    assert len(report.top(10)) == 5  # the 6 heads but the generic one
    off = score_heads(model, task, control=control, joint_k=0, progress=False, n_examples=0)
    assert off.joint_set is None and off.method["joint_control"].startswith("off (joint_k=0)")
    _, _, _, split_report = split
    with pytest.raises(GnaLensError, match=r"joint=True\): it has none"):
        off.top(2, joint=True)
    with pytest.raises(GnaLensError, match="raw order has none"):
        split_report.top(2, by="ablation_effect", joint=True)
    for bad in (-1, True, 2.0):
        with pytest.raises(InterventionError, match=rf"joint_k={bad!r}.*expected an int >= 0"):
            score_heads(model, task, control=control, joint_k=bad, progress=False)


def test_a_report_copied_with_another_bound_does_not_use_a_stale_joint_set(split):
    import dataclasses

    _, _, _, report = split
    loose = dataclasses.replace(report, max_control=100.0)
    assert loose.top(2) == loose.top(2, joint=False) and set(loose.top(2)) == set(HALVES)
    assert "joint set" not in loose.criterion
    with pytest.raises(GnaLensError, match=r"built for max_control 0\.1, not 100"):
        loose.top(2, joint=True)


def test_json_round_trip_keeps_the_joint_set_and_the_sample_effects(split, tmp_path):
    _, task, control, report = split
    path = tmp_path / "report.json"
    report.to_json(path)
    data = json.loads(path.read_text())
    assert data["joint_set"]["heads"][0] == list(report.top(1)[0])
    again = GnaReport.from_json(path)
    assert again.joint_set == report.joint_set and isinstance(again.joint_set, JointSet)
    assert again.top(3) == report.top(3) and again.excluded(3) == report.excluded(3)
    for name, grid in report.sample_effects.items():
        assert torch.equal(again.sample_effects[name].isnan(), grid.isnan())
        assert torch.equal(again.sample_effects[name].nan_to_num(7.0), grid.nan_to_num(7.0))
    assert report.sample_effects["ablation_effect"].shape == (len(report.heads), len(task))
    assert report.sample_effects["control_effect"].shape == (len(report.heads), len(control))
    assert json.loads(again.to_json()) == data  # nothing lost on the way
    assert GnaReport.from_json(report.to_json()).top(3) == report.top(3)  # text works too
    with pytest.raises(GnaLensError, match=r"expected the dict of GnaReport\.to_dict"):
        GnaReport.from_dict({"model_name": "x"})
    with pytest.raises(GnaLensError, match="cannot read it"):
        GnaReport.from_json(tmp_path / "missing.json")


def test_html_and_scan_cli_show_the_joint_control_effect(split, tmp_path, monkeypatch, capsys):
    from gna_lens import scan as scan_module
    from gna_lens.cli import main
    from gna_lens.scan import ScanTasks

    model, _, _, report = split
    page = report.to_html(tmp_path / "r.html", k=3).read_text()
    assert "Joint set: joint control effect of" in page and "joint_control_effect" in page
    assert "joint control effect +5.8" in page  # the half turned down, in "Left out"
    table = report.joint_table(report.top(3))
    assert list(table["joint_control_effect"]) == [iv.value for iv in report.joint_set.effects[:3]]
    assert table.columns.get_loc("joint_control_effect") > table.columns.get_loc("control_effect")

    def tasks(tok, task, n_samples, seed, n_eval=8, **kv):
        return ScanTasks(
            toy_gna_task(model, n_samples=n_samples, seed=seed),
            {"kv-4": toy_gna_task(model, n_samples=n_eval, seed=seed + 1)},
            control_select=toy_control(model, seed=seed),
            control_eval=toy_control(model, seed=seed + 1),
        )

    monkeypatch.setattr(scan_module, "build_tasks", tasks)
    monkeypatch.setattr(scan_module, "load_scan_model", lambda name, **kw: model)
    args = ["scan", "toy", "--n-samples", "8", "--top", "3", "--out", str(tmp_path / "s"),
            "--random-draws", "1"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Joint control effect (the top 3 removed together, 95% interval): +0.00" in text
    assert "joint_control_effect" in text and "joint control effect +5.8" in text
    data = json.loads((tmp_path / "s" / "report.json").read_text())
    assert data["top"] == [list(h) for h in data["joint_set"]["heads"][:3]]


def test_rank_stability_on_the_toy_has_the_reports_order_and_narrow_intervals(generic):
    _, report = generic
    stab = rank_stability(report, bounds=(0.05, 0.1, 0.2), k=3, n_boot=300, n_prompts=(4, 8))
    df = stab.to_dataframe()
    assert len(df) == 3 * 2 * 3 and list(df.columns[:5]) == [
        "bound", "n_prompts", "rank", "layer", "head"
    ]  # fmt: skip
    assert stab.top(report.max_control) == report.top(3, joint=False)
    assert TOY_GENERIC_HEAD not in stab.top(0.2)
    # The G&A heads' effects are the same on every prompt: their ranks never move.
    ga = df[df["rank"] <= 2]
    assert (ga["rank_low"] == ga["rank"]).all() and (ga["rank_high"] == ga["rank"]).all()
    assert (ga["p_top_k"] == 1.0).all() and (ga["p_eligible"] == 1.0).all()
    assert json.loads(json.dumps(stab.to_dict()))["k"] == 3
    with pytest.raises(GnaLensError, match=r"n_prompts=\(9,\).*between 1 and 8"):
        rank_stability(report, n_prompts=(9,))
    no_samples = GnaReport.from_dict({k: v for k, v in report.to_dict().items()
                                      if k != "sample_effects"})  # fmt: skip
    with pytest.raises(GnaLensError, match="per-sample effects none"):
        rank_stability(no_samples)


def _synthetic(ablation, control):
    """A report of per-sample effects only (``[head, prompt]``, ``[head, window]``)."""
    n = ablation.shape[0]
    scores = {name: torch.full((n,), math.nan) for name in SCORE_COLUMNS}
    scores["ablation_effect"] = ablation.mean(-1)
    scores["control_effect"] = control.mean(-1)
    return GnaReport(
        "synthetic", "t", heads=tuple((i // 2, i % 2) for i in range(n)),
        kinds=("attention",) * n, scores=scores, metric="logit_diff", baseline=2.0,
        n_layers=(n + 1) // 2, layer_heads=(2,) * ((n + 1) // 2), control="c", max_control=0.1,
        sample_effects={"ablation_effect": ablation, "control_effect": control},
    )  # fmt: skip


def test_rank_intervals_cover_overlapping_heads_and_a_head_on_the_bound():
    """A and B about as harmful (noisy), C much weaker with a control effect right at 0.1."""
    gen = torch.Generator().manual_seed(0)
    n, w = 24, 8
    ablation = torch.stack(
        [-1.0 + 0.5 * torch.randn(n, generator=gen), -0.95 + 0.5 * torch.randn(n, generator=gen),
         -0.1 + 0.01 * torch.randn(n, generator=gen)]
    )  # fmt: skip
    control = torch.zeros(3, w)
    control[2] = 0.05 * torch.randn(w, generator=gen)
    control[2] += 0.099 - control[2].mean()  # at the bound on average
    report = _synthetic(ablation, control)
    a, b, c = report.heads
    stab = rank_stability(report, bounds=(0.1, 0.5), k=3, n_boot=2000)
    df = stab.to_dataframe().set_index(["bound", "layer", "head"])
    for h in (a, b):  # A and B swap places between resamples
        row = df.loc[(0.5, *h)]
        assert (row["rank_low"], row["rank_high"]) == (1.0, 2.0) and row["p_top_k"] == 1.0
    row = df.loc[(0.5, *c)]  # far weaker: always third at a loose bound
    assert (row["rank"], row["rank_low"], row["rank_high"], row["p_eligible"]) == (3, 3, 3, 1)
    row = df.loc[(0.1, *c)]  # on the bound: out of the ranking in many resamples
    assert row["rank_high"] == math.inf and 0.2 < row["p_eligible"] < 0.8
    assert row["p_top_k"] == pytest.approx(row["p_eligible"])


def test_fewer_prompts_draw_fewer_prompts_per_resample():
    """D is -2 on half the prompts and 0 on the others (mean -1), E always -1.2: D ranks first
    when its drawn prompts average below -1.2, which 4 draws do with probability 5/16 (3 or 4
    of them at -2) and 24 draws with P(Binomial(24, 1/2) >= 15) = 0.154."""
    n = 24
    d = torch.tensor([-2.0, 0.0] * (n // 2))
    report = _synthetic(torch.stack([d, torch.full((n,), -1.2)]), torch.zeros(2, 8))
    stab = rank_stability(report, bounds=(0.1,), k=1, n_boot=4000, n_prompts=(4, 24))
    first = {r.n_prompts: r for r in stab.rows}
    assert first[4].head == first[24].head == report.heads[1]  # E first on the report's numbers
    assert first[4].p_top_k == pytest.approx(1 - 5 / 16, abs=0.03)
    p24 = sum(math.comb(n, i) for i in range(15, n + 1)) / 2**n
    assert first[24].p_top_k == pytest.approx(1 - p24, abs=0.02)
    assert (first[4].rank_low, first[4].rank_high) == (1, 2)


def test_findings_page_shows_the_joint_set_and_the_rank_intervals(split):
    from gna_lens.findings.experiments import selection_extras
    from gna_lens.findings.render import _joint_lines, _stability_lines

    _, _, _, report = split
    extras = json.loads(json.dumps(selection_extras(report)))  # as the JSON stores them
    joint = report.joint_set
    lines = "\n".join(_joint_lines(extras["joint"], None))
    for i, (head, iv) in enumerate(zip(joint.heads, joint.effects, strict=True)):
        row = f"| {i + 1} | L{head[0]}H{head[1]} | accepted | {iv.format(signed=True)}"
        assert row in lines, (row, lines)
    for r in joint.rejected:  # the split generic head: passes alone, not with the others
        assert f"L{r.head[0]}H{r.head[1]} | turned down" in lines
    assert joint.rejected
    stab = _stability_lines(extras["stability"])
    bounds = [x for x in stab if x.startswith("- bound")]
    assert len(bounds) == 3 * len(extras["stability"]["n_prompts"])  # 0.05 / 0.1 / 0.2
    top = report.top(1, joint=False)[0]
    assert f"L{top[0]}H{top[1]} [1, " in stab[2]


def test_metric_agreement_compares_the_published_set_and_draws_ties():
    """Issue 39: the accuracy top k was compared with the per-head order and its ties broken by
    head index (which favours exactly the low-index heads the joint walk rejects)."""
    from gna_lens.findings.experiments import metric_agreement
    from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task

    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=8)
    report = score_heads(model, task, control=toy_control(model), progress=False)
    picks = []
    for seed in range(4):
        out = metric_agreement(model, task, report, ks=(4,), n_boot=20, seed=seed, progress=False)
        o = out["overlap"]["4"]
        assert o["joint_top"] == [f"L{h[0]}H{h[1]}" for h in report.top(4)]
        assert o["shared_with_joint"] == len(set(o["joint_top"]) & set(o["accuracy_top"]))
        assert set(o["accuracy_top"][:2]) == {"L0H0", "L1H0"}  # the two hand-built heads
        picks.append(tuple(o["accuracy_top"][2:]))  # heads tied at 0: drawn
        assert len(out["accuracy_effects"]) == out["n_heads"]
    assert len(set(picks)) > 1, picks  # head order would give the same lowest-index pair


def test_joint_stability_redoes_the_walk_on_resampled_selection_data():
    """Issue 39: the joint set's own stability (how often each member stays in the set over
    resampled selection prompts and control windows)."""
    from gna_lens.scoring.pipeline import _joint_walk
    from gna_lens.scoring.stability import joint_stability

    model = toy_gna_model(generic_head=True)
    control = toy_control(model)
    report = score_heads(model, toy_gna_task(model, n_samples=12), control=control, progress=False)
    js = joint_stability(model, control, report, k=2, n_boot=20, progress=False)
    assert js.heads == tuple(report.top(2)) and js.same_set == 1.0 and js.mean_shared == 2.0
    assert js.share == {TOY_GATHER_HEAD: 1.0, TOY_AGGREGATE_HEAD: 1.0}  # never the generic one
    assert set(js.to_dataframe()["published"]) == {True}
    # The cached measure on the original windows reproduces score_heads' own walk.
    full = report.sample_effects["control_effect"]
    calls = []

    def measure(sets):
        calls.append(len(sets))
        res = control_sweep(model, control, sets, progress=False)
        return (res.values.double() - res.baseline.double()[None]).cpu()

    again, _ = _joint_walk(model, control, report, full, 4, mode="zero", positions=None,
                           progress=False, measure=measure)  # fmt: skip
    assert again.heads == report.joint_set.heads[:4] and calls
    with pytest.raises(GnaLensError, match="positions"):
        joint_stability(model, control, report, positions=[-1], progress=False)


@pytest.mark.parametrize("joint_k", [1, 2])
def test_control_scope_needed_builds_the_same_joint_set_from_fewer_heads(split, joint_k):
    """control_scope="needed" measures the control alone only as far as the joint walk reaches
    (in ablation-effect order): the same joint set, effects and rejections as measuring every
    head, NaN control effects past the reach, and the per-head order past it refused."""
    model, task, control, _ = split
    kw = dict(control=control, progress=False, n_examples=0, joint_k=joint_k)
    full = score_heads(model, task, **kw)
    part = score_heads(model, task, control_scope="needed", **kw)
    assert part.joint_set.heads == full.joint_set.heads
    assert part.joint_set.rejected == full.joint_set.rejected
    for a, b in zip(part.joint_set.effects, full.joint_set.effects, strict=True):
        assert a.value == pytest.approx(b.value, abs=1e-6)
    assert part.top(joint_k) == full.top(joint_k)
    c_part, c_full = part.scores["control_effect"], full.scores["control_effect"]
    seen = ~c_part.isnan()
    n_seen = int(seen.sum())
    # joint_k=1: the first 2 heads suffice; joint_k=2: the walk asks for more than the first 4
    assert n_seen < len(part.heads) if joint_k == 1 else n_seen > 2 * joint_k
    torch.testing.assert_close(c_part[seen], c_full[seen], atol=1e-6, rtol=0)
    # what was measured is the head of the ablation-effect order
    order = torch.argsort(full.scores["ablation_effect"], stable=True)
    assert bool(seen[order[:n_seen]].all()) and not bool(seen[order[n_seen:]].any())
    assert f"first {n_seen} of the {len(part.heads)} ablated heads" in part.method["control_scope"]
    assert "control_scope" not in full.method
    if n_seen < len(part.heads):
        with pytest.raises(GnaLensError, match="control_scope='all'"):
            part.top(len(part.heads), joint=False)
        with pytest.raises(GnaLensError, match="control_scope='all'"):
            rank_stability(part)
    else:  # the walk measured every head: nothing is missing
        assert rank_stability(part, n_boot=20).rows == rank_stability(full, n_boot=20).rows


def test_control_scope_is_checked():
    model = toy_gna_model()
    with pytest.raises(InterventionError, match=r"control_scope='some'.*'all'.*'needed'"):
        score_heads(model, toy_gna_task(model, n_samples=4), control_scope="some", progress=False)
