"""gna-lens scan: the report it writes and its errors."""

import json

import pytest

from gna_lens.cli import main
from gna_lens.errors import TaskError
from gna_lens.scan import build_tasks, scan
from gna_lens.testing import TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD, toy_gna_model


def test_scan_ranks_heads_and_writes_offline_reports(tmp_path, monkeypatch):
    from gna_lens import scan as scan_module
    from gna_lens.testing import toy_gna_task

    model = toy_gna_model()
    # The toy model retrieves in its own template: feed scan its task.
    monkeypatch.setattr(
        scan_module,
        "build_tasks",
        lambda tok, task, n_samples, seed: (
            toy_gna_task(model, n_samples=n_samples, seed=seed),
            {"kv-4": toy_gna_task(model, n_samples=n_samples, seed=seed)},
        ),
    )
    result = scan(model, "kv", n_samples=8, top=2, out=tmp_path, progress=False, command="test")
    assert set(result.top) == {TOY_GATHER_HEAD, TOY_AGGREGATE_HEAD}
    df = result.knowledge.to_dataframe()
    assert df.loc[0, "before"] == 1.0 and df.loc[0, "after"] <= 0.5
    page = result.html_path.read_text()
    assert "heatmap" in page and "CircuitsVis" in page and "Retrieval vs knowledge" in page
    assert "cdn.jsdelivr" not in page and "unpkg.com" not in page
    data = json.loads(result.json_path.read_text())
    assert data["command"] == "test" and len(data["top"]) == 2


def test_scan_cli_errors_are_clear(tmp_path, capsys):
    assert main(["scan", str(tmp_path / "no-such-model")]) == 2
    assert "no model config" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TaskError, match=r"empty|no records"):
        build_tasks(toy_gna_model().tokenizer, str(empty))
    with pytest.raises(TaskError, match="not 'kv', 'mc' or an existing file"):
        build_tasks(toy_gna_model().tokenizer, "nonsense")
