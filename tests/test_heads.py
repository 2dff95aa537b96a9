"""The head view: per layer the hooks holding patterns and head outputs, on every model kind."""

import pytest
import torch
from interventions_helpers import hook_count, model, tokens, weights
from interventions_helpers import task as make_task

from gna_lens.errors import GnaLensError, InterventionError, PatternEditError
from gna_lens.heads import head_view, normalize_head_sets, require_editable

ARCHS = [
    "llama",
    "mamba1",
    "falcon_mamba",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "jamba",
    "zamba2",
]


def test_view_describes_each_architecture():
    expected = {
        "llama": [("attention", 4, 8)] * 2,  # grouped-query: 4 query heads over 2 KV heads
        "mamba1": [("ssm", 64, 1)] * 2,  # channels are the heads
        "falcon_mamba": [("ssm", 64, 1)] * 2,  # Mamba-1's layout (plus RMS norms on B, C, dt)
        "mamba2": [("ssm", 8, 8)] * 2,
        "bamba": [("ssm", 8, 8), ("attention", 4, 8), ("ssm", 8, 8)],
        # Mamba-2, attention, MLP-only and MoE blocks (the MLP blocks have no heads).
        "nemotron_h": [("ssm", 8, 8), ("attention", 4, 8), ("ssm", 8, 8)],
        "granitemoehybrid": [("ssm", 8, 8), ("attention", 4, 8), ("ssm", 8, 8)],
        # Falcon-H1: each layer's 8 SSM heads, then its parallel attention's 4 (two parts).
        "falcon_h1": [("mixed", 12, 8)] * 3,
        # Mamba-1 layers (channels are the heads) and attention layers without RoPE.
        "jamba": [
            ("ssm", 64, 1),
            ("attention", 4, 8),
            ("ssm", 64, 1),
            ("ssm", 64, 1),
            ("attention", 4, 8),
        ],
        # Zamba2: Mamba-2 layers, and hybrid layers whose heads are the shared transformer
        # block's attention heads as invoked there, then the layer's mixer's SSM heads (two
        # parts whose d_head differ: 0 at the layer).
        "zamba2": [("ssm", 8, 8), ("mixed", 12, 0)] * 2 + [("mixed", 12, 0)],
    }
    assert sorted(expected) == sorted(ARCHS)  # every architecture the file tests
    for arch, layers in expected.items():
        view = head_view(model(arch))
        assert [(lh.kind, lh.n_heads, lh.d_head) for lh in view] == layers, arch
        assert view.n_heads_total == sum(n for _, n, _ in layers)
        assert len(view.heads("attention")) + len(view.heads("ssm")) == view.n_heads_total
    df = head_view(model("bamba")).to_dataframe()
    assert df.loc[1, "z_hook"] == "blocks.1.attn.hook_z"
    assert df.loc[0, "pattern_hook"] == "blocks.0.mixer.hook_pattern"
    assert head_view(model("bamba"))[0].scores_hook is None


@pytest.mark.parametrize("arch", ARCHS)
def test_every_view_hook_fires_with_its_shape_and_edits_change_the_output(arch):
    m = model(arch)
    view = head_view(m)
    ids = tokens(make_task())[:2]
    b, L = ids.shape
    with torch.no_grad():
        clean = m(ids)
        for lh in (part for layer in view for part in layer.parts):
            targets = [("z", lh.z_hook), ("pattern", lh.pattern_hook)]
            if lh.scores_hook is not None:
                targets.append(("scores", lh.scores_hook))
            for target, name in targets:
                shapes = []

                def edit(x, hook, shapes=shapes, target=target):
                    shapes.append(tuple(x.shape))
                    if target == "scores":  # every query attends to key 0 only
                        return torch.full_like(x, torch.finfo(x.dtype).min).index_fill(
                            -1, torch.tensor([0]), 0.0
                        )
                    # A scale that differs across heads: Zamba2's shared block normalizes the
                    # attention's output, so a scale shared by every head would change nothing.
                    w = torch.linspace(0.25, 1.0, x.shape[2 if target == "z" else 1])
                    return x * (w[:, None] if target == "z" else w[:, None, None])

                out = m.run_with_hooks(ids, fwd_hooks=[(name, edit)])
                assert shapes, f"{name} never fired"
                if target == "z":
                    assert shapes[0] == (b, L, lh.n_heads, lh.d_head)
                else:
                    assert shapes[0] == (b, lh.n_heads, L, L)
                assert (out - clean).abs().max() > 1e-3, f"editing {name} changed nothing"
        require_editable(m, view, [lh.layer for lh in view], "z")
        require_editable(m, view, [lh.layer for lh in view], "pattern")


def test_bridge_that_discards_pattern_edits_is_refused_not_ignored():
    """OPT's attention bridge delegates to HF and only reports the pattern: refuse the edit."""
    from gna_lens.interventions import ablate_heads, mask_patterns

    m = model("opt")
    view = head_view(m)
    before = hook_count(m)
    with pytest.raises(PatternEditError, match=r"layer 1: post-softmax .* silently ignored"):
        require_editable(m, view, [1], "pattern")
    with (
        pytest.raises(PatternEditError, match="pre-softmax"),
        mask_patterns(m, {(0, 0): torch.ones(5, 5, dtype=torch.bool)}, mode="pre"),
    ):
        pass
    assert hook_count(m) == before
    # Head outputs (hook_z) of the same bridge do take edits: ablation is allowed.
    ids = tokens(make_task())[:1]
    with torch.no_grad():
        clean = m(ids)
        with ablate_heads(m, [(1, 0)]):
            ablated = m(ids)
    assert (ablated - clean).abs().max() > 1e-4


def test_head_errors_repeat_the_input():
    view = head_view(model("bamba"))
    with pytest.raises(InterventionError, match=r"\(1, 7\).*layer 1 \(attention\) has 4 heads"):
        view.check_heads([(1, 7)])
    with pytest.raises(InterventionError, match=r"one \(layer, head\) pair.*\[\(0, 1\)\]"):
        view.check_heads((0, 1))
    with pytest.raises(InterventionError, match=r"layer 5 is out of range.*3 layers"):
        view.check_heads([(5, 0)])
    with pytest.raises(InterventionError, match="'x'"):
        normalize_head_sets(view, ["x"])
    with pytest.raises(GnaLensError, match="expected a TransformerLens model"):
        head_view(torch.nn.Linear(2, 2))
    sets = normalize_head_sets(view, [(0, 1), [(2, 0), (1, 3)]])
    assert sets == [((0, 1),), ((1, 3), (2, 0))]


def test_view_and_probe_leave_model_untouched():
    m = model("llama")
    w, before = weights(m), hook_count(m)
    require_editable(m, head_view(m), [0, 1], "scores")
    assert hook_count(m) == before
    assert all(torch.equal(w[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("arch", ["falcon_h1", "zamba2"])
def test_a_layer_of_two_parts_numbers_its_heads_part_after_part(arch):
    """A layer whose heads live behind two hook sets: heads are the layer's indices, parts
    translate them to their own; asking the layer for one hook or mask refuses, naming the
    parts, instead of editing the wrong hook."""
    from gna_lens.heads import head_output_weights

    m = model(arch)
    view = head_view(m)
    lh = next(lh for lh in view if len(lh.parts) == 2)
    first, second = lh.parts
    assert (first.offset, second.offset) == (0, first.n_heads)
    assert lh.n_heads == first.n_heads + second.n_heads and lh.multipart
    last = lh.n_heads - 1
    assert lh.split([last, 1, first.n_heads]) == [(first, [1]), (second, [second.n_heads - 1, 0])]
    assert lh.split([2]) == [(first, [2])]
    assert view.part_of((lh.layer, first.n_heads + 2)) == (second, 2)
    assert view.parts_of([(lh.layer, last), (lh.layer, 0), (lh.layer, 1)]) == [first, second]
    single = head_view(model("bamba"))[1]  # a single-part layer is its own part
    assert single.parts == (single,) and single.split([3]) == [(single, [3])]
    assert single.part_of(3) == (single, 3) and single.hook("z") == single.z_hook
    for call in (
        lambda: lh.hook_mask([0]),
        lambda: lh.members(0),
        lambda: lh.membership(),
        lambda: lh.hook("z"),
    ):
        with pytest.raises(InterventionError, match=rf"layer {lh.layer}: .* 2 sets of hooks"):
            call()
    with pytest.raises(InterventionError, match=r"has 2 parts.*part=i"):
        head_output_weights(m, lh.layer)
    with pytest.raises(InterventionError, match=rf"\({lh.layer}, 99\).*has {lh.n_heads} heads"):
        view.check_heads([(lh.layer, 99)])
    df = view.to_dataframe()
    rows = df[df["layer"] == lh.layer]
    assert list(rows["z_hook"]) == [first.z_hook, second.z_hook]
    assert list(rows["first_head"]) == [0, first.n_heads]
