"""Layer interventions: removal equals deleting the block from the HF model, hook hygiene, the
mixer / MLP / mean variants, the pruning protocols, and the coarse-to-fine head scan."""

import copy
import dataclasses

import pytest
import torch
from interventions_helpers import (
    bos_model,
    bos_task,
    bos_tok,
    hand_class_mean,
    hand_columns,
    hook_count,
    model,
    task,
    tok,
    weights,
)

from gna_lens.errors import InterventionError
from gna_lens.interventions import (
    ablate_layers,
    layer_ablation_hooks,
    layer_sweep,
    prune_from_end,
    remove_layers,
)
from gna_lens.interventions.layers import layer_infos
from gna_lens.interventions.metrics import Metric
from gna_lens.models import HookedSSM
from gna_lens.scoring import score_heads
from gna_lens.tasks import TextControl, evaluate
from gna_lens.testing import (
    tiny_hf_model,
    tiny_tokenizer,
    toy_control,
    toy_gna_model,
    toy_gna_task,
)

TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 3, 4], [9, 3, 3, 14, 7, 6, 5, 21, 8, 2]])


def _hf_without(hf, layer: int):
    """A copy of a Hugging Face causal LM with block ``layer`` deleted from its layer list."""
    hf2 = copy.deepcopy(hf)
    base = hf2.model if hasattr(hf2, "model") else hf2.backbone
    base = getattr(base, "decoder", base)  # OPT: model.decoder.layers
    del base.layers[layer]
    hf2.config.num_hidden_layers -= 1
    for i, block in enumerate(base.layers):
        for module in block.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = i
    return hf2


def _pair(arch: str):
    """(hooked model, its Hugging Face model)."""
    if arch in ("llama", "opt"):
        bridge = model(arch)
        return bridge, bridge.original_model
    hf = tiny_hf_model(arch) if arch == "bamba" else tiny_hf_model(arch, num_hidden_layers=3)
    return HookedSSM.from_hf_model(hf, tiny_tokenizer()), hf


@pytest.mark.parametrize("arch", ["llama", "opt", "mamba2", "mamba1", "bamba"])
def test_removed_layer_equals_the_hf_model_with_that_block_deleted(arch):
    m, hf = _pair(arch)
    tokens = TOKENS % m.cfg.d_vocab
    before_w, before_h = weights(m), hook_count(m)
    with torch.no_grad():
        full = hf(tokens, use_cache=False).logits
    for layer in range(m.cfg.n_layers):
        with torch.no_grad():
            expected = _hf_without(hf, layer)(tokens, use_cache=False).logits
            with remove_layers(m, [layer]):
                got = m(tokens)
        assert float((expected - full).abs().max()) > 1e-2  # the layer matters
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    after = weights(m)
    assert all(torch.equal(before_w[k], after[k]) for k in before_w)  # bit-identical
    assert hook_count(m) == before_h


@pytest.mark.parametrize("arch", ["llama", "bamba"])
def test_no_hook_survives_an_exception_and_the_users_hooks_stay(arch):
    m, _ = _pair(arch)
    tokens = TOKENS % m.cfg.d_vocab
    seen = []
    m.add_hook("blocks.0.hook_resid_post", lambda x, hook: seen.append(1))
    before_w, before_h = weights(m), hook_count(m)
    with torch.no_grad():
        clean = m(tokens)
    for target in ("block", "mixer"):
        with pytest.raises(RuntimeError, match="boom"), ablate_layers(m, [0], target=target):
            m(tokens)
            raise RuntimeError("boom")
        assert hook_count(m) == before_h

    def bad_metric(logits, samples):
        raise RuntimeError("metric boom")

    t = task()
    if m.cfg.d_vocab < len(tok()):
        t = None
    if t is not None:
        with pytest.raises(RuntimeError, match="metric boom"):
            layer_sweep(m, t, bad_metric, control=None, progress=False)
        assert hook_count(m) == before_h
    seen.clear()
    with torch.no_grad():
        assert torch.equal(m(tokens), clean)
    assert seen  # the user's own hook still fires
    m.reset_hooks()
    after = weights(m)
    assert all(torch.equal(before_w[k], after[k]) for k in before_w)


def test_mixer_and_mlp_targets():
    mamba2, _ = _pair("mamba2")  # blocks without MLP: zeroing the mixer removes the block
    bamba, _ = _pair("bamba")  # hybrid blocks with an MLP after the mixer
    with torch.no_grad():
        with remove_layers(mamba2, [1]):
            removed = mamba2(TOKENS)
        with ablate_layers(mamba2, [1], target="mixer"):
            no_mixer = mamba2(TOKENS)
        torch.testing.assert_close(no_mixer, removed, atol=1e-6, rtol=0)
        for layer in range(bamba.cfg.n_layers):  # SSM and attention layers alike
            with remove_layers(bamba, [layer]):
                removed = bamba(TOKENS)
            with ablate_layers(bamba, [layer], target="mixer"):
                no_mixer = bamba(TOKENS)
            with (
                ablate_layers(bamba, [layer], target="mixer"),
                ablate_layers(bamba, [layer], target="mlp"),
            ):
                neither = bamba(TOKENS)
            assert float((no_mixer - removed).abs().max()) > 1e-3  # the MLP still runs
            torch.testing.assert_close(neither, removed, atol=1e-5, rtol=0)
    with pytest.raises(InterventionError, match=r"has no MLP.*target='block'"):
        layer_ablation_hooks(mamba2, [0], target="mlp")
    # One-part layers: 'attn' / 'ssm' name the one mixer there is, or refuse.
    with torch.no_grad():
        for layer, part in ((0, "ssm"), (1, "attn")):
            with ablate_layers(bamba, [layer], target="mixer"):
                mixer = bamba(TOKENS)
            with ablate_layers(bamba, [layer], target=part):
                assert torch.equal(bamba(TOKENS), mixer)
    with pytest.raises(InterventionError, match=r"target='attn' at layer 0.*no attention"):
        layer_ablation_hooks(bamba, [0], target="attn")
    with pytest.raises(InterventionError, match=r"target='ssm' at layer 1.*no SSM mixer"):
        layer_ablation_hooks(bamba, [1], target="ssm")
    with pytest.raises(InterventionError, match="one layer"):
        layer_ablation_hooks(mamba2, 0)
    with pytest.raises(InterventionError, match=r"0\.\.2"):
        layer_ablation_hooks(mamba2, [3])


@pytest.mark.parametrize("target", ["block", "mixer"])
def test_mean_mode_adds_the_references_mean_and_last_position_leaves_the_rest(target):
    m, _ = _pair("mamba2")  # resid_post = resid_pre + mixer_out: both targets are the same delta
    reference = torch.tensor([[4, 8, 15, 16, 23, 42], [1, 2, 3, 5, 8, 13]])
    layer = 1
    names = [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.hook_resid_post"]
    with torch.no_grad():
        _, ref_cache = m.run_with_cache(reference, names_filter=names)
        delta = (ref_cache[names[1]] - ref_cache[names[0]]).reshape(-1, m.cfg.d_model).mean(0)
        with ablate_layers(m, [layer], target=target, mode="mean", reference=reference):
            _, cache = m.run_with_cache(TOKENS, names_filter=names)
        got = cache[names[1]] - cache[names[0]]
        torch.testing.assert_close(got, delta.expand_as(got), atol=1e-5, rtol=0)
        _, clean = m.run_with_cache(TOKENS, names_filter=names)
        with ablate_layers(
            m, [layer], target=target, mode="mean", reference=reference, positions="last"
        ):
            _, last = m.run_with_cache(TOKENS, names_filter=names)
    assert torch.equal(last[names[1]][:, :-1], clean[names[1]][:, :-1])
    assert not torch.allclose(last[names[1]][:, -1], clean[names[1]][:, -1])
    with pytest.raises(InterventionError, match="needs reference"):
        layer_ablation_hooks(m, [0], mode="mean")


# ----------------------------------------------------------------------------- mean over a class
def _ids(t) -> torch.Tensor:
    return torch.tensor([s.input_ids for s in t])


def _layer_out(m, layer: int, target: str, ids: torch.Tensor, **ablate) -> torch.Tensor:
    """What ``target`` of ``layer`` holds ``[batch, pos, d_model]`` on a forward of ``ids`` (the
    block: ``resid_post - resid_pre``), under ``ablate_layers(**ablate)`` when given."""
    info = layer_infos(m)[layer]
    names = {
        "block": [info.resid_pre_hook, info.resid_post_hook],
        "mixer": list(info.mixer_hooks),
        "mlp": [info.mlp_hook],
    }[target]
    with torch.no_grad():
        if ablate:
            with ablate_layers(m, [layer], target=target, **ablate):
                _, cache = m.run_with_cache(ids, names_filter=names)
        else:
            _, cache = m.run_with_cache(ids, names_filter=names)
    return cache[names[-1]] - cache[names[0]] if target == "block" else cache[names[0]]


def assert_layer_mean_ablation(m, layer, target, positions, include_bos=False):
    """The ablated quantity holds the hand mean (over the reference prompts' tokens at the
    ablated positions, BOS left out unless include_bos) exactly at the ablated positions, and the
    clean value elsewhere (the BOS column included)."""
    ids, ref = _ids(bos_task(3, 3, 0)), bos_task(4, 5, 5)  # other lengths than the reference
    assert ids[0, 0] == bos_tok().bos_token_id
    kw = {"include_bos": True} if include_bos else {}
    got = _layer_out(m, layer, target, ids, mode="mean", positions=positions, reference=ref, **kw)
    clean = _layer_out(m, layer, target, ids)
    mean = hand_class_mean(
        ref, lambda x: _layer_out(m, layer, target, x), positions, include_bos
    )  # fmt: skip
    cols = hand_columns(ids.shape[1], positions, include_bos)
    torch.testing.assert_close(got[:, cols], mean.expand_as(got[:, cols]), atol=2e-5, rtol=0)
    torch.testing.assert_close(got[:, ~cols], clean[:, ~cols], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("arch", "target"),
    [("mamba2", "block"), ("mamba2", "mixer"), ("llama", "block"), ("llama", "mixer"),
     ("llama", "mlp")],
)  # fmt: skip
@pytest.mark.parametrize("positions", ["last", None, [-2, -1], [1, 2]])
def test_layer_mean_is_over_the_ablated_positions_of_the_reference_without_bos(
    arch, target, positions
):
    assert_layer_mean_ablation(bos_model(arch), 1, target, positions)


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_layer_mean_with_include_bos_averages_over_and_edits_the_bos_too(arch):
    m = bos_model(arch)
    assert_layer_mean_ablation(m, 1, "block", None, include_bos=True)
    assert_layer_mean_ablation(m, 0, "mixer", [0, -1], include_bos=True)


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_layer_mean_with_a_listed_bos_position_raises_unless_include_bos(arch):
    m = bos_model(arch)
    t, ref = bos_task(3, 3, 0), bos_task(4, 5, 5)
    ids = _ids(t)
    kw = dict(mode="mean", reference=ref)
    with pytest.raises(InterventionError, match=r"positions=\[0, -1\] include position 0.*BOS"):
        layer_ablation_hooks(m, [1], positions=[0, -1], **kw)
    # Position -P is BOS in the P-token inputs, not in the longer reference prompts: the hooks
    # find it at run time.
    P = ids.shape[1]
    assert ref[0].n_tokens > P
    with (
        pytest.raises(InterventionError, match=r"column 0, the BOS token of input row 0"),
        torch.no_grad(),
        ablate_layers(m, [1], target="mixer", positions=[-P, -1], **kw),
    ):
        m(ids)
    for sweep in (layer_sweep, prune_from_end):
        with pytest.raises(InterventionError, match="include_bos=True"):
            sweep(m, t, "logit_diff", positions=[-P, -1], control=None, progress=False, **kw)
    with torch.no_grad(), ablate_layers(m, [1], positions=[0, -1], include_bos=True, **kw):
        m(ids)  # allowed when asked


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_layer_sweep_mean_equals_a_hand_made_mean_hook_and_records_the_class(arch):
    """Every sweep path (from the ablated layer's cached residual, or a loop of full forwards)
    adds the hand mean at every position but the BOS, on the task and on the control."""
    m = bos_model(arch)
    t, ref = bos_task(3, 4, 0), bos_task(4, 5, 5)
    control = TextControl(name="bos windows", tokens=_ids(bos_task(2, 3, 7)), source="kv prompts")
    ids = _ids(t)
    kw = dict(mode="mean", reference=ref, control=control, progress=False)
    res = layer_sweep(m, t, "logit_diff", **kw)
    loop = layer_sweep(m, t, "logit_diff", method="loop", **kw)
    torch.testing.assert_close(res.values, loop.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.control_values, loop.control_values, atol=1e-5, rtol=0)
    met, idx = Metric("logit_diff", t), torch.arange(len(t))
    for layer in range(m.cfg.n_layers):
        info = layer_infos(m)[layer]
        mean = hand_class_mean(ref, lambda x, layer=layer: _layer_out(m, layer, "block", x), None)
        pre = {}

        def keep(x, hook, pre=pre):
            pre["x"] = x

        def replace(x, hook, pre=pre, mean=mean):
            x = x.clone()
            x[:, 1:] = pre["x"][:, 1:] + mean  # every position but the BOS
            return x

        hooks = [(info.resid_pre_hook, keep), (info.resid_post_hook, replace)]
        with torch.no_grad(), m.hooks(fwd_hooks=hooks):
            manual = met(m(ids)[:, -1], idx)
        torch.testing.assert_close(res.values[layer], manual, atol=1e-5, rtol=0)
    assert res.effects.abs().max() > 1e-3
    assert res.method["mean_over"] == (
        f"every position of each reference prompt, except a leading BOS (id {bos_tok().bos_token_id})"
    )
    assert res.method["mean_tokens"] == sum(s.n_tokens - 1 for s in ref)
    assert res.method["mean_prompts"] == len(ref)
    assert res.method["bos_excluded"] == len(ref)
    assert res.method["include_bos"] is False and res.method["bos_unedited"] is True
    assert res.method["control_mean_tokens"] == control.tokens[:, :-1].numel() - len(control)
    assert res.method["control_bos_unedited"] is True
    with_bos = prune_from_end(m, t, "logit_diff", include_bos=True, **kw)
    assert with_bos.method["include_bos"] is True and with_bos.method["bos_unedited"] is False
    assert with_bos.method["bos_excluded"] == 0
    assert (with_bos.values[0] - res.values[-1]).abs().max() > 1e-4  # another ablation
    zero = layer_sweep(m, t, "logit_diff", control=None, progress=False)
    assert "mean_over" not in zero.method


def _windows(n: int = 3, length: int = 12) -> TextControl:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tok()), (n, length), generator=gen)
    return TextControl(name="random", tokens=ids, source="random ids")


@pytest.mark.parametrize("arch", ["llama", "bamba"])
def test_layer_sweep_batched_equals_loop_and_direct_evaluation(arch):
    m = model(arch)
    t = task(n_samples=6)
    control = _windows()
    res = layer_sweep(m, t, "logit_diff", control=control, progress=False)
    loop = layer_sweep(m, t, "logit_diff", control=control, method="loop", progress=False)
    assert res.cells == tuple((i,) for i in range(m.cfg.n_layers))
    torch.testing.assert_close(res.values, loop.values, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res.control_values, loop.control_values, atol=1e-4, rtol=1e-4)
    assert float(res.effects.abs().max()) > 1e-3 and float(res.control_effects.abs().max()) > 1e-3
    # Direct: the accuracy of each removal, and the control's loss, recomputed by hand.
    acc = layer_sweep(m, t, "accuracy", control=None, progress=False)
    for layer in range(m.cfg.n_layers):
        with remove_layers(m, [layer]):
            assert acc.values[layer].mean() == evaluate(m, t, progress=False).accuracy
            with torch.no_grad():
                logits = m(control.tokens[:, :-1])[:, -6:]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), control.tokens[:, -6:].reshape(-1),
            reduction="none",
        ).view(len(control), -1).mean(-1)  # fmt: skip
        torch.testing.assert_close(res.control_values[layer], nll, atol=1e-4, rtol=1e-4)
    # Intervals and the method record.
    df = res.to_dataframe()
    assert (df["effect_low"] <= df["effect"] + 1e-9).all()
    assert (df["effect"] <= df["effect_high"] + 1e-9).all()
    assert {"layer", "kind", "effect", "control_effect", "selectivity"} <= set(df.columns)
    for key in ("protocol", "target", "mode", "positions", "metric", "control", "intervals"):
        assert res.method[key], key
    adf = acc.to_dataframe()
    assert ((adf["value_low"] >= 0) & (adf["value_high"] <= 1)).all()  # Wilson
    fig = res.plot()
    assert [list(tr.y) for tr in fig.data] == [list(df["effect"]), list(df["control_effect"])]
    # Other targets, modes and positions: the runner's shortcuts change nothing.
    for kw in (
        dict(target="mlp", mode="mean", reference=t, positions=[0, 3, -1]),
        dict(target="mixer", positions="last"),
        dict(target="block", mode="mean", reference=t, positions=[1, -2]),
    ):
        a = layer_sweep(m, t, "logit_diff", control=control, progress=False, **kw)
        b = layer_sweep(m, t, "logit_diff", control=control, method="loop", progress=False, **kw)
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.control_values, b.control_values, atol=1e-4, rtol=1e-4)
        assert float(a.effects.abs().max()) > 1e-4, kw


def test_ssm_target_refuses_a_mixer_holding_both_kinds_of_heads():
    """A hybrid student's layer mixes attention and SSM heads in one mixer (one hook_mixer_out):
    'ssm' cannot ablate its SSM heads alone and says so; 'mixer' ablates the whole mixer."""
    from gna_lens.heads import head_view
    from gna_lens.hybrid import build_hybrid

    student = build_hybrid(model("llama"), [(0, 1)], d_state=8)
    assert head_view(student)[0].kind == "mixed"
    with pytest.raises(InterventionError, match=r"target='ssm' at layer 0.*attention and SSM"):
        layer_ablation_hooks(student, [0], target="ssm")
    with pytest.raises(InterventionError, match=r"target='attn' at layer 0.*no attention-only"):
        layer_ablation_hooks(student, [0], target="attn")
    assert layer_ablation_hooks(student, [0], target="mixer")
    assert hook_count(student) == 0


def test_individual_removal_on_a_pruned_model_and_gradual_pruning():
    m = model("bamba")  # 3 layers
    t = task(n_samples=6)
    pruned = layer_sweep(m, t, "logit_diff", removed=[2], control=None, progress=False)
    assert pruned.cells == ((0,), (1,))
    alone = layer_sweep(m, t, "logit_diff", layers=[[2], [0, 2], [1, 2]], control=None,
                        progress=False)  # fmt: skip
    torch.testing.assert_close(pruned.baseline, alone.values[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(pruned.values, alone.values[1:], atol=1e-5, rtol=0)
    with pytest.raises(InterventionError, match="also in removed"):
        layer_sweep(m, t, layers=[2], removed=[2], control=None, progress=False)

    steps = prune_from_end(m, t, "logit_diff", control=_windows(), progress=False)
    assert steps.cells == ((2,), (1, 2))  # cumulative, from the last layer back
    torch.testing.assert_close(steps.values[0], alone.values[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(steps.values[1], alone.values[2], atol=1e-5, rtol=0)
    assert steps.method["protocol"] == "gradual pruning from the end"
    assert list(steps.to_dataframe()["layers"]) == ["L2", "L1+L2"]
    with pytest.raises(InterventionError, match="n_steps"):
        prune_from_end(m, t, n_steps=4, control=None, progress=False)


# ----------------------------------------------------------------------------- coarse to fine
def one_layer_retrieval_model():
    """Four layers, one of which carries retrieval: a random SSM layer (output scaled down), the
    toy's Gather head (layer 1), and its Aggregate head twice (layers 2 and 3), each copy alone
    enough to read the answer out. Removing layer 1 breaks retrieval; removing any other does not.
    """
    toy = toy_gna_model()
    cfg = dataclasses.replace(toy.cfg, n_layers=4, layer_types=["ssm"] + ["attention"] * 3)
    torch.manual_seed(0)
    m = HookedSSM(cfg, toy.tokenizer).eval()
    with torch.no_grad():
        for name in ("embed", "unembed", "ln_final"):
            getattr(m, name).load_state_dict(getattr(toy, name).state_dict())
        m.blocks[1].load_state_dict(toy.blocks[0].state_dict())  # Gather head (1, 0)
        m.blocks[2].load_state_dict(toy.blocks[1].state_dict())  # Aggregate head (2, 0)
        m.blocks[3].load_state_dict(toy.blocks[1].state_dict())  # ... and its copy (3, 0)
        m.blocks[0].mixer.out_proj.weight.mul_(0.01)
        m.blocks[0].mlp.down_proj.weight.mul_(0.01)
    return m


def test_layer_ranking_finds_the_layer_that_carries_retrieval_and_the_scan_its_head():
    m = one_layer_retrieval_model()
    t = toy_gna_task(m, n_samples=16)
    assert evaluate(m, t, progress=False).accuracy == 1.0
    acc = layer_sweep(m, t, "accuracy", control=None, progress=False)
    assert acc.values[1].mean() <= 0.25  # chance with 4 pairs
    assert [float(acc.values[i].mean()) for i in (0, 2, 3)] == [1.0, 1.0, 1.0]

    report = score_heads(
        m, t, control=toy_control(m), strategy="coarse_to_fine", top_layers=1, progress=False
    )
    assert report.layers is not None and report.layers.ranking()[0] == (1,)
    effects = report.scores["ablation_effect"]
    measured = {h for h, e in zip(report.heads, effects.tolist(), strict=True) if e == e}
    assert measured == {(1, 0), (1, 1)}  # only the top layer's heads were ablated
    assert report.top(1) == [(1, 0)]
    assert {u.layer for u in report.unmeasured} == {0, 2, 3}
    assert report.n_unmeasured == len(report.heads) - 2
    assert all("ranked" in u.reason and "top_layers=1" in u.reason for u in report.unmeasured)
    assert report.method["strategy"] == "coarse_to_fine" and report.method["n_exact"] == 2
    # The exact scan over every head agrees on the head.
    exact = score_heads(m, t, control=toy_control(m), strategy="exact", progress=False)
    assert exact.top(1, by="ablation_effect") == [(1, 0)] and not exact.unmeasured


def test_strategy_policy(monkeypatch):
    import gna_lens.sweep_policy as report_module

    m = toy_gna_model()
    t = toy_gna_task(m, n_samples=4)
    small = score_heads(m, t, control=None, progress=False, n_examples=0)
    assert small.method["strategy"] == "exact" and small.layers is None  # demo size: exact
    monkeypatch.setattr(report_module, "EXACT_ALL_MAX", 3)  # 4 heads are now "many"
    big = score_heads(m, t, control=None, progress=False, n_examples=0)
    assert big.method["strategy"] == "coarse_to_fine" and big.method["top_layers"] == 1
    attr = score_heads(m, t, control=None, prefilter=2, progress=False, n_examples=0)
    assert attr.method["strategy"] == "attribution" and attr.n_unmeasured == 2
    assert all("attribution" in u.reason for u in attr.unmeasured)
    with pytest.raises(InterventionError, match="strategy="):
        score_heads(m, t, control=None, strategy="fast", progress=False)
    with pytest.raises(InterventionError, match="top_layers"):
        score_heads(m, t, control=None, strategy="exact", top_layers=1, progress=False)
