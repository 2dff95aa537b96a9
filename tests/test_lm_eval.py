"""lm-evaluation-harness backed by gna_lens: parity with lm-eval's own ``hf`` backend, per-item
equality with :func:`gna_lens.tasks.evaluate` under ablation, no hook left behind, the table."""

import json
import math
import re

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the optional extra gna-lens[lmeval]")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import gna_lens.lm_eval as gl  # noqa: E402
from gna_lens.errors import ConfigError, InterventionError  # noqa: E402
from gna_lens.interventions import ablate_heads, aggregate_mask, mask_patterns  # noqa: E402
from gna_lens.interventions.hooks import count_hooks  # noqa: E402
from gna_lens.tasks import evaluate, multiple_choice  # noqa: E402
from gna_lens.testing import tiny_checkpoint  # noqa: E402

RECORDS = [
    ("Which planet is red?", ["Mars", "Venus", "Earth", "Jupiter"], 0),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("Which is a fruit?", ["stone", "apple pie", "river", "x = y + z"], 1),
    ("Which one is a letter?", ["42", "99", "q", "10"], 2),
    ("The quick brown fox jumps over the", ["lazy dog", "moon", "key", "value"], 0),
    ("hello", ["world", "river", "stone", "b c d"], 0),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_ckpt")
    return {arch: str(tiny_checkpoint(arch, root / arch)) for arch in ("llama", "mamba2")}


def _run(model, task_dir, name, **kw):
    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model, tasks=[name], task_manager=tm, log_samples=True, bootstrap_iters=0, **kw
    )
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
    return out["results"][name]["acc,none"], lls, [s["acc"] for s in samples]


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
@pytest.mark.parametrize("fmt", ["letter", "cloze"])
def test_unablated_matches_lm_eval_hf_backend(checkpoints, tmp_path, arch, fmt):
    """Same log-likelihoods (1e-4) and accuracy as lm-eval's own hf backend on the checkpoint
    (TransformerBridge for llama, HookedSSM for mamba2; cloze choices are multi-token)."""
    lm = gl.GnaLM(pretrained=checkpoints[arch], batch_size=4)
    task = multiple_choice(RECORDS, lm.tokenizer, format=fmt)
    gl.write_task(task, tmp_path, "tiny_mc")
    acc, lls, _ = _run(lm, tmp_path, "tiny_mc")
    hf_acc, hf_lls, _ = _run(
        "hf", tmp_path, "tiny_mc", model_args=f"pretrained={checkpoints[arch]},dtype=float32",
        batch_size=3, device="cpu",
    )  # fmt: skip
    diff = max(
        abs(a - b) for x, y in zip(lls, hf_lls, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert diff < 1e-4, diff
    assert acc == hf_acc


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_rolling_and_generation_match_hf_backend(checkpoints, arch):
    from lm_eval.models.huggingface import HFLM

    lm = gl.GnaLM(pretrained=checkpoints[arch], batch_size=3, max_length=16)
    hf = HFLM(
        pretrained=checkpoints[arch], dtype="float32", batch_size=3, device="cpu", max_length=16
    )
    texts = ["the quick brown fox jumps over the lazy dog. hello world! x = y + z;", "a b c"]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    ours = lm.loglikelihood_rolling(rolling, disable_tqdm=True)
    ref = hf.loglikelihood_rolling(rolling, disable_tqdm=True)
    assert ours == pytest.approx(ref, abs=1e-4)
    kwargs = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    prompts = ["Memorize the following dictionary:\napple:12", "a b c d e", "The value of"]
    gen = [Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)]
    assert lm.generate_until(gen, disable_tqdm=True) == hf.generate_until(gen, disable_tqdm=True)


HEADS = {"llama": [(0, 1), (1, 3)], "mamba2": [(0, 2), (1, 0), (1, 5)]}


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_ablated_items_equal_gna_lens_evaluate(checkpoints, tmp_path, arch):
    """Heads removed through lm-eval give, item by item, what gna_lens.tasks.evaluate gives with
    the same heads ablated by gna_lens.interventions (and differ from the unablated model)."""
    heads = HEADS[arch]
    lm = gl.GnaLM(pretrained=checkpoints[arch], remove=gl.format_heads(heads), batch_size=4)
    task = multiple_choice(
        RECORDS, lm.tokenizer, format="cloze", add_special_tokens=lm.add_bos_token is not False
    )
    gl.write_task(task, tmp_path, "tiny_mc")
    acc, lls, correct = _run(lm, tmp_path, "tiny_mc")
    with ablate_heads(lm.model, heads):
        ref = evaluate(lm.model, task, batch_size=3, progress=False)
    flat = [v for row in lls for v in row]
    expected = [v for row in ref.choice_scores for v in row]
    assert flat == pytest.approx(expected, abs=1e-4)
    assert correct == [float(c) for c in ref.correct.tolist()]
    assert acc == pytest.approx(ref.accuracy)
    plain = evaluate(lm.model, task, batch_size=3, progress=False)
    unablated = [v for r in plain.choice_scores for v in r]
    assert expected != pytest.approx(unablated, abs=1e-3)


def test_last_position_ablation_equals_ablate_heads_at_the_query(checkpoints, tmp_path):
    """positions=last ablates the last context token of each request (the query position,
    whatever the continuation's length): what ablate_heads does at sample.query_position."""
    heads = HEADS["mamba2"]
    lm = gl.GnaLM(
        pretrained=checkpoints["mamba2"], remove=gl.format_heads(heads), positions="last",
        batch_size=4,
    )  # fmt: skip
    task = multiple_choice(RECORDS, lm.tokenizer, format="cloze")
    gl.write_task(task, tmp_path, "tiny_mc")
    _, lls, _ = _run(lm, tmp_path, "tiny_mc")
    expected, everywhere = [], []
    for i, s in enumerate(task):
        with ablate_heads(lm.model, heads, positions=[s.query_position]):
            expected += evaluate(lm.model, task[i : i + 1], progress=False).choice_scores[0]
        with ablate_heads(lm.model, heads):
            everywhere += evaluate(lm.model, task[i : i + 1], progress=False).choice_scores[0]
    flat = [v for row in lls for v in row]
    assert flat == pytest.approx(expected, abs=1e-4)
    assert flat != pytest.approx(everywhere, abs=1e-3)


def test_aggregate_mask_equals_mask_patterns(checkpoints):
    """mask=aggregate builds each request's mask from its option lines: the log-likelihoods are
    those of mask_patterns with gna_lens.aggregate_mask on the same prompt."""
    lm = gl.GnaLM(
        pretrained=checkpoints["mamba2"], mask="aggregate", mask_heads="L1H0;L1H3",
        segments="options", batch_size=4,
    )  # fmt: skip
    task = multiple_choice(RECORDS[:3], lm.tokenizer, format="letter")
    reqs = [
        Instance("loglikelihood", {}, (s.prompt, c), i)
        for i, s in enumerate(task)
        for c in s.choices
    ]
    ours = [ll for ll, _ in lm.loglikelihood(reqs, disable_tqdm=True)]
    expected, plain = [], []
    with torch.no_grad():
        for s in task:
            n = s.n_tokens
            for c in s.choice_ids:  # " A" is two tokens for the tiny tokenizer
                row = s.input_ids + c
                ids = torch.tensor([row[:-1]])
                m = torch.ones(len(row) - 1, len(row) - 1, dtype=torch.bool)
                m[:n, :n] = aggregate_mask(s)
                with mask_patterns(lm.model, {(1, 0): m, (1, 3): m}):
                    lp = torch.log_softmax(lm.model(ids)[0].float(), -1)
                lp0 = torch.log_softmax(lm.model(ids)[0].float(), -1)
                steps = range(n - 1, len(row) - 1)
                expected.append(sum(float(lp[p, t]) for p, t in zip(steps, c, strict=True)))
                plain.append(sum(float(lp0[p, t]) for p, t in zip(steps, c, strict=True)))
    assert ours == pytest.approx(expected, abs=1e-4)
    assert ours != pytest.approx(plain, abs=1e-3)
    no_lines = [Instance("loglikelihood", {}, ("no option lines here", " A"), 0)]
    with pytest.raises(InterventionError, match="no run of two or more segment lines"):
        lm.loglikelihood(no_lines, disable_tqdm=True)


def test_no_hook_left_after_calls_or_errors(checkpoints):
    """Hooks exist only during a forward pass: none after a call, and after an exception the
    model has exactly the hooks it had before, the user's own included."""
    for kw in ({"remove": "L1H0;L0H2"}, {"remove": "L1H0", "positions": "last", "mode": "mean"}):
        lm = gl.GnaLM(pretrained=checkpoints["mamba2"], batch_size=2, **kw)
        model = lm.model
        before = count_hooks(model)
        reqs = [Instance("loglikelihood", {}, ("a b c", " d"), 0)]
        gen = [Instance("generate_until", {}, ("a b", {"until": ["\n"], "max_gen_toks": 2}), 0)]
        clean = lm.loglikelihood(reqs, disable_tqdm=True)
        lm.generate_until(gen, disable_tqdm=True)
        assert count_hooks(model) == before

        def boom(x, hook):
            raise RuntimeError("user hook failed")

        model.blocks[1].hook_resid_post.add_hook(boom)
        with_user = count_hooks(model)
        with pytest.raises(RuntimeError, match="user hook failed"):
            lm.loglikelihood(reqs, disable_tqdm=True)
        assert count_hooks(model) == with_user > before
        with pytest.raises(RuntimeError, match="user hook failed"):
            lm.generate_until(gen, disable_tqdm=True)
        assert count_hooks(model) == with_user
        model.blocks[1].hook_resid_post.remove_hooks()
        assert lm.loglikelihood(reqs, disable_tqdm=True) == clean


def test_registered_and_arguments_checked(checkpoints):
    from lm_eval.api.registry import get_model

    assert get_model("gna_lens") is gl.GnaLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own backends stay findable
    lm = gl.GnaLM.create_from_arg_string(
        f"pretrained={checkpoints['mamba2']},remove=L1H0;L0H2,mode=mean,positions=last",
        {"batch_size": 4, "device": "cpu"},
    )
    assert lm.intervention.heads == ((1, 0), (0, 2)) and lm.batch_size == 4
    with pytest.raises(ConfigError, match="unknown argument"):
        gl.GnaLM(pretrained=checkpoints["mamba2"], rmove="L1H0")
    with pytest.raises(ConfigError, match="cannot read head"):
        gl.GnaLM(pretrained=checkpoints["mamba2"], remove="L1-0")
    with pytest.raises(Exception, match="out of range"):
        gl.GnaLM(pretrained=checkpoints["mamba2"], remove="L9H0")


def test_load_ranking_rebuilds_the_scans_ranking(tmp_path):
    """A scan report lists only its top k; the rows beyond need the rest of the ranking, rebuilt
    from the per-head effects exactly as GnaReport.top ranks."""
    from gna_lens.scoring import score_heads
    from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task

    model = toy_gna_model(generic_head=True)
    report = score_heads(
        model, toy_gna_task(model, n_samples=8), control=toy_control(model), progress=False
    )
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report.to_dict() | {"top": [list(h) for h in report.top(1)]}))
    heads, source = gl.load_ranking(path)
    n = int(report._eligible().sum())
    assert list(heads) == report.top(n) and len(heads) == n
    assert (0, 2) not in heads[:2] and "retrieval-specific" in source
    bad = json.loads(path.read_text()) | {"top": [[0, 2]]}
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="inconsistent"):
        gl.load_ranking(path)


def test_evaluate_command_writes_the_table(checkpoints, tmp_path, capsys):
    """`gna-lens evaluate` end to end on a tiny checkpoint and the offline MMLU tasks, with
    random rows (--random-draws, --random-k); --ranking-metric reaches evaluate_table."""
    from gna_lens.cli import main

    ranking = tmp_path / "ranking.json"
    ranking.write_text(json.dumps([[1, 0], [0, 2], [1, 5], [0, 7]]))
    out = tmp_path / "table"
    rc = main(
        ["evaluate", checkpoints["mamba2"], "--tasks", "gna_mmlu_letter,gna_mmlu_cloze",
         "--remove-top", "0,2,4", "--ranking", str(ranking), "--limit", "12", "--out", str(out),
         "--batch-size", "8", "--quiet", "--random-draws", "2", "--random-k", "2"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "table.json").read_text())
    assert {p.name for p in out.iterdir()} >= {"table.md", "table.csv", "table.svg", "tasks"}
    randoms = [c for c in data["cells"] if c.get("kind") == "random"]
    assert len(randoms) == 4 and {c["k"] for c in randoms} == {2}
    assert all(not {(1, 0), (0, 2)} & {tuple(h) for h in c["heads"]} for c in randoms)
    assert "| random-2 #2 |" in (out / "table.md").read_text()
    cells = {(c["k"], c["task"]): c for c in data["cells"] if "kind" not in c}
    assert len(cells) == 6 and data["ranking"] == [[1, 0], [0, 2], [1, 5], [0, 7]]
    for task in ("gna_mmlu_letter", "gna_mmlu_cloze"):
        base = cells[(0, task)]
        assert base["change"] is None and base["n"] == 12
        assert base["value"]["method"] == "wilson"
        for k in (2, 4):
            c = cells[(k, task)]
            diff = sum(c["items"]) / 12 - sum(base["items"]) / 12
            assert c["change"]["value"] == pytest.approx(diff)
            assert c["value"]["low"] <= c["value"]["value"] <= c["value"]["high"]
    assert data["method"]["provenance"]["source"] == "local"
    assert "zero" in data["method"]["mode"] and data["method"]["ranking"] == "L1H0;L0H2;L1H5;L0H7"
    assert gl.BenchmarkTable.from_dict(data).to_dict() == data
    table = (out / "table.md").read_text()
    assert "| 4 |" in table and "pts" in table
    assert not math.isnan(cells[(0, "gna_mmlu_letter")]["value"]["value"])
    rc = main(
        ["evaluate", checkpoints["mamba2"], "--ranking", str(ranking), "--ranking-metric",
         "accuracy", "--out", str(tmp_path / "no"), "--quiet"]
    )  # fmt: skip
    assert rc == 2 and "ranking_metric='accuracy' with a ranking given" in capsys.readouterr().err


def test_table_api_returns_frozen_result(checkpoints):
    lm_model = gl.GnaLM(pretrained=checkpoints["llama"]).model
    table = gl.evaluate_table(
        lm_model, ["gna_mmlu_letter"], [0, 1], ranking=[(1, 2)], limit=6, progress=False
    )
    df = table.to_dataframe()
    assert list(df["k"]) == [0, 1] and set(df.columns) >= {"value", "low", "high", "change"}
    with pytest.raises(AttributeError):
        table.model = "x"  # type: ignore[misc]
    with pytest.raises(ConfigError, match="needs 3 ranked heads"):
        gl.evaluate_table(lm_model, ["gna_mmlu_letter"], [0, 3], ranking=[(1, 2)], limit=6)


def test_recipe_blocks_run_and_print_what_the_page_says(tmp_path, monkeypatch):
    """docs/recipes/lm_eval.md: the toy table falls from 100% as the Aggregate head goes, and
    keeping vs denying its pattern keeps vs breaks retrieval."""
    import contextlib
    import io
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    page = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "lm_eval.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 2
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile("\n".join(blocks), "lm_eval.md", "exec"), scope)
    table = scope["table"]
    assert table.cell(0, "toy_kv").value.value == 1.0
    assert table.cell(1, "toy_kv").value.value == pytest.approx(0.208, abs=1e-3)
    assert table.cell(1, "toy_kv").change.high < 0
    assert (tmp_path / "toy_table" / "table.svg").read_text().startswith("<svg")
    lines = out.getvalue().splitlines()
    kept, denied = (float(line.split()[-1]) for line in lines[-2:])
    assert lines[-2].startswith("aggregate ") and kept == 1.0
    assert denied == pytest.approx(0.208, abs=1e-3)


def test_lm_eval_command_line_wrapper(checkpoints, tmp_path, monkeypatch, capsys):
    """`gna-lens lm-eval` is lm-eval's own CLI with --model gna_lens registered; offline gna_*
    tasks are written on demand for the model's tokenizer."""
    from gna_lens.cli import main

    monkeypatch.setenv("GNA_LENS_CACHE", str(tmp_path / "cache"))
    rc = main(
        ["lm-eval", "--model", "gna_lens", "--model_args",
         f"pretrained={checkpoints['mamba2']},remove=L1H0;L0H2", "--tasks", "gna_mmlu_letter",
         "--limit", "4", "--batch_size", "4", "--output_path", str(tmp_path / "results")]
    )  # fmt: skip
    assert rc == 0
    assert list((tmp_path / "cache" / "lm_eval_tasks").glob("*-4/gna_mmlu_letter.yaml"))
    results = list((tmp_path / "results").rglob("results_*.json"))
    assert len(results) == 1
    data = json.loads(results[0].read_text())
    assert data["n-samples"]["gna_mmlu_letter"]["effective"] == 4
    assert data["config"]["gna_lens_intervention"]["heads"] == [[1, 0], [0, 2]]
    assert data["config"]["gna_lens_provenance"]["source"] == "local"


def test_ranking_computed_on_the_fly_when_none_is_given(tmp_path, monkeypatch):
    """Without --ranking the heads are ranked as gna-lens scan ranks them (score_heads with a
    control, retrieval-specific top): on the toy, its Gather and Aggregate heads, not the
    generic head that every prediction needs."""
    import gna_lens.scan
    import gna_lens.scoring
    from gna_lens.scan import ScanTasks
    from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task

    model = toy_gna_model(generic_head=True)
    monkeypatch.setattr(
        gna_lens.scan,
        "build_tasks",
        lambda *a, **k: ScanTasks(toy_gna_task(model, n_samples=8), {}),
    )
    monkeypatch.setattr(gna_lens.scoring, "resolve_control", lambda *a, **k: toy_control(model))
    gl.write_task(toy_gna_task(model, n_samples=12, seed=3), tmp_path, "toy_kv")
    table = gl.evaluate_table(
        model, ["toy_kv"], [0, 2], task_dir=tmp_path, progress=False, limit=None
    )
    assert sorted(table.ranking) == [(0, 0), (1, 0)]
    assert "computed on the fly" in table.method["ranking_source"]
    assert table.method["local_tasks"] == {}  # only the tasks asked for are written
    assert table.cell(2, "toy_kv").value.value < table.cell(0, "toy_kv").value.value


def test_a_ranking_of_channel_groups_removes_the_groups(tmp_path, checkpoints):
    """A scan of a large Mamba-1 ranks 64-channel blocks; its report.json must remove those
    blocks in lm-eval, not the single channels with the same indices."""
    from interventions_helpers import task as kv_task
    from interventions_helpers import tok

    from gna_lens.scoring import score_heads

    folder = tiny_checkpoint("mamba1", tmp_path / "m1", vocab_size=len(tok()))
    tok().save_pretrained(folder)
    mamba1 = gl.GnaLM(pretrained=str(folder)).model
    task, control = kv_task(n_samples=4), kv_task(n_samples=4, seed=1)
    with mamba1.head_groups(16):
        report = score_heads(mamba1, task, control=control, progress=False)
    path = tmp_path / "report.json"
    report.to_json(path)
    heads, source = gl.load_ranking(path)
    assert heads.head_groups == report.head_groups and "channel groups" in source
    table = gl.evaluate_table(mamba1, ["gna_mmlu_cloze"], [0, 1], ranking=path, limit=6,
                              progress=False)  # fmt: skip
    assert table.method["head_groups"] == report.head_groups_spec()
    assert mamba1.head_group_spec == {}  # the groups were set for the rows only
    expected = table.cells[1].items
    with mamba1.head_groups(16):
        again = gl.evaluate_table(mamba1, ["gna_mmlu_cloze"], [0, 1], ranking=list(heads),
                                  limit=6, progress=False)  # fmt: skip
    assert again.cells[1].items == expected
    llama = gl.GnaLM(pretrained=checkpoints["llama"]).model
    with pytest.raises(ConfigError, match="addresses Mamba-1 channel groups"):
        gl.evaluate_table(llama, ["gna_mmlu_cloze"], [0, 1], ranking=path, limit=6)


def _toy_table(model, tmp_path, ranking, remove_top, **kw):
    from gna_lens.testing import toy_gna_task

    if not (tmp_path / "toy_kv.yaml").exists():
        gl.write_task(toy_gna_task(model, n_pairs=4, n_samples=12, seed=1), tmp_path, "toy_kv")
    return gl.evaluate_table(
        model, ["toy_kv"], remove_top, ranking=ranking, task_dir=tmp_path, progress=False,
        limit=None, **kw,
    )  # fmt: skip


def test_random_rows_are_layer_matched_outside_the_top_k_and_reproducible(tmp_path):
    """random-K #i rows remove K heads outside the ranking's top K with as many heads per layer
    (the toy has two other heads per layer), the same ones for the same seed, other ones for
    another seed; their mean has an interval over draws and items; every output shows them."""
    from collections import Counter

    from gna_lens.heads import head_view
    from gna_lens.scoring import matched_random_sets
    from gna_lens.testing import TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD, toy_gna_model

    model = toy_gna_model(generic_head=True)
    ranking = [TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD]
    table = _toy_table(model, tmp_path, ranking, [0, 2], random_draws=3)
    labels = ["random-2 #1", "random-2 #2", "random-2 #3"]
    assert table.rows() == ["0", "2", *labels, "random-2 mean"]
    draws = [table.cell(r, "toy_kv") for r in labels]
    sets = [c.heads for c in draws]
    assert len(set(sets)) == 3 and table.method["random"]["matching"] == "layer"
    for heads in sets:
        assert not set(heads) & set(ranking), f"random heads {heads} overlap the top 2 {ranking}"
        assert Counter(layer for layer, _ in heads) == Counter(layer for layer, _ in ranking)
    mean = table.cell("random-2 mean", "toy_kv")
    values = [c.value.value for c in draws]
    assert mean.value.value == pytest.approx(sum(values) / 3)
    assert mean.change.method == "bootstrap (draws x prompts)" and mean.change.n == 3 * mean.n
    assert mean.change.low <= mean.change.value <= mean.change.high

    again = _toy_table(model, tmp_path, ranking, [0, 2], random_draws=3)
    assert [again.cell(r, "toy_kv").heads for r in labels] == sets
    assert [again.cell(r, "toy_kv").items for r in labels] == [c.items for c in draws]
    view = head_view(model)
    other = next(
        s for s in range(1, 50) if matched_random_sets(view, ranking, 1, s).sets[0] != sets[0]
    )
    moved = _toy_table(model, tmp_path, ranking, [0, 2], random_draws=1, seed=other)
    assert moved.cell("random-2 #1", "toy_kv").heads != sets[0]

    paths = table.write(tmp_path / "out")
    first = gl.format_heads(sets[0])
    md = paths["markdown"].read_text()
    assert "| random-2 #1 |" in md and "| random-2 mean |" in md
    assert f"random-2 #1 {first}" in md and "over the draws and the items" in md
    assert f"random-2 #1,2,{first},toy_kv" in paths["csv"].read_text()
    data = json.loads(paths["json"].read_text())
    assert gl.BenchmarkTable.from_dict(data).to_dict() == data
    svg = paths["svg"].read_text()
    top_x = [float(x) for x in re.findall(r'<circle cx="([\d.]+)" cy="[\d.]+" r="3" fill="#', svg)]
    random_x = {float(x) for x in re.findall(r'class="random" cx="([\d.]+)"', svg)}
    assert random_x == {top_x[-1] + 6} and "random-2 #1" in svg  # beside the top-2 row's point
    assert any(t.name == "toy_kv random-2" for t in table.figure().data)


def test_random_rows_fall_back_to_any_layer_and_say_so(tmp_path):
    """Without the generic head layer 1 has one other head: the top-1 Aggregate head's layer
    cannot give distinct layer-matched sets, so the draws take any layer and the table says so;
    a random_k that no top-k row matches is refused."""
    from gna_lens.testing import TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD, toy_gna_model

    model = toy_gna_model()
    ranking = [TOY_AGGREGATE_HEAD, TOY_GATHER_HEAD]
    table = _toy_table(model, tmp_path, ranking, [0, 1, 2], random_draws=3, random_k=1)
    sets = [c.heads for c in table.random_cells("toy_kv") if c.kind == "random"]
    assert len(set(sets)) == 3 and all(TOY_AGGREGATE_HEAD not in s for s in sets)
    assert {s[0][0] for s in sets} == {0, 1} and table.method["random"]["matching"] == "kind"
    assert "from any layer" in table.to_markdown()
    with pytest.raises(ConfigError, match="random_k=3 with remove_top=\\[0, 1, 2\\]"):
        _toy_table(model, tmp_path, ranking, [0, 1, 2], random_draws=2, random_k=3)
    with pytest.raises(ConfigError, match="without random_draws"):
        _toy_table(model, tmp_path, ranking, [0, 1, 2], random_k=1)


def test_ranking_metric_accuracy_is_the_papers_protocol(tmp_path, monkeypatch):
    """ranking_metric="accuracy" ranks by each head's accuracy drop with every head ablated
    alone (no prefilter), and the table says which metric ranked its heads."""
    import gna_lens.scan
    import gna_lens.scoring
    from gna_lens.scan import ScanTasks
    from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task

    model = toy_gna_model(generic_head=True)
    monkeypatch.setattr(
        gna_lens.scan,
        "build_tasks",
        lambda *a, **k: ScanTasks(toy_gna_task(model, n_samples=8), {}),
    )
    monkeypatch.setattr(gna_lens.scoring, "resolve_control", lambda *a, **k: toy_control(model))
    calls = []
    score_heads = gna_lens.scoring.score_heads

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return score_heads(*args, **kwargs)

    monkeypatch.setattr(gna_lens.scoring, "score_heads", spy)
    table = _toy_table(model, tmp_path, None, [0, 2], ranking_metric="accuracy")
    assert calls[-1]["metric"] == "accuracy" and calls[-1]["strategy"] == "exact"
    assert calls[-1]["prefilter"] is None
    assert sorted(table.ranking) == [(0, 0), (1, 0)]
    assert table.method["ranking_metric"] == "accuracy"
    md = table.to_markdown()
    assert "Heads ranked by: accuracy (the paper's protocol" in md.split("- Model:")[0]
    default = _toy_table(model, tmp_path, None, [0, 2])
    assert calls[-1]["metric"] == "logit_diff" and default.method["ranking_metric"] == "logit_diff"
    with pytest.raises(ConfigError, match="only applies to the ranking computed here"):
        _toy_table(model, tmp_path, [(1, 0)], [0, 1], ranking_metric="accuracy")
    with pytest.raises(ConfigError, match="expected one of \\['logit_diff', 'accuracy'\\]"):
        _toy_table(model, tmp_path, None, [0, 1], ranking_metric="acc")
