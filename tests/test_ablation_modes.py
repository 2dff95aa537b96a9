"""Ablation semantics: the mean is taken over the ablated positions (BOS left out and unedited
unless asked), and resample ablation refuses to pair a prompt with itself."""

import dataclasses

import pytest
import torch
from interventions_helpers import bos_model, bos_task, bos_tok, hand_class_mean, hand_columns

import gna_lens.interventions as I
from gna_lens.errors import InterventionError
from gna_lens.heads import head_view
from gna_lens.interventions.metrics import Metric

ARCHS = ["mamba2", "bamba", "llama"]  # SSM, hybrid (layer 1 is attention), Transformer bridge
kv = bos_task


def _ids(task) -> torch.Tensor:
    return torch.tensor([s.input_ids for s in task])


def _z(model, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """``hook_z`` of ``layer`` on a plain forward ``[batch, pos, head, d_head]``."""
    name = head_view(model)[layer].z_hook
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=[name])
    return cache[name]


def hand_mean(model, layer: int, reference, positions, include_bos: bool = False):
    """The mean a careful researcher computes by hand: over the reference prompts' tokens at the
    ablated positions, each (prompt, position) once, position 0 (the BOS) left out."""
    return hand_class_mean(
        reference, lambda ids: _z(model, layer, ids), positions, include_bos
    )  # [H, d]


def ablated_z(model, layer: int, heads, ids, **kw) -> torch.Tensor:
    """``hook_z`` of ``layer`` as the ablation leaves it (an observer added after its hooks)."""
    name = head_view(model)[layer].z_hook
    seen = {}

    def observe(z, hook):
        seen["z"] = z.detach().clone()

    with (
        torch.no_grad(),
        I.ablate_heads(model, heads, **kw),
        model.hooks(fwd_hooks=[(name, observe)]),
    ):
        model(ids)
    return seen["z"]


def assert_mean_ablation(model, layer, head, ids, reference, positions, include_bos=False):
    """The ablated head holds the hand mean exactly at the ablated positions (the BOS column
    untouched unless include_bos), and everything else is the clean run's."""
    clean = _z(model, layer, ids)
    kw = {"include_bos": True} if include_bos else {}
    edited = ablated_z(
        model, layer, [(layer, head)], ids, mode="mean", positions=positions,
        reference=reference, **kw,
    )  # fmt: skip
    mean = hand_mean(model, layer, reference, positions, include_bos)
    cols = hand_columns(ids.shape[1], positions, include_bos)
    others = torch.ones(clean.shape[2], dtype=torch.bool)
    others[head] = False
    assert torch.allclose(
        edited[:, cols, head], mean[head].expand_as(edited[:, cols, head]), atol=1e-6
    )
    assert torch.equal(edited[:, ~cols, head], clean[:, ~cols, head])
    assert torch.equal(edited[:, :, others], clean[:, :, others])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("positions", ["last", None, [-3, -1], [1, 2]])
def test_the_mean_is_over_the_ablated_positions_of_the_reference_without_bos(arch, positions):
    model = bos_model(arch)
    task, ref = kv(3, 3, 0), kv(4, 5, 5)  # prompts of different lengths than the reference
    assert task[0].input_ids[0] == bos_tok().bos_token_id
    layer = 1
    assert_mean_ablation(model, layer, 2, _ids(task), ref, positions)


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_include_bos_averages_over_and_edits_the_bos_too(arch):
    model = bos_model(arch)
    task, ref = kv(3, 3, 0), kv(4, 5, 5)
    assert_mean_ablation(model, 1, 0, _ids(task), ref, None, include_bos=True)
    assert_mean_ablation(model, 1, 0, _ids(task), ref, [0, -1], include_bos=True)


@pytest.mark.parametrize("positions", [None, [-3, -1]])
def test_the_old_one_mean_over_every_position_fails_the_check(monkeypatch, positions):
    """The check above fires on the old semantics: one mean over every reference position, BOS
    included, whatever positions are ablated."""
    from gna_lens.interventions import sources

    def every_position(ids, positions, bos_id, include_bos, where):
        return list(range(len(ids))), 0

    monkeypatch.setattr(sources, "class_positions", every_position)
    model = bos_model("bamba")
    task, ref = kv(3, 3, 0), kv(4, 5, 5)
    with pytest.raises(AssertionError):
        assert_mean_ablation(model, 1, 2, _ids(task), ref, positions)


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
@pytest.mark.parametrize("positions", ["last", None])
def test_mean_ablation_sweep_equals_a_hand_made_mean_hook(arch, positions):
    """Every sweep path (incremental for "last", from the ablated layer for all positions)
    replaces each head by the hand mean at the positions the hand picks."""
    model = bos_model(arch)
    task, ref = kv(3, 4, 0), kv(4, 5, 5)
    view = head_view(model)
    heads = [(0, 1), (1, 2), (view.n_layers - 1, 0)]
    res = I.ablation_sweep(
        model, task, "logit_diff", heads, mode="mean", positions=positions, reference=ref,
        progress=False,
    )  # fmt: skip
    met, ids, idx = Metric("logit_diff", task), _ids(task), torch.arange(len(task))
    for i, (layer, h) in enumerate(heads):
        mean = hand_mean(model, layer, ref, positions)

        def replace(z, hook, h=h, mean=mean):
            z = z.clone()
            if positions == "last":
                z[:, -1, h] = mean[h]
            else:
                z[:, 1:, h] = mean[h]  # every position but the BOS
            return z

        with torch.no_grad(), model.hooks(fwd_hooks=[(view[layer].z_hook, replace)]):
            manual = met(model(ids)[:, -1], idx)
        assert (res.values[i] - manual).abs().max() <= 1e-5, (layer, h)
    assert res.effects.abs().max() > 1e-3
    assert res.info["mean_tokens"] == (
        len(ref) if positions == "last" else sum(s.n_tokens - 1 for s in ref)
    )
    assert res.info["bos_excluded"] == (0 if positions == "last" else len(ref))
    assert "reference prompt" in res.info["mean_over"]
    assert res.info["bos_unedited"] == (positions is None)


def test_a_listed_bos_position_raises_unless_include_bos():
    model = bos_model("mamba2")
    task, ref = kv(3, 3, 0), kv(4, 5, 5)
    with pytest.raises(
        InterventionError, match=r"positions=\[0, -1\] include position 0.*include_bos=True"
    ):
        I.ablation_sweep(
            model, task, "logit_diff", [(0, 0)], mode="mean", positions=[0, -1], reference=ref,
            progress=False,
        )  # fmt: skip
    with pytest.raises(InterventionError, match="include_bos=True"):
        I.head_ablation_hooks(model, [(0, 0)], "mean", [0], reference=ref)


def test_resample_with_the_task_itself_raises():
    """Sample i resampled from reference row i of the same prompts would ablate nothing."""
    model = bos_model("mamba2")
    task = kv(3, 4, 0)
    for positions in ("last", None):
        with pytest.raises(InterventionError, match=r"4 of 4 pairs are the same prompt.*Fix:"):
            I.ablation_sweep(
                model, task, "logit_diff", [(0, 0)], mode="resample", positions=positions,
                reference=task, progress=False,
            )  # fmt: skip
    with pytest.raises(InterventionError, match="same prompt"):
        I.ablation_sweep(
            model, task, "logit_diff", [(0, 0)], mode="resample", reference=_ids(task),
            progress=False,
        )  # fmt: skip
    # One self-pair among others is refused too.
    mixed = dataclasses.replace(task, samples=(task[1], task[0], task[2], task[0]))
    with pytest.raises(InterventionError, match="1 of 4 pairs"):
        I.ablation_sweep(
            model, task, "logit_diff", [(0, 0)], mode="resample", positions="last",
            reference=mixed, progress=False,
        )  # fmt: skip
    # The fix the message names works.
    rotated = dataclasses.replace(task, samples=task.samples[1:] + task.samples[:1])
    res = I.ablation_sweep(
        model, task, "logit_diff", [(0, 0)], mode="resample", positions="last",
        reference=rotated, progress=False,
    )  # fmt: skip
    assert res.effects.abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_ablate_heads_resample_with_the_same_prompts_raises(arch):
    model = bos_model(arch)
    ids = _ids(kv(3, 3, 0))
    for positions in ("last", None):
        with (
            pytest.raises(InterventionError, match="input row 0 is the same prompt"),
            torch.no_grad(),
            I.ablate_heads(model, [(1, 0)], "resample", positions, reference=ids),
        ):
            model(ids)
    with torch.no_grad(), I.ablate_heads(model, [(1, 0)], "resample", reference=ids.roll(1, 0)):
        moved = model(ids)
    with torch.no_grad():
        assert (moved - model(ids)).abs().max() > 1e-4


def test_control_sweep_resamples_a_task_control_from_other_samples():
    """A knowledge-task control in resample mode used to be resampled from itself (no effect)."""
    model = bos_model("mamba2")
    control = kv(3, 4, 1)
    res = I.control_sweep(model, control, [(0, 0), (1, 2)], mode="resample", positions="last",
                          progress=False)  # fmt: skip
    assert res.effects.abs().min() > 1e-5


def test_score_heads_records_what_the_mean_was_taken_over():
    from gna_lens import score_heads
    from gna_lens.testing import toy_gna_model, toy_gna_task

    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=8)
    report = score_heads(model, task, control=None, mode="mean", positions="last", progress=False)
    assert report.method["mean_over"] == "the last (query) token of each reference prompt"
    assert report.method["include_bos"] is False
    zero = score_heads(model, task, control=None, progress=False)
    assert "mean_over" not in zero.method


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_mean_ablation_of_a_left_padded_batch_leaves_its_bos_alone(arch):
    """With left padding the BOS is not in column 0; the hooks find it from hook_embed, so each
    row gets what it gets unpadded."""
    model = bos_model(arch)
    short, long_ = kv(2, 1, 1)[0], kv(3, 1, 2)[0]
    pad = bos_tok().pad_token_id
    n = long_.n_tokens - short.n_tokens
    ids = torch.tensor([[pad] * n + short.input_ids, long_.input_ids])
    mask = (ids != pad).long()
    mask[0, :n] = 0
    ref = kv(4, 5, 5)
    kw = dict(mode="mean", reference=ref)
    with torch.no_grad():
        with I.ablate_heads(model, [(0, 1), (1, 2)], **kw):
            padded = model(ids, attention_mask=mask)
            alone = model(torch.tensor([short.input_ids]))
        with I.ablate_heads(model, [(0, 1), (1, 2)], include_bos=True, **kw):
            with_bos = model(torch.tensor([short.input_ids]))
    assert (padded[0, n:] - alone[0]).abs().max() <= 1e-4
    assert (with_bos - alone).abs().max() > 1e-3  # editing the BOS too is another ablation
