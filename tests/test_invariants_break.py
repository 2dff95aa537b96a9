"""The core invariants' checks can fail: each test breaks one step of the code on purpose
(monkeypatching it) and shows that the same helper the real test uses raises AssertionError.

- parity with Hugging Face (tests/test_hooked_ssm.py, ``assert_matches_hf``): the Mamba-2 scan
  forgets the state carried between chunks;
- an edit moves the logits (tests/test_interventions.py, ``assert_ablation_takes_effect``): the
  ablation hook returns its input unchanged;
- sweep == loop (``assert_sweep_equals_loop``): the sweep skips one head;
- no hook left after an exception (``assert_model_untouched``): hook removal skips one hook.
"""

import contextlib

import pytest
import torch
from interventions_helpers import model, tokens
from interventions_helpers import task as make_task
from test_hooked_ssm import PARITY_ATOL, _hf_reference, assert_matches_hf
from test_interventions import (
    _loop_reference,
    assert_ablation_takes_effect,
    assert_model_untouched,
    assert_sweep_equals_loop,
    model_state,
)

import gna_lens.interventions as I
from gna_lens.interventions import ablation, engine
from gna_lens.models import HookedSSM, ops
from gna_lens.testing import tiny_checkpoint


# ----------------------------------------------------------------------------- parity
@pytest.fixture(scope="module")
def mamba2_pair(tmp_path_factory):
    path = tiny_checkpoint(
        "mamba2", tmp_path_factory.mktemp("m2"), seed=3, n_groups=2, chunk_size=8
    )
    return _hf_reference(path), HookedSSM.from_pretrained(str(path))


def _logits(pair):
    hf, ours = pair
    tokens = torch.randint(2, 320, (2, 40), generator=torch.Generator().manual_seed(40))
    with torch.no_grad():
        return ours(tokens), hf(tokens).logits


def test_parity_check_passes_on_the_real_scan(mamba2_pair):
    assert_matches_hf(*_logits(mamba2_pair), "real scan")


def test_parity_check_fires_when_the_scan_drops_the_carried_state(mamba2_pair, monkeypatch):
    real = ops.mamba2_ssd

    def chunks_forget_the_past(x, dt, A, B, C, chunk_size):
        """Each chunk scanned alone: the term carrying the state across chunks is dropped."""
        parts = [
            real(x[:, s : s + chunk_size], dt[:, s : s + chunk_size], A,
                 B[:, s : s + chunk_size], C[:, s : s + chunk_size], chunk_size)
            for s in range(0, x.shape[1], chunk_size)
        ]  # fmt: skip
        return torch.cat(parts, dim=1)

    monkeypatch.setattr(ops, "mamba2_ssd", chunks_forget_the_past)
    with pytest.raises(AssertionError, match="max abs logit difference"):
        assert_matches_hf(*_logits(mamba2_pair), "broken scan")


def test_parity_check_fires_on_a_tiny_error_just_above_the_bound(mamba2_pair):
    ours, ref = _logits(mamba2_pair)
    bump = torch.zeros_like(ours)
    bump[0, 7, 11] = 2 * PARITY_ATOL
    with pytest.raises(AssertionError):
        assert_matches_hf(ours + bump, ref, "one logit off by 2e-5")


# ----------------------------------------------------------------------------- edit effect
@pytest.mark.parametrize("arch", ["llama", "mamba2", "bamba"])
def test_edit_check_fires_when_the_ablation_hook_is_a_no_op(arch, monkeypatch):
    m = model(arch)
    ids = tokens(make_task())
    assert_ablation_takes_effect(m, [(0, 1), (1, 2)], ids)  # the real hook passes

    def no_op_hook(*args, **kwargs):
        return lambda z, hook: z

    monkeypatch.setattr(ablation, "_ablation_hook", no_op_hook)
    with pytest.raises(AssertionError, match="moved the logits by only"):
        assert_ablation_takes_effect(m, [(0, 1), (1, 2)], ids)


# ----------------------------------------------------------------------------- sweep == loop
@pytest.mark.parametrize("arch", ["llama", "bamba"])
def test_sweep_check_fires_when_the_sweep_skips_a_head(arch, monkeypatch):
    m = model(arch)
    t = make_task()
    loop, _ = _loop_reference(m, t, "zero", None, None)
    real = engine.run_cells  # what every planned sweep (CellSweep.run) calls

    def skip_second_cell(runner, cells, *args, **kwargs):
        cells = list(cells)
        cells[1] = ()  # the sweep forgets to ablate this head
        return real(runner, cells, *args, **kwargs)

    monkeypatch.setattr(engine, "run_cells", skip_second_cell)
    res = I.ablation_sweep(m, t, "logit_diff", progress=False)
    with pytest.raises(AssertionError, match="differs from the loop"):
        assert_sweep_equals_loop(res.values, loop)


# ----------------------------------------------------------------------------- no hook left
@pytest.mark.parametrize("arch", ["llama", "bamba"])
def test_hook_check_fires_when_removal_skips_a_hook(arch, monkeypatch):
    m = model(arch)
    t = make_task()

    @contextlib.contextmanager
    def leaky(model, fwd_hooks):
        *removed, kept = list(fwd_hooks)
        model.add_hook(*kept)  # never removed
        with model.hooks(fwd_hooks=removed):
            yield model

    monkeypatch.setattr(ablation, "hooked", leaky)
    before = model_state(m)
    try:
        with pytest.raises(RuntimeError, match="user code failed"):  # noqa: SIM117
            with I.ablate_heads(m, [(0, 1), (1, 0)], mode="mean", reference=t):
                raise RuntimeError("user code failed")
        with pytest.raises(AssertionError, match=r"hook\(s\) left on the model"):
            assert_model_untouched(m, before)
    finally:
        m.reset_hooks(including_permanent=True)
