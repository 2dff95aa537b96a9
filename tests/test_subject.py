"""The model's architecture questions are asked once per call and the answer is handed down.

``Subject.of(model)`` builds the head view and the device policy; every public function takes a
model or a Subject; ``score_heads`` (patterns, layer and head sweeps, control, joint walk,
examples) builds them once.
"""

import pytest
import torch
from interventions_helpers import model as helper_model
from interventions_helpers import task as helper_task

import gna_lens.heads as heads_module
from gna_lens import device as device_module
from gna_lens import score_heads
from gna_lens.heads import HookedModel, Subject
from gna_lens.interventions import ablation_sweep, layer_sweep, patch_heads
from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task


@pytest.fixture
def counted(monkeypatch):
    """Counts of head_view and DevicePolicy.of calls."""
    calls = {"head_view": 0, "policy": 0}
    real_view = heads_module.head_view
    real_policy = device_module.DevicePolicy.of.__func__

    def view(model):
        calls["head_view"] += 1
        return real_view(model)

    def policy(cls, model):
        calls["policy"] += 1
        return real_policy(cls, model)

    monkeypatch.setattr(heads_module, "head_view", view)
    monkeypatch.setattr(device_module.DevicePolicy, "of", classmethod(policy))
    return calls


@pytest.mark.parametrize("strategy", ["exact", "coarse_to_fine"])
def test_score_heads_builds_the_view_and_the_policy_once(counted, strategy):
    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=8)
    control = toy_control(model)
    counted.update(head_view=0, policy=0)
    top_layers = 1 if strategy == "coarse_to_fine" else None
    report = score_heads(
        model, task, control=control, strategy=strategy, top_layers=top_layers, progress=False
    )
    assert report.method["strategy"] == strategy
    assert counted == {"head_view": 1, "policy": 1}, counted


def test_a_subject_is_taken_wherever_a_model_is_and_gives_the_same_numbers(counted):
    model = helper_model("bamba")
    task = helper_task(n_samples=4)
    subject = Subject.of(model)
    assert Subject.of(subject) is subject
    counted.update(head_view=0, policy=0)
    by_subject = ablation_sweep(subject, task, "logit_diff", progress=False)
    layers = layer_sweep(subject, task, "logit_diff", control=None, progress=False)
    assert counted == {"head_view": 0, "policy": 0}, counted  # nothing asked again
    by_model = ablation_sweep(model, task, "logit_diff", progress=False)
    assert torch.equal(by_subject.values, by_model.values)
    assert torch.equal(
        layers.values, layer_sweep(model, task, "logit_diff", control=None, progress=False).values
    )
    patched = patch_heads(subject, task, task, "logit_diff", heads=[(0, 0)], progress=False)
    torch.testing.assert_close(patched.values[0], patched.clean_baseline)


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_bridges_and_hooked_ssms_are_hooked_models(arch):
    assert isinstance(helper_model(arch), HookedModel)
    assert not isinstance("gpt2", HookedModel)
    with pytest.raises(Exception, match="head_view got a str"):
        Subject.of("gpt2")  # type: ignore[arg-type]


def test_functions_that_run_the_model_take_a_subject_too():
    """``evaluate``, ``mask_experiment`` and ``prefix_matching_scores`` called the Subject itself
    as the model (or read its tokenizer from it) before they were typed ``ModelLike``."""
    from gna_lens.scoring import mask_experiment, prefix_matching_scores
    from gna_lens.tasks import evaluate

    model = helper_model("bamba")
    task = helper_task(n_samples=4)
    subject = Subject.of(model)
    a, b = evaluate(subject, task, progress=False), evaluate(model, task, progress=False)
    assert torch.equal(a.correct, b.correct)
    gathers, aggregates = [(0, 0)], [(1, 0)]
    assert mask_experiment(subject, task, gathers, aggregates) == mask_experiment(
        model, task, gathers, aggregates
    )
    by_subject = prefix_matching_scores(subject, n_tokens=8, n_samples=2, progress=False)
    by_model = prefix_matching_scores(model, n_tokens=8, n_samples=2, progress=False)
    assert torch.equal(by_subject.prefix_matching, by_model.prefix_matching)


def test_report_examples_show_the_tokens_not_their_ids():
    """The report's example patterns are labelled by the tokenizer's tokens (the pipeline hands
    the Subject down; reading the tokenizer off it gave none, and ids as labels)."""
    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=8)
    report = score_heads(model, task, control=toy_control(model), progress=False)
    want = [model.tokenizer.decode([i]) for i in task[0].input_ids]
    assert report.examples["tokens"] == want and not want[0].isdigit()


def test_context_managers_take_a_subject_too():
    """``ablate_layers`` entered the Subject's hooks (it has none) before the types said so."""
    from gna_lens.interventions import ablate_heads, ablate_layers

    model = helper_model("bamba")
    subject = Subject.of(model)
    tokens = torch.tensor([[5, 6, 7, 8]], device=subject.device)
    task = helper_task(n_samples=4)
    with torch.no_grad():
        with ablate_layers(model, [1], target="mixer"):
            want = model(tokens)
        with ablate_layers(subject, [1], target="mixer"):
            got = model(tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        with ablate_heads(model, [(0, 0)], mode="mean", reference=task):
            want = model(tokens)
        with ablate_heads(subject, [(0, 0)], mode="mean", reference=task):
            got = model(tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
