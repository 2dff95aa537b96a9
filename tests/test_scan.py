"""gna-lens scan: the report it writes, the table and JSON of the CLI, and its errors."""

import json

import pytest

from gna_lens.cli import TABLE_COLUMNS, main
from gna_lens.errors import ConfigError, TaskError
from gna_lens.runtime import override_speed_probe
from gna_lens.scan import ScanTasks, build_tasks, scan
from gna_lens.testing import (
    TOY_AGGREGATE_HEAD,
    TOY_GATHER_HEAD,
    TOY_GENERIC_HEAD,
    toy_control,
    toy_gna_model,
    toy_gna_task,
)


@pytest.fixture
def toy_scan(monkeypatch):
    """``gna-lens scan`` on the hand-built G&A model with its generic head, fed its own task (it
    retrieves in its own template, not in the KV question template) and its own control."""
    from gna_lens import scan as scan_module

    model = toy_gna_model(generic_head=True)

    def tasks(tok, task, n_samples, seed, n_eval=8, **kv):
        return ScanTasks(
            toy_gna_task(model, n_samples=n_samples, seed=seed),
            {"kv-4": toy_gna_task(model, n_samples=n_eval, seed=seed + 1)},
            control_select=toy_control(model, seed=seed),
            control_eval=toy_control(model, seed=seed + 1),
        )

    monkeypatch.setattr(scan_module, "build_tasks", tasks)
    monkeypatch.setattr(scan_module, "load_scan_model", lambda name, **kw: model)
    return model


def test_scan_ranks_retrieval_heads_leaves_out_the_generic_one_and_writes_reports(
    tmp_path, toy_scan
):
    result = scan(
        toy_scan, "kv", n_samples=8, top=2, out=tmp_path, progress=False, command="test",
        random_draws=3,
    )  # fmt: skip
    assert set(result.top) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    assert [e.head for e in result.excluded] == [TOY_GENERIC_HEAD]
    assert "max_control" in result.excluded[0].reason
    row = result.knowledge.rows[0]
    assert row.before.value == 1.0 and row.after.value <= 0.5 and row.after.high < row.before.low
    # Random sets match the top heads' layers (one head from layer 0, one from layer 1); a draw
    # that picks the generic head breaks retrieval, one of zero-weight heads does not.
    sets = result.knowledge.random_sets
    assert len(sets) == 3 and all(sorted(layer for layer, _ in s) == [0, 1] for s in sets)
    expected = [0.0 if TOY_GENERIC_HEAD in s else 1.0 for s in sets]
    assert list(row.random_draws) == expected
    assert row.random_after is not None
    assert row.random_after.value == pytest.approx(sum(expected) / 3)
    assert result.knowledge.control is not None
    assert abs(result.knowledge.control.change.value) < 0.1  # G&A heads do not touch the control
    page = result.html_path.read_text()
    assert "heatmap" in page and "CircuitsVis" in page and "Retrieval vs knowledge" in page
    assert "Left out as generic" in page and f"L{TOY_GENERIC_HEAD[0]}H{TOY_GENERIC_HEAD[1]}" in page
    assert "cdn.jsdelivr" not in page and "unpkg.com" not in page
    data = json.loads(result.json_path.read_text())
    assert data["command"] == "test" and len(data["top"]) == 2
    assert data["method"]["mode"] == "zero" and data["method"]["positions"] == "all"
    assert data["method"]["selection_prompts"] == 8
    assert data["excluded"][0]["head"] == "L0H2"
    assert data["held_out"]["rows"][0]["after"]["high"] == pytest.approx(row.after.high)


def test_scan_prefilters_by_attribution_then_ablates_exactly(tmp_path, toy_scan):
    result = scan(
        toy_scan, "kv", n_samples=8, top=2, exact=3, out=None, progress=False, random_draws=0
    )
    effects = result.report.scores["ablation_effect"]
    assert int((~effects.isnan()).sum()) == 3 == result.n_exact  # only the prefiltered heads
    assert set(result.top) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    assert not bool(result.report.scores["attribution"].isnan().any())


def _kv_world():
    """A word tokenizer covering the KV templates and a small word list, and a tiny model."""
    from gna_lens.tasks import load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer
    from gna_lens.testing import tiny_hooked_ssm

    words = load_words()[:40]
    tok = word_tokenizer(
        [
            "Below is a list of key-value pairs. What is the value for key ? :",
            "Memorize the following dictionary: The value of the key ' is",
            " ".join(words),
        ],
        bos=True,
    )
    model = tiny_hooked_ssm("mamba2", vocab_size=len(tok))
    model.tokenizer = tok
    return model, tok, words


def test_scan_held_out_prompts_are_disjoint_from_the_selection_prompts(tmp_path):
    model, tok, _ = _kv_world()
    sets = build_tasks(tok, "kv", n_samples=12, seed=0, n_pairs=2, n_eval=40)
    chosen = {s.prompt for s in sets.selection}
    assert len(chosen) > 1
    for name, task in sets.held_out.items():
        assert len(task) > 0
        assert not chosen & {s.prompt for s in task}, name
    # With 2 pairs over 40 words, some seed-1 prompts repeat seed-0 ones: they are dropped.
    raw = {s.prompt for s in __import__("gna_lens").tasks.kv_retrieval(
        tok, n_pairs=2, n_samples=40, seed=1, template="question", values="words")}  # fmt: skip
    assert len(sets.held_out["kv-2"]) == len(raw - chosen) or len(raw & chosen) == 0
    # the induction-proof template is measured held out too (issue 39): copying cannot answer it
    assert sets.held_out["kv-2-facts"].info["template"] == "facts"
    assert "induction-proof" in sets.notes["facts_template"]
    result = scan(
        model, "kv", n_samples=12, n_eval=40, top=2, out=None, progress=False, control=None,
        random_draws=2, force=True,  # random weights: at chance
    )  # fmt: skip
    assert result.tasks is not None
    selection = {s.prompt for s in result.tasks.selection}
    for task in result.tasks.held_out.values():
        assert not selection & {s.prompt for s in task}
    assert result.report.method["selection_prompts"] == 12
    assert "no control was measured: the ranking is not retrieval-specific." in result.warnings


def test_scan_cli_prints_the_table_and_json(tmp_path, toy_scan, capsys):
    from gna_lens.models.provenance import Provenance, attach

    prov = Provenance(
        "smollm2-135m", "gguf", "gguf", location="/x/m.Q4_1.gguf", quantization="Q4_1",
        files=(("m.Q4_1.gguf", "c0" * 32),), dtype="float32", conversion="dequantized to float32",
    )  # fmt: skip
    attach(toy_scan, prov)
    out = tmp_path / "report"
    args = [
        "scan",
        "toy",
        "--n-samples",
        "8",
        "--top",
        "2",
        "--out",
        str(out),
        "--random-draws",
        "2",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.split()[:2] == ["layer", "head"])
    # "attribution" is dropped when every head was ablated exactly (toy model: 6 heads).
    assert header.split() == [c for c in TABLE_COLUMNS if c != "attribution"]
    assert "Held-out prompts" in text and "kv-4" in text and "random heads" in text
    assert "Left out as generic" in text and "L0H2" in text
    assert f"\nWeights: {prov.describe()}\n" in text  # which weights were measured
    page = (out / "report.html").read_text()
    assert f"Weights files: m.Q4_1.gguf (sha256 {'c0' * 32})" in page
    assert "Weights: smollm2-135m: m.Q4_1.gguf (Q4_1 GGUF file, sha256 c0c0c0c0c0c0" in page

    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # nothing but the JSON on stdout
    assert {"top", "heads", "baseline", "held_out", "timings", "n_exact", "method"} <= set(data)
    assert data["provenance"]["quantization"] == "Q4_1"
    assert data["held_out"]["method"]["provenance"] == data["provenance"]
    assert [tuple(h) for h in data["top"]] in (
        [TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD],
        [TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD],
    )
    assert {"layer", "head", "kind", "ablation_effect", "gather_score"} <= set(data["heads"][0])


def test_scan_cli_unknown_model_names_it_and_the_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out is made before loading
    missing = str(tmp_path / "no-such-model")
    assert main(["scan", missing]) == 2
    err = capsys.readouterr().err
    assert missing in err and "no such folder" in err and "zoo name" in err
    assert main(["scan", "zoo-no-such"]) == 2
    err = capsys.readouterr().err
    assert "zoo-no-such" in err and "zoo-llama" in err  # lists the zoo's names


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "BertForMaskedLM"),
        ({"model_type": "no-such-arch", "architectures": ["NoSuchForCausalLM"]}, "no-such-arch"),
    ],
)
def test_scan_cli_unsupported_architecture_is_refused_clearly(tmp_path, capsys, config, expected):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["scan", str(folder)]) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and expected in err and "decoder-only causal LM" in err


def test_scan_task_errors_name_the_input_and_the_fix(tmp_path):
    tokenizer = toy_gna_model().tokenizer
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TaskError, match=r"no records.*--task kv"):
        build_tasks(tokenizer, str(empty))
    with pytest.raises(TaskError, match="not 'kv', 'mc' or an existing file"):
        build_tasks(tokenizer, "nonsense")


def test_scan_cli_empty_task_file_exits_cleanly(tmp_path, monkeypatch, capsys):
    from gna_lens import scan as scan_module

    monkeypatch.setattr(scan_module, "load_scan_model", lambda name, **kw: toy_gna_model())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["scan", "toy", "--task", str(empty), "--out", str(tmp_path)]) == 2
    assert str(empty) in capsys.readouterr().err


def test_train_zoo_passes_its_own_flags_through(monkeypatch):
    import gna_lens.zoo.train as train

    seen = []
    monkeypatch.setattr(train, "train_zoo_main", lambda argv: seen.append(list(argv)) or 0)
    assert main(["train-zoo", "--steps", "3", "--help", "zoo-llama"]) == 0
    assert seen == [["--steps", "3", "--help", "zoo-llama"]]


@pytest.mark.parametrize("task", ["kv", "mc"])
def test_zoo_held_out_sets_share_no_prompt_with_the_selection_or_the_control_selection(task):
    from gna_lens import zoo

    tok = zoo.load("zoo-llama").tokenizer
    sets = zoo.scan_tasks(tok, task, n_samples=24, n_eval=48)
    assert sets.control_select is not None and sets.control_eval is not None
    used = {s.prompt for s in sets.selection} | {s.prompt for s in sets.control_select}
    for name, held in sets.held_out.items():
        assert len(held) > 0 and not used & {s.prompt for s in held}, name
    assert not {s.prompt for s in sets.control_eval} & used
    assert "cloze-eval" in sets.control_eval.name


@pytest.mark.parametrize("argv", [["zoo-llama"], ["zoo-llama", "--task", "mc"], ["my-model"]])
def test_scan_cli_gives_a_zoo_model_its_own_splits_and_others_none(monkeypatch, tmp_path, argv):
    """The scan does not know the zoo: the CLI passes a zoo model's prompts as tasks=."""
    from gna_lens import cli, scan, zoo

    seen = {}

    def fake_scan(model, task, **kw):
        seen.update(kw, task=task)
        raise ConfigError("stop here")

    monkeypatch.setattr(scan, "scan", fake_scan)
    if argv[0] == "my-model":  # any other model: loaded as usual (here a stand-in)
        monkeypatch.setattr(scan, "load_scan_model", lambda name, **kw: zoo.load("zoo-llama"))
        built = ScanTasks(toy_gna_task(toy_gna_model(), n_samples=4), {})
        monkeypatch.setattr(scan, "build_tasks", lambda *a, **kw: seen.update(build=kw) or built)
    args = ["scan", *argv, "--n-samples", "20", "--n-eval", "10", "--out", str(tmp_path)]
    assert cli.main(args) == 2
    if argv[0] != "zoo-llama":  # the task flags' defaults: question template, 6 pairs, words
        assert seen["tasks"] is built
        assert seen["build"] == dict(n_eval=10, values="words", n_pairs=6, template="question")
        return
    tok = zoo.load("zoo-llama").tokenizer
    want = zoo.scan_tasks(tok, seen["task"], n_samples=20, n_eval=10)
    got = seen["tasks"]
    assert [s.prompt for s in got.selection] == [s.prompt for s in want.selection]
    assert len(got.selection) == 20 and all(len(t) == 10 for t in got.held_out.values())
    assert got.control_select is not None and "zoo" in got.notes


def test_scan_cli_coarse_to_fine_above_the_exact_limit_says_what_it_never_measured(
    tmp_path, toy_scan, capsys, monkeypatch
):
    import gna_lens.sweep_policy as report_module

    monkeypatch.setattr(report_module, "EXACT_ALL_MAX", 4)  # the toy's 6 heads are now "many"
    verdicts = []
    check = report_module.check_bfloat16

    def recorded(model, task, n=8):
        verdicts.append(check(model, task, n))
        return verdicts[-1]

    monkeypatch.setattr(report_module, "check_bfloat16", recorded)
    out = tmp_path / "report"
    args = ["scan", "toy", "--n-samples", "8", "--top", "1", "--out", str(out)]
    # Large now, so sweep_dtype="auto" times bfloat16 against float32 on the model: reported 2x
    # faster here whatever this CPU does, so this branch runs on every machine.
    with override_speed_probe((0.02, 0.01)):
        assert main([*args, "--random-draws", "2"]) == 0
    text = capsys.readouterr().out
    # Removing layer 0 breaks the control too (the generic head): layer 1 ranks first.
    assert "coarse to fine: the heads of the top 1 of 2 layers" in text
    assert "Layers ranked by removal" in text and "Heads never measured: 3 of 6" in text
    assert "L0 (3 heads): layer ranked 2 of 2 by layer removal" in text
    page = (out / "report.html").read_text()
    assert "Layer ranking (coarse stage)" in page and "Heads never measured (3 of 6)" in page
    assert "strategy coarse_to_fine" in page
    data = json.loads((out / "report.json").read_text())
    assert data["method"]["strategy"] == "coarse_to_fine" and data["n_exact"] == 3
    # bfloat16 measured faster, then checked on the clean logit differences: the hand-built toy
    # passes (its attention runs fused, accumulating in float32).
    choice = data["method"]["sweep_dtype_choice"]
    ((ok, words),) = verdicts
    assert ok and choice.startswith(
        "auto: bfloat16 autocast, because bfloat16 autocast 2.00x faster than float32"
    ), choice
    assert f"; checked: {words}" in choice and "the model is large (6 heads, more than 4)" in choice
    assert data["method"]["sweep_dtype"] == "bfloat16 (autocast)"
    assert data["method"]["sweep_dtype_probe"]["speedup"] == 2.0
    assert "sweep dtype auto: bfloat16 autocast" in text
    assert [(u["layer"], u["head_indices"]) for u in data["unmeasured"]] == [(0, [0, 1, 2])]
    assert [r["layer"] for r in data["layer_ranking"]] == [1, 0]
    assert [r["scanned"] for r in data["layer_ranking"]] == [True, False]
    assert all(h["ablation_effect"] is None for h in data["heads"] if h["layer"] == 0)
    assert data["top"] == [[1, 0]]

    # bfloat16 measured slower (a CPU without native bfloat16, e.g. an AVX2-only EPYC): float32,
    # the report says what was measured, and no accuracy check is spent on it.
    with override_speed_probe((0.01, 0.105)):
        assert main([*args, "--random-draws", "0", "--strategy", "exact"]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    choice = data["method"]["sweep_dtype_choice"]
    assert choice.startswith(
        "auto: float32, because bfloat16 autocast 10.50x slower than float32 (forward of 16 x "
    ), choice
    assert "selection tokens, last-position logits on cpu: 10.0 ms vs 105.0 ms" in choice
    assert data["method"]["sweep_dtype"] == "float32" and len(verdicts) == 1
    assert "sweep dtype auto: float32, because bfloat16 autocast 10.50x slower" in text

    # A model that fails the check is swept in float32 although bfloat16 is faster.
    monkeypatch.setattr(report_module, "check_bfloat16", lambda m, t, n=8: (False, "moved by 9"))
    with override_speed_probe((0.02, 0.01)):
        assert main([*args, "--random-draws", "0", "--strategy", "exact"]) == 0
    text = capsys.readouterr().out
    assert "Heads never measured" not in text and "Heads ablated exactly: 6 of 6" in text
    data = json.loads((out / "report.json").read_text())
    choice = data["method"]["sweep_dtype_choice"]
    assert choice.startswith("auto: float32, because bfloat16 fails the check (moved by 9)"), choice
    assert data["method"]["sweep_dtype"] == "float32" and "sweep dtype auto: float32" in text


@pytest.fixture
def mamba1_scan(monkeypatch):
    """``gna-lens scan`` on a tiny random Mamba-1 (2 layers of 64 channels) that counts as large:
    EXACT_ALL_MAX is 100 (< its 128 single-channel heads) and the auto block size 16."""
    import torch
    from interventions_helpers import model as tiny_model
    from interventions_helpers import task as make_task
    from interventions_helpers import tok

    import gna_lens.sweep_policy as report_module
    from gna_lens import scan as scan_module
    from gna_lens.tasks import TextControl

    m = tiny_model("mamba1")
    ids = [tok().convert_tokens_to_ids(w) for w in ("apple", " river", " stone", " is", ":")]
    gen = torch.Generator().manual_seed(0)
    control = TextControl(
        name="word-chains", tokens=torch.tensor(ids)[torch.randint(5, (8, 12), generator=gen)],
        source="random chains of the test words", split="all",
    )  # fmt: skip

    def tasks(tok_, task, n_samples, seed, n_eval=8, **kv):
        return ScanTasks(
            make_task(n_pairs=4, n_samples=n_samples, seed=seed),
            {"kv-4": make_task(n_pairs=4, n_samples=n_eval, seed=seed + 1)},
            control_select=control,
            control_eval=control,
        )

    monkeypatch.setattr(scan_module, "build_tasks", tasks)
    monkeypatch.setattr(scan_module, "load_scan_model", lambda name, **kw: m)
    monkeypatch.setattr(report_module, "EXACT_ALL_MAX", 100)
    monkeypatch.setattr(report_module, "DEFAULT_CHANNEL_GROUP", 16)
    with override_speed_probe((0.02, 0.01)):  # bfloat16 "2x faster", whatever this CPU does
        yield m


def test_scan_groups_a_large_mamba1_into_channel_blocks_by_default_and_says_so(
    tmp_path, mamba1_scan, capsys
):
    out = tmp_path / "report"
    args = ["scan", "tiny-mamba1", "--n-samples", "4", "--n-eval", "4", "--top", "2", "--force"]
    assert main([*args, "--random-draws", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    groups = (
        "Mamba-1 channel groups as heads: layer 0: 4 blocks of 16 channels; "
        "layer 1: 4 blocks of 16 channels"
    )
    assert f"Heads: {groups}" in text
    assert "head groups auto: 128 single-channel heads is more than EXACT_ALL_MAX (100)" in text
    assert "Heads ablated exactly: 8 of 8" in text  # 8 groups: every one exact
    data = json.loads((out / "report.json").read_text())
    assert data["method"]["head_groups"] == groups and data["method"]["head_group_size"] == 16
    assert "with model.head_groups(16)" in data["method"]["head_groups_choice"]
    assert data["method"]["strategy"] == "exact" and data["n_exact"] == 8
    # A short sweep keeps float32 (estimated where bfloat16 is native, else not probed at all).
    assert data["method"]["sweep_dtype_choice"].startswith(
        ("auto: float32 (8 heads: a small model)", "auto: float32 (a short sweep: estimated")
    ), data["method"]["sweep_dtype_choice"]
    assert len(data["heads"]) == 8 and data["layer_heads"] == [4, 4]
    assert all(0 <= h < 4 for _, h in data["top"])
    assert set(data["timings_heads"]) >= {"pattern_scores", "ablation_sweep", "control_sweep"}
    page = (out / "report.html").read_text()
    assert "4 blocks of 16 channels" in page and "head groups auto" in page
    assert mamba1_scan.head_group_spec == {}  # grouped for the scan only

    # An explicit block size, and single channels (then coarse to fine: 128 > 100 heads).
    assert main([*args, "--random-draws", "0", "--out", str(out), "--head-groups", "32"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["method"]["head_group_size"] == 32 and data["layer_heads"] == [2, 2]
    assert main([*args, "--random-draws", "0", "--out", str(out), "--head-groups", "none"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert "head_groups" not in data["method"] and data["layer_heads"] == [64, 64]
    assert data["method"]["strategy"] == "coarse_to_fine" and data["n_exact"] == 64
    # 128 heads > 100: sweep_dtype="auto" sweeps in bfloat16 (native here), after its check.
    assert data["method"]["sweep_dtype"] == "bfloat16 (autocast)"
    choice = data["method"]["sweep_dtype_choice"]
    assert choice.startswith("auto: bfloat16 autocast, because bfloat16 autocast 2.00x faster")
    assert "the model is large (128 heads, more than 100)" in choice
    assert "; checked: clean logit difference" in choice


def test_score_heads_groups_a_large_mamba1_by_default(mamba1_scan):
    from interventions_helpers import task as make_task

    from gna_lens import score_heads

    t = make_task(n_pairs=4, n_samples=4)
    report = score_heads(mamba1_scan, t, control=None, progress=False, n_examples=1)
    assert report.layer_heads == (4, 4) and report.method["head_group_size"] == 16
    assert report.method["strategy"] == "exact" and mamba1_scan.head_group_spec == {}
    with mamba1_scan.head_groups(8):  # groups of its own: kept, nothing chosen
        own = score_heads(mamba1_scan, t, ablation=False, control=None, progress=False)
    assert own.layer_heads == (8, 8) and "head_groups_choice" not in own.method
    plain = score_heads(
        mamba1_scan, t, ablation=False, control=None, progress=False, head_groups=None
    )
    assert plain.layer_heads == (64, 64) and "head_groups" not in plain.method


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5", "16x"])
def test_scan_cli_head_groups_rejects_what_is_not_auto_none_or_a_block_size(value, capsys):
    with pytest.raises(SystemExit) as err:
        main(["scan", "x", "--head-groups", value])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert f"argument --head-groups: {value!r}: expected 'auto'" in msg
    assert "'none' (single channels) or a positive int block size" in msg


def test_scan_cli_head_groups_the_model_refuses_is_a_clear_error(tmp_path, mamba1_scan, capsys):
    args = [
        "scan",
        "tiny-mamba1",
        "--n-samples",
        "4",
        "--n-eval",
        "4",
        "--out",
        str(tmp_path),
        "--force",
    ]
    assert main([*args, "--head-groups", "48"]) == 2
    err = capsys.readouterr().err
    assert "gna-lens scan: error: set_head_groups: block size 48" in err
    assert "does not divide d_inner=64" in err


def test_scan_head_groups_on_a_model_without_channel_heads_is_refused(tmp_path, toy_scan, capsys):
    assert main(["scan", "toy", "--out", str(tmp_path), "--head-groups", "16"]) == 2
    err = capsys.readouterr().err
    assert "head_groups=16 on a" in err and "channel groups are for Mamba-1" in err
