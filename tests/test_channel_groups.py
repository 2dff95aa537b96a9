"""Mamba-1 channel groups as heads: one group = all its channels, in every intervention."""

import pytest
import torch
from interventions_helpers import hook_count, model, other_key, tokens
from interventions_helpers import task as make_task

import gna_lens.interventions as I
from gna_lens.errors import InterventionError
from gna_lens.heads import head_patterns, head_view
from gna_lens.interventions.metrics import Metric

#: Contiguous blocks of 8 channels, and explicit (uneven, non-contiguous) sets in layer 1.
SPECS = [8, {1: [[3, 40, 7], [5], [60, 61, 62, 63, 0]]}]


def _members(m, spec, layer, group):
    with m.head_groups(spec):
        return head_view(m)[layer].members(group)


@pytest.mark.parametrize("arch", ["mamba1", "falcon_mamba"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("positions", [None, "last"])
def test_ablating_a_group_equals_ablating_its_channels_together(arch, spec, positions):
    m = model(arch)
    ids = tokens(make_task())
    cells = [(1, 0), (1, 2)] if isinstance(spec, dict) else [(0, 2), (1, 7)]
    channels = [(layer, c) for layer, g in cells for c in _members(m, spec, layer, g)]
    assert len(channels) > len(cells)
    with torch.no_grad():
        clean = m(ids)
        with m.head_groups(spec), I.ablate_heads(m, cells, positions=positions):
            grouped = m(ids)
        with I.ablate_heads(m, channels, positions=positions):
            by_channel = m(ids)
    assert not torch.equal(grouped, clean)
    assert torch.equal(grouped, by_channel)
    assert m.head_group_spec == {} and hook_count(m) == 0


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("positions", [None, "last"])
def test_group_sweep_equals_single_group_ablations(spec, positions):
    """The batched sweep (cached prefix / incremental last-token states) over groups equals a
    loop of single group ablations."""
    m, t = model("mamba1"), make_task()
    met, ids, idx = Metric("logit_diff", t), tokens(t), torch.arange(len(t))
    with m.head_groups(spec):
        view = head_view(m)
        sweep = I.ablation_sweep(m, t, "logit_diff", positions=positions, progress=False)
        assert [c[0] for c in sweep.cells] == view.heads()
        with torch.no_grad():
            for i, (head,) in enumerate(sweep.cells):
                with I.ablate_heads(m, [head], positions=positions):
                    ref = met(m(ids)[:, -1], idx)
                assert torch.allclose(sweep.values[i], ref, atol=2e-5), head


@pytest.mark.parametrize("spec", SPECS)
def test_group_attribution_is_its_channels_attribution_together(spec):
    m, t = model("mamba1"), make_task()
    with m.head_groups(spec):
        view = head_view(m)
        est = I.attribute_heads(m, t)
    assert [c[0] for c in est.cells] == view.heads()
    sets = [[(layer, c) for c in view[layer].members(g)] for layer, g in view.heads()]
    ref = I.attribute_heads(m, t, heads=sets)  # single channels, each group as a head set
    assert torch.allclose(est.values, ref.values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions", [None, "last"])
def test_patching_a_group_patches_its_channels_together(positions):
    m, t = model("mamba1"), make_task()
    corrupted = other_key(t)
    with m.head_groups(SPECS[1]):
        view = head_view(m)
        got = I.patch_heads(m, t, corrupted, positions=positions, progress=False)
    sets = [[(layer, c) for c in view[layer].members(g)] for layer, g in view.heads()]
    ref = I.patch_heads(m, t, corrupted, heads=sets, positions=positions, progress=False)
    assert got.values.shape[0] == len(got.index_df) == view.n_heads_total == 64 + 3
    assert torch.allclose(got.values, ref.values, atol=2e-5)


def test_masking_a_group_masks_each_of_its_channels():
    m = model("mamba1")
    ids = tokens(make_task())
    L = ids.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    keep[-1, 1:-4] = False  # the query row may not read the middle of the prompt
    with torch.no_grad():
        clean = m(ids)
        with m.head_groups(16), I.mask_patterns(m, {(1, 1): keep}):
            grouped = m(ids)
        with I.mask_patterns(m, {(1, c): keep for c in range(16, 32)}):
            by_channel = m(ids)
    assert not torch.equal(grouped, clean)
    assert torch.allclose(grouped, by_channel, rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_group_pattern_scores_are_the_mean_of_its_channels_shares(spec):
    """A group's pattern is the mean of its channels' row-normalized |α|: its gather and
    aggregate shares (and their nulls) are the means of its channels' shares, per sample."""
    from gna_lens.scoring import pattern_scores
    from gna_lens.scoring.patterns import SCORE_NAMES

    m, t = model("mamba1"), make_task(n_pairs=4, n_samples=6)
    with m.head_groups(spec):
        view = head_view(m)
        grouped = pattern_scores(m, t, progress=False)
    single = pattern_scores(m, t, progress=False)
    col = {h: i for i, h in enumerate(single.heads)}
    linear = [SCORE_NAMES.index(n) for n in ("gather_share", "aggregate_score", "aggregate_null")]
    for k, (layer, g) in enumerate(grouped.heads):
        idx = [col[(layer, c)] for c in view[layer].members(g)]
        mean = single.per_sample[:, idx][..., linear].double().mean(1)
        assert torch.allclose(grouped.per_sample[:, k, linear].double(), mean, atol=1e-6)
    sharp = grouped.per_sample[..., SCORE_NAMES.index("sharpness")]
    assert bool(((sharp > 0) & (sharp <= 1)).all())


def test_head_patterns_are_row_stochastic_means_and_single_channels_pass_through():
    m = model("mamba1")
    ids = tokens(make_task())[:1]
    _, cache = m.run_with_cache(ids, names_filter="blocks.1.mixer.hook_pattern")
    pattern = cache["blocks.1.mixer.hook_pattern"]
    assert head_patterns(pattern, head_view(m)[1]) is pattern
    with m.head_groups({1: [[3, 9], [4]]}):
        lh = head_view(m)[1]
        groups = head_patterns(pattern, lh)
    assert groups.shape == (1, 2, ids.shape[1], ids.shape[1])
    assert torch.allclose(groups.sum(-1), torch.ones(1, 2, ids.shape[1]))
    w = pattern.abs() / pattern.abs().sum(-1, keepdim=True)
    assert torch.allclose(groups[:, 0], (w[:, 3] + w[:, 9]) / 2)
    assert torch.allclose(groups[:, 1], w[:, 4])


def test_group_view_and_spec_errors():
    m = model("mamba1")
    E = m.cfg.d_inner
    assert head_view(m)[0].n_heads == E and head_view(m)[0].channels is None
    with m.head_groups({0: 16}):
        view = head_view(m)
        assert [lh.n_heads for lh in view] == [E // 16, E]
        assert view[0].members(1) == tuple(range(16, 32)) and view[0].n_channels == E
        assert view.check_heads([(0, 3)]) == [(0, 3)]
        with pytest.raises(InterventionError, match=r"\(0, 4\).*4 heads"):
            view.check_heads([(0, 4)])
    with pytest.raises(RuntimeError, match="boom"), m.head_groups(8):
        raise RuntimeError("boom")
    assert m.head_group_spec == {}
    bad = {
        "does not divide d_inner=64": 10,
        "out of range for d_inner=64": {0: [[1, 64]]},
        r"channels \[2\] of layer 1 are in more than one set": {1: [[1, 2], [2, 3]]},
        "not an SSM layer": {5: 8},
        "non-empty list of non-empty channel lists": {0: [[]]},
        "expected None, an int block size": "16",
    }
    for message, spec in bad.items():
        with pytest.raises(InterventionError, match=message):
            m.set_head_groups(spec)
    assert m.head_group_spec == {}
    with pytest.raises(InterventionError, match="channel groups are for Mamba-1"):
        model("mamba2").set_head_groups(8)


def test_score_heads_ranks_groups_and_says_so():
    from gna_lens import score_heads

    m, t = model("mamba1"), make_task(n_pairs=4, n_samples=6)
    with m.head_groups({0: 16, 1: [[3, 40, 7], [5]]}):
        report = score_heads(m, t, control=None, progress=False, n_examples=2)
    assert report.heads == ((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1))
    assert report.layer_heads == (4, 2)
    assert report.method["head_groups"] == (
        "Mamba-1 channel groups as heads: layer 0: 4 blocks of 16 channels; "
        "layer 1: 2 channel sets (3, 1 channels)"
    )
    for name, rows in report.examples["patterns"].items():  # group patterns: row-stochastic
        assert torch.allclose(torch.tensor(rows).sum(-1), torch.ones(len(rows))), name
    plain = score_heads(m, t, ablation=False, control=None, progress=False, n_examples=0)
    assert "head_groups" not in plain.method and len(plain.heads) == 2 * m.cfg.d_inner


def test_a_ranking_made_on_groups_is_refused_on_single_channels_and_back():
    """A grouped report's heads name groups: used on the ungrouped model they would name single
    channels (the findings once measured channels 0-3 instead of the ranked 64-channel blocks)."""
    from gna_lens import GnaReport, retrieval_vs_knowledge, score_heads

    m, t = model("mamba1"), make_task(n_pairs=4, n_samples=4)
    with m.head_groups(16):
        report = score_heads(m, t, control=None, progress=False, n_examples=0)
    heads = report.top(2, by="ablation_effect")
    assert heads.head_groups == report.head_groups and report.head_groups
    for call in (
        lambda h: I.ablate_heads(m, h).__enter__(),
        lambda h: I.ablation_sweep(m, t, "logit_diff", [h], progress=False),
        lambda h: retrieval_vs_knowledge(m, h, {"kv": t}, random_draws=0, progress=False),
    ):
        for given in (heads, heads[:1]):  # slices keep the groups
            with pytest.raises(InterventionError, match="were chosen with Mamba-1 channel groups"):
                call(given)
    assert hook_count(m) == 0
    with m.head_groups(report.head_groups_spec()):
        grouped = retrieval_vs_knowledge(m, heads, {"kv": t}, random_draws=0, progress=False)
    with m.head_groups(16):
        again = retrieval_vs_knowledge(m, list(heads), {"kv": t}, random_draws=0, progress=False)
    assert grouped.after == again.after
    # A single-channel ranking is refused on a grouped model too; list() opts out of the check.
    plain = score_heads(m, t, ablation=False, control=None, progress=False, n_examples=0)
    ranked = plain.top(1, by="aggregate_score")
    with m.head_groups(16), pytest.raises(InterventionError, match="single channels as heads"):
        I.ablate_heads(m, ranked).__enter__()
    # The JSON records the groups.
    assert report.to_dict()["head_groups"]["0"][1][:2] == [16, 17]
    assert isinstance(report, GnaReport) and "head_groups" not in plain.to_dict()
