"""The offline code blocks of the recipe pages run, and say what the page says they print."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_rank_heads_recipe_toy_blocks_run_and_match_their_comments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks("recipes/rank_heads.md")
    offline = [b for b in blocks if "smollm2" not in b]
    assert len(offline) == 2
    scope: dict = {}
    exec(compile("\n".join(offline), "rank_heads.md", "exec"), scope)
    report, table = scope["report"], scope["table"]
    assert sorted(report.top(2)) == [(0, 0), (1, 0)]
    assert report.top(1, by="ablation_effect") == [(0, 2)]
    assert "max_control" in report.excluded(2)[0].reason
    assert (tmp_path / "toy_report.html").is_file()
    row = table.rows[0]
    assert row.after.high < row.before.low
    # 2 of the toy's 6 heads removed: 6 distinct pairs of the other 4, all drawn, and said so.
    assert len(set(table.random_sets)) == 6 and "only 6 possible" in table.method["random_sets"]


def test_ablate_a_head_recipe_blocks_run_and_the_mean_is_the_last_token_mean(tmp_path, monkeypatch):
    """The worked example of the ablation modes runs and prints what the page says."""
    import contextlib
    import io

    monkeypatch.chdir(tmp_path)
    blocks = [b for b in _blocks("recipes/ablate_a_head.md") if "head_groups" not in b]
    assert len(blocks) == 3
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n".join(blocks), "ablate_a_head.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[-2:] == ["True", "the last (query) token of each reference prompt"]
    assert float(lines[0]) == 1.0  # the toy model retrieves every key before the ablation


def test_layers_recipe_blocks_run_and_match_their_comments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks("recipes/layers.md")
    assert len(blocks) == 5
    scope: dict = {}
    exec(compile("\n".join(blocks), "layers.md", "exec"), scope)
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["1.0", "0.25"]
    assert scope["sweep"].ranking() == [(1,), (0,)]
    assert scope["steps"].cells == ((1,),)
    report = scope["report"]
    assert report.top(1) == [(1, 0)]
    assert out[-1].startswith("L0 (3 heads): layer ranked 2 of 2 by layer removal")
    # Two-part layers: the whole mixer is not its attention part alone.
    assert (scope["no_mixer"] - scope["no_attn"]).abs().max() > 1e-4


def test_channel_groups_recipe_block_runs_and_prints_what_it_says(capsys):
    blocks = [b for b in _blocks("recipes/ablate_a_head.md") if "head_groups" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "ablate_a_head.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["4", "True", "64"]


def test_adding_a_family_page_shows_the_shipped_family_module():
    """The worked example is the FalconMamba module as shipped, and Mamba's weight names."""
    from gna_lens.models.families import falcon_mamba, mamba

    blocks = _blocks("adding_a_family.md")
    assert blocks[0] == Path(falcon_mamba.__file__).read_text(encoding="utf-8")
    assert blocks[1] in Path(mamba.__file__).read_text(encoding="utf-8")


def test_hybrids_page_blocks_run_and_print_what_the_page_says(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks("hybrids.md")
    assert len(blocks) == 4  # the student; swap_heads; swap_layers; swap_teacher_heads
    for block in blocks:
        exec(compile(block, "hybrids.md", "exec"), {})
        printed = capsys.readouterr().out.splitlines()
        comments = [line[2:] for line in block.splitlines() if line.startswith("# ")]
        assert printed == comments


def test_hybrid_aggregate_recipe_runs_offline_on_every_hybrid_family(tmp_path, monkeypatch, capsys):
    """The offline blocks run on tiny random models of the five families and print what the page
    says; the Colab block names a real checkpoint of each family and reads only attributes the
    report has."""
    import ast

    from gna_lens.scoring import GnaReport

    monkeypatch.chdir(tmp_path)
    blocks = _blocks("recipes/hybrid_aggregate.md")
    offline = [b for b in blocks if "load_model(" not in b]
    (colab,) = [b for b in blocks if "load_model(" in b]
    assert len(offline) == 4
    scope: dict = {}
    exec(compile("\n".join(offline), "hybrid_aggregate.md", "exec"), scope)
    out = capsys.readouterr().out.splitlines()
    models = scope["models"]
    assert set(models) == {"zamba2", "falcon_h1", "nemotron_h", "granitemoehybrid", "jamba"}
    assert out[0] == "zamba2 {'attention': 12, 'ssm': 40}"
    assert out[4] == "jamba {'attention': 8, 'ssm': 192}"
    best = scope["best"]
    assert set(best) == {"attention", "ssm"} and all(len(h) == 2 for h in best.values())
    view = scope["gna_lens"].head_view(scope["model"])
    assert all(view.kind_of(h) == kind for kind, heads in best.items() for h in heads)
    assert str(best) in out  # the comment's value
    assert all(0.0 <= a <= 1.0 for a in scope["accuracy"].values())
    assert out[-2:] == ["attention True", "ssm True"]
    # The Colab block: valid Python, one checkpoint per family in the page's table.
    ast.parse(colab)
    text = (DOCS / "recipes/hybrid_aggregate.md").read_text(encoding="utf-8")
    for name in ("Zyphra/Zamba2-1.2B", "Zyphra/Zamba2-2.7B", "Zyphra/Zamba2-7B",
                 "tiiuae/Falcon-H1-0.5B", "nvidia/Nemotron-H-8B", "ibm-granite/granite-4.0-h-tiny",
                 "ai21labs/AI21-Jamba-Mini"):  # fmt: skip
        assert name in text, name
    fields = GnaReport.__dataclass_fields__
    assert {"heads", "kinds"} <= set(fields)


def test_llama_vs_llamba_recipe_offline_block_runs_and_prints_what_it_says(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks("recipes/llama_vs_llamba.md")
    offline = [b for b in blocks if "tiny_checkpoint" in b]
    assert len(offline) == 1 and len(blocks) == 4  # load; swap layer 17; state sizes; offline
    exec(compile(offline[0], "llama_vs_llamba.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed == [line[2:] for line in offline[0].splitlines() if line.startswith("# ")]
