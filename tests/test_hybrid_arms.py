"""The hybrid experiment's controlled arms (issue 30): distillation data without KV texts,
several training seeds, layer-matched random students, comparisons against their mean, and
``only=`` to split a run.

Checked here: the no-kv data holds no KV text and its measured composition sums to 1 (tokens
counted after the cut at ``max_length``, as distillation reads them); a tokenizer that leaves
out prose and MMLU makes ``no-kv`` fail before anything runs, and a bad choice is refused naming
the input and the choices; every (arm, seed, data) is its own row, distilled with its own seed
and data, and a rerun reads finished rows back instead of distilling them again (a stub
``distill`` counts the calls), including rows written by earlier versions; random students keep
as many heads per layer as the top-k set and never a top head; the comparison against the
random students' mean is the per-prompt mean difference; a typo in ``only`` is refused.
"""

import collections
import functools
import itertools
import json
import re
import types
from pathlib import Path

import pytest
import torch

import gna_lens.hybrid._distill as distill_module
from gna_lens.errors import ConfigError
from gna_lens.hybrid import (
    DISTILL_DATA,
    data_composition,
    default_distill_data,
    distill_data,
    run_experiment,
)

#: What marks a KV-retrieval text (both templates), and a ``key:value`` dictionary line.
KV_MARKERS = ("Memorize the following dictionary", "key-value pairs", "The value of the key")
KV_LINE = re.compile(r"(?m)^[A-Za-z]+:\s?\w+$")
ASSET = Path(__file__).resolve().parents[1] / "docs" / "assets" / "hybrid_smollm2_200k.json"


def _is_kv(text: str) -> bool:
    return any(m in text for m in KV_MARKERS) or bool(KV_LINE.search(text))


@functools.cache
def _word_tok():
    """A word tokenizer that reads the KV templates, the prose and the first MMLU questions:
    every source of the distillation data is usable."""
    from gna_lens.hybrid._data import _mmlu_texts
    from gna_lens.tasks import load_prose, load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    return word_tokenizer(
        [
            "Below is a list of key-value pairs. What is the value for key ? :",
            "Memorize the following dictionary: The value of the key ' is",
            " ".join(load_words()[:60]),
            load_prose(),
            *_mmlu_texts()[:64],
        ],
        bos=True,
    )


# ----------------------------------------------------------------------------- data
def test_no_kv_data_holds_no_kv_text_and_its_composition_sums_to_one():
    t = _word_tok()
    default = distill_data(t, "default")
    assert default.sources == DISTILL_DATA["default"]
    assert sum(map(_is_kv, itertools.islice(default, 40))) >= 15  # the markers do find KV texts
    no_kv = distill_data(t, "no-kv", seed=3)
    assert no_kv.sources == ("prose", "mmlu") and no_kv.seed == 3
    texts = list(itertools.islice(no_kv, 400))
    assert not [x for x in texts if _is_kv(x)][:1]
    assert {s for s, _ in itertools.islice(no_kv.labelled(), 10)} == {"prose", "mmlu"}
    for data in (default, no_kv):
        comp = data_composition(data, t, max_length=64, tokens=20_000)
        assert set(comp.shares) == set(data.sources)
        for column in ("texts", "tokens"):
            assert sum(v[column] for v in comp.shares.values()) == pytest.approx(1.0)
        assert comp.n_tokens >= 20_000 and comp.n_texts * 64 >= comp.n_tokens
    # cut at 16 tokens, every text counts 16: the token shares are the text shares; uncut,
    # prose (~256 tokens per text) outweighs MMLU questions
    cut = data_composition(no_kv, t, max_length=16, n_texts=200)
    full = data_composition(no_kv, t, max_length=10_000, n_texts=200)
    assert cut.n_texts == full.n_texts == 200 and cut.n_tokens == 16 * 200
    assert cut.shares["prose"]["tokens"] == pytest.approx(cut.shares["prose"]["texts"])
    assert full.shares["prose"]["tokens"] > full.shares["prose"]["texts"] + 0.1
    assert "KV texts in all: 0.0% / 0.0%" in cut.describe()


def test_no_kv_with_a_tokenizer_that_covers_neither_prose_nor_mmlu_says_no_source_is_left():
    from gna_lens import zoo

    t = zoo.tokenizer()
    assert default_distill_data(t).sources == ("kv-paper", "kv-question")
    with pytest.raises(ConfigError, match=r"distill_data='no-kv'.*no source is left") as err:
        distill_data(t, "no-kv")
    assert "prose" in str(err.value) and "mmlu" in str(err.value)


def test_a_bad_distill_data_choice_names_the_input_and_the_choices(tmp_path, capsys):
    from gna_lens.cli import main

    with pytest.raises(ConfigError, match=r"'nokv' is not a distillation-data choice") as err:
        run_experiment(str(tmp_path / "no-such-teacher"), distill_data=["default", "nokv"])
    assert "'default', 'no-kv'" in str(err.value)  # refused before loading the teacher
    with pytest.raises(ConfigError, match=r"distill_data='kv'; expected one of"):
        distill_data(_word_tok(), "kv")
    code = main(["hybrid", str(tmp_path / "x"), "--distill-data", "default,nokv", "--quiet"])
    text = capsys.readouterr().err
    assert code == 2 and "--distill-data 'default,nokv'" in text and "'nokv'" in text
    assert "default, no-kv" in text
    with pytest.raises(ConfigError, match=r"seeds=\[0, 0\]"):
        run_experiment(str(tmp_path / "x"), seeds=[0, 0])


# ----------------------------------------------------------------------------- experiment
@functools.cache
def _teacher(root: str) -> str:
    """A tiny Llama (2 layers x 8 heads) with :func:`_word_tok`."""
    from gna_lens.testing import tiny_checkpoint

    t = _word_tok()
    path = tiny_checkpoint(
        "llama", Path(root) / "teacher", vocab_size=len(t), num_attention_heads=8
    )
    t.save_pretrained(path)
    return str(path)


class _StubDistill:
    """Stands in for distill: records each call (kept heads, seed, the first texts of its data)
    and trains nothing."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, student, twin, data, **kw):
        from gna_lens import head_view

        heads = tuple(sorted(head_view(student).heads(kind="attention")))
        self.calls.append(
            {"heads": heads, "seed": kw["seed"], "texts": list(itertools.islice(data, 24))}
        )
        return types.SimpleNamespace(totals={}, probe={}, n_trained=0)


KW = dict(
    keep=(0, 2), budget=300, n_rank=6, n_eval=12, kv_pairs=(2, 4), n_knowledge=0,
    prose_windows=2, prose_len=32, batch_size=4, max_length=64, lengths=(128,), progress=False,
)  # fmt: skip


def _run(teacher, out, stub, monkeypatch, **kw):
    monkeypatch.setattr(distill_module, "distill", stub)
    return run_experiment(teacher, out=out, **(KW | kw))


def test_seeds_data_and_draws_are_rows_that_only_splits_and_reruns_read_back(tmp_path, monkeypatch):
    teacher = _teacher(str(tmp_path))
    out = tmp_path / "out"
    arms = dict(seeds=(0, 1), random_draws=3, distill_data=["default", "no-kv"])
    # chunk 1: seed 0 only
    first = _StubDistill()
    table = _run(teacher, out, first, monkeypatch, only="seed=0", **arms)
    names = [r.name for r in table.rows]
    assert names == [
        "teacher", "k=0", "top-2", "random-2", "random-2 #2", "random-2 #3",
        "k=0 data=no-kv", "top-2 data=no-kv", "random-2 data=no-kv", "random-2 #2 data=no-kv",
        "random-2 #3 data=no-kv",
    ]  # fmt: skip
    assert [c["seed"] for c in first.calls] == [0] * 10
    assert (
        len(table.method["pending"]) == 10 and "top-2 seed=1 data=no-kv" in table.method["pending"]
    )
    assert table.method["only"] == ["seed=0"]
    # each data choice distils on its own texts: no KV text at all in no-kv
    by_row = dict(zip(names[1:], first.calls, strict=True))
    assert not any(_is_kv(x) for n, c in by_row.items() if "no-kv" in n for x in c["texts"])
    assert sum(_is_kv(x) for x in by_row["top-2"]["texts"]) >= 8
    comp = table.method["data_composition"]
    assert set(comp["no-kv"]) == {"prose", "mmlu"} and "kv-paper" in comp["default"]
    for shares in comp.values():
        assert sum(v["texts"] for v in shares.values()) == pytest.approx(1.0)
        assert sum(v["tokens"] for v in shares.values()) == pytest.approx(1.0)
    assert "Distillation data composition" in table.to_markdown()
    # every training seed reads its own stream, and the table says what each one held
    by_seed = table.method["data_composition_by_seed"]
    assert set(by_seed) == {"default", "no-kv"} and set(by_seed["default"]) == {"0", "1"}
    assert by_seed["default"]["0"] == comp["default"] and "kv-paper" in by_seed["default"]["1"]
    assert "default, training seed 1:" in table.to_markdown()
    assert "of data seed 1," in table.method["data_composition_text"]["no-kv, training seed 1"]
    # random students: as many heads per layer as the top set, none of the ranking's top 2
    top = set(table.ranking[:2])
    top_layers = collections.Counter(layer for layer, _ in table.row("top-2").heads)
    randoms = [r for r in table.rows if r.kind == "random" and r.data == "default"]
    assert len({r.heads for r in randoms}) == 3
    for r in randoms:
        assert collections.Counter(layer for layer, _ in r.heads) == top_layers
        assert not top & set(r.heads)
    # 3 draws per training seed, each seed its own: 6 distinct sets drawn in one sequence
    assert table.method["random_matching"]["2"].startswith("6 distinct sets, same layers")
    # a row of an earlier version (no seed / data / arm in the row) is read back as well
    old = json.loads((out / "rows" / "top-2.json").read_text())
    for key in ("seed", "data", "arm"):
        old["row"].pop(key)
    (out / "rows" / "top-2.json").write_text(json.dumps(old))
    # chunk 2: everything: only the 10 seed-1 rows are distilled, with seed 1
    second = _StubDistill()
    table = _run(teacher, out, second, monkeypatch, **arms)
    assert [c["seed"] for c in second.calls] == [1] * 10
    assert len(table.rows) == 21 and "pending" not in table.method
    seed1 = [r for r in table.rows if r.seed == 1]
    assert len(seed1) == 10 and all(" seed=1" in r.name for r in seed1)
    assert table.row("top-2").seed == 0 and table.row("top-2").arm == "top-2"
    # seed 1's random sets are not seed 0's: 6 distinct sets per data arm, layer-matched
    sets = {r.heads for r in table.rows if r.kind == "random" and r.data == "no-kv"}
    assert len(sets) == 6 and table.row("random-2 #2 seed=1").heads not in {
        table.row(f"random-2{d}").heads for d in ("", " #2", " #3")
    }
    assert table.row("random-2 #2 seed=1 data=no-kv").heads == table.row("random-2 #2 seed=1").heads
    files = {p.name for p in (out / "rows").glob("*.json")}
    assert {
        "top-2.json",
        "top-2-seed1.json",
        "random-2-2-seed1-no-kv.json",
        "k0-no-kv.json",
    } <= files
    # the default rows keep the fingerprint keys of the published 200k run (its rows resume)
    saved = json.loads((out / "rows" / "top-2.json").read_text())["fingerprint"]
    published = json.loads(ASSET.read_text())["method"]["settings"]
    assert set(saved) - {"heads"} == set(published)
    assert (
        json.loads((out / "rows" / "top-2-seed1.json").read_text())["fingerprint"]["train_seed"]
        == 1
    )
    # a rerun distils nothing
    third = _StubDistill()
    again = _run(teacher, out, third, monkeypatch, **arms)
    assert third.calls == [] and [r.name for r in again.rows] == [r.name for r in table.rows]
    # comparisons: per data; against the mean of every random student, per prompt
    comps = {(c["data"], c["task"]): c for c in again.comparisons()}
    # each size in the question template and in the induction-proof facts template
    tasks = ("kv-2", "kv-4", "kv-2-facts", "kv-4-facts")
    assert set(comps) == {(d, t) for d in ("default", "no-kv") for t in tasks}
    c = comps[("default", "kv-4")]
    rows = [r for r in again.rows if r.data == "default"]
    tops = torch.tensor([r.kv_correct["kv-4"] for r in rows if r.kind == "top"]).double()
    rand = torch.tensor([r.kv_correct["kv-4"] for r in rows if r.kind == "random"]).double()
    assert c["seeds"] == [0, 1] and c["n_random"] == 6
    assert c["paired_random_mean"]["value"] == pytest.approx(
        float((tops.mean(0) - rand.mean(0)).mean())
    )
    assert [p["seed"] for p in c["per_seed"]] == [0, 1] and c["per_seed"][1]["n_random"] == 3
    assert c["per_seed"][1]["paired_random_mean"]["value"] == pytest.approx(
        float((tops[1] - rand[3:].mean(0)).mean())
    )
    assert again.method["controlled"] is True  # 2 seeds, a no-kv arm, 3 random, same layers
    assert "vs mean" in again.to_markdown() and "per seed: seed 0" in again.to_markdown()
    # a row measured before a task was added: kept without it unless asked to train it again
    stale = json.loads((out / "rows" / "top-2.json").read_text())
    for key in ("kv", "kv_correct"):
        stale["row"][key].pop("kv-4-facts")
    (out / "rows" / "top-2.json").write_text(json.dumps(stale))
    fourth = _StubDistill()
    kept = _run(teacher, out, fourth, monkeypatch, only="k=0", **arms)
    assert fourth.calls == [] and kept.method["unmeasured"] == {"top-2": ["kv-4-facts"]}
    assert "not measured" in kept.to_markdown().split("top-2 |", 1)[1].split("\n", 1)[0]
    c = {(c["data"], c["task"]): c for c in kept.comparisons()}[("default", "kv-4-facts")]
    assert c["seeds"] == [1]  # the comparison reads the students that measured the task
    fifth = _StubDistill()
    again = _run(teacher, out, fifth, monkeypatch, only="top-2 seed=0 data=default", **arms)
    assert [c["seed"] for c in fifth.calls] == [0] and "unmeasured" not in again.method
    assert "kv-4-facts" in again.row("top-2").kv


def test_an_only_entry_that_selects_no_row_is_refused(tmp_path, monkeypatch):
    teacher = _teacher(str(tmp_path))
    stub = _StubDistill()
    for only, says in (
        ("top-3", r"'top-3' selects no row"),
        ("top-2 seed=5", r"'top-2 seed=5' selects no row"),
        ("data=no-kv", r"'data=no-kv' selects no row"),
        ("top-2 seed=x", r"bad seed"),
    ):
        with pytest.raises(ConfigError, match=says):
            _run(teacher, None, stub, monkeypatch, only=only, random_draws=1)
    assert stub.calls == []


def test_an_only_entry_names_the_first_random_set_as_number_1():
    from gna_lens.hybrid._experiment import _parse_only, _selected

    arms = ["k=0", "top-8", "random-8", "random-8 #2"]
    pick = _parse_only("random-8 #1 seed=1")
    assert pick is not None
    assert [a for a in arms if _selected(pick, a, 1, "default")] == ["random-8"]
    assert not _selected(pick, "random-8", 0, "default")
    every = _parse_only("random-8")
    assert every is not None
    assert [a for a in arms if _selected(every, a, 0, "default")] == ["random-8", "random-8 #2"]
