"""The control that tells retrieval heads from generic ones, and the intervals every number
carries: control texts, the control sweep (batched == loop), specificity, Wilson/bootstrap."""

import dataclasses
import math

import pytest
import torch

from gna_lens.errors import GnaLensError, InterventionError, TaskError
from gna_lens.interventions import control_sweep
from gna_lens.scoring import resolve_control, score_heads
from gna_lens.scoring.report import specificity
from gna_lens.stats import bootstrap_interval, draws_interval, wilson_interval
from gna_lens.sweep_policy import sweep_precision
from gna_lens.tasks import PROSE_SOURCE, TextControl, load_prose, text_control
from gna_lens.testing import (
    tiny_checkpoint,
    tiny_hooked_ssm,
    tiny_tokenizer,
    toy_control,
    toy_gna_model,
    toy_gna_task,
)


def test_shipped_prose_is_long_enough_and_has_its_licence():
    from importlib import resources

    text = load_prose()
    assert len(text.split()) > 30_000  # >= 20k tokens for any BPE
    notice = resources.files("gna_lens").joinpath("data/prose/NOTICE.md").read_text()
    assert "public domain" in notice.lower() and "Persuasion" in notice
    assert resources.files("gna_lens").joinpath("data/prose/LICENSE-janeaustenr.txt").is_file()


def test_text_control_windows_are_disjoint_between_select_and_eval():
    tok = tiny_tokenizer()
    sel = text_control(tok, n_sequences=6, seq_len=32, split="select", max_unknown=1.0)
    ev = text_control(tok, n_sequences=6, seq_len=32, split="eval", max_unknown=1.0)
    assert sel.tokens.shape == ev.tokens.shape == (6, 32)
    half = sel.info["stream_tokens"] // 2
    assert max(sel.info["starts"]) + 32 <= half <= min(ev.info["starts"])
    assert sel.source == PROSE_SOURCE and "select" in sel.describe()


def test_text_control_takes_texts_lists_and_datasets():
    from datasets import Dataset

    tok = tiny_tokenizer()
    text = "the quick brown fox jumps over the lazy dog. " * 60
    a = text_control(tok, text, n_sequences=2, seq_len=16, max_unknown=1.0, split="all")
    b = text_control(tok, [text], n_sequences=2, seq_len=16, max_unknown=1.0, split="all")
    c = text_control(
        tok, Dataset.from_dict({"text": [text]}), n_sequences=2, seq_len=16, max_unknown=1.0,
        split="all",
    )  # fmt: skip
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, c.tokens)
    with pytest.raises(TaskError, match="'text' column"):
        text_control(tok, Dataset.from_dict({"a": ["x"], "b": ["y"]}), max_unknown=1.0)


def test_text_control_errors_name_the_input_and_the_fix():
    model = toy_gna_model()  # a word tokenizer: prose is mostly <unk>
    with pytest.raises(TaskError, match=r"unknown token.*knowledge task.*zoo") as err:
        text_control(model.tokenizer)
    assert "Persuasion" in str(err.value)
    with pytest.raises(TaskError, match="windows of"):
        text_control(tiny_tokenizer(), "just a few words", max_unknown=1.0)
    with pytest.raises(TaskError, match="n_sequences"):
        text_control(tiny_tokenizer(), n_sequences=0)
    with pytest.raises(TaskError, match="split"):
        text_control(tiny_tokenizer(), split="test")  # type: ignore[arg-type]
    with pytest.raises(GnaLensError, match="expected 'prose', None"):
        resolve_control(3.5, tiny_tokenizer())


def test_resolve_control_uses_one_prediction_windows_for_last_position_ablation():
    tok = tiny_tokenizer()
    assert resolve_control(None, tok) is None
    ctrl = toy_control(toy_gna_model())
    assert resolve_control(ctrl, tok) is ctrl
    text = "the quick brown fox jumps over the lazy dog. " * 400
    all_pos = resolve_control(text, tok)
    last = resolve_control(text, tok, positions="last")
    assert isinstance(all_pos, TextControl) and isinstance(last, TextControl)
    assert len(last) > len(all_pos)


def _models(tmp_path):
    from gna_lens import load_model

    yield "llama", load_model(str(tiny_checkpoint("llama", tmp_path / "llama")))
    for arch in ("mamba1", "mamba2", "bamba"):
        yield arch, tiny_hooked_ssm(arch)


@pytest.mark.parametrize(
    ("mode", "positions"), [("zero", None), ("mean", None), ("resample", [1, -2]), ("zero", "last")]
)
def test_control_sweep_equals_the_loop_of_single_ablations(tmp_path, mode, positions):
    """The batched control sweep (runs from the ablated layer, logits of the scored positions
    only, or the incremental last-token path) gives the numbers of one full forward per cell."""
    for arch, model in _models(tmp_path):
        ctrl = text_control(model.tokenizer, n_sequences=3, seq_len=20, max_unknown=1.0)
        heads = [(0, 1), (1, 2), [(0, 0), (1, 1)]]
        kw = dict(mode=mode, positions=positions, progress=False)
        fast = control_sweep(model, ctrl, heads, **kw)
        loop = control_sweep(model, ctrl, heads, method="loop", **kw)
        assert fast.metric == "nll" and fast.values.shape == (3, 3)
        assert (fast.values - loop.values).abs().max() <= 1e-4, arch
        assert (fast.baseline - loop.baseline).abs().max() <= 1e-5, arch
        assert fast.effects.abs().max() > 1e-4, arch  # the ablations do something
        if positions == "last":
            assert fast.method == "incremental"


def test_control_loss_is_the_plain_next_token_loss(tmp_path):
    """The control's baseline is the cross-entropy of the scored tokens under a plain forward."""
    model = tiny_hooked_ssm("mamba2")
    ctrl = text_control(model.tokenizer, n_sequences=2, seq_len=12, max_unknown=1.0)
    res = control_sweep(model, ctrl, [(0, 0)], progress=False)
    with torch.no_grad():
        logits = model(ctrl.tokens[:, :-1])
    k = res.info["n_scored"]
    ce = torch.nn.functional.cross_entropy(
        logits[:, -k:].reshape(-1, logits.shape[-1]), ctrl.tokens[:, -k:].reshape(-1),
        reduction="none",
    ).view(2, k).mean(-1)  # fmt: skip
    assert torch.allclose(res.baseline, ce, atol=1e-5)


def test_the_control_loss_in_blocks_of_rows_equals_one_block_bit_for_bit(monkeypatch):
    """The next-token loss runs NLL_ROWS rows at a time (a whole pack's log-softmax ran out of
    cache): the same numbers as one block, to the bit, on a pack that splits unevenly."""
    from gna_lens.interventions import ablation

    model = tiny_hooked_ssm("mamba2")
    ctrl = text_control(model.tokenizer, n_sequences=3, seq_len=12, max_unknown=1.0)
    heads = [(0, 0), (1, 2)]
    monkeypatch.setattr(ablation, "NLL_ROWS", 10**9)
    whole = control_sweep(model, ctrl, heads, progress=False)
    monkeypatch.setattr(ablation, "NLL_ROWS", 4)  # rows per pack are a multiple of 6 here
    blocks = control_sweep(model, ctrl, heads, progress=False)
    assert whole.info["n_scored"] == 6 and torch.equal(blocks.values, whole.values)
    assert torch.equal(blocks.baseline, whole.baseline) and whole.effects.abs().max() > 1e-4


def test_control_sweep_refuses_what_it_cannot_measure():
    model = tiny_hooked_ssm("mamba2")
    one = text_control(model.tokenizer, n_sequences=1, seq_len=12, max_unknown=1.0)
    with pytest.raises(InterventionError, match="one window cannot be resampled"):
        control_sweep(model, one, [(0, 0)], mode="resample", progress=False)
    with pytest.raises(InterventionError, match="n_scored"):
        control_sweep(model, one, [(0, 0)], n_scored=12, progress=False)
    with pytest.raises(InterventionError, match="TextControl"):
        control_sweep(model, "prose", [(0, 0)], progress=False)  # type: ignore[arg-type]


def test_a_knowledge_task_is_a_control_in_nats_among_its_choices():
    """A Task control reports the answer's NLL among its choices: mass that moves from the
    choices to the rest of the vocabulary is no knowledge effect."""
    from gna_lens.interventions import ablation_sweep

    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=6)
    ctrl = control_sweep(model, task, [(1, 0)], progress=False)
    lp = ablation_sweep(model, task, "choice_logprob", [(1, 0)], progress=False)
    assert ctrl.metric == "nll"
    assert torch.allclose(ctrl.values, -lp.values) and float(ctrl.effects[0]) > 1.0
    # choice_logprob is the log-softmax over the choices' logits at the query position.
    sample = task[0]
    with torch.no_grad():
        logits = model(torch.tensor([sample.input_ids]))[0, sample.query_position]
    ids = [c[0] for c in sample.choice_ids]
    expected = logits[ids].log_softmax(-1)[sample.answer_index]
    assert float(lp.baseline[0]) == pytest.approx(float(expected), abs=1e-4)
    full = ablation_sweep(model, task, "logprob", [(1, 0)], progress=False)
    # The vocabulary holds at least the choices' mass: full-vocabulary log-probs are lower.
    assert bool((full.values <= lp.values + 1e-6).all()) and bool((full.values < lp.values).any())


def test_specificity_puts_both_effects_in_one_currency():
    s = specificity(
        torch.tensor([-1.0, -1.0, 0.3, -1.0, math.nan]), 2.0,
        torch.tensor([0.0, math.log(2), 0.0, 5.0, 0.0]),
    )  # fmt: skip
    # r = 0.5 of the baseline; c = 1 - exp(-0.693) = 0.5 of the per-token probability.
    assert s[0] == 1.0 and s[1] == pytest.approx(0.5) and math.isnan(float(s[2]))
    assert s[3] < 0.35 and math.isnan(float(s[4]))


def test_resample_with_the_task_itself_is_refused_and_without_one_rotates():
    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=4)
    with pytest.raises(InterventionError, match="reference is the task itself"):
        score_heads(model, task, mode="resample", reference=task, control=None, progress=False)
    one = dataclasses.replace(task, samples=task.samples[:1])
    with pytest.raises(InterventionError, match="has 1; expected at least 2 prompts"):
        score_heads(model, one, mode="resample", control=None, progress=False)


def test_bfloat16_sweeps_are_recorded_and_close_to_float32():
    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=8)
    kw = dict(control=toy_control(model), progress=False, n_examples=0)
    exact = score_heads(model, task, **kw)
    fast = score_heads(model, task, sweep_dtype="bfloat16", **kw)
    assert exact.method["sweep_dtype"] == "float32"
    assert fast.method["sweep_dtype"] == "bfloat16 (autocast)"
    assert sorted(fast.top(2)) == sorted(exact.top(2))
    a, b = exact.scores["ablation_effect"], fast.scores["ablation_effect"]
    assert 0 < (a - b).abs().max() <= 0.05 * a.abs().max()  # rounded, but not another ranking
    with pytest.raises(GnaLensError, match="sweep_dtype"), sweep_precision(model, "float16"):
        pass


def test_wilson_interval_matches_known_values():
    iv = wilson_interval(37, 48)  # 77.1%: the interval of SmolLM2's held-out KV accuracy
    assert (round(iv.low, 3), round(iv.high, 3)) == (0.635, 0.867)
    assert wilson_interval(0, 48).low == 0.0 and wilson_interval(48, 48).high == 1.0
    assert wilson_interval(48, 48).low < 0.93  # 48/48 is not certainty
    assert math.isnan(wilson_interval(0, 0).value)
    with pytest.raises(GnaLensError, match="successes"):
        wilson_interval(5, 4)


def test_bootstrap_intervals_cover_the_mean_and_shrink_with_n():
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(20, generator=gen) + 1.0
    large = torch.randn(2000, generator=gen) + 1.0
    a, b = bootstrap_interval(small), bootstrap_interval(large)
    assert a.low < a.value < a.high and b.low < 1.0 < b.high  # type: ignore[union-attr]
    assert (b.high - b.low) < (a.high - a.low) / 5  # type: ignore[union-attr]
    rows = bootstrap_interval(torch.stack([small, small + 10]))
    assert isinstance(rows, list) and rows[1].value == pytest.approx(rows[0].value + 10)
    assert bootstrap_interval(torch.tensor([3.0])).method == "none"  # type: ignore[union-attr]
    d = draws_interval([0.7, 0.75, 0.8, 0.72, 0.78, 0.74, 0.76, 0.73, 0.79, 0.71])
    assert d.n == 10 and d.low < d.value < d.high


def test_sweeps_in_shared_clean_runs_reuse_one_clean_run_and_give_the_same_numbers(tmp_path):
    """Inside shared_clean_runs, control sweeps on the same windows run the clean forward once
    (every layer's residual kept) and give exactly the numbers of separate sweeps."""
    from gna_lens.interventions.engine import shared_clean_runs

    for arch, model in _models(tmp_path):
        ctrl = text_control(model.tokenizer, n_sequences=3, seq_len=20, max_unknown=1.0)
        cells = [[(1, 2)], [(0, 1), (1, 0)], [(1, 1)]]
        alone = [control_sweep(model, ctrl, [c], progress=False) for c in cells]
        with shared_clean_runs():
            shared = [control_sweep(model, ctrl, [c], progress=False) for c in cells]
        for a, b in zip(alone, shared, strict=True):
            assert torch.equal(a.values, b.values) and torch.equal(a.baseline, b.baseline), arch
        forwards = [r.info["forwards"] for r in shared]
        assert forwards[1:] == [f - 1 for f in (r.info["forwards"] for r in alone[1:])], arch


def test_the_pack_tuner_starts_at_start_rows_and_doubles_while_faster():
    """Cells per pass start at START_ROWS rows whatever the prompts per cell (8 cells of 48
    prompts were 384 rows, where the CPU's caches no longer hold a pass), then double while the
    time per cell-layer drops by more than 10%; a pinned size is kept."""
    from gna_lens.interventions.engine import START_ROWS, PackTuner

    tuner = PackTuner(None)
    assert tuner.size(cap=100, rows_per_cell=48) == max(1, START_ROWS // 48)
    tuner = PackTuner(None)
    k = tuner.size(cap=100, rows_per_cell=16)
    assert k == START_ROWS // 16
    tuner.report(k, seconds=1.0 * k, work=k, cap=100)  # 1 s per cell
    assert tuner.size(100, 16) == 2 * k
    tuner.report(2 * k, seconds=0.5 * 2 * k, work=2 * k, cap=100)  # twice as fast: go on
    assert tuner.size(100, 16) == 4 * k
    tuner.report(4 * k, seconds=0.5 * 4 * k, work=4 * k, cap=100)  # no faster: back and stop
    assert tuner.done and tuner.size(100, 16) == 2 * k
    assert PackTuner(8).size(cap=2, rows_per_cell=48) == 8
