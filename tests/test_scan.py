"""gna-lens scan: the report it writes, the table and JSON of the CLI, and its errors."""

import json

import pytest

from gna_lens.cli import TABLE_COLUMNS, main
from gna_lens.errors import TaskError
from gna_lens.scan import build_tasks, scan
from gna_lens.testing import TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD, toy_gna_model


@pytest.fixture
def toy_scan(monkeypatch):
    """``gna-lens scan`` on the hand-built G&A model, fed its own task (it retrieves in its own
    template, not in the KV question template)."""
    from gna_lens import scan as scan_module
    from gna_lens.testing import toy_gna_task

    model = toy_gna_model()
    monkeypatch.setattr(
        scan_module,
        "build_tasks",
        lambda tok, task, n_samples, seed: (
            toy_gna_task(model, n_samples=n_samples, seed=seed),
            {"kv-4": toy_gna_task(model, n_samples=n_samples, seed=seed)},
        ),
    )
    monkeypatch.setattr(scan_module, "load_scan_model", lambda name: model)
    return model


def test_scan_ranks_heads_and_writes_offline_reports(tmp_path, toy_scan):
    result = scan(toy_scan, "kv", n_samples=8, top=2, out=tmp_path, progress=False, command="test")
    assert set(result.top) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    df = result.knowledge.to_dataframe()
    assert df.loc[0, "before"] == 1.0 and df.loc[0, "after"] <= 0.5
    page = result.html_path.read_text()
    assert "heatmap" in page and "CircuitsVis" in page and "Retrieval vs knowledge" in page
    assert "cdn.jsdelivr" not in page and "unpkg.com" not in page
    data = json.loads(result.json_path.read_text())
    assert data["command"] == "test" and len(data["top"]) == 2


def test_scan_prefilters_by_attribution_then_ablates_exactly(tmp_path, toy_scan):
    result = scan(toy_scan, "kv", n_samples=8, top=2, exact=2, out=None, progress=False)
    effects = result.report.scores["ablation_effect"]
    assert int((~effects.isnan()).sum()) == 2 == result.n_exact  # only the prefiltered heads
    assert set(result.top) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    assert not bool(result.report.scores["attribution"].isnan().any())


def test_scan_cli_prints_the_table_and_json(tmp_path, toy_scan, capsys):
    out = tmp_path / "report"
    args = ["scan", "toy", "--n-samples", "8", "--top", "2", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.split()[:2] == ["layer", "head"])
    # "attribution" is dropped when every head was ablated exactly (toy model: 16 heads).
    assert header.split() == [c for c in TABLE_COLUMNS if c != "attribution"]
    assert "Retrieval vs knowledge" in text and "kv-4" in text
    assert (out / "report.html").is_file()

    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # nothing but the JSON on stdout
    assert {"top", "heads", "baseline", "retrieval_vs_knowledge", "timings", "n_exact"} <= set(data)
    assert [tuple(h) for h in data["top"]] in (
        [TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD],
        [TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD],
    )
    assert {"layer", "head", "kind", "ablation_effect", "gather_score"} <= set(data["heads"][0])


def test_scan_cli_unknown_model_names_it_and_the_fix(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    assert main(["scan", missing]) == 2
    err = capsys.readouterr().err
    assert missing in err and "no model config found" in err and "zoo name" in err
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

    monkeypatch.setattr(scan_module, "load_scan_model", lambda name: toy_gna_model())
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
