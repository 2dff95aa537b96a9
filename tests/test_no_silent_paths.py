"""Every edit takes effect or raises; no fallback is silent (issue 17).

Each test here pins one path that used to return a plausible result while dropping what was
asked for: a state edit discarded by a pattern hook, out-of-range rows or layers dropped or
wrapped, masks skipped outside a selection, an editability probe that passed what it could not
check, and shortcut failures swallowed by ``except Exception``.
"""

from types import SimpleNamespace

import pytest
import torch
from interventions_helpers import SSM_ARCHS, other_key, tok
from interventions_helpers import task as make_task
from torch import nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

import gna_lens.interventions as I
from gna_lens.errors import HookError, InterventionError, PatternEditError
from gna_lens.heads import head_view, require_editable
from gna_lens.interventions import engine as _engine
from gna_lens.interventions import hooks
from gna_lens.testing import tiny_hooked_ssm

TOKENS = torch.tensor([[5, 6, 7, 8, 9]])


def _fresh(arch: str = "mamba2"):
    """A model no other test has used: the per-model shortcut verdicts start empty."""
    return tiny_hooked_ssm(arch, vocab_size=len(tok()))


def _zero(x, hook):
    return torch.zeros_like(x)


def _identity(x, hook):
    return x


# ----------------------------------------------------------------------------- state vs pattern
@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
def test_state_edit_together_with_a_pattern_hook_raises(arch):
    m = tiny_hooked_ssm(arch)
    state, pattern = "blocks.0.mixer.hook_ssm_state", "blocks.0.mixer.hook_pattern"
    with torch.no_grad():
        clean = m(TOKENS)
        edited = m.run_with_hooks(TOKENS, fwd_hooks=[(state, _zero)])
        assert (edited - clean).abs().max() > 1e-2  # the state edit alone takes effect
        with pytest.raises(PatternEditError, match=r"hook_ssm_state.*hook_pattern.*separate"):
            m.run_with_hooks(TOKENS, fwd_hooks=[(state, _zero), (pattern, _identity)])

        def zero_in_place(x, hook):
            x.zero_()

        with pytest.raises(PatternEditError, match="hook_ssm_state"):
            m.run_with_hooks(TOKENS, fwd_hooks=[(state, zero_in_place), (pattern, _identity)])
        # Reading both (run_with_cache) edits nothing: allowed, and the output is unchanged.
        logits, cache = m.run_with_cache(TOKENS, names_filter=[state, pattern])
    assert set(cache.keys()) == {state, pattern}
    assert (logits - clean).abs().max() <= 1e-4
    assert not any(hp.fwd_hooks for hp in m.hook_dict.values())


# ----------------------------------------------------------------------------- ranges
def test_pattern_selection_refuses_out_of_range_positions_heads_and_layers():
    m = tiny_hooked_ssm("mamba2")
    name = "blocks.0.mixer.hook_pattern"
    with (
        pytest.raises(InterventionError, match=r"\[99\].*5 positions.*-5 to 4"),
        m.pattern_selection(heads=[0], query_positions=[2, 99]),
    ):
        m.run_with_cache(TOKENS, names_filter=name)
    with pytest.raises(InterventionError, match=r"heads \[8\].*0 to 7"), m.pattern_selection([8]):
        pass
    bamba = tiny_hooked_ssm("bamba")  # layer 1 is attention, layer 7 does not exist
    for layers in ({1: [0]}, {7: [0]}):
        with (
            pytest.raises(InterventionError, match=r"not SSM layers.*\[0, 2\]"),
            bamba.pattern_selection(heads=layers),
        ):
            pass
    # In range: the selection is exactly what was asked for.
    with m.pattern_selection(heads=[0], query_positions=[2, -1]):
        _, cache = m.run_with_cache(TOKENS, names_filter=name)
    assert tuple(cache[name].shape) == (1, 1, 2, 5)


def test_start_and_stop_at_layer_out_of_range_raise():
    m = tiny_hooked_ssm("mamba2")  # 2 layers
    with torch.no_grad():
        for kw in ({"stop_at_layer": 99}, {"stop_at_layer": -3}):
            with pytest.raises(InterventionError, match=r"out of range for this 2-layer model"):
                m(TOKENS, **kw)
        resid = m(TOKENS, stop_at_layer=1)
        with pytest.raises(InterventionError, match="start_at_layer=5"):
            m(resid, start_at_layer=5)
        assert m(resid, start_at_layer=1).shape[:2] == TOKENS.shape


def test_patch_residual_refuses_out_of_range_positions_instead_of_wrapping():
    m = _fresh()
    clean = make_task(n_samples=2)
    length = clean[0].n_tokens
    with pytest.raises(InterventionError, match=rf"position 99 is out of range.*{length} tokens"):
        I.patch_residual(m, clean, other_key(clean), layers=[0], positions=[99], progress=False)


# ----------------------------------------------------------------------------- masks
def test_masks_outside_an_enclosing_pattern_selection_raise():
    m = tiny_hooked_ssm("mamba2")
    keep_self = torch.eye(5, dtype=torch.bool)
    with torch.no_grad():
        hooks = I.pattern_mask_hooks(m, {(0, 0): keep_self})
        with m.pattern_selection(heads=[1]), pytest.raises(PatternEditError, match=r"\(0, 0\)"):
            m.run_with_hooks(TOKENS, fwd_hooks=hooks)
        with (
            m.pattern_selection(heads=[0], query_positions=[-1]),
            pytest.raises(PatternEditError, match=r"rows \[1, 2, 3\]"),
        ):
            m.run_with_hooks(TOKENS, fwd_hooks=hooks)


def test_float_mask_weights_reach_every_row_they_change():
    """mask_patterns materializes every row a float mask scales, not only its zero rows."""
    m = tiny_hooked_ssm("mamba2")
    mask = torch.ones(5, 5)
    mask[2, :2] = 0.5  # scaled, not removed
    mask[4, 0] = 0.0
    name = "blocks.1.mixer.hook_pattern"

    def by_hand(p, hook):
        out = p.clone()
        out[:, 3] = out[:, 3] * mask
        return out

    with torch.no_grad():
        expected = m.run_with_hooks(TOKENS, fwd_hooks=[(name, by_hand)])
        with I.mask_patterns(m, {(1, 3): mask}):
            got = m(TOKENS)
        unmasked_row2 = mask.clone()
        unmasked_row2[2] = 1.0
        with I.mask_patterns(m, {(1, 3): unmasked_row2}):
            without = m(TOKENS)
    assert (without - expected).abs().max() > 1e-6  # row 2's weights matter
    assert (got - expected).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- probe
class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attn()


class TupleOutput(HookedRootModule):
    """Reports its pattern through a hook but computes the output without it, and returns a
    tuple: nothing the probe can compare."""

    def __init__(self):
        super().__init__()
        self.cfg = SimpleNamespace(n_layers=1, n_heads=2, d_head=4, d_vocab=16, device="cpu")
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([_Block()])
        self.setup()

    def forward(self, tokens, stop_at_layer=None):
        x = self.embed(tokens)
        b, L, _ = x.shape
        self.blocks[0].attn.hook_pattern(torch.ones(b, 2, L, L).tril() / L)  # result discarded
        z = self.blocks[0].attn.hook_z(x.view(b, L, 2, 4))
        return (z.reshape(b, L, 8),)


def test_editability_probe_fails_closed_when_it_cannot_compare_outputs():
    m = TupleOutput()
    view = head_view(m)
    assert not view[0].verified
    for target in ("pattern", "z"):
        with pytest.raises(PatternEditError, match=r"cannot be shown to take effect.*tuple"):
            require_editable(m, view, [0], target)
    with pytest.raises(PatternEditError, match="cannot be shown"):
        I.mask_patterns(m, {(0, 0): torch.ones(4, 4, dtype=torch.bool)}).__enter__()


def test_layer_probe_fails_closed_when_it_cannot_compare_outputs():
    """A layer intervention on a model whose output the probe cannot compare is refused."""
    from interventions_helpers import model as helper_model

    from gna_lens.interventions import layers as layers_module

    m = helper_model("llama")
    layers_module._VERDICTS.pop(m, None)
    forward = m.forward
    m.forward = lambda *a, **k: (forward(*a, **k),)  # a tuple: nothing to compare
    try:
        for target in ("mixer", "block"):
            with pytest.raises(PatternEditError, match=r"cannot be shown to take effect.*tuple"):
                _enter(I.ablate_layers(m, [0], target=target))
    finally:
        m.forward = forward
        layers_module._VERDICTS.pop(m, None)  # the refusal is cached per model
    assert not any(h for hp in m.hook_dict.values() for h in hp.fwd_hooks)


_T = make_task(n_samples=2)
_REF = other_key(_T)


def _enter(cm, model=None):
    """Enter and leave ``cm``; with ``model``, run a forward on a task prompt inside it."""
    with torch.no_grad(), cm:
        if model is not None:
            model(torch.tensor([_T[0].input_ids]))


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m, bad: _enter(I.ablate_heads(m, **bad), m), id="ablate_heads"),
        pytest.param(
            lambda m, bad: I.ablation_sweep(m, _T, "logit_diff", progress=False, **bad),
            id="ablation_sweep",
        ),
        pytest.param(
            lambda m, bad: I.control_sweep(m, _T, progress=False, **bad),
            id="control_sweep",
        ),
        pytest.param(
            lambda m, bad: I.patch_heads(m, _T, _REF, progress=False, **bad), id="patch_heads"
        ),
        pytest.param(lambda m, bad: I.attribute_heads(m, _T, **bad), id="attribute_heads"),
    ],
)
@pytest.mark.parametrize(
    "bad, names",
    [
        ({"heads": [(0, 99)]}, "99"),
        ({"heads": [(9, 0)]}, "layer 9"),
        ({"heads": [(0, 0)], "positions": [999]}, "999"),
    ],
    ids=["head", "layer", "position"],
)
def test_out_of_range_heads_layers_and_positions_raise_everywhere(call, bad, names):
    m = _fresh()
    with pytest.raises(InterventionError, match=names):
        call(m, bad)
    assert not any(h for hp in m.hook_dict.values() for h in hp.fwd_hooks)


def test_out_of_range_layers_raise_in_layer_interventions_and_patching():
    m = _fresh()
    with pytest.raises(InterventionError, match="9"):
        _enter(I.ablate_layers(m, [9]))
    with pytest.raises(InterventionError, match="-1"):
        I.patch_residual(m, _T, _REF, layers=[-1], progress=False)
    with pytest.raises(InterventionError, match="999"):
        I.patch_residual(m, _T, _REF, layers=[0], positions=[999], progress=False)
    with pytest.raises(InterventionError, match="layer 9"):
        _enter(I.mask_patterns(m, {(9, 0): torch.eye(4, dtype=torch.bool)}))


# ----------------------------------------------------------------------------- fallbacks
def test_a_bug_inside_a_shortcut_propagates_instead_of_falling_back(monkeypatch):
    m = _fresh()

    def broken(*args, **kwargs):
        raise KeyError("a bug in the expand shortcut")

    monkeypatch.setattr(_engine, "expand_hooks", broken)
    with pytest.raises(KeyError, match="a bug in the expand shortcut"):
        I.ablation_sweep(m, make_task(n_samples=2), "logit_diff", progress=False)
    assert m not in _engine._STRATEGY or not _engine._STRATEGY[m]  # no verdict cached


def test_a_shortcut_that_does_not_apply_is_recorded_on_every_result(monkeypatch):
    m = _fresh()
    t = make_task(n_samples=2)
    heads = [(0, 1), (1, 2)]
    ok = I.ablation_sweep(_fresh("bamba"), t, "logit_diff", heads, progress=False)
    assert {"from_layer", "cells"} <= set(ok.info["paths"]) and ok.info["fallbacks"] == []

    real = _engine.expand_hooks

    def mismatched(*args, **kwargs):
        hooks = real(*args, **kwargs)
        (z_name, read_z), (out_name, _) = hooks

        def expand(out, hook):
            raise RuntimeError("The size of tensor a (8) must match the size of tensor b (1)")

        return [(z_name, read_z), (out_name, expand)]

    monkeypatch.setattr(_engine, "expand_hooks", mismatched)
    first = I.ablation_sweep(m, t, "logit_diff", heads, progress=False)
    loop = I.ablation_sweep(m, t, "logit_diff", heads, method="loop", progress=False)
    assert (first.values - loop.values).abs().max() <= 1e-5
    assert first.info["paths"]["cells"] == ["packed"]
    (why,) = first.info["fallbacks"]
    assert "expanding the cells" in why and "must match the size" in why
    # The verdict is cached per model; later results still say so.
    again = I.ablation_sweep(m, t, "logit_diff", heads, progress=False)
    assert again.info["fallbacks"] == first.info["fallbacks"]
    assert loop.info["paths"]["cells"] == ["loop"]


def test_a_bug_in_the_bridge_kv_cache_path_propagates(monkeypatch):
    import transformers
    from interventions_helpers import model

    class BrokenCache:
        def __init__(self, *args, **kwargs):
            raise ValueError("a bug in the cache")

    monkeypatch.setattr(transformers, "DynamicCache", BrokenCache)
    with pytest.raises(ValueError, match="a bug in the cache"):
        I.ablation_sweep(
            model("llama"), make_task(n_samples=2), "logit_diff", [(0, 1)], positions="last",
            progress=False,
        )  # fmt: skip


def test_a_bridge_without_usable_kv_cache_records_the_fallback(monkeypatch):
    import transformers
    from interventions_helpers import model

    class OldCache:  # a transformers whose DynamicCache takes no config=
        def __init__(self):
            pass

    monkeypatch.setattr(transformers, "DynamicCache", OldCache)
    t = make_task(n_samples=2)
    bridge = model("llama")
    res = I.ablation_sweep(bridge, t, "logit_diff", [(0, 1)], positions="last", progress=False)
    loop = I.ablation_sweep(
        bridge, t, "logit_diff", [(0, 1)], positions="last", method="loop", progress=False
    )
    assert res.method == "batched"
    assert (res.values - loop.values).abs().max() <= 1e-5
    (why,) = [f for f in res.info["fallbacks"] if f.startswith("incremental")]
    assert why.startswith("incremental: full recomputation (DynamicCache(config=...) failed")


def test_hooked_keeps_the_original_error_when_hooks_leak():
    m = _fresh()
    try:
        with pytest.raises(ValueError, match="boom") as err, hooks.hooked(m, []):
            m.add_hook("blocks.0.hook_resid_pre", _identity, is_permanent=True)
            raise ValueError("boom")
        assert any("leaked" in note for note in err.value.__notes__)
        m.reset_hooks(including_permanent=True)
        with pytest.raises(HookError, match="hooks leaked"), hooks.hooked(m, []):
            m.add_hook("blocks.0.hook_resid_pre", _identity, is_permanent=True)
    finally:
        m.reset_hooks(including_permanent=True)


@pytest.mark.parametrize("arch", SSM_ARCHS[2:])
def test_attribution_records_its_path(arch):
    m = _fresh(arch)
    res = I.attribute_heads(m, make_task(n_samples=2), heads=[(0, 0)])
    path = "the model's own forward"
    if m.channel_heads:  # Jamba's Mamba-1 layers: their scan's own backward
        path += "; " + m.ssm_mixers()[0].backward_note
    assert res.info["paths"] == {"gradient": [path]}
    assert res.info["fallbacks"] == []


def test_layer_sweep_records_its_paths_and_a_fallback(monkeypatch):
    """Layer sweeps record which path ran, and a shortcut that does not reproduce the plain
    path is a recorded fallback with its reason, on the task and the control alike."""
    from interventions_helpers import model as helper_model

    from gna_lens.interventions import runner as _runner

    m = helper_model("llama")
    t = make_task(n_samples=2)
    from gna_lens.tasks import text_control

    texts = [tok().decode(s.input_ids) for s in make_task(n_samples=8, seed=5)]  # in-vocab
    control = text_control(tok(), texts, n_sequences=2, seq_len=16)
    monkeypatch.delitem(_runner._INJECT_VERDICT, m, raising=False)
    ok = I.layer_sweep(m, t, control=None, progress=False)
    assert "residual swap" in ok.method["paths"]["from_layer"] and ok.method["fallbacks"] == []

    real = _runner.Runner._inject

    def off_by_one(self, *args, **kwargs):
        return real(self, *args, **kwargs) + 1.0

    monkeypatch.setattr(_runner.Runner, "_inject", off_by_one)
    monkeypatch.delitem(_runner._INJECT_VERDICT, m)
    for control_arg in (None, control):
        bad = I.layer_sweep(m, t, control=control_arg, progress=False)
        loop = I.layer_sweep(m, t, control=control_arg, method="loop", progress=False)
        assert (bad.values - loop.values).abs().max() <= 1e-5  # the plain path was used
        assert bad.method["paths"]["from_layer"] == ["start_at_layer"]
        assert any(
            why.startswith("from_layer: start_at_layer") and "does not reproduce" in why
            for why in bad.method["fallbacks"]
        )
    monkeypatch.delitem(_runner._INJECT_VERDICT, m)


def test_the_knowledge_table_carries_the_sweeps_paths_and_fallbacks(monkeypatch):
    from gna_lens import retrieval_vs_knowledge

    m = _fresh()
    t = make_task(n_samples=2)
    ok = retrieval_vs_knowledge(m, [(0, 1)], {"kv": t}, random_draws=1, progress=False)
    assert ok.method["paths"]["kv"]["cells"] and ok.method["fallbacks"] == []

    real = _engine.expand_hooks

    def mismatched(*args, **kwargs):
        (z_name, read_z), (out_name, _) = real(*args, **kwargs)

        def expand(out, hook):
            raise RuntimeError("The size of tensor a (8) must match the size of tensor b (1)")

        return [(z_name, read_z), (out_name, expand)]

    monkeypatch.setattr(_engine, "expand_hooks", mismatched)
    m = _fresh()
    table = retrieval_vs_knowledge(m, [(0, 1)], {"kv": t}, random_draws=1, progress=False)
    assert table.after == ok.after
    (why,) = table.method["fallbacks"]
    assert why.startswith("kv: cells:") and "must match the size" in why


@pytest.mark.parametrize("slow", ["expand", "packed"])
def test_the_strategy_probe_reruns_packed_only_when_that_could_change_the_choice(slow, monkeypatch):
    """The probe times packed once; a second packed timing (it can only favour packed) runs only
    when expand looked faster, so a process does not redo a chunk of cells it already chose."""
    m = _fresh()
    calls = {"packed": 0}
    real_packed, real_expanded = _engine._LayerRun.packed, _engine._LayerRun.expanded
    clock = {"t": 0.0}
    monkeypatch.setattr(_engine.time, "perf_counter", lambda: clock["t"])

    def packed(self, chunk, share=True):
        calls["packed"] += 1
        lg, _ = real_packed(self, chunk, share)
        clock["t"] += 100.0 if slow == "packed" else 0.001
        return lg, 100.0 if slow == "packed" else 0.001

    def expanded(self, W, chunk, r):
        lg, _ = real_expanded(self, W, chunk, r)
        clock["t"] += 100.0 if slow == "expand" else 0.001
        return lg, 100.0 if slow == "expand" else 0.001

    monkeypatch.setattr(_engine._LayerRun, "packed", packed)
    monkeypatch.setattr(_engine._LayerRun, "expanded", expanded)
    heads = [(0, h) for h in range(4)]
    res = I.ablation_sweep(m, make_task(n_samples=2), "logit_diff", heads, pack=4, progress=False)
    assert res.info["expanded"] == (slow == "packed")
    # packed won: one packed run of the 4 cells, kept; expand won: timed twice, then expanded
    assert calls["packed"] == (1 if slow == "expand" else 2)


def test_a_sharded_sweep_checks_edits_in_the_workers_not_twice(monkeypatch):
    """With an executor the caller does not probe its own copy (serial time of every sharded
    sweep); each worker's plan of the job does, on the copy it edits, and raises the same error."""
    from interventions_helpers import model as helper_model

    from gna_lens import heads as heads_mod
    from gna_lens.interventions import ablation
    from gna_lens.tasks import text_control

    m = helper_model("llama")  # a TransformerBridge: its layers are probed
    texts = [tok().decode(s.input_ids) for s in make_task(n_samples=8, seed=5)]
    control = text_control(tok(), texts, n_sequences=2, seq_len=16)
    probed = []
    real = ablation.require_editable
    monkeypatch.setattr(
        ablation, "require_editable", lambda *a, **k: probed.append(a[2]) or real(*a, **k)
    )

    class InProcess:  # what a worker does: plan the job again on its copy, run the cells
        def run_sweep(self, model, job, sweep, bar=None):
            probed.append("worker")
            return ablation.plan_job(model, job).run()

    t = make_task(n_samples=2)
    for sweep in (
        lambda ex: I.ablation_sweep(m, t, "logit_diff", [(0, 1)], progress=False, executor=ex),
        lambda ex: I.control_sweep(m, control, [(0, 1)], progress=False, executor=ex),
    ):
        probed.clear()
        sweep(InProcess())
        assert probed == ["worker", [0]]  # the caller did not probe; the worker's plan did
        probed.clear()
        sweep(None)
        assert probed == [[0]]
    monkeypatch.setitem(heads_mod._VERDICTS, m, {(1, "z"): "would be silently ignored: test"})
    with pytest.raises(PatternEditError, match=r"layer 1: head-output edits .* test"):
        I.ablation_sweep(m, t, "logit_diff", [(1, 0)], progress=False, executor=InProcess())
