"""An induction-proof KV probe, and prefix-matching (induction) scores of every head.

The ``"question"`` KV template ends its query on ``{key}:``, the dictionary line's own prefix, so
a plain induction head answers it; the induction-proof template must not, and the induction scores
must find an induction head wherever the head space has one (attention or SSM, TransformerBridge
or HookedSSM).
"""

import contextlib

import pytest
import torch
from tasks_helpers import KEYS, tokenizer

from gna_lens.errors import InterventionError
from gna_lens.heads import head_patterns, head_view
from gna_lens.scoring import InductionScores, prefix_matching_scores
from gna_lens.scoring.induction import repeated_tokens, uniform_baseline
from gna_lens.tasks import KV_TEMPLATES, KVTemplate, kv_retrieval
from gna_lens.testing import tiny_checkpoint, tiny_hooked_ssm, toy_gna_model

PROOF = "facts"


def _copyable(sample) -> bool:
    """Whether the prompt + answer end the way the queried line continues after its key: then
    copying what followed the key last time writes the answer (what an induction head does)."""
    key = sample.info["query_key"]
    line = sample.segment_text(sample.answer_segment)
    after_line = line[line.index(key) + len(key) :]
    after_query = sample.prompt[sample.prompt.rindex(key) + len(key) :] + sample.answer
    return after_line.startswith(after_query)


@pytest.mark.parametrize("kind", ["word", "byte_bpe"])
def test_facts_query_does_not_repeat_the_line_after_the_key(kind):
    tok = tokenizer(kind, False)
    kw = dict(n_pairs=6, n_samples=8, values="words", words=KEYS)
    proof = kv_retrieval(tok, template=PROOF, **kw)
    question = kv_retrieval(tok, template="question", **kw)
    assert KV_TEMPLATES[PROOF].induction_proof and not any(_copyable(s) for s in proof)
    # The check can fail: the question template's query ends on the line's "{key}:".
    assert not KV_TEMPLATES["question"].induction_proof and all(_copyable(s) for s in question)


def test_induction_proof_flags_queries_that_continue_like_the_line():
    def tpl(line, query, answer=" {value}"):
        return KVTemplate(header="", line=line, query=query, answer=answer).induction_proof

    assert not tpl("{key} = {value}\n", "{key} =")  # the answer's space completes " = "
    assert not tpl("{key} {value}\n", "{key}")  # the toy template: the key, then the value
    assert not tpl("{key}: {value}\n", "What is {key}? Again, {key}: the")  # a later repeat
    assert not tpl("{key}: {value}\n", "{key}", answer=": {value}")  # the separator is answered
    assert tpl("{key}: {value}\n", "{key} =")  # another separator
    assert tpl("{key}: {value}\n", "What is the value for key {key}?\nAnswer:")
    assert tpl("{value} is the {key}\n", "The {key} is")  # the value never follows the key


def test_facts_task_has_single_token_answers_among_its_choices():
    tok = tokenizer("byte_bpe", True)
    task = kv_retrieval(tok, n_pairs=6, n_samples=12, template=PROOF, values="words", words=KEYS)
    assert task.info["template"] == PROOF
    for s in task:
        key, values = s.info["query_key"], s.info["values"]
        assert s.prompt.endswith(f"What is the {key}? It is")
        assert s.choices == [f" {v}" for v in values] and len(set(values)) == 6
        assert all(len(ids) == 1 for ids in s.choice_ids)
        assert s.answer == f" {values[s.info['keys'].index(key)]}"
        assert s.segment_text(s.answer_segment).startswith(f"The {key} is {s.answer.strip()}.")


# --- prefix-matching scores ---------------------------------------------------------------


def _forcing_hook(n_tokens: int, bos: bool):
    """Replace layer 0's heads 0-2 by an induction, a previous-token and a uniform head."""
    start = n_tokens + int(bos)

    def hook(pattern, hook):
        P = pattern.clone()
        L = P.shape[-1]
        q = torch.arange(L)
        induction = torch.zeros(L, L)
        induction[q, torch.where(q >= start, q - n_tokens + 1, q)] = 1.0
        previous = torch.zeros(L, L)
        previous[q, (q - 1).clamp(min=0)] = 1.0
        uniform = torch.tril(torch.ones(L, L))
        uniform = uniform / uniform.sum(-1, keepdim=True)
        for h, forced in enumerate([induction, previous, uniform]):
            P[:, h] = forced.to(P)
        return P

    return hook


def _bridge(tmp_path):
    from transformer_lens.model_bridge import TransformerBridge

    path = tiny_checkpoint("llama", tmp_path / "llama")
    return TransformerBridge.boot_transformers(str(path))


def test_finds_a_forced_induction_head_the_same_way_on_a_bridge_and_a_hooked_ssm(tmp_path):
    n = 10
    models = {"hooked_ssm": toy_gna_model(generic_head=True), "bridge": _bridge(tmp_path)}
    got = {}
    for name, model in models.items():
        hook = _forcing_hook(n, bos=False)
        with model.hooks(fwd_hooks=[(head_view(model)[0].pattern_hook, hook)]):
            scores = prefix_matching_scores(
                model, n_tokens=n, n_samples=3, seed=1, prepend_bos=False
            )
        assert isinstance(scores, InductionScores) and not scores.bos
        assert len(scores.heads) == head_view(model).n_heads_total
        assert scores.top(1) == [(0, 0)], name
        forced = [scores.score((0, h)) for h in range(3)]
        assert forced[0] == pytest.approx(1.0) and forced[1] == pytest.approx(0.0), name
        assert forced[2] == pytest.approx(uniform_baseline(n, bos=False)), name
        assert scores.baseline == pytest.approx(forced[2])
        prev = scores.to_dataframe().set_index(["layer", "head"])["previous_token"]
        assert prev[(0, 1)] == pytest.approx(1.0) and prev[(0, 0)] == pytest.approx(0.0)
        got[name] = forced
    assert got["bridge"] == pytest.approx(got["hooked_ssm"])


def test_bos_is_dropped_from_rows_and_shifts_the_induction_key():
    model = toy_gna_model(generic_head=True)  # its tokenizer has a BOS but does not add it
    n = 8
    assert not prefix_matching_scores(model, n_tokens=n, n_samples=1).bos
    with model.hooks(fwd_hooks=[(head_view(model)[0].pattern_hook, _forcing_hook(n, bos=True))]):
        scores = prefix_matching_scores(model, n_tokens=n, n_samples=2, prepend_bos=True)
    assert scores.bos and scores.score((0, 0)) == pytest.approx(1.0)
    # A uniform row over every causal key, BOS included, scores the baseline: BOS is dropped.
    assert scores.score((0, 2)) == pytest.approx(uniform_baseline(n, bos=True))


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "bamba"])
def test_ssm_scores_match_the_full_materialized_pattern(arch):
    """The selected rows and channels (``pattern_selection``) give the scores of the full
    pattern read by hand; Mamba-1 under channel groups too."""
    model = tiny_hooked_ssm(arch, seed=2)
    n, view = 6, head_view(model)
    heads = [(0, 1), (1, 3)] if arch != "bamba" else [(0, 1), (1, 2)]
    groups = 16 if arch == "mamba1" else None
    ctx = model.head_groups(groups) if groups else contextlib.nullcontext()
    with ctx:
        view = head_view(model)
        scores = prefix_matching_scores(model, n_tokens=n, n_samples=2, seed=5, heads=heads)
        tokens = repeated_tokens(
            [i for i in range(len(model.tokenizer)) if i not in model.tokenizer.all_special_ids],
            n, 2, 5, None,
        )  # fmt: skip
        names = [view[layer].pattern_hook for layer, _ in heads]
        _, cache = model.run_with_cache(tokens, names_filter=names)
        expected = []
        for layer, h in heads:
            pattern = cache[view[layer].pattern_hook]
            w = head_patterns(pattern.abs(), view[layer])[:, h].double()
            w = torch.tril(w) / torch.tril(w).sum(-1, keepdim=True)
            q = torch.arange(n, 2 * n)
            expected.append(float(w[:, q, q - n + 1].mean()))
    assert scores.prefix_matching.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_refuses_more_tokens_than_the_vocabulary_and_unknown_heads():
    model = toy_gna_model()
    with pytest.raises(InterventionError, match=r"n_tokens=100000 .*Fix: n_tokens <= \d+"):
        prefix_matching_scores(model, n_tokens=100_000)
    scores = prefix_matching_scores(model, n_tokens=4, n_samples=1)
    with pytest.raises(InterventionError, match=r"head \(5, 0\) was not scored"):
        scores.score((5, 0))


@pytest.mark.parametrize("kind", ["word", "byte_bpe"])
def test_a_copying_oracle_solves_the_question_template_and_guesses_on_facts(kind):
    """Issue 39: the facts template is induction-proof only while copying scores chance on it;
    a template change that lets copying work there fails here."""
    from gna_lens.stats import wilson_interval
    from gna_lens.tasks import copying_oracle

    tok = tokenizer(kind, False)
    kw = dict(n_pairs=6, n_samples=120, values="words", words=KEYS, seed=5)
    question = kv_retrieval(tok, template="question", **kw)
    assert all(copying_oracle(question))  # 100%: copying answers it
    facts = kv_retrieval(tok, template=PROOF, **kw)
    hits = sum(copying_oracle(facts))
    acc = wilson_interval(hits, len(facts))
    assert acc.low <= facts.chance <= acc.high, (acc, facts.chance)
